//! The discrete-event engine: simulated shards and simulated workers exchanging real wire
//! frames over simulated connections.
//!
//! Time is an integer number of simulated nanoseconds; the queue orders events by
//! `(time, sequence number)`, so ties resolve in scheduling order. Each simulated connection is
//! FIFO in each direction (a message never overtakes an earlier one on the same connection),
//! like a WebSocket.
//!
//! The shard side is [`super::shard::ShardDriver`]: core's shard session on simulated time, so
//! every rule (ordering, read waits, validation, errors, sync flushes) is the server's own.
//! The worker side drives core's [`Worker`] the way `crate::worker` does: step when ready,
//! reconnect after a lost session with core's [`Backoff`], the one every worker uses.

use super::config::{DropoutKind, SimConfig, SpeedDist};
use super::report::{PushCounts, ReadRecord, Row, SimResult, Totals, WorkerSummary};
use super::shard::{Output, ShardDriver};
use crate::error::{Error, Result};
use crate::support::data::TrainTest;
use crowdgrad_core::backoff::Backoff;
use crowdgrad_core::data::{encode_idx, Dataset};
use crowdgrad_core::model::{Model, ModelSpec};
use crowdgrad_core::partition::partition;
use crowdgrad_core::rng::Rng;
use crowdgrad_core::robust::{Aggregation, ZenoReference, ZENO_REFRESH};
use crowdgrad_core::session::Record;
use crowdgrad_core::shard::Outcome;
use crowdgrad_core::spec::{JoinResponse, PartitionInfo, RunParams, RunSpec};
use crowdgrad_core::wire::{ClientKind, ErrorCode, PROTOCOL_VERSION};
use crowdgrad_core::worker::{Worker, WorkerStats};
use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};

mod faults;
mod participants;
mod shard_side;

use faults::{exponential, mean_one_lognormal, stream, Faults};

/// Simulated nanoseconds.
type Time = u64;

fn ns(seconds: f64) -> Time {
    // `as` saturates; negative and NaN become 0.
    (seconds.max(0.0) * 1e9).round() as Time
}

fn secs(t: Time) -> f64 {
    t as f64 / 1e9
}

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
    /// A shard session's timer (a waiting pull's deadline).
    ShardTimer { shard: usize, conn: u64 },
    /// A worker's timer ([`Worker::poll_timeout`]: its next pulls waited for the shards'
    /// pace, issue 18), armed for time `at`.
    WorkerTimer { participant: usize, at: Time },
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

/// One simulated connection as the transport sees it (the session is in the driver).
#[derive(Debug)]
struct Link {
    participant: usize,
    /// Delivery time of the last message sent down (FIFO).
    down_last: Time,
}

#[derive(Debug)]
struct SimShard {
    driver: ShardDriver,
    links: BTreeMap<u64, Link>,
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
    /// Simulated compute time of the step being computed (reported to the worker).
    compute_dur: Time,
    paused: Option<Paused>,
    steps_before: u64,
    /// When it joined (the admission's probation counts sessions younger than it).
    joined: Time,
    /// When the worker's timer is armed for (a [`Event::WorkerTimer`] is scheduled).
    hold: Option<Time>,
}

#[derive(Debug)]
struct Participant {
    partition: usize,
    mean_step: f64,
    faulty: bool,
    /// A sybil (`--sybils`): joins at `--sybil-at`, never leaves, pushes per
    /// `--sybil-fault`, and its examples do not count in the budget.
    sybil: bool,
    /// What it does to its pushes (faulty workers and sybils).
    fault: Option<super::config::Fault>,
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
    backoff: Backoff,
    sessions: u32,
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
/// The simulation state.
pub(super) struct Engine<'a> {
    cfg: &'a SimConfig,
    model: Model,
    spec: RunSpec,
    parts: Vec<Dataset>,
    /// What faulty workers remember, and the shuffled data of `shuffled_labels` ones.
    faults: Faults,
    test: std::borrow::Cow<'a, Dataset>,
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
    /// `--aggregation zeno`: the validation batch's gradient, and shard 0's version when the
    /// shards last got it.
    zeno: Option<(ZenoReference, u64)>,
}

impl<'a> Engine<'a> {
    /// Builds the model, shards, data partitions and workers for `cfg`.
    pub(super) fn new(cfg: &'a SimConfig, data: &'a TrainTest) -> Result<Self> {
        let train = &data.train;
        let name = if data.text.is_some() { "text" } else { "mnist" };
        let info = data.info(name);
        let spec = ModelSpec::parse_shaped(&cfg.model, &train.image_dims, info.classes)?;
        let model = Model::new(spec.clone())?;
        let ranges = partition(model.param_len(), cfg.shards)?;
        let initial = model.init_params(cfg.seed);
        let training = cfg.training();
        let shards = ranges
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let setup = training.shard_setup(false, initial.len());
                let state = setup.state(i as u32, *r, initial[r.start..r.end].to_vec())?;
                Ok(SimShard {
                    driver: ShardDriver::new(state, cfg.announce_spot_checks),
                    links: BTreeMap::new(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let spec = RunSpec::build(RunParams {
            run_id: format!("sim-{}", cfg.seed),
            model: cfg.model.clone(),
            optimizer: cfg.optimizer,
            batch_size: cfg.batch_size,
            seed: cfg.seed,
            consistency: cfg.consistency,
            shards: cfg.shards,
            dataset: info,
            local: cfg.exchange.local,
            normalize: data.normalize(&cfg.normalize)?,
        })?;
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
        // Sybils come after the workers, with speeds of their own stream: adding them
        // changes no draw of the workers'.
        let mut sybil_speeds = stream(cfg.seed, 9, 0);
        let people = (0..cfg.workers + cfg.sybils)
            .map(|i| {
                let sybil = i >= cfg.workers;
                let speeds = if sybil {
                    &mut sybil_speeds
                } else {
                    &mut speeds
                };
                let factor = match cfg.speed {
                    SpeedDist::Fixed => 1.0,
                    SpeedDist::Uniform { spread } => 1.0 + spread * (2.0 * speeds.next_f64() - 1.0),
                    SpeedDist::LogNormal { sigma } => mean_one_lognormal(speeds, sigma),
                };
                let i64 = i as u64;
                let faulty = !sybil && faulty[i];
                Participant {
                    partition: i % cfg.partitions,
                    mean_step: cfg.step_time * factor,
                    faulty,
                    sybil,
                    fault: if sybil {
                        Some(cfg.sybil_fault)
                    } else {
                        faulty.then_some(cfg.fault)
                    },
                    step_rng: stream(cfg.seed, 3, i64),
                    net_rng: stream(cfg.seed, 4, i64),
                    life_rng: stream(cfg.seed, 5, i64),
                    fault_rng: stream(cfg.seed, 6, i64),
                    session: None,
                    return_token: 0,
                    leave_token: 0,
                    away: false,
                    stats: WorkerStats::default(),
                    backoff: Backoff::new(stream(cfg.seed, 7, i64).next_u64()),
                    sessions: 0,
                }
            })
            .collect::<Vec<Participant>>();
        let kinds: Vec<_> = people.iter().map(|p| p.fault).collect();
        let faults = Faults::new(cfg, &parts, &kinds)?;
        let zeno = if matches!(cfg.aggregation, Aggregation::Zeno { .. }) {
            let mut t = train.clone();
            t.set_normalize(&spec.normalize)?;
            Some((ZenoReference::new(Model::new(spec.model.clone())?, &t)?, 0))
        } else {
            None
        };
        let stall = 120.0f64.max(20.0 * (cfg.step_time + cfg.away + 4.0 * cfg.delay));
        Ok(Self {
            test_subset: {
                let mut t = strided_subset(&data.test, cfg.eval_subset)?;
                t.set_normalize(&spec.normalize)?;
                t
            },
            test: if spec.normalize.is_identity() {
                std::borrow::Cow::Borrowed(&data.test)
            } else {
                let mut t = data.test.clone();
                t.set_normalize(&spec.normalize)?;
                std::borrow::Cow::Owned(t)
            },
            params: Vec::with_capacity(model.param_len()),
            zeno,
            cfg,
            model,
            spec,
            parts,
            faults,
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
        let Some(c) = self.shards[shard].links.get_mut(&conn) else {
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
        self.refresh_zeno(true);
        for p in 0..self.people.len() {
            let t = self.token();
            self.people[p].return_token = t;
            let at = if self.people[p].sybil {
                ns(self.cfg.sybil_at)
            } else {
                0
            };
            self.schedule(
                at,
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
                let now = self.now_s();
                let mut out = Vec::new();
                let driver = &mut self.shards[shard].driver;
                match wire {
                    Wire::Frame(bytes) => driver.receive(conn, &bytes, now, &mut out),
                    Wire::Close => driver.close(conn, now, &mut out),
                }
                self.shard_outputs(shard, out);
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
            Event::WorkerTimer { participant, at } => {
                if !self.stopping {
                    self.worker_timer(participant, at);
                }
            }
            Event::ShardTimer { shard, conn } => {
                let now = self.now_s();
                let mut out = Vec::new();
                self.shards[shard].driver.timer(conn, now, &mut out);
                self.shard_outputs(shard, out);
            }
        }
        Ok(())
    }
}

impl Engine<'_> {
    /// `zeno`: gives every shard its slice of the validation batch's gradient at the current
    /// parameters, at the start and then every [`ZENO_REFRESH`] updates of shard 0 (as the
    /// server does).
    pub(super) fn refresh_zeno(&mut self, force: bool) {
        let Some((reference, last)) = &mut self.zeno else {
            return;
        };
        let version = self.shards[0].driver.state().version();
        if !force && version < *last + ZENO_REFRESH {
            return;
        }
        *last = version;
        self.params.clear();
        for s in &self.shards {
            self.params.extend_from_slice(s.driver.state().values());
        }
        if let Ok(g) = reference.gradient(&self.params) {
            for s in &mut self.shards {
                let r = s.driver.state().config().range;
                s.driver.set_reference(&g[r.start..r.end]);
            }
        }
    }

    // ---------------------------------------------------------------- results

    fn evaluate(&mut self, full: bool) -> Row {
        self.params.clear();
        for s in &self.shards {
            // With --ema, the shard's moving average (what `serve` evaluates too).
            let state = s.driver.state();
            let values = state.core().average().unwrap_or(state.values());
            self.params.extend_from_slice(values);
        }
        let set = if full { &*self.test } else { &self.test_subset };
        let stats = crowdgrad_core::eval::evaluate(&self.model, &self.params, set);
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
            updates: self.shards.iter().map(|s| s.driver.state().version()).sum(),
            accepted: self.totals.accepted,
            rejected: self.totals.rejected,
            sybil_accepted: self.totals.sybil_pushes.accepted,
            sybil_rejected: self.totals.sybil_pushes.rejected(),
            norm_reference: {
                let now = self.now_s();
                self.shards[0].driver.norm_reference(now).unwrap_or(0.0)
            },
            workers_online: self
                .people
                .iter()
                .filter(|p| p.session.as_ref().is_some_and(|s| s.paused.is_none()))
                .count(),
        }
    }

    fn finish(mut self) -> SimResult {
        self.totals.sim_seconds = self.now_s();
        self.totals.shard_versions = self
            .shards
            .iter()
            .map(|s| s.driver.state().version())
            .collect();
        let now = self.now_s();
        self.totals.trust = self
            .shards
            .iter()
            .map(|s| s.driver.state().trust_counts(now))
            .collect();
        self.totals.shard_pending = self
            .shards
            .iter()
            .map(|s| s.driver.state().core().pending())
            .collect();
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
                    sybil: p.sybil,
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
