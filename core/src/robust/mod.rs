//! Robust aggregation for untrusted volunteers (issue 10): how a shard combines pushes when some
//! workers may send garbage or attack the run.
//!
//! - [`Aggregation`]: the run's rule, chosen per run with `--aggregation`:
//!   - `mean` (the default): the plain mean of a `sync:K` round, every push applied in `async`;
//!   - in `sync:K`, over the K pushes of a round: `median` (coordinate-wise), `trimmed_mean:β`
//!     (coordinate-wise, drops the ⌊βn⌋ largest and smallest values of each coordinate),
//!     `krum:f` (the push with the smallest sum of squared distances to its n − f − 2 nearest
//!     others, Blanchard et al. 2017) and `multikrum:f,m` (the mean of the m best-scored);
//!   - in `async` and `ssp:S`: `consensus[:C]`, a Zeno++-style filter (Xie et al. 2020) that
//!     refuses a push whose direction disagrees with the recent consensus ([`Consensus`]), and
//!     `zeno[:C]`, Zeno++ proper, against the gradient of a validation batch held by the driver
//!     ([`ZenoReference`]).
//! - [`aggregate`]: the pure `sync:K` rules over a buffer of n rows, with preallocated
//!   [`Scratch`] (nothing is allocated per aggregate once the scratch has grown to the round).
//!
//! # Per shard
//! A shard only ever sees its own slice of each push, so every rule runs per shard: the
//! coordinate-wise rules are exactly what they would be on the whole vector, but Krum picks a
//! push per shard (shard 0 may choose worker 3's slice, shard 1 worker 7's). Each choice is still
//! a slice of an honest-looking push; with one shard it is plain Krum.
//!
//! # Partial rounds
//! A `sync:K` round can be flushed with n < K pushes (a worker left, a straggler timed out). The
//! coordinate-wise rules use n; Krum needs n ≥ 2f + 3 and falls back to the coordinate-wise
//! median below that (still robust, and what a round of one or two pushes can afford).
//!
//! # The consensus filter
//! Zeno++ (Xie et al. 2020) accepts a push g when `γ⟨v, g⟩ − ρ‖g‖² ≥ −γε`, v a gradient of a
//! validation batch held by the server: a first-order estimate that the step does not raise the
//! validation loss by more than a margin. A shard holds no data, so v is the running consensus
//! of the pushes it received: the exponential moving average of their *unit* directions over
//! ~[`CONSENSUS_WINDOW`] pushes (each push weighs the same whatever its norm, so an honest
//! majority sets the direction), scaled to the median norm m of the last [`CONSENSUS_NORMS`].
//! Divided by m², with r = ‖g‖ / m and c the cosine of g with the consensus, the test is
//!
//! ```text
//! score = c·r − ρ·r²  ≥  −E        ρ = CONSENSUS_RHO (0.01), E the margin (default 0.5)
//! ```
//!
//! A push failing it is refused ([`crate::wire::ErrorCode::Disagrees`], not fatal; no parameter
//! changes). Why both terms: in async training honest minibatch gradients are nearly orthogonal
//! to the recent consensus (measured with 10 simulated async MNIST workers: cosines centred on 0,
//! 5% below −0.22), so a cosine threshold alone either refuses honest pushes or lets attackers
//! through; a push of the usual norm passes unless it points clearly against the consensus
//! (c < −0.49), while one 10× the usual norm must agree with it (c > 0.05). Refused pushes count
//! in the consensus too: an average of accepted pushes only falls behind the moving model, then
//! refuses everything and never catches up (measured: 93% of honest pushes refused). The shard's
//! norm bound (`--norm-bound`, [`crate::session::PushGuard`]) still applies in every mode.
//!
//! # Zeno++ with a validation batch
//! A driver that holds the training data (the server with its shards in process, the
//! simulator) can give each shard the real v: [`ZenoReference`] computes the gradient of a
//! fixed validation batch ([`ZENO_BATCH`] examples strided through the training set) at the
//! current parameters, every [`ZENO_REFRESH`] updates of shard 0 (Zeno++'s lazy refresh), and
//! each shard gets its slice ([`crate::session::ShardState::set_reference`]). `zeno` then scores
//! a push as above with c its cosine to that slice and ρ = [`ZENO_RHO`] (0.1): against the true
//! descent direction honest minibatch gradients mostly agree, so a larger ρ can refuse pushes
//! of several times the usual norm unless they agree closely, and no warm-up of the direction
//! is needed (the norm term waits for [`ZENO_NORM_WARMUP`] norms). The shard session gives r
//! against the median over workers of each one's median norm (the norm bound's reference,
//! [`crate::session::PushGuard`]), so a worker pushing more often than the others cannot make
//! its own norm the usual one. Measured with 2 of 10
//! simulated async workers pushing −10× their gradient: 96.28% against a clean 96.65%, where
//! `consensus` reaches 91.20% (tests/integration/robust.rs, docs/experiments.md).
//!
//! # Layout
//! - `parse.rs`: [`Aggregation`], its grammar and the modes it fits.
//! - `round.rs`: the `sync:K` round rules, [`aggregate`] and [`Scratch`].
//! - `consensus.rs`: [`Consensus`], the async filter.
//! - `zeno.rs`: `zeno`'s check ([`Consensus::check_zeno`]) and [`ZenoReference`].

mod consensus;
mod parse;
mod round;
mod zeno;

pub use consensus::{
    Consensus, CONSENSUS_NORMS, CONSENSUS_RHO, CONSENSUS_WARMUP, CONSENSUS_WINDOW,
};
pub use parse::{Aggregation, DEFAULT_CONSENSUS_MARGIN, DEFAULT_ZENO_MARGIN, MAX_ROBUST_K};
pub use round::{aggregate, trim, Scratch};
pub use zeno::{ZenoReference, ZENO_BATCH, ZENO_NORM_WARMUP, ZENO_REFRESH, ZENO_RHO};

/// Helpers the robust tests share.
#[cfg(test)]
mod testing {
    use super::Aggregation;
    use crate::shard::{Consistency, ShardCore, StalenessPolicy};

    pub(super) fn sgd_shard(
        values: Vec<f32>,
        consistency: Consistency,
        rule: Aggregation,
    ) -> ShardCore {
        let cfg = crate::optim::OptimizerConfig {
            rule: crate::optim::Rule::Sgd,
            lr: 1.0,
            weight_decay: 0.0,
            clip_norm: None,
            schedule: Default::default(),
        };
        ShardCore::new(values, cfg, StalenessPolicy::default(), consistency).with_aggregation(rule)
    }
}
