//! The shard socket's own WebSocket frame writer (issue 18): the server's frames (RFC 6455,
//! unmasked) written with vectored writes straight from the frame's buffers, copying nothing.
//!
//! Why: tungstenite copies every message it sends into the connection's write buffer, a `Vec`
//! that keeps its capacity. Sent whole, one parameters frame (~100 KiB in bf16 for a shard of
//! the default MLP) left that much memory behind in every connection; sent in 16 KiB
//! fragments to keep the buffer small, each fragment was its own write, and a pull at H = 1
//! cost about 15% of the end-to-end rate (docs/benchmarks.md, "End to end before and after
//! issue 18"). Here a frame is queued as slices of its own buffers (a `Params` frame's body is
//! the one shared by every connection, [`Outgoing`](crowdgrad_core::session::Outgoing)) behind a header of at most 10 bytes, and
//! goes out in as few `writev` calls as the socket takes. A connection keeps no write buffer
//! between frames.
//!
//! A message over [`FRAGMENT`] bytes goes out in fragments of that size (RFC 6455 section
//! 5.4; the receiver's WebSocket layer reassembles them, so to the protocol it is still one
//! message = one crowdgrad frame): a client library's frame limit (tungstenite's default is
//! 16 MiB) does not limit the model.
//!
//! Backpressure: a frame is taken only while less than [`QUEUE`] bytes wait ([`Sink::poll_ready`]
//! writes first), so a peer that does not read holds its handler on its send instead of
//! growing a queue; at most one frame beyond that bound waits.

use super::handler::Outbound;
use bytes::{Buf, Bytes};
use futures_util::Sink;
use std::collections::VecDeque;
use std::io::IoSlice;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use tokio::io::AsyncWrite;

/// Payload bytes per WebSocket frame of a message sent in fragments.
pub const FRAGMENT: usize = 1 << 20;

/// Bytes that may wait unwritten before [`FrameWriter`] takes another frame: small replies
/// (acks, errors) queue up to this and leave together at the flush.
pub const QUEUE: usize = 16 * 1024;

/// Slices handed to one `writev` (Linux takes at most 1,024).
const SLICES: usize = 64;

const BINARY: u8 = 0x2;
const CONTINUATION: u8 = 0x0;
const CLOSE: u8 = 0x8;
const PONG: u8 = 0xA;

/// RFC 6455 section 5.2's header of an unmasked frame: FIN, opcode and payload length.
fn header(fin: bool, opcode: u8, len: usize) -> Bytes {
    let mut h = Vec::with_capacity(10);
    h.push(if fin { 0x80 } else { 0 } | opcode);
    match len {
        n if n < 126 => h.push(n as u8),
        n if n < 65_536 => {
            h.push(126);
            h.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            h.push(127);
            h.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    Bytes::from(h)
}

/// Writes a shard socket's frames to `io`. A Ping's payload left in `pong` (by the socket's
/// reader) is answered with a Pong ahead of the next frame sent.
pub struct FrameWriter<W> {
    io: W,
    /// Bytes to write, in order: headers and slices of the frames' own buffers.
    queue: VecDeque<Bytes>,
    /// Their total length.
    queued: usize,
    pong: Arc<Mutex<Option<Bytes>>>,
    /// A Close frame was queued: anything after it is refused.
    closed: bool,
}

impl<W: AsyncWrite + Unpin> FrameWriter<W> {
    /// A writer to `io` that answers the Ping payload left in `pong` (by the socket's reader).
    pub fn new(io: W, pong: Arc<Mutex<Option<Bytes>>>) -> Self {
        FrameWriter {
            io,
            queue: VecDeque::new(),
            queued: 0,
            pong,
            closed: false,
        }
    }

    fn push(&mut self, b: Bytes) {
        if !b.is_empty() {
            self.queued += b.len();
            self.queue.push_back(b);
        }
    }

    /// Queues one message as frames of at most [`FRAGMENT`] payload bytes, their payloads
    /// slices of `parts` (no copy).
    fn message(&mut self, opcode: u8, parts: [Bytes; 2]) {
        let total: usize = parts.iter().map(Bytes::len).sum();
        let mut parts = parts.into_iter().filter(|p| !p.is_empty());
        let mut part = parts.next().unwrap_or_default();
        let mut sent = 0;
        let mut first = true;
        loop {
            let n = (total - sent).min(FRAGMENT);
            let fin = sent + n == total;
            self.push(header(fin, if first { opcode } else { CONTINUATION }, n));
            let mut left = n;
            while left > 0 {
                if part.is_empty() {
                    part = parts.next().unwrap_or_default();
                    if part.is_empty() {
                        break;
                    }
                }
                let take = left.min(part.len());
                self.push(part.split_to(take));
                left -= take;
            }
            sent += n;
            first = false;
            if fin {
                break;
            }
        }
    }

    /// Writes the queue out, in as few vectored writes as the socket takes.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        while !self.queue.is_empty() {
            let n = {
                let mut slices = [IoSlice::new(&[]); SLICES];
                let mut k = 0;
                for (s, b) in slices.iter_mut().zip(&self.queue) {
                    *s = IoSlice::new(b);
                    k += 1;
                }
                ready!(Pin::new(&mut self.io).poll_write_vectored(cx, &slices[..k]))?
            };
            if n == 0 {
                return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
            }
            self.queued -= n;
            let mut n = n;
            while n > 0 {
                let Some(front) = self.queue.front_mut() else {
                    break;
                };
                if front.len() <= n {
                    n -= front.len();
                    self.queue.pop_front();
                } else {
                    front.advance(n);
                    n = 0;
                }
            }
        }
        // A frame's few entries fit the capacity kept; a long queue's is given back.
        if self.queue.capacity() > SLICES {
            self.queue = VecDeque::new();
        }
        Poll::Ready(Ok(()))
    }
}

impl<W: AsyncWrite + Unpin> Sink<Outbound> for FrameWriter<W> {
    type Error = std::io::Error;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if this.queued >= QUEUE {
            ready!(this.poll_drain(cx))?;
        }
        Poll::Ready(Ok(()))
    }

    fn start_send(self: Pin<&mut Self>, item: Outbound) -> std::io::Result<()> {
        let this = self.get_mut();
        if this.closed {
            return Err(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "the socket was closed",
            ));
        }
        let pong = this.pong.lock().ok().and_then(|mut p| p.take());
        if let Some(p) = pong {
            this.message(PONG, [p, Bytes::new()]);
        }
        match item {
            Outbound::Frame(frame) => {
                let (head, body) = frame.into_parts();
                let body = body.map_or_else(Bytes::new, Bytes::from_owner);
                this.message(BINARY, [Bytes::from(head), body]);
            }
            Outbound::Close(reason) => {
                // Code 1000 (normal closure), then as much of the reason as a control
                // frame's 125 bytes hold, cut between characters (it must stay UTF-8).
                let mut payload = 1000u16.to_be_bytes().to_vec();
                for c in reason.chars() {
                    if payload.len() + c.len_utf8() > 125 {
                        break;
                    }
                    let mut b = [0; 4];
                    payload.extend_from_slice(c.encode_utf8(&mut b).as_bytes());
                }
                this.message(CLOSE, [Bytes::from(payload), Bytes::new()]);
                this.closed = true;
            }
        }
        Ok(())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        ready!(Pin::new(&mut this.io).poll_flush(cx))?;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crowdgrad_core::session::Outgoing;
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::protocol::Role;
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::WebSocketStream;

    /// Whatever the writer sends, a tungstenite client reads as the same messages: a small
    /// frame, a shared-body frame in fragments (reassembled into one message), a Pong for the
    /// Ping left in the slot, and a Close whose reason is cut between characters; nothing is
    /// taken after the Close.
    #[tokio::test]
    async fn a_tungstenite_client_reads_what_the_writer_sends() {
        let (client_io, server_io) = tokio::io::duplex(1 << 16);
        let pong = Arc::new(Mutex::new(None));
        let mut w = FrameWriter::new(server_io, pong.clone());
        let big: Vec<u8> = (0..(2 * FRAGMENT + 77)).map(|i| (i * 7) as u8).collect();
        let body: Arc<[u8]> = big[40..].into();
        let reason = "é".repeat(200);
        let sent = big.clone();
        let server = tokio::spawn(async move {
            w.send(Outbound::Frame(vec![1, 2, 3].into())).await.unwrap();
            w.send(Outbound::Frame(Outgoing::shared(sent[..40].to_vec(), body)))
                .await
                .unwrap();
            *pong.lock().unwrap() = Some(Bytes::from_static(b"hi"));
            w.send(Outbound::Frame(Vec::new().into())).await.unwrap();
            w.send(Outbound::Close(reason)).await.unwrap();
            assert!(w.send(Outbound::Frame(vec![9].into())).await.is_err());
        });
        let mut ws = WebSocketStream::from_raw_socket(client_io, Role::Client, None).await;
        let mut got = Vec::new();
        while let Some(Ok(m)) = ws.next().await {
            let close = matches!(m, Message::Close(_));
            got.push(m);
            if close {
                break;
            }
        }
        server.await.unwrap();
        assert_eq!(
            got.len(),
            5,
            "{:?}",
            got.iter().map(|m| m.len()).collect::<Vec<_>>()
        );
        assert_eq!(got[0], Message::Binary(vec![1, 2, 3].into()));
        assert_eq!(got[1], Message::Binary(big.into()));
        assert_eq!(got[2], Message::Pong(Bytes::from_static(b"hi")));
        assert_eq!(got[3], Message::Binary(Bytes::new()));
        let Message::Close(Some(c)) = &got[4] else {
            panic!("{:?}", got[4])
        };
        assert_eq!(u16::from(c.code), 1000);
        assert_eq!(c.reason.as_str(), "é".repeat(61));
    }

    /// A parameters frame's shared body is queued as slices of itself, nothing copied, in
    /// fragments of at most [`FRAGMENT`] bytes behind headers that add up to the frame.
    #[test]
    fn a_shared_body_is_queued_as_slices_of_itself() {
        let (_, server_io) = tokio::io::duplex(16);
        let mut w = FrameWriter::new(server_io, Arc::default());
        let body: Arc<[u8]> = vec![5u8; 2 * FRAGMENT + 3].into();
        let mut sink = Pin::new(&mut w);
        sink.as_mut()
            .start_send(Outbound::Frame(Outgoing::shared(vec![1; 10], body.clone())))
            .unwrap();
        let range = body.as_ptr_range();
        let from_body: usize = w
            .queue
            .iter()
            .filter(|b| range.contains(&b.as_ptr()))
            .map(Bytes::len)
            .sum();
        assert_eq!(from_body, body.len());
        // Three frames: two of FRAGMENT bytes (10-byte headers, 64-bit lengths), one of 13
        // (a 2-byte header), then the head and the body's slices.
        assert_eq!(w.queued, 10 + 10 + 2 + 10 + body.len());
        assert_eq!(w.queue.front().map(|h| h[0]), Some(BINARY));
    }

    /// A peer that does not read: frames are taken until [`QUEUE`] bytes wait, then the
    /// sender waits (bounded), never queueing more than one frame past the bound.
    #[tokio::test]
    async fn a_peer_that_does_not_read_holds_the_sender() {
        let (_client, server_io) = tokio::io::duplex(1024);
        let mut w = FrameWriter::new(server_io, Arc::default());
        let mut taken = 0;
        let stuck = tokio::time::timeout(std::time::Duration::from_millis(200), async {
            loop {
                w.feed(Outbound::Frame(vec![0; 4096].into())).await.unwrap();
                taken += 1;
            }
        })
        .await;
        assert!(stuck.is_err(), "the sender waits");
        assert!(w.queued < QUEUE + 4096 + 10, "{} bytes queued", w.queued);
        assert!(taken >= QUEUE / 4096, "{taken} frames taken");
    }

    #[test]
    fn headers_use_the_shortest_length_form() {
        assert_eq!(&header(true, BINARY, 125)[..], [0x82, 125]);
        assert_eq!(&header(false, BINARY, 126)[..], [0x02, 126, 0, 126]);
        assert_eq!(
            &header(true, CONTINUATION, 65_535)[..],
            [0x80, 126, 255, 255]
        );
        assert_eq!(
            &header(true, CLOSE, 65_536)[..],
            [0x88, 127, 0, 0, 0, 0, 0, 1, 0, 0]
        );
    }
}
