//! Tests of [`super`] (spec.rs).

use super::*;
use proptest::prelude::*;

fn gpt(text: &str, t: usize, v: usize) -> Result<ModelSpec> {
    ModelSpec::parse_shaped(text, &[t + 1], v)
}

#[test]
fn gpt_names_and_layer_lists_are_one_grammar() {
    let s = gpt("gpt:2,8,2,5", 5, 7).unwrap();
    assert_eq!(
        s.layers,
        [
            Layer::Embed { dim: 8, context: 5 },
            Layer::Block { heads: 2 },
            Layer::Block { heads: 2 },
            Layer::LayerNorm,
            Layer::Head { tied: true },
        ]
    );
    assert_eq!(s.to_string(), "gpt:2,8,2,5 6-7");
    assert_eq!(s.layers_text(), "gpt:2,8,2,5");
    assert_eq!(
        (s.inputs, s.input_shape.clone(), s.classes),
        (6, vec![6], 7)
    );
    let info = s.sequence().unwrap();
    assert_eq!(
        info,
        SeqInfo {
            context: 5,
            vocab: 7,
            layers: 2,
            dim: 8,
            heads: 2,
            tied: true
        }
    );
    assert_eq!(info.layers(), s.layers);
    for same in [
        "embed:8/t5,block:2,block:2,lnorm",
        " embed:8/t5, block:2 ,block:2,lnorm,head ",
        "embed:8/t5,block:2,block:2,lnorm,head:tied",
        "gpt: 2, 8, 2, 5",
    ] {
        assert_eq!(gpt(same, 5, 7).unwrap(), s, "{same}");
    }
    let u = gpt("gpt:2,8,2,5/untied", 5, 7).unwrap();
    assert_eq!(u.layers.last(), Some(&Layer::Head { tied: false }));
    assert_eq!(u.to_string(), "gpt:2,8,2,5/untied 6-7");
    assert_eq!(
        gpt("embed:8/t5,block:2,block:2,lnorm,head:untied", 5, 7).unwrap(),
        u
    );
    assert!(!u.sequence().unwrap().tied);
    // Plain `gpt`; `parse` with a flat count reads the same.
    let d = gpt("gpt", 64, 100).unwrap();
    assert_eq!(d.layers_text(), GPT);
    assert_eq!(ModelSpec::parse("gpt", 65, 100).unwrap(), d);
    assert!(ModelSpec::check_text("gpt").is_ok());
    assert_eq!(ModelSpec::parse_sequence("gpt", 100).unwrap(), d);
    assert_eq!(ModelSpec::parse_sequence("gpt:2,8,2,5", 7).unwrap(), s);
    for not in ["mlp:8", "cnn", "block:2,lnorm", "gpt:2,7,2,5", "nonsense"] {
        assert!(ModelSpec::parse_sequence(not, 7).is_err(), "{not}");
    }
    assert!(ModelSpec::check_text("gpt:1,4,2,3/untied").is_ok());
    // Other models are not language models.
    assert_eq!(ModelSpec::parse("mlp:8", 6, 3).unwrap().sequence(), None);
    assert_eq!(
        ModelSpec::parse("softmax", 6, 3).unwrap().mlp_widths(),
        Some(vec![])
    );
    assert_eq!(d.mlp_widths(), None);
}

#[test]
fn gpt_json_round_trips_and_validates() {
    let s = gpt("gpt:2,8,2,5/untied", 5, 7).unwrap();
    let json = serde_json::to_value(&s).unwrap();
    assert_eq!(json["inputs"], 6);
    assert!(json.get("hidden").is_none());
    assert_eq!(
        json["layers"],
        serde_json::json!([
            {"kind": "embed", "dim": 8, "context": 5},
            {"kind": "block", "heads": 2},
            {"kind": "block", "heads": 2},
            {"kind": "layer_norm"},
            {"kind": "head", "tied": false},
        ])
    );
    assert_eq!(
        serde_json::from_value::<ModelSpec>(json.clone()).unwrap(),
        s
    );
    let text = serde_json::to_string(&s).unwrap();
    assert_eq!(serde_json::from_str::<ModelSpec>(&text).unwrap(), s);
    // Unknown fields, a bad structure or a misfit do not decode.
    let mut bad = json.clone();
    bad["layers"][1]["dim"] = 3.into();
    assert!(serde_json::from_value::<ModelSpec>(bad).is_err());
    let mut bad = json.clone();
    bad["layers"][1]["heads"] = 3.into();
    let err = serde_json::from_value::<ModelSpec>(bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("other heads"), "{err}");
    let mut bad = json.clone();
    bad["inputs"] = 7.into();
    bad["input_shape"] = serde_json::json!([7]);
    let err = serde_json::from_value::<ModelSpec>(bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("T+1 = 6"), "{err}");
    let mut bad = json;
    bad["layers"][3] = serde_json::json!({"kind": "dense", "units": 7});
    assert!(serde_json::from_value::<ModelSpec>(bad).is_err());
}

fn refusal(text: &str, t: usize, v: usize) -> String {
    match gpt(text, t, v) {
        Ok(s) => panic!("{text} was accepted as {s}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_gpt_specs_say_why() {
    let cases: [(&str, usize, usize, &[&str]); 16] = [
        (
            "gpt:2,10,4,5",
            5,
            7,
            &["4 heads do not divide the width 10", "D % H"],
        ),
        ("gpt:2,8,2,5", 6, 7, &["T+1 = 6", "input is 7"]),
        ("gpt:2,8,2", 5, 7, &["4 sizes"]),
        ("gpt:2,8,2,5,1", 5, 7, &["4 sizes"]),
        ("gpt:2,8,0,5", 5, 7, &["gpt size \"0\""]),
        ("gpt:2,8,2,5/tied", 5, 7, &["only /untied"]),
        ("gpt:2,8,2,x", 5, 7, &["gpt size"]),
        ("gpt:65,8,2,5", 5, 7, &["65 blocks", "1..=64"]),
        ("gpt:2,8192,2,5", 5, 7, &["width 8192", "1..=4096"]),
        ("gpt:2,8,2,5000", 5000, 7, &["context 5000", "1..=4096"]),
        ("gpt:64,4096,64,4096", 4096, 7, &["too many", "at most"]),
        ("gpt:1,8,2,5", 5, 70_000, &["vocabulary of 70000", "65536"]),
        ("embed:8/t5,block:2,lnorm,dense:4", 5, 7, &["out of place"]),
        ("block:2,embed:8/t5,lnorm", 5, 7, &["start with embed"]),
        (
            "embed:8/t5,block:2",
            5,
            7,
            &["lnorm must come right before the head"],
        ),
        (
            "embed:8/t5,head:untied,block:2,lnorm",
            5,
            7,
            &["out of place"],
        ),
    ];
    for (text, t, v, needles) in cases {
        let msg = refusal(text, t, v);
        for n in needles {
            assert!(msg.contains(n), "{text}: {msg:?} lacks {n:?}");
        }
    }
    for text in [
        "embed:8",
        "embed:8/s5",
        "block:2/t3",
        "lnorm:1",
        "head:both",
        "embed:8/t5,block:2,block:4,lnorm",
    ] {
        assert!(gpt(text, 5, 7).is_err(), "{text}");
    }
    assert!(gpt("gpt:1,8,2,5", 5, 1).is_err());
    // Too many activations per example: refused at parse time, with the numbers.
    let msg = refusal("gpt:64,64,64,4096", 4096, 7);
    assert!(
        msg.contains("activations per example") && msg.contains("16777216"),
        "{msg}"
    );
}

proptest! {
    /// No model text, however mangled, panics the grammar; what it accepts is shown and
    /// parsed back to the same spec, and survives JSON.
    #[test]
    fn the_grammar_never_panics_and_round_trips(
        text in "(gpt|mlp|cnn|softmax|embed|block|lnorm|head|dense|conv|pool|avgpool|dropout|flatten|untied|tied|relu|[:,/xstp0-9. é-]){0,12}",
        t in 1usize..12,
        classes in 0usize..12,
    ) {
        for shape in [vec![t + 1], vec![t, t], vec![t, t, 2]] {
            if let Ok(s) = ModelSpec::parse_shaped(&text, &shape, classes) {
                // (Softmax regression has no hidden layer: an empty text, named `softmax`.)
                let shown = Some(s.layers_text()).filter(|t| !t.is_empty());
                let shown = shown.unwrap_or_else(|| "softmax".into());
                let again = ModelSpec::parse_shaped(&shown, &shape, classes);
                prop_assert_eq!(again.as_ref().ok(), Some(&s), "{} -> {}", text, s);
                let json = serde_json::to_string(&s).unwrap();
                prop_assert_eq!(serde_json::from_str::<ModelSpec>(&json).ok(), Some(s));
            }
        }
        let _ = ModelSpec::check_text(&text);
        let _ = ModelSpec::parse(&text, t + 1, classes);
    }

    /// Every gpt of small sizes that parses round-trips; the sizes decide acceptance.
    #[test]
    fn gpt_sizes_round_trip(l in 0usize..4, d in 0usize..20, h in 0usize..6, t in 0usize..9, v in 0usize..9, untied: bool) {
        let text = format!("gpt:{l},{d},{h},{t}{}", if untied { "/untied" } else { "" });
        let ok = l >= 1 && d >= 1 && h >= 1 && t >= 1 && v >= 2 && d % h == 0;
        match gpt(&text, t, v) {
            Ok(s) => {
                prop_assert!(ok, "{} accepted", text);
                prop_assert_eq!(s.layers_text(), text);
                let info = s.sequence().unwrap();
                prop_assert_eq!((info.layers, info.dim, info.heads, info.context, info.vocab, info.tied), (l, d, h, t, v, !untied));
                prop_assert_eq!(s.param_len() as u128, crate::model::gpt::param_count(&info));
            }
            Err(e) => prop_assert!(!ok, "{} refused: {}", text, e),
        }
    }
}
