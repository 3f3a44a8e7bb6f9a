//! The core crate's single error type.

use thiserror::Error;

/// Everything that can go wrong in `crowdgrad-core`. Every variant is a value a caller can
/// report; nothing in this crate panics on input that came from a file or the network.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum Error {
    /// A wire frame was malformed (too short, bad magic, inconsistent lengths, bad meta JSON...).
    #[error("malformed frame: {0}")]
    Malformed(String),
    /// A frame announced a wire format version this build does not speak.
    #[error("unsupported wire version {got} (this build speaks {expected})")]
    WireVersion {
        /// Version found in the frame.
        got: u8,
        /// Version this build speaks.
        expected: u8,
    },
    /// A frame carried a kind byte that is not defined.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// A frame is larger than the receiver accepts.
    #[error("frame of {size} bytes exceeds the limit of {limit} bytes")]
    Oversize {
        /// Size of the offending frame in bytes.
        size: usize,
        /// Largest accepted frame.
        limit: usize,
    },
    /// A payload had the wrong number of values.
    #[error("wrong payload length: expected {expected} values, got {got}")]
    WrongLength {
        /// What the receiver needed.
        expected: usize,
        /// What arrived.
        got: usize,
    },
    /// A payload contained NaN or an infinity.
    #[error("payload value {index} is not finite ({value})")]
    NotFinite {
        /// Index of the first bad value.
        index: usize,
        /// The value itself.
        value: f32,
    },
    /// The peer speaks a different protocol version.
    #[error("protocol version mismatch: peer speaks {got}, this build speaks {expected}")]
    ProtocolVersion {
        /// Peer's version.
        got: u32,
        /// Our version.
        expected: u32,
    },
    /// A message arrived that is not valid in the current state.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// A dataset file could not be parsed.
    #[error("bad dataset: {0}")]
    Data(String),
    /// A configuration value is out of range.
    #[error("invalid config: {0}")]
    Config(String),
}

/// `Result` with the core [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
