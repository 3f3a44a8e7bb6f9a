//! The attacks of one client or a socket flood: silent sockets, a stale tag, poisoned
//! reports and a kill -9, replays, and acting as another volunteer's public identity.

use super::super::load::fd_count;
use super::common::{
    attacker_addr, get_json, http, join, judge, spot_summary, Children, Ctx, Mode, Oracle, Raw,
    Reply, Tally, Verdict,
};
use crate::error::{Error, Result};
use crowdgrad_core::wire::PushTag;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;

/// Addresses and silent connections per address of the socket flood (17 × 241 = 4,097:
/// one more than the server's default `--max-connections`, each address under the per-IP
/// cap of 256).
const FLOOD_ADDRS: u8 = 17;
const FLOOD_PER_ADDR: usize = 241;

/// The honest client's address during the flood (outside 127.0.0.0/24, as a volunteer's
/// would be).
const HONEST: [u8; 4] = [127, 1, 0, 1];

/// An honest status read and join during the flood: `(what, status or error, ms)`.
async fn probe(addr: SocketAddr) -> Vec<(String, String, f64)> {
    let mut out = Vec::new();
    let t = Instant::now();
    let r = http(addr, HONEST, "GET", "/api/status", b"").await;
    out.push((
        "status".into(),
        r.map_or_else(|e| e.to_string(), |(c, _, _)| c.to_string()),
        t.elapsed().as_secs_f64() * 1e3,
    ));
    let t = Instant::now();
    let r = join(addr, HONEST, None, Some("honest")).await;
    out.push((
        "join".into(),
        r.map_or_else(|e| e.to_string(), |(c, _, _)| c.to_string()),
        t.elapsed().as_secs_f64() * 1e3,
    ));
    out
}

/// 17 addresses × 241 silent TCP connections; an honest status read and join from another
/// address while they are held (twice), and when the server closed each of them.
pub(super) async fn sockets(ctx: &Ctx, mode: Mode) -> Result<Verdict> {
    let server = ctx.serve(mode, &[])?;
    let addr = server.addr;
    let fds_before = fd_count(server.pid());
    let watch = Duration::from_secs_f64((2.0 * ctx.seconds).clamp(20.0, 120.0));
    let opening = Instant::now();
    // All at once (4,097 connects in flight), so they are held together.
    let conns = futures_util::future::join_all((0..FLOOD_ADDRS).flat_map(|a| {
        (0..FLOOD_PER_ADDR).map(move |_| async move {
            let s = tokio::net::TcpSocket::new_v4().ok()?;
            s.bind(SocketAddr::from(([127, 0, 0, 2 + a], 0))).ok()?;
            let c = tokio::time::timeout(Duration::from_secs(10), s.connect(addr))
                .await
                .ok()?
                .ok()?;
            Some((c, Instant::now()))
        })
    }))
    .await;
    let failed = conns.iter().filter(|c| c.is_none()).count();
    let streams: Vec<_> = conns.into_iter().flatten().collect();
    let open_s = opening.elapsed().as_secs_f64();
    // Every socket is held silent until the server closes it (EOF or reset), or until
    // `watch` after the last one connected; its close time counts from its own connect.
    let held = Instant::now();
    let end = tokio::time::Instant::from_std(held + watch);
    let watchers: Vec<_> = streams
        .into_iter()
        .map(|(mut stream, at)| {
            tokio::spawn(async move {
                let mut buf = [0u8; 512];
                loop {
                    match tokio::time::timeout_at(end, stream.read(&mut buf)).await {
                        Err(_) => return None,
                        Ok(Ok(0) | Err(_)) => return Some(at.elapsed().as_secs_f64()),
                        Ok(Ok(_)) => {}
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let fds_held = fd_count(server.pid());
    let first = probe(addr).await;
    let first_at = held.elapsed().as_secs_f64();
    tokio::time::sleep_until(tokio::time::Instant::from_std(held + watch / 2)).await;
    let second = probe(addr).await;
    let second_at = held.elapsed().as_secs_f64();
    let mut closed = Vec::new();
    let mut still = 0usize;
    tokio::time::sleep_until(end).await;
    let fds_end = fd_count(server.pid());
    for w in watchers {
        match w.await.ok().flatten() {
            Some(t) => closed.push(t),
            None => still += 1,
        }
    }
    closed.sort_by(f64::total_cmp);
    let pick = |p: f64| {
        closed
            .get(((closed.len() as f64 - 1.0) * p) as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    let show = |v: &[(String, String, f64)], at: f64| {
        let parts: Vec<String> = v
            .iter()
            .map(|(w, c, ms)| format!("{w} {c} in {ms:.0} ms"))
            .collect();
        format!("at {at:.1} s: {}", parts.join(", "))
    };
    let total = FLOOD_ADDRS as usize * FLOOD_PER_ADDR;
    let figures = format!(
        "{total} silent connections from 127.0.0.2-{} ({} failed to connect; all in flight at once, connected within {open_s:.1} s; server fds {fds_before} → {fds_held} 1 s later, {fds_end} at the end); honest from 127.1.0.1 once all were connected: {}; {}; closed by the server: {} (after their connect: p50 {:.1} s, max {:.1} s); still open on the client's side {:.0} s after the last connected (never accepted: not held by the server): {still}",
        2 + FLOOD_ADDRS - 1,
        failed,
        show(&first, first_at),
        show(&second, second_at),
        closed.len(),
        pick(0.5),
        pick(1.0),
        watch.as_secs_f64(),
    );
    let mut claims = Vec::new();
    for (v, at) in [(&first, first_at), (&second, second_at)] {
        for (w, c, ms) in v {
            claims.push((
                c == "200" && *ms < 1000.0,
                format!("honest {w} at {at:.0} s: {c} in {ms:.0} ms"),
            ));
        }
    }
    // What the flood can hold is the server's: one /24 gets at most its prefix budget (512
    // by default) of the server's connections, whenever it is looked at. A socket still open
    // on this side may be one the server has not accepted yet (the kernel dropped the last
    // ACK of its handshake from a full accept queue, so only this side thinks it is open; a
    // retransmitted SYN-ACK completes it later, and the server then closes it at its own
    // deadline): printed, not judged.
    let cap = fds_before + 512 + 16;
    claims.push((
        fds_held <= cap && fds_end <= cap,
        format!(
            "the server held {fds_held} then {fds_end} fds (started with {fds_before}; one /24 \
             may hold 512)"
        ),
    ));
    Ok(Verdict {
        attack: "silent sockets".into(),
        server: mode.label(ctx.exchange),
        figures,
        verdict: judge(&claims),
    })
}

/// One honest worker trains 300 steps; then a push tagged (and based) 200 versions back.
pub(super) async fn stale(ctx: &Ctx, mode: Mode) -> Result<Verdict> {
    // At H = 1 (Mode::flags) the honest worker's 300 steps make over 200 versions, so a tag
    // 200 back names one the checker no longer holds.
    let server = ctx.serve(mode, &[])?;
    let addr = server.addr;
    let mut kids = Children(vec![
        ctx.work(&server.url, &["--name", "honest-0", "--steps", "300"])?
    ]);
    if !kids.wait(Duration::from_secs(180)).await {
        return Err(Error::Process(
            "the honest worker did not finish 300 steps in 180 s".into(),
        ));
    }
    let mut p = Raw::join(addr, attacker_addr(0), None, Some("stale")).await?;
    let (params, versions) = p
        .pull_all()
        .await
        .ok_or_else(|| Error::WebSocket("pull".into()))?;
    let mut oracle = Oracle::new(&p.joined, ctx.train()?)?;
    let g = oracle.gradient(&params)?;
    let old: Vec<u64> = versions.iter().map(|v| v.saturating_sub(200)).collect();
    let tag = PushTag {
        batch: 0,
        versions: old.clone(),
    };
    p.links[0].version = old[0];
    let reply = p.push(0, &g[0], Some(&tag)).await;
    let after = p.pull(0).await.map_or(0, |(v, _)| v);
    let s = get_json(addr, "/api/status").await?;
    let applied = after != versions[0];
    let figures = format!(
        "shard 0 at version {}, push tagged {:?}: {}; shard 0 then at {} ({}); spot checks: {}",
        versions[0],
        old,
        reply.name(),
        after,
        if applied {
            "applied"
        } else {
            "nothing applied"
        },
        spot_summary(&s)
    );
    // Without spot checks nothing holds versions: a push 200 versions stale is asynchronous
    // SGD's ordinary stale gradient, and the issue claims nothing for it. (A default server
    // spot-checks since `--spot-check auto`: then the claim holds for it too.)
    let verdict = if s["spot_checks"].is_null() {
        format!(
            "- (no spot checks: {})",
            if applied {
                "applied as a stale gradient"
            } else {
                "refused"
            }
        )
    } else {
        judge(&[(
            !applied && matches!(reply, Reply::Refused(_)),
            format!(
                "the push got {} and shard 0 moved {} → {after}",
                reply.name(),
                versions[0]
            ),
        )])
    };
    Ok(Verdict {
        attack: "stale tag (200 back)".into(),
        server: mode.label(ctx.exchange),
        figures,
        verdict,
    })
}

/// A leaderboard entry: name, samples, compute seconds (`None`: not a finite number).
#[derive(Debug, Clone, PartialEq)]
struct Entry {
    name: String,
    samples: u64,
    accepted: u64,
    rejected: u64,
    compute: Option<f64>,
}

async fn board(addr: SocketAddr) -> Result<std::collections::BTreeMap<String, Entry>> {
    let b = get_json(addr, "/api/contributors?limit=1000").await?;
    let mut out = std::collections::BTreeMap::new();
    for c in b["contributors"].as_array().into_iter().flatten() {
        let Some(id) = c["identity"].as_str() else {
            continue;
        };
        out.insert(
            id.to_string(),
            Entry {
                name: c["name"].as_str().unwrap_or("").to_string(),
                samples: c["samples"].as_u64().unwrap_or(0),
                accepted: c["pushes_accepted"].as_u64().unwrap_or(0),
                rejected: c["pushes_rejected"].as_u64().unwrap_or(0),
                compute: c["compute_seconds"].as_f64(),
            },
        );
    }
    Ok(out)
}

fn show(e: Option<&Entry>) -> String {
    e.map_or("absent".into(), |e| {
        format!(
            "{} samples, {} s",
            e.samples,
            e.compute.map_or("null".into(), |c| format!("{c:.1}"))
        )
    })
}

/// Two honest identities train; an attacker sends poisoned, rewound and huge Reports and
/// 600 all-zero pushes; the server is killed with SIGKILL and restarted on the same
/// checkpoint directory (and so the same ledger).
pub(super) async fn reports(ctx: &Ctx, mode: Mode) -> Result<Verdict> {
    let dir = std::env::temp_dir().join(format!(
        "crowdgrad-bench-attack-{}-{}",
        std::process::id(),
        mode.name()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| Error::io("making a checkpoint dir", e))?;
    let flags = vec!["--checkpoint-dir".to_string(), dir.display().to_string()];
    let result = reports_in(ctx, mode, &flags).await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn reports_in(ctx: &Ctx, mode: Mode, flags: &[String]) -> Result<Verdict> {
    let server = ctx.serve(mode, flags)?;
    let addr = server.addr;
    let secs = ctx.seconds.to_string();
    let ids = ["ledger-honest-a", "ledger-honest-b"];
    let mut kids = Children(Vec::new());
    for (i, id) in ids.iter().enumerate() {
        let name = format!("honest-{i}");
        kids.0.push(ctx.work(
            &server.url,
            &["--id", id, "--name", &name, "--seconds", &secs],
        )?);
    }
    let attacker_id = "ledger-attacker-01";
    let joined_at = Instant::now();
    let mut p = Raw::join(addr, attacker_addr(0), Some(attacker_id), Some("attacker")).await?;
    let mut said = Vec::new();
    for c in [1.7e308, 0.0, 1.7e308, 100.0, 0.0, 100.0, 0.0, 100.0, 1e12] {
        // Spaced past the per-report gap (0.5 s), so the rate limit is not what refuses them.
        tokio::time::sleep(Duration::from_millis(600)).await;
        let r = p.report(0, c, c, Duration::from_millis(200)).await;
        said.push(format!("{c:e}: {}", r.map_or("no error", |c| c.name())));
    }
    let mut zeros = Tally::default();
    let n = p.len(0);
    for k in 0..600usize {
        let mut g = vec![0.0f32; n];
        g[k % n.max(1)] = -0.0;
        let r = p.push(0, &g, None).await;
        zeros.add(&r);
        if r == Reply::Closed {
            break;
        }
    }
    let attacker_wall = joined_at.elapsed().as_secs_f64();
    drop(p);
    kids.wait(Duration::from_secs_f64(ctx.seconds + 120.0))
        .await;
    // The ledger's writer flushes every second.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let before = board(addr).await?;
    // kill -9 (Child::kill is SIGKILL) and the same checkpoint directory again.
    drop(server);
    let server = ctx.serve(mode, flags)?;
    let after = board(server.addr).await?;
    // The board is keyed by public ids (the secret each client sent, hashed).
    let public = crate::registry::ledger::public_id;
    let honest: Vec<String> = ids
        .iter()
        .map(|id| {
            let p = public(id);
            format!("{id} {} → {}", show(before.get(&p)), show(after.get(&p)))
        })
        .collect();
    let a = after.get(&public(attacker_id));
    let figures = format!(
        "reports (compute_s: reply) {}; 600 zero pushes: {}; attacker before kill {}, after restart {} (its session {attacker_wall:.0} s); honest before kill -9 → after restart: {}",
        said.join(", "),
        zeros.describe(),
        show(before.get(&public(attacker_id))),
        show(a),
        honest.join("; ")
    );
    let mut claims = Vec::new();
    for id in ids {
        let (b, f) = (before.get(&public(id)), after.get(&public(id)));
        claims.push((
            b.is_some_and(|b| b.samples > 0)
                && f.is_some_and(|f| Some(f.samples) >= b.map(|b| b.samples)),
            format!("{id}: {} before, {} after the restart", show(b), show(f)),
        ));
    }
    claims.push((
        a.is_some_and(|a| {
            a.compute
                .is_some_and(|c| c.is_finite() && c <= attacker_wall + 10.0)
        }),
        format!(
            "the attacker's compute is {} after a {attacker_wall:.0} s session",
            show(a)
        ),
    ));
    claims.push((
        a.is_none_or(|a| a.samples == 0),
        format!("the attacker's zero pushes earned {}", show(a)),
    ));
    Ok(Verdict {
        attack: "reports + kill -9".into(),
        server: mode.label(ctx.exchange),
        figures,
        verdict: judge(&claims),
    })
}

/// The same push frame on a new connection, and the same gradient with rising request ids.
pub(super) async fn replays(ctx: &Ctx, mode: Mode) -> Result<Verdict> {
    let server = ctx.serve(mode, &[])?;
    let mut p = Raw::join(server.addr, attacker_addr(0), None, Some("replayer")).await?;
    let (params, versions) = p
        .pull_all()
        .await
        .ok_or_else(|| Error::WebSocket("pull".into()))?;
    let mut oracle = Oracle::new(&p.joined, ctx.train()?)?;
    // An honest gradient for the batch the push claims (it passes a spot check): only the
    // replays are wrong.
    let g = oracle.honest(&params, p.batch + 1)?.swap_remove(0);
    let (rid, frame) = p.push_frame(0, &g, None);
    let first = p.send(0, rid, frame.clone()).await;
    // A new identity's push is held until its spot check passes, then applied: wait for it
    // (bounded) before the replays.
    let mut v1 = p.pull(0).await.map_or(0, |(v, _)| v);
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while v1 <= versions[0] && std::time::Instant::now() < until {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        v1 = p.pull(0).await.map_or(v1, |(v, _)| v);
    }
    p.reconnect(0).await?;
    let again = p.send(0, rid, frame).await;
    let mut rising = Tally::default();
    for _ in 0..20 {
        rising.add(&p.push(0, &g, None).await);
    }
    // A quarantined replayer's sockets are closed: then the shard is read by a new client.
    let v2 = match p.pull(0).await {
        Some((v, _)) => Some(v),
        None => Raw::join(server.addr, attacker_addr(1), None, Some("reader"))
            .await
            .ok()
            .map(|r| r.links[0].version),
    };
    let v2s = v2.map_or("unread".into(), |v| v.to_string());
    let spot = get_json(server.addr, "/api/status")
        .await
        .map_or_else(|e| e.to_string(), |s| spot_summary(&s));
    let figures = format!(
        "first push: {} (shard 0 {} → {v1}); same frame on a new connection: {}; same gradient, 20 new request ids: {}; shard 0 then at {v2s}; spot checks: {spot}",
        first.name(),
        versions[0],
        again.name(),
        rising.describe()
    );
    Ok(Verdict {
        attack: "replays".into(),
        server: mode.label(ctx.exchange),
        figures,
        verdict: judge(&[
            (
                first == Reply::Ack,
                format!("the first push got {}", first.name()),
            ),
            (
                matches!(again, Reply::Refused(_)),
                format!(
                    "the frame replayed on a new connection got {}",
                    again.name()
                ),
            ),
            (
                rising.get("ack") == 0,
                format!(
                    "{} of 20 replays with new request ids applied",
                    rising.get("ack")
                ),
            ),
            (
                v2 == Some(v1),
                format!("shard 0 moved {v1} → {v2s} after the first push"),
            ),
        ]),
    })
}

/// A client that knows only a volunteer's identity as `/api/contributors` shows it joins as
/// it, renames it, pushes an honest-looking gradient (credit) and six replays (refusals
/// toward a quarantine).
pub(super) async fn identity(ctx: &Ctx, mode: Mode) -> Result<Verdict> {
    let server = ctx.serve(mode, &[])?;
    let addr = server.addr;
    let mut kids = Children(vec![ctx.work(
        &server.url,
        &[
            "--id",
            "victim-volunteer-01",
            "--name",
            "victim",
            "--steps",
            "200",
        ],
    )?]);
    if !kids.wait(Duration::from_secs(180)).await {
        return Err(Error::Process(
            "the victim did not finish 200 steps in 180 s".into(),
        ));
    }
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let b0 = board(addr).await?;
    let (public, owner0) = b0
        .iter()
        .find(|(_, e)| e.name == "victim")
        .map(|(id, e)| (id.clone(), e.clone()))
        .ok_or_else(|| Error::Process("the victim is not on the leaderboard".into()))?;
    let mut acted = Tally::default();
    let joined = Raw::join(
        addr,
        attacker_addr(1),
        Some(&public),
        Some("renamed-by-attacker"),
    )
    .await;
    let join_result = match joined {
        Ok(mut p) => {
            if let Some((params, _)) = p.pull_all().await {
                let mut oracle = Oracle::new(&p.joined, ctx.train()?)?;
                let g = oracle.gradient(&params)?;
                for (s, gs) in g.iter().enumerate() {
                    acted.add(&p.push(s as u32, gs, None).await);
                }
                for _ in 0..6 {
                    acted.add(&p.push(0, &g[0], None).await);
                }
            }
            "joined".to_string()
        }
        Err(e) => format!("join refused: {e}"),
    };
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let b1 = board(addr).await?;
    let owner1 = b1.get(&public).cloned();
    let (code, _, text) = join(
        addr,
        [127, 0, 0, 1],
        Some("victim-volunteer-01"),
        Some("victim"),
    )
    .await?;
    let s = get_json(addr, "/api/status").await?;
    let o1 = owner1.clone().unwrap_or(Entry {
        name: "absent".into(),
        samples: 0,
        accepted: 0,
        rejected: 0,
        compute: None,
    });
    let figures = format!(
        "public identity {public:?}: attacker {join_result}, its pushes {}; owner before: name {:?}, {} samples, {} accepted / {} refused; after: name {:?}, {} samples, {} accepted / {} refused; quarantined {}; owner's next join: {code}{}",
        acted.describe(),
        owner0.name,
        owner0.samples,
        owner0.accepted,
        owner0.rejected,
        o1.name,
        o1.samples,
        o1.accepted,
        o1.rejected,
        s["reputation"]["quarantined"],
        if code == 200 { String::new() } else { format!(" {text}") }
    );
    Ok(Verdict {
        attack: "public identity".into(),
        server: mode.label(ctx.exchange),
        figures,
        verdict: judge(&[
            (o1.name == owner0.name, format!("renamed to {:?}", o1.name)),
            (
                o1.samples == owner0.samples && o1.rejected == owner0.rejected,
                format!(
                    "credited {} → {} samples, refusals {} → {}",
                    owner0.samples, o1.samples, owner0.rejected, o1.rejected
                ),
            ),
            (code == 200, format!("the owner's next join got {code}")),
        ]),
    })
}
