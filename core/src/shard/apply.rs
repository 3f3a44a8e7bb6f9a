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
mod tests {
    use super::*;
    use crate::optim::Rule;

    fn sgd(lr: f32) -> OptimizerConfig {
        OptimizerConfig {
            rule: Rule::Sgd,
            lr,
            weight_decay: 0.0,
            clip_norm: None,
            schedule: Default::default(),
        }
    }

    /// Issue 18: a driver that keeps every version (the spot checker's history) holds the
    /// previous buffer, so each update allocated; a version it lets go, offered back with
    /// `recycle`, is the next update's buffer. The values are the same either way.
    #[test]
    fn an_update_writes_into_a_recycled_buffer() {
        let policy = StalenessPolicy::parse("accept").unwrap();
        let mut a = ShardCore::new(vec![1.0; 4], sgd(0.5), policy, Consistency::Async);
        let mut b = ShardCore::new(vec![1.0; 4], sgd(0.5), policy, Consistency::Async);
        let mut kept = vec![a.values().clone()];
        a.push(a.version(), &[1.0; 4]);
        kept.push(a.values().clone());
        // The history lets go of version 0 (nothing else holds it) and offers it back.
        let old = kept.remove(0);
        let at = old.as_ptr();
        a.recycle(old);
        a.push(a.version(), &[2.0; 4]);
        assert_eq!(
            a.values().as_ptr(),
            at,
            "the recycled buffer was written into"
        );
        // A shared buffer or one of another size is not taken.
        a.recycle(kept[0].clone());
        a.recycle(Arc::new(vec![0.0; 3]));
        b.push(b.version(), &[1.0; 4]);
        b.push(b.version(), &[2.0; 4]);
        assert_eq!(a.values(), b.values());
        assert_eq!(a.values()[..], [-0.5; 4]);
    }

    #[test]
    fn an_exported_shard_restores_to_the_same_future() {
        for name in ["sgd", "momentum", "adagrad", "rmsprop", "adam", "adamw"] {
            let cfg = OptimizerConfig {
                rule: crate::optim::Rule::from_name(name).unwrap(),
                lr: 0.01,
                weight_decay: 0.0,
                clip_norm: None,
                schedule: Default::default(),
            };
            let policy = StalenessPolicy::parse("scale").unwrap();
            let grads: Vec<Vec<f32>> = (0..6)
                .map(|k| (0..5).map(|i| ((i + k) as f32 * 0.7).sin()).collect())
                .collect();
            let mut a = ShardCore::new(vec![0.5; 5], cfg, policy, Consistency::Async);
            for g in &grads[..3] {
                a.push(a.version(), g);
            }
            let saved = a.export();
            assert_eq!(saved.version, 3);
            let mut b = ShardCore::restore(saved.clone(), cfg, policy, Consistency::Async).unwrap();
            assert_eq!(b.version(), 3);
            assert_eq!(b.opt_state(), a.opt_state());
            for g in &grads[3..] {
                let (va, vb) = (a.version(), b.version());
                assert_eq!(
                    a.push(va.saturating_sub(1), g),
                    b.push(vb.saturating_sub(1), g)
                );
            }
            assert_eq!(a.values(), b.values(), "{name}");
            // A state for another rule is refused.
            let other = OptimizerConfig {
                // (adam and adamw keep the same slots: the checkpoint compares rule names.)
                rule: crate::optim::Rule::from_name(if name.starts_with("adam") {
                    "sgd"
                } else {
                    "adam"
                })
                .unwrap(),
                ..cfg
            };
            assert!(ShardCore::restore(saved.clone(), other, policy, Consistency::Async).is_err());
            let mut bad = saved;
            Arc::make_mut(&mut bad.values)[0] = f32::INFINITY;
            assert!(ShardCore::restore(bad, cfg, policy, Consistency::Async).is_err());
        }
    }

    /// Issue 21: a rollback publishes the earlier values as the next version and keeps the
    /// optimizer state (a fresh Adagrad accumulator would make the next step `lr` in every
    /// coordinate); a restart starts the state afresh.
    #[test]
    fn a_rollback_moves_the_version_on_and_keeps_the_optimizer_state() {
        let cfg = OptimizerConfig {
            rule: crate::optim::Rule::from_name("adagrad").unwrap(),
            ..sgd(0.1)
        };
        let mut s = ShardCore::new(
            vec![1.0, 2.0],
            cfg,
            StalenessPolicy::default(),
            Consistency::Async,
        );
        s.push(0, &[0.5, -0.5]);
        s.push(1, &[0.5, -0.5]);
        let state = s.opt_state().clone();
        s.roll_back(vec![1.0, 2.0]).unwrap();
        assert_eq!((s.version(), &s.values()[..]), (3, &[1.0f32, 2.0][..]));
        assert_eq!(s.opt_state(), &state);
        assert!(s.roll_back(vec![1.0]).is_err());
        assert!(s.roll_back(vec![f32::NAN, 0.0]).is_err());
        assert_eq!((s.version(), s.opt_state()), (3, &state), "nothing changed");
        s.restart(vec![0.0, 0.0]).unwrap();
        assert_ne!(s.opt_state(), &state);
    }

    /// Issue 20 (`--ema`): the average weights each update by `(1 − d)·d^age` over the
    /// updates since it started, bias-corrected (the first update's values whole, no weight
    /// left on the start); a reader's copy never changes; a restore, rollback and restart start
    /// it again; without `--ema` there is none.
    #[test]
    fn a_moving_average_weights_each_update_by_its_age() {
        let d = 0.5f32;
        let mut s = ShardCore::new(
            vec![0.0, 10.0],
            sgd(1.0),
            StalenessPolicy::default(),
            Consistency::Async,
        )
        .with_average(Some(d));
        assert_eq!(
            &s.average().unwrap()[..],
            &[0.0, 10.0],
            "the start, before any update"
        );
        // SGD at lr 1: values_1 = [1, 9], values_2 = [3, 7], values_3 = [7, 3].
        s.push(0, &[-1.0, 1.0]);
        assert_eq!(
            &s.average().unwrap()[..],
            &[1.0, 9.0],
            "the first update, whole"
        );
        let held = s.average().unwrap().clone();
        s.push(1, &[-2.0, 2.0]);
        s.push(2, &[-4.0, 4.0]);
        // (d²·v1 + d·v2 + v3)·(1 − d)/(1 − d³) = (0.25·v1 + 0.5·v2 + v3) / 1.75.
        let want = |v1: f32, v2: f32, v3: f32| (0.25 * v1 + 0.5 * v2 + v3) / 1.75;
        let avg = s.average().unwrap();
        assert!((avg[0] - want(1.0, 3.0, 7.0)).abs() < 1e-6, "{avg:?}");
        assert!((avg[1] - want(9.0, 7.0, 3.0)).abs() < 1e-6, "{avg:?}");
        assert_eq!(&held[..], &[1.0, 9.0], "a reader's copy stays as it was");
        assert_eq!(
            &s.values()[..],
            &[7.0, 3.0],
            "the live values are the workers'"
        );

        s.roll_back(vec![2.0, 2.0]).unwrap();
        assert_eq!(
            &s.average().unwrap()[..],
            &[2.0, 2.0],
            "a rollback starts it again"
        );
        s.push(s.version(), &[1.0, 1.0]);
        assert_eq!(&s.average().unwrap()[..], &[1.0, 1.0]);
        s.restart(vec![5.0, 5.0]).unwrap();
        assert_eq!(&s.average().unwrap()[..], &[5.0, 5.0], "so does a restart");
        s.push(s.version(), &[1.0, -1.0]);
        s.push(s.version(), &[1.0, -1.0]);
        let restore = |s: &ShardCore, decay| {
            ShardCore::restore(
                s.export(),
                sgd(1.0),
                StalenessPolicy::default(),
                Consistency::Async,
            )
            .unwrap()
            .with_average(decay)
        };
        // A checkpoint keeps the average: restored with the same decay it continues, update
        // for update, as the shard that was saved.
        let mut r = restore(&s, Some(d));
        assert_eq!(r.average(), s.average(), "a restore continues it");
        s.push(s.version(), &[2.0, 0.0]);
        r.push(r.version(), &[2.0, 0.0]);
        assert_eq!(r.average(), s.average(), "and so does the next update");
        assert_eq!(
            &restore(&s, Some(0.25)).average().unwrap()[..],
            &s.values()[..],
            "another decay starts again from the values"
        );
        assert!(restore(&s, None).average().is_none());
        let mut bad = s.export();
        bad.average.as_mut().unwrap().values = Arc::new(vec![1.0]);
        let e = ShardCore::restore(
            bad,
            sgd(1.0),
            StalenessPolicy::default(),
            Consistency::Async,
        )
        .unwrap_err();
        assert!(e.to_string().contains("moving average"), "{e}");

        let plain = ShardCore::new(
            vec![0.0],
            sgd(1.0),
            StalenessPolicy::default(),
            Consistency::Async,
        );
        assert!(plain.with_average(None).average().is_none());
    }

    /// Issue 20: a shard counts the samples of the updates it applied (a counted schedule's
    /// position under `auto` local steps): an async push its own, a sync round its pushes
    /// together, a worker's dropped pushes none; refusals, rollbacks and restarts add none,
    /// and the count survives an export and a restore.
    #[test]
    fn a_shard_counts_the_samples_it_applied() {
        let mut a = ShardCore::new(
            vec![0.0; 2],
            sgd(0.1),
            StalenessPolicy {
                max_staleness: Some(1),
                ..Default::default()
            },
            Consistency::Async,
        );
        a.push_judged(1, 0, &[1.0, 1.0], 1.0, None, 96);
        a.push_judged(2, 1, &[1.0, 1.0], 1.0, None, 32);
        assert_eq!((a.version(), a.samples()), (2, 128));
        // Refused (too stale, from the future): not counted.
        assert!(matches!(
            a.push_judged(1, 0, &[1.0, 1.0], 1.0, None, 1000),
            Outcome::Rejected { .. }
        ));
        assert!(matches!(
            a.push_judged(1, 9, &[1.0, 1.0], 1.0, None, 1000),
            Outcome::Rejected { .. }
        ));
        assert_eq!(a.samples(), 128);
        a.roll_back(vec![0.0, 0.0]).unwrap();
        assert_eq!(
            (a.version(), a.samples()),
            (3, 128),
            "a rollback keeps the count"
        );
        a.restart(vec![0.0, 0.0]).unwrap();
        assert_eq!(a.samples(), 128, "a restart too");
        let saved = a.export();
        assert_eq!(saved.samples, 128);
        let b = ShardCore::restore(
            saved,
            sgd(0.1),
            StalenessPolicy::default(),
            Consistency::Async,
        )
        .unwrap();
        assert_eq!((b.version(), b.samples()), (4, 128));

        let mut s = ShardCore::new(
            vec![0.0; 2],
            sgd(0.1),
            StalenessPolicy::default(),
            Consistency::Sync { k: 3 },
        );
        s.set_droppable(true);
        s.push_judged(1, 0, &[1.0, 0.0], 1.0, None, 10);
        s.push_judged(2, 0, &[0.0, 1.0], 1.0, None, 20);
        assert_eq!(s.samples(), 0, "a round counts when it is applied");
        assert_eq!(s.drop_pending(1), 1);
        s.push_judged(3, 0, &[0.0, 1.0], 1.0, None, 40);
        assert_eq!(s.samples(), 0);
        s.push_judged(4, 0, &[0.0, 1.0], 1.0, None, 80);
        assert_eq!(
            (s.version(), s.samples()),
            (1, 140),
            "worker 1's 10 were dropped"
        );
        s.push_judged(1, 1, &[1.0, 0.0], 1.0, None, 5);
        assert!(s.flush().is_some());
        assert_eq!(
            (s.version(), s.samples()),
            (2, 145),
            "a flushed round counts its pushes"
        );
    }

    /// Issue 20: each update runs at the schedule's factor at the shard's version, times the
    /// staleness policy's multiplier; a sync round at the factor of the version it makes.
    #[test]
    fn a_scheduled_shard_runs_each_version_at_its_factor() {
        use crate::schedule::{Decay, Schedule};
        let schedule = Schedule {
            warmup: 8,
            decay: Decay::Cosine,
            decay_samples: 24,
            min_ratio: 0.25,
            samples_per_version: 4,
            counted: false,
        };
        let cfg = OptimizerConfig {
            schedule,
            ..sgd(1.0)
        };
        // By hand, s = (v + 1) * 4: 4/8, then the cosine from 8 to 24, then the floor.
        let cos =
            |s: f64| 0.25 + 0.75 * 0.5 * (1.0 + (std::f64::consts::PI * (s - 8.0) / 16.0).cos());
        let want = [0.5, 1.0, cos(12.0), cos(16.0), cos(20.0), 0.25, 0.25, 0.25];
        let mut s = ShardCore::new(
            vec![0.0],
            cfg,
            StalenessPolicy::default(),
            Consistency::Async,
        );
        for (v, w) in want.iter().enumerate() {
            assert!(
                (f64::from(s.current_lr()) - w).abs() < 1e-6,
                "current lr at {v}"
            );
            let before = s.values()[0];
            match s.push(s.version(), &[1.0]) {
                Outcome::Applied {
                    version, lr_scale, ..
                } => {
                    assert_eq!(version, v as u64 + 1);
                    assert!(
                        (f64::from(lr_scale) - w).abs() < 1e-6,
                        "version {v}: {lr_scale}"
                    );
                }
                other => panic!("{other:?}"),
            }
            // SGD at lr 1 with g = 1 moves by exactly the factor.
            assert!(
                (f64::from(before - s.values()[0]) - w).abs() < 1e-6,
                "version {v}"
            );
        }
        // Staleness scaling multiplies the factor: a push 2 stale under scale:abs at version 8.
        let p = StalenessPolicy::parse("scale:abs").unwrap();
        let mut s = ShardCore::new(vec![0.0], cfg, p, Consistency::Async);
        fresh_zero_pushes(&mut s, 1);
        let out = s.push(0, &[1.0]);
        assert!(
            matches!(out, Outcome::Applied { staleness: 1, lr_scale, .. } if lr_scale == 1.0),
            "{out:?}"
        );
        let out = s.push(0, &[1.0]);
        let w = (cos(12.0) / 2.0) as f32;
        assert!(
            matches!(out, Outcome::Applied { staleness: 2, lr_scale, .. } if (lr_scale - w).abs() < 1e-6),
            "{out:?}"
        );
        // sync:2: one mean per version, at that version's factor.
        let mut s = ShardCore::new(
            vec![0.0],
            cfg,
            StalenessPolicy::default(),
            Consistency::Sync { k: 2 },
        );
        for w in &want[..3] {
            let v = s.version();
            s.push(v, &[1.0]);
            match s.push(v, &[3.0]) {
                Outcome::Applied {
                    merged: 2,
                    lr_scale,
                    ..
                } => {
                    assert!((f64::from(lr_scale) - w).abs() < 1e-6, "{lr_scale} != {w}")
                }
                other => panic!("{other:?}"),
            }
        }
        // The mean 2 at 0.5, 1.0 and cos(12).
        let moved = -f64::from(s.values()[0]);
        assert!(
            (moved - 2.0 * (0.5 + 1.0 + cos(12.0))).abs() < 1e-5,
            "{moved}"
        );
    }

    #[test]
    fn a_paused_shard_refuses_pushes_with_busy_and_changes_nothing() {
        let mut s = ShardCore::new(
            vec![1.0],
            sgd(0.1),
            StalenessPolicy::default(),
            Consistency::Async,
        );
        s.set_paused(true);
        assert!(matches!(
            s.push(0, &[1.0]),
            Outcome::Rejected {
                code: ErrorCode::Busy,
                ..
            }
        ));
        assert_eq!((s.version(), s.values()[0]), (0, 1.0));
        s.set_paused(false);
        assert!(matches!(
            s.push(0, &[1.0]),
            Outcome::Applied { version: 1, .. }
        ));
    }

    #[test]
    fn set_lr_checks_and_applies() {
        let mut s = ShardCore::new(
            vec![1.0],
            sgd(0.1),
            StalenessPolicy::default(),
            Consistency::Async,
        );
        assert!(s.set_lr(f32::NAN).is_err());
        assert_eq!(s.optimizer().lr, 0.1);
        s.set_lr(1.0).unwrap();
        s.push(0, &[1.0]);
        assert_eq!(**s.values(), vec![0.0]);
    }

    #[test]
    fn async_applies_on_receipt_and_counts_staleness() {
        let mut s = ShardCore::new(
            vec![1.0; 2],
            sgd(0.5),
            StalenessPolicy::default(),
            Consistency::Async,
        );
        let held = s.values().clone();
        assert!(matches!(
            s.push(0, &[1.0, 1.0]),
            Outcome::Applied {
                version: 1,
                staleness: 0,
                ..
            }
        ));
        assert!(matches!(
            s.push(0, &[1.0, 1.0]),
            Outcome::Applied {
                version: 2,
                staleness: 1,
                ..
            }
        ));
        assert_eq!(**s.values(), vec![0.0, 0.0]);
        assert_eq!(*held, vec![1.0, 1.0], "published values never change");
        assert!(matches!(
            s.push(3, &[1.0, 1.0]),
            Outcome::Rejected {
                code: ErrorCode::FutureVersion,
                ..
            }
        ));
        assert_eq!(s.version(), 2);
    }

    #[test]
    fn drop_policy_rejects_beyond_the_bound() {
        let p = StalenessPolicy::parse("drop:1").unwrap();
        let mut s = ShardCore::new(vec![0.0], sgd(1.0), p, Consistency::Async);
        s.push(0, &[1.0]);
        s.push(0, &[1.0]);
        assert!(matches!(
            s.push(0, &[1.0]),
            Outcome::Rejected {
                code: ErrorCode::TooStale,
                ..
            }
        ));
        assert_eq!(**s.values(), vec![-2.0]);
    }

    /// Pushes `n` gradients of 0 computed from the current version: `n` fresh updates.
    fn fresh_zero_pushes(s: &mut ShardCore, n: usize) {
        for _ in 0..n {
            s.push(s.version(), &[0.0]);
        }
    }

    #[test]
    fn absolute_scaling_at_staleness_five_moves_one_fifth_as_far() {
        let p = StalenessPolicy::parse("scale:abs").unwrap();
        let mut s = ShardCore::new(vec![0.0], sgd(1.0), p, Consistency::Async);
        fresh_zero_pushes(&mut s, 5);
        let before = s.values()[0];
        let out = s.push(0, &[1.0]);
        assert!(
            matches!(out, Outcome::Applied { staleness: 5, lr_scale, .. } if (lr_scale - 0.2).abs() < 1e-7)
        );
        assert!(((before - s.values()[0]) - 0.2).abs() < 1e-7);
        // A fresh push moves the full distance.
        let before = s.values()[0];
        s.push(s.version(), &[1.0]);
        assert!(((before - s.values()[0]) - 1.0).abs() < 1e-7);
    }

    #[test]
    fn relative_scaling_by_hand() {
        let p = StalenessPolicy::parse("scale").unwrap();
        let mut s = ShardCore::new(vec![0.0], sgd(1.0), p, Consistency::Async);
        // Five fresh pushes: 1 / max(1, 0) = 1 each, so the mean of 1/τ is 1.
        fresh_zero_pushes(&mut s, 5);
        // Staleness 5: the mean of 1/τ becomes (5 + 1/5) / 6, so the push gets
        // (1/5) / (5.2 / 6) = 3/13 of the learning rate.
        let before = s.values()[0];
        let out = s.push(0, &[1.0]);
        let want = 3.0 / 13.0;
        assert!(
            matches!(out, Outcome::Applied { staleness: 5, lr_scale, .. } if (lr_scale - want).abs() < 1e-6),
            "{out:?}"
        );
        assert!(((before - s.values()[0]) - want).abs() < 1e-6);
        // A fresh push is fresher than usual: the full learning rate, never more.
        let before = s.values()[0];
        let out = s.push(s.version(), &[1.0]);
        assert!(matches!(out, Outcome::Applied { lr_scale, .. } if lr_scale == 1.0));
        assert!(((before - s.values()[0]) - 1.0).abs() < 1e-6);
    }

    #[test]
    fn relative_scaling_leaves_the_usual_staleness_alone() {
        // Four workers in lockstep: every push 4 stale. That is the usual staleness, so it gets
        // the full step once the mean has settled, where `scale:abs` divides the learning rate
        // by 4 on every push.
        for (policy, want, tolerance) in [("scale", 1.0, 1e-3), ("scale:abs", 0.25, 1e-7)] {
            let p = StalenessPolicy::parse(policy).unwrap();
            let mut s = ShardCore::new(vec![0.0], sgd(1.0), p, Consistency::Async);
            fresh_zero_pushes(&mut s, 4);
            let mut last = f32::NAN;
            for _ in 0..5 * STALENESS_WINDOW {
                match s.push(s.version() - 4, &[0.0]) {
                    Outcome::Applied { lr_scale, .. } => last = lr_scale,
                    other => panic!("{other:?}"),
                }
            }
            assert!((last - want).abs() < tolerance, "{policy}: {last}");
        }
    }

    #[test]
    fn relative_scaling_follows_a_change_in_the_usual_staleness() {
        // Long fresh, then the run gets busy (staleness 10 on every push): after a few windows
        // staleness 10 is the new usual and gets (almost) the full step again.
        let p = StalenessPolicy::parse("scale").unwrap();
        let mut s = ShardCore::new(vec![0.0], sgd(1.0), p, Consistency::Async);
        fresh_zero_pushes(&mut s, 2 * STALENESS_WINDOW as usize);
        let scale_at_10 = |s: &mut ShardCore| match s.push(s.version() - 10, &[0.0]) {
            Outcome::Applied { lr_scale, .. } => lr_scale,
            other => panic!("{other:?}"),
        };
        let first = scale_at_10(&mut s);
        assert!((0.1..0.2).contains(&first), "{first}");
        for _ in 0..8 * STALENESS_WINDOW {
            scale_at_10(&mut s);
        }
        let later = scale_at_10(&mut s);
        assert!(later > 0.99, "{later}");
    }

    #[test]
    fn delay_compensation_by_hand() {
        let p = StalenessPolicy::parse("dc:0.5").unwrap();
        let mut s = ShardCore::new(vec![1.0], sgd(1.0), p, Consistency::Async);
        s.push(0, &[0.5]); // w: 1.0 -> 0.5 (fresh, no compensation)
        assert_eq!(s.values()[0], 0.5);
        // Computed at version 0 (w = 1.0); now w = 0.5: g' = 2 + 0.5 * 4 * (0.5 - 1.0) = 1.
        s.push(0, &[2.0]);
        assert!(
            (s.values()[0] - (0.5 - 1.0)).abs() < 1e-6,
            "{}",
            s.values()[0]
        );
    }

    #[test]
    fn sync_applies_one_mean_per_k_fresh_gradients_and_drops_late_ones() {
        let mut s = ShardCore::new(
            vec![0.0],
            sgd(1.0),
            StalenessPolicy::default(),
            Consistency::Sync { k: 3 },
        );
        assert!(matches!(
            s.push(0, &[1.0]),
            Outcome::Buffered {
                version: 0,
                pending: 1
            }
        ));
        assert!(matches!(
            s.push(0, &[2.0]),
            Outcome::Buffered { pending: 2, .. }
        ));
        assert_eq!(s.values()[0], 0.0, "nothing applied before K");
        assert!(matches!(
            s.push(0, &[6.0]),
            Outcome::Applied {
                version: 1,
                merged: 3,
                ..
            }
        ));
        assert_eq!(s.values()[0], -3.0, "the mean (1 + 2 + 6) / 3 applied once");
        assert!(matches!(
            s.push(0, &[1.0]),
            Outcome::Rejected {
                code: ErrorCode::TooStale,
                ..
            }
        ));
        assert!(matches!(
            s.push(1, &[4.0]),
            Outcome::Buffered { pending: 1, .. }
        ));
        assert!(matches!(
            s.flush(),
            Some(Outcome::Applied {
                version: 2,
                merged: 1,
                ..
            })
        ));
        assert_eq!(s.values()[0], -7.0);
        assert_eq!(s.flush(), None);
    }
}
