//! Issue 10: robust aggregation against faulty volunteers, in the simulator (deterministic, on
//! real MNIST) and over real sockets.

use crate::util::{config, mnist, server, status, wait_for};
use crowdgrad::sim::{self, SimConfig, SimResult};
use crowdgrad::worker::{WorkOptions, WorkerThread};
use crowdgrad_core::fault::Fault;
use crowdgrad_core::robust::Aggregation;
use crowdgrad_core::shard::Consistency;
use std::time::Duration;

/// 10 simulated workers on real MNIST, `samples` examples, final accuracy on the full test set.
fn ten(consistency: Consistency, aggregation: Aggregation, faulty: f64, fault: Fault) -> SimConfig {
    SimConfig {
        workers: 10,
        partitions: 10,
        samples: Some(150_000),
        eval_every: 1_000_000,
        eval_subset: 500,
        consistency,
        aggregation,
        faulty,
        fault,
        ..SimConfig::default()
    }
}

fn run(cfg: &SimConfig) -> SimResult {
    sim::run(cfg, &mnist()).expect("run")
}

fn pct(r: &SimResult) -> f64 {
    r.final_accuracy() * 100.0
}

/// Issue 10's target: 2 of 10 workers push their gradient times -10. In sync:10 the plain mean
/// is wrecked; Multi-Krum ends within 1 point of the clean run, the coordinate-wise median and
/// trimmed mean within 2.
#[test]
fn issue10_two_of_ten_signflip_x10_robust_sync_within_a_point_of_clean() {
    let sync = Consistency::Sync { k: 10 };
    let flip = Fault::SignFlip(10.0);
    let clean = run(&ten(sync, Aggregation::Mean, 0.0, flip));
    let plain = run(&ten(sync, Aggregation::Mean, 0.2, flip));
    let median = run(&ten(sync, Aggregation::Median, 0.2, flip));
    let trimmed = run(&ten(
        sync,
        Aggregation::TrimmedMean { beta: 0.2 },
        0.2,
        flip,
    ));
    let krum = run(&ten(sync, Aggregation::MultiKrum { f: 2, m: 6 }, 0.2, flip));
    println!(
        "sync:10, 2 of 10 signflip:10: clean mean {:.2}%, attacked mean {:.2}%, median {:.2}%, trimmed_mean:0.2 {:.2}%, multikrum:2,6 {:.2}%",
        pct(&clean),
        pct(&plain),
        pct(&median),
        pct(&trimmed),
        pct(&krum)
    );
    assert_eq!(clean.workers.iter().filter(|w| w.faulty).count(), 0);
    assert_eq!(plain.workers.iter().filter(|w| w.faulty).count(), 2);
    assert!(plain.totals.faulty_pushes > 0 && median.totals.faulty_pushes > 0);
    assert!(pct(&clean) > 90.0, "clean run: {:?}", clean.rows);
    assert!(
        pct(&plain) <= pct(&clean) - 5.0,
        "the attack should hurt the plain mean: {:.2}% vs clean {:.2}%",
        pct(&plain),
        pct(&clean)
    );
    // Multi-Krum averages 6 whole pushes: within a point. The coordinate-wise rules pay for
    // their statistical efficiency (the median of 10 noisy gradients, biased toward the side
    // the 2 flipped ones sit on): within 2 points at this budget.
    assert!(
        pct(&krum) >= pct(&clean) - 1.0,
        "multikrum: {:.2}% vs clean {:.2}%",
        pct(&krum),
        pct(&clean)
    );
    for (name, r) in [("median", &median), ("trimmed_mean", &trimmed)] {
        assert!(
            pct(r) >= pct(&clean) - 2.0,
            "{name}: {:.2}% vs clean {:.2}%",
            pct(r),
            pct(&clean)
        );
    }
}

/// Issue 10 in async, 2 of 10 workers pushing their gradient times -10, against the plain
/// mean's clean run:
/// - `zeno` (Zeno++ with the validation gradient the driver holds) ends within a point of it
///   (measured, seeds 42, 2, 3: 96.28% vs 96.65%, 95.56% vs 96.34%, 96.38% vs 96.50%);
/// - `consensus` (no data at the shards) wins back most of what the attack costs, not all
///   (measured 62.00% -> 92.51% against a clean 96.61%, and 40.49% -> 91.20% against 96.65%
///   after a change of float rounding in the first layer: the flipped pushes it lets through
///   still hurt);
/// - in a clean run each refuses under 2% of the honest pushes.
#[test]
fn issue10_two_of_ten_signflip_x10_async_zeno_within_a_point_consensus_most_of_the_way() {
    let flip = Fault::SignFlip(10.0);
    let clean = run(&ten(Consistency::Async, Aggregation::Mean, 0.0, flip));
    let plain = run(&ten(Consistency::Async, Aggregation::Mean, 0.2, flip));
    assert!(pct(&plain) <= pct(&clean) - 20.0, "{:.2}%", pct(&plain));
    let disagrees = |r: &SimResult| r.totals.rejected_by_reason.get("disagrees").copied();
    let consensus = Aggregation::Consensus {
        margin: crowdgrad_core::robust::DEFAULT_CONSENSUS_MARGIN,
    };
    let zeno = Aggregation::Zeno {
        margin: crowdgrad_core::robust::DEFAULT_ZENO_MARGIN,
    };
    for (rule, within) in [(zeno, 1.0), (consensus, 7.0)] {
        let clean_filtered = run(&ten(Consistency::Async, rule, 0.0, flip));
        let attacked = run(&ten(Consistency::Async, rule, 0.2, flip));
        println!(
            "async, 2 of 10 signflip:10: clean {:.2}% (with {rule} {:.2}%, {:?} honest pushes refused of {}), attacked mean {:.2}%, {rule} {:.2}% ({:?} disagrees, {:?} out of bounds, {} faulty pushes)",
            pct(&clean),
            pct(&clean_filtered),
            disagrees(&clean_filtered),
            clean_filtered.totals.pushes,
            pct(&plain),
            pct(&attacked),
            disagrees(&attacked),
            attacked.totals.rejected_by_reason.get("out_of_bounds"),
            attacked.totals.faulty_pushes,
        );
        assert!(
            pct(&attacked) >= pct(&clean) - within && pct(&attacked) >= pct(&plain) + 20.0,
            "{rule} {:.2}% vs clean {:.2}%, attacked mean {:.2}%",
            pct(&attacked),
            pct(&clean),
            pct(&plain)
        );
        assert!(disagrees(&attacked).unwrap_or(0) > 0, "{rule}");
        assert!(pct(&clean_filtered) >= pct(&clean) - 1.0, "{rule}");
        let honest_refused = disagrees(&clean_filtered).unwrap_or(0);
        assert!(
            honest_refused * 50 <= clean_filtered.totals.pushes,
            "{rule}: {honest_refused} of {} honest pushes refused",
            clean_filtered.totals.pushes
        );
    }
}

/// The real worker (`crowdgrad::worker::work`, what `crowdgrad work --fault signflip:S` runs)
/// with core's `signflip:scale` fault: every push it sends carries its gradient times `-scale`
/// (re-encoded as f32, which every shard accepts). Unpaced, so it pushes several times as often
/// as the paced honest workers.
fn signflip_worker(base: &str, steps: u64, scale: f32) -> WorkerThread {
    let mut o = WorkOptions::new(base);
    o.steps = Some(steps);
    o.name = Some("signflip".into());
    o.threads = 1;
    o.fault = Some(Fault::SignFlip(scale));
    // Paced as the honest workers are (as `crowdgrad work --fault` is in faults.rs).
    o.step_delay = Duration::from_millis(10);
    WorkerThread::spawn(o)
}

/// One real run: a server with `aggregation` in `consistency`, `honest` `crowdgrad work`
/// workers and `faulty` native workers sign-flipping x10, `steps` steps each. Returns the
/// server's final test accuracy (%) and its status.
async fn real_run(
    consistency: Consistency,
    aggregation: Aggregation,
    honest: usize,
    faulty: usize,
    steps: u64,
) -> (f64, serde_json::Value) {
    let mut cfg = config();
    cfg.training.consistency = consistency;
    cfg.training.aggregation = aggregation;
    cfg.eval_every = Duration::from_millis(200);
    // Only the aggregation defends here: the norm bound would refuse about half the flipped
    // pushes (then each round waits for --sync-timeout).
    cfg.training.exchange.norm_bound = 0.0;
    // No round is cut short by a straggler timeout: on a loaded machine an honest worker can
    // be slower than the 2 s default, and a round of one honest push and the flipped one is
    // a mean whatever the rule (the test flaked so: attacked median 8.92% vs clean 89.55%).
    // Rounds still close when a worker leaves (rule 2), so nothing waits for this.
    cfg.training.sync_timeout = 60.0;
    let running = server(cfg).await;
    let url = running.url();
    let updates = |s: &serde_json::Value| {
        s["shards"].as_array().map_or(0, |a| {
            a.iter()
                .map(|x| x["version"].as_u64().unwrap_or(0))
                .sum::<u64>()
        })
    };
    let honest_workers = honest;
    // The honest workers train until stopped (at most 240 s): they must outlive the faulty
    // ones. With step counts they once did not: a faulty worker that joined late on a loaded
    // machine (load 18) still pushed after the honest ones had finished, alone in its sync
    // rounds, and the attacked median ended at 10.32%.
    let honest: Vec<WorkerThread> = (0..honest_workers)
        .map(|i| {
            let mut o = WorkOptions::new(&url);
            o.duration = Some(Duration::from_secs(240));
            o.name = Some(format!("honest-{i}"));
            // Paced, so the run outlasts the faulty worker's start: unpaced, 3 workers finish
            // their steps in well under a second on a quiet machine, before it joins.
            o.step_delay = Duration::from_millis(10);
            WorkerThread::spawn(o)
        })
        .collect();
    // The faulty workers start once the honest ones train, for `steps - 50` steps each.
    wait_for(&url, Duration::from_secs(30), "the honest workers", |s| {
        s["workers_connected"] == honest_workers as u64
    })
    .await;
    let bad: Vec<_> = (0..faulty)
        .map(|_| signflip_worker(&url, steps - 50, 10.0))
        .collect();
    for b in bad {
        let s = tokio::time::timeout(
            Duration::from_secs(180),
            tokio::task::spawn_blocking(move || b.join()),
        )
        .await
        .expect("the faulty worker finishes")
        .expect("join")
        .expect("faulty worker");
        let sent = s.stats.pushes_sent;
        assert!(
            sent >= steps - 50,
            "the faulty worker pushed {sent} times: {s:?}"
        );
    }
    // Then the honest workers alone for 50 more steps each, and at least `steps` each in all
    // (what a clean run gets): on each of the 2 shards a step of every honest worker is one
    // update in async, and one round of them all is one update in sync.
    let per_step = match consistency {
        Consistency::Sync { .. } => 1,
        _ => honest_workers as u64,
    };
    let target = (updates(&status(&url).await) + 2 * 50 * per_step).max(2 * steps * per_step);
    wait_for(
        &url,
        Duration::from_secs(180),
        "the honest workers' last updates",
        |s| updates(s) >= target,
    )
    .await;
    for h in honest {
        let s = tokio::task::spawn_blocking(move || h.stop())
            .await
            .expect("join")
            .expect("honest worker");
        assert!(s.stats.pushes_accepted > 0, "{s:?}");
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    let end = wait_for(&url, Duration::from_secs(10), "an evaluation", |s| {
        s["eval"]["accuracy"].as_f64().is_some()
    })
    .await;
    running.stop().await.expect("clean shutdown");
    (end["eval"]["accuracy"].as_f64().unwrap_or(0.0) * 100.0, end)
}

/// Issue 10 over real sockets: a real server in sync:4 with 3 `crowdgrad work` workers and one
/// faulty native worker (the real worker with core's `signflip:10`) pushing its gradient x -10.
/// The plain mean is wrecked; the coordinate-wise median stays near the clean run (measured:
/// clean 91.07%, attacked mean 10.09%, attacked median 88.97%, with the hand-written faulty
/// worker this test had before; thread timing makes runs differ, hence the 5-point margin).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue10_real_server_median_survives_a_signflip_worker() {
    let steps = 250;
    let sync = Consistency::Sync { k: 4 };
    let clean = real_run(sync, Aggregation::Mean, 4, 0, steps).await.0;
    let plain = real_run(sync, Aggregation::Mean, 3, 1, steps).await.0;
    let median = real_run(sync, Aggregation::Median, 3, 1, steps).await.0;
    println!(
        "real server, sync:4, 1 of 4 native workers signflip:10, {steps} steps each: clean mean {clean:.2}%, attacked mean {plain:.2}%, attacked median {median:.2}%"
    );
    assert!(clean > 85.0, "clean {clean:.2}%");
    assert!(
        plain <= clean - 20.0,
        "attacked mean {plain:.2}% vs clean {clean:.2}%"
    );
    assert!(
        median >= clean - 5.0,
        "attacked median {median:.2}% vs clean {clean:.2}%"
    );
}

/// The same over real sockets in async: the server computes its validation batch's gradient
/// (`crowdgrad::coordinator::zeno`) and the shards refuse the flipped pushes (`disagrees`); the plain mean
/// is wrecked, `zeno` stays near the clean run of the same 3 honest workers (measured: clean
/// 93.47% / 93.50%, attacked mean 10.09%, attacked zeno 93.36% / 93.14%, the flipping worker
/// getting 1 and 0 of its 400 shard pushes applied). The attacker pushes unpaced, several
/// times as often as the honest workers: the norm ratio zeno scores by is taken against the
/// median over workers (as the norm bound's), or the attacker's own pushes would set "the
/// usual norm" (measured before that: 45 of its pushes applied, 76.96%).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue10_real_server_zeno_survives_a_signflip_worker_in_async() {
    let steps = 250;
    let zeno = Aggregation::Zeno {
        margin: crowdgrad_core::robust::DEFAULT_ZENO_MARGIN,
    };
    let clean = real_run(Consistency::Async, Aggregation::Mean, 3, 0, steps)
        .await
        .0;
    let plain = real_run(Consistency::Async, Aggregation::Mean, 3, 1, steps)
        .await
        .0;
    let (filtered, s) = real_run(Consistency::Async, zeno, 3, 1, steps).await;
    let refused = s["totals"]["rejected_by_reason"]["disagrees"]
        .as_u64()
        .unwrap_or(0);
    println!(
        "real server, async, 3 honest native workers (+ 1 signflip:10), {steps} steps each: clean mean {clean:.2}%, attacked mean {plain:.2}%, attacked zeno {filtered:.2}% ({refused} pushes refused as disagrees)"
    );
    for w in s["workers"].as_array().into_iter().flatten() {
        println!(
            "  worker {} ({}): applied {}, rejected {}",
            w["id"], w["name"], w["pushes_applied"], w["rejected_by_reason"]
        );
    }
    assert!(clean > 85.0, "clean {clean:.2}%");
    assert!(
        plain <= clean - 20.0,
        "attacked mean {plain:.2}% vs clean {clean:.2}%"
    );
    assert!(
        filtered >= clean - 3.0,
        "attacked zeno {filtered:.2}% vs clean {clean:.2}%"
    );
    // Most of the flipped worker's 2 x 200 shard pushes.
    assert!(refused >= 200, "{refused} refused: {}", s["totals"]);
}

/// Every fault kind of the simulator does what its doc says, as the shards see it.
#[test]
fn every_fault_kind_reaches_the_shards_as_documented() {
    let small = |fault: Fault, consistency: Consistency| SimConfig {
        workers: 4,
        partitions: 4,
        shards: 2,
        samples: Some(6_000),
        eval_every: 1_000_000,
        eval_subset: 500,
        faulty: 0.5,
        fault,
        consistency,
        // Protocol version 1's exchange: a worker waits for its pushes' round trip, so every
        // push reaches an open connection.
        exchange: crowdgrad::config::Exchange::default(),
        ..SimConfig::default()
    };
    let reason = |r: &SimResult, code: &str| r.totals.rejected_by_reason.get(code).copied();
    for fault in [
        Fault::Inf,
        Fault::WrongShard,
        Fault::Replay,
        Fault::ShuffledLabels,
        Fault::SignFlip(10.0),
        Fault::Collude(1.0),
    ] {
        let r = run(&small(fault, Consistency::Async));
        let t = &r.totals;
        assert!(t.faulty_pushes > 0, "{fault}: {t:?}");
        assert!(!t.stalled, "{fault}: {t:?}");
        assert!(r.final_params.iter().all(|v| v.is_finite()), "{fault}");
        let faulty = r.workers.iter().filter(|w| w.faulty);
        match fault {
            Fault::Inf => {
                assert_eq!(reason(&r, "not_finite"), Some(t.faulty_pushes), "{t:?}");
                assert!(faulty.clone().all(|w| w.pushes_accepted == 0));
            }
            Fault::WrongShard => {
                let refused = reason(&r, "wrong_shard").unwrap_or(0);
                assert!(refused > 0 && refused <= t.faulty_pushes, "{t:?}");
                assert!(faulty.clone().all(|w| w.pushes_accepted == 0));
            }
            // In range, of a plausible norm: the plain mean applies them.
            Fault::Replay | Fault::ShuffledLabels => {
                assert!(
                    faulty.clone().all(|w| w.pushes_accepted > 0),
                    "{fault}: {t:?}"
                );
            }
            _ => {}
        }
    }
    // Colluders in sync:K send one vector per round (two identical flipped pushes of four):
    // the round rules take them like any others.
    let r = run(&SimConfig {
        aggregation: Aggregation::Median,
        ..small(Fault::Collude(1.0), Consistency::Sync { k: 4 })
    });
    assert!(r.totals.faulty_pushes > 0 && r.final_params.iter().all(|v| v.is_finite()));
}
