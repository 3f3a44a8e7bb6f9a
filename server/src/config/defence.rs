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

/// Flags of `crowdgrad serve` for spot checks and quarantine.
#[derive(Debug, Clone, Args)]
pub struct SpotArgs {
    /// Fraction of pushes the server recomputes and compares with what the worker sent
    /// (e.g. 0.01); 0 turns spot checks off. With it on, every push must carry a push tag.
    #[arg(long, default_value_t = 0.0)]
    pub spot_check: f64,
    /// A spot check passes when the cosine similarity of the pushed and the recomputed slice
    /// is at least this.
    #[arg(long, default_value_t = DEFAULT_COSINE)]
    pub spot_check_cosine: f64,
    /// ... and the pushed slice's norm is within this relative distance of the recomputed one's.
    #[arg(long, default_value_t = DEFAULT_NORM_TOL)]
    pub spot_check_norm_tol: f64,
    /// Versions of every shard's parameters kept for spot checks and rollbacks (memory: this
    /// × parameters × 4 bytes); a push read from an older version is refused too_stale.
    #[arg(long, default_value_t = 64)]
    pub spot_check_history: usize,
    /// Do not roll shards back when a failed spot check quarantines a worker. By default
    /// every shard is rolled back to the version before the poisoner's first applied push,
    /// if --spot-check-history still holds it (the honest pushes since are undone too);
    /// otherwise, and with this flag, the run heals by training on.
    #[arg(long)]
    pub no_spot_check_rollback: bool,
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
    /// Versions kept per shard.
    pub history: usize,
    /// Roll a shard back past a quarantined poisoner's pushes (`--spot-check-rollback`).
    pub rollback: bool,
    /// When refusals quarantine.
    pub quarantine: QuarantinePolicy,
}

impl Default for SpotConfig {
    fn default() -> Self {
        Self {
            fraction: 0.0,
            cosine: DEFAULT_COSINE,
            norm_tol: DEFAULT_NORM_TOL,
            history: 64,
            rollback: true,
            quarantine: QuarantinePolicy::default(),
        }
    }
}

impl SpotArgs {
    /// Checks the flags.
    ///
    /// # Errors
    /// [`Error::Config`] naming the bad flag.
    pub fn check(&self) -> Result<SpotConfig> {
        let bad = |m: String| Err(Error::Config(m));
        if !(0.0..=1.0).contains(&self.spot_check) {
            return bad(format!(
                "--spot-check {} must be a fraction in [0, 1]",
                self.spot_check
            ));
        }
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
        if !(1..=4096).contains(&self.spot_check_history) {
            return bad(format!(
                "--spot-check-history {} must be in 1..=4096",
                self.spot_check_history
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
            fraction: self.spot_check,
            cosine: self.spot_check_cosine,
            norm_tol: self.spot_check_norm_tol,
            history: self.spot_check_history,
            rollback: !self.no_spot_check_rollback,
            quarantine: QuarantinePolicy {
                rejections: self.quarantine_rejections,
                window: Duration::from_secs_f64(self.quarantine_window),
                out_of_bounds: self.quarantine_out_of_bounds,
            },
        })
    }
}
