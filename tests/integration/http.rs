//! The HTTP API: join, data partitions, status, static page.

use crate::util::{config, get, join, post, server, status};
use crowdgrad_core::data::Dataset;
use crowdgrad_core::spec::JoinRequest;
use crowdgrad_core::wire::ClientKind;

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
    assert_ne!(a.partition.index, b.partition.index);
    let (c1, images) = get(format!("{url}{}", a.partition.images)).await;
    let (c2, labels) = get(format!("{url}{}", a.partition.labels)).await;
    assert_eq!((c1, c2), (200, 200));
    let d = Dataset::from_idx(&images, &labels).expect("IDX partition");
    assert_eq!(d.len(), a.partition.examples);
    assert_eq!(d.len(), 10_000);
    // Unknown data tags and partitions are 404s.
    let (c, _) = get(format!("{url}/api/data/nope/train/0/images")).await;
    assert_eq!(c, 404);
    let bad_index = a.partition.images.replace("/train/0/", "/train/99/");
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
    let (c, body) = post(
        format!("{url}/api/join"),
        serde_json::to_vec(&req).expect("json"),
    )
    .await;
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
    let (encoding, compressed) = tokio::task::spawn_blocking(move || {
        let mut r = ureq::get(&target)
            .header("accept-encoding", "gzip")
            .call()
            .expect("request");
        let enc = r
            .headers()
            .get("content-encoding")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        (
            enc,
            r.body_mut()
                .with_config()
                .limit(1 << 30)
                .read_to_vec()
                .expect("body"),
        )
    })
    .await
    .expect("join");
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
