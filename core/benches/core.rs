//! Micro-benchmarks of the hot paths: shard apply per optimizer, frame encode/decode, one
//! gradient step of the MLP 784-128-10 at batch 32, and one of `gpt` (4 blocks of 128, T = 64,
//! V = 100) at batch 32, in tokens. Run: `cargo bench -p crowdgrad-core`
//! (`--example model_bench -- gpt 32` splits a gpt step per stage).

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use crowdgrad_core::model::{Model, ModelSpec};
use crowdgrad_core::optim::{step, OptState, OptimizerConfig, Rule};
use crowdgrad_core::rng::Rng;
use crowdgrad_core::wire;
use ndarray::Array2;
use std::hint::black_box;

const N: usize = 101_770; // MLP 784-128-10

fn apply(c: &mut Criterion) {
    let mut g = c.benchmark_group("apply");
    g.throughput(Throughput::Elements(N as u64));
    for name in ["sgd", "momentum", "nesterov", "adagrad", "rmsprop", "adam"] {
        let cfg = OptimizerConfig {
            rule: Rule::from_name(name).expect("known rule"),
            lr: 0.01,
            weight_decay: 0.0,
            clip_norm: None,
            schedule: Default::default(),
        };
        let mut state = OptState::new(&cfg.rule, N);
        let mut params = vec![0.5f32; N];
        let grad: Vec<f32> = (0..N).map(|i| (i as f32).sin() * 1e-3).collect();
        g.bench_function(name, |b| {
            b.iter(|| {
                step(
                    &cfg,
                    &mut state,
                    black_box(&mut params),
                    black_box(&grad),
                    1.0,
                )
            })
        });
    }
    g.finish();
}

fn codec(c: &mut Criterion) {
    let values: Vec<f32> = (0..N).map(|i| i as f32 * 1e-3).collect();
    let frame = wire::encode_push(1, 0, 7, 32, &values);
    let mut g = c.benchmark_group("codec");
    g.throughput(Throughput::Bytes(frame.len() as u64));
    g.bench_function("encode_push", |b| {
        b.iter(|| wire::encode_push(1, 0, 7, 32, black_box(&values)))
    });
    let mut out = vec![0.0f32; N];
    g.bench_function("decode_push_and_copy_checked", |b| {
        b.iter(|| {
            let wire::Message::Push { grad, .. } =
                wire::decode(black_box(&frame), 1 << 24).expect("valid")
            else {
                unreachable!()
            };
            grad.copy_into(&mut out).expect("finite")
        })
    });
    g.finish();
}

fn gradient(c: &mut Criterion) {
    let model = Model::new(ModelSpec::parse("mlp:128", 784, 10).expect("spec")).expect("model");
    let params = model.init_params(1);
    let mut rng = Rng::new(2);
    let x = Array2::from_shape_fn((32, 784), |_| rng.next_f64() as f32);
    let y: Vec<u8> = (0..32).map(|i| (i % 10) as u8).collect();
    let mut ws = model.workspace(32);
    let mut grad = vec![0.0; params.len()];
    let mut g = c.benchmark_group("gradient");
    g.throughput(Throughput::Elements(32));
    g.bench_function("mlp_784_128_10_batch32", |b| {
        b.iter(|| {
            model
                .loss_and_grad(&params, x.view(), &y, &mut grad, &mut ws)
                .expect("fits")
        })
    });
    g.bench_function("init_params", |b| {
        b.iter_batched(|| (), |_| model.init_params(3), BatchSize::SmallInput)
    });
    g.finish();
}

fn gpt(c: &mut Criterion) {
    let model = Model::new(ModelSpec::parse_sequence("gpt", 100).expect("spec")).expect("model");
    let params = model.init_params(1);
    let mut rng = Rng::new(2);
    let x = Array2::from_shape_fn((32, 65), |_| rng.below(100) as f32);
    let y = vec![0u8; 32];
    let mut ws = model.workspace(32);
    let mut grad = vec![0.0; params.len()];
    let mut g = c.benchmark_group("gradient");
    g.sample_size(10);
    g.throughput(Throughput::Elements(32 * 64));
    g.bench_function("gpt_4_128_4_64_batch32_tokens", |b| {
        b.iter(|| {
            model
                .loss_and_grad(&params, x.view(), &y, &mut grad, &mut ws)
                .expect("fits")
        })
    });
    g.finish();
}

mod group {
    #![allow(missing_docs)] // criterion_group! generates an undocumented fn
    use super::*;
    criterion_group!(benches, apply, codec, gradient, gpt);
}
criterion_main!(group::benches);
