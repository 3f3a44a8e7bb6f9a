//! Step benchmarks with any GEMM kernel ([`Gemm`]) and sparse-input choice ([`SparseInput`]:
//! whether the first dense layer skips the batch's zeros), the same code natively
//! (`examples/step_time.rs`) and in a browser's Web Worker (the wasm exports below, driven by
//! `tests/browser/bench-step.mjs`):
//!
//! - [`step_bench`]: the core worker's `step()` (batch, forward, backward, clip, encode the
//!   pushes) against the in-memory [`Loopback`] shards, timed per step, and the samples/s of the
//!   whole loop (the loopback's shard work runs on the same thread, so this is a floor for a
//!   tab whose server is elsewhere).
//! - [`layer_bench`]: forward and backward time per stage from
//!   [`Model::loss_and_grad_timed`], on a batch of a chosen density (MNIST's `pixel / 255`
//!   batches are ~19% nonzero, the synthetic ones of `step_bench` ~25%).
//!
//! Clocks are passed in (`Instant` natively, `performance.now()` in a browser, which Chromium
//! coarsens to 100 µs with jitter outside cross-origin isolation: means over hundreds of steps
//! are still unbiased, single steps are not).

use crate::loopback::{synthetic_run, Loopback};
use crowdgrad_core::model::{
    set_default_kernel, set_default_sparse_input, Gemm, Model, ModelSpec, SparseInput,
};
use crowdgrad_core::optim::{OptimizerConfig, Rule};
use crowdgrad_core::rng::Rng;
use crowdgrad_core::wire::ClientKind;
use crowdgrad_core::worker::Worker;
use crowdgrad_core::{Error, Result};
use ndarray::Array2;
use serde::Serialize;

/// Steps run before timing starts (caches, allocator, packing buffers).
const WARMUP: u64 = 20;
/// Upper bound on timed steps, so a bad argument cannot hang a tab.
pub const MAX_STEPS: u64 = 100_000;

/// What [`step_bench`] measured.
#[derive(Debug, Clone, Serialize)]
pub struct StepBench {
    /// Kernel name ([`Gemm::name`]).
    pub kernel: String,
    /// Sparse-input choice ([`SparseInput::name`]).
    pub sparse: String,
    /// Nonzero fraction of the synthetic dataset's pixels (its batches' density).
    pub density: f64,
    /// Model text, e.g. `mlp:128`.
    pub model: String,
    /// Examples per step.
    pub batch: usize,
    /// Timed steps.
    pub steps: u64,
    /// Mean `step()` time.
    pub step_ms_mean: f64,
    /// Median `step()` time.
    pub step_ms_median: f64,
    /// Samples per second of the whole loop (exchange with the loopback shards + step).
    pub loopback_samples_per_sec: f64,
}

/// What [`layer_bench`] measured.
#[derive(Debug, Clone, Serialize)]
pub struct LayerBench {
    /// Kernel name.
    pub kernel: String,
    /// Sparse-input choice.
    pub sparse: String,
    /// Nonzero fraction of the batch.
    pub density: f64,
    /// True when the first layer skipped the zeros.
    pub sparse_path: bool,
    /// Model text.
    pub model: String,
    /// Examples per step.
    pub batch: usize,
    /// Timed steps.
    pub steps: u64,
    /// Stage names ([`Model::stage_names`]).
    pub names: Vec<String>,
    /// Mean forward milliseconds per stage.
    pub forward_ms: Vec<f64>,
    /// Mean backward milliseconds per stage.
    pub backward_ms: Vec<f64>,
    /// Mean softmax cross-entropy milliseconds.
    pub loss_ms: f64,
    /// Mean whole `loss_and_grad` milliseconds (sum of the above).
    pub step_ms: f64,
    /// Median `loss_and_grad` milliseconds, each call timed as a whole (robust to the
    /// preemption a shared machine adds to the means).
    pub step_ms_median: f64,
}

fn check_steps(steps: u64) -> Result<()> {
    if steps == 0 || steps > MAX_STEPS {
        return Err(Error::Config(format!(
            "steps must be in 1..={MAX_STEPS}, got {steps}"
        )));
    }
    Ok(())
}

/// Times `steps` worker steps of `model` (batch `batch`, `shards` shards) with `kernel` and
/// `sparse`.
///
/// # Errors
/// When the model, batch or shard count is invalid, or `steps` is outside `1..=MAX_STEPS`.
#[allow(clippy::too_many_arguments)]
pub fn step_bench(
    model: &str,
    batch: usize,
    shards: usize,
    steps: u64,
    kernel: Gemm,
    sparse: SparseInput,
    now: &mut dyn FnMut() -> f64,
) -> Result<StepBench> {
    check_steps(steps)?;
    let optimizer = OptimizerConfig {
        rule: Rule::from_name("adagrad")?,
        lr: 0.05,
        weight_decay: 0.0,
        clip_norm: None,
        schedule: Default::default(),
    };
    let (join, data) = synthetic_run(model, shards, optimizer, batch, 2_000, 7)?;
    let nonzero: usize = (0..data.len())
        .map(|i| data.pixels(i).iter().filter(|&&p| p != 0).count())
        .sum();
    let density = nonzero as f64 / (data.len() * join.run.model.inputs).max(1) as f64;
    let mut ps = Loopback::new(&join, 42)?;
    // The core worker builds its workspace inside: the default kernel picks it.
    set_default_kernel(kernel);
    set_default_sparse_input(sparse);
    let worker = Worker::new(join, data, ClientKind::Browser, Some(steps + WARMUP));
    set_default_kernel(Gemm::target_default());
    set_default_sparse_input(SparseInput::Auto);
    let mut worker = worker?;
    for s in 0..shards {
        worker.connected(s);
    }
    let mut times = Vec::with_capacity(steps as usize);
    let mut done = 0u64;
    let mut loop_start = 0.0;
    // Bounded: every round either steps or the loopback answers; a stuck exchange ends it.
    let mut idle = 0u32;
    while done < steps + WARMUP {
        ps.exchange(&mut worker, |_, _, _| {})?;
        if worker.ready() {
            idle = 0;
            if done == WARMUP {
                loop_start = now();
            }
            let t = now();
            worker.step()?;
            if done >= WARMUP {
                times.push(now() - t);
            }
            done += 1;
        } else {
            idle += 1;
            if idle > 1_000 {
                return Err(Error::Protocol(
                    "the loopback stopped answering the worker".into(),
                ));
            }
        }
    }
    let wall = now() - loop_start;
    times.sort_by(f64::total_cmp);
    let mean = times.iter().sum::<f64>() / times.len().max(1) as f64;
    let median = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
    Ok(StepBench {
        kernel: kernel.name().into(),
        sparse: sparse.name().into(),
        density,
        model: model.into(),
        batch,
        steps,
        step_ms_mean: mean * 1e3,
        step_ms_median: median * 1e3,
        loopback_samples_per_sec: (steps as usize * batch) as f64 / wall.max(1e-9),
    })
}

/// Times `steps` forward + backward passes of `model` (28x28 inputs, 10 classes) per stage,
/// with `kernel` and `sparse`, on a batch where a fraction `density` of the pixels is nonzero
/// (uniform in `(0, 1]`, like `pixel / 255`) and the rest exactly zero.
///
/// # Errors
/// When the model text is invalid, `batch` is 0, `density` is outside `[0, 1]`, or `steps` is
/// outside `1..=MAX_STEPS`.
#[allow(clippy::too_many_arguments)]
pub fn layer_bench(
    model: &str,
    batch: usize,
    steps: u64,
    kernel: Gemm,
    sparse: SparseInput,
    density: f64,
    now: &mut dyn FnMut() -> f64,
) -> Result<LayerBench> {
    check_steps(steps)?;
    if batch == 0 {
        return Err(Error::Config("batch must be at least 1".into()));
    }
    if !(0.0..=1.0).contains(&density) {
        return Err(Error::Config(format!(
            "density must be in [0, 1], got {density}"
        )));
    }
    let spec = ModelSpec::parse_shaped(model, &[28, 28], 10)?;
    let m = Model::new(spec)?;
    let params = m.init_params(1);
    let mut rng = Rng::new(2);
    let x = Array2::from_shape_fn((batch, m.spec().inputs), |_| {
        if rng.next_f64() < density {
            (1.0 - rng.next_f64()) as f32
        } else {
            0.0
        }
    });
    let y: Vec<u8> = (0..batch).map(|i| (i % 10) as u8).collect();
    let mut ws = m.workspace(batch);
    ws.set_gemm(kernel);
    ws.set_sparse_input(sparse);
    let mut grad = vec![0.0; params.len()];
    for s in 0..WARMUP.min(5) {
        m.loss_and_grad_seeded(&params, x.view(), &y, s, &mut grad, &mut ws)?;
    }
    let mut times = m.layer_times();
    let mut whole = Vec::with_capacity(steps as usize);
    for s in 0..steps {
        let t0 = now();
        m.loss_and_grad_timed(
            &params,
            x.view(),
            &y,
            s,
            &mut grad,
            &mut ws,
            now,
            &mut times,
        )?;
        whole.push(now() - t0);
    }
    whole.sort_by(f64::total_cmp);
    let per = |v: &[f64]| -> Vec<f64> { v.iter().map(|t| t * 1e3 / steps as f64).collect() };
    let forward_ms = per(&times.forward);
    let backward_ms = per(&times.backward);
    let loss_ms = times.loss * 1e3 / steps as f64;
    let step_ms = forward_ms.iter().sum::<f64>() + backward_ms.iter().sum::<f64>() + loss_ms;
    let nonzero = x.iter().filter(|&&v| v != 0.0).count();
    Ok(LayerBench {
        kernel: kernel.name().into(),
        sparse: sparse.name().into(),
        density: nonzero as f64 / x.len().max(1) as f64,
        sparse_path: ws.sparse_passes() > 0,
        model: model.into(),
        batch,
        steps,
        names: times.names,
        forward_ms,
        backward_ms,
        loss_ms,
        step_ms,
        step_ms_median: whole.get(whole.len() / 2).map_or(f64::NAN, |t| t * 1e3),
    })
}

#[cfg(target_arch = "wasm32")]
mod exports {
    //! The wasm-bindgen surface of the benchmarks, for a dedicated Web Worker.
    use super::{layer_bench, step_bench};
    use crowdgrad_core::model::{Gemm, SparseInput};
    use wasm_bindgen::prelude::*;
    use wasm_bindgen::JsCast;

    fn kernel(name: &str) -> Result<Gemm, JsError> {
        Gemm::from_name(name).ok_or_else(|| {
            let names: Vec<&str> = Gemm::ALL.iter().map(|g| g.name()).collect();
            JsError::new(&format!(
                "unknown kernel {name:?} (one of {})",
                names.join(", ")
            ))
        })
    }

    fn sparse(name: &str) -> Result<SparseInput, JsError> {
        SparseInput::from_name(name).ok_or_else(|| {
            JsError::new(&format!(
                "unknown sparse-input choice {name:?} (off, auto or on)"
            ))
        })
    }

    fn clock() -> Result<impl FnMut() -> f64, JsError> {
        let scope: web_sys::WorkerGlobalScope = js_sys::global()
            .dyn_into()
            .map_err(|_| JsError::new("the benchmarks run inside a Web Worker"))?;
        let perf = scope
            .performance()
            .ok_or_else(|| JsError::new("no performance clock"))?;
        Ok(move || perf.now() / 1e3)
    }

    fn json<T: serde::Serialize>(v: &T) -> Result<String, JsError> {
        serde_json::to_string(v).map_err(|e| JsError::new(&e.to_string()))
    }

    /// The kernels and lanes of this build, as JSON:
    /// `{"kernels":[..],"default":"..","sparse":[..],"sparse_default":"auto",
    /// "sparse_max_density":0.5,"simd128":true,"relaxed_simd":false}`.
    #[wasm_bindgen]
    pub fn bench_info() -> String {
        let (simd128, relaxed) = Gemm::simd_lanes();
        serde_json::json!({
            "kernels": Gemm::ALL.iter().map(|g| g.name()).collect::<Vec<_>>(),
            "default": Gemm::target_default().name(),
            "sparse": SparseInput::ALL.iter().map(|s| s.name()).collect::<Vec<_>>(),
            "sparse_default": crowdgrad_core::model::default_sparse_input().name(),
            "sparse_max_density": crowdgrad_core::model::SPARSE_MAX_DENSITY,
            "simd128": simd128,
            "relaxed_simd": relaxed,
        })
        .to_string()
    }

    /// [`step_bench`] as JSON ([`super::StepBench`]); `sparse_name` is `off`, `auto` or `on`.
    ///
    /// # Errors
    /// An unknown kernel or choice, a bad model or size, or not inside a Web Worker.
    #[wasm_bindgen]
    pub fn bench_step(
        model: &str,
        batch: usize,
        shards: usize,
        steps: u32,
        kernel_name: &str,
        sparse_name: &str,
    ) -> Result<String, JsError> {
        console_error_panic_hook::set_once();
        let k = kernel(kernel_name)?;
        let s = sparse(sparse_name)?;
        let mut now = clock()?;
        let r = step_bench(model, batch, shards, u64::from(steps), k, s, &mut now)
            .map_err(|e| JsError::new(&e.to_string()))?;
        json(&r)
    }

    /// [`layer_bench`] as JSON ([`super::LayerBench`]) on a batch of `density` nonzeros.
    ///
    /// # Errors
    /// An unknown kernel or choice, a bad model, size or density, or not inside a Web Worker.
    #[wasm_bindgen]
    pub fn bench_layers(
        model: &str,
        batch: usize,
        steps: u32,
        kernel_name: &str,
        sparse_name: &str,
        density: f64,
    ) -> Result<String, JsError> {
        console_error_panic_hook::set_once();
        let k = kernel(kernel_name)?;
        let s = sparse(sparse_name)?;
        let mut now = clock()?;
        let r = layer_bench(model, batch, u64::from(steps), k, s, density, &mut now)
            .map_err(|e| JsError::new(&e.to_string()))?;
        json(&r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn benches_run_and_refuse_bad_arguments() {
        let origin = Instant::now();
        let mut now = || origin.elapsed().as_secs_f64();
        let auto = SparseInput::Auto;
        for &k in Gemm::ALL {
            for &sp in SparseInput::ALL {
                let s = step_bench("mlp:16", 8, 2, 3, k, sp, &mut now).unwrap();
                assert_eq!((s.steps, s.kernel.as_str()), (3, k.name()));
                assert_eq!(s.sparse, sp.name());
                assert!(s.step_ms_mean > 0.0 && s.loopback_samples_per_sec > 0.0);
                // The synthetic MNIST: about a quarter of the pixels are nonzero.
                assert!((0.2..0.3).contains(&s.density), "{}", s.density);
            }
            let l = layer_bench("conv:2x3x3,pool:2,dense:4", 4, 2, k, auto, 0.2, &mut now).unwrap();
            assert_eq!(l.names.len(), 4, "{:?}", l.names);
            assert!(l.step_ms > 0.0 && !l.sparse_path);
            for (sp, density, went) in [
                (auto, 0.2, true),
                (auto, 0.9, false),
                (SparseInput::Off, 0.2, false),
            ] {
                let l = layer_bench("mlp:16", 32, 2, k, sp, density, &mut now).unwrap();
                assert_eq!(l.sparse_path, went, "{sp} at {density}");
                assert!((l.density - density).abs() < 0.05, "{}", l.density);
            }
        }
        assert!(step_bench("mlp:16", 8, 2, 0, Gemm::LoadSplat, auto, &mut now).is_err());
        assert!(step_bench("mlp:x", 8, 2, 3, Gemm::LoadSplat, auto, &mut now).is_err());
        assert!(layer_bench("mlp:16", 0, 3, Gemm::LoadSplat, auto, 0.2, &mut now).is_err());
        assert!(layer_bench(
            "mlp:16",
            4,
            MAX_STEPS + 1,
            Gemm::LoadSplat,
            auto,
            0.2,
            &mut now
        )
        .is_err());
        assert!(layer_bench("mlp:16", 4, 3, Gemm::LoadSplat, auto, 1.5, &mut now).is_err());
        assert!(layer_bench("mlp:16", 4, 3, Gemm::LoadSplat, auto, f64::NAN, &mut now).is_err());
        // The defaults are back to the target's after a bench.
        assert_eq!(
            crowdgrad_core::model::default_kernel(),
            Gemm::target_default()
        );
        assert_eq!(crowdgrad_core::model::default_sparse_input(), auto);
    }
}
