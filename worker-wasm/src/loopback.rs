//! An in-memory parameter server for tests and benchmarks of the core worker without a network:
//! [`Loopback`] answers a [`Worker`]'s frames with the real shard side, core's
//! [`ShardSession`] over a [`ShardState`] (so pushes go through `ShardCore` like on the
//! server), and [`synthetic_run`] makes a join reply
//! and an MNIST-shaped dataset from a seed. Used by `tests/parity.rs` (natively and as wasm) and
//! `examples/step_time.rs` (native step timing, to compare with the browser's).

use crowdgrad_core::codec::Encoding;
use crowdgrad_core::data::{encode_idx, Dataset};
use crowdgrad_core::model::Model;
use crowdgrad_core::optim::OptimizerConfig;
use crowdgrad_core::rng::Rng;
use crowdgrad_core::session::{Action, PushGuard, ShardSession, ShardSetup, ShardState};
use crowdgrad_core::shard::{Consistency, StalenessPolicy};
use crowdgrad_core::spec::{DataInfo, JoinResponse, PartitionInfo, RunParams, RunSpec};
use crowdgrad_core::wire::{self, Message, PROTOCOL_VERSION};
use crowdgrad_core::worker::Worker;
use crowdgrad_core::{Error, Result};
use std::collections::VecDeque;

/// MNIST-shaped IDX files (28x28 bytes, 10 classes) of `n` pseudo-random examples.
pub fn synthetic_idx(n: usize, seed: u64) -> (Vec<u8>, Vec<u8>) {
    let mut r = Rng::new(seed);
    let pixels: Vec<u8> = (0..n * 784)
        .map(|_| {
            // Mostly dark like MNIST, some bright strokes.
            let v = r.next_u64();
            if v & 3 == 0 {
                (v >> 8) as u8
            } else {
                0
            }
        })
        .collect();
    let labels: Vec<u8> = (0..n).map(|_| r.below(10) as u8).collect();
    (encode_idx(&[n, 28, 28], &pixels), encode_idx(&[n], &labels))
}

/// A join reply for `model` (e.g. `mlp:128`) cut into `shards`, with `optimizer` and `batch`,
/// and a synthetic dataset of `examples` from `seed`: MNIST-shaped images, or for a language
/// model (`gpt...`) windows of random byte tokens (V = 256, token mode).
///
/// # Errors
/// When the model text or the shard count is invalid.
pub fn synthetic_run(
    model: &str,
    shards: usize,
    optimizer: OptimizerConfig,
    batch: usize,
    examples: usize,
    seed: u64,
) -> Result<(JoinResponse, Dataset)> {
    // A language model (`gpt...`) gets random windows of byte tokens instead of images.
    let language = crowdgrad_core::model::ModelSpec::parse_sequence(model, 256)
        .ok()
        .and_then(|s| s.sequence());
    let data = match language {
        Some(seq) => {
            let mut r = Rng::new(seed ^ 0x5eed);
            let tokens: Vec<u8> = (0..examples * seq.context + 1)
                .map(|_| r.below(256) as u8)
                .collect();
            crowdgrad_core::data::windows(&tokens, seq.context)?
        }
        None => {
            let (img, lab) = synthetic_idx(examples, seed ^ 0x5eed);
            Dataset::from_idx(&img, &lab)?
        }
    };
    let (dataset, normalize) = match language {
        Some(_) => (
            DataInfo::of_text(
                "synthetic-text",
                &data,
                &data,
                crowdgrad_core::data::TextInfo::bytes(),
            ),
            crowdgrad_core::data::Normalize::tokens(),
        ),
        None => (
            DataInfo {
                name: "synthetic".into(),
                image_dims: vec![28, 28],
                classes: 10,
                train_len: examples,
                test_len: 0,
                text: None,
            },
            Default::default(),
        ),
    };
    let join = JoinResponse {
        protocol: PROTOCOL_VERSION,
        worker_id: 3,
        run: RunSpec::build(RunParams {
            run_id: "loopback".into(),
            model: model.into(),
            optimizer,
            batch_size: batch,
            seed,
            consistency: Consistency::Async,
            shards,
            dataset,
            local: crowdgrad_core::local::LocalConfig::default(),
            normalize,
        })?,
        partition: PartitionInfo {
            index: 0,
            count: 1,
            examples,
            images: "/images".into(),
            labels: "/labels".into(),
        },
        credential: None,
    };
    Ok((join, data))
}

/// In-memory shards answering one worker.
#[derive(Debug)]
pub struct Loopback {
    shards: Vec<(ShardState, ShardSession)>,
    replies: VecDeque<(usize, Vec<u8>)>,
    /// Loopback time, seconds: advanced by a microsecond per frame (no clock of its own).
    now: f64,
}

impl Loopback {
    /// Shards for the run in `join`, starting from the model's initial weights for `init_seed`.
    ///
    /// # Errors
    /// When the run spec is invalid.
    pub fn new(join: &JoinResponse, init_seed: u64) -> Result<Self> {
        let slicer = join.run.validate()?;
        let init = Model::new(join.run.model.clone())?.init_params(init_seed);
        let consistency = join.run.consistency;
        let shards = slicer
            .ranges()
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let setup = ShardSetup {
                    optimizer: join.run.optimizer,
                    staleness: StalenessPolicy::default(),
                    consistency,
                    heartbeat: 5.0,
                    sync_timeout: 2.0,
                    pull_encoding: Encoding::F32,
                    push_encoding: Encoding::F32,
                    reports: false,
                    pseudo_gradients: join.run.local.steps.pseudo_gradients(),
                    guard: PushGuard {
                        max_samples: u32::MAX,
                        ..PushGuard::default()
                    },
                    aggregation: crowdgrad_core::robust::Aggregation::Mean,
                    pacing: crowdgrad_core::shard::Pacing::OFF,
                    counted: join.run.local.inner.schedule.counted,
                    average: None,
                };
                let state = setup.state(i as u32, *r, init[r.start..r.end].to_vec())?;
                Ok((state, ShardSession::new(setup.config(i as u32, *r))))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            shards,
            replies: VecDeque::new(),
            now: 0.0,
        })
    }

    /// The shards' parameters, concatenated.
    pub fn params(&self) -> Vec<f32> {
        self.shards
            .iter()
            .flat_map(|(s, _)| s.values().iter().copied())
            .collect()
    }

    /// The shards' versions.
    pub fn versions(&self) -> Vec<u64> {
        self.shards.iter().map(|(s, _)| s.version()).collect()
    }

    /// Answers every frame the worker queued (showing each to `observe` with its shard), then
    /// delivers the answers to the worker, in order.
    ///
    /// # Errors
    /// When the worker sends a frame a shard would refuse (the shard's error frame and close
    /// are delivered first), or refuses an answer.
    pub fn exchange(
        &mut self,
        worker: &mut Worker,
        mut observe: impl FnMut(usize, &[u8], &Message<'_>),
    ) -> Result<()> {
        let mut refused = None;
        while let Some(out) = worker.poll_transmit() {
            let s = out.shard;
            let Some((state, session)) = self.shards.get_mut(s) else {
                return Err(Error::Protocol(format!("no shard {s}")));
            };
            let msg = wire::decode(&out.frame, usize::MAX)?;
            observe(s, &out.frame, &msg);
            self.now += 1e-6;
            session.handle_frame(state, &out.frame, self.now);
            while let Some(a) = session.poll_action() {
                match a {
                    Action::Send(frame) => self.replies.push_back((s, frame.into_vec())),
                    Action::Close(why) => refused = Some(why),
                    Action::Record(_) => {}
                }
            }
        }
        while let Some((s, bytes)) = self.replies.pop_front() {
            worker.receive(s, &bytes)?;
        }
        match refused {
            Some(why) => Err(Error::Protocol(format!(
                "a shard closed the connection: {why}"
            ))),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crowdgrad_core::model::ModelSpec;
    use crowdgrad_core::optim::Rule;
    use crowdgrad_core::wire::ClientKind;

    #[test]
    fn a_worker_trains_against_the_loopback() {
        let cfg = OptimizerConfig {
            rule: Rule::Sgd,
            lr: 0.1,
            weight_decay: 0.0,
            clip_norm: None,
            schedule: Default::default(),
        };
        let (join, data) = synthetic_run("softmax", 3, cfg, 16, 64, 1).unwrap();
        let mut shards = Loopback::new(&join, 42).unwrap();
        let mut worker = Worker::new(join, data, ClientKind::Native, Some(5)).unwrap();
        for s in 0..3 {
            worker.connected(s);
        }
        let mut frames = 0;
        for _ in 0..50 {
            shards.exchange(&mut worker, |_, _, _| frames += 1).unwrap();
            if worker.ready() {
                worker.step().unwrap();
            } else if worker.is_done() {
                break;
            }
        }
        let st = worker.stats();
        assert_eq!((st.steps, st.pushes_accepted, st.pushes_lost), (5, 15, 0));
        // 3 hellos, 5 rounds of 3 pulls, 5 rounds of 3 pushes.
        assert_eq!(frames, 3 + 15 + 15);
        assert_eq!(shards.versions(), vec![5, 5, 5]);
        assert_ne!(
            shards.params(),
            Model::new(ModelSpec::parse("softmax", 784, 10).unwrap())
                .unwrap()
                .init_params(42)
        );
    }
}
