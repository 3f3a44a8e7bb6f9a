//! Tests of [`super`] (gpt.rs).

use super::super::{Gemm, ModelSpec};
use super::*;
use ndarray::Array2;

fn tiny(text: &str, t: usize, v: usize) -> Model {
    Model::new(ModelSpec::parse(text, t + 1, v).unwrap()).unwrap()
}

/// `rows` examples of `T + 1` random token ids.
fn tokens(rows: usize, t: usize, v: usize, seed: u64) -> (Array2<f32>, Vec<u8>) {
    let mut r = Rng::new(seed);
    let x = Array2::from_shape_fn((rows, t + 1), |_| r.below(v as u64) as f32);
    (x, vec![0; rows])
}

/// Parameters far from the init (larger weights, gains and biases away from 1 and 0), so
/// every path carries a gradient worth checking.
fn rough_params(m: &Model, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    let mut p = vec![0.0; m.param_len()];
    for t in &m.layout().tensors {
        let gain = t.name.contains("ln") && t.name.ends_with("weight");
        for v in &mut p[t.offset..t.offset + t.len()] {
            let z = r.normal() as f32;
            *v = if gain { 1.0 + 0.2 * z } else { 0.4 * z };
        }
    }
    p
}

/// Central differences of the mean loss against the analytic gradient, every parameter
/// (the model is smooth: no kink to skip). f32 forward passes, step `h`.
fn finite_difference_check(m: &Model, h: f32) {
    let info = m.sequence().unwrap();
    let p = rough_params(m, 3);
    let (x, y) = tokens(3, info.context, info.vocab, 4);
    let mut ws = m.workspace(3);
    let mut grad = vec![0.0; p.len()];
    m.loss_and_grad(&p, x.view(), &y, &mut grad, &mut ws)
        .unwrap();
    let mut loss = |p: &[f32]| m.evaluate(p, x.view(), &y, &mut ws).unwrap().mean_loss();
    let mut worst = (0.0f64, String::new());
    for t in &m.layout().tensors {
        for i in t.offset..t.offset + t.len() {
            let mut q = p.clone();
            q[i] += h;
            let up = loss(&q);
            q[i] -= 2.0 * h;
            let down = loss(&q);
            let numeric = (up - down) / (2.0 * f64::from(h));
            let a = f64::from(grad[i]);
            let err = (numeric - a).abs() / (numeric.abs() + a.abs()).max(1e-2);
            if err > worst.0 {
                worst = (
                    err,
                    format!("{}[{}]: {numeric} vs {a}", t.name, i - t.offset),
                );
            }
        }
    }
    assert!(worst.0 < 2e-2, "{}: worst {worst:?}", m.spec());
    // Every tensor gets a gradient.
    for t in &m.layout().tensors {
        let g = &grad[t.offset..t.offset + t.len()];
        assert!(
            g.iter().any(|v| v.abs() > 1e-4),
            "{} has no gradient",
            t.name
        );
    }
}

/// The vectorisable `exp` against f64's over the range softmax and GELU use, its clamps
/// and a NaN.
#[test]
fn exp_is_within_two_ulp_of_f64s() {
    let mut worst = 0.0f64;
    for i in 0..=200_000 {
        let x = -87.0 + 175.0 * f64::from(i) / 200_000.0;
        let x = x as f32;
        let want = f64::from(x).exp();
        let got = f64::from(exp(x));
        worst = worst.max(((got - want) / want).abs());
    }
    assert!(worst < 2.4e-7, "relative error {worst}");
    assert_eq!(exp(0.0), 1.0);
    assert_eq!(exp(-1000.0), exp(-87.0));
    assert_eq!(exp(1000.0), exp(88.0));
    assert!(exp(f32::NEG_INFINITY) > 0.0 && exp(f32::INFINITY).is_finite());
    assert!(exp(f32::NAN).is_nan());
}

#[test]
fn tiny_gpt_gradient_matches_finite_differences_tied_and_untied() {
    finite_difference_check(&tiny("gpt:2,8,2,5", 5, 7), 1e-2);
    finite_difference_check(&tiny("gpt:2,8,2,5/untied", 5, 7), 1e-2);
    // One head of width 4, a context of 1 (attention to itself only).
    finite_difference_check(&tiny("gpt:1,4,1,1/untied", 1, 3), 1e-2);
}

/// `sum(out * w)` for a fixed random `w`: a scalar loss of a layer's output.
fn weighted(out: &[f32], w: &[f32]) -> f64 {
    out.iter()
        .zip(w)
        .map(|(&a, &b)| f64::from(a) * f64::from(b))
        .sum()
}

fn normals(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.normal() as f32 * scale).collect()
}

fn assert_close(numeric: f64, analytic: f32, what: &str) {
    let a = f64::from(analytic);
    let err = (numeric - a).abs() / (numeric.abs() + a.abs()).max(1e-2);
    assert!(err < 1e-2, "{what}: {numeric} vs {a}");
}

#[test]
fn layer_norm_backward_matches_finite_differences() {
    let (rows, d) = (3, 6);
    let x = normals(rows * d, 1, 2.0);
    let gamma: Vec<f32> = normals(d, 2, 0.3).iter().map(|v| 1.0 + v).collect();
    let beta = normals(d, 3, 0.3);
    let w = normals(rows * d, 4, 1.0);
    let out = |x: &[f32], gamma: &[f32], beta: &[f32]| {
        let mut ln = Ln::new(rows, d);
        ln_forward(x, gamma, beta, &mut ln, rows);
        (weighted(&ln.out, &w), ln)
    };
    let (_, ln) = out(&x, &gamma, &beta);
    let mut dx = vec![0.5; rows * d]; // accumulated into
    let (mut dg, mut db) = (vec![9.0; d], vec![9.0; d]); // overwritten
    ln_backward(&w, &ln, &gamma, rows, &mut dx, &mut dg, &mut db);
    let h = 1e-2;
    for i in 0..rows * d {
        let mut q = x.clone();
        q[i] += h;
        let up = out(&q, &gamma, &beta).0;
        q[i] -= 2.0 * h;
        let down = out(&q, &gamma, &beta).0;
        assert_close((up - down) / f64::from(2.0 * h), dx[i] - 0.5, "dx");
    }
    for j in 0..d {
        let mut q = gamma.clone();
        q[j] += h;
        let up = out(&x, &q, &beta).0;
        q[j] -= 2.0 * h;
        let down = out(&x, &q, &beta).0;
        assert_close((up - down) / f64::from(2.0 * h), dg[j], "dgamma");
        let mut q = beta.clone();
        q[j] += h;
        let up = out(&x, &gamma, &q).0;
        q[j] -= 2.0 * h;
        let down = out(&x, &gamma, &q).0;
        assert_close((up - down) / f64::from(2.0 * h), db[j], "dbeta");
    }
    // Normalised: zero mean and unit (biased) variance per row.
    for r in ln.xhat.chunks(d) {
        let mean = r.iter().sum::<f32>() / d as f32;
        let var = r.iter().map(|v| v * v).sum::<f32>() / d as f32;
        assert!(
            mean.abs() < 1e-5 && (var - 1.0).abs() < 1e-3,
            "{mean} {var}"
        );
    }
}

#[test]
fn gelu_backward_matches_finite_differences_and_the_formula() {
    let mut h: Vec<f32> = (-40..=40).map(|i| i as f32 * 0.1).collect();
    h.extend([-100.0, -30.0, 30.0, 100.0, 1e-6, -1e-6]);
    let (mut sg, mut g) = (vec![0.0; h.len()], vec![0.0; h.len()]);
    gelu_forward(&h, &mut sg, &mut g);
    let mut d = vec![1.0; h.len()];
    gelu_backward(&h, &sg, &mut d);
    let gelu = |x: f64| {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
    };
    let mut again = vec![0.0; h.len()];
    gelu_again(&h, &sg, &mut again);
    assert_eq!(again, g);
    for (i, &x) in h.iter().enumerate() {
        let x = f64::from(x);
        // The tanh form of the shared architecture text, to float rounding.
        let want = gelu(x);
        assert!(
            (want - f64::from(g[i])).abs() <= 1e-6 * (1.0 + want.abs()),
            "gelu({x})"
        );
        let numeric = (gelu(x + 1e-4) - gelu(x - 1e-4)) / 2e-4;
        assert_close(numeric, d[i], "gelu'");
    }
}

#[test]
fn causal_attention_backward_matches_finite_differences() {
    let k = Dims {
        b: 2,
        tn: 4,
        d: 6,
        h: 2,
        hd: 3,
    };
    let n = k.rows() * k.d;
    let heads = normals(3 * n, 5, 1.0);
    let w = normals(n, 6, 1.0);
    let mut scratch = Scratch::default();
    let mut run = |heads: &[f32]| {
        let mut mm = Mm {
            kernel: Gemm::MatrixMultiply,
            scratch: &mut scratch,
        };
        let mut probs = vec![0.0; k.b * k.h * k.tn * k.tn];
        let mut att = vec![0.0; n];
        attention_forward(&mut mm, heads, &mut probs, &mut att, k);
        (weighted(&att, &w), probs)
    };
    let (_, probs) = run(&heads);
    // Rows sum to 1 and nothing after the diagonal.
    for (r, row) in probs.chunks(k.tn).enumerate() {
        let t = r % k.tn;
        assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        assert!(row[t + 1..].iter().all(|&v| v == 0.0));
    }
    let mut dheads = vec![0.0; 3 * n];
    let mut dp = vec![0.0; k.tn * k.tn];
    let mut scratch2 = Scratch::default();
    let mut mm = Mm {
        kernel: Gemm::MatrixMultiply,
        scratch: &mut scratch2,
    };
    attention_backward(&mut mm, &heads, &probs, &w, &mut dheads, &mut dp, k);
    let h = 1e-2;
    for i in 0..3 * n {
        let mut q = heads.clone();
        q[i] += h;
        let up = run(&q).0;
        q[i] -= 2.0 * h;
        let down = run(&q).0;
        assert_close((up - down) / f64::from(2.0 * h), dheads[i], "dq/dk/dv");
    }
}

#[test]
fn heads_split_and_join_are_inverse() {
    let k = Dims {
        b: 2,
        tn: 3,
        d: 4,
        h: 2,
        hd: 2,
    };
    let src: Vec<f32> = (0..k.rows() * 3 * k.d).map(|i| i as f32).collect();
    let mut heads = vec![0.0; 3 * k.rows() * k.d];
    let mut back = vec![0.0; src.len()];
    for part in 0..3 {
        to_heads(&src, 3 * k.d, part * k.d, &mut heads[part * 24..], k);
        from_heads(&heads[part * 24..], &mut back, 3 * k.d, part * k.d, k);
    }
    assert_eq!(back, src);
    // Example 1, head 1, position 2 of k: row 5, columns 4 + 2..4 + 4.
    let o = 24 + k.head(1, 1) + 2 * 2;
    assert_eq!(heads[o..o + 2], [5.0 * 12.0 + 6.0, 5.0 * 12.0 + 7.0]);
}

/// The logits of every position of a batch.
fn logits(m: &Model, p: &[f32], x: &Array2<f32>) -> Vec<f32> {
    let mut ws = m.inference_workspace(x.nrows());
    m.evaluate(p, x.view(), &vec![0; x.nrows()], &mut ws)
        .unwrap();
    let s = ws.seq.unwrap();
    s.logits
}

#[test]
fn later_tokens_change_nothing_before_them() {
    let m = tiny("gpt:2,8,2,6/untied", 6, 9);
    let (t, v) = (6, 9);
    let p = rough_params(&m, 1);
    let (x, _) = tokens(2, t, v, 7);
    let base = logits(&m, &p, &x);
    for cut in 0..t {
        let mut x2 = x.clone();
        for j in cut + 1..=t {
            x2[[0, j]] = ((x2[[0, j]] as usize + 1 + j) % v) as f32;
        }
        let after = logits(&m, &p, &x2);
        // Positions 0..=cut of example 0 see the same tokens: the same logits, exactly;
        // example 1 is untouched.
        assert_eq!(after[..(cut + 1) * v], base[..(cut + 1) * v], "cut {cut}");
        assert_eq!(after[t * v..], base[t * v..]);
        if cut + 1 < t {
            assert_ne!(after[(cut + 1) * v..t * v], base[(cut + 1) * v..t * v]);
        }
    }
    // And the loss of a position depends on its target: the last token only moves the last
    // position's loss term.
    let mut ws = m.workspace(2);
    let y = [0u8; 2];
    let a = m.evaluate(&p, x.view(), &y, &mut ws).unwrap();
    let mut x2 = x.clone();
    x2[[0, t]] = ((x2[[0, t]] as usize + 1) % v) as f32;
    assert_eq!(logits(&m, &p, &x2), base);
    assert_ne!(m.evaluate(&p, x2.view(), &y, &mut ws).unwrap(), a);
}

#[test]
fn a_fresh_model_predicts_about_uniformly() {
    for (text, v) in [("gpt:2,32,4,16", 50usize), ("gpt:1,16,2,8/untied", 100)] {
        let t = ModelSpec::parse(text, 100, v).ok().map_or(0, |_| 0);
        let _ = t;
        let ctx = text.rsplit(',').next().unwrap().trim_end_matches("/untied");
        let ctx: usize = ctx.parse().unwrap();
        let m = tiny(text, ctx, v);
        let p = m.init_params(5);
        let (x, y) = tokens(16, ctx, v, 2);
        let mut ws = m.inference_workspace(16);
        let s = m.evaluate(&p, x.view(), &y, &mut ws).unwrap();
        assert_eq!(s.count, 16 * ctx);
        let ln_v = (v as f64).ln();
        assert!(
            (s.mean_loss() - ln_v).abs() < 0.05,
            "{text}: {} vs ln V {ln_v}",
            s.mean_loss()
        );
    }
}

/// Adam (here, so this test does not follow changes to `optim`).
fn adam(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], step: i32, lr: f32) {
    let (b1, b2) = (0.9f32, 0.999f32);
    let (c1, c2) = (1.0 - b1.powi(step), 1.0 - b2.powi(step));
    for i in 0..p.len() {
        m[i] = b1 * m[i] + (1.0 - b1) * g[i];
        v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
        p[i] -= lr * (m[i] / c1) / ((v[i] / c2).sqrt() + 1e-8);
    }
}

#[test]
fn a_tiny_gpt_learns_a_repeated_string_and_continues_it() {
    let text = b"the cat sat on the mat. ";
    let mut vocab: Vec<u8> = text.to_vec();
    vocab.sort_unstable();
    vocab.dedup();
    let v = vocab.len();
    let ids: Vec<u32> = text
        .iter()
        .cycle()
        .take(400)
        .map(|c| vocab.binary_search(c).unwrap() as u32)
        .collect();
    let t = 16;
    let m = tiny("gpt:2,32,4,16", t, v);
    let mut p = m.init_params(1);
    let (b, steps) = (8, 300);
    let mut ws = m.workspace(b);
    let mut g = vec![0.0; p.len()];
    let (mut m1, mut m2) = (vec![0.0; p.len()], vec![0.0; p.len()]);
    let mut r = Rng::new(3);
    let mut x = Array2::zeros((b, t + 1));
    let y = vec![0u8; b];
    let mut first = None;
    let mut last = 0.0;
    for step in 1..=steps {
        for e in 0..b {
            let at = r.below((ids.len() - t - 1) as u64) as usize;
            for j in 0..=t {
                x[[e, j]] = ids[at + j] as f32;
            }
        }
        let s = m.loss_and_grad(&p, x.view(), &y, &mut g, &mut ws).unwrap();
        first.get_or_insert(s.mean_loss());
        last = s.mean_loss();
        adam(&mut p, &g, &mut m1, &mut m2, step, 3e-3);
    }
    let ln_v = (v as f64).ln();
    let first = first.unwrap();
    assert!(
        (first - ln_v).abs() < 0.1,
        "first loss {first}, ln V {ln_v}"
    );
    // The first few positions of a window cannot know where in the sentence they are,
    // but most can: the loss ends far below ln V.
    assert!(last < 0.25 * ln_v, "loss {first} -> {last} (ln V {ln_v})");
    // Greedy sampling continues the sentence.
    let prompt: Vec<u32> = ids[..20].to_vec();
    let out = m.generate(&p, &prompt, 24, 0.0, &mut Rng::new(1)).unwrap();
    let want = &ids[20..44];
    let same = out.iter().zip(want).filter(|(a, b)| a == b).count();
    assert!(same >= 20, "{same} of 24 sampled tokens continue the text");
    // A temperature draws from the softmax: reproducible with the seed, and still mostly
    // the text at a low temperature.
    let a = m.generate(&p, &prompt, 24, 0.5, &mut Rng::new(9)).unwrap();
    assert_eq!(
        a,
        m.generate(&p, &prompt, 24, 0.5, &mut Rng::new(9)).unwrap()
    );
    assert!(a.iter().all(|&id| (id as usize) < v));
}

#[test]
fn every_gemm_kernel_gives_the_same_gradient() {
    let m = tiny("gpt:2,16,4,12", 12, 11);
    let p = rough_params(&m, 2);
    let (x, y) = tokens(5, 12, 11, 3);
    let run = |k: Gemm| {
        let mut ws = m.workspace(5);
        ws.set_gemm(k);
        let mut g = vec![0.0; p.len()];
        let s = m.loss_and_grad(&p, x.view(), &y, &mut g, &mut ws).unwrap();
        (s, g)
    };
    let (s0, g0) = run(Gemm::ALL[0]);
    for &k in &Gemm::ALL[1..] {
        let (s, g) = run(k);
        assert!((s.loss_sum - s0.loss_sum).abs() < 1e-4 * s0.loss_sum, "{k}");
        assert_eq!(s.correct, s0.correct);
        for (a, b) in g.iter().zip(&g0) {
            assert!((a - b).abs() <= 1e-5 + 1e-4 * b.abs(), "{k}: {a} vs {b}");
        }
    }
}

#[test]
fn steps_reuse_the_workspace_and_evaluation_runs_in_pieces() {
    let m = tiny("gpt:1,8,2,6", 6, 5);
    let p = rough_params(&m, 1);
    let (x, y) = tokens(7, 6, 5, 1);
    let mut ws = m.workspace(7);
    let mut g = vec![0.0; p.len()];
    let mut g2 = vec![0.0; p.len()];
    m.loss_and_grad(&p, x.view(), &y, &mut g, &mut ws).unwrap();
    let held = ws.gemm_scratch_len();
    let ptr = ws.seq.as_ref().unwrap().x.as_ptr();
    g2.fill(7.0); // overwritten, not accumulated
    m.loss_and_grad(&p, x.view(), &y, &mut g2, &mut ws).unwrap();
    assert_eq!(g, g2);
    assert_eq!(ws.gemm_scratch_len(), held);
    assert_eq!(ws.seq.as_ref().unwrap().x.as_ptr(), ptr);
    // A smaller batch in the same workspace is the same as in its own.
    let (xs, ys) = (x.slice(ndarray::s![..3, ..]), &y[..3]);
    let a = m.loss_and_grad(&p, xs, ys, &mut g, &mut ws).unwrap();
    let b = m
        .loss_and_grad(&p, xs, ys, &mut g2, &mut m.workspace(3))
        .unwrap();
    assert_eq!((a, &g), (b, &g2));
    // Evaluation: a training workspace, an inference one, and one that takes two examples
    // at a time agree.
    let full = m.evaluate(&p, x.view(), &y, &mut ws).unwrap();
    let mut iws = m.inference_workspace(7);
    assert_eq!(m.evaluate(&p, x.view(), &y, &mut iws).unwrap(), full);
    iws.seq.as_mut().unwrap().capacity = 2;
    let pieces = m.evaluate(&p, x.view(), &y, &mut iws).unwrap();
    assert_eq!((pieces.count, pieces.correct), (full.count, full.correct));
    assert!((pieces.loss_sum - full.loss_sum).abs() < 1e-9 * full.loss_sum.max(1.0));
    assert!(m.loss_and_grad(&p, x.view(), &y, &mut g, &mut iws).is_err());
    // The default model's inference workspace is bounded whatever the capacity.
    let big = tiny("gpt", 64, 100);
    let ews = big.inference_workspace(100_000);
    let s = ews.seq.as_ref().unwrap();
    assert!(
        s.capacity >= 1
            && (s.capacity as u128) * floats_per_example(&s.info, false) <= EVAL_BUDGET as u128
    );
}

#[test]
fn bad_batches_and_requests_are_errors() {
    let m = tiny("gpt:1,8,2,4", 4, 6);
    let p = m.init_params(1);
    let mut ws = m.workspace(3);
    let mut g = vec![0.0; p.len()];
    let (x, y) = tokens(3, 4, 6, 1);
    assert!(m.loss_and_grad(&p, x.view(), &y, &mut g, &mut ws).is_ok());
    for bad in [6.0, -1.0, 2.5, f32::NAN, f32::INFINITY] {
        let mut xb = x.clone();
        xb[[1, 2]] = bad;
        let e = m
            .loss_and_grad(&p, xb.view(), &y, &mut g, &mut ws)
            .unwrap_err();
        assert!(e.to_string().contains("not an id in 0..6"), "{bad}: {e}");
    }
    let (wide, yw) = tokens(3, 5, 6, 1);
    assert!(m
        .loss_and_grad(&p, wide.view(), &yw, &mut g, &mut ws)
        .is_err());
    assert!(m
        .loss_and_grad(&p, x.view(), &y[..2], &mut g, &mut ws)
        .is_err());
    assert!(m
        .loss_and_grad(&p[1..], x.view(), &y, &mut g, &mut ws)
        .is_err());
    assert!(m
        .loss_and_grad(&p, x.view(), &y, &mut g[1..], &mut ws)
        .is_err());
    let (four, y4) = tokens(4, 4, 6, 1);
    assert!(m
        .loss_and_grad(&p, four.view(), &y4, &mut g, &mut ws)
        .is_err());
    // A transposed batch is read as well as a row-major one.
    let xt = x.t().to_owned();
    let mut g2 = vec![0.0; p.len()];
    m.loss_and_grad(&p, xt.t(), &y, &mut g2, &mut ws).unwrap();
    m.loss_and_grad(&p, x.view(), &y, &mut g, &mut ws).unwrap();
    assert_eq!(g, g2);
    // Workspaces of other models are refused both ways.
    let other = tiny("gpt:1,8,4,4", 4, 6);
    assert!(m
        .loss_and_grad(&p, x.view(), &y, &mut g, &mut other.workspace(3))
        .is_err());
    let mlp = Model::new(ModelSpec::parse("mlp:4", 5, 6).unwrap()).unwrap();
    let mut mws = mlp.workspace(3);
    assert!(m.loss_and_grad(&p, x.view(), &y, &mut g, &mut mws).is_err());
    let mp = mlp.init_params(1);
    let mut mg = vec![0.0; mp.len()];
    assert!(mlp
        .loss_and_grad(&mp, x.view(), &y, &mut mg, &mut ws)
        .is_err());
    assert!(mlp.evaluate(&mp, x.view(), &y, &mut ws).is_err());
    // Sampling.
    let mut r = Rng::new(1);
    assert!(mlp.generate(&mp, &[1], 3, 1.0, &mut r).is_err());
    assert!(m.generate(&p, &[], 3, 1.0, &mut r).is_err());
    assert!(m.generate(&p, &[6], 3, 1.0, &mut r).is_err());
    assert!(m.generate(&p, &[1], MAX_GENERATE + 1, 1.0, &mut r).is_err());
    assert!(m.generate(&p, &[1], 3, -1.0, &mut r).is_err());
    assert!(m.generate(&p, &[1], 3, f32::NAN, &mut r).is_err());
    assert!(m.generate(&p[1..], &[1], 3, 1.0, &mut r).is_err());
    // A prompt longer than the context is cropped to its last T tokens.
    let long: Vec<u32> = (0..11).map(|i| i % 6).collect();
    let a = m.generate(&p, &long, 5, 0.0, &mut r).unwrap();
    let b = m.generate(&p, &long[7..], 5, 0.0, &mut r).unwrap();
    assert_eq!(a.len(), 5);
    assert_eq!(a[0], b[0]);
    assert!(m.generate(&p, &[1], 0, 1.0, &mut r).unwrap().is_empty());
}

#[test]
fn layout_stages_and_times() {
    let m = tiny("gpt", 64, 100);
    assert_eq!(m.spec().to_string(), "gpt:4,128,4,64 65-100");
    let n = m.param_len();
    assert!((750_000..850_000).contains(&n), "{n} parameters");
    assert_eq!(n as u128, param_count(&m.sequence().unwrap()));
    let names: Vec<&str> = m.layout().tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names[..4],
        [
            "tok_emb.weight",
            "pos_emb.weight",
            "block0.ln1.weight",
            "block0.ln1.bias"
        ]
    );
    assert_eq!(names[names.len() - 2..], ["ln_f.weight", "ln_f.bias"]);
    assert_eq!(names.len(), 2 + 4 * 12 + 2);
    let l = m.layout();
    assert_eq!(l.get("block3.attn.qkv.weight").unwrap().shape, [128, 384]);
    assert_eq!(l.get("block1.mlp.proj.weight").unwrap().shape, [512, 128]);
    assert_eq!(l.get("tok_emb.weight").unwrap().shape, [100, 128]);
    assert_eq!(l.get("pos_emb.weight").unwrap().offset, 100 * 128);
    let u = tiny("gpt:4,128,4,64/untied", 64, 100);
    let head = u.layout().tensors.last().cloned().unwrap();
    assert_eq!(
        (head.name.as_str(), head.shape.clone()),
        ("head.weight", vec![128, 100])
    );
    assert_eq!(u.param_len(), n + 128 * 100);
    // Init: gains 1, biases 0, residual projections narrower.
    let p = u.init_params(3);
    assert_eq!(p, u.init_params(3));
    assert_ne!(p, u.init_params(4));
    let std = |name: &str| {
        let t = l.get(name).unwrap_or_else(|| u.layout().get(name).unwrap());
        let v = &p[t.offset..t.offset + t.len()];
        (v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / v.len() as f64).sqrt()
    };
    assert!((std("tok_emb.weight") - 0.02).abs() < 0.002);
    assert!((std("block0.attn.qkv.weight") - 0.02).abs() < 0.002);
    assert!((std("head.weight") - 0.02).abs() < 0.002);
    assert!((std("block2.mlp.proj.weight") - 0.02 / 8f64.sqrt()).abs() < 0.001);
    assert!((std("block2.attn.proj.weight") - 0.02 / 8f64.sqrt()).abs() < 0.001);
    let ln = u.layout().get("block1.ln2.weight").unwrap();
    assert!(p[ln.offset..ln.offset + 128].iter().all(|&v| v == 1.0));
    let b = u.layout().get("block1.mlp.fc.bias").unwrap();
    assert!(p[b.offset..b.offset + 512].iter().all(|&v| v == 0.0));
    // Stages and their times.
    let m = tiny("gpt:2,8,2,4", 4, 5);
    assert_eq!(m.stage_names(), ["embed", "block0", "block1", "head"]);
    assert!(!m.has_dropout());
    let p = m.init_params(1);
    let (x, y) = tokens(2, 4, 5, 1);
    let (times, g) = crate::model::tests::ticked(&m, &p, &x, &y);
    assert_eq!(times.forward, vec![1.0; 4]);
    assert_eq!(times.backward, vec![1.0; 4]);
    assert_eq!(times.loss, 1.0);
    let mut g2 = vec![0.0; p.len()];
    let mut ws = m.workspace(2);
    m.loss_and_grad_seeded(&p, x.view(), &y, 99, &mut g2, &mut ws)
        .unwrap();
    assert_eq!(g, g2, "no dropout: the seed changes nothing");
}
