//! The worker's training logic as a sans-IO state machine, driven by both the native worker
//! (tokio-tungstenite) and the browser worker (web-sys WebSocket). The driver feeds it
//! connection events and received frames, takes frames to send from [`Worker::poll_transmit`],
//! and calls [`Worker::step`] whenever [`Worker::ready`] says a step can run (the browser driver
//! may delay that to throttle CPU use).
//!
//! One step, as in TensorFlow's between-graph async replication:
//! 1. `Pull` every shard (concurrently: all requests go out before any reply is awaited);
//! 2. when every shard's `Params` have arrived, compute the gradient on the next mini-batch;
//! 3. `Push` each shard its slice, tagged with the shard version it was computed from, and
//!    immediately `Pull` again. A shard handles one connection's frames in order, so the next
//!    pull observes this worker's own push (plus whatever other workers pushed meanwhile).

use crate::data::{BatchSampler, Dataset};
use crate::error::{Error, Result};
use crate::model::{Model, Workspace};
use crate::optim::clip_by_global_norm;
use crate::partition::Slicer;
use crate::shard::Consistency;
use crate::spec::JoinResponse;
use crate::wire::{
    self, ClientKind, ErrorCode, Hello, Message, HEADER_LEN, MAX_META_LEN, PROTOCOL_VERSION,
};
use ndarray::Array2;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// A frame to send on shard `shard`'s connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    /// Shard index.
    pub shard: usize,
    /// The encoded frame (one WebSocket binary message).
    pub frame: Vec<u8>,
}

/// Counters a worker keeps about itself (shown in the CLI and the browser page).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerStats {
    /// Gradient steps computed.
    pub steps: u64,
    /// Examples consumed.
    pub samples: u64,
    /// Push frames sent (one per shard per step).
    pub pushes_sent: u64,
    /// Pushes acknowledged as applied.
    pub pushes_accepted: u64,
    /// Pushes rejected by a shard (e.g. too stale).
    pub pushes_rejected: u64,
    /// Pushes whose connection dropped before an answer.
    pub pushes_lost: u64,
    /// Mean training loss of the last batch.
    pub last_loss: f64,
    /// Exponential moving average of the training loss.
    pub ema_loss: f64,
    /// Staleness of the last acknowledged push.
    pub last_staleness: u32,
    /// Largest staleness acknowledged.
    pub max_staleness: u32,
    /// Sum of acknowledged staleness (for a mean).
    pub staleness_sum: u64,
    /// Spread (max - min) of shard versions read for the last step.
    pub read_skew: u64,
    /// Last rejection or error reported by a shard.
    pub last_error: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Disconnected,
    Handshake,
    Ready,
}

#[derive(Debug, Clone)]
struct ShardSlot {
    phase: Phase,
    /// Shard version of the parameters we hold for it.
    version: u64,
    /// Parameters for the next step have arrived.
    fresh: bool,
    /// Request id of the outstanding pull.
    pull: Option<u32>,
    /// Pushes awaiting an answer.
    in_flight: u32,
    /// Version the next pull asks for (sync mode: one past the version pushed to).
    min_version: u64,
}

/// What one [`Worker::step`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// Mean loss of the batch.
    pub loss: f64,
    /// Examples in the batch.
    pub samples: usize,
    /// Norm of the gradient before clipping.
    pub grad_norm: f32,
}

/// The sans-IO worker.
#[derive(Debug)]
pub struct Worker {
    join: JoinResponse,
    client: ClientKind,
    model: Model,
    slicer: Slicer,
    params: Vec<f32>,
    grad: Vec<f32>,
    ws: Workspace,
    data: Dataset,
    sampler: BatchSampler,
    idx: Vec<u32>,
    x: Array2<f32>,
    y: Vec<u8>,
    shards: Vec<ShardSlot>,
    outbox: VecDeque<Outgoing>,
    next_request: u32,
    frame_limit: usize,
    max_steps: Option<u64>,
    /// `sync:K` run: pull the next version, not the current one.
    sync: bool,
    stats: WorkerStats,
}

impl Worker {
    /// A worker for the run it joined, training on `data` (its partition), for at most
    /// `max_steps` steps.
    ///
    /// # Errors
    /// [`Error::Config`] when the run spec is inconsistent or the data does not fit the model.
    pub fn new(
        join: JoinResponse,
        data: Dataset,
        client: ClientKind,
        max_steps: Option<u64>,
    ) -> Result<Self> {
        if join.protocol != PROTOCOL_VERSION {
            return Err(Error::ProtocolVersion {
                got: join.protocol,
                expected: PROTOCOL_VERSION,
            });
        }
        let slicer = join.run.validate()?;
        let model = Model::new(join.run.model.clone())?;
        if data.features != model.spec().inputs || data.is_empty() {
            return Err(Error::Config(format!(
                "partition has {} examples of {} features, model {} needs {}",
                data.len(),
                data.features,
                model.spec(),
                model.spec().inputs
            )));
        }
        if data.classes() > model.spec().classes {
            return Err(Error::Data(format!(
                "labels exceed the model's {} classes",
                model.spec().classes
            )));
        }
        let batch = join.run.batch_size;
        let n = model.param_len();
        let largest = slicer.ranges().iter().map(|r| r.len()).max().unwrap_or(0);
        let seed = join.run.seed ^ join.worker_id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        Ok(Self {
            client,
            ws: model.workspace(batch),
            params: vec![0.0; n],
            grad: vec![0.0; n],
            sampler: BatchSampler::new(data.len(), seed),
            idx: vec![0; batch],
            x: Array2::zeros((batch, data.features)),
            y: vec![0; batch],
            shards: vec![
                ShardSlot {
                    phase: Phase::Disconnected,
                    version: 0,
                    fresh: false,
                    pull: None,
                    in_flight: 0,
                    min_version: 0,
                };
                slicer.ranges().len()
            ],
            outbox: VecDeque::new(),
            next_request: 1,
            frame_limit: HEADER_LEN + MAX_META_LEN + 4 * largest,
            max_steps,
            sync: matches!(
                Consistency::parse(&join.run.consistency)?,
                Consistency::Sync { .. }
            ),
            stats: WorkerStats::default(),
            data,
            model,
            slicer,
            join,
        })
    }

    /// The join reply this worker was built from.
    pub fn join_info(&self) -> &JoinResponse {
        &self.join
    }

    /// Counters so far.
    pub fn stats(&self) -> &WorkerStats {
        &self.stats
    }

    /// Carries counters over from a previous session (after a reconnect).
    pub fn carry_stats(&mut self, previous: WorkerStats) {
        self.stats = previous;
    }

    /// The parameters as last pulled (for tests and evaluation).
    pub fn params(&self) -> &[f32] {
        &self.params
    }

    /// Number of shards.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    fn request_id(&mut self) -> u32 {
        let id = self.next_request;
        self.next_request = self.next_request.wrapping_add(1).max(1);
        id
    }

    /// The driver opened the connection to `shard`: queue the Hello.
    pub fn connected(&mut self, shard: usize) {
        let request_id = self.request_id();
        let frame = wire::encode(&Message::Hello {
            request_id,
            shard: shard as u32,
            hello: Hello {
                protocol: PROTOCOL_VERSION,
                worker_id: self.join.worker_id,
                client: self.client,
            },
        });
        if let Some(s) = self.shards.get_mut(shard) {
            s.phase = Phase::Handshake;
            self.outbox.push_back(Outgoing { shard, frame });
        }
    }

    /// The connection to `shard` closed: forget what was outstanding on it.
    pub fn disconnected(&mut self, shard: usize) {
        if let Some(s) = self.shards.get_mut(shard) {
            self.stats.pushes_lost += u64::from(s.in_flight);
            *s = ShardSlot {
                phase: Phase::Disconnected,
                version: s.version,
                fresh: false,
                pull: None,
                in_flight: 0,
                min_version: 0,
            };
        }
        self.outbox.retain(|o| o.shard != shard);
    }

    /// Handles one frame received from `shard`.
    ///
    /// # Errors
    /// A malformed frame, a protocol violation, NaN parameters, or a fatal error frame from the
    /// shard. The driver should close the connections and rejoin.
    pub fn receive(&mut self, shard: usize, bytes: &[u8]) -> Result<()> {
        let msg = wire::decode(bytes, self.frame_limit)?;
        let Some(range) = self.slicer.ranges().get(shard).copied() else {
            return Err(Error::Protocol(format!("frame for unknown shard {shard}")));
        };
        match msg {
            Message::Welcome { welcome, .. } => {
                if self.shards[shard].phase != Phase::Handshake {
                    return Err(Error::Protocol("unexpected Welcome".into()));
                }
                if welcome.protocol != PROTOCOL_VERSION {
                    return Err(Error::ProtocolVersion {
                        got: welcome.protocol,
                        expected: PROTOCOL_VERSION,
                    });
                }
                if welcome.range != range {
                    return Err(Error::Protocol(format!(
                        "shard {shard} serves {:?}, the run spec says {range:?}",
                        welcome.range
                    )));
                }
                self.shards[shard].phase = Phase::Ready;
                self.shards[shard].version = welcome.version;
                self.queue_pulls();
            }
            Message::Params {
                request_id,
                version,
                values,
                ..
            } => {
                let slot = &mut self.shards[shard];
                if slot.pull != Some(request_id) {
                    return Err(Error::Protocol(format!(
                        "Params for request {request_id} that is not outstanding"
                    )));
                }
                values.copy_into(self.slicer.slice_mut(&mut self.params, shard))?;
                slot.pull = None;
                slot.fresh = true;
                slot.version = version;
            }
            Message::Ack {
                version, staleness, ..
            } => {
                let slot = &mut self.shards[shard];
                if slot.in_flight == 0 {
                    return Err(Error::Protocol("Ack without a push in flight".into()));
                }
                slot.in_flight -= 1;
                let _ = version;
                self.stats.pushes_accepted += 1;
                self.stats.last_staleness = staleness;
                self.stats.max_staleness = self.stats.max_staleness.max(staleness);
                self.stats.staleness_sum += u64::from(staleness);
            }
            Message::Error { error, .. } => {
                self.stats.last_error = Some(format!(
                    "shard {shard}: {}: {}",
                    error.code.name(),
                    error.message
                ));
                if error.code.is_fatal() {
                    return Err(Error::Protocol(format!(
                        "shard {shard} refused: {}",
                        error.message
                    )));
                }
                // A non-fatal error answers a push (e.g. too stale): it was not applied.
                let slot = &mut self.shards[shard];
                slot.in_flight = slot.in_flight.saturating_sub(1);
                self.stats.pushes_rejected += 1;
                if error.code == ErrorCode::Busy {
                    self.stats.last_error = Some(format!("shard {shard} busy: {}", error.message));
                }
            }
            Message::Bye { bye, .. } => {
                self.stats.last_error = Some(format!("shard {shard} said bye: {}", bye.reason));
            }
            Message::Hello { .. } | Message::Pull { .. } | Message::Push { .. } => {
                return Err(Error::Protocol("a shard sent a worker-side message".into()));
            }
        }
        Ok(())
    }

    fn steps_left(&self) -> bool {
        self.max_steps.is_none_or(|m| self.stats.steps < m)
    }

    fn all_ready(&self) -> bool {
        self.shards.iter().all(|s| s.phase == Phase::Ready)
    }

    fn queue_pulls(&mut self) {
        if !self.all_ready() || !self.steps_left() {
            return;
        }
        for shard in 0..self.shards.len() {
            if !self.shards[shard].fresh && self.shards[shard].pull.is_none() {
                let request_id = self.request_id();
                self.shards[shard].pull = Some(request_id);
                let frame = wire::encode(&Message::Pull {
                    request_id,
                    shard: shard as u32,
                    min_version: self.shards[shard].min_version,
                });
                self.outbox.push_back(Outgoing { shard, frame });
            }
        }
    }

    /// True when every shard's parameters for the next step have arrived.
    pub fn ready(&self) -> bool {
        self.steps_left()
            && self
                .shards
                .iter()
                .all(|s| s.phase == Phase::Ready && s.fresh)
    }

    /// True once `max_steps` steps were computed and every push was answered or lost.
    pub fn is_done(&self) -> bool {
        !self.steps_left() && self.shards.iter().all(|s| s.in_flight == 0)
    }

    /// Computes one gradient and queues its pushes (and the next pulls).
    ///
    /// # Errors
    /// [`Error::Protocol`] when called while not [`Worker::ready`]; model errors otherwise.
    pub fn step(&mut self) -> Result<StepReport> {
        if !self.ready() {
            return Err(Error::Protocol(
                "step() called before all parameters arrived".into(),
            ));
        }
        self.sampler.next_batch(&mut self.idx);
        self.data
            .fill_batch(&self.idx, &mut self.x.view_mut(), &mut self.y);
        let stats = self.model.loss_and_grad(
            &self.params,
            self.x.view(),
            &self.y,
            &mut self.grad,
            &mut self.ws,
        )?;
        let grad_norm = match self.join.run.optimizer.clip_norm {
            Some(c) => clip_by_global_norm(&mut self.grad, c),
            None => 0.0,
        };
        let samples = self.idx.len();
        let (mut lo, mut hi) = (u64::MAX, 0);
        for shard in 0..self.shards.len() {
            let request_id = self.request_id();
            let slot = &mut self.shards[shard];
            lo = lo.min(slot.version);
            hi = hi.max(slot.version);
            slot.fresh = false;
            slot.in_flight += 1;
            if self.sync {
                slot.min_version = slot.version + 1;
            }
            let frame = wire::encode_push(
                request_id,
                shard as u32,
                slot.version,
                samples as u32,
                self.slicer.slice(&self.grad, shard),
            );
            self.outbox.push_back(Outgoing { shard, frame });
        }
        let loss = stats.mean_loss();
        let s = &mut self.stats;
        s.steps += 1;
        s.samples += samples as u64;
        s.pushes_sent += self.shards.len() as u64;
        s.read_skew = hi.saturating_sub(lo);
        s.last_loss = loss;
        s.ema_loss = if s.steps == 1 {
            loss
        } else {
            0.98 * s.ema_loss + 0.02 * loss
        };
        self.queue_pulls();
        Ok(StepReport {
            loss,
            samples,
            grad_norm,
        })
    }

    /// Next frame to send, if any.
    pub fn poll_transmit(&mut self) -> Option<Outgoing> {
        self.outbox.pop_front()
    }
}
