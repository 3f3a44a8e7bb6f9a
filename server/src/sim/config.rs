//! The simulator's flags ([`SimArgs`], with the training flags of `serve` flattened in) and
//! their checked form ([`SimConfig`]).

use crate::config::TrainingArgs;
use crate::error::{Error, Result};
use clap::Args;
use crowdgrad_core::model::ModelSpec;
use crowdgrad_core::optim::OptimizerConfig;
use crowdgrad_core::shard::{Consistency, StalenessPolicy};
use std::fmt::Write as _;
use std::path::PathBuf;

/// Flags of `crowdgrad sim`. The training flags ([`TrainingArgs`]: model, optimizer, batch,
/// seed, shards, consistency, staleness, timeouts) are `crowdgrad serve`'s, flattened; `--mode`
/// is kept as an alias of `--consistency`.
#[derive(Debug, Clone, Args)]
#[command(
    mut_arg("consistency", |a| a.visible_alias("mode")),
    mut_arg("shards", |a| a.default_value("1")), // SIM_SHARDS
    mut_arg("egress_budget", |a| a.default_value("off")),
)]
pub struct SimArgs {
    /// The data: a directory holding the four IDX files (raw or .gz) or the four .npy files,
    /// or text (a directory holding train.txt and valid.txt, or one text file; see
    /// --text-level).
    #[arg(long, default_value = "data/mnist")]
    pub data_dir: PathBuf,
    /// Do not fetch MNIST when the data directory is empty.
    #[arg(long)]
    pub no_fetch: bool,
    /// How text data becomes tokens.
    #[command(flatten)]
    pub text: crate::support::text::TextArgs,
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
    /// What faulty workers do: `nan` / `inf` (one NaN / infinity per push), `noise` (Gaussian
    /// noise with the gradient's norm), `scale:F` (the gradient times F), `signflip:S` (times
    /// -S), `replay` (every push repeats the worker's first one), `wrong_shard` (pushes
    /// addressed to the next shard), `shuffled_labels` (honest gradients of the worker's data
    /// with its labels permuted), `collude:S` (all faulty workers send the same vector:
    /// -S x the gradient of the first of them to push from that version), `zeros` (all-zero
    /// pushes) or `huge:S` (Gaussian noise of S x the gradient's norm).
    #[arg(long, default_value = "nan")]
    pub fault: String,
    /// Sybils (issue 21): this many extra, fresh identities join at --sybil-at and push as
    /// --sybil-fault says. They go through the shards' guard like anyone (a new identity is
    /// on probation: no say in the norm reference until 16 nonzero pushes accepted over 10 s),
    /// their examples do not count in --samples, and the report splits pushes into honest and
    /// sybil ones.
    #[arg(long, default_value_t = 0)]
    pub sybils: usize,
    /// Simulated second at which the sybils join.
    #[arg(long, default_value_t = 0.0)]
    pub sybil_at: f64,
    /// What the sybils push: any --fault kind, e.g. `zeros`, `huge:S` (noise of S x the honest
    /// gradient's norm) or `signflip:S` (poison: their own honest gradient times -S).
    #[arg(long, default_value = "zeros")]
    pub sybil_fault: String,
    /// Run one simulation per value: PARAM=V1,V2,... with PARAM one of consistency (or mode),
    /// workers, ssp, staleness, lr, faulty, fault, dropout-every, dropout-kind, delay-ms,
    /// step-ms, batch-size, aggregation, local-steps, inner-lr, pull-encoding, push-encoding,
    /// overlap, sybils, sybil-at, sybil-fault.
    /// Separate values with `;` when they contain commas (staleness=accept;drop:8,scale).
    #[arg(long)]
    pub sweep: Option<String>,
    /// The shards announce spot checks, as `serve`'s do by default (`--spot-check auto`):
    /// workers then tag every push and start each round's inner optimizer afresh, so that a
    /// round can be recomputed (docs/protocol.md, "Spot checks"). The simulator does not
    /// recompute pushes; it models what announcing checks costs honest workers.
    #[arg(long)]
    pub announce_spot_checks: bool,
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

/// What a faulty worker does (`--fault`): core's [`crowdgrad_core::fault::Fault`], the one
/// list the simulator and `crowdgrad work --fault` share.
pub use crowdgrad_core::fault::Fault;

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
    /// `--normalize`.
    pub normalize: crowdgrad_core::data::NormalizeChoice,
    /// The shards' optimizer.
    pub optimizer: OptimizerConfig,
    /// Examples per gradient.
    pub batch_size: usize,
    /// Consistency mode.
    pub consistency: Consistency,
    /// Staleness policy for async/SSP pushes.
    pub staleness: StalenessPolicy,
    /// How shards combine pushes (`--aggregation`).
    pub aggregation: crowdgrad_core::robust::Aggregation,
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
    /// Sybils: fresh identities joining at [`SimConfig::sybil_at`].
    pub sybils: usize,
    /// When the sybils join, simulated seconds.
    pub sybil_at: f64,
    /// What the sybils push.
    pub sybil_fault: Fault,
    /// SSP heartbeat timeout, seconds.
    pub heartbeat: f64,
    /// sync:K straggler timeout, seconds.
    pub sync_timeout: f64,
    /// Local steps, overlap and encodings.
    pub exchange: crate::config::Exchange,
    /// `--ema`: evaluate the shards' moving average of the weights with this decay.
    pub ema: Option<f32>,
    /// `--announce-spot-checks`: the shards' Welcomes say they spot-check (nothing is
    /// recomputed).
    pub announce_spot_checks: bool,
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
        let t = self.training.check(crate::config::CommandDefaults {
            shards: SIM_SHARDS,
            local_steps: "1",
        })?;
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
            normalize: t.normalize,
            optimizer: t.optimizer,
            batch_size: t.batch_size,
            consistency: t.consistency,
            staleness: t.staleness,
            aggregation: t.aggregation,
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
            fault: parse_fault(&self.fault, "--fault")?,
            sybils: self.sybils,
            sybil_at: self.sybil_at,
            sybil_fault: parse_fault(&self.sybil_fault, "--sybil-fault")?,
            heartbeat: t.heartbeat_timeout,
            sync_timeout: t.sync_timeout,
            exchange: t.exchange,
            ema: t.ema,
            announce_spot_checks: self.announce_spot_checks,
            log_reads: false,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// Parses a fault kind for `flag` (core's list, [`Fault::parse`]).
fn parse_fault(text: &str, flag: &str) -> Result<Fault> {
    Fault::parse(text).map_err(|e| match e {
        crowdgrad_core::Error::Config(m) if flag == "--fault" => Error::Config(m),
        crowdgrad_core::Error::Config(m) => Error::Config(m.replacen("--fault", flag, 1)),
        e => Error::Core(e),
    })
}

impl SimConfig {
    /// The training half of this config, as `serve` and `shard` hold it
    /// ([`crate::config::Training`]): the simulated shards are set up from it by the same
    /// [`crate::config::Training::shard_setup`] as the real ones.
    pub fn training(&self) -> crate::config::Training {
        crate::config::Training {
            model: self.model.clone(),
            normalize: self.normalize.clone(),
            optimizer: self.optimizer,
            batch_size: self.batch_size,
            seed: self.seed,
            shards: self.shards,
            consistency: self.consistency,
            staleness: self.staleness,
            aggregation: self.aggregation,
            heartbeat_timeout: self.heartbeat,
            sync_timeout: self.sync_timeout,
            exchange: self.exchange,
            ema: self.ema,
        }
    }

    /// Checks every value is in range (the fields are public, so [`run`] checks again).
    ///
    /// # Errors
    /// [`Error::Config`] naming the first bad value.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        self.optimizer.validate()?;
        self.aggregation.validate(self.consistency)?;
        if let Some(d) = self.ema {
            crate::config::check_ema(d)?;
        }
        ModelSpec::check_text(&self.model)?;
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
        if self.sybils > 1024 {
            return bad(format!("--sybils {} must be in 0..=1024", self.sybils));
        }
        if !(finite(self.sybil_at) && (0.0..=1e7).contains(&self.sybil_at)) {
            return bad(format!("--sybil-at {} must be in [0, 1e7]", self.sybil_at));
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
        if param != "aggregation" && self.aggregation != Default::default() {
            parts.push(format!("aggregation {}", self.aggregation));
        }
        if param != "lr" {
            parts.push(format!("lr {}", self.optimizer.lr));
        }
        if param != "batch-size" {
            parts.push(format!("batch {}", self.batch_size));
        }
        let x = &self.exchange;
        if param != "local-steps" && x.local.steps.pseudo_gradients() {
            parts.push(format!("local steps {}", x.local.steps));
        }
        if param != "inner-lr" && x.local.steps.pseudo_gradients() {
            parts.push(format!("inner lr {}", x.local.inner.lr));
        }
        if param != "pull-encoding" {
            parts.push(format!("pulls {}", x.pull_encoding.name()));
        }
        if param != "push-encoding" {
            parts.push(format!("pushes {}", x.push_encoding.name()));
        }
        if param != "overlap" && x.local.overlap {
            parts.push("overlap".into());
        }
        if self.announce_spot_checks {
            parts.push("spot checks announced".into());
        }
        if self.faulty > 0.0 || param == "fault" {
            let share = if param == "faulty" {
                String::new()
            } else {
                format!("{:.1}% ", self.faulty * 100.0)
            };
            let kind = match (param, self.fault) {
                ("fault", _) => String::new(),
                (_, f) => format!(" ({f})"),
            };
            parts.push(format!("{share}faulty{kind}"));
        }
        if self.sybils > 0 || param.starts_with("sybil") {
            let n = if param == "sybils" {
                String::new()
            } else {
                format!("{} ", self.sybils)
            };
            let fault = if param == "sybil-fault" {
                String::new()
            } else {
                format!(" ({})", self.sybil_fault)
            };
            let at = if param == "sybil-at" {
                String::new()
            } else {
                format!(" from {} s", self.sybil_at)
            };
            parts.push(format!("{n}sybils{fault}{at}"));
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
