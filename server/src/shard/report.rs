//! How a shard describes itself: to `/api/status` ([`ShardStatus`]) and, from a shard process,
//! to its coordinator (`GET /api/shard`, [`ShardReport`]).

use super::Shard;
use crate::registry::Counters;
use crowdgrad_core::partition::KeyRange;
use serde::{Deserialize, Serialize};

/// A shard as `/api/status` shows it.
#[derive(Debug, Serialize)]
pub struct ShardStatus {
    /// Index.
    pub id: u32,
    /// Key range.
    pub range: KeyRange,
    /// Version (applied updates).
    pub version: u64,
    /// Samples in the updates applied (what a schedule under `auto` local steps is positioned
    /// by; issue 20).
    #[serde(default)]
    pub samples_applied: u64,
    /// Updates by the number of gradients they merged (sync: K, or fewer when flushed early).
    pub updates_by_merged: std::collections::BTreeMap<usize, u64>,
    /// Its share of the run's egress budget, bytes per second (`null`: no budget; issue 18).
    pub egress_budget: Option<f64>,
    /// Its pace now, seconds: the bytes of one Params frame to every connected worker over
    /// that share, the least interval between one worker's pulls it asks for (0: none).
    pub pace_s: f64,
    /// Counters.
    #[serde(flatten)]
    pub counters: Counters,
}

impl ShardStatus {
    /// Shard `s` now, with its `counters`: the version and the updates that make it are read
    /// together ([`Shard::progress`]), so a reader never sees one without the other.
    pub fn of(s: &Shard, counters: Counters) -> Self {
        let (version, samples_applied, updates_by_merged) = s.progress();
        Self {
            id: s.id(),
            range: s.range(),
            version,
            samples_applied,
            updates_by_merged,
            egress_budget: s.egress_budget(),
            pace_s: s.pace_s(),
            counters,
        }
    }
}

/// The body of a shard process's `GET /api/shard`: what the coordinator checks against its own
/// run and shows on the dashboard.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ShardReport {
    /// This shard's index.
    pub index: u32,
    /// Shards in the run.
    pub of: usize,
    /// Its key range.
    pub range: KeyRange,
    /// The model, e.g. `mlp 784-128-10`.
    pub model: String,
    /// Consistency mode text.
    pub consistency: String,
    /// `--ema`: the decay of the moving average its `/api/params` serves (absent: none, and
    /// from shard processes older than it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ema: Option<f32>,
    /// Current version.
    pub version: u64,
    /// Seconds since the process started.
    pub uptime_s: f64,
    /// Its counters as `/api/status` shows a shard (`id`, `range`, `version`, counters...).
    pub status: serde_json::Value,
}
