//! Randomness and faults of the simulated world: independent seeded streams, the delay and
//! speed distributions, and what a faulty worker does to its pushes.

use crate::error::Result;
use crate::sim::config::{Fault, SimConfig};
use crowdgrad_core::data::Dataset;
use crowdgrad_core::fault::{shuffle_labels, Collusion, Faults as CoreFaults};
use crowdgrad_core::rng::Rng;

/// An independent random stream for `(tag, index)`, so that e.g. adding faulty workers does
/// not change the speeds drawn.
pub(super) fn stream(seed: u64, tag: u64, index: u64) -> Rng {
    let mut r = Rng::new(
        seed ^ tag.wrapping_mul(0xA076_1D64_78BD_642F) ^ index.wrapping_mul(0xE703_7ED1_A0B4_28DB),
    );
    Rng::new(r.next_u64())
}

pub(super) fn exponential(rng: &mut Rng, mean: f64) -> f64 {
    -mean * (1.0 - rng.next_f64()).ln()
}

pub(super) fn mean_one_lognormal(rng: &mut Rng, sigma: f64) -> f64 {
    if sigma == 0.0 {
        1.0
    } else {
        (sigma * rng.normal() - sigma * sigma / 2.0).exp()
    }
}

/// The simulator's faulty participants: core's [`CoreFaults`] (the one push-rewriting
/// implementation, shared with `crowdgrad work --fault`; colluders share it in-process,
/// [`Collusion::Shared`]) and the data of the ones that train on shuffled labels. Every fault
/// kind is documented on [`Fault`] (README, docs/experiments.md).
pub(super) struct Faults {
    core: CoreFaults,
    /// `shuffled_labels`: each faulty participant's partition with its labels permuted.
    shuffled: Vec<Option<Dataset>>,
}

impl Faults {
    /// The fault state for participants whose `faults[i]` is set (faulty workers and
    /// sybils); participant i trains on `parts[i % parts.len()]`.
    pub(super) fn new(
        cfg: &SimConfig,
        parts: &[Dataset],
        faults: &[Option<Fault>],
    ) -> Result<Self> {
        let shuffled = faults
            .iter()
            .enumerate()
            .map(|(i, &f)| {
                if f != Some(Fault::ShuffledLabels) {
                    return Ok(None);
                }
                let part = &parts[i % parts.len()];
                Ok(Some(shuffle_labels(
                    part,
                    &mut stream(cfg.seed, 8, i as u64),
                )?))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            core: CoreFaults::new(Collusion::Shared, faults.len(), cfg.shards),
            shuffled,
        })
    }

    /// The data participant `p` trains on when it is not its partition as given.
    pub(super) fn data(&self, p: usize) -> Option<&Dataset> {
        self.shuffled.get(p).and_then(Option::as_ref)
    }

    /// Rewrites a push frame of participant `p` as a faulty worker would send it; other frames
    /// pass unchanged. Returns the frame and whether it is a faulty push.
    pub(super) fn corrupt(
        &mut self,
        p: usize,
        frame: Vec<u8>,
        fault: Fault,
        rng: &mut Rng,
    ) -> (Vec<u8>, bool) {
        self.core.corrupt(p, frame, fault, rng)
    }
}
