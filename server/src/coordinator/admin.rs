//! The admin state the coordinator holds: the admin token and the limits on guessing it,
//! paused, draining or stopping, and the live learning rate. Its HTTP routes are
//! [`crate::coordinator::http::admin`].
//!
//! # Guessing the token
//! [`Admin::authenticate`] bounds how fast anyone can try tokens:
//! - per client (IP, or /64): after [`AUTH_FAILURES`] different wrong tokens within
//!   [`AUTH_WINDOW`], every admin call from it, even with the right token, is refused (429,
//!   Retry-After) for [`AUTH_LOCKOUT`]. Sending the same wrong token again (a script with a
//!   stale token) counts once: it tells the sender nothing new.
//! - over all clients: [`AUTH_GLOBAL_BURST`] different wrong tokens, refilled at
//!   [`AUTH_GLOBAL_RATE`] a second; while that budget is spent every admin call is refused with
//!   429 before its token is looked at (answering a right token then would let a crowd of
//!   addresses keep guessing at full speed), so a distributed guesser delays the operator too,
//!   never the training.
//!
//! A call without a bearer token is a 401 that counts as no guess.

use crate::support::credential::Secret;
use crate::support::limits::{IpKey, MAX_KEYS};
use axum::http::{header, HeaderMap};
use serde::Serialize;
use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Different wrong admin tokens one client may send within [`AUTH_WINDOW`]; the last of
/// them locks it out for [`AUTH_LOCKOUT`].
pub const AUTH_FAILURES: usize = 5;

/// The window [`AUTH_FAILURES`] are counted in.
pub const AUTH_WINDOW: Duration = Duration::from_secs(60);

/// How long a client that hit [`AUTH_FAILURES`] is refused every admin call.
pub const AUTH_LOCKOUT: Duration = Duration::from_secs(300);

/// Different wrong admin tokens per second over all clients, sustained.
pub const AUTH_GLOBAL_RATE: f64 = 1.0;

/// Different wrong admin tokens over all clients at once.
pub const AUTH_GLOBAL_BURST: f64 = 30.0;

/// What [`Admin::authenticate`] decided about one admin call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Auth {
    /// The right token.
    Granted,
    /// No bearer token (401; no guess).
    Missing,
    /// A wrong token (401; counted against the client and the global budget).
    Wrong,
    /// Refused without looking at the token: the client is locked out, or the global budget
    /// is spent (429 with this Retry-After).
    Locked(Duration),
}

/// One client's recent wrong tokens.
#[derive(Debug, Clone)]
struct Guesses {
    /// When the first of `tokens` arrived.
    since: Instant,
    /// Hashes (keyed by the process' random state, never the tokens) of the different wrong
    /// tokens since `since`.
    tokens: Vec<u64>,
    /// Locked out until then.
    locked_until: Option<Instant>,
}

/// The state behind [`Admin::authenticate`] (module doc, "Guessing the token").
#[derive(Debug)]
struct AuthLimiter {
    per_ip: HashMap<IpKey, Guesses>,
    /// The global budget: tokens left, last refill.
    global: (f64, Instant),
    keys: RandomState,
}

impl AuthLimiter {
    fn new(now: Instant) -> Self {
        Self {
            per_ip: HashMap::new(),
            global: (AUTH_GLOBAL_BURST, now),
            keys: RandomState::new(),
        }
    }

    /// Refills the global budget to `now`; the time until one guess is allowed, if none is.
    fn global_wait(&mut self, now: Instant) -> Option<Duration> {
        let (tokens, at) = &mut self.global;
        let dt = now.saturating_duration_since(*at).as_secs_f64();
        *tokens = (*tokens + dt * AUTH_GLOBAL_RATE).min(AUTH_GLOBAL_BURST);
        *at = now;
        (*tokens < 1.0).then(|| Duration::from_secs_f64((1.0 - *tokens) / AUTH_GLOBAL_RATE))
    }

    /// Whether `ip` is locked out at `now`: the time left. Forgets an ended lockout or window.
    fn locked(&mut self, ip: IpKey, now: Instant) -> Option<Duration> {
        let g = self.per_ip.get(&ip)?;
        match g.locked_until {
            Some(until) if until > now => Some(until - now),
            Some(_) => {
                self.per_ip.remove(&ip);
                None
            }
            None if now.saturating_duration_since(g.since) > AUTH_WINDOW => {
                self.per_ip.remove(&ip);
                None
            }
            None => None,
        }
    }

    /// `ip` sent the wrong token `token` at `now`.
    fn wrong(&mut self, ip: IpKey, token: &str, now: Instant) {
        let h = self.keys.hash_one(token);
        if self.per_ip.len() >= MAX_KEYS && !self.per_ip.contains_key(&ip) {
            self.per_ip
                .retain(|_, g| g.locked_until.is_some_and(|u| u > now));
            if self.per_ip.len() >= MAX_KEYS {
                // Failing open for a moment; the global budget still holds.
                tracing::warn!("admin guess limiter full ({MAX_KEYS} clients): starting over");
                self.per_ip.clear();
            }
        }
        let g = self.per_ip.entry(ip).or_insert_with(|| Guesses {
            since: now,
            tokens: Vec::new(),
            locked_until: None,
        });
        if g.tokens.contains(&h) {
            return;
        }
        g.tokens.push(h);
        self.global.0 -= 1.0;
        if g.tokens.len() >= AUTH_FAILURES {
            g.locked_until = Some(now + AUTH_LOCKOUT);
            tracing::warn!(client = %ip, "admin: {AUTH_FAILURES} wrong tokens, locked out");
        }
    }
}

/// How the admin API asked the server to end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopMode {
    /// Graceful: connections finish what they sent, then the final checkpoint.
    Drain,
    /// At once: the final checkpoint without waiting for connections.
    Stop,
}

/// The admin side of a running server.
pub struct Admin {
    token: Secret,
    guesses: Mutex<AuthLimiter>,
    stop: watch::Sender<Option<StopMode>>,
    draining: AtomicBool,
    paused: AtomicBool,
    lr_bits: AtomicU32,
}

impl std::fmt::Debug for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admin")
            .field("token", &self.token)
            .field("paused", &self.paused())
            .field("draining", &self.draining())
            .finish()
    }
}

impl Admin {
    /// The admin side with `token`, or a generated one, returned for printing once.
    ///
    /// # Errors
    /// When the OS has no randomness for a token.
    pub fn new(token: Option<Secret>, lr: f32) -> std::io::Result<(Self, Option<String>)> {
        let (token, generated) = match token {
            Some(t) => (t, None),
            None => {
                let bytes = crate::support::credential::run_secret()?;
                let t: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
                (Secret::new(t.clone()), Some(t))
            }
        };
        Ok((
            Self {
                token,
                guesses: Mutex::new(AuthLimiter::new(Instant::now())),
                stop: watch::channel(None).0,
                draining: AtomicBool::new(false),
                paused: AtomicBool::new(false),
                lr_bits: AtomicU32::new(lr.to_bits()),
            },
            generated,
        ))
    }

    /// Whether `headers` carry the admin token (constant-time comparison), unless `ip` (the
    /// client) or everyone together has been guessing (module doc, "Guessing the token").
    pub fn authenticate(&self, headers: &HeaderMap, ip: IpKey, now: Instant) -> Auth {
        let mut g = self.guesses.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(wait) = g.locked(ip, now).or_else(|| g.global_wait(now)) {
            return Auth::Locked(wait);
        }
        let Some(token) = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
        else {
            return Auth::Missing;
        };
        if self.token.matches(token) {
            return Auth::Granted;
        }
        g.wrong(ip, token, now);
        Auth::Wrong
    }

    /// Whether joins are refused because of a drain or stop.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Records that pushes are paused or resumed (the shards are told by the caller).
    pub fn set_paused(&self, paused: bool) {
        self.paused.store(paused, Ordering::Relaxed);
    }

    /// Records the learning rate every shard now runs with.
    pub fn set_lr(&self, lr: f32) {
        self.lr_bits.store(lr.to_bits(), Ordering::Relaxed);
    }

    /// Whether pushes are paused.
    pub fn paused(&self) -> bool {
        self.paused.load(Ordering::Relaxed)
    }

    /// The learning rate set last (the configured one until `set-lr`).
    pub fn lr(&self) -> f32 {
        f32::from_bits(self.lr_bits.load(Ordering::Relaxed))
    }

    /// How the admin API asked the server to end, if it did.
    pub fn stop_mode(&self) -> Option<StopMode> {
        *self.stop.borrow()
    }

    /// Completes when the admin API asks the server to end.
    pub fn stopped(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.stop.subscribe();
        async move {
            let _ = rx.wait_for(Option::is_some).await;
        }
    }

    pub(crate) fn request_stop(&self, mode: StopMode) {
        self.draining.store(true, Ordering::Relaxed);
        self.stop.send_if_modified(|m| {
            if m.is_none() {
                *m = Some(mode);
                true
            } else {
                false
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bearer(t: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            format!("Bearer {t}").parse().unwrap(),
        );
        h
    }

    fn ip(s: &str) -> IpKey {
        IpKey::of(s.parse().unwrap())
    }

    #[test]
    fn wrong_tokens_lock_a_client_out_even_from_the_right_token() {
        let (a, _) = Admin::new(Some(Secret::new("the-right-token")), 0.1).unwrap();
        let t = Instant::now();
        let right = bearer("the-right-token");
        let (me, other) = (ip("192.0.2.1"), ip("192.0.2.2"));
        assert_eq!(a.authenticate(&HeaderMap::new(), me, t), Auth::Missing);
        // The same wrong token again is one guess.
        for _ in 0..10 {
            assert_eq!(a.authenticate(&bearer("stale"), me, t), Auth::Wrong);
        }
        assert_eq!(a.authenticate(&right, me, t), Auth::Granted);
        for i in 1..AUTH_FAILURES {
            assert_eq!(
                a.authenticate(&bearer(&format!("guess-{i}")), me, t),
                Auth::Wrong
            );
        }
        let Auth::Locked(wait) = a.authenticate(&right, me, t) else {
            panic!("locked out")
        };
        assert_eq!(wait, AUTH_LOCKOUT);
        assert!(matches!(
            a.authenticate(&bearer("guess-9"), me, t + AUTH_LOCKOUT / 2),
            Auth::Locked(_)
        ));
        // Another client is not held back; the lockout ends.
        assert_eq!(a.authenticate(&right, other, t), Auth::Granted);
        assert_eq!(a.authenticate(&right, me, t + AUTH_LOCKOUT), Auth::Granted);
        // Wrong tokens spread over more than the window never lock out.
        let t = t + AUTH_LOCKOUT;
        for i in 0..3 * AUTH_FAILURES {
            let at = t + (AUTH_WINDOW + Duration::from_secs(1)) * (i / 2) as u32;
            assert_eq!(
                a.authenticate(&bearer(&format!("slow-{i}")), me, at),
                Auth::Wrong
            );
        }
    }

    #[test]
    fn guessing_from_many_addresses_is_bounded_over_all() {
        let (a, _) = Admin::new(Some(Secret::new("the-right-token")), 0.1).unwrap();
        let t = Instant::now();
        let mut wrong = 0;
        for n in 0..100u32 {
            let from = ip(&format!("198.51.100.{n}"));
            match a.authenticate(&bearer(&format!("guess-{n}")), from, t) {
                Auth::Wrong => wrong += 1,
                Auth::Locked(wait) => assert!(wait <= Duration::from_secs(1), "{wait:?}"),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(wrong, AUTH_GLOBAL_BURST as usize);
        // The budget refills at its rate.
        let right = bearer("the-right-token");
        assert!(matches!(
            a.authenticate(&right, ip("203.0.113.1"), t),
            Auth::Locked(_)
        ));
        let later = t + Duration::from_secs_f64(1.0 / AUTH_GLOBAL_RATE);
        assert_eq!(
            a.authenticate(&right, ip("203.0.113.1"), later),
            Auth::Granted
        );
    }
}
