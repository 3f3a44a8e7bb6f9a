//! `crowdgrad bench attack` keeps working: its cheapest attacks (replays and a stale tag)
//! against a default and a spot-checking server, run as the command a reader of
//! docs/benchmarks.md would run, and its printed verdicts read back.
//!
//! Asserted on behaviour only (what the server answered, as the bench printed it), never on a
//! time: a push frame replayed on a new connection and the same gradient under new request ids
//! are refused on both servers (`holds`); a push tagged 200 versions back is refused
//! `too_stale` by both (`holds`): the default server spot-checks too since issue 21
//! (`--spot-check auto`), so it keeps versions and the claim is made for it (it said `- (no
//! spot checks ...)` when it kept none).

use crate::util::{mnist_dir, Proc};
use std::time::Duration;

/// The summary row of `attack` on `server`, e.g. `| replays | spot | holds |`.
fn row<'a>(out: &'a str, attack: &str, server: &str) -> &'a str {
    let head = format!("| {attack} | {server} | ");
    out.lines()
        .find(|l| l.starts_with(&head))
        .unwrap_or_else(|| panic!("no summary row {head:?} in:\n{out}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_attack_prints_its_verdicts_for_replays_and_stale_tags() {
    let data = mnist_dir();
    let mut p = Proc::crowdgrad(
        "bench-attack",
        &[
            "bench",
            "attack",
            "--quick",
            "--only",
            "replays,stale",
            "--data-dir",
            data.to_str().expect("utf-8 path"),
        ],
    );
    // Generous: two servers, one honest worker of 300 steps each, on a loaded machine.
    let status = p
        .exit_within(Duration::from_secs(600))
        .await
        .unwrap_or_else(|| panic!("still running after 600 s:\n{}", p.stdout()));
    let out = p.stdout();
    println!("{out}");
    assert!(status.success(), "{status}: {}\n{out}", p.stderr());
    for server in ["default", "spot"] {
        assert_eq!(
            row(&out, "replays", server),
            format!("| replays | {server} | holds |")
        );
    }
    assert!(
        out.contains("same frame on a new connection: replayed"),
        "{out}"
    );
    assert_eq!(
        row(&out, "stale tag (200 back)", "spot"),
        "| stale tag (200 back) | spot | holds |"
    );
    assert!(
        out.contains("push tagged") && out.contains(": too_stale;"),
        "{out}"
    );
    assert_eq!(
        row(&out, "stale tag (200 back)", "default"),
        "| stale tag (200 back) | default | holds |"
    );
}
