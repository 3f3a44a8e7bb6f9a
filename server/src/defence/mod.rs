//! Defences against hostile or broken workers that need more than one push to judge.
//!
//! - [`reputation`]: per-worker spot-check results and refusals, and quarantine.
//! - [`spotcheck`]: recomputing a sampled fraction of the pushes from the server's data.
//! - [`tolerance`]: how close a push must be to its recomputation.
//!
//! The per-push bounds (norm, NaN, size) and the robust round rules are core's
//! (`crowdgrad_core::session`, `crowdgrad_core::robust`); the zeno thread that feeds them the
//! server's validation gradient is the coordinator's (`crate::coordinator::zeno`).

pub mod reputation;
pub mod spotcheck;
pub mod tolerance;

pub use spotcheck::Defence;
