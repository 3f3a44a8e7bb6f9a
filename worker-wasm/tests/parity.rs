//! Native and wasm32 parity: the same seeds and batches give the same numbers in the browser as
//! natively. One computation ([`compute`]) runs in both places and is compared against one
//! fixture, `tests/fixtures/parity.json`, generated natively:
//!
//! - natively: `cargo test -p crowdgrad-worker-wasm --test parity`
//!   (regenerate with `CROWDGRAD_BLESS=1`);
//! - as wasm, in a dedicated Web Worker of headless Chromium:
//!   `CHROMEDRIVER=/usr/bin/chromedriver cargo test -p crowdgrad-worker-wasm --target
//!   wasm32-unknown-unknown` (with `wasm-bindgen-test-runner` as the target's runner).
//!
//! Two kinds of values, and why:
//! - **exact** (compared bit for bit): the PRNG's integers, initial weights, data parsing and
//!   batching, the optimizer update and every frame header the worker sends. These are integer
//!   or element-wise IEEE arithmetic (`+ - * / sqrt`) that Rust neither contracts nor reorders,
//!   so wasm must match exactly. Initial weights go through f64 `ln`/`cos`, which differ in
//!   the last bits between glibc (native) and Rust's libm port (wasm), but they are rounded to
//!   f32 and all 101,770 weights of the MLP come out identical.
//! - **approximate** (relative tolerance [`RTOL`], absolute floor [`ATOL`]): the f64 normal
//!   samples themselves (which do differ in the last bits, see above), losses and gradients.
//!   Losses and gradients go through `matrixmultiply`'s GEMM, whose native kernel is chosen at
//!   run time by CPU features (FMA where available), and through `expf`/`ln`, so they may round
//!   differently on another machine even though on the reference machine they match bit for
//!   bit. The largest relative difference seen is printed by both tests.
//!
//! Every GEMM kernel ([`Gemm::ALL`]: `matrixmultiply`, our load-splat kernel) computes the
//! same gradients of the MLP, the CNN and the small CNN, and each is compared with the one
//! native fixture (`*_kernel_matches_native_fixture`): in the browser that is wasm
//! load-splat on `v128` lanes (and, in the relaxed-SIMD build the xtask tests too,
//! `f32x4.relaxed_madd`) against native `matrixmultiply` with AVX2/FMA. `compute` itself uses
//! the target's default kernel, load-splat on wasm.
//!
//! The sparse first layer (issue 11: the MLP's first dense layer skips the batch's zero
//! inputs, [`SparseInput`]) is compared the same way: every kernel with it `off` (dense GEMM),
//! `auto` (the default: sparse at most half nonzero) and `on` gives the fixture's gradients,
//! which are the native dense ones. The batch is MNIST-like (~25% nonzero: `auto` goes
//! sparse, checked), and the same images normalised with `--normalize 0.1307/0.3081` (no zero
//! left: `auto` must take the dense GEMM, checked; `on` computes the sparse product of a full
//! batch). The CNNs' first layer is a convolution: no choice changes them (checked).
//!
//! A tiny `gpt` language model (issue 20: embeddings, causal attention through the GEMM
//! switch, LayerNorm, GELU, a tied and an untied head) is compared the same way, every kernel.

use crowdgrad_core::data::{BatchSampler, Dataset, Normalize};
use crowdgrad_core::model::{
    default_kernel, default_sparse_input, Gemm, Model, ModelSpec, SparseInput, SPARSE_MAX_DENSITY,
};
use crowdgrad_core::optim::{self, OptState, OptimizerConfig, Rule};
use crowdgrad_core::rng::Rng;
use crowdgrad_core::wire::{self, ClientKind, Message};
use crowdgrad_core::worker::Worker;
use crowdgrad_worker_wasm::loopback::{synthetic_idx, synthetic_run, Loopback};
use ndarray::Array2;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[cfg(target_arch = "wasm32")]
wasm_bindgen_test::wasm_bindgen_test_configure!(run_in_dedicated_worker);

/// Relative tolerance for values that go through GEMM and transcendental functions.
const RTOL: f64 = 1e-4;
/// Absolute floor of the tolerance (gradient entries near zero).
const ATOL: f64 = 1e-6;

/// The fixture, checked in.
const FIXTURE: &str = include_str!("fixtures/parity.json");

/// What both platforms compute.
#[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
struct Fingerprint {
    /// Hex digests (FNV-1a 64 of the bits) or decimal integers, compared exactly.
    exact: BTreeMap<String, String>,
    /// Values compared within tolerance, as Rust's shortest round-trip decimal text (parsed
    /// back exactly with `str::parse`, unlike JSON numbers through serde_json's fast path).
    approx: BTreeMap<String, Vec<String>>,
}

/// FNV-1a 64 over bytes.
fn fnv(bytes: impl IntoIterator<Item = u8>) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn fnv_f32(values: &[f32]) -> String {
    fnv(values.iter().flat_map(|v| v.to_bits().to_le_bytes()))
}

fn l2(values: &[f32]) -> f64 {
    values
        .iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum::<f64>()
        .sqrt()
}

fn sum(values: &[f32]) -> f64 {
    values.iter().map(|&v| f64::from(v)).sum()
}

impl Fingerprint {
    fn put_exact(&mut self, key: &str, value: String) {
        self.exact.insert(key.into(), value);
    }

    fn put_approx(&mut self, key: &str, values: impl IntoIterator<Item = f64>) {
        let text = values.into_iter().map(|v| format!("{v:?}")).collect();
        self.approx.insert(key.into(), text);
    }
}

fn compute() -> Fingerprint {
    let mut fp = Fingerprint::default();

    // PRNG.
    let mut r = Rng::new(42);
    let words: Vec<u8> = (0..64).flat_map(|_| r.next_u64().to_le_bytes()).collect();
    fp.put_exact("rng.next_u64", fnv(words));
    // f64 `ln`/`cos` behind `normal()` are not bit-identical across libms: approximate.
    let normals: Vec<f64> = (0..64).map(|_| r.normal()).collect();
    fp.put_approx("rng.normal_f64", normals);

    // Initial weights of the MNIST MLP the server runs by default.
    let mlp = Model::new(ModelSpec::parse("mlp:128", 784, 10).expect("spec")).expect("model");
    let p0 = mlp.init_params(7);
    fp.put_exact("init.mlp128.len", p0.len().to_string());
    fp.put_exact("init.mlp128.bits", fnv_f32(&p0));

    let batch = mnist_batch(&mut fp);
    gradients(&mut fp, default_kernel(), default_sparse_input(), &batch);

    // The optimizer: element-wise IEEE arithmetic, so bit-exact.
    for name in ["sgd", "momentum", "adagrad", "rmsprop", "adam"] {
        let cfg = OptimizerConfig {
            rule: Rule::from_name(name).expect("rule"),
            lr: 0.01,
            weight_decay: 1e-4,
            clip_norm: None,
            schedule: Default::default(),
        };
        let mut state = OptState::new(&cfg.rule, 100);
        // Inputs from exact integer arithmetic (f32 `sin`/`cos` would differ across libms).
        let mut r = Rng::new(13);
        let mut uniform = || ((r.next_u64() >> 40) as f32) / (1u32 << 24) as f32 - 0.5;
        let mut p: Vec<f32> = (0..100).map(|_| uniform()).collect();
        for _ in 0..5 {
            let g: Vec<f32> = (0..100).map(|_| uniform()).collect();
            optim::step(&cfg, &mut state, &mut p, &g, 1.0);
        }
        fp.put_exact(&format!("optim.{name}"), fnv_f32(&p));
    }

    worker_session(&mut fp);
    fp
}

/// The batches gradients are taken on.
struct Batch {
    /// `pixel / 255`: mostly exact zeros, like MNIST.
    x: Array2<f32>,
    /// The same images with `--normalize 0.1307/0.3081`: no zero left.
    normalized: Array2<f32>,
    y: Vec<u8>,
}

/// The MNIST-shaped batch the gradients are taken on, from IDX parsing and the sampler, plain
/// and normalised; their digests go into `fp`.
fn mnist_batch(fp: &mut Fingerprint) -> Batch {
    let (img, lab) = synthetic_idx(96, 5);
    let mut data = Dataset::from_idx(&img, &lab).expect("valid IDX");
    let mut sampler = BatchSampler::new(data.len(), 11);
    let mut idx = vec![0u32; 32];
    let mut all_idx = Vec::new();
    for _ in 0..4 {
        sampler.next_batch(&mut idx);
        all_idx.extend_from_slice(&idx);
    }
    fp.put_exact(
        "data.batches",
        fnv(all_idx.iter().flat_map(|i| i.to_le_bytes())),
    );
    let mut x = Array2::zeros((32, 784));
    let mut y = vec![0u8; 32];
    data.fill_batch(&idx, &mut x.view_mut(), &mut y);
    fp.put_exact(
        "data.batch_x",
        fnv_f32(x.as_slice().expect("standard layout")),
    );
    fp.put_exact("data.batch_y", fnv(y.iter().copied()));
    data.set_normalize(&Normalize::parse("0.1307/0.3081").expect("normalize"))
        .expect("one channel");
    let mut normalized = Array2::zeros((32, 784));
    data.fill_batch(&idx, &mut normalized.view_mut(), &mut y);
    fp.put_exact(
        "data.batch_x_normalized",
        fnv_f32(normalized.as_slice().expect("standard layout")),
    );
    Batch { x, normalized, y }
}

/// Nonzero fraction of a batch.
fn density(x: &Array2<f32>) -> f64 {
    x.iter().filter(|&&v| v != 0.0).count() as f64 / x.len() as f64
}

/// Losses and gradients of every model on `batch`, computed with `kernel` and `sparse`.
fn gradients(fp: &mut Fingerprint, kernel: Gemm, sparse: SparseInput, batch: &Batch) {
    let (x, y) = (&batch.x, &batch.y[..]);
    let mlp = Model::new(ModelSpec::parse("mlp:128", 784, 10).expect("spec")).expect("model");
    let p0 = mlp.init_params(7);
    // Loss and gradient of the MNIST MLP on that batch, plain and normalised.
    for (key, x, dense) in [
        ("mlp128", x, false),
        ("mlp128.normalized", &batch.normalized, true),
    ] {
        let mut grad = vec![0.0f32; p0.len()];
        let mut ws = mlp.workspace(32);
        ws.set_gemm(kernel);
        ws.set_sparse_input(sparse);
        let stats = mlp
            .loss_and_grad(&p0, x.view(), y, &mut grad, &mut ws)
            .expect("fits");
        // The path each choice must take on this batch.
        let d = density(x);
        assert!(if dense { d > 0.99 } else { d < 0.3 }, "{key}: density {d}");
        let want_sparse = match sparse {
            SparseInput::Off => false,
            SparseInput::On => true,
            SparseInput::Auto => d <= SPARSE_MAX_DENSITY,
        };
        assert_eq!(
            ws.sparse_passes() > 0,
            want_sparse,
            "{key} {kernel} sparse {sparse}: density {}",
            density(x)
        );
        fp.put_approx(&format!("{key}.loss"), [stats.mean_loss()]);
        fp.put_approx(&format!("{key}.grad.l2_sum"), [l2(&grad), sum(&grad)]);
        // A spread of individual entries: first and last layer, weights and biases.
        let picks: Vec<f64> = [
            0usize, 1, 5000, 77_777, 100_351, 100_480, 100_481, 101_759, 101_769,
        ]
        .iter()
        .map(|&i| f64::from(grad[i]))
        .collect();
        fp.put_approx(&format!("{key}.grad.picks"), picks);
    }

    // A tiny model, every gradient entry.
    let tiny = Model::new(ModelSpec::parse("mlp:8", 16, 4).expect("spec")).expect("model");
    let tp = tiny.init_params(3);
    let mut r = Rng::new(9);
    let tx = Array2::from_shape_fn((8, 16), |_| r.normal() as f32);
    let ty: Vec<u8> = (0..8).map(|_| r.below(4) as u8).collect();
    let mut tg = vec![0.0f32; tp.len()];
    let mut tws = tiny.workspace(8);
    tws.set_gemm(kernel);
    tws.set_sparse_input(sparse);
    let ts = tiny
        .loss_and_grad(&tp, tx.view(), &ty, &mut tg, &mut tws)
        .expect("fits");
    fp.put_exact("tiny.init.bits", fnv_f32(&tp));
    fp.put_approx("tiny.loss", [ts.mean_loss()]);
    fp.put_approx("tiny.grad", tg.iter().map(|&g| f64::from(g)));

    cnn(fp, kernel, sparse, x, y);
    gpt(fp, kernel, sparse);
}

/// A tiny `gpt` language model (embeddings, two attention blocks, tied head) on a batch of
/// random token ids: initial weights exactly, loss and gradient within tolerance (its L2 and L1
/// norms, and the first and middle entry of every tensor, to keep the fixture small), and the
/// same for an untied head. No sparse choice touches it (checked).
fn gpt(fp: &mut Fingerprint, kernel: Gemm, sparse: SparseInput) {
    let (t, v) = (8, 11);
    let mut r = Rng::new(17);
    let x = Array2::from_shape_fn((4, t + 1), |_| r.below(v as u64) as f32);
    let y = vec![0u8; 4];
    for (key, text) in [
        ("gpt", "gpt:2,16,4,8"),
        ("gpt_untied", "gpt:1,16,2,8/untied"),
    ] {
        let m = Model::new(ModelSpec::parse(text, t + 1, v).expect("spec")).expect("model");
        let p0 = m.init_params(7);
        fp.put_exact(&format!("{key}.init.bits"), fnv_f32(&p0));
        let mut grad = vec![0.0f32; p0.len()];
        let mut ws = m.workspace(4);
        ws.set_gemm(kernel);
        ws.set_sparse_input(sparse);
        let stats = m
            .loss_and_grad(&p0, x.view(), &y, &mut grad, &mut ws)
            .expect("fits");
        assert_eq!(ws.sparse_passes(), 0, "a language model: never sparse");
        fp.put_approx(&format!("{key}.loss"), [stats.mean_loss()]);
        // Norms, not the plain sum: a LayerNorm's input gradient sums to about zero, so the
        // sum of this gradient cancels and its relative rounding is large.
        let l1: f64 = grad.iter().map(|&g| f64::from(g.abs())).sum();
        fp.put_approx(&format!("{key}.grad.l2_l1"), [l2(&grad), l1]);
        let picks: Vec<f64> = m
            .layout()
            .tensors
            .iter()
            .flat_map(|t| [t.offset, t.offset + t.len() / 2])
            .map(|i| f64::from(grad[i]))
            .collect();
        fp.put_approx(&format!("{key}.grad.picks"), picks);
    }
}

/// The default CNN (`cnn`: im2col convolutions, max-pooling, dense layers) and a small model
/// with every other layer kind (padding, stride, average pooling, dropout), on the MNIST-shaped
/// batch `x`, `y`: initial weights exactly, loss and gradients within tolerance.
fn cnn(fp: &mut Fingerprint, kernel: Gemm, sparse: SparseInput, x: &Array2<f32>, y: &[u8]) {
    let cnn =
        Model::new(ModelSpec::parse_shaped("cnn", &[28, 28], 10).expect("spec")).expect("model");
    let p0 = cnn.init_params(7);
    fp.put_exact("init.cnn.len", p0.len().to_string());
    fp.put_exact("init.cnn.bits", fnv_f32(&p0));
    let mut grad = vec![0.0f32; p0.len()];
    let mut ws = cnn.workspace(32);
    ws.set_gemm(kernel);
    ws.set_sparse_input(sparse);
    let stats = cnn
        .loss_and_grad(&p0, x.view(), y, &mut grad, &mut ws)
        .expect("fits");
    assert_eq!(ws.sparse_passes(), 0, "a convolution first: never sparse");
    fp.put_approx("cnn.loss", [stats.mean_loss()]);
    fp.put_approx("cnn.grad.l2_sum", [l2(&grad), sum(&grad)]);
    // One entry of every tensor: the first, and one in the middle.
    let picks: Vec<f64> = cnn
        .layout()
        .tensors
        .iter()
        .flat_map(|t| [t.offset, t.offset + t.len() / 2])
        .map(|i| f64::from(grad[i]))
        .collect();
    fp.put_approx("cnn.grad.picks", picks);

    let small = Model::new(
        ModelSpec::parse_shaped(
            "conv:4x3x3/p1,pool:2,conv:6x3x3/s2,avgpool:2,dense:16,dropout:0.25",
            &[28, 28],
            10,
        )
        .expect("spec"),
    )
    .expect("model");
    let sp = small.init_params(5);
    let mut sg = vec![0.0f32; sp.len()];
    let mut sws = small.workspace(32);
    sws.set_gemm(kernel);
    sws.set_sparse_input(sparse);
    let ss = small
        .loss_and_grad_seeded(&sp, x.view(), y, 99, &mut sg, &mut sws)
        .expect("fits");
    fp.put_exact("small_cnn.init.bits", fnv_f32(&sp));
    fp.put_approx("small_cnn.loss", [ss.mean_loss()]);
    fp.put_approx("small_cnn.grad", sg.iter().map(|&g| f64::from(g)));
}

/// Runs the sans-IO worker against the in-memory two-shard [`Loopback`] for a few steps.
fn worker_session(fp: &mut Fingerprint) {
    let cfg = OptimizerConfig {
        rule: Rule::Sgd,
        lr: 0.1,
        weight_decay: 0.0,
        clip_norm: Some(5.0),
        schedule: Default::default(),
    };
    let (join, data) = synthetic_run("mlp:32", 2, cfg, 16, 64, 21).expect("run");
    let mut shards = Loopback::new(&join, 42).expect("shards");
    let mut worker = Worker::new(join, data, ClientKind::Browser, Some(4)).expect("worker");
    let mut headers = Vec::new();
    let mut hellos = Vec::new();
    let mut push_l2 = Vec::new();
    let mut losses = Vec::new();
    for shard in 0..2 {
        worker.connected(shard);
    }
    for _round in 0..100 {
        shards
            .exchange(&mut worker, |_, frame, msg| {
                headers.extend_from_slice(&frame[..wire::HEADER_LEN]);
                match msg {
                    Message::Hello { .. } => hellos.extend_from_slice(frame),
                    Message::Push { grad, .. } => {
                        push_l2.push(l2(&grad.iter().collect::<Vec<f32>>()));
                    }
                    _ => {}
                }
            })
            .expect("valid exchange");
        if worker.ready() {
            losses.push(worker.step().expect("step").loss);
        } else if worker.is_done() {
            break;
        }
    }
    let st = worker.stats();
    fp.put_exact(
        "worker.counts",
        format!(
            "steps={} samples={} sent={} accepted={} rejected={} lost={}",
            st.steps,
            st.samples,
            st.pushes_sent,
            st.pushes_accepted,
            st.pushes_rejected,
            st.pushes_lost
        ),
    );
    fp.put_exact("worker.headers", fnv(headers));
    fp.put_exact("worker.hellos", fnv(hellos));
    fp.put_approx("worker.losses", losses);
    fp.put_approx("worker.push_l2", push_l2);
    let all = shards.params();
    fp.put_approx("worker.final_params.l2_sum", [l2(&all), sum(&all)]);
}

/// What [`compare`] found.
#[derive(Debug, Default)]
struct Report {
    /// Largest relative difference among approximate values.
    worst: f64,
    /// Approximate values that matched bit for bit, of `total`.
    identical: usize,
    total: usize,
    /// Largest relative difference per approximate key.
    per_key: Vec<String>,
    failures: Vec<String>,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exact values all equal: {}; approximate values bit-identical: {} of {}; \
             largest relative difference {:.1e} ({})",
            self.failures.iter().all(|m| !m.starts_with("exact")),
            self.identical,
            self.total,
            self.worst,
            self.per_key.join(", ")
        )
    }
}

/// Compares `got` with `want`.
fn compare(got: &Fingerprint, want: &Fingerprint) -> Report {
    let mut r = Report::default();
    let failures = &mut r.failures;
    for (k, w) in &want.exact {
        match got.exact.get(k) {
            Some(g) if g == w => {}
            g => failures.push(format!("exact {k}: got {g:?}, fixture {w}")),
        }
    }
    let parse =
        |v: &[String]| -> Vec<f64> { v.iter().map(|t| t.parse().unwrap_or(f64::NAN)).collect() };
    for (k, w) in &want.approx {
        let w = parse(w);
        let Some(g) = got.approx.get(k).map(|g| parse(g)) else {
            failures.push(format!("missing {k}"));
            continue;
        };
        if g.len() != w.len() {
            failures.push(format!("{k}: {} values, fixture {}", g.len(), w.len()));
            continue;
        }
        let mut key_worst = 0.0f64;
        for (i, (&a, &b)) in g.iter().zip(&w).enumerate() {
            let diff = (a - b).abs();
            r.total += 1;
            if a.to_bits() == b.to_bits() {
                r.identical += 1;
            }
            key_worst = key_worst.max(diff / b.abs().max(ATOL));
            if diff.is_nan() || diff > ATOL + RTOL * b.abs() {
                failures.push(format!("{k}[{i}]: got {a}, fixture {b} (diff {diff:e})"));
            }
        }
        r.worst = r.worst.max(key_worst);
        r.per_key.push(format!("{k}: {key_worst:.1e}"));
    }
    if got.exact.len() != want.exact.len() || got.approx.len() != want.approx.len() {
        failures.push("the fixture and the computation list different keys".into());
    }
    r
}

fn fixture() -> Fingerprint {
    serde_json::from_str(FIXTURE).expect("fixture is valid JSON")
}

#[cfg(not(target_arch = "wasm32"))]
#[test]
fn native_matches_fixture() {
    let got = compute();
    if std::env::var_os("CROWDGRAD_BLESS").is_some() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/parity.json");
        let json = serde_json::to_string_pretty(&got).expect("serialisable") + "\n";
        std::fs::write(path, json).expect("write fixture");
        return;
    }
    let report = compare(&got, &fixture());
    println!("native vs fixture: {report}");
    assert!(report.failures.is_empty(), "{}", report.failures.join("\n"));
}

#[cfg(not(target_arch = "wasm32"))]
#[test]
fn compare_flags_differences() {
    let mut want = compute();
    let got = compute();
    assert!(compare(&got, &want).failures.is_empty());
    want.exact.insert("rng.next_u64".into(), "0".into());
    if let Some(v) = want.approx.get_mut("tiny.grad") {
        let x: f64 = v[3].parse().unwrap();
        v[3] = format!("{:?}", x * 1.01 + 1e-3);
    }
    let failures = compare(&got, &want).failures;
    assert_eq!(failures.len(), 2, "{failures:?}");
}

/// The gradients of every model with `kernel` and `sparse`, compared with the fixture's (native
/// matrixmultiply, dense first layer) values of the same keys.
fn kernel_report(kernel: Gemm, sparse: SparseInput) -> Report {
    let mut fp = Fingerprint::default();
    let batch = mnist_batch(&mut fp);
    gradients(&mut fp, kernel, sparse, &batch);
    let mut want = fixture();
    want.exact.retain(|k, _| fp.exact.contains_key(k));
    want.approx.retain(|k, _| fp.approx.contains_key(k));
    assert!(
        want.approx.len() >= 10,
        "the fixture lacks the gradient keys: {:?}",
        want.approx.keys()
    );
    compare(&fp, &want)
}

#[cfg(not(target_arch = "wasm32"))]
#[test]
fn every_kernel_matches_native_fixture() {
    for &kernel in Gemm::ALL {
        for &sparse in SparseInput::ALL {
            let report = kernel_report(kernel, sparse);
            println!("native {kernel}, sparse input {sparse} vs fixture: {report}");
            assert!(
                report.failures.is_empty(),
                "{kernel} sparse {sparse}: {}",
                report.failures.join("\n")
            );
        }
    }
}

#[cfg(target_arch = "wasm32")]
#[wasm_bindgen_test::wasm_bindgen_test]
fn wasm_every_kernel_matches_native_fixture() {
    let (simd128, relaxed) = Gemm::simd_lanes();
    for &kernel in Gemm::ALL {
        for &sparse in SparseInput::ALL {
            let report = kernel_report(kernel, sparse);
            wasm_bindgen_test::console_log!(
                "wasm {kernel}, sparse input {sparse} (simd128 {simd128}, relaxed-simd {relaxed}) vs native fixture: {report}"
            );
            assert!(
                report.failures.is_empty(),
                "{kernel} sparse {sparse}: {}",
                report.failures.join("\n")
            );
        }
    }
}

#[cfg(target_arch = "wasm32")]
#[wasm_bindgen_test::wasm_bindgen_test]
fn wasm_matches_fixture() {
    let got = compute();
    let report = compare(&got, &fixture());
    wasm_bindgen_test::console_log!("wasm vs native fixture: {report}");
    assert!(report.failures.is_empty(), "{}", report.failures.join("\n"));
}
