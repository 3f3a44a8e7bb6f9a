//! Issue 10, access control: private runs (join token), session credentials on every Hello,
//! nothing secret in the status or the page.

use crate::util::{config, connect, credential, get, join, recv, send, server, status, wait_for};
use crowdgrad::support::credential::Secret;
use crowdgrad::worker::{WorkOptions, WorkerThread};
use crowdgrad_core::spec::JoinRequest;
use crowdgrad_core::wire::{self, ClientKind, ErrorCode, Message as Frame};
use std::time::Duration;

const TOKEN: &str = "class-of-2025-Zq8x";

/// POST /api/join with an optional `Authorization` header: status, `WWW-Authenticate`, body.
async fn join_with(base: &str, authorization: Option<&str>) -> (u16, Option<String>, String) {
    let url = format!("{base}/api/join");
    let auth = authorization.map(str::to_owned);
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let body = serde_json::to_vec(&JoinRequest::new(ClientKind::Native)).expect("json");
        let mut req = agent.post(&url).header("content-type", "application/json");
        if let Some(a) = &auth {
            req = req.header("authorization", a);
        }
        let mut r = req.send(&body[..]).expect("request");
        let www = r
            .headers()
            .get("www-authenticate")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let status = r.status().as_u16();
        let body = r.body_mut().read_to_string().expect("body");
        (status, www, body)
    })
    .await
    .expect("join")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_run_refuses_joins_without_the_token_and_trains_with_it() {
    let mut cfg = config();
    cfg.join_token = Some(Secret::new(TOKEN));
    assert!(
        !format!("{cfg:?}").contains(TOKEN),
        "the token never prints"
    );
    let running = server(cfg).await;
    let url = running.url();
    for auth in [
        None,
        Some("Bearer wrong-token"),
        Some("Bearer class-of-2025-Zq8"),
        Some(&format!("Basic {TOKEN}")[..]),
        Some("Bearer "),
    ] {
        let (code, www, body) = join_with(&url, auth).await;
        assert_eq!(code, 401, "{auth:?}: {body}");
        assert!(www.is_some_and(|w| w.starts_with("Bearer")), "{auth:?}");
        assert!(body.contains("private"), "{body}");
    }
    let (code, _, body) = join_with(&url, Some(&format!("Bearer {TOKEN}"))).await;
    assert_eq!(code, 200, "{body}");
    let s = status(&url).await;
    assert_eq!(s["private_run"], true);
    assert_eq!(s["limits"]["joins_unauthorized"], 5, "{}", s["limits"]);
    assert_eq!(s["totals"]["workers"]["registered"], 1);

    // A native worker without the token gives up at once with a clear message...
    let mut o = WorkOptions::new(&url);
    o.duration = Some(Duration::from_secs(30));
    let t0 = std::time::Instant::now();
    let refused = WorkerThread::spawn(o.clone()).join().expect("summary");
    assert!(refused.refused, "{refused:?}");
    assert!(t0.elapsed() < Duration::from_secs(10));
    let why = refused.last_error.unwrap_or_default();
    assert!(why.contains("401") && why.contains("--join-token"), "{why}");
    assert_eq!(refused.stats.steps, 0);

    // ...and with it, trains.
    o.join_token = Some(TOKEN.into());
    let w = WorkerThread::spawn(o);
    wait_for(&url, Duration::from_secs(30), "the worker to train", |s| {
        s["totals"]["pushes_applied"].as_u64() > Some(50)
    })
    .await;
    let summary = w.stop().expect("summary");
    assert!(
        !summary.refused && summary.stats.pushes_accepted > 50,
        "{summary:?}"
    );

    // Nothing secret in the status, the worker list or the page.
    for path in ["/api/status", "/api/workers", "/", "/app.js"] {
        let (_, body) = get(format!("{url}{path}")).await;
        let body = String::from_utf8_lossy(&body);
        assert!(!body.contains(TOKEN), "{path} shows the token");
    }
    running.stop().await.expect("stops");
}

/// `worker_id`'s Hello to shard 0 carrying `credential`, request id 5 (what [`first_reply`]
/// matches).
fn hello_with(worker_id: u64, credential: Option<String>) -> Vec<u8> {
    crate::util::hello(worker_id)
        .request_id(5)
        .credential(credential)
        .frame()
}

/// The reply to `frame` as the first frame on a fresh socket: an error code, or `None` for a
/// Welcome.
async fn first_reply(running: &crowdgrad::Running, frame: Vec<u8>) -> Option<ErrorCode> {
    let mut ws = connect(running, 0).await;
    send(&mut ws, frame).await;
    let reply = recv(&mut ws).await.expect("a reply");
    match wire::decode(&reply, usize::MAX).expect("decodes") {
        Frame::Welcome { request_id: 5, .. } => None,
        Frame::Error {
            request_id: 5,
            error,
            ..
        } => {
            assert!(recv(&mut ws).await.is_none(), "closed after a fatal error");
            Some(error.code)
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn a_hello_needs_its_own_workers_credential() {
    let running = server(config()).await;
    let url = running.url();
    let alice = join(&url).await;
    let bob = join(&url).await;
    let (a, b) = (alice.worker_id, bob.worker_id);
    let cred_a = alice.credential.clone().expect("a credential");
    let cred_b = bob.credential.clone().expect("a credential");
    assert_ne!(cred_a, cred_b);
    assert!(
        !status(&url).await.to_string().contains(&cred_a),
        "no credential in status"
    );

    // Speaking as Alice: without a credential, with Bob's, with a forged one.
    let mut forged = cred_a.clone().into_bytes();
    forged[0] = if forged[0] == b'a' { b'b' } else { b'a' };
    for cred in [
        None,
        Some(cred_b.clone()),
        Some(String::from_utf8(forged).expect("hex")),
        Some("not-a-credential".into()),
    ] {
        assert_eq!(
            first_reply(&running, hello_with(a, cred.clone())).await,
            Some(ErrorCode::Unauthorized),
            "{cred:?}"
        );
    }
    // A worker nobody joined as is unknown, whatever it carries.
    assert_eq!(
        first_reply(&running, hello_with(424_242, Some(cred_a.clone()))).await,
        Some(ErrorCode::UnknownWorker)
    );
    // Each with its own credential is welcome.
    assert_eq!(
        first_reply(&running, hello_with(a, Some(cred_a))).await,
        None
    );
    assert_eq!(
        first_reply(&running, hello_with(b, credential(&url, b))).await,
        None
    );
    let s = status(&url).await;
    assert_eq!(
        s["shards"][0]["frames_rejected_by_reason"]["unauthorized"], 4,
        "{}",
        s["shards"][0]
    );
    running.stop().await.expect("stops");
}
