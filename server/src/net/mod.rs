//! The accept loop (mini-redis' `Listener`): before anything is read from it, every TCP
//! connection takes a slot of `--max-connections` (else `503` and close) and a place in the
//! unauthenticated budget: one of `--max-unauthenticated`, and unless `--trust-proxy` one of
//! its IP's `--max-connections-per-ip` and one of its /24's or /48's
//! `--max-connections-per-prefix` (else `429` or `503` and close; the budgets and what
//! authenticates a connection: [`crate::support::limits`]). Its first byte must arrive within
//! `--header-timeout` of the accept (else it is closed and counted as `silent_closed`: hyper's
//! header deadline only starts at the first byte, so without this a silent socket would hold
//! its slots for ever); then TLS handshakes (with `--tls-cert`, by the same deadline) and
//! request headers (within `--header-timeout` again) must arrive; each connection is served by
//! hyper (HTTP/1.1 with upgrades) with the router.
//!
//! A connection's slots are held by a [`ConnSlot`] shared by the connection task and, through
//! the request extensions, by any WebSocket upgraded from it: the total slot is released when
//! the last of them ends, so an upgraded socket keeps counting; the unauthenticated places
//! when the socket's worker authenticates ([`ConnSlot::authenticated`]) or it ends.

pub use crate::support::limits::ConnSlot;
use crate::support::limits::{Count, IpKey, Limits};
use axum::extract::ConnectInfo;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt;

/// The budgets a listener counts connections against: what `serve` and `crowdgrad shard` hand
/// [`serve`] (cheap handles, not the state of the role that owns them).
#[derive(Debug, Clone)]
pub struct Caps {
    /// Per-IP, per-prefix, header, TLS and rate limits, and their refusal counters.
    pub limits: Arc<Limits>,
    /// Every open TCP connection holds one permit (`--max-connections`).
    pub connections: Arc<Semaphore>,
    /// Every unauthenticated connection holds one permit (`--max-unauthenticated`).
    pub unauthenticated: Arc<Semaphore>,
}

impl Caps {
    /// The budgets of a listener with `max_connections` in all (`connections` must hold that
    /// many permits): the unauthenticated pool is sized by `limits`
    /// ([`LimitConfig::unauthenticated_pool`](crate::support::limits::LimitConfig::unauthenticated_pool)).
    pub fn new(limits: Arc<Limits>, connections: Arc<Semaphore>, max_connections: usize) -> Self {
        let pool = limits.cfg.unauthenticated_pool(max_connections);
        Self {
            limits,
            connections,
            unauthenticated: Arc::new(Semaphore::new(pool)),
        }
    }
}

/// How long shutdown waits for HTTP connections (not WebSockets: `run` waits for those).
const DRAIN: Duration = Duration::from_secs(5);

/// Serves `router` on `listener` until `shutdown` completes, then stops accepting and lets
/// open HTTP requests finish (at most [`DRAIN`]).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    caps: Caps,
    tls: Option<TlsAcceptor>,
    shutdown: impl Future<Output = ()>,
) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let limits = caps.limits.clone();
    let header_timeout = limits.cfg.header_timeout;
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors, or a connection reset before accept: wait a
                    // moment instead of spinning.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(total) = caps.connections.clone().try_acquire_owned() else {
            limits.count(Count::RefusedTotal);
            refuse(
                &tcp,
                tls.is_none(),
                "503 Service Unavailable",
                "too many connections",
            );
            continue;
        };
        // Behind a proxy every connection comes from the proxy: the per-IP and per-prefix
        // places are taken by the forwarded address when a WebSocket opens
        // (`crate::shard::socket::limited_socket`).
        let client = (!limits.cfg.trust_proxy).then(|| IpKey::of(peer.ip()));
        let unauthenticated = match limits.unauthenticated(Some(&caps.unauthenticated), client) {
            Ok(u) => u,
            Err(why) => {
                let (status, m) = why.reply();
                refuse(&tcp, tls.is_none(), status, m);
                continue;
            }
        };
        let slot = Arc::new(ConnSlot::new(total, unauthenticated, limits.opened()));
        let _ = tcp.set_nodelay(true);
        let deadline = tokio::time::Instant::now() + header_timeout;
        let service = router
            .clone()
            .map_request(move |mut req: hyper::Request<Incoming>| {
                req.extensions_mut().insert(ConnectInfo(peer));
                req.extensions_mut().insert(slot.clone());
                req
            });
        let service = TowerToHyperService::new(service);
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(header_timeout);
        let builder = builder.http1_only();
        let tls = tls.clone();
        let watcher = graceful.watcher();
        let limits = limits.clone();
        tokio::spawn(async move {
            match first_byte(&tcp, deadline).await {
                FirstByte::Arrived => {}
                FirstByte::Closed => return,
                FirstByte::Silent => {
                    limits.count(Count::SilentClosed);
                    tracing::debug!(%peer, "closed: no byte within the header timeout");
                    return;
                }
            }
            let r = match tls {
                None => {
                    let conn = builder.serve_connection_with_upgrades(TokioIo::new(tcp), service);
                    watcher.watch(conn.into_owned()).await
                }
                Some(acceptor) => {
                    let stream = match tokio::time::timeout_at(deadline, acceptor.accept(tcp)).await
                    {
                        Ok(Ok(s)) => s,
                        Ok(Err(e)) => {
                            limits.count(Count::TlsFailed);
                            tracing::debug!(%peer, "TLS handshake failed: {e}");
                            return;
                        }
                        Err(_) => {
                            limits.count(Count::TlsFailed);
                            tracing::debug!(%peer, "TLS handshake timed out");
                            return;
                        }
                    };
                    let conn =
                        builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
                    watcher.watch(conn.into_owned()).await
                }
            };
            if let Err(e) = r {
                tracing::debug!(%peer, "connection ended: {e}");
            }
        });
    }
    drop(listener);
    let _ = tokio::time::timeout(DRAIN, graceful.shutdown()).await;
}

/// What a new connection did before its first-byte deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FirstByte {
    /// At least one byte is waiting (still unread: hyper or rustls reads it).
    Arrived,
    /// The peer closed, or the socket failed, before sending anything.
    Closed,
    /// Nothing by the deadline.
    Silent,
}

/// Waits until `tcp` has a byte to read, without reading it (`peek`), or until `deadline`.
async fn first_byte(tcp: &TcpStream, deadline: tokio::time::Instant) -> FirstByte {
    match tokio::time::timeout_at(deadline, tcp.peek(&mut [0u8; 1])).await {
        Ok(Ok(n)) if n > 0 => FirstByte::Arrived,
        Ok(_) => FirstByte::Closed,
        Err(_) => FirstByte::Silent,
    }
}

/// Best effort, without waiting: tell a plain-HTTP client why, then close. (A TLS client just
/// sees the connection close: answering would need a handshake first.)
fn refuse(tcp: &TcpStream, plain: bool, status: &str, message: &str) {
    if plain {
        let body = format!("{{\"error\":\"{message}\"}}");
        let reply = format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        let _ = tcp.try_write(reply.as_bytes());
        // Read what already arrived so the close is a FIN, not a reset that could destroy
        // the reply in flight.
        let _ = tcp.try_read(&mut [0u8; 4096]);
    }
}
