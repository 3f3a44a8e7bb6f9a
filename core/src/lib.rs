//! crowdgrad-core: everything both sides of the wire share, with no I/O and no runtime, so it
//! builds natively and for `wasm32-unknown-unknown`.
//!
//! # Layout
//! - [`model`]: [`model::ModelSpec`], [`model::Model`] (forward/backward over a flat vector),
//!   [`model::ParamLayout`].
//! - [`optim`]: update rules ([`optim::step`]) over slices with explicit [`optim::OptState`].
//! - [`schedule`]: learning-rate warmup and decay ([`schedule::Schedule`]), positioned by the
//!   shard's version, or under `auto` local steps by the samples the shards applied.
//! - [`partition`]: [`partition::KeyRange`], [`partition::partition`], [`partition::Slicer`].
//! - [`wire`]: frames, [`wire::decode`] / [`wire::encode`]; spec in docs/protocol.md.
//! - [`codec`]: payload encodings ([`codec::Encoding`]: f32, bf16, int8 blocks) and
//!   [`codec::ErrorFeedback`].
//! - [`data`]: IDX parsing, [`data::Dataset`], [`data::BatchSampler`].
//! - [`eval`]: [`eval::evaluate`], loss and accuracy of parameters on a dataset.
//! - [`spec`]: the run spec and join messages.
//! - [`worker`]: the sans-IO [`worker::Worker`] state machine.
//! - [`shard`]: [`shard::ShardCore`] (the one apply path), consistency modes, staleness
//!   policies and the SSP clock.
//! - [`backoff`]: [`backoff::Backoff`], the one reconnect backoff (start, cap, doubling, jitter)
//!   every worker and the simulator use.
//! - [`session`]: the shard side of the protocol as sans-IO state machines:
//!   [`session::ShardState`] (what a shard's connections share) and [`session::ShardSession`]
//!   (one connection), driven by the server, the simulator and the loopback.
//! - [`local`]: [`local::LocalSteps`] (inner steps per push) and the controller that picks
//!   them ([`local::Controller`]).
//! - [`rng`]: the deterministic PRNG everything seeds from.
//! - [`fault`]: faulty workers for experiments ([`fault::Fault`], [`fault::Faults`]), one
//!   implementation for the simulator and `crowdgrad work --fault`.
//! - [`robust`]: robust aggregation for untrusted volunteers ([`robust::Aggregation`]:
//!   coordinate-wise median, trimmed mean, (Multi-)Krum in `sync:K`; the consensus filter in
//!   async).

pub mod backoff;
pub mod codec;
pub mod data;
pub mod error;
pub mod eval;
pub mod fault;
pub mod local;
pub mod model;
pub mod optim;
pub mod partition;
pub mod rng;
pub mod robust;
pub mod schedule;
pub mod session;
pub mod shard;
pub mod spec;
pub mod wire;
pub mod worker;

pub use error::{Error, Result};
