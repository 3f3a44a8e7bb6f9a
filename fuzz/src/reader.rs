//! The `reader` target: the shard socket's own WebSocket frame reader
//! (`server/src/shard/frames.rs`, compiled here as [`crate::frames`]: RFC 6455 client frames
//! into messages) fed any
//! bytes, delivered in any chunks as a socket would (with `Pending` between reads, and the
//! stream ending cleanly or with an error), under any frame and message limits.
//!
//! What must hold, for every input:
//! - no panic;
//! - every result is what a plain reading of the bytes says (an independent parse over the
//!   whole buffer, [`expected`]): each message's kind and payload (unmasked, fragments
//!   joined), each Ping's payload, the Close, and the error that ends the stream (its kind,
//!   its text, the size a `TooLarge` names); the chunking never changes any of it;
//! - memory stays within the reader's stated limits: making it allocates its read buffer,
//!   exactly [`READ_CHUNK`]; reading then allocates no single buffer larger than the message
//!   limit (or a control frame's 125 bytes) and never holds more than the limit and a small
//!   slack ([`SLACK`]) at once.
//!
//! Input: `flags` (bit 0: the stream ends with `ConnectionReset` instead of a clean end; bits
//! 1..7: which reads return `Pending` first), the frame and message limits (`u16` × 16 each,
//! little-endian), `n` (low 3 bits) and `n` chunk sizes (`u16`, 1..=8192, cycled), then the
//! stream.

use crate::frames::{FrameReader, Read, ReadError, READ_CHUNK};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::future::Future;
use std::pin::{pin, Pin};
use std::task::{Context, Poll, Waker};
use tokio::io::{AsyncRead, ReadBuf};

// ------------------------------------------------------------------ counting allocator

/// The system allocator, counting what the thread that armed it allocates: the bytes live
/// and their peak, and the largest single allocation. Other threads (the test harness) pass
/// through uncounted.
pub struct Counting;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn count(grow: isize, size: usize) {
    let _ = ARMED.try_with(|armed| {
        if armed.get() {
            LIVE.with(|l| {
                let now = l.get() + grow;
                l.set(now);
                PEAK.with(|p| p.set(p.get().max(now)));
            });
            LARGEST.with(|m| m.set(m.get().max(size)));
        }
    });
}

// SAFETY: every call goes straight to `System` with the caller's arguments; the counting
// touches only const-initialised thread-locals without destructors (no allocation).
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as isize, layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as isize, layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(-(layout.size() as isize), 0);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size as isize - layout.size() as isize, new_size);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// What the armed thread allocated while `f` ran: (peak bytes live above the start, largest
/// single allocation).
fn measured<T>(f: impl FnOnce() -> T) -> (T, usize, usize) {
    LIVE.with(|l| l.set(0));
    PEAK.with(|p| p.set(0));
    LARGEST.with(|m| m.set(0));
    ARMED.with(|a| a.set(true));
    let out = f();
    ARMED.with(|a| a.set(false));
    (
        out,
        PEAK.with(Cell::get).max(0) as usize,
        LARGEST.with(Cell::get),
    )
}

// ------------------------------------------------------------------ the socket

/// A socket delivering `data` in chunks of `sizes` (cycled), `Pending` before the reads whose
/// bit is set in `pending` (from the first read, cycled over 7), then a clean end or `reset`.
struct Chunked<'a> {
    data: &'a [u8],
    sizes: Vec<usize>,
    reads: usize,
    pending: u8,
    waited: bool,
    reset: bool,
}

impl AsyncRead for Chunked<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let me = &mut *self;
        if !me.waited && me.pending >> (me.reads % 7) & 1 == 1 {
            me.waited = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        me.waited = false;
        if me.data.is_empty() && me.reset {
            return Poll::Ready(Err(std::io::ErrorKind::ConnectionReset.into()));
        }
        let size = me.sizes[me.reads % me.sizes.len()];
        me.reads += 1;
        let n = size.min(buf.remaining()).min(me.data.len());
        buf.put_slice(&me.data[..n]);
        me.data = &me.data[n..];
        Poll::Ready(Ok(()))
    }
}

/// Polls `f` to completion; the socket wakes it before every `Pending`, so a bound on the
/// polls is a bound on a hang.
fn block_on<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    for _ in 0..1_000_000 {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
    panic!("the reader kept returning Pending with the socket ready");
}

// ------------------------------------------------------------------ what the bytes say

/// One result of reading, comparable: a message, or the error that ended the stream.
#[derive(Debug, Clone, PartialEq)]
pub enum Got {
    /// A binary message's payload.
    Binary(Vec<u8>),
    /// A text message.
    Text,
    /// A Ping's payload.
    Ping(Vec<u8>),
    /// The end: a Close frame, or the stream ending between messages.
    Close,
    /// The transport ended (or failed) inside a frame or a fragmented message.
    Io(std::io::ErrorKind),
    /// A frame a client may not send.
    Protocol(&'static str),
    /// A frame or message over its limit, with the size named.
    TooLarge(u64),
}

/// Whether the reader's result `r` is `want`, compared in place (a copy of a message would
/// count against the reader's memory).
fn same(r: &Result<Read, ReadError>, want: &Got) -> bool {
    match (r, want) {
        (Ok(Read::Binary(b)), Got::Binary(w)) => b[..] == w[..],
        (Ok(Read::Text), Got::Text) | (Ok(Read::Close), Got::Close) => true,
        (Ok(Read::Ping(b)), Got::Ping(w)) => b[..] == w[..],
        (Err(ReadError::Io(e)), Got::Io(k)) => e.kind() == *k,
        (Err(ReadError::Protocol(s)), Got::Protocol(w)) => s == w,
        (Err(ReadError::TooLarge(n)), Got::TooLarge(w)) => n == w,
        _ => false,
    }
}

/// What RFC 6455's client framing makes of `s` under the limits, read over the whole buffer
/// (no chunks): the results up to and including the first Close or error. The stream's end
/// is a Close between messages and `Io(UnexpectedEof)` inside one, or `reset` wherever it
/// comes.
pub fn expected(s: &[u8], max_frame: u64, max_message: u64, reset: bool) -> Vec<Got> {
    let end = |inside: bool| {
        if reset {
            Got::Io(std::io::ErrorKind::ConnectionReset)
        } else if inside {
            Got::Io(std::io::ErrorKind::UnexpectedEof)
        } else {
            Got::Close
        }
    };
    let mut out = Vec::new();
    let mut at = 0usize;
    let mut partial: Option<(bool, Vec<u8>)> = None;
    loop {
        let rest = &s[at..];
        if rest.len() < 2 {
            out.push(end(partial.is_some()));
            return out;
        }
        let (b0, b1) = (rest[0], rest[1]);
        if b0 & 0x70 != 0 {
            out.push(Got::Protocol("reserved bits set"));
            return out;
        }
        if b1 & 0x80 == 0 {
            out.push(Got::Protocol("unmasked frame from a client"));
            return out;
        }
        let ext = match b1 & 0x7f {
            126 => 2,
            127 => 8,
            _ => 0,
        };
        let head = 2 + ext + 4;
        if rest.len() < head {
            out.push(end(true));
            return out;
        }
        let len = match ext {
            0 => u64::from(b1 & 0x7f),
            2 => u64::from(u16::from_be_bytes([rest[2], rest[3]])),
            _ => u64::from_be_bytes(rest[2..10].try_into().unwrap_or_default()),
        };
        let mask = &rest[head - 4..head];
        let body = &rest[head..];
        let unmasked = |n: usize| -> Vec<u8> {
            body[..n]
                .iter()
                .enumerate()
                .map(|(i, b)| b ^ mask[i % 4])
                .collect()
        };
        let (fin, opcode) = (b0 & 0x80 != 0, b0 & 0x0f);
        match opcode {
            8..=10 => {
                if !fin || len > 125 {
                    out.push(Got::Protocol(
                        "a control frame fragmented or over 125 bytes",
                    ));
                    return out;
                }
                let n = len as usize;
                if body.len() < n {
                    out.push(end(true));
                    return out;
                }
                at += head + n;
                match opcode {
                    8 => {
                        out.push(Got::Close);
                        return out;
                    }
                    9 => out.push(Got::Ping(unmasked(n))),
                    _ => {}
                }
            }
            0..=2 => {
                let (text, mut message) = match (opcode, partial.take()) {
                    (0, Some(p)) => p,
                    (0, None) => {
                        out.push(Got::Protocol("a continuation without a message"));
                        return out;
                    }
                    (_, Some(_)) => {
                        out.push(Got::Protocol("a new message inside a fragmented one"));
                        return out;
                    }
                    (op, None) => (op == 1, Vec::new()),
                };
                let before = message.len() as u64;
                if len > max_frame || before.saturating_add(len) > max_message {
                    out.push(Got::TooLarge(before.saturating_add(len)));
                    return out;
                }
                let n = len as usize;
                if body.len() < n {
                    out.push(end(true));
                    return out;
                }
                message.extend(unmasked(n));
                at += head + n;
                if !fin {
                    partial = Some((text, message));
                } else if text {
                    out.push(Got::Text);
                } else {
                    out.push(Got::Binary(message));
                }
            }
            _ => {
                out.push(Got::Protocol("reserved opcode"));
                return out;
            }
        }
    }
}

// ------------------------------------------------------------------ the target

/// Bytes live beyond the message limit that reading may hold (the read buffer apart): a
/// control frame's payload (at most 125) and what the `Bytes` handles take.
pub const SLACK: usize = 1024;

/// The `reader` target (module docs).
pub fn reader(data: &[u8]) {
    let [flags, f0, f1, m0, m1, n, rest @ ..] = data else {
        return;
    };
    let max_frame = usize::from(u16::from_le_bytes([*f0, *f1])) * 16;
    let max_message = usize::from(u16::from_le_bytes([*m0, *m1])) * 16;
    let n = usize::from(n & 7);
    if rest.len() < 2 * n {
        return;
    }
    let (sizes, stream) = rest.split_at(2 * n);
    let mut sizes: Vec<usize> = sizes
        .chunks_exact(2)
        .map(|c| 1 + usize::from(u16::from_le_bytes([c[0], c[1]])) % 8192)
        .collect();
    if sizes.is_empty() {
        sizes.push(READ_CHUNK);
    }
    let reset = flags & 1 == 1;
    let want = expected(stream, max_frame as u64, max_message as u64, reset);
    let socket = Chunked {
        data: stream,
        sizes,
        reads: 0,
        pending: flags >> 1,
        waited: false,
        reset,
    };
    // The read buffer, allocated once when the reader is made: exactly READ_CHUNK.
    let (mut r, peak, largest) = measured(|| FrameReader::new(socket, max_frame, max_message));
    assert_eq!(
        (peak, largest),
        (READ_CHUNK, READ_CHUNK),
        "the reader's own buffer"
    );
    let mut results = 0usize;
    let ((), peak, largest) = measured(|| loop {
        let g = block_on(r.next());
        // Compared in place and freed one at a time, so what is counted is the reader's own.
        assert!(
            results < want.len(),
            "more results than the bytes hold: {g:?}"
        );
        assert!(
            same(&g, &want[results]),
            "result {results} is {g:?}, the bytes say {:?}",
            want[results]
        );
        results += 1;
        if !matches!(g, Ok(Read::Binary(_) | Read::Text | Read::Ping(_))) {
            break;
        }
    });
    drop(r);
    assert_eq!(results, want.len(), "fewer results than the bytes hold");
    // Beyond its buffer, reading allocates a message's buffer (at most the limit) and a
    // control frame's payload (at most 125 bytes).
    let bound = max_message.max(125);
    assert!(
        largest <= bound,
        "an allocation of {largest} bytes while reading, over the message limit ({bound})"
    );
    assert!(
        peak <= max_message + SLACK,
        "{peak} bytes live at once while reading, over the message limit ({max_message}) + {SLACK}"
    );
}

/// A client frame as RFC 6455 lays it out, masked with `mask` (seeds and tests).
pub fn client_frame(fin: bool, opcode: u8, payload: &[u8], mask: [u8; 4]) -> Vec<u8> {
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

/// A `reader` input: `flags`, the limits (in bytes, rounded down to 16), chunk sizes, the
/// stream.
pub fn input(
    flags: u8,
    max_frame: usize,
    max_message: usize,
    sizes: &[u16],
    stream: &[u8],
) -> Vec<u8> {
    let mut v = vec![flags];
    v.extend(((max_frame / 16).min(65_535) as u16).to_le_bytes());
    v.extend(((max_message / 16).min(65_535) as u16).to_le_bytes());
    v.push(sizes.len().min(7) as u8);
    for s in sizes.iter().take(7) {
        v.extend(s.to_le_bytes());
    }
    v.extend_from_slice(stream);
    v
}

/// The seed corpus of `reader` (name, input): what a tungstenite client sends (binary, Ping,
/// text, a message in fragments with a Ping between, Close), a crowdgrad push inside a frame,
/// every length encoding, in chunks of 1 byte up to more than the read buffer, with `Pending`
/// reads; a message in fragments larger than the read buffer; and each way a stream ends or
/// is refused.
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    use crowdgrad_core::codec::Encoding;
    use crowdgrad_core::wire;
    let m = [0x12, 0x34, 0x56, 0x78];
    let values: Vec<f32> = (0..300).map(|i| (i as f32 - 150.0) * 1e-3).collect();
    let push = wire::encode_push_as(Encoding::INT8, 7, 1, 3, 32, &values, None).unwrap_or_default();
    let mut session = client_frame(true, 2, &push, m);
    session.extend(client_frame(true, 9, b"ping", m));
    session.extend(client_frame(true, 1, b"not the protocol", m));
    session.extend(client_frame(false, 2, &[7; 10], m));
    session.extend(client_frame(true, 9, &[9], m));
    session.extend(client_frame(true, 10, b"pong", m));
    session.extend(client_frame(true, 0, &[8; 5], m));
    session.extend(client_frame(true, 8, &[3, 232], m));
    let big: Vec<u8> = (0..5_000u32).map(|i| (i * 31 % 251) as u8).collect();
    // A 64-bit length naming a small frame (RFC 6455 wants the shortest; the reader takes it).
    let mut long_len = vec![0x82, 0x80 | 127];
    long_len.extend(300u64.to_be_bytes());
    long_len.extend(m);
    long_len.extend(std::iter::repeat_n(0x5a, 300));
    let mut huge = vec![0x82, 0x80 | 127];
    huge.extend(u64::MAX.to_be_bytes());
    huge.extend(m);
    let mut two = client_frame(false, 2, &[1; 60], m);
    two.extend(client_frame(true, 0, &[2; 60], m));
    let mut grow = client_frame(false, 2, &[7; 3000], m);
    grow.extend(client_frame(true, 0, &[8; 2000], m));
    let mib = 1 << 20;
    vec![
        ("session".into(), input(0, mib, mib, &[4096], &session)),
        (
            "session-bytewise".into(),
            input(0, mib, mib, &[1], &session),
        ),
        (
            "session-pending".into(),
            input(0x7e, mib, mib, &[5, 3000, 9000], &session),
        ),
        (
            "len16".into(),
            input(0, mib, mib, &[100, 4097], &client_frame(true, 2, &big, m)),
        ),
        ("len64".into(), input(0x0a, mib, mib, &[7], &long_len)),
        ("huge-len".into(), input(0, mib, mib, &[], &huge)),
        ("fragments-over-limit".into(), input(0, 64, 112, &[3], &two)),
        ("fragments-at-limit".into(), input(0, 64, 128, &[3], &two)),
        (
            "fragments-grow".into(),
            input(0, 4096, 5008, &[4096], &grow),
        ),
        (
            "eof-inside".into(),
            input(
                0,
                mib,
                mib,
                &[1000],
                &client_frame(true, 2, &big, m)[..3000],
            ),
        ),
        (
            "reset".into(),
            input(1, mib, mib, &[8192], &client_frame(true, 2, &big, m)),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_allocator_counts_the_armed_thread() {
        let ((), peak, largest) = measured(|| drop(std::hint::black_box(vec![1u8; 10_000])));
        assert!(largest >= 10_000 && peak >= 10_000, "{peak} {largest}");
        let ((), peak, largest) = measured(|| ());
        assert_eq!((peak, largest), (0, 0));
    }

    #[test]
    fn the_expected_results_read_the_seeds_as_written() {
        let m = [1, 2, 3, 4];
        let mut s = client_frame(false, 2, &[1; 60], m);
        s.extend(client_frame(true, 9, b"p", m));
        s.extend(client_frame(true, 0, &[2; 60], m));
        let mut whole = vec![1; 60];
        whole.extend([2; 60]);
        assert_eq!(
            expected(&s, 64, 128, false),
            vec![Got::Ping(b"p".to_vec()), Got::Binary(whole), Got::Close]
        );
        assert_eq!(
            expected(&s, 64, 112, false),
            vec![Got::Ping(b"p".to_vec()), Got::TooLarge(120)]
        );
        assert_eq!(
            expected(&s[..75], 64, 128, true),
            vec![
                Got::Ping(b"p".to_vec()),
                Got::Io(std::io::ErrorKind::ConnectionReset)
            ]
        );
    }

    /// Found by `reader` (first run, seconds in): a fragment, then a continuation whose 64-bit
    /// length is 2^64 - 1; the reader's `TooLarge(before + len)` wrapped (fixed in
    /// server/src/shard/upgrade.rs, which has its own test).
    #[test]
    fn regression_a_continuation_length_near_2_pow_64_wrapped_the_size() {
        reader(&[
            0xd9, 0x00, 0x01, 0x17, 0x01, 0x01, 0x00, 0x20, 0x01, 0xa0, 0x17, 0x88, 0x88, 0x88,
            0x88, 0x88, 0x88, 0x88, 0x88, 0x81, 0x01, 0x01, 0x81, 0x81, 0x01, 0x81, 0xa1, 0x81,
            0x01, 0x00, 0x00, 0x00, 0x88, 0x88, 0x88, 0x88, 0x88, 0x88, 0x88, 0x3b, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
            0xff, 0xff, 0xc8, 0x88, 0x88, 0x88, 0x88, 0x88, 0x88, 0x88, 0x88, 0x00, 0x02, 0xff,
            0x0d, 0x03,
        ]);
    }

    /// Found by the memory check (an input written after the first run's fix, then replayed on
    /// the built target): 3,000 + 2,000 bytes in fragments under a 5,008-byte limit took a
    /// 6,000-byte buffer (`BytesMut::reserve` doubles); the reader now grows it exactly.
    #[test]
    fn regression_a_message_in_fragments_doubled_its_buffer() {
        let m = [1, 2, 3, 4];
        let mut s = client_frame(false, 2, &[7; 3000], m);
        s.extend(client_frame(true, 0, &[8; 2000], m));
        reader(&input(0, 4096, 5008, &[4096], &s));
    }

    /// The same bytes in every chunking from 1 byte to more than the buffer give the same
    /// results (each run checks them against [`expected`]).
    #[test]
    fn every_chunking_reads_the_same() {
        let (_, bytes) = seeds().swap_remove(0);
        let stream = &bytes[8..];
        for size in [1u16, 2, 3, 5, 13, 127, 1000, 4095, 4096, 4097, 8191] {
            for flags in [0u8, 0x2a, 0xfe] {
                reader(&input(flags, 1 << 20, 1 << 20, &[size], stream));
            }
        }
    }
}
