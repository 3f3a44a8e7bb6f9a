//! The driver task: join, fetch data, connect, then feed the core worker socket events, send
//! its frames and call `step()` whenever it is ready, within the CPU limit. A shard whose socket
//! closes is reopened alone with backoff while the worker trains on the others (core's
//! `Worker::disconnected`, docs/protocol.md "One shard lost"), as the native worker does. Any
//! other failure, or every shard lost at once, ends the session; [`run`] then rejoins from
//! scratch after core's reconnect [`Backoff`] (the policy the native worker and the simulator
//! use too), carrying the counters over with `carry_stats`.

use super::net::Scope;
use super::socket::{ShardSocket, SocketEventKind};
use super::{LoopbackRun, Shared};
use crate::endpoint::{http_url, ws_url};
use crate::error::{Error, Result};
use crate::loopback::{synthetic_run, Loopback};
use crate::pace::{Ema, RateMeter};
use crate::progress::ConnState;
use crowdgrad_core::backoff::Backoff;
use crowdgrad_core::data::Dataset;
use crowdgrad_core::optim::OptimizerConfig;
use crowdgrad_core::spec::{JoinRequest, JoinResponse};
use crowdgrad_core::wire::ClientKind;
use crowdgrad_core::worker::{Worker, WorkerStats};
use std::rc::Rc;

/// A step waits while any socket has more than this many bytes unsent (a browser closes a
/// socket whose send buffer overflows).
const HIGH_WATER_BYTES: u32 = 4 << 20;
/// Longest wait for parameters before the session is declared stalled.
const STALL_MS: f64 = 30_000.0;
/// How often progress is posted while nothing else changes.
const REPORT_EVERY_MS: f64 = 250.0;
/// Weight of the newest step time in the step-time average.
const STEP_EMA_ALPHA: f64 = 0.1;

/// The join this Web Worker sends: a browser's, as one of the tab's threads if it runs several.
fn join_request(sh: &Shared) -> JoinRequest {
    let mut req = JoinRequest::new(ClientKind::Browser);
    req.threads.clone_from(&sh.setup.threads);
    req.identity.clone_from(&sh.identity.borrow());
    req.name.clone_from(&sh.setup.name);
    req.team.clone_from(&sh.setup.team);
    req
}

/// Examples in a loopback partition (synthetic, MNIST-shaped).
const LOOPBACK_EXAMPLES: usize = 6_000;
/// In loopback mode nothing else gives the event loop a turn: yield at least this often so
/// the page's pause, CPU limit and stop reach the worker (a yield costs ~4 ms, under 5%).
const LOOPBACK_YIELD_MS: f64 = 100.0;

/// Runs sessions until the page calls `stop()`.
pub(crate) async fn run(sh: Rc<Shared>) {
    let started = sh.scope.now();
    let mut d = Driver {
        sh: sh.clone(),
        started,
        carried: WorkerStats::default(),
        next_link: 1,
        step_ms: Ema::default(),
        wait_ms: Ema::default(),
        rate: RateMeter::new(5_000.0),
        last_report: f64::NEG_INFINITY,
    };
    // Tabs that lost the same server must not rejoin together: seed the jitter per tab.
    let seed =
        (js_sys::Math::random() * 9_007_199_254_740_992.0) as u64 ^ js_sys::Date::now().to_bits();
    let mut backoff = Backoff::new(seed);
    let mut sessions = 0u32;
    if let Some(run) = sh.setup.loopback.clone() {
        if let Err(e) = d.loopback(&run).await {
            sh.progress.borrow_mut().error = Some(e.to_string());
        }
        sh.progress.borrow_mut().state = ConnState::Stopped;
        d.report(None, true);
        return;
    }
    loop {
        if sh.control.borrow().stopped {
            break;
        }
        sh.progress.borrow_mut().reconnects = sessions;
        sessions += 1;
        let accepted_before = d.carried.pushes_accepted;
        match d.session().await {
            Ok(()) => break,
            Err(e) => {
                if d.carried.pushes_accepted > accepted_before {
                    // The session trained: this is a fresh failure, not a repeated one.
                    backoff.reset();
                }
                let delay = backoff.next_delay() * 1000.0;
                {
                    let mut p = sh.progress.borrow_mut();
                    p.state = ConnState::Reconnecting;
                    p.error = Some(e.to_string());
                    p.retry_in_ms = Some(delay);
                    p.shards_connected = 0;
                }
                d.report(None, true);
                let deadline = sh.scope.now() + delay;
                loop {
                    let left = deadline - sh.scope.now();
                    if left <= 0.0 || sh.control.borrow().stopped {
                        break;
                    }
                    sh.wake.wait(&sh.scope, left).await;
                }
                sh.progress.borrow_mut().retry_in_ms = None;
            }
        }
    }
    sh.progress.borrow_mut().state = ConnState::Stopped;
    sh.progress.borrow_mut().shards_connected = 0;
    d.report(None, true);
}

struct Driver {
    sh: Rc<Shared>,
    started: f64,
    /// Counters of the sessions so far (handed to each new core worker).
    carried: WorkerStats,
    next_link: u64,
    step_ms: Ema,
    wait_ms: Ema,
    rate: RateMeter,
    last_report: f64,
}

/// The open sockets of one session (or of one stretch between pauses).
struct Link {
    id: u64,
    sockets: Vec<Option<ShardSocket>>,
    open: Vec<bool>,
    /// The shards' WebSocket URLs (a lost one is reopened alone).
    urls: Vec<String>,
    /// Per shard: when a lost socket is opened again (page clock, ms), if it is down.
    retry_at: Vec<Option<f64>>,
    /// Per shard: the delays between those attempts.
    backoff: Vec<Backoff>,
}

impl Link {
    fn connected(&self) -> usize {
        self.open.iter().filter(|&&o| o).count()
    }

    fn buffered_max(&self) -> u32 {
        self.sockets
            .iter()
            .flatten()
            .map(ShardSocket::buffered)
            .max()
            .unwrap_or(0)
    }

    /// Sends everything the core worker queued.
    fn flush(&self, worker: &mut Worker) -> Result<()> {
        while let Some(out) = worker.poll_transmit() {
            match self.sockets.get(out.shard).and_then(Option::as_ref) {
                Some(s) => s.send(&out.frame)?,
                None => {
                    return Err(Error::Closed {
                        shard: out.shard,
                        code: 1006,
                        reason: "socket already closed".into(),
                    })
                }
            }
        }
        Ok(())
    }

    /// Shard `shard`'s socket closed: the core worker trains on the others and the socket is
    /// reopened after a backoff delay. False when no shard is left (the session is over).
    fn lose(&mut self, worker: &mut Worker, shard: usize, now: f64) -> bool {
        self.sockets[shard] = None;
        self.open[shard] = false;
        worker.disconnected(shard);
        if self.sockets.iter().all(Option::is_none) {
            return false;
        }
        self.retry_at[shard] = Some(now + self.backoff[shard].next_delay() * 1000.0);
        true
    }

    /// Reopens the lost sockets whose delay has passed; returns the next deadline, if any.
    fn retry(&mut self, sh: &Rc<Shared>, now: f64) -> Option<f64> {
        for i in 0..self.sockets.len() {
            match self.retry_at[i] {
                Some(t) if t <= now => match ShardSocket::open(&self.urls[i], i, self.id, sh) {
                    Ok(sock) => {
                        self.sockets[i] = Some(sock);
                        self.retry_at[i] = None;
                    }
                    Err(_) => {
                        self.retry_at[i] = Some(now + self.backoff[i].next_delay() * 1000.0);
                    }
                },
                _ => {}
            }
        }
        self.retry_at.iter().flatten().copied().reduce(f64::min)
    }

    /// Closes every socket and tells the core worker (which counts lost pushes).
    fn close(&mut self, worker: &mut Worker, reason: &str) {
        for (shard, s) in self.sockets.iter_mut().enumerate() {
            if let Some(s) = s.take() {
                s.close(reason);
            }
            worker.disconnected(shard);
            self.open[shard] = false;
            self.retry_at[shard] = None;
        }
    }
}

impl Driver {
    fn scope(&self) -> &Scope {
        &self.sh.scope
    }

    fn set_state(&mut self, state: ConnState, worker: Option<&Worker>) {
        self.sh.progress.borrow_mut().state = state;
        self.report(worker, true);
    }

    /// Refreshes the report from `worker` (or the carried counters) and posts it, at most every
    /// [`REPORT_EVERY_MS`] unless `force`.
    fn report(&mut self, worker: Option<&Worker>, force: bool) {
        let now = self.scope().now();
        if !force && now - self.last_report < REPORT_EVERY_MS {
            return;
        }
        self.last_report = now;
        {
            let mut p = self.sh.progress.borrow_mut();
            p.stats = worker.map_or_else(|| self.carried.clone(), |w| w.stats().clone());
            p.samples_per_sec = self.rate.rate(now);
            p.step_ms = self.step_ms.get();
            p.wait_ms = self.wait_ms.get();
            p.uptime_ms = now - self.started;
            if p.first_push_ms.is_none() && p.stats.pushes_accepted > 0 {
                p.first_push_ms = Some(now - self.started);
            }
        }
        self.sh.post();
    }

    async fn wait_while_paused(&mut self) {
        let mut announced = false;
        loop {
            let c = *self.sh.control.borrow();
            if !c.paused || c.stopped {
                return;
            }
            if !announced {
                self.sh.progress.borrow_mut().shards_connected = 0;
                self.set_state(ConnState::Paused, None);
                announced = true;
            }
            self.sh.wake.wait(&self.sh.scope, 60_000.0).await;
        }
    }

    /// One join-to-failure session. `Ok` means the page stopped the worker.
    async fn session(&mut self) -> Result<()> {
        self.wait_while_paused().await;
        if self.sh.control.borrow().stopped {
            return Ok(());
        }
        self.set_state(ConnState::Joining, None);
        let join_url = format!("{}/api/join", self.sh.base);
        let token = self.sh.join_token.borrow().clone();
        let join: JoinResponse = self
            .scope()
            .post_json(&join_url, &join_request(&self.sh), token.as_deref())
            .await?;
        {
            let mut p = self.sh.progress.borrow_mut();
            p.worker_id = Some(join.worker_id);
            p.run_id = Some(join.run.run_id.clone());
            p.model = Some(join.run.model.to_string());
            p.batch_size = Some(join.run.batch_size);
            p.shards = join.run.shards.len();
            p.partition_index = Some(join.partition.index);
            p.partition_count = Some(join.partition.count);
            p.partition_examples = Some(join.partition.examples);
            p.partition_images = Some(join.partition.images.clone());
            p.error = None;
        }
        self.set_state(ConnState::Downloading, None);
        let base = self.sh.base.clone();
        let (images, images_cached) = self
            .scope()
            .fetch_cached(&http_url(&base, &join.partition.images))
            .await?;
        let (labels, labels_cached) = self
            .scope()
            .fetch_cached(&http_url(&base, &join.partition.labels))
            .await?;
        {
            let mut p = self.sh.progress.borrow_mut();
            p.data_from_cache = Some(images_cached && labels_cached);
            p.data_bytes = (images.len() + labels.len()) as u64;
        }
        let data = Dataset::from_idx(&images, &labels)?;
        drop((images, labels));
        let mut worker = Worker::new(join, data, ClientKind::Browser, None)?;
        worker.carry_stats(self.carried.clone());
        let mut link = self.connect(&worker)?;
        let result = self.drive(&mut worker, &mut link).await;
        link.close(
            &mut worker,
            if result.is_ok() { "stopped" } else { "error" },
        );
        self.carried = worker.stats().clone();
        result
    }

    /// Trains against in-memory loopback shards (core's shard sessions in this Web Worker) on
    /// a synthetic partition until `stop()`, under the same pause and CPU limit as a session.
    async fn loopback(&mut self, run: &LoopbackRun) -> Result<()> {
        let index = self.sh.setup.threads.as_ref().map_or(0, |t| t.index);
        let (join, data) = synthetic_run(
            &run.model,
            run.shards,
            OptimizerConfig::default(),
            run.batch,
            LOOPBACK_EXAMPLES,
            1 + u64::from(index),
        )?;
        {
            let mut p = self.sh.progress.borrow_mut();
            p.worker_id = None;
            p.run_id = Some(join.run.run_id.clone());
            p.model = Some(join.run.model.to_string());
            p.batch_size = Some(join.run.batch_size);
            p.shards = run.shards;
            p.shards_connected = run.shards;
            p.partition_examples = Some(LOOPBACK_EXAMPLES);
        }
        let mut shards = Loopback::new(&join, 42)?;
        let mut worker = Worker::new(join, data, ClientKind::Browser, None)?;
        for s in 0..run.shards {
            worker.connected(s);
        }
        let mut training = false;
        let mut rest_end = self.scope().now();
        let mut last_yield = rest_end;
        loop {
            let control = *self.sh.control.borrow();
            if control.stopped {
                self.carried = worker.stats().clone();
                return Ok(());
            }
            if control.paused {
                training = false;
                self.wait_while_paused().await;
                self.sh.progress.borrow_mut().shards_connected = run.shards;
                rest_end = self.scope().now();
                continue;
            }
            // Hello/Welcome, then pulls/Params: a few exchanges at most before a step.
            let mut exchanges = 0;
            while !worker.ready() {
                if exchanges == 16 {
                    return Err(Error::Stalled(
                        "the loopback shards sent no parameters".into(),
                    ));
                }
                shards.exchange(&mut worker, |_, _, _| {})?;
                exchanges += 1;
            }
            if !training {
                training = true;
                self.set_state(ConnState::Training, Some(&worker));
            }
            let t0 = self.scope().now();
            let idle = t0 - rest_end;
            worker.set_time(t0 / 1e3);
            worker.step()?;
            let t1 = self.scope().now();
            worker.observe_compute((t1 - t0) / 1e3);
            worker.set_time(t1 / 1e3);
            let dt = t1 - t0;
            self.step_ms.update(dt, STEP_EMA_ALPHA);
            self.sh.progress.borrow_mut().step_ms_last = Some(dt);
            self.rate.record(t1, worker.stats().samples);
            self.report(Some(&worker), false);
            let rest = control.throttle.rest_ms(dt, idle);
            if rest > 0.0 {
                self.scope().sleep(rest).await;
                last_yield = self.scope().now();
            } else if t1 - last_yield > LOOPBACK_YIELD_MS {
                self.scope().sleep(0.0).await;
                last_yield = self.scope().now();
            }
            rest_end = self.scope().now();
        }
    }

    /// Opens one socket per shard.
    fn connect(&mut self, worker: &Worker) -> Result<Link> {
        let id = self.next_link;
        self.next_link += 1;
        // Late events from an older link are skipped by id; drop them now too.
        self.sh.events.borrow_mut().clear();
        let shards = &worker.join_info().run.shards;
        let mut sockets = Vec::with_capacity(shards.len());
        let urls: Vec<String> = shards
            .iter()
            .map(|s| ws_url(&self.sh.base, &s.path))
            .collect();
        for (i, url) in urls.iter().enumerate() {
            match ShardSocket::open(url, i, id, &self.sh) {
                Ok(sock) => sockets.push(Some(sock)),
                Err(e) => {
                    sockets.into_iter().flatten().for_each(|s| s.close("error"));
                    return Err(e);
                }
            }
        }
        let n = sockets.len();
        {
            let mut p = self.sh.progress.borrow_mut();
            p.state = ConnState::Connecting;
            p.shards_connected = 0;
        }
        self.report(Some(worker), true);
        // Tabs that lost the same shard must not retry together: seed the jitter per tab.
        let seed = (js_sys::Math::random() * 9_007_199_254_740_992.0) as u64;
        Ok(Link {
            id,
            sockets,
            open: vec![false; n],
            urls,
            retry_at: vec![None; n],
            backoff: (0..n as u64)
                .map(|i| Backoff::new(seed.wrapping_add(i)))
                .collect(),
        })
    }

    /// Feeds the core worker until a failure or `stop()`.
    async fn drive(&mut self, worker: &mut Worker, link: &mut Link) -> Result<()> {
        let mut training = false;
        let mut rest_end = self.scope().now();
        let mut last_frame = rest_end;
        loop {
            // 1. Socket events, in arrival order.
            loop {
                let Some(ev) = self.sh.events.borrow_mut().pop_front() else {
                    break;
                };
                if ev.link != link.id {
                    continue;
                }
                match ev.kind {
                    SocketEventKind::Open => {
                        link.open[ev.shard] = true;
                        link.backoff[ev.shard].reset();
                        worker.connected(ev.shard);
                        self.sh.progress.borrow_mut().shards_connected = link.connected();
                    }
                    SocketEventKind::Message(bytes) => {
                        last_frame = self.scope().now();
                        worker.set_time(last_frame / 1e3);
                        worker.receive(ev.shard, &bytes)?;
                    }
                    SocketEventKind::Close { code, reason } => {
                        if !link.lose(worker, ev.shard, self.scope().now()) {
                            return Err(Error::Closed {
                                shard: ev.shard,
                                code,
                                reason,
                            });
                        }
                        self.sh.progress.borrow_mut().shards_connected = link.connected();
                    }
                }
            }
            let next_retry = link.retry(&self.sh, self.scope().now());
            link.flush(worker)?;

            // 2. What the page asked for.
            let control = *self.sh.control.borrow();
            if control.stopped {
                return Ok(());
            }
            if control.paused {
                link.close(worker, "paused");
                training = false;
                self.wait_while_paused().await;
                if self.sh.control.borrow().stopped {
                    return Ok(());
                }
                *link = self.connect(worker)?;
                rest_end = self.scope().now();
                last_frame = rest_end;
                continue;
            }

            // 3. A step, when every shard's parameters are in.
            if worker.ready() {
                // The first step after connecting waited for the handshake, not for a pull.
                let first = !training;
                if first {
                    training = true;
                    self.set_state(ConnState::Training, Some(worker));
                }
                let buffered = link.buffered_max();
                {
                    let mut p = self.sh.progress.borrow_mut();
                    p.buffered_max = p.buffered_max.max(u64::from(buffered));
                    if buffered > HIGH_WATER_BYTES {
                        p.backpressure_waits += 1;
                    }
                }
                if buffered > HIGH_WATER_BYTES {
                    self.scope().sleep(10.0).await;
                    continue;
                }
                let t0 = self.scope().now();
                let idle = t0 - rest_end;
                worker.set_time(t0 / 1e3);
                worker.step()?;
                let t1 = self.scope().now();
                worker.observe_compute((t1 - t0) / 1e3);
                worker.set_time(t1 / 1e3);
                link.flush(worker)?;
                let dt = t1 - t0;
                self.step_ms.update(dt, STEP_EMA_ALPHA);
                if !first {
                    self.wait_ms.update(idle, STEP_EMA_ALPHA);
                }
                self.sh.progress.borrow_mut().step_ms_last = Some(dt);
                self.rate.record(t1, worker.stats().samples);
                self.report(Some(worker), false);
                // The CPU limit counts sending the push and the report as computing too.
                let busy = self.scope().now() - t0;
                let rest = control.throttle.rest_ms(busy, idle);
                if rest > 0.0 {
                    self.scope().sleep(rest).await;
                }
                rest_end = self.scope().now();
                last_frame = last_frame.max(t1);
                continue;
            }

            // 4. Nothing to do until a frame, a command, or the end of the shards' pace
            //    (issue 18: the next pulls wait for it) arrives.
            let now = self.scope().now();
            let held = worker.poll_timeout().map(|t| t * 1e3);
            if held.is_some_and(|t| now >= t) {
                worker.handle_timeout(now / 1e3);
                link.flush(worker)?;
                // Nothing was asked for during the hold: the stall clock starts again now.
                last_frame = now;
                continue;
            }
            if held.is_none() && now - last_frame > STALL_MS {
                return Err(Error::Stalled(format!(
                    "no frame from the shards for {} s",
                    (STALL_MS / 1000.0) as u32
                )));
            }
            self.report(Some(worker), false);
            let wait = next_retry
                .into_iter()
                .chain(held)
                .fold(None, |a: Option<f64>, t| Some(a.map_or(t, |a| a.min(t))))
                .map_or(REPORT_EVERY_MS, |t| {
                    (t - self.scope().now()).clamp(1.0, REPORT_EVERY_MS)
                });
            self.sh.wake.wait(&self.sh.scope, wait).await;
        }
    }
}
