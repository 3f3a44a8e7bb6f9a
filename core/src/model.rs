//! Models over a flat parameter vector: softmax regression and ReLU MLPs with softmax
//! cross-entropy, forward and backward on f32 with ndarray (blocked GEMM through
//! `matrixmultiply`). All scratch lives in a [`Workspace`] sized once, so a training step does not
//! allocate.
//!
//! Layout of the flat vector, layer by layer: `layer{i}.weight` `[fan_in, fan_out]` row-major,
//! then `layer{i}.bias` `[fan_out]`.

use crate::error::{Error, Result};
use crate::rng::Rng;
use ndarray::linalg::general_mat_mul;
use ndarray::{s, Array2, ArrayView1, ArrayView2, ArrayViewMut2, Axis};
use serde::{Deserialize, Serialize};
use std::fmt;

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

/// Architecture of a model: `inputs -> hidden... -> classes`, ReLU between layers, softmax on
/// top. No hidden layer is softmax (multinomial logistic) regression.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Input features (784 for MNIST).
    pub inputs: usize,
    /// Widths of the hidden ReLU layers; empty for softmax regression.
    pub hidden: Vec<usize>,
    /// Number of classes.
    pub classes: usize,
}

impl ModelSpec {
    /// Parses `softmax` or `mlp:W1[,W2...]` (e.g. `mlp:128`, `mlp:256,128`) for the given input
    /// and class counts.
    ///
    /// # Errors
    /// [`Error::Config`] on any other text, a zero width, or zero inputs/classes.
    pub fn parse(text: &str, inputs: usize, classes: usize) -> Result<Self> {
        let hidden = match text.trim() {
            "softmax" => Vec::new(),
            t => {
                let widths = t.strip_prefix("mlp:").ok_or_else(|| {
                    Error::Config(format!(
                        "unknown model {t:?}: use `softmax` or `mlp:W1,W2,...`"
                    ))
                })?;
                widths
                    .split(',')
                    .map(|w| match w.trim().parse::<usize>() {
                        Ok(n) if (1..=65_536).contains(&n) => Ok(n),
                        _ => Err(Error::Config(format!("bad hidden width {w:?} in {t:?}"))),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
        };
        let spec = Self {
            inputs,
            hidden,
            classes,
        };
        spec.validate()?;
        Ok(spec)
    }

    /// Checks the dimensions are usable.
    ///
    /// # Errors
    /// [`Error::Config`] for zero inputs, fewer than 2 classes, a zero width, or more than
    /// 2^31 parameters.
    pub fn validate(&self) -> Result<()> {
        if self.inputs == 0 || self.classes < 2 || self.hidden.contains(&0) {
            return Err(Error::Config(format!("unusable model dimensions {self}")));
        }
        let mut n: u128 = 0;
        for w in self.dims().windows(2) {
            n += (w[0] as u128 + 1) * w[1] as u128;
        }
        if n > (1u128 << 31) {
            return Err(Error::Config(format!(
                "model {self} has {n} parameters, too many"
            )));
        }
        Ok(())
    }

    /// Layer widths including input and output: `[inputs, hidden..., classes]`.
    pub fn dims(&self) -> Vec<usize> {
        let mut d = vec![self.inputs];
        d.extend(&self.hidden);
        d.push(self.classes);
        d
    }

    /// The flat parameter layout.
    pub fn layout(&self) -> ParamLayout {
        let mut l = ParamLayout::default();
        for (i, w) in self.dims().windows(2).enumerate() {
            l.push(format!("layer{i}.weight"), vec![w[0], w[1]]);
            l.push(format!("layer{i}.bias"), vec![w[1]]);
        }
        l
    }

    /// Number of parameters.
    pub fn param_len(&self) -> usize {
        self.layout().len()
    }
}

impl fmt::Display for ModelSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dims: Vec<String> = self.dims().iter().map(ToString::to_string).collect();
        let kind = if self.hidden.is_empty() {
            "softmax"
        } else {
            "mlp"
        };
        write!(f, "{kind} {}", dims.join("-"))
    }
}

/// Loss and accuracy counts over a batch.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BatchStats {
    /// Sum over the batch of the cross-entropy loss.
    pub loss_sum: f64,
    /// Number of correct argmax predictions.
    pub correct: usize,
    /// Number of examples.
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

/// Scratch for forward and backward passes of up to `capacity` examples.
#[derive(Debug, Clone)]
pub struct Workspace {
    capacity: usize,
    /// Output of every layer (post-ReLU for hidden layers, logits for the last).
    acts: Vec<Array2<f32>>,
    /// Loss gradient with respect to each layer's pre-activation.
    deltas: Vec<Array2<f32>>,
}

/// A model: its spec and precomputed layout.
#[derive(Debug, Clone)]
pub struct Model {
    spec: ModelSpec,
    dims: Vec<usize>,
    layout: ParamLayout,
}

impl Model {
    /// A model for `spec`.
    ///
    /// # Errors
    /// As [`ModelSpec::validate`].
    pub fn new(spec: ModelSpec) -> Result<Self> {
        spec.validate()?;
        Ok(Self {
            dims: spec.dims(),
            layout: spec.layout(),
            spec,
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

    /// Scratch for batches of up to `capacity` rows.
    pub fn workspace(&self, capacity: usize) -> Workspace {
        let capacity = capacity.max(1);
        let layers = &self.dims[1..];
        Workspace {
            capacity,
            acts: layers
                .iter()
                .map(|&d| Array2::zeros((capacity, d)))
                .collect(),
            deltas: layers
                .iter()
                .map(|&d| Array2::zeros((capacity, d)))
                .collect(),
        }
    }

    /// Deterministic initial parameters: He-normal weights for ReLU layers, Glorot-normal for the
    /// output layer, zero biases.
    pub fn init_params(&self, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        let mut p = vec![0.0f32; self.param_len()];
        let last = self.dims.len() - 2;
        for (i, w) in self.dims.windows(2).enumerate() {
            let t = &self.layout.tensors[2 * i];
            let std = if i == last {
                (2.0 / (w[0] + w[1]) as f64).sqrt()
            } else {
                (2.0 / w[0] as f64).sqrt()
            };
            for v in &mut p[t.offset..t.offset + t.len()] {
                *v = (rng.normal() * std) as f32;
            }
        }
        p
    }

    fn weight<'a>(&self, params: &'a [f32], layer: usize) -> ArrayView2<'a, f32> {
        let t = &self.layout.tensors[2 * layer];
        ArrayView2::from_shape(
            (t.shape[0], t.shape[1]),
            &params[t.offset..t.offset + t.len()],
        )
        .expect("layout matches shape")
    }

    fn bias<'a>(&self, params: &'a [f32], layer: usize) -> ArrayView1<'a, f32> {
        let t = &self.layout.tensors[2 * layer + 1];
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
        if x.ncols() != self.spec.inputs || x.nrows() != y.len() || x.nrows() > ws.capacity {
            return Err(Error::Config(format!(
                "batch of {}x{} with {} labels does not fit model {} / workspace {}",
                x.nrows(),
                x.ncols(),
                y.len(),
                self.spec,
                ws.capacity
            )));
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
    fn forward(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
        y: &[u8],
        ws: &mut Workspace,
    ) -> BatchStats {
        let b = x.nrows();
        let layers = self.dims.len() - 1;
        for l in 0..layers {
            let (done, rest) = ws.acts.split_at_mut(l);
            let mut out = rest[0].slice_mut(s![..b, ..]);
            out.assign(
                &self
                    .bias(params, l)
                    .broadcast((b, self.dims[l + 1]))
                    .expect("bias broadcast"),
            );
            let input = if l == 0 {
                x.view()
            } else {
                done[l - 1].slice(s![..b, ..])
            };
            general_mat_mul(1.0, &input, &self.weight(params, l), 1.0, &mut out);
            if l + 1 < layers {
                out.mapv_inplace(|v| v.max(0.0));
            }
        }
        let logits = ws.acts[layers - 1].slice(s![..b, ..]);
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

    /// Mean softmax cross-entropy of the batch and its gradient, written into `grad` (same layout
    /// as `params`, overwritten).
    ///
    /// # Errors
    /// When `params`/`grad` have the wrong length, the batch does not fit the model or the
    /// workspace, or a label is out of range.
    pub fn loss_and_grad(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
        y: &[u8],
        grad: &mut [f32],
        ws: &mut Workspace,
    ) -> Result<BatchStats> {
        self.check(params, &x, y, ws)?;
        if grad.len() != params.len() {
            return Err(Error::WrongLength {
                expected: params.len(),
                got: grad.len(),
            });
        }
        let stats = self.forward(params, x.view(), y, ws);
        let b = x.nrows();
        let layers = self.dims.len() - 1;
        let inv_b = 1.0 / b as f32;
        // dL/dlogits = (softmax - onehot) / B
        {
            let logits = ws.acts[layers - 1].slice(s![..b, ..]);
            let mut d = ws.deltas[layers - 1].slice_mut(s![..b, ..]);
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
        for l in (0..layers).rev() {
            let tw = &self.layout.tensors[2 * l];
            let tb = &self.layout.tensors[2 * l + 1];
            let (gw, gb) = grad[tw.offset..tb.offset + tb.len()].split_at_mut(tw.len());
            let mut gw = ArrayViewMut2::from_shape((tw.shape[0], tw.shape[1]), gw).expect("layout");
            {
                let delta = ws.deltas[l].slice(s![..b, ..]);
                let input = if l == 0 {
                    x.view()
                } else {
                    ws.acts[l - 1].slice(s![..b, ..])
                };
                general_mat_mul(1.0, &input.t(), &delta, 0.0, &mut gw);
                for (g, col) in gb.iter_mut().zip(delta.axis_iter(Axis(1))) {
                    *g = col.sum();
                }
            }
            if l > 0 {
                let (lower, upper) = ws.deltas.split_at_mut(l);
                let mut dprev = lower[l - 1].slice_mut(s![..b, ..]);
                general_mat_mul(
                    1.0,
                    &upper[0].slice(s![..b, ..]),
                    &self.weight(params, l).t(),
                    0.0,
                    &mut dprev,
                );
                let act = ws.acts[l - 1].slice(s![..b, ..]);
                ndarray::Zip::from(&mut dprev).and(&act).for_each(|d, &a| {
                    if a <= 0.0 {
                        *d = 0.0;
                    }
                });
            }
        }
        Ok(stats)
    }

    /// Loss and accuracy on a batch without computing gradients.
    ///
    /// # Errors
    /// As [`Model::loss_and_grad`].
    pub fn evaluate(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
        y: &[u8],
        ws: &mut Workspace,
    ) -> Result<BatchStats> {
        self.check(params, &x, y, ws)?;
        Ok(self.forward(params, x, y, ws))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toy_batch(rows: usize, cols: usize, classes: usize, seed: u64) -> (Array2<f32>, Vec<u8>) {
        let mut r = Rng::new(seed);
        let x = Array2::from_shape_fn((rows, cols), |_| r.normal() as f32);
        let y = (0..rows).map(|_| r.below(classes as u64) as u8).collect();
        (x, y)
    }

    fn finite_difference_check(spec: ModelSpec) {
        let model = Model::new(spec).unwrap();
        let mut params = model.init_params(3);
        // Non-zero biases so every path is exercised.
        let mut r = Rng::new(9);
        for t in model
            .layout()
            .tensors
            .iter()
            .filter(|t| t.name.ends_with("bias"))
        {
            for v in &mut params[t.offset..t.offset + t.len()] {
                *v = (r.normal() * 0.1) as f32;
            }
        }
        let (x, y) = toy_batch(5, model.spec().inputs, model.spec().classes, 4);
        let mut ws = model.workspace(8);
        let mut grad = vec![0.0; params.len()];
        model
            .loss_and_grad(&params, x.view(), &y, &mut grad, &mut ws)
            .unwrap();
        // The loss is piecewise smooth: a perturbation that flips a ReLU crosses a kink and the
        // central difference is meaningless there, so such parameters are skipped (and counted).
        let hidden = model.spec().hidden.len();
        let eval = |p: &[f32], ws: &mut Workspace| -> (f64, Vec<bool>) {
            let l = model.evaluate(p, x.view(), &y, ws).unwrap().mean_loss();
            let mask = ws.acts[..hidden]
                .iter()
                .flat_map(|a| {
                    a.slice(s![..x.nrows(), ..])
                        .iter()
                        .map(|&v| v > 0.0)
                        .collect::<Vec<_>>()
                })
                .collect();
            (l, mask)
        };
        let (_, base_mask) = eval(&params, &mut ws);
        let h = 1e-2f32;
        let mut worst = 0.0f64;
        let mut skipped = 0;
        for i in 0..params.len() {
            let mut p = params.clone();
            p[i] += h;
            let (up, m_up) = eval(&p, &mut ws);
            p[i] -= 2.0 * h;
            let (down, m_down) = eval(&p, &mut ws);
            if m_up != base_mask || m_down != base_mask {
                skipped += 1;
                continue;
            }
            let numeric = (up - down) / (2.0 * h as f64);
            let err =
                (numeric - grad[i] as f64).abs() / (numeric.abs() + grad[i].abs() as f64).max(1e-2);
            worst = worst.max(err);
        }
        assert!(
            skipped * 4 < params.len(),
            "{skipped} of {} parameters sit on a kink",
            params.len()
        );
        assert!(worst < 2e-2, "worst relative error {worst}");
    }

    #[test]
    fn softmax_gradient_matches_finite_differences() {
        finite_difference_check(ModelSpec::parse("softmax", 6, 4).unwrap());
    }

    #[test]
    fn mlp_gradient_matches_finite_differences() {
        finite_difference_check(ModelSpec::parse("mlp:7", 6, 3).unwrap());
        finite_difference_check(ModelSpec::parse("mlp:5,4", 6, 3).unwrap());
    }

    #[test]
    fn layout_and_parse() {
        let s = ModelSpec::parse("mlp:128", 784, 10).unwrap();
        assert_eq!(s.param_len(), 784 * 128 + 128 + 128 * 10 + 10);
        let l = s.layout();
        assert_eq!(l.get("layer1.weight").unwrap().offset, 784 * 128 + 128);
        assert_eq!(s.to_string(), "mlp 784-128-10");
        assert!(ModelSpec::parse("mlp:", 784, 10).is_err());
        assert!(ModelSpec::parse("mlp:0", 784, 10).is_err());
        assert!(ModelSpec::parse("cnn", 784, 10).is_err());
        assert!(ModelSpec::parse("softmax", 784, 1).is_err());
    }

    #[test]
    fn init_is_deterministic_and_bad_batches_are_errors() {
        let m = Model::new(ModelSpec::parse("mlp:16", 8, 3).unwrap()).unwrap();
        assert_eq!(m.init_params(1), m.init_params(1));
        assert_ne!(m.init_params(1), m.init_params(2));
        let p = m.init_params(1);
        let mut ws = m.workspace(4);
        let mut g = vec![0.0; p.len()];
        let (x, _) = toy_batch(2, 8, 3, 1);
        assert!(m
            .loss_and_grad(&p, x.view(), &[0, 5], &mut g, &mut ws)
            .is_err());
        assert!(m
            .loss_and_grad(&p, x.view(), &[0], &mut g, &mut ws)
            .is_err());
        assert!(m
            .loss_and_grad(&p[1..], x.view(), &[0, 1], &mut g, &mut ws)
            .is_err());
        let (big, yb) = toy_batch(5, 8, 3, 1);
        assert!(m
            .loss_and_grad(&p, big.view(), &yb, &mut g, &mut ws)
            .is_err());
    }
}
