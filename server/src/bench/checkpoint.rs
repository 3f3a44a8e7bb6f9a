//! `crowdgrad bench checkpoint` (issue 9): what checkpoints cost.
//!
//! 1. Per model (default: the MLP `mlp:128` and `mlp:12000`, 9.5M parameters), a checkpoint of
//!    a two-shard server's state (default optimizer, Adagrad) written to a local directory, `--repeat` times: the
//!    time the shards are locked for the snapshot ([`Shard::export`]: the values' `Arc` and a
//!    copy of the optimizer state), the encode time (safetensors + SHA-256, off the reactor in
//!    the server), the durable write (temporary file, fsync, rename, directory fsync) and the
//!    size. The exact path `crowdgrad serve` takes ([`Checkpoint::assemble`], [`Store::put`]).
//! 2. Training throughput of a real `crowdgrad serve` process and `crowdgrad work` processes
//!    ([`super::e2e`]) with `--checkpoint-every 1` (aggressive) against none, interleaved
//!    `--repeat` times, side by side: the samples/s lost while checkpointing.

use super::e2e;
use crate::checkpoint::format::Checkpoint;
use crate::checkpoint::store::{self, Store};
use crate::error::{Error, Result};
use crate::shard::Shard;
use bytes::Bytes;
use clap::Args;
use crowdgrad_core::spec::{DataInfo, RunParams, RunSpec};
use std::path::PathBuf;
use std::time::Instant;

/// Flags of `crowdgrad bench checkpoint`.
#[derive(Debug, Clone, Args)]
pub struct CheckpointArgs {
    /// Models whose checkpoint is written (model text as for `serve --model`).
    #[arg(long, value_delimiter = ',', default_value = "mlp:128,mlp:12000")]
    pub models: Vec<String>,
    /// Repetitions of each measurement (medians, min and max are reported).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Where checkpoints are written (a scratch directory under it, removed afterwards).
    #[arg(long, default_value = "target/tmp/bench-checkpoint")]
    pub dir: PathBuf,
    /// Worker processes in the throughput runs (0: skip them).
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Seconds per throughput run.
    #[arg(long, default_value_t = 20.0)]
    pub seconds: f64,
    /// MNIST directory for the throughput runs.
    #[arg(long, default_value = "data/mnist")]
    pub data_dir: PathBuf,
}

/// One checkpoint write, measured.
#[derive(Debug, Clone, Copy)]
pub struct Write {
    /// Seconds the shards were locked (all shards).
    pub lock_s: f64,
    /// Seconds to assemble and encode.
    pub encode_s: f64,
    /// Seconds to write it durably.
    pub write_s: f64,
    /// Bytes.
    pub bytes: u64,
}

fn spec(model: &str) -> Result<RunSpec> {
    Ok(RunSpec::build(RunParams {
        run_id: "bench".into(),
        model: model.into(),
        // The server's default optimizer (Adagrad: one state slot as large as the model).
        optimizer: crate::config::ServeConfig::defaults("data/mnist")
            .training
            .optimizer,
        batch_size: 32,
        seed: 1,
        consistency: crowdgrad_core::shard::Consistency::Async,
        shards: 2,
        dataset: DataInfo {
            name: "mnist".into(),
            image_dims: vec![28, 28],
            classes: 10,
            train_len: 60_000,
            test_len: 10_000,
            text: None,
        },
        local: Default::default(),
        normalize: Default::default(),
    })?)
}

/// Writes `repeat` checkpoints of `model`'s two shards (values set, Adagrad state filled by
/// one update) into `dir`.
///
/// # Errors
/// The model does not build, or a write fails.
pub async fn writes(model: &str, dir: &std::path::Path, repeat: usize) -> Result<Vec<Write>> {
    let spec = spec(model)?;
    let mut opts = crate::config::ServeConfig::defaults("data/mnist")
        .training
        .shard_setup(true, spec.model.param_len());
    opts.optimizer = spec.optimizer;
    opts.consistency = spec.consistency;
    let model_ = crowdgrad_core::model::Model::new(spec.model.clone())?;
    let init = model_.init_params(1);
    let shards: Vec<Shard> = spec
        .ranges()
        .iter()
        .enumerate()
        .map(|(i, r)| Shard::start(i as u32, *r, init[r.start..r.end].to_vec(), opts))
        .collect::<Result<_>>()?;
    drop(init);
    let store = Store::open(&dir.to_string_lossy())?;
    let mut out = Vec::new();
    for seq in 0..repeat as u64 {
        let t = Instant::now();
        let exports: Vec<_> = shards.iter().map(Shard::export).collect();
        let lock_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let s = spec.clone();
        let bytes = tokio::task::spawn_blocking(move || {
            Checkpoint::assemble(s, &exports, serde_json::json!({ "contributors": [] }))?.encode()
        })
        .await
        .map_err(|e| Error::Task(e.to_string()))??;
        let encode_s = t.elapsed().as_secs_f64();
        let size = bytes.len() as u64;
        let t = Instant::now();
        store.put(&store::name(seq + 1), Bytes::from(bytes)).await?;
        out.push(Write {
            lock_s,
            encode_s,
            write_s: t.elapsed().as_secs_f64(),
            bytes: size,
        });
    }
    Ok(out)
}

/// Median, min and max.
fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return (0.0, 0.0, 0.0);
    }
    (v[n / 2], v[0], v[n - 1])
}

fn ms(v: (f64, f64, f64)) -> String {
    format!("{:.1} ms ({:.1}–{:.1})", v.0 * 1e3, v.1 * 1e3, v.2 * 1e3)
}

/// `crowdgrad bench checkpoint`: prints both tables.
///
/// # Errors
/// A write or a process that fails.
pub fn cli(a: &CheckpointArgs) -> Result<()> {
    if a.repeat == 0 || a.repeat > 100 {
        return Err(Error::Config("--repeat must be 1..=100".into()));
    }
    let scratch = a.dir.join(format!("run-{}", std::process::id()));
    let rt = tokio::runtime::Runtime::new().map_err(|e| Error::io("runtime", e))?;
    println!("| model | params | size | shards locked | encode | durable write | total |");
    println!("|---|---|---|---|---|---|---|");
    for m in &a.models {
        let dir = scratch.join(m.replace([':', '/'], "_"));
        let w = rt.block_on(writes(m, &dir, a.repeat))?;
        let _ = std::fs::remove_dir_all(&dir);
        let params = spec(m)?.model.param_len();
        let size = w.first().map_or(0, |w| w.bytes);
        println!(
            "| {m} | {params} | {:.1} MB | {} | {} | {} | {} |",
            size as f64 / 1e6,
            ms(spread(w.iter().map(|w| w.lock_s).collect())),
            ms(spread(w.iter().map(|w| w.encode_s).collect())),
            ms(spread(w.iter().map(|w| w.write_s).collect())),
            ms(spread(
                w.iter()
                    .map(|w| w.lock_s + w.encode_s + w.write_s)
                    .collect()
            )),
        );
    }
    drop(rt);
    if a.workers > 0 {
        let exe = std::env::current_exe().map_err(|e| Error::io("own path", e))?;
        println!();
        println!(
            "| run | checkpoints | samples/s | steps/s | server CPU/step | load avg |\n|---|---|---|---|---|---|"
        );
        let (mut off, mut on) = (Vec::new(), Vec::new());
        for i in 0..a.repeat {
            for every in [None, Some("1")] {
                let mut args = Vec::new();
                if let Some(e) = every {
                    let d = scratch.join(format!("serve-{i}"));
                    args = vec![
                        "--checkpoint-dir".into(),
                        d.to_string_lossy().into_owned(),
                        "--checkpoint-every".into(),
                        e.into(),
                    ];
                }
                let r = e2e(&exe, &a.data_dir, a.workers, a.seconds, &args)?;
                println!(
                    "| {} | {} | {:.0} | {:.0} | {:.3} ms | {:.2} |",
                    i + 1,
                    every.map_or("off".to_string(), |e| format!("every {e} s")),
                    r.samples_per_sec,
                    r.steps_per_sec,
                    r.server_cpu_ms_per_step,
                    r.load_avg
                );
                if every.is_some() {
                    on.push(r.samples_per_sec);
                } else {
                    off.push(r.samples_per_sec);
                }
            }
        }
        let (m_off, m_on) = (spread(off).0, spread(on).0);
        println!(
            "\nmedian samples/s: off {m_off:.0}, every 1 s {m_on:.0}: {:+.1}% with checkpoints",
            (m_on / m_off.max(1e-9) - 1.0) * 100.0
        );
    }
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(())
}
