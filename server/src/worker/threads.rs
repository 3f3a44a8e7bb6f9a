//! `--threads N`: N worker loops on OS threads of their own, joined as the threads of one
//! volunteer, with one progress bar that sums them.

use super::net::Net;
use super::options::{base_urls, peak_rss_kib, Summary, WorkOptions};
use super::progress::{spinner, Cache, Progress, Slots, ThreadCtx};
use super::session::run_loop;
use crate::error::{Error, Result};
use crowdgrad_core::spec::Threads;
use crowdgrad_core::spec::MAX_THREADS;
use crowdgrad_core::worker::WorkerStats;
use futures_util::StreamExt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A key for this process' threads to join under ([`Threads::volunteer`]): 32 random hex
/// digits.
pub(super) fn volunteer_key() -> Result<String> {
    let bytes =
        crate::support::credential::run_secret().map_err(|e| Error::io("drawing a key", e))?;
    Ok(bytes[..16].iter().map(|b| format!("{b:02x}")).collect())
}

/// How long threads asked to stop may take before [`work`] returns without them (each one's
/// waits race the stop, so they take milliseconds; this bounds a thread stuck in a step).
pub(super) const THREADS_STOP_WITHIN: Duration = Duration::from_millis(1500);

pub(super) async fn work_threads(
    opts: WorkOptions,
    net: Net,
    shutdown: impl Future<Output = ()>,
) -> Result<Summary> {
    let n = opts.threads;
    let started = Instant::now();
    let volunteer = volunteer_key()?;
    let cache = Cache::default();
    let slots: Slots = Arc::new(Mutex::new(vec![(None, WorkerStats::default()); n]));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut finished = futures_util::stream::FuturesUnordered::new();
    for index in 0..n {
        let (tx, rx) = tokio::sync::oneshot::channel::<Result<Summary>>();
        let ctx = ThreadCtx {
            threads: Some(Threads {
                volunteer: volunteer.clone(),
                index: index as u32,
                count: n as u32,
            }),
            cache: cache.clone(),
            progress: Progress {
                bar: None,
                slot: Some((slots.clone(), index)),
                last: Instant::now(),
            },
        };
        let (opts, net, mut stop) = (opts.clone(), net.clone(), stop_rx.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("crowdgrad-worker-{index}"))
            .spawn(move || {
                let r = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| Error::io("building a runtime", e))
                    .and_then(|rt| {
                        let stopped = async move {
                            let _ = stop.wait_for(|s| *s).await;
                        };
                        let r = rt.block_on(run_loop(&opts, &net, ctx, stopped));
                        // An HTTP call stuck on a stalled link sits on a blocking thread until
                        // its own deadline: do not wait for it.
                        rt.shutdown_timeout(Duration::from_millis(100));
                        r
                    });
                let _ = tx.send(r);
            });
        if let Err(e) = spawned {
            let _ = stop_tx.send(true);
            return Err(Error::io("starting a worker thread", e));
        }
        finished.push(rx);
    }
    drop(stop_rx);
    let bar = opts.progress.then(spinner);
    let render = |force: bool| {
        let Some(bar) = &bar else { return };
        let slots = slots.lock().unwrap_or_else(|p| p.into_inner());
        let ids: Vec<String> = slots
            .iter()
            .map(|(id, _)| id.map_or_else(|| "-".into(), |i| i.to_string()))
            .collect();
        let sum = sum_stats(slots.iter().map(|(_, s)| s));
        let rate = sum.samples as f64 / started.elapsed().as_secs_f64().max(1e-9);
        bar.set_message(format!(
            "{n} threads, workers {} | {} samples | {rate:.0} samples/s | loss {:.4} | pushes {} ok, {} rejected | staleness {}",
            ids.join(","), sum.samples, sum.ema_loss, sum.pushes_accepted, sum.pushes_rejected, sum.last_staleness
        ));
        if force {
            bar.tick();
        }
    };
    let mut summaries = Vec::with_capacity(n);
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    let mut stop_by: Option<tokio::time::Instant> = None;
    let mut lost_threads = 0usize;
    tokio::pin!(shutdown);
    while summaries.len() + lost_threads < n {
        let give_up = async {
            match stop_by {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = finished.next() => match r {
                Some(Ok(s)) => {
                    let s = s?;
                    summaries.push(s);
                }
                // The thread died without an answer (a panic): count it, keep the others.
                Some(Err(_)) => lost_threads += 1,
                None => break,
            },
            _ = &mut shutdown, if stop_by.is_none() => {
                let _ = stop_tx.send(true);
                stop_by = Some(tokio::time::Instant::now() + THREADS_STOP_WITHIN);
            }
            _ = give_up => {
                tracing::warn!("{} threads did not stop within {THREADS_STOP_WITHIN:?}", n - summaries.len());
                lost_threads = n - summaries.len();
            }
            _ = tick.tick() => render(true),
        }
    }
    // Threads that ended by themselves (limits) leave the others running: stop them all.
    let _ = stop_tx.send(true);
    render(true);
    if let Some(b) = &bar {
        b.finish();
    }
    let seconds = started.elapsed().as_secs_f64();
    let stats = sum_stats(summaries.iter().map(|s| &s.stats));
    let mut last_error = summaries.iter().find_map(|s| s.last_error.clone());
    if lost_threads > 0 {
        last_error = Some(format!("{lost_threads} of {n} threads did not report"));
    }
    Ok(Summary {
        worker_ids: summaries
            .iter()
            .flat_map(|s| s.worker_ids.clone())
            .collect(),
        samples_per_sec: stats.samples as f64 / seconds.max(1e-9),
        stats,
        seconds,
        sessions: summaries.iter().map(|s| s.sessions).sum(),
        peak_rss_kib: peak_rss_kib(),
        last_error,
        refused: summaries.iter().any(|s| s.refused),
        threads: n,
        public_id: summaries.iter().find_map(|s| s.public_id.clone()),
    })
}

/// The counters of several threads as one worker's: counts add up, the loss is their mean,
/// staleness and read skew their largest.
pub(super) fn sum_stats<'a>(all: impl Iterator<Item = &'a WorkerStats>) -> WorkerStats {
    let mut sum = WorkerStats::default();
    let mut n = 0u32;
    for s in all {
        n += 1;
        sum.steps += s.steps;
        sum.samples += s.samples;
        sum.pushes_sent += s.pushes_sent;
        sum.pushes_accepted += s.pushes_accepted;
        sum.pushes_rejected += s.pushes_rejected;
        sum.pushes_lost += s.pushes_lost;
        sum.last_loss += s.last_loss;
        sum.ema_loss += s.ema_loss;
        sum.last_staleness = sum.last_staleness.max(s.last_staleness);
        sum.max_staleness = sum.max_staleness.max(s.max_staleness);
        sum.staleness_sum += s.staleness_sum;
        sum.read_skew = sum.read_skew.max(s.read_skew);
        sum.rounds += s.rounds;
        sum.local_steps = sum.local_steps.max(s.local_steps);
        sum.compute_s += s.compute_s;
        sum.wall_s = sum.wall_s.max(s.wall_s);
        sum.bytes_up += s.bytes_up;
        sum.bytes_down += s.bytes_down;
        if sum.last_error.is_none() {
            sum.last_error.clone_from(&s.last_error);
        }
        for (reason, n) in &s.rejected_by_reason {
            *sum.rejected_by_reason.entry(reason.clone()).or_default() += n;
        }
    }
    if n > 0 {
        sum.last_loss /= f64::from(n);
        sum.ema_loss /= f64::from(n);
    }
    sum
}

/// Runs a native worker until its step or time limit, or until `shutdown` completes: one
/// worker loop, or [`WorkOptions::threads`] of them as threads of one volunteer.
///
/// # Errors
/// Only for bad options (a malformed server URL, a thread count outside 1..=256) or when a
/// thread cannot be started; network trouble is retried with backoff and reported in the
/// summary.
pub async fn work(opts: WorkOptions, shutdown: impl Future<Output = ()>) -> Result<Summary> {
    base_urls(&opts.server)?;
    if !(1..=MAX_THREADS as usize).contains(&opts.threads) {
        return Err(Error::Config(format!(
            "--threads {} is outside 1..={MAX_THREADS}",
            opts.threads
        )));
    }
    let net = Net::new(&opts)?;
    if opts.threads == 1 {
        let ctx = ThreadCtx {
            threads: None,
            cache: Cache::default(),
            progress: Progress {
                bar: opts.progress.then(spinner),
                slot: None,
                last: Instant::now(),
            },
        };
        return run_loop(&opts, &net, ctx, shutdown).await;
    }
    work_threads(opts, net, shutdown).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_counters_add_up_as_one_volunteers() {
        let a = WorkerStats {
            steps: 10,
            samples: 320,
            pushes_accepted: 9,
            pushes_rejected: 1,
            ema_loss: 1.0,
            max_staleness: 3,
            wall_s: 2.0,
            ..Default::default()
        };
        let b = WorkerStats {
            steps: 5,
            samples: 160,
            pushes_accepted: 5,
            ema_loss: 3.0,
            max_staleness: 7,
            wall_s: 1.0,
            last_error: Some("shard 1: busy".into()),
            rejected_by_reason: [("too_stale".to_string(), 2)].into(),
            ..Default::default()
        };
        let s = sum_stats([&a, &b].into_iter());
        assert_eq!((s.steps, s.samples), (15, 480));
        assert_eq!((s.pushes_accepted, s.pushes_rejected), (14, 1));
        assert_eq!(s.ema_loss, 2.0, "the loss is the threads' mean");
        assert_eq!(s.max_staleness, 7, "staleness is the largest");
        assert_eq!(s.wall_s, 2.0, "wall time is the longest, not a sum");
        assert_eq!(s.last_error.as_deref(), Some("shard 1: busy"));
        assert_eq!(s.rejected_by_reason["too_stale"], 2);
        assert_eq!(sum_stats(std::iter::empty()).ema_loss, 0.0);
    }

    #[tokio::test]
    async fn bad_thread_counts_are_refused_before_anything_connects() {
        for n in [0, MAX_THREADS as usize + 1] {
            let mut o = WorkOptions::new("http://127.0.0.1:9");
            o.threads = n;
            let e = work(o, std::future::pending()).await.expect_err("refused");
            assert!(e.to_string().contains("--threads"), "{e}");
        }
    }
}
