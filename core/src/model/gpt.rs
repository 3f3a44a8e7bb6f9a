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
mod tests {
    use super::super::{Gemm, ModelSpec};
    use super::*;
    use ndarray::Array2;

    fn tiny(text: &str, t: usize, v: usize) -> Model {
        Model::new(ModelSpec::parse(text, t + 1, v).unwrap()).unwrap()
    }

    /// `rows` examples of `T + 1` random token ids.
    fn tokens(rows: usize, t: usize, v: usize, seed: u64) -> (Array2<f32>, Vec<u8>) {
        let mut r = Rng::new(seed);
        let x = Array2::from_shape_fn((rows, t + 1), |_| r.below(v as u64) as f32);
        (x, vec![0; rows])
    }

    /// Parameters far from the init (larger weights, gains and biases away from 1 and 0), so
    /// every path carries a gradient worth checking.
    fn rough_params(m: &Model, seed: u64) -> Vec<f32> {
        let mut r = Rng::new(seed);
        let mut p = vec![0.0; m.param_len()];
        for t in &m.layout().tensors {
            let gain = t.name.contains("ln") && t.name.ends_with("weight");
            for v in &mut p[t.offset..t.offset + t.len()] {
                let z = r.normal() as f32;
                *v = if gain { 1.0 + 0.2 * z } else { 0.4 * z };
            }
        }
        p
    }

    /// Central differences of the mean loss against the analytic gradient, every parameter
    /// (the model is smooth: no kink to skip). f32 forward passes, step `h`.
    fn finite_difference_check(m: &Model, h: f32) {
        let info = m.sequence().unwrap();
        let p = rough_params(m, 3);
        let (x, y) = tokens(3, info.context, info.vocab, 4);
        let mut ws = m.workspace(3);
        let mut grad = vec![0.0; p.len()];
        m.loss_and_grad(&p, x.view(), &y, &mut grad, &mut ws)
            .unwrap();
        let mut loss = |p: &[f32]| m.evaluate(p, x.view(), &y, &mut ws).unwrap().mean_loss();
        let mut worst = (0.0f64, String::new());
        for t in &m.layout().tensors {
            for i in t.offset..t.offset + t.len() {
                let mut q = p.clone();
                q[i] += h;
                let up = loss(&q);
                q[i] -= 2.0 * h;
                let down = loss(&q);
                let numeric = (up - down) / (2.0 * f64::from(h));
                let a = f64::from(grad[i]);
                let err = (numeric - a).abs() / (numeric.abs() + a.abs()).max(1e-2);
                if err > worst.0 {
                    worst = (
                        err,
                        format!("{}[{}]: {numeric} vs {a}", t.name, i - t.offset),
                    );
                }
            }
        }
        assert!(worst.0 < 2e-2, "{}: worst {worst:?}", m.spec());
        // Every tensor gets a gradient.
        for t in &m.layout().tensors {
            let g = &grad[t.offset..t.offset + t.len()];
            assert!(
                g.iter().any(|v| v.abs() > 1e-4),
                "{} has no gradient",
                t.name
            );
        }
    }

    /// The vectorisable `exp` against f64's over the range softmax and GELU use, its clamps
    /// and a NaN.
    #[test]
    fn exp_is_within_two_ulp_of_f64s() {
        let mut worst = 0.0f64;
        for i in 0..=200_000 {
            let x = -87.0 + 175.0 * f64::from(i) / 200_000.0;
            let x = x as f32;
            let want = f64::from(x).exp();
            let got = f64::from(exp(x));
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 2.4e-7, "relative error {worst}");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-1000.0), exp(-87.0));
        assert_eq!(exp(1000.0), exp(88.0));
        assert!(exp(f32::NEG_INFINITY) > 0.0 && exp(f32::INFINITY).is_finite());
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn tiny_gpt_gradient_matches_finite_differences_tied_and_untied() {
        finite_difference_check(&tiny("gpt:2,8,2,5", 5, 7), 1e-2);
        finite_difference_check(&tiny("gpt:2,8,2,5/untied", 5, 7), 1e-2);
        // One head of width 4, a context of 1 (attention to itself only).
        finite_difference_check(&tiny("gpt:1,4,1,1/untied", 1, 3), 1e-2);
    }

    /// `sum(out * w)` for a fixed random `w`: a scalar loss of a layer's output.
    fn weighted(out: &[f32], w: &[f32]) -> f64 {
        out.iter()
            .zip(w)
            .map(|(&a, &b)| f64::from(a) * f64::from(b))
            .sum()
    }

    fn normals(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut r = Rng::new(seed);
        (0..n).map(|_| r.normal() as f32 * scale).collect()
    }

    fn assert_close(numeric: f64, analytic: f32, what: &str) {
        let a = f64::from(analytic);
        let err = (numeric - a).abs() / (numeric.abs() + a.abs()).max(1e-2);
        assert!(err < 1e-2, "{what}: {numeric} vs {a}");
    }

    #[test]
    fn layer_norm_backward_matches_finite_differences() {
        let (rows, d) = (3, 6);
        let x = normals(rows * d, 1, 2.0);
        let gamma: Vec<f32> = normals(d, 2, 0.3).iter().map(|v| 1.0 + v).collect();
        let beta = normals(d, 3, 0.3);
        let w = normals(rows * d, 4, 1.0);
        let out = |x: &[f32], gamma: &[f32], beta: &[f32]| {
            let mut ln = Ln::new(rows, d);
            ln_forward(x, gamma, beta, &mut ln, rows);
            (weighted(&ln.out, &w), ln)
        };
        let (_, ln) = out(&x, &gamma, &beta);
        let mut dx = vec![0.5; rows * d]; // accumulated into
        let (mut dg, mut db) = (vec![9.0; d], vec![9.0; d]); // overwritten
        ln_backward(&w, &ln, &gamma, rows, &mut dx, &mut dg, &mut db);
        let h = 1e-2;
        for i in 0..rows * d {
            let mut q = x.clone();
            q[i] += h;
            let up = out(&q, &gamma, &beta).0;
            q[i] -= 2.0 * h;
            let down = out(&q, &gamma, &beta).0;
            assert_close((up - down) / f64::from(2.0 * h), dx[i] - 0.5, "dx");
        }
        for j in 0..d {
            let mut q = gamma.clone();
            q[j] += h;
            let up = out(&x, &q, &beta).0;
            q[j] -= 2.0 * h;
            let down = out(&x, &q, &beta).0;
            assert_close((up - down) / f64::from(2.0 * h), dg[j], "dgamma");
            let mut q = beta.clone();
            q[j] += h;
            let up = out(&x, &gamma, &q).0;
            q[j] -= 2.0 * h;
            let down = out(&x, &gamma, &q).0;
            assert_close((up - down) / f64::from(2.0 * h), db[j], "dbeta");
        }
        // Normalised: zero mean and unit (biased) variance per row.
        for r in ln.xhat.chunks(d) {
            let mean = r.iter().sum::<f32>() / d as f32;
            let var = r.iter().map(|v| v * v).sum::<f32>() / d as f32;
            assert!(
                mean.abs() < 1e-5 && (var - 1.0).abs() < 1e-3,
                "{mean} {var}"
            );
        }
    }

    #[test]
    fn gelu_backward_matches_finite_differences_and_the_formula() {
        let mut h: Vec<f32> = (-40..=40).map(|i| i as f32 * 0.1).collect();
        h.extend([-100.0, -30.0, 30.0, 100.0, 1e-6, -1e-6]);
        let (mut sg, mut g) = (vec![0.0; h.len()], vec![0.0; h.len()]);
        gelu_forward(&h, &mut sg, &mut g);
        let mut d = vec![1.0; h.len()];
        gelu_backward(&h, &sg, &mut d);
        let gelu = |x: f64| {
            0.5 * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
        };
        let mut again = vec![0.0; h.len()];
        gelu_again(&h, &sg, &mut again);
        assert_eq!(again, g);
        for (i, &x) in h.iter().enumerate() {
            let x = f64::from(x);
            // The tanh form of the shared architecture text, to float rounding.
            let want = gelu(x);
            assert!(
                (want - f64::from(g[i])).abs() <= 1e-6 * (1.0 + want.abs()),
                "gelu({x})"
            );
            let numeric = (gelu(x + 1e-4) - gelu(x - 1e-4)) / 2e-4;
            assert_close(numeric, d[i], "gelu'");
        }
    }

    #[test]
    fn causal_attention_backward_matches_finite_differences() {
        let k = Dims {
            b: 2,
            tn: 4,
            d: 6,
            h: 2,
            hd: 3,
        };
        let n = k.rows() * k.d;
        let heads = normals(3 * n, 5, 1.0);
        let w = normals(n, 6, 1.0);
        let mut scratch = Scratch::default();
        let mut run = |heads: &[f32]| {
            let mut mm = Mm {
                kernel: Gemm::MatrixMultiply,
                scratch: &mut scratch,
            };
            let mut probs = vec![0.0; k.b * k.h * k.tn * k.tn];
            let mut att = vec![0.0; n];
            attention_forward(&mut mm, heads, &mut probs, &mut att, k);
            (weighted(&att, &w), probs)
        };
        let (_, probs) = run(&heads);
        // Rows sum to 1 and nothing after the diagonal.
        for (r, row) in probs.chunks(k.tn).enumerate() {
            let t = r % k.tn;
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
            assert!(row[t + 1..].iter().all(|&v| v == 0.0));
        }
        let mut dheads = vec![0.0; 3 * n];
        let mut dp = vec![0.0; k.tn * k.tn];
        let mut scratch2 = Scratch::default();
        let mut mm = Mm {
            kernel: Gemm::MatrixMultiply,
            scratch: &mut scratch2,
        };
        attention_backward(&mut mm, &heads, &probs, &w, &mut dheads, &mut dp, k);
        let h = 1e-2;
        for i in 0..3 * n {
            let mut q = heads.clone();
            q[i] += h;
            let up = run(&q).0;
            q[i] -= 2.0 * h;
            let down = run(&q).0;
            assert_close((up - down) / f64::from(2.0 * h), dheads[i], "dq/dk/dv");
        }
    }

    #[test]
    fn heads_split_and_join_are_inverse() {
        let k = Dims {
            b: 2,
            tn: 3,
            d: 4,
            h: 2,
            hd: 2,
        };
        let src: Vec<f32> = (0..k.rows() * 3 * k.d).map(|i| i as f32).collect();
        let mut heads = vec![0.0; 3 * k.rows() * k.d];
        let mut back = vec![0.0; src.len()];
        for part in 0..3 {
            to_heads(&src, 3 * k.d, part * k.d, &mut heads[part * 24..], k);
            from_heads(&heads[part * 24..], &mut back, 3 * k.d, part * k.d, k);
        }
        assert_eq!(back, src);
        // Example 1, head 1, position 2 of k: row 5, columns 4 + 2..4 + 4.
        let o = 24 + k.head(1, 1) + 2 * 2;
        assert_eq!(heads[o..o + 2], [5.0 * 12.0 + 6.0, 5.0 * 12.0 + 7.0]);
    }

    /// The logits of every position of a batch.
    fn logits(m: &Model, p: &[f32], x: &Array2<f32>) -> Vec<f32> {
        let mut ws = m.inference_workspace(x.nrows());
        m.evaluate(p, x.view(), &vec![0; x.nrows()], &mut ws)
            .unwrap();
        let s = ws.seq.unwrap();
        s.logits
    }

    #[test]
    fn later_tokens_change_nothing_before_them() {
        let m = tiny("gpt:2,8,2,6/untied", 6, 9);
        let (t, v) = (6, 9);
        let p = rough_params(&m, 1);
        let (x, _) = tokens(2, t, v, 7);
        let base = logits(&m, &p, &x);
        for cut in 0..t {
            let mut x2 = x.clone();
            for j in cut + 1..=t {
                x2[[0, j]] = ((x2[[0, j]] as usize + 1 + j) % v) as f32;
            }
            let after = logits(&m, &p, &x2);
            // Positions 0..=cut of example 0 see the same tokens: the same logits, exactly;
            // example 1 is untouched.
            assert_eq!(after[..(cut + 1) * v], base[..(cut + 1) * v], "cut {cut}");
            assert_eq!(after[t * v..], base[t * v..]);
            if cut + 1 < t {
                assert_ne!(after[(cut + 1) * v..t * v], base[(cut + 1) * v..t * v]);
            }
        }
        // And the loss of a position depends on its target: the last token only moves the last
        // position's loss term.
        let mut ws = m.workspace(2);
        let y = [0u8; 2];
        let a = m.evaluate(&p, x.view(), &y, &mut ws).unwrap();
        let mut x2 = x.clone();
        x2[[0, t]] = ((x2[[0, t]] as usize + 1) % v) as f32;
        assert_eq!(logits(&m, &p, &x2), base);
        assert_ne!(m.evaluate(&p, x2.view(), &y, &mut ws).unwrap(), a);
    }

    #[test]
    fn a_fresh_model_predicts_about_uniformly() {
        for (text, v) in [("gpt:2,32,4,16", 50usize), ("gpt:1,16,2,8/untied", 100)] {
            let t = ModelSpec::parse(text, 100, v).ok().map_or(0, |_| 0);
            let _ = t;
            let ctx = text.rsplit(',').next().unwrap().trim_end_matches("/untied");
            let ctx: usize = ctx.parse().unwrap();
            let m = tiny(text, ctx, v);
            let p = m.init_params(5);
            let (x, y) = tokens(16, ctx, v, 2);
            let mut ws = m.inference_workspace(16);
            let s = m.evaluate(&p, x.view(), &y, &mut ws).unwrap();
            assert_eq!(s.count, 16 * ctx);
            let ln_v = (v as f64).ln();
            assert!(
                (s.mean_loss() - ln_v).abs() < 0.05,
                "{text}: {} vs ln V {ln_v}",
                s.mean_loss()
            );
        }
    }

    /// Adam (here, so this test does not follow changes to `optim`).
    fn adam(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], step: i32, lr: f32) {
        let (b1, b2) = (0.9f32, 0.999f32);
        let (c1, c2) = (1.0 - b1.powi(step), 1.0 - b2.powi(step));
        for i in 0..p.len() {
            m[i] = b1 * m[i] + (1.0 - b1) * g[i];
            v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
            p[i] -= lr * (m[i] / c1) / ((v[i] / c2).sqrt() + 1e-8);
        }
    }

    #[test]
    fn a_tiny_gpt_learns_a_repeated_string_and_continues_it() {
        let text = b"the cat sat on the mat. ";
        let mut vocab: Vec<u8> = text.to_vec();
        vocab.sort_unstable();
        vocab.dedup();
        let v = vocab.len();
        let ids: Vec<u32> = text
            .iter()
            .cycle()
            .take(400)
            .map(|c| vocab.binary_search(c).unwrap() as u32)
            .collect();
        let t = 16;
        let m = tiny("gpt:2,32,4,16", t, v);
        let mut p = m.init_params(1);
        let (b, steps) = (8, 300);
        let mut ws = m.workspace(b);
        let mut g = vec![0.0; p.len()];
        let (mut m1, mut m2) = (vec![0.0; p.len()], vec![0.0; p.len()]);
        let mut r = Rng::new(3);
        let mut x = Array2::zeros((b, t + 1));
        let y = vec![0u8; b];
        let mut first = None;
        let mut last = 0.0;
        for step in 1..=steps {
            for e in 0..b {
                let at = r.below((ids.len() - t - 1) as u64) as usize;
                for j in 0..=t {
                    x[[e, j]] = ids[at + j] as f32;
                }
            }
            let s = m.loss_and_grad(&p, x.view(), &y, &mut g, &mut ws).unwrap();
            first.get_or_insert(s.mean_loss());
            last = s.mean_loss();
            adam(&mut p, &g, &mut m1, &mut m2, step, 3e-3);
        }
        let ln_v = (v as f64).ln();
        let first = first.unwrap();
        assert!(
            (first - ln_v).abs() < 0.1,
            "first loss {first}, ln V {ln_v}"
        );
        // The first few positions of a window cannot know where in the sentence they are,
        // but most can: the loss ends far below ln V.
        assert!(last < 0.25 * ln_v, "loss {first} -> {last} (ln V {ln_v})");
        // Greedy sampling continues the sentence.
        let prompt: Vec<u32> = ids[..20].to_vec();
        let out = m.generate(&p, &prompt, 24, 0.0, &mut Rng::new(1)).unwrap();
        let want = &ids[20..44];
        let same = out.iter().zip(want).filter(|(a, b)| a == b).count();
        assert!(same >= 20, "{same} of 24 sampled tokens continue the text");
        // A temperature draws from the softmax: reproducible with the seed, and still mostly
        // the text at a low temperature.
        let a = m.generate(&p, &prompt, 24, 0.5, &mut Rng::new(9)).unwrap();
        assert_eq!(
            a,
            m.generate(&p, &prompt, 24, 0.5, &mut Rng::new(9)).unwrap()
        );
        assert!(a.iter().all(|&id| (id as usize) < v));
    }

    #[test]
    fn every_gemm_kernel_gives_the_same_gradient() {
        let m = tiny("gpt:2,16,4,12", 12, 11);
        let p = rough_params(&m, 2);
        let (x, y) = tokens(5, 12, 11, 3);
        let run = |k: Gemm| {
            let mut ws = m.workspace(5);
            ws.set_gemm(k);
            let mut g = vec![0.0; p.len()];
            let s = m.loss_and_grad(&p, x.view(), &y, &mut g, &mut ws).unwrap();
            (s, g)
        };
        let (s0, g0) = run(Gemm::ALL[0]);
        for &k in &Gemm::ALL[1..] {
            let (s, g) = run(k);
            assert!((s.loss_sum - s0.loss_sum).abs() < 1e-4 * s0.loss_sum, "{k}");
            assert_eq!(s.correct, s0.correct);
            for (a, b) in g.iter().zip(&g0) {
                assert!((a - b).abs() <= 1e-5 + 1e-4 * b.abs(), "{k}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn steps_reuse_the_workspace_and_evaluation_runs_in_pieces() {
        let m = tiny("gpt:1,8,2,6", 6, 5);
        let p = rough_params(&m, 1);
        let (x, y) = tokens(7, 6, 5, 1);
        let mut ws = m.workspace(7);
        let mut g = vec![0.0; p.len()];
        let mut g2 = vec![0.0; p.len()];
        m.loss_and_grad(&p, x.view(), &y, &mut g, &mut ws).unwrap();
        let held = ws.gemm_scratch_len();
        let ptr = ws.seq.as_ref().unwrap().x.as_ptr();
        g2.fill(7.0); // overwritten, not accumulated
        m.loss_and_grad(&p, x.view(), &y, &mut g2, &mut ws).unwrap();
        assert_eq!(g, g2);
        assert_eq!(ws.gemm_scratch_len(), held);
        assert_eq!(ws.seq.as_ref().unwrap().x.as_ptr(), ptr);
        // A smaller batch in the same workspace is the same as in its own.
        let (xs, ys) = (x.slice(ndarray::s![..3, ..]), &y[..3]);
        let a = m.loss_and_grad(&p, xs, ys, &mut g, &mut ws).unwrap();
        let b = m
            .loss_and_grad(&p, xs, ys, &mut g2, &mut m.workspace(3))
            .unwrap();
        assert_eq!((a, &g), (b, &g2));
        // Evaluation: a training workspace, an inference one, and one that takes two examples
        // at a time agree.
        let full = m.evaluate(&p, x.view(), &y, &mut ws).unwrap();
        let mut iws = m.inference_workspace(7);
        assert_eq!(m.evaluate(&p, x.view(), &y, &mut iws).unwrap(), full);
        iws.seq.as_mut().unwrap().capacity = 2;
        let pieces = m.evaluate(&p, x.view(), &y, &mut iws).unwrap();
        assert_eq!((pieces.count, pieces.correct), (full.count, full.correct));
        assert!((pieces.loss_sum - full.loss_sum).abs() < 1e-9 * full.loss_sum.max(1.0));
        assert!(m.loss_and_grad(&p, x.view(), &y, &mut g, &mut iws).is_err());
        // The default model's inference workspace is bounded whatever the capacity.
        let big = tiny("gpt", 64, 100);
        let ews = big.inference_workspace(100_000);
        let s = ews.seq.as_ref().unwrap();
        assert!(
            s.capacity >= 1
                && (s.capacity as u128) * floats_per_example(&s.info, false) <= EVAL_BUDGET as u128
        );
    }

    #[test]
    fn bad_batches_and_requests_are_errors() {
        let m = tiny("gpt:1,8,2,4", 4, 6);
        let p = m.init_params(1);
        let mut ws = m.workspace(3);
        let mut g = vec![0.0; p.len()];
        let (x, y) = tokens(3, 4, 6, 1);
        assert!(m.loss_and_grad(&p, x.view(), &y, &mut g, &mut ws).is_ok());
        for bad in [6.0, -1.0, 2.5, f32::NAN, f32::INFINITY] {
            let mut xb = x.clone();
            xb[[1, 2]] = bad;
            let e = m
                .loss_and_grad(&p, xb.view(), &y, &mut g, &mut ws)
                .unwrap_err();
            assert!(e.to_string().contains("not an id in 0..6"), "{bad}: {e}");
        }
        let (wide, yw) = tokens(3, 5, 6, 1);
        assert!(m
            .loss_and_grad(&p, wide.view(), &yw, &mut g, &mut ws)
            .is_err());
        assert!(m
            .loss_and_grad(&p, x.view(), &y[..2], &mut g, &mut ws)
            .is_err());
        assert!(m
            .loss_and_grad(&p[1..], x.view(), &y, &mut g, &mut ws)
            .is_err());
        assert!(m
            .loss_and_grad(&p, x.view(), &y, &mut g[1..], &mut ws)
            .is_err());
        let (four, y4) = tokens(4, 4, 6, 1);
        assert!(m
            .loss_and_grad(&p, four.view(), &y4, &mut g, &mut ws)
            .is_err());
        // A transposed batch is read as well as a row-major one.
        let xt = x.t().to_owned();
        let mut g2 = vec![0.0; p.len()];
        m.loss_and_grad(&p, xt.t(), &y, &mut g2, &mut ws).unwrap();
        m.loss_and_grad(&p, x.view(), &y, &mut g, &mut ws).unwrap();
        assert_eq!(g, g2);
        // Workspaces of other models are refused both ways.
        let other = tiny("gpt:1,8,4,4", 4, 6);
        assert!(m
            .loss_and_grad(&p, x.view(), &y, &mut g, &mut other.workspace(3))
            .is_err());
        let mlp = Model::new(ModelSpec::parse("mlp:4", 5, 6).unwrap()).unwrap();
        let mut mws = mlp.workspace(3);
        assert!(m.loss_and_grad(&p, x.view(), &y, &mut g, &mut mws).is_err());
        let mp = mlp.init_params(1);
        let mut mg = vec![0.0; mp.len()];
        assert!(mlp
            .loss_and_grad(&mp, x.view(), &y, &mut mg, &mut ws)
            .is_err());
        assert!(mlp.evaluate(&mp, x.view(), &y, &mut ws).is_err());
        // Sampling.
        let mut r = Rng::new(1);
        assert!(mlp.generate(&mp, &[1], 3, 1.0, &mut r).is_err());
        assert!(m.generate(&p, &[], 3, 1.0, &mut r).is_err());
        assert!(m.generate(&p, &[6], 3, 1.0, &mut r).is_err());
        assert!(m.generate(&p, &[1], MAX_GENERATE + 1, 1.0, &mut r).is_err());
        assert!(m.generate(&p, &[1], 3, -1.0, &mut r).is_err());
        assert!(m.generate(&p, &[1], 3, f32::NAN, &mut r).is_err());
        assert!(m.generate(&p[1..], &[1], 3, 1.0, &mut r).is_err());
        // A prompt longer than the context is cropped to its last T tokens.
        let long: Vec<u32> = (0..11).map(|i| i % 6).collect();
        let a = m.generate(&p, &long, 5, 0.0, &mut r).unwrap();
        let b = m.generate(&p, &long[7..], 5, 0.0, &mut r).unwrap();
        assert_eq!(a.len(), 5);
        assert_eq!(a[0], b[0]);
        assert!(m.generate(&p, &[1], 0, 1.0, &mut r).unwrap().is_empty());
    }

    #[test]
    fn layout_stages_and_times() {
        let m = tiny("gpt", 64, 100);
        assert_eq!(m.spec().to_string(), "gpt:4,128,4,64 65-100");
        let n = m.param_len();
        assert!((750_000..850_000).contains(&n), "{n} parameters");
        assert_eq!(n as u128, param_count(&m.sequence().unwrap()));
        let names: Vec<&str> = m.layout().tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names[..4],
            [
                "tok_emb.weight",
                "pos_emb.weight",
                "block0.ln1.weight",
                "block0.ln1.bias"
            ]
        );
        assert_eq!(names[names.len() - 2..], ["ln_f.weight", "ln_f.bias"]);
        assert_eq!(names.len(), 2 + 4 * 12 + 2);
        let l = m.layout();
        assert_eq!(l.get("block3.attn.qkv.weight").unwrap().shape, [128, 384]);
        assert_eq!(l.get("block1.mlp.proj.weight").unwrap().shape, [512, 128]);
        assert_eq!(l.get("tok_emb.weight").unwrap().shape, [100, 128]);
        assert_eq!(l.get("pos_emb.weight").unwrap().offset, 100 * 128);
        let u = tiny("gpt:4,128,4,64/untied", 64, 100);
        let head = u.layout().tensors.last().cloned().unwrap();
        assert_eq!(
            (head.name.as_str(), head.shape.clone()),
            ("head.weight", vec![128, 100])
        );
        assert_eq!(u.param_len(), n + 128 * 100);
        // Init: gains 1, biases 0, residual projections narrower.
        let p = u.init_params(3);
        assert_eq!(p, u.init_params(3));
        assert_ne!(p, u.init_params(4));
        let std = |name: &str| {
            let t = l.get(name).unwrap_or_else(|| u.layout().get(name).unwrap());
            let v = &p[t.offset..t.offset + t.len()];
            (v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / v.len() as f64).sqrt()
        };
        assert!((std("tok_emb.weight") - 0.02).abs() < 0.002);
        assert!((std("block0.attn.qkv.weight") - 0.02).abs() < 0.002);
        assert!((std("head.weight") - 0.02).abs() < 0.002);
        assert!((std("block2.mlp.proj.weight") - 0.02 / 8f64.sqrt()).abs() < 0.001);
        assert!((std("block2.attn.proj.weight") - 0.02 / 8f64.sqrt()).abs() < 0.001);
        let ln = u.layout().get("block1.ln2.weight").unwrap();
        assert!(p[ln.offset..ln.offset + 128].iter().all(|&v| v == 1.0));
        let b = u.layout().get("block1.mlp.fc.bias").unwrap();
        assert!(p[b.offset..b.offset + 512].iter().all(|&v| v == 0.0));
        // Stages and their times.
        let m = tiny("gpt:2,8,2,4", 4, 5);
        assert_eq!(m.stage_names(), ["embed", "block0", "block1", "head"]);
        assert!(!m.has_dropout());
        let p = m.init_params(1);
        let (x, y) = tokens(2, 4, 5, 1);
        let mut ws = m.workspace(2);
        let mut g = vec![0.0; p.len()];
        let mut times = m.layer_times();
        let mut t = 0.0;
        let mut clock = || {
            t += 1.0;
            t
        };
        m.loss_and_grad_timed(&p, x.view(), &y, 0, &mut g, &mut ws, &mut clock, &mut times)
            .unwrap();
        assert_eq!(times.forward, vec![1.0; 4]);
        assert_eq!(times.backward, vec![1.0; 4]);
        assert_eq!(times.loss, 1.0);
        let mut g2 = vec![0.0; p.len()];
        m.loss_and_grad_seeded(&p, x.view(), &y, 99, &mut g2, &mut ws)
            .unwrap();
        assert_eq!(g, g2, "no dropout: the seed changes nothing");
    }
}
