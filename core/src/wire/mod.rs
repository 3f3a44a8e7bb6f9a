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
//!     12    4 aux        per kind: Push = samples, Ack = staleness, Error = error code,
//!                        Params = the shard's pace in ms (0 = none; only if negotiated)
//!     16    8 version    per kind: Pull = min version, Params = shard version, Push = base
//!                        version, Ack = new version
//!     24    4 meta_len   bytes of JSON meta after the header (control messages, a spot-checked
//!                        Push's tag, a Params' samples when negotiated)
//!     28    4 count      number of values after the meta (their bytes depend on the
//!                        encoding: 4, 2, or 1 + 4/256 per value)
//! ```
//!
//! Decoding is two-step, like mini-redis' `check`/`parse`: [`Header::parse`] validates the fixed
//! part and the exact total length, [`decode`] then types the frame. Neither panics on any input.
//! Payload values are decoded and validated (length, finite values and scales) when copied
//! out with [`Payload::copy_into`]. A frame in a compressed encoding is only sent to a peer
//! that asked for it in the handshake, so version-1 peers never see a nonzero high nibble.
//!
//! # Layout
//! - `header.rs`: [`Header`], [`Kind`] and the constants ([`MAGIC`], [`HEADER_LEN`], ...).
//! - `meta.rs`: the JSON meta of control frames and pushes, and [`ErrorCode`].
//! - `message.rs`: [`Message`], [`Payload`], [`decode`], [`push_tag`].
//! - `encode.rs`: [`encode`] and the data encoders.

mod encode;
mod header;
mod message;
mod meta;

pub use encode::{
    encode, encode_error, encode_params, encode_params_as, encode_params_paced, encode_push,
    encode_push_as, encode_push_tagged, ParamsBody,
};
pub use header::{
    id_after, next_request_id, Header, Kind, HEADER_LEN, MAGIC, MAX_META_LEN, PROTOCOL_VERSION,
    WIRE_VERSION,
};
pub use message::{decode, push_tag, Message, Payload};
pub use meta::{
    Bye, ClientKind, ErrorBody, ErrorCode, Hello, ParamsMeta, PushTag, Report, Welcome,
    MAX_TAG_VERSIONS,
};
