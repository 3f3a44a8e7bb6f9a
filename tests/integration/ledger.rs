//! Issue 18: the contribution ledger in SQLite. A writer killed with SIGKILL mid-write loses
//! no committed row; `serve --ledger` refuses a corrupt or foreign file at start (non-zero
//! exit, the path in the message, the file untouched); a `crowdgrad work`'s credit survives a
//! kill -9 and restart of `serve` on the same checkpoint directory, and with `--shard-urls`
//! the coordinator's `--ledger` survives one too.

use crate::util::{self, Proc};
use crowdgrad::registry::ledger::db::Db;
use std::path::Path;
use std::time::{Duration, Instant};

const SECRET: &str = "integration-run-secret-0123456789";

/// `crowdgrad serve` on any loopback port with `args`, waiting for it to listen (`None`
/// when it exits before printing its address).
fn serve(tag: &str, args: &[&str]) -> (Proc, Option<String>) {
    let mut c = util::crowdgrad();
    c.args([
        "serve",
        "--addr",
        "127.0.0.1:0",
        "--eval-every",
        "0.5",
        "--no-fetch",
    ])
    .arg("--data-dir")
    .arg(util::mnist_dir())
    .arg("--web-dir")
    .arg(util::root().join("web"))
    .args(["--admin-token", "ledger-test-admin-token-0123456789"])
    .args(args)
    .env("RUST_LOG", "info");
    let mut p = Proc::spawn(c, tag);
    let started = Instant::now();
    loop {
        if let Some(url) = p.stdout().lines().find_map(util::listening_addr) {
            return (p, Some(url.to_string()));
        }
        if !p.running() {
            return (p, None);
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{tag} did not start: {}",
            p.stderr()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The board with `identity`'s line, found by its public id (issue 21).
async fn board(base: &str, identity: &str) -> serde_json::Value {
    let public = crowdgrad::registry::ledger::public_id(identity);
    let (code, body) = util::get(format!("{base}/api/contributors?identity={public}")).await;
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    serde_json::from_slice(&body).expect("contributors JSON")
}

/// A kill -9 during heavy writes: the child (`crowdgrad bench ledger --crash-writer`, the
/// writer's own [`Db::apply`]) prints `committed SEQ` after each commit; every one it
/// printed before the SIGKILL is in the reopened file, which passes `quick_check` and whose
/// counts agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_during_heavy_writes_loses_no_committed_row() {
    let dir = util::scratch("ledger", "kill9");
    let path = dir.join("ledger.sqlite");
    let mut child = Proc::crowdgrad(
        "crash-writer",
        &[
            "bench",
            "ledger",
            "--crash-writer",
            "--db",
            path.to_str().expect("utf-8"),
        ],
    );
    let started = Instant::now();
    let committed = |p: &Proc| {
        p.stdout()
            .lines()
            .filter_map(|l| l.strip_prefix("committed ")?.trim().parse::<u64>().ok())
            .next_back()
    };
    while committed(&child).unwrap_or(0) < 40 {
        assert!(child.running(), "the writer exited: {}", child.stderr());
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the writer committed too little: {}",
            child.stdout()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Killed mid-write: it never stops between batches.
    child.kill();
    let last = committed(&child).expect("a committed sequence number");
    let db = Db::open(&path).expect("the file reopens");
    db.verify().expect("consistent after the kill");
    let seq = db.seq().expect("seq");
    assert!(seq >= last, "committed {last}, the file is at {seq}");
    for i in 1..=last {
        let row = db
            .get(&format!("crash-{i:010}"), 0.0)
            .expect("read")
            .unwrap_or_else(|| panic!("committed batch {i} of {last} is missing"));
        assert_eq!(row.samples, i);
    }
    let counter = db
        .get("crash-counter", 0.0)
        .expect("read")
        .expect("counter");
    assert_eq!(counter.samples, seq, "one sample per committed batch");
}

/// `serve --ledger PATH` on a file that is not a ledger exits non-zero at start, naming the
/// file, and leaves it as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_refuses_a_corrupt_or_foreign_ledger() {
    let dir = util::scratch("ledger", "refuse");
    let garbage = dir.join("garbage.sqlite");
    std::fs::write(&garbage, vec![0x42u8; 10_000]).expect("write");
    // A real SQLite database of another program: a crowdgrad ledger with another
    // application id is one (the id is what marks it as ours).
    let foreign = dir.join("foreign.sqlite");
    drop(Db::open(&foreign).expect("a database"));
    {
        let mut bytes = std::fs::read(&foreign).expect("read");
        // The WAL may hold the schema: fold it in by reopening through Db, then patch the
        // header's application id (offset 68) to another program's.
        if bytes.len() < 100 {
            bytes.resize(100, 0);
        }
        bytes[68..72].copy_from_slice(&0x1234_5678u32.to_be_bytes());
        std::fs::write(&foreign, bytes).expect("write");
        for s in ["-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{s}", foreign.display()));
        }
    }
    for (file, says) in [
        (&garbage, "not a SQLite database"),
        (&foreign, "not a crowdgrad ledger"),
    ] {
        let before = std::fs::read(file).expect("read");
        // (It may print its address first: `main` binds before the run opens the ledger.)
        let (mut p, _) = serve("refused", &["--ledger", file.to_str().expect("utf-8")]);
        let status = p
            .exit_within(Duration::from_secs(30))
            .await
            .expect("exited");
        assert!(!status.success(), "exit status {status}");
        let err = p.stderr();
        assert!(
            err.contains(&file.display().to_string()) && err.contains(says),
            "{says}: {err}"
        );
        assert_eq!(
            std::fs::read(file).expect("read"),
            before,
            "the file changed"
        );
    }
}

/// A `crowdgrad work`'s credit as `/api/contributors` showed it survives a kill -9 of `serve`
/// and a restart on the same checkpoint directory (the ledger file beside the checkpoints is
/// the source of truth); the checkpoint records the ledger's position, not its contents.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credit_survives_a_kill_9_and_restart_of_serve() {
    let dir = util::scratch("ledger", "restart");
    let ck = dir.join("checkpoints");
    let ck = ck.to_str().expect("utf-8");
    let args = ["--checkpoint-dir", ck, "--checkpoint-every", "1"];
    let (mut first, url) = serve("first", &args);
    let url = url.unwrap_or_else(|| panic!("serve did not start: {}", first.stderr()));
    let identity = "ledger-restart-01";
    let mut worker = Proc::crowdgrad(
        "work",
        &[
            "work",
            "--server",
            &url,
            "--id",
            identity,
            "--name",
            "Résumé 名前",
            "--team",
            " Team\u{7} Ωmega ",
            "--quiet",
        ],
    );
    let started = Instant::now();
    let credited = loop {
        let b = board(&url, identity).await;
        let s = b["you"]["samples"].as_u64().unwrap_or(0);
        if s >= 2_000 {
            break b;
        }
        assert!(worker.running(), "worker exited: {}", worker.stderr());
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "no credit: {b}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // A checkpoint written after some credit holds the ledger's position. (The worker can
    // reach 2,000 samples before the first checkpoint: wait for one, every 1 s.)
    let newest_saved = || {
        let newest = std::fs::read_dir(dir.join("checkpoints"))
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .max()?;
        crowdgrad::checkpoint::format::Checkpoint::decode(&std::fs::read(&newest).ok()?).ok()
    };
    let waited = Instant::now();
    let saved = loop {
        match newest_saved() {
            Some(c) if c.ledger["seq"].as_u64() > Some(0) => break c,
            _ if waited.elapsed() > Duration::from_secs(30) => {
                panic!("no checkpoint with the ledger's position in 30 s")
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    // That read flushed the ledger: what it showed is committed.
    first.kill();
    worker.kill();
    let you = &credited["you"];
    assert_eq!(you["name"], "Résumé 名前");
    // The team as the join handler cleaned it (control characters out, trimmed), and the
    // board's team line adds up its one member.
    assert_eq!(you["team"], "Team Ωmega");
    let team = &credited["teams"][0];
    assert!(
        team["team"] == "Team Ωmega" && team["members"] == 1 && team["samples"] == you["samples"],
        "{credited}"
    );
    assert!(
        credited["your_rank"] == 1 && you["recent"].as_f64() > Some(0.0),
        "{credited}"
    );
    assert!(saved.ledger["seq"].as_u64() > Some(0), "{}", saved.ledger);
    assert!(saved.ledger.get("contributors").is_none());

    let (second, url2) = serve("second", &args);
    let url2 = url2.unwrap_or_else(|| panic!("restart failed: {}", second.stderr()));
    let after = board(&url2, identity).await;
    for k in ["samples", "pushes_accepted", "sessions", "first_seen_unix"] {
        assert!(
            after["you"][k].as_f64() >= you[k].as_f64(),
            "{k}: before {you}, after {}",
            after["you"]
        );
    }
    assert_eq!(after["you"]["name"], you["name"]);
    assert_eq!(after["you"]["team"], you["team"]);
    assert!(
        after["teams"][0]["samples"].as_u64() >= you["samples"].as_u64(),
        "{after}"
    );
    // The CSV export keeps its shape.
    let (code, csv) = util::get(format!("{url2}/api/contributors?format=csv")).await;
    assert_eq!(code, 200);
    let csv = String::from_utf8(csv).expect("utf-8");
    assert!(csv.starts_with(
        "identity,name,client,samples,pushes_accepted,pushes_rejected,compute_seconds,sessions,first_seen_unix,last_seen_unix,team\n"
    ));
    let public = crowdgrad::registry::ledger::public_id(identity);
    assert!(
        !csv.contains(identity)
            && csv.contains(&format!("{public},\"Résumé 名前\",native,"))
            && csv.contains(",\"Team Ωmega\"\n"),
        "{csv}"
    );
    assert!(Path::new(ck).join("ledger.sqlite").is_file());
}

/// With `--shard-urls` the coordinator keeps its ledger in `--ledger PATH`, and credits the
/// samples of pushes applied by the shard processes, which report them in their feeds
/// (`GET /api/feed`, only with the coordinator's token): a `crowdgrad work`'s credit and an
/// identity's joins are still there after a kill -9 and restart of the coordinator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinators_ledger_survives_a_restart_with_shard_urls() {
    let dir = util::scratch("ledger", "remote");
    let mut shards = Vec::new();
    let mut urls = Vec::new();
    for i in 0..2 {
        let mut c = util::crowdgrad();
        c.args([
            "shard",
            "--listen",
            "127.0.0.1:0",
            "--index",
            &i.to_string(),
            "--of",
            "2",
        ])
        .env("CROWDGRAD_RUN_SECRET", SECRET)
        .env("RUST_LOG", "warn");
        let mut p = Proc::spawn(c, &format!("shard-{i}"));
        urls.push(p.listening(Duration::from_secs(30)));
        shards.push(p);
    }
    let ledger = dir.join("coordinator-ledger.sqlite");
    let urls = urls.join(",");
    let args = [
        "--shard-urls",
        urls.as_str(),
        "--run-secret",
        SECRET,
        "--ledger",
        ledger.to_str().expect("utf-8"),
    ];
    let (mut first, url) = serve("coordinator", &args);
    let url = url.unwrap_or_else(|| panic!("serve did not start: {}", first.stderr()));
    let identity = "ledger-remote-01";
    util::wait_for(&url, Duration::from_secs(30), "both shards up", |s| {
        s["remote_shards"]
            .as_array()
            .is_some_and(|a| a.iter().all(|h| h["ready"] == true))
    })
    .await;
    for _ in 0..2 {
        let (code, body) = util::join_as(&url, identity).await;
        assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    }
    let b = board(&url, identity).await;
    assert_eq!(b["you"]["sessions"], 2, "{b}");
    // Nobody but the coordinator takes a shard's feed (a take acknowledges batches).
    let shard0 = urls
        .split(',')
        .next()
        .expect("a shard")
        .replace("ws://", "http://");
    for bearer in [None, Some("0".repeat(64))] {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let mut req = agent.get(format!("{shard0}/api/feed?boot=1&ack=99"));
        if let Some(b) = &bearer {
            req = req.header("authorization", &format!("Bearer {b}"));
        }
        let code = tokio::task::spawn_blocking(move || req.call().map(|r| r.status().as_u16()))
            .await
            .expect("join")
            .expect("shard answers");
        assert_eq!(code, 401, "{bearer:?}");
    }
    let mut worker = Proc::crowdgrad(
        "work-remote",
        &["work", "--server", &url, "--id", identity, "--quiet"],
    );
    let started = Instant::now();
    let credited = loop {
        let b = board(&url, identity).await;
        if b["you"]["samples"].as_u64() >= Some(2_000)
            && b["you"]["pushes_accepted"].as_u64() > Some(0)
        {
            break b;
        }
        assert!(worker.running(), "worker exited: {}", worker.stderr());
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "no credit from the shard processes' feeds: {b}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    // The coordinator's worker record counts the pushes the shards applied.
    let (code, page) = util::get(format!("{url}/api/workers?limit=100")).await;
    assert_eq!(code, 200);
    let page: serde_json::Value = serde_json::from_slice(&page).expect("workers JSON");
    assert!(
        page["workers"]
            .as_array()
            .is_some_and(|w| w.iter().any(|w| w["pushes_applied"].as_u64() > Some(0))),
        "{page}"
    );
    first.kill();
    worker.kill();
    let (second, url2) = serve("coordinator-again", &args);
    let url2 = url2.unwrap_or_else(|| panic!("restart failed: {}", second.stderr()));
    let b = board(&url2, identity).await;
    assert!(b["you"]["sessions"].as_u64() >= Some(3), "{b}");
    for k in ["samples", "pushes_accepted"] {
        assert!(
            b["you"][k].as_u64() >= credited["you"][k].as_u64(),
            "{k}: before {credited}, after {b}"
        );
    }
    assert_eq!(b["total"], 1);
}
