//! Issue 17: a `crowdgrad shard` process is served through the same hardened listener as
//! `serve` (`crowdgrad::net`), so it refuses connections over its caps before reading a byte,
//! drops a request whose headers never finish, and rate-limits pushes. And a configuration
//! that cannot run is refused before anything is served, never a panic. Issue 21: a
//! credential expires on a shard process too, `--credential-expiry` after its worker's last
//! socket there closed.

use crate::util;
use clap::Parser;
use crowdgrad::shardproc::{ShardArgs, ShardProcConfig};
use crowdgrad::support::credential::RunSecret;
use crowdgrad_core::wire::{self, ErrorCode, Message as Frame};
use futures_util::{SinkExt, StreamExt};
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::net::TcpSocket;
use tokio_tungstenite::tungstenite::Message;

const SECRET: &str = "shard-limits-run-secret-0123456789";

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    shard: ShardArgs,
}

fn shard_config(extra: &[&str]) -> ShardProcConfig {
    let mut args = vec!["shard", "--index", "0", "--of", "1", "--run-secret", SECRET];
    args.extend_from_slice(extra);
    Flags::try_parse_from(args)
        .expect("flags parse")
        .shard
        .check()
        .expect("a valid shard configuration")
}

/// A shard process's server on 127.0.0.1:0, run in this process; stops when dropped.
struct Served {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

async fn serve(cfg: ShardProcConfig) -> Served {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(crowdgrad::shardproc::run(listener, cfg, async move {
        let _ = rx.await;
    }));
    Served {
        addr,
        stop: Some(stop),
    }
}

/// A TCP connection to `to` from the loopback address `from` (127.0.0.0/8 is all local).
async fn connect_from(from: [u8; 4], to: SocketAddr) -> tokio::net::TcpStream {
    let s = TcpSocket::new_v4().expect("socket");
    s.bind(SocketAddr::from((from, 0))).expect("bind source");
    s.connect(to).await.expect("connect")
}

/// What the server says to a new connection from `from` that sends nothing (a refusal is
/// written at once; an accepted idle connection says nothing within `wait`).
async fn first_words(from: [u8; 4], to: SocketAddr, wait: Duration) -> String {
    let s = connect_from(from, to).await;
    let s = s.into_std().expect("std socket");
    tokio::task::spawn_blocking(move || {
        let mut s = s;
        s.set_nonblocking(false).expect("blocking");
        s.set_read_timeout(Some(wait)).expect("timeout");
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    })
    .await
    .expect("reader")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_process_refuses_connections_over_its_caps() {
    let served = serve(shard_config(&[
        "--max-connections",
        "5",
        "--max-unauthenticated",
        "5",
        "--max-connections-per-ip",
        "3",
    ]))
    .await;
    let addr = served.addr;
    // Three idle connections from one address fill its per-IP cap: the fourth gets 429.
    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(connect_from([127, 0, 0, 1], addr).await);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let reply = first_words([127, 0, 0, 1], addr, Duration::from_secs(5)).await;
    assert!(reply.starts_with("HTTP/1.1 429"), "{reply:?}");
    assert!(reply.contains("retry-after"), "{reply:?}");
    // Two more addresses fill the total of 5: the sixth connection gets 503.
    idle.push(connect_from([127, 0, 0, 2], addr).await);
    idle.push(connect_from([127, 0, 0, 3], addr).await);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let reply = first_words([127, 0, 0, 4], addr, Duration::from_secs(5)).await;
    assert!(reply.starts_with("HTTP/1.1 503"), "{reply:?}");
    // Their slots come back when they close.
    drop(idle);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (code, _) = util::get(format!("http://{addr}/healthz")).await;
    assert_eq!(code, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_process_drops_a_request_whose_headers_never_arrive() {
    let served = serve(shard_config(&["--header-timeout", "0.5"])).await;
    let addr = served.addr;
    let (took, reply) = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        s.write_all(b"GET /ws/shard/0 HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            .expect("write");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let t0 = Instant::now();
        let mut buf = Vec::new();
        let _ = s.read_to_end(&mut buf);
        (t0.elapsed(), String::from_utf8_lossy(&buf).into_owned())
    })
    .await
    .expect("slow client");
    assert!(
        took >= Duration::from_millis(400) && took < Duration::from_secs(5),
        "closed after {took:?}: {reply:?}"
    );
}

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn next(ws: &mut Ws) -> Vec<u8> {
    match tokio::time::timeout(Duration::from_secs(10), ws.next())
        .await
        .expect("a reply within 10 s")
    {
        Some(Ok(Message::Binary(b))) => b.to_vec(),
        other => panic!("expected a binary frame, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_process_rate_limits_pushes() {
    let served = serve(shard_config(&["--push-rate", "5"])).await;
    let url = format!("ws://{}/ws/shard/0", served.addr);
    let (mut ws, _) = tokio_tungstenite::connect_async(url.as_str())
        .await
        .expect("connect");
    let worker = 7;
    let hello = util::hello(worker)
        .credential(Some(RunSecret::shared(SECRET).issue(worker)))
        .frame();
    ws.send(Message::Binary(hello.into())).await.expect("send");
    let len = match wire::decode(&next(&mut ws).await, usize::MAX).expect("decodes") {
        Frame::Welcome { welcome, .. } => welcome.range.len(),
        other => panic!("expected Welcome, got {other:?}"),
    };
    let grad = vec![1e-4f32; len];
    // 20 pushes at once: the bucket holds 5.
    for i in 0..20u32 {
        // Each a little different: the same gradient twice is a replay (issue 21).
        let g: Vec<f32> = grad.iter().map(|x| x * (1.0 + i as f32 * 1e-3)).collect();
        let f = wire::encode_push(100 + i, 0, 0, 32, &g);
        ws.send(Message::Binary(f.into())).await.expect("send");
    }
    let (mut acks, mut busy) = (0, 0);
    for _ in 0..20 {
        match wire::decode(&next(&mut ws).await, usize::MAX).expect("decodes") {
            Frame::Ack { .. } => acks += 1,
            Frame::Error { error, .. } if error.code == ErrorCode::Busy => busy += 1,
            other => panic!("{other:?}"),
        }
    }
    assert!((5..=7).contains(&acks), "{acks} acks, {busy} busy");
    assert_eq!(acks + busy, 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue17_a_round_over_the_memory_bound_is_refused_at_start_not_a_panic() {
    // 9.5M parameters in one shard, a median round of 128 pushes kept apart: 4.8 GB.
    let mut cfg = util::config();
    cfg.training.model = "mlp:12000".into();
    cfg.training.shards = 1;
    cfg.training.consistency = crowdgrad_core::shard::Consistency::Sync { k: 128 };
    cfg.training.aggregation = crowdgrad_core::robust::Aggregation::parse("median").expect("rule");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let e = crowdgrad::run(listener, cfg, util::mnist(), std::future::pending())
        .await
        .expect_err("refused");
    let e = e.to_string();
    assert!(e.contains("sync:128") && e.contains("--consistency"), "{e}");
}

/// Opens a socket to `addr`'s shard 0 and sends `worker`'s Hello with its credential: the
/// socket, and the error code if the Hello was refused.
async fn hello_as(addr: SocketAddr, worker: u64) -> (Ws, Option<ErrorCode>) {
    let url = format!("ws://{addr}/ws/shard/0");
    let (mut ws, _) = tokio_tungstenite::connect_async(url.as_str())
        .await
        .expect("connect");
    let hello = util::hello(worker)
        .credential(Some(RunSecret::shared(SECRET).issue(worker)))
        .frame();
    ws.send(Message::Binary(hello.into())).await.expect("send");
    let code = match wire::decode(&next(&mut ws).await, usize::MAX).expect("decodes") {
        Frame::Welcome { .. } => None,
        Frame::Error { error, .. } => Some(error.code),
        other => panic!("expected Welcome or Error, got {other:?}"),
    };
    (ws, code)
}

/// Closes `ws` and waits until the server ended it (so the shard has seen the close).
async fn close(mut ws: Ws) {
    let _ = ws.close(None).await;
    let drain = async { while ws.next().await.is_some() {} };
    tokio::time::timeout(Duration::from_secs(10), drain)
        .await
        .expect("the server closes within 10 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_credential_expires_on_a_shard_process_once_its_worker_is_away() {
    let expiry = Duration::from_secs(3);
    let served = serve(shard_config(&["--credential-expiry", "3"])).await;
    let addr = served.addr;
    // Connected longer than the expiry: a second socket of the same worker is still admitted.
    let (first, code) = hello_as(addr, 5).await;
    assert_eq!(code, None, "a credential this shard never saw is admitted");
    tokio::time::sleep(expiry + Duration::from_millis(500)).await;
    let (second, code) = hello_as(addr, 5).await;
    assert_eq!(
        code, None,
        "a connected worker's credential does not expire"
    );
    close(first).await;
    close(second).await;
    // Away longer than the expiry (counted from the server's side of the close, which the
    // waits above saw end): refused `unknown_worker`, so the worker joins again.
    tokio::time::sleep(expiry + Duration::from_millis(500)).await;
    let (ws, code) = hello_as(addr, 5).await;
    assert_eq!(code, Some(ErrorCode::UnknownWorker));
    drop(ws);
    let (ws, code) = hello_as(addr, 5).await;
    assert_eq!(code, Some(ErrorCode::UnknownWorker), "and stays refused");
    drop(ws);
    // Another worker (a fresh join's new id) is admitted.
    let (ws, code) = hello_as(addr, 6).await;
    assert_eq!(code, None);
    close(ws).await;
    // A worker back within the expiry is admitted again.
    let (ws, code) = hello_as(addr, 6).await;
    assert_eq!(code, None, "back at once");
    close(ws).await;
    // Bad values are refused at start.
    for bad in ["0", "-1", "nan", "1e12"] {
        let e = Flags::try_parse_from([
            "shard",
            "--index",
            "0",
            "--of",
            "1",
            "--run-secret",
            SECRET,
            "--credential-expiry",
            bad,
        ])
        .map(|f| f.shard.check());
        assert!(!matches!(e, Ok(Ok(_))), "--credential-expiry {bad}");
    }
}
