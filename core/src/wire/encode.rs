//! Encoding frames: [`encode`] for every [`Message`], and the data encoders that write
//! straight from a slice ([`encode_params`], [`encode_push`] and their `_as` / `_tagged` forms).

use super::{ErrorBody, ErrorCode, Header, Kind, Message, PushTag, HEADER_LEN};
use crate::codec::{self, Encoding, ErrorFeedback};
use crate::error::{Error, Result};
use serde::Serialize;

fn frame(mut h: Header, meta: &[u8], payload: &[u8]) -> Vec<u8> {
    h.meta_len = meta.len() as u32;
    if h.count == 0 {
        h.count = (payload.len() / 4) as u32;
    }
    let mut out = Vec::with_capacity(HEADER_LEN + meta.len() + payload.len());
    h.write(&mut out);
    out.extend_from_slice(meta);
    out.extend_from_slice(payload);
    out
}

fn header(kind: Kind, request_id: u32, shard: u32, aux: u32, version: u64) -> Header {
    Header {
        kind,
        encoding: Encoding::F32,
        request_id,
        shard,
        aux,
        version,
        meta_len: 0,
        count: 0,
    }
}

fn json<T: Serialize>(v: &T) -> Vec<u8> {
    // Serialising these plain structs cannot fail.
    serde_json::to_vec(v).unwrap_or_default()
}

/// Appends `values` as little-endian bytes.
fn f32_bytes(values: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(bytemuck::cast_slice(values))
    } else {
        std::borrow::Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

/// Encodes a `Params` frame straight from a slice.
pub fn encode_params(request_id: u32, shard: u32, version: u64, values: &[f32]) -> Vec<u8> {
    frame(
        header(Kind::Params, request_id, shard, 0, version),
        &[],
        &f32_bytes(values),
    )
}

/// Encodes a `Push` frame straight from a slice.
pub fn encode_push(
    request_id: u32,
    shard: u32,
    base_version: u64,
    samples: u32,
    grad: &[f32],
) -> Vec<u8> {
    frame(
        header(Kind::Push, request_id, shard, samples, base_version),
        &[],
        &f32_bytes(grad),
    )
}

/// The header's value count for `len` values in `encoding`, if a frame can carry them.
fn wire_count(encoding: Encoding, len: usize) -> Result<u32> {
    // Frames carry no block size: on the wire int8 blocks are always DEFAULT_INT8_BLOCK values
    // (docs/protocol.md section 8). Another block size would make a frame no receiver decodes.
    if let Encoding::Int8Block { block } = encoding {
        if block != codec::DEFAULT_INT8_BLOCK {
            return Err(Error::Malformed(format!(
                "int8 blocks of {block} cannot be sent: frames carry blocks of {}",
                codec::DEFAULT_INT8_BLOCK
            )));
        }
    }
    u32::try_from(len).map_err(|_| Error::Malformed("payload of more than 2^32 values".into()))
}

/// The payload of a `Params` frame: one shard version's values in one encoding, encoded once
/// and shared (reference-counted) by every pull of that version in that encoding. The frame
/// is [`ParamsBody::header`] (what differs per pull: the request id, the pace, and whether the
/// connection asked for the samples meta) followed by
/// [`ParamsBody::bytes`], byte for byte what [`encode_params_paced`] writes. Issue 18: the
/// server quantised and copied the whole parameters once per pull and per connection.
#[derive(Debug, Clone)]
pub struct ParamsBody {
    /// The shard version the values are of.
    pub version: u64,
    /// The samples the shard had applied at that version (sent as a [`super::ParamsMeta`] to
    /// connections that asked for it).
    pub samples: u64,
    /// The encoding of [`ParamsBody::bytes`]: the one asked for, or f32 when it could not
    /// encode the values (see [`ParamsBody::encode_or_f32`]).
    pub encoding: Encoding,
    /// How many values.
    pub count: u32,
    /// The encoded values.
    pub bytes: std::sync::Arc<[u8]>,
}

impl ParamsBody {
    /// Encodes `values` of shard version `version` in `encoding`.
    ///
    /// # Errors
    /// [`Error::NotFinite`] when a value cannot be encoded; [`Error::Malformed`] for an int8
    /// block size frames cannot carry or more than 2^32 values.
    pub fn encode(encoding: Encoding, version: u64, samples: u64, values: &[f32]) -> Result<Self> {
        let count = wire_count(encoding, values.len())?;
        let mut out = Vec::with_capacity(encoding.encoded_len(values.len()));
        encoding.encode(values, &mut out)?;
        Ok(Self {
            version,
            samples,
            encoding,
            count,
            bytes: out.into(),
        })
    }

    /// [`ParamsBody::encode`], falling back to f32 (what the shard holds, exactly) when
    /// `encoding` cannot encode the values. A shard's parameters are finite (every update is
    /// validated), so the fallback is for the impossible case, not a path in use.
    pub fn encode_or_f32(encoding: Encoding, version: u64, samples: u64, values: &[f32]) -> Self {
        Self::encode(encoding, version, samples, values).unwrap_or_else(|_| Self {
            version,
            samples,
            encoding: Encoding::F32,
            count: u32::try_from(values.len()).unwrap_or(u32::MAX),
            bytes: f32_bytes(values).into_owned().into(),
        })
    }

    /// The bytes that start the `Params` frame carrying this body, answering `request_id` on
    /// `shard`, with the shard's pace in `aux` (0: none): the [`HEADER_LEN`]-byte header, then
    /// when `samples` the [`super::ParamsMeta`] stating [`ParamsBody::samples`].
    pub fn header(&self, request_id: u32, shard: u32, pace_ms: u32, samples: bool) -> Vec<u8> {
        let meta = if samples {
            json(&super::ParamsMeta {
                samples: self.samples,
            })
        } else {
            Vec::new()
        };
        let h = Header {
            encoding: self.encoding,
            count: self.count,
            meta_len: meta.len() as u32,
            ..header(Kind::Params, request_id, shard, pace_ms, self.version)
        };
        let mut out = Vec::with_capacity(HEADER_LEN + meta.len());
        h.write(&mut out);
        out.extend_from_slice(&meta);
        out
    }

    /// The bytes of the whole frame (one copy of the body): for drivers that send frames as
    /// one buffer.
    pub fn frame(&self, request_id: u32, shard: u32, pace_ms: u32, samples: bool) -> Vec<u8> {
        let mut out = self.header(request_id, shard, pace_ms, samples);
        out.extend_from_slice(&self.bytes);
        out
    }
}

/// Encodes a data frame of `kind` whose payload is `values` in `encoding`, appending the
/// payload straight after the header (no intermediate copy). With `feedback`, the values are
/// first corrected by the residual of earlier lossy pushes and the new residual is kept
/// ([`ErrorFeedback::encode_with_feedback`]).
#[allow(clippy::too_many_arguments)]
fn encode_data(
    kind: Kind,
    encoding: Encoding,
    request_id: u32,
    shard: u32,
    aux: u32,
    version: u64,
    values: &[f32],
    feedback: Option<&mut ErrorFeedback>,
    meta: &[u8],
) -> Result<Vec<u8>> {
    let h = Header {
        encoding,
        count: wire_count(encoding, values.len())?,
        meta_len: meta.len() as u32,
        ..header(kind, request_id, shard, aux, version)
    };
    let mut out = Vec::with_capacity(HEADER_LEN + meta.len() + encoding.encoded_len(values.len()));
    h.write(&mut out);
    out.extend_from_slice(meta);
    match feedback {
        Some(ef) => ef.encode_with_feedback(values, encoding, &mut out)?,
        None => encoding.encode(values, &mut out)?,
    }
    Ok(out)
}

/// Encodes a `Params` frame in `encoding`.
///
/// # Errors
/// [`Error::NotFinite`] when a value cannot be encoded (callers hold finite parameters).
pub fn encode_params_as(
    encoding: Encoding,
    request_id: u32,
    shard: u32,
    version: u64,
    values: &[f32],
) -> Result<Vec<u8>> {
    encode_params_paced(encoding, request_id, shard, version, 0, values)
}

/// [`encode_params_as`] with the shard's pace in the header's `aux`, in milliseconds (to a
/// connection whose Welcome had `paces`; docs/protocol.md, "Pacing").
///
/// # Errors
/// As [`encode_params_as`].
pub fn encode_params_paced(
    encoding: Encoding,
    request_id: u32,
    shard: u32,
    version: u64,
    pace_ms: u32,
    values: &[f32],
) -> Result<Vec<u8>> {
    encode_data(
        Kind::Params,
        encoding,
        request_id,
        shard,
        pace_ms,
        version,
        values,
        None,
        &[],
    )
}

/// Encodes a `Push` frame in `encoding`, with error feedback when given.
///
/// # Errors
/// [`Error::NotFinite`] for a gradient that cannot be encoded (the feedback is unchanged).
pub fn encode_push_as(
    encoding: Encoding,
    request_id: u32,
    shard: u32,
    base_version: u64,
    samples: u32,
    grad: &[f32],
    feedback: Option<&mut ErrorFeedback>,
) -> Result<Vec<u8>> {
    encode_data(
        Kind::Push,
        encoding,
        request_id,
        shard,
        samples,
        base_version,
        grad,
        feedback,
        &[],
    )
}

/// [`encode_push_as`] with a [`PushTag`] meta (to a shard whose Welcome had `spot_checks`).
///
/// # Errors
/// As [`encode_push_as`].
#[allow(clippy::too_many_arguments)]
pub fn encode_push_tagged(
    encoding: Encoding,
    request_id: u32,
    shard: u32,
    base_version: u64,
    samples: u32,
    grad: &[f32],
    feedback: Option<&mut ErrorFeedback>,
    tag: &PushTag,
) -> Result<Vec<u8>> {
    encode_data(
        Kind::Push,
        encoding,
        request_id,
        shard,
        samples,
        base_version,
        grad,
        feedback,
        &json(tag),
    )
}

/// Encodes an `Error` frame.
pub fn encode_error(
    request_id: u32,
    shard: u32,
    code: ErrorCode,
    message: impl Into<String>,
) -> Vec<u8> {
    encode(&Message::Error {
        request_id,
        shard,
        error: ErrorBody {
            code,
            message: message.into(),
        },
    })
}

/// Encodes any message.
pub fn encode(msg: &Message<'_>) -> Vec<u8> {
    match msg {
        Message::Hello {
            request_id,
            shard,
            hello,
        } => frame(
            header(Kind::Hello, *request_id, *shard, 0, 0),
            &json(hello),
            &[],
        ),
        Message::Welcome {
            request_id,
            shard,
            welcome,
        } => frame(
            header(Kind::Welcome, *request_id, *shard, 0, welcome.version),
            &json(welcome),
            &[],
        ),
        Message::Pull {
            request_id,
            shard,
            min_version,
        } => frame(
            header(Kind::Pull, *request_id, *shard, 0, *min_version),
            &[],
            &[],
        ),
        Message::Params {
            request_id,
            shard,
            version,
            pace_ms,
            samples,
            values,
        } => frame(
            Header {
                encoding: values.encoding(),
                count: values.len() as u32,
                ..header(Kind::Params, *request_id, *shard, *pace_ms, *version)
            },
            &samples
                .map(|samples| json(&super::ParamsMeta { samples }))
                .unwrap_or_default(),
            values.bytes(),
        ),
        Message::Push {
            request_id,
            shard,
            base_version,
            samples,
            grad,
        } => frame(
            Header {
                encoding: grad.encoding(),
                count: grad.len() as u32,
                ..header(Kind::Push, *request_id, *shard, *samples, *base_version)
            },
            &[],
            grad.bytes(),
        ),
        Message::Ack {
            request_id,
            shard,
            version,
            staleness,
        } => frame(
            header(Kind::Ack, *request_id, *shard, *staleness, *version),
            &[],
            &[],
        ),
        Message::Error {
            request_id,
            shard,
            error,
        } => frame(
            header(Kind::Error, *request_id, *shard, error.code as u32, 0),
            &json(error),
            &[],
        ),
        Message::Bye { shard, bye } => frame(header(Kind::Bye, 0, *shard, 0, 0), &json(bye), &[]),
        Message::Report { shard, report } => {
            frame(header(Kind::Report, 0, *shard, 0, 0), &json(report), &[])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::partition::KeyRange;
    use crate::wire::*;

    const LIMIT: usize = 1 << 20;

    #[test]
    fn a_shared_params_body_makes_the_same_frame_as_encoding_it_per_pull() {
        let values: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        for enc in [
            Encoding::F32,
            Encoding::Bf16,
            Encoding::Int8Block {
                block: codec::DEFAULT_INT8_BLOCK,
            },
        ] {
            let body = ParamsBody::encode(enc, 42, 1344, &values).unwrap();
            let whole = encode_params_paced(enc, 9, 1, 42, 250, &values).unwrap();
            assert_eq!(body.frame(9, 1, 250, false), whole, "{enc:?}");
            let head = body.header(9, 1, 250, false);
            assert_eq!(head.len(), HEADER_LEN);
            assert_eq!([&head[..], &body.bytes[..]].concat(), whole);
            // With the samples meta: the frame decodes to the same values and says the count.
            let counted = body.frame(9, 1, 250, true);
            assert_eq!(
                &counted[HEADER_LEN..HEADER_LEN + 16],
                br#"{"samples":1344}"#
            );
            let Message::Params {
                version,
                samples,
                pace_ms,
                values: v,
                ..
            } = decode(&counted, usize::MAX).unwrap()
            else {
                panic!("not Params")
            };
            assert_eq!((version, samples, pace_ms), (42, Some(1344), 250));
            let mut a = vec![0.0; values.len()];
            let mut b = vec![0.0; values.len()];
            v.copy_into(&mut a).unwrap();
            let Message::Params { values: w, .. } = decode(&whole, usize::MAX).unwrap() else {
                panic!("not Params")
            };
            w.copy_into(&mut b).unwrap();
            assert_eq!(a, b);
            let Message::Params { samples, .. } = decode(&whole, usize::MAX).unwrap() else {
                panic!("not Params")
            };
            assert_eq!(samples, None);
        }
        // A value the encoding refuses: f32, exactly what the shard holds.
        let bad = [1.0, f32::NAN];
        let body = ParamsBody::encode_or_f32(Encoding::Bf16, 3, 0, &bad);
        assert_eq!(body.encoding, Encoding::F32);
        assert_eq!(body.frame(1, 0, 0, false), encode_params(1, 0, 3, &bad));
        assert!(ParamsBody::encode(Encoding::Int8Block { block: 7 }, 0, 0, &values).is_err());
    }

    fn all_messages(payload: &[u8]) -> Vec<Message<'_>> {
        vec![
            Message::Hello {
                request_id: 1,
                shard: 2,
                hello: Hello {
                    protocol: PROTOCOL_VERSION,
                    worker_id: 77,
                    client: ClientKind::Browser,
                    ..Default::default()
                },
            },
            Message::Welcome {
                request_id: 1,
                shard: 2,
                welcome: Welcome {
                    protocol: 1,
                    range: KeyRange { start: 10, end: 20 },
                    version: 5,
                    pull_encoding: Default::default(),
                    push_encoding: Default::default(),
                    reports: false,
                    spot_checks: false,
                    paces: false,
                    samples: true,
                },
            },
            Message::Pull {
                request_id: 9,
                shard: 0,
                min_version: 3,
            },
            Message::Params {
                request_id: 9,
                shard: 0,
                version: 42,
                pace_ms: 250,
                samples: Some(4096),
                values: Payload::f32(payload),
            },
            Message::Push {
                request_id: 10,
                shard: 3,
                base_version: 41,
                samples: 32,
                grad: Payload::f32(payload),
            },
            Message::Ack {
                request_id: 10,
                shard: 3,
                version: 43,
                staleness: 2,
            },
            Message::Error {
                request_id: 10,
                shard: 3,
                error: ErrorBody {
                    code: ErrorCode::NotFinite,
                    message: "nan at 3".into(),
                },
            },
            Message::Bye {
                shard: 1,
                bye: Bye {
                    reason: "shutdown".into(),
                },
            },
        ]
    }

    #[test]
    fn every_message_round_trips() {
        let values = [1.5f32, -2.0, 0.0, 3.25];
        let payload = encode_params(0, 0, 0, &values)[HEADER_LEN..].to_vec();
        for m in all_messages(&payload) {
            let bytes = encode(&m);
            assert_eq!(decode(&bytes, LIMIT).unwrap(), m);
        }
        let p = encode_push(10, 3, 41, 32, &values);
        match decode(&p, LIMIT).unwrap() {
            Message::Push {
                grad,
                samples,
                base_version,
                ..
            } => {
                assert_eq!(grad.iter().collect::<Vec<_>>(), values);
                assert_eq!((samples, base_version), (32, 41));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn encoded_frames_round_trip_and_say_their_encoding() {
        let v: Vec<f32> = (0..600).map(|i| (i as f32 - 300.0) * 0.01).collect();
        for enc in [Encoding::F32, Encoding::Bf16, Encoding::INT8] {
            let f = encode_push_as(enc, 7, 1, 9, 32, &v, None).unwrap();
            assert_eq!(f.len(), HEADER_LEN + enc.encoded_len(v.len()));
            assert_eq!(f[3] >> 4, enc.id(), "the kind byte's high nibble");
            let Message::Push {
                request_id: 7,
                shard: 1,
                base_version: 9,
                samples: 32,
                grad,
            } = decode(&f, LIMIT).unwrap()
            else {
                panic!("{enc}")
            };
            assert_eq!((grad.encoding(), grad.len()), (enc, 600));
            let mut out = vec![0.0; 600];
            grad.copy_into(&mut out).unwrap();
            assert!(grad.iter().zip(&out).all(|(a, b)| a == *b), "iter agrees");
            let tol = match enc {
                Encoding::F32 => 0.0,
                Encoding::Bf16 => 3.0 / 256.0,
                Encoding::Int8Block { .. } => 3.0 / 254.0,
            };
            assert!(
                v.iter().zip(&out).all(|(a, b)| (a - b).abs() <= tol),
                "{enc}"
            );
            // Re-encoding the decoded message gives the same bytes.
            assert_eq!(encode(&decode(&f, LIMIT).unwrap()), f);
            let p = encode_params_as(enc, 8, 1, 3, &v).unwrap();
            assert!(matches!(
                decode(&p, LIMIT).unwrap(),
                Message::Params { request_id: 8, version: 3, values, .. } if values.encoding() == enc
            ));
        }
        // An encoding nibble on a kind without a payload, or an unknown one, is refused.
        let mut pull = encode(&Message::Pull {
            request_id: 1,
            shard: 0,
            min_version: 0,
        });
        pull[3] |= 1 << 4;
        assert!(matches!(decode(&pull, LIMIT), Err(Error::UnknownKind(_))));
        let mut push = encode_push(1, 0, 0, 1, &[1.0; 4]);
        push[3] |= 9 << 4;
        assert!(matches!(decode(&push, LIMIT), Err(Error::Malformed(_))));
        // An int8 frame with a NaN scale decodes as a frame but is refused when copied out.
        let mut q = encode_push_as(Encoding::INT8, 1, 0, 0, 1, &[1.0; 4], None).unwrap();
        q[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        let Message::Push { grad, .. } = decode(&q, LIMIT).unwrap() else {
            panic!()
        };
        assert!(grad.copy_into(&mut [0.0; 4]).is_err());
        // Error feedback carries the rounding residual into the next push.
        let mut ef = ErrorFeedback::new(4);
        let g = [0.001, 1.0, -1.0, 0.5];
        encode_push_as(Encoding::INT8, 1, 0, 0, 1, &g, Some(&mut ef)).unwrap();
        assert!(ef.residual().iter().any(|&r| r != 0.0));
    }

    #[test]
    fn a_push_tag_rides_in_the_meta_and_bad_tags_are_malformed() {
        let v = [0.5f32, -1.0, 2.0];
        let tag = PushTag {
            batch: 1234,
            versions: vec![7, 9],
        };
        for enc in [Encoding::F32, Encoding::Bf16, Encoding::INT8] {
            let f = encode_push_tagged(enc, 3, 1, 9, 64, &v, None, &tag).unwrap();
            let Message::Push {
                base_version: 9,
                samples: 64,
                grad,
                ..
            } = decode(&f, LIMIT).unwrap()
            else {
                panic!("{enc}")
            };
            assert_eq!(grad.len(), 3);
            assert_eq!(push_tag(&f).unwrap(), Some(tag.clone()));
        }
        let plain = encode_push(3, 1, 9, 64, &v);
        assert_eq!(push_tag(&plain).unwrap(), None);
        // No versions, too many versions, and meta that is no tag are refused by decode.
        for bad in [
            PushTag {
                batch: 1,
                versions: vec![],
            },
            PushTag {
                batch: 1,
                versions: vec![0; MAX_TAG_VERSIONS + 1],
            },
        ] {
            let f = encode_push_tagged(Encoding::F32, 3, 1, 9, 64, &v, None, &bad).unwrap();
            assert!(matches!(decode(&f, LIMIT), Err(Error::Malformed(_))));
            assert!(push_tag(&f).is_err());
        }
        let mut f = encode_push_tagged(Encoding::F32, 3, 1, 9, 64, &v, None, &tag).unwrap();
        f[HEADER_LEN] = b'[';
        assert!(matches!(decode(&f, LIMIT), Err(Error::Malformed(_))));
        assert_eq!(ErrorCode::from_u32(19), Some(ErrorCode::Quarantined));
        assert!(ErrorCode::Quarantined.is_fatal());
    }
}
