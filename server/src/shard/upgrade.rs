//! The shard endpoint's WebSocket upgrade, done here rather than by axum's `WebSocketUpgrade`
//! so the socket is tokio-tungstenite's own stream and large frames can be sent as fragments
//! (issue 18).
//!
//! Why: tungstenite copies every message it sends into the connection's write buffer, a `Vec`
//! that keeps its capacity. Sent whole, one parameters frame (~100 KiB in bf16 for a shard of
//! the default MLP, ~200 KiB in f32) left that much memory behind in every connection for as
//! long as it lived; axum's `Message` cannot say "fragment". Here a frame larger than
//! [`FRAGMENT`] goes out as one binary WebSocket message in several frames (RFC 6455 section
//! 5.4: the receiver's WebSocket layer reassembles it, so to the protocol it is still one
//! message = one crowdgrad frame), and the write buffer never holds more than about a fragment.
//!
//! The checks are axum's (`GET`, `Connection: upgrade`, `Upgrade: websocket`,
//! `Sec-WebSocket-Version: 13`, a key, and an upgradable connection), with its messages.
//! HTTP/1.1 only: the listener serves no HTTP/2 extended CONNECT.

use axum::body::Body;
use axum::extract::FromRequestParts;
use axum::http::{header, request::Parts, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use crowdgrad_core::session::Outgoing;
use hyper_util::rt::TokioIo;
use std::future::Future;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
use tokio_tungstenite::tungstenite::protocol::frame::Frame;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

/// An upgraded shard socket.
pub type Socket = WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>;

/// Payload bytes per WebSocket frame of a message sent in fragments.
pub const FRAGMENT: usize = 16 * 1024;

/// A request to open a shard WebSocket (the extractor of the shard routes).
pub struct ShardUpgrade {
    key: HeaderValue,
    on_upgrade: hyper::upgrade::OnUpgrade,
}

impl std::fmt::Debug for ShardUpgrade {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardUpgrade").finish_non_exhaustive()
    }
}

fn has_token(headers: &HeaderMap, name: HeaderName, token: &str) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

impl<S: Send + Sync> FromRequestParts<S> for ShardUpgrade {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Response> {
        let refuse = |code: StatusCode, m: &'static str| (code, m).into_response();
        if parts.method != Method::GET {
            return Err(refuse(
                StatusCode::METHOD_NOT_ALLOWED,
                "Request method must be `GET`",
            ));
        }
        if !has_token(&parts.headers, header::CONNECTION, "upgrade") {
            return Err(refuse(
                StatusCode::BAD_REQUEST,
                "Connection header did not include 'upgrade'",
            ));
        }
        if !has_token(&parts.headers, header::UPGRADE, "websocket") {
            return Err(refuse(
                StatusCode::BAD_REQUEST,
                "`Upgrade` header did not include 'websocket'",
            ));
        }
        if !has_token(&parts.headers, header::SEC_WEBSOCKET_VERSION, "13") {
            return Err(refuse(
                StatusCode::BAD_REQUEST,
                "`Sec-WebSocket-Version` header did not include '13'",
            ));
        }
        let Some(key) = parts.headers.get(header::SEC_WEBSOCKET_KEY).cloned() else {
            return Err(refuse(
                StatusCode::BAD_REQUEST,
                "`Sec-WebSocket-Key` header missing",
            ));
        };
        let Some(on_upgrade) = parts.extensions.remove::<hyper::upgrade::OnUpgrade>() else {
            return Err(refuse(
                StatusCode::UPGRADE_REQUIRED,
                "WebSocket request couldn't be upgraded since no upgrade state was present",
            ));
        };
        Ok(Self { key, on_upgrade })
    }
}

impl ShardUpgrade {
    /// Answers `101 Switching Protocols` and, once the connection is upgraded, runs
    /// `callback` on the socket (configured by `config`) in a task of its own.
    pub fn on_upgrade<F, Fut>(self, config: WebSocketConfig, callback: F) -> Response
    where
        F: FnOnce(Socket) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let on_upgrade = self.on_upgrade;
        tokio::spawn(async move {
            let Ok(upgraded) = on_upgrade.await else {
                return;
            };
            let socket = WebSocketStream::from_raw_socket(
                TokioIo::new(upgraded),
                Role::Server,
                Some(config),
            )
            .await;
            callback(socket).await;
        });
        let accept = derive_accept_key(self.key.as_bytes());
        let mut r = Response::new(Body::empty());
        *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        let h = r.headers_mut();
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        if let Ok(v) = HeaderValue::from_str(&accept) {
            h.insert(header::SEC_WEBSOCKET_ACCEPT, v);
        }
        r
    }
}

/// `frame` as the WebSocket messages that send it: one binary message, in frames of at most
/// [`FRAGMENT`] payload bytes. The fragments are slices of the frame's buffers, not copies: a
/// `Params` frame's shared body ([`Outgoing`], encoded once per version and encoding) goes out
/// as slices of the one body every connection sends; only a fragment that straddles the
/// frame's own head and the body is put together (at most one fragment's bytes).
pub fn binary(frame: Outgoing) -> Vec<Message> {
    if frame.len() <= FRAGMENT {
        return vec![Message::Binary(frame.into_vec().into())];
    }
    let total = frame.len();
    let (head, body) = frame.into_parts();
    let head = Bytes::from(head);
    let body = body.map_or_else(Bytes::new, Bytes::from_owner);
    let n = total.div_ceil(FRAGMENT);
    (0..n)
        .map(|i| {
            let (a, b) = (i * FRAGMENT, ((i + 1) * FRAGMENT).min(total));
            let chunk = if b <= head.len() {
                head.slice(a..b)
            } else if a >= head.len() {
                body.slice(a - head.len()..b - head.len())
            } else {
                let mut v = Vec::with_capacity(b - a);
                v.extend_from_slice(&head[a..]);
                v.extend_from_slice(&body[..b - head.len()]);
                Bytes::from(v)
            };
            let op = if i == 0 {
                OpCode::Data(Data::Binary)
            } else {
                OpCode::Data(Data::Continue)
            };
            Message::Frame(Frame::message(chunk, op, i + 1 == n))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn joined(msgs: &[Message]) -> Vec<u8> {
        let mut joined = Vec::new();
        for (i, m) in msgs.iter().enumerate() {
            let Message::Frame(f) = m else {
                panic!("a raw frame")
            };
            assert_eq!(f.header().is_final, i + 1 == msgs.len());
            let op = if i == 0 { Data::Binary } else { Data::Continue };
            assert_eq!(f.header().opcode, OpCode::Data(op));
            assert!(f.payload().len() <= FRAGMENT);
            joined.extend_from_slice(f.payload());
        }
        joined
    }

    #[test]
    fn large_frames_go_out_in_fragments_that_add_up_to_the_frame() {
        assert!(matches!(&binary(vec![7; 10].into())[..], [Message::Binary(b)] if b.len() == 10));
        let frame: Vec<u8> = (0..(2 * FRAGMENT + 5)).map(|i| i as u8).collect();
        let msgs = binary(frame.clone().into());
        assert_eq!(msgs.len(), 3);
        assert_eq!(joined(&msgs), frame);
    }

    #[test]
    fn a_shared_body_goes_out_as_slices_of_itself() {
        let frame: Vec<u8> = (0..(3 * FRAGMENT + 77)).map(|i| (i * 7) as u8).collect();
        let body: std::sync::Arc<[u8]> = frame[32..].into();
        let msgs = binary(Outgoing::shared(frame[..32].to_vec(), body.clone()));
        assert_eq!(msgs.len(), 4);
        assert_eq!(joined(&msgs), frame);
        // Every fragment after the first points into the shared body: nothing copied.
        let range = body.as_ptr_range();
        for m in &msgs[1..] {
            let Message::Frame(f) = m else { panic!() };
            assert!(range.contains(&f.payload().as_ptr()));
        }
        // Small shared frames go whole.
        let small = binary(Outgoing::shared(vec![1, 2], vec![3u8, 4].into()));
        assert!(matches!(&small[..], [Message::Binary(b)] if b[..] == [1, 2, 3, 4]));
    }
}
