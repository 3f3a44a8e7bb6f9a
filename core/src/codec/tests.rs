//! Tests of [`super`] (codec.rs).

use super::*;
use proptest::prelude::*;

/// Found by fuzz/ (`payload`): the code byte 0x80 (-128), which the encoder never writes,
/// times a scale near [`MAX_INT8_SCALE`] decoded to -infinity. It is refused now.
#[test]
fn regression_int8_code_minus_128_is_refused() {
    let mut bytes = MAX_INT8_SCALE.to_le_bytes().to_vec();
    bytes.extend([0x80, 0x7f]);
    let mut out = [0.0f32; 2];
    assert!(matches!(
        Encoding::Int8Block { block: 2 }.decode(&bytes, &mut out),
        Err(Error::Malformed(_))
    ));
    bytes[4] = 0x81; // -127: the most negative code, finite
    Encoding::Int8Block { block: 2 }
        .decode(&bytes, &mut out)
        .expect("decodes");
    assert!(out.iter().all(|v| v.is_finite()));
}

const ALL: [Encoding; 5] = [
    Encoding::F32,
    Encoding::Bf16,
    Encoding::INT8,
    Encoding::Int8Block { block: 1 },
    Encoding::Int8Block { block: 7 },
];

fn round_trip(enc: Encoding, values: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = Vec::new();
    enc.encode(values, &mut bytes)
        .expect("finite input encodes");
    assert_eq!(bytes.len(), enc.encoded_len(values.len()));
    let mut out = vec![0.0; values.len()];
    enc.decode(&bytes, &mut out).expect("own output decodes");
    (bytes, out)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The worked examples of docs/protocol.md, byte for byte.
#[test]
fn worked_examples_match_protocol_md() {
    let values = [1.0f32, -0.5, std::f32::consts::PI, 0.0];
    let (b, _) = round_trip(Encoding::F32, &values);
    assert_eq!(hex(&b), "0000803f000000bfdb0f494000000000");
    let (b, out) = round_trip(Encoding::Bf16, &values);
    assert_eq!(hex(&b), "803f00bf49400000");
    assert_eq!(out, [1.0, -0.5, 3.140625, 0.0]);
    // Ties go to even.
    let ties = [f32::from_bits(0x3f80_8000), f32::from_bits(0x3f81_8000)];
    let (b, _) = round_trip(Encoding::Bf16, &ties);
    assert_eq!(hex(&b), "803f823f");

    let values = [1.0f32, -0.4, 0.25, 2.54, 0.1];
    let enc = Encoding::Int8Block { block: 3 };
    let (b, out) = round_trip(enc, &values);
    assert_eq!(hex(&b), concat!("0402013c", "0ad7a33c", "7fcd20", "7f05"));
    let s0 = 1.0f32 / 127.0;
    let s1 = 2.54f32 / 127.0;
    assert_eq!(
        out,
        [127.0 * s0, -51.0 * s0, 32.0 * s0, 127.0 * s1, 5.0 * s1]
    );
}

#[test]
fn names_ids_and_serde() {
    let json = serde_json::to_string(&ALL).expect("serializes");
    assert_eq!(
        json,
        r#"["f32","bf16","int8_block",{"int8_block":{"block":1}},{"int8_block":{"block":7}}]"#
    );
    let back: Vec<Encoding> = serde_json::from_str(&json).expect("deserializes");
    assert_eq!(back, ALL);
    let explicit: Encoding =
        serde_json::from_str(r#"{"int8_block":{"block":256}}"#).expect("explicit form");
    assert_eq!(explicit, Encoding::INT8);
    for bad in [
        r#"{"int8_block":{"block":0}}"#,
        r#""int4""#,
        r#"{"f32":{}}"#,
        "3",
    ] {
        assert!(serde_json::from_str::<Encoding>(bad).is_err(), "{bad}");
    }
    for e in ALL {
        assert_eq!(Encoding::from_id(e.id(), 7).map(|d| d.id()), Ok(e.id()));
        assert_eq!(
            e.name(),
            serde_json::to_value(Repr::from(e)).map_or("?".into(), |v| {
                v.as_str()
                    .map_or_else(|| "int8_block".to_string(), str::to_string)
            })
        );
    }
    assert_eq!(
        Encoding::from_id(2, 64),
        Ok(Encoding::Int8Block { block: 64 })
    );
    assert!(Encoding::from_id(2, 0).is_err());
    assert!(Encoding::from_id(3, 64).is_err());
    assert_eq!(Encoding::default(), Encoding::F32);
    assert_eq!(Encoding::INT8.to_string(), "int8_block(256)");
}

#[test]
fn hello_lists_skip_unknown_encodings() {
    #[derive(Deserialize)]
    struct Hello {
        #[serde(default, deserialize_with = "known_encodings")]
        encodings: Vec<Encoding>,
    }
    let h: Hello = serde_json::from_str(r#"{"encodings":["int4","bf16",{"zstd":1},"int8_block"]}"#)
        .expect("lenient");
    assert_eq!(h.encodings, [Encoding::Bf16, Encoding::INT8]);
    let old: Hello = serde_json::from_str("{}").expect("old worker");
    assert!(old.encodings.is_empty());
}

#[test]
fn negotiation_falls_back_to_f32() {
    let prefs = [Encoding::Int8Block { block: 128 }, Encoding::Bf16];
    assert_eq!(Encoding::negotiate(&[], &prefs), Encoding::F32);
    assert_eq!(
        Encoding::negotiate(&[Encoding::F32, Encoding::Bf16], &prefs),
        Encoding::Bf16
    );
    assert_eq!(
        Encoding::negotiate(&[Encoding::INT8, Encoding::Bf16], &prefs),
        Encoding::Int8Block { block: 128 }
    );
    assert_eq!(Encoding::negotiate(&[Encoding::INT8], &[]), Encoding::F32);
}

/// The issue's target: int8 push bytes at most 27% of f32, for a shard of the MLP.
#[test]
fn int8_default_block_meets_issue_8_byte_target() {
    for n in [50_885usize, 50_886, 101_770] {
        let ratio = Encoding::INT8.encoded_len(n) as f64 / Encoding::F32.encoded_len(n) as f64;
        assert!(ratio <= 0.255, "{n}: {ratio}");
    }
    // (4 + B) / (4B) <= 0.27  <=>  B >= 50.
    let ratio = |b: u32| {
        let e = Encoding::Int8Block { block: b };
        e.encoded_len(b as usize * 1000) as f64 / (b as f64 * 4000.0)
    };
    assert!(ratio(50) <= 0.27 && ratio(49) > 0.27);
}

#[test]
fn lengths_invert() {
    for e in ALL {
        for n in 0..600 {
            assert_eq!(e.decoded_len(e.encoded_len(n)), Some(n), "{e} {n}");
        }
    }
    let e = Encoding::Int8Block { block: 3 };
    let valid: Vec<usize> = (0..20).filter_map(|b| e.decoded_len(b)).collect();
    // 0, 5, 6, 7, then 12, 13, 14, then 19 bytes.
    assert_eq!(valid, [0, 1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(e.decoded_len(5), Some(1));
    assert_eq!(e.decoded_len(4), None);
    assert_eq!(Encoding::Bf16.decoded_len(3), None);
    let zero = Encoding::Int8Block { block: 0 };
    assert_eq!(zero.encoded_len(10), usize::MAX);
    assert_eq!(zero.decoded_len(10), None);
    assert_eq!(Encoding::INT8.encoded_len(usize::MAX), usize::MAX);
    assert_eq!(
        Encoding::Int8Block { block: u32::MAX }.decoded_len(usize::MAX),
        Some(usize::MAX - 4 * usize::MAX.div_ceil(u32::MAX as usize + 4))
    );
}

#[test]
fn wrong_lengths_are_reported() {
    let mut out = [0.0f32; 4];
    assert_eq!(
        Encoding::F32.decode(&[0; 12], &mut out),
        Err(Error::WrongLength {
            expected: 4,
            got: 3
        })
    );
    assert!(matches!(
        Encoding::F32.decode(&[0; 15], &mut out),
        Err(Error::Malformed(_))
    ));
    assert!(matches!(
        Encoding::INT8.decode(&[0; 3], &mut out),
        Err(Error::Malformed(_))
    ));
    assert_eq!(
        Encoding::INT8.decode(&[0; 7], &mut out),
        Err(Error::WrongLength {
            expected: 4,
            got: 3
        })
    );
    assert!(Encoding::Int8Block { block: 0 }
        .decode(&[], &mut [])
        .is_err());
    assert!(Encoding::Int8Block { block: 0 }
        .encode(&[], &mut Vec::new())
        .is_err());
}

#[test]
fn non_finite_values_and_bad_scales_are_rejected() {
    let mut out = [0.0f32; 3];
    // f32: a NaN at index 2.
    let mut b = Vec::new();
    for v in [1.0f32, 2.0, f32::NAN] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    assert!(matches!(
        Encoding::F32.decode(&b, &mut out),
        Err(Error::NotFinite { index: 2, .. })
    ));
    // bf16: +inf (0x7f80) at index 1.
    let b = [0x80, 0x3f, 0x80, 0x7f, 0, 0];
    assert!(matches!(
        Encoding::Bf16.decode(&b, &mut out),
        Err(Error::NotFinite { index: 1, .. })
    ));
    // int8: one block of 3, scale NaN, negative, +inf, too large; 0 and the max are fine.
    for (scale, ok) in [
        (f32::NAN, false),
        (-f32::NAN, false),
        (-1e-3, false),
        (f32::INFINITY, false),
        (f32::from_bits(MAX_INT8_SCALE.to_bits() + 1), false),
        (MAX_INT8_SCALE, true),
        (0.0, true),
        (-0.0, true),
    ] {
        let mut b = scale.to_le_bytes().to_vec();
        b.extend_from_slice(&[0x81, 0x7f, 0]);
        let r = Encoding::Int8Block { block: 3 }.decode(&b, &mut out);
        assert_eq!(r.is_ok(), ok, "{scale}: {r:?}");
        if ok {
            assert!(out.iter().all(|v| v.is_finite()));
        } else {
            assert!(matches!(r, Err(Error::Malformed(_))));
        }
    }
    assert!((MAX_INT8_SCALE * 127.0).is_finite());
    assert!((f32::from_bits(MAX_INT8_SCALE.to_bits() + 1) * 127.0).is_infinite());
}

#[test]
fn encoders_reject_non_finite_and_leave_out_unchanged() {
    for e in ALL {
        for bad in [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let values = [0.5f32, 1.0, 2.0, bad, 3.0];
            let mut out = vec![9u8; 3];
            assert!(
                matches!(
                    e.encode(&values, &mut out),
                    Err(Error::NotFinite { index: 3, .. })
                ),
                "{e} {bad}"
            );
            assert_eq!(out, [9, 9, 9]);
        }
    }
    // Finite, but rounds to bf16 infinity.
    assert!(Encoding::Bf16.encode(&[f32::MAX], &mut Vec::new()).is_err());
    assert!(Encoding::Bf16
        .encode(&[f32::from_bits(0x7f7f_8000)], &mut Vec::new())
        .is_err());
    assert!(Encoding::Bf16
        .encode(&[f32::from_bits(0x7f7f_7fff)], &mut Vec::new())
        .is_ok());
    // int8 handles the whole finite range.
    let (_, out) = round_trip(Encoding::INT8, &[f32::MAX, -f32::MAX, 1.0]);
    assert!(out.iter().all(|v| v.is_finite()));
}

#[test]
fn encoders_append() {
    let mut out = vec![0xaa];
    Encoding::Bf16.encode(&[1.0], &mut out).expect("encodes");
    Encoding::INT8.encode(&[2.0], &mut out).expect("encodes");
    assert_eq!(hex(&out), "aa803f".to_string() + "0402813c" + "7f");
}

#[test]
fn int8_tiny_and_zero_blocks() {
    let tiny = [f32::from_bits(1), -f32::from_bits(3), 0.0];
    let (_, out) = round_trip(Encoding::Int8Block { block: 3 }, &tiny);
    assert_eq!(out, [0.0, 0.0, 0.0]);
    let sub = [1e-40f32, -5e-41, 2e-41];
    let (b, out) = round_trip(Encoding::Int8Block { block: 3 }, &sub);
    let s = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (x, y) in sub.iter().zip(&out) {
        assert!((x - y).abs() <= s, "{x} {y} {s}");
    }
    let (_, out) = round_trip(Encoding::INT8, &[0.0; 300]);
    assert_eq!(out, [0.0; 300]);
    // Found by proptest: a subnormal scale is coarse (here 66 * 2^-149), so 127 codes of it
    // miss the max by more than half a scale, but by less than 127 * 2^-150.
    let (_, out) = round_trip(Encoding::Int8Block { block: 1 }, &[1.1828e-41]);
    assert!((f64::from(out[0]) - 1.1828e-41).abs() < 127.0 * 2f64.powi(-150));
}

/// Found by proptest: bf16 subnormals are exact to half a bf16 subnormal ulp (2^-134).
#[test]
fn bf16_subnormals() {
    let (b, out) = round_trip(Encoding::Bf16, &[-1.609885e-39, f32::from_bits(1)]);
    assert_eq!(hex(&b), "12800000");
    assert!((f64::from(out[0]) + 1.609885e-39).abs() <= 2f64.powi(-134));
    assert_eq!(out[1], 0.0);
}

/// The fused int8 error feedback gives the bytes and the residual, bit for bit, of
/// correct + encode + decode + subtract (what it replaced), over several pushes and blocks
/// of every kind: full, partial, zero, subnormal scale; an error changes nothing.
#[test]
fn int8_feedback_fused_matches_encode_decode_subtract() {
    let mut rng = crate::rng::Rng::new(11);
    for block in [1u32, 3, 256] {
        let enc = Encoding::Int8Block { block };
        let n = 2 * 256 + 77;
        let mut fused = ErrorFeedback::new(n);
        let mut reference = vec![0.0f32; n];
        for push in 0..4 {
            let mut grad: Vec<f32> = (0..n).map(|_| rng.normal() as f32 * 0.01).collect();
            grad[..256].fill(0.0);
            grad[256..259].copy_from_slice(&[1e-40, -5e-41, 2e-41]);
            if push == 3 {
                grad[300] = 1e30;
            }
            let mut out = vec![0x5a];
            fused
                .encode_with_feedback(&grad, enc, &mut out)
                .expect("encodes");
            let corrected: Vec<f32> = grad.iter().zip(&reference).map(|(g, r)| g + r).collect();
            let mut want = vec![0x5a];
            enc.encode(&corrected, &mut want).expect("encodes");
            assert_eq!(out, want, "block {block} push {push}");
            let mut decoded = vec![0.0; n];
            enc.decode(&want[1..], &mut decoded).expect("decodes");
            for (r, (c, d)) in reference.iter_mut().zip(corrected.iter().zip(&decoded)) {
                *r = c - d;
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(fused.residual()), bits(&reference));
        }
        let before = fused.residual().to_vec();
        let mut grad = vec![0.5f32; n];
        grad[n - 1] = f32::NAN;
        let mut out = vec![7u8];
        assert!(matches!(
            fused.encode_with_feedback(&grad, enc, &mut out),
            Err(Error::NotFinite { index, .. }) if index == n - 1
        ));
        assert_eq!(out, [7]);
        assert_eq!(fused.residual(), &before[..]);
    }
}

/// With int8, a coordinate far below its block's scale rounds to 0 on every push; error
/// feedback accumulates it until it is sent, so the shard sees the right sum.
#[test]
fn error_feedback_delivers_small_coordinates() {
    let grad = [1.0f32, 0.001];
    let enc = Encoding::Int8Block { block: 2 };
    let mut plain = [0.0f64; 2];
    let mut fed = [0.0f64; 2];
    let mut ef = ErrorFeedback::new(2);
    let mut bytes = Vec::new();
    let mut out = [0.0f32; 2];
    for _ in 0..1000 {
        bytes.clear();
        enc.encode(&grad, &mut bytes).expect("encodes");
        enc.decode(&bytes, &mut out).expect("decodes");
        plain[1] += f64::from(out[1]);
        bytes.clear();
        ef.encode_with_feedback(&grad, enc, &mut bytes)
            .expect("encodes");
        enc.decode(&bytes, &mut out).expect("decodes");
        fed[0] += f64::from(out[0]);
        fed[1] += f64::from(out[1]);
    }
    assert_eq!(plain[1], 0.0);
    assert!((fed[1] - 1.0).abs() < 0.01, "{fed:?}");
    assert!((fed[0] - 1000.0).abs() < 0.01, "{fed:?}");
    ef.reset();
    assert_eq!(ef.residual(), [0.0, 0.0]);
}

#[test]
fn error_feedback_errors_leave_state_unchanged() {
    let mut ef = ErrorFeedback::new(3);
    let mut out = Vec::new();
    ef.encode_with_feedback(&[0.3, 0.001, -0.2], Encoding::INT8, &mut out)
        .expect("encodes");
    let (before, len) = (ef.residual().to_vec(), out.len());
    assert!(matches!(
        ef.encode_with_feedback(&[0.0, f32::NAN, 0.0], Encoding::INT8, &mut out),
        Err(Error::NotFinite { index: 1, .. })
    ));
    assert!(matches!(
        ef.encode_with_feedback(&[0.0; 4], Encoding::INT8, &mut out),
        Err(Error::WrongLength {
            expected: 3,
            got: 4
        })
    ));
    assert_eq!((ef.residual(), out.len()), (&before[..], len));
    let mut ef = ErrorFeedback::new(2);
    ef.encode_with_feedback(&[0.25, 1e-9], Encoding::F32, &mut out)
        .expect("encodes");
    assert_eq!(ef.residual(), [0.0, 0.0]);
}

fn finite() -> impl Strategy<Value = f32> {
    prop_oneof![
        -1e3f32..1e3,
        -1e-3f32..1e-3,
        any::<f32>().prop_filter("finite", |v| v.is_finite()),
        Just(0.0f32),
    ]
}

fn block() -> impl Strategy<Value = u32> {
    prop_oneof![1u32..40, Just(256u32), 200u32..300]
}

proptest! {
    #[test]
    fn bf16_round_trip_within_2_pow_minus_8(values in prop::collection::vec(finite(), 0..600)) {
        // Finite inputs too large for bf16 are rejected, not rounded: skip them here.
        let values: Vec<f32> = values.into_iter().filter(|v| v.abs() < 3.38e38).collect();
        let (_, out) = round_trip(Encoding::Bf16, &values);
        for (x, y) in values.iter().zip(&out) {
            // Relative 2^-8 for normal values (half an ulp of an 8-bit significand);
            // subnormals within half a bf16 subnormal ulp, 2^-134. In f64: 2f32.powi(-134)
            // is computed as 1/2^134, which overflows f32 and gives 0.
            let tol = f64::from(x.abs()) * 2f64.powi(-8) + 2f64.powi(-134);
            let err = (f64::from(*x) - f64::from(*y)).abs();
            prop_assert!(err <= tol, "{} -> {}", x, y);
            prop_assert!(x.signum() == y.signum() || *y == 0.0);
        }
    }

    #[test]
    fn int8_round_trip_within_half_a_scale(
        values in prop::collection::vec(finite(), 0..1500),
        block in block(),
    ) {
        let enc = Encoding::Int8Block { block };
        let (bytes, out) = round_trip(enc, &values);
        let n_blocks = values.len().div_ceil(block as usize);
        prop_assert_eq!(bytes.len(), 4 * n_blocks + values.len());
        let blocks = values.chunks(block as usize).zip(out.chunks(block as usize));
        for (b, (x, y)) in blocks.enumerate() {
            let s = f32::from_le_bytes(bytes[4 * b..4 * b + 4].try_into().expect("4 bytes"));
            let m = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            prop_assert!((0.0..=MAX_INT8_SCALE).contains(&s));
            prop_assert!(s == (m / 127.0).min(MAX_INT8_SCALE));
            for (x, y) in x.iter().zip(y) {
                let err = f64::from(*x) - f64::from(*y);
                // Half a scale, plus f32 rounding of x/scale and of q*scale. A subnormal
                // scale (max below 1.5e-36) is itself off by up to half of 2^-149, which
                // 127 codes multiply: 127 * 2^-150 < 1e-43 more.
                let tol = f64::from(s) * (0.5 + 1e-5) + f64::from(y.abs()) * 1.2e-7 + 1e-43;
                prop_assert!(err.abs() <= tol, "{} -> {} (scale {})", x, y, s);
            }
        }
    }

    #[test]
    fn f32_round_trip_is_exact(values in prop::collection::vec(finite(), 0..600)) {
        let (bytes, out) = round_trip(Encoding::F32, &values);
        prop_assert_eq!(bytes.len(), 4 * values.len());
        prop_assert_eq!(out, values);
    }

    #[test]
    fn decoders_never_panic(
        bytes in prop::collection::vec(any::<u8>(), 0..1200),
        n in 0usize..1200,
        enc in prop_oneof![
            Just(Encoding::F32),
            Just(Encoding::Bf16),
            any::<u32>().prop_map(|block| Encoding::Int8Block { block }),
            (0u32..300).prop_map(|block| Encoding::Int8Block { block }),
        ],
    ) {
        let mut out = vec![0.0f32; n];
        let r = enc.decode(&bytes, &mut out);
        if r.is_ok() {
            prop_assert_eq!(bytes.len(), enc.encoded_len(n));
            prop_assert!(out.iter().all(|v| v.is_finite()));
        }
        // Also with the length that fits: the value and scale checks run.
        if let Some(m) = enc.decoded_len(bytes.len()) {
            let mut out = vec![0.0f32; m];
            if enc.decode(&bytes, &mut out).is_ok() {
                prop_assert!(out.iter().all(|v| v.is_finite()));
            }
        }
    }

    #[test]
    fn int8_non_finite_or_negative_scales_are_rejected(
        values in prop::collection::vec(-1.0f32..1.0, 1..600),
        block in block(),
        pick in any::<prop::sample::Index>(),
        bad in prop_oneof![
            Just(f32::NAN), Just(f32::INFINITY), Just(f32::NEG_INFINITY),
            -1e30f32..-1e-30, 2.7e36f32..f32::MAX,
        ],
    ) {
        let enc = Encoding::Int8Block { block };
        let mut bytes = Vec::new();
        enc.encode(&values, &mut bytes).expect("encodes");
        let b = pick.index(values.len().div_ceil(block as usize));
        bytes[4 * b..4 * b + 4].copy_from_slice(&bad.to_le_bytes());
        let mut out = vec![0.0f32; values.len()];
        prop_assert!(matches!(enc.decode(&bytes, &mut out), Err(Error::Malformed(_))));
    }

    #[test]
    fn error_feedback_tracks_the_sum_of_gradients(
        seed in any::<u64>(),
        n in 1usize..300,
        enc in prop_oneof![
            Just(Encoding::Bf16),
            block().prop_map(|block| Encoding::Int8Block { block }),
        ],
    ) {
        let mut rng = crate::rng::Rng::new(seed);
        let mut ef = ErrorFeedback::new(n);
        let mut sum_true = vec![0.0f64; n];
        let mut sum_sent = vec![0.0f64; n];
        let mut grad = vec![0.0f32; n];
        let mut decoded = vec![0.0f32; n];
        let mut bytes = Vec::new();
        let steps = 200;
        for _ in 0..steps {
            // Heavy-tailed gradients of mixed magnitude: the hard case for block scales.
            for g in grad.iter_mut() {
                let u = (rng.next_f64() as f32) * 2.0 - 1.0;
                *g = u * u * u * if (rng.next_f64() as f32) < 0.05 { 10.0 } else { 0.1 };
            }
            bytes.clear();
            ef.encode_with_feedback(&grad, enc, &mut bytes).expect("encodes");
            enc.decode(&bytes, &mut decoded).expect("decodes");
            for i in 0..n {
                sum_true[i] += f64::from(grad[i]);
                sum_sent[i] += f64::from(decoded[i]);
            }
            // The residual stays bounded: at most half a scale of a block whose values are
            // at most |g| + residual <= 10 + small, so 10/254 + slack.
            prop_assert!(ef.residual().iter().all(|r| r.abs() <= 0.05), "{:?}", ef.residual());
        }
        // Telescoping: sum sent = sum true - final residual (up to f32 rounding per step).
        for i in 0..n {
            let gap = sum_true[i] - sum_sent[i] - f64::from(ef.residual()[i]);
            prop_assert!(gap.abs() <= 1e-4, "coordinate {}: gap {}", i, gap);
            prop_assert!((sum_true[i] - sum_sent[i]).abs() <= 0.05);
        }
    }
}
