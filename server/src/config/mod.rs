//! `crowdgrad serve` configuration: command-line flags ([`ServeArgs`]) checked into a
//! [`ServeConfig`] (unchecked -> checked, like linfa's param guards).
//!
//! The flags that describe training (model, optimizer, batch, seed, shards, consistency,
//! staleness, timeouts) are one struct, [`TrainingArgs`] checked into [`Training`], flattened
//! into both `serve` and `sim` (`crate::sim::SimArgs`): the same concept has the same flag,
//! default and check in both.

pub mod checkpoint;
pub mod defence;
pub mod runfile;

use crate::error::{Error, Result};
use clap::Args;
use crowdgrad_core::codec::Encoding;
use crowdgrad_core::data::NormalizeChoice;
use crowdgrad_core::local::{LocalConfig, LocalSteps};
use crowdgrad_core::model::ModelSpec;
use crowdgrad_core::optim::{OptimizerConfig, Rule};
use crowdgrad_core::robust::Aggregation;
use crowdgrad_core::schedule::{Decay, Schedule, DEFAULT_MIN_RATIO};
use crowdgrad_core::session::ShardSetup;
use crowdgrad_core::shard::{Consistency, EgressBudget, Pacing, StalenessPolicy};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Training flags shared by `crowdgrad serve`, `crowdgrad shard` and `crowdgrad sim` (flattened into each).
#[derive(Debug, Clone, Args)]
pub struct TrainingArgs {
    /// Model: `softmax`, `mlp:W1[,W2...]` (ReLU hidden layers), `cnn`
    /// (conv:16x5x5,pool:2,conv:32x5x5,pool:2,dense:128) or a layer list such as
    /// `conv:32x5x5,pool:2,dense:128` (docs/training.md, "Models", has the grammar).
    #[arg(long, default_value = "mlp:128")]
    pub model: String,
    /// Per-channel normalisation every worker applies to its batches and the evaluator to the
    /// test set: `none` (pixel / 255), `MEAN/STD` on the /255 scale with comma lists per
    /// channel (e.g. `0.1307/0.3081`), or `auto` (the training set's own statistics, computed
    /// at start and stated in the run spec).
    #[arg(long, default_value = "none")]
    pub normalize: String,
    /// The shards' optimizer: sgd, momentum, nesterov, adagrad, rmsprop, adam, adamw (decoupled
    /// weight decay; betas 0.9/0.95, eps 1e-8) [default: adagrad;
    /// with local steps, the outer optimizer: in sync:K DiLoCo's nesterov at lr 0.7, momentum
    /// 0.9; in async and ssp sgd at lr 1.0 (each pseudo-gradient is applied at 1/workers)].
    #[arg(long)]
    pub optimizer: Option<String>,
    /// Learning rate, the peak of a schedule [default: sgd 0.1, momentum/nesterov 0.01, adagrad
    /// 0.05, rmsprop/adam/adamw 0.001].
    #[arg(long)]
    pub lr: Option<f32>,
    /// Momentum coefficient for momentum/nesterov.
    #[arg(long)]
    pub momentum: Option<f32>,
    /// Weight decay of the shards' optimizer: an L2 term in the gradient, decoupled for adamw
    /// [default: adamw 0.1, others 0].
    #[arg(long)]
    pub weight_decay: Option<f32>,
    /// Workers clip their full gradient to this global L2 norm before pushing, and under local
    /// steps every inner step's gradient before the inner optimizer sees it.
    #[arg(long)]
    pub clip_norm: Option<f32>,
    /// Learning-rate warmup: the rate rises linearly from 0 to --lr over this many training
    /// samples, counted by the shards' version, or under `auto` local steps by the samples the
    /// shards applied (docs/training.md, "Learning-rate schedules").
    /// It applies to the optimizer that sees gradients: the shards' with gradient pushes, the
    /// workers' inner optimizer under local steps.
    #[arg(long, default_value_t = 0, value_name = "SAMPLES")]
    pub lr_warmup: u64,
    /// After the warmup: `none` (the peak for good), `linear` or `cosine` down to
    /// --lr-min-ratio x --lr at --lr-decay-samples.
    #[arg(long, default_value = "none", value_parser = ["none", "linear", "cosine"])]
    pub lr_decay: String,
    /// The training sample, counted from the start (warmup included), at which the decay
    /// reaches its floor; needed with --lr-decay linear or cosine.
    #[arg(long, value_name = "SAMPLES")]
    pub lr_decay_samples: Option<u64>,
    /// The decay's floor as a fraction of --lr, 0 to 1 [default: 0.1].
    #[arg(long, value_name = "F")]
    pub lr_min_ratio: Option<f32>,
    /// Keep an exponential moving average of the weights on every shard, moved by
    /// `avg = d avg + (1 - d) weights` after each update (d = DECAY, bias-corrected as Adam's
    /// moments: the initial weights count for nothing), and evaluate, sample text from and
    /// export it; workers still train the live weights. Between 0 and 1, e.g. 0.999 (about
    /// the last 1,000 updates) (docs/training.md, "A moving average of the weights").
    #[arg(long, value_name = "DECAY")]
    pub ema: Option<f32>,
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
    /// How shards combine pushes (docs/defences.md): `mean`; in sync:K over the K pushes of a round
    /// `median`, `trimmed_mean:B` (drop the floor(B x K) largest and smallest of each
    /// coordinate), `krum:F` (needs K >= 2F + 3) or `multikrum:F,M`; in async and ssp
    /// `consensus[:E]` (Zeno++-style: refuse, answered `disagrees`, a push whose cosine c with
    /// the recent pushes' direction and norm ratio r to their median score c r - 0.01 r^2 below
    /// -E, default 0.5), or `zeno[:E]` (Zeno++: the same against the gradient of a
    /// 128-example validation batch the server computes, c r - 0.1 r^2; in-process shards
    /// only). Per shard, on the shard's slice.
    #[arg(long, default_value = "mean")]
    pub aggregation: String,
    /// Seconds without a frame after which a worker drops out of the SSP clock.
    #[arg(long, default_value_t = 5.0)]
    pub heartbeat_timeout: f64,
    /// sync:K: seconds a waiting pull waits before the partial aggregate is applied.
    #[arg(long, default_value_t = 2.0)]
    pub sync_timeout: f64,
    /// Inner steps per push: `1` (push every gradient), a whole number H (push the
    /// pseudo-gradient θ_pulled − θ_local after H steps of the inner optimizer), `auto` or
    /// `auto:MAX` (each worker picks H so communication stays near 15% of its time; MAX
    /// defaults to 4096; a learning-rate schedule then follows the samples the shards
    /// applied) [default: serve and shard `auto`; sim `1`].
    // The default differs per command: `check` takes it (CommandDefaults).
    #[arg(long)]
    pub local_steps: Option<String>,
    /// The workers' inner optimizer under local steps (same names as --optimizer; its state
    /// stays on the worker across rounds, as DiLoCo's inner AdamW does).
    #[arg(long, default_value = "adam")]
    pub inner_optimizer: String,
    /// The inner optimizer's learning rate, the peak of a schedule [default: adam 0.003, other
    /// rules their --lr default].
    #[arg(long)]
    pub inner_lr: Option<f32>,
    /// The inner optimizer's weight decay (decoupled for adamw) [default: adamw 0.1, others 0].
    #[arg(long)]
    pub inner_weight_decay: Option<f32>,
    /// Workers keep their next pull in flight while computing (double-buffered parameters;
    /// each read misses the worker's own last push). Only with --local-steps 1; ignored in
    /// sync:K. Off by default: in the simulator it gives 4 async workers 1.5x the samples/s
    /// for 0.3 points at equal samples, but 16 workers lose 2.5 points (staleness doubles).
    #[arg(long, default_value = "off", value_parser = ["on", "off"])]
    pub overlap: String,
    /// The most compact encoding shards send parameters in, to workers that can decode it:
    /// f32, bf16.
    #[arg(long, default_value = "bf16")]
    pub pull_encoding: String,
    /// The most compact encoding shards ask pushes in: f32, bf16, int8_block (blocks of 256
    /// with one f32 scale each; workers carry the rounding error into their next push).
    #[arg(long, default_value = "int8_block")]
    pub push_encoding: String,
    /// Shards refuse (`out_of_bounds`, not fatal) a push holding a value larger than this in
    /// magnitude, so no optimizer state can overflow.
    #[arg(long, default_value_t = 1e4)]
    pub max_push_value: f32,
    /// Shards refuse a push whose norm per step is more than this many times the norm
    /// reference: the median of trusted workers' usual norms (a worker earns trust with 16
    /// accepted pushes over 10 s), clamped within 4x of the server's own gradient norm when
    /// it holds the training data; 0 = off.
    #[arg(long, default_value_t = 10.0)]
    pub norm_bound: f32,
    /// A trusted worker's push over --norm-bound is scaled down to the bound and applied
    /// (counted as `pushes_clipped`), not refused, when its last N accepted pushes kept the
    /// bound: honest mini-batch gradients are heavy-tailed. 0 refuses every push over the
    /// bound.
    #[arg(long, default_value_t = crowdgrad_core::session::CLIP_SPACING, value_name = "N")]
    pub norm_clip_spacing: u32,
    /// The server paces the crowd (docs/operations.md, "Egress budget"): the bytes per second
    /// of parameters all shards together may send workers, e.g. `400mbit`, `50MB` (bytes),
    /// a plain number (bytes), or `off`. Each shard takes a share by its range length and
    /// tells workers that ask a pace, its sessions' Params bytes over its share: they pull no
    /// more often, and under --local-steps auto lengthen their rounds to it. Default (serve,
    /// shard): 400mbit, 40% of a 1 Gbit/s link, leaving room for pushes coming in, the
    /// dashboard, joins and checkpoints; `sim`: off. With --local-steps 1 a budget holds pulls
    /// (on loopback 400mbit cut 2 workers from 48k to 6k samples/s): set `off` for lessons
    /// that compare H = 1.
    // The default differs per command: each sets it with `mut_arg`; `check` falls back to
    // the serve default (crowdgrad_core::shard::pace::DEFAULT_EGRESS_BUDGET).
    #[arg(long, value_name = "RATE")]
    pub egress_budget: Option<String>,
}

/// How workers exchange with shards: local steps, overlap and the negotiated encodings' upper
/// bounds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Exchange {
    /// Local steps, inner optimizer, overlap (goes into the run spec).
    pub local: LocalConfig,
    /// The most compact pull encoding shards offer.
    pub pull_encoding: Encoding,
    /// The most compact push encoding shards ask for.
    pub push_encoding: Encoding,
    /// `--max-push-value`.
    pub max_push_value: f32,
    /// `--norm-bound`.
    pub norm_bound: f32,
    /// `--norm-clip-spacing`.
    pub norm_clip_spacing: u32,
    /// `--egress-budget`: what the shards pace workers to.
    pub egress_budget: EgressBudget,
}

impl Default for Exchange {
    /// Protocol version 1: gradient pushes, no overlap, f32 both ways.
    fn default() -> Self {
        Self {
            local: LocalConfig::default(),
            pull_encoding: Encoding::F32,
            push_encoding: Encoding::F32,
            max_push_value: 1e4,
            norm_bound: 10.0,
            norm_clip_spacing: crowdgrad_core::session::CLIP_SPACING,
            egress_budget: EgressBudget::OFF,
        }
    }
}

impl Exchange {
    /// The push bounds for a run with `batch` examples per step.
    pub fn guard(&self, batch: usize) -> crowdgrad_core::session::PushGuard {
        let batch = u32::try_from(batch).unwrap_or(u32::MAX);
        crowdgrad_core::session::PushGuard {
            max_abs: self.max_push_value,
            norm_factor: self.norm_bound,
            max_samples: batch.saturating_mul(self.local.steps.max()),
            batch,
            clip_spacing: self.norm_clip_spacing,
        }
    }
}

fn encoding_flag(flag: &str, v: &str, allowed: &[Encoding]) -> Result<Encoding> {
    allowed
        .iter()
        .copied()
        .find(|e| e.name() == v.trim())
        .ok_or_else(|| {
            let names: Vec<&str> = allowed.iter().map(|e| e.name()).collect();
            Error::Config(format!("{flag} {v:?}: use one of {}", names.join(", ")))
        })
}

/// Checked [`TrainingArgs`].
#[derive(Debug, Clone, PartialEq)]
pub struct Training {
    /// Model text (resolved against the dataset when it is loaded).
    pub model: String,
    /// `--normalize` (resolved against the dataset when it is loaded).
    pub normalize: NormalizeChoice,
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
    /// How shards combine pushes.
    pub aggregation: Aggregation,
    /// SSP heartbeat timeout, seconds.
    pub heartbeat_timeout: f64,
    /// sync:K straggler timeout, seconds.
    pub sync_timeout: f64,
    /// Local steps and encodings.
    pub exchange: Exchange,
    /// `--ema`: the decay of the weights' moving average the shards keep.
    pub ema: Option<f32>,
}

impl TrainingArgs {
    /// Validates the flags with the command's defaults.
    ///
    /// # Errors
    /// [`Error::Config`] / [`crowdgrad_core::Error::Config`] naming the first bad flag.
    pub fn check(&self, defaults: CommandDefaults) -> Result<Training> {
        let default_shards = defaults.shards;
        let local_steps = match &self.local_steps {
            Some(given) => given.as_str(),
            None => defaults.local_steps,
        };
        let steps = LocalSteps::parse(local_steps)
            .map_err(|e| Error::Config(format!("--local-steps: {e}")))?;
        let pseudo = steps.pseudo_gradients();
        let (name, lr) = match (&self.optimizer, pseudo) {
            (Some(n), _) => (n.as_str(), self.lr),
            (None, false) => ("adagrad", self.lr),
            // Pseudo-gradients already carry the inner learning rate: DiLoCo's outer Nesterov
            // step on sync aggregates; async ones are applied as they are (at 1/workers).
            (None, true) if self.consistency.trim().starts_with("sync:") => {
                ("nesterov", Some(self.lr.unwrap_or(0.7)))
            }
            (None, true) => ("sgd", Some(self.lr.unwrap_or(1.0))),
        };
        let momentum = match (&self.optimizer, pseudo, self.momentum) {
            (None, true, None) if name == "nesterov" => Some(0.9),
            (_, _, m) => m,
        };
        let mut optimizer =
            optimizer_from_flags(name, lr, momentum, self.weight_decay, self.clip_norm)?;
        let inner_lr = self.inner_lr.or_else(|| {
            (self.inner_optimizer.trim() == "adam")
                .then_some(crowdgrad_core::local::DEFAULT_INNER_LR)
        });
        let inner = optimizer_from_flags(
            &self.inner_optimizer,
            inner_lr,
            None,
            self.inner_weight_decay,
            None,
        )
        .map_err(|e| {
            Error::Config(format!(
                "--inner-optimizer/--inner-lr/--inner-weight-decay: {e}"
            ))
        })?;
        let mut exchange = Exchange {
            local: LocalConfig {
                steps,
                inner,
                overlap: self.overlap == "on",
            },
            pull_encoding: encoding_flag(
                "--pull-encoding",
                &self.pull_encoding,
                &[Encoding::F32, Encoding::Bf16],
            )?,
            push_encoding: encoding_flag(
                "--push-encoding",
                &self.push_encoding,
                &[Encoding::F32, Encoding::Bf16, Encoding::INT8],
            )?,
            max_push_value: self.max_push_value,
            norm_bound: self.norm_bound,
            norm_clip_spacing: self.norm_clip_spacing,
            egress_budget: EgressBudget::parse(
                self.egress_budget
                    .as_deref()
                    .unwrap_or(crowdgrad_core::shard::pace::DEFAULT_EGRESS_BUDGET),
            )
            .map_err(|e| Error::Config(format!("--egress-budget: {e}")))?,
        };
        if !(self.max_push_value.is_finite() && self.max_push_value > 0.0) {
            return Err(Error::Config(format!(
                "--max-push-value {} must be finite and positive",
                self.max_push_value
            )));
        }
        if !(self.norm_bound.is_finite() && (self.norm_bound == 0.0 || self.norm_bound >= 1.0)) {
            return Err(Error::Config(format!(
                "--norm-bound {} must be 0 (off) or at least 1",
                self.norm_bound
            )));
        }
        // Check the text before any data is loaded; the shapes are checked against the
        // dataset's when it is (RunSpec::build), still before anything is served.
        ModelSpec::check_text(&self.model).map_err(|e| Error::Config(format!("--model: {e}")))?;
        let normalize = NormalizeChoice::parse(&self.normalize)
            .map_err(|e| Error::Config(format!("--normalize: {e}")))?;
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
        let consistency = Consistency::parse(&self.consistency)?;
        let aggregation = Aggregation::parse(&self.aggregation)?;
        aggregation.validate(consistency)?;
        let schedule = self.schedule(self.batch_size, consistency, steps)?;
        // The optimizer that sees gradients follows it (crowdgrad_core::schedule).
        if pseudo {
            exchange.local.inner.schedule = schedule;
        } else {
            optimizer.schedule = schedule;
        }
        Ok(Training {
            model: self.model.clone(),
            normalize,
            optimizer,
            batch_size: self.batch_size,
            seed: self.seed,
            shards,
            consistency,
            staleness: StalenessPolicy::parse(&self.staleness)?,
            aggregation,
            heartbeat_timeout: self.heartbeat_timeout,
            sync_timeout: self.sync_timeout,
            exchange,
            ema: self.ema.map(check_ema).transpose()?,
        })
    }
}

/// `--ema DECAY`: finite and strictly between 0 and 1.
///
/// # Errors
/// [`Error::Config`] naming the flag otherwise.
pub fn check_ema(decay: f32) -> Result<f32> {
    if decay.is_finite() && decay > 0.0 && decay < 1.0 {
        Ok(decay)
    } else {
        Err(Error::Config(format!(
            "--ema: the decay must be between 0 and 1, not included (e.g. 0.999), got {decay}"
        )))
    }
}

impl TrainingArgs {
    /// The learning-rate schedule of `--lr-warmup`, `--lr-decay`, `--lr-decay-samples` and
    /// `--lr-min-ratio`, with the samples one shard version stands for in a run of `batch`
    /// examples per step under `consistency` and `steps` (`crowdgrad_core::schedule`).
    ///
    /// # Errors
    /// [`Error::Config`] naming the flag: a decay without its end, an end or floor without a
    /// decay, a floor outside 0..=1, a decay that does not end after the warmup, lengths over
    /// the limit. Under `auto` local steps the schedule is [`Schedule::counted`].
    fn schedule(
        &self,
        batch: usize,
        consistency: Consistency,
        steps: LocalSteps,
    ) -> Result<Schedule> {
        let bad = |m: String| Err(Error::Config(m));
        let decay =
            Decay::parse(&self.lr_decay).map_err(|e| Error::Config(format!("--lr-decay: {e}")))?;
        let decay_samples = match (decay, self.lr_decay_samples) {
            (Decay::None, None) => 0,
            (Decay::None, Some(_)) => {
                return bad("--lr-decay-samples needs --lr-decay linear or cosine".into())
            }
            (d, None) => {
                return bad(format!(
                    "--lr-decay {} needs --lr-decay-samples: the training sample (warmup \
                     included) at which the rate reaches its floor",
                    d.name()
                ))
            }
            (_, Some(n)) => n,
        };
        if decay == Decay::None && self.lr_min_ratio.is_some() {
            return bad("--lr-min-ratio needs --lr-decay linear or cosine".into());
        }
        let mut schedule = Schedule {
            warmup: self.lr_warmup,
            decay,
            decay_samples,
            min_ratio: self.lr_min_ratio.unwrap_or(DEFAULT_MIN_RATIO),
            samples_per_version: 1,
            counted: false,
        };
        if schedule.is_constant() {
            return Ok(Schedule::default());
        }
        let k = match consistency {
            Consistency::Sync { k } => k as u64,
            _ => 1,
        };
        match steps {
            LocalSteps::Fixed(h) => {
                schedule.samples_per_version = (batch as u64)
                    .saturating_mul(k)
                    .saturating_mul(u64::from(h));
            }
            // Each push carries a varying number of samples: the shards count them and state
            // them in every Params (crowdgrad_core::schedule).
            LocalSteps::Auto { .. } => schedule.counted = true,
        }
        schedule.validate().map_err(|e| {
            Error::Config(format!(
                "--lr-warmup {} / --lr-decay-samples {} / --lr-min-ratio {}: {e}",
                schedule.warmup, schedule.decay_samples, schedule.min_ratio
            ))
        })?;
        Ok(schedule)
    }
}

impl Training {
    /// The one description of this run's shards, for every driver: `serve`'s in-process
    /// shards, `crowdgrad shard` and the simulator. `reports`: whether the shards ask workers
    /// for `Report` frames (the real servers do; the simulator counts for itself);
    /// `model_len`: values in the whole parameter vector, which the egress budget is shared
    /// over.
    pub fn shard_setup(&self, reports: bool, model_len: usize) -> ShardSetup {
        ShardSetup {
            optimizer: self.optimizer,
            staleness: self.staleness,
            consistency: self.consistency,
            heartbeat: self.heartbeat_timeout,
            sync_timeout: self.sync_timeout,
            pull_encoding: self.exchange.pull_encoding,
            push_encoding: self.exchange.push_encoding,
            reports,
            pseudo_gradients: self.exchange.local.steps.pseudo_gradients(),
            guard: self.exchange.guard(self.batch_size),
            aggregation: self.aggregation,
            pacing: Pacing {
                budget: self.exchange.egress_budget,
                model_len,
            },
            counted: self.exchange.local.inner.schedule.counted,
            average: self.ema,
        }
    }
}

/// The contribution ledger's file name in a local `--checkpoint-dir`.
pub const LEDGER_FILE: &str = "ledger.sqlite";

/// `--shards` of `crowdgrad serve` when not given.
pub const SERVE_SHARDS: usize = 2;

/// What differs between the commands that take [`TrainingArgs`].
#[derive(Debug, Clone, Copy)]
pub struct CommandDefaults {
    /// `--shards`.
    pub shards: usize,
    /// `--local-steps`.
    pub local_steps: &'static str,
}

/// `serve`'s defaults.
pub const SERVE_DEFAULTS: CommandDefaults = CommandDefaults {
    shards: SERVE_SHARDS,
    local_steps: SERVE_LOCAL_STEPS,
};

/// `serve`'s and `shard`'s `--local-steps` (issue 18): `auto`, each worker picks H from its own
/// link and the server's pace. Measured faster to 97% than H = 1 on loopback and on a
/// 20 Mbit/s link (docs/experiments.md, "Local steps by default"); `crowdgrad sim` keeps `1`
/// for lessons and comparisons.
pub const SERVE_LOCAL_STEPS: &str = "auto";

/// Default `serve --admission-floor`: new identities admitted at once whatever the number of
/// established workers (the rule is the registry's `admission`).
pub const ADMISSION_FLOOR: usize = 1024;

/// Flags of `crowdgrad serve`.
#[derive(Debug, Clone, Args)]
#[command(mut_arg("shards", |a| a.default_value("2")))] // SERVE_SHARDS
#[command(mut_arg("egress_budget", |a| a.default_value(crowdgrad_core::shard::pace::DEFAULT_EGRESS_BUDGET)))]
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
    /// The finest cut of the training set: a joining worker trains on one of
    /// min(this, active workers + 1) equal parts, the one the others cover least, so any
    /// number of workers covers the whole set (the first trains on all of it).
    #[arg(long, default_value_t = 6)]
    pub partitions: usize,
    /// Dataset name shown to workers. `mnist` and `sentences` (text: npm nlp-corpus, as
    /// train.txt and valid.txt) are fetched when their directory lacks them.
    #[arg(long, default_value = "mnist")]
    pub dataset: String,
    /// The data: a directory holding the four IDX files (raw or .gz) or the four .npy files,
    /// or text (a directory holding train.txt and valid.txt, or one text file; see
    /// --text-level) [default: data/DATASET].
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Do not fetch MNIST (or the sentences) when the data directory lacks it.
    #[arg(long)]
    pub no_fetch: bool,
    /// How text data becomes tokens.
    #[command(flatten)]
    pub text: crate::support::text::TextArgs,
    /// Static files served at `/`.
    #[arg(long, default_value = "web")]
    pub web_dir: PathBuf,
    /// Most workers registered at once (joins beyond it are refused).
    #[arg(long, default_value_t = 10_000)]
    pub max_workers: usize,
    /// New identities (on probation: joined in the last 10 s, or no push applied yet) admitted
    /// whatever the number of established workers; beyond it a join waits (429, Retry-After
    /// 5) until there are fewer on probation than established workers. Raise it only when a
    /// rush of fresh volunteers is expected: it is how many sybils can join at once.
    #[arg(long, default_value_t = ADMISSION_FLOOR)]
    pub admission_floor: usize,
    /// Most simultaneous TCP connections, HTTP and WebSocket alike (counted when accepted).
    #[arg(long, default_value_t = 4_096)]
    pub max_connections: usize,
    /// Per-IP, rate and timeout limits.
    #[command(flatten)]
    pub limits: crate::support::limits::LimitArgs,
    /// TLS certificate and key.
    #[command(flatten)]
    pub tls: crate::support::tls::TlsArgs,
    /// Private run: `POST /api/join` needs `Authorization: Bearer TOKEN` (else 401). Also read
    /// from the environment variable CROWDGRAD_JOIN_TOKEN (which `ps` does not show).
    #[arg(long, env = "CROWDGRAD_JOIN_TOKEN", hide_env_values = true)]
    pub join_token: Option<String>,
    /// Checkpoints: write them to this directory, or to `s3://BUCKET/PREFIX` (endpoint and
    /// credentials from the AWS_* environment variables), and resume from the newest valid one
    /// at start. No checkpoints without it.
    #[arg(long)]
    pub checkpoint_dir: Option<String>,
    /// Seconds between checkpoints (one is also written on shutdown).
    #[arg(long, default_value_t = 60.0)]
    pub checkpoint_every: f64,
    /// Checkpoints kept; older ones are deleted.
    #[arg(long, default_value_t = 3)]
    pub checkpoint_keep: usize,
    /// Resume a checkpoint written with another --shards by re-cutting it onto this one.
    #[arg(long)]
    pub reshard: bool,
    /// The contribution ledger's SQLite file (made if missing; a corrupt file or one that is
    /// not crowdgrad's ledger is refused, untouched). Default: ledger.sqlite in a local
    /// --checkpoint-dir; without either (or with an s3:// one) a temporary file deleted at
    /// exit, so credit does not survive a restart. Works with --shard-urls too.
    #[arg(long, value_name = "PATH")]
    pub ledger: Option<PathBuf>,
    /// Token for /api/admin/... (`Authorization: Bearer TOKEN`). Also read from the environment
    /// variable CROWDGRAD_ADMIN_TOKEN. When neither is set, one is generated and printed once.
    #[arg(long, env = "CROWDGRAD_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// A TOML run file (docs/run.example.toml); flags given on the command line override it.
    #[arg(long, value_name = "RUN.toml")]
    pub config: Option<PathBuf>,
    /// Coordinate shard processes (`crowdgrad shard`) at these base URLs, one per shard in
    /// order (`ws://h1:9000,ws://h2:9000`), instead of serving the shards in this process.
    #[arg(long, value_delimiter = ',')]
    pub shard_urls: Vec<String>,
    /// The secret shared with the shard processes (at least 16 characters): joins get the
    /// credential HMAC-SHA256(secret, worker id), which the shards check. Also read from
    /// CROWDGRAD_RUN_SECRET. Needed with --shard-urls.
    #[arg(long, env = "CROWDGRAD_RUN_SECRET", hide_env_values = true)]
    pub run_secret: Option<String>,
    /// Spot checks and quarantine (crate::defence::spotcheck).
    #[command(flatten)]
    pub spot: defence::SpotArgs,
}

/// Checked server configuration.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Listen address (used by `main`; `run` takes a bound listener).
    pub addr: SocketAddr,
    /// The training flags `serve` shares with `shard` and `sim` (model, optimizer, shards,
    /// consistency, encodings...): checked once, in [`TrainingArgs::check`].
    pub training: Training,
    /// Evaluation period.
    pub eval_every: Duration,
    /// Number of data partitions.
    pub partitions: usize,
    /// Dataset name.
    pub dataset: String,
    /// Data directory.
    pub data_dir: PathBuf,
    /// Fetch MNIST (or the sentences) if missing.
    pub fetch: bool,
    /// How text data becomes tokens (used when the data is text).
    pub text: crate::support::text::TextConfig,
    /// Static web root.
    pub web_dir: PathBuf,
    /// Registry capacity.
    pub max_workers: usize,
    /// New identities always admitted (`--admission-floor`, [`crate::registry::admission`]).
    pub admission_floor: usize,
    /// Connection limit (every TCP connection).
    pub max_connections: usize,
    /// Per-IP, rate and timeout limits.
    pub limits: crate::support::limits::LimitConfig,
    /// Serve https/wss with this certificate and key.
    pub tls: Option<crate::support::tls::TlsFiles>,
    /// Private run: the join token (`Debug` prints it redacted).
    pub join_token: Option<crate::support::credential::Secret>,
    /// Checkpoint policy; `None`: no checkpoints.
    pub checkpoint: Option<checkpoint::CheckpointConfig>,
    /// `--ledger`: the contribution ledger's file ([`ServeConfig::ledger_path`] gives the
    /// default).
    pub ledger: Option<PathBuf>,
    /// The admin API's token (`Debug` prints it redacted); `None`: generated at start.
    pub admin_token: Option<crate::support::credential::Secret>,
    /// Remote shard processes' base URLs (empty: shards in this process).
    pub shard_urls: Vec<String>,
    /// The run secret shared with shard processes (`Debug` prints it redacted).
    pub run_secret: Option<crate::support::credential::Secret>,
    /// Spot checks and quarantine.
    pub spot: defence::SpotConfig,
    /// The resolved configuration (flags over run file) as `/api/status` shows it; set by
    /// `main` ([`crate::config::runfile`]), `Null` otherwise.
    pub resolved: serde_json::Value,
}

/// The optimizer named by `--optimizer` with `--lr` (or the rule's default: sgd 0.1,
/// momentum/nesterov 0.01, adagrad 0.05, rmsprop/adam/adamw 0.001), `--momentum`,
/// `--weight-decay` (or the rule's default, [`Rule::default_weight_decay`]) and `--clip-norm`,
/// validated, with a constant learning rate ([`TrainingArgs::check`] adds the schedule).
/// Shared by `serve` and `sim`.
///
/// # Errors
/// [`Error::Config`] / [`crowdgrad_core::Error::Config`] naming the bad flag.
pub fn optimizer_from_flags(
    name: &str,
    lr: Option<f32>,
    momentum: Option<f32>,
    weight_decay: Option<f32>,
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
        Rule::RmsProp { .. } | Rule::Adam { .. } | Rule::AdamW { .. } => 0.001,
    });
    let optimizer = OptimizerConfig {
        rule,
        lr,
        weight_decay: weight_decay.unwrap_or(rule.default_weight_decay()),
        clip_norm,
        schedule: Schedule::default(),
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
        let t = self.training.check(SERVE_DEFAULTS)?;
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
        if self.max_workers == 0 || self.max_connections == 0 || self.admission_floor == 0 {
            return bad(
                "--max-workers, --max-connections and --admission-floor must be positive".into(),
            );
        }
        let limits = self.limits.check()?;
        let tls = self.tls.check()?;
        let join_token = match self.join_token {
            Some(t)
                if t.is_empty() || t.len() > 1024 || !t.bytes().all(|b| b.is_ascii_graphic()) =>
            {
                return bad(
                    "--join-token must be 1 to 1024 printable ASCII characters without spaces"
                        .into(),
                )
            }
            t => t.map(crate::support::credential::Secret::new),
        };
        if self.dataset.is_empty() || self.dataset.len() > 64 {
            return bad("--dataset must be a short name".into());
        }
        let checkpoint = match self.checkpoint_dir {
            None => None,
            Some(location) => {
                if location.is_empty() {
                    return bad("--checkpoint-dir must not be empty".into());
                }
                if !(self.checkpoint_every.is_finite()
                    && (0.1..=86_400.0).contains(&self.checkpoint_every))
                {
                    return bad(format!(
                        "--checkpoint-every {} must be between 0.1 and 86400 seconds",
                        self.checkpoint_every
                    ));
                }
                if !(1..=1000).contains(&self.checkpoint_keep) {
                    return bad(format!(
                        "--checkpoint-keep {} must be in 1..=1000",
                        self.checkpoint_keep
                    ));
                }
                Some(checkpoint::CheckpointConfig {
                    location,
                    every: Duration::from_secs_f64(self.checkpoint_every),
                    keep: self.checkpoint_keep,
                    reshard: self.reshard,
                })
            }
        };
        let admin_token = match self.admin_token {
            Some(t)
                if t.len() < 16 || t.len() > 1024 || !t.bytes().all(|b| b.is_ascii_graphic()) =>
            {
                return bad(
                    "--admin-token must be 16 to 1024 printable ASCII characters without spaces"
                        .into(),
                )
            }
            t => t.map(crate::support::credential::Secret::new),
        };
        if !self.shard_urls.is_empty() && self.shard_urls.len() != t.shards {
            return bad(format!(
                "--shard-urls lists {} shards but --shards is {}",
                self.shard_urls.len(),
                t.shards
            ));
        }
        let run_secret = match self.run_secret {
            Some(s) if s.len() < crate::support::credential::MIN_SECRET => {
                return bad("--run-secret must be at least 16 characters".into())
            }
            s => s.map(crate::support::credential::Secret::new),
        };
        if !self.shard_urls.is_empty() && checkpoint.is_some() {
            // The coordinator holds no parameters then, and its checkpoints (run spec and
            // ledger) are not written for that case yet: refused rather than half-working.
            return bad(
                "--checkpoint-dir with --shard-urls: each shard process checkpoints itself                  (crowdgrad shard --checkpoint-dir); the coordinator does not checkpoint (give                  it --ledger PATH to keep the contribution ledger)"
                    .into(),
            );
        }
        if !self.shard_urls.is_empty()
            && matches!(
                t.aggregation,
                crowdgrad_core::robust::Aggregation::Zeno { .. }
            )
        {
            return bad(
                "--aggregation zeno needs the shards in this process (not --shard-urls): the validation gradient is computed where the data is; use consensus"
                    .into(),
            );
        }
        if !self.shard_urls.is_empty() && run_secret.is_none() {
            return bad(
                "--shard-urls needs --run-secret (or CROWDGRAD_RUN_SECRET), the same as the shard processes'"
                    .into(),
            );
        }
        Ok(ServeConfig {
            addr: self.addr,
            eval_every: Duration::from_secs_f64(self.eval_every),
            partitions: self.partitions,
            data_dir: self
                .data_dir
                .unwrap_or_else(|| crate::support::text::default_dir(&self.dataset)),
            dataset: self.dataset,
            fetch: !self.no_fetch,
            text: self.text.check()?,
            web_dir: self.web_dir,
            max_workers: self.max_workers,
            admission_floor: self.admission_floor,
            max_connections: self.max_connections,
            limits,
            tls,
            join_token,
            checkpoint,
            ledger: self.ledger,
            admin_token,
            spot: {
                let spot = self.spot.check(self.shard_urls.is_empty())?;
                if spot.fraction > 0.0 && !self.shard_urls.is_empty() {
                    return bad(
                        "--spot-check needs the shards in this process (not --shard-urls)".into(),
                    );
                }
                spot
            },
            shard_urls: self.shard_urls,
            run_secret,
            resolved: serde_json::Value::Null,
            training: t,
        })
    }
}

impl ServeConfig {
    /// Where the contribution ledger lives: `--ledger`, else `ledger.sqlite` in a local
    /// `--checkpoint-dir`; `None`: a temporary file (no flag, or checkpoints on S3).
    pub fn ledger_path(&self) -> Option<PathBuf> {
        self.ledger.clone().or_else(|| {
            self.checkpoint
                .as_ref()
                .filter(|c| !c.location.starts_with("s3://"))
                .map(|c| PathBuf::from(&c.location).join(LEDGER_FILE))
        })
    }

    /// The defaults of `crowdgrad serve` with the given data directory (for tests and benches).
    pub fn defaults(data_dir: impl Into<PathBuf>) -> Self {
        Self::with_flags(data_dir, &[]).expect("defaults are valid")
    }

    /// `crowdgrad serve FLAGS` with the given data directory (for tests and benches): flags
    /// that settle other defaults (`--local-steps` picks the outer optimizer's) must be given
    /// here, not set on the checked config afterwards.
    ///
    /// # Errors
    /// What `crowdgrad serve` says of bad flags.
    pub fn with_flags(data_dir: impl Into<PathBuf>, flags: &[&str]) -> Result<Self> {
        use clap::Parser;
        #[derive(Parser)]
        struct P {
            #[command(flatten)]
            a: ServeArgs,
        }
        let args = std::iter::once("serve").chain(flags.iter().copied());
        let mut c = P::try_parse_from(args)
            .map_err(|e| Error::Config(e.to_string()))?
            .a
            .check()?;
        c.data_dir = data_dir.into();
        Ok(c)
    }
}

#[cfg(test)]
mod tests;
