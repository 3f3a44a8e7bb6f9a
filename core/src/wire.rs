//! The wire protocol: one WebSocket binary message is one frame, a fixed 32-byte little-endian
//! header, then `meta_len` bytes of UTF-8 JSON (control messages only), then `count` raw
//! little-endian f32 values (data messages only). docs/protocol.md is the full specification.
//!
//! ```text
//! offset size field
//!      0    2 magic      b"CG"
//!      2    1 wire       wire format version (1)
//!      3    1 kind       Message kind (see Kind)
//!      4    4 request_id echoed by the reply
//!      8    4 shard      shard the frame is for / from
//!     12    4 aux        per kind: Push = samples, Ack = staleness, Error = error code
//!     16    8 version    per kind: Pull = min version, Params = shard version, Push = base
//!                        version, Ack = new version
//!     24    4 meta_len   bytes of JSON meta after the header
//!     28    4 count      number of f32 values after the meta
//! ```
//!
//! Decoding is two-step, like mini-redis' `check`/`parse`: [`Header::parse`] validates the fixed
//! part and the exact total length, [`decode`] then types the frame. Neither panics on any input.
//! Payload values are validated (finite) when copied out with [`F32Le::copy_into`].

use crate::error::{Error, Result};
use crate::partition::KeyRange;
use serde::{Deserialize, Serialize};

/// First two bytes of every frame.
pub const MAGIC: [u8; 2] = *b"CG";
/// Version of the frame layout above.
pub const WIRE_VERSION: u8 = 1;
/// Version of the protocol semantics, exchanged in `Hello`/`Welcome` and `/api/join`.
pub const PROTOCOL_VERSION: u32 = 1;
/// Size of the fixed header.
pub const HEADER_LEN: usize = 32;
/// Largest accepted JSON meta section.
pub const MAX_META_LEN: usize = 64 * 1024;

/// Message kinds. Control: Hello, Welcome, Error, Bye. Data: Pull, Params, Push, Ack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// worker -> shard: first frame on a connection.
    Hello = 1,
    /// shard -> worker: reply to Hello.
    Welcome = 2,
    /// worker -> shard: ask for the shard's current parameters.
    Pull = 3,
    /// shard -> worker: the parameters (reply to Pull).
    Params = 4,
    /// worker -> shard: a gradient slice.
    Push = 5,
    /// shard -> worker: the push was applied.
    Ack = 6,
    /// either way: a request failed.
    Error = 7,
    /// either way: the sender is going away.
    Bye = 8,
}

impl Kind {
    /// The kind for a byte.
    ///
    /// # Errors
    /// [`Error::UnknownKind`].
    pub fn from_u8(b: u8) -> Result<Self> {
        Ok(match b {
            1 => Kind::Hello,
            2 => Kind::Welcome,
            3 => Kind::Pull,
            4 => Kind::Params,
            5 => Kind::Push,
            6 => Kind::Ack,
            7 => Kind::Error,
            8 => Kind::Bye,
            other => return Err(Error::UnknownKind(other)),
        })
    }
}

/// The fixed header of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Message kind.
    pub kind: Kind,
    /// Request id; replies echo it.
    pub request_id: u32,
    /// Shard index.
    pub shard: u32,
    /// Kind-specific 32-bit field.
    pub aux: u32,
    /// Kind-specific version field.
    pub version: u64,
    /// Bytes of JSON meta following the header.
    pub meta_len: u32,
    /// f32 values following the meta.
    pub count: u32,
}

impl Header {
    /// Total frame length this header announces.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + self.meta_len as usize + 4 * self.count as usize
    }

    /// Validates the fixed part of `bytes` and that the frame is exactly as long as announced and
    /// at most `limit` bytes.
    ///
    /// # Errors
    /// [`Error::Oversize`], [`Error::Malformed`], [`Error::WireVersion`], [`Error::UnknownKind`].
    pub fn parse(bytes: &[u8], limit: usize) -> Result<Self> {
        if bytes.len() > limit {
            return Err(Error::Oversize {
                size: bytes.len(),
                limit,
            });
        }
        if bytes.len() < HEADER_LEN {
            return Err(Error::Malformed(format!(
                "frame of {} bytes is shorter than the {HEADER_LEN}-byte header",
                bytes.len()
            )));
        }
        if bytes[0..2] != MAGIC {
            return Err(Error::Malformed("bad magic (expected \"CG\")".into()));
        }
        if bytes[2] != WIRE_VERSION {
            return Err(Error::WireVersion {
                got: bytes[2],
                expected: WIRE_VERSION,
            });
        }
        let u32_at =
            |o: usize| u32::from_le_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]);
        let mut v = [0u8; 8];
        v.copy_from_slice(&bytes[16..24]);
        let h = Header {
            kind: Kind::from_u8(bytes[3])?,
            request_id: u32_at(4),
            shard: u32_at(8),
            aux: u32_at(12),
            version: u64::from_le_bytes(v),
            meta_len: u32_at(24),
            count: u32_at(28),
        };
        if h.meta_len as usize > MAX_META_LEN {
            return Err(Error::Malformed(format!(
                "meta of {} bytes exceeds {MAX_META_LEN}",
                h.meta_len
            )));
        }
        // u64 arithmetic: 4 * count cannot overflow.
        let announced = HEADER_LEN as u64 + u64::from(h.meta_len) + 4 * u64::from(h.count);
        if announced != bytes.len() as u64 {
            return Err(Error::Malformed(format!(
                "header announces {announced} bytes but the frame has {}",
                bytes.len()
            )));
        }
        Ok(h)
    }

    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&MAGIC);
        out.push(WIRE_VERSION);
        out.push(self.kind as u8);
        out.extend_from_slice(&self.request_id.to_le_bytes());
        out.extend_from_slice(&self.shard.to_le_bytes());
        out.extend_from_slice(&self.aux.to_le_bytes());
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&self.meta_len.to_le_bytes());
        out.extend_from_slice(&self.count.to_le_bytes());
    }
}

/// Who is connecting: shown on the dashboard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ClientKind {
    /// `crowdgrad work` or another native program.
    #[default]
    Native,
    /// The wasm worker in a browser tab.
    Browser,
}

/// Meta of a `Hello`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Protocol version the worker speaks ([`PROTOCOL_VERSION`]).
    pub protocol: u32,
    /// Worker id handed out by `/api/join`.
    pub worker_id: u64,
    /// Kind of client.
    #[serde(default)]
    pub client: ClientKind,
}

/// Meta of a `Welcome`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// Protocol version the shard speaks.
    pub protocol: u32,
    /// The shard's key range in the flat parameter vector.
    pub range: KeyRange,
    /// The shard's current version (number of applied updates).
    pub version: u64,
}

/// Why a request failed. Codes marked fatal close the connection after the error frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[repr(u32)]
pub enum ErrorCode {
    /// The frame could not be decoded (fatal).
    Malformed = 1,
    /// Unknown wire format version (fatal).
    WireVersion = 2,
    /// Unknown message kind (fatal).
    UnknownKind = 3,
    /// Frame over the size limit (fatal).
    Oversize = 4,
    /// Payload length does not match the shard (fatal).
    WrongLength = 5,
    /// Payload holds NaN or infinity (fatal).
    NotFinite = 6,
    /// Protocol version mismatch in Hello (fatal).
    ProtocolVersion = 7,
    /// A message not valid in this state, e.g. Push before Hello (fatal).
    Protocol = 8,
    /// Frame addressed to another shard (fatal).
    WrongShard = 9,
    /// Push claims a base version the shard has not reached (fatal).
    FutureVersion = 10,
    /// Push rejected by the staleness policy (not fatal).
    TooStale = 11,
    /// Worker id unknown to the server (fatal).
    UnknownWorker = 12,
    /// The server is shutting down (fatal).
    ShuttingDown = 13,
    /// The server is overloaded or failed internally (not fatal).
    Busy = 14,
}

impl ErrorCode {
    /// Whether the server closes the connection after sending this error.
    pub fn is_fatal(self) -> bool {
        !matches!(self, ErrorCode::TooStale | ErrorCode::Busy)
    }

    /// Code for a numeric value, if defined.
    pub fn from_u32(v: u32) -> Option<Self> {
        use ErrorCode::*;
        [
            Malformed,
            WireVersion,
            UnknownKind,
            Oversize,
            WrongLength,
            NotFinite,
            ProtocolVersion,
            Protocol,
            WrongShard,
            FutureVersion,
            TooStale,
            UnknownWorker,
            ShuttingDown,
            Busy,
        ]
        .into_iter()
        .find(|c| *c as u32 == v)
    }

    /// Stable snake_case name (as in JSON and the status API).
    pub fn name(self) -> &'static str {
        use ErrorCode::*;
        match self {
            Malformed => "malformed",
            WireVersion => "wire_version",
            UnknownKind => "unknown_kind",
            Oversize => "oversize",
            WrongLength => "wrong_length",
            NotFinite => "not_finite",
            ProtocolVersion => "protocol_version",
            Protocol => "protocol",
            WrongShard => "wrong_shard",
            FutureVersion => "future_version",
            TooStale => "too_stale",
            UnknownWorker => "unknown_worker",
            ShuttingDown => "shutting_down",
            Busy => "busy",
        }
    }
}

impl From<&Error> for ErrorCode {
    fn from(e: &Error) -> Self {
        match e {
            Error::WireVersion { .. } => ErrorCode::WireVersion,
            Error::UnknownKind(_) => ErrorCode::UnknownKind,
            Error::Oversize { .. } => ErrorCode::Oversize,
            Error::WrongLength { .. } => ErrorCode::WrongLength,
            Error::NotFinite { .. } => ErrorCode::NotFinite,
            Error::ProtocolVersion { .. } => ErrorCode::ProtocolVersion,
            Error::Protocol(_) => ErrorCode::Protocol,
            Error::Malformed(_) | Error::Data(_) | Error::Config(_) => ErrorCode::Malformed,
        }
    }
}

/// Meta of an `Error`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// Machine-readable code.
    pub code: ErrorCode,
    /// Human-readable explanation.
    pub message: String,
}

/// Meta of a `Bye`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bye {
    /// Why the sender leaves.
    pub reason: String,
}

/// A borrowed run of little-endian f32 values (any alignment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct F32Le<'a>(&'a [u8]);

impl<'a> F32Le<'a> {
    /// Number of values.
    pub fn len(&self) -> usize {
        self.0.len() / 4
    }

    /// True when there is no value.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The raw bytes.
    pub fn bytes(&self) -> &'a [u8] {
        self.0
    }

    /// The values, unchecked.
    pub fn iter(&self) -> impl Iterator<Item = f32> + 'a {
        self.0
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
    }

    /// Copies the values into `out`, checking the length and that every value is finite. On
    /// error `out` may be partly written; callers copy into scratch, never into live state.
    ///
    /// # Errors
    /// [`Error::WrongLength`] or [`Error::NotFinite`].
    pub fn copy_into(&self, out: &mut [f32]) -> Result<()> {
        if out.len() != self.len() {
            return Err(Error::WrongLength {
                expected: out.len(),
                got: self.len(),
            });
        }
        if cfg!(target_endian = "little") {
            // The bytes are already the values: one memcpy, whatever the input's alignment.
            bytemuck::cast_slice_mut::<f32, u8>(out).copy_from_slice(self.0);
        } else {
            for (o, v) in out.iter_mut().zip(self.iter()) {
                *o = v;
            }
        }
        // Branch-free so it vectorises: a value is not finite iff its exponent bits are all set.
        let any_bad = out.iter().fold(0u32, |acc, v| {
            acc | u32::from(v.to_bits() & 0x7f80_0000 == 0x7f80_0000)
        });
        if any_bad != 0 {
            let (index, &value) = out
                .iter()
                .enumerate()
                .find(|(_, v)| !v.is_finite())
                .unwrap_or((0, &f32::NAN));
            return Err(Error::NotFinite { index, value });
        }
        Ok(())
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
        /// The values of the shard's key range.
        values: F32Le<'a>,
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
        grad: F32Le<'a>,
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
    let payload = F32Le(&bytes[meta_end..]);
    let has_meta = matches!(
        h.kind,
        Kind::Hello | Kind::Welcome | Kind::Error | Kind::Bye
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
            values: payload,
        },
        Kind::Push => Message::Push {
            request_id,
            shard,
            base_version: h.version,
            samples: h.aux,
            grad: payload,
        },
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
    })
}

fn frame(mut h: Header, meta: &[u8], payload: &[u8]) -> Vec<u8> {
    h.meta_len = meta.len() as u32;
    h.count = (payload.len() / 4) as u32;
    let mut out = Vec::with_capacity(HEADER_LEN + meta.len() + payload.len());
    h.write(&mut out);
    out.extend_from_slice(meta);
    out.extend_from_slice(payload);
    out
}

fn header(kind: Kind, request_id: u32, shard: u32, aux: u32, version: u64) -> Header {
    Header {
        kind,
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
            values,
        } => frame(
            header(Kind::Params, *request_id, *shard, 0, *version),
            &[],
            values.bytes(),
        ),
        Message::Push {
            request_id,
            shard,
            base_version,
            samples,
            grad,
        } => frame(
            header(Kind::Push, *request_id, *shard, *samples, *base_version),
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const LIMIT: usize = 1 << 20;

    fn all_messages(payload: &[u8]) -> Vec<Message<'_>> {
        vec![
            Message::Hello {
                request_id: 1,
                shard: 2,
                hello: Hello {
                    protocol: PROTOCOL_VERSION,
                    worker_id: 77,
                    client: ClientKind::Browser,
                },
            },
            Message::Welcome {
                request_id: 1,
                shard: 2,
                welcome: Welcome {
                    protocol: 1,
                    range: KeyRange { start: 10, end: 20 },
                    version: 5,
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
                values: F32Le(payload),
            },
            Message::Push {
                request_id: 10,
                shard: 3,
                base_version: 41,
                samples: 32,
                grad: F32Le(payload),
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

    #[test]
    fn error_codes_are_stable() {
        for v in 1..=14 {
            let c = ErrorCode::from_u32(v).unwrap();
            assert_eq!(c as u32, v);
            assert_eq!(
                serde_json::to_string(&c).unwrap(),
                format!("\"{}\"", c.name())
            );
        }
        assert!(ErrorCode::from_u32(0).is_none());
    }

    proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode(&bytes, LIMIT);
        }

        #[test]
        fn decoding_mutated_frames_never_panics(idx in 0usize..64, val in any::<u8>(), cut in 0usize..80) {
            let mut f = encode(&Message::Hello {
                request_id: 1, shard: 0,
                hello: Hello { protocol: 1, worker_id: 5, client: ClientKind::Native },
            });
            let i = idx % f.len();
            f[i] = val;
            f.truncate(cut.max(1).min(f.len()));
            let _ = decode(&f, LIMIT);
        }
    }
}
