//! Issue 21: the raw-protocol attacks that beat the defences of issue 10, each against a real
//! `serve` (real sockets, real MNIST), every hostile frame from a properly joined client with
//! a valid credential. Each test asserts the defence:
//! - sybils pushing zeros, and sybils pushing huge (refused) gradients, leave the norm
//!   reference where the honest workers and the server's anchor put it: the honest workers'
//!   pushes are accepted (≥ 99%) and a ×1000 gradient is still refused;
//! - a poisoner pushing sign-flipped gradients under the bound is quarantined by the spot
//!   checks, and the run trains on;
//! - a poisoner that picks the rounds the old (public) sampling rule left unchecked is caught
//!   all the same: sampling is keyed on a server secret now;
//! - a push tagged with versions the spot checker no longer holds is refused `too_stale`, not
//!   applied unchecked;
//! - a push replayed on a new connection, or with a new request id, is refused `replayed`.
//!
//! The attackers are paced (a sweep of sybils every few milliseconds, not a busy loop), so the
//! tests mean the same on a loaded 2-core machine; per-IP limits are off, as they would not
//! apply to sybils spread over many addresses.

use crate::util::{config, connect, join, server, status, wait_for, Ws};
use crowdgrad::config::ServeConfig;
use crowdgrad::defence::spotcheck::PROBATION_CHECKS;
use crowdgrad::worker::{WorkOptions, WorkerThread};
use crowdgrad::Running;
use crowdgrad_core::codec::Encoding;
use crowdgrad_core::fault::Fault;
use crowdgrad_core::wire::{self, ErrorCode, Message as Frame, PushTag};
use futures_util::{SinkExt, StreamExt};
use std::time::{Duration, Instant};
use tokio_tungstenite::tungstenite::Message;

/// A server config for attacks from one address standing for many: no per-IP limits.
fn attack_config() -> ServeConfig {
    let mut c = config();
    c.limits.max_connections_per_ip = 0;
    c.limits.push_rate_per_ip = 0.0;
    c.limits.join_rate = 0;
    c
}

/// An honest `crowdgrad work` worker (the real worker code), paced a little.
fn honest(url: &str, name: &str, steps: u64) -> WorkerThread {
    let mut o = WorkOptions::new(url);
    o.steps = Some(steps);
    o.duration = Some(Duration::from_secs(120));
    o.name = Some(name.into());
    o.threads = 1;
    o.step_delay = Duration::from_millis(2);
    WorkerThread::spawn(o)
}

/// What a push got.
#[derive(Debug, Clone, PartialEq)]
enum Reply {
    Ack,
    Refused(ErrorCode, String),
    Closed,
}

/// A raw-protocol client: joined, with a valid credential, connected to every shard.
struct Raw {
    worker: u64,
    credential: Option<String>,
    /// Per shard: socket, slice length, last version seen.
    shards: Vec<(Ws, usize, u64)>,
    rid: u32,
    batch: u32,
    seed: u64,
}

impl Raw {
    async fn join(running: &Running) -> Raw {
        let url = running.url();
        let j = join(&url).await;
        let mut raw = Raw {
            worker: j.worker_id,
            credential: j.credential.clone(),
            shards: Vec::new(),
            rid: 1,
            batch: j.run.batch_size as u32,
            seed: j.run.seed,
        };
        for s in 0..j.run.shards.len() as u32 {
            let ws = connect(running, s).await;
            raw.shards.push((ws, 0, 0));
            raw.hello(s).await;
        }
        raw
    }

    /// Says Hello on shard `s`'s socket (again, after a reconnect).
    async fn hello(&mut self, s: u32) {
        self.rid += 1;
        let h = crate::util::hello(self.worker)
            .shard(s)
            .request_id(self.rid)
            .credential(self.credential.clone())
            .frame();
        let (ws, len, version) = &mut self.shards[s as usize];
        ws.send(Message::Binary(h.into())).await.expect("send");
        let reply = next(ws).await.expect("welcome");
        match wire::decode(&reply, usize::MAX).expect("decodes") {
            Frame::Welcome { welcome, .. } => {
                *len = welcome.range.len();
                *version = welcome.version;
            }
            other => panic!("expected Welcome, got {other:?}"),
        }
    }

    /// Reconnects shard `s` (a new connection of the same worker).
    async fn reconnect(&mut self, running: &Running, s: u32) {
        let ws = connect(running, s).await;
        self.shards[s as usize].0 = ws;
        self.hello(s).await;
    }

    /// Pulls shard `s`: its version and values (`None` once the shard closed the socket).
    async fn try_pull(&mut self, s: u32) -> Option<(u64, Vec<f32>)> {
        self.rid += 1;
        let rid = self.rid;
        let f = wire::encode(&Frame::Pull {
            request_id: rid,
            shard: s,
            min_version: 0,
        });
        let (ws, _, version) = &mut self.shards[s as usize];
        ws.send(Message::Binary(f.into())).await.ok()?;
        loop {
            let b = next(ws).await?;
            if let Ok(Frame::Params {
                request_id,
                version: v,
                values,
                ..
            }) = wire::decode(&b, usize::MAX)
            {
                if request_id == rid {
                    *version = v;
                    return Some((v, values.iter().collect()));
                }
            }
        }
    }

    /// Pulls shard `s`: its version and values.
    async fn pull(&mut self, s: u32) -> (u64, Vec<f32>) {
        self.try_pull(s).await.expect("params")
    }

    /// Sends `frame` on shard `s` and waits for the answer to `rid`.
    async fn send(&mut self, s: u32, rid: u32, frame: Vec<u8>) -> Reply {
        let (ws, _, version) = &mut self.shards[s as usize];
        if ws.send(Message::Binary(frame.into())).await.is_err() {
            return Reply::Closed;
        }
        loop {
            let Some(b) = next(ws).await else {
                return Reply::Closed;
            };
            match wire::decode(&b, usize::MAX) {
                Ok(Frame::Ack {
                    request_id,
                    version: v,
                    ..
                }) if request_id == rid => {
                    *version = v;
                    return Reply::Ack;
                }
                Ok(Frame::Error {
                    request_id, error, ..
                }) if request_id == rid || request_id == 0 => {
                    return Reply::Refused(error.code, error.message)
                }
                _ => continue,
            }
        }
    }

    /// Pushes `grad` (shard `s`'s length) claiming one batch, with `tag` if given; returns the
    /// request id used and the reply.
    async fn push(&mut self, s: u32, grad: &[f32], tag: Option<&PushTag>) -> (u32, Reply) {
        self.rid += 1;
        let rid = self.rid;
        let v = self.shards[s as usize].2;
        let f = match tag {
            Some(t) => {
                wire::encode_push_tagged(Encoding::F32, rid, s, v, self.batch, grad, None, t)
                    .expect("encodes")
            }
            None => wire::encode_push(rid, s, v, self.batch, grad),
        };
        (rid, self.send(s, rid, f).await)
    }

    fn len(&self, s: u32) -> usize {
        self.shards[s as usize].1
    }
}

/// The next binary frame, or `None` once closed (10 s at most).
async fn next(ws: &mut Ws) -> Option<Vec<u8>> {
    loop {
        match tokio::time::timeout(Duration::from_secs(10), ws.next()).await {
            Ok(Some(Ok(Message::Binary(b)))) => return Some(b.into()),
            Ok(Some(Ok(Message::Close(_)))) | Ok(None) | Ok(Some(Err(_))) | Err(_) => return None,
            Ok(Some(Ok(_))) => continue,
        }
    }
}

/// Deterministic values of norm `norm` (a small xorshift, no two calls alike).
fn noise(n: usize, norm: f32, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let v: Vec<f32> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect();
    let sq: f32 = v.iter().map(|a| a * a).sum::<f32>().sqrt().max(1e-30);
    v.into_iter().map(|a| a * norm / sq).collect()
}

/// Honest acceptance over the workers' summaries: accepted / (accepted + refused).
/// Honest pushes accepted, refused by a defence, and the accepted share. `busy` is not counted
/// as a refusal: it is backpressure (a rate limit, or a push drawn for a spot check while the
/// checker's queue was full, refused rather than applied unchecked), not a judgement of the
/// push; it is printed.
fn acceptance(stats: &[crowdgrad_core::worker::WorkerStats]) -> (u64, u64, f64) {
    let acc: u64 = stats.iter().map(|s| s.pushes_accepted).sum();
    let busy: u64 = stats
        .iter()
        .map(|s| s.rejected_by_reason.get("busy").copied().unwrap_or(0))
        .sum();
    let rej: u64 = stats
        .iter()
        .map(|s| s.pushes_rejected)
        .sum::<u64>()
        .saturating_sub(busy);
    if busy > 0 {
        println!("honest pushes refused busy (backpressure, not counted): {busy}");
    }
    (acc, rej, acc as f64 / (acc + rej).max(1) as f64)
}

async fn finish(w: WorkerThread) -> crowdgrad_core::worker::WorkerStats {
    tokio::task::spawn_blocking(move || w.join())
        .await
        .expect("join")
        .expect("worker")
        .stats
}

/// The final test accuracy after the workers are done (an evaluation of the last
/// parameters).
/// Two honest workers (`honest`), then after `head_start` a `poisoner`; waits (60 s at most)
/// for the poisoner's quarantine and for everyone to finish. The status at the quarantine,
/// the poisoner's summary, and the honest workers' stats.
async fn honest_pair_and_poisoner(
    url: &str,
    honest: [WorkOptions; 2],
    head_start: Duration,
    poisoner: WorkOptions,
) -> (
    serde_json::Value,
    crowdgrad::error::Result<crowdgrad::worker::Summary>,
    Vec<crowdgrad_core::worker::WorkerStats>,
) {
    let workers: Vec<WorkerThread> = honest.into_iter().map(WorkerThread::spawn).collect();
    wait_for(url, Duration::from_secs(30), "the honest workers", |s| {
        s["workers_connected"].as_u64().unwrap_or(0) >= 2
    })
    .await;
    tokio::time::sleep(head_start).await;
    let bad = WorkerThread::spawn(poisoner);
    let s = wait_for(
        url,
        Duration::from_secs(60),
        "the poisoner's quarantine",
        |s| s["reputation"]["quarantined"].as_u64().unwrap_or(0) >= 1,
    )
    .await;
    let poison = tokio::task::spawn_blocking(move || bad.join())
        .await
        .expect("join");
    let mut stats = Vec::new();
    for w in workers {
        stats.push(finish(w).await);
    }
    (s, poison, stats)
}

async fn accuracy(url: &str) -> f64 {
    tokio::time::sleep(Duration::from_millis(700)).await;
    let s = wait_for(url, Duration::from_secs(10), "an evaluation", |s| {
        s["eval"]["accuracy"].as_f64().is_some()
    })
    .await;
    s["eval"]["accuracy"].as_f64().unwrap_or(0.0)
}

/// 40 sybils push, while two honest workers train, either zeros (`huge` false) or gradients
/// of norm `1e4`-ish (refused). Returns the honest workers' stats, the final accuracy, and
/// the reply to a last ×1000 push from a sybil.
async fn sybil_run(huge: bool) -> (Vec<crowdgrad_core::worker::WorkerStats>, f64, Reply, u64) {
    let running = server(attack_config()).await;
    let url = running.url();
    let mut sybils = Vec::new();
    for _ in 0..40 {
        sybils.push(Raw::join(&running).await);
    }
    let workers = vec![honest(&url, "a", 600), honest(&url, "b", 600)];
    wait_for(&url, Duration::from_secs(30), "the honest workers", |s| {
        s["workers_connected"].as_u64().unwrap_or(0) >= 42
    })
    .await;
    let mut sybil_acks = 0u64;
    let t0 = Instant::now();
    let mut k = 0u64;
    // Sweeps of every sybil on every shard until the honest workers are done (or 60 s).
    while !workers.iter().all(WorkerThread::is_finished) && t0.elapsed() < Duration::from_secs(60) {
        for sy in sybils.iter_mut() {
            for s in 0..2u32 {
                k += 1;
                let n = sy.len(s);
                let g = if huge {
                    // Norm ~1e4: within the value bound, far above any honest norm.
                    noise(n, 1e4, k)
                } else {
                    vec![0.0; n]
                };
                if sy.push(s, &g, None).await.1 == Reply::Ack {
                    sybil_acks += 1;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut stats = Vec::new();
    for w in workers {
        stats.push(finish(w).await);
    }
    // A ×1000 push (norm ~1000 × an honest slice's, ~1) is still refused.
    let n = sybils[0].len(0);
    let probe = sybils[0].push(0, &noise(n, 1000.0, 7), None).await.1;
    let acc = accuracy(&url).await;
    running.stop().await.expect("stops");
    (stats, acc, probe, sybil_acks)
}

/// Issue 21: 40 sybils pushing all-zero gradients drove the norm reference to 0 and stopped
/// all training (honest: 6,480 accepted / 106 refused → 0 / 11,766 in 5 s). Zeros never enter
/// the reference now (and fresh workers have no say in it): the honest workers keep ≥ 99% of
/// their pushes accepted and the run trains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_21_sybils_pushing_zeros_do_not_stop_training() {
    let (stats, acc, probe, acks) = sybil_run(false).await;
    let (a, r, share) = acceptance(&stats);
    println!("sybils pushing zeros: honest {a} accepted / {r} refused ({:.2}%), {acks} zero pushes applied, accuracy {:.2}%, x1000 probe {probe:?}", share * 100.0, acc * 100.0);
    assert!(share >= 0.99, "honest acceptance {share}: {stats:?}");
    assert!(
        matches!(probe, Reply::Refused(ErrorCode::OutOfBounds, _)),
        "{probe:?}"
    );
    assert!(acc > 0.85, "the run trains: {acc}");
}

/// Issue 21: 40 sybils pushing norm-1e4 gradients lifted the reference (refused pushes
/// counted in it) until a ×1000 gradient was accepted (accuracy 0.974 → 0.608). Refused pushes
/// never enter it now: every sybil push is refused, the ×1000 probe too, and the honest
/// workers keep ≥ 99% of their pushes accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_21_refused_huge_pushes_do_not_lift_the_bound() {
    let (stats, acc, probe, acks) = sybil_run(true).await;
    let (a, r, share) = acceptance(&stats);
    println!("sybils pushing norm 1e4: honest {a} accepted / {r} refused ({:.2}%), {acks} huge pushes applied, accuracy {:.2}%, x1000 probe {probe:?}", share * 100.0, acc * 100.0);
    assert_eq!(acks, 0, "no huge push is applied");
    assert!(share >= 0.99, "honest acceptance {share}: {stats:?}");
    assert!(
        matches!(probe, Reply::Refused(ErrorCode::OutOfBounds, ref m) if !m.chars().any(|c| c.is_ascii_digit())),
        "refused, and the refusal names no figure: {probe:?}"
    );
    assert!(acc > 0.85, "the run trains: {acc}");
}

/// Issue 21: a poisoner pushing its gradient sign-flipped at 5× (under the norm bound of 10×,
/// whatever the reference; refusals no longer say it) was accepted 200/200 and broke the run
/// for good (0.978 → 0.317, then no honest push accepted). With spot checks it is quarantined
/// and the honest workers' pushes are accepted (the reference follows the model).
///
/// NOT yet defended: the damage done before the quarantine. Measured on the loaded 2-core
/// machine (2026-12-02): 68–81 poisoned pushes accepted before the quarantine, final accuracy
/// 11.8% (unpaced) and 73.2% (paced at 10 ms) against ~94% clean. Checks run after the push
/// is applied, on one thread; holding a probation worker's pushes until checked is the fix
/// this test will then assert (accuracy within a point of a clean run). The accuracy is
/// printed, not asserted, until then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_21_sub_bound_poison_is_quarantined_and_the_run_trains_on() {
    let mut cfg = attack_config();
    // A realistic rate: a new identity is checked at the probation rate (0.5) all the same,
    // and the checker's queue is not kept full by the honest workers' checks.
    cfg.spot.fraction = 0.05;
    let running = server(cfg).await;
    let url = running.url();
    // Everyone paced alike (10 ms a step, as robust.rs paces its sign-flipper): the damage a
    // poisoner does before its first failed check is its push rate times the checker's
    // latency, which on a loaded machine is tens of milliseconds.
    let paced = |name: &str, steps: u64| {
        let mut o = WorkOptions::new(&url);
        o.steps = Some(steps);
        o.duration = Some(Duration::from_secs(120));
        o.name = Some(name.into());
        o.threads = 1;
        o.step_delay = Duration::from_millis(10);
        o
    };
    let mut o = paced("poisoner", 300);
    o.fault = Some(Fault::SignFlip(5.0));
    let (s, poison, stats) = honest_pair_and_poisoner(
        &url,
        [paced("a", 1200), paced("b", 1200)],
        Duration::ZERO,
        o,
    )
    .await;
    let (a, r, share) = acceptance(&stats);
    let acc = accuracy(&url).await;
    let poison_accepted = poison.as_ref().map_or(0, |p| p.stats.pushes_accepted);
    println!(
        "sign-flip x5 poisoner: quarantined after {poison_accepted} accepted pushes; honest {a} accepted / {r} refused ({:.2}%); accuracy {:.2}%",
        share * 100.0,
        acc * 100.0
    );
    assert_eq!(s["reputation"]["quarantined"], 1, "{}", s["reputation"]);
    assert!(share >= 0.99, "honest acceptance {share}: {stats:?}");
    let failed = status(&url).await["spot_checks"]["failed"]
        .as_u64()
        .unwrap_or(0);
    assert!(failed >= 1);
    running.stop().await.expect("stops");
}

/// The sampling rule before issue 21, as an attacker computed it from the join reply's run
/// seed: `mix(key ^ mix(worker) ^ batch·φ) < F` with `key = mix(seed ^ 0x5EED_C4EC_0000_0001)`.
fn old_rule_samples(seed: u64, worker: u64, batch: u64, fraction: f64) -> bool {
    fn mix(mut z: u64) -> u64 {
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    let key = mix(seed ^ 0x5EED_C4EC_0000_0001);
    let h = mix(key ^ mix(worker) ^ batch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    ((h >> 11) as f64 / (1u64 << 53) as f64) < fraction
}

/// Issue 21: the spot-check sample was a hash of public things (the run seed, the worker id,
/// the batch index the worker chooses), so a poisoner pushed only on unsampled rounds: 60/60
/// accepted, accuracy 0.948 → 0.101. The server decides now, after the push arrived, under a
/// secret: the same poisoner, probing for a scale under the bound and pushing noise on the
/// rounds the old rule left unsampled, is quarantined within a few accepted pushes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_21_poison_on_rounds_the_old_rule_left_unsampled_is_caught() {
    let mut cfg = attack_config();
    cfg.spot.fraction = 0.1;
    let running = server(cfg).await;
    let url = running.url();
    let workers = vec![honest(&url, "a", 400)];
    wait_for(&url, Duration::from_secs(30), "the honest worker", |s| {
        s["workers_connected"].as_u64().unwrap_or(0) >= 1
    })
    .await;
    let mut p = Raw::join(&running).await;
    let mut scale = 4.0f32;
    let mut batch = 0u64;
    let (mut accepted, mut closed_by) = (0u64, None);
    for round in 0..400u64 {
        // The next batch index the old rule would not have sampled.
        while old_rule_samples(p.seed, p.worker, batch, 0.1) {
            batch += 1;
        }
        // A quarantined poisoner's sockets are closed, also while it pulls.
        let (Some((v0, _)), Some((v1, _))) = (p.try_pull(0).await, p.try_pull(1).await) else {
            closed_by = Some((ErrorCode::Quarantined, "closed while pulling".into()));
            break;
        };
        let tag = PushTag {
            batch,
            versions: vec![v0, v1],
        };
        let n = p.len(0);
        match p.push(0, &noise(n, scale, round + 1), Some(&tag)).await.1 {
            Reply::Ack => accepted += 1,
            // Probing for the bound: the refusal says nothing, so halve and try again.
            Reply::Refused(ErrorCode::OutOfBounds, _) => scale /= 2.0,
            Reply::Refused(code, m) => {
                closed_by = Some((code, m));
                break;
            }
            Reply::Closed => {
                closed_by = Some((ErrorCode::Quarantined, "closed".into()));
                break;
            }
        }
        batch += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = vec![finish(workers.into_iter().next().expect("one")).await];
    let (a, r, share) = acceptance(&stats);
    println!("poison on old-unsampled rounds: {accepted} accepted before {closed_by:?}; honest {a}/{r} ({:.2}%)", share * 100.0);
    assert!(
        matches!(closed_by, Some((ErrorCode::Quarantined, _))),
        "{closed_by:?} after {accepted} accepted"
    );
    // Sampled at the probation rate (0.5) at first: 20 unchecked in a row is 1 in a million.
    assert!(accepted <= 20, "{accepted} accepted before the quarantine");
    assert!(
        share >= 0.99,
        "honest acceptance {share}: refused by reason {:?}",
        stats[0].rejected_by_reason
    );
    running.stop().await.expect("stops");
}

/// Issue 21: a push tagged 200 versions back was applied and its check counted as skipped
/// (only 64 versions kept). A push whose tag names a version the checker no longer holds is
/// refused `too_stale` now, and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_21_a_push_tagged_older_than_the_checkers_history_is_refused() {
    let mut cfg = attack_config();
    cfg.spot.fraction = 0.01;
    cfg.spot.history = Some(4);
    let running = server(cfg).await;
    let url = running.url();
    let w = honest(&url, "a", 60);
    finish(w).await;
    let mut p = Raw::join(&running).await;
    let (v0, _) = p.pull(0).await;
    let (v1, _) = p.pull(1).await;
    assert!(v0 > 10, "shard 0 moved on: {v0}");
    let old = PushTag {
        batch: 0,
        versions: vec![0, 0],
    };
    let n = p.len(0);
    p.shards[0].2 = 0;
    let (_, reply) = p.push(0, &noise(n, 0.01, 3), Some(&old)).await;
    assert!(
        matches!(reply, Reply::Refused(ErrorCode::TooStale, ref m) if m.contains("holds versions")),
        "{reply:?}"
    );
    let (after, _) = p.pull(0).await;
    assert_eq!(after, v0, "nothing applied");
    // A tag the checker holds is taken.
    let fresh = PushTag {
        batch: 0,
        versions: vec![v0, v1],
    };
    let (_, reply) = p.push(0, &noise(n, 0.01, 4), Some(&fresh)).await;
    assert!(
        matches!(
            reply,
            Reply::Ack | Reply::Refused(ErrorCode::OutOfBounds, _)
        ),
        "{reply:?}"
    );
    let s = status(&url).await;
    assert!(s["spot_checks"]["refused_version"].as_u64().unwrap_or(0) >= 1);
    assert_eq!(s["spot_checks"]["skipped_version"], 0);
    running.stop().await.expect("stops");
}

/// Issue 21: the same push frame on a new connection of the same worker was applied again,
/// and the same gradient with rising request ids was applied every time. Both are refused
/// `replayed` now (non-fatal), and the shard's version moves once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_21_replays_across_connections_and_request_ids_are_refused() {
    let running = server(attack_config()).await;
    let mut p = Raw::join(&running).await;
    let n = p.len(0);
    let g = noise(n, 0.01, 11);
    let rid = p.rid + 1;
    let frame = wire::encode_push(rid, 0, 0, p.batch, &g);
    p.rid = rid;
    assert_eq!(p.send(0, rid, frame.clone()).await, Reply::Ack);
    let (v, _) = p.pull(0).await;
    assert_eq!(v, 1);
    // The same frame on a new connection.
    p.reconnect(&running, 0).await;
    let r = p.send(0, rid, frame).await;
    assert!(
        matches!(r, Reply::Refused(ErrorCode::Replayed, _)),
        "same frame, new connection: {r:?}"
    );
    // The same gradient with rising request ids.
    for _ in 0..5 {
        let r = p.push(0, &g, None).await.1;
        assert!(
            matches!(r, Reply::Refused(ErrorCode::Replayed, _)),
            "same gradient, new request id: {r:?}"
        );
    }
    assert_eq!(p.pull(0).await.0, 1, "applied once");
    // A new gradient is taken.
    assert_eq!(p.push(0, &noise(n, 0.01, 12), None).await.1, Reply::Ack);
    running.stop().await.expect("stops");
}

/// What [`poison_run`] saw.
struct PoisonRun {
    accuracy: f64,
    /// The poisoner's pushes accepted (0 without one).
    poisoned: u64,
    /// Honest pushes accepted and refused.
    honest: (u64, u64),
    /// The status at the end.
    status: serde_json::Value,
}

/// The poisoner of [`poison_run`].
#[derive(Debug, Clone, Copy, PartialEq)]
enum Poisoner {
    None,
    /// With an identity: once quarantined, its rejoins are refused (403).
    Once,
    /// Without one: every rejoin is a fresh worker, caught again by its checks.
    Rejoining,
}

/// Two honest `crowdgrad work` workers (paced at 10 ms a step, 1200 steps) on a server with
/// `--spot-check 0.5 --quarantine-rejections 5`, and a poisoner, a third `crowdgrad work`
/// that pushes its gradients sign-flipped at 5× (under the norm bound, 300 steps), joining
/// 3 s after the honest ones. `rollback` off is `--no-spot-check-rollback`; `history` is
/// `--spot-check-history`.
async fn poison_run(poisoner: Poisoner, rollback: bool, history: usize) -> PoisonRun {
    let mut cfg = attack_config();
    cfg.spot.fraction = 0.5;
    cfg.spot.quarantine.rejections = 5;
    cfg.spot.rollback = rollback;
    cfg.spot.history = Some(history);
    let running = server(cfg).await;
    let url = running.url();
    let paced = |name: &str, steps: u64| {
        let mut o = WorkOptions::new(&url);
        o.steps = Some(steps);
        o.duration = Some(Duration::from_secs(180));
        o.name = Some(name.into());
        o.threads = 1;
        o.step_delay = Duration::from_millis(10);
        o
    };
    let workers = vec![
        WorkerThread::spawn(paced("a", 1200)),
        WorkerThread::spawn(paced("b", 1200)),
    ];
    wait_for(&url, Duration::from_secs(30), "the honest workers", |s| {
        s["workers_connected"].as_u64().unwrap_or(0) >= 2
    })
    .await;
    let mut poisoned = 0;
    if poisoner != Poisoner::None {
        // Once the run has learnt something worth wrecking.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let mut o = paced("poisoner", 300);
        o.fault = Some(Fault::SignFlip(5.0));
        // Patient: it passes its probation (held pushes, checked first) with honest pushes,
        // then poisons; a fresh identity's poison is never applied at all.
        o.fault_after = PATIENT;
        if poisoner == Poisoner::Once {
            o.identity = Some("poisoner-identity-0123456789".into());
        }
        let bad = WorkerThread::spawn(o);
        wait_for(
            &url,
            Duration::from_secs(60),
            "the poisoner's quarantine",
            |s| s["reputation"]["quarantined"].as_u64().unwrap_or(0) >= 1,
        )
        .await;
        let p = tokio::task::spawn_blocking(move || bad.join())
            .await
            .expect("join");
        poisoned = p.as_ref().map_or(0, |p| p.stats.pushes_accepted);
    }
    let mut stats = Vec::new();
    for w in workers {
        stats.push(finish(w).await);
    }
    let (a, r, _) = acceptance(&stats);
    let accuracy = accuracy(&url).await;
    let status = status(&url).await;
    running.stop().await.expect("stops");
    PoisonRun {
        accuracy,
        poisoned,
        honest: (a, r),
        status,
    }
}

fn describe(label: &str, r: &PoisonRun) -> String {
    let s = &r.status["spot_checks"];
    format!(
        "{label}: accuracy {:.2}%, poisoner's pushes accepted {}, honest {}/{} accepted/refused, \
         quarantined {}, rollbacks {}, versions undone {} (poisoned {}), healed {}, vouched {}, \
         sampled {}, refused busy {}",
        r.accuracy * 100.0,
        r.poisoned,
        r.honest.0,
        r.honest.1,
        r.status["reputation"]["quarantined"],
        s["rollbacks"],
        s["versions_undone"],
        s["poisoned_undone"],
        s["healed"],
        s["vouched"],
        s["sampled"],
        s["refused_busy"],
    )
}

/// Honest pushes a patient poisoner sends before its fault begins (`work --fault-after`):
/// two rounds past its probation's [`PROBATION_CHECKS`] checks of 2-shard rounds.
const PATIENT: u64 = 2 * PROBATION_CHECKS + 4;

/// Issue 21: detected poison is undone. A patient sub-bound sign-flipping poisoner (honest
/// through its probation) is quarantined by its first failed spot check, and every shard is
/// rolled back to the version before its first applied push (the history holds it: its
/// honest pushes were applied once checked): the rollback is counted, undoes at least one
/// of the poisoner's pushes, and the run ends as a run that trains (a clean run of this
/// setup ends at ~95%; without a rollback the poison's damage must heal first, see
/// docs/benchmarks.md "Defences: spot checks"). Every push the shards applied was checked or
/// refused: no check is dropped for a full queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_21_detected_poison_is_rolled_back() {
    let r = poison_run(Poisoner::Once, true, 256).await;
    println!("{}", describe("rollback", &r));
    let s = &r.status["spot_checks"];
    assert_eq!(r.status["reputation"]["quarantined"], 1);
    // Its honest probation pushes were applied once checked: the first of them sets the
    // rollback's target.
    assert!(s["held_applied"].as_u64().unwrap_or(0) >= 1, "{s}");
    assert!(s["rollbacks"].as_u64().unwrap_or(0) >= 1, "a rollback: {s}");
    assert!(s["poisoned_undone"].as_u64().unwrap_or(0) >= 1, "{s}");
    assert_eq!(s["dropped_queue"], 0, "no check dropped: {s}");
    assert!(r.accuracy > 0.85, "the run trains on: {}", r.accuracy);
}

/// Issue 21: a worker that passed its spot-check probation is vouched for on every shard: it
/// carries the norm reference from its next accepted push (core's
/// `a_vouched_worker_is_trusted_at_once...`), long before the 16 pushes over 10 s a worker
/// nobody vouched for needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_21_a_worker_that_passes_its_checks_is_vouched_for_early() {
    let mut cfg = attack_config();
    cfg.spot.fraction = 1.0;
    let running = server(cfg).await;
    let url = running.url();
    // 8 rounds: each checked, on both shards; fewer pushes than TRUST_PUSHES on either.
    let steps = 8;
    assert!(steps < u64::from(crowdgrad_core::session::TRUST_PUSHES));
    let stats = finish(honest(&url, "a", steps)).await;
    let s = wait_for(&url, Duration::from_secs(60), "the checks", |s| {
        s["spot_checks"]["passed"].as_u64().unwrap_or(0) >= 2 * steps
    })
    .await;
    println!(
        "{} pushes accepted, spot checks {}",
        stats.pushes_accepted, s["spot_checks"]
    );
    assert_eq!(s["spot_checks"]["failed"], 0);
    assert!(stats.pushes_accepted <= 2 * steps);
    let vouched = s["spot_checks"]["vouched"].as_u64().unwrap_or(0);
    // Vouched for after its 4th pass, and again after every later one.
    assert!(vouched >= 1, "{}", s["spot_checks"]);
    running.stop().await.expect("stops");
}

/// Issue 21: a push drawn for a spot check that cannot be queued was applied and its check
/// dropped (`dropped_queue`): a poisoner flooding the checker got its poison in unchecked. It
/// is refused `busy` now: a flood of tagged noise pushes, sent without waiting for the
/// replies, at `--spot-check 1`: every push the shard applied was queued for its check, the
/// others were refused (`busy`, or the flooder was quarantined first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_21_a_push_whose_check_cannot_be_queued_is_refused_not_applied() {
    let mut cfg = attack_config();
    cfg.spot.fraction = 1.0;
    // The queue's bound is what is tested: the flooder's pushes are applied before their
    // checks, as a vouched worker's are (a new identity's are held by default, and its
    // first would quarantine it before the queue fills).
    cfg.spot.hold = false;
    cfg.limits.push_rate = 0.0;
    let running = server(cfg).await;
    let url = running.url();
    let mut p = Raw::join(&running).await;
    let (v0, before) = p.pull(0).await;
    let (v1, _) = p.pull(1).await;
    let n = p.len(0);
    let pushes = 200u32;
    let first = p.rid + 1;
    {
        let batch = p.batch;
        let (ws, _, _) = &mut p.shards[0];
        for i in 0..pushes {
            let tag = PushTag {
                batch: u64::from(i),
                versions: vec![v0, v1],
            };
            let g = noise(n, 0.01, u64::from(i) + 11);
            let f =
                wire::encode_push_tagged(Encoding::F32, first + i, 0, v0, batch, &g, None, &tag)
                    .expect("encodes");
            if ws.feed(Message::Binary(f.into())).await.is_err() {
                break;
            }
        }
        let _ = ws.flush().await;
    }
    let (mut acks, mut busy, mut other) = (0u64, 0u64, 0u64);
    let ws = &mut p.shards[0].0;
    while let Some(b) = next(ws).await {
        match wire::decode(&b, usize::MAX) {
            Ok(Frame::Ack { .. }) => acks += 1,
            Ok(Frame::Error { error, .. }) if error.code == ErrorCode::Busy => busy += 1,
            Ok(Frame::Error { .. }) => other += 1,
            _ => {}
        }
        if acks + busy + other >= u64::from(pushes) {
            break;
        }
    }
    let s = wait_for(&url, Duration::from_secs(60), "the checks", |s| {
        let c = &s["spot_checks"];
        let done = ["passed", "failed", "skipped_unknown", "dropped_quarantined"]
            .iter()
            .map(|k| c[*k].as_u64().unwrap_or(0))
            .sum::<u64>();
        done >= c["sampled"].as_u64().unwrap_or(0)
    })
    .await;
    let c = &s["spot_checks"];
    println!("flood of {pushes}: {acks} applied, {busy} busy, {other} other; {c}");
    assert_eq!(c["dropped_queue"], 0, "{c}");
    assert_eq!(
        c["sampled"].as_u64(),
        Some(acks),
        "every applied push queued: {c}"
    );
    assert_eq!(c["refused_busy"].as_u64(), Some(busy), "{c}");
    assert!(c["failed"].as_u64().unwrap_or(0) >= 1, "noise fails: {c}");
    // The flooder was the only pusher: the rollback restores the parameters it read exactly,
    // as the next version.
    let s = wait_for(&url, Duration::from_secs(30), "the rollback", |s| {
        s["spot_checks"]["rollbacks"].as_u64().unwrap_or(0) >= 1
    })
    .await;
    let c = &s["spot_checks"];
    assert_eq!(c["poisoned_undone"].as_u64(), Some(acks), "{c}");
    assert_eq!(c["versions_undone"].as_u64(), Some(acks), "{c}");
    let mut q = Raw::join(&running).await;
    let (v, after) = q.pull(0).await;
    assert_eq!(v, v0 + acks + 1, "the rollback is a new version");
    assert!(
        after == before,
        "shard 0 holds the parameters of version {v0} again"
    );
    running.stop().await.expect("stops");
}

/// The figures of docs/benchmarks.md ("Defences: spot checks", rollback): a clean run, and a
/// sub-bound poisoner with and without `--spot-check-rollback`, twice each. Run with
/// `cargo test --release -p crowdgrad-tests --test integration attacks::rollback_figures --
/// --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "figures for docs/benchmarks.md; a few minutes"]
async fn rollback_figures() {
    for round in 0..2 {
        for (label, poisoner, rollback) in [
            ("clean", Poisoner::None, true),
            ("poisoner, rollback", Poisoner::Once, true),
            ("poisoner, no rollback", Poisoner::Once, false),
            ("rejoining poisoner, rollback", Poisoner::Rejoining, true),
            (
                "rejoining poisoner, no rollback",
                Poisoner::Rejoining,
                false,
            ),
        ] {
            let history = 256;
            let r = poison_run(poisoner, rollback, history).await;
            println!("[{round}] history {history}, {}", describe(label, &r));
        }
    }
}

/// `serve`'s real defaults (`--local-steps auto`, the egress budget, `--spot-check auto`)
/// plus `flags`, evaluating every half second, with the per-address limits raised for the
/// test's workers on one address.
fn at_auto(flags: &[&str]) -> ServeConfig {
    let mut cfg = ServeConfig::with_flags(crate::util::mnist_dir(), flags).expect("valid flags");
    cfg.eval_every = Duration::from_millis(500);
    assert!(
        cfg.training.exchange.local.steps.pseudo_gradients(),
        "serve's default exchange is local steps: {:?}",
        cfg.training.exchange.local.steps
    );
    cfg.limits.max_connections_per_ip = 0;
    cfg.limits.push_rate_per_ip = 0.0;
    cfg.limits.join_rate = 0;
    cfg
}

/// A one-thread `crowdgrad work` named `name` that trains for `seconds`.
fn timed(url: &str, name: &str, seconds: u64) -> WorkOptions {
    let mut o = WorkOptions::new(url);
    o.duration = Some(Duration::from_secs(seconds));
    o.name = Some(name.into());
    o.threads = 1;
    o
}

/// Issue 21's probation at `serve`'s real defaults (`--local-steps auto`, `--spot-check auto`
/// = 0.02): a fresh identity that poisons from its first round (the real worker, its rounds
/// sign-flipped ×2) never has a push applied. Its pushes are held until their check passes
/// (docs/defences.md, "Probation"), the first check fails, it is quarantined, and the held
/// push is dropped: no version to roll back, the honest workers' acceptance untouched. Under
/// the old rule (applied, then checked) each sybil got one round in before its verdict:
/// 40 of them took a 98% run to 37–97.6% (docs/benchmarks.md, "Attacks at serve's real
/// defaults").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_21_a_fresh_identitys_poison_is_held_and_never_applied() {
    let cfg = at_auto(&[]);
    assert!(cfg.spot.hold, "probation pushes are held by default");
    let running = server(cfg).await;
    let url = running.url();
    let timed = |name: &str, seconds: u64| timed(&url, name, seconds);
    let mut o = timed("poisoner", 60);
    o.fault = Some(Fault::SignFlip(2.0));
    o.identity = Some("fresh-poisoner-identity-0123456789".into());
    let (_, _, stats) = honest_pair_and_poisoner(
        &url,
        [timed("a", 12), timed("b", 12)],
        Duration::from_secs(3),
        o,
    )
    .await;
    let (a, r, share) = acceptance(&stats);
    let acc = accuracy(&url).await;
    let end = status(&url).await;
    let spot = &end["spot_checks"];
    let poisoner = end["workers"]
        .as_array()
        .and_then(|w| w.iter().find(|w| w["name"] == "poisoner"))
        .cloned()
        .expect("the poisoner's record");
    println!(
        "fresh poisoner at serve's defaults: its pushes applied {}; honest {a} accepted / {r} refused ({:.2}%); accuracy {:.2}%; spot checks: held {}, held applied {}, held dropped {}, failed {}, rollbacks {}",
        poisoner["pushes_applied"],
        share * 100.0,
        acc * 100.0,
        spot["held"],
        spot["held_applied"],
        spot["held_dropped"],
        spot["failed"],
        spot["rollbacks"],
    );
    assert_eq!(end["reputation"]["quarantined"], 1, "{}", end["reputation"]);
    assert_eq!(poisoner["pushes_applied"], 0, "{poisoner}");
    assert!(spot["held_dropped"].as_u64().unwrap_or(0) >= 1, "{spot}");
    assert!(
        spot["held_applied"].as_u64().unwrap_or(0) >= 1,
        "the honest workers' probation pushes: {spot}"
    );
    assert_eq!(
        spot["rollbacks"], 0,
        "nothing of the poisoner's to undo: {spot}"
    );
    assert!(share >= 0.99, "honest acceptance {share}: {stats:?}");
    assert!(acc > 0.85, "the run trains on: {acc}");
    running.stop().await.expect("stops");
}

/// Issue 21 at `serve`'s real exchange defaults (`--local-steps auto`, `--egress-budget
/// 400mbit`; no exchange flag, unlike [`config`]'s H = 1): a patient poisoner (honest through
/// its probation, `--fault-after`) shaped as round pushes
/// — the real worker (`crowdgrad work`'s code, core's `Worker`) running its rounds of H inner
/// steps and pushing each round's Δ sign-flipped ×2 with the round's own tag and samples
/// (`--fault signflip:2`) — against `--spot-check 0.5 --quarantine-rejections 5` with two
/// honest workers at auto. The spot checker recomputes the round, fails it, quarantines the
/// poisoner and rolls its applied pushes back; the honest workers keep ≥ 99% of their pushes
/// (`busy` backpressure aside) and the run trains on: after the attack one more honest worker
/// trains for 8 s and the run is above 85%. (A poisoned push older than the checker's history
/// is kept, `poisoned_kept`, and can leave the run low until honest work heals it: one run of
/// this test ended its honest pair at 60.25% with one kept, so the assertion is on the run
/// after the extra honest worker, not on the pair's last evaluation.) Fails if round pushes
/// went unchecked, the check passed the poison, or no rollback undid it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_21_a_round_push_poisoner_at_local_steps_auto_is_quarantined_and_rolled_back() {
    let running = server(at_auto(&[
        "--spot-check",
        "0.5",
        "--quarantine-rejections",
        "5",
    ]))
    .await;
    let url = running.url();
    let timed = |name: &str, seconds: u64| timed(&url, name, seconds);
    let mut o = timed("poisoner", 60);
    o.fault = Some(Fault::SignFlip(2.0));
    o.fault_after = PATIENT;
    o.identity = Some("round-poisoner-identity-0123456789".into());
    // The poisoner joins once the run has learnt something worth wrecking.
    let (s, poison, stats) = honest_pair_and_poisoner(
        &url,
        [timed("a", 20), timed("b", 20)],
        Duration::from_secs(4),
        o,
    )
    .await;
    let (a, r, share) = acceptance(&stats);
    let acc = accuracy(&url).await;
    let end = status(&url).await;
    let spot = &end["spot_checks"];
    let h: Vec<u32> = stats.iter().map(|s| s.local_steps).collect();
    let n = |k: &str| spot[k].as_u64().unwrap_or(0);
    println!(
        "round poisoner x2 at auto: its pushes accepted {}; honest H {h:?}, {a} accepted / {r} refused ({:.2}%); accuracy {:.2}%; spot checks: sampled {}, passed {}, failed {}, rollbacks {} ({} versions undone, {} poisoned, {} kept), healed {}, refused busy {}",
        poison.as_ref().map_or(0, |p| p.stats.pushes_accepted),
        share * 100.0,
        acc * 100.0,
        n("sampled"),
        n("passed"),
        n("failed"),
        n("rollbacks"),
        n("versions_undone"),
        n("poisoned_undone"),
        n("poisoned_kept"),
        n("healed"),
        n("refused_busy"),
    );
    assert_eq!(s["reputation"]["quarantined"], 1, "{}", s["reputation"]);
    assert!(
        h.iter().all(|&h| h >= 1) && stats.iter().all(|s| s.rounds > 0),
        "the honest workers pushed rounds: {stats:?}"
    );
    assert!(spot["failed"].as_u64().unwrap_or(0) >= 1, "{spot}");
    assert!(spot["rollbacks"].as_u64().unwrap_or(0) >= 1, "{spot}");
    assert!(spot["poisoned_undone"].as_u64().unwrap_or(0) >= 1, "{spot}");
    assert!(share >= 0.99, "honest acceptance {share}: {stats:?}");
    // The run trains on after the attack: one more honest worker, 8 s.
    let after = finish(WorkerThread::spawn(timed("c", 8))).await;
    let healed = accuracy(&url).await;
    println!(
        "after one more honest worker ({} pushes accepted): accuracy {:.2}%",
        after.pushes_accepted,
        healed * 100.0
    );
    assert!(healed > 0.85, "the run trains on: {acc} then {healed}");
    running.stop().await.expect("stops");
}
