//! Key ranges: how the flat parameter vector is cut into contiguous shards (ps-lite's
//! `GetServerKeyRanges`), and the [`Slicer`] that cuts a full gradient into per-shard slices.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// A half-open range `[start, end)` of indices into the flat parameter vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRange {
    /// First index owned.
    pub start: usize,
    /// One past the last index owned.
    pub end: usize,
}

impl KeyRange {
    /// Number of parameters in the range.
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// True when the range holds no parameter.
    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

/// Cuts `total` parameters into `shards` contiguous ranges whose sizes differ by at most one.
///
/// # Errors
/// [`Error::Config`] when `shards` is zero or larger than `total` (a shard would be empty).
pub fn partition(total: usize, shards: usize) -> Result<Vec<KeyRange>> {
    if shards == 0 {
        return Err(Error::Config(
            "the number of shards must be at least 1".into(),
        ));
    }
    if shards > total {
        return Err(Error::Config(format!(
            "{shards} shards for {total} parameters would leave a shard empty"
        )));
    }
    let base = total / shards;
    let extra = total % shards;
    let mut ranges = Vec::with_capacity(shards);
    let mut start = 0;
    for i in 0..shards {
        let len = base + usize::from(i < extra);
        ranges.push(KeyRange {
            start,
            end: start + len,
        });
        start += len;
    }
    Ok(ranges)
}

/// Cuts full-length vectors into the per-shard slices of a fixed partition (ps-lite's
/// `DefaultSlicer`).
#[derive(Debug, Clone, PartialEq)]
pub struct Slicer {
    ranges: Vec<KeyRange>,
    total: usize,
}

impl Slicer {
    /// A slicer for `ranges`, which must cover `[0, total)` contiguously in order.
    ///
    /// # Errors
    /// [`Error::Config`] when the ranges are empty, out of order, overlapping or leave gaps.
    pub fn new(ranges: Vec<KeyRange>) -> Result<Self> {
        let mut expect = 0;
        for (i, r) in ranges.iter().enumerate() {
            if r.start != expect || r.end <= r.start {
                return Err(Error::Config(format!(
                    "shard {i} range {}..{} does not continue the previous one at {expect}",
                    r.start, r.end
                )));
            }
            expect = r.end;
        }
        if ranges.is_empty() {
            return Err(Error::Config("no shard ranges".into()));
        }
        Ok(Self {
            ranges,
            total: expect,
        })
    }

    /// The ranges, in shard order.
    pub fn ranges(&self) -> &[KeyRange] {
        &self.ranges
    }

    /// Length of the full vector.
    pub fn total(&self) -> usize {
        self.total
    }

    /// The slice of `full` owned by `shard`.
    ///
    /// # Panics
    /// If `shard` is out of range or `full` is shorter than [`Slicer::total`]; both are
    /// programming errors, never input.
    pub fn slice<'a>(&self, full: &'a [f32], shard: usize) -> &'a [f32] {
        let r = self.ranges[shard];
        &full[r.start..r.end]
    }

    /// Mutable slice of `full` owned by `shard` (same panics as [`Slicer::slice`]).
    pub fn slice_mut<'a>(&self, full: &'a mut [f32], shard: usize) -> &'a mut [f32] {
        let r = self.ranges[shard];
        &mut full[r.start..r.end]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn partition_covers_disjoint_and_balanced(total in 1usize..100_000, shards in 1usize..64) {
            prop_assume!(shards <= total);
            let ranges = partition(total, shards).unwrap();
            prop_assert_eq!(ranges.len(), shards);
            prop_assert_eq!(ranges[0].start, 0);
            prop_assert_eq!(ranges[shards - 1].end, total);
            for w in ranges.windows(2) {
                prop_assert_eq!(w[0].end, w[1].start);
            }
            let min = ranges.iter().map(KeyRange::len).min().unwrap();
            let max = ranges.iter().map(KeyRange::len).max().unwrap();
            prop_assert!(max - min <= 1);
            prop_assert!(min >= 1);
            let slicer = Slicer::new(ranges).unwrap();
            let full: Vec<f32> = (0..total).map(|i| i as f32).collect();
            let joined: Vec<f32> = (0..shards).flat_map(|s| slicer.slice(&full, s).to_vec()).collect();
            prop_assert_eq!(joined, full);
        }
    }

    #[test]
    fn bad_partitions_are_errors() {
        assert!(partition(10, 0).is_err());
        assert!(partition(3, 4).is_err());
        let gap = vec![KeyRange { start: 0, end: 2 }, KeyRange { start: 3, end: 5 }];
        assert!(Slicer::new(gap).is_err());
        assert!(Slicer::new(vec![]).is_err());
    }
}
