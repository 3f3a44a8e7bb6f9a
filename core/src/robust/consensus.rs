//! `consensus` for async and SSP shards ([`Consensus`]): a push whose direction disagrees with
//! the recent accepted pushes, at its norm, is refused.

/// Pushes before [`Consensus`] starts refusing (it needs a direction and a norm to compare with).
pub const CONSENSUS_WARMUP: u64 = 16;

/// The consensus average's window: each push has weight `1 / CONSENSUS_WINDOW` (or
/// `1 / n` for the first ones).
pub const CONSENSUS_WINDOW: u64 = 32;

/// Recent push norms whose median scales the consensus.
pub const CONSENSUS_NORMS: usize = 64;

/// Zeno++'s ρ: the weight of the push's squared (relative) norm in the score.
pub const CONSENSUS_RHO: f64 = 0.01;

/// The running consensus of a shard's recent async/SSP pushes: direction and norm (module doc).
#[derive(Debug, Default, Clone)]
pub struct Consensus {
    /// Exponential moving average of the unit directions of recent pushes.
    ema: Vec<f32>,
    /// Pushes it has seen.
    seen: u64,
    /// Norms of the last [`CONSENSUS_NORMS`] pushes, and a buffer to sort them in.
    pub(super) norms: std::collections::VecDeque<f64>,
    sorted: Vec<f64>,
    /// `zeno`: this shard's slice of the validation gradient ([`Consensus::set_reference`]).
    pub(super) reference: Option<Vec<f32>>,
}

impl Consensus {
    /// `zeno`: compares pushes with `slice` (this shard's slice of a validation gradient)
    /// from now on.
    pub fn set_reference(&mut self, slice: &[f32]) {
        match &mut self.reference {
            Some(r) if r.len() == slice.len() => r.copy_from_slice(slice),
            r => *r = Some(slice.to_vec()),
        }
    }

    /// The reference slice, once set.
    pub fn reference(&self) -> Option<&[f32]> {
        self.reference.as_deref()
    }

    pub(super) fn median_norm(&mut self) -> f64 {
        self.sorted.clear();
        self.sorted.extend(self.norms.iter().copied());
        self.sorted.sort_unstable_by(f64::total_cmp);
        self.sorted
            .get(self.sorted.len() / 2)
            .copied()
            .unwrap_or(0.0)
    }

    /// Whether `grad` may be applied with margin `margin`: always during the first
    /// [`CONSENSUS_WARMUP`] pushes and for a zero push (it moves nothing).
    ///
    /// # Errors
    /// The reason, when the push's score is below `-margin`.
    pub fn check(&mut self, grad: &[f32], margin: f32) -> std::result::Result<(), String> {
        if self.seen < CONSENSUS_WARMUP || self.ema.len() != grad.len() {
            return Ok(());
        }
        let (dot, gg, ee) = dots(grad, &self.ema);
        let median = self.median_norm();
        if gg == 0.0 || ee == 0.0 || median == 0.0 {
            return Ok(());
        }
        let cos = dot / (gg.sqrt() * ee.sqrt());
        let r = gg.sqrt() / median;
        let score = cos * r - CONSENSUS_RHO * r * r;
        if score < -f64::from(margin) {
            return Err(format!(
                "the push disagrees with the recent consensus: cosine {cos:.3} at {r:.2}x the usual norm scores {score:.3} < -{margin}"
            ));
        }
        Ok(())
    }

    /// A push joins the consensus, whether it was refused or not (its unit direction, so every
    /// push weighs the same, and its norm).
    pub fn observe(&mut self, grad: &[f32]) {
        let norm = grad
            .iter()
            .map(|&g| f64::from(g) * f64::from(g))
            .sum::<f64>()
            .sqrt();
        if norm == 0.0 {
            return;
        }
        if self.ema.len() != grad.len() {
            self.ema = vec![0.0; grad.len()];
        }
        self.seen += 1;
        let w = 1.0 / self.seen.min(CONSENSUS_WINDOW) as f64;
        for (e, &g) in self.ema.iter_mut().zip(grad) {
            let u = f64::from(g) / norm;
            *e += (w * (u - f64::from(*e))) as f32;
        }
        if self.norms.len() >= CONSENSUS_NORMS {
            self.norms.pop_front();
        }
        self.norms.push_back(norm);
    }

    /// Pushes it has seen.
    pub fn seen(&self) -> u64 {
        self.seen
    }
}

/// ⟨a, b⟩, ‖a‖², ‖b‖² in f64.
pub(super) fn dots(a: &[f32], b: &[f32]) -> (f64, f64, f64) {
    let (mut dot, mut aa, mut bb) = (0.0f64, 0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (f64::from(x), f64::from(y));
        dot += x * y;
        aa += x * x;
        bb += y * y;
    }
    (dot, aa, bb)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::robust::testing::sgd_shard;
    use crate::robust::Aggregation;
    use crate::shard::{Consistency, Outcome};
    use crate::wire::ErrorCode;

    #[test]
    fn consensus_refuses_a_flipped_push_after_warmup_and_keeps_honest_ones() {
        let mut c = Consensus::default();
        let honest = |i: usize| vec![1.0 + 0.1 * (i % 3) as f32, 0.5, -0.2];
        let flipped: Vec<f32> = honest(0).iter().map(|v| -10.0 * v).collect();
        for i in 0..CONSENSUS_WARMUP as usize {
            assert!(c.check(&flipped, 0.5).is_ok(), "warmup accepts everything");
            c.observe(&honest(i));
        }
        assert_eq!(c.seen(), CONSENSUS_WARMUP);
        let e = c.check(&flipped, 0.5).unwrap_err();
        assert!(e.contains("cosine -"), "{e}");
        assert!(c.check(&honest(7), 0.5).is_ok());
        assert!(c.check(&[0.0; 3], 0.5).is_ok(), "a zero push moves nothing");
        // The usual norm pointing sideways passes; 10x the norm sideways does not.
        let sideways = [0.0, 0.2, 0.5];
        assert!(c.check(&sideways, 0.5).is_ok());
        let big: Vec<f32> = sideways.iter().map(|v| v * 10.0 * 1.1 / 0.54).collect();
        assert!(c.check(&big, 0.5).is_err());
        // A few huge pushes cannot steer it: every push weighs the same.
        for _ in 0..3 {
            c.observe(&flipped);
        }
        assert!(c.check(&honest(1), 0.5).is_ok());
    }

    #[test]
    fn an_async_consensus_shard_refuses_a_flipped_push_and_changes_nothing() {
        let rule = Aggregation::Consensus { margin: 0.5 };
        let mut s = sgd_shard(vec![0.0; 2], Consistency::Async, rule);
        for _ in 0..CONSENSUS_WARMUP {
            assert!(matches!(
                s.push(s.version(), &[0.01, 0.02]),
                Outcome::Applied { .. }
            ));
        }
        let (version, values) = (s.version(), s.values().clone());
        match s.push(version, &[-0.1, -0.2]) {
            Outcome::Rejected {
                code: ErrorCode::Disagrees,
                message,
            } => assert!(message.contains("consensus"), "{message}"),
            other => panic!("{other:?}"),
        }
        assert_eq!((s.version(), s.values()), (version, &values));
        assert!(matches!(
            s.push(version, &[0.02, 0.01]),
            Outcome::Applied { .. }
        ));
    }
}
