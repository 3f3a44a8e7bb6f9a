//! Operations: `/metrics` (parses, counters rise), `/healthz` and `/readyz`, the TOML run file
//! (the example runs, flags override it, bad files are refused naming the key) and JSON logs.
//! The run-file tests spawn the real `crowdgrad` binary.

use crate::util::{self, Proc};
use crowdgrad::worker::{WorkOptions, WorkerThread};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Parses an OpenMetrics text body into `name{labels}` → value; panics on a malformed line.
pub fn parse_metrics(text: &str) -> HashMap<String, f64> {
    assert!(text.trim_end().ends_with("# EOF"), "no # EOF:\n{text}");
    let mut out = HashMap::new();
    for line in text.lines() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("`series value`");
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("bad value in {line:?}"));
        let name_end = series.find('{').unwrap_or(series.len());
        let name = &series[..name_end];
        assert!(
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name in {line:?}"
        );
        if name_end < series.len() {
            assert!(series.ends_with('}'), "unclosed labels in {line:?}");
        }
        out.insert(series.to_string(), value);
    }
    out
}

async fn scrape(base: &str) -> HashMap<String, f64> {
    let (code, body) = util::get(format!("{base}/metrics")).await;
    assert_eq!(code, 200);
    parse_metrics(&String::from_utf8(body).expect("utf-8"))
}

fn sum(m: &HashMap<String, f64>, name: &str) -> f64 {
    m.iter()
        .filter(|(k, _)| k.split('{').next() == Some(name))
        .map(|(_, v)| v)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_and_counters_rise_health_and_ready() {
    let running = util::server(util::config()).await;
    let base = running.url();
    let (code, body) = util::get(format!("{base}/healthz")).await;
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    let (code, body) = util::get(format!("{base}/readyz")).await;
    assert_eq!(code, 200);
    let ready: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(ready["ready"], true);
    assert_eq!(ready["shards"].as_array().unwrap().len(), 2);

    let before = scrape(&base).await;
    for name in [
        "crowdgrad_pushes_applied_total",
        "crowdgrad_pulls_total",
        "crowdgrad_push_staleness_count",
        "crowdgrad_apply_seconds_count",
        "crowdgrad_workers_connected",
        "crowdgrad_samples_total",
        "crowdgrad_samples_per_second",
        "crowdgrad_bytes_received_total",
        "crowdgrad_uptime_seconds",
    ] {
        assert!(
            before.keys().any(|k| k.split('{').next() == Some(name)),
            "{name} missing"
        );
    }
    assert_eq!(sum(&before, "crowdgrad_pushes_applied_total"), 0.0);

    let mut o = WorkOptions::new(&base);
    o.steps = Some(150);
    let w = WorkerThread::spawn(o);
    let t0 = Instant::now();
    loop {
        let m = scrape(&base).await;
        if sum(&m, "crowdgrad_pushes_applied_total") >= 200.0 {
            assert!(m["crowdgrad_workers_connected{kind=\"native\"}"] >= 0.0);
            assert!(sum(&m, "crowdgrad_samples_total") > 0.0);
            assert!(sum(&m, "crowdgrad_apply_seconds_count") >= 200.0);
            assert!(sum(&m, "crowdgrad_push_staleness_count") >= 200.0);
            assert!(
                sum(&m, "crowdgrad_bytes_sent_total") > sum(&before, "crowdgrad_bytes_sent_total")
            );
            assert!(sum(&m, "crowdgrad_bytes_received_total") > 100_000.0);
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "pushes never rose");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = tokio::task::spawn_blocking(move || w.join()).await;
    // The run's main curve for Grafana: the evaluator's last accuracy and loss, the same as
    // /api/status shows once the evaluations have caught up with the stopped worker.
    let t0 = Instant::now();
    loop {
        let m = scrape(&base).await;
        let status = util::status(&base).await;
        if let (Some(acc), Some(loss), Some(eval)) = (
            m.get("crowdgrad_test_accuracy"),
            m.get("crowdgrad_test_loss"),
            status["eval"].as_object(),
        ) {
            if *acc > 0.3 && eval["accuracy"].as_f64() == Some(*acc) {
                assert!(*loss > 0.0 && loss.is_finite(), "loss {loss}");
                break;
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no test accuracy gauge matching the status: {:?}, status eval {}",
            m.get("crowdgrad_test_accuracy"),
            status["eval"]
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    running.stop().await.unwrap();
}

/// Spawns `crowdgrad <args>` (with `RUST_LOG=info`) and waits (at most 60 s) for its
/// `... listening on URL` line; returns it and its HTTP base URL.
fn spawn_listening(args: &[String]) -> (Proc, String) {
    let mut c = util::crowdgrad();
    c.args(args).env("RUST_LOG", "info");
    let mut serve = Proc::spawn(c, "ops-serve");
    let base = serve
        .listening(Duration::from_secs(60))
        .replace("ws://", "http://");
    (serve, base)
}

fn strings(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_run_file_runs_flags_override_it_and_logs_are_json() {
    let data = util::mnist_dir();
    util::mnist();
    let (serve, base) = spawn_listening(&strings(&[
        "--log-format",
        "json",
        "serve",
        "--config",
        "docs/run.example.toml",
        "--addr",
        "127.0.0.1:0",
        "--batch-size",
        "16",
        "--data-dir",
        data.to_str().unwrap(),
    ]));
    let s = util::status(&base).await;
    assert_eq!(s["batch_size"], 16, "the flag wins over the file's 32");
    let cfg = &s["config"];
    assert_eq!(cfg["training"]["batch_size"], 16);
    assert_eq!(cfg["training"]["model"], "mlp:128", "from the file");
    assert_eq!(cfg["limits"]["max_workers"], 10000);
    // It trains.
    let mut o = WorkOptions::new(&base);
    o.steps = Some(300);
    let summary = tokio::task::spawn_blocking(move || WorkerThread::spawn(o).join())
        .await
        .unwrap()
        .expect("worker ran");
    assert_eq!(summary.stats.steps, 300);
    util::wait_for(&base, Duration::from_secs(30), "an evaluation", |s| {
        s["eval"]["accuracy"].as_f64().unwrap_or(0.0) > 0.5
    })
    .await;
    // Every log line so far is one JSON object.
    let lines = serve.stderr_lines();
    assert!(!lines.is_empty(), "no log lines");
    for l in &lines {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        assert!(v.get("level").is_some() && v.get("fields").is_some(), "{l}");
    }
}

fn refused(file_text: &str, flags: &[&str]) -> String {
    let dir = std::env::temp_dir().join(format!("crowdgrad-ops-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(format!("run-{}.toml", file_text.len()));
    std::fs::write(&file, file_text).unwrap();
    let out = util::crowdgrad()
        .args([
            "serve",
            "--config",
            file.to_str().unwrap(),
            "--addr",
            "127.0.0.1:0",
        ])
        .args(flags)
        .output()
        .expect("run crowdgrad");
    assert!(!out.status.success(), "{file_text:?} was accepted");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn bad_run_files_are_refused_naming_the_key() {
    let e = refused("[training]\nbatchsize = 3\n", &[]);
    assert!(e.contains("unknown key training.batchsize"), "{e}");
    let e = refused("[limits]\nmax_workers = \"many\"\n", &[]);
    assert!(e.contains("limits.max_workers"), "{e}");
    let e = refused("[training]\nbatch_size = 0\n", &[]);
    assert!(e.contains("training.batch_size"), "{e}");
    let e = refused("[training]\noptimizer = \"sgd\"\nmomentum = 0.9\n", &[]);
    assert!(e.contains("training.momentum"), "bad combination: {e}");
    // A bad flag over a good file is refused too, as a flag.
    let e = refused("[training]\nbatch_size = 8\n", &["--batch-size", "0"]);
    assert!(
        e.contains("--batch-size") && !e.contains("training.batch_size"),
        "{e}"
    );
}

/// `crowdgrad ctl ... set-consistency MODE`: (exit success, stdout, stderr).
fn ctl_set_consistency(base: &str, token: &str, mode: &str) -> (bool, String, String) {
    let out = util::crowdgrad()
        .args([
            "ctl",
            "--server",
            base,
            "--token",
            token,
            "set-consistency",
            mode,
        ])
        .output()
        .expect("run crowdgrad ctl");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn total_version(s: &serde_json::Value) -> u64 {
    s["shards"]
        .as_array()
        .map_or(0, |a| a.iter().filter_map(|x| x["version"].as_u64()).sum())
}

/// Issue 9: `ctl set-consistency` switches a running server's mode where that is safe
/// (sync:2 -> sync:4 -> ssp:3 -> async, with the workers that joined under sync training on
/// through every switch), new joins get the new mode, and an unsafe change (async -> sync:2)
/// or a bad mode is refused with the reason while the mode stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_consistency_switches_safe_modes_at_runtime() {
    const TOKEN: &str = "ops-admin-token-consistency-0";
    let mut cfg = util::config();
    cfg.training.consistency = crowdgrad_core::shard::Consistency::Sync { k: 2 };
    cfg.admin_token = Some(crowdgrad::support::credential::Secret::new(TOKEN));
    let running = util::server(cfg).await;
    let base = running.url();
    let workers: Vec<WorkerThread> = (0..2)
        .map(|i| {
            let mut o = WorkOptions::new(&base);
            o.name = Some(format!("mode-{i}"));
            WorkerThread::spawn(o)
        })
        .collect();
    // Both workers in, and a round of both applied under sync:2: a worker that joins late
    // (a loaded machine) trains alone at first, and its rounds merge 1 push (rule 1).
    util::wait_for(
        &base,
        Duration::from_secs(60),
        "sync training of both",
        |s| {
            s["workers_connected"] == 2
                && s["shards"][0]["updates_by_merged"]["2"].as_u64() > Some(0)
                && total_version(s) > 40
        },
    )
    .await;
    for (mode, shown) in [("sync:4", "sync:4"), ("ssp:3", "ssp:3"), ("async", "async")] {
        let b = base.clone();
        let (ok, out, err) =
            tokio::task::spawn_blocking(move || ctl_set_consistency(&b, TOKEN, mode))
                .await
                .unwrap();
        assert!(ok, "{mode}: {out} {err}");
        assert!(out.contains(shown), "{mode}: {out}");
        let s = util::status(&base).await;
        assert_eq!(s["consistency"], shown);
        // The workers that joined under sync:2 keep training under the new mode.
        let v = total_version(&s);
        util::wait_for(&base, Duration::from_secs(30), "training on", |s| {
            total_version(s) > v + 40
        })
        .await;
    }
    let joined = util::join(&base).await;
    assert_eq!(
        joined.run.consistency,
        crowdgrad_core::shard::Consistency::Async,
        "a new worker learns the mode in its join"
    );
    // Unsafe: back to sync from async. Refused with the reason; the mode stays.
    let b = base.clone();
    let (ok, _, err) =
        tokio::task::spawn_blocking(move || ctl_set_consistency(&b, TOKEN, "sync:2"))
            .await
            .unwrap();
    assert!(!ok);
    assert!(
        err.contains("409") && err.contains("pull the current version"),
        "{err}"
    );
    let b = base.clone();
    let (ok, _, err) = tokio::task::spawn_blocking(move || ctl_set_consistency(&b, TOKEN, "fast"))
        .await
        .unwrap();
    assert!(!ok && err.contains("400"), "{err}");
    let s = util::status(&base).await;
    assert_eq!(s["consistency"], "async");
    // Updates of every mode were applied (merged counts of 1 under async/ssp and flushes,
    // 2 and 4 under sync).
    let merged = &s["shards"][0]["updates_by_merged"];
    assert!(merged["1"].as_u64() > Some(0), "{merged}");
    assert!(merged["2"].as_u64() > Some(0), "{merged}");
    for w in workers {
        let _ = tokio::task::spawn_blocking(move || w.stop()).await;
    }
    running.stop().await.unwrap();
}
