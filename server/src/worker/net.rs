//! The worker's network: the HTTP agent (join, data downloads), the WebSocket to each shard
//! and its reader task. Every wait here has a deadline ([`Timeouts`]).

use super::options::jitter_seed;
use super::options::{Timeouts, WorkOptions};
use crate::error::{Error, Result};
use crowdgrad_core::backoff::Backoff;
use crowdgrad_core::spec::{JoinRequest, JoinResponse, Threads};
use crowdgrad_core::wire::ClientKind;
use futures_util::StreamExt;
use std::future::Future;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;

/// The worker's HTTP agent and WebSocket TLS connector, built once from its options.
#[derive(Clone)]
pub(super) struct Net {
    pub(super) agent: ureq::Agent,
    pub(super) tls: Option<tokio_tungstenite::Connector>,
    pub(super) token: Option<String>,
    pub(super) timeouts: Timeouts,
}

impl Net {
    pub(super) fn new(opts: &WorkOptions) -> Result<Self> {
        let t = opts.timeouts;
        let mut tls = ureq::tls::TlsConfig::builder().provider(ureq::tls::TlsProvider::Rustls);
        let mut ws_tls = None;
        if let Some(ca) = &opts.ca {
            let certs: Vec<ureq::tls::Certificate<'static>> = crate::support::tls::certs(ca)?
                .iter()
                .map(|c| ureq::tls::Certificate::from_der(c.as_ref()).to_owned())
                .collect();
            tls = tls.root_certs(ureq::tls::RootCerts::new_with_certs(&certs));
            ws_tls = Some(tokio_tungstenite::Connector::Rustls(
                crate::support::tls::client_config(Some(ca))?,
            ));
        }
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .tls_config(tls.build())
            .timeout_connect(Some(t.connect))
            .timeout_global(Some(t.http))
            .timeout_per_read(Some(t.stall))
            .timeout_per_write(Some(t.stall))
            .build()
            .into();
        Ok(Self {
            agent,
            tls: ws_tls,
            token: opts.join_token.clone(),
            timeouts: t,
        })
    }
}

pub(super) fn http_error(e: ureq::Error) -> Error {
    Error::Http(e.to_string())
}

/// Most bytes accepted in one HTTP response (a data partition).
pub(super) const MAX_BODY: u64 = 1 << 30;

/// Why a join failed: worth retrying, or not (the run is private and our token is wrong).
pub(super) enum JoinError {
    Retry(Error),
    Refused(String),
}

impl From<Error> for JoinError {
    fn from(e: Error) -> Self {
        JoinError::Retry(e)
    }
}

pub(super) async fn join(
    net: &Net,
    http: &str,
    (name, team): (Option<String>, Option<String>),
    identity: Option<String>,
    threads: Option<Threads>,
) -> std::result::Result<JoinResponse, JoinError> {
    let url = format!("{http}/api/join");
    let mut req = JoinRequest::new(ClientKind::Native);
    req.name = name;
    req.team = team;
    req.identity = identity;
    req.threads = threads;
    let body = serde_json::to_vec(&req).map_err(|e| Error::Http(e.to_string()))?;
    let net2 = net.clone();
    let (status, bytes) = tokio::task::spawn_blocking(move || -> Result<(u16, Vec<u8>)> {
        let mut post = net2
            .agent
            .post(&url)
            .header("content-type", "application/json");
        if let Some(t) = &net2.token {
            post = post.header("authorization", format!("Bearer {t}"));
        }
        let mut resp = post.send(&body[..]).map_err(http_error)?;
        let status = resp.status().as_u16();
        let bytes = resp
            .body_mut()
            .with_config()
            .limit(1 << 20)
            .read_to_vec()
            .map_err(http_error)?;
        Ok((status, bytes))
    })
    .await
    .map_err(|e| Error::Task(format!("join request: {e}")))??;
    let text = || {
        String::from_utf8_lossy(&bytes)
            .chars()
            .take(500)
            .collect::<String>()
    };
    match status {
        200..=299 => serde_json::from_slice(&bytes)
            .map_err(|e| JoinError::Retry(Error::Http(format!("bad join reply: {e}")))),
        401 | 403 => Err(JoinError::Refused(format!(
            "join refused ({status}): {}{}",
            text(),
            // 403 is also a quarantined identity: the token hint is only for 401.
            match (status, net.token.is_some()) {
                (403, _) => "",
                (_, true) => " (is --join-token right?)",
                (_, false) => " (this run needs --join-token)",
            }
        ))),
        _ => Err(JoinError::Retry(Error::Http(format!(
            "join refused ({status}): {}",
            text()
        )))),
    }
}

pub(super) async fn get(net: &Net, url: String) -> Result<Vec<u8>> {
    let agent = net.agent.clone();
    tokio::task::spawn_blocking(move || -> Result<Vec<u8>> {
        let mut resp = agent.get(&url).call().map_err(http_error)?;
        let status = resp.status();
        if !status.is_success() {
            return Err(Error::Http(format!("GET {url}: {status}")));
        }
        resp.body_mut()
            .with_config()
            .limit(MAX_BODY)
            .read_to_vec()
            .map_err(http_error)
    })
    .await
    .map_err(|e| Error::Task(format!("download: {e}")))?
}

/// What a reader task saw on shard `.0`'s connection of generation `.1`.
pub(super) enum Event {
    /// A frame as tungstenite read it (a slice of its read buffer: not copied again).
    Frame(usize, u64, bytes::Bytes),
    Closed(usize, u64, String),
}

pub(super) type WsStream =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;
pub(super) type WsSink = futures_util::stream::SplitSink<WsStream, Message>;
/// A pending reconnect of one shard: its index, the generation it replaces, the outcome.
pub(super) type Reconnect<'a> = std::pin::Pin<
    Box<dyn Future<Output = (usize, u64, std::result::Result<WsStream, String>)> + Send + 'a>,
>;

/// Opens the WebSocket to one shard within the connect deadline.
pub(super) async fn connect_shard(net: &Net, url: &str) -> std::result::Result<WsStream, String> {
    let connect = net.timeouts.connect;
    let c = tokio_tungstenite::connect_async_tls_with_config(url, None, true, net.tls.clone());
    match tokio::time::timeout(connect, c).await {
        Ok(r) => r.map(|(s, _)| s).map_err(|e| e.to_string()),
        Err(_) => Err(format!("no connection within {connect:?}")),
    }
}

/// The worker's connection to one shard: its sink while up, its reader, and the backoff of
/// its reconnects.
pub(super) struct Link {
    pub(super) sink: Option<WsSink>,
    pub(super) reader: Option<tokio::task::AbortHandle>,
    /// Bumped by every new connection: events of an older one are ignored.
    pub(super) generation: u64,
    pub(super) backoff: Backoff,
}

impl Link {
    pub(super) fn up(
        i: usize,
        generation: u64,
        socket: WsStream,
        events: &mpsc::Sender<Event>,
        readers: &mut tokio::task::JoinSet<()>,
        max_backoff: Duration,
    ) -> Self {
        let (sink, mut stream) = socket.split();
        let tx = events.clone();
        let reader = readers.spawn(async move {
            loop {
                let ev = match stream.next().await {
                    Some(Ok(Message::Binary(b))) => Event::Frame(i, generation, b),
                    Some(Ok(Message::Close(c))) => Event::Closed(
                        i,
                        generation,
                        c.map_or_else(|| "closed".into(), |c| c.reason.to_string()),
                    ),
                    Some(Ok(_)) => continue,
                    Some(Err(e)) => Event::Closed(i, generation, e.to_string()),
                    None => Event::Closed(i, generation, "closed".into()),
                };
                let closed = matches!(ev, Event::Closed(..));
                if tx.send(ev).await.is_err() || closed {
                    break;
                }
            }
        });
        Self {
            sink: Some(sink),
            reader: Some(reader),
            generation,
            backoff: Backoff::new(jitter_seed()).with_cap(max_backoff.as_secs_f64()),
        }
    }

    /// The connection is gone: stop its reader, drop its sink.
    pub(super) fn down(&mut self) {
        if let Some(r) = self.reader.take() {
            r.abort();
        }
        self.sink = None;
    }

    /// Whether an event of `generation` is about the current connection.
    pub(super) fn current(&self, generation: u64) -> bool {
        self.sink.is_some() && self.generation == generation
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;
    use axum::routing::post;

    /// A real HTTP server on 127.0.0.1:0 whose `/api/join` answers `status` with `body`.
    async fn server(status: StatusCode, body: &'static str) -> String {
        let app =
            axum::Router::new().route("/api/join", post(move || async move { (status, body) }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        format!("http://{addr}")
    }

    fn net(token: Option<&str>) -> Net {
        let mut o = WorkOptions::new("http://127.0.0.1:9");
        o.join_token = token.map(str::to_owned);
        o.timeouts.http = Duration::from_secs(5);
        Net::new(&o).expect("net")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_join_refused_for_a_token_or_quarantine_is_final_other_failures_retry() {
        for (status, token, refused, hint) in [
            (
                StatusCode::UNAUTHORIZED,
                None,
                true,
                "this run needs --join-token",
            ),
            (
                StatusCode::UNAUTHORIZED,
                Some("t"),
                true,
                "is --join-token right?",
            ),
            (StatusCode::FORBIDDEN, None, true, "quarantined"),
            (StatusCode::SERVICE_UNAVAILABLE, None, false, "503"),
            (StatusCode::OK, None, false, "bad join reply"),
        ] {
            let base = server(status, "quarantined").await;
            let r = join(&net(token), &base, (None, None), None, None).await;
            match (r, refused) {
                (Err(JoinError::Refused(why)), true) => assert!(why.contains(hint), "{why}"),
                (Err(JoinError::Retry(e)), false) => {
                    assert!(e.to_string().contains(hint), "{e}")
                }
                (Err(JoinError::Refused(why)), false) => panic!("{status}: refused: {why}"),
                (Err(JoinError::Retry(e)), true) => panic!("{status}: retried: {e}"),
                (Ok(_), _) => panic!("{status}: joined"),
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_shard_that_does_not_answer_is_given_up_within_the_connect_deadline() {
        // A listener that accepts TCP but never completes the WebSocket upgrade.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let _hold = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                held.push(s);
            }
        });
        let mut n = net(None);
        n.timeouts.connect = Duration::from_millis(300);
        let t0 = std::time::Instant::now();
        let e = connect_shard(&n, &format!("ws://{addr}/ws/shard/0"))
            .await
            .expect_err("no upgrade");
        assert!(e.contains("no connection within"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(3));
    }
}
