//! Tests of [`super`] (spotcheck.rs).

use super::*;

/// Issue 21 (found by `bench attack --local-steps auto`): a rollback never restores
/// parameters an earlier rollback undid. Poisoners A (first push made version 10) and B
/// (version 11), judged A first: A's rollback restores 9 and publishes 12; B's must not
/// restore 10 (9 plus A's push) but 9. A later target outside every undone range stays.
#[test]
fn a_rollback_never_restores_what_an_earlier_one_undid() {
    let mut undone = VecDeque::new();
    assert_eq!(below_undone(&undone, 11), 10, "nothing undone yet");
    undone.push_back((9, 11));
    assert_eq!(below_undone(&undone, 11), 9, "10 holds A's push");
    assert_eq!(below_undone(&undone, 12), 9, "11 too");
    assert_eq!(below_undone(&undone, 13), 12, "12 is the restored 9: clean");
    assert_eq!(below_undone(&undone, 10), 9, "the target 9 itself is clean");
    // A later rollback's range: 13 holds what it undid, 12 (the restored 9) is clean.
    undone.push_back((12, 14));
    assert_eq!(below_undone(&undone, 14), 12);
    // Chains: 7 lies in (6, 8], and 6 in a later, wider (2, 12].
    let chain = VecDeque::from([(6, 8), (2, 12)]);
    assert_eq!(below_undone(&chain, 8), 2);
    assert_eq!(below_undone(&chain, 3), 2);
    assert_eq!(below_undone(&undone, 1), 0);
}

/// A shard as the checker sees it: its version, and what each rollback restored.
#[derive(Default)]
struct FakeShard {
    version: Mutex<u64>,
    restored: Mutex<Vec<(f32, u64)>>,
}

impl ShardControl for Arc<FakeShard> {
    fn vouch(&self, _worker: u64) {}
    fn apply_held(&self, _push: &SampledPush) -> Option<(Outcome, bool)> {
        None
    }
    fn roll_back(&self, values: Vec<f32>, target: u64, _poisoner: u64) -> Option<(u64, u64)> {
        let mut v = self.version.lock().unwrap();
        let before = *v;
        if before <= target {
            return None;
        }
        *v += 1;
        self.restored.lock().unwrap().push((values[0], target));
        Some((before, *v))
    }
}

/// Issue 21 (found by `bench attack --local-steps auto`): rollbacks against two
/// poisoners, end to end on the checker's history and log. Version `v` of the one shard
/// holds the value `v`. Poisoner A made version 10, B version 11 and, after A's rollback
/// (to 9, published as 13), version 14. A's rollback restores 9; B's restores 13 (the
/// restored 9), never 10 (9 plus A's push), which is what it did before the fix.
/// The checker's shared state over one [`FakeShard`], with no history yet.
fn one_shard(shard: &Arc<FakeShard>) -> Shared {
    let shared = Shared {
        cfg: SpotConfig::default(),
        counters: Counters::default(),
        recent: Mutex::new(VecDeque::new()),
        reputation: Arc::new(Reputation::new(Default::default())),
        histories: vec![Mutex::new(VecDeque::new())],
        applied: vec![Mutex::new(VecDeque::new())],
        verified: vec![Mutex::new(VecDeque::new())],
        undone: vec![Mutex::new(VecDeque::new())],
        slots: Mutex::new(Slots::new(1)),
        freed: tokio::sync::Notify::new(),
        history: 64,
        controls: std::sync::OnceLock::new(),
    };
    let _ = shared.controls.set(vec![Box::new(shard.clone())]);
    shared
}

#[test]
fn rollbacks_of_two_poisoners_never_bring_the_first_ones_push_back() {
    let shard = Arc::new(FakeShard::default());
    let shared = one_shard(&shard);
    let record = |v: u64, value: f32| {
        shared.histories[0]
            .lock()
            .unwrap()
            .push_back((v, Arc::new(vec![value]), 0));
    };
    for v in 0..=12 {
        record(v, v as f32);
    }
    *shard.version.lock().unwrap() = 12;
    let (a, b) = (100, 200);
    shared.applied[0].lock().unwrap().extend([(10, a), (11, b)]);
    shared.roll_back(a);
    assert_eq!(*shard.restored.lock().unwrap(), vec![(9.0, 9)]);
    // The rollback published the restored 9 as 13; B pushes again and makes 14.
    record(13, 9.0);
    record(14, 14.0);
    *shard.version.lock().unwrap() = 14;
    shared.applied[0].lock().unwrap().push_back((14, b));
    shared.roll_back(b);
    assert_eq!(
        *shard.restored.lock().unwrap(),
        vec![(9.0, 9), (9.0, 13)],
        "B's rollback restores the restored 9, not version 10 (A's push)"
    );
    assert_eq!(shared.counters.rollbacks.load(Ordering::Relaxed), 2);
    // A third poisoner whose only push an earlier rollback already undid: nothing to do.
    shared.applied[0].lock().unwrap().push_back((11, 300));
    shared.roll_back(300);
    assert_eq!(shard.restored.lock().unwrap().len(), 2);
}

/// Issue 21 (found under load in CI: a patient round poisoner at auto ended the run at
/// 11.2%): its first unchecked push is older than the history, a later one is not. The
/// shard is rolled back to the version before that later push, not left to heal, and
/// the one older push is counted as kept. With none held at all, the shard heals.
#[test]
fn a_poisoner_whose_first_push_is_older_than_the_history_is_still_rolled_back() {
    let shard = Arc::new(FakeShard::default());
    let shared = one_shard(&shard);
    for v in 20..=30 {
        shared.histories[0]
            .lock()
            .unwrap()
            .push_back((v, Arc::new(vec![v as f32]), 0));
    }
    *shard.version.lock().unwrap() = 30;
    let p = 7;
    shared.applied[0]
        .lock()
        .unwrap()
        .extend([(5, p), (12, 1), (25, p), (27, p)]);
    shared.roll_back(p);
    assert_eq!(*shard.restored.lock().unwrap(), vec![(24.0, 24)]);
    let c = &shared.counters;
    assert_eq!(c.rollbacks.load(Ordering::Relaxed), 1);
    assert_eq!(c.poisoned_undone.load(Ordering::Relaxed), 2);
    assert_eq!(c.poisoned_kept.load(Ordering::Relaxed), 1);
    assert_eq!(c.healed.load(Ordering::Relaxed), 0);
    // A second poisoner whose pushes are all older than the history: left to heal.
    shared.applied[0].lock().unwrap().extend([(8, 9), (10, 9)]);
    shared.roll_back(9);
    assert_eq!(shard.restored.lock().unwrap().len(), 1);
    assert_eq!(c.healed.load(Ordering::Relaxed), 1);
    assert_eq!(c.poisoned_kept.load(Ordering::Relaxed), 3);
}

#[test]
fn compare_measures_direction_and_length() {
    let e = [1.0f32, 2.0, -2.0];
    let same = compare(&e, &e);
    assert!((same.cosine - 1.0).abs() < 1e-12 && (same.norm_ratio - 1.0).abs() < 1e-12);
    let double: Vec<f32> = e.iter().map(|v| 2.0 * v).collect();
    let d = compare(&e, &double);
    assert!((d.cosine - 1.0).abs() < 1e-12 && (d.norm_ratio - 2.0).abs() < 1e-12);
    let neg: Vec<f32> = e.iter().map(|v| -v).collect();
    assert!((compare(&e, &neg).cosine + 1.0).abs() < 1e-12);
    assert_eq!(compare(&[0.0; 3], &[0.0; 3]).cosine, 1.0);
    assert_eq!(compare(&[0.0; 3], &e).cosine, 0.0);
}

/// Issue 21: the checker's queue holds at most [`QUEUE`] checks, and one worker at most
/// [`QUEUE_PER_WORKER`] of them; a place given back is free again (a push drawn when
/// none is free is refused `busy`, [`SpotChecker::sample`]).
#[test]
fn the_queue_is_bounded_overall_and_per_worker() {
    let mut s = Slots::new(2);
    for _ in 0..QUEUE_PER_WORKER {
        assert!(s.take(1, false));
    }
    assert!(!s.take(1, false), "worker 1's share is full");
    let mut w = 2;
    while s.total < QUEUE {
        assert!(s.take(w, false), "room left at {}", s.total);
        if s.by_worker[&w].0 == QUEUE_PER_WORKER {
            w += 1;
        }
    }
    assert!(!s.take(99, false), "the queue is full for everyone");
    assert!(!s.take(99, true), "and for workers on probation");
    s.give(1);
    assert!(s.take(1, false), "worker 1 takes its place again");
    assert_eq!(s.total, QUEUE);
    assert!(!s.take(99, false));
    // A place given back by a worker holding none changes nothing.
    s.give(12345);
    assert_eq!(s.total, QUEUE);
    for _ in 0..QUEUE_PER_WORKER {
        s.give(1);
    }
    assert_eq!(s.total, QUEUE - QUEUE_PER_WORKER);
    assert!(s.take(99, false));
}

/// Issue 21: workers on probation (fresh identities, a sybil crowd) hold at most
/// [`PROBATION_QUEUE`] places together and [`PROBATION_PER_SHARD`] a shard each; the
/// rest of the queue stays free for vouched workers.
#[test]
fn workers_on_probation_cannot_fill_the_queue() {
    let shards = 2;
    let per = PROBATION_PER_SHARD * shards;
    let mut s = Slots::new(shards);
    let mut sybil = 1000;
    let mut held = 0;
    while held < QUEUE {
        if s.take(sybil, true) {
            held += 1;
        } else if s.by_worker.get(&sybil).map_or(0, |e| e.0) == per {
            sybil += 1;
        } else {
            break;
        }
    }
    assert_eq!(held, PROBATION_QUEUE, "the probation part is full");
    assert_eq!(sybil - 1000, (PROBATION_QUEUE / per) as u64, "{per} each");
    assert!(!s.take(sybil + 1, true), "a new sybil waits");
    for w in 0..(QUEUE - PROBATION_QUEUE) as u64 {
        assert!(
            s.take(w % 4, false),
            "vouched worker {} takes place {w}",
            w % 4
        );
    }
    assert_eq!(s.total, QUEUE);
    assert!(!s.take(1, false), "the whole queue is full");
    // A probation place given back is free for probation again.
    s.give(1000);
    assert_eq!(s.probation, PROBATION_QUEUE - 1);
    assert!(s.take(5000, true), "a waiting sybil takes it");
    assert_eq!(s.probation, PROBATION_QUEUE);
    assert!(!s.take(1000, true), "full again");
    // A worker vouched while it holds a probation place gives that back as such.
    let mut s = Slots::new(shards);
    for _ in 0..per {
        assert!(
            s.take(7, true),
            "a round's slice to every shard is queued at once"
        );
    }
    assert!(!s.take(7, true), "its next round waits for the verdict");
    assert!(
        s.take(7, false),
        "vouched now: its share is the vouched one"
    );
    s.give(7);
    assert_eq!((s.total, s.probation), (per, per - 1));
    for _ in 0..per {
        s.give(7);
    }
    assert!(!s.by_worker.contains_key(&7));
    assert_eq!((s.total, s.probation), (0, 0));
}

#[test]
fn flags_are_checked() {
    let ok = SpotArgs {
        spot_check: "0.01".into(),
        spot_check_cosine: DEFAULT_COSINE,
        spot_check_norm_tol: DEFAULT_NORM_TOL,
        spot_check_history: "64".into(),
        no_spot_check_rollback: false,
        no_spot_check_hold: false,
        quarantine_rejections: 0,
        quarantine_out_of_bounds: false,
        quarantine_window: 60.0,
    };
    assert_eq!(ok.check(true).unwrap().fraction, 0.01);
    assert_eq!(ok.check(true).unwrap().history, Some(64));
    // auto: on where this process holds the shards, off with --shard-urls.
    let auto = SpotArgs {
        spot_check: "auto".into(),
        spot_check_history: "auto".into(),
        ..ok.clone()
    };
    let local = auto.check(true).unwrap();
    assert_eq!(local.fraction, crate::config::defence::DEFAULT_FRACTION);
    assert!(local.fraction > 0.0);
    assert_eq!(local.history, None);
    assert_eq!(auto.check(false).unwrap().fraction, 0.0);
    for bad in [
        SpotArgs {
            spot_check: "1.5".into(),
            ..ok.clone()
        },
        SpotArgs {
            spot_check: "NaN".into(),
            ..ok.clone()
        },
        SpotArgs {
            spot_check: "often".into(),
            ..ok.clone()
        },
        SpotArgs {
            spot_check_norm_tol: -1.0,
            ..ok.clone()
        },
        SpotArgs {
            spot_check_history: "0".into(),
            ..ok.clone()
        },
        SpotArgs {
            spot_check_history: "-3".into(),
            ..ok.clone()
        },
        SpotArgs {
            quarantine_window: 0.0,
            ..ok.clone()
        },
    ] {
        assert!(bad.check(true).is_err(), "{bad:?}");
    }
}

/// `--spot-check-history auto` keeps what fits in [`HISTORY_BYTES`](crate::config::defence::HISTORY_BYTES),
/// 8 to 64 versions.
#[test]
fn the_automatic_history_is_scaled_to_the_model() {
    use crate::config::defence::{auto_history, MAX_AUTO_HISTORY, MIN_AUTO_HISTORY};
    // mlp:128 on MNIST: 64 versions are 26 MB.
    assert_eq!(auto_history(101_770), MAX_AUTO_HISTORY);
    // A 3.3 MB model (the default gpt): 20 versions, 66 MB.
    assert_eq!(auto_history(825_000), 20);
    // A huge model still keeps the least that serves ordinary staleness.
    assert_eq!(auto_history(100_000_000), MIN_AUTO_HISTORY);
    assert_eq!(auto_history(0), MAX_AUTO_HISTORY);
}
