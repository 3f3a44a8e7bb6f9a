//! Robust aggregation for untrusted volunteers (issue 10): how a shard combines pushes when some
//! workers may send garbage or attack the run.
//!
//! - [`Aggregation`]: the run's rule, chosen per run with `--aggregation`:
//!   - `mean` (the default): the plain mean of a `sync:K` round, every push applied in `async`;
//!   - in `sync:K`, over the K pushes of a round: `median` (coordinate-wise), `trimmed_mean:β`
//!     (coordinate-wise, drops the ⌊βn⌋ largest and smallest values of each coordinate),
//!     `krum:f` (the push with the smallest sum of squared distances to its n − f − 2 nearest
//!     others, Blanchard et al. 2017) and `multikrum:f,m` (the mean of the m best-scored);
//!   - in `async` and `ssp:S`: `consensus[:C]`, a Zeno++-style filter (Xie et al. 2020) that
//!     refuses a push whose direction disagrees with the recent consensus ([`Consensus`]), and
//!     `zeno[:C]`, Zeno++ proper, against the gradient of a validation batch held by the driver
//!     ([`ZenoReference`]).
//! - [`aggregate`]: the pure `sync:K` rules over a buffer of n rows, with preallocated
//!   [`Scratch`] (nothing is allocated per aggregate once the scratch has grown to the round).
//!
//! # Per shard
//! A shard only ever sees its own slice of each push, so every rule runs per shard: the
//! coordinate-wise rules are exactly what they would be on the whole vector, but Krum picks a
//! push per shard (shard 0 may choose worker 3's slice, shard 1 worker 7's). Each choice is still
//! a slice of an honest-looking push; with one shard it is plain Krum.
//!
//! # Partial rounds
//! A `sync:K` round can be flushed with n < K pushes (a worker left, a straggler timed out). The
//! coordinate-wise rules use n; Krum needs n ≥ 2f + 3 and falls back to the coordinate-wise
//! median below that (still robust, and what a round of one or two pushes can afford).
//!
//! # The consensus filter
//! Zeno++ (Xie et al. 2020) accepts a push g when `γ⟨v, g⟩ − ρ‖g‖² ≥ −γε`, v a gradient of a
//! validation batch held by the server: a first-order estimate that the step does not raise the
//! validation loss by more than a margin. A shard holds no data, so v is the running consensus
//! of the pushes it received: the exponential moving average of their *unit* directions over
//! ~[`CONSENSUS_WINDOW`] pushes (each push weighs the same whatever its norm, so an honest
//! majority sets the direction), scaled to the median norm m of the last [`CONSENSUS_NORMS`].
//! Divided by m², with r = ‖g‖ / m and c the cosine of g with the consensus, the test is
//!
//! ```text
//! score = c·r − ρ·r²  ≥  −E        ρ = CONSENSUS_RHO (0.01), E the margin (default 0.5)
//! ```
//!
//! A push failing it is refused ([`crate::wire::ErrorCode::Disagrees`], not fatal; no parameter
//! changes). Why both terms: in async training honest minibatch gradients are nearly orthogonal
//! to the recent consensus (measured with 10 simulated async MNIST workers: cosines centred on 0,
//! 5% below −0.22), so a cosine threshold alone either refuses honest pushes or lets attackers
//! through; a push of the usual norm passes unless it points clearly against the consensus
//! (c < −0.49), while one 10× the usual norm must agree with it (c > 0.05). Refused pushes count
//! in the consensus too: an average of accepted pushes only falls behind the moving model, then
//! refuses everything and never catches up (measured: 93% of honest pushes refused). The shard's
//! norm bound (`--norm-bound`, [`crate::session::PushGuard`]) still applies in every mode.
//!
//! # Zeno++ with a validation batch
//! A driver that holds the training data (the server with its shards in process, the
//! simulator) can give each shard the real v: [`ZenoReference`] computes the gradient of a
//! fixed validation batch ([`ZENO_BATCH`] examples strided through the training set) at the
//! current parameters, every [`ZENO_REFRESH`] updates of shard 0 (Zeno++'s lazy refresh), and
//! each shard gets its slice ([`crate::session::ShardState::set_reference`]). `zeno` then scores
//! a push as above with c its cosine to that slice and ρ = [`ZENO_RHO`] (0.1): against the true
//! descent direction honest minibatch gradients mostly agree, so a larger ρ can refuse pushes
//! of several times the usual norm unless they agree closely, and no warm-up of the direction
//! is needed (the norm term waits for [`ZENO_NORM_WARMUP`] norms). The shard session gives r
//! against the median over workers of each one's median norm (the norm bound's reference,
//! [`crate::session::PushGuard`]), so a worker pushing more often than the others cannot make
//! its own norm the usual one. Measured with 2 of 10
//! simulated async workers pushing −10× their gradient: 96.28% against a clean 96.65%, where
//! `consensus` reaches 91.20% (tests/integration/robust.rs, docs/experiments.md).

use crate::error::{Error, Result};
use crate::shard::Consistency;
use std::fmt;

/// Most pushes a `sync:K` round with a robust rule keeps (the shard holds K × its length
/// values).
pub const MAX_ROBUST_K: usize = 1024;

/// Pushes before [`Consensus`] starts refusing (it needs a direction and a norm to compare with).
pub const CONSENSUS_WARMUP: u64 = 16;

/// The consensus average's window: each push has weight `1 / CONSENSUS_WINDOW` (or
/// `1 / n` for the first ones).
pub const CONSENSUS_WINDOW: u64 = 32;

/// Recent push norms whose median scales the consensus.
pub const CONSENSUS_NORMS: usize = 64;

/// Zeno++'s ρ: the weight of the push's squared (relative) norm in the score.
pub const CONSENSUS_RHO: f64 = 0.01;

/// The default margin E of `consensus`.
pub const DEFAULT_CONSENSUS_MARGIN: f32 = 0.5;

/// The default margin E of `zeno`.
pub const DEFAULT_ZENO_MARGIN: f32 = 0.5;

/// Examples in `zeno`'s validation batch, strided through the training set
/// ([`ZenoReference`]).
pub const ZENO_BATCH: usize = 128;

/// `zeno`'s ρ: larger than [`CONSENSUS_RHO`], because the validation gradient is a reliable
/// direction: a push of r times the usual norm needs a cosine of at least 0.1·r − E/r with it.
pub const ZENO_RHO: f64 = 0.1;

/// Norms `zeno` needs before its norm term counts (the median of 4 survives one outlier).
pub const ZENO_NORM_WARMUP: usize = 4;

/// Updates of shard 0 between two refreshes of `zeno`'s reference gradient (Zeno++'s lazy
/// update of its validation gradient).
pub const ZENO_REFRESH: u64 = 16;

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
    /// validation batch held by the server ([`ZenoReference`]) instead of the pushes'
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

/// Values trimmed from each end of each coordinate for fraction `beta` of `n` pushes, leaving
/// at least one.
pub fn trim(beta: f32, n: usize) -> usize {
    let t = (f64::from(beta) * n as f64).floor() as usize;
    t.min(n.saturating_sub(1) / 2)
}

/// Reusable buffers of [`aggregate`]: they grow to the largest round once and are reused.
#[derive(Debug, Default, Clone)]
pub struct Scratch {
    column: Vec<f32>,
    dist: Vec<f64>,
    near: Vec<f64>,
    scores: Vec<(f64, usize)>,
}

/// Combines `n` pushes of `out.len()` values each, kept one after the other in
/// `rows[..n * out.len()]`, with a `sync:K` round rule into `out`. [`Aggregation::Mean`] (and
/// `Consensus`, which is not a round rule) give the mean. Values are finite (the shard validated
/// them).
///
/// # Panics
/// If `n` is 0 or `rows` holds fewer than `n * out.len()` values (the shard's own buffers).
pub fn aggregate(rule: Aggregation, rows: &[f32], n: usize, out: &mut [f32], s: &mut Scratch) {
    let len = out.len();
    assert!(n > 0 && rows.len() >= n * len, "rows of a round");
    let rows = &rows[..n * len];
    match rule {
        Aggregation::Median => median(rows, n, out, s),
        Aggregation::TrimmedMean { beta } => trimmed_mean(rows, n, trim(beta, n), out, s),
        Aggregation::Krum { f } if n >= 2 * f + 3 => {
            let best = krum_scores(rows, n, f, s)[0].1;
            out.copy_from_slice(&rows[best * len..(best + 1) * len]);
        }
        Aggregation::MultiKrum { f, m } if n >= 2 * f + 3 => {
            let m = m.clamp(1, n - f);
            krum_scores(rows, n, f, s);
            out.fill(0.0);
            for &(_, i) in &s.scores[..m] {
                for (o, v) in out.iter_mut().zip(&rows[i * len..(i + 1) * len]) {
                    *o += v;
                }
            }
            let inv = 1.0 / m as f32;
            out.iter_mut().for_each(|o| *o *= inv);
        }
        // Too few pushes for Krum: the coordinate-wise median (module doc).
        Aggregation::Krum { .. } | Aggregation::MultiKrum { .. } => median(rows, n, out, s),
        Aggregation::Mean | Aggregation::Consensus { .. } | Aggregation::Zeno { .. } => {
            out.fill(0.0);
            for row in rows.chunks_exact(len) {
                for (o, v) in out.iter_mut().zip(row) {
                    *o += v;
                }
            }
            let inv = 1.0 / n as f32;
            out.iter_mut().for_each(|o| *o *= inv);
        }
    }
}

/// Coordinate `j` of the `n` rows, sorted, in `column`.
fn sorted_column<'a>(
    rows: &[f32],
    n: usize,
    len: usize,
    j: usize,
    column: &'a mut Vec<f32>,
) -> &'a [f32] {
    column.clear();
    column.extend((0..n).map(|i| rows[i * len + j]));
    column.sort_unstable_by(f32::total_cmp);
    column
}

/// Coordinate-wise median (the mean of the two middle values for even `n`).
fn median(rows: &[f32], n: usize, out: &mut [f32], s: &mut Scratch) {
    let len = out.len();
    for (j, o) in out.iter_mut().enumerate() {
        let c = sorted_column(rows, n, len, j, &mut s.column);
        *o = if n % 2 == 1 {
            c[n / 2]
        } else {
            0.5 * (c[n / 2 - 1] + c[n / 2])
        };
    }
}

/// Coordinate-wise mean of the values left after dropping the `t` smallest and `t` largest.
fn trimmed_mean(rows: &[f32], n: usize, t: usize, out: &mut [f32], s: &mut Scratch) {
    let len = out.len();
    let kept = n - 2 * t;
    for (j, o) in out.iter_mut().enumerate() {
        let c = sorted_column(rows, n, len, j, &mut s.column);
        let sum: f64 = c[t..n - t].iter().map(|&v| f64::from(v)).sum();
        *o = (sum / kept as f64) as f32;
    }
}

/// Krum scores of the `n` rows, best (smallest) first, ties by index: row i's score is the sum
/// of its n − f − 2 smallest squared distances to the other rows. Needs n ≥ 2f + 3.
fn krum_scores<'a>(rows: &[f32], n: usize, f: usize, s: &'a mut Scratch) -> &'a [(f64, usize)] {
    let len = rows.len() / n;
    s.dist.clear();
    s.dist.resize(n * n, 0.0);
    for i in 0..n {
        for j in i + 1..n {
            let (a, b) = (&rows[i * len..(i + 1) * len], &rows[j * len..(j + 1) * len]);
            let d: f64 = a
                .iter()
                .zip(b)
                .map(|(&x, &y)| {
                    let e = f64::from(x) - f64::from(y);
                    e * e
                })
                .sum();
            s.dist[i * n + j] = d;
            s.dist[j * n + i] = d;
        }
    }
    let nearest = n - f - 2;
    s.scores.clear();
    for i in 0..n {
        s.near.clear();
        s.near
            .extend((0..n).filter(|&j| j != i).map(|j| s.dist[i * n + j]));
        s.near.sort_unstable_by(f64::total_cmp);
        let score = s.near[..nearest].iter().sum();
        s.scores.push((score, i));
    }
    s.scores
        .sort_unstable_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    &s.scores
}

/// The running consensus of a shard's recent async/SSP pushes: direction and norm (module doc).
#[derive(Debug, Default, Clone)]
pub struct Consensus {
    /// Exponential moving average of the unit directions of recent pushes.
    ema: Vec<f32>,
    /// Pushes it has seen.
    seen: u64,
    /// Norms of the last [`CONSENSUS_NORMS`] pushes, and a buffer to sort them in.
    norms: std::collections::VecDeque<f64>,
    sorted: Vec<f64>,
    /// `zeno`: this shard's slice of the validation gradient ([`Consensus::set_reference`]).
    reference: Option<Vec<f32>>,
}

impl Consensus {
    /// `zeno`: compares pushes with `slice` (this shard's slice of a validation gradient)
    /// from now on.
    pub fn set_reference(&mut self, slice: &[f32]) {
        match &mut self.reference {
            Some(r) if r.len() == slice.len() => r.copy_from_slice(slice),
            r => *r = Some(slice.to_vec()),
        }
    }

    /// The reference slice, once set.
    pub fn reference(&self) -> Option<&[f32]> {
        self.reference.as_deref()
    }

    /// Whether `grad` may be applied under `zeno` with margin `margin`: the score of
    /// [`Consensus::check`] with the reference as the direction. Always before the first
    /// reference and for a zero push; the norm term counts once [`ZENO_NORM_WARMUP`] norms are
    /// known (before, r = 1: the direction alone decides), with ρ = [`ZENO_RHO`].
    ///
    /// # Errors
    /// The reason, when the push's score is below `-margin`.
    pub fn check_zeno(
        &mut self,
        grad: &[f32],
        margin: f32,
        ratio: Option<f64>,
    ) -> std::result::Result<(), String> {
        let Some(v) = self.reference.as_deref().filter(|v| v.len() == grad.len()) else {
            return Ok(());
        };
        let (dot, gg, vv) = dots(grad, v);
        if gg == 0.0 || vv == 0.0 {
            return Ok(());
        }
        let cos = dot / (gg.sqrt() * vv.sqrt());
        let r = match ratio {
            Some(r) if r.is_finite() => r,
            _ => {
                let median = self.median_norm();
                if self.norms.len() < ZENO_NORM_WARMUP || median == 0.0 {
                    1.0
                } else {
                    gg.sqrt() / median
                }
            }
        };
        let score = cos * r - ZENO_RHO * r * r;
        if score < -f64::from(margin) {
            return Err(format!(
                "the push would raise the loss of the server's validation batch: cosine {cos:.3} with its gradient at {r:.2}x the usual norm scores {score:.3} < -{margin}"
            ));
        }
        Ok(())
    }

    fn median_norm(&mut self) -> f64 {
        self.sorted.clear();
        self.sorted.extend(self.norms.iter().copied());
        self.sorted.sort_unstable_by(f64::total_cmp);
        self.sorted
            .get(self.sorted.len() / 2)
            .copied()
            .unwrap_or(0.0)
    }

    /// Whether `grad` may be applied with margin `margin`: always during the first
    /// [`CONSENSUS_WARMUP`] pushes and for a zero push (it moves nothing).
    ///
    /// # Errors
    /// The reason, when the push's score is below `-margin`.
    pub fn check(&mut self, grad: &[f32], margin: f32) -> std::result::Result<(), String> {
        if self.seen < CONSENSUS_WARMUP || self.ema.len() != grad.len() {
            return Ok(());
        }
        let (dot, gg, ee) = dots(grad, &self.ema);
        let median = self.median_norm();
        if gg == 0.0 || ee == 0.0 || median == 0.0 {
            return Ok(());
        }
        let cos = dot / (gg.sqrt() * ee.sqrt());
        let r = gg.sqrt() / median;
        let score = cos * r - CONSENSUS_RHO * r * r;
        if score < -f64::from(margin) {
            return Err(format!(
                "the push disagrees with the recent consensus: cosine {cos:.3} at {r:.2}x the usual norm scores {score:.3} < -{margin}"
            ));
        }
        Ok(())
    }

    /// A push joins the consensus, whether it was refused or not (its unit direction, so every
    /// push weighs the same, and its norm).
    pub fn observe(&mut self, grad: &[f32]) {
        let norm = grad
            .iter()
            .map(|&g| f64::from(g) * f64::from(g))
            .sum::<f64>()
            .sqrt();
        if norm == 0.0 {
            return;
        }
        if self.ema.len() != grad.len() {
            self.ema = vec![0.0; grad.len()];
        }
        self.seen += 1;
        let w = 1.0 / self.seen.min(CONSENSUS_WINDOW) as f64;
        for (e, &g) in self.ema.iter_mut().zip(grad) {
            let u = f64::from(g) / norm;
            *e += (w * (u - f64::from(*e))) as f32;
        }
        if self.norms.len() >= CONSENSUS_NORMS {
            self.norms.pop_front();
        }
        self.norms.push_back(norm);
    }

    /// Pushes it has seen.
    pub fn seen(&self) -> u64 {
        self.seen
    }
}

/// ⟨a, b⟩, ‖a‖², ‖b‖² in f64.
fn dots(a: &[f32], b: &[f32]) -> (f64, f64, f64) {
    let (mut dot, mut aa, mut bb) = (0.0f64, 0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (f64::from(x), f64::from(y));
        dot += x * y;
        aa += x * x;
        bb += y * y;
    }
    (dot, aa, bb)
}

/// `zeno`'s validation batch and the gradient of the model on it: what a driver holding the
/// training data (the server, the simulator) computes every [`ZENO_REFRESH`] updates and gives
/// each shard its slice of ([`crate::session::ShardState::set_reference`]).
///
/// The batch is [`ZENO_BATCH`] examples strided evenly through the training set (the same for
/// every run on that set), normalised as the run's workers normalise theirs.
#[derive(Debug)]
pub struct ZenoReference {
    model: crate::model::Model,
    x: ndarray::Array2<f32>,
    y: Vec<u8>,
    ws: crate::model::Workspace,
    grad: Vec<f32>,
}

impl ZenoReference {
    /// The validation batch of `train` (already normalised by the run's rule) for `model`.
    ///
    /// # Errors
    /// [`Error::Config`] for an empty training set.
    pub fn new(model: crate::model::Model, train: &crate::data::Dataset) -> Result<Self> {
        let n = train.len();
        if n == 0 {
            return Err(Error::Config("zeno needs a training set".into()));
        }
        let b = ZENO_BATCH.min(n);
        let idx: Vec<u32> = (0..b).map(|i| (i * n / b) as u32).collect();
        let mut x = ndarray::Array2::zeros((b, train.features));
        let mut y = vec![0u8; b];
        train.fill_batch(&idx, &mut x.view_mut(), &mut y);
        let ws = model.workspace(b);
        let grad = vec![0.0; model.param_len()];
        Ok(Self {
            model,
            x,
            y,
            ws,
            grad,
        })
    }

    /// The gradient of the validation batch's mean loss at `params` (the whole model).
    ///
    /// # Errors
    /// When `params` does not fit the model.
    pub fn gradient(&mut self, params: &[f32]) -> Result<&[f32]> {
        self.model
            .loss_and_grad(params, self.x.view(), &self.y, &mut self.grad, &mut self.ws)?;
        Ok(&self.grad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::{Outcome, ShardCore, StalenessPolicy};
    use crate::wire::ErrorCode;
    use proptest::prelude::*;

    fn agg(rule: Aggregation, rows: &[Vec<f32>]) -> Vec<f32> {
        let flat: Vec<f32> = rows.concat();
        let mut out = vec![0.0; rows[0].len()];
        aggregate(rule, &flat, rows.len(), &mut out, &mut Scratch::default());
        out
    }

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

    /// Zeno++ against a reference: nothing is refused before there is one; then a push against
    /// the validation gradient is, from the first push (no warm-up of the direction), a push
    /// along it is not, and one of many times the usual norm must agree with it closely.
    #[test]
    fn zeno_refuses_pushes_against_the_validation_gradient() {
        let mut c = Consensus::default();
        let v = [1.0, 0.5, -0.2];
        let flipped: Vec<f32> = v.iter().map(|x| -10.0 * x).collect();
        assert!(
            c.check_zeno(&flipped, 0.5, None).is_ok(),
            "no reference yet"
        );
        c.set_reference(&v);
        let e = c.check_zeno(&flipped, 0.5, None).unwrap_err();
        assert!(e.contains("validation batch"), "{e}");
        // Slightly against it, at the usual norm: within the margin.
        let slightly = [0.9, 0.5, 0.8];
        assert!(c.check_zeno(&slightly, 0.5, None).is_ok());
        assert!(
            c.check_zeno(&[0.0; 3], 0.5, None).is_ok(),
            "a zero push moves nothing"
        );
        for _ in 0..ZENO_NORM_WARMUP {
            c.observe(&v);
        }
        // 10x the usual norm sideways (cosine 0): 0 - 0.1 x 100 < -0.5.
        let sideways = [0.0, 4.0, 10.0];
        assert!(c.check_zeno(&sideways, 0.5, None).is_err());
        let along: Vec<f32> = v.iter().map(|x| 10.0 * x).collect();
        assert!(
            c.check_zeno(&along, 0.5, None).is_ok(),
            "cosine 1 at 10x: 10 - 10 = 0"
        );
        // A reference of another length (a bug in a driver) turns the check off.
        assert!(c.check_zeno(&[1.0, 2.0], 0.5, None).is_ok());
    }

    #[test]
    fn an_async_zeno_shard_refuses_a_flipped_push_and_changes_nothing() {
        let mut s = sgd_shard(
            vec![0.0; 2],
            Consistency::Async,
            Aggregation::Zeno { margin: 0.5 },
        );
        s.set_reference(&[1.0, 2.0]);
        let (version, values) = (s.version(), s.values().clone());
        match s.push(version, &[-1.0, -2.0]) {
            Outcome::Rejected {
                code: ErrorCode::Disagrees,
                ..
            } => {}
            other => panic!("{other:?}"),
        }
        assert_eq!((s.version(), s.values()), (version, &values));
        assert!(matches!(s.push(0, &[1.0, 1.0]), Outcome::Applied { .. }));
    }

    #[test]
    fn rules_by_hand() {
        let rows = vec![
            vec![1.0, 10.0],
            vec![2.0, 20.0],
            vec![3.0, 30.0],
            vec![100.0, -1000.0],
        ];
        assert_eq!(agg(Aggregation::Median, &rows), vec![2.5, 15.0]);
        assert_eq!(agg(Aggregation::Mean, &rows), vec![26.5, -235.0]);
        assert_eq!(
            agg(Aggregation::TrimmedMean { beta: 0.25 }, &rows),
            vec![2.5, 15.0]
        );
        // Five pushes, one far away: Krum (f = 1, n - f - 2 = 2 nearest) scores 5, 2, 2, 5 and
        // a huge one; of the two best, the first.
        let rows = vec![
            vec![0.0, 0.0],
            vec![1.0, 0.0],
            vec![2.0, 0.0],
            vec![3.0, 0.0],
            vec![-50.0, 50.0],
        ];
        assert_eq!(agg(Aggregation::Krum { f: 1 }, &rows), vec![1.0, 0.0]);
        // The three best: 1, 2 (score 2 each) then 0 and 3 (score 5; 0 wins the tie by index).
        assert_eq!(
            agg(Aggregation::MultiKrum { f: 1, m: 3 }, &rows),
            vec![1.0, 0.0]
        );
        // Too few for Krum: the median.
        assert_eq!(agg(Aggregation::Krum { f: 1 }, &rows[..3]), vec![1.0, 0.0]);
    }

    #[test]
    fn scratch_stops_growing_after_the_first_round() {
        let rows: Vec<f32> = (0..10 * 50).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut out = vec![0.0; 50];
        let mut s = Scratch::default();
        for rule in [
            Aggregation::Median,
            Aggregation::TrimmedMean { beta: 0.2 },
            Aggregation::MultiKrum { f: 2, m: 4 },
        ] {
            aggregate(rule, &rows, 10, &mut out, &mut s);
            let caps = (
                s.column.capacity(),
                s.dist.capacity(),
                s.near.capacity(),
                s.scores.capacity(),
            );
            aggregate(rule, &rows, 10, &mut out, &mut s);
            let again = (
                s.column.capacity(),
                s.dist.capacity(),
                s.near.capacity(),
                s.scores.capacity(),
            );
            assert_eq!(caps, again, "{rule}");
        }
    }

    #[test]
    fn consensus_refuses_a_flipped_push_after_warmup_and_keeps_honest_ones() {
        let mut c = Consensus::default();
        let honest = |i: usize| vec![1.0 + 0.1 * (i % 3) as f32, 0.5, -0.2];
        let flipped: Vec<f32> = honest(0).iter().map(|v| -10.0 * v).collect();
        for i in 0..CONSENSUS_WARMUP as usize {
            assert!(c.check(&flipped, 0.5).is_ok(), "warmup accepts everything");
            c.observe(&honest(i));
        }
        assert_eq!(c.seen(), CONSENSUS_WARMUP);
        let e = c.check(&flipped, 0.5).unwrap_err();
        assert!(e.contains("cosine -"), "{e}");
        assert!(c.check(&honest(7), 0.5).is_ok());
        assert!(c.check(&[0.0; 3], 0.5).is_ok(), "a zero push moves nothing");
        // The usual norm pointing sideways passes; 10x the norm sideways does not.
        let sideways = [0.0, 0.2, 0.5];
        assert!(c.check(&sideways, 0.5).is_ok());
        let big: Vec<f32> = sideways.iter().map(|v| v * 10.0 * 1.1 / 0.54).collect();
        assert!(c.check(&big, 0.5).is_err());
        // A few huge pushes cannot steer it: every push weighs the same.
        for _ in 0..3 {
            c.observe(&flipped);
        }
        assert!(c.check(&honest(1), 0.5).is_ok());
    }

    fn sgd_shard(values: Vec<f32>, consistency: Consistency, rule: Aggregation) -> ShardCore {
        let cfg = crate::optim::OptimizerConfig {
            rule: crate::optim::Rule::Sgd,
            lr: 1.0,
            weight_decay: 0.0,
            clip_norm: None,
        };
        ShardCore::new(values, cfg, StalenessPolicy::default(), consistency).with_aggregation(rule)
    }

    #[test]
    fn a_sync_shard_applies_the_median_of_its_round_and_a_flush_uses_what_came() {
        let mut s = sgd_shard(
            vec![0.0; 2],
            Consistency::Sync { k: 3 },
            Aggregation::Median,
        );
        s.push(0, &[1.0, 1.0]);
        s.push(0, &[2.0, 3.0]);
        assert!(matches!(
            s.push(0, &[-100.0, 2.0]),
            Outcome::Applied { merged: 3, .. }
        ));
        assert_eq!(**s.values(), vec![-1.0, -2.0], "w - median");
        // A partial round of two: the median of two is their mean.
        s.push(1, &[1.0, 0.0]);
        s.push(1, &[3.0, 0.0]);
        assert!(matches!(
            s.flush(),
            Some(Outcome::Applied { merged: 2, .. })
        ));
        assert_eq!(**s.values(), vec![-3.0, -2.0]);
    }

    #[test]
    fn an_async_consensus_shard_refuses_a_flipped_push_and_changes_nothing() {
        let rule = Aggregation::Consensus { margin: 0.5 };
        let mut s = sgd_shard(vec![0.0; 2], Consistency::Async, rule);
        for _ in 0..CONSENSUS_WARMUP {
            assert!(matches!(
                s.push(s.version(), &[0.01, 0.02]),
                Outcome::Applied { .. }
            ));
        }
        let (version, values) = (s.version(), s.values().clone());
        match s.push(version, &[-0.1, -0.2]) {
            Outcome::Rejected {
                code: ErrorCode::Disagrees,
                message,
            } => assert!(message.contains("consensus"), "{message}"),
            other => panic!("{other:?}"),
        }
        assert_eq!((s.version(), s.values()), (version, &values));
        assert!(matches!(
            s.push(version, &[0.02, 0.01]),
            Outcome::Applied { .. }
        ));
    }

    fn honest_rows(n: usize, len: usize) -> impl Strategy<Value = Vec<Vec<f32>>> {
        prop::collection::vec(prop::collection::vec(-1.0f32..1.0, len), n)
    }

    /// Per coordinate, the smallest and largest value over `rows`.
    fn spread(rows: &[Vec<f32>]) -> Vec<(f32, f32)> {
        (0..rows[0].len())
            .map(|j| {
                rows.iter().fold((f32::MAX, f32::MIN), |(lo, hi), r| {
                    (lo.min(r[j]), hi.max(r[j]))
                })
            })
            .collect()
    }

    proptest! {
        #[test]
        fn every_rule_of_identical_pushes_is_that_push(
            row in prop::collection::vec(-100.0f32..100.0, 1..20),
            n in 1usize..12,
        ) {
            let rows = vec![row.clone(); n];
            for rule in [
                Aggregation::Mean,
                Aggregation::Median,
                Aggregation::TrimmedMean { beta: 0.3 },
                Aggregation::Krum { f: 1 },
                Aggregation::MultiKrum { f: 1, m: 2 },
            ] {
                let out = agg(rule, &rows);
                for (o, r) in out.iter().zip(&row) {
                    prop_assert!((o - r).abs() <= 1e-4 * r.abs().max(1.0), "{rule}: {o} vs {r}");
                }
            }
        }

        #[test]
        fn trimmed_mean_with_zero_trim_is_the_mean(rows in (1usize..10, 1usize..16)
            .prop_flat_map(|(n, len)| honest_rows(n, len)))
        {
            let a = agg(Aggregation::TrimmedMean { beta: 0.0 }, &rows);
            let b = agg(Aggregation::Mean, &rows);
            for (x, y) in a.iter().zip(&b) {
                prop_assert!((x - y).abs() <= 1e-5, "{x} vs {y}");
            }
        }

        /// One huge outlier among n: the robust rules stay within the honest pushes' range on
        /// every coordinate (Krum: it returns one of the honest pushes), the mean does not.
        #[test]
        fn one_outlier_moves_robust_rules_at_most_within_the_honest_spread(
            honest in (4usize..10, 1usize..16).prop_flat_map(|(n, len)| honest_rows(n, len)),
            scale in prop_oneof![Just(-1e4f32), Just(1e4f32)],
        ) {
            let bounds = spread(&honest);
            let mut rows = honest.clone();
            rows.push(honest[0].iter().map(|v| v + scale).collect());
            let n = rows.len();
            for rule in [
                Aggregation::Median,
                Aggregation::TrimmedMean { beta: 1.0 / n as f32 + 1e-3 },
                Aggregation::Krum { f: 1 },
                Aggregation::MultiKrum { f: 1, m: n - 2 },
            ] {
                let out = agg(rule, &rows);
                for (j, (o, (lo, hi))) in out.iter().zip(&bounds).enumerate() {
                    prop_assert!(*o >= lo - 1e-5 && *o <= hi + 1e-5,
                        "{rule}: coordinate {j} = {o} outside the honest [{lo}, {hi}]");
                }
            }
            let mean = agg(Aggregation::Mean, &rows);
            prop_assert!(mean.iter().zip(&bounds).any(|(o, (lo, hi))| o < lo || o > hi));
        }
    }
}
