//! `crowdgrad bench churn` (issue 10): a server strangers can join,
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
//! Everything stays on loopback, every loop is bounded by a deadline, and the server process is
//! killed when a run ends or fails.

use crate::error::{Error, Result};
use clap::Args;
use crowdgrad_core::wire::{self, Bye, Message as Frame};
use futures_util::SinkExt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_tungstenite::tungstenite::Message;

use super::load::*;

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
        "--max-connections-per-prefix",
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
