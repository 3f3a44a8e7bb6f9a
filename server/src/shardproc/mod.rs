//! `crowdgrad shard`: one parameter shard in a process of its own, for runs that outgrow one
//! machine. [`run`] serves shard `I` of `N` with the same endpoint as `crowdgrad serve`
//! (`/ws/shard/{I}`, the same [`handler::serve`](crate::shard::handler::serve) over the same
//! [`Shard`]), plus:
//! - `GET /api/params`: the shard's values, raw f32 LE (header `x-crowdgrad-versions`);
//! - `GET /api/shard`: what the coordinator checks and shows ([`ShardReport`]);
//! - `GET /api/feed?boot=B&ack=S`: what the workers' pushes did here since the coordinator last
//!   took it ([`crate::registry::feed`]), for its ledger and join admission; only with the
//!   coordinator's token ([`crate::support::credential::coordinator_token`]), else 401;
//! - `GET /healthz`, `GET /readyz`, `GET /metrics`.
//!
//! Workers join at the coordinator (`crowdgrad serve --shard-urls ...`), which hands them a
//! credential (HMAC of the worker id under the run secret, [`crate::support::credential`]); this process
//! shares the secret and admits a Hello only with its worker's credential, until the credential
//! expires: `--credential-expiry` after its worker's last socket here closed
//! ([`crate::shard::expiry`]). Connections are counted as on `serve` (`crate::net`): a socket
//! leaves the unauthenticated budget once its Hello is admitted.
//!
//! [`remote`] is the coordinator's side: health checks, layout checks and parameter fetches.
//! [`checkpoint`] is the process's own checkpoints (`--checkpoint-dir`): a shard that died
//! and is started again on the same directory continues from its newest one (values,
//! optimizer state, version), without a coordinator restart.

pub mod checkpoint;

use crate::config::{Training, TrainingArgs};
use crate::error::{Error, Result};
use crate::registry::Registry;
use crate::shard::report::{ShardReport, ShardStatus};
use crate::shard::upgrade::ShardUpgrade;
use crate::shard::Shard;
use axum::extract::{ConnectInfo, Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Extension;
use axum::{Json, Router};
use clap::Args;
use crowdgrad_core::model::Model;
use crowdgrad_core::spec::{DataInfo, RunParams, RunSpec};

use serde_json::json;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio_util::task::TaskTracker;

/// How long shutdown waits for open WebSocket connections to finish.
const DRAIN: Duration = Duration::from_secs(5);

pub use crate::support::credential::MIN_SECRET;

/// Flags of `crowdgrad shard`.
#[derive(Debug, Clone, Args)]
#[command(mut_arg("shards", |a| a
    .visible_alias("of")
    .required(true)
    .help("Number of shards in the run (`--of` or `--shards`); the coordinator's --shard-urls lists as many")))]
#[command(mut_arg("egress_budget", |a| a.default_value(crowdgrad_core::shard::pace::DEFAULT_EGRESS_BUDGET)))]
pub struct ShardArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:9000")]
    pub listen: SocketAddr,
    /// Which shard of the run this process serves (0-based).
    #[arg(long)]
    pub index: usize,
    /// The run's training flags: they must be the coordinator's (the coordinator checks model,
    /// consistency and layout and reports a mismatch on /readyz).
    #[command(flatten)]
    pub training: TrainingArgs,
    /// Input features of one example (MNIST: 784), which fixes the model's layout.
    #[arg(long, default_value_t = 784)]
    pub inputs: usize,
    /// Classes (MNIST: 10).
    #[arg(long, default_value_t = 10)]
    pub classes: usize,
    /// The run secret shared with the coordinator (at least 16 characters); workers' Hellos
    /// must carry the credential the coordinator derived from it.
    #[arg(long, env = "CROWDGRAD_RUN_SECRET", hide_env_values = true)]
    pub run_secret: String,
    /// Most simultaneous TCP connections (WebSockets included): past it a connection is
    /// refused before anything is read from it.
    #[arg(long, default_value_t = 4_096)]
    pub max_connections: usize,
    /// Per-IP connection caps, push rates, header, Hello and idle deadlines: the same limits,
    /// flags and defaults as `crowdgrad serve` (join and download rates do not apply: a shard
    /// process serves neither).
    #[command(flatten)]
    pub limits: crate::support::limits::LimitArgs,
    /// Seconds a worker's credential stays good here after its last socket to this shard
    /// closed: past that its Hello gets `unknown_worker` and it must join the coordinator
    /// again, as on `serve`'s own shards, where a credential expires with its session after 10
    /// minutes away. A credential this process never saw is admitted (it cannot tell when the
    /// coordinator issued it) and remembered from then on (docs/remote-shards.md).
    #[arg(long, default_value_t = 600.0)]
    pub credential_expiry: f64,
    /// The run's shard checkpoints: a directory or `s3://BUCKET/PREFIX`; this shard writes
    /// its own under `shard-{index}/` in it and, on start, resumes from the newest valid one
    /// there (values, optimizer state, version). No checkpoints without it.
    #[arg(long)]
    pub checkpoint_dir: Option<String>,
    /// Seconds between this shard's checkpoints (one is also written on shutdown).
    #[arg(long, default_value_t = 30.0)]
    pub checkpoint_every: f64,
    /// Checkpoints kept; older ones are deleted.
    #[arg(long, default_value_t = 3)]
    pub checkpoint_keep: usize,
}

/// Checked [`ShardArgs`].
#[derive(Clone)]
pub struct ShardProcConfig {
    /// Listen address.
    pub listen: SocketAddr,
    /// This shard's index.
    pub index: usize,
    /// The run's training settings (`shards` is the shard count).
    pub training: Training,
    /// Input features.
    pub inputs: usize,
    /// Classes.
    pub classes: usize,
    /// The run secret.
    pub secret: Vec<u8>,
    /// Connection limit.
    pub max_connections: usize,
    /// Per-IP, rate and timeout limits (as `serve`'s).
    pub limits: crate::support::limits::LimitConfig,
    /// A credential expires this long after its worker's last socket here closed.
    pub credential_expiry: Duration,
    /// Checkpoint policy, if any.
    pub checkpoint: Option<checkpoint::ShardCheckpointConfig>,
}

impl std::fmt::Debug for ShardProcConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardProcConfig")
            .field("listen", &self.listen)
            .field("index", &self.index)
            .field("training", &self.training)
            .field("secret", &"<redacted>")
            .finish_non_exhaustive()
    }
}

impl ShardArgs {
    /// Validates the flags.
    ///
    /// # Errors
    /// [`Error::Config`] naming the bad flag.
    pub fn check(self) -> Result<ShardProcConfig> {
        let training = self.training.check(crate::config::CommandDefaults {
            shards: 1,
            local_steps: crate::config::SERVE_LOCAL_STEPS,
        })?;
        if matches!(
            training.aggregation,
            crowdgrad_core::robust::Aggregation::Zeno { .. }
        ) {
            return Err(Error::Config(
                "--aggregation zeno needs the training data next to the shards (crowdgrad serve without --shard-urls); a shard process can use consensus".into(),
            ));
        }
        if self.index >= training.shards {
            return Err(Error::Config(format!(
                "--index {} must be below --of {}",
                self.index, training.shards
            )));
        }
        if self.run_secret.len() < MIN_SECRET {
            return Err(Error::Config(format!(
                "--run-secret must be at least {MIN_SECRET} characters"
            )));
        }
        if !(1..=1 << 24).contains(&self.inputs) || !(2..=1 << 16).contains(&self.classes) {
            return Err(Error::Config(
                "--inputs must be in 1..=16777216 and --classes in 2..=65536".into(),
            ));
        }
        if self.max_connections == 0 {
            return Err(Error::Config("--max-connections must be positive".into()));
        }
        if !(self.credential_expiry.is_finite()
            && (0.05..=30.0 * 86_400.0).contains(&self.credential_expiry))
        {
            return Err(Error::Config(format!(
                "--credential-expiry {} must be between 0.05 and 2592000 seconds",
                self.credential_expiry
            )));
        }
        let checkpoint = match self.checkpoint_dir {
            None => None,
            Some(d) if d.is_empty() => {
                return Err(Error::Config("--checkpoint-dir must not be empty".into()))
            }
            Some(location) => {
                if !(self.checkpoint_every.is_finite()
                    && (0.1..=86_400.0).contains(&self.checkpoint_every))
                {
                    return Err(Error::Config(format!(
                        "--checkpoint-every {} must be between 0.1 and 86400 seconds",
                        self.checkpoint_every
                    )));
                }
                if !(1..=1000).contains(&self.checkpoint_keep) {
                    return Err(Error::Config(format!(
                        "--checkpoint-keep {} must be in 1..=1000",
                        self.checkpoint_keep
                    )));
                }
                Some(checkpoint::ShardCheckpointConfig {
                    location,
                    every: Duration::from_secs_f64(self.checkpoint_every),
                    keep: self.checkpoint_keep,
                })
            }
        };
        Ok(ShardProcConfig {
            listen: self.listen,
            index: self.index,
            training,
            inputs: self.inputs,
            classes: self.classes,
            secret: crate::support::credential::RunSecret::shared(&self.run_secret)
                .as_bytes()
                .to_vec(),
            max_connections: self.max_connections,
            limits: self.limits.check()?,
            credential_expiry: Duration::from_secs_f64(self.credential_expiry),
            checkpoint,
        })
    }
}

/// The run spec a shard process derives from its flags (the same [`RunSpec::build`] the
/// coordinator runs, on a dataset of `inputs` features and `classes` classes).
///
/// # Errors
/// When the model does not fit.
pub fn spec_of(t: &Training, inputs: usize, classes: usize) -> Result<RunSpec> {
    Ok(RunSpec::build(RunParams {
        run_id: "shard".into(),
        model: t.model.clone(),
        optimizer: t.optimizer,
        batch_size: t.batch_size,
        seed: t.seed,
        consistency: t.consistency,
        shards: t.shards,
        dataset: DataInfo {
            name: "remote".into(),
            image_dims: vec![inputs],
            classes,
            train_len: 0,
            test_len: 0,
            text: None,
        },
        local: Default::default(),
        normalize: Default::default(),
    })?)
}

struct ShardProc {
    shard: Shard,
    registry: Registry,
    spec: RunSpec,
    shutdown: watch::Receiver<bool>,
    tracker: TaskTracker,
    connections: Arc<Semaphore>,
    limits: Arc<crate::support::limits::Limits>,
    metrics: Arc<crate::registry::metrics::Metrics>,
    started: Instant,
    /// What the coordinator must show to take the feed (`Authorization: Bearer ...`).
    coordinator_token: String,
}

/// Serves shard `cfg.index` on `listener` until `shutdown` completes; then tells every worker
/// goodbye and waits (at most 5 s) for the connections to finish.
///
/// # Errors
/// A model that does not fit, or a failing listener.
pub async fn run(
    listener: TcpListener,
    cfg: ShardProcConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let spec = spec_of(&cfg.training, cfg.inputs, cfg.classes)?;
    let range = spec.ranges()[cfg.index];
    let t = &cfg.training;
    // This shard's own checkpoints: continue from the newest valid one (a corrupt one is
    // skipped, one of another run is refused before serving).
    let (checkpointer, restored) = match &cfg.checkpoint {
        Some(c) => {
            let (ck, r) = checkpoint::resume(c, &spec, cfg.index).await?;
            (Some(Arc::new(ck)), r)
        }
        None => (None, None),
    };
    let opts = t.shard_setup(true, spec.model.param_len());
    let shard = match restored {
        Some((name, c)) => {
            tracing::info!(checkpoint = %name, version = c.meta.version, "shard continues from its checkpoint");
            Shard::restore(cfg.index as u32, range, c.export(), opts)?
        }
        None => {
            let model = Model::new(spec.model.clone())?;
            let values = model.init_params(t.seed)[range.start..range.end].to_vec();
            Shard::start(cfg.index as u32, range, values, opts)?
        }
    };
    shard.require_credential(cfg.secret.clone());
    shard.expire_credentials(cfg.credential_expiry);
    let (stop_tx, stop_rx) = watch::channel(false);
    let registry = Registry::new(t.shards, 1 << 20);
    // Numbers the feed's batches for this start (any value that differs between starts).
    let boot = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64 | 1);
    registry.keep_feed(boot);
    let proc = Arc::new(ShardProc {
        shard,
        registry,
        spec,
        shutdown: stop_rx,
        tracker: TaskTracker::new(),
        connections: Arc::new(Semaphore::new(cfg.max_connections)),
        limits: crate::support::limits::Limits::new(cfg.limits),
        metrics: Arc::default(),
        started: Instant::now(),
        coordinator_token: crate::support::credential::coordinator_token(&cfg.secret),
    });
    let router = Router::new()
        .route("/ws/shard/{id}", get(ws))
        .route("/api/params", get(params))
        .route("/api/shard", get(report))
        .route("/api/feed", get(feed))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(proc.clone());
    // Memory of closed worker connections goes back to the OS, as in `serve` (crate::support::trim).
    let (conns, max) = (proc.connections.clone(), cfg.max_connections);
    tokio::spawn(crate::support::trim::counting(
        move || max.saturating_sub(conns.available_permits()) as u64,
        proc.shutdown.clone(),
    ));
    let writer = checkpointer.clone().map(|ck| {
        tokio::spawn(checkpoint::task(
            proc.shard.clone(),
            ck,
            proc.shutdown.clone(),
            proc.metrics.clone(),
        ))
    });
    tracing::info!(
        index = cfg.index,
        of = t.shards,
        range = ?range,
        model = %proc.spec.model,
        "shard process serving"
    );
    // The same hardened accept loop as `serve` (crate::net): every TCP connection counted
    // against --max-connections and the per-IP cap before a byte is read, header deadline.
    let caps = crate::net::Caps::new(
        proc.limits.clone(),
        proc.connections.clone(),
        cfg.max_connections,
    );
    crate::net::serve(listener, router, caps, None, async move {
        shutdown.await;
        tracing::info!("shard shutting down: closing worker connections");
        let _ = stop_tx.send(true);
    })
    .await;
    let served: Result<()> = Ok(());
    proc.tracker.close();
    let _ = tokio::time::timeout(DRAIN, proc.tracker.wait()).await;
    // Every connection is done: the final checkpoint holds every acknowledged push.
    let mut served = served;
    if let Some(ck) = &checkpointer {
        if let Some(w) = writer {
            let _ = w.await;
        }
        match ck.write(&proc.shard).await {
            Ok(w) => {
                tracing::info!(checkpoint = %w.name, bytes = w.bytes, version = w.version, "final shard checkpoint written")
            }
            Err(e) => {
                tracing::error!(%e, "final shard checkpoint failed");
                served = served.and(Err(e));
            }
        }
    }
    served
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({ "error": message.into() }))).into_response()
}

async fn ws(
    State(p): State<Arc<ShardProc>>,
    Path(id): Path<usize>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    Extension(slot): Extension<Arc<crate::net::ConnSlot>>,
    headers: HeaderMap,
    upgrade: ShardUpgrade,
) -> Response {
    if id != p.shard.id() as usize {
        return error(
            StatusCode::NOT_FOUND,
            format!("this process serves shard {}, not {id}", p.shard.id()),
        );
    }
    if *p.shutdown.borrow() {
        return error(StatusCode::SERVICE_UNAVAILABLE, "shard is shutting down");
    }
    crate::shard::socket::limited_socket(
        upgrade,
        p.shard.clone(),
        p.registry.clone(),
        p.shutdown.clone(),
        p.tracker.clone(),
        &p.limits,
        peer,
        &headers,
        slot,
    )
}

async fn params(State(p): State<Arc<ShardProc>>) -> Response {
    let (version, values) = p.shard.evaluated();
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut r = bytes.into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert("x-crowdgrad-versions", HeaderValue::from(version));
    r
}

fn shard_report(p: &ShardProc) -> ShardReport {
    let (_, counters, _) = p.registry.view();
    let s = &p.shard;
    let status = ShardStatus::of(
        s,
        counters.get(s.id() as usize).cloned().unwrap_or_default(),
    );
    ShardReport {
        index: s.id(),
        of: p.spec.shards.len(),
        range: s.range(),
        model: p.spec.model.to_string(),
        consistency: p.spec.consistency.to_string(),
        ema: s.config().setup.average,
        version: s.version(),
        uptime_s: p.started.elapsed().as_secs_f64(),
        status: serde_json::to_value(status).unwrap_or_default(),
    }
}

async fn report(State(p): State<Arc<ShardProc>>) -> Response {
    Json(shard_report(&p)).into_response()
}

/// The query of `GET /api/feed`.
#[derive(Debug, serde::Deserialize)]
struct FeedQuery {
    #[serde(default)]
    boot: u64,
    #[serde(default)]
    ack: u64,
}

async fn feed(
    State(p): State<Arc<ShardProc>>,
    headers: HeaderMap,
    query: std::result::Result<
        axum::extract::Query<FeedQuery>,
        axum::extract::rejection::QueryRejection,
    >,
) -> Response {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if !crate::support::credential::token_eq(given, &p.coordinator_token) {
        return error(
            StatusCode::UNAUTHORIZED,
            "the feed is the coordinator's: Authorization: Bearer <token derived from the run secret>",
        );
    }
    let Ok(axum::extract::Query(q)) = query else {
        return error(
            StatusCode::BAD_REQUEST,
            "query: boot and ack must be unsigned integers",
        );
    };
    match p.registry.take_feed(q.boot, q.ack) {
        Some(batch) => Json(batch).into_response(),
        None => error(StatusCode::NOT_FOUND, "no feed"),
    }
}

async fn healthz() -> Response {
    Json(json!({ "live": true })).into_response()
}

async fn readyz(State(p): State<Arc<ShardProc>>) -> Response {
    let stopping = *p.shutdown.borrow();
    let body = json!({
        "ready": !stopping,
        "shutting_down": stopping,
        "shards": [{ "id": p.shard.id(), "ready": !stopping, "version": p.shard.version() }],
    });
    let code = if stopping {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    (code, Json(body)).into_response()
}

async fn metrics(State(p): State<Arc<ShardProc>>) -> Response {
    let (_, counters, totals) = p.registry.view();
    let s = &p.shard;
    let (bytes_received, bytes_sent) = s.bytes();
    let scrape = crate::registry::metrics::Scrape {
        shards: vec![crate::registry::metrics::ShardScrape {
            id: s.id(),
            version: s.version(),
            counters: counters.get(s.id() as usize).cloned().unwrap_or_default(),
            apply: Some(s.apply_seconds()),
            bytes_received,
            bytes_sent,
            egress_budget: s.egress_budget(),
            pace_s: s.pace_s(),
        }],
        totals,
        samples_per_sec: 0.0,
        remote_up: Vec::new(),
        checkpoint: p.metrics.checkpoint(),
        uptime_s: p.started.elapsed().as_secs_f64(),
        now_unix: crate::registry::metrics::unix_now(),
        test: None,
        test_bits_per_token: None,
    };
    (
        [(header::CONTENT_TYPE, crate::registry::metrics::CONTENT_TYPE)],
        crate::registry::metrics::render_with(scrape, Some(Box::new(p.limits.counts()))),
    )
        .into_response()
}
