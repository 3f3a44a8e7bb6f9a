//! The JSON meta of control frames ([`Hello`], [`Welcome`], [`Report`], [`ErrorBody`],
//! [`Bye`]) and of tagged pushes ([`PushTag`]), and the error codes ([`ErrorCode`]).

use super::PROTOCOL_VERSION;
use crate::codec::Encoding;
use crate::error::Error;
use crate::partition::KeyRange;
use serde::{Deserialize, Serialize};

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
    /// The worker honours a shard's pace (issue 18, docs/protocol.md "Pacing"): it reads the
    /// pace from each `Params` header's `aux` and waits that long between batches of pulls
    /// (absent: false; the shard then leaves `aux` 0).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pacing: bool,
    /// The worker reads the samples a shard applied from each `Params` meta ([`ParamsMeta`];
    /// docs/protocol.md "Samples"): what a learning-rate schedule under `auto` local steps is
    /// positioned by (absent: false; such a run's shards then refuse the Hello).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub samples: bool,
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
            pacing: false,
            samples: false,
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
    /// The shard paces this connection (its Hello had `pacing` and the run has an egress
    /// budget): every `Params` header's `aux` carries the shard's pace in milliseconds (absent:
    /// false; `aux` is then 0 and means nothing).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paces: bool,
    /// Every `Params` on this connection carries a [`ParamsMeta`] (its Hello had `samples`;
    /// absent: false, `Params` then carry no meta).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub samples: bool,
}

/// Meta of a `Params` to a connection whose Welcome had `samples`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamsMeta {
    /// Samples in the updates the shard had applied when it was read (a push counts its
    /// header's `aux`; a `sync:K` round, its pushes together). Never decreases.
    pub samples: u64,
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
    /// A push whose request id does not come after the connection's last push (in the wrapping
    /// order of [`crate::wire::id_after`]): a replay (not fatal).
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
