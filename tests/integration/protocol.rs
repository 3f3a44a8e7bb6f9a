//! The wire protocol over a real server: every kind of bad input gets a clear error frame, the
//! connection is closed, the shard is unchanged, and the server keeps serving other workers.

use crate::util::{config, connect, handshake, hello, join, recv, send, server, status};
use crowdgrad::Running;
use crowdgrad_core::wire::{self, ErrorCode, Message as Frame, HEADER_LEN, MAX_META_LEN};
use futures_util::SinkExt;
use tokio_tungstenite::tungstenite::Message;

fn decode(frame: &[u8]) -> Frame<'_> {
    wire::decode(frame, usize::MAX).expect("the server's frames decode")
}

/// A healthy worker can still pull and push on shard 0 and the push is applied.
async fn still_serving(running: &Running, worker: u64) {
    let (mut ws, version) = handshake(running, worker, 0).await;
    let n = join_len(running).await;
    send(&mut ws, wire::encode_push(5, 0, version, 1, &vec![0.0; n])).await;
    let ack = recv(&mut ws).await.expect("ack");
    assert!(
        matches!(decode(&ack), Frame::Ack { request_id: 5, .. }),
        "{:?}",
        decode(&ack)
    );
    send(
        &mut ws,
        wire::encode(&Frame::Pull {
            request_id: 6,
            shard: 0,
            min_version: 0,
        }),
    )
    .await;
    let p = recv(&mut ws).await.expect("params");
    assert!(matches!(decode(&p), Frame::Params { request_id: 6, values, .. } if values.len() == n));
}

async fn join_len(running: &Running) -> usize {
    let s = status(&running.url()).await;
    let r = &s["shards"][0]["range"];
    (r["end"].as_u64().unwrap_or(0) - r["start"].as_u64().unwrap_or(0)) as usize
}

/// Sends `bad` after an optional handshake and checks: error frame with `code` echoing
/// `request_id`, then close; shard 0 unchanged; others still served.
async fn rejected(handshake: bool, bad: Message, code: ErrorCode, request_id: u32) {
    rejected_with(config(), handshake, |_, _| bad, code, request_id).await;
}

/// [`rejected`] on a server run with `cfg`, the bad message made from the server's URL and the
/// worker id of the sender (for frames that need a worker's identity, e.g. a credential).
async fn rejected_with(
    cfg: crowdgrad::config::ServeConfig,
    handshake: bool,
    bad: impl FnOnce(&str, u64) -> Message,
    code: ErrorCode,
    request_id: u32,
) {
    let running = server(cfg).await;
    let url = running.url();
    let me = join(&url).await.worker_id;
    let other = join(&url).await.worker_id;
    let bad = bad(&url, me);
    let before = status(&url).await;
    let (_, params_before) = crate::util::get(format!("{url}/api/params")).await;
    let mut ws = if handshake {
        crate::util::handshake(&running, me, 0).await.0
    } else {
        connect(&running, 0).await
    };
    ws.send(bad).await.expect("send");
    let reply = recv(&mut ws)
        .await
        .expect("an error frame before the close");
    match decode(&reply) {
        Frame::Error {
            error,
            request_id: echoed,
            ..
        } => {
            assert_eq!(error.code, code, "{}", error.message);
            assert!(!error.message.is_empty());
            assert_eq!(echoed, request_id);
        }
        other => panic!("expected an Error frame, got {other:?}"),
    }
    assert!(
        recv(&mut ws).await.is_none(),
        "the connection is closed after a fatal error"
    );
    let after = status(&url).await;
    assert_eq!(
        after["shards"][0]["version"],
        before["shards"][0]["version"]
    );
    let (_, params_after) = crate::util::get(format!("{url}/api/params")).await;
    assert!(
        params_before == params_after,
        "a rejected frame changed the parameters"
    );
    // Counted once: as a rejected push when the frame decoded as a push, else as a refused
    // frame (issue 7: `pushes_rejected` counts pushes only).
    let shard = &after["shards"][0];
    let as_push = shard["rejected_by_reason"][code.name()]
        .as_u64()
        .unwrap_or(0);
    let as_frame = shard["frames_rejected_by_reason"][code.name()]
        .as_u64()
        .unwrap_or(0);
    assert_eq!(
        (as_push + as_frame, as_push.min(as_frame)),
        (1, 0),
        "{shard}"
    );
    still_serving(&running, other).await;
    running.stop().await.expect("clean shutdown");
}

fn bin(v: Vec<u8>) -> Message {
    Message::Binary(v.into())
}

fn full_push(n: usize) -> Vec<u8> {
    wire::encode_push(9, 0, 0, 32, &vec![0.01; n])
}

const SHARD0: usize = 50_885; // MLP 784-128-10 over the default 2 shards

#[tokio::test]
async fn truncated_frame() {
    let mut f = full_push(SHARD0);
    f.truncate(f.len() - 3);
    rejected(true, bin(f), ErrorCode::Malformed, 9).await;
}

#[tokio::test]
async fn frame_shorter_than_a_header() {
    rejected(true, bin(vec![b'C', b'G', 1]), ErrorCode::Malformed, 0).await;
}

#[tokio::test]
async fn oversized_frame() {
    let n = SHARD0 + MAX_META_LEN / 4 + HEADER_LEN;
    rejected(
        true,
        bin(wire::encode_push(9, 0, 0, 32, &vec![0.0; n])),
        ErrorCode::Oversize,
        9,
    )
    .await;
}

#[tokio::test]
async fn wrong_length_push() {
    rejected(
        true,
        bin(wire::encode_push(9, 0, 0, 32, &vec![0.0; SHARD0 - 1])),
        ErrorCode::WrongLength,
        9,
    )
    .await;
}

#[tokio::test]
async fn unknown_kind() {
    let mut f = wire::encode(&Frame::Pull {
        request_id: 9,
        shard: 0,
        min_version: 0,
    });
    f[3] = 99;
    rejected(true, bin(f), ErrorCode::UnknownKind, 9).await;
}

#[tokio::test]
async fn unknown_wire_version() {
    let mut f = full_push(SHARD0);
    f[2] = 2;
    rejected(true, bin(f), ErrorCode::WireVersion, 9).await;
}

#[tokio::test]
async fn wrong_protocol_version_in_hello() {
    let f = hello(1).request_id(4).protocol(99).frame();
    rejected(false, bin(f), ErrorCode::ProtocolVersion, 4).await;
}

#[tokio::test]
async fn nan_in_a_push() {
    let mut g = vec![0.01f32; SHARD0];
    g[1234] = f32::NAN;
    rejected(
        true,
        bin(wire::encode_push(9, 0, 0, 32, &g)),
        ErrorCode::NotFinite,
        9,
    )
    .await;
}

#[tokio::test]
async fn infinity_in_a_push() {
    let mut g = vec![0.01f32; SHARD0];
    g[SHARD0 - 1] = f32::NEG_INFINITY;
    rejected(
        true,
        bin(wire::encode_push(9, 0, 0, 32, &g)),
        ErrorCode::NotFinite,
        9,
    )
    .await;
}

#[tokio::test]
async fn push_from_the_future() {
    rejected(
        true,
        bin(wire::encode_push(9, 0, 1000, 32, &vec![0.0; SHARD0])),
        ErrorCode::FutureVersion,
        9,
    )
    .await;
}

#[tokio::test]
async fn push_before_hello() {
    rejected(false, bin(full_push(SHARD0)), ErrorCode::Protocol, 9).await;
}

#[tokio::test]
async fn unknown_worker_id() {
    let f = hello(424_242).request_id(3).protocol(1).frame();
    rejected(false, bin(f), ErrorCode::UnknownWorker, 3).await;
}

#[tokio::test]
async fn frame_for_another_shard() {
    rejected(
        true,
        bin(wire::encode_push(9, 1, 0, 32, &vec![0.0; SHARD0])),
        ErrorCode::WrongShard,
        9,
    )
    .await;
}

#[tokio::test]
async fn text_message() {
    rejected(
        true,
        Message::Text("{\"pull\":1}".into()),
        ErrorCode::Malformed,
        0,
    )
    .await;
}

#[tokio::test]
async fn graceful_shutdown_says_bye_and_closes() {
    let running = server(config()).await;
    let me = join(&running.url()).await.worker_id;
    let (mut ws, _) = handshake(&running, me, 1).await;
    let stopping = tokio::spawn(running.stop());
    let bye = recv(&mut ws).await.expect("a Bye frame");
    assert!(matches!(decode(&bye), Frame::Bye { shard: 1, .. }));
    assert!(recv(&mut ws).await.is_none());
    stopping.await.expect("join").expect("clean shutdown");
}

#[tokio::test]
async fn staleness_is_recorded_and_a_bounded_policy_rejects_without_closing() {
    let mut cfg = config();
    cfg.training.staleness =
        crowdgrad_core::shard::StalenessPolicy::parse("drop:1").expect("policy");
    let running = server(cfg).await;
    let url = running.url();
    let me = join(&url).await.worker_id;
    let (mut ws, v0) = handshake(&running, me, 0).await;
    let g = vec![0.0f32; SHARD0];
    for (req, expect_staleness) in [(1u32, 0u32), (2, 1)] {
        send(&mut ws, wire::encode_push(req, 0, v0, 32, &g)).await;
        let ack = recv(&mut ws).await.expect("ack");
        assert!(
            matches!(decode(&ack), Frame::Ack { staleness, .. } if staleness == expect_staleness)
        );
    }
    // Staleness 2 > 1: rejected, but the connection stays open.
    send(&mut ws, wire::encode_push(3, 0, v0, 32, &g)).await;
    let err = recv(&mut ws).await.expect("error");
    assert!(
        matches!(decode(&err), Frame::Error { request_id: 3, error, .. } if error.code == ErrorCode::TooStale)
    );
    send(
        &mut ws,
        wire::encode(&Frame::Pull {
            request_id: 4,
            shard: 0,
            min_version: 0,
        }),
    )
    .await;
    let p = recv(&mut ws).await.expect("still open");
    assert!(matches!(decode(&p), Frame::Params { version: 2, .. }));
    let s = status(&url).await;
    assert_eq!(s["shards"][0]["staleness_max"], 1);
    assert_eq!(s["shards"][0]["rejected_by_reason"]["too_stale"], 1);
    assert_eq!(s["workers"][0]["pushes_rejected"], 1);
    running.stop().await.expect("clean shutdown");
}

// ------------------------------------------------------------------------------------------
// Issue 10: the refusals that keep the connection open, the compressed payloads, and the
// credential, from a raw client, each with the same four checks as `rejected`.

/// Shard 0's socket for `worker`, opened from the loopback address `from` (another client IP
/// for the server's per-IP limits), after Hello; returns the shard version.
async fn hello_from(running: &Running, worker: u64, from: [u8; 4]) -> (crate::util::Ws, u64) {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind(std::net::SocketAddr::from((from, 0)))
        .expect("bind a loopback address");
    let tcp = socket.connect(running.addr).await.expect("connect");
    let url = format!("ws://{}/ws/shard/0", running.addr);
    let (ws, _) = tokio_tungstenite::client_async(
        url.as_str(),
        tokio_tungstenite::MaybeTlsStream::Plain(tcp),
    )
    .await
    .expect("upgrade");
    crate::util::handshake_on(ws, &running.url(), worker, 0).await
}

/// How often shard 0 counted `code`, as a rejected push or a refused frame.
fn counted(status: &serde_json::Value, code: ErrorCode) -> u64 {
    let shard = &status["shards"][0];
    shard["rejected_by_reason"][code.name()]
        .as_u64()
        .unwrap_or(0)
        + shard["frames_rejected_by_reason"][code.name()]
            .as_u64()
            .unwrap_or(0)
}

/// A refusal that keeps the connection open: after `warmup` (each frame answered), `bad` gets
/// an Error with `code` echoing `request_id`; shard 0's parameters are byte-identical and its
/// version unchanged; the refusal is counted once; the same connection still gets Params; and
/// another worker (from 127.0.0.2, another client IP) still has its push applied. Returns the
/// final status.
async fn refused_open(
    cfg: crowdgrad::config::ServeConfig,
    warmup: Vec<Vec<u8>>,
    bad: Vec<u8>,
    code: ErrorCode,
    request_id: u32,
) -> serde_json::Value {
    assert!(
        !code.is_fatal(),
        "{code:?} closes the connection: use `rejected`"
    );
    let running = server(cfg).await;
    let url = running.url();
    let me = join(&url).await.worker_id;
    let other = join(&url).await.worker_id;
    let (mut ws, _) = handshake(&running, me, 0).await;
    for f in warmup {
        send(&mut ws, f).await;
        recv(&mut ws).await.expect("a reply to each warm-up frame");
    }
    let before = status(&url).await;
    let (_, params_before) = crate::util::get(format!("{url}/api/params")).await;
    send(&mut ws, bad).await;
    match decode(&recv(&mut ws).await.expect("an error frame")) {
        Frame::Error {
            error,
            request_id: echoed,
            ..
        } => {
            assert_eq!(error.code, code, "{}", error.message);
            assert!(!error.message.is_empty());
            assert_eq!(echoed, request_id);
        }
        other => panic!("expected an Error frame, got {other:?}"),
    }
    let after = status(&url).await;
    let (_, params_after) = crate::util::get(format!("{url}/api/params")).await;
    assert!(
        params_before == params_after,
        "a refused frame changed the parameters"
    );
    assert_eq!(
        after["shards"][0]["version"],
        before["shards"][0]["version"]
    );
    assert_eq!(
        counted(&after, code),
        counted(&before, code) + 1,
        "{}",
        after["shards"][0]
    );
    // Not fatal: the same socket still answers a pull.
    send(
        &mut ws,
        wire::encode(&Frame::Pull {
            request_id: 900,
            shard: 0,
            min_version: 0,
        }),
    )
    .await;
    let p = recv(&mut ws).await.expect("still open");
    assert!(matches!(
        decode(&p),
        Frame::Params {
            request_id: 900,
            ..
        }
    ));
    // Another worker, another client: its push is applied.
    let (mut ws2, v) = hello_from(&running, other, [127, 0, 0, 2]).await;
    let n = join_len(&running).await;
    send(&mut ws2, wire::encode_push(1, 0, v, 32, &vec![1e-4; n])).await;
    let ack = recv(&mut ws2).await.expect("ack");
    assert!(
        matches!(decode(&ack), Frame::Ack { request_id: 1, .. }),
        "{:?}",
        decode(&ack)
    );
    let end = status(&url).await;
    assert_eq!(
        end["shards"][0]["version"].as_u64(),
        after["shards"][0]["version"].as_u64().map(|v| v + 1),
        "the other worker's push was applied"
    );
    running.stop().await.expect("clean shutdown");
    end
}

fn push(request_id: u32, base: u64, samples: u32, g: &[f32]) -> Vec<u8> {
    wire::encode_push(request_id, 0, base, samples, g)
}

#[tokio::test]
async fn too_stale_push_changes_nothing_and_keeps_the_connection() {
    let mut cfg = config();
    cfg.training.staleness =
        crowdgrad_core::shard::StalenessPolicy::parse("drop:1").expect("policy");
    // Three different gradients: the same one twice is a replay (issue 21).
    let g = |v: f32| vec![v; SHARD0];
    let warmup = vec![push(1, 0, 32, &g(1e-3)), push(2, 0, 32, &g(2e-3))];
    refused_open(
        cfg,
        warmup,
        push(3, 0, 32, &g(3e-3)),
        ErrorCode::TooStale,
        3,
    )
    .await;
}

#[tokio::test]
async fn replayed_push_request_id() {
    let g = vec![1e-3f32; SHARD0];
    let warmup = vec![push(5, 0, 32, &g)];
    refused_open(config(), warmup, push(5, 1, 32, &g), ErrorCode::Replayed, 5).await;
}

#[tokio::test]
async fn push_with_a_value_above_the_bound() {
    let mut g = vec![1e-3f32; SHARD0];
    g[77] = 2e4;
    refused_open(
        config(),
        vec![],
        push(8, 0, 32, &g),
        ErrorCode::OutOfBounds,
        8,
    )
    .await;
}

#[tokio::test]
async fn push_claiming_no_samples() {
    let g = vec![1e-3f32; SHARD0];
    refused_open(
        config(),
        vec![],
        push(8, 0, 0, &g),
        ErrorCode::OutOfBounds,
        8,
    )
    .await;
}

#[tokio::test]
async fn push_over_the_per_ip_rate_is_busy_and_other_clients_are_not_held_back() {
    let mut cfg = config();
    cfg.limits.push_rate = 0.0;
    cfg.limits.push_rate_per_ip = 2.0;
    let g = vec![1e-3f32; SHARD0];
    let warmup = vec![push(1, 0, 32, &g), push(2, 1, 32, &g)];
    let s = refused_open(cfg, warmup, push(3, 2, 32, &g), ErrorCode::Busy, 3).await;
    assert_eq!(s["limits"]["pushes_limited_per_ip"], 1, "{}", s["limits"]);
}

#[tokio::test]
async fn hello_with_a_forged_credential() {
    rejected_with(
        config(),
        false,
        |_, me| {
            bin(hello(me)
                .request_id(6)
                .credential(Some(format!("{me}.forged")))
                .frame())
        },
        ErrorCode::Unauthorized,
        6,
    )
    .await;
}

/// A compressed push in `enc` of SHARD0 finite values, then `patch` applied to its payload
/// bytes (which start after the 32-byte header; pushes carry no meta).
fn compressed_push(enc: crowdgrad_core::codec::Encoding, patch: impl FnOnce(&mut [u8])) -> Message {
    let mut f = wire::encode_push_as(enc, 9, 0, 0, 32, &vec![0.01f32; SHARD0], None)
        .expect("finite values encode");
    patch(&mut f[HEADER_LEN..]);
    bin(f)
}

#[tokio::test]
async fn bf16_push_holding_a_nan() {
    let bad = compressed_push(crowdgrad_core::codec::Encoding::Bf16, |p| {
        p[2 * 500..2 * 500 + 2].copy_from_slice(&0x7fc0u16.to_le_bytes());
    });
    rejected(true, bad, ErrorCode::NotFinite, 9).await;
}

#[tokio::test]
async fn int8_push_with_a_nan_block_scale() {
    // The scales come first: block 3's scale is NaN.
    let bad = compressed_push(crowdgrad_core::codec::Encoding::INT8, |p| {
        p[12..16].copy_from_slice(&f32::NAN.to_le_bytes());
    });
    rejected(true, bad, ErrorCode::Malformed, 9).await;
}

#[tokio::test]
async fn int8_push_of_the_wrong_length() {
    let f = wire::encode_push_as(
        crowdgrad_core::codec::Encoding::INT8,
        9,
        0,
        0,
        32,
        &vec![0.01f32; SHARD0 + 256],
        None,
    )
    .expect("encodes");
    rejected(true, bin(f), ErrorCode::WrongLength, 9).await;
}

#[tokio::test]
async fn int8_push_with_code_minus_128() {
    // Found by fuzz/ `payload`: -128 times a large scale decoded to -infinity; refused now.
    let bad = compressed_push(crowdgrad_core::codec::Encoding::INT8, |p| {
        p[..4].copy_from_slice(&crowdgrad_core::codec::MAX_INT8_SCALE.to_le_bytes());
        let scales = 4 * SHARD0.div_ceil(256);
        p[scales + 3] = 0x80;
    });
    rejected(true, bad, ErrorCode::Malformed, 9).await;
}

/// A worker that closes its socket gets the shard's Close back (RFC 6455 5.5.1), before and
/// after its Hello: the shard reads frames itself (server/src/shard/upgrade.rs) and must still
/// answer the closing handshake, or a browser's `close` event says the close was not clean.
#[tokio::test]
async fn a_close_from_the_worker_is_answered_with_a_close() {
    use futures_util::StreamExt;
    let running = server(config()).await;
    let plain = connect(&running, 0).await;
    let me = join(&running.url()).await.worker_id;
    let (shaken, _) = handshake(&running, me, 1).await;
    for (what, mut ws) in [("before its Hello", plain), ("after its Hello", shaken)] {
        ws.close(None).await.expect("close sent");
        let reply = tokio::time::timeout(std::time::Duration::from_secs(5), ws.next())
            .await
            .unwrap_or_else(|_| panic!("{what}: no reply to the close within 5 s"));
        assert!(
            matches!(reply, Some(Ok(Message::Close(_)))),
            "{what}: the shard answered a close with {reply:?}"
        );
    }
    running.stop().await.expect("clean shutdown");
}
