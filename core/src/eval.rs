//! Evaluating parameters on a dataset: [`evaluate`], used by the server's side-car evaluator
//! and by the simulator, so both report loss and accuracy the same way. Pure computation (no
//! I/O, no threads), so it builds for wasm32 too.

use crate::data::Dataset;
use crate::model::{BatchStats, Model};
use ndarray::{s, Array2};

/// Examples per forward pass: bounds the workspace (about `CHUNK x widest layer` floats).
const CHUNK: usize = 1000;

/// Loss and accuracy of `params` on every example of `data`, in chunks of 1000, as `data`
/// fills its batches (so normalised as [`Dataset::set_normalize`] said).
///
/// Returns empty stats (`count` 0) when `params` or the dataset do not fit the model (wrong
/// parameter count, feature count or a label beyond the model's classes): an evaluation is a
/// report, and the callers (the evaluator thread, the simulator) have nothing better to do with
/// an error than to show nothing.
pub fn evaluate(model: &Model, params: &[f32], data: &Dataset) -> BatchStats {
    let n = CHUNK.min(data.len());
    if n == 0 {
        return BatchStats::default();
    }
    let mut ws = model.inference_workspace(n);
    let mut x = Array2::zeros((n, data.features));
    let mut y = vec![0u8; n];
    let mut idx: Vec<u32> = Vec::with_capacity(n);
    let mut total = BatchStats::default();
    let mut start = 0;
    while start < data.len() {
        let len = n.min(data.len() - start);
        idx.clear();
        idx.extend(start as u32..(start + len) as u32);
        let mut view = x.slice_mut(s![..len, ..]);
        data.fill_batch(&idx, &mut view, &mut y[..len]);
        match model.evaluate(params, x.slice(s![..len, ..]), &y[..len], &mut ws) {
            Ok(stats) => total.merge(stats),
            Err(_) => return BatchStats::default(),
        }
        start += len;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::encode_idx;
    use crate::model::ModelSpec;

    /// `n` 2x2 "images" with labels `i % 3`.
    fn toy(n: usize) -> Dataset {
        let pixels: Vec<u8> = (0..n * 4).map(|i| (i * 37 % 256) as u8).collect();
        let labels: Vec<u8> = (0..n).map(|i| (i % 3) as u8).collect();
        Dataset::from_idx(&encode_idx(&[n, 2, 2], &pixels), &encode_idx(&[n], &labels)).unwrap()
    }

    #[test]
    fn chunked_evaluation_equals_one_batch() {
        let model = Model::new(ModelSpec::parse("mlp:5", 4, 3).unwrap()).unwrap();
        let params = model.init_params(1);
        // 2500 examples: two full chunks and a partial one.
        let data = toy(2500);
        let got = evaluate(&model, &params, &data);
        let mut x = Array2::zeros((data.len(), 4));
        let mut y = vec![0u8; data.len()];
        let idx: Vec<u32> = (0..data.len() as u32).collect();
        data.fill_batch(&idx, &mut x.view_mut(), &mut y);
        let mut ws = model.workspace(data.len());
        let want = model.evaluate(&params, x.view(), &y, &mut ws).unwrap();
        assert_eq!(got.count, 2500);
        assert_eq!(got.correct, want.correct);
        assert!((got.loss_sum - want.loss_sum).abs() < 1e-6 * want.loss_sum.abs().max(1.0));
    }

    #[test]
    fn what_does_not_fit_gives_empty_stats() {
        let model = Model::new(ModelSpec::parse("softmax", 4, 3).unwrap()).unwrap();
        let data = toy(10);
        assert_eq!(evaluate(&model, &[0.0; 3], &data).count, 0);
        assert_eq!(evaluate(&model, &model.init_params(1), &toy(0)).count, 0);
    }
}
