//! Datasets: IDX files (MNIST, Fashion-MNIST and anything else in LeCun's IDX format with
//! unsigned-byte images and labels, raw or gzip-compressed; images `N x H x W` or
//! `N x H x W x C`) and NumPy `.npy` files ([`parse_npy`]), and batching into normalised f32.
//!
//! Pixels stay `u8` in memory (a quarter of the f32 size); a batch is converted to `x / 255`
//! when it is filled, then normalised per channel when the run says so ([`Normalize`]).

use crate::error::{Error, Result};
use crate::rng::Rng;
use ndarray::ArrayViewMut2;
use serde::{Deserialize, Serialize};
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
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    /// Image shape after the example axis (e.g. `[28, 28]`).
    pub image_dims: Vec<usize>,
    /// Values per example (784 for MNIST).
    pub features: usize,
    pixels: Vec<u8>,
    labels: Vec<u8>,
    /// `x = p * scale[c] + offset[c]` per channel (empty: `p / 255`).
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

    /// Normalises every batch filled from now on with `n` (`x = (p / 255 - mean[c]) / std[c]`).
    ///
    /// # Errors
    /// As [`Normalize::validate`] for this dataset's channels (nothing changes then).
    pub fn set_normalize(&mut self, n: &Normalize) -> Result<()> {
        let c = self.channels();
        n.validate(c)?;
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
    /// [`Dataset::set_normalize`] said so) and `y`.
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

/// Per-channel normalisation every worker applies to a batch, stated in the run spec:
/// `x = (p / 255 - mean[c]) / std[c]` for pixel `p` of channel `c`. One value applies to every
/// channel. The default (`mean` and `std` empty) is plain `p / 255`.
///
/// As text (`--normalize`): `MEAN/STD` with comma lists for several channels, e.g.
/// `0.1307/0.3081` (MNIST) or `0.49,0.48,0.45/0.25,0.24,0.26`; `none` for the default.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Normalize {
    /// Mean per channel (or one for all), on the `p / 255` scale.
    #[serde(default)]
    pub mean: Vec<f32>,
    /// Standard deviation per channel (or one for all), positive.
    #[serde(default)]
    pub std: Vec<f32>,
}

impl Normalize {
    /// True for the default, plain `p / 255`.
    pub fn is_identity(&self) -> bool {
        self.mean.is_empty() && self.std.is_empty()
    }

    /// Parses `MEAN/STD` (comma lists per channel) or `none`.
    ///
    /// # Errors
    /// [`Error::Config`] for any other text, a non-finite value or a non-positive deviation.
    pub fn parse(text: &str) -> Result<Self> {
        let t = text.trim();
        if t == "none" || t.is_empty() {
            return Ok(Self::default());
        }
        let bad = || {
            Error::Config(format!("bad normalisation {t:?}: use MEAN/STD, e.g. 0.1307/0.3081, comma lists per channel, or none"))
        };
        let (m, s) = t.split_once('/').ok_or_else(bad)?;
        let list = |v: &str| -> Result<Vec<f32>> {
            v.split(',')
                .map(|x| x.trim().parse::<f32>().map_err(|_| bad()))
                .collect()
        };
        let n = Self {
            mean: list(m)?,
            std: list(s)?,
        };
        n.validate(n.mean.len().max(n.std.len()))?;
        Ok(n)
    }

    /// Mean and standard deviation per channel of `data`'s pixels (on the `p / 255` scale).
    pub fn of(data: &Dataset) -> Self {
        let c = data.channels();
        let mut sum = vec![0f64; c];
        let mut sq = vec![0f64; c];
        for (j, &p) in data.pixels.iter().enumerate() {
            let v = f64::from(p) / 255.0;
            sum[j % c] += v;
            sq[j % c] += v * v;
        }
        let n = (data.pixels.len() / c).max(1) as f64;
        let mean: Vec<f64> = sum.iter().map(|s| s / n).collect();
        Self {
            mean: mean.iter().map(|&m| m as f32).collect(),
            std: sq
                .iter()
                .zip(&mean)
                .map(|(q, m)| ((q / n - m * m).max(0.0).sqrt().max(1e-3)) as f32)
                .collect(),
        }
    }

    /// Checks the values fit images of `channels` channels.
    ///
    /// # Errors
    /// [`Error::Config`] when `mean` and `std` are not both empty, both of one value or both of
    /// `channels` values, or a value is not finite or a deviation not positive.
    pub fn validate(&self, channels: usize) -> Result<()> {
        if self.is_identity() {
            return Ok(());
        }
        let fits = |n: usize| n == 1 || n == channels;
        if !fits(self.mean.len()) || !fits(self.std.len()) {
            return Err(Error::Config(format!(
                "normalisation has {} means and {} deviations for images of {channels} channels",
                self.mean.len(),
                self.std.len()
            )));
        }
        if self.mean.iter().any(|m| !m.is_finite())
            || self.std.iter().any(|s| !(s.is_finite() && *s > 0.0))
        {
            return Err(Error::Config(
                "normalisation means must be finite and deviations positive".into(),
            ));
        }
        Ok(())
    }
}

/// `--normalize` as given: a fixed [`Normalize`], or `auto`, the training set's own per-channel
/// statistics ([`Normalize::of`]), computed once by the server and stated in the run spec, so
/// every worker still applies the same numbers.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum NormalizeChoice {
    /// These values (the default: none, plain `p / 255`).
    #[default]
    None,
    /// These values.
    Fixed(Normalize),
    /// The training set's statistics.
    Auto,
}

impl NormalizeChoice {
    /// Parses `none`, `auto` or `MEAN/STD` ([`Normalize::parse`]).
    ///
    /// # Errors
    /// As [`Normalize::parse`].
    pub fn parse(text: &str) -> Result<Self> {
        match text.trim() {
            "auto" => Ok(Self::Auto),
            t => {
                let n = Normalize::parse(t)?;
                Ok(if n.is_identity() {
                    Self::None
                } else {
                    Self::Fixed(n)
                })
            }
        }
    }

    /// The values for a run training on `train`, checked against its channels.
    ///
    /// # Errors
    /// [`Error::Config`] when fixed values do not fit `train`'s channels.
    pub fn resolve(&self, train: &Dataset) -> Result<Normalize> {
        let n = match self {
            Self::None => Normalize::default(),
            Self::Fixed(n) => n.clone(),
            Self::Auto => Normalize::of(train),
        };
        n.validate(train.channels()).map_err(|e| {
            Error::Config(format!(
                "--normalize: {e} (the dataset's images are {:?})",
                train.image_dims
            ))
        })?;
        Ok(n)
    }
}

impl std::fmt::Display for NormalizeChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::None => write!(f, "none"),
            Self::Fixed(n) => write!(f, "{n}"),
            Self::Auto => write!(f, "auto"),
        }
    }
}

impl std::fmt::Display for Normalize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_identity() {
            return write!(f, "none");
        }
        let list = |v: &[f32]| {
            v.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        write!(f, "{}/{}", list(&self.mean), list(&self.std))
    }
}

/// Parses a NumPy `.npy` file (format versions 1, 2 and 3; C order; element types `u1`, and
/// for images `f4`, for labels also `i1`, `i4`, `i8`, `u4`, `u8`) into unsigned bytes:
/// - `f4` values in `[0, 1]` are scaled by 255 and rounded; `f4` values that are all
///   integers in `[0, 255]` are taken as they are; anything else is an error (pixels travel to
///   workers as bytes; normalise with [`Normalize`] instead);
/// - integer values must lie in `[0, 255]` (labels are class indices).
///
/// # Errors
/// [`Error::Data`] naming the problem: not an `.npy` file, an unreadable or Fortran-order
/// header, an unsupported element type, a shape whose data is larger than [`MAX_IDX_BYTES`],
/// a truncated (or overlong) file, values out of range.
pub fn parse_npy(bytes: &[u8]) -> Result<IdxArray> {
    let bad = |m: String| Err(Error::Data(m));
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return bad("not a .npy file (bad magic)".into());
    }
    let (len, start): (usize, usize) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        v => return bad(format!(".npy format version {v} is not supported")),
    };
    let Some(header) = bytes.get(start..start.saturating_add(len)) else {
        return bad(".npy header is truncated".into());
    };
    let header =
        std::str::from_utf8(header).map_err(|_| Error::Data(".npy header is not text".into()))?;
    let field = |key: &str| -> Option<&str> {
        let at = header.find(&format!("'{key}'"))? + key.len() + 2;
        let rest = header[at..].trim_start().strip_prefix(':')?.trim_start();
        Some(rest)
    };
    let descr = field("descr")
        .and_then(|r| r.strip_prefix('\'').and_then(|r| r.split('\'').next()))
        .ok_or_else(|| Error::Data(format!(".npy header {header:?} has no descr")))?;
    let fortran = field("fortran_order")
        .ok_or_else(|| Error::Data(format!(".npy header {header:?} has no fortran_order")))?;
    if fortran.starts_with("True") {
        return bad(".npy file is in Fortran order; save it with np.ascontiguousarray".into());
    }
    let shape = field("shape")
        .and_then(|r| r.strip_prefix('('))
        .and_then(|r| r.split(')').next())
        .ok_or_else(|| Error::Data(format!(".npy header {header:?} has no shape")))?;
    let dims = shape
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| {
            d.parse::<usize>()
                .map_err(|_| Error::Data(format!(".npy shape ({shape}) is not a list of integers")))
        })
        .collect::<Result<Vec<usize>>>()?;
    if dims.is_empty() || dims.len() > 4 {
        return bad(format!(
            ".npy array of shape ({shape}): expected 1 to 4 dimensions"
        ));
    }
    let size = match descr {
        "|u1" | "<u1" | "u1" | "|i1" | "<i1" | "i1" => 1,
        "<f4" | "<i4" | "<u4" => 4,
        "<i8" | "<u8" => 8,
        d => {
            return bad(format!(
                ".npy element type {d:?} is not supported (u1, <f4, or integer labels <i4/<i8)"
            ))
        }
    };
    let count = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
        .filter(|&n| n.saturating_mul(size as u64) <= MAX_IDX_BYTES)
        .ok_or_else(|| Error::Data(format!(".npy shape ({shape}) is too large (over 1 GiB)")))?
        as usize;
    let data = &bytes[start + len..];
    if data.len() != count * size {
        return bad(format!(
            ".npy shape ({shape}) of {descr} needs {} bytes of data, the file has {}{}",
            count * size,
            data.len(),
            if data.len() < count * size {
                " (truncated)"
            } else {
                ""
            }
        ));
    }
    let out_of_range = |i: usize| {
        Error::Data(format!(
            ".npy value #{i} is outside [0, 255] (labels must be class indices, pixels bytes)"
        ))
    };
    let values: Vec<u8> = match descr {
        "<f4" => {
            let f: Vec<f32> = data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let unit = f.iter().all(|v| (0.0..=1.0).contains(v));
            if !unit
                && !f
                    .iter()
                    .all(|v| (0.0..=255.0).contains(v) && v.fract() == 0.0)
            {
                return bad(
                    ".npy f4 values must all be in [0, 1] or all integers in [0, 255]".into(),
                );
            }
            f.iter()
                .map(|&v| {
                    if unit {
                        (v * 255.0).round() as u8
                    } else {
                        v as u8
                    }
                })
                .collect()
        }
        _ if size == 1 => {
            if descr.contains('i') {
                if let Some(i) = data.iter().position(|&b| b > 127) {
                    return Err(out_of_range(i));
                }
            }
            data.to_vec()
        }
        _ => data
            .chunks_exact(size)
            .enumerate()
            .map(|(i, c)| {
                let mut v = [0u8; 8];
                v[..size].copy_from_slice(c);
                let n = u64::from_le_bytes(v);
                // Negative values of signed types have the top bit set: out of range too.
                u8::try_from(n).map_err(|_| out_of_range(i))
            })
            .collect::<Result<Vec<u8>>>()?,
    };
    Ok(IdxArray { dims, data: values })
}

/// Writes a version-1 `.npy` file of unsigned bytes (tests and tools).
pub fn encode_npy_u8(dims: &[usize], data: &[u8]) -> Vec<u8> {
    let shape: String = dims.iter().map(|d| format!("{d}, ")).collect();
    let mut header = format!(
        "{{'descr': '|u1', 'fortran_order': False, 'shape': ({}), }}",
        shape.trim_end_matches(' ')
    );
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
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
    use ndarray::Array2;

    fn toy() -> (Vec<u8>, Vec<u8>) {
        let pixels: Vec<u8> = (0..5 * 4).map(|i| (i * 10) as u8).collect();
        (
            encode_idx(&[5, 2, 2], &pixels),
            encode_idx(&[5], &[0, 1, 2, 1, 0]),
        )
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

    fn npy(descr: &str, shape: &str, data: &[u8], version: u8) -> Vec<u8> {
        let header =
            format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}\n");
        let mut out = b"\x93NUMPY".to_vec();
        out.extend_from_slice(&[version, 0]);
        if version == 1 {
            out.extend_from_slice(&(header.len() as u16).to_le_bytes());
        } else {
            out.extend_from_slice(&(header.len() as u32).to_le_bytes());
        }
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out
    }

    #[test]
    fn npy_files_parse_like_idx() {
        let (img, lab) = toy();
        let want = Dataset::from_idx(&img, &lab).unwrap();
        let pixels: Vec<u8> = (0..5 * 4).map(|i| (i * 10) as u8).collect();
        let labels = [0u8, 1, 2, 1, 0];
        let u8_img = encode_npy_u8(&[5, 2, 2], &pixels);
        assert_eq!(
            Dataset::from_npy(&u8_img, &encode_npy_u8(&[5], &labels)).unwrap(),
            want
        );
        // v2 header, f4 pixels in [0, 1], int64 labels (NumPy's default integer).
        let f4: Vec<u8> = pixels
            .iter()
            .flat_map(|&p| (f32::from(p) / 255.0).to_le_bytes())
            .collect();
        let i8: Vec<u8> = labels
            .iter()
            .flat_map(|&l| i64::from(l).to_le_bytes())
            .collect();
        let d = Dataset::from_npy(
            &npy("<f4", "(5, 2, 2)", &f4, 2),
            &npy("<i8", "(5,)", &i8, 1),
        )
        .unwrap();
        assert_eq!(d, want);
        // Channels last: N x H x W x C.
        let c = Dataset::from_npy(
            &npy("|u1", "(5, 1, 2, 2)", &pixels, 1),
            &encode_npy_u8(&[5], &labels),
        )
        .unwrap();
        assert_eq!((c.image_dims.clone(), c.channels()), (vec![1, 2, 2], 2));
    }

    #[test]
    fn bad_npy_files_are_clear_errors() {
        let p = [0u8; 8];
        let cases: [(Vec<u8>, &str); 10] = [
            (b"PK\x03\x04 a zip".to_vec(), "bad magic"),
            (npy("|u1", "(2, 4)", &p[..7], 1), "truncated"),
            (npy("|u1", "(2, 4)", &[0; 9], 1), "needs 8 bytes"),
            (npy(">f4", "(2,)", &p, 1), "not supported"),
            (npy("<f8", "(1,)", &p, 1), "not supported"),
            (npy("|u1", "(65536, 65536, 2)", &p, 1), "too large"),
            (npy("|u1", "(2, x)", &p, 1), "not a list of integers"),
            (
                npy("<i8", "(1,)", &(-1i64).to_le_bytes(), 1),
                "outside [0, 255]",
            ),
            (
                npy("<f4", "(2,)", &[0, 0, 0x80, 0x3f, 0, 0, 0x20, 0x40], 1),
                "[0, 1]",
            ),
            (
                npy("|u1", "(1, 1, 1, 1, 1)", &p[..1], 1),
                "1 to 4 dimensions",
            ),
        ];
        for (bytes, needle) in cases {
            let msg = parse_npy(&bytes).unwrap_err().to_string();
            assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
        }
        let mut fortran = npy("|u1", "(2,)", &[1, 2], 1);
        let at = fortran.windows(5).position(|w| w == b"False").unwrap();
        fortran.splice(at..at + 5, b"True ".iter().copied());
        assert!(parse_npy(&fortran)
            .unwrap_err()
            .to_string()
            .contains("Fortran"));
        assert!(parse_npy(&fortran[..12])
            .unwrap_err()
            .to_string()
            .contains("truncated"));
        // Mismatched label counts.
        let err = Dataset::from_npy(
            &encode_npy_u8(&[2, 2, 2], &p),
            &encode_npy_u8(&[3], &[0, 1, 2]),
        )
        .unwrap_err();
        assert!(err.to_string().contains("2 images but 3 labels"), "{err}");
    }

    #[test]
    fn normalisation_per_channel() {
        // Two pixels of two channels: (10, 200), (30, 100).
        let img = encode_idx(&[1, 1, 2, 2], &[10, 200, 30, 100]);
        let mut d = Dataset::from_idx(&img, &encode_idx(&[1], &[0])).unwrap();
        let mut x = ndarray::Array2::zeros((1, 4));
        let mut y = [0u8];
        let plain = |d: &Dataset, x: &mut ndarray::Array2<f32>, y: &mut [u8]| {
            d.fill_batch(&[0], &mut x.view_mut(), y);
            x.row(0).to_vec()
        };
        let before = plain(&d, &mut x, &mut y);
        d.set_normalize(&Normalize::parse("0.1,0.5/0.2,0.25").unwrap())
            .unwrap();
        let after = plain(&d, &mut x, &mut y);
        for (j, (&a, &b)) in after.iter().zip(&before).enumerate() {
            let (m, s) = if j % 2 == 0 { (0.1, 0.2) } else { (0.5, 0.25) };
            assert!((a - (b - m) / s).abs() < 1e-5, "{j}: {a} vs {b}");
        }
        // A bad normalisation changes nothing.
        assert!(d
            .set_normalize(&Normalize::parse("0.1,0.2,0.3/1").unwrap())
            .is_err());
        assert_eq!(plain(&d, &mut x, &mut y), after);
        d.set_normalize(&Normalize::default()).unwrap();
        assert_eq!(plain(&d, &mut x, &mut y), before);
        for bad in ["0.1", "a/b", "0.1/0", "0.1/-1", "nan/1"] {
            assert!(Normalize::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(Normalize::parse("none").unwrap(), Normalize::default());
        assert_eq!(
            NormalizeChoice::parse("none").unwrap(),
            NormalizeChoice::None
        );
        assert_eq!(
            NormalizeChoice::parse("auto").unwrap(),
            NormalizeChoice::Auto
        );
        assert!(NormalizeChoice::parse("auto:2").is_err());
        assert_eq!(
            NormalizeChoice::parse("auto").unwrap().resolve(&d).unwrap(),
            Normalize::of(&d)
        );
        assert!(NormalizeChoice::parse("0.1,0.2,0.3/1")
            .unwrap()
            .resolve(&d)
            .is_err());
        for t in ["none", "auto", "0.5/0.25"] {
            assert_eq!(NormalizeChoice::parse(t).unwrap().to_string(), t);
        }
        let n = Normalize::parse("0.1307/0.3081").unwrap();
        assert_eq!(Normalize::parse(&n.to_string()).unwrap(), n);
        let stats = Normalize::of(&d);
        assert!((stats.mean[0] - 20.0 / 255.0).abs() < 1e-6);
        assert!((stats.std[1] - 50.0 / 255.0).abs() < 1e-6);
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
