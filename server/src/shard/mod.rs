//! A parameter shard: one contiguous key range of the flat vector, served over WebSockets.
//!
//! The rules live in core ([`crowdgrad_core::session`]); this is their storage for a
//! multi-threaded server:
//! - the shared [`ShardState`] sits behind a mutex that is held for one decision or one
//!   update (tens of microseconds for 100k parameters), never across an await;
//! - every update publishes an immutable [`Snapshot`] through an `ArcSwap`, and async pulls are
//!   encoded from that snapshot without taking the mutex: pulls never wait for pushes;
//! - every change a waiting pull may wait for (a version, an SSP clock) bumps a `watch`
//!   channel, which wakes the handlers of parked pulls ([`crate::shard::handler`]).
//!
//! Pushes are applied inline by the connection that received them, serialised by the mutex,
//! rather than handed to a writer thread (ps-lite's receive thread); applying inline measured
//! ~25% less server CPU per step (two thread hand-offs per push fewer), see
//! docs/benchmarks.md.

pub mod demo;
pub mod expiry;
pub mod frames;
pub mod handler;
pub mod report;
pub mod socket;
pub mod upgrade;
pub mod writer;

use crate::registry::Registry;
use arc_swap::ArcSwap;
use crowdgrad_core::codec::{Encoding, DEFAULT_INT8_BLOCK};
use crowdgrad_core::partition::KeyRange;
use crowdgrad_core::session::{
    Admission, Sampling, ShardAccess, ShardConfig, ShardSetup, ShardState,
};
use crowdgrad_core::shard::{Consistency, ShardCore, ShardExport};
use crowdgrad_core::wire::ParamsBody;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// An immutable view of a shard's values at one version.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Number of updates applied to reach these values.
    pub version: u64,
    /// Samples in those updates ([`ShardState`]'s core's `samples`).
    pub samples: u64,
    /// The values of the shard's key range.
    pub values: Arc<Vec<f32>>,
    /// The values as `Params` bodies, one per wire encoding, each encoded by the first pull
    /// that asks for it and shared by every later pull of this version (issue 18: a frame
    /// was quantised and copied per pull and per connection). Dropped with the snapshot.
    params: Arc<[OnceLock<ParamsBody>; 3]>,
}

impl Snapshot {
    /// The snapshot of `values` at `version` after `samples`, nothing encoded yet.
    pub fn new(version: u64, samples: u64, values: Arc<Vec<f32>>) -> Self {
        Self {
            version,
            samples,
            values,
            params: Arc::new(Default::default()),
        }
    }

    /// The values as the body of a `Params` frame in `encoding`: encoded once per snapshot and
    /// encoding, then shared. Concurrent first pulls of one encoding wait for the one that
    /// encodes (a copy's worth of time) rather than each encoding it.
    pub fn params_body(&self, encoding: Encoding) -> ParamsBody {
        let slot = match encoding {
            Encoding::F32 => 0,
            Encoding::Bf16 => 1,
            Encoding::Int8Block { block } if block == DEFAULT_INT8_BLOCK => 2,
            // Not a wire encoding (frames carry blocks of the default size): not kept.
            Encoding::Int8Block { .. } => {
                return ParamsBody::encode_or_f32(
                    encoding,
                    self.version,
                    self.samples,
                    &self.values,
                )
            }
        };
        self.params[slot]
            .get_or_init(|| {
                ParamsBody::encode_or_f32(encoding, self.version, self.samples, &self.values)
            })
            .clone()
    }
}

struct Inner {
    cfg: ShardConfig,
    /// The consistency mode now (the state's, copied here so async pulls read it without the
    /// mutex; [`Shard::set_consistency`] changes both under the mutex).
    mode: ArcSwap<Consistency>,
    current: ArcSwap<Snapshot>,
    state: Mutex<ShardState>,
    /// The state's epoch, for handlers whose pull waits.
    epoch_tx: watch::Sender<u64>,
    started: Instant,
    /// Time each update spends in the apply, for `/metrics`.
    apply_seconds: prometheus_client::metrics::histogram::Histogram,
    /// Frame bytes received from / sent to workers, for `/metrics`.
    bytes_received: AtomicU64,
    bytes_sent: AtomicU64,
    /// The state's [`ShardState::demand`] (the bytes of one Params frame to every connected
    /// session), copied after every change so paced pulls and the status read it without the
    /// mutex.
    demand: AtomicU64,
    /// When set, a Hello is admitted by its credential (`crate::support::credential::verify` under this
    /// run secret) instead of by the registry: how a shard process admits workers that joined
    /// at the coordinator.
    secret: std::sync::OnceLock<Vec<u8>>,
    /// Set when this process's registry holds every join (`serve`'s own shards): a
    /// credential is then good only while its worker is registered, so it expires with the
    /// session (a worker forgotten after 10 minutes away must join again).
    joins_here: std::sync::OnceLock<()>,
    /// Set on a shard process (`crowdgrad shard`), which sees no joins: a credential expires
    /// once its worker has not been connected here for a while ([`expiry`]).
    expiry: std::sync::OnceLock<expiry::Expiry>,
    /// Reputation and spot checks ([`crate::defence::spotcheck`]), set once at start.
    defence: std::sync::OnceLock<crate::defence::spotcheck::Defence>,
    /// A teacher's demonstrations ([`demo`]), set once at start by the coordinator.
    demo: std::sync::OnceLock<Arc<demo::Demo>>,
}

/// Cheap-to-clone handle to one shard (like mini-redis' `Db`).
#[derive(Clone)]
pub struct Shard {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shard")
            .field("id", &self.inner.cfg.id)
            .field("range", &self.inner.cfg.range)
            .field("version", &self.version())
            .finish()
    }
}

impl Inner {
    /// Publishes the state's values as the current snapshot, a new version (a push applied, a
    /// restart, a rollback): kept for spot checks first, before any worker can read it.
    fn publish(&self, st: &mut ShardState) {
        if let Some(spot) = self.defence.get().and_then(|d| d.spot.as_ref()) {
            // The version the history let go is the next update's buffer: no allocation
            // per push for the history (docs/benchmarks.md, "End to end before and after
            // issue 18").
            let (version, samples) = (st.version(), st.core().samples());
            if let Some(old) = spot.record(self.cfg.id, version, samples, st.values().clone()) {
                st.recycle(old);
            }
        }
        self.current.store(Arc::new(Snapshot::new(
            st.version(),
            st.core().samples(),
            st.values().clone(),
        )));
    }
}

impl Shard {
    /// Starts shard `id` over `range` with `initial` values.
    ///
    /// # Errors
    /// [`crate::Error::Config`] when `setup` cannot run at this size (a robust `sync:K` round
    /// over the memory bound), or `initial` does not have `range.len()` values.
    pub fn start(
        id: u32,
        range: KeyRange,
        initial: Vec<f32>,
        setup: ShardSetup,
    ) -> crate::Result<Self> {
        let core = setup.core(initial);
        Self::with_core(id, range, core, setup)
    }

    /// Starts shard `id` over `range` from a checkpoint's export of it (values, optimizer
    /// state, version, and the moving average when `setup` keeps one with the same decay):
    /// versions continue from there.
    ///
    /// # Errors
    /// When the export does not fit the range or the optimizer ([`ShardCore::restore`]).
    pub fn restore(
        id: u32,
        range: KeyRange,
        saved: ShardExport,
        setup: ShardSetup,
    ) -> crate::Result<Self> {
        match (saved.average.as_ref().map(|a| a.decay), setup.average) {
            (Some(was), now) if now != Some(was) => tracing::warn!(
                shard = id,
                "the checkpoint's moving average (ema {was}) is not continued: this run has {}; \
                 it evaluates from the live weights",
                now.map_or("no --ema".to_string(), |d| format!("--ema {d}"))
            ),
            (None, Some(d)) => tracing::info!(
                shard = id,
                "the checkpoint holds no moving average: --ema {d} starts from its weights"
            ),
            _ => {}
        }
        let core = ShardCore::restore(saved, setup.optimizer, setup.staleness, setup.consistency)?
            .with_aggregation(setup.aggregation)
            .with_average(setup.average);
        Self::with_core(id, range, core, setup)
    }

    /// Pauses or resumes pushes (the admin API; a paused shard answers pushes `busy`).
    pub fn set_paused(&self, paused: bool) {
        self.state().set_paused(paused);
    }

    /// Sets the learning rate from the next update on (the admin API).
    ///
    /// # Errors
    /// A learning rate that is not finite and positive; nothing changes.
    pub fn set_lr(&self, lr: f32) -> crate::Result<()> {
        Ok(self.state().set_lr(lr)?)
    }

    /// What a checkpoint keeps of this shard, taken under its lock (the values' `Arc` and a
    /// copy of the optimizer state: a memory copy, no I/O).
    pub fn export(&self) -> ShardExport {
        self.state().core().export()
    }

    fn with_core(
        id: u32,
        range: KeyRange,
        core: ShardCore,
        setup: ShardSetup,
    ) -> crate::Result<Self> {
        let cfg = setup.config(id, range);
        let (version, samples, values) = (core.version(), core.samples(), core.values().clone());
        let state = ShardState::new(cfg, core)?;
        Ok(Self {
            inner: Arc::new(Inner {
                cfg,
                mode: ArcSwap::from_pointee(cfg.setup.consistency),
                current: ArcSwap::from_pointee(Snapshot::new(version, samples, values)),
                state: Mutex::new(state),
                epoch_tx: watch::channel(0).0,
                started: Instant::now(),
                apply_seconds: crate::registry::metrics::apply_histogram(),
                bytes_received: AtomicU64::new(0),
                bytes_sent: AtomicU64::new(0),
                demand: AtomicU64::new(0),
                secret: std::sync::OnceLock::new(),
                joins_here: std::sync::OnceLock::new(),
                expiry: std::sync::OnceLock::new(),
                defence: std::sync::OnceLock::new(),
                demo: std::sync::OnceLock::new(),
            }),
        })
    }

    /// The shard's description (what every session of it is created with).
    pub fn config(&self) -> ShardConfig {
        self.inner.cfg
    }

    /// Shard index.
    pub fn id(&self) -> u32 {
        self.inner.cfg.id
    }

    /// Key range.
    pub fn range(&self) -> KeyRange {
        self.inner.cfg.range
    }

    /// Consistency mode now (the run's, or the one the admin API switched to).
    pub fn consistency(&self) -> Consistency {
        **self.inner.mode.load()
    }

    /// Switches the consistency mode for every session of this shard (the admin API): see
    /// [`ShardState::set_consistency`] for which changes are safe. A pending sync aggregate is
    /// applied first and published; parked pulls are woken to re-check under the new mode.
    ///
    /// # Errors
    /// An unsafe change, with the reason; nothing changes.
    pub fn set_consistency(&self, mode: Consistency) -> std::result::Result<(), String> {
        let inner = &self.inner;
        let epoch = {
            let mut st = self.state();
            let v0 = st.version();
            st.set_consistency(mode)?;
            inner.mode.store(Arc::new(mode));
            if st.version() != v0 {
                inner.publish(&mut st);
            }
            st.epoch()
        };
        inner.epoch_tx.send_replace(epoch);
        Ok(())
    }

    /// Current version.
    pub fn version(&self) -> u64 {
        self.inner.current.load().version
    }

    /// The current snapshot (lock-free; never waits for an update).
    pub fn snapshot(&self) -> Snapshot {
        Snapshot::clone(&self.inner.current.load())
    }

    /// What the run evaluates and exports: with `--ema` the moving average of the values
    /// (taken under the state lock, an `Arc` clone: the next update copies the average while
    /// the caller holds it), else the current snapshot's values without the lock; and the
    /// version.
    pub fn evaluated(&self) -> (u64, Arc<Vec<f32>>) {
        if self.inner.cfg.setup.average.is_some() {
            let st = self.state();
            if let Some(avg) = st.core().average() {
                return (st.version(), avg.clone());
            }
        }
        let snap = self.snapshot();
        (snap.version, snap.values)
    }

    /// Updates applied so far, keyed by how many gradients each merged (sync mode: K for a full
    /// aggregate, fewer for an early flush; 1 in the other modes).
    pub fn updates(&self) -> BTreeMap<usize, u64> {
        self.state().updates().clone()
    }

    /// The version and the updates applied so far (as [`Shard::updates`]), read together under
    /// the state lock: the version is the number of applied updates, so a status built from
    /// this never shows one count ahead of the other.
    pub fn progress(&self) -> (u64, u64, BTreeMap<usize, u64>) {
        let st = self.state();
        (st.version(), st.core().samples(), st.updates().clone())
    }

    /// Largest frame this shard accepts: a full push plus meta.
    pub fn frame_limit(&self) -> usize {
        self.inner.cfg.frame_limit()
    }

    /// Seconds since the shard started: the clock its sessions run on.
    pub fn now(&self) -> f64 {
        self.inner.started.elapsed().as_secs_f64()
    }

    /// The instant `t` (seconds on [`Shard::now`]'s clock) stands for.
    pub fn instant(&self, t: f64) -> Instant {
        // Clamped: a deadline is at most a few seconds out; a huge one must not overflow.
        self.inner.started + Duration::from_secs_f64(t.clamp(0.0, 1e9))
    }

    /// A receiver that changes whenever a waiting pull may have become answerable.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.inner.epoch_tx.subscribe()
    }

    /// Admit Hellos by their credential under `secret` from now on (set once; later calls are
    /// ignored).
    pub fn require_credential(&self, secret: Vec<u8>) {
        let _ = self.inner.secret.set(secret);
    }

    /// This process's registry holds every join (the coordinator's own shards): from now on
    /// a credential admits only while its worker is registered (set once).
    pub fn credentials_expire_with_joins(&self) {
        let _ = self.inner.joins_here.set(());
    }

    /// This process sees no joins (a shard process): from now on a credential admits only
    /// until its worker has been away from this shard for `after` ([`expiry`]; set once).
    pub fn expire_credentials(&self, after: std::time::Duration) {
        let _ = self
            .inner
            .expiry
            .set(expiry::Expiry::new(after, expiry::MAX_REMEMBERED));
    }

    /// `worker`'s socket on this shard closed (the expiry clock of a shard process).
    pub fn left(&self, worker: u64) {
        if let Some(e) = self.inner.expiry.get() {
            e.left(worker, Instant::now());
        }
    }

    /// Report to `defence` from now on: refuse quarantined workers, spot-check sampled
    /// pushes (set once; later calls are ignored). When it can quarantine, `sync:K` rounds
    /// keep their pushes apart so an expelled worker's are dropped before the round applies
    /// ([`ShardState::set_droppable`]).
    ///
    /// # Errors
    /// When K pushes of this shard kept apart would take too much memory (nothing is set).
    pub fn set_defence(
        &self,
        defence: crate::defence::spotcheck::Defence,
    ) -> crowdgrad_core::Result<()> {
        self.state().set_droppable(defence.can_quarantine())?;
        let _ = self.inner.defence.set(defence);
        Ok(())
    }

    /// `zeno`: this shard's slice of the validation gradient ([`ShardState::set_reference`],
    /// kept fresh by [`crate::coordinator::zeno`]).
    pub fn set_reference(&self, slice: &[f32]) {
        self.state().set_reference(slice);
    }

    /// The server's own per-step gradient norm for this shard's slice at the current
    /// parameters ([`ShardState::set_norm_anchor`], kept fresh by
    /// [`crate::coordinator::anchor`]).
    pub fn set_norm_anchor(&self, norm: f32) {
        let now = self.now();
        self.state().set_norm_anchor(norm, now);
    }

    /// The norm reference now, and the workers with a say in it and on probation
    /// ([`ShardState::norm_reference`]): for the server's own status, never for a refusal.
    pub fn norm_reference(&self) -> (Option<f32>, usize, usize) {
        let now = self.now();
        let mut st = self.state();
        let (trusted, probation) = st.trust_counts(now);
        (st.norm_reference(now), trusted, probation)
    }

    /// Carry out the demonstrations of `demo` from now on (set once; later calls are
    /// ignored).
    pub fn set_demo(&self, demo: Arc<demo::Demo>) {
        let _ = self.inner.demo.set(demo);
    }

    /// The demonstrations, once set.
    pub fn demo(&self) -> Option<&demo::Demo> {
        self.inner.demo.get().map(|d| &**d)
    }

    /// Starts over from `values` (the next experiment, issue 19): fresh optimizer state, the
    /// pending sync round dropped, the version moved on by one so no push computed before is
    /// taken as fresh; connections, clocks and the replay log stay. Published at once.
    ///
    /// # Errors
    /// When `values` does not have the shard's length; nothing changes.
    pub fn restart(&self, values: Vec<f32>) -> crate::Result<()> {
        let inner = &self.inner;
        let epoch = {
            let mut st = self.state();
            st.restart(values)?;
            inner.publish(&mut st);
            st.epoch()
        };
        inner.epoch_tx.send_replace(epoch);
        Ok(())
    }

    /// Rolls back to `values`, the parameters of version `target`, after poison was detected
    /// ([`ShardState::roll_back`]): they are published at once as the next version, kept for
    /// spot checks, and `poisoner`'s norms leave the reference. Returns the version before
    /// and the one published; `None` (nothing done) when the shard is still at `target`.
    ///
    /// # Errors
    /// When `values` does not have the shard's length; nothing changes.
    pub fn roll_back(
        &self,
        values: Vec<f32>,
        target: u64,
        poisoner: u64,
    ) -> crate::Result<Option<(u64, u64)>> {
        let inner = &self.inner;
        let (before, after, epoch) = {
            let mut st = self.state();
            let before = st.version();
            if before <= target {
                return Ok(None);
            }
            st.roll_back(values, poisoner)?;
            inner.publish(&mut st);
            inner.demand.store(st.demand(), Ordering::Relaxed);
            (before, st.version(), st.epoch())
        };
        inner.epoch_tx.send_replace(epoch);
        Ok(Some((before, after)))
    }

    /// A held push whose spot check passed ([`ShardState::apply_held`]), applied now and
    /// published like any push; returns its outcome and whether it was nonzero.
    pub fn apply_held(
        &self,
        push: &crowdgrad_core::session::SampledPush,
    ) -> (crowdgrad_core::shard::Outcome, bool) {
        let inner = &self.inner;
        let now = self.now();
        let (r, epoch) = {
            let mut st = self.state();
            let (v0, e0) = (st.version(), st.epoch());
            let r = st.apply_held(push, now);
            if st.version() != v0 {
                inner.publish(&mut st);
            }
            inner.demand.store(st.demand(), Ordering::Relaxed);
            (r, (st.epoch() != e0).then(|| st.epoch()))
        };
        if let Some(e) = epoch {
            inner.epoch_tx.send_replace(e);
        }
        r
    }

    /// [`ShardState::vouch`] for `worker`.
    pub fn vouch(&self, worker: u64) {
        let now = self.now();
        self.state().vouch(worker, now);
    }

    /// What the spot checker holds of this shard: a weak handle (the shard holds the
    /// checker, so a strong one would keep both alive for ever).
    pub fn control(&self) -> Box<dyn crate::defence::spotcheck::ShardControl> {
        Box::new(Control(Arc::downgrade(&self.inner)))
    }

    /// Reputation and spot checks, once set.
    pub fn defence(&self) -> Option<&crate::defence::spotcheck::Defence> {
        self.inner.defence.get()
    }

    /// The histogram of time spent applying updates (a handle on the live one).
    pub fn apply_seconds(&self) -> prometheus_client::metrics::histogram::Histogram {
        self.inner.apply_seconds.clone()
    }

    /// Counts the bytes of frames received from (`up`) and sent to (`down`) workers.
    pub fn count_bytes(&self, up: usize, down: usize) {
        if up > 0 {
            self.inner
                .bytes_received
                .fetch_add(up as u64, Ordering::Relaxed);
        }
        if down > 0 {
            self.inner
                .bytes_sent
                .fetch_add(down as u64, Ordering::Relaxed);
        }
    }

    /// The shard's pace now, seconds (0 without an egress budget): its sessions' Params bytes
    /// over its share of the budget (issue 18, [`crowdgrad_core::shard::pace`]). Lock-free.
    pub fn pace_s(&self) -> f64 {
        let cfg = &self.inner.cfg;
        let demand = self.inner.demand.load(Ordering::Relaxed);
        cfg.setup.pacing.pace_s(cfg.range.len(), demand)
    }

    /// This shard's share of the run's egress budget, bytes per second (`None`: no budget).
    pub fn egress_budget(&self) -> Option<f64> {
        let cfg = &self.inner.cfg;
        cfg.setup.pacing.shard_budget(cfg.range.len())
    }

    /// Frame bytes received from and sent to workers so far.
    pub fn bytes(&self) -> (u64, u64) {
        (
            self.inner.bytes_received.load(Ordering::Relaxed),
            self.inner.bytes_sent.load(Ordering::Relaxed),
        )
    }

    fn state(&self) -> MutexGuard<'_, ShardState> {
        // Critical sections never panic midway; a poisoned lock still holds a usable state.
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// This shard as its sessions see it, with `registry` answering who joined.
    pub fn access<'a>(&'a self, registry: &'a Registry) -> Access<'a> {
        Access {
            shard: self,
            registry,
            held: None,
            drawn: None,
            placed: None,
        }
    }
}

/// [`Shard::control`].
struct Control(std::sync::Weak<Inner>);

impl crate::defence::spotcheck::ShardControl for Control {
    fn vouch(&self, worker: u64) {
        if let Some(inner) = self.0.upgrade() {
            Shard { inner }.vouch(worker);
        }
    }

    fn apply_held(
        &self,
        push: &crowdgrad_core::session::SampledPush,
    ) -> Option<(crowdgrad_core::shard::Outcome, bool)> {
        let inner = self.0.upgrade()?;
        Some(Shard { inner }.apply_held(push))
    }

    fn roll_back(&self, values: Vec<f32>, target: u64, poisoner: u64) -> Option<(u64, u64)> {
        let inner = self.0.upgrade()?;
        Shard { inner }
            .roll_back(values, target, poisoner)
            .ok()
            .flatten()
    }
}

/// [`ShardAccess`] for one handler: the lock-free snapshot, the state mutex, the registry.
pub struct Access<'a> {
    shard: &'a Shard,
    registry: &'a Registry,
    /// The parameters a push's tag names, taken before it is applied and held until its spot
    /// check is queued or declined (one push at a time).
    held: Option<crate::defence::spotcheck::Read>,
    /// The worker whose push holds a place in the spot checker's queue, from
    /// [`ShardAccess::sample`] to [`ShardAccess::take_sample`].
    drawn: Option<u64>,
    /// The worker for whose next push the driver took a place in the spot checker's queue
    /// ([`Access::placed`]): used by [`ShardAccess::sample`] if the push is drawn, given back
    /// otherwise.
    placed: Option<u64>,
}

impl Access<'_> {
    /// The driver took a place in the spot checker's queue for `worker`'s push it feeds next
    /// (`crate::defence::spotcheck`, "Pacing").
    pub fn placed(&mut self, worker: u64) {
        self.unplace();
        self.placed = Some(worker);
    }

    /// Gives back a place the last push fed did not use (it was refused before it was
    /// sampled, or never reached sampling).
    pub fn unplace(&mut self) {
        if let Some(w) = self.placed.take() {
            if let Some(s) = self.shard.defence().and_then(|d| d.spot.as_ref()) {
                s.cancel(w);
            }
        }
    }
}

impl ShardAccess for Access<'_> {
    fn mode(&mut self) -> Consistency {
        **self.shard.inner.mode.load()
    }

    fn snapshot(&self) -> (u64, Arc<Vec<f32>>) {
        let s = self.shard.inner.current.load();
        (s.version, s.values.clone())
    }

    fn snapshot_samples(&self) -> u64 {
        self.shard.inner.current.load().samples
    }

    fn params_body(&mut self, encoding: Encoding) -> ParamsBody {
        self.shard.inner.current.load().params_body(encoding)
    }

    fn pace(&mut self) -> f64 {
        self.shard.pace_s()
    }

    fn with<R>(&mut self, f: impl FnOnce(&mut ShardState) -> R) -> R {
        let inner = &self.shard.inner;
        let (r, epoch) = {
            let mut st = self.shard.state();
            let (v0, e0) = (st.version(), st.epoch());
            let t0 = Instant::now();
            let r = f(&mut st);
            if st.version() != v0 {
                // An update was applied: its time under the lock is the apply latency.
                inner.apply_seconds.observe(t0.elapsed().as_secs_f64());
                inner.publish(&mut st);
            }
            inner.demand.store(st.demand(), Ordering::Relaxed);
            (r, (st.epoch() != e0).then(|| st.epoch()))
        };
        if let Some(e) = epoch {
            inner.epoch_tx.send_replace(e);
        }
        r
    }

    fn admit(&self, worker: u64, credential: Option<&str>) -> Admission {
        if let Some(why) = self
            .shard
            .defence()
            .and_then(|d| d.reputation.quarantined(worker))
        {
            return Admission::Quarantined(why);
        }
        match (self.shard.inner.secret.get(), credential) {
            (None, _) if self.registry.knows(worker) => Admission::Admitted,
            (None, _) => Admission::Unknown,
            (Some(secret), Some(c)) if crate::support::credential::verify(secret, worker, c) => {
                if self.shard.inner.joins_here.get().is_some()
                    && !self.registry.session_open(worker)
                {
                    // Its session ended (left and forgotten): the credential expired with it.
                    Admission::Unknown
                } else if let Some(e) = self.shard.inner.expiry.get() {
                    let connected = self.shard.state().sockets_of(worker) > 0;
                    if e.admit(worker, connected, Instant::now()) {
                        Admission::Admitted
                    } else {
                        // Away from this shard process longer than the expiry.
                        Admission::Unknown
                    }
                } else {
                    Admission::Admitted
                }
            }
            // Missing or not this worker's credential: nobody speaks as another worker. (A
            // shard process whose registry knows nobody calls a bad one unknown.)
            (Some(_), _) if self.registry.knows(worker) => Admission::BadCredential,
            (Some(_), _) => Admission::Unknown,
        }
    }

    fn spot_checks(&self) -> bool {
        self.shard.defence().is_some_and(|d| d.spot.is_some())
    }

    fn check_tag(
        &mut self,
        _worker: u64,
        tag: &crowdgrad_core::wire::PushTag,
    ) -> std::result::Result<(), String> {
        self.held = None;
        if let Some(s) = self.shard.defence().and_then(|d| d.spot.as_ref()) {
            self.held = Some(s.capture(tag)?);
        }
        Ok(())
    }

    fn sample(
        &mut self,
        worker: u64,
        request_id: u32,
        digest: u64,
        tag: &crowdgrad_core::wire::PushTag,
    ) -> Sampling {
        let placed = self.placed == Some(worker);
        if placed {
            // Used or given back by `sample`.
            self.placed = None;
        }
        let answer = match self.shard.defence().and_then(|d| d.spot.as_ref()) {
            Some(s) => s.sample(worker, request_id, digest, tag, placed),
            None => Sampling::No,
        };
        if matches!(answer, Sampling::Yes | Sampling::Hold) {
            self.drawn = Some(worker);
        } else {
            // Not checked: the versions' parameters are not kept past this push.
            self.held = None;
        }
        answer
    }

    fn take_sample(&mut self, push: Option<crowdgrad_core::session::SampledPush>) {
        let Some(s) = self.shard.defence().and_then(|d| d.spot.as_ref()) else {
            return;
        };
        let drawn = self.drawn.take();
        match (push, self.held.take()) {
            (Some(push), Some(params)) => s.submit(push, params),
            // Refused by the shard: the place held in the checker's queue is given back.
            _ => {
                if let Some(w) = drawn {
                    s.cancel(w);
                }
            }
        }
    }
}

/// A read: the version sent and, in SSP mode, the clocks it was allowed under.
#[derive(Debug, Clone)]
pub struct Read {
    /// What was read.
    pub snapshot: Snapshot,
    /// The reader's SSP clock.
    pub clock: Option<u64>,
    /// The slowest active SSP clock.
    pub min_clock: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crowdgrad_core::wire;

    #[test]
    fn a_snapshot_encodes_its_params_once_per_encoding_and_shares_them() {
        let values: Vec<f32> = (0..5000).map(|i| (i as f32).cos()).collect();
        let snap = Snapshot::new(7, 0, Arc::new(values.clone()));
        let int8 = Encoding::Int8Block {
            block: DEFAULT_INT8_BLOCK,
        };
        for enc in [Encoding::F32, Encoding::Bf16, int8] {
            let a = snap.params_body(enc);
            let b = snap.clone().params_body(enc);
            assert!(Arc::ptr_eq(&a.bytes, &b.bytes), "{enc:?} encoded twice");
            assert_eq!(
                a.frame(3, 1, 0, false),
                wire::encode_params_as(enc, 3, 1, 7, &values).unwrap()
            );
        }
        let (f, h) = (
            snap.params_body(Encoding::F32),
            snap.params_body(Encoding::Bf16),
        );
        assert!(!Arc::ptr_eq(&f.bytes, &h.bytes));
        // The next version starts with nothing encoded.
        let next = Snapshot::new(8, 0, Arc::new(values));
        assert!(!Arc::ptr_eq(
            &next.params_body(Encoding::F32).bytes,
            &f.bytes
        ));
    }
}
