//! What the connections of one shard share: [`ShardState`] and the rules that involve several
//! connections (who counts for sync and SSP, when a sync aggregate is flushed, when a waiting
//! pull may be answered), and [`ShardAccess`], how a session reaches it.

use super::guard::{digest, PushLog, WorkerNorms};
use super::setup::round_memory;
use super::{ShardConfig, NORM_WARMUP};
use crate::codec::Encoding;
use crate::error::Error;
use crate::shard::{Consistency, Outcome, ShardCore, SspClock};
use crate::wire::{self, ErrorCode, Payload};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// How often a waiting SSP pull re-checks the clock at the latest, seconds (a worker's
/// heartbeat may expire without any event).
const SSP_RECHECK: f64 = 1.0;
/// Slack after a heartbeat expiry before re-checking, seconds.
const SSP_SLACK: f64 = 0.001;

/// Most sessions one worker (one credential) may hold open on one shard at once: its
/// connection, and one more while a reconnect overlaps the old socket's close. A Hello past it
/// is answered `busy` and closed, so one credential cannot hold many sockets.
pub const MAX_SOCKETS_PER_WORKER: u32 = 2;

/// The state every connection of one shard shares.
#[derive(Debug)]
pub struct ShardState {
    pub(super) cfg: ShardConfig,
    core: ShardCore,
    clock: SspClock,
    /// Workers past Hello and not yet gone.
    connected: usize,
    /// Open sessions past Hello, by worker (at most [`MAX_SOCKETS_PER_WORKER`] each).
    sockets: std::collections::HashMap<u64, u32>,
    /// The bytes of one `Params` frame for each of those sessions, summed: what one pull by
    /// every connected worker sends (the pace rule's `S`, [`crate::shard::pace`]).
    demand: u64,
    /// Updates applied, by how many gradients each merged.
    updates: BTreeMap<usize, u64>,
    /// Bumped by every change a waiting pull may be waiting for (a version, a clock).
    epoch: u64,
    /// The gradient of the push being applied, validated before it reaches `core`.
    pub(super) scratch: Vec<f32>,
    /// Trusted workers (at most [`NORM_WINDOW`](super::NORM_WINDOW)): their recent accepted
    /// and refused per-step norms, for the norm reference (guard.rs module docs).
    pub(super) norms: Vec<WorkerNorms>,
    /// Workers on probation (at most [`PROBATION`](super::guard::PROBATION)): no say in the
    /// reference until they have earned it, except in the bootstrap.
    pub(super) probation: Vec<WorkerNorms>,
    /// The driver's own per-step gradient norm for this slice and when it was measured.
    pub(super) anchor: Option<(f32, f64)>,
    /// Scratch for the medians (no allocation per push once grown).
    pub(super) norm_scratch: Vec<f32>,
    /// Per worker, across its connections: its last push request id and recent gradient
    /// digests (the replay check), at most [`MAX_PUSHERS`](super::guard::MAX_PUSHERS).
    pub(super) pushers: HashMap<u64, PushLog>,
    pub(super) log_tick: u64,
    /// The digest of the last push's decoded gradient (0 before any, or for a refused one),
    /// [`ShardState::last_digest`].
    pub(super) last_digest: u64,
    /// Pushes accepted so far (the norm bound's warm-up).
    pub(super) accepted: u64,
    /// Whether the last push offered had a non-zero gradient (its norm was above 0): what
    /// [`crate::session::Record::Pushed`] carries as `nonzero`.
    pub(super) last_push_nonzero: bool,
    /// Held pushes screened and not yet applied, (worker, request id), oldest first, at most
    /// [`MAX_HELD`]: [`ShardState::apply_held`] applies each once.
    held: std::collections::VecDeque<(u64, u32)>,
    /// Whether the last push was over the norm bound and scaled down to it (guard.rs docs):
    /// what [`crate::session::Record::Pushed`] carries as `clipped`.
    pub(super) last_push_clipped: bool,
    /// Pushes scaled down to the bound so far.
    pub(super) clipped: u64,
    /// Workers with a recent accepted nonzero push: the K of a local-steps shard's `lr / K`
    /// ([`super::active`]).
    active: super::active::ActivePushers,
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
            sockets: std::collections::HashMap::new(),
            demand: 0,
            updates: BTreeMap::new(),
            epoch: 0,
            norms: Vec::new(),
            probation: Vec::new(),
            anchor: None,
            norm_scratch: Vec::new(),
            pushers: HashMap::new(),
            log_tick: 0,
            last_digest: 0,
            accepted: 0,
            last_push_nonzero: false,
            held: std::collections::VecDeque::new(),
            last_push_clipped: false,
            clipped: 0,
            active: Default::default(),
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
    /// [`Error::Config`] when K rows of this shard would exceed [`MAX_ROUND_BYTES`](super::MAX_ROUND_BYTES); nothing
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

    /// Operator controls: starts over from `values` ([`ShardCore::restart`]: a teacher's next
    /// experiment). The norm reference starts over too (the new model's gradients are not the
    /// old one's); connections, SSP clocks and the replay log stay. Wakes waiting pulls.
    ///
    /// # Errors
    /// As [`ShardCore::restart`]; nothing changes.
    pub fn restart(&mut self, values: Vec<f32>) -> crate::Result<()> {
        self.core.restart(values)?;
        self.norms.clear();
        self.probation.clear();
        self.anchor = None;
        self.accepted = 0;
        self.epoch += 1;
        Ok(())
    }

    /// Rolls the shard back to `values` (the parameters of an earlier version, kept by the
    /// driver) after poison was detected: they are published as the next version (versions
    /// stay monotonic for the workers, the SSP clock and the replay log), the optimizer state
    /// kept and the pending `sync:K` round dropped ([`ShardCore::roll_back`]). Unlike
    /// [`ShardState::restart`], what the workers have earned stays (trust, the replay log, the
    /// anchor), except `poisoner`'s norms, which leave the reference.
    ///
    /// # Errors
    /// When `values` does not have the shard's length or holds a non-finite value; nothing
    /// changes.
    pub fn roll_back(&mut self, values: Vec<f32>, poisoner: u64) -> crate::Result<()> {
        self.core.roll_back(values)?;
        self.norms.retain(|e| e.worker != poisoner);
        self.probation.retain(|e| e.worker != poisoner);
        self.epoch += 1;
        Ok(())
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

    /// A buffer of values a driver let go, for the next update to write into
    /// ([`ShardCore::recycle`]).
    pub fn recycle(&mut self, buf: Arc<Vec<f32>>) {
        self.core.recycle(buf);
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

    /// The bytes of one `Params` frame to every connected session, summed (the pace rule's
    /// `S`).
    pub fn demand(&self) -> u64 {
        self.demand
    }

    /// The shard's pace now, seconds: [`demand`](Self::demand) over the shard's share of the
    /// run's egress budget; 0 without one ([`crate::shard::Pacing::pace_s`]).
    pub fn pace_s(&self) -> f64 {
        self.cfg
            .setup
            .pacing
            .pace_s(self.cfg.range.len(), self.demand)
    }

    /// A worker said Hello; one `Params` frame to it is `frame_bytes` bytes.
    pub(super) fn join(&mut self, worker: u64, now: f64, frame_bytes: u64) {
        self.connected += 1;
        *self.sockets.entry(worker).or_default() += 1;
        self.active.joined(worker, now);
        self.demand = self.demand.saturating_add(frame_bytes);
        self.clock.join(worker, now);
        self.epoch += 1;
    }

    /// Sessions of `worker` open on this shard (past Hello).
    pub fn sockets_of(&self, worker: u64) -> u32 {
        self.sockets.get(&worker).copied().unwrap_or(0)
    }

    /// Rule 2 of the sync flush decisions (module doc).
    pub(super) fn leave(&mut self, worker: u64, frame_bytes: u64) {
        self.connected = self.connected.saturating_sub(1);
        self.demand = self.demand.saturating_sub(frame_bytes);
        // The clock forgets the worker with its last session here, not with any one of them.
        match self.sockets.get_mut(&worker) {
            Some(n) if *n > 1 => *n -= 1,
            _ => {
                self.sockets.remove(&worker);
                self.clock.leave(worker);
                self.active.left(worker);
            }
        }
        self.epoch += 1;
        if matches!(self.cfg.setup.consistency, Consistency::Sync { .. })
            && self.core.pending() > 0
            && self.core.pending() >= self.connected
        {
            self.flush();
        }
    }

    pub(super) fn seen(&mut self, worker: u64, now: f64) {
        if matches!(self.cfg.setup.consistency, Consistency::Ssp { .. }) {
            let before = self.clock.clock(worker);
            self.clock.seen(worker, now);
            if self.clock.clock(worker) != before {
                self.epoch += 1;
            }
        }
    }

    /// Sync: applies the partial aggregate now (rules 1 to 3).
    pub(super) fn flush(&mut self) {
        if let Some(o) = self.core.flush() {
            self.record(&o);
        }
    }

    /// The digest of the last push's decoded gradient (0 after a push refused before its
    /// gradient was read): the replay check's key.
    pub fn last_digest(&self) -> u64 {
        self.last_digest
    }

    /// Validates `grad` (length, finite) into scratch, refuses replays (guard.rs module docs)
    /// and outliers, and applies it (rule 1 included).
    #[allow(clippy::too_many_arguments)]
    /// A held push ([`Sampling::Hold`]) whose spot check passed, applied now as it would have
    /// been when it arrived: request id and replay checks, the norm bound against the
    /// reference of now, staleness from its base version, `lr / K`. Returns the outcome and
    /// whether the gradient was nonzero (the ledger credits only those).
    pub fn apply_held(&mut self, push: &SampledPush, now: f64) -> (Outcome, bool) {
        let key = (push.worker, push.request_id);
        let Some(i) = self.held.iter().position(|k| *k == key) else {
            self.last_push_nonzero = false;
            let message = format!(
                "push {} of worker {} is not held here (applied already, or never screened)",
                push.request_id, push.worker
            );
            return (
                Outcome::Rejected {
                    code: ErrorCode::Replayed,
                    message,
                },
                false,
            );
        };
        self.held.remove(i);
        let bytes: Vec<u8> = push.grad.iter().flat_map(|v| v.to_le_bytes()).collect();
        let payload = wire::Payload::f32(&bytes);
        let outcome = self.push_screened(
            push.worker,
            push.request_id,
            push.base_version,
            payload,
            push.samples,
            now,
            true,
        );
        (outcome, self.last_push_nonzero)
    }

    /// Screens a push about to be held ([`Sampling::Hold`]) as [`ShardState::push`] screens
    /// any push before it applies it: its request id follows the worker's last, its values
    /// and sample count are within bounds, and its gradient was not pushed before. Its
    /// request id and digest are taken now, so a replay of it while it waits for its check
    /// is refused as one. [`ShardState::apply_held`] does not screen it again.
    ///
    /// # Errors
    /// The refusal's code and message; nothing is taken then but the request id.
    pub fn screen_held(
        &mut self,
        worker: u64,
        request_id: u32,
        base_version: u64,
        grad: &[f32],
        samples: u32,
    ) -> Result<(), (ErrorCode, String)> {
        self.check_request(worker, request_id)
            .map_err(|m| (ErrorCode::Replayed, m))?;
        self.scratch.clear();
        self.scratch.extend_from_slice(grad);
        let norm = self
            .guard(samples)
            .map_err(|m| (ErrorCode::OutOfBounds, m))?;
        if norm > 0.0 {
            let d = digest(&self.scratch);
            if base_version <= self.core.version() && self.seen_digest(worker, d) {
                return Err((
                    ErrorCode::Replayed,
                    "this gradient was pushed before".into(),
                ));
            }
            self.note_digest(worker, d);
        }
        if self.held.len() >= MAX_HELD {
            self.held.pop_front();
        }
        self.held.push_back((worker, request_id));
        Ok(())
    }

    pub(super) fn push(
        &mut self,
        worker: u64,
        request_id: u32,
        base_version: u64,
        grad: Payload<'_>,
        samples: u32,
        now: f64,
    ) -> Outcome {
        self.push_screened(worker, request_id, base_version, grad, samples, now, false)
    }

    /// [`ShardState::push`]; `screened` when [`ShardState::screen_held`] already took its
    /// request id and digest.
    #[allow(clippy::too_many_arguments)]
    fn push_screened(
        &mut self,
        worker: u64,
        request_id: u32,
        base_version: u64,
        grad: Payload<'_>,
        samples: u32,
        now: f64,
        screened: bool,
    ) -> Outcome {
        self.last_digest = 0;
        self.last_push_clipped = false;
        if !screened {
            if let Err(message) = self.check_request(worker, request_id) {
                return Outcome::Rejected {
                    code: ErrorCode::Replayed,
                    message,
                };
            }
        }
        if let Err(e) = grad.copy_into(&mut self.scratch) {
            return Outcome::Rejected {
                code: ErrorCode::from(&e),
                message: e.to_string(),
            };
        }
        // Whether the push moves anything: an all-zero push (norm 0) earns no credit in the
        // server's ledger, though the shard accepts it (it is harmless to the model).
        self.last_push_nonzero = false;
        let norm = match self.guard(samples) {
            Ok(n) => n,
            Err(message) => {
                return Outcome::Rejected {
                    code: ErrorCode::OutOfBounds,
                    message,
                }
            }
        };
        self.last_push_nonzero = norm > 0.0;
        // The same nonzero gradient twice is a replay, whatever its request id or connection.
        // (A push from a future version is left to the core, which refuses it as such.)
        let d = if norm > 0.0 { digest(&self.scratch) } else { 0 };
        if !screened
            && norm > 0.0
            && base_version <= self.core.version()
            && self.seen_digest(worker, d)
        {
            return Outcome::Rejected {
                code: ErrorCode::Replayed,
                message: "this gradient was pushed before".into(),
            };
        }
        // `zeno`'s norm ratio is taken against the same reference as the norm bound, so
        // neither a fast worker nor a crowd of fresh ones can set "the usual norm". The
        // reference is computed only when the bound or `zeno` will use it.
        let g = self.cfg.setup.guard;
        // With the driver's anchor the bound holds from the first push (no warm-up to abuse).
        let bound_on =
            g.norm_factor > 0.0 && (self.accepted >= NORM_WARMUP as u64 || self.anchored(now));
        let zeno_on = matches!(
            self.cfg.setup.aggregation,
            crate::robust::Aggregation::Zeno { .. }
        ) && self.accepted >= crate::robust::ZENO_NORM_WARMUP as u64;
        let reference = if bound_on || zeno_on {
            self.reference_norm(now)
        } else {
            None
        };
        let ratio = reference
            .filter(|&m| zeno_on && m > 0.0)
            .map(|m| f64::from(norm) / f64::from(m));
        let mut clipped = false;
        if let Err(message) = self.norm_check(norm, reference, now) {
            // A trusted worker's rare outlier is scaled down to the bound (guard.rs docs).
            match reference.filter(|_| self.clip_allowed(worker, now)) {
                Some(r) => {
                    let scale = g.norm_factor * r / norm;
                    self.scratch.iter_mut().for_each(|v| *v *= scale);
                    clipped = true;
                }
                None => {
                    self.note_refused(worker, norm, now);
                    return Outcome::Rejected {
                        code: ErrorCode::OutOfBounds,
                        message,
                    };
                }
            }
        }
        self.last_push_clipped = clipped;
        let scale = if self.cfg.setup.pseudo_gradients {
            // lr / K, K the workers pushing now, this one included, and at the start those
            // on their first round (super::active): workers that are connected but do not
            // push do not dilute the others' rounds.
            let window = super::active::window(self.pace_s());
            1.0 / self.active.divisor(worker, now, window, norm > 0.0) as f32
        } else {
            1.0
        };
        let outcome = self.core.push_judged(
            worker,
            base_version,
            &self.scratch,
            scale,
            ratio,
            u64::from(samples),
        );
        self.record(&outcome);
        if matches!(outcome, Outcome::Applied { .. } | Outcome::Buffered { .. }) {
            if norm > 0.0 {
                // Only accepted, nonzero norms have a say (and count for the warm-up); a
                // scaled outlier's does not.
                self.accepted += 1;
                if !clipped {
                    self.note_accepted(worker, norm, now);
                }
                if !screened {
                    self.note_digest(worker, d);
                }
            }
            self.last_digest = d;
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

    /// Whether `worker`'s pull for `min_version` may be answered now; if not, the time by which
    /// to check again (besides any [`ShardState::epoch`] change).
    pub(super) fn gate(&mut self, worker: u64, min_version: u64, now: f64, since: f64) -> Gate {
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
    pub(super) fn read_view(&self, worker: u64, now: f64) -> (Option<u64>, Option<u64>) {
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
    /// The encoding the push came in.
    pub push_encoding: Encoding,
    /// An upper bound on how far the encoding moved this slice from the gradient the worker
    /// computed (`‖pushed − computed‖₂`): with error feedback, the rounding of this push and
    /// the residual carried in from the previous push on this connection
    /// ([`Payload::error_bound`](wire::Payload::error_bound) of both; the worker resets its
    /// residual when a connection ends). 0 for f32.
    pub error_bound: f64,
    /// The decoded gradient slice.
    pub grad: Vec<f32>,
    /// The push's request id (a held push is applied with it, [`ShardState::apply_held`]).
    pub request_id: u32,
    /// Held, not applied: the push of a worker on probation waits for its check's verdict
    /// ([`Sampling::Hold`]), and the checker applies it if it passes.
    pub held: bool,
    /// The version the push produced when it was applied (a `sync:K` push: the version its
    /// round will produce); `None` when held. A pass marks it verified: a rollback past its
    /// worker's pushes need not undo it.
    pub produced: Option<u64>,
}

/// Held pushes a shard remembers as screened and not yet applied ([`ShardState::screen_held`]):
/// far more than the checker's queue holds at once (a push that waits longer is applied never).
pub const MAX_HELD: usize = 4096;

/// The answer to [`ShardAccess::sample`], before a tagged push is applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sampling {
    /// Not checked: it is applied as any push.
    No,
    /// Checked: the driver holds a place for the check; the push is applied, then handed
    /// over ([`ShardAccess::take_sample`]).
    Yes,
    /// Checked before it is applied (a worker on probation, issue 21): the push is
    /// acknowledged, not applied, and handed over as held ([`SampledPush::held`]); the checker
    /// applies it with [`ShardState::apply_held`] if it passes, and drops it if it fails.
    Hold,
    /// Drawn for a check the driver cannot take now (its queue is full): the push is
    /// refused `busy` and not applied; the text says why.
    Busy(String),
}

pub(super) enum Gate {
    Open,
    Wait(f64),
}

/// How a session reaches the state of its shard. Drivers decide how it is stored and locked.
pub trait ShardAccess {
    /// The last published values and their version. Must not wait for an update in progress
    /// (the server serves it from an `ArcSwap`): this is what keeps async pulls lock-free.
    fn snapshot(&self) -> (u64, Arc<Vec<f32>>);
    /// The samples the shard had applied at [`ShardAccess::snapshot`]'s version
    /// ([`ShardCore::samples`](crate::shard::ShardCore::samples)).
    fn snapshot_samples(&self) -> u64;
    /// The last published values as the body of a `Params` frame in `encoding`. A driver that
    /// serves many connections keeps one per version and encoding and hands every pull the
    /// same bytes (the server does: `Snapshot` in server/src/shard/mod.rs); this default
    /// encodes [`ShardAccess::snapshot`] at every call. Must not wait for an update in
    /// progress, like [`ShardAccess::snapshot`].
    fn params_body(&mut self, encoding: crate::codec::Encoding) -> wire::ParamsBody {
        let (version, values) = self.snapshot();
        wire::ParamsBody::encode_or_f32(encoding, version, self.snapshot_samples(), &values)
    }
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
    /// Before a tagged push is applied: whether the spot checker can check it, that is,
    /// still holds the parameters of every version its tag names (default: yes). A push it
    /// cannot check is refused `too_stale`, never applied unchecked, so an old tag is no way
    /// around the checks; the driver may keep what it needs for the check (the versions'
    /// parameters) until [`ShardAccess::take_sample`].
    ///
    /// # Errors
    /// Why the push cannot be checked (sent in the `too_stale` error).
    fn check_tag(&mut self, _worker: u64, _tag: &wire::PushTag) -> Result<(), String> {
        Ok(())
    }
    /// Whether this tagged push is spot-checked (default: no), asked before it is applied.
    /// Decided from its worker, request id and content digest (of the payload's bytes) as
    /// well as its tag, so a driver can key the choice on a secret nobody else knows. A push
    /// drawn for a check that the driver cannot take now is refused `busy` and not applied
    /// ([`Sampling::Busy`]): checked or refused, never applied unchecked.
    fn sample(
        &mut self,
        _worker: u64,
        _request_id: u32,
        _digest: u64,
        _tag: &wire::PushTag,
    ) -> Sampling {
        Sampling::No
    }
    /// After a push [`ShardAccess::sample`] answered [`Sampling::Yes`] for: the copy to
    /// check when it was applied (or buffered), `None` when the shard refused it (the driver
    /// gives back what it held for the check).
    fn take_sample(&mut self, _push: Option<SampledPush>) {}
    /// The shard's consistency mode now ([`ShardState::consistency`]; an operator may switch
    /// it while sessions run). Drivers whose [`ShardAccess::with`] takes a lock should answer
    /// without it: async pulls ask on every pull.
    fn mode(&mut self) -> Consistency {
        self.with(|s| ShardState::consistency(s))
    }
    /// The shard's pace now, seconds ([`ShardState::pace_s`]). Drivers whose
    /// [`ShardAccess::with`] takes a lock should answer without it: paced pulls ask on every
    /// pull.
    fn pace(&mut self) -> f64 {
        self.with(|s| s.pace_s())
    }
}

impl ShardAccess for ShardState {
    fn snapshot(&self) -> (u64, Arc<Vec<f32>>) {
        (self.version(), self.values().clone())
    }
    fn snapshot_samples(&self) -> u64 {
        self.core.samples()
    }
    fn with<R>(&mut self, f: impl FnOnce(&mut ShardState) -> R) -> R {
        f(self)
    }
    fn admit(&self, _worker: u64, _credential: Option<&str>) -> Admission {
        Admission::Admitted
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::testing::{hello, pull, sent, state};
    use crate::session::{Action, Record, ShardSession};

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
            let g = [0.1 * rid as f32];
            a.handle_frame(&mut sh, &wire::encode_push(rid, 1, v, 8, &g), 0.4);
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
}
