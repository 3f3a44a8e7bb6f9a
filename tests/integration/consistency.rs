//! Consistency modes with native workers over real WebSockets: SSP keeps every reader within S
//! ticks of the slowest active worker (checked from the server's own read log), sync:K applies
//! exactly one mean per K fresh gradients, and neither deadlocks when a worker dies mid-step.

use crate::util::{config, get, server, status, wait_for};
use crowdgrad::worker::{WorkOptions, WorkerThread};
use crowdgrad_core::shard::Consistency;
use std::time::Duration;

fn worker(url: &str, delay_ms: u64) -> WorkerThread {
    let mut o = WorkOptions::new(url);
    o.duration = Some(Duration::from_secs(120));
    o.step_delay = Duration::from_millis(delay_ms);
    WorkerThread::spawn(o)
}

fn applied(s: &serde_json::Value) -> u64 {
    s["totals"]["pushes_applied"].as_u64().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ssp_bounds_the_fastest_worker_and_survives_a_dead_straggler() {
    let mut cfg = config();
    cfg.training.consistency = Consistency::Ssp { bound: 2 };
    cfg.training.heartbeat_timeout = 2.0;
    let running = server(cfg).await;
    let url = running.url();
    let fast_a = worker(&url, 0);
    let fast_b = worker(&url, 0);
    let slow = worker(&url, 40);
    wait_for(
        &url,
        Duration::from_secs(30),
        "3 workers and 100 applied pushes",
        |s| s["workers_connected"] == 3 && applied(s) > 100,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Kill the straggler mid-step: the fast workers must not wait for it forever.
    slow.kill();
    let before = applied(&status(&url).await);
    wait_for(
        &url,
        Duration::from_secs(20),
        "training to go on without the straggler",
        |s| applied(s) > before + 400,
    )
    .await;
    let (code, body) = get(format!("{url}/api/reads")).await;
    assert_eq!(code, 200);
    let reads: Vec<serde_json::Value> = serde_json::from_slice(&body).expect("read log");
    assert!(reads.len() > 300, "{} reads", reads.len());
    let mut waited_on = 0;
    for r in &reads {
        let clock = r["clock"]
            .as_u64()
            .expect("SSP reads carry the reader's clock");
        let min = r["min_clock"]
            .as_u64()
            .expect("and the slowest active clock");
        assert!(
            clock <= min + 2,
            "worker {} read at clock {clock} while the slowest was at {min}",
            r["worker"]
        );
        if clock == min + 2 {
            waited_on += 1;
        }
    }
    assert!(
        waited_on > 10,
        "the bound was never reached ({waited_on} reads at it): the test did not exercise SSP"
    );
    let s = status(&url).await;
    assert_eq!(s["consistency"], "ssp:2");
    assert_eq!(s["totals"]["pushes_rejected"], 0);
    for w in [fast_a, fast_b] {
        let summary = w.stop().expect("worker");
        assert_eq!(summary.sessions, 1);
        assert!(summary.stats.max_staleness <= 64, "{:?}", summary.stats);
    }
    running.stop().await.expect("clean shutdown");
}

fn updates(s: &serde_json::Value, shard: usize) -> Vec<(u64, u64)> {
    s["shards"][shard]["updates_by_merged"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.parse().unwrap_or(0), v.as_u64().unwrap_or(0)))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_applies_one_mean_per_k_fresh_gradients_and_survives_a_dead_worker() {
    let mut cfg = config();
    cfg.training.consistency = Consistency::Sync { k: 3 };
    cfg.training.sync_timeout = 0.5;
    let running = server(cfg).await;
    let url = running.url();
    let a = worker(&url, 0);
    let b = worker(&url, 0);
    let c = worker(&url, 0);
    let warm = wait_for(
        &url,
        Duration::from_secs(30),
        "3 workers and 30 updates",
        |s| s["workers_connected"] == 3 && s["shards"][0]["version"].as_u64().unwrap_or(0) > 30,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let steady = status(&url).await;
    // While all three are connected, every new update merged exactly K = 3 fresh gradients.
    for shard in 0..2 {
        let before: std::collections::BTreeMap<u64, u64> =
            updates(&warm, shard).into_iter().collect();
        let after: std::collections::BTreeMap<u64, u64> =
            updates(&steady, shard).into_iter().collect();
        for (merged, n) in &after {
            let grew = n - before.get(merged).copied().unwrap_or(0);
            if *merged != 3 {
                assert_eq!(grew, 0, "shard {shard}: {grew} updates merged {merged} gradients while 3 workers were connected");
            } else {
                assert!(grew > 20, "shard {shard}: only {grew} full updates in 2 s");
            }
        }
        // Accepted pushes = buffered + applied-on-completion: K per full update.
        let version = steady["shards"][shard]["version"].as_u64().unwrap_or(0);
        let total_updates: u64 = after.values().sum();
        assert_eq!(version, total_updates);
    }
    assert_eq!(steady["consistency"], "sync:3");
    // A worker dies mid-step: the others must not deadlock.
    c.kill();
    let v = steady["shards"][0]["version"].as_u64().unwrap_or(0);
    wait_for(
        &url,
        Duration::from_secs(20),
        "updates to go on with 2 workers",
        |s| s["shards"][0]["version"].as_u64().unwrap_or(0) > v + 100,
    )
    .await;
    let end = status(&url).await;
    let partial: u64 = updates(&end, 0)
        .iter()
        .filter(|(m, _)| *m < 3)
        .map(|(_, n)| n)
        .sum();
    assert!(
        partial > 50,
        "after the death, updates merge fewer than K: {partial}"
    );
    for w in [a, b] {
        let s = w.stop().expect("worker");
        assert!(s.stats.pushes_accepted > 100);
    }
    running.stop().await.expect("clean shutdown");
}
