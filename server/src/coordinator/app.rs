//! The server's shared state ([`App`]), the evaluator and the status report.

use crate::config::ServeConfig;
use crate::registry::{Counters, Registry, WorkerRecord};
use crate::shard::report::ShardStatus;
use crate::shard::Shard;
use crowdgrad_core::data::Dataset;
use crowdgrad_core::eval::evaluate;
use crowdgrad_core::model::Model;
use crowdgrad_core::optim::OptimizerConfig;
use crowdgrad_core::spec::RunSpec;
use serde::Serialize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{watch, Semaphore};
use tokio_util::task::TaskTracker;

pub use super::evals::EvalPoint;

/// What the run trains, for the page's labels (`task` in the status).
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Task {
    /// Images (or any examples) into classes: accuracy and loss.
    Classification {
        /// Number of classes.
        classes: usize,
    },
    /// Next-token prediction on text: bits per token and perplexity.
    Language {
        /// Tokens of context per example.
        context: usize,
        /// Vocabulary size.
        vocab: usize,
        /// `chars` or `bytes`.
        level: String,
    },
}

/// A short text the current weights wrote (`GET /api/sample`, language models only).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Sample {
    /// The prompt it continues.
    pub prompt: String,
    /// What the model wrote after it.
    pub text: String,
    /// Sampling temperature.
    pub temperature: f32,
    /// Mean shard version of the weights.
    pub step: u64,
    /// Examples behind them.
    pub samples: u64,
    /// Seconds since the server started.
    pub time_s: f64,
}

/// Tokens a sample continues its prompt by.
pub const SAMPLE_TOKENS: usize = 160;
/// Temperature of the samples.
pub const SAMPLE_TEMPERATURE: f32 = 0.8;
/// Least seconds between two samples.
pub const SAMPLE_EVERY_S: f64 = 5.0;
/// The prompt samples start from.
pub const SAMPLE_PROMPT: &str = "The ";
/// A language model's evaluation takes at most this share of the evaluator's time: the next
/// one waits at least `duration / EVAL_SHARE` (its evaluation is not cheap).
pub const EVAL_SHARE: f64 = 0.25;

/// Most evaluation points kept (older ones are thinned out).
const EVAL_HISTORY: usize = 1024;

/// Shared state of a running server.
#[derive(Debug)]
pub struct App {
    /// Checked config.
    pub cfg: ServeConfig,
    /// The run spec handed to joining workers.
    pub spec: RunSpec,
    /// The shards.
    pub shards: Vec<Shard>,
    /// Workers and counters.
    pub registry: Registry,
    /// The model (for evaluation).
    pub model: Model,
    /// Training set (served in partitions).
    pub train: Arc<Dataset>,
    /// Test set (evaluation).
    pub test: Arc<Dataset>,
    /// Content tag of the training data in data URLs (changes when the data does).
    pub data_tag: String,
    /// The training set's parts, encoded once for the data route.
    pub parts: Arc<crate::coordinator::parts::Parts>,
    /// Evaluation history.
    pub evals: Mutex<Vec<EvalPoint>>,
    /// The newest sample of a language model.
    pub sample: Mutex<Option<Sample>>,
    /// Recent (time, samples) pairs for a rate.
    pub rate: Mutex<Vec<(Instant, u64)>>,
    /// Start time.
    pub started: Instant,
    /// The same moment as unix milliseconds, read once: the base of every `at_ms` derived
    /// from seconds since the start (so two requests give the same figure).
    pub started_unix_ms: u64,
    /// Flips to true on shutdown.
    pub shutdown: watch::Receiver<bool>,
    /// WebSocket tasks, awaited on shutdown.
    pub tracker: TaskTracker,
    /// Connection limit.
    pub connections: Arc<Semaphore>,
    /// Per-IP, rate and timeout limits and what they refused.
    pub limits: Arc<crate::support::limits::Limits>,
    /// The run secret that session credentials are HMACs under ([`crate::support::credential`]).
    pub secret: crate::support::credential::RunSecret,
    /// What only `/metrics` keeps (the last checkpoint); the rest is read at scrape time.
    pub metrics: Arc<crate::registry::metrics::Metrics>,
    /// The checkpoint writer (`--checkpoint-dir`), for the final checkpoint and checkpoint-now.
    pub checkpoints: Option<Arc<crate::checkpoint::Checkpointer>>,
    /// The admin API's token and controls (pause, drain...).
    pub admin: crate::coordinator::admin::Admin,
    /// With `--shard-urls`: the shard processes (then `shards` is empty).
    pub remote: Option<Arc<crate::coordinator::remote::RemoteShards>>,
    /// Per-worker reputation and quarantine, and the spot checker ([`crate::defence::spotcheck`]).
    pub defence: crate::defence::spotcheck::Defence,
    /// The dashboard stream's newest tick ([`crate::coordinator::dashboard`]).
    pub dashboard: crate::coordinator::dashboard::Dashboard,
    /// Every experiment's evaluation history (`/api/evals`, kept in checkpoints).
    pub experiments: Arc<Mutex<crate::coordinator::history::Experiments>>,
    /// The ring of the run's figures every 5 s (`/api/history`).
    pub figures: Mutex<crate::coordinator::history::Figures>,
    /// The teacher's demonstration settings per worker (`/api/admin/demo`), read by the
    /// shards' handlers.
    pub demo: Arc<crate::shard::demo::Demo>,
    /// The strip of test images with the model's guesses (`/api/guesses`), shared by every
    /// viewer.
    pub guesses: crate::coordinator::history::GuessCache,
    /// [`App::quarantines`] as of a reputation epoch (recomputed only when it moved).
    pub quarantine_cache: Mutex<Option<(u64, Vec<QuarantineRow>)>>,
}

/// Totals with a recent rate.
#[derive(Debug, Serialize)]
pub struct Totals {
    /// Counters over all shards (samples counted once per step).
    #[serde(flatten)]
    pub counters: Counters,
    /// Examples per second over the last few seconds.
    pub samples_per_sec: f64,
}

/// The body of `GET /api/status`.
#[derive(Debug, Serialize)]
pub struct Status {
    /// Run id.
    pub run_id: String,
    /// Model, e.g. `mlp 784-128-10`.
    pub model: String,
    /// Parameter count.
    pub params: usize,
    /// Consistency mode.
    pub consistency: String,
    /// Staleness policy for async/SSP pushes.
    pub staleness_policy: String,
    /// Histogram of read skew (spread of shard versions read for one step), buckets 0..15, 16+.
    pub read_skew_hist: Vec<u64>,
    /// Examples per gradient.
    pub batch_size: usize,
    /// Dataset name.
    pub dataset: String,
    /// Optimizer.
    pub optimizer: OptimizerConfig,
    /// Local steps and the workers' inner optimizer, with its schedule (the run spec's).
    pub local: crowdgrad_core::local::LocalConfig,
    /// The learning rate of the optimizer that follows the schedule, now: the shards' (its
    /// peak as `set-lr` left it) with gradient pushes, the workers' inner optimizer under
    /// local steps, at shard 0's version, or under `auto` at the most samples a shard applied
    /// (`crowdgrad_core::schedule`). The peak without one.
    pub lr_now: f32,
    /// `--ema`: the decay of the weights' moving average the shards keep, which the
    /// evaluations, the text samples and `/api/params` are of (`null`: the live weights).
    pub ema: Option<f32>,
    /// Seconds since start.
    pub uptime_s: f64,
    /// The run's egress budget for parameters sent to workers, bytes per second (`null`:
    /// off; `--egress-budget`, issue 18). Each shard's share and pace are in `shards`.
    pub egress_budget: Option<f64>,
    /// Per shard.
    pub shards: Vec<ShardStatus>,
    /// The newest workers (at most [`crate::registry::RECENT_WORKERS`]); `/api/workers` pages all.
    pub workers: Vec<WorkerRecord>,
    /// Workers with at least one open connection.
    pub workers_connected: usize,
    /// Totals.
    pub totals: Totals,
    /// What the run trains.
    pub task: Task,
    /// Latest evaluation.
    pub eval: Option<EvalPoint>,
    /// All kept evaluations, oldest first.
    pub eval_history: Vec<EvalPoint>,
    /// Whether joining needs the join token (the token itself is never shown).
    pub private_run: bool,
    /// What the connection, rate and timeout limits refused.
    pub limits: crate::support::limits::LimitCounts,
    /// The resolved configuration (run file and flags), as `crowdgrad serve` printed it.
    pub config: serde_json::Value,
    /// With `--shard-urls`: every shard process's health (`url`, `up`, `ready`, `error`,
    /// `last_ok_s`, `version`, `uptime_s`, `status`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_shards: Option<Vec<crate::coordinator::remote::Health>>,
    /// Per-worker spot checks, refusals and quarantines ([`crate::defence::reputation`]).
    pub reputation: crate::defence::reputation::ReputationStatus,
    /// The spot checker's counters and recent figures (absent: spot checks off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spot_checks: Option<crate::defence::spotcheck::SpotStatus>,
    /// The workers quarantined now, newest first (at most [`QUARANTINE_ROWS`]).
    pub quarantines: Vec<QuarantineRow>,
    /// The teacher's demonstrations on now (`/api/admin/demo`): `{"worker", "delay_ms",
    /// "fault"}`; empty when off.
    pub demo: Vec<crate::shard::demo::Setting>,
}

/// Most rows of [`Status::quarantines`].
pub const QUARANTINE_ROWS: usize = 100;

/// One quarantined worker, for the host's table.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct QuarantineRow {
    /// Its worker id.
    pub worker: u64,
    /// The first 8 characters of the identity it joined with (never the whole: whoever has
    /// it can credit work to it).
    pub identity_short: Option<String>,
    /// Why.
    pub reason: String,
    /// When, milliseconds since the Unix epoch.
    pub at_ms: u64,
}

/// The data of the dashboard's `tick` event (docs/protocol.md, "Dashboard stream"): the
/// status without the run's description, the evaluation history, the workers and the
/// per-worker reputation.
#[derive(Debug, Serialize)]
pub struct TickBody {
    /// Tick number, from 1, one per second.
    pub seq: u64,
    /// [`Status::lr_now`].
    pub lr_now: f32,
    /// Seconds since start.
    pub uptime_s: f64,
    /// Consistency mode now.
    pub consistency: String,
    /// Staleness policy.
    pub staleness_policy: String,
    /// Read-skew histogram.
    pub read_skew_hist: Vec<u64>,
    /// Per shard.
    pub shards: Vec<ShardStatus>,
    /// Workers with at least one open connection.
    pub workers_connected: usize,
    /// Totals.
    pub totals: Totals,
    /// Latest evaluation.
    pub eval: Option<EvalPoint>,
    /// Evaluations added since the previous tick, oldest first.
    pub evals: Vec<EvalPoint>,
    /// What the limits refused.
    pub limits: crate::support::limits::LimitCounts,
    /// With `--shard-urls`: the shard processes' health.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_shards: Option<Vec<crate::coordinator::remote::Health>>,
    /// Quarantine counts (the per-worker part comes with `/api/workers`).
    pub reputation: crate::defence::reputation::ReputationSummary,
    /// The spot checker's counters (absent: spot checks off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spot_checks: Option<crate::defence::spotcheck::SpotStatus>,
    /// The teacher's demonstrations on now (absent when none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub demo: Vec<crate::shard::demo::Setting>,
}

/// A remote shard's counters from the `status` record it reported (the per-reason maps stay
/// with the shard process's own `/metrics`).
/// A remote shard's egress budget (its share, bytes/s) and pace (seconds) from its status.
fn remote_pacing(status: Option<&serde_json::Value>) -> (Option<f64>, f64) {
    let get = |k: &str| status.and_then(|s| s[k].as_f64());
    (get("egress_budget"), get("pace_s").unwrap_or(0.0))
}

fn remote_counters(status: Option<&serde_json::Value>) -> Counters {
    let mut c = Counters::default();
    let Some(v) = status else { return c };
    let n = |k: &str| v.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0);
    c.pulls = n("pulls");
    c.pushes_applied = n("pushes_applied");
    c.pushes_buffered = n("pushes_buffered");
    c.pushes_rejected = n("pushes_rejected");
    c.pushes_dropped = n("pushes_dropped");
    c.pushes_clipped = n("pushes_clipped");
    c.frames_rejected = n("frames_rejected");
    c.samples = n("samples");
    c.staleness_max = n("staleness_max");
    c.staleness_mean = v
        .get("staleness_mean")
        .and_then(serde_json::Value::as_f64)
        .unwrap_or(0.0);
    c.staleness_hist = v
        .get("staleness_hist")
        .and_then(serde_json::Value::as_array)
        .map(|a| a.iter().map(|x| x.as_u64().unwrap_or(0)).collect())
        .unwrap_or_default();
    c.staleness_sum = (c.staleness_mean * c.pushes_applied as f64).round() as u64;
    c
}

impl App {
    /// The consistency mode now: the shards' (the admin API may have switched it), else the
    /// run's (shards in other processes).
    pub fn consistency(&self) -> crowdgrad_core::shard::Consistency {
        self.shards
            .first()
            .map_or(self.spec.consistency, |s| s.consistency())
    }

    /// The status report.
    /// What the run trains.
    pub fn task(&self) -> Task {
        match (self.model.sequence(), &self.spec.dataset.text) {
            (Some(seq), text) => Task::Language {
                context: seq.context,
                vocab: seq.vocab,
                level: text
                    .as_ref()
                    .map_or_else(|| "bytes".to_string(), |t| t.level.to_string()),
            },
            (None, _) => Task::Classification {
                classes: self.spec.dataset.classes,
            },
        }
    }

    /// The status now.
    pub fn status(&self) -> Status {
        let (workers, shard_counters, totals) = self.registry.view();
        let evals = self.evals.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let rate = self.samples_per_sec();
        let remote_shards = self.remote.as_ref().map(|r| r.health());
        let (shards, totals) = self.shard_view(shard_counters, totals, remote_shards.as_deref());
        let reputation = self
            .defence
            .reputation
            .status(crate::registry::RECENT_WORKERS);
        let quarantines = self.quarantine_rows(&reputation);
        Status {
            run_id: self.spec.run_id.clone(),
            model: self.model.spec().to_string(),
            params: self.model.param_len(),
            consistency: self.consistency().to_string(),
            staleness_policy: self.cfg.training.staleness.to_string(),
            read_skew_hist: self.registry.read_skew_hist(),
            batch_size: self.spec.batch_size,
            dataset: self.spec.dataset.name.clone(),
            optimizer: self.spec.optimizer,
            local: self.spec.local,
            lr_now: self.lr_now(&shards),
            ema: self.cfg.training.ema,
            uptime_s: self.started.elapsed().as_secs_f64(),
            egress_budget: self.cfg.training.exchange.egress_budget.get(),
            shards,
            workers_connected: totals.workers.map_or(0, |w| w.connected as usize),
            workers,
            totals: Totals {
                counters: totals,
                samples_per_sec: rate,
            },
            task: self.task(),
            eval: evals.last().copied(),
            eval_history: evals,
            private_run: self.cfg.join_token.is_some(),
            limits: self.limits.counts(),
            config: self.cfg.resolved.clone(),
            remote_shards,
            reputation,
            spot_checks: self.defence.spot.as_ref().map(|s| s.status()),
            quarantines,
            demo: self.demo.list(),
        }
    }

    /// The quarantined workers now, newest first (as [`Status::quarantines`]), recomputed only
    /// when a quarantine began or was lifted.
    pub fn quarantines(&self) -> Vec<QuarantineRow> {
        let epoch = self.defence.reputation.epoch();
        let mut c = self
            .quarantine_cache
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match &*c {
            Some((e, rows)) if *e == epoch => rows.clone(),
            _ => {
                let status = self.defence.reputation.status(QUARANTINE_ROWS);
                let rows = self.quarantine_rows(&status);
                *c = Some((epoch, rows.clone()));
                rows
            }
        }
    }

    /// The quarantined workers in `status` (quarantined ones come first in it), newest first,
    /// at most [`QUARANTINE_ROWS`].
    pub fn quarantine_rows(
        &self,
        status: &crate::defence::reputation::ReputationStatus,
    ) -> Vec<QuarantineRow> {
        // The reputation's times are seconds since it started, a moment before the App did.
        let start_ms = self.started_unix_ms;
        let mut rows: Vec<QuarantineRow> = status
            .workers
            .iter()
            .filter_map(|(id, r)| {
                let q = r.quarantined.as_ref()?;
                Some(QuarantineRow {
                    worker: id.parse().ok()?,
                    identity_short: r.identity.as_ref().map(|i| i.chars().take(8).collect()),
                    reason: q.reason.clone(),
                    at_ms: start_ms + (q.at_s * 1000.0) as u64,
                })
            })
            .collect();
        rows.sort_by_key(|r| std::cmp::Reverse((r.at_ms, r.worker)));
        rows.truncate(QUARANTINE_ROWS);
        rows
    }

    /// The counters one point of the figures ring is taken from
    /// ([`crate::coordinator::history::Figures`]).
    pub fn figure_totals(&self) -> crate::coordinator::history::Totals {
        let (_, totals) = self.registry.summary();
        let mut rejected: std::collections::BTreeMap<String, u64> = Default::default();
        for (k, v) in totals
            .rejected_by_reason
            .iter()
            .chain(totals.frames_rejected_by_reason.iter())
        {
            *rejected.entry((*k).to_string()).or_default() += v;
        }
        let l = self.limits.counts();
        crate::coordinator::history::Totals {
            t_ms: crate::coordinator::history::unix_ms(),
            samples: match &self.remote {
                Some(_) => self.samples(),
                None => totals.samples,
            },
            bytes_up: totals.bytes_up,
            bytes_down: totals.bytes_down,
            rejected,
            limit_refusals: l.connections_refused_total
                + l.connections_refused_per_ip
                + l.pushes_limited_per_worker
                + l.pushes_limited_per_ip
                + l.joins_limited
                + l.downloads_limited,
            volunteers: totals.workers.map_or(0, |w| w.volunteers.connected),
            quarantined: self.defence.reputation.summary().quarantined as u64,
        }
    }

    /// The shards as the status shows them, and the totals: from the registry's counters, or
    /// with remote shards from their last reports.
    fn shard_view(
        &self,
        shard_counters: Vec<Counters>,
        mut totals: Counters,
        remote: Option<&[crate::coordinator::remote::Health]>,
    ) -> (Vec<ShardStatus>, Counters) {
        let mut shards: Vec<ShardStatus> = self
            .shards
            .iter()
            .zip(shard_counters)
            .map(|(s, counters)| ShardStatus::of(s, counters))
            .collect();
        if let Some(health) = remote {
            // The shard processes count pushes and pulls; the coordinator sees their reports.
            shards = health
                .iter()
                .zip(self.spec.ranges())
                .map(|(h, range)| ShardStatus {
                    id: h.id,
                    range,
                    version: h.version.unwrap_or(0),
                    samples_applied: h
                        .status
                        .as_ref()
                        .and_then(|s| s["samples_applied"].as_u64())
                        .unwrap_or(0),
                    updates_by_merged: Default::default(),
                    egress_budget: remote_pacing(h.status.as_ref()).0,
                    pace_s: remote_pacing(h.status.as_ref()).1,
                    counters: remote_counters(h.status.as_ref()),
                })
                .collect();
            totals.pulls = shards.iter().map(|s| s.counters.pulls).sum();
            totals.pushes_applied = shards.iter().map(|s| s.counters.pushes_applied).sum();
            totals.pushes_rejected = shards.iter().map(|s| s.counters.pushes_rejected).sum();
            totals.frames_rejected = shards.iter().map(|s| s.counters.frames_rejected).sum();
            totals.samples = shards.first().map_or(0, |s| s.counters.samples);
        }
        (shards, totals)
    }

    /// [`Status::lr_now`] for shards in the state `shards`.
    fn lr_now(&self, shards: &[ShardStatus]) -> f32 {
        let version = shards.first().map_or(0, |s| s.version);
        if self.spec.local.steps.pseudo_gradients() {
            let inner = self.spec.local.inner;
            if inner.schedule.counted {
                // The next round's position: the most samples a shard applied.
                let applied = shards.iter().map(|s| s.samples_applied).max();
                inner.lr * inner.schedule.factor_at(applied.unwrap_or(0))
            } else {
                inner.lr * inner.schedule.factor(version)
            }
        } else {
            self.admin.lr() * self.spec.optimizer.schedule.factor(version)
        }
    }

    /// The dashboard's tick number `seq` ([`crate::coordinator::dashboard`]): the counters, and
    /// the evaluation points newer than `after` (seconds since start); also the newest point's
    /// time. Copies the registry's totals under its lock and walks no worker.
    pub fn tick_body(&self, seq: u64, after: f64) -> (TickBody, f64) {
        let (shard_counters, totals) = self.registry.summary();
        let remote_shards = self.remote.as_ref().map(|r| r.health());
        let (shards, totals) = self.shard_view(shard_counters, totals, remote_shards.as_deref());
        let (eval, evals) = {
            let e = self.evals.lock().unwrap_or_else(|p| p.into_inner());
            let new: Vec<EvalPoint> = e.iter().filter(|p| p.time_s > after).copied().collect();
            (e.last().copied(), new)
        };
        let newest = eval.map_or(after, |e| e.time_s.max(after));
        let body = TickBody {
            seq,
            lr_now: self.lr_now(&shards),
            uptime_s: self.started.elapsed().as_secs_f64(),
            consistency: self.consistency().to_string(),
            staleness_policy: self.cfg.training.staleness.to_string(),
            read_skew_hist: self.registry.read_skew_hist(),
            shards,
            workers_connected: totals.workers.map_or(0, |w| w.connected as usize),
            totals: Totals {
                counters: totals,
                samples_per_sec: self.samples_per_sec(),
            },
            eval,
            evals,
            limits: self.limits.counts(),
            remote_shards,
            reputation: self.defence.reputation.summary(),
            spot_checks: self.defence.spot.as_ref().map(|s| s.status()),
            demo: self.demo.list(),
        };
        (body, newest)
    }

    /// What does not change while the run lasts (but the configuration an operator may
    /// switch: the tick carries the consistency mode): the dashboard's `run` event.
    pub fn run_description(&self) -> serde_json::Value {
        serde_json::json!({
            "run_id": self.spec.run_id,
            "model": self.model.spec().to_string(),
            "params": self.model.param_len(),
            "batch_size": self.spec.batch_size,
            "dataset": self.spec.dataset.name,
            "optimizer": self.spec.optimizer,
            "local": self.spec.local,
            // As typed (0.999), not as the f32's f64 value (0.9990000128746033).
            "ema": self.cfg.training.ema.and_then(|d| d.to_string().parse::<f64>().ok()),
            "task": self.task(),
            "private_run": self.cfg.join_token.is_some(),
            "config": self.cfg.resolved,
        })
    }

    /// The examples behind all applied pushes (with remote shards: as shard 0 last reported).
    pub fn samples(&self) -> u64 {
        match &self.remote {
            Some(r) => remote_counters(r.health().first().and_then(|h| h.status.as_ref())).samples,
            None => self.registry.view().2.samples,
        }
    }

    /// [`App::params`], or with remote shards their `/api/params` (each with a timeout).
    ///
    /// # Errors
    /// When a remote shard does not answer in time.
    pub async fn fetch_params(&self) -> crate::Result<(Vec<f32>, Vec<u64>)> {
        match &self.remote {
            Some(r) => r.params().await,
            None => Ok(self.params()),
        }
    }

    /// The full parameter vector the run evaluates and exports, assembled from the shards
    /// ([`crate::shard::Shard::evaluated`]: their current values, or with `--ema` their
    /// moving averages), and their versions. Shards are read one after another, so versions
    /// may differ (read skew).
    pub fn params(&self) -> (Vec<f32>, Vec<u64>) {
        self.gather(crate::shard::Shard::evaluated)
    }

    /// The full parameter vector the workers train (the shards' current snapshots, whether
    /// or not the run keeps a moving average), and the shards' versions.
    pub fn live_params(&self) -> (Vec<f32>, Vec<u64>) {
        self.gather(|s| {
            let snap = s.snapshot();
            (snap.version, snap.values)
        })
    }

    /// Every shard's (version, values) as `read` gives them, concatenated in shard order.
    fn gather(
        &self,
        read: impl Fn(&crate::shard::Shard) -> (u64, Arc<Vec<f32>>),
    ) -> (Vec<f32>, Vec<u64>) {
        let mut all = Vec::with_capacity(self.model.param_len());
        let mut versions = Vec::with_capacity(self.shards.len());
        for s in &self.shards {
            let (version, values) = read(s);
            all.extend_from_slice(&values);
            versions.push(version);
        }
        (all, versions)
    }

    /// Samples per second over the last few seconds.
    pub fn samples_per_sec(&self) -> f64 {
        let r = self.rate.lock().unwrap_or_else(|p| p.into_inner());
        match (r.first(), r.last()) {
            (Some(a), Some(b)) if b.0 > a.0 => {
                (b.1 - a.1) as f64 / b.0.duration_since(a.0).as_secs_f64()
            }
            _ => 0.0,
        }
    }

    /// What a checkpoint is taken of ([`crate::checkpoint::Source`]).
    pub fn checkpoint_source(&self) -> crate::checkpoint::Source {
        crate::checkpoint::Source {
            shards: self.shards.clone(),
            spec: self.spec.clone(),
            registry: self.registry.clone(),
            metrics: self.metrics.clone(),
            history: Some(self.history_saver()),
        }
    }

    /// What `/metrics` shows now, read from the registry and the shards.
    pub fn scrape(&self) -> crate::registry::metrics::Scrape {
        let (_, shard_counters, totals) = self.registry.view();
        let health = self.remote.as_ref().map(|r| r.health()).unwrap_or_default();
        // Copied out first: the evaluations' lock is not held while the rest is read.
        let newest = self
            .evals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .last()
            .copied();
        let remote = health
            .iter()
            .map(|h| crate::registry::metrics::ShardScrape {
                id: h.id,
                version: h.version.unwrap_or(0),
                counters: remote_counters(h.status.as_ref()),
                apply: None,
                bytes_received: 0,
                bytes_sent: 0,
                egress_budget: remote_pacing(h.status.as_ref()).0,
                pace_s: remote_pacing(h.status.as_ref()).1,
            });
        crate::registry::metrics::Scrape {
            shards: self
                .shards
                .iter()
                .zip(shard_counters)
                .map(|(s, counters)| {
                    let (bytes_received, bytes_sent) = s.bytes();
                    crate::registry::metrics::ShardScrape {
                        id: s.id(),
                        version: s.version(),
                        counters,
                        apply: Some(s.apply_seconds()),
                        bytes_received,
                        bytes_sent,
                        egress_budget: s.egress_budget(),
                        pace_s: s.pace_s(),
                    }
                })
                .chain(remote)
                .collect(),
            totals,
            samples_per_sec: self.samples_per_sec(),
            remote_up: health.iter().map(|h| (h.id, h.up)).collect(),
            checkpoint: self.metrics.checkpoint(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            now_unix: crate::registry::metrics::unix_now(),
            test: newest.map(|e| (e.accuracy, e.loss)),
            test_bits_per_token: newest.and_then(|e| e.bits_per_token),
        }
    }

    /// Records the sample counter for the rate meter.
    fn tick_rate(&self) {
        let samples = self.samples();
        let mut r = self.rate.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        r.push((now, samples));
        r.retain(|(t, _)| now.duration_since(*t) <= Duration::from_secs(5));
    }
}

impl App {
    /// Appends `point` to the dashboard's evaluation history (thinned when full).
    fn keep_eval(&self, point: EvalPoint) {
        let mut evals = self.evals.lock().unwrap_or_else(|p| p.into_inner());
        if evals.len() >= EVAL_HISTORY {
            // Thin out: keep every other point, so the history spans the whole run.
            let kept: Vec<EvalPoint> = evals.iter().step_by(2).copied().collect();
            *evals = kept;
        }
        evals.push(point);
    }

    /// The evaluator found nothing moved: when the newest point is
    /// [`crate::coordinator::history::IDLE_EVERY_MS`] old, the same figures again, now.
    fn idle_point(&self) {
        let now = crate::coordinator::history::unix_ms();
        let raw = self.samples();
        let recorded = self
            .experiments
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .record(None, now, raw, None);
        if !recorded {
            return;
        }
        let last = self
            .evals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .last()
            .copied();
        if let Some(p) = last {
            self.keep_eval(EvalPoint {
                time_s: self.started.elapsed().as_secs_f64(),
                t_ms: now,
                ..p
            });
        }
    }

    /// What checkpoints keep of the coordinator: every experiment's history.
    fn history_saver(&self) -> crate::checkpoint::History {
        let x = self.experiments.clone();
        crate::checkpoint::History(Arc::new(move || {
            let e = x.lock().unwrap_or_else(|p| p.into_inner());
            serde_json::to_value(&*e).unwrap_or(serde_json::Value::Null)
        }))
    }
}

/// The body of `GET /readyz`.
#[derive(Debug, Clone, Serialize)]
pub struct Readiness {
    /// Whether the server takes workers: every shard loaded (and, with remote shards,
    /// answering with the expected layout), and not shutting down.
    pub ready: bool,
    /// True once shutdown began.
    pub shutting_down: bool,
    /// Per shard: `{"id", "ready", "url"?, "error"?}`.
    pub shards: Vec<serde_json::Value>,
}

impl App {
    /// Whether the server is ready to take workers, and why not.
    pub fn readiness(&self) -> Readiness {
        let shutting_down = *self.shutdown.borrow();
        let shards: Vec<serde_json::Value> = match &self.remote {
            Some(r) => r
                .health()
                .iter()
                .map(|h| {
                    serde_json::json!({
                        "id": h.id, "ready": h.ready, "url": h.url, "version": h.version,
                        "error": h.error,
                    })
                })
                .collect(),
            None => self
                .shards
                .iter()
                .map(|s| serde_json::json!({ "id": s.id(), "ready": true, "version": s.version() }))
                .collect(),
        };
        let all = shards.iter().all(|s| s["ready"] == true);
        Readiness {
            ready: !shutting_down && all && !shards.is_empty(),
            shutting_down,
            shards,
        }
    }
}

/// The side-car evaluator (like TF2's): every `eval_every`, if any shard moved, evaluate the
/// current parameters on the test set on a blocking thread, off the request path.
pub async fn evaluator(app: Arc<App>) {
    let mut shutdown = app.shutdown.clone();
    let mut last_versions: Option<Vec<u64>> = None;
    let mut rate_tick = tokio::time::interval(Duration::from_millis(500));
    let mut next_eval = tokio::time::Instant::now();
    let mut last_sample: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = rate_tick.tick() => app.tick_rate(),
            _ = tokio::time::sleep_until(next_eval) => {
                next_eval = tokio::time::Instant::now() + app.cfg.eval_every;
                // The experiment the parameters belong to, read before them.
                let experiment = app
                    .experiments
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .current()
                    .map_or(0, |e| e.id);
                let (params, versions) = match app.fetch_params().await {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::warn!(error = %e, "evaluation skipped: could not read the parameters");
                        continue;
                    }
                };
                if last_versions.as_ref() == Some(&versions) {
                    // Nothing moved: at most every 30 s the same figures with a new time, so
                    // a chart draws the idle time flat (issue 19).
                    app.idle_point();
                    continue;
                }
                let samples = app.samples();
                let step = versions.iter().sum::<u64>() / versions.len().max(1) as u64;
                last_versions = Some(versions);
                let a = app.clone();
                let language = app.model.sequence().is_some();
                let due = language
                    && last_sample.is_none_or(|t: tokio::time::Instant| t.elapsed().as_secs_f64() >= SAMPLE_EVERY_S);
                let began = tokio::time::Instant::now();
                let (stats, text) = match tokio::task::spawn_blocking(move || {
                    let stats = evaluate(&a.model, &params, &a.test);
                    let text = due.then(|| write_sample(&a, &params, step)).flatten();
                    (stats, text)
                })
                .await
                {
                    Ok(s) => s,
                    Err(_) => continue,
                };
                // A language model's slow evaluation waits longer for the next (an image
                // model's keeps --eval-every: tests and pages expect fresh points).
                if language {
                    let took = began.elapsed().as_secs_f64();
                    next_eval = next_eval.max(began + Duration::from_secs_f64(took / EVAL_SHARE));
                }
                let time_s = app.started.elapsed().as_secs_f64();
                if let Some(text) = text {
                    last_sample = Some(tokio::time::Instant::now());
                    *app.sample.lock().unwrap_or_else(|p| p.into_inner()) = Some(Sample {
                        prompt: SAMPLE_PROMPT.to_string(),
                        text,
                        temperature: SAMPLE_TEMPERATURE,
                        step,
                        samples,
                        time_s,
                    });
                }
                let point = EvalPoint {
                    time_s,
                    t_ms: crate::coordinator::history::unix_ms(),
                    step,
                    samples,
                    loss: stats.mean_loss(),
                    accuracy: stats.accuracy(),
                    bits_per_token: language.then(|| stats.mean_loss() / std::f64::consts::LN_2),
                };
                tracing::info!(step, samples, loss = point.loss, accuracy = point.accuracy, "evaluation");
                app.experiments
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .record(
                        Some(experiment),
                        point.t_ms,
                        samples,
                        Some((point.accuracy, point.loss, point.bits_per_token)),
                    );
                app.keep_eval(point);
            }
        }
    }
}

/// What the weights `params` (at mean version `step`) write after [`SAMPLE_PROMPT`]: `None`
/// for a model that is not a language model or a run without a tokenizer of text.
fn write_sample(app: &App, params: &[f32], step: u64) -> Option<String> {
    let text = app.spec.dataset.text.as_ref()?;
    let prompt: Vec<u32> = text
        .encode(SAMPLE_PROMPT)
        .into_iter()
        .map(u32::from)
        .collect();
    // Seeded by the version: the same weights write the same sample.
    let mut rng = crowdgrad_core::rng::Rng::new(app.spec.seed ^ step.wrapping_mul(0x9E37_79B9));
    let ids = app
        .model
        .generate(params, &prompt, SAMPLE_TOKENS, SAMPLE_TEMPERATURE, &mut rng)
        .ok()?;
    let ids: Vec<u8> = ids
        .into_iter()
        .filter_map(|i| u8::try_from(i).ok())
        .collect();
    Some(text.decode(&ids))
}
