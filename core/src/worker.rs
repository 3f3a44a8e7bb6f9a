//! The worker's training logic as a sans-IO state machine, driven by the native worker
//! (tokio-tungstenite), the browser worker (web-sys WebSocket) and the simulator. The driver
//! feeds it connection events and received frames, takes frames to send from
//! [`Worker::poll_transmit`], and calls [`Worker::step`] whenever [`Worker::ready`] says a step
//! can run (the browser driver may delay that to throttle CPU use). Time is an input: drivers
//! that report it ([`Worker::set_time`] before each call, [`Worker::observe_compute`] after each
//! step) get the adaptive number of local steps and the compute/wait figures; without it the
//! worker still trains, with `auto` staying at one step per push.
//!
//! One round, as in TensorFlow's between-graph async replication, extended with local steps
//! ([`crate::local`]):
//! 1. `Pull` every shard (concurrently: all requests go out before any reply is awaited);
//! 2. when every shard's `Params` have arrived, the round starts: with `H = 1` one gradient on
//!    the next mini-batch; otherwise `H` inner steps with the run's inner optimizer, one per
//!    [`Worker::step`] call;
//! 3. `Push` each shard its slice (the gradient, or the pseudo-gradient θ_pulled − θ_local),
//!    tagged with the shard version it was computed from, in the encoding the shard chose.
//!
//! The next pull goes out right after the pushes (a shard handles one connection's frames in
//! order, so it observes this worker's own push), or, with overlap, as soon as a round starts,
//! into a second buffer: the link works while the worker computes, and every read misses the
//! worker's own last push.
//!
//! A shard whose connection is lost does not stall the others ([`Worker::disconnected`]):
//! once every shard has sent parameters once, rounds go on with the shards that are connected,
//! the lost shard's slice keeps its last values, and nothing is pushed to it until its
//! connection is back and welcomed (the driver reconnects it with backoff).

use crate::codec::{Encoding, ErrorFeedback};
use crate::data::{BatchSampler, Dataset};
use crate::error::{Error, Result};
use crate::local::Controller;
use crate::model::{Model, Workspace};
use crate::optim::{self, clip_by_global_norm, OptState};
use crate::partition::Slicer;
use crate::shard::Consistency;
use crate::spec::JoinResponse;
use crate::wire::{
    self, ClientKind, Hello, Message, Report, HEADER_LEN, MAX_META_LEN, PROTOCOL_VERSION,
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
    /// Gradient steps computed (inner steps with local steps).
    pub steps: u64,
    /// Examples consumed.
    pub samples: u64,
    /// Push frames sent (one per shard per round).
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
    /// Spread (max - min) of shard versions read for the last round.
    pub read_skew: u64,
    /// The last real failure a shard reported: a fatal error frame or a Bye. Policy refusals
    /// of single pushes (too stale, busy, out of bounds...) are not failures: they are
    /// counted in [`WorkerStats::rejected_by_reason`]. Cleared by the next applied push.
    pub last_error: Option<String>,
    /// Pushes a shard refused without ending the session, by error code name
    /// (`too_stale`, `busy`, `out_of_bounds`, `disagrees`...): what a volunteer's page shows as
    /// normal, per reason.
    #[serde(default)]
    pub rejected_by_reason: std::collections::BTreeMap<String, u64>,
    /// Rounds completed (pushes sent to every shard).
    #[serde(default)]
    pub rounds: u64,
    /// Inner steps per push used by the last round.
    #[serde(default)]
    pub local_steps: u32,
    /// Seconds spent computing (as reported by the driver).
    #[serde(default)]
    pub compute_s: f64,
    /// Seconds from the first to the last time the driver reported.
    #[serde(default)]
    pub wall_s: f64,
    /// Bytes sent on the shard connections.
    #[serde(default)]
    pub bytes_up: u64,
    /// Bytes received on the shard connections.
    #[serde(default)]
    pub bytes_down: u64,
    /// Encodings negotiated with shard 0: pulls, pushes (names).
    #[serde(default)]
    pub encodings: Option<(String, String)>,
    /// The pace the worker honours now, seconds (the largest its shards sent; 0 = none):
    /// the least time between two batches of its pulls (issue 18, [`crate::shard::pace`]).
    #[serde(default)]
    pub pace_s: f64,
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
    /// Shard version of the parameters in the `next` buffer (or last consumed).
    version: u64,
    /// Parameters for the next round have arrived (in `next`).
    fresh: bool,
    /// Request id of the outstanding pull.
    pull: Option<u32>,
    /// Pushes awaiting an answer.
    in_flight: u32,
    /// Version the next pull asks for (sync mode: one past the version pushed to).
    min_version: u64,
    /// Negotiated in the Welcome.
    pull_encoding: Encoding,
    push_encoding: Encoding,
    /// Parameters of this shard arrived at least once (kept across reconnects): while it is
    /// down, rounds go on with its last values.
    have: bool,
    /// Connections lost so far (kept across reconnects): a round pushes only to shards still
    /// on the connection it read from.
    generation: u64,
    /// Negotiated in the Welcome: this shard's `Params` carry its pace.
    paces: bool,
    /// The pace its last `Params` carried, seconds (0 = none).
    pace: f64,
    /// The samples the shard had applied at `version`, as its `Params` said (0 when it did
    /// not say: a shard whose run has no counted schedule need not).
    samples: u64,
}

impl ShardSlot {
    fn new() -> Self {
        Self {
            phase: Phase::Disconnected,
            version: 0,
            fresh: false,
            pull: None,
            in_flight: 0,
            min_version: 0,
            pull_encoding: Encoding::F32,
            push_encoding: Encoding::F32,
            have: false,
            generation: 0,
            paces: false,
            pace: 0.0,
            samples: 0,
        }
    }

    /// Ready for the next round: fresh parameters in, or down after having sent some (the
    /// round uses its last values and pushes nothing to it).
    fn settled(&self) -> bool {
        if self.phase == Phase::Ready {
            self.fresh
        } else {
            self.have
        }
    }
}

/// The round in progress.
#[derive(Debug, Clone)]
struct Round {
    /// Inner steps this round runs.
    h: u32,
    /// Inner steps done.
    done: u32,
    /// Shard versions the round's parameters were read at.
    versions: Vec<u64>,
    /// The samples each shard had applied at those versions (a counted schedule's position,
    /// [`crate::schedule`]).
    counts: Vec<u64>,
    /// Per shard, the connection generation its fresh parameters came from; `None` for a
    /// shard that was down (nothing is pushed to it).
    read: Vec<Option<u64>>,
    /// Summed loss and examples of the round's batches.
    samples: usize,
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
    /// This step ended a round: its pushes are queued.
    pub pushed: bool,
}

/// The sans-IO worker.
///
/// # Driving a worker
/// Its methods come in the kinds of quinn-proto's `Connection`, though the names predate the
/// `handle_*` / `poll_*` convention of [`crate::session::ShardSession`]:
/// - events in (the `handle_*` kind): [`Worker::connected`] (a shard's connection opened: the
///   Hello is queued), [`Worker::receive`] (a frame arrived from a shard),
///   [`Worker::disconnected`] (a shard's connection closed), [`Worker::set_time`] (the driver's
///   clock, seconds) and [`Worker::observe_compute`] (how long the last step computed);
/// - questions (the `poll_*` kind): [`Worker::poll_transmit`] (the next frame to send, and to
///   which shard), [`Worker::ready`] (a step can run), [`Worker::is_done`] (`max_steps` done
///   and every push answered or lost) and [`Worker::stats`];
/// - [`Worker::step`], the work itself: one gradient or inner step, run by the driver when
///   [`Worker::ready`] says so (the browser may delay it to throttle CPU use).
///
/// It has no timer of its own: reply deadlines and reconnect backoff are the driver's. The
/// order a driver keeps (the native worker, the browser driver and the simulator all do):
/// 1. [`Worker::connected`] for each shard once its socket is open;
/// 2. [`Worker::set_time`], then drain [`Worker::poll_transmit`] until `None`, sending each
///    frame on its shard's connection (a step's push and pull to one shard may leave in one
///    write);
/// 3. stop when [`Worker::is_done`];
/// 4. if [`Worker::ready`]: [`Worker::set_time`], [`Worker::step`], then
///    [`Worker::observe_compute`] with the time it took; then take the frames that arrived
///    meanwhile ([`Worker::set_time`], [`Worker::receive`]) and go back to 2;
/// 5. otherwise wait for the next event: a frame ([`Worker::set_time`], [`Worker::receive`];
///    an error ends the session, the driver closes and joins again), a closed connection
///    ([`Worker::disconnected`], then reconnect with backoff and [`Worker::connected`] again),
///    and go back to 2.
#[derive(Debug)]
pub struct Worker {
    join: JoinResponse,
    client: ClientKind,
    model: Model,
    slicer: Slicer,
    /// The parameters the current round computes on (θ_local with local steps).
    params: Vec<f32>,
    /// Where pulls land: the next round's parameters.
    next: Vec<f32>,
    /// θ_pulled of the current round (local steps only).
    anchor: Vec<f32>,
    grad: Vec<f32>,
    inner: OptState,
    ws: Workspace,
    data: Dataset,
    sampler: BatchSampler,
    idx: Vec<u32>,
    x: Array2<f32>,
    y: Vec<u8>,
    shards: Vec<ShardSlot>,
    feedback: Vec<ErrorFeedback>,
    round: Option<Round>,
    outbox: VecDeque<Outgoing>,
    next_request: u32,
    frame_limit: usize,
    max_steps: Option<u64>,
    /// `sync:K` run: pull the next version, not the current one.
    sync: bool,
    /// Pull the next round's parameters while computing.
    overlap: bool,
    controller: Controller,
    now: Option<f64>,
    started: Option<f64>,
    /// When the outstanding batch of pulls went out.
    pulls_sent: Option<f64>,
    /// When the last batch of pulls went out (the pace counts from it).
    last_pulls: Option<f64>,
    /// The next batch of pulls waits for the pace until then ([`Worker::poll_timeout`]).
    held: Option<f64>,
    last_report: Option<f64>,
    /// The counters carried over from earlier sessions ([`Worker::carry_stats`]): a `Report`
    /// says what this session measured, so it subtracts them.
    carried: Carried,
    reports: bool,
    /// Per shard: its Welcome asked for spot checks, so pushes carry a [`wire::PushTag`].
    spot_checks: Vec<bool>,
    /// Index of the current round's first batch in the sampler's sequence (for the tag).
    round_batch: u64,
    stats: WorkerStats,
}

/// How close to [`Worker::poll_timeout`] a wake-up counts as on time, seconds.
const HOLD_SLACK: f64 = 1e-6;

/// How often a worker sends a `Report`, seconds.
const REPORT_EVERY: f64 = 1.0;

/// What [`Worker::carry_stats`] brought in (see `Worker::carried`).
#[derive(Debug, Clone, Copy, Default)]
struct Carried {
    compute_s: f64,
    bytes_up: u64,
    bytes_down: u64,
}

impl Worker {
    /// A worker for the run it joined, training on `data` (its partition), for at most
    /// `max_steps` steps.
    ///
    /// # Errors
    /// [`Error::Config`] when the run spec is inconsistent or the data does not fit the model.
    pub fn new(
        join: JoinResponse,
        mut data: Dataset,
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
        // Every worker preprocesses as the run says (the evaluator does the same to the test set).
        data.set_normalize(&join.run.normalize)?;
        let batch = join.run.batch_size;
        let n = model.param_len();
        let largest = slicer.ranges().iter().map(|r| r.len()).max().unwrap_or(0);
        let seed = join.run.seed ^ join.worker_id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let local = join.run.local;
        let sync = matches!(join.run.consistency, Consistency::Sync { .. });
        let pseudo = local.steps.pseudo_gradients();
        Ok(Self {
            client,
            ws: model.workspace(batch),
            params: vec![0.0; n],
            next: vec![0.0; n],
            anchor: if pseudo { vec![0.0; n] } else { Vec::new() },
            grad: vec![0.0; n],
            inner: if pseudo {
                OptState::new(&local.inner.rule, n)
            } else {
                OptState::new(&optim::Rule::Sgd, 0)
            },
            sampler: BatchSampler::new(data.len(), seed),
            idx: vec![0; batch],
            x: Array2::zeros((batch, data.features)),
            y: vec![0; batch],
            shards: vec![ShardSlot::new(); slicer.ranges().len()],
            feedback: slicer
                .ranges()
                .iter()
                .map(|r| ErrorFeedback::new(r.len()))
                .collect(),
            round: None,
            outbox: VecDeque::new(),
            next_request: 1,
            frame_limit: HEADER_LEN + MAX_META_LEN + 4 * largest,
            max_steps,
            sync,
            // With local steps the controller keeps communication near 15% instead: a round
            // started from parameters pulled before the worker's own last push would redo
            // (and push again) what that push did, and in the simulator that cost up to 7
            // points of accuracy with 4 workers.
            overlap: local.overlap && !sync && !pseudo,
            controller: Controller::default(),
            now: None,
            started: None,
            pulls_sent: None,
            last_pulls: None,
            held: None,
            last_report: None,
            carried: Carried::default(),
            reports: false,
            spot_checks: vec![false; slicer.ranges().len()],
            round_batch: 0,
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

    /// Carries counters over from a previous session (after a reconnect). [`WorkerStats`]
    /// go on counting from them; `Report`s still say what this session measured (the server
    /// credits a worker id only for time since its join, docs/protocol.md).
    pub fn carry_stats(&mut self, previous: WorkerStats) {
        self.carried = Carried {
            compute_s: previous.compute_s,
            bytes_up: previous.bytes_up,
            bytes_down: previous.bytes_down,
        };
        self.stats = previous;
    }

    /// The parameters the worker computes on (as last pulled, plus its own inner steps).
    pub fn params(&self) -> &[f32] {
        &self.params
    }

    /// Number of shards.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// Inner steps per push the next round will use.
    pub fn local_steps(&self) -> u32 {
        self.next_h()
    }

    /// The encodings negotiated with `shard`: pulls, pushes.
    pub fn encodings(&self, shard: usize) -> Option<(Encoding, Encoding)> {
        self.shards
            .get(shard)
            .map(|s| (s.pull_encoding, s.push_encoding))
    }

    /// The time now, in seconds on any clock the driver keeps (monotonic). Call it before
    /// [`Worker::receive`], [`Worker::step`] and [`Worker::poll_transmit`].
    pub fn set_time(&mut self, now: f64) {
        if !now.is_finite() {
            return;
        }
        let start = *self.started.get_or_insert(now);
        self.now = Some(now);
        self.stats.wall_s = (now - start).max(0.0);
        self.maybe_report();
    }

    /// When the worker wants [`Worker::handle_timeout`] at the latest: `Some` while its next
    /// batch of pulls waits for the shards' pace (issue 18), `None` otherwise. On the clock of
    /// [`Worker::set_time`].
    pub fn poll_timeout(&self) -> Option<f64> {
        self.held
    }

    /// The time [`Worker::poll_timeout`] gave has come (or any later time): the time is
    /// `now`, and pulls held for the pace go out if it has passed (drain
    /// [`Worker::poll_transmit`] next).
    pub fn handle_timeout(&mut self, now: f64) {
        self.set_time(now);
        self.queue_pulls();
    }

    /// The pace this worker honours, seconds: the largest its shards sent (0 = none).
    pub fn pace(&self) -> f64 {
        self.shards.iter().map(|s| s.pace).fold(0.0, f64::max)
    }

    /// The last [`Worker::step`] took `seconds` of compute.
    pub fn observe_compute(&mut self, seconds: f64) {
        if seconds.is_finite() && seconds >= 0.0 {
            self.controller.compute(seconds);
            self.stats.compute_s += seconds;
        }
    }

    fn request_id(&mut self) -> u32 {
        let id = self.next_request;
        self.next_request = wire::next_request_id(self.next_request);
        id
    }

    fn emit(&mut self, shard: usize, frame: Vec<u8>) {
        self.stats.bytes_up += frame.len() as u64;
        self.outbox.push_back(Outgoing { shard, frame });
    }

    /// The driver opened the connection to `shard`: queue the Hello.
    pub fn connected(&mut self, shard: usize) {
        let request_id = self.request_id();
        let offered = vec![Encoding::INT8, Encoding::Bf16, Encoding::F32];
        let frame = wire::encode(&Message::Hello {
            request_id,
            shard: shard as u32,
            hello: Hello {
                protocol: PROTOCOL_VERSION,
                worker_id: self.join.worker_id,
                client: self.client,
                pull_encodings: offered.clone(),
                push_encodings: offered,
                credential: self.join.credential.clone(),
                pacing: true,
                samples: true,
            },
        });
        if let Some(s) = self.shards.get_mut(shard) {
            s.phase = Phase::Handshake;
            self.emit(shard, frame);
        }
    }

    /// The connection to `shard` closed: forget what was outstanding on it. The other shards
    /// carry on: rounds run with this shard's last parameters and push nothing to it until it
    /// is connected and welcomed again (the driver reconnects it with backoff).
    pub fn disconnected(&mut self, shard: usize) {
        if let Some(s) = self.shards.get_mut(shard) {
            self.stats.pushes_lost += u64::from(s.in_flight);
            *s = ShardSlot {
                version: s.version,
                have: s.have,
                generation: s.generation + 1,
                ..ShardSlot::new()
            };
        }
        if let Some(f) = self.feedback.get_mut(shard) {
            f.reset();
        }
        if shard == 0 {
            self.reports = false;
        }
        self.outbox.retain(|o| o.shard != shard);
        // A round may have waited only for this shard's parameters.
        self.try_start_round();
    }

    /// Handles one frame received from `shard`.
    ///
    /// # Errors
    /// A malformed frame, a protocol violation, NaN parameters, or a fatal error frame from the
    /// shard. The driver should close the connections and rejoin.
    pub fn receive(&mut self, shard: usize, bytes: &[u8]) -> Result<()> {
        self.stats.bytes_down += bytes.len() as u64;
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
                let slot = &mut self.shards[shard];
                slot.phase = Phase::Ready;
                slot.version = welcome.version;
                slot.pull_encoding = welcome.pull_encoding;
                slot.push_encoding = welcome.push_encoding;
                slot.paces = welcome.paces;
                self.spot_checks[shard] = welcome.spot_checks;
                if shard == 0 {
                    self.reports = welcome.reports;
                    self.stats.encodings = Some((
                        welcome.pull_encoding.name().into(),
                        welcome.push_encoding.name().into(),
                    ));
                }
                // A reconnect mid-round: that shard's parameters for the next round are needed
                // again; with overlap the others may already be pulling.
                self.queue_pulls();
            }
            Message::Params {
                request_id,
                version,
                pace_ms,
                samples,
                values,
                ..
            } => {
                let slot = &mut self.shards[shard];
                if slot.pull != Some(request_id) {
                    return Err(Error::Protocol(format!(
                        "Params for request {request_id} that is not outstanding"
                    )));
                }
                values.copy_into(self.slicer.slice_mut(&mut self.next, shard))?;
                // `aux` means the pace only where the Welcome said so.
                slot.pace = if slot.paces {
                    crate::shard::pace::pace_from_ms(pace_ms)
                } else {
                    0.0
                };
                slot.pull = None;
                slot.fresh = true;
                slot.have = true;
                slot.version = version;
                slot.samples = samples.unwrap_or(0);
                self.stats.pace_s = self.pace();
                if self.shards.iter().all(|s| s.fresh) {
                    if let (Some(now), Some(sent)) = (self.now, self.pulls_sent.take()) {
                        self.controller.exchange(now - sent);
                    }
                }
                self.try_start_round();
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
                // A push applied: whatever failed before has passed.
                self.stats.last_error = None;
                self.stats.last_staleness = staleness;
                self.stats.max_staleness = self.stats.max_staleness.max(staleness);
                self.stats.staleness_sum += u64::from(staleness);
            }
            Message::Error { error, .. } => {
                if error.code.is_fatal() {
                    self.stats.last_error = Some(format!(
                        "shard {shard}: {}: {}",
                        error.code.name(),
                        error.message
                    ));
                    return Err(Error::Protocol(format!(
                        "shard {shard} refused: {}",
                        error.message
                    )));
                }
                // A non-fatal error answers a push (e.g. too stale): it was not applied. That is
                // the server's policy at work, not a failure: counted by reason.
                *self
                    .stats
                    .rejected_by_reason
                    .entry(error.code.name().to_owned())
                    .or_default() += 1;
                let slot = &mut self.shards[shard];
                if slot.in_flight > 0 {
                    slot.in_flight -= 1;
                    self.stats.pushes_rejected += 1;
                    // The refused push's rounding residual belongs to a gradient the shard
                    // did not take: it is dropped, not carried into the next push (issue 21:
                    // a spot-checking shard bounds the residual a push may carry by the last
                    // accepted push's rounding).
                    if let Some(f) = self.feedback.get_mut(shard) {
                        f.reset();
                    }
                }
            }
            Message::Bye { bye, .. } => {
                self.stats.last_error = Some(format!("shard {shard} said bye: {}", bye.reason));
            }
            Message::Hello { .. }
            | Message::Pull { .. }
            | Message::Push { .. }
            | Message::Report { .. } => {
                return Err(Error::Protocol("a shard sent a worker-side message".into()));
            }
        }
        Ok(())
    }

    fn steps_left(&self) -> u64 {
        self.max_steps
            .map_or(u64::MAX, |m| m.saturating_sub(self.stats.steps))
    }

    /// Every shard is connected, or down after having sent parameters (the first round
    /// needs every shard once), and at least one is connected.
    fn all_ready(&self) -> bool {
        self.shards
            .iter()
            .all(|s| s.phase == Phase::Ready || s.have)
            && self.shards.iter().any(|s| s.phase == Phase::Ready)
    }

    /// `H` for the next round: the policy's choice (under `auto`, raised so a round's compute
    /// covers the shards' pace, [`crate::shard::paced_steps`]), never more than the steps
    /// left.
    fn next_h(&self) -> u32 {
        let policy = self.join.run.local.steps;
        let mut h = self.controller.choose(policy);
        if let crate::local::LocalSteps::Auto { max } = policy {
            h = crate::shard::paced_steps(h, self.pace(), self.controller.compute_s(), max);
        }
        let left = self.steps_left().min(u64::from(u32::MAX)) as u32;
        h.min(left).max(1)
    }

    /// Steps that remain after the round in progress (or after the next one, if none is).
    fn steps_after_round(&self) -> u64 {
        let pending = match &self.round {
            Some(r) => u64::from(r.h - r.done),
            None => u64::from(self.next_h()),
        };
        self.steps_left().saturating_sub(pending)
    }

    fn queue_pulls(&mut self) {
        if !self.all_ready() || self.steps_left() == 0 {
            return;
        }
        // Without overlap, a round in progress pulls nothing: its pushes come first.
        if self.round.is_some() && !self.overlap {
            return;
        }
        if self.round.is_some() && self.steps_after_round() == 0 {
            return;
        }
        let wanted = |s: &ShardSlot| s.phase == Phase::Ready && !s.fresh && s.pull.is_none();
        if !self.shards.iter().any(wanted) {
            return;
        }
        // A new batch of pulls waits until the pace has passed since the last one (a pull
        // re-sent to a reconnected shard within a batch does not).
        if self.pulls_sent.is_none() {
            let due = crate::shard::pull_due(self.last_pulls, self.pace());
            if let (Some(now), Some(due)) = (self.now, due) {
                // Within a microsecond counts as due: a driver converting the time it was
                // given back and forth (ns, ms) must not find it held again forever.
                if now + HOLD_SLACK < due {
                    self.held = Some(due);
                    return;
                }
            }
        }
        self.held = None;
        for shard in 0..self.shards.len() {
            let s = &self.shards[shard];
            if s.phase == Phase::Ready && !s.fresh && s.pull.is_none() {
                let request_id = self.request_id();
                self.shards[shard].pull = Some(request_id);
                let frame = wire::encode(&Message::Pull {
                    request_id,
                    shard: shard as u32,
                    min_version: self.shards[shard].min_version,
                });
                if self.pulls_sent.is_none() {
                    self.pulls_sent = self.now;
                    self.last_pulls = self.now;
                }
                self.emit(shard, frame);
            }
        }
    }

    /// Starts the next round when the previous one is pushed and every shard's parameters are
    /// in: the `next` buffer becomes the working one and, with overlap, the following pulls go
    /// out at once.
    fn try_start_round(&mut self) {
        if self.round.is_some()
            || self.steps_left() == 0
            || !self.all_ready()
            || !self.shards.iter().all(ShardSlot::settled)
            || !self.shards.iter().any(|s| s.fresh)
        {
            return;
        }
        // A shard that is down keeps its last parameters: those of the round just finished
        // (θ_pulled with local steps, not the locally moved θ).
        for shard in 0..self.shards.len() {
            if !self.shards[shard].fresh {
                let last = if self.join.run.local.steps.pseudo_gradients() {
                    &self.anchor
                } else {
                    &self.params
                };
                let r = self.slicer.ranges()[shard];
                self.next[r.start..r.end].copy_from_slice(&last[r.start..r.end]);
            }
        }
        std::mem::swap(&mut self.params, &mut self.next);
        // Every pull of the last batch is answered (or its shard is down): the next pull
        // starts a new batch, which the pace counts from.
        self.pulls_sent = None;
        let versions: Vec<u64> = self.shards.iter().map(|s| s.version).collect();
        let counts: Vec<u64> = self.shards.iter().map(|s| s.samples).collect();
        let read = self
            .shards
            .iter()
            .map(|s| s.fresh.then_some(s.generation))
            .collect();
        for s in &mut self.shards {
            s.fresh = false;
        }
        let lo = versions.iter().copied().min().unwrap_or(0);
        let hi = versions.iter().copied().max().unwrap_or(0);
        self.stats.read_skew = hi - lo;
        if self.join.run.local.steps.pseudo_gradients() {
            self.anchor.copy_from_slice(&self.params);
        }
        let h = self.next_h();
        self.stats.local_steps = h;
        self.round = Some(Round {
            h,
            done: 0,
            versions,
            counts,
            read,
            samples: 0,
        });
        if self.overlap {
            self.queue_pulls();
        }
    }

    /// True when a step can run: a round is in progress.
    pub fn ready(&self) -> bool {
        self.round.is_some()
    }

    /// True once `max_steps` steps were computed and every push was answered or lost.
    pub fn is_done(&self) -> bool {
        self.steps_left() == 0 && self.shards.iter().all(|s| s.in_flight == 0)
    }

    /// Computes one step (a gradient, or one inner step), and at the end of a round queues its
    /// pushes (and, without overlap, the next pulls).
    ///
    /// # Errors
    /// [`Error::Protocol`] when called while not [`Worker::ready`]; model errors otherwise.
    pub fn step(&mut self) -> Result<StepReport> {
        let Some(mut round) = self.round.take() else {
            return Err(Error::Protocol(
                "step() called before all parameters arrived".into(),
            ));
        };
        if round.done == 0 {
            // Where the round's batches start, for the push tag; and, when the shards
            // spot-check, a round's inner optimizer starts fresh, so the round can be
            // recomputed from what the push says (docs/protocol.md, "Spot checks").
            self.round_batch = self.sampler.position() / self.idx.len().max(1) as u64;
            if self.join.run.local.steps.pseudo_gradients() && self.spot_checks.contains(&true) {
                self.inner = OptState::new(&self.join.run.local.inner.rule, self.params.len());
            }
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
        );
        let stats = match stats {
            Ok(s) => s,
            Err(e) => {
                self.round = Some(round);
                return Err(e);
            }
        };
        let grad_norm = match self.join.run.optimizer.clip_norm {
            Some(c) => clip_by_global_norm(&mut self.grad, c),
            None => 0.0,
        };
        let samples = self.idx.len();
        let pseudo = self.join.run.local.steps.pseudo_gradients();
        if pseudo {
            // The round's inner steps follow the schedule where the shards it read were
            // (crate::schedule), which a spot check recomputes from the push's tag: their
            // versions, or under `auto` the samples they had applied plus the round's own.
            let inner = self.join.run.local.inner;
            let round_samples = u64::from(round.h).saturating_mul(self.idx.len() as u64);
            let scale = inner
                .schedule
                .factor_round(&round.versions, &round.counts, round_samples);
            optim::step(&inner, &mut self.inner, &mut self.params, &self.grad, scale);
        }
        round.done += 1;
        round.samples += samples;
        let loss = stats.mean_loss();
        let s = &mut self.stats;
        s.steps += 1;
        s.samples += samples as u64;
        s.last_loss = loss;
        s.ema_loss = if s.steps == 1 {
            loss
        } else {
            0.98 * s.ema_loss + 0.02 * loss
        };
        let pushed = round.done >= round.h;
        if pushed {
            self.push_round(&round, pseudo)?;
        } else {
            self.round = Some(round);
        }
        Ok(StepReport {
            loss,
            samples,
            grad_norm,
            pushed,
        })
    }

    fn push_round(&mut self, round: &Round, pseudo: bool) -> Result<()> {
        if pseudo {
            // Δ = θ_pulled − θ_local, in the gradient buffer.
            for ((g, a), p) in self.grad.iter_mut().zip(&self.anchor).zip(&self.params) {
                *g = a - p;
            }
        }
        let samples = u32::try_from(round.samples).unwrap_or(u32::MAX);
        let mut sent = 0;
        for shard in 0..self.shards.len() {
            // Only to a shard still on the connection the round read from: one that was down,
            // or dropped since, would get a gradient of parameters it may no longer hold.
            let s = &self.shards[shard];
            if s.phase != Phase::Ready || round.read[shard] != Some(s.generation) {
                continue;
            }
            let request_id = self.request_id();
            let version = round.versions[shard];
            let enc = self.shards[shard].push_encoding;
            let slice = self.slicer.slice(&self.grad, shard);
            let feedback = (enc != Encoding::F32).then(|| &mut self.feedback[shard]);
            // A non-finite gradient (a diverged model) is not sent: the shard would refuse it,
            // and the driver's rejoin starts again from the shard's parameters.
            let frame = if self.spot_checks[shard] {
                let tag = wire::PushTag {
                    batch: self.round_batch,
                    versions: round.versions.clone(),
                };
                let id = shard as u32;
                wire::encode_push_tagged(
                    enc, request_id, id, version, samples, slice, feedback, &tag,
                )?
            } else {
                wire::encode_push_as(
                    enc,
                    request_id,
                    shard as u32,
                    version,
                    samples,
                    slice,
                    feedback,
                )?
            };
            let slot = &mut self.shards[shard];
            slot.in_flight += 1;
            if self.sync {
                slot.min_version = version + 1;
            }
            self.emit(shard, frame);
            sent += 1;
        }
        self.stats.pushes_sent += sent;
        self.stats.rounds += 1;
        if !self.overlap {
            self.queue_pulls();
        }
        self.try_start_round();
        Ok(())
    }

    fn maybe_report(&mut self) {
        let Some(now) = self.now else { return };
        if !self.reports || self.shards.first().is_none_or(|s| s.phase != Phase::Ready) {
            return;
        }
        if self.last_report.is_some_and(|t| now - t < REPORT_EVERY) {
            return;
        }
        self.last_report = Some(now);
        let report = Report {
            local_steps: self.stats.local_steps.max(1),
            compute_s: (self.stats.compute_s - self.carried.compute_s).max(0.0),
            wall_s: self.stats.wall_s,
            exchange_s: self.controller.exchange_s().unwrap_or(0.0),
            bytes_up: self.stats.bytes_up.saturating_sub(self.carried.bytes_up),
            bytes_down: self
                .stats
                .bytes_down
                .saturating_sub(self.carried.bytes_down),
        };
        let frame = wire::encode(&Message::Report { shard: 0, report });
        self.emit(0, frame);
    }

    /// Next frame to send, if any.
    pub fn poll_transmit(&mut self) -> Option<Outgoing> {
        self.outbox.pop_front()
    }
}

#[cfg(test)]
mod tests;
