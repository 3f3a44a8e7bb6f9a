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

/// Rewrites a push frame as a faulty worker would send it; other frames pass unchanged.
pub(super) fn corrupt(frame: Vec<u8>, fault: Fault, rng: &mut Rng) -> (Vec<u8>, bool) {
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
    match fault {
        Fault::Nan => {
            let i = rng.below(g.len() as u64) as usize;
            g[i] = f32::NAN;
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
    }
    (
        wire::encode_push(request_id, shard, base_version, samples, &g),
        true,
    )
}
