//! Issue 10, limits: every limit refused with its documented error frame or HTTP status,
//! counted in `/api/status` (`limits`), and other clients unaffected.

use crate::util::{config, connect, handshake, join, recv, send, server, status};
use crowdgrad_core::spec::JoinRequest;
use crowdgrad_core::wire::{self, ClientKind, ErrorCode, Message as Frame};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

/// A request from "client `ip`" (via X-Forwarded-For, for servers run with --trust-proxy):
/// status, Retry-After.
async fn request(url: String, post: bool, ip: &str) -> (u16, Option<String>) {
    let ip = ip.to_string();
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let mut r = if post {
            let body = serde_json::to_vec(&JoinRequest::new(ClientKind::Native)).expect("json");
            agent
                .post(&url)
                .header("x-forwarded-for", &ip)
                .send(&body[..])
                .expect("request")
        } else {
            agent
                .get(&url)
                .header("x-forwarded-for", &ip)
                .call()
                .expect("request")
        };
        let _ = r.body_mut().read_to_vec();
        let retry = r
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        (r.status().as_u16(), retry)
    })
    .await
    .expect("request")
}

#[tokio::test]
async fn joins_and_downloads_per_ip_per_minute_get_429_with_retry_after() {
    let mut cfg = config();
    cfg.limits.join_rate = 3;
    cfg.limits.download_rate = 2;
    cfg.limits.trust_proxy = true;
    let running = server(cfg).await;
    let url = running.url();
    let join_url = format!("{url}/api/join");
    for _ in 0..3 {
        assert_eq!(request(join_url.clone(), true, "203.0.113.7").await.0, 200);
    }
    let (code, retry) = request(join_url.clone(), true, "203.0.113.7").await;
    assert_eq!(code, 429);
    let retry: u64 = retry.expect("Retry-After").parse().expect("seconds");
    assert!((1..=20).contains(&retry), "{retry}");
    // Another client (another forwarded address, another /64) is not held back.
    assert_eq!(request(join_url.clone(), true, "203.0.113.8").await.0, 200);
    assert_eq!(request(join_url.clone(), true, "2001:db8::1").await.0, 200);

    let part = join(&url).await.partition;
    let data = format!("{url}{}", part.images);
    assert_eq!(request(data.clone(), false, "198.51.100.1").await.0, 200);
    assert_eq!(request(data.clone(), false, "198.51.100.1").await.0, 200);
    let (code, retry) = request(data.clone(), false, "198.51.100.1").await;
    assert_eq!(code, 429);
    assert!(retry.is_some());
    assert_eq!(request(data, false, "198.51.100.2").await.0, 200);
    let l = &status(&url).await["limits"];
    assert_eq!(l["joins_limited"], 1, "{l}");
    assert_eq!(l["downloads_limited"], 1, "{l}");
    running.stop().await.expect("stops");
}

/// Issue 21's join admission with `--admission-floor 3`: three fresh identities join, the
/// fourth (from another address, so no per-IP limit is involved) waits with 429 and
/// `Retry-After: 5`, since nobody is established yet; a refused join registers nothing.
#[tokio::test]
async fn new_identities_beyond_the_admission_floor_wait() {
    let mut cfg = config();
    cfg.admission_floor = 3;
    cfg.limits.trust_proxy = true;
    let running = server(cfg).await;
    let url = running.url();
    let join_url = format!("{url}/api/join");
    for i in 0..3 {
        let ip = format!("203.0.113.{}", 10 + i);
        assert_eq!(request(join_url.clone(), true, &ip).await.0, 200);
    }
    for ip in ["198.51.100.20", "2001:db8::20"] {
        let (code, retry) = request(join_url.clone(), true, ip).await;
        assert_eq!((code, retry.as_deref()), (429, Some("5")), "{ip}");
    }
    let s = status(&url).await;
    assert_eq!(s["totals"]["workers"]["registered"], 3, "{}", s["totals"]);
    running.stop().await.expect("stops");
}

/// Connects and reads what the server says before sending anything.
fn raw_reply(addr: std::net::SocketAddr) -> String {
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_tcp_connection_counts_in_total_and_per_ip() {
    let mut cfg = config();
    cfg.max_connections = 4;
    cfg.limits.max_connections_per_ip = 3;
    let running = server(cfg).await;
    let addr = running.addr;
    // Three idle TCP connections (never upgraded, never a request): the per-IP limit is full.
    let idle: Vec<_> = (0..3)
        .map(|_| std::net::TcpStream::connect(addr).expect("connect"))
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let reply = tokio::task::spawn_blocking(move || raw_reply(addr))
        .await
        .expect("reply");
    assert!(reply.starts_with("HTTP/1.1 429"), "{reply}");
    assert!(reply.contains("retry-after"), "{reply}");
    drop(idle);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let s = status(&running.url()).await;
    assert_eq!(
        s["limits"]["connections_refused_per_ip"], 1,
        "{}",
        s["limits"]
    );
    // The idle ones are gone; the one open is this status request's own.
    assert_eq!(s["limits"]["connections_open"], 1, "{}", s["limits"]);
    running.stop().await.expect("stops");

    // The total: with the per-IP limit off, the fifth connection is refused with 503.
    let mut cfg = config();
    cfg.max_connections = 4;
    cfg.limits.max_unauthenticated = Some(4);
    cfg.limits.max_connections_per_ip = 0;
    let running = server(cfg).await;
    let addr = running.addr;
    let idle: Vec<_> = (0..4)
        .map(|_| std::net::TcpStream::connect(addr).expect("connect"))
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let reply = tokio::task::spawn_blocking(move || raw_reply(addr))
        .await
        .expect("reply");
    assert!(reply.starts_with("HTTP/1.1 503"), "{reply}");
    drop(idle);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let s = status(&running.url()).await;
    assert_eq!(
        s["limits"]["connections_refused_total"], 1,
        "{}",
        s["limits"]
    );
    running.stop().await.expect("stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_silent_sockets_and_missing_hellos_are_closed() {
    let mut cfg = config();
    cfg.limits.header_timeout = Duration::from_millis(500);
    cfg.limits.hello_timeout = Duration::from_millis(400);
    cfg.limits.idle_timeout = Duration::from_millis(600);
    let running = server(cfg).await;
    let url = running.url();
    let addr = running.addr;

    // A client that sends half a request line and stops: closed after the header deadline.
    let slow = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        s.write_all(b"GET /api/status HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            .expect("write");
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let t0 = Instant::now();
        let mut buf = Vec::new();
        let r = s.read_to_end(&mut buf);
        (
            t0.elapsed(),
            r.is_ok(),
            String::from_utf8_lossy(&buf).to_string(),
        )
    });

    // A WebSocket that never says Hello: `protocol` error with request id 0, then Close.
    let t0 = Instant::now();
    let mut ws = connect(&running, 0).await;
    let frame = recv(&mut ws).await.expect("an error frame");
    match wire::decode(&frame, usize::MAX).expect("decodes") {
        Frame::Error {
            request_id: 0,
            error,
            ..
        } => {
            assert_eq!(error.code, ErrorCode::Protocol);
            assert!(error.message.contains("Hello"), "{}", error.message);
        }
        other => panic!("{other:?}"),
    }
    assert!(recv(&mut ws).await.is_none(), "closed");
    let waited = t0.elapsed();
    assert!(waited >= Duration::from_millis(350) && waited < Duration::from_secs(3));

    // A worker that says Hello and then nothing: Bye (idle), then Close.
    let me = join(&url).await.worker_id;
    let (mut ws, _) = handshake(&running, me, 0).await;
    let frame = recv(&mut ws).await.expect("a bye");
    match wire::decode(&frame, usize::MAX).expect("decodes") {
        Frame::Bye { bye, .. } => assert!(bye.reason.starts_with("idle"), "{}", bye.reason),
        other => panic!("{other:?}"),
    }
    assert!(recv(&mut ws).await.is_none(), "closed");

    let (took, _, reply) = slow.await.expect("slow client");
    assert!(took < Duration::from_secs(3), "{took:?}: {reply}");
    let s = status(&url).await;
    let l = &s["limits"];
    assert_eq!(l["hello_timeouts"], 1, "{l}");
    assert_eq!(l["idle_timeouts"], 1, "{l}");
    assert_eq!(s["workers_connected"], 0);
    running.stop().await.expect("stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_over_the_rate_are_busy_counted_and_not_applied() {
    let mut cfg = config();
    cfg.limits.push_rate = 5.0;
    let running = server(cfg).await;
    let url = running.url();
    let flood = join(&url).await;
    let calm = join(&url).await;
    let n = flood.run.shards[0].range.len();
    let grad = vec![1e-4f32; n];
    let (mut ws, _) = handshake(&running, flood.worker_id, 0).await;
    // 20 pushes at once: the bucket holds 5.
    for i in 0..20u32 {
        // Each a little different: the same gradient twice is a replay (issue 21).
        let g: Vec<f32> = grad.iter().map(|x| x * (1.0 + i as f32 * 1e-3)).collect();
        send(&mut ws, wire::encode_push(100 + i, 0, 0, 32, &g)).await;
    }
    let (mut acks, mut busy) = (0, 0);
    for _ in 0..20 {
        let f = recv(&mut ws).await.expect("a reply per push");
        match wire::decode(&f, usize::MAX).expect("decodes") {
            Frame::Ack { .. } => acks += 1,
            Frame::Error { error, .. } if error.code == ErrorCode::Busy => busy += 1,
            other => panic!("{other:?}"),
        }
    }
    assert!((5..=7).contains(&acks), "{acks} acks");
    assert_eq!(acks + busy, 20);
    // The socket stays open (busy is not fatal) and the other worker is not held back.
    let (mut other, v) = handshake(&running, calm.worker_id, 0).await;
    assert_eq!(v, acks as u64, "only accepted pushes were applied");
    send(&mut other, wire::encode_push(1, 0, v, 32, &grad)).await;
    let f = recv(&mut other).await.expect("ack");
    assert!(matches!(
        wire::decode(&f, usize::MAX),
        Ok(Frame::Ack { .. })
    ));
    let s = status(&url).await;
    assert_eq!(
        s["limits"]["pushes_limited_per_worker"], busy,
        "{}",
        s["limits"]
    );
    assert_eq!(s["shards"][0]["rejected_by_reason"]["busy"], busy);
    drop(ws);
    running.stop().await.expect("stops");
}
