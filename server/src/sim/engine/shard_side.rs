//! Between the event loop and the shards' sans-IO driver (`super::super::shard`): frames and
//! closes travel down their connection, timers are scheduled, records are counted.

use super::*;

impl Engine<'_> {
    // ---------------------------------------------------------------- shard side

    /// Carries out what shard `shard`'s driver asked: frames and closes travel down their
    /// connection, timers are scheduled, records are counted.
    pub(super) fn shard_outputs(&mut self, shard: usize, out: Vec<Output>) {
        for o in out {
            match o {
                Output::Frame { conn, bytes } => self.send_down(shard, conn, Wire::Frame(bytes)),
                Output::Close { conn } => {
                    self.send_down(shard, conn, Wire::Close);
                    self.shards[shard].links.remove(&conn);
                }
                Output::Timer { conn, at } => {
                    // Rounded up, so the timer never fires before the session's deadline.
                    let t = ((at.max(0.0) * 1e9).ceil() as Time).saturating_add(1);
                    self.schedule(t.max(self.now), Event::ShardTimer { shard, conn });
                }
                Output::Record { conn, record } => self.count(shard, conn, record),
            }
        }
        let SimShard { driver, links } = &mut self.shards[shard];
        links.retain(|&c, _| driver.is_open(c));
        if shard == 0 {
            self.refresh_zeno(false);
        }
    }

    pub(super) fn count(&mut self, shard: usize, conn: u64, record: Record) {
        // Whose push: a sybil's or a worker's (the connection's participant).
        let sybil = self.shards[shard]
            .links
            .get(&conn)
            .is_some_and(|c| self.people[c.participant].sybil);
        let t = &mut self.totals;
        fn group(t: &mut Totals, sybil: bool) -> &mut PushCounts {
            if sybil {
                &mut t.sybil_pushes
            } else {
                &mut t.worker_pushes
            }
        }
        let reject = |t: &mut Totals, code: ErrorCode| {
            t.rejected += 1;
            *t.rejected_by_reason
                .entry(code.name().to_string())
                .or_insert(0) += 1;
            group(t, sybil).reject(code);
        };
        match record {
            Record::Pushed {
                outcome, clipped, ..
            } => {
                t.pushes += 1;
                let g = group(t, sybil);
                g.pushes += 1;
                if !matches!(outcome, Outcome::Rejected { .. }) {
                    g.accepted += 1;
                    g.clipped += u64::from(clipped);
                }
                match outcome {
                    Outcome::Applied { staleness, .. } => {
                        t.accepted += 1;
                        t.staleness_sum += staleness;
                        t.staleness_max = t.staleness_max.max(staleness);
                        self.interval.0 += staleness;
                        self.interval.1 += 1;
                        self.interval.2 = self.interval.2.max(staleness);
                    }
                    Outcome::Buffered { .. } => {
                        t.accepted += 1;
                        self.interval.1 += 1;
                    }
                    Outcome::Rejected { code, .. } => reject(t, code),
                }
            }
            Record::Rejected { code, .. } => {
                group(t, sybil).pushes += 1;
                reject(t, code);
            }
            Record::Pulled {
                worker,
                version,
                clock,
                min_clock,
                ..
            } => {
                if self.cfg.log_reads {
                    let participant = self.shards[shard]
                        .links
                        .get(&conn)
                        .map_or(0, |c| c.participant);
                    self.reads.push(ReadRecord {
                        time_s: self.now_s(),
                        worker: participant,
                        worker_id: worker,
                        shard,
                        version,
                        clock,
                        min_clock,
                    });
                }
            }
            Record::Joined { .. }
            | Record::Left { .. }
            | Record::Reported { .. }
            | Record::Dropped { .. }
            | Record::Held { .. } => {}
        }
    }
}
