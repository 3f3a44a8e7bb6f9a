//! An in-memory parameter server for tests and benchmarks of the core worker without a network:
//! [`Loopback`] answers a [`Worker`]'s frames the way the real shards do (Welcome, Params, Ack
//! after applying the push with the run's optimizer), and [`synthetic_run`] makes a join reply
//! and an MNIST-shaped dataset from a seed. Used by `tests/parity.rs` (natively and as wasm) and
//! `examples/step_time.rs` (native step timing, to compare with the browser's).

use crowdgrad_core::data::{encode_idx, Dataset};
use crowdgrad_core::model::{Model, ModelSpec};
use crowdgrad_core::optim::{self, OptState, OptimizerConfig};
use crowdgrad_core::partition::{partition, KeyRange};
use crowdgrad_core::rng::Rng;
use crowdgrad_core::spec::{DataInfo, JoinResponse, PartitionInfo, RunSpec, ShardInfo};
use crowdgrad_core::wire::{self, Message, Welcome, PROTOCOL_VERSION};
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
/// and a synthetic dataset of `examples` from `seed`.
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
    let spec = ModelSpec::parse(model, 784, 10)?;
    let ranges = partition(spec.param_len(), shards)?;
    let join = JoinResponse {
        protocol: PROTOCOL_VERSION,
        worker_id: 3,
        run: RunSpec {
            run_id: "loopback".into(),
            model: spec,
            optimizer,
            batch_size: batch,
            seed,
            consistency: "async".into(),
            shards: ranges
                .iter()
                .enumerate()
                .map(|(i, &range)| ShardInfo {
                    id: i as u32,
                    path: format!("/ws/shard/{i}"),
                    range,
                })
                .collect(),
            dataset: DataInfo {
                name: "synthetic".into(),
                image_dims: vec![28, 28],
                classes: 10,
                train_len: examples,
                test_len: 0,
            },
        },
        partition: PartitionInfo {
            index: 0,
            count: 1,
            examples,
            images: "/images".into(),
            labels: "/labels".into(),
        },
    };
    let (img, lab) = synthetic_idx(examples, seed ^ 0x5eed);
    Ok((join, Dataset::from_idx(&img, &lab)?))
}

/// In-memory shards answering one worker.
#[derive(Debug)]
pub struct Loopback {
    ranges: Vec<KeyRange>,
    optimizer: OptimizerConfig,
    params: Vec<Vec<f32>>,
    states: Vec<OptState>,
    versions: Vec<u64>,
    replies: VecDeque<(usize, Vec<u8>)>,
    grad: Vec<f32>,
}

impl Loopback {
    /// Shards for the run in `join`, starting from the model's initial weights for `init_seed`.
    ///
    /// # Errors
    /// When the run spec is invalid.
    pub fn new(join: &JoinResponse, init_seed: u64) -> Result<Self> {
        let slicer = join.run.validate()?;
        let init = Model::new(join.run.model.clone())?.init_params(init_seed);
        let ranges = slicer.ranges().to_vec();
        Ok(Self {
            params: ranges
                .iter()
                .map(|r| init[r.start..r.end].to_vec())
                .collect(),
            states: ranges
                .iter()
                .map(|r| OptState::new(&join.run.optimizer.rule, r.len()))
                .collect(),
            versions: vec![0; ranges.len()],
            optimizer: join.run.optimizer,
            replies: VecDeque::new(),
            grad: Vec::new(),
            ranges,
        })
    }

    /// The shards' parameters, concatenated.
    pub fn params(&self) -> Vec<f32> {
        self.params.concat()
    }

    /// Answers every frame the worker queued (showing each to `observe` with its shard), then
    /// delivers the answers to the worker, in order.
    ///
    /// # Errors
    /// When the worker sends a frame a shard would refuse, or refuses an answer.
    pub fn exchange(
        &mut self,
        worker: &mut Worker,
        mut observe: impl FnMut(usize, &[u8], &Message<'_>),
    ) -> Result<()> {
        while let Some(out) = worker.poll_transmit() {
            let s = out.shard;
            let msg = wire::decode(&out.frame, usize::MAX)?;
            observe(s, &out.frame, &msg);
            let reply = match msg {
                Message::Hello { request_id, .. } => wire::encode(&Message::Welcome {
                    request_id,
                    shard: s as u32,
                    welcome: Welcome {
                        protocol: PROTOCOL_VERSION,
                        range: self.ranges[s],
                        version: self.versions[s],
                    },
                }),
                Message::Pull { request_id, .. } => {
                    wire::encode_params(request_id, s as u32, self.versions[s], &self.params[s])
                }
                Message::Push {
                    request_id,
                    base_version,
                    grad,
                    ..
                } => {
                    self.grad.resize(grad.len(), 0.0);
                    grad.copy_into(&mut self.grad)?;
                    if self.grad.len() != self.params[s].len() {
                        return Err(Error::WrongLength {
                            expected: self.params[s].len(),
                            got: self.grad.len(),
                        });
                    }
                    optim::step(
                        &self.optimizer,
                        &mut self.states[s],
                        &mut self.params[s],
                        &self.grad,
                        1.0,
                    );
                    self.versions[s] += 1;
                    let staleness = self.versions[s] - 1 - base_version.min(self.versions[s] - 1);
                    wire::encode(&Message::Ack {
                        request_id,
                        shard: s as u32,
                        version: self.versions[s],
                        staleness: staleness as u32,
                    })
                }
                other => {
                    return Err(Error::Protocol(format!(
                        "a worker sent a shard-side frame: {other:?}"
                    )))
                }
            };
            self.replies.push_back((s, reply));
        }
        while let Some((s, bytes)) = self.replies.pop_front() {
            worker.receive(s, &bytes)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crowdgrad_core::optim::Rule;
    use crowdgrad_core::wire::ClientKind;

    #[test]
    fn a_worker_trains_against_the_loopback() {
        let cfg = OptimizerConfig {
            rule: Rule::Sgd,
            lr: 0.1,
            weight_decay: 0.0,
            clip_norm: None,
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
        assert_eq!(shards.versions, vec![5, 5, 5]);
        assert_ne!(
            shards.params(),
            Model::new(ModelSpec::parse("softmax", 784, 10).unwrap())
                .unwrap()
                .init_params(42)
        );
    }
}
