//! Local steps: how many inner steps a worker runs between two exchanges, and the controller
//! that picks that number by itself ([`LocalSteps::Auto`]).
//!
//! With `H = 1` (the default) a worker pushes each mini-batch gradient and the shards apply it
//! with their optimizer: protocol version 1's behaviour. With a fixed `H > 1`, or `auto`, a
//! worker pulls θ, runs inner steps with the run's inner optimizer on its own batches, and
//! pushes the pseudo-gradient Δ = θ_pulled − θ_local; each shard applies Δ with its own (outer)
//! optimizer, as in DiLoCo (Douillard et al. 2023) and asynchronous local SGD (Liu et al.
//! 2024). In `auto` every push is a pseudo-gradient, even while the controller picks `H = 1`,
//! so a run never mixes the two kinds.
//!
//! # The controller
//! A worker measures the compute time of one inner step (`t_c`) and the latency of an exchange
//! (`t_x`: from the moment its pulls go out to the moment every shard's parameters are in,
//! which includes the push sent just before on the same connections). It picks the smallest
//! `H` for which communication is at most [`COMM_SHARE`] of the round's wall time even without
//! overlap, `t_x / (H·t_c + t_x) ≤ 0.15`, that is `H = ⌈t_x·(1 − 0.15) / (0.15·t_c)⌉`, within
//! `[1, max]` where the server sets `max`. Both times are exponential moving averages, so one
//! slow exchange does not swing `H`. Time is an input (sans-IO): the drivers report it.

use crate::error::{Error, Result};
use crate::optim::{OptimizerConfig, Rule};
use serde::{Deserialize, Serialize};
use std::fmt;

/// How workers exchange with the shards: local steps, their optimizer, and overlap. Part of the
/// run spec (`"local"` in the join reply; absent means [`LocalConfig::default`], protocol
/// version 1's behaviour).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LocalConfig {
    /// Inner steps per push.
    #[serde(default)]
    pub steps: LocalSteps,
    /// The workers' inner optimizer (used when `steps` is not 1). Its state stays on the
    /// worker, across rounds.
    #[serde(default = "default_inner")]
    pub inner: OptimizerConfig,
    /// Keep the next pull in flight while computing (double-buffered parameters): no step
    /// waits a full round trip, and each read misses the worker's own last push (one more
    /// unit of staleness). Only for gradient pushes (`steps` = 1), and never in `sync:K`
    /// runs, whose pulls wait for the next version.
    #[serde(default)]
    pub overlap: bool,
}

/// The inner optimizer's learning rate when the run names Adam without one.
///
/// 0.003, not Adam's usual 0.001 (DiLoCo's, for language models): simulated on the MLP with
/// 16 async workers on 20 Mbit/s links, 300k samples, seeds 1–3 (docs/experiments.md lesson
/// 6), H = 32 ends 1.4 pt below gradient pushes at 0.001 and 0.7 pt above at 0.003; with 2 and
/// 4 workers 0.003 is also the better (+0.4 and +0.8 pt).
pub const DEFAULT_INNER_LR: f32 = 0.003;

/// The inner optimizer a run gets unless it names one: Adam at [`DEFAULT_INNER_LR`].
pub fn default_inner() -> OptimizerConfig {
    OptimizerConfig {
        rule: Rule::from_name("adam").unwrap_or(Rule::Sgd),
        lr: DEFAULT_INNER_LR,
        weight_decay: 0.0,
        clip_norm: None,
        schedule: Default::default(),
    }
}

impl Default for LocalConfig {
    fn default() -> Self {
        Self {
            steps: LocalSteps::default(),
            inner: default_inner(),
            overlap: false,
        }
    }
}

impl LocalConfig {
    /// Checks the steps and the inner optimizer.
    ///
    /// # Errors
    /// [`Error::Config`] naming the problem.
    pub fn validate(&self) -> Result<()> {
        self.steps.validate()?;
        self.inner.validate()
    }
}

/// The share of wall time communication may take under [`LocalSteps::Auto`].
pub const COMM_SHARE: f64 = 0.15;
/// The bound `auto` uses when the server names none.
pub const DEFAULT_AUTO_MAX: u32 = 4096;
/// The largest `H` a run may ask for.
pub const MAX_LOCAL_STEPS: u32 = 10_000;

/// Inner steps per push.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum LocalSteps {
    /// Exactly `H` inner steps; `1` means gradient pushes.
    Fixed(u32),
    /// Chosen by each worker ([module doc](self)), at most `max`.
    Auto {
        /// The server's bound.
        max: u32,
    },
}

impl Default for LocalSteps {
    fn default() -> Self {
        LocalSteps::Fixed(1)
    }
}

impl LocalSteps {
    /// Parses `H` (a whole number from 1 to 10,000), `auto` or `auto:MAX`.
    ///
    /// # Errors
    /// [`Error::Config`] naming the problem.
    pub fn parse(text: &str) -> Result<Self> {
        let t = text.trim();
        let num = |s: &str| -> Result<u32> {
            match s.parse::<u32>() {
                Ok(n) if (1..=MAX_LOCAL_STEPS).contains(&n) => Ok(n),
                _ => Err(Error::Config(format!(
                    "local steps {t:?}: use a whole number from 1 to {MAX_LOCAL_STEPS}, auto or auto:MAX"
                ))),
            }
        };
        if t == "auto" {
            Ok(LocalSteps::Auto {
                max: DEFAULT_AUTO_MAX,
            })
        } else if let Some(m) = t.strip_prefix("auto:") {
            Ok(LocalSteps::Auto { max: num(m)? })
        } else {
            Ok(LocalSteps::Fixed(num(t)?))
        }
    }

    /// Whether pushes are pseudo-gradients (anything but `1`).
    pub fn pseudo_gradients(self) -> bool {
        self != LocalSteps::Fixed(1)
    }

    /// The largest `H` a worker may use.
    pub fn max(self) -> u32 {
        match self {
            LocalSteps::Fixed(h) => h,
            LocalSteps::Auto { max } => max,
        }
    }

    /// Checks the bounds.
    ///
    /// # Errors
    /// [`Error::Config`] when `H` or `max` is 0 or over [`MAX_LOCAL_STEPS`].
    pub fn validate(self) -> Result<Self> {
        let h = self.max();
        if (1..=MAX_LOCAL_STEPS).contains(&h) {
            Ok(self)
        } else {
            Err(Error::Config(format!(
                "local steps {h} out of range 1..={MAX_LOCAL_STEPS}"
            )))
        }
    }
}

impl fmt::Display for LocalSteps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LocalSteps::Fixed(h) => write!(f, "{h}"),
            LocalSteps::Auto { max } => write!(f, "auto:{max}"),
        }
    }
}

impl TryFrom<String> for LocalSteps {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        LocalSteps::parse(&s)
    }
}

impl From<LocalSteps> for String {
    fn from(l: LocalSteps) -> String {
        l.to_string()
    }
}

/// An exponential moving average that starts at its first sample.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Ema {
    value: Option<f64>,
}

impl Ema {
    /// Weight of a new sample.
    const ALPHA: f64 = 0.2;

    /// Adds a sample (ignored unless finite and >= 0).
    pub fn add(&mut self, x: f64) {
        if !(x.is_finite() && x >= 0.0) {
            return;
        }
        self.value = Some(match self.value {
            None => x,
            Some(v) => v + Self::ALPHA * (x - v),
        });
    }

    /// The average, if any sample arrived.
    pub fn get(&self) -> Option<f64> {
        self.value
    }
}

/// Picks `H` for the next round from the measured compute and exchange times.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Controller {
    compute: Ema,
    exchange: Ema,
}

impl Controller {
    /// One inner step took `seconds` of compute.
    pub fn compute(&mut self, seconds: f64) {
        self.compute.add(seconds);
    }

    /// One exchange took `seconds`, pulls out to parameters in.
    pub fn exchange(&mut self, seconds: f64) {
        self.exchange.add(seconds);
    }

    /// Mean compute per inner step, seconds.
    pub fn compute_s(&self) -> Option<f64> {
        self.compute.get()
    }

    /// Mean exchange latency, seconds.
    pub fn exchange_s(&self) -> Option<f64> {
        self.exchange.get()
    }

    /// `H` for the next round under `policy`: the fixed value, or the controller's choice (1
    /// until both times were measured).
    pub fn choose(&self, policy: LocalSteps) -> u32 {
        match policy {
            LocalSteps::Fixed(h) => h.max(1),
            LocalSteps::Auto { max } => {
                let (Some(tc), Some(tx)) = (self.compute.get(), self.exchange.get()) else {
                    return 1;
                };
                let h = (tx * (1.0 - COMM_SHARE) / (COMM_SHARE * tc.max(1e-7))).ceil();
                // `as` saturates; NaN cannot occur (both inputs are finite and >= 0).
                (h as u32).clamp(1, max.max(1))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_display_and_serde() {
        assert_eq!(LocalSteps::parse("1").unwrap(), LocalSteps::Fixed(1));
        assert_eq!(LocalSteps::parse("32").unwrap(), LocalSteps::Fixed(32));
        assert_eq!(
            LocalSteps::parse("auto").unwrap(),
            LocalSteps::Auto {
                max: DEFAULT_AUTO_MAX
            }
        );
        assert_eq!(
            LocalSteps::parse("auto:64").unwrap(),
            LocalSteps::Auto { max: 64 }
        );
        for bad in ["0", "-1", "x", "auto:0", "auto:", "10001", "1.5"] {
            assert!(LocalSteps::parse(bad).is_err(), "{bad}");
        }
        let l = LocalSteps::Auto { max: 64 };
        assert_eq!(serde_json::to_string(&l).unwrap(), "\"auto:64\"");
        assert_eq!(
            serde_json::from_str::<LocalSteps>("\"8\"").unwrap(),
            LocalSteps::Fixed(8)
        );
        assert!(serde_json::from_str::<LocalSteps>("\"0\"").is_err());
        assert!(!LocalSteps::Fixed(1).pseudo_gradients());
        assert!(LocalSteps::Fixed(2).pseudo_gradients());
        assert!(LocalSteps::Auto { max: 1 }.pseudo_gradients());
    }

    #[test]
    fn the_controller_keeps_communication_near_15_percent() {
        let mut c = Controller::default();
        let auto = LocalSteps::Auto { max: 1000 };
        assert_eq!(c.choose(auto), 1, "nothing measured yet");
        c.compute(0.001);
        c.exchange(0.170);
        let h = c.choose(auto);
        // 0.170 / (h * 0.001 + 0.170) <= 0.15 with the smallest such h.
        assert_eq!(h, 964);
        let share = |h: u32| 0.170 / (f64::from(h) * 0.001 + 0.170);
        assert!(share(h) <= COMM_SHARE && share(h - 1) > COMM_SHARE);
        assert_eq!(
            c.choose(LocalSteps::Auto { max: 64 }),
            64,
            "the server's bound"
        );
        assert_eq!(c.choose(LocalSteps::Fixed(7)), 7);
        // Loopback: an exchange as fast as a step needs only a few.
        let mut fast = Controller::default();
        fast.compute(0.0005);
        fast.exchange(0.0005);
        assert_eq!(fast.choose(auto), 6);
        // One outlier moves the average by a fifth of the difference.
        fast.exchange(0.0105);
        assert!((fast.exchange_s().unwrap() - 0.0025).abs() < 1e-12);
        fast.exchange(f64::NAN);
        fast.exchange(-1.0);
        assert!(
            (fast.exchange_s().unwrap() - 0.0025).abs() < 1e-12,
            "bad samples are ignored"
        );
    }
}
