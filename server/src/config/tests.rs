//! Tests of [`super`] (config/mod.rs).

use super::*;
use clap::Parser;

#[derive(Parser)]
struct P {
    #[command(flatten)]
    a: ServeArgs,
}

fn parse(flags: &[&str]) -> std::result::Result<ServeArgs, clap::Error> {
    P::try_parse_from(std::iter::once("serve").chain(flags.iter().copied())).map(|p| p.a)
}

#[test]
fn a_schedule_with_auto_local_steps_is_counted_by_samples() {
    let warm = ["--lr-warmup", "1000"];
    // serve's default `auto`: the inner optimizer follows the schedule, positioned by the
    // samples the shards count; the shards refuse workers that cannot read them.
    let c = ServeConfig::with_flags("data/mnist", &warm).unwrap();
    let t = &c.training;
    assert!(t.exchange.local.steps.pseudo_gradients());
    assert!(
        t.optimizer.schedule.is_constant(),
        "the outer rate is constant"
    );
    let inner = t.exchange.local.inner.schedule;
    assert_eq!(inner.warmup, 1000);
    assert!(inner.counted);
    assert!(t.shard_setup(true, 10).counted);
    let e = ServeConfig::with_flags("data/mnist", &[&warm[..], &["--local-steps", "1"]].concat())
        .unwrap();
    assert!(!e.training.optimizer.schedule.counted);
    assert!(!e.training.shard_setup(true, 10).counted);
    assert!(
        !ServeConfig::defaults("data/mnist")
            .training
            .shard_setup(true, 10)
            .counted
    );
    let c = ServeConfig::with_flags("data/mnist", &[&warm[..], &["--local-steps", "8"]].concat())
        .unwrap();
    assert_eq!(c.training.exchange.local.steps.to_string(), "8");
    let e = ServeConfig::with_flags("data/mnist", &["--local-steps", "many"]).unwrap_err();
    assert!(e.to_string().contains("--local-steps"), "{e}");
}

#[test]
fn training_flags_check_into_the_config() {
    let d = ServeConfig::defaults("data/mnist");
    assert_eq!(d.training.shards, SERVE_SHARDS);
    assert_eq!(d.training.consistency, Consistency::Async);
    // Local steps `auto` by default (issue 18): the shards' rule is the outer SGD at 1.0.
    assert!(d.training.exchange.local.steps.pseudo_gradients());
    assert_eq!(d.training.optimizer.lr, 1.0);
    assert_eq!(
        d.training.exchange.egress_budget,
        EgressBudget::bytes_per_second(50e6).unwrap()
    );
    let h1 = ServeConfig::with_flags("data/mnist", &["--local-steps", "1"]).unwrap();
    assert!(!h1.training.exchange.local.steps.pseudo_gradients());
    assert_eq!(h1.training.optimizer.lr, 0.05);
    assert_eq!(d.training.heartbeat_timeout, 5.0);
    let c = parse(&[
        "--consistency",
        "sync:3",
        "--shards",
        "4",
        "--sync-timeout",
        "0.5",
    ])
    .unwrap()
    .check()
    .unwrap();
    assert_eq!(c.training.consistency, Consistency::Sync { k: 3 });
    assert_eq!(c.training.shards, 4);
    assert_eq!(c.training.sync_timeout, 0.5);
    // `--mode` is the simulator's old name, not a serve flag.
    assert!(parse(&["--mode", "async"]).is_err());
    for bad in [
        &["--shards", "0"][..],
        &["--batch-size", "0"],
        &["--heartbeat-timeout", "0"],
        &["--consistency", "bsp"],
        &["--staleness", "fast"],
        &["--aggregation", "median"],
        &["--aggregation", "consensus", "--consistency", "sync:4"],
        &["--aggregation", "krum:2", "--consistency", "sync:6"],
        &["--optimizer", "sgd", "--momentum", "0.9"],
    ] {
        assert!(parse(bad).unwrap().check().is_err(), "{bad:?}");
    }
    // A coordinator of shard processes does not checkpoint: refused, saying where to.
    let remote = [
        "--shard-urls",
        "ws://a:1,ws://b:2",
        "--run-secret",
        "0123456789abcdef0",
    ];
    assert!(parse(&remote).unwrap().check().is_ok());
    let e = parse(&[&remote[..], &["--checkpoint-dir", "ck"]].concat())
        .unwrap()
        .check()
        .unwrap_err()
        .to_string();
    assert!(e.contains("crowdgrad shard --checkpoint-dir"), "{e}");
}

fn training(flags: &[&str]) -> Result<Training> {
    parse(flags).unwrap().check().map(|c| c.training)
}

/// Issue 20 (`--ema`): a decay strictly between 0 and 1 reaches every shard's setup;
/// anything else is refused naming the flag; none keeps no average.
#[test]
fn the_weights_moving_average_is_checked_and_reaches_the_shards() {
    let t = training(&["--ema", "0.999"]).unwrap();
    assert_eq!(t.ema, Some(0.999));
    assert_eq!(t.shard_setup(true, 10).average, Some(0.999));
    assert_eq!(training(&[]).unwrap().shard_setup(true, 10).average, None);
    for bad in ["1", "0", "-0.5", "1.5", "NaN", "inf"] {
        let e = training(&[&format!("--ema={bad}")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--ema") && e.contains("between 0 and 1"),
            "{bad}: {e}"
        );
    }
}

/// Issue 20: the PyTorch comparison peer's optimizer (AdamW, betas 0.9/0.95, eps 1e-8,
/// weight decay 0.1, linear warmup then cosine to 10%, clip 1.0) as flags.
#[test]
fn the_torch_peer_is_expressible_exactly() {
    let t = training(&[
        "--optimizer",
        "adamw",
        "--lr",
        "0.0006",
        "--lr-warmup",
        "3200",
        "--lr-decay",
        "cosine",
        "--lr-decay-samples",
        "320000",
        "--clip-norm",
        "1.0",
        "--local-steps",
        "1",
    ])
    .unwrap();
    let o = t.optimizer;
    assert_eq!(
        o.rule,
        Rule::AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8
        }
    );
    assert_eq!(
        (o.lr, o.weight_decay, o.clip_norm),
        (0.0006, 0.1, Some(1.0))
    );
    assert_eq!(
        o.schedule,
        Schedule {
            warmup: 3200,
            decay: Decay::Cosine,
            decay_samples: 320_000,
            min_ratio: 0.1,
            samples_per_version: 32,
            counted: false,
        }
    );
    // The inner optimizer is untouched without local steps.
    assert!(t.exchange.local.inner.schedule.is_constant());
    // --weight-decay overrides AdamW's default; other rules default to none.
    let t = training(&["--optimizer", "adamw", "--weight-decay", "0.01"]).unwrap();
    assert_eq!(t.optimizer.weight_decay, 0.01);
    assert_eq!(
        training(&["--optimizer", "adam"])
            .unwrap()
            .optimizer
            .weight_decay,
        0.0
    );
    assert!(training(&[]).unwrap().optimizer.schedule.is_constant());
}

#[test]
fn versions_count_samples_per_mode_and_local_steps_schedule_the_inner_optimizer() {
    let sched = [
        "--lr-warmup",
        "1000",
        "--lr-decay",
        "linear",
        "--lr-decay-samples",
        "9000",
    ];
    let t = training(
        &[
            &sched[..],
            &[
                "--consistency",
                "sync:4",
                "--batch-size",
                "16",
                "--local-steps",
                "1",
            ],
        ]
        .concat(),
    )
    .unwrap();
    assert_eq!(t.optimizer.schedule.samples_per_version, 64);
    // Local steps: the inner optimizer follows it, H x batch per version; the outer is
    // constant (a pseudo-gradient already carries the inner rate).
    let t = training(
        &[
            &sched[..],
            &["--local-steps", "8", "--inner-optimizer", "adamw"],
        ]
        .concat(),
    )
    .unwrap();
    assert!(t.optimizer.schedule.is_constant());
    let inner = t.exchange.local.inner;
    assert_eq!(inner.schedule.samples_per_version, 8 * 32);
    assert_eq!(inner.schedule.decay, Decay::Linear);
    assert_eq!(inner.weight_decay, 0.1, "adamw's default decay");
    let t = training(&["--local-steps", "4", "--inner-weight-decay", "0.05"]).unwrap();
    assert_eq!(t.exchange.local.inner.weight_decay, 0.05);
    // Warmup alone is a schedule too.
    let t = training(&["--lr-warmup", "640", "--local-steps", "1"]).unwrap();
    assert_eq!(t.optimizer.schedule.warmup, 640);
    assert_eq!(t.optimizer.schedule.decay, Decay::None);
}

#[test]
fn bad_schedules_are_refused_naming_the_flag() {
    for (flags, says) in [
        (&["--lr-decay", "cosine"][..], "needs --lr-decay-samples"),
        (
            &["--lr-decay-samples", "100"],
            "--lr-decay-samples needs --lr-decay",
        ),
        (
            &["--lr-min-ratio", "0.2"],
            "--lr-min-ratio needs --lr-decay",
        ),
        (
            &[
                "--lr-decay",
                "linear",
                "--lr-decay-samples",
                "100",
                "--lr-min-ratio",
                "1.5",
            ],
            "between 0 and 1",
        ),
        (
            &[
                "--lr-decay",
                "linear",
                "--lr-decay-samples",
                "100",
                "--lr-min-ratio",
                "NaN",
            ],
            "between 0 and 1",
        ),
        (
            &[
                "--lr-warmup",
                "500",
                "--lr-decay",
                "cosine",
                "--lr-decay-samples",
                "500",
            ],
            "must end after the warmup",
        ),
        (&["--lr-warmup", "1125899906842625"], "over the limit"),
        (
            &["--optimizer", "adamw", "--weight-decay=-1"],
            "weight decay",
        ),
        (
            &["--local-steps", "2", "--inner-weight-decay", "NaN"],
            "--inner-weight-decay",
        ),
    ] {
        let e = training(flags).unwrap_err().to_string();
        assert!(e.contains(says), "{flags:?}: {e}");
    }
    // Values clap refuses are its errors (a usage message), never a panic.
    for flags in [
        &["--lr-decay", "exp"][..],
        &["--lr-warmup", "-1"],
        &["--lr-decay-samples", "x"],
        &["--lr-warmup", "99999999999999999999999"],
    ] {
        assert!(parse(flags).is_err(), "{flags:?}");
    }
}
