//! How a run's shards are set up: [`ShardSetup`] (what every shard of the run shares),
//! [`ShardConfig`] (one shard: id, range, setup), the encodings a shard falls back through
//! ([`fallbacks`]), and the memory bound on a `sync:K` round kept apart ([`MAX_ROUND_BYTES`]).

use super::{PushGuard, ShardState};
use crate::codec::Encoding;
use crate::error::Error;
use crate::partition::KeyRange;
use crate::shard::{Consistency, ShardCore};
use crate::wire::{HEADER_LEN, MAX_META_LEN};

/// The fixed description of one shard: where it sits and how the run sets its shards up.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShardConfig {
    /// Shard index (in every frame header).
    pub id: u32,
    /// The shard's key range of the flat parameter vector.
    pub range: KeyRange,
    /// What every shard of the run shares.
    pub setup: ShardSetup,
}

/// Most bytes one shard's `sync:K` round may hold when it keeps its pushes apart (K rows of
/// the shard's length: the robust round rules, [`ShardState::set_droppable`]).
pub const MAX_ROUND_BYTES: u64 = 4 << 30;

/// Checks that a round of `mode` keeping its pushes apart (`rows`) fits [`MAX_ROUND_BYTES`].
pub(super) fn round_memory(
    id: u32,
    mode: Consistency,
    len: usize,
    rows: bool,
) -> crate::Result<()> {
    let Consistency::Sync { k } = mode else {
        return Ok(());
    };
    let bytes = (k as u64).saturating_mul(len as u64).saturating_mul(4);
    if rows && bytes > MAX_ROUND_BYTES {
        return Err(Error::Config(format!(
            "shard {id}: a sync:{k} round keeps its {k} pushes of {len} values apart ({} MiB, \
             more than {} MiB); lower K or use more shards",
            bytes >> 20,
            MAX_ROUND_BYTES >> 20
        )));
    }
    Ok(())
}

/// How a run's shards are set up: everything of [`ShardConfig`] but the shard's id and range,
/// and the update rules. One place turns it into a shard, for the server, the simulator, the
/// loopback and the tests alike.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShardSetup {
    /// The update rule.
    pub optimizer: crate::optim::OptimizerConfig,
    /// Staleness policy for async/SSP pushes.
    pub staleness: crate::shard::StalenessPolicy,
    /// Consistency mode.
    pub consistency: Consistency,
    /// SSP: a worker not heard from for this long (seconds) stops holding others back.
    pub heartbeat: f64,
    /// sync: a pull waiting this long (seconds) forces the partial aggregate through.
    pub sync_timeout: f64,
    /// The most compact encoding a shard sends `Params` in, to a worker that can decode it
    /// (it falls back through bf16 to f32).
    pub pull_encoding: Encoding,
    /// The most compact encoding a shard asks pushes in (int8 blocks, bf16, f32).
    pub push_encoding: Encoding,
    /// Ask workers for `Report` frames (shard 0 only).
    pub reports: bool,
    /// Pushes are pseudo-gradients (local steps): in async and SSP each is applied at
    /// 1/(workers connected), so K workers that each moved the model by Δ move it by their
    /// mean, as a sync aggregate would (applied whole, K concurrent Δs overshoot K-fold).
    pub pseudo_gradients: bool,
    /// Bounds every push must keep.
    pub guard: PushGuard,
    /// How pushes are combined: the plain mean, a robust `sync:K` round rule, or the async
    /// consensus filter ([`crate::robust`], issue 10).
    pub aggregation: crate::robust::Aggregation,
    /// The run's egress budget and the model length its shares are cut from (issue 18,
    /// [`crate::shard::pace`]): sessions whose worker asked are told the shard's pace.
    pub pacing: crate::shard::Pacing,
    /// The run's learning-rate schedule is positioned by the samples the shards applied
    /// ([`crate::schedule::Schedule::counted`]: `auto` local steps): a Hello that does not ask
    /// for them in `Params` is refused, as its worker could not follow the schedule.
    pub counted: bool,
    /// Keep a moving average of the values with this decay per version (`--ema`,
    /// [`ShardCore::with_average`]): what the evaluator reads. `None`: none.
    pub average: Option<f32>,
}

impl ShardSetup {
    /// The description of shard `id` over `range`.
    pub fn config(&self, id: u32, range: KeyRange) -> ShardConfig {
        ShardConfig {
            id,
            range,
            setup: *self,
        }
    }

    /// A fresh apply path over `values`.
    pub fn core(&self, values: Vec<f32>) -> ShardCore {
        ShardCore::new(values, self.optimizer, self.staleness, self.consistency)
            .with_aggregation(self.aggregation)
            .with_average(self.average)
    }

    /// Shard `id` over `range`, holding `values` at version 0.
    ///
    /// # Errors
    /// [`Error::Config`] when `values` does not fit the range.
    pub fn state(&self, id: u32, range: KeyRange, values: Vec<f32>) -> crate::Result<ShardState> {
        ShardState::new(self.config(id, range), self.core(values))
    }
}

/// The encodings a shard accepts for a direction when its most compact is `best`, most compact
/// first.
pub fn fallbacks(best: Encoding) -> Vec<Encoding> {
    let all = [Encoding::INT8, Encoding::Bf16, Encoding::F32];
    let from = all.iter().position(|e| e.id() == best.id()).unwrap_or(2);
    let mut v = vec![best];
    v.extend(all[from + 1..].iter().copied());
    v
}

impl ShardConfig {
    /// Largest frame this shard accepts: a full push plus meta.
    pub fn frame_limit(&self) -> usize {
        HEADER_LEN + MAX_META_LEN + 4 * self.range.len()
    }
}

#[cfg(test)]
mod tests {
    use crate::session::testing::state;
    use crate::shard::Consistency;

    #[test]
    fn a_round_too_large_to_keep_apart_is_refused() {
        let mut sh = state(Consistency::Sync { k: 65_536 }, 1 << 16);
        let e = sh.set_droppable(true).unwrap_err().to_string();
        assert!(e.contains("lower K"), "{e}");
        assert!(!sh.core().keeps_rows(), "nothing changed");
        sh.set_droppable(false).unwrap();
    }
}
