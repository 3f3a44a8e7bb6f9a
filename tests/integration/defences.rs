//! The defences issue:
//! - silent sockets: a TCP connection that never sends a byte is closed at the first-byte
//!   deadline (`--header-timeout`), counted as `silent_closed`, on `serve` and on a
//!   `crowdgrad shard` alike (both use `crowdgrad::net`), so silent sockets cannot hold every
//!   connection slot and lock honest clients out;
//! - admin-token guesses: a client that sent 5 different wrong tokens gets 429 with
//!   Retry-After on every admin call, the right token included, counted in `limits`.

use crate::util::{config, get, server, status};
use clap::Parser;
use crowdgrad::shardproc::ShardArgs;
use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// Opens `n` connections to `addr` that never send anything.
fn silent(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    (0..n)
        .map(|_| TcpStream::connect(addr).expect("connect"))
        .collect()
}

/// Reads each socket until it ends: how long after `t0` the last one was closed by the server
/// (all must end with EOF, no bytes, within 5 s).
async fn closed_after(sockets: Vec<TcpStream>, t0: Instant) -> Duration {
    tokio::task::spawn_blocking(move || {
        for mut s in sockets {
            s.set_read_timeout(Some(Duration::from_secs(5)))
                .expect("timeout");
            let mut buf = Vec::new();
            let r = s.read_to_end(&mut buf);
            // A close is EOF (or a reset); a read timeout would be an error of another kind.
            match r {
                Ok(0) => {}
                Ok(n) => panic!("a silent socket got {n} bytes: {buf:?}"),
                Err(e) => assert!(
                    matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted
                    ),
                    "a silent socket was not closed: {e}"
                ),
            }
        }
        t0.elapsed()
    })
    .await
    .expect("reader")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_sockets_are_closed_at_the_header_timeout_and_counted() {
    let mut cfg = config();
    cfg.limits.header_timeout = Duration::from_millis(500);
    let running = server(cfg).await;
    let t0 = Instant::now();
    let sockets = silent(running.addr, 20);
    let took = closed_after(sockets, t0).await;
    assert!(
        took >= Duration::from_millis(400) && took < Duration::from_millis(2_000),
        "closed after {took:?}"
    );
    let l = &status(&running.url()).await["limits"];
    assert_eq!(l["silent_closed"], 20, "{l}");
    // The status request's own connection is the only one open.
    assert_eq!(l["connections_open"], 1, "{l}");
    running.stop().await.expect("stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_full_of_silent_sockets_answers_again_right_after_the_deadline() {
    let mut cfg = config();
    cfg.max_connections = 8;
    cfg.limits.max_connections_per_ip = 0;
    cfg.limits.header_timeout = Duration::from_millis(500);
    let running = server(cfg).await;
    let t0 = Instant::now();
    // Every slot is held by a socket that says nothing (and is never closed by its client).
    let held = silent(running.addr, 8);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (code, _) = get(format!("{}/api/status", running.url())).await;
    assert_eq!(code, 503, "the server is full");
    // Right after the deadline the slots are free again, with the silent sockets still open
    // on this side.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let (code, body) = get(format!("{}/api/status", running.url())).await;
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    let s: serde_json::Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(s["limits"]["silent_closed"], 8, "{}", s["limits"]);
    assert_eq!(
        s["limits"]["connections_refused_total"], 1,
        "{}",
        s["limits"]
    );
    drop(held);
    running.stop().await.expect("stops");
}

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    shard: ShardArgs,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_process_closes_silent_sockets_at_the_header_timeout() {
    let secret = "silent-shard-run-secret-0123456789";
    let cfg = Flags::try_parse_from([
        "shard",
        "--index",
        "0",
        "--of",
        "1",
        "--run-secret",
        secret,
        "--header-timeout",
        "0.5",
        "--max-connections",
        "4",
        "--max-connections-per-ip",
        "0",
    ])
    .expect("flags parse")
    .shard
    .check()
    .expect("a valid shard configuration");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(crowdgrad::shardproc::run(listener, cfg, async move {
        let _ = rx.await;
    }));
    let t0 = Instant::now();
    let sockets = silent(addr, 4);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (code, _) = get(format!("http://{addr}/healthz")).await;
    assert_eq!(code, 503, "the shard is full");
    let took = closed_after(sockets, t0).await;
    assert!(
        took >= Duration::from_millis(400) && took < Duration::from_millis(2_000),
        "closed after {took:?}"
    );
    let (code, _) = get(format!("http://{addr}/healthz")).await;
    assert_eq!(code, 200);
    let _ = stop.send(());
}

/// An admin GET of `state` with `token`: status and Retry-After.
async fn admin_state(base: &str, token: &str) -> (u16, Option<String>) {
    let url = format!("{base}/api/admin/state");
    let token = token.to_string();
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let mut r = agent
            .get(&url)
            .header("authorization", &format!("Bearer {token}"))
            .call()
            .expect("request");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_token_guesses_lock_the_guesser_out_even_from_the_right_token() {
    const TOKEN: &str = "defences-admin-token-0123456789";
    let mut cfg = config();
    cfg.admin_token = Some(crowdgrad::support::credential::Secret::new(TOKEN));
    let running = server(cfg).await;
    let url = running.url();
    assert_eq!(admin_state(&url, TOKEN).await.0, 200);
    let mut codes = Vec::new();
    for i in 0..10 {
        let (code, retry) = admin_state(&url, &format!("guess-{i}-0123456789")).await;
        if code == 429 {
            let secs: u64 = retry.expect("Retry-After").parse().expect("seconds");
            assert!((1..=300).contains(&secs), "{secs}");
        }
        codes.push(code);
    }
    assert_eq!(codes, [401, 401, 401, 401, 401, 429, 429, 429, 429, 429]);
    let (code, retry) = admin_state(&url, TOKEN).await;
    assert_eq!(code, 429, "the right token is refused during the lockout");
    assert!(retry.is_some());
    let l = &status(&url).await["limits"];
    assert_eq!(l["admin_unauthorized"], 5, "{l}");
    assert_eq!(l["admin_locked_out"], 6, "{l}");
    running.stop().await.expect("stops");
}
