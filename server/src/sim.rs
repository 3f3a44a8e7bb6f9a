//! `crowdgrad sim`: a classroom experiment runner. One process simulates K volunteer workers
//! training on real data against the real shard code, on a simulated clock.
//!
//! - Every gradient is real: each simulated worker is core's sans-IO
//!   [`crowdgrad_core::worker::Worker`] (the state machine the native and browser workers
//!   drive), computing [`crowdgrad_core::model::Model::loss_and_grad`] on its own partition of
//!   the training set, and exchanging real wire frames with the simulated shards.
//! - Every update is real: a simulated shard validates a push as the server does
//!   (`wire::decode`, then [`crowdgrad_core::wire::F32Le::copy_into`], which rejects NaN and
//!   infinities) and applies it with [`crowdgrad_core::shard::ShardCore::push`], the server's
//!   one apply path; SSP reads are gated by [`crowdgrad_core::shard::SspClock`] and sync
//!   aggregates are flushed by the server's rules (enough pushes for the connected workers, a
//!   waiting pull timing out, a worker leaving).
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
//! - `engine` (private): the event loop, simulated shards and workers. `plot`: SVG charts.

mod engine;
mod plot;
pub mod shard;

use crate::config::TrainingArgs;
use crate::data::TrainTest;
use crate::error::{Error, Result};
use clap::Args;
use crowdgrad_core::model::ModelSpec;
use crowdgrad_core::optim::OptimizerConfig;
use crowdgrad_core::shard::{Consistency, StalenessPolicy};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Flags of `crowdgrad sim`. The training flags ([`TrainingArgs`]: model, optimizer, batch,
/// seed, shards, consistency, staleness, timeouts) are `crowdgrad serve`'s, flattened; `--mode`
/// is kept as an alias of `--consistency`.
#[derive(Debug, Clone, Args)]
#[command(
    mut_arg("consistency", |a| a.visible_alias("mode")),
    mut_arg("shards", |a| a.default_value("1")), // SIM_SHARDS
)]
pub struct SimArgs {
    /// Directory holding the four IDX files (raw or .gz).
    #[arg(long, default_value = "data/mnist")]
    pub data_dir: PathBuf,
    /// Do not fetch MNIST when the data directory is empty.
    #[arg(long)]
    pub no_fetch: bool,
    /// Output directory (run.csv, run.svg, summary.csv, summary.md).
    #[arg(long, default_value = "sim-out")]
    pub out: PathBuf,
    /// Simulated workers.
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    /// Model, optimizer, batch, seed, shards, consistency, staleness and timeouts (as `serve`).
    #[command(flatten)]
    pub training: TrainingArgs,
    /// Data partitions; worker i trains on partition i mod partitions [default: one per worker].
    #[arg(long)]
    pub partitions: Option<usize>,
    /// Budget: training examples (summed over workers) [default: 200000 unless --sim-seconds].
    #[arg(long)]
    pub samples: Option<u64>,
    /// Budget: simulated seconds.
    #[arg(long)]
    pub sim_seconds: Option<f64>,
    /// Evaluate on the test subset every this many training examples.
    #[arg(long, default_value_t = 10_000)]
    pub eval_every: u64,
    /// Test examples for the periodic evaluations (every n-th example of the test set; 0 = all).
    /// The final row always uses the full test set.
    #[arg(long, default_value_t = 2_000)]
    pub eval_subset: usize,
    /// Mean compute time of one gradient step, milliseconds.
    #[arg(long, default_value_t = 50.0)]
    pub step_ms: f64,
    /// How worker speeds spread around the mean: `fixed`, `uniform:SPREAD` (mean x U[1-S, 1+S])
    /// or `lognormal:SIGMA` (mean-preserving).
    #[arg(long, default_value = "lognormal:0.5")]
    pub speed: String,
    /// Per-step jitter: each step's time is multiplied by a mean-one lognormal of this sigma.
    #[arg(long, default_value_t = 0.1)]
    pub jitter: f64,
    /// Mean one-way network latency per message, milliseconds.
    #[arg(long, default_value_t = 10.0)]
    pub delay_ms: f64,
    /// Latency jitter: each message's latency is the mean x U[1-J, 1+J].
    #[arg(long, default_value_t = 0.5)]
    pub delay_jitter: f64,
    /// Link bandwidth in Mbit/s (adds size/bandwidth to each message) [default: unlimited].
    #[arg(long)]
    pub mbps: Option<f64>,
    /// Mean simulated seconds a worker stays before it leaves (exponential) [default: never].
    #[arg(long)]
    pub dropout_every: Option<f64>,
    /// Mean simulated seconds a worker stays away before it comes back (exponential).
    #[arg(long, default_value_t = 10.0)]
    pub away: f64,
    /// How a worker leaves: `disconnect` (closes its connections; rejoins as a new worker) or
    /// `pause` (goes silent on open connections, like a sleeping laptop, and resumes).
    #[arg(long, default_value = "disconnect")]
    pub dropout_kind: String,
    /// Fraction of faulty workers.
    #[arg(long, default_value_t = 0.0)]
    pub faulty: f64,
    /// What faulty workers push: `nan` (one NaN per push), `noise` (Gaussian noise with the
    /// gradient's norm) or `scale:F` (the gradient times F).
    #[arg(long, default_value = "nan")]
    pub fault: String,
    /// Run one simulation per value: PARAM=V1,V2,... with PARAM one of consistency (or mode),
    /// workers, ssp, staleness, lr, faulty, fault, dropout-every, dropout-kind, delay-ms,
    /// step-ms, batch-size.
    /// Separate values with `;` when they contain commas (staleness=accept;drop:8,scale).
    #[arg(long)]
    pub sweep: Option<String>,
    /// Print only the summary.
    #[arg(long)]
    pub quiet: bool,
}

/// How per-worker mean step times spread around `--step-ms`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SpeedDist {
    /// Every worker has the mean speed.
    Fixed,
    /// Mean x U[1 - spread, 1 + spread].
    Uniform {
        /// Relative half-width, in [0, 1).
        spread: f64,
    },
    /// Mean x exp(sigma N(0,1) - sigma^2 / 2): mean-preserving, a long tail of slow workers.
    LogNormal {
        /// Standard deviation of the log.
        sigma: f64,
    },
}

impl SpeedDist {
    /// Parses `fixed`, `uniform:SPREAD` or `lognormal:SIGMA`.
    ///
    /// # Errors
    /// [`Error::Config`] on anything else or an out-of-range number.
    pub fn parse(text: &str) -> Result<Self> {
        let t = text.trim();
        let num = |s: &str, ok: &dyn Fn(f64) -> bool| {
            match s.parse::<f64>() {
            Ok(v) if v.is_finite() && ok(v) => Ok(v),
            _ => Err(Error::Config(format!(
                "bad number in --speed {t:?}: uniform:SPREAD needs 0 <= SPREAD < 1, lognormal:SIGMA needs 0 <= SIGMA <= 3"
            ))),
        }
        };
        if t == "fixed" {
            Ok(SpeedDist::Fixed)
        } else if let Some(s) = t.strip_prefix("uniform:") {
            Ok(SpeedDist::Uniform {
                spread: num(s, &|v| (0.0..1.0).contains(&v))?,
            })
        } else if let Some(s) = t.strip_prefix("lognormal:") {
            Ok(SpeedDist::LogNormal {
                sigma: num(s, &|v| (0.0..=3.0).contains(&v))?,
            })
        } else {
            Err(Error::Config(format!(
                "unknown --speed {t:?}: use fixed, uniform:SPREAD (0 <= SPREAD < 1) or lognormal:SIGMA (0..3)"
            )))
        }
    }
}

/// What a faulty worker does to each of its pushes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fault {
    /// Puts one NaN in the push: the shard must reject it (and closes the connection, as the
    /// server does for a non-finite payload).
    Nan,
    /// Replaces the gradient by Gaussian noise of the same L2 norm.
    Noise,
    /// Multiplies the gradient by a factor.
    Scale(f32),
}

impl Fault {
    /// Parses `nan`, `noise` or `scale:F`.
    ///
    /// # Errors
    /// [`Error::Config`] on anything else.
    pub fn parse(text: &str) -> Result<Self> {
        match text.trim() {
            "nan" => Ok(Fault::Nan),
            "noise" => Ok(Fault::Noise),
            t => match t.strip_prefix("scale:").map(str::parse::<f32>) {
                Some(Ok(f)) if f.is_finite() => Ok(Fault::Scale(f)),
                _ => Err(Error::Config(format!(
                    "unknown --fault {t:?}: use nan, noise or scale:F"
                ))),
            },
        }
    }
}

/// How a worker leaves for a while.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropoutKind {
    /// Closes its connections (the shards see it leave at once) and rejoins later as a new
    /// worker, like a closed and reopened tab.
    Disconnect,
    /// Stays connected but silent (a sleeping laptop): the shards drop it from the SSP clock
    /// after the heartbeat timeout; it resumes where it stopped.
    Pause,
}

/// A checked simulation config. `Default` gives the defaults of `crowdgrad sim`.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Simulated workers.
    pub workers: usize,
    /// Parameter shards.
    pub shards: usize,
    /// Data partitions (worker i trains on partition i mod partitions).
    pub partitions: usize,
    /// Model text, e.g. `mlp:128`.
    pub model: String,
    /// The shards' optimizer.
    pub optimizer: OptimizerConfig,
    /// Examples per gradient.
    pub batch_size: usize,
    /// Consistency mode.
    pub consistency: Consistency,
    /// Staleness policy for async/SSP pushes.
    pub staleness: StalenessPolicy,
    /// Seed of everything.
    pub seed: u64,
    /// Budget in training examples.
    pub samples: Option<u64>,
    /// Budget in simulated seconds.
    pub sim_seconds: Option<f64>,
    /// Training examples between evaluations.
    pub eval_every: u64,
    /// Test examples in periodic evaluations (0: the full test set).
    pub eval_subset: usize,
    /// Mean step compute time, seconds.
    pub step_time: f64,
    /// Spread of worker speeds.
    pub speed: SpeedDist,
    /// Per-step jitter (lognormal sigma).
    pub jitter: f64,
    /// Mean one-way latency, seconds.
    pub delay: f64,
    /// Relative latency jitter in [0, 1].
    pub delay_jitter: f64,
    /// Bandwidth in bits per second, if limited.
    pub bandwidth: Option<f64>,
    /// Mean seconds between departures of one worker.
    pub dropout_every: Option<f64>,
    /// Mean seconds away.
    pub away: f64,
    /// How workers leave.
    pub dropout_kind: DropoutKind,
    /// Fraction of faulty workers.
    pub faulty: f64,
    /// What they push.
    pub fault: Fault,
    /// SSP heartbeat timeout, seconds.
    pub heartbeat: f64,
    /// sync:K straggler timeout, seconds.
    pub sync_timeout: f64,
    /// Local steps, overlap and encodings.
    pub exchange: crate::config::Exchange,
    /// Keep every read in [`SimResult::reads`] (for tests; costs memory on long runs).
    pub log_reads: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        use clap::Parser;
        #[derive(Parser)]
        struct P {
            #[command(flatten)]
            a: SimArgs,
        }
        P::parse_from(["sim"])
            .a
            .check()
            .expect("the defaults of `crowdgrad sim` are valid")
    }
}

/// `--shards` of `crowdgrad sim` when not given.
pub const SIM_SHARDS: usize = 1;

/// Default budget when neither `--samples` nor `--sim-seconds` is given.
pub const DEFAULT_SAMPLES: u64 = 200_000;

impl SimArgs {
    /// Parses and validates the flags.
    ///
    /// # Errors
    /// [`Error::Config`] naming the first bad flag.
    pub fn check(&self) -> Result<SimConfig> {
        // The same flags, defaults and checks as `serve`.
        let t = self.training.check(SIM_SHARDS)?;
        let dropout_kind = match self.dropout_kind.trim() {
            "disconnect" => DropoutKind::Disconnect,
            "pause" => DropoutKind::Pause,
            other => {
                return Err(Error::Config(format!(
                    "unknown --dropout-kind {other:?}: use disconnect or pause"
                )))
            }
        };
        let samples = match (self.samples, self.sim_seconds) {
            (None, None) => Some(DEFAULT_SAMPLES),
            (s, _) => s,
        };
        let cfg = SimConfig {
            workers: self.workers,
            shards: t.shards,
            partitions: self.partitions.unwrap_or(self.workers),
            model: t.model,
            optimizer: t.optimizer,
            batch_size: t.batch_size,
            consistency: t.consistency,
            staleness: t.staleness,
            seed: t.seed,
            samples,
            sim_seconds: self.sim_seconds,
            eval_every: self.eval_every,
            eval_subset: self.eval_subset,
            step_time: self.step_ms / 1e3,
            speed: SpeedDist::parse(&self.speed)?,
            jitter: self.jitter,
            delay: self.delay_ms / 1e3,
            delay_jitter: self.delay_jitter,
            bandwidth: self.mbps.map(|m| m * 1e6),
            dropout_every: self.dropout_every,
            away: self.away,
            dropout_kind,
            faulty: self.faulty,
            fault: Fault::parse(&self.fault)?,
            heartbeat: t.heartbeat_timeout,
            sync_timeout: t.sync_timeout,
            exchange: t.exchange,
            log_reads: false,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

impl SimConfig {
    /// Checks every value is in range (the fields are public, so [`run`] checks again).
    ///
    /// # Errors
    /// [`Error::Config`] naming the first bad value.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        self.optimizer.validate()?;
        ModelSpec::parse(&self.model, 784, 10)?;
        let finite = |v: f64| v.is_finite();
        // Each simulated worker holds its parameters and gradient (~1 MB for the default MLP).
        if !(1..=1024).contains(&self.workers) {
            return bad(format!("--workers {} must be in 1..=1024", self.workers));
        }
        if !(1..=256).contains(&self.shards) {
            return bad(format!("--shards {} must be in 1..=256", self.shards));
        }
        if !(1..=10_000).contains(&self.partitions) {
            return bad(format!(
                "--partitions {} must be in 1..=10000",
                self.partitions
            ));
        }
        if !(1..=4096).contains(&self.batch_size) {
            return bad(format!(
                "--batch-size {} must be in 1..=4096",
                self.batch_size
            ));
        }
        match (self.samples, self.sim_seconds) {
            (None, None) => return bad("give a budget: --samples or --sim-seconds".into()),
            (Some(0), _) => return bad("--samples must be positive".into()),
            (_, Some(s)) if !(finite(s) && s > 0.0 && s <= 1e7) => {
                return bad(format!("--sim-seconds {s} must be in (0, 1e7]"))
            }
            _ => {}
        }
        if self.eval_every == 0 {
            return bad("--eval-every must be positive".into());
        }
        if !(finite(self.step_time) && self.step_time > 0.0 && self.step_time <= 3600.0) {
            return bad(format!(
                "--step-ms {} must be in (0, 3600000]",
                self.step_time * 1e3
            ));
        }
        if !(finite(self.jitter) && (0.0..=3.0).contains(&self.jitter)) {
            return bad(format!("--jitter {} must be in [0, 3]", self.jitter));
        }
        if !(finite(self.delay) && (0.0..=3600.0).contains(&self.delay)) {
            return bad(format!(
                "--delay-ms {} must be in [0, 3600000]",
                self.delay * 1e3
            ));
        }
        if !(finite(self.delay_jitter) && (0.0..=1.0).contains(&self.delay_jitter)) {
            return bad(format!(
                "--delay-jitter {} must be in [0, 1]",
                self.delay_jitter
            ));
        }
        if let Some(b) = self.bandwidth {
            if !(finite(b) && b >= 1e3) {
                return bad(format!("--mbps {} must be at least 0.001", b / 1e6));
            }
        }
        if let Some(d) = self.dropout_every {
            if !(finite(d) && d > 0.0 && d <= 1e7) {
                return bad(format!("--dropout-every {d} must be in (0, 1e7]"));
            }
        }
        if !(finite(self.away) && self.away > 0.0 && self.away <= 1e7) {
            return bad(format!("--away {} must be in (0, 1e7]", self.away));
        }
        if !(finite(self.faulty) && (0.0..=1.0).contains(&self.faulty)) {
            return bad(format!("--faulty {} must be in [0, 1]", self.faulty));
        }
        for (flag, v) in [
            ("--heartbeat-timeout", self.heartbeat),
            ("--sync-timeout", self.sync_timeout),
        ] {
            if !(finite(v) && (0.01..=3600.0).contains(&v)) {
                return bad(format!("{flag} {v} must be between 0.01 and 3600 seconds"));
            }
        }
        Ok(())
    }

    /// A one-line description for titles and logs.
    pub fn describe(&self) -> String {
        self.describe_except("")
    }

    /// [`SimConfig::describe`] without the part a sweep varies (`param` as in `--sweep`).
    pub fn describe_except(&self, param: &str) -> String {
        let mut parts = Vec::new();
        if param != "workers" {
            parts.push(format!("{} workers", self.workers));
        }
        if !matches!(param, "consistency" | "mode" | "ssp") {
            parts.push(self.consistency.to_string());
        }
        if param != "staleness" {
            parts.push(format!("staleness {}", self.staleness));
        }
        if param != "lr" {
            parts.push(format!("lr {}", self.optimizer.lr));
        }
        if param != "batch-size" {
            parts.push(format!("batch {}", self.batch_size));
        }
        if self.faulty > 0.0 || param == "fault" {
            let share = if param == "faulty" {
                String::new()
            } else {
                format!("{:.1}% ", self.faulty * 100.0)
            };
            let kind = match (param, self.fault) {
                ("fault", _) => String::new(),
                (_, Fault::Nan) => " (nan)".into(),
                (_, Fault::Noise) => " (noise)".into(),
                (_, Fault::Scale(f)) => format!(" (scale:{f})"),
            };
            parts.push(format!("{share}faulty{kind}"));
        }
        if let Some(every) = self.dropout_every {
            let kind = match self.dropout_kind {
                DropoutKind::Disconnect => "disconnect",
                DropoutKind::Pause => "pause",
            };
            let mut d = String::from("dropouts");
            if param != "dropout-every" {
                let _ = write!(d, " every ~{every} s");
            }
            let _ = write!(d, " for ~{} s", self.away);
            if param != "dropout-kind" {
                let _ = write!(d, " ({kind})");
            }
            parts.push(d);
        }
        parts.join(", ")
    }
}

/// One evaluation point: a line of `run.csv`.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// Training examples computed so far (summed over workers).
    pub samples: u64,
    /// Simulated seconds since the start.
    pub sim_time_s: f64,
    /// Mean cross-entropy on the evaluated test examples.
    pub test_loss: f64,
    /// Accuracy on them.
    pub test_accuracy: f64,
    /// How many test examples were evaluated (the last row: the full test set).
    pub eval_examples: usize,
    /// Mean staleness of the pushes accepted since the previous row.
    pub mean_staleness: f64,
    /// Largest staleness accepted since the previous row.
    pub max_staleness: u64,
    /// Updates applied, summed over shards (the sum of the ShardCore versions).
    pub updates: u64,
    /// Push frames accepted so far (applied or buffered), summed over shards.
    pub accepted: u64,
    /// Push frames rejected so far (too stale, late, not finite...), summed over shards.
    pub rejected: u64,
    /// Workers online (connected and not paused) at this moment.
    pub workers_online: usize,
}

/// The columns of `run.csv`.
pub const CSV_HEADER: &str = "samples,sim_time_s,test_loss,test_accuracy,eval_examples,mean_staleness,max_staleness,updates,accepted,rejected,workers_online";

impl Row {
    fn csv_line(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "{},{:.6},{:.6},{:.6},{},{:.4},{},{},{},{},{}",
            self.samples,
            self.sim_time_s,
            self.test_loss,
            self.test_accuracy,
            self.eval_examples,
            self.mean_staleness,
            self.max_staleness,
            self.updates,
            self.accepted,
            self.rejected,
            self.workers_online
        );
    }
}

/// One read (a `Params` reply), as the simulated shard saw it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReadRecord {
    /// Simulated time, seconds.
    pub time_s: f64,
    /// Simulated worker (participant index).
    pub worker: usize,
    /// Worker id of its session (a rejoin gets a new id, as on the server).
    pub worker_id: u64,
    /// Shard.
    pub shard: usize,
    /// Version read.
    pub version: u64,
    /// SSP: the reader's clock.
    pub clock: Option<u64>,
    /// SSP: the slowest active clock.
    pub min_clock: Option<u64>,
}

/// What one simulated worker did.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerSummary {
    /// Index.
    pub index: usize,
    /// Its mean step time, seconds.
    pub mean_step_s: f64,
    /// Whether it is faulty.
    pub faulty: bool,
    /// Data partition.
    pub partition: usize,
    /// Sessions (joins).
    pub sessions: u32,
    /// Gradients computed.
    pub steps: u64,
    /// Pushes acknowledged.
    pub pushes_accepted: u64,
    /// Pushes rejected.
    pub pushes_rejected: u64,
    /// Pushes lost with a connection.
    pub pushes_lost: u64,
}

/// Totals of a run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Totals {
    /// Training examples computed.
    pub samples: u64,
    /// Gradient steps computed.
    pub steps: u64,
    /// Push frames that reached a shard.
    pub pushes: u64,
    /// Accepted (applied or buffered).
    pub accepted: u64,
    /// Rejected.
    pub rejected: u64,
    /// Rejections by error code name (`too_stale`, `not_finite`, ...).
    pub rejected_by_reason: BTreeMap<String, u64>,
    /// Push frames corrupted by faulty workers (sent).
    pub faulty_pushes: u64,
    /// Each shard's final version.
    pub shard_versions: Vec<u64>,
    /// Sync mode: gradients each shard still had buffered at the end.
    pub shard_pending: Vec<usize>,
    /// Sum of staleness over applied pushes.
    pub staleness_sum: u64,
    /// Largest staleness applied.
    pub staleness_max: u64,
    /// Simulated seconds.
    pub sim_seconds: f64,
    /// Events processed.
    pub events: u64,
    /// The run stopped because no step completed for a long simulated time (e.g. the model
    /// diverged to non-finite parameters that every worker refuses).
    pub stalled: bool,
}

impl Totals {
    /// Updates applied, summed over shards.
    pub fn updates(&self) -> u64 {
        self.shard_versions.iter().sum()
    }

    /// Mean staleness over accepted pushes.
    pub fn mean_staleness(&self) -> f64 {
        self.staleness_sum as f64 / self.accepted.max(1) as f64
    }
}

/// The outcome of [`run`].
#[derive(Debug, Clone)]
pub struct SimResult {
    /// The configuration that ran.
    pub config: SimConfig,
    /// Evaluation rows; the last one is on the full test set.
    pub rows: Vec<Row>,
    /// Totals.
    pub totals: Totals,
    /// Per worker.
    pub workers: Vec<WorkerSummary>,
    /// Every read, when [`SimConfig::log_reads`] was set.
    pub reads: Vec<ReadRecord>,
    /// The final parameters (the shards' values, concatenated).
    pub final_params: Vec<f32>,
    /// Wall-clock seconds the run took (not part of the CSV: it is not deterministic).
    pub wall_seconds: f64,
}

impl SimResult {
    /// `run.csv`: [`CSV_HEADER`] and one line per row. Deterministic for a config and seed.
    pub fn csv(&self) -> String {
        let mut out = String::with_capacity(64 * (self.rows.len() + 1));
        out.push_str(CSV_HEADER);
        out.push('\n');
        for r in &self.rows {
            r.csv_line(&mut out);
        }
        out
    }

    /// The last row (on the full test set).
    pub fn last(&self) -> Option<&Row> {
        self.rows.last()
    }

    /// Final accuracy on the full test set.
    pub fn final_accuracy(&self) -> f64 {
        self.last().map_or(0.0, |r| r.test_accuracy)
    }

    /// The first row at or above `accuracy`: (samples, simulated seconds).
    pub fn reached(&self, accuracy: f64) -> Option<(u64, f64)> {
        self.rows
            .iter()
            .find(|r| r.test_accuracy >= accuracy)
            .map(|r| (r.samples, r.sim_time_s))
    }

    /// One line about the workers and rejections: step-time spread, faulty workers, sessions,
    /// rejections by reason.
    pub fn digest(&self) -> String {
        let mut steps: Vec<f64> = self.workers.iter().map(|w| w.mean_step_s).collect();
        steps.sort_by(f64::total_cmp);
        let ms = |i: usize| steps.get(i).map_or(0.0, |s| s * 1e3);
        let mut s = format!(
            "worker step times: fastest {:.0} ms, median {:.0} ms, slowest {:.0} ms",
            ms(0),
            ms(steps.len() / 2),
            ms(steps.len().saturating_sub(1))
        );
        let faulty = self.workers.iter().filter(|w| w.faulty).count();
        if faulty > 0 {
            let _ = write!(s, "; {faulty} faulty");
        }
        let sessions: u32 = self.workers.iter().map(|w| w.sessions).sum();
        let _ = write!(s, "; {sessions} sessions");
        if !self.totals.rejected_by_reason.is_empty() {
            let reasons: Vec<String> = self
                .totals
                .rejected_by_reason
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect();
            let _ = write!(s, "; rejected: {}", reasons.join(", "));
        }
        s
    }

    /// Simulated seconds per wall-clock second.
    pub fn speedup(&self) -> f64 {
        self.totals.sim_seconds / self.wall_seconds.max(1e-9)
    }
}

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

/// Names of the parameters `--sweep` accepts.
pub const SWEEP_PARAMS: [&str; 13] = [
    "consistency",
    "mode",
    "workers",
    "ssp",
    "staleness",
    "lr",
    "faulty",
    "fault",
    "dropout-every",
    "dropout-kind",
    "delay-ms",
    "step-ms",
    "batch-size",
];

/// Expands `--sweep PARAM=V1,V2,...` over `base`: one `(label, config)` per value, in order.
///
/// # Errors
/// [`Error::Config`] for a malformed spec, an unknown parameter, or a value that makes an
/// invalid config.
pub fn sweep_configs(base: &SimArgs, spec: &str) -> Result<Vec<(String, SimConfig)>> {
    let (param, values) = spec
        .split_once('=')
        .ok_or_else(|| Error::Config(format!("--sweep {spec:?}: expected PARAM=V1,V2,...")))?;
    let param = param.trim();
    if !SWEEP_PARAMS.contains(&param) {
        return Err(Error::Config(format!(
            "--sweep: unknown parameter {param:?}; use one of {}",
            SWEEP_PARAMS.join(", ")
        )));
    }
    let sep = if values.contains(';') { ';' } else { ',' };
    let values: Vec<&str> = values
        .split(sep)
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .collect();
    if values.is_empty() || values.len() > 64 {
        return Err(Error::Config(format!(
            "--sweep {spec:?}: give between 1 and 64 values"
        )));
    }
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for v in values {
        if !seen.insert(v) {
            return Err(Error::Config(format!("--sweep: value {v:?} is repeated")));
        }
        let mut a = base.clone();
        let num = |what: &str| Error::Config(format!("--sweep {param}: bad {what} {v:?}"));
        match param {
            "consistency" | "mode" => a.training.consistency = v.into(),
            "workers" => a.workers = v.parse().map_err(|_| num("worker count"))?,
            "ssp" => a.training.consistency = format!("ssp:{v}"),
            "staleness" => a.training.staleness = v.into(),
            "lr" => a.training.lr = Some(v.parse().map_err(|_| num("learning rate"))?),
            "faulty" => a.faulty = v.parse().map_err(|_| num("fraction"))?,
            "fault" => a.fault = v.into(),
            "dropout-kind" => a.dropout_kind = v.into(),
            "dropout-every" => {
                a.dropout_every = Some(v.parse().map_err(|_| num("number of seconds"))?)
            }
            "delay-ms" => a.delay_ms = v.parse().map_err(|_| num("delay"))?,
            "step-ms" => a.step_ms = v.parse().map_err(|_| num("step time"))?,
            _ => a.training.batch_size = v.parse().map_err(|_| num("batch size"))?,
        }
        let cfg = a
            .check()
            .map_err(|e| Error::Config(format!("--sweep {param}={v}: {e}")))?;
        out.push((format!("{param}={v}"), cfg));
    }
    Ok(out)
}

/// A file-name-safe form of a label (`mode=ssp:2` -> `mode=ssp_2`).
pub fn slug(label: &str) -> String {
    label
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '=' | '-' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// One line of the summary table.
#[derive(Debug, Clone, PartialEq)]
pub struct SummaryLine {
    /// What varied (`mode=async`), or `run` for a single run.
    pub label: String,
    /// Final accuracy on the full test set.
    pub final_accuracy: f64,
    /// Final test loss.
    pub final_loss: f64,
    /// First evaluation at >= 95%: samples and simulated seconds.
    pub to_95: Option<(u64, f64)>,
    /// Totals.
    pub totals: Totals,
    /// Wall seconds.
    pub wall_seconds: f64,
}

impl SummaryLine {
    /// The summary of one run.
    pub fn of(label: impl Into<String>, r: &SimResult) -> Self {
        Self {
            label: label.into(),
            final_accuracy: r.final_accuracy(),
            final_loss: r.last().map_or(f64::NAN, |l| l.test_loss),
            to_95: r.reached(0.95),
            totals: r.totals.clone(),
            wall_seconds: r.wall_seconds,
        }
    }
}

/// `summary.csv`: deterministic (no wall-clock figures).
pub fn summary_csv(lines: &[SummaryLine]) -> String {
    let mut s = String::from(
        "label,final_accuracy,final_loss,samples_to_95,sim_s_to_95,samples,sim_seconds,updates,accepted,rejected,mean_staleness,max_staleness\n",
    );
    for l in lines {
        let (a, b) = l.to_95.map_or((String::new(), String::new()), |(n, t)| {
            (n.to_string(), format!("{t:.3}"))
        });
        let t = &l.totals;
        let _ = writeln!(
            s,
            "{},{:.6},{:.6},{a},{b},{},{:.3},{},{},{},{:.4},{}",
            csv_field(&l.label),
            l.final_accuracy,
            l.final_loss,
            t.samples,
            t.sim_seconds,
            t.updates(),
            t.accepted,
            t.rejected,
            t.mean_staleness(),
            t.staleness_max
        );
    }
    s
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// `summary.md`: the table a teacher pastes into notes (includes wall time and speed-up).
pub fn summary_markdown(lines: &[SummaryLine]) -> String {
    let mut s = String::from(
        "| run | final accuracy | samples to 95% | sim time to 95% | samples | sim time | updates | rejected | mean staleness | wall time | faster than real time |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for l in lines {
        let t = &l.totals;
        let (n, secs) = l
            .to_95
            .map_or(("not reached".into(), "–".into()), |(n, t)| {
                (n.to_string(), format!("{t:.1} s"))
            });
        let _ = writeln!(
            s,
            "| `{}` | {:.2}% | {n} | {secs} | {} | {:.1} s | {} | {} | {:.2} | {:.1} s | {:.0}× |",
            l.label,
            l.final_accuracy * 100.0,
            t.samples,
            t.sim_seconds,
            t.updates(),
            t.rejected,
            t.mean_staleness(),
            l.wall_seconds,
            t.sim_seconds / l.wall_seconds.max(1e-9)
        );
    }
    s
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

/// Writes `run.csv` and `run.svg` for one result into `dir`.
///
/// # Errors
/// When the directory or a file cannot be written.
pub fn write_run(dir: &Path, title: &str, r: &SimResult) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    write(&dir.join("run.csv"), &r.csv())?;
    let svg = plot::accuracy_svg(title, &[plot::Series::of("accuracy", &r.rows)]);
    write(&dir.join("run.svg"), &svg)
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
    let data = crate::data::ensure(&args.data_dir, "mnist", !args.no_fetch)?;
    std::fs::create_dir_all(&args.out)
        .map_err(|e| Error::io(format!("creating {}", args.out.display()), e))?;
    let mut lines = Vec::new();
    let mut series = Vec::new();
    let n = runs.len();
    for (i, (label, cfg)) in runs.iter().enumerate() {
        eprintln!("[{}/{n}] {label}: {}", i + 1, cfg.describe());
        let quiet = args.quiet;
        let r = run_with(cfg, &data, &mut |row: &Row| {
            if !quiet {
                eprintln!(
                    "  samples {:>8}  sim {:>8.1} s  accuracy {:6.2}%  loss {:.4}  staleness {:5.2}  updates {}  rejected {}  online {}",
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
        let cases: [(&str, Edit); 19] = [
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
            ("local steps", |a| a.training.local_steps = "0".into()),
            ("inner lr", |a| a.training.inner_lr = Some(f32::NAN)),
            ("pull encoding", |a| a.training.pull_encoding = "int8_block".into()),
            ("push encoding", |a| a.training.push_encoding = "fp8".into()),
            ("eval", |a| a.eval_every = 0),
            ("samples", |a| a.samples = Some(0)),
            ("seconds", |a| a.sim_seconds = Some(f64::INFINITY)),
            ("momentum", |a| a.training.momentum = Some(0.5)),
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
        for bad in [
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
