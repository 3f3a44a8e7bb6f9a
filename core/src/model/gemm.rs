//! The matrix products of the model, `C = A B + beta C` (beta 0 or 1), behind one switch:
//!
//! - [`Gemm::MatrixMultiply`]: `ndarray`'s `general_mat_mul`, i.e. `matrixmultiply`. Natively it
//!   picks its AVX2/FMA kernel at run time. On wasm32 its SIMD128 8x8 kernel (ported from NEON,
//!   which has a lane FMA) spends a lane shuffle on every multiply-accumulate; built with
//!   `+relaxed-simd` it uses `f32x4.relaxed_madd`.
//! - [`Gemm::LoadSplat`]: our own kernel in the shape XNNPACK uses for wasm: B in 8-column
//!   panels (read in place when B is row-major and at most one block of `MC` rows of A passes
//!   over it, as in the MLP's batch of 32; packed once per depth pass otherwise), A read in
//!   place when row-major, packed a block of `MC` rows at a time when transposed and more than
//!   one B panel reads it (a partial last group of rows packed with zeros), and a 4x8
//!   micro-kernel that broadcasts each A scalar with one `v128.load32_splat` and multiply-adds
//!   it into two B vectors: 8 accumulators, no shuffle in the loop. Depth is cut in passes of
//!   `KC` (256) like `matrixmultiply`'s, so long sums round like its. On wasm32 with
//!   `simd128` the lanes are `v128` (and `f32x4.relaxed_madd` when the build has
//!   `+relaxed-simd`); elsewhere they are `[f32; 4]`, so native tests run the same blocking,
//!   packing and edge code.
//!
//! The kernel of a [`super::Workspace`] is [`default_kernel`] when it is made (the target's
//! best, or what [`set_default_kernel`] chose, for benchmarks) and [`super::Workspace::set_gemm`]
//! changes it. Packing buffers ([`Scratch`]) live in the workspace and only grow, so after the
//! first step a training step does not allocate.
//!
//! Both kernels sum each output's `k` products in the same order from zero and add `beta C`
//! after, but `matrixmultiply` uses FMA natively, so results agree within float tolerance, not
//! bit for bit (the parity tests compare them).

use ndarray::linalg::general_mat_mul;
use ndarray::{ArrayView2, ArrayViewMut2};
use std::sync::atomic::{AtomicU8, Ordering};

/// A GEMM implementation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Gemm {
    /// `matrixmultiply` through ndarray's `general_mat_mul`.
    MatrixMultiply,
    /// Our 4x8 load-splat micro-kernel with B in 8-wide panels.
    LoadSplat,
    /// The `gemm` crate (single-threaded; its SIMD128 kernels on wasm32), with the crate
    /// feature `gemm-crate` only: a benchmark candidate.
    #[cfg(feature = "gemm-crate")]
    GemmCrate,
}

impl Gemm {
    /// Every kernel of this build, in the order benchmarks list them.
    pub const ALL: &'static [Gemm] = &[
        Gemm::MatrixMultiply,
        Gemm::LoadSplat,
        #[cfg(feature = "gemm-crate")]
        Gemm::GemmCrate,
    ];

    /// The name used by benchmarks and tests: `matrixmultiply`, `loadsplat`, `gemm`.
    pub fn name(self) -> &'static str {
        match self {
            Gemm::MatrixMultiply => "matrixmultiply",
            Gemm::LoadSplat => "loadsplat",
            #[cfg(feature = "gemm-crate")]
            Gemm::GemmCrate => "gemm",
        }
    }

    /// The kernel called `name` ([`Gemm::name`]).
    pub fn from_name(name: &str) -> Option<Gemm> {
        Gemm::ALL.iter().copied().find(|g| g.name() == name)
    }

    /// The fastest kernel measured on this target (docs/benchmarks.md, "Browser worker"):
    /// load-splat on wasm32 with SIMD128, `matrixmultiply` (AVX2/FMA) natively.
    pub fn target_default() -> Gemm {
        if cfg!(all(target_arch = "wasm32", target_feature = "simd128")) {
            Gemm::LoadSplat
        } else {
            Gemm::MatrixMultiply
        }
    }

    /// True when this build runs the load-splat kernel on `v128` lanes (wasm32 + SIMD128), and
    /// with `f32x4.relaxed_madd` (`+relaxed-simd`).
    pub fn simd_lanes() -> (bool, bool) {
        (
            cfg!(all(target_arch = "wasm32", target_feature = "simd128")),
            cfg!(all(target_arch = "wasm32", target_feature = "relaxed-simd")),
        )
    }
}

impl std::fmt::Display for Gemm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `u8::MAX`: not chosen, [`Gemm::target_default`].
static DEFAULT: AtomicU8 = AtomicU8::new(u8::MAX);

/// The kernel new workspaces use.
pub fn default_kernel() -> Gemm {
    match DEFAULT.load(Ordering::Relaxed) {
        0 => Gemm::MatrixMultiply,
        1 => Gemm::LoadSplat,
        #[cfg(feature = "gemm-crate")]
        2 => Gemm::GemmCrate,
        _ => Gemm::target_default(),
    }
}

/// Makes `kernel` the one new workspaces use (benchmarks: the browser worker builds its
/// workspace inside the core worker).
pub fn set_default_kernel(kernel: Gemm) {
    let v = match kernel {
        Gemm::MatrixMultiply => 0,
        Gemm::LoadSplat => 1,
        #[cfg(feature = "gemm-crate")]
        Gemm::GemmCrate => 2,
    };
    DEFAULT.store(v, Ordering::Relaxed);
}

/// Rows of a micro-tile (A scalars broadcast per step of `k`).
const MR: usize = 4;
/// Columns of a micro-tile: two 4-lane vectors of B.
const NR: usize = 8;
/// Rows of A packed at once: `MC x KC` floats (32 KiB) stay in L2 while every B panel passes
/// over them, and one B panel (`KC x 8`, 8 KiB) stays in L1 across the `MC / MR` micro-panels.
///
/// In a `gpt` step (issue 20) packing B for every product of more than `MC` rows, and storing
/// full tiles as vectors, took the wasm step from 369 to 262 ms of CPU (V8, load ~9):
/// in place, the panels' rows are `ld` apart, and a transformer's power-of-two widths put
/// them in a few L1 sets.
const MC: usize = 32;
/// Depth of one pass: each output sums `KC` products in a register, then adds them to C
/// (like `matrixmultiply`'s `kc`), which bounds the packing buffers and keeps long sums (an
/// im2col weight gradient sums over every position of every example) as accurate as its.
/// The sparse first layer (`model/sparse.rs`) cuts its sums the same way.
pub(super) const KC: usize = 256;

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
pub(super) mod lanes {
    //! `v128` lanes. The intrinsics are safe functions here: the crate is built with
    //! `simd128` (and optionally `relaxed-simd`) enabled.
    use core::arch::wasm32::*;

    pub type F4 = v128;

    #[inline(always)]
    pub fn zero() -> F4 {
        f32x4_splat(0.0)
    }

    /// One `v128.load32_splat` when `x` comes from memory.
    #[inline(always)]
    pub fn splat(x: f32) -> F4 {
        f32x4_splat(x)
    }

    /// Four consecutive floats; LLVM merges the four loads into one `v128.load`.
    #[inline(always)]
    pub fn load(s: &[f32]) -> F4 {
        f32x4(s[0], s[1], s[2], s[3])
    }

    /// `a * b + c`: fused or not as the engine likes with relaxed SIMD, else mul then add.
    #[inline(always)]
    pub fn madd(a: F4, b: F4, c: F4) -> F4 {
        #[cfg(target_feature = "relaxed-simd")]
        {
            f32x4_relaxed_madd(a, b, c)
        }
        #[cfg(not(target_feature = "relaxed-simd"))]
        {
            f32x4_add(f32x4_mul(a, b), c)
        }
    }

    #[inline(always)]
    pub fn add(a: F4, b: F4) -> F4 {
        f32x4_add(a, b)
    }

    /// Writes the four lanes to `s[..4]`; LLVM makes it one `v128.store`.
    #[inline(always)]
    pub fn store(v: F4, s: &mut [f32]) {
        s[..4].copy_from_slice(&to_array(v));
    }

    #[inline(always)]
    pub fn to_array(v: F4) -> [f32; 4] {
        [
            f32x4_extract_lane::<0>(v),
            f32x4_extract_lane::<1>(v),
            f32x4_extract_lane::<2>(v),
            f32x4_extract_lane::<3>(v),
        ]
    }
}

#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
pub(super) mod lanes {
    //! Portable lanes: the same kernel as on wasm32, for native tests.
    pub type F4 = [f32; 4];

    #[inline(always)]
    pub fn zero() -> F4 {
        [0.0; 4]
    }

    #[inline(always)]
    pub fn splat(x: f32) -> F4 {
        [x; 4]
    }

    #[inline(always)]
    pub fn load(s: &[f32]) -> F4 {
        [s[0], s[1], s[2], s[3]]
    }

    #[inline(always)]
    pub fn madd(a: F4, b: F4, c: F4) -> F4 {
        [
            a[0] * b[0] + c[0],
            a[1] * b[1] + c[1],
            a[2] * b[2] + c[2],
            a[3] * b[3] + c[3],
        ]
    }

    #[inline(always)]
    pub fn add(a: F4, b: F4) -> F4 {
        [a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3]]
    }

    #[inline(always)]
    pub fn store(v: F4, s: &mut [f32]) {
        s[..4].copy_from_slice(&v);
    }

    #[inline(always)]
    pub fn to_array(v: F4) -> [f32; 4] {
        v
    }
}

use lanes::F4;

/// Packing buffers of the load-splat kernel; they grow to the largest product once.
#[derive(Debug, Clone, Default)]
pub struct Scratch {
    /// A last, partial micro-panel of A, packed with zero rows: `[p][row]`.
    a: Vec<f32>,
    /// B panels that cannot be read in place: `[panel][p][2 vectors]`.
    b: Vec<F4>,
}

impl Scratch {
    /// Floats held (for tests of "no growth after the first step").
    pub fn capacity(&self) -> usize {
        self.a.capacity() + 4 * self.b.capacity()
    }
}

/// A 2-D view as a slice and its row and column strides, for the two layouts the model uses:
/// row-major and its transpose.
fn raw<'a>(v: &ArrayView2<'a, f32>) -> Option<(&'a [f32], usize, usize)> {
    let (rows, cols) = v.dim();
    if let Some(s) = v.to_slice() {
        return Some((s, cols, 1));
    }
    (*v).reversed_axes().to_slice().map(|s| (s, 1, rows))
}

/// `c = a b + beta c` with `kernel`; `beta` is 0 (c is overwritten, never read) or 1.
///
/// The load-splat kernel needs `c` in standard layout and `a`, `b` row-major or transposed
/// row-major (every product of the model is); anything else goes to `matrixmultiply`.
pub(crate) fn gemm(
    kernel: Gemm,
    a: &ArrayView2<'_, f32>,
    b: &ArrayView2<'_, f32>,
    beta: f32,
    c: &mut ArrayViewMut2<'_, f32>,
    scratch: &mut Scratch,
) {
    debug_assert!(beta == 0.0 || beta == 1.0);
    debug_assert_eq!(a.ncols(), b.nrows());
    debug_assert_eq!((a.nrows(), b.ncols()), c.dim());
    #[cfg(feature = "gemm-crate")]
    if kernel == Gemm::GemmCrate {
        gemm_crate(a, b, beta, c);
        return;
    }
    if kernel == Gemm::LoadSplat {
        if let (Some(ar), Some(br)) = (raw(a), raw(b)) {
            let (m, n) = c.dim();
            if let Some(cs) = c.as_slice_mut() {
                load_splat(m, a.ncols(), n, ar, br, beta, cs, scratch);
                return;
            }
        }
    }
    general_mat_mul(1.0, a, b, beta, c);
}

/// `c = a b + beta c` through the `gemm` crate, which takes raw pointers and strides.
#[cfg(feature = "gemm-crate")]
#[allow(unsafe_code)]
fn gemm_crate(
    a: &ArrayView2<'_, f32>,
    b: &ArrayView2<'_, f32>,
    beta: f32,
    c: &mut ArrayViewMut2<'_, f32>,
) {
    let (m, k) = a.dim();
    let n = b.ncols();
    let (sa, sb) = (a.strides(), b.strides());
    let sc = [c.strides()[0], c.strides()[1]];
    let dst = c.as_mut_ptr();
    // SAFETY: each pointer and its strides are those of a live ndarray view of exactly
    // `m x k`, `k x n` and `m x n` elements, so every element gemm addresses is in bounds;
    // `c` is borrowed exclusively, so it overlaps neither `a` nor `b`; with `read_dst`
    // false (beta 0) gemm writes C without reading it, and it computes
    // `dst = alpha * dst + beta * lhs * rhs` with our beta as its alpha.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            sc[1],
            sc[0],
            beta != 0.0,
            a.as_ptr(),
            sa[1],
            sa[0],
            b.as_ptr(),
            sb[1],
            sb[0],
            beta,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// Where the micro-kernel reads B panel `jp` from.
enum PanelB<'a> {
    /// Row-major B, a full panel: row `p` is `b[p * ld + j0..][..8]`.
    InPlace { b: &'a [f32], ld: usize, j0: usize },
    /// Packed: `[p][2 vectors]`.
    Packed(&'a [F4]),
}

#[allow(clippy::too_many_arguments)]
fn load_splat(
    m: usize,
    k: usize,
    n: usize,
    (a, ars, acs): (&[f32], usize, usize),
    (b, brs, bcs): (&[f32], usize, usize),
    beta: f32,
    c: &mut [f32],
    s: &mut Scratch,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if beta == 0.0 {
            c.fill(0.0);
        }
        return;
    }
    let panels = n.div_ceil(NR);
    // Row-major B is read in place when one block of A rows passes over it (except a last,
    // partial panel); else it is packed, once per depth pass: every block of `MC` rows reads
    // all of it again, and its rows in place are `ld` apart, which for the power-of-two widths
    // of a transformer (`ld` = 128, 384, 512) falls in a few cache sets and leaves L1 between
    // micro-panels. Other layouts are always packed.
    let in_place = bcs == 1 && m <= MC;
    let packed_panels = if in_place {
        usize::from(!n.is_multiple_of(NR))
    } else {
        panels
    };
    let first_packed = panels - packed_panels;
    let kc_max = KC.min(k);
    let need_b = packed_panels * kc_max * 2;
    if s.b.len() < need_b {
        s.b.resize(need_b, lanes::zero());
    }
    // A transposed A (every weight gradient's, whose depth is the batch's rows) is packed a
    // block of `MC` rows at a time when more than one B panel passes over it: in place, each
    // step reads 4 values from a line `ld` apart, a few L1 sets for a power-of-two `ld`, and
    // every panel misses again; packed, a micro-panel is one contiguous run. A row-major A is
    // read in place (4 sequential rows; packing it cost more than it saved), with a partial
    // last micro-panel packed.
    let pack_block = panels > 1 && acs != 1;
    let need_a = if pack_block { MC } else { MR } * kc_max;
    if s.a.len() < need_a {
        s.a.resize(need_a, 0.0);
    }
    let mut pc = 0;
    while pc < k {
        let kc = KC.min(k - pc);
        // The first pass applies beta, the others add to what it wrote.
        let beta = if pc == 0 { beta } else { 1.0 };
        let (ak, bk) = (&a[pc * acs..], &b[pc * brs..]);
        for (q, jp) in (first_packed..panels).enumerate() {
            pack_b(
                &mut s.b[q * kc * 2..(q + 1) * kc * 2],
                bk,
                brs,
                bcs,
                kc,
                jp * NR,
                n,
            );
        }
        let mut i0 = 0;
        while i0 < m {
            let mc = MC.min(m - i0);
            let micro = mc.div_ceil(MR);
            if pack_block {
                pack_a(&mut s.a[..micro * MR * kc], ak, ars, acs, kc, i0, mc);
            }
            for jp in 0..panels {
                let j0 = jp * NR;
                let nr = NR.min(n - j0);
                let panel = if jp < first_packed {
                    PanelB::InPlace { b: bk, ld: brs, j0 }
                } else {
                    let q = jp - first_packed;
                    PanelB::Packed(&s.b[q * kc * 2..(q + 1) * kc * 2])
                };
                for ip in 0..micro {
                    let r0 = i0 + ip * MR;
                    let mr = MR.min(m - r0);
                    // A packed block is read from the packing buffer; otherwise full
                    // micro-panels read A where it is and a last, partial one is packed with
                    // zero rows (as are layouts with no unit stride, which the model does not
                    // make).
                    let source = if pack_block {
                        PanelA::Packed(&s.a[ip * MR * kc..(ip + 1) * MR * kc])
                    } else if mr == MR && acs == 1 {
                        PanelA::Rows(&ak[r0 * ars..], ars)
                    } else if mr == MR && ars == 1 {
                        PanelA::Columns(&ak[r0..], acs)
                    } else {
                        pack_a(&mut s.a[..MR * kc], ak, ars, acs, kc, r0, mr);
                        PanelA::Packed(&s.a[..MR * kc])
                    };
                    let acc = micro_tile(source, &panel, kc);
                    store(&acc, &mut c[r0 * n + j0..], n, mr, nr, beta);
                }
            }
            i0 += mc;
        }
        pc += kc;
    }
}

/// Where the micro-kernel reads its `MR` rows of A from.
enum PanelA<'a> {
    /// Row-major: row `r` is `a[r * ld..][..kc]`.
    Rows(&'a [f32], usize),
    /// Transposed: the `MR` values of step `p` are `a[p * ld..][..MR]`.
    Columns(&'a [f32], usize),
    /// Packed `[p][row]`.
    Packed(&'a [f32]),
}

/// One `MR x NR` tile over `kc` steps, for every pair of A and B sources.
#[inline(always)]
fn micro_tile(a: PanelA<'_>, b: &PanelB<'_>, kc: usize) -> [[F4; 2]; MR] {
    macro_rules! with_b {
        ($a:expr) => {
            match *b {
                PanelB::InPlace { b, ld, j0 } => tile(
                    $a,
                    b[j0..]
                        .chunks(ld)
                        .take(kc)
                        .map(|row| (lanes::load(&row[..4]), lanes::load(&row[4..8]))),
                ),
                PanelB::Packed(pb) => tile($a, pb.chunks_exact(2).map(|v| (v[0], v[1]))),
            }
        };
    }
    match a {
        PanelA::Rows(a, ld) => {
            let (r0, r1, r2, r3) = (
                &a[..kc],
                &a[ld..ld + kc],
                &a[2 * ld..2 * ld + kc],
                &a[3 * ld..3 * ld + kc],
            );
            with_b!(r0
                .iter()
                .zip(r1)
                .zip(r2)
                .zip(r3)
                .map(|(((&x0, &x1), &x2), &x3)| [x0, x1, x2, x3]))
        }
        PanelA::Columns(a, ld) => {
            with_b!(a.chunks(ld).take(kc).map(|c| [c[0], c[1], c[2], c[3]]))
        }
        PanelA::Packed(pa) => with_b!(pa.chunks_exact(MR).map(|c| [c[0], c[1], c[2], c[3]])),
    }
}

/// The 4x8 micro-kernel: for each `p`, four broadcasts of A times two vectors of B.
#[inline(always)]
fn tile(a: impl Iterator<Item = [f32; MR]>, bs: impl Iterator<Item = (F4, F4)>) -> [[F4; 2]; MR] {
    let z = lanes::zero();
    let mut acc = [[z; 2]; MR];
    for (av, (b0, b1)) in a.zip(bs) {
        for (r, acc) in acc.iter_mut().enumerate() {
            let x = lanes::splat(av[r]);
            acc[0] = lanes::madd(x, b0, acc[0]);
            acc[1] = lanes::madd(x, b1, acc[1]);
        }
    }
    acc
}

/// Writes the valid `mr x nr` corner of a tile to `c` (row stride `ldc`), adding `c` if `beta`
/// is 1. A full tile's rows are stored (and added) as whole vectors: lane by lane, the store
/// took as long as a 32-deep tile's products.
#[inline(always)]
fn store(acc: &[[F4; 2]; MR], c: &mut [f32], ldc: usize, mr: usize, nr: usize, beta: f32) {
    if nr == NR {
        for (r, v) in acc.iter().enumerate().take(mr) {
            let row = &mut c[r * ldc..r * ldc + NR];
            let (lo, hi) = row.split_at_mut(4);
            if beta == 0.0 {
                lanes::store(v[0], lo);
                lanes::store(v[1], hi);
            } else {
                lanes::store(lanes::add(v[0], lanes::load(lo)), lo);
                lanes::store(lanes::add(v[1], lanes::load(hi)), hi);
            }
        }
        return;
    }
    for (r, v) in acc.iter().enumerate().take(mr) {
        let (lo, hi) = (lanes::to_array(v[0]), lanes::to_array(v[1]));
        let row = &mut c[r * ldc..r * ldc + nr];
        for (j, out) in row.iter_mut().enumerate() {
            let x = if j < 4 { lo[j] } else { hi[j - 4] };
            *out = if beta == 0.0 { x } else { x + *out };
        }
    }
}

/// Packs rows `i0..i0 + mc` of A (`[i, p]` at `a[i * rs + p * cs]`) into `MR`-row
/// micro-panels `[panel][p][row]`, padding the last with zero rows.
fn pack_a(out: &mut [f32], a: &[f32], rs: usize, cs: usize, k: usize, i0: usize, mc: usize) {
    for (ip, panel) in out.chunks_exact_mut(MR * k).enumerate() {
        let r0 = i0 + ip * MR;
        let rows = MR.min(i0 + mc - r0);
        if cs == 1 {
            // Row-major: each row is contiguous; write it with stride MR.
            for r in 0..MR {
                let dst = panel[r..].iter_mut().step_by(MR);
                if r < rows {
                    let src = &a[(r0 + r) * rs..(r0 + r) * rs + k];
                    dst.zip(src).for_each(|(d, &v)| *d = v);
                } else {
                    dst.for_each(|d| *d = 0.0);
                }
            }
        } else if rs == 1 {
            // Transposed: the MR values of one p are contiguous. A full panel moves them as a
            // fixed-size array (one vector load and store; a copy of `rows` values was a
            // `memcpy` call per step on wasm32, 10% of a `gpt` step).
            let (steps, _) = panel.as_chunks_mut::<MR>();
            for (p, dst) in steps.iter_mut().enumerate() {
                let src = &a[p * cs + r0..];
                if rows == MR {
                    dst.copy_from_slice(&src[..MR]);
                } else {
                    for (r, d) in dst.iter_mut().enumerate() {
                        *d = if r < rows { src[r] } else { 0.0 };
                    }
                }
            }
        } else {
            for (p, dst) in panel.chunks_exact_mut(MR).enumerate() {
                for (r, d) in dst.iter_mut().enumerate() {
                    *d = if r < rows {
                        a[(r0 + r) * rs + p * cs]
                    } else {
                        0.0
                    };
                }
            }
        }
    }
}

/// Packs columns `j0..j0 + 8` of B (`[p, j]` at `b[p * rs + j * cs]`), zero past column `n`.
fn pack_b(out: &mut [F4], b: &[f32], rs: usize, cs: usize, k: usize, j0: usize, n: usize) {
    let nr = NR.min(n - j0);
    if cs == 1 && nr == NR {
        // Row-major, a full panel: two vector loads per step.
        for (p, dst) in out.chunks_exact_mut(2).enumerate().take(k) {
            let row = &b[p * rs + j0..p * rs + j0 + NR];
            dst[0] = lanes::load(&row[..4]);
            dst[1] = lanes::load(&row[4..]);
        }
        return;
    }
    let mut row = [0.0f32; NR];
    for (p, dst) in out.chunks_exact_mut(2).enumerate().take(k) {
        for (j, v) in row.iter_mut().enumerate() {
            *v = if j < nr {
                b[p * rs + (j0 + j) * cs]
            } else {
                0.0
            };
        }
        dst[0] = lanes::load(&row[..4]);
        dst[1] = lanes::load(&row[4..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;
    use ndarray::Array2;

    fn random(rows: usize, cols: usize, seed: u64) -> Array2<f32> {
        let mut r = Rng::new(seed);
        Array2::from_shape_fn((rows, cols), |_| r.normal() as f32)
    }

    /// Every layout the model uses (row-major, transposed), odd sizes on every edge (tails of
    /// MR, NR and MC), beta 0 with garbage in C and beta 1: load-splat equals matrixmultiply
    /// within float tolerance.
    #[test]
    fn load_splat_matches_matrixmultiply_on_every_layout_and_edge() {
        let mut scratch = Scratch::default();
        let shapes = [
            (1, 1, 1),
            (3, 5, 7),
            (4, 8, 8),
            (5, 9, 17),
            (32, 784, 128),
            (33, 31, 10),
            (70, 3, 9),
            (128, 32, 10),
            (6, 700, 9),
        ];
        for (i, &(m, k, n)) in shapes.iter().enumerate() {
            let seed = i as u64;
            let a = random(m, k, seed);
            let at = random(k, m, seed + 100);
            let b = random(k, n, seed + 200);
            let bt = random(n, k, seed + 300);
            let c0 = random(m, n, seed + 400);
            for (a, b) in [
                (a.view(), b.view()),
                (at.t(), b.view()),
                (a.view(), bt.t()),
                (at.t(), bt.t()),
            ] {
                for beta in [0.0, 1.0] {
                    let mut want = c0.clone();
                    general_mat_mul(1.0, &a, &b, beta, &mut want);
                    let nan = Array2::from_elem((m, n), f32::NAN);
                    let mut got = c0.clone();
                    for &kernel in &Gemm::ALL[1..] {
                        got.assign(if beta == 0.0 { &nan } else { &c0 });
                        gemm(kernel, &a, &b, beta, &mut got.view_mut(), &mut scratch);
                        for (g, w) in got.iter().zip(&want) {
                            assert!(
                                (g - w).abs() <= 1e-4 * (1.0 + w.abs()) * (k as f32).sqrt(),
                                "{kernel} {m}x{k}x{n} beta {beta}: {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
        // k = 0: beta 0 clears C, beta 1 leaves it.
        let a = Array2::<f32>::zeros((3, 0));
        let b = Array2::<f32>::zeros((0, 5));
        let mut c = Array2::from_elem((3, 5), 2.0f32);
        gemm(
            Gemm::LoadSplat,
            &a.view(),
            &b.view(),
            1.0,
            &mut c.view_mut(),
            &mut scratch,
        );
        assert!(c.iter().all(|&v| v == 2.0));
        gemm(
            Gemm::LoadSplat,
            &a.view(),
            &b.view(),
            0.0,
            &mut c.view_mut(),
            &mut scratch,
        );
        assert!(c.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn names_round_trip() {
        for &g in Gemm::ALL {
            assert_eq!(Gemm::from_name(g.name()), Some(g));
        }
        assert_eq!(Gemm::from_name("blas"), None);
        assert_eq!(Gemm::target_default(), Gemm::MatrixMultiply);
    }
}
