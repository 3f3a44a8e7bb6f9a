//! Speed of one model's training step (forward + backward), natively: samples/s and the share
//! of the step each stage takes.
//!
//! Run: `cargo run --release -p crowdgrad-core --example model_bench [-- MODEL [BATCH [SECONDS [HxW[xC]]]]]`,
//! e.g. `-- cnn 32 5` (defaults: `cnn`, 32, 5 s, `28x28`). A language model takes a vocabulary
//! size in place of the shape (default 100) and also prints tokens/s, e.g. `-- gpt 32 10 100`
//! (batch 32 x T = 64).
//!
//! Inputs are uniform in [0, 1) (the speed of these kernels does not depend on the values); a
//! language model's are uniform token ids.
//! The per-stage shares come from [`Model::loss_and_grad_timed`] over the same steps; its
//! clock reads add about 1 µs per stage. A tool, not a test: the figures vary with the machine
//! and its load.

use crowdgrad_core::model::{Model, ModelSpec};
use crowdgrad_core::rng::Rng;
use ndarray::Array2;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let text = args.first().map_or("cnn", String::as_str);
    let batch: usize = args.get(1).and_then(|b| b.parse().ok()).unwrap_or(32);
    let seconds: f64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(5.0);
    let shape: Vec<usize> = args
        .get(3)
        .map_or("28x28", String::as_str)
        .split('x')
        .filter_map(|d| d.parse().ok())
        .collect();
    let vocab = args.get(3).and_then(|v| v.parse().ok()).unwrap_or(100);
    let spec = ModelSpec::parse_sequence(text, vocab);
    let spec = match spec.or_else(|_| ModelSpec::parse_shaped(text, &shape, 10)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let model = Model::new(spec).expect("a valid spec builds");
    let params = model.init_params(1);
    let mut rng = Rng::new(2);
    let seq = model.sequence();
    let x = Array2::from_shape_fn((batch, model.spec().inputs), |_| match seq {
        Some(s) => rng.below(s.vocab as u64) as f32,
        None => rng.next_f64() as f32,
    });
    let y: Vec<u8> = (0..batch).map(|i| (i % 10) as u8).collect();
    let mut ws = model.workspace(batch);
    let mut grad = vec![0.0; params.len()];
    let mut step = |seed: u64| {
        model
            .loss_and_grad_seeded(&params, x.view(), &y, seed, &mut grad, &mut ws)
            .expect("fits");
    };
    for s in 0..3 {
        step(s);
    }
    let start = Instant::now();
    let mut steps = 0u64;
    while start.elapsed().as_secs_f64() < seconds / 2.0 {
        step(steps);
        steps += 1;
    }
    let per_step = start.elapsed().as_secs_f64() / steps as f64;
    // The same steps again, timed per stage.
    let mut times = model.layer_times();
    let mut ws = model.workspace(batch);
    let origin = Instant::now();
    let mut now = || origin.elapsed().as_secs_f64();
    let timed = Instant::now();
    let mut n = 0u64;
    while timed.elapsed().as_secs_f64() < seconds / 2.0 {
        model
            .loss_and_grad_timed(
                &params,
                x.view(),
                &y,
                n,
                &mut grad,
                &mut ws,
                &mut now,
                &mut times,
            )
            .expect("fits");
        n += 1;
    }
    let total: f64 =
        times.forward.iter().sum::<f64>() + times.backward.iter().sum::<f64>() + times.loss;
    println!(
        "model {} ({} parameters), batch {batch}, one core",
        model.spec(),
        model.param_len()
    );
    println!(
        "step {:.3} ms, {:.0} samples/s ({steps} steps)",
        per_step * 1e3,
        batch as f64 / per_step
    );
    if let Some(s) = seq {
        println!(
            "{:.0} tokens/s (batch {batch} x context {})",
            (batch * s.context) as f64 / per_step,
            s.context
        );
    }
    println!("| stage | forward | backward | share |");
    println!("|---|---|---|---|");
    for (i, name) in times.names.iter().enumerate() {
        let (f, b) = (times.forward[i] / n as f64, times.backward[i] / n as f64);
        println!(
            "| {name} | {:.3} ms | {:.3} ms | {:.1}% |",
            f * 1e3,
            b * 1e3,
            100.0 * (times.forward[i] + times.backward[i]) / total
        );
    }
    println!(
        "| softmax cross-entropy | {:.3} ms | | {:.1}% |",
        times.loss / n as f64 * 1e3,
        100.0 * times.loss / total
    );
}
