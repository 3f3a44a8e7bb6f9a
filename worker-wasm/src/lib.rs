//! The browser worker: [`crowdgrad_core::worker::Worker`] (all training and protocol logic)
//! driven over web-sys WebSockets inside a module Web Worker, so a volunteer's tab computes
//! gradients without freezing the page.
//!
//! # Layout
//! - [`pace`]: pure timing policy, testable natively: [`pace::Throttle`] (CPU duty cycle),
//!   [`pace::RateMeter`] (samples per second), [`pace::Ema`]. Reconnect delays are core's
//!   `crowdgrad_core::backoff::Backoff`.
//! - [`progress`]: [`progress::Progress`], the report posted to the page, and
//!   [`progress::ConnState`].
//! - [`endpoint`]: server URLs from the base URL and the paths in the join reply.
//! - [`error`]: the crate's [`Error`].
//! - [`loopback`]: an in-memory parameter server ([`loopback::Loopback`]) for tests and the
//!   native step-time example.
//! - [`bench`]: step and per-layer benchmarks for any GEMM kernel, natively
//!   (`examples/step_time.rs`) and as wasm exports (`bench_step`, `bench_layers`, `bench_info`)
//!   for `tests/browser/bench-step.mjs`.
//! - `browser` (wasm32 only): `BrowserWorker`, the object `web/worker.js` builds. It joins with
//!   `fetch`, downloads its data partition through the Cache API, opens one WebSocket per shard,
//!   feeds the core worker and pushes its frames, and rejoins with exponential backoff when the
//!   server goes away.
//!
//! Everything outside `browser` compiles natively, so `cargo test --workspace` covers the
//! policies, and `tests/parity.rs` runs the same model and worker computations natively and
//! (with `wasm-bindgen-test`, in a dedicated worker) as wasm against one fixture.

pub mod bench;
pub mod endpoint;
pub mod error;
pub mod loopback;
pub mod pace;
pub mod progress;

#[cfg(target_arch = "wasm32")]
mod browser;

#[cfg(target_arch = "wasm32")]
pub use browser::BrowserWorker;

pub use error::{Error, Result};
