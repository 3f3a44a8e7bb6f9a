//! The reconnect backoff every worker uses: the native worker (`crowdgrad work`), the browser
//! worker and the simulator. Sans-IO like the rest of core: it has no clock and sleeps nowhere;
//! it only says how long the driver should wait, in seconds, before its next attempt.
//!
//! # The one policy
//! The nominal delay starts at [`START_S`] (0.25 s) and doubles after every failed attempt up to
//! `cap / (1 + JITTER)` (8 s with the default [`CAP_S`] of 10 s); each actual delay is the nominal
//! one times a uniform factor in `[1 - JITTER, 1 + JITTER)` ([`JITTER`] = 25%). So:
//!
//! | attempt | 1 | 2 | 3 | 4 | 5 | 6 | 7 and later |
//! |---|---|---|---|---|---|---|---|
//! | nominal (s) | 0.25 | 0.5 | 1 | 2 | 4 | 8 | 8 |
//! | range (s) | 0.19-0.31 | 0.38-0.63 | 0.75-1.25 | 1.5-2.5 | 3-5 | 6-10 | 6-10 |
//!
//! Why these numbers:
//! - 0.25 s first: a dropped connection to a server that is still up (a proxy hiccup, a shard
//!   closing one socket) costs a quarter of a second of training, not more.
//! - 8 s nominal, 10 s at most: a volunteer's tab comes back within seconds of a server restart,
//!   while 10,000 waiting workers cost the server ~1,250 joins a second on average.
//! - ±25% jitter: after a server restart every worker lost its session at the same instant; with
//!   the same delays they would all rejoin in the same millisecond, every attempt. The jitter
//!   spreads each wave over half its nominal delay, and the spread grows with every attempt.
//! - The cap bounds every single delay, jitter included, so `crowdgrad work --max-backoff` and
//!   the "retry in" the page shows mean what they say.
//!
//! The driver calls [`Backoff::reset`] after a session that made progress (it trained), so a
//! fresh failure starts over at the shortest delay while a server that keeps refusing backs off.
//!
//! The jitter comes from [`crate::rng::Rng`], owned and seeded by the caller: the simulator seeds
//! it from the run's seed and stays deterministic; live workers seed it from whatever differs
//! between them (time, process id, `Math.random`).

use crate::rng::Rng;

/// Nominal first delay, seconds.
pub const START_S: f64 = 0.25;
/// Longest single delay, jitter included, seconds.
pub const CAP_S: f64 = 10.0;
/// Relative jitter: each delay is its nominal value times a factor in `[1 - JITTER, 1 + JITTER)`.
pub const JITTER: f64 = 0.25;

/// Exponential reconnect backoff with jitter (see the module doc for the policy).
#[derive(Debug, Clone)]
pub struct Backoff {
    /// Longest single delay, seconds.
    cap: f64,
    /// Failed attempts since the last reset.
    attempt: u32,
    rng: Rng,
}

impl Backoff {
    /// The standard backoff with its jitter drawn from `Rng::new(seed)`.
    pub fn new(seed: u64) -> Self {
        Self::with_rng(Rng::new(seed))
    }

    /// The standard backoff with its jitter drawn from `rng`.
    pub fn with_rng(rng: Rng) -> Self {
        Self {
            cap: CAP_S,
            attempt: 0,
            rng,
        }
    }

    /// The same policy with a different longest delay, `cap_s` seconds (jitter included). A
    /// negative or non-finite cap counts as 0 (retry at once).
    #[must_use]
    pub fn with_cap(mut self, cap_s: f64) -> Self {
        self.cap = if cap_s.is_finite() {
            cap_s.max(0.0)
        } else {
            0.0
        };
        self
    }

    /// The longest single delay, seconds.
    pub fn cap(&self) -> f64 {
        self.cap
    }

    /// Failed attempts since the last [`Backoff::reset`] (delays handed out).
    pub fn attempts(&self) -> u32 {
        self.attempt
    }

    /// The nominal delay of the next attempt, seconds, before jitter.
    pub fn nominal(&self) -> f64 {
        // 2^30 * 0.25 s is already far past any cap; stop there so nothing overflows.
        let doubled = START_S * 2f64.powi(self.attempt.min(30) as i32);
        doubled.min(self.cap / (1.0 + JITTER))
    }

    /// How long to wait before the next attempt, seconds, always in `[0, cap]`; counts the
    /// attempt.
    pub fn next_delay(&mut self) -> f64 {
        let nominal = self.nominal();
        self.attempt = self.attempt.saturating_add(1);
        let factor = 1.0 + JITTER * (2.0 * self.rng.next_f64() - 1.0);
        (nominal * factor).clamp(0.0, self.cap)
    }

    /// Back to the shortest delay: call it after a session that made progress.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_delay_is_the_start_within_the_jitter() {
        for seed in 0..200 {
            let d = Backoff::new(seed).next_delay();
            assert!(
                (START_S * (1.0 - JITTER)..START_S * (1.0 + JITTER)).contains(&d),
                "seed {seed}: {d}"
            );
        }
    }

    #[test]
    fn nominal_doubles_up_to_the_cap() {
        let mut b = Backoff::new(1);
        let mut nominals = Vec::new();
        for _ in 0..8 {
            nominals.push(b.nominal());
            b.next_delay();
        }
        assert_eq!(nominals, vec![0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]);
        assert_eq!(b.attempts(), 8);
    }

    #[test]
    fn every_delay_is_within_its_band_and_under_the_cap() {
        let mut b = Backoff::new(7);
        for _ in 0..1000 {
            let n = b.nominal();
            let d = b.next_delay();
            assert!(
                d >= n * (1.0 - JITTER) && d < n * (1.0 + JITTER),
                "{d} vs {n}"
            );
            assert!(d <= CAP_S);
        }
        // Many failures never overflow.
        assert_eq!(b.attempts(), 1000);
        assert!(b.nominal().is_finite());
    }

    #[test]
    fn jitter_spreads_the_delays() {
        // Workers that lost the same server at the same instant must not come back together:
        // 100 seeds give (nearly) 100 different first delays, spread over most of the band.
        let firsts: Vec<f64> = (0..100).map(|s| Backoff::new(s).next_delay()).collect();
        let lo = firsts.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = firsts.iter().copied().fold(0.0, f64::max);
        assert!(hi - lo > START_S * JITTER, "spread {lo}..{hi}");
        let mut sorted = firsts.clone();
        sorted.sort_by(f64::total_cmp);
        sorted.dedup();
        assert!(sorted.len() >= 95);
    }

    #[test]
    fn a_custom_cap_bounds_every_delay() {
        let mut b = Backoff::new(3).with_cap(2.0);
        assert_eq!(b.cap(), 2.0);
        let delays: Vec<f64> = (0..20).map(|_| b.next_delay()).collect();
        assert!(delays.iter().all(|&d| d <= 2.0));
        // Past the cap the nominal delay sits at cap / (1 + jitter).
        assert_eq!(b.nominal(), 2.0 / (1.0 + JITTER));
        // A cap below the start: every delay is at most the cap.
        let mut tiny = Backoff::new(3).with_cap(0.1);
        assert!((0..10).all(|_| tiny.next_delay() <= 0.1));
        // Nonsense caps retry at once rather than panic.
        assert_eq!(Backoff::new(3).with_cap(-1.0).next_delay(), 0.0);
        assert_eq!(Backoff::new(3).with_cap(f64::NAN).next_delay(), 0.0);
    }

    #[test]
    fn reset_starts_over() {
        let mut b = Backoff::new(9);
        for _ in 0..6 {
            b.next_delay();
        }
        assert_eq!(b.nominal(), 8.0);
        b.reset();
        assert_eq!(b.attempts(), 0);
        assert_eq!(b.nominal(), START_S);
        assert!(b.next_delay() < START_S * (1.0 + JITTER));
    }

    #[test]
    fn a_seed_gives_the_same_delays() {
        let run = |seed| {
            let mut b = Backoff::new(seed);
            let mut v: Vec<f64> = (0..10).map(|_| b.next_delay()).collect();
            b.reset();
            v.extend((0..3).map(|_| b.next_delay()));
            v
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
        // `with_rng` is `new` with the caller's generator.
        let mut a = Backoff::new(5);
        let mut b = Backoff::with_rng(Rng::new(5));
        for _ in 0..10 {
            assert_eq!(a.next_delay(), b.next_delay());
        }
    }
}
