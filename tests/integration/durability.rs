//! Issue 9: checkpoints, resume, export, the admin API and the contribution ledger, with the
//! real `crowdgrad` binary as a child process (killed with SIGKILL where a crash is the
//! point), real MNIST, real files, a real S3-compatible server (moto) and Python's
//! `safetensors` + numpy, installed by the test itself in a venv under target/.

use crate::util::{crowdgrad as crowdgrad_cmd, get, mnist_dir, root, target_dir, wait_for, Proc};
use crowdgrad::checkpoint::format::Checkpoint;
use crowdgrad::worker::{WorkOptions, WorkerThread};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A fresh scratch directory ([`crate::util::scratch`]).
fn scratch(name: &str) -> PathBuf {
    crate::util::scratch("durability", name)
}

/// The admin token the checkpointing servers here are started with.
const ADMIN_TOKEN: &str = "durability-admin-token-0123456789";

/// A fresh scratch directory, its `checkpoints` directory and that as a `--checkpoint-dir`.
fn checkpoint_dir(name: &str) -> (PathBuf, PathBuf, String) {
    let dir = scratch(name);
    let ckdir = dir.join("checkpoints");
    let ck = ckdir.to_str().expect("utf-8 path").to_string();
    (dir, ckdir, ck)
}

/// A `crowdgrad serve` process ([`Proc`]: killed when dropped) and the URL it listens on.
struct Server {
    proc: Proc,
    url: String,
}

impl Server {
    /// Starts `crowdgrad serve` with `args` (after the defaults: loopback on any port, MNIST,
    /// the web dir, evaluation every 0.5 s) and waits for it to listen.
    fn start(tag: &str, args: &[&str], envs: &[(&str, String)]) -> Server {
        let mut c = crowdgrad_cmd();
        c.arg("serve")
            .args(if args.contains(&"--addr") {
                &[][..]
            } else {
                &["--addr", "127.0.0.1:0"][..]
            })
            .args(["--eval-every", "0.5", "--no-fetch"])
            .arg("--data-dir")
            .arg(mnist_dir())
            .arg("--web-dir")
            .arg(root().join("web"))
            .args(args)
            .env_remove("CROWDGRAD_ADMIN_TOKEN")
            .env("RUST_LOG", "info");
        for (k, v) in envs {
            c.env(k, v);
        }
        let mut proc = Proc::spawn(c, &format!("durability-{tag}"));
        let url = proc.listening(Duration::from_secs(60));
        Server { proc, url }
    }

    /// The port it listens on.
    fn port(&self) -> String {
        self.url.rsplit(':').next().expect("port").to_string()
    }

    /// SIGKILL: a crash, nothing written on the way out.
    fn kill9(&mut self) {
        self.proc.kill();
    }

    /// Waits for the process to exit by itself.
    async fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        self.proc
            .exit_within(timeout)
            .await
            .unwrap_or_else(|| panic!("server did not exit in {timeout:?}"))
    }

    fn stdout(&self) -> String {
        self.proc.stdout()
    }

    fn stderr(&self) -> String {
        self.proc.stderr()
    }
}

/// Runs `crowdgrad` with `args` to completion (60 s at most); returns status, stdout, stderr.
fn crowdgrad(args: &[&str], envs: &[(&str, String)]) -> (ExitStatus, String, String) {
    let mut c = crowdgrad_cmd();
    c.args(args).stdin(Stdio::null());
    for (k, v) in envs {
        c.env(k, v);
    }
    let child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn crowdgrad");
    let out = child.wait_with_output().expect("crowdgrad output");
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// An admin call: method, path under /api/admin/, optional token and JSON body.
async fn admin(
    base: &str,
    path: &str,
    token: Option<&str>,
    body: Option<serde_json::Value>,
) -> (u16, serde_json::Value) {
    let url = format!("{base}/api/admin/{path}");
    let is_get = path == "state";
    let token = token.map(str::to_string);
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(60)))
            .build()
            .into();
        let mut r = if is_get {
            let mut rq = agent.get(&url);
            if let Some(t) = &token {
                rq = rq.header("authorization", &format!("Bearer {t}"));
            }
            rq.call()
        } else {
            let mut rq = agent.post(&url).header("content-type", "application/json");
            if let Some(t) = &token {
                rq = rq.header("authorization", &format!("Bearer {t}"));
            }
            rq.send(
                body.unwrap_or_else(|| serde_json::json!({}))
                    .to_string()
                    .as_bytes(),
            )
        }
        .expect("admin request");
        let status = r.status().as_u16();
        let body = r.body_mut().read_to_vec().expect("body");
        (
            status,
            serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
        )
    })
    .await
    .expect("admin call")
}

/// The checkpoints in `dir`, oldest first.
fn checkpoints(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|r| {
            r.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("ckpt-") && n.ends_with(".safetensors"))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn f32_le(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// `/api/params` and its versions header.
async fn params(base: &str) -> (Vec<u8>, Vec<u64>) {
    params_of(base, "").await
}

/// `/api/params{query}` and its versions header.
async fn params_of(base: &str, query: &str) -> (Vec<u8>, Vec<u64>) {
    let url = format!("{base}/api/params{query}");
    tokio::task::spawn_blocking(move || {
        let mut r = ureq::get(&url).call().expect("params");
        let versions = r
            .headers()
            .get("x-crowdgrad-versions")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .split(',')
            .filter_map(|v| v.parse().ok())
            .collect();
        let body = r
            .body_mut()
            .with_config()
            .limit(1 << 30)
            .read_to_vec()
            .expect("params body");
        (body, versions)
    })
    .await
    .expect("params")
}

fn versions(s: &serde_json::Value) -> Vec<u64> {
    s["shards"]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x["version"].as_u64()).collect())
        .unwrap_or_default()
}

fn native_worker(url: &str, identity: &str) -> WorkerThread {
    let mut o = WorkOptions::new(url);
    o.duration = Some(Duration::from_secs(240));
    o.identity = Some(identity.into());
    o.name = Some("durable".into());
    o.max_backoff = Duration::from_millis(500);
    WorkerThread::spawn(o)
}

/// The venv with safetensors, numpy and moto under target/, made once (and kept: later runs
/// reuse it). Returns its `bin` directory.
fn python_env() -> PathBuf {
    static ENV: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut g = ENV.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(p) = g.as_ref() {
        return p.clone();
    }
    let venv = target_dir().join("py-durability");
    let bin = venv.join("bin");
    let ready = venv.join(".crowdgrad-ready");
    if !ready.exists() {
        let ok = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .expect("python3 -m venv")
            .success();
        assert!(ok, "python3 -m venv failed");
        let ok = Command::new(bin.join("pip"))
            .args(["install", "--quiet", "safetensors", "numpy", "moto[server]"])
            .status()
            .expect("pip install")
            .success();
        assert!(ok, "pip install safetensors numpy moto[server] failed");
        std::fs::write(&ready, "ok").expect("marker");
    }
    *g = Some(bin.clone());
    bin
}

fn ledger_samples(board: &serde_json::Value, identity: &str) -> Option<u64> {
    // The board shows the identity's public id (issue 21), never the identity itself.
    let public = crowdgrad::registry::ledger::public_id(identity);
    board["contributors"]
        .as_array()?
        .iter()
        .find(|c| c["identity"] == public.as_str())?["samples"]
        .as_u64()
}

async fn contributors(base: &str) -> serde_json::Value {
    let (code, body) = get(format!("{base}/api/contributors")).await;
    assert_eq!(code, 200);
    serde_json::from_slice(&body).expect("contributors JSON")
}

/// Issue 9: kill -9 mid-training, restart on the same directory. The restarted server holds
/// exactly the newest valid checkpoint (a truncated newer one is skipped with a warning),
/// keeps the run id and the ledger; the exported model gives in Python the accuracy
/// `/api/status` reports; the native worker reconnects by itself and accuracy keeps rising
/// from where it was; drain exits 0 with a final checkpoint equal to the live parameters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_then_restart_continues_the_newest_valid_checkpoint() {
    let (dir, ckdir, ck) = checkpoint_dir("kill9");
    let token = ADMIN_TOKEN;
    let common = [
        "--checkpoint-dir",
        ck.as_str(),
        "--admin-token",
        token,
        "--checkpoint-keep",
        "4",
    ];
    let mut first = Server::start(
        "first",
        &[&common[..], &["--checkpoint-every", "0.5"]].concat(),
        &[],
    );
    let url = first.url.clone();
    let port = first.port();
    let identity = "durability-native-01";
    let w = native_worker(&url, identity);
    let before = wait_for(&url, Duration::from_secs(60), "90% and training", |s| {
        s["eval"]["accuracy"].as_f64().unwrap_or(0.0) >= 0.90
    })
    .await;
    let run_id = before["run_id"].as_str().expect("run id").to_string();
    // At least two checkpoints since then.
    let seen = checkpoints(&ckdir).last().cloned();
    let started = Instant::now();
    while checkpoints(&ckdir).last() == seen.as_ref() || checkpoints(&ckdir).len() < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "no checkpoint written"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    first.kill9();
    let acc_before = wait_for_acc(&before);

    let files = checkpoints(&ckdir);
    assert!(
        files.len() >= 2 && files.len() <= 4,
        "--checkpoint-keep 4: {files:?}"
    );
    let newest = files.last().expect("a checkpoint").clone();
    let saved = Checkpoint::decode(&std::fs::read(&newest).expect("read")).expect("valid");
    assert_eq!(saved.spec.run_id, run_id);
    assert!(
        saved.versions().iter().all(|&v| v > 0),
        "{:?}",
        saved.versions()
    );
    // The checkpoint records the ledger's position; the ledger itself is the file beside it.
    assert!(
        saved.ledger["seq"].as_u64() > Some(0),
        "the checkpoint carries the ledger's position: {}",
        saved.ledger
    );
    // A newer checkpoint, truncated as a crash mid-copy would leave it: must be skipped.
    let name = newest.file_name().and_then(|n| n.to_str()).expect("name");
    let seq: u64 = name["ckpt-".len()..name.len() - ".safetensors".len()]
        .parse()
        .expect("seq");
    let bytes = std::fs::read(&newest).expect("read");
    let truncated = ckdir.join(format!("ckpt-{:012}.safetensors", seq + 1));
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).expect("truncate");

    // Restart on another port, where no worker can reach it: the parameters must be the
    // checkpoint's bit for bit.
    let mut second = Server::start(
        "second",
        &[&common[..], &["--checkpoint-every", "3600"]].concat(),
        &[],
    );
    let (live, live_versions) = params(&second.url).await;
    assert_eq!(
        live_versions,
        saved.versions(),
        "versions continue from the checkpoint"
    );
    assert!(
        live == f32_le(&saved.values),
        "parameters differ from the checkpoint"
    );
    let s2 = wait_for(&second.url, Duration::from_secs(30), "an evaluation", |s| {
        s["eval"]["accuracy"].is_number()
    })
    .await;
    assert_eq!(
        s2["run_id"],
        run_id.as_str(),
        "the run id survives the restart"
    );
    let acc2 = s2["eval"]["accuracy"].as_f64().expect("accuracy");
    assert!(
        acc2 >= acc_before - 0.03,
        "accuracy after the restart {acc2} vs {acc_before} before: not starting over"
    );
    let err = second.stderr();
    assert!(
        err.contains("skipping an unusable checkpoint")
            && err.contains(&format!("{:012}", seq + 1)),
        "the truncated checkpoint is skipped with a warning: {err}"
    );
    // The ledger came back (from ledger.sqlite in the checkpoint directory).
    let board = contributors(&second.url).await;
    let saved_samples = ledger_samples(&board, identity);
    assert!(
        saved_samples > Some(0),
        "the ledger file keeps the identity's credit: {board}"
    );
    // The export, loaded by Python, gives /api/status' accuracy.
    let out = dir.join("model.safetensors");
    let (st, stdout, stderr) = crowdgrad(
        &[
            "export",
            "--server",
            &second.url,
            "--out",
            out.to_str().expect("utf-8"),
        ],
        &[],
    );
    assert!(st.success(), "export: {stdout} {stderr}");
    let py = python_env();
    let r = Command::new(py.join("python"))
        .arg(root().join("tests/python/export_accuracy.py"))
        .arg(&out)
        .arg(mnist_dir())
        .output()
        .expect("python");
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let py: serde_json::Value = serde_json::from_slice(&r.stdout).expect("python JSON");
    let acc_py = py["accuracy"].as_f64().expect("accuracy");
    assert!(
        (acc_py - acc2).abs() <= 0.001,
        "Python says {acc_py}, /api/status says {acc2}"
    );
    assert_eq!(
        py["tensors"]["layer0.weight"],
        serde_json::json!([784, 128])
    );
    // The export straight from the checkpoint directory is the same model.
    let out2 = dir.join("from-dir.safetensors");
    let (st, so, se) = crowdgrad(
        &[
            "export",
            "--checkpoint-dir",
            &ck,
            "--out",
            out2.to_str().expect("utf-8"),
        ],
        &[],
    );
    assert!(st.success(), "{so} {se}");
    assert!(
        std::fs::read(&out2).expect("export") == std::fs::read(&out).expect("export") || {
            // Same tensors; only the creation time in the metadata may differ.
            let a = safetensors_values(&out);
            a == safetensors_values(&out2)
        }
    );
    second.kill9();

    // Back on the original port: the worker, which kept retrying, reconnects by itself.
    let third = Server::start(
        "third",
        &[
            &common[..],
            &[
                "--checkpoint-every",
                "0.5",
                "--addr",
                &format!("127.0.0.1:{port}"),
            ],
        ]
        .concat(),
        &[],
    );
    assert_eq!(third.url, url);
    let resumed = saved.versions();
    let back = wait_for(
        &url,
        Duration::from_secs(60),
        "the worker to come back",
        |s| s["workers_connected"] == 1 && versions(s).iter().zip(&resumed).all(|(v, r)| v > r),
    )
    .await;
    assert_eq!(back["run_id"], run_id.as_str());
    wait_for(
        &url,
        Duration::from_secs(90),
        "accuracy to keep rising",
        |s| s["eval"]["accuracy"].as_f64().unwrap_or(0.0) >= (acc_before + 0.01).min(0.96),
    )
    .await;
    let ledger_now = contributors(&url).await;
    assert!(
        ledger_samples(&ledger_now, identity) > saved_samples,
        "the identity's total continues: {ledger_now}"
    );
    let summary = w.stop().expect("worker");
    assert!(summary.sessions >= 2, "{summary:?}");

    // Drain: with the worker gone the parameters are still; drain must checkpoint exactly them
    // and exit 0. Gone means its sockets are closed on the server's side too: the frames it
    // sent before it exited (its last round's push, under serve's default local steps) are
    // applied by then.
    wait_for(
        &url,
        Duration::from_secs(30),
        "the worker's sockets to close",
        |s| s["workers_connected"] == 0,
    )
    .await;
    let (live, live_versions) = params(&url).await;
    let mut third = third;
    let (st, so, se) = crowdgrad(&["ctl", "--server", &url, "--token", token, "drain"], &[]);
    assert!(st.success(), "ctl drain: {so} {se}");
    let status = third.wait_exit(Duration::from_secs(30)).await;
    assert!(
        status.success(),
        "drain exits 0: {status}; {}",
        third.stderr()
    );
    let last = checkpoints(&ckdir)
        .into_iter()
        .rev()
        .find_map(|p| Checkpoint::decode(&std::fs::read(p).ok()?).ok())
        .expect("a final checkpoint");
    assert_eq!(last.versions(), live_versions);
    assert!(
        f32_le(&last.values) == live,
        "the final checkpoint equals the live parameters"
    );
    assert!(third.stderr().contains("final checkpoint written"));
}

/// Issue 20 (`--ema`): a checkpoint keeps the shards' moving average beside the live weights
/// (`{tensor}.ema`), so a drained and restarted run evaluates and exports the same average it
/// did, bit for bit, rather than starting it again from the live weights; `crowdgrad export`
/// from the checkpoint gives the average by default and the live weights with `--weights
/// live`, and says which, as the server's export does; a restart with another decay, or
/// without `--ema`, evaluates the live weights.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_keeps_the_moving_average_and_a_restart_continues_it() {
    let (dir, ckdir, ck) = checkpoint_dir("ema");
    let token = ADMIN_TOKEN;
    let common = [
        "--checkpoint-dir",
        ck.as_str(),
        "--checkpoint-every",
        "3600",
        "--admin-token",
        token,
    ];
    let with_ema = |d: &'static str| [&common[..], &["--ema", d]].concat();
    let mut first = Server::start("ema-first", &with_ema("0.99"), &[]);
    let url = first.url.clone();
    let mut o = WorkOptions::new(&url);
    o.steps = Some(120);
    tokio::task::spawn_blocking(move || WorkerThread::spawn(o).join())
        .await
        .expect("join")
        .expect("worker");
    wait_for(&url, Duration::from_secs(30), "the sockets to close", |s| {
        s["workers_connected"] == 0
    })
    .await;
    let (average, versions) = params(&url).await;
    let (live, _) = params_of(&url, "?weights=live").await;
    assert_ne!(average, live, "the average lags the live weights");
    let export = |args: &[&str], name: &str| {
        let out = dir.join(name);
        let out_s = out.to_str().expect("utf-8").to_string();
        let (st, so, se) = crowdgrad(&[&["export", "--out", &out_s][..], args].concat(), &[]);
        assert!(st.success(), "export {args:?}: {so} {se}");
        (safetensors_values(&out), so, out)
    };
    let (served_avg, so, _) = export(&["--server", &url], "served-average.safetensors");
    assert!(so.contains("moving average weights"), "{so}");
    let (served_live, so, _) = export(
        &["--server", &url, "--weights", "live"],
        "served-live.safetensors",
    );
    assert!(so.contains("live weights"), "{so}");
    assert_ne!(served_avg, served_live);

    let (st, so, se) = crowdgrad(&["ctl", "--server", &url, "--token", token, "drain"], &[]);
    assert!(st.success(), "ctl drain: {so} {se}");
    assert!(first.wait_exit(Duration::from_secs(30)).await.success());
    let newest = checkpoints(&ckdir).pop().expect("a final checkpoint");
    let saved = Checkpoint::decode(&std::fs::read(&newest).expect("read")).expect("valid");
    assert_eq!(saved.versions(), versions);
    assert!(f32_le(&saved.values) == live, "the live weights are kept");
    let kept = saved.average.as_deref().expect("the average is kept");
    assert!(f32_le(kept) == average, "and so is the average, exactly");
    assert!(saved
        .shards
        .iter()
        .all(|s| s.ema.is_some_and(|e| e.decay == 0.99 && e.power < 1.0)));

    // From the checkpoint: the average unless asked for the live weights, as the server did.
    let (from_dir, so, out) = export(&["--checkpoint-dir", &ck], "from-dir.safetensors");
    assert!(so.contains("moving average weights"), "{so}");
    assert_eq!(from_dir, served_avg);
    let meta = safetensors::SafeTensors::read_metadata(&std::fs::read(&out).expect("read"))
        .expect("header")
        .1
        .metadata()
        .clone()
        .unwrap_or_default();
    assert_eq!(
        meta.get("weights").map(String::as_str),
        Some("moving average")
    );
    let (from_dir_live, so, _) = export(
        &["--checkpoint-dir", &ck, "--weights", "live"],
        "from-dir-live.safetensors",
    );
    assert!(so.contains("live weights"), "{so}");
    assert_eq!(from_dir_live, served_live);

    // Restarted with the same decay, the run evaluates the average it had.
    let second = Server::start("ema-same", &with_ema("0.99"), &[]);
    assert!(
        params(&second.url).await.0 == average,
        "the average continues"
    );
    assert!(params_of(&second.url, "?weights=live").await.0 == live);
    drop(second);
    // With another decay, or none, it starts again from the live weights.
    let third = Server::start("ema-other", &with_ema("0.9"), &[]);
    assert!(
        params(&third.url).await.0 == live,
        "another decay starts again"
    );
    assert!(
        third.stderr().contains("moving average"),
        "{}",
        third.stderr()
    );
    drop(third);
    let fourth = Server::start("ema-none", &common, &[]);
    assert!(
        params(&fourth.url).await.0 == live,
        "no --ema: the live weights"
    );
}

fn wait_for_acc(s: &serde_json::Value) -> f64 {
    s["eval"]["accuracy"].as_f64().unwrap_or(0.0)
}

fn safetensors_values(p: &Path) -> Vec<(String, Vec<u8>)> {
    let bytes = std::fs::read(p).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut v: Vec<(String, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.data().to_vec()))
        .collect();
    v.sort();
    v
}

/// Issue 9: every admin call without the token, or with a wrong one, is a 401 and changes
/// nothing; the generated token is printed once on stdout, never in the logs or the status;
/// with it, pause makes shards answer pushes `busy` (nothing applied) and resume undoes it;
/// set-lr checks its value; set-consistency refuses an unsafe change with a reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_calls_need_the_token_which_is_never_logged() {
    let dir = scratch("admin");
    let ck = dir.join("ck");
    let mut server = Server::start(
        "server",
        &[
            "--checkpoint-dir",
            ck.to_str().expect("utf-8"),
            "--checkpoint-every",
            "3600",
        ],
        &[],
    );
    let url = server.url.clone();
    let started = Instant::now();
    let token = loop {
        let out = server.stdout();
        if let Some(t) = out
            .lines()
            .find_map(|l| l.split("shown only now): ").nth(1))
        {
            break t.trim().to_string();
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the generated token is printed: {out}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(token.len(), 64);
    let w = native_worker(&url, "durability-admin-01");
    wait_for(&url, Duration::from_secs(30), "training", |s| {
        s["totals"]["pushes_applied"].as_u64() > Some(50)
    })
    .await;
    // Without the token, or a wrong one: 401 and nothing changes.
    for t in [None, Some("wrong-token-wrong-token"), Some(&token[..63])] {
        for path in ["pause", "drain", "stop", "checkpoint", "set-lr", "state"] {
            let body = (path == "set-lr").then(|| serde_json::json!({"lr": 0.5}));
            let (code, b) = admin(&url, path, t, body).await;
            assert_eq!(code, 401, "{path} with {t:?}: {b}");
        }
    }
    let a = versions(&crate::util::status(&url).await);
    let later = wait_for(&url, Duration::from_secs(10), "training to go on", |s| {
        versions(s).iter().zip(&a).all(|(v, a)| v > a)
    })
    .await;
    assert!(checkpoints(&ck).is_empty(), "no checkpoint was written");
    let (_, state) = admin(&url, "state", Some(&token), None).await;
    assert_eq!(state["paused"], false);
    assert_eq!(state["draining"], false);
    // serve's default exchange is `--local-steps auto`: the shards' rule is the outer SGD at 1.0.
    assert!(
        (state["lr"].as_f64().unwrap_or(0.0) - 1.0).abs() < 1e-6,
        "{state}"
    );
    assert!(later["totals"]["pushes_rejected"] == 0);

    // With the token.
    let (code, s) = admin(&url, "pause", Some(&token), None).await;
    assert_eq!((code, &s["paused"]), (200, &serde_json::json!(true)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let p1 = versions(&crate::util::status(&url).await);
    let paused = wait_for(&url, Duration::from_secs(10), "busy rejections", |s| {
        s["totals"]["rejected_by_reason"]["busy"].as_u64() > Some(20)
    })
    .await;
    assert_eq!(versions(&paused), p1, "a paused server applies nothing");
    let (code, _) = admin(&url, "resume", Some(&token), None).await;
    assert_eq!(code, 200);
    wait_for(&url, Duration::from_secs(10), "training to resume", |s| {
        versions(s).iter().zip(&p1).all(|(v, p)| v > p)
    })
    .await;
    for bad in [
        serde_json::json!({"lr": -1.0}),
        serde_json::json!({"lr": "x"}),
        serde_json::json!({"rate": 1}),
    ] {
        let (code, b) = admin(&url, "set-lr", Some(&token), Some(bad.clone())).await;
        assert_eq!(code, 400, "{bad}: {b}");
    }
    let (code, s) = admin(
        &url,
        "set-lr",
        Some(&token),
        Some(serde_json::json!({"lr": 0.02})),
    )
    .await;
    assert_eq!(code, 200);
    assert!((s["lr"].as_f64().expect("lr") - 0.02).abs() < 1e-6);
    let (code, b) = admin(
        &url,
        "set-consistency",
        Some(&token),
        Some(serde_json::json!({"consistency": "sync:2"})),
    )
    .await;
    assert_eq!(code, 409, "async -> sync is unsafe");
    assert!(
        b["error"]
            .as_str()
            .is_some_and(|e| e.contains("--consistency sync:2")),
        "{b}"
    );
    let (code, b) = admin(&url, "checkpoint", Some(&token), None).await;
    assert_eq!(code, 200, "{b}");
    assert_eq!(checkpoints(&ck).len(), 1);
    // The token is nowhere but that one line of stdout.
    let (_, status) = get(format!("{url}/api/status")).await;
    assert!(!String::from_utf8_lossy(&status).contains(&token));
    assert!(
        !server.stderr().contains(&token),
        "the token reached the logs"
    );
    assert_eq!(server.stdout().matches(&token).count(), 1);
    // ctl stop: exit 0 with a final checkpoint.
    let (st, so, se) = crowdgrad(&["ctl", "--server", &url, "--token", &token, "stop"], &[]);
    assert!(st.success(), "{so} {se}");
    let code = server.wait_exit(Duration::from_secs(30)).await;
    assert!(code.success(), "{code}");
    assert_eq!(checkpoints(&ck).len(), 2);
    assert!(!server.stderr().contains(&token));
    w.kill();
}

/// Issue 9: a checkpoint of another model is refused with an error naming both; one of another
/// shard count is refused naming --reshard, and with --reshard it is re-cut exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_model_or_layout_is_refused_unless_resharded() {
    let dir = scratch("layout");
    let ck = dir.join("ck");
    let ck = ck.to_str().expect("utf-8");
    let token = "durability-admin-token-layout-0";
    let server = Server::start(
        "two",
        &[
            "--checkpoint-dir",
            ck,
            "--admin-token",
            token,
            "--checkpoint-every",
            "3600",
        ],
        &[],
    );
    let w = native_worker(&server.url, "durability-layout1");
    wait_for(&server.url, Duration::from_secs(30), "training", |s| {
        s["totals"]["pushes_applied"].as_u64() > Some(100)
    })
    .await;
    w.kill();
    let (code, b) = admin(&server.url, "checkpoint", Some(token), None).await;
    assert_eq!(code, 200, "{b}");
    drop(server);
    let saved = Checkpoint::decode(
        &std::fs::read(checkpoints(Path::new(ck)).pop().expect("checkpoint")).expect("read"),
    )
    .expect("valid");
    let data = mnist_dir();
    let data = data.to_str().expect("utf-8");
    let serve = |extra: &[&str]| {
        let mut a = vec![
            "serve",
            "--addr",
            "127.0.0.1:0",
            "--no-fetch",
            "--data-dir",
            data,
            "--checkpoint-dir",
            ck,
        ];
        a.extend_from_slice(extra);
        crowdgrad(&a, &[("CROWDGRAD_ADMIN_TOKEN", token.to_string())])
    };
    let (st, _, err) = serve(&["--model", "mlp:64"]);
    assert!(!st.success());
    assert!(
        err.contains("holds model mlp 784-128-10") && err.contains("configured for mlp 784-64-10"),
        "{err}"
    );
    let (st, _, err) = serve(&["--optimizer", "adam"]);
    assert!(!st.success());
    // The default run's shards hold the outer SGD's state (`--local-steps auto`).
    assert!(err.contains("sgd optimizer state"), "{err}");
    let (st, _, err) = serve(&["--shards", "3"]);
    assert!(!st.success());
    assert!(
        err.contains("has 2 shards") && err.contains("--reshard"),
        "{err}"
    );
    // Nothing was written by the refused starts.
    assert_eq!(checkpoints(Path::new(ck)).len(), 1);
    let three = Server::start(
        "three",
        &[
            "--checkpoint-dir",
            ck,
            "--shards",
            "3",
            "--reshard",
            "--checkpoint-every",
            "3600",
        ],
        &[],
    );
    let (live, v) = params(&three.url).await;
    assert!(live == f32_le(&saved.values), "re-cut parameters differ");
    assert_eq!(v.len(), 3);
    assert!(v
        .iter()
        .all(|x| *x == saved.versions().into_iter().max().unwrap_or(0)));
    assert!(three.stderr().contains("re-cut from 2 onto 3 shards"));
}

/// Issue 9: checkpoints in an S3-compatible store (moto's server), then a resume from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_go_to_s3_and_resume_from_there() {
    let dir = scratch("s3");
    let bin = python_env();
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("port");
        l.local_addr().expect("addr").port()
    };
    let mut moto = Command::new(bin.join("moto_server"));
    moto.args(["-H", "127.0.0.1", "-p", &port.to_string()]);
    let moto = Proc::spawn(moto, "moto");
    let endpoint = format!("http://127.0.0.1:{port}");
    let started = Instant::now();
    loop {
        let e = endpoint.clone();
        let up = tokio::task::spawn_blocking(move || {
            ureq::put(&format!("{e}/crowdgrad-test"))
                .send_empty()
                .is_ok()
        })
        .await
        .expect("put");
        if up {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "moto did not start"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let env = vec![
        ("AWS_ENDPOINT", endpoint.clone()),
        ("AWS_ALLOW_HTTP", "true".to_string()),
        ("AWS_ACCESS_KEY_ID", "testing".to_string()),
        ("AWS_SECRET_ACCESS_KEY", "testing".to_string()),
        ("AWS_REGION", "us-east-1".to_string()),
    ];
    let loc = "s3://crowdgrad-test/runs/one";
    let token = "durability-admin-token-s3-00000";
    let mut first = Server::start(
        "first",
        &[
            "--checkpoint-dir",
            loc,
            "--checkpoint-every",
            "0.5",
            "--admin-token",
            token,
        ],
        &env,
    );
    let w = native_worker(&first.url, "durability-s3-0001");
    wait_for(&first.url, Duration::from_secs(30), "training", |s| {
        s["eval"]["accuracy"].as_f64().unwrap_or(0.0) > 0.8
    })
    .await;
    w.kill();
    let (code, b) = admin(&first.url, "checkpoint", Some(token), None).await;
    assert_eq!(code, 200, "{b}");
    let written = b["written"]["versions"].clone();
    first.kill9();
    let second = Server::start(
        "second",
        &["--checkpoint-dir", loc, "--checkpoint-every", "3600"],
        &env,
    );
    let (_, v) = params(&second.url).await;
    assert_eq!(
        serde_json::json!(v),
        written,
        "resumed from the S3 checkpoint"
    );
    assert!(second.stderr().contains("resuming from checkpoint"));
    // And the export reads the bucket too.
    let out = dir.join("s3.safetensors");
    let (st, so, se) = crowdgrad(
        &[
            "export",
            "--checkpoint-dir",
            loc,
            "--out",
            out.to_str().expect("utf-8"),
        ],
        &env,
    );
    assert!(st.success(), "{so} {se}");
    let (live, _) = params(&second.url).await;
    let tensors: std::collections::HashMap<String, Vec<u8>> =
        safetensors_values(&out).into_iter().collect();
    let flat: Vec<u8> = [
        "layer0.weight",
        "layer0.bias",
        "layer1.weight",
        "layer1.bias",
    ]
    .iter()
    .flat_map(|n| tensors[*n].clone())
    .collect();
    assert!(flat == live, "the export from S3 is the resumed model");
    drop(moto);
}
