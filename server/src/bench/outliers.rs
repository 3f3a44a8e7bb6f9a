//! `crowdgrad bench outliers`: how often does the norm bound refuse honest workers, and do the
//! ×10 and ×1e6 attacks still get through?
//!
//! Each configuration starts a real `crowdgrad serve` (its defaults, `--norm-bound 10`) and
//! `--workers` real `crowdgrad work` processes (one thread each) for `--seconds`, with
//! `--norm-clip-spacing 8` (a trusted worker's rare outlier is scaled down to the bound, the
//! default) and `0` (every push over the bound refused, as before issue 19), each without an
//! attacker and with one more `crowdgrad work --fault` worker pushing its gradient times 10
//! (`scale:10`) or times 1e6 (`scale:1e6`). It prints, per run, the honest workers' pushes
//! (applied, refused `out_of_bounds`, scaled), their refusal rate per 10,000, the attacker's
//! pushes sent, applied and scaled, and the final test accuracy.
//!
//! Everything stays on loopback; every process is killed when its run ends or fails.

use super::load::{agent, get_json, Server};
use crate::error::{Error, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Flags of `crowdgrad bench outliers`.
#[derive(Debug, Clone, Args)]
pub struct OutliersArgs {
    /// Honest `crowdgrad work` processes.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Seconds each run's workers train (at most 3,600).
    #[arg(long, default_value_t = 60.0)]
    pub seconds: f64,
    /// Attacks to run besides none, comma-separated `--fault` values of `crowdgrad work`
    /// (`""`: none).
    #[arg(long, value_delimiter = ',', default_value = "scale:10,scale:1e6")]
    pub attacks: Vec<String>,
    /// `--norm-clip-spacing` values to compare (0: refuse every push over the bound).
    #[arg(long, value_delimiter = ',', default_value = "8,0")]
    pub spacings: Vec<u32>,
    /// Data directory of the server.
    #[arg(long, default_value = "data/mnist")]
    pub data_dir: PathBuf,
    /// Extra flags for every `serve`.
    #[arg(last = true)]
    pub serve_args: Vec<String>,
}

/// What one run measured.
#[derive(Debug, Clone)]
pub struct OutlierRun {
    /// `--norm-clip-spacing`.
    pub spacing: u32,
    /// The attacker's `--fault`, if any.
    pub attack: Option<String>,
    /// Honest pushes applied (scaled ones included), refused `out_of_bounds`, scaled.
    pub honest_applied: u64,
    /// Honest pushes refused by the norm bound.
    pub honest_out_of_bounds: u64,
    /// Honest pushes scaled down to the bound.
    pub honest_clipped: u64,
    /// The attacker's pushes that reached a shard, were applied, were scaled.
    pub attack_pushes: u64,
    /// The attacker's pushes applied (scaled ones included).
    pub attack_applied: u64,
    /// The attacker's pushes scaled down to the bound.
    pub attack_clipped: u64,
    /// The last evaluation's test accuracy (%).
    pub accuracy: f64,
}

impl OutlierRun {
    /// Honest refusals per 10,000 honest pushes.
    pub fn honest_rate(&self) -> f64 {
        let n = self.honest_applied + self.honest_out_of_bounds;
        1e4 * self.honest_out_of_bounds as f64 / n.max(1) as f64
    }
}

fn work(exe: &Path, url: &str, name: &str, seconds: f64, fault: Option<&str>) -> Result<Child> {
    let mut c = Command::new(exe);
    c.args(["work", "--quiet", "--server", url, "--threads", "1"])
        .args(["--name", name, "--seconds", &seconds.to_string()]);
    if let Some(f) = fault {
        c.args(["--fault", f]);
    }
    c.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| Error::io("starting a worker", e))
}

/// Kills the children when dropped (a failed run leaves nothing behind).
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn one(exe: &Path, args: &OutliersArgs, spacing: u32, attack: Option<&str>) -> Result<OutlierRun> {
    // The norm bound alone, as recorded before issue 21's defaults: spot checks off (they
    // would quarantine the attacker, and the bound is what is measured). `serve_args` may
    // turn them on again.
    let mut serve = vec![
        "--norm-clip-spacing".to_string(),
        spacing.to_string(),
        "--spot-check".to_string(),
        "0".to_string(),
    ];
    serve.extend(args.serve_args.iter().cloned());
    let server = Server::start(exe, &args.data_dir, &serve, &[])?;
    let mut kids = Children(Vec::new());
    for i in 0..args.workers {
        let name = format!("honest-{i}");
        kids.0
            .push(work(exe, &server.url, &name, args.seconds, None)?);
    }
    if let Some(f) = attack {
        kids.0
            .push(work(exe, &server.url, "attacker", args.seconds, Some(f))?);
    }
    // Each worker stops by itself after --seconds; the deadline covers joins and downloads.
    let deadline = Instant::now() + Duration::from_secs_f64(args.seconds + 120.0);
    for c in &mut kids.0 {
        loop {
            match c.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(200));
                }
                Ok(None) => return Err(Error::Process("a worker outlived its deadline".into())),
                Err(e) => return Err(Error::io("waiting for a worker", e)),
            }
        }
    }
    let a = agent();
    // One evaluation of the final parameters (the evaluator runs every --eval-every).
    std::thread::sleep(Duration::from_millis(1500));
    let s = get_json(&a, &format!("{}/api/status", server.url))?;
    let mut run = OutlierRun {
        spacing,
        attack: attack.map(str::to_string),
        honest_applied: 0,
        honest_out_of_bounds: 0,
        honest_clipped: 0,
        attack_pushes: 0,
        attack_applied: 0,
        attack_clipped: 0,
        accuracy: s["eval"]["accuracy"].as_f64().unwrap_or(f64::NAN) * 100.0,
    };
    let workers = get_json(&a, &format!("{}/api/workers?limit=1000", server.url))?;
    let rows = workers["workers"]
        .as_array()
        .or_else(|| workers.as_array())
        .cloned()
        .unwrap_or_default();
    for w in &rows {
        let n = |k: &str| w[k].as_u64().unwrap_or(0);
        let oob = w["rejected_by_reason"]["out_of_bounds"]
            .as_u64()
            .unwrap_or(0);
        if w["name"] == "attacker" {
            run.attack_pushes += n("pushes_applied") + n("pushes_rejected");
            run.attack_applied += n("pushes_applied");
            run.attack_clipped += n("pushes_clipped");
        } else {
            run.honest_applied += n("pushes_applied");
            run.honest_out_of_bounds += oob;
            run.honest_clipped += n("pushes_clipped");
        }
    }
    if rows.is_empty() {
        return Err(Error::Process("the server listed no workers".into()));
    }
    Ok(run)
}

/// Runs every configuration (see the module docs).
///
/// # Errors
/// Bad flags, or a server or worker that fails to start or to finish in time.
pub fn outliers(exe: &Path, args: &OutliersArgs) -> Result<Vec<OutlierRun>> {
    if !(args.seconds > 0.0 && args.seconds <= 3600.0) {
        return Err(Error::Config(format!(
            "--seconds {} must be in (0, 3600]",
            args.seconds
        )));
    }
    if args.workers == 0 || args.workers > 16 {
        return Err(Error::Config(format!(
            "--workers {} must be 1 to 16",
            args.workers
        )));
    }
    let named: Vec<&String> = args.attacks.iter().filter(|a| !a.is_empty()).collect();
    for f in &named {
        crowdgrad_core::fault::Fault::parse(f)
            .map_err(|e| Error::Config(format!("--attacks {f}: {e}")))?;
    }
    let mut runs = Vec::new();
    let attacks: Vec<Option<&str>> = std::iter::once(None)
        .chain(named.iter().map(|a| Some(a.as_str())))
        .collect();
    for attack in attacks {
        for &spacing in &args.spacings {
            let r = one(exe, args, spacing, attack)?;
            eprintln!("{r:?}");
            runs.push(r);
        }
    }
    Ok(runs)
}

/// `crowdgrad bench outliers`: runs and prints the table.
///
/// # Errors
/// As [`outliers`].
pub fn cli(args: &OutliersArgs) -> Result<()> {
    let exe = std::env::current_exe().map_err(|e| Error::io("current exe", e))?;
    let runs = outliers(&exe, args)?;
    println!(
        "{} honest workers, {} s per run",
        args.workers, args.seconds
    );
    println!("| clip spacing | attacker | honest pushes applied | honest refused out_of_bounds | per 10,000 | honest scaled | attack pushes / applied / scaled | accuracy |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in &runs {
        println!(
            "| {} | {} | {} | {} | {:.2} | {} | {} | {:.2}% |",
            r.spacing,
            r.attack.as_deref().unwrap_or("none"),
            r.honest_applied,
            r.honest_out_of_bounds,
            r.honest_rate(),
            r.honest_clipped,
            if r.attack.is_some() {
                format!(
                    "{} / {} / {}",
                    r.attack_pushes, r.attack_applied, r.attack_clipped
                )
            } else {
                "-".into()
            },
            r.accuracy
        );
    }
    Ok(())
}
