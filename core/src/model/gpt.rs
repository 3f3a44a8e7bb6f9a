//! The `gpt` language model: a character-level, decoder-only, pre-LayerNorm transformer
//! (GPT-2's shape), forward and backward on f32 over the same flat parameter vector, GEMM
//! switch and [`Workspace`] as the layer stacks. The architecture, tensor names and init are
//! those of `docs`' shared text (the PyTorch peer follows the same): per position `t`,
//! `x = tok_emb[tok_t] + pos_emb[t]`; per block `x += proj(attn(ln1(x)))`,
//! `x += mlp_proj(gelu(fc(ln2(x))))`; `logits = ln_f(x) W_head` (tied: `tok_embᵀ`); mean softmax
//! cross-entropy over all `B x T` positions.
//!
//! - An example is one row of `T + 1` token ids stored as exact f32 integers: inputs
//!   `tok[0..T]`, targets `tok[1..=T]`; the label vector is not read.
//! - Every matrix product goes through [`gemm::gemm`]: the projections over all `B x T` rows at
//!   once, attention's `q kᵀ`, `p v` and their backward per (example, head) on head-major
//!   copies of q, k and v (`[B][H][T][hd]`, so each operand is row-major or its transpose, which
//!   both kernels read in place). The causal mask is applied after the full `T x T` product
//!   (half of it is wasted; the products stay plain GEMMs).
//! - LayerNorm, the causal softmax and GELU (tanh form) are element-wise loops; their `exp` is
//!   [`exp`], a polynomial the compiler vectorises (SSE2 natively, SIMD128 on wasm32). These
//!   loops, the head-major copies and attention are functions kept out of line
//!   (`#[inline(never)]`: a call per block, nothing per value), so a profiler names each op,
//!   perf natively and V8's profiler in wasm (`worker-wasm/profile/profile-step.mjs`).
//! - Buffers ([`GptWorkspace`]) are sized once from the capacity. A training workspace keeps
//!   every block's activations for the backward pass; an inference one keeps one block's,
//!   reused, and at most [`EVAL_BUDGET`] floats: [`Model::evaluate`] cuts a larger batch into
//!   pieces that fit.
//!
//! Stages (for [`super::LayerTimes`]): `embed`, `block0`..`block{L-1}`, `head` (`ln_f` and the
//! logits); the loss is timed apart.

use super::gemm::{self, Gemm, Scratch};
use super::spec::SeqInfo;
use super::{tick, BatchStats, Clock, Model, ParamLayout, Workspace};
use crate::error::{Error, Result};
use crate::rng::Rng;
use ndarray::{ArrayView2, ArrayViewMut2};

/// LayerNorm's epsilon.
const EPS: f32 = 1e-5;
/// `sqrt(2 / pi)`, GELU's tanh form.
const GELU_C: f32 = 0.797_884_6;
/// Floats an inference workspace may hold: an evaluation of a larger batch runs in pieces.
pub const EVAL_BUDGET: usize = 1 << 24;
/// Most tokens one [`Model::generate`] call may produce.
pub const MAX_GENERATE: usize = 1 << 16;

/// Parameters of a model with `info`'s sizes (u128: checked against the limits before use).
pub(super) fn param_count(info: &SeqInfo) -> u128 {
    let (v, t, d, l) = (
        info.vocab as u128,
        info.context as u128,
        info.dim as u128,
        info.layers as u128,
    );
    let block = 12 * d * d + 13 * d;
    let head = if info.tied { 0 } else { d * v };
    v * d + t * d + l * block + 2 * d + head
}

/// Floats of per-block activations kept per row (position) for the backward pass.
fn block_floats_per_row(d: u128) -> u128 {
    // ln1 (xhat, out) + rstd, q/k/v, att_cat, ln2 (xhat, out) + rstd, fc and its sigmoid.
    2 * d + 1 + 3 * d + d + 2 * d + 1 + 4 * d + 4 * d
}

/// Floats a workspace holds per example (a training one with `train`).
pub(super) fn floats_per_example(info: &SeqInfo, train: bool) -> u128 {
    let (v, t, d, l, h) = (
        info.vocab as u128,
        info.context as u128,
        info.dim as u128,
        info.layers as u128,
        info.heads as u128,
    );
    let kept = if train { l } else { 1 };
    // Per row: the stream, qkv, att, gelu out, ln_f, logits; per block its kept rows and probs.
    let shared = d + 3 * d + d + 4 * d + 2 * d + 1 + v + 1;
    let grads = if train {
        d + d + 4 * d + 3 * d + 3 * d + d
    } else {
        0
    };
    t * (shared + grads + kept * block_floats_per_row(d)) + kept * h * t * t + t * t
}

/// The flat layout (names and order of the shared architecture text).
pub(super) fn layout(info: &SeqInfo) -> ParamLayout {
    let (v, t, d) = (info.vocab, info.context, info.dim);
    let mut l = ParamLayout::default();
    l.push("tok_emb.weight", vec![v, d]);
    l.push("pos_emb.weight", vec![t, d]);
    for i in 0..info.layers {
        let b = |n: &str| format!("block{i}.{n}");
        l.push(b("ln1.weight"), vec![d]);
        l.push(b("ln1.bias"), vec![d]);
        l.push(b("attn.qkv.weight"), vec![d, 3 * d]);
        l.push(b("attn.qkv.bias"), vec![3 * d]);
        l.push(b("attn.proj.weight"), vec![d, d]);
        l.push(b("attn.proj.bias"), vec![d]);
        l.push(b("ln2.weight"), vec![d]);
        l.push(b("ln2.bias"), vec![d]);
        l.push(b("mlp.fc.weight"), vec![d, 4 * d]);
        l.push(b("mlp.fc.bias"), vec![4 * d]);
        l.push(b("mlp.proj.weight"), vec![4 * d, d]);
        l.push(b("mlp.proj.bias"), vec![d]);
    }
    l.push("ln_f.weight", vec![d]);
    l.push("ln_f.bias", vec![d]);
    if !info.tied {
        l.push("head.weight", vec![d, v]);
    }
    l
}

/// Offsets of one block's tensors.
#[derive(Debug, Clone, Copy)]
struct BlockOffsets {
    ln1_w: usize,
    ln1_b: usize,
    qkv_w: usize,
    qkv_b: usize,
    proj_w: usize,
    proj_b: usize,
    ln2_w: usize,
    ln2_b: usize,
    fc_w: usize,
    fc_b: usize,
    mlp_w: usize,
    mlp_b: usize,
}

/// A compiled language model: its sizes and the offsets of its tensors.
#[derive(Debug, Clone)]
pub(super) struct Gpt {
    pub(super) info: SeqInfo,
    tok: usize,
    pos: usize,
    blocks: Vec<BlockOffsets>,
    lnf_w: usize,
    lnf_b: usize,
    /// `head.weight`, untied only.
    head: Option<usize>,
}

impl Gpt {
    /// The model of `info` over `layout` (made by [`layout`]).
    ///
    /// # Errors
    /// [`Error::Config`] when a tensor is missing from the layout.
    pub(super) fn new(info: SeqInfo, layout: &ParamLayout) -> Result<Self> {
        let at = |name: &str| {
            layout
                .get(name)
                .map(|t| t.offset)
                .ok_or_else(|| Error::Config(format!("layout has no tensor {name}")))
        };
        let blocks = (0..info.layers)
            .map(|i| {
                let b = |n: &str| at(&format!("block{i}.{n}"));
                Ok(BlockOffsets {
                    ln1_w: b("ln1.weight")?,
                    ln1_b: b("ln1.bias")?,
                    qkv_w: b("attn.qkv.weight")?,
                    qkv_b: b("attn.qkv.bias")?,
                    proj_w: b("attn.proj.weight")?,
                    proj_b: b("attn.proj.bias")?,
                    ln2_w: b("ln2.weight")?,
                    ln2_b: b("ln2.bias")?,
                    fc_w: b("mlp.fc.weight")?,
                    fc_b: b("mlp.fc.bias")?,
                    mlp_w: b("mlp.proj.weight")?,
                    mlp_b: b("mlp.proj.bias")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            info,
            tok: at("tok_emb.weight")?,
            pos: at("pos_emb.weight")?,
            blocks,
            lnf_w: at("ln_f.weight")?,
            lnf_b: at("ln_f.bias")?,
            head: if info.tied {
                None
            } else {
                Some(at("head.weight")?)
            },
        })
    }

    /// `embed`, `block0`.., `head`.
    pub(super) fn stage_names(&self) -> Vec<String> {
        let mut n = vec!["embed".to_string()];
        n.extend((0..self.info.layers).map(|i| format!("block{i}")));
        n.push("head".into());
        n
    }

    /// The init of the shared text, drawn from one stream in layout order: weight matrices
    /// and embeddings `N(0, 0.02)`, the residual projections `N(0, 0.02 / sqrt(2L))`, biases
    /// 0, LayerNorm gains 1.
    pub(super) fn init_params(&self, layout: &ParamLayout, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        let mut p = vec![0.0f32; layout.len()];
        let resid = 0.02 / (2.0 * self.info.layers as f64).sqrt();
        for t in &layout.tensors {
            let dst = &mut p[t.offset..t.offset + t.len()];
            let name = t.name.as_str();
            if name.ends_with(".bias") {
                continue;
            }
            if name.starts_with("ln") || name.contains(".ln") {
                dst.fill(1.0);
                continue;
            }
            let std = if name.ends_with("attn.proj.weight") || name.ends_with("mlp.proj.weight") {
                resid
            } else {
                0.02
            };
            for v in dst {
                *v = (rng.normal() * std) as f32;
            }
        }
        p
    }
}

/// LayerNorm's saved values: `xhat`, `1 / std` per row and the output.
#[derive(Debug, Clone, Default)]
struct Ln {
    xhat: Vec<f32>,
    rstd: Vec<f32>,
    out: Vec<f32>,
}

impl Ln {
    fn new(rows: usize, d: usize) -> Self {
        Self {
            xhat: vec![0.0; rows * d],
            rstd: vec![0.0; rows],
            out: vec![0.0; rows * d],
        }
    }
}

/// What one block keeps from its forward pass for its backward pass.
#[derive(Debug, Clone)]
struct BlockActs {
    ln1: Ln,
    /// q, k and v, head-major: `[3][B][H][T][hd]`.
    heads: Vec<f32>,
    /// Attention probabilities, `[B][H][T][T]` (zero above the diagonal).
    probs: Vec<f32>,
    /// The heads' outputs, concatenated: `[B * T, D]`.
    att_cat: Vec<f32>,
    ln2: Ln,
    /// `fc` before GELU, `[B * T, 4D]`.
    fc: Vec<f32>,
    /// GELU's `sigmoid(2u)` ([`gelu_forward`]), `[B * T, 4D]`.
    sg: Vec<f32>,
}

/// Buffers of a language model's passes, part of a [`Workspace`].
#[derive(Debug, Clone)]
pub(super) struct GptWorkspace {
    /// The model sizes it was made for.
    info: SeqInfo,
    /// Examples per pass.
    pub(super) capacity: usize,
    /// Token ids, `[B][T + 1]`.
    tokens: Vec<u32>,
    /// The residual stream, `[B * T, D]`, updated in place.
    x: Vec<f32>,
    /// One block's kept values per block (training), or one set reused (inference).
    blocks: Vec<BlockActs>,
    /// qkv before the head split, `[B * T, 3D]` (and its gradient in the backward pass).
    qkv: Vec<f32>,
    /// Heads' outputs, head-major (and their gradient in the backward pass).
    att: Vec<f32>,
    /// GELU's output, `[B * T, 4D]`.
    g: Vec<f32>,
    lnf: Ln,
    /// Logits `[B * T, V]`, then (training) their gradient, in place.
    logits: Vec<f32>,
    /// Training only: the stream's gradient `[B * T, D]`, a LayerNorm output's gradient, the
    /// MLP's hidden gradient `[B * T, 4D]`, head-major dq/dk/dv, and one `T x T` score
    /// gradient.
    dx: Vec<f32>,
    dln: Vec<f32>,
    dff: Vec<f32>,
    dheads: Vec<f32>,
    dp: Vec<f32>,
    train: bool,
}

impl GptWorkspace {
    /// Buffers for `capacity` examples (inference: at most [`EVAL_BUDGET`] floats).
    pub(super) fn new(info: SeqInfo, capacity: usize, train: bool) -> Self {
        let per = floats_per_example(&info, train).max(1);
        let capacity = if train {
            capacity.max(1)
        } else {
            let fit = (EVAL_BUDGET as u128 / per).max(1);
            capacity
                .max(1)
                .min(usize::try_from(fit).unwrap_or(usize::MAX))
        };
        let (t, d, v, h) = (info.context, info.dim, info.vocab, info.heads);
        let n = capacity * t;
        let kept = if train { info.layers } else { 1 };
        let z = |len: usize| vec![0.0f32; len];
        let grad = |len: usize| if train { z(len) } else { Vec::new() };
        let blocks = (0..kept)
            .map(|_| BlockActs {
                ln1: Ln::new(n, d),
                heads: z(3 * n * d),
                probs: z(capacity * h * t * t),
                att_cat: z(n * d),
                ln2: Ln::new(n, d),
                fc: z(n * 4 * d),
                sg: z(n * 4 * d),
            })
            .collect();
        Self {
            info,
            capacity,
            tokens: vec![0; capacity * (t + 1)],
            x: z(n * d),
            blocks,
            qkv: z(n * 3 * d),
            att: z(n * d),
            g: z(n * 4 * d),
            lnf: Ln::new(n, d),
            logits: z(n * v),
            dx: grad(n * d),
            dln: grad(n * d),
            dff: grad(n * 4 * d),
            dheads: grad(3 * n * d),
            dp: grad(t * t),
            train,
        }
    }
}

/// A row-major matrix over the first `r * c` values of `s`.
fn mat(s: &[f32], r: usize, c: usize) -> ArrayView2<'_, f32> {
    ArrayView2::from_shape((r, c), &s[..r * c]).expect("buffers are sized for the batch")
}

fn mat_mut(s: &mut [f32], r: usize, c: usize) -> ArrayViewMut2<'_, f32> {
    ArrayViewMut2::from_shape((r, c), &mut s[..r * c]).expect("buffers are sized for the batch")
}

/// The GEMM kernel and its packing buffers.
struct Mm<'a> {
    kernel: Gemm,
    scratch: &'a mut Scratch,
}

impl Mm<'_> {
    /// `c = a b + beta c`.
    fn mm(
        &mut self,
        a: &ArrayView2<'_, f32>,
        b: &ArrayView2<'_, f32>,
        beta: f32,
        c: &mut ArrayViewMut2<'_, f32>,
    ) {
        gemm::gemm(self.kernel, a, b, beta, c, self.scratch);
    }
}

/// Adds `bias` to every row of `out` (rows of `bias.len()`).
#[inline(never)]
fn add_bias(out: &mut [f32], bias: &[f32]) {
    for row in out.chunks_exact_mut(bias.len()) {
        row.iter_mut().zip(bias).for_each(|(o, b)| *o += b);
    }
}

/// `g = sum of the rows of m` (rows of `g.len()`).
#[inline(never)]
fn col_sum(m: &[f32], g: &mut [f32]) {
    g.fill(0.0);
    for row in m.chunks_exact(g.len()) {
        g.iter_mut().zip(row).for_each(|(g, v)| *g += v);
    }
}

/// LayerNorm of the rows of `x` (width `gamma.len()`): biased variance, [`EPS`].
#[inline(never)]
fn ln_forward(x: &[f32], gamma: &[f32], beta: &[f32], ln: &mut Ln, rows: usize) {
    let d = gamma.len();
    let inv_d = 1.0 / d as f32;
    for r in 0..rows {
        let xr = &x[r * d..(r + 1) * d];
        let mean = xr.iter().sum::<f32>() * inv_d;
        let var = xr.iter().map(|&v| (v - mean) * (v - mean)).sum::<f32>() * inv_d;
        let rstd = 1.0 / (var + EPS).sqrt();
        ln.rstd[r] = rstd;
        let xh = &mut ln.xhat[r * d..(r + 1) * d];
        let out = &mut ln.out[r * d..(r + 1) * d];
        for j in 0..d {
            xh[j] = (xr[j] - mean) * rstd;
            out[j] = gamma[j] * xh[j] + beta[j];
        }
    }
}

/// LayerNorm's backward: adds the input gradient to `dx`, writes `dgamma`, `dbeta`.
#[inline(never)]
fn ln_backward(
    dy: &[f32],
    ln: &Ln,
    gamma: &[f32],
    rows: usize,
    dx: &mut [f32],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
) {
    let d = gamma.len();
    let inv_d = 1.0 / d as f32;
    dgamma.fill(0.0);
    dbeta.fill(0.0);
    for r in 0..rows {
        let dyr = &dy[r * d..(r + 1) * d];
        let xh = &ln.xhat[r * d..(r + 1) * d];
        let (mut m1, mut m2) = (0.0f32, 0.0f32);
        for j in 0..d {
            let g = dyr[j] * gamma[j];
            m1 += g;
            m2 += g * xh[j];
            dgamma[j] += dyr[j] * xh[j];
            dbeta[j] += dyr[j];
        }
        let (m1, m2) = (m1 * inv_d, m2 * inv_d);
        let rstd = ln.rstd[r];
        let dxr = &mut dx[r * d..(r + 1) * d];
        for j in 0..d {
            dxr[j] += rstd * (dyr[j] * gamma[j] - m1 - xh[j] * m2);
        }
    }
}

/// `e^x` for f32, in a form the compiler turns into SIMD (SSE2 natively, SIMD128 on wasm32)
/// when it is called over a slice: Cephes' `expf` (a degree-6 polynomial on
/// `[-ln 2 / 2, ln 2 / 2]` and `2^n` built from the exponent bits), relative error under
/// 2e-7 on `[-87, 88]`, where the argument is clamped (`e^-87` is 1.6e-38: softmax and GELU
/// need nothing smaller). A NaN stays NaN. `f32::exp` is a libm call per value, which the
/// loops around it cannot vectorise: on wasm32 it took 9% of a `gpt` training step.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // 1.5 * 2^23: adding it rounds to an integer, which lands in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // `clamp` keeps a NaN (`max` / `min` would turn it into a bound).
    let x = x.clamp(-87.0, 88.0);
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^n: n sits in the low bits of t's mantissa; shifted into the exponent field.
    let pow2 = f32::from_bits((t.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127)) << 23);
    y * pow2
}

/// GELU (tanh form) of `h` into `g`, keeping `s = sigmoid(2u)` in `sg`.
///
/// `0.5 x (1 + tanh(u))` with `u = sqrt(2/pi) (x + 0.044715 x^3)` is exactly `x sigmoid(2u)`
/// (`1 + tanh(u) = 2 sigmoid(2u)`): one `exp` per value, where libm's `tanhf` (through
/// `expm1f`) took a quarter of a training step.
#[inline(never)]
fn gelu_forward(h: &[f32], sg: &mut [f32], g: &mut [f32]) {
    for ((&x, s), g) in h.iter().zip(sg.iter_mut()).zip(g.iter_mut()) {
        let u = GELU_C * (x + 0.044_715 * x * x * x);
        *s = 1.0 / (1.0 + exp(-2.0 * u));
        *g = x * *s;
    }
}

/// GELU's output again from its input and kept sigmoid (the backward pass's input of
/// `mlp.proj`).
#[inline(never)]
fn gelu_again(h: &[f32], sg: &[f32], g: &mut [f32]) {
    for ((&x, &s), g) in h.iter().zip(sg).zip(g.iter_mut()) {
        *g = x * s;
    }
}

/// `d *= gelu'(h)`, from the kept sigmoid: `s + 2 x s (1 - s) du/dx`.
#[inline(never)]
fn gelu_backward(h: &[f32], sg: &[f32], d: &mut [f32]) {
    for ((&x, &s), d) in h.iter().zip(sg).zip(d.iter_mut()) {
        let du = GELU_C * (1.0 + 3.0 * 0.044_715 * x * x);
        *d *= s + 2.0 * x * s * (1.0 - s) * du;
    }
}

/// Causal softmax in place of a `tn x tn` score matrix times `scale`: row `t` over `0..=t`
/// (stable: the row max subtracted), zero after.
#[inline(never)]
fn causal_softmax(p: &mut [f32], tn: usize, scale: f32) {
    for t in 0..tn {
        let row = &mut p[t * tn..(t + 1) * tn];
        let (seen, masked) = row.split_at_mut(t + 1);
        // A comparison, not `f32::max`: on wasm32 that is a call to libm's `fmaxf` per value.
        let max = seen
            .iter()
            .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
            * scale;
        seen.iter_mut().for_each(|v| *v = exp(*v * scale - max));
        let sum: f32 = seen.iter().sum();
        let inv = 1.0 / sum;
        seen.iter_mut().for_each(|v| *v *= inv);
        masked.fill(0.0);
    }
}

/// Softmax's backward in place: `dp` becomes the gradient of the unscaled scores,
/// `scale * p * (dp - sum_j p dp)` on the causal part, zero after.
#[inline(never)]
fn causal_softmax_backward(p: &[f32], dp: &mut [f32], tn: usize, scale: f32) {
    for t in 0..tn {
        let pr = &p[t * tn..t * tn + t + 1];
        let row = &mut dp[t * tn..(t + 1) * tn];
        let (seen, masked) = row.split_at_mut(t + 1);
        let dot: f32 = pr.iter().zip(seen.iter()).map(|(a, b)| a * b).sum();
        for (d, &pv) in seen.iter_mut().zip(pr) {
            *d = scale * pv * (*d - dot);
        }
        masked.fill(0.0);
    }
}

/// Sizes of one pass: `b` examples of `tn` positions (`tn <= T`), `h` heads of `hd`.
#[derive(Debug, Clone, Copy)]
struct Dims {
    b: usize,
    tn: usize,
    d: usize,
    h: usize,
    hd: usize,
}

impl Dims {
    fn rows(&self) -> usize {
        self.b * self.tn
    }

    /// Offset of (example, head)'s `tn x hd` block in a head-major buffer.
    fn head(&self, e: usize, h: usize) -> usize {
        (e * self.h + h) * self.tn * self.hd
    }
}

/// Columns `col0..col0 + D` of `src` (rows of `stride`) into head-major `dst`.
#[inline(never)]
fn to_heads(src: &[f32], stride: usize, col0: usize, dst: &mut [f32], k: Dims) {
    for e in 0..k.b {
        for t in 0..k.tn {
            let row = &src[(e * k.tn + t) * stride + col0..][..k.d];
            for h in 0..k.h {
                let o = k.head(e, h) + t * k.hd;
                dst[o..o + k.hd].copy_from_slice(&row[h * k.hd..(h + 1) * k.hd]);
            }
        }
    }
}

/// The inverse of [`to_heads`].
#[inline(never)]
fn from_heads(src: &[f32], dst: &mut [f32], stride: usize, col0: usize, k: Dims) {
    for e in 0..k.b {
        for t in 0..k.tn {
            let row = &mut dst[(e * k.tn + t) * stride + col0..][..k.d];
            for h in 0..k.h {
                let o = k.head(e, h) + t * k.hd;
                row[h * k.hd..(h + 1) * k.hd].copy_from_slice(&src[o..o + k.hd]);
            }
        }
    }
}

/// Attention forward of every (example, head): `probs = softmax(q kᵀ / sqrt(hd))` (causal),
/// `att = probs v`; `heads` is q, k, v head-major.
#[inline(never)]
fn attention_forward(mm: &mut Mm<'_>, heads: &[f32], probs: &mut [f32], att: &mut [f32], k: Dims) {
    let n = k.rows() * k.d;
    let (q, rest) = heads.split_at(n);
    let (kk, v) = rest.split_at(n);
    let scale = 1.0 / (k.hd as f32).sqrt();
    let tt = k.tn * k.tn;
    for e in 0..k.b {
        for h in 0..k.h {
            let o = k.head(e, h);
            let pi = (e * k.h + h) * tt;
            let p = &mut probs[pi..pi + tt];
            let qm = mat(&q[o..], k.tn, k.hd);
            let km = mat(&kk[o..], k.tn, k.hd);
            mm.mm(&qm, &km.t(), 0.0, &mut mat_mut(p, k.tn, k.tn));
            causal_softmax(p, k.tn, scale);
            let vm = mat(&v[o..], k.tn, k.hd);
            mm.mm(
                &mat(p, k.tn, k.tn),
                &vm,
                0.0,
                &mut mat_mut(&mut att[o..], k.tn, k.hd),
            );
        }
    }
}

/// Attention backward: from `datt` (head-major) to `dheads` (dq, dk, dv head-major).
#[inline(never)]
fn attention_backward(
    mm: &mut Mm<'_>,
    heads: &[f32],
    probs: &[f32],
    datt: &[f32],
    dheads: &mut [f32],
    dp: &mut [f32],
    k: Dims,
) {
    let n = k.rows() * k.d;
    let (q, rest) = heads.split_at(n);
    let (kk, v) = rest.split_at(n);
    let (dq, rest) = dheads.split_at_mut(n);
    let (dk, dv) = rest.split_at_mut(n);
    let scale = 1.0 / (k.hd as f32).sqrt();
    let tt = k.tn * k.tn;
    let dp = &mut dp[..tt];
    for e in 0..k.b {
        for h in 0..k.h {
            let o = k.head(e, h);
            let pi = (e * k.h + h) * tt;
            let p = mat(&probs[pi..], k.tn, k.tn);
            let dout = mat(&datt[o..], k.tn, k.hd);
            // dv = pᵀ dout, dp = dout vᵀ.
            mm.mm(&p.t(), &dout, 0.0, &mut mat_mut(&mut dv[o..], k.tn, k.hd));
            let vm = mat(&v[o..], k.tn, k.hd);
            mm.mm(&dout, &vm.t(), 0.0, &mut mat_mut(dp, k.tn, k.tn));
            causal_softmax_backward(&probs[pi..pi + tt], dp, k.tn, scale);
            // dq = ds k, dk = dsᵀ q.
            let ds = mat(dp, k.tn, k.tn);
            let km = mat(&kk[o..], k.tn, k.hd);
            mm.mm(&ds, &km, 0.0, &mut mat_mut(&mut dq[o..], k.tn, k.hd));
            let qm = mat(&q[o..], k.tn, k.hd);
            mm.mm(&ds.t(), &qm, 0.0, &mut mat_mut(&mut dk[o..], k.tn, k.hd));
        }
    }
}

/// The first index of the largest value (0 for an empty row).
fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(ai, am), (i, &v)| {
            if v > am {
                (i, v)
            } else {
                (ai, am)
            }
        })
        .0
}

impl Model {
    fn gpt_parts(&self) -> Result<&Gpt> {
        self.gpt
            .as_ref()
            .ok_or_else(|| Error::Config(format!("model {} is not a language model", self.spec)))
    }

    /// Checks the batch against a language model and copies its token ids into the workspace.
    fn gpt_check(
        &self,
        g: &Gpt,
        params: &[f32],
        x: &ArrayView2<'_, f32>,
        y: &[u8],
        ws: &Workspace,
    ) -> Result<()> {
        if params.len() != self.param_len() {
            return Err(Error::WrongLength {
                expected: self.param_len(),
                got: params.len(),
            });
        }
        let fits = ws.seq.as_ref().is_some_and(|s| s.info == g.info);
        if !fits || x.ncols() != g.info.context + 1 || x.nrows() != y.len() {
            return Err(Error::Config(format!(
                "batch of {}x{} with {} labels does not fit language model {} (examples of T+1 = {} tokens) or its workspace",
                x.nrows(),
                x.ncols(),
                y.len(),
                self.spec,
                g.info.context + 1
            )));
        }
        Ok(())
    }

    /// Copies examples `rows` of `x` into the workspace's token ids, checking each.
    fn gpt_tokens(
        g: &Gpt,
        x: &ArrayView2<'_, f32>,
        rows: std::ops::Range<usize>,
        s: &mut GptWorkspace,
    ) -> Result<()> {
        let v = g.info.vocab;
        let w = g.info.context + 1;
        for (i, row) in x.outer_iter().skip(rows.start).take(rows.len()).enumerate() {
            for (j, &val) in row.iter().enumerate() {
                if !(val >= 0.0 && val < v as f32 && val.fract() == 0.0) {
                    return Err(Error::Data(format!(
                        "token {val} at example {}, position {j} is not an id in 0..{v}",
                        rows.start + i
                    )));
                }
                s.tokens[i * w + j] = val as u32;
            }
        }
        Ok(())
    }

    /// Forward pass of `b` examples over their first `tn` positions (token ids already in
    /// the workspace): leaves the logits in `s.logits`.
    #[allow(clippy::too_many_arguments)]
    fn gpt_forward(
        g: &Gpt,
        params: &[f32],
        b: usize,
        tn: usize,
        s: &mut GptWorkspace,
        mm: &mut Mm<'_>,
        clock: &mut Option<Clock<'_>>,
    ) {
        let info = g.info;
        let (t, d, v) = (info.context, info.dim, info.vocab);
        let k = Dims {
            b,
            tn,
            d,
            h: info.heads,
            hd: d / info.heads,
        };
        let n = k.rows();
        let p = |o: usize, len: usize| &params[o..o + len];
        // Embeddings.
        let (tok, pos) = (p(g.tok, v * d), p(g.pos, t * d));
        for e in 0..b {
            for i in 0..tn {
                let id = s.tokens[e * (t + 1) + i] as usize;
                let row = &mut s.x[(e * tn + i) * d..][..d];
                let (te, pe) = (&tok[id * d..][..d], &pos[i * d..][..d]);
                for j in 0..d {
                    row[j] = te[j] + pe[j];
                }
            }
        }
        tick(clock, |ti, dt| ti.forward[0] += dt);
        for (l, bo) in g.blocks.iter().enumerate() {
            let ba = &mut s.blocks[if s.train { l } else { 0 }];
            // x += proj(attn(ln1(x))).
            ln_forward(&s.x, p(bo.ln1_w, d), p(bo.ln1_b, d), &mut ba.ln1, n);
            {
                let mut qkv = mat_mut(&mut s.qkv, n, 3 * d);
                mm.mm(
                    &mat(&ba.ln1.out, n, d),
                    &mat(p(bo.qkv_w, 3 * d * d), d, 3 * d),
                    0.0,
                    &mut qkv,
                );
            }
            add_bias(&mut s.qkv[..n * 3 * d], p(bo.qkv_b, 3 * d));
            for part in 0..3 {
                to_heads(&s.qkv, 3 * d, part * d, &mut ba.heads[part * n * d..], k);
            }
            attention_forward(mm, &ba.heads, &mut ba.probs, &mut s.att, k);
            from_heads(&s.att, &mut ba.att_cat, d, 0, k);
            mm.mm(
                &mat(&ba.att_cat, n, d),
                &mat(p(bo.proj_w, d * d), d, d),
                1.0,
                &mut mat_mut(&mut s.x, n, d),
            );
            add_bias(&mut s.x[..n * d], p(bo.proj_b, d));
            // x += mlp_proj(gelu(fc(ln2(x)))).
            ln_forward(&s.x, p(bo.ln2_w, d), p(bo.ln2_b, d), &mut ba.ln2, n);
            mm.mm(
                &mat(&ba.ln2.out, n, d),
                &mat(p(bo.fc_w, 4 * d * d), d, 4 * d),
                0.0,
                &mut mat_mut(&mut ba.fc, n, 4 * d),
            );
            add_bias(&mut ba.fc[..n * 4 * d], p(bo.fc_b, 4 * d));
            gelu_forward(&ba.fc[..n * 4 * d], &mut ba.sg, &mut s.g);
            mm.mm(
                &mat(&s.g, n, 4 * d),
                &mat(p(bo.mlp_w, 4 * d * d), 4 * d, d),
                1.0,
                &mut mat_mut(&mut s.x, n, d),
            );
            add_bias(&mut s.x[..n * d], p(bo.mlp_b, d));
            tick(clock, |ti, dt| ti.forward[l + 1] += dt);
        }
        ln_forward(&s.x, p(g.lnf_w, d), p(g.lnf_b, d), &mut s.lnf, n);
        let h = mat(&s.lnf.out, n, d);
        let mut logits = mat_mut(&mut s.logits, n, v);
        match g.head {
            Some(o) => mm.mm(&h, &mat(p(o, d * v), d, v), 0.0, &mut logits),
            None => mm.mm(&h, &mat(tok, v, d).t(), 0.0, &mut logits),
        }
        tick(clock, |ti, dt| ti.forward[info.layers + 1] += dt);
    }

    /// Cross-entropy over the `b x T` positions; with `grad_scale` the logits become their
    /// gradient, `(softmax - onehot) * grad_scale`.
    #[inline(never)]
    fn gpt_loss(g: &Gpt, b: usize, s: &mut GptWorkspace, grad_scale: Option<f32>) -> BatchStats {
        let (t, v) = (g.info.context, g.info.vocab);
        let mut stats = BatchStats {
            count: b * t,
            ..BatchStats::default()
        };
        for e in 0..b {
            for i in 0..t {
                let target = s.tokens[e * (t + 1) + i + 1] as usize;
                let row = &mut s.logits[(e * t + i) * v..][..v];
                let arg = argmax(row);
                let max = row[arg];
                let picked = row[target];
                // Training: the logits become their exponentials, then their gradient (one
                // `exp` each, vectorised); an evaluation leaves them as they are.
                let sum: f32 = if grad_scale.is_some() {
                    row.iter_mut().for_each(|z| *z = exp(*z - max));
                    row.iter().sum()
                } else {
                    row.iter().map(|&z| exp(z - max)).sum()
                };
                stats.loss_sum += f64::from(max + sum.ln() - picked);
                stats.correct += usize::from(arg == target);
                if let Some(scale) = grad_scale {
                    let inv = scale / sum;
                    row.iter_mut().for_each(|z| *z *= inv);
                    row[target] -= scale;
                }
            }
        }
        stats
    }

    /// A training step of a language model (see [`Model::loss_and_grad_seeded`]).
    pub(super) fn gpt_train_step(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
        y: &[u8],
        grad: &mut [f32],
        ws: &mut Workspace,
        clock: &mut Option<Clock<'_>>,
    ) -> Result<BatchStats> {
        let g = self.gpt_parts()?;
        self.gpt_check(g, params, &x, y, ws)?;
        if grad.len() != params.len() {
            return Err(Error::WrongLength {
                expected: params.len(),
                got: grad.len(),
            });
        }
        let Workspace {
            gemm, scratch, seq, ..
        } = ws;
        let Some(s) = seq.as_mut().filter(|s| s.train) else {
            return Err(Error::Config(
                "an inference workspace cannot compute gradients".into(),
            ));
        };
        let b = x.nrows();
        if b > s.capacity {
            return Err(Error::Config(format!(
                "batch of {b} examples is over the workspace's {}",
                s.capacity
            )));
        }
        Self::gpt_tokens(g, &x, 0..b, s)?;
        let mut mm = Mm {
            kernel: *gemm,
            scratch,
        };
        let info = g.info;
        let (t, d, v) = (info.context, info.dim, info.vocab);
        Self::gpt_forward(g, params, b, t, s, &mut mm, clock);
        let n = b * t;
        let stats = Self::gpt_loss(g, b, s, Some(1.0 / n as f32));
        tick(clock, |ti, dt| ti.loss += dt);
        let k = Dims {
            b,
            tn: t,
            d,
            h: info.heads,
            hd: d / info.heads,
        };
        let p = |o: usize, len: usize| &params[o..o + len];
        // Head: the weight's gradient, then the stream's through ln_f.
        let dlogits = mat(&s.logits, n, v);
        {
            let h = mat(&s.lnf.out, n, d);
            let mut dln = mat_mut(&mut s.dln, n, d);
            match g.head {
                Some(o) => {
                    let gh = &mut grad[o..o + d * v];
                    mm.mm(&h.t(), &dlogits, 0.0, &mut mat_mut(gh, d, v));
                    mm.mm(&dlogits, &mat(p(o, d * v), d, v).t(), 0.0, &mut dln);
                }
                None => {
                    let gt = &mut grad[g.tok..g.tok + v * d];
                    mm.mm(&dlogits.t(), &h, 0.0, &mut mat_mut(gt, v, d));
                    mm.mm(&dlogits, &mat(p(g.tok, v * d), v, d), 0.0, &mut dln);
                }
            }
        }
        s.dx[..n * d].fill(0.0);
        {
            let (gw, gb) = grad[g.lnf_w..g.lnf_b + d].split_at_mut(d);
            ln_backward(&s.dln, &s.lnf, p(g.lnf_w, d), n, &mut s.dx, gw, gb);
        }
        tick(clock, |ti, dt| ti.backward[info.layers + 1] += dt);
        for (l, bo) in g.blocks.iter().enumerate().rev() {
            let ba = &s.blocks[l];
            // MLP: dx is the gradient of its output.
            gelu_again(&ba.fc[..n * 4 * d], &ba.sg, &mut s.g);
            {
                let dxm = mat(&s.dx, n, d);
                let gw = &mut grad[bo.mlp_w..bo.mlp_w + 4 * d * d];
                mm.mm(
                    &mat(&s.g, n, 4 * d).t(),
                    &dxm,
                    0.0,
                    &mut mat_mut(gw, 4 * d, d),
                );
                col_sum(&s.dx[..n * d], &mut grad[bo.mlp_b..bo.mlp_b + d]);
                let w = mat(p(bo.mlp_w, 4 * d * d), 4 * d, d);
                mm.mm(&dxm, &w.t(), 0.0, &mut mat_mut(&mut s.dff, n, 4 * d));
            }
            gelu_backward(&ba.fc[..n * 4 * d], &ba.sg, &mut s.dff[..n * 4 * d]);
            {
                let dff = mat(&s.dff, n, 4 * d);
                let gw = &mut grad[bo.fc_w..bo.fc_w + 4 * d * d];
                mm.mm(
                    &mat(&ba.ln2.out, n, d).t(),
                    &dff,
                    0.0,
                    &mut mat_mut(gw, d, 4 * d),
                );
                col_sum(&s.dff[..n * 4 * d], &mut grad[bo.fc_b..bo.fc_b + 4 * d]);
                let w = mat(p(bo.fc_w, 4 * d * d), d, 4 * d);
                mm.mm(&dff, &w.t(), 0.0, &mut mat_mut(&mut s.dln, n, d));
            }
            {
                let (gw, gb) = grad[bo.ln2_w..bo.ln2_b + d].split_at_mut(d);
                ln_backward(&s.dln, &ba.ln2, p(bo.ln2_w, d), n, &mut s.dx, gw, gb);
            }
            // Attention: dx is the gradient of its output too.
            {
                let dxm = mat(&s.dx, n, d);
                let gw = &mut grad[bo.proj_w..bo.proj_w + d * d];
                mm.mm(
                    &mat(&ba.att_cat, n, d).t(),
                    &dxm,
                    0.0,
                    &mut mat_mut(gw, d, d),
                );
                col_sum(&s.dx[..n * d], &mut grad[bo.proj_b..bo.proj_b + d]);
                let w = mat(p(bo.proj_w, d * d), d, d);
                mm.mm(&dxm, &w.t(), 0.0, &mut mat_mut(&mut s.dln, n, d));
            }
            to_heads(&s.dln, d, 0, &mut s.att, k);
            attention_backward(
                &mut mm,
                &ba.heads,
                &ba.probs,
                &s.att,
                &mut s.dheads,
                &mut s.dp,
                k,
            );
            for part in 0..3 {
                from_heads(&s.dheads[part * n * d..], &mut s.qkv, 3 * d, part * d, k);
            }
            {
                let dqkv = mat(&s.qkv, n, 3 * d);
                let gw = &mut grad[bo.qkv_w..bo.qkv_w + 3 * d * d];
                mm.mm(
                    &mat(&ba.ln1.out, n, d).t(),
                    &dqkv,
                    0.0,
                    &mut mat_mut(gw, d, 3 * d),
                );
                col_sum(&s.qkv[..n * 3 * d], &mut grad[bo.qkv_b..bo.qkv_b + 3 * d]);
                let w = mat(p(bo.qkv_w, 3 * d * d), d, 3 * d);
                mm.mm(&dqkv, &w.t(), 0.0, &mut mat_mut(&mut s.dln, n, d));
            }
            {
                let (gw, gb) = grad[bo.ln1_w..bo.ln1_b + d].split_at_mut(d);
                ln_backward(&s.dln, &ba.ln1, p(bo.ln1_w, d), n, &mut s.dx, gw, gb);
            }
            tick(clock, |ti, dt| ti.backward[l + 1] += dt);
        }
        // Embeddings: scatter the stream's gradient (a tied head's part is already there).
        let (gtok, gpos) = grad[g.tok..g.pos + t * d].split_at_mut(v * d);
        if g.head.is_some() {
            gtok.fill(0.0);
        }
        gpos.fill(0.0);
        for e in 0..b {
            for i in 0..t {
                let id = s.tokens[e * (t + 1) + i] as usize;
                let dr = &s.dx[(e * t + i) * d..][..d];
                let tr = &mut gtok[id * d..][..d];
                tr.iter_mut().zip(dr).for_each(|(g, v)| *g += v);
                let pr = &mut gpos[i * d..][..d];
                pr.iter_mut().zip(dr).for_each(|(g, v)| *g += v);
            }
        }
        tick(clock, |ti, dt| ti.backward[0] += dt);
        Ok(stats)
    }

    /// Evaluation of a language model, in pieces of the workspace's capacity.
    pub(super) fn gpt_evaluate(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
        y: &[u8],
        ws: &mut Workspace,
    ) -> Result<BatchStats> {
        let g = self.gpt_parts()?;
        self.gpt_check(g, params, &x, y, ws)?;
        let Workspace {
            gemm, scratch, seq, ..
        } = ws;
        let Some(s) = seq.as_mut() else {
            return Err(Error::Config("not a language model's workspace".into()));
        };
        let mut mm = Mm {
            kernel: *gemm,
            scratch,
        };
        let mut total = BatchStats::default();
        let mut start = 0;
        while start < x.nrows() {
            let b = s.capacity.min(x.nrows() - start);
            Self::gpt_tokens(g, &x, start..start + b, s)?;
            Self::gpt_forward(g, params, b, g.info.context, s, &mut mm, &mut None);
            total.merge(Self::gpt_loss(g, b, s, None));
            start += b;
        }
        Ok(total)
    }

    /// Samples `n` tokens after `prompt` from a language model: each step sees the last `T`
    /// tokens (the prompt and what it drew so far) and draws the next from the softmax of its
    /// logits over `temperature` (0: the argmax, no draw), with `rng`. Returns the `n` new
    /// tokens. It allocates one small workspace per call and recomputes the context for every
    /// token (no cache): it is for showing samples, not for training.
    ///
    /// # Errors
    /// [`Error::Config`] when the model is not a language model, `params` has the wrong length,
    /// the prompt is empty or has an id outside the vocabulary, `n` is over [`MAX_GENERATE`]
    /// or the temperature is negative or not finite.
    pub fn generate(
        &self,
        params: &[f32],
        prompt: &[u32],
        n: usize,
        temperature: f32,
        rng: &mut Rng,
    ) -> Result<Vec<u32>> {
        let g = self.gpt_parts()?;
        let info = g.info;
        if params.len() != self.param_len() {
            return Err(Error::WrongLength {
                expected: self.param_len(),
                got: params.len(),
            });
        }
        if prompt.is_empty() {
            return Err(Error::Config(
                "sampling needs a prompt of one token or more".into(),
            ));
        }
        if let Some(bad) = prompt.iter().find(|&&id| id as usize >= info.vocab) {
            return Err(Error::Config(format!(
                "prompt token {bad} is outside the vocabulary of {}",
                info.vocab
            )));
        }
        if n > MAX_GENERATE {
            return Err(Error::Config(format!(
                "{n} tokens to sample is over {MAX_GENERATE}"
            )));
        }
        if !(temperature.is_finite() && temperature >= 0.0) {
            return Err(Error::Config(format!(
                "temperature {temperature} must be finite and 0 or more"
            )));
        }
        let mut s = GptWorkspace::new(info, 1, false);
        let mut scratch = Scratch::default();
        let mut mm = Mm {
            kernel: gemm::default_kernel(),
            scratch: &mut scratch,
        };
        let mut seq: Vec<u32> = prompt.to_vec();
        let mut out = Vec::with_capacity(n);
        let mut probs = vec![0.0f64; info.vocab];
        for _ in 0..n {
            let ctx = &seq[seq.len().saturating_sub(info.context)..];
            let tn = ctx.len();
            s.tokens[..tn].copy_from_slice(ctx);
            Self::gpt_forward(g, params, 1, tn, &mut s, &mut mm, &mut None);
            let row = &s.logits[(tn - 1) * info.vocab..tn * info.vocab];
            let next: usize = if temperature == 0.0 {
                argmax(row)
            } else {
                let max = row[argmax(row)];
                let inv_t = 1.0 / f64::from(temperature);
                let mut sum = 0.0;
                for (p, &z) in probs.iter_mut().zip(row) {
                    *p = (f64::from(z - max) * inv_t).exp();
                    sum += *p;
                }
                let mut u = rng.next_f64() * sum;
                let mut pick = info.vocab - 1;
                for (i, &p) in probs.iter().enumerate() {
                    if u < p {
                        pick = i;
                        break;
                    }
                    u -= p;
                }
                pick
            };
            let next = next as u32;
            seq.push(next);
            out.push(next);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
