//! Issue 21: identities with a secret. What a worker sends in its join is a secret; the
//! server keys the ledger, the names, the teams, the credit and the quarantine by the public id
//! it derives from it (`crowdgrad::registry::ledger::public_id`), and shows only that. Against
//! real servers:
//! - a client that knows only a volunteer's public id (read off the leaderboard) and joins
//!   with it, renames itself, pushes and sends refused frames until it is quarantined books all
//!   of it to another public id: the owner's next join succeeds, its name, team and credit are
//!   as they were, and no public answer ever holds the owner's secret;
//! - `crowdgrad work --id-file` makes a secret of 32 hex digits in a file of mode 0600 and is
//!   credited under its public id, run after run;
//! - a ledger file written before (schema version 2, keyed by the old public identities) is
//!   re-keyed by hashing when `serve --ledger` opens it: its volunteers keep their credit by
//!   joining with the string they always had, and that string is shown nowhere.

use crate::util::{self, config, get, join_as, server, status, Proc};
use crowdgrad::registry::ledger::{check_public_id, public_id};
use crowdgrad::worker::{WorkOptions, WorkerThread};
use crowdgrad_core::spec::{JoinRequest, JoinResponse};
use crowdgrad_core::wire::{self, ClientKind, ErrorCode, Message as Frame};
use std::time::{Duration, Instant};

const ADMIN: &str = "identity-test-admin-token-0123456789";

/// `/api/contributors?identity=PUBLIC` as JSON.
async fn board(base: &str, public: &str) -> serde_json::Value {
    let (code, body) = get(format!("{base}/api/contributors?identity={public}")).await;
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    serde_json::from_slice(&body).expect("contributors JSON")
}

/// Every public answer of the server at `base`, as text: status, workers, leaderboard, CSV,
/// metrics.
async fn public_text(base: &str) -> String {
    let mut all = String::new();
    for path in [
        "/api/status",
        "/api/workers",
        "/api/contributors?limit=1000",
        "/api/contributors?format=csv",
        "/metrics",
    ] {
        let (code, body) = get(format!("{base}{path}")).await;
        assert_eq!(code, 200, "{path}");
        all.push_str(&String::from_utf8_lossy(&body));
    }
    all
}

/// The next binary frame on `ws`, or `None` once it closed (10 s at most).
async fn next(ws: &mut util::Ws) -> Option<Vec<u8>> {
    use futures_util::StreamExt;
    use tokio_tungstenite::tungstenite::Message;
    loop {
        match tokio::time::timeout(Duration::from_secs(10), ws.next()).await {
            Ok(Some(Ok(Message::Binary(b)))) => return Some(b.into()),
            Ok(Some(Ok(Message::Close(_)))) | Ok(None) | Ok(Some(Err(_))) | Err(_) => return None,
            Ok(Some(Ok(_))) => continue,
        }
    }
}

/// Says Hello for `j` on shard 0: the socket, slice length and version, or the refusal.
async fn hello(
    running: &crowdgrad::Running,
    j: &JoinResponse,
) -> Result<(util::Ws, usize, u64), ErrorCode> {
    let mut ws = util::connect(running, 0).await;
    let h = util::hello(j.worker_id)
        .shard(0)
        .request_id(1)
        .credential(j.credential.clone())
        .frame();
    util::send(&mut ws, h).await;
    match wire::decode(&next(&mut ws).await.expect("an answer"), usize::MAX).expect("decodes") {
        Frame::Welcome { welcome, .. } => Ok((ws, welcome.range.len(), welcome.version)),
        Frame::Error { error, .. } => Err(error.code),
        other => panic!("expected Welcome, got {other:?}"),
    }
}

/// The impostor: joins as `identity` (named "Impostor", team "Red"), says Hello on shard 0
/// with its valid credential, pushes `good` small gradients, then NaN gradients (refused
/// `not_finite`, which closes the connection and counts towards quarantine; it reconnects)
/// until the shard refuses it as quarantined. Returns the join and the refusal codes it got.
async fn impostor(
    running: &crowdgrad::Running,
    identity: &str,
    good: u32,
) -> (JoinResponse, Vec<ErrorCode>) {
    use futures_util::SinkExt;
    let url = running.url();
    let mut req = JoinRequest::new(ClientKind::Native);
    req.identity = Some(identity.into());
    req.name = Some("Impostor".into());
    req.team = Some("Red".into());
    let (code, body) = util::try_join(&url, &req).await;
    assert_eq!(
        code,
        200,
        "the impostor's join: {}",
        String::from_utf8_lossy(&body)
    );
    let j: JoinResponse = serde_json::from_slice(&body).expect("join reply");
    let batch = j.run.batch_size as u32;
    let mut codes = Vec::new();
    let mut socket = None;
    for rid in 2..100u32 {
        let (ws, len, version) = match socket.as_mut() {
            Some(s) => s,
            None => match hello(running, &j).await {
                Ok(s) => socket.insert(s),
                Err(c) => {
                    codes.push(c);
                    break;
                }
            },
        };
        let grad: Vec<f32> = if rid < 2 + good {
            (0..*len)
                .map(|i| ((i as f32 + rid as f32) * 0.37).sin() * 1e-4)
                .collect()
        } else {
            vec![f32::NAN; *len]
        };
        let f = wire::encode_push(rid, 0, *version, batch, &grad);
        let reply = if ws
            .send(tokio_tungstenite::tungstenite::Message::Binary(f.into()))
            .await
            .is_err()
        {
            None
        } else {
            loop {
                let Some(b) = next(ws).await else {
                    break None;
                };
                match wire::decode(&b, usize::MAX) {
                    Ok(Frame::Ack {
                        request_id,
                        version: v,
                        ..
                    }) if request_id == rid => {
                        *version = v;
                        break Some(None);
                    }
                    Ok(Frame::Error {
                        request_id, error, ..
                    }) if request_id == rid || request_id == 0 => break Some(Some(error.code)),
                    _ => continue,
                }
            }
        };
        match reply {
            None => socket = None,
            Some(None) => {}
            Some(Some(c)) => {
                codes.push(c);
                if c == ErrorCode::Quarantined {
                    break;
                }
                // A refusal may close the connection: the next push finds out and reconnects.
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    (j, codes)
}

/// Issue 21 regression: with quarantine on (5 refusals), a client that knows only the
/// owner's public id joins with it, renames, pushes and is quarantined; none of it touches the
/// owner, whose next join succeeds with its name, team and credit unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_21_a_public_id_cannot_rename_credit_or_quarantine_its_owner() {
    let mut cfg = config();
    cfg.spot.quarantine.rejections = 5;
    cfg.admin_token = Some(crowdgrad::support::credential::Secret::new(ADMIN));
    let running = server(cfg).await;
    let url = running.url();

    // The owner: a real worker with a secret, a name and a team, credited some samples.
    let secret = "3f1c9a0d5b7e42c68a19f0e3d2b4c6a8";
    let mut o = WorkOptions::new(&url);
    o.identity = Some(secret.into());
    o.name = Some("Owner".into());
    o.team = Some("Blue".into());
    o.steps = Some(20);
    o.duration = Some(Duration::from_secs(120));
    o.threads = 1;
    let sum = tokio::task::spawn_blocking(move || WorkerThread::spawn(o).join())
        .await
        .expect("join")
        .expect("the owner trains");
    let owner = public_id(secret);
    assert_eq!(sum.public_id.as_deref(), Some(owner.as_str()));
    // What the world sees: the public id, never the secret.
    let before = board(&url, &owner).await;
    let you = before["you"].clone();
    assert_eq!(
        before["contributors"][0]["identity"],
        owner.as_str(),
        "{before}"
    );
    assert_eq!(
        (you["name"].as_str(), you["team"].as_str()),
        (Some("Owner"), Some("Blue")),
        "{before}"
    );
    assert!(you["samples"].as_u64() > Some(0), "{before}");
    assert!(!public_text(&url).await.contains(secret));

    // The impostor joins with the public id as its identity: a different public id.
    let (j, codes) = impostor(&running, &owner, 3).await;
    let theirs = public_id(&owner);
    assert_ne!(theirs, owner);
    assert_eq!(
        codes.last(),
        Some(&ErrorCode::Quarantined),
        "NaN pushes quarantine the impostor: {codes:?}"
    );
    assert!(
        codes
            .iter()
            .filter(|c| **c != ErrorCode::Quarantined)
            .count()
            >= 5,
        "{codes:?}"
    );
    let s = status(&url).await;
    let rep = &s["reputation"]["workers"][j.worker_id.to_string()];
    assert!(rep["quarantined"].is_object(), "{rep}");
    assert_eq!(
        rep["identity"],
        theirs.as_str(),
        "quarantine binds the impostor's own public id"
    );
    // The quarantine holds what the impostor holds: its identity is refused...
    let (code, body) = join_as(&url, &owner).await;
    assert_eq!(code, 403, "{}", String::from_utf8_lossy(&body));
    // ...and the owner's is not, nor is anything of the owner's changed.
    let (code, body) = join_as(&url, secret).await;
    assert_eq!(
        code,
        200,
        "the owner's join: {}",
        String::from_utf8_lossy(&body)
    );
    let after = board(&url, &owner).await;
    let now = &after["you"];
    for k in [
        "samples",
        "pushes_accepted",
        "pushes_rejected",
        "compute_seconds",
        "name",
        "team",
        "client",
    ] {
        assert_eq!(now[k], you[k], "{k}: before {you}, after {now}");
    }
    assert_eq!(
        now["sessions"].as_u64(),
        you["sessions"].as_u64().map(|n| n + 1),
        "{now}"
    );
    // Everything the impostor did is on its own line.
    let imp = board(&url, &theirs).await;
    let imp = &imp["you"];
    assert_eq!(
        (imp["name"].as_str(), imp["team"].as_str()),
        (Some("Impostor"), Some("Red")),
        "{imp}"
    );
    assert_eq!(imp["sessions"], 1, "{imp}");
    let text = public_text(&url).await;
    assert!(!text.contains(secret), "the owner's secret is never shown");
    // A lookup with a secret is refused, not looked up; it is not echoed.
    let (code, body) = get(format!("{url}/api/contributors?identity={secret}")).await;
    assert_eq!(code, 400);
    assert!(!String::from_utf8_lossy(&body).contains(secret));

    // The admin lifts the quarantine by the public id the status shows (a secret is refused
    // as not being one).
    let ctl = |who: &str| {
        util::crowdgrad()
            .args([
                "ctl",
                "--server",
                &url,
                "--token",
                ADMIN,
                "unquarantine",
                "--identity",
                who,
            ])
            .output()
            .expect("ctl runs")
    };
    let s = status(&url).await;
    let quarantined: Vec<&serde_json::Value> = s["reputation"]["workers"]
        .as_object()
        .expect("workers")
        .values()
        .filter(|r| r["quarantined"].is_object())
        .collect();
    assert!(
        quarantined.len() == 1 && quarantined[0]["identity"] == theirs.as_str(),
        "only the impostor's public id is quarantined: {quarantined:?}"
    );
    let out = ctl(secret);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("public id"),
        "{out:?}"
    );
    let out = ctl(&theirs);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(join_as(&url, &owner).await.0, 200);
    running.stop().await.expect("stops");
}

/// `crowdgrad work --id-file`: the secret is drawn once (32 hex digits), kept in a file only
/// its owner can read, and credited under its public id in every run; the worker says which.
#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_native_workers_id_file_is_a_secret_of_mode_0600() {
    use std::os::unix::fs::PermissionsExt;
    let running = server(config()).await;
    let url = running.url();
    let dir = util::scratch("identity", "id-file");
    let file = dir.join("keys/worker-id");
    let run = |tag: &str| {
        let mut c = util::crowdgrad();
        c.args([
            "work",
            "--json",
            "--threads",
            "1",
            "--steps",
            "5",
            "--server",
            &url,
        ])
        .arg("--id-file")
        .arg(&file);
        Proc::spawn(c, tag)
    };
    let mut publics = Vec::new();
    for tag in ["id-file-first", "id-file-second"] {
        let mut w = run(tag);
        let st = w
            .exit_within(Duration::from_secs(120))
            .await
            .unwrap_or_else(|| panic!("{tag} did not finish: {}", w.stderr()));
        assert!(st.success(), "{tag}: {}", w.stderr());
        let sum: serde_json::Value = serde_json::from_str(w.stdout().trim()).expect("summary");
        publics.push(sum["public_id"].as_str().expect("public id").to_string());
    }
    let meta = std::fs::metadata(&file).expect("the id file");
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let secret = std::fs::read_to_string(&file)
        .expect("read")
        .trim()
        .to_string();
    assert!(
        secret.len() == 32 && secret.bytes().all(|b| b.is_ascii_hexdigit()),
        "{secret}"
    );
    let public = public_id(&secret);
    assert!(check_public_id(&public).is_ok());
    assert_eq!(
        publics,
        [public.clone(), public.clone()],
        "the same volunteer both runs"
    );
    let b = board(&url, &public).await;
    assert_eq!(b["you"]["sessions"], 2, "{b}");
    assert_eq!(b["you"]["client"], "native", "{b}");
    assert!(!public_text(&url).await.contains(&secret));
    running.stop().await.expect("stops");
}

/// A ledger file of schema version 2 (before issue 21: keyed by the identities themselves,
/// which were public) opened by `serve --ledger`: re-keyed by hashing, the old strings gone
/// from every answer, and a volunteer joining with its old string continues its own line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_ledger_is_rekeyed_by_public_id_and_its_volunteers_keep_their_credit() {
    let dir = util::scratch("identity", "old-ledger");
    let path = dir.join("ledger.sqlite");
    let old = "old-volunteer-identity-01";
    let other = "another-old-volunteer-02";
    // The hour of its credit is this one (older hourly rows are deleted by the writer).
    let hour = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs()
        / 3600;
    {
        let c = rusqlite::Connection::open(&path).expect("create");
        c.execute_batch(crowdgrad::registry::ledger::db::MIGRATIONS[0])
            .expect("v1");
        c.execute_batch(crowdgrad::registry::ledger::db::MIGRATIONS[1])
            .expect("v2");
        c.execute_batch(&format!(
            "PRAGMA application_id = {}; PRAGMA user_version = 2;
             INSERT INTO contributors VALUES ('{old}', 'Veteran', 'browser', 1234, 40, 2, 9.5, 3, 1e9, 1.1e9, 'Old Guard');
             INSERT INTO contributors VALUES ('{other}', 'Other', 'native', 10, 1, 0, 0.5, 1, 1e9, 1e9, NULL);
             INSERT INTO hourly VALUES ('{old}', {hour}, 1234, 9.5);
             INSERT INTO buckets VALUES ({}, 1), (10, 1);
             INSERT INTO teams VALUES ('Old Guard', 1, 1234);
             UPDATE meta SET value = 2 WHERE key = 'identities';
             UPDATE meta SET value = 1244 WHERE key = 'samples';",
            crowdgrad::registry::ledger::db::APPLICATION_ID,
            crowdgrad::registry::ledger::db::bucket(1234),
        ))
        .expect("old rows");
    }
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
    .arg("--ledger")
    .arg(&path)
    .env("RUST_LOG", "info");
    let mut serve = Proc::spawn(c, "identity-old-ledger");
    let url = serve.listening(Duration::from_secs(60));
    let public = public_id(old);
    let b = board(&url, &public).await;
    assert_eq!(b["total"], 2, "{b}");
    let you = &b["you"];
    assert_eq!(you["samples"], 1234, "{b}");
    assert_eq!(
        (you["name"].as_str(), you["team"].as_str()),
        (Some("Veteran"), Some("Old Guard"))
    );
    assert!(
        you["recent"].as_f64() > Some(0.0),
        "its hourly credit moved with it: {b}"
    );
    assert_eq!(b["teams"][0]["samples"], 1234, "{b}");
    let text = public_text(&url).await;
    assert!(
        !text.contains(old) && !text.contains(other),
        "the old strings are shown nowhere"
    );
    assert!(text.contains(&public) && text.contains(&public_id(other)));
    // The volunteer whose browser still holds the old string joins with it: its own line.
    let (code, body) = join_as(&url, old).await;
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    let started = Instant::now();
    loop {
        let b = board(&url, &public).await;
        if b["you"]["sessions"] == 4 {
            assert_eq!(b["you"]["samples"], 1234);
            assert_eq!(b["total"], 2, "no new line: {b}");
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the join was not credited: {b}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    serve.terminate();
    let _ = serve.exit_within(Duration::from_secs(30)).await;
    // On disk: version 3, every key a public id.
    let c = rusqlite::Connection::open(&path).expect("open");
    let v: i64 = c
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .expect("version");
    assert_eq!(v, 3);
    let keys: Vec<String> = c
        .prepare("SELECT identity FROM contributors UNION ALL SELECT identity FROM hourly")
        .expect("prepare")
        .query_map([], |r| r.get(0))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    assert_eq!(keys.len(), 3, "{keys:?}");
    assert!(keys.iter().all(|k| check_public_id(k).is_ok()), "{keys:?}");
}
