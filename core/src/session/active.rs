//! Who moves the model now (issue 21): the workers a local-steps shard divides its learning
//! rate among.
//!
//! With local steps a push is a pseudo-gradient, a whole round's change of the parameters,
//! and a shard applies each one at `lr / K` so that K workers training at once move the model
//! by their mean change. K was the number of workers *connected*, so 40 sybils that connected
//! and never pushed shrank every honest round forty-fold (`bench attack --only idle
//! --local-steps auto`: 96.40% against 98.07% clean in 20 s). K is now the number of workers
//! with a nonzero push accepted within the last [`window`]: at least [`ACTIVE_MIN_S`], and
//! [`ACTIVE_PACES`] times the shard's pace when the server paces the crowd (a paced worker
//! pushes once per pace). To count, a worker must keep sending pushes that pass the guard,
//! and on probation every one of them is spot-checked. Zero pushes do not count. A worker
//! whose last socket on the shard closed no longer counts.

use std::collections::{HashMap, VecDeque};

/// The shortest window, seconds.
pub const ACTIVE_MIN_S: f64 = 60.0;
/// The window in paces, when the shard paces its workers.
pub const ACTIVE_PACES: f64 = 3.0;

/// How long a worker counts after its last accepted nonzero push, at the shard's pace
/// `pace_s` (0 without pacing).
pub fn window(pace_s: f64) -> f64 {
    ACTIVE_MIN_S.max(ACTIVE_PACES * pace_s)
}

/// Workers with a recent accepted nonzero push ([module doc](self)).
#[derive(Debug, Default)]
pub struct ActivePushers {
    /// Worker -> time of its last counted push.
    last: HashMap<u64, f64>,
    /// Counted pushes in time order (stale entries are skipped when they expire).
    order: VecDeque<(f64, u64)>,
}

impl ActivePushers {
    /// `worker` had a nonzero push accepted at `now`.
    pub fn pushed(&mut self, worker: u64, now: f64) {
        self.last.insert(worker, now);
        self.order.push_back((now, worker));
        // Bounded by the workers counted: compact when most entries are superseded.
        if self.order.len() > 2 * self.last.len() + 1024 {
            let mut v: Vec<(f64, u64)> = self.last.iter().map(|(&w, &t)| (t, w)).collect();
            v.sort_by(|a, b| a.0.total_cmp(&b.0));
            self.order = v.into();
        }
    }

    /// `worker`'s last socket on the shard closed.
    pub fn left(&mut self, worker: u64) {
        self.last.remove(&worker);
    }

    /// Workers counted at `now` with a window of `window` seconds (at least 1).
    pub fn count(&mut self, now: f64, window: f64) -> usize {
        while let Some(&(t, w)) = self.order.front() {
            if now - t <= window {
                break;
            }
            self.order.pop_front();
            if self.last.get(&w) == Some(&t) {
                self.last.remove(&w);
            }
        }
        self.last.len().max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_count_while_they_push_and_not_after() {
        let mut a = ActivePushers::default();
        assert_eq!(a.count(0.0, 60.0), 1, "never zero");
        a.pushed(1, 0.0);
        a.pushed(2, 10.0);
        a.pushed(1, 30.0);
        assert_eq!(a.count(40.0, 60.0), 2);
        // Worker 2's last push is 61 s old; worker 1's 31 s.
        assert_eq!(a.count(71.0, 60.0), 1);
        a.left(1);
        assert_eq!(a.count(72.0, 60.0), 1);
        assert!(a.last.is_empty());
        // A long-paced crowd counts over three paces.
        assert_eq!(window(0.0), 60.0);
        assert_eq!(window(40.0), 120.0);
    }

    #[test]
    fn one_busy_worker_does_not_grow_the_log() {
        let mut a = ActivePushers::default();
        for i in 0..100_000u32 {
            a.pushed(7, f64::from(i) * 1e-3);
        }
        assert!(a.order.len() <= 1026, "{}", a.order.len());
        assert_eq!(a.count(100.0, 60.0), 1);
        assert_eq!(a.count(200.0, 60.0), 1);
        assert!(a.last.is_empty());
    }
}
