//! Native timing of the core worker's `step()` (batch, forward, backward, clip, encode the
//! pushes), the same call the browser worker times with `performance.now()` and reports as
//! `step_ms`. The worker runs against the in-memory [`Loopback`] shards, so no network time is
//! included.
//!
//! ```text
//! cargo run --release -p crowdgrad-worker-wasm --example step_time -- \
//!     [--model mlp:128] [--batch 32] [--shards 2] [--steps 300]
//! ```
//! Prints a human line and a JSON line (`{"native_step_ms_mean":..}`) for scripts.

use crowdgrad_core::optim::{OptimizerConfig, Rule};
use crowdgrad_core::wire::ClientKind;
use crowdgrad_core::worker::Worker;
use crowdgrad_worker_wasm::loopback::{synthetic_run, Loopback};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut model = "mlp:128".to_owned();
    let (mut batch, mut shards, mut steps) = (32usize, 2usize, 300u64);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => model = value()?,
            "--batch" => batch = value()?.parse()?,
            "--shards" => shards = value()?.parse()?,
            "--steps" => steps = value()?.parse()?,
            other => return Err(format!("unknown flag {other}").into()),
        }
    }
    let optimizer = OptimizerConfig {
        rule: Rule::from_name("adagrad")?,
        lr: 0.05,
        weight_decay: 0.0,
        clip_norm: None,
    };
    let (join, data) = synthetic_run(&model, shards, optimizer, batch, 2_000, 7)?;
    let mut ps = Loopback::new(&join, 42)?;
    let mut worker = Worker::new(join, data, ClientKind::Native, Some(steps + 20))?;
    for s in 0..shards {
        worker.connected(s);
    }
    let mut times = Vec::with_capacity(steps as usize);
    let mut done = 0u64;
    while done < steps + 20 {
        ps.exchange(&mut worker, |_, _, _| {})?;
        if worker.ready() {
            let t = Instant::now();
            worker.step()?;
            // The first 20 steps warm caches and the allocator; they are not timed.
            if done >= 20 {
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
            done += 1;
        }
    }
    times.sort_by(f64::total_cmp);
    let mean = times.iter().sum::<f64>() / times.len().max(1) as f64;
    let median = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
    println!(
        "native step(): {model} batch {batch}, {shards} shards: mean {mean:.3} ms, median {median:.3} ms over {} steps ({:.0} samples/s of compute)",
        times.len(),
        batch as f64 * 1e3 / mean
    );
    println!(
        "{{\"native_step_ms_mean\":{mean:.4},\"native_step_ms_median\":{median:.4},\"model\":\"{model}\",\"batch\":{batch},\"steps\":{}}}",
        times.len()
    );
    Ok(())
}
