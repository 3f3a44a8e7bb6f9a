//! The discrete-event engine: simulated shards and simulated workers exchanging real wire
//! frames over simulated connections.
//!
//! Time is an integer number of simulated nanoseconds; the queue orders events by
//! `(time, sequence number)`, so ties resolve in scheduling order. Each simulated connection is
//! FIFO in each direction (a message never overtakes an earlier one on the same connection),
//! like a WebSocket.
//!
//! The shard side mirrors `crate::shard` and `crate::handler`: frames of one connection are
//! handled strictly in order, a pull that must wait (SSP bound, sync version) holds up the
//! frames behind it, a push is validated (`wire::decode`, `F32Le::copy_into`) before
//! [`ShardCore::push`], fatal errors send an `Error` frame and close the connection, and a
//! worker leaving drops out of the SSP clock and the sync count (and flushes a sync aggregate).
//! The worker side mirrors `crate::worker`'s driver around core's [`Worker`]: step when
//! ready, reconnect with exponential backoff (200 ms doubling to 5 s) after a lost session.

use super::{
    DropoutKind, Fault, ReadRecord, Row, SimConfig, SimResult, SpeedDist, Totals, WorkerSummary,
};
use crate::data::TrainTest;
use crate::error::{Error, Result};
use crowdgrad_core::data::{encode_idx, Dataset};
use crowdgrad_core::model::{Model, ModelSpec};
use crowdgrad_core::partition::{partition, KeyRange};
use crowdgrad_core::rng::Rng;
use crowdgrad_core::shard::{Consistency, Outcome, ShardCore, SspClock};
use crowdgrad_core::spec::{DataInfo, JoinResponse, PartitionInfo, RunSpec};
use crowdgrad_core::wire::{
    self, ClientKind, ErrorCode, Message, Welcome, HEADER_LEN, MAX_META_LEN, PROTOCOL_VERSION,
};
use crowdgrad_core::worker::{Worker, WorkerStats};
use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};

/// Simulated nanoseconds.
type Time = u64;

fn ns(seconds: f64) -> Time {
    // `as` saturates; negative and NaN become 0.
    (seconds.max(0.0) * 1e9).round() as Time
}

fn secs(t: Time) -> f64 {
    t as f64 / 1e9
}

/// The native worker's reconnect backoff (crate::worker::work): first wait and cap, seconds.
const BACKOFF_START: f64 = 0.2;
const BACKOFF_MAX: f64 = 5.0;

/// What travels on a simulated connection.
#[derive(Debug)]
enum Wire {
    Frame(Vec<u8>),
    Close,
}

#[derive(Debug)]
enum Event {
    /// Worker → shard on connection `conn`.
    Up { shard: usize, conn: u64, wire: Wire },
    /// Shard → worker on connection `conn`.
    Down {
        participant: usize,
        shard: usize,
        conn: u64,
        wire: Wire,
    },
    /// A worker finished computing a gradient.
    ComputeDone { participant: usize, token: u64 },
    /// A worker leaves for a while.
    Leave { participant: usize, token: u64 },
    /// A worker (re)joins: after being away, after a lost session, or at the start.
    Return { participant: usize, token: u64 },
    /// SSP: re-check a waiting pull (a silent worker may have timed out).
    SspRecheck { shard: usize, conn: u64, token: u64 },
    /// sync: a waiting pull's straggler timeout.
    SyncTimeout { shard: usize, conn: u64, token: u64 },
}

#[derive(Debug)]
struct Scheduled {
    time: Time,
    seq: u64,
    event: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.time, self.seq) == (other.time, other.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    /// Reversed, so that `BinaryHeap` (a max-heap) pops the earliest event first.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.time, other.seq).cmp(&(self.time, self.seq))
    }
}

/// One simulated connection as the shard sees it.
#[derive(Debug)]
struct Conn {
    participant: usize,
    /// Set by Hello.
    worker: Option<u64>,
    /// Frames received and not yet handled (a waiting pull holds up the rest).
    inbox: VecDeque<Wire>,
    /// Token of the timer of the pull waiting at the head of the inbox.
    blocked: Option<u64>,
    /// Delivery time of the last message sent down (FIFO).
    down_last: Time,
}

#[derive(Debug)]
struct SimShard {
    core: ShardCore,
    clock: SspClock,
    range: KeyRange,
    /// Workers that said Hello and have not left (the server's `workers` count).
    connected: usize,
    conns: BTreeMap<u64, Conn>,
    scratch: Vec<f32>,
    limit: usize,
}

#[derive(Debug)]
struct Paused {
    /// Frames that arrived while paused, handled on resume.
    held: VecDeque<(usize, Wire)>,
    /// Compute time left of the step in progress.
    remaining: Option<Time>,
}

#[derive(Debug)]
struct Session {
    worker: Worker,
    conns: Vec<u64>,
    up_last: Vec<Time>,
    /// Token and completion time of the step being computed.
    compute: Option<(u64, Time)>,
    paused: Option<Paused>,
    steps_before: u64,
}

#[derive(Debug)]
struct Participant {
    partition: usize,
    mean_step: f64,
    faulty: bool,
    step_rng: Rng,
    net_rng: Rng,
    life_rng: Rng,
    fault_rng: Rng,
    session: Option<Box<Session>>,
    /// Only the Return event with this token is current.
    return_token: u64,
    /// Only the Leave event with this token is current.
    leave_token: u64,
    /// Left and not yet back (the next Return schedules the next Leave).
    away: bool,
    stats: WorkerStats,
    backoff: f64,
    sessions: u32,
}

enum Handled {
    Done,
    Blocked,
    Closed,
}

/// An independent random stream for `(tag, index)`, so that e.g. adding faulty workers does
/// not change the speeds drawn.
fn stream(seed: u64, tag: u64, index: u64) -> Rng {
    let mut r = Rng::new(
        seed ^ tag.wrapping_mul(0xA076_1D64_78BD_642F) ^ index.wrapping_mul(0xE703_7ED1_A0B4_28DB),
    );
    Rng::new(r.next_u64())
}

fn exponential(rng: &mut Rng, mean: f64) -> f64 {
    -mean * (1.0 - rng.next_f64()).ln()
}

fn mean_one_lognormal(rng: &mut Rng, sigma: f64) -> f64 {
    if sigma == 0.0 {
        1.0
    } else {
        (sigma * rng.normal() - sigma * sigma / 2.0).exp()
    }
}

/// Every `len / n`-th test example (the MNIST test set's two halves differ in difficulty, so
/// a strided subset is fairer than the first n).
fn strided_subset(test: &Dataset, n: usize) -> Result<Dataset> {
    if n == 0 || n >= test.len() {
        return Ok(test.clone());
    }
    let mut pixels = Vec::with_capacity(n * test.features);
    let mut labels = Vec::with_capacity(n);
    for i in 0..n {
        let j = i * test.len() / n;
        pixels.extend_from_slice(test.pixels(j));
        labels.push(test.labels()[j]);
    }
    let mut dims = vec![n];
    dims.extend(&test.image_dims);
    Ok(Dataset::from_idx(
        &encode_idx(&dims, &pixels),
        &encode_idx(&[n], &labels),
    )?)
}

/// Rewrites a push frame as a faulty worker would send it; other frames pass unchanged.
fn corrupt(frame: Vec<u8>, fault: Fault, rng: &mut Rng) -> (Vec<u8>, bool) {
    let Ok(Message::Push {
        request_id,
        shard,
        base_version,
        samples,
        grad,
    }) = wire::decode(&frame, usize::MAX)
    else {
        return (frame, false);
    };
    let mut g: Vec<f32> = grad.iter().collect();
    if g.is_empty() {
        return (frame, false);
    }
    match fault {
        Fault::Nan => {
            let i = rng.below(g.len() as u64) as usize;
            g[i] = f32::NAN;
        }
        Fault::Noise => {
            let norm = g.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
            let z: Vec<f64> = g.iter().map(|_| rng.normal()).collect();
            let zn = z.iter().map(|v| v * v).sum::<f64>().sqrt().max(1e-30);
            for (o, v) in g.iter_mut().zip(z) {
                *o = (v * norm / zn) as f32;
            }
        }
        Fault::Scale(f) => g.iter_mut().for_each(|v| *v *= f),
    }
    (
        wire::encode_push(request_id, shard, base_version, samples, &g),
        true,
    )
}

/// The simulation state.
pub(super) struct Engine<'a> {
    cfg: &'a SimConfig,
    model: Model,
    spec: RunSpec,
    parts: Vec<Dataset>,
    test: &'a Dataset,
    test_subset: Dataset,
    shards: Vec<SimShard>,
    people: Vec<Participant>,
    queue: BinaryHeap<Scheduled>,
    seq: u64,
    now: Time,
    next_token: u64,
    next_worker_id: u64,
    next_conn: u64,
    /// Messages scheduled and not yet delivered (the drain at the end waits for them).
    in_flight: u64,
    /// The budget is spent: no new steps, no joins or departures; in-flight messages drain.
    stopping: bool,
    totals: Totals,
    /// Staleness of pushes accepted since the last row: sum, count, max.
    interval: (u64, u64, u64),
    rows: Vec<Row>,
    reads: Vec<ReadRecord>,
    next_eval: u64,
    last_step_at: Time,
    stall_after: Time,
    params: Vec<f32>,
}

impl<'a> Engine<'a> {
    /// Builds the model, shards, data partitions and workers for `cfg`.
    pub(super) fn new(cfg: &'a SimConfig, data: &'a TrainTest) -> Result<Self> {
        let train = &data.train;
        let classes = train.classes().max(data.test.classes());
        let spec = ModelSpec::parse(&cfg.model, train.features, classes)?;
        let model = Model::new(spec.clone())?;
        let ranges = partition(model.param_len(), cfg.shards)?;
        let initial = model.init_params(cfg.seed);
        let bound = match cfg.consistency {
            Consistency::Ssp { bound } => bound,
            _ => u64::MAX / 2,
        };
        let shards = ranges
            .iter()
            .map(|r| SimShard {
                core: ShardCore::new(
                    initial[r.start..r.end].to_vec(),
                    cfg.optimizer,
                    cfg.staleness,
                    cfg.consistency,
                ),
                clock: SspClock::new(bound, cfg.heartbeat),
                range: *r,
                connected: 0,
                conns: BTreeMap::new(),
                scratch: vec![0.0; r.len()],
                limit: HEADER_LEN + MAX_META_LEN + 4 * r.len(),
            })
            .collect();
        let spec = RunSpec {
            run_id: format!("sim-{}", cfg.seed),
            model: spec,
            optimizer: cfg.optimizer,
            batch_size: cfg.batch_size,
            seed: cfg.seed,
            consistency: cfg.consistency.to_string(),
            shards: crowdgrad_core::spec::shard_map(&ranges),
            dataset: DataInfo {
                name: "mnist".into(),
                image_dims: train.image_dims.clone(),
                classes,
                train_len: train.len(),
                test_len: data.test.len(),
            },
        };
        spec.validate()?;
        if cfg.partitions > train.len() {
            return Err(Error::Config(format!(
                "--partitions {} exceeds the {} training examples",
                cfg.partitions,
                train.len()
            )));
        }
        let parts = (0..cfg.partitions)
            .map(|i| train.subset(train.partition(i, cfg.partitions)?))
            .collect::<crowdgrad_core::Result<Vec<_>>>()?;
        let mut speeds = stream(cfg.seed, 1, 0);
        let mut faults = stream(cfg.seed, 2, 0);
        let mut order: Vec<usize> = (0..cfg.workers).collect();
        faults.shuffle(&mut order);
        let n_faulty = (cfg.faulty * cfg.workers as f64).round() as usize;
        let mut faulty = vec![false; cfg.workers];
        for &i in &order[..n_faulty.min(cfg.workers)] {
            faulty[i] = true;
        }
        let people = (0..cfg.workers)
            .map(|i| {
                let factor = match cfg.speed {
                    SpeedDist::Fixed => 1.0,
                    SpeedDist::Uniform { spread } => 1.0 + spread * (2.0 * speeds.next_f64() - 1.0),
                    SpeedDist::LogNormal { sigma } => mean_one_lognormal(&mut speeds, sigma),
                };
                let i64 = i as u64;
                Participant {
                    partition: i % cfg.partitions,
                    mean_step: cfg.step_time * factor,
                    faulty: faulty[i],
                    step_rng: stream(cfg.seed, 3, i64),
                    net_rng: stream(cfg.seed, 4, i64),
                    life_rng: stream(cfg.seed, 5, i64),
                    fault_rng: stream(cfg.seed, 6, i64),
                    session: None,
                    return_token: 0,
                    leave_token: 0,
                    away: false,
                    stats: WorkerStats::default(),
                    backoff: BACKOFF_START,
                    sessions: 0,
                }
            })
            .collect();
        let stall = 120.0f64.max(20.0 * (cfg.step_time + cfg.away + 4.0 * cfg.delay));
        Ok(Self {
            test_subset: strided_subset(&data.test, cfg.eval_subset)?,
            test: &data.test,
            params: Vec::with_capacity(model.param_len()),
            cfg,
            model,
            spec,
            parts,
            shards,
            people,
            queue: BinaryHeap::new(),
            seq: 0,
            now: 0,
            next_token: 1,
            next_worker_id: 1,
            next_conn: 1,
            in_flight: 0,
            stopping: false,
            totals: Totals::default(),
            interval: (0, 0, 0),
            rows: Vec::new(),
            reads: Vec::new(),
            next_eval: cfg.eval_every,
            last_step_at: 0,
            stall_after: ns(stall),
        })
    }

    fn schedule(&mut self, at: Time, event: Event) {
        if matches!(event, Event::Up { .. } | Event::Down { .. }) {
            self.in_flight += 1;
        }
        self.seq += 1;
        self.queue.push(Scheduled {
            time: at,
            seq: self.seq,
            event,
        });
    }

    fn token(&mut self) -> u64 {
        self.next_token += 1;
        self.next_token
    }

    fn now_s(&self) -> f64 {
        secs(self.now)
    }

    /// One message's transit time: latency with jitter, plus size over bandwidth.
    fn transit(cfg: &SimConfig, rng: &mut Rng, bytes: usize) -> Time {
        let j = cfg.delay_jitter * (2.0 * rng.next_f64() - 1.0);
        let mut d = cfg.delay * (1.0 + j);
        if let Some(bw) = cfg.bandwidth {
            d += bytes as f64 * 8.0 / bw;
        }
        ns(d)
    }

    fn wire_len(w: &Wire) -> usize {
        match w {
            Wire::Frame(f) => f.len(),
            Wire::Close => 0,
        }
    }

    /// Sends from participant `p` to `shard` on its current session's connection.
    fn send_up(&mut self, p: usize, shard: usize, wire: Wire) {
        let cfg = self.cfg;
        let now = self.now;
        let person = &mut self.people[p];
        let Some(s) = person.session.as_mut() else {
            return;
        };
        let at = (now + Self::transit(cfg, &mut person.net_rng, Self::wire_len(&wire)))
            .max(s.up_last[shard]);
        s.up_last[shard] = at;
        let conn = s.conns[shard];
        self.schedule(at, Event::Up { shard, conn, wire });
    }

    /// Sends from `shard` on connection `conn` to its worker.
    fn send_down(&mut self, shard: usize, conn: u64, wire: Wire) {
        let cfg = self.cfg;
        let now = self.now;
        let Some(c) = self.shards[shard].conns.get_mut(&conn) else {
            return;
        };
        let p = c.participant;
        let at = (now + Self::transit(cfg, &mut self.people[p].net_rng, Self::wire_len(&wire)))
            .max(c.down_last);
        c.down_last = at;
        self.schedule(
            at,
            Event::Down {
                participant: p,
                shard,
                conn,
                wire,
            },
        );
    }

    /// Runs to the budget, drains in-flight messages and evaluates on the full test set.
    pub(super) fn run(mut self, on_row: &mut dyn FnMut(&Row)) -> Result<SimResult> {
        for p in 0..self.people.len() {
            let t = self.token();
            self.people[p].return_token = t;
            self.schedule(
                0,
                Event::Return {
                    participant: p,
                    token: t,
                },
            );
            self.schedule_leave(p);
        }
        let first = self.evaluate(false);
        on_row(&first);
        self.rows.push(first);
        let limit = self.cfg.sim_seconds.map(ns);
        while let Some(Scheduled { time, event, .. }) = self.queue.pop() {
            if limit.is_some_and(|l| time > l) {
                self.stopping = true;
            }
            if self.stopping && self.in_flight == 0 {
                break;
            }
            self.now = time;
            self.totals.events += 1;
            if !self.stopping && self.now.saturating_sub(self.last_step_at) > self.stall_after {
                self.totals.stalled = true;
                self.stopping = true;
            }
            self.dispatch(event, on_row)?;
            if self.stopping && self.in_flight == 0 {
                break;
            }
        }
        let last = self.evaluate(true);
        on_row(&last);
        self.rows.push(last);
        Ok(self.finish())
    }

    fn dispatch(&mut self, event: Event, on_row: &mut dyn FnMut(&Row)) -> Result<()> {
        match event {
            Event::Up { shard, conn, wire } => {
                self.in_flight -= 1;
                if let Some(c) = self.shards[shard].conns.get_mut(&conn) {
                    c.inbox.push_back(wire);
                    self.pump(shard);
                }
            }
            Event::Down {
                participant,
                shard,
                conn,
                wire,
            } => {
                self.in_flight -= 1;
                let Some(s) = self.people[participant].session.as_mut() else {
                    return Ok(());
                };
                if s.conns[shard] != conn {
                    return Ok(());
                }
                if let Some(paused) = s.paused.as_mut() {
                    paused.held.push_back((shard, wire));
                    return Ok(());
                }
                self.deliver(participant, shard, wire);
            }
            Event::ComputeDone { participant, token } => {
                if !self.stopping {
                    self.compute_done(participant, token, on_row)?;
                }
            }
            Event::Leave { participant, token } => {
                if !self.stopping && self.people[participant].leave_token == token {
                    self.leave(participant)?;
                }
            }
            Event::Return { participant, token } => {
                if !self.stopping && self.people[participant].return_token == token {
                    self.come_back(participant)?;
                }
            }
            Event::SspRecheck { shard, conn, token } => {
                if self.blocked(shard, conn, token) {
                    self.pump(shard);
                    if self.blocked(shard, conn, token) {
                        self.arm_ssp_recheck(shard, conn, token);
                    }
                }
            }
            Event::SyncTimeout { shard, conn, token } => {
                if self.blocked(shard, conn, token) {
                    // Stragglers: apply what was gathered so far (backup workers).
                    self.shards[shard].core.flush();
                    self.pump(shard);
                    if self.blocked(shard, conn, token) {
                        let at = self.now + ns(self.cfg.sync_timeout);
                        self.schedule(at, Event::SyncTimeout { shard, conn, token });
                    }
                }
            }
        }
        Ok(())
    }

    fn blocked(&self, shard: usize, conn: u64, token: u64) -> bool {
        self.shards[shard]
            .conns
            .get(&conn)
            .is_some_and(|c| c.blocked == Some(token))
    }

    fn arm_ssp_recheck(&mut self, shard: usize, conn: u64, token: u64) {
        // As the server: wait for a clock change, at most until the next heartbeat expiry or
        // one second, plus a millisecond.
        let now = self.now_s();
        let expiry = self.shards[shard]
            .clock
            .next_expiry(now)
            .map(|t| (t - now).max(0.0));
        let at = self.now + ns(expiry.unwrap_or(1.0).min(1.0) + 0.001);
        self.schedule(at, Event::SspRecheck { shard, conn, token });
    }

    fn schedule_leave(&mut self, p: usize) {
        let Some(every) = self.cfg.dropout_every else {
            return;
        };
        let t = self.token();
        let person = &mut self.people[p];
        person.leave_token = t;
        let at = self.now + ns(exponential(&mut person.life_rng, every));
        self.schedule(
            at,
            Event::Leave {
                participant: p,
                token: t,
            },
        );
    }

    // ---------------------------------------------------------------- worker side

    /// A participant (re)joins or resumes.
    fn come_back(&mut self, p: usize) -> Result<()> {
        let was_away = std::mem::take(&mut self.people[p].away);
        let paused = self.people[p]
            .session
            .as_mut()
            .and_then(|s| s.paused.take());
        match paused {
            Some(paused) => self.resume(p, paused),
            None if self.people[p].session.is_none() => self.start_session(p)?,
            None => {}
        }
        if was_away {
            self.schedule_leave(p);
        }
        Ok(())
    }

    fn start_session(&mut self, p: usize) -> Result<()> {
        let id = self.next_worker_id;
        self.next_worker_id += 1;
        let person = &self.people[p];
        let part = &self.parts[person.partition];
        let join = JoinResponse {
            protocol: PROTOCOL_VERSION,
            worker_id: id,
            run: self.spec.clone(),
            partition: PartitionInfo {
                index: person.partition,
                count: self.cfg.partitions,
                examples: part.len(),
                images: String::new(),
                labels: String::new(),
            },
        };
        let mut worker = Worker::new(join, part.clone(), ClientKind::Browser, None)?;
        worker.carry_stats(person.stats.clone());
        let n = self.shards.len();
        let conns: Vec<u64> = (0..n).map(|i| self.next_conn + i as u64).collect();
        self.next_conn += n as u64;
        for (s, &c) in conns.iter().enumerate() {
            self.shards[s].conns.insert(
                c,
                Conn {
                    participant: p,
                    worker: None,
                    inbox: VecDeque::new(),
                    blocked: None,
                    down_last: 0,
                },
            );
            worker.connected(s);
        }
        let person = &mut self.people[p];
        person.sessions += 1;
        person.session = Some(Box::new(Session {
            steps_before: person.stats.steps,
            worker,
            conns,
            up_last: vec![0; n],
            compute: None,
            paused: None,
        }));
        self.flush_outbox(p);
        Ok(())
    }

    fn resume(&mut self, p: usize, mut paused: Paused) {
        while let Some((shard, wire)) = paused.held.pop_front() {
            if self.people[p].session.is_none() {
                return;
            }
            self.deliver(p, shard, wire);
        }
        if let Some(left) = paused.remaining {
            let t = self.token();
            let at = self.now + left;
            if let Some(s) = self.people[p].session.as_mut() {
                s.compute = Some((t, at));
                self.schedule(
                    at,
                    Event::ComputeDone {
                        participant: p,
                        token: t,
                    },
                );
            }
        } else {
            self.maybe_compute(p);
        }
    }

    /// Hands a frame or a close from `shard` to the participant's worker.
    fn deliver(&mut self, p: usize, shard: usize, wire: Wire) {
        let Some(s) = self.people[p].session.as_mut() else {
            return;
        };
        let ok = match wire {
            Wire::Frame(bytes) => s.worker.receive(shard, &bytes).is_ok(),
            Wire::Close => {
                s.worker.disconnected(shard);
                false
            }
        };
        if ok {
            self.flush_outbox(p);
            self.maybe_compute(p);
        } else {
            // The native driver ends the session on any receive error or close.
            self.end_session(p, true);
        }
    }

    /// Closes every connection of the session; with `retry`, schedules a rejoin after the
    /// backoff (the native worker's reconnect loop).
    fn end_session(&mut self, p: usize, retry: bool) {
        let Some(s) = self.people[p].session.as_ref() else {
            return;
        };
        for shard in 0..s.conns.len() {
            self.send_up(p, shard, Wire::Close);
        }
        let Some(mut s) = self.people[p].session.take() else {
            return;
        };
        for shard in 0..s.conns.len() {
            // Counts pushes still unanswered as lost.
            s.worker.disconnected(shard);
        }
        let person = &mut self.people[p];
        person.stats = s.worker.stats().clone();
        if retry {
            if person.stats.steps > s.steps_before {
                person.backoff = BACKOFF_START;
            }
            let wait = person.backoff;
            person.backoff = (person.backoff * 2.0).min(BACKOFF_MAX);
            let t = self.token();
            self.people[p].return_token = t;
            self.schedule(
                self.now + ns(wait),
                Event::Return {
                    participant: p,
                    token: t,
                },
            );
        }
    }

    fn leave(&mut self, p: usize) -> Result<()> {
        let now = self.now;
        let kind = self.cfg.dropout_kind;
        let person = &mut self.people[p];
        person.away = true;
        let mut paused = false;
        if let (DropoutKind::Pause, Some(s)) = (kind, person.session.as_mut()) {
            if s.paused.is_none() {
                let remaining = s.compute.take().map(|(_, at)| at.saturating_sub(now));
                s.paused = Some(Paused {
                    held: VecDeque::new(),
                    remaining,
                });
            }
            paused = true;
        }
        if !paused {
            self.end_session(p, false);
        }
        let t = self.token();
        let person = &mut self.people[p];
        person.return_token = t;
        let at = now + ns(exponential(&mut person.life_rng, self.cfg.away));
        self.schedule(
            at,
            Event::Return {
                participant: p,
                token: t,
            },
        );
        Ok(())
    }

    fn flush_outbox(&mut self, p: usize) {
        let fault = self.cfg.fault;
        loop {
            let person = &mut self.people[p];
            let Some(s) = person.session.as_mut() else {
                return;
            };
            let Some(out) = s.worker.poll_transmit() else {
                return;
            };
            let frame = if person.faulty {
                let (f, corrupted) = corrupt(out.frame, fault, &mut person.fault_rng);
                self.totals.faulty_pushes += u64::from(corrupted);
                f
            } else {
                out.frame
            };
            self.send_up(p, out.shard, Wire::Frame(frame));
        }
    }

    fn maybe_compute(&mut self, p: usize) {
        if self.stopping {
            return;
        }
        let jitter = self.cfg.jitter;
        let now = self.now;
        let person = &mut self.people[p];
        let Some(s) = person.session.as_mut() else {
            return;
        };
        if s.paused.is_some() || s.compute.is_some() || !s.worker.ready() {
            return;
        }
        let dur = ns(person.mean_step * mean_one_lognormal(&mut person.step_rng, jitter)).max(1);
        self.next_token += 1;
        let t = self.next_token;
        s.compute = Some((t, now + dur));
        self.schedule(
            now + dur,
            Event::ComputeDone {
                participant: p,
                token: t,
            },
        );
    }

    fn compute_done(&mut self, p: usize, token: u64, on_row: &mut dyn FnMut(&Row)) -> Result<()> {
        let Some(s) = self.people[p].session.as_mut() else {
            return Ok(());
        };
        if s.compute.map(|(t, _)| t) != Some(token) {
            return Ok(());
        }
        s.compute = None;
        // The gradient is computed from the parameters the worker pulled before the step
        // started: nothing reaches the worker's parameters between.
        let report = s.worker.step()?;
        self.totals.samples += report.samples as u64;
        self.totals.steps += 1;
        self.last_step_at = self.now;
        self.flush_outbox(p);
        self.maybe_compute(p);
        if self.cfg.samples.is_some_and(|b| self.totals.samples >= b) {
            self.stopping = true;
        } else if self.totals.samples >= self.next_eval {
            let every = self.cfg.eval_every;
            self.next_eval = (self.totals.samples / every + 1) * every;
            let row = self.evaluate(false);
            on_row(&row);
            self.rows.push(row);
        }
        Ok(())
    }

    // ---------------------------------------------------------------- shard side

    /// Handles queued frames on every connection of `shard` until nothing moves (a handled
    /// frame may let a waiting pull through).
    fn pump(&mut self, shard: usize) {
        loop {
            let ready: Vec<u64> = self.shards[shard]
                .conns
                .iter()
                .filter(|(_, c)| !c.inbox.is_empty())
                .map(|(&id, _)| id)
                .collect();
            let mut progressed = false;
            for conn in ready {
                progressed |= self.handle_conn(shard, conn);
            }
            if !progressed {
                return;
            }
        }
    }

    /// Handles `conn`'s frames in order until its inbox is empty, a pull must wait, or it
    /// closes. Returns whether any frame was consumed.
    fn handle_conn(&mut self, shard: usize, conn: u64) -> bool {
        let mut any = false;
        loop {
            let Some(c) = self.shards[shard].conns.get_mut(&conn) else {
                return any;
            };
            let Some(wire) = c.inbox.pop_front() else {
                return any;
            };
            match wire {
                Wire::Close => {
                    self.shard_close(shard, conn);
                    return true;
                }
                Wire::Frame(bytes) => match self.shard_frame(shard, conn, &bytes) {
                    Handled::Done => any = true,
                    Handled::Closed => return true,
                    Handled::Blocked => {
                        if let Some(c) = self.shards[shard].conns.get_mut(&conn) {
                            c.inbox.push_front(Wire::Frame(bytes));
                        }
                        return any;
                    }
                },
            }
        }
    }

    /// The server's handler + writer for one frame.
    fn shard_frame(&mut self, shard: usize, conn: u64, bytes: &[u8]) -> Handled {
        let now = self.now_s();
        let sh = &mut self.shards[shard];
        let msg = match wire::decode(bytes, sh.limit) {
            Ok(m) => m,
            Err(e) => {
                let id = bytes
                    .get(4..8)
                    .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                return self.shard_fail(shard, conn, id, ErrorCode::from(&e), e.to_string());
            }
        };
        let Some(c) = sh.conns.get(&conn) else {
            return Handled::Closed;
        };
        let worker = c.worker;
        if let Some(w) = worker {
            sh.clock.seen(w, now);
        }
        match msg {
            Message::Hello {
                request_id, hello, ..
            } => {
                if worker.is_some() {
                    return self.shard_fail(
                        shard,
                        conn,
                        request_id,
                        ErrorCode::Protocol,
                        "second Hello on one connection".into(),
                    );
                }
                if let Some(c) = sh.conns.get_mut(&conn) {
                    c.worker = Some(hello.worker_id);
                }
                sh.connected += 1;
                sh.clock.join(hello.worker_id, now);
                let frame = wire::encode(&Message::Welcome {
                    request_id,
                    shard: shard as u32,
                    welcome: Welcome {
                        protocol: PROTOCOL_VERSION,
                        range: sh.range,
                        version: sh.core.version(),
                    },
                });
                self.send_down(shard, conn, Wire::Frame(frame));
                Handled::Done
            }
            _ if worker.is_none() => self.shard_fail(
                shard,
                conn,
                0,
                ErrorCode::Protocol,
                "the first frame must be Hello".into(),
            ),
            Message::Pull {
                request_id,
                min_version,
                ..
            } => {
                let w = worker.unwrap_or(0);
                let may = match sh.core.consistency() {
                    Consistency::Async => true,
                    Consistency::Ssp { .. } => sh.clock.may_read(w, now),
                    Consistency::Sync { .. } => sh.core.version() >= min_version,
                };
                if !may {
                    let newly = sh.conns.get(&conn).is_some_and(|c| c.blocked.is_none());
                    if newly {
                        let t = self.token();
                        if let Some(c) = self.shards[shard].conns.get_mut(&conn) {
                            c.blocked = Some(t);
                        }
                        match self.cfg.consistency {
                            Consistency::Sync { .. } => {
                                let at = self.now + ns(self.cfg.sync_timeout);
                                self.schedule(
                                    at,
                                    Event::SyncTimeout {
                                        shard,
                                        conn,
                                        token: t,
                                    },
                                );
                            }
                            _ => self.arm_ssp_recheck(shard, conn, t),
                        }
                    }
                    return Handled::Blocked;
                }
                if let Some(c) = sh.conns.get_mut(&conn) {
                    c.blocked = None;
                }
                let (clock, min_clock) = match sh.core.consistency() {
                    Consistency::Ssp { .. } => sh.clock.read_view(w, now),
                    _ => (None, None),
                };
                let version = sh.core.version();
                let frame =
                    wire::encode_params(request_id, shard as u32, version, sh.core.values());
                if self.cfg.log_reads {
                    let participant = sh.conns.get(&conn).map_or(0, |c| c.participant);
                    self.reads.push(ReadRecord {
                        time_s: now,
                        worker: participant,
                        worker_id: w,
                        shard,
                        version,
                        clock,
                        min_clock,
                    });
                }
                self.send_down(shard, conn, Wire::Frame(frame));
                Handled::Done
            }
            Message::Push {
                request_id,
                base_version,
                grad,
                ..
            } => {
                self.totals.pushes += 1;
                // Validate everything before touching state, as the server's writer does.
                if let Err(e) = grad.copy_into(&mut sh.scratch) {
                    return self.shard_fail(
                        shard,
                        conn,
                        request_id,
                        ErrorCode::from(&e),
                        e.to_string(),
                    );
                }
                let outcome = sh.core.push(base_version, &sh.scratch);
                let (version, staleness) = match outcome {
                    Outcome::Applied {
                        version, staleness, ..
                    } => (version, staleness),
                    Outcome::Buffered { version, pending } => {
                        // Fewer workers connected than K: do not wait for gradients that
                        // cannot come.
                        if pending >= sh.connected {
                            sh.core.flush();
                        }
                        (version, 0)
                    }
                    Outcome::Rejected { code, message } => {
                        return self.shard_fail(shard, conn, request_id, code, message);
                    }
                };
                if let Some(w) = worker {
                    sh.clock.tick(w, now);
                }
                self.totals.accepted += 1;
                self.totals.staleness_sum += staleness;
                self.totals.staleness_max = self.totals.staleness_max.max(staleness);
                self.interval.0 += staleness;
                self.interval.1 += 1;
                self.interval.2 = self.interval.2.max(staleness);
                let ack = wire::encode(&Message::Ack {
                    request_id,
                    shard: shard as u32,
                    version,
                    staleness: staleness.min(u64::from(u32::MAX)) as u32,
                });
                self.send_down(shard, conn, Wire::Frame(ack));
                Handled::Done
            }
            Message::Bye { .. } => {
                self.shard_close(shard, conn);
                Handled::Closed
            }
            Message::Welcome { .. }
            | Message::Params { .. }
            | Message::Ack { .. }
            | Message::Error { .. } => self.shard_fail(
                shard,
                conn,
                0,
                ErrorCode::Protocol,
                "a worker sent a shard-side message".into(),
            ),
        }
    }

    /// The server's `fail`: count the rejection, send the error frame, close if fatal.
    fn shard_fail(
        &mut self,
        shard: usize,
        conn: u64,
        request_id: u32,
        code: ErrorCode,
        message: String,
    ) -> Handled {
        self.totals.rejected += 1;
        *self
            .totals
            .rejected_by_reason
            .entry(code.name().to_string())
            .or_insert(0) += 1;
        let frame = wire::encode_error(request_id, shard as u32, code, message);
        self.send_down(shard, conn, Wire::Frame(frame));
        if code.is_fatal() {
            self.send_down(shard, conn, Wire::Close);
            self.shard_close(shard, conn);
            Handled::Closed
        } else {
            Handled::Done
        }
    }

    /// The connection ended on the shard side: the worker leaves the SSP clock and the sync
    /// count; a sync shard applies what it has (the server's `worker_left`).
    fn shard_close(&mut self, shard: usize, conn: u64) {
        let sh = &mut self.shards[shard];
        let Some(c) = sh.conns.remove(&conn) else {
            return;
        };
        if let Some(w) = c.worker {
            sh.connected -= 1;
            sh.clock.leave(w);
            if matches!(sh.core.consistency(), Consistency::Sync { .. }) {
                sh.core.flush();
            }
        }
    }

    // ---------------------------------------------------------------- results

    fn evaluate(&mut self, full: bool) -> Row {
        self.params.clear();
        for s in &self.shards {
            self.params.extend_from_slice(s.core.values());
        }
        let set = if full { self.test } else { &self.test_subset };
        let stats = crate::app::evaluate(&self.model, &self.params, set);
        let (sum, count, max) = std::mem::take(&mut self.interval);
        Row {
            samples: self.totals.samples,
            sim_time_s: self.now_s(),
            test_loss: stats.mean_loss(),
            test_accuracy: stats.accuracy(),
            eval_examples: stats.count,
            mean_staleness: if count == 0 {
                0.0
            } else {
                sum as f64 / count as f64
            },
            max_staleness: max,
            updates: self.shards.iter().map(|s| s.core.version()).sum(),
            accepted: self.totals.accepted,
            rejected: self.totals.rejected,
            workers_online: self
                .people
                .iter()
                .filter(|p| p.session.as_ref().is_some_and(|s| s.paused.is_none()))
                .count(),
        }
    }

    fn finish(mut self) -> SimResult {
        self.totals.sim_seconds = self.now_s();
        self.totals.shard_versions = self.shards.iter().map(|s| s.core.version()).collect();
        self.totals.shard_pending = self.shards.iter().map(|s| s.core.pending()).collect();
        let workers = self
            .people
            .iter()
            .enumerate()
            .map(|(index, p)| {
                let st = p.session.as_ref().map_or(&p.stats, |s| s.worker.stats());
                WorkerSummary {
                    index,
                    mean_step_s: p.mean_step,
                    faulty: p.faulty,
                    partition: p.partition,
                    sessions: p.sessions,
                    steps: st.steps,
                    pushes_accepted: st.pushes_accepted,
                    pushes_rejected: st.pushes_rejected,
                    pushes_lost: st.pushes_lost,
                }
            })
            .collect();
        SimResult {
            config: self.cfg.clone(),
            rows: self.rows,
            totals: self.totals,
            workers,
            reads: self.reads,
            final_params: self.params,
            wall_seconds: 0.0,
        }
    }
}
