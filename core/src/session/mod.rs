//! The shard side of the protocol as sans-IO state machines, the mirror of [`crate::worker`].
//! The server's WebSocket handler, the simulator's shard driver and the in-browser loopback are
//! thin drivers around these types: every rule of the shard side is written once, here.
//!
//! - [`ShardState`]: what the connections of one shard share: [`ShardCore`] (the one apply
//!   path), the SSP clock, the number of workers connected, and the updates applied by merged
//!   count. Its methods hold the rules that involve several connections: who counts for sync
//!   and SSP, when a sync aggregate is flushed.
//! - [`ShardSession`]: one connection. The driver feeds it decoded events (a frame arrived, the
//!   peer closed, a timer fired, the shard published an update, the server shuts down) with the
//!   time `now` in seconds on the driver's clock, and takes [`Action`]s from
//!   [`ShardSession::poll_action`]: send this frame, close, record this for the dashboard. It
//!   says when it wants to be woken with [`ShardSession::poll_timeout`].
//! - [`ShardAccess`]: how a session reaches its shard's state. The server implements it with a
//!   lock-free snapshot for reads and a writer lock for changes, the simulator and the loopback
//!   with a plain struct.
//!
//! # The rules
//! - Frames of one connection are handled strictly in order. A pull that must wait (SSP bound,
//!   sync version) holds up the frames behind it; they are kept (at most [`MAX_DEFERRED`]) and
//!   handled as soon as the pull is answered. So a worker's pull right after its own push always
//!   sees that push.
//! - Pulls never wait for pushes in `async` mode: the reply is encoded from the last published
//!   snapshot, without taking the shard's writer lock.
//! - A push is decoded once ([`wire::decode`]), then its gradient is checked for length and
//!   finiteness while it is copied into the shard's scratch buffer, and only then handed to
//!   [`ShardCore::push`]: applied whole or not at all.
//! - Every error frame echoes the request id of the frame it answers. A frame whose 32-byte
//!   header cannot be read (too short, bad magic) is answered with request id 0.
//! - Fatal errors ([`ErrorCode::is_fatal`]) send the error frame, then close the connection;
//!   the worker leaves the shard. Policy rejections (too stale, busy) keep it open.
//! - In SSP mode every frame from a worker is its heartbeat: a worker silent for longer than
//!   the heartbeat timeout stops holding the others back.
//!
//! # Sync flush decisions
//! A `sync:K` shard applies the mean of K fresh gradients. It applies fewer ("flushes") in
//! exactly three cases, decided here and nowhere else:
//! 1. a push leaves as many gradients buffered as there are workers connected: no more can come
//!    for this version;
//! 2. a worker leaves and the gradients buffered are at least the workers still connected: the
//!    same reason. While some connected worker has not pushed for this version yet, the shard
//!    keeps waiting for it. Flushing at once would apply a partial mean and then reject that
//!    worker's gradient as late, throwing away work the worker is about to deliver;
//! 3. a pull has waited [`ShardSetup::sync_timeout`] for the next version (a straggler that is
//!    connected but silent): backup-worker semantics, never a deadlock.
//!
//! A gradient buffered from a worker that then left stays in the aggregate: it was computed
//! from the current version and is as good as the others. A worker the driver expels
//! ([`ShardSession::expel`]: it was quarantined) is different: its buffered gradients are taken
//! out of the round first ([`ShardState::drop_pending`], which needs
//! [`ShardState::set_droppable`]), and only then does rule 2 look at what is left.
//!
//! # Layout
//! - `setup.rs`: [`ShardSetup`], [`ShardConfig`], [`fallbacks`], the `sync:K` round memory bound.
//! - `guard.rs`: [`PushGuard`], the checks a push's gradient passes before it is applied (a
//!   norm reference no stranger can move) and the per-worker replay log.
//! - `state.rs`: [`ShardState`], [`ShardAccess`], [`Admission`], [`SampledPush`].
//! - `conn.rs`: [`ShardSession`], [`Action`], [`Record`], [`header_request_id`].
//!
//! [`ShardCore`]: crate::shard::ShardCore
//! [`ShardCore::push`]: crate::shard::ShardCore::push
//! [`wire::decode`]: crate::wire::decode
//! [`ErrorCode::is_fatal`]: crate::wire::ErrorCode::is_fatal

pub mod active;
mod conn;
mod guard;
mod setup;
mod state;
#[cfg(test)]
mod testing;

pub use conn::{header_request_id, Action, Outgoing, Record, ShardSession, MAX_DEFERRED};
pub use guard::{
    PushGuard, ANCHOR_MAX_AGE, ANCHOR_SPAN, CLIP_SPACING, LOCKOUT, MAX_PUSHERS, NORM_HISTORY,
    NORM_MAX_AGE, NORM_WARMUP, NORM_WINDOW, PROBATION, REFUSED_HISTORY, REPLAY_DIGESTS,
    TRUST_PUSHES, TRUST_SECONDS,
};
pub use setup::{fallbacks, ShardConfig, ShardSetup, MAX_ROUND_BYTES};
pub use state::{
    Admission, SampledPush, Sampling, ShardAccess, ShardState, MAX_SOCKETS_PER_WORKER,
};
