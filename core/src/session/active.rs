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
//!
//! # The start
//! Counting pushers alone over-applies the first round of a crowd that starts together: the
//! first push is applied whole, the second at 1/2, ..., so 8 workers move the model by
//! 1 + 1/2 + ... + 1/8 = 2.7 rounds in their first: 8 simulated workers training the `gpt`
//! at `--local-steps auto` without a warmup ended at 2.829 nats, against 2.620 dividing by
//! the workers connected and 2.634 with the rule below (docs/benchmarks.md, "Eight async
//! workers"). So until the shard has seen a full round (some worker's second counted push,
//! [`ActivePushers::divisor`]), a push also counts the workers that are *on their first
//! round*: connected, no counted push yet, and joined no earlier than the pusher's own round
//! began less that round's length. One that had longer than the pusher's whole round and
//! pushed nothing counts as silent, as before. Those newcomers add at most [`START_GROWTH`]
//! − 1 times the pushers, so a horde of fresh silent identities can shrink the rounds of the
//! first pushers at most [`START_GROWTH`]-fold, once, at the start (8 workers starting
//! together: 1/4 + 7 × 1/8 = 1.125 rounds in their first).

use std::collections::{HashMap, VecDeque};

/// The shortest window, seconds.
pub const ACTIVE_MIN_S: f64 = 60.0;
/// The window in paces, when the shard paces its workers.
pub const ACTIVE_PACES: f64 = 3.0;

/// At the start, K is at most this many times the workers pushing ([module doc](self)).
pub const START_GROWTH: usize = 4;

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
    /// Connected worker -> when its first socket on the shard opened (removed when its last
    /// closes): whether it is on its first round at the start.
    joined: HashMap<u64, f64>,
    /// Whether some worker pushed a second time: the start is over ([module doc](self)).
    started: bool,
}

impl ActivePushers {
    /// `worker`'s first socket on the shard opened at `now` (later sockets keep the time).
    pub fn joined(&mut self, worker: u64, now: f64) {
        self.joined.entry(worker).or_insert(now);
    }

    /// `worker` had a nonzero push accepted at `now`.
    pub fn pushed(&mut self, worker: u64, now: f64) {
        if self.last.insert(worker, now).is_some() {
            self.started = true;
        }
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
        self.joined.remove(&worker);
    }

    /// The K that divides the rate of `worker`'s push at `now` (window `window` seconds; a
    /// nonzero push is recorded, as [`ActivePushers::pushed`]): the workers pushing now, this
    /// one included, and at the start those on their first round, at most [`START_GROWTH`]
    /// times as many in all ([module doc](self)). At least 1.
    pub fn divisor(&mut self, worker: u64, now: f64, window: f64, nonzero: bool) -> usize {
        // The pusher's round began at its last counted push, or when it joined.
        let began = self
            .last
            .get(&worker)
            .or_else(|| self.joined.get(&worker))
            .copied()
            .unwrap_or(now);
        if nonzero {
            self.pushed(worker, now);
        }
        let k = self.count(now, window);
        if self.started {
            return k;
        }
        let since = began - (now - began).max(0.0);
        let fresh = self
            .joined
            .iter()
            .filter(|&(w, &t)| {
                *w != worker && !self.last.contains_key(w) && t >= since && now - t <= window
            })
            .count();
        k + fresh.min((START_GROWTH - 1) * k)
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

    /// Issue 20: 8 workers joining together are counted from their first pushes (the first
    /// at 1/4, the rest at 1/8), not at 1, 1/2, ..., 1/8; after the first full round only
    /// pushers count.
    #[test]
    fn issue_20_a_crowd_starting_together_is_counted_at_its_first_pushes() {
        let mut a = ActivePushers::default();
        for w in 0..8u64 {
            a.joined(w, w as f64 * 1e-3);
        }
        let first: Vec<usize> = (0..8u64)
            .map(|w| a.divisor(w, 0.25 + w as f64 * 0.01, 60.0, true))
            .collect();
        assert_eq!(first, [4, 8, 8, 8, 8, 8, 8, 8]);
        // A zero push counts nobody new but is divided the same way.
        assert_eq!(a.divisor(3, 0.4, 60.0, false), 8);
        // Worker 0's second push: the start is over; a newcomer no longer counts.
        assert_eq!(a.divisor(0, 0.5, 60.0, true), 8);
        a.joined(8, 0.55);
        assert_eq!(a.divisor(1, 0.6, 60.0, true), 8);
        assert_eq!(a.divisor(8, 0.9, 60.0, true), 9);
    }

    /// Issue 21 kept: silent identities that had longer than a pusher's whole round do not
    /// count even at the start, and fresh ones shrink the first rounds at most
    /// START_GROWTH-fold, until the first full round.
    #[test]
    fn silent_newcomers_count_only_at_the_start_and_at_most_fourfold() {
        let mut a = ActivePushers::default();
        for s in 100..140u64 {
            a.joined(s, 0.0);
        }
        a.joined(1, 10.0);
        assert_eq!(
            a.divisor(1, 10.5, 60.0, true),
            1,
            "the sybils are long silent"
        );
        let mut b = ActivePushers::default();
        b.joined(1, 1.0);
        for s in 100..140u64 {
            b.joined(s, 1.0);
        }
        assert_eq!(b.divisor(1, 1.2, 60.0, true), START_GROWTH);
        assert_eq!(b.divisor(1, 1.4, 60.0, true), 1, "the start is over");
        // A worker that left is forgotten.
        b.left(100);
        assert!(!b.joined.contains_key(&100));
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
