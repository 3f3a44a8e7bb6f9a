//! Tests of [`super`] (format.rs).

use super::*;
use crowdgrad_core::optim::{OptimizerConfig, Rule};
use crowdgrad_core::shard::Consistency;
use crowdgrad_core::spec::{DataInfo, RunParams};

pub(crate) fn spec(shards: usize, optimizer: &str) -> RunSpec {
    RunSpec::build(RunParams {
        run_id: "r1".into(),
        model: "mlp:5".into(),
        optimizer: OptimizerConfig {
            rule: Rule::from_name(optimizer).unwrap(),
            ..OptimizerConfig::default()
        },
        batch_size: 4,
        seed: 1,
        consistency: Consistency::Async,
        shards,
        dataset: DataInfo {
            name: "toy".into(),
            image_dims: vec![2, 3],
            classes: 4,
            train_len: 10,
            test_len: 5,
            text: None,
        },
        local: Default::default(),
        normalize: Default::default(),
    })
    .unwrap()
}

fn sample(shards: usize, optimizer: &str) -> Checkpoint {
    let spec = spec(shards, optimizer);
    let rule = spec.optimizer.rule;
    let exports: Vec<ShardExport> = spec
        .ranges()
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let vals: Vec<f32> = (r.start..r.end).map(|k| k as f32 * 0.5).collect();
            let mut state = OptState::new(&rule, r.len());
            state
                .slot0
                .iter_mut()
                .enumerate()
                .for_each(|(k, v)| *v = k as f32);
            state.slot1.iter_mut().for_each(|v| *v = -1.0);
            state.t = 10 + i as u64;
            ShardExport {
                version: 10 + i as u64,
                values: Arc::new(vals),
                state,
                inv_staleness_mean: 0.5,
                scaled_pushes: 3,
                samples: 320 + i as u64,
                average: None,
            }
        })
        .collect();
    Checkpoint::assemble(spec, &exports, serde_json::json!({"contributors": []})).unwrap()
}

#[test]
fn round_trips_with_named_tensors() {
    for opt in ["sgd", "adagrad", "adam"] {
        let c = sample(3, opt);
        let bytes = c.encode().unwrap();
        let back = Checkpoint::decode(&bytes).unwrap();
        assert_eq!(back, c, "{opt}");
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let w = st.tensor("layer0.weight").unwrap();
        assert_eq!(w.shape(), &[6, 5]);
        assert_eq!(f32s(w.data())[1], 0.5);
        if opt == "adagrad" {
            assert_eq!(st.tensor("layer1.bias.adagrad_acc").unwrap().shape(), &[4]);
        }
        if opt == "adam" {
            assert!(st.tensor("layer0.weight.adam_v").is_ok());
        }
        // The same layout gives back the same exports.
        let ex = back.exports_for(&back.spec.ranges());
        assert_eq!(ex.len(), 3);
        assert_eq!(ex[2].version, 12);
    }
}

/// `--ema`: the shards' moving average is kept as `{tensor}.ema` tensors with its decay
/// and bias correction per shard, re-cut with the values when resharding; a checkpoint
/// without it (written before it was kept, or by a run without `--ema`) loads with none,
/// and one that lacks a tensor of it is refused.
#[test]
fn the_moving_average_is_kept_and_recut() {
    let spec3 = spec(3, "adam");
    let n = spec3.model.param_len();
    let mut exports = sample(3, "adam").exports_for(&spec3.ranges());
    for (i, e) in exports.iter_mut().enumerate() {
        e.average = Some(AverageExport {
            decay: 0.999,
            values: Arc::new(e.values.iter().map(|v| v + 100.0).collect()),
            power: 0.25 + i as f64 / 10.0,
        });
    }
    let c = Checkpoint::assemble(spec3, &exports, serde_json::json!({"seq": 0})).unwrap();
    let all: Vec<f32> = c.values.iter().map(|v| v + 100.0).collect();
    assert_eq!(c.average.as_ref(), Some(&all));
    let bytes = c.encode().unwrap();
    let back = Checkpoint::decode(&bytes).unwrap();
    assert_eq!(back, c);
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("layer0.weight.ema").unwrap().shape(), &[6, 5]);
    assert_eq!(back.exports_for(&back.spec.ranges()), exports);
    // Onto two shards: the whole average, re-cut.
    let two = back.exports_for(&spec(2, "adam").ranges());
    let recut: Vec<f32> = two
        .iter()
        .flat_map(|e| e.average.as_ref().unwrap().values.to_vec())
        .collect();
    assert_eq!(recut, all);
    assert_eq!(two[0].average.as_ref().unwrap().decay, 0.999);
    assert_eq!(recut.len(), n);

    // A shard without an average beside shards with one cannot be assembled.
    let mut mixed = exports.clone();
    mixed[1].average = None;
    let e = Checkpoint::assemble(back.spec.clone(), &mixed, serde_json::json!({}))
        .unwrap_err()
        .to_string();
    assert!(e.contains("moving average"), "{e}");

    // A decay out of range in the metadata is refused at decode, before any shard
    // restores it.
    let mut odd = back.clone();
    odd.shards[0].ema = Some(EmaMeta {
        decay: 1.5,
        power: 0.5,
    });
    let e = Checkpoint::decode(&odd.encode().unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("decay 1.5"), "{e}");

    // The average's metadata without its tensors: refused, naming what is missing.
    let mut lacking = back.clone();
    lacking.average = None;
    let e = Checkpoint::decode(&lacking.encode().unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("moving average"), "{e}");
}

#[test]
fn the_history_is_kept_and_optional() {
    // Issue 19: a checkpoint carries the coordinator's history; one without it (written
    // before it existed) still loads, with none.
    let mut c = sample(2, "sgd");
    let old = c.encode().unwrap();
    let back = Checkpoint::decode(&old).unwrap();
    assert_eq!(back.history, None);
    let (_, header) = SafeTensors::read_metadata(&old).unwrap();
    assert!(!header.metadata().clone().unwrap().contains_key("history"));
    c.history = Some(serde_json::json!({"list": [{"id": 1}]}));
    let back = Checkpoint::decode(&c.encode().unwrap()).unwrap();
    assert_eq!(back, c);
}

#[test]
fn truncation_and_corruption_are_detected() {
    let bytes = sample(2, "adagrad").encode().unwrap();
    for cut in [0, 7, 100, bytes.len() / 2, bytes.len() - 1] {
        let e = Checkpoint::decode(&bytes[..cut]).unwrap_err().to_string();
        assert!(e.contains("truncated"), "{cut}: {e}");
    }
    let mut flipped = bytes.clone();
    let last = flipped.len() - 3;
    flipped[last] ^= 0x40;
    let e = Checkpoint::decode(&flipped).unwrap_err().to_string();
    assert!(e.contains("checksum"), "{e}");
    let export = encode_model(&spec(2, "sgd"), &vec![0.0; 59], &[1, 2], Weights::Live).unwrap();
    let e = Checkpoint::decode(&export).unwrap_err().to_string();
    assert!(e.contains("format"), "{e}");
}

#[test]
fn resharding_recuts_whole_tensors() {
    let c = sample(3, "adam");
    let target = spec(2, "adam").ranges();
    let ex = c.exports_for(&target);
    let mut values = Vec::new();
    let mut slot1 = Vec::new();
    for (e, r) in ex.iter().zip(&target) {
        assert_eq!(e.values.len(), r.len());
        values.extend_from_slice(&e.values);
        slot1.extend_from_slice(&e.state.slot1);
    }
    assert_eq!(values, c.values);
    assert_eq!(slot1, c.slots[1]);
    assert_eq!(ex[1].version, 12, "the newest overlapping shard's version");
}

#[test]
fn the_export_has_only_model_tensors() {
    let s = spec(2, "adagrad");
    let n = s.model.param_len();
    let v: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let bytes = encode_model(&s, &v, &[3, 4], Weights::Average).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut names = st.names();
    names.sort();
    assert_eq!(
        names,
        [
            "layer0.bias",
            "layer0.weight",
            "layer1.bias",
            "layer1.weight"
        ]
    );
    assert_eq!(st.tensor("layer1.weight").unwrap().shape(), &[5, 4]);
    assert_eq!(
        f32s(st.tensor("layer1.bias").unwrap().data()),
        vec![55.0, 56.0, 57.0, 58.0]
    );
}
