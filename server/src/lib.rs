//! crowdgrad: the parameter server, the shard process, the native worker, the classroom
//! simulator and the benchmarks, as a library that `main.rs` (the `crowdgrad` binary) and the
//! tests call.
//!
//! # Layout
//! Roles live in folders of their own and depend one way, each on the ones above it in this
//! list only (`server/tests/layout.rs` checks it: no import cycle, no import upward):
//!
//! - [`error`]: the crate's error enum and `Result`.
//! - [`support`]: what every role uses and that knows no role: credentials and the run
//!   secret, TLS, the memory trim, datasets on disk, connection and rate limits.
//! - [`config`]: the training flags `serve`, `shard` and `sim` share ([`config::Training`]),
//!   the `serve` flags, and the TOML run file.
//! - [`registry`]: data only: the workers, their per-shard counters, the contribution ledger,
//!   and the Prometheus rendering of those counters.
//! - [`defence`]: reputation and quarantine, and the spot checker.
//! - [`shard`]: a shard's storage (lock-free snapshots over core's `ShardState`), its
//!   WebSocket handler (generic over Sink/Stream) and the axum socket adapter.
//! - [`net`]: the hardened accept loop that `serve` and `shard` both use.
//! - [`checkpoint`]: the checkpoint format, the stores (directory, S3) and the writer, over
//!   shards and a run spec, with no coordinator in sight.
//! - [`coordinator`]: the `serve` process: the shared state, the evaluator, admin, remote
//!   shards, the zeno thread and the HTTP routes.
//! - [`shardproc`]: `crowdgrad shard`, one shard in a process of its own.
//! - [`worker`]: `crowdgrad work`, the native worker driving core's sans-IO worker.
//! - [`sim`]: `crowdgrad sim`, the classroom simulator on a simulated clock.
//! - [`bench`]: end-to-end benchmarks; [`ctl`]: `crowdgrad ctl`, the admin client.
//! - [`cli`]: every command's flags (clap), so the flag reference is generated from them.

pub mod bench;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod coordinator;
pub mod ctl;
pub mod defence;
pub mod error;
pub mod net;
pub mod registry;
pub mod shard;
pub mod shardproc;
pub mod sim;
pub mod support;
pub mod worker;

pub use coordinator::{run, start, Running};
pub use error::{Error, Result};
