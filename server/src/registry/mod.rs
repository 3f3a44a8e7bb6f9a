//! Who is connected and what happened to every frame: per worker and per shard counters of
//! pulls, applied and rejected pushes (by reason), other rejected frames (by reason), samples and
//! staleness. Everything `/api/status` and `/api/workers` show comes from here and from the
//! shards' versions.
//!
//! A public server may hold 10,000 workers, so the status carries only the
//! [`RECENT_WORKERS`] newest ones plus [`WorkerTotals`] by kind, and [`Registry::workers`] pages
//! the rest ([`MAX_PAGE`] at a time). Workers are kept in id order (ids grow with joins), so both
//! are cheap and a page is stable while workers come and go. The totals by kind are kept as
//! workers join, connect, leave and are forgotten (issue 18), so neither the status nor the
//! dashboard tick ([`Registry::summary`]) walks every worker under the lock pulls and pushes
//! take.

pub mod feed;
pub mod ledger;
pub mod metrics;
pub mod partition;

pub use partition::Part;

use crowdgrad_core::shard::Outcome;
use crowdgrad_core::wire::{ClientKind, ErrorCode};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// What one pull read, as the registry logs it (`/api/reads`, the read-skew histogram).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pulled {
    /// The version sent.
    pub version: u64,
    /// The reader's SSP clock.
    pub clock: Option<u64>,
    /// The slowest active SSP clock.
    pub min_clock: Option<u64>,
}

/// Staleness histogram buckets: 0, 1, ..., 15 exactly, then `16+`.
pub const STALENESS_BUCKETS: usize = 17;

/// Workers `/api/status` carries, newest first; `/api/workers` pages the rest.
pub const RECENT_WORKERS: usize = 100;

/// Most workers one [`Registry::workers`] page holds.
pub const MAX_PAGE: usize = 1000;

/// Workers of one kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct KindCount {
    /// Registered (joined and not forgotten), connected or not.
    pub registered: u64,
    /// With at least one shard connection open.
    pub connected: u64,
}

/// Worker counts over the whole registry, by kind: what the status reports instead of listing
/// every worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct WorkerTotals {
    /// Registered workers of every kind.
    pub registered: u64,
    /// Connected workers of every kind.
    pub connected: u64,
    /// `crowdgrad work` processes.
    pub native: KindCount,
    /// Browser tabs.
    pub browser: KindCount,
    /// Volunteers: the threads of one (a tab's Web Workers, a `work --threads` process,
    /// joined with one `threads.volunteer`) count once; a worker joined without counts alone.
    pub volunteers: KindCount,
}

impl WorkerTotals {
    #[cfg(test)]
    fn count(&mut self, client: ClientKind, connected: bool) {
        let kind = match client {
            ClientKind::Native => &mut self.native,
            ClientKind::Browser => &mut self.browser,
        };
        kind.registered += 1;
        self.registered += 1;
        if connected {
            kind.connected += 1;
            self.connected += 1;
        }
    }
}

/// Counters shared by shards and workers.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Counters {
    /// Pull requests served.
    pub pulls: u64,
    /// Bytes of the push frames received (what workers sent up).
    pub bytes_up: u64,
    /// Bytes of the parameter frames sent (what workers received).
    pub bytes_down: u64,
    /// Pushes applied (in sync mode: accepted into an aggregate).
    pub pushes_applied: u64,
    /// Sync mode: pushes buffered for an aggregate (included in `pushes_applied`).
    pub pushes_buffered: u64,
    /// Pushes rejected (other refused frames are `frames_rejected`).
    pub pushes_rejected: u64,
    /// Sync mode: buffered pushes taken out of their round before it was applied, because
    /// their worker was quarantined (they stay counted in `pushes_buffered`).
    pub pushes_dropped: u64,
    /// Pushes over the norm bound that were scaled down to it and applied (a trusted worker's
    /// rare outlier, core's `session/guard.rs`; included in `pushes_applied`).
    pub pushes_clipped: u64,
    /// Push rejections by error code name.
    pub rejected_by_reason: BTreeMap<&'static str, u64>,
    /// Frames other than pushes refused with an error frame: malformed or oversized frames, text
    /// messages, a bad Hello, anything before Hello but a push, frames for another shard.
    pub frames_rejected: u64,
    /// Those refusals by error code name.
    pub frames_rejected_by_reason: BTreeMap<&'static str, u64>,
    /// Examples behind the applied pushes (counted on shard 0 for workers and totals).
    pub samples: u64,
    /// Sum of staleness of applied pushes.
    #[serde(skip)]
    pub staleness_sum: u64,
    /// Mean staleness of applied pushes.
    pub staleness_mean: f64,
    /// Largest staleness applied.
    pub staleness_max: u64,
    /// Histogram of staleness (see [`STALENESS_BUCKETS`]).
    pub staleness_hist: Vec<u64>,
    /// Steps whose shard reads were complete (for read skew).
    pub read_steps: u64,
    /// Mean read skew: spread (max - min) of the shard versions read for one step.
    pub read_skew_mean: f64,
    /// Largest read skew.
    pub read_skew_max: u64,
    #[serde(skip)]
    read_skew_sum: u64,
    /// Totals only (`None` per shard and per worker): the workers by kind.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workers: Option<WorkerTotals>,
}

impl Counters {
    fn record(&mut self, outcome: &Outcome, samples: Option<u32>) {
        match outcome {
            Outcome::Buffered { .. } => {
                self.pushes_applied += 1;
                self.pushes_buffered += 1;
                self.samples += u64::from(samples.unwrap_or(0));
                self.record_staleness(0);
            }
            Outcome::Applied { staleness, .. } => {
                self.pushes_applied += 1;
                self.samples += u64::from(samples.unwrap_or(0));
                self.record_staleness(*staleness);
            }
            Outcome::Rejected { code, .. } => self.reject(*code),
        }
    }

    fn record_staleness(&mut self, staleness: u64) {
        self.staleness_sum += staleness;
        self.staleness_max = self.staleness_max.max(staleness);
        self.staleness_mean = self.staleness_sum as f64 / self.pushes_applied as f64;
        if self.staleness_hist.len() != STALENESS_BUCKETS {
            self.staleness_hist = vec![0; STALENESS_BUCKETS];
        }
        self.staleness_hist[(staleness as usize).min(STALENESS_BUCKETS - 1)] += 1;
    }

    fn record_skew(&mut self, skew: u64) {
        self.read_steps += 1;
        self.read_skew_sum += skew;
        self.read_skew_max = self.read_skew_max.max(skew);
        self.read_skew_mean = self.read_skew_sum as f64 / self.read_steps as f64;
    }

    fn reject(&mut self, code: ErrorCode) {
        self.pushes_rejected += 1;
        *self.rejected_by_reason.entry(code.name()).or_default() += 1;
    }

    fn reject_frame(&mut self, code: ErrorCode) {
        self.frames_rejected += 1;
        *self
            .frames_rejected_by_reason
            .entry(code.name())
            .or_default() += 1;
    }
}

/// One registered worker.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerRecord {
    /// Worker id.
    pub id: u64,
    /// Native or browser.
    pub client: ClientKind,
    /// Display name it gave.
    pub name: Option<String>,
    /// Data partition assigned (its index; [`WorkerRecord::partitions`] parts).
    pub partition: usize,
    /// How many parts its partition is one of ([`partition`]).
    pub partitions: usize,
    /// Which of a volunteer's threads it is (as joined), if it runs several.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub threads: Option<crowdgrad_core::spec::Threads>,
    /// Shard connections open now.
    pub shards_connected: u32,
    /// Whether it has any connection open.
    pub connected: bool,
    /// Seconds since it was last heard from.
    pub last_seen_s: f64,
    /// Seconds since it joined.
    pub joined_s: f64,
    /// Last rejection reason (of a push or any other frame).
    pub last_rejection: Option<String>,
    /// What it did.
    #[serde(flatten)]
    pub counters: Counters,
    /// What it reported about its exchanges (None until its first `Report`).
    pub exchange: Option<ExchangeView>,
    #[serde(skip)]
    last_read: Vec<Option<u64>>,
    #[serde(skip)]
    joined: Option<Instant>,
    #[serde(skip)]
    last_seen: Option<Instant>,
}

/// A worker's exchanges, from its `Report` frames and the shard's own byte counts.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct ExchangeView {
    /// Inner steps per push it uses now.
    pub local_steps: u32,
    /// Pull encoding negotiated (shard 0).
    pub pull_encoding: String,
    /// Push encoding negotiated (shard 0).
    pub push_encoding: String,
    /// Share of its wall time spent computing (the rest is waiting), 0..1.
    pub compute_share: f64,
    /// Mean exchange latency, seconds.
    pub exchange_s: f64,
    /// Bytes per second it sent, over the last report interval.
    pub up_bps: f64,
    /// Bytes per second it received, over the last report interval.
    pub down_bps: f64,
    #[serde(skip)]
    last: Option<(f64, u64, u64)>,
}

/// One served pull, as the server's own read log keeps it.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct ReadEntry {
    /// Seconds since the registry was created.
    pub time_s: f64,
    /// Reader.
    pub worker: u64,
    /// Shard read.
    pub shard: u32,
    /// Version returned.
    pub version: u64,
    /// SSP: the reader's clock when it was allowed to read.
    pub clock: Option<u64>,
    /// SSP: the slowest active clock at that moment.
    pub min_clock: Option<u64>,
}

/// Most read-log entries kept (oldest dropped first).
pub const READ_LOG: usize = 50_000;

#[derive(Debug, Default)]
struct Inner {
    next_id: u64,
    /// By id, so the newest are last and pages are ranges.
    workers: BTreeMap<u64, WorkerRecord>,
    shards: Vec<Counters>,
    totals: Counters,
    reads: VecDeque<ReadEntry>,
    read_skew_hist: Vec<u64>,
    epoch: Option<Instant>,
    /// The contribution ledger's in-memory part (crate::registry::ledger): seats and the
    /// credit not yet flushed to its database.
    ledger: crate::registry::ledger::Ledger,
    /// Workers by kind, kept as they join, connect and are forgotten, so the status never
    /// walks every worker under this lock.
    tally: Tally,
    /// A shard process's report of the workers' pushes to its coordinator ([`feed`]); `None`
    /// elsewhere.
    feed: Option<feed::Feed>,
}

impl Inner {
    /// Forgets the workers with no socket open that were not seen for [`FORGET_AFTER_S`]
    /// (their records, tallies and ledger seats); their ids.
    fn forget_idle(&mut self, now: Instant) -> Vec<u64> {
        let Inner {
            workers,
            tally,
            ledger,
            ..
        } = self;
        let mut forgotten = Vec::new();
        workers.retain(|id, w| {
            let keep = w.shards_connected > 0
                || w.last_seen
                    .is_none_or(|t| now.duration_since(t).as_secs_f64() < FORGET_AFTER_S);
            if !keep {
                tally.forgot(w);
                ledger.left(*id);
                forgotten.push(*id);
            }
            keep
        });
        forgotten
    }
}

/// [`WorkerTotals`] kept up to date one event at a time (issue 18: the status and the
/// dashboard tick read it under the lock pulls and pushes take; counting 10,000 workers there
/// each time held that lock for the whole walk).
#[derive(Debug, Default)]
struct Tally {
    /// Native, browser and all; `volunteers` is filled in by [`Tally::totals`].
    kinds: WorkerTotals,
    /// Workers joined without `threads`: each its own volunteer.
    solo: KindCount,
    /// Volunteers with threads: key -> (threads registered, threads connected).
    groups: HashMap<String, (u32, u32)>,
    /// Groups with at least one thread connected.
    groups_connected: u64,
}

impl Tally {
    fn kind(&mut self, client: ClientKind) -> &mut KindCount {
        match client {
            ClientKind::Native => &mut self.kinds.native,
            ClientKind::Browser => &mut self.kinds.browser,
        }
    }

    fn joined(&mut self, w: &WorkerRecord) {
        self.kind(w.client).registered += 1;
        self.kinds.registered += 1;
        match &w.threads {
            Some(t) => self.groups.entry(t.volunteer.clone()).or_default().0 += 1,
            None => self.solo.registered += 1,
        }
    }

    /// `w` went from no connection to one (`true`) or from one to none.
    fn connected(&mut self, w: &WorkerRecord, now: bool) {
        let step = |n: &mut u64| {
            if now {
                *n += 1
            } else {
                *n = n.saturating_sub(1)
            }
        };
        step(&mut self.kind(w.client).connected);
        step(&mut self.kinds.connected);
        match &w.threads {
            Some(t) => {
                let Some(g) = self.groups.get_mut(&t.volunteer) else {
                    return;
                };
                let was = g.1 > 0;
                g.1 = if now { g.1 + 1 } else { g.1.saturating_sub(1) };
                if was != (g.1 > 0) {
                    step(&mut self.groups_connected);
                }
            }
            None => step(&mut self.solo.connected),
        }
    }

    /// `w` (not connected) was forgotten.
    fn forgot(&mut self, w: &WorkerRecord) {
        let k = self.kind(w.client);
        k.registered = k.registered.saturating_sub(1);
        self.kinds.registered = self.kinds.registered.saturating_sub(1);
        match &w.threads {
            Some(t) => {
                if let Some(g) = self.groups.get_mut(&t.volunteer) {
                    g.0 = g.0.saturating_sub(1);
                    if g.0 == 0 {
                        if g.1 > 0 {
                            self.groups_connected = self.groups_connected.saturating_sub(1);
                        }
                        self.groups.remove(&t.volunteer);
                    }
                }
            }
            None => self.solo.registered = self.solo.registered.saturating_sub(1),
        }
    }

    fn totals(&self) -> WorkerTotals {
        WorkerTotals {
            volunteers: KindCount {
                registered: self.solo.registered + self.groups.len() as u64,
                connected: self.solo.connected + self.groups_connected,
            },
            ..self.kinds
        }
    }
}

/// Cheap-to-clone handle to the registry.
#[derive(Debug, Clone)]
pub struct Registry {
    inner: Arc<Mutex<Inner>>,
    capacity: usize,
    /// The ledger's database, once [`Registry::start_ledger`] attached it (read without the
    /// registry's lock).
    ledger_store: Arc<std::sync::OnceLock<Arc<ledger::store::Store>>>,
}

/// Workers not seen for this long while disconnected are forgotten.
const FORGET_AFTER_S: f64 = 600.0;
/// How often the coordinator forgets idle workers ([`Registry::forget_idle`]).
pub const SWEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

impl Registry {
    /// A registry for `shards` shards holding at most `capacity` workers.
    pub fn new(shards: usize, capacity: usize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                next_id: 1,
                shards: vec![Counters::default(); shards],
                read_skew_hist: vec![0; STALENESS_BUCKETS],
                epoch: Some(Instant::now()),
                ..Inner::default()
            })),
            capacity,
            ledger_store: Arc::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Critical sections only update counters; a poisoned lock still holds usable counters.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a worker; returns its id and data partition ([`partition::choose`] with
    /// `partitions` the finest cut), or `None` when full.
    pub fn join(
        &self,
        client: ClientKind,
        name: Option<String>,
        partitions: usize,
    ) -> Option<(u64, Part)> {
        self.join_thread(client, name, partitions, None)
    }

    /// [`Registry::join`] for one of a volunteer's threads (checked by the caller): it gets
    /// the partition of the volunteer's threads already registered, so they share one
    /// download.
    pub fn join_thread(
        &self,
        client: ClientKind,
        name: Option<String>,
        partitions: usize,
        threads: Option<crowdgrad_core::spec::Threads>,
    ) -> Option<(u64, Part)> {
        let mut g = self.lock();
        let now = Instant::now();
        if g.workers.len() >= self.capacity {
            g.forget_idle(now);
            if g.workers.len() >= self.capacity {
                return None;
            }
        }
        let id = g.next_id;
        g.next_id += 1;
        // The volunteer's other threads are among the newest workers: look back a bounded
        // way (a thread joining much later just gets a partition of its own).
        let sibling = threads.as_ref().and_then(|t| {
            g.workers
                .values()
                .rev()
                .take(4 * crowdgrad_core::spec::MAX_THREADS as usize)
                .find(|w| {
                    w.threads
                        .as_ref()
                        .is_some_and(|o| o.volunteer == t.volunteer)
                })
                .map(|w| Part {
                    index: w.partition,
                    count: w.partitions,
                })
        });
        let part = match sibling.filter(|p| p.count <= partitions.max(1)) {
            Some(p) => p,
            None => {
                let active: Vec<Part> = g
                    .workers
                    .values()
                    .filter(|w| {
                        w.shards_connected > 0
                            || w.joined.is_some_and(|t| {
                                now.duration_since(t).as_secs_f64() < partition::ACTIVE_JOIN_S
                            })
                    })
                    .map(|w| Part {
                        index: w.partition,
                        count: w.partitions,
                    })
                    .collect();
                partition::choose(&active, partitions, id)
            }
        };
        let record = WorkerRecord {
            id,
            client,
            name,
            partition: part.index,
            partitions: part.count,
            threads,
            shards_connected: 0,
            connected: false,
            last_seen_s: 0.0,
            joined_s: 0.0,
            last_rejection: None,
            counters: Counters::default(),
            exchange: None,
            last_read: Vec::new(),
            joined: Some(now),
            last_seen: Some(now),
        };
        g.tally.joined(&record);
        g.workers.insert(id, record);
        Some((id, part))
    }

    /// Workers on probation and established ones, for the join admission bound (issue 21,
    /// [`admission::admits`]): on probation, a worker that joined less than
    /// [`PROBATION_S`](admission::PROBATION_S) ago or has no push applied yet and was seen in
    /// that time; established, one that joined earlier, has had pushes applied and is
    /// connected or was seen in the last 10 minutes. One pass over the registered workers.
    pub fn probation_counts(&self) -> (usize, usize) {
        let g = self.lock();
        let now = Instant::now();
        let age =
            |t: Option<Instant>| t.map_or(f64::INFINITY, |t| now.duration_since(t).as_secs_f64());
        let (mut new, mut established) = (0, 0);
        for w in g.workers.values() {
            let young = age(w.joined) < admission::PROBATION_S;
            if young
                || (w.counters.pushes_applied == 0 && age(w.last_seen) < admission::PROBATION_S)
            {
                new += 1;
            } else if w.counters.pushes_applied > 0
                && (w.shards_connected > 0 || age(w.last_seen) < FORGET_AFTER_S)
            {
                established += 1;
            }
        }
        (new, established)
    }

    /// Forgets the workers that left more than 10 minutes ago ([`FORGET_AFTER_S`]) and have
    /// no socket open, so the memory of a crowd that left goes back (a join does the same
    /// when the registry is full); returns their ids (the coordinator tells the reputation).
    /// One pass under the lock, run by the coordinator every [`SWEEP_EVERY`].
    pub fn forget_idle(&self) -> Vec<u64> {
        self.lock().forget_idle(Instant::now())
    }

    /// True when `id` was handed out and not forgotten.
    pub fn knows(&self, id: u64) -> bool {
        self.lock().workers.contains_key(&id)
    }

    /// Whether `id`'s session is open now ([`Registry::session_open_at`]).
    pub fn session_open(&self, id: u64) -> bool {
        self.session_open_at(id, Instant::now())
    }

    /// Whether `id`'s session is open at `now`: it is registered and either connected to a
    /// shard or seen (or joined) less than 10 minutes before. Past that its credential has
    /// expired with the session, even while the registry still keeps its row.
    pub fn session_open_at(&self, id: u64, now: Instant) -> bool {
        let g = self.lock();
        g.workers.get(&id).is_some_and(|w| {
            let seen = w.last_seen.or(w.joined);
            w.shards_connected > 0
                || seen.is_some_and(|t| {
                    now.saturating_duration_since(t).as_secs_f64() < FORGET_AFTER_S
                })
        })
    }

    /// The data partition `id` trains on, while registered (for spot checks).
    pub fn partition(&self, id: u64) -> Option<Part> {
        self.lock().workers.get(&id).map(|w| Part {
            index: w.partition,
            count: w.partitions,
        })
    }

    /// A worker opened (`+1`) or closed (`-1`) a shard connection.
    pub fn connection(&self, worker: u64, opened: bool) {
        let mut g = self.lock();
        let Inner { workers, tally, .. } = &mut *g;
        if let Some(w) = workers.get_mut(&worker) {
            let was = w.shards_connected > 0;
            if opened {
                w.shards_connected += 1;
            } else {
                w.shards_connected = w.shards_connected.saturating_sub(1);
            }
            if was != (w.shards_connected > 0) {
                tally.connected(w, !was);
            }
            w.last_seen = Some(Instant::now());
        }
    }

    /// A pull was served on `shard`: logs the read and, once the worker has read every shard
    /// since its last complete step, its read skew.
    pub fn pulled(&self, shard: u32, worker: Option<u64>, read: &Pulled) {
        let mut g = self.lock();
        let shards = g.shards.len();
        if let Some(c) = g.shards.get_mut(shard as usize) {
            c.pulls += 1;
        }
        g.totals.pulls += 1;
        let Some(id) = worker else { return };
        let time_s = g.epoch.map_or(0.0, |e| e.elapsed().as_secs_f64());
        if g.reads.len() >= READ_LOG {
            g.reads.pop_front();
        }
        g.reads.push_back(ReadEntry {
            time_s,
            worker: id,
            shard,
            version: read.version,
            clock: read.clock,
            min_clock: read.min_clock,
        });
        let mut skew = None;
        if let Some(w) = g.workers.get_mut(&id) {
            w.counters.pulls += 1;
            w.last_seen = Some(Instant::now());
            if w.last_read.len() != shards {
                w.last_read = vec![None; shards];
            }
            if let Some(slot) = w.last_read.get_mut(shard as usize) {
                *slot = Some(read.version);
            }
            if w.last_read.iter().all(Option::is_some) {
                let versions = w.last_read.iter().flatten();
                let s = versions.clone().max().unwrap_or(&0) - versions.min().unwrap_or(&0);
                w.counters.record_skew(s);
                w.last_read.iter_mut().for_each(|v| *v = None);
                skew = Some(s);
            }
        }
        if let Some(s) = skew {
            g.totals.record_skew(s);
            g.read_skew_hist[(s as usize).min(STALENESS_BUCKETS - 1)] += 1;
        }
    }

    /// Records a push's outcome on `shard` from `worker` (`None` when it came before Hello).
    /// Samples count once per step: on shard 0. Refused frames that are not pushes go to
    /// [`Registry::frame_rejected`].
    /// `nonzero`: the gradient moved anything (the ledger credits no samples for an all-zero
    /// push).
    pub fn pushed(
        &self,
        shard: u32,
        worker: Option<u64>,
        outcome: &Outcome,
        samples: u32,
        nonzero: bool,
    ) {
        let mut g = self.lock();
        let samples = (shard == 0).then_some(samples);
        if let Some(c) = g.shards.get_mut(shard as usize) {
            c.record(outcome, samples);
        }
        g.totals.record(outcome, samples);
        if let Some(w) = worker.and_then(|id| g.workers.get_mut(&id)) {
            w.counters.record(outcome, samples);
            w.last_seen = Some(Instant::now());
            if let Outcome::Rejected { code, message } = outcome {
                w.last_rejection = Some(format!("{}: {message}", code.name()));
            }
        }
        if let Some(id) = worker {
            g.ledger.pushed(id, outcome, samples, nonzero);
            if let Some(f) = &mut g.feed {
                f.pushed(id, outcome, samples, nonzero);
            }
        }
    }

    /// Keeps a [`feed`] of the workers' pushes for a coordinator from now on (a shard
    /// process), numbered for the process start `boot`.
    pub fn keep_feed(&self, boot: u64) {
        self.lock().feed = Some(feed::Feed::new(boot));
    }

    /// The coordinator's take of the feed ([`feed::Feed::take`]); `None` without a feed.
    pub fn take_feed(&self, boot: u64, ack: u64) -> Option<feed::Batch> {
        self.lock().feed.as_mut().map(|f| f.take(boot, ack))
    }

    /// A shard process reported what `worker`'s pushes did there ([`feed`]): its counters,
    /// when it was last seen, and the ledger's credit, as if the pushes had come here. The
    /// shards' own counters are not touched (a coordinator shows remote shards as they report
    /// themselves). An unknown or forgotten worker changes nothing.
    pub fn tallied(&self, worker: u64, t: &feed::Tally) {
        let mut g = self.lock();
        let Some(w) = g.workers.get_mut(&worker) else {
            return;
        };
        let c = &mut w.counters;
        c.pushes_applied = c.pushes_applied.saturating_add(t.accepted);
        c.pushes_rejected = c.pushes_rejected.saturating_add(t.rejected);
        c.samples = c.samples.saturating_add(t.samples);
        w.last_seen = Some(Instant::now());
        g.ledger.tallied(worker, t.accepted, t.rejected, t.credited);
        if let Some(s) = t.compute_s {
            g.ledger.reported(worker, s);
        }
    }

    /// A push of `worker` to `shard` was over the norm bound and scaled down to it (counted
    /// besides [`Registry::pushed`]).
    pub fn clipped(&self, shard: u32, worker: Option<u64>) {
        let mut g = self.lock();
        if let Some(c) = g.shards.get_mut(shard as usize) {
            c.pushes_clipped += 1;
        }
        g.totals.pushes_clipped += 1;
        if let Some(w) = worker.and_then(|id| g.workers.get_mut(&id)) {
            w.counters.pushes_clipped += 1;
        }
    }

    /// Worker `worker` joined as the volunteer `identity` (checked by the caller): its pushes
    /// and reports count in the ledger from now on.
    pub fn identify(&self, worker: u64, identity: &str, who: ledger::Who<'_>, client: ClientKind) {
        self.lock().ledger.joined(worker, identity, who, client);
    }

    /// Runs `f` on the ledger's in-memory part (read-only).
    pub fn with_ledger<R>(&self, f: impl FnOnce(&crate::registry::ledger::Ledger) -> R) -> R {
        f(&self.lock().ledger)
    }

    // --- The ledger's database (crate::registry::ledger::store): attached once; its writer
    // --- thread takes the pending credit with a swap under the lock, never more.

    /// Attaches the ledger's database `store` and starts its writer over `db` (both from
    /// [`ledger::store::Store::open`]).
    ///
    /// # Errors
    /// [`crate::Error::Task`] when a database is already attached or the thread cannot start.
    pub fn start_ledger(
        &self,
        store: &Arc<ledger::store::Store>,
        db: ledger::db::Db,
    ) -> crate::error::Result<ledger::store::Writer> {
        if self.ledger_store.set(store.clone()).is_err() {
            return Err(crate::error::Error::Task(
                "the registry already has a ledger".into(),
            ));
        }
        let (take, back) = (self.clone(), self.clone());
        store.start(
            db,
            move || take.lock().ledger.take(),
            move |batch| back.lock().ledger.give_back(batch),
        )
    }

    /// The ledger's database, once attached.
    pub fn ledger(&self) -> Option<Arc<ledger::store::Store>> {
        self.ledger_store.get().cloned()
    }

    /// Bytes moved on `shard` for `worker`: a push frame received (`up`), a parameter frame
    /// sent (`down`).
    pub fn traffic(&self, shard: u32, worker: Option<u64>, up: usize, down: usize) {
        let mut g = self.lock();
        let (up, down) = (up as u64, down as u64);
        let add = |c: &mut Counters| {
            c.bytes_up += up;
            c.bytes_down += down;
        };
        if let Some(c) = g.shards.get_mut(shard as usize) {
            add(c);
        }
        add(&mut g.totals);
        if let Some(w) = worker.and_then(|id| g.workers.get_mut(&id)) {
            add(&mut w.counters);
        }
    }

    /// `worker` reported its measurements (`Report` on shard 0).
    pub fn reported(
        &self,
        worker: u64,
        report: &crowdgrad_core::wire::Report,
        encodings: (
            crowdgrad_core::codec::Encoding,
            crowdgrad_core::codec::Encoding,
        ),
    ) {
        let mut g = self.lock();
        g.ledger.reported(worker, report.compute_s);
        if let Some(f) = &mut g.feed {
            f.reported(worker, report.compute_s);
        }
        let Some(w) = g.workers.get_mut(&worker) else {
            return;
        };
        let v = w.exchange.get_or_insert_with(ExchangeView::default);
        v.local_steps = report.local_steps;
        v.pull_encoding = encodings.0.name().into();
        v.push_encoding = encodings.1.name().into();
        let finite = |x: f64| if x.is_finite() { x.max(0.0) } else { 0.0 };
        let (wall, compute) = (finite(report.wall_s), finite(report.compute_s));
        v.compute_share = if wall > 0.0 {
            (compute / wall).min(1.0)
        } else {
            0.0
        };
        v.exchange_s = finite(report.exchange_s);
        if let Some((t, up, down)) = v.last {
            let dt = wall - t;
            if dt > 0.0 {
                v.up_bps = report.bytes_up.saturating_sub(up) as f64 / dt;
                v.down_bps = report.bytes_down.saturating_sub(down) as f64 / dt;
            }
        }
        v.last = Some((wall, report.bytes_up, report.bytes_down));
        w.last_seen = Some(Instant::now());
    }

    /// `pushes` buffered pushes of `worker` were dropped from `shard`'s pending sync round (it
    /// was quarantined): counted per shard, per worker and in the totals.
    pub fn dropped(&self, shard: u32, worker: u64, pushes: usize) {
        let n = pushes as u64;
        let mut g = self.lock();
        if let Some(c) = g.shards.get_mut(shard as usize) {
            c.pushes_dropped += n;
        }
        g.totals.pushes_dropped += n;
        if let Some(w) = g.workers.get_mut(&worker) {
            w.counters.pushes_dropped += n;
        }
    }

    /// A frame that is not a push was refused on `shard` with `code` (from `worker`, `None`
    /// before Hello): counted per shard, per worker and in the totals as `frames_rejected`,
    /// never as a rejected push.
    pub fn frame_rejected(&self, shard: u32, worker: Option<u64>, code: ErrorCode) {
        let mut g = self.lock();
        if let Some(c) = g.shards.get_mut(shard as usize) {
            c.reject_frame(code);
        }
        g.totals.reject_frame(code);
        if let Some(w) = worker.and_then(|id| g.workers.get_mut(&id)) {
            w.counters.reject_frame(code);
            w.last_seen = Some(Instant::now());
            w.last_rejection = Some(code.name().to_string());
        }
    }

    /// The newest `n` entries of the server's read log, oldest first.
    pub fn reads(&self, n: usize) -> Vec<ReadEntry> {
        let g = self.lock();
        g.reads
            .iter()
            .skip(g.reads.len().saturating_sub(n))
            .copied()
            .collect()
    }

    /// Histogram of read skew over all workers' steps (buckets as for staleness).
    pub fn read_skew_hist(&self) -> Vec<u64> {
        self.lock().read_skew_hist.clone()
    }

    /// Snapshot of the [`RECENT_WORKERS`] newest workers (newest first), the shard counters,
    /// and the totals with [`Counters::workers`] filled in.
    pub fn view(&self) -> (Vec<WorkerRecord>, Vec<Counters>, Counters) {
        let g = self.lock();
        let now = Instant::now();
        let recent = g
            .workers
            .values()
            .rev()
            .take(RECENT_WORKERS)
            .map(|w| present(w, now))
            .collect();
        let mut totals = g.totals.clone();
        totals.workers = Some(g.tally.totals());
        (recent, g.shards.clone(), totals)
    }

    /// [`Registry::view`] without the workers: the shard counters and the totals (with
    /// [`Counters::workers`]), copied out under the lock and nothing else (the dashboard tick).
    pub fn summary(&self) -> (Vec<Counters>, Counters) {
        let g = self.lock();
        let mut totals = g.totals.clone();
        totals.workers = Some(g.tally.totals());
        (g.shards.clone(), totals)
    }

    /// The per-kind counts recomputed by walking every worker: what [`Registry::summary`]
    /// keeps incrementally (tests compare the two).
    #[cfg(test)]
    fn recount(&self) -> WorkerTotals {
        let g = self.lock();
        let mut by_kind = WorkerTotals::default();
        // Volunteer key -> whether any of its threads is connected.
        let mut volunteers: HashMap<&str, bool> = HashMap::new();
        for w in g.workers.values() {
            let connected = w.shards_connected > 0;
            by_kind.count(w.client, connected);
            match &w.threads {
                Some(t) => *volunteers.entry(t.volunteer.as_str()).or_default() |= connected,
                None => {
                    by_kind.volunteers.registered += 1;
                    by_kind.volunteers.connected += u64::from(connected);
                }
            }
        }
        by_kind.volunteers.registered += volunteers.len() as u64;
        by_kind.volunteers.connected += volunteers.values().filter(|&&c| c).count() as u64;
        by_kind
    }

    /// Workers newest first, skipping `offset` and taking at most `limit` (capped at
    /// [`MAX_PAGE`]); `offset` past the end gives an empty page.
    pub fn workers(&self, offset: usize, limit: usize) -> WorkersPage {
        let g = self.lock();
        let now = Instant::now();
        let limit = limit.min(MAX_PAGE);
        WorkersPage {
            total: g.workers.len(),
            offset,
            limit,
            workers: g
                .workers
                .values()
                .rev()
                .skip(offset)
                .take(limit)
                .map(|w| present(w, now))
                .collect(),
        }
    }
}

/// One page of workers, the body of `GET /api/workers`.
#[derive(Debug, Clone, Serialize)]
pub struct WorkersPage {
    /// Workers registered now (all pages).
    pub total: usize,
    /// Workers skipped (newest first).
    pub offset: usize,
    /// Largest page asked for (after the cap).
    pub limit: usize,
    /// This page, newest first.
    pub workers: Vec<WorkerRecord>,
}

/// `w` as reported at `now`: connected flag and ages filled in.
fn present(w: &WorkerRecord, now: Instant) -> WorkerRecord {
    let mut w = w.clone();
    w.connected = w.shards_connected > 0;
    w.last_seen_s = w
        .last_seen
        .map_or(0.0, |t| now.duration_since(t).as_secs_f64());
    w.joined_s = w
        .joined
        .map_or(0.0, |t| now.duration_since(t).as_secs_f64());
    w
}

/// The join admission bound (issue 21): how many identities may be on probation at once.
pub mod admission {
    /// A worker joined less than this many seconds ago is on probation (besides the shards'
    /// own trust rule, `crowdgrad_core::session`'s guard). 10 s, not the 30 s of before
    /// (issue 18): what bounds a sybil crowd is the ratio of new identities to established
    /// ones (an established one has had a push applied: under spot checks, a held push that
    /// passed its check), not how long the newcomers wait; with 30 s a crowd of 10,000 fresh
    /// volunteers took 132 s to get in from a standing start.
    pub const PROBATION_S: f64 = 10.0;
    /// New identities always admitted, whatever the number of established ones (a run starts
    /// with none established): the default of `serve --admission-floor`. 1,024: a classroom
    /// or a churn test (1,000 joins within seconds, tests/integration/churn.rs) starts at
    /// once; sybils beyond it wait for the established workers they would have to outnumber.
    /// From a standing start the crowd can then double every [`PROBATION_S`] or so (plus the
    /// time to a first applied push) (docs/benchmarks.md, "Crowd").
    pub const FLOOR: usize = crate::config::ADMISSION_FLOOR;
    /// Beyond [`FLOOR`], at most this many new identities per established worker.
    pub const PER_ESTABLISHED: usize = 1;

    /// Whether one more worker may join with `new` on probation and `established` workers:
    /// `new < max(floor, PER_ESTABLISHED × established)`, `floor` being [`FLOOR`] unless the
    /// host set `--admission-floor`. A crowd of fresh identities can never outnumber the
    /// established workers by more than the floor, so sybils must earn their standing over
    /// time, not by joining fast.
    pub fn admits(new: usize, established: usize, floor: usize) -> bool {
        new < floor.max(PER_ESTABLISHED.saturating_mul(established))
    }
}

#[cfg(test)]
mod tests;
