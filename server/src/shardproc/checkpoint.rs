//! A shard process's own checkpoints (`crowdgrad shard --checkpoint-dir D`): how a shard that
//! died comes back where it was without a coordinator restart (docs/checkpoints.md, "Shard
//! processes").
//!
//! Who writes what: with `serve --shard-urls` the parameters live in the shard processes, so
//! each writes its own shard: `D/shard-{index}/ckpt-{seq:012}.safetensors` (a directory or
//! `s3://bucket/prefix`, through the same [`Store`] as the coordinator's checkpoints, written
//! atomically, the newest `--checkpoint-keep` kept). One file holds one shard:
//! - tensors `values` `[len]` and one tensor per optimizer slot, named as the slot
//!   (`adagrad_acc`, [`crowdgrad_core::optim::Rule::slot_names`]), and with `--ema` its moving
//!   average `ema`, all F32, of the shard's range;
//! - metadata `format` = `crowdgrad-shard-checkpoint`, `format_version` = `1`, `run` (the run
//!   spec JSON the process derived from its flags), `shard` (JSON [`ShardMeta`]: index, range,
//!   version, optimizer update count, `scale` statistics), `created_unix_ms` and `checksum`
//!   (`sha256:` over the tensors sorted by name: name, 0, data; then the other metadata sorted
//!   by key: key, 0, value, 0: the coordinator's rule, [`crate::checkpoint::format`]).
//!
//! At start [`resume`] tries them newest first: a truncated or corrupt one is skipped with a
//! warning, one of another model, optimizer rule, shard layout or index stops the start with
//! an error naming the difference ([`crate::checkpoint::check_compatible`]).

use crate::checkpoint::format::{bad, checksum, le_bytes, open, EmaMeta, ShardMeta, AVERAGE, F32};
use crate::checkpoint::store::{self, Entry, Store};
use crate::error::{Error, Result};
use crate::shard::Shard;
use bytes::Bytes;
use crowdgrad_core::optim::OptState;
use crowdgrad_core::partition::KeyRange;
use crowdgrad_core::shard::ShardExport;
use crowdgrad_core::spec::RunSpec;
use safetensors::tensor::Dtype;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `format` of a shard checkpoint.
pub const FORMAT: &str = "crowdgrad-shard-checkpoint";
/// `format_version` this build writes and reads.
pub const FORMAT_VERSION: &str = "1";
/// Most bytes of a checkpoint header this reader accepts.
const MAX_HEADER: u64 = 100_000_000;

/// Where and how often a shard process checkpoints.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardCheckpointConfig {
    /// The run's checkpoint location (the shard writes under `shard-{index}` in it).
    pub location: String,
    /// Time between checkpoints.
    pub every: Duration,
    /// Checkpoints kept.
    pub keep: usize,
}

/// The location of shard `index`'s checkpoints in `location`.
pub fn shard_location(location: &str, index: usize) -> String {
    format!("{}/shard-{index}", location.trim_end_matches('/'))
}

/// A shard's checkpoint, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardCheckpoint {
    /// The run as the shard process derived it.
    pub spec: RunSpec,
    /// The shard.
    pub meta: ShardMeta,
    /// Its values.
    pub values: Vec<f32>,
    /// Its optimizer slots, in slot order.
    pub slots: Vec<Vec<f32>>,
    /// `--ema`: its moving average (tensor `ema`), when it keeps one.
    pub average: Option<Vec<f32>>,
    /// When it was taken, ms since the Unix epoch.
    pub created_unix_ms: u64,
}

fn json<T: serde::Serialize>(v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| bad(format!("encoding metadata: {e}")))
}

impl ShardCheckpoint {
    /// The checkpoint of shard `index` of `spec` from its export.
    ///
    /// # Errors
    /// When the export does not fit the shard's range or the optimizer rule.
    pub fn of(spec: RunSpec, index: usize, e: &ShardExport) -> Result<Self> {
        let range = *spec
            .ranges()
            .get(index)
            .ok_or_else(|| bad(format!("no shard {index} in the run")))?;
        let rule = spec.optimizer.rule;
        let slots: Vec<Vec<f32>> = e.state.slots(&rule).iter().map(|s| s.to_vec()).collect();
        let average = e.average.as_ref().map(|a| a.values.to_vec());
        if e.values.len() != range.len()
            || slots.iter().chain(&average).any(|s| s.len() != range.len())
        {
            return Err(bad(format!(
                "shard {index} exported {} values for a range of {}",
                e.values.len(),
                range.len()
            )));
        }
        Ok(Self {
            meta: ShardMeta {
                id: index as u32,
                range,
                version: e.version,
                opt_t: e.state.t,
                inv_staleness_mean: e.inv_staleness_mean,
                scaled_pushes: e.scaled_pushes,
                samples: e.samples,
                ema: EmaMeta::of(e),
            },
            values: e.values.to_vec(),
            slots,
            average,
            spec,
            created_unix_ms: (crate::registry::metrics::unix_now() * 1000.0) as u64,
        })
    }

    /// The shard's state as [`Shard::restore`] takes it.
    pub fn export(&self) -> ShardExport {
        let mut it = self.slots.iter().cloned();
        ShardExport {
            version: self.meta.version,
            values: Arc::new(self.values.clone()),
            state: OptState {
                slot0: it.next().unwrap_or_default(),
                slot1: it.next().unwrap_or_default(),
                t: self.meta.opt_t,
            },
            inv_staleness_mean: self.meta.inv_staleness_mean,
            scaled_pushes: self.meta.scaled_pushes,
            samples: self.meta.samples,
            average: self
                .meta
                .ema
                .zip(self.average.clone())
                .map(|(ema, values)| ema.export(values)),
        }
    }

    /// The safetensors bytes.
    ///
    /// # Errors
    /// When the slots do not match the rule or serialising fails.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let names = self.spec.optimizer.rule.slot_names();
        if names.len() != self.slots.len() {
            return Err(bad("optimizer slots do not match the rule"));
        }
        let mut meta: HashMap<String, String> = [
            ("format", FORMAT.to_string()),
            ("format_version", FORMAT_VERSION.to_string()),
            ("run", json(&self.spec)?),
            ("shard", json(&self.meta)?),
            ("created_unix_ms", self.created_unix_ms.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let n = self.values.len();
        let mut named = vec![(
            "values".to_string(),
            F32 {
                shape: vec![n],
                data: le_bytes(&self.values),
            },
        )];
        let average = self.average.iter().map(|a| (&AVERAGE, a));
        for (name, s) in names.iter().zip(&self.slots).chain(average) {
            named.push((
                name.to_string(),
                F32 {
                    shape: vec![n],
                    data: le_bytes(s),
                },
            ));
        }
        let sum = checksum(named.iter().map(|(n, t)| (n.as_str(), &*t.data)), &meta);
        meta.insert("checksum".into(), sum);
        safetensors::serialize(named, Some(meta)).map_err(|e| bad(format!("serialising: {e}")))
    }

    /// Parses and checks a shard checkpoint: size, format, checksum, the tensors of its range
    /// and optimizer, nothing else.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] saying what is wrong.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let (tensors, meta, spec) = open(bytes, FORMAT, FORMAT_VERSION)?;
        let get = |k: &str| {
            meta.get(k)
                .ok_or_else(|| bad(format!("metadata has no {k:?}")))
        };
        let shard: ShardMeta =
            serde_json::from_str(get("shard")?).map_err(|e| bad(format!("bad shard: {e}")))?;
        if spec.ranges().get(shard.id as usize) != Some(&shard.range) {
            return Err(bad("the shard's range is not the run's"));
        }
        let created_unix_ms = get("created_unix_ms")?
            .parse()
            .map_err(|_| bad("bad created_unix_ms"))?;
        let names = spec.optimizer.rule.slot_names();
        if let Some(ema) = shard.ema {
            ema.check()?;
        }
        let keeps_average = shard.ema.is_some();
        let expected = 1 + names.len() + usize::from(keeps_average);
        if tensors.len() != expected {
            return Err(bad(format!(
                "{} tensors, the run's optimizer{} needs {expected}",
                tensors.len(),
                if keeps_average {
                    " with the moving average"
                } else {
                    ""
                }
            )));
        }
        let by_name: HashMap<&str, _> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let n = shard.range.len();
        let flat = |name: &str| -> Result<Vec<f32>> {
            let t = by_name
                .get(name)
                .ok_or_else(|| bad(format!("tensor {name} is missing")))?;
            if t.dtype() != Dtype::F32 || t.shape() != [n] {
                return Err(bad(format!(
                    "tensor {name} is {:?} {:?}, expected F32 [{n}]",
                    t.dtype(),
                    t.shape()
                )));
            }
            Ok(t.data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect())
        };
        let values = flat("values")?;
        let slots = names.iter().map(|s| flat(s)).collect::<Result<Vec<_>>>()?;
        let average = if keeps_average {
            Some(flat(AVERAGE)?)
        } else {
            None
        };
        Ok(Self {
            spec,
            meta: shard,
            values,
            slots,
            average,
            created_unix_ms,
        })
    }
}

/// A checkpoint a shard process wrote.
#[derive(Debug, Clone, serde::Serialize, PartialEq)]
pub struct Written {
    /// Object name.
    pub name: String,
    /// Size in bytes.
    pub bytes: u64,
    /// The shard's version in it.
    pub version: u64,
    /// Seconds from the snapshot to durable.
    pub write_seconds: f64,
    /// Seconds the shard was locked for the snapshot.
    pub lock_seconds: f64,
}

/// Writes one shard's checkpoints.
#[derive(Debug)]
pub struct ShardCheckpointer {
    store: Store,
    cfg: ShardCheckpointConfig,
    spec: RunSpec,
    index: usize,
    next_seq: AtomicU64,
    writing: tokio::sync::Mutex<()>,
}

impl ShardCheckpointer {
    /// The store (`D/shard-{index}`).
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Takes and writes a checkpoint of `shard` now (one at a time), then keeps the newest
    /// [`ShardCheckpointConfig::keep`].
    ///
    /// # Errors
    /// Encoding or writing fails; the previous checkpoints are untouched.
    pub async fn write(&self, shard: &Shard) -> Result<Written> {
        let _one = self.writing.lock().await;
        let started = Instant::now();
        let export = shard.export();
        let lock_seconds = started.elapsed().as_secs_f64();
        let (spec, index) = (self.spec.clone(), self.index);
        let (bytes, version) = tokio::task::spawn_blocking(move || {
            let c = ShardCheckpoint::of(spec, index, &export)?;
            Ok::<_, Error>((c.encode()?, c.meta.version))
        })
        .await
        .map_err(|e| Error::Task(format!("shard checkpoint encoder: {e}")))??;
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let name = store::name(seq);
        let size = bytes.len() as u64;
        self.store.put(&name, Bytes::from(bytes)).await?;
        if let Ok(entries) = self.store.list().await {
            let excess = entries.len().saturating_sub(self.cfg.keep);
            for e in &entries[..excess] {
                if let Err(err) = self.store.delete(&e.name).await {
                    tracing::warn!(checkpoint = %e.name, %err, "could not delete an old checkpoint");
                }
            }
        }
        Ok(Written {
            name,
            bytes: size,
            version,
            write_seconds: started.elapsed().as_secs_f64(),
            lock_seconds,
        })
    }
}

/// Opens shard `index`'s store in `cfg` and finds its newest valid checkpoint for `spec`.
///
/// # Errors
/// The store cannot be opened or listed, or the newest valid checkpoint belongs to another
/// model, optimizer rule, shard layout or shard index.
pub async fn resume(
    cfg: &ShardCheckpointConfig,
    spec: &RunSpec,
    index: usize,
) -> Result<(ShardCheckpointer, Option<(String, ShardCheckpoint)>)> {
    let store = Store::open(&shard_location(&cfg.location, index))?;
    store.remove_temporaries();
    let entries = store.list().await?;
    let ck = ShardCheckpointer {
        next_seq: AtomicU64::new(entries.last().map_or(1, |e| e.seq + 1)),
        store,
        cfg: cfg.clone(),
        spec: spec.clone(),
        index,
        writing: tokio::sync::Mutex::new(()),
    };
    for e in entries.iter().rev() {
        if let Some(c) = load(&ck.store, e, spec, index).await? {
            return Ok((ck, Some((e.name.clone(), c))));
        }
    }
    if !entries.is_empty() {
        tracing::warn!(
            location = ck.store.location(),
            "no valid shard checkpoint found; starting from the initial weights"
        );
    }
    Ok((ck, None))
}

/// `Ok(None)`: unusable, skipped (warned); `Err`: refuse to start.
async fn load(
    store: &Store,
    e: &Entry,
    spec: &RunSpec,
    index: usize,
) -> Result<Option<ShardCheckpoint>> {
    let range: KeyRange = spec.ranges()[index];
    // Values, optimizer slots and maybe a moving average (`--ema`).
    let slots = 2 + spec.optimizer.rule.slots() as u64;
    let limit = MAX_HEADER + 4 * range.len() as u64 * slots;
    let bytes = match store.get(&e.name, limit).await {
        Ok(b) => b,
        Err(err) => {
            tracing::warn!(checkpoint = %e.name, %err, "skipping an unreadable shard checkpoint");
            return Ok(None);
        }
    };
    let decoded = tokio::task::spawn_blocking(move || ShardCheckpoint::decode(&bytes))
        .await
        .map_err(|err| Error::Task(format!("shard checkpoint decoder: {err}")))?;
    let c = match decoded {
        Ok(c) => c,
        Err(err) => {
            tracing::warn!(checkpoint = %e.name, bytes = e.size, %err, "skipping an unusable shard checkpoint; trying the previous one");
            return Ok(None);
        }
    };
    for d in crate::checkpoint::check_compatible(&e.name, &c.spec, spec, false)? {
        tracing::warn!(checkpoint = %e.name, "resuming with a change: {d}");
    }
    if c.meta.id as usize != index {
        return Err(Error::Checkpoint(format!(
            "{} holds shard {}, this process serves shard {index} (use shard {index}'s own \
             checkpoint directory)",
            e.name, c.meta.id
        )));
    }
    tracing::info!(checkpoint = %e.name, version = c.meta.version, "shard resuming from checkpoint");
    Ok(Some(c))
}

/// The periodic writer: every `every`, a checkpoint if the shard's version moved. Returns when
/// `stop` turns true (the final checkpoint is [`super::run`]'s).
pub async fn task(
    shard: Shard,
    ck: Arc<ShardCheckpointer>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    metrics: Arc<crate::registry::metrics::Metrics>,
) {
    let every = ck.cfg.every;
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = Some(shard.version());
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tick.tick() => {
                if last == Some(shard.version()) {
                    continue;
                }
                match ck.write(&shard).await {
                    Ok(w) => {
                        tracing::info!(checkpoint = %w.name, bytes = w.bytes, seconds = w.write_seconds, version = w.version, "shard checkpoint written");
                        metrics.checkpoint_written(w.bytes, crate::registry::metrics::unix_now());
                        last = Some(w.version);
                    }
                    Err(err) => tracing::error!(%err, "shard checkpoint failed; the previous ones are kept"),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: super::super::ShardArgs,
    }

    fn spec() -> RunSpec {
        use clap::Parser;
        let cli = Cli::try_parse_from([
            "shard",
            "--index",
            "1",
            "--of",
            "2",
            "--optimizer",
            "adagrad",
            "--run-secret",
            "0123456789abcdef",
        ])
        .unwrap();
        let c = cli.args.check().unwrap();
        super::super::spec_of(&c.training, c.inputs, c.classes).unwrap()
    }

    fn export(n: usize) -> ShardExport {
        ShardExport {
            version: 17,
            values: Arc::new((0..n).map(|i| i as f32 * 0.5).collect()),
            state: OptState {
                slot0: (0..n).map(|i| i as f32).collect(),
                slot1: Vec::new(),
                t: 9,
            },
            inv_staleness_mean: 0.75,
            scaled_pushes: 4,
            samples: 544,
            average: None,
        }
    }

    #[test]
    fn round_trips_and_refuses_corruption() {
        let s = spec();
        let n = s.ranges()[1].len();
        let c = ShardCheckpoint::of(s.clone(), 1, &export(n)).unwrap();
        let bytes = c.encode().unwrap();
        let back = ShardCheckpoint::decode(&bytes).unwrap();
        assert_eq!(back, c);
        assert_eq!(back.export().state.t, 9);
        assert_eq!(back.export().version, 17);
        // A flipped byte in the data, or a truncated file, is refused without a panic.
        let mut bad = bytes.clone();
        let at = bad.len() - 3;
        bad[at] ^= 0x40;
        let e = ShardCheckpoint::decode(&bad).unwrap_err().to_string();
        assert!(e.contains("checksum"), "{e}");
        let e = ShardCheckpoint::decode(&bytes[..bytes.len() / 2])
            .unwrap_err()
            .to_string();
        assert!(e.contains("truncated"), "{e}");
        // An export of the wrong length is refused.
        assert!(ShardCheckpoint::of(s.clone(), 1, &export(n - 1)).is_err());

        // `--ema`: the moving average is kept (tensor `ema`, its decay and bias correction
        // in `shard`) and given back whole; one of the wrong length is refused.
        let mut e = export(n);
        e.average = Some(crowdgrad_core::shard::AverageExport {
            decay: 0.999,
            values: Arc::new((0..n).map(|i| i as f32 * 0.25).collect()),
            power: 0.5,
        });
        let c = ShardCheckpoint::of(s.clone(), 1, &e).unwrap();
        let bytes = c.encode().unwrap();
        let back = ShardCheckpoint::decode(&bytes).unwrap();
        assert_eq!(back.export().average, e.average);
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("ema").unwrap().shape(), &[n]);
        e.average.as_mut().unwrap().values = Arc::new(vec![0.0; n - 1]);
        assert!(ShardCheckpoint::of(s, 1, &e).is_err());
    }
}
