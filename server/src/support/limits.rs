//! Limits for a server that strangers can reach: connections in total and per client IP, push
//! rates per worker and per IP, join and data-download rates per IP, idle, Hello and
//! header-read deadlines. Every refusal is counted ([`LimitCounts`], in `/api/status` under
//! `limits`).
//!
//! - [`LimitArgs`] are the `serve` flags, checked into [`LimitConfig`] (0 switches a rate or
//!   per-IP limit off).
//! - [`Limits`] is the shared state: token buckets ([`RateMap`]) and per-IP connection counts,
//!   each map bounded in size.
//! - [`client_ip`] says who a request is from: the TCP peer, or with `--trust-proxy` the last
//!   address in `X-Forwarded-For` (what the reverse proxy in front saw, docs/deploy.md).
//!
//! IPv6 clients are keyed by their /64 (one home network gets one prefix, and a host can pick
//! any address in it).

use crate::error::{Error, Result};
use clap::Args;
use serde::Serialize;
use std::collections::HashMap;
use std::hash::Hash;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Most keys one rate or connection map holds before it drops idle entries.
pub const MAX_KEYS: usize = 65_536;

/// Limit flags of `crowdgrad serve` (flattened into `ServeArgs`).
#[derive(Debug, Clone, Args)]
pub struct LimitArgs {
    /// Most simultaneous TCP connections from one client IP (0: no per-IP limit). With
    /// --trust-proxy, WebSocket connections per forwarded client IP instead.
    #[arg(long, default_value_t = 256)]
    pub max_connections_per_ip: usize,
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
    /// Connections per client IP (0: off).
    pub max_connections_per_ip: usize,
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
        Ok(LimitConfig {
            max_connections_per_ip: self.max_connections_per_ip,
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
    /// Refused because the client IP had `--max-connections-per-ip` open.
    pub connections_refused_per_ip: u64,
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

#[derive(Debug, Default)]
struct Counters {
    open: AtomicU64,
    accepted: AtomicU64,
    refused_total: AtomicU64,
    refused_per_ip: AtomicU64,
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
    per_ip: Mutex<HashMap<IpKey, usize>>,
    counters: Counters,
}

/// One connection's share of a per-IP limit; released on drop.
#[derive(Debug)]
pub struct IpGuard {
    limits: Arc<Limits>,
    ip: IpKey,
}

impl Drop for IpGuard {
    fn drop(&mut self) {
        let mut g = self.limits.per_ip.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = g.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                g.remove(&self.ip);
            }
        }
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
            per_ip: Mutex::new(HashMap::new()),
            counters: Counters::default(),
        })
    }

    /// Counts `what`.
    pub fn count(&self, what: Count) {
        let c = &self.counters;
        let a = match what {
            Count::RefusedTotal => &c.refused_total,
            Count::RefusedPerIp => &c.refused_per_ip,
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
        let max = self.cfg.max_connections_per_ip;
        let mut g = self.per_ip.lock().unwrap_or_else(|p| p.into_inner());
        let n = g.entry(ip).or_insert(0);
        if max > 0 && *n >= max {
            drop(g);
            self.count(Count::RefusedPerIp);
            return None;
        }
        *n += 1;
        Some(IpGuard {
            limits: self.clone(),
            ip,
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
            connections_refused_per_ip: l(&c.refused_per_ip),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_refill_at_their_rate() {
        let m = RateMap::new(10.0, 3.0);
        let t = Instant::now();
        for _ in 0..3 {
            assert!(m.take(1u8, t).is_ok());
        }
        let wait = m.take(1u8, t).unwrap_err();
        assert!((wait.as_secs_f64() - 0.1).abs() < 1e-6, "{wait:?}");
        assert!(m.take(2u8, t).is_ok(), "another key has its own bucket");
        assert!(m.take(1u8, t + Duration::from_millis(100)).is_ok());
        assert!(m.take(1u8, t + Duration::from_millis(100)).is_err());
        // Refills cap at the burst.
        let later = t + Duration::from_secs(60);
        for _ in 0..3 {
            assert!(m.take(1u8, later).is_ok());
        }
        assert!(m.take(1u8, later).is_err());
        let off = RateMap::new(0.0, 0.0);
        for _ in 0..1000 {
            assert!(off.take(1u8, t).is_ok());
        }
    }

    #[test]
    fn the_maps_stay_bounded() {
        let m = RateMap::new(1.0, 1.0);
        let t = Instant::now();
        for k in 0..(MAX_KEYS as u32 + 10) {
            let _ = m.take(k, t);
        }
        assert!(m.buckets.lock().unwrap().len() <= MAX_KEYS);
    }

    #[test]
    fn per_ip_connections_release_on_drop() {
        let l = Limits::new(LimitConfig {
            max_connections_per_ip: 2,
            ..Default::default()
        });
        let ip = IpKey::of("10.0.0.1".parse().unwrap());
        let a = l.connect_ip(ip).unwrap();
        let _b = l.connect_ip(ip).unwrap();
        assert!(l.connect_ip(ip).is_none());
        assert!(l
            .connect_ip(IpKey::of("10.0.0.2".parse().unwrap()))
            .is_some());
        drop(a);
        assert!(l.connect_ip(ip).is_some());
        assert_eq!(l.counts().connections_refused_per_ip, 1);
    }

    #[test]
    fn client_ips() {
        let peer: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let mut h = axum::http::HeaderMap::new();
        h.append("x-forwarded-for", "1.2.3.4, 5.6.7.8".parse().unwrap());
        assert_eq!(client_ip(&h, peer, false).to_string(), "127.0.0.1");
        assert_eq!(client_ip(&h, peer, true).to_string(), "5.6.7.8");
        h.append("x-forwarded-for", "junk".parse().unwrap());
        assert_eq!(client_ip(&h, peer, true).to_string(), "5.6.7.8");
        assert_eq!(
            client_ip(&axum::http::HeaderMap::new(), peer, true).to_string(),
            "127.0.0.1"
        );
        let a = IpKey::of("2001:db8:1:2:aaaa::1".parse().unwrap());
        let b = IpKey::of("2001:db8:1:2:bbbb::7".parse().unwrap());
        assert_eq!(a, b);
        assert_eq!(a.to_string(), "2001:db8:1:2::/64");
        assert_eq!(
            IpKey::of("::ffff:10.1.2.3".parse().unwrap()).to_string(),
            "10.1.2.3"
        );
    }

    #[test]
    fn flags_check() {
        let d = LimitConfig::default();
        assert_eq!(d.hello_timeout, Duration::from_secs(10));
        assert!(!d.trust_proxy);
        use clap::Parser;
        #[derive(Parser)]
        struct P {
            #[command(flatten)]
            a: LimitArgs,
        }
        for bad in [
            &["--push-rate", "-1"][..],
            &["--push-rate-per-ip", "inf"],
            &["--idle-timeout", "0"],
            &["--hello-timeout", "nan"],
        ] {
            let p = P::try_parse_from(std::iter::once("serve").chain(bad.iter().copied()));
            assert!(p.map_or(true, |p| p.a.check().is_err()), "{bad:?}");
        }
    }
}
