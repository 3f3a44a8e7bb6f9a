//! The `sync:K` round rules: [`aggregate`] over a buffer of n rows (median, trimmed mean,
//! (Multi-)Krum, mean), with preallocated [`Scratch`].

use super::Aggregation;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::robust::testing::sgd_shard;
    use crate::shard::{Consistency, Outcome};
    use proptest::prelude::*;

    fn agg(rule: Aggregation, rows: &[Vec<f32>]) -> Vec<f32> {
        let flat: Vec<f32> = rows.concat();
        let mut out = vec![0.0; rows[0].len()];
        aggregate(rule, &flat, rows.len(), &mut out, &mut Scratch::default());
        out
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
