//! `crowdgrad sim`: a classroom experiment runner. One process simulates K volunteer workers
//! training on real data against the real shard code, on a simulated clock.
//!
//! - Every gradient is real: each simulated worker is core's sans-IO
//!   [`crowdgrad_core::worker::Worker`] (the state machine the native and browser workers
//!   drive), computing [`crowdgrad_core::model::Model::loss_and_grad`] on its own partition of
//!   the training set, and exchanging real wire frames with the simulated shards.
//! - Every update is real: a simulated shard is the server's own shard side, core's
//!   [`crowdgrad_core::session::ShardSession`] over a
//!   [`crowdgrad_core::session::ShardState`] ([`shard::ShardDriver`]): the same validation,
//!   read waits, sync flushes and error frames, and [`crowdgrad_core::shard::ShardCore`], the
//!   one apply path.
//! - Only time is simulated: compute time per step, network delay per message (FIFO per
//!   connection, like a WebSocket), workers leaving and coming back, and faulty workers. Events
//!   are processed in `(simulated time, sequence number)` order from one priority queue, with
//!   randomness from [`crowdgrad_core::rng::Rng`] streams derived from the seed: no wall clock,
//!   no threads, no hash-map order, so the same seed gives the same CSV bytes (on the same
//!   binary and CPU).
//!
//! # Layout
//! - [`SimArgs`] (flags) → [`SimArgs::check`] → [`SimConfig`] (checked; `Default` for tests).
//! - [`run`] / [`run_with`]: one simulation → [`SimResult`] (rows, counters, read log, final
//!   parameters); [`SimResult::csv`] is `run.csv`.
//! - [`sweep_configs`]: one config per value of `--sweep PARAM=V1,V2,...`.
//! - [`cli`]: what `crowdgrad sim` does (load data, run or sweep, write CSV, SVG and summary).
//! - `config`: [`SimArgs`], [`SimConfig`]; `report`: [`Row`], [`Totals`], [`SimResult`],
//!   summaries; `sweep`: [`sweep_configs`].
//! - `engine` (private): the event loop (`engine.rs`), the simulated volunteers
//!   (`engine/participants.rs`), randomness and faults (`engine/faults.rs`), and the link to
//!   the shards (`engine/shard_side.rs`), whose sans-IO driver is [`shard`]. `plot`: SVG charts.

mod config;
mod engine;
mod plot;
mod report;
mod row;
pub mod shard;
mod sweep;

pub use config::*;
use report::write;
pub use report::*;
pub use sweep::*;

use crate::error::{Error, Result};
use crate::support::data::TrainTest;
use std::time::Instant;

/// Runs one simulation.
///
/// # Errors
/// [`Error::Config`] for an invalid config or a model that does not fit the data; model errors.
pub fn run(cfg: &SimConfig, data: &TrainTest) -> Result<SimResult> {
    run_with(cfg, data, &mut |_| {})
}

/// Runs one simulation, calling `on_row` with each row as it is produced.
///
/// # Errors
/// As [`run`].
pub fn run_with(
    cfg: &SimConfig,
    data: &TrainTest,
    on_row: &mut dyn FnMut(&Row),
) -> Result<SimResult> {
    cfg.validate()?;
    let started = Instant::now();
    let mut result = engine::Engine::new(cfg, data)?.run(on_row)?;
    result.wall_seconds = started.elapsed().as_secs_f64();
    Ok(result)
}
/// What `crowdgrad sim` does: loads the data, runs one simulation or a sweep, writes the CSVs,
/// plots and summary under `--out` and prints the summary table.
///
/// # Errors
/// Bad flags, missing data, or files that cannot be written.
pub fn cli(args: &SimArgs) -> Result<()> {
    let runs = match &args.sweep {
        Some(spec) => sweep_configs(args, spec)?,
        None => vec![("run".to_string(), args.check()?)],
    };
    let model = runs.first().map_or("", |(_, c)| c.model.as_str());
    let data = crate::support::text::ensure(
        &args.data_dir,
        "mnist",
        !args.no_fetch,
        &args.text.check()?,
        model,
    )?;
    std::fs::create_dir_all(&args.out)
        .map_err(|e| Error::io(format!("creating {}", args.out.display()), e))?;
    let mut lines = Vec::new();
    let mut series = Vec::new();
    let n = runs.len();
    for (i, (label, cfg)) in runs.iter().enumerate() {
        eprintln!("[{}/{n}] {label}: {}", i + 1, cfg.describe());
        let quiet = args.quiet;
        let sybils = cfg.sybils > 0;
        let r = run_with(cfg, &data, &mut |row: &Row| {
            if !quiet {
                let sybil = if sybils {
                    format!(
                        "  sybils accepted {} rejected {}  norm ref {:.4}",
                        row.sybil_accepted, row.sybil_rejected, row.norm_reference
                    )
                } else {
                    String::new()
                };
                eprintln!(
                    "  samples {:>8}  sim {:>8.1} s  accuracy {:6.2}%  loss {:.4}  staleness {:5.2}  updates {}  rejected {}  online {}{sybil}",
                    row.samples,
                    row.sim_time_s,
                    row.test_accuracy * 100.0,
                    row.test_loss,
                    row.mean_staleness,
                    row.updates,
                    row.rejected,
                    row.workers_online
                );
            }
        })?;
        let dir = if args.sweep.is_some() {
            args.out.join(slug(label))
        } else {
            args.out.clone()
        };
        let title = if args.sweep.is_some() {
            format!("{label} ({})", cfg.describe())
        } else {
            cfg.describe()
        };
        write_run(&dir, &title, &r)?;
        eprintln!("  {}", r.digest());
        if let Some(line) = r.sybil_digest() {
            eprintln!("  {line}");
        }
        if r.totals.stalled {
            eprintln!(
                "  warning: the run stalled (no step completed for a long time); stopped early"
            );
        }
        eprintln!(
            "  final accuracy {:.2}% after {} samples, {:.1} simulated s in {:.1} s wall ({:.0}x real time); wrote {}",
            r.final_accuracy() * 100.0,
            r.totals.samples,
            r.totals.sim_seconds,
            r.wall_seconds,
            r.speedup(),
            dir.join("run.csv").display()
        );
        series.push(plot::Series::of(label, &r.rows));
        lines.push(SummaryLine::of(label.clone(), &r));
    }
    if let Some(spec) = &args.sweep {
        let param = spec.split_once('=').map_or("", |(p, _)| p.trim());
        let title = format!("sweep {spec} ({})", runs[0].1.describe_except(param));
        write(
            &args.out.join("sweep.svg"),
            &plot::accuracy_svg(&title, &series),
        )?;
    }
    write(&args.out.join("summary.csv"), &summary_csv(&lines))?;
    let md = summary_markdown(&lines);
    write(&args.out.join("summary.md"), &md)?;
    println!("{md}");
    Ok(())
}
#[cfg(test)]
mod tests {
    use super::*;
    use crowdgrad_core::shard::Consistency;

    fn parse(flags: &[&str]) -> SimArgs {
        use clap::Parser;
        #[derive(Parser)]
        struct P {
            #[command(flatten)]
            a: SimArgs,
        }
        P::try_parse_from(std::iter::once("sim").chain(flags.iter().copied()))
            .expect("flags parse")
            .a
    }

    fn args() -> SimArgs {
        parse(&[])
    }

    #[test]
    fn consistency_is_the_serve_flag_and_mode_its_alias() {
        assert_eq!(SimConfig::default().consistency, Consistency::Async);
        assert_eq!(SimConfig::default().shards, SIM_SHARDS);
        for flag in ["--consistency", "--mode"] {
            let c = parse(&[flag, "ssp:2"]).check().unwrap();
            assert_eq!(c.consistency, Consistency::Ssp { bound: 2 }, "{flag}");
        }
        let c = parse(&[
            "--shards",
            "3",
            "--heartbeat-timeout",
            "1.5",
            "--staleness",
            "scale",
        ])
        .check()
        .unwrap();
        assert_eq!((c.shards, c.heartbeat), (3, 1.5));
        assert!(c.staleness.scale_lr.is_some());
    }

    #[test]
    fn defaults_are_valid_and_bad_flags_are_errors() {
        let c = SimConfig::default();
        assert_eq!(c.samples, Some(DEFAULT_SAMPLES));
        assert_eq!(c.partitions, c.workers);
        assert_eq!(c.optimizer.lr, 0.05);
        type Edit = fn(&mut SimArgs);
        let cases: [(&str, Edit); 23] = [
            ("workers", |a| a.workers = 0),
            ("consistency", |a| a.training.consistency = "bsp".into()),
            ("staleness", |a| a.training.staleness = "drop".into()),
            ("speed", |a| a.speed = "uniform:1.5".into()),
            ("fault", |a| a.fault = "scale:x".into()),
            ("kind", |a| a.dropout_kind = "vanish".into()),
            ("faulty", |a| a.faulty = 1.5),
            ("step", |a| a.step_ms = f64::NAN),
            ("delay", |a| a.delay_ms = -1.0),
            ("lr", |a| a.training.lr = Some(-0.1)),
            ("model", |a| a.training.model = "lstm".into()),
            ("local steps", |a| a.training.local_steps = Some("0".into())),
            ("inner lr", |a| a.training.inner_lr = Some(f32::NAN)),
            ("pull encoding", |a| {
                a.training.pull_encoding = "int8_block".into()
            }),
            ("push encoding", |a| a.training.push_encoding = "fp8".into()),
            ("eval", |a| a.eval_every = 0),
            ("samples", |a| a.samples = Some(0)),
            ("seconds", |a| a.sim_seconds = Some(f64::INFINITY)),
            ("momentum", |a| a.training.momentum = Some(0.5)),
            ("sybils", |a| a.sybils = 5000),
            ("sybil at", |a| a.sybil_at = f64::NAN),
            ("sybil fault", |a| a.sybil_fault = "huge".into()),
            ("sybil fault", |a| a.sybil_fault = "zero".into()),
        ];
        for (what, f) in cases {
            let mut a = args();
            f(&mut a);
            assert!(a.check().is_err(), "{what} should be rejected");
        }
    }

    #[test]
    fn sweep_expands_values_and_rejects_nonsense() {
        let a = args();
        let runs = sweep_configs(&a, "mode=async,ssp:2,sync:4").unwrap();
        assert_eq!(runs.len(), 3);
        assert_eq!(runs[1].1.consistency, Consistency::Ssp { bound: 2 });
        let runs = sweep_configs(&a, "consistency=async,sync:4").unwrap();
        assert_eq!(runs[1].0, "consistency=sync:4");
        assert_eq!(runs[1].1.consistency, Consistency::Sync { k: 4 });
        let runs = sweep_configs(&a, "staleness=accept;drop:8,scale").unwrap();
        assert_eq!(runs[1].0, "staleness=drop:8,scale");
        assert!(runs[1].1.staleness.scale_lr.is_some());
        let runs = sweep_configs(&a, "workers=1,4").unwrap();
        assert_eq!(runs[1].1.partitions, 4, "one partition per worker");
        assert_eq!(slug("staleness=drop:8,scale"), "staleness=drop_8_scale");
        // Issue 8: local steps and encodings are sweepable too.
        let runs = sweep_configs(&a, "local-steps=1,32,auto").unwrap();
        assert!(!runs[0].1.exchange.local.steps.pseudo_gradients());
        assert_eq!(runs[1].1.exchange.local.steps.to_string(), "32");
        assert_eq!(
            runs[1].1.optimizer.lr, 1.0,
            "the outer lr of async local steps"
        );
        assert!(runs[0].1.describe_except("local-steps").contains("pushes"));
        let runs = sweep_configs(&a, "push-encoding=f32,bf16,int8_block").unwrap();
        assert_eq!(runs[2].1.exchange.push_encoding.name(), "int8_block");
        let runs = sweep_configs(&a, "inner-lr=0.001,0.003").unwrap();
        assert_eq!(runs[1].1.exchange.local.inner.lr, 0.003);
        // Issue 21: sybils are sweepable, and the error names --sybil-fault.
        let runs = sweep_configs(&a, "sybil-fault=zeros;huge:100;signflip:5").unwrap();
        assert_eq!(runs[1].1.sybil_fault, Fault::Huge(100.0));
        assert!(runs[0]
            .1
            .describe_except("sybil-fault")
            .contains("sybils from 0 s"));
        let runs = sweep_configs(&a, "sybils=0,40").unwrap();
        assert_eq!((runs[0].1.sybils, runs[1].1.sybils), (0, 40));
        let e = parse(&["--sybil-fault", "lots"]).check().unwrap_err();
        assert!(e.to_string().contains("--sybil-fault"), "{e}");
        let runs = sweep_configs(&a, "overlap=on,off").unwrap();
        assert!(runs[0].1.exchange.local.overlap && !runs[1].1.exchange.local.overlap);
        for bad in [
            "overlap=yes",
            "push-encoding=int4",
            "pull-encoding=int8_block",
            "local-steps=0",
            "inner-lr=x",
            "mode",
            "speed=1,2",
            "workers=1,x",
            "workers=",
            "lr=0.1,0.1",
            "ssp=a",
        ] {
            assert!(sweep_configs(&a, bad).is_err(), "{bad}");
        }
    }
}
