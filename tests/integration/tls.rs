//! Issue 10, TLS: `crowdgrad serve --tls-cert --tls-key` serves https and wss; a native worker
//! trusting the test certificate (`--ca`) trains against it. The certificate is self-signed,
//! made here with rcgen for 127.0.0.1 and localhost.

use crate::util::{config, server};
use crowdgrad::support::tls::TlsFiles;
use crowdgrad::worker::{WorkOptions, WorkerThread};
use std::path::PathBuf;
use std::time::Duration;

/// A self-signed certificate for 127.0.0.1/localhost in a fresh directory: (cert, key) paths.
pub fn test_cert(tag: &str) -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("crowdgrad-tls-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let c = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into(), "localhost".into()])
        .expect("certificate");
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert, c.cert.pem()).expect("write cert");
    std::fs::write(&key, c.signing_key.serialize_pem()).expect("write key");
    (cert, key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_native_worker_trains_over_https_and_wss() {
    let (cert, key) = test_cert("native");
    let mut cfg = config();
    cfg.tls = Some(TlsFiles {
        cert: cert.clone(),
        key,
    });
    let running = server(cfg).await;
    let url = running.url();
    assert!(url.starts_with("https://"), "{url}");

    // Without --ca the self-signed certificate is not trusted: no join, no training.
    let mut o = WorkOptions::new(&url);
    o.duration = Some(Duration::from_secs(2));
    let untrusted = WorkerThread::spawn(o.clone()).join().expect("summary");
    assert_eq!(untrusted.stats.steps, 0);
    let why = untrusted.last_error.unwrap_or_default();
    assert!(why.to_lowercase().contains("certificate"), "{why}");

    // Plain HTTP to the TLS port is refused (the handshake fails), the server carries on.
    let plain = format!("http://{}/api/status", running.addr);
    let r = tokio::task::spawn_blocking(move || ureq::get(&plain).call().map(|_| ()))
        .await
        .expect("request");
    assert!(r.is_err());

    o.ca = Some(cert);
    o.duration = Some(Duration::from_secs(60));
    let w = WorkerThread::spawn(o);
    let s = wait_for_status(&url).await;
    assert!(s["totals"]["pushes_applied"].as_u64() > Some(100), "{s}");
    assert!(s["limits"]["tls_handshakes_failed"].as_u64() >= Some(1));
    let summary = w.stop().expect("summary");
    assert!(summary.stats.pushes_accepted > 100, "{summary:?}");
    running.stop().await.expect("stops");
}

/// Polls `/api/status` over https (this test client skips certificate checks: what is under
/// test is the worker's verification) until 100 pushes were applied, or 30 s.
async fn wait_for_status(url: &str) -> serde_json::Value {
    let url = url.to_string();
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .tls_config(
                ureq::tls::TlsConfig::builder()
                    .disable_verification(true)
                    .build(),
            )
            .build()
            .into();
        let t0 = std::time::Instant::now();
        loop {
            let body = agent
                .get(&format!("{url}/api/status"))
                .call()
                .expect("status over https")
                .body_mut()
                .read_to_vec()
                .expect("body");
            let s: serde_json::Value = serde_json::from_slice(&body).expect("json");
            if s["totals"]["pushes_applied"].as_u64() > Some(100)
                || t0.elapsed() > Duration::from_secs(30)
            {
                return s;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    })
    .await
    .expect("status")
}
