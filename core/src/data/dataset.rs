//! [`Dataset`] (images and labels, pixels kept as bytes, batches filled as normalised f32) and
//! [`BatchSampler`] (endless shuffled batches from a seed).

use super::{encode_idx, parse_idx, parse_npy, IdxArray, Normalize};
use crate::error::{Error, Result};
use crate::rng::Rng;
use ndarray::ArrayViewMut2;
use std::ops::Range;

/// Images and labels of a classification dataset.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    /// Image shape after the example axis (e.g. `[28, 28]`).
    pub image_dims: Vec<usize>,
    /// Values per example (784 for MNIST).
    pub features: usize,
    pub(super) pixels: Vec<u8>,
    labels: Vec<u8>,
    /// `x = p * scale[c] + offset[c]` per channel (empty: `p / 255`; token mode is one channel
    /// of scale 1 and offset 0, exact in f32).
    scale: Vec<f32>,
    offset: Vec<f32>,
}

// The normalisation is validated finite, so equality is an equivalence.
impl Eq for Dataset {}

impl Dataset {
    /// Builds a dataset from IDX image and label files (raw or gzip).
    ///
    /// # Errors
    /// [`Error::Data`] when either file is bad or their example counts differ.
    pub fn from_idx(images: &[u8], labels: &[u8]) -> Result<Self> {
        let img = parse_idx(images)?;
        let lab = parse_idx(labels)?;
        Self::from_arrays(img, lab)
    }

    /// Builds a dataset from `.npy` image and label files ([`parse_npy`]).
    ///
    /// # Errors
    /// [`Error::Data`] when either file is bad or their example counts differ.
    pub fn from_npy(images: &[u8], labels: &[u8]) -> Result<Self> {
        Self::from_arrays(parse_npy(images)?, parse_npy(labels)?)
    }

    /// Builds a dataset from parsed arrays.
    ///
    /// # Errors
    /// As [`Dataset::from_idx`].
    pub fn from_arrays(img: IdxArray, lab: IdxArray) -> Result<Self> {
        if img.dims.len() < 2 {
            return Err(Error::Data(format!(
                "image file has dimensions {:?}, expected [n, ...]",
                img.dims
            )));
        }
        if lab.dims.len() != 1 {
            return Err(Error::Data(format!(
                "label file has dimensions {:?}, expected [n]",
                lab.dims
            )));
        }
        if img.dims[0] != lab.dims[0] {
            return Err(Error::Data(format!(
                "{} images but {} labels",
                img.dims[0], lab.dims[0]
            )));
        }
        let image_dims = img.dims[1..].to_vec();
        let features = image_dims.iter().product();
        if features == 0 {
            return Err(Error::Data("images have no pixels".into()));
        }
        Ok(Self {
            image_dims,
            features,
            pixels: img.data,
            labels: lab.data,
            scale: Vec::new(),
            offset: Vec::new(),
        })
    }

    /// Channels of an image: the last dimension of `H x W x C` images, 1 otherwise.
    pub fn channels(&self) -> usize {
        channels_of(&self.image_dims)
    }

    /// Normalises every batch filled from now on with `n` (`x = (p / 255 - mean[c]) / std[c]`,
    /// or `x = p` in token mode).
    ///
    /// # Errors
    /// As [`Normalize::validate`] for this dataset's channels (nothing changes then).
    pub fn set_normalize(&mut self, n: &Normalize) -> Result<()> {
        let c = self.channels();
        n.validate(c)?;
        if n.tokens {
            self.scale = vec![1.0];
            self.offset = vec![0.0];
            return Ok(());
        }
        if n.is_identity() {
            self.scale.clear();
            self.offset.clear();
            return Ok(());
        }
        let pick = |v: &[f32], i: usize| if v.len() == 1 { v[0] } else { v[i] };
        self.scale = (0..c).map(|i| 1.0 / (255.0 * pick(&n.std, i))).collect();
        self.offset = (0..c)
            .map(|i| -pick(&n.mean, i) / pick(&n.std, i))
            .collect();
        Ok(())
    }

    /// Number of examples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True for an empty dataset.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Number of classes: the largest label plus one.
    pub fn classes(&self) -> usize {
        self.labels
            .iter()
            .copied()
            .max()
            .map_or(0, |m| m as usize + 1)
    }

    /// The labels.
    pub fn labels(&self) -> &[u8] {
        &self.labels
    }

    /// The raw pixels of example `i`.
    pub fn pixels(&self, i: usize) -> &[u8] {
        &self.pixels[i * self.features..(i + 1) * self.features]
    }

    /// Range of examples in partition `index` of `count` contiguous, balanced partitions.
    ///
    /// # Errors
    /// [`Error::Config`] when `count` is zero, `index >= count` or `count` exceeds the examples.
    pub fn partition(&self, index: usize, count: usize) -> Result<Range<usize>> {
        if count == 0 || index >= count || count > self.len() {
            return Err(Error::Config(format!(
                "partition {index} of {count} does not exist for {} examples",
                self.len()
            )));
        }
        let r = crate::partition::partition(self.len(), count)?[index];
        Ok(r.start..r.end)
    }

    /// A copy of the examples in `range`.
    ///
    /// # Errors
    /// [`Error::Config`] when the range is out of bounds.
    pub fn subset(&self, range: Range<usize>) -> Result<Self> {
        if range.start > range.end || range.end > self.len() {
            return Err(Error::Config(format!(
                "range {range:?} outside {} examples",
                self.len()
            )));
        }
        Ok(Self {
            image_dims: self.image_dims.clone(),
            features: self.features,
            pixels: self.pixels[range.start * self.features..range.end * self.features].to_vec(),
            labels: self.labels[range.clone()].to_vec(),
            scale: self.scale.clone(),
            offset: self.offset.clone(),
        })
    }

    /// The examples in `range` as IDX files `(images, labels)`.
    ///
    /// # Errors
    /// As [`Dataset::subset`].
    pub fn to_idx(&self, range: Range<usize>) -> Result<(Vec<u8>, Vec<u8>)> {
        if range.start > range.end || range.end > self.len() {
            return Err(Error::Config(format!(
                "range {range:?} outside {} examples",
                self.len()
            )));
        }
        let mut dims = vec![range.len()];
        dims.extend(&self.image_dims);
        Ok((
            encode_idx(
                &dims,
                &self.pixels[range.start * self.features..range.end * self.features],
            ),
            encode_idx(&[range.len()], &self.labels[range]),
        ))
    }

    /// Writes examples `indices` into `x` (as `pixel / 255`, then normalised per channel when
    /// [`Dataset::set_normalize`] said so, or as the exact byte in token mode) and `y`.
    ///
    /// # Panics
    /// If `x` is not `indices.len() x features`, `y` is not `indices.len()` long or an index is
    /// out of range: callers size their buffers from this dataset.
    pub fn fill_batch(&self, indices: &[u32], x: &mut ArrayViewMut2<'_, f32>, y: &mut [u8]) {
        assert_eq!(x.dim(), (indices.len(), self.features));
        let c = self.scale.len();
        for ((mut row, yi), &i) in x.outer_iter_mut().zip(y.iter_mut()).zip(indices) {
            let i = i as usize;
            if c == 0 {
                for (d, &p) in row.iter_mut().zip(self.pixels(i)) {
                    *d = f32::from(p) * (1.0 / 255.0);
                }
            } else {
                for (j, (d, &p)) in row.iter_mut().zip(self.pixels(i)).enumerate() {
                    let ch = j % c;
                    *d = f32::from(p) * self.scale[ch] + self.offset[ch];
                }
            }
            *yi = self.labels[i];
        }
    }
}

/// Channels of one example of shape `dims`: the last of `[h, w, c]`, 1 otherwise.
pub fn channels_of(dims: &[usize]) -> usize {
    if dims.len() == 3 {
        dims[2]
    } else {
        1
    }
}

/// Endless shuffled batches over `n` examples: a new permutation every epoch, from a seed.
#[derive(Debug, Clone)]
pub struct BatchSampler {
    order: Vec<u32>,
    pos: usize,
    rng: Rng,
    /// Completed passes over the data.
    pub epochs: u64,
}

impl BatchSampler {
    /// A sampler over `n` examples.
    pub fn new(n: usize, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let mut order: Vec<u32> = (0..n as u32).collect();
        rng.shuffle(&mut order);
        Self {
            order,
            pos: 0,
            rng,
            epochs: 0,
        }
    }

    /// Fills `out` with the next indices, wrapping into a fresh permutation at epoch ends.
    pub fn next_batch(&mut self, out: &mut [u32]) {
        if self.order.is_empty() {
            return;
        }
        for o in out.iter_mut() {
            if self.pos == self.order.len() {
                self.rng.shuffle(&mut self.order);
                self.pos = 0;
                self.epochs += 1;
            }
            *o = self.order[self.pos];
            self.pos += 1;
        }
    }

    /// Indices drawn so far (over all epochs).
    pub fn position(&self) -> u64 {
        self.epochs * self.order.len() as u64 + self.pos as u64
    }

    /// Draws and drops `n` indices: afterwards the sampler is exactly where one that drew them
    /// with [`BatchSampler::next_batch`] is (how a spot check finds a worker's batch). Costs
    /// one shuffle per epoch crossed.
    pub fn skip(&mut self, n: u64) {
        let len = self.order.len() as u64;
        if len == 0 {
            return;
        }
        let mut left = n;
        while left > 0 {
            if self.pos as u64 == len {
                self.rng.shuffle(&mut self.order);
                self.pos = 0;
                self.epochs += 1;
            }
            let take = left.min(len - self.pos as u64);
            self.pos += take as usize;
            left -= take;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::testing::toy;
    use ndarray::Array2;

    #[test]
    fn batches_are_normalised() {
        let (img, lab) = toy();
        let d = Dataset::from_idx(&img, &lab).unwrap();
        let mut x = Array2::zeros((2, 4));
        let mut y = [0u8; 2];
        d.fill_batch(&[1, 2], &mut x.view_mut(), &mut y);
        assert_eq!(y, [1, 2]);
        assert!((x[[0, 0]] - 40.0 / 255.0).abs() < 1e-7);
        let (pi, pl) = d.to_idx(1..3).unwrap();
        let sub = Dataset::from_idx(&pi, &pl).unwrap();
        assert_eq!(sub, d.subset(1..3).unwrap());
        assert_eq!(d.partition(1, 2).unwrap(), 3..5);
        assert!(d.partition(2, 2).is_err());
    }

    #[test]
    fn a_sampler_skipped_ahead_draws_what_one_that_drew_draws() {
        for (n, skip) in [(10usize, 0u64), (10, 7), (10, 10), (10, 33), (7, 1000)] {
            let mut drawn = BatchSampler::new(n, 5);
            let mut sink = vec![0u32; 1];
            for _ in 0..skip {
                drawn.next_batch(&mut sink);
            }
            let mut skipped = BatchSampler::new(n, 5);
            skipped.skip(skip);
            assert_eq!(skipped.position(), skip);
            assert_eq!(drawn.position(), skip);
            let (mut a, mut b) = (vec![0u32; 13], vec![0u32; 13]);
            drawn.next_batch(&mut a);
            skipped.next_batch(&mut b);
            assert_eq!(a, b, "n {n} skip {skip}");
        }
    }

    #[test]
    fn sampler_visits_everything_each_epoch() {
        let mut s = BatchSampler::new(10, 3);
        let mut seen = vec![0u32; 10];
        let mut b = [0u32; 5];
        for _ in 0..4 {
            s.next_batch(&mut b);
            b.iter().for_each(|&i| seen[i as usize] += 1);
        }
        assert_eq!(seen, vec![2; 10]);
        assert_eq!(s.epochs, 1);
    }
}
