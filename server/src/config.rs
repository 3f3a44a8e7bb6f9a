//! `crowdgrad serve` configuration: command-line flags ([`ServeArgs`]) checked into a
//! [`ServeConfig`] (unchecked -> checked, like linfa's param guards).
//!
//! The flags that describe training (model, optimizer, batch, seed, shards, consistency,
//! staleness, timeouts) are one struct, [`TrainingArgs`] checked into [`Training`], flattened
//! into both `serve` and `sim` (`crate::sim::SimArgs`): the same concept has the same flag,
//! default and check in both.

use crate::error::{Error, Result};
use clap::Args;
use crowdgrad_core::model::ModelSpec;
use crowdgrad_core::optim::{OptimizerConfig, Rule};
use crowdgrad_core::shard::{Consistency, StalenessPolicy};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Training flags shared by `crowdgrad serve` and `crowdgrad sim` (flattened into both).
#[derive(Debug, Clone, Args)]
pub struct TrainingArgs {
    /// Model: `softmax` or `mlp:W1[,W2...]` (ReLU hidden layers).
    #[arg(long, default_value = "mlp:128")]
    pub model: String,
    /// Optimizer: sgd, momentum, nesterov, adagrad, rmsprop, adam.
    #[arg(long, default_value = "adagrad")]
    pub optimizer: String,
    /// Learning rate [default: sgd 0.1, momentum/nesterov 0.01, adagrad 0.05, rmsprop/adam 0.001].
    #[arg(long)]
    pub lr: Option<f32>,
    /// Momentum coefficient for momentum/nesterov.
    #[arg(long)]
    pub momentum: Option<f32>,
    /// L2 weight decay.
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f32,
    /// Workers clip their full gradient to this L2 norm before pushing.
    #[arg(long)]
    pub clip_norm: Option<f32>,
    /// Examples per worker gradient.
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// Seed for initial weights and workers' batch order (and, in `sim`, every simulated
    /// random draw).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Number of parameter shards, each with its own apply path and SSP clock (in `serve`, its
    /// own WebSocket endpoint /ws/shard/N).
    // The default differs per command (serve 2, sim 1): each sets it with `mut_arg`, so its
    // help shows its own; `check` falls back to the command's default too.
    #[arg(long)]
    pub shards: Option<usize>,
    /// Consistency mode: `async` (apply on receipt), `ssp:S` (stale-synchronous, bound S) or
    /// `sync:K` (average K fresh gradients per update, drop late ones).
    #[arg(long, default_value = "async")]
    pub consistency: String,
    /// Staleness policy for async/SSP pushes: `accept`, or a comma list of `drop:N` (reject
    /// staler than N), `scale` (lr x min(1, mean staleness / staleness)), `scale:abs`
    /// (lr / staleness), `dc:LAMBDA` (DC-ASGD delay compensation).
    #[arg(long, default_value = "accept")]
    pub staleness: String,
    /// Seconds without a frame after which a worker drops out of the SSP clock.
    #[arg(long, default_value_t = 5.0)]
    pub heartbeat_timeout: f64,
    /// sync:K: seconds a waiting pull waits before the partial aggregate is applied.
    #[arg(long, default_value_t = 2.0)]
    pub sync_timeout: f64,
}

/// Checked [`TrainingArgs`].
#[derive(Debug, Clone, PartialEq)]
pub struct Training {
    /// Model text (resolved against the dataset when it is loaded).
    pub model: String,
    /// The shards' optimizer.
    pub optimizer: OptimizerConfig,
    /// Examples per gradient.
    pub batch_size: usize,
    /// Seed.
    pub seed: u64,
    /// Number of shards.
    pub shards: usize,
    /// Consistency mode.
    pub consistency: Consistency,
    /// Staleness policy for async/SSP pushes.
    pub staleness: StalenessPolicy,
    /// SSP heartbeat timeout, seconds.
    pub heartbeat_timeout: f64,
    /// sync:K straggler timeout, seconds.
    pub sync_timeout: f64,
}

impl TrainingArgs {
    /// Validates the flags; `default_shards` is the command's `--shards` default.
    ///
    /// # Errors
    /// [`Error::Config`] / [`crowdgrad_core::Error::Config`] naming the first bad flag.
    pub fn check(&self, default_shards: usize) -> Result<Training> {
        let optimizer = optimizer_from_flags(
            &self.optimizer,
            self.lr,
            self.momentum,
            self.weight_decay,
            self.clip_norm,
        )?;
        // Parse once against MNIST's shape to catch typos before any data is loaded.
        ModelSpec::parse(&self.model, 784, 10)?;
        let bad = |m: String| Err(Error::Config(m));
        let shards = self.shards.unwrap_or(default_shards);
        if !(1..=256).contains(&shards) {
            return bad(format!("--shards {shards} must be in 1..=256"));
        }
        if !(1..=4096).contains(&self.batch_size) {
            return bad(format!(
                "--batch-size {} must be in 1..=4096",
                self.batch_size
            ));
        }
        for (flag, v) in [
            ("--heartbeat-timeout", self.heartbeat_timeout),
            ("--sync-timeout", self.sync_timeout),
        ] {
            if !(v.is_finite() && (0.01..=3600.0).contains(&v)) {
                return bad(format!("{flag} {v} must be between 0.01 and 3600 seconds"));
            }
        }
        Ok(Training {
            model: self.model.clone(),
            optimizer,
            batch_size: self.batch_size,
            seed: self.seed,
            shards,
            consistency: Consistency::parse(&self.consistency)?,
            staleness: StalenessPolicy::parse(&self.staleness)?,
            heartbeat_timeout: self.heartbeat_timeout,
            sync_timeout: self.sync_timeout,
        })
    }
}

/// `--shards` of `crowdgrad serve` when not given.
pub const SERVE_SHARDS: usize = 2;

/// Flags of `crowdgrad serve`.
#[derive(Debug, Clone, Args)]
#[command(mut_arg("shards", |a| a.default_value("2")))] // SERVE_SHARDS
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub addr: SocketAddr,
    /// Model, optimizer, batch, seed, shards, consistency, staleness and timeouts.
    #[command(flatten)]
    pub training: TrainingArgs,
    /// Seconds between evaluations of the current parameters on the test set.
    #[arg(long, default_value_t = 1.0)]
    pub eval_every: f64,
    /// The training set is split into this many partitions; worker N trains on partition
    /// N mod partitions.
    #[arg(long, default_value_t = 6)]
    pub partitions: usize,
    /// Dataset name shown to workers.
    #[arg(long, default_value = "mnist")]
    pub dataset: String,
    /// Directory holding the four IDX files (raw or .gz).
    #[arg(long, default_value = "data/mnist")]
    pub data_dir: PathBuf,
    /// Do not fetch MNIST when the data directory is empty.
    #[arg(long)]
    pub no_fetch: bool,
    /// Static files served at `/`.
    #[arg(long, default_value = "web")]
    pub web_dir: PathBuf,
    /// Most workers registered at once (joins beyond it are refused).
    #[arg(long, default_value_t = 10_000)]
    pub max_workers: usize,
    /// Most simultaneous WebSocket connections.
    #[arg(long, default_value_t = 4_096)]
    pub max_connections: usize,
}

/// Checked server configuration.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Listen address (used by `main`; `run` takes a bound listener).
    pub addr: SocketAddr,
    /// Number of shards.
    pub shards: usize,
    /// Model architecture text (resolved against the dataset when loaded).
    pub model: String,
    /// Shards' optimizer.
    pub optimizer: OptimizerConfig,
    /// Examples per gradient.
    pub batch_size: usize,
    /// Seed.
    pub seed: u64,
    /// Evaluation period.
    pub eval_every: Duration,
    /// Number of data partitions.
    pub partitions: usize,
    /// Consistency mode.
    pub consistency: Consistency,
    /// Staleness policy for async/SSP pushes.
    pub staleness: StalenessPolicy,
    /// SSP heartbeat timeout.
    pub heartbeat_timeout: Duration,
    /// sync:K straggler timeout.
    pub sync_timeout: Duration,
    /// Dataset name.
    pub dataset: String,
    /// Data directory.
    pub data_dir: PathBuf,
    /// Fetch MNIST if missing.
    pub fetch: bool,
    /// Static web root.
    pub web_dir: PathBuf,
    /// Registry capacity.
    pub max_workers: usize,
    /// Connection limit.
    pub max_connections: usize,
}

/// The optimizer named by `--optimizer` with `--lr` (or the rule's default: sgd 0.1,
/// momentum/nesterov 0.01, adagrad 0.05, rmsprop/adam 0.001), `--momentum`, `--weight-decay` and
/// `--clip-norm`, validated. Shared by `serve` and `sim`.
///
/// # Errors
/// [`Error::Config`] / [`crowdgrad_core::Error::Config`] naming the bad flag.
pub fn optimizer_from_flags(
    name: &str,
    lr: Option<f32>,
    momentum: Option<f32>,
    weight_decay: f32,
    clip_norm: Option<f32>,
) -> Result<OptimizerConfig> {
    let mut rule = Rule::from_name(name)?;
    if let (Some(m), Rule::Momentum { momentum, .. }) = (momentum, &mut rule) {
        *momentum = m;
    } else if momentum.is_some() {
        return Err(Error::Config(
            "--momentum only applies to momentum and nesterov".into(),
        ));
    }
    let lr = lr.unwrap_or(match rule {
        Rule::Sgd => 0.1,
        Rule::Momentum { .. } => 0.01,
        Rule::Adagrad { .. } => 0.05,
        Rule::RmsProp { .. } | Rule::Adam { .. } => 0.001,
    });
    let optimizer = OptimizerConfig {
        rule,
        lr,
        weight_decay,
        clip_norm,
    };
    optimizer.validate()?;
    Ok(optimizer)
}

impl ServeArgs {
    /// Validates the flags.
    ///
    /// # Errors
    /// [`Error::Config`] naming the first bad flag.
    pub fn check(self) -> Result<ServeConfig> {
        let t = self.training.check(SERVE_SHARDS)?;
        let bad = |m: String| Err(Error::Config(m));
        if !(self.eval_every.is_finite() && self.eval_every >= 0.05 && self.eval_every <= 86_400.0)
        {
            return bad(format!(
                "--eval-every {} must be between 0.05 and 86400 seconds",
                self.eval_every
            ));
        }
        if self.partitions == 0 || self.partitions > 10_000 {
            return bad(format!(
                "--partitions {} must be in 1..=10000",
                self.partitions
            ));
        }
        if self.max_workers == 0 || self.max_connections == 0 {
            return bad("--max-workers and --max-connections must be positive".into());
        }
        if self.dataset.is_empty() || self.dataset.len() > 64 {
            return bad("--dataset must be a short name".into());
        }
        Ok(ServeConfig {
            addr: self.addr,
            shards: t.shards,
            model: t.model,
            optimizer: t.optimizer,
            batch_size: t.batch_size,
            seed: t.seed,
            eval_every: Duration::from_secs_f64(self.eval_every),
            partitions: self.partitions,
            consistency: t.consistency,
            staleness: t.staleness,
            heartbeat_timeout: Duration::from_secs_f64(t.heartbeat_timeout),
            sync_timeout: Duration::from_secs_f64(t.sync_timeout),
            dataset: self.dataset,
            data_dir: self.data_dir,
            fetch: !self.no_fetch,
            web_dir: self.web_dir,
            max_workers: self.max_workers,
            max_connections: self.max_connections,
        })
    }
}

impl ServeConfig {
    /// The defaults of `crowdgrad serve` with the given data directory (for tests and benches).
    pub fn defaults(data_dir: impl Into<PathBuf>) -> Self {
        use clap::Parser;
        #[derive(Parser)]
        struct P {
            #[command(flatten)]
            a: ServeArgs,
        }
        let mut c = P::parse_from(["serve"])
            .a
            .check()
            .expect("defaults are valid");
        c.data_dir = data_dir.into();
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct P {
        #[command(flatten)]
        a: ServeArgs,
    }

    fn parse(flags: &[&str]) -> std::result::Result<ServeArgs, clap::Error> {
        P::try_parse_from(std::iter::once("serve").chain(flags.iter().copied())).map(|p| p.a)
    }

    #[test]
    fn training_flags_check_into_the_config() {
        let d = ServeConfig::defaults("data/mnist");
        assert_eq!(d.shards, SERVE_SHARDS);
        assert_eq!(d.consistency, Consistency::Async);
        assert_eq!(d.optimizer.lr, 0.05);
        assert_eq!(d.heartbeat_timeout, Duration::from_secs(5));
        let c = parse(&[
            "--consistency",
            "sync:3",
            "--shards",
            "4",
            "--sync-timeout",
            "0.5",
        ])
        .unwrap()
        .check()
        .unwrap();
        assert_eq!(c.consistency, Consistency::Sync { k: 3 });
        assert_eq!(c.shards, 4);
        assert_eq!(c.sync_timeout, Duration::from_millis(500));
        // `--mode` is the simulator's old name, not a serve flag.
        assert!(parse(&["--mode", "async"]).is_err());
        for bad in [
            &["--shards", "0"][..],
            &["--batch-size", "0"],
            &["--heartbeat-timeout", "0"],
            &["--consistency", "bsp"],
            &["--staleness", "fast"],
            &["--optimizer", "sgd", "--momentum", "0.9"],
        ] {
            assert!(parse(bad).unwrap().check().is_err(), "{bad:?}");
        }
    }
}
