//! What a worker learns when it joins: the run spec (model, optimizer, shard map, batch size,
//! seed, dataset) and its own id and data partition. Sent as JSON by `POST /api/join`.

use crate::error::{Error, Result};
use crate::model::ModelSpec;
use crate::optim::OptimizerConfig;
use crate::partition::{KeyRange, Slicer};
use crate::wire::{ClientKind, PROTOCOL_VERSION};
use serde::{Deserialize, Serialize};

/// One shard as a worker sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardInfo {
    /// Shard index, also in every frame header.
    pub id: u32,
    /// WebSocket path on the server, e.g. `/ws/shard/0`.
    pub path: String,
    /// The shard's key range of the flat parameter vector.
    pub range: KeyRange,
}

/// The shard map for `ranges`: shard `i` at `/ws/shard/{i}` (the server's endpoint layout).
pub fn shard_map(ranges: &[KeyRange]) -> Vec<ShardInfo> {
    ranges
        .iter()
        .enumerate()
        .map(|(i, r)| ShardInfo {
            id: i as u32,
            path: format!("/ws/shard/{i}"),
            range: *r,
        })
        .collect()
}

/// The dataset being trained on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataInfo {
    /// Name, e.g. `mnist`.
    pub name: String,
    /// Shape of one example.
    pub image_dims: Vec<usize>,
    /// Number of classes.
    pub classes: usize,
    /// Training examples on the server.
    pub train_len: usize,
    /// Test examples on the server.
    pub test_len: usize,
}

/// Everything about a run that a worker needs to train.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSpec {
    /// Distinguishes runs (a restarted server starts a new one).
    pub run_id: String,
    /// The model.
    pub model: ModelSpec,
    /// The shards' optimizer (the worker uses `clip_norm`; the rest is informational).
    pub optimizer: OptimizerConfig,
    /// Examples per gradient.
    pub batch_size: usize,
    /// Seed for initial weights and each worker's batch order.
    pub seed: u64,
    /// Consistency mode: `async`, `ssp:S` or `sync:K` (see [`crate::shard::Consistency`]).
    pub consistency: String,
    /// The shard map.
    pub shards: Vec<ShardInfo>,
    /// The dataset.
    pub dataset: DataInfo,
}

impl RunSpec {
    /// Checks the spec is self-consistent: a valid model, shards that tile its parameters, a
    /// positive batch size, and a dataset the model fits.
    ///
    /// # Errors
    /// [`Error::Config`] naming the problem.
    pub fn validate(&self) -> Result<Slicer> {
        self.model.validate()?;
        self.optimizer.validate()?;
        crate::shard::Consistency::parse(&self.consistency)?;
        if self.batch_size == 0 || self.batch_size > 65_536 {
            return Err(Error::Config(format!(
                "batch size {} is out of range",
                self.batch_size
            )));
        }
        for (i, s) in self.shards.iter().enumerate() {
            if s.id as usize != i {
                return Err(Error::Config(format!(
                    "shard {i} is listed with id {}",
                    s.id
                )));
            }
        }
        let slicer = Slicer::new(self.shards.iter().map(|s| s.range).collect())?;
        if slicer.total() != self.model.param_len() {
            return Err(Error::Config(format!(
                "shards cover {} parameters, the model has {}",
                slicer.total(),
                self.model.param_len()
            )));
        }
        let features: usize = self.dataset.image_dims.iter().product();
        if features != self.model.inputs || self.dataset.classes != self.model.classes {
            return Err(Error::Config("dataset does not fit the model".into()));
        }
        Ok(slicer)
    }
}

/// Body of `POST /api/join`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinRequest {
    /// Protocol version the worker speaks.
    pub protocol: u32,
    /// Kind of client.
    #[serde(default)]
    pub client: ClientKind,
    /// Optional display name.
    #[serde(default)]
    pub name: Option<String>,
}

impl JoinRequest {
    /// A request for this build's protocol.
    pub fn new(client: ClientKind) -> Self {
        Self {
            protocol: PROTOCOL_VERSION,
            client,
            name: None,
        }
    }
}

/// The worker's slice of the training set and where to download it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionInfo {
    /// Partition index.
    pub index: usize,
    /// Number of partitions.
    pub count: usize,
    /// Examples in the partition.
    pub examples: usize,
    /// Path of the IDX images file, e.g. `/api/data/train/0/images`.
    pub images: String,
    /// Path of the IDX labels file.
    pub labels: String,
}

/// Reply to `POST /api/join`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JoinResponse {
    /// Protocol version of the server.
    pub protocol: u32,
    /// This worker's id (put it in every Hello).
    pub worker_id: u64,
    /// The run.
    pub run: RunSpec,
    /// The data to train on.
    pub partition: PartitionInfo,
}
