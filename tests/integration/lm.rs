//! Issue 20: the language model under the defences built for the MLP. A `gpt` run is
//! spot-checked like any other (the server recomputes a worker's round of next-token
//! gradients on the windows it drew and compares them in the push's encoding), and robust
//! aggregation keeps a sign-flipping worker from wrecking it. Real processes on a small text
//! written here (a tiny `gpt` so the tests stay quick in a debug or release build).

use crate::util::{crowdgrad, scratch, status, wait_for, Proc};
use std::path::Path;
use std::time::Duration;

/// A small English text with enough regularity for a tiny model to learn in a few hundred
/// steps: train.txt and valid.txt in `dir`.
fn write_text(dir: &Path) {
    let lines = [
        "the quick brown fox jumps over the lazy dog.",
        "a stitch in time saves nine, and the dog sleeps.",
        "the fox runs, the dog barks, the bird sings.",
        "time and tide wait for no one at all.",
    ];
    let train: String = (0..600)
        .map(|i| format!("{} {}\n", lines[i % 4], lines[(i * 7 + 1) % 4]))
        .collect();
    std::fs::write(dir.join("train.txt"), train).expect("write train.txt");
    std::fs::write(
        dir.join("valid.txt"),
        (0..40)
            .map(|i| format!("{} {}\n", lines[(i + 2) % 4], lines[i % 4]))
            .collect::<String>(),
    )
    .expect("write valid.txt");
}

const MODEL: &str = "gpt:1,16,2,16";

/// A real `crowdgrad serve` of the text in `dir` with every push spot-checked, pushes asked in
/// `encoding`. Rounds of 4 local steps, not `serve`'s default `auto`: `auto` picks H from the
/// machine's timing, so how many rounds (and checks) 60 steps make varied with the load (a
/// loaded run once made 8 of the 10 checks waited for).
fn serve(dir: &Path, encoding: &str) -> (Proc, String) {
    let mut c = crowdgrad();
    c.args(["serve", "--addr", "127.0.0.1:0", "--no-fetch"])
        .args(["--dataset", "toy-text", "--model", MODEL])
        .args(["--optimizer", "adamw", "--lr", "0.003", "--eval-every", "1"])
        .args(["--local-steps", "4"])
        .args(["--spot-check", "1", "--push-encoding", encoding])
        .arg("--data-dir")
        .arg(dir);
    let mut p = Proc::spawn(c, &format!("lm-serve-{encoding}"));
    let url = p.listening(Duration::from_secs(60));
    (p, url)
}

/// A real `crowdgrad work` of `steps` steps, optionally faulty; waits for it to end.
async fn work(url: &str, steps: u32, fault: Option<&str>) -> serde_json::Value {
    let mut c = crowdgrad();
    c.args([
        "work",
        "--json",
        "--quiet",
        "--threads",
        "1",
        "--server",
        url,
    ])
    .args(["--steps", &steps.to_string()]);
    if let Some(f) = fault {
        c.args(["--fault", f]);
    }
    let mut w = Proc::spawn(c, "lm-work");
    let st = w
        .exit_within(Duration::from_secs(300))
        .await
        .unwrap_or_else(|| panic!("the worker did not finish: {}", w.stderr()));
    if fault.is_none() {
        assert!(st.success(), "worker failed: {}", w.stderr());
        serde_json::from_str(w.stdout().trim()).expect("the worker's JSON summary")
    } else {
        serde_json::Value::Null
    }
}

/// Honest `gpt` workers pass every spot check in every push encoding (f32, bf16, int8 blocks
/// with error feedback), and a worker pushing noise of the gradient's norm is caught and
/// quarantined.
#[tokio::test]
async fn issue20_gpt_pushes_are_spot_checked_honest_ones_pass_in_every_encoding_noise_is_caught() {
    let dir = scratch("lm", "spot");
    write_text(&dir);
    for encoding in ["f32", "bf16", "int8_block"] {
        let (mut server, url) = serve(&dir, encoding);
        let sum = work(&url, 60, None).await;
        assert!(
            sum["stats"]["pushes_accepted"].as_u64() > Some(0),
            "{encoding}: {sum}"
        );
        let s = wait_for(
            &url,
            Duration::from_secs(120),
            "the honest gpt worker's checks",
            |s| {
                let c = &s["spot_checks"];
                c["passed"].as_u64().unwrap_or(0) + c["failed"].as_u64().unwrap_or(0) >= 10
            },
        )
        .await;
        assert_eq!(
            s["spot_checks"]["failed"], 0,
            "{encoding}: {}",
            s["spot_checks"]
        );
        assert_eq!(s["reputation"]["quarantined"], 0, "{encoding}");
        if encoding == "int8_block" {
            // The same server: a worker whose pushes are noise is quarantined.
            work(&url, 200, Some("noise")).await;
            let s = wait_for(
                &url,
                Duration::from_secs(120),
                "the noise worker's quarantine",
                |s| s["reputation"]["quarantined"].as_u64() == Some(1),
            )
            .await;
            assert!(
                s["spot_checks"]["failed"].as_u64() >= Some(1),
                "{}",
                s["spot_checks"]
            );
            // The honest worker's checks still all passed: only the noise failed.
            let st = status(&url).await;
            assert_eq!(st["reputation"]["quarantined"], 1);
        }
        server.kill();
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The final validation loss of each labelled line of a simulation's summary.csv.
fn final_losses(out: &Path) -> Vec<(String, f64)> {
    let csv = std::fs::read_to_string(out.join("summary.csv")).expect("summary.csv");
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    let at = header
        .iter()
        .position(|h| *h == "final_loss")
        .expect("final_loss column");
    lines
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            (f[0].to_string(), f[at].parse().expect("a loss"))
        })
        .collect()
}

/// A `crowdgrad sim` of 5 workers in sync:5 on the text, `faulty` of them flipping their
/// gradient ×10, over `sweep`. Deterministic: the same seed gives the same losses.
async fn sim(dir: &Path, out: &Path, faulty: &str, sweep: &str) -> Vec<(String, f64)> {
    let mut c = crowdgrad();
    c.args(["sim", "--quiet", "--no-fetch", "--model", MODEL])
        .args(["--workers", "5", "--consistency", "sync:5", "--shards", "2"])
        .args([
            "--optimizer",
            "adamw",
            "--lr",
            "0.003",
            "--samples",
            "16000",
        ])
        .args([
            "--eval-every",
            "8000",
            "--faulty",
            faulty,
            "--fault",
            "signflip:10",
        ])
        .args(["--sweep", sweep])
        .arg("--data-dir")
        .arg(dir)
        .arg("--out")
        .arg(out);
    let mut p = Proc::spawn(c, "lm-sim");
    let st = p.exit_within(Duration::from_secs(600)).await;
    assert!(
        st.is_some_and(|s| s.success()),
        "sim failed: {}",
        p.stderr()
    );
    final_losses(out)
}

/// Robust aggregation on the language model: one sign-flipping worker of five (×10) wrecks the
/// mean of each sync:5 round, and the coordinate-wise median keeps the run near the clean one.
#[tokio::test]
async fn issue20_the_median_keeps_a_gpt_run_from_a_sign_flipping_worker() {
    let dir = scratch("lm", "robust");
    write_text(&dir);
    let clean = sim(&dir, &dir.join("clean"), "0", "aggregation=mean").await;
    let attacked = sim(
        &dir,
        &dir.join("attacked"),
        "0.2",
        "aggregation=mean;median",
    )
    .await;
    let loss = |v: &[(String, f64)], label: &str| {
        v.iter()
            .find(|(l, _)| l.contains(label))
            .unwrap_or_else(|| panic!("no {label} line in {v:?}"))
            .1
    };
    let (clean, mean, median) = (
        loss(&clean, "mean"),
        loss(&attacked, "mean"),
        loss(&attacked, "median"),
    );
    eprintln!(
        "gpt sync:5, 1 of 5 signflip:10: clean {clean:.4}, mean {mean:.4}, median {median:.4} nats"
    );
    assert!(clean.is_finite() && median.is_finite(), "{clean} {median}");
    assert!(
        !mean.is_finite() || mean > median + 0.3,
        "the attack did not hurt the mean ({mean}) more than the median ({median})"
    );
    assert!(
        median < clean + 0.25,
        "the median ({median}) is far from the clean run ({clean})"
    );
    std::fs::remove_dir_all(&dir).ok();
}
