//! The dashboard stream (`GET /api/events`, issue 18): built once per tick by one task and
//! handed to every viewer as the same bytes, so a viewer costs a reference-counted clone and
//! a socket write, whatever the number of viewers or workers.
//!
//! Every [`TICK`] the coordinator's dashboard task builds a [`Tick`]: the `tick` event (counters, shard versions,
//! the newest evaluation and only the evaluation points added since the previous tick: no
//! history, no worker list, no leaderboard) as plain SSE bytes and as one raw-deflate segment
//! ending in a full flush. A full flush empties the compressor's window, so the segment does
//! not depend on what came before it on the wire: every gzip viewer's stream is the 10-byte
//! gzip header followed by the segments of the events it was sent, and the compression is
//! done once per tick for all of them. The `run` event (the run's description, the whole kept
//! evaluation history and the current tick) is what a viewer gets first, and again whenever it
//! missed a tick (a slow reader: [`watch`] keeps only the newest tick, so a reader that falls
//! behind skips ticks and gets a fresh `run` instead of a queue); it is built at most once per
//! tick, when a viewer first needs it.
//!
//! The worker table and the leaderboard are not in the stream: the page asks for them
//! (`/api/workers?offset=&limit=`, `/api/contributors`) while they are on screen. The exact
//! format is in docs/protocol.md ("Dashboard stream").
//!
//! Nothing here takes the registry's lock for longer than a copy of the totals: the tick reads
//! [`crate::registry::Registry::summary`] (per-kind worker counts kept as the workers come and
//! go, not counted by walking them) and the shards' own counters.

use super::evals::EvalPoint;
use bytes::Bytes;
use flate2::{Compress, Compression, FlushCompress};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::sync::watch;

/// How often the tick is built and sent.
pub const TICK: Duration = Duration::from_secs(1);

/// The 10-byte gzip header a gzip viewer's stream starts with (no name, no time, unknown OS).
pub const GZIP_HEADER: [u8; 10] = [0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff];

/// One event as plain SSE bytes and as a self-contained raw-deflate segment.
#[derive(Debug, Clone, Default)]
pub struct Encoded {
    /// `event: NAME\ndata: JSON\n\n`.
    pub plain: Bytes,
    /// The same bytes deflated, ending in a full flush (appendable to any deflate stream
    /// positioned after another such segment or at its start).
    pub deflated: Bytes,
}

impl Encoded {
    fn new(name: &str, json: &str) -> Self {
        let plain = format!("event: {name}\ndata: {json}\n\n").into_bytes();
        let deflated = deflate_segment(&plain);
        Self {
            plain: plain.into(),
            deflated: deflated.into(),
        }
    }

    /// The bytes for a viewer that takes gzip (`true`) or not.
    pub fn bytes(&self, gzip: bool) -> Bytes {
        if gzip {
            self.deflated.clone()
        } else {
            self.plain.clone()
        }
    }
}

/// Raw deflate of `input` with a fresh compressor, ending in a full flush (no final block).
fn deflate_segment(input: &[u8]) -> Vec<u8> {
    let mut c = Compress::new(Compression::fast(), false);
    let mut out = Vec::with_capacity(input.len() + input.len() / 16 + 64);
    loop {
        let taken = (c.total_in() as usize).min(input.len());
        if c.compress_vec(&input[taken..], &mut out, FlushCompress::Full)
            .is_err()
        {
            // miniz does not fail on a buffer it was handed; send nothing rather than garbage.
            return Vec::new();
        }
        // Done when all input is in and the flush stopped short of the buffer's end.
        if c.total_in() as usize == input.len() && out.len() < out.capacity() {
            return out;
        }
        out.reserve(out.capacity());
    }
}

/// What the `run` event is built from (kept with the tick, built when first needed).
#[derive(Debug, Default)]
struct RunSource {
    description: serde_json::Value,
    history: Vec<EvalPoint>,
    tick_json: String,
}

/// One tick of the dashboard stream.
#[derive(Debug, Default)]
pub struct Tick {
    /// Counts ticks from 1 (0: none built yet).
    pub seq: u64,
    /// The `tick` event.
    pub tick: Encoded,
    source: RunSource,
    run: OnceLock<Encoded>,
}

impl Tick {
    /// The `run` event of this tick (built once, by the first viewer that needs it).
    pub fn run(&self) -> &Encoded {
        self.run.get_or_init(|| {
            let json = format!(
                r#"{{"seq":{},"run":{},"eval_history":{},"tick":{}}}"#,
                self.seq,
                serde_json::to_string(&self.source.description).unwrap_or_else(|_| "{}".into()),
                serde_json::to_string(&self.source.history).unwrap_or_else(|_| "[]".into()),
                if self.source.tick_json.is_empty() {
                    "null"
                } else {
                    &self.source.tick_json
                },
            );
            Encoded::new("run", &json)
        })
    }
}

/// The stream's shared state: the newest tick.
#[derive(Debug)]
pub struct Dashboard {
    tx: watch::Sender<Arc<Tick>>,
}

impl Default for Dashboard {
    fn default() -> Self {
        Self {
            tx: watch::Sender::new(Arc::new(Tick::default())),
        }
    }
}

impl Dashboard {
    /// A receiver of the ticks (the newest is there at once).
    pub fn subscribe(&self) -> watch::Receiver<Arc<Tick>> {
        self.tx.subscribe()
    }

    /// Viewers subscribed now.
    pub fn viewers(&self) -> usize {
        self.tx.receiver_count()
    }
}

impl Tick {
    /// Tick number `seq` with its `tick` event's JSON, and what its `run` event is built from
    /// when a viewer first needs it: the run's description and the kept evaluation history.
    pub fn new(
        seq: u64,
        tick_json: String,
        description: serde_json::Value,
        history: Vec<EvalPoint>,
    ) -> Self {
        Self {
            seq,
            tick: Encoded::new("tick", &tick_json),
            source: RunSource {
                description,
                history,
                tick_json,
            },
            run: OnceLock::new(),
        }
    }
}

impl Dashboard {
    /// Makes `tick` the newest for every viewer (a viewer that missed one gets a `run` event).
    pub fn publish(&self, tick: Tick) {
        self.tx.send_replace(Arc::new(tick));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn segments_from_different_compressors_concatenate_into_one_gzip_stream() {
        let events = [
            Encoded::new("run", r#"{"seq":1,"run":{"model":"mlp"}}"#),
            Encoded::new("tick", r#"{"seq":2,"totals":{"pulls":10}}"#),
            Encoded::new(
                "tick",
                &format!(r#"{{"seq":3,"x":"{}"}}"#, "ab".repeat(5000)),
            ),
        ];
        let mut wire = GZIP_HEADER.to_vec();
        let mut plain = Vec::new();
        for e in &events {
            wire.extend_from_slice(&e.deflated);
            plain.extend_from_slice(&e.plain);
            assert!(e.deflated.len() < e.plain.len() + 16);
        }
        // The stream never ends (no trailer): read what decodes so far.
        let mut d = flate2::read::GzDecoder::new(&wire[..]);
        let mut got = vec![0u8; plain.len()];
        d.read_exact(&mut got).expect("every event decodes");
        assert_eq!(got, plain);
    }
}
