//! Tests of [`super`] (registry/mod.rs).

use super::*;

fn read(version: u64) -> Pulled {
    Pulled {
        version,
        clock: None,
        min_clock: None,
    }
}

fn applied(staleness: u64) -> Outcome {
    Outcome::Applied {
        version: 1,
        staleness,
        lr_scale: 1.0,
        merged: 1,
    }
}

#[test]
fn refused_frames_are_not_rejected_pushes() {
    let r = Registry::new(2, 10);
    let (id, _) = r.join(ClientKind::Native, None, 1).unwrap();
    r.pushed(0, Some(id), &applied(0), 32, true);
    r.pushed(
        1,
        Some(id),
        &Outcome::Rejected {
            code: ErrorCode::TooStale,
            message: "old".into(),
        },
        32,
        false,
    );
    r.frame_rejected(1, Some(id), ErrorCode::Malformed);
    r.frame_rejected(1, None, ErrorCode::Protocol);
    r.frame_rejected(7, None, ErrorCode::WrongShard);
    let (workers, shards, totals) = r.view();
    let w = &workers[0].counters;
    assert_eq!(
        (w.pushes_applied, w.pushes_rejected, w.frames_rejected),
        (1, 1, 1)
    );
    assert_eq!(w.rejected_by_reason.get("too_stale"), Some(&1));
    assert_eq!(w.frames_rejected_by_reason.get("malformed"), Some(&1));
    assert_eq!(workers[0].last_rejection.as_deref(), Some("malformed"));
    assert_eq!(
        (shards[1].pushes_rejected, shards[1].frames_rejected),
        (1, 2)
    );
    assert_eq!(shards[0].frames_rejected, 0);
    // The totals count every refusal once, even on a shard that does not exist.
    assert_eq!((totals.pushes_rejected, totals.frames_rejected), (1, 3));
    assert_eq!(totals.rejected_by_reason.len(), 1);
    assert_eq!(
        totals.frames_rejected_by_reason.get("wrong_shard"),
        Some(&1)
    );
    assert_eq!(
        totals.samples, 32,
        "samples count once per step, on shard 0"
    );
}

/// A credential's session: open while connected, and for 10 minutes after the worker was
/// last seen; then it has expired, though the registry still keeps the row.
#[test]
fn a_session_stays_open_while_connected_and_ends_10_minutes_after_it_was_last_seen() {
    let r = Registry::new(2, 10);
    let (id, _) = r.join(ClientKind::Native, None, 1).unwrap();
    let later = |s: f64| Instant::now() + std::time::Duration::from_secs_f64(s);
    assert!(r.session_open(id));
    assert!(!r.session_open_at(id, later(FORGET_AFTER_S + 1.0)));
    r.connection(id, true);
    assert!(
        r.session_open_at(id, later(FORGET_AFTER_S + 1.0)),
        "connected"
    );
    r.connection(id, false);
    assert!(r.session_open_at(id, later(FORGET_AFTER_S - 5.0)));
    assert!(!r.session_open_at(id, later(FORGET_AFTER_S + 5.0)));
    assert!(r.knows(id), "the row is still there");
    assert!(!r.session_open(id + 1), "never joined");
}

#[test]
fn totals_count_pulls() {
    let r = Registry::new(2, 10);
    let (id, _) = r.join(ClientKind::Browser, None, 1).unwrap();
    for v in 0..3 {
        r.pulled(0, Some(id), &read(v));
        r.pulled(1, Some(id), &read(v + 2));
    }
    r.pulled(1, None, &read(0));
    let (workers, shards, totals) = r.view();
    assert_eq!((shards[0].pulls, shards[1].pulls), (3, 4));
    assert_eq!(totals.pulls, 7);
    assert_eq!(workers[0].counters.pulls, 6);
    assert_eq!(workers[0].counters.read_skew_max, 2);
}

#[test]
fn the_view_carries_the_newest_workers_and_totals_by_kind() {
    let r = Registry::new(1, 20_000);
    let mut ids = Vec::new();
    for i in 0..10_000u64 {
        let kind = if i % 4 == 0 {
            ClientKind::Native
        } else {
            ClientKind::Browser
        };
        ids.push(r.join(kind, None, 6).unwrap().0);
    }
    // Workers 0, 4, 8, ... (native) and 1 (browser) connect.
    for &id in ids.iter().step_by(4).chain(std::iter::once(&ids[1])) {
        r.connection(id, true);
    }
    let (workers, shards, totals) = r.view();
    assert_eq!(workers.len(), RECENT_WORKERS);
    let newest: Vec<u64> = ids.iter().rev().take(RECENT_WORKERS).copied().collect();
    assert_eq!(workers.iter().map(|w| w.id).collect::<Vec<_>>(), newest);
    assert!(shards[0].workers.is_none(), "only the totals count workers");
    let by_kind = totals.workers.unwrap();
    assert_eq!((by_kind.registered, by_kind.connected), (10_000, 2_501));
    assert_eq!(
        by_kind.native,
        KindCount {
            registered: 2_500,
            connected: 2_500
        }
    );
    assert_eq!(
        by_kind.browser,
        KindCount {
            registered: 7_500,
            connected: 1
        }
    );
    // Small enough to stream every second: the 100 workers dominate.
    let json = serde_json::to_string(&(&workers, &totals)).unwrap();
    assert!(json.len() < 200_000, "{} bytes", json.len());
}

/// Issue 18: the per-kind counts kept as workers join, connect, leave and are forgotten
/// equal a walk over every worker, threads grouped by volunteer.
#[test]
fn kept_totals_equal_a_recount() {
    let r = Registry::new(1, 40);
    let threads = |v: &str, index: u32| crowdgrad_core::spec::Threads {
        volunteer: v.into(),
        index,
        count: 2,
    };
    let mut ids = Vec::new();
    for i in 0..60u32 {
        let kind = if i % 3 == 0 {
            ClientKind::Native
        } else {
            ClientKind::Browser
        };
        let t = (i % 4 == 0).then(|| threads(&format!("v{}", i / 8), i % 2));
        if let Some((id, _)) = r.join_thread(kind, None, 6, t) {
            ids.push(id);
        }
        // Connect, double-connect, disconnect in a pattern; check after every step.
        for (k, &id) in ids.iter().enumerate() {
            match (k + i as usize) % 5 {
                0 => r.connection(id, true),
                1 if k % 2 == 0 => r.connection(id, false),
                _ => {}
            }
        }
        let (_, totals) = r.summary();
        assert_eq!(totals.workers, Some(r.recount()), "after join {i}");
    }
    // Everyone disconnects and the registry is full: forgetting old workers keeps the count.
    for &id in &ids {
        for _ in 0..8 {
            r.connection(id, false);
        }
    }
    {
        let mut g = r.lock();
        let past = Instant::now()
            .checked_sub(std::time::Duration::from_secs_f64(FORGET_AFTER_S + 1.0))
            .unwrap();
        for w in g.workers.values_mut().take(30) {
            w.last_seen = Some(past);
        }
    }
    assert!(r.join(ClientKind::Native, None, 6).is_some());
    assert_eq!(r.summary().1.workers, Some(r.recount()));
    assert_eq!(r.view().2.workers, Some(r.recount()));
}

#[test]
fn the_sweep_forgets_workers_gone_for_ten_minutes_with_their_seats() {
    let r = Registry::new(1, 100);
    let ids: Vec<u64> = (0..4)
        .map(|_| r.join(ClientKind::Native, None, 6).expect("room").0)
        .collect();
    for (i, &id) in ids.iter().enumerate() {
        r.identify(
            id,
            &format!("sweep-{i}"),
            ledger::Who::default(),
            ClientKind::Native,
        );
    }
    r.connection(ids[1], true);
    {
        let mut g = r.lock();
        let past = Instant::now()
            .checked_sub(std::time::Duration::from_secs_f64(FORGET_AFTER_S + 1.0))
            .unwrap();
        // 0 and 1 were last seen long ago; 1 still has a socket open.
        for id in &ids[..2] {
            g.workers.get_mut(id).expect("known").last_seen = Some(past);
        }
    }
    assert_eq!(r.with_ledger(|l| l.seats()), 4);
    assert_eq!(r.forget_idle(), [ids[0]]);
    assert!(!r.knows(ids[0]));
    assert!(ids[1..].iter().all(|&id| r.knows(id)));
    assert_eq!(r.with_ledger(|l| l.seats()), 3);
    assert_eq!(r.summary().1.workers, Some(r.recount()));
    assert!(r.forget_idle().is_empty());
}

#[test]
fn pages_walk_every_worker_newest_first() {
    let r = Registry::new(1, 1_000);
    let ids: Vec<u64> = (0..250)
        .map(|_| r.join(ClientKind::Native, None, 6).unwrap().0)
        .collect();
    let mut seen = Vec::new();
    let mut offset = 0;
    loop {
        let page = r.workers(offset, 64);
        assert_eq!((page.total, page.offset, page.limit), (250, offset, 64));
        if page.workers.is_empty() {
            break;
        }
        assert!(page.workers.len() <= 64);
        offset += page.workers.len();
        seen.extend(page.workers.iter().map(|w| w.id));
    }
    assert_eq!(seen, ids.iter().rev().copied().collect::<Vec<_>>());
    // The first page is what the status carries; limits are capped.
    let first = r.workers(0, RECENT_WORKERS);
    let (recent, _, _) = r.view();
    assert_eq!(
        first.workers.iter().map(|w| w.id).collect::<Vec<_>>(),
        recent.iter().map(|w| w.id).collect::<Vec<_>>()
    );
    assert_eq!(r.workers(0, 1_000_000).limit, MAX_PAGE);
    assert!(r.workers(10_000, 10).workers.is_empty());
}
