//! Tests of [`super`] (model.rs).

use super::*;
use ndarray::Array2;

fn toy_batch(rows: usize, cols: usize, classes: usize, seed: u64) -> (Array2<f32>, Vec<u8>) {
    let mut r = Rng::new(seed);
    let x = Array2::from_shape_fn((rows, cols), |_| r.normal() as f32);
    let y = (0..rows).map(|_| r.below(classes as u64) as u8).collect();
    (x, y)
}

/// Which side of every kink the batch sits on: ReLU signs and max-pool winners.
fn kinks(model: &Model, ws: &Workspace, b: usize) -> Vec<u32> {
    let mut sig = Vec::new();
    for (i, st) in model.stages.iter().enumerate() {
        if st.relu {
            sig.extend(
                ws.acts[i][..b * st.out_len]
                    .iter()
                    .map(|&v| u32::from(v > 0.0)),
            );
        }
        if matches!(st.op, Op::Pool { g } if g.max) {
            sig.extend_from_slice(&ws.argmax[i][..b * st.out_len]);
        }
    }
    sig
}

/// Central differences against the analytic gradient, for every parameter. The loss is
/// piecewise smooth: a perturbation that flips a ReLU or a max-pool winner crosses a kink
/// and the difference is meaningless there, so such parameters are skipped (and counted).
fn finite_difference_check(spec: ModelSpec) {
    finite_difference_check_h(spec, 1e-2);
}

fn finite_difference_check_h(spec: ModelSpec, h: f32) {
    let model = Model::new(spec).unwrap();
    let mut params = model.init_params(3);
    // Non-zero biases so every path is exercised.
    let mut r = Rng::new(9);
    for t in model
        .layout()
        .tensors
        .iter()
        .filter(|t| t.name.ends_with("bias"))
    {
        for v in &mut params[t.offset..t.offset + t.len()] {
            *v = (r.normal() * 0.1) as f32;
        }
    }
    let (x, y) = toy_batch(5, model.spec().inputs, model.spec().classes, 4);
    let mut ws = model.workspace(8);
    let mut grad = vec![0.0; params.len()];
    let seed = 77;
    model
        .loss_and_grad_seeded(&params, x.view(), &y, seed, &mut grad, &mut ws)
        .unwrap();
    let mut scratch = vec![0.0; params.len()];
    let mut eval = |p: &[f32], ws: &mut Workspace| -> (f64, Vec<u32>) {
        let l = model
            .loss_and_grad_seeded(p, x.view(), &y, seed, &mut scratch, ws)
            .unwrap()
            .mean_loss();
        (l, kinks(&model, ws, x.nrows()))
    };
    let (_, base) = eval(&params, &mut ws);
    let mut worst = 0.0f64;
    let mut skipped = 0;
    for i in 0..params.len() {
        let mut p = params.clone();
        p[i] += h;
        let (up, k_up) = eval(&p, &mut ws);
        p[i] -= 2.0 * h;
        let (down, k_down) = eval(&p, &mut ws);
        if k_up != base || k_down != base {
            skipped += 1;
            continue;
        }
        let numeric = (up - down) / (2.0 * h as f64);
        let err =
            (numeric - grad[i] as f64).abs() / (numeric.abs() + grad[i].abs() as f64).max(1e-2);
        worst = worst.max(err);
    }
    assert!(
        skipped * 4 < params.len(),
        "{skipped} of {} parameters sit on a kink",
        params.len()
    );
    assert!(
        worst < 2e-2,
        "{}: worst relative error {worst}",
        model.spec()
    );
    // And the gradient is not trivially zero.
    assert!(grad.iter().any(|&g| g.abs() > 1e-4));
}

fn shaped(text: &str, shape: &[usize], classes: usize) -> ModelSpec {
    ModelSpec::parse_shaped(text, shape, classes).unwrap()
}

#[test]
fn softmax_gradient_matches_finite_differences() {
    finite_difference_check(ModelSpec::parse("softmax", 6, 4).unwrap());
}

#[test]
fn mlp_gradient_matches_finite_differences() {
    finite_difference_check(ModelSpec::parse("mlp:7", 6, 3).unwrap());
    finite_difference_check(ModelSpec::parse("mlp:5,4", 6, 3).unwrap());
}

#[test]
fn conv_with_padding_and_max_pool_match_finite_differences() {
    finite_difference_check(shaped("conv:3x3x3/p1,pool:2,dense:5", &[7, 6, 2], 3));
}

#[test]
fn strided_conv_avg_pool_and_dropout_match_finite_differences() {
    finite_difference_check(shaped(
        "conv:2x3x3/s2p1,avgpool:2,dense:4,dropout:0.4",
        &[6, 6],
        3,
    ));
}

#[test]
fn stacked_convs_rectangular_kernels_and_overlapping_pools_match_finite_differences() {
    // The second convolution and the pools need input gradients (col2im, pool backward).
    // Overlapping max-pool windows put many winners near a tie: a smaller step.
    finite_difference_check_h(
        shaped(
            "conv:3x2x3,conv:2x3x3/p1,avgpool:2/s1,pool:2/s1,flatten,dropout:0.2",
            &[5, 6, 3],
            3,
        ),
        2e-3,
    );
    // A pool first: the first stage has no parameters and no input gradient.
    finite_difference_check(shaped("pool:2,conv:2x2x2,dense:3", &[6, 6, 2], 4));
}

#[test]
fn mlp_layout_and_text_are_unchanged() {
    let s = ModelSpec::parse("mlp:128", 784, 10).unwrap();
    assert_eq!(s.param_len(), 784 * 128 + 128 + 128 * 10 + 10);
    let l = s.layout();
    let names: Vec<&str> = l.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "layer0.weight",
            "layer0.bias",
            "layer1.weight",
            "layer1.bias"
        ]
    );
    assert_eq!(l.get("layer1.weight").unwrap().offset, 784 * 128 + 128);
    assert_eq!(l.get("layer1.weight").unwrap().shape, [128, 10]);
    assert_eq!(s.to_string(), "mlp 784-128-10");
    assert_eq!(s.mlp_widths(), Some(vec![128]));
    assert_eq!(ModelSpec::parse("dense:128", 784, 10).unwrap(), s);
    let soft = ModelSpec::parse("softmax", 784, 10).unwrap();
    assert_eq!(soft.to_string(), "softmax 784-10");
    assert_eq!(soft.layers, [Layer::Dense { units: 10 }]);
    assert!(ModelSpec::parse("mlp:", 784, 10).is_err());
    assert!(ModelSpec::parse("mlp:0", 784, 10).is_err());
    assert!(ModelSpec::parse("softmax", 784, 1).is_err());
}

#[test]
fn cnn_layout_names_shapes_and_offsets() {
    let s = shaped("cnn", &[28, 28], 10);
    assert_eq!(s.layers_text(), CNN);
    assert_eq!(s.to_string(), format!("{CNN} 28x28x1-10"));
    let l = s.layout();
    let got: Vec<(&str, Vec<usize>, usize)> = l
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t.shape.clone(), t.offset))
        .collect();
    let c1 = 5 * 5 * 16;
    let c2 = 5 * 5 * 16 * 32;
    let d1 = 4 * 4 * 32 * 128;
    assert_eq!(
        got,
        [
            ("layer0.weight", vec![5, 5, 1, 16], 0),
            ("layer0.bias", vec![16], c1),
            ("layer1.weight", vec![5, 5, 16, 32], c1 + 16),
            ("layer1.bias", vec![32], c1 + 16 + c2),
            ("layer2.weight", vec![512, 128], c1 + 16 + c2 + 32),
            ("layer2.bias", vec![128], c1 + 16 + c2 + 32 + d1),
            ("layer3.weight", vec![128, 10], c1 + 16 + c2 + 32 + d1 + 128),
            ("layer3.bias", vec![10], c1 + 16 + c2 + 32 + d1 + 128 + 1280),
        ]
    );
    assert_eq!(s.param_len(), c1 + 16 + c2 + 32 + d1 + 128 + 1280 + 10);
    // Flat 784 is read as 28x28 by `parse`, so the flag checks accept a CNN.
    assert_eq!(ModelSpec::parse("cnn", 784, 10).unwrap(), s);
    let m = Model::new(s).unwrap();
    assert_eq!(
        m.stage_names(),
        [
            "conv:16x5x5+relu",
            "pool:2",
            "conv:32x5x5+relu",
            "pool:2",
            "dense:128+relu",
            "dense:10"
        ]
    );
}

#[test]
fn the_grammar() {
    let s = shaped(
        "conv:8x3x5/s2/p1,maxpool:3/s2,avgpool:2,dense:16,dropout:0.5",
        &[32, 32, 3],
        10,
    );
    assert_eq!(
        s.layers,
        [
            Layer::Conv {
                filters: 8,
                kernel: [3, 5],
                stride: 2,
                padding: 1
            },
            Layer::Relu,
            Layer::MaxPool { size: 3, stride: 2 },
            Layer::AvgPool { size: 2, stride: 2 },
            Layer::Dense { units: 16 },
            Layer::Relu,
            Layer::Dropout { rate: 0.5 },
            Layer::Dense { units: 10 },
        ]
    );
    assert_eq!(
        s.layers_text(),
        "conv:8x3x5/s2/p1,pool:3/s2,avgpool:2,dense:16,dropout:0.5"
    );
    // The canonical text parses back to the same spec.
    assert_eq!(shaped(&s.layers_text(), &[32, 32, 3], 10), s);
    assert_eq!(
        shaped(
            "conv:8x3x5/s2p1,maxpool:3/s2,avgpool:2,dense:16,dropout:0.5",
            &[32, 32, 3],
            10
        ),
        s
    );
    assert_eq!(
        shaped("conv:4x3", &[8, 8], 2).layers[0],
        Layer::Conv {
            filters: 4,
            kernel: [3, 3],
            stride: 1,
            padding: 0
        }
    );
}

fn refusal(text: &str, shape: &[usize]) -> String {
    match ModelSpec::parse_shaped(text, shape, 10) {
        Ok(s) => panic!("{text} on {shape:?} was accepted as {s}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_specs_name_the_layer_and_the_shape() {
    let cases: [(&str, &[usize], &[&str]); 12] = [
        (
            "conv:8x5x5",
            &[4, 4],
            &["layer 0 (conv:8x5x5)", "4x4x1", "5x5 kernel"],
        ),
        (
            "conv:8x5x5,pool:2,conv:16x5x5,pool:2,conv:32x5x5",
            &[28, 28],
            &["layer 6 (conv:32x5x5)", "4x4x16"],
        ),
        (
            "dense:10,conv:4x3x3",
            &[28, 28],
            &["layer 2 (conv:4x3x3)", "a vector"],
        ),
        ("pool:2", &[784], &["layer 0 (pool:2)", "784"]),
        ("pool:5", &[4, 4, 2], &["4x4x2", "5x5 window"]),
        ("conv:4x3x3/p3", &[8, 8], &["padding 3"]),
        ("cnv:4x3", &[8, 8], &["\"cnv:4x3\"", "unknown layer"]),
        ("conv:4", &[8, 8], &["FILTERSxK"]),
        ("conv:4x3/q2", &[8, 8], &["unknown option"]),
        ("dropout:1.5", &[8, 8], &["outside [0, 1)"]),
        ("relu,dense:4", &[8, 8], &["implied"]),
        ("dense:4,dropout:0.1,dropout:0.2", &[8], &["two dropouts"]),
    ];
    for (text, shape, needles) in cases {
        let msg = refusal(text, shape);
        for n in needles {
            assert!(msg.contains(n), "{text}: {msg:?} lacks {n:?}");
        }
    }
    assert!(ModelSpec::parse_shaped("cnn", &[28, 28, 1, 1], 10).is_err());
    assert!(ModelSpec::parse_shaped("dense:65537", &[8], 10).is_err());
    assert!(ModelSpec::parse_shaped("conv:4x3/é", &[8, 8], 10).is_err());
    // Too many parameters is refused at parse time, not at allocation.
    let msg = refusal("dense:65536,dense:65536", &[65536]);
    assert!(msg.contains("too many"), "{msg}");
    let msg = refusal("conv:4096x3x3/p1", &[2048, 2048]);
    assert!(msg.contains("too"), "{msg}");
}

#[test]
fn json_keeps_the_mlp_form_and_validates() {
    let mlp = ModelSpec::parse("mlp:128", 784, 10).unwrap();
    let json = serde_json::to_value(&mlp).unwrap();
    assert_eq!(json["inputs"], 784);
    assert_eq!(json["hidden"], serde_json::json!([128]));
    assert_eq!(json["classes"], 10);
    assert_eq!(serde_json::from_value::<ModelSpec>(json).unwrap(), mlp);
    // What protocol-1 servers before layers sent.
    let old = serde_json::json!({"inputs": 784, "hidden": [128], "classes": 10});
    assert_eq!(serde_json::from_value::<ModelSpec>(old).unwrap(), mlp);
    let cnn = shaped("cnn", &[28, 28], 10);
    let json = serde_json::to_value(&cnn).unwrap();
    assert!(json.get("hidden").is_none());
    assert_eq!(json["layers"][0]["kind"], "conv");
    assert_eq!(json["layers"][0]["kernel"], serde_json::json!([5, 5]));
    assert_eq!(
        serde_json::from_value::<ModelSpec>(json.clone()).unwrap(),
        cnn
    );
    // A model that does not fit does not decode.
    let mut bad = json;
    bad["input_shape"] = serde_json::json!([8, 8]);
    bad["inputs"] = 64.into();
    let err = serde_json::from_value::<ModelSpec>(bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("layer 3 (conv:32x5x5)"), "{err}");
}

#[test]
fn dropout_is_seeded_and_off_in_evaluation() {
    let m = Model::new(shaped("dense:32,dropout:0.5", &[6], 3)).unwrap();
    let p = m.init_params(1);
    let (x, y) = toy_batch(4, 6, 3, 2);
    let mut ws = m.workspace(4);
    let mut g = |seed| {
        let mut g = vec![0.0; p.len()];
        m.loss_and_grad_seeded(&p, x.view(), &y, seed, &mut g, &mut ws)
            .unwrap();
        g
    };
    assert_eq!(g(5), g(5));
    assert_ne!(g(5), g(6));
    let mut ws = m.workspace(4);
    let mut a = vec![0.0; p.len()];
    let mut b = vec![0.0; p.len()];
    m.loss_and_grad(&p, x.view(), &y, &mut a, &mut ws).unwrap();
    m.loss_and_grad(&p, x.view(), &y, &mut b, &mut ws).unwrap();
    assert_eq!(a, b, "the unseeded gradient is a function of the batch");
    // Evaluation is deterministic and the same with an inference workspace.
    let e1 = m.evaluate(&p, x.view(), &y, &mut ws).unwrap();
    let mut iws = m.inference_workspace(4);
    assert_eq!(m.evaluate(&p, x.view(), &y, &mut iws).unwrap(), e1);
    assert!(m.loss_and_grad(&p, x.view(), &y, &mut a, &mut iws).is_err());
    // About half the hidden units are dropped.
    let mut ws = m.workspace(4);
    m.loss_and_grad_seeded(&p, x.view(), &y, 1, &mut a, &mut ws)
        .unwrap();
    let dropped = ws.masks[0][..4 * 32].iter().filter(|&&v| v == 0.0).count();
    assert!((40..=88).contains(&dropped), "{dropped} of 128 dropped");
}

#[test]
fn conv_chunks_do_not_change_the_gradient() {
    let m = Model::new(shaped(
        "conv:3x3x3/p1,pool:2,conv:4x3x3,dense:5",
        &[8, 8, 2],
        3,
    ))
    .unwrap();
    let p = m.init_params(4);
    let (x, y) = toy_batch(7, m.spec().inputs, 3, 8);
    let run = |chunk: usize| {
        let mut ws = m.workspace(7);
        ws.chunks.iter_mut().for_each(|c| *c = chunk.min(*c));
        let mut g = vec![0.0; p.len()];
        let s = m.loss_and_grad(&p, x.view(), &y, &mut g, &mut ws).unwrap();
        (s.loss_sum, g)
    };
    let (l7, g7) = run(7);
    for chunk in [1, 3] {
        let (l, g) = run(chunk);
        assert!((l - l7).abs() < 1e-5);
        for (a, b) in g.iter().zip(&g7) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }
}

#[test]
fn init_is_deterministic_and_bad_batches_are_errors() {
    let m = Model::new(ModelSpec::parse("mlp:16", 8, 3).unwrap()).unwrap();
    assert_eq!(m.init_params(1), m.init_params(1));
    assert_ne!(m.init_params(1), m.init_params(2));
    let p = m.init_params(1);
    let mut ws = m.workspace(4);
    let mut g = vec![0.0; p.len()];
    let (x, _) = toy_batch(2, 8, 3, 1);
    assert!(m
        .loss_and_grad(&p, x.view(), &[0, 5], &mut g, &mut ws)
        .is_err());
    assert!(m
        .loss_and_grad(&p, x.view(), &[0], &mut g, &mut ws)
        .is_err());
    assert!(m
        .loss_and_grad(&p[1..], x.view(), &[0, 1], &mut g, &mut ws)
        .is_err());
    let (big, yb) = toy_batch(5, 8, 3, 1);
    assert!(m
        .loss_and_grad(&p, big.view(), &yb, &mut g, &mut ws)
        .is_err());
    // A workspace of another model is refused, not indexed out of bounds.
    let other = Model::new(ModelSpec::parse("mlp:4", 8, 3).unwrap()).unwrap();
    let mut ows = other.workspace(4);
    assert!(m
        .loss_and_grad(&p, x.view(), &[0, 1], &mut g, &mut ows)
        .is_err());
    // A conv model refuses a transposed (non row-major) batch.
    let c = Model::new(shaped("conv:2x3x3", &[4, 4], 3)).unwrap();
    let cp = c.init_params(1);
    let (xt, _) = toy_batch(16, 2, 3, 1);
    let mut cws = c.workspace(2);
    let mut cg = vec![0.0; cp.len()];
    assert!(c
        .loss_and_grad(&cp, xt.t(), &[0, 1], &mut cg, &mut cws)
        .is_err());
}

#[test]
fn layer_times_cover_every_stage() {
    let m = Model::new(shaped("cnn", &[28, 28], 10)).unwrap();
    let p = m.init_params(1);
    let (x, y) = toy_batch(4, 784, 10, 1);
    let (times, _) = ticked(&m, &p, &x, &y);
    // One tick per stage forward and backward and one for the loss.
    assert_eq!(times.forward, vec![1.0; 6]);
    assert_eq!(times.backward, vec![1.0; 6]);
    assert_eq!(times.loss, 1.0);
}

/// The layer times and the gradient of one step of `m` on `(x, y)`, with a clock that ticks
/// one second per reading (so each stage's time is the number of readings it took).
pub(crate) fn ticked(m: &Model, p: &[f32], x: &Array2<f32>, y: &[u8]) -> (LayerTimes, Vec<f32>) {
    let mut ws = m.workspace(x.nrows());
    let mut g = vec![0.0; p.len()];
    let mut times = m.layer_times();
    let mut t = 0.0;
    let mut clock = || {
        t += 1.0;
        t
    };
    m.loss_and_grad_timed(p, x.view(), y, 0, &mut g, &mut ws, &mut clock, &mut times)
        .unwrap();
    (times, g)
}
