//! The report the browser worker posts to the page (as a plain JS object, via JSON) a few times
//! a second and on every state change. `web/app.js` renders it; nothing in JS computes training
//! numbers.

use crowdgrad_core::worker::WorkerStats;
use serde::Serialize;

/// Where the worker is in its life cycle (shown to the volunteer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ConnState {
    /// Built, not started.
    #[default]
    Idle,
    /// `POST /api/join` in flight.
    Joining,
    /// Fetching the data partition (from the Cache API or the server).
    Downloading,
    /// Opening the shard WebSockets and waiting for the first parameters.
    Connecting,
    /// Computing and pushing gradients.
    Training,
    /// Paused by the volunteer: sockets closed, nothing computed.
    Paused,
    /// The server went away or refused: waiting `retry_in_ms` before rejoining.
    Reconnecting,
    /// Stopped for good.
    Stopped,
}

impl ConnState {
    /// Stable snake_case name, as serialised.
    pub fn name(self) -> &'static str {
        match self {
            ConnState::Idle => "idle",
            ConnState::Joining => "joining",
            ConnState::Downloading => "downloading",
            ConnState::Connecting => "connecting",
            ConnState::Training => "training",
            ConnState::Paused => "paused",
            ConnState::Reconnecting => "reconnecting",
            ConnState::Stopped => "stopped",
        }
    }
}

/// One progress report.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Progress {
    /// Life-cycle state.
    pub state: ConnState,
    /// Id from the current join (changes on rejoin).
    pub worker_id: Option<u64>,
    /// Run joined (a restarted server starts a new run).
    pub run_id: Option<String>,
    /// Model of the run, e.g. `softmax 784-10`.
    pub model: Option<String>,
    /// Examples per step.
    pub batch_size: Option<usize>,
    /// Number of shards in the run.
    pub shards: usize,
    /// Shard sockets currently open.
    pub shards_connected: usize,
    /// Index of this worker's data partition (of `partition_count`).
    pub partition_index: Option<usize>,
    /// Number of partitions the training set is cut into.
    pub partition_count: Option<usize>,
    /// Examples in this worker's data partition.
    pub partition_examples: Option<usize>,
    /// URL path of the partition's images file (also its Cache API key, with the origin).
    pub partition_images: Option<String>,
    /// Whether the partition came from the Cache API (no download).
    pub data_from_cache: Option<bool>,
    /// Bytes of IDX data loaded for the partition.
    pub data_bytes: u64,
    /// Counters from the core worker, carried across rejoins.
    #[serde(flatten)]
    pub stats: WorkerStats,
    /// Examples per second over the last few seconds.
    pub samples_per_sec: f64,
    /// Moving average of the time one `step()` (forward, backward, encoding) takes, in ms.
    pub step_ms: Option<f64>,
    /// Time of the latest step, in ms.
    pub step_ms_last: Option<f64>,
    /// Moving average of the wait between steps for parameters to arrive (network and server
    /// time, the part of a step's period that is not computing), in ms.
    pub wait_ms: Option<f64>,
    /// CPU limit in percent.
    pub throttle_percent: u32,
    /// Which of the tab's Web Workers this is (`None`: the only one).
    pub thread: Option<u32>,
    /// Web Workers the tab runs (1 when alone).
    pub threads: u32,
    /// Training against in-memory loopback shards, not the server.
    pub loopback: bool,
    /// Paused by the volunteer.
    pub paused: bool,
    /// Sessions started after the first (rejoins).
    pub reconnects: u32,
    /// Delay before the next rejoin attempt, while reconnecting.
    pub retry_in_ms: Option<f64>,
    /// Milliseconds from `start()` to the first accepted push.
    pub first_push_ms: Option<f64>,
    /// Largest `WebSocket.bufferedAmount` seen on a shard socket, in bytes.
    pub buffered_max: u64,
    /// Times a step was held back because a socket's send buffer was over the high-water mark.
    pub backpressure_waits: u64,
    /// Milliseconds since `start()`.
    pub uptime_ms: f64,
    /// Why the last session ended or failed (driver side; `last_error` is the shards' word).
    pub error: Option<String>,
}

impl Progress {
    /// The report as JSON (the wasm side parses it into a JS object).
    pub fn to_json(&self) -> String {
        // Plain data with string keys: serialising cannot fail.
        serde_json::to_string(self).unwrap_or_else(|_| "{}".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serialises_flat_with_snake_case_state() {
        let mut p = Progress {
            state: ConnState::Reconnecting,
            worker_id: Some(7),
            throttle_percent: 50,
            ..Progress::default()
        };
        p.stats.pushes_accepted = 12;
        let v: serde_json::Value = serde_json::from_str(&p.to_json()).unwrap();
        assert_eq!(v["state"], "reconnecting");
        assert_eq!(v["worker_id"], 7);
        assert_eq!(v["pushes_accepted"], 12);
        assert_eq!(v["throttle_percent"], 50);
        assert!(v["error"].is_null());
        for s in [
            ConnState::Idle,
            ConnState::Joining,
            ConnState::Downloading,
            ConnState::Connecting,
            ConnState::Training,
            ConnState::Paused,
            ConnState::Reconnecting,
            ConnState::Stopped,
        ] {
            assert_eq!(serde_json::to_value(s).unwrap(), s.name());
        }
    }
}
