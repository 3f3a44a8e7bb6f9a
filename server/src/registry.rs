//! Who is connected and what happened to every frame: per worker and per shard counters of
//! pulls, applied and rejected pushes (by reason), samples and staleness. Everything
//! `/api/status` shows comes from here and from the shards' versions.

use crate::shard::Read;
use crowdgrad_core::shard::Outcome;
use crowdgrad_core::wire::{ClientKind, ErrorCode};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// Staleness histogram buckets: 0, 1, ..., 15 exactly, then `16+`.
pub const STALENESS_BUCKETS: usize = 17;

/// Counters shared by shards and workers.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Counters {
    /// Pull requests served.
    pub pulls: u64,
    /// Pushes applied (in sync mode: accepted into an aggregate).
    pub pushes_applied: u64,
    /// Sync mode: pushes buffered for an aggregate (included in `pushes_applied`).
    pub pushes_buffered: u64,
    /// Pushes (or other frames) rejected.
    pub pushes_rejected: u64,
    /// Rejections by error code name.
    pub rejected_by_reason: BTreeMap<&'static str, u64>,
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
    /// Data partition assigned.
    pub partition: usize,
    /// Shard connections open now.
    pub shards_connected: u32,
    /// Whether it has any connection open.
    pub connected: bool,
    /// Seconds since it was last heard from.
    pub last_seen_s: f64,
    /// Seconds since it joined.
    pub joined_s: f64,
    /// Last rejection reason.
    pub last_rejection: Option<String>,
    /// What it did.
    #[serde(flatten)]
    pub counters: Counters,
    #[serde(skip)]
    last_read: Vec<Option<u64>>,
    #[serde(skip)]
    joined: Option<Instant>,
    #[serde(skip)]
    last_seen: Option<Instant>,
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
    workers: HashMap<u64, WorkerRecord>,
    shards: Vec<Counters>,
    totals: Counters,
    reads: VecDeque<ReadEntry>,
    read_skew_hist: Vec<u64>,
    epoch: Option<Instant>,
}

/// Cheap-to-clone handle to the registry.
#[derive(Debug, Clone)]
pub struct Registry {
    inner: Arc<Mutex<Inner>>,
    capacity: usize,
}

/// Workers not seen for this long while disconnected are forgotten.
const FORGET_AFTER_S: f64 = 600.0;

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
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Critical sections only update counters; a poisoned lock still holds usable counters.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a worker; returns its id and partition index, or `None` when full.
    pub fn join(
        &self,
        client: ClientKind,
        name: Option<String>,
        partitions: usize,
    ) -> Option<(u64, usize)> {
        let mut g = self.lock();
        let now = Instant::now();
        if g.workers.len() >= self.capacity {
            g.workers.retain(|_, w| {
                w.shards_connected > 0
                    || w.last_seen
                        .is_none_or(|t| now.duration_since(t).as_secs_f64() < FORGET_AFTER_S)
            });
            if g.workers.len() >= self.capacity {
                return None;
            }
        }
        let id = g.next_id;
        g.next_id += 1;
        let partition = ((id - 1) as usize) % partitions.max(1);
        g.workers.insert(
            id,
            WorkerRecord {
                id,
                client,
                name,
                partition,
                shards_connected: 0,
                connected: false,
                last_seen_s: 0.0,
                joined_s: 0.0,
                last_rejection: None,
                counters: Counters::default(),
                last_read: Vec::new(),
                joined: Some(now),
                last_seen: Some(now),
            },
        );
        Some((id, partition))
    }

    /// True when `id` was handed out and not forgotten.
    pub fn knows(&self, id: u64) -> bool {
        self.lock().workers.contains_key(&id)
    }

    /// A worker opened (`+1`) or closed (`-1`) a shard connection.
    pub fn connection(&self, worker: u64, opened: bool) {
        if let Some(w) = self.lock().workers.get_mut(&worker) {
            if opened {
                w.shards_connected += 1;
            } else {
                w.shards_connected = w.shards_connected.saturating_sub(1);
            }
            w.last_seen = Some(Instant::now());
        }
    }

    /// A pull was served on `shard`: logs the read and, once the worker has read every shard
    /// since its last complete step, its read skew.
    pub fn pulled(&self, shard: u32, worker: Option<u64>, read: &Read) {
        let mut g = self.lock();
        let shards = g.shards.len();
        if let Some(c) = g.shards.get_mut(shard as usize) {
            c.pulls += 1;
        }
        let Some(id) = worker else { return };
        let time_s = g.epoch.map_or(0.0, |e| e.elapsed().as_secs_f64());
        if g.reads.len() >= READ_LOG {
            g.reads.pop_front();
        }
        g.reads.push_back(ReadEntry {
            time_s,
            worker: id,
            shard,
            version: read.snapshot.version,
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
                *slot = Some(read.snapshot.version);
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

    /// Records a push outcome (or any rejected frame) on `shard` from `worker`. Samples count
    /// once per step: on shard 0.
    pub fn pushed(&self, shard: u32, worker: Option<u64>, outcome: &Outcome, samples: u32) {
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
    }

    /// The server's read log, oldest first.
    pub fn reads(&self) -> Vec<ReadEntry> {
        self.lock().reads.iter().copied().collect()
    }

    /// Histogram of read skew over all workers' steps (buckets as for staleness).
    pub fn read_skew_hist(&self) -> Vec<u64> {
        self.lock().read_skew_hist.clone()
    }

    /// Snapshot of the workers (newest first), shard counters and totals.
    pub fn view(&self) -> (Vec<WorkerRecord>, Vec<Counters>, Counters) {
        let g = self.lock();
        let now = Instant::now();
        let mut workers: Vec<WorkerRecord> = g
            .workers
            .values()
            .map(|w| {
                let mut w = w.clone();
                w.connected = w.shards_connected > 0;
                w.last_seen_s = w
                    .last_seen
                    .map_or(0.0, |t| now.duration_since(t).as_secs_f64());
                w.joined_s = w
                    .joined
                    .map_or(0.0, |t| now.duration_since(t).as_secs_f64());
                w
            })
            .collect();
        workers.sort_by_key(|w| std::cmp::Reverse(w.id));
        (workers, g.shards.clone(), g.totals.clone())
    }
}
