//! Randomness and faults of the simulated world: independent seeded streams, the delay and
//! speed distributions, and what a faulty worker does to its pushes.

use super::*;

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

/// What faulty workers remember between pushes, and the data of the ones that train on
/// shuffled labels. Every fault kind is documented on [`Fault`] (README, docs/experiments.md).
pub(super) struct Faults {
    /// `replay`: the first push each participant sent to each shard (`[participant][shard]`).
    first: Vec<Vec<Option<Vec<f32>>>>,
    /// `collude`: per shard, the base version and the vector every colluder sends from it.
    shared: Vec<Option<(u64, Vec<f32>)>>,
    /// `shuffled_labels`: each faulty participant's partition with its labels permuted.
    shuffled: Vec<Option<Dataset>>,
}

impl Faults {
    /// The fault state for participants whose `faulty[i]` is set; participant i trains on
    /// `parts[i % parts.len()]`.
    pub(super) fn new(cfg: &SimConfig, parts: &[Dataset], faulty: &[bool]) -> Result<Self> {
        let shuffled = faulty
            .iter()
            .enumerate()
            .map(|(i, &f)| {
                if !(f && cfg.fault == Fault::ShuffledLabels) {
                    return Ok(None);
                }
                let part = &parts[i % parts.len()];
                let (images, labels) = part.to_idx(0..part.len())?;
                let mut labels = labels;
                // An IDX label file: 8 header bytes, then one byte per example.
                let mut body = labels.split_off(8);
                stream(cfg.seed, 8, i as u64).shuffle(&mut body);
                labels.extend(body);
                Ok(Some(Dataset::from_idx(&images, &labels)?))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            first: vec![vec![None; cfg.shards]; faulty.len()],
            shared: vec![None; cfg.shards],
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
        let Ok(Message::Push {
            request_id,
            shard,
            base_version,
            samples,
            grad,
        }) = wire::decode(&frame, usize::MAX)
        else {
            return (frame, false);
        };
        let mut g: Vec<f32> = grad.iter().collect();
        if g.is_empty() {
            return (frame, false);
        }
        let s = shard as usize;
        let mut to_shard = shard;
        match fault {
            Fault::Nan => {
                let i = rng.below(g.len() as u64) as usize;
                g[i] = f32::NAN;
            }
            Fault::Inf => {
                let i = rng.below(g.len() as u64) as usize;
                g[i] = if rng.next_f64() < 0.5 {
                    f32::INFINITY
                } else {
                    f32::NEG_INFINITY
                };
            }
            Fault::Noise => {
                let norm = g.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
                let z: Vec<f64> = g.iter().map(|_| rng.normal()).collect();
                let zn = z.iter().map(|v| v * v).sum::<f64>().sqrt().max(1e-30);
                for (o, v) in g.iter_mut().zip(z) {
                    *o = (v * norm / zn) as f32;
                }
            }
            Fault::Scale(f) => g.iter_mut().for_each(|v| *v *= f),
            Fault::SignFlip(f) => g.iter_mut().for_each(|v| *v *= -f),
            Fault::Replay => match self.first.get_mut(p).and_then(|v| v.get_mut(s)) {
                Some(Some(old)) if old.len() == g.len() => g.copy_from_slice(old),
                Some(slot) => {
                    // The first push goes out as it is; every later one repeats it.
                    *slot = Some(g);
                    return (frame, true);
                }
                None => return (frame, false),
            },
            Fault::WrongShard => to_shard = shard.wrapping_add(1),
            Fault::ShuffledLabels => return (frame, true),
            Fault::Collude(f) => match self.shared.get_mut(s) {
                Some(Some((v, bad))) if *v >= base_version && bad.len() == g.len() => {
                    g.copy_from_slice(bad)
                }
                Some(slot) => {
                    g.iter_mut().for_each(|v| *v *= -f);
                    *slot = Some((base_version, g.clone()));
                }
                None => return (frame, false),
            },
        }
        (
            wire::encode_push(request_id, to_shard, base_version, samples, &g),
            true,
        )
    }
}
