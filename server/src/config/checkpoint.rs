//! The checkpoint policy as the flags give it (`crate::checkpoint` writes and reads them).

use std::time::Duration;

/// Checkpoint policy (`--checkpoint-dir`, `--checkpoint-every`, `--checkpoint-keep`,
/// `--reshard`).
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointConfig {
    /// A directory, or `s3://bucket/prefix`.
    pub location: String,
    /// Time between periodic checkpoints.
    pub every: Duration,
    /// Checkpoints kept (older ones are deleted after each write).
    pub keep: usize,
    /// Accept a checkpoint of another shard count and re-cut it.
    pub reshard: bool,
}
