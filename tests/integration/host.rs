//! Issue 19, the server side of the page for its three people: the evaluation history with
//! wall-clock times that survives a restart (`/api/evals`, CSV with its `crowdgrad sim`
//! command), the ring of the run's figures (`/api/history`), the accuracy gauge, the
//! quarantine table, a teacher's demonstration on one worker and the next experiment from
//! fresh weights, and the strip of guesses. Real servers, real HTTP, real `crowdgrad work`
//! worker threads on real MNIST; every wait has a timeout.

use crate::util::{config, get, mnist_dir, scratch, server, status, wait_for};
use crowdgrad::checkpoint::CheckpointConfig;
use crowdgrad::worker::{WorkOptions, WorkerThread};
use serde_json::{json, Value};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const TOKEN: &str = "host-test-admin-token";

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64
}

/// An admin POST with the token (or none): status and JSON body.
async fn admin(base: &str, path: &str, token: Option<&str>, body: Value) -> (u16, Value) {
    let url = format!("{base}/api/admin/{path}");
    let token = token.map(str::to_string);
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .into();
        let mut rq = agent.post(&url).header("content-type", "application/json");
        if let Some(t) = &token {
            rq = rq.header("authorization", &format!("Bearer {t}"));
        }
        let mut r = rq.send(body.to_string().as_bytes()).expect("request");
        let code = r.status().as_u16();
        let text = r.body_mut().read_to_string().expect("body");
        (
            code,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    })
    .await
    .expect("join")
}

async fn get_json(url: String) -> (u16, Value) {
    let (code, body) = get(url).await;
    (code, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

async fn get_text(url: String) -> (u16, String) {
    let (code, body) = get(url).await;
    (code, String::from_utf8_lossy(&body).into_owned())
}

fn worker(url: &str, name: &str) -> WorkOptions {
    let mut o = WorkOptions::new(url);
    o.name = Some(name.into());
    o.duration = Some(Duration::from_secs(60));
    o
}

/// The id of the worker called `name` in the status.
fn worker_id(s: &Value, name: &str) -> Option<u64> {
    s["workers"]
        .as_array()?
        .iter()
        .find(|w| w["name"] == name)
        .and_then(|w| w["id"].as_u64())
}

fn points(evals: &Value, experiment: usize) -> Vec<Value> {
    evals["experiments"][experiment]["points"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// A metric's value in a `/metrics` body.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn history_has_wall_clock_points_survives_a_restart_and_the_gauge_matches() {
    let dir = scratch("host", "restart");
    let mut cfg = config();
    cfg.checkpoint = Some(CheckpointConfig {
        location: dir.display().to_string(),
        every: Duration::from_secs(3600),
        keep: 2,
        reshard: false,
    });
    let t0 = now_ms();
    let running = server(cfg.clone()).await;
    let url = running.url();
    let w = WorkerThread::spawn(worker(&url, "restart-a"));
    wait_for(&url, Duration::from_secs(30), "training to 80%", |s| {
        s["eval"]["accuracy"].as_f64() > Some(0.8)
    })
    .await;
    // At least two figures of the 5 s ring while the worker trains.
    let ring = {
        let start = std::time::Instant::now();
        loop {
            let (code, h) = get_json(format!("{url}/api/history")).await;
            assert_eq!(code, 200, "{h}");
            let pts = h["points"].as_array().cloned().unwrap_or_default();
            if pts.iter().any(|p| p["samples_per_s"].as_f64() > Some(0.0)) {
                break h;
            }
            assert!(
                start.elapsed() < Duration::from_secs(15),
                "no figure with samples/s after 15 s: {h}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    };
    assert_eq!(ring["interval_s"], 5);
    let fig = &ring["points"][0];
    for key in [
        "t_ms",
        "samples",
        "samples_per_s",
        "volunteers",
        "bytes_up_per_s",
        "bytes_down_per_s",
        "quarantined",
        "limit_refusals",
    ] {
        assert!(fig[key].is_number(), "{key} in {fig}");
    }
    assert!(fig["rejected"].is_object(), "{fig}");
    assert!(ring["points"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["bytes_up_per_s"].as_f64() > Some(0.0) && p["volunteers"] == 1));
    let newest = ring["points"].as_array().unwrap().last().unwrap()["t_ms"]
        .as_u64()
        .unwrap();
    let (_, later) = get_json(format!("{url}/api/history?since_ms={newest}")).await;
    assert_eq!(later["points"].as_array().map(Vec::len), Some(0), "{later}");
    let (code, csv) = get_text(format!("{url}/api/history.csv")).await;
    assert_eq!(code, 200);
    assert!(
        csv.starts_with("t_ms,samples,samples_per_s,volunteers,"),
        "{csv}"
    );
    for bad in ["since_ms=soon", "since_ms=-5", "since=1"] {
        let (code, body) = get_json(format!("{url}/api/history?{bad}")).await;
        assert_eq!(code, 400, "{bad}: {body}");
        assert!(body["error"].as_str().is_some_and(|e| !e.is_empty()));
    }
    w.stop().expect("summary");
    // The last evaluation of the trained weights is done (every 0.5 s while they move).
    tokio::time::sleep(Duration::from_millis(1500)).await;

    // The gauge is the newest evaluation, as /api/evals shows it.
    let (code, text) = get_text(format!("{url}/metrics")).await;
    assert_eq!(code, 200);
    let acc = metric(&text, "crowdgrad_test_accuracy").expect("the accuracy gauge");
    let loss = metric(&text, "crowdgrad_test_loss").expect("the loss gauge");
    assert!(acc > 0.8 && loss > 0.0, "{acc} {loss}");
    assert!(metric(&text, "crowdgrad_test_bits_per_token").is_none());
    let (code, evals) = get_json(format!("{url}/api/evals")).await;
    assert_eq!(code, 200);
    assert_eq!(evals["experiment"], 1);
    let before = points(&evals, 0);
    assert!(before.len() >= 3, "{evals}");
    let last = before.last().unwrap();
    assert_eq!(
        last["accuracy"].as_f64(),
        Some(acc),
        "gauge {acc} vs {last}"
    );
    assert_eq!(last["loss"].as_f64(), Some(loss), "gauge {loss} vs {last}");
    let t_end = now_ms();
    for p in &before {
        let t = p["t_ms"].as_u64().unwrap();
        assert!((t0..=t_end).contains(&t), "{t} not in [{t0}, {t_end}]");
    }
    assert!(before
        .windows(2)
        .all(|w| w[0]["t_ms"].as_u64() <= w[1]["t_ms"].as_u64()));
    assert!(before
        .windows(2)
        .all(|w| w[0]["samples"].as_u64() <= w[1]["samples"].as_u64()));
    assert!(last["samples"].as_u64() > Some(1000), "{last}");
    let e = &evals["experiments"][0];
    assert_eq!(e["settings"]["consistency"], "async");
    assert_eq!(e["settings"]["model"], "mlp:128");
    let sim = e["sim_command"].as_str().unwrap();
    assert!(
        sim.starts_with("crowdgrad sim ") && sim.contains("--consistency async"),
        "{sim}"
    );
    // The CSV: the sim command, the header, a line per point.
    let (code, csv) = get_text(format!("{url}/api/evals.csv?experiment=1")).await;
    assert_eq!(code, 200);
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines[0], format!("# sim: {sim}"));
    assert_eq!(lines[1], "t_ms,samples,accuracy,loss,bits_per_token");
    assert_eq!(lines.len(), 2 + before.len(), "{csv}");
    let (code, body) = get_json(format!("{url}/api/evals.csv?experiment=9")).await;
    assert_eq!(code, 404);
    assert!(body["error"].as_str().unwrap().contains("no experiment 9"));
    for bad in ["", "?experiment=one", "?id=1"] {
        let (code, _) = get_json(format!("{url}/api/evals.csv{bad}")).await;
        assert_eq!(code, 400, "{bad}");
    }
    running
        .stop()
        .await
        .expect("stops, writing the final checkpoint");

    // The same directory again: the history is back before anything else happens.
    let running = server(cfg).await;
    let url = running.url();
    let (_, again) = get_json(format!("{url}/api/evals")).await;
    let after = points(&again, 0);
    assert!(after.len() >= before.len(), "{again}");
    assert_eq!(
        &after[..before.len()],
        &before[..],
        "the points before the restart"
    );
    // New points carry the experiment's samples on: the counter restarted at 0.
    let w = WorkerThread::spawn(worker(&url, "restart-b"));
    let start = std::time::Instant::now();
    loop {
        let (_, x) = get_json(format!("{url}/api/evals")).await;
        let pts = points(&x, 0);
        if pts.len() > before.len() + 1
            && pts.last().unwrap()["samples"].as_u64() > last["samples"].as_u64()
        {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no new point: {x}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    w.stop().expect("summary");
    running.stop().await.expect("stops");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_demo_fault_is_refused_and_shown_and_only_quarantines_when_asked() {
    for strict in [false, true] {
        let mut cfg = config();
        cfg.admin_token = Some(crowdgrad::support::credential::Secret::new(TOKEN));
        if strict {
            cfg.spot.quarantine.rejections = 5;
            cfg.spot.quarantine.out_of_bounds = true;
        } else {
            // Refusals would quarantine, but out_of_bounds does not count by default.
            cfg.spot.quarantine.rejections = 5;
        }
        let running = server(cfg).await;
        let url = running.url();
        let name = format!("demo-{strict}");
        let mut o = worker(&url, &name);
        o.identity = Some(format!("demoidentity{strict}xyz"));
        let w = WorkerThread::spawn(o);
        let s = wait_for(&url, Duration::from_secs(20), "pushes applied", |s| {
            s["totals"]["pushes_applied"].as_u64() > Some(100)
        })
        .await;
        let id = worker_id(&s, &name).expect("the worker in the status");
        // Bad inputs: refused with a reason, nothing on.
        for (token, body, code) in [
            (None, json!({"worker": id, "fault": "scale:1000"}), 401),
            (Some(TOKEN), json!({"worker": id, "delay_ms": 10_001}), 400),
            (Some(TOKEN), json!({"worker": id, "fault": "bogus"}), 400),
            (
                Some(TOKEN),
                json!({"worker": id, "fault": "shuffled_labels"}),
                400,
            ),
            (Some(TOKEN), json!({"worker": "seven", "fault": "nan"}), 400),
            (Some(TOKEN), json!({"worker": id, "speed": 3}), 400),
            (Some(TOKEN), json!({"worker": 999_999, "fault": "nan"}), 404),
        ] {
            let (got, reply) = admin(&url, "demo", token, body.clone()).await;
            assert_eq!(got, code, "{body}: {reply}");
            assert!(
                reply["error"].as_str().is_some_and(|e| !e.is_empty()),
                "{reply}"
            );
        }
        assert_eq!(status(&url).await["demo"], json!([]));
        let before = status(&url).await["totals"]["rejected_by_reason"]["out_of_bounds"]
            .as_u64()
            .unwrap_or(0);
        // A thousandfold gradient from this worker: the norm bound refuses it.
        let (code, reply) = admin(
            &url,
            "demo",
            Some(TOKEN),
            json!({"worker": id, "fault": "scale:1000"}),
        )
        .await;
        assert_eq!(code, 200, "{reply}");
        assert_eq!(
            reply["demo"],
            json!([{"worker": id, "delay_ms": null, "fault": "scale:1000"}])
        );
        let s = status(&url).await;
        assert_eq!(s["demo"][0]["worker"], id, "the status shows it while on");
        let s = wait_for(&url, Duration::from_secs(20), "the fault refused", |s| {
            s["totals"]["rejected_by_reason"]["out_of_bounds"].as_u64() >= Some(before + 5)
                || s["reputation"]["quarantined"].as_u64() > Some(0)
        })
        .await;
        if strict {
            let s = wait_for(&url, Duration::from_secs(10), "the quarantine", |s| {
                s["quarantines"].as_array().is_some_and(|q| !q.is_empty())
            })
            .await;
            let q = &s["quarantines"][0];
            assert_eq!(q["worker"], id, "{q}");
            // The start of the identity's public id (issue 21), never of the identity.
            let public =
                crowdgrad::registry::ledger::public_id(&format!("demoidentity{strict}xyz"));
            assert_eq!(q["identity_short"], public[..8]);
            assert!(
                q["reason"].as_str().unwrap().contains("out_of_bounds"),
                "{q}"
            );
            let at = q["at_ms"].as_u64().unwrap();
            assert!(at <= now_ms() && at + 60_000 > now_ms(), "{at}");
            let (_, page) = get_json(format!("{url}/api/workers")).await;
            assert_eq!(page["quarantines"], s["quarantines"]);
        } else {
            // Refused, counted, and never quarantined.
            tokio::time::sleep(Duration::from_secs(1)).await;
            let s2 = status(&url).await;
            assert_eq!(s2["reputation"]["quarantined"], 0, "{}", s2["reputation"]);
            assert_eq!(s2["quarantines"], json!([]));
            assert!(
                s["reputation"]["workers"][id.to_string()]["rejections"]["out_of_bounds"].as_u64()
                    > Some(0)
            );
            // Off again: the worker's pushes are applied as before.
            let (code, reply) = admin(
                &url,
                "demo",
                Some(TOKEN),
                json!({"worker": id, "delay_ms": null, "fault": null}),
            )
            .await;
            assert_eq!((code, &reply["demo"]), (200, &json!([])), "{reply}");
            let applied = status(&url).await["totals"]["pushes_applied"]
                .as_u64()
                .unwrap();
            wait_for(&url, Duration::from_secs(10), "pushes applied again", |s| {
                s["totals"]["pushes_applied"].as_u64() > Some(applied + 50)
            })
            .await;
        }
        let _ = w.stop();
        running.stop().await.expect("stops");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_demo_delay_makes_one_worker_stale_and_slow() {
    let mut cfg = config();
    cfg.admin_token = Some(crowdgrad::support::credential::Secret::new(TOKEN));
    let running = server(cfg).await;
    let url = running.url();
    let slow = WorkerThread::spawn(worker(&url, "slow"));
    let fast = WorkerThread::spawn(worker(&url, "fast"));
    let s = wait_for(&url, Duration::from_secs(20), "both training", |s| {
        ["slow", "fast"].iter().all(|n| {
            s["workers"].as_array().is_some_and(|ws| {
                ws.iter()
                    .any(|w| w["name"] == *n && w["pushes_applied"].as_u64() > Some(20))
            })
        })
    })
    .await;
    let id = worker_id(&s, "slow").unwrap();
    let (code, reply) = admin(
        &url,
        "demo",
        Some(TOKEN),
        json!({"worker": id, "delay_ms": 400}),
    )
    .await;
    assert_eq!(code, 200, "{reply}");
    let applied = |s: &Value, n: &str| -> u64 {
        s["workers"]
            .as_array()
            .and_then(|ws| ws.iter().find(|w| w["name"] == n))
            .and_then(|w| w["pushes_applied"].as_u64())
            .unwrap_or(0)
    };
    // The slow worker's pushes staler than 15 versions (the histogram's last bucket).
    let stale16 = |s: &Value| -> u64 {
        s["workers"]
            .as_array()
            .and_then(|ws| ws.iter().find(|w| w["name"] == "slow"))
            .and_then(|w| w["staleness_hist"][16].as_u64())
            .unwrap_or(0)
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let a = status(&url).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let b = status(&url).await;
    let slow_n = applied(&b, "slow") - applied(&a, "slow");
    let fast_n = applied(&b, "fast") - applied(&a, "fast");
    // 400 ms per push: at most ~8 rounds of 2 shards in 3 s.
    assert!(
        slow_n <= 20,
        "the delayed worker applied {slow_n} pushes in 3 s"
    );
    assert!(fast_n > 5 * slow_n.max(1), "fast {fast_n} vs slow {slow_n}");
    // While it is held, the fast worker moves the shards on by hundreds of versions.
    let stale = stale16(&b) - stale16(&a);
    assert!(
        slow_n > 0 && stale * 10 >= slow_n * 8,
        "{stale} of the {slow_n} held pushes were applied more than 15 versions stale"
    );
    // Off again: the worker is as fast as before.
    let (code, _) = admin(&url, "demo", Some(TOKEN), json!({"worker": id})).await;
    assert_eq!(code, 200);
    let c = status(&url).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let d = status(&url).await;
    let again = applied(&d, "slow") - applied(&c, "slow");
    assert!(
        again > 5 * slow_n.max(1),
        "{again} pushes in 2 s after the delay ended"
    );
    let _ = slow.stop();
    let _ = fast.stop();
    running.stop().await.expect("stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_experiment_starts_from_fresh_weights_and_replays_in_the_simulator() {
    let mut cfg = config();
    cfg.admin_token = Some(crowdgrad::support::credential::Secret::new(TOKEN));
    let seed = cfg.training.seed;
    let running = server(cfg).await;
    let url = running.url();
    let w = WorkerThread::spawn(worker(&url, "first"));
    wait_for(&url, Duration::from_secs(30), "training to 80%", |s| {
        s["eval"]["accuracy"].as_f64() > Some(0.8)
    })
    .await;
    w.stop().expect("summary");
    let params = || async {
        let (code, body) = get(format!("{url}/api/params")).await;
        assert_eq!(code, 200);
        body.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect::<Vec<f32>>()
    };
    let trained = params().await;
    // Refused, and nothing changes.
    for (body, code) in [
        (json!({"lr": 0.1}), 400),
        (json!({"label": "x", "lr": -1}), 400),
        (json!({"label": "x", "consistency": "sometimes"}), 400),
        (json!({"label": "x", "seed": 1}), 400),
        (json!({"label": "x", "consistency": "sync:4"}), 409),
        (json!({"label": "x", "aggregation": "median"}), 409),
    ] {
        let (got, reply) = admin(&url, "experiment", Some(TOKEN), body.clone()).await;
        assert_eq!(got, code, "{body}: {reply}");
    }
    let (got, _) = admin(&url, "experiment", None, json!({"label": "x"})).await;
    assert_eq!(got, 401);
    assert_eq!(params().await, trained);
    assert_eq!(
        get_json(format!("{url}/api/evals")).await.1["experiment"],
        1
    );

    let (code, reply) = admin(
        &url,
        "experiment",
        Some(TOKEN),
        json!({"label": "ssp at a lower rate", "consistency": "ssp:2", "lr": 0.02}),
    )
    .await;
    assert_eq!(code, 200, "{reply}");
    assert_eq!(reply["experiment"]["id"], 2);
    assert_eq!(reply["experiment"]["settings"]["consistency"], "ssp:2");
    assert_eq!(reply["experiment"]["settings"]["seed"], seed + 1);
    // The run's initialisation with the next seed, exactly.
    let spec = crowdgrad_core::model::ModelSpec::parse("mlp:128", 784, 10).unwrap();
    let model = crowdgrad_core::model::Model::new(spec).unwrap();
    let fresh = params().await;
    assert_eq!(fresh, model.init_params(seed + 1));
    assert_ne!(fresh, trained);
    assert_eq!(status(&url).await["consistency"], "ssp:2");
    // Its first evaluation is the untrained model's, at 0 samples; experiment 1 stays.
    let start = std::time::Instant::now();
    let evals = loop {
        let (_, x) = get_json(format!("{url}/api/evals")).await;
        if !points(&x, 1).is_empty() {
            break x;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{x}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(evals["experiment"], 2);
    assert_eq!(evals["experiments"].as_array().unwrap().len(), 2);
    assert!(points(&evals, 0).last().unwrap()["accuracy"].as_f64() > Some(0.8));
    let p = &points(&evals, 1)[0];
    assert_eq!(p["samples"], 0, "{p}");
    assert!(
        p["accuracy"].as_f64() < Some(0.3),
        "fresh weights guess: {p}"
    );
    // The export replays with the printed command (a short budget, in a scratch dir).
    let (_, csv) = get_text(format!("{url}/api/evals.csv?experiment=2")).await;
    let sim = csv
        .lines()
        .next()
        .unwrap()
        .strip_prefix("# sim: ")
        .unwrap()
        .to_string();
    assert!(
        sim.contains("--consistency ssp:2") && sim.contains("--lr 0.02"),
        "{sim}"
    );
    let out = scratch("host", "sim");
    let mut args: Vec<String> = sim.split_whitespace().skip(2).map(String::from).collect();
    let i = args.iter().position(|a| a == "--out").unwrap();
    args[i + 1] = out.display().to_string();
    let i = args.iter().position(|a| a == "--samples").unwrap();
    args[i + 1] = "2000".into();
    args.push("--quiet".into());
    let ran = crate::util::crowdgrad()
        .arg("sim")
        .args(&args)
        .output()
        .expect("runs the sim");
    assert!(
        ran.status.success(),
        "{sim}: {}",
        String::from_utf8_lossy(&ran.stderr)
    );
    assert!(out.join("run.csv").is_file());
    let _ = std::fs::remove_dir_all(&out);
    let _ = mnist_dir();
    running.stop().await.expect("stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn guesses_are_sixteen_test_images_shared_by_every_viewer() {
    let running = server(config()).await;
    let url = running.url();
    let (code, a) = get(format!("{url}/api/guesses")).await;
    assert_eq!(code, 200);
    let (_, b) = get(format!("{url}/api/guesses")).await;
    assert_eq!(a, b, "within 3 s every viewer gets the same body");
    let g: Value = serde_json::from_slice(&a).unwrap();
    let images = g["images"].as_array().unwrap();
    assert_eq!(images.len(), 16);
    let mut labels = std::collections::BTreeSet::new();
    for im in images {
        assert_eq!(
            (im["width"].as_u64(), im["height"].as_u64()),
            (Some(28), Some(28))
        );
        // 784 bytes are 1,048 base64 characters (no padding).
        assert_eq!(im["pixels"].as_str().unwrap().len(), 1048, "{im}");
        let c = im["confidence"].as_f64().unwrap();
        assert!(c > 0.0 && c <= 1.0, "{c}");
        assert!(im["guess"].as_u64().unwrap() < 10);
        labels.insert(im["label"].as_u64().unwrap());
    }
    assert!(labels.len() > 3, "spread over the test set: {labels:?}");
    assert!(g["version"].is_u64());
    running.stop().await.expect("stops");
}
