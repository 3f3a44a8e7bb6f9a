//! The run's policies: the consistency mode ([`Consistency`]) and what staleness does to an
//! async or SSP push ([`StalenessPolicy`], [`LrScale`]), with their command-line grammar.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fmt;

/// How a run keeps workers consistent. In JSON (the join reply's `run.consistency`) it is the
/// same text as on the command line: `"async"`, `"ssp:2"`, `"sync:4"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum Consistency {
    /// Apply every push on receipt (Hogwild / Downpour / TensorFlow's async PS).
    Async,
    /// Stale-synchronous parallel: a worker may be at most `bound` clock ticks ahead of the
    /// slowest active worker.
    Ssp {
        /// The staleness bound S.
        bound: u64,
    },
    /// Synchronous with backup workers: aggregate `k` gradients computed from the current
    /// version, apply their mean once, drop late ones.
    Sync {
        /// Gradients per update (TensorFlow's `replicas_to_aggregate`).
        k: usize,
    },
}

impl Consistency {
    /// Parses `async`, `ssp:S` or `sync:K`.
    ///
    /// # Errors
    /// [`Error::Config`] on anything else, or K = 0.
    pub fn parse(text: &str) -> Result<Self> {
        let t = text.trim();
        let num = |s: &str| {
            s.parse::<u64>()
                .map_err(|_| Error::Config(format!("bad number in consistency mode {t:?}")))
        };
        if t == "async" {
            Ok(Consistency::Async)
        } else if let Some(s) = t.strip_prefix("ssp:") {
            Ok(Consistency::Ssp { bound: num(s)? })
        } else if let Some(k) = t.strip_prefix("sync:") {
            let k = usize::try_from(num(k)?).unwrap_or(usize::MAX);
            let c = Consistency::Sync { k };
            c.validate()?;
            Ok(c)
        } else {
            Err(Error::Config(format!(
                "unknown consistency mode {t:?}: use async, ssp:S or sync:K"
            )))
        }
    }

    /// Checks a mode made in code (a parsed one always passes): sync:K needs 1 <= K <= 65536.
    ///
    /// # Errors
    /// [`Error::Config`] for K out of range.
    pub fn validate(&self) -> Result<()> {
        match *self {
            Consistency::Sync { k: 0 } => Err(Error::Config("sync:K needs K >= 1".into())),
            Consistency::Sync { k } if k > 65_536 => {
                Err(Error::Config("sync:K needs K <= 65536".into()))
            }
            _ => Ok(()),
        }
    }
}

impl From<Consistency> for String {
    fn from(c: Consistency) -> Self {
        c.to_string()
    }
}

impl TryFrom<String> for Consistency {
    type Error = Error;

    fn try_from(text: String) -> Result<Self> {
        Consistency::parse(&text)
    }
}

impl fmt::Display for Consistency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Consistency::Async => write!(f, "async"),
            Consistency::Ssp { bound } => write!(f, "ssp:{bound}"),
            Consistency::Sync { k } => write!(f, "sync:{k}"),
        }
    }
}

/// How a staleness-aware policy scales the learning rate of a push of staleness τ (see the
/// module doc for why the default is relative).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrScale {
    /// `scale`: `min(1, H / max(1, τ))` with H the shard's running harmonic mean of
    /// `max(1, τ)`: stale pushes are weighted down relative to the usual staleness, the usual
    /// step stays the configured learning rate.
    #[default]
    Relative,
    /// `scale:abs`: `1 / max(1, τ)` (Zhang et al. 2016). Divides the mean step by about the
    /// mean staleness, so it needs a learning rate about that many times larger.
    Absolute,
}

/// Pushes the running mean staleness of [`LrScale::Relative`] averages over (the weight of an
/// exponential moving average: `1 / STALENESS_WINDOW`, or `1 / n` for the first pushes).
pub const STALENESS_WINDOW: u64 = 256;

/// What staleness does to an async (or SSP) push. The parts combine: a push is first checked
/// against `max_staleness`, then compensated, then applied with the scaled learning rate.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct StalenessPolicy {
    /// Reject pushes staler than this.
    pub max_staleness: Option<u64>,
    /// Scale the learning rate down for stale pushes (`scale` or `scale:abs`).
    pub scale_lr: Option<LrScale>,
    /// DC-ASGD: add `lambda * g * g * (w_now - w_read)` to the gradient.
    pub dc_lambda: Option<f32>,
}

impl StalenessPolicy {
    /// Parses `accept`, or a comma list of `drop:N`, `scale` (relative to the mean
    /// staleness), `scale:abs` (lr / staleness), `dc:LAMBDA`.
    ///
    /// # Errors
    /// [`Error::Config`] on anything else.
    pub fn parse(text: &str) -> Result<Self> {
        let mut p = StalenessPolicy::default();
        for part in text.split(',').map(str::trim) {
            if part == "accept" {
                continue;
            } else if part == "scale" {
                p.scale_lr = Some(LrScale::Relative);
            } else if part == "scale:abs" {
                p.scale_lr = Some(LrScale::Absolute);
            } else if let Some(n) = part.strip_prefix("drop:") {
                p.max_staleness = Some(
                    n.parse()
                        .map_err(|_| Error::Config(format!("bad bound in {part:?}")))?,
                );
            } else if let Some(l) = part.strip_prefix("dc:") {
                let l: f32 = l
                    .parse()
                    .map_err(|_| Error::Config(format!("bad lambda in {part:?}")))?;
                if !(l.is_finite() && l >= 0.0) {
                    return Err(Error::Config(format!("DC lambda must be >= 0 in {part:?}")));
                }
                p.dc_lambda = Some(l);
            } else {
                return Err(Error::Config(format!(
                    "unknown staleness policy {part:?}: use accept, drop:N, scale, scale:abs, dc:LAMBDA (comma-separated)"
                )));
            }
        }
        Ok(p)
    }
}

impl fmt::Display for StalenessPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(n) = self.max_staleness {
            parts.push(format!("drop:{n}"));
        }
        match self.scale_lr {
            Some(LrScale::Relative) => parts.push("scale".into()),
            Some(LrScale::Absolute) => parts.push("scale:abs".into()),
            None => {}
        }
        if let Some(l) = self.dc_lambda {
            parts.push(format!("dc:{l}"));
        }
        if parts.is_empty() {
            parts.push("accept".into());
        }
        write!(f, "{}", parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_modes_and_policies() {
        assert_eq!(Consistency::parse("async").unwrap(), Consistency::Async);
        assert_eq!(
            Consistency::parse("ssp:2").unwrap(),
            Consistency::Ssp { bound: 2 }
        );
        assert_eq!(
            Consistency::parse("sync:4").unwrap(),
            Consistency::Sync { k: 4 }
        );
        for bad in ["sync:0", "ssp:x", "bsp", "sync:-1", "sync:65537"] {
            assert!(Consistency::parse(bad).is_err(), "{bad}");
        }
        assert!(Consistency::Sync { k: 0 }.validate().is_err());
        let p = StalenessPolicy::parse("drop:8,scale,dc:0.04").unwrap();
        assert_eq!(
            p,
            StalenessPolicy {
                max_staleness: Some(8),
                scale_lr: Some(LrScale::Relative),
                dc_lambda: Some(0.04)
            }
        );
        assert_eq!(p.to_string(), "drop:8,scale,dc:0.04");
        let p = StalenessPolicy::parse("scale:abs").unwrap();
        assert_eq!(p.scale_lr, Some(LrScale::Absolute));
        assert_eq!(p.to_string(), "scale:abs");
        assert_eq!(
            StalenessPolicy::parse("accept").unwrap(),
            StalenessPolicy::default()
        );
        for bad in ["drop", "dc:nan", "dc:-1", "fast", "scale:rel"] {
            assert!(StalenessPolicy::parse(bad).is_err(), "{bad}");
        }
    }
}
