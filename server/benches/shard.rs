//! Shard apply throughput through the server's real push path (the shard session decodes,
//! validates and copies the frame, `ShardCore` updates, the server publishes the snapshot), per
//! optimizer. Run: `cargo bench -p crowdgrad --bench shard`.

use criterion::{criterion_main, Criterion, Throughput};
use crowdgrad::registry::Registry;
use crowdgrad::shard::Shard;
use crowdgrad_core::optim::{OptimizerConfig, Rule};
use crowdgrad_core::partition::KeyRange;
use crowdgrad_core::session::ShardSetup;
use crowdgrad_core::session::{Action, ShardSession};
use crowdgrad_core::shard::{Consistency, StalenessPolicy};
use crowdgrad_core::wire::{self, ClientKind, Hello, Message};

const N: usize = 101_770;

fn apply(c: &mut Criterion) {
    let mut g = c.benchmark_group("shard_apply");
    g.throughput(Throughput::Elements(N as u64));
    for name in ["sgd", "momentum", "adagrad", "rmsprop", "adam"] {
        let opts = ShardSetup {
            optimizer: OptimizerConfig {
                rule: Rule::from_name(name).expect("rule"),
                lr: 1e-3,
                weight_decay: 0.0,
                clip_norm: None,
                schedule: Default::default(),
            },
            staleness: StalenessPolicy::default(),
            consistency: Consistency::Async,
            heartbeat: 5.0,
            sync_timeout: 1.0,
            pull_encoding: crowdgrad_core::codec::Encoding::F32,
            push_encoding: crowdgrad_core::codec::Encoding::F32,
            reports: true,
            pseudo_gradients: false,
            guard: crowdgrad_core::session::PushGuard::default(),
            aggregation: crowdgrad_core::robust::Aggregation::Mean,
            pacing: crowdgrad_core::shard::Pacing::OFF,
            counted: false,
            average: None,
        };
        let shard = Shard::start(0, KeyRange { start: 0, end: N }, vec![0.1; N], opts)
            .expect("a valid setup");
        let grad = vec![1e-3f32; N];
        let registry = Registry::new(1, 10);
        let Some((id, _)) = registry.join(ClientKind::Native, None, 1) else {
            panic!("join")
        };
        let mut access = shard.access(&registry);
        let mut session = ShardSession::new(shard.config());
        let hello = wire::encode(&Message::Hello {
            request_id: 1,
            shard: 0,
            hello: Hello {
                worker_id: id,
                ..Default::default()
            },
        });
        session.handle_frame(&mut access, &hello, 0.0);
        while session.poll_action().is_some() {}
        let mut request = 1u32;
        g.bench_function(name, |b| {
            b.iter(|| {
                // Push request ids rise on a connection (a repeated one is a replay).
                request += 1;
                let frame = wire::encode_push(request, 0, shard.version(), 32, &grad);
                session.handle_frame(&mut access, &frame, 0.0);
                let mut acked = false;
                while let Some(a) = session.poll_action() {
                    acked |= matches!(a, Action::Send(_));
                }
                acked
            })
        });
    }
    g.finish();
}

mod group {
    #![allow(missing_docs)] // criterion_group! generates an undocumented fn
    use super::*;
    criterion::criterion_group!(benches, apply);
}
criterion_main!(group::benches);
