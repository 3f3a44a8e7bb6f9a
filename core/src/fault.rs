//! Faulty workers for experiments and tests: what a faulty worker does to its pushes
//! ([`Fault`], carried out by [`Faults::corrupt`] on the push frames a
//! [`crate::worker::Worker`] emits) or to its data ([`shuffle_labels`]).
//!
//! One implementation for every driver: the simulator (`crowdgrad sim --fault`) and the native
//! worker (`crowdgrad work --fault`) both call it. No I/O and no clock; randomness comes in as
//! an [`Rng`], so the simulator stays deterministic for a seed.
//!
//! Colluders send the same vector. How they agree on it is [`Collusion`]: inside one process
//! (the simulator) they share a [`Faults`] and send what the first of them computed; separate
//! processes (`crowdgrad work --fault collude:S`) cannot talk, so each derives the vector from
//! a seed they share ([`collusion_vector`]).

use crate::data::Dataset;
use crate::error::{Error, Result};
use crate::rng::Rng;
use crate::wire::{self, Message};

/// What a faulty worker does (`--fault`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fault {
    /// Puts one NaN in the push: the shard must reject it (and closes the connection, as the
    /// server does for a non-finite payload).
    Nan,
    /// Puts one infinity (either sign) in the push: refused like a NaN.
    Inf,
    /// Replaces the gradient by Gaussian noise of the same L2 norm.
    Noise,
    /// Multiplies the gradient by a factor.
    Scale(f32),
    /// Sign flip with a scale: the gradient times -S (an ascent step, S times as long).
    SignFlip(f32),
    /// Stale replay: every push after the worker's first one to a shard carries that first
    /// push's values again (with a fresh request id and base version, so only its content is
    /// stale).
    Replay,
    /// Addresses every push to the next shard (`wrong_shard`, fatal: the connection closes).
    WrongShard,
    /// Trains on its partition with the labels shuffled: honest-looking gradients of the wrong
    /// task (norm and values in range; the kind only spot checks catch). A data transform
    /// ([`shuffle_labels`]), not a frame rewrite.
    ShuffledLabels,
    /// Colluding workers: every faulty worker sends the same vector to a shard, scaled by S
    /// (how they agree on it: [`Collusion`]).
    Collude(f32),
    /// All-zero pushes: harmless to the parameters, they try to drag a norm reference
    /// built from every push down to 0, so that honest pushes look like outliers (issue 21's
    /// sybils). The shard's guard applies them and notes them nowhere.
    Zeros,
    /// Gaussian noise of S times the gradient's L2 norm: no signal, and far over any honest
    /// norm for a large S; it tries to lift a norm reference built from every push (issue 21's
    /// sybils). `huge:1` is `noise`.
    Huge(f32),
}

impl Fault {
    /// Parses `nan`, `inf`, `noise`, `scale:F`, `signflip:S`, `replay`, `wrong_shard`,
    /// `shuffled_labels`, `collude:S`, `zeros` or `huge:S` (`signflip` and `collude` alone:
    /// S = 1).
    ///
    /// # Errors
    /// [`Error::Config`] on anything else or a factor that is not finite (S must be > 0).
    pub fn parse(text: &str) -> Result<Self> {
        let t = text.trim();
        let bad = || {
            Error::Config(format!(
                "unknown --fault {t:?}: use nan, inf, noise, scale:F, signflip:S, replay, wrong_shard, shuffled_labels, collude:S, zeros or huge:S (S > 0)"
            ))
        };
        let factor = |s: Option<&str>, positive: bool| match s.map(str::parse::<f32>) {
            None => Ok(1.0),
            Some(Ok(f)) if f.is_finite() && (!positive || f > 0.0) => Ok(f),
            _ => Err(bad()),
        };
        let (name, arg) = match t.split_once(':') {
            Some((n, a)) => (n, Some(a)),
            None => (t, None),
        };
        match (name, arg) {
            ("nan", None) => Ok(Fault::Nan),
            ("inf", None) => Ok(Fault::Inf),
            ("noise", None) => Ok(Fault::Noise),
            ("replay", None) => Ok(Fault::Replay),
            ("wrong_shard", None) => Ok(Fault::WrongShard),
            ("shuffled_labels", None) => Ok(Fault::ShuffledLabels),
            ("scale", Some(_)) => Ok(Fault::Scale(factor(arg, false)?)),
            ("signflip", _) => Ok(Fault::SignFlip(factor(arg, true)?)),
            ("collude", _) => Ok(Fault::Collude(factor(arg, true)?)),
            ("zeros", None) => Ok(Fault::Zeros),
            ("huge", Some(_)) => Ok(Fault::Huge(factor(arg, true)?)),
            _ => Err(bad()),
        }
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::Nan => write!(f, "nan"),
            Fault::Inf => write!(f, "inf"),
            Fault::Noise => write!(f, "noise"),
            Fault::Scale(x) => write!(f, "scale:{x}"),
            Fault::SignFlip(x) => write!(f, "signflip:{x}"),
            Fault::Replay => write!(f, "replay"),
            Fault::WrongShard => write!(f, "wrong_shard"),
            Fault::ShuffledLabels => write!(f, "shuffled_labels"),
            Fault::Collude(x) => write!(f, "collude:{x}"),
            Fault::Zeros => write!(f, "zeros"),
            Fault::Huge(x) => write!(f, "huge:{x}"),
        }
    }
}

/// How colluders ([`Fault::Collude`]) agree on the one vector they send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collusion {
    /// All colluders share one [`Faults`] (the simulator): a shard gets -S times the gradient
    /// of the first colluder to push from that shard version, kept until one pushes from a
    /// newer version. In sync:K all of a round's colluders send one vector.
    Shared,
    /// Colluders in separate processes, each with its own [`Faults`]: every push to shard `s`
    /// carries [`collusion_vector`]`(seed, s, len, S)`, the same vector in every process
    /// that uses the seed (the native worker uses the run's seed, so all of a run's colluders
    /// agree without talking).
    Seeded(u64),
}

/// The vector separate colluders send to shard `shard` ([`Collusion::Seeded`]): a fixed
/// direction drawn from `(seed, shard)` (independent standard normals from core's SplitMix64
/// [`Rng`], seeded with `r = Rng::new(seed ^ 0xC011_0DE0_5EED_F00D ^ shard *
/// 0xE703_7ED1_A0B4_28DB)` and then `Rng::new(r.next_u64())`), scaled to an L2 norm of
/// `norm`. Fixed over the run, so its effect on the parameters adds up instead of averaging
/// out; identical in every process, so robust rules see `len` coordinates agreeing.
pub fn collusion_vector(seed: u64, shard: u32, len: usize, norm: f32) -> Vec<f32> {
    let mut r = Rng::new(
        seed ^ 0xC011_0DE0_5EED_F00D ^ u64::from(shard).wrapping_mul(0xE703_7ED1_A0B4_28DB),
    );
    let mut rng = Rng::new(r.next_u64());
    let z: Vec<f64> = (0..len).map(|_| rng.normal()).collect();
    let zn = z.iter().map(|v| v * v).sum::<f64>().sqrt().max(1e-30);
    z.iter()
        .map(|v| (v * f64::from(norm) / zn) as f32)
        .collect()
}

/// Replaces `g` by Gaussian noise of `factor` times its L2 norm ([`Fault::Noise`],
/// [`Fault::Huge`]).
fn noise_of_norm(g: &mut [f32], factor: f64, rng: &mut Rng) {
    let norm = g.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt() * factor;
    let z: Vec<f64> = g.iter().map(|_| rng.normal()).collect();
    let zn = z.iter().map(|v| v * v).sum::<f64>().sqrt().max(1e-30);
    for (o, v) in g.iter_mut().zip(z) {
        *o = (v * norm / zn) as f32;
    }
}

/// A copy of `data` with its labels permuted by `rng` (Fisher-Yates): the images stay in
/// place, so every batch a worker samples has the right pictures and wrong answers.
///
/// # Errors
/// As [`Dataset::to_idx`] / [`Dataset::from_idx`] (not for a dataset that parsed).
pub fn shuffle_labels(data: &Dataset, rng: &mut Rng) -> Result<Dataset> {
    let (images, mut labels) = data.to_idx(0..data.len())?;
    // An IDX label file: 8 header bytes, then one byte per example.
    let mut body = labels.split_off(8);
    rng.shuffle(&mut body);
    labels.extend(body);
    Dataset::from_idx(&images, &labels)
}

/// What faulty workers remember between pushes: the first push of each (participant, shard)
/// for [`Fault::Replay`] and the colluders' vector per shard for [`Fault::Collude`]. Every
/// table is sized at construction (participants x shards), so memory is bounded by the
/// parameter count times the participants.
#[derive(Debug, Clone)]
pub struct Faults {
    collusion: Collusion,
    /// `replay`: the first push each participant sent to each shard (`[participant][shard]`).
    first: Vec<Vec<Option<Vec<f32>>>>,
    /// `collude`: per shard, the base version and the vector every colluder sends from it
    /// (with [`Collusion::Seeded`], the version is unused and the vector is the cached
    /// [`collusion_vector`]).
    shared: Vec<Option<(u64, Vec<f32>)>>,
    /// Pushes each participant sends unchanged before its fault begins ([`Faults::honest_first`]).
    honest: u64,
    /// Pushes each participant sent so far (counted up to `honest`).
    pushed: Vec<u64>,
}

impl Faults {
    /// The state of `participants` faulty workers (indices `0..participants`) of a run with
    /// `shards` shards. Pushes to shards outside `0..shards` or from participants outside the
    /// range pass unchanged.
    pub fn new(collusion: Collusion, participants: usize, shards: usize) -> Self {
        Self {
            collusion,
            first: vec![vec![None; shards]; participants],
            shared: vec![None; shards],
            honest: 0,
            pushed: vec![0; participants],
        }
    }

    /// Every participant's first `pushes` pushes (over all shards) pass unchanged: a patient
    /// attacker that earns trust with honest pushes before its fault begins (`work
    /// --fault-after`, issue 21's probation).
    pub fn honest_first(mut self, pushes: u64) -> Self {
        self.honest = pushes;
        self
    }

    /// Rewrites a push frame of participant `p` as a worker with `fault` would send it; other
    /// frames (and any frame under [`Fault::ShuffledLabels`], whose fault is in its data) pass
    /// unchanged. The rewritten push is f32-encoded and keeps the original's spot-check tag
    /// ([`wire::push_tag`]), if any. Returns the frame and whether it is a faulty push.
    pub fn corrupt(
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
        if let Some(n) = self.pushed.get_mut(p) {
            if *n < self.honest {
                *n += 1;
                return (frame, false);
            }
        }
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
            Fault::Noise => noise_of_norm(&mut g, 1.0, rng),
            Fault::Huge(f) => noise_of_norm(&mut g, f64::from(f), rng),
            Fault::Zeros => g.fill(0.0),
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
            Fault::Collude(f) => match (self.collusion, self.shared.get_mut(s)) {
                (_, None) => return (frame, false),
                (Collusion::Shared, Some(Some((v, bad))))
                    if *v >= base_version && bad.len() == g.len() =>
                {
                    g.copy_from_slice(bad)
                }
                (Collusion::Shared, Some(slot)) => {
                    g.iter_mut().for_each(|v| *v *= -f);
                    *slot = Some((base_version, g.clone()));
                }
                (Collusion::Seeded(seed), Some(slot)) => match slot {
                    Some((_, bad)) if bad.len() == g.len() => g.copy_from_slice(bad),
                    _ => {
                        g = collusion_vector(seed, shard, g.len(), f);
                        *slot = Some((0, g.clone()));
                    }
                },
            },
        }
        let tag = wire::push_tag(&frame).ok().flatten();
        let out = match tag {
            Some(tag) => wire::encode_push_tagged(
                crate::codec::Encoding::F32,
                request_id,
                to_shard,
                base_version,
                samples,
                &g,
                None,
                &tag,
            )
            .unwrap_or_else(|_| wire::encode_push(request_id, to_shard, base_version, samples, &g)),
            None => wire::encode_push(request_id, to_shard, base_version, samples, &g),
        };
        (out, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn push(shard: u32, version: u64, g: &[f32]) -> Vec<u8> {
        wire::encode_push(7, shard, version, 32, g)
    }

    fn grad(frame: &[u8]) -> (u32, Vec<f32>) {
        match wire::decode(frame, usize::MAX).expect("decodes") {
            Message::Push { shard, grad, .. } => (shard, grad.iter().collect()),
            other => panic!("not a push: {other:?}"),
        }
    }

    #[test]
    fn parse_and_display_round_trip_and_bad_kinds_are_refused() {
        for t in [
            "nan",
            "inf",
            "noise",
            "scale:0.5",
            "signflip:10",
            "replay",
            "wrong_shard",
            "shuffled_labels",
            "collude:3",
            "zeros",
            "huge:100",
        ] {
            let f = Fault::parse(t).expect(t);
            assert_eq!(Fault::parse(&f.to_string()).unwrap(), f);
        }
        assert_eq!(Fault::parse("signflip").unwrap(), Fault::SignFlip(1.0));
        for t in [
            "",
            "nan:1",
            "signflip:-1",
            "signflip:0",
            "collude:inf",
            "zeros:1",
            "huge",
            "huge:0",
            "huge:nan",
            "scale",
            "bogus",
        ] {
            assert!(matches!(Fault::parse(t), Err(Error::Config(_))), "{t:?}");
        }
    }

    /// `--fault-after N`: a participant's first N pushes pass unchanged, the rest are faulty.
    #[test]
    fn a_patient_participant_sends_its_first_pushes_unchanged() {
        let g = [1.0f32, -2.0];
        let mut rng = Rng::new(1);
        let mut f = Faults::new(Collusion::Shared, 1, 2).honest_first(3);
        for i in 0..3 {
            let (out, bad) = f.corrupt(0, push(i % 2, 3, &g), Fault::SignFlip(1.0), &mut rng);
            assert!(!bad);
            assert_eq!(grad(&out).1, g.to_vec());
        }
        let (out, bad) = f.corrupt(0, push(1, 3, &g), Fault::SignFlip(1.0), &mut rng);
        assert!(bad);
        assert_eq!(grad(&out).1, vec![-1.0, 2.0]);
    }

    #[test]
    fn each_kind_rewrites_a_push_as_documented() {
        let g = [1.0f32, -2.0, 0.5, 4.0];
        let mut rng = Rng::new(1);
        let mut f = Faults::new(Collusion::Shared, 1, 2);
        let (out, bad) = f.corrupt(0, push(0, 3, &g), Fault::SignFlip(10.0), &mut rng);
        assert!(bad);
        assert_eq!(grad(&out), (0, vec![-10.0, 20.0, -5.0, -40.0]));
        let (out, _) = f.corrupt(0, push(1, 3, &g), Fault::Nan, &mut rng);
        assert_eq!(grad(&out).1.iter().filter(|v| v.is_nan()).count(), 1);
        let (out, _) = f.corrupt(0, push(1, 3, &g), Fault::Inf, &mut rng);
        assert_eq!(grad(&out).1.iter().filter(|v| v.is_infinite()).count(), 1);
        let (out, _) = f.corrupt(0, push(1, 3, &g), Fault::Noise, &mut rng);
        let n = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
        let noisy = grad(&out).1;
        assert!((n(&noisy) - n(&g)).abs() < 1e-4 && noisy != g);
        let (out, bad) = f.corrupt(0, push(1, 3, &g), Fault::Zeros, &mut rng);
        assert!(bad);
        assert_eq!(grad(&out), (1, vec![0.0; 4]));
        let (out, _) = f.corrupt(0, push(1, 3, &g), Fault::Huge(100.0), &mut rng);
        let huge = grad(&out).1;
        assert!((n(&huge) / n(&g) - 100.0).abs() < 1e-3, "{huge:?}");
        let (out, _) = f.corrupt(0, push(1, 3, &g), Fault::WrongShard, &mut rng);
        assert_eq!(grad(&out), (2, g.to_vec()));
        // Replay: the first push as it is, then its values again.
        let (out, _) = f.corrupt(0, push(1, 3, &g), Fault::Replay, &mut rng);
        assert_eq!(grad(&out).1, g);
        let (out, _) = f.corrupt(0, push(1, 4, &[9.0; 4]), Fault::Replay, &mut rng);
        assert_eq!(grad(&out).1, g);
        // Shuffled labels and non-push frames pass unchanged.
        let p = push(0, 3, &g);
        assert_eq!(
            f.corrupt(0, p.clone(), Fault::ShuffledLabels, &mut rng),
            (p, true)
        );
        let e = wire::encode_error(1, 0, wire::ErrorCode::Malformed, "x");
        assert_eq!(f.corrupt(0, e.clone(), Fault::Nan, &mut rng), (e, false));
    }

    #[test]
    fn seeded_colluders_in_separate_processes_send_the_same_vector() {
        let mut a = Faults::new(Collusion::Seeded(42), 1, 2);
        let mut b = Faults::new(Collusion::Seeded(42), 1, 2);
        let (mut ra, mut rb) = (Rng::new(1), Rng::new(2));
        let fa = grad(
            &a.corrupt(0, push(1, 5, &[1.0; 64]), Fault::Collude(3.0), &mut ra)
                .0,
        )
        .1;
        let fb = grad(
            &b.corrupt(0, push(1, 9, &[-7.0; 64]), Fault::Collude(3.0), &mut rb)
                .0,
        )
        .1;
        assert_eq!(fa, fb);
        let norm = fa.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 3.0).abs() < 1e-4, "{norm}");
        assert_eq!(fa, collusion_vector(42, 1, 64, 3.0));
        assert_ne!(fa, collusion_vector(42, 0, 64, 3.0));
        assert_ne!(fa, collusion_vector(43, 1, 64, 3.0));
        // In one process: the first colluder's gradient times -S, sent by the next one too.
        let mut s = Faults::new(Collusion::Shared, 2, 1);
        let x = grad(
            &s.corrupt(0, push(0, 5, &[1.0, 2.0]), Fault::Collude(2.0), &mut ra)
                .0,
        )
        .1;
        let y = grad(
            &s.corrupt(1, push(0, 5, &[5.0, 5.0]), Fault::Collude(2.0), &mut ra)
                .0,
        )
        .1;
        assert_eq!((x.clone(), y), (vec![-2.0, -4.0], x));
    }

    #[test]
    fn a_spot_check_tag_survives_the_rewrite() {
        let tag = wire::PushTag {
            versions: vec![3, 4],
            ..Default::default()
        };
        let g = [1.0f32, 2.0];
        let frame =
            wire::encode_push_tagged(crate::codec::Encoding::Bf16, 7, 0, 3, 32, &g, None, &tag)
                .unwrap();
        let mut f = Faults::new(Collusion::Shared, 1, 1);
        let (out, _) = f.corrupt(0, frame, Fault::SignFlip(1.0), &mut Rng::new(1));
        assert_eq!(wire::push_tag(&out).unwrap(), Some(tag));
        assert_eq!(grad(&out).1, vec![-1.0, -2.0]);
    }

    #[test]
    fn shuffled_labels_keep_the_images_and_permute_the_labels() {
        let images = crate::data::encode_idx(&[6, 2, 2], &[7u8; 24]);
        let labels = crate::data::encode_idx(&[6], &[0, 1, 2, 3, 4, 5]);
        let d = Dataset::from_idx(&images, &labels).unwrap();
        let s = shuffle_labels(&d, &mut Rng::new(3)).unwrap();
        assert_eq!(s.len(), 6);
        let mut l = s.labels().to_vec();
        assert_ne!(l, d.labels());
        l.sort_unstable();
        assert_eq!(l, d.labels());
        assert_eq!(s.pixels(0), d.pixels(0));
    }
}
