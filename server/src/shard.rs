//! A parameter shard: one contiguous key range of the flat vector, served over WebSockets.
//!
//! Read semantics (documented in docs/protocol.md): the shard's state is an immutable
//! [`Snapshot`] (version + values) behind an `ArcSwap`. A pull loads the current snapshot
//! lock-free and encodes it; in `async` mode it never waits for an update. Every update is
//! computed by the shard's single writer thread into a *new* vector by
//! [`crowdgrad_core::shard::ShardCore`] (the same apply path the simulator uses), then
//! published atomically. So a pull observes the shard between two applied pushes, never a
//! half-applied push, and a push is applied whole or not at all (it is validated completely
//! before anything is touched).
//!
//! Updates are serialised by a mutex that only writers take (one validation + one update, tens of
//! microseconds for 100k parameters; never held across an await). An earlier version used a
//! writer thread fed by a channel (ps-lite's receive thread); applying inline measured ~25% less
//! server CPU per step (two thread hand-offs per push fewer), see docs/benchmarks.md.
//!
//! Consistency modes add waiting on the read side only: `ssp:S` holds a pull while the reader is
//! more than S clock ticks ahead of the slowest active worker ([`SspClock`]); `sync:K` holds a
//! pull that asks for a version the shard has not reached until K fresh gradients were averaged
//! and applied (or fewer, when fewer workers are left or they took too long: never a deadlock).

use arc_swap::ArcSwap;
use crowdgrad_core::optim::OptimizerConfig;
use crowdgrad_core::partition::KeyRange;
use crowdgrad_core::shard::{Consistency, Outcome, ShardCore, SspClock, StalenessPolicy};
use crowdgrad_core::wire::{self, ErrorCode, Message};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::{watch, Notify};

/// An immutable view of a shard's values at one version.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Number of updates applied to reach these values.
    pub version: u64,
    /// The values of the shard's key range.
    pub values: Arc<Vec<f32>>,
}

/// The writer side: only ever touched under its mutex, by one push at a time.
#[derive(Debug)]
struct Writer {
    core: ShardCore,
    scratch: Vec<f32>,
    /// Updates applied, by how many gradients each merged.
    updates: BTreeMap<usize, u64>,
}

struct Inner {
    id: u32,
    range: KeyRange,
    consistency: Consistency,
    current: ArcSwap<Snapshot>,
    writer: Mutex<Writer>,
    version_tx: watch::Sender<u64>,
    clock: Mutex<SspClock>,
    clock_moved: Notify,
    workers: AtomicUsize,
    epoch: Instant,
    sync_timeout: Duration,
}

/// Cheap-to-clone handle to one shard (like mini-redis' `Db`).
#[derive(Clone)]
pub struct Shard {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shard")
            .field("id", &self.inner.id)
            .field("range", &self.inner.range)
            .field("version", &self.version())
            .finish()
    }
}

/// How a shard is run.
#[derive(Debug, Clone, Copy)]
pub struct ShardOptions {
    /// The update rule.
    pub optimizer: OptimizerConfig,
    /// Staleness policy for async/SSP pushes.
    pub staleness: StalenessPolicy,
    /// Consistency mode.
    pub consistency: Consistency,
    /// SSP: a worker not heard from for this long drops out of the clock.
    pub heartbeat: Duration,
    /// sync: a waiting pull forces the partial aggregate through after this long.
    pub sync_timeout: Duration,
}

impl Shard {
    /// Starts shard `id` over `range` with `initial` values.
    ///
    /// # Panics
    /// If `initial` does not have `range.len()` values (a startup bug, not input).
    pub fn start(id: u32, range: KeyRange, initial: Vec<f32>, opts: ShardOptions) -> Self {
        assert_eq!(initial.len(), range.len());
        let core = ShardCore::new(initial, opts.optimizer, opts.staleness, opts.consistency);
        let bound = match opts.consistency {
            Consistency::Ssp { bound } => bound,
            _ => u64::MAX / 2,
        };
        let inner = Arc::new(Inner {
            id,
            range,
            consistency: opts.consistency,
            current: ArcSwap::from_pointee(Snapshot {
                version: 0,
                values: core.values().clone(),
            }),
            writer: Mutex::new(Writer {
                scratch: vec![0.0; core.len()],
                core,
                updates: BTreeMap::new(),
            }),
            version_tx: watch::channel(0).0,
            clock: Mutex::new(SspClock::new(bound, opts.heartbeat.as_secs_f64())),
            clock_moved: Notify::new(),
            workers: AtomicUsize::new(0),
            epoch: Instant::now(),
            sync_timeout: opts.sync_timeout,
        });
        Self { inner }
    }

    /// Shard index.
    pub fn id(&self) -> u32 {
        self.inner.id
    }

    /// Key range.
    pub fn range(&self) -> KeyRange {
        self.inner.range
    }

    /// Consistency mode.
    pub fn consistency(&self) -> Consistency {
        self.inner.consistency
    }

    /// Current version.
    pub fn version(&self) -> u64 {
        self.inner.current.load().version
    }

    /// The current snapshot (lock-free; never waits for an update).
    pub fn snapshot(&self) -> Snapshot {
        Snapshot::clone(&self.inner.current.load())
    }

    /// Updates applied so far, keyed by how many gradients each merged (sync mode: K for a full
    /// aggregate, fewer for an early flush; 1 in the other modes).
    pub fn updates(&self) -> BTreeMap<usize, u64> {
        self.writer().updates.clone()
    }

    /// Largest frame this shard accepts: a full push plus meta.
    pub fn frame_limit(&self) -> usize {
        wire::HEADER_LEN + wire::MAX_META_LEN + 4 * self.inner.range.len()
    }

    fn now(&self) -> f64 {
        self.inner.epoch.elapsed().as_secs_f64()
    }

    fn clock(&self) -> MutexGuard<'_, SspClock> {
        // Critical sections never panic midway; a poisoned lock still holds a usable clock.
        self.inner.clock.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn writer(&self) -> MutexGuard<'_, Writer> {
        self.inner.writer.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the writer state and publishes the new snapshot if it applied an update.
    /// The lock is held for one validation and one update (tens of microseconds for 100k
    /// parameters), never across an await, and readers never take it.
    fn write(&self, f: impl FnOnce(&mut Writer) -> Option<Outcome>) -> Option<Outcome> {
        let mut w = self.writer();
        let outcome = f(&mut w);
        if let Some(Outcome::Applied {
            version, merged, ..
        }) = &outcome
        {
            self.inner.current.store(Arc::new(Snapshot {
                version: *version,
                values: w.core.values().clone(),
            }));
            *w.updates.entry(*merged).or_default() += 1;
            self.inner.version_tx.send_replace(*version);
        }
        outcome
    }

    /// Sync mode: applies the partial aggregate now.
    fn flush(&self) {
        self.write(|w| w.core.flush());
    }

    /// A worker said hello on this shard.
    pub fn worker_joined(&self, worker: u64) {
        self.inner.workers.fetch_add(1, Ordering::Relaxed);
        let now = self.now();
        self.clock().join(worker, now);
        self.inner.clock_moved.notify_waiters();
    }

    /// A worker's connection to this shard closed.
    pub fn worker_left(&self, worker: u64) {
        let left = self
            .inner
            .workers
            .fetch_sub(1, Ordering::Relaxed)
            .saturating_sub(1);
        self.clock().leave(worker);
        self.inner.clock_moved.notify_waiters();
        if matches!(self.inner.consistency, Consistency::Sync { .. })
            && self.writer().core.pending() >= left
        {
            self.flush();
        }
    }

    /// A frame arrived from `worker` (its heartbeat).
    pub fn heard_from(&self, worker: u64) {
        let now = self.now();
        self.clock().seen(worker, now);
    }

    /// Validates and applies a push frame (already checked to be a `Push` of the right length
    /// for this shard) from `worker`: whole or not at all.
    pub fn push(&self, worker: Option<u64>, frame: &[u8]) -> Outcome {
        let outcome =
            self.write(|w| Some(validate_and_push(w, frame)))
                .unwrap_or(Outcome::Rejected {
                    code: ErrorCode::Busy,
                    message: "no outcome".into(),
                });
        if let (Outcome::Applied { .. } | Outcome::Buffered { .. }, Some(w)) = (&outcome, worker) {
            let now = self.now();
            self.clock().tick(w, now);
            self.inner.clock_moved.notify_waiters();
        }
        if let Outcome::Buffered { pending, .. } = outcome {
            // Fewer workers connected than K: do not wait for gradients that cannot come.
            if pending >= self.inner.workers.load(Ordering::Relaxed) {
                self.flush();
            }
        }
        outcome
    }

    /// Waits until `worker` may read under the consistency mode (SSP bound; in sync mode, until
    /// the shard reaches `min_version`), then returns the snapshot to send with the reader's and
    /// the slowest active clock at read time. In async mode it returns at once.
    pub async fn read(&self, worker: Option<u64>, min_version: u64) -> Read {
        match self.inner.consistency {
            Consistency::Async => {}
            Consistency::Ssp { .. } => {
                if let Some(w) = worker {
                    loop {
                        let notified = self.inner.clock_moved.notified();
                        let (ok, expiry) = {
                            let now = self.now();
                            let mut c = self.clock();
                            c.seen(w, now);
                            (
                                c.may_read(w, now),
                                c.next_expiry(now).map(|t| (t - now).max(0.0)),
                            )
                        };
                        if ok {
                            break;
                        }
                        let wait = Duration::from_secs_f64(expiry.unwrap_or(1.0).min(1.0) + 0.001);
                        let _ = tokio::time::timeout(wait, notified).await;
                    }
                }
            }
            Consistency::Sync { .. } => {
                let mut version = self.inner.version_tx.subscribe();
                loop {
                    if *version.borrow_and_update() >= min_version {
                        break;
                    }
                    match tokio::time::timeout(self.inner.sync_timeout, version.changed()).await {
                        Ok(Ok(())) => {}
                        Ok(Err(_)) => break,
                        // Stragglers: apply what was gathered so far (backup workers).
                        Err(_) => self.flush(),
                    }
                }
            }
        }
        let snapshot = self.snapshot();
        let (clock, min_clock) = match (worker, self.inner.consistency) {
            (Some(w), Consistency::Ssp { .. }) => {
                let now = self.now();
                self.clock().read_view(w, now)
            }
            _ => (None, None),
        };
        Read {
            snapshot,
            clock,
            min_clock,
        }
    }
}

/// A read: the snapshot and, in SSP mode, the clocks it was allowed under.
#[derive(Debug, Clone)]
pub struct Read {
    /// What was read.
    pub snapshot: Snapshot,
    /// The reader's SSP clock.
    pub clock: Option<u64>,
    /// The slowest active SSP clock.
    pub min_clock: Option<u64>,
}

fn validate_and_push(w: &mut Writer, frame: &[u8]) -> Outcome {
    let reject = |code: ErrorCode, message: String| Outcome::Rejected { code, message };
    let (base_version, grad) = match wire::decode(frame, usize::MAX) {
        Ok(Message::Push {
            base_version, grad, ..
        }) => (base_version, grad),
        Ok(_) => return reject(ErrorCode::Protocol, "not a push".into()),
        Err(e) => return reject(ErrorCode::from(&e), e.to_string()),
    };
    // Validate everything before touching state: whole or nothing.
    if let Err(e) = grad.copy_into(&mut w.scratch) {
        return reject(ErrorCode::from(&e), e.to_string());
    }
    let Writer { core, scratch, .. } = w;
    core.push(base_version, scratch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crowdgrad_core::optim::Rule;

    fn opts(staleness: StalenessPolicy) -> ShardOptions {
        ShardOptions {
            optimizer: OptimizerConfig {
                rule: Rule::Sgd,
                lr: 0.5,
                weight_decay: 0.0,
                clip_norm: None,
            },
            staleness,
            consistency: Consistency::Async,
            heartbeat: Duration::from_secs(5),
            sync_timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn push_applies_whole_or_not_at_all() {
        let range = KeyRange { start: 0, end: 3 };
        let policy = StalenessPolicy::parse("drop:1").unwrap();
        let shard = Shard::start(0, range, vec![1.0; 3], opts(policy));
        let ok = shard.push(None, &wire::encode_push(1, 0, 0, 4, &[1.0, 2.0, 3.0]));
        assert!(matches!(
            ok,
            Outcome::Applied {
                version: 1,
                staleness: 0,
                ..
            }
        ));
        assert_eq!(*shard.snapshot().values, vec![0.5, 0.0, -0.5]);
        let before = shard.snapshot();
        for bad in [
            wire::encode_push(2, 0, 1, 4, &[1.0, f32::NAN, 3.0]),
            wire::encode_push(3, 0, 1, 4, &[1.0, 2.0]),
            wire::encode_push(4, 0, 9, 4, &[1.0, 2.0, 3.0]),
        ] {
            assert!(matches!(shard.push(None, &bad), Outcome::Rejected { .. }));
        }
        shard.push(None, &wire::encode_push(5, 0, 1, 4, &[0.0; 3]));
        shard.push(None, &wire::encode_push(6, 0, 2, 4, &[0.0; 3]));
        let stale = shard.push(None, &wire::encode_push(7, 0, 1, 4, &[1.0; 3]));
        assert!(matches!(
            stale,
            Outcome::Rejected {
                code: ErrorCode::TooStale,
                ..
            }
        ));
        assert_eq!(shard.version(), 3);
        assert_eq!(
            *before.values,
            vec![0.5, 0.0, -0.5],
            "a held snapshot never changes"
        );
        assert_eq!(*shard.snapshot().values, vec![0.5, 0.0, -0.5]);
        assert_eq!(shard.updates().get(&1), Some(&3));
    }

    #[tokio::test]
    async fn sync_pull_waits_for_the_aggregate_and_never_deadlocks() {
        let mut o = opts(StalenessPolicy::default());
        o.consistency = Consistency::Sync { k: 2 };
        o.sync_timeout = Duration::from_millis(100);
        let shard = Shard::start(0, KeyRange { start: 0, end: 1 }, vec![0.0], o);
        shard.worker_joined(1);
        shard.worker_joined(2);
        let out = shard.push(Some(1), &wire::encode_push(1, 0, 0, 1, &[1.0]));
        assert!(matches!(out, Outcome::Buffered { pending: 1, .. }));
        // Worker 2 never pushes: the waiting pull forces the partial mean after the timeout.
        let t = Instant::now();
        let r = shard.read(Some(1), 1).await;
        assert_eq!(r.snapshot.version, 1);
        assert!(t.elapsed() >= Duration::from_millis(100));
        assert_eq!(*r.snapshot.values, vec![-0.5]);
        assert_eq!(
            shard.updates().get(&1),
            Some(&1),
            "a partial update of one gradient"
        );
    }
}
