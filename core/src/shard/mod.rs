//! The shard's update logic: one implementation shared by the server's shards (applied inline,
//! under the shard's lock, by the connection that received the push) and the
//! simulator (`crowdgrad sim`), so both apply gradients by the very same path.
//!
//! - [`ShardCore`]: version, values, optimizer state, the staleness policy for async pushes and
//!   the aggregation buffer of synchronous mode.
//! - [`Consistency`]: `async` (apply on receipt), `ssp:S` (stale-synchronous parallel; gating
//!   happens at read time with [`SspClock`]) and `sync:K` (aggregate K fresh gradients, apply
//!   their mean once, drop late ones).
//! - Robust aggregation ([`crate::robust::Aggregation`], issue 10): with a round rule a
//!   `sync:K` shard keeps the round's pushes one by one (at most K × its length values) and
//!   applies their median, trimmed mean or (Multi-)Krum instead of the mean; in async/SSP the
//!   `consensus` rule refuses pushes whose direction disagrees with the recent accepted ones.
//! - [`StalenessPolicy`]: accept all; drop beyond a bound; scale the learning rate down for
//!   stale pushes ([`LrScale`]); delay compensation (DC-ASGD, Zheng et al., ICML 2017).
//!   Combinable.
//!
//! # Staleness-aware learning rate
//!
//! Zhang et al. (IJCAI 2016) divide the learning rate by the staleness τ. That does two things
//! at once: it weights stale gradients less than fresh ones (the point), and it divides the
//! *average* step by about the mean staleness, which with K async workers is about K. The
//! second part means a run that turns the rule on at its usual learning rate barely learns
//! (16 simulated workers, seed 7, 200k examples: 95.07% accepting everything, 92.29% with
//! lr/τ; it needs 8x the learning rate to do better). So `scale` ([`LrScale::Relative`])
//! keeps the first part and not the second: a push of staleness τ gets
//!
//! ```text
//! lr_scale = min(1, H / max(1, τ))      H = running harmonic mean of max(1, τ) on this shard
//! ```
//!
//! A push staler than usual moves less, in proportion (the 1/τ weighting of Zhang et al.);
//! a push at most as stale as usual gets the configured learning rate, never more. One worker
//! (τ = 0) is unaffected, and the learning rate means the same with and without the rule. H is
//! the harmonic mean because the 1/τ weights average to exactly 1/H: without the cap at 1 the
//! mean multiplier would be 1 (the cap only ever lowers a step, so `scale` is never more
//! aggressive than `accept`). H is an exponential moving average of 1/max(1, τ) over the last
//! ~[`STALENESS_WINDOW`] pushes (a plain mean until then), so it follows workers coming and
//! going. Measured with 16 simulated async workers, 200k examples, lr 0.05: seeds 7 / 42 / 1
//! give 95.07 / 95.92 / 95.16% with `accept` and 96.41 / 96.70 / 96.13% with `scale`; the mean
//! multiplier is about 0.88, and `accept` at lr 0.044 reaches only 95.48 / 96.24 / 96.07%, so the
//! gain is the weighting, not a smaller step. Zhang et al.'s plain lr/τ stays available as
//! `scale:abs` ([`LrScale::Absolute`]): at a learning rate that makes plain async diverge
//! (lr 0.4) it is the safety net (95.45%), which the relative rule, by design, is not.
//!
//! Values live in an `Arc<Vec<f32>>` that is never mutated once published: an update writes a
//! new vector (recycling the previous one when no reader holds it), so readers holding the old
//! one see a whole version, never a half-applied update.
//!
//! # Layout
//! - `policy.rs`: [`Consistency`], [`StalenessPolicy`], [`LrScale`] and their grammar.
//! - `apply.rs`: [`ShardCore`] (the one apply path), [`Outcome`], [`ShardExport`].
//! - `clock.rs`: [`SspClock`].
//! - `pace.rs`: the egress budget and the pace rule (issue 18): [`EgressBudget`], [`Pacing`],
//!   [`pace_s`], [`paced_steps`], [`pull_due`].

mod apply;
mod clock;
pub mod pace;
mod policy;

pub use apply::{AverageExport, Outcome, ShardCore, ShardExport, ANONYMOUS, DC_HISTORY};
pub use clock::SspClock;
pub use pace::{pace_ms, pace_s, paced_steps, pull_due, EgressBudget, Pacing};
pub use policy::{Consistency, LrScale, StalenessPolicy, STALENESS_WINDOW};
