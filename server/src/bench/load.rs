//! What `bench churn` and `bench flood` share: the server process they load, its RSS and
//! open fds, and a raw-protocol client (join, Hello with credential, pull) on loopback.

use crate::error::{Error, Result};
use crowdgrad_core::spec::{JoinRequest, JoinResponse};
use crowdgrad_core::wire::{self, ClientKind, Hello, Message as Frame, PROTOCOL_VERSION};
use futures_util::{SinkExt, StreamExt};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tokio_tungstenite::tungstenite::Message;

/// A `crowdgrad serve` child, killed when dropped.
pub(super) struct Server {
    pub(super) child: Child,
    pub(super) url: String,
    pub(super) addr: SocketAddr,
}

impl Server {
    pub(super) fn start(
        exe: &Path,
        data_dir: &Path,
        args: &[String],
        env: &[(String, String)],
    ) -> Result<Self> {
        let mut all: Vec<std::ffi::OsString> =
            ["serve", "--addr", "127.0.0.1:0", "--no-fetch", "--data-dir"]
                .iter()
                .map(Into::into)
                .collect();
        all.push(data_dir.into());
        all.extend(args.iter().map(Into::into));
        Self::command(exe, &all, env)
    }

    /// Any `crowdgrad` command that prints `crowdgrad ... listening on URL` (`serve`, `shard`)
    /// started with exactly `args`; `addr` is the URL's `host:port`.
    pub(super) fn command(
        exe: &Path,
        args: &[std::ffi::OsString],
        env: &[(String, String)],
    ) -> Result<Self> {
        let mut child = Command::new(exe)
            .envs(env.iter().cloned())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| Error::io("starting the server", e))?;
        // Its stderr is drained all along; the last lines are kept to say why it exited.
        let tail = std::sync::Arc::new(std::sync::Mutex::new(std::collections::VecDeque::new()));
        if let Some(err) = child.stderr.take() {
            let tail = tail.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(err)
                    .lines()
                    .map_while(std::result::Result::ok)
                {
                    let mut t = tail.lock().unwrap_or_else(|p| p.into_inner());
                    if t.len() == 8 {
                        t.pop_front();
                    }
                    t.push_back(line);
                }
            });
        }
        let out = child
            .stdout
            .take()
            .ok_or_else(|| Error::Process("no server stdout".into()))?;
        let (tx, rx) = std::sync::mpsc::channel();
        // Reads the address, then keeps draining stdout so the server never blocks on it.
        std::thread::spawn(move || {
            let mut lines = BufReader::new(out).lines();
            for line in lines.by_ref().map_while(std::result::Result::ok) {
                if let Some((_, u)) = line
                    .strip_prefix("crowdgrad ")
                    .and_then(|l| l.split_once("listening on "))
                {
                    let _ = tx.send(u.trim().to_string());
                    break;
                }
            }
            for _ in lines {}
        });
        let mut server = Server {
            child,
            url: String::new(),
            addr: "127.0.0.1:0"
                .parse()
                .map_err(|_| Error::Process("addr".into()))?,
        };
        server.url = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(url) => url,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                return Err(Error::Process(
                    "the server did not start within 60 s".into(),
                ))
            }
            // Its stdout closed before the address: it exited (a bad flag, a port in use).
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                let status = server.child.wait().map(|s| s.to_string());
                std::thread::sleep(Duration::from_millis(100));
                let said: Vec<String> = tail
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .iter()
                    .cloned()
                    .collect();
                return Err(Error::Process(format!(
                    "the server exited before listening ({}): {}",
                    status.unwrap_or_else(|e| e.to_string()),
                    said.join(" | ")
                )));
            }
        };
        server.addr = server
            .url
            .split_once("://")
            .map_or(server.url.as_str(), |(_, a)| a)
            .parse()
            .map_err(|_| Error::Process(format!("server url {}", server.url)))?;
        Ok(server)
    }

    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Current resident memory of `pid`, MiB.
pub fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// Open file descriptors of `pid`.
pub fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

pub(super) fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .into()
}

pub(super) fn get_json(agent: &ureq::Agent, url: &str) -> Result<serde_json::Value> {
    let mut r = agent
        .get(url)
        .call()
        .map_err(|e| Error::Http(e.to_string()))?;
    if r.status() != 200 {
        return Err(Error::Http(format!("GET {url}: {}", r.status())));
    }
    let b = r
        .body_mut()
        .with_config()
        .limit(64 << 20)
        .read_to_vec()
        .map_err(|e| Error::Http(e.to_string()))?;
    serde_json::from_slice(&b).map_err(|e| Error::Http(e.to_string()))
}

pub(super) fn join(agent: &ureq::Agent, url: &str) -> Result<JoinResponse> {
    let body = serde_json::to_vec(&JoinRequest::new(ClientKind::Native))
        .map_err(|e| Error::Http(e.to_string()))?;
    let mut r = agent
        .post(&format!("{url}/api/join"))
        .header("content-type", "application/json")
        .send(&body[..])
        .map_err(|e| Error::Http(e.to_string()))?;
    let status = r.status().as_u16();
    let b = r
        .body_mut()
        .read_to_vec()
        .map_err(|e| Error::Http(e.to_string()))?;
    if status != 200 {
        return Err(Error::Http(format!(
            "join: {status} {}",
            String::from_utf8_lossy(&b)
        )));
    }
    serde_json::from_slice(&b).map_err(|e| Error::Http(e.to_string()))
}

pub(super) type Ws = tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>;

/// Opens `path` on the server from the loopback address `from` (127.0.0.1, 127.0.0.2, ...).
pub(super) async fn open(addr: SocketAddr, from: [u8; 4], path: &str) -> Result<Ws> {
    let socket = tokio::net::TcpSocket::new_v4().map_err(|e| Error::io("socket", e))?;
    socket
        .bind(SocketAddr::from((from, 0)))
        .map_err(|e| Error::io("bind a loopback address", e))?;
    let tcp = socket
        .connect(addr)
        .await
        .map_err(|e| Error::io("connect", e))?;
    let url = format!("ws://{addr}{path}");
    let (ws, _) = tokio_tungstenite::client_async(url.as_str(), tcp)
        .await
        .map_err(|e| Error::WebSocket(e.to_string()))?;
    Ok(ws)
}

/// The next binary frame within `wait`.
pub(super) async fn next_frame(ws: &mut Ws, wait: Duration) -> Result<Vec<u8>> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(deadline, ws.next()).await {
            Err(_) => return Err(Error::WebSocket(format!("no frame within {wait:?}"))),
            Ok(Some(Ok(Message::Binary(b)))) => return Ok(b.into()),
            Ok(Some(Ok(Message::Close(c)))) => {
                return Err(Error::WebSocket(format!("closed by the server: {c:?}")))
            }
            Ok(None) => return Err(Error::WebSocket("closed by the server".into())),
            Ok(Some(Err(e))) => return Err(Error::WebSocket(e.to_string())),
            Ok(Some(Ok(_))) => {}
        }
    }
}

/// Hello on shard `shard`; returns the Welcome's version.
pub(super) async fn hello(ws: &mut Ws, joined: &JoinResponse, shard: u32) -> Result<u64> {
    let h = wire::encode(&Frame::Hello {
        request_id: 1,
        shard,
        hello: Hello {
            protocol: PROTOCOL_VERSION,
            worker_id: joined.worker_id,
            client: ClientKind::Native,
            credential: joined.credential.clone(),
            ..Default::default()
        },
    });
    ws.send(Message::Binary(h.into()))
        .await
        .map_err(|e| Error::WebSocket(e.to_string()))?;
    let reply = next_frame(ws, Duration::from_secs(20)).await?;
    match wire::decode(&reply, usize::MAX) {
        Ok(Frame::Welcome { welcome, .. }) => Ok(welcome.version),
        other => Err(Error::WebSocket(format!("expected Welcome, got {other:?}"))),
    }
}

pub(super) async fn pull(ws: &mut Ws, shard: u32, request_id: u32) -> Result<()> {
    let p = wire::encode(&Frame::Pull {
        request_id,
        shard,
        min_version: 0,
    });
    ws.send(Message::Binary(p.into()))
        .await
        .map_err(|e| Error::WebSocket(e.to_string()))?;
    let reply = next_frame(ws, Duration::from_secs(20)).await?;
    match wire::decode(&reply, usize::MAX) {
        Ok(Frame::Params { request_id: r, .. }) if r == request_id => Ok(()),
        other => Err(Error::WebSocket(format!("expected Params, got {other:?}"))),
    }
}

// ----------------------------------------------------------------------------------- churn

pub(super) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}
