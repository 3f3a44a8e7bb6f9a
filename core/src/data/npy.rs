//! NumPy `.npy` files: [`parse_npy`] into the same [`IdxArray`] an IDX file gives, and
//! [`encode_npy_u8`].

use super::{IdxArray, MAX_IDX_BYTES};
use crate::error::{Error, Result};

/// Parses a NumPy `.npy` file (format versions 1, 2 and 3; C order; element types `u1`, and
/// for images `f4`, for labels also `i1`, `i4`, `i8`, `u4`, `u8`) into unsigned bytes:
/// - `f4` values in `[0, 1]` are scaled by 255 and rounded; `f4` values that are all
///   integers in `[0, 255]` are taken as they are; anything else is an error (pixels travel to
///   workers as bytes; normalise with [`Normalize`](super::Normalize) instead);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::testing::toy;
    use crate::data::Dataset;

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
}
