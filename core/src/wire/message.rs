//! Typed frames ([`Message`], with borrowed [`Payload`]s) and the second step of decoding:
//! [`decode`] and [`push_tag`].

use super::MAX_TAG_VERSIONS;
use super::{Bye, ErrorBody, Header, Hello, Kind, PushTag, Report, Welcome, HEADER_LEN};
use crate::codec::Encoding;
use crate::error::{Error, Result};
use serde::Deserialize;

/// A borrowed payload: `len` values in `encoding` (any alignment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Payload<'a> {
    encoding: Encoding,
    len: usize,
    bytes: &'a [u8],
}

impl<'a> Payload<'a> {
    /// Raw little-endian f32 bytes (`bytes.len() / 4` values).
    pub fn f32(bytes: &'a [u8]) -> Self {
        Self {
            encoding: Encoding::F32,
            len: bytes.len() / 4,
            bytes,
        }
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when there is no value.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How the values are encoded.
    pub fn encoding(&self) -> Encoding {
        self.encoding
    }

    /// The raw bytes.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// An upper bound on `‖c − decoded‖₂` for any vector `c` whose encoding these bytes are:
    /// how far a lossy encoding's rounding may have moved the values (issue 21: spot checks
    /// compare a compressed push as what it is, not as an f32 gradient). 0 for f32; for bf16
    /// (round to nearest, 8 significant bits) `2⁻⁸·(1 + 2⁻⁷)·‖decoded‖`; for int8 blocks, whose
    /// codes round `c / s` to nearest with `s = max |c| / 127`, `√(Σ_b n_b·(s_b/2)²)` over the
    /// blocks, plus the f32 rounding of `code·s`. Computed from the scales alone for int8 (one
    /// pass over `⌈n/B⌉` floats), from the values for bf16.
    pub fn error_bound(&self) -> f64 {
        match self.encoding {
            Encoding::F32 => 0.0,
            Encoding::Bf16 => {
                let sq: f64 = self.iter().map(|v| f64::from(v) * f64::from(v)).sum();
                sq.sqrt() * (1.0 / 256.0) * (1.0 + 1.0 / 128.0)
            }
            Encoding::Int8Block { block } => {
                let block = block.max(1) as usize;
                let blocks = self.len.div_ceil(block);
                let mut sq = 0.0f64;
                for b in 0..blocks {
                    let at = 4 * b;
                    let Some(c) = self.bytes.get(at..at + 4) else {
                        break;
                    };
                    let s = f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]]).abs());
                    let n = block.min(self.len - b * block) as f64;
                    // Half a step, and the product code·s rounded in f32 (127·s·2⁻²⁴), and
                    // subnormal scales' coarser steps (an absolute 2⁻¹⁴⁹ per value).
                    let e = 0.5 * s + 127.0 * s * f64::from(f32::EPSILON) + 1e-45;
                    sq += n * e * e;
                }
                sq.sqrt()
            }
        }
    }

    /// The values, unchecked (decoded one by one; for tests and tools, not hot paths).
    pub fn iter(&self) -> impl Iterator<Item = f32> + 'a {
        let (enc, n, b) = (self.encoding, self.len, self.bytes);
        (0..n).map(move |i| {
            let at = |o: usize| b.get(o..o + 4).map_or([0; 4], |c| [c[0], c[1], c[2], c[3]]);
            match enc {
                Encoding::F32 => f32::from_le_bytes(at(4 * i)),
                Encoding::Bf16 => {
                    let h = b.get(2 * i..2 * i + 2).map_or([0; 2], |c| [c[0], c[1]]);
                    f32::from_bits(u32::from(u16::from_le_bytes(h)) << 16)
                }
                Encoding::Int8Block { block } => {
                    let block = block.max(1) as usize;
                    let scales = 4 * n.div_ceil(block);
                    let scale = f32::from_le_bytes(at(4 * (i / block)));
                    let q = b.get(scales + i).map_or(0, |&q| q as i8);
                    f32::from(q) * scale
                }
            }
        })
    }

    /// Decodes the values into `out`, checking the length and that every value (or scale) is
    /// finite. On error `out` may be partly written; callers decode into scratch, never into
    /// live state.
    ///
    /// # Errors
    /// [`Error::WrongLength`], [`Error::NotFinite`] or [`Error::Malformed`].
    pub fn copy_into(&self, out: &mut [f32]) -> Result<()> {
        if out.len() != self.len {
            return Err(Error::WrongLength {
                expected: out.len(),
                got: self.len,
            });
        }
        self.encoding.decode(self.bytes, out)
    }
}

/// A decoded frame. Payloads borrow from the input bytes.
#[derive(Debug, Clone, PartialEq)]
pub enum Message<'a> {
    /// Worker introduces itself on a shard connection.
    Hello {
        /// Echoed by `Welcome`.
        request_id: u32,
        /// Shard the worker thinks it is talking to.
        shard: u32,
        /// Meta.
        hello: Hello,
    },
    /// Shard accepts the worker.
    Welcome {
        /// Echo of the Hello's id.
        request_id: u32,
        /// Shard index.
        shard: u32,
        /// Meta.
        welcome: Welcome,
    },
    /// Worker asks for parameters.
    Pull {
        /// Echoed by `Params`.
        request_id: u32,
        /// Shard index.
        shard: u32,
        /// Reply once the shard has reached this version (0: reply now). Only `sync:K` runs
        /// wait; other modes ignore it.
        min_version: u64,
    },
    /// The shard's parameters at `version`.
    Params {
        /// Echo of the Pull's id.
        request_id: u32,
        /// Shard index.
        shard: u32,
        /// Number of updates applied to the shard when it was read.
        version: u64,
        /// The shard's pace in milliseconds (header `aux`; 0 = none): the least interval
        /// between this worker's batches of pulls the shard asks for (issue 18). Nonzero only
        /// on a connection whose Welcome had `paces`.
        pace_ms: u32,
        /// The samples the shard had applied at `version` (the frame's [`super::ParamsMeta`]),
        /// on a connection whose Welcome had `samples`; `None` without a meta.
        samples: Option<u64>,
        /// The values of the shard's key range.
        values: Payload<'a>,
    },
    /// A gradient slice computed from the shard at `base_version`.
    Push {
        /// Echoed by `Ack` or `Error`.
        request_id: u32,
        /// Shard index.
        shard: u32,
        /// The shard version the worker read before computing this gradient.
        base_version: u64,
        /// Examples the gradient was averaged over.
        samples: u32,
        /// The gradient for the shard's key range.
        grad: Payload<'a>,
    },
    /// The push was applied, making the shard `version`.
    Ack {
        /// Echo of the Push's id.
        request_id: u32,
        /// Shard index.
        shard: u32,
        /// Shard version right after this push was applied.
        version: u64,
        /// Updates applied between the push's base version and this one.
        staleness: u32,
    },
    /// A request failed.
    Error {
        /// Echo of the failed request's id (0 when it could not be read).
        request_id: u32,
        /// Shard index.
        shard: u32,
        /// What went wrong.
        error: ErrorBody,
    },
    /// The sender leaves.
    Bye {
        /// Shard index.
        shard: u32,
        /// Meta.
        bye: Bye,
    },
    /// A worker's measurements.
    Report {
        /// Shard index.
        shard: u32,
        /// Meta.
        report: Report,
    },
}

fn meta<'a, T: Deserialize<'a>>(bytes: &'a [u8], kind: Kind) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|e| Error::Malformed(format!("{kind:?} meta: {e}")))
}

/// Decodes one frame of at most `limit` bytes.
///
/// # Errors
/// Any [`Header::parse`] error, or [`Error::Malformed`] when the meta or payload does not fit the
/// kind.
pub fn decode(bytes: &[u8], limit: usize) -> Result<Message<'_>> {
    let h = Header::parse(bytes, limit)?;
    let meta_end = HEADER_LEN + h.meta_len as usize;
    let meta_bytes = &bytes[HEADER_LEN..meta_end];
    let payload = Payload {
        encoding: h.encoding,
        len: h.count as usize,
        bytes: &bytes[meta_end..],
    };
    // A Push may carry a PushTag (spot checks); it is checked here and read by push_tag.
    let has_meta = matches!(
        h.kind,
        Kind::Hello
            | Kind::Welcome
            | Kind::Error
            | Kind::Bye
            | Kind::Report
            | Kind::Push
            | Kind::Params
    );
    let has_payload = matches!(h.kind, Kind::Params | Kind::Push);
    if !has_meta && h.meta_len != 0 {
        return Err(Error::Malformed(format!("{:?} carries no meta", h.kind)));
    }
    if !has_payload && h.count != 0 {
        return Err(Error::Malformed(format!("{:?} carries no payload", h.kind)));
    }
    let (request_id, shard) = (h.request_id, h.shard);
    Ok(match h.kind {
        Kind::Hello => Message::Hello {
            request_id,
            shard,
            hello: meta(meta_bytes, h.kind)?,
        },
        Kind::Welcome => Message::Welcome {
            request_id,
            shard,
            welcome: meta(meta_bytes, h.kind)?,
        },
        Kind::Pull => Message::Pull {
            request_id,
            shard,
            min_version: h.version,
        },
        Kind::Params => Message::Params {
            request_id,
            shard,
            version: h.version,
            pace_ms: h.aux,
            samples: if h.meta_len == 0 {
                None
            } else {
                Some(meta::<super::ParamsMeta>(meta_bytes, h.kind)?.samples)
            },
            values: payload,
        },
        Kind::Push => {
            if h.meta_len != 0 {
                check_tag(&meta::<PushTag>(meta_bytes, h.kind)?)?;
            }
            Message::Push {
                request_id,
                shard,
                base_version: h.version,
                samples: h.aux,
                grad: payload,
            }
        }
        Kind::Ack => Message::Ack {
            request_id,
            shard,
            version: h.version,
            staleness: h.aux,
        },
        Kind::Error => Message::Error {
            request_id,
            shard,
            error: meta(meta_bytes, h.kind)?,
        },
        Kind::Bye => Message::Bye {
            shard,
            bye: meta(meta_bytes, h.kind)?,
        },
        Kind::Report => Message::Report {
            shard,
            report: meta(meta_bytes, h.kind)?,
        },
    })
}

fn check_tag(tag: &PushTag) -> Result<()> {
    if tag.versions.is_empty() || tag.versions.len() > MAX_TAG_VERSIONS {
        return Err(Error::Malformed(format!(
            "push tag lists {} shard versions; 1 to {MAX_TAG_VERSIONS}",
            tag.versions.len()
        )));
    }
    Ok(())
}

/// The [`PushTag`] of a Push frame that [`decode`] accepted, `None` when it carries none.
///
/// # Errors
/// [`Error::Malformed`] for a frame that is not a Push or whose meta is not a tag.
pub fn push_tag(bytes: &[u8]) -> Result<Option<PushTag>> {
    let h = Header::parse(bytes, usize::MAX)?;
    if h.kind != Kind::Push {
        return Err(Error::Malformed("not a Push frame".into()));
    }
    if h.meta_len == 0 {
        return Ok(None);
    }
    let tag: PushTag = meta(&bytes[HEADER_LEN..HEADER_LEN + h.meta_len as usize], h.kind)?;
    check_tag(&tag)?;
    Ok(Some(tag))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::*;
    use proptest::prelude::*;

    const LIMIT: usize = 1 << 20;

    /// Issue 21: the rounding a lossy push encoding did is within `Payload::error_bound`, for
    /// sparse and dense blocks and over rounds of error feedback (what the spot checker's
    /// tolerance is made of); f32's bound is 0.
    #[test]
    fn issue_21_error_bound_covers_the_rounding_of_every_encoding() {
        let mut rng = crate::rng::Rng::new(21);
        for enc in [Encoding::F32, Encoding::Bf16, Encoding::INT8] {
            let n = 1000;
            let mut fb = crate::codec::ErrorFeedback::new(n);
            for round in 0..20 {
                // Sparse blocks with outliers, like an MLP's first-layer gradient.
                let g: Vec<f32> = (0..n)
                    .map(|i| {
                        let x = rng.normal() as f32 * 1e-3;
                        if i % 97 == round {
                            x * 300.0
                        } else if i % 3 == 0 {
                            0.0
                        } else {
                            x
                        }
                    })
                    .collect();
                let corrected: Vec<f32> = g.iter().zip(fb.residual()).map(|(g, r)| g + r).collect();
                let f = crate::wire::encode_push_as(enc, 2, 0, 0, 8, &g, Some(&mut fb)).unwrap();
                let Message::Push { grad, .. } = decode(&f, LIMIT).unwrap() else {
                    panic!("a push")
                };
                let mut p = vec![0.0; n];
                grad.copy_into(&mut p).unwrap();
                let d: f64 = corrected
                    .iter()
                    .zip(&p)
                    .map(|(c, p)| (f64::from(*c) - f64::from(*p)).powi(2))
                    .sum::<f64>()
                    .sqrt();
                let b = grad.error_bound();
                assert!(
                    d <= b * (1.0 + 1e-9) + 1e-30,
                    "{enc:?} round {round}: {d} > {b}"
                );
                if enc == Encoding::F32 {
                    assert_eq!(b, 0.0);
                } else {
                    assert!(b > 0.0);
                }
            }
        }
    }

    #[test]
    fn bad_frames_are_errors() {
        let good = encode_push(1, 0, 0, 1, &[1.0, 2.0]);
        assert!(matches!(
            decode(&good[..10], LIMIT),
            Err(Error::Malformed(_))
        ));
        assert!(matches!(
            decode(&good[..good.len() - 1], LIMIT),
            Err(Error::Malformed(_))
        ));
        let mut extra = good.clone();
        extra.extend_from_slice(&[0; 4]);
        assert!(matches!(decode(&extra, LIMIT), Err(Error::Malformed(_))));
        assert!(matches!(decode(&good, 39), Err(Error::Oversize { .. })));
        let mut v = good.clone();
        v[2] = 9;
        assert!(matches!(
            decode(&v, LIMIT),
            Err(Error::WireVersion { got: 9, .. })
        ));
        let mut k = good.clone();
        k[3] = 200;
        assert!(matches!(decode(&k, LIMIT), Err(Error::UnknownKind(200))));
        let mut m = good.clone();
        m[0] = b'X';
        assert!(matches!(decode(&m, LIMIT), Err(Error::Malformed(_))));
        // A Pull must not carry a payload.
        let mut pull = encode(&Message::Pull {
            request_id: 1,
            shard: 0,
            min_version: 0,
        });
        pull[28] = 1;
        pull.extend_from_slice(&[0; 4]);
        assert!(matches!(decode(&pull, LIMIT), Err(Error::Malformed(_))));
        // Hello meta that is not JSON.
        let mut hello = encode(&Message::Hello {
            request_id: 1,
            shard: 0,
            hello: Hello {
                protocol: 1,
                worker_id: 1,
                client: ClientKind::Native,
                ..Default::default()
            },
        });
        let n = hello.len();
        hello[n - 1] = b'!';
        assert!(matches!(decode(&hello, LIMIT), Err(Error::Malformed(_))));
    }

    #[test]
    fn nan_payload_is_caught_on_copy() {
        let f = encode_push(1, 0, 0, 1, &[1.0, f32::NAN, 2.0]);
        let Message::Push { grad, .. } = decode(&f, LIMIT).unwrap() else {
            panic!()
        };
        let mut out = [0.0; 3];
        assert!(matches!(
            grad.copy_into(&mut out),
            Err(Error::NotFinite { index: 1, .. })
        ));
        let mut short = [0.0; 2];
        assert!(matches!(
            grad.copy_into(&mut short),
            Err(Error::WrongLength {
                expected: 2,
                got: 3
            })
        ));
        let inf = encode_push(1, 0, 0, 1, &[f32::INFINITY]);
        let Message::Push { grad, .. } = decode(&inf, LIMIT).unwrap() else {
            panic!()
        };
        assert!(grad.copy_into(&mut [0.0]).is_err());
    }

    proptest! {
        #[test]
        fn decoding_arbitrary_encoded_frames_never_panics(
            kind in 0u8..=255, count in 0u32..64, tail in proptest::collection::vec(any::<u8>(), 0..400)
        ) {
            let mut f = encode_push(1, 0, 0, 1, &[]);
            f[3] = kind;
            f[28..32].copy_from_slice(&count.to_le_bytes());
            f.extend_from_slice(&tail);
            if let Ok(Message::Push { grad, .. } | Message::Params { values: grad, .. }) = decode(&f, LIMIT) {
                let mut out = vec![0.0; grad.len()];
                let _ = grad.copy_into(&mut out);
                let _ = grad.iter().count();
            }
        }

        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode(&bytes, LIMIT);
        }

        #[test]
        fn decoding_mutated_frames_never_panics(idx in 0usize..64, val in any::<u8>(), cut in 0usize..80) {
            let mut f = encode(&Message::Hello {
                request_id: 1, shard: 0,
                hello: Hello { protocol: 1, worker_id: 5, client: ClientKind::Native, ..Default::default() },
            });
            let i = idx % f.len();
            f[i] = val;
            f.truncate(cut.max(1).min(f.len()));
            let _ = decode(&f, LIMIT);
        }
    }
}
