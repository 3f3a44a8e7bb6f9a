//! `crowdgrad bench attack` (issue 21): every attack of the issue against real `crowdgrad
//! serve` children on 127.0.0.1, a default server (which spot-checks 2% of pushes and every
//! push of a new identity since `--spot-check auto`) and one checking half of all pushes
//! (`--spot-check 0.5 --quarantine-rejections 5`), and what happened, in figures; a summary
//! table at the end. `--local-steps` says how both servers exchange ([`common::Exchange`]):
//! `1` (the default) pins them to gradient pushes without pacing (`--local-steps 1
//! --egress-budget off`), where the attackers' gradient oracle makes honest pushes; `auto`
//! runs them with no exchange flag at all, `serve`'s real defaults (`--local-steps auto`,
//! `--egress-budget 400mbit`), and `H` at `--local-steps H`. Under `auto` and `H` the sybils
//! and poisoners push rounds as an honest worker does: core's own worker state machine runs
//! the round on the real training set at the parameters they pulled (`rounds.rs`), and they
//! push its Δ (zeroed, huge, or sign-flipped and scaled) with its tag and `samples` = H ×
//! batch size. `--local-steps 1,auto` runs both.
//!
//! The printed, measured counterpart of `tests/integration/attacks.rs`. Honest workers are
//! real `crowdgrad work` processes; attackers speak the documented protocol
//! (docs/protocol.md) from this process, each joined with a valid credential from its own
//! loopback address (127.0.0.2, 127.0.0.3, ...: the per-address limits of the server stay on,
//! as a stranger spread over many addresses would meet them). A poisoner's gradients are real:
//! core's model on the real training set at the parameters it pulled, sign-flipped and scaled.
//!
//! Attacks (`--only`):
//! - `sockets`: 17 addresses × 241 silent TCP connections; an honest status read and join from
//!   127.1.0.1 while they are held (at 1 s and half-way), and when the server closed each.
//! - `idle`: `--sybils` sybils join, connect to every shard and push nothing (with local
//!   steps a shard applies each pseudo-gradient at lr / workers connected: what their
//!   presence alone costs).
//! - `zeros`, `huge`, `poison`: `--sybils` sybils push all-zero gradients, norm-1e4 gradients,
//!   or sign-flipped honest gradients at each `--poison-scales` against `--honest` honest
//!   workers for `--seconds`; honest acceptance, final accuracy against a clean run of the
//!   same length (`clean`, run first), the sybils' pushes applied and refused.
//! - `unsampled`: a poisoner pushing on the batches the old public sampling rule left
//!   unchecked: its pushes, when it was quarantined, accuracy against clean.
//! - `stale`: a push tagged 200 versions back.
//! - `reports`: Reports of 1.7e308 / 0 / 1.7e308, rewound and replayed ones, 1e12 s, 600
//!   zero pushes; two honest identities' credit before and after a kill -9 and a restart on
//!   the same checkpoint directory.
//! - `replays`: a push frame again on a new connection, the same gradient with new request
//!   ids.
//! - `identity`: a client that knows only a volunteer's identity from `/api/contributors`
//!   joins as it, renames it, credits it and draws refusals toward a quarantine.
//!
//! Each attack's line says `holds` when the claim for it held, else `FAILS:` and
//! which claim failed; nothing is tuned to pass.
//!
//! Bounded: every server and worker is killed when its attack ends or fails, every wait has a
//! deadline, `--seconds` is at most 600 and the counts are capped; only 127.0.0.0/8 is ever
//! targeted (`--addr` is refused in the server flags). The process raises its own fd limit
//! for the socket flood.

mod common;
mod misc;
mod rounds;
mod sybil;

pub use common::{Exchange, Mode, Verdict};

use crate::error::{Error, Result};
use clap::Args;
use common::Ctx;
use std::path::PathBuf;
use std::time::Instant;
use sybil::Push;

/// The attacks, in the order they run.
pub const ATTACKS: [&str; 10] = [
    "sockets",
    "idle",
    "zeros",
    "huge",
    "poison",
    "unsampled",
    "stale",
    "reports",
    "replays",
    "identity",
];

/// Flags of `crowdgrad bench attack`.
#[derive(Debug, Clone, Args)]
pub struct AttackArgs {
    /// Seconds each training attack runs (its honest workers train this long; the clean run
    /// too). At most 600.
    #[arg(long, default_value_t = 20.0)]
    pub seconds: f64,
    /// Run only these attacks (comma-separated): sockets, idle, zeros, huge, poison, unsampled,
    /// stale, reports, replays, identity. Default: all.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Quick mode: at most 8 s per training attack and one poison scale (the largest).
    #[arg(long)]
    pub quick: bool,
    /// The servers to attack (comma-separated): `default` (serve's defaults) and `spot`
    /// (`--spot-check 0.5 --quarantine-rejections 5`), each under every `--local-steps`.
    #[arg(long, value_delimiter = ',', default_value = "default,spot")]
    pub servers: Vec<String>,
    /// How the servers exchange (comma-separated, each run in turn): `1` — gradient pushes
    /// without pacing (`--local-steps 1 --egress-budget off`), `auto` — serve's real defaults
    /// (no exchange flag: `--local-steps auto`, `--egress-budget 400mbit`), or a whole number
    /// H of local steps (2-10000). Under `auto` and H the attackers push rounds formed by
    /// core's worker; stale, reports, replays and identity run at `1` only.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub local_steps: Vec<String>,
    /// Honest `crowdgrad work` processes in the sybil and poison runs (1-16).
    #[arg(long, default_value_t = 4)]
    pub honest: usize,
    /// Sybils (1-200), each joined from its own address 127.0.0.2, 127.0.0.3, ...
    #[arg(long, default_value_t = 40)]
    pub sybils: usize,
    /// Scales of the sybils' sign-flipped gradients, in honest gradient norms.
    #[arg(long, value_delimiter = ',', default_value = "0.5,2,9")]
    pub poison_scales: Vec<f64>,
    /// Data directory of the servers (and of the poisoners' gradients).
    #[arg(long, default_value = "data/mnist")]
    pub data_dir: PathBuf,
    /// Extra flags for every `serve` (after the server mode's; not `--addr`).
    #[arg(last = true)]
    pub serve_args: Vec<String>,
}

impl AttackArgs {
    fn check(&self) -> Result<(Vec<&'static str>, Vec<Mode>, Vec<Exchange>)> {
        let bad = |m: String| Err(Error::Config(m));
        if !(self.seconds > 0.0 && self.seconds <= 600.0) {
            return bad(format!("--seconds {} must be in (0, 600]", self.seconds));
        }
        if !(1..=16).contains(&self.honest) {
            return bad(format!("--honest {} must be 1 to 16", self.honest));
        }
        if !(1..=200).contains(&self.sybils) {
            return bad(format!("--sybils {} must be 1 to 200", self.sybils));
        }
        if self
            .poison_scales
            .iter()
            .any(|s| !(s.is_finite() && *s > 0.0 && *s <= 1e6))
        {
            return bad("--poison-scales must be in (0, 1e6]".into());
        }
        if self.serve_args.iter().any(|a| a.starts_with("--addr")) {
            return bad("the attacks target 127.0.0.1 only: --addr is not taken".into());
        }
        let mut attacks = Vec::new();
        for a in &self.only {
            match ATTACKS.iter().find(|x| **x == a.trim()) {
                Some(x) => attacks.push(*x),
                None => return bad(format!("--only {a}: use {}", ATTACKS.join(", "))),
            }
        }
        if attacks.is_empty() {
            attacks = ATTACKS.to_vec();
        }
        let mut modes = Vec::new();
        for s in &self.servers {
            match s.trim() {
                "default" => modes.push(Mode::Default),
                "spot" => modes.push(Mode::Spot),
                other => return bad(format!("--servers {other}: use default or spot")),
            }
        }
        if modes.is_empty() {
            return bad("--servers names no server".into());
        }
        let mut exchanges = Vec::new();
        for l in &self.local_steps {
            let e = Exchange::parse(l)?;
            if !exchanges.contains(&e) {
                exchanges.push(e);
            }
        }
        if exchanges.is_empty() {
            return bad("--local-steps names no exchange".into());
        }
        Ok((attacks, modes, exchanges))
    }
}

fn print_verdict(v: &Verdict) {
    println!(
        "[{}] {}: {}\n    → {}",
        v.server, v.attack, v.figures, v.verdict
    );
}

/// Runs the selected attacks against each selected server; the verdicts in order.
///
/// # Errors
/// Bad flags or a missing dataset. An attack that fails to run (a server that does not
/// start, a socket error) is a verdict `ERROR: ...`, and the others still run.
pub async fn attack(args: &AttackArgs) -> Result<Vec<Verdict>> {
    let (attacks, modes, exchanges) = args.check()?;
    common::check_data(&args.data_dir)?;
    let nofile = crate::support::limits::raise_nofile();
    let seconds = if args.quick {
        args.seconds.min(8.0)
    } else {
        args.seconds
    };
    let mut scales = args.poison_scales.clone();
    if args.quick {
        scales.sort_by(f64::total_cmp);
        scales = scales.last().copied().into_iter().collect();
    }
    let mut ctx = Ctx {
        exchange: Exchange::Gradients,
        exe: std::env::current_exe().map_err(|e| Error::io("current exe", e))?,
        data_dir: args.data_dir.clone(),
        serve_args: args.serve_args.clone(),
        seconds,
        honest: args.honest,
        sybils: args.sybils,
        train: std::sync::OnceLock::new(),
    };
    println!(
        "crowdgrad bench attack: {} s per training attack, {} honest workers, {} sybils, poison scales {:?}; fd limit {} → {}; load average {:.2}",
        seconds,
        args.honest,
        args.sybils,
        scales,
        nofile.0,
        nofile.1,
        super::load_avg()
    );
    let mut out = Vec::new();
    let mut record = |v: Verdict| {
        print_verdict(&v);
        out.push(v);
    };
    let error = |attack: &str, server: String, e: Error| Verdict {
        attack: attack.into(),
        server,
        figures: "-".into(),
        verdict: format!("ERROR: {e}"),
    };
    for (&exchange, &mode) in exchanges
        .iter()
        .flat_map(|e| modes.iter().map(move |m| (e, m)))
    {
        ctx.exchange = exchange;
        let label = mode.label(exchange);
        let needs_clean = attacks
            .iter()
            .any(|a| matches!(*a, "idle" | "zeros" | "huge" | "poison" | "unsampled"));
        let mut clean = f64::NAN;
        for &a in &attacks {
            let t = Instant::now();
            if needs_clean
                && clean.is_nan()
                && matches!(a, "idle" | "zeros" | "huge" | "poison" | "unsampled")
            {
                match sybil::run(&ctx, mode, Push::Clean).await {
                    Ok(r) => {
                        clean = r.accuracy;
                        record(Verdict {
                            attack: "clean".into(),
                            server: label.clone(),
                            figures: format!(
                                "honest {}; accuracy {:.2}%; {:.0} s",
                                r.honest.describe(),
                                r.accuracy,
                                r.seconds
                            ),
                            verdict: "-".into(),
                        });
                    }
                    Err(e) => record(error("clean", label.clone(), e)),
                }
            }
            let pushes: Vec<Push> = match a {
                "idle" => vec![Push::Idle],
                "zeros" => vec![Push::Zeros],
                "huge" => vec![Push::Huge],
                "poison" => scales.iter().map(|s| Push::Poison(*s)).collect(),
                _ => Vec::new(),
            };
            for what in pushes {
                match sybil::run(&ctx, mode, what).await {
                    Ok(r) => record(sybil::verdict(label.clone(), what, &r, clean, ctx.sybils)),
                    Err(e) => record(error(&what.name(), label.clone(), e)),
                }
            }
            let one = match a {
                // Their pushes are H = 1 gradients (the gradient oracle): not honest pushes
                // under local steps, where a spot check would quarantine them for that.
                "stale" | "reports" | "replays" | "identity" if exchange.rounds() => {
                    Some(Ok(Verdict {
                        attack: a.into(),
                        server: label.clone(),
                        figures: "-".into(),
                        verdict:
                            "not run: its pushes are H = 1 gradients (run it with --local-steps 1)"
                                .into(),
                    }))
                }
                "sockets" => Some(misc::sockets(&ctx, mode).await),
                "unsampled" => Some(sybil::unsampled(&ctx, mode, clean).await),
                "stale" => Some(misc::stale(&ctx, mode).await),
                "reports" => Some(misc::reports(&ctx, mode).await),
                "replays" => Some(misc::replays(&ctx, mode).await),
                "identity" => Some(misc::identity(&ctx, mode).await),
                _ => None,
            };
            match one {
                Some(Ok(v)) => record(v),
                Some(Err(e)) => record(error(a, label.clone(), e)),
                None => {}
            }
            eprintln!("[{label}] {a}: {:.0} s", t.elapsed().as_secs_f64());
        }
    }
    Ok(out)
}

/// `crowdgrad bench attack`: runs the attacks, prints each verdict as it comes and the
/// summary table.
///
/// # Errors
/// As [`attack`].
pub fn cli(args: &AttackArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::io("tokio runtime", e))?;
    let started = Instant::now();
    let verdicts = rt.block_on(attack(args))?;
    println!();
    println!(
        "## Summary ({:.0} s, load average {:.2} at the end)",
        started.elapsed().as_secs_f64(),
        super::load_avg()
    );
    println!("| attack | server | verdict |");
    println!("|---|---|---|");
    for v in &verdicts {
        println!("| {} | {} | {} |", v.attack, v.server, v.verdict);
    }
    Ok(())
}
