//! The teacher's experiments and the strip of guesses (issue 19).
//!
//! - [`first`]: the run's first experiment, or the ones a checkpoint kept.
//! - [`start_next`]: `POST /api/admin/experiment`: fresh weights (the run's initialisation
//!   with the next seed), the new settings, a new experiment id; the earlier experiments'
//!   points stay for overlay on the samples axis.
//! - [`GuessCache`]: `GET /api/guesses`, 16 fixed test images with the current parameters'
//!   guesses ([`guesses`]), computed at most every
//!   [`GUESS_EVERY`](super::history::GUESS_EVERY) and shared by every viewer
//!   ([`GuessCache`](super::history::GuessCache)).

use super::app::App;
use super::history::{unix_ms, Experiment, Experiments, Settings};
use crowdgrad_core::shard::Consistency;

/// What an experiment of `app` runs with now, its weights drawn from `seed`.
pub fn settings(app: &App, seed: u64) -> Settings {
    Settings {
        consistency: app.consistency().to_string(),
        lr: f64::from(app.admin.lr()),
        aggregation: app.cfg.training.aggregation.to_string(),
        model: app.cfg.training.model.clone(),
        optimizer: app.spec.optimizer.rule.name().to_string(),
        batch_size: app.spec.batch_size,
        seed,
        shards: app.spec.shards.len(),
        staleness: app.cfg.training.staleness.to_string(),
        local_steps: app.spec.local.steps.to_string(),
    }
}

/// The experiments a server starts with: those `saved` in the checkpoint it resumed (the
/// current one carries its samples over the restart), else experiment 1 with the run's seed.
pub fn first(app: &App, saved: Option<serde_json::Value>) -> Experiments {
    let mut x: Experiments = saved
        .and_then(|v| match serde_json::from_value(v) {
            Ok(x) => Some(x),
            Err(e) => {
                tracing::warn!(%e, "the checkpoint's evaluation history is unreadable; starting a new one");
                None
            }
        })
        .unwrap_or_default();
    if x.current().is_some() {
        x.resumed();
    } else {
        let s = settings(app, app.cfg.training.seed);
        x.start(Experiment::new(
            1,
            "Experiment 1".into(),
            s,
            app.samples(),
            unix_ms(),
        ));
    }
    x
}

/// What `POST /api/admin/experiment` asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct NextExperiment {
    /// Its name (1 to 80 characters).
    pub label: String,
    /// A consistency mode to switch to (the same changes as `set-consistency`).
    pub consistency: Option<Consistency>,
    /// A learning rate to set.
    pub lr: Option<f32>,
    /// An aggregation rule: must be the run's (a rule cannot change while shards run).
    pub aggregation: Option<String>,
}

/// Why an experiment was not started: HTTP status and message. Nothing changed.
pub type Refusal = (u16, String);

/// Parses the body of `POST /api/admin/experiment`:
/// `{"label": str, "consistency"?: str, "lr"?: number, "aggregation"?: str}`.
///
/// # Errors
/// A message for a 400.
pub fn parse(body: &[u8]) -> Result<NextExperiment, String> {
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("body must be JSON: {e}"))?;
    let o = v
        .as_object()
        .ok_or("body must be an object like {\"label\": \"sync:4\"}")?;
    for k in o.keys() {
        if !["label", "consistency", "lr", "aggregation"].contains(&k.as_str()) {
            return Err(format!(
                "unknown key {k:?} (expected label, consistency, lr, aggregation)"
            ));
        }
    }
    let label = o
        .get("label")
        .and_then(serde_json::Value::as_str)
        .ok_or("label must be a string")?
        .trim()
        .chars()
        .filter(|c| !c.is_control())
        .collect::<String>();
    if label.is_empty() || label.chars().count() > 80 {
        return Err("label must be 1 to 80 characters".into());
    }
    let consistency = match o.get("consistency") {
        None | Some(serde_json::Value::Null) => None,
        Some(c) => Some(
            Consistency::parse(c.as_str().ok_or("consistency must be a string")?)
                .map_err(|e| e.to_string())?,
        ),
    };
    let lr = match o.get("lr") {
        None | Some(serde_json::Value::Null) => None,
        Some(l) => {
            let lr = l.as_f64().ok_or("lr must be a number")? as f32;
            if !(lr.is_finite() && lr > 0.0) {
                return Err("lr must be finite and positive".into());
            }
            Some(lr)
        }
    };
    let aggregation = match o.get("aggregation") {
        None | Some(serde_json::Value::Null) => None,
        Some(a) => Some(
            a.as_str()
                .ok_or("aggregation must be a string")?
                .to_string(),
        ),
    };
    Ok(NextExperiment {
        label,
        consistency,
        lr,
        aggregation,
    })
}

/// Starts the next experiment (module doc). Everything is checked before anything changes.
///
/// # Errors
/// 409 with shards in other processes, for an unsafe consistency change or another
/// aggregation rule; 400 for a learning rate the optimizer refuses.
pub fn start_next(app: &App, next: NextExperiment) -> Result<Experiment, Refusal> {
    if app.remote.is_some() {
        return Err((
            409,
            "experiments need the shards in this process (not --shard-urls)".into(),
        ));
    }
    if let Some(a) = &next.aggregation {
        let parsed =
            crowdgrad_core::robust::Aggregation::parse(a).map_err(|e| (400, e.to_string()))?;
        if parsed != app.cfg.training.aggregation {
            return Err((
                409,
                format!(
                    "the aggregation rule cannot change while the shards run (this run uses {}); \
                     start the server with --aggregation {a}",
                    app.cfg.training.aggregation
                ),
            ));
        }
    }
    if let Some(lr) = next.lr {
        let mut probe = app.spec.optimizer;
        probe.lr = lr;
        probe.validate().map_err(|e| (400, e.to_string()))?;
    }
    if let Some(mode) = next.consistency {
        let from = app.consistency();
        if mode != from
            && matches!(mode, Consistency::Sync { .. })
            && !matches!(from, Consistency::Sync { .. })
        {
            return Err((
                409,
                format!(
                    "cannot switch from {from} to {mode} live: workers that joined under {from} \
                     pull the current version, not the next one; start the server with \
                     --consistency {mode}"
                ),
            ));
        }
        for (i, s) in app.shards.iter().enumerate() {
            if let Err(why) = s.set_consistency(mode) {
                return Err((if i == 0 { 409 } else { 500 }, why));
            }
        }
    }
    if let Some(lr) = next.lr {
        for s in &app.shards {
            s.set_lr(lr).map_err(|e| (500, e.to_string()))?;
        }
        app.admin.set_lr(lr);
    }
    let id = app
        .experiments
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .next_id();
    let seed = app.cfg.training.seed.wrapping_add(u64::from(id - 1));
    let initial = app.model.init_params(seed);
    for (s, r) in app.shards.iter().zip(app.spec.ranges()) {
        s.restart(initial[r.start..r.end].to_vec())
            .map_err(|e| (500, e.to_string()))?;
    }
    let mut e = Experiment::new(
        id,
        next.label,
        settings(app, seed),
        app.samples(),
        unix_ms(),
    );
    e.workers_seen = app.registry.summary().1.workers.map_or(0, |w| w.connected);
    app.experiments
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .start(e.clone());
    tracing::info!(id, label = %e.label, seed, "admin: next experiment started from fresh weights");
    Ok(e)
}

/// Test images in the strip.
pub const GUESS_IMAGES: usize = 16;

/// The guesses of the current parameters on [`GUESS_IMAGES`] test images spread over the test
/// set: `{"version", "images": [{"label", "guess", "confidence", "pixels", "width",
/// "height"}]}` (pixels: base64 of the grayscale bytes, row by row).
pub fn guesses(app: &App) -> serde_json::Value {
    let (params, versions) = app.params();
    let version = versions.iter().sum::<u64>() / versions.len().max(1) as u64;
    let test = &app.test;
    let classes = app.spec.dataset.classes;
    let (height, width) = match test.image_dims.as_slice() {
        [h, w, ..] => (*h, *w),
        _ => (1, test.features),
    };
    let mut ws = app.model.inference_workspace(1);
    let mut x = ndarray::Array2::zeros((1, test.features));
    let mut y = [0u8];
    let mut images = Vec::new();
    let n = test.len().min(GUESS_IMAGES);
    for k in 0..n {
        let i = k * test.len() / n;
        let idx = [i as u32];
        test.fill_batch(&idx, &mut x.view_mut(), &mut y);
        let label = y[0];
        // The loss of the one example under label c is -ln p(c).
        let probs: Vec<f64> = (0..classes)
            .map(|c| {
                let yc = [c as u8];
                app.model
                    .evaluate(&params, x.view(), &yc, &mut ws)
                    .map_or(0.0, |s| (-s.loss_sum).exp())
            })
            .collect();
        let (guess, confidence) =
            probs
                .iter()
                .enumerate()
                .fold((0, 0.0), |b, (c, &p)| if p > b.1 { (c, p) } else { b });
        let raw = test.pixels(i);
        let channels = (raw.len() / (width * height).max(1)).max(1);
        let gray: Vec<u8> = raw
            .chunks(channels)
            .take(width * height)
            .map(|c| (c.iter().map(|&v| u32::from(v)).sum::<u32>() / c.len() as u32) as u8)
            .collect();
        images.push(serde_json::json!({
            "label": label,
            "guess": guess,
            "confidence": confidence as f32,
            "pixels": base64(&gray),
            "width": width,
            "height": height,
        }));
    }
    serde_json::json!({ "version": version, "images": images })
}

/// Standard base64 with padding (RFC 4648).
pub fn base64(bytes: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for j in 0..4 {
            if j <= chunk.len() {
                out.push(ABC[(n >> (18 - 6 * j) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_rfc_examples() {
        for (input, want) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(input.as_bytes()), want);
        }
    }

    #[test]
    fn experiment_bodies_are_checked() {
        let ok = parse(br#"{"label": " sync ", "consistency": "ssp:2", "lr": 0.1}"#).unwrap();
        assert_eq!(ok.label, "sync");
        assert_eq!(ok.consistency, Some(Consistency::Ssp { bound: 2 }));
        assert_eq!(ok.lr, Some(0.1));
        for (bad, says) in [
            ("not json", "JSON"),
            ("[]", "object"),
            (r#"{"lr": 0.1}"#, "label"),
            (r#"{"label": ""}"#, "1 to 80"),
            (r#"{"label": "a", "lr": -1}"#, "positive"),
            (r#"{"label": "a", "lr": "x"}"#, "number"),
            (r#"{"label": "a", "consistency": "sometimes"}"#, ""),
            (r#"{"label": "a", "seed": 3}"#, "unknown key"),
        ] {
            let e = parse(bad.as_bytes()).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
