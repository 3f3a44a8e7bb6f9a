//! Issue 11: one volunteer, several cores. `crowdgrad work --threads 2` (the real binary)
//! trains as two worker loops that the server shows as one volunteer with two threads on one
//! data partition, credited to one ledger identity; bad `threads` in a join are refused.

use crate::util::{config, get, server, status, try_join, wait_for, Proc};
use crowdgrad_core::spec::{JoinRequest, Threads};
use crowdgrad_core::wire::ClientKind;
use std::time::{Duration, Instant};

const IDENTITY: &str = "threads-test-volunteer";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_threads_2_trains_as_one_volunteer_with_two_threads() {
    let running = server(config()).await;
    let url = running.url();
    let before = status(&url).await["eval"]["accuracy"]
        .as_f64()
        .unwrap_or(0.0);
    let mut child = Proc::crowdgrad(
        "threads-2",
        &[
            "work",
            "--json",
            "--threads",
            "2",
            "--seconds",
            "120",
            "--id",
            IDENTITY,
            "--server",
            &url,
        ],
    );
    let s = wait_for(
        &url,
        Duration::from_secs(60),
        "two threads training, one volunteer",
        |s| {
            let w = s["workers"].as_array().cloned().unwrap_or_default();
            s["workers_connected"] == 2
                && s["totals"]["workers"]["volunteers"]["connected"] == 1
                && w.len() == 2
                && w.iter().all(|w| w["pushes_applied"].as_u64() > Some(20))
        },
    )
    .await;
    let w = s["workers"].as_array().cloned().unwrap_or_default();
    assert_eq!(w[0]["threads"]["volunteer"], w[1]["threads"]["volunteer"]);
    assert_eq!(w[0]["threads"]["count"], 2);
    let mut idx: Vec<_> = w.iter().map(|w| w["threads"]["index"].clone()).collect();
    idx.sort_by_key(|v| v.as_u64());
    assert_eq!(idx, vec![serde_json::json!(0), serde_json::json!(1)]);
    assert_eq!(
        w[0]["partition"], w[1]["partition"],
        "a volunteer's threads share one partition"
    );
    assert_eq!(s["totals"]["workers"]["native"]["connected"], 2);
    let done = wait_for(&url, Duration::from_secs(60), "accuracy to rise", |s| {
        s["eval"]["accuracy"].as_f64().unwrap_or(0.0) >= 0.85
    })
    .await;
    assert!(done["eval"]["accuracy"].as_f64().unwrap_or(0.0) > before + 0.3);
    // Both threads' pushes add up into the one identity's ledger entry.
    let (code, body) = get(format!("{url}/api/contributors")).await;
    assert_eq!(code, 200);
    let ledger: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
    let text = ledger.to_string();
    let public = crowdgrad::registry::ledger::public_id(IDENTITY);
    assert!(text.contains(&public) && !text.contains(IDENTITY), "{text}");
    // SIGTERM stops both threads within 2 s, and the summary sums them.
    let sent = Instant::now();
    child.terminate();
    let exit = child
        .exit_within(Duration::from_secs(5))
        .await
        .expect("the worker stops on SIGTERM within 5 s");
    let took = sent.elapsed();
    assert!(took < Duration::from_secs(2), "stopped after {took:?}");
    assert!(exit.success(), "{exit:?}");
    let out = child.stdout();
    let summary: serde_json::Value = serde_json::from_str(out.trim()).expect("summary JSON");
    assert_eq!(summary["threads"], 2, "{summary}");
    assert_eq!(summary["worker_ids"].as_array().map(Vec::len), Some(2));
    let end = status(&url).await;
    let applied: u64 = end["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|w| w["pushes_applied"].as_u64())
        .sum();
    let acked = summary["stats"]["pushes_accepted"].as_u64().unwrap_or(0);
    assert!(
        acked > 40 && acked <= applied,
        "{acked} acked, {applied} applied"
    );
    running.stop().await.expect("clean shutdown");
}

#[tokio::test]
async fn a_join_with_bad_threads_is_refused_and_registers_nobody() {
    let running = server(config()).await;
    let url = running.url();
    let bad = [
        ("short", 0, 2),
        ("volunteer-ok", 2, 2),
        ("volunteer-ok", 0, 0),
        ("volunteer-ok", 0, 1000),
        ("volunteer ok!", 0, 2),
    ];
    for (volunteer, index, count) in bad {
        let mut req = JoinRequest::new(ClientKind::Native);
        req.threads = Some(Threads {
            volunteer: volunteer.into(),
            index,
            count,
        });
        let (code, body) = try_join(&url, &req).await;
        let text = String::from_utf8_lossy(&body);
        assert_eq!(code, 400, "{volunteer} {index}/{count}: {text}");
        assert!(text.contains("threads."), "{text}");
    }
    let s = status(&url).await;
    assert_eq!(s["totals"]["workers"]["registered"], 0);
    running.stop().await.expect("clean shutdown");
}
