//! Issue 10, load and churn: 1,000 WebSocket connections (real joins over HTTP, a Hello and
//! pulls on every shard socket) join and leave a release `crowdgrad serve` process on 127.0.0.1
//! (`crowdgrad::bench::churn`, the same code as `crowdgrad bench churn`), started as shipped: no
//! environment variables, the binary's own allocator. The server stays responsive, gives back
//! every file descriptor, and its memory returns to its baseline after every round.
//!
//! Memory: the server gives freed heap memory back after connections close (a `malloc_trim`
//! once open connections have fallen, server/src/trim.rs). Without it, glibc's malloc left RSS
//! at its peak (66 MiB before, ~410 MiB with 1,000
//! connections, ~400 MiB after each round: its dynamic mmap threshold rises after the first
//! large free and the per-connection buffers then come from arenas it does not trim), which
//! is why this test used to start the server with `MALLOC_MMAP_THRESHOLD_` fixed. It no
//! longer does: RSS, once it has stopped falling after a round, must be within 16 MiB of the
//! baseline. (The candidates side by side: docs/benchmarks.md.)
//! Latency: the figure (p99 of `/api/status` during the churn, target 100 ms) is printed and
//! recorded in docs/benchmarks.md; the test only asserts a bound that cannot flake on a busy CI
//! machine (1 s).

use crate::util::{binary, mnist_dir};
use crowdgrad::bench::churn::{churn, Churn, ChurnArgs};

/// RSS above the baseline allowed after a round. Since issue 18's own frame reader and writer
/// (no socket buffer grows or is kept) 1,000 connections cost ~10 MiB at the peak (70 → 80–81
/// MiB, 2026-12-05; ~37 MiB with tungstenite's 16 KiB write buffers, ~345 MiB before issue 18)
/// and RSS after a round measured +4 to +6.5 MiB. A connection's memory never given back would
/// leave about twice the peak's cost after the second round (+20 MiB).
const MIB_SLACK: f64 = 12.0;

/// RSS the connections must cost at the peak, above the baseline (else the "after" checks
/// would not tell anything).
const PEAK_MIB: f64 = 6.0;

/// RSS the second round may add to what the first left: half a round's peak cost. Measured
/// +2.2 MiB; a round's connections kept would add ~10.
const ROUND_GROWTH_MIB: f64 = 5.0;

fn run(rounds: usize, round_seconds: f64) -> Churn {
    let args = ChurnArgs {
        connections: 1000,
        rounds,
        round_seconds,
        pull_every: 5.0,
        malloc_mmap_threshold: None,
        server_env: Vec::new(),
        data_dir: mnist_dir(),
        serve_args: Vec::new(),
    };
    let c = churn(&binary(), &args).expect("the churn runs");
    println!("{c:#?}");
    assert_eq!(c.failures, 0, "{:?}", c.failure_reasons);
    assert_eq!(
        c.handshakes,
        rounds * c.connections,
        "every socket said Hello"
    );
    assert!(c.connections >= 1000);
    // Arrivals end at a third of the round, leaves start at two thirds: all open at once.
    assert_eq!(c.peak_open, c.connections, "{c:?}");
    assert!(c.pulls >= 2 * (rounds * c.connections) as u64, "{c:?}");
    assert_eq!(c.poll_failures, 0, "every status poll was answered");
    assert!(c.polls > 100, "{c:?}");
    assert!(
        c.status_p99_ms < 1000.0,
        "status p99 {} ms",
        c.status_p99_ms
    );
    for (peak, after) in c.fds_peak.iter().zip(&c.fds_after) {
        assert!(*peak >= c.fds_base + c.connections, "{c:?}");
        assert!(*after <= c.fds_base + 2, "fds leaked: {c:?}");
    }
    c
}

#[test]
fn a_thousand_connections_join_and_leave_twice_and_nothing_leaks() {
    let c = run(2, 30.0);
    assert!(
        c.rss_peak_mib[0] > c.rss_base_mib + PEAK_MIB,
        "the connections cost memory at the peak: {c:?}"
    );
    for after in &c.rss_after_mib {
        assert!(
            *after <= c.rss_base_mib + MIB_SLACK,
            "RSS did not return to its baseline: {c:?}"
        );
    }
    assert!(
        c.rss_after_mib[1] <= c.rss_after_mib[0] + ROUND_GROWTH_MIB,
        "the second round kept memory: {c:?}"
    );
}
