//! IDX files (LeCun's format; unsigned-byte images and labels, raw or gzip-compressed):
//! [`parse_idx`], [`parse_idx_owned`], [`encode_idx`] and [`IdxArray`], the parsed array both
//! file formats give.

use crate::error::{Error, Result};
use std::io::Read;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::testing::toy;
    use crate::data::Dataset;

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
}
