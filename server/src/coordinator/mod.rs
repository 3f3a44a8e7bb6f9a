//! The coordinator: the `crowdgrad serve` process. It builds the run (model, initial
//! parameters, shards), holds the shared state ([`app::App`]), runs the evaluator and the
//! checkpoint writer, and serves the page, the HTTP API and the shard endpoints through the
//! hardened listener ([`crate::net`]).
//!
//! - [`run`] / [`start`]: the server (mini-redis' `server::run(listener, shutdown)`).
//! - [`app`]: the shared state, the side-car evaluator and `/api/status`.
//! - [`admin`]: the admin state (pause, drain, stop, live learning rate).
//! - [`http`]: the router, one file per endpoint group.
//! - [`remote`]: shards in other processes (`--shard-urls`).
//! - [`zeno`]: the validation-gradient thread of `--aggregation zeno`.
//! - [`anchor`]: the norm anchor thread (the server's own per-step gradient norms, issue 21).

pub mod admin;
pub mod anchor;
pub mod app;
pub mod http;
pub mod remote;
pub mod zeno;

use crate::config::ServeConfig;
use crate::error::{Error, Result};
use crate::shard::Shard;
use crate::support::data::TrainTest;
use crate::support::{credential, limits, tls, trim};
use crate::{checkpoint, defence, net, registry};
use app::App;
use crowdgrad_core::model::Model;
use crowdgrad_core::spec::{DataInfo, RunParams, RunSpec};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio_util::task::TaskTracker;

/// How long shutdown waits for open WebSocket connections to finish.
const DRAIN: Duration = Duration::from_secs(5);

/// Builds the run (model, initial parameters, shards) and serves on `listener` until
/// `shutdown` completes; then stops accepting, tells every worker (Bye + Close), lets in-flight
/// applies finish and returns.
///
/// # Errors
/// When the model does not fit the data, or the listener fails.
pub async fn run(
    listener: TcpListener,
    cfg: ServeConfig,
    data: TrainTest,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let run_id = format!(
        "{:x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis())
    );
    let spec = RunSpec::build(RunParams {
        run_id,
        model: cfg.training.model.clone(),
        optimizer: cfg.training.optimizer,
        batch_size: cfg.training.batch_size,
        seed: cfg.training.seed,
        consistency: cfg.training.consistency,
        shards: cfg.training.shards,
        dataset: DataInfo::of(cfg.dataset.clone(), &data.train, &data.test),
        local: cfg.training.exchange.local,
        normalize: cfg.training.normalize.resolve(&data.train)?,
    })?;
    // The evaluator sees the test set as the workers see their batches.
    let mut data = data;
    data.test.set_normalize(&spec.normalize)?;
    // Continue the newest valid checkpoint, if any (crate::checkpoint); its run id stays, so
    // workers that rejoin see the same run.
    let (checkpoints, mut restored) = match &cfg.checkpoint {
        Some(c) => {
            let (ck, r) = checkpoint::resume(c, &spec).await?;
            (Some(Arc::new(ck)), r)
        }
        None => (None, None),
    };
    let mut spec = spec;
    if let Some(r) = &restored {
        spec.run_id = r.run_id.clone();
    }
    let mut saved = restored
        .as_mut()
        .map(|r| std::mem::take(&mut r.exports).into_iter());
    let model = Model::new(spec.model.clone())?;
    let ranges = spec.ranges();
    let initial = model.init_params(cfg.training.seed);
    let mut shards = Vec::new();
    // With --shard-urls the shards are other processes: workers get their absolute URLs.
    let remote = if cfg.shard_urls.is_empty() {
        None
    } else {
        let r = remote::RemoteShards::new(
            &cfg.shard_urls,
            &ranges,
            &spec.model.to_string(),
            &spec.consistency.to_string(),
        )?;
        r.rewrite(&mut spec.shards);
        Some(Arc::new(r))
    };
    for (i, r) in ranges.iter().enumerate() {
        if remote.is_some() {
            break;
        }
        let setup = cfg.training.shard_setup(true);
        shards.push(match saved.as_mut().and_then(Iterator::next) {
            Some(export) => Shard::restore(i as u32, *r, export, setup)?,
            // Refused here, before anything is served, when the setup cannot run at this size.
            None => Shard::start(i as u32, *r, initial[r.start..r.end].to_vec(), setup).map_err(
                |e| {
                    Error::Config(format!(
                        "{e} (flags --consistency, --shards, --aggregation, --model)"
                    ))
                },
            )?,
        });
    }
    drop(initial);
    let data_tag = {
        let mut h = crate::support::data::sha256_hex(data.train.labels());
        h.truncate(12);
        format!("{h}-{}", cfg.partitions)
    };
    let tls = match &cfg.tls {
        Some(files) => Some(tokio_rustls::TlsAcceptor::from(tls::server_config(files)?)),
        None => None,
    };
    let secret = match &cfg.run_secret {
        // Shared with the shard processes (--run-secret), or drawn for this run only.
        Some(text) => credential::RunSecret::shared(text.expose()),
        None => credential::RunSecret::generate().map_err(|e| Error::io("run secret", e))?,
    };
    for s in &shards {
        // Every Hello must carry the credential its join handed out (crate::support::credential).
        s.require_credential(secret.as_bytes().to_vec());
    }
    let (admin, generated) = admin::Admin::new(cfg.admin_token.clone(), cfg.training.optimizer.lr)
        .map_err(|e| Error::io("admin token", e))?;
    if let Some(token) = generated {
        // Printed once, on stdout, never logged (crate::coordinator::admin).
        println!("admin token (for crowdgrad ctl and /api/admin; shown only now): {token}");
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    let registry = registry::Registry::new(cfg.training.shards, cfg.max_workers);
    let train = Arc::new(data.train);
    // --aggregation zeno: the validation gradient, computed once before anything is served.
    let zeno = if matches!(
        cfg.training.aggregation,
        crowdgrad_core::robust::Aggregation::Zeno { .. }
    ) && !shards.is_empty()
    {
        Some(zeno::start(&spec, &train, shards.clone(), stop_rx.clone())?)
    } else {
        None
    };
    // The norm reference's anchor (crate::coordinator::anchor), before anything is served.
    let anchor = anchor::start(&spec, &train, shards.clone(), stop_rx.clone())?;
    let defence = defence::spotcheck::Defence {
        reputation: Arc::new(defence::reputation::Reputation::new(cfg.spot.quarantine)),
        spot: None,
    };
    let defence = if cfg.spot.fraction > 0.0 && !shards.is_empty() {
        defence::spotcheck::Defence {
            spot: Some(defence::spotcheck::SpotChecker::start(
                cfg.spot,
                &spec,
                train.clone(),
                cfg.partitions,
                registry.clone(),
                defence.reputation.clone(),
                shards
                    .iter()
                    .map(|s| {
                        let snap = s.snapshot();
                        (snap.version, snap.values)
                    })
                    .collect(),
            )?),
            ..defence
        }
    } else {
        defence
    };
    for s in &shards {
        s.set_defence(defence.clone())?;
    }
    let app = Arc::new(App {
        limits: limits::Limits::new(cfg.limits),
        secret,
        registry,
        defence,
        connections: Arc::new(Semaphore::new(cfg.max_connections)),
        cfg,
        spec,
        shards,
        model,
        train,
        test: Arc::new(data.test),
        data_tag,
        evals: Mutex::new(Vec::new()),
        rate: Mutex::new(Vec::new()),
        started: Instant::now(),
        shutdown: stop_rx,
        tracker: TaskTracker::new(),
        metrics: Default::default(),
        remote,
        checkpoints: checkpoints.clone(),
        admin,
    });
    if let Some(r) = app.remote.clone() {
        let stop = app.shutdown.clone();
        tokio::spawn(async move { r.monitor(stop).await });
    }
    if let Some(r) = &restored {
        match registry::ledger::Ledger::restore(&r.ledger) {
            Ok(l) => app.registry.restore_ledger(l),
            Err(e) => tracing::warn!(%e, "the checkpoint's ledger is unusable; starting it empty"),
        }
    }
    let stop_tx = Arc::new(stop_tx);
    let stopper = stop_tx.clone();
    let evaluator = tokio::spawn(app::evaluator(app.clone()));
    tokio::spawn(trim::task(app.limits.clone(), app.shutdown.clone()));
    let checkpointer = checkpoints.clone().map(|ck| {
        tokio::spawn(checkpoint::task(
            app.checkpoint_source(),
            ck,
            app.shutdown.clone(),
        ))
    });
    let router = http::router(app.clone());
    // Our own accept loop rather than `axum::serve`: it counts every TCP connection, per IP
    // too, bounds the header read and the TLS handshake (crate::net).
    let admin_stop = app.admin.stopped();
    let caps = net::Caps {
        limits: app.limits.clone(),
        connections: app.connections.clone(),
    };
    net::serve(listener, router, caps, tls, async move {
        tokio::select! {
            _ = shutdown => {}
            _ = admin_stop => {}
        }
        tracing::info!("shutting down: closing worker connections");
        let _ = stopper.send(true);
    })
    .await;
    let served = Ok(());
    // Axum's graceful shutdown does not wait for upgraded connections (axum #3003): do it here.
    app.tracker.close();
    // `ctl stop` does not wait for the connections (crate::coordinator::admin).
    let wait = match app.admin.stop_mode() {
        Some(admin::StopMode::Stop) => Duration::ZERO,
        _ => DRAIN,
    };
    let _ = tokio::time::timeout(wait, app.tracker.wait()).await;
    let _ = evaluator.await;
    if let Some(z) = zeno {
        let _ = tokio::task::spawn_blocking(move || z.join()).await;
    }
    if let Some(a) = anchor {
        let _ = tokio::task::spawn_blocking(move || a.join()).await;
    }
    // Every connection is done, so every acknowledged push is in the shards: the final
    // checkpoint holds them all. A failure here is the run's error (exit code 1).
    let mut served = served;
    if let Some(ck) = &checkpoints {
        if let Some(t) = checkpointer {
            let _ = t.await;
        }
        match ck.write(&app.checkpoint_source()).await {
            Ok(w) => {
                tracing::info!(checkpoint = %w.name, bytes = w.bytes, versions = ?w.versions, "final checkpoint written")
            }
            Err(e) => {
                tracing::error!(%e, "final checkpoint failed");
                served = Err(e);
            }
        }
    }
    // Updates are applied inside the connection tasks, so once those are done every in-flight
    // push has been applied or rejected.
    drop(app);
    drop(stop_tx);
    served
}

/// A server started in the background (for tests, benches and embedding).
#[derive(Debug)]
pub struct Running {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Whether it serves https/wss.
    pub tls: bool,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<()>>,
}

impl Running {
    /// The base URL, e.g. `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// Shuts the server down gracefully and waits for it.
    ///
    /// # Errors
    /// What [`run`] returned.
    pub async fn stop(mut self) -> Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        (&mut self.task)
            .await
            .unwrap_or_else(|e| Err(Error::Task(format!("server task: {e}"))))
    }
}

/// Binds `addr` and spawns [`run`] on the current runtime.
///
/// # Errors
/// When binding fails.
pub async fn start(addr: SocketAddr, cfg: ServeConfig, data: TrainTest) -> Result<Running> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| Error::io(format!("binding {addr}"), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::io("local address", e))?;
    let tls = cfg.tls.is_some();
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(run(listener, cfg, data, async move {
        let _ = rx.await;
    }));
    Ok(Running {
        addr,
        tls,
        stop: Some(stop),
        task,
    })
}
