//! A teacher's demonstration (issue 19, `POST /api/admin/demo`): one chosen worker made slow
//! or faulty by the server, so a class watches staleness and the defences at work. Off unless
//! set, per worker id:
//!
//! - `delay_ms`: the shard holds each of that worker's pushes this long before it takes it
//!   (its Ack and the Params of the pull behind it come that much later), so the push is
//!   applied that much staler — or, in `sync:K`, arrives late;
//! - `fault`: the shard rewrites each of that worker's pushes on arrival as a faulty worker
//!   with that [`Fault`] would have sent it ([`Faults::corrupt`], the same code as `crowdgrad
//!   work --fault`), and the push goes on through every check as if the worker had sent it.
//!
//! The handler of every connection asks [`Demo::get`] once per push; with no demonstration
//! set that is one relaxed atomic load.

use crowdgrad_core::fault::{Collusion, Fault, Faults};
use crowdgrad_core::rng::Rng;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::RwLock;
use std::time::Duration;

/// The longest delay a demonstration may set.
pub const MAX_DELAY_MS: u32 = 10_000;

/// Most workers with a demonstration at once.
pub const MAX_WORKERS: usize = 64;

/// What is done to one worker's pushes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Setting {
    /// The worker.
    pub worker: u64,
    /// Held this long before the shard takes each push.
    pub delay_ms: Option<u32>,
    /// Rewritten as this fault (its `--fault` name in the JSON).
    #[serde(serialize_with = "fault_name")]
    pub fault: Option<Fault>,
}

fn fault_name<S: serde::Serializer>(f: &Option<Fault>, s: S) -> Result<S::Ok, S::Error> {
    match f {
        Some(f) => s.serialize_str(&f.to_string()),
        None => s.serialize_none(),
    }
}

/// Every demonstration on, shared by the shards' handlers and the admin API.
#[derive(Debug, Default)]
pub struct Demo {
    any: AtomicBool,
    on: RwLock<BTreeMap<u64, Setting>>,
}

impl Demo {
    /// Sets `worker`'s demonstration (both `None`: clears it).
    ///
    /// # Errors
    /// A delay above [`MAX_DELAY_MS`], or more than [`MAX_WORKERS`] workers; nothing changes.
    pub fn set(
        &self,
        worker: u64,
        delay_ms: Option<u32>,
        fault: Option<Fault>,
    ) -> Result<(), String> {
        if delay_ms.is_some_and(|d| d > MAX_DELAY_MS) {
            return Err(format!("delay_ms must be at most {MAX_DELAY_MS}"));
        }
        let mut on = self.on.write().unwrap_or_else(|p| p.into_inner());
        if delay_ms.is_none() && fault.is_none() {
            on.remove(&worker);
        } else {
            if !on.contains_key(&worker) && on.len() >= MAX_WORKERS {
                return Err(format!(
                    "at most {MAX_WORKERS} workers can have a demonstration at once"
                ));
            }
            on.insert(
                worker,
                Setting {
                    worker,
                    delay_ms,
                    fault,
                },
            );
        }
        self.any.store(!on.is_empty(), Ordering::Release);
        Ok(())
    }

    /// Clears every demonstration.
    pub fn clear(&self) {
        self.on.write().unwrap_or_else(|p| p.into_inner()).clear();
        self.any.store(false, Ordering::Release);
    }

    /// `worker`'s demonstration, if one is on.
    pub fn get(&self, worker: u64) -> Option<Setting> {
        if !self.any.load(Ordering::Acquire) {
            return None;
        }
        self.on
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&worker)
            .copied()
    }

    /// Every demonstration on, by worker.
    pub fn list(&self) -> Vec<Setting> {
        self.on
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .copied()
            .collect()
    }
}

/// What one connection keeps to carry out a fault (the first push, for `replay`).
#[derive(Debug)]
pub struct Rewriter {
    faults: Faults,
    rng: Rng,
}

impl Rewriter {
    /// For a connection of `worker` to one of `shards` shards.
    pub fn new(worker: u64, shards: usize, seed: u64) -> Self {
        Self {
            faults: Faults::new(Collusion::Seeded(seed), 1, shards),
            rng: Rng::new(seed ^ worker.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
        }
    }

    /// `frame` (a push) as the fault rewrites it.
    pub fn rewrite(&mut self, frame: Vec<u8>, fault: Fault) -> Vec<u8> {
        self.faults.corrupt(0, frame, fault, &mut self.rng).0
    }
}

/// The delay of `s` as a duration.
pub fn delay(s: &Setting) -> Option<Duration> {
    s.delay_ms
        .filter(|&d| d > 0)
        .map(|d| Duration::from_millis(u64::from(d)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_bounded_and_cleared() {
        let d = Demo::default();
        assert_eq!(d.get(3), None);
        assert!(d.set(3, Some(10_001), None).is_err());
        assert_eq!(d.get(3), None);
        d.set(3, Some(500), Some(Fault::SignFlip(10.0))).unwrap();
        let s = d.get(3).unwrap();
        assert_eq!(delay(&s), Some(Duration::from_millis(500)));
        assert_eq!(
            serde_json::to_value(s).unwrap(),
            serde_json::json!({"worker": 3, "delay_ms": 500, "fault": "signflip:10"})
        );
        d.set(3, None, None).unwrap();
        assert_eq!(d.get(3), None);
        assert!(d.list().is_empty());
    }

    #[test]
    fn a_rewritten_push_is_the_fault() {
        let push = crowdgrad_core::wire::encode_push(9, 0, 4, 32, &[1.0, -2.0]);
        let mut r = Rewriter::new(1, 2, 42);
        let out = r.rewrite(push, Fault::SignFlip(10.0));
        match crowdgrad_core::wire::decode(&out, 1 << 20).unwrap() {
            crowdgrad_core::wire::Message::Push {
                request_id,
                base_version,
                grad,
                ..
            } => {
                assert_eq!((request_id, base_version), (9, 4));
                assert_eq!(grad.iter().collect::<Vec<_>>(), vec![-10.0, 20.0]);
            }
            other => panic!("{other:?}"),
        }
    }
}
