//! The wire protocol: one WebSocket binary message is one frame, a fixed 32-byte little-endian
//! header, then `meta_len` bytes of UTF-8 JSON (control messages only), then `count` raw
//! little-endian f32 values (data messages only). docs/protocol.md is the full specification.
//!
//! ```text
//! offset size field
//!      0    2 magic      b"CG"
//!      2    1 wire       wire format version (1)
//!      3    1 kind       low 4 bits: message kind (see Kind); high 4 bits: the payload
//!                        encoding of Params/Push (0 = f32, 1 = bf16, 2 = int8 blocks of 256,
//!                        see crate::codec), 0 for every other kind
//!      4    4 request_id echoed by the reply
//!      8    4 shard      shard the frame is for / from
//!     12    4 aux        per kind: Push = samples, Ack = staleness, Error = error code
//!     16    8 version    per kind: Pull = min version, Params = shard version, Push = base
//!                        version, Ack = new version
//!     24    4 meta_len   bytes of JSON meta after the header
//!     28    4 count      number of values after the meta (their bytes depend on the
//!                        encoding: 4, 2, or 1 + 4/256 per value)
//! ```
//!
//! Decoding is two-step, like mini-redis' `check`/`parse`: [`Header::parse`] validates the fixed
//! part and the exact total length, [`decode`] then types the frame. Neither panics on any input.
//! Payload values are decoded and validated (length, finite values and scales) when copied
//! out with [`Payload::copy_into`]. A frame in a compressed encoding is only sent to a peer
//! that asked for it in the handshake, so version-1 peers never see a nonzero high nibble.

use crate::codec::{self, Encoding, ErrorFeedback};
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
    /// worker → shard: what the worker measured (only to a shard whose Welcome asked).
    Report = 9,
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
            9 => Kind::Report,
            other => return Err(Error::UnknownKind(other)),
        })
    }
}

/// The fixed header of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Message kind.
    pub kind: Kind,
    /// Payload encoding (Params and Push; [`Encoding::F32`] for every other kind).
    pub encoding: Encoding,
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
    /// Values following the meta.
    pub count: u32,
}

/// The wire id of an encoding (the kind byte's high nibble).
fn encoding_nibble(e: Encoding) -> u8 {
    e.id()
}

fn encoding_from_nibble(n: u8) -> Result<Encoding> {
    Encoding::from_id(n, codec::DEFAULT_INT8_BLOCK)
}

impl Header {
    /// Total frame length this header announces.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN
            .saturating_add(self.meta_len as usize)
            .saturating_add(self.encoding.encoded_len(self.count as usize))
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
        let kind = Kind::from_u8(bytes[3] & 0x0f).map_err(|_| Error::UnknownKind(bytes[3]))?;
        let encoding = match bytes[3] >> 4 {
            0 => Encoding::F32,
            n if matches!(kind, Kind::Params | Kind::Push) => encoding_from_nibble(n)
                .map_err(|_| Error::Malformed(format!("unknown payload encoding {n}")))?,
            _ => return Err(Error::UnknownKind(bytes[3])),
        };
        let h = Header {
            kind,
            encoding,
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
        // u64 arithmetic: the payload length of a u32 count cannot overflow.
        let payload = match h.encoding {
            Encoding::F32 => 4 * u64::from(h.count),
            Encoding::Bf16 => 2 * u64::from(h.count),
            Encoding::Int8Block { block } => {
                u64::from(h.count) + 4 * u64::from(h.count).div_ceil(u64::from(block.max(1)))
            }
        };
        let announced = HEADER_LEN as u64 + u64::from(h.meta_len) + payload;
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
        out.push(self.kind as u8 | (encoding_nibble(self.encoding) << 4));
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

/// Meta of a `Hello`. Fields after `client` were added after protocol version 1 shipped: a
/// receiver takes their absence as the version-1 behaviour.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Protocol version the worker speaks ([`PROTOCOL_VERSION`]).
    pub protocol: u32,
    /// Worker id handed out by `/api/join`.
    pub worker_id: u64,
    /// Kind of client.
    #[serde(default)]
    pub client: ClientKind,
    /// Encodings the worker can decode in `Params`; empty means f32 only. Unknown names are
    /// skipped.
    #[serde(
        default,
        deserialize_with = "crate::codec::known_encodings",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub pull_encodings: Vec<Encoding>,
    /// Encodings the worker can send in `Push`; empty means f32 only.
    #[serde(
        default,
        deserialize_with = "crate::codec::known_encodings",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub push_encodings: Vec<Encoding>,
    /// The session credential from the join reply, proving the worker id is this worker's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential: Option<String>,
}

impl Default for Hello {
    /// A version-1 Hello from worker 0 (fill in the rest with struct update syntax).
    fn default() -> Self {
        Self {
            protocol: PROTOCOL_VERSION,
            worker_id: 0,
            client: ClientKind::Native,
            pull_encodings: Vec::new(),
            push_encodings: Vec::new(),
            credential: None,
        }
    }
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
    /// The encoding of this connection's `Params` (absent: f32).
    #[serde(default, skip_serializing_if = "is_f32")]
    pub pull_encoding: Encoding,
    /// The encoding this connection's `Push` frames must use (absent: f32).
    #[serde(default, skip_serializing_if = "is_f32")]
    pub push_encoding: Encoding,
    /// The shard takes `Report` frames (absent: false; never send one then).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reports: bool,
    /// The shard spot-checks pushes: every `Push` on this connection must carry a
    /// [`PushTag`] meta saying where its batches came from (absent: false; send none then).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub spot_checks: bool,
}

/// Meta of a `Push` to a shard whose Welcome had `spot_checks`: what the server needs to
/// recompute the push ([docs/protocol.md](../../docs/protocol.md), "Spot checks").
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushTag {
    /// Index of the round's first batch in the worker's batch sequence
    /// ([`crate::data::BatchSampler`] seeded from the run seed and the worker id): batches
    /// the worker drew before this round. The round's `H = samples / batch_size` batches
    /// follow it.
    pub batch: u64,
    /// The shard versions the round's parameters were read at, one per shard in shard order
    /// (the push's own shard's is its header's base version).
    pub versions: Vec<u64>,
}

/// Most shard versions a [`PushTag`] may list (the most shards a run may have).
pub const MAX_TAG_VERSIONS: usize = 256;

fn is_f32(e: &Encoding) -> bool {
    *e == Encoding::F32
}

/// Meta of a `Report`: what a worker measured about itself since it joined, for the dashboard.
/// Sent at most once a second, on shard 0 only, and only when its Welcome had `reports`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Inner steps per push the worker uses now (1 for gradient pushes).
    pub local_steps: u32,
    /// Seconds spent computing.
    pub compute_s: f64,
    /// Seconds since the session started (computing + waiting).
    pub wall_s: f64,
    /// Mean exchange latency (pulls out to parameters in), seconds; 0 before the first.
    #[serde(default)]
    pub exchange_s: f64,
    /// Bytes the worker sent on all its shard connections.
    pub bytes_up: u64,
    /// Bytes the worker received on all its shard connections.
    pub bytes_down: u64,
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
    /// A Hello's credential is missing or not the worker's own (fatal).
    Unauthorized = 15,
    /// A push outside the shard's bounds: a value too large, a norm far above the recent
    /// ones, or more samples than a round can have (not fatal).
    OutOfBounds = 16,
    /// A push whose request id is not above the connection's last push: a replay (not fatal).
    Replayed = 17,
    /// A push refused by the run's robust aggregation (`--aggregation consensus`): its
    /// direction disagrees with the recent consensus of accepted pushes (not fatal).
    Disagrees = 18,
    /// The worker is quarantined (a push failed a spot check, or it kept sending refused
    /// frames): its connections are closed and its Hellos refused (fatal).
    Quarantined = 19,
}

impl ErrorCode {
    /// Whether the server closes the connection after sending this error.
    pub fn is_fatal(self) -> bool {
        !matches!(
            self,
            ErrorCode::TooStale
                | ErrorCode::Busy
                | ErrorCode::OutOfBounds
                | ErrorCode::Replayed
                | ErrorCode::Disagrees
        )
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
            Unauthorized,
            OutOfBounds,
            Replayed,
            Disagrees,
            Quarantined,
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
            Unauthorized => "unauthorized",
            OutOfBounds => "out_of_bounds",
            Replayed => "replayed",
            Disagrees => "disagrees",
            Quarantined => "quarantined",
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
        Kind::Hello | Kind::Welcome | Kind::Error | Kind::Bye | Kind::Report | Kind::Push
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
    let h = Header {
        encoding,
        count: u32::try_from(values.len())
            .map_err(|_| Error::Malformed("payload of more than 2^32 values".into()))?,
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
    encode_data(
        Kind::Params,
        encoding,
        request_id,
        shard,
        0,
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
            values,
        } => frame(
            Header {
                encoding: values.encoding(),
                count: values.len() as u32,
                ..header(Kind::Params, *request_id, *shard, 0, *version)
            },
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

    #[test]
    fn error_codes_are_stable() {
        for v in 1..=17 {
            let c = ErrorCode::from_u32(v).unwrap();
            assert_eq!(c as u32, v);
            assert_eq!(
                serde_json::to_string(&c).unwrap(),
                format!("\"{}\"", c.name())
            );
        }
        assert!(ErrorCode::from_u32(0).is_none());
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
