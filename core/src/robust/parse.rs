//! The run's rule ([`Aggregation`]): its grammar (`--aggregation`), its display, and the modes
//! it may be used in.

use super::trim;
use crate::error::{Error, Result};
use crate::shard::Consistency;
use std::fmt;

/// Most pushes a `sync:K` round with a robust rule keeps (the shard holds K × its length
/// values).
pub const MAX_ROBUST_K: usize = 1024;

/// The default margin E of `consensus`.
pub const DEFAULT_CONSENSUS_MARGIN: f32 = 0.5;

/// The default margin E of `zeno`.
pub const DEFAULT_ZENO_MARGIN: f32 = 0.5;

/// How a shard combines pushes (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Aggregation {
    /// The plain mean (sync), every push applied (async).
    #[default]
    Mean,
    /// Coordinate-wise median of a sync round.
    Median,
    /// Coordinate-wise trimmed mean of a sync round.
    TrimmedMean {
        /// Fraction trimmed from each end, in [0, 0.5).
        beta: f32,
    },
    /// Krum: the one push closest to its n − f − 2 nearest others.
    Krum {
        /// Faulty pushes tolerated.
        f: usize,
    },
    /// Multi-Krum: the mean of the m pushes with the best Krum scores.
    MultiKrum {
        /// Faulty pushes tolerated.
        f: usize,
        /// Pushes averaged.
        m: usize,
    },
    /// Async/SSP: refuse a push whose Zeno++-style score against the consensus is below
    /// `-margin` (module doc).
    Consensus {
        /// The margin E, in (0, 100].
        margin: f32,
    },
    /// Async/SSP: Zeno++ proper. The same score with the direction of a gradient of a
    /// validation batch held by the server ([`ZenoReference`](super::ZenoReference)) instead of the pushes'
    /// consensus (module doc, "Zeno++ with a validation batch").
    Zeno {
        /// The margin E, in (0, 100].
        margin: f32,
    },
}

impl Aggregation {
    /// Parses `mean`, `median`, `trimmed_mean:B`, `krum:F`, `multikrum:F,M`, `consensus` or
    /// `consensus:E`.
    ///
    /// # Errors
    /// [`Error::Config`] on anything else or a number out of range (the rule alone; the checks
    /// against the consistency mode are [`Aggregation::validate`]).
    pub fn parse(text: &str) -> Result<Self> {
        let t = text.trim();
        let bad = |what: &str| Error::Config(format!("--aggregation {t:?}: {what}"));
        let int = |s: &str| {
            s.trim()
                .parse::<usize>()
                .map_err(|_| bad("expected a whole number"))
        };
        let float = |s: &str| match s.trim().parse::<f32>() {
            Ok(v) if v.is_finite() => Ok(v),
            _ => Err(bad("expected a number")),
        };
        let a = if t == "mean" {
            Aggregation::Mean
        } else if t == "median" {
            Aggregation::Median
        } else if t == "consensus" {
            Aggregation::Consensus {
                margin: DEFAULT_CONSENSUS_MARGIN,
            }
        } else if let Some(e) = t.strip_prefix("consensus:") {
            Aggregation::Consensus { margin: float(e)? }
        } else if t == "zeno" {
            Aggregation::Zeno {
                margin: DEFAULT_ZENO_MARGIN,
            }
        } else if let Some(e) = t.strip_prefix("zeno:") {
            Aggregation::Zeno { margin: float(e)? }
        } else if let Some(b) = t.strip_prefix("trimmed_mean:") {
            Aggregation::TrimmedMean { beta: float(b)? }
        } else if let Some(f) = t.strip_prefix("krum:") {
            Aggregation::Krum { f: int(f)? }
        } else if let Some(fm) = t.strip_prefix("multikrum:") {
            let (f, m) = fm.split_once(',').ok_or_else(|| bad("use multikrum:F,M"))?;
            Aggregation::MultiKrum {
                f: int(f)?,
                m: int(m)?,
            }
        } else {
            return Err(bad(
                "use mean, median, trimmed_mean:B, krum:F, multikrum:F,M (sync:K) or consensus[:E] (async, ssp)",
            ));
        };
        a.check_alone()?;
        Ok(a)
    }

    fn check_alone(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(format!("--aggregation {self}: {m}")));
        match *self {
            Aggregation::TrimmedMean { beta } if !(0.0..0.5).contains(&beta) => {
                bad("the trim fraction must be in [0, 0.5)".into())
            }
            Aggregation::MultiKrum { m: 0, .. } => bad("M must be at least 1".into()),
            Aggregation::Consensus { margin } | Aggregation::Zeno { margin }
                if !(margin > 0.0 && margin <= 100.0) =>
            {
                bad("the margin must be in (0, 100]".into())
            }
            _ => Ok(()),
        }
    }

    /// Whether a `sync:K` round keeps its pushes one by one (every rule but the mean).
    pub fn keeps_rows(&self) -> bool {
        matches!(
            self,
            Aggregation::Median
                | Aggregation::TrimmedMean { .. }
                | Aggregation::Krum { .. }
                | Aggregation::MultiKrum { .. }
        )
    }

    /// Checks the rule fits the consistency mode: the round rules need `sync:K` with
    /// K ≤ [`MAX_ROBUST_K`] (and Krum K ≥ 2f + 3, Multi-Krum also m ≤ K − f, the trimmed mean a
    /// fraction that trims at least one push of K); `consensus` needs `async` or `ssp:S`.
    ///
    /// # Errors
    /// [`Error::Config`] saying what to change.
    pub fn validate(&self, consistency: Consistency) -> Result<()> {
        self.check_alone()?;
        let bad = |m: String| Err(Error::Config(format!("--aggregation {self}: {m}")));
        match (*self, consistency) {
            (Aggregation::Mean, _) => Ok(()),
            (Aggregation::Consensus { .. }, Consistency::Sync { .. }) => bad(
                "consensus filters pushes applied on receipt (async, ssp:S); in sync:K use median, trimmed_mean:B, krum:F or multikrum:F,M".into(),
            ),
            (Aggregation::Consensus { .. }, _) => Ok(()),
            (Aggregation::Zeno { .. }, Consistency::Sync { .. }) => bad(
                "zeno filters pushes applied on receipt (async, ssp:S); in sync:K use median, trimmed_mean:B, krum:F or multikrum:F,M".into(),
            ),
            (Aggregation::Zeno { .. }, _) => Ok(()),
            (_, Consistency::Sync { k }) => {
                if k > MAX_ROBUST_K {
                    return bad(format!(
                        "keeps the K pushes of a round, so it needs K <= {MAX_ROBUST_K} (sync:{k})"
                    ));
                }
                match *self {
                    Aggregation::TrimmedMean { beta } if beta > 0.0 && trim(beta, k) == 0 => {
                        bad(format!(
                            "trims floor({beta} x {k}) = 0 pushes from each end of a sync:{k} round; use a fraction of at least 1/{k}"
                        ))
                    }
                    Aggregation::Krum { f } | Aggregation::MultiKrum { f, .. } if k < 2 * f + 3 => {
                        bad(format!(
                            "Krum tolerating f = {f} needs K >= 2f + 3 = {} pushes per round (sync:{k})",
                            2 * f + 3
                        ))
                    }
                    Aggregation::MultiKrum { f, m } if m > k - f => bad(format!(
                        "Multi-Krum averages at most K - f = {} pushes (M = {m})",
                        k - f
                    )),
                    _ => Ok(()),
                }
            }
            (_, other) => bad(format!(
                "a round rule needs --consistency sync:K (it combines the K pushes of a round), not {other}; in async and ssp use consensus"
            )),
        }
    }
}

impl fmt::Display for Aggregation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Aggregation::Mean => write!(f, "mean"),
            Aggregation::Median => write!(f, "median"),
            Aggregation::TrimmedMean { beta } => write!(f, "trimmed_mean:{beta}"),
            Aggregation::Krum { f: k } => write!(f, "krum:{k}"),
            Aggregation::MultiKrum { f: k, m } => write!(f, "multikrum:{k},{m}"),
            Aggregation::Consensus { margin } => write!(f, "consensus:{margin}"),
            Aggregation::Zeno { margin } => write!(f, "zeno:{margin}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_display_and_validate() {
        for (text, want) in [
            ("mean", Aggregation::Mean),
            ("median", Aggregation::Median),
            ("trimmed_mean:0.2", Aggregation::TrimmedMean { beta: 0.2 }),
            ("krum:2", Aggregation::Krum { f: 2 }),
            ("multikrum:2,4", Aggregation::MultiKrum { f: 2, m: 4 }),
            ("consensus:0.25", Aggregation::Consensus { margin: 0.25 }),
            ("zeno:0.3", Aggregation::Zeno { margin: 0.3 }),
        ] {
            let a = Aggregation::parse(text).unwrap();
            assert_eq!(a, want);
            assert_eq!(a.to_string(), text);
            assert_eq!(Aggregation::parse(&a.to_string()).unwrap(), a);
        }
        assert_eq!(
            Aggregation::parse("consensus").unwrap(),
            Aggregation::Consensus {
                margin: DEFAULT_CONSENSUS_MARGIN
            }
        );
        for bad in [
            "avg",
            "trimmed_mean:0.5",
            "trimmed_mean:-0.1",
            "trimmed_mean:nan",
            "krum",
            "krum:-1",
            "multikrum:2",
            "multikrum:2,0",
            "consensus:0",
            "consensus:-1",
            "consensus:x",
            "zeno:0",
            "zeno:inf",
        ] {
            assert!(Aggregation::parse(bad).is_err(), "{bad}");
        }
        let sync = |k| Consistency::Sync { k };
        assert!(Aggregation::Mean.validate(Consistency::Async).is_ok());
        assert!(Aggregation::Median.validate(sync(10)).is_ok());
        let e = Aggregation::Median
            .validate(Consistency::Async)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sync:K"), "{e}");
        let e = Aggregation::Krum { f: 2 }
            .validate(sync(6))
            .unwrap_err()
            .to_string();
        assert!(e.contains("K >= 2f + 3 = 7"), "{e}");
        assert!(Aggregation::Krum { f: 2 }.validate(sync(7)).is_ok());
        assert!(Aggregation::MultiKrum { f: 2, m: 6 }
            .validate(sync(7))
            .is_err());
        assert!(Aggregation::MultiKrum { f: 2, m: 5 }
            .validate(sync(7))
            .is_ok());
        let e = Aggregation::TrimmedMean { beta: 0.05 }
            .validate(sync(10))
            .unwrap_err()
            .to_string();
        assert!(e.contains("at least 1/10"), "{e}");
        assert!(Aggregation::TrimmedMean { beta: 0.1 }
            .validate(sync(10))
            .is_ok());
        assert!(Aggregation::Median
            .validate(sync(MAX_ROBUST_K + 1))
            .is_err());
        let c = Aggregation::Consensus { margin: 0.5 };
        assert!(c.validate(Consistency::Ssp { bound: 2 }).is_ok());
        assert!(c.validate(sync(4)).is_err());
        assert_eq!(
            Aggregation::parse("zeno").unwrap(),
            Aggregation::Zeno {
                margin: DEFAULT_ZENO_MARGIN
            }
        );
        let z = Aggregation::Zeno { margin: 0.5 };
        assert!(z.validate(Consistency::Async).is_ok());
        let e = z.validate(sync(4)).unwrap_err().to_string();
        assert!(e.contains("async"), "{e}");
    }
}
