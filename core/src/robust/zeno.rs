//! `zeno`, Zeno++ proper: pushes are scored against the gradient of a validation batch the
//! driver holds ([`ZenoReference`], [`Consensus::check_zeno`]).

use super::consensus::dots;
use super::Consensus;
use crate::error::{Error, Result};

/// Examples in `zeno`'s validation batch, strided through the training set
/// ([`ZenoReference`]).
pub const ZENO_BATCH: usize = 128;

/// `zeno`'s ρ: larger than [`CONSENSUS_RHO`](super::CONSENSUS_RHO), because the validation gradient is a reliable
/// direction: a push of r times the usual norm needs a cosine of at least 0.1·r − E/r with it.
pub const ZENO_RHO: f64 = 0.1;

/// Norms `zeno` needs before its norm term counts (the median of 4 survives one outlier).
pub const ZENO_NORM_WARMUP: usize = 4;

/// Updates of shard 0 between two refreshes of `zeno`'s reference gradient (Zeno++'s lazy
/// update of its validation gradient).
pub const ZENO_REFRESH: u64 = 16;

impl Consensus {
    /// Whether `grad` may be applied under `zeno` with margin `margin`: the score of
    /// [`Consensus::check`] with the reference as the direction. Always before the first
    /// reference and for a zero push; the norm term counts once [`ZENO_NORM_WARMUP`] norms are
    /// known (before, r = 1: the direction alone decides), with ρ = [`ZENO_RHO`].
    ///
    /// # Errors
    /// The reason, when the push's score is below `-margin`.
    pub fn check_zeno(
        &mut self,
        grad: &[f32],
        margin: f32,
        ratio: Option<f64>,
    ) -> std::result::Result<(), String> {
        let Some(v) = self.reference.as_deref().filter(|v| v.len() == grad.len()) else {
            return Ok(());
        };
        let (dot, gg, vv) = dots(grad, v);
        if gg == 0.0 || vv == 0.0 {
            return Ok(());
        }
        let cos = dot / (gg.sqrt() * vv.sqrt());
        let r = match ratio {
            Some(r) if r.is_finite() => r,
            _ => {
                let median = self.median_norm();
                if self.norms.len() < ZENO_NORM_WARMUP || median == 0.0 {
                    1.0
                } else {
                    gg.sqrt() / median
                }
            }
        };
        let score = cos * r - ZENO_RHO * r * r;
        if score < -f64::from(margin) {
            return Err(format!(
                "the push would raise the loss of the server's validation batch: cosine {cos:.3} with its gradient at {r:.2}x the usual norm scores {score:.3} < -{margin}"
            ));
        }
        Ok(())
    }
}

/// `zeno`'s validation batch and the gradient of the model on it: what a driver holding the
/// training data (the server, the simulator) computes every [`ZENO_REFRESH`] updates and gives
/// each shard its slice of ([`crate::session::ShardState::set_reference`]).
///
/// The batch is [`ZENO_BATCH`] examples strided evenly through the training set (the same for
/// every run on that set), normalised as the run's workers normalise theirs.
#[derive(Debug)]
pub struct ZenoReference {
    model: crate::model::Model,
    x: ndarray::Array2<f32>,
    y: Vec<u8>,
    ws: crate::model::Workspace,
    grad: Vec<f32>,
}

impl ZenoReference {
    /// The validation batch of `train` (already normalised by the run's rule) for `model`.
    ///
    /// # Errors
    /// [`Error::Config`] for an empty training set.
    pub fn new(model: crate::model::Model, train: &crate::data::Dataset) -> Result<Self> {
        let n = train.len();
        if n == 0 {
            return Err(Error::Config("zeno needs a training set".into()));
        }
        let b = ZENO_BATCH.min(n);
        let idx: Vec<u32> = (0..b).map(|i| (i * n / b) as u32).collect();
        let mut x = ndarray::Array2::zeros((b, train.features));
        let mut y = vec![0u8; b];
        train.fill_batch(&idx, &mut x.view_mut(), &mut y);
        let ws = model.workspace(b);
        let grad = vec![0.0; model.param_len()];
        Ok(Self {
            model,
            x,
            y,
            ws,
            grad,
        })
    }

    /// The gradient of the validation batch's mean loss at `params` (the whole model).
    ///
    /// # Errors
    /// When `params` does not fit the model.
    pub fn gradient(&mut self, params: &[f32]) -> Result<&[f32]> {
        self.model
            .loss_and_grad(params, self.x.view(), &self.y, &mut self.grad, &mut self.ws)?;
        Ok(&self.grad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::robust::testing::sgd_shard;
    use crate::robust::Aggregation;
    use crate::shard::{Consistency, Outcome};
    use crate::wire::ErrorCode;

    /// Zeno++ against a reference: nothing is refused before there is one; then a push against
    /// the validation gradient is, from the first push (no warm-up of the direction), a push
    /// along it is not, and one of many times the usual norm must agree with it closely.
    #[test]
    fn zeno_refuses_pushes_against_the_validation_gradient() {
        let mut c = Consensus::default();
        let v = [1.0, 0.5, -0.2];
        let flipped: Vec<f32> = v.iter().map(|x| -10.0 * x).collect();
        assert!(
            c.check_zeno(&flipped, 0.5, None).is_ok(),
            "no reference yet"
        );
        c.set_reference(&v);
        let e = c.check_zeno(&flipped, 0.5, None).unwrap_err();
        assert!(e.contains("validation batch"), "{e}");
        // Slightly against it, at the usual norm: within the margin.
        let slightly = [0.9, 0.5, 0.8];
        assert!(c.check_zeno(&slightly, 0.5, None).is_ok());
        assert!(
            c.check_zeno(&[0.0; 3], 0.5, None).is_ok(),
            "a zero push moves nothing"
        );
        for _ in 0..ZENO_NORM_WARMUP {
            c.observe(&v);
        }
        // 10x the usual norm sideways (cosine 0): 0 - 0.1 x 100 < -0.5.
        let sideways = [0.0, 4.0, 10.0];
        assert!(c.check_zeno(&sideways, 0.5, None).is_err());
        let along: Vec<f32> = v.iter().map(|x| 10.0 * x).collect();
        assert!(
            c.check_zeno(&along, 0.5, None).is_ok(),
            "cosine 1 at 10x: 10 - 10 = 0"
        );
        // A reference of another length (a bug in a driver) turns the check off.
        assert!(c.check_zeno(&[1.0, 2.0], 0.5, None).is_ok());
    }

    #[test]
    fn an_async_zeno_shard_refuses_a_flipped_push_and_changes_nothing() {
        let mut s = sgd_shard(
            vec![0.0; 2],
            Consistency::Async,
            Aggregation::Zeno { margin: 0.5 },
        );
        s.set_reference(&[1.0, 2.0]);
        let (version, values) = (s.version(), s.values().clone());
        match s.push(version, &[-1.0, -2.0]) {
            Outcome::Rejected {
                code: ErrorCode::Disagrees,
                ..
            } => {}
            other => panic!("{other:?}"),
        }
        assert_eq!((s.version(), s.values()), (version, &values));
        assert!(matches!(s.push(0, &[1.0, 1.0]), Outcome::Applied { .. }));
    }
}
