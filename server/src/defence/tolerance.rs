//! How close a pushed slice must be to the spot checker's recomputation of it (issue 21):
//! the fixed tolerances widened by the push encoding's error bound ([`within_tolerance`]),
//! and, for a round of local steps outside them, its own sensitivity
//! ([`sensitivity_verdict`]; the recomputations are `crate::defence::spotcheck`'s). Pure
//! functions of the figures: no state, no I/O.

use crate::config::defence::SpotConfig;
use crate::defence::reputation::CheckFigures;

/// Nudged recomputations of a round outside the fixed tolerances (`within_sensitivity`).
pub const NUDGES: u32 = 2;
/// How many times its sensitivity a round may be from the recomputation.
pub const SENSITIVITY_FACTOR: f64 = 4.0;
/// The least cosine a round judged by its sensitivity may have: a sign flip (−1) or a round
/// pointing away from the recomputation never passes, however chaotic the round. Not
/// higher: an honest browser round of 1,481 Adam steps in bf16 was at cosine 0.4652 from the
/// native recomputation (a floor of 0.5 quarantined that tab after 2,959 checks).
pub const SENSITIVITY_COSINE: f64 = 0.0;
/// The largest relative norm difference a round judged by its sensitivity may have.
pub const SENSITIVITY_NORM: f64 = 0.5;

/// Whether a round at `distance` from the recomputation, whose nudged recomputations spread
/// `spread` from it, passes (`Checker::within_sensitivity`; module docs, "Sensitivity"): the
/// floors first, then `distance ≤ SENSITIVITY_FACTOR · spread + bound`. A round no nudge
/// moved (`spread` 0) is not sensitive and gets nothing.
pub fn sensitivity_verdict(f: CheckFigures, distance: f64, spread: f64, bound: f64) -> bool {
    f.cosine >= SENSITIVITY_COSINE
        && (f.norm_ratio - 1.0).abs() <= SENSITIVITY_NORM
        && spread > 0.0
        && spread.is_finite()
        && distance <= SENSITIVITY_FACTOR * spread + bound.max(0.0)
}

/// ‖a − b‖₂ in f64.
pub(crate) fn distance(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
        .sum::<f64>()
        .sqrt()
}

/// Whether a push passes its check: the f32 tolerances (cosine at least `cfg.cosine`, norm
/// ratio within `1 ± cfg.norm_tol`), or, for a lossy encoding whose rounding moved the slice
/// by at most `bound` (`SampledPush::error_bound`), the same tolerances widened by exactly
/// that: `‖pushed − expected‖ ≤ √(2(1 − cosine))·‖expected‖ + bound` (the distance the cosine
/// threshold allows at equal norms, plus the encoding's) and
/// `|‖pushed‖ − ‖expected‖| ≤ norm_tol·‖expected‖ + bound`. A sign flip or a scaled gradient
/// is as far off as before (the bound is a few percent of the norm); an honest int8 push with
/// error feedback is compared as what it is.
pub fn within_tolerance(
    cfg: &SpotConfig,
    f: CheckFigures,
    expected: &[f32],
    pushed: &[f32],
    bound: f64,
) -> bool {
    if f.cosine >= cfg.cosine && (f.norm_ratio - 1.0).abs() <= cfg.norm_tol {
        return true;
    }
    if !(bound > 0.0 && bound.is_finite()) {
        return false;
    }
    let (mut dd, mut ee, mut pp) = (0.0f64, 0.0f64, 0.0f64);
    for (&e, &p) in expected.iter().zip(pushed) {
        let (e, p) = (f64::from(e), f64::from(p));
        dd += (p - e) * (p - e);
        ee += e * e;
        pp += p * p;
    }
    let (d, ne, np) = (dd.sqrt(), ee.sqrt(), pp.sqrt());
    let delta = (2.0 * (1.0 - cfg.cosine).max(0.0)).sqrt();
    d <= delta * ne + bound && (np - ne).abs() <= cfg.norm_tol * ne + bound
}

/// Cosine similarity and norm ratio of `pushed` to `expected` (in f64). Two zero vectors
/// agree; a zero vector against a nonzero one has cosine 0.
pub fn compare(expected: &[f32], pushed: &[f32]) -> CheckFigures {
    let (mut dot, mut ee, mut pp) = (0.0f64, 0.0f64, 0.0f64);
    for (&e, &p) in expected.iter().zip(pushed) {
        let (e, p) = (f64::from(e), f64::from(p));
        dot += e * p;
        ee += e * e;
        pp += p * p;
    }
    let (ne, np) = (ee.sqrt(), pp.sqrt());
    if ne == 0.0 && np == 0.0 {
        return CheckFigures {
            cosine: 1.0,
            norm_ratio: 1.0,
        };
    }
    if ne == 0.0 || np == 0.0 {
        return CheckFigures {
            cosine: 0.0,
            norm_ratio: if ne == 0.0 { f64::INFINITY } else { 0.0 },
        };
    }
    CheckFigures {
        cosine: dot / (ne * np),
        norm_ratio: np / ne,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 21: a round outside the fixed tolerances passes on its own sensitivity only
    /// within the factor of its nudged spread, and never below the floors: a sign flip, a
    /// halved or doubled round, or a round no nudge moved fails however far it is.
    #[test]
    fn a_sensitive_round_passes_within_its_spread_and_never_below_the_floors() {
        let f = |cosine, norm_ratio| CheckFigures { cosine, norm_ratio };
        // A chaotic honest round (the browser's worst seen: cosine 0.66) within 4 spreads.
        assert!(sensitivity_verdict(f(0.66, 1.02), 0.8, 0.25, 0.0));
        assert!(!sensitivity_verdict(f(0.66, 1.02), 0.8, 0.19, 0.0));
        // The encoding's bound widens it as it does the fixed tolerance.
        assert!(sensitivity_verdict(f(0.66, 1.02), 0.8, 0.19, 0.1));
        // The floors hold whatever the spread.
        assert!(
            !sensitivity_verdict(f(-1.0, 1.0), 2.0, 1e9, 0.0),
            "sign flip"
        );
        assert!(!sensitivity_verdict(f(0.99, 2.0), 1.0, 1e9, 0.0), "doubled");
        assert!(!sensitivity_verdict(f(0.99, 0.49), 0.5, 1e9, 0.0), "halved");
        assert!(
            !sensitivity_verdict(f(-0.01, 1.0), 1.4, 1e9, 0.0),
            "pointing away"
        );
        // The worst honest browser round seen (bf16, H = 1,481): cosine 0.4652.
        assert!(sensitivity_verdict(f(0.4652, 0.934), 1.03, 0.3, 0.0));
        // Not sensitive: no nudge moved it, so the fixed tolerance is all it gets.
        assert!(!sensitivity_verdict(f(0.95, 1.0), 1e-9, 0.0, 0.0));
        assert!(!sensitivity_verdict(f(0.95, 1.0), 0.1, f64::NAN, 0.0));
    }
}
