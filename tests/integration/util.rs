//! Shared helpers: MNIST loaded once, servers on ephemeral ports, raw WebSocket clients.

use crowdgrad::config::ServeConfig;
use crowdgrad::support::data::TrainTest;
use crowdgrad::Running;
use crowdgrad_core::spec::{JoinRequest, JoinResponse};
use crowdgrad_core::wire::{self, ClientKind, Hello, Message as Frame, PROTOCOL_VERSION};
use futures_util::{SinkExt, StreamExt};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// A raw client socket.
pub type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// The repository's data directory for MNIST.
pub fn mnist_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../data/mnist")
}

/// Real MNIST, fetched (SHA-256 verified) on first use and parsed once per test binary.
pub fn mnist() -> TrainTest {
    static DATA: OnceLock<TrainTest> = OnceLock::new();
    DATA.get_or_init(|| {
        crowdgrad::support::data::ensure(&mnist_dir(), "mnist", true).expect("MNIST is available")
    })
    .clone()
}

/// Server defaults with evaluation every half second.
pub fn config() -> ServeConfig {
    let mut c = ServeConfig::defaults(mnist_dir());
    c.eval_every = Duration::from_millis(500);
    c.web_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../web");
    c
}

/// Starts a server on an ephemeral loopback port.
pub async fn server(cfg: ServeConfig) -> Running {
    crowdgrad::start("127.0.0.1:0".parse().expect("addr"), cfg, mnist())
        .await
        .expect("server starts")
}

/// GET a URL, returning status and body.
pub async fn get(url: String) -> (u16, Vec<u8>) {
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let mut r = agent.get(&url).call().expect("request");
        let status = r.status().as_u16();
        (
            status,
            r.body_mut()
                .with_config()
                .limit(1 << 30)
                .read_to_vec()
                .expect("body"),
        )
    })
    .await
    .expect("join")
}

/// POST raw bytes as JSON, returning status and body.
pub async fn post(url: String, body: Vec<u8>) -> (u16, Vec<u8>) {
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let mut r = agent
            .post(&url)
            .header("content-type", "application/json")
            .send(&body[..])
            .expect("request");
        let status = r.status().as_u16();
        (status, r.body_mut().read_to_vec().expect("body"))
    })
    .await
    .expect("join")
}

/// `/api/status` as JSON.
pub async fn status(base: &str) -> serde_json::Value {
    let (code, body) = get(format!("{base}/api/status")).await;
    assert_eq!(code, 200);
    serde_json::from_slice(&body).expect("status JSON")
}

/// Joins as a native worker. The session credential is remembered for [`hello`] and
/// [`credential`].
pub async fn join(base: &str) -> JoinResponse {
    let body = serde_json::to_vec(&JoinRequest::new(ClientKind::Native)).expect("json");
    let (code, reply) = post(format!("{base}/api/join"), body).await;
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&reply));
    let joined: JoinResponse = serde_json::from_slice(&reply).expect("join reply");
    if let Some(c) = &joined.credential {
        credentials()
            .lock()
            .expect("lock")
            .insert((base.to_string(), joined.worker_id), c.clone());
    }
    joined
}

fn credentials() -> &'static std::sync::Mutex<std::collections::HashMap<(String, u64), String>> {
    static CREDS: OnceLock<std::sync::Mutex<std::collections::HashMap<(String, u64), String>>> =
        OnceLock::new();
    CREDS.get_or_init(Default::default)
}

/// The credential [`join`] got for `worker` from the server at `base`.
pub fn credential(base: &str, worker: u64) -> Option<String> {
    credentials()
        .lock()
        .expect("lock")
        .get(&(base.to_string(), worker))
        .cloned()
}

/// Opens shard `shard`'s socket.
pub async fn connect(running: &Running, shard: u32) -> Ws {
    let url = format!("ws://{}/ws/shard/{shard}", running.addr);
    tokio_tungstenite::connect_async(url.as_str())
        .await
        .expect("connect")
        .0
}

/// Sends a binary frame.
pub async fn send(ws: &mut Ws, frame: Vec<u8>) {
    ws.send(Message::Binary(frame.into())).await.expect("send");
}

/// Next binary frame, or `None` when the socket closed; panics after 10 s.
pub async fn recv(ws: &mut Ws) -> Option<Vec<u8>> {
    loop {
        match tokio::time::timeout(Duration::from_secs(10), ws.next())
            .await
            .expect("reply within 10 s")
        {
            Some(Ok(Message::Binary(b))) => return Some(b.into()),
            Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return None,
            Some(Ok(_)) => continue,
        }
    }
}

/// Connects and completes the Hello/Welcome handshake; returns the socket and shard version.
pub async fn hello(running: &Running, worker_id: u64, shard: u32) -> (Ws, u64) {
    let mut ws = connect(running, shard).await;
    let h = wire::encode(&Frame::Hello {
        request_id: 1,
        shard,
        hello: Hello {
            protocol: PROTOCOL_VERSION,
            worker_id,
            client: ClientKind::Native,
            credential: credential(&running.url(), worker_id),
            ..Default::default()
        },
    });
    send(&mut ws, h).await;
    let reply = recv(&mut ws).await.expect("welcome");
    match wire::decode(&reply, usize::MAX).expect("decodes") {
        Frame::Welcome { welcome, .. } => (ws, welcome.version),
        other => panic!("expected Welcome, got {other:?}"),
    }
}

/// Polls `cond` on the status every 100 ms until it holds; panics after `timeout`.
pub async fn wait_for(
    base: &str,
    timeout: Duration,
    what: &str,
    cond: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let start = std::time::Instant::now();
    loop {
        let s = status(base).await;
        if cond(&s) {
            return s;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}; last status: {s}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
