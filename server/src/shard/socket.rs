//! The axum side of a shard's WebSocket: upgrades a request ([`ShardUpgrade`]) to a socket of
//! bounded frame size and bounded buffers and serves it with
//! [`handler::serve`](super::handler::serve) in a tracked task. The one shard endpoint of
//! `crowdgrad serve` and of a shard process (`crowdgrad shard`).
//!
//! Memory per connection (issue 18, docs/benchmarks.md "Crowd"): a read buffer of
//! [`READ_CHUNK`](super::upgrade::READ_CHUNK) that stays that size (frames are read by our own
//! [`FrameReader`], each message into a buffer of its own length that is freed with it; with
//! tungstenite's reader the buffer grew to the largest frame read, a worker's push, and
//! stayed), and no write buffer: our own [`FrameWriter`](super::writer::FrameWriter) writes
//! each frame from its own buffers (a `Params` frame's body is shared by every connection).
//! A peer that does not read gets backpressure: a frame is taken only while less than
//! [`QUEUE`](super::writer::QUEUE) bytes wait unwritten, so the handler waits on its send
//! instead of queueing.

use super::handler::{self, Inbound};
use super::upgrade::{FrameReader, Read, ShardUpgrade, Socket};
use super::Shard;
use crate::registry::Registry;
use crate::support::limits::{client_ip, ConnSlot, Limits};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Upgrades a request that arrived through the hardened listener (`crate::net::serve`, which
/// counted its TCP connection and holds `slot` for it) to a socket of `shard` under every
/// per-connection limit of `limits`: behind `--trust-proxy` the per-IP and per-prefix
/// connection caps are taken here by the forwarded address (429 when full), and the handler
/// enforces the push rates (per connection and per IP) and the Hello and idle deadlines, and
/// gives the slot's unauthenticated places back once the worker's Hello is admitted
/// ([`ConnSlot::authenticated`]). `crowdgrad serve` and `crowdgrad shard` both serve their
/// shard endpoints through this.
#[allow(clippy::too_many_arguments)] // the two handles and the request's three parts
pub fn limited_socket(
    upgrade: ShardUpgrade,
    shard: Shard,
    registry: Registry,
    shutdown: tokio::sync::watch::Receiver<bool>,
    tracker: tokio_util::task::TaskTracker,
    limits: &Arc<Limits>,
    peer: SocketAddr,
    headers: &HeaderMap,
    slot: Arc<ConnSlot>,
) -> Response {
    let trust_proxy = limits.cfg.trust_proxy;
    let ip = client_ip(headers, peer, trust_proxy);
    if trust_proxy {
        match limits.unauthenticated(None, Some(ip)) {
            Ok(places) => slot.hold(places),
            Err(why) => {
                let mut r = (
                    StatusCode::TOO_MANY_REQUESTS,
                    axum::Json(serde_json::json!({ "error": why.reply().1 })),
                )
                    .into_response();
                let secs = Duration::from_secs(1).as_secs();
                r.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(secs));
                return r;
            }
        }
    }
    let conn = handler::ConnLimits {
        limits: limits.clone(),
        ip,
        slot: Some(slot.clone()),
    };
    shard_socket_with(
        upgrade,
        shard,
        registry,
        shutdown,
        tracker,
        slot,
        Some(conn),
    )
}

/// Upgrades `upgrade` to a connection to `shard`, served by [`handler::serve`] in a task
/// tracked by `tracker` and holding `permit` until it ends: the one shard endpoint of
/// `crowdgrad serve` and of a shard process (`crowdgrad shard`).
pub fn shard_socket(
    upgrade: ShardUpgrade,
    shard: Shard,
    registry: Registry,
    shutdown: tokio::sync::watch::Receiver<bool>,
    tracker: tokio_util::task::TaskTracker,
    permit: tokio::sync::OwnedSemaphorePermit,
) -> Response {
    shard_socket_with(upgrade, shard, registry, shutdown, tracker, permit, None)
}

/// [`shard_socket`] holding `held` (connection slots) until the socket ends, with `conn`'s
/// per-connection limits (push rates, Hello and idle deadlines; `None`: default deadlines, no
/// rate limits).
pub fn shard_socket_with(
    upgrade: ShardUpgrade,
    shard: Shard,
    registry: Registry,
    shutdown: tokio::sync::watch::Receiver<bool>,
    tracker: tokio_util::task::TaskTracker,
    held: impl Send + 'static,
    conn: Option<handler::ConnLimits>,
) -> Response {
    // The largest frame the shard takes (a full f32 push: the largest encoding) plus a little,
    // so a frame slightly over still reaches the session and gets its `oversize` error frame;
    // anything larger is cut off by the WebSocket layer, which closes the socket.
    let limit = shard.frame_limit() + OVERSIZE_SLACK;
    upgrade.on_upgrade(limit, limit, move |socket| {
        tracker.track_future(async move {
            connection(socket, shard, registry, shutdown, conn).await;
            drop(held);
        })
    })
}

/// Bytes past a shard's frame limit that still get an `oversize` error frame.
pub const OVERSIZE_SLACK: usize = 64 * 1024;

async fn connection(
    socket: Socket,
    shard: Shard,
    registry: Registry,
    shutdown: tokio::sync::watch::Receiver<bool>,
    conn: Option<handler::ConnLimits>,
) {
    // A client's Ping is answered ahead of the next frame the server sends (crowdgrad's
    // workers and browsers send none; the reader only reads).
    let Socket {
        reader,
        writer,
        pong,
    } = socket;
    let stream = shard_stream(reader, pong);
    handler::serve(
        Box::pin(writer),
        Box::pin(stream),
        shard,
        registry,
        shutdown,
        conn,
    )
    .await;
}

/// The frames of `reader` as the handler's [`Inbound`]s: binary messages, text, and one
/// `Closed` when the peer closes, breaks the protocol or goes over a limit (then the stream
/// ends). A Ping's payload is left in `pong` for the writer.
pub fn shard_stream<R>(
    reader: FrameReader<R>,
    pong: Arc<Mutex<Option<Bytes>>>,
) -> impl futures_util::Stream<Item = Inbound> + Send
where
    R: tokio::io::AsyncRead + Unpin + Send,
{
    futures_util::stream::unfold(Some(reader), move |reader| {
        let pong = pong.clone();
        async move {
            let mut reader = reader?;
            loop {
                match reader.next().await {
                    Ok(Read::Binary(b)) => return Some((Inbound::Frame(b), Some(reader))),
                    Ok(Read::Text) => return Some((Inbound::Text, Some(reader))),
                    Ok(Read::Ping(p)) => {
                        if let Ok(mut slot) = pong.lock() {
                            *slot = Some(p);
                        }
                    }
                    Ok(Read::Close) | Err(_) => return Some((Inbound::Closed, None)),
                }
            }
        }
    })
}
