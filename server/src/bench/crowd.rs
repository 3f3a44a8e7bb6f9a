//! `crowdgrad bench crowd` (issue 18): a crowd of volunteers on one server.
//!
//! One `crowdgrad serve` process on 127.0.0.1 (started here, as [`super::load::Server`] does
//! for churn and flood: its defaults, plus only the limits a crowd from one address needs
//! raised, printed) and, in this process, `--volunteers` simulated volunteers on one tokio
//! runtime (tasks, not threads). Each volunteer speaks the real protocol
//! (docs/protocol.md):
//!
//! 1. `POST /api/join` with an identity (`crowd-N`) at its arrival time; arrivals are ramped
//!    at `--ramp-rate` per second;
//! 2. one WebSocket per shard: Hello with the join's credential, offering every encoding
//!    (int8 blocks, bf16, f32, as `crowdgrad work` does), and the Welcome's choice;
//! 3. every `--round-interval` seconds (each volunteer at its own phase): on every shard at
//!    once, a Pull (timed from the request sent to the last byte of the `Params`), then a Push
//!    of a synthetic gradient in the negotiated push encoding (small values of one fixed
//!    pattern, so every push has the same norm and the norm bound accepts them; timed to its
//!    `Ack`), and a `Report` on shard 0 at most once a second when the Welcome took reports;
//! 4. a dashboard stream (`GET /api/events`, `Accept-Encoding: gzip` as a browser sends it)
//!    for a `--dashboard-fraction` of the volunteers, read and counted, never parsed;
//! 5. at its leave time (leaves are ramped at the same rate after `--steady-seconds`), `Bye`
//!    and Close on every socket, and the stream dropped.
//!
//! Bytes are counted on this side of every socket (a counting wrapper around each TCP
//! stream: HTTP and WebSocket framing included), so what the volunteers received is the
//! server's egress. The server's RSS (`VmRSS`), CPU (utime + stime), open fds, and this
//! process's CPU are read from `/proc` at every phase boundary and once a second.
//!
//! Past ~6,000 volunteers one server process and one generator process run out of file
//! descriptors (3 per volunteer on each side, a 20,000 hard limit here): `--shard-processes`
//! serves the shards from `crowdgrad shard` processes with `serve --shard-urls` as the
//! coordinator, `--generators N` splits the volunteers over N child processes of this
//! binary, and every server-side process is measured and summed (`super::crowdprocs`).
//!
//! Bounded: at most [`MAX_VOLUNTEERS`] volunteers and 16 generators, every wait has a
//! deadline, the whole run ends by itself (ramp + steady + leave + settling), and every
//! process it started is killed when it ends or fails. Only 127.0.0.1 is ever targeted:
//! `--addr` is refused in the server flags, and every listening address and shard URL is
//! checked.

use crate::error::{Error, Result};
use clap::Args;
use crowdgrad_core::codec::Encoding;
use crowdgrad_core::spec::{JoinRequest, JoinResponse};
use crowdgrad_core::wire::{
    self, Bye, ClientKind, Header, Hello, Kind, Message as Frame, Report, PROTOCOL_VERSION,
};
use futures_util::{SinkExt, StreamExt};
use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;

/// Most volunteers one run simulates.
pub const MAX_VOLUNTEERS: usize = 20_000;

/// Most generator processes (`--generators`).
pub const MAX_GENERATORS: usize = 16;

/// Round-trip samples kept per phase and kind (later ones are dropped).
const MAX_SAMPLES: usize = 1 << 20;

/// How long any single network step (connect, join reply, handshake, reply frame) may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a volunteer keeps trying to join after its arrival (joins answered 429).
const JOIN_PATIENCE: Duration = Duration::from_secs(300);

/// The wait before a join answered 429 is tried again (the server's `Retry-After`), the
/// first time; then twice and three times this.
const JOIN_RETRY: Duration = Duration::from_secs(5);

/// Flags of `crowdgrad bench crowd`.
#[derive(Debug, Clone, Args)]
pub struct CrowdArgs {
    /// Simulated volunteers (each: a join, one WebSocket per shard, maybe a dashboard).
    #[arg(long, default_value_t = 1000)]
    pub volunteers: usize,
    /// Volunteers joining per second during the ramp (and leaving per second at the end).
    #[arg(long, default_value_t = 100.0)]
    pub ramp_rate: f64,
    /// Seconds with every volunteer connected, between the ramp and the leaving.
    #[arg(long, default_value_t = 60.0)]
    pub steady_seconds: f64,
    /// Seconds between a volunteer's rounds (pull + push on every shard).
    #[arg(long, default_value_t = 2.0)]
    pub round_interval: f64,
    /// Share of the volunteers that keep a dashboard stream (`/api/events`) open, 0..1.
    #[arg(long, default_value_t = 1.0)]
    pub dashboard_fraction: f64,
    /// Data directory of the server.
    #[arg(long, default_value = "data/mnist")]
    pub data_dir: PathBuf,
    /// The `crowdgrad` binary started as the server (default: this one): two builds under
    /// the same crowd.
    #[arg(long)]
    pub server_binary: Option<PathBuf>,
    /// Serve each shard from a `crowdgrad shard` process of its own (on 127.0.0.1, sharing a
    /// run secret made for the run) with `serve --shard-urls` as the coordinator of joins and
    /// dashboards: each server process then holds one socket per volunteer, not three (past
    /// ~6,000 volunteers one process meets a 20,000 fd hard limit). Every process is measured.
    #[arg(long)]
    pub shard_processes: bool,
    /// Processes the volunteers run in: 1 is this process; more re-runs this binary as child
    /// generators, each with a contiguous slice of the volunteers and its own fd limit (a
    /// volunteer holds 3 fds on the generator's side too). At most 16.
    #[arg(long, default_value_t = 1)]
    pub generators: usize,
    /// `--egress-budget` of the shards (`serve`'s, or every shard process's): the server paces
    /// the crowd's pulls to it (e.g. `400mbit`). Default: the server's (off).
    #[arg(long)]
    pub egress_budget: Option<String>,
    /// Seconds to wait after everyone left (and the fds fell) before the RSS "after" is read.
    /// 700 shows the coordinator forgetting the crowd: it keeps a worker's record 10 minutes
    /// after its last socket closed, and sweeps once a minute. At most 3600.
    #[arg(long, default_value_t = 10.0)]
    pub settle_seconds: f64,
    /// Internal: run as one of the child generators of `--generators` (`LO,HI,ADDR,START_MS`).
    #[arg(long, hide = true)]
    pub as_generator: Option<String>,
    /// Extra flags for `serve` (after the bench's own, so they win; not `--addr`).
    #[arg(last = true)]
    pub serve_args: Vec<String>,
}

impl CrowdArgs {
    /// Defaults for `volunteers` (as the flags' defaults), e.g. for tests.
    pub fn new(volunteers: usize, data_dir: PathBuf) -> Self {
        Self {
            volunteers,
            ramp_rate: 100.0,
            steady_seconds: 60.0,
            round_interval: 2.0,
            dashboard_fraction: 1.0,
            data_dir,
            server_binary: None,
            shard_processes: false,
            generators: 1,
            egress_budget: None,
            settle_seconds: 10.0,
            as_generator: None,
            serve_args: Vec::new(),
        }
    }

    pub(super) fn check(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::Config(m.into()));
        if self.volunteers == 0 || self.volunteers > MAX_VOLUNTEERS {
            return bad(&format!("--volunteers must be in 1..={MAX_VOLUNTEERS}"));
        }
        if !(self.ramp_rate > 0.0 && self.ramp_rate <= 10_000.0) {
            return bad("--ramp-rate must be in (0, 10000] per second");
        }
        if !(self.steady_seconds >= 1.0 && self.steady_seconds <= 3600.0) {
            return bad("--steady-seconds must be in [1, 3600]");
        }
        if !(self.round_interval >= 0.05 && self.round_interval <= 30.0) {
            return bad("--round-interval must be in [0.05, 30] seconds");
        }
        if !(self.settle_seconds >= 0.0 && self.settle_seconds <= 3600.0) {
            return bad("--settle-seconds must be in [0, 3600]");
        }
        if !(0.0..=1.0).contains(&self.dashboard_fraction) {
            return bad("--dashboard-fraction must be in [0, 1]");
        }
        if self.serve_args.iter().any(|a| a.starts_with("--addr")) {
            return bad("the crowd targets 127.0.0.1 only: --addr is not taken");
        }
        if self.shard_processes
            && self
                .serve_args
                .iter()
                .any(|a| a.starts_with("--shard-urls") || a.starts_with("--egress-budget"))
        {
            return bad("with --shard-processes the bench sets --shard-urls, and --egress-budget is the bench's own flag");
        }
        if !(1..=MAX_GENERATORS).contains(&self.generators) {
            return bad(&format!("--generators must be in 1..={MAX_GENERATORS}"));
        }
        Ok(())
    }
}

/// Bytes one kind of socket moved, counted on the generator's side.
#[derive(Debug, Default)]
struct Traffic {
    /// Received by the generator (the server's egress).
    rx: AtomicU64,
    /// Sent by the generator (the server's ingress).
    tx: AtomicU64,
}

/// A TCP stream that counts what passes through it.
struct Counted {
    inner: TcpStream,
    traffic: Arc<Traffic>,
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        self.traffic.rx.fetch_add(n as u64, Ordering::Relaxed);
        r
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &r {
            self.traffic.tx.fetch_add(*n as u64, Ordering::Relaxed);
        }
        r
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

type Ws = tokio_tungstenite::WebSocketStream<Counted>;

/// Phases of a run, in order.
pub(super) const PHASES: [&str; 3] = ["ramp", "steady", "leave"];

/// What the volunteers share: the target, the counters, the samples.
pub(super) struct Ctx {
    addr: SocketAddr,
    /// The phase being counted (0 ramp, 1 steady, 2 leave).
    pub(super) phase: AtomicUsize,
    training: Arc<Traffic>,
    dashboard: Arc<Traffic>,
    http: Arc<Traffic>,
    /// Volunteers with every shard socket open.
    connected: AtomicUsize,
    training_open: AtomicUsize,
    dashboards_open: AtomicUsize,
    joins: [AtomicU64; 3],
    pulls: AtomicU64,
    pushes: AtomicU64,
    /// Per phase: pull round trips and push-to-ack times, ms.
    pull_ms: Mutex<[Vec<f32>; 3]>,
    push_ms: Mutex<[Vec<f32>; 3]>,
    /// Per phase: refusals and failures by reason.
    refusals: Mutex<[BTreeMap<String, u64>; 3]>,
    round: Duration,
    /// Per shard: the gradient values pushed (one fixed pattern, small).
    grads: Mutex<BTreeMap<usize, Arc<Vec<f32>>>>,
    /// The largest pace a shard told a volunteer, ms.
    pace_ms_max: AtomicU64,
    /// Volunteers whose task ended.
    finished: AtomicUsize,
    /// Joins answered 429 and tried again.
    join_retries: AtomicU64,
    /// The latest a volunteer got all its shard sockets open, ms after the first arrival.
    all_in_ms: AtomicU64,
    /// Per volunteer: its arrival to all its shard sockets open, ms.
    join_ms: Mutex<Vec<f32>>,
}

/// The generator's counters at one moment (of this process, or summed over the child
/// generators).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub(super) struct Totals {
    /// Volunteers with every shard socket open.
    pub connected: u64,
    /// Shard sockets open.
    pub training_open: u64,
    /// Dashboard streams open.
    pub dashboards_open: u64,
    /// Bytes received / sent on shard sockets, dashboards and other HTTP (joins).
    pub training_rx: u64,
    /// Sent on shard sockets.
    pub training_tx: u64,
    /// Received on dashboards.
    pub dashboard_rx: u64,
    /// Sent on dashboards.
    pub dashboard_tx: u64,
    /// Received on other HTTP.
    pub http_rx: u64,
    /// Sent on other HTTP.
    pub http_tx: u64,
    /// Joins per phase.
    pub joins: [u64; 3],
    /// Params received.
    pub pulls: u64,
    /// Acks received.
    pub pushes: u64,
    /// Largest pace told, ms.
    pub pace_ms_max: u64,
    /// Volunteers whose task ended.
    pub finished: u64,
    /// Joins answered 429 and tried again.
    pub join_retries: u64,
    /// The latest a volunteer got all its shard sockets open, ms after the first arrival.
    pub all_in_ms: u64,
    /// CPU seconds of the generator process(es).
    pub cpu_s: f64,
    /// Refusals and failures by reason, per phase.
    pub refusals: [BTreeMap<String, u64>; 3],
}

impl Totals {
    /// Adds `o`'s counters (the largest pace of the two).
    pub fn add(&mut self, o: &Totals) {
        self.connected += o.connected;
        self.training_open += o.training_open;
        self.dashboards_open += o.dashboards_open;
        self.training_rx += o.training_rx;
        self.training_tx += o.training_tx;
        self.dashboard_rx += o.dashboard_rx;
        self.dashboard_tx += o.dashboard_tx;
        self.http_rx += o.http_rx;
        self.http_tx += o.http_tx;
        for p in 0..3 {
            self.joins[p] += o.joins[p];
            for (k, v) in &o.refusals[p] {
                *self.refusals[p].entry(k.clone()).or_default() += v;
            }
        }
        self.pulls += o.pulls;
        self.pushes += o.pushes;
        self.pace_ms_max = self.pace_ms_max.max(o.pace_ms_max);
        self.finished += o.finished;
        self.join_retries += o.join_retries;
        self.all_in_ms = self.all_in_ms.max(o.all_in_ms);
        self.cpu_s += o.cpu_s;
    }
}

/// Round-trip samples per phase, ms.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub(super) struct Samples {
    /// Pull round trips.
    pub pull_ms: [Vec<f32>; 3],
    /// Push to ack.
    pub push_ms: [Vec<f32>; 3],
    /// Per volunteer: arrival to all its shard sockets open.
    pub join_ms: Vec<f32>,
}

impl Samples {
    /// Appends `o`'s samples (at most [`MAX_SAMPLES`] per phase and kind).
    pub fn merge(&mut self, o: Samples) {
        for p in 0..3 {
            for (mine, theirs) in [
                (&mut self.pull_ms[p], &o.pull_ms[p]),
                (&mut self.push_ms[p], &o.push_ms[p]),
            ] {
                let room = MAX_SAMPLES.saturating_sub(mine.len());
                mine.extend(theirs.iter().take(room));
            }
        }
        let room = MAX_SAMPLES.saturating_sub(self.join_ms.len());
        self.join_ms.extend(o.join_ms.iter().take(room));
    }
}

/// The volunteers' timetable: arrivals ramped from `start`, `steady` with everyone in,
/// leaves ramped; the same in this process and in every child generator.
pub(super) struct Plan {
    /// When the first volunteer arrives.
    pub(super) start: Instant,
    gap: Duration,
    ramp: Duration,
    steady: Duration,
    n: usize,
    dashboards: usize,
}

impl Plan {
    /// A plan starting `lead` from now.
    pub fn new(args: &CrowdArgs, lead: Duration) -> Self {
        let gap = Duration::from_secs_f64(1.0 / args.ramp_rate);
        Plan {
            start: Instant::now() + lead,
            gap,
            ramp: gap.mul_f64(args.volunteers as f64),
            steady: Duration::from_secs_f64(args.steady_seconds),
            n: args.volunteers,
            dashboards: (args.volunteers as f64 * args.dashboard_fraction).round() as usize,
        }
    }

    /// The plan starting at `ms` Unix milliseconds (as another process's [`Self::start_unix_ms`]).
    pub fn at_unix_ms(args: &CrowdArgs, ms: u64) -> Self {
        let now = unix_ms();
        let mut plan = Plan::new(args, Duration::ZERO);
        if ms >= now {
            plan.start += Duration::from_millis(ms - now);
        } else {
            plan.start = plan
                .start
                .checked_sub(Duration::from_millis(now - ms))
                .unwrap_or(plan.start);
        }
        plan
    }

    /// The start as Unix milliseconds.
    pub fn start_unix_ms(&self) -> u64 {
        let now = unix_ms();
        let ahead = self.start.saturating_duration_since(Instant::now());
        now + ahead.as_millis() as u64
    }

    /// The ends of the ramp, the steady phase and the leaving.
    pub fn ends(&self) -> [Instant; 3] {
        let s = self.start;
        [
            s + self.ramp,
            s + self.ramp + self.steady,
            s + self.ramp + self.steady + self.ramp,
        ]
    }

    /// Spawns volunteers `range` (global indices) on `rt`; each counts itself finished.
    pub fn spawn(
        &self,
        rt: &tokio::runtime::Runtime,
        ctx: &'static Ctx,
        range: std::ops::Range<usize>,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        let t0 = tokio::time::Instant::from_std(self.start);
        let (n, dashboards) = (self.n.max(1), self.dashboards);
        range
            .map(|i| {
                let arrive = t0 + self.gap.mul_f64(i as f64);
                let leave = t0 + self.ramp + self.steady + self.gap.mul_f64(i as f64);
                // Spread the dashboards evenly over the crowd.
                let board = (i * dashboards) / n != ((i + 1) * dashboards) / n;
                rt.spawn(async move {
                    volunteer(ctx, i, t0, arrive, leave, board).await;
                    ctx.finished.fetch_add(1, Ordering::Relaxed);
                })
            })
            .collect()
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The generator's runtime: 2 worker threads.
pub(super) fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::io("runtime", e))
}

impl Ctx {
    /// A context for volunteers against `addr`, kept for the rest of the process (the
    /// volunteers borrow it for `'static`; one per run).
    pub fn leak(addr: SocketAddr, round_interval: f64) -> &'static Ctx {
        Box::leak(Box::new(Ctx {
            addr,
            phase: AtomicUsize::new(0),
            training: Arc::default(),
            dashboard: Arc::default(),
            http: Arc::default(),
            connected: AtomicUsize::new(0),
            training_open: AtomicUsize::new(0),
            dashboards_open: AtomicUsize::new(0),
            joins: Default::default(),
            pulls: AtomicU64::new(0),
            pushes: AtomicU64::new(0),
            pull_ms: Mutex::default(),
            push_ms: Mutex::default(),
            refusals: Mutex::default(),
            round: Duration::from_secs_f64(round_interval),
            grads: Mutex::default(),
            pace_ms_max: AtomicU64::new(0),
            finished: AtomicUsize::new(0),
            join_retries: AtomicU64::new(0),
            all_in_ms: AtomicU64::new(0),
            join_ms: Mutex::default(),
        }))
    }

    /// The counters now (`cpu_s` left 0).
    pub fn totals(&self) -> Totals {
        let r = |a: &AtomicUsize| a.load(Ordering::Relaxed) as u64;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Totals {
            connected: r(&self.connected),
            training_open: r(&self.training_open),
            dashboards_open: r(&self.dashboards_open),
            training_rx: l(&self.training.rx),
            training_tx: l(&self.training.tx),
            dashboard_rx: l(&self.dashboard.rx),
            dashboard_tx: l(&self.dashboard.tx),
            http_rx: l(&self.http.rx),
            http_tx: l(&self.http.tx),
            joins: [0, 1, 2].map(|p| l(&self.joins[p])),
            pulls: l(&self.pulls),
            pushes: l(&self.pushes),
            pace_ms_max: l(&self.pace_ms_max),
            finished: r(&self.finished),
            join_retries: l(&self.join_retries),
            all_in_ms: l(&self.all_in_ms),
            cpu_s: 0.0,
            refusals: self.refusals.lock().map(|r| r.clone()).unwrap_or_default(),
        }
    }

    /// The samples so far, taken out (the context keeps none).
    pub fn take_samples(&self) -> Samples {
        let take = |m: &Mutex<[Vec<f32>; 3]>| {
            m.lock()
                .map(|mut v| std::mem::take(&mut *v))
                .unwrap_or_default()
        };
        Samples {
            pull_ms: take(&self.pull_ms),
            push_ms: take(&self.push_ms),
            join_ms: self
                .join_ms
                .lock()
                .map(|mut v| std::mem::take(&mut *v))
                .unwrap_or_default(),
        }
    }

    fn phase(&self) -> usize {
        self.phase.load(Ordering::Relaxed).min(2)
    }

    pub(super) fn refuse(&self, reason: impl Into<String>) {
        let mut reason: String = reason.into();
        reason.truncate(120);
        let p = self.phase();
        if let Ok(mut r) = self.refusals.lock() {
            *r[p].entry(reason).or_default() += 1;
        }
    }

    fn sample(&self, which: &Mutex<[Vec<f32>; 3]>, since: Instant) {
        let ms = since.elapsed().as_secs_f64() as f32 * 1e3;
        let p = self.phase();
        if let Ok(mut v) = which.lock() {
            if v[p].len() < MAX_SAMPLES {
                v[p].push(ms);
            }
        }
    }

    fn grad(&self, len: usize) -> Arc<Vec<f32>> {
        let mut g = self.grads.lock().unwrap_or_else(|p| p.into_inner());
        g.entry(len)
            .or_insert_with(|| {
                // A fixed pseudo-random pattern of magnitude ~1e-4 (xorshift).
                let mut s = 0x9e37_79b9_7f4a_7c15u64;
                Arc::new(
                    (0..len)
                        .map(|_| {
                            s ^= s << 13;
                            s ^= s >> 7;
                            s ^= s << 17;
                            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2e-4
                        })
                        .collect(),
                )
            })
            .clone()
    }
}

/// Counts an open socket of one kind for as long as it lives.
struct Open<'a>(&'a AtomicUsize);

impl<'a> Open<'a> {
    fn new(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::Relaxed);
        Open(n)
    }
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn connect(addr: SocketAddr, traffic: &Arc<Traffic>) -> Result<Counted> {
    let tcp = tokio::time::timeout(STEP_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| Error::Http("connect timed out".into()))?
        .map_err(|e| Error::io("connect", e))?;
    let _ = tcp.set_nodelay(true);
    Ok(Counted {
        inner: tcp,
        traffic: traffic.clone(),
    })
}

/// One HTTP/1.1 request with `Connection: close`; the status and the (de-chunked) body, at
/// most 1 MiB of it.
async fn http(ctx: &Ctx, method: &str, path: &str, body: &[u8]) -> Result<(u16, Vec<u8>)> {
    let mut s = connect(ctx.addr, &ctx.http).await?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        ctx.addr,
        body.len()
    );
    let mut out = Vec::new();
    tokio::time::timeout(STEP_TIMEOUT, async {
        s.write_all(head.as_bytes()).await?;
        s.write_all(body).await?;
        (&mut s).take(1 << 20).read_to_end(&mut out).await
    })
    .await
    .map_err(|_| Error::Http(format!("{method} {path}: no reply within {STEP_TIMEOUT:?}")))?
    .map_err(|e| Error::io("http", e))?;
    let split = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| Error::Http("reply without a header end".into()))?;
    let head = String::from_utf8_lossy(&out[..split]).to_ascii_lowercase();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or_else(|| Error::Http("reply without a status".into()))?;
    let mut body = out[split + 4..].to_vec();
    if head.contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    Ok((status, body))
}

/// The payload of a chunked body (what parses of it).
pub(super) fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let size = std::str::from_utf8(&b[..eol])
            .ok()
            .and_then(|s| usize::from_str_radix(s.split(';').next()?.trim(), 16).ok());
        let Some(size) = size.filter(|&n| n > 0) else {
            break;
        };
        let start = eol + 2;
        let Some(chunk) = b.get(start..start + size) else {
            break;
        };
        out.extend_from_slice(chunk);
        b = b.get(start + size + 2..).unwrap_or(&[]);
    }
    out
}

/// What one shard socket negotiated.
struct Link {
    ws: Ws,
    shard: u32,
    version: u64,
    push: Encoding,
    reports: bool,
    len: usize,
    /// The Welcome said `paces`: each Params' `aux` is the shard's pace in ms (issue 18).
    paces: bool,
    /// The pace the last Params carried, seconds.
    pace: f64,
    _open: Open<'static>,
}

async fn next_binary(ws: &mut Ws) -> Result<Vec<u8>> {
    loop {
        match tokio::time::timeout(STEP_TIMEOUT, ws.next()).await {
            Err(_) => return Err(Error::WebSocket("no frame within the step timeout".into())),
            Ok(Some(Ok(Message::Binary(b)))) => return Ok(b.into()),
            Ok(Some(Ok(Message::Close(c)))) => {
                let why = c.map_or_else(String::new, |c| c.reason.to_string());
                return Err(Error::WebSocket(format!("closed by the server: {why}")));
            }
            Ok(None) => return Err(Error::WebSocket("closed by the server".into())),
            Ok(Some(Err(e))) => return Err(Error::WebSocket(e.to_string())),
            Ok(Some(Ok(_))) => {}
        }
    }
}

/// A refusal's reason from an `Error` frame, else a short description of the frame.
fn frame_reason(bytes: &[u8]) -> String {
    match wire::decode(bytes, usize::MAX) {
        Ok(Frame::Error { error, .. }) => format!("error frame: {}", error.code.name()),
        Ok(Frame::Bye { bye, .. }) => format!("bye: {}", bye.reason),
        Ok(other) => format!("unexpected frame {:?}", std::mem::discriminant(&other)),
        Err(e) => format!("undecodable frame: {e}"),
    }
}

async fn open_shard(
    ctx: &'static Ctx,
    joined: &JoinResponse,
    shard: u32,
    path: &str,
) -> Result<Link> {
    // A shard of `serve` is a path on it; a shard process's is an absolute ws:// URL.
    let (addr, path) = match path.strip_prefix("ws://") {
        Some(rest) => {
            let (host, p) = rest.split_once('/').unwrap_or((rest, ""));
            let addr: SocketAddr = host
                .parse()
                .map_err(|_| Error::WebSocket(format!("shard URL {path}")))?;
            if addr.ip() != std::net::IpAddr::from([127, 0, 0, 1]) {
                return Err(Error::WebSocket(format!(
                    "shard URL {path} is not on 127.0.0.1"
                )));
            }
            (addr, format!("/{p}"))
        }
        None => (ctx.addr, path.to_string()),
    };
    let tcp = connect(addr, &ctx.training).await?;
    let url = format!("ws://{addr}{path}");
    let (mut ws, _) = tokio::time::timeout(
        STEP_TIMEOUT,
        tokio_tungstenite::client_async(url.as_str(), tcp),
    )
    .await
    .map_err(|_| Error::WebSocket("upgrade timed out".into()))?
    .map_err(|e| Error::WebSocket(format!("upgrade: {e}")))?;
    let open = Open::new(&ctx.training_open);
    let offered = vec![Encoding::INT8, Encoding::Bf16, Encoding::F32];
    let hello = wire::encode(&Frame::Hello {
        request_id: 1,
        shard,
        hello: Hello {
            protocol: PROTOCOL_VERSION,
            worker_id: joined.worker_id,
            client: ClientKind::Browser,
            pull_encodings: offered.clone(),
            push_encodings: offered,
            credential: joined.credential.clone(),
            pacing: true,
            samples: true,
        },
    });
    ws.send(Message::Binary(hello.into()))
        .await
        .map_err(|e| Error::WebSocket(e.to_string()))?;
    let reply = next_binary(&mut ws).await?;
    match wire::decode(&reply, usize::MAX) {
        Ok(Frame::Welcome { welcome, .. }) => Ok(Link {
            ws,
            shard,
            version: welcome.version,
            push: welcome.push_encoding,
            reports: welcome.reports,
            len: welcome.range.len(),
            paces: welcome.paces,
            pace: 0.0,
            _open: open,
        }),
        _ => Err(Error::WebSocket(frame_reason(&reply))),
    }
}

/// One round on one shard: Pull (timed to the last byte of Params), then Push (timed to Ack).
async fn round(
    ctx: &'static Ctx,
    link: &mut Link,
    rid: u32,
    report: Option<&Report>,
) -> Result<()> {
    let pull = wire::encode(&Frame::Pull {
        request_id: rid,
        shard: link.shard,
        min_version: 0,
    });
    let t = Instant::now();
    link.ws
        .send(Message::Binary(pull.into()))
        .await
        .map_err(|e| Error::WebSocket(e.to_string()))?;
    let reply = next_binary(&mut link.ws).await?;
    match Header::parse(&reply, usize::MAX) {
        Ok(h) if h.kind == Kind::Params && h.request_id == rid => {
            ctx.sample(&ctx.pull_ms, t);
            ctx.pulls.fetch_add(1, Ordering::Relaxed);
            link.version = h.version;
            link.pace = if link.paces {
                ctx.pace_ms_max
                    .fetch_max(u64::from(h.aux), Ordering::Relaxed);
                crowdgrad_core::shard::pace::pace_from_ms(h.aux)
            } else {
                0.0
            };
        }
        _ => return Err(Error::WebSocket(frame_reason(&reply))),
    }
    // The shared pattern with its first value set from the request id: the shard refuses the
    // same gradient twice (a replay, issue 21), and 199 distinct values stay distinct after
    // int8-block or bf16 rounding (steps of 1e-6 at a block maximum of ~1e-4).
    let mut grad = (*ctx.grad(link.len)).clone();
    if let Some(g0) = grad.first_mut() {
        *g0 = ((rid % 199) as f32 - 99.0) * 1e-6;
    }
    let push = wire::encode_push_as(link.push, rid, link.shard, link.version, 32, &grad, None)
        .map_err(Error::Core)?;
    let t = Instant::now();
    link.ws
        .send(Message::Binary(push.into()))
        .await
        .map_err(|e| Error::WebSocket(e.to_string()))?;
    let reply = next_binary(&mut link.ws).await?;
    match Header::parse(&reply, usize::MAX) {
        Ok(h) if h.kind == Kind::Ack && h.request_id == rid => {
            ctx.sample(&ctx.push_ms, t);
            ctx.pushes.fetch_add(1, Ordering::Relaxed);
        }
        // A refused push (too stale, busy, out of bounds...) is counted, not fatal.
        Ok(h) if h.kind == Kind::Error && h.request_id == rid => {
            let reason = frame_reason(&reply);
            if is_fatal(&reply) {
                return Err(Error::WebSocket(reason));
            }
            ctx.refuse(format!("push: {reason}"));
        }
        _ => return Err(Error::WebSocket(frame_reason(&reply))),
    }
    if let Some(r) = report {
        let f = wire::encode(&Frame::Report {
            shard: link.shard,
            report: r.clone(),
        });
        link.ws
            .send(Message::Binary(f.into()))
            .await
            .map_err(|e| Error::WebSocket(e.to_string()))?;
    }
    Ok(())
}

fn is_fatal(bytes: &[u8]) -> bool {
    matches!(wire::decode(bytes, usize::MAX), Ok(Frame::Error { error, .. }) if error.code.is_fatal())
}

/// Reads a dashboard stream until `leave`, counting its bytes.
async fn dashboard(ctx: &'static Ctx, leave: tokio::time::Instant) {
    let mut s = match connect(ctx.addr, &ctx.dashboard).await {
        Ok(s) => s,
        Err(e) => return ctx.refuse(format!("dashboard: {e}")),
    };
    let req = format!(
        "GET /api/events HTTP/1.1\r\nHost: {}\r\nAccept: text/event-stream\r\nAccept-Encoding: gzip, deflate, br\r\n\r\n",
        ctx.addr
    );
    if let Err(e) = s.write_all(req.as_bytes()).await {
        return ctx.refuse(format!("dashboard: {e}"));
    }
    let _open = Open::new(&ctx.dashboards_open);
    let mut buf = vec![0u8; 16 * 1024];
    let mut first = true;
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(leave) => return,
            r = s.read(&mut buf) => match r {
                Ok(0) => return ctx.refuse("dashboard: closed by the server"),
                Ok(n) => {
                    if first {
                        first = false;
                        if !buf[..n].starts_with(b"HTTP/1.1 200") {
                            let line = String::from_utf8_lossy(&buf[..n.min(40)]).to_string();
                            return ctx.refuse(format!("dashboard: {}", line.lines().next().unwrap_or("")));
                        }
                    }
                }
                Err(e) => return ctx.refuse(format!("dashboard: {e}")),
            }
        }
    }
}

/// One volunteer, from its arrival to its leave.
async fn volunteer(
    ctx: &'static Ctx,
    i: usize,
    t0: tokio::time::Instant,
    arrive: tokio::time::Instant,
    leave: tokio::time::Instant,
    watch_dashboard: bool,
) {
    tokio::time::sleep_until(arrive).await;
    let mut req = JoinRequest::new(ClientKind::Browser);
    req.identity = Some(format!("crowd-{i:06}"));
    req.name = Some(format!("crowd {i}"));
    let body = serde_json::to_vec(&req).unwrap_or_default();
    // A join answered 429 (the server's admission bound on new identities, issue 21, or a
    // rate) is tried again after the 5 s it asks (then 10, 15 s), until the volunteer's leave
    // time or JOIN_PATIENCE, whichever comes first.
    let give_up = leave.min(arrive + JOIN_PATIENCE);
    let mut tries = 0u32;
    let joined: JoinResponse = loop {
        match http(ctx, "POST", "/api/join", &body).await {
            Ok((200, b)) => match serde_json::from_slice(&b) {
                Ok(j) => break j,
                Err(e) => return ctx.refuse(format!("join: bad reply: {e}")),
            },
            // A server too busy (503: its connection budget), or a connection its accept
            // queue dropped or reset under the retries of a large crowd, is tried again the
            // same way.
            Ok((429 | 503, _)) | Err(Error::Io { .. })
                if tokio::time::Instant::now() + JOIN_RETRY < give_up =>
            {
                ctx.join_retries.fetch_add(1, Ordering::Relaxed);
                tries += 1;
                // Spread the retries over a second so they do not come back as one wave, and
                // back off (5, 10, 15 s) so thousands waiting do not flood the coordinator.
                let jitter = Duration::from_millis((i as u64 * 7919) % 1000);
                tokio::time::sleep(JOIN_RETRY * tries.min(3) + jitter).await;
            }
            Ok((code, b)) => {
                let msg = serde_json::from_slice::<serde_json::Value>(&b)
                    .ok()
                    .and_then(|v| v["error"].as_str().map(str::to_string))
                    .unwrap_or_default();
                return ctx.refuse(format!("join {code}: {msg}"));
            }
            Err(e) => return ctx.refuse(format!("join: {e}")),
        }
    };
    ctx.joins[ctx.phase()].fetch_add(1, Ordering::Relaxed);
    let board = watch_dashboard.then(|| tokio::spawn(dashboard(ctx, leave)));
    let mut links = Vec::new();
    for (s, d) in joined.run.shards.iter().enumerate() {
        match open_shard(ctx, &joined, s as u32, &d.path).await {
            Ok(l) => links.push(l),
            Err(e) => {
                ctx.refuse(format!("shard socket: {e}"));
                if let Some(b) = board {
                    b.abort();
                }
                return;
            }
        }
    }
    let connected = Open::new(&ctx.connected);
    let now = tokio::time::Instant::now();
    ctx.all_in_ms.fetch_max(
        now.saturating_duration_since(t0).as_millis() as u64,
        Ordering::Relaxed,
    );
    if let Ok(mut j) = ctx.join_ms.lock() {
        if j.len() < MAX_SAMPLES {
            j.push(now.saturating_duration_since(arrive).as_secs_f32() * 1e3);
        }
    }
    let started = Instant::now();
    // Each volunteer at its own phase of the round, so the rounds do not come in waves.
    let phase = ctx.round.mul_f64((i as f64 * 0.618_034).fract());
    let mut next = tokio::time::Instant::now() + phase;
    let mut rid = 2u32;
    let mut last_report: Option<Instant> = None;
    'rounds: while next < leave {
        tokio::time::sleep_until(next).await;
        let began = tokio::time::Instant::now();
        next += ctx.round;
        let report = (links.first().is_some_and(|l| l.reports)
            && last_report.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)))
        .then(|| {
            last_report = Some(Instant::now());
            Report {
                local_steps: 1,
                compute_s: started.elapsed().as_secs_f64() * 0.5,
                wall_s: started.elapsed().as_secs_f64(),
                exchange_s: 0.01,
                // Counted on this side per kind of socket, not per volunteer.
                bytes_up: 0,
                bytes_down: 0,
            }
        });
        let results = futures_util::future::join_all(
            links
                .iter_mut()
                .enumerate()
                .map(|(k, l)| round(ctx, l, rid, if k == 0 { report.as_ref() } else { None })),
        )
        .await;
        rid = wire::next_request_id(rid);
        for r in results {
            if let Err(e) = r {
                ctx.refuse(format!("training socket: {e}"));
                break 'rounds;
            }
        }
        // As a worker honours the shards' pace (issue 18): its next pulls no sooner than the
        // largest pace after this round's went out.
        let pace = links.iter().map(|l| l.pace).fold(0.0, f64::max);
        if let Some(due) = crowdgrad_core::shard::pull_due(Some(0.0), pace) {
            next = next.max(began + Duration::from_secs_f64(due));
        }
    }
    tokio::time::sleep_until(leave).await;
    for mut l in links {
        let bye = wire::encode(&Frame::Bye {
            shard: l.shard,
            bye: Bye {
                reason: "crowd: leaving".into(),
            },
        });
        let _ = l.ws.send(Message::Binary(bye.into())).await;
        let _ = tokio::time::timeout(Duration::from_secs(5), l.ws.close(None)).await;
    }
    drop(connected);
    if let Some(b) = board {
        let _ = tokio::time::timeout(Duration::from_secs(5), b).await;
    }
}
