//! `crowdgrad bench churn` and `crowdgrad bench flood` (issue 10): a server strangers can join,
//! under load.
//!
//! **churn** ([`churn`]): one `crowdgrad serve` process on 127.0.0.1 and, in this process,
//! `--connections` WebSocket connections that join and leave in `--rounds` rounds. In a round
//! every simulated worker joins over HTTP (`POST /api/join`), opens one socket per shard, says
//! Hello with its credential and pulls; the arrivals are spread evenly over the ramp (a third
//! of the round), every worker pulls again every `--pull-every` seconds while connected, and they
//! leave in arrival order over the last third, half with `Bye` + Close, half by dropping the TCP
//! connection. Meanwhile a thread polls `GET /api/status` every 50 ms and times each reply, and
//! the server's RSS (`VmRSS`) and open file descriptors (`/proc/PID/fd`) are sampled before the
//! first round (baseline), at every round's peak and after every round (once the server reports
//! no worker connected, and [`AFTER_WAIT`] = 10 s more). It prints one
//! Markdown row per figure. `--malloc-mmap-threshold` and `--server-env` start the server with
//! allocator settings, to compare allocators side by side (docs/benchmarks.md).
//!
//! **flood** ([`flood`]): do limits slow well-behaved workers down? `--workers` real
//! `crowdgrad work` processes train for `--seconds` on a server with its default limits, with
//! every limit off, and with a tight `--push-rate` (`tight`), each without and with an attacker
//! from another loopback address (127.0.0.2, so per-IP limits tell it apart from the honest
//! workers on 127.0.0.1): a joined worker pushing gradient-sized noise (or zeros, with
//! `--attack-grad zero`) as fast as its sockets take them on every shard, plus `--idle`
//! WebSockets that open, never say Hello and reconnect when closed. It prints the honest
//! workers' samples/s and pushes accepted (their own summaries) per run, what the server's
//! limits refused, the pushes refused by reason, and the medians of the honest samples/s that
//! were applied (samples/s × accepted / sent).
//!
//! Everything stays on loopback, every loop is bounded by a deadline, and the server process is
//! killed when a run ends or fails.

use crate::error::{Error, Result};
use clap::Args;
use crowdgrad_core::spec::{JoinRequest, JoinResponse};
use crowdgrad_core::wire::{self, Bye, ClientKind, Hello, Message as Frame, PROTOCOL_VERSION};
use futures_util::{SinkExt, StreamExt};
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_tungstenite::tungstenite::Message;

/// Flags of `crowdgrad bench churn`.
#[derive(Debug, Clone, Args)]
pub struct ChurnArgs {
    /// WebSocket connections per round (workers × shards; each worker opens every shard).
    #[arg(long, default_value_t = 1000)]
    pub connections: usize,
    /// Rounds of joining and leaving (RSS after each round shows whether memory grows).
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// Seconds per round: a third joining, a third all connected, a third leaving.
    #[arg(long, default_value_t = 60.0)]
    pub round_seconds: f64,
    /// Seconds between the pulls of a connected worker.
    #[arg(long, default_value_t = 5.0)]
    pub pull_every: f64,
    /// Start the server with `MALLOC_MMAP_THRESHOLD_` set to this many bytes: glibc then
    /// serves every larger block (frames, socket buffers) with its own mapping and returns it
    /// when freed, instead of raising the threshold and keeping freed blocks in its heap. An
    /// allocator experiment (the server trims its heap by itself: crate::support::trim).
    #[arg(long)]
    pub malloc_mmap_threshold: Option<usize>,
    /// More environment for the server process, `KEY=VALUE` (repeatable): allocator
    /// experiments such as `LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2` or
    /// `MALLOC_ARENA_MAX=2`, without touching this process's own allocator.
    #[arg(long = "server-env", value_name = "KEY=VALUE")]
    pub server_env: Vec<String>,
    /// Data directory of the server.
    #[arg(long, default_value = "data/mnist")]
    pub data_dir: PathBuf,
    /// Extra flags for `serve` (after the bench's own, so they win).
    #[arg(last = true)]
    pub serve_args: Vec<String>,
}

/// What a churn run measured.
#[derive(Debug, Clone)]
pub struct Churn {
    /// Connections per round.
    pub connections: usize,
    /// Rounds.
    pub rounds: usize,
    /// Handshakes (Welcome received) over all rounds.
    pub handshakes: usize,
    /// Params frames received over all rounds.
    pub pulls: u64,
    /// Connections that failed (join, connect, handshake or pull), and the first few reasons.
    pub failures: usize,
    /// The first failure reasons.
    pub failure_reasons: Vec<String>,
    /// Most connections open at once (client side).
    pub peak_open: usize,
    /// Status polls answered, and how many failed or took longer than 1 s.
    pub polls: usize,
    /// Status polls that failed.
    pub poll_failures: usize,
    /// Status latency percentiles over the whole run, milliseconds.
    pub status_p50_ms: f64,
    /// 99th percentile.
    pub status_p99_ms: f64,
    /// Slowest.
    pub status_max_ms: f64,
    /// Server RSS before the first round, MiB.
    pub rss_base_mib: f64,
    /// Server RSS at each round's peak, MiB.
    pub rss_peak_mib: Vec<f64>,
    /// Server RSS after each round, MiB.
    pub rss_after_mib: Vec<f64>,
    /// Server open fds before the first round.
    pub fds_base: usize,
    /// At each round's peak.
    pub fds_peak: Vec<usize>,
    /// After each round.
    pub fds_after: Vec<usize>,
    /// Wall time of the rounds, seconds.
    pub seconds: f64,
}

/// Flags of `crowdgrad bench flood`.
#[derive(Debug, Clone, Args)]
pub struct FloodArgs {
    /// Honest `crowdgrad work` processes.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Seconds each run's workers train.
    #[arg(long, default_value_t = 20.0)]
    pub seconds: f64,
    /// Idle WebSockets the attacker keeps open (they never say Hello).
    #[arg(long, default_value_t = 200)]
    pub idle: usize,
    /// Runs of every configuration (interleaved); the table shows each and the medians.
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// `--push-rate` of the `tight` configuration: above what an honest worker pushes (~350/s
    /// per shard with 2 workers on this kind of machine), below the attacker's flood.
    #[arg(long, default_value_t = 500.0)]
    pub tight_push_rate: f64,
    /// What the attacker pushes: `noise` (values of ±1e-3, the size of real gradients) or
    /// `zero` (all zeros: drags the median norm of the shard's push bound down to 0).
    #[arg(long, default_value = "noise")]
    pub attack_grad: String,
    /// Data directory of the server.
    #[arg(long, default_value = "data/mnist")]
    pub data_dir: PathBuf,
    /// Extra flags for every `serve`.
    #[arg(last = true)]
    pub serve_args: Vec<String>,
}

/// One flood run.
#[derive(Debug, Clone)]
pub struct FloodRun {
    /// `default`, `tight` (the default limits with `--push-rate` at `--tight-push-rate`) or
    /// `off`.
    pub limits: &'static str,
    /// Whether the attacker ran.
    pub attacked: bool,
    /// The honest workers' samples/s, summed (each worker's samples over its training time).
    pub honest_samples_per_sec: f64,
    /// Their pushes accepted / sent.
    pub honest_accepted: u64,
    /// Their pushes sent.
    pub honest_sent: u64,
    /// Attacker pushes sent, and answered with Ack.
    pub attack_pushes: u64,
    /// Attacker pushes acknowledged (applied).
    pub attack_acked: u64,
    /// Attacker WebSocket connections opened (idle ones included, reconnections counted).
    pub attack_connections: u64,
    /// The server's `limits` counters at the end.
    pub limits_status: serde_json::Value,
    /// Pushes refused, by reason, summed over the shards (honest and attacker pushes alike).
    pub refused_by_reason: std::collections::BTreeMap<String, u64>,
}

// ------------------------------------------------------------------------------- processes

/// A `crowdgrad serve` child, killed when dropped.
struct Server {
    child: Child,
    url: String,
    addr: SocketAddr,
}

impl Server {
    fn start(
        exe: &Path,
        data_dir: &Path,
        args: &[String],
        env: &[(String, String)],
    ) -> Result<Self> {
        let mut child = Command::new(exe)
            .envs(env.iter().cloned())
            .args(["serve", "--addr", "127.0.0.1:0", "--no-fetch", "--data-dir"])
            .arg(data_dir)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| Error::io("starting the server", e))?;
        let out = child
            .stdout
            .take()
            .ok_or_else(|| Error::Process("no server stdout".into()))?;
        let (tx, rx) = std::sync::mpsc::channel();
        // Reads the address, then keeps draining stdout so the server never blocks on it.
        std::thread::spawn(move || {
            let mut lines = BufReader::new(out).lines();
            for line in lines.by_ref().map_while(std::result::Result::ok) {
                if let Some(u) = line.strip_prefix("crowdgrad listening on ") {
                    let _ = tx.send(u.trim().to_string());
                    break;
                }
            }
            for _ in lines {}
        });
        let mut server = Server {
            child,
            url: String::new(),
            addr: "127.0.0.1:0"
                .parse()
                .map_err(|_| Error::Process("addr".into()))?,
        };
        server.url = rx
            .recv_timeout(Duration::from_secs(60))
            .map_err(|_| Error::Process("the server did not start within 60 s".into()))?;
        server.addr = server
            .url
            .trim_start_matches("http://")
            .parse()
            .map_err(|_| Error::Process(format!("server url {}", server.url)))?;
        Ok(server)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Current resident memory of `pid`, MiB.
pub fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// Open file descriptors of `pid`.
pub fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .into()
}

fn get_json(agent: &ureq::Agent, url: &str) -> Result<serde_json::Value> {
    let mut r = agent
        .get(url)
        .call()
        .map_err(|e| Error::Http(e.to_string()))?;
    if r.status() != 200 {
        return Err(Error::Http(format!("GET {url}: {}", r.status())));
    }
    let b = r
        .body_mut()
        .with_config()
        .limit(64 << 20)
        .read_to_vec()
        .map_err(|e| Error::Http(e.to_string()))?;
    serde_json::from_slice(&b).map_err(|e| Error::Http(e.to_string()))
}

fn join(agent: &ureq::Agent, url: &str) -> Result<JoinResponse> {
    let body = serde_json::to_vec(&JoinRequest::new(ClientKind::Native))
        .map_err(|e| Error::Http(e.to_string()))?;
    let mut r = agent
        .post(&format!("{url}/api/join"))
        .header("content-type", "application/json")
        .send(&body[..])
        .map_err(|e| Error::Http(e.to_string()))?;
    let status = r.status().as_u16();
    let b = r
        .body_mut()
        .read_to_vec()
        .map_err(|e| Error::Http(e.to_string()))?;
    if status != 200 {
        return Err(Error::Http(format!(
            "join: {status} {}",
            String::from_utf8_lossy(&b)
        )));
    }
    serde_json::from_slice(&b).map_err(|e| Error::Http(e.to_string()))
}

type Ws = tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>;

/// Opens `path` on the server from the loopback address `from` (127.0.0.1, 127.0.0.2, ...).
async fn open(addr: SocketAddr, from: [u8; 4], path: &str) -> Result<Ws> {
    let socket = tokio::net::TcpSocket::new_v4().map_err(|e| Error::io("socket", e))?;
    socket
        .bind(SocketAddr::from((from, 0)))
        .map_err(|e| Error::io("bind a loopback address", e))?;
    let tcp = socket
        .connect(addr)
        .await
        .map_err(|e| Error::io("connect", e))?;
    let url = format!("ws://{addr}{path}");
    let (ws, _) = tokio_tungstenite::client_async(url.as_str(), tcp)
        .await
        .map_err(|e| Error::WebSocket(e.to_string()))?;
    Ok(ws)
}

/// The next binary frame within `wait`.
async fn next_frame(ws: &mut Ws, wait: Duration) -> Result<Vec<u8>> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(deadline, ws.next()).await {
            Err(_) => return Err(Error::WebSocket(format!("no frame within {wait:?}"))),
            Ok(Some(Ok(Message::Binary(b)))) => return Ok(b.into()),
            Ok(Some(Ok(Message::Close(c)))) => {
                return Err(Error::WebSocket(format!("closed by the server: {c:?}")))
            }
            Ok(None) => return Err(Error::WebSocket("closed by the server".into())),
            Ok(Some(Err(e))) => return Err(Error::WebSocket(e.to_string())),
            Ok(Some(Ok(_))) => {}
        }
    }
}

/// Hello on shard `shard`; returns the Welcome's version.
async fn hello(ws: &mut Ws, joined: &JoinResponse, shard: u32) -> Result<u64> {
    let h = wire::encode(&Frame::Hello {
        request_id: 1,
        shard,
        hello: Hello {
            protocol: PROTOCOL_VERSION,
            worker_id: joined.worker_id,
            client: ClientKind::Native,
            credential: joined.credential.clone(),
            ..Default::default()
        },
    });
    ws.send(Message::Binary(h.into()))
        .await
        .map_err(|e| Error::WebSocket(e.to_string()))?;
    let reply = next_frame(ws, Duration::from_secs(20)).await?;
    match wire::decode(&reply, usize::MAX) {
        Ok(Frame::Welcome { welcome, .. }) => Ok(welcome.version),
        other => Err(Error::WebSocket(format!("expected Welcome, got {other:?}"))),
    }
}

async fn pull(ws: &mut Ws, shard: u32, request_id: u32) -> Result<()> {
    let p = wire::encode(&Frame::Pull {
        request_id,
        shard,
        min_version: 0,
    });
    ws.send(Message::Binary(p.into()))
        .await
        .map_err(|e| Error::WebSocket(e.to_string()))?;
    let reply = next_frame(ws, Duration::from_secs(20)).await?;
    match wire::decode(&reply, usize::MAX) {
        Ok(Frame::Params { request_id: r, .. }) if r == request_id => Ok(()),
        other => Err(Error::WebSocket(format!("expected Params, got {other:?}"))),
    }
}

// ----------------------------------------------------------------------------------- churn

/// Latencies of `GET /api/status`, polled every 50 ms by a thread until stopped.
struct Poller {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<(Vec<f64>, usize)>,
}

impl Poller {
    fn start(url: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let url = format!("{url}/api/status");
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let agent = agent();
            let (mut times, mut failed) = (Vec::new(), 0);
            while !flag.load(Ordering::Relaxed) {
                let t = Instant::now();
                match get_json(&agent, &url) {
                    Ok(_) => times.push(t.elapsed().as_secs_f64() * 1e3),
                    Err(_) => failed += 1,
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            (times, failed)
        });
        Poller { stop, thread }
    }

    fn finish(self) -> (Vec<f64>, usize) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// What the simulated workers of a churn run share.
struct ChurnCtx {
    url: String,
    addr: SocketAddr,
    agent: ureq::Agent,
    open: AtomicUsize,
    peak: AtomicUsize,
    handshakes: AtomicUsize,
    pulls: AtomicU64,
    failures: AtomicUsize,
    reasons: Mutex<Vec<String>>,
    pull_every: Duration,
}

impl ChurnCtx {
    fn fail(&self, e: &Error) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut r) = self.reasons.lock() {
            if r.len() < 5 {
                r.push(e.to_string());
            }
        }
    }
}

/// Counts an open socket for as long as it lives.
struct OpenGuard<'a>(&'a ChurnCtx);

impl<'a> OpenGuard<'a> {
    fn new(ctx: &'a ChurnCtx) -> Self {
        let n = ctx.open.fetch_add(1, Ordering::Relaxed) + 1;
        ctx.peak.fetch_max(n, Ordering::Relaxed);
        OpenGuard(ctx)
    }
}

impl Drop for OpenGuard<'_> {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One simulated worker: join at `arrive`, every shard's socket, Hello, pulls until `leave`.
async fn churn_worker(
    ctx: Arc<ChurnCtx>,
    shards: u32,
    arrive: tokio::time::Instant,
    leave: tokio::time::Instant,
    polite: bool,
) {
    tokio::time::sleep_until(arrive).await;
    let agent = ctx.agent.clone();
    let url = ctx.url.clone();
    let joined = match tokio::task::spawn_blocking(move || join(&agent, &url)).await {
        Ok(Ok(j)) => j,
        Ok(Err(e)) => return ctx.fail(&e),
        Err(e) => return ctx.fail(&Error::Task(e.to_string())),
    };
    let mut sockets = Vec::new();
    for s in 0..shards {
        let path = joined
            .run
            .shards
            .get(s as usize)
            .map_or_else(|| format!("/ws/shard/{s}"), |d| d.path.clone());
        let mut ws = match open(ctx.addr, [127, 0, 0, 1], &path).await {
            Ok(ws) => ws,
            Err(e) => return ctx.fail(&e),
        };
        let guard = OpenGuard::new(&ctx);
        if let Err(e) = hello(&mut ws, &joined, s).await {
            return ctx.fail(&e);
        }
        ctx.handshakes.fetch_add(1, Ordering::Relaxed);
        sockets.push((ws, s, guard));
    }
    let mut rid = 2u32;
    loop {
        for (ws, s, _) in &mut sockets {
            if let Err(e) = pull(ws, *s, rid).await {
                return ctx.fail(&e);
            }
            ctx.pulls.fetch_add(1, Ordering::Relaxed);
        }
        rid += 1;
        let next = tokio::time::Instant::now() + ctx.pull_every;
        if next >= leave {
            break;
        }
        tokio::time::sleep_until(next).await;
    }
    tokio::time::sleep_until(leave).await;
    for (mut ws, s, guard) in sockets {
        if polite {
            let bye = wire::encode(&Frame::Bye {
                shard: s,
                bye: Bye {
                    reason: "churn: leaving".into(),
                },
            });
            let _ = ws.send(Message::Binary(bye.into())).await;
            let _ = tokio::time::timeout(Duration::from_secs(5), ws.close(None)).await;
        }
        // Impolite workers just drop the TCP connection.
        drop(ws);
        drop(guard);
    }
}

/// Waits until the server reports no worker connected and its fds are back within `slack`
/// of `base` (at most `within`).
fn settle(agent: &ureq::Agent, url: &str, pid: u32, base: usize, slack: usize, within: Duration) {
    let t0 = Instant::now();
    while t0.elapsed() < within {
        let idle = get_json(agent, &format!("{url}/api/status"))
            .map(|s| s["workers_connected"].as_u64() == Some(0))
            .unwrap_or(false);
        if idle && fd_count(pid) <= base + slack {
            return;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// How long after a round the server's RSS is read: an allocator that gives memory back on a
/// timer (jemalloc's 10 s decay, a periodic trim) is measured after it has done so.
pub const AFTER_WAIT: Duration = Duration::from_secs(10);

/// Runs the churn benchmark against a `crowdgrad serve` started from `exe`.
///
/// # Errors
/// When the server does not start or cannot be read; failed connections are counted, not
/// errors.
pub fn churn(exe: &Path, args: &ChurnArgs) -> Result<Churn> {
    if args.connections == 0
        || args.rounds == 0
        || args.round_seconds.is_nan()
        || args.round_seconds < 3.0
    {
        return Err(Error::Config(
            "--connections and --rounds must be positive, --round-seconds at least 3".into(),
        ));
    }
    // Every connection comes from 127.0.0.1: lift the per-IP limits, keep the rest.
    let mut serve: Vec<String> = [
        "--max-connections-per-ip",
        "0",
        "--join-rate",
        "0",
        "--eval-every",
        "5",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    serve.extend(args.serve_args.iter().cloned());
    let mut env: Vec<(String, String)> = args
        .malloc_mmap_threshold
        .map(|b| ("MALLOC_MMAP_THRESHOLD_".to_string(), b.to_string()))
        .into_iter()
        .collect();
    for kv in &args.server_env {
        match kv.split_once('=') {
            Some((k, v)) if !k.is_empty() && !k.contains('\0') && !v.contains('\0') => {
                env.push((k.to_string(), v.to_string()));
            }
            _ => {
                return Err(Error::Config(format!(
                    "--server-env {kv:?} must be KEY=VALUE"
                )))
            }
        }
    }
    let server = Server::start(exe, &args.data_dir, &serve, &env)?;
    let pid = server.pid();
    let http = agent();
    let status = get_json(&http, &format!("{}/api/status", server.url))?;
    let shards = status["shards"].as_array().map_or(1, Vec::len).max(1) as u32;
    let workers = args.connections.div_ceil(shards as usize);
    // Baseline: the server up, one status served, nothing else.
    std::thread::sleep(Duration::from_secs(2));
    let rss_base_mib = rss_mib(pid);
    let fds_base = fd_count(pid);
    let ctx = Arc::new(ChurnCtx {
        url: server.url.clone(),
        addr: server.addr,
        agent: agent(),
        open: AtomicUsize::new(0),
        peak: AtomicUsize::new(0),
        handshakes: AtomicUsize::new(0),
        pulls: AtomicU64::new(0),
        failures: AtomicUsize::new(0),
        reasons: Mutex::new(Vec::new()),
        pull_every: Duration::from_secs_f64(args.pull_every.max(0.1)),
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(32)
        .enable_all()
        .build()
        .map_err(|e| Error::io("runtime", e))?;
    let poller = Poller::start(&server.url);
    let started = Instant::now();
    let (mut rss_peak_mib, mut rss_after_mib, mut fds_peak, mut fds_after) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.rounds {
        let third = Duration::from_secs_f64(args.round_seconds / 3.0);
        let t0 = rt.block_on(async { tokio::time::Instant::now() });
        let tasks: Vec<_> = (0..workers)
            .map(|i| {
                let offset = third.mul_f64(i as f64 / workers as f64);
                let arrive = t0 + offset;
                let leave = t0 + 2 * third + offset;
                rt.spawn(churn_worker(ctx.clone(), shards, arrive, leave, i % 2 == 0))
            })
            .collect();
        // The peak: the middle of the round, every worker connected.
        std::thread::sleep(third.mul_f64(1.5));
        rss_peak_mib.push(rss_mib(pid));
        fds_peak.push(fd_count(pid));
        let deadline = Instant::now() + third.mul_f64(1.5) + Duration::from_secs(60);
        rt.block_on(async {
            for t in tasks {
                let left = deadline.saturating_duration_since(Instant::now());
                if tokio::time::timeout(left, t).await.is_err() {
                    ctx.fail(&Error::Task("a worker did not finish in time".into()));
                }
            }
        });
        settle(
            &http,
            &server.url,
            pid,
            fds_base,
            2,
            Duration::from_secs(20),
        );
        std::thread::sleep(AFTER_WAIT);
        rss_after_mib.push(rss_mib(pid));
        fds_after.push(fd_count(pid));
    }
    let seconds = started.elapsed().as_secs_f64();
    let (mut times, poll_failures) = poller.finish();
    rt.shutdown_timeout(Duration::from_secs(5));
    times.sort_by(f64::total_cmp);
    let reasons = ctx.reasons.lock().map(|r| r.clone()).unwrap_or_default();
    Ok(Churn {
        connections: workers * shards as usize,
        rounds: args.rounds,
        handshakes: ctx.handshakes.load(Ordering::Relaxed),
        pulls: ctx.pulls.load(Ordering::Relaxed),
        failures: ctx.failures.load(Ordering::Relaxed),
        failure_reasons: reasons,
        peak_open: ctx.peak.load(Ordering::Relaxed),
        polls: times.len(),
        poll_failures,
        status_p50_ms: percentile(&times, 0.5),
        status_p99_ms: percentile(&times, 0.99),
        status_max_ms: times.last().copied().unwrap_or(0.0),
        rss_base_mib,
        rss_peak_mib,
        rss_after_mib,
        fds_base,
        fds_peak,
        fds_after,
        seconds,
    })
}

fn list<T: std::fmt::Display>(v: &[T], unit: &str) -> String {
    v.iter()
        .map(|x| format!("{x}{unit}"))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// `crowdgrad bench churn`: runs [`churn`] and prints its figures.
///
/// # Errors
/// As [`churn`].
pub fn cli_churn(args: &ChurnArgs) -> Result<()> {
    let exe = std::env::current_exe().map_err(|e| Error::io("current exe", e))?;
    let c = churn(&exe, args)?;
    let mib = |v: &[f64]| {
        list(
            &v.iter().map(|x| format!("{x:.0}")).collect::<Vec<_>>(),
            " MiB",
        )
    };
    println!("| figure | value |");
    println!("|---|---|");
    println!(
        "| connections | {} per round × {} rounds ({:.0} s), peak {} open |",
        c.connections, c.rounds, c.seconds, c.peak_open
    );
    println!(
        "| handshakes / pulls / failures | {} / {} / {} |",
        c.handshakes, c.pulls, c.failures
    );
    println!(
        "| status latency p50 / p99 / max | {:.1} / {:.1} / {:.1} ms ({} polls, {} failed) |",
        c.status_p50_ms, c.status_p99_ms, c.status_max_ms, c.polls, c.poll_failures
    );
    println!(
        "| server RSS base; peak; after each round | {:.0} MiB; {}; {} |",
        c.rss_base_mib,
        mib(&c.rss_peak_mib),
        mib(&c.rss_after_mib)
    );
    println!(
        "| server fds base; peak; after each round | {}; {}; {} |",
        c.fds_base,
        list(&c.fds_peak, ""),
        list(&c.fds_after, "")
    );
    for r in &c.failure_reasons {
        println!("failure: {r}");
    }
    Ok(())
}

// ----------------------------------------------------------------------------------- flood

/// The attacker: a joined worker flooding every shard with pushes from 127.0.0.2, plus idle
/// WebSockets that never say Hello. Runs until `stop`.
async fn attack(
    addr: SocketAddr,
    url: String,
    idle: usize,
    zero: bool,
    stop: Arc<AtomicBool>,
    counts: Arc<[AtomicU64; 3]>,
) {
    const FROM: [u8; 4] = [127, 0, 0, 2];
    let mut tasks = Vec::new();
    for _ in 0..idle {
        let (stop, counts) = (stop.clone(), counts.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                match open(addr, FROM, "/ws/shard/0").await {
                    Ok(mut ws) => {
                        counts[2].fetch_add(1, Ordering::Relaxed);
                        // Hold it until the server closes it (Hello timeout) or the run ends.
                        while !stop.load(Ordering::Relaxed) {
                            let r = tokio::time::timeout(Duration::from_millis(200), ws.next());
                            if let Ok(None | Some(Err(_))) = r.await {
                                break;
                            }
                        }
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            }
        }));
    }
    let joined = {
        let url = url.clone();
        match tokio::task::spawn_blocking(move || join(&agent(), &url)).await {
            Ok(Ok(j)) => Some(j),
            _ => None,
        }
    };
    if let Some(joined) = joined {
        for (s, d) in joined.run.shards.iter().enumerate() {
            let (stop, counts, joined, path) =
                (stop.clone(), counts.clone(), joined.clone(), d.path.clone());
            let n = d.range.len();
            tasks.push(tokio::spawn(async move {
                let Ok(mut ws) = open(addr, FROM, &path).await else {
                    return;
                };
                counts[2].fetch_add(1, Ordering::Relaxed);
                let Ok(version) = hello(&mut ws, &joined, s as u32).await else {
                    return;
                };
                let (mut tx, mut rx) = ws.split();
                let acked = {
                    let (stop, counts) = (stop.clone(), counts.clone());
                    tokio::spawn(async move {
                        while !stop.load(Ordering::Relaxed) {
                            match tokio::time::timeout(Duration::from_millis(200), rx.next()).await
                            {
                                Ok(Some(Ok(Message::Binary(b)))) => {
                                    if let Ok(Frame::Ack { .. }) = wire::decode(&b, usize::MAX) {
                                        counts[1].fetch_add(1, Ordering::Relaxed);
                                    }
                                }
                                Ok(None | Some(Err(_))) => break,
                                _ => {}
                            }
                        }
                    })
                };
                // Zeros, or a fixed pattern of ±1e-3: the norm of a real gradient, no signal.
                let grad: Vec<f32> = (0..n)
                    .map(
                        |i| match (zero, (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 63) {
                            (true, _) => 0.0,
                            (false, 0) => 1e-3,
                            _ => -1e-3,
                        },
                    )
                    .collect();
                let mut rid = 2u32;
                while !stop.load(Ordering::Relaxed) {
                    let f = wire::encode_push(rid, s as u32, version, 32, &grad);
                    if tx.send(Message::Binary(f.into())).await.is_err() {
                        break;
                    }
                    counts[0].fetch_add(1, Ordering::Relaxed);
                    rid += 1;
                }
                let _ = acked.await;
            }));
        }
    }
    for t in tasks {
        let _ = t.await;
    }
}

/// `--flag value` pairs that switch every limit off.
const LIMITS_OFF: [&str; 10] = [
    "--push-rate",
    "0",
    "--push-rate-per-ip",
    "0",
    "--max-connections-per-ip",
    "0",
    "--join-rate",
    "0",
    "--download-rate",
    "0",
];

/// One flood run: the honest workers' figures with the given limits, attacked or not.
///
/// # Errors
/// When the server or a worker cannot be started.
pub fn flood_run(
    exe: &Path,
    args: &FloodArgs,
    limits: &'static str,
    attacked: bool,
) -> Result<FloodRun> {
    let mut serve: Vec<String> = Vec::new();
    match limits {
        "off" => serve.extend(LIMITS_OFF.iter().map(|s| s.to_string())),
        "tight" => serve.extend(["--push-rate".to_string(), args.tight_push_rate.to_string()]),
        _ => {}
    }
    serve.extend(args.serve_args.iter().cloned());
    let server = Server::start(exe, &args.data_dir, &serve, &[])?;
    let stop = Arc::new(AtomicBool::new(false));
    let counts: Arc<[AtomicU64; 3]> = Arc::new(Default::default());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| Error::io("runtime", e))?;
    let attacker = attacked.then(|| {
        rt.spawn(attack(
            server.addr,
            server.url.clone(),
            args.idle,
            args.attack_grad == "zero",
            stop.clone(),
            counts.clone(),
        ))
    });
    if attacked {
        // The flood is on before the honest workers arrive.
        std::thread::sleep(Duration::from_secs(1));
    }
    let mut children = Vec::new();
    let mut readers = Vec::new();
    for i in 0..args.workers {
        let mut child = Command::new(exe)
            .args([
                "work",
                "--quiet",
                "--json",
                "--server",
                &server.url,
                "--name",
            ])
            .arg(format!("honest-{i}"))
            .arg("--seconds")
            .arg(args.seconds.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| Error::io("starting a worker", e))?;
        let mut out = child.stdout.take();
        readers.push(std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(o) = out.as_mut() {
                let _ = o.read_to_string(&mut s);
            }
            s
        }));
        children.push(child);
    }
    let deadline = Instant::now() + Duration::from_secs_f64(args.seconds + 60.0);
    for c in &mut children {
        loop {
            if matches!(c.try_wait(), Ok(Some(_))) {
                break;
            }
            if Instant::now() >= deadline {
                let _ = c.kill();
                let _ = c.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let summaries: Vec<serde_json::Value> = readers
        .into_iter()
        .filter_map(|h| h.join().ok())
        .filter_map(|s| serde_json::from_str(s.trim()).ok())
        .collect();
    let status = get_json(&agent(), &format!("{}/api/status", server.url))?;
    stop.store(true, Ordering::Relaxed);
    if let Some(a) = attacker {
        let _ = rt.block_on(async { tokio::time::timeout(Duration::from_secs(10), a).await });
    }
    rt.shutdown_timeout(Duration::from_secs(2));
    drop(server);
    if summaries.len() != args.workers {
        return Err(Error::Task(format!(
            "{} of {} honest workers printed a summary",
            summaries.len(),
            args.workers
        )));
    }
    let u = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
    let mut refused_by_reason = std::collections::BTreeMap::new();
    for shard in status["shards"].as_array().into_iter().flatten() {
        for (k, v) in shard["rejected_by_reason"]
            .as_object()
            .into_iter()
            .flatten()
        {
            *refused_by_reason.entry(k.clone()).or_insert(0) += u(v);
        }
    }
    let honest_samples_per_sec = summaries
        .iter()
        .map(|s| {
            let wall = s["stats"]["wall_s"].as_f64().unwrap_or(0.0);
            if wall > 0.0 {
                u(&s["stats"]["samples"]) as f64 / wall
            } else {
                0.0
            }
        })
        .sum();
    Ok(FloodRun {
        limits,
        attacked,
        honest_samples_per_sec,
        honest_accepted: summaries
            .iter()
            .map(|s| u(&s["stats"]["pushes_accepted"]))
            .sum(),
        honest_sent: summaries
            .iter()
            .map(|s| u(&s["stats"]["pushes_sent"]))
            .sum(),
        attack_pushes: counts[0].load(Ordering::Relaxed),
        attack_acked: counts[1].load(Ordering::Relaxed),
        attack_connections: counts[2].load(Ordering::Relaxed),
        limits_status: status["limits"].clone(),
        refused_by_reason,
    })
}

/// Runs every configuration `repeat` times, interleaved.
///
/// # Errors
/// As [`flood_run`].
pub fn flood(exe: &Path, args: &FloodArgs) -> Result<Vec<FloodRun>> {
    if !matches!(args.attack_grad.as_str(), "noise" | "zero") {
        return Err(Error::Config(format!(
            "--attack-grad {} must be noise or zero",
            args.attack_grad
        )));
    }
    let mut runs = Vec::new();
    for _ in 0..args.repeat.max(1) {
        for (limits, attacked) in CONFIGS {
            runs.push(flood_run(exe, args, limits, attacked)?);
        }
    }
    Ok(runs)
}

/// The configurations of [`flood`], in order.
const CONFIGS: [(&str, bool); 6] = [
    ("default", false),
    ("off", false),
    ("tight", false),
    ("default", true),
    ("off", true),
    ("tight", true),
];

/// `crowdgrad bench flood`: runs [`flood`] and prints a row per run, then the medians.
///
/// # Errors
/// As [`flood`].
pub fn cli_flood(args: &FloodArgs) -> Result<()> {
    let exe = std::env::current_exe().map_err(|e| Error::io("current exe", e))?;
    let runs = flood(&exe, args)?;
    println!("| limits | attacker | honest samples/s | honest pushes accepted/sent | attack pushes sent / applied | attack connections | refused by limits | pushes refused by reason |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in &runs {
        let l = &r.limits_status;
        let refused = l
            .as_object()
            .map(|m| {
                m.iter()
                    .filter(|(k, v)| k.as_str() != "connections_open" && v.as_u64() > Some(0))
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default();
        let reasons = r
            .refused_by_reason
            .iter()
            .filter(|(_, v)| **v > 0)
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ");
        println!(
            "| {} | {} | {:.0} | {}/{} | {} / {} | {} | {} | {} |",
            r.limits,
            if r.attacked { "flood" } else { "none" },
            r.honest_samples_per_sec,
            r.honest_accepted,
            r.honest_sent,
            r.attack_pushes,
            r.attack_acked,
            r.attack_connections,
            if refused.is_empty() {
                "-".into()
            } else {
                refused
            },
            if reasons.is_empty() {
                "-".into()
            } else {
                reasons
            }
        );
    }
    // Samples whose pushes were applied: what the run gained from the honest workers.
    let applied = |r: &FloodRun| {
        r.honest_samples_per_sec * r.honest_accepted as f64 / r.honest_sent.max(1) as f64
    };
    let median = |limits: &str, attacked: bool| {
        let mut v: Vec<f64> = runs
            .iter()
            .filter(|r| r.limits == limits && r.attacked == attacked)
            .map(applied)
            .collect();
        v.sort_by(f64::total_cmp);
        percentile(&v, 0.5)
    };
    let base = median("off", false).max(1e-9);
    println!();
    for (limits, attacked) in CONFIGS {
        let m = median(limits, attacked);
        println!(
            "median honest samples/s applied, limits {limits}, {}: {m:.0} ({:.1}% of limits off without attacker)",
            if attacked { "attacked" } else { "no attacker" },
            100.0 * m / base
        );
    }
    Ok(())
}
