//! Micro-benchmark of the payload encodings on a vector the size of the MLP 784-128-10
//! (101,770 values): ns per value to encode, decode, and encode with error feedback, and the
//! payload size relative to f32.
//!
//! Run: `cargo run --release -p crowdgrad-core --example codec_bench [-- ROUNDS]`
//!
//! Each figure is the median of ROUNDS (default 200) timed calls on warm buffers, so it
//! measures the loops, not the allocator. A tool, not a test: the figures vary with the
//! machine and its load.

use crowdgrad_core::codec::{Encoding, ErrorFeedback};
use crowdgrad_core::rng::Rng;
use std::hint::black_box;
use std::time::Instant;

const N: usize = 101_770;

fn median_ns_per_value(rounds: usize, mut f: impl FnMut()) -> f64 {
    f(); // warm the buffers
    let mut t: Vec<f64> = (0..rounds)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_nanos() as f64 / N as f64
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn main() {
    let rounds = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(200usize)
        .max(1);
    // Gradient-like values: normal, scaled, with the occasional outlier.
    let mut rng = Rng::new(8);
    let grad: Vec<f32> = (0..N)
        .map(|i| {
            let g = rng.normal() as f32 * 1e-3;
            if i % 997 == 0 {
                g * 30.0
            } else {
                g
            }
        })
        .collect();

    println!("{N} values, median of {rounds} rounds");
    println!(
        "{:<16} {:>9} {:>8} {:>12} {:>12} {:>12}",
        "encoding", "bytes", "of f32", "encode ns/v", "decode ns/v", "enc+EF ns/v"
    );
    for enc in [
        Encoding::F32,
        Encoding::Bf16,
        Encoding::INT8,
        Encoding::Int8Block { block: 64 },
    ] {
        let mut bytes = Vec::with_capacity(enc.encoded_len(N));
        let mut out = vec![0.0f32; N];
        let mut ef = ErrorFeedback::new(N);
        let encode = median_ns_per_value(rounds, || {
            bytes.clear();
            enc.encode(black_box(&grad), &mut bytes).expect("finite");
        });
        let payload = bytes.clone();
        let decode = median_ns_per_value(rounds, || {
            enc.decode(black_box(&payload), &mut out).expect("valid");
            black_box(&out);
        });
        let feedback = median_ns_per_value(rounds, || {
            bytes.clear();
            ef.encode_with_feedback(black_box(&grad), enc, &mut bytes)
                .expect("finite");
        });
        println!(
            "{:<16} {:>9} {:>7.1}% {:>12.3} {:>12.3} {:>12.3}",
            enc.to_string(),
            payload.len(),
            100.0 * payload.len() as f64 / (4 * N) as f64,
            encode,
            decode,
            feedback
        );
    }
}
