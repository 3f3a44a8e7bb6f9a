//! `crowdgrad bench`: end-to-end figures that need real processes and sockets.
//!
//! - `e2e`: a `crowdgrad serve` process and N `crowdgrad work` processes on loopback; reports
//!   samples/s, applied steps/s, time to 95% test accuracy and peak RSS of each process.
//! - `roundtrip`: push + pull round trip over one loopback WebSocket for a shard of a given size.
//! - `link` ([`link`]): training over plain loopback and a shaped link (issue 8): samples/s,
//!   bytes per sample, times to 95% / 97%, compute utilisation, per exchange configuration.
//! - `churn` and `flood` ([`churn`]): 1,000 WebSocket connections joining and leaving (status
//!   latency, server RSS and fds before, at peak, after), and honest workers' samples/s with
//!   default limits vs none, with and without a flooding attacker (issue 10).
//! - `crowd` ([`crowd`]): a crowd of simulated volunteers speaking the real protocol from one
//!   process (joins, a socket per shard, pulls, pushes, reports, dashboards) against one
//!   `serve`: RSS per volunteer, CPU, fds, bytes/s per dashboard and per socket, round trips,
//!   per phase (issue 18).
//! - `checkpoint` ([`checkpoint`]): checkpoint time and size for the MLP and a 10M-parameter
//!   model, and samples/s with `--checkpoint-every 1` against none (issue 9).
//! - `ledger` ([`ledger`]): the contribution ledger's SQLite database with 1,000,000
//!   identities: insert rate, file size, rank and top-10 query latency (issue 18).
//! - `attack` ([`attack`]): every attack of issue 21 against a default and a spot-checking
//!   `serve`, and what happened, in figures.

pub mod attack;
pub mod checkpoint;
pub mod churn;
pub mod crowd;
mod crowdprocs;
pub mod crowdrun;
pub mod flood;
pub mod ledger;
pub mod link;
mod load;
pub mod outliers;

use crate::config::ServeConfig;
use crate::error::{Error, Result};
use crate::support::data::TrainTest;
use crowdgrad_core::spec::{JoinRequest, JoinResponse};
use crowdgrad_core::wire::{self, ClientKind, Hello, Message as Frame, PROTOCOL_VERSION};
use futures_util::{SinkExt, StreamExt};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio_tungstenite::tungstenite::Message;

/// Result of one end-to-end run.
#[derive(Debug, Clone)]
pub struct E2e {
    /// Workers.
    pub workers: usize,
    /// Examples per second applied by the server over the run.
    pub samples_per_sec: f64,
    /// Pushes applied per second on shard 0 (= worker steps per second).
    pub steps_per_sec: f64,
    /// Seconds from the first worker start to the first evaluation at >= 95%.
    pub to_95: Option<f64>,
    /// Final test accuracy.
    pub accuracy: f64,
    /// Server peak RSS, MiB.
    pub server_rss_mib: f64,
    /// Largest worker peak RSS, MiB.
    pub worker_rss_mib: f64,
    /// Server CPU time (user + system, all threads) per worker step, ms, over the same window
    /// as the rates: what a step costs the parameter server, whatever else runs on the machine.
    pub server_cpu_ms_per_step: f64,
    /// Worker CPU time per step (all worker processes together over all their steps), ms.
    pub worker_cpu_ms_per_step: f64,
    /// The 1-minute load average when the run ended (how busy the machine was).
    pub load_avg: f64,
}

impl E2e {
    /// The header of [`E2e::row`]'s Markdown table.
    pub const HEADER: &'static str = "| workers | samples/s | steps/s | time to 95% | final accuracy | server peak RSS | worker peak RSS | server CPU/step | worker CPU/step | load avg |\n|---|---|---|---|---|---|---|---|---|---|";

    /// This run as a row of a Markdown table under [`E2e::HEADER`].
    pub fn row(&self) -> String {
        format!(
            "| {} | {:.0} | {:.0} | {} | {:.2}% | {:.0} MiB | {:.0} MiB | {:.3} ms | {:.3} ms | {:.2} |",
            self.workers,
            self.samples_per_sec,
            self.steps_per_sec,
            self.to_95
                .map_or("not reached".into(), |t| format!("{t:.1} s")),
            self.accuracy * 100.0,
            self.server_rss_mib,
            self.worker_rss_mib,
            self.server_cpu_ms_per_step,
            self.worker_cpu_ms_per_step,
            self.load_avg,
        )
    }
}

/// CPU time (user + system) process `pid` has used so far, seconds, from `/proc/PID/stat`
/// (Linux; in clock ticks of 1/100 s, the USER_HZ of every Linux ABI); 0 when unreadable.
fn cpu_seconds(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            // The fields after the command name (which may hold spaces) in parentheses.
            let rest = &s[s.rfind(')')? + 1..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
            let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
            Some(ticks as f64 / 100.0)
        })
        .unwrap_or(0.0)
}

/// The 1-minute load average (Linux), 0 when unreadable.
fn load_avg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

struct Killer(Vec<Child>);

impl Drop for Killer {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn status(url: &str) -> Result<serde_json::Value> {
    let mut r = ureq::get(&format!("{url}/api/status"))
        .call()
        .map_err(|e| Error::Http(e.to_string()))?;
    let b = r
        .body_mut()
        .with_config()
        .limit(64 << 20)
        .read_to_vec()
        .map_err(|e| Error::Http(e.to_string()))?;
    serde_json::from_slice(&b).map_err(|e| Error::Http(e.to_string()))
}

/// Runs the end-to-end benchmark with `workers` worker processes for `seconds`.
///
/// # Errors
/// When a process cannot be started or the server does not come up.
pub fn e2e(
    exe: &Path,
    data_dir: &Path,
    workers: usize,
    seconds: f64,
    serve_args: &[String],
) -> Result<E2e> {
    let mut serve = Command::new(exe);
    serve
        .args(["serve", "--addr", "127.0.0.1:0", "--no-fetch"])
        // Evaluate often enough to time the climb to 95%, unless the caller chose a period.
        .args(
            (!serve_args.iter().any(|a| a.starts_with("--eval-every")))
                .then_some(["--eval-every", "0.25"])
                .into_iter()
                .flatten(),
        )
        .arg("--data-dir")
        .arg(data_dir)
        .args(serve_args);
    // Its stdout is drained to the end: the server prints more after its listening line (the
    // admin token), and a closed pipe would end it.
    let (server, url) = link::start_server(serve, Duration::from_secs(60))?;
    let server_pid = server.id();
    let mut procs = Killer(vec![server]);
    let started = Instant::now();
    let mut worker_pids = Vec::new();
    for _ in 0..workers {
        let w = Command::new(exe)
            .args(["work", "--quiet", "--server", &url, "--seconds"])
            .arg(seconds.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| Error::io("starting a worker", e))?;
        worker_pids.push(w.id());
        procs.0.push(w);
    }
    let mut to_95 = None;
    let mut worker_rss: f64 = 0.0;
    // (when, samples, shard 0 version, server CPU s, workers' CPU s)
    let mut first: Option<(Instant, u64, u64, f64, f64)> = None;
    let mut last = (Instant::now(), 0u64, 0u64, 0.0, 0.0);
    while started.elapsed().as_secs_f64() < seconds - 0.3 {
        std::thread::sleep(Duration::from_millis(100));
        for pid in &worker_pids {
            worker_rss = worker_rss.max(rss_mib(*pid));
        }
        let Ok(s) = status(&url) else { continue };
        let samples = s["totals"]["samples"].as_u64().unwrap_or(0);
        let steps = s["shards"][0]["version"].as_u64().unwrap_or(0);
        let cpu = (
            cpu_seconds(server_pid),
            worker_pids.iter().map(|p| cpu_seconds(*p)).sum::<f64>(),
        );
        if first.is_none() && samples > 0 {
            first = Some((Instant::now(), samples, steps, cpu.0, cpu.1));
        }
        last = (Instant::now(), samples, steps, cpu.0, cpu.1);
        if to_95.is_none() && s["eval"]["accuracy"].as_f64().unwrap_or(0.0) >= 0.95 {
            to_95 = Some(started.elapsed().as_secs_f64());
        }
    }
    let (t0, s0, v0, sc0, wc0) = first.unwrap_or(last);
    let dt = last.0.duration_since(t0).as_secs_f64().max(1e-9);
    let steps = (last.2 - v0).max(1) as f64;
    let load = load_avg();
    std::thread::sleep(Duration::from_millis(600));
    let accuracy = status(&url)
        .ok()
        .and_then(|s| s["eval"]["accuracy"].as_f64())
        .unwrap_or(0.0);
    let server_rss_mib = rss_mib(server_pid);
    drop(procs);
    Ok(E2e {
        workers,
        samples_per_sec: (last.1 - s0) as f64 / dt,
        steps_per_sec: (last.2 - v0) as f64 / dt,
        to_95,
        accuracy,
        server_rss_mib,
        worker_rss_mib: worker_rss,
        server_cpu_ms_per_step: (last.3 - sc0) * 1e3 / steps,
        worker_cpu_ms_per_step: (last.4 - wc0) * 1e3 / steps,
        load_avg: load,
    })
}

/// Round-trip figures for one shard size.
#[derive(Debug, Clone)]
pub struct RoundTrip {
    /// Parameters in the shard.
    pub params: usize,
    /// Mean push+pull round trip.
    pub mean_ms: f64,
    /// Median.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Payload MB/s moved (push + params).
    pub mb_per_sec: f64,
}

/// Measures push + pull round trips against an in-process one-shard server whose model has
/// about `params` parameters.
///
/// # Errors
/// On socket or protocol failures.
pub async fn roundtrip(data: TrainTest, params: usize, iters: usize) -> Result<RoundTrip> {
    let features = data.train.features;
    let classes = data.train.classes();
    let hidden = ((params.saturating_sub(classes)) / (features + 1 + classes)).max(1);
    let mut cfg = ServeConfig::defaults("unused");
    cfg.training.model = format!("mlp:{hidden}");
    cfg.training.shards = 1;
    cfg.training.optimizer.rule = crowdgrad_core::optim::Rule::Sgd;
    cfg.training.optimizer.lr = 1e-9;
    cfg.eval_every = Duration::from_secs(3600);
    // The wire's round trip, not the spot checker: its raw push carries no tag, which a
    // spot-checking shard (the default since issue 21) refuses.
    cfg.spot.fraction = 0.0;
    let server = crate::start(
        "127.0.0.1:0"
            .parse()
            .map_err(|_| Error::Process("addr".into()))?,
        cfg,
        data,
    )
    .await?;
    let url = server.url();
    let body = serde_json::to_vec(&JoinRequest::new(ClientKind::Native))
        .map_err(|e| Error::Http(e.to_string()))?;
    let join_url = format!("{url}/api/join");
    let joined: JoinResponse = tokio::task::spawn_blocking(move || -> Result<JoinResponse> {
        let mut r = ureq::post(&join_url)
            .header("content-type", "application/json")
            .send(&body[..])
            .map_err(|e| Error::Http(e.to_string()))?;
        let b = r
            .body_mut()
            .read_to_vec()
            .map_err(|e| Error::Http(e.to_string()))?;
        serde_json::from_slice(&b).map_err(|e| Error::Http(e.to_string()))
    })
    .await
    .map_err(|e| Error::Http(e.to_string()))??;
    let n = joined.run.shards[0].range.len();
    let ws_url = format!("ws://{}{}", server.addr, joined.run.shards[0].path);
    let (mut ws, _) = tokio_tungstenite::connect_async(ws_url.as_str())
        .await
        .map_err(|e| Error::WebSocket(e.to_string()))?;
    let hello = wire::encode(&Frame::Hello {
        request_id: 1,
        shard: 0,
        hello: Hello {
            protocol: PROTOCOL_VERSION,
            worker_id: joined.worker_id,
            credential: joined.credential.clone(),
            client: ClientKind::Native,
            ..Default::default()
        },
    });
    ws.send(Message::Binary(hello.into()))
        .await
        .map_err(|e| Error::WebSocket(e.to_string()))?;
    ws.next().await;
    let grad = vec![1e-3f32; n];
    let mut times = Vec::with_capacity(iters);
    let mut version = 0;
    for i in 0..iters + 5 {
        let t = Instant::now();
        let push = wire::encode_push(2, 0, version, 1, &grad);
        ws.send(Message::Binary(push.into()))
            .await
            .map_err(|e| Error::WebSocket(e.to_string()))?;
        let pull = wire::encode(&Frame::Pull {
            min_version: 0,
            request_id: 3,
            shard: 0,
        });
        ws.send(Message::Binary(pull.into()))
            .await
            .map_err(|e| Error::WebSocket(e.to_string()))?;
        for _ in 0..2 {
            match ws.next().await {
                Some(Ok(Message::Binary(b))) => {
                    if let Ok(Frame::Params { version: v, .. }) = wire::decode(&b, usize::MAX) {
                        version = v;
                    }
                }
                other => return Err(Error::WebSocket(format!("unexpected reply {other:?}"))),
            }
        }
        if i >= 5 {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    drop(ws);
    server.stop().await?;
    let mean = times.iter().sum::<f64>() / times.len().max(1) as f64;
    times.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        times
            .get(((times.len() as f64 - 1.0) * p) as usize)
            .copied()
            .unwrap_or(0.0)
    };
    Ok(RoundTrip {
        params: n,
        mean_ms: mean,
        p50_ms: pct(0.5),
        p99_ms: pct(0.99),
        mb_per_sec: (2.0 * 4.0 * n as f64 / 1e6) / (mean / 1e3),
    })
}
