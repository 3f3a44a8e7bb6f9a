//! The shard socket's own WebSocket frame reader (issue 18): RFC 6455 client frames into
//! whole messages, through a fixed [`READ_CHUNK`] buffer, each message read into a buffer of
//! exactly its length. It needs only `bytes` and tokio's `AsyncRead`, and names nothing else of
//! this crate, so the fuzz crate compiles this very file (`fuzz/src/reader.rs`, `#[path]`)
//! without the server's dependencies. `super::upgrade` wires it to the shard endpoint.

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt};

/// Bytes a shard socket keeps for reading between messages. Frame headers and small frames
/// (a Pull, a Report, a Hello) are read through it; a larger frame's payload is copied out of
/// it and the rest read straight into a buffer of exactly the frame's length, which goes to
/// the handler and is freed with the frame (issue 18: tungstenite's read buffer grew to the
/// largest frame read, a worker's push, and kept it for the life of the socket).
pub const READ_CHUNK: usize = 4 * 1024;

/// What [`FrameReader::next`] read.
#[derive(Debug, Clone, PartialEq)]
pub enum Read {
    /// A whole binary message.
    Binary(Bytes),
    /// A whole text message (not part of the protocol; its bytes are not kept).
    Text,
    /// A Ping with its payload (at most 125 bytes), to be answered with a Pong.
    Ping(Bytes),
    /// The peer closed (a Close frame, or the end of the stream between frames).
    Close,
}

/// Why a socket's reading stopped with an error.
#[derive(Debug)]
pub enum ReadError {
    /// The transport failed, or ended inside a frame.
    Io(std::io::Error),
    /// A frame RFC 6455 does not allow from a client.
    Protocol(&'static str),
    /// A frame or message over the limit (the payload is not read).
    TooLarge(u64),
}

impl From<std::io::Error> for ReadError {
    fn from(e: std::io::Error) -> Self {
        ReadError::Io(e)
    }
}

/// The server side of RFC 6455's framing, reading only: the frames a client sends (masked),
/// reassembled into messages, with control frames between fragments, under a frame and a
/// message size limit. It keeps [`READ_CHUNK`] bytes between messages whatever it read
/// before; a message's payload lives in a buffer of its own length, handed out whole.
///
/// Cancel-safe between calls only as a whole: keep the reader inside the future or stream
/// that calls [`Self::next`] (as `super::upgrade::shard_stream` does), never drop a pending `next`.
pub struct FrameReader<R> {
    io: R,
    pub(crate) buf: Box<[u8]>,
    pos: usize,
    end: usize,
    max_frame: u64,
    max_message: u64,
    /// A message arriving in fragments: text or not, and its payload so far. A `Vec` grown
    /// with `reserve_exact`: `BytesMut::reserve` grows by doubling, so a message in fragments
    /// took up to twice its length, over the message limit (found by the `reader` fuzz target:
    /// 3,000 + 2,000 bytes under a 5,008-byte limit allocated 6,000).
    pub(crate) partial: Option<(bool, Vec<u8>)>,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// Reads client frames from `io`: a frame over `max_frame` payload bytes or a message over
    /// `max_message` is [`ReadError::TooLarge`].
    pub fn new(io: R, max_frame: usize, max_message: usize) -> Self {
        FrameReader {
            io,
            buf: vec![0; READ_CHUNK].into_boxed_slice(),
            pos: 0,
            end: 0,
            max_frame: max_frame as u64,
            max_message: max_message as u64,
            partial: None,
        }
    }

    /// Until `need` (at most [`READ_CHUNK`]) bytes are buffered; false when the stream ended
    /// first.
    async fn fill(&mut self, need: usize) -> std::io::Result<bool> {
        while self.end - self.pos < need {
            if self.pos == self.end {
                (self.pos, self.end) = (0, 0);
            } else if self.buf.len() - self.pos < need {
                self.buf.copy_within(self.pos..self.end, 0);
                (self.pos, self.end) = (0, self.end - self.pos);
            }
            let n = self.io.read(&mut self.buf[self.end..]).await?;
            if n == 0 {
                return Ok(false);
            }
            self.end += n;
        }
        Ok(true)
    }

    /// The next message or control frame.
    ///
    /// # Errors
    /// [`ReadError`]: the transport failed or ended inside a frame, a frame broke RFC 6455
    /// (unmasked, reserved bits or opcodes, a control frame fragmented or over 125 bytes, a
    /// continuation out of place), or a frame or message was over its limit.
    pub async fn next(&mut self) -> Result<Read, ReadError> {
        loop {
            if !self.fill(2).await? {
                return if self.partial.is_none() {
                    Ok(Read::Close)
                } else {
                    Err(ReadError::Io(std::io::ErrorKind::UnexpectedEof.into()))
                };
            }
            let (b0, b1) = (self.buf[self.pos], self.buf[self.pos + 1]);
            let fin = b0 & 0x80 != 0;
            let opcode = b0 & 0x0f;
            if b0 & 0x70 != 0 {
                return Err(ReadError::Protocol("reserved bits set"));
            }
            if b1 & 0x80 == 0 {
                return Err(ReadError::Protocol("unmasked frame from a client"));
            }
            let ext = match b1 & 0x7f {
                126 => 2,
                127 => 8,
                _ => 0,
            };
            let head = 2 + ext + 4;
            if !self.fill(head).await? {
                return Err(ReadError::Io(std::io::ErrorKind::UnexpectedEof.into()));
            }
            let h = &self.buf[self.pos..self.pos + head];
            let len = match ext {
                0 => u64::from(b1 & 0x7f),
                2 => u64::from(u16::from_be_bytes([h[2], h[3]])),
                _ => u64::from_be_bytes([h[2], h[3], h[4], h[5], h[6], h[7], h[8], h[9]]),
            };
            let mask = [h[head - 4], h[head - 3], h[head - 2], h[head - 1]];
            self.pos += head;
            match opcode {
                0x8..=0xa => {
                    if !fin || len > 125 {
                        return Err(ReadError::Protocol(
                            "a control frame fragmented or over 125 bytes",
                        ));
                    }
                    let len = len as usize;
                    if !self.fill(len).await? {
                        return Err(ReadError::Io(std::io::ErrorKind::UnexpectedEof.into()));
                    }
                    let mut payload = self.buf[self.pos..self.pos + len].to_vec();
                    self.pos += len;
                    unmask(&mut payload, mask);
                    match opcode {
                        0x8 => return Ok(Read::Close),
                        0x9 => return Ok(Read::Ping(payload.into())),
                        _ => continue, // a Pong: nothing to do
                    }
                }
                0x0..=0x2 => {
                    let (text, mut message) = match (opcode, self.partial.take()) {
                        (0, Some(p)) => p,
                        (0, None) => {
                            return Err(ReadError::Protocol("a continuation without a message"))
                        }
                        (_, Some(_)) => {
                            return Err(ReadError::Protocol(
                                "a new message inside a fragmented one",
                            ))
                        }
                        (op, None) => (op == 1, Vec::new()),
                    };
                    let before = message.len() as u64;
                    // Saturating: `len` is any u64 the peer wrote (found by the `reader` fuzz
                    // target: a continuation claiming 2^64 - 1 bytes wrapped the sum).
                    let total = before.saturating_add(len);
                    if len > self.max_frame || total > self.max_message {
                        return Err(ReadError::TooLarge(total));
                    }
                    // Exactly this frame's bytes more: the message's buffer is its own size.
                    let len = len as usize;
                    message.reserve_exact(len);
                    let start = message.len();
                    let here = (self.end - self.pos).min(len);
                    message.extend_from_slice(&self.buf[self.pos..self.pos + here]);
                    self.pos += here;
                    let mut rest = (len - here) as u64;
                    while rest > 0 {
                        let n = (&mut self.io).take(rest).read_buf(&mut message).await?;
                        if n == 0 {
                            return Err(ReadError::Io(std::io::ErrorKind::UnexpectedEof.into()));
                        }
                        rest -= n as u64;
                    }
                    unmask(&mut message[start..], mask);
                    if !fin {
                        self.partial = Some((text, message));
                    } else if text {
                        return Ok(Read::Text);
                    } else {
                        return Ok(Read::Binary(Bytes::from(message)));
                    }
                }
                _ => return Err(ReadError::Protocol("reserved opcode")),
            }
        }
    }
}

/// XORs `data` (a frame's payload from its start) with the client's masking key.
fn unmask(data: &mut [u8], mask: [u8; 4]) {
    let wide = u64::from_ne_bytes([
        mask[0], mask[1], mask[2], mask[3], mask[0], mask[1], mask[2], mask[3],
    ]);
    let mut chunks = data.chunks_exact_mut(8);
    for c in &mut chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        c.copy_from_slice(&(u64::from_ne_bytes(w) ^ wide).to_ne_bytes());
    }
    // What is left starts at a multiple of 8, so at mask offset 0.
    for (i, b) in chunks.into_remainder().iter_mut().enumerate() {
        *b ^= mask[i & 3];
    }
}
