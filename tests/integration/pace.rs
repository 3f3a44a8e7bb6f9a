//! Issue 18: the server paces the crowd. With a small `--egress-budget` the parameters sent to
//! real workers fall to the budget; without one the same workers pull far more.

use crate::util::{config, server, status, wait_for};
use crowdgrad::worker::{WorkOptions, WorkerThread};
use crowdgrad_core::shard::EgressBudget;
use std::time::{Duration, Instant};

/// Workers in each run.
const WORKERS: usize = 4;
/// The budget of the paced run, bytes per second: 4 softmax workers (two shards of bf16
/// Params, 15.8 kB a round) get a pace of about 0.3 s.
const BUDGET: f64 = 200_000.0;

/// Parameter bytes sent to workers so far, over all shards.
fn bytes_down(s: &serde_json::Value) -> u64 {
    s["shards"].as_array().map_or(0, |v| {
        v.iter().filter_map(|x| x["bytes_down"].as_u64()).sum()
    })
}

/// Runs `WORKERS` workers against a server with `budget` and returns the parameter bytes per
/// second it sent over `window`, after every worker connected and pulled for a second, and
/// the status at the end.
async fn egress(budget: EgressBudget, window: Duration) -> (f64, serde_json::Value) {
    let mut cfg = config();
    cfg.training.model = "softmax".into();
    cfg.training.exchange.egress_budget = budget;
    let running = server(cfg).await;
    let url = running.url();
    let workers: Vec<WorkerThread> = (0..WORKERS)
        .map(|_| {
            let mut o = WorkOptions::new(&url);
            o.duration = Some(Duration::from_secs(60));
            WorkerThread::spawn(o)
        })
        .collect();
    wait_for(
        &url,
        Duration::from_secs(30),
        "every worker connected and pulling",
        |s| s["workers_connected"] == WORKERS as u64 && s["totals"]["pulls"].as_u64() > Some(40),
    )
    .await;
    // Past the first round of every worker (its first pull is never held).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (b0, t0) = (bytes_down(&status(&url).await), Instant::now());
    tokio::time::sleep(window).await;
    let end = status(&url).await;
    let rate = (bytes_down(&end) - b0) as f64 / t0.elapsed().as_secs_f64();
    for w in workers {
        w.kill();
    }
    running.stop().await.expect("server stops");
    (rate, end)
}

/// Issue 18: real workers' pulls drop to the egress budget; without it they are far above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_18_workers_pull_within_the_egress_budget() {
    let budget = EgressBudget::bytes_per_second(BUDGET).expect("a valid budget");
    let (paced, s) = egress(budget, Duration::from_secs(5)).await;
    assert_eq!(
        s["egress_budget"].as_f64(),
        Some(BUDGET),
        "{}",
        s["egress_budget"]
    );
    let shards = s["shards"].as_array().expect("shards");
    let share: f64 = shards
        .iter()
        .filter_map(|x| x["egress_budget"].as_f64())
        .sum();
    assert!((share - BUDGET).abs() < 1.0, "shares {share}");
    for sh in shards {
        let pace = sh["pace_s"].as_f64().expect("pace_s");
        // 4 workers' bf16 frames of half a softmax each, over half the budget: ~0.16 s.
        assert!((0.1..0.5).contains(&pace), "pace {pace} s on {sh}");
    }
    // Every worker pulls at most once per pace: within the budget, give or take one round
    // per worker at the window's edges (4 rounds of 15.8 kB over 5 s: 6%) and timer slack.
    assert!(
        paced <= BUDGET * 1.15,
        "paced egress {paced:.0} B/s over the budget {BUDGET}"
    );
    assert!(
        paced >= BUDGET * 0.5,
        "paced egress {paced:.0} B/s: the workers barely pulled"
    );
    let (free, s) = egress(EgressBudget::OFF, Duration::from_secs(2)).await;
    assert!(s["egress_budget"].is_null());
    assert!(s["shards"][0]["pace_s"].as_f64() == Some(0.0));
    assert!(
        free >= BUDGET * 5.0,
        "without a budget the same workers sent only {free:.0} B/s (paced: {paced:.0})"
    );
    eprintln!("egress: paced {paced:.0} B/s (budget {BUDGET}), unpaced {free:.0} B/s");
}
