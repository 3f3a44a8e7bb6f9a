//! Limits for a server that strangers can reach: connections in total, unauthenticated
//! connections in all, per client IP and per network prefix, push rates per worker and per IP,
//! join and data-download rates per IP, idle, Hello and header-read deadlines. Every refusal is
//! counted ([`LimitCounts`], in `/api/status` under `limits`, and in `/metrics`).
//!
//! - [`LimitArgs`] are the `serve` flags, checked into [`LimitConfig`] (0 switches a rate,
//!   per-IP or per-prefix limit off).
//! - [`Limits`] is the shared state: token buckets ([`RateMap`]), per-IP and per-prefix
//!   connection counts, each map bounded in size.
//! - [`ConnSlot`] is one TCP connection's share of the connection budgets.
//! - [`client_ip`] says who a request is from: the TCP peer, or with `--trust-proxy` the last
//!   address in `X-Forwarded-For` (what the reverse proxy in front saw, docs/deploy.md).
//!
//! # Two connection budgets
//!
//! Every accepted TCP connection holds one of `--max-connections` for as long as it is open.
//! Until it **authenticates** it also holds a place in the unauthenticated budget:
//!
//! - one of `--max-unauthenticated` places (default: three quarters of `--max-connections`),
//! - one of its client IP's `--max-connections-per-ip`,
//! - one of its network prefix's `--max-connections-per-prefix` (an IPv4 /24, an IPv6 /48).
//!
//! A connection authenticates when it is a shard WebSocket whose Hello the shard admitted:
//! the Hello carried the credential its worker's join handed out (checked by the shard,
//! `crate::shard::Access::admit`), the credential has not expired, and the worker holds fewer
//! than `MAX_SOCKETS_PER_WORKER` sockets on that shard. Then [`ConnSlot::authenticated`]
//! gives the unauthenticated places back; the socket keeps its total slot, and from then on is
//! bounded by the per-credential cap instead, and by `--idle-timeout`. Everything else stays
//! unauthenticated for its whole life: HTTP requests (the page, `/api/status`, joins, data
//! downloads, the event stream), WebSockets before or without an admitted Hello.
//!
//! So connections that proved nothing can never hold more than `--max-unauthenticated` of the
//! total: the rest is kept for volunteers' worker sockets. And within that budget one network
//! prefix cannot take more than `--max-connections-per-prefix`: a flood from a handful of
//! addresses in one /24 (the 17 addresses x 241 silent sockets, each address under its
//! per-IP cap) holds at most that many, and the status page, joins and the workers of everyone
//! else still get through. Silent sockets are also closed at `--header-timeout`
//! (`crate::net`). What the prefix cap does not stop: an attacker with many prefixes (IPv6 /48s
//! are cheap) can fill the unauthenticated budget; established volunteers then keep their
//! sockets and their reserved quarter, but new visitors wait until the flood's sockets reach
//! their deadline.
//!
//! IPv6 clients are keyed by their /64 for the per-IP caps and rates (one home network gets one
//! prefix, and a host can pick any address in it), and by their /48 for the prefix cap (what
//! one site is usually allotted).

use crate::error::{Error, Result};
use clap::Args;
use serde::Serialize;
use std::collections::HashMap;
use std::hash::Hash;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Most keys one rate or connection map holds before it drops idle entries.
pub const MAX_KEYS: usize = 65_536;

/// Limit flags of `crowdgrad serve` (flattened into `ServeArgs`).
#[derive(Debug, Clone, Args)]
pub struct LimitArgs {
    /// Most simultaneous unauthenticated TCP connections from one client IP (0: no per-IP
    /// limit): HTTP requests and WebSockets before an admitted Hello. With --trust-proxy,
    /// WebSocket connections per forwarded client IP instead.
    #[arg(long, default_value_t = 256)]
    pub max_connections_per_ip: usize,
    /// Most simultaneous unauthenticated TCP connections from one network prefix, an IPv4 /24
    /// or an IPv6 /48 (0: no per-prefix limit): HTTP requests and WebSockets before an admitted
    /// Hello. Over it, 429 and close. The default is two busy NAT addresses' worth (2 x the
    /// per-IP default), and holds a flood from one prefix to an eighth of the default
    /// --max-connections. With --trust-proxy, WebSockets per forwarded prefix instead.
    #[arg(long, default_value_t = 512)]
    pub max_connections_per_prefix: usize,
    /// Most simultaneous unauthenticated TCP connections in all (default: three quarters of
    /// --max-connections; at most --max-connections). The rest of --max-connections is kept
    /// for worker WebSockets whose Hello carried a valid credential: a flood of connections
    /// that authenticate nothing never takes those. Over it, 503 and close.
    #[arg(long)]
    pub max_unauthenticated: Option<usize>,
    /// Pushes per second one worker may send to one shard (token bucket, one second of burst;
    /// 0: unlimited). Excess pushes get the `busy` error. A native worker on loopback pushes
    /// ~1,100/s.
    #[arg(long, default_value_t = 2_000.0)]
    pub push_rate: f64,
    /// Pushes per second one client IP may send to one shard, all its workers together (0:
    /// unlimited).
    #[arg(long, default_value_t = 8_000.0)]
    pub push_rate_per_ip: f64,
    /// Joins per minute from one client IP (0: unlimited); excess gets 429 with Retry-After.
    #[arg(long, default_value_t = 120)]
    pub join_rate: u32,
    /// Data-partition downloads per minute from one client IP (0: unlimited); excess gets 429.
    #[arg(long, default_value_t = 240)]
    pub download_rate: u32,
    /// Seconds a WebSocket may stay silent (no frame) while the server is not holding a pull
    /// for it before it is closed.
    #[arg(long, default_value_t = 60.0)]
    pub idle_timeout: f64,
    /// Seconds a new WebSocket has to send its Hello (else `protocol` error and Close).
    #[arg(long, default_value_t = 10.0)]
    pub hello_timeout: f64,
    /// Seconds a new TCP connection has to send its first byte (else it is closed, counted as
    /// `silent_closed`), and then to send a request's headers (with TLS: to finish the
    /// handshake, counted from the accept).
    #[arg(long, default_value_t = 10.0)]
    pub header_timeout: f64,
    /// The server is behind a reverse proxy: take the client IP from the last
    /// `X-Forwarded-For` address (only set this when a proxy overwrites or appends it).
    #[arg(long)]
    pub trust_proxy: bool,
}

/// Checked [`LimitArgs`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LimitConfig {
    /// Unauthenticated connections per client IP (0: off).
    pub max_connections_per_ip: usize,
    /// Unauthenticated connections per IPv4 /24 or IPv6 /48 (0: off).
    pub max_connections_per_prefix: usize,
    /// Unauthenticated connections in all (`None`: three quarters of the total,
    /// [`LimitConfig::unauthenticated_pool`]).
    pub max_unauthenticated: Option<usize>,
    /// Pushes/s per worker per shard (0: off).
    pub push_rate: f64,
    /// Pushes/s per IP per shard (0: off).
    pub push_rate_per_ip: f64,
    /// Joins per minute per IP (0: off).
    pub join_rate: u32,
    /// Downloads per minute per IP (0: off).
    pub download_rate: u32,
    /// Silent WebSocket deadline.
    pub idle_timeout: Duration,
    /// Hello deadline.
    pub hello_timeout: Duration,
    /// First-byte, header-read and TLS handshake deadline.
    pub header_timeout: Duration,
    /// Trust `X-Forwarded-For`.
    pub trust_proxy: bool,
}

impl LimitArgs {
    /// Validates the flags.
    ///
    /// # Errors
    /// [`Error::Config`] naming the first bad flag.
    pub fn check(&self) -> Result<LimitConfig> {
        let bad = |m: String| Err(Error::Config(m));
        for (flag, v) in [
            ("--push-rate", self.push_rate),
            ("--push-rate-per-ip", self.push_rate_per_ip),
        ] {
            if !(v.is_finite() && (0.0..=1e7).contains(&v)) {
                return bad(format!(
                    "{flag} {v} must be between 0 (off) and 1e7 per second"
                ));
            }
        }
        for (flag, v) in [
            ("--idle-timeout", self.idle_timeout),
            ("--hello-timeout", self.hello_timeout),
            ("--header-timeout", self.header_timeout),
        ] {
            if !(v.is_finite() && (0.05..=86_400.0).contains(&v)) {
                return bad(format!("{flag} {v} must be between 0.05 and 86400 seconds"));
            }
        }
        if self.max_unauthenticated == Some(0) {
            return bad("--max-unauthenticated must be positive".into());
        }
        Ok(LimitConfig {
            max_connections_per_ip: self.max_connections_per_ip,
            max_connections_per_prefix: self.max_connections_per_prefix,
            max_unauthenticated: self.max_unauthenticated,
            push_rate: self.push_rate,
            push_rate_per_ip: self.push_rate_per_ip,
            join_rate: self.join_rate,
            download_rate: self.download_rate,
            idle_timeout: Duration::from_secs_f64(self.idle_timeout),
            hello_timeout: Duration::from_secs_f64(self.hello_timeout),
            header_timeout: Duration::from_secs_f64(self.header_timeout),
            trust_proxy: self.trust_proxy,
        })
    }
}

impl Default for LimitConfig {
    /// The flags' defaults.
    fn default() -> Self {
        use clap::Parser;
        #[derive(Parser)]
        struct P {
            #[command(flatten)]
            a: LimitArgs,
        }
        P::parse_from(["serve"])
            .a
            .check()
            .expect("defaults are valid")
    }
}

impl LimitConfig {
    /// The unauthenticated budget's size under a total of `max_connections`:
    /// `--max-unauthenticated`, or three quarters of the total (at least 1), never above it.
    pub fn unauthenticated_pool(&self, max_connections: usize) -> usize {
        self.max_unauthenticated
            .unwrap_or(max_connections - max_connections / 4)
            .clamp(1, max_connections.max(1))
    }
}

/// A client as the limits see it: an IPv4 address or an IPv6 /64.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpKey(IpAddr);

impl IpKey {
    /// The key of `ip` (IPv4-mapped IPv6 addresses count as IPv4).
    pub fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => Self(ip),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Self(IpAddr::V4(v4)),
                None => {
                    let s = v6.segments();
                    Self(IpAddr::V6(Ipv6Addr::new(
                        s[0], s[1], s[2], s[3], 0, 0, 0, 0,
                    )))
                }
            },
        }
    }
}

/// A client's network as the prefix cap sees it: an IPv4 /24 or an IPv6 /48.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PrefixKey(IpAddr);

impl PrefixKey {
    /// The prefix of `ip` (of its IPv4 address if it is IPv4-mapped).
    pub fn of(ip: IpAddr) -> Self {
        match IpKey::of(ip).0 {
            IpAddr::V4(a) => {
                let [a, b, c, _] = a.octets();
                Self(IpAddr::V4([a, b, c, 0].into()))
            }
            IpAddr::V6(a) => {
                let s = a.segments();
                Self(IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], 0, 0, 0, 0, 0)))
            }
        }
    }
}

impl std::fmt::Display for PrefixKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            IpAddr::V4(a) => write!(f, "{a}/24"),
            IpAddr::V6(a) => write!(f, "{a}/48"),
        }
    }
}

impl std::fmt::Display for IpKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            IpAddr::V4(a) => write!(f, "{a}"),
            IpAddr::V6(a) => write!(f, "{a}/64"),
        }
    }
}

/// The client a request comes from: `peer`, or with `trust_proxy` the last parseable address
/// of the last `X-Forwarded-For` header (the one the proxy in front of us appended).
pub fn client_ip(headers: &axum::http::HeaderMap, peer: SocketAddr, trust_proxy: bool) -> IpKey {
    if trust_proxy {
        let forwarded = headers
            .get_all("x-forwarded-for")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|a| a.trim().parse::<IpAddr>().ok())
            .next_back();
        if let Some(ip) = forwarded {
            return IpKey::of(ip);
        }
    }
    IpKey::of(peer.ip())
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Token buckets keyed by `K`: `rate` tokens per second, at most `burst`. Bounded: past
/// [`MAX_KEYS`] keys, full (idle) buckets are forgotten; if none is, all are (failing open for
/// a moment beats refusing everyone new).
#[derive(Debug)]
pub struct RateMap<K> {
    rate: f64,
    burst: f64,
    buckets: Mutex<HashMap<K, Bucket>>,
}

impl<K: Hash + Eq + Copy> RateMap<K> {
    /// `rate` per second with `burst` (0 rate: always allowed).
    pub fn new(rate: f64, burst: f64) -> Self {
        Self {
            rate,
            burst: burst.max(1.0),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one token for `key` at `now`; `Err(wait)` when there is none (`wait` until one).
    ///
    /// # Errors
    /// The time until the next token when the bucket is empty.
    pub fn take(&self, key: K, now: Instant) -> std::result::Result<(), Duration> {
        if self.rate <= 0.0 {
            return Ok(());
        }
        let mut g = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if g.len() >= MAX_KEYS && !g.contains_key(&key) {
            let (rate, burst) = (self.rate, self.burst);
            g.retain(|_, b| {
                b.tokens + now.saturating_duration_since(b.at).as_secs_f64() * rate < burst
            });
            if g.len() >= MAX_KEYS {
                tracing::warn!("rate limiter full ({MAX_KEYS} clients): starting over");
                g.clear();
            }
        }
        let b = g.entry(key).or_insert(Bucket {
            tokens: self.burst,
            at: now,
        });
        let elapsed = now.saturating_duration_since(b.at).as_secs_f64();
        b.tokens = (b.tokens + elapsed * self.rate).min(self.burst);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - b.tokens) / self.rate))
        }
    }
}

/// What the limits refused, and how many connections are open (in `/api/status` as `limits`).
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct LimitCounts {
    /// TCP connections open now.
    pub connections_open: u64,
    /// TCP connections accepted since start.
    pub connections_accepted: u64,
    /// Refused because `--max-connections` were open.
    pub connections_refused_total: u64,
    /// Open connections not (yet) authenticated: the unauthenticated budget in use.
    pub connections_unauthenticated: u64,
    /// Connections that authenticated since start (a worker WebSocket's Hello was admitted)
    /// and so left the unauthenticated budget.
    pub connections_authenticated: u64,
    /// Refused because the client IP had `--max-connections-per-ip` unauthenticated open.
    pub connections_refused_per_ip: u64,
    /// Refused because the client's /24 (IPv6: /48) had `--max-connections-per-prefix`
    /// unauthenticated open.
    pub connections_refused_per_prefix: u64,
    /// Refused because `--max-unauthenticated` unauthenticated connections were open.
    pub connections_refused_unauthenticated: u64,
    /// TLS handshakes that failed or timed out.
    pub tls_handshakes_failed: u64,
    /// TCP connections closed for not sending a first byte within `--header-timeout`.
    pub silent_closed: u64,
    /// WebSockets closed for not sending Hello within `--hello-timeout`.
    pub hello_timeouts: u64,
    /// WebSockets closed for silence longer than `--idle-timeout`.
    pub idle_timeouts: u64,
    /// Pushes answered `busy` by `--push-rate` (per worker).
    pub pushes_limited_per_worker: u64,
    /// Pushes answered `busy` by `--push-rate-per-ip`.
    pub pushes_limited_per_ip: u64,
    /// Joins answered 429 by `--join-rate`.
    pub joins_limited: u64,
    /// Joins answered 401 (private run, missing or wrong token).
    pub joins_unauthorized: u64,
    /// Joins answered 403: the identity is quarantined.
    pub joins_quarantined: u64,
    /// Data downloads answered 429 by `--download-rate`.
    pub downloads_limited: u64,
    /// Admin calls answered 401 (no token, or a wrong one).
    pub admin_unauthorized: u64,
    /// Admin calls answered 429: the client guessed too many tokens, or everyone together did.
    pub admin_locked_out: u64,
}

impl prometheus_client::collector::Collector for LimitCounts {
    fn encode(
        &self,
        mut enc: prometheus_client::encoding::DescriptorEncoder,
    ) -> std::result::Result<(), std::fmt::Error> {
        self.encode_into(&mut enc)
    }
}

impl LimitCounts {
    /// Writes the counts as metrics: `crowdgrad_connections_open`,
    /// `crowdgrad_connections_unauthenticated` (gauges), `crowdgrad_connections_accepted`,
    /// `crowdgrad_connections_authenticated` and `crowdgrad_limit_refusals{limit}` (counters).
    fn encode_into(
        &self,
        enc: &mut prometheus_client::encoding::DescriptorEncoder,
    ) -> std::result::Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        use prometheus_client::metrics::MetricType;
        for (name, help, v) in [
            (
                "crowdgrad_connections_open",
                "TCP connections open now.",
                self.connections_open,
            ),
            (
                "crowdgrad_connections_unauthenticated",
                "Open TCP connections not (yet) authenticated.",
                self.connections_unauthenticated,
            ),
        ] {
            let m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
            ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX)).encode(m)?;
        }
        for (name, help, v) in [
            (
                "crowdgrad_connections_accepted",
                "TCP connections accepted.",
                self.connections_accepted,
            ),
            (
                "crowdgrad_connections_authenticated",
                "Worker sockets whose Hello was admitted (they left the unauthenticated budget).",
                self.connections_authenticated,
            ),
        ] {
            let m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
            ConstCounter::new(v).encode(m)?;
        }
        let mut m = enc.encode_descriptor(
            "crowdgrad_limit_refusals",
            "What the connection, rate and timeout limits refused or closed, by limit.",
            None,
            MetricType::Counter,
        )?;
        for (limit, n) in [
            ("max_connections", self.connections_refused_total),
            ("per_ip", self.connections_refused_per_ip),
            ("per_prefix", self.connections_refused_per_prefix),
            ("unauthenticated", self.connections_refused_unauthenticated),
            ("tls_handshake", self.tls_handshakes_failed),
            ("silent", self.silent_closed),
            ("hello_timeout", self.hello_timeouts),
            ("idle_timeout", self.idle_timeouts),
            ("push_per_worker", self.pushes_limited_per_worker),
            ("push_per_ip", self.pushes_limited_per_ip),
            ("join_rate", self.joins_limited),
            ("join_unauthorized", self.joins_unauthorized),
            ("join_quarantined", self.joins_quarantined),
            ("download_rate", self.downloads_limited),
            ("admin_unauthorized", self.admin_unauthorized),
            ("admin_locked_out", self.admin_locked_out),
        ] {
            ConstCounter::new(n).encode(m.encode_family(&vec![("limit", limit)])?)?;
        }
        Ok(())
    }
}

/// Another collector's metrics followed by the limits' ([`LimitCounts`]), for one `/metrics`
/// extra.
#[derive(Debug)]
pub struct WithLimits<C>(pub C, pub LimitCounts);

impl<C: prometheus_client::collector::Collector> prometheus_client::collector::Collector
    for WithLimits<C>
{
    fn encode(
        &self,
        mut enc: prometheus_client::encoding::DescriptorEncoder,
    ) -> std::result::Result<(), std::fmt::Error> {
        self.1.encode_into(&mut enc)?;
        self.0.encode(enc)
    }
}

#[derive(Debug, Default)]
struct Counters {
    open: AtomicU64,
    accepted: AtomicU64,
    refused_total: AtomicU64,
    unauthenticated: AtomicU64,
    authenticated: AtomicU64,
    refused_per_ip: AtomicU64,
    refused_per_prefix: AtomicU64,
    refused_unauthenticated: AtomicU64,
    tls_failed: AtomicU64,
    silent_closed: AtomicU64,
    hello_timeouts: AtomicU64,
    idle_timeouts: AtomicU64,
    pushes_worker: AtomicU64,
    pushes_ip: AtomicU64,
    joins: AtomicU64,
    joins_unauthorized: AtomicU64,
    joins_quarantined: AtomicU64,
    downloads: AtomicU64,
    admin_unauthorized: AtomicU64,
    admin_locked_out: AtomicU64,
}

/// A refusal or an event to count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    /// See [`LimitCounts::connections_refused_total`].
    RefusedTotal,
    /// See [`LimitCounts::connections_refused_per_ip`].
    RefusedPerIp,
    /// See [`LimitCounts::connections_refused_per_prefix`].
    RefusedPerPrefix,
    /// See [`LimitCounts::connections_refused_unauthenticated`].
    RefusedUnauthenticated,
    /// See [`LimitCounts::tls_handshakes_failed`].
    TlsFailed,
    /// See [`LimitCounts::silent_closed`].
    SilentClosed,
    /// See [`LimitCounts::hello_timeouts`].
    HelloTimeout,
    /// See [`LimitCounts::idle_timeouts`].
    IdleTimeout,
    /// See [`LimitCounts::pushes_limited_per_worker`].
    PushPerWorker,
    /// See [`LimitCounts::pushes_limited_per_ip`].
    PushPerIp,
    /// See [`LimitCounts::joins_limited`].
    Join,
    /// See [`LimitCounts::joins_unauthorized`].
    JoinUnauthorized,
    /// See [`LimitCounts::joins_quarantined`].
    JoinQuarantined,
    /// See [`LimitCounts::downloads_limited`].
    Download,
    /// See [`LimitCounts::admin_unauthorized`].
    AdminUnauthorized,
    /// See [`LimitCounts::admin_locked_out`].
    AdminLockedOut,
}

/// Why a push was refused by a rate limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushLimit {
    /// `--push-rate`.
    Worker,
    /// `--push-rate-per-ip`.
    Ip,
}

/// The server's limits: configuration, buckets, per-IP connection counts, counters.
#[derive(Debug)]
pub struct Limits {
    /// The configuration.
    pub cfg: LimitConfig,
    pushes_worker: RateMap<(u32, u64)>,
    pushes_ip: RateMap<(u32, IpKey)>,
    joins: RateMap<IpKey>,
    downloads: RateMap<IpKey>,
    per_ip: ConnCounts<IpKey>,
    per_prefix: ConnCounts<PrefixKey>,
    counters: Counters,
}

/// Open connections by key (client IP or prefix). Holds only keys with a connection open, so
/// it never has more keys than there are open connections.
#[derive(Debug)]
struct ConnCounts<K>(Mutex<HashMap<K, usize>>);

impl<K: Hash + Eq + Copy> ConnCounts<K> {
    fn new() -> Self {
        Self(Mutex::new(HashMap::new()))
    }

    /// Takes one of `key`'s `max` places (0: unlimited); false when it has none left.
    fn take(&self, key: K, max: usize) -> bool {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let n = g.entry(key).or_insert(0);
        if max > 0 && *n >= max {
            return false;
        }
        *n += 1;
        true
    }

    fn release(&self, key: K) {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = g.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                g.remove(&key);
            }
        }
    }

    fn get(&self, key: K) -> usize {
        let g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        g.get(&key).copied().unwrap_or(0)
    }
}

/// One connection's share of a per-IP limit; released on drop.
#[derive(Debug)]
pub struct IpGuard {
    limits: Arc<Limits>,
    ip: IpKey,
}

impl Drop for IpGuard {
    fn drop(&mut self) {
        self.limits.per_ip.release(self.ip);
    }
}

/// One connection's share of a per-prefix limit; released on drop.
#[derive(Debug)]
pub struct PrefixGuard {
    limits: Arc<Limits>,
    prefix: PrefixKey,
}

impl Drop for PrefixGuard {
    fn drop(&mut self) {
        self.limits.per_prefix.release(self.prefix);
    }
}

/// Why a connection was refused a place in the unauthenticated budget (counted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Its client IP had `--max-connections-per-ip` unauthenticated connections open.
    PerIp,
    /// Its /24 or /48 had `--max-connections-per-prefix` unauthenticated connections open.
    PerPrefix,
    /// `--max-unauthenticated` unauthenticated connections were open.
    Pool,
}

impl Refused {
    /// The HTTP status and message a refused client is told.
    pub fn reply(self) -> (&'static str, &'static str) {
        match self {
            Self::PerIp => (
                "429 Too Many Requests",
                "too many connections from your address",
            ),
            Self::PerPrefix => (
                "429 Too Many Requests",
                "too many connections from your network",
            ),
            Self::Pool => ("503 Service Unavailable", "too many connections"),
        }
    }
}

/// A connection's places in the unauthenticated budget (module doc): the pool's, its client
/// IP's and its prefix's, each optional. Given back on drop.
#[derive(Debug)]
pub struct Unauthenticated {
    limits: Arc<Limits>,
    pool: Option<OwnedSemaphorePermit>,
    _ip: Option<IpGuard>,
    _prefix: Option<PrefixGuard>,
}

impl Drop for Unauthenticated {
    fn drop(&mut self) {
        if self.pool.take().is_some() {
            self.limits
                .counters
                .unauthenticated
                .fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// One TCP connection's share of the connection budgets: a slot of `--max-connections` until
/// it closes, and its [`Unauthenticated`] places until it authenticates or closes. Shared by
/// the connection task and, through the request extensions, by a WebSocket upgraded from it
/// (`crate::net`), so an upgraded socket keeps counting.
#[derive(Debug)]
pub struct ConnSlot {
    _total: OwnedSemaphorePermit,
    unauthenticated: Mutex<Vec<Unauthenticated>>,
    _open: OpenGuard,
}

impl ConnSlot {
    /// A connection holding `total` (a `--max-connections` permit) and `unauthenticated`,
    /// counted open by `open`.
    pub fn new(
        total: OwnedSemaphorePermit,
        unauthenticated: Unauthenticated,
        open: OpenGuard,
    ) -> Self {
        Self {
            _total: total,
            unauthenticated: Mutex::new(vec![unauthenticated]),
            _open: open,
        }
    }

    /// Adds more unauthenticated places to hold (behind `--trust-proxy`: the forwarded
    /// client's). Given back at once if the connection already authenticated.
    pub fn hold(&self, more: Unauthenticated) {
        let mut g = self
            .unauthenticated
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if !g.is_empty() {
            g.push(more);
        }
    }

    /// The connection authenticated (a worker's Hello was admitted): its unauthenticated
    /// places go back, its total slot stays. Counted once; later calls do nothing.
    pub fn authenticated(&self) {
        let held = std::mem::take(
            &mut *self
                .unauthenticated
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        if let Some(u) = held.first() {
            u.limits
                .counters
                .authenticated
                .fetch_add(1, Ordering::Relaxed);
        }
        drop(held);
    }

    /// Whether it still holds unauthenticated places.
    pub fn is_unauthenticated(&self) -> bool {
        !self
            .unauthenticated
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty()
    }
}

/// An open TCP connection, counted in `connections_open` until dropped.
#[derive(Debug)]
pub struct OpenGuard(Arc<Limits>);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.counters.open.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Limits {
    /// Limits with `cfg`.
    pub fn new(cfg: LimitConfig) -> Arc<Self> {
        let per_minute = |n: u32| RateMap::new(f64::from(n) / 60.0, f64::from(n));
        Arc::new(Self {
            cfg,
            pushes_worker: RateMap::new(cfg.push_rate, cfg.push_rate),
            pushes_ip: RateMap::new(cfg.push_rate_per_ip, cfg.push_rate_per_ip),
            joins: per_minute(cfg.join_rate),
            downloads: per_minute(cfg.download_rate),
            per_ip: ConnCounts::new(),
            per_prefix: ConnCounts::new(),
            counters: Counters::default(),
        })
    }

    /// Counts `what`.
    pub fn count(&self, what: Count) {
        let c = &self.counters;
        let a = match what {
            Count::RefusedTotal => &c.refused_total,
            Count::RefusedPerIp => &c.refused_per_ip,
            Count::RefusedPerPrefix => &c.refused_per_prefix,
            Count::RefusedUnauthenticated => &c.refused_unauthenticated,
            Count::TlsFailed => &c.tls_failed,
            Count::SilentClosed => &c.silent_closed,
            Count::HelloTimeout => &c.hello_timeouts,
            Count::IdleTimeout => &c.idle_timeouts,
            Count::PushPerWorker => &c.pushes_worker,
            Count::PushPerIp => &c.pushes_ip,
            Count::Join => &c.joins,
            Count::JoinUnauthorized => &c.joins_unauthorized,
            Count::JoinQuarantined => &c.joins_quarantined,
            Count::Download => &c.downloads,
            Count::AdminUnauthorized => &c.admin_unauthorized,
            Count::AdminLockedOut => &c.admin_locked_out,
        };
        a.fetch_add(1, Ordering::Relaxed);
    }

    /// A TCP connection was accepted: counted open until the guard drops.
    pub fn opened(self: &Arc<Self>) -> OpenGuard {
        self.counters.open.fetch_add(1, Ordering::Relaxed);
        self.counters.accepted.fetch_add(1, Ordering::Relaxed);
        OpenGuard(self.clone())
    }

    /// Takes one of `ip`'s connection slots, or `None` (counted) when it has
    /// `--max-connections-per-ip` open. Always succeeds when the limit is off.
    pub fn connect_ip(self: &Arc<Self>, ip: IpKey) -> Option<IpGuard> {
        if !self.per_ip.take(ip, self.cfg.max_connections_per_ip) {
            self.count(Count::RefusedPerIp);
            return None;
        }
        Some(IpGuard {
            limits: self.clone(),
            ip,
        })
    }

    /// Takes one of `prefix`'s connection slots, or `None` (counted) when it has
    /// `--max-connections-per-prefix` open. Always succeeds when the limit is off.
    pub fn connect_prefix(self: &Arc<Self>, prefix: PrefixKey) -> Option<PrefixGuard> {
        if !self
            .per_prefix
            .take(prefix, self.cfg.max_connections_per_prefix)
        {
            self.count(Count::RefusedPerPrefix);
            return None;
        }
        Some(PrefixGuard {
            limits: self.clone(),
            prefix,
        })
    }

    /// Unauthenticated connections open from `prefix` now.
    pub fn open_in_prefix(&self, prefix: PrefixKey) -> usize {
        self.per_prefix.get(prefix)
    }

    /// A new connection's places in the unauthenticated budget (module doc): one of `pool`
    /// (the `--max-unauthenticated` semaphore) when given, and when `client` is given one of
    /// its IP's and one of its prefix's. Refusals are counted.
    ///
    /// # Errors
    /// The first budget that was full (nothing is held then).
    pub fn unauthenticated(
        self: &Arc<Self>,
        pool: Option<&Arc<Semaphore>>,
        client: Option<IpKey>,
    ) -> std::result::Result<Unauthenticated, Refused> {
        let (ip, prefix) = match client {
            Some(ip) => {
                let Some(i) = self.connect_ip(ip) else {
                    return Err(Refused::PerIp);
                };
                let Some(p) = self.connect_prefix(PrefixKey::of(ip.0)) else {
                    return Err(Refused::PerPrefix);
                };
                (Some(i), Some(p))
            }
            None => (None, None),
        };
        let pool = match pool {
            Some(s) => match s.clone().try_acquire_owned() {
                Ok(permit) => {
                    self.counters
                        .unauthenticated
                        .fetch_add(1, Ordering::Relaxed);
                    Some(permit)
                }
                Err(_) => {
                    self.count(Count::RefusedUnauthenticated);
                    return Err(Refused::Pool);
                }
            },
            None => None,
        };
        Ok(Unauthenticated {
            limits: self.clone(),
            pool,
            _ip: ip,
            _prefix: prefix,
        })
    }

    /// Whether `worker` (from `ip`) may push to `shard` now; refusals are counted.
    ///
    /// # Errors
    /// Which limit it hit.
    pub fn push(
        &self,
        shard: u32,
        worker: u64,
        ip: IpKey,
        now: Instant,
    ) -> std::result::Result<(), PushLimit> {
        if self.pushes_worker.take((shard, worker), now).is_err() {
            self.count(Count::PushPerWorker);
            return Err(PushLimit::Worker);
        }
        if self.pushes_ip.take((shard, ip), now).is_err() {
            self.count(Count::PushPerIp);
            return Err(PushLimit::Ip);
        }
        Ok(())
    }

    /// Whether `ip` may join now; `Err(retry_after)` (counted) when not.
    ///
    /// # Errors
    /// When over `--join-rate`: the time until the next join is allowed.
    pub fn join(&self, ip: IpKey) -> std::result::Result<(), Duration> {
        self.joins.take(ip, Instant::now()).inspect_err(|_| {
            self.count(Count::Join);
        })
    }

    /// Whether `ip` may download a data file now; `Err(retry_after)` (counted) when not.
    ///
    /// # Errors
    /// When over `--download-rate`: the time until the next download is allowed.
    pub fn download(&self, ip: IpKey) -> std::result::Result<(), Duration> {
        self.downloads.take(ip, Instant::now()).inspect_err(|_| {
            self.count(Count::Download);
        })
    }

    /// The counters now.
    pub fn counts(&self) -> LimitCounts {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        LimitCounts {
            connections_open: l(&c.open),
            connections_accepted: l(&c.accepted),
            connections_refused_total: l(&c.refused_total),
            connections_unauthenticated: l(&c.unauthenticated),
            connections_authenticated: l(&c.authenticated),
            connections_refused_per_ip: l(&c.refused_per_ip),
            connections_refused_per_prefix: l(&c.refused_per_prefix),
            connections_refused_unauthenticated: l(&c.refused_unauthenticated),
            tls_handshakes_failed: l(&c.tls_failed),
            silent_closed: l(&c.silent_closed),
            hello_timeouts: l(&c.hello_timeouts),
            idle_timeouts: l(&c.idle_timeouts),
            pushes_limited_per_worker: l(&c.pushes_worker),
            pushes_limited_per_ip: l(&c.pushes_ip),
            joins_limited: l(&c.joins),
            joins_unauthorized: l(&c.joins_unauthorized),
            joins_quarantined: l(&c.joins_quarantined),
            downloads_limited: l(&c.downloads),
            admin_unauthorized: l(&c.admin_unauthorized),
            admin_locked_out: l(&c.admin_locked_out),
        }
    }
}

/// Raises this process's `RLIMIT_NOFILE` soft limit to its hard limit (what a load test that
/// holds thousands of sockets needs); returns the soft limit before and after. Children
/// inherit it.
pub fn raise_nofile() -> (u64, u64) {
    #[cfg(unix)]
    #[allow(unsafe_code, clippy::unnecessary_cast)] // rlim_t is not u64 on every target
    {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit/setrlimit only read and write the struct passed by pointer, which
        // lives on this stack frame for the whole call.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
                return (0, 0);
            }
            let before = lim.rlim_cur as u64;
            lim.rlim_cur = lim.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return (before, before);
            }
            (before, lim.rlim_cur as u64)
        }
    }
    #[cfg(not(unix))]
    {
        (0, 0)
    }
}

#[cfg(test)]
mod tests;
