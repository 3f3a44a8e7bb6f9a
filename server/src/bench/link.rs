//! `crowdgrad bench link`: training over a shaped link (issue 8's benchmark).
//!
//! For each link (`loopback`: the host's plain loopback; `NNmbit`: a private network namespace
//! whose loopback is shaped with `tc tbf` to NN Mbit/s) and each exchange configuration (`f32`,
//! `bf16`, `int8`, `int8+overlap`, `auto`, `auto:MAX`, `hN`), it starts a `crowdgrad serve`
//! process and N `crowdgrad work` processes (inside the namespace for a shaped link, through
//! `ip netns exec`), lets the workers run for a fixed time, then reads the server's
//! `/api/status` once and the workers' JSON summaries. It prints one Markdown row per run:
//! samples/s, bytes per sample up and down (the server's `totals`), push frame size, time to
//! 95% and 97% test accuracy, final accuracy, compute utilisation (the workers' `exchange`
//! views, `compute_share`) and the `H` each worker ended with; then the targets, each
//! marked met or missed.
//!
//! Nothing polls the server during a run: on a shaped link every request to the server crosses
//! the shaped loopback (the namespace has no other interface), so the one status read happens
//! after the workers stopped. Times come from the server's evaluation history (`time_s`, seconds
//! since the server started) aligned with the moment the workers were started; the set-up time
//! (join + data download, ~7.5 MiB per worker) is each worker's wall time minus its training
//! time, from its summary.
//!
//! [`Netns`] is the namespace guard (also used by the integration test `link`): it creates the
//! namespace, brings its loopback up with MTU 1500 (64 KiB loopback packets otherwise overflow
//! the token bucket and the link stalls), adds the qdisc, and deletes the namespace when
//! dropped. Namespaces left behind by a killed run (named after a process that no longer
//! exists) are deleted on the next start.

use crate::error::{Error, Result};
use clap::Args;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Flags of `crowdgrad bench link`.
#[derive(Debug, Clone, Args)]
pub struct LinkArgs {
    /// Links to run on: `loopback` (the host's plain loopback) and/or `NNmbit` (a private
    /// network namespace whose loopback is shaped to NN Mbit/s; needs root).
    #[arg(long, value_delimiter = ',', default_value = "loopback,20mbit")]
    pub links: Vec<String>,
    /// Exchange configurations: `f32` (f32 both ways, H = 1, no overlap: protocol version 1),
    /// `bf16` (bf16 both ways), `int8` (bf16 pulls, int8 block pushes with error feedback),
    /// `int8+overlap` (the same with the next pull in flight), `auto` / `auto:MAX` (local steps
    /// chosen by each worker, bf16/int8), `hN` (N local steps, bf16/int8).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "f32,bf16,int8,int8+overlap,auto,auto:4096"
    )]
    pub configs: Vec<String>,
    /// Worker processes per run.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Runs of every configuration per link (interleaved: each repetition runs every config
    /// once); the targets use the medians.
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Seconds each worker runs (from its start: join, data download, training).
    #[arg(long, default_value_t = 30.0)]
    pub seconds: f64,
    /// Steps (gradients, or inner steps with local steps) each worker computes before it
    /// stops, so every configuration trains on the same number of examples (`--seconds` still
    /// caps the run): the quality comparison at equal samples.
    #[arg(long)]
    pub steps: Option<u64>,
    /// The server's evaluation period (the resolution of the times to 95% / 97%).
    #[arg(long, default_value_t = 0.25)]
    pub eval_every: f64,
    /// Data directory.
    #[arg(long, default_value = "data/mnist")]
    pub data_dir: PathBuf,
    /// Internal: print the body of a GET of this URL and exit (how the bench reads a server
    /// inside a namespace: it runs itself there).
    #[arg(long, hide = true)]
    pub fetch: Option<String>,
    /// Extra flags for every `serve` (e.g. --shards 1).
    #[arg(last = true)]
    pub serve_args: Vec<String>,
}

/// A link to run on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Link {
    /// The host's loopback, unshaped.
    Loopback,
    /// A namespace's loopback shaped to this many Mbit/s.
    Shaped(f64),
}

impl Link {
    /// Parses `loopback` or `NNmbit`.
    ///
    /// # Errors
    /// [`Error::Config`] for anything else.
    pub fn parse(s: &str) -> Result<Link> {
        let t = s.trim();
        if t == "loopback" {
            return Ok(Link::Loopback);
        }
        match t.strip_suffix("mbit").map(str::parse::<f64>) {
            Some(Ok(r)) if r.is_finite() && (0.1..=10_000.0).contains(&r) => Ok(Link::Shaped(r)),
            _ => Err(Error::Config(format!(
                "link {t:?}: use loopback or NNmbit (0.1 to 10000)"
            ))),
        }
    }

    fn name(self) -> String {
        match self {
            Link::Loopback => "loopback".into(),
            Link::Shaped(r) => format!("{r}mbit"),
        }
    }
}

/// The `serve` flags of an exchange configuration name. The H = 1 configurations also set
/// `--egress-budget off`: they are the exchange as it was before `serve` defaulted to `auto`
/// and a 400 Mbit/s budget (issue 18), which would otherwise hold their pulls on loopback;
/// `auto` runs with the default budget, as shipped.
///
/// # Errors
/// [`Error::Config`] for an unknown name.
pub fn config_flags(name: &str) -> Result<Vec<String>> {
    let compressed = ["--pull-encoding", "bf16", "--push-encoding", "int8_block"];
    let flags: Vec<&str> = match name {
        "f32" => vec![
            "--local-steps",
            "1",
            "--overlap",
            "off",
            "--pull-encoding",
            "f32",
            "--push-encoding",
            "f32",
        ],
        "bf16" => vec![
            "--local-steps",
            "1",
            "--overlap",
            "off",
            "--pull-encoding",
            "bf16",
            "--push-encoding",
            "bf16",
        ],
        "int8" => [&["--local-steps", "1", "--overlap", "off"][..], &compressed].concat(),
        "int8+overlap" => [&["--local-steps", "1", "--overlap", "on"][..], &compressed].concat(),
        n if n == "auto" || n.starts_with("auto:") => {
            [&["--local-steps", n][..], &compressed].concat()
        }
        n if n
            .strip_prefix('h')
            .is_some_and(|h| h.parse::<u32>().is_ok()) =>
        {
            [&["--local-steps", &n[1..]][..], &compressed].concat()
        }
        n => {
            return Err(Error::Config(format!(
                "config {n:?}: use f32, bf16, int8, int8+overlap, auto, auto:MAX or hN"
            )))
        }
    };
    let mut flags: Vec<String> = flags.into_iter().map(String::from).collect();
    if flags[..2] == ["--local-steps", "1"] {
        flags.extend(["--egress-budget".into(), "off".into()]);
    }
    Ok(flags)
}

/// A private network namespace with a shaped loopback, deleted when dropped.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

/// Runs `ip ARGS`; the error is what it printed.
fn ip(args: &[&str]) -> std::result::Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running ip (iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Netns {
    /// Creates namespace `{prefix}-{pid}-{n}` with its loopback up at MTU 1500 and, with
    /// `rate_mbit`, `tc qdisc add dev lo root tbf rate {rate}mbit burst 64kb latency 2000ms`.
    /// First deletes namespaces `{prefix}-{pid}-…` of processes that no longer exist.
    ///
    /// # Errors
    /// [`Error::Config`] saying that shaping needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and
    /// what `ip`/`tc` answered, when the namespace cannot be created or shaped.
    pub fn create(prefix: &str, rate_mbit: Option<f64>) -> Result<Netns> {
        reap_stale(prefix);
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("{prefix}-{}-{seq}", std::process::id());
        ip(&["netns", "add", &name]).map_err(|e| {
            Error::Process(format!(
                "cannot create a network namespace (shaping the link needs root): {e}"
            ))
        })?;
        let ns = Netns { name };
        ip(&[
            "netns", "exec", &ns.name, "ip", "link", "set", "lo", "up", "mtu", "1500",
        ])
        .map_err(Error::Process)?;
        if let Some(r) = rate_mbit {
            let rate = format!("{r}mbit");
            ip(&[
                "netns", "exec", &ns.name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                "rate", &rate, "burst", "64kb", "latency", "2000ms",
            ])
            .map_err(|e| Error::Process(format!("cannot shape the namespace's loopback: {e}")))?;
        }
        Ok(ns)
    }

    /// The namespace's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A command that runs `program` inside the namespace (`ip netns exec NAME program`; `ip`
    /// execs it, so the child's pid is the program's).
    pub fn command(&self, program: &Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name]).arg(program);
        c
    }

    /// GETs `url` from inside the namespace by running `exe bench link --fetch URL` there
    /// (`exe` is a `crowdgrad` binary), within `timeout`.
    ///
    /// # Errors
    /// [`Error::Http`] when the request fails or takes longer than `timeout`.
    pub fn fetch(&self, exe: &Path, url: &str, timeout: Duration) -> Result<Vec<u8>> {
        let mut c = self.command(exe);
        c.args(["bench", "link", "--fetch", url]);
        output_within(c, timeout)
            .map_err(|e| Error::Http(format!("GET {url} in the namespace: {e}")))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            eprintln!("could not delete network namespace {}: {e}", self.name);
        }
    }
}

/// Deletes namespaces `{prefix}-{pid}-{n}` whose process is gone (a run killed by a signal).
fn reap_stale(prefix: &str) {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(pid) = name
            .strip_prefix(prefix)
            .and_then(|r| r.strip_prefix('-'))
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = ip(&["netns", "del", name]);
        }
    }
}

/// Runs `c` to completion within `timeout`, returning its stdout (killing it on timeout).
fn output_within(mut c: Command, timeout: Duration) -> std::result::Result<Vec<u8>, String> {
    let mut child = c
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut out = child.stdout.take().ok_or("no stdout")?;
    let reader = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = out.read_to_end(&mut b);
        b
    });
    let status = wait_within(&mut child, timeout);
    let body = reader.join().unwrap_or_default();
    match status {
        Some(s) if s.success() => Ok(body),
        Some(s) => {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = e.read_to_string(&mut err);
            }
            Err(format!("{s}: {}", err.trim()))
        }
        None => Err(format!("no answer within {timeout:?}")),
    }
}

/// Waits for `child` at most `timeout`; kills it and returns `None` when it takes longer.
fn wait_within(child: &mut Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let until = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(s)) => return Some(s),
            Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(50)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

/// GETs `url` directly (on the host's loopback), within `timeout`.
fn get(url: &str, timeout: Duration) -> Result<Vec<u8>> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .build()
        .into();
    let mut r = agent
        .get(url)
        .call()
        .map_err(|e| Error::Http(e.to_string()))?;
    r.body_mut()
        .with_config()
        .limit(64 << 20)
        .read_to_vec()
        .map_err(|e| Error::Http(e.to_string()))
}

/// Kills every child when dropped.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts a `crowdgrad serve` command (stdout is read here, stderr discarded) and waits at
/// most `timeout` for its `crowdgrad listening on URL` line; returns the child and the URL.
/// The rest of its stdout is drained on a thread of its own.
///
/// # Errors
/// When it cannot be started or does not listen in time (it is killed then).
pub fn start_server(mut serve: Command, timeout: Duration) -> Result<(Child, String)> {
    let mut server = serve
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| Error::io("starting the server", e))?;
    let out = server
        .stdout
        .take()
        .ok_or_else(|| Error::Process("no server stdout".into()))?;
    // Killed if it does not come up.
    let mut guard = Children(vec![server]);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        // Read up to the listening line, then drain (the pipe must never fill up).
        let mut tx = Some(tx);
        for line in BufReader::new(out)
            .lines()
            .map_while(std::result::Result::ok)
        {
            if let Some(u) = line.strip_prefix("crowdgrad listening on ") {
                if let Some(t) = tx.take() {
                    let _ = t.send(u.trim().to_string());
                }
            }
        }
    });
    let url = rx
        .recv_timeout(timeout)
        .map_err(|_| Error::Process(format!("the server did not start within {timeout:?}")))?;
    Ok((guard.0.remove(0), url))
}

/// One run's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkRun {
    /// The link.
    pub link: Link,
    /// The configuration name.
    pub config: String,
    /// Examples per second applied by the server, over the training window.
    pub samples_per_sec: f64,
    /// Push frame bytes received per example.
    pub up_per_sample: f64,
    /// Parameter frame bytes sent per example.
    pub down_per_sample: f64,
    /// Mean push frame size, bytes (all shards together: per worker step or round).
    pub push_bytes: f64,
    /// Seconds from starting the workers to the first evaluation at >= 95%.
    pub to_95: Option<f64>,
    /// The same for 97%.
    pub to_97: Option<f64>,
    /// Seconds from starting the workers to the first one training (join + data download).
    pub setup_s: f64,
    /// Test accuracy at the end.
    pub accuracy: f64,
    /// Mean over the workers of their `exchange.compute_share`.
    pub compute_share: f64,
    /// Each worker's `exchange.local_steps` at the end.
    pub local_steps: Vec<u64>,
    /// Each worker's negotiated encodings (pull, push).
    pub encodings: Vec<(String, String)>,
}

/// Runs one configuration on one link: a server and `workers` worker processes for `seconds`.
///
/// # Errors
/// When a process cannot be started, the server does not come up within 60 s, or its status
/// cannot be read.
pub fn run(
    exe: &Path,
    args: &LinkArgs,
    link: Link,
    ns: Option<&Netns>,
    config: &str,
) -> Result<LinkRun> {
    let cmd = |p: &Path| ns.map_or_else(|| Command::new(p), |n| n.command(p));
    let mut serve = cmd(exe);
    serve
        .args([
            "serve",
            "--addr",
            "127.0.0.1:0",
            "--no-fetch",
            "--eval-every",
        ])
        .arg(args.eval_every.to_string())
        .arg("--data-dir")
        .arg(&args.data_dir)
        .args(config_flags(config)?)
        .args(&args.serve_args);
    let (server, url) = start_server(serve, Duration::from_secs(60))?;
    let mut procs = Children(vec![server]);
    let started = Instant::now();
    let mut workers = Vec::new();
    for i in 0..args.workers {
        let mut w = cmd(exe);
        w.args(["work", "--quiet", "--json", "--server", &url, "--name"])
            .arg(format!("bench-{i}"))
            .arg("--seconds")
            .arg(args.seconds.to_string())
            .args(args.steps.map(|n| format!("--steps={n}")))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut child = w.spawn().map_err(|e| Error::io("starting a worker", e))?;
        let mut out = child.stdout.take();
        workers.push(std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(o) = out.as_mut() {
                let _ = o.read_to_string(&mut s);
            }
            s
        }));
        procs.0.push(child);
    }
    // The workers stop by themselves after `seconds`; a stuck one is killed 30 s later.
    let limit = Duration::from_secs_f64(args.seconds + 30.0);
    for c in procs.0.iter_mut().skip(1) {
        let left = limit.saturating_sub(started.elapsed());
        wait_within(c, left.max(Duration::from_millis(1)));
    }
    let summaries: Vec<serde_json::Value> = workers
        .into_iter()
        .filter_map(|h| h.join().ok())
        .filter_map(|s| serde_json::from_str(s.trim()).ok())
        .collect();
    // One more evaluation of the final parameters.
    std::thread::sleep(Duration::from_secs_f64(2.0 * args.eval_every + 0.3));
    let asked = Instant::now();
    let timeout = Duration::from_secs(30);
    let body = match ns {
        Some(n) => n.fetch(exe, &format!("{url}/api/status"), timeout)?,
        None => get(&format!("{url}/api/status"), timeout)?,
    };
    let status: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| Error::Http(format!("status JSON: {e}")))?;
    drop(procs);
    // The server's clock at the moment the workers were started.
    let origin =
        status["uptime_s"].as_f64().unwrap_or(0.0) - asked.duration_since(started).as_secs_f64();
    Ok(figures(link, config, &status, &summaries, origin))
}

/// The figures of one run from the final status, the workers' summaries and the server time
/// at which the workers were started.
fn figures(
    link: Link,
    config: &str,
    status: &serde_json::Value,
    summaries: &[serde_json::Value],
    origin: f64,
) -> LinkRun {
    let totals = &status["totals"];
    let u = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
    let samples = u(&totals["samples"]);
    let pushes = u(&totals["pushes_applied"]) + u(&totals["pushes_rejected"]);
    let shards = status["shards"].as_array().map_or(1, Vec::len).max(1);
    // Set-up: each worker's wall time minus its training time (from its first shard event).
    let setup_s = summaries
        .iter()
        .filter_map(|s| Some(s["seconds"].as_f64()? - s["stats"]["wall_s"].as_f64()?))
        .fold(f64::INFINITY, f64::min);
    let setup_s = if setup_s.is_finite() { setup_s } else { 0.0 };
    let evals: Vec<(f64, u64, f64)> = status["eval_history"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|e| {
                    (
                        e["time_s"].as_f64().unwrap_or(0.0) - origin,
                        u(&e["samples"]),
                        e["accuracy"].as_f64().unwrap_or(0.0),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let to = |x: f64| evals.iter().find(|e| e.2 >= x).map(|e| e.0);
    // Samples/s from the first training moment to the evaluation that saw the final count.
    let end = evals
        .iter()
        .find(|e| e.1 >= samples)
        .map_or(setup_s, |e| e.0);
    let window = (end - setup_s).max(1e-3);
    let workers: Vec<&serde_json::Value> = status["workers"]
        .as_array()
        .map(|w| w.iter().filter(|w| !w["exchange"].is_null()).collect())
        .unwrap_or_default();
    let compute_share = workers
        .iter()
        .filter_map(|w| w["exchange"]["compute_share"].as_f64())
        .sum::<f64>()
        / workers.len().max(1) as f64;
    LinkRun {
        link,
        config: config.to_string(),
        samples_per_sec: samples as f64 / window,
        up_per_sample: u(&totals["bytes_up"]) as f64 / samples.max(1) as f64,
        down_per_sample: u(&totals["bytes_down"]) as f64 / samples.max(1) as f64,
        push_bytes: u(&totals["bytes_up"]) as f64 * shards as f64 / pushes.max(1) as f64,
        to_95: to(0.95),
        to_97: to(0.97),
        setup_s,
        accuracy: status["eval"]["accuracy"].as_f64().unwrap_or(0.0),
        compute_share,
        local_steps: workers
            .iter()
            .map(|w| u(&w["exchange"]["local_steps"]))
            .collect(),
        encodings: workers
            .iter()
            .map(|w| {
                let s = |k: &str| w["exchange"][k].as_str().unwrap_or("?").to_string();
                (s("pull_encoding"), s("push_encoding"))
            })
            .collect(),
    }
}

fn secs(t: Option<f64>, setup: f64) -> String {
    t.map_or("not reached".into(), |t| {
        format!("{t:.1} s ({:.1} s)", t - setup)
    })
}

/// The Markdown table of `runs`.
pub fn table(runs: &[LinkRun]) -> String {
    let mut s = String::from(
        "| link | config | encodings (pull/push) | H | samples/s | up B/sample | down B/sample | push frame | to 95% (training) | to 97% (training) | set-up | final accuracy | compute |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        let enc = r
            .encodings
            .first()
            .map_or("?".into(), |(a, b)| format!("{a}/{b}"));
        let h: Vec<String> = r.local_steps.iter().map(u64::to_string).collect();
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.1} KB | {} | {} | {:.1} s | {:.2}% | {:.1}% |",
            r.link.name(),
            r.config,
            enc,
            h.join(", "),
            r.samples_per_sec,
            r.up_per_sample,
            r.down_per_sample,
            r.push_bytes / 1e3,
            secs(r.to_95, r.setup_s),
            secs(r.to_97, r.setup_s),
            r.setup_s,
            r.accuracy * 100.0,
            r.compute_share * 100.0
        );
    }
    s
}

/// One row per (link, config) from repeated runs: the median of each time (a run that never
/// got there counts as the slowest) and of set-up, samples/s and compute share; the other
/// figures from the median run by time to 97%.
pub fn medians(runs: &[LinkRun]) -> Vec<LinkRun> {
    fn median<T: Clone>(mut v: Vec<T>, cmp: impl Fn(&T, &T) -> std::cmp::Ordering) -> T {
        v.sort_by(cmp);
        v[(v.len() - 1) / 2].clone()
    }
    let mut keys: Vec<(Link, &str)> = Vec::new();
    for r in runs {
        if !keys.contains(&(r.link, r.config.as_str())) {
            keys.push((r.link, r.config.as_str()));
        }
    }
    let slow = |t: &Option<f64>| t.unwrap_or(f64::INFINITY);
    keys.into_iter()
        .map(|(link, config)| {
            let group: Vec<&LinkRun> = runs
                .iter()
                .filter(|r| r.link == link && r.config == config)
                .collect();
            let f = |g: fn(&LinkRun) -> f64| {
                median(group.iter().map(|r| g(r)).collect(), f64::total_cmp)
            };
            let t = |g: fn(&LinkRun) -> Option<f64>| {
                median(group.iter().map(|r| g(r)).collect(), |a, b| {
                    slow(a).total_cmp(&slow(b))
                })
            };
            let mid = median(group.clone(), |a, b| {
                slow(&a.to_97).total_cmp(&slow(&b.to_97))
            });
            LinkRun {
                samples_per_sec: f(|r| r.samples_per_sec),
                to_95: t(|r| r.to_95),
                to_97: t(|r| r.to_97),
                setup_s: f(|r| r.setup_s),
                compute_share: f(|r| r.compute_share),
                ..mid.clone()
            }
        })
        .collect()
}

/// Issue 8's targets over `runs`, one line each, marked met or missed.
pub fn targets(runs: &[LinkRun]) -> String {
    let mut s = String::new();
    let find = |link: Link, c: &str| runs.iter().find(|r| r.link == link && r.config == c);
    let mark = |ok: bool| if ok { "met" } else { "MISSED" };
    if let Some(base) = find(Link::Loopback, "f32") {
        for r in runs.iter().filter(|r| matches!(r.link, Link::Shaped(_))) {
            let (Some(b), Some(t)) = (base.to_97, r.to_97) else {
                let _ = writeln!(
                    s,
                    "- 97% on {} with {}: {} vs loopback f32 {}: MISSED (not reached)",
                    r.link.name(),
                    r.config,
                    secs(r.to_97, r.setup_s),
                    secs(base.to_97, base.setup_s)
                );
                continue;
            };
            let whole = t / b;
            let training = (t - r.setup_s) / (b - base.setup_s).max(1e-9);
            let _ = writeln!(
                s,
                "- 97% on {} with {} in ≤ 2× loopback f32 H=1: {whole:.2}× counting from the workers' start ({}), {training:.2}× counting training only ({})",
                r.link.name(),
                r.config,
                mark(whole <= 2.0),
                mark(training <= 2.0)
            );
        }
    }
    for r in runs.iter().filter(|r| matches!(r.link, Link::Shaped(_))) {
        let _ = writeln!(
            s,
            "- compute utilisation ≥ 70% on {} with {}: {:.0}% ({})",
            r.link.name(),
            r.config,
            r.compute_share * 100.0,
            mark(r.compute_share >= 0.70)
        );
    }
    for link in [Link::Loopback]
        .into_iter()
        .chain(runs.iter().map(|r| r.link))
    {
        if let (Some(f), Some(i)) = (find(link, "f32"), find(link, "int8")) {
            let ratio = i.up_per_sample / f.up_per_sample.max(1e-9);
            let _ = writeln!(
                s,
                "- int8 push bytes ≤ 27% of f32 on {}: {:.1}% ({})",
                link.name(),
                ratio * 100.0,
                mark(ratio <= 0.27)
            );
            break;
        }
    }
    s
}

/// The batch size the extra `serve` flags ask for (32, serve's default, otherwise).
fn batch_of(serve_args: &[String]) -> u64 {
    let mut it = serve_args.iter();
    while let Some(a) = it.next() {
        if let Some(v) = a.strip_prefix("--batch-size=") {
            return v.parse().unwrap_or(32);
        }
        if a == "--batch-size" {
            return it.next().and_then(|v| v.parse().ok()).unwrap_or(32);
        }
    }
    32
}

/// What `crowdgrad bench link` does.
///
/// # Errors
/// Bad flags, a namespace that cannot be created (not root), a run that fails.
pub fn cli(args: &LinkArgs) -> Result<()> {
    if let Some(url) = &args.fetch {
        let body = get(url, Duration::from_secs(20))?;
        use std::io::Write as _;
        std::io::stdout()
            .write_all(&body)
            .map_err(|e| Error::io("writing the body", e))?;
        return Ok(());
    }
    if !(args.seconds.is_finite() && (1.0..=600.0).contains(&args.seconds)) {
        return Err(Error::Config("--seconds must be between 1 and 600".into()));
    }
    if args.steps.is_some_and(|n| !(1..=10_000_000).contains(&n)) {
        return Err(Error::Config(
            "--steps must be between 1 and 10000000".into(),
        ));
    }
    if !(1..=10).contains(&args.repeat) {
        return Err(Error::Config("--repeat must be between 1 and 10".into()));
    }
    if !(1..=16).contains(&args.workers) {
        return Err(Error::Config("--workers must be between 1 and 16".into()));
    }
    if !(args.eval_every.is_finite() && (0.05..=10.0).contains(&args.eval_every)) {
        return Err(Error::Config(
            "--eval-every must be between 0.05 and 10".into(),
        ));
    }
    let links = args
        .links
        .iter()
        .map(|l| Link::parse(l))
        .collect::<Result<Vec<_>>>()?;
    for c in &args.configs {
        config_flags(c)?;
    }
    let exe = std::env::current_exe().map_err(|e| Error::io("finding this executable", e))?;
    let mut runs = Vec::new();
    for link in links {
        let ns = match link {
            Link::Loopback => None,
            Link::Shaped(r) => Some(Netns::create("crowdgrad-bench-link", Some(r))?),
        };
        for _ in 0..args.repeat {
            for c in &args.configs {
                let r = run(&exe, args, link, ns.as_ref(), c)?;
                eprintln!(
                    "{}",
                    table(std::slice::from_ref(&r)).lines().nth(2).unwrap_or("")
                );
                runs.push(r);
            }
        }
    }
    let each = match args.steps {
        Some(n) => format!(
            "{n} steps ({} examples) each, at most {} s",
            n * batch_of(&args.serve_args),
            args.seconds
        ),
        None => format!("{} s each", args.seconds),
    };
    println!(
        "{} workers, {each} (times from the workers' start; in brackets from the first worker's first exchange)\n",
        args.workers
    );
    print!("{}", table(&runs));
    let runs = if args.repeat > 1 {
        let m = medians(&runs);
        println!("\nMedians over {} runs each:\n", args.repeat);
        print!("{}", table(&m));
        m
    } else {
        runs
    };
    println!("\nTargets (issue 8):\n{}", targets(&runs));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_and_configs_parse() {
        assert_eq!(Link::parse("loopback").unwrap(), Link::Loopback);
        assert_eq!(Link::parse("20mbit").unwrap(), Link::Shaped(20.0));
        for bad in ["20", "mbit", "0mbit", "lo", "-5mbit"] {
            assert!(Link::parse(bad).is_err(), "{bad}");
        }
        assert!(config_flags("f32").unwrap().contains(&"f32".to_string()));
        assert_eq!(
            config_flags("auto:64").unwrap()[..2],
            ["--local-steps".to_string(), "auto:64".to_string()]
        );
        assert_eq!(config_flags("h8").unwrap()[1], "8");
        for bad in ["int4", "h", "hx", ""] {
            assert!(config_flags(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn figures_align_the_evaluations_with_the_workers_start() {
        let status = serde_json::json!({
            "uptime_s": 20.0,
            "shards": [{}, {}],
            "totals": {"samples": 1000, "bytes_up": 50_000, "bytes_down": 100_000,
                       "pushes_applied": 20, "pushes_rejected": 0},
            "eval": {"accuracy": 0.971},
            "eval_history": [
                {"time_s": 1.0, "samples": 0, "accuracy": 0.1},
                {"time_s": 6.0, "samples": 400, "accuracy": 0.955},
                {"time_s": 8.0, "samples": 1000, "accuracy": 0.971},
            ],
            "workers": [
                {"exchange": {"compute_share": 0.8, "local_steps": 64,
                              "pull_encoding": "bf16", "push_encoding": "int8_block"}},
                {"exchange": {"compute_share": 0.6, "local_steps": 32,
                              "pull_encoding": "bf16", "push_encoding": "int8_block"}},
                {"exchange": null},
            ],
        });
        let summaries = [
            serde_json::json!({"seconds": 10.0, "stats": {"wall_s": 7.0}}),
            serde_json::json!({"seconds": 10.0, "stats": {"wall_s": 8.0}}),
        ];
        let r = figures(Link::Shaped(20.0), "auto", &status, &summaries, 2.0);
        assert_eq!(r.setup_s, 2.0);
        assert_eq!(r.to_95, Some(4.0));
        assert_eq!(r.to_97, Some(6.0));
        assert!(
            (r.samples_per_sec - 250.0).abs() < 1e-9,
            "1000 samples from 2 s to 6 s"
        );
        assert_eq!(r.up_per_sample, 50.0);
        assert_eq!(r.push_bytes, 5000.0, "two shards' frames per push");
        assert!((r.compute_share - 0.7).abs() < 1e-12);
        assert_eq!(r.local_steps, vec![64, 32]);
        let base = LinkRun {
            link: Link::Loopback,
            config: "f32".into(),
            to_97: Some(4.0),
            setup_s: 0.5,
            up_per_sample: 200.0,
            ..r.clone()
        };
        let t = targets(&[base, r.clone()]);
        assert!(
            t.contains("1.50× counting from the workers' start (met)"),
            "{t}"
        );
        assert!(t.contains("1.14× counting training only (met)"), "{t}");
        assert!(
            t.contains("compute utilisation ≥ 70% on 20mbit with auto: 70% (met)"),
            "{t}"
        );
        let slower = LinkRun {
            to_97: Some(9.0),
            samples_per_sec: 100.0,
            ..r.clone()
        };
        let never = LinkRun {
            to_97: None,
            samples_per_sec: 50.0,
            ..r.clone()
        };
        let m = medians(&[never.clone(), r.clone(), slower]);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].to_97, Some(9.0), "the middle of 6 s, 9 s and never");
        assert_eq!(m[0].samples_per_sec, 100.0);
        let m = medians(&[never.clone(), never, r.clone()]);
        assert_eq!(m[0].to_97, None, "mostly never");
    }
}
