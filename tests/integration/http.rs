//! The HTTP API: join, data partitions, status, the paged worker list, static page.

use crate::util::{
    config, get, handshake, join, post, recv, send, server, status, try_join, wait_for,
};
use crowdgrad::worker::{WorkOptions, WorkerThread};
use crowdgrad_core::data::Dataset;
use crowdgrad_core::spec::JoinRequest;
use crowdgrad_core::wire::{self, ClientKind, ErrorCode, Message as Frame};
use futures_util::SinkExt;
use std::time::Duration;
use tokio_tungstenite::tungstenite::Message;

#[tokio::test]
async fn join_hands_out_ids_spec_and_data() {
    let running = server(config()).await;
    let url = running.url();
    let a = join(&url).await;
    let b = join(&url).await;
    assert_ne!(a.worker_id, b.worker_id);
    assert_eq!(a.run.shards.len(), 2);
    assert_eq!(a.run.model.to_string(), "mlp 784-128-10");
    a.run.validate().expect("a consistent run spec");
    // Issue 18: the first worker trains on the whole set, the second on half of it (so two
    // workers cover every example; `--partitions 6` is the finest cut).
    assert_eq!((a.partition.index, a.partition.count), (0, 1));
    assert_eq!(b.partition.count, 2);
    for (p, want) in [(&a.partition, 60_000), (&b.partition, 30_000)] {
        let (c1, images) = get(format!("{url}{}", p.images)).await;
        let (c2, labels) = get(format!("{url}{}", p.labels)).await;
        assert_eq!((c1, c2), (200, 200));
        let d = Dataset::from_idx(&images, &labels).expect("IDX partition");
        assert_eq!(d.len(), p.examples);
        assert_eq!(d.len(), want);
    }
    // Ten more workers: the cut reaches 6 parts (the sixth worker's), and the six joins
    // after that take six different ones.
    let mut sixths = Vec::new();
    for k in 3..=12 {
        let p = join(&url).await.partition;
        assert_eq!(p.count, k.min(6), "worker {k}");
        if k > 6 {
            sixths.push(p.index);
        }
    }
    sixths.sort_unstable();
    sixths.dedup();
    assert!(sixths.len() >= 5, "{sixths:?}");
    // Unknown data tags, cuts finer than --partitions and partitions are 404s.
    let (c, _) = get(format!("{url}/api/data/nope/train/0/images")).await;
    assert_eq!(c, 404);
    let too_fine = a.partition.images.replace("-1/train/", "-7/train/");
    assert_ne!(too_fine, a.partition.images);
    let (c, _) = get(format!("{url}{too_fine}")).await;
    assert_eq!(c, 404);
    let bad_index = b
        .partition
        .images
        .replace("/train/1/", "/train/99/")
        .replace("/train/0/", "/train/99/");
    let (c, _) = get(format!("{url}{bad_index}")).await;
    assert_eq!(c, 404);
    running.stop().await.expect("clean shutdown");
}

#[tokio::test]
async fn bad_join_requests_get_clear_errors() {
    let running = server(config()).await;
    let url = running.url();
    let (c, body) = post(format!("{url}/api/join"), b"{not json".to_vec()).await;
    assert_eq!(c, 400);
    assert!(String::from_utf8_lossy(&body).contains("bad join request"));
    let mut req = JoinRequest::new(ClientKind::Browser);
    req.protocol = 77;
    let (c, body) = try_join(&url, &req).await;
    assert_eq!(c, 400);
    assert!(String::from_utf8_lossy(&body).contains("protocol 77"));
    assert_eq!(
        status(&url).await["workers"].as_array().map(Vec::len),
        Some(0),
        "failed joins register nobody"
    );
    running.stop().await.expect("clean shutdown");
}

#[tokio::test]
async fn status_reports_the_run_and_the_page_is_served() {
    let running = server(config()).await;
    let url = running.url();
    let s = status(&url).await;
    assert_eq!(s["model"], "mlp 784-128-10");
    assert_eq!(s["params"], 101_770);
    assert_eq!(s["consistency"], "async");
    assert_eq!(s["workers_connected"], 0);
    for key in ["shards", "workers", "totals", "eval_history"] {
        assert!(!s[key].is_null(), "{key} missing");
    }
    let (c, page) = get(format!("{url}/")).await;
    assert_eq!(c, 200);
    assert!(String::from_utf8_lossy(&page).contains("crowdgrad"));
    running.stop().await.expect("clean shutdown");
}

#[tokio::test]
async fn data_partitions_are_gzipped_for_clients_that_ask() {
    let running = server(config()).await;
    let url = running.url();
    let a = join(&url).await;
    let target = format!("{url}{}", a.partition.images);
    // A raw HTTP/1.0 request: an HTTP client library would decompress the body and drop the
    // header this checks. HTTP/1.0 gets a close-delimited body (no chunking to undo).
    let fetch = |target: String| async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = target
            .strip_prefix("http://")
            .and_then(|t| t.split_once('/'))
            .map(|(a, _)| a.to_string())
            .expect("http URL");
        let path = &target[target.find(&addr).expect("addr") + addr.len()..];
        let mut tcp = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect");
        let req = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\nAccept-Encoding: gzip\r\n\r\n");
        tcp.write_all(req.as_bytes()).await.expect("request");
        let mut raw = Vec::new();
        tokio::time::timeout(Duration::from_secs(30), tcp.read_to_end(&mut raw))
            .await
            .expect("in time")
            .expect("response");
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("end of headers");
        let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
        let enc = head
            .lines()
            .find_map(|l| l.strip_prefix("content-encoding:"))
            .map(|v| v.trim().to_string());
        let body = raw[split + 4..].to_vec();
        // Encoded once, ahead of the response (coordinator::parts), so it has a length: a
        // part compressed again on the request's path (the compression layer did that to the
        // raw form) went out with none, seconds late.
        let length = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok());
        assert_eq!(length, Some(body.len()), "{head}");
        (enc, body)
    };
    // The first download may get the raw part while the server compresses it once
    // (coordinator::parts); the compressed form follows within seconds.
    let start = std::time::Instant::now();
    let (encoding, compressed) = loop {
        let (enc, body) = fetch(target.clone()).await;
        if enc.is_some() || start.elapsed() > Duration::from_secs(60) {
            break (enc, body);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(encoding.as_deref(), Some("gzip"));
    let (_, plain) = get(format!("{url}{}", a.partition.images)).await;
    assert!(
        compressed.len() * 3 < plain.len(),
        "{} vs {} bytes",
        compressed.len(),
        plain.len()
    );
    // The core reader takes the gzip body as it is.
    let labels = get(format!("{url}{}", a.partition.labels)).await.1;
    let d = Dataset::from_idx(&compressed, &labels).expect("gzip IDX parses");
    assert_eq!(d.len(), a.partition.examples);
    running.stop().await.expect("clean shutdown");
}

fn json(body: &[u8]) -> serde_json::Value {
    serde_json::from_slice(body).expect("JSON body")
}

fn ids(list: &serde_json::Value) -> Vec<u64> {
    list.as_array()
        .expect("a list of workers")
        .iter()
        .map(|w| w["id"].as_u64().expect("an id"))
        .collect()
}

/// Issue 7: the status carries the 100 newest workers and totals by kind; `/api/workers` pages
/// every worker, newest first, and refuses bad parameters with a 400 that says why.
#[tokio::test]
async fn workers_are_paged_and_the_status_stays_small() {
    // 131 joins from one address in a second: more than --join-rate lets through.
    let mut cfg = config();
    cfg.limits.join_rate = 0;
    let running = server(cfg).await;
    let url = running.url();
    let mut joined = Vec::new();
    for _ in 0..130 {
        joined.push(join(&url).await.worker_id);
    }
    let (c, reply) = try_join(&url, &JoinRequest::new(ClientKind::Browser)).await;
    assert_eq!(c, 200);
    joined.push(json(&reply)["worker_id"].as_u64().expect("id"));
    let newest_first: Vec<u64> = joined.iter().rev().copied().collect();

    let s = status(&url).await;
    assert_eq!(ids(&s["workers"]), newest_first[..100].to_vec());
    let kinds = &s["totals"]["workers"];
    assert_eq!(kinds["registered"], 131, "{kinds}");
    assert_eq!(kinds["connected"], 0);
    assert_eq!(kinds["native"]["registered"], 130);
    assert_eq!(kinds["browser"]["registered"], 1);
    assert_eq!(s["workers_connected"], 0);

    // Default page: the same 100 as the status.
    let (c, body) = get(format!("{url}/api/workers")).await;
    assert_eq!(c, 200);
    let page = json(&body);
    assert_eq!(
        (page["total"].as_u64(), page["offset"].as_u64()),
        (Some(131), Some(0))
    );
    assert_eq!(ids(&page["workers"]), newest_first[..100].to_vec());
    // Walking pages of 40 visits everyone once, newest first.
    let mut walked = Vec::new();
    let mut offset = 0;
    loop {
        let (c, body) = get(format!("{url}/api/workers?offset={offset}&limit=40")).await;
        assert_eq!(c, 200);
        let page = ids(&json(&body)["workers"]);
        if page.is_empty() {
            break;
        }
        assert!(page.len() <= 40);
        offset += page.len();
        walked.extend(page);
    }
    assert_eq!(walked, newest_first);
    // A page's records are the status's: counters included.
    let (_, body) = get(format!("{url}/api/workers?limit=1")).await;
    let one = &json(&body)["workers"][0];
    for key in [
        "client",
        "connected",
        "pulls",
        "pushes_rejected",
        "frames_rejected",
    ] {
        assert!(!one[key].is_null(), "{key} missing in {one}");
    }

    for (query, says) in [
        ("limit=0", "limit must be between 1 and 1000"),
        ("limit=1001", "limit must be between 1 and 1000"),
        ("offset=-3", "offset must be a non-negative integer"),
        (
            "offset=1&limit=lots",
            "limit must be a non-negative integer",
        ),
        ("page=2", "unknown parameter"),
    ] {
        let (c, body) = get(format!("{url}/api/workers?{query}")).await;
        assert_eq!(c, 400, "{query}");
        let message = json(&body)["error"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(message.contains(says), "{query}: {message}");
    }
    running.stop().await.expect("clean shutdown");
}

/// Issue 7: `totals.pulls` was 0 while every shard counted thousands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn totals_count_pulls_after_training() {
    let running = server(config()).await;
    let url = running.url();
    let mut o = WorkOptions::new(&url);
    o.steps = Some(40);
    let w = WorkerThread::spawn(o);
    let summary = tokio::task::spawn_blocking(move || w.join())
        .await
        .expect("join")
        .expect("the worker finishes its steps");
    assert_eq!(summary.stats.steps, 40);
    let s = status(&url).await;
    let per_shard: u64 = s["shards"]
        .as_array()
        .expect("shards")
        .iter()
        .map(|sh| sh["pulls"].as_u64().unwrap_or(0))
        .sum();
    assert!(per_shard >= 2 * 40, "{per_shard}");
    assert_eq!(s["totals"]["pulls"].as_u64(), Some(per_shard));
    assert_eq!(s["workers"][0]["pulls"].as_u64(), Some(per_shard));
    running.stop().await.expect("clean shutdown");
}

/// Issue 7: a refused frame that is not a push (a text message, a pull for another shard)
/// counts as a rejected frame, per shard, per worker and in the totals; never as a rejected
/// push.
#[tokio::test]
async fn a_refused_frame_is_not_a_rejected_push() {
    let running = server(config()).await;
    let url = running.url();
    let me = join(&url).await.worker_id;

    let (mut ws, _) = handshake(&running, me, 0).await;
    ws.send(Message::Text("hello?".into())).await.expect("send");
    let reply = recv(&mut ws).await.expect("an error frame");
    assert!(matches!(
        wire::decode(&reply, usize::MAX).expect("decodes"),
        Frame::Error { error, .. } if error.code == ErrorCode::Malformed
    ));
    let (mut ws, _) = handshake(&running, me, 0).await;
    let pull = wire::encode(&Frame::Pull {
        request_id: 4,
        shard: 1,
        min_version: 0,
    });
    send(&mut ws, pull).await;
    let reply = recv(&mut ws).await.expect("an error frame");
    assert!(matches!(
        wire::decode(&reply, usize::MAX).expect("decodes"),
        Frame::Error { error, request_id: 4, .. } if error.code == ErrorCode::WrongShard
    ));

    let s = wait_for(
        &url,
        Duration::from_secs(10),
        "both refusals counted",
        |s| s["totals"]["frames_rejected"] == 2,
    )
    .await;
    for counters in [&s["shards"][0], &s["workers"][0], &s["totals"]] {
        assert_eq!(counters["pushes_rejected"], 0, "{counters}");
        assert_eq!(
            counters["rejected_by_reason"],
            serde_json::json!({}),
            "{counters}"
        );
        assert_eq!(counters["frames_rejected"], 2, "{counters}");
        assert_eq!(counters["frames_rejected_by_reason"]["malformed"], 1);
        assert_eq!(counters["frames_rejected_by_reason"]["wrong_shard"], 1);
    }
    assert_eq!(s["shards"][1]["frames_rejected"], 0);
    running.stop().await.expect("clean shutdown");
}
