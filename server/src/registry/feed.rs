//! What a shard process tells its coordinator about the workers' pushes (issue 18).
//!
//! With `crowdgrad serve --shard-urls`, pushes go to `crowdgrad shard` processes and the
//! coordinator never sees them. Two things there need them: the contribution ledger (samples
//! and compute seconds are credited for accepted pushes and Reports) and the join admission
//! bound ([`crate::registry::admission`]: a worker is established once a push of it was
//! applied). So each shard process keeps a [`Feed`]: per worker, what its pushes did since the
//! coordinator last took it, and the coordinator takes it about once a second
//! (`GET /api/feed`, `crate::coordinator::remote`), applying it to its own registry with
//! [`crate::registry::Registry::tallied`].
//!
//! Exactly once, with one batch in flight: a take seals what is open into a [`Batch`] with the
//! next sequence number and hands it out; it is handed out again, unchanged, until the
//! coordinator acknowledges its number in a later take (`ack`); only then is the next one
//! sealed. A lost answer therefore loses nothing, and a repeated one is recognised by its
//! number ([`Cursor`]). Numbers are per process start (`boot`): a restarted shard process
//! starts again at 1, and an acknowledgement for another start is ignored.
//!
//! Bounded: at most [`MAX_WORKERS`] workers are open (a push of one more is counted in `lost`
//! and otherwise dropped) and a batch carries at most [`MAX_BATCH`] of them (the rest stay
//! open for the next).

use crowdgrad_core::shard::Outcome;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// Most workers the open part holds.
pub const MAX_WORKERS: usize = 1 << 20;
/// Most workers one batch carries.
pub const MAX_BATCH: usize = 1 << 16;

/// What one worker's pushes did on one shard since the last batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Tally {
    /// Pushes applied (in sync mode: buffered into an aggregate).
    pub accepted: u64,
    /// Pushes refused.
    pub rejected: u64,
    /// Examples behind the applied pushes (shard 0 counts them, as in the registry).
    pub samples: u64,
    /// Of those, the examples the ledger credits (not those of all-zero pushes).
    pub credited: u64,
    /// The largest compute seconds the worker's Reports stated (shard 0 takes Reports),
    /// already checked by the shard's session (`crowdgrad_core::session::check_report`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_s: Option<f64>,
}

impl Tally {
    fn add(&mut self, o: &Tally) {
        self.accepted = self.accepted.saturating_add(o.accepted);
        self.rejected = self.rejected.saturating_add(o.rejected);
        self.samples = self.samples.saturating_add(o.samples);
        self.credited = self.credited.saturating_add(o.credited);
        self.compute_s = match (self.compute_s, o.compute_s) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
}

/// One batch of the feed, as `GET /api/feed` answers it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Batch {
    /// The shard process's start this numbering belongs to.
    pub boot: u64,
    /// The batch's number (from 1); 0 with no batch (nothing happened since the last).
    pub seq: u64,
    /// Worker id and its tally.
    pub workers: Vec<(u64, Tally)>,
    /// Workers' events dropped since the process started, because [`MAX_WORKERS`] were open.
    pub lost: u64,
}

/// The shard process's side ([module doc](self)).
#[derive(Debug)]
pub struct Feed {
    boot: u64,
    next_seq: u64,
    open: HashMap<u64, Tally>,
    sealed: Option<Batch>,
    lost: u64,
}

impl Feed {
    /// An empty feed for the process start `boot` (any number that differs between starts).
    pub fn new(boot: u64) -> Self {
        Self {
            boot,
            next_seq: 1,
            open: HashMap::new(),
            sealed: None,
            lost: 0,
        }
    }

    fn entry(&mut self, worker: u64) -> Option<&mut Tally> {
        if !self.open.contains_key(&worker) && self.open.len() >= MAX_WORKERS {
            self.lost += 1;
            return None;
        }
        Some(self.open.entry(worker).or_default())
    }

    /// A push of `worker` had `outcome`; `samples` is `Some` on the shard that counts them;
    /// `nonzero`: its gradient moved anything.
    pub fn pushed(&mut self, worker: u64, outcome: &Outcome, samples: Option<u32>, nonzero: bool) {
        let Some(t) = self.entry(worker) else {
            return;
        };
        match outcome {
            Outcome::Applied { .. } | Outcome::Buffered { .. } => {
                let n = u64::from(samples.unwrap_or(0));
                t.accepted = t.accepted.saturating_add(1);
                t.samples = t.samples.saturating_add(n);
                if nonzero {
                    t.credited = t.credited.saturating_add(n);
                }
            }
            Outcome::Rejected { .. } => t.rejected = t.rejected.saturating_add(1),
        }
    }

    /// `worker` reported `compute_s` seconds of computing in its session so far.
    pub fn reported(&mut self, worker: u64, compute_s: f64) {
        if !(compute_s.is_finite() && compute_s >= 0.0) {
            return;
        }
        if let Some(t) = self.entry(worker) {
            t.add(&Tally {
                compute_s: Some(compute_s),
                ..Tally::default()
            });
        }
    }

    /// The coordinator's take: `ack` acknowledges batch `ack` of start `boot` (0: none). The
    /// unacknowledged batch again if there is one, else what is open sealed into the next
    /// (`seq` 0 and no workers when nothing is open).
    pub fn take(&mut self, boot: u64, ack: u64) -> Batch {
        if boot == self.boot && self.sealed.as_ref().is_some_and(|b| b.seq <= ack) {
            self.sealed = None;
        }
        if let Some(b) = &self.sealed {
            return Batch {
                lost: self.lost,
                ..b.clone()
            };
        }
        if self.open.is_empty() {
            return Batch {
                boot: self.boot,
                lost: self.lost,
                ..Batch::default()
            };
        }
        let workers: Vec<(u64, Tally)> = if self.open.len() <= MAX_BATCH {
            self.open.drain().collect()
        } else {
            let ids: Vec<u64> = self.open.keys().take(MAX_BATCH).copied().collect();
            ids.into_iter()
                .filter_map(|id| self.open.remove(&id).map(|t| (id, t)))
                .collect()
        };
        let batch = Batch {
            boot: self.boot,
            seq: self.next_seq,
            workers,
            lost: self.lost,
        };
        self.next_seq += 1;
        self.sealed = Some(batch.clone());
        batch
    }
}

/// The coordinator's side for one shard: which batch it applied last.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cursor {
    boot: Option<u64>,
    applied: u64,
}

impl Cursor {
    /// The query of the next take: `(boot, ack)`.
    pub fn query(&self) -> (u64, u64) {
        (self.boot.unwrap_or(0), self.applied)
    }

    /// Whether `batch` is new (to apply); moves the cursor past it if so. A batch of another
    /// process start restarts the numbering.
    pub fn fresh(&mut self, batch: &Batch) -> bool {
        if self.boot != Some(batch.boot) {
            self.boot = Some(batch.boot);
            self.applied = 0;
        }
        if batch.seq == 0 || batch.seq <= self.applied {
            return false;
        }
        self.applied = batch.seq;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::ledger::tests::applied;
    use crowdgrad_core::wire::ErrorCode;

    #[test]
    fn a_lost_answer_is_handed_out_again_and_applied_once() {
        let mut f = Feed::new(7);
        f.pushed(3, &applied(), Some(32), true);
        f.pushed(3, &applied(), Some(32), false);
        f.pushed(
            4,
            &Outcome::Rejected {
                code: ErrorCode::OutOfBounds,
                message: String::new(),
            },
            Some(32),
            true,
        );
        f.reported(3, 2.5);
        f.reported(3, f64::INFINITY);
        let mut c = Cursor::default();
        let (boot, ack) = c.query();
        let first = f.take(boot, ack);
        assert_eq!((first.boot, first.seq), (7, 1));
        let mut w = first.workers.clone();
        w.sort_by_key(|x| x.0);
        assert_eq!(
            w,
            vec![
                (
                    3,
                    Tally {
                        accepted: 2,
                        rejected: 0,
                        samples: 64,
                        credited: 32,
                        compute_s: Some(2.5)
                    }
                ),
                (
                    4,
                    Tally {
                        rejected: 1,
                        ..Tally::default()
                    }
                )
            ]
        );
        // The answer is lost: the coordinator asks again with its old cursor and gets the
        // same batch, though more happened meanwhile.
        f.pushed(5, &applied(), None, true);
        let again = f.take(boot, ack);
        assert_eq!(again, first);
        assert!(c.fresh(&again));
        assert!(!c.fresh(&again), "a batch is applied once");
        let (boot, ack) = c.query();
        assert_eq!((boot, ack), (7, 1));
        let second = f.take(boot, ack);
        assert_eq!(second.seq, 2);
        assert_eq!(
            second.workers,
            vec![(
                5,
                Tally {
                    accepted: 1,
                    ..Tally::default()
                }
            )]
        );
        assert!(c.fresh(&second));
        let (boot, ack) = c.query();
        let none = f.take(boot, ack);
        assert_eq!((none.seq, none.workers.len()), (0, 0));
        assert!(!c.fresh(&none));
    }

    #[test]
    fn another_start_restarts_the_numbering_and_a_foreign_ack_acks_nothing() {
        let mut old = Feed::new(1);
        old.pushed(3, &applied(), Some(1), true);
        let mut c = Cursor::default();
        assert!(c.fresh(&old.take(0, 0)));
        assert_eq!(c.query(), (1, 1));
        let mut new = Feed::new(2);
        new.pushed(3, &applied(), Some(1), true);
        let (boot, ack) = c.query();
        let b = new.take(boot, ack);
        assert_eq!((b.boot, b.seq), (2, 1));
        // The old start's ack 1 did not acknowledge the new start's batch 1.
        assert_eq!(new.take(boot, ack), b);
        assert!(c.fresh(&b), "a new start's batch 1 is new");
    }

    #[test]
    fn open_workers_and_batches_are_bounded() {
        let mut f = Feed::new(1);
        for id in 0..(MAX_BATCH as u64 + 10) {
            f.pushed(id, &applied(), None, true);
        }
        let b = f.take(0, 0);
        assert_eq!(b.workers.len(), MAX_BATCH);
        let rest = f.take(1, b.seq);
        assert_eq!((rest.seq, rest.workers.len()), (2, 10));
        let mut full = Feed::new(1);
        full.open = (0..MAX_WORKERS as u64)
            .map(|i| (i, Tally::default()))
            .collect();
        full.pushed(u64::MAX, &applied(), None, true);
        full.pushed(0, &applied(), None, true);
        assert_eq!(full.lost, 1);
        assert_eq!(full.open.len(), MAX_WORKERS);
    }
}
