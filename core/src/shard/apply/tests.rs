//! Tests of [`super`] (apply.rs).

use super::*;
use crate::optim::Rule;

fn sgd(lr: f32) -> OptimizerConfig {
    OptimizerConfig {
        rule: Rule::Sgd,
        lr,
        weight_decay: 0.0,
        clip_norm: None,
        schedule: Default::default(),
    }
}

/// Issue 18: a driver that keeps every version (the spot checker's history) holds the
/// previous buffer, so each update allocated; a version it lets go, offered back with
/// `recycle`, is the next update's buffer. The values are the same either way.
#[test]
fn an_update_writes_into_a_recycled_buffer() {
    let policy = StalenessPolicy::parse("accept").unwrap();
    let mut a = ShardCore::new(vec![1.0; 4], sgd(0.5), policy, Consistency::Async);
    let mut b = ShardCore::new(vec![1.0; 4], sgd(0.5), policy, Consistency::Async);
    let mut kept = vec![a.values().clone()];
    a.push(a.version(), &[1.0; 4]);
    kept.push(a.values().clone());
    // The history lets go of version 0 (nothing else holds it) and offers it back.
    let old = kept.remove(0);
    let at = old.as_ptr();
    a.recycle(old);
    a.push(a.version(), &[2.0; 4]);
    assert_eq!(
        a.values().as_ptr(),
        at,
        "the recycled buffer was written into"
    );
    // A shared buffer or one of another size is not taken.
    a.recycle(kept[0].clone());
    a.recycle(Arc::new(vec![0.0; 3]));
    b.push(b.version(), &[1.0; 4]);
    b.push(b.version(), &[2.0; 4]);
    assert_eq!(a.values(), b.values());
    assert_eq!(a.values()[..], [-0.5; 4]);
}

#[test]
fn an_exported_shard_restores_to_the_same_future() {
    for name in ["sgd", "momentum", "adagrad", "rmsprop", "adam", "adamw"] {
        let cfg = OptimizerConfig {
            rule: crate::optim::Rule::from_name(name).unwrap(),
            lr: 0.01,
            weight_decay: 0.0,
            clip_norm: None,
            schedule: Default::default(),
        };
        let policy = StalenessPolicy::parse("scale").unwrap();
        let grads: Vec<Vec<f32>> = (0..6)
            .map(|k| (0..5).map(|i| ((i + k) as f32 * 0.7).sin()).collect())
            .collect();
        let mut a = ShardCore::new(vec![0.5; 5], cfg, policy, Consistency::Async);
        for g in &grads[..3] {
            a.push(a.version(), g);
        }
        let saved = a.export();
        assert_eq!(saved.version, 3);
        let mut b = ShardCore::restore(saved.clone(), cfg, policy, Consistency::Async).unwrap();
        assert_eq!(b.version(), 3);
        assert_eq!(b.opt_state(), a.opt_state());
        for g in &grads[3..] {
            let (va, vb) = (a.version(), b.version());
            assert_eq!(
                a.push(va.saturating_sub(1), g),
                b.push(vb.saturating_sub(1), g)
            );
        }
        assert_eq!(a.values(), b.values(), "{name}");
        // A state for another rule is refused.
        let other = OptimizerConfig {
            // (adam and adamw keep the same slots: the checkpoint compares rule names.)
            rule: crate::optim::Rule::from_name(if name.starts_with("adam") {
                "sgd"
            } else {
                "adam"
            })
            .unwrap(),
            ..cfg
        };
        assert!(ShardCore::restore(saved.clone(), other, policy, Consistency::Async).is_err());
        let mut bad = saved;
        Arc::make_mut(&mut bad.values)[0] = f32::INFINITY;
        assert!(ShardCore::restore(bad, cfg, policy, Consistency::Async).is_err());
    }
}

/// Issue 21: a rollback publishes the earlier values as the next version and keeps the
/// optimizer state (a fresh Adagrad accumulator would make the next step `lr` in every
/// coordinate); a restart starts the state afresh.
#[test]
fn a_rollback_moves_the_version_on_and_keeps_the_optimizer_state() {
    let cfg = OptimizerConfig {
        rule: crate::optim::Rule::from_name("adagrad").unwrap(),
        ..sgd(0.1)
    };
    let mut s = ShardCore::new(
        vec![1.0, 2.0],
        cfg,
        StalenessPolicy::default(),
        Consistency::Async,
    );
    s.push(0, &[0.5, -0.5]);
    s.push(1, &[0.5, -0.5]);
    let state = s.opt_state().clone();
    s.roll_back(vec![1.0, 2.0]).unwrap();
    assert_eq!((s.version(), &s.values()[..]), (3, &[1.0f32, 2.0][..]));
    assert_eq!(s.opt_state(), &state);
    assert!(s.roll_back(vec![1.0]).is_err());
    assert!(s.roll_back(vec![f32::NAN, 0.0]).is_err());
    assert_eq!((s.version(), s.opt_state()), (3, &state), "nothing changed");
    s.restart(vec![0.0, 0.0]).unwrap();
    assert_ne!(s.opt_state(), &state);
}

/// Issue 20 (`--ema`): the average weights each update by `(1 − d)·d^age` over the
/// updates since it started, bias-corrected (the first update's values whole, no weight
/// left on the start); a reader's copy never changes; a restore, rollback and restart start
/// it again; without `--ema` there is none.
#[test]
fn a_moving_average_weights_each_update_by_its_age() {
    let d = 0.5f32;
    let mut s = ShardCore::new(
        vec![0.0, 10.0],
        sgd(1.0),
        StalenessPolicy::default(),
        Consistency::Async,
    )
    .with_average(Some(d));
    assert_eq!(
        &s.average().unwrap()[..],
        &[0.0, 10.0],
        "the start, before any update"
    );
    // SGD at lr 1: values_1 = [1, 9], values_2 = [3, 7], values_3 = [7, 3].
    s.push(0, &[-1.0, 1.0]);
    assert_eq!(
        &s.average().unwrap()[..],
        &[1.0, 9.0],
        "the first update, whole"
    );
    let held = s.average().unwrap().clone();
    s.push(1, &[-2.0, 2.0]);
    s.push(2, &[-4.0, 4.0]);
    // (d²·v1 + d·v2 + v3)·(1 − d)/(1 − d³) = (0.25·v1 + 0.5·v2 + v3) / 1.75.
    let want = |v1: f32, v2: f32, v3: f32| (0.25 * v1 + 0.5 * v2 + v3) / 1.75;
    let avg = s.average().unwrap();
    assert!((avg[0] - want(1.0, 3.0, 7.0)).abs() < 1e-6, "{avg:?}");
    assert!((avg[1] - want(9.0, 7.0, 3.0)).abs() < 1e-6, "{avg:?}");
    assert_eq!(&held[..], &[1.0, 9.0], "a reader's copy stays as it was");
    assert_eq!(
        &s.values()[..],
        &[7.0, 3.0],
        "the live values are the workers'"
    );

    s.roll_back(vec![2.0, 2.0]).unwrap();
    assert_eq!(
        &s.average().unwrap()[..],
        &[2.0, 2.0],
        "a rollback starts it again"
    );
    s.push(s.version(), &[1.0, 1.0]);
    assert_eq!(&s.average().unwrap()[..], &[1.0, 1.0]);
    s.restart(vec![5.0, 5.0]).unwrap();
    assert_eq!(&s.average().unwrap()[..], &[5.0, 5.0], "so does a restart");
    s.push(s.version(), &[1.0, -1.0]);
    s.push(s.version(), &[1.0, -1.0]);
    let restore = |s: &ShardCore, decay| {
        ShardCore::restore(
            s.export(),
            sgd(1.0),
            StalenessPolicy::default(),
            Consistency::Async,
        )
        .unwrap()
        .with_average(decay)
    };
    // A checkpoint keeps the average: restored with the same decay it continues, update
    // for update, as the shard that was saved.
    let mut r = restore(&s, Some(d));
    assert_eq!(r.average(), s.average(), "a restore continues it");
    s.push(s.version(), &[2.0, 0.0]);
    r.push(r.version(), &[2.0, 0.0]);
    assert_eq!(r.average(), s.average(), "and so does the next update");
    assert_eq!(
        &restore(&s, Some(0.25)).average().unwrap()[..],
        &s.values()[..],
        "another decay starts again from the values"
    );
    assert!(restore(&s, None).average().is_none());
    let mut bad = s.export();
    bad.average.as_mut().unwrap().values = Arc::new(vec![1.0]);
    let e = ShardCore::restore(
        bad,
        sgd(1.0),
        StalenessPolicy::default(),
        Consistency::Async,
    )
    .unwrap_err();
    assert!(e.to_string().contains("moving average"), "{e}");

    let plain = ShardCore::new(
        vec![0.0],
        sgd(1.0),
        StalenessPolicy::default(),
        Consistency::Async,
    );
    assert!(plain.with_average(None).average().is_none());
}

/// Issue 20: a shard counts the samples of the updates it applied (a counted schedule's
/// position under `auto` local steps): an async push its own, a sync round its pushes
/// together, a worker's dropped pushes none; refusals, rollbacks and restarts add none,
/// and the count survives an export and a restore.
#[test]
fn a_shard_counts_the_samples_it_applied() {
    let mut a = ShardCore::new(
        vec![0.0; 2],
        sgd(0.1),
        StalenessPolicy {
            max_staleness: Some(1),
            ..Default::default()
        },
        Consistency::Async,
    );
    a.push_judged(1, 0, &[1.0, 1.0], 1.0, None, 96);
    a.push_judged(2, 1, &[1.0, 1.0], 1.0, None, 32);
    assert_eq!((a.version(), a.samples()), (2, 128));
    // Refused (too stale, from the future): not counted.
    assert!(matches!(
        a.push_judged(1, 0, &[1.0, 1.0], 1.0, None, 1000),
        Outcome::Rejected { .. }
    ));
    assert!(matches!(
        a.push_judged(1, 9, &[1.0, 1.0], 1.0, None, 1000),
        Outcome::Rejected { .. }
    ));
    assert_eq!(a.samples(), 128);
    a.roll_back(vec![0.0, 0.0]).unwrap();
    assert_eq!(
        (a.version(), a.samples()),
        (3, 128),
        "a rollback keeps the count"
    );
    a.restart(vec![0.0, 0.0]).unwrap();
    assert_eq!(a.samples(), 128, "a restart too");
    let saved = a.export();
    assert_eq!(saved.samples, 128);
    let b = ShardCore::restore(
        saved,
        sgd(0.1),
        StalenessPolicy::default(),
        Consistency::Async,
    )
    .unwrap();
    assert_eq!((b.version(), b.samples()), (4, 128));

    let mut s = ShardCore::new(
        vec![0.0; 2],
        sgd(0.1),
        StalenessPolicy::default(),
        Consistency::Sync { k: 3 },
    );
    s.set_droppable(true);
    s.push_judged(1, 0, &[1.0, 0.0], 1.0, None, 10);
    s.push_judged(2, 0, &[0.0, 1.0], 1.0, None, 20);
    assert_eq!(s.samples(), 0, "a round counts when it is applied");
    assert_eq!(s.drop_pending(1), 1);
    s.push_judged(3, 0, &[0.0, 1.0], 1.0, None, 40);
    assert_eq!(s.samples(), 0);
    s.push_judged(4, 0, &[0.0, 1.0], 1.0, None, 80);
    assert_eq!(
        (s.version(), s.samples()),
        (1, 140),
        "worker 1's 10 were dropped"
    );
    s.push_judged(1, 1, &[1.0, 0.0], 1.0, None, 5);
    assert!(s.flush().is_some());
    assert_eq!(
        (s.version(), s.samples()),
        (2, 145),
        "a flushed round counts its pushes"
    );
}

/// Issue 20: each update runs at the schedule's factor at the shard's version, times the
/// staleness policy's multiplier; a sync round at the factor of the version it makes.
#[test]
fn a_scheduled_shard_runs_each_version_at_its_factor() {
    use crate::schedule::{Decay, Schedule};
    let schedule = Schedule {
        warmup: 8,
        decay: Decay::Cosine,
        decay_samples: 24,
        min_ratio: 0.25,
        samples_per_version: 4,
        counted: false,
    };
    let cfg = OptimizerConfig {
        schedule,
        ..sgd(1.0)
    };
    // By hand, s = (v + 1) * 4: 4/8, then the cosine from 8 to 24, then the floor.
    let cos = |s: f64| 0.25 + 0.75 * 0.5 * (1.0 + (std::f64::consts::PI * (s - 8.0) / 16.0).cos());
    let want = [0.5, 1.0, cos(12.0), cos(16.0), cos(20.0), 0.25, 0.25, 0.25];
    let mut s = ShardCore::new(
        vec![0.0],
        cfg,
        StalenessPolicy::default(),
        Consistency::Async,
    );
    for (v, w) in want.iter().enumerate() {
        assert!(
            (f64::from(s.current_lr()) - w).abs() < 1e-6,
            "current lr at {v}"
        );
        let before = s.values()[0];
        match s.push(s.version(), &[1.0]) {
            Outcome::Applied {
                version, lr_scale, ..
            } => {
                assert_eq!(version, v as u64 + 1);
                assert!(
                    (f64::from(lr_scale) - w).abs() < 1e-6,
                    "version {v}: {lr_scale}"
                );
            }
            other => panic!("{other:?}"),
        }
        // SGD at lr 1 with g = 1 moves by exactly the factor.
        assert!(
            (f64::from(before - s.values()[0]) - w).abs() < 1e-6,
            "version {v}"
        );
    }
    // Staleness scaling multiplies the factor: a push 2 stale under scale:abs at version 8.
    let p = StalenessPolicy::parse("scale:abs").unwrap();
    let mut s = ShardCore::new(vec![0.0], cfg, p, Consistency::Async);
    fresh_zero_pushes(&mut s, 1);
    let out = s.push(0, &[1.0]);
    assert!(
        matches!(out, Outcome::Applied { staleness: 1, lr_scale, .. } if lr_scale == 1.0),
        "{out:?}"
    );
    let out = s.push(0, &[1.0]);
    let w = (cos(12.0) / 2.0) as f32;
    assert!(
        matches!(out, Outcome::Applied { staleness: 2, lr_scale, .. } if (lr_scale - w).abs() < 1e-6),
        "{out:?}"
    );
    // sync:2: one mean per version, at that version's factor.
    let mut s = ShardCore::new(
        vec![0.0],
        cfg,
        StalenessPolicy::default(),
        Consistency::Sync { k: 2 },
    );
    for w in &want[..3] {
        let v = s.version();
        s.push(v, &[1.0]);
        match s.push(v, &[3.0]) {
            Outcome::Applied {
                merged: 2,
                lr_scale,
                ..
            } => {
                assert!((f64::from(lr_scale) - w).abs() < 1e-6, "{lr_scale} != {w}")
            }
            other => panic!("{other:?}"),
        }
    }
    // The mean 2 at 0.5, 1.0 and cos(12).
    let moved = -f64::from(s.values()[0]);
    assert!(
        (moved - 2.0 * (0.5 + 1.0 + cos(12.0))).abs() < 1e-5,
        "{moved}"
    );
}

#[test]
fn a_paused_shard_refuses_pushes_with_busy_and_changes_nothing() {
    let mut s = ShardCore::new(
        vec![1.0],
        sgd(0.1),
        StalenessPolicy::default(),
        Consistency::Async,
    );
    s.set_paused(true);
    assert!(matches!(
        s.push(0, &[1.0]),
        Outcome::Rejected {
            code: ErrorCode::Busy,
            ..
        }
    ));
    assert_eq!((s.version(), s.values()[0]), (0, 1.0));
    s.set_paused(false);
    assert!(matches!(
        s.push(0, &[1.0]),
        Outcome::Applied { version: 1, .. }
    ));
}

#[test]
fn set_lr_checks_and_applies() {
    let mut s = ShardCore::new(
        vec![1.0],
        sgd(0.1),
        StalenessPolicy::default(),
        Consistency::Async,
    );
    assert!(s.set_lr(f32::NAN).is_err());
    assert_eq!(s.optimizer().lr, 0.1);
    s.set_lr(1.0).unwrap();
    s.push(0, &[1.0]);
    assert_eq!(**s.values(), vec![0.0]);
}

#[test]
fn async_applies_on_receipt_and_counts_staleness() {
    let mut s = ShardCore::new(
        vec![1.0; 2],
        sgd(0.5),
        StalenessPolicy::default(),
        Consistency::Async,
    );
    let held = s.values().clone();
    assert!(matches!(
        s.push(0, &[1.0, 1.0]),
        Outcome::Applied {
            version: 1,
            staleness: 0,
            ..
        }
    ));
    assert!(matches!(
        s.push(0, &[1.0, 1.0]),
        Outcome::Applied {
            version: 2,
            staleness: 1,
            ..
        }
    ));
    assert_eq!(**s.values(), vec![0.0, 0.0]);
    assert_eq!(*held, vec![1.0, 1.0], "published values never change");
    assert!(matches!(
        s.push(3, &[1.0, 1.0]),
        Outcome::Rejected {
            code: ErrorCode::FutureVersion,
            ..
        }
    ));
    assert_eq!(s.version(), 2);
}

#[test]
fn drop_policy_rejects_beyond_the_bound() {
    let p = StalenessPolicy::parse("drop:1").unwrap();
    let mut s = ShardCore::new(vec![0.0], sgd(1.0), p, Consistency::Async);
    s.push(0, &[1.0]);
    s.push(0, &[1.0]);
    assert!(matches!(
        s.push(0, &[1.0]),
        Outcome::Rejected {
            code: ErrorCode::TooStale,
            ..
        }
    ));
    assert_eq!(**s.values(), vec![-2.0]);
}

/// Pushes `n` gradients of 0 computed from the current version: `n` fresh updates.
fn fresh_zero_pushes(s: &mut ShardCore, n: usize) {
    for _ in 0..n {
        s.push(s.version(), &[0.0]);
    }
}

#[test]
fn absolute_scaling_at_staleness_five_moves_one_fifth_as_far() {
    let p = StalenessPolicy::parse("scale:abs").unwrap();
    let mut s = ShardCore::new(vec![0.0], sgd(1.0), p, Consistency::Async);
    fresh_zero_pushes(&mut s, 5);
    let before = s.values()[0];
    let out = s.push(0, &[1.0]);
    assert!(
        matches!(out, Outcome::Applied { staleness: 5, lr_scale, .. } if (lr_scale - 0.2).abs() < 1e-7)
    );
    assert!(((before - s.values()[0]) - 0.2).abs() < 1e-7);
    // A fresh push moves the full distance.
    let before = s.values()[0];
    s.push(s.version(), &[1.0]);
    assert!(((before - s.values()[0]) - 1.0).abs() < 1e-7);
}

#[test]
fn relative_scaling_by_hand() {
    let p = StalenessPolicy::parse("scale").unwrap();
    let mut s = ShardCore::new(vec![0.0], sgd(1.0), p, Consistency::Async);
    // Five fresh pushes: 1 / max(1, 0) = 1 each, so the mean of 1/τ is 1.
    fresh_zero_pushes(&mut s, 5);
    // Staleness 5: the mean of 1/τ becomes (5 + 1/5) / 6, so the push gets
    // (1/5) / (5.2 / 6) = 3/13 of the learning rate.
    let before = s.values()[0];
    let out = s.push(0, &[1.0]);
    let want = 3.0 / 13.0;
    assert!(
        matches!(out, Outcome::Applied { staleness: 5, lr_scale, .. } if (lr_scale - want).abs() < 1e-6),
        "{out:?}"
    );
    assert!(((before - s.values()[0]) - want).abs() < 1e-6);
    // A fresh push is fresher than usual: the full learning rate, never more.
    let before = s.values()[0];
    let out = s.push(s.version(), &[1.0]);
    assert!(matches!(out, Outcome::Applied { lr_scale, .. } if lr_scale == 1.0));
    assert!(((before - s.values()[0]) - 1.0).abs() < 1e-6);
}

#[test]
fn relative_scaling_leaves_the_usual_staleness_alone() {
    // Four workers in lockstep: every push 4 stale. That is the usual staleness, so it gets
    // the full step once the mean has settled, where `scale:abs` divides the learning rate
    // by 4 on every push.
    for (policy, want, tolerance) in [("scale", 1.0, 1e-3), ("scale:abs", 0.25, 1e-7)] {
        let p = StalenessPolicy::parse(policy).unwrap();
        let mut s = ShardCore::new(vec![0.0], sgd(1.0), p, Consistency::Async);
        fresh_zero_pushes(&mut s, 4);
        let mut last = f32::NAN;
        for _ in 0..5 * STALENESS_WINDOW {
            match s.push(s.version() - 4, &[0.0]) {
                Outcome::Applied { lr_scale, .. } => last = lr_scale,
                other => panic!("{other:?}"),
            }
        }
        assert!((last - want).abs() < tolerance, "{policy}: {last}");
    }
}

#[test]
fn relative_scaling_follows_a_change_in_the_usual_staleness() {
    // Long fresh, then the run gets busy (staleness 10 on every push): after a few windows
    // staleness 10 is the new usual and gets (almost) the full step again.
    let p = StalenessPolicy::parse("scale").unwrap();
    let mut s = ShardCore::new(vec![0.0], sgd(1.0), p, Consistency::Async);
    fresh_zero_pushes(&mut s, 2 * STALENESS_WINDOW as usize);
    let scale_at_10 = |s: &mut ShardCore| match s.push(s.version() - 10, &[0.0]) {
        Outcome::Applied { lr_scale, .. } => lr_scale,
        other => panic!("{other:?}"),
    };
    let first = scale_at_10(&mut s);
    assert!((0.1..0.2).contains(&first), "{first}");
    for _ in 0..8 * STALENESS_WINDOW {
        scale_at_10(&mut s);
    }
    let later = scale_at_10(&mut s);
    assert!(later > 0.99, "{later}");
}

#[test]
fn delay_compensation_by_hand() {
    let p = StalenessPolicy::parse("dc:0.5").unwrap();
    let mut s = ShardCore::new(vec![1.0], sgd(1.0), p, Consistency::Async);
    s.push(0, &[0.5]); // w: 1.0 -> 0.5 (fresh, no compensation)
    assert_eq!(s.values()[0], 0.5);
    // Computed at version 0 (w = 1.0); now w = 0.5: g' = 2 + 0.5 * 4 * (0.5 - 1.0) = 1.
    s.push(0, &[2.0]);
    assert!(
        (s.values()[0] - (0.5 - 1.0)).abs() < 1e-6,
        "{}",
        s.values()[0]
    );
}

#[test]
fn sync_applies_one_mean_per_k_fresh_gradients_and_drops_late_ones() {
    let mut s = ShardCore::new(
        vec![0.0],
        sgd(1.0),
        StalenessPolicy::default(),
        Consistency::Sync { k: 3 },
    );
    assert!(matches!(
        s.push(0, &[1.0]),
        Outcome::Buffered {
            version: 0,
            pending: 1
        }
    ));
    assert!(matches!(
        s.push(0, &[2.0]),
        Outcome::Buffered { pending: 2, .. }
    ));
    assert_eq!(s.values()[0], 0.0, "nothing applied before K");
    assert!(matches!(
        s.push(0, &[6.0]),
        Outcome::Applied {
            version: 1,
            merged: 3,
            ..
        }
    ));
    assert_eq!(s.values()[0], -3.0, "the mean (1 + 2 + 6) / 3 applied once");
    assert!(matches!(
        s.push(0, &[1.0]),
        Outcome::Rejected {
            code: ErrorCode::TooStale,
            ..
        }
    ));
    assert!(matches!(
        s.push(1, &[4.0]),
        Outcome::Buffered { pending: 1, .. }
    ));
    assert!(matches!(
        s.flush(),
        Some(Outcome::Applied {
            version: 2,
            merged: 1,
            ..
        })
    ));
    assert_eq!(s.values()[0], -7.0);
    assert_eq!(s.flush(), None);
}
