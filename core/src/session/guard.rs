//! The push guard: the bounds every push must keep beyond a finite payload of the right length
//! ([`PushGuard`]), and the checks [`ShardState`] runs on a push's gradient against them (its
//! magnitude, its sample count, and its per-step norm against a reference no stranger can
//! move), and the per-worker replay log ([`PushLog`]).
//!
//! # The norm reference (issue 21)
//! A push's per-step norm may be at most [`PushGuard::norm_factor`] times the *reference*
//! (after [`NORM_WARMUP`] accepted pushes, or from the first push on a shard with an anchor). The
//! reference was once the median over the last 64 workers of each one's median norm, refused
//! and zero pushes included; a raw-protocol attacker moved it at will: 40 fresh joins pushing
//! zeros drove it to 0 (every honest push refused), 40 pushing huge norms lifted it until a
//! ×1000 gradient passed, and after sub-bound poison had broken the model the honest (now
//! larger) gradients were refused against the stale reference for ever. The rules now:
//! - **Trust is earned.** A worker has no say in the reference until it has had
//!   [`TRUST_PUSHES`] nonzero pushes accepted on this shard over at least [`TRUST_SECONDS`]
//!   (or the driver vouches for it, [`ShardState::vouch`]: e.g. it passed a spot check).
//!   Workers on probation are kept apart ([`PROBATION`] of them at most, the least recently
//!   heard making room), so a crowd of fresh identities neither counts nor evicts the trusted
//!   ones ([`NORM_WINDOW`] trusted workers are kept).
//! - **Only accepted, nonzero norms enter it.** A zero push is applied (it is harmless) but
//!   noted nowhere; a refused or quarantined push is never noted as an accepted norm.
//! - **It follows the model.** A trusted worker's estimate is the median of its last
//!   [`NORM_HISTORY`] accepted norms, except when its last [`LOCKOUT`] pushes were all refused
//!   by the bound: then it is the median of its refused norms. One trusted worker can only move
//!   its own estimate; when the model changed so much that most trusted workers are refused
//!   (a repair after poison), the median follows them and their repair goes through. Trusted
//!   workers not heard from for [`NORM_MAX_AGE`] seconds no longer count.
//! - **An anchor the crowd cannot move.** A driver that holds training data feeds the shard
//!   the per-step gradient norm of its own batches at the current parameters
//!   ([`ShardState::set_norm_anchor`]; the server recomputes it every few seconds, see
//!   `server/src/coordinator/anchor.rs`). The reference is then clamped to
//!   `[anchor / ANCHOR_SPAN, anchor × ANCHOR_SPAN]` ([`ANCHOR_SPAN`]): whatever the crowd does,
//!   the bound stays within a fixed factor of the server's own gradient, and follows the model
//!   when it changes. Local-steps pseudo-gradients are not gradients (their per-step norm is a
//!   learning rate times an optimizer's step), so drivers give no anchor for them and their
//!   shards rely on the trusted workers alone.
//! - **Bootstrap.** Before any worker is trusted (the first [`TRUST_SECONDS`] of a shard),
//!   the reference is the median over the workers on probation. Without an anchor, a worker
//!   whose every push so far was refused counts with its refused norms there (so a flooder
//!   that came first cannot lock later honest workers out): this window, on a shard without
//!   an anchor (a `crowdgrad shard` process), is the one place refused pushes move the bound.
//!   With an anchor they never do (its floor lets honest workers in).
//! - **A trusted worker's rare outlier is scaled, not refused.** Honest mini-batch gradients
//!   are heavy-tailed: about 1 push in 1,000 of an honest worker came out over 10 × the
//!   reference (issue 19: an honest volunteer was shown "out_of_bounds" errors, and with
//!   `--quarantine-out-of-bounds` a fast tab could have been quarantined). A push over the
//!   bound from a trusted worker whose last [`PushGuard::clip_spacing`] ([`CLIP_SPACING`] by
//!   default) accepted pushes were all within it is scaled down to the bound and applied ([`ShardState::clipped_pushes`] counts them);
//!   any other push over the bound is refused. This gives an attacker nothing it did not
//!   have: a push scaled to the bound is one it could have sent (sub-bound poison), and it
//!   earns one per [`CLIP_SPACING`] accepted pushes, after earning trust. Its norm is not noted
//!   (the reference does not move), and spot checks see the push as it was sent.
//! - **Refusals disclose nothing.** An `out_of_bounds` message says the push was an outlier,
//!   never the reference or the bound ([`ShardState::norm_reference`] gives the driver the
//!   figure for its own status and logs).
//!
//! # Replays (issue 21)
//! [`PushLog`] keeps, per worker across all its connections to this shard, the request id of
//! its last push and the digests of its last [`REPLAY_DIGESTS`] accepted gradients. A push
//! whose request id does not follow the last one (wrapping, [`crate::wire::id_after`]), or
//! whose decoded gradient equals one accepted recently (a nonzero one: zero pushes are
//! harmless and honest workers may repeat them), is refused `replayed`. A worker's request ids
//! rise across reconnects (one [`crate::worker::Worker`] numbers every frame it sends), so
//! honest workers never meet it. At most [`MAX_PUSHERS`] workers are logged (the least recently
//! heard is forgotten).

use super::ShardState;

/// What a push must keep to be applied, beyond a finite payload of the right length: the
/// defences against one hostile or broken push wrecking a run. A push that breaks one is
/// answered [`ErrorCode::OutOfBounds`](crate::wire::ErrorCode::OutOfBounds) (not fatal) and changes nothing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PushGuard {
    /// Largest |value| in a push. With it no optimizer state can overflow: Adagrad's
    /// accumulator grows by at most `max_abs²` (1e8) per push, far from f32's 3.4e38.
    pub max_abs: f32,
    /// A push's L2 norm per step (norm / (samples / batch), so local rounds of any H compare)
    /// may be at most this many times the shard's norm reference (module docs: trusted
    /// workers' accepted norms, clamped around the driver's anchor); 0 turns it off. Checked
    /// once [`NORM_WARMUP`] nonzero pushes were accepted.
    pub norm_factor: f32,
    /// Largest sample count a push may claim: batch × the most local steps.
    pub max_samples: u32,
    /// The run's batch size (for the per-step norm).
    pub batch: u32,
    /// A trusted worker's push over the bound is scaled down to it, not refused, when its last
    /// this many accepted pushes kept the bound (module docs); 0 refuses every push over it.
    pub clip_spacing: u32,
}

impl Default for PushGuard {
    fn default() -> Self {
        Self {
            max_abs: 1e4,
            norm_factor: 10.0,
            max_samples: u32::MAX,
            batch: 1,
            clip_spacing: CLIP_SPACING,
        }
    }
}

/// `max |v|` and `Σ v²` (in f64) of finite `values`, in [`GUARD_LANES`] independent lanes
/// (summed in a fixed order at the end, so the result is the same on every platform). A single
/// running sum is one long chain of dependent f64 additions that does not vectorise: it was 43%
/// of the server's CPU per step (perf, 2 native workers, 101,770 parameters); the lanes run
/// ~8x faster.
fn max_abs_and_square_sum(values: &[f32]) -> (f32, f64) {
    let mut max = [0.0f32; GUARD_LANES];
    let mut sq = [0.0f64; GUARD_LANES];
    let chunks = values.chunks_exact(GUARD_LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..GUARD_LANES {
            let a = c[i].abs();
            // A select, not `f32::max` (whose NaN rule does not vectorise); values are finite.
            max[i] = if a > max[i] { a } else { max[i] };
            sq[i] += f64::from(c[i]) * f64::from(c[i]);
        }
    }
    for (i, &v) in rest.iter().enumerate() {
        let a = v.abs();
        max[i] = if a > max[i] { a } else { max[i] };
        sq[i] += f64::from(v) * f64::from(v);
    }
    (
        max.iter().fold(0.0f32, |m, &a| if a > m { a } else { m }),
        sq.iter().sum(),
    )
}

/// The upper median of `v` (reordered); `v` is not empty.
fn median_of(v: &mut [f32]) -> f32 {
    let k = v.len() / 2;
    *v.select_nth_unstable_by(k, f32::total_cmp).1
}

/// Lanes of [`max_abs_and_square_sum`].
const GUARD_LANES: usize = 8;

/// Trusted workers whose estimates the norm reference's median is taken over (the most
/// recent to push).
pub const NORM_WINDOW: usize = 64;
/// Each worker's recent accepted norms its own median is taken over.
pub const NORM_HISTORY: usize = 64;
/// Refused norms kept per worker (its estimate when it is locked out, module docs).
pub const REFUSED_HISTORY: usize = 16;
/// Nonzero pushes accepted before the norm bound applies.
pub const NORM_WARMUP: usize = 16;
/// Nonzero pushes a worker must have accepted on a shard before it has a say in the
/// reference ...
pub const TRUST_PUSHES: u32 = 16;
/// ... over at least this many seconds since its first accepted push.
pub const TRUST_SECONDS: f64 = 10.0;
/// Workers on probation tracked per shard (the least recently heard makes room).
pub const PROBATION: usize = 256;
/// Refusals by the bound in a row after which a trusted worker's estimate is its refused
/// norms (the model moved away from the reference: module docs, "It follows the model").
pub const LOCKOUT: u32 = 4;
/// A trusted worker silent this long (seconds) no longer counts in the reference.
pub const NORM_MAX_AGE: f64 = 60.0;
/// The reference stays within this factor of the driver's anchor, both ways.
pub const ANCHOR_SPAN: f32 = 4.0;
/// An anchor older than this (seconds on the shard's clock) is not used.
pub const ANCHOR_MAX_AGE: f64 = 120.0;
/// Gradient digests kept per worker for the replay check.
pub const REPLAY_DIGESTS: usize = 64;
/// Workers whose pushes the replay log keeps.
pub const MAX_PUSHERS: usize = 4096;
/// The default [`PushGuard::clip_spacing`]: accepted pushes a trusted worker needs within the
/// bound since its last push scaled down to it before another one is scaled rather than
/// refused (module docs).
pub const CLIP_SPACING: u32 = 1;

/// One worker's recent per-step norms on one shard, and what it has earned.
#[derive(Debug, Clone)]
pub(super) struct WorkerNorms {
    pub(super) worker: u64,
    /// When it was last heard from (seconds on the driver's clock).
    pub(super) last_at: f64,
    /// When its first push was accepted (for [`TRUST_SECONDS`]).
    pub(super) since: Option<f64>,
    /// Nonzero pushes accepted.
    pub(super) accepted: u32,
    /// Its last [`NORM_HISTORY`] accepted norms, a ring, and their median.
    pub(super) ring: Vec<f32>,
    pub(super) next: usize,
    pub(super) median: Option<f32>,
    /// Its last [`REFUSED_HISTORY`] norms refused by the bound, a ring, and their median.
    pub(super) refused: Vec<f32>,
    pub(super) refused_next: usize,
    pub(super) refused_median: Option<f32>,
    /// Pushes refused by the bound since its last accepted one.
    pub(super) streak: u32,
    /// The driver vouched for it ([`ShardState::vouch`]).
    pub(super) vouched: bool,
    /// Accepted pushes since its last one scaled down to the bound ([`CLIP_SPACING`]).
    pub(super) since_clip: u32,
}

impl WorkerNorms {
    fn new(worker: u64, now: f64) -> Self {
        Self {
            worker,
            last_at: now,
            since: None,
            accepted: 0,
            ring: Vec::new(),
            next: 0,
            median: None,
            refused: Vec::new(),
            refused_next: 0,
            refused_median: None,
            streak: 0,
            vouched: false,
            since_clip: u32::MAX,
        }
    }

    /// Whether it has earned a say in the reference at `now`.
    fn earned(&self, now: f64) -> bool {
        self.accepted > 0
            && (self.vouched
                || (self.accepted >= TRUST_PUSHES
                    && self.since.is_some_and(|s| now - s >= TRUST_SECONDS)))
    }

    /// Its estimate of the usual norm: its accepted median, or its refused one when locked out
    /// (`lockout` refusals in a row, or nothing accepted yet).
    /// `lockout` `None`: its accepted median only.
    fn estimate(&self, lockout: Option<u32>) -> Option<f32> {
        match lockout {
            Some(l) if self.streak >= l || self.median.is_none() => {
                self.refused_median.or(self.median)
            }
            _ => self.median,
        }
    }
}

/// Pushes `v` into the ring `ring` (capacity `cap`, next slot `next`) and returns its median.
fn ring_push(
    ring: &mut Vec<f32>,
    next: &mut usize,
    cap: usize,
    v: f32,
    scratch: &mut Vec<f32>,
) -> f32 {
    if ring.len() < cap {
        ring.push(v);
    } else {
        ring[*next] = v;
    }
    *next = (*next + 1) % cap;
    scratch.clear();
    scratch.extend_from_slice(ring);
    median_of(scratch)
}

/// One worker's replay record on one shard ([`ShardState`]'s replay log).
#[derive(Debug, Clone, Default)]
pub(super) struct PushLog {
    /// Request id of its last push (on any connection).
    pub(super) last_request: Option<u32>,
    /// Digests of its last [`REPLAY_DIGESTS`] accepted nonzero gradients, a ring.
    pub(super) digests: Vec<u64>,
    pub(super) next: usize,
    /// When it was last heard (for the bound).
    pub(super) touched: u64,
}

/// A 64-bit digest of `values`' bits (eight independent multiply-xorshift lanes over pairs of
/// values, combined in a fixed order): equal gradients have equal digests; an accidental
/// collision between two honest gradients (probability about 2⁻⁶⁴ per pair) refuses one
/// push, nothing worse. Every push is digested (a shard slice of the default MLP is 50,885
/// values): four lanes of one value each were a chain of dependent multiplies, 8% of the
/// server's CPU at H = 1 in `bench e2e`; eight lanes of two values each are a quarter of the
/// chain. Digests live in memory only (the replay log), so changing the mix changes nothing
/// kept.
pub(super) fn digest(values: &[f32]) -> u64 {
    const K: [u64; 8] = [
        0x9E37_79B9_7F4A_7C15,
        0xC2B2_AE3D_27D4_EB4F,
        0x1656_67B1_9E37_79F9,
        0x27D4_EB2F_1656_67C5,
        0xD6E8_FEB8_6659_FD93,
        0xA076_1D64_78BD_642F,
        0xE703_7ED1_A0B4_28DB,
        0x8EBC_6AF0_9C88_C6E3,
    ];
    let mut h = K;
    let chunks = values.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            let w = u64::from(c[2 * i].to_bits()) | (u64::from(c[2 * i + 1].to_bits()) << 32);
            h[i] = (h[i] ^ w).wrapping_mul(K[i]).rotate_left(29);
        }
    }
    for (i, v) in rest.iter().enumerate() {
        let l = i % 8;
        // The position within the remainder is mixed in, so [a, b] and [b, a] differ there too.
        let w = u64::from(v.to_bits()) | ((i as u64 + 1) << 32);
        h[l] = (h[l] ^ w).wrapping_mul(K[l]).rotate_left(29);
    }
    let mut z = (values.len() as u64).wrapping_mul(K[0]);
    for x in h {
        z = (z ^ x).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z ^= z >> 31;
    }
    z
}

/// A 64-bit digest of a push's payload bytes, as [`digest`] mixes values: what the driver's
/// secret spot-check sampling is keyed on before the push is decoded and applied
/// ([`crate::session::ShardAccess::sample`]).
pub(super) fn bytes_digest(bytes: &[u8]) -> u64 {
    const K: [u64; 4] = [
        0x9E37_79B9_7F4A_7C15,
        0xC2B2_AE3D_27D4_EB4F,
        0x1656_67B1_9E37_79F9,
        0x27D4_EB2F_1656_67C5,
    ];
    let mut h = K;
    let chunks = bytes.chunks_exact(32);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..4 {
            let mut w = [0u8; 8];
            w.copy_from_slice(&c[i * 8..i * 8 + 8]);
            h[i] = (h[i] ^ u64::from_le_bytes(w))
                .wrapping_mul(K[i])
                .rotate_left(29);
        }
    }
    for (i, &b) in rest.iter().enumerate() {
        let l = i % 4;
        h[l] = (h[l] ^ u64::from(b)).wrapping_mul(K[l]).rotate_left(29);
    }
    let mut z = (bytes.len() as u64).wrapping_mul(K[0]);
    for x in h {
        z = (z ^ x).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z ^= z >> 31;
    }
    z
}

impl ShardState {
    /// The driver vouches for `worker` on this shard at `now` (it passed the spot checker's
    /// probation, or it is an established identity): from its next accepted push (or at once,
    /// if it has one accepted) it has a say in the reference, without the [`TRUST_PUSHES`] /
    /// [`TRUST_SECONDS`] wait. A worker not heard on this shard yet is noted on probation,
    /// vouched for, so its first accepted push promotes it.
    pub fn vouch(&mut self, worker: u64, now: f64) {
        self.norm_entry(worker, now).vouched = true;
        self.promote(worker, now);
    }

    /// The driver's own per-step gradient norm for this shard's slice at the current
    /// parameters (module docs, "An anchor"), measured at `now` on the shard's clock. A value
    /// that is not finite and positive clears it.
    pub fn set_norm_anchor(&mut self, norm: f32, now: f64) {
        self.anchor = (norm.is_finite() && norm > 0.0).then_some((norm, now));
    }

    /// Whether a fresh anchor is set: then the bound holds from the first push, with no
    /// warm-up a crowd could use.
    pub(super) fn anchored(&self, now: f64) -> bool {
        self.anchor
            .is_some_and(|(_, at)| now - at <= ANCHOR_MAX_AGE)
    }

    /// The norm reference now, for the driver's status and logs (refusals never say it).
    pub fn norm_reference(&mut self, now: f64) -> Option<f32> {
        self.reference_norm(now)
    }

    /// Workers with a say in the reference now, and workers on probation.
    pub fn trust_counts(&self, now: f64) -> (usize, usize) {
        let trusted = self
            .norms
            .iter()
            .filter(|e| now - e.last_at <= NORM_MAX_AGE)
            .count();
        (trusted, self.probation.len())
    }

    /// The entry of `worker` (trusted or on probation), made on probation if new.
    fn norm_entry(&mut self, worker: u64, now: f64) -> &mut WorkerNorms {
        if let Some(i) = self.norms.iter().position(|e| e.worker == worker) {
            return &mut self.norms[i];
        }
        let i = match self.probation.iter().position(|e| e.worker == worker) {
            Some(i) => i,
            None => {
                if self.probation.len() >= PROBATION {
                    if let Some(i) = (0..self.probation.len()).min_by(|&a, &b| {
                        self.probation[a]
                            .last_at
                            .total_cmp(&self.probation[b].last_at)
                    }) {
                        self.probation.swap_remove(i);
                    }
                }
                self.probation.push(WorkerNorms::new(worker, now));
                self.probation.len() - 1
            }
        };
        &mut self.probation[i]
    }

    /// Moves `worker` from probation to the trusted window once it has earned it.
    fn promote(&mut self, worker: u64, now: f64) {
        let Some(i) = self.probation.iter().position(|e| e.worker == worker) else {
            return;
        };
        if !self.probation[i].earned(now) {
            return;
        }
        let e = self.probation.swap_remove(i);
        if self.norms.len() >= NORM_WINDOW {
            // The trusted worker heard from least recently makes room.
            if let Some(j) = (0..self.norms.len())
                .min_by(|&a, &b| self.norms[a].last_at.total_cmp(&self.norms[b].last_at))
            {
                self.norms.swap_remove(j);
            }
        }
        self.norms.push(e);
    }

    /// `worker`'s push of per-step norm `norm` was accepted at `now` (zero norms are not noted).
    pub(super) fn note_accepted(&mut self, worker: u64, norm: f32, now: f64) {
        if norm <= 0.0 {
            return;
        }
        let mut scratch = std::mem::take(&mut self.norm_scratch);
        let e = self.norm_entry(worker, now);
        e.last_at = now;
        e.since.get_or_insert(now);
        e.accepted = e.accepted.saturating_add(1);
        if e.streak >= LOCKOUT {
            // It was locked out and got through on its refused norms: the model moved, and
            // its accepted history is of the old one. It starts again from the refused norms.
            e.ring.clone_from(&e.refused);
            e.next = e.ring.len() % NORM_HISTORY;
        }
        e.streak = 0;
        e.since_clip = e.since_clip.saturating_add(1);
        e.median = Some(ring_push(
            &mut e.ring,
            &mut e.next,
            NORM_HISTORY,
            norm,
            &mut scratch,
        ));
        self.norm_scratch = scratch;
        self.promote(worker, now);
    }

    /// Whether `worker`'s push over the bound is scaled down to it rather than refused (module
    /// docs): it is trusted, and its last [`CLIP_SPACING`] accepted pushes kept the bound.
    /// Says yes at most once per [`CLIP_SPACING`] accepted pushes.
    pub(super) fn clip_allowed(&mut self, worker: u64, now: f64) -> bool {
        let spacing = self.cfg.setup.guard.clip_spacing;
        if spacing == 0 {
            return false;
        }
        let Some(e) = self.norms.iter_mut().find(|e| e.worker == worker) else {
            return false;
        };
        if !e.earned(now) || e.since_clip < spacing {
            return false;
        }
        e.since_clip = 0;
        e.last_at = now;
        self.clipped += 1;
        true
    }

    /// Pushes over the bound that were scaled down to it and applied (module docs).
    pub fn clipped_pushes(&self) -> u64 {
        self.clipped
    }

    /// `worker`'s push of per-step norm `norm` was refused by the norm bound at `now`.
    pub(super) fn note_refused(&mut self, worker: u64, norm: f32, now: f64) {
        let mut scratch = std::mem::take(&mut self.norm_scratch);
        let e = self.norm_entry(worker, now);
        e.last_at = now;
        e.streak = e.streak.saturating_add(1);
        e.refused_median = Some(ring_push(
            &mut e.refused,
            &mut e.refused_next,
            REFUSED_HISTORY,
            norm,
            &mut scratch,
        ));
        self.norm_scratch = scratch;
    }

    /// The norm reference (module docs): the median of the trusted workers' estimates (in the
    /// bootstrap, of the workers on probation), clamped around the anchor; `None` when nothing
    /// is known.
    pub(super) fn reference_norm(&mut self, now: f64) -> Option<f32> {
        // In the scratch `note_*` also use: no allocation per push.
        let anchor = self.anchor.filter(|&(_, at)| now - at <= ANCHOR_MAX_AGE);
        self.norm_scratch.clear();
        self.norm_scratch.extend(
            self.norms
                .iter()
                .filter(|e| now - e.last_at <= NORM_MAX_AGE)
                .filter_map(|e| e.estimate(Some(LOCKOUT))),
        );
        if self.norm_scratch.is_empty() {
            // Bootstrap: nobody has earned trust yet. Without an anchor, a worker refused
            // every time counts with its refused norms (lockout 1: a flooder that came first
            // cannot lock the others out); with one, refused norms never count (the anchor's
            // floor lets honest workers in).
            let lockout = anchor.is_none().then_some(1);
            self.norm_scratch
                .extend(self.probation.iter().filter_map(|e| e.estimate(lockout)));
        }
        let crowd = (!self.norm_scratch.is_empty()).then(|| median_of(&mut self.norm_scratch));
        match anchor {
            Some((a, _)) => Some(crowd.unwrap_or(a).clamp(a / ANCHOR_SPAN, a * ANCHOR_SPAN)),
            None => crowd,
        }
    }

    /// Whether a push of per-step `norm` passes the bound against `reference`. The message
    /// says it was an outlier and nothing more (module docs, "Refusals disclose nothing").
    pub(super) fn norm_check(
        &self,
        norm: f32,
        reference: Option<f32>,
        now: f64,
    ) -> Result<(), String> {
        let g = self.cfg.setup.guard;
        if let (true, true, Some(median)) = (
            g.norm_factor > 0.0,
            self.accepted >= NORM_WARMUP as u64 || self.anchored(now),
            reference,
        ) {
            if norm > g.norm_factor * median {
                return Err(
                    "the push's norm is an outlier against the recent pushes of this shard".into(),
                );
            }
        }
        Ok(())
    }

    /// The replay check of a push from `worker` with `request_id` (module docs, "Replays"):
    /// refuses a request id that does not follow its last push's, on any connection; records
    /// it otherwise.
    pub(super) fn check_request(&mut self, worker: u64, request_id: u32) -> Result<(), String> {
        self.log_tick += 1;
        let tick = self.log_tick;
        if !self.pushers.contains_key(&worker) && self.pushers.len() >= MAX_PUSHERS {
            if let Some(victim) = self
                .pushers
                .iter()
                .min_by_key(|(_, l)| l.touched)
                .map(|(w, _)| *w)
            {
                self.pushers.remove(&victim);
            }
        }
        let log = self.pushers.entry(worker).or_default();
        log.touched = tick;
        if let Some(last) = log.last_request {
            if !crate::wire::id_after(request_id, last) {
                return Err(format!(
                    "push request id {request_id} does not follow this worker's last push {last}"
                ));
            }
        }
        log.last_request = Some(request_id);
        Ok(())
    }

    /// Whether `worker` pushed a gradient of digest `d` recently.
    pub(super) fn seen_digest(&self, worker: u64, d: u64) -> bool {
        self.pushers
            .get(&worker)
            .is_some_and(|l| l.digests.contains(&d))
    }

    /// Records an accepted gradient's digest.
    pub(super) fn note_digest(&mut self, worker: u64, d: u64) {
        let log: &mut PushLog = self.pushers.entry(worker).or_default();
        if log.digests.len() < REPLAY_DIGESTS {
            log.digests.push(d);
        } else {
            log.digests[log.next] = d;
        }
        log.next = (log.next + 1) % REPLAY_DIGESTS;
    }

    /// Checks the validated gradient in scratch against the sample count and magnitude
    /// bounds; returns its per-step norm.
    pub(super) fn guard(&self, samples: u32) -> Result<f32, String> {
        let g = self.cfg.setup.guard;
        if samples == 0 || samples > g.max_samples {
            return Err(format!(
                "a push claims {samples} samples; a round has 1 to {}",
                g.max_samples
            ));
        }
        let (max, sq) = max_abs_and_square_sum(&self.scratch);
        if max > g.max_abs {
            return Err(format!(
                "a value of magnitude {max:e} exceeds the bound {:e}",
                g.max_abs
            ));
        }
        let steps = (samples as f32 / g.batch.max(1) as f32).max(1.0);
        Ok((sq.sqrt() as f32) / steps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::testing::{hello, sent, state};
    use crate::session::ShardSession;
    use crate::shard::Consistency;
    use crate::wire::{self, ErrorCode, Message};

    /// `g` scaled by `1 + k·1e-6`: a slightly different gradient per push.
    fn nudge(g: &[f32], k: u32) -> Vec<f32> {
        g.iter().map(|x| x * (1.0 + k as f32 * 1e-6)).collect()
    }

    /// A shard of two values with the run's batch 32, and a push helper that remembers request
    /// ids per session: `push(sh, session, worker, gradient, now)` gives the reply.
    struct Bench {
        sh: ShardState,
        sessions: std::collections::HashMap<u64, (ShardSession, u32)>,
        k: u32,
    }

    impl Bench {
        fn new() -> Self {
            let mut sh = state(Consistency::Async, 2);
            sh.cfg.setup.guard = PushGuard {
                max_samples: 32,
                batch: 32,
                ..PushGuard::default()
            };
            Self {
                sh,
                sessions: Default::default(),
                k: 0,
            }
        }

        /// `worker` pushes `g` (nudged to be unique) at `now`; returns "ack" or the error code.
        fn push(&mut self, worker: u64, g: &[f32], now: f64) -> String {
            self.k += 1;
            let g = nudge(g, self.k);
            self.raw(worker, &g, now)
        }

        /// `worker` pushes exactly `g`, with the next request id of its session.
        fn raw(&mut self, worker: u64, g: &[f32], now: f64) -> String {
            let cfg = *self.sh.config();
            let sh = &mut self.sh;
            let (s, rid) = self.sessions.entry(worker).or_insert_with(|| {
                let mut s = ShardSession::new(cfg);
                s.handle_frame(sh, &hello(1, worker), now);
                sent(&mut s);
                (s, 1)
            });
            *rid += 1;
            let v = sh.version();
            s.handle_frame(sh, &wire::encode_push(*rid, 1, v, 32, g), now);
            last_reply(s)
        }
    }

    /// The last reply of `s`: "ack", or the error code's name (with its message).
    fn last_reply(s: &mut ShardSession) -> String {
        let mut out = String::new();
        while let Some(a) = s.poll_action() {
            if let crate::session::Action::Send(f) = a {
                out = match wire::decode(&f.to_vec(), usize::MAX).unwrap() {
                    Message::Ack { .. } => "ack".into(),
                    Message::Error { error, .. } => {
                        format!("{}: {}", error.code.name(), error.message)
                    }
                    m => format!("{m:?}"),
                };
            }
        }
        out
    }

    /// Three honest workers push norm ~1 gradients for 12 s: they have earned trust.
    fn trusted_bench() -> Bench {
        let mut b = Bench::new();
        for i in 0..24 {
            for w in 1..=3u64 {
                let t = f64::from(i) * 0.5;
                assert_eq!(b.push(w, &[0.6, -0.8], t), "ack", "warm-up");
            }
        }
        assert_eq!(b.sh.trust_counts(12.0).0, 3, "three trusted");
        b
    }

    /// Issue 21: 40 fresh sybils pushing zeros, then huge (refused) gradients, neither lower
    /// nor lift the reference: honest pushes are all accepted, and a ×1000 gradient is still
    /// refused. Before, zeros drove the median to 0 and refused pushes lifted it.
    #[test]
    fn issue_21_sybils_pushing_zeros_or_huge_norms_do_not_move_the_reference() {
        let mut b = trusted_bench();
        let before = b.sh.norm_reference(12.0).unwrap();
        let mut t = 12.0;
        for round in 0..20 {
            for sybil in 100..140u64 {
                let g = if round % 2 == 0 {
                    [0.0, 0.0]
                } else {
                    [600.0, -800.0]
                };
                let r = b.push(sybil, &g, t);
                if round % 2 == 1 {
                    assert!(r.starts_with("out_of_bounds"), "{r}");
                }
            }
            for w in 1..=3u64 {
                assert_eq!(b.push(w, &[0.6, -0.8], t), "ack", "honest, round {round}");
            }
            t += 0.1;
        }
        let after = b.sh.norm_reference(t).unwrap();
        assert!((after / before - 1.0).abs() < 0.01, "{before} -> {after}");
        let r = b.push(120, &[600.0, -800.0], t);
        assert!(r.starts_with("out_of_bounds"), "x1000: {r}");
        // The refusal names no figure: the reference is not disclosed.
        assert!(!r.chars().any(|c| c.is_ascii_digit()), "{r}");
        // Sybils that behave for TRUST_SECONDS earn a say; zeros and refusals never do.
        assert_eq!(b.sh.trust_counts(t).0, 3);
    }

    /// Issue 21: after the model changed (poison broke it; honest gradients are now 30x the
    /// reference), trusted workers refused LOCKOUT times in a row count with their refused
    /// norms, so the median follows them and the repair goes through. One trusted worker
    /// alone cannot do that.
    #[test]
    fn issue_21_the_reference_follows_the_model_when_most_trusted_workers_are_refused() {
        let mut b = trusted_bench();
        let mut t = 13.0;
        // One trusted worker pushing 30x: its first outlier is scaled down to the bound
        // (a rare outlier), then it is refused however often it tries.
        for i in 0..3 * LOCKOUT {
            let r = b.push(1, &[18.0, -24.0], t);
            if i == 0 {
                assert_eq!(r, "ack", "the first outlier is scaled");
            } else {
                assert!(r.starts_with("out_of_bounds"), "{r}");
            }
            assert_eq!(b.push(2, &[0.6, -0.8], t), "ack");
            assert_eq!(b.push(3, &[0.6, -0.8], t), "ack");
            t += 0.1;
        }
        // All three see the larger gradients: refused LOCKOUT times (workers 2 and 3 have
        // their first one scaled), then accepted.
        let mut accepted = 0;
        for round in 0..LOCKOUT + 3 {
            for w in 1..=3u64 {
                if b.push(w, &[18.0, -24.0], t) == "ack" {
                    accepted += 1;
                } else {
                    assert!(round <= LOCKOUT, "still refused in round {round}");
                }
            }
            t += 0.1;
        }
        assert!(accepted >= 3, "{accepted}");
    }

    /// Issue 19: a trusted worker's rare outlier is scaled down to the bound and applied, at
    /// most one per CLIP_SPACING accepted pushes; a worker on probation is refused; the
    /// reference does not move; a x1e6 push from the trusted worker right after is refused.
    #[test]
    fn a_trusted_workers_rare_outlier_is_scaled_to_the_bound_not_refused() {
        let mut b = trusted_bench();
        let t = 13.0;
        let before = b.sh.norm_reference(t).unwrap();
        let v0 = b.sh.values().to_vec();
        // 20 x the usual norm: scaled down to 10 x, applied.
        assert_eq!(b.push(1, &[12.0, -16.0], t), "ack");
        assert_eq!(b.sh.clipped_pushes(), 1);
        let v1 = b.sh.values().to_vec();
        let moved: f32 = v0
            .iter()
            .zip(&v1)
            .map(|(a, b)| (a - b) * (a - b))
            .sum::<f32>()
            .sqrt();
        assert!(moved > 0.0, "the scaled push was applied");
        // The second outlier before CLIP_SPACING accepted pushes is refused, and so is x1e6.
        assert!(b.push(1, &[12.0, -16.0], t).starts_with("out_of_bounds"));
        assert!(b.push(1, &[6e5, -8e5], t).starts_with("out_of_bounds"));
        // After CLIP_SPACING pushes within the bound, one more is scaled.
        for i in 0..CLIP_SPACING {
            assert_eq!(b.push(1, &[0.6, -0.8], t + f64::from(i) * 0.01), "ack");
        }
        assert_eq!(b.push(1, &[12.0, -16.0], t + 1.0), "ack");
        assert_eq!(b.sh.clipped_pushes(), 2);
        // A fresh worker (on probation) gets no such allowance.
        assert!(b
            .push(50, &[12.0, -16.0], t + 1.0)
            .starts_with("out_of_bounds"));
        let after = b.sh.norm_reference(t + 1.0).unwrap();
        assert!((after / before - 1.0).abs() < 0.01, "{before} -> {after}");
    }

    /// Issue 21: a local-steps shard divides its rate among the workers pushing now, not
    /// among those connected: 40 silent sybils leave an honest round whole; a worker counts
    /// for a while after its push (super::active), and not after its socket closed.
    #[test]
    fn issue_21_silent_sybils_do_not_dilute_local_rounds() {
        let mut b = Bench::new();
        b.sh.cfg.setup.pseudo_gradients = true;
        let cfg = *b.sh.config();
        let mut idle: Vec<ShardSession> = (0..40)
            .map(|i| {
                let mut s = ShardSession::new(cfg);
                s.handle_frame(&mut b.sh, &hello(1, 1000 + i), 0.0);
                sent(&mut s);
                s
            })
            .collect();
        assert_eq!(b.sh.connected(), 40);
        assert_eq!(b.raw(1, &[1.0, -1.0], 1.0), "ack");
        assert_eq!(b.sh.values().as_slice(), &[-1.0, 1.0], "applied whole");
        // A second worker pushing within the window: both count, each applied at half.
        assert_eq!(b.raw(2, &[2.0, -2.0], 2.0), "ack");
        assert_eq!(b.sh.values().as_slice(), &[-2.0, 2.0]);
        // Long after worker 1's push, worker 2 alone counts again.
        assert_eq!(b.raw(2, &[4.0, -4.0], 100.0), "ack");
        assert_eq!(b.sh.values().as_slice(), &[-6.0, 6.0]);
        idle.clear();
    }

    /// Issue 21: with the driver's anchor, the reference stays within ANCHOR_SPAN of it
    /// whatever the workers do, and moves with it (re-anchoring after the model changed).
    #[test]
    fn issue_21_the_anchor_bounds_the_reference_and_moves_it() {
        let mut b = Bench::new();
        b.sh.set_norm_anchor(1.0, 0.0);
        // With an anchor the bound holds from the first push: 30 is refused at once.
        assert!(b
            .push(199, &[18.0, -24.0], 0.0)
            .starts_with("out_of_bounds"));
        // Bootstrap: sybils alone, pushing norm 9 (under 10 x the anchor).
        for i in 0..NORM_WARMUP as u32 {
            assert_eq!(b.push(200 + u64::from(i), &[5.4, -7.2], 0.0), "ack");
        }
        assert_eq!(b.sh.norm_reference(0.0), Some(ANCHOR_SPAN));
        // 10 x 4 = 40: 38.6 passes, 50 does not.
        assert_eq!(b.push(300, &[23.0, -31.0], 0.0), "ack");
        assert!(b
            .push(300, &[30.0, -40.0], 0.0)
            .starts_with("out_of_bounds"));
        // The model changed: the server's own gradient is 1000 now, and the floor follows.
        b.sh.set_norm_anchor(1000.0, 1.0);
        assert_eq!(b.sh.norm_reference(1.0), Some(1000.0 / ANCHOR_SPAN));
        assert_eq!(b.push(301, &[1200.0, -1600.0], 1.0), "ack");
        // Zero or non-finite anchors clear it; a stale one is not used.
        b.sh.set_norm_anchor(f32::NAN, 2.0);
        assert_eq!(b.sh.anchor, None);
        b.sh.set_norm_anchor(1.0, 2.0);
        let crowd = b.sh.norm_reference(2.0 + ANCHOR_MAX_AGE + 1.0).unwrap();
        assert!(crowd > ANCHOR_SPAN, "{crowd}");
    }

    /// Issue 21: a push replayed on a new connection of the same worker, and the same
    /// gradient under a new request id, are refused `replayed`; a new gradient goes through,
    /// and so does a zero one twice (harmless, never logged).
    #[test]
    fn issue_21_replays_across_connections_and_request_ids_are_refused() {
        let mut sh = state(Consistency::Async, 2);
        let mut a = ShardSession::new(*sh.config());
        a.handle_frame(&mut sh, &hello(1, 7), 0.0);
        let frame = wire::encode_push(2, 1, 0, 8, &[0.25, -0.5]);
        a.handle_frame(&mut sh, &frame, 0.0);
        assert_eq!(last_reply(&mut a), "ack");
        a.handle_close(&mut sh);
        // The same frame on a new connection.
        let mut b = ShardSession::new(*sh.config());
        b.handle_frame(&mut sh, &hello(1, 7), 0.0);
        sent(&mut b);
        b.handle_frame(&mut sh, &frame, 0.0);
        assert!(
            last_reply(&mut b).starts_with("replayed"),
            "same frame, new connection"
        );
        // The same gradient with rising request ids, at the current version.
        for rid in [3, 50, 1 << 20] {
            let v = sh.version();
            b.handle_frame(
                &mut sh,
                &wire::encode_push(rid, 1, v, 8, &[0.25, -0.5]),
                0.0,
            );
            assert!(last_reply(&mut b).starts_with("replayed"), "request {rid}");
        }
        assert_eq!(sh.version(), 1, "applied once");
        let v = sh.version();
        b.handle_frame(
            &mut sh,
            &wire::encode_push((1 << 20) + 1, 1, v, 8, &[0.5, 0.5]),
            0.0,
        );
        assert_eq!(last_reply(&mut b), "ack");
        for rid in [(1 << 20) + 2, (1 << 20) + 3] {
            b.handle_frame(&mut sh, &wire::encode_push(rid, 1, v, 8, &[0.0, 0.0]), 0.0);
            assert_eq!(last_reply(&mut b), "ack", "zero pushes");
        }
        // Another worker's identical gradient is its own.
        let mut c = ShardSession::new(*sh.config());
        c.handle_frame(&mut sh, &hello(1, 8), 0.0);
        sent(&mut c);
        c.handle_frame(&mut sh, &wire::encode_push(2, 1, v, 8, &[0.25, -0.5]), 0.0);
        assert_eq!(last_reply(&mut c), "ack");
        let _ = ErrorCode::Replayed;
    }

    /// The laned guard sums equal a plain running max and f64 sum (to rounding), for every
    /// remainder length; the max is exact.
    #[test]
    fn guard_sums_in_lanes_match_a_plain_loop() {
        let mut rng = crate::rng::Rng::new(5);
        for n in [0usize, 1, 7, 8, 9, 1000, 50_885] {
            let v: Vec<f32> = (0..n).map(|_| (rng.normal() * 3.0) as f32).collect();
            let (max, sq) = max_abs_and_square_sum(&v);
            let want_max = v.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let want_sq: f64 = v.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
            assert_eq!(max, want_max, "n {n}");
            assert!(
                (sq - want_sq).abs() <= 1e-12 * want_sq.max(1.0),
                "n {n}: {sq} {want_sq}"
            );
        }
    }

    /// Issue 10: a push replayed on its connection, a value near f32's limit (which would
    /// overflow Adagrad's accumulator), a push scaled far above the recent norms, and an
    /// impossible sample count are refused without closing, and change nothing.
    #[test]
    fn replays_huge_values_outlier_norms_and_false_sample_counts_are_refused() {
        let mut sh = state(Consistency::Async, 2);
        sh.cfg.setup.guard = PushGuard {
            max_samples: 32,
            batch: 32,
            ..PushGuard::default()
        };
        let mut s = ShardSession::new(*sh.config());
        s.handle_frame(&mut sh, &hello(1, 7), 0.0);
        let mut rid = 1;
        // Each push a little different (the same gradient twice is a replay).
        let mut push = |s: &mut ShardSession, sh: &mut ShardState, g: &[f32], samples: u32| {
            rid += 1;
            let v = sh.version();
            let g = nudge(g, rid);
            s.handle_frame(sh, &wire::encode_push(rid, 1, v, samples, &g), 0.0);
            rid
        };
        for _ in 0..NORM_WARMUP {
            push(&mut s, &mut sh, &[0.01, -0.02], 32);
        }
        let before = sh.values().clone();
        let v = sh.version();
        let id = push(&mut s, &mut sh, &[1e30, 0.0], 32);
        push(&mut s, &mut sh, &[10.0, -20.0], 32);
        push(&mut s, &mut sh, &[0.01, -0.02], u32::MAX);
        let replay = wire::encode_push(id, 1, v, 32, &[0.01, -0.02]);
        s.handle_frame(&mut sh, &replay, 0.0);
        let out = sent(&mut s);
        assert_eq!(
            out[out.len() - 4..],
            [
                format!("error {id} out_of_bounds"),
                format!("error {} out_of_bounds", id + 1),
                format!("error {} out_of_bounds", id + 2),
                format!("error {id} replayed"),
            ]
        );
        assert_eq!(sh.values(), &before, "nothing applied");
        assert_eq!(sh.version(), v);
        assert!(!s.is_closed(), "not fatal");
        // An honest push still goes through.
        push(&mut s, &mut sh, &[0.02, -0.01], 32);
        assert_eq!(sh.version(), v + 1);
    }

    /// Issue 10 (found by `bench flood`): a worker flooding tiny pushes used to fill the norm
    /// window, so the median dropped and every honest push looked 10x too large. The median is
    /// over workers: the flooder counts once, even when it was there first (here, in the
    /// bootstrap, before anyone earned trust, where a worker refused every time counts with its
    /// refused norms).
    #[test]
    fn a_flood_of_tiny_pushes_does_not_get_honest_pushes_refused() {
        let mut sh = state(Consistency::Async, 2);
        sh.cfg.setup.guard = PushGuard {
            max_samples: 32,
            batch: 32,
            ..PushGuard::default()
        };
        let mut honest = ShardSession::new(*sh.config());
        let mut other = ShardSession::new(*sh.config());
        let mut flood = ShardSession::new(*sh.config());
        honest.handle_frame(&mut sh, &hello(1, 7), 0.0);
        other.handle_frame(&mut sh, &hello(1, 8), 0.0);
        flood.handle_frame(&mut sh, &hello(1, 9), 0.0);
        let mut rid = 1;
        let mut push = |s: &mut ShardSession, sh: &mut ShardState, g: &[f32]| {
            rid += 1;
            let v = sh.version();
            s.handle_frame(sh, &wire::encode_push(rid, 1, v, 32, &nudge(g, rid)), 0.0);
        };
        // The flooder comes first and alone: 200 tiny pushes are the whole history.
        for _ in 0..200 {
            push(&mut flood, &mut sh, &[1e-4, 1e-4]);
        }
        // An honest worker's first push is judged against the flooder alone and refused; it
        // counts in the reference all the same, so from its second push on it is accepted.
        let v = sh.version();
        push(&mut honest, &mut sh, &[0.5, -0.5]);
        assert_eq!(sh.version(), v, "judged against the flooder alone");
        push(&mut other, &mut sh, &[0.4, -0.6]);
        for _ in 0..100 {
            push(&mut flood, &mut sh, &[1e-4, 1e-4]);
        }
        sent(&mut honest);
        for _ in 0..5 {
            let v = sh.version();
            push(&mut honest, &mut sh, &[0.5, -0.4]);
            assert_eq!(sh.version(), v + 1, "{:?}", sent(&mut honest));
            push(&mut flood, &mut sh, &[1e-4, 1e-4]);
        }
        // The bound itself still holds against the honest workers' norms.
        let v = sh.version();
        push(&mut flood, &mut sh, &[50.0, 50.0]);
        assert_eq!(sh.version(), v, "a push 100x the honest norm is refused");
    }

    /// Issue 21: a worker the driver vouches for (it passed the spot checker's probation)
    /// has a say in the reference from its first accepted push, where one not vouched for
    /// waits for [`TRUST_PUSHES`] pushes over [`TRUST_SECONDS`]; a vouching before its first
    /// push on the shard counts too. A rollback forgets the poisoner's norms.
    #[test]
    fn a_vouched_worker_is_trusted_at_once_and_a_rollback_forgets_the_poisoner() {
        let mut b = Bench::new();
        // Worker 7 vouched for before it ever pushed here; worker 8 not.
        b.sh.vouch(7, 0.0);
        assert_eq!(b.push(7, &[0.5, -0.5], 0.1), "ack");
        assert_eq!(b.push(8, &[0.5, -0.4], 0.1), "ack");
        assert_eq!(b.sh.trust_counts(0.2), (1, 1), "7 trusted, 8 on probation");
        // Vouching for one with a push accepted promotes it at once.
        b.sh.vouch(8, 0.3);
        assert_eq!(b.sh.trust_counts(0.3), (2, 0));
        // Without a vouching, trust takes TRUST_PUSHES over TRUST_SECONDS.
        for i in 0..TRUST_PUSHES {
            assert_eq!(b.push(9, &[0.4, -0.5], 0.4 + f64::from(i) * 0.01), "ack");
        }
        assert_eq!(b.sh.trust_counts(1.0), (2, 1), "9 is still on probation");
        assert_eq!(b.push(9, &[0.4, -0.5], 0.5 + TRUST_SECONDS), "ack");
        assert_eq!(b.sh.trust_counts(0.5 + TRUST_SECONDS).0, 3);
        // A rollback publishes the values as the next version and forgets the poisoner.
        let v = b.sh.version();
        b.sh.roll_back(vec![1.0, 2.0], 8).unwrap();
        assert_eq!(b.sh.version(), v + 1);
        assert_eq!(&b.sh.values()[..], &[1.0, 2.0]);
        assert_eq!(b.sh.trust_counts(0.5 + TRUST_SECONDS), (2, 0));
        assert!(b.sh.roll_back(vec![1.0], 8).is_err(), "wrong length");
        assert!(
            b.sh.roll_back(vec![f32::NAN, 0.0], 8).is_err(),
            "not finite"
        );
        assert_eq!(b.sh.version(), v + 1, "a refused rollback changes nothing");
    }

    /// The replay check's digest: equal values give equal digests, and a change of one bit,
    /// of order, of a zero's sign or of the length anywhere (in the 16-value chunks and in
    /// the remainder) gives another.
    #[test]
    fn a_digest_changes_with_any_bit_order_or_length() {
        let v: Vec<f32> = (0..53).map(|i| (i as f32 * 0.37).sin()).collect();
        let d = super::digest(&v);
        assert_eq!(d, super::digest(&v.clone()));
        let mut seen = std::collections::HashSet::from([d]);
        for i in 0..v.len() {
            for bit in [0, 17, 31] {
                let mut w = v.clone();
                w[i] = f32::from_bits(w[i].to_bits() ^ (1 << bit));
                assert!(seen.insert(super::digest(&w)), "bit {bit} of value {i}");
            }
        }
        for (a, b) in [(0, 1), (15, 16), (48, 49), (50, 52)] {
            let mut w = v.clone();
            w.swap(a, b);
            assert!(seen.insert(super::digest(&w)), "swap {a} {b}");
        }
        let zeros = vec![0.0f32; 20];
        let mut negative = zeros.clone();
        negative[18] = -0.0;
        assert_ne!(super::digest(&zeros), super::digest(&negative));
        assert_ne!(super::digest(&zeros), super::digest(&zeros[..19]));
        assert_ne!(super::digest(&[]), super::digest(&[0.0]));
    }
}
