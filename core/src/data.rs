//! IDX datasets (MNIST, Fashion-MNIST and anything else in LeCun's IDX format with unsigned-byte
//! images and labels), raw or gzip-compressed, and batching into normalised f32.
//!
//! Pixels stay `u8` in memory (a quarter of the f32 size); a batch is converted to `x / 255` when
//! it is filled.

use crate::error::{Error, Result};
use crate::rng::Rng;
use ndarray::ArrayViewMut2;
use std::io::Read;
use std::ops::Range;

/// Largest decompressed IDX file accepted (1 GiB).
pub const MAX_IDX_BYTES: u64 = 1 << 30;

/// A parsed IDX file of unsigned bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdxArray {
    /// Dimensions, outermost first.
    pub dims: Vec<usize>,
    /// The values, row-major.
    pub data: Vec<u8>,
}

/// Parses an IDX file, gunzipping it first when it starts with the gzip magic.
///
/// # Errors
/// [`Error::Data`] for a bad gzip stream, a bad magic, a non-`u8` element type, dimensions that
/// do not match the data length, or more than [`MAX_IDX_BYTES`] of data.
pub fn parse_idx(bytes: &[u8]) -> Result<IdxArray> {
    if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(bytes)
            .take(MAX_IDX_BYTES + 1)
            .read_to_end(&mut out)
            .map_err(|e| Error::Data(format!("bad gzip stream: {e}")))?;
        if out.len() as u64 > MAX_IDX_BYTES {
            return Err(Error::Data("decompressed IDX file exceeds 1 GiB".into()));
        }
        return parse_raw(&out);
    }
    parse_raw(bytes)
}

/// Like [`parse_idx`], but takes ownership so a raw file is parsed in place, without a second
/// copy of the data (halves the peak memory of loading a large file).
///
/// # Errors
/// As [`parse_idx`].
pub fn parse_idx_owned(mut bytes: Vec<u8>) -> Result<IdxArray> {
    if bytes.starts_with(&[0x1f, 0x8b]) {
        return parse_idx(&bytes);
    }
    let dims = parse_raw_header(&bytes)?;
    let header = 4 + 4 * dims.len();
    bytes.drain(..header);
    Ok(IdxArray { dims, data: bytes })
}

fn parse_raw(bytes: &[u8]) -> Result<IdxArray> {
    let dims = parse_raw_header(bytes)?;
    Ok(IdxArray {
        data: bytes[4 + 4 * dims.len()..].to_vec(),
        dims,
    })
}

/// Validates an uncompressed IDX file and returns its dimensions.
fn parse_raw_header(bytes: &[u8]) -> Result<Vec<usize>> {
    if bytes.len() < 4 || bytes[0] != 0 || bytes[1] != 0 {
        return Err(Error::Data("not an IDX file (bad magic)".into()));
    }
    if bytes[2] != 0x08 {
        return Err(Error::Data(format!(
            "IDX element type 0x{:02x} is not supported (only unsigned byte, 0x08)",
            bytes[2]
        )));
    }
    let ndims = bytes[3] as usize;
    if ndims == 0 || ndims > 4 {
        return Err(Error::Data(format!("IDX file with {ndims} dimensions")));
    }
    let header = 4 + 4 * ndims;
    if bytes.len() < header {
        return Err(Error::Data("IDX header is truncated".into()));
    }
    let dims: Vec<usize> = bytes[4..header]
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize)
        .collect();
    let expected = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
        .filter(|&n| n <= MAX_IDX_BYTES)
        .ok_or_else(|| Error::Data(format!("IDX dimensions {dims:?} are too large")))?;
    let data = &bytes[header..];
    if data.len() as u64 != expected {
        return Err(Error::Data(format!(
            "IDX dimensions {dims:?} need {expected} bytes of data, the file has {}",
            data.len()
        )));
    }
    Ok(dims)
}

/// Writes an IDX file of unsigned bytes.
pub fn encode_idx(dims: &[usize], data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + 4 * dims.len() + data.len());
    out.extend_from_slice(&[0, 0, 0x08, dims.len() as u8]);
    for &d in dims {
        out.extend_from_slice(&(d as u32).to_be_bytes());
    }
    out.extend_from_slice(data);
    out
}

/// Images and labels of a classification dataset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dataset {
    /// Image shape after the example axis (e.g. `[28, 28]`).
    pub image_dims: Vec<usize>,
    /// Values per example (784 for MNIST).
    pub features: usize,
    pixels: Vec<u8>,
    labels: Vec<u8>,
}

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
        })
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

    /// Writes examples `indices` into `x` (as `pixel / 255`) and `y`.
    ///
    /// # Panics
    /// If `x` is not `indices.len() x features`, `y` is not `indices.len()` long or an index is
    /// out of range: callers size their buffers from this dataset.
    pub fn fill_batch(&self, indices: &[u32], x: &mut ArrayViewMut2<'_, f32>, y: &mut [u8]) {
        assert_eq!(x.dim(), (indices.len(), self.features));
        for ((mut row, yi), &i) in x.outer_iter_mut().zip(y.iter_mut()).zip(indices) {
            let i = i as usize;
            for (d, &p) in row.iter_mut().zip(self.pixels(i)) {
                *d = f32::from(p) * (1.0 / 255.0);
            }
            *yi = self.labels[i];
        }
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array2;

    fn toy() -> (Vec<u8>, Vec<u8>) {
        let pixels: Vec<u8> = (0..5 * 4).map(|i| (i * 10) as u8).collect();
        (
            encode_idx(&[5, 2, 2], &pixels),
            encode_idx(&[5], &[0, 1, 2, 1, 0]),
        )
    }

    #[test]
    fn raw_and_gzip_parse_alike() {
        let (img, lab) = toy();
        let d = Dataset::from_idx(&img, &lab).unwrap();
        assert_eq!((d.len(), d.features, d.classes()), (5, 4, 3));
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &img).unwrap();
        let gz = gz.finish().unwrap();
        assert_eq!(Dataset::from_idx(&gz, &lab).unwrap(), d);
    }

    #[test]
    fn owned_parse_matches_borrowed() {
        let (img, _) = toy();
        assert_eq!(
            parse_idx_owned(img.clone()).unwrap(),
            parse_idx(&img).unwrap()
        );
        assert!(parse_idx_owned(img[..img.len() - 1].to_vec()).is_err());
    }

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
    fn bad_files_are_errors() {
        let (img, lab) = toy();
        assert!(parse_idx(&img[..img.len() - 1]).is_err());
        assert!(parse_idx(&[0, 0, 0x0d, 1, 0, 0, 0, 1, 0, 0, 0, 0]).is_err());
        assert!(parse_idx(&[1, 2, 3]).is_err());
        assert!(parse_idx(&[0x1f, 0x8b, 0, 0]).is_err());
        // Dimensions that overflow.
        assert!(parse_idx(&[
            0, 0, 8, 3, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255
        ])
        .is_err());
        assert!(Dataset::from_idx(&img, &encode_idx(&[4], &[0; 4])).is_err());
        assert!(Dataset::from_idx(&lab, &lab).is_err());
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
