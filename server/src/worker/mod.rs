//! The native worker: `crowdgrad work`. It joins over HTTP, downloads its data partition, opens
//! one WebSocket per shard (tokio-tungstenite) and drives core's sans-IO
//! [`crowdgrad_core::worker::Worker`]: the same training logic the browser worker runs.
//!
//! If the server goes away it reconnects after core's [`crowdgrad_core::backoff::Backoff`] (the
//! one policy every worker and the simulator share) and joins again (the server may have
//! restarted with a new run), keeping its counters.
//!
//! Every network wait has a deadline ([`Timeouts`]): the join and each download (a whole-request
//! deadline and a stall deadline per read), each WebSocket connect, and the reply to a pull or
//! push; when one passes the session counts as lost and the worker reconnects with backoff.
//! Every wait also races the stop signal, so Ctrl-C or SIGTERM ends the worker at once (a
//! blocking HTTP call is left to its own deadline on a helper thread that the runtime does not
//! wait for; see `main.rs`). `https://` servers are reached over TLS (rustls, webpki roots, or
//! `--ca FILE`), their shards over `wss://`.
//!
//! With [`WorkOptions::threads`] > 1 the process runs that many worker loops, each on an OS
//! thread of its own with a single-threaded runtime and sockets of its own, joined as the
//! threads of one volunteer ([`Threads`]: the server gives them one partition, downloaded
//! once into a cache they share, and its dashboard shows one volunteer). Every rule above
//! holds per thread; the stop signal reaches all of them; the progress bar sums them.

pub mod args;

use crate::error::{Error, Result};
use crowdgrad_core::backoff::{self, Backoff};
use crowdgrad_core::data::Dataset;
use crowdgrad_core::fault::{self, Collusion, Fault, Faults};
use crowdgrad_core::rng::Rng;
use crowdgrad_core::spec::{JoinRequest, JoinResponse, Threads, MAX_THREADS};
use crowdgrad_core::wire::{self, Bye, ClientKind, Message as Frame};
use crowdgrad_core::worker::{Worker, WorkerStats};
use futures_util::{SinkExt, StreamExt};
use serde::Serialize;
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;

/// What `crowdgrad work` was asked to do.
#[derive(Debug, Clone)]
pub struct WorkOptions {
    /// Base URL of the server, e.g. `http://127.0.0.1:8080`.
    pub server: String,
    /// Stop after this many steps.
    pub steps: Option<u64>,
    /// Stop after this long.
    pub duration: Option<Duration>,
    /// Display name sent on join.
    pub name: Option<String>,
    /// Show a progress bar.
    pub progress: bool,
    /// Longest wait between reconnection attempts, jitter included (the cap of core's
    /// [`Backoff`]).
    pub max_backoff: Duration,
    /// Extra time each gradient step takes (to play a slow volunteer in experiments).
    pub step_delay: Duration,
    /// The volunteer's stable identity sent with every join (the server's contribution
    /// ledger credits it across sessions); `None`: not credited.
    pub identity: Option<String>,
    /// A private run's join token (sent as `Authorization: Bearer`).
    pub join_token: Option<String>,
    /// Trust only the certificates in this PEM file for `https://` servers (a self-signed
    /// test server) instead of the webpki roots.
    pub ca: Option<std::path::PathBuf>,
    /// Deadlines of the network waits.
    pub timeouts: Timeouts,
    /// Worker loops to run in parallel (1 to [`MAX_THREADS`]), as threads of one volunteer;
    /// `steps` and `duration` apply to each.
    pub threads: usize,
    /// Play a faulty worker (`--fault`, for experiments on robust rules and spot checks): its
    /// pushes are rewritten by core's [`Faults`] (colluders agree through the run's seed,
    /// [`Collusion::Seeded`]), or, for [`Fault::ShuffledLabels`], it trains on its partition
    /// with the labels permuted. Nothing in the join or the Hello says so: the server has to
    /// find out by itself. Applies to every thread.
    pub fault: Option<Fault>,
}

/// How long the worker waits for the network before it gives the session up and reconnects.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timeouts {
    /// TCP (and TLS) connect, for HTTP and each WebSocket (with its upgrade).
    pub connect: Duration,
    /// A whole HTTP request: the join, or one data file (a partition is ~7.5 MiB).
    pub http: Duration,
    /// No byte received for this long during an HTTP request: the link stalled.
    pub stall: Duration,
    /// No frame from any shard for this long while the worker waits for a reply to its pulls
    /// or pushes (a held SSP/sync pull included).
    pub reply: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(10),
            http: Duration::from_secs(300),
            stall: Duration::from_secs(30),
            reply: Duration::from_secs(30),
        }
    }
}

impl WorkOptions {
    /// Options for `server` with no limit, no progress bar and the standard backoff cap
    /// ([`backoff::CAP_S`]).
    pub fn new(server: impl Into<String>) -> Self {
        Self {
            server: server.into(),
            steps: None,
            duration: None,
            name: None,
            progress: false,
            max_backoff: Duration::from_secs_f64(backoff::CAP_S),
            step_delay: Duration::ZERO,
            identity: None,
            join_token: None,
            ca: None,
            timeouts: Timeouts::default(),
            threads: 1,
            fault: None,
        }
    }
}

/// The default of `crowdgrad work --threads`: every core but one (left to the volunteer), at
/// least one.
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get().saturating_sub(1))
        .max(1)
}

/// What a worker did, printed at the end.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// Worker ids it was given (one per session).
    pub worker_ids: Vec<u64>,
    /// Counters over all sessions.
    pub stats: WorkerStats,
    /// Wall time.
    pub seconds: f64,
    /// Examples per second.
    pub samples_per_sec: f64,
    /// Sessions (1 + reconnections).
    pub sessions: u32,
    /// Peak resident memory of the process, KiB (Linux).
    pub peak_rss_kib: Option<u64>,
    /// Why the last session ended badly, if it did.
    pub last_error: Option<String>,
    /// The server refused to let the worker join (a private run and a missing or wrong
    /// `--join-token`): the worker gave up instead of retrying.
    pub refused: bool,
    /// Worker loops it ran ([`WorkOptions::threads`]); the counters are their sums.
    pub threads: usize,
}

/// The identity kept in `path` (created with 32 random hex digits when missing): how
/// `crowdgrad work` stays the same volunteer across runs.
///
/// # Errors
/// When the file cannot be read or created, or holds an unusable identity.
pub fn identity_from_file(path: &std::path::Path) -> Result<String> {
    match std::fs::read_to_string(path) {
        Ok(s) => {
            let id = s.trim().to_string();
            crate::registry::ledger::check_identity(&id)
                .map_err(|m| Error::Config(format!("identity file {}: {m}", path.display())))?;
            Ok(id)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let bytes = crate::support::credential::run_secret()
                .map_err(|e| Error::io("drawing an identity", e))?;
            let id: String = bytes[..16].iter().map(|b| format!("{b:02x}")).collect();
            if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)
                    .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
            }
            std::fs::write(path, format!("{id}\n"))
                .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
            Ok(id)
        }
        Err(e) => Err(Error::io(format!("reading {}", path.display()), e)),
    }
}

/// Peak resident set size of this process in KiB, from /proc (Linux only).
pub fn peak_rss_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

fn base_urls(server: &str) -> Result<(String, String)> {
    let s = server.trim_end_matches('/');
    let (rest, ws) = match (s.strip_prefix("http://"), s.strip_prefix("https://")) {
        (Some(rest), _) => (rest, "ws"),
        (_, Some(rest)) => (rest, "wss"),
        _ => {
            return Err(Error::Config(format!(
                "server URL {server:?} must start with http:// or https:// (e.g. http://127.0.0.1:8080)"
            )))
        }
    };
    if rest.is_empty() || rest.contains('/') {
        return Err(Error::Config(format!(
            "server URL {server:?} must be a base address like http://HOST:PORT"
        )));
    }
    Ok((s.to_string(), format!("{ws}://{rest}")))
}

/// The worker's HTTP agent and WebSocket TLS connector, built once from its options.
#[derive(Clone)]
struct Net {
    agent: ureq::Agent,
    tls: Option<tokio_tungstenite::Connector>,
    token: Option<String>,
    timeouts: Timeouts,
}

impl Net {
    fn new(opts: &WorkOptions) -> Result<Self> {
        let t = opts.timeouts;
        let mut tls = ureq::tls::TlsConfig::builder().provider(ureq::tls::TlsProvider::Rustls);
        let mut ws_tls = None;
        if let Some(ca) = &opts.ca {
            let certs: Vec<ureq::tls::Certificate<'static>> = crate::support::tls::certs(ca)?
                .iter()
                .map(|c| ureq::tls::Certificate::from_der(c.as_ref()).to_owned())
                .collect();
            tls = tls.root_certs(ureq::tls::RootCerts::new_with_certs(&certs));
            ws_tls = Some(tokio_tungstenite::Connector::Rustls(
                crate::support::tls::client_config(Some(ca))?,
            ));
        }
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .tls_config(tls.build())
            .timeout_connect(Some(t.connect))
            .timeout_global(Some(t.http))
            .timeout_per_read(Some(t.stall))
            .timeout_per_write(Some(t.stall))
            .build()
            .into();
        Ok(Self {
            agent,
            tls: ws_tls,
            token: opts.join_token.clone(),
            timeouts: t,
        })
    }
}

fn http_error(e: ureq::Error) -> Error {
    Error::Http(e.to_string())
}

/// Most bytes accepted in one HTTP response (a data partition).
const MAX_BODY: u64 = 1 << 30;

/// Why a join failed: worth retrying, or not (the run is private and our token is wrong).
enum JoinError {
    Retry(Error),
    Refused(String),
}

impl From<Error> for JoinError {
    fn from(e: Error) -> Self {
        JoinError::Retry(e)
    }
}

async fn join(
    net: &Net,
    http: &str,
    name: Option<String>,
    identity: Option<String>,
    threads: Option<Threads>,
) -> std::result::Result<JoinResponse, JoinError> {
    let url = format!("{http}/api/join");
    let mut req = JoinRequest::new(ClientKind::Native);
    req.name = name;
    req.identity = identity;
    req.threads = threads;
    let body = serde_json::to_vec(&req).map_err(|e| Error::Http(e.to_string()))?;
    let net2 = net.clone();
    let (status, bytes) = tokio::task::spawn_blocking(move || -> Result<(u16, Vec<u8>)> {
        let mut post = net2
            .agent
            .post(&url)
            .header("content-type", "application/json");
        if let Some(t) = &net2.token {
            post = post.header("authorization", format!("Bearer {t}"));
        }
        let mut resp = post.send(&body[..]).map_err(http_error)?;
        let status = resp.status().as_u16();
        let bytes = resp
            .body_mut()
            .with_config()
            .limit(1 << 20)
            .read_to_vec()
            .map_err(http_error)?;
        Ok((status, bytes))
    })
    .await
    .map_err(|e| Error::Task(format!("join request: {e}")))??;
    let text = || {
        String::from_utf8_lossy(&bytes)
            .chars()
            .take(500)
            .collect::<String>()
    };
    match status {
        200..=299 => serde_json::from_slice(&bytes)
            .map_err(|e| JoinError::Retry(Error::Http(format!("bad join reply: {e}")))),
        401 | 403 => Err(JoinError::Refused(format!(
            "join refused ({status}): {}{}",
            text(),
            // 403 is also a quarantined identity: the token hint is only for 401.
            match (status, net.token.is_some()) {
                (403, _) => "",
                (_, true) => " (is --join-token right?)",
                (_, false) => " (this run needs --join-token)",
            }
        ))),
        _ => Err(JoinError::Retry(Error::Http(format!(
            "join refused ({status}): {}",
            text()
        )))),
    }
}

async fn get(net: &Net, url: String) -> Result<Vec<u8>> {
    let agent = net.agent.clone();
    tokio::task::spawn_blocking(move || -> Result<Vec<u8>> {
        let mut resp = agent.get(&url).call().map_err(http_error)?;
        let status = resp.status();
        if !status.is_success() {
            return Err(Error::Http(format!("GET {url}: {status}")));
        }
        resp.body_mut()
            .with_config()
            .limit(MAX_BODY)
            .read_to_vec()
            .map_err(http_error)
    })
    .await
    .map_err(|e| Error::Task(format!("download: {e}")))?
}

enum End {
    /// Steps or time limit reached, or asked to stop.
    Done,
    /// The connection was lost or refused.
    Lost(String),
    /// The server will not let this worker in (wrong or missing join token): retrying is
    /// pointless.
    Refused(String),
}

/// What each thread of a `--threads` worker last reported: its worker id and counters.
type Slots = Arc<Mutex<Vec<(Option<u64>, WorkerStats)>>>;

struct Progress {
    bar: Option<indicatif::ProgressBar>,
    /// With several threads: where this one posts its counters (the bar sums them).
    slot: Option<(Slots, usize)>,
    last: Instant,
}

fn spinner() -> indicatif::ProgressBar {
    let b = indicatif::ProgressBar::new_spinner();
    b.set_style(
        indicatif::ProgressStyle::with_template("{spinner} [{elapsed_precise}] {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    b
}

impl Progress {
    fn update(&mut self, id: u64, stats: &WorkerStats, started: Instant, force: bool) {
        if !force && self.last.elapsed() < Duration::from_millis(200) {
            return;
        }
        self.last = Instant::now();
        if let Some((slots, i)) = &self.slot {
            if let Some(s) = slots.lock().unwrap_or_else(|p| p.into_inner()).get_mut(*i) {
                *s = (Some(id), stats.clone());
            }
        }
        let Some(bar) = &self.bar else { return };
        let rate = stats.samples as f64 / started.elapsed().as_secs_f64().max(1e-9);
        bar.set_message(format!(
            "worker {id} | {} samples | {rate:.0} samples/s | loss {:.4} | pushes {} ok, {} rejected | staleness {}",
            stats.samples, stats.ema_loss, stats.pushes_accepted, stats.pushes_rejected, stats.last_staleness
        ));
        bar.tick();
    }
}

/// Data partitions downloaded so far, by images path, shared by a worker's threads.
type Cache = Arc<tokio::sync::Mutex<HashMap<String, Dataset>>>;

/// How one worker loop takes part in its process.
struct ThreadCtx {
    /// As joined (`None`: a worker of one thread, joined as before threads existed).
    threads: Option<Threads>,
    cache: Cache,
    progress: Progress,
}

/// Runs a native worker until its step or time limit, or until `shutdown` completes: one
/// worker loop, or [`WorkOptions::threads`] of them as threads of one volunteer.
///
/// # Errors
/// Only for bad options (a malformed server URL, a thread count outside 1..=256) or when a
/// thread cannot be started; network trouble is retried with backoff and reported in the
/// summary.
pub async fn work(opts: WorkOptions, shutdown: impl Future<Output = ()>) -> Result<Summary> {
    base_urls(&opts.server)?;
    if !(1..=MAX_THREADS as usize).contains(&opts.threads) {
        return Err(Error::Config(format!(
            "--threads {} is outside 1..={MAX_THREADS}",
            opts.threads
        )));
    }
    let net = Net::new(&opts)?;
    if opts.threads == 1 {
        let ctx = ThreadCtx {
            threads: None,
            cache: Cache::default(),
            progress: Progress {
                bar: opts.progress.then(spinner),
                slot: None,
                last: Instant::now(),
            },
        };
        return run_loop(&opts, &net, ctx, shutdown).await;
    }
    work_threads(opts, net, shutdown).await
}

/// A key for this process' threads to join under ([`Threads::volunteer`]): 32 random hex
/// digits.
fn volunteer_key() -> Result<String> {
    let bytes =
        crate::support::credential::run_secret().map_err(|e| Error::io("drawing a key", e))?;
    Ok(bytes[..16].iter().map(|b| format!("{b:02x}")).collect())
}

/// How long threads asked to stop may take before [`work`] returns without them (each one's
/// waits race the stop, so they take milliseconds; this bounds a thread stuck in a step).
const THREADS_STOP_WITHIN: Duration = Duration::from_millis(1500);

async fn work_threads(
    opts: WorkOptions,
    net: Net,
    shutdown: impl Future<Output = ()>,
) -> Result<Summary> {
    let n = opts.threads;
    let started = Instant::now();
    let volunteer = volunteer_key()?;
    let cache = Cache::default();
    let slots: Slots = Arc::new(Mutex::new(vec![(None, WorkerStats::default()); n]));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut finished = futures_util::stream::FuturesUnordered::new();
    for index in 0..n {
        let (tx, rx) = tokio::sync::oneshot::channel::<Result<Summary>>();
        let ctx = ThreadCtx {
            threads: Some(Threads {
                volunteer: volunteer.clone(),
                index: index as u32,
                count: n as u32,
            }),
            cache: cache.clone(),
            progress: Progress {
                bar: None,
                slot: Some((slots.clone(), index)),
                last: Instant::now(),
            },
        };
        let (opts, net, mut stop) = (opts.clone(), net.clone(), stop_rx.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("crowdgrad-worker-{index}"))
            .spawn(move || {
                let r = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| Error::io("building a runtime", e))
                    .and_then(|rt| {
                        let stopped = async move {
                            let _ = stop.wait_for(|s| *s).await;
                        };
                        let r = rt.block_on(run_loop(&opts, &net, ctx, stopped));
                        // An HTTP call stuck on a stalled link sits on a blocking thread until
                        // its own deadline: do not wait for it.
                        rt.shutdown_timeout(Duration::from_millis(100));
                        r
                    });
                let _ = tx.send(r);
            });
        if let Err(e) = spawned {
            let _ = stop_tx.send(true);
            return Err(Error::io("starting a worker thread", e));
        }
        finished.push(rx);
    }
    drop(stop_rx);
    let bar = opts.progress.then(spinner);
    let render = |force: bool| {
        let Some(bar) = &bar else { return };
        let slots = slots.lock().unwrap_or_else(|p| p.into_inner());
        let ids: Vec<String> = slots
            .iter()
            .map(|(id, _)| id.map_or_else(|| "-".into(), |i| i.to_string()))
            .collect();
        let sum = sum_stats(slots.iter().map(|(_, s)| s));
        let rate = sum.samples as f64 / started.elapsed().as_secs_f64().max(1e-9);
        bar.set_message(format!(
            "{n} threads, workers {} | {} samples | {rate:.0} samples/s | loss {:.4} | pushes {} ok, {} rejected | staleness {}",
            ids.join(","), sum.samples, sum.ema_loss, sum.pushes_accepted, sum.pushes_rejected, sum.last_staleness
        ));
        if force {
            bar.tick();
        }
    };
    let mut summaries = Vec::with_capacity(n);
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    let mut stop_by: Option<tokio::time::Instant> = None;
    let mut lost_threads = 0usize;
    tokio::pin!(shutdown);
    while summaries.len() + lost_threads < n {
        let give_up = async {
            match stop_by {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = finished.next() => match r {
                Some(Ok(s)) => {
                    let s = s?;
                    summaries.push(s);
                }
                // The thread died without an answer (a panic): count it, keep the others.
                Some(Err(_)) => lost_threads += 1,
                None => break,
            },
            _ = &mut shutdown, if stop_by.is_none() => {
                let _ = stop_tx.send(true);
                stop_by = Some(tokio::time::Instant::now() + THREADS_STOP_WITHIN);
            }
            _ = give_up => {
                tracing::warn!("{} threads did not stop within {THREADS_STOP_WITHIN:?}", n - summaries.len());
                lost_threads = n - summaries.len();
            }
            _ = tick.tick() => render(true),
        }
    }
    // Threads that ended by themselves (limits) leave the others running: stop them all.
    let _ = stop_tx.send(true);
    render(true);
    if let Some(b) = &bar {
        b.finish();
    }
    let seconds = started.elapsed().as_secs_f64();
    let stats = sum_stats(summaries.iter().map(|s| &s.stats));
    let mut last_error = summaries.iter().find_map(|s| s.last_error.clone());
    if lost_threads > 0 {
        last_error = Some(format!("{lost_threads} of {n} threads did not report"));
    }
    Ok(Summary {
        worker_ids: summaries
            .iter()
            .flat_map(|s| s.worker_ids.clone())
            .collect(),
        samples_per_sec: stats.samples as f64 / seconds.max(1e-9),
        stats,
        seconds,
        sessions: summaries.iter().map(|s| s.sessions).sum(),
        peak_rss_kib: peak_rss_kib(),
        last_error,
        refused: summaries.iter().any(|s| s.refused),
        threads: n,
    })
}

/// The counters of several threads as one worker's: counts add up, the loss is their mean,
/// staleness and read skew their largest.
fn sum_stats<'a>(all: impl Iterator<Item = &'a WorkerStats>) -> WorkerStats {
    let mut sum = WorkerStats::default();
    let mut n = 0u32;
    for s in all {
        n += 1;
        sum.steps += s.steps;
        sum.samples += s.samples;
        sum.pushes_sent += s.pushes_sent;
        sum.pushes_accepted += s.pushes_accepted;
        sum.pushes_rejected += s.pushes_rejected;
        sum.pushes_lost += s.pushes_lost;
        sum.last_loss += s.last_loss;
        sum.ema_loss += s.ema_loss;
        sum.last_staleness = sum.last_staleness.max(s.last_staleness);
        sum.max_staleness = sum.max_staleness.max(s.max_staleness);
        sum.staleness_sum += s.staleness_sum;
        sum.read_skew = sum.read_skew.max(s.read_skew);
        sum.rounds += s.rounds;
        sum.local_steps = sum.local_steps.max(s.local_steps);
        sum.compute_s += s.compute_s;
        sum.wall_s = sum.wall_s.max(s.wall_s);
        sum.bytes_up += s.bytes_up;
        sum.bytes_down += s.bytes_down;
        if sum.last_error.is_none() {
            sum.last_error.clone_from(&s.last_error);
        }
    }
    if n > 0 {
        sum.last_loss /= f64::from(n);
        sum.ema_loss /= f64::from(n);
    }
    sum
}

/// One worker loop: sessions with reconnection until its limits or `shutdown`.
async fn run_loop(
    opts: &WorkOptions,
    net: &Net,
    ctx: ThreadCtx,
    shutdown: impl Future<Output = ()>,
) -> Result<Summary> {
    let (http, ws) = base_urls(&opts.server)?;
    let ThreadCtx {
        threads,
        cache,
        mut progress,
    } = ctx;
    let started = Instant::now();
    let deadline = opts.duration.map(|d| started + d);
    let mut stats = WorkerStats::default();
    let mut ids = Vec::new();
    let mut sessions = 0u32;
    let mut backoff = Backoff::new(jitter_seed()).with_cap(opts.max_backoff.as_secs_f64());
    let mut last_error = None;
    let mut refused = false;
    tokio::pin!(shutdown);
    loop {
        let out_of_time = deadline.is_some_and(|d| Instant::now() >= d);
        let out_of_steps = opts.steps.is_some_and(|s| stats.steps >= s);
        if out_of_time || out_of_steps {
            break;
        }
        sessions += 1;
        let steps_before = stats.steps;
        let end = session(
            opts,
            net,
            &http,
            &ws,
            &mut ids,
            threads.as_ref(),
            &cache,
            &mut stats,
            deadline,
            &mut progress,
            started,
            shutdown.as_mut(),
        )
        .await
        .unwrap_or_else(|e| End::Lost(e.to_string()));
        match end {
            End::Done => break,
            End::Refused(why) => {
                tracing::error!(%why, "giving up");
                last_error = Some(why);
                refused = true;
                break;
            }
            End::Lost(why) => {
                if stats.steps > steps_before {
                    // The session trained: a fresh failure, not a repeated one.
                    backoff.reset();
                }
                let delay = Duration::from_secs_f64(backoff.next_delay());
                tracing::warn!(%why, "connection lost; reconnecting in {delay:?}");
                last_error = Some(why);
                let wait = match deadline {
                    Some(d) => delay.min(d.saturating_duration_since(Instant::now())),
                    None => delay,
                };
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = &mut shutdown => break,
                }
            }
        }
    }
    if let Some(id) = ids.last() {
        progress.update(*id, &stats, started, true);
    }
    if let Some(b) = &progress.bar {
        b.finish();
    }
    let seconds = started.elapsed().as_secs_f64();
    Ok(Summary {
        worker_ids: ids,
        samples_per_sec: stats.samples as f64 / seconds.max(1e-9),
        stats,
        seconds,
        sessions,
        peak_rss_kib: peak_rss_kib(),
        last_error,
        refused,
        threads: 1,
    })
}

/// A seed for the backoff's jitter that differs between workers started together (the point
/// of the jitter): the clock's nanoseconds and the process id.
fn jitter_seed() -> u64 {
    // Workers in one process (tests, benches) may read the same clock tick: count them too.
    static STARTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nth = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ (u64::from(std::process::id()) << 32) ^ nth.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// One join + connect + train cycle. Returns `Done` when asked to stop or out of steps/time.
#[allow(clippy::too_many_arguments)]
async fn session(
    opts: &WorkOptions,
    net: &Net,
    http: &str,
    ws: &str,
    ids: &mut Vec<u64>,
    threads: Option<&Threads>,
    cache: &Cache,
    stats: &mut WorkerStats,
    deadline: Option<Instant>,
    progress: &mut Progress,
    started: Instant,
    mut shutdown: std::pin::Pin<&mut impl Future<Output = ()>>,
) -> Result<End> {
    let prepare = async {
        let joined = join(
            net,
            http,
            opts.name.clone(),
            opts.identity.clone(),
            threads.cloned(),
        )
        .await?;
        ids.push(joined.worker_id);
        // The first thread to need the partition downloads it; the others wait for it here.
        let mut cached = cache.lock().await;
        let data = match cached.get(&joined.partition.images) {
            Some(d) => d.clone(),
            None => {
                let images = get(net, format!("{http}{}", joined.partition.images)).await?;
                let labels = get(net, format!("{http}{}", joined.partition.labels)).await?;
                let d = Dataset::from_idx(&images, &labels).map_err(Error::from)?;
                // Bounded: as many partitions as threads (a server without thread support
                // gives each its own); a restarted server's new paths replace the old.
                if cached.len() >= threads.map_or(1, |t| t.count as usize) {
                    cached.clear();
                }
                cached.insert(joined.partition.images.clone(), d.clone());
                d
            }
        };
        drop(cached);
        Ok::<_, JoinError>((joined, data))
    };
    let (joined, data) = tokio::select! {
        r = prepare => match r {
            Ok(x) => x,
            Err(JoinError::Retry(e)) => return Err(e),
            Err(JoinError::Refused(why)) => return Ok(End::Refused(why)),
        },
        _ = &mut shutdown => return Ok(End::Done),
    };
    let data = match opts.fault {
        // The same permutation for a worker id and run seed (a rerun is reproducible).
        Some(Fault::ShuffledLabels) => fault::shuffle_labels(
            &data,
            &mut Rng::new(joined.run.seed ^ joined.worker_id.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
        )?,
        _ => data,
    };
    let mut worker = Worker::new(joined, data, ClientKind::Native, opts.steps)?;
    worker.carry_stats(stats.clone());
    let end = drive(
        &mut worker,
        net,
        ws,
        deadline,
        opts.step_delay,
        opts.max_backoff,
        opts.fault,
        progress,
        started,
        shutdown,
    )
    .await;
    *stats = worker.stats().clone();
    Ok(end)
}

/// What a reader task saw on shard `.0`'s connection of generation `.1`.
enum Event {
    /// A frame as tungstenite read it (a slice of its read buffer: not copied again).
    Frame(usize, u64, bytes::Bytes),
    Closed(usize, u64, String),
}

#[allow(clippy::too_many_arguments)]
async fn drive(
    worker: &mut Worker,
    net: &Net,
    ws: &str,
    deadline: Option<Instant>,
    step_delay: Duration,
    max_backoff: Duration,
    fault: Option<Fault>,
    progress: &mut Progress,
    started: Instant,
    mut shutdown: std::pin::Pin<&mut impl Future<Output = ()>>,
) -> End {
    let shards: Vec<String> = worker
        .join_info()
        .run
        .shards
        .iter()
        .map(|s| {
            // A shard in its own process has an absolute URL (`serve --shard-urls`).
            if s.path.starts_with("ws://") || s.path.starts_with("wss://") {
                s.path.clone()
            } else {
                format!("{ws}{}", s.path)
            }
        })
        .collect();
    let id = worker.join_info().worker_id;
    // A faulty worker's push rewriting (`--fault`; shuffled labels are in its data already):
    // one participant, this session's shards, noise drawn from a seed of its own.
    let mut faulty = fault.filter(|f| *f != Fault::ShuffledLabels).map(|f| {
        let seed = worker.join_info().run.seed;
        (
            f,
            Faults::new(Collusion::Seeded(seed), 1, shards.len()),
            Rng::new(jitter_seed()),
        )
    });
    // Connect to every shard concurrently, within the connect deadline, unless told to stop.
    let conns = futures_util::future::join_all(shards.iter().map(|u| connect_shard(net, u)));
    let conns = tokio::select! {
        c = conns => c,
        _ = &mut shutdown => return End::Done,
    };
    // One reader task per connection; its events carry the connection's generation so that
    // a late event of a replaced connection is ignored.
    let (ev_tx, mut ev_rx) = mpsc::channel::<Event>(256);
    let mut links: Vec<Link> = Vec::new();
    let mut readers = tokio::task::JoinSet::new();
    for (i, c) in conns.into_iter().enumerate() {
        let socket = match c {
            Ok(s) => s,
            Err(e) => return End::Lost(format!("connecting to shard {i}: {e}")),
        };
        links.push(Link::up(i, 0, socket, &ev_tx, &mut readers, max_backoff));
        worker.connected(i);
    }
    // Shards being reconnected: a shard that is lost is retried with backoff while the worker
    // trains on the others (core's `Worker::disconnected`); the session ends only when every
    // shard is lost at once (the server went away: join again).
    let mut reconnects: futures_util::stream::FuturesUnordered<Reconnect<'_>> = Default::default();
    macro_rules! lose {
        ($i:expr, $why:expr) => {{
            let i: usize = $i;
            let why: String = $why;
            worker.disconnected(i);
            let l = &mut links[i];
            l.down();
            if links.iter().all(|l| l.sink.is_none()) {
                break End::Lost(format!("every shard lost (last: shard {i}: {why})"));
            }
            let delay = Duration::from_secs_f64(links[i].backoff.next_delay());
            let generation = links[i].generation;
            tracing::warn!(shard = i, %why, "shard connection lost; the others carry on; reconnecting in {delay:?}");
            let url = shards[i].clone();
            reconnects.push(Box::pin(async move {
                tokio::time::sleep(delay).await;
                (i, generation, connect_shard(net, &url).await)
            }));
        }};
    }
    macro_rules! reconnected {
        ($i:expr, $generation:expr, $r:expr) => {{
            let (i, generation) = ($i, $generation);
            if links[i].generation == generation && links[i].sink.is_none() {
                match $r {
                    Ok(socket) => {
                        tracing::info!(shard = i, "shard connection back");
                        links[i] = Link::up(i, generation + 1, socket, &ev_tx, &mut readers, max_backoff);
                        worker.connected(i);
                    }
                    Err(e) => {
                        let delay = Duration::from_secs_f64(links[i].backoff.next_delay());
                        tracing::debug!(shard = i, %e, "shard still down; retrying in {delay:?}");
                        let url = shards[i].clone();
                        reconnects.push(Box::pin(async move {
                            tokio::time::sleep(delay).await;
                            (i, generation, connect_shard(net, &url).await)
                        }));
                    }
                }
            }
        }};
    }
    // The worker's clock (sans-IO: it measures compute and exchanges on what it is told).
    let clock = Instant::now();
    // Shards with frames queued but not yet flushed: frames are fed to their sinks and each
    // shard's are flushed once, so a step's push and pull to one shard leave in one write and
    // the shard answers both in one (one syscall and one wake-up each side instead of two).
    let mut queued = vec![false; links.len()];
    let end = loop {
        let mut send_failed = None;
        worker.set_time(clock.elapsed().as_secs_f64());
        while let Some(out) = worker.poll_transmit() {
            let Some(sink) = links[out.shard].sink.as_mut() else {
                continue;
            };
            // A link that stopped taking bytes must not hold the worker (nor its stop).
            let reply = net.timeouts.reply;
            queued[out.shard] = true;
            let frame = match faulty.as_mut() {
                Some((f, faults, rng)) => faults.corrupt(0, out.frame, *f, rng).0,
                None => out.frame,
            };
            let send = tokio::time::timeout(reply, sink.feed(Message::Binary(frame.into())));
            let sent = tokio::select! {
                r = send => r,
                _ = &mut shutdown => return End::Done,
            };
            match sent {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    send_failed = Some((out.shard, format!("sending to shard {}: {e}", out.shard)));
                    break;
                }
                Err(_) => {
                    send_failed = Some((
                        out.shard,
                        format!("shard {} took no bytes for {reply:?}", out.shard),
                    ));
                    break;
                }
            }
        }
        for (i, link) in links.iter_mut().enumerate() {
            let failed = send_failed.as_ref().is_some_and(|(f, _)| *f == i);
            let flag = std::mem::take(&mut queued[i]);
            let Some(sink) = link.sink.as_mut().filter(|_| flag && !failed) else {
                continue;
            };
            let reply = net.timeouts.reply;
            let flushed = tokio::select! {
                r = tokio::time::timeout(reply, sink.flush()) => r,
                _ = &mut shutdown => return End::Done,
            };
            let why = match flushed {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => format!("sending to shard {i}: {e}"),
                Err(_) => format!("shard {i} took no bytes for {reply:?}"),
            };
            send_failed.get_or_insert((i, why));
        }
        if let Some((i, why)) = send_failed {
            lose!(i, why);
            continue;
        }
        if worker.is_done() || deadline.is_some_and(|d| Instant::now() >= d) {
            break End::Done;
        }
        if worker.ready() {
            worker.set_time(clock.elapsed().as_secs_f64());
            let t = Instant::now();
            if let Err(e) = worker.step() {
                break End::Lost(e.to_string());
            }
            worker.observe_compute(t.elapsed().as_secs_f64());
            // Frames that arrived meanwhile (the next round's parameters, acks) are taken now,
            // between steps, so a round of local steps does not delay them.
            let (mut lost, mut closed) = (None, None);
            while let Ok(ev) = ev_rx.try_recv() {
                worker.set_time(clock.elapsed().as_secs_f64());
                match ev {
                    Event::Frame(i, g, bytes) if links[i].current(g) => {
                        if let Err(e) = worker.receive(i, &bytes) {
                            lost = Some(format!("shard {i}: {e}"));
                            break;
                        }
                    }
                    Event::Closed(i, g, why) if links[i].current(g) => {
                        closed = Some((i, why));
                        break;
                    }
                    _ => {}
                }
            }
            if let Some(why) = lost {
                break End::Lost(why);
            }
            if let Some((i, why)) = closed {
                lose!(i, format!("closed: {why}"));
            }
            while let Some(Some((i, g, r))) =
                futures_util::FutureExt::now_or_never(reconnects.next())
            {
                reconnected!(i, g, r);
            }
            progress.update(id, worker.stats(), started, false);
            if !step_delay.is_zero() {
                tokio::select! {
                    _ = tokio::time::sleep(step_delay) => {}
                    _ = &mut shutdown => break End::Done,
                }
            }
            continue;
        }
        let until = deadline.map_or_else(
            || tokio::time::Instant::now() + Duration::from_secs(86_400),
            Into::into,
        );
        // Waiting for replies: one must come within the reply deadline.
        let reply = net.timeouts.reply;
        let ev = tokio::select! {
            ev = ev_rx.recv() => ev,
            Some((i, g, r)) = reconnects.next(), if !reconnects.is_empty() => {
                reconnected!(i, g, r);
                continue;
            }
            _ = tokio::time::sleep_until(until) => break End::Done,
            _ = tokio::time::sleep(reply) => {
                break End::Lost(format!("no reply from the shards within {reply:?}"))
            }
            _ = &mut shutdown => break End::Done,
        };
        worker.set_time(clock.elapsed().as_secs_f64());
        match ev {
            Some(Event::Frame(i, g, bytes)) if links[i].current(g) => {
                if let Err(e) = worker.receive(i, &bytes) {
                    break End::Lost(format!("shard {i}: {e}"));
                }
            }
            Some(Event::Closed(i, g, why)) if links[i].current(g) => {
                lose!(i, format!("closed: {why}"));
            }
            Some(_) => {}
            None => break End::Lost("all connections closed".into()),
        }
    };
    drop(reconnects);
    // Say goodbye on every connection that is still open, all at once and briefly (a stalled
    // link must not hold up a worker asked to stop).
    let byes = links
        .into_iter()
        .enumerate()
        .filter_map(|(i, l)| l.sink.map(|s| (i, s)))
        .map(|(i, mut sink)| async move {
            let bye = wire::encode(&Frame::Bye {
                shard: i as u32,
                bye: Bye {
                    reason: "worker leaving".into(),
                },
            });
            let _ = tokio::time::timeout(Duration::from_millis(500), async {
                let _ = sink.send(Message::Binary(bye.into())).await;
                let _ = sink.close().await;
            })
            .await;
        });
    futures_util::future::join_all(byes).await;
    readers.abort_all();
    end
}

type WsStream =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;
type WsSink = futures_util::stream::SplitSink<WsStream, Message>;
/// A pending reconnect of one shard: its index, the generation it replaces, the outcome.
type Reconnect<'a> = std::pin::Pin<
    Box<dyn Future<Output = (usize, u64, std::result::Result<WsStream, String>)> + Send + 'a>,
>;

/// Opens the WebSocket to one shard within the connect deadline.
async fn connect_shard(net: &Net, url: &str) -> std::result::Result<WsStream, String> {
    let connect = net.timeouts.connect;
    let c = tokio_tungstenite::connect_async_tls_with_config(url, None, true, net.tls.clone());
    match tokio::time::timeout(connect, c).await {
        Ok(r) => r.map(|(s, _)| s).map_err(|e| e.to_string()),
        Err(_) => Err(format!("no connection within {connect:?}")),
    }
}

/// The worker's connection to one shard: its sink while up, its reader, and the backoff of
/// its reconnects.
struct Link {
    sink: Option<WsSink>,
    reader: Option<tokio::task::AbortHandle>,
    /// Bumped by every new connection: events of an older one are ignored.
    generation: u64,
    backoff: Backoff,
}

impl Link {
    fn up(
        i: usize,
        generation: u64,
        socket: WsStream,
        events: &mpsc::Sender<Event>,
        readers: &mut tokio::task::JoinSet<()>,
        max_backoff: Duration,
    ) -> Self {
        let (sink, mut stream) = socket.split();
        let tx = events.clone();
        let reader = readers.spawn(async move {
            loop {
                let ev = match stream.next().await {
                    Some(Ok(Message::Binary(b))) => Event::Frame(i, generation, b),
                    Some(Ok(Message::Close(c))) => Event::Closed(
                        i,
                        generation,
                        c.map_or_else(|| "closed".into(), |c| c.reason.to_string()),
                    ),
                    Some(Ok(_)) => continue,
                    Some(Err(e)) => Event::Closed(i, generation, e.to_string()),
                    None => Event::Closed(i, generation, "closed".into()),
                };
                let closed = matches!(ev, Event::Closed(..));
                if tx.send(ev).await.is_err() || closed {
                    break;
                }
            }
        });
        Self {
            sink: Some(sink),
            reader: Some(reader),
            generation,
            backoff: Backoff::new(jitter_seed()).with_cap(max_backoff.as_secs_f64()),
        }
    }

    /// The connection is gone: stop its reader, drop its sink.
    fn down(&mut self) {
        if let Some(r) = self.reader.take() {
            r.abort();
        }
        self.sink = None;
    }

    /// Whether an event of `generation` is about the current connection.
    fn current(&self, generation: u64) -> bool {
        self.sink.is_some() && self.generation == generation
    }
}

/// A worker running on a thread of its own with a single-threaded runtime (how tests and
/// benches run several workers in one process without sharing the server's runtime).
#[derive(Debug)]
pub struct WorkerThread {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    kill: Option<tokio::sync::oneshot::Sender<()>>,
    handle: std::thread::JoinHandle<Option<Result<Summary>>>,
}

impl WorkerThread {
    /// Starts a worker with `opts`.
    pub fn spawn(opts: WorkOptions) -> Self {
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (kill, kill_rx) = tokio::sync::oneshot::channel::<()>();
        let handle = std::thread::spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => return Some(Err(Error::io("building a runtime", e))),
            };
            rt.block_on(async move {
                let stopped = async move {
                    let _ = stop_rx.await;
                };
                tokio::select! {
                    r = work(opts, stopped) => Some(r),
                    // Dropping the worker mid-flight closes its sockets without a goodbye, as
                    // a crashed process would.
                    _ = kill_rx => None,
                }
            })
        });
        Self {
            stop: Some(stop),
            kill: Some(kill),
            handle,
        }
    }

    /// True once the worker has returned.
    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// Asks the worker to stop (it says goodbye) and waits for its summary.
    ///
    /// # Errors
    /// What [`work`] returned, or an error when the thread panicked.
    pub fn stop(mut self) -> Result<Summary> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.join()
    }

    /// Waits for the worker to finish by itself (step or time limit).
    ///
    /// # Errors
    /// As [`WorkerThread::stop`].
    pub fn join(self) -> Result<Summary> {
        match self.handle.join() {
            Ok(Some(r)) => r,
            Ok(None) => Err(Error::Task("worker was killed".into())),
            Err(_) => Err(Error::Task("worker thread panicked".into())),
        }
    }

    /// Kills the worker abruptly: its connections drop without Bye or Close frames.
    pub fn kill(mut self) {
        if let Some(k) = self.kill.take() {
            let _ = k.send(());
        }
        let _ = self.handle.join();
    }
}
