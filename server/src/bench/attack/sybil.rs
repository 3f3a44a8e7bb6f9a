//! Sybils and poisoners against honest `crowdgrad work` workers: a clean run, sybils pushing
//! zeros, huge (refused) gradients or sign-flipped honest gradients at a scale, and a poisoner
//! pushing on the rounds the old, public sampling rule left unchecked.

use super::common::{
    attacker_addr, final_accuracy, get_json, judge, norm, pushes_of, spot_summary, wait_status,
    Children, Ctx, Mode, Oracle, Pushes, Raw, Reply, Tally, Verdict,
};
use super::rounds::Rounds;
use crate::error::Result;
use crowdgrad_core::wire::PushTag;
use std::time::{Duration, Instant};

/// What the sybils push.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Push {
    /// Nothing: the clean run.
    Clean,
    /// Sybils connected to every shard that push nothing.
    Idle,
    /// All-zero gradients (a -0.0 at a moving index, so no two pushes are the same bytes).
    Zeros,
    /// Gradients of norm 1e4 (within the value bound, far over any honest norm).
    Huge,
    /// The honest gradient sign-flipped and scaled to this many honest norms.
    Poison(f64),
}

impl Push {
    pub fn name(self) -> String {
        match self {
            Push::Clean => "clean".into(),
            Push::Idle => "sybils: idle".into(),
            Push::Zeros => "sybils: zeros".into(),
            Push::Huge => "sybils: huge".into(),
            Push::Poison(s) => format!("sybils: poison x{s}"),
        }
    }
}

/// One run's figures.
#[derive(Debug, Clone)]
pub(super) struct Run {
    pub honest: Pushes,
    pub accuracy: f64,
    pub sybil: Tally,
    pub quarantined: u64,
    pub seconds: f64,
    /// The spot checker's counters.
    pub spot: String,
    /// Mean L2 norm of the honest gradient (or round push) per shard slice (poison runs; 0
    /// otherwise).
    pub honest_norm: f64,
    /// Mean H of the sybils' rounds (0 at H = 1 servers).
    pub sybil_h: f64,
    /// The honest workers' H, as their last Reports said.
    pub honest_h: Vec<u64>,
    /// Workers connected when the honest workers were done (the sybils still in among them).
    pub connected_end: u64,
    /// The sybils' pushes the shards applied, as the server counts them (an Ack is not an
    /// application: a new identity's pushes are held until their check passes).
    pub sybil_applied: u64,
}

/// The H of each honest worker (`honest-…`), from `/api/workers` (their last Report).
pub(super) async fn honest_h(addr: std::net::SocketAddr) -> Vec<u64> {
    let Ok(w) = get_json(addr, "/api/workers?limit=1000").await else {
        return Vec::new();
    };
    w["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["name"].as_str().is_some_and(|n| n.starts_with("honest-")))
        .map(|r| r["exchange"]["local_steps"].as_u64().unwrap_or(0))
        .collect()
}

/// The honest workers of a run (`honest-0`, ...), each for `ctx.seconds`.
fn honest(ctx: &Ctx, url: &str, n: usize) -> Result<Children> {
    let secs = ctx.seconds.to_string();
    let mut kids = Children(Vec::new());
    for i in 0..n {
        let name = format!("honest-{i}");
        kids.0
            .push(ctx.work(url, &["--name", &name, "--seconds", &secs])?);
    }
    Ok(kids)
}

/// The sybils' push `k` on a slice of `len` (`honest`: the honest gradient of that slice).
fn forge(what: Push, len: usize, k: u64, honest: Option<&[f32]>) -> Vec<f32> {
    match (what, honest) {
        (Push::Zeros, _) | (Push::Clean, _) | (Push::Idle, _) => {
            let mut g = vec![0.0f32; len];
            if len > 0 {
                g[(k as usize) % len] = -0.0;
            }
            g
        }
        (Push::Huge, _) => {
            // Norm ~1e4 spread evenly, with a sign pattern that moves with k.
            let v = 1e4 / (len.max(1) as f32).sqrt();
            (0..len)
                .map(|i| {
                    if (i as u64 + k).is_multiple_of(3) {
                        -v
                    } else {
                        v
                    }
                })
                .collect()
        }
        (Push::Poison(s), Some(h)) => {
            // A scale that differs by 1e-6 per push: never the same bytes twice.
            let f = -(s as f32) * (1.0 + (k % 1000) as f32 * 1e-6);
            h.iter().map(|&x| x * f).collect()
        }
        (Push::Poison(_), None) => vec![0.0; len],
    }
}

/// One run: honest workers for `ctx.seconds`, and `ctx.sybils` sybils pushing `what` in
/// sweeps until the honest workers are done.
pub(super) async fn run(ctx: &Ctx, mode: Mode, what: Push) -> Result<Run> {
    let server = ctx.serve(mode, &[])?;
    let addr = server.addr;
    let mut kids = honest(ctx, &server.url, ctx.honest)?;
    let started = Instant::now();
    let mut sybils = Vec::new();
    if what != Push::Clean {
        for i in 0..ctx.sybils {
            sybils
                .push(Raw::join(addr, attacker_addr(i), None, Some(&format!("sybil-{i}"))).await?);
        }
    }
    let want = (ctx.honest + sybils.len()) as u64;
    wait_status(addr, Duration::from_secs(60), |s| {
        s["workers_connected"].as_u64().unwrap_or(0) >= want
    })
    .await;
    let mut tally = Tally::default();
    let rounds_mode = ctx.exchange.rounds();
    // H = 1 servers: a batch gradient (poison only). Round pushes: sybil 0's honest rounds,
    // formed by core's worker, for every kind (their H and samples are the format).
    let mut oracle = match (what, sybils.first()) {
        (Push::Poison(_), Some(s)) if !rounds_mode => Some(Oracle::new(&s.joined, ctx.train()?)?),
        _ => None,
    };
    let mut rounds = match sybils.first() {
        Some(s) if rounds_mode && what != Push::Idle => {
            Some(Rounds::new(&s.joined, ctx.train()?, &s.welcomes())?)
        }
        _ => None,
    };
    let batch = sybils.first().map_or(1, |s| s.joined.run.batch_size.max(1)) as u32;
    // Each sybil's batch count, as its tags say (H batches a round).
    let mut batches = vec![0u64; sybils.len()];
    let mut hs = (0u64, 0u64);
    let mut alive = vec![true; sybils.len()];
    let deadline = Instant::now() + Duration::from_secs_f64(ctx.seconds + 90.0);
    let mut k = 0u64;
    let mut norms = (0.0f64, 0u64);
    while what == Push::Idle && !kids.all_done() && Instant::now() < deadline {
        // Connected, silent: only held open.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    while what != Push::Idle && !sybils.is_empty() && !kids.all_done() && Instant::now() < deadline
    {
        // The sybils collude: the first one still in pulls every shard once a sweep, and
        // all push at the versions it read (so their pushes are fresh, not `too_stale`);
        // poisoners compute the honest gradient (or round) at those parameters.
        let Some(first) = alive.iter().position(|a| *a) else {
            break;
        };
        let Some((pulled, pull_s)) = sybils[first].pull_rounds().await else {
            alive[first] = false;
            continue;
        };
        let versions: Vec<u64> = pulled.iter().map(|p| p.0).collect();
        // The newest version seen of each shard: from the pull, then from every Ack.
        let mut latest = versions.clone();
        let (honest_grad, samples, round_tag) = match (oracle.as_mut(), rounds.as_mut()) {
            (Some(o), _) => {
                let params: Vec<f32> = pulled.iter().flat_map(|p| p.2.iter().copied()).collect();
                (Some(o.gradient(&params)?), batch, None)
            }
            (None, Some(r)) => {
                let round = r.round(&pulled, pull_s)?;
                hs.0 += u64::from(r.last_h);
                hs.1 += 1;
                let samples = round.first().map_or(batch, |p| p.samples);
                let tag = round.first().and_then(|p| p.tag.clone());
                (
                    Some(round.into_iter().map(|p| p.values).collect::<Vec<_>>()),
                    samples,
                    tag,
                )
            }
            (None, None) => (None, batch, None),
        };
        if let (Push::Poison(_), Some(g)) = (what, honest_grad.as_ref()) {
            norms.0 += g.iter().map(|s| norm(s)).sum::<f64>() / g.len().max(1) as f64;
            norms.1 += 1;
        }
        let h = u64::from((samples / batch).max(1));
        for (i, sy) in sybils.iter_mut().enumerate() {
            if !alive[i] {
                continue;
            }
            for (su, l) in sy.links.iter_mut().enumerate() {
                l.version = l.version.max(latest[su]);
            }
            // A round's tag, the same on every shard: sybil 0's own when it read what the
            // round read (exactly an honest worker's), else the sybil's batch count and the
            // versions it pushes at.
            let tag = rounds_mode.then(|| match &round_tag {
                Some(t)
                    if i == 0
                        && t.versions == sy.links.iter().map(|l| l.version).collect::<Vec<_>>() =>
                {
                    t.clone()
                }
                _ => PushTag {
                    batch: batches[i],
                    versions: sy.links.iter().map(|l| l.version).collect(),
                },
            });
            batches[i] += h;
            for s in 0..sy.links.len() as u32 {
                k += 1;
                let g = forge(
                    what,
                    sy.len(s),
                    k,
                    honest_grad.as_ref().map(|h| h[s as usize].as_slice()),
                );
                let su = s as usize;
                let r = match &tag {
                    Some(t) => {
                        sy.links[su].version = t.versions[su];
                        sy.push_of(s, &g, Some(t), samples).await
                    }
                    None => {
                        sy.links[su].version = sy.links[su].version.max(latest[su]);
                        sy.push(s, &g, None).await
                    }
                };
                latest[su] = latest[su].max(sy.links[su].version);
                tally.add(&r);
                if matches!(
                    r,
                    Reply::Closed | Reply::Refused(crowdgrad_core::wire::ErrorCode::Quarantined)
                ) {
                    alive[i] = false;
                    break;
                }
            }
        }
        if !alive.iter().any(|a| *a) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    kids.wait(Duration::from_secs_f64(ctx.seconds + 120.0))
        .await;
    let seconds = started.elapsed().as_secs_f64();
    let accuracy = final_accuracy(addr).await;
    let honest = pushes_of(addr, "honest-").await?;
    let sybil_applied = pushes_of(addr, "sybil-").await?.accepted;
    let status = get_json(addr, "/api/status").await?;
    drop(sybils);
    Ok(Run {
        honest,
        accuracy,
        sybil: tally,
        quarantined: status["reputation"]["quarantined"].as_u64().unwrap_or(0),
        seconds,
        spot: spot_summary(&status),
        honest_norm: norms.0 / norms.1.max(1) as f64,
        sybil_h: hs.0 as f64 / hs.1.max(1) as f64,
        honest_h: honest_h(addr).await,
        connected_end: status["workers_connected"].as_u64().unwrap_or(0),
        sybil_applied,
    })
}

/// The verdict on a sybil run against the clean run's accuracy.
pub(super) fn verdict(server: String, what: Push, r: &Run, clean: f64, n: usize) -> Verdict {
    let figures = format!(
        "{}honest {}; accuracy {:.2}% (clean {:.2}%); {} sybils' pushes{}: {} applied of {} ({}); quarantined {}; connected at the end {}; spot checks: {}; {:.0} s",
        if r.sybil_h > 0.0 || r.honest_h.iter().any(|h| *h > 1) {
            format!(
                "H: honest {:?}, sybils' mean {:.1}; ",
                r.honest_h, r.sybil_h
            )
        } else {
            String::new()
        },
        r.honest.describe(),
        r.accuracy,
        clean,
        n,
        if r.honest_norm > 0.0 {
            format!(" (honest slice norm {:.3})", r.honest_norm)
        } else {
            String::new()
        },
        r.sybil_applied,
        r.sybil.total(),
        r.sybil.describe(),
        r.quarantined,
        r.connected_end,
        r.spot,
        r.seconds
    );
    let mut claims = vec![
        (
            r.honest.share() >= 99.0,
            format!("honest acceptance {:.2}% < 99%", r.honest.share()),
        ),
        (
            r.accuracy >= clean - 1.0,
            format!(
                "accuracy {:.2}% more than 1 pt below clean {clean:.2}%",
                r.accuracy
            ),
        ),
    ];
    if what == Push::Huge {
        claims.push((
            r.sybil_applied == 0,
            format!("{} huge pushes applied", r.sybil_applied),
        ));
    }
    Verdict {
        attack: what.name(),
        server,
        figures,
        verdict: judge(&claims),
    }
}

/// Rounds the "unsampled" poisoner pushes honestly before it poisons (round pushes): twice
/// the 4 checks that end probation (docs/protocol.md §4a), so it is vouched for first.
const PROBATION_ROUNDS: u64 = 8;

/// The sampling rule before issue 21, as an attacker computed it from the join reply's run
/// seed (tests/integration/attacks.rs has the same).
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

/// A poisoner (sign-flipped honest gradient, ×2: under any norm bound of 10×) pushing, as
/// fast as the replies come, tagged with the batches the old public rule left unsampled at
/// the spot-check fraction 0.5, while the honest workers train.
pub(super) async fn unsampled(ctx: &Ctx, mode: Mode, clean: f64) -> Result<Verdict> {
    let server = ctx.serve(mode, &[])?;
    let addr = server.addr;
    let mut kids = honest(ctx, &server.url, ctx.honest)?;
    let started = Instant::now();
    let mut p = Raw::join(addr, attacker_addr(0), None, Some("poisoner")).await?;
    wait_status(addr, Duration::from_secs(60), |s| {
        s["workers_connected"].as_u64().unwrap_or(0) > ctx.honest as u64
    })
    .await;
    let (seed, worker) = (p.joined.run.seed, p.joined.worker_id);
    let mut tally = Tally::default();
    let mut honest_tally = Tally::default();
    let mut first_push: Option<Instant> = None;
    let mut caught: Option<(f64, u64)> = None;
    let deadline = Instant::now() + Duration::from_secs_f64(ctx.seconds + 90.0);
    let mut k = 0u64;
    if ctx.exchange.rounds() {
        // Round pushes: the poisoner runs an honest worker's rounds (core's worker, its own
        // worker id and partition, so its honest pushes pass any check). It pushes them
        // honestly for its first PROBATION_ROUNDS rounds (the documented probation checks
        // every push of a new identity) and afterwards on every round the old public rule
        // samples; on the others the round sign-flipped ×2, with the round's own tag.
        let mut rounds = Rounds::new(&p.joined, ctx.train()?, &p.welcomes())?;
        let mut n = 0u64;
        'rounds_loop: while !kids.all_done() && Instant::now() < deadline {
            let Some((pulled, pull_s)) = p.pull_rounds().await else {
                break;
            };
            let round = rounds.round(&pulled, pull_s)?;
            n += 1;
            for (s, rp) in round.iter().enumerate() {
                let sampled = rp
                    .tag
                    .as_ref()
                    .is_none_or(|t| old_rule_samples(seed, worker, t.batch, 0.5));
                let poison = n > PROBATION_ROUNDS && !sampled;
                k += 1;
                let g = if poison {
                    forge(Push::Poison(2.0), rp.values.len(), k, Some(&rp.values))
                } else {
                    rp.values.clone()
                };
                if poison {
                    first_push.get_or_insert_with(Instant::now);
                }
                p.links[s].version = rp.version;
                let r = p.push_of(s as u32, &g, rp.tag.as_ref(), rp.samples).await;
                if poison {
                    tally.add(&r);
                } else {
                    honest_tally.add(&r);
                }
                if matches!(
                    r,
                    Reply::Closed | Reply::Refused(crowdgrad_core::wire::ErrorCode::Quarantined)
                ) {
                    let t = first_push.map_or(0.0, |t| t.elapsed().as_secs_f64());
                    caught = Some((t, tally.total()));
                    break 'rounds_loop;
                }
            }
        }
    } else {
        let mut oracle = Oracle::new(&p.joined, ctx.train()?)?;
        let mut batch = 0u64;
        'rounds: while !kids.all_done() && Instant::now() < deadline {
            while old_rule_samples(seed, worker, batch, 0.5) {
                batch += 1;
            }
            let Some((params, versions)) = p.pull_all().await else {
                break;
            };
            let grads = oracle.gradient(&params)?;
            let tag = PushTag {
                batch,
                versions: versions.clone(),
            };
            for (s, g) in grads.iter().enumerate() {
                k += 1;
                let bad = forge(Push::Poison(2.0), g.len(), k, Some(g));
                first_push.get_or_insert_with(Instant::now);
                let r = p.push(s as u32, &bad, Some(&tag)).await;
                tally.add(&r);
                if matches!(
                    r,
                    Reply::Closed | Reply::Refused(crowdgrad_core::wire::ErrorCode::Quarantined)
                ) {
                    let t = first_push.map_or(0.0, |t| t.elapsed().as_secs_f64());
                    caught = Some((t, tally.total()));
                    break 'rounds;
                }
            }
            batch += 1;
        }
    }
    kids.wait(Duration::from_secs_f64(ctx.seconds + 120.0))
        .await;
    let seconds = started.elapsed().as_secs_f64();
    let accuracy = final_accuracy(addr).await;
    let honest = pushes_of(addr, "honest-").await?;
    let status = get_json(addr, "/api/status").await?;
    let spot = spot_summary(&status);
    let quarantined = status["reputation"]["quarantined"].as_u64().unwrap_or(0);
    let hs = honest_h(addr).await;
    let figures = format!(
        "{}poisoner's poison pushes: {} ({}); its honest pushes: {}; {}; quarantined (server) {quarantined}; spot checks: {}; honest {}; accuracy {:.2}% (clean {clean:.2}%); {:.0} s",
        if hs.iter().any(|h| *h > 1) {
            format!("H: honest {hs:?}; ")
        } else {
            String::new()
        },
        tally.total(),
        tally.describe(),
        honest_tally.describe(),
        match caught {
            Some((t, n)) => format!(
                "quarantined {t:.2} s after its first poison push, at poison push {n}"
            ),
            None => "never quarantined".into(),
        },
        spot,
        honest.describe(),
        accuracy,
        seconds
    );
    let mut claims = vec![
        (
            honest.share() >= 99.0,
            format!("honest acceptance {:.2}% < 99%", honest.share()),
        ),
        (
            accuracy >= clean - 1.0,
            format!("accuracy {accuracy:.2}% more than 1 pt below clean {clean:.2}%"),
        ),
    ];
    // Claimed wherever the server spot-checks: the default server too since `--spot-check
    // auto` (issue 21).
    if !status["spot_checks"].is_null() {
        claims.push((
            caught.is_some() && quarantined >= 1,
            "the poisoner was not quarantined".into(),
        ));
    }
    Ok(Verdict {
        attack: "poison on old-unsampled rounds".into(),
        server: mode.label(ctx.exchange),
        figures,
        verdict: judge(&claims),
    })
}
