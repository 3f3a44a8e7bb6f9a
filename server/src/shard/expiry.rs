//! Credential expiry where no sessions are kept: a shard process (`crowdgrad shard`).
//!
//! On `serve`'s own shards a credential expires with its worker's session
//! (`Registry::session_open`): 10 minutes neither connected nor seen, and its Hello gets
//! `unknown_worker`, so the worker joins again and gets a new id and credential. A shard
//! process never sees the joins (they happen at the coordinator) and the credential is an HMAC
//! of the worker id alone (docs/protocol.md §1), so it cannot tell when one was issued. Rather
//! than change the credential's bytes, the shard process remembers when it last had each
//! worker ([`Expiry`]):
//!
//! - a worker with a socket open on this shard is always admitted (its expiry clock runs from
//!   its last socket's close);
//! - a worker it has had, but not for `--credential-expiry` (default 600 s, as `serve`), is
//!   refused `unknown_worker`, and stays refused (the entry is kept);
//! - a worker it has never had is admitted, and remembered from then on.
//!
//! What this does not cover, said plainly: a credential never presented to this shard process
//! stays good here until its first use; a restarted shard process starts with an empty table;
//! and the table is bounded ([`MAX_REMEMBERED`] workers, ~10 MiB): when full, the eighth it
//! had longest ago is forgotten, so their credentials count as new again. An attacker would
//! need that many joins (bounded by `--join-rate` per address at the coordinator) to push one
//! out.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Most workers one [`Expiry`] remembers.
pub const MAX_REMEMBERED: usize = 1 << 18;

/// When each worker was last connected to this shard (see the module doc).
#[derive(Debug)]
pub struct Expiry {
    after: Duration,
    max: usize,
    last: Mutex<HashMap<u64, Instant>>,
}

impl Expiry {
    /// Credentials expire `after` their worker's last connection here; at most `max` workers
    /// remembered.
    pub fn new(after: Duration, max: usize) -> Self {
        Self {
            after,
            max: max.max(8),
            last: Mutex::new(HashMap::new()),
        }
    }

    /// The expiry.
    pub fn after(&self) -> Duration {
        self.after
    }

    /// Whether `worker`'s (valid) credential still admits it at `now`; `connected`: it has a
    /// socket open on this shard. An admitted worker is recorded as had at `now`.
    pub fn admit(&self, worker: u64, connected: bool, now: Instant) -> bool {
        let mut g = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&t) = g.get(&worker) {
            if !connected && now.saturating_duration_since(t) >= self.after {
                return false;
            }
        } else if g.len() >= self.max {
            forget_oldest(&mut g, self.max / 8);
        }
        g.insert(worker, now);
        true
    }

    /// `worker`'s socket on this shard closed at `now`: its expiry clock starts again.
    pub fn left(&self, worker: u64, now: Instant) {
        let mut g = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = g.get_mut(&worker) {
            *t = (*t).max(now);
        }
    }

    /// Workers remembered.
    pub fn len(&self) -> usize {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Removes the `n` entries with the oldest times.
fn forget_oldest(g: &mut HashMap<u64, Instant>, n: usize) {
    let mut times: Vec<Instant> = g.values().copied().collect();
    let n = n.clamp(1, times.len());
    let (_, cut, _) = times.select_nth_unstable(n - 1);
    let cut = *cut;
    let mut left = n;
    g.retain(|_, t| {
        if left > 0 && *t <= cut {
            left -= 1;
            false
        } else {
            true
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_away_longer_than_the_expiry_is_refused_and_stays_refused() {
        let e = Expiry::new(Duration::from_secs(600), 1000);
        let t = Instant::now();
        let at = |s: u64| t + Duration::from_secs(s);
        assert!(e.admit(1, false, t), "never seen: first use");
        // Connected for an hour: admitted however long ago the first Hello was.
        assert!(e.admit(1, true, at(3600)));
        e.left(1, at(3600));
        assert!(e.admit(1, false, at(3600 + 599)), "back within 10 minutes");
        e.left(1, at(3600 + 600));
        assert!(!e.admit(1, false, at(3600 + 1200)), "away 10 minutes");
        assert!(!e.admit(1, false, at(9999)), "and stays refused");
        assert!(e.admit(2, false, at(9999)), "another worker is new");
        // A late close never moves the clock back.
        e.left(2, at(5));
        assert!(e.admit(2, false, at(9999 + 599)));
    }

    #[test]
    fn the_table_stays_bounded_and_forgets_the_oldest() {
        let e = Expiry::new(Duration::from_secs(1), 64);
        let t = Instant::now();
        for w in 0..1000u64 {
            assert!(e.admit(w, false, t + Duration::from_millis(w)));
        }
        assert!(e.len() <= 64, "{}", e.len());
        // The newest are still remembered (and expired), the oldest forgotten (new again).
        let late = t + Duration::from_secs(100);
        assert!(!e.admit(999, false, late));
        assert!(e.admit(0, false, late));
    }
}
