//! Per-worker reputation and quarantine (issue 10): what each worker's spot checks
//! ([`crate::defence::spotcheck`]) and refused frames say about it, and the quarantine of workers that
//! fail a spot check or keep sending frames the shards refuse.
//!
//! A quarantined worker
//! - has every shard connection closed at its next frame, after an `Error` frame with code
//!   `quarantined` (19, fatal; [`crate::shard::handler`] asks the session to [`expel`] it);
//! - is refused at Hello with the same code ([`crowdgrad_core::session::Admission::Quarantined`]);
//! - when it joined with an `identity`, that identity's joins are refused with HTTP 403
//!   ([`crate::coordinator::http`]), so a rejoin does not wash the record clean (an identity is chosen by
//!   the worker, so this stops honest-but-broken workers and lazy attackers, not one that
//!   makes up a new identity per join: that is what spot checks keep catching). The identity
//!   bound here is the public id the join derived from the secret the worker sent
//!   ([`crate::registry::ledger::public_id`]): only the secret's holder acts as it, so a
//!   stranger who knows a public id cannot get its owner quarantined;
//! - has its spot checks still waiting in the checker's queue dropped;
//! - is shown in `/api/status` (`reputation`), on the dashboard, and counted in `/metrics`.
//!
//! An admin lifts a quarantine with `POST /api/admin/unquarantine` (`crowdgrad ctl
//! unquarantine`).
//!
//! Refused frames count towards quarantine only with `--quarantine-rejections N` (0, the
//! default, turns it off): N refusals within `--quarantine-window` seconds quarantine the
//! worker. `too_stale` and `busy` are the server's own policies, which honest workers meet
//! under load, and never count; `quarantined` itself does not either. `out_of_bounds` (the
//! norm bound, the largest value) counts only with `--quarantine-out-of-bounds`: an honest
//! worker's outlier gradient is refused now and then, and the refusal alone keeps it out.
//!
//! Bounded: at most [`MAX_TRACKED`] workers and [`MAX_TRACKED`] identities are kept; when full,
//! the least recently touched worker that is not quarantined is forgotten (quarantined
//! identities are forgotten oldest first).
//!
//! [`expel`]: crowdgrad_core::session::ShardSession::expel

use crowdgrad_core::wire::ErrorCode;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

/// Most workers (and quarantined identities) tracked.
pub const MAX_TRACKED: usize = 100_000;

pub use crate::config::defence::QuarantinePolicy;

/// The last spot check of a worker.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CheckFigures {
    /// Cosine similarity of the pushed slice with the recomputed one.
    pub cosine: f64,
    /// Norm of the pushed slice over the recomputed one's.
    pub norm_ratio: f64,
}

/// Why and when a worker was quarantined.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Quarantine {
    /// What it did.
    pub reason: String,
    /// Seconds since the server started, when it happened.
    pub at_s: f64,
}

/// What the server knows of one worker's behaviour.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct WorkerReputation {
    /// Spot checks it passed.
    pub spot_passed: u64,
    /// Spot checks it failed.
    pub spot_failed: u64,
    /// Its pushes sampled but not checked (parameters no longer kept, queue full...).
    pub spot_skipped: u64,
    /// The figures of its last spot check.
    pub last_check: Option<CheckFigures>,
    /// Frames and pushes refused, by error code.
    pub rejections: BTreeMap<&'static str, u64>,
    /// Set while quarantined.
    pub quarantined: Option<Quarantine>,
    /// The public id of the identity it joined with, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
    #[serde(skip)]
    recent: VecDeque<Instant>,
    #[serde(skip)]
    touched: u64,
}

/// The result of one spot check, as the checker reports it.
#[derive(Debug, Clone, PartialEq)]
pub enum CheckResult {
    /// Within the tolerances.
    Passed(CheckFigures),
    /// Outside them, or the push did not fit what its tag says; the text says how.
    Failed(String, Option<CheckFigures>),
    /// Not checked.
    Skipped,
}

#[derive(Debug, Default)]
struct Inner {
    workers: HashMap<u64, WorkerReputation>,
    /// Quarantined identities: reason, and order of insertion for the bound.
    identities: HashMap<String, Quarantine>,
    identity_order: VecDeque<String>,
    tick: u64,
}

/// Cheap to share (`Arc`): every handler and the checker thread report here.
#[derive(Debug)]
pub struct Reputation {
    inner: Mutex<Inner>,
    /// Bumped on every quarantine and lift: handlers re-check their worker only then.
    epoch: AtomicU64,
    /// The same epoch for handlers waiting on their socket or a parked pull: a quarantine
    /// wakes them, so a worker is expelled (and its pending sync pushes dropped) at once, not
    /// at its next frame.
    changed: tokio::sync::watch::Sender<u64>,
    policy: QuarantinePolicy,
    started: Instant,
}

/// `/api/status`'s `reputation`.
#[derive(Debug, Clone, Serialize)]
pub struct ReputationStatus {
    /// Refusals within the window that quarantine (0: off), and the window in seconds.
    pub quarantine_rejections: u32,
    /// The window, seconds.
    pub quarantine_window_s: f64,
    /// Workers quarantined now.
    pub quarantined: usize,
    /// Identities whose joins are refused.
    pub quarantined_identities: usize,
    /// Per worker id (as a string key), the workers with anything on record.
    pub workers: BTreeMap<String, WorkerReputation>,
}

/// The dashboard tick's `reputation`: [`ReputationStatus`] without the per-worker records
/// (those come with the page of workers they belong to, [`Reputation::of`]).
#[derive(Debug, Clone, Serialize)]
pub struct ReputationSummary {
    /// As [`ReputationStatus::quarantine_rejections`].
    pub quarantine_rejections: u32,
    /// The window, seconds.
    pub quarantine_window_s: f64,
    /// Workers quarantined now.
    pub quarantined: usize,
    /// Identities whose joins are refused.
    pub quarantined_identities: usize,
}

impl Reputation {
    /// Empty, quarantining by `policy` (and by failed spot checks).
    pub fn new(policy: QuarantinePolicy) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            epoch: AtomicU64::new(0),
            changed: tokio::sync::watch::Sender::new(0),
            policy,
            started: Instant::now(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Only counters; a poisoned lock still holds usable ones.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The quarantine epoch: changes whenever a worker is quarantined or lifted.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Whether refused frames quarantine (`--quarantine-rejections` above 0).
    pub fn quarantines_on_refusals(&self) -> bool {
        self.policy.rejections > 0
    }

    /// Wakes when the epoch moves ([`Reputation::epoch`]).
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    fn bump(&self) {
        let e = self.epoch.fetch_add(1, Ordering::AcqRel) + 1;
        self.changed.send_replace(e);
    }

    fn entry(g: &mut Inner, worker: u64) -> &mut WorkerReputation {
        g.tick += 1;
        let tick = g.tick;
        if !g.workers.contains_key(&worker) && g.workers.len() >= MAX_TRACKED {
            let victim = g
                .workers
                .iter()
                .filter(|(_, r)| r.quarantined.is_none())
                .min_by_key(|(_, r)| r.touched)
                .map(|(id, _)| *id);
            if let Some(v) = victim {
                g.workers.remove(&v);
            }
        }
        let r = g.workers.entry(worker).or_default();
        r.touched = tick;
        r
    }

    /// `worker` joined with `identity` (to refuse that identity's joins if it is quarantined).
    pub fn bind(&self, worker: u64, identity: &str) {
        let mut g = self.lock();
        Self::entry(&mut g, worker).identity = Some(identity.to_string());
    }

    /// Spot checks `worker` has passed (0 for a worker with nothing on record): the
    /// spot checker keeps a worker with fewer than
    /// [`PROBATION_CHECKS`](crate::defence::spotcheck::PROBATION_CHECKS) on probation.
    pub fn spot_passed(&self, worker: u64) -> u64 {
        self.lock()
            .workers
            .get(&worker)
            .map_or(0, |r| r.spot_passed)
    }

    /// Why `worker` is quarantined, if it is.
    pub fn quarantined(&self, worker: u64) -> Option<String> {
        let g = self.lock();
        g.workers
            .get(&worker)
            .and_then(|r| r.quarantined.as_ref())
            .map(|q| q.reason.clone())
    }

    /// Why `identity` is refused, if it is.
    pub fn identity_quarantined(&self, identity: &str) -> Option<String> {
        self.lock()
            .identities
            .get(identity)
            .map(|q| q.reason.clone())
    }

    /// Quarantines `worker` (and its identity) for `reason`. Returns false when it already was.
    pub fn quarantine(&self, worker: u64, reason: String) -> bool {
        let at_s = self.started.elapsed().as_secs_f64();
        let q = Quarantine { reason, at_s };
        let mut g = self.lock();
        let r = Self::entry(&mut g, worker);
        if r.quarantined.is_some() {
            return false;
        }
        r.quarantined = Some(q.clone());
        let identity = r.identity.clone();
        if let Some(id) = identity {
            if g.identities.insert(id.clone(), q).is_none() {
                g.identity_order.push_back(id);
                while g.identity_order.len() > MAX_TRACKED {
                    if let Some(old) = g.identity_order.pop_front() {
                        g.identities.remove(&old);
                    }
                }
            }
        }
        drop(g);
        self.bump();
        tracing::warn!(worker, "worker quarantined");
        true
    }

    /// Lifts the quarantine of `worker` (and of its identity). Returns whether it was
    /// quarantined.
    pub fn lift(&self, worker: u64) -> bool {
        let mut g = self.lock();
        let Some(r) = g.workers.get_mut(&worker) else {
            return false;
        };
        let was = r.quarantined.take().is_some();
        r.recent.clear();
        let identity = r.identity.clone();
        if let Some(id) = identity {
            g.identities.remove(&id);
            g.identity_order.retain(|i| *i != id);
        }
        drop(g);
        if was {
            self.bump();
        }
        was
    }

    /// Lifts the refusal of `identity`'s joins (and the quarantine of its workers). Returns
    /// whether anything was lifted: its joins were refused or one of its workers was
    /// quarantined (an identity whose workers are all in good standing is not quarantined:
    /// false, and the admin API answers 404 as documented).
    pub fn lift_identity(&self, identity: &str) -> bool {
        let workers: Vec<u64> = {
            let mut g = self.lock();
            let was = g.identities.remove(identity).is_some();
            g.identity_order.retain(|i| i != identity);
            let ws: Vec<u64> = g
                .workers
                .iter()
                .filter(|(_, r)| r.identity.as_deref() == Some(identity) && r.quarantined.is_some())
                .map(|(id, _)| *id)
                .collect();
            if !was && ws.is_empty() {
                return false;
            }
            ws
        };
        for w in workers {
            self.lift(w);
        }
        self.bump();
        true
    }

    /// A shard refused a frame or push of `worker` with `code`; quarantines it when the policy
    /// says it keeps doing so.
    pub fn rejected(&self, worker: u64, code: ErrorCode) {
        let counts = match code {
            ErrorCode::TooStale | ErrorCode::Busy | ErrorCode::Quarantined => false,
            ErrorCode::OutOfBounds => self.policy.out_of_bounds,
            _ => true,
        };
        let now = Instant::now();
        let window = self.policy.window;
        let limit = self.policy.rejections as usize;
        let trip = {
            let mut g = self.lock();
            let r = Self::entry(&mut g, worker);
            *r.rejections.entry(code.name()).or_default() += 1;
            if !counts || limit == 0 || r.quarantined.is_some() {
                return;
            }
            r.recent.push_back(now);
            while r
                .recent
                .front()
                .is_some_and(|t| now.duration_since(*t) > window)
            {
                r.recent.pop_front();
            }
            while r.recent.len() > limit {
                r.recent.pop_front();
            }
            r.recent.len() >= limit
        };
        if trip {
            self.quarantine(
                worker,
                format!(
                    "{limit} frames refused within {} s (last: {})",
                    window.as_secs_f64(),
                    code.name()
                ),
            );
        }
    }

    /// The checker's verdict on one of `worker`'s pushes; a failure quarantines it.
    /// Returns whether this result quarantined the worker (it was not before).
    pub fn checked(&self, worker: u64, result: CheckResult) -> bool {
        let reason = {
            let mut g = self.lock();
            let r = Self::entry(&mut g, worker);
            match result {
                CheckResult::Passed(f) => {
                    r.spot_passed += 1;
                    r.last_check = Some(f);
                    None
                }
                CheckResult::Failed(why, f) => {
                    r.spot_failed += 1;
                    if f.is_some() {
                        r.last_check = f;
                    }
                    Some(why)
                }
                CheckResult::Skipped => {
                    r.spot_skipped += 1;
                    None
                }
            }
        };
        match reason {
            Some(why) => self.quarantine(worker, format!("failed a spot check: {why}")),
            None => false,
        }
    }

    /// Workers quarantined now.
    pub fn quarantined_count(&self) -> usize {
        self.lock()
            .workers
            .values()
            .filter(|r| r.quarantined.is_some())
            .count()
    }

    /// The counts of [`Reputation::status`], without sorting or copying any record.
    pub fn summary(&self) -> ReputationSummary {
        let g = self.lock();
        ReputationSummary {
            quarantine_rejections: self.policy.rejections,
            quarantine_window_s: self.policy.window.as_secs_f64(),
            quarantined: g
                .workers
                .values()
                .filter(|r| r.quarantined.is_some())
                .count(),
            quarantined_identities: g.identities.len(),
        }
    }

    /// Drops the records of workers the registry forgot (gone for 10 minutes), except a
    /// quarantined one's: a crowd that left gives its memory back instead of staying here
    /// until [`MAX_TRACKED`] others push it out. A forgotten worker id is never handed out
    /// again, and a quarantined identity is kept apart (its joins stay refused).
    pub fn forget(&self, ids: &[u64]) {
        let mut g = self.lock();
        for id in ids {
            if g.workers.get(id).is_some_and(|r| r.quarantined.is_none()) {
                g.workers.remove(id);
            }
        }
    }

    /// The records of the workers `ids` that have one, by id as a string key.
    pub fn of(&self, ids: impl IntoIterator<Item = u64>) -> BTreeMap<String, WorkerReputation> {
        let g = self.lock();
        ids.into_iter()
            .filter_map(|id| g.workers.get(&id).map(|r| (id.to_string(), r.clone())))
            .collect()
    }

    /// The status section: the policy, and every worker with a spot check, a refusal or a
    /// quarantine on record (at most `limit`, quarantined ones first, then the newest ids).
    pub fn status(&self, limit: usize) -> ReputationStatus {
        let g = self.lock();
        let mut ids: Vec<(&u64, &WorkerReputation)> = g.workers.iter().collect();
        ids.sort_by_key(|(id, r)| (r.quarantined.is_none(), std::cmp::Reverse(**id)));
        ReputationStatus {
            quarantine_rejections: self.policy.rejections,
            quarantine_window_s: self.policy.window.as_secs_f64(),
            quarantined: g
                .workers
                .values()
                .filter(|r| r.quarantined.is_some())
                .count(),
            quarantined_identities: g.identities.len(),
            workers: ids
                .into_iter()
                .take(limit)
                .map(|(id, r)| (id.to_string(), r.clone()))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_failed_check_quarantines_the_worker_and_its_identity_until_lifted() {
        let r = Reputation::new(QuarantinePolicy::default());
        r.bind(7, "volunteer-7");
        let e0 = r.epoch();
        let figures = CheckFigures {
            cosine: 1.0,
            norm_ratio: 1.0,
        };
        r.checked(7, CheckResult::Passed(figures));
        assert_eq!(r.quarantined(7), None);
        assert_eq!(r.epoch(), e0);
        r.checked(7, CheckResult::Failed("cosine 0.1".into(), None));
        assert!(r.quarantined(7).unwrap().contains("cosine 0.1"));
        assert!(r.identity_quarantined("volunteer-7").is_some());
        assert_ne!(r.epoch(), e0);
        let s = r.status(10);
        assert_eq!((s.quarantined, s.quarantined_identities), (1, 1));
        assert_eq!(s.workers["7"].spot_passed, 1);
        assert_eq!(s.workers["7"].spot_failed, 1);
        assert!(r.lift(7));
        assert_eq!(r.quarantined(7), None);
        assert_eq!(r.identity_quarantined("volunteer-7"), None);
        assert!(!r.lift(7));
    }

    /// Lifting an identity that is not quarantined lifts nothing: false, which the admin
    /// API answers 404 (docs/protocol.md, `POST /api/admin/unquarantine`). It returned true
    /// (200) whenever the identity had a worker on record, quarantined or not.
    #[test]
    fn lifting_an_identity_in_good_standing_lifts_nothing() {
        let r = Reputation::new(QuarantinePolicy::default());
        r.bind(7, "volunteer-7");
        r.checked(
            7,
            CheckResult::Passed(CheckFigures {
                cosine: 1.0,
                norm_ratio: 1.0,
            }),
        );
        let e0 = r.epoch();
        assert!(!r.lift_identity("volunteer-7"), "nothing was quarantined");
        assert!(!r.lift_identity("nobody"), "an identity never seen");
        assert_eq!(r.epoch(), e0, "nothing moved");
        r.checked(7, CheckResult::Failed("cosine 0.1".into(), None));
        assert!(r.lift_identity("volunteer-7"));
        assert_eq!(r.quarantined(7), None);
        assert_eq!(r.identity_quarantined("volunteer-7"), None);
        assert!(!r.lift_identity("volunteer-7"), "already lifted");
    }

    #[test]
    fn refusals_quarantine_only_when_configured_and_policy_refusals_never_count() {
        let off = Reputation::new(QuarantinePolicy::default());
        for _ in 0..100 {
            off.rejected(1, ErrorCode::OutOfBounds);
        }
        assert_eq!(off.quarantined(1), None);
        assert_eq!(off.status(10).workers["1"].rejections["out_of_bounds"], 100);
        let on = Reputation::new(QuarantinePolicy {
            rejections: 3,
            window: Duration::from_secs(60),
            out_of_bounds: false,
        });
        for _ in 0..50 {
            on.rejected(2, ErrorCode::TooStale);
            on.rejected(2, ErrorCode::Busy);
            // An honest worker's outlier: refused, never quarantined for it by default.
            on.rejected(2, ErrorCode::OutOfBounds);
        }
        assert_eq!(on.quarantined(2), None);
        assert_eq!(on.status(10).workers["2"].rejections["out_of_bounds"], 50);
        on.rejected(2, ErrorCode::Malformed);
        on.rejected(2, ErrorCode::Replayed);
        assert_eq!(on.quarantined(2), None);
        on.rejected(2, ErrorCode::NotFinite);
        assert!(on.quarantined(2).unwrap().contains("not_finite"));
        // Asked for: out_of_bounds counts like the others.
        let strict = Reputation::new(QuarantinePolicy {
            rejections: 3,
            window: Duration::from_secs(60),
            out_of_bounds: true,
        });
        for _ in 0..3 {
            strict.rejected(3, ErrorCode::OutOfBounds);
        }
        assert!(strict.quarantined(3).unwrap().contains("out_of_bounds"));
    }

    /// Workers the registry forgot leave the table; a quarantined one stays, and so does its
    /// identity's quarantine.
    #[test]
    fn forgotten_workers_leave_the_table_but_quarantines_stay() {
        let r = Reputation::new(QuarantinePolicy::default());
        for w in 1..=3 {
            r.bind(w, &format!("volunteer-{w}"));
        }
        r.checked(2, CheckResult::Failed("cosine 0.1".into(), None));
        assert_eq!(r.of([1, 2, 3]).len(), 3);
        r.forget(&[1, 2, 99]);
        assert_eq!(r.of([1, 2, 3]).keys().collect::<Vec<_>>(), ["2", "3"]);
        assert!(r.quarantined(2).is_some());
        assert!(r.identity_quarantined("volunteer-2").is_some());
        assert_eq!(r.spot_passed(1), 0, "nothing on record");
    }
}
