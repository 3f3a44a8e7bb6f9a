//! How one worker loop takes part in its process: the progress bar (or the slot where a
//! thread of a `--threads` worker posts its counters) and the cache of downloaded partitions.

use crowdgrad_core::data::Dataset;
use crowdgrad_core::spec::Threads;
use crowdgrad_core::worker::WorkerStats;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What each thread of a `--threads` worker last reported: its worker id and counters.
pub(super) type Slots = Arc<Mutex<Vec<(Option<u64>, WorkerStats)>>>;

pub(super) struct Progress {
    pub(super) bar: Option<indicatif::ProgressBar>,
    /// With several threads: where this one posts its counters (the bar sums them).
    pub(super) slot: Option<(Slots, usize)>,
    pub(super) last: Instant,
}

pub(super) fn spinner() -> indicatif::ProgressBar {
    let b = indicatif::ProgressBar::new_spinner();
    b.set_style(
        indicatif::ProgressStyle::with_template("{spinner} [{elapsed_precise}] {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    b
}

impl Progress {
    pub(super) fn update(&mut self, id: u64, stats: &WorkerStats, started: Instant, force: bool) {
        if !force && self.last.elapsed() < Duration::from_millis(200) {
            return;
        }
        self.last = Instant::now();
        if let Some((slots, i)) = &self.slot {
            if let Some(s) = slots.lock().unwrap_or_else(|p| p.into_inner()).get_mut(*i) {
                *s = (Some(id), stats.clone());
            }
        }
        let Some(bar) = &self.bar else { return };
        let rate = stats.samples as f64 / started.elapsed().as_secs_f64().max(1e-9);
        bar.set_message(format!(
            "worker {id} | {} samples | {rate:.0} samples/s | loss {:.4} | pushes {} ok, {} rejected | staleness {}",
            stats.samples, stats.ema_loss, stats.pushes_accepted, stats.pushes_rejected, stats.last_staleness
        ));
        bar.tick();
    }
}

/// Data partitions downloaded so far, by images path, shared by a worker's threads.
pub(super) type Cache = Arc<tokio::sync::Mutex<HashMap<String, Dataset>>>;

/// How one worker loop takes part in its process.
pub(super) struct ThreadCtx {
    /// As joined (`None`: a worker of one thread, joined as before threads existed).
    pub(super) threads: Option<Threads>,
    pub(super) cache: Cache,
    pub(super) progress: Progress,
}
