//! Issue 18, a crowd on one server: 400 simulated volunteers (`crowdgrad::bench::crowd`, the
//! same code as `crowdgrad bench crowd`: real joins with identities, a WebSocket per shard with
//! Hello and credential, pulls and pushes in the negotiated encodings every 2 s, Report frames,
//! and a gzip dashboard stream each) ramp up at 100 a second into a release `crowdgrad serve`
//! on 127.0.0.1, hold for 20 s and leave at the same rate.
//!
//! Asserted, with margins over what this 2-core machine measured with other builds beside it
//! (docs/benchmarks.md, "Crowd"). This very run measured 97 KiB per volunteer (load 4, with
//! our own frame reader on the shard sockets; 218 KiB with tungstenite's, whose read buffer
//! kept the size of the largest push; ~700 KiB before issue 18) and 976 B/s per dashboard
//! (~106 kB/s before), so both bounds fail on a return of either cost; a starved machine
//! lowers the dashboard bytes (fewer ticks get out), it does not raise them.
//! - every volunteer got in and nothing was refused;
//! - RSS per connected volunteer above the idle server: at most [`RSS_PER_VOLUNTEER_KIB`];
//! - bytes per second per open dashboard over the steady phase: at most
//!   [`DASHBOARD_BPS`] (the target is 3 kB/s with 1,000+ workers);
//! - after everyone left, the server's fds are back within [`FD_SLACK`] of the idle server's.

use crate::util::{binary, mnist_dir};
use crowdgrad::bench::crowd::CrowdArgs;
use crowdgrad::bench::crowdrun::crowd;

/// KiB of server RSS per connected volunteer above the idle baseline: about 2x the 97
/// measured, below the 218 of tungstenite's growing read buffer.
const RSS_PER_VOLUNTEER_KIB: f64 = 200.0;

/// Dashboard bytes per second per viewer over the steady phase: the target, 3x the 976
/// measured.
const DASHBOARD_BPS: f64 = 3_000.0;

/// Server fds above the idle baseline once everyone left (measured: 12 after, 13 idle).
const FD_SLACK: usize = 4;

#[test]
fn a_crowd_of_400_costs_bounded_memory_and_dashboard_bytes_and_gives_back_its_fds() {
    let mut args = CrowdArgs::new(400, mnist_dir());
    args.ramp_rate = 100.0;
    args.steady_seconds = 20.0;
    args.round_interval = 2.0;
    args.dashboard_fraction = 1.0;
    let c = crowd(&binary(), &args).expect("the crowd runs");
    println!("{}", c.table());
    println!("{c:#?}");
    let (ramp, steady) = (&c.phases[0], &c.phases[1]);
    assert_eq!(c.joined, 400, "{:?} {:?}", ramp.refusals, steady.refusals);
    // All in during the steady phase: both sockets of each open on average (measured 799.5 of
    // 800). Its end is when the first volunteers start leaving (100/s), so the end sample
    // counts a few less (measured 397-400).
    assert!(steady.training_sockets >= 790.0, "{steady:?}");
    assert!(steady.connected >= 390, "{:?}", steady.refusals);
    assert!(ramp.refusals.is_empty(), "{:?}", ramp.refusals);
    assert!(steady.refusals.is_empty(), "{:?}", steady.refusals);
    // The volunteers trained: about one round per 2 s each, on both shards.
    assert!(
        steady.pulls as f64 >= 400.0 * 2.0 * 20.0 / 2.0 * 0.5,
        "{steady:?}"
    );
    assert!(
        steady.pushes as f64 >= 400.0 * 2.0 * 20.0 / 2.0 * 0.5,
        "{steady:?}"
    );
    let per = steady
        .rss_per_volunteer_kib
        .expect("volunteers were connected");
    assert!(per <= RSS_PER_VOLUNTEER_KIB, "{per:.0} KiB per volunteer");
    assert!(steady.dashboards >= 390.0, "{steady:?}");
    assert!(
        steady.egress_per_dashboard_bps <= DASHBOARD_BPS,
        "{:.0} B/s per dashboard",
        steady.egress_per_dashboard_bps
    );
    // The stream did flow: ticks, not nothing.
    assert!(steady.egress_per_dashboard_bps >= 50.0, "{steady:?}");
    assert!(
        c.fds_after <= c.fds_base + FD_SLACK,
        "fds {} after, {} idle",
        c.fds_after,
        c.fds_base
    );
}

/// Issue 18's topology past one process's fds, small: the shards as `crowdgrad shard`
/// processes behind `serve --shard-urls`, the volunteers split over 2 child generators. Every
/// volunteer gets in and trains on both shard processes, every server-side process is
/// measured, and each gives its fds back once the crowd left.
#[test]
fn a_crowd_over_shard_processes_and_child_generators_trains_and_gives_back_its_fds() {
    let mut args = CrowdArgs::new(120, mnist_dir());
    args.ramp_rate = 100.0;
    args.steady_seconds = 8.0;
    args.round_interval = 2.0;
    args.shard_processes = true;
    args.generators = 2;
    args.egress_budget = Some("400mbit".into());
    let c = crowd(&binary(), &args).expect("the crowd runs");
    println!("{}\n{}", c.table(), c.process_table());
    assert_eq!(c.topology, ["serve", "shard 0", "shard 1"]);
    let steady = &c.phases[1];
    assert_eq!(c.joined, 120, "{:?}", c.phases);
    assert!(steady.refusals.is_empty(), "{:?}", steady.refusals);
    assert!(steady.training_sockets >= 230.0, "{steady:?}");
    // About one round per 2 s on both shards (the pace of 400mbit is far below 2 s here).
    assert!(
        steady.pulls as f64 >= 120.0 * 2.0 * 8.0 / 2.0 * 0.5,
        "{steady:?}"
    );
    assert!(
        steady.pushes as f64 >= 120.0 * 2.0 * 8.0 / 2.0 * 0.5,
        "{steady:?}"
    );
    for p in &c.procs {
        // Each server-side process held one socket per volunteer during the steady phase
        // (the coordinator: the dashboards).
        assert!(p.fds.1 >= p.fds.0 + 110, "{p:?}");
        assert!(p.fds.2 <= p.fds.0 + FD_SLACK, "{p:?}");
    }
}

/// The dashboard stream's body for ~3.5 s, as sent (gzip when `gzip`), de-chunked; over a
/// raw socket so the request carries exactly the `Accept-Encoding` a browser sends.
fn read_stream(url: &str, gzip: bool) -> Vec<u8> {
    use std::io::{Read, Write};
    let addr = url.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    let accept = if gzip {
        "Accept-Encoding: gzip, deflate, br\r\n"
    } else {
        ""
    };
    write!(
        s,
        "GET /api/events HTTP/1.1\r\nHost: {addr}\r\n{accept}\r\n"
    )
    .expect("request");
    let until = std::time::Instant::now() + std::time::Duration::from_millis(3_500);
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    while let Some(left) = until.checked_duration_since(std::time::Instant::now()) {
        s.set_read_timeout(Some(left.max(std::time::Duration::from_millis(1))))
            .expect("timeout");
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
    }
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("headers");
    let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert_eq!(head.contains("content-encoding: gzip"), gzip, "{head}");
    assert!(head.contains("transfer-encoding: chunked"), "{head}");
    // De-chunk what arrived (the last chunk may be cut off).
    let mut body = Vec::new();
    let mut rest = &raw[end + 4..];
    while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
        let size = std::str::from_utf8(&rest[..eol])
            .ok()
            .and_then(|h| usize::from_str_radix(h.trim(), 16).ok())
            .unwrap_or(0);
        let chunk = &rest[eol + 2..];
        if size == 0 || chunk.len() < size {
            body.extend_from_slice(&chunk[..size.min(chunk.len())]);
            break;
        }
        body.extend_from_slice(&chunk[..size]);
        rest = chunk.get(size + 2..).unwrap_or(&[]);
    }
    body
}

/// `(event, JSON)` pairs of an SSE text.
fn events(text: &str) -> Vec<(String, serde_json::Value)> {
    text.split("\n\n")
        .filter_map(|e| {
            let name = e.lines().find_map(|l| l.strip_prefix("event: "))?;
            let data = e.lines().find_map(|l| l.strip_prefix("data: "))?;
            Some((
                name.to_string(),
                serde_json::from_str(data).expect("JSON data"),
            ))
        })
        .collect()
}

/// Issue 18: the stream is a `run` event, then one `tick` a second numbered one after the
/// other, the same in plain text and in gzip (the header, then one deflate segment per event,
/// no trailer); no worker list, no history in the ticks; `/api/workers` carries the
/// reputation records instead.
#[tokio::test(flavor = "multi_thread")]
async fn the_dashboard_stream_is_a_run_event_then_small_ticks_plain_or_gzip() {
    let running = crate::util::server(crate::util::config()).await;
    let url = running.url();
    let (plain, zipped) =
        tokio::task::spawn_blocking(move || (read_stream(&url, false), read_stream(&url, true)))
            .await
            .expect("join");
    let mut unzipped = Vec::new();
    // The stream has no trailer: take what decodes.
    let _ = std::io::Read::read_to_end(
        &mut flate2::read::GzDecoder::new(&zipped[..]),
        &mut unzipped,
    );
    assert!(
        zipped.len() < unzipped.len(),
        "{} vs {}",
        zipped.len(),
        unzipped.len()
    );
    for body in [plain, unzipped] {
        let text = String::from_utf8(body).expect("text");
        let ev = events(&text);
        assert!(ev.len() >= 3, "{text}");
        let (name, run) = &ev[0];
        assert_eq!(name, "run");
        assert!(run["run"]["model"]
            .as_str()
            .is_some_and(|m| m.starts_with("mlp")));
        assert!(run["eval_history"].is_array());
        assert_eq!(run["tick"]["seq"], run["seq"]);
        let mut seq = run["seq"].as_u64().expect("seq");
        for (name, tick) in &ev[1..] {
            assert_eq!(name, "tick", "{text}");
            seq += 1;
            assert_eq!(tick["seq"].as_u64(), Some(seq));
            assert!(tick["totals"]["workers"]["registered"].is_u64());
            assert!(tick["shards"].as_array().is_some_and(|s| s.len() == 2));
            assert!(tick["evals"].is_array());
            assert!(tick.get("workers").is_none() && tick.get("eval_history").is_none());
            assert!(tick["reputation"].get("workers").is_none());
            assert!(tick.to_string().len() < 8_000, "{tick}");
        }
    }
    let (code, page) = crate::util::get(format!("{}/api/workers", running.url())).await;
    assert_eq!(code, 200);
    let page: serde_json::Value = serde_json::from_slice(&page).expect("JSON");
    assert!(
        page["reputation"].is_object() && page["workers"].is_array(),
        "{page}"
    );
}
