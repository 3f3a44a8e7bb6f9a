//! The norm anchor (issue 21): the server's own per-step gradient norm for every shard's slice
//! at the current parameters, fed to the shards as the anchor of their norm reference
//! ([`crowdgrad_core::session`]'s guard: the reference stays within
//! [`ANCHOR_SPAN`](crowdgrad_core::session::ANCHOR_SPAN) of it, both ways).
//!
//! Why: a shard alone knows only what workers push, and a crowd of strangers can push
//! anything. The server holds the training data, so it measures what an honest push looks
//! like itself: [`BATCHES`] minibatches of the run's batch size (the workers' batch: a
//! minibatch gradient's norm grows with its noise, so a larger batch would read low), drawn
//! from the first [`EXAMPLES`] training examples, normalised and clipped as the workers do,
//! at the shards' current snapshots; the anchor of a shard is the median over the batches of
//! the norm of its slice. It is refreshed every [`EVERY`], so it follows the model: after
//! poison broke the run, the honest (larger) gradients of the repair are within the bound.
//!
//! Local-steps pseudo-gradients (`--local-steps H` with H > 1, or adaptive) are not anchored:
//! a pseudo-gradient's per-step norm is an inner optimizer's step (a learning rate times an
//! update rule's output), not a gradient's norm, and recomputing a whole round here would be a
//! spot check of every shard every few seconds. Those shards rely on their trusted workers
//! alone (docs/defences.md).
//!
//! A thread of its own (CPU work off the reactor), like [`crate::coordinator::zeno`]; it reads
//! the lock-free snapshots, computes the first anchor before the server serves, and stops
//! within [`EVERY`] of the shutdown signal.

use crate::error::{Error, Result};
use crate::shard::Shard;
use crowdgrad_core::data::{BatchSampler, Dataset};
use crowdgrad_core::model::Model;
use crowdgrad_core::optim::clip_by_global_norm;
use crowdgrad_core::spec::RunSpec;
use ndarray::Array2;
use std::time::Duration;
use tokio::sync::watch;

/// How often the anchor is recomputed.
pub const EVERY: Duration = Duration::from_secs(2);
/// Minibatches per anchor (the median of their norms).
pub const BATCHES: usize = 8;
/// Training examples the batches are drawn from (a copy of them is kept).
pub const EXAMPLES: usize = 8192;

/// The running anchor thread ([`start`]).
#[derive(Debug)]
pub struct Anchor {
    thread: std::thread::JoinHandle<()>,
}

impl Anchor {
    /// Waits for the thread (it ends within [`EVERY`] of the shutdown).
    pub fn join(self) {
        let _ = self.thread.join();
    }
}

struct Meter {
    model: Model,
    data: Dataset,
    sampler: BatchSampler,
    clip: Option<f32>,
    x: Array2<f32>,
    y: Vec<u8>,
    idx: Vec<u32>,
    grad: Vec<f32>,
    ws: crowdgrad_core::model::Workspace,
}

impl Meter {
    /// Every shard's anchor from the current snapshots.
    fn measure(&mut self, shards: &[Shard]) -> Result<()> {
        let snaps: Vec<_> = shards.iter().map(Shard::snapshot).collect();
        let params: Vec<f32> = snaps
            .iter()
            .flat_map(|s| s.values.iter().copied())
            .collect();
        let mut norms = vec![Vec::with_capacity(BATCHES); shards.len()];
        for _ in 0..BATCHES {
            self.sampler.next_batch(&mut self.idx);
            self.data
                .fill_batch(&self.idx, &mut self.x.view_mut(), &mut self.y);
            self.model.loss_and_grad(
                &params,
                self.x.view(),
                &self.y,
                &mut self.grad,
                &mut self.ws,
            )?;
            if let Some(c) = self.clip {
                clip_by_global_norm(&mut self.grad, c);
            }
            let mut at = 0;
            for (n, snap) in norms.iter_mut().zip(&snaps) {
                let len = snap.values.len();
                let sq: f64 = self.grad[at..at + len]
                    .iter()
                    .map(|&g| f64::from(g) * f64::from(g))
                    .sum();
                n.push(sq.sqrt() as f32);
                at += len;
            }
        }
        for (shard, mut n) in shards.iter().zip(norms) {
            n.sort_by(f32::total_cmp);
            let anchor = n[n.len() / 2];
            shard.set_norm_anchor(anchor);
            // The figures refusals never disclose, for the operator's log.
            let (reference, trusted, probation) = shard.norm_reference();
            tracing::debug!(
                shard = shard.id(),
                anchor,
                ?reference,
                trusted,
                probation,
                "norm reference"
            );
        }
        Ok(())
    }
}

/// Computes the first anchor of `shards` (so the first push is judged against it), then keeps
/// it fresh on a thread until `stop` says true. `None` for pseudo-gradient runs (module docs)
/// or an empty training set.
///
/// # Errors
/// When the model cannot be built or does not fit the shards.
pub fn start(
    spec: &RunSpec,
    train: &Dataset,
    shards: Vec<Shard>,
    stop: watch::Receiver<bool>,
) -> Result<Option<Anchor>> {
    if spec.local.steps.pseudo_gradients() || train.is_empty() || shards.is_empty() {
        return Ok(None);
    }
    let mut data = train.subset(0..train.len().min(EXAMPLES))?;
    data.set_normalize(&spec.normalize)?;
    let model = Model::new(spec.model.clone())?;
    let batch = spec.batch_size.max(1);
    let mut meter = Meter {
        ws: model.workspace(batch),
        grad: vec![0.0; model.param_len()],
        x: Array2::zeros((batch, data.features)),
        y: vec![0; batch],
        idx: vec![0; batch],
        sampler: BatchSampler::new(data.len(), spec.seed ^ 0xA2C4_0000_0000_0021),
        clip: spec.optimizer.clip_norm,
        model,
        data,
    };
    meter.measure(&shards)?;
    tracing::info!(
        batches = BATCHES,
        every_s = EVERY.as_secs(),
        "norm anchor ready"
    );
    let thread = std::thread::Builder::new()
        .name("norm-anchor".into())
        .spawn(move || {
            let tick = Duration::from_millis(50);
            let mut waited = Duration::ZERO;
            while !*stop.borrow() {
                std::thread::sleep(tick);
                waited += tick;
                if waited < EVERY {
                    continue;
                }
                waited = Duration::ZERO;
                if let Err(e) = meter.measure(&shards) {
                    tracing::warn!(error = %e, "the norm anchor was not refreshed");
                }
            }
        })
        .map_err(|e| Error::io("norm anchor thread", e))?;
    Ok(Some(Anchor { thread }))
}
