//! What a simulation reports: evaluation rows ([`Row`], `run.csv`), the read log, per-worker
//! summaries, totals, and the sweep summary tables.

use super::config::*;
use super::plot;
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

pub use super::row::{Row, CSV_HEADER};

/// One read (a `Params` reply), as the simulated shard saw it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReadRecord {
    /// Simulated time, seconds.
    pub time_s: f64,
    /// Simulated worker (participant index).
    pub worker: usize,
    /// Worker id of its session (a rejoin gets a new id, as on the server).
    pub worker_id: u64,
    /// Shard.
    pub shard: usize,
    /// Version read.
    pub version: u64,
    /// SSP: the reader's clock.
    pub clock: Option<u64>,
    /// SSP: the slowest active clock.
    pub min_clock: Option<u64>,
}

/// What one simulated worker did.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerSummary {
    /// Index.
    pub index: usize,
    /// Its mean step time, seconds.
    pub mean_step_s: f64,
    /// Whether it is faulty (`--faulty`).
    pub faulty: bool,
    /// Whether it is a sybil (`--sybils`).
    pub sybil: bool,
    /// Data partition.
    pub partition: usize,
    /// Sessions (joins).
    pub sessions: u32,
    /// Gradients computed.
    pub steps: u64,
    /// Pushes acknowledged.
    pub pushes_accepted: u64,
    /// Pushes rejected.
    pub pushes_rejected: u64,
    /// Pushes lost with a connection.
    pub pushes_lost: u64,
}

/// What one group of participants (the workers, or the sybils) got from the shards.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PushCounts {
    /// Push frames that reached a shard (and other frames refused there).
    pub pushes: u64,
    /// Accepted (applied or buffered; zero pushes included).
    pub accepted: u64,
    /// Accepted after being scaled down to the norm bound (a trusted worker's rare outlier).
    pub clipped: u64,
    /// Refusals by error code name (`out_of_bounds`, `replayed`, `not_finite`, ...).
    pub refused: BTreeMap<String, u64>,
}

impl PushCounts {
    pub(super) fn reject(&mut self, code: crowdgrad_core::wire::ErrorCode) {
        *self.refused.entry(code.name().to_string()).or_insert(0) += 1;
    }

    /// Refused frames.
    pub fn rejected(&self) -> u64 {
        self.refused.values().sum()
    }

    /// Accepted / pushes (1 when there were none).
    pub fn acceptance(&self) -> f64 {
        if self.pushes == 0 {
            1.0
        } else {
            self.accepted as f64 / self.pushes as f64
        }
    }

    /// `A of N accepted (P%)[, refused: reason n, ...]`.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "{} of {} accepted ({:.2}%)",
            self.accepted,
            self.pushes,
            self.acceptance() * 100.0
        );
        if self.clipped > 0 {
            let _ = write!(s, ", {} of them scaled to the bound", self.clipped);
        }
        if !self.refused.is_empty() {
            let r: Vec<String> = self
                .refused
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect();
            let _ = write!(s, "; refused: {}", r.join(", "));
        }
        s
    }
}

/// Totals of a run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Totals {
    /// Training examples computed.
    pub samples: u64,
    /// Gradient steps computed.
    pub steps: u64,
    /// Push frames that reached a shard.
    pub pushes: u64,
    /// Accepted (applied or buffered).
    pub accepted: u64,
    /// Rejected.
    pub rejected: u64,
    /// Rejections by error code name (`too_stale`, `not_finite`, ...).
    pub rejected_by_reason: BTreeMap<String, u64>,
    /// Push frames corrupted by faulty workers (sent; sybils' not included).
    pub faulty_pushes: u64,
    /// The workers' pushes (honest and `--faulty` ones), as the shards answered them.
    pub worker_pushes: PushCounts,
    /// The sybils' pushes.
    pub sybil_pushes: PushCounts,
    /// Training examples the sybils computed (not in [`Totals::samples`], not in the budget).
    pub sybil_samples: u64,
    /// Joins refused by the server's admission bound (new identities against established
    /// ones, `crate::registry::admission`); the participant tries again 5 s later.
    pub joins_refused: u64,
    /// Per shard at the end: workers with a say in the norm reference, and workers on
    /// probation (`crowdgrad_core::session::ShardState::trust_counts`).
    pub trust: Vec<(usize, usize)>,
    /// Each shard's final version.
    pub shard_versions: Vec<u64>,
    /// Sync mode: gradients each shard still had buffered at the end.
    pub shard_pending: Vec<usize>,
    /// Sum of staleness over applied pushes.
    pub staleness_sum: u64,
    /// Largest staleness applied.
    pub staleness_max: u64,
    /// Simulated seconds.
    pub sim_seconds: f64,
    /// Events processed.
    pub events: u64,
    /// The run stopped because no step completed for a long simulated time (e.g. the model
    /// diverged to non-finite parameters that every worker refuses).
    pub stalled: bool,
}

impl Totals {
    /// Updates applied, summed over shards.
    pub fn updates(&self) -> u64 {
        self.shard_versions.iter().sum()
    }

    /// Mean staleness over accepted pushes.
    pub fn mean_staleness(&self) -> f64 {
        self.staleness_sum as f64 / self.accepted.max(1) as f64
    }
}

/// The outcome of [`run`].
#[derive(Debug, Clone)]
pub struct SimResult {
    /// The configuration that ran.
    pub config: SimConfig,
    /// Evaluation rows; the last one is on the full test set.
    pub rows: Vec<Row>,
    /// Totals.
    pub totals: Totals,
    /// Per worker.
    pub workers: Vec<WorkerSummary>,
    /// Every read, when [`SimConfig::log_reads`] was set.
    pub reads: Vec<ReadRecord>,
    /// The final parameters (the shards' values, concatenated).
    pub final_params: Vec<f32>,
    /// Wall-clock seconds the run took (not part of the CSV: it is not deterministic).
    pub wall_seconds: f64,
}

impl SimResult {
    /// `run.csv`: [`CSV_HEADER`] and one line per row. Deterministic for a config and seed.
    pub fn csv(&self) -> String {
        let mut out = String::with_capacity(64 * (self.rows.len() + 1));
        out.push_str(CSV_HEADER);
        out.push('\n');
        for r in &self.rows {
            r.csv_line(&mut out);
        }
        out
    }

    /// The last row (on the full test set).
    pub fn last(&self) -> Option<&Row> {
        self.rows.last()
    }

    /// Final accuracy on the full test set.
    pub fn final_accuracy(&self) -> f64 {
        self.last().map_or(0.0, |r| r.test_accuracy)
    }

    /// The first row at or above `accuracy`: (samples, simulated seconds).
    pub fn reached(&self, accuracy: f64) -> Option<(u64, f64)> {
        self.rows
            .iter()
            .find(|r| r.test_accuracy >= accuracy)
            .map(|r| (r.samples, r.sim_time_s))
    }

    /// One line about the workers and rejections: step-time spread, faulty workers, sessions,
    /// rejections by reason.
    pub fn digest(&self) -> String {
        let mut steps: Vec<f64> = self
            .workers
            .iter()
            .filter(|w| !w.sybil)
            .map(|w| w.mean_step_s)
            .collect();
        steps.sort_by(f64::total_cmp);
        let ms = |i: usize| steps.get(i).map_or(0.0, |s| s * 1e3);
        let mut s = format!(
            "worker step times: fastest {:.0} ms, median {:.0} ms, slowest {:.0} ms",
            ms(0),
            ms(steps.len() / 2),
            ms(steps.len().saturating_sub(1))
        );
        let faulty = self.workers.iter().filter(|w| w.faulty).count();
        if faulty > 0 {
            let _ = write!(s, "; {faulty} faulty");
        }
        let sessions: u32 = self
            .workers
            .iter()
            .filter(|w| !w.sybil)
            .map(|w| w.sessions)
            .sum();
        let _ = write!(s, "; {sessions} sessions");
        if !self.totals.rejected_by_reason.is_empty() {
            let reasons: Vec<String> = self
                .totals
                .rejected_by_reason
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect();
            let _ = write!(s, "; rejected: {}", reasons.join(", "));
        }
        s
    }

    /// With sybils: one line on what the workers' and the sybils' pushes got, and trust at
    /// the end (shard 0). `None` without sybils.
    pub fn sybil_digest(&self) -> Option<String> {
        let c = &self.config;
        if c.sybils == 0 {
            return None;
        }
        let (trusted, probation) = self.totals.trust.first().copied().unwrap_or_default();
        Some(format!(
            "workers' pushes: {}; {} sybils ({}, from {} s): {}; joins refused {}; shard 0 at the end: {trusted} trusted, {probation} on probation",
            self.totals.worker_pushes.describe(),
            c.sybils,
            c.sybil_fault,
            c.sybil_at,
            self.totals.sybil_pushes.describe(),
            self.totals.joins_refused,
        ))
    }

    /// Simulated seconds per wall-clock second.
    pub fn speedup(&self) -> f64 {
        self.totals.sim_seconds / self.wall_seconds.max(1e-9)
    }
}

/// One line of the summary table.
#[derive(Debug, Clone, PartialEq)]
pub struct SummaryLine {
    /// What varied (`mode=async`), or `run` for a single run.
    pub label: String,
    /// Final accuracy on the full test set.
    pub final_accuracy: f64,
    /// Final test loss.
    pub final_loss: f64,
    /// First evaluation at >= 95%: samples and simulated seconds.
    pub to_95: Option<(u64, f64)>,
    /// Totals.
    pub totals: Totals,
    /// Wall seconds.
    pub wall_seconds: f64,
}

impl SummaryLine {
    /// The summary of one run.
    pub fn of(label: impl Into<String>, r: &SimResult) -> Self {
        Self {
            label: label.into(),
            final_accuracy: r.final_accuracy(),
            final_loss: r.last().map_or(f64::NAN, |l| l.test_loss),
            to_95: r.reached(0.95),
            totals: r.totals.clone(),
            wall_seconds: r.wall_seconds,
        }
    }
}

/// `summary.csv`: deterministic (no wall-clock figures).
pub fn summary_csv(lines: &[SummaryLine]) -> String {
    let mut s = String::from(
        "label,final_accuracy,final_loss,samples_to_95,sim_s_to_95,samples,sim_seconds,updates,accepted,rejected,mean_staleness,max_staleness,worker_acceptance,sybil_pushes,sybil_accepted\n",
    );
    for l in lines {
        let (a, b) = l.to_95.map_or((String::new(), String::new()), |(n, t)| {
            (n.to_string(), format!("{t:.3}"))
        });
        let t = &l.totals;
        let _ = writeln!(
            s,
            "{},{:.6},{:.6},{a},{b},{},{:.3},{},{},{},{:.4},{},{:.6},{},{}",
            csv_field(&l.label),
            l.final_accuracy,
            l.final_loss,
            t.samples,
            t.sim_seconds,
            t.updates(),
            t.accepted,
            t.rejected,
            t.mean_staleness(),
            t.staleness_max,
            t.worker_pushes.acceptance(),
            t.sybil_pushes.pushes,
            t.sybil_pushes.accepted
        );
    }
    s
}

pub(super) fn csv_field(s: &str) -> String {
    if s.contains([',', '"']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// `summary.md`: the table a teacher pastes into notes (includes wall time and speed-up).
pub fn summary_markdown(lines: &[SummaryLine]) -> String {
    let mut s = String::from(
        "| run | final accuracy | samples to 95% | sim time to 95% | samples | sim time | updates | rejected | mean staleness | wall time | faster than real time |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for l in lines {
        let t = &l.totals;
        let (n, secs) = l
            .to_95
            .map_or(("not reached".into(), "–".into()), |(n, t)| {
                (n.to_string(), format!("{t:.1} s"))
            });
        let _ = writeln!(
            s,
            "| `{}` | {:.2}% | {n} | {secs} | {} | {:.1} s | {} | {} | {:.2} | {:.1} s | {:.0}× |",
            l.label,
            l.final_accuracy * 100.0,
            t.samples,
            t.sim_seconds,
            t.updates(),
            t.rejected,
            t.mean_staleness(),
            l.wall_seconds,
            t.sim_seconds / l.wall_seconds.max(1e-9)
        );
    }
    s
}

pub(super) fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

/// Writes `run.csv` and `run.svg` for one result into `dir`.
///
/// # Errors
/// When the directory or a file cannot be written.
pub fn write_run(dir: &Path, title: &str, r: &SimResult) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    write(&dir.join("run.csv"), &r.csv())?;
    let svg = plot::accuracy_svg(title, &[plot::Series::of("accuracy", &r.rows)]);
    write(&dir.join("run.svg"), &svg)
}
