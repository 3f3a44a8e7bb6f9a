//! The first dense layer on a sparse data batch (issue 11): MNIST images are ~80% exact zeros
//! (background pixels, also after `pixel / 255`), and a zero input contributes exactly nothing
//! to `H = X W1` or to `dW1 = Xᵀ dH`. So when the batch is sparse enough, the first layer
//!
//! - forward: for each example `b` and each nonzero `x[b, i]`, adds `x[b, i] * W1[i, :]` to
//!   `h[b, :]` (a row-wide axpy: 8 four-lane accumulators over 32 columns at a time);
//! - weight gradient: for each input `i`, `dW1[i, :] = Σ_b x[b, i] dH[b, :]` over the examples
//!   where `x[b, i]` is nonzero (the batch's nonzeros by column, built once per step); a row of
//!   `dW1` whose input is zero in the whole batch is written as exact zeros, so the gradient
//!   stays a full vector.
//!
//! The first layer needs no input gradient, so nothing else changes. [`SparseInput`] chooses:
//! [`SparseInput::Auto`] (the default) measures the batch's density (nonzeros / entries) and
//! takes this path at or below [`MAX_DENSITY`], else the dense GEMM (a normalised batch,
//! `--normalize MEAN/STD`, has no zeros left: dense); a CNN's first layer is a convolution and
//! never takes it.
//!
//! Exactness: the sums use the load-splat kernel's lanes ([`super::gemm`]: `mul` + `add`, or
//! `f32x4.relaxed_madd` in a relaxed-SIMD build), start from zero, add the products in the
//! same order (increasing input index; increasing example index for the weight gradient) and
//! are cut into the same depth passes of `KC` before being added to the output. Skipping a
//! zero product changes a running sum only when that sum is `-0.0` (`-0 + 0 = +0`), so the
//! result equals load-splat's dense product bit for bit up to the sign of a zero, as long as
//! the weights and deltas are finite (a dense product would turn `0 * inf` into NaN; the
//! shards refuse non-finite parameters). Against `matrixmultiply` (FMA natively) it agrees
//! within float tolerance, like load-splat itself. The unit tests compare both.

use super::gemm::{lanes, KC};
use std::sync::atomic::{AtomicU8, Ordering};

/// Largest batch density (nonzeros / entries) at which [`SparseInput::Auto`] takes the sparse
/// path, per target, where the measured costs cross (docs/benchmarks.md, issue 11, "Sparse
/// first layer": `loss_and_grad` of the MLP across densities). In wasm (SIMD128, 4 lanes
/// either way) the sparse step is still faster at 0.5; natively the dense GEMM is
/// `matrixmultiply`'s 8-lane AVX2/FMA kernel and the 4-lane sparse sums stop paying at about
/// 0.25-0.3. MNIST's `pixel / 255` batches (~0.19) go sparse on both; a normalised batch
/// (`--normalize MEAN/STD`, density ~1) stays on the dense GEMM.
pub const MAX_DENSITY: f64 = if cfg!(target_arch = "wasm32") {
    0.5
} else {
    0.25
};

/// When the first dense layer skips the batch's zero inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SparseInput {
    /// Always the dense GEMM.
    Off,
    /// Sparse when the batch's density is at most [`MAX_DENSITY`] (0.5 in wasm, 0.25
    /// natively), else dense.
    Auto,
    /// Sparse for every batch (tests and benchmarks: its cost on dense batches).
    On,
}

impl SparseInput {
    /// Every choice, in the order benchmarks list them.
    pub const ALL: &'static [SparseInput] = &[SparseInput::Off, SparseInput::Auto, SparseInput::On];

    /// `off`, `auto`, `on`.
    pub fn name(self) -> &'static str {
        match self {
            SparseInput::Off => "off",
            SparseInput::Auto => "auto",
            SparseInput::On => "on",
        }
    }

    /// The choice called `name` ([`SparseInput::name`]).
    pub fn from_name(name: &str) -> Option<SparseInput> {
        SparseInput::ALL.iter().copied().find(|s| s.name() == name)
    }

    /// True when a batch of `nonzeros` out of `entries` goes the sparse way.
    pub fn takes(self, nonzeros: usize, entries: usize) -> bool {
        match self {
            SparseInput::Off => false,
            SparseInput::On => true,
            SparseInput::Auto => nonzeros as f64 <= MAX_DENSITY * entries as f64,
        }
    }
}

impl std::fmt::Display for SparseInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `u8::MAX`: not chosen, [`SparseInput::Auto`].
static DEFAULT: AtomicU8 = AtomicU8::new(u8::MAX);

/// The choice new workspaces make ([`SparseInput::Auto`] unless [`set_default_sparse_input`]
/// said otherwise).
pub fn default_sparse_input() -> SparseInput {
    match DEFAULT.load(Ordering::Relaxed) {
        0 => SparseInput::Off,
        2 => SparseInput::On,
        _ => SparseInput::Auto,
    }
}

/// Makes `choice` the one new workspaces make (benchmarks: the browser worker builds its
/// workspace inside the core worker).
pub fn set_default_sparse_input(choice: SparseInput) {
    let v = match choice {
        SparseInput::Off => 0,
        SparseInput::Auto => 1,
        SparseInput::On => 2,
    };
    DEFAULT.store(v, Ordering::Relaxed);
}

/// The batch's nonzeros by example (for the forward pass) and by input (for the weight
/// gradient). They grow to the largest batch's nonzeros once, so steps do not allocate after
/// the first.
#[derive(Debug, Clone, Default)]
pub struct Nonzeros {
    /// Input index of each nonzero, example by example.
    col: Vec<u32>,
    /// Its value.
    val: Vec<f32>,
    /// End of each example's nonzeros in `col` / `val`.
    row_end: Vec<usize>,
    /// Nonzeros of the batch kept for the weight gradient.
    len: usize,
    /// Start of each input's nonzeros in `by_col_row` / `by_col_val` (`fan_in + 1` entries).
    col_start: Vec<u32>,
    /// Example index of each nonzero, input by input (increasing examples within an input).
    by_col_row: Vec<u32>,
    /// Its value.
    by_col_val: Vec<f32>,
}

impl Nonzeros {
    /// Floats and indices held (for tests of "no growth after the first step").
    pub fn capacity(&self) -> usize {
        self.col.capacity()
            + self.val.capacity()
            + self.row_end.capacity()
            + self.col_start.capacity()
            + self.by_col_row.capacity()
            + self.by_col_val.capacity()
    }
}

/// Nonzero entries of `x` (NaN counts as nonzero: it must reach the output as in a dense
/// product).
pub fn count_nonzeros(x: &[f32]) -> usize {
    // Branch-free, so it vectorises: ~1 µs for a 32 x 784 batch.
    x.iter().map(|&v| usize::from(v != 0.0)).sum()
}

/// `out[b, :] += Σ_i x[b, i] W[i, :]` over the nonzero `x[b, i]`, for the `rows` examples of
/// row-major `x` (`rows x fan_in`, with `nonzeros` nonzero entries, [`count_nonzeros`]) and
/// row-major `w` (`fan_in x n`); `out` (`rows x n`) holds the bias already. When `keep`, the
/// batch's nonzeros stay in `nz` for [`weight_grad`].
#[allow(clippy::too_many_arguments)]
pub fn forward(
    nz: &mut Nonzeros,
    x: &[f32],
    rows: usize,
    fan_in: usize,
    nonzeros: usize,
    w: &[f32],
    n: usize,
    out: &mut [f32],
    keep: bool,
) {
    debug_assert_eq!(x.len(), rows * fan_in);
    debug_assert_eq!(w.len(), fan_in * n);
    debug_assert_eq!(out.len(), rows * n);
    // Evaluation batches can be large: without `keep`, one example's nonzeros at a time.
    // One row of slack: the gather below writes every entry and advances past nonzeros only.
    let need = if keep { nonzeros + fan_in } else { fan_in };
    if nz.col.len() < need {
        nz.col.resize(need, 0);
        nz.val.resize(need, 0.0);
    }
    nz.row_end.clear();
    let mut end = 0;
    for (xr, or) in x
        .chunks_exact(fan_in)
        .zip(out.chunks_exact_mut(n))
        .take(rows)
    {
        let start = if keep { end } else { 0 };
        // Branch-free compaction: the zeros of a batch are not predictable.
        let (cols, vals) = (
            &mut nz.col[start..start + fan_in],
            &mut nz.val[start..start + fan_in],
        );
        let mut k = 0;
        // Groups of 8 that are all zero (MNIST's background) are skipped with one test.
        let mut i0 = 0;
        for group in xr.chunks(8) {
            let any = group.iter().fold(false, |a, &v| a | (v != 0.0));
            if any {
                for (i, &v) in (i0..).zip(group) {
                    cols[k] = i as u32;
                    vals[k] = v;
                    // (k <= i < fan_in: the bounds check never fails and is predicted.)
                    k += usize::from(v != 0.0);
                }
            }
            i0 += group.len();
        }
        end = start + k;
        nz.row_end.push(end);
        axpys(&nz.col[start..end], &nz.val[start..end], w, n, or, true);
    }
    nz.len = if keep { end } else { 0 };
}

/// `gw = Xᵀ dH` (`fan_in x n`, overwritten) from the nonzeros [`forward`] kept (with `keep`)
/// and `delta` (`rows x n`, row-major).
pub fn weight_grad(nz: &mut Nonzeros, fan_in: usize, delta: &[f32], n: usize, gw: &mut [f32]) {
    debug_assert_eq!(gw.len(), fan_in * n);
    // Counting sort of the nonzeros by input; within an input they stay in example order.
    nz.col_start.clear();
    nz.col_start.resize(fan_in + 1, 0);
    let total = nz.len;
    for &c in &nz.col[..total] {
        nz.col_start[c as usize + 1] += 1;
    }
    for i in 0..fan_in {
        nz.col_start[i + 1] += nz.col_start[i];
    }
    nz.by_col_row.resize(total, 0);
    nz.by_col_val.resize(total, 0.0);
    let mut next: &mut [u32] = &mut nz.col_start[..fan_in];
    let mut begin = 0;
    for (b, &end) in nz.row_end.iter().enumerate() {
        for p in begin..end {
            let c = nz.col[p] as usize;
            let slot = next[c] as usize;
            nz.by_col_row[slot] = b as u32;
            nz.by_col_val[slot] = nz.val[p];
            next[c] += 1;
        }
        begin = end;
    }
    // `next[i]` is now the end of input i, i.e. the start of input i + 1: shift back.
    next = &mut nz.col_start[..];
    for i in (1..=fan_in).rev() {
        next[i] = next[i - 1];
    }
    next[0] = 0;
    for (i, row) in gw.chunks_exact_mut(n).enumerate() {
        let (s, e) = (nz.col_start[i] as usize, nz.col_start[i + 1] as usize);
        if s == e {
            row.fill(0.0);
        } else {
            axpys(
                &nz.by_col_row[s..e],
                &nz.by_col_val[s..e],
                delta,
                n,
                row,
                false,
            );
        }
    }
}

/// `out[:] (+)= Σ_p val[p] * m[idx[p], :]` with `m` row-major `? x n`, `idx` increasing: each
/// depth pass of `KC` indices is summed from zero in registers, then added to `out`; with
/// `add` false the first pass overwrites `out` instead (load-splat's `beta` 1 and 0).
fn axpys(idx: &[u32], val: &[f32], m: &[f32], n: usize, out: &mut [f32], add: bool) {
    let mut j0 = 0;
    while j0 + 32 <= n {
        columns::<8>(idx, val, m, n, j0, out, add);
        j0 += 32;
    }
    while j0 + 4 <= n {
        columns::<1>(idx, val, m, n, j0, out, add);
        j0 += 4;
    }
    if j0 < n {
        // A last partial vector: padded with zeros like load-splat's packed panel.
        let w = n - j0;
        let mut p = 0;
        let mut first = !add;
        while p < idx.len() {
            let pass_end = (idx[p] as usize / KC + 1) * KC;
            let mut acc = lanes::zero();
            while p < idx.len() && (idx[p] as usize) < pass_end {
                let o = idx[p] as usize * n + j0;
                let mut pad = [0.0f32; 4];
                pad[..w].copy_from_slice(&m[o..o + w]);
                acc = lanes::madd(lanes::splat(val[p]), lanes::load(&pad), acc);
                p += 1;
            }
            let a = lanes::to_array(acc);
            for (o, &v) in out[j0..n].iter_mut().zip(&a) {
                *o = if first { v } else { v + *o };
            }
            first = false;
        }
    }
}

/// [`axpys`] on columns `j0..j0 + 4 V` with `V` vector accumulators.
#[inline(always)]
fn columns<const V: usize>(
    idx: &[u32],
    val: &[f32],
    m: &[f32],
    n: usize,
    j0: usize,
    out: &mut [f32],
    add: bool,
) {
    let mut p = 0;
    let mut first = !add;
    while p < idx.len() {
        let pass_end = (idx[p] as usize / KC + 1) * KC;
        let mut acc = [lanes::zero(); V];
        while p < idx.len() && (idx[p] as usize) < pass_end {
            let x = lanes::splat(val[p]);
            let o = idx[p] as usize * n + j0;
            let row = &m[o..o + 4 * V];
            for (v, a) in acc.iter_mut().enumerate() {
                *a = lanes::madd(x, lanes::load(&row[4 * v..4 * v + 4]), *a);
            }
            p += 1;
        }
        let dst = &mut out[j0..j0 + 4 * V];
        for (v, a) in acc.iter().enumerate() {
            let a = lanes::to_array(*a);
            for (o, &x) in dst[4 * v..4 * v + 4].iter_mut().zip(&a) {
                *o = if first { x } else { x + *o };
            }
        }
        first = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{encode_idx, Dataset, Normalize};
    use crate::model::{Gemm, Model, ModelSpec, Workspace};
    use crate::rng::Rng;
    use ndarray::Array2;

    /// A batch where a fraction `zeros` of the entries are exactly zero, the rest like
    /// `pixel / 255` (MNIST has ~0.81 zeros).
    fn batch(rows: usize, cols: usize, zeros: f64, seed: u64) -> (Array2<f32>, Vec<u8>) {
        let mut r = Rng::new(seed);
        let x = Array2::from_shape_fn((rows, cols), |_| {
            if r.next_f64() < zeros {
                0.0
            } else {
                (1 + r.below(255)) as f32 / 255.0
            }
        });
        let y = (0..rows).map(|_| r.below(10) as u8).collect();
        (x, y)
    }

    /// Loss and gradient of `m` at `p` on `x`, `y` with `kernel` and `choice`, and whether the
    /// first layer went sparse.
    fn step(
        m: &Model,
        p: &[f32],
        x: &Array2<f32>,
        y: &[u8],
        kernel: Gemm,
        choice: SparseInput,
        ws: Option<&mut Workspace>,
    ) -> (f64, Vec<f32>, bool) {
        let mut own = m.workspace(x.nrows());
        let ws = ws.unwrap_or(&mut own);
        ws.set_gemm(kernel);
        ws.set_sparse_input(choice);
        let before = ws.sparse_passes();
        let mut g = vec![f32::NAN; p.len()];
        let s = m
            .loss_and_grad_seeded(p, x.view(), y, 3, &mut g, ws)
            .unwrap();
        (s.loss_sum, g, ws.sparse_passes() > before)
    }

    fn close(a: &[f32], b: &[f32], what: &str) {
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-4 * (y.abs() + 1e-3 * scale),
                "{what}[{i}]: {x} vs {y}"
            );
        }
    }

    /// The sparse first layer against the dense one: bit for bit against load-splat (same
    /// lanes, order and depth passes; `==` also equates the sign of zero), within tolerance
    /// against matrixmultiply. Models: the MNIST MLP (784 inputs: 4 depth passes, 128 = 4
    /// full column blocks), softmax (10 outputs: a partial vector), odd widths with dropout,
    /// a batch of 300 rows (the weight gradient's sums over examples cross a depth pass), and
    /// densities from all-zero to none.
    #[test]
    fn sparse_first_layer_equals_the_dense_one() {
        let cases: [(&str, usize, usize, f64); 7] = [
            ("mlp:128", 784, 32, 0.81),
            ("mlp:128", 784, 1, 0.5),
            ("softmax", 784, 7, 0.81),
            ("dense:37,dropout:0.3,dense:5", 23, 9, 0.6),
            ("mlp:13", 20, 300, 0.7),
            ("mlp:128", 784, 32, 1.0),
            ("mlp:40", 50, 16, 0.0),
        ];
        for (k, &(text, inputs, rows, zeros)) in cases.iter().enumerate() {
            let m = Model::new(ModelSpec::parse(text, inputs, 10).unwrap()).unwrap();
            let mut p = m.init_params(k as u64);
            // Nonzero biases, so "bias + sum" is exercised.
            p.iter_mut().rev().take(10).for_each(|v| *v = 0.25);
            let (x, y) = batch(rows, inputs, zeros, 10 + k as u64);
            let what = format!("{text} {rows}x{inputs} zeros {zeros}");
            let (dl, dg, dense_sparse) =
                step(&m, &p, &x, &y, Gemm::LoadSplat, SparseInput::Off, None);
            let (sl, sg, went) = step(&m, &p, &x, &y, Gemm::LoadSplat, SparseInput::On, None);
            assert!(!dense_sparse && went, "{what}");
            assert_eq!(sl.to_bits(), dl.to_bits(), "{what}: loss");
            for (i, (a, b)) in sg.iter().zip(&dg).enumerate() {
                assert!(a == b, "{what}: grad[{i}] {a} vs {b}");
            }
            let (ml, mg, _) = step(&m, &p, &x, &y, Gemm::MatrixMultiply, SparseInput::Off, None);
            let (sml, smg, _) = step(&m, &p, &x, &y, Gemm::MatrixMultiply, SparseInput::On, None);
            assert!((sml - ml).abs() <= 1e-5 * ml.abs(), "{what}: {sml} vs {ml}");
            close(&smg, &mg, &what);
            close(&sg, &mg, &what);
            // A weight row whose input is zero in the whole batch gets exact zeros.
            let fan_out = m.layout().tensors[0].shape[1];
            for i in 0..inputs {
                if x.column(i).iter().all(|&v| v == 0.0) {
                    assert!(sg[i * fan_out..(i + 1) * fan_out].iter().all(|&g| g == 0.0));
                }
            }
            assert!(
                sg.iter().all(|g| g.is_finite()),
                "{what}: every entry written"
            );
        }
    }

    /// Auto takes the sparse path on a `pixel / 255` batch (MNIST's zeros) and the dense
    /// GEMM on the same images normalised with `--normalize 0.1307/0.3081` (zeros become
    /// -0.42): same gradients as Off either way. The same workspace goes through both, so a
    /// dense batch after a sparse one does not reuse stale nonzeros.
    #[test]
    fn auto_is_sparse_on_mnist_pixels_and_dense_when_normalised() {
        let n = 64;
        let mut r = Rng::new(4);
        let pixels: Vec<u8> = (0..n * 784)
            .map(|j| {
                // A centred blob of strokes on a black background, like MNIST.
                let (row, col) = ((j % 784) / 28, j % 28);
                let inside = (6..22).contains(&row) && (8..20).contains(&col);
                if inside && r.below(3) > 0 {
                    r.below(256) as u8
                } else {
                    0
                }
            })
            .collect();
        let labels: Vec<u8> = (0..n).map(|i| (i % 10) as u8).collect();
        let idx: Vec<u32> = (0..32).collect();
        let load = |norm: Option<&str>| {
            let mut d = Dataset::from_idx(
                &encode_idx(&[n, 28, 28], &pixels),
                &encode_idx(&[n], &labels),
            )
            .unwrap();
            if let Some(t) = norm {
                d.set_normalize(&Normalize::parse(t).unwrap()).unwrap();
            }
            let mut x = Array2::zeros((32, 784));
            let mut y = vec![0u8; 32];
            d.fill_batch(&idx, &mut x.view_mut(), &mut y);
            (x, y)
        };
        let m = Model::new(ModelSpec::parse("mlp:128", 784, 10).unwrap()).unwrap();
        let p = m.init_params(7);
        let mut ws = m.workspace(32);
        assert_eq!(ws.sparse_input(), SparseInput::Auto, "the default");
        for (norm, sparse) in [(None, true), (Some("0.1307/0.3081"), false), (None, true)] {
            let (x, y) = load(norm);
            let density = count_nonzeros(x.as_slice().unwrap()) as f64 / x.len() as f64;
            assert_eq!(
                density <= MAX_DENSITY,
                sparse,
                "{norm:?}: density {density}"
            );
            for kernel in [Gemm::LoadSplat, Gemm::MatrixMultiply] {
                let (al, ag, went) = step(&m, &p, &x, &y, kernel, SparseInput::Auto, Some(&mut ws));
                assert_eq!(went, sparse, "{norm:?} {kernel}: density {density}");
                let (dl, dg, _) = step(&m, &p, &x, &y, kernel, SparseInput::Off, None);
                if kernel == Gemm::LoadSplat || !sparse {
                    assert_eq!(al.to_bits(), dl.to_bits(), "{norm:?} {kernel}");
                    assert!(ag.iter().zip(&dg).all(|(a, b)| a == b), "{norm:?}");
                } else {
                    assert!((al - dl).abs() <= 1e-5 * dl.abs(), "{al} vs {dl}");
                    close(&ag, &dg, "auto vs off, matrixmultiply");
                }
                // Forced sparse on the normalised batch is still the same product.
                let (_, og, _) = step(&m, &p, &x, &y, kernel, SparseInput::On, Some(&mut ws));
                close(&og, &dg, "on vs off");
            }
        }
        // The buffers grew on the first batches and do not grow on a batch no denser.
        let len = ws.sparse_buffer_len();
        let (x, y) = load(None);
        step(
            &m,
            &p,
            &x,
            &y,
            Gemm::LoadSplat,
            SparseInput::Auto,
            Some(&mut ws),
        );
        assert_eq!(ws.sparse_buffer_len(), len);
    }

    /// A CNN's first layer is a convolution: every choice gives the same gradient and no
    /// sparse pass, though the batch is sparse.
    #[test]
    fn cnn_is_unaffected() {
        let m = Model::new(ModelSpec::parse_shaped("cnn", &[28, 28], 10).unwrap()).unwrap();
        let p = m.init_params(2);
        let (x, y) = batch(4, 784, 0.81, 5);
        let (l0, g0, _) = step(&m, &p, &x, &y, Gemm::LoadSplat, SparseInput::Off, None);
        for choice in [SparseInput::Auto, SparseInput::On] {
            let (l, g, went) = step(&m, &p, &x, &y, Gemm::LoadSplat, choice, None);
            assert!(!went);
            assert_eq!((l.to_bits(), g), (l0.to_bits(), g0.clone()));
        }
    }

    /// Evaluation takes the sparse path too (one example's nonzeros at a time, so a large
    /// inference workspace holds at most one row of them) with the same loss and accuracy;
    /// a NaN input reaches the loss as in the dense product.
    #[test]
    fn evaluation_and_nan_inputs() {
        let m = Model::new(ModelSpec::parse("mlp:32", 784, 10).unwrap()).unwrap();
        let p = m.init_params(1);
        let (mut x, y) = batch(500, 784, 0.81, 6);
        let mut ws = m.inference_workspace(500);
        ws.set_gemm(Gemm::LoadSplat);
        ws.set_sparse_input(SparseInput::Off);
        let dense = m.evaluate(&p, x.view(), &y, &mut ws).unwrap();
        ws.set_sparse_input(SparseInput::Auto);
        let sparse = m.evaluate(&p, x.view(), &y, &mut ws).unwrap();
        assert_eq!(ws.sparse_passes(), 1);
        assert_eq!(sparse, dense);
        assert!(
            ws.sparse_buffer_len() <= 3 * 784 + 2 * 512,
            "{}",
            ws.sparse_buffer_len()
        );
        // (ReLU's `max` turns a NaN pre-activation into 0, so look at the gradient.)
        x[[3, 400]] = f32::NAN;
        let (l, g, went) = step(&m, &p, &x, &y, Gemm::LoadSplat, SparseInput::Auto, None);
        let (dl, dg, _) = step(&m, &p, &x, &y, Gemm::LoadSplat, SparseInput::Off, None);
        assert!(went);
        assert_eq!(l.to_bits(), dl.to_bits());
        let nans = |g: &[f32]| g.iter().filter(|v| v.is_nan()).count();
        assert!(
            nans(&g) > 0 && nans(&g) == nans(&dg),
            "{} vs {}",
            nans(&g),
            nans(&dg)
        );
    }

    #[test]
    fn names_round_trip_and_auto_cuts_at_max_density() {
        for &s in SparseInput::ALL {
            assert_eq!(SparseInput::from_name(s.name()), Some(s));
        }
        assert_eq!(SparseInput::from_name("sometimes"), None);
        let cut = (MAX_DENSITY * 100.0) as usize;
        assert!(SparseInput::Auto.takes(cut, 100) && !SparseInput::Auto.takes(cut + 1, 100));
        assert!(SparseInput::On.takes(100, 100) && !SparseInput::Off.takes(0, 100));
        assert_eq!(count_nonzeros(&[0.0, -0.0, 1.0, f32::NAN, -2.0]), 3);
    }
}
