//! An honest worker's round pushes under local steps, for attackers that must look like one:
//! core's own [`Worker`] state machine (the code `crowdgrad work` and the browser run), fed
//! over a loopback with the parameters an attacker pulled on its real sockets.
//!
//! Under `serve`'s default `--local-steps auto` a round's push is the pseudo-gradient
//! Δ = θ_pulled − θ_local after `H` inner steps of the run's inner optimizer on the worker's
//! own batches, tagged `{batch, versions}` and with `samples` = H × batch size
//! (docs/protocol.md §1 `local`, §4a). [`Rounds`] does not re-implement any of it: it builds
//! a [`Worker`] for a joined attacker (its worker id, its partition, the run spec of its join
//! reply), answers the worker's Hello with a Welcome carrying what the real shard said
//! (spot checks, pacing) and its Pulls with Params frames holding the real pulled values,
//! versions and pace, runs its steps, and hands back the Push frames it formed: their
//! payload, tag, samples and base version are exactly what an honest worker with that id
//! would send for that round. `H` comes from the worker's own controller (the `auto` rule and
//! the pace rule, §1 and §4c), on a clock that advances only with the worker's compute and
//! the attacker's real pull latency, so it picks the H an honest worker at the same place
//! would. The attacker itself does not wait for the pace (nothing forces it to).

use crate::error::{Error, Result};
use crowdgrad_core::codec::Encoding;
use crowdgrad_core::data::Dataset;
use crowdgrad_core::spec::JoinResponse;
use crowdgrad_core::wire::{self, ClientKind, Message, PushTag, Welcome};
use crowdgrad_core::worker::Worker;
use std::time::Instant;

/// Inner steps a round may take before it is given up (the run's bound is at most 10,000).
const MAX_ROUND_STEPS: u32 = 10_000;

/// One shard's slice of an honest round push, as the worker formed it.
#[derive(Debug, Clone)]
pub(super) struct RoundPush {
    /// Base version (the version of the Params the round read on this shard).
    pub version: u64,
    /// The round's examples, H × batch size (the Push header's `aux`).
    pub samples: u32,
    /// The push tag (`{batch, versions}`); `None` when the shard does not spot-check.
    pub tag: Option<PushTag>,
    /// The slice: Δ = θ_pulled − θ_local (or the gradient at H = 1 runs).
    pub values: Vec<f32>,
}

/// A loopback-driven [`Worker`]: one honest round at a time.
pub(super) struct Rounds {
    worker: Worker,
    /// The request ids of the worker's outstanding Pulls, per shard.
    pulls: Vec<Option<u32>>,
    /// The worker's clock, seconds: its compute and the real pull latencies only.
    clock: f64,
    /// Inner steps of the last round.
    pub last_h: u32,
}

fn protocol(e: impl std::fmt::Display) -> Error {
    Error::Process(format!("the attackers' round oracle: {e}"))
}

impl Rounds {
    /// A worker for the attacker `joined` (its partition of the raw training set `train`),
    /// welcomed on every shard as `welcomes` (the real shards' Welcomes to that attacker; the
    /// encodings are f32 both ways, as the attacker's own sockets negotiated).
    ///
    /// # Errors
    /// A partition that does not fit, a run spec the worker refuses.
    pub fn new(joined: &JoinResponse, train: &Dataset, welcomes: &[Welcome]) -> Result<Self> {
        let range = train.partition(joined.partition.index, joined.partition.count)?;
        let part = train.subset(range)?;
        let worker = Worker::new(joined.clone(), part, ClientKind::Native, None)?;
        let mut r = Rounds {
            pulls: vec![None; worker.shard_count()],
            worker,
            clock: 0.0,
            last_h: 0,
        };
        r.worker.set_time(r.clock);
        for (s, w) in welcomes.iter().enumerate() {
            r.worker.connected(s);
            let mut hello = None;
            while let Some(o) = r.worker.poll_transmit() {
                if let Ok(Message::Hello { request_id, .. }) = wire::decode(&o.frame, usize::MAX) {
                    hello = Some(request_id);
                }
            }
            let request_id = hello.ok_or_else(|| protocol("no Hello"))?;
            let welcome = Welcome {
                pull_encoding: Encoding::F32,
                push_encoding: Encoding::F32,
                reports: false,
                ..w.clone()
            };
            let f = wire::encode(&Message::Welcome {
                request_id,
                shard: s as u32,
                welcome,
            });
            r.worker.receive(s, &f).map_err(protocol)?;
        }
        r.drain_pulls();
        Ok(r)
    }

    /// Takes what the worker wants to send: its Pulls' ids are kept, its Pushes returned.
    fn drain_pulls(&mut self) -> Vec<(u32, Vec<u8>)> {
        let mut pushes = Vec::new();
        while let Some(o) = self.worker.poll_transmit() {
            match wire::decode(&o.frame, usize::MAX) {
                Ok(Message::Pull { request_id, .. }) => {
                    if let Some(p) = self.pulls.get_mut(o.shard) {
                        *p = Some(request_id);
                    }
                }
                Ok(Message::Push { request_id, .. }) => pushes.push((request_id, o.frame)),
                _ => {}
            }
        }
        pushes
    }

    /// One honest round on the parameters the attacker pulled: per shard its version, the
    /// pace in ms its Params said, and its values; `pull_s` the real latency of that pull.
    /// The round's push per shard, in shard order.
    ///
    /// # Errors
    /// A slice of the wrong length or non-finite values, a model error, a round that never
    /// ends.
    pub fn round(
        &mut self,
        pulled: &[(u64, u32, Vec<f32>)],
        pull_s: f64,
    ) -> Result<Vec<RoundPush>> {
        // A pace wait the worker asked for: its clock moves on (the attacker does not wait).
        if let Some(due) = self.worker.poll_timeout() {
            self.clock = self.clock.max(due);
            self.worker.handle_timeout(self.clock);
            self.drain_pulls();
        }
        self.clock += pull_s.max(0.0);
        self.worker.set_time(self.clock);
        for (s, (version, pace_ms, values)) in pulled.iter().enumerate() {
            let request_id = self
                .pulls
                .get_mut(s)
                .and_then(Option::take)
                .ok_or_else(|| protocol(format!("no Pull outstanding on shard {s}")))?;
            let f = wire::encode_params_paced(
                Encoding::F32,
                request_id,
                s as u32,
                *version,
                *pace_ms,
                values,
            )
            .map_err(protocol)?;
            self.worker.receive(s, &f).map_err(protocol)?;
        }
        let mut steps = 0u32;
        while self.worker.ready() {
            if steps >= MAX_ROUND_STEPS {
                return Err(protocol("a round did not end"));
            }
            self.worker.set_time(self.clock);
            let t = Instant::now();
            let report = self.worker.step().map_err(protocol)?;
            let dt = t.elapsed().as_secs_f64();
            self.clock += dt;
            self.worker.observe_compute(dt);
            steps += 1;
            if report.pushed {
                break;
            }
        }
        self.last_h = steps;
        self.worker.set_time(self.clock);
        let frames = self.drain_pulls();
        let mut out = Vec::with_capacity(frames.len());
        for (request_id, frame) in frames {
            let tag = wire::push_tag(&frame).map_err(protocol)?;
            let Ok(Message::Push {
                shard,
                base_version,
                samples,
                grad,
                ..
            }) = wire::decode(&frame, usize::MAX)
            else {
                return Err(protocol("a push that does not decode"));
            };
            out.push(RoundPush {
                version: base_version,
                samples,
                tag,
                values: grad.iter().collect(),
            });
            // Answered at once, so the worker's next round is not held by a push in flight.
            let ack = wire::encode(&Message::Ack {
                request_id,
                shard,
                version: base_version + 1,
                staleness: 0,
            });
            self.worker
                .receive(shard as usize, &ack)
                .map_err(protocol)?;
        }
        self.drain_pulls();
        if out.len() != self.pulls.len() {
            return Err(protocol(format!(
                "a round pushed {} of {} shards",
                out.len(),
                self.pulls.len()
            )));
        }
        Ok(out)
    }
}
