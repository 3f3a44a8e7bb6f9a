//! Shards in their own processes: a coordinator (`serve --shard-urls`) and two real
//! `crowdgrad shard` processes on 127.0.0.1, trained by two native workers to the accuracy of
//! the in-process setup; one shard process killed with SIGKILL and restarted on the same
//! address and checkpoint directory: the coordinator reports it down, the workers keep pushing
//! to the other shard meanwhile, the restarted shard continues from its newest checkpoint and
//! the run recovers without a coordinator restart.

use crate::util::{self, Proc};
use crowdgrad::shardproc::checkpoint::ShardCheckpoint;
use crowdgrad::worker::{WorkOptions, WorkerThread};
use std::time::Duration;

const SECRET: &str = "integration-run-secret-0123456789";

/// A `crowdgrad shard` process and the address it listens on.
struct ShardProc {
    proc: Proc,
    addr: String,
}

/// Starts shard `index` of 2 on `listen`, checkpointing every second into `ckpt`, and waits
/// for its address line.
fn shard(index: usize, listen: &str, ckpt: &std::path::Path) -> ShardProc {
    let mut c = util::crowdgrad();
    c.args([
        "shard",
        "--listen",
        listen,
        "--index",
        &index.to_string(),
        "--of",
        "2",
        "--checkpoint-every",
        "1",
        "--checkpoint-dir",
    ])
    .arg(ckpt)
    .env("CROWDGRAD_RUN_SECRET", SECRET)
    .env("RUST_LOG", "warn");
    let mut proc = Proc::spawn(c, &format!("shard-{index}"));
    let url = proc.listening(Duration::from_secs(30));
    let addr = url
        .strip_prefix("ws://")
        .unwrap_or_else(|| panic!("the shard listens on ws://: {url}"))
        .to_string();
    ShardProc { proc, addr }
}

/// A scratch directory ([`util::scratch`]), removed when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        Self(util::scratch("remote", name))
    }

    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The version in the newest valid checkpoint of shard `index` under `dir`.
fn newest_checkpoint(dir: &std::path::Path, index: usize) -> Option<u64> {
    let mut files: Vec<_> = std::fs::read_dir(dir.join(format!("shard-{index}")))
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    files.iter().rev().find_map(|p| {
        let bytes = std::fs::read(p).ok()?;
        ShardCheckpoint::decode(&bytes).ok().map(|c| c.meta.version)
    })
}

fn accuracy(s: &serde_json::Value) -> f64 {
    s["eval"]["accuracy"].as_f64().unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_shards_reach_in_process_accuracy_and_survive_a_kill() {
    let dir = Scratch::new("kill");
    let s0 = shard(0, "127.0.0.1:0", dir.path());
    let mut s1 = shard(1, "127.0.0.1:0", dir.path());
    let mut cfg = util::config();
    cfg.shard_urls = vec![format!("ws://{}", s0.addr), format!("ws://{}", s1.addr)];
    cfg.run_secret = Some(crowdgrad::support::credential::Secret::new(SECRET));
    let running = util::server(cfg).await;
    let base = running.url();
    util::wait_for(&base, Duration::from_secs(20), "both shards up", |s| {
        s["remote_shards"]
            .as_array()
            .is_some_and(|a| a.iter().all(|h| h["ready"] == true))
    })
    .await;
    let (code, _) = util::get(format!("{base}/readyz")).await;
    assert_eq!(code, 200);
    // The join hands out the shard processes' absolute URLs.
    let joined = util::join(&base).await;
    assert_eq!(
        joined.run.shards[1].path,
        format!("ws://{}/ws/shard/1", s1.addr)
    );
    // A Hello without the credential is refused by the shard process.
    {
        use crowdgrad_core::wire::{self, ErrorCode, Message};
        use futures_util::{SinkExt, StreamExt};
        let url = format!("ws://{}/ws/shard/0", s0.addr);
        let (mut ws, _) = tokio_tungstenite::connect_async(url.as_str())
            .await
            .unwrap();
        let hello = util::hello(joined.worker_id)
            .request_id(3)
            .protocol(1)
            .credential(Some("00".repeat(32)))
            .frame();
        ws.send(tokio_tungstenite::tungstenite::Message::Binary(
            hello.into(),
        ))
        .await
        .unwrap();
        let reply = tokio::time::timeout(Duration::from_secs(10), ws.next())
            .await
            .expect("a reply")
            .expect("a frame")
            .expect("ok");
        let frame = reply.into_data();
        match wire::decode(&frame, usize::MAX).unwrap() {
            Message::Error { error, .. } => assert!(
                matches!(
                    error.code,
                    ErrorCode::Unauthorized | ErrorCode::UnknownWorker
                ),
                "{error:?}"
            ),
            other => panic!("expected unauthorized, got {other:?}"),
        }
    }

    let workers: Vec<WorkerThread> = (0..2)
        .map(|i| {
            let mut o = WorkOptions::new(&base);
            o.name = Some(format!("remote-{i}"));
            o.max_backoff = Duration::from_millis(500);
            WorkerThread::spawn(o)
        })
        .collect();
    let s = util::wait_for(&base, Duration::from_secs(120), "95% accuracy", |s| {
        accuracy(s) > 0.95
    })
    .await;
    let before = s["remote_shards"][1]["version"].as_u64().unwrap();
    assert!(before > 100, "shard 1 applied updates: {before}");
    assert!(s["totals"]["pushes_applied"].as_u64().unwrap() > 200);

    // kill -9 shard 1 once it has a checkpoint, then start it again on the same address.
    let t = std::time::Instant::now();
    let saved = loop {
        match newest_checkpoint(dir.path(), 1) {
            Some(v) if v > 0 => break v,
            _ if t.elapsed() > Duration::from_secs(30) => panic!("shard 1 wrote no checkpoint"),
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    let addr = s1.addr.clone();
    s1.proc.kill();
    // What it had written when it died (it may have written one more after `saved`).
    let saved = newest_checkpoint(dir.path(), 1).unwrap_or(saved);
    util::wait_for(
        &base,
        Duration::from_secs(20),
        "shard 1 reported down",
        |s| s["remote_shards"][1]["up"] == false,
    )
    .await;
    let (code, body) = util::get(format!("{base}/readyz")).await;
    assert_eq!(code, 503);
    let r: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(r["shards"][1]["ready"], false);
    assert!(r["shards"][1]["error"].is_string());
    // While shard 1 is down the workers keep pushing to shard 0 (they retry shard 1 with
    // backoff and do not stall the round).
    let v0 = |s: &serde_json::Value| s["remote_shards"][0]["version"].as_u64().unwrap_or(0);
    let (_, body) = util::get(format!("{base}/api/status")).await;
    let down_at = v0(&serde_json::from_slice(&body).unwrap());
    let s = util::wait_for(&base, Duration::from_secs(30), "shard 0 moving on", |s| {
        v0(s) > down_at + 100
    })
    .await;
    assert_eq!(s["remote_shards"][1]["up"], false, "shard 1 is still down");
    s1 = shard(1, &addr, dir.path());
    let s = util::wait_for(&base, Duration::from_secs(30), "shard 1 back", |s| {
        s["remote_shards"][1]["ready"] == true
    })
    .await;
    // It continues from its newest checkpoint: at most one checkpoint interval is lost.
    let resumed = s["remote_shards"][1]["version"].as_u64().unwrap();
    assert!(
        resumed >= saved,
        "shard 1 restarted at version {resumed}, its checkpoint holds {saved}"
    );
    let (_, body) = util::get(format!("http://{addr}/api/shard")).await;
    let report: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert!(report["version"].as_u64().unwrap() >= saved, "{report}");
    // The workers reconnect by themselves and the run climbs back.
    util::wait_for(&base, Duration::from_secs(120), "recovery to 93%", |s| {
        accuracy(s) > 0.93 && s["remote_shards"][1]["version"].as_u64().unwrap_or(0) > resumed + 50
    })
    .await;
    for w in workers {
        let _ = tokio::task::spawn_blocking(move || w.stop()).await;
    }
    running.stop().await.unwrap();
    drop(s1);
    drop(s0);
}
