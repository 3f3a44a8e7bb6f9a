//! The push guard: the bounds every push must keep beyond a finite payload of the right length
//! ([`PushGuard`]), and the checks [`ShardState`] runs on a push's gradient against them (its
//! magnitude, its sample count, and its per-step norm against the recent workers' median).

use super::ShardState;

/// What a push must keep to be applied, beyond a finite payload of the right length: the
/// defences against one hostile or broken push wrecking a run. A push that breaks one is
/// answered [`ErrorCode::OutOfBounds`](crate::wire::ErrorCode::OutOfBounds) (not fatal) and changes nothing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PushGuard {
    /// Largest |value| in a push. With it no optimizer state can overflow: Adagrad's
    /// accumulator grows by at most `max_abs²` (1e8) per push, far from f32's 3.4e38.
    pub max_abs: f32,
    /// A push's L2 norm per step (norm / (samples / batch), so local rounds of any H compare)
    /// may be at most this many times the median over the last [`NORM_WINDOW`] workers to push
    /// of each one's median of its last [`NORM_HISTORY`] norms, refused pushes included (a
    /// median over workers, not pushes:
    /// a worker pushing faster than the others still counts once, so it cannot drag the
    /// reference down and get honest pushes refused, not even honest workers that arrive after
    /// it); 0 turns it off. Checked once [`NORM_WARMUP`] pushes were accepted.
    pub norm_factor: f32,
    /// Largest sample count a push may claim: batch × the most local steps.
    pub max_samples: u32,
    /// The run's batch size (for the per-step norm).
    pub batch: u32,
}

impl Default for PushGuard {
    fn default() -> Self {
        Self {
            max_abs: 1e4,
            norm_factor: 10.0,
            max_samples: u32::MAX,
            batch: 1,
        }
    }
}

/// `max |v|` and `Σ v²` (in f64) of finite `values`, in [`GUARD_LANES`] independent lanes
/// (summed in a fixed order at the end, so the result is the same on every platform). A single
/// running sum is one long chain of dependent f64 additions that does not vectorise: it was 43%
/// of the server's CPU per step (perf, 2 native workers, 101,770 parameters); the lanes run
/// ~8x faster.
fn max_abs_and_square_sum(values: &[f32]) -> (f32, f64) {
    let mut max = [0.0f32; GUARD_LANES];
    let mut sq = [0.0f64; GUARD_LANES];
    let chunks = values.chunks_exact(GUARD_LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..GUARD_LANES {
            let a = c[i].abs();
            // A select, not `f32::max` (whose NaN rule does not vectorise); values are finite.
            max[i] = if a > max[i] { a } else { max[i] };
            sq[i] += f64::from(c[i]) * f64::from(c[i]);
        }
    }
    for (i, &v) in rest.iter().enumerate() {
        let a = v.abs();
        max[i] = if a > max[i] { a } else { max[i] };
        sq[i] += f64::from(v) * f64::from(v);
    }
    (
        max.iter().fold(0.0f32, |m, &a| if a > m { a } else { m }),
        sq.iter().sum(),
    )
}

/// The upper median of `v` (reordered); `v` is not empty.
fn median_of(v: &mut [f32]) -> f32 {
    let k = v.len() / 2;
    *v.select_nth_unstable_by(k, f32::total_cmp).1
}

/// Lanes of [`max_abs_and_square_sum`].
const GUARD_LANES: usize = 8;

/// Workers whose norms the norm bound's median is taken over (the most recent to push).
pub const NORM_WINDOW: usize = 64;
/// Each worker's recent norms its own median is taken over.
pub const NORM_HISTORY: usize = 64;

/// One worker's recent per-step norms and their median (for [`PushGuard::norm_factor`]).
#[derive(Debug, Clone)]
pub(super) struct WorkerNorms {
    pub(super) worker: u64,
    /// When it last pushed (the shard's push count then): the stalest makes room.
    pub(super) seq: u64,
    /// Its last [`NORM_HISTORY`] norms, a ring.
    pub(super) ring: Vec<f32>,
    pub(super) next: usize,
    pub(super) median: f32,
}
/// Accepted pushes before the norm bound applies.
pub const NORM_WARMUP: usize = 16;

impl ShardState {
    /// Records `worker`'s latest per-step norm for the norm bound's median.
    pub(super) fn note_norm(&mut self, worker: u64, norm: f32) {
        self.offered += 1;
        let seq = self.offered;
        let i = match self.norms.iter().position(|e| e.worker == worker) {
            Some(i) => i,
            None => {
                if self.norms.len() >= NORM_WINDOW {
                    // The worker heard from least recently makes room.
                    if let Some(i) = (0..self.norms.len()).min_by_key(|&i| self.norms[i].seq) {
                        self.norms.swap_remove(i);
                    }
                }
                self.norms.push(WorkerNorms {
                    worker,
                    seq,
                    ring: Vec::with_capacity(NORM_HISTORY),
                    next: 0,
                    median: norm,
                });
                self.norms.len() - 1
            }
        };
        let e = &mut self.norms[i];
        e.seq = seq;
        if e.ring.len() < NORM_HISTORY {
            e.ring.push(norm);
        } else {
            e.ring[e.next] = norm;
        }
        e.next = (e.next + 1) % NORM_HISTORY;
        self.norm_scratch.clear();
        self.norm_scratch.extend_from_slice(&e.ring);
        e.median = median_of(&mut self.norm_scratch);
    }

    /// The norm bound ([`PushGuard::norm_factor`]) for a push of per-step norm `norm`.
    /// The median over the recent workers of each one's median per-step norm (`None` before
    /// any push).
    pub(super) fn reference_norm(&mut self) -> Option<f32> {
        if self.norms.is_empty() {
            return None;
        }
        // In the scratch `note_norm` also uses: no allocation per push.
        self.norm_scratch.clear();
        self.norm_scratch
            .extend(self.norms.iter().map(|e| e.median));
        Some(median_of(&mut self.norm_scratch))
    }

    pub(super) fn norm_check(&self, norm: f32, reference: Option<f32>) -> Result<(), String> {
        let g = self.cfg.setup.guard;
        if let (true, true, Some(median)) = (
            g.norm_factor > 0.0,
            self.accepted >= NORM_WARMUP as u64,
            reference,
        ) {
            let bound = g.norm_factor * median;
            if norm > bound {
                return Err(format!(
                    "norm per step {norm:.3e} exceeds {} x the recent median {median:.3e}",
                    g.norm_factor
                ));
            }
        }
        Ok(())
    }

    /// Checks the validated gradient in scratch against the sample count and magnitude
    /// bounds; returns its per-step norm.
    pub(super) fn guard(&self, samples: u32) -> Result<f32, String> {
        let g = self.cfg.setup.guard;
        if samples == 0 || samples > g.max_samples {
            return Err(format!(
                "a push claims {samples} samples; a round has 1 to {}",
                g.max_samples
            ));
        }
        let (max, sq) = max_abs_and_square_sum(&self.scratch);
        if max > g.max_abs {
            return Err(format!(
                "a value of magnitude {max:e} exceeds the bound {:e}",
                g.max_abs
            ));
        }
        let steps = (samples as f32 / g.batch.max(1) as f32).max(1.0);
        Ok((sq.sqrt() as f32) / steps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::testing::{hello, sent, state};
    use crate::session::ShardSession;
    use crate::shard::Consistency;
    use crate::wire;

    /// The laned guard sums equal a plain running max and f64 sum (to rounding), for every
    /// remainder length; the max is exact.
    #[test]
    fn guard_sums_in_lanes_match_a_plain_loop() {
        let mut rng = crate::rng::Rng::new(5);
        for n in [0usize, 1, 7, 8, 9, 1000, 50_885] {
            let v: Vec<f32> = (0..n).map(|_| (rng.normal() * 3.0) as f32).collect();
            let (max, sq) = max_abs_and_square_sum(&v);
            let want_max = v.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let want_sq: f64 = v.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
            assert_eq!(max, want_max, "n {n}");
            assert!(
                (sq - want_sq).abs() <= 1e-12 * want_sq.max(1.0),
                "n {n}: {sq} {want_sq}"
            );
        }
    }

    /// Issue 10: a push replayed on its connection, a value near f32's limit (which would
    /// overflow Adagrad's accumulator), a push scaled far above the recent norms, and an
    /// impossible sample count are refused without closing, and change nothing.
    #[test]
    fn replays_huge_values_outlier_norms_and_false_sample_counts_are_refused() {
        let mut sh = state(Consistency::Async, 2);
        sh.cfg.setup.guard = PushGuard {
            max_samples: 32,
            batch: 32,
            ..PushGuard::default()
        };
        let mut s = ShardSession::new(*sh.config());
        s.handle_frame(&mut sh, &hello(1, 7), 0.0);
        let mut rid = 1;
        let mut push = |s: &mut ShardSession, sh: &mut ShardState, g: &[f32], samples: u32| {
            rid += 1;
            let v = sh.version();
            s.handle_frame(sh, &wire::encode_push(rid, 1, v, samples, g), 0.0);
            rid
        };
        for _ in 0..NORM_WARMUP {
            push(&mut s, &mut sh, &[0.01, -0.02], 32);
        }
        let before = sh.values().clone();
        let v = sh.version();
        let id = push(&mut s, &mut sh, &[1e30, 0.0], 32);
        push(&mut s, &mut sh, &[10.0, -20.0], 32);
        push(&mut s, &mut sh, &[0.01, -0.02], u32::MAX);
        let replay = wire::encode_push(id, 1, v, 32, &[0.01, -0.02]);
        s.handle_frame(&mut sh, &replay, 0.0);
        let out = sent(&mut s);
        assert_eq!(
            out[out.len() - 4..],
            [
                format!("error {id} out_of_bounds"),
                format!("error {} out_of_bounds", id + 1),
                format!("error {} out_of_bounds", id + 2),
                format!("error {id} replayed"),
            ]
        );
        assert_eq!(sh.values(), &before, "nothing applied");
        assert_eq!(sh.version(), v);
        assert!(!s.is_closed(), "not fatal");
        // An honest push still goes through.
        push(&mut s, &mut sh, &[0.02, -0.01], 32);
        assert_eq!(sh.version(), v + 1);
    }

    /// Issue 10 (found by `bench flood`): a worker flooding tiny pushes used to fill the norm
    /// window, so the median dropped and every honest push looked 10x too large. The median is
    /// over workers now, refused pushes included: the flooder counts once, even when it was
    /// there first.
    #[test]
    fn a_flood_of_tiny_pushes_does_not_get_honest_pushes_refused() {
        let mut sh = state(Consistency::Async, 2);
        sh.cfg.setup.guard = PushGuard {
            max_samples: 32,
            batch: 32,
            ..PushGuard::default()
        };
        let mut honest = ShardSession::new(*sh.config());
        let mut other = ShardSession::new(*sh.config());
        let mut flood = ShardSession::new(*sh.config());
        honest.handle_frame(&mut sh, &hello(1, 7), 0.0);
        other.handle_frame(&mut sh, &hello(1, 8), 0.0);
        flood.handle_frame(&mut sh, &hello(1, 9), 0.0);
        let mut rid = 1;
        let mut push = |s: &mut ShardSession, sh: &mut ShardState, g: &[f32]| {
            rid += 1;
            let v = sh.version();
            s.handle_frame(sh, &wire::encode_push(rid, 1, v, 32, g), 0.0);
        };
        // The flooder comes first and alone: 200 tiny pushes are the whole history.
        for _ in 0..200 {
            push(&mut flood, &mut sh, &[1e-4, 1e-4]);
        }
        // An honest worker's first push is judged against the flooder alone and refused; it
        // counts in the reference all the same, so from its second push on it is accepted.
        let v = sh.version();
        push(&mut honest, &mut sh, &[0.5, -0.5]);
        assert_eq!(sh.version(), v, "judged against the flooder alone");
        push(&mut other, &mut sh, &[0.4, -0.6]);
        for _ in 0..100 {
            push(&mut flood, &mut sh, &[1e-4, 1e-4]);
        }
        sent(&mut honest);
        for _ in 0..5 {
            let v = sh.version();
            push(&mut honest, &mut sh, &[0.5, -0.4]);
            assert_eq!(sh.version(), v + 1, "{:?}", sent(&mut honest));
            push(&mut flood, &mut sh, &[1e-4, 1e-4]);
        }
        // The bound itself still holds against the honest workers' norms.
        let v = sh.version();
        push(&mut flood, &mut sh, &[50.0, 50.0]);
        assert_eq!(sh.version(), v, "a push 100x the honest norm is refused");
    }
}
