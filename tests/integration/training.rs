//! Training end to end on real MNIST with native workers over real WebSockets.

use crate::util::{config, get, server, status, wait_for};
use crowdgrad::worker::{WorkOptions, WorkerThread};
use std::time::Duration;

fn worker(url: &str, name: &str) -> WorkerThread {
    let mut o = WorkOptions::new(url);
    o.duration = Some(Duration::from_secs(120));
    o.name = Some(name.into());
    WorkerThread::spawn(o)
}

/// Issue 2: 2 shards, 3 native workers, MLP to >= 95% test accuracy as reported by
/// /api/status; a worker killed mid-run leaves the server healthy and the others training.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_shards_three_workers_reach_95_percent_and_survive_a_killed_worker() {
    let running = server(config()).await;
    let url = running.url();
    let a = worker(&url, "a");
    let b = worker(&url, "b");
    let c = worker(&url, "c");
    wait_for(&url, Duration::from_secs(30), "3 workers training", |s| {
        s["workers_connected"] == 3
            && s["workers"]
                .as_array()
                .is_some_and(|w| w.iter().all(|w| w["samples"].as_u64() > Some(0)))
    })
    .await;
    c.kill();
    let after_kill = wait_for(
        &url,
        Duration::from_secs(10),
        "the killed worker to drop out",
        |s| s["workers_connected"] == 2,
    )
    .await;
    let applied = after_kill["totals"]["pushes_applied"].as_u64().unwrap_or(0);
    // The two survivors keep training...
    wait_for(&url, Duration::from_secs(20), "training to continue", |s| {
        s["totals"]["pushes_applied"].as_u64().unwrap_or(0) > applied + 200
    })
    .await;
    // ...to 95% test accuracy.
    let done = wait_for(&url, Duration::from_secs(90), "95% test accuracy", |s| {
        s["eval"]["accuracy"].as_f64().unwrap_or(0.0) >= 0.95
    })
    .await;
    assert_eq!(done["shards"].as_array().map(Vec::len), Some(2));
    let sa = a.stop().expect("worker a");
    let sb = b.stop().expect("worker b");
    for s in [&sa, &sb] {
        assert!(s.stats.pushes_accepted > 100, "{s:?}");
        assert_eq!(s.stats.pushes_rejected, 0, "{s:?}");
        assert_eq!(s.sessions, 1, "{s:?}");
    }
    let end = status(&url).await;
    assert_eq!(
        end["totals"]["pushes_rejected"], 0,
        "killing a worker must not look like a bad push"
    );
    assert_eq!(end["workers"].as_array().map(Vec::len), Some(3));
    running.stop().await.expect("clean shutdown");
}

async fn train_and_read_params(shards: usize, steps: u64) -> (Vec<u8>, serde_json::Value) {
    let mut cfg = config();
    cfg.training.shards = shards;
    cfg.training.seed = 7;
    // Protocol version 1's exchange: int8 blocks are cut per shard, so compressed pushes differ
    // between shard counts by design; and with overlap a lone worker reads before its own push.
    cfg.training.exchange = crowdgrad::config::Exchange::default();
    let running = server(cfg).await;
    let url = running.url();
    let mut o = WorkOptions::new(&url);
    o.steps = Some(steps);
    let summary = tokio::task::spawn_blocking(move || WorkerThread::spawn(o).join())
        .await
        .expect("join")
        .expect("worker");
    assert_eq!(summary.stats.steps, steps);
    assert_eq!(summary.stats.pushes_accepted, steps * shards as u64);
    let (code, params) = get(format!("{url}/api/params")).await;
    assert_eq!(code, 200);
    let s = status(&url).await;
    running.stop().await.expect("clean shutdown");
    (params, s)
}

/// Issue 2: with one worker and a fixed seed, training is deterministic and the same for 1 and 4
/// shards (bit for bit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_worker_is_deterministic_and_equal_for_one_and_four_shards() {
    let (one, s1) = train_and_read_params(1, 150).await;
    let (four, s4) = train_and_read_params(4, 150).await;
    let (again, _) = train_and_read_params(4, 150).await;
    assert_eq!(one.len(), 101_770 * 4);
    assert!(one == four, "1-shard and 4-shard parameters differ");
    assert!(four == again, "two identical runs differ");
    for s in [&s1, &s4] {
        for shard in s["shards"].as_array().expect("shards") {
            assert_eq!(shard["version"], 150);
            assert_eq!(shard["staleness_max"], 0, "a lone worker is never stale");
        }
    }
    // And training moved the parameters away from the seed's initial values.
    let (init, _) = train_and_read_params(1, 0).await;
    assert!(init != one);
}

/// Issue 2: a native worker reconnects with backoff when the server goes away and comes back
/// (a new run on the same address), and keeps its counters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_native_worker_rejoins_a_restarted_server() {
    let first = server(config()).await;
    let addr = first.addr;
    let url = first.url();
    let w = worker(&url, "phoenix");
    wait_for(&url, Duration::from_secs(30), "the worker to train", |s| {
        s["totals"]["samples"].as_u64() > Some(0)
    })
    .await;
    first.stop().await.expect("clean shutdown");
    // The worker is now retrying; bring a new server up on the same address.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let second = crowdgrad::start(addr, config(), crate::util::mnist())
        .await
        .expect("restart on the same port");
    wait_for(
        &url,
        Duration::from_secs(30),
        "the worker to come back",
        |s| s["workers_connected"] == 1 && s["totals"]["samples"].as_u64() > Some(0),
    )
    .await;
    let summary = w.stop().expect("worker");
    assert!(summary.sessions >= 2, "{summary:?}");
    assert!(
        summary.worker_ids.len() >= 2,
        "it joined the new run: {summary:?}"
    );
    assert!(
        summary.last_error.is_some(),
        "the loss of the first server was noticed"
    );
    second.stop().await.expect("clean shutdown");
}

/// Issue 12: `--normalize auto` states the training set's per-channel statistics in the run
/// spec (MNIST's well-known 0.1307 / 0.3081), a native worker trains with them, and the
/// evaluator, which normalises the test set the same way, sees the accuracy rise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn normalize_auto_is_stated_in_the_run_spec_and_trains() {
    let mut cfg = config();
    cfg.training.normalize = crowdgrad_core::data::NormalizeChoice::Auto;
    let running = server(cfg).await;
    let url = running.url();
    let joined = crate::util::join(&url).await;
    let n = &joined.run.normalize;
    assert_eq!((n.mean.len(), n.std.len()), (1, 1), "{n:?}");
    assert!((n.mean[0] - 0.1307).abs() < 1e-3, "{n:?}");
    assert!((n.std[0] - 0.3081).abs() < 1e-3, "{n:?}");
    let w = worker(&url, "normalised");
    let done = wait_for(&url, Duration::from_secs(60), "90% test accuracy", |s| {
        s["eval"]["accuracy"].as_f64().unwrap_or(0.0) >= 0.90
    })
    .await;
    assert_eq!(done["totals"]["pushes_rejected"], 0, "{done}");
    w.stop().expect("worker");
}
