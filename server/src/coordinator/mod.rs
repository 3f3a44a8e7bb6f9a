//! The coordinator: the `crowdgrad serve` process. It builds the run (model, initial
//! parameters, shards), holds the shared state ([`app::App`]), runs the evaluator and the
//! checkpoint writer, and serves the page, the HTTP API and the shard endpoints through the
//! hardened listener ([`crate::net`]).
//!
//! - [`run`] / [`start`]: the server (mini-redis' `server::run(listener, shutdown)`).
//! - [`app`]: the shared state, the side-car evaluator and `/api/status`.
//! - [`dashboard`]: the dashboard stream's tick, built once a second for every viewer.
//! - [`admin`]: the admin state (pause, drain, stop, live learning rate).
//! - [`http`]: the router, one file per endpoint group.
//! - [`remote`]: shards in other processes (`--shard-urls`).
//! - [`zeno`]: the validation-gradient thread of `--aggregation zeno`.
//! - [`anchor`]: the norm anchor thread (the server's own per-step gradient norms, issue 21).
//! - [`history`]: every experiment's evaluation history and the ring of the run's figures;
//!   [`experiments`]: the teacher's next experiment and the strip of guesses (issue 19).

pub mod admin;
pub mod anchor;
pub mod app;
pub mod dashboard;
pub mod evals;
pub mod experiments;
pub mod history;
pub mod http;
pub mod parts;
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
use crowdgrad_core::spec::{RunParams, RunSpec};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio_util::task::TaskTracker;

/// How long shutdown waits for open WebSocket connections to finish.
const DRAIN: Duration = Duration::from_secs(5);

/// Copies of the parameters a worker holds: the pulled ones, its own (local steps), the
/// gradient, the inner optimizer's two Adam moments, the push encoder's error feedback.
pub const WORKER_PARAM_COPIES: u128 = 6;

/// Most bytes a worker may need for a run's model: a wasm32 tab addresses 4 GiB at most,
/// and its page, bundle and buffers need some of it.
pub const MAX_WORKER_BYTES: u128 = 3 << 30;

/// About the bytes a worker needs to train `model` at `batch` (parameters and activations).
pub fn worker_memory(model: &Model, batch: usize) -> u128 {
    4 * (WORKER_PARAM_COPIES * model.param_len() as u128 + model.workspace_floats(batch, true))
}

/// Validation windows a language model's evaluator reads (about 33,000 tokens at T = 64).
pub const EVAL_WINDOWS: usize = 512;

/// `n` examples of `data` evenly spaced over it, in order.
fn spaced(data: &crowdgrad_core::data::Dataset, n: usize) -> Result<crowdgrad_core::data::Dataset> {
    let len = data.len();
    let picks: Vec<usize> = (0..n.min(len))
        .map(|k| k * len / n.min(len).max(1))
        .collect();
    let mut pixels = Vec::with_capacity(picks.len() * data.features);
    let mut labels = Vec::with_capacity(picks.len());
    for &i in &picks {
        pixels.extend_from_slice(data.pixels(i));
        labels.push(data.labels()[i]);
    }
    let mut dims = vec![picks.len()];
    dims.extend(&data.image_dims);
    Ok(crowdgrad_core::data::Dataset::from_arrays(
        crowdgrad_core::data::IdxArray { dims, data: pixels },
        crowdgrad_core::data::IdxArray {
            dims: vec![picks.len()],
            data: labels,
        },
    )?)
}

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
        dataset: data.info(cfg.dataset.clone()),
        local: cfg.training.exchange.local,
        normalize: data.normalize(&cfg.training.normalize)?,
    })?;
    // The evaluator sees the test set as the workers see their batches.
    let mut data = data;
    if spec.model.sequence().is_some() && data.test.len() > EVAL_WINDOWS {
        // A language model's evaluation is a forward pass per window: the evaluator reads a
        // fixed, evenly spaced sample of the validation windows.
        data.test = spaced(&data.test, EVAL_WINDOWS)?;
    }
    data.test.set_normalize(&spec.normalize)?;
    // The contribution ledger's file (crate::registry::ledger): opened first, so a corrupt
    // or foreign file stops the start before anything else happens (and is left untouched).
    let ledger_path = cfg.ledger_path();
    let (ledger, mut ledger_db) = registry::ledger::store::Store::open(ledger_path.as_deref())?;
    if ledger.is_temporary() {
        tracing::warn!(path = %ledger.path().display(), "ledger: no --ledger and no local --checkpoint-dir: contributions are kept in a temporary file, lost at exit");
    } else {
        tracing::info!(path = %ledger.path().display(), seq = ledger.seq(), "ledger opened");
    }
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
    let saved_history = restored.as_mut().and_then(|r| r.history.take());
    let model = Model::new(spec.model.clone())?;
    let worker_bytes = worker_memory(&model, spec.batch_size);
    if worker_bytes > MAX_WORKER_BYTES {
        return Err(Error::Config(format!(
            "model {}: a worker would need about {} MiB ({} parameters x {WORKER_PARAM_COPIES} \
             copies + {} MiB of activations at batch {}), more than the {} MiB a browser tab \
             (wasm32) can have; use a smaller model or --batch-size",
            spec.model,
            worker_bytes >> 20,
            model.param_len(),
            (4 * model.workspace_floats(spec.batch_size, true)) >> 20,
            spec.batch_size,
            MAX_WORKER_BYTES >> 20
        )));
    }
    tracing::info!(
        params = model.param_len(),
        worker_mib = (worker_bytes >> 20) as u64,
        "a worker needs about this much memory for the model"
    );
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
        )?
        .with_ema(cfg.training.ema);
        r.rewrite(&mut spec.shards);
        Some(Arc::new(r))
    };
    for (i, r) in ranges.iter().enumerate() {
        if remote.is_some() {
            break;
        }
        let setup = cfg.training.shard_setup(true, initial.len());
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
        h
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
        // The registry holds every join here: a credential expires with its session.
        s.credentials_expire_with_joins();
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
        let local = &spec.local;
        if local.steps.pseudo_gradients() && local.inner.rule.slots() > 0 {
            // Observable, not silent: the trade-off docs/defences.md states with its figures.
            // A warning for a language model, where it costs most.
            const WHY: &str = "spot checks are on, so every round's inner optimizer starts \
                afresh (its moments are not carried from round to round, so that a round can \
                be recomputed): at equal samples this cost the MLP 0.7 points of accuracy and \
                the default gpt at batch 4 12-15% of validation loss. On a crowd of trusted \
                machines --spot-check 0 keeps the moments (docs/defences.md, \"Spot checks \
                and the inner optimizer\")";
            let inner = local.inner.rule.name();
            if spec.model.sequence().is_some() {
                tracing::warn!(inner_optimizer = inner, "{WHY}");
            } else {
                tracing::info!(inner_optimizer = inner, "{WHY}");
            }
        }
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
                        (snap.version, snap.values, snap.samples)
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
    if let Some(spot) = &defence.spot {
        // Vouching and rollbacks reach the shards through these (crate::defence::spotcheck).
        spot.attach(shards.iter().map(crate::shard::Shard::control).collect());
    }
    let demo = Arc::new(crate::shard::demo::Demo::default());
    for s in &shards {
        s.set_demo(demo.clone());
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
        parts: Arc::new(parts::Parts::new(train.clone(), parts::CACHE_BYTES)),
        train,
        test: Arc::new(data.test),
        data_tag,
        evals: Mutex::new(Vec::new()),
        sample: Mutex::new(None),
        rate: Mutex::new(Vec::new()),
        started: Instant::now(),
        started_unix_ms: crate::coordinator::history::unix_ms(),
        shutdown: stop_rx,
        tracker: TaskTracker::new(),
        metrics: Default::default(),
        remote,
        checkpoints: checkpoints.clone(),
        admin,
        dashboard: Default::default(),
        experiments: Default::default(),
        figures: Default::default(),
        demo,
        guesses: Default::default(),
        quarantine_cache: Default::default(),
    });
    let first = experiments::first(&app, saved_history);
    *app.experiments.lock().unwrap_or_else(|p| p.into_inner()) = first;
    if let Some(r) = app.remote.clone() {
        let stop = app.shutdown.clone();
        let registry = app.registry.clone();
        let token = credential::coordinator_token(app.secret.as_bytes());
        tokio::spawn(async move { r.monitor(stop, registry, token).await });
    }
    if let Some(r) = &restored {
        resume_ledger(&mut ledger_db, ledger.seq(), r);
    }
    let ledger_writer = app.registry.start_ledger(&ledger, ledger_db)?;
    let stop_tx = Arc::new(stop_tx);
    let stopper = stop_tx.clone();
    let evaluator = tokio::spawn(app::evaluator(app.clone()));
    tokio::spawn(dashboard_task(app.clone()));
    tokio::spawn(figures_task(app.clone()));
    tokio::spawn(sweep_task(app.clone()));
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
    let caps = net::Caps::new(
        app.limits.clone(),
        app.connections.clone(),
        app.cfg.max_connections,
    );
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
    // The last credit goes to the ledger's file (after the final checkpoint, which records
    // the position it flushed to).
    let _ = tokio::task::spawn_blocking(move || ledger_writer.stop()).await;
    // Updates are applied inside the connection tasks, so once those are done every in-flight
    // push has been applied or rejected.
    drop(app);
    drop(stop_tx);
    served
}

/// The ledger on resume from checkpoint `r` (the ledger file, at `seq`, is the source of
/// truth: credit given after the checkpoint stays, though the parameters go back to it). A
/// checkpoint from before the ledger moved to SQLite carries the whole ledger as JSON: it is
/// imported once (identities the file already has keep their row). A ledger file behind the
/// checkpoint's position (replaced, or restored from an older backup) is used with a warning.
fn resume_ledger(db: &mut registry::ledger::db::Db, seq: u64, r: &checkpoint::Restored) {
    if r.ledger.get("contributors").is_some() {
        let name = format!("{}/{}", r.run_id, r.name);
        match registry::ledger::import_json(&r.ledger).and_then(|rows| db.import(&name, &rows)) {
            Ok(Some(n)) => {
                tracing::info!(checkpoint = %r.name, identities = n, "ledger: imported the checkpoint's JSON ledger")
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(%e, "the checkpoint's ledger could not be imported"),
        }
    } else if let Some(saved) = r.ledger.get("seq").and_then(|s| s.as_u64()) {
        if saved > seq {
            tracing::warn!(
                checkpoint = %r.name,
                checkpoint_seq = saved,
                ledger_seq = seq,
                path = %db.path().display(),
                "ledger: the file is behind the checkpoint (replaced, or an older backup?): credit between is missing"
            );
        }
    }
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

/// Every [`history::FIGURE_EVERY_S`] seconds until shutdown, one point of the run's figures
/// ([`history::Figures`]), from the counters the registry and the limits already keep.
/// Forgets idle workers every [`registry::SWEEP_EVERY`] ([`registry::Registry::forget_idle`]),
/// until shutdown.
async fn sweep_task(app: Arc<App>) {
    let mut shutdown = app.shutdown.clone();
    let mut every = tokio::time::interval(registry::SWEEP_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = every.tick() => {}
        }
        let ids = app.registry.forget_idle();
        app.defence.reputation.forget(&ids);
        let forgotten = ids.len();
        if forgotten > 0 {
            tracing::info!(forgotten, "forgot workers gone for 10 minutes");
        }
        // The records, reputations, ledger seats and tallies of a crowd that left are freed
        // here, ten minutes after their sockets closed, when the connection count no longer
        // moves: the trim task never sees it (crate::support::trim). Give the pages back now.
        if forgotten >= trim::FALL as usize {
            match tokio::task::spawn_blocking(trim::trim_now).await {
                Ok(t) => tracing::info!(
                    forgotten,
                    rss_before_mib = t.rss_before_mib,
                    rss_after_mib = t.rss_after_mib,
                    "gave the forgotten workers' memory back to the OS"
                ),
                Err(e) => tracing::warn!(%e, "malloc_trim task failed"),
            }
        }
    }
}

async fn figures_task(app: Arc<App>) {
    let mut shutdown = app.shutdown.clone();
    let mut every = tokio::time::interval(Duration::from_secs(history::FIGURE_EVERY_S));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = every.tick() => {}
        }
        let totals = app.figure_totals();
        let connected = app.registry.summary().1.workers.map_or(0, |w| w.connected);
        if let Some(e) = app
            .experiments
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .current_mut()
        {
            e.workers_seen = e.workers_seen.max(connected);
        }
        app.figures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .observe(totals);
    }
}

/// Builds a dashboard tick every [`dashboard::TICK`] until shutdown (the first at once) and
/// hands it to every viewer ([`dashboard::Dashboard::publish`]).
async fn dashboard_task(app: Arc<App>) {
    let mut shutdown = app.shutdown.clone();
    let mut every = tokio::time::interval(dashboard::TICK);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut seq = 0u64;
    let mut last_eval = f64::NEG_INFINITY;
    loop {
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = every.tick() => {}
        }
        seq += 1;
        let (body, newest) = app.tick_body(seq, last_eval);
        last_eval = newest;
        let tick_json = serde_json::to_string(&body).unwrap_or_default();
        let history = app.evals.lock().unwrap_or_else(|p| p.into_inner()).clone();
        app.dashboard.publish(dashboard::Tick::new(
            seq,
            tick_json,
            app.run_description(),
            history,
        ));
    }
}
