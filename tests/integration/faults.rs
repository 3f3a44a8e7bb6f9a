//! Issue 10: faulty workers in real runs. `crowdgrad work --fault KIND` (the real binary, as
//! separate processes) against a real server: a sign-flipping worker among three honest ones in
//! sync:4 is outvoted by the coordinate-wise median and wrecks the plain mean; a worker that
//! trains on shuffled labels is caught by spot checks, quarantined, refused on rejoin (403) and
//! shown in the status and the metrics. Nothing in the faulty worker's join says it is faulty:
//! the server finds out by itself.

use crate::util::{config, crowdgrad, get, join_as, server, status, wait_for, Proc};
use crowdgrad::worker::{WorkOptions, WorkerThread};
use crowdgrad_core::robust::Aggregation;
use crowdgrad_core::shard::Consistency;
use std::time::Duration;

/// A `crowdgrad work --json --threads 1 <args>` process ([`Proc`]: killed when dropped).
fn work(tag: &str, args: &[&str]) -> Proc {
    let mut c = crowdgrad();
    c.args(["work", "--json", "--threads", "1"]).args(args);
    Proc::spawn(c, &format!("faults-{tag}"))
}

/// Waits (bounded) for a worker process to exit: (succeeded, stdout, stderr).
async fn finish(mut w: Proc, within: Duration) -> (bool, String, String) {
    let Some(st) = w.exit_within(within).await else {
        panic!(
            "the worker did not exit within {within:?}; stderr: {}",
            w.stderr()
        );
    };
    (st.success(), w.stdout(), w.stderr())
}

/// The `--json` summary a worker printed.
fn summary(tag: &str, out: &str) -> serde_json::Value {
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{tag}: summary {out:?}: {e}"))
}

/// One real run in sync:4 with `aggregation`: 4 - `faulty` honest `crowdgrad work` processes
/// and `faulty` processes with `--fault signflip:10`, `steps` steps each. Returns the server's
/// final test accuracy (%).
async fn signflip_run(aggregation: Aggregation, faulty: usize, steps: u64) -> f64 {
    let mut cfg = config();
    cfg.training.consistency = Consistency::Sync { k: 4 };
    cfg.training.aggregation = aggregation;
    cfg.eval_every = Duration::from_millis(200);
    // Only the aggregation defends here: the norm bound would refuse about half the flipped
    // pushes (then each round waits for --sync-timeout). robust.rs has the same setting.
    cfg.training.exchange.norm_bound = 0.0;
    // No round cut short by the straggler timeout (robust.rs has the same, and why): a round
    // of one honest push and the flipped one is a mean whatever the rule. Rounds still close
    // when a process leaves.
    cfg.training.sync_timeout = 60.0;
    let running = server(cfg).await;
    let url = running.url();
    let n = steps.to_string();
    // Paced, so the run outlasts the faulty process's start (join, download, parse).
    let honest: Vec<Proc> = (0..4 - faulty)
        .map(|i| {
            let name = format!("volunteer-{i}");
            work(
                &format!("{aggregation}-{faulty}-h{i}"),
                &[
                    "--server",
                    &url,
                    "--steps",
                    &n,
                    "--step-delay-ms",
                    "20",
                    "--name",
                    &name,
                ],
            )
        })
        .collect();
    wait_for(&url, Duration::from_secs(60), "the honest workers", |s| {
        s["workers_connected"] == 4 - faulty as u64
    })
    .await;
    // The faulty ones join once the honest ones train, and stop 50 steps before them: a round
    // of fewer pushes than faults (a lone attacker) is applied as it is by any rule.
    let bad_steps = (steps - 50).to_string();
    let bad: Vec<Proc> = (0..faulty)
        .map(|i| {
            let name = format!("volunteer-{}", 4 - faulty + i);
            work(
                &format!("{aggregation}-{faulty}-f{i}"),
                &[
                    "--server",
                    &url,
                    "--steps",
                    &bad_steps,
                    "--step-delay-ms",
                    "20",
                    "--name",
                    &name,
                    "--fault",
                    "signflip:10",
                ],
            )
        })
        .collect();
    if faulty > 0 {
        // The dashboard shows four ordinary native volunteers: nothing names the faulty one.
        let s = wait_for(&url, Duration::from_secs(60), "all four workers", |s| {
            s["workers_connected"] == 4
        })
        .await;
        let workers = s["workers"].as_array().cloned().unwrap_or_default();
        assert!(
            workers.iter().all(|w| w["kind"] == workers[0]["kind"]),
            "{workers:?}"
        );
        assert!(
            !s["workers"].to_string().contains("fault"),
            "{}",
            s["workers"]
        );
    }
    for (i, b) in bad.into_iter().enumerate() {
        let (ok, out, err) = finish(b, Duration::from_secs(120)).await;
        assert!(ok, "faulty worker {i}: {err}");
        assert!(
            err.contains("WARNING: this is a FAULTY worker (--fault signflip:10)"),
            "{err}"
        );
        let s = summary("faulty", &out);
        assert_eq!(s["stats"]["steps"].as_u64(), Some(steps - 50), "{s}");
        assert!(s["stats"]["pushes_accepted"].as_u64() > Some(0), "{s}");
    }
    for (i, h) in honest.into_iter().enumerate() {
        let (ok, out, err) = finish(h, Duration::from_secs(120)).await;
        assert!(ok, "honest worker {i}: {err}");
        assert!(!err.contains("FAULTY"), "{err}");
        let s = summary("honest", &out);
        assert!(s["stats"]["pushes_accepted"].as_u64() > Some(0), "{s}");
    }
    // An evaluation of the final parameters.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let end = wait_for(&url, Duration::from_secs(10), "an evaluation", |s| {
        s["eval"]["accuracy"].as_f64().is_some()
    })
    .await;
    running.stop().await.expect("clean shutdown");
    end["eval"]["accuracy"].as_f64().unwrap_or(0.0) * 100.0
}

/// `crowdgrad work --fault signflip:10` among three honest `crowdgrad work` processes, sync:4:
/// the plain mean is wrecked, the coordinate-wise median stays within a few points of a clean
/// run of four honest processes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_fault_signflip_wrecks_the_mean_and_the_median_outvotes_it() {
    let steps = 250;
    let clean = signflip_run(Aggregation::Mean, 0, steps).await;
    let plain = signflip_run(Aggregation::Mean, 1, steps).await;
    let median = signflip_run(Aggregation::Median, 1, steps).await;
    println!(
        "real server, sync:4, 3 `crowdgrad work` + 1 `work --fault signflip:10`, {steps} steps each: clean mean {clean:.2}%, attacked mean {plain:.2}%, attacked median {median:.2}%"
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

/// `crowdgrad work --fault shuffled_labels` (real gradients of the wrong task, norms in range)
/// next to an honest worker, 10% of the rounds spot-checked: the faulty process is quarantined
/// and gives up (exit status non-zero, refused), its identity's rejoin gets 403, the status
/// and /metrics count one quarantined worker with a failed check; the honest one is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_fault_shuffled_labels_is_caught_by_spot_checks_and_quarantined() {
    const ID: &str = "faulty-shuffled-labels-01";
    let mut cfg = config();
    cfg.spot.fraction = 0.1;
    let running = server(cfg).await;
    let url = running.url();
    let mut o = WorkOptions::new(&url);
    o.steps = Some(100_000);
    o.duration = Some(Duration::from_secs(120));
    o.name = Some("honest".into());
    o.threads = 1;
    let h = WorkerThread::spawn(o);
    wait_for(&url, Duration::from_secs(60), "the honest worker", |s| {
        s["spot_checks"]["passed"].as_u64() >= Some(3)
    })
    .await;
    let bad = work(
        "shuffled",
        &[
            "--server",
            &url,
            "--id",
            ID,
            "--name",
            "volunteer",
            "--fault",
            "shuffled_labels",
        ],
    );
    let (ok, out, err) = finish(bad, Duration::from_secs(90)).await;
    assert!(!ok, "a quarantined worker gives up with an error: {err}");
    assert!(
        err.contains("WARNING: this is a FAULTY worker (--fault shuffled_labels)"),
        "{err}"
    );
    let sum = summary("shuffled", &out);
    assert_eq!(sum["refused"], true, "{sum}");
    assert!(sum["stats"]["pushes_accepted"].as_u64() > Some(0), "{sum}");
    let ids: Vec<u64> = sum["worker_ids"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_u64()).collect())
        .unwrap_or_default();
    let s = status(&url).await;
    assert_eq!(s["reputation"]["quarantined"], 1, "{}", s["reputation"]);
    let rep = &s["reputation"]["workers"][ids.first().expect("an id").to_string()];
    assert!(
        rep["quarantined"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("failed a spot check")),
        "{rep}"
    );
    assert!(rep["spot_failed"].as_u64() >= Some(1), "{rep}");
    let (_, metrics) = get(format!("{url}/metrics")).await;
    let metrics = String::from_utf8(metrics).expect("utf-8");
    assert!(
        metrics.contains("crowdgrad_workers_quarantined 1"),
        "{metrics}"
    );
    assert!(metrics.contains("crowdgrad_spot_checks_total{result=\"failed\"}"));
    let (code, body) = join_as(&url, ID).await;
    assert_eq!(code, 403, "{}", String::from_utf8_lossy(&body));
    // The honest worker trains on, never failed a check.
    let s = status(&url).await;
    let honest_id = s["workers"]
        .as_array()
        .and_then(|w| w.iter().find(|w| w["name"] == "honest"))
        .and_then(|w| w["id"].as_u64())
        .expect("the honest worker");
    let rep = &s["reputation"]["workers"][honest_id.to_string()];
    assert!(rep["quarantined"].is_null(), "{rep}");
    assert_eq!(rep["spot_failed"], 0, "{rep}");
    eprintln!(
        "work --fault shuffled_labels: quarantined after {} accepted pushes ({})",
        sum["stats"]["pushes_accepted"], sum["last_error"]
    );
    h.kill();
    running.stop().await.expect("stops");
}

/// A bad `--fault` is refused before the worker contacts anyone.
#[test]
fn work_refuses_an_unknown_fault() {
    let out = crowdgrad()
        .args([
            "work",
            "--server",
            "http://127.0.0.1:9",
            "--fault",
            "signflip:-3",
        ])
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown --fault \"signflip:-3\""), "{err}");
    assert!(!err.contains("WARNING"), "{err}");
}
