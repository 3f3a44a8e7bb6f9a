//! The fixed 32-byte header of every frame ([`Header`], [`Kind`]) and the protocol's constants:
//! the cheap first step of decoding, [`Header::parse`].

use crate::codec::{self, Encoding};
use crate::error::{Error, Result};

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

/// The request id a requester uses after `id`: ids rise by one and wrap from `u32::MAX` to 1,
/// skipping 0, which stands for "no request" (errors about a whole connection, Bye, Report).
pub const fn next_request_id(id: u32) -> u32 {
    match id.wrapping_add(1) {
        0 => 1,
        n => n,
    }
}

/// Whether request id `id` comes after `last` on a connection whose ids rise and wrap (serial
/// number order, RFC 1982): `id` is 1 to 2^31 − 1 ids ahead of `last`, counting through the
/// wrap. So after `u32::MAX` come 1, 2, ..., while `last` itself and the 2^31 ids before it do
/// not.
pub const fn id_after(id: u32, last: u32) -> bool {
    let ahead = id.wrapping_sub(last);
    ahead != 0 && ahead < 1 << 31
}

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

    pub(super) fn write(&self, out: &mut Vec<u8>) {
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

#[cfg(test)]
mod request_id_tests {
    use super::*;

    #[test]
    fn request_ids_wrap_past_u32_max_skipping_0() {
        assert_eq!(next_request_id(1), 2);
        assert_eq!(next_request_id(u32::MAX - 1), u32::MAX);
        assert_eq!(next_request_id(u32::MAX), 1);
        assert_eq!(next_request_id(0), 1);
        for (id, last, after) in [
            (2, 1, true),
            (1, 1, false),
            (1, 2, false),
            (1, u32::MAX, true),
            (5, u32::MAX - 5, true),
            (u32::MAX, 1, false),
            (1 << 31, 1, true),
            ((1 << 31) + 1, 1, false),
        ] {
            assert_eq!(id_after(id, last), after, "{id} after {last}");
        }
    }
}
