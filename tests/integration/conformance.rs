//! One shard side (issue 7): the same scripted conversations played through the server (real
//! sockets) and through the simulator's shard driver give the same frames, in the same order,
//! with the same request ids and error codes, and leave the same parameters, byte for byte.

use crate::util::{config, get, join, server};
use crowdgrad::config::ServeConfig;
use crowdgrad::sim::shard::{Output, ShardDriver};
use crowdgrad_core::partition::partition;
use crowdgrad_core::shard::{Consistency, StalenessPolicy};
use crowdgrad_core::wire::{self, Bye, Message as Frame, PROTOCOL_VERSION};
use futures_util::{SinkExt, StreamExt};
use std::collections::{BTreeMap, BinaryHeap};
use std::time::Duration;
use tokio_tungstenite::tungstenite::Message;

/// One step of a conversation. Connections are numbered by the script.
#[derive(Debug, Clone)]
enum Step {
    /// Connection `c` opens to shard `s`.
    Open(usize, u32),
    /// Connection `c` sends a binary message.
    Send(usize, Vec<u8>),
    /// Connection `c` closes.
    Close(usize),
    /// Time passes (the server: real seconds; the simulator: simulated, its timers fire).
    Wait(f64),
    /// Connection `c` has received `n` events so far (the server reads until it has).
    Expect(usize, usize),
}

/// What a connection received, as text that names everything that must agree.
fn describe(frame: &[u8]) -> String {
    match wire::decode(frame, usize::MAX) {
        Ok(Frame::Welcome {
            request_id,
            shard,
            welcome,
        }) => format!(
            "welcome id={request_id} shard={shard} v={} range={}..{}",
            welcome.version, welcome.range.start, welcome.range.end
        ),
        Ok(Frame::Params {
            request_id,
            shard,
            version,
            pace_ms,
            samples,
            values,
        }) => {
            // FNV-1a over the payload: the values must agree byte for byte.
            let h = values
                .bytes()
                .iter()
                .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
                    (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
                });
            format!(
                "params id={request_id} shard={shard} v={version} pace={pace_ms} \
                 samples={samples:?} hash={h:016x}"
            )
        }
        Ok(Frame::Ack {
            request_id,
            shard,
            version,
            staleness,
        }) => format!("ack id={request_id} shard={shard} v={version} staleness={staleness}"),
        Ok(Frame::Error {
            request_id,
            shard,
            error,
        }) => format!(
            "error id={request_id} shard={shard} {} ({})",
            error.code.name(),
            error.message
        ),
        Ok(Frame::Bye { shard, bye }) => format!("bye shard={shard} {}", bye.reason),
        Ok(other) => format!("unexpected {other:?}"),
        Err(e) => format!("undecodable: {e}"),
    }
}

/// `worker`'s Hello (no credential: [`with_credential`] adds it on the server's side).
fn hello(rid: u32, shard: u32, worker: u64, protocol: u32) -> Vec<u8> {
    crate::util::hello(worker)
        .request_id(rid)
        .shard(shard)
        .protocol(protocol)
        .frame()
}

fn pull(rid: u32, shard: u32, min_version: u64) -> Vec<u8> {
    wire::encode(&Frame::Pull {
        request_id: rid,
        shard,
        min_version,
    })
}

fn bye(shard: u32) -> Vec<u8> {
    wire::encode(&Frame::Bye {
        shard,
        bye: Bye {
            reason: "done".into(),
        },
    })
}

/// A Hello without a credential gets the one the server's join handed out for its worker (the
/// simulator admits every joined worker; the server wants the credential too).
fn with_credential(url: &str, frame: Vec<u8>) -> Vec<u8> {
    match wire::decode(&frame, usize::MAX) {
        // Every Hello of a script is made by [`hello`]: the same frame with the credential.
        Ok(Frame::Hello {
            request_id,
            shard,
            hello,
        }) if hello.credential.is_none() => crate::util::hello(hello.worker_id)
            .request_id(request_id)
            .shard(shard)
            .protocol(hello.protocol)
            .credential(crate::util::credential(url, hello.worker_id))
            .frame(),
        _ => frame,
    }
}

/// Plays `script` against a real server; returns every connection's events.
async fn through_server(cfg: ServeConfig, workers: usize, script: Script) -> Played {
    let running = server(cfg).await;
    let url = running.url();
    let mut ids = Vec::new();
    for _ in 0..workers {
        ids.push(join(&url).await.worker_id);
    }
    let (_, initial) = get(format!("{url}/api/params")).await;
    let steps = script(&ids);
    let mut socks = BTreeMap::new();
    let mut logs: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for step in steps {
        match step {
            Step::Open(c, s) => {
                let u = format!("ws://{}/ws/shard/{s}", running.addr);
                let ws = tokio_tungstenite::connect_async(u.as_str())
                    .await
                    .expect("connect")
                    .0;
                socks.insert(c, ws);
                logs.entry(c).or_default();
            }
            Step::Send(c, f) => {
                let ws = socks.get_mut(&c).expect("open connection");
                let f = with_credential(&url, f);
                let _ = ws.send(Message::Binary(f.into())).await;
            }
            Step::Close(c) => {
                if let Some(mut ws) = socks.remove(&c) {
                    let _ = ws.close(None).await;
                }
            }
            Step::Wait(s) => tokio::time::sleep(Duration::from_secs_f64(s)).await,
            Step::Expect(c, n) => {
                let log = logs.entry(c).or_default();
                while log.len() < n {
                    let ws = socks.get_mut(&c).expect("open connection");
                    match next(ws, Duration::from_secs(10)).await {
                        Some(e) => log.push(e),
                        None => panic!("connection {c}: nothing after {log:?}, expected {n}"),
                    }
                }
            }
        }
    }
    // Whatever else arrives: the logs must be complete, not just agree on a prefix.
    for (c, ws) in socks.iter_mut() {
        let log = logs.entry(*c).or_default();
        while log.last().map(String::as_str) != Some("close") {
            match next(ws, Duration::from_millis(300)).await {
                Some(e) => log.push(e),
                None => break,
            }
        }
    }
    let (_, params) = get(format!("{url}/api/params")).await;
    running.stop().await.expect("clean stop");
    Played {
        ids,
        initial,
        logs,
        params,
    }
}

/// The next event on `ws`: a frame, "close", or None when nothing came within `wait`.
async fn next(ws: &mut crate::util::Ws, wait: Duration) -> Option<String> {
    loop {
        match tokio::time::timeout(wait, ws.next()).await {
            Err(_) => return None,
            Ok(Some(Ok(Message::Binary(b)))) => return Some(describe(&b)),
            Ok(Some(Ok(Message::Close(_)))) | Ok(None) | Ok(Some(Err(_))) => {
                return Some("close".into())
            }
            Ok(Some(Ok(_))) => continue,
        }
    }
}

/// Plays `script` through the simulator's shard driver, on simulated time, with the server's
/// configuration and initial parameters.
fn through_sim(cfg: &ServeConfig, server: &Played, script: Script) -> Played {
    let initial: Vec<f32> = server
        .initial
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let ranges = partition(initial.len(), cfg.training.shards).expect("ranges");
    let mut shards: Vec<ShardDriver> = ranges
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let state = cfg
                .training
                .shard_setup(true, initial.len())
                .state(i as u32, *r, initial[r.start..r.end].to_vec())
                .expect("state");
            let mut d = ShardDriver::new(state, false);
            for &id in &server.ids {
                d.register(id);
            }
            d
        })
        .collect();
    let mut shard_of = BTreeMap::new();
    let mut logs: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    // Pending timers: (-time in ns, shard, conn) in a max-heap, earliest first.
    let mut timers: BinaryHeap<(i64, usize, u64)> = BinaryHeap::new();
    let mut now = 0.0f64;
    let apply = |out: Vec<Output>,
                 shard: usize,
                 logs: &mut BTreeMap<usize, Vec<String>>,
                 timers: &mut BinaryHeap<(i64, usize, u64)>| {
        for o in out {
            match o {
                Output::Frame { conn, bytes } => logs
                    .entry(conn as usize)
                    .or_default()
                    .push(describe(&bytes)),
                Output::Close { conn } => {
                    logs.entry(conn as usize).or_default().push("close".into())
                }
                Output::Timer { conn, at } => {
                    timers.push((-((at * 1e9).ceil() as i64 + 1), shard, conn));
                }
                Output::Record { .. } => {}
            }
        }
    };
    for step in script(&server.ids) {
        let mut out = Vec::new();
        match step {
            Step::Open(c, s) => {
                shards[s as usize].open(c as u64);
                shard_of.insert(c, s as usize);
                logs.entry(c).or_default();
            }
            Step::Send(c, f) => {
                let s = shard_of[&c];
                shards[s].receive(c as u64, &f, now, &mut out);
                apply(out, s, &mut logs, &mut timers);
            }
            Step::Close(c) => {
                let s = shard_of[&c];
                shards[s].close(c as u64, now, &mut out);
                apply(out, s, &mut logs, &mut timers);
            }
            Step::Wait(d) => {
                let until = now + d;
                while let Some(&(t, s, c)) = timers.peek() {
                    let at = -t as f64 / 1e9;
                    if at > until {
                        break;
                    }
                    timers.pop();
                    now = now.max(at);
                    let mut out = Vec::new();
                    shards[s].timer(c, now, &mut out);
                    apply(out, s, &mut logs, &mut timers);
                }
                now = until;
            }
            Step::Expect(..) => {}
        }
    }
    let params = shards
        .iter()
        .flat_map(|d| d.state().values().iter().flat_map(|v| v.to_le_bytes()))
        .collect();
    Played {
        ids: server.ids.clone(),
        initial: server.initial.clone(),
        logs,
        params,
    }
}

type Script = fn(&[u64]) -> Vec<Step>;

struct Played {
    ids: Vec<u64>,
    initial: Vec<u8>,
    logs: BTreeMap<usize, Vec<String>>,
    params: Vec<u8>,
}

async fn conformance(cfg: ServeConfig, workers: usize, script: Script) {
    let live = through_server(cfg.clone(), workers, script).await;
    let sim = through_sim(&cfg, &live, script);
    for (c, log) in &live.logs {
        assert_eq!(
            Some(log),
            sim.logs.get(c),
            "connection {c}: the server (left) and the simulator (right) disagree"
        );
    }
    assert_eq!(live.logs.len(), sim.logs.len());
    assert!(
        live.params == sim.params,
        "the server and the simulator end with different parameters"
    );
    assert_ne!(
        live.params, live.initial,
        "the conversation trained something"
    );
}

fn small(consistency: Consistency, staleness: &str) -> ServeConfig {
    let mut c = config();
    c.training.model = "softmax".into();
    c.training.shards = 2;
    c.training.consistency = consistency;
    c.training.staleness = StalenessPolicy::parse(staleness).expect("policy");
    c.training.heartbeat_timeout = 1.0;
    c.training.sync_timeout = 1.0;
    c
}

/// Half of softmax on MNIST: 7,850 parameters in 2 shards.
const N: usize = 3925;

fn grad(v: f32) -> Vec<f32> {
    (0..N).map(|i| v * ((i % 7) as f32 - 3.0) * 1e-3).collect()
}

#[tokio::test]
async fn hello_pull_push_and_every_rejection() {
    conformance(small(Consistency::Async, "drop:1"), 2, |ids| {
        let (a, b) = (ids[0], ids[1]);
        use Step::*;
        let mut nan = grad(1.0);
        nan[17] = f32::NAN;
        vec![
            // A good Hello, then a second one: fatal.
            Open(0, 0),
            Send(0, hello(1, 0, a, PROTOCOL_VERSION)),
            Expect(0, 1),
            Send(0, hello(2, 0, a, PROTOCOL_VERSION)),
            Expect(0, 3),
            // Wrong protocol version; unknown worker; an unreadable header (id 0).
            Open(1, 0),
            Send(1, hello(3, 0, a, PROTOCOL_VERSION + 7)),
            Expect(1, 2),
            Open(2, 0),
            Send(2, hello(4, 0, 999_999, PROTOCOL_VERSION)),
            Expect(2, 2),
            Open(3, 1),
            Send(3, vec![b'C', b'G', 1, 5, 9, 9, 9, 9, 0, 0]),
            Expect(3, 2),
            // Pull, push, staleness, too stale (not fatal), wrong length (fatal).
            Open(4, 1),
            Send(4, hello(5, 1, b, PROTOCOL_VERSION)),
            Send(4, pull(6, 1, 0)),
            Send(4, wire::encode_push(7, 1, 0, 32, &grad(1.0))),
            Send(4, pull(8, 1, 0)),
            Send(4, wire::encode_push(9, 1, 0, 32, &grad(2.0))),
            Send(4, wire::encode_push(10, 1, 0, 32, &grad(3.0))),
            Send(4, wire::encode_push(11, 1, 2, 32, &grad(1.0)[1..])),
            Expect(4, 8),
            // NaN; a push addressed to the other shard; a push before Hello.
            Open(5, 1),
            Send(5, hello(12, 1, a, PROTOCOL_VERSION)),
            Send(5, wire::encode_push(13, 1, 2, 32, &nan)),
            Expect(5, 3),
            Open(6, 0),
            Send(6, hello(14, 0, a, PROTOCOL_VERSION)),
            Send(6, wire::encode_push(15, 1, 0, 32, &grad(1.0))),
            Expect(6, 3),
            Open(7, 0),
            Send(7, wire::encode_push(16, 0, 0, 32, &grad(1.0))),
            Expect(7, 2),
            // A push from the future; then Bye closes cleanly.
            Open(8, 0),
            Send(8, hello(17, 0, b, PROTOCOL_VERSION)),
            Send(8, wire::encode_push(18, 0, 0, 32, &grad(1.0))),
            Send(8, wire::encode_push(19, 0, 5, 32, &grad(1.0))),
            Expect(8, 4),
            Open(9, 0),
            Send(9, hello(20, 0, b, PROTOCOL_VERSION)),
            Send(9, pull(21, 0, 0)),
            Send(9, bye(0)),
            Expect(9, 3),
        ]
    })
    .await;
}

#[tokio::test]
async fn sync_with_a_worker_leaving_mid_aggregate() {
    conformance(small(Consistency::Sync { k: 3 }, "accept"), 3, |ids| {
        use Step::*;
        vec![
            Open(0, 0),
            Open(1, 0),
            Open(2, 0),
            Send(0, hello(1, 0, ids[0], PROTOCOL_VERSION)),
            Send(1, hello(1, 0, ids[1], PROTOCOL_VERSION)),
            Send(2, hello(1, 0, ids[2], PROTOCOL_VERSION)),
            Expect(0, 1),
            Expect(1, 1),
            Expect(2, 1),
            Send(0, wire::encode_push(2, 0, 0, 32, &grad(1.0))),
            Expect(0, 2),
            Send(1, wire::encode_push(2, 0, 0, 32, &grad(3.0))),
            Expect(1, 2),
            // Worker 0 waits for version 1; worker 2 leaves without pushing: the two buffered
            // gradients are all that can come, so the shard applies their mean.
            Send(0, pull(3, 0, 1)),
            Close(2),
            Expect(0, 3),
            // A late gradient from version 0 is refused, not fatal.
            Send(1, wire::encode_push(3, 0, 0, 32, &grad(1.0))),
            Expect(1, 3),
            // Next round with two workers left: one push, then the pull waits for the other.
            Send(1, wire::encode_push(4, 0, 1, 32, &grad(2.0))),
            Send(1, pull(5, 0, 2)),
            Expect(1, 4),
            Send(0, wire::encode_push(4, 0, 1, 32, &grad(1.0))),
            Expect(0, 4),
            Expect(1, 5),
            Send(0, bye(0)),
            Send(1, bye(0)),
            Expect(0, 5),
            Expect(1, 6),
        ]
    })
    .await;
}

#[tokio::test]
async fn ssp_with_a_sleeper() {
    conformance(small(Consistency::Ssp { bound: 1 }, "accept"), 2, |ids| {
        use Step::*;
        vec![
            Open(0, 1),
            Open(1, 1),
            Send(0, hello(1, 1, ids[0], PROTOCOL_VERSION)),
            Send(1, hello(1, 1, ids[1], PROTOCOL_VERSION)),
            Expect(0, 1),
            Expect(1, 1),
            Send(0, wire::encode_push(2, 1, 0, 32, &grad(1.0))),
            Send(0, wire::encode_push(3, 1, 1, 32, &grad(1.0))),
            Expect(0, 3),
            // Two ahead of a silent worker with S = 1: the pull waits until the sleeper's
            // heartbeat (1 s) expires.
            Send(0, pull(4, 1, 0)),
            Wait(1.8),
            Expect(0, 4),
            // The sleeper wakes: its push from version 0 is applied with staleness 2.
            Send(1, wire::encode_push(2, 1, 0, 32, &grad(2.0))),
            Expect(1, 2),
            Send(0, bye(1)),
            Send(1, bye(1)),
            Expect(0, 5),
            Expect(1, 3),
        ]
    })
    .await;
}
