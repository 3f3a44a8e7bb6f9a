//! The shard endpoint's WebSocket upgrade, done here rather than by axum's `WebSocketUpgrade`
//! so the socket's frames are read by our own [`FrameReader`] and written by our own
//! [`FrameWriter`] (issue 18: each keeps no buffer the size of the largest frame, and a
//! parameters frame goes out as slices of the body every connection shares).
//!
//! The checks are axum's (`GET`, `Connection: upgrade`, `Upgrade: websocket`,
//! `Sec-WebSocket-Version: 13`, a key, and an upgradable connection), with its messages.
//! HTTP/1.1 only: the listener serves no HTTP/2 extended CONNECT.

use axum::body::Body;
use axum::extract::FromRequestParts;
use axum::http::{header, request::Parts, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use hyper_util::rt::TokioIo;
use std::future::Future;
use std::sync::{Arc, Mutex};
use tokio::io::{ReadHalf, WriteHalf};
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;

pub use super::writer::{FrameWriter, FRAGMENT};

/// The upgraded connection.
type Upgraded = TokioIo<hyper::upgrade::Upgraded>;

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
    /// `callback` on the socket, whose reader refuses a frame over `max_frame` or a message
    /// over `max_message` payload bytes, in a task of its own.
    pub fn on_upgrade<F, Fut>(self, max_frame: usize, max_message: usize, callback: F) -> Response
    where
        F: FnOnce(Socket) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let on_upgrade = self.on_upgrade;
        tokio::spawn(async move {
            let Ok(upgraded) = on_upgrade.await else {
                return;
            };
            let (read, write) = tokio::io::split(TokioIo::new(upgraded));
            let pong = Arc::default();
            let writer = FrameWriter::new(write, Arc::clone(&pong));
            let reader = FrameReader::new(read, max_frame, max_message);
            callback(Socket {
                reader,
                writer,
                pong,
            })
            .await;
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

pub use super::frames::{FrameReader, Read, ReadError, READ_CHUNK};

/// An upgraded shard socket's two halves.
pub struct Socket {
    /// Reads the client's frames.
    pub reader: FrameReader<ReadHalf<Upgraded>>,
    /// Writes the server's frames.
    pub writer: FrameWriter<WriteHalf<Upgraded>>,
    /// A Ping's payload, left by whoever reads the reader's frames for the writer to answer
    /// ahead of its next frame.
    pub pong: Arc<Mutex<Option<Bytes>>>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
    use tokio_tungstenite::tungstenite::protocol::frame::Frame;
    use tokio_tungstenite::tungstenite::protocol::Role;
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::WebSocketStream;

    /// A client frame as RFC 6455 lays it out, masked with `mask`.
    fn client_frame(fin: bool, opcode: u8, payload: &[u8], mask: [u8; 4]) -> Vec<u8> {
        let mut f = vec![if fin { 0x80 } else { 0 } | opcode];
        match payload.len() {
            n if n < 126 => f.push(0x80 | n as u8),
            n if n < 65_536 => {
                f.push(0x80 | 126);
                f.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                f.push(0x80 | 127);
                f.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        f.extend_from_slice(&mask);
        f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        f
    }

    async fn read_all(bytes: &[u8], max: usize) -> Vec<std::result::Result<Read, String>> {
        let mut r = FrameReader::new(bytes, max, max);
        let mut out = Vec::new();
        loop {
            match r.next().await {
                Ok(Read::Close) => {
                    out.push(Ok(Read::Close));
                    break;
                }
                Ok(m) => out.push(Ok(m)),
                Err(e) => {
                    out.push(Err(format!("{e:?}")));
                    break;
                }
            }
            assert_eq!(r.buf.len(), READ_CHUNK, "the read buffer keeps its size");
        }
        out
    }

    #[tokio::test]
    async fn the_reader_takes_what_a_tungstenite_client_sends() {
        use futures_util::SinkExt;
        let (client_io, server_io) = tokio::io::duplex(1 << 16);
        let big: Vec<u8> = (0..200_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let small = b"pull".to_vec();
        let sent = big.clone();
        let client = tokio::spawn(async move {
            let mut ws = WebSocketStream::from_raw_socket(client_io, Role::Client, None).await;
            ws.send(Message::Binary(sent.into())).await.unwrap();
            ws.send(Message::Ping(vec![1, 2, 3].into())).await.unwrap();
            ws.send(Message::Text("not the protocol".into()))
                .await
                .unwrap();
            ws.send(Message::Binary(small.into())).await.unwrap();
            // A message in fragments with a Ping between them (RFC 6455 5.4).
            for m in [
                Message::Frame(Frame::message(
                    vec![7u8; 10],
                    OpCode::Data(Data::Binary),
                    false,
                )),
                Message::Ping(vec![9].into()),
                Message::Frame(Frame::message(
                    vec![8u8; 5],
                    OpCode::Data(Data::Continue),
                    true,
                )),
            ] {
                ws.send(m).await.unwrap();
            }
            ws.close(None).await.unwrap();
            ws
        });
        let mut r = FrameReader::new(server_io, 1 << 20, 1 << 20);
        assert_eq!(r.next().await.unwrap(), Read::Binary(big.into()));
        assert_eq!(r.next().await.unwrap(), Read::Ping(vec![1, 2, 3].into()));
        assert_eq!(r.next().await.unwrap(), Read::Text);
        assert_eq!(
            r.next().await.unwrap(),
            Read::Binary(b"pull".to_vec().into())
        );
        assert_eq!(r.next().await.unwrap(), Read::Ping(vec![9].into()));
        let mut joined = vec![7u8; 10];
        joined.extend([8u8; 5]);
        assert_eq!(r.next().await.unwrap(), Read::Binary(joined.into()));
        assert_eq!(r.next().await.unwrap(), Read::Close);
        assert_eq!(r.buf.len(), READ_CHUNK);
        drop(client.await.unwrap());
    }

    #[tokio::test]
    async fn the_reader_refuses_what_a_client_may_not_send_and_bounds_sizes() {
        let m = [1, 2, 3, 4];
        let err = |v: &[std::result::Result<Read, String>], what: &str| matches!(v.last(), Some(Err(e)) if e.contains(what));
        // Unmasked.
        let mut f = client_frame(true, 2, b"abc", m);
        f[1] &= 0x7f;
        f.drain(2..6);
        assert!(err(&read_all(&f, 100).await, "unmasked"));
        // Reserved bits, reserved opcode, a long or fragmented control frame.
        let mut f = client_frame(true, 2, b"abc", m);
        f[0] |= 0x40;
        assert!(err(&read_all(&f, 100).await, "reserved bits"));
        assert!(err(
            &read_all(&client_frame(true, 3, b"x", m), 100).await,
            "reserved opcode"
        ));
        assert!(err(
            &read_all(&client_frame(true, 9, &[0; 126], m), 1000).await,
            "control"
        ));
        assert!(err(
            &read_all(&client_frame(false, 9, b"x", m), 100).await,
            "control"
        ));
        // Continuations out of place.
        assert!(err(
            &read_all(&client_frame(true, 0, b"x", m), 100).await,
            "continuation"
        ));
        let mut f = client_frame(false, 2, b"x", m);
        f.extend(client_frame(true, 2, b"y", m));
        assert!(err(&read_all(&f, 100).await, "inside a fragmented"));
        // A frame over the limit, and a message whose fragments add up over it.
        assert!(err(
            &read_all(&client_frame(true, 2, &[0; 101], m), 100).await,
            "TooLarge"
        ));
        let mut f = client_frame(false, 2, &[0; 60], m);
        f.extend(client_frame(true, 0, &[0; 60], m));
        assert!(err(&read_all(&f, 100).await, "TooLarge(120)"));
        // The stream ending between frames is a close; inside one, an error.
        let f = client_frame(true, 2, &[5; 5000], m);
        let v = read_all(&f, 10_000).await;
        assert_eq!(v[0], Ok(Read::Binary(vec![5; 5000].into())));
        assert_eq!(v[1], Ok(Read::Close));
        assert!(err(&read_all(&f[..3000], 10_000).await, "UnexpectedEof"));
        assert!(err(&read_all(&f[..5], 10_000).await, "UnexpectedEof"));
        // Every length encoding, every alignment of the mask.
        for n in [
            0, 1, 7, 8, 9, 125, 126, 127, 4095, 4096, 65_535, 65_536, 70_001,
        ] {
            let payload: Vec<u8> = (0..n).map(|i| (i % 253) as u8).collect();
            let v = read_all(&client_frame(true, 2, &payload, [9, 8, 7, 6]), 1 << 20).await;
            assert_eq!(v[0], Ok(Read::Binary(payload.into())), "{n} bytes");
        }
    }

    /// Found by the `reader` fuzz target (fuzz/, docs/fuzzing.md): a fragment, then a
    /// continuation whose 64-bit length is 2^64 - 1. The size in the error was `before + len`,
    /// which overflowed (a panic with overflow checks, a wrapped size without).
    #[tokio::test]
    async fn regression_a_continuation_claiming_2_pow_64_bytes_is_too_large_without_overflow() {
        let m = [1, 2, 3, 4];
        let mut f = client_frame(false, 2, b"ab", m);
        f.extend([0x80, 0x80 | 127]);
        f.extend(u64::MAX.to_be_bytes());
        f.extend(m);
        let v = read_all(&f, 100).await;
        assert_eq!(
            v.last(),
            Some(&Err(format!("{:?}", ReadError::TooLarge(u64::MAX))))
        );
    }

    /// Found by the `reader` fuzz target's memory check: a message in fragments grew its
    /// buffer by doubling (`BytesMut::reserve`), 3,000 + 2,000 bytes taking 6,000 under a
    /// 5,008-byte limit. Each fragment now adds exactly its length.
    #[tokio::test]
    async fn regression_a_message_in_fragments_takes_exactly_its_length() {
        let m = [1, 2, 3, 4];
        let mut f = client_frame(false, 2, &[7; 3000], m);
        f.extend(client_frame(false, 0, &[8; 2000], m));
        f.extend(client_frame(true, 9, b"p", m));
        let mut r = FrameReader::new(&f[..], 4096, 5008);
        assert_eq!(r.next().await.unwrap(), Read::Ping(b"p".to_vec().into()));
        let (_, message) = r.partial.as_ref().expect("the message so far");
        assert_eq!((message.len(), message.capacity()), (5000, 5000));
    }
}
