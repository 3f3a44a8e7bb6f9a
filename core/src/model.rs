//! Models as a list of layers over a flat parameter vector: dense, conv2d (stride, padding),
//! max- and average-pooling, ReLU, flatten and dropout, with softmax cross-entropy on top;
//! forward and backward on f32 with ndarray. Dense layers and convolutions (through im2col)
//! use the same GEMM switch ([`Gemm`]: `matrixmultiply`, or our load-splat SIMD128 kernel on
//! wasm). All scratch lives in a [`Workspace`] sized once (the GEMM's packing buffers grow on
//! the first step), so a training step does not allocate.
//!
//! - [`ModelSpec`] (in `model/spec.rs`): the layers, their text grammar (`--model`) and checks;
//!   `softmax` and `mlp:W` are names for layer lists, [`CNN`] the default convolutional one.
//! - [`Model`]: the compiled stages, [`Model::loss_and_grad`], [`Model::evaluate`].
//! - `model/kernels.rs`: im2col / col2im and the pooling loops.
//! - `model/gemm.rs`: [`Gemm`], the matrix products' kernels and their switch.
//! - `model/sparse.rs`: the first dense layer on a sparse batch, skipping zero inputs
//!   ([`SparseInput`], chosen per batch by its density).
//! - `model/gpt.rs`: the language model `gpt:L,D,H,T` (token and position embeddings,
//!   pre-LayerNorm transformer blocks with causal attention, a tied or untied head; cross-entropy
//!   at every position), behind the same [`Model`] API, plus [`Model::generate`]. It is a path
//!   of its own inside [`Model`] (not stages of the layer stack): its tensors, workspace and
//!   stages (`embed`, `block{i}`, `head`) are its own.
//!
//! Layout of the flat vector, for the i-th layer with parameters in order: `layer{i}.weight`
//! (dense `[fan_in, units]`, convolution `[KH, KW, C, filters]`, row-major), then
//! `layer{i}.bias` `[units]` / `[filters]`. [`ParamLayout`] lists every tensor's name, shape and
//! offset. A language model's tensors are named after their role instead (`tok_emb.weight`,
//! `block{i}.attn.qkv.weight`, ...: `model/gpt.rs`).

mod gemm;
mod gpt;
mod kernels;
mod sparse;
mod spec;

pub use gemm::{default_kernel, set_default_kernel, Gemm};
pub use sparse::{
    default_sparse_input, set_default_sparse_input, SparseInput, MAX_DENSITY as SPARSE_MAX_DENSITY,
};

pub use gpt::{EVAL_BUDGET, MAX_GENERATE};
use kernels::{col2im, im2col, pool_backward, pool_forward, ConvGeom, PoolGeom};
pub use spec::{
    Layer, ModelSpec, Resolved, SeqInfo, Shape, CNN, GPT, MAX_ACTIVATIONS, MAX_GPT_BLOCKS,
    MAX_GPT_CONTEXT, MAX_GPT_VOCAB, MAX_GPT_WIDTH, MAX_PARAMS, MAX_PATCHES,
};

use crate::error::{Error, Result};
use crate::rng::Rng;
use ndarray::{ArrayView1, ArrayView2, ArrayViewMut2, Axis};
use serde::{Deserialize, Serialize};

/// Which tensor lives at which offset of the flat parameter vector.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSpec {
    /// Name, e.g. `layer0.weight`.
    pub name: String,
    /// Shape, row-major.
    pub shape: Vec<usize>,
    /// Offset of the first element in the flat vector.
    pub offset: usize,
}

impl TensorSpec {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// True for a tensor with no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The named layout of a flat parameter vector.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ParamLayout {
    /// Tensors in order of offset, contiguous.
    pub tensors: Vec<TensorSpec>,
}

impl ParamLayout {
    /// Appends a tensor right after the last one.
    pub fn push(&mut self, name: impl Into<String>, shape: Vec<usize>) {
        let offset = self.len();
        self.tensors.push(TensorSpec {
            name: name.into(),
            shape,
            offset,
        });
    }

    /// Total number of parameters.
    pub fn len(&self) -> usize {
        self.tensors.last().map_or(0, |t| t.offset + t.len())
    }

    /// True for an empty layout.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The tensor called `name`.
    pub fn get(&self, name: &str) -> Option<&TensorSpec> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// Loss and accuracy counts over a batch. A language model counts positions, not examples
/// (`B x T` predictions), so its mean loss is the mean cross-entropy per token in nats and its
/// accuracy the next-token accuracy.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BatchStats {
    /// Sum over the batch of the cross-entropy loss.
    pub loss_sum: f64,
    /// Number of correct argmax predictions.
    pub correct: usize,
    /// Number of examples (of predicted positions, for a language model).
    pub count: usize,
}

impl BatchStats {
    /// Mean loss.
    pub fn mean_loss(&self) -> f64 {
        self.loss_sum / self.count.max(1) as f64
    }

    /// Accuracy in `[0, 1]`.
    pub fn accuracy(&self) -> f64 {
        self.correct as f64 / self.count.max(1) as f64
    }

    /// Adds another batch's counts.
    pub fn merge(&mut self, o: BatchStats) {
        self.loss_sum += o.loss_sum;
        self.correct += o.correct;
        self.count += o.count;
    }
}

/// im2col scratch budget (floats): a convolution processes as many examples at once as fit.
const COLS_BUDGET: usize = 1 << 20;

/// What one stage computes.
#[derive(Debug, Clone, Copy)]
enum Op {
    /// `out = in W + b`; `t` is the index of the weight tensor in the layout.
    Dense {
        t: usize,
        fan_in: usize,
        fan_out: usize,
    },
    /// im2col + GEMM.
    Conv { t: usize, g: ConvGeom },
    /// Max or average pooling.
    Pool { g: PoolGeom },
}

/// A layer that writes its own output buffer, with the element-wise layers after it (ReLU,
/// dropout) applied in place on that buffer; flatten is free (the layout is already flat).
#[derive(Debug, Clone)]
struct Stage {
    op: Op,
    in_len: usize,
    out_len: usize,
    relu: bool,
    /// Dropout rate, 0 for none.
    dropout: f32,
    /// Layers of the stage in the grammar, e.g. `conv:16x5x5+relu`.
    label: String,
}

/// Scratch for forward and backward passes of up to `capacity` examples, sized once.
#[derive(Debug, Clone)]
pub struct Workspace {
    capacity: usize,
    /// Output of every stage (after its ReLU and dropout), `capacity x out_len`.
    acts: Vec<Vec<f32>>,
    /// Loss gradient with respect to every stage's output; empty in an inference workspace.
    deltas: Vec<Vec<f32>>,
    /// Max-pooling winners per output.
    argmax: Vec<Vec<u32>>,
    /// Dropout multipliers (0 or `1 / (1 - rate)`) per output (training only).
    masks: Vec<Vec<f32>>,
    /// im2col scratch shared by the convolutions.
    cols: Vec<f32>,
    /// Examples per im2col chunk, per stage (1 for non-convolutions).
    chunks: Vec<usize>,
    train: bool,
    /// The GEMM kernel of every product.
    gemm: Gemm,
    /// Its packing buffers.
    scratch: gemm::Scratch,
    /// When the first dense layer skips zero inputs.
    sparse: SparseInput,
    /// The batch's nonzeros when it does.
    nonzeros: sparse::Nonzeros,
    /// A language model's buffers (`None` for a layer stack).
    seq: Option<gpt::GptWorkspace>,
    /// True when the last training forward pass took the sparse path (its backward does too).
    first_sparse: bool,
    /// Forward passes whose first layer took the sparse path (tests, benchmarks).
    sparse_passes: u64,
}

impl Workspace {
    /// The GEMM kernel this workspace computes with.
    pub fn gemm(&self) -> Gemm {
        self.gemm
    }

    /// Computes with `kernel` from now on (benchmarks and parity tests compare them).
    pub fn set_gemm(&mut self, kernel: Gemm) {
        self.gemm = kernel;
    }

    /// Floats held by the GEMM's packing buffers (they grow once, on the first products).
    pub fn gemm_scratch_len(&self) -> usize {
        self.scratch.capacity()
    }

    /// When the first dense layer skips the batch's zero inputs.
    pub fn sparse_input(&self) -> SparseInput {
        self.sparse
    }

    /// Chooses when the first dense layer skips zero inputs from now on.
    pub fn set_sparse_input(&mut self, choice: SparseInput) {
        self.sparse = choice;
    }

    /// Forward passes so far whose first layer took the sparse path.
    pub fn sparse_passes(&self) -> u64 {
        self.sparse_passes
    }

    /// Entries held by the sparse path's buffers (they grow once, on the first batch).
    pub fn sparse_buffer_len(&self) -> usize {
        self.nonzeros.capacity()
    }
}

/// Seconds spent per stage in [`Model::loss_and_grad_timed`], accumulated over calls.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerTimes {
    /// The stages ([`Model::stage_names`]).
    pub names: Vec<String>,
    /// Forward seconds per stage.
    pub forward: Vec<f64>,
    /// Backward seconds per stage (parameter and input gradients).
    pub backward: Vec<f64>,
    /// Softmax cross-entropy and its gradient.
    pub loss: f64,
}

/// A model: its spec, layout and the compiled stages.
#[derive(Debug, Clone)]
pub struct Model {
    spec: ModelSpec,
    layout: ParamLayout,
    /// A layer stack's stages (empty for a language model).
    stages: Vec<Stage>,
    /// A language model (then `stages` is empty).
    gpt: Option<gpt::Gpt>,
}

struct Clock<'a> {
    now: &'a mut dyn FnMut() -> f64,
    times: &'a mut LayerTimes,
    last: f64,
}

impl Clock<'_> {
    fn lap(&mut self) -> f64 {
        let t = (self.now)();
        let d = t - self.last;
        self.last = t;
        d
    }
}

fn tick(clock: &mut Option<Clock<'_>>, f: impl FnOnce(&mut LayerTimes, f64)) {
    if let Some(c) = clock {
        let d = c.lap();
        f(c.times, d);
    }
}

impl Model {
    /// A model for `spec`.
    ///
    /// # Errors
    /// As [`ModelSpec::validate`].
    pub fn new(spec: ModelSpec) -> Result<Self> {
        let resolved = spec.resolve()?;
        let layout = spec.layout();
        if let Some(info) = spec.sequence() {
            let g = gpt::Gpt::new(info, &layout)?;
            return Ok(Self {
                spec,
                layout,
                stages: Vec::new(),
                gpt: Some(g),
            });
        }
        let mut stages: Vec<Stage> = Vec::new();
        let mut t = 0;
        for r in &resolved {
            let op = match (r.layer, r.input, r.output) {
                (Layer::Dense { units }, input, _) => {
                    t += 2;
                    Op::Dense {
                        t: t - 2,
                        fan_in: input.len(),
                        fan_out: units,
                    }
                }
                (
                    Layer::Conv {
                        filters,
                        kernel,
                        stride,
                        padding,
                    },
                    Shape::Image { h, w, c },
                    Shape::Image { h: oh, w: ow, .. },
                ) => {
                    t += 2;
                    Op::Conv {
                        t: t - 2,
                        g: ConvGeom {
                            h,
                            w,
                            c,
                            kh: kernel[0],
                            kw: kernel[1],
                            filters,
                            stride,
                            pad: padding,
                            oh,
                            ow,
                        },
                    }
                }
                (
                    Layer::MaxPool { size, stride } | Layer::AvgPool { size, stride },
                    Shape::Image { h, w, c },
                    Shape::Image { h: oh, w: ow, .. },
                ) => Op::Pool {
                    g: PoolGeom {
                        h,
                        w,
                        c,
                        size,
                        stride,
                        oh,
                        ow,
                        max: matches!(r.layer, Layer::MaxPool { .. }),
                    },
                },
                (Layer::Relu | Layer::Dropout { .. } | Layer::Flatten, ..) => {
                    let Some(last) = stages.last_mut() else {
                        // resolve() refuses ReLU/dropout first; a leading flatten is free.
                        continue;
                    };
                    match r.layer {
                        Layer::Relu => last.relu = true,
                        Layer::Dropout { rate } => last.dropout = rate,
                        _ => continue,
                    }
                    last.label.push_str(&format!("+{}", r.layer));
                    continue;
                }
                _ => {
                    return Err(Error::Config(format!(
                        "layer {} has an unexpected input {}",
                        r.layer, r.input
                    )))
                }
            };
            stages.push(Stage {
                op,
                in_len: r.input.len(),
                out_len: r.output.len(),
                relu: false,
                dropout: 0.0,
                label: r.layer.to_string(),
            });
        }
        Ok(Self {
            spec,
            layout,
            stages,
            gpt: None,
        })
    }

    /// The spec.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The flat layout.
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// Number of parameters.
    pub fn param_len(&self) -> usize {
        self.layout.len()
    }

    /// The computing stages, e.g. `["conv:16x5x5+relu", "pool:2", ...]`: a layer with
    /// parameters or a pooling layer, with the ReLU/dropout after it; for a language model
    /// `["embed", "block0", ..., "head"]`.
    pub fn stage_names(&self) -> Vec<String> {
        match &self.gpt {
            Some(g) => g.stage_names(),
            None => self.stages.iter().map(|s| s.label.clone()).collect(),
        }
    }

    /// Number of stages ([`Model::stage_names`]).
    fn stage_count(&self) -> usize {
        self.gpt
            .as_ref()
            .map_or(self.stages.len(), |g| g.info.layers + 2)
    }

    /// The sizes of a language model, `None` for a layer stack ([`ModelSpec::sequence`]).
    pub fn sequence(&self) -> Option<SeqInfo> {
        self.gpt.as_ref().map(|g| g.info)
    }

    /// True when the model has a dropout layer (its gradient depends on a seed).
    pub fn has_dropout(&self) -> bool {
        self.stages.iter().any(|s| s.dropout > 0.0)
    }

    /// About how many f32 a [`Model::workspace`] (`train`) or [`Model::inference_workspace`]
    /// of `capacity` rows holds, without making one: what a server checks a worker's memory
    /// against before it serves a model (activations, their gradients, im2col columns).
    pub fn workspace_floats(&self, capacity: usize, train: bool) -> u128 {
        let capacity = capacity.max(1) as u128;
        if let Some(g) = &self.gpt {
            let per = gpt::floats_per_example(&g.info, train);
            return if train {
                per * capacity
            } else {
                (per * capacity).min(gpt::EVAL_BUDGET as u128)
            };
        }
        let acts: u128 = self.stages.iter().map(|s| s.out_len as u128).sum();
        let cols = COLS_BUDGET as u128;
        capacity * acts * if train { 2 } else { 1 } + cols
    }

    fn make_workspace(&self, capacity: usize, train: bool) -> Workspace {
        let capacity = capacity.max(1);
        let seq = self
            .gpt
            .as_ref()
            .map(|g| gpt::GptWorkspace::new(g.info, capacity, train));
        let chunks: Vec<usize> = self
            .stages
            .iter()
            .map(|s| match s.op {
                Op::Conv { g, .. } => {
                    (COLS_BUDGET / (g.positions() * g.patch()).max(1)).clamp(1, capacity)
                }
                _ => 1,
            })
            .collect();
        let cols = self
            .stages
            .iter()
            .zip(&chunks)
            .map(|(s, &n)| match s.op {
                Op::Conv { g, .. } => n * g.positions() * g.patch(),
                _ => 0,
            })
            .max()
            .unwrap_or(0);
        let per = |f: &dyn Fn(&Stage) -> bool| -> Vec<usize> {
            self.stages
                .iter()
                .map(|s| {
                    if train && f(s) {
                        capacity * s.out_len
                    } else {
                        0
                    }
                })
                .collect()
        };
        Workspace {
            capacity,
            acts: self
                .stages
                .iter()
                .map(|s| vec![0.0; capacity * s.out_len])
                .collect(),
            deltas: per(&|_| true).into_iter().map(|n| vec![0.0; n]).collect(),
            // Max-pool winners are written in evaluation too (a branch-free loop).
            argmax: self
                .stages
                .iter()
                .map(|s| match s.op {
                    Op::Pool { g } if g.max => vec![0; capacity * s.out_len],
                    _ => Vec::new(),
                })
                .collect(),
            masks: per(&|s| s.dropout > 0.0)
                .into_iter()
                .map(|n| vec![0.0; n])
                .collect(),
            cols: vec![0.0; cols],
            chunks,
            train,
            gemm: gemm::default_kernel(),
            scratch: gemm::Scratch::default(),
            sparse: sparse::default_sparse_input(),
            nonzeros: sparse::Nonzeros::default(),
            first_sparse: false,
            sparse_passes: 0,
            seq,
        }
    }

    /// Scratch for training (and evaluating) batches of up to `capacity` rows.
    pub fn workspace(&self, capacity: usize) -> Workspace {
        self.make_workspace(capacity, true)
    }

    /// Scratch for evaluating batches of up to `capacity` rows: no gradient buffers (about
    /// half the memory of [`Model::workspace`]); [`Model::loss_and_grad`] refuses it. A
    /// language model's holds at most [`EVAL_BUDGET`] floats (one block's activations, and as
    /// many examples as fit: [`Model::evaluate`] runs a larger batch in pieces).
    pub fn inference_workspace(&self, capacity: usize) -> Workspace {
        self.make_workspace(capacity, false)
    }

    /// Deterministic initial parameters: He-normal weights for the hidden layers (fan-in
    /// `KH * KW * C` for a convolution), Glorot-normal for the output layer, zero biases; the
    /// weights are drawn from one stream in layout order. A language model: every weight
    /// matrix and both embeddings `N(0, 0.02)`, the two residual projections of each block
    /// `N(0, 0.02 / sqrt(2L))`, biases 0, LayerNorm gains 1 (one stream in layout order too).
    pub fn init_params(&self, seed: u64) -> Vec<f32> {
        if let Some(g) = &self.gpt {
            return g.init_params(&self.layout, seed);
        }
        let mut rng = Rng::new(seed);
        let mut p = vec![0.0f32; self.param_len()];
        let weights: Vec<usize> = self
            .stages
            .iter()
            .filter_map(|s| match s.op {
                Op::Dense { t, .. } | Op::Conv { t, .. } => Some(t),
                Op::Pool { .. } => None,
            })
            .collect();
        for (i, &t) in weights.iter().enumerate() {
            let t = &self.layout.tensors[t];
            let fan_out = *t.shape.last().unwrap_or(&1);
            let fan_in = t.len() / fan_out.max(1);
            let std = if i + 1 == weights.len() {
                (2.0 / (fan_in + fan_out) as f64).sqrt()
            } else {
                (2.0 / fan_in as f64).sqrt()
            };
            for v in &mut p[t.offset..t.offset + t.len()] {
                *v = (rng.normal() * std) as f32;
            }
        }
        p
    }

    fn weight<'a>(&self, params: &'a [f32], t: usize) -> ArrayView2<'a, f32> {
        let t = &self.layout.tensors[t];
        let rows = t.len() / t.shape.last().copied().unwrap_or(1).max(1);
        ArrayView2::from_shape(
            (rows, t.len() / rows.max(1)),
            &params[t.offset..t.offset + t.len()],
        )
        .expect("layout matches shape")
    }

    fn bias<'a>(&self, params: &'a [f32], t: usize) -> ArrayView1<'a, f32> {
        let t = &self.layout.tensors[t + 1];
        ArrayView1::from(&params[t.offset..t.offset + t.len()])
    }

    fn check(
        &self,
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
        if x.ncols() != self.spec.inputs
            || x.nrows() != y.len()
            || x.nrows() > ws.capacity
            || ws.acts.len() != self.stages.len()
            || ws
                .acts
                .iter()
                .zip(&self.stages)
                .any(|(a, s)| a.len() != ws.capacity * s.out_len)
        {
            return Err(Error::Config(format!(
                "batch of {}x{} with {} labels does not fit model {} / workspace {}",
                x.nrows(),
                x.ncols(),
                y.len(),
                self.spec,
                ws.capacity
            )));
        }
        let first_is_dense = matches!(self.stages.first().map(|s| s.op), Some(Op::Dense { .. }));
        if !first_is_dense && x.as_slice().is_none() {
            return Err(Error::Config(
                "an image batch must be in standard (row-major) layout".into(),
            ));
        }
        if let Some(&bad) = y.iter().find(|&&c| c as usize >= self.spec.classes) {
            return Err(Error::Data(format!(
                "label {bad} outside {} classes",
                self.spec.classes
            )));
        }
        Ok(())
    }

    /// Forward pass; leaves logits in the last activation and returns loss/accuracy counts.
    /// `dropout` is `Some(seed)` in training.
    fn forward(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
        y: &[u8],
        ws: &mut Workspace,
        dropout: Option<u64>,
        clock: &mut Option<Clock<'_>>,
    ) -> BatchStats {
        let b = x.nrows();
        let train = ws.train;
        let xs = x.as_slice().unwrap_or(&[]);
        ws.first_sparse = false;
        for (i, st) in self.stages.iter().enumerate() {
            let (done, rest) = ws.acts.split_at_mut(i);
            let out = &mut rest[0][..b * st.out_len];
            match st.op {
                Op::Dense { t, fan_out, fan_in } => {
                    let mut o = ArrayViewMut2::from_shape((b, fan_out), &mut *out).expect("sized");
                    o.assign(&self.bias(params, t).broadcast((b, fan_out)).expect("bias"));
                    let input = if i == 0 {
                        x.view()
                    } else {
                        ArrayView2::from_shape((b, fan_in), &done[i - 1][..b * fan_in])
                            .expect("sized")
                    };
                    let w = self.weight(params, t);
                    // The data batch itself (row-major) may skip its zeros.
                    let nonzeros =
                        if i == 0 && ws.sparse != SparseInput::Off && xs.len() == b * fan_in {
                            Some(sparse::count_nonzeros(xs))
                        } else {
                            None
                        };
                    if let Some(nnz) = nonzeros.filter(|&n| ws.sparse.takes(n, xs.len())) {
                        let keep = dropout.is_some() && train;
                        let wv = w.as_slice().expect("a weight is row-major");
                        let o = o.as_slice_mut().expect("sized");
                        sparse::forward(&mut ws.nonzeros, xs, b, fan_in, nnz, wv, fan_out, o, keep);
                        ws.first_sparse = keep;
                        ws.sparse_passes += 1;
                    } else {
                        gemm::gemm(ws.gemm, &input, &w, 1.0, &mut o, &mut ws.scratch);
                    }
                }
                Op::Conv { t, g } => {
                    let input = stage_input(xs, done, i, b * st.in_len);
                    let w = self.weight(params, t);
                    let bias = self.bias(params, t);
                    let (per_in, per_out, patch) = (st.in_len, st.out_len, g.patch());
                    let mut e0 = 0;
                    while e0 < b {
                        let n = ws.chunks[i].min(b - e0);
                        let rows = n * g.positions();
                        let cols = &mut ws.cols[..rows * patch];
                        im2col(&g, &input[e0 * per_in..(e0 + n) * per_in], n, cols);
                        let cols = ArrayView2::from_shape((rows, patch), &*cols).expect("sized");
                        let mut o = ArrayViewMut2::from_shape(
                            (rows, g.filters),
                            &mut out[e0 * per_out..(e0 + n) * per_out],
                        )
                        .expect("sized");
                        o.assign(&bias.broadcast((rows, g.filters)).expect("bias"));
                        gemm::gemm(ws.gemm, &cols, &w, 1.0, &mut o, &mut ws.scratch);
                        e0 += n;
                    }
                }
                Op::Pool { g } => {
                    let input = stage_input(xs, done, i, b * st.in_len);
                    let argmax = if g.max {
                        &mut ws.argmax[i][..b * st.out_len]
                    } else {
                        &mut []
                    };
                    pool_forward(&g, input, b, out, argmax);
                }
            }
            if st.relu {
                out.iter_mut().for_each(|v| *v = v.max(0.0));
            }
            if let (Some(seed), true) = (dropout, st.dropout > 0.0 && train) {
                let mask = &mut ws.masks[i][..b * st.out_len];
                let mut rng = Rng::new(seed ^ (i as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03));
                let keep = 1.0 / (1.0 - st.dropout);
                // Drop when 24 random bits fall below rate * 2^24.
                let cut = (f64::from(st.dropout) * (1u64 << 24) as f64) as u64;
                for (m, v) in mask.iter_mut().zip(out.iter_mut()) {
                    *m = if rng.next_u64() >> 40 < cut {
                        0.0
                    } else {
                        keep
                    };
                    *v *= *m;
                }
            }
            tick(clock, |t, d| t.forward[i] += d);
        }
        let last = self.stages.len() - 1;
        let logits = ArrayView2::from_shape(
            (b, self.spec.classes),
            &ws.acts[last][..b * self.spec.classes],
        )
        .expect("sized");
        let mut stats = BatchStats {
            count: b,
            ..BatchStats::default()
        };
        for (row, &label) in logits.outer_iter().zip(y) {
            let (arg, max) =
                row.iter()
                    .enumerate()
                    .fold((0, f32::NEG_INFINITY), |(ai, am), (i, &v)| {
                        if v > am {
                            (i, v)
                        } else {
                            (ai, am)
                        }
                    });
            let lse = max + row.iter().map(|&v| (v - max).exp()).sum::<f32>().ln();
            stats.loss_sum += f64::from(lse - row[label as usize]);
            stats.correct += usize::from(arg == label as usize);
        }
        stats
    }

    /// Mean softmax cross-entropy of the batch and its gradient, written into `grad` (same
    /// layout as `params`, overwritten). Dropout, if the model has any, is seeded from the
    /// batch itself (a hash of `x` and `y`), so the gradient is a function of the parameters
    /// and the batch; [`Model::loss_and_grad_seeded`] takes the seed explicitly.
    ///
    /// A language model reads each row of `x` as `T + 1` token ids (exact f32 integers) and
    /// its loss is the mean over the batch's `B x T` positions; `y` must have one entry per
    /// row but is not read.
    ///
    /// # Errors
    /// When `params`/`grad` have the wrong length, the batch does not fit the model or the
    /// workspace (or the workspace is an inference one), a label is out of range, or (a
    /// language model) a token is not an id of the vocabulary.
    pub fn loss_and_grad(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
        y: &[u8],
        grad: &mut [f32],
        ws: &mut Workspace,
    ) -> Result<BatchStats> {
        let seed = if self.has_dropout() {
            batch_hash(&x, y)
        } else {
            0
        };
        self.loss_and_grad_seeded(params, x, y, seed, grad, ws)
    }

    /// [`Model::loss_and_grad`] with dropout masks drawn from `seed` (a worker passes one
    /// derived from its batch seed and step, so a gradient is reproducible from the
    /// parameters, the batch indices and the seed). Models without dropout ignore it.
    ///
    /// # Errors
    /// As [`Model::loss_and_grad`].
    pub fn loss_and_grad_seeded(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
        y: &[u8],
        seed: u64,
        grad: &mut [f32],
        ws: &mut Workspace,
    ) -> Result<BatchStats> {
        self.train_step(params, x, y, seed, grad, ws, &mut None)
    }

    /// [`Model::loss_and_grad_seeded`], adding the seconds each stage takes to `times`
    /// (reset it with [`Model::layer_times`]); `now` is a clock in seconds (core has none of
    /// its own: natively `Instant`, in a browser `performance.now()`).
    ///
    /// # Errors
    /// As [`Model::loss_and_grad`].
    #[allow(clippy::too_many_arguments)]
    pub fn loss_and_grad_timed(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
        y: &[u8],
        seed: u64,
        grad: &mut [f32],
        ws: &mut Workspace,
        now: &mut dyn FnMut() -> f64,
        times: &mut LayerTimes,
    ) -> Result<BatchStats> {
        if times.names.len() != self.stage_count() {
            *times = self.layer_times();
        }
        let last = now();
        let mut clock = Some(Clock { now, times, last });
        self.train_step(params, x, y, seed, grad, ws, &mut clock)
    }

    /// Zeroed [`LayerTimes`] for this model's stages.
    pub fn layer_times(&self) -> LayerTimes {
        LayerTimes {
            names: self.stage_names(),
            forward: vec![0.0; self.stage_count()],
            backward: vec![0.0; self.stage_count()],
            loss: 0.0,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn train_step(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
        y: &[u8],
        seed: u64,
        grad: &mut [f32],
        ws: &mut Workspace,
        clock: &mut Option<Clock<'_>>,
    ) -> Result<BatchStats> {
        if self.gpt.is_some() {
            return self.gpt_train_step(params, x, y, grad, ws, clock);
        }
        self.check(params, &x, y, ws)?;
        if !ws.train {
            return Err(Error::Config(
                "an inference workspace cannot compute gradients".into(),
            ));
        }
        if grad.len() != params.len() {
            return Err(Error::WrongLength {
                expected: params.len(),
                got: grad.len(),
            });
        }
        let stats = self.forward(params, x.view(), y, ws, Some(seed), clock);
        let b = x.nrows();
        let xs = x.as_slice().unwrap_or(&[]);
        let last = self.stages.len() - 1;
        let classes = self.spec.classes;
        let inv_b = 1.0 / b as f32;
        // dL/dlogits = (softmax - onehot) / B
        {
            let logits =
                ArrayView2::from_shape((b, classes), &ws.acts[last][..b * classes]).expect("sized");
            let mut d =
                ArrayViewMut2::from_shape((b, classes), &mut ws.deltas[last][..b * classes])
                    .expect("sized");
            for ((lrow, mut drow), &label) in logits.outer_iter().zip(d.outer_iter_mut()).zip(y) {
                let max = lrow.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0;
                for (dv, &lv) in drow.iter_mut().zip(lrow.iter()) {
                    *dv = (lv - max).exp();
                    sum += *dv;
                }
                let scale = inv_b / sum;
                drow.mapv_inplace(|v| v * scale);
                drow[label as usize] -= inv_b;
            }
        }
        tick(clock, |t, d| t.loss += d);
        for (i, st) in self.stages.iter().enumerate().rev() {
            let (lower, upper) = ws.deltas.split_at_mut(i);
            let delta = &mut upper[0][..b * st.out_len];
            if st.dropout > 0.0 {
                for (d, &m) in delta.iter_mut().zip(&ws.masks[i][..b * st.out_len]) {
                    *d *= m;
                }
            }
            if st.relu {
                for (d, &a) in delta.iter_mut().zip(&ws.acts[i][..b * st.out_len]) {
                    if a <= 0.0 {
                        *d = 0.0;
                    }
                }
            }
            let delta = &*delta;
            match st.op {
                Op::Dense { t, fan_in, fan_out } => {
                    let (tw, tb) = (&self.layout.tensors[t], &self.layout.tensors[t + 1]);
                    let (gw, gb) = grad[tw.offset..tb.offset + tb.len()].split_at_mut(tw.len());
                    let mut gw = ArrayViewMut2::from_shape((fan_in, fan_out), gw).expect("layout");
                    let delta = ArrayView2::from_shape((b, fan_out), delta).expect("sized");
                    let input = if i == 0 {
                        x.view()
                    } else {
                        ArrayView2::from_shape((b, fan_in), &ws.acts[i - 1][..b * fan_in])
                            .expect("sized")
                    };
                    if i == 0 && ws.first_sparse {
                        let (d, g) = (delta.as_slice().expect("sized"), gw.as_slice_mut());
                        let g = g.expect("layout");
                        sparse::weight_grad(&mut ws.nonzeros, fan_in, d, fan_out, g);
                    } else {
                        gemm::gemm(ws.gemm, &input.t(), &delta, 0.0, &mut gw, &mut ws.scratch);
                    }
                    for (g, col) in gb.iter_mut().zip(delta.axis_iter(Axis(1))) {
                        *g = col.sum();
                    }
                    if i > 0 {
                        let mut dprev =
                            ArrayViewMut2::from_shape((b, fan_in), &mut lower[i - 1][..b * fan_in])
                                .expect("sized");
                        let w = self.weight(params, t);
                        gemm::gemm(ws.gemm, &delta, &w.t(), 0.0, &mut dprev, &mut ws.scratch);
                    }
                }
                Op::Conv { t, g } => {
                    let (tw, tb) = (&self.layout.tensors[t], &self.layout.tensors[t + 1]);
                    let (gw, gb) = grad[tw.offset..tb.offset + tb.len()].split_at_mut(tw.len());
                    let patch = g.patch();
                    let mut gw = ArrayViewMut2::from_shape((patch, g.filters), gw).expect("layout");
                    gw.fill(0.0);
                    gb.fill(0.0);
                    let w = self.weight(params, t);
                    let input = stage_input(xs, &ws.acts, i, b * st.in_len);
                    let (per_in, per_out) = (st.in_len, st.out_len);
                    let mut e0 = 0;
                    while e0 < b {
                        let n = ws.chunks[i].min(b - e0);
                        let rows = n * g.positions();
                        let d = ArrayView2::from_shape(
                            (rows, g.filters),
                            &delta[e0 * per_out..(e0 + n) * per_out],
                        )
                        .expect("sized");
                        for row in d.outer_iter() {
                            for (gv, &dv) in gb.iter_mut().zip(row) {
                                *gv += dv;
                            }
                        }
                        let cols = &mut ws.cols[..rows * patch];
                        im2col(&g, &input[e0 * per_in..(e0 + n) * per_in], n, cols);
                        let cv = ArrayView2::from_shape((rows, patch), &*cols).expect("sized");
                        gemm::gemm(ws.gemm, &cv.t(), &d, 1.0, &mut gw, &mut ws.scratch);
                        if i > 0 {
                            let mut dc = ArrayViewMut2::from_shape((rows, patch), &mut *cols)
                                .expect("sized");
                            gemm::gemm(ws.gemm, &d, &w.t(), 0.0, &mut dc, &mut ws.scratch);
                            let dprev = &mut lower[i - 1][e0 * per_in..(e0 + n) * per_in];
                            dprev.fill(0.0);
                            col2im(&g, cols, n, dprev);
                        }
                        e0 += n;
                    }
                }
                Op::Pool { g } => {
                    if i > 0 {
                        let am = if g.max { &ws.argmax[i][..] } else { &[][..] };
                        pool_backward(&g, delta, am, b, &mut lower[i - 1][..b * st.in_len]);
                    }
                }
            }
            tick(clock, |t, d| t.backward[i] += d);
        }
        Ok(stats)
    }

    /// Loss and accuracy on a batch without computing gradients (no dropout).
    ///
    /// # Errors
    /// As [`Model::loss_and_grad`] (an inference workspace is fine here).
    pub fn evaluate(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
        y: &[u8],
        ws: &mut Workspace,
    ) -> Result<BatchStats> {
        if self.gpt.is_some() {
            return self.gpt_evaluate(params, x, y, ws);
        }
        self.check(params, &x, y, ws)?;
        Ok(self.forward(params, x, y, ws, None, &mut None))
    }
}

/// The input of stage `i`: the batch for the first, the previous stage's output otherwise.
fn stage_input<'a>(x: &'a [f32], acts: &'a [Vec<f32>], i: usize, len: usize) -> &'a [f32] {
    if i == 0 {
        &x[..len.min(x.len())]
    } else {
        &acts[i - 1][..len]
    }
}

/// FNV-1a over a batch's labels and pixel bits: the dropout seed of [`Model::loss_and_grad`].
fn batch_hash(x: &ArrayView2<'_, f32>, y: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |v: u64| {
        h ^= v;
        h = h.wrapping_mul(0x0100_0000_01b3);
    };
    y.iter().for_each(|&l| eat(u64::from(l)));
    x.iter().for_each(|v| eat(u64::from(v.to_bits())));
    h
}

#[cfg(test)]
mod tests;
