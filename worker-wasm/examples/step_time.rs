//! Native timing of the core worker's `step()` (batch, forward, backward, clip, encode the
//! pushes), the same call the browser worker times with `performance.now()` and reports as
//! `step_ms`. The worker runs against the in-memory [`Loopback`] shards, so no network time is
//! included; `--layers` adds the forward/backward time per stage. The measuring code is
//! `crowdgrad_worker_wasm::bench`, which the browser benchmark runs as wasm.
//!
//! ```text
//! cargo run --release -p crowdgrad-worker-wasm --example step_time -- \
//!     [--model mlp:128] [--batch 32] [--shards 2] [--steps 300] [--gemm matrixmultiply] \
//!     [--sparse off|auto|on] [--layers] [--density 0.19]
//! ```
//! `--sparse` chooses whether the first dense layer skips the batch's zero inputs (`auto`, the
//! default: when the batch is at most half nonzero); `--density` is the nonzero fraction of
//! the `--layers` batch (default 0.19, MNIST's; the `step()` batches are the synthetic
//! loopback dataset's, ~0.25).
//! Prints a human line and a JSON line (`{"native_step_ms_mean":..}`) for scripts.
//!
//! [`Loopback`]: crowdgrad_worker_wasm::loopback::Loopback

use crowdgrad_core::model::{Gemm, SparseInput};
use crowdgrad_worker_wasm::bench::{layer_bench, step_bench};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut model = "mlp:128".to_owned();
    let (mut batch, mut shards, mut steps) = (32usize, 2usize, 300u64);
    let mut gemm = Gemm::target_default();
    let mut layers = false;
    let mut sparse = SparseInput::Auto;
    let mut density = 0.19;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--layers" {
            layers = true;
            continue;
        }
        let mut value = || args.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => model = value()?,
            "--batch" => batch = value()?.parse()?,
            "--shards" => shards = value()?.parse()?,
            "--steps" => steps = value()?.parse()?,
            "--gemm" => {
                let name = value()?;
                gemm = Gemm::from_name(&name).ok_or(format!("unknown --gemm {name}"))?;
            }
            "--sparse" => {
                let name = value()?;
                sparse = SparseInput::from_name(&name)
                    .ok_or(format!("unknown --sparse {name} (off, auto or on)"))?;
            }
            "--density" => density = value()?.parse()?,
            other => return Err(format!("unknown flag {other}").into()),
        }
    }
    let origin = Instant::now();
    let mut now = || origin.elapsed().as_secs_f64();
    let s = step_bench(&model, batch, shards, steps, gemm, sparse, &mut now)?;
    println!(
        "native step(): {model} batch {batch}, {shards} shards, {gemm}, sparse input {sparse}: mean {:.3} ms, median {:.3} ms over {} steps ({:.0} samples/s of compute, {:.0} with the loopback shards)",
        s.step_ms_mean,
        s.step_ms_median,
        s.steps,
        batch as f64 * 1e3 / s.step_ms_mean,
        s.loopback_samples_per_sec
    );
    let mut json = serde_json::json!({
        "native_step_ms_mean": s.step_ms_mean,
        "native_step_ms_median": s.step_ms_median,
        "loopback_samples_per_sec": s.loopback_samples_per_sec,
        "model": model,
        "batch": batch,
        "steps": s.steps,
        "gemm": gemm.name(),
        "sparse": sparse.name(),
        "density": s.density,
        "sparse_max_density": crowdgrad_core::model::SPARSE_MAX_DENSITY,
    });
    if layers {
        let l = layer_bench(&model, batch, steps, gemm, sparse, density, &mut now)?;
        println!(
            "  loss_and_grad on a batch of density {:.3}, first layer sparse {}: mean {:.3} ms, median {:.3} ms",
            l.density, l.sparse_path, l.step_ms, l.step_ms_median
        );
        for (i, name) in l.names.iter().enumerate() {
            println!(
                "  {name:<20} forward {:.3} ms  backward {:.3} ms",
                l.forward_ms[i], l.backward_ms[i]
            );
        }
        json["layers"] = serde_json::to_value(&l)?;
    }
    println!("{json}");
    Ok(())
}
