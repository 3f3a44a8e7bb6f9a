//! Which slice of the training set a joining worker trains on: [`choose`].
//!
//! `--partitions N` is the finest cut, not a fixed one. A join gets a partition of
//! `min(N, active + 1)` equal contiguous parts, where `active` counts the workers training now
//! (a shard connection open, or joined in the last [`ACTIVE_JOIN_S`] seconds), and among those
//! parts the one the active workers cover least. So the first worker trains on the whole set,
//! two workers on the whole set and a half of it, three on the whole, a half and a third, and
//! so on until the crowd is large enough for parts of `1 / N` each: whatever the number of
//! workers, every example is in someone's partition. With a fixed cut of 6, 2 workers trained
//! on a third of MNIST (issue 18: 97% only after about 230,000 samples).
//!
//! The cost: the first volunteers download more (the whole set for the very first); a crowd's
//! later joiners get `1 / N`. Parts of one count are the balanced contiguous ranges of
//! `Dataset::partition`, and the data URL names the count (the data tag ends in `-{count}`),
//! so a browser's cache keeps each part once.

use serde::Serialize;

/// Seconds a joined worker counts as active before its first shard connection.
pub const ACTIVE_JOIN_S: f64 = 60.0;

/// A data partition: part `index` of `count` equal contiguous parts of the training set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Part {
    /// Which part.
    pub index: usize,
    /// Of how many.
    pub count: usize,
}

impl Part {
    /// The fraction of the set it spans, `[index / count, (index + 1) / count)`.
    fn span(self) -> (f64, f64) {
        let c = self.count.max(1) as f64;
        (self.index as f64 / c, (self.index + 1) as f64 / c)
    }
}

/// The part a new worker gets, given the parts `active` workers train on, the finest cut
/// `max` (`--partitions`) and a `rotate` value (the worker id) that breaks ties so equal
/// choices spread.
pub fn choose(active: &[Part], max: usize, rotate: u64) -> Part {
    let count = (active.len() + 1).clamp(1, max.max(1));
    let overlap = |j: usize| -> f64 {
        let (a0, a1) = Part { index: j, count }.span();
        active
            .iter()
            .map(|p| {
                let (b0, b1) = p.span();
                (a1.min(b1) - a0.max(b0)).max(0.0)
            })
            .sum()
    };
    let start = (rotate % count as u64) as usize;
    let mut best = Part {
        index: start,
        count,
    };
    let mut best_overlap = f64::INFINITY;
    for k in 0..count {
        let j = (start + k) % count;
        let o = overlap(j);
        // Strictly less (with a margin for rounding): ties keep the earlier in rotation order.
        if o < best_overlap - 1e-9 {
            best_overlap = o;
            best = Part { index: j, count };
        }
    }
    best
}

/// The fraction of the set `parts` together cover (for tests and the status).
pub fn coverage(parts: &[Part]) -> f64 {
    let mut spans: Vec<(f64, f64)> = parts.iter().map(|p| p.span()).collect();
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (mut covered, mut end) = (0.0, 0.0f64);
    for (a, b) in spans {
        if b > end {
            covered += b - a.max(end);
            end = b;
        }
    }
    covered
}

#[cfg(test)]
mod tests {
    use super::*;

    fn crowd(n: usize, max: usize) -> Vec<Part> {
        let mut parts = Vec::new();
        for id in 1..=n as u64 {
            let p = choose(&parts, max, id);
            parts.push(p);
        }
        parts
    }

    /// Issue 18: whatever the number of workers, their partitions cover the whole set; the
    /// first trains on all of it, and a large crowd gets the finest cut.
    #[test]
    fn every_crowd_size_covers_the_whole_set() {
        for max in [1, 2, 6, 10] {
            for n in 1..=40 {
                let parts = crowd(n, max);
                assert!(
                    (coverage(&parts) - 1.0).abs() < 1e-9,
                    "max {max}, {n} workers: {parts:?}"
                );
                assert!(parts.iter().all(|p| p.count <= max && p.index < p.count));
            }
        }
        assert_eq!(crowd(1, 6), [Part { index: 0, count: 1 }]);
        let two = crowd(2, 6);
        assert_eq!(two[1].count, 2);
        let many = crowd(30, 6);
        assert!(many[6..].iter().all(|p| p.count == 6));
        // The finest parts are spread evenly: each of the 6 taken by 3 to 5 of the last 24
        // (the first six workers' coarser parts count too).
        let mut per = [0; 6];
        many[6..].iter().for_each(|p| per[p.index] += 1);
        assert!(per.iter().all(|&n| (3..=5).contains(&n)), "{per:?}");
    }

    /// When workers leave, the next joiners fill the uncovered part first.
    #[test]
    fn a_gap_left_by_a_leaver_is_filled_first() {
        let mut parts = crowd(12, 6);
        // Every worker on part 3 of 6 leaves, and the whole-set and half-set workers too.
        parts.retain(|p| p.count == 6 && p.index != 3);
        assert!(coverage(&parts) < 0.9);
        let next = choose(&parts, 6, 1);
        assert_eq!(next, Part { index: 3, count: 6 });
        parts.push(next);
        assert!((coverage(&parts) - 1.0).abs() < 1e-9);
    }
}
