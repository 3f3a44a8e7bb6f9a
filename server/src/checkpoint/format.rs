//! The checkpoint file format: one safetensors file per checkpoint (docs/checkpoints.md).
//!
//! - Tensors are whole named tensors of the full model, assembled from the shards' key ranges:
//!   `layer0.weight` `[784, 128]`, `layer0.bias` `[128]`, ... exactly as
//!   [`crowdgrad_core::model::ModelSpec::layout`] lays out the flat vector; the optimizer's
//!   state slots are tensors of the same shapes named `{tensor}.{slot}`
//!   (`layer0.weight.adagrad_acc`, [`crowdgrad_core::optim::Rule::slot_names`]), and with
//!   `--ema` the shards' moving average `{tensor}.ema` ([`AVERAGE`]). All F32.
//! - The header's metadata holds the rest as strings: `format` (`crowdgrad-checkpoint`),
//!   `format_version` (`1`), `run` (the run spec JSON, its shard map included), `shards` (JSON:
//!   per shard its range, version, optimizer update count, the `scale` policy's running
//!   mean, its samples and its average's decay and bias correction), `ledger` (the contribution ledger's position, `{"seq": N}`; older checkpoints
//!   hold the whole ledger as JSON), `created_unix_ms`, optionally `history` (JSON: the
//!   coordinator's evaluation history of every experiment, issue 19; absent in older
//!   checkpoints, which load as before) and `checksum`.
//! - `checksum` is `sha256:` and the hex SHA-256 of every tensor (sorted by name: the name, a 0
//!   byte, its little-endian data) followed by every other metadata entry (sorted by key: key,
//!   0, value, 0). safetensors itself checks the size: a truncated file does not parse.
//!
//! Because tensors are whole, a checkpoint does not depend on the shard layout: restoring onto
//! another shard count is re-cutting the flat vectors ([`Checkpoint::exports_for`]).
//!
//! [`encode_model`] writes the export format (`crowdgrad export`): the model tensors only, for
//! Python's `safetensors` / PyTorch.

use crate::error::{Error, Result};
use crowdgrad_core::optim::OptState;
use crowdgrad_core::partition::KeyRange;
use crowdgrad_core::shard::{AverageExport, ShardExport};
use crowdgrad_core::spec::RunSpec;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// `format` of a checkpoint.
pub const FORMAT: &str = "crowdgrad-checkpoint";
/// `format` of an exported model.
pub const EXPORT_FORMAT: &str = "crowdgrad-model";
/// `format_version` this build writes and reads.
pub const FORMAT_VERSION: &str = "1";
/// The suffix of the moving average's tensors (`layer0.weight.ema`; `ema` in a shard
/// process's checkpoint).
pub const AVERAGE: &str = "ema";

/// A shard as the checkpoint's `shards` metadata records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardMeta {
    /// Shard index.
    pub id: u32,
    /// Its key range of the flat vector.
    pub range: KeyRange,
    /// Updates applied.
    pub version: u64,
    /// The optimizer's update count (Adam's bias correction).
    pub opt_t: u64,
    /// `scale` policy: running mean of `1 / max(1, staleness)`.
    pub inv_staleness_mean: f64,
    /// `scale` policy: pushes that mean has seen.
    pub scaled_pushes: u64,
    /// Samples in the updates applied (a counted schedule's position; absent in checkpoints
    /// from before it: 0).
    #[serde(default)]
    pub samples: u64,
    /// `--ema`: the moving average's decay and bias correction; absent when the shard keeps no
    /// average (and in checkpoints from before it was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ema: Option<EmaMeta>,
}

/// A shard's moving average as the checkpoint's metadata records it (its values are tensors).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EmaMeta {
    /// Decay per update.
    pub decay: f32,
    /// `decay^t`, t the updates it has seen ([`crowdgrad_core::shard::AverageExport::power`]).
    pub power: f64,
}

impl EmaMeta {
    /// What `e` records of its average, if it keeps one.
    pub fn of(e: &ShardExport) -> Option<Self> {
        e.average.as_ref().map(|a| Self {
            decay: a.decay,
            power: a.power,
        })
    }

    /// Checks what the metadata says: a decay strictly between 0 and 1 and a bias correction
    /// in `[0, 1]`, as a shard keeps them.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming the values.
    pub fn check(self) -> Result<Self> {
        if self.decay > 0.0 && self.decay < 1.0 && (0.0..=1.0).contains(&self.power) {
            Ok(self)
        } else {
            Err(bad(format!(
                "a moving average with decay {} and power {} (a decay must be in (0, 1), a \
                 power in [0, 1])",
                self.decay, self.power
            )))
        }
    }

    /// The average again, with `values`.
    pub fn export(self, values: Vec<f32>) -> AverageExport {
        AverageExport {
            decay: self.decay,
            values: Arc::new(values),
            power: self.power,
        }
    }
}

/// Everything a checkpoint holds, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// The run (model, optimizer, shard map, dataset, run id).
    pub spec: RunSpec,
    /// Per shard, in shard order.
    pub shards: Vec<ShardMeta>,
    /// The full flat parameter vector.
    pub values: Vec<f32>,
    /// The optimizer's state slots over the full vector, in slot order.
    pub slots: Vec<Vec<f32>>,
    /// `--ema`: the moving average over the full vector (tensors `{tensor}.ema`), when the
    /// shards keep one.
    pub average: Option<Vec<f32>>,
    /// The contribution ledger's position (`{"seq": N}`, [`crate::registry::ledger`]); older
    /// checkpoints hold the whole ledger (`{"contributors": [...]}`).
    pub ledger: serde_json::Value,
    /// When it was taken, milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// What the coordinator keeps across restarts besides the model (issue 19: every
    /// experiment's evaluation history), as it saved it; `None` in checkpoints written before
    /// it existed (they still load) and by writers with nothing to keep.
    pub history: Option<serde_json::Value>,
}

pub(crate) fn bad(m: impl Into<String>) -> Error {
    Error::Checkpoint(m.into())
}

/// Little-endian bytes of `v` (borrowed where the machine is little-endian).
pub(crate) fn le_bytes(v: &[f32]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        Cow::Borrowed(bytemuck::cast_slice(v))
    } else {
        Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// A little-endian f32 tensor for `safetensors::serialize`.
pub(crate) struct F32<'a> {
    pub shape: Vec<usize>,
    pub data: Cow<'a, [u8]>,
}

impl safetensors::View for F32<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// The checks every checkpoint file gets before its tensors are read: a readable safetensors
/// file of `format` at `version` whose checksum matches, holding a valid run spec. Returns its
/// tensors, metadata and run spec.
///
/// # Errors
/// [`Error::Checkpoint`] saying what is wrong (truncated, another format, checksum mismatch...).
#[allow(clippy::type_complexity)]
pub(crate) fn open<'a>(
    bytes: &'a [u8],
    format: &str,
    version: &str,
) -> Result<(
    Vec<(String, TensorView<'a>)>,
    HashMap<String, String>,
    RunSpec,
)> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| {
        bad(format!(
            "not a readable safetensors file ({} bytes; truncated?): {e}",
            bytes.len()
        ))
    })?;
    let (_, header) =
        SafeTensors::read_metadata(bytes).map_err(|e| bad(format!("unreadable header: {e}")))?;
    let meta = header.metadata().clone().unwrap_or_default();
    let get = |k: &str| {
        meta.get(k)
            .ok_or_else(|| bad(format!("metadata has no {k:?}")))
    };
    if get("format")? != format {
        return Err(bad(format!(
            "format is {:?}, not {format:?}",
            get("format")?
        )));
    }
    if get("format_version")? != version {
        return Err(bad(format!(
            "format version {} (this build reads {version})",
            get("format_version")?
        )));
    }
    let tensors = st.tensors();
    let sum = checksum(tensors.iter().map(|(n, t)| (n.as_str(), t.data())), &meta);
    if &sum != get("checksum")? {
        return Err(bad("checksum mismatch: the file is corrupt"));
    }
    let spec: RunSpec =
        serde_json::from_str(get("run")?).map_err(|e| bad(format!("bad run spec: {e}")))?;
    spec.validate()?;
    Ok((tensors, meta, spec))
}

/// SHA-256 over the tensors (by name) and the metadata but `checksum`, as `sha256:HEX`.
pub(crate) fn checksum<'a>(
    tensors: impl IntoIterator<Item = (&'a str, &'a [u8])>,
    meta: &HashMap<String, String>,
) -> String {
    let mut h = Sha256::new();
    let sorted: BTreeMap<&str, &[u8]> = tensors.into_iter().collect();
    for (name, data) in sorted {
        h.update(name.as_bytes());
        h.update([0]);
        h.update(data);
    }
    let sorted: BTreeMap<&String, &String> =
        meta.iter().filter(|(k, _)| *k != "checksum").collect();
    for (k, v) in sorted {
        h.update(k.as_bytes());
        h.update([0]);
        h.update(v.as_bytes());
        h.update([0]);
    }
    format!("sha256:{}", hex(&h.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Serialises named tensors of `spec`'s layout cut from `flats` (each the full vector: values
/// first, then slots named by `suffixes`), with `meta` and its checksum.
fn serialize(
    spec: &RunSpec,
    flats: &[(&str, &[f32])],
    mut meta: HashMap<String, String>,
) -> Result<Vec<u8>> {
    let layout = spec.model.layout();
    let mut named: Vec<(String, F32<'_>)> = Vec::new();
    for (suffix, flat) in flats {
        if flat.len() != layout.len() {
            return Err(bad(format!(
                "{} values for a model of {}",
                flat.len(),
                layout.len()
            )));
        }
        for t in &layout.tensors {
            let name = if suffix.is_empty() {
                t.name.clone()
            } else {
                format!("{}.{suffix}", t.name)
            };
            named.push((
                name,
                F32 {
                    shape: t.shape.clone(),
                    data: le_bytes(&flat[t.offset..t.offset + t.len()]),
                },
            ));
        }
    }
    let sum = checksum(named.iter().map(|(n, t)| (n.as_str(), &*t.data)), &meta);
    meta.insert("checksum".into(), sum);
    safetensors::serialize(named, Some(meta)).map_err(|e| bad(format!("serialising: {e}")))
}

impl Checkpoint {
    /// A checkpoint of `spec` from its shards' exports (in shard order) and the ledger.
    ///
    /// # Errors
    /// When the exports do not tile the spec's shard map or their optimizer state does not
    /// fit its rule.
    pub fn assemble(
        spec: RunSpec,
        exports: &[ShardExport],
        ledger: serde_json::Value,
    ) -> Result<Self> {
        let ranges = spec.ranges();
        if ranges.len() != exports.len() {
            return Err(bad(format!(
                "{} shard exports for {} shards",
                exports.len(),
                ranges.len()
            )));
        }
        let rule = spec.optimizer.rule;
        let n = spec.model.param_len();
        let mut values = Vec::with_capacity(n);
        let mut slots = vec![Vec::with_capacity(n); rule.slots()];
        let mut shards = Vec::with_capacity(exports.len());
        let keeps_average = exports.first().is_some_and(|e| e.average.is_some());
        let mut average = Vec::with_capacity(if keeps_average { n } else { 0 });
        for (i, (r, e)) in ranges.iter().zip(exports).enumerate() {
            if e.values.len() != r.len() {
                return Err(bad(format!(
                    "shard {i} exported {} values for a range of {}",
                    e.values.len(),
                    r.len()
                )));
            }
            values.extend_from_slice(&e.values);
            let s = e.state.slots(&rule);
            for (all, part) in slots.iter_mut().zip(&s) {
                if part.len() != r.len() {
                    return Err(bad(format!("shard {i}: optimizer state of the wrong size")));
                }
                all.extend_from_slice(part);
            }
            match &e.average {
                Some(a) if keeps_average && a.values.len() == r.len() => {
                    average.extend_from_slice(&a.values);
                }
                None if !keeps_average => {}
                _ => {
                    return Err(bad(format!(
                        "shard {i}: its moving average does not match the other shards'"
                    )))
                }
            }
            shards.push(ShardMeta {
                id: i as u32,
                range: *r,
                version: e.version,
                opt_t: e.state.t,
                inv_staleness_mean: e.inv_staleness_mean,
                scaled_pushes: e.scaled_pushes,
                samples: e.samples,
                ema: EmaMeta::of(e),
            });
        }
        Ok(Self {
            spec,
            shards,
            values,
            slots,
            average: keeps_average.then_some(average),
            ledger,
            created_unix_ms: now_ms(),
            history: None,
        })
    }

    /// The shards' versions, in shard order.
    pub fn versions(&self) -> Vec<u64> {
        self.shards.iter().map(|s| s.version).collect()
    }

    /// Shard exports for the key ranges `ranges` (the checkpoint's own, or another layout's
    /// when resharding): values and slots are re-cut from the full vectors; a new shard takes
    /// the largest version, update count and samples of the old shards it overlaps, and the
    /// `scale` statistics and the moving average's bias correction of the first of them.
    pub fn exports_for(&self, ranges: &[KeyRange]) -> Vec<ShardExport> {
        ranges
            .iter()
            .map(|r| {
                let overlap: Vec<&ShardMeta> = self
                    .shards
                    .iter()
                    .filter(|s| s.range.start < r.end && r.start < s.range.end)
                    .collect();
                let slots: Vec<Vec<f32>> = self
                    .slots
                    .iter()
                    .map(|s| s[r.start..r.end].to_vec())
                    .collect();
                let mut it = slots.into_iter();
                ShardExport {
                    version: overlap.iter().map(|s| s.version).max().unwrap_or(0),
                    values: Arc::new(self.values[r.start..r.end].to_vec()),
                    state: OptState {
                        slot0: it.next().unwrap_or_default(),
                        slot1: it.next().unwrap_or_default(),
                        t: overlap.iter().map(|s| s.opt_t).max().unwrap_or(0),
                    },
                    inv_staleness_mean: overlap.first().map_or(1.0, |s| s.inv_staleness_mean),
                    scaled_pushes: overlap.first().map_or(0, |s| s.scaled_pushes),
                    samples: overlap.iter().map(|s| s.samples).max().unwrap_or(0),
                    average: match (&self.average, overlap.first().and_then(|s| s.ema)) {
                        (Some(all), Some(ema)) => Some(ema.export(all[r.start..r.end].to_vec())),
                        _ => None,
                    },
                }
            })
            .collect()
    }

    /// The safetensors bytes.
    ///
    /// # Errors
    /// When the checkpoint is inconsistent (lengths) or cannot be serialised.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let rule = self.spec.optimizer.rule;
        if self.slots.len() != rule.slots() {
            return Err(bad("optimizer slots do not match the rule"));
        }
        let mut meta: HashMap<String, String> = [
            ("format", FORMAT.to_string()),
            ("format_version", FORMAT_VERSION.to_string()),
            ("run", json(&self.spec)?),
            ("shards", json(&self.shards)?),
            ("ledger", json(&self.ledger)?),
            ("created_unix_ms", self.created_unix_ms.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        // Optional, so a reader that does not know it (or a checkpoint without it) is fine.
        if let Some(h) = &self.history {
            meta.insert("history".into(), json(h)?);
        }
        let mut flats: Vec<(&str, &[f32])> = vec![("", &self.values)];
        for (name, s) in rule.slot_names().iter().zip(&self.slots) {
            flats.push((name, s));
        }
        if let Some(a) = &self.average {
            flats.push((AVERAGE, a));
        }
        serialize(&self.spec, &flats, meta)
    }

    /// Parses and checks a checkpoint: size (safetensors), format, checksum, then that every
    /// tensor of the run's layout and optimizer is there with its shape, and nothing else.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] saying what is wrong (truncated, checksum mismatch, a missing
    /// tensor...).
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let (tensors, meta, spec) = open(bytes, FORMAT, FORMAT_VERSION)?;
        let get = |k: &str| {
            meta.get(k)
                .ok_or_else(|| bad(format!("metadata has no {k:?}")))
        };
        let shards: Vec<ShardMeta> = serde_json::from_str(get("shards")?)
            .map_err(|e| bad(format!("bad shard list: {e}")))?;
        if shards.iter().map(|s| s.range).collect::<Vec<_>>() != spec.ranges() {
            return Err(bad("the shard list does not match the run's shard map"));
        }
        let ledger =
            serde_json::from_str(get("ledger")?).map_err(|e| bad(format!("bad ledger: {e}")))?;
        let created_unix_ms = get("created_unix_ms")?
            .parse()
            .map_err(|_| bad("bad created_unix_ms"))?;
        let layout = spec.model.layout();
        let rule = spec.optimizer.rule;
        let by_name: HashMap<&str, &TensorView<'_>> =
            tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        for ema in shards.iter().filter_map(|s| s.ema) {
            ema.check()?;
        }
        let keeps_average = shards.first().is_some_and(|s| s.ema.is_some());
        if shards.iter().any(|s| s.ema.is_some() != keeps_average) {
            return Err(bad("some shards keep a moving average and some do not"));
        }
        let expected = layout.tensors.len() * (1 + rule.slots() + usize::from(keeps_average));
        if by_name.len() != expected {
            return Err(bad(format!(
                "{} tensors, the run's model and optimizer{} need {expected}",
                by_name.len(),
                if keeps_average {
                    " and the moving average"
                } else {
                    ""
                }
            )));
        }
        let flat = |suffix: &str| -> Result<Vec<f32>> {
            let mut all = Vec::with_capacity(layout.len());
            for t in &layout.tensors {
                let name = if suffix.is_empty() {
                    t.name.clone()
                } else {
                    format!("{}.{suffix}", t.name)
                };
                let v = by_name
                    .get(name.as_str())
                    .ok_or_else(|| bad(format!("tensor {name} is missing")))?;
                if v.dtype() != Dtype::F32 || v.shape() != t.shape.as_slice() {
                    return Err(bad(format!(
                        "tensor {name} is {:?} {:?}, expected F32 {:?}",
                        v.dtype(),
                        v.shape(),
                        t.shape
                    )));
                }
                all.extend(f32s(v.data()));
            }
            Ok(all)
        };
        let values = flat("")?;
        let slots = rule
            .slot_names()
            .iter()
            .map(|s| flat(s))
            .collect::<Result<Vec<_>>>()?;
        let average = if keeps_average {
            Some(flat(AVERAGE)?)
        } else {
            None
        };
        Ok(Self {
            spec,
            shards,
            values,
            slots,
            average,
            ledger,
            created_unix_ms,
            // Covered by the checksum like every entry; unreadable only from a writer's bug,
            // which must not cost the model: then it is dropped.
            history: meta
                .get("history")
                .and_then(|h| serde_json::from_str(h).ok()),
        })
    }
}

/// The export format: the model's named tensors only (`layer0.weight` `[784, 128]`, ...), F32,
/// with `format` = `crowdgrad-model`, `run` (the run spec JSON), `versions` (the shards'
/// versions, JSON), `weights` ([`Weights::name`]: `live`, or `moving average` when `values`
/// is the `--ema` average) and `checksum` in the metadata. Loads with Python's
/// `safetensors.numpy.load_file` and `safetensors.torch.load_file`.
///
/// # Errors
/// When `values` does not have the model's length.
pub fn encode_model(
    spec: &RunSpec,
    values: &[f32],
    versions: &[u64],
    weights: Weights,
) -> Result<Vec<u8>> {
    let meta: HashMap<String, String> = [
        ("format", EXPORT_FORMAT.to_string()),
        ("format_version", FORMAT_VERSION.to_string()),
        ("run", json(spec)?),
        ("versions", json(&versions)?),
        ("weights", weights.name().to_string()),
        ("created_unix_ms", now_ms().to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    serialize(spec, &[("", values)], meta)
}

/// Which weights an export holds (its `weights` metadata).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Weights {
    /// The weights the workers train.
    Live,
    /// The shards' moving average of them (`--ema`).
    Average,
}

impl Weights {
    /// As the metadata and `crowdgrad export` name it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Live => "live",
            Self::Average => "moving average",
        }
    }
}

/// JSON for the metadata.
fn json<T: Serialize>(v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| bad(format!("encoding metadata: {e}")))
}

#[cfg(test)]
mod tests;
