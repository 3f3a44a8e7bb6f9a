//! `crowdgrad bench crowd`, the run (issue 18): starts the server side and the generators
//! ([`super::crowdprocs`]), samples every process once a second and at the phase boundaries,
//! and prints the figures per phase. The volunteers themselves, the flags and the counters
//! are in [`super::crowd`]; the layers depend one way: this file → `crowdprocs` → `crowd`.

use super::crowd::{CrowdArgs, Plan, Totals, PHASES};
use super::load::{fd_count, get_json, percentile, rss_mib};
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// The server-side processes' and the generators' figures at one moment.
#[derive(Debug, Clone, Default)]
struct Sample {
    at: Option<Instant>,
    /// Per server process: RSS MiB, CPU seconds, open fds.
    procs: Vec<(f64, f64, usize)>,
    gen: Totals,
}

impl Sample {
    fn take(pids: &[u32], gen: Totals) -> Self {
        Sample {
            at: Some(Instant::now()),
            procs: pids
                .iter()
                .map(|&p| (rss_mib(p), super::cpu_seconds(p), fd_count(p)))
                .collect(),
            gen,
        }
    }
    fn rss_mib(&self) -> f64 {
        self.procs.iter().map(|p| p.0).sum()
    }
    fn cpu_s(&self) -> f64 {
        self.procs.iter().map(|p| p.1).sum()
    }
    fn fds(&self) -> usize {
        self.procs.iter().map(|p| p.2).sum()
    }
}

/// One server-side process's figures.
#[derive(Debug, Clone, Default)]
pub struct ProcFigures {
    /// `serve`, `shard 0`, ...
    pub name: String,
    /// Idle RSS before the crowd, MiB.
    pub rss_base_mib: f64,
    /// The most RSS seen during the steady phase, MiB.
    pub rss_steady_peak_mib: f64,
    /// (Steady peak − idle) / volunteers connected at the steady phase's end, KiB.
    pub rss_per_volunteer_kib: Option<f64>,
    /// CPU over the steady phase, cores.
    pub cpu_steady: f64,
    /// Open fds: idle, at the steady phase's end, after everyone left.
    pub fds: (usize, usize, usize),
    /// RSS after everyone left, MiB.
    pub rss_after_mib: f64,
}

/// The end of the steady phase measured apart: per-dashboard egress after the run's history.
pub const LAST_WINDOW: Duration = Duration::from_secs(60);

/// The figures of one phase.
#[derive(Debug, Clone, Default)]
pub struct Phase {
    /// `ramp`, `steady` or `leave`.
    pub name: &'static str,
    /// Seconds.
    pub seconds: f64,
    /// Volunteers with every shard socket open at the end of the phase (the most, for leave).
    pub connected: usize,
    /// Mean training sockets and dashboard streams open over the phase (once a second).
    pub training_sockets: f64,
    /// As above, dashboards.
    pub dashboards: f64,
    /// Server RSS at the end, and the most seen in the phase, MiB.
    pub rss_end_mib: f64,
    /// The most seen.
    pub rss_peak_mib: f64,
    /// (Peak RSS − idle baseline) / volunteers connected at that time, KiB.
    pub rss_per_volunteer_kib: Option<f64>,
    /// Server CPU, cores (utime + stime over the phase's wall time).
    pub server_cpu: f64,
    /// This process's CPU, cores.
    pub generator_cpu: f64,
    /// Server open fds at the end.
    pub fds_end: usize,
    /// Server egress (what the generator received), bytes/s: all, dashboards, training.
    pub egress_bps: f64,
    /// Per dashboard stream open (egress on dashboards / mean dashboards open).
    pub egress_per_dashboard_bps: f64,
    /// Steady only: the same over the phase's last [`LAST_WINDOW`] (after all the history the
    /// run built up, e.g. 30 minutes of evaluations).
    pub egress_per_dashboard_last_bps: Option<f64>,
    /// Per training socket open.
    pub egress_per_training_bps: f64,
    /// Server ingress, bytes/s: all, per dashboard, per training socket.
    pub ingress_bps: f64,
    /// Per dashboard.
    pub ingress_per_dashboard_bps: f64,
    /// Per training socket.
    pub ingress_per_training_bps: f64,
    /// Pull round trips (request sent → last byte of Params), ms: p50, p99, count.
    pub pull_p50_ms: f64,
    /// p99.
    pub pull_p99_ms: f64,
    /// Pulls timed.
    pub pulls: usize,
    /// Push → Ack, ms.
    pub push_p50_ms: f64,
    /// p99.
    pub push_p99_ms: f64,
    /// Pushes timed.
    pub pushes: usize,
    /// Joins per second.
    pub joins_per_sec: f64,
    /// The largest pace a shard had told a volunteer by the phase's end, seconds.
    pub pace_max_s: f64,
    /// Refusals and failures by reason.
    pub refusals: BTreeMap<String, u64>,
}

/// What a crowd run measured.
#[derive(Debug, Clone, Default)]
pub struct Crowd {
    /// Volunteers simulated.
    pub volunteers: usize,
    /// Shards of the run (sockets per volunteer).
    pub shards: usize,
    /// Volunteers with a dashboard stream.
    pub dashboards: usize,
    /// The server-side processes, coordinator first (`serve`, then `shard 0`, ... with
    /// `--shard-processes`).
    pub topology: Vec<String>,
    /// Processes the volunteers ran in.
    pub generators: usize,
    /// The `--egress-budget` given to the shards, if any.
    pub egress_budget: Option<String>,
    /// The server flags the bench set (beyond its own `--addr`, `--data-dir`, `--no-fetch`).
    pub serve_flags: Vec<String>,
    /// The flags set on every shard process (with `--shard-processes`).
    pub shard_flags: Vec<String>,
    /// The fd limit (soft) before and after raising it.
    pub nofile: (u64, u64),
    /// Idle server side before the crowd (all its processes): RSS MiB and open fds.
    pub rss_base_mib: f64,
    /// Open fds then.
    pub fds_base: usize,
    /// Ramp, steady, leave.
    pub phases: Vec<Phase>,
    /// Each server-side process.
    pub procs: Vec<ProcFigures>,
    /// After everyone left and the server settled: RSS MiB, open fds (all processes).
    pub rss_after_mib: f64,
    /// Open fds then.
    pub fds_after: usize,
    /// Volunteers that joined.
    pub joined: u64,
    /// Params received and pushes acknowledged over the run.
    pub pulls: u64,
    /// Acks.
    pub pushes: u64,
    /// The largest pace a shard told a volunteer, seconds (0: none).
    pub pace_max_s: f64,
    /// Joins answered 429 and tried again after 5 s.
    pub join_retries: u64,
    /// Seconds from the first arrival until the last volunteer had its shard sockets open.
    pub all_in_s: f64,
    /// Seconds from a volunteer's arrival to its shard sockets open: p50, p99, most.
    pub join_s: (f64, f64, f64),
    /// The 1-minute load average at the start and at the end.
    pub load: (f64, f64),
}

fn pct(v: &[f32], p: f64) -> f64 {
    let mut d: Vec<f64> = v.iter().map(|&x| f64::from(x)).collect();
    d.sort_by(f64::total_cmp);
    percentile(&d, p)
}

/// Runs the crowd against a `crowdgrad serve` (and with `--shard-processes` its `crowdgrad
/// shard` processes) started from `exe`.
///
/// # Errors
/// Bad flags, a server that does not start or does not listen on 127.0.0.1; refused joins,
/// sockets and pushes are counted, not errors.
pub fn crowd(exe: &Path, args: &CrowdArgs) -> Result<Crowd> {
    args.check()?;
    let nofile = crate::support::limits::raise_nofile();
    let load0 = super::load_avg();
    let n = args.volunteers;
    let shards_guess = args
        .serve_args
        .iter()
        .position(|a| a == "--shards")
        .and_then(|i| args.serve_args.get(i + 1)?.parse::<usize>().ok())
        .unwrap_or(crate::config::SERVE_SHARDS);
    let topo = super::crowdprocs::Topology::start(exe, args, shards_guess)?;
    let pids = topo.pids();
    let agent = super::load::agent();
    let status = get_json(&agent, &format!("{}/api/status", topo.url))?;
    let shards = status["shards"].as_array().map_or(1, Vec::len).max(1);
    std::thread::sleep(Duration::from_secs(2));
    let base = Sample::take(&pids, Totals::default());
    // Children need a moment to start and raise their fd limit.
    let lead = Duration::from_millis(if args.generators > 1 { 2_000 } else { 200 });
    let plan = Plan::new(args, lead);
    let gens = super::crowdprocs::Gens::start(exe, args, topo.addr, &plan, args.generators)?;
    // The phases are counted from the first arrival.
    std::thread::sleep(plan.start.saturating_duration_since(Instant::now()));
    let base = Sample {
        at: Some(Instant::now()),
        gen: gens.totals(),
        ..base
    };
    let ends = plan.ends();
    let mut phases = Vec::new();
    let mut start = base.clone();
    let np = pids.len();
    let mut steady_peaks = vec![0.0f64; np];
    let mut steady_end = Sample::default();
    let mut ramp_end = Sample::default();
    for (p, end) in ends.iter().enumerate() {
        gens.set_phase(p);
        let (mut peak_rss, mut peak_conn) = (0.0f64, 0usize);
        let mut peaks = vec![0.0f64; np];
        let (mut train_sum, mut board_sum, mut ticks) = (0.0, 0.0, 0usize);
        // Steady: where its last LAST_WINDOW began (time, totals, dashboards summed, ticks).
        let mut window = None;
        loop {
            let now = Instant::now();
            if p == 1 && window.is_none() && *end <= now + LAST_WINDOW {
                window = Some((now, gens.totals(), board_sum, ticks));
            }
            let rss: Vec<f64> = pids.iter().map(|&q| rss_mib(q)).collect();
            for (k, r) in rss.iter().enumerate() {
                peaks[k] = peaks[k].max(*r);
            }
            peak_rss = peak_rss.max(rss.iter().sum());
            let t = gens.totals();
            peak_conn = peak_conn.max(t.connected as usize);
            train_sum += t.training_open as f64;
            board_sum += t.dashboards_open as f64;
            ticks += 1;
            if now >= *end {
                break;
            }
            std::thread::sleep((*end - now).min(Duration::from_secs(1)));
        }
        if p == 2 {
            // Leaving: wait (bounded) for the volunteers to finish and the server's fds to fall.
            let deadline = Instant::now() + Duration::from_secs(60);
            while gens.totals().connected > 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        let end_s = Sample::take(&pids, gens.totals());
        for (k, e) in end_s.procs.iter().enumerate() {
            peaks[k] = peaks[k].max(e.0);
        }
        match p {
            0 => ramp_end = end_s.clone(),
            1 => {
                steady_peaks = peaks.clone();
                steady_end = end_s.clone();
            }
            _ => {}
        }
        let connected_end = end_s.gen.connected as usize;
        // Ramp and steady: the phase's largest RSS over the volunteers connected at its end.
        let per_vol = (p < 2 && connected_end > 0).then(|| {
            (peak_rss.max(end_s.rss_mib()) - base.rss_mib()).max(0.0) * 1024.0
                / connected_end as f64
        });
        let dt = end_s
            .at
            .zip(start.at)
            .map_or(1.0, |(a, b)| a.duration_since(b).as_secs_f64())
            .max(1e-3);
        let trains = train_sum / ticks.max(1) as f64;
        let boards = board_sum / ticks.max(1) as f64;
        let rate = |a: u64, b: u64| a.saturating_sub(b) as f64 / dt;
        let (g1, g0) = (&end_s.gen, &start.gen);
        let egress_train = rate(g1.training_rx, g0.training_rx);
        let egress_board = rate(g1.dashboard_rx, g0.dashboard_rx);
        let ingress_train = rate(g1.training_tx, g0.training_tx);
        let ingress_board = rate(g1.dashboard_tx, g0.dashboard_tx);
        let per = |x: f64, n: f64| if n > 0.0 { x / n } else { 0.0 };
        let last_board = window.and_then(|(at, w, sum0, ticks0)| {
            let dt = end_s.at?.duration_since(at).as_secs_f64();
            let n = (board_sum - sum0) / (ticks - ticks0).max(1) as f64;
            (dt > 1.0).then(|| {
                per(
                    g1.dashboard_rx.saturating_sub(w.dashboard_rx) as f64 / dt,
                    n,
                )
            })
        });
        phases.push(Phase {
            name: PHASES[p],
            seconds: dt,
            connected: if p == 2 { peak_conn } else { connected_end },
            training_sockets: trains,
            dashboards: boards,
            rss_end_mib: end_s.rss_mib(),
            rss_peak_mib: peak_rss.max(end_s.rss_mib()),
            rss_per_volunteer_kib: per_vol,
            server_cpu: (end_s.cpu_s() - start.cpu_s()) / dt,
            generator_cpu: (g1.cpu_s - g0.cpu_s) / dt,
            fds_end: end_s.fds(),
            egress_bps: egress_train + egress_board + rate(g1.http_rx, g0.http_rx),
            egress_per_dashboard_bps: per(egress_board, boards),
            egress_per_dashboard_last_bps: last_board,
            egress_per_training_bps: per(egress_train, trains),
            ingress_bps: ingress_train + ingress_board + rate(g1.http_tx, g0.http_tx),
            ingress_per_dashboard_bps: per(ingress_board, boards),
            ingress_per_training_bps: per(ingress_train, trains),
            joins_per_sec: g1.joins[p] as f64 / dt,
            pace_max_s: g1.pace_ms_max as f64 / 1e3,
            ..Phase::default()
        });
        start = end_s;
    }
    let (fin, samples) = gens.finish();
    for (p, ph) in phases.iter_mut().enumerate() {
        let (pl, ps) = (&samples.pull_ms[p], &samples.push_ms[p]);
        (ph.pull_p50_ms, ph.pull_p99_ms, ph.pulls) = (pct(pl, 0.5), pct(pl, 0.99), pl.len());
        (ph.push_p50_ms, ph.push_p99_ms, ph.pushes) = (pct(ps, 0.5), pct(ps, 0.99), ps.len());
        ph.refusals = fin.refusals[p].clone();
    }
    let js = &samples.join_ms;
    let join_s = (
        pct(js, 0.5) / 1e3,
        pct(js, 0.99) / 1e3,
        js.iter().copied().fold(0.0f32, f32::max) as f64 / 1e3,
    );
    drop(samples);
    // Settle: fds back near the baseline (at most 20 s), then the periodic heap trim's turn.
    let settle = Instant::now() + Duration::from_secs(20);
    while pids.iter().map(|&q| fd_count(q)).sum::<usize>() > base.fds() + 2 * np
        && Instant::now() < settle
    {
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_secs_f64(args.settle_seconds));
    let after = Sample::take(&pids, fin.clone());
    let steady_connected = steady_end.gen.connected as f64;
    let steady_dt = phases.get(1).map_or(1.0, |p| p.seconds);
    let names = topo.names();
    let procs = (0..np)
        .map(|k| {
            let (b, e, a) = (
                base.procs.get(k).copied().unwrap_or_default(),
                steady_end.procs.get(k).copied().unwrap_or_default(),
                after.procs.get(k).copied().unwrap_or_default(),
            );
            // CPU over the steady phase: from the ramp's end sample to the steady's.
            let r = ramp_end.procs.get(k).copied().unwrap_or_default();
            ProcFigures {
                name: names.get(k).cloned().unwrap_or_default(),
                rss_base_mib: b.0,
                rss_steady_peak_mib: steady_peaks[k],
                rss_per_volunteer_kib: (steady_connected > 0.0)
                    .then(|| (steady_peaks[k] - b.0).max(0.0) * 1024.0 / steady_connected),
                cpu_steady: (e.1 - r.1) / steady_dt.max(1e-3),
                fds: (b.2, e.2, a.2),
                rss_after_mib: a.0,
            }
        })
        .collect::<Vec<_>>();
    Ok(Crowd {
        volunteers: n,
        shards,
        dashboards: (n as f64 * args.dashboard_fraction).round() as usize,
        topology: names,
        generators: args.generators,
        egress_budget: args.egress_budget.clone(),
        serve_flags: topo.serve_flags.clone(),
        shard_flags: topo.shard_flags.clone(),
        nofile,
        rss_base_mib: base.rss_mib(),
        fds_base: base.fds(),
        phases,
        procs,
        rss_after_mib: after.rss_mib(),
        fds_after: after.fds(),
        joined: fin.joins.iter().sum(),
        pulls: fin.pulls,
        pushes: fin.pushes,
        pace_max_s: fin.pace_ms_max as f64 / 1e3,
        join_retries: fin.join_retries,
        all_in_s: fin.all_in_ms as f64 / 1e3,
        join_s,
        load: (load0, super::load_avg()),
    })
}

impl Crowd {
    /// The figures as a Markdown table, one column per phase.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let cols = self
            .phases
            .iter()
            .map(|p| p.name)
            .collect::<Vec<_>>()
            .join(" | ");
        out.push_str(&format!(
            "| figure | {cols} |\n|---|{}\n",
            "---|".repeat(self.phases.len())
        ));
        let row = |out: &mut String, name: &str, f: &dyn Fn(&Phase) -> String| {
            let v: Vec<String> = self.phases.iter().map(f).collect();
            out.push_str(&format!("| {name} | {} |\n", v.join(" | ")));
        };
        row(&mut out, "seconds", &|p| format!("{:.1}", p.seconds));
        row(&mut out, "volunteers connected (end; leave: most)", &|p| {
            p.connected.to_string()
        });
        row(
            &mut out,
            "training sockets / dashboards open (mean)",
            &|p| format!("{:.0} / {:.0}", p.training_sockets, p.dashboards),
        );
        row(&mut out, "server RSS end / peak", &|p| {
            format!("{:.0} / {:.0} MiB", p.rss_end_mib, p.rss_peak_mib)
        });
        row(&mut out, "RSS per connected volunteer above idle", &|p| {
            p.rss_per_volunteer_kib
                .map_or("–".into(), |k| format!("{k:.0} KiB"))
        });
        row(&mut out, "server CPU", &|p| {
            format!("{:.0}%", p.server_cpu * 100.0)
        });
        row(&mut out, "generator CPU", &|p| {
            format!("{:.0}%", p.generator_cpu * 100.0)
        });
        row(&mut out, "server fds (end)", &|p| p.fds_end.to_string());
        row(
            &mut out,
            "egress total / per dashboard / per training socket",
            &|p| {
                format!(
                    "{} / {} / {}",
                    bps(p.egress_bps),
                    bps(p.egress_per_dashboard_bps),
                    bps(p.egress_per_training_bps)
                )
            },
        );
        row(
            &mut out,
            "egress per dashboard, the phase's last 60 s",
            &|p| p.egress_per_dashboard_last_bps.map_or("–".into(), bps),
        );
        row(
            &mut out,
            "ingress total / per dashboard / per training socket",
            &|p| {
                format!(
                    "{} / {} / {}",
                    bps(p.ingress_bps),
                    bps(p.ingress_per_dashboard_bps),
                    bps(p.ingress_per_training_bps)
                )
            },
        );
        row(&mut out, "pull round trip p50 / p99 (n)", &|p| {
            format!(
                "{:.1} / {:.1} ms ({})",
                p.pull_p50_ms, p.pull_p99_ms, p.pulls
            )
        });
        row(&mut out, "push to ack p50 / p99 (n)", &|p| {
            format!(
                "{:.1} / {:.1} ms ({})",
                p.push_p50_ms, p.push_p99_ms, p.pushes
            )
        });
        row(&mut out, "joins/s", &|p| format!("{:.1}", p.joins_per_sec));
        row(&mut out, "largest pace told (by the end)", &|p| {
            format!("{:.1} s", p.pace_max_s)
        });
        row(&mut out, "refusals", &|p| {
            if p.refusals.is_empty() {
                "0".into()
            } else {
                p.refusals
                    .iter()
                    .map(|(k, v)| format!("{v}× {k}"))
                    .collect::<Vec<_>>()
                    .join("; ")
            }
        });
        out
    }
}

impl Crowd {
    /// Each server-side process (and their sum) as a Markdown table.
    pub fn process_table(&self) -> String {
        let mut out = String::from(
            "| process | RSS idle → steady peak → after | per volunteer above idle | CPU (steady) | fds idle / steady end / after |\n|---|---|---|---|---|\n",
        );
        let kib = |k: Option<f64>| k.map_or("–".into(), |k| format!("{k:.0} KiB"));
        for p in &self.procs {
            out.push_str(&format!(
                "| {} | {:.0} → {:.0} → {:.0} MiB | {} | {:.0}% | {} / {} / {} |\n",
                p.name,
                p.rss_base_mib,
                p.rss_steady_peak_mib,
                p.rss_after_mib,
                kib(p.rss_per_volunteer_kib),
                p.cpu_steady * 100.0,
                p.fds.0,
                p.fds.1,
                p.fds.2
            ));
        }
        if self.procs.len() > 1 {
            let sum = |f: &dyn Fn(&ProcFigures) -> f64| self.procs.iter().map(f).sum::<f64>();
            let per = self
                .procs
                .iter()
                .map(|p| p.rss_per_volunteer_kib)
                .sum::<Option<f64>>();
            let fds = |f: &dyn Fn(&ProcFigures) -> usize| self.procs.iter().map(f).sum::<usize>();
            out.push_str(&format!(
                "| **all** | {:.0} → {:.0} → {:.0} MiB | **{}** | {:.0}% | {} / {} / {} |\n",
                sum(&|p| p.rss_base_mib),
                sum(&|p| p.rss_steady_peak_mib),
                sum(&|p| p.rss_after_mib),
                kib(per),
                sum(&|p| p.cpu_steady) * 100.0,
                fds(&|p| p.fds.0),
                fds(&|p| p.fds.1),
                fds(&|p| p.fds.2)
            ));
        }
        out
    }
}

fn bps(b: f64) -> String {
    if b >= 1e6 {
        format!("{:.1} MB/s", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} kB/s", b / 1e3)
    } else {
        format!("{b:.0} B/s")
    }
}

/// `crowdgrad bench crowd`: runs [`crowd`] and prints its figures.
///
/// # Errors
/// As [`crowd`].
pub fn cli(args: &CrowdArgs) -> Result<()> {
    if let Some(spec) = &args.as_generator {
        return super::crowdprocs::generator(args, spec);
    }
    let exe = std::env::current_exe().map_err(|e| Error::io("current exe", e))?;
    let c = crowd(&exe, args)?;
    println!(
        "crowd: {} volunteers × {} shard sockets, {} dashboards, ramp {}/s, round every {} s, {} generator process(es)",
        c.volunteers, c.shards, c.dashboards, args.ramp_rate, args.round_interval, c.generators
    );
    println!("server side: {}", c.topology.join(" + "));
    println!(
        "egress budget: {}; largest pace told: {:.1} s",
        c.egress_budget.clone().unwrap_or_else(|| format!(
            "the servers' default ({})",
            crowdgrad_core::shard::pace::DEFAULT_EGRESS_BUDGET
        )),
        c.pace_max_s
    );
    println!("fd limit (soft): {} → {}", c.nofile.0, c.nofile.1);
    println!(
        "load average (1 min): {:.2} at the start, {:.2} at the end",
        c.load.0, c.load.1
    );
    println!("server flags raised: {}", c.serve_flags.join(" "));
    if !c.shard_flags.is_empty() {
        println!("shard process flags: {}", c.shard_flags.join(" "));
    }
    println!(
        "idle server side: RSS {:.0} MiB, {} fds; after everyone left (and {:.0} s more): RSS {:.0} MiB, {} fds",
        c.rss_base_mib, c.fds_base, args.settle_seconds, c.rss_after_mib, c.fds_after
    );
    println!(
        "joined {}, params received {}, pushes acknowledged {}",
        c.joined, c.pulls, c.pushes
    );
    println!(
        "joins: all in {:.1} s after the first arrival; arrival to sockets open p50 {:.2} s, p99 {:.2} s, most {:.2} s; {} joins answered 429 and tried again",
        c.all_in_s, c.join_s.0, c.join_s.1, c.join_s.2, c.join_retries
    );
    print!("{}", c.table());
    println!();
    print!("{}", c.process_table());
    Ok(())
}
