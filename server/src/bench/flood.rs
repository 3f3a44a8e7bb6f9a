//! `crowdgrad bench flood`: do limits slow well-behaved workers down?
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
use crowdgrad_core::wire::{self, Message as Frame};
use futures_util::{SinkExt, StreamExt};
use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_tungstenite::tungstenite::Message;

use super::load::*;

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
                let mut grad: Vec<f32> = (0..n)
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
                    // One value flipped per push: the same gradient twice is refused as a
                    // replay (issue 21), and a flooder would make each push differ.
                    if !zero && n > 0 {
                        let i = rid as usize % n;
                        grad[i] = -grad[i];
                    }
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
const LIMITS_OFF: [&str; 12] = [
    "--push-rate",
    "0",
    "--push-rate-per-ip",
    "0",
    "--max-connections-per-ip",
    "0",
    "--max-connections-per-prefix",
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
    // The limits, as recorded before issue 21's defaults: spot checks off (the flooder's raw
    // pushes carry no tag, and a spot-checking shard would close it at its first push rather
    // than the limits hold it). `serve_args` may turn them on again.
    let mut serve: Vec<String> = vec!["--spot-check".into(), "0".into()];
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
                    .filter(|(k, v)| {
                        // Gauges and counts of what was let in, not refusals.
                        !matches!(
                            k.as_str(),
                            "connections_open"
                                | "connections_accepted"
                                | "connections_unauthenticated"
                                | "connections_authenticated"
                        ) && v.as_u64() > Some(0)
                    })
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
