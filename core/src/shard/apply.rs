//! The one apply path: [`ShardCore`] (version, values, optimizer state, the staleness policy
//! and the `sync:K` round), what a push did ([`Outcome`]), and what a checkpoint keeps of it
//! ([`ShardExport`]).

use super::{Consistency, LrScale, StalenessPolicy, STALENESS_WINDOW};
use crate::error::{Error, Result};
use crate::optim::{self, OptState, OptimizerConfig};
use crate::robust::{self, Aggregation, Consensus};
use crate::wire::ErrorCode;
use std::collections::VecDeque;
use std::sync::Arc;

/// How many past versions a shard keeps for delay compensation.
pub const DC_HISTORY: usize = 64;

/// The owner of a push whose sender the caller did not name ([`ShardCore::push_scaled`]): it
/// is never dropped from a round.
pub const ANONYMOUS: u64 = u64::MAX;

/// What a push did to the shard.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// An update was applied; the shard is now at `version`.
    Applied {
        /// Version after the update.
        version: u64,
        /// Updates between the push's base version and the version it was applied to.
        staleness: u64,
        /// Learning-rate multiplier used: the schedule's factor at the version it was applied
        /// to ([`crate::schedule`]) times the staleness policy's and the caller's.
        lr_scale: f32,
        /// Gradients merged into this update: 1 in async/SSP; in sync mode K, or fewer when
        /// the aggregate was flushed early.
        merged: usize,
    },
    /// Sync mode: the gradient was buffered for the next aggregate update.
    Buffered {
        /// The (unchanged) shard version.
        version: u64,
        /// Gradients now buffered.
        pending: usize,
    },
    /// Not applied; the shard is unchanged.
    Rejected {
        /// Why.
        code: ErrorCode,
        /// Detail.
        message: String,
    },
}

/// What a checkpoint keeps of a shard ([`ShardCore::export`]): enough for
/// [`ShardCore::restore`] to continue exactly where the export was taken. Two things are not
/// kept: a sync aggregate in progress (its buffered gradients are lost like unacknowledged
/// pushes; a clean shutdown flushes it first, rule 2 of [`crate::session`]) and DC-ASGD's
/// history of past versions (pushes computed before the restore are applied uncompensated,
/// as pushes older than the history always are).
#[derive(Debug, Clone, PartialEq)]
pub struct ShardExport {
    /// Updates applied.
    pub version: u64,
    /// The values (shared with the shard when just exported: no copy).
    pub values: Arc<Vec<f32>>,
    /// The optimizer state (slots in [`crate::optim::Rule::slot_names`] order, update count).
    pub state: OptState,
    /// `scale`: the running mean of `1 / max(1, staleness)` (see the module doc).
    pub inv_staleness_mean: f64,
    /// `scale`: pushes that running mean has seen.
    pub scaled_pushes: u64,
    /// Samples in the updates applied ([`ShardCore::samples`]).
    pub samples: u64,
    /// `--ema`: the moving average of the values, when the shard keeps one.
    pub average: Option<AverageExport>,
}

/// A shard's moving average of its values (`--ema`) as a checkpoint keeps it: restored with
/// the same decay it continues where it was ([`ShardCore::with_average`]).
#[derive(Debug, Clone, PartialEq)]
pub struct AverageExport {
    /// Its decay per update.
    pub decay: f32,
    /// The average.
    pub values: Arc<Vec<f32>>,
    /// `decay^t`, t the updates it has seen since it started (its bias correction).
    pub power: f64,
}

/// A shard's state and update logic.
#[derive(Debug)]
pub struct ShardCore {
    version: u64,
    /// Samples in the updates applied: what a counted schedule is positioned by
    /// ([`crate::schedule`]).
    samples: u64,
    values: Arc<Vec<f32>>,
    spare: Option<Arc<Vec<f32>>>,
    state: OptState,
    cfg: OptimizerConfig,
    policy: StalenessPolicy,
    consistency: Consistency,
    /// Sync mode: sum of buffered gradients and how many.
    sum: Vec<f32>,
    pending: usize,
    /// DC-ASGD: values of recent versions.
    history: VecDeque<(u64, Arc<Vec<f32>>)>,
    scratch: Vec<f32>,
    /// [`LrScale::Relative`]: running mean of `1 / max(1, staleness)` over accepted async/SSP
    /// pushes (the reciprocal of their harmonic mean staleness), and how many it has seen.
    inv_staleness_mean: f64,
    scaled_pushes: u64,
    /// Paused by the operator: pushes are answered [`ErrorCode::Busy`] and change nothing.
    paused: bool,
    /// How pushes are combined (issue 10).
    aggregation: Aggregation,
    /// Sync with a round rule (or [`ShardCore::set_droppable`]): the round's pushes, one
    /// after the other (`pending` of them).
    rows: Vec<f32>,
    /// Sync: who sent each of the round's pushes ([`ANONYMOUS`] when the caller did not say).
    owners: Vec<u64>,
    /// Sync: the samples of each of the round's pushes (beside `owners`).
    round_samples: Vec<u64>,
    /// Sync: keep each round's pushes apart (in `rows`) even for the plain mean, so one
    /// worker's can be dropped before the round is applied ([`ShardCore::drop_pending`]).
    droppable: bool,
    /// Sync: the current round keeps its pushes in `rows` (decided at its first push).
    round_rows: bool,
    robust_scratch: robust::Scratch,
    /// Async/SSP with `consensus`: the recent accepted directions.
    consensus: Consensus,
    /// `--ema`: the exponential moving average of the values ([`ShardCore::with_average`]).
    average: Option<Average>,
}

/// An exponential moving average of a shard's values over its updates (`--ema DECAY`): what
/// the evaluator, the text samples and the export read, while workers train the live values.
/// After the `t`-th update since it started it holds
///
/// ```text
/// avg_t = Σ_{i ≤ t} (1 − d)·d^(t−i)·values_i / (1 − d^t)
/// ```
///
/// the moving average with Adam's bias correction: every update's weight is `(1 − d)·d^age`,
/// and no weight is left on the values it started from, so the first updates are not held
/// back by the initial weights. Kept corrected, one pass per update:
/// `avg_t = a·avg_{t−1} + (1 − a)·values_t` with `a = d·(1 − d^(t−1)) / (1 − d^t)`. It starts
/// again (t = 0, the values it is given) at a rollback and a restart, and at a restore of a
/// checkpoint without one or with another decay; a restore with the same decay continues it.
#[derive(Debug, Clone)]
struct Average {
    decay: f32,
    values: Arc<Vec<f32>>,
    /// `d^t`.
    power: f64,
}

impl Average {
    fn new(decay: f32, values: Arc<Vec<f32>>) -> Self {
        Self {
            decay,
            values,
            power: 1.0,
        }
    }

    fn step(&mut self, values: &[f32]) {
        let d = f64::from(self.decay);
        let before = self.power;
        self.power *= d;
        let a = (d * (1.0 - before) / (1.0 - self.power)) as f32;
        let avg = Arc::make_mut(&mut self.values);
        for (m, v) in avg.iter_mut().zip(values) {
            *m = a * *m + (1.0 - a) * *v;
        }
    }
}

impl ShardCore {
    /// A shard holding `values` at version 0.
    pub fn new(
        values: Vec<f32>,
        cfg: OptimizerConfig,
        policy: StalenessPolicy,
        consistency: Consistency,
    ) -> Self {
        let n = values.len();
        Self {
            version: 0,
            samples: 0,
            values: Arc::new(values),
            spare: None,
            state: OptState::new(&cfg.rule, n),
            cfg,
            policy,
            consistency,
            sum: if matches!(consistency, Consistency::Sync { .. }) {
                vec![0.0; n]
            } else {
                Vec::new()
            },
            pending: 0,
            history: VecDeque::new(),
            scratch: Vec::new(),
            inv_staleness_mean: 1.0,
            scaled_pushes: 0,
            paused: false,
            aggregation: Aggregation::Mean,
            rows: Vec::new(),
            owners: Vec::new(),
            round_samples: Vec::new(),
            droppable: false,
            round_rows: false,
            robust_scratch: robust::Scratch::default(),
            consensus: Consensus::default(),
            average: None,
        }
    }

    /// The same shard keeping an exponential moving average of its values with `decay` per
    /// version ([`Average`]; the caller checked `0 < decay < 1`), starting from its current
    /// values, or continuing the average [`ShardCore::restore`] brought back when that has the
    /// same decay. `None` keeps none.
    pub fn with_average(mut self, decay: Option<f32>) -> Self {
        self.average = match (decay, self.average.take()) {
            (Some(d), Some(saved)) if saved.decay == d => Some(saved),
            (Some(d), _) => Some(Average::new(d, self.values.clone())),
            (None, _) => None,
        };
        self
    }

    /// The moving average of the values (`--ema`), when the shard keeps one; shared and
    /// immutable like [`ShardCore::values`] (an update copies it when a reader holds it).
    pub fn average(&self) -> Option<&Arc<Vec<f32>>> {
        self.average.as_ref().map(|a| &a.values)
    }

    /// The average starts again from the current values (a restore, rollback or restart:
    /// what it held is not the run's any more).
    fn restart_average(&mut self) {
        if let Some(a) = self.average.as_mut() {
            *a = Average::new(a.decay, self.values.clone());
        }
    }

    /// In `sync:K`, keeps each round's pushes apart (K rows of the shard's length instead of
    /// one running sum) from the next round on, so that [`ShardCore::drop_pending`] can take a
    /// worker's pushes out of a round before it is applied. Drivers turn it on when a worker
    /// can be quarantined (issue 10: a worker caught cheating has its pending pushes dropped).
    /// The robust round rules keep rows anyway. Nothing changes in async/SSP.
    pub fn set_droppable(&mut self, droppable: bool) {
        self.droppable = droppable;
    }

    /// `zeno`: this shard's slice of the validation gradient pushes are compared with from
    /// now on ([`crate::robust::ZenoReference`]). Ignored when its length is not the shard's.
    pub fn set_reference(&mut self, slice: &[f32]) {
        if slice.len() == self.values.len() {
            self.consensus.set_reference(slice);
        }
    }

    /// Whether rounds keep their pushes apart ([`ShardCore::set_droppable`], or a round rule).
    pub fn keeps_rows(&self) -> bool {
        self.droppable || self.aggregation.keeps_rows()
    }

    /// Sync: takes `owner`'s pushes out of the pending round (they are never applied) and
    /// returns how many. Only a round that keeps its pushes apart can be split; otherwise
    /// (and outside sync) nothing changes and 0 is returned.
    pub fn drop_pending(&mut self, owner: u64) -> usize {
        if self.pending == 0 || !self.round_rows || owner == ANONYMOUS {
            return 0;
        }
        let len = self.values.len();
        let mut kept = 0;
        for i in 0..self.pending {
            if self.owners[i] == owner {
                continue;
            }
            if kept != i {
                self.rows.copy_within(i * len..(i + 1) * len, kept * len);
                self.owners[kept] = self.owners[i];
                self.round_samples[kept] = self.round_samples[i];
            }
            kept += 1;
        }
        let dropped = self.pending - kept;
        self.pending = kept;
        self.owners.truncate(kept);
        self.round_samples.truncate(kept);
        dropped
    }

    /// The same shard combining pushes by `aggregation` (the plain mean without it). A rule
    /// that does not apply to the mode (checked by [`Aggregation::validate`], which
    /// [`crate::session::ShardState::new`] calls) changes nothing: round rules act in `sync:K`
    /// only, `consensus` in async/SSP only.
    pub fn with_aggregation(mut self, aggregation: Aggregation) -> Self {
        self.aggregation = aggregation;
        self
    }

    /// How pushes are combined.
    pub fn aggregation(&self) -> Aggregation {
        self.aggregation
    }

    /// A shard that continues from `saved` (a [`ShardCore::export`], maybe of another shard
    /// layout re-cut by the caller) under `cfg`, `policy` and `consistency`.
    ///
    /// A saved moving average is kept for [`ShardCore::with_average`] to continue.
    ///
    /// # Errors
    /// [`Error::Config`] when the optimizer state or the average does not fit `cfg.rule` and
    /// the values (slot count or lengths), or a value is not finite.
    pub fn restore(
        saved: ShardExport,
        cfg: OptimizerConfig,
        policy: StalenessPolicy,
        consistency: Consistency,
    ) -> Result<Self> {
        let n = saved.values.len();
        if saved.values.iter().any(|v| !v.is_finite()) {
            return Err(Error::Config(
                "saved parameters hold a non-finite value".into(),
            ));
        }
        let slots = saved
            .state
            .slots(&cfg.rule)
            .iter()
            .map(|s| s.to_vec())
            .collect();
        let state = OptState::from_slots(&cfg.rule, n, slots, saved.state.t)?;
        if [&saved.state.slot0, &saved.state.slot1]
            .iter()
            .skip(cfg.rule.slots())
            .any(|s| !s.is_empty())
        {
            return Err(Error::Config(format!(
                "saved optimizer state does not match {}",
                cfg.rule.name()
            )));
        }
        let mean = saved.inv_staleness_mean;
        let mut core = Self::new(Vec::new(), cfg, policy, consistency);
        core.sum = if matches!(consistency, Consistency::Sync { .. }) {
            vec![0.0; n]
        } else {
            Vec::new()
        };
        core.values = saved.values;
        core.version = saved.version;
        core.samples = saved.samples;
        core.state = state;
        core.inv_staleness_mean = if mean.is_finite() && mean > 0.0 && mean <= 1.0 {
            mean
        } else {
            1.0
        };
        core.scaled_pushes = saved.scaled_pushes;
        if let Some(a) = saved.average {
            let fits = a.values.len() == n
                && a.decay > 0.0
                && a.decay < 1.0
                && (0.0..=1.0).contains(&a.power)
                && a.values.iter().all(|v| v.is_finite());
            if !fits {
                return Err(Error::Config(format!(
                    "the saved moving average does not fit: {} values for {n}, decay {}, \
                     power {}, all finite: {}",
                    a.values.len(),
                    a.decay,
                    a.power,
                    a.values.iter().all(|v| v.is_finite())
                )));
            }
            core.average = Some(Average {
                decay: a.decay,
                values: a.values,
                power: a.power,
            });
        }
        Ok(core)
    }

    /// Rolls back to `values` (an earlier version's parameters, after poison was detected):
    /// published as the next version (monotonic, as [`ShardCore::restart`]), the pending
    /// `sync:K` round and DC-ASGD's history dropped, the optimizer state kept. A fresh state
    /// would undo more than the poison: Adagrad's (the default) first step from an empty
    /// accumulator is `lr` in every coordinate, and a run rolled back 93 times with fresh
    /// states ended at 44-67% (docs/benchmarks.md, "Defences: spot checks"); the poison's
    /// trace in a kept state is the few pushes' share of an accumulator or a momentum that
    /// decays.
    ///
    /// # Errors
    /// [`Error::Config`] when `values` has another length or a non-finite value; nothing
    /// changes.
    pub fn roll_back(&mut self, values: Vec<f32>) -> Result<()> {
        let state = self.state.clone();
        let (mean, scaled) = (self.inv_staleness_mean, self.scaled_pushes);
        self.restart(values)?;
        self.state = state;
        self.inv_staleness_mean = mean;
        self.scaled_pushes = scaled;
        Ok(())
    }

    /// Starts over from `values` (a teacher's next experiment, issue 19): a fresh optimizer
    /// state, the pending `sync:K` round, DC-ASGD's history and the `scale` statistics
    /// dropped. The version moves on by one rather than back to 0, so every push computed
    /// before is at least one version stale (refused as late in `sync:K`) and versions stay
    /// monotonic for the workers, the spot checker and the replay log.
    ///
    /// # Errors
    /// [`Error::Config`] when `values` has another length or a non-finite value; nothing
    /// changes.
    pub fn restart(&mut self, values: Vec<f32>) -> Result<()> {
        if values.len() != self.values.len() || values.iter().any(|v| !v.is_finite()) {
            return Err(Error::Config(format!(
                "a restart needs {} finite values, got {}",
                self.values.len(),
                values.len()
            )));
        }
        let n = values.len();
        self.values = Arc::new(values);
        self.spare = None;
        self.state = OptState::new(&self.cfg.rule, n);
        self.version += 1;
        self.pending = 0;
        self.sum.iter_mut().for_each(|v| *v = 0.0);
        self.owners.clear();
        self.round_samples.clear();
        self.round_rows = false;
        self.history.clear();
        self.inv_staleness_mean = 1.0;
        self.scaled_pushes = 0;
        self.restart_average();
        Ok(())
    }

    /// Everything a checkpoint keeps ([`ShardExport`]). Copies the optimizer state (the values
    /// are shared), so it is quick enough to take under the shard's lock.
    pub fn export(&self) -> ShardExport {
        ShardExport {
            version: self.version,
            values: self.values.clone(),
            state: self.state.clone(),
            inv_staleness_mean: self.inv_staleness_mean,
            scaled_pushes: self.scaled_pushes,
            samples: self.samples,
            average: self.average.as_ref().map(|a| AverageExport {
                decay: a.decay,
                values: a.values.clone(),
                power: a.power,
            }),
        }
    }

    /// The optimizer's state (read-only).
    pub fn opt_state(&self) -> &OptState {
        &self.state
    }

    /// The optimizer's hyperparameters.
    pub fn optimizer(&self) -> &OptimizerConfig {
        &self.cfg
    }

    /// Pauses (`true`: every push is answered [`ErrorCode::Busy`], nothing changes) or resumes
    /// the shard (the admin API's `pause` / `resume`).
    pub fn set_paused(&mut self, paused: bool) {
        self.paused = paused;
    }

    /// Whether pushes are paused.
    pub fn is_paused(&self) -> bool {
        self.paused
    }

    /// The learning rate the next update runs at before staleness scaling: the peak times the
    /// schedule's factor at the current version (the status shows it).
    pub fn current_lr(&self) -> f32 {
        self.cfg.lr * self.cfg.schedule.factor(self.version)
    }

    /// Changes the (peak) learning rate from the next update on (the admin API's `set-lr`); a
    /// schedule goes on multiplying it.
    ///
    /// # Errors
    /// [`Error::Config`] for a learning rate that is not finite and positive; nothing changes.
    pub fn set_lr(&mut self, lr: f32) -> Result<()> {
        let mut cfg = self.cfg;
        cfg.lr = lr;
        cfg.validate()?;
        self.cfg = cfg;
        Ok(())
    }

    /// Current version (number of updates applied).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Samples in the updates applied so far (each push counts the samples its sender stated;
    /// a `sync:K` round, its pushes together). Rollbacks and restarts keep it: like versions,
    /// it never goes back.
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// Current values (shared, immutable).
    pub fn values(&self) -> &Arc<Vec<f32>> {
        &self.values
    }

    /// Offers a buffer of values nobody else holds any more (a version a driver kept and let
    /// go, e.g. a spot checker's oldest) for the next update to write into, instead of
    /// allocating one: kept if it is this shard's size, unshared, and the spare buffer is not
    /// itself free to reuse.
    pub fn recycle(&mut self, mut buf: Arc<Vec<f32>>) {
        let fits = Arc::get_mut(&mut buf).is_some_and(|b| b.len() == self.values.len());
        let spare_free = self
            .spare
            .as_mut()
            .is_some_and(|s| Arc::get_mut(s).is_some());
        if fits && !spare_free {
            self.spare = Some(buf);
        }
    }

    /// Number of parameters.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// True for an empty shard.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Sync mode: gradients waiting for the next aggregate update.
    pub fn pending(&self) -> usize {
        self.pending
    }

    /// The consistency mode.
    pub fn consistency(&self) -> Consistency {
        self.consistency
    }

    /// Switches the consistency mode from the next push on (the admin API; which changes are
    /// safe is [`crate::session::ShardState::set_consistency`]'s decision). A pending sync
    /// aggregate is applied first, as a flush would, and returned.
    pub fn set_consistency(&mut self, mode: Consistency) -> Option<Outcome> {
        let flushed = self.flush();
        self.consistency = mode;
        if matches!(mode, Consistency::Sync { .. }) {
            self.sum = vec![0.0; self.values.len()];
        } else {
            self.sum = Vec::new();
        }
        flushed
    }

    /// Handles one push of `grad` (already checked finite and of the right length) computed
    /// from `base_version`.
    ///
    /// # Panics
    /// If `grad` has the wrong length (callers validate input first).
    pub fn push(&mut self, base_version: u64, grad: &[f32]) -> Outcome {
        self.push_scaled(base_version, grad, 1.0)
    }

    /// [`ShardCore::push`] with the learning rate of an async/SSP update multiplied by `scale`
    /// besides the staleness policy's multiplier (pseudo-gradients from K concurrent workers are
    /// applied at 1/K, see `crate::session`). Sync aggregates ignore it (they average).
    ///
    /// # Panics
    /// If `grad` has the wrong length (callers validate input first).
    pub fn push_scaled(&mut self, base_version: u64, grad: &[f32], scale: f32) -> Outcome {
        self.push_from(ANONYMOUS, base_version, grad, scale)
    }

    /// [`ShardCore::push_scaled`] from `owner` (a worker id): in `sync:K` the round remembers
    /// who sent each push, for [`ShardCore::drop_pending`].
    ///
    /// # Panics
    /// If `grad` has the wrong length (callers validate input first).
    pub fn push_from(
        &mut self,
        owner: u64,
        base_version: u64,
        grad: &[f32],
        scale: f32,
    ) -> Outcome {
        self.push_judged(owner, base_version, grad, scale, None, 0)
    }

    /// [`ShardCore::push_from`] with the push's norm ratio to the usual one, for `zeno`'s
    /// score, as the caller measures it ([`crate::session::ShardState`]: against the median
    /// over workers of each one's median, so one fast worker cannot set it). `None`: `zeno`
    /// uses the median of its recent pushes' norms. `samples`: what the push was computed on
    /// (its header's `aux`), counted in [`ShardCore::samples`] when it is applied.
    ///
    /// # Panics
    /// If `grad` has the wrong length (callers validate input first).
    pub fn push_judged(
        &mut self,
        owner: u64,
        base_version: u64,
        grad: &[f32],
        scale: f32,
        ratio: Option<f64>,
        samples: u64,
    ) -> Outcome {
        assert_eq!(grad.len(), self.values.len(), "validated gradient length");
        if self.paused {
            return Outcome::Rejected {
                code: ErrorCode::Busy,
                message: "training is paused by the operator; retry later".into(),
            };
        }
        if base_version > self.version {
            return Outcome::Rejected {
                code: ErrorCode::FutureVersion,
                message: format!(
                    "push computed from version {base_version}, but the shard is at {}",
                    self.version
                ),
            };
        }
        let staleness = self.version - base_version;
        match self.consistency {
            Consistency::Sync { k } => {
                if staleness > 0 {
                    return Outcome::Rejected {
                        code: ErrorCode::TooStale,
                        message: format!(
                            "late gradient from version {base_version}; the shard is at {}",
                            self.version
                        ),
                    };
                }
                if self.pending == 0 {
                    self.round_rows = self.keeps_rows();
                    self.owners.clear();
                    self.round_samples.clear();
                }
                if self.round_rows {
                    // Grows to K rows in the first round, then is reused.
                    let len = grad.len();
                    let at = self.pending * len;
                    if self.rows.len() < at + len {
                        self.rows.resize(at + len, 0.0);
                    }
                    self.rows[at..at + len].copy_from_slice(grad);
                } else {
                    for (s, g) in self.sum.iter_mut().zip(grad) {
                        *s += g;
                    }
                }
                self.owners.push(owner);
                self.round_samples.push(samples);
                self.pending += 1;
                if self.pending >= k {
                    return self.apply_mean();
                }
                Outcome::Buffered {
                    version: self.version,
                    pending: self.pending,
                }
            }
            Consistency::Async | Consistency::Ssp { .. } => {
                if let Some(max) = self.policy.max_staleness {
                    if staleness > max {
                        return Outcome::Rejected {
                            code: ErrorCode::TooStale,
                            message: format!("staleness {staleness} exceeds the maximum {max}"),
                        };
                    }
                }
                if let Aggregation::Consensus { margin } | Aggregation::Zeno { margin } =
                    self.aggregation
                {
                    // Refused pushes join the consensus too (see `crate::robust`).
                    let verdict = if matches!(self.aggregation, Aggregation::Zeno { .. }) {
                        self.consensus.check_zeno(grad, margin, ratio)
                    } else {
                        self.consensus.check(grad, margin)
                    };
                    self.consensus.observe(grad);
                    if let Err(message) = verdict {
                        return Outcome::Rejected {
                            code: ErrorCode::Disagrees,
                            message,
                        };
                    }
                }
                // The schedule's factor at this version, times the staleness policy's.
                let lr_scale =
                    self.lr_scale(staleness) * scale * self.cfg.schedule.factor(self.version);
                match self.policy.dc_lambda {
                    Some(lambda) if staleness > 0 => {
                        let read = self
                            .history
                            .iter()
                            .find(|(v, _)| *v == base_version)
                            .map(|(_, w)| w.clone());
                        let mut g = std::mem::take(&mut self.scratch);
                        g.clear();
                        match read {
                            Some(read) => g.extend(
                                grad.iter()
                                    .zip(self.values.iter())
                                    .zip(read.iter())
                                    .map(|((&g, &now), &then)| g + lambda * g * g * (now - then)),
                            ),
                            // Older than the kept history: apply uncompensated.
                            None => g.extend_from_slice(grad),
                        }
                        self.update(&g, lr_scale);
                        self.scratch = g;
                    }
                    _ => self.update(grad, lr_scale),
                }
                self.samples = self.samples.saturating_add(samples);
                Outcome::Applied {
                    version: self.version,
                    staleness,
                    lr_scale,
                    merged: 1,
                }
            }
        }
    }

    /// The learning-rate multiplier for an accepted async/SSP push of `staleness` (see the
    /// module doc); updates the running mean staleness it is relative to.
    fn lr_scale(&mut self, staleness: u64) -> f32 {
        let inv = 1.0 / staleness.max(1) as f64;
        match self.policy.scale_lr {
            None => 1.0,
            Some(LrScale::Absolute) => inv as f32,
            Some(LrScale::Relative) => {
                // This push counts in the mean it is compared with, so the first push (and a
                // lone worker's every push) gets exactly 1.
                self.scaled_pushes += 1;
                let weight = 1.0 / self.scaled_pushes.min(STALENESS_WINDOW) as f64;
                self.inv_staleness_mean += weight * (inv - self.inv_staleness_mean);
                (inv / self.inv_staleness_mean).min(1.0) as f32
            }
        }
    }

    /// Sync mode: applies the mean of the buffered gradients now (when fewer than K workers are
    /// left, or they took too long). Returns `None` when nothing is buffered.
    pub fn flush(&mut self) -> Option<Outcome> {
        (self.pending > 0).then(|| self.apply_mean())
    }

    fn apply_mean(&mut self) -> Outcome {
        let merged = self.pending;
        let mut sum = std::mem::take(&mut self.sum);
        if self.round_rows {
            robust::aggregate(
                self.aggregation,
                &self.rows,
                merged,
                &mut sum,
                &mut self.robust_scratch,
            );
        } else {
            let inv = 1.0 / self.pending as f32;
            sum.iter_mut().for_each(|s| *s *= inv);
        }
        let lr_scale = self.cfg.schedule.factor(self.version);
        self.update(&sum, lr_scale);
        sum.iter_mut().for_each(|s| *s = 0.0);
        self.sum = sum;
        self.pending = 0;
        self.owners.clear();
        let round: u64 = self.round_samples.drain(..).fold(0, u64::saturating_add);
        self.samples = self.samples.saturating_add(round);
        Outcome::Applied {
            version: self.version,
            staleness: 0,
            lr_scale,
            merged,
        }
    }

    fn update(&mut self, grad: &[f32], lr_scale: f32) {
        // Reuse the previous buffer when nobody holds it (a snapshot, a spot checker's
        // history); otherwise a fresh copy of the values, copied once (`make_mut` on a shared
        // spare copied its stale values, then this copied the current ones over them).
        let mut spare = self.spare.take();
        let mut next = match spare.as_mut().and_then(Arc::get_mut) {
            Some(buf) if buf.len() == self.values.len() => {
                buf.copy_from_slice(&self.values);
                spare.take()
            }
            _ => None,
        }
        .unwrap_or_else(|| Arc::new(self.values.to_vec()));
        let n = Arc::make_mut(&mut next);
        optim::step(&self.cfg, &mut self.state, n, grad, lr_scale);
        let previous = std::mem::replace(&mut self.values, next);
        self.version += 1;
        if let Some(a) = self.average.as_mut() {
            a.step(&self.values);
        }
        if self.policy.dc_lambda.is_some() {
            self.history.push_back((self.version - 1, previous));
            if self.history.len() > DC_HISTORY {
                self.history.pop_front();
            }
        } else {
            self.spare = Some(previous);
        }
    }
}

#[cfg(test)]
mod tests;
