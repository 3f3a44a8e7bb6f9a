//! One row of `run.csv`: what the report writes and the plots draw.

use std::fmt::Write as _;

/// One evaluation point: a line of `run.csv`.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// Training examples computed so far (summed over workers).
    pub samples: u64,
    /// Simulated seconds since the start.
    pub sim_time_s: f64,
    /// Mean cross-entropy on the evaluated test examples.
    pub test_loss: f64,
    /// Accuracy on them.
    pub test_accuracy: f64,
    /// How many test examples were evaluated (the last row: the full test set).
    pub eval_examples: usize,
    /// Mean staleness of the pushes accepted since the previous row.
    pub mean_staleness: f64,
    /// Largest staleness accepted since the previous row.
    pub max_staleness: u64,
    /// Updates applied, summed over shards (the sum of the ShardCore versions).
    pub updates: u64,
    /// Push frames accepted so far (applied or buffered), summed over shards.
    pub accepted: u64,
    /// Push frames rejected so far (too stale, late, not finite...), summed over shards.
    pub rejected: u64,
    /// Of `accepted`, the sybils' (`--sybils`).
    pub sybil_accepted: u64,
    /// Of `rejected`, the sybils'.
    pub sybil_rejected: u64,
    /// Shard 0's norm reference at this moment (the per-step norm a push is bounded by, over
    /// `--norm-bound`); 0 before anything is known.
    pub norm_reference: f32,
    /// Workers online (connected and not paused) at this moment.
    pub workers_online: usize,
}

/// The columns of `run.csv`.
pub const CSV_HEADER: &str = "samples,sim_time_s,test_loss,test_accuracy,eval_examples,mean_staleness,max_staleness,updates,accepted,rejected,workers_online,sybil_accepted,sybil_rejected,norm_reference";

impl Row {
    pub(super) fn csv_line(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "{},{:.6},{:.6},{:.6},{},{:.4},{},{},{},{},{},{},{},{:.6}",
            self.samples,
            self.sim_time_s,
            self.test_loss,
            self.test_accuracy,
            self.eval_examples,
            self.mean_staleness,
            self.max_staleness,
            self.updates,
            self.accepted,
            self.rejected,
            self.workers_online,
            self.sybil_accepted,
            self.sybil_rejected,
            self.norm_reference
        );
    }
}
