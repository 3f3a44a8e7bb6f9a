//! Timing policy for the browser driver, kept free of browser APIs so it is unit-tested natively:
//! how long to rest after a step to honour a CPU limit and how fast samples are going. How long
//! to wait before rejoining is core's [`crowdgrad_core::backoff::Backoff`], shared with the
//! native worker and the simulator.

use crate::error::{Error, Result};
use std::collections::VecDeque;

/// A CPU limit as a duty cycle: computing takes at most `fraction` of wall time.
///
/// After a step that computed for `c` ms, the driver rests so that the step's period is at least
/// `c / fraction`. Time already spent idle since the previous step (waiting for parameters to
/// arrive) counts as rest, so a worker that is network-bound is not slowed further.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Throttle {
    fraction: f64,
}

impl Throttle {
    /// Choices offered on the page.
    pub const PERCENT_CHOICES: [u32; 3] = [25, 50, 100];

    /// A limit of `percent` % of one core (1 to 100).
    ///
    /// # Errors
    /// [`Error::Config`] outside `1..=100`.
    pub fn from_percent(percent: u32) -> Result<Self> {
        if !(1..=100).contains(&percent) {
            return Err(Error::Config(format!(
                "CPU limit {percent}% is outside 1..=100"
            )));
        }
        Ok(Self {
            fraction: f64::from(percent) / 100.0,
        })
    }

    /// The limit in percent.
    pub fn percent(&self) -> u32 {
        (self.fraction * 100.0).round() as u32
    }

    /// Rest (ms) to take after a step that computed for `compute_ms`, given `idle_ms` spent idle
    /// between the end of the previous step's rest and the start of this step.
    pub fn rest_ms(&self, compute_ms: f64, idle_ms: f64) -> f64 {
        if self.fraction >= 1.0 || !compute_ms.is_finite() || compute_ms <= 0.0 {
            return 0.0;
        }
        let needed = compute_ms * (1.0 - self.fraction) / self.fraction;
        (needed - idle_ms.max(0.0)).max(0.0)
    }
}

impl Default for Throttle {
    fn default() -> Self {
        Self { fraction: 1.0 }
    }
}

/// Examples per second over a sliding window of (time, cumulative count) samples.
#[derive(Debug, Clone)]
pub struct RateMeter {
    window_ms: f64,
    points: VecDeque<(f64, u64)>,
}

impl RateMeter {
    /// A meter averaging over the last `window_ms` milliseconds.
    pub fn new(window_ms: f64) -> Self {
        Self {
            window_ms: window_ms.max(1.0),
            points: VecDeque::new(),
        }
    }

    /// Records that `total` examples had been processed at time `now_ms`.
    pub fn record(&mut self, now_ms: f64, total: u64) {
        if let Some(&(_, last)) = self.points.back() {
            if total < last {
                // The counter went backwards (a fresh session): start over.
                self.points.clear();
            }
        }
        self.points.push_back((now_ms, total));
        while self.points.len() > 2 {
            match self.points.front() {
                Some(&(t, _)) if now_ms - t > self.window_ms => {
                    self.points.pop_front();
                }
                _ => break,
            }
        }
    }

    /// Examples per second at time `now_ms` (0 when idle for a whole window).
    pub fn rate(&self, now_ms: f64) -> f64 {
        let (Some(&(t0, n0)), Some(&(t1, n1))) = (self.points.front(), self.points.back()) else {
            return 0.0;
        };
        if now_ms - t1 > self.window_ms || t1 <= t0 {
            return 0.0;
        }
        // Count the time since the last record too, so a stalled worker's rate decays.
        let span = (now_ms.max(t1) - t0).max(1e-3);
        (n1 - n0) as f64 * 1000.0 / span
    }
}

/// Exponential moving average that starts at its first sample.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Ema {
    value: Option<f64>,
}

impl Ema {
    /// Folds in `x` with weight `alpha` (the first sample is taken as is).
    pub fn update(&mut self, x: f64, alpha: f64) -> f64 {
        let v = match self.value {
            None => x,
            Some(v) => v + alpha * (x - v),
        };
        self.value = Some(v);
        v
    }

    /// The average so far.
    pub fn get(&self) -> Option<f64> {
        self.value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throttle_keeps_the_duty_cycle() {
        let full = Throttle::from_percent(100).unwrap();
        assert_eq!(full.rest_ms(40.0, 0.0), 0.0);
        let quarter = Throttle::from_percent(25).unwrap();
        // 10 ms of compute in a 40 ms period.
        assert!((quarter.rest_ms(10.0, 0.0) - 30.0).abs() < 1e-9);
        // Idle time already taken counts as rest.
        assert!((quarter.rest_ms(10.0, 12.0) - 18.0).abs() < 1e-9);
        assert_eq!(quarter.rest_ms(10.0, 100.0), 0.0);
        let half = Throttle::from_percent(50).unwrap();
        assert!((half.rest_ms(8.0, 0.0) - 8.0).abs() < 1e-9);
        assert_eq!(half.percent(), 50);
        assert_eq!(half.rest_ms(f64::NAN, 0.0), 0.0);
        assert!(Throttle::from_percent(0).is_err());
        assert!(Throttle::from_percent(101).is_err());
        for p in Throttle::PERCENT_CHOICES {
            assert_eq!(Throttle::from_percent(p).unwrap().percent(), p);
        }
    }

    #[test]
    fn simulated_duty_cycle_matches_the_limit() {
        // Steps of 7 ms compute with 1 ms of network wait: the busy fraction of wall time must
        // come out at the limit (not below it: idle time counts as rest).
        for percent in Throttle::PERCENT_CHOICES {
            let t = Throttle::from_percent(percent).unwrap();
            let (mut busy, mut wall) = (0.0, 0.0);
            for _ in 0..100 {
                let idle = 1.0;
                let compute = 7.0;
                let rest = t.rest_ms(compute, idle);
                busy += compute;
                wall += idle + compute + rest;
            }
            let duty = busy / wall;
            let want = f64::from(percent) / 100.0;
            if percent == 100 {
                assert!((duty - 7.0 / 8.0).abs() < 1e-9);
            } else {
                assert!((duty - want).abs() < 1e-9, "{percent}%: duty {duty}");
            }
        }
    }

    #[test]
    fn rate_meter_measures_and_decays() {
        let mut m = RateMeter::new(5_000.0);
        assert_eq!(m.rate(0.0), 0.0);
        for i in 0u32..=10 {
            m.record(f64::from(i) * 100.0, u64::from(i) * 64);
        }
        // 640 examples in 1 s.
        assert!((m.rate(1_000.0) - 640.0).abs() < 1e-6);
        // Stalled for 1 s: the rate halves.
        assert!((m.rate(2_000.0) - 320.0).abs() < 1e-6);
        // Stalled beyond the window: zero.
        assert_eq!(m.rate(7_000.0), 0.0);
        // Old points leave the window.
        for i in 11u32..=100 {
            m.record(f64::from(i) * 100.0, u64::from(i) * 64);
        }
        assert!((m.rate(10_000.0) - 640.0).abs() < 1e-6);
        // A counter reset (new session) starts over rather than going negative.
        m.record(10_100.0, 10);
        assert_eq!(m.rate(10_100.0), 0.0);
    }

    #[test]
    fn ema_starts_at_the_first_sample() {
        let mut e = Ema::default();
        assert_eq!(e.get(), None);
        assert_eq!(e.update(10.0, 0.1), 10.0);
        assert!((e.update(20.0, 0.1) - 11.0).abs() < 1e-12);
    }
}
