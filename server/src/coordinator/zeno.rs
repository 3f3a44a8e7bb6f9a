//! `--aggregation zeno` on the server (issue 10): Zeno++'s validation gradient, kept fresh for
//! every in-process shard.
//!
//! The server holds the training data, so it can do what a shard alone cannot: compute the
//! gradient of a small validation batch ([`ZenoReference`], [`ZENO_BATCH`] examples strided
//! through the training set, normalised as the workers normalise theirs) at the current
//! parameters, and give each shard its slice ([`Shard::set_reference`]). The shards' sessions
//! then refuse (`disagrees`) a push that would raise that batch's loss by more than the margin
//! (the rule is `crowdgrad_core::robust`'s, the same the simulator runs).
//!
//! A thread of its own (CPU work off the reactor) computes the first reference before the
//! server serves, then a new one whenever shard 0 has moved [`ZENO_REFRESH`] versions (Zeno++'s
//! lazy update), polling every [`POLL`]. It stops within one poll of the shutdown signal. The
//! parameters are read from the shards' lock-free snapshots, so pulls and pushes never wait for
//! it; a reference computed from a snapshot a few versions old is what Zeno++ allows.

use crate::error::Result;
use crate::shard::Shard;
use crowdgrad_core::data::Dataset;
use crowdgrad_core::model::Model;
use crowdgrad_core::robust::{ZenoReference, ZENO_BATCH, ZENO_REFRESH};
use crowdgrad_core::spec::RunSpec;
use std::time::Duration;
use tokio::sync::watch;

/// How often the thread looks at shard 0's version.
pub const POLL: Duration = Duration::from_millis(5);

/// The running reference thread ([`start`]).
#[derive(Debug)]
pub struct Zeno {
    thread: std::thread::JoinHandle<()>,
}

impl Zeno {
    /// Waits for the thread, which ends within [`POLL`] and one gradient of the shutdown.
    pub fn join(self) {
        let _ = self.thread.join();
    }
}

/// Computes the first reference for `shards` (so the first push is already checked), then
/// keeps it fresh on a thread until `stop` says true.
///
/// # Errors
/// When the validation batch cannot be built or the model does not fit the shards.
pub fn start(
    spec: &RunSpec,
    train: &Dataset,
    shards: Vec<Shard>,
    stop: watch::Receiver<bool>,
) -> Result<Zeno> {
    // Only the validation batch is kept: the copy the normalisation needs is dropped here.
    let mut t = train.subset(0..train.len())?;
    t.set_normalize(&spec.normalize)?;
    let mut reference = ZenoReference::new(Model::new(spec.model.clone())?, &t)?;
    drop(t);
    let first = refresh(&mut reference, &shards)?;
    tracing::info!(
        batch = ZENO_BATCH,
        every = ZENO_REFRESH,
        "zeno: validation gradient ready"
    );
    let thread = std::thread::Builder::new()
        .name("zeno".into())
        .spawn(move || {
            let mut last = first;
            while !*stop.borrow() {
                std::thread::sleep(POLL);
                let version = shards[0].version();
                if version < last + ZENO_REFRESH {
                    continue;
                }
                match refresh(&mut reference, &shards) {
                    Ok(v) => last = v,
                    Err(e) => {
                        tracing::warn!(error = %e, "zeno: the validation gradient was not refreshed");
                        last = version;
                    }
                }
            }
        })
        .map_err(|e| crate::error::Error::io("zeno thread", e))?;
    Ok(Zeno { thread })
}

/// One reference from the shards' current snapshots; returns shard 0's version it is of.
fn refresh(reference: &mut ZenoReference, shards: &[Shard]) -> Result<u64> {
    let snaps: Vec<_> = shards.iter().map(Shard::snapshot).collect();
    let params: Vec<f32> = snaps
        .iter()
        .flat_map(|s| s.values.iter().copied())
        .collect();
    let g = reference.gradient(&params)?;
    let mut at = 0;
    for (shard, snap) in shards.iter().zip(&snaps) {
        let n = snap.values.len();
        shard.set_reference(&g[at..at + n]);
        at += n;
    }
    Ok(snaps[0].version)
}
