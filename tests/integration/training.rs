//! Training end to end on real MNIST with native workers over real WebSockets.

use crate::util::{config, get, server, status, wait_for, Proc};
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

/// Issue 20 (`--ema`): the shards keep a moving average of the weights. `/api/params` and the
/// evaluations are of it, `?weights=live` is what the workers train, the status states the
/// decay, and a bad query is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_with_ema_evaluates_and_exports_the_weights_average() {
    let mut cfg = config();
    cfg.training.ema = Some(0.9);
    let running = server(cfg).await;
    let url = running.url();
    assert_eq!(status(&url).await["ema"].as_f64(), Some(0.9));
    let params = |q: &'static str| {
        let url = url.clone();
        async move {
            let (code, body) = get(format!("{url}/api/params{q}")).await;
            assert_eq!(code, 200, "{q}: {}", String::from_utf8_lossy(&body));
            body.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect::<Vec<f32>>()
        }
    };
    assert_eq!(
        params("").await,
        params("?weights=live").await,
        "no update yet"
    );
    let mut o = WorkOptions::new(&url);
    o.steps = Some(150);
    tokio::task::spawn_blocking(move || WorkerThread::spawn(o).join())
        .await
        .expect("join")
        .expect("worker");
    let done = wait_for(&url, Duration::from_secs(30), "the last evaluation", |s| {
        s["eval"]["step"] == 150
    })
    .await;
    let (average, live) = (params("").await, params("?weights=live&format=f32").await);
    assert_eq!(average.len(), live.len());
    assert_ne!(average, live, "the average lags the live weights");
    let join = crate::util::join(&url).await;
    let model = crowdgrad_core::model::Model::new(join.run.model).expect("model");
    let test = &crate::util::mnist().test;
    let loss = |p: &[f32]| crowdgrad_core::eval::evaluate(&model, p, test).mean_loss();
    let shown = done["eval"]["loss"].as_f64().unwrap_or(f64::NAN);
    let (of_average, of_live) = (loss(&average), loss(&live));
    eprintln!("ema 0.9, 150 steps: test loss shown {shown}, of the average {of_average}, of the live weights {of_live}");
    assert!((shown - of_average).abs() < 1e-6, "{shown} vs {of_average}");
    assert!((shown - of_live).abs() > 1e-4, "{shown} vs {of_live}");
    for bad in ["?weights=average", "?format=f32&weights=", "?live"] {
        assert_eq!(get(format!("{url}/api/params{bad}")).await.0, 400, "{bad}");
    }
    running.stop().await.expect("clean shutdown");
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

/// A real `crowdgrad work` process (`tag` in the logs, identity `id`) trains 500 steps on
/// the server at `base` and exits cleanly.
async fn work_500_steps(base: &str, tag: &str, id: &str) {
    let mut work = Proc::crowdgrad(
        tag,
        &[
            "work",
            "--server",
            base,
            "--steps",
            "500",
            "--threads",
            "1",
            "--quiet",
            "--json",
            "--id",
            id,
        ],
    );
    let exit = work
        .exit_within(Duration::from_secs(600))
        .await
        .expect("the worker finishes its 500 steps");
    assert!(exit.success(), "{exit:?}: {}", work.stderr());
}

/// Issue 20: a real `crowdgrad serve` with AdamW, a linear warmup and a cosine decay (the
/// flags) trains a real `crowdgrad work` on MNIST; the status states the schedule, and the
/// rate it shows is the warmup's first step at the start and the floor once the decay is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_with_adamw_and_a_cosine_schedule_trains_a_real_worker() {
    crate::util::mnist();
    let data = crate::util::mnist_dir();
    // 500 steps of 32 = 16,000 samples: the decay ends with the worker's last push.
    let mut c = crate::util::crowdgrad();
    c.args([
        "serve",
        "--addr",
        "127.0.0.1:0",
        "--no-fetch",
        "--data-dir",
        data.to_str().expect("utf-8 path"),
        "--eval-every",
        "0.5",
        "--optimizer",
        "adamw",
        "--lr",
        "0.002",
        "--lr-warmup",
        "1600",
        "--lr-decay",
        "cosine",
        "--lr-decay-samples",
        "16000",
        "--clip-norm",
        "1.0",
        // Gradient pushes: the shards' AdamW follows the schedule (the test below has serve's
        // default, `auto` local steps, where the workers' inner optimizer does).
        "--local-steps",
        "1",
    ])
    .env("RUST_LOG", "info");
    let mut serve = Proc::spawn(c, "schedule-serve");
    let base = serve
        .listening(Duration::from_secs(60))
        .replace("ws://", "http://");
    let s = status(&base).await;
    let o = &s["optimizer"];
    assert_eq!(o["rule"]["kind"], "adamw", "{o}");
    assert_eq!(o["rule"]["beta2"].as_f64(), Some(0.95), "{o}");
    assert_eq!(o["weight_decay"].as_f64(), Some(0.1), "{o}");
    assert_eq!(o["clip_norm"].as_f64(), Some(1.0), "{o}");
    let sched = &o["schedule"];
    assert_eq!(sched["decay"], "cosine", "{o}");
    assert_eq!(sched["warmup"], 1600, "{o}");
    assert_eq!(sched["decay_samples"], 16000, "{o}");
    assert_eq!(sched["samples_per_version"], 32, "{o}");
    let lr0 = s["lr_now"].as_f64().unwrap_or(f64::NAN);
    assert!(
        (lr0 - 0.002 * 32.0 / 1600.0).abs() < 1e-7,
        "first warmup step: {lr0}"
    );
    work_500_steps(&base, "schedule-work", "schedule-test-volunteer").await;
    let done = wait_for(
        &base,
        Duration::from_secs(30),
        "an evaluation of the last version",
        |s| s["eval"]["step"].as_u64() >= Some(500),
    )
    .await;
    let acc = done["eval"]["accuracy"].as_f64().unwrap_or(0.0);
    let lr = done["lr_now"].as_f64().unwrap_or(f64::NAN);
    eprintln!("adamw lr 0.002, warmup 1600, cosine to 16000 samples: test accuracy {acc:.4}, lr now {lr:e}");
    assert!(acc >= 0.9, "test accuracy {acc} after 500 steps");
    assert!(
        (lr - 0.0002).abs() < 1e-7,
        "the floor, 10% of the peak: {lr}"
    );
    for shard in done["shards"].as_array().expect("shards") {
        assert_eq!(shard["version"], 500, "{shard}");
    }
    serve.terminate();
    let _ = serve.exit_within(Duration::from_secs(10)).await;
}

/// Issue 20: serve's default `auto` local steps with a warmup and a cosine decay. The
/// workers' inner AdamW follows the schedule by the samples the shards applied (stated in
/// every Params), the spot checker (on by default: every push of a new worker checked)
/// recomputes each round at the same factor, and the rate the status shows reaches the floor
/// once the shards applied the decay's samples.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_with_auto_local_steps_follows_a_schedule_by_samples() {
    crate::util::mnist();
    let data = crate::util::mnist_dir();
    let mut serve = Proc::crowdgrad(
        "auto-schedule-serve",
        &[
            "serve",
            "--addr",
            "127.0.0.1:0",
            "--no-fetch",
            "--data-dir",
            data.to_str().expect("utf-8 path"),
            "--eval-every",
            "0.5",
            "--inner-optimizer",
            "adamw",
            "--inner-lr",
            "0.002",
            "--lr-warmup",
            "1600",
            "--lr-decay",
            "cosine",
            "--lr-decay-samples",
            "12800",
        ],
    );
    let base = serve
        .listening(Duration::from_secs(60))
        .replace("ws://", "http://");
    let s = status(&base).await;
    let sched = &s["local"]["inner"]["schedule"];
    assert_eq!(sched["counted"], true, "{s}");
    assert_eq!(s["lr_now"].as_f64(), Some(0.0), "no sample applied yet");
    // 500 steps of 32: 16,000 samples, past the decay's end at 12,800.
    work_500_steps(&base, "auto-schedule-work", "auto-schedule-volunteer").await;
    let done = wait_for(&base, Duration::from_secs(30), "the last samples", |s| {
        s["shards"].as_array().is_some_and(|a| {
            a.iter()
                .all(|sh| sh["samples_applied"].as_u64() >= Some(12_800))
        })
    })
    .await;
    let lr = done["lr_now"].as_f64().unwrap_or(f64::NAN);
    let acc = done["eval"]["accuracy"].as_f64().unwrap_or(0.0);
    eprintln!(
        "auto local steps, inner adamw 0.002, warmup 1600, cosine to 12800 samples: \
         test accuracy {acc:.4}, lr now {lr:e}, shards {}",
        done["shards"]
    );
    assert!(
        (lr - 0.0002).abs() < 1e-7,
        "the floor, 10% of the peak: {lr}"
    );
    assert_eq!(done["spot_checks"]["failed"], 0, "{}", done["spot_checks"]);
    assert!(
        done["spot_checks"]["passed"].as_u64() >= Some(4),
        "the probation checks ran: {}",
        done["spot_checks"]
    );
    assert_eq!(done["reputation"]["quarantined"], 0);
    let wait = wait_for(&base, Duration::from_secs(30), "an evaluation", |s| {
        s["eval"]["accuracy"].as_f64() >= Some(0.9)
    })
    .await;
    assert!(wait["eval"]["accuracy"].as_f64() >= Some(0.9));
    serve.terminate();
    let _ = serve.exit_within(Duration::from_secs(10)).await;
}
