//! The `crowdgrad` command: parse flags, then call the library.

use anyhow::Context;
use crowdgrad::cli::{BenchCmd, Cli, Cmd, DataCmd, LogFormat};
use crowdgrad::worker::work;
use std::time::Duration;

/// Structured logs on stderr: `RUST_LOG` filter, text or JSON lines.
fn init_logs(format: LogFormat) {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().with_current_span(false).init(),
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

fn main() -> anyhow::Result<()> {
    // `serve --config run.toml`: the file's values become the flags' defaults (crowdgrad::config::runfile).
    let (cli, resolved) =
        crowdgrad::config::runfile::resolve::<Cli>(std::env::args_os().collect())?;
    init_logs(cli.log_format);
    match cli.command {
        Cmd::Serve(args) => {
            let mut cfg = args.check().map_err(|e| {
                anyhow::anyhow!(crowdgrad::config::runfile::explain(e, resolved.as_ref()))
            })?;
            if let Some(r) = &resolved {
                // One block, as TOML: a run file that reproduces this run (no secrets in it).
                println!("# crowdgrad serve: resolved configuration\n{}", r.to_toml());
                cfg.resolved = r.to_json();
            }
            let data = crowdgrad::support::text::ensure(
                &cfg.data_dir,
                &cfg.dataset,
                cfg.fetch,
                &cfg.text,
                &cfg.training.model,
            )
            .with_context(|| format!("loading the dataset from {}", cfg.data_dir.display()))?;
            let rt = tokio::runtime::Runtime::new()?;
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind(cfg.addr)
                    .await
                    .with_context(|| format!("binding {}", cfg.addr))?;
                let addr = listener.local_addr()?;
                tracing::info!(
                    model = %cfg.training.model, shards = cfg.training.shards, train = data.train.len(), test = data.test.len(),
                    "serving; open http://{addr}/ in a browser or run `crowdgrad work --server http://{addr}`"
                );
                let scheme = if cfg.tls.is_some() { "https" } else { "http" };
                println!("crowdgrad listening on {scheme}://{addr}");
                crowdgrad::run(listener, cfg, data, shutdown_signal()).await?;
                anyhow::Ok(())
            })?;
        }
        Cmd::Work(args) => {
            let json = args.json;
            let opts = args.options()?;
            if let Some(f) = &opts.fault {
                eprintln!(
                    "WARNING: this is a FAULTY worker (--fault {f}): its pushes are wrong on purpose, for experiments on robust aggregation and spot checks. Never run it against a run you care about."
                );
            }
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let summary = rt.block_on(work(opts, shutdown_signal()));
            // An HTTP call stuck on a stalled link sits on a blocking thread until its own
            // deadline; do not wait for it (dropping the runtime would): stop now.
            rt.shutdown_timeout(Duration::from_millis(100));
            let summary = summary?;
            if json {
                println!("{}", serde_json::to_string(&summary)?);
            } else {
                let s = &summary.stats;
                println!(
                    "worker {:?}{}: {} steps, {} samples in {:.1} s ({:.0} samples/s); pushes {} accepted, {} rejected, {} lost; loss {:.4}; mean staleness {:.2}; sessions {}; peak RSS {} MiB{}",
                    summary.worker_ids,
                    if summary.threads > 1 { format!(" ({} threads)", summary.threads) } else { String::new() },
                    s.steps,
                    s.samples,
                    summary.seconds,
                    summary.samples_per_sec,
                    s.pushes_accepted,
                    s.pushes_rejected,
                    s.pushes_lost,
                    s.ema_loss,
                    s.staleness_sum as f64 / s.pushes_accepted.max(1) as f64,
                    summary.sessions,
                    summary.peak_rss_kib.unwrap_or(0) / 1024,
                    summary.last_error.as_ref().map(|e| format!("; last error: {e}")).unwrap_or_default()
                );
                if let Some(p) = &summary.public_id {
                    println!("credited to public id {p} (the leaderboard shows it; the identity itself is a secret)");
                }
            }
            anyhow::ensure!(
                !summary.refused,
                "{}",
                summary.last_error.as_deref().unwrap_or("join refused")
            );
        }
        Cmd::Shard(args) => {
            let cfg = args.check()?;
            let rt = tokio::runtime::Runtime::new()?;
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind(cfg.listen)
                    .await
                    .with_context(|| format!("binding {}", cfg.listen))?;
                let addr = listener.local_addr()?;
                println!(
                    "crowdgrad shard {} of {} listening on ws://{addr}",
                    cfg.index, cfg.training.shards
                );
                crowdgrad::shardproc::run(listener, cfg, shutdown_signal()).await?;
                anyhow::Ok(())
            })?;
        }
        Cmd::Sim(args) => crowdgrad::sim::cli(&args)?,
        Cmd::Ctl(args) => {
            let answer = crowdgrad::ctl::run(&args)?;
            println!("{}", serde_json::to_string_pretty(&answer)?);
        }
        Cmd::Export {
            checkpoint_dir,
            server,
            out,
            weights,
        } => {
            let live = weights == crowdgrad::cli::ExportWeights::Live;
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let done = rt.block_on(async {
                match (checkpoint_dir, server) {
                    (Some(dir), _) => {
                        crowdgrad::checkpoint::export_checkpoint(&dir, &out, live).await
                    }
                    (None, Some(url)) => {
                        crowdgrad::checkpoint::export_server(&url, &out, live).await
                    }
                    (None, None) => Err(crowdgrad::Error::Config(
                        "give --checkpoint-dir or --server".into(),
                    )),
                }
            })?;
            println!(
                "wrote {} ({}, {} parameters, {} weights, versions {:?}, {} bytes) from {}",
                out.display(),
                done.model,
                done.params,
                done.weights,
                done.versions,
                done.bytes,
                done.source
            );
        }
        Cmd::Data {
            command: DataCmd::Fetch { dataset, from, dir },
        } => {
            let dir = dir.unwrap_or_else(|| crowdgrad::support::text::default_dir(&dataset));
            if dataset == "sentences" && from.is_none() {
                let got = crowdgrad::support::text::fetch_sentences(&dir)?;
                let data = crowdgrad::support::text::load_text(
                    &dir,
                    &crowdgrad::support::text::TextConfig::default(),
                    crowdgrad::support::text::DEFAULT_CONTEXT,
                )?;
                println!(
                    "sentences: {} sentences; train.txt {} bytes, valid.txt {} bytes; {} characters (chars level: {} tokens); {} training and {} validation windows of {} tokens in {}",
                    got.sentences,
                    got.train_bytes,
                    got.valid_bytes,
                    data.text.as_ref().map_or(0, |t| t.vocab.chars().count()),
                    data.text.as_ref().map_or(0, |t| t.vocab_size()),
                    data.train.len(),
                    data.test.len(),
                    crowdgrad::support::text::DEFAULT_CONTEXT + 1,
                    dir.display()
                );
                return Ok(());
            }
            let data = match from {
                Some(from) => crowdgrad::support::data::import_dir(&from, &dir)?,
                None => {
                    anyhow::ensure!(
                        dataset == "mnist",
                        "only mnist and sentences can be downloaded; use --from DIR for {dataset}"
                    );
                    crowdgrad::support::data::fetch_mnist(&dir)?;
                    crowdgrad::support::data::load_dir(&dir)?
                }
            };
            println!(
                "{dataset}: {} training and {} test examples of {:?} in {}",
                data.train.len(),
                data.test.len(),
                data.train.image_dims,
                dir.display()
            );
        }
        Cmd::Bench {
            command:
                BenchCmd::E2e {
                    workers,
                    seconds,
                    data_dir,
                    serve_args,
                },
        } => {
            let exe = std::env::current_exe()?;
            println!("{}", crowdgrad::bench::E2e::HEADER);
            for n in workers {
                let r = crowdgrad::bench::e2e(&exe, &data_dir, n, seconds, &serve_args)?;
                println!("{}", r.row());
            }
        }
        Cmd::Bench {
            command: BenchCmd::Link(args),
        } => crowdgrad::bench::link::cli(&args)?,
        Cmd::Bench {
            command: BenchCmd::Churn(args),
        } => crowdgrad::bench::churn::cli_churn(&args)?,
        Cmd::Bench {
            command: BenchCmd::Flood(args),
        } => crowdgrad::bench::flood::cli_flood(&args)?,
        Cmd::Bench {
            command: BenchCmd::Outliers(args),
        } => crowdgrad::bench::outliers::cli(&args)?,
        Cmd::Bench {
            command: BenchCmd::Crowd(args),
        } => crowdgrad::bench::crowdrun::cli(&args)?,
        Cmd::Bench {
            command: BenchCmd::Checkpoint(args),
        } => crowdgrad::bench::checkpoint::cli(&args)?,
        Cmd::Bench {
            command: BenchCmd::Ledger(args),
        } => crowdgrad::bench::ledger::cli(&args)?,
        Cmd::Bench {
            command: BenchCmd::Attack(args),
        } => crowdgrad::bench::attack::cli(&args)?,
        Cmd::Bench {
            command:
                BenchCmd::Roundtrip {
                    params,
                    iters,
                    data_dir,
                },
        } => {
            let data = crowdgrad::support::data::load_dir(&data_dir)?;
            let rt = tokio::runtime::Runtime::new()?;
            println!("| params | mean | p50 | p99 | payload MB/s |");
            println!("|---|---|---|---|---|");
            for p in params {
                let r = rt.block_on(crowdgrad::bench::roundtrip(data.clone(), p, iters))?;
                println!(
                    "| {} | {:.3} ms | {:.3} ms | {:.3} ms | {:.0} |",
                    r.params, r.mean_ms, r.p50_ms, r.p99_ms, r.mb_per_sec
                );
            }
        }
    }
    Ok(())
}
