//! The native worker: `crowdgrad work`. It joins over HTTP, downloads its data partition, opens
//! one WebSocket per shard (tokio-tungstenite) and drives core's sans-IO
//! [`crowdgrad_core::worker::Worker`]: the same training logic the browser worker runs.
//!
//! If the server goes away it reconnects after core's [`crowdgrad_core::backoff::Backoff`] (the
//! one policy every worker and the simulator share) and joins again (the server may have
//! restarted with a new run), keeping its counters.
//!
//! Every network wait has a deadline ([`Timeouts`]): the join and each download (a whole-request
//! deadline and a stall deadline per read), each WebSocket connect, and the reply to a pull or
//! push; when one passes the session counts as lost and the worker reconnects with backoff.
//! Every wait also races the stop signal, so Ctrl-C or SIGTERM ends the worker at once (a
//! blocking HTTP call is left to its own deadline on a helper thread that the runtime does not
//! wait for; see `main.rs`). `https://` servers are reached over TLS (rustls, webpki roots, or
//! `--ca FILE`), their shards over `wss://`.
//!
//! With [`WorkOptions::threads`] > 1 the process runs that many worker loops, each on an OS
//! thread of its own with a single-threaded runtime and sockets of its own, joined as the
//! threads of one volunteer ([`Threads`]: the server gives them one partition, downloaded
//! once into a cache they share, and its dashboard shows one volunteer). Every rule above
//! holds per thread; the stop signal reaches all of them; the progress bar sums them.

pub mod args;
mod handle;
mod net;
mod options;
mod progress;
mod session;
mod threads;

pub use handle::WorkerThread;
pub use options::{
    default_threads, identity_from_file, peak_rss_kib, Summary, Timeouts, WorkOptions,
};
pub use threads::work;
