//! The browser worker negotiates and decodes every payload encoding (issue 8): round trips of
//! f32, bf16 and int8 blocks through `crowdgrad_core::codec` and through whole wire frames,
//! error feedback, decoders that refuse bad bytes, and a worker running local steps against
//! shard sessions that choose bf16 pulls and int8 pushes.
//!
//! The same tests run natively (`cargo test -p crowdgrad-worker-wasm --test codec`) and as wasm
//! in a dedicated Web Worker of headless Chromium (`cargo xtask test`, like `tests/parity.rs`),
//! so the wasm build of the codec is checked where the browser runs it.

use crowdgrad_core::codec::{Encoding, ErrorFeedback, MAX_INT8_SCALE};
use crowdgrad_core::local::{LocalConfig, LocalSteps};
use crowdgrad_core::optim::{OptimizerConfig, Rule};
use crowdgrad_core::rng::Rng;
use crowdgrad_core::session::{Action, PushGuard, ShardSession, ShardSetup, ShardState};
use crowdgrad_core::shard::{Consistency, StalenessPolicy};
use crowdgrad_core::wire::{self, ClientKind, Message};
use crowdgrad_core::worker::Worker;
use crowdgrad_worker_wasm::loopback::synthetic_run;

#[cfg(target_arch = "wasm32")]
wasm_bindgen_test::wasm_bindgen_test_configure!(run_in_dedicated_worker);

/// Every encoding a worker may be asked for, including an odd int8 block size.
const ENCODINGS: [Encoding; 4] = [
    Encoding::F32,
    Encoding::Bf16,
    Encoding::INT8,
    Encoding::Int8Block { block: 7 },
];

/// `n` values of mixed magnitudes (with zeros, tiny and large entries), from `seed`.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n)
        .map(|i| {
            let u = (r.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
            let mag = [1e-6, 1e-3, 0.1, 1.0, 30.0][i % 5];
            if i % 11 == 0 {
                0.0
            } else {
                (u * mag) as f32
            }
        })
        .collect()
}

/// The error bound of `enc` for `x`, within the block of `xs` it belongs to.
fn bound(enc: Encoding, xs: &[f32], i: usize) -> f32 {
    match enc {
        Encoding::F32 => 0.0,
        // bf16 keeps 8 significant bits: half a unit in the last place, 2^-9 relative.
        Encoding::Bf16 => xs[i].abs() * (1.0 / 256.0),
        Encoding::Int8Block { block } => {
            let b = block as usize;
            let start = i / b * b;
            let max = xs[start..(start + b).min(xs.len())]
                .iter()
                .fold(0f32, |m, v| m.max(v.abs()));
            // Scale max/127; rounding to the nearest code loses at most half of it.
            max / 127.0 * 0.5 * (1.0 + 1e-5)
        }
    }
}

fn assert_close(enc: Encoding, want: &[f32], got: &[f32]) {
    assert_eq!(want.len(), got.len());
    for (i, (w, g)) in want.iter().zip(got).enumerate() {
        let b = bound(enc, want, i);
        assert!(
            (w - g).abs() <= b,
            "{enc} value {i}: {w} came back as {g} (bound {b})"
        );
    }
}

#[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
#[cfg_attr(not(target_arch = "wasm32"), test)]
fn every_encoding_round_trips_within_its_bound() {
    for enc in ENCODINGS {
        for n in [0, 1, 6, 7, 8, 255, 256, 257, 1000] {
            let xs = values(n, n as u64 + 1);
            let mut bytes = Vec::new();
            enc.encode(&xs, &mut bytes).unwrap();
            assert_eq!(bytes.len(), enc.encoded_len(n), "{enc} n={n}");
            assert_eq!(enc.decoded_len(bytes.len()), Some(n), "{enc} n={n}");
            let mut back = vec![f32::NAN; n];
            enc.decode(&bytes, &mut back).unwrap();
            assert_close(enc, &xs, &back);
        }
    }
    // f32 is bit exact, and the int8 frame of the MLP's shard is about a quarter of f32.
    let xs = values(101_770, 9);
    let mut b = Vec::new();
    Encoding::F32.encode(&xs, &mut b).unwrap();
    let mut back = vec![0.0; xs.len()];
    Encoding::F32.decode(&b, &mut back).unwrap();
    assert!(xs
        .iter()
        .zip(&back)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    let ratio = Encoding::INT8.encoded_len(xs.len()) as f64 / (4 * xs.len()) as f64;
    assert!(ratio < 0.255, "int8 blocks take {ratio} of f32");
}

#[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
#[cfg_attr(not(target_arch = "wasm32"), test)]
fn params_and_push_frames_round_trip_through_the_wire() {
    let n = 1000;
    let xs = values(n, 5);
    // Frames carry int8 blocks of the default size only (the header names no block size).
    for enc in [Encoding::F32, Encoding::Bf16, Encoding::INT8] {
        let frame = wire::encode_params_as(enc, 17, 1, 42, &xs).unwrap();
        let Message::Params {
            request_id,
            shard,
            version,
            pace_ms,
            samples,
            values: payload,
        } = wire::decode(&frame, usize::MAX).unwrap()
        else {
            panic!("{enc}: not a Params frame");
        };
        assert_eq!((request_id, shard, version, pace_ms), (17, 1, 42, 0));
        assert_eq!(samples, None, "no samples meta unless negotiated");
        assert_eq!((payload.encoding(), payload.len()), (enc, n));
        let mut got = vec![0.0; n];
        payload.copy_into(&mut got).unwrap();
        assert_close(enc, &xs, &got);
        // The unchecked iterator (tools) agrees with the checked decoder.
        assert!(payload
            .iter()
            .zip(&got)
            .all(|(a, b)| a.to_bits() == b.to_bits()));

        let mut fb = ErrorFeedback::new(n);
        let frame = wire::encode_push_as(enc, 3, 0, 41, 32, &xs, Some(&mut fb)).unwrap();
        let Message::Push {
            base_version,
            samples,
            grad,
            ..
        } = wire::decode(&frame, usize::MAX).unwrap()
        else {
            panic!("{enc}: not a Push frame");
        };
        assert_eq!((base_version, samples, grad.encoding()), (41, 32, enc));
        let mut got = vec![0.0; n];
        grad.copy_into(&mut got).unwrap();
        assert_close(enc, &xs, &got);
        // What was lost is exactly what the next push carries.
        for ((x, g), r) in xs.iter().zip(&got).zip(fb.residual()) {
            assert_eq!(*r, x - g, "{enc}");
        }
    }
}

#[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
#[cfg_attr(not(target_arch = "wasm32"), test)]
fn error_feedback_delivers_the_sum_of_the_gradients() {
    // Over many pushes the shard receives the sum of the gradients minus one residual: the
    // rounding error does not accumulate.
    let n = 600;
    for enc in [Encoding::Bf16, Encoding::INT8] {
        let mut fb = ErrorFeedback::new(n);
        let (mut sent, mut got) = (vec![0f64; n], vec![0f64; n]);
        let mut out = Vec::new();
        let mut dec = vec![0f32; n];
        for round in 0..50 {
            let g = values(n, 100 + round);
            out.clear();
            fb.encode_with_feedback(&g, enc, &mut out).unwrap();
            enc.decode(&out, &mut dec).unwrap();
            for i in 0..n {
                sent[i] += f64::from(g[i]);
                got[i] += f64::from(dec[i]);
            }
        }
        for i in 0..n {
            let lag = sent[i] - got[i] - f64::from(fb.residual()[i]);
            assert!(lag.abs() <= 1e-4 * (1.0 + sent[i].abs()), "{enc} value {i}");
            // Without feedback the error would grow with the rounds; with it, it stays within
            // one rounding of the largest gradient magnitude.
            assert!(
                f64::from(fb.residual()[i]).abs() <= 30.0 / 127.0 + 1e-3,
                "{enc} {i}"
            );
        }
    }
}

#[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
#[cfg_attr(not(target_arch = "wasm32"), test)]
fn decoders_refuse_bad_payloads_without_panicking() {
    let xs = values(300, 2);
    for enc in ENCODINGS {
        let mut bytes = Vec::new();
        enc.encode(&xs, &mut bytes).unwrap();
        let mut out = vec![0.0; 300];
        // Every truncation and extension is refused.
        for len in (0..bytes.len()).step_by(13).chain([bytes.len() - 1]) {
            assert!(enc.decode(&bytes[..len], &mut out).is_err(), "{enc} {len}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(enc.decode(&longer, &mut out).is_err(), "{enc}");
        assert!(enc.decode(&bytes, &mut vec![0.0; 299]).is_err(), "{enc}");
    }
    // Non-finite values and bad scales.
    let mut f = Vec::new();
    Encoding::F32.encode(&[1.0, 2.0], &mut f).unwrap();
    f[4..8].copy_from_slice(&f32::INFINITY.to_le_bytes());
    assert!(Encoding::F32.decode(&f, &mut [0.0; 2]).is_err());
    let mut h = Vec::new();
    Encoding::Bf16.encode(&[1.0, 2.0], &mut h).unwrap();
    h[2..4].copy_from_slice(&0x7fc0u16.to_le_bytes()); // bf16 NaN
    assert!(Encoding::Bf16.decode(&h, &mut [0.0; 2]).is_err());
    for scale in [
        f32::NAN,
        f32::INFINITY,
        -1.0,
        f32::from_bits(MAX_INT8_SCALE.to_bits() + 1),
    ] {
        let mut q = Vec::new();
        Encoding::INT8.encode(&[1.0, -1.0, 0.5], &mut q).unwrap();
        q[..4].copy_from_slice(&scale.to_le_bytes());
        assert!(Encoding::INT8.decode(&q, &mut [0.0; 3]).is_err(), "{scale}");
    }
    assert!(Encoding::Int8Block { block: 0 }
        .decode(&[], &mut [])
        .is_err());
    // The encoders refuse what the decoders would: nothing non-finite leaves a worker.
    for enc in ENCODINGS {
        assert!(
            enc.encode(&[0.0, f32::NAN], &mut Vec::new()).is_err(),
            "{enc}"
        );
    }
    // Whole frames with garbage never panic the frame decoder.
    let frame = wire::encode_params_as(Encoding::INT8, 1, 0, 1, &xs).unwrap();
    for cut in (0..frame.len()).step_by(7) {
        if let Ok(Message::Params { values, .. }) = wire::decode(&frame[..cut], usize::MAX) {
            let mut out = vec![0.0; 300];
            assert!(values.copy_into(&mut out).is_err(), "cut at {cut}");
        }
    }
}

#[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
#[cfg_attr(not(target_arch = "wasm32"), test)]
fn a_worker_with_local_steps_negotiates_bf16_pulls_and_int8_pushes() {
    let inner = OptimizerConfig {
        rule: Rule::Sgd,
        lr: 0.05,
        weight_decay: 0.0,
        clip_norm: None,
        schedule: Default::default(),
    };
    let (mut join, data) = synthetic_run("mlp:16", 2, inner, 8, 256, 4).unwrap();
    join.run.local = LocalConfig {
        steps: LocalSteps::Fixed(4),
        inner,
        overlap: false,
    };
    let slicer = join.run.validate().unwrap();
    let outer = OptimizerConfig {
        rule: Rule::Sgd,
        lr: 1.0,
        weight_decay: 0.0,
        clip_norm: None,
        schedule: Default::default(),
    };
    let init = crowdgrad_core::model::Model::new(join.run.model.clone())
        .unwrap()
        .init_params(42);
    let mut shards: Vec<(ShardState, ShardSession)> = slicer
        .ranges()
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let setup = ShardSetup {
                optimizer: outer,
                staleness: StalenessPolicy::default(),
                consistency: Consistency::Async,
                heartbeat: 5.0,
                sync_timeout: 2.0,
                pull_encoding: Encoding::Bf16,
                push_encoding: Encoding::INT8,
                reports: true,
                pseudo_gradients: true,
                guard: PushGuard {
                    max_samples: u32::MAX,
                    ..PushGuard::default()
                },
                aggregation: crowdgrad_core::robust::Aggregation::Mean,
                pacing: crowdgrad_core::shard::Pacing::OFF,
                counted: false,
                average: None,
            };
            let state = setup
                .state(i as u32, *r, init[r.start..r.end].to_vec())
                .unwrap();
            (state, ShardSession::new(setup.config(i as u32, *r)))
        })
        .collect();
    let mut worker = Worker::new(join, data, ClientKind::Browser, Some(12)).unwrap();
    for s in 0..2 {
        worker.connected(s);
    }
    let (mut hellos, mut pushes, mut params) = (0, 0, 0);
    let mut now = 0.0;
    for _ in 0..200 {
        now += 0.01;
        worker.set_time(now);
        let mut replies = Vec::new();
        while let Some(out) = worker.poll_transmit() {
            match wire::decode(&out.frame, usize::MAX).unwrap() {
                Message::Hello { hello, .. } => {
                    hellos += 1;
                    // The browser offers every encoding in both directions it decodes.
                    for e in [Encoding::F32, Encoding::Bf16, Encoding::INT8] {
                        assert!(hello.pull_encodings.iter().any(|o| o.id() == e.id()), "{e}");
                    }
                    for e in [Encoding::F32, Encoding::Bf16, Encoding::INT8] {
                        assert!(hello.push_encodings.iter().any(|o| o.id() == e.id()), "{e}");
                    }
                }
                Message::Push { grad, samples, .. } => {
                    pushes += 1;
                    assert_eq!(grad.encoding(), Encoding::INT8);
                    assert_eq!(samples, 4 * 8, "H = 4 batches of 8 per pseudo-gradient");
                }
                _ => {}
            }
            let (state, session) = &mut shards[out.shard];
            session.handle_frame(state, &out.frame, now);
            while let Some(a) = session.poll_action() {
                match a {
                    Action::Send(f) => replies.push((out.shard, f.into_vec())),
                    Action::Close(why) => panic!("shard {} closed: {why}", out.shard),
                    Action::Record(_) => {}
                }
            }
        }
        for (s, f) in replies {
            if let Ok(Message::Params { values, .. }) = wire::decode(&f, usize::MAX) {
                params += 1;
                assert_eq!(values.encoding(), Encoding::Bf16);
            }
            worker.receive(s, &f).unwrap();
        }
        if worker.ready() {
            worker.step().unwrap();
            worker.observe_compute(0.001);
        } else if worker.is_done() {
            break;
        }
    }
    let st = worker.stats();
    assert_eq!(hellos, 2);
    assert_eq!(st.steps, 12);
    assert_eq!(st.local_steps, 4);
    assert_eq!(
        st.encodings,
        Some(("bf16".to_string(), "int8_block".to_string()))
    );
    assert_eq!((pushes, st.pushes_accepted, st.pushes_rejected), (6, 6, 0));
    assert!(params >= 6, "{params} parameter frames");
    // The shards moved, and stayed finite.
    let after: Vec<f32> = shards
        .iter()
        .flat_map(|(s, _)| s.values().iter().copied())
        .collect();
    assert!(after.iter().all(|v| v.is_finite()));
    assert_ne!(after, init);
    assert_eq!(
        shards.iter().map(|(s, _)| s.version()).collect::<Vec<_>>(),
        vec![3, 3]
    );
}
