//! Checkpoints: what a restarted server continues from (docs/checkpoints.md).
//!
//! - [`format`]: the safetensors file (named tensors of the full model, optimizer slots, run
//!   metadata and a checksum) and the export format.
//! - [`store`]: where they live (`object_store`: a directory or `s3://bucket/prefix`), written
//!   atomically.
//! - [`Checkpointer`]: takes a checkpoint of a running server (each shard briefly under its
//!   lock: the values' `Arc` and a copy of the optimizer state; encoding and writing happen off
//!   the reactor), keeps the last N, remembers the last one written.
//! - [`resume`]: at start, finds the newest valid checkpoint (a truncated or corrupt one is
//!   skipped with a warning), refuses one of another model, optimizer or shard layout with an
//!   error naming the difference (unless `--reshard`), and hands back the shards' state.
//! - [`task`]: the periodic writer (`--checkpoint-every`); the final checkpoint on shutdown is
//!   written by [`crate::run`] once every connection has finished.

pub mod format;
pub mod store;

use crate::error::{Error, Result};
use crate::registry::metrics::Metrics;
use crate::registry::Registry;
use crate::shard::Shard;
use bytes::Bytes;
use crowdgrad_core::shard::ShardExport;
use crowdgrad_core::spec::RunSpec;
use format::Checkpoint;
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use store::{Entry, Store};

pub use crate::config::checkpoint::CheckpointConfig;

/// A checkpoint that was written.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Written {
    /// Object name.
    pub name: String,
    /// Sequence number.
    pub seq: u64,
    /// Size in bytes.
    pub bytes: u64,
    /// The shards' versions in it.
    pub versions: Vec<u64>,
    /// When it was taken, milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// Seconds from snapshot to durable.
    pub write_seconds: f64,
    /// Seconds the shards were locked for the snapshot (all shards together).
    pub lock_seconds: f64,
}

/// What [`resume`] found.
#[derive(Debug)]
pub struct Restored {
    /// The checkpoint's object name.
    pub name: String,
    /// The run id to keep (workers see the same run).
    pub run_id: String,
    /// One export per shard of the server's (possibly new) layout.
    pub exports: Vec<ShardExport>,
    /// The shards' versions as saved.
    pub versions: Vec<u64>,
    /// The ledger as saved: `{"seq": N}`, the ledger's position when it was taken, or (a
    /// checkpoint written before the ledger moved to SQLite) `{"contributors": [...]}`.
    pub ledger: serde_json::Value,
    /// What the writer's [`Source::history`] saved (absent in older checkpoints).
    pub history: Option<serde_json::Value>,
}

/// Writes checkpoints of one server.
#[derive(Debug)]
pub struct Checkpointer {
    store: Store,
    cfg: CheckpointConfig,
    next_seq: AtomicU64,
    writing: tokio::sync::Mutex<()>,
    last: Mutex<Option<Written>>,
}

impl Checkpointer {
    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The policy.
    pub fn config(&self) -> &CheckpointConfig {
        &self.cfg
    }

    /// The last checkpoint written by this process.
    pub fn last(&self) -> Option<Written> {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Takes and writes a checkpoint of `run` now (one at a time), then deletes all but the
    /// newest [`CheckpointConfig::keep`].
    ///
    /// # Errors
    /// When encoding or writing fails; the previous checkpoints are untouched.
    pub async fn write(&self, run: &Source) -> Result<Written> {
        let _one = self.writing.lock().await;
        let started = Instant::now();
        let exports: Vec<ShardExport> = run.shards.iter().map(|s| s.export()).collect();
        let lock_seconds = started.elapsed().as_secs_f64();
        let spec = run.spec.clone();
        // The ledger's position, not its contents (the ledger file is the source of truth,
        // crate::registry::ledger): flushed first, so it covers the credit up to now.
        let ledger = match run.registry.ledger() {
            Some(store) => {
                let s = store.clone();
                let _ = tokio::task::spawn_blocking(move || s.flush()).await;
                serde_json::json!({ "seq": store.seq() })
            }
            None => serde_json::Value::Null,
        };
        let history = run.history.as_ref().map(|h| (h.0)());
        let (bytes, versions, created_unix_ms) = tokio::task::spawn_blocking(move || {
            let mut c = Checkpoint::assemble(spec, &exports, ledger)?;
            c.history = history;
            Ok::<_, Error>((c.encode()?, c.versions(), c.created_unix_ms))
        })
        .await
        .map_err(|e| Error::Task(format!("checkpoint encoder: {e}")))??;
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let name = store::name(seq);
        let size = bytes.len() as u64;
        self.store.put(&name, Bytes::from(bytes)).await?;
        let written = Written {
            name,
            seq,
            bytes: size,
            versions,
            created_unix_ms,
            write_seconds: started.elapsed().as_secs_f64(),
            lock_seconds,
        };
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(written.clone());
        run.metrics
            .checkpoint_written(size, created_unix_ms as f64 / 1000.0);
        self.prune().await;
        Ok(written)
    }

    async fn prune(&self) {
        let Ok(entries) = self.store.list().await else {
            return;
        };
        let excess = entries.len().saturating_sub(self.cfg.keep);
        for e in &entries[..excess] {
            if let Err(err) = self.store.delete(&e.name).await {
                tracing::warn!(checkpoint = %e.name, %err, "could not delete an old checkpoint");
            }
        }
    }
}

/// Most bytes the header of a checkpoint may have (safetensors' own limit).
const MAX_HEADER: u64 = 100_000_000;

/// Reads just the run spec out of a checkpoint's header (to name a model mismatch before
/// reading the whole file).
async fn read_spec(store: &Store, e: &Entry) -> Result<RunSpec> {
    let head = store.get_range(&e.name, 0..8).await?;
    let n = u64::from_le_bytes(
        head[..]
            .try_into()
            .map_err(|_| Error::Checkpoint("shorter than 8 bytes".into()))?,
    );
    if n > MAX_HEADER || 8 + n > e.size {
        return Err(Error::Checkpoint(format!(
            "header of {n} bytes does not fit the {} byte file (truncated?)",
            e.size
        )));
    }
    let header = store.get_range(&e.name, 8..8 + n).await?;
    let v: serde_json::Value = serde_json::from_slice(&header)
        .map_err(|err| Error::Checkpoint(format!("unreadable header: {err}")))?;
    let run = v["__metadata__"]["run"]
        .as_str()
        .ok_or_else(|| Error::Checkpoint("header has no run spec".into()))?;
    serde_json::from_str(run).map_err(|err| Error::Checkpoint(format!("bad run spec: {err}")))
}

/// Whether a checkpoint of `saved` can continue as `now`: the same model, dataset shape and
/// optimizer rule, and the same shard layout unless `reshard`. Returns the other differences
/// (learning rate, batch size, consistency...), which the command line decides.
///
/// # Errors
/// [`Error::Checkpoint`] naming the difference.
pub fn check_compatible(
    name: &str,
    saved: &RunSpec,
    now: &RunSpec,
    reshard: bool,
) -> Result<Vec<String>> {
    let refuse = |m: String| {
        Err(Error::Checkpoint(format!(
            "{name} cannot be resumed: {m} (start with a new --checkpoint-dir to begin a new run)"
        )))
    };
    if saved.model != now.model {
        return refuse(format!(
            "it holds model {} ({} parameters), this server is configured for {} ({})",
            saved.model,
            saved.model.param_len(),
            now.model,
            now.model.param_len()
        ));
    }
    if saved.dataset.image_dims != now.dataset.image_dims
        || saved.dataset.classes != now.dataset.classes
    {
        return refuse(format!(
            "it was trained on {} ({:?}, {} classes), this server has {} ({:?}, {} classes)",
            saved.dataset.name,
            saved.dataset.image_dims,
            saved.dataset.classes,
            now.dataset.name,
            now.dataset.image_dims,
            now.dataset.classes
        ));
    }
    if saved.optimizer.rule.name() != now.optimizer.rule.name() {
        return refuse(format!(
            "it holds {} optimizer state, this server is configured for --optimizer {}",
            saved.optimizer.rule.name(),
            now.optimizer.rule.name()
        ));
    }
    let (a, b) = (saved.ranges(), now.ranges());
    if a != b && !reshard {
        let show = |r: &[crowdgrad_core::partition::KeyRange]| {
            r.iter()
                .map(|r| format!("[{}, {})", r.start, r.end))
                .collect::<Vec<_>>()
                .join(" ")
        };
        return Err(Error::Checkpoint(format!(
            "{name} has {} shards ({}), this server is configured for {} ({}): start with \
             --shards {}, or add --reshard to re-cut the checkpoint onto {} shards",
            a.len(),
            show(&a),
            b.len(),
            show(&b),
            a.len(),
            b.len()
        )));
    }
    let mut diffs = Vec::new();
    if a != b {
        diffs.push(format!("re-cut from {} onto {} shards", a.len(), b.len()));
    }
    if saved.optimizer != now.optimizer {
        diffs.push(format!(
            "optimizer settings {:?} -> {:?}",
            saved.optimizer, now.optimizer
        ));
    }
    if saved.batch_size != now.batch_size {
        diffs.push(format!(
            "batch size {} -> {}",
            saved.batch_size, now.batch_size
        ));
    }
    if saved.consistency != now.consistency {
        diffs.push(format!(
            "consistency {} -> {}",
            saved.consistency, now.consistency
        ));
    }
    if saved.seed != now.seed {
        diffs.push(format!("seed {} -> {}", saved.seed, now.seed));
    }
    Ok(diffs)
}

/// Opens the store of `cfg` and finds the newest valid checkpoint for `spec`.
///
/// Checkpoints are tried newest first. One that cannot be read or does not pass its checks
/// (size, checksum, tensors) is skipped with a warning. One that is valid but of another
/// model, dataset shape, optimizer or (without `reshard`) shard layout stops the start with an
/// error naming the difference: silently starting over would throw the run away.
///
/// # Errors
/// The store cannot be opened or listed, or the newest valid checkpoint is incompatible.
pub async fn resume(
    cfg: &CheckpointConfig,
    spec: &RunSpec,
) -> Result<(Checkpointer, Option<Restored>)> {
    let store = Store::open(&cfg.location)?;
    store.remove_temporaries();
    let entries = store.list().await?;
    let next = entries.last().map_or(1, |e| e.seq + 1);
    let ck = Checkpointer {
        store,
        cfg: cfg.clone(),
        next_seq: AtomicU64::new(next),
        writing: tokio::sync::Mutex::new(()),
        last: Mutex::new(None),
    };
    for e in entries.iter().rev() {
        match load(&ck.store, e, spec, cfg.reshard).await {
            Ok(Some(r)) => return Ok((ck, Some(r))),
            Ok(None) => continue,
            Err(err) => return Err(err),
        }
    }
    if !entries.is_empty() {
        tracing::warn!(
            location = ck.store.location(),
            "no valid checkpoint found; starting a new run"
        );
    }
    Ok((ck, None))
}

/// `Ok(None)`: skip this one (warned); `Err`: refuse to start.
async fn load(store: &Store, e: &Entry, spec: &RunSpec, reshard: bool) -> Result<Option<Restored>> {
    let skip = |err: Error| {
        tracing::warn!(checkpoint = %e.name, bytes = e.size, %err, "skipping an unusable checkpoint; trying the previous one");
        Ok(None)
    };
    let saved = match read_spec(store, e).await {
        Ok(s) => s,
        Err(err) => return skip(err),
    };
    let diffs = check_compatible(&e.name, &saved, spec, reshard)?;
    let n = spec.model.param_len() as u64;
    // Values, optimizer slots and maybe a moving average (`--ema`).
    let limit = MAX_HEADER + 4 * n * (2 + spec.optimizer.rule.slots() as u64) + 8;
    let bytes = match store.get(&e.name, limit).await {
        Ok(b) => b,
        Err(err) => return skip(err),
    };
    let decoded = tokio::task::spawn_blocking(move || Checkpoint::decode(&bytes))
        .await
        .map_err(|err| Error::Task(format!("checkpoint decoder: {err}")))?;
    let c = match decoded {
        Ok(c) => c,
        Err(err) => return skip(err),
    };
    // The header read first and the checked file agree (or the file changed under us).
    if c.spec != saved {
        return skip(Error::Checkpoint("changed while being read".into()));
    }
    for d in &diffs {
        tracing::warn!(checkpoint = %e.name, "resuming with a change: {d}");
    }
    let exports = c.exports_for(&spec.ranges());
    tracing::info!(checkpoint = %e.name, versions = ?c.versions(), run_id = %c.spec.run_id, "resuming from checkpoint");
    Ok(Some(Restored {
        name: e.name.clone(),
        run_id: c.spec.run_id.clone(),
        versions: c.versions(),
        exports,
        ledger: c.ledger,
        history: c.history,
    }))
}

/// What the coordinator keeps in a checkpoint besides the model, read when one is taken
/// (issue 19: the evaluation history): a function, so this module names nothing of the
/// coordinator's state.
#[derive(Clone)]
pub struct History(pub Arc<dyn Fn() -> serde_json::Value + Send + Sync>);

impl std::fmt::Debug for History {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("History(..)")
    }
}

/// What a checkpoint is taken of: the shards, the run they belong to, the registry whose
/// ledger goes along, and the metrics that report the write. Cheap handles, built once.
#[derive(Debug, Clone)]
pub struct Source {
    /// Every shard of the run, in order.
    pub shards: Vec<Shard>,
    /// The run.
    pub spec: RunSpec,
    /// Its registry (for the contribution ledger).
    pub registry: Registry,
    /// Where the last checkpoint's size and time are reported.
    pub metrics: Arc<Metrics>,
    /// What else the checkpoint keeps ([`Checkpoint::history`]), if anything.
    pub history: Option<History>,
}

/// The periodic writer: every [`CheckpointConfig::every`], a checkpoint if any shard moved
/// since the last one. Returns on shutdown (the final checkpoint is the coordinator's).
pub async fn task(
    app: Source,
    ck: Arc<Checkpointer>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let every = ck.cfg.every;
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last: Option<Vec<u64>> = None;
    loop {
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = tick.tick() => {
                let versions: Vec<u64> = app.shards.iter().map(|s| s.version()).collect();
                if last.as_ref() == Some(&versions) {
                    continue;
                }
                match ck.write(&app).await {
                    Ok(w) => {
                        tracing::info!(checkpoint = %w.name, bytes = w.bytes, seconds = w.write_seconds, versions = ?w.versions, "checkpoint written");
                        last = Some(w.versions);
                    }
                    Err(err) => tracing::error!(%err, "checkpoint failed; the previous ones are kept"),
                }
            }
        }
    }
}

/// What `crowdgrad export` wrote.
#[derive(Debug, Clone, Serialize)]
pub struct Exported {
    /// Where from: a checkpoint name or a server URL.
    pub source: String,
    /// The model, e.g. `mlp 784-128-10`.
    pub model: String,
    /// Parameters.
    pub params: usize,
    /// The shards' versions.
    pub versions: Vec<u64>,
    /// Bytes written.
    pub bytes: u64,
    /// Which weights ([`format::Weights::name`]).
    pub weights: &'static str,
}

/// Writes `bytes` to `out` atomically (temporary name in the same directory, fsync, rename).
fn write_out(out: &std::path::Path, bytes: &[u8]) -> Result<()> {
    let dir = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let name = out
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| Error::Config(format!("--out {}: not a file name", out.display())))?;
    store::write_atomic(&dir, name, bytes)
}

/// `crowdgrad export --checkpoint-dir D --out F`: the model of the newest valid checkpoint in
/// `location` as a safetensors file of named tensors ([`format::encode_model`]): its moving
/// average when it keeps one (`--ema`, what the server evaluated and exported) unless `live`,
/// else the live weights.
///
/// # Errors
/// No valid checkpoint, or the output cannot be written.
pub async fn export_checkpoint(
    location: &str,
    out: &std::path::Path,
    live: bool,
) -> Result<Exported> {
    let store = Store::open(location)?;
    let entries = store.list().await?;
    for e in entries.iter().rev() {
        // A checkpoint is at most its header limit plus 3 f32 tensors per parameter of a model
        // of 2^31 parameters; the decode checks the rest.
        let bytes = match store.get(&e.name, MAX_HEADER + 24 * (1u64 << 31)).await {
            Ok(b) => b,
            Err(err) => {
                tracing::warn!(checkpoint = %e.name, %err, "skipping");
                continue;
            }
        };
        let decoded = tokio::task::spawn_blocking(move || {
            let c = Checkpoint::decode(&bytes)?;
            let (values, weights) = match &c.average {
                Some(avg) if !live => (avg, format::Weights::Average),
                _ => (&c.values, format::Weights::Live),
            };
            let model = format::encode_model(&c.spec, values, &c.versions(), weights)?;
            Ok::<_, Error>((c, model, weights))
        })
        .await
        .map_err(|err| Error::Task(format!("export: {err}")))?;
        let (c, model, weights) = match decoded {
            Ok(x) => x,
            Err(err) => {
                tracing::warn!(checkpoint = %e.name, %err, "skipping an unusable checkpoint");
                continue;
            }
        };
        write_out(out, &model)?;
        return Ok(Exported {
            source: format!("{}/{}", store.location(), e.name),
            model: c.spec.model.to_string(),
            params: c.values.len(),
            versions: c.versions(),
            bytes: model.len() as u64,
            weights: weights.name(),
        });
    }
    Err(Error::Checkpoint(format!(
        "no valid checkpoint in {location} ({} found)",
        entries.len()
    )))
}

/// `crowdgrad export --server URL --out F`: the model of a running server
/// (`GET /api/params?format=safetensors`): what it evaluates (with `--ema` the moving average)
/// unless `live`, else the weights the workers train (`&weights=live`).
///
/// # Errors
/// The server cannot be reached or answers with an error, or the file cannot be written.
pub async fn export_server(server: &str, out: &std::path::Path, live: bool) -> Result<Exported> {
    let url = format!(
        "{}/api/params?format=safetensors{}",
        server.trim_end_matches('/'),
        if live { "&weights=live" } else { "" }
    );
    let u = url.clone();
    let bytes = tokio::task::spawn_blocking(move || -> Result<Vec<u8>> {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(120)))
            .build()
            .into();
        let mut r = agent
            .get(&u)
            .call()
            .map_err(|e| Error::Http(format!("{u}: {e}")))?;
        r.body_mut()
            .with_config()
            .limit(24 * (1u64 << 31))
            .read_to_vec()
            .map_err(|e| Error::Http(format!("{u}: {e}")))
    })
    .await
    .map_err(|e| Error::Task(format!("export download: {e}")))??;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)
        .map_err(|e| Error::Checkpoint(format!("{url} did not send a safetensors file: {e}")))?;
    let m = meta.metadata().clone().unwrap_or_default();
    let spec: RunSpec = m
        .get("run")
        .and_then(|r| serde_json::from_str(r).ok())
        .ok_or_else(|| Error::Checkpoint(format!("{url}: no run spec in the file")))?;
    let versions: Vec<u64> = m
        .get("versions")
        .and_then(|v| serde_json::from_str(v).ok())
        .unwrap_or_default();
    write_out(out, &bytes)?;
    Ok(Exported {
        source: url,
        model: spec.model.to_string(),
        params: spec.model.param_len(),
        versions,
        bytes: bytes.len() as u64,
        // As the server says; one from before the metadata existed sent live weights.
        weights: if m.get("weights").map(String::as_str) == Some(format::Weights::Average.name()) {
            format::Weights::Average.name()
        } else {
            format::Weights::Live.name()
        },
    })
}
