//! `--sweep PARAM=V1,V2,...`: one configuration per value, and file-safe labels.

use super::config::*;
use crate::error::{Error, Result};

/// Names of the parameters `--sweep` accepts.
pub const SWEEP_PARAMS: [&str; 22] = [
    "consistency",
    "mode",
    "workers",
    "ssp",
    "staleness",
    "lr",
    "faulty",
    "fault",
    "dropout-every",
    "dropout-kind",
    "delay-ms",
    "step-ms",
    "batch-size",
    "aggregation",
    "local-steps",
    "inner-lr",
    "pull-encoding",
    "push-encoding",
    "overlap",
    "sybils",
    "sybil-at",
    "sybil-fault",
];

/// Expands `--sweep PARAM=V1,V2,...` over `base`: one `(label, config)` per value, in order.
///
/// # Errors
/// [`Error::Config`] for a malformed spec, an unknown parameter, or a value that makes an
/// invalid config.
pub fn sweep_configs(base: &SimArgs, spec: &str) -> Result<Vec<(String, SimConfig)>> {
    let (param, values) = spec
        .split_once('=')
        .ok_or_else(|| Error::Config(format!("--sweep {spec:?}: expected PARAM=V1,V2,...")))?;
    let param = param.trim();
    if !SWEEP_PARAMS.contains(&param) {
        return Err(Error::Config(format!(
            "--sweep: unknown parameter {param:?}; use one of {}",
            SWEEP_PARAMS.join(", ")
        )));
    }
    let sep = if values.contains(';') { ';' } else { ',' };
    let values: Vec<&str> = values
        .split(sep)
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .collect();
    if values.is_empty() || values.len() > 64 {
        return Err(Error::Config(format!(
            "--sweep {spec:?}: give between 1 and 64 values"
        )));
    }
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for v in values {
        if !seen.insert(v) {
            return Err(Error::Config(format!("--sweep: value {v:?} is repeated")));
        }
        let mut a = base.clone();
        let num = |what: &str| Error::Config(format!("--sweep {param}: bad {what} {v:?}"));
        match param {
            "consistency" | "mode" => a.training.consistency = v.into(),
            "workers" => a.workers = v.parse().map_err(|_| num("worker count"))?,
            "ssp" => a.training.consistency = format!("ssp:{v}"),
            "staleness" => a.training.staleness = v.into(),
            "lr" => a.training.lr = Some(v.parse().map_err(|_| num("learning rate"))?),
            "faulty" => a.faulty = v.parse().map_err(|_| num("fraction"))?,
            "fault" => a.fault = v.into(),
            "dropout-kind" => a.dropout_kind = v.into(),
            "dropout-every" => {
                a.dropout_every = Some(v.parse().map_err(|_| num("number of seconds"))?)
            }
            "delay-ms" => a.delay_ms = v.parse().map_err(|_| num("delay"))?,
            "aggregation" => a.training.aggregation = v.into(),
            "step-ms" => a.step_ms = v.parse().map_err(|_| num("step time"))?,
            "local-steps" => a.training.local_steps = Some(v.into()),
            "inner-lr" => a.training.inner_lr = Some(v.parse().map_err(|_| num("learning rate"))?),
            "pull-encoding" => a.training.pull_encoding = v.into(),
            "push-encoding" => a.training.push_encoding = v.into(),
            "overlap" if v == "on" || v == "off" => a.training.overlap = v.into(),
            "overlap" => return Err(num("overlap (use on or off)")),
            "sybils" => a.sybils = v.parse().map_err(|_| num("sybil count"))?,
            "sybil-at" => a.sybil_at = v.parse().map_err(|_| num("number of seconds"))?,
            "sybil-fault" => a.sybil_fault = v.into(),
            _ => a.training.batch_size = v.parse().map_err(|_| num("batch size"))?,
        }
        let cfg = a
            .check()
            .map_err(|e| Error::Config(format!("--sweep {param}={v}: {e}")))?;
        out.push((format!("{param}={v}"), cfg));
    }
    Ok(out)
}

/// A file-name-safe form of a label (`mode=ssp:2` -> `mode=ssp_2`).
pub fn slug(label: &str) -> String {
    label
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '=' | '-' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect()
}
