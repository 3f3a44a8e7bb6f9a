//! Learning-rate schedules (issue 20): linear warmup, then a cosine or linear decay (or none)
//! to a floor, over a stated number of training samples. A [`Schedule`] is part of an
//! [`crate::optim::OptimizerConfig`] (absent in JSON: the constant learning rate of runs
//! before schedules existed), so it travels in the run spec and in checkpoints with the rest
//! of the optimizer.
//!
//! # Where a run is on its schedule: the shard's version
//! Nothing in a crowd counts samples for everyone: workers come and go, pushes are refused,
//! and every shard applies its own updates. What every party agrees on is a shard's version
//! (updates applied so far): the shard knows it, every pull says it, and every push (and a
//! spot check's tag) names the versions it was computed from. So the position is counted in
//! versions, and the run spec states how many samples one version stands for
//! ([`Schedule::samples_per_version`], fixed when the run is built):
//! - gradient pushes: one version is one push of `batch_size` examples, so `batch_size`;
//! - `sync:K`: one version is the mean of K pushes, so `K × batch_size` (a round flushed early
//!   with fewer pushes still counts as K: the schedule runs a little ahead, never behind);
//! - local steps `H`: one push of a pseudo-gradient carries `H × batch_size` examples, so
//!   `H × batch_size` (times K in `sync:K`).
//!
//! # `auto` local steps: the samples the shards applied
//! `auto` varies `H` per worker and per round, so versions do not map to samples. Such a
//! schedule is [`Schedule::counted`]: every shard counts the samples of the updates it applied
//! (a push's `samples`; a `sync:K` round's pushes together) and states the count of each
//! version in every `Params` to a worker that asked for it (docs/protocol.md, "Samples"). A
//! round read at counts `c₀..c_S` (one per shard) that will carry `r` samples runs all its
//! inner steps at `f(max cᵢ + r)` ([`Schedule::factor_round`]): the samples seen once it is
//! applied, as `(v + 1) × samples_per_version` is for a fixed `H`. The spot checker takes the
//! counts from its own record of the versions the push's tag names, not from the worker.
//!
//! Update number `n` (0-based: the one that takes a shard from version `n` to `n + 1`) runs
//! at `lr × f(s)` with `s = (n + 1) × samples_per_version`, the samples seen once it is
//! applied ([`Schedule::factor`]):
//! - warmup, `s < warmup`: `f = s / warmup` (the first update already moves; the update that
//!   reaches `warmup` gets the full rate);
//! - decay, `warmup ≤ s < decay_samples` with progress `p = (s − warmup) / (decay_samples −
//!   warmup)`: cosine `f = m + (1 − m) · (1 + cos πp) / 2`, linear `f = m + (1 − m) · (1 − p)`,
//!   where `m` is [`Schedule::min_ratio`];
//! - after it, `s ≥ decay_samples`: `f = m`; with no decay, `f = 1` after the warmup.
//!
//! In PyTorch terms (scheduler stepped after every optimizer step, step `k` from 0) that is
//! `LambdaLR(opt, lambda k: f((k + 1) * samples_per_version))`.
//!
//! # Which optimizer follows it
//! The one that sees gradients. With gradient pushes that is the shards' optimizer: each shard
//! multiplies the rate of an update by `f` at its own version, through the same `lr_scale` the
//! staleness policies use (the two multiply). With local steps it is the workers' inner
//! optimizer: a round computed from parameters read at versions `v₀..v_S` runs all its inner
//! steps at `f(max vᵢ)` ([`Schedule::factor_read`]), the schedule at the version it pulled,
//! which a spot check recomputes from the push's tag alone. The outer optimizer then keeps a
//! constant rate: a pseudo-gradient already carries the inner rate, so scheduling both would
//! apply the decay twice (DiLoCo likewise decays the inner rate only). The largest version of
//! the read, not the smallest, because a shard that was down or refused pushes lags the run.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// The longest schedule, in samples (2^50, about 10^15): past it the `f64` position would
/// lose whole samples.
pub const MAX_SAMPLES: u64 = 1 << 50;

/// The floor of a decay when the run names none: 10% of the peak rate (Chinchilla's and the
/// PyTorch comparison peer's).
pub const DEFAULT_MIN_RATIO: f32 = 0.1;

/// The shape after the warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decay {
    /// The peak rate for good.
    #[default]
    None,
    /// Straight down to the floor.
    Linear,
    /// Half a cosine down to the floor (Loshchilov & Hutter's SGDR without restarts).
    Cosine,
}

impl Decay {
    /// Parses `none`, `linear` or `cosine`.
    ///
    /// # Errors
    /// [`Error::Config`] for anything else.
    pub fn parse(text: &str) -> Result<Self> {
        match text.trim() {
            "none" => Ok(Decay::None),
            "linear" => Ok(Decay::Linear),
            "cosine" => Ok(Decay::Cosine),
            other => Err(Error::Config(format!(
                "learning-rate decay {other:?}: use none, linear or cosine"
            ))),
        }
    }

    /// The name [`Decay::parse`] takes.
    pub fn name(self) -> &'static str {
        match self {
            Decay::None => "none",
            Decay::Linear => "linear",
            Decay::Cosine => "cosine",
        }
    }
}

fn default_min_ratio() -> f32 {
    DEFAULT_MIN_RATIO
}

fn one() -> u64 {
    1
}

/// A learning-rate schedule over samples, positioned by shard version or, when
/// [`Schedule::counted`], by the samples the shards applied ([module doc](self)).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    /// Samples of linear warmup from the start; 0: none.
    #[serde(default)]
    pub warmup: u64,
    /// The shape after the warmup.
    #[serde(default)]
    pub decay: Decay,
    /// The sample, counted from the start of the run (warmup included, as nanoGPT's
    /// `lr_decay_iters`), at which the decay reaches its floor. Unused without a decay.
    #[serde(default)]
    pub decay_samples: u64,
    /// The floor as a fraction of the peak rate, in `[0, 1]`.
    #[serde(default = "default_min_ratio")]
    pub min_ratio: f32,
    /// Samples one shard version stands for (set when the run is built, see the module doc).
    #[serde(default = "one")]
    pub samples_per_version: u64,
    /// The position is the samples the shards counted, not versions (`auto` local steps;
    /// the module doc). Absent: false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub counted: bool,
}

impl Default for Schedule {
    /// The constant rate: no warmup, no decay.
    fn default() -> Self {
        Self {
            warmup: 0,
            decay: Decay::None,
            decay_samples: 0,
            min_ratio: DEFAULT_MIN_RATIO,
            samples_per_version: 1,
            counted: false,
        }
    }
}

impl Schedule {
    /// Whether the rate never changes (no warmup, no decay): then it is left out of JSON.
    pub fn is_constant(&self) -> bool {
        self.warmup == 0 && self.decay == Decay::None
    }

    /// Checks the bounds.
    ///
    /// # Errors
    /// [`Error::Config`] naming the bad value: a length over [`MAX_SAMPLES`], a floor outside
    /// `[0, 1]`, no samples per version, or a decay that does not end after the warmup.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        for (what, v) in [("warmup", self.warmup), ("decay end", self.decay_samples)] {
            if v > MAX_SAMPLES {
                return bad(format!(
                    "learning-rate {what} of {v} samples is over the limit of {MAX_SAMPLES}"
                ));
            }
        }
        if !(self.min_ratio.is_finite() && (0.0..=1.0).contains(&self.min_ratio)) {
            return bad(format!(
                "learning-rate floor ratio {} must be between 0 and 1",
                self.min_ratio
            ));
        }
        if self.samples_per_version == 0 {
            return bad("a schedule needs at least one sample per version".into());
        }
        if self.decay != Decay::None && self.decay_samples <= self.warmup {
            return bad(format!(
                "the {} decay must end after the warmup: it ends at sample {}, the warmup at {}",
                self.decay.name(),
                self.decay_samples,
                self.warmup
            ));
        }
        Ok(())
    }

    /// The multiplier of the update that takes a shard from `version` to `version + 1` (the
    /// module doc has the formula). 1 for a constant schedule; always in `[0, 1]`.
    pub fn factor(&self, version: u64) -> f32 {
        self.factor_at(
            version
                .saturating_add(1)
                .saturating_mul(self.samples_per_version.max(1)),
        )
    }

    /// The multiplier at `s` samples seen (the module doc has the formula). 1 for a constant
    /// schedule; always in `[0, 1]`.
    pub fn factor_at(&self, s: u64) -> f32 {
        if self.is_constant() {
            return 1.0;
        }
        if s < self.warmup {
            return (s as f64 / self.warmup as f64) as f32;
        }
        let m = f64::from(self.min_ratio.clamp(0.0, 1.0));
        let f = match self.decay {
            Decay::None => 1.0,
            _ if s >= self.decay_samples => m,
            decay => {
                let p = (s - self.warmup) as f64 / (self.decay_samples - self.warmup) as f64;
                let shape = match decay {
                    Decay::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * p).cos()),
                    _ => 1.0 - p,
                };
                m + (1.0 - m) * shape
            }
        };
        f as f32
    }

    /// The multiplier of a round computed from parameters read at `versions` (one per shard):
    /// [`Schedule::factor`] at the largest (see the module doc). The worker's inner optimizer
    /// and the spot checker both call it.
    pub fn factor_read(&self, versions: &[u64]) -> f32 {
        self.factor(versions.iter().copied().max().unwrap_or(0))
    }

    /// The multiplier of a round read at `versions` whose shards had applied `counts` samples
    /// (one each, in shard order; [`crate::wire::Message::Params`]' `samples`), that carries
    /// `round_samples`: [`Schedule::factor_at`] the largest count plus the round's when the
    /// schedule is [`Schedule::counted`], else [`Schedule::factor_read`]. The worker's inner
    /// optimizer and the spot checker both call it.
    pub fn factor_round(&self, versions: &[u64], counts: &[u64], round_samples: u64) -> f32 {
        if self.counted {
            let read = counts.iter().copied().max().unwrap_or(0);
            self.factor_at(read.saturating_add(round_samples))
        } else {
            self.factor_read(versions)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(decay: Decay) -> Schedule {
        Schedule {
            warmup: 100,
            decay,
            decay_samples: 1100,
            min_ratio: 0.1,
            samples_per_version: 10,
            counted: false,
        }
    }

    fn close(a: f32, b: f64) {
        assert!((f64::from(a) - b).abs() < 1e-6, "{a} != {b}");
    }

    #[test]
    fn values_at_the_key_points() {
        let c = sched(Decay::Cosine);
        // Version v is the update seen at (v + 1) * 10 samples.
        close(c.factor(0), 0.1); // 10 of 100 warmup samples
        close(c.factor(4), 0.5); // mid-warmup
        close(c.factor(9), 1.0); // the warmup's last update: the full rate
        close(
            c.factor(34),
            0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI / 4.0).cos()),
        );
        close(c.factor(59), 0.55); // mid-decay: cos(π/2) = 0
        close(c.factor(109), 0.1); // the decay's end
        close(c.factor(110), 0.1); // past it
        close(c.factor(u64::MAX), 0.1); // saturates, no overflow
        let l = sched(Decay::Linear);
        close(l.factor(4), 0.5);
        close(l.factor(9), 1.0);
        close(l.factor(34), 0.775);
        close(l.factor(59), 0.55);
        close(l.factor(109), 0.1);
        close(l.factor(5000), 0.1);
        // Warmup only: the peak for good after it.
        let w = sched(Decay::None);
        close(w.factor(4), 0.5);
        close(w.factor(9), 1.0);
        close(w.factor(1_000_000), 1.0);
        // The constant schedule of old runs.
        assert_eq!(Schedule::default().factor(0), 1.0);
        assert_eq!(Schedule::default().factor(u64::MAX), 1.0);
        // A floor of 0 reaches 0, never below.
        let zero = Schedule {
            min_ratio: 0.0,
            ..c
        };
        assert_eq!(zero.factor(109), 0.0);
        // Decay without warmup starts at the peak.
        let no_warm = Schedule { warmup: 0, ..c };
        assert!(no_warm.factor(0) > 0.99 && no_warm.factor(0) <= 1.0);
        // A round reads its shards' versions: the largest counts.
        close(c.factor_read(&[3, 59, 12]), 0.55);
        assert_eq!(c.factor_read(&[]), c.factor(0));
        // Not counted: a round follows its versions, whatever the counts say.
        close(c.factor_round(&[3, 59, 12], &[0, 0, 0], 10), 0.55);
        // Counted (auto local steps): the largest count plus the round's own samples.
        let counted = Schedule { counted: true, ..c };
        close(counted.factor_round(&[0, 0], &[30, 590], 10), 0.55);
        close(counted.factor_round(&[9, 9], &[40, 0], 10), 0.5);
        close(counted.factor_round(&[0], &[], 10), 0.1);
        close(counted.factor_at(600), 0.55);
        assert_eq!(counted.factor_round(&[], &[u64::MAX], u64::MAX), 0.1);
    }

    #[test]
    fn bad_schedules_are_refused() {
        assert!(Schedule::default().validate().is_ok());
        assert!(sched(Decay::Cosine).validate().is_ok());
        let c = sched(Decay::Cosine);
        for (what, bad) in [
            (
                "ends at the warmup",
                Schedule {
                    decay_samples: 100,
                    ..c
                },
            ),
            (
                "ends before it",
                Schedule {
                    decay_samples: 0,
                    ..c
                },
            ),
            (
                "floor > 1",
                Schedule {
                    min_ratio: 1.5,
                    ..c
                },
            ),
            (
                "floor < 0",
                Schedule {
                    min_ratio: -0.1,
                    ..c
                },
            ),
            (
                "floor NaN",
                Schedule {
                    min_ratio: f32::NAN,
                    ..c
                },
            ),
            (
                "no samples per version",
                Schedule {
                    samples_per_version: 0,
                    ..c
                },
            ),
            (
                "warmup too long",
                Schedule {
                    warmup: MAX_SAMPLES + 1,
                    ..c
                },
            ),
            (
                "decay too long",
                Schedule {
                    decay_samples: u64::MAX,
                    ..c
                },
            ),
        ] {
            assert!(bad.validate().is_err(), "{what}");
        }
        // Warmup alone needs no decay end.
        assert!(Schedule {
            decay_samples: 0,
            ..sched(Decay::None)
        }
        .validate()
        .is_ok());
        assert!(Decay::parse("exp").is_err());
        for d in [Decay::None, Decay::Linear, Decay::Cosine] {
            assert_eq!(Decay::parse(d.name()).unwrap(), d);
        }
    }

    #[test]
    fn json_round_trip_and_defaults() {
        let c = sched(Decay::Cosine);
        let json = serde_json::to_value(c).unwrap();
        assert_eq!(json["decay"], "cosine");
        assert_eq!(serde_json::from_value::<Schedule>(json.clone()).unwrap(), c);
        // `counted` is left out unless set (runs before it encode as they did).
        assert!(json.get("counted").is_none(), "{json}");
        let counted = Schedule { counted: true, ..c };
        let json = serde_json::to_value(counted).unwrap();
        assert_eq!(json["counted"], true);
        assert_eq!(serde_json::from_value::<Schedule>(json).unwrap(), counted);
        // Every field may be left out.
        let d: Schedule = serde_json::from_str("{}").unwrap();
        assert_eq!(d, Schedule::default());
        assert!(serde_json::from_str::<Schedule>(r#"{"decay":"exp"}"#).is_err());
    }
}
