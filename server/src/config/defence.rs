//! The flags of the defences that need more than one push to judge: spot checks and
//! quarantine (`crate::defence`), and their checked form.

use crate::error::{Error, Result};
use clap::Args;
use std::time::Duration;

/// When refused frames quarantine a worker.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuarantinePolicy {
    /// Refusals within `window` that quarantine a worker; 0 turns it off.
    pub rejections: u32,
    /// The window.
    pub window: Duration,
    /// Whether `out_of_bounds` refusals (the norm bound, the largest value) count too. Off by
    /// default: an honest worker's unusual gradient is refused now and then, and must not get
    /// it quarantined; the refusal alone already keeps the push out.
    pub out_of_bounds: bool,
}

impl Default for QuarantinePolicy {
    fn default() -> Self {
        Self {
            rejections: 0,
            window: Duration::from_secs(60),
            out_of_bounds: false,
        }
    }
}

/// Default `--spot-check-cosine` (docs/benchmarks.md, "Spot checks").
pub const DEFAULT_COSINE: f64 = 0.99;
/// Default `--spot-check-norm-tol`.
pub const DEFAULT_NORM_TOL: f64 = 0.05;
/// `--spot-check auto` where this process holds the shards and the data: the fraction of a
/// vouched worker's pushes checked (a worker on probation is checked at least at
/// `PROBATION_RATE`, `crate::defence::spotcheck`). A 2-shard round is then recomputed for
/// about 4% of rounds: the checker costs about 4% of the crowd's compute on one thread.
pub const DEFAULT_FRACTION: f64 = 0.02;
/// `--spot-check-history auto`: the versions kept are what fits in this many bytes
/// (`history × parameters × 4`), between [`MIN_AUTO_HISTORY`] and [`MAX_AUTO_HISTORY`]:
/// 64 versions of the MLP (26 MB), 20 of the default gpt (3.3 MB each).
pub const HISTORY_BYTES: usize = 64 << 20;
/// The fewest versions `--spot-check-history auto` keeps, whatever the model's size: fewer
/// would refuse honest pushes `too_stale` at ordinary staleness.
pub const MIN_AUTO_HISTORY: usize = 8;
/// The most versions `--spot-check-history auto` keeps (the fixed default before issue 21's
/// defaults: enough for the staleness of a few dozen workers).
pub const MAX_AUTO_HISTORY: usize = 64;

/// `--spot-check-history auto` for a model of `params` parameters ([`HISTORY_BYTES`]).
pub fn auto_history(params: usize) -> usize {
    (HISTORY_BYTES / params.max(1).saturating_mul(4)).clamp(MIN_AUTO_HISTORY, MAX_AUTO_HISTORY)
}

/// Flags of `crowdgrad serve` for spot checks and quarantine.
#[derive(Debug, Clone, Args)]
pub struct SpotArgs {
    /// Fraction of pushes the server recomputes and compares with what the worker sent; 0
    /// turns spot checks off. `auto`: 0.02 when this process holds the shards and the data,
    /// 0 with --shard-urls (the coordinator does not see those pushes). A worker's first 4
    /// checks are drawn at a rate of at least 0.5 (probation). With it on, every push must
    /// carry a push tag.
    #[arg(long, default_value = "auto")]
    pub spot_check: String,
    /// A spot check passes when the cosine similarity of the pushed and the recomputed slice
    /// is at least this.
    #[arg(long, default_value_t = DEFAULT_COSINE)]
    pub spot_check_cosine: f64,
    /// ... and the pushed slice's norm is within this relative distance of the recomputed one's.
    #[arg(long, default_value_t = DEFAULT_NORM_TOL)]
    pub spot_check_norm_tol: f64,
    /// Versions of every shard's parameters kept for spot checks and rollbacks (memory: this
    /// × parameters × 4 bytes); a push read from an older version is refused too_stale.
    /// `auto`: what fits in 64 MiB, 8 to 64 versions (64 of the MLP, 20 of the default gpt).
    #[arg(long, default_value = "auto")]
    pub spot_check_history: String,
    /// Do not roll shards back when a failed spot check quarantines a worker. By default
    /// every shard is rolled back to the version before the poisoner's first applied push,
    /// if --spot-check-history still holds it (the honest pushes since are undone too);
    /// otherwise, and with this flag, the run heals by training on.
    #[arg(long)]
    pub no_spot_check_rollback: bool,
    /// Apply the pushes of workers on probation (their first 4 checks) before their check,
    /// as every other checked push, instead of holding them until it passes. For lessons and
    /// comparisons only: a fresh identity's poison then lands before its verdict and needs a
    /// rollback (docs/defences.md, "Probation").
    #[arg(long)]
    pub no_spot_check_hold: bool,
    /// Quarantine a worker after this many refused frames within --quarantine-window
    /// (too_stale and busy never count, out_of_bounds only with --quarantine-out-of-bounds);
    /// 0 turns it off. A failed spot check always quarantines.
    #[arg(long, default_value_t = 0)]
    pub quarantine_rejections: u32,
    /// The window of --quarantine-rejections, seconds.
    #[arg(long, default_value_t = 60.0)]
    pub quarantine_window: f64,
    /// Count out_of_bounds refusals (the norm bound, --max-push-value) toward
    /// --quarantine-rejections too. Off by default: an honest worker's outlier gradient is
    /// refused now and then and must not get it quarantined.
    #[arg(long)]
    pub quarantine_out_of_bounds: bool,
}

/// Checked spot-check and quarantine settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpotConfig {
    /// Fraction of pushes checked (0: off).
    pub fraction: f64,
    /// Least cosine similarity that passes.
    pub cosine: f64,
    /// Largest relative norm difference that passes.
    pub norm_tol: f64,
    /// Versions kept per shard; `None`: `--spot-check-history auto` ([`auto_history`] of the
    /// model's size, worked out when the checker starts).
    pub history: Option<usize>,
    /// Roll a shard back past a quarantined poisoner's pushes (`--spot-check-rollback`).
    pub rollback: bool,
    /// Hold a worker's pushes on probation until their check passes (`--no-spot-check-hold`
    /// turns it off).
    pub hold: bool,
    /// When refusals quarantine.
    pub quarantine: QuarantinePolicy,
}

impl Default for SpotConfig {
    fn default() -> Self {
        Self {
            fraction: 0.0,
            cosine: DEFAULT_COSINE,
            norm_tol: DEFAULT_NORM_TOL,
            history: None,
            rollback: true,
            hold: true,
            quarantine: QuarantinePolicy::default(),
        }
    }
}

impl SpotArgs {
    /// Checks the flags. `local_shards`: this process holds the shards and the data (no
    /// `--shard-urls`), which is where `--spot-check auto` turns spot checks on.
    ///
    /// # Errors
    /// [`Error::Config`] naming the bad flag.
    pub fn check(&self, local_shards: bool) -> Result<SpotConfig> {
        let bad = |m: String| Err(Error::Config(m));
        let fraction = match self.spot_check.trim() {
            "auto" if local_shards => DEFAULT_FRACTION,
            "auto" => 0.0,
            f => match f.parse::<f64>() {
                Ok(f) if (0.0..=1.0).contains(&f) => f,
                _ => {
                    return bad(format!(
                        "--spot-check {} must be auto or a fraction in [0, 1]",
                        self.spot_check
                    ))
                }
            },
        };
        let history = match self.spot_check_history.trim() {
            "auto" => None,
            h => match h.parse::<usize>() {
                Ok(h) if (1..=4096).contains(&h) => Some(h),
                _ => {
                    return bad(format!(
                        "--spot-check-history {} must be auto or in 1..=4096",
                        self.spot_check_history
                    ))
                }
            },
        };
        if !(-1.0..=1.0).contains(&self.spot_check_cosine) {
            return bad(format!(
                "--spot-check-cosine {} must be in [-1, 1]",
                self.spot_check_cosine
            ));
        }
        if !(self.spot_check_norm_tol.is_finite() && self.spot_check_norm_tol >= 0.0) {
            return bad(format!(
                "--spot-check-norm-tol {} must be a non-negative number",
                self.spot_check_norm_tol
            ));
        }
        if !(self.quarantine_window.is_finite()
            && self.quarantine_window > 0.0
            && self.quarantine_window <= 86_400.0)
        {
            return bad(format!(
                "--quarantine-window {} must be between 0 and 86400 seconds",
                self.quarantine_window
            ));
        }
        Ok(SpotConfig {
            fraction,
            cosine: self.spot_check_cosine,
            norm_tol: self.spot_check_norm_tol,
            history,
            rollback: !self.no_spot_check_rollback,
            hold: !self.no_spot_check_hold,
            quarantine: QuarantinePolicy {
                rejections: self.quarantine_rejections,
                window: Duration::from_secs_f64(self.quarantine_window),
                out_of_bounds: self.quarantine_out_of_bounds,
            },
        })
    }
}
