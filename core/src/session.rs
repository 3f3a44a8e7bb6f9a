//! The shard side of the protocol as sans-IO state machines, the mirror of [`crate::worker`].
//! The server's WebSocket handler, the simulator's shard driver and the in-browser loopback are
//! thin drivers around these types: every rule of the shard side is written once, here.
//!
//! - [`ShardState`]: what the connections of one shard share: [`ShardCore`] (the one apply
//!   path), the SSP clock, the number of workers connected, and the updates applied by merged
//!   count. Its methods hold the rules that involve several connections: who counts for sync
//!   and SSP, when a sync aggregate is flushed.
//! - [`ShardSession`]: one connection. The driver feeds it decoded events (a frame arrived, the
//!   peer closed, a timer fired, the shard published an update, the server shuts down) with the
//!   time `now` in seconds on the driver's clock, and takes [`Action`]s from
//!   [`ShardSession::poll_action`]: send this frame, close, record this for the dashboard. It
//!   says when it wants to be woken with [`ShardSession::poll_timeout`].
//! - [`ShardAccess`]: how a session reaches its shard's state. The server implements it with a
//!   lock-free snapshot for reads and a writer lock for changes, the simulator and the loopback
//!   with a plain struct.
//!
//! # The rules
//! - Frames of one connection are handled strictly in order. A pull that must wait (SSP bound,
//!   sync version) holds up the frames behind it; they are kept (at most [`MAX_DEFERRED`]) and
//!   handled as soon as the pull is answered. So a worker's pull right after its own push always
//!   sees that push.
//! - Pulls never wait for pushes in `async` mode: the reply is encoded from the last published
//!   snapshot, without taking the shard's writer lock.
//! - A push is decoded once ([`wire::decode`]), then its gradient is checked for length and
//!   finiteness while it is copied into the shard's scratch buffer, and only then handed to
//!   [`ShardCore::push`]: applied whole or not at all.
//! - Every error frame echoes the request id of the frame it answers. A frame whose 32-byte
//!   header cannot be read (too short, bad magic) is answered with request id 0.
//! - Fatal errors ([`ErrorCode::is_fatal`]) send the error frame, then close the connection;
//!   the worker leaves the shard. Policy rejections (too stale, busy) keep it open.
//! - In SSP mode every frame from a worker is its heartbeat: a worker silent for longer than
//!   the heartbeat timeout stops holding the others back.
//!
//! # Sync flush decisions
//! A `sync:K` shard applies the mean of K fresh gradients. It applies fewer ("flushes") in
//! exactly three cases, decided here and nowhere else:
//! 1. a push leaves as many gradients buffered as there are workers connected: no more can come
//!    for this version;
//! 2. a worker leaves and the gradients buffered are at least the workers still connected: the
//!    same reason. While some connected worker has not pushed for this version yet, the shard
//!    keeps waiting for it. Flushing at once would apply a partial mean and then reject that
//!    worker's gradient as late, throwing away work the worker is about to deliver;
//! 3. a pull has waited [`ShardSetup::sync_timeout`] for the next version (a straggler that is
//!    connected but silent): backup-worker semantics, never a deadlock.
//!
//! A gradient buffered from a worker that then left stays in the aggregate: it was computed
//! from the current version and is as good as the others. A worker the driver expels
//! ([`ShardSession::expel`]: it was quarantined) is different: its buffered gradients are taken
//! out of the round first ([`ShardState::drop_pending`], which needs
//! [`ShardState::set_droppable`]), and only then does rule 2 look at what is left.

use crate::codec::Encoding;
use crate::error::Error;
use crate::partition::KeyRange;
use crate::shard::{Consistency, Outcome, ShardCore, SspClock};
use crate::wire::{
    self, Bye, ErrorCode, Message, Payload, Report, Welcome, HEADER_LEN, MAGIC, MAX_META_LEN,
    PROTOCOL_VERSION,
};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

/// Frames a session keeps while a pull waits; past this the connection is refused with
/// [`ErrorCode::Busy`] and closed (a well-behaved worker has a few frames in flight).
pub const MAX_DEFERRED: usize = 64;

/// How often a waiting SSP pull re-checks the clock at the latest, seconds (a worker's
/// heartbeat may expire without any event).
const SSP_RECHECK: f64 = 1.0;
/// Slack after a heartbeat expiry before re-checking, seconds.
const SSP_SLACK: f64 = 0.001;

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

/// What a push must keep to be applied, beyond a finite payload of the right length: the
/// defences against one hostile or broken push wrecking a run. A push that breaks one is
/// answered [`ErrorCode::OutOfBounds`] (not fatal) and changes nothing.
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
struct WorkerNorms {
    worker: u64,
    /// When it last pushed (the shard's push count then): the stalest makes room.
    seq: u64,
    /// Its last [`NORM_HISTORY`] norms, a ring.
    ring: Vec<f32>,
    next: usize,
    median: f32,
}
/// Accepted pushes before the norm bound applies.
pub const NORM_WARMUP: usize = 16;

/// Most bytes one shard's `sync:K` round may hold when it keeps its pushes apart (K rows of
/// the shard's length: the robust round rules, [`ShardState::set_droppable`]).
pub const MAX_ROUND_BYTES: u64 = 4 << 30;

/// Checks that a round of `mode` keeping its pushes apart (`rows`) fits [`MAX_ROUND_BYTES`].
fn round_memory(id: u32, mode: Consistency, len: usize, rows: bool) -> crate::Result<()> {
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

/// The state every connection of one shard shares.
#[derive(Debug)]
pub struct ShardState {
    cfg: ShardConfig,
    core: ShardCore,
    clock: SspClock,
    /// Workers past Hello and not yet gone.
    connected: usize,
    /// Updates applied, by how many gradients each merged.
    updates: BTreeMap<usize, u64>,
    /// Bumped by every change a waiting pull may be waiting for (a version, a clock).
    epoch: u64,
    /// The gradient of the push being applied, validated before it reaches `core`.
    scratch: Vec<f32>,
    /// Per worker (the last [`NORM_WINDOW`] to push): its recent per-step norms, refused
    /// pushes included, and their median (for [`PushGuard::norm_factor`]).
    norms: Vec<WorkerNorms>,
    /// Scratch for the medians (no allocation per push once grown).
    norm_scratch: Vec<f32>,
    /// Pushes whose norm was noted.
    offered: u64,
    /// Pushes accepted so far (the norm bound's warm-up).
    accepted: u64,
}

impl ShardState {
    /// A shard over `core` (whose length must be `cfg.range.len()`).
    ///
    /// # Errors
    /// [`Error::Config`] when the lengths differ, the mode or the aggregation and the core
    /// disagree, or the aggregation does not fit the mode ([`crate::robust::Aggregation::validate`]).
    pub fn new(cfg: ShardConfig, core: ShardCore) -> crate::Result<Self> {
        if core.len() != cfg.range.len() {
            return Err(Error::Config(format!(
                "shard {} holds {} values for a range of {}",
                cfg.id,
                core.len(),
                cfg.range.len()
            )));
        }
        if core.consistency() != cfg.setup.consistency {
            return Err(Error::Config(format!(
                "shard {}: core runs {}, config says {}",
                cfg.id,
                core.consistency(),
                cfg.setup.consistency
            )));
        }
        if core.aggregation() != cfg.setup.aggregation {
            return Err(Error::Config(format!(
                "shard {}: core aggregates by {}, config says {}",
                cfg.id,
                core.aggregation(),
                cfg.setup.aggregation
            )));
        }
        cfg.setup.aggregation.validate(cfg.setup.consistency)?;
        round_memory(cfg.id, cfg.setup.consistency, core.len(), core.keeps_rows())?;
        let bound = match cfg.setup.consistency {
            Consistency::Ssp { bound } => bound,
            _ => u64::MAX / 2,
        };
        Ok(Self {
            clock: SspClock::new(bound, cfg.setup.heartbeat),
            scratch: vec![0.0; core.len()],
            cfg,
            core,
            connected: 0,
            updates: BTreeMap::new(),
            epoch: 0,
            norms: Vec::new(),
            norm_scratch: Vec::new(),
            offered: 0,
            accepted: 0,
        })
    }

    /// The shard's description.
    pub fn config(&self) -> &ShardConfig {
        &self.cfg
    }

    /// The apply path (read-only).
    pub fn core(&self) -> &ShardCore {
        &self.core
    }

    /// Operator controls (the server's admin API, issue 9): pause or resume pushes (a paused
    /// shard answers them `busy`, [`ShardCore::set_paused`]).
    pub fn set_paused(&mut self, paused: bool) {
        self.core.set_paused(paused);
    }

    /// The consistency mode now (the run's, or the one an operator switched to).
    pub fn consistency(&self) -> Consistency {
        self.cfg.setup.consistency
    }

    /// Operator controls: switches the consistency mode of a running shard, for every session
    /// at once (sessions read the mode from here, not from their copy of the config).
    ///
    /// Safe, and done: `async` ↔ `ssp:S`, `ssp:S` → `ssp:S'`, `sync:K` → `sync:K'`, and
    /// `sync:K` → `async` / `ssp:S`. Leaving sync mode, or changing K, first applies the
    /// pending aggregate (a flush). Entering SSP from async levels every worker's clock, so
    /// clocks counted without a bound hold nobody back. A pull waiting under the old mode is
    /// re-checked under the new one.
    ///
    /// # Errors
    /// `async`/`ssp` → `sync:K`, with a reason (nothing changes): workers that joined under
    /// async or SSP ask for the current version, not the next one, so a fast worker would fill
    /// an aggregate with several gradients of its own.
    pub fn set_consistency(&mut self, mode: Consistency) -> Result<(), String> {
        let from = self.cfg.setup.consistency;
        if mode == from {
            return Ok(());
        }
        if matches!(mode, Consistency::Sync { .. }) && !matches!(from, Consistency::Sync { .. }) {
            return Err(format!(
                "cannot switch a running shard from {from} to {mode}: workers that joined under \
                 {from} pull the current version, not the next one, so one fast worker could \
                 fill an aggregate alone; restart from a checkpoint with --consistency {mode}"
            ));
        }
        // The run's aggregation rule must hold in the new mode too (e.g. Krum's K >= 2f + 3,
        // or a round rule leaving sync): refused, and nothing changes.
        self.cfg
            .setup
            .aggregation
            .validate(mode)
            .map_err(|e| format!("cannot switch a running shard from {from} to {mode}: {e}"))?;
        round_memory(self.cfg.id, mode, self.core.len(), self.core.keeps_rows())
            .map_err(|e| format!("cannot switch a running shard from {from} to {mode}: {e}"))?;
        if let Some(o) = self.core.set_consistency(mode) {
            self.record(&o);
        }
        match mode {
            Consistency::Ssp { bound } => self
                .clock
                .set_bound(bound, !matches!(from, Consistency::Ssp { .. })),
            _ => self.clock.set_bound(u64::MAX / 2, false),
        }
        self.cfg.setup.consistency = mode;
        self.epoch += 1;
        Ok(())
    }

    /// In `sync:K`, keeps each round's pushes apart so that a quarantined worker's can be
    /// dropped before the round is applied ([`ShardState::drop_pending`],
    /// [`ShardCore::set_droppable`]). A driver whose workers can be quarantined turns it on.
    ///
    /// # Errors
    /// [`Error::Config`] when K rows of this shard would exceed [`MAX_ROUND_BYTES`]; nothing
    /// changes.
    pub fn set_droppable(&mut self, droppable: bool) -> crate::Result<()> {
        round_memory(
            self.cfg.id,
            self.cfg.setup.consistency,
            self.core.len(),
            droppable || self.core.keeps_rows(),
        )?;
        self.core.set_droppable(droppable);
        Ok(())
    }

    /// `zeno` ([`crate::robust::Aggregation::Zeno`]): this shard's slice of the gradient of
    /// the server's validation batch, which pushes are compared with from now on. Drivers
    /// holding the training data refresh it every [`crate::robust::ZENO_REFRESH`] updates.
    pub fn set_reference(&mut self, slice: &[f32]) {
        self.core.set_reference(slice);
    }

    /// Takes `worker`'s pushes out of the pending `sync:K` round, so they are never applied
    /// (its worker was quarantined), and returns how many. A round holding no push of it, a
    /// round kept as a running sum ([`ShardState::set_droppable`] off), and async/SSP (where
    /// pushes are applied on receipt) give 0 and change nothing.
    pub fn drop_pending(&mut self, worker: u64) -> usize {
        let n = self.core.drop_pending(worker);
        if n > 0 {
            self.epoch += 1;
        }
        n
    }

    /// Operator controls: the learning rate from the next update on ([`ShardCore::set_lr`]).
    ///
    /// # Errors
    /// A learning rate that is not finite and positive; nothing changes.
    pub fn set_lr(&mut self, lr: f32) -> crate::Result<()> {
        self.core.set_lr(lr)
    }

    /// Current version.
    pub fn version(&self) -> u64 {
        self.core.version()
    }

    /// Current values.
    pub fn values(&self) -> &Arc<Vec<f32>> {
        self.core.values()
    }

    /// Workers connected (past Hello).
    pub fn connected(&self) -> usize {
        self.connected
    }

    /// Updates applied so far, keyed by how many gradients each merged (sync: K for a full
    /// aggregate, fewer for a flush; 1 in the other modes).
    pub fn updates(&self) -> &BTreeMap<usize, u64> {
        &self.updates
    }

    /// Changes so far that may release a waiting pull; drivers compare it before and after a
    /// call to know whether to wake the other sessions of this shard.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The SSP clock (read-only).
    pub fn clock(&self) -> &SspClock {
        &self.clock
    }

    fn record(&mut self, outcome: &Outcome) {
        if let Outcome::Applied { merged, .. } = outcome {
            *self.updates.entry(*merged).or_default() += 1;
            self.epoch += 1;
        }
    }

    fn join(&mut self, worker: u64, now: f64) {
        self.connected += 1;
        self.clock.join(worker, now);
        self.epoch += 1;
    }

    /// Rule 2 of the sync flush decisions (module doc).
    fn leave(&mut self, worker: u64) {
        self.connected = self.connected.saturating_sub(1);
        self.clock.leave(worker);
        self.epoch += 1;
        if matches!(self.cfg.setup.consistency, Consistency::Sync { .. })
            && self.core.pending() > 0
            && self.core.pending() >= self.connected
        {
            self.flush();
        }
    }

    fn seen(&mut self, worker: u64, now: f64) {
        if matches!(self.cfg.setup.consistency, Consistency::Ssp { .. }) {
            let before = self.clock.clock(worker);
            self.clock.seen(worker, now);
            if self.clock.clock(worker) != before {
                self.epoch += 1;
            }
        }
    }

    /// Sync: applies the partial aggregate now (rules 1 to 3).
    fn flush(&mut self) {
        if let Some(o) = self.core.flush() {
            self.record(&o);
        }
    }

    /// Validates `grad` (length, finite) into scratch and applies it (rule 1 included).
    fn push(
        &mut self,
        worker: u64,
        base_version: u64,
        grad: Payload<'_>,
        samples: u32,
        now: f64,
    ) -> Outcome {
        if let Err(e) = grad.copy_into(&mut self.scratch) {
            return Outcome::Rejected {
                code: ErrorCode::from(&e),
                message: e.to_string(),
            };
        }
        // `zeno`'s norm ratio is taken against the same per-worker reference as the norm
        // bound, so a worker pushing faster than the others cannot set "the usual norm".
        let mut ratio = None;
        let checked = self.guard(samples).and_then(|norm| {
            // The worker's norm counts in the reference whether or not this push passes, so
            // honest workers that arrive after a flooder are not locked out by its median.
            // Only when the norm bound or `zeno` will use it (a sort over up to 64 workers).
            let g = self.cfg.setup.guard;
            let bound_on = g.norm_factor > 0.0 && self.accepted >= NORM_WARMUP as u64;
            let zeno_on = matches!(
                self.cfg.setup.aggregation,
                crate::robust::Aggregation::Zeno { .. }
            ) && self.accepted >= crate::robust::ZENO_NORM_WARMUP as u64;
            let reference = if bound_on || zeno_on {
                self.reference_norm()
            } else {
                None
            };
            let verdict = self.norm_check(norm, reference);
            if let Some(m) = reference.filter(|&m| zeno_on && m > 0.0) {
                ratio = Some(f64::from(norm) / f64::from(m));
            }
            self.note_norm(worker, norm);
            verdict.map(|()| norm)
        });
        if let Err(message) = checked {
            return Outcome::Rejected {
                code: ErrorCode::OutOfBounds,
                message,
            };
        }
        let scale = if self.cfg.setup.pseudo_gradients {
            1.0 / self.connected.max(1) as f32
        } else {
            1.0
        };
        let outcome = self
            .core
            .push_judged(worker, base_version, &self.scratch, scale, ratio);
        self.record(&outcome);
        if matches!(outcome, Outcome::Applied { .. } | Outcome::Buffered { .. }) {
            self.accepted += 1;
            self.clock.tick(worker, now);
            self.epoch += 1;
        }
        if let Outcome::Buffered { pending, .. } = outcome {
            if pending >= self.connected {
                self.flush();
            }
        }
        outcome
    }

    /// Records `worker`'s latest per-step norm for the norm bound's median.
    fn note_norm(&mut self, worker: u64, norm: f32) {
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
    fn reference_norm(&mut self) -> Option<f32> {
        if self.norms.is_empty() {
            return None;
        }
        // In the scratch `note_norm` also uses: no allocation per push.
        self.norm_scratch.clear();
        self.norm_scratch
            .extend(self.norms.iter().map(|e| e.median));
        Some(median_of(&mut self.norm_scratch))
    }

    fn norm_check(&self, norm: f32, reference: Option<f32>) -> Result<(), String> {
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
    fn guard(&self, samples: u32) -> Result<f32, String> {
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

    /// Whether `worker`'s pull for `min_version` may be answered now; if not, the time by which
    /// to check again (besides any [`ShardState::epoch`] change).
    fn gate(&mut self, worker: u64, min_version: u64, now: f64, since: f64) -> Gate {
        match self.cfg.setup.consistency {
            Consistency::Async => Gate::Open,
            Consistency::Ssp { .. } => {
                self.seen(worker, now);
                if self.clock.may_read(worker, now) {
                    Gate::Open
                } else {
                    let expiry = self
                        .clock
                        .next_expiry(now)
                        .map_or(SSP_RECHECK, |t| (t - now).clamp(0.0, SSP_RECHECK));
                    Gate::Wait(now + expiry + SSP_SLACK)
                }
            }
            Consistency::Sync { .. } => {
                if self.core.version() >= min_version {
                    Gate::Open
                } else {
                    Gate::Wait(since + self.cfg.setup.sync_timeout)
                }
            }
        }
    }

    /// The reader's and the slowest active SSP clock, for the read log.
    fn read_view(&self, worker: u64, now: f64) -> (Option<u64>, Option<u64>) {
        match self.cfg.setup.consistency {
            Consistency::Ssp { .. } => self.clock.read_view(worker, now),
            _ => (None, None),
        }
    }
}

/// The answer to a Hello's identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Go ahead.
    Admitted,
    /// No such worker joined the run.
    Unknown,
    /// The worker joined, but the credential is missing or not its own.
    BadCredential,
    /// The worker is quarantined ([`ErrorCode::Quarantined`]); the text says why.
    Quarantined(String),
}

/// A copy of an accepted push the driver asked for ([`ShardAccess::sample`]), for a spot
/// check: the gradient as the shard decoded it, and what the push says it was computed from.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledPush {
    /// The pusher.
    pub worker: u64,
    /// The shard it was pushed to.
    pub shard: u32,
    /// The push's base version.
    pub base_version: u64,
    /// Examples it claims.
    pub samples: u32,
    /// Where its batches came from.
    pub tag: wire::PushTag,
    /// The encoding this connection's `Params` are sent in: the worker computed on the
    /// parameters as decoded from it.
    pub pull_encoding: Encoding,
    /// The decoded gradient slice.
    pub grad: Vec<f32>,
}

enum Gate {
    Open,
    Wait(f64),
}

/// How a session reaches the state of its shard. Drivers decide how it is stored and locked.
pub trait ShardAccess {
    /// The last published values and their version. Must not wait for an update in progress
    /// (the server serves it from an `ArcSwap`): this is what keeps async pulls lock-free.
    fn snapshot(&self) -> (u64, Arc<Vec<f32>>);
    /// Runs `f` with exclusive access to the shared state; the driver publishes a new snapshot
    /// afterwards when the version moved, and wakes the other sessions when the epoch moved.
    fn with<R>(&mut self, f: impl FnOnce(&mut ShardState) -> R) -> R;
    /// Whether `worker` may speak on this shard: it joined the run (`POST /api/join` on the
    /// server) and, where the driver requires one, `credential` is the one its join handed out.
    fn admit(&self, worker: u64, credential: Option<&str>) -> Admission;
    /// Whether this shard spot-checks pushes: Welcomes say so, and every push must then carry
    /// a [`wire::PushTag`] (default: no).
    fn spot_checks(&self) -> bool {
        false
    }
    /// Whether the driver wants a copy of this accepted, tagged push (default: no).
    fn sample(&self, _worker: u64, _tag: &wire::PushTag) -> bool {
        false
    }
    /// Takes the copy [`ShardAccess::sample`] asked for.
    fn take_sample(&mut self, _push: SampledPush) {}
    /// The shard's consistency mode now ([`ShardState::consistency`]; an operator may switch
    /// it while sessions run). Drivers whose [`ShardAccess::with`] takes a lock should answer
    /// without it: async pulls ask on every pull.
    fn mode(&mut self) -> Consistency {
        self.with(|s| ShardState::consistency(s))
    }
}

impl ShardAccess for ShardState {
    fn snapshot(&self) -> (u64, Arc<Vec<f32>>) {
        (self.version(), self.values().clone())
    }
    fn with<R>(&mut self, f: impl FnOnce(&mut ShardState) -> R) -> R {
        f(self)
    }
    fn admit(&self, _worker: u64, _credential: Option<&str>) -> Admission {
        Admission::Admitted
    }
}

/// What a session records for the dashboard and the metrics.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    /// A worker said Hello on this shard.
    Joined {
        /// The worker.
        worker: u64,
    },
    /// The worker's connection to this shard ended.
    Left {
        /// The worker.
        worker: u64,
    },
    /// A pull was answered.
    Pulled {
        /// The reader.
        worker: u64,
        /// Bytes of the Params frame.
        bytes: usize,
        /// Version sent.
        version: u64,
        /// SSP: the reader's clock.
        clock: Option<u64>,
        /// SSP: the slowest active clock.
        min_clock: Option<u64>,
    },
    /// A frame that decoded as a push: applied, buffered or rejected.
    Pushed {
        /// The pusher (None before Hello).
        worker: Option<u64>,
        /// What happened.
        outcome: Outcome,
        /// Samples the push claims.
        samples: u32,
        /// Bytes of the Push frame.
        bytes: usize,
    },
    /// A worker reported its measurements.
    Reported {
        /// The worker.
        worker: u64,
        /// What it measured.
        report: Report,
        /// The encodings this connection negotiated: pulls, pushes.
        encodings: (Encoding, Encoding),
    },
    /// Any other frame was refused.
    Rejected {
        /// The sender (None before Hello).
        worker: Option<u64>,
        /// Why.
        code: ErrorCode,
    },
    /// The worker was expelled ([`ShardSession::expel`]) and its pushes still pending in the
    /// `sync:K` round were dropped from it, never applied.
    Dropped {
        /// The worker.
        worker: u64,
        /// Pushes dropped.
        pushes: usize,
    },
}

/// What a session asks its driver to do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Send one binary message.
    Send(Vec<u8>),
    /// Close the connection with this reason (after everything sent before).
    Close(String),
    /// Record this.
    Record(Record),
}

#[derive(Debug, Clone, Copy)]
struct Waiting {
    request_id: u32,
    min_version: u64,
    since: f64,
    deadline: f64,
}

/// One connection to one shard.
#[derive(Debug)]
pub struct ShardSession {
    cfg: ShardConfig,
    worker: Option<u64>,
    waiting: Option<Waiting>,
    deferred: VecDeque<Vec<u8>>,
    actions: VecDeque<Action>,
    closed: bool,
    /// Negotiated in the handshake: what Params are sent in, what pushes should come in.
    pull_encoding: Encoding,
    push_encoding: Encoding,
    /// The request id of the last push on this connection (replays are refused).
    last_push: Option<u32>,
}

/// The request id of a frame, if its header can be read (32 bytes, right magic); else 0.
pub fn header_request_id(bytes: &[u8]) -> u32 {
    match bytes.get(..HEADER_LEN) {
        Some(h) if h[..2] == MAGIC => u32::from_le_bytes([h[4], h[5], h[6], h[7]]),
        _ => 0,
    }
}

impl ShardSession {
    /// A new connection to the shard described by `cfg`.
    pub fn new(cfg: ShardConfig) -> Self {
        Self {
            cfg,
            worker: None,
            waiting: None,
            deferred: VecDeque::new(),
            actions: VecDeque::new(),
            closed: false,
            pull_encoding: Encoding::F32,
            push_encoding: Encoding::F32,
            last_push: None,
        }
    }

    /// The worker that said Hello, if any.
    pub fn worker(&self) -> Option<u64> {
        self.worker
    }

    /// Whether a pull is waiting (the frames behind it are held).
    pub fn is_waiting(&self) -> bool {
        self.waiting.is_some()
    }

    /// Whether the session has closed (it ignores every further event).
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// The next action for the driver.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// When to call [`ShardSession::handle_timeout`] at the latest (a waiting pull's deadline).
    pub fn poll_timeout(&self) -> Option<f64> {
        self.waiting.map(|w| w.deadline)
    }

    /// A text message arrived (not part of the protocol).
    pub fn handle_text(&mut self, shard: &mut impl ShardAccess, now: f64) {
        if self.closed {
            return;
        }
        self.fail(
            shard,
            0,
            ErrorCode::Malformed,
            "text messages are not part of the protocol; send binary frames".into(),
            None,
            now,
        );
    }

    /// A binary message arrived.
    pub fn handle_frame(&mut self, shard: &mut impl ShardAccess, bytes: &[u8], now: f64) {
        if self.closed {
            return;
        }
        if self.waiting.is_some() {
            if self.deferred.len() >= MAX_DEFERRED {
                let id = header_request_id(bytes);
                let m = format!("more than {MAX_DEFERRED} frames behind a waiting pull");
                self.fail(shard, id, ErrorCode::Busy, m, None, now);
                self.close(shard, format!("busy: {MAX_DEFERRED} frames behind a pull"));
            } else {
                self.deferred.push_back(bytes.to_vec());
            }
            return;
        }
        self.frame(shard, bytes, now);
    }

    /// The shard published an update or its clock moved (another connection's push, join or
    /// leave): a waiting pull may now be answered.
    pub fn handle_update(&mut self, shard: &mut impl ShardAccess, now: f64) {
        self.retry(shard, now, false);
    }

    /// A timer fired (at or after [`ShardSession::poll_timeout`]).
    pub fn handle_timeout(&mut self, shard: &mut impl ShardAccess, now: f64) {
        let due = self.waiting.is_some_and(|w| now >= w.deadline);
        self.retry(shard, now, due);
    }

    /// The peer closed or the socket failed.
    pub fn handle_close(&mut self, shard: &mut impl ShardAccess) {
        self.leave(shard);
        self.closed = true;
    }

    /// The server shuts down: a pull still waiting is answered [`ErrorCode::ShuttingDown`]
    /// (its request fails; frames held behind it are dropped), then Bye, then close.
    pub fn shutdown(&mut self, shard: &mut impl ShardAccess) {
        if self.closed {
            return;
        }
        if let Some(w) = self.waiting.take() {
            self.send(wire::encode_error(
                w.request_id,
                self.cfg.id,
                ErrorCode::ShuttingDown,
                "server shutting down",
            ));
        }
        let bye = wire::encode(&Message::Bye {
            shard: self.cfg.id,
            bye: Bye {
                reason: "server shutting down".into(),
            },
        });
        self.actions.push_back(Action::Send(bye));
        self.close(shard, "server shutting down".into());
    }

    /// The driver turns the connection away (its worker was quarantined): an error frame
    /// with `code` and `message` (request id 0), then Close.
    pub fn expel(&mut self, shard: &mut impl ShardAccess, code: ErrorCode, message: String) {
        if self.closed {
            return;
        }
        let worker = self.worker;
        if let Some(w) = worker {
            // Before the close: leaving may apply the round, and its pushes must not be in it.
            let pushes = shard.with(|s| s.drop_pending(w));
            if pushes > 0 {
                self.actions
                    .push_back(Action::Record(Record::Dropped { worker: w, pushes }));
            }
        }
        self.actions
            .push_back(Action::Record(Record::Rejected { worker, code }));
        self.send(wire::encode_error(0, self.cfg.id, code, message.clone()));
        self.close(shard, format!("{}: {message}", code.name()));
    }

    fn close(&mut self, shard: &mut impl ShardAccess, reason: String) {
        if self.closed {
            return;
        }
        self.actions.push_back(Action::Close(reason));
        self.leave(shard);
        self.closed = true;
        self.waiting = None;
        self.deferred.clear();
    }

    fn leave(&mut self, shard: &mut impl ShardAccess) {
        if let Some(worker) = self.worker.take() {
            shard.with(|s| s.leave(worker));
            self.actions
                .push_back(Action::Record(Record::Left { worker }));
        }
    }

    fn send(&mut self, frame: Vec<u8>) {
        self.actions.push_back(Action::Send(frame));
    }

    /// Records the rejection, sends the error frame, and closes if the code is fatal.
    fn fail(
        &mut self,
        shard: &mut impl ShardAccess,
        request_id: u32,
        code: ErrorCode,
        message: String,
        push: Option<(u32, usize)>,
        _now: f64,
    ) {
        let worker = self.worker;
        let record = match push {
            Some((samples, bytes)) => Record::Pushed {
                worker,
                outcome: Outcome::Rejected {
                    code,
                    message: message.clone(),
                },
                samples,
                bytes,
            },
            None => Record::Rejected { worker, code },
        };
        self.actions.push_back(Action::Record(record));
        self.send(wire::encode_error(
            request_id,
            self.cfg.id,
            code,
            message.clone(),
        ));
        if code.is_fatal() {
            self.close(shard, format!("{}: {message}", code.name()));
        }
    }

    /// Re-checks a waiting pull; `due` when its deadline passed (sync: flush first). Then
    /// handles the frames that were held behind it, until one waits again.
    fn retry(&mut self, shard: &mut impl ShardAccess, now: f64, due: bool) {
        let Some(w) = self.waiting else { return };
        if self.closed {
            return;
        }
        if due {
            // Rule 3: stragglers; apply what was gathered so far.
            shard.with(|s| {
                if matches!(s.consistency(), Consistency::Sync { .. }) {
                    s.flush();
                }
            });
        }
        let since = if due { now } else { w.since };
        if !self.pull(shard, w.request_id, w.min_version, now, since) {
            return;
        }
        while !self.closed && self.waiting.is_none() {
            let Some(bytes) = self.deferred.pop_front() else {
                break;
            };
            self.frame(shard, &bytes, now);
        }
    }

    /// Answers a pull, or parks it. Returns whether it was answered.
    fn pull(
        &mut self,
        shard: &mut impl ShardAccess,
        request_id: u32,
        min_version: u64,
        now: f64,
        since: f64,
    ) -> bool {
        let Some(worker) = self.worker else {
            return true;
        };
        let (gate, clock, min_clock) = if shard.mode() == Consistency::Async {
            (Gate::Open, None, None)
        } else {
            shard.with(|s| {
                let g = s.gate(worker, min_version, now, since);
                let (c, m) = s.read_view(worker, now);
                (g, c, m)
            })
        };
        if let Gate::Wait(deadline) = gate {
            self.waiting = Some(Waiting {
                request_id,
                min_version,
                since,
                deadline,
            });
            return false;
        }
        self.waiting = None;
        let (version, values) = shard.snapshot();
        let frame = wire::encode_params_as(
            self.pull_encoding,
            request_id,
            self.cfg.id,
            version,
            &values,
        )
        // Parameters are finite (every update is validated), so this does not happen;
        // if it did, f32 says exactly what the shard holds.
        .unwrap_or_else(|_| wire::encode_params(request_id, self.cfg.id, version, &values));
        let bytes = frame.len();
        self.send(frame);
        self.actions.push_back(Action::Record(Record::Pulled {
            worker,
            bytes,
            version,
            clock,
            min_clock,
        }));
        true
    }

    fn frame(&mut self, shard: &mut impl ShardAccess, bytes: &[u8], now: f64) {
        let id = self.cfg.id;
        let msg = match wire::decode(bytes, self.cfg.frame_limit()) {
            Ok(m) => m,
            Err(e) => {
                let rid = header_request_id(bytes);
                return self.fail(shard, rid, ErrorCode::from(&e), e.to_string(), None, now);
            }
        };
        let (request_id, addressed, push) = match &msg {
            Message::Push {
                request_id,
                shard,
                samples,
                ..
            } => (*request_id, *shard, Some((*samples, bytes.len()))),
            Message::Hello {
                request_id, shard, ..
            }
            | Message::Pull {
                request_id, shard, ..
            }
            | Message::Welcome {
                request_id, shard, ..
            }
            | Message::Params {
                request_id, shard, ..
            }
            | Message::Ack {
                request_id, shard, ..
            }
            | Message::Error {
                request_id, shard, ..
            } => (*request_id, *shard, None),
            Message::Bye { shard, .. } | Message::Report { shard, .. } => (0, *shard, None),
        };
        if addressed != id {
            let m = format!("frame addressed to shard {addressed} arrived at shard {id}");
            return self.fail(shard, request_id, ErrorCode::WrongShard, m, push, now);
        }
        if let Some(w) = self.worker {
            shard.with(|s| s.seen(w, now));
        }
        match msg {
            Message::Hello { hello, .. } => {
                if self.worker.is_some() {
                    let m = "second Hello on one connection".to_string();
                    return self.fail(shard, request_id, ErrorCode::Protocol, m, None, now);
                }
                if hello.protocol != PROTOCOL_VERSION {
                    let m = format!(
                        "worker speaks protocol {}, this server speaks {PROTOCOL_VERSION}",
                        hello.protocol
                    );
                    return self.fail(shard, request_id, ErrorCode::ProtocolVersion, m, None, now);
                }
                match shard.admit(hello.worker_id, hello.credential.as_deref()) {
                    Admission::Admitted => {}
                    Admission::Unknown => {
                        let m = format!(
                            "worker id {} is unknown; POST /api/join first",
                            hello.worker_id
                        );
                        let code = ErrorCode::UnknownWorker;
                        return self.fail(shard, request_id, code, m, None, now);
                    }
                    Admission::BadCredential => {
                        let m = format!(
                            "the credential does not belong to worker {}; use the one from its join",
                            hello.worker_id
                        );
                        let code = ErrorCode::Unauthorized;
                        return self.fail(shard, request_id, code, m, None, now);
                    }
                    Admission::Quarantined(why) => {
                        let m = format!("worker {} is quarantined: {why}", hello.worker_id);
                        let code = ErrorCode::Quarantined;
                        return self.fail(shard, request_id, code, m, None, now);
                    }
                }
                let worker = hello.worker_id;
                self.worker = Some(worker);
                self.pull_encoding = Encoding::negotiate(
                    &hello.pull_encodings,
                    &fallbacks(self.cfg.setup.pull_encoding),
                );
                self.push_encoding = Encoding::negotiate(
                    &hello.push_encodings,
                    &fallbacks(self.cfg.setup.push_encoding),
                );
                let version = shard.with(|s| {
                    s.join(worker, now);
                    s.version()
                });
                self.actions
                    .push_back(Action::Record(Record::Joined { worker }));
                self.send(wire::encode(&Message::Welcome {
                    request_id,
                    shard: id,
                    welcome: Welcome {
                        protocol: PROTOCOL_VERSION,
                        range: self.cfg.range,
                        version,
                        pull_encoding: self.pull_encoding,
                        push_encoding: self.push_encoding,
                        reports: self.cfg.setup.reports && self.cfg.id == 0,
                        spot_checks: shard.spot_checks(),
                    },
                }));
            }
            _ if self.worker.is_none() => {
                let m = "the first frame must be Hello".to_string();
                self.fail(shard, request_id, ErrorCode::Protocol, m, push, now);
            }
            Message::Pull { min_version, .. } => {
                self.pull(shard, request_id, min_version, now, now);
            }
            Message::Push {
                base_version,
                samples,
                grad,
                ..
            } => {
                let worker = self.worker.unwrap_or_default();
                if grad.len() != self.cfg.range.len() {
                    let m = format!(
                        "push of {} values to a shard of {}",
                        grad.len(),
                        self.cfg.range.len()
                    );
                    return self.fail(shard, request_id, ErrorCode::WrongLength, m, push, now);
                }
                if self.last_push.is_some_and(|last| request_id <= last) {
                    let m = format!(
                        "push request id {request_id} is not above this connection's last push {}",
                        self.last_push.unwrap_or_default()
                    );
                    return self.fail(shard, request_id, ErrorCode::Replayed, m, push, now);
                }
                self.last_push = Some(request_id);
                // The frame decoded, so its meta, if any, is a valid tag.
                let tag = wire::push_tag(bytes).ok().flatten();
                if tag.is_none() && shard.spot_checks() {
                    let m = "this shard spot-checks pushes: every push must carry a PushTag meta"
                        .to_string();
                    return self.fail(shard, request_id, ErrorCode::Protocol, m, push, now);
                }
                let outcome = shard.with(|s| s.push(worker, base_version, grad, samples, now));
                if let Some(tag) = tag.filter(|t| {
                    matches!(outcome, Outcome::Applied { .. } | Outcome::Buffered { .. })
                        && shard.sample(worker, t)
                }) {
                    let mut copy = vec![0.0; grad.len()];
                    if grad.copy_into(&mut copy).is_ok() {
                        shard.take_sample(SampledPush {
                            worker,
                            shard: id,
                            base_version,
                            samples,
                            tag,
                            pull_encoding: self.pull_encoding,
                            grad: copy,
                        });
                    }
                }
                let (version, staleness) = match &outcome {
                    Outcome::Applied {
                        version, staleness, ..
                    } => (*version, *staleness),
                    Outcome::Buffered { version, .. } => (*version, 0),
                    Outcome::Rejected { code, message } => {
                        let (code, message) = (*code, message.clone());
                        return self.fail(shard, request_id, code, message, push, now);
                    }
                };
                self.actions.push_back(Action::Record(Record::Pushed {
                    worker: Some(worker),
                    outcome,
                    samples,
                    bytes: bytes.len(),
                }));
                self.send(wire::encode(&Message::Ack {
                    request_id,
                    shard: id,
                    version,
                    staleness: staleness.min(u64::from(u32::MAX)) as u32,
                }));
            }
            Message::Bye { .. } => self.close(shard, "worker said bye".into()),
            Message::Report { report, .. } => {
                if !(self.cfg.setup.reports && self.cfg.id == 0) {
                    let m = "this shard takes no Report frames".to_string();
                    return self.fail(shard, request_id, ErrorCode::Protocol, m, None, now);
                }
                let worker = self.worker.unwrap_or_default();
                let encodings = (self.pull_encoding, self.push_encoding);
                self.actions.push_back(Action::Record(Record::Reported {
                    worker,
                    report,
                    encodings,
                }));
            }
            Message::Welcome { .. }
            | Message::Params { .. }
            | Message::Ack { .. }
            | Message::Error { .. } => {
                let m = "a worker sent a shard-side message".to_string();
                self.fail(shard, request_id, ErrorCode::Protocol, m, None, now);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{OptimizerConfig, Rule};
    use crate::shard::StalenessPolicy;
    use crate::wire::{ClientKind, Hello};

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

    fn state(consistency: Consistency, n: usize) -> ShardState {
        let setup = ShardSetup {
            optimizer: OptimizerConfig {
                rule: Rule::Sgd,
                lr: 1.0,
                weight_decay: 0.0,
                clip_norm: None,
            },
            staleness: StalenessPolicy::default(),
            consistency,
            heartbeat: 5.0,
            sync_timeout: 2.0,
            pull_encoding: Encoding::F32,
            push_encoding: Encoding::F32,
            reports: false,
            pseudo_gradients: false,
            guard: PushGuard::default(),
            aggregation: crate::robust::Aggregation::Mean,
        };
        let range = KeyRange {
            start: 4,
            end: 4 + n,
        };
        setup.state(1, range, vec![0.0; n]).unwrap()
    }

    fn hello(rid: u32, worker: u64) -> Vec<u8> {
        wire::encode(&Message::Hello {
            request_id: rid,
            shard: 1,
            hello: Hello {
                protocol: PROTOCOL_VERSION,
                worker_id: worker,
                client: ClientKind::Native,
                ..Default::default()
            },
        })
    }

    fn pull(rid: u32, min_version: u64) -> Vec<u8> {
        wire::encode(&Message::Pull {
            request_id: rid,
            shard: 1,
            min_version,
        })
    }

    /// The frames sent, decoded to (kind name, request id, version or error code).
    fn sent(s: &mut ShardSession) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(a) = s.poll_action() {
            match a {
                Action::Send(f) => out.push(match wire::decode(&f, usize::MAX).unwrap() {
                    Message::Welcome { request_id, .. } => format!("welcome {request_id}"),
                    Message::Params {
                        request_id,
                        version,
                        ..
                    } => format!("params {request_id} v{version}"),
                    Message::Ack {
                        request_id,
                        version,
                        ..
                    } => format!("ack {request_id} v{version}"),
                    Message::Error {
                        request_id, error, ..
                    } => format!("error {request_id} {}", error.code.name()),
                    Message::Bye { .. } => "bye".into(),
                    other => format!("{other:?}"),
                }),
                Action::Close(_) => out.push("close".into()),
                Action::Record(_) => {}
            }
        }
        out
    }

    #[test]
    fn errors_echo_the_request_id_and_fatal_ones_close() {
        let mut sh = state(Consistency::Async, 2);
        let mut s = ShardSession::new(*sh.config());
        s.handle_frame(&mut sh, &pull(5, 0), 0.0);
        assert_eq!(sent(&mut s), ["error 5 protocol", "close"]);
        s.handle_frame(&mut sh, &hello(6, 1), 0.0);
        assert!(sent(&mut s).is_empty(), "a closed session ignores input");

        let mut s = ShardSession::new(*sh.config());
        s.handle_frame(&mut sh, &[b'C', b'G', 1, 3, 9, 0, 0, 0, 0, 0], 0.0);
        assert_eq!(
            sent(&mut s),
            ["error 0 malformed", "close"],
            "short header: id 0"
        );

        let mut s = ShardSession::new(*sh.config());
        s.handle_frame(&mut sh, &hello(1, 7), 0.0);
        s.handle_frame(
            &mut sh,
            &wire::encode_push(2, 1, 0, 8, &[1.0, f32::NAN]),
            0.0,
        );
        assert_eq!(sent(&mut s), ["welcome 1", "error 2 not_finite", "close"]);
        assert_eq!(sh.connected(), 0, "a closed connection leaves the shard");
        assert_eq!(**sh.values(), vec![0.0, 0.0], "unchanged");
    }

    #[test]
    fn async_pushes_apply_and_pulls_see_them() {
        let mut sh = state(Consistency::Async, 2);
        let mut s = ShardSession::new(*sh.config());
        s.handle_frame(&mut sh, &hello(1, 7), 0.0);
        s.handle_frame(&mut sh, &wire::encode_push(2, 1, 0, 8, &[1.0, -1.0]), 0.0);
        s.handle_frame(&mut sh, &pull(3, 0), 0.0);
        s.handle_frame(
            &mut sh,
            &wire::encode_push(4, 1, 0, 8, &[1.0, -1.0, 3.0]),
            0.0,
        );
        assert_eq!(
            sent(&mut s),
            [
                "welcome 1",
                "ack 2 v1",
                "params 3 v1",
                "error 4 wrong_length",
                "close"
            ]
        );
        assert_eq!(**sh.values(), vec![-1.0, 1.0]);
    }

    /// The flush-on-leave rule (module doc, rule 2): with sync:4 and four workers, two
    /// gradients buffered and one worker leaving, the shard keeps waiting for the two that can
    /// still push; when the next one leaves, the two buffered equal the two left: flush.
    #[test]
    fn sync_flushes_on_leave_only_when_no_more_gradients_can_come() {
        let mut sh = state(Consistency::Sync { k: 4 }, 1);
        let mut s: Vec<ShardSession> = (0..4).map(|_| ShardSession::new(*sh.config())).collect();
        for (i, x) in s.iter_mut().enumerate() {
            x.handle_frame(&mut sh, &hello(1, i as u64 + 1), 0.0);
        }
        s[0].handle_frame(&mut sh, &wire::encode_push(2, 1, 0, 8, &[1.0]), 0.0);
        s[1].handle_frame(&mut sh, &wire::encode_push(2, 1, 0, 8, &[3.0]), 0.0);
        assert_eq!(sh.core().pending(), 2);
        s[3].handle_close(&mut sh);
        assert_eq!(
            (sh.version(), sh.core().pending()),
            (0, 2),
            "two can still push"
        );
        s[2].handle_close(&mut sh);
        assert_eq!(sh.version(), 1, "two buffered, two connected: flush");
        assert_eq!(**sh.values(), vec![-2.0]);
        assert_eq!(sh.updates().get(&2), Some(&1));
    }

    /// Issue 10: a worker caught cheating has its pending pushes dropped. In sync:3 with three
    /// workers, the cheat's push and an honest one are buffered; expelling the cheat takes its
    /// push out before its leaving could apply the round, and the round applies the honest
    /// pushes only. Without droppable rounds (a running sum) nothing can be taken out.
    #[test]
    fn an_expelled_workers_pending_sync_pushes_are_dropped_from_the_round() {
        let mut sh = state(Consistency::Sync { k: 3 }, 1);
        sh.set_droppable(true).unwrap();
        let mut s: Vec<ShardSession> = (0..3).map(|_| ShardSession::new(*sh.config())).collect();
        for (i, x) in s.iter_mut().enumerate() {
            x.handle_frame(&mut sh, &hello(1, i as u64 + 1), 0.0);
        }
        s[0].handle_frame(&mut sh, &wire::encode_push(2, 1, 0, 8, &[1000.0]), 0.0);
        s[1].handle_frame(&mut sh, &wire::encode_push(2, 1, 0, 8, &[2.0]), 0.0);
        assert_eq!(sh.core().pending(), 2);
        for x in s.iter_mut() {
            sent(x);
        }
        s[0].expel(
            &mut sh,
            ErrorCode::Quarantined,
            "failed a spot check".into(),
        );
        let mut dropped = Vec::new();
        let mut frames = Vec::new();
        while let Some(a) = s[0].poll_action() {
            match a {
                Action::Record(Record::Dropped { worker, pushes }) => {
                    dropped.push((worker, pushes))
                }
                Action::Send(f) => frames.push(f),
                _ => {}
            }
        }
        assert_eq!(dropped, [(1, 1)]);
        assert_eq!(frames.len(), 1, "the quarantined error frame");
        assert_eq!(
            (sh.version(), sh.core().pending(), sh.connected()),
            (0, 1, 2),
            "the honest push waits for the third"
        );
        s[2].handle_frame(&mut sh, &wire::encode_push(2, 1, 0, 8, &[4.0]), 0.0);
        assert_eq!(sh.version(), 1);
        assert_eq!(**sh.values(), vec![-3.0], "the mean of 2 and 4 only");
        assert_eq!(sh.updates().get(&2), Some(&1));

        // Leaving alone (no expel) keeps a push: it was honest as far as anyone knows.
        let mut sh = state(Consistency::Sync { k: 3 }, 1);
        sh.set_droppable(true).unwrap();
        let mut s: Vec<ShardSession> = (0..3).map(|_| ShardSession::new(*sh.config())).collect();
        for (i, x) in s.iter_mut().enumerate() {
            x.handle_frame(&mut sh, &hello(1, i as u64 + 1), 0.0);
        }
        s[0].handle_frame(&mut sh, &wire::encode_push(2, 1, 0, 8, &[6.0]), 0.0);
        s[0].handle_close(&mut sh);
        assert_eq!(sh.core().pending(), 1);
        // Two buffered, two connected: the round (6 and 2) is applied.
        s[1].handle_frame(&mut sh, &wire::encode_push(2, 1, 0, 8, &[2.0]), 0.0);
        assert_eq!(**sh.values(), vec![-4.0]);

        // A running-sum round cannot be split: nothing is dropped, and it says so.
        let mut sh = state(Consistency::Sync { k: 2 }, 1);
        let mut s: Vec<ShardSession> = (0..2).map(|_| ShardSession::new(*sh.config())).collect();
        for (i, x) in s.iter_mut().enumerate() {
            x.handle_frame(&mut sh, &hello(1, i as u64 + 9), 0.0);
        }
        s[0].handle_frame(&mut sh, &wire::encode_push(2, 1, 0, 8, &[1.0]), 0.0);
        assert_eq!(sh.drop_pending(9), 0);
        assert_eq!(sh.core().pending(), 1);
    }

    #[test]
    fn a_round_too_large_to_keep_apart_is_refused() {
        let mut sh = state(Consistency::Sync { k: 65_536 }, 1 << 16);
        let e = sh.set_droppable(true).unwrap_err().to_string();
        assert!(e.contains("lower K"), "{e}");
        assert!(!sh.core().keeps_rows(), "nothing changed");
        sh.set_droppable(false).unwrap();
    }

    #[test]
    fn sync_pull_waits_then_flushes_at_the_timeout_and_held_frames_follow() {
        let mut sh = state(Consistency::Sync { k: 2 }, 1);
        let mut a = ShardSession::new(*sh.config());
        let mut b = ShardSession::new(*sh.config());
        a.handle_frame(&mut sh, &hello(1, 1), 0.0);
        b.handle_frame(&mut sh, &hello(1, 2), 0.0);
        a.handle_frame(&mut sh, &wire::encode_push(2, 1, 0, 8, &[1.0]), 0.0);
        a.handle_frame(&mut sh, &pull(3, 1), 0.5);
        a.handle_frame(&mut sh, &pull(4, 0), 0.6);
        assert!(a.is_waiting());
        assert_eq!(a.poll_timeout(), Some(2.5));
        assert_eq!(sent(&mut a), ["welcome 1", "ack 2 v0"]);
        a.handle_timeout(&mut sh, 1.0);
        assert!(a.is_waiting(), "not due yet");
        a.handle_timeout(&mut sh, 2.5);
        assert_eq!(sent(&mut a), ["params 3 v1", "params 4 v1"]);
        assert_eq!(sh.updates().get(&1), Some(&1), "a partial update of one");
        // A fresh round: b's push completes the aggregate and releases a's pull.
        a.handle_frame(&mut sh, &wire::encode_push(5, 1, 1, 8, &[1.0]), 3.0);
        a.handle_frame(&mut sh, &pull(6, 2), 3.0);
        assert!(a.is_waiting());
        b.handle_frame(&mut sh, &wire::encode_push(2, 1, 1, 8, &[3.0]), 3.1);
        a.handle_update(&mut sh, 3.1);
        assert_eq!(sent(&mut a), ["ack 5 v1", "params 6 v2"]);
        assert_eq!(sh.updates().get(&2), Some(&1));
    }

    /// The admin API's consistency change (issue 9): sessions read the mode from the shared
    /// state, so a switch reaches open connections, and a pull parked under the old mode is
    /// re-checked under the new one.
    #[test]
    fn consistency_changes_reach_open_sessions() {
        let mut sh = state(Consistency::Sync { k: 2 }, 1);
        let mut a = ShardSession::new(*sh.config());
        let mut b = ShardSession::new(*sh.config());
        a.handle_frame(&mut sh, &hello(1, 1), 0.0);
        b.handle_frame(&mut sh, &hello(1, 2), 0.0);
        a.handle_frame(&mut sh, &wire::encode_push(2, 1, 0, 8, &[1.0]), 0.1);
        a.handle_frame(&mut sh, &pull(3, 1), 0.1);
        assert!(a.is_waiting());
        // sync -> async: the pending aggregate is applied first, the parked pull answered.
        let epoch = sh.epoch();
        sh.set_consistency(Consistency::Async).unwrap();
        assert!(sh.epoch() > epoch);
        assert_eq!((sh.version(), sh.core().pending()), (1, 0));
        assert_eq!(sh.updates().get(&1), Some(&1), "a flush of one");
        a.handle_update(&mut sh, 0.2);
        assert_eq!(sent(&mut a), ["welcome 1", "ack 2 v0", "params 3 v1"]);
        // Async now: a stale push is applied, not refused as late.
        b.handle_frame(&mut sh, &wire::encode_push(2, 1, 0, 8, &[1.0]), 0.3);
        assert_eq!(sent(&mut b), ["welcome 1", "ack 2 v2"]);
        // async -> ssp:1: clocks are levelled, then the bound holds a runner back.
        sh.set_consistency(Consistency::Ssp { bound: 1 }).unwrap();
        for rid in [4, 5] {
            let v = sh.version();
            a.handle_frame(&mut sh, &wire::encode_push(rid, 1, v, 8, &[0.5]), 0.4);
        }
        a.handle_frame(&mut sh, &pull(6, 0), 0.4);
        assert!(a.is_waiting(), "two ahead of b with S = 1");
        // ssp -> sync is refused with a reason, and changes nothing.
        let e = sh.set_consistency(Consistency::Sync { k: 2 }).unwrap_err();
        assert!(e.contains("pull the current version"), "{e}");
        assert_eq!(sh.consistency(), Consistency::Ssp { bound: 1 });
        // ssp:1 -> ssp:4: the runner may read again.
        sh.set_consistency(Consistency::Ssp { bound: 4 }).unwrap();
        a.handle_update(&mut sh, 0.5);
        assert_eq!(sent(&mut a), ["ack 4 v3", "ack 5 v4", "params 6 v4"]);
        // sync:K -> sync:K' is allowed only from sync.
        let mut sh = state(Consistency::Sync { k: 3 }, 1);
        let mut c = ShardSession::new(*sh.config());
        c.handle_frame(&mut sh, &hello(1, 1), 0.0);
        sh.set_consistency(Consistency::Sync { k: 2 }).unwrap();
        assert_eq!(sh.core().consistency(), Consistency::Sync { k: 2 });
        // The aggregation rule must fit the new mode: Krum with f = 1 needs K >= 5, and a round
        // rule has no meaning in async. Refused, and nothing changes.
        let mut sh = state(Consistency::Sync { k: 5 }, 1);
        sh.cfg.setup.aggregation = crate::robust::Aggregation::Krum { f: 1 };
        for to in [Consistency::Sync { k: 4 }, Consistency::Async] {
            let e = sh.set_consistency(to).unwrap_err();
            assert!(e.contains("Krum") || e.contains("round rule"), "{to}: {e}");
            assert_eq!(sh.consistency(), Consistency::Sync { k: 5 });
        }
        sh.set_consistency(Consistency::Sync { k: 7 }).unwrap();
    }

    #[test]
    fn ssp_pull_waits_for_the_sleeper_to_expire() {
        let mut sh = state(Consistency::Ssp { bound: 1 }, 1);
        let mut a = ShardSession::new(*sh.config());
        let mut b = ShardSession::new(*sh.config());
        a.handle_frame(&mut sh, &hello(1, 1), 0.0);
        b.handle_frame(&mut sh, &hello(1, 2), 0.0);
        for rid in [2, 3] {
            let v = sh.version();
            a.handle_frame(&mut sh, &wire::encode_push(rid, 1, v, 8, &[0.0]), 0.1);
        }
        a.handle_frame(&mut sh, &pull(4, 0), 0.2);
        assert!(a.is_waiting(), "two ahead of a silent worker with S = 1");
        let t = a.poll_timeout().unwrap();
        assert!(
            t <= 1.2 + SSP_SLACK + 1e-9,
            "re-checks within a second: {t}"
        );
        let mut now = 0.2;
        while a.is_waiting() {
            now = a.poll_timeout().unwrap();
            a.handle_timeout(&mut sh, now);
        }
        assert!(
            now > 5.0,
            "released only after b's heartbeat expired: {now}"
        );
        assert_eq!(
            sent(&mut a),
            ["welcome 1", "ack 2 v1", "ack 3 v2", "params 4 v2"]
        );
    }

    #[test]
    fn shutdown_says_bye_and_deferred_frames_are_bounded() {
        let mut sh = state(Consistency::Sync { k: 2 }, 1);
        let mut a = ShardSession::new(*sh.config());
        let mut b = ShardSession::new(*sh.config());
        a.handle_frame(&mut sh, &hello(1, 1), 0.0);
        b.handle_frame(&mut sh, &hello(1, 2), 0.0);
        a.handle_frame(&mut sh, &pull(2, 1), 0.0);
        for i in 0..MAX_DEFERRED as u32 + 1 {
            a.handle_frame(&mut sh, &pull(10 + i, 0), 0.0);
        }
        let out = sent(&mut a);
        assert_eq!(out[1..], ["error 74 busy".to_string(), "close".into()]);
        b.shutdown(&mut sh);
        assert_eq!(sent(&mut b), ["welcome 1", "bye", "close"]);
        assert_eq!(sh.connected(), 0);
        // A pull still waiting for the next version fails with shutting_down before the Bye.
        let mut c = ShardSession::new(*sh.config());
        c.handle_frame(&mut sh, &hello(1, 3), 0.0);
        c.handle_frame(&mut sh, &pull(5, 1), 0.0);
        c.shutdown(&mut sh);
        assert_eq!(
            sent(&mut c),
            ["welcome 1", "error 5 shutting_down", "bye", "close"]
        );
        assert_eq!(sh.connected(), 0);
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
