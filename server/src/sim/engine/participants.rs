//! The simulated volunteers: sessions, departures and returns, pauses, compute, and the
//! reconnect backoff, driving core's `Worker` the way `crate::worker` does.

use super::*;
use crate::registry::admission;

/// Seconds a refused join waits before it tries again (the server's retry-after).
const JOIN_RETRY_S: f64 = 5.0;

impl Engine<'_> {
    pub(super) fn schedule_leave(&mut self, p: usize) {
        let Some(every) = self.cfg.dropout_every else {
            return;
        };
        if self.people[p].sybil {
            // Sybils stay for good once they joined.
            return;
        }
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
    pub(super) fn come_back(&mut self, p: usize) -> Result<()> {
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

    /// The server's join admission (issue 21, `crate::registry::admission`): whether one more
    /// identity may join now, with the sessions younger than its probation counted as new and
    /// the older ones with a push accepted as established.
    fn admitted(&self) -> bool {
        let probation = ns(admission::PROBATION_S);
        let (mut new, mut established) = (0, 0);
        for s in self.people.iter().filter_map(|q| q.session.as_ref()) {
            if self.now.saturating_sub(s.joined) < probation {
                new += 1;
            } else if s.worker.stats().pushes_accepted > 0 {
                established += 1;
            }
        }
        admission::admits(new, established, admission::FLOOR)
    }

    pub(super) fn start_session(&mut self, p: usize) -> Result<()> {
        if !self.admitted() {
            // Refused (429 with a retry-after of 5 s on the server): it tries again then.
            self.totals.joins_refused += 1;
            let t = self.token();
            self.people[p].return_token = t;
            self.schedule(
                self.now + ns(JOIN_RETRY_S),
                Event::Return {
                    participant: p,
                    token: t,
                },
            );
            return Ok(());
        }
        let id = self.next_worker_id;
        self.next_worker_id += 1;
        let person = &self.people[p];
        let part = self.faults.data(p).unwrap_or(&self.parts[person.partition]);
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
            credential: None,
        };
        let mut worker = Worker::new(join, part.clone(), ClientKind::Browser, None)?;
        worker.carry_stats(person.stats.clone());
        let n = self.shards.len();
        let conns: Vec<u64> = (0..n).map(|i| self.next_conn + i as u64).collect();
        self.next_conn += n as u64;
        for (s, &c) in conns.iter().enumerate() {
            let shard = &mut self.shards[s];
            shard.driver.register(id);
            shard.driver.open(c);
            shard.links.insert(
                c,
                Link {
                    participant: p,
                    down_last: 0,
                },
            );
            worker.connected(s);
        }
        let person = &mut self.people[p];
        person.sessions += 1;
        person.session = Some(Box::new(Session {
            joined: self.now,
            steps_before: person.stats.steps,
            worker,
            conns,
            up_last: vec![0; n],
            compute: None,
            compute_dur: 0,
            paused: None,
            hold: None,
        }));
        self.flush_outbox(p);
        Ok(())
    }

    pub(super) fn resume(&mut self, p: usize, mut paused: Paused) {
        while let Some((shard, wire)) = paused.held.pop_front() {
            if self.people[p].session.is_none() {
                return;
            }
            self.deliver(p, shard, wire);
        }
        // Pulls held for the pace while it was paused go out now if it has passed.
        let now = secs(self.now);
        if let Some(s) = self.people[p].session.as_mut() {
            s.hold = None;
            s.worker.handle_timeout(now);
        }
        self.flush_outbox(p);
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
    pub(super) fn deliver(&mut self, p: usize, shard: usize, wire: Wire) {
        let Some(s) = self.people[p].session.as_mut() else {
            return;
        };
        s.worker.set_time(secs(self.now));
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
    pub(super) fn end_session(&mut self, p: usize, retry: bool) {
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
                person.backoff.reset();
            }
            let wait = person.backoff.next_delay();
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

    pub(super) fn leave(&mut self, p: usize) -> Result<()> {
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

    pub(super) fn flush_outbox(&mut self, p: usize) {
        loop {
            let person = &mut self.people[p];
            let Some(s) = person.session.as_mut() else {
                return;
            };
            let Some(out) = s.worker.poll_transmit() else {
                // Nothing more to send: the next pulls may wait for the pace (issue 18).
                if let Some(t) = s.worker.poll_timeout() {
                    let at = ns(t).max(self.now);
                    if s.hold != Some(at) {
                        s.hold = Some(at);
                        self.schedule(at, Event::WorkerTimer { participant: p, at });
                    }
                }
                return;
            };
            let frame = if let Some(fault) = person.fault {
                let (f, corrupted) =
                    self.faults
                        .corrupt(p, out.frame, fault, &mut person.fault_rng);
                if !person.sybil {
                    self.totals.faulty_pushes += u64::from(corrupted);
                }
                f
            } else {
                out.frame
            };
            self.send_up(p, out.shard, Wire::Frame(frame));
        }
    }

    /// The worker's timer armed for `at` fired: its held pulls go out (a paused worker's wait
    /// until it resumes).
    pub(super) fn worker_timer(&mut self, p: usize, at: Time) {
        let now = secs(self.now);
        let Some(s) = self.people[p].session.as_mut() else {
            return;
        };
        if s.hold != Some(at) {
            return;
        }
        s.hold = None;
        if s.paused.is_some() {
            return;
        }
        s.worker.handle_timeout(now);
        self.flush_outbox(p);
        self.maybe_compute(p);
    }

    pub(super) fn maybe_compute(&mut self, p: usize) {
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
        s.compute_dur = dur;
        self.schedule(
            now + dur,
            Event::ComputeDone {
                participant: p,
                token: t,
            },
        );
    }

    pub(super) fn compute_done(
        &mut self,
        p: usize,
        token: u64,
        on_row: &mut dyn FnMut(&Row),
    ) -> Result<()> {
        let Some(s) = self.people[p].session.as_mut() else {
            return Ok(());
        };
        if s.compute.map(|(t, _)| t) != Some(token) {
            return Ok(());
        }
        s.compute = None;
        // The gradient is computed from the parameters the worker pulled before the step
        // started: nothing reaches the worker's parameters between.
        s.worker.set_time(secs(self.now));
        let report = s.worker.step()?;
        s.worker.observe_compute(secs(s.compute_dur));
        if self.people[p].sybil {
            // Sybils' examples are not part of the budget (it is the workers' training), and
            // their steps do not keep a run whose workers stalled going.
            self.totals.sybil_samples += report.samples as u64;
            self.flush_outbox(p);
            self.maybe_compute(p);
            return Ok(());
        }
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
}
