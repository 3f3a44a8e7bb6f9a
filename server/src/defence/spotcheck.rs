//! Spot-checked gradients (issue 10): the server holds the data, every worker's partition and
//! batch seed, and the parameters of recent versions, so it can recompute a sampled fraction of
//! the pushes itself and compare them with what the worker sent.
//!
//! # When: on by default where the server holds the data (issue 21)
//! `serve --spot-check auto` (the default) is [`DEFAULT_FRACTION`] (0.02) when this process
//! holds the shards and the data, and 0 with `--shard-urls` (the coordinator does not see
//! those pushes, and a spot check needs the data and the versions where the push lands).
//! `--spot-check 0` turns checks off (for lessons and comparisons), any fraction sets it.
//! A default server used to run no checks: 40 sybils pushing sign-flipped gradients under the
//! norm bound took the accuracy of a 98% run to 47% / 93% / 9% (×0.5 / ×2 / ×9). The history
//! is scaled to the model (`--spot-check-history auto`,
//! [`auto_history`](crate::config::defence::auto_history)): what fits in 64 MiB, 8 to 64
//! versions (64 of the MLP: 26 MB; 20 of the default gpt: 66 MB).
//!
//! # How
//! - With `--spot-check F > 0` every shard's Welcome says `spot_checks`, and every push must
//!   carry a [`PushTag`]: the index of the round's first batch in the worker's batch sequence
//!   and the shard versions its parameters were read at (docs/protocol.md, "Spot checks"). A
//!   push without one is refused (`protocol`, fatal).
//! - Sampling (issue 21) is decided after the push arrived, by an HMAC-SHA256 under a secret
//!   only this server holds (32 bytes from the OS, drawn at start, never sent nor derived
//!   from the run seed) of the push's worker, request id, gradient digest and tag, below `F`
//!   ([`SpotChecker::sample`]). It was a hash of (run seed, worker, batch): the run seed is in
//!   every join reply and the batch is the worker's choice, so a poisoner knew which rounds
//!   were unsampled and poisoned only those (60/60 accepted, accuracy 0.948 → 0.101). Now
//!   every push is an independent coin nobody can predict, the same round re-tagged included.
//!   A recomputed round is cached ([`Checker`] keeps the last few), so a round sampled on
//!   several shards is still recomputed once.
//! - Probation: a worker that has passed fewer than [`PROBATION_CHECKS`] spot checks is
//!   sampled at [`PROBATION_RATE`] (every push), holds at most [`PROBATION_PER_SHARD`] (one)
//!   place in the checker's queue per shard, and keeps it until its check's verdict: a
//!   round's slices are judged side by side, and its next round waits until the last was
//!   judged ("Pacing" below).
//! - **Its pushes are held until they pass** ([`Sampling::Hold`]): screened as any push
//!   (request id, values, replayed bytes; its digest taken at once, so a replay of it while
//!   it waits is refused), acknowledged at the shard's version, handed to the checker, and
//!   applied by the checker only if the check passes (`ShardControl::apply_held`, then booked
//!   in the registry and ledger as the driver books any push: norm bound, staleness and
//!   `lr / K` as of then). A failed check drops it. So no push of a fresh identity moves the
//!   model before it was recomputed and found honest. The rule before (apply, then check)
//!   let each new identity get one push in unjudged: at `serve`'s default `--local-steps
//!   auto` that push is a round of up to thousands of inner steps, and 40 sybils, one round
//!   each, took a 98% run to 37–97.6% (sign flips ×0.5/×2/×9) and huge pushes got 8–18 rounds
//!   in before the norm bound had a reference (docs/benchmarks.md, "Attacks at serve's real
//!   defaults"). The cost is the newcomer's: its first rounds land a check later (staler),
//!   2 rounds of a 2-shard model, once. `--no-spot-check-hold` restores the old rule, for
//!   lessons and comparisons. Counted: `held`, `held_applied`, `held_dropped`.
//! - Before a tagged push is applied, the handler takes the parameters its tag names from the
//!   shards' histories ([`SpotChecker::record`] keeps the last `--spot-check-history` versions
//!   of every shard; [`SpotChecker::capture`]). A push whose tag names a version no longer kept
//!   (or never published) is refused `too_stale` and not applied: it could not be checked, and
//!   a push that cannot be checked must not get through (a push tagged 200 versions back used
//!   to be applied and its check counted as skipped). Honest workers meet this only when their
//!   staleness exceeds the history (docs/protocol.md, "Spot checks").
//! - Whether a push is checked is decided before it is applied ([`SpotChecker::sample`], on
//!   a digest of its payload bytes): a push drawn holds a place in the bounded queue to the
//!   one checker thread ([`QUEUE`], at most [`QUEUE_PER_WORKER`] per worker) and is applied,
//!   then queued with the parameters captured; a push drawn with no place is refused `busy`
//!   and not applied (`refused_busy`). Checked or refused, never applied unchecked: a full
//!   queue used to drop the check of a push already applied, so a poisoner that kept the
//!   checker busy got its poison in unchecked. `busy` never counts toward quarantine.
//!
//! # Pacing: the checker's queue is waited for, not refused (issue 21)
//! Refusing a drawn push `busy` whenever the queue was full cost honest workers 6–12% of
//! their pushes at `--spot-check 0.5` (88–96% acceptance, the clean run included): one
//! checker thread recomputing half the pushes of 4 workers on the same 2 cores cannot keep
//! up, and any bounded queue overflows at a steady rate above its drain. Now the connection's
//! driver (`crate::shard::handler`) takes a place for a push *before* feeding it to the
//! session, waiting for one ([`SpotChecker::wait_place`], woken when a place is given back,
//! at most [`PLACE_WAIT`]) while the socket is not read; [`SpotChecker::sample`] keeps the
//! place if the push is drawn and gives it back at once if not. So a push is refused `busy`
//! only when no place came free within [`PLACE_WAIT`], and the workers are paced at the
//! checker's rate instead: backpressure, as everywhere else in the server. That is the cost
//! and it is real: at 0.5 on the 2-core bench machine (4 worker processes, the server and
//! the checker on the same cores, other builds running: load average 11–21) 4 honest workers
//! got 25,959 pushes in through a clean 20 s run against 33,468 with checks off and 32,052 at
//! the default 0.02 (docs/benchmarks.md, "Attacks"): about a fifth fewer at 0.5, within the
//! noise at 0.02. On a real deployment the volunteers' compute is elsewhere and the server's
//! cores are the checker's. More checker threads were not added: on this machine they would
//! take the same cores from the workers, and at the default rate one thread is far from full.
//! - Fairness: workers on probation hold at most [`PROBATION_QUEUE`] (half) of the places
//!   together and one each, so a crowd of fresh identities waits among itself and the other
//!   half stays free for vouched workers; one worker holds at most [`QUEUE_PER_WORKER`].
//!   A sybil crowd's cost to honest workers is its share of the checker's time, bounded by
//!   how fast it is quarantined.
//!
//! The reactor threads never compute.
//! - The checker draws the worker's batches again ([`BatchSampler::skip`] to the tag's batch),
//!   recomputes the gradient, or with local steps the whole round of `H = samples / batch`
//!   inner steps from the pulled parameters with a fresh inner optimizer state (a worker
//!   whose shards spot-check starts every round's inner optimizer afresh) at the inner
//!   learning-rate schedule's factor for the tag's versions (`crowdgrad_core::schedule`:
//!   a function of the run spec and the versions alone; under `auto` local steps, of the
//!   samples this checker recorded for those versions and the push's own), and compares the
//!   shard's slice with the pushed one: cosine similarity at least `--spot-check-cosine` and
//!   the norm ratio within `1 ± --spot-check-norm-tol`. Compressed pushes (bf16, int8 blocks
//!   with error feedback) are compared as what they are ([`within_tolerance`], issue 21): the
//!   session bounds how far the encoding moved the slice (this push's rounding plus the
//!   residual carried in from the last one, `SampledPush::error_bound`, from the block scales),
//!   and the distance to the recomputed slice may exceed the f32 tolerance by that bound. With
//!   fixed thresholds, honest int8 pushes (cosine 0.969–0.985) were quarantined.
//! - **Sensitivity** (issue 21): a round of local steps (H > 1) outside those tolerances is
//!   recomputed [`NUDGES`] more times, from the pulled parameters moved by one unit in the
//!   last place (a pattern of ups and downs per nudge), and passes if its distance to the
//!   first recomputation is at most [`SENSITIVITY_FACTOR`] times the farthest nudged one
//!   (plus the encoding's bound), with a cosine of at least [`SENSITIVITY_COSINE`] and a
//!   norm ratio within `1 ±` [`SENSITIVITY_NORM`] whatever the spread. Why: a fresh Adam
//!   round's first steps move each coordinate by about `lr × sign(g)`, so where a gradient
//!   coordinate cancels to near 0, a last-bit difference in the arithmetic (wasm's GEMM and
//!   `exp` against native's) flips a sign and the round drifts away from the recomputation;
//!   a few rounds in hundreds did, down to cosine 0.47, and every honest browser tab was
//!   quarantined at `--local-steps auto` (native workers recompute bit-exactly and never
//!   were). Such a round is as sensitive to a last-bit nudge of its start, so its own
//!   spread says how far honest rounding can take it. The floors keep a sign flip, a
//!   scaled round or one pointing away out however chaotic the round; what a poisoner can
//!   hide in a sensitive round is bounded by them and by the spread (a garbage round of the
//!   honest norm, in a round that chaotic). It costs [`NUDGES`]
//!   more recomputations, only for rounds that failed the fixed tolerances (counted:
//!   `sensitive`, `sensitive_passed`).
//! - A failure quarantines the worker ([`crate::defence::reputation`]).
//!
//! # Trust: vouching
//! A worker that passed [`PROBATION_CHECKS`] spot checks (a failure quarantines, so it failed
//! none) is vouched for on every shard of this process (`ShardState::vouch`, through
//! [`ShardControl`]): it has a say in the norm reference from its next accepted push instead
//! of after 16 pushes over 10 s. Why the fourth pass, not the first: one pass costs an
//! attacker one honest round, and a sybil crowd vouched for that cheaply would carry the
//! reference; four passes at the probation rate (every push a coin at least 1/2) cost at
//! least four honest rounds with no poisoned one in between, and the same moment ends the
//! checker's own probation, so "on probation" means one thing. The vouching is repeated after
//! each later pass (cheap: checks are rare), so a worker a shard's probation table forgot is
//! vouched for again.
//!
//! # Rollback: detected poison is undone
//! The checker logs which versions every worker's applied pushes produced on every shard
//! ([`SpotChecker::applied`], at most `history` × [`APPLIED_PER_VERSION`] per shard). When a
//! failed check quarantines a worker (and `--no-spot-check-rollback` is not given), every
//! shard where the worker's first push in the log produced version `f` and the history
//! still holds version `f − 1` is rolled back: those parameters are published as the next
//! version (versions stay monotonic for the workers, the SSP clock and the replay log), with
//! the optimizer state kept (a fresh one would cost more: Adagrad's first step from an empty
//! accumulator is `lr` in every coordinate; measured), the pending
//! `sync:K` round dropped, and the poisoner's norms out of the reference. Where `f − 1` is no
//! longer held, the target is the version before its first later push whose predecessor is
//! held, and the older pushes stay (`poisoned_kept`; measured: a patient round poisoner under
//! load, whose unsampled honest rounds reached past the history, left one shard to heal and
//! the run at 11.2%). Where no push of its has a held predecessor, the shard is left to heal
//! by training on (`healed`).
//!
//! Pushes of the poisoner's that a passed check verified are skipped when the target is
//! chosen (`verified`, bounded as the log): a patient poisoner's honest probation pushes
//! (held, checked, then applied) and its later checked-and-passed ones are not poison, and a
//! target before them would reach further back than the history holds (measured: a patient
//! round poisoner at auto, rolled back on one shard and left to heal on the other, ended at
//! 9.68%). Unchecked pushes between its passes are undone: a pass says nothing of them.
//!
//! The rule is "roll back whenever the history holds the version before the poison", so the
//! history bounds the cost: at most `--spot-check-history` versions are undone, the honest
//! ones among them included (their workers' next pushes are a few versions staler, nothing
//! else). Healing costs more: sub-bound poison moves the model by up to the norm bound per
//! push, and honest gradients then need at least as many updates to undo each poisoned one,
//! at a time when their own pushes may be refused against a reference that has not followed
//! the model yet; measured in docs/benchmarks.md ("Defences: spot checks"). Pushes the
//! poisoner made before the log's oldest entry are not undone (a poisoner passing checks
//! for `history` × [`APPLIED_PER_VERSION`] versions before its first poisoned push is
//! caught, and rolled back, from its first logged push on). Counted: `rollbacks`,
//! `versions_undone`, `poisoned_undone`, `poisoned_kept`, `healed`.
//!
//! Rollbacks never restore what an earlier rollback undid: every rollback's range
//! `(target, before]` is kept ([`UNDONE_KEPT`] a shard), and a later target inside one is
//! moved down to that range's target (repeatedly). Without it, two poisoners whose first
//! pushes made versions 10 and 11 were rolled back one after the other to version 9 and then
//! to version 10, the parameters **with** the first poisoner's push: its poison came back.
//! With gradient pushes (H = 1) that is one poisoned gradient; under `--local-steps auto` it
//! is a poisoned round of up to thousands of inner steps (found with `crowdgrad bench attack
//! --local-steps auto`, where 40 sybils with one round pushed each are judged one after the
//! other; docs/benchmarks.md "Attacks at serve's real defaults"). Pushes read from undone
//! versions are still applied (as slightly staler pushes); refusing them was measured there
//! and cost more honest rounds than it saved.
//!
//! # Bounds
//! Memory: the histories hold at most `history` versions of every shard (the same versions
//! serve checks and rollbacks), that is
//! `history × parameters × 4` bytes (64 versions of the 101,770-parameter `mlp:128` are
//! 26 MB); the queue's [`QUEUE`] pushes hold a shard slice each and `Arc`s of the versions
//! they read, which outlive the history at worst by `QUEUE × parameters × 4` bytes more; and
//! [`CACHE`] recomputed rounds of `parameters × 4` bytes. CPU: one thread; a check of a round
//! of H steps costs H gradient computations. At the default 0.02 a 2-shard round is
//! recomputed for about 4% of rounds, plus each new identity's first rounds.
//!
//! Remote shards (`--shard-urls`) are not spot-checked: the coordinator does not see their
//! pushes (the flag is refused with them).

use crate::defence::reputation::{CheckFigures, CheckResult, Reputation};
use crate::defence::tolerance::distance;
pub use crate::defence::tolerance::{
    compare, sensitivity_verdict, within_tolerance, NUDGES, SENSITIVITY_COSINE, SENSITIVITY_FACTOR,
    SENSITIVITY_NORM,
};
use crate::error::{Error, Result};
use crate::registry::Registry;
use crowdgrad_core::codec::Encoding;
use crowdgrad_core::data::{BatchSampler, Dataset};
use crowdgrad_core::model::Model;
use crowdgrad_core::optim::{self, clip_by_global_norm, OptState};
use crowdgrad_core::session::{SampledPush, Sampling};
use crowdgrad_core::shard::Outcome;
use crowdgrad_core::spec::RunSpec;
use crowdgrad_core::wire::PushTag;
use ndarray::Array2;
use serde::Serialize;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};

/// Sampled pushes waiting for the checker; past this a push drawn for a check is refused
/// `busy` and not applied (counted).
pub const QUEUE: usize = 64;
/// Checks one worker may have waiting at once; past this its pushes wait for a place
/// ([`PLACE_WAIT`]): one worker's flood holds up its own pushes, not the others'.
pub const QUEUE_PER_WORKER: usize = 16;
/// Places of the queue that workers on probation may hold together: the rest is kept for
/// vouched workers, so a crowd of fresh identities (40 sybils each checked at
/// [`PROBATION_RATE`]) cannot hold up the pushes of workers that passed their probation.
pub const PROBATION_QUEUE: usize = QUEUE / 2;
/// Places one worker on probation may hold at once, per shard of this process: one a shard,
/// kept until its check's verdict, so a new identity's round is judged on every shard side
/// by side and its next round waits until the last was judged (module docs, "Probation").
/// It was one in all: a round's slice to the second shard then waited for the first one's
/// recomputation (a round of up to 4,096 steps), past [`PLACE_WAIT`], and was refused
/// `busy`: the honest `busy` refusals of `--spot-check 0.5` at `--local-steps auto`.
pub const PROBATION_PER_SHARD: usize = 1;
/// How long a push waits for a place in the checker's queue before it is refused `busy`
/// (module docs, "Pacing"). Under a worker's reply timeout (`work --reply-timeout`, 30 s) and
/// the shard's idle timeout (60 s): the connection is not read meanwhile, so its frames behind
/// the push (a pull) wait too. It was 2 s: at `--spot-check 0.5` and `--local-steps auto` one
/// check recomputes a round of up to 4,096 steps, 1–3 s on the shared 2-core machine, and a
/// push waiting behind one or two of them was refused `busy` (1–3 honest pushes in 200 a run,
/// under the 99% the attack suite asks for); a wait that long is backpressure, not abuse.
pub const PLACE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);
/// Pushes applied per shard whose (version, worker) the checker remembers for a rollback, per
/// version kept (`--spot-check-history` × this): a `sync:K` version merges several.
pub const APPLIED_PER_VERSION: usize = 4;
/// Recomputed rounds the checker keeps (a round is compared once per shard).
pub const CACHE: usize = 8;
/// Partitions the checker keeps a copy of (the first workers' are large: a crowd's first
/// worker trains on the whole set, `crate::registry::partition`).
pub const DATASETS: usize = 8;
/// Figures of the most recent checks kept for the status.
pub const RECENT: usize = 512;
pub use crate::config::defence::{
    SpotArgs, SpotConfig, DEFAULT_COSINE, DEFAULT_FRACTION, DEFAULT_NORM_TOL,
};
/// Spot checks a worker must pass before it is sampled at the run's rate only.
pub const PROBATION_CHECKS: u64 = 4;
/// The least sampling rate of a worker on probation: every push of a new identity is
/// checked (issue 21: at 0.5, 40 sybils each got pushes in between their checks).
pub const PROBATION_RATE: f64 = 1.0;

#[derive(Debug, Default)]
struct Counters {
    sampled: AtomicU64,
    passed: AtomicU64,
    failed: AtomicU64,
    skipped_version: AtomicU64,
    refused_version: AtomicU64,
    skipped_unknown: AtomicU64,
    dropped_queue: AtomicU64,
    refused_busy: AtomicU64,
    dropped_quarantined: AtomicU64,
    vouched: AtomicU64,
    rollbacks: AtomicU64,
    versions_undone: AtomicU64,
    poisoned_undone: AtomicU64,
    poisoned_kept: AtomicU64,
    healed: AtomicU64,
    held: AtomicU64,
    held_applied: AtomicU64,
    held_dropped: AtomicU64,
    sensitive: AtomicU64,
    sensitive_passed: AtomicU64,
}

/// Places in the checker's queue: taken before a push is fed to its session (the driver
/// waits for one, [`SpotChecker::wait_place`]), kept if the push is drawn for a check, given
/// back at once if it is not, when the checker takes the job, or when the shard refuses it.
#[derive(Debug)]
struct Slots {
    /// Places one worker on probation may hold: [`PROBATION_PER_SHARD`] × the shards.
    per_probation: usize,
    total: usize,
    /// Places held by workers on probation (taken while on probation).
    probation: usize,
    /// Per worker: places held, of which taken on probation.
    by_worker: HashMap<u64, (usize, usize)>,
}

impl Slots {
    /// The queue of a process holding `shards` shards, every place free.
    fn new(shards: usize) -> Self {
        Self {
            per_probation: PROBATION_PER_SHARD * shards.max(1),
            total: 0,
            probation: 0,
            by_worker: HashMap::new(),
        }
    }

    /// Takes a place for `worker`: false when the queue ([`QUEUE`]) or the worker's share of
    /// it ([`QUEUE_PER_WORKER`]) is full, or, for a worker `on_probation`, the probation part
    /// ([`PROBATION_QUEUE`]) or its share of it ([`PROBATION_PER_SHARD`] a shard).
    fn take(&mut self, worker: u64, on_probation: bool) -> bool {
        let (mine, _) = self.by_worker.get(&worker).copied().unwrap_or((0, 0));
        if self.total >= QUEUE || mine >= QUEUE_PER_WORKER {
            return false;
        }
        if on_probation && (self.probation >= PROBATION_QUEUE || mine >= self.per_probation) {
            return false;
        }
        self.total += 1;
        let e = self.by_worker.entry(worker).or_default();
        e.0 += 1;
        if on_probation {
            self.probation += 1;
            e.1 += 1;
        }
        true
    }

    /// Gives a place of `worker`'s back (one taken on probation first).
    fn give(&mut self, worker: u64) {
        if let Some((n, p)) = self.by_worker.get_mut(&worker) {
            self.total = self.total.saturating_sub(1);
            *n -= 1;
            if *p > 0 {
                *p -= 1;
                self.probation = self.probation.saturating_sub(1);
            }
            if *n == 0 {
                self.by_worker.remove(&worker);
            }
        }
    }
}

/// What the checker does to the shards of this process: vouch for a worker that passed its
/// probation, roll a shard back past a poisoner's pushes. `crate::shard` implements it (the
/// defences sit below the shards in the layout, `crate` docs, so they see shards only as
/// this); the coordinator hands them over once with [`SpotChecker::attach`].
pub trait ShardControl: Send + Sync {
    /// `ShardState::vouch`: `worker` has a say in this shard's norm reference from its next
    /// accepted push.
    fn vouch(&self, worker: u64);
    /// Applies a held push whose check passed (`ShardState::apply_held`): its outcome and
    /// whether it was nonzero; `None` when the shard is gone.
    fn apply_held(&self, push: &SampledPush) -> Option<(Outcome, bool)>;
    /// Publishes `values`, the parameters of version `target`, as this shard's next version
    /// (optimizer state kept, the pending sync round dropped) and forgets `poisoner`'s norms.
    /// Returns the version before and the one published; `None` when the shard is gone, the
    /// values do not fit, or it is still at `target` (nothing was applied since: a `sync:K`
    /// push of the poisoner's still pending is dropped by its expulsion).
    fn roll_back(&self, values: Vec<f32>, target: u64, poisoner: u64) -> Option<(u64, u64)>;
}

/// One check's figures, for the status.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Figure {
    /// The worker.
    pub worker: u64,
    /// The shard.
    pub shard: u32,
    /// Inner steps of the round.
    pub steps: u32,
    /// Cosine similarity.
    pub cosine: f64,
    /// Pushed norm / recomputed norm.
    pub norm_ratio: f64,
    /// Within the tolerances.
    pub passed: bool,
}

struct Shared {
    cfg: SpotConfig,
    counters: Counters,
    recent: Mutex<VecDeque<Figure>>,
    reputation: Arc<Reputation>,
    /// Every shard's recent versions.
    histories: Vec<Mutex<History>>,
    /// Every shard's recent applied pushes: (the version it produced, its worker), oldest
    /// first, at most `history` × [`APPLIED_PER_VERSION`].
    applied: Vec<Mutex<VecDeque<(u64, u64)>>>,
    /// Every shard's recent pushes verified by a passed check, (version produced, worker),
    /// bounded as `applied`: a rollback does not reach back past its worker's verified
    /// pushes (module docs, "Rollback").
    verified: Vec<Mutex<VecDeque<(u64, u64)>>>,
    slots: Mutex<Slots>,
    /// Woken when a place in the queue is given back ([`SpotChecker::wait_place`]).
    freed: tokio::sync::Notify,
    /// Versions kept per shard (`--spot-check-history`, resolved).
    history: usize,
    /// Every shard's recent rollbacks, `(target, before)`: the versions `(target, before]`
    /// were undone (module docs, "Rollback"), at most [`UNDONE_KEPT`], oldest first.
    undone: Vec<Mutex<VecDeque<(u64, u64)>>>,
    /// The shards, once attached (vouching and rollback need them).
    controls: std::sync::OnceLock<Vec<Box<dyn ShardControl>>>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("cfg", &self.cfg).finish()
    }
}

/// Rollbacks remembered per shard (module docs, "Rollback"): more than the history could
/// reach back over in the worst case (one rollback per version).
const UNDONE_KEPT: usize = 256;

/// The version to roll back to for a poisoner whose first logged push produced `first`:
/// `first − 1`, moved down to the target of any earlier rollback whose undone range
/// `(target, before]` holds it, repeatedly (the parameters of an undone version carry the
/// pushes that rollback undid).
fn below_undone(undone: &VecDeque<(u64, u64)>, first: u64) -> u64 {
    let mut target = first.saturating_sub(1);
    // Each step moves the target strictly down, so at most one step per range.
    for _ in 0..=undone.len() {
        match undone.iter().find(|&&(t, b)| target > t && target <= b) {
            Some(&(t, _)) => target = t,
            None => break,
        }
    }
    target
}

impl Shared {
    /// [`SpotChecker::applied`].
    fn log_applied(&self, shard: u32, version: u64, worker: u64) {
        Self::log(&self.applied, self.history, shard, version, worker);
    }

    /// `worker`'s push that produced `version` on `shard` passed its check.
    fn log_verified(&self, shard: u32, version: u64, worker: u64) {
        Self::log(&self.verified, self.history, shard, version, worker);
    }

    fn log(
        logs: &[Mutex<VecDeque<(u64, u64)>>],
        history: usize,
        shard: u32,
        version: u64,
        worker: u64,
    ) {
        let Some(a) = logs.get(shard as usize) else {
            return;
        };
        let mut a = a.lock().unwrap_or_else(|p| p.into_inner());
        a.push_back((version, worker));
        while a.len() > history.saturating_mul(APPLIED_PER_VERSION) {
            a.pop_front();
        }
    }

    /// `worker` passed its probation ([`PROBATION_CHECKS`] checks, none failed: a failure
    /// quarantines): it has a say in every shard's norm reference without serving the
    /// shards' own probation (module docs, "Trust"). Again after every later pass, so a
    /// worker a shard's probation table forgot is vouched for again.
    fn vouch(&self, worker: u64) {
        let Some(shards) = self.controls.get() else {
            return;
        };
        for s in shards {
            s.vouch(worker);
        }
        self.counters.vouched.fetch_add(1, Ordering::Relaxed);
    }

    /// `poisoner` was quarantined for a failed check: every shard where one of its applied
    /// pushes still in the log produced a version whose predecessor the history holds is
    /// rolled back to the first such predecessor (or below the earlier rollbacks whose undone range holds it,
    /// [`below_undone`]), published as a new version (module docs, "Rollback"); the others are
    /// left to heal. Pushes of its that an earlier rollback undid do not set the target.
    fn roll_back(&self, poisoner: u64) {
        let Some(shards) = self.controls.get() else {
            return;
        };
        let c = &self.counters;
        for (i, control) in shards.iter().enumerate() {
            let mine: Vec<u64> = {
                let Some(a) = self.applied.get(i) else {
                    continue;
                };
                // Its pushes a passed check verified are not poison: the rollback need not
                // reach back past them (a patient poisoner's probation, say).
                let verified: Vec<u64> = self.verified.get(i).map_or_else(Vec::new, |v| {
                    v.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .iter()
                        .filter(|(_, w)| *w == poisoner)
                        .map(|(v, _)| *v)
                        .collect()
                });
                let a = a.lock().unwrap_or_else(|p| p.into_inner());
                let mut versions: Vec<u64> = a
                    .iter()
                    .filter(|(v, w)| *w == poisoner && !verified.contains(v))
                    .map(|(v, _)| *v)
                    .collect();
                versions.dedup();
                versions
            };
            // Its pushes an earlier rollback already undid are gone: the first one still in
            // the parameters counts (none: nothing recent of its to undo here), and the
            // target goes below every undone range.
            // The target is the version before its first live push whose predecessor the
            // history still holds: where its oldest unchecked pushes are older than the
            // history (a patient poisoner's unsampled honest rounds, say), the newer ones are
            // still undone, and only the older ones are left to heal.
            let live: Vec<u64> = {
                let Some(u) = self.undone.get(i) else {
                    continue;
                };
                let u = u.lock().unwrap_or_else(|p| p.into_inner());
                mine.iter()
                    .copied()
                    .filter(|&v| !u.iter().any(|&(t, b)| v > t && v <= b))
                    .map(|v| below_undone(&u, v))
                    .collect()
            };
            let Some(&oldest) = live.first() else {
                continue;
            };
            let held = self.histories.get(i).and_then(|h| {
                let h = h.lock().unwrap_or_else(|p| p.into_inner());
                live.iter().enumerate().find_map(|(k, &target)| {
                    h.iter()
                        .find(|(v, _, _)| *v == target)
                        .map(|(_, p, _)| (k, target, p.clone()))
                })
            });
            let Some((kept, target, values)) = held else {
                c.healed.fetch_add(1, Ordering::Relaxed);
                c.poisoned_kept
                    .fetch_add(live.len() as u64, Ordering::Relaxed);
                tracing::warn!(
                    worker = poisoner,
                    shard = i,
                    version = oldest,
                    "no rollback: the version before every push of the poisoner's is no longer held"
                );
                continue;
            };
            if kept > 0 {
                c.poisoned_kept.fetch_add(kept as u64, Ordering::Relaxed);
                tracing::warn!(
                    worker = poisoner,
                    shard = i,
                    kept,
                    "a partial rollback: the poisoner's oldest unchecked pushes are older than the history"
                );
            }
            let Some((before, published)) = control.roll_back(values.to_vec(), target, poisoner)
            else {
                continue;
            };
            if let Some(u) = self.undone.get(i) {
                let mut u = u.lock().unwrap_or_else(|p| p.into_inner());
                if u.len() >= UNDONE_KEPT {
                    u.pop_front();
                }
                u.push_back((target, before));
            }
            let undone = before.saturating_sub(target);
            let poisoned = mine.iter().filter(|&&v| v > target && v <= before).count() as u64;
            c.rollbacks.fetch_add(1, Ordering::Relaxed);
            c.versions_undone.fetch_add(undone, Ordering::Relaxed);
            c.poisoned_undone.fetch_add(poisoned, Ordering::Relaxed);
            tracing::warn!(
                worker = poisoner,
                shard = i,
                restored = target,
                undone,
                poisoned,
                published,
                "rolled back past a quarantined worker's pushes"
            );
        }
    }

    /// Gives back `worker`'s place in the queue, and wakes the pushes waiting for one.
    fn release(&self, worker: u64) {
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .give(worker);
        self.freed.notify_waiters();
    }

    /// Takes a place for `worker` in its part of the queue.
    fn take(&self, worker: u64) -> bool {
        let on_probation = self.reputation.spot_passed(worker) < PROBATION_CHECKS;
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take(worker, on_probation)
    }
}

/// `/api/status`'s `spot_checks`.
#[derive(Debug, Clone, Serialize)]
pub struct SpotStatus {
    /// Fraction of pushes sampled.
    pub fraction: f64,
    /// Least cosine that passes.
    pub cosine: f64,
    /// Largest relative norm difference that passes.
    pub norm_tol: f64,
    /// Versions kept per shard.
    pub history: usize,
    /// Pushes sampled.
    pub sampled: u64,
    /// Checks passed.
    pub passed: u64,
    /// Checks failed.
    pub failed: u64,
    /// Sampled pushes whose parameters were no longer kept (0 since issue 21: such pushes are
    /// refused before they are applied, [`SpotStatus::refused_version`]).
    pub skipped_version: u64,
    /// Pushes refused `too_stale` because their tag named versions the checker no longer held.
    pub refused_version: u64,
    /// Sampled pushes of workers the registry forgot.
    pub skipped_unknown: u64,
    /// Sampled pushes applied without their check because the queue was full (0 since issue
    /// 21: such pushes are refused `busy` before they are applied, [`SpotStatus::refused_busy`]).
    pub dropped_queue: u64,
    /// Pushes drawn for a check that could not be queued (the queue full, or the worker's
    /// share of it): refused `busy`, not applied.
    pub refused_busy: u64,
    /// Queued checks dropped because their worker was quarantined meanwhile.
    pub dropped_quarantined: u64,
    /// Vouchings: a worker that passed its probation was vouched for on every shard (once
    /// per passed check from then on).
    pub vouched: u64,
    /// Whether a poisoner's pushes are rolled back (`--spot-check-rollback`).
    pub rollback: bool,
    /// Shards rolled back past a quarantined worker's pushes.
    pub rollbacks: u64,
    /// Versions those rollbacks undid (the poisoner's and the honest ones since).
    pub versions_undone: u64,
    /// Of those, the poisoner's own pushes.
    pub poisoned_undone: u64,
    /// The poisoner's unchecked pushes no rollback could undo: older than the history held
    /// (the rollback went back as far as the history allows, or, on a shard left to heal, not
    /// at all).
    pub poisoned_kept: u64,
    /// Shards left to heal: every push of the poisoner's there was older than the history
    /// held.
    pub healed: u64,
    /// Pushes of workers on probation held for their check before being applied (module
    /// docs, "Probation").
    pub held: u64,
    /// Held pushes whose check passed, then applied (or refused by the shard as any push).
    pub held_applied: u64,
    /// Held pushes never applied: their check failed or could not be made, or their worker
    /// was quarantined meanwhile.
    pub held_dropped: u64,
    /// Rounds outside the fixed tolerances judged against their own sensitivity (module
    /// docs, "Sensitivity").
    pub sensitive: u64,
    /// Of those, the ones that passed.
    pub sensitive_passed: u64,
    /// The most recent checks' figures, oldest first.
    pub recent: Vec<Figure>,
}

struct Job {
    push: SampledPush,
    params: Vec<Arc<Vec<f32>>>,
    /// The samples each shard had applied at the tag's versions (a counted schedule's
    /// position, `crowdgrad_core::schedule`).
    counts: Vec<u64>,
}

/// What [`SpotChecker::capture`] took for a push: the parameters of every version its tag
/// names and, per shard, the samples applied at that version.
#[derive(Debug, Clone)]
pub struct Read {
    params: Vec<Arc<Vec<f32>>>,
    counts: Vec<u64>,
}

/// One shard's recent versions, oldest first: version, values, samples applied.
type History = VecDeque<(u64, Arc<Vec<f32>>, u64)>;

/// The spot checker: the shards' recent versions, the sampling rule and the queue to the
/// checker thread. Shared by every shard of the server (`Arc`).
pub struct SpotChecker {
    cfg: SpotConfig,
    /// The sampling secret: never leaves this process (module docs, "Sampling").
    key: [u8; 32],
    tx: SyncSender<Job>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for SpotChecker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpotChecker")
            .field("cfg", &self.cfg)
            .finish()
    }
}

/// The worker's batch seed (as `crowdgrad_core::worker::Worker` draws it).
pub fn batch_seed(run_seed: u64, worker: u64) -> u64 {
    run_seed ^ worker.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl SpotChecker {
    /// Starts the checker thread for a run of `spec` on `train` (in `partitions`), with the
    /// workers' partitions from `registry` and verdicts going to `reputation`. `initial` is
    /// every shard's current version, values and samples applied.
    ///
    /// # Errors
    /// When the model cannot be built or the thread cannot be started.
    pub fn start(
        cfg: SpotConfig,
        spec: &RunSpec,
        train: Arc<Dataset>,
        partitions: usize,
        registry: Registry,
        reputation: Arc<Reputation>,
        initial: Vec<(u64, Arc<Vec<f32>>, u64)>,
    ) -> Result<Arc<Self>> {
        let model = Model::new(spec.model.clone())?;
        let (tx, rx) = sync_channel(QUEUE);
        let shards = initial.len();
        let history = cfg
            .history
            .unwrap_or_else(|| crate::config::defence::auto_history(model.param_len()));
        let shared = Arc::new(Shared {
            cfg,
            counters: Counters::default(),
            recent: Mutex::new(VecDeque::new()),
            reputation,
            histories: initial
                .into_iter()
                .map(|v| Mutex::new(VecDeque::from([v])))
                .collect(),
            applied: (0..shards).map(|_| Mutex::new(VecDeque::new())).collect(),
            verified: (0..shards).map(|_| Mutex::new(VecDeque::new())).collect(),
            undone: (0..shards).map(|_| Mutex::new(VecDeque::new())).collect(),
            slots: Mutex::new(Slots::new(shards)),
            freed: tokio::sync::Notify::new(),
            history,
            controls: std::sync::OnceLock::new(),
        });
        let checker = Checker {
            cfg,
            spec: spec.clone(),
            model,
            train,
            partitions,
            registry,
            shared: shared.clone(),
            datasets: HashMap::new(),
            samplers: HashMap::new(),
            cache: VecDeque::new(),
        };
        std::thread::Builder::new()
            .name("spot-check".into())
            .spawn(move || checker.run(rx))
            .map_err(|e| Error::io("starting the spot-check thread", e))?;
        Ok(Arc::new(Self {
            cfg,
            key: crate::support::credential::run_secret()
                .map_err(|e| Error::io("drawing the spot-check secret", e))?,
            tx,
            shared,
        }))
    }

    /// The settings.
    pub fn config(&self) -> &SpotConfig {
        &self.cfg
    }

    /// Shard `shard` published `values` as `version`, after `samples` (kept for the checks of
    /// pushes read from it). Returns the oldest version's values the history let go, if any,
    /// for the shard to reuse.
    pub fn record(
        &self,
        shard: u32,
        version: u64,
        samples: u64,
        values: Arc<Vec<f32>>,
    ) -> Option<Arc<Vec<f32>>> {
        let h = self.shared.histories.get(shard as usize)?;
        let mut h = h.lock().unwrap_or_else(|p| p.into_inner());
        h.push_back((version, values, samples));
        let mut old = None;
        while h.len() > self.shared.history {
            old = h.pop_front().map(|(_, v, _)| v);
        }
        old
    }

    // --- Sampling, versions (issue 21). The recomputation is below, in `Checker`. ---

    /// Whether this push is checked: an HMAC under the server's secret of its worker,
    /// request id, gradient digest and tag, below the run's fraction (at least
    /// [`PROBATION_RATE`] for a worker on probation). Decided once the push arrived; nothing
    /// public predicts it.
    /// A push drawn holds a place in the checker's queue until [`SpotChecker::submit`] or
    /// [`SpotChecker::cancel`]: the one the driver took for it (`placed`, from
    /// [`SpotChecker::wait_place`]; given back here if the push is not drawn), or else one
    /// taken now. A push drawn with no place for it (the driver's wait timed out, and the
    /// queue or the worker's part of it is still full) is answered [`Sampling::Busy`]: it is
    /// refused, not applied unchecked.
    pub fn sample(
        &self,
        worker: u64,
        request_id: u32,
        digest: u64,
        tag: &PushTag,
        placed: bool,
    ) -> Sampling {
        if !self.draw(worker, request_id, digest, tag) {
            if placed {
                self.shared.release(worker);
            }
            return Sampling::No;
        }
        if !(placed || self.shared.take(worker)) {
            self.shared
                .counters
                .refused_busy
                .fetch_add(1, Ordering::Relaxed);
            return Sampling::Busy(
                "this push was drawn for a spot check and the checker is busy: retry later".into(),
            );
        }
        if self.cfg.hold && self.shared.reputation.spot_passed(worker) < PROBATION_CHECKS {
            self.shared.counters.held.fetch_add(1, Ordering::Relaxed);
            return Sampling::Hold;
        }
        Sampling::Yes
    }

    /// A push drawn for a check was refused by the shard, or a place taken for a push was
    /// not used: the place is given back.
    pub fn cancel(&self, worker: u64) {
        self.shared.release(worker);
    }

    /// Takes a place in the checker's queue for `worker`'s next push, now or as soon as one
    /// is given back, waiting at most `within` (module docs, "Pacing"): false when none came
    /// free in time (the push is then fed without one, and refused `busy` if it is drawn).
    /// A place taken is handed to [`SpotChecker::sample`] (`placed`), or given back with
    /// [`SpotChecker::cancel`].
    pub async fn wait_place(&self, worker: u64, within: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let freed = self.shared.freed.notified();
            tokio::pin!(freed);
            // Registered before the look, so a place given back in between still wakes us.
            freed.as_mut().enable();
            if self.shared.take(worker) {
                return true;
            }
            if tokio::time::timeout_at(deadline, freed).await.is_err() {
                return self.shared.take(worker);
            }
        }
    }

    /// [`SpotChecker::wait_place`] without waiting.
    pub fn try_place(&self, worker: u64) -> bool {
        self.shared.take(worker)
    }

    /// The coin of [`SpotChecker::sample`].
    fn draw(&self, worker: u64, request_id: u32, digest: u64, tag: &PushTag) -> bool {
        let mut rate = self.cfg.fraction;
        if rate <= 0.0 {
            return false;
        }
        if rate < PROBATION_RATE && self.shared.reputation.spot_passed(worker) < PROBATION_CHECKS {
            rate = PROBATION_RATE;
        }
        if rate >= 1.0 {
            return true;
        }
        use hmac::{Hmac, Mac};
        type HmacSha256 = Hmac<sha2::Sha256>;
        // HMAC takes keys of any length: `new_from_slice` does not fail for 32 bytes.
        let Ok(mut m) = <HmacSha256 as Mac>::new_from_slice(&self.key) else {
            return true;
        };
        m.update(b"crowdgrad spot check ");
        m.update(&worker.to_le_bytes());
        m.update(&request_id.to_le_bytes());
        m.update(&digest.to_le_bytes());
        m.update(&tag.batch.to_le_bytes());
        for v in &tag.versions {
            m.update(&v.to_le_bytes());
        }
        let out = m.finalize().into_bytes();
        let mut h = [0u8; 8];
        h.copy_from_slice(&out[..8]);
        ((u64::from_le_bytes(h) >> 11) as f64 / (1u64 << 53) as f64) < rate
    }

    /// The parameters of every version `tag` names, taken before its push is applied.
    ///
    /// # Errors
    /// When the tag does not list one version per shard, or names a version this checker no
    /// longer holds (older than its `--spot-check-history`) or never saw: the push cannot be
    /// checked, and is refused `too_stale` (the message says which).
    pub fn capture(&self, tag: &PushTag) -> std::result::Result<Read, String> {
        if tag.versions.len() != self.shared.histories.len() {
            return Err(format!(
                "its tag lists {} shard versions for {} shards",
                tag.versions.len(),
                self.shared.histories.len()
            ));
        }
        let mut params = Vec::with_capacity(self.shared.histories.len());
        let mut counts = Vec::with_capacity(self.shared.histories.len());
        for (shard, (h, &v)) in self.shared.histories.iter().zip(&tag.versions).enumerate() {
            let h = h.lock().unwrap_or_else(|p| p.into_inner());
            match h.iter().find(|(hv, _, _)| *hv == v) {
                Some((_, p, samples)) => {
                    params.push(p.clone());
                    counts.push(*samples);
                }
                None => {
                    let oldest = h.front().map_or(0, |(v, _, _)| *v);
                    self.shared
                        .counters
                        .refused_version
                        .fetch_add(1, Ordering::Relaxed);
                    return Err(format!(
                        "it was computed from version {v} of shard {shard}; the spot checker \
                         holds versions {oldest} and later only: pull again"
                    ));
                }
            }
        }
        Ok(Read { params, counts })
    }

    /// A sampled push, applied (or held, [`SampledPush::held`]), with the parameters
    /// [`SpotChecker::capture`] took: queues the check in the place [`SpotChecker::sample`]
    /// held for it.
    pub fn submit(&self, push: SampledPush, read: Read) {
        let Read { params, counts } = read;
        self.shared.counters.sampled.fetch_add(1, Ordering::Relaxed);
        let worker = push.worker;
        // The places held never exceed the channel's room, so this fails only if the checker
        // thread is gone (it ends with the server).
        let held = push.held;
        if self
            .tx
            .try_send(Job {
                push,
                params,
                counts,
            })
            .is_err()
        {
            self.shared.release(worker);
            if held {
                // Never applied unchecked.
                self.shared
                    .counters
                    .held_dropped
                    .fetch_add(1, Ordering::Relaxed);
            }
            self.shared
                .counters
                .dropped_queue
                .fetch_add(1, Ordering::Relaxed);
            self.shared.reputation.checked(worker, CheckResult::Skipped);
        }
    }

    /// Hands the checker the shards of this process, in shard order (set once; later calls
    /// are ignored): it vouches for workers that passed their probation and rolls back
    /// poison on them.
    pub fn attach(&self, shards: Vec<Box<dyn ShardControl>>) {
        let _ = self.shared.controls.set(shards);
    }

    /// Shard `shard`'s push from `worker` produced `version` (a `sync:K` push: the version
    /// its round will produce): remembered, bounded, for a rollback.
    pub fn applied(&self, shard: u32, version: u64, worker: u64) {
        self.shared.log_applied(shard, version, worker);
    }

    /// The counters and recent figures.
    pub fn status(&self) -> SpotStatus {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        SpotStatus {
            fraction: self.cfg.fraction,
            cosine: self.cfg.cosine,
            norm_tol: self.cfg.norm_tol,
            history: self.shared.history,
            sampled: get(&c.sampled),
            passed: get(&c.passed),
            failed: get(&c.failed),
            skipped_version: get(&c.skipped_version),
            refused_version: get(&c.refused_version),
            skipped_unknown: get(&c.skipped_unknown),
            dropped_queue: get(&c.dropped_queue),
            refused_busy: get(&c.refused_busy),
            dropped_quarantined: get(&c.dropped_quarantined),
            vouched: get(&c.vouched),
            rollback: self.cfg.rollback,
            rollbacks: get(&c.rollbacks),
            versions_undone: get(&c.versions_undone),
            poisoned_undone: get(&c.poisoned_undone),
            poisoned_kept: get(&c.poisoned_kept),
            healed: get(&c.healed),
            held: get(&c.held),
            held_applied: get(&c.held_applied),
            held_dropped: get(&c.held_dropped),
            sensitive: get(&c.sensitive),
            sensitive_passed: get(&c.sensitive_passed),
            recent: self
                .shared
                .recent
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .copied()
                .collect(),
        }
    }
}

/// What the shards of one server share for defence: the reputation of every worker and, with
/// `--spot-check`, the spot checker.
#[derive(Debug, Clone)]
pub struct Defence {
    /// Per-worker reputation and quarantine.
    pub reputation: Arc<Reputation>,
    /// The spot checker (None: spot checks off).
    pub spot: Option<Arc<SpotChecker>>,
}

impl Defence {
    /// Whether a worker can be quarantined: by failed spot checks or by refused frames
    /// (`--quarantine-rejections`).
    pub fn can_quarantine(&self) -> bool {
        self.spot.is_some() || self.reputation.quarantines_on_refusals()
    }

    /// The counters `/metrics` shows.
    pub fn scrape(&self) -> DefenceScrape {
        let status = self.reputation.status(0);
        DefenceScrape {
            spot: self.spot.as_ref().map(|s| s.status()),
            quarantined: status.quarantined as u64,
            identities: status.quarantined_identities as u64,
        }
    }
}

/// The spot-check and quarantine counters at scrape time ([`crate::registry::metrics::render_with`]).
#[derive(Debug)]
pub struct DefenceScrape {
    spot: Option<SpotStatus>,
    quarantined: u64,
    identities: u64,
}

impl prometheus_client::collector::Collector for DefenceScrape {
    fn encode(
        &self,
        mut enc: prometheus_client::encoding::DescriptorEncoder,
    ) -> std::result::Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        use prometheus_client::metrics::MetricType;
        if let Some(s) = &self.spot {
            let mut m = enc.encode_descriptor(
                "crowdgrad_spot_checks",
                "Spot checks of sampled pushes, by result.",
                None,
                MetricType::Counter,
            )?;
            for (result, n) in [
                ("passed", s.passed),
                ("failed", s.failed),
                ("skipped_version", s.skipped_version),
                ("refused_version", s.refused_version),
                ("skipped_unknown", s.skipped_unknown),
                ("dropped_queue", s.dropped_queue),
                ("refused_busy", s.refused_busy),
                ("dropped_quarantined", s.dropped_quarantined),
            ] {
                ConstCounter::new(n).encode(m.encode_family(&vec![("result", result)])?)?;
            }
            for (name, help, n) in [
                (
                    "crowdgrad_spot_check_vouched",
                    "Workers vouched for after passing their spot-check probation (once per passed check from then on).",
                    s.vouched,
                ),
                (
                    "crowdgrad_spot_check_rollbacks",
                    "Shards rolled back past a quarantined worker's pushes.",
                    s.rollbacks,
                ),
                (
                    "crowdgrad_spot_check_versions_undone",
                    "Versions undone by rollbacks (the poisoner's and the honest ones since).",
                    s.versions_undone,
                ),
                (
                    "crowdgrad_spot_check_poisoned_undone",
                    "A poisoner's applied pushes undone by rollbacks.",
                    s.poisoned_undone,
                ),
                (
                    "crowdgrad_spot_check_poisoned_kept",
                    "A poisoner's unchecked pushes no rollback could undo: older than the history held.",
                    s.poisoned_kept,
                ),
                (
                    "crowdgrad_spot_check_healed",
                    "Shards left to heal: every push of the poisoner's there was older than the history held.",
                    s.healed,
                ),
            ] {
                let m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
                ConstCounter::new(n).encode(m)?;
            }
            let m = enc.encode_descriptor(
                "crowdgrad_spot_checks_sampled",
                "Pushes sampled for a spot check.",
                None,
                MetricType::Counter,
            )?;
            ConstCounter::new(s.sampled).encode(m)?;
        }
        for (name, help, v) in [
            (
                "crowdgrad_workers_quarantined",
                "Workers quarantined now.",
                self.quarantined,
            ),
            (
                "crowdgrad_identities_quarantined",
                "Identities whose joins are refused.",
                self.identities,
            ),
        ] {
            let m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
            ConstGauge::new(v as i64).encode(m)?;
        }
        Ok(())
    }
}

/// A recomputed round: who, from which batch and versions, and the full vector pushed.
struct Recomputed {
    worker: u64,
    batch: u64,
    versions: Vec<u64>,
    samples: u32,
    expected: Vec<f32>,
}

/// The checker thread's state.
struct Checker {
    cfg: SpotConfig,
    spec: RunSpec,
    model: Model,
    train: Arc<Dataset>,
    partitions: usize,
    registry: Registry,
    shared: Arc<Shared>,
    /// Partition index -> its examples, normalised as the workers see them.
    /// The workers' partitions, by part (at most [`DATASETS`]: a partition is a copy).
    datasets: HashMap<crate::registry::Part, Arc<Dataset>>,
    /// Worker -> its sampler where the last check left it (batches only move forward).
    samplers: HashMap<u64, BatchSampler>,
    cache: VecDeque<Recomputed>,
}

/// Most workers whose samplers the checker keeps.
const SAMPLERS: usize = 4096;

enum Verdict {
    Pass(CheckFigures, u32),
    Fail(String, Option<(CheckFigures, u32)>),
    Skip,
}

impl Checker {
    fn run(mut self, rx: Receiver<Job>) {
        // Ends when the SpotChecker (the only sender) is dropped with the server.
        while let Ok(job) = rx.recv() {
            let worker = job.push.worker;
            if self.shared.reputation.quarantined(worker).is_some() {
                self.shared
                    .counters
                    .dropped_quarantined
                    .fetch_add(1, Ordering::Relaxed);
                if job.push.held {
                    self.shared
                        .counters
                        .held_dropped
                        .fetch_add(1, Ordering::Relaxed);
                }
                self.shared.release(worker);
                continue;
            }
            let shard = job.push.shard;
            let verdict = self.check(&job);
            let c = &self.shared.counters;
            let mut passed = false;
            let result = match verdict {
                Verdict::Pass(f, steps) => {
                    c.passed.fetch_add(1, Ordering::Relaxed);
                    if let Some(v) = job.push.produced {
                        self.shared.log_verified(shard, v, worker);
                    }
                    self.remember(worker, shard, steps, f, true);
                    passed = true;
                    CheckResult::Passed(f)
                }
                Verdict::Fail(why, f) => {
                    c.failed.fetch_add(1, Ordering::Relaxed);
                    if let Some((f, steps)) = f {
                        self.remember(worker, shard, steps, f, false);
                    }
                    tracing::warn!(worker, shard, %why, "spot check failed");
                    CheckResult::Failed(why, f.map(|(f, _)| f))
                }
                Verdict::Skip => {
                    c.skipped_unknown.fetch_add(1, Ordering::Relaxed);
                    CheckResult::Skipped
                }
            };
            // A held push is applied once found honest, before its worker's next push can
            // take the place (so its pushes land in order), and dropped otherwise.
            if job.push.held {
                if passed {
                    self.apply_held(&job.push);
                } else {
                    c.held_dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
            let quarantined = self.shared.reputation.checked(worker, result);
            if passed && self.shared.reputation.spot_passed(worker) >= PROBATION_CHECKS {
                self.shared.vouch(worker);
            }
            if quarantined && self.cfg.rollback {
                self.shared.roll_back(worker);
            }
            // Judged (and, if it failed, quarantined and rolled back): its place is free for
            // the next push, which a worker on probation waited for.
            self.shared.release(worker);
        }
    }

    /// Applies a held push that passed on its shard, and books it as the driver books any
    /// push: the registry's counters and ledger, a refusal in the reputation, the version in
    /// the rollback log.
    fn apply_held(&self, push: &SampledPush) {
        let Some(control) = self
            .shared
            .controls
            .get()
            .and_then(|c| c.get(push.shard as usize))
        else {
            self.shared
                .counters
                .held_dropped
                .fetch_add(1, Ordering::Relaxed);
            return;
        };
        let Some((outcome, nonzero)) = control.apply_held(push) else {
            return;
        };
        self.shared
            .counters
            .held_applied
            .fetch_add(1, Ordering::Relaxed);
        let (worker, shard) = (push.worker, push.shard);
        let produced = match &outcome {
            Outcome::Applied { version, .. } => Some(*version),
            Outcome::Buffered { version, .. } => Some(version + 1),
            Outcome::Rejected { .. } => None,
        };
        if let Some(v) = produced {
            self.shared.log_applied(shard, v, worker);
            self.shared.log_verified(shard, v, worker);
        }
        match &outcome {
            Outcome::Applied { .. } | Outcome::Buffered { .. } => {}
            Outcome::Rejected { code, .. } => self.shared.reputation.rejected(worker, *code),
        }
        self.registry
            .pushed(shard, Some(worker), &outcome, push.samples, nonzero);
    }

    fn remember(&self, worker: u64, shard: u32, steps: u32, f: CheckFigures, passed: bool) {
        let mut r = self.shared.recent.lock().unwrap_or_else(|p| p.into_inner());
        if r.len() >= RECENT {
            r.pop_front();
        }
        r.push_back(Figure {
            worker,
            shard,
            steps,
            cosine: f.cosine,
            norm_ratio: f.norm_ratio,
            passed,
        });
    }

    fn dataset(&mut self, worker: u64) -> Option<Arc<Dataset>> {
        let part = self.registry.partition(worker)?;
        if part.count > self.partitions {
            return None;
        }
        if let Some(d) = self.datasets.get(&part) {
            return Some(d.clone());
        }
        let range = self.train.partition(part.index, part.count).ok()?;
        let mut d = self.train.subset(range).ok()?;
        d.set_normalize(&self.spec.normalize).ok()?;
        let d = Arc::new(d);
        if self.datasets.len() >= DATASETS {
            self.datasets.clear();
        }
        self.datasets.insert(part, d.clone());
        Some(d)
    }

    fn check(&mut self, job: &Job) -> Verdict {
        let p = &job.push;
        let shards = self.spec.shards.len();
        let tag = &p.tag;
        if tag.versions.len() != shards {
            return Verdict::Fail(
                format!(
                    "its tag lists {} shard versions for {shards} shards",
                    tag.versions.len()
                ),
                None,
            );
        }
        if job.params.len() != shards {
            return Verdict::Fail(
                "its tag names a version the shards never published".into(),
                None,
            );
        }
        if tag.versions.get(p.shard as usize) != Some(&p.base_version) {
            return Verdict::Fail(
                format!(
                    "its tag says shard {} was read at {:?}, its header at {}",
                    p.shard,
                    tag.versions.get(p.shard as usize),
                    p.base_version
                ),
                None,
            );
        }
        let batch = self.spec.batch_size.max(1);
        let pseudo = self.spec.local.steps.pseudo_gradients();
        let samples = p.samples as usize;
        let steps = samples / batch;
        let max_steps = if pseudo {
            self.spec.local.steps.max() as usize
        } else {
            1
        };
        if !samples.is_multiple_of(batch) || steps == 0 || steps > max_steps {
            return Verdict::Fail(
                format!("{samples} samples are not 1 to {max_steps} batches of {batch}"),
                None,
            );
        }
        let Some(range) = self.spec.shards.get(p.shard as usize).map(|s| s.range) else {
            return Verdict::Fail(format!("no shard {}", p.shard), None);
        };
        if p.grad.len() != range.len() {
            return Verdict::Fail("its slice has the wrong length".into(), None);
        }
        let cached = self.cache.iter().position(|r| {
            r.worker == p.worker
                && r.batch == tag.batch
                && r.versions == tag.versions
                && r.samples == p.samples
        });
        let index = match cached {
            Some(i) => i,
            None => {
                let Some(expected) = self.recompute(job, steps, pseudo, None) else {
                    return Verdict::Skip;
                };
                if self.cache.len() >= CACHE {
                    self.cache.pop_front();
                }
                self.cache.push_back(Recomputed {
                    worker: p.worker,
                    batch: tag.batch,
                    versions: tag.versions.clone(),
                    samples: p.samples,
                    expected,
                });
                self.cache.len() - 1
            }
        };
        let f = compare(&self.cache[index].expected[range.start..range.end], &p.grad);
        let passes = within_tolerance(
            &self.cfg,
            f,
            &self.cache[index].expected[range.start..range.end],
            &p.grad,
            p.error_bound,
        ) || (pseudo
            && steps > 1
            && self.within_sensitivity(job, steps, index, range.start..range.end, f));
        let steps = steps as u32;
        if passes {
            Verdict::Pass(f, steps)
        } else {
            Verdict::Fail(
                format!(
                    "shard {} slice has cosine {:.4} (needs >= {}) and norm ratio {:.4} (needs 1 ± {}) to the recomputed one",
                    p.shard, f.cosine, self.cfg.cosine, f.norm_ratio, self.cfg.norm_tol
                ),
                Some((f, steps)),
            )
        }
    }

    /// A round that failed the fixed tolerances, judged against its own sensitivity (module
    /// docs, "Sensitivity"): recomputed again from the pulled parameters nudged by one unit
    /// in the last place ([`NUDGES`] ways), the farthest of those from the first recomputation
    /// is how far rounding alone moves this round. The push passes if it is within
    /// [`SENSITIVITY_FACTOR`] times that (plus the encoding's bound), and never with a cosine
    /// under [`SENSITIVITY_COSINE`] or a norm ratio off by more than [`SENSITIVITY_NORM`].
    fn within_sensitivity(
        &mut self,
        job: &Job,
        steps: usize,
        index: usize,
        range: std::ops::Range<usize>,
        f: CheckFigures,
    ) -> bool {
        if f.cosine < SENSITIVITY_COSINE || (f.norm_ratio - 1.0).abs() > SENSITIVITY_NORM {
            return false;
        }
        let mut spread = 0.0f64;
        for nudge in 1..=NUDGES {
            let Some(again) = self.recompute(job, steps, true, Some(nudge)) else {
                return false;
            };
            let Some(first) = self.cache.get(index) else {
                return false;
            };
            spread = spread.max(distance(
                &first.expected[range.clone()],
                &again[range.clone()],
            ));
        }
        let Some(first) = self.cache.get(index) else {
            return false;
        };
        let expected = &first.expected[range];
        let d = distance(expected, &job.push.grad);
        let passed = sensitivity_verdict(f, d, spread, job.push.error_bound);
        self.shared
            .counters
            .sensitive
            .fetch_add(1, Ordering::Relaxed);
        if passed {
            self.shared
                .counters
                .sensitive_passed
                .fetch_add(1, Ordering::Relaxed);
        }
        tracing::info!(
            worker = job.push.worker,
            shard = job.push.shard,
            steps,
            cosine = f.cosine,
            distance = d,
            spread,
            passed,
            "a round outside the fixed tolerances, judged against its sensitivity"
        );
        passed
    }

    /// The worker's whole push vector recomputed: its gradient, or the pseudo-gradient of a
    /// round of `steps` inner steps. `None` when its partition is unknown. `nudge`: start
    /// from the pulled parameters moved by one unit in the last place, in a pattern of its
    /// own (`within_sensitivity`).
    fn recompute(
        &mut self,
        job: &Job,
        steps: usize,
        pseudo: bool,
        nudge: Option<u32>,
    ) -> Option<Vec<f32>> {
        let p = &job.push;
        let data = self.dataset(p.worker)?;
        let batch = self.spec.batch_size;
        let start = p.tag.batch.checked_mul(batch as u64)?;
        let mut sampler = match self.samplers.remove(&p.worker) {
            Some(s) if s.position() <= start => s,
            _ => BatchSampler::new(data.len(), batch_seed(self.spec.seed, p.worker)),
        };
        sampler.skip(start - sampler.position());
        // The parameters as the worker decoded them from its pulls (bf16 by default).
        let mut theta = Vec::with_capacity(self.model.param_len());
        let mut bytes = Vec::new();
        for v in &job.params {
            let at = theta.len();
            theta.resize(at + v.len(), 0.0);
            if p.pull_encoding == Encoding::F32 {
                theta[at..].copy_from_slice(v);
            } else {
                bytes.clear();
                p.pull_encoding.encode(v, &mut bytes).ok()?;
                p.pull_encoding.decode(&bytes, &mut theta[at..]).ok()?;
            }
        }
        if theta.len() != self.model.param_len() {
            return None;
        }
        if let Some(k) = nudge {
            // One ulp up or down, coordinate by coordinate, in a pattern per nudge.
            let mut r = crowdgrad_core::rng::Rng::new(0x5EED_0000 + u64::from(k));
            for t in theta.iter_mut().filter(|t| t.is_finite() && **t != 0.0) {
                let b = t.to_bits();
                *t = f32::from_bits(if r.next_u64() & 1 == 0 { b + 1 } else { b - 1 });
            }
        }
        let anchor = if pseudo { theta.clone() } else { Vec::new() };
        let mut ws = self.model.workspace(batch);
        let mut idx = vec![0u32; batch];
        let mut x = Array2::zeros((batch, data.features));
        let mut y = vec![0u8; batch];
        let mut grad = vec![0.0f32; theta.len()];
        let inner = self.spec.local.inner;
        // The inner schedule where the shards the round read were, as the worker ran it:
        // their versions, or under `auto` the samples they had applied (this checker's own
        // record, not the worker's word) plus the round's.
        let inner_scale =
            inner
                .schedule
                .factor_round(&p.tag.versions, &job.counts, u64::from(p.samples));
        let mut state = OptState::new(&inner.rule, if pseudo { theta.len() } else { 0 });
        for _ in 0..steps {
            sampler.next_batch(&mut idx);
            data.fill_batch(&idx, &mut x.view_mut(), &mut y);
            self.model
                .loss_and_grad(&theta, x.view(), &y, &mut grad, &mut ws)
                .ok()?;
            if let Some(c) = self.spec.optimizer.clip_norm {
                clip_by_global_norm(&mut grad, c);
            }
            if pseudo {
                optim::step(&inner, &mut state, &mut theta, &grad, inner_scale);
            }
        }
        if self.samplers.len() >= SAMPLERS {
            self.samplers.clear();
        }
        self.samplers.insert(p.worker, sampler);
        if pseudo {
            for ((g, a), t) in grad.iter_mut().zip(&anchor).zip(&theta) {
                *g = a - t;
            }
        }
        Some(grad)
    }
}

#[cfg(test)]
mod tests;
