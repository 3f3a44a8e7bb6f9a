//! The admin state the coordinator holds: the admin token, paused, draining or stopping, and
//! the live learning rate. Its HTTP routes are [`crate::coordinator::http::admin`].

use crate::support::credential::Secret;
use axum::http::{header, HeaderMap};
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use tokio::sync::watch;

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
                stop: watch::channel(None).0,
                draining: AtomicBool::new(false),
                paused: AtomicBool::new(false),
                lr_bits: AtomicU32::new(lr.to_bits()),
            },
            generated,
        ))
    }

    /// Whether `headers` carry the admin token (constant-time comparison).
    pub fn authorized(&self, headers: &HeaderMap) -> bool {
        let Some(v) = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
        else {
            return false;
        };
        match v.strip_prefix("Bearer ") {
            Some(t) => self.token.matches(t.trim()),
            None => false,
        }
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
