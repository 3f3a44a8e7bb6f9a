//! A parameter shard: one contiguous key range of the flat vector.
//!
//! Read semantics (documented in docs/protocol.md): the shard's state is an immutable
//! [`Snapshot`] (version + values) behind an `ArcSwap`. A pull loads the current snapshot
//! lock-free and encodes it; it never waits for an update. Every update is applied by the shard's
//! single writer thread to a *copy* of the current snapshot, which is then published atomically.
//! So a pull observes the shard between two applied pushes, never a half-applied push, and a push
//! is applied whole or not at all (it is validated completely before the copy is touched).
//!
//! The writer is an actor fed by a bounded channel (ps-lite's single receive thread per server);
//! it owns the optimizer state, so the update rule needs no lock. Old snapshots are recycled
//! once no reader holds them, so a steady state allocates nothing per push.

use crate::config::StalenessPolicy;
use arc_swap::ArcSwap;
use bytes::Bytes;
use crowdgrad_core::optim::{self, OptState, OptimizerConfig};
use crowdgrad_core::partition::KeyRange;
use crowdgrad_core::wire::{self, ErrorCode, Message};
use std::sync::Arc;
use std::thread::JoinHandle;
use tokio::sync::{mpsc, oneshot};

/// An immutable view of a shard's values at one version.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Number of updates applied to reach these values.
    pub version: u64,
    /// The values of the shard's key range.
    pub values: Vec<f32>,
}

/// What happened to a push.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Applied; the shard is now at `version`.
    Applied {
        /// Version after the update.
        version: u64,
        /// Updates between the push's base version and the one it was applied on.
        staleness: u64,
        /// Examples the gradient came from.
        samples: u32,
    },
    /// Not applied.
    Rejected {
        /// Why.
        code: ErrorCode,
        /// Human-readable detail.
        message: String,
    },
}

struct Apply {
    frame: Bytes,
    reply: oneshot::Sender<Outcome>,
}

struct Inner {
    id: u32,
    range: KeyRange,
    current: ArcSwap<Snapshot>,
    tx: mpsc::Sender<Apply>,
}

/// Cheap-to-clone handle to one shard (like mini-redis' `Db`).
#[derive(Clone)]
pub struct Shard {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shard")
            .field("id", &self.inner.id)
            .field("range", &self.inner.range)
            .field("version", &self.version())
            .finish()
    }
}

/// Join handle of a shard's writer thread; the thread ends when every [`Shard`] handle is gone.
#[derive(Debug)]
pub struct Writer(JoinHandle<()>);

impl Writer {
    /// Waits for the writer to finish its queued updates and exit.
    pub fn join(self) {
        let _ = self.0.join();
    }
}

/// Largest number of pushes queued for one shard's writer.
pub const QUEUE: usize = 64;

impl Shard {
    /// Starts shard `id` over `range` with `initial` values and its writer thread.
    ///
    /// # Panics
    /// If `initial` does not have `range.len()` values (a startup bug, not input).
    pub fn start(
        id: u32,
        range: KeyRange,
        initial: Vec<f32>,
        optimizer: OptimizerConfig,
        staleness: StalenessPolicy,
    ) -> (Self, Writer) {
        assert_eq!(initial.len(), range.len());
        let (tx, rx) = mpsc::channel(QUEUE);
        let inner = Arc::new(Inner {
            id,
            range,
            current: ArcSwap::from_pointee(Snapshot {
                version: 0,
                values: initial,
            }),
            tx,
        });
        let writer_inner = Arc::downgrade(&inner);
        let handle = std::thread::Builder::new()
            .name(format!("shard-{id}"))
            .spawn(move || writer(writer_inner, rx, optimizer, staleness, range))
            .expect("spawn shard writer thread");
        (Self { inner }, Writer(handle))
    }

    /// Shard index.
    pub fn id(&self) -> u32 {
        self.inner.id
    }

    /// Key range.
    pub fn range(&self) -> KeyRange {
        self.inner.range
    }

    /// Current version.
    pub fn version(&self) -> u64 {
        self.inner.current.load().version
    }

    /// The current snapshot (lock-free; never waits for an update).
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.inner.current.load_full()
    }

    /// Largest frame this shard accepts: a full push plus meta.
    pub fn frame_limit(&self) -> usize {
        wire::HEADER_LEN + wire::MAX_META_LEN + 4 * self.inner.range.len()
    }

    /// Queues a push frame (already checked to be a `Push` for this shard) for the writer and
    /// waits for its outcome. Waits only for queue space and the apply itself.
    pub async fn push(&self, frame: Bytes) -> Outcome {
        let (reply, rx) = oneshot::channel();
        if self.inner.tx.send(Apply { frame, reply }).await.is_err() {
            return Outcome::Rejected {
                code: ErrorCode::ShuttingDown,
                message: "shard writer has stopped".into(),
            };
        }
        rx.await.unwrap_or(Outcome::Rejected {
            code: ErrorCode::ShuttingDown,
            message: "shard writer has stopped".into(),
        })
    }
}

fn writer(
    inner: std::sync::Weak<Inner>,
    mut rx: mpsc::Receiver<Apply>,
    cfg: OptimizerConfig,
    policy: StalenessPolicy,
    range: KeyRange,
) {
    let mut state = OptState::new(&cfg.rule, range.len());
    let mut scratch = vec![0.0f32; range.len()];
    let mut spare: Option<Arc<Snapshot>> = None;
    // `blocking_recv` returns None once every Shard handle (and so every sender) is dropped,
    // after the queue is drained: queued updates are always finished.
    while let Some(Apply { frame, reply }) = rx.blocking_recv() {
        let Some(inner) = inner.upgrade() else { break };
        let outcome = apply_one(
            &inner,
            &frame,
            &cfg,
            policy,
            &mut state,
            &mut scratch,
            &mut spare,
        );
        let _ = reply.send(outcome);
    }
}

fn apply_one(
    inner: &Inner,
    frame: &[u8],
    cfg: &OptimizerConfig,
    policy: StalenessPolicy,
    state: &mut OptState,
    scratch: &mut [f32],
    spare: &mut Option<Arc<Snapshot>>,
) -> Outcome {
    let reject = |code: ErrorCode, message: String| Outcome::Rejected { code, message };
    let (base_version, samples, grad) = match wire::decode(frame, usize::MAX) {
        Ok(Message::Push {
            base_version,
            samples,
            grad,
            ..
        }) => (base_version, samples, grad),
        Ok(_) => return reject(ErrorCode::Protocol, "not a push".into()),
        Err(e) => return reject(ErrorCode::from(&e), e.to_string()),
    };
    // Validate everything before touching state: whole or nothing.
    if let Err(e) = grad.copy_into(scratch) {
        return reject(ErrorCode::from(&e), e.to_string());
    }
    let current = inner.current.load_full();
    if base_version > current.version {
        return reject(
            ErrorCode::FutureVersion,
            format!(
                "push computed from version {base_version}, but shard {} is at {}",
                inner.id, current.version
            ),
        );
    }
    let staleness = current.version - base_version;
    if let StalenessPolicy::DropBeyond(max) = policy {
        if staleness > max {
            return reject(
                ErrorCode::TooStale,
                format!("staleness {staleness} exceeds the maximum {max}"),
            );
        }
    }
    // Reuse the previous snapshot's buffer when no reader holds it any more; `make_mut` copies
    // it into a fresh allocation only when one still does.
    let mut next = spare.take().unwrap_or_else(|| current.clone());
    let n = Arc::make_mut(&mut next);
    n.values.copy_from_slice(&current.values);
    optim::step(cfg, state, &mut n.values, scratch, 1.0);
    n.version = current.version + 1;
    let version = n.version;
    inner.current.store(next);
    *spare = Some(current);
    Outcome::Applied {
        version,
        staleness,
        samples,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crowdgrad_core::optim::Rule;

    fn cfg() -> OptimizerConfig {
        OptimizerConfig {
            rule: Rule::Sgd,
            lr: 0.5,
            weight_decay: 0.0,
            clip_norm: None,
        }
    }

    #[tokio::test]
    async fn push_applies_whole_or_not_at_all() {
        let range = KeyRange { start: 0, end: 3 };
        let (shard, writer) = Shard::start(
            0,
            range,
            vec![1.0; 3],
            cfg(),
            StalenessPolicy::DropBeyond(1),
        );
        let ok = shard
            .push(wire::encode_push(1, 0, 0, 4, &[1.0, 2.0, 3.0]).into())
            .await;
        assert_eq!(
            ok,
            Outcome::Applied {
                version: 1,
                staleness: 0,
                samples: 4
            }
        );
        assert_eq!(shard.snapshot().values, vec![0.5, 0.0, -0.5]);
        let before = shard.snapshot();
        for bad in [
            wire::encode_push(2, 0, 1, 4, &[1.0, f32::NAN, 3.0]),
            wire::encode_push(3, 0, 1, 4, &[1.0, 2.0]),
            wire::encode_push(4, 0, 9, 4, &[1.0, 2.0, 3.0]),
        ] {
            assert!(matches!(
                shard.push(bad.into()).await,
                Outcome::Rejected { .. }
            ));
        }
        // Staleness 2 > 1 after two more applies.
        shard
            .push(wire::encode_push(5, 0, 1, 4, &[0.0; 3]).into())
            .await;
        shard
            .push(wire::encode_push(6, 0, 2, 4, &[0.0; 3]).into())
            .await;
        let stale = shard
            .push(wire::encode_push(7, 0, 1, 4, &[1.0; 3]).into())
            .await;
        assert!(matches!(
            stale,
            Outcome::Rejected {
                code: ErrorCode::TooStale,
                ..
            }
        ));
        assert_eq!(shard.version(), 3);
        assert_eq!(
            before.values,
            vec![0.5, 0.0, -0.5],
            "a held snapshot never changes"
        );
        assert_eq!(shard.snapshot().values, vec![0.5, 0.0, -0.5]);
        drop(shard);
        writer.join();
    }
}
