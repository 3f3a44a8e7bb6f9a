//! The SSP clock ([`SspClock`]): who may read under a stale-synchronous bound, and who has gone
//! silent.

use std::collections::BTreeMap;

/// The SSP clock of one shard: each worker's clock is the number of its pushes applied; a
/// worker may read only while its clock is at most `bound` ahead of the slowest *active*
/// worker. A worker is active while connected and heard from within the heartbeat timeout, so
/// a silent or departed worker never blocks the rest for long. Times are seconds on any clock
/// the caller chooses (sans-IO: the server passes wall time, the simulator simulated time).
#[derive(Debug, Clone)]
pub struct SspClock {
    bound: u64,
    heartbeat: f64,
    workers: BTreeMap<u64, Tick>,
}

#[derive(Debug, Clone, Copy)]
struct Tick {
    clock: u64,
    last_seen: f64,
}

impl SspClock {
    /// A clock with staleness bound `bound` and heartbeat timeout `heartbeat` seconds.
    pub fn new(bound: u64, heartbeat: f64) -> Self {
        Self {
            bound,
            heartbeat,
            workers: BTreeMap::new(),
        }
    }

    /// The bound S.
    pub fn bound(&self) -> u64 {
        self.bound
    }

    /// A new bound S from now on (the admin API's consistency change); with `level`, every
    /// worker's clock is first set to the fastest one, so that clocks counted while no bound
    /// applied (async) hold nobody back.
    pub fn set_bound(&mut self, bound: u64, level: bool) {
        self.bound = bound;
        if level {
            let top = self.workers.values().map(|t| t.clock).max().unwrap_or(0);
            for t in self.workers.values_mut() {
                t.clock = top;
            }
        }
    }

    /// A worker connects. It starts at the slowest active clock, so a newcomer neither waits
    /// for nor holds back the others; a returning worker keeps its clock.
    pub fn join(&mut self, worker: u64, now: f64) {
        let start = self.min_active(now).unwrap_or(0);
        let t = self.workers.entry(worker).or_insert(Tick {
            clock: start,
            last_seen: now,
        });
        t.last_seen = now;
    }

    /// A worker disconnected: it no longer holds anyone back.
    pub fn leave(&mut self, worker: u64) {
        self.workers.remove(&worker);
    }

    /// A worker was heard from. One that had dropped out of the clock (silent past the
    /// heartbeat timeout) re-enters at the slowest active clock, like a newcomer: its absence
    /// must not make everyone wait for it to catch up afterwards.
    pub fn seen(&mut self, worker: u64, now: f64) {
        let expired = self
            .workers
            .get(&worker)
            .is_some_and(|t| now - t.last_seen > self.heartbeat);
        let floor = if expired {
            self.workers
                .iter()
                .filter(|(id, t)| **id != worker && now - t.last_seen <= self.heartbeat)
                .map(|(_, t)| t.clock)
                .min()
        } else {
            None
        };
        if let Some(t) = self.workers.get_mut(&worker) {
            if let Some(f) = floor {
                t.clock = t.clock.max(f);
            }
            t.last_seen = now;
        }
    }

    /// A push of `worker` was applied: its clock advances.
    pub fn tick(&mut self, worker: u64, now: f64) {
        self.seen(worker, now);
        if let Some(t) = self.workers.get_mut(&worker) {
            t.clock += 1;
        }
    }

    /// `worker`'s clock.
    pub fn clock(&self, worker: u64) -> Option<u64> {
        self.workers.get(&worker).map(|t| t.clock)
    }

    fn active(&self, now: f64) -> impl Iterator<Item = &Tick> {
        self.workers
            .values()
            .filter(move |t| now - t.last_seen <= self.heartbeat)
    }

    /// Slowest clock among active workers.
    pub fn min_active(&self, now: f64) -> Option<u64> {
        self.active(now).map(|t| t.clock).min()
    }

    /// Whether `worker` may read now: its clock is at most the bound ahead of every active
    /// worker's. A worker that is not registered (not connected) is never held back.
    pub fn may_read(&self, worker: u64, now: f64) -> bool {
        match (self.clock(worker), self.min_active(now)) {
            (Some(c), Some(m)) => c <= m + self.bound,
            _ => true,
        }
    }

    /// The slowest active clock and the reader's clock, for the read log.
    pub fn read_view(&self, worker: u64, now: f64) -> (Option<u64>, Option<u64>) {
        (self.clock(worker), self.min_active(now))
    }

    /// The next time an active worker holding others back would time out (to re-check then).
    pub fn next_expiry(&self, now: f64) -> Option<f64> {
        self.active(now)
            .map(|t| t.last_seen + self.heartbeat)
            .reduce(f64::min)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ssp_clock_bounds_the_fastest_and_forgets_the_silent() {
        let mut c = SspClock::new(2, 5.0);
        c.join(1, 0.0);
        c.join(2, 0.0);
        for _ in 0..2 {
            c.tick(1, 1.0);
        }
        assert!(c.may_read(1, 1.0), "2 ahead is allowed with S = 2");
        c.tick(1, 1.0);
        assert!(!c.may_read(1, 1.0), "3 ahead must wait");
        assert!(c.may_read(2, 1.0));
        // Worker 2 goes silent: after the heartbeat timeout it no longer holds worker 1 back.
        assert_eq!(c.next_expiry(1.0), Some(5.0));
        c.seen(1, 6.5);
        assert!(c.may_read(1, 6.5));
        // When it speaks again it re-enters at the slowest active clock, so nobody waits for
        // it to catch up.
        c.seen(2, 7.0);
        assert_eq!(c.clock(2), Some(3));
        assert!(c.may_read(1, 7.0));
        // A live straggler does hold the others back.
        for _ in 0..3 {
            c.tick(1, 7.0);
        }
        assert!(!c.may_read(1, 7.0));
        // A departed worker does not; a newcomer starts at the slowest clock.
        c.leave(2);
        assert!(c.may_read(1, 7.0));
        c.join(3, 7.0);
        assert_eq!(c.clock(3), Some(6));
    }
}
