//! What a worker learns when it joins: the run spec (model, optimizer, shard map, batch size,
//! seed, consistency mode, dataset) and its own id and data partition. Sent as JSON by
//! `POST /api/join`.
//!
//! A [`RunSpec`] is made in one place, [`RunSpec::build`] from [`RunParams`] (the server, the
//! simulator, the loopback and the tests all call it), and checked again with
//! [`RunSpec::validate`] by whoever receives one.

use crate::data::{channels_of, Dataset, Normalize, TextInfo};
use crate::error::{Error, Result};
use crate::local::LocalConfig;
use crate::model::ModelSpec;
use crate::optim::OptimizerConfig;
use crate::partition::{partition, KeyRange, Slicer};
use crate::shard::Consistency;
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
    /// For a text run, its tokenizer (examples are windows of `T + 1` token ids, `classes` is
    /// the vocabulary size `V`); the server decodes samples and encodes prompts with it.
    /// Absent for images, and in specs from before text existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<TextInfo>,
}

impl DataInfo {
    /// The description of a training and a test set called `name`; the class count is the
    /// larger of the two sets' (a label seen only in the test set still needs an output).
    pub fn of(name: impl Into<String>, train: &Dataset, test: &Dataset) -> Self {
        Self {
            name: name.into(),
            image_dims: train.image_dims.clone(),
            classes: train.classes().max(test.classes()),
            train_len: train.len(),
            test_len: test.len(),
            text: None,
        }
    }

    /// The description of a text run's training and validation windows
    /// ([`crate::data::windows`]) tokenized by `text`: the class count is its vocabulary size
    /// (a token need not occur as a label to be predicted).
    pub fn of_text(
        name: impl Into<String>,
        train: &Dataset,
        test: &Dataset,
        text: TextInfo,
    ) -> Self {
        Self {
            classes: text.vocab_size(),
            text: Some(text),
            ..Self::of(name, train, test)
        }
    }
}

/// What a run is made of, unchecked: [`RunSpec::build`] resolves the model against the
/// dataset, cuts the parameters into shards and checks the result.
#[derive(Debug, Clone, PartialEq)]
pub struct RunParams {
    /// Distinguishes runs (a restarted server starts a new one).
    pub run_id: String,
    /// Model text ([`ModelSpec::parse_shaped`]: `softmax`, `mlp:W1[,W2...]`, `cnn` or a layer
    /// list); the input shape and the classes come from `dataset`.
    pub model: String,
    /// The shards' optimizer.
    pub optimizer: OptimizerConfig,
    /// Examples per gradient.
    pub batch_size: usize,
    /// Seed for initial weights and each worker's batch order.
    pub seed: u64,
    /// Consistency mode.
    pub consistency: Consistency,
    /// Number of parameter shards (contiguous, near-equal key ranges at `/ws/shard/{i}`).
    pub shards: usize,
    /// The dataset.
    pub dataset: DataInfo,
    /// Local steps, the inner optimizer and overlap.
    pub local: LocalConfig,
    /// Per-channel normalisation of every batch (resolved: `auto` is the caller's job,
    /// [`crate::data::NormalizeChoice::resolve`]).
    pub normalize: Normalize,
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
    /// Consistency mode; in JSON the string `"async"`, `"ssp:S"` or `"sync:K"`
    /// ([`Consistency::parse`] / `Display`).
    pub consistency: Consistency,
    /// The shard map.
    pub shards: Vec<ShardInfo>,
    /// The dataset.
    pub dataset: DataInfo,
    /// How workers exchange: local steps, the inner optimizer, overlap (absent: one gradient
    /// per push, no overlap).
    #[serde(default)]
    pub local: LocalConfig,
    /// Per-channel normalisation every worker applies to its batches (and the evaluator to
    /// the test set); absent in JSON = plain `p / 255`, the behaviour before it existed.
    #[serde(default, skip_serializing_if = "Normalize::is_identity")]
    pub normalize: Normalize,
}

impl RunSpec {
    /// The one way to make a run spec: parses `p.model` for the dataset's image size and
    /// classes, cuts its parameters into `p.shards` ranges (the shard map of
    /// [`shard_map`]) and validates the whole ([`RunSpec::validate`]).
    ///
    /// # Errors
    /// [`Error::Config`] for a bad model text, a shard count that is zero or larger than the
    /// parameter count, or anything [`RunSpec::validate`] rejects.
    pub fn build(p: RunParams) -> Result<Self> {
        let model = ModelSpec::parse_shaped(&p.model, &p.dataset.image_dims, p.dataset.classes)?;
        let ranges = partition(model.param_len(), p.shards)?;
        let spec = Self {
            run_id: p.run_id,
            model,
            optimizer: p.optimizer,
            batch_size: p.batch_size,
            seed: p.seed,
            consistency: p.consistency,
            shards: shard_map(&ranges),
            dataset: p.dataset,
            local: p.local,
            normalize: p.normalize,
        };
        spec.validate()?;
        Ok(spec)
    }

    /// The shards' key ranges, in shard order.
    pub fn ranges(&self) -> Vec<KeyRange> {
        self.shards.iter().map(|s| s.range).collect()
    }

    /// Checks the spec is self-consistent: a valid model, optimizer and consistency mode,
    /// shards that tile its parameters, a positive batch size, and a dataset the model fits.
    ///
    /// # Errors
    /// [`Error::Config`] naming the problem.
    pub fn validate(&self) -> Result<Slicer> {
        self.model.validate()?;
        self.optimizer.validate()?;
        self.consistency.validate()?;
        self.local.validate()?;
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
        let slicer = Slicer::new(self.ranges())?;
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
        self.normalize
            .validate(channels_of(&self.dataset.image_dims))?;
        if let Some(text) = &self.dataset.text {
            text.validate()?;
            if self.dataset.classes != text.vocab_size() {
                return Err(Error::Config(format!(
                    "a text run of {} tokens states {} classes",
                    text.vocab_size(),
                    self.dataset.classes
                )));
            }
            if !self.normalize.tokens {
                return Err(Error::Config(
                    "a text run's batches are token ids: its normalisation must be tokens".into(),
                ));
            }
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
    /// Optional team: volunteers who give the same team are shown together on the
    /// leaderboard (`GET /api/teams`). The server keeps at most 64 characters of it, control
    /// characters removed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub team: Option<String>,
    /// Optional stable identity of the volunteer across sessions, a secret (8 to 64
    /// characters of `[A-Za-z0-9_-]`; the clients draw 32 random hex digits, the browser
    /// keeps them in localStorage): the server keys its ledger, names and quarantine by the
    /// public id it derives from it (docs/protocol.md, "Join") and never shows the secret.
    /// Absent: the session is not credited to anyone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
    /// This join is one of a volunteer's parallel threads (a tab's Web Workers, `crowdgrad
    /// work --threads`): the server gives every thread of one `volunteer` the same data
    /// partition (downloaded once) and its dashboard shows them as one volunteer. Absent: a
    /// volunteer of one thread.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threads: Option<Threads>,
}

impl JoinRequest {
    /// A request for this build's protocol.
    pub fn new(client: ClientKind) -> Self {
        Self {
            protocol: PROTOCOL_VERSION,
            client,
            name: None,
            team: None,
            identity: None,
            threads: None,
        }
    }
}

/// Most threads one volunteer may run ([`Threads::count`]).
pub const MAX_THREADS: u32 = 256;

/// Which of a volunteer's parallel threads a join is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Threads {
    /// A key the volunteer's threads share, drawn afresh each time it starts (8 to 64
    /// characters of `[A-Za-z0-9_-]`); not its ledger identity, which two tabs of one
    /// browser share.
    pub volunteer: String,
    /// This thread, `0..count`.
    pub index: u32,
    /// Threads the volunteer runs, `1..=MAX_THREADS`.
    pub count: u32,
}

impl Threads {
    /// Checks the fields' bounds.
    ///
    /// # Errors
    /// [`Error::Config`] naming the bad field.
    pub fn check(&self) -> Result<()> {
        let v = &self.volunteer;
        if !(8..=64).contains(&v.len())
            || !v
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(Error::Config(
                "threads.volunteer must be 8 to 64 characters of A-Z a-z 0-9 - _".into(),
            ));
        }
        if !(1..=MAX_THREADS).contains(&self.count) {
            return Err(Error::Config(format!(
                "threads.count {} is outside 1..={MAX_THREADS}",
                self.count
            )));
        }
        if self.index >= self.count {
            return Err(Error::Config(format!(
                "threads.index {} is not below threads.count {}",
                self.index, self.count
            )));
        }
        Ok(())
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
    /// The session credential: the worker puts it in every Hello, proving `worker_id` is its
    /// own (HMAC of the id under the run's secret). Absent from servers that do not check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> RunParams {
        RunParams {
            run_id: "t".into(),
            model: "mlp:8".into(),
            optimizer: OptimizerConfig::default(),
            batch_size: 4,
            seed: 1,
            consistency: Consistency::Ssp { bound: 2 },
            shards: 3,
            dataset: DataInfo {
                name: "toy".into(),
                image_dims: vec![2, 3],
                classes: 4,
                train_len: 10,
                test_len: 5,
                text: None,
            },
            local: crate::local::LocalConfig::default(),
            normalize: Normalize::default(),
        }
    }

    #[test]
    fn build_resolves_the_model_and_tiles_the_shards() {
        let spec = RunSpec::build(params()).unwrap();
        assert_eq!(spec.model, ModelSpec::parse("mlp:8", 6, 4).unwrap());
        let n = spec.model.param_len();
        assert_eq!(spec.ranges(), partition(n, 3).unwrap());
        assert_eq!(spec.shards, shard_map(&spec.ranges()));
        assert_eq!(spec.shards[2].path, "/ws/shard/2");
        assert_eq!(spec.validate().unwrap().total(), n);
    }

    #[test]
    fn build_rejects_what_validate_rejects() {
        type Edit = fn(&mut RunParams);
        let cases: [(&str, Edit); 7] = [
            ("model", |p| p.model = "mlp:x".into()),
            // A 2x3 image is too small for the CNN's 5x5 convolution.
            ("cnn on 2x3", |p| p.model = "cnn".into()),
            ("no shards", |p| p.shards = 0),
            ("more shards than parameters", |p| p.shards = 10_000),
            ("batch", |p| p.batch_size = 0),
            ("sync:0", |p| p.consistency = Consistency::Sync { k: 0 }),
            ("lr", |p| p.optimizer.lr = f32::NAN),
        ];
        for (what, edit) in cases {
            let mut p = params();
            edit(&mut p);
            assert!(RunSpec::build(p).is_err(), "{what}");
        }
    }

    #[test]
    fn consistency_is_its_command_line_text_in_json() {
        let spec = RunSpec::build(params()).unwrap();
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(json["consistency"], "ssp:2");
        let back: RunSpec = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(back, spec);
        for (mode, text) in [
            (Consistency::Async, "async"),
            (Consistency::Sync { k: 4 }, "sync:4"),
        ] {
            assert_eq!(serde_json::to_value(mode).unwrap(), text);
            assert_eq!(
                serde_json::from_value::<Consistency>(text.into()).unwrap(),
                mode
            );
        }
        // A bad mode from the network is a decode error, not a run with a broken mode.
        let mut bad = json;
        bad["consistency"] = "sync:0".into();
        assert!(serde_json::from_value::<RunSpec>(bad).is_err());
    }

    /// A text run: windows of 9 tokens, `classes` = the vocabulary size, token mode.
    fn text_params() -> RunParams {
        let text = TextInfo::chars_of("the cat sat\n");
        let mut p = params();
        p.dataset = DataInfo {
            name: "sentences".into(),
            image_dims: vec![9],
            classes: text.vocab_size(),
            train_len: 10,
            test_len: 5,
            text: Some(text),
        };
        p.normalize = Normalize::tokens();
        p
    }

    #[test]
    fn a_text_run_spec_round_trips_through_json_with_its_vocabulary() {
        let spec = RunSpec::build(text_params()).unwrap();
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(json["dataset"]["text"]["level"], "chars");
        assert_eq!(json["dataset"]["text"]["vocab"], "\n acehst");
        assert_eq!(json["dataset"]["classes"], 9);
        assert_eq!(json["normalize"]["tokens"], true);
        let back: RunSpec = serde_json::from_value(json).unwrap();
        assert_eq!(back, spec);
        let text = back.dataset.text.as_ref().unwrap();
        assert_eq!(text.decode(&text.encode("a cat")), "a cat");
        // An image run's JSON has neither key (old readers and specs are unchanged).
        let img = serde_json::to_value(RunSpec::build(params()).unwrap()).unwrap();
        assert!(img["dataset"].get("text").is_none());
        assert!(img.get("normalize").is_none());
    }

    #[test]
    fn a_text_run_needs_token_mode_and_its_vocabulary_size() {
        type Edit = fn(&mut RunParams);
        let cases: [(&str, Edit); 4] = [
            ("p / 255", |p| p.normalize = Normalize::default()),
            ("mean/std", |p| {
                p.normalize = Normalize::parse("0.5/0.2").unwrap()
            }),
            ("classes", |p| p.dataset.classes += 1),
            ("unsorted vocabulary", |p| {
                if let Some(t) = p.dataset.text.as_mut() {
                    t.vocab = "ba".into();
                }
                p.dataset.classes = 3;
            }),
        ];
        for (what, edit) in cases {
            let mut p = text_params();
            edit(&mut p);
            assert!(RunSpec::build(p).is_err(), "{what}");
        }
        assert!(RunSpec::build(text_params()).is_ok());
    }
}
