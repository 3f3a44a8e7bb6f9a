//! The processes of `crowdgrad bench crowd` (issue 18): the server side it starts, and the
//! child processes its volunteers may run in.
//!
//! **Server side** ([`Topology`]): one `crowdgrad serve`, or with `--shard-processes` one
//! `crowdgrad shard` per shard on 127.0.0.1 plus `serve --shard-urls` as the coordinator
//! (joins, dashboards, the evaluator), sharing a run secret made for the run. Every process
//! is measured (RSS, CPU, fds) and killed when the bench ends, on every path ([`Server`]'s
//! `Drop`).
//!
//! **Generators** ([`Gens`]): the volunteers run as tasks of this process, or with
//! `--generators N` as N child processes of this same binary (`bench crowd --as-generator`,
//! hidden), each with a contiguous slice of the volunteers and its own fd limit. A child
//! prints one `crowd-generator status {json}` line every half second (its counters, see
//! [`Totals`]) and a `crowd-generator done {json}` line (its round-trip samples) when its
//! volunteers have left; the bench sums the children's counters and merges their samples.
//! Every volunteer keeps the arrival and leave times of its global index, measured from a
//! start time given to every child as Unix milliseconds, so the crowd is the same crowd
//! however it is split.
//!
//! Why the split exists: a volunteer holds 3 fds on the server side (2 shard sockets and a
//! dashboard) and 3 on the generator's, and this machine's hard `RLIMIT_NOFILE` is 20,000, so
//! one server process and one generator process stop near 6,000 volunteers. With the shards in
//! processes of their own each server process holds one socket per volunteer, and with
//! generators the generator side is split the same way.

use super::crowd::{CrowdArgs, Ctx, Plan, Samples, Totals};
use super::load::Server;
use crate::error::{Error, Result};
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The prefix of a child generator's lines on its stdout.
const LINE: &str = "crowd-generator ";

/// The most connections the bench lets the coordinator hold with `--shard-processes`: below
/// this machine's 20,000 fd hard limit, with room for its files and listeners.
const MAX_COORDINATOR_CONNECTIONS: usize = 19_000;

/// How long after the last leave a child may still be running before it is killed.
const CHILD_GRACE: Duration = Duration::from_secs(90);

fn loopback(addr: SocketAddr) -> Result<SocketAddr> {
    if addr.ip() == IpAddr::from([127, 0, 0, 1]) {
        Ok(addr)
    } else {
        Err(Error::Config(format!(
            "{addr} is not 127.0.0.1: the crowd targets loopback only"
        )))
    }
}

/// The server-side processes of a run, coordinator first; each killed when dropped.
pub(super) struct Topology {
    /// `(name, process)`: `serve` alone, or `serve` then `shard 0`, `shard 1`, ...
    pub procs: Vec<(String, Server)>,
    /// The flags the bench set on `serve` (besides address, data and, with shard processes,
    /// `--shard-urls`).
    pub serve_flags: Vec<String>,
    /// The flags the bench set on every `crowdgrad shard` (besides listen address and index).
    pub shard_flags: Vec<String>,
    /// The coordinator's address (joins, dashboards; and the shards without shard processes).
    pub addr: SocketAddr,
    /// Its base URL.
    pub url: String,
}

impl Topology {
    /// Starts the server side for `args.volunteers` volunteers on `shards` shards.
    ///
    /// # Errors
    /// A process that does not start or does not listen on 127.0.0.1.
    pub fn start(exe: &Path, args: &CrowdArgs, shards: usize) -> Result<Self> {
        let n = args.volunteers;
        let exe = args.server_binary.as_deref().unwrap_or(exe);
        // One address for the whole crowd: the per-IP limits are lifted (a shard process has
        // no joins, so no --join-rate), the totals sized to it.
        let per_ip = |joins: bool| -> Vec<String> {
            let mut f = vec![
                "--max-connections-per-ip",
                "0",
                "--max-connections-per-prefix",
                "0",
                "--push-rate-per-ip",
                "0",
            ];
            if joins {
                f.extend(["--join-rate", "0"]);
            }
            f.into_iter().map(String::from).collect()
        };
        let mut flags = per_ip(true);
        if n > 10_000 {
            flags.extend(["--max-workers".to_string(), (n + 64).to_string()]);
        }
        let budget = args
            .egress_budget
            .iter()
            .flat_map(|b| ["--egress-budget".to_string(), b.clone()])
            .collect::<Vec<_>>();
        let mut procs = Vec::new();
        let mut shard_flags = Vec::new();
        let mut env = Vec::new();
        if args.shard_processes {
            // A secret for this run only (loopback, gone with the processes).
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let secret = format!("crowd-bench-{:x}-{nanos:x}", std::process::id());
            env.push(("CROWDGRAD_RUN_SECRET".to_string(), secret));
            env.push(("RUST_LOG".to_string(), "warn".to_string()));
            shard_flags = per_ip(false);
            shard_flags.extend([
                "--max-connections".to_string(),
                (n + 256).to_string(),
                "--of".to_string(),
                shards.to_string(),
            ]);
            shard_flags.extend(budget.iter().cloned());
            let mut urls = Vec::new();
            for i in 0..shards {
                let mut a: Vec<std::ffi::OsString> =
                    ["shard", "--listen", "127.0.0.1:0", "--index"]
                        .iter()
                        .map(Into::into)
                        .collect();
                a.push(i.to_string().into());
                a.extend(shard_flags.iter().map(Into::into));
                let s = Server::command(exe, &a, &env)?;
                loopback(s.addr)?;
                urls.push(format!("ws://{}", s.addr));
                procs.push((format!("shard {i}"), s));
            }
            // The coordinator: a dashboard per volunteer and the joins in flight, which are
            // many while a large crowd waits on the admission bound (one per volunteer at
            // worst); below the fd limit, with room for its own files.
            let conns = (2 * n + 256).min(MAX_COORDINATOR_CONNECTIONS);
            if conns > 4_096 {
                flags.extend(["--max-connections".to_string(), conns.to_string()]);
            }
            flags.extend([
                "--shards".to_string(),
                shards.to_string(),
                "--shard-urls".to_string(),
                urls.join(","),
            ]);
        } else {
            // Shards (2 by default) + a dashboard + joins in flight.
            let conns = n * (shards + 1) + 256;
            if conns > 4_096 {
                flags.extend(["--max-connections".to_string(), conns.to_string()]);
            }
            flags.extend(budget);
            // The volunteers push synthetic gradients without push tags: a spot-checking shard
            // (serve's default `--spot-check auto` where it holds the data) refuses those, and
            // a recomputation would quarantine every one. Shard processes run no checks.
            flags.extend(["--spot-check".to_string(), "0".to_string()]);
        }
        let mut serve = flags.clone();
        serve.extend(args.serve_args.iter().cloned());
        let server = Server::start(exe, &args.data_dir, &serve, &env)?;
        let addr = loopback(server.addr)?;
        let url = server.url.clone();
        procs.insert(0, ("serve".to_string(), server));
        Ok(Topology {
            procs,
            serve_flags: flags,
            shard_flags,
            addr,
            url,
        })
    }

    /// The processes' ids, coordinator first.
    pub fn pids(&self) -> Vec<u32> {
        self.procs.iter().map(|(_, s)| s.pid()).collect()
    }

    /// Their names, in the same order.
    pub fn names(&self) -> Vec<String> {
        self.procs.iter().map(|(n, _)| n.clone()).collect()
    }
}

/// What one child generator said last.
#[derive(Default)]
struct ChildState {
    latest: Totals,
    done: Option<Samples>,
    stderr: VecDeque<String>,
}

/// A child generator process, killed when dropped.
pub(super) struct GenChild {
    child: Child,
    state: Arc<Mutex<ChildState>>,
}

impl Drop for GenChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl GenChild {
    fn start(exe: &Path, args: &CrowdArgs, spec: &GenSpec) -> Result<Self> {
        let mut child = Command::new(exe)
            .args(["bench", "crowd", "--volunteers"])
            .arg(args.volunteers.to_string())
            .arg("--ramp-rate")
            .arg(args.ramp_rate.to_string())
            .arg("--steady-seconds")
            .arg(args.steady_seconds.to_string())
            .arg("--round-interval")
            .arg(args.round_interval.to_string())
            .arg("--dashboard-fraction")
            .arg(args.dashboard_fraction.to_string())
            .arg("--as-generator")
            .arg(spec.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| Error::io("starting a generator", e))?;
        let state = Arc::new(Mutex::new(ChildState::default()));
        if let Some(err) = child.stderr.take() {
            let state = state.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(err)
                    .lines()
                    .map_while(std::result::Result::ok)
                {
                    let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
                    if s.stderr.len() == 8 {
                        s.stderr.pop_front();
                    }
                    s.stderr.push_back(line);
                }
            });
        }
        if let Some(out) = child.stdout.take() {
            let state = state.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out)
                    .lines()
                    .map_while(std::result::Result::ok)
                {
                    let Some(rest) = line.strip_prefix(LINE) else {
                        continue;
                    };
                    let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
                    if let Some(j) = rest.strip_prefix("status ") {
                        if let Ok(t) = serde_json::from_str(j) {
                            s.latest = t;
                        }
                    } else if let Some(j) = rest.strip_prefix("done ") {
                        if let Ok(d) = serde_json::from_str::<Done>(j) {
                            s.latest = d.totals;
                            s.done = Some(d.samples);
                        }
                    }
                }
            });
        }
        Ok(GenChild { child, state })
    }
}

/// Where the volunteers run.
pub(super) enum Gens {
    /// Tasks of this process, on a runtime of its own.
    Local {
        /// Their shared counters.
        ctx: &'static Ctx,
        /// The runtime (2 worker threads).
        rt: tokio::runtime::Runtime,
        /// One task per volunteer.
        tasks: Vec<tokio::task::JoinHandle<()>>,
    },
    /// Child processes, each with a slice of the volunteers.
    Children(Vec<GenChild>),
}

impl Gens {
    /// The volunteers of `plan` against `addr`: in this process, or over `count` children.
    ///
    /// # Errors
    /// A runtime or a child that does not start.
    pub fn start(
        exe: &Path,
        args: &CrowdArgs,
        addr: SocketAddr,
        plan: &Plan,
        count: usize,
    ) -> Result<Self> {
        let n = args.volunteers;
        if count <= 1 {
            let ctx = Ctx::leak(addr, args.round_interval);
            let rt = super::crowd::runtime()?;
            let tasks = plan.spawn(&rt, ctx, 0..n);
            return Ok(Gens::Local { ctx, rt, tasks });
        }
        let start_ms = plan.start_unix_ms();
        let children = (0..count)
            .map(|k| {
                let spec = GenSpec {
                    lo: n * k / count,
                    hi: n * (k + 1) / count,
                    addr,
                    start_ms,
                };
                GenChild::start(exe, args, &spec)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Gens::Children(children))
    }

    /// The counters now, summed over the children (each as of its last status line, at most
    /// half a second old).
    pub fn totals(&self) -> Totals {
        match self {
            Gens::Local { ctx, .. } => {
                let mut t = ctx.totals();
                t.cpu_s = super::cpu_seconds(std::process::id());
                t
            }
            Gens::Children(c) => {
                let mut t = Totals::default();
                for g in c {
                    t.add(&g.state.lock().unwrap_or_else(|p| p.into_inner()).latest);
                }
                t
            }
        }
    }

    /// Moves the local volunteers' counting to phase `p` (children follow the clock).
    pub fn set_phase(&self, p: usize) {
        if let Gens::Local { ctx, .. } = self {
            ctx.phase.store(p, Ordering::Relaxed);
        }
    }

    /// Waits (bounded) for every volunteer to finish and returns the final counters and every
    /// round-trip sample; a child still running past its grace is killed and counted as a
    /// refusal.
    pub fn finish(self) -> (Totals, Samples) {
        match self {
            Gens::Local { ctx, rt, tasks } => {
                rt.block_on(async {
                    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
                    for t in tasks {
                        if tokio::time::timeout_at(deadline, t).await.is_err() {
                            ctx.refuse("a volunteer did not finish in time");
                        }
                    }
                });
                rt.shutdown_timeout(Duration::from_secs(5));
                let mut t = ctx.totals();
                t.cpu_s = super::cpu_seconds(std::process::id());
                (t, ctx.take_samples())
            }
            Gens::Children(mut children) => {
                let deadline = Instant::now() + CHILD_GRACE;
                let (mut totals, mut samples) = (Totals::default(), Samples::default());
                for g in &mut children {
                    while Instant::now() < deadline {
                        let done = g.state.lock().map(|s| s.done.is_some()).unwrap_or(true);
                        if done || matches!(g.child.try_wait(), Ok(Some(_))) {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    // Its reader thread may still be parsing the last line.
                    let t = Instant::now() + Duration::from_secs(5);
                    while Instant::now() < t
                        && g.state.lock().map(|s| s.done.is_none()).unwrap_or(false)
                        && matches!(g.child.try_wait(), Ok(None))
                    {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    let mut s = g.state.lock().unwrap_or_else(|p| p.into_inner());
                    let mut latest = std::mem::take(&mut s.latest);
                    match s.done.take() {
                        Some(d) => samples.merge(d),
                        None => {
                            let why = format!(
                                "a generator ended without its figures: {}",
                                s.stderr.iter().cloned().collect::<Vec<_>>().join(" | ")
                            );
                            *latest.refusals[2]
                                .entry(why.chars().take(160).collect())
                                .or_default() += 1;
                        }
                    }
                    totals.add(&latest);
                }
                (totals, samples)
            }
        }
    }
}

/// What a child generator is told: its slice `lo..hi` of the volunteers, the server and the
/// start time, as `LO,HI,ADDR,START_UNIX_MS`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct GenSpec {
    lo: usize,
    hi: usize,
    addr: SocketAddr,
    start_ms: u64,
}

impl std::fmt::Display for GenSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{},{},{},{}", self.lo, self.hi, self.addr, self.start_ms)
    }
}

impl std::str::FromStr for GenSpec {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            Error::Config(format!(
                "--as-generator {s:?}: expected LO,HI,ADDR,START_MS"
            ))
        };
        let f: Vec<&str> = s.split(',').collect();
        let [lo, hi, addr, start] = f[..] else {
            return Err(bad());
        };
        let spec = GenSpec {
            lo: lo.parse().map_err(|_| bad())?,
            hi: hi.parse().map_err(|_| bad())?,
            addr: addr.parse().map_err(|_| bad())?,
            start_ms: start.parse().map_err(|_| bad())?,
        };
        if spec.lo >= spec.hi {
            return Err(bad());
        }
        loopback(spec.addr)?;
        Ok(spec)
    }
}

/// A child's last line.
#[derive(serde::Serialize, serde::Deserialize)]
struct Done {
    totals: Totals,
    samples: Samples,
}

fn say(kind: &str, json: &impl serde::Serialize) {
    let line = serde_json::to_string(json).unwrap_or_default();
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{LINE}{kind} {line}");
    let _ = out.flush();
}

/// `bench crowd --as-generator SPEC`: runs volunteers `lo..hi` of the crowd `args` describes
/// against the server in `spec`, printing its counters every half second and its samples at
/// the end; ends by itself once they left (at most [`CHILD_GRACE`] after the last leave).
///
/// # Errors
/// A bad spec or flags, a runtime that does not start.
pub fn generator(args: &CrowdArgs, spec: &str) -> Result<()> {
    args.check()?;
    let spec: GenSpec = spec.parse()?;
    if spec.hi > args.volunteers {
        return Err(Error::Config(format!(
            "--as-generator: slice {}..{} beyond --volunteers {}",
            spec.lo, spec.hi, args.volunteers
        )));
    }
    crate::support::limits::raise_nofile();
    let plan = Plan::at_unix_ms(args, spec.start_ms);
    let ctx = Ctx::leak(spec.addr, args.round_interval);
    let rt = super::crowd::runtime()?;
    let tasks = plan.spawn(&rt, ctx, spec.lo..spec.hi);
    let count = spec.hi - spec.lo;
    let ends = plan.ends();
    let stop = ends[2] + CHILD_GRACE;
    loop {
        let now = Instant::now();
        let p = ends.iter().filter(|e| now >= **e).count().min(2);
        ctx.phase.store(p, Ordering::Relaxed);
        let mut t = ctx.totals();
        t.cpu_s = super::cpu_seconds(std::process::id());
        say("status", &t);
        if t.finished as usize >= count || now >= stop {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let gens = Gens::Local { ctx, rt, tasks };
    let (totals, samples) = gens.finish();
    say("done", &Done { totals, samples });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generator_spec_reads_back_and_refuses_what_is_not_loopback() {
        let s = GenSpec {
            lo: 10,
            hi: 20,
            addr: "127.0.0.1:8080".parse().unwrap(),
            start_ms: 1_700_000_000_000,
        };
        assert_eq!(s.to_string().parse::<GenSpec>().unwrap(), s);
        assert!("10,20,10.0.0.1:80,1".parse::<GenSpec>().is_err());
        assert!("20,10,127.0.0.1:80,1".parse::<GenSpec>().is_err());
        assert!("1,2,127.0.0.1:80".parse::<GenSpec>().is_err());
        assert!("x".parse::<GenSpec>().is_err());
    }
}
