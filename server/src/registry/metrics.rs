//! `GET /metrics`: the server's counters in the Prometheus text format (OpenMetrics 1.0, which
//! Prometheus scrapes natively), encoded by the `prometheus-client` crate.
//!
//! There is no second counting path: at scrape time a [`Scrape`] is read from the sources the
//! dashboard uses too (the [`Registry`]'s per-shard counters and worker totals, the shards'
//! versions, apply-latency histograms and byte counters, the sample rate) and encoded through a
//! [`Collector`]. What only this module keeps is the last checkpoint's size and time, which the
//! checkpoint writer reports with [`Metrics::checkpoint_written`].
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `crowdgrad_pushes_applied_total` | counter | `shard` |
//! | `crowdgrad_pushes_rejected_total` | counter | `shard`, `reason` (error code name) |
//! | `crowdgrad_frames_rejected_total` | counter | `shard`, `reason` |
//! | `crowdgrad_pushes_dropped_total` | counter | `shard` (sync pushes dropped from their round: the worker was quarantined) |
//! | `crowdgrad_pushes_clipped_total` | counter | `shard` (pushes over the norm bound scaled down to it: a trusted worker's rare outlier) |
//! | `crowdgrad_pulls_total` | counter | `shard` |
//! | `crowdgrad_samples_total` | counter | |
//! | `crowdgrad_samples_per_second` | gauge | |
//! | `crowdgrad_push_staleness` | histogram (le 0..15, +Inf) | `shard` |
//! | `crowdgrad_apply_seconds` | histogram | `shard` |
//! | `crowdgrad_shard_version` | gauge | `shard` |
//! | `crowdgrad_egress_budget_bytes_per_second` | gauge | `shard` (its share of `--egress-budget`; absent when off) |
//! | `crowdgrad_pace_seconds` | gauge | `shard` (the pace it tells workers, issue 18; 0 = none) |
//! | `crowdgrad_bytes_received_total` / `crowdgrad_bytes_sent_total` | counter | `shard` |
//! | `crowdgrad_workers_connected` / `crowdgrad_workers_registered` | gauge | `kind` |
//! | `crowdgrad_remote_shard_up` | gauge | `shard` (coordinator with `--shard-urls`) |
//! | `crowdgrad_checkpoint_size_bytes` / `crowdgrad_checkpoint_timestamp_seconds` / `crowdgrad_checkpoint_age_seconds` | gauge | (after the first checkpoint) |
//! | `crowdgrad_uptime_seconds` | gauge | |
//! | `crowdgrad_test_accuracy` / `crowdgrad_test_loss` | gauge | (coordinator, after the first evaluation) |
//! | `crowdgrad_test_bits_per_token` | gauge | (coordinator, language models, after the first evaluation) |
//! | `crowdgrad_spot_checks_total` | counter | `result`: passed, failed, skipped_version, refused_version, skipped_unknown, dropped_queue, refused_busy, dropped_quarantined (with `--spot-check`) |
//! | `crowdgrad_spot_check_vouched_total`, `crowdgrad_spot_check_rollbacks_total`, `crowdgrad_spot_check_versions_undone_total`, `crowdgrad_spot_check_poisoned_undone_total`, `crowdgrad_spot_check_poisoned_kept_total`, `crowdgrad_spot_check_healed_total` | counter | (with `--spot-check`) vouchings, rollbacks, versions they undid, the poisoner's pushes among them, its unchecked pushes older than the history (not undone), shards left to heal |
//! | `crowdgrad_spot_checks_sampled_total` | counter | (with `--spot-check`) |
//! | `crowdgrad_workers_quarantined` / `crowdgrad_identities_quarantined` | gauge | |

use crate::registry::{Counters, STALENESS_BUCKETS};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use std::sync::Mutex;

/// The content type of [`render`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Apply-latency buckets: 1 µs to ~0.5 s, doubling.
pub fn apply_histogram() -> Histogram {
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        1e-6, 2.0, 20,
    ))
}

/// What only the metrics keep: the last checkpoint. Cheap to share (`Arc<App>` holds one).
#[derive(Debug, Default)]
pub struct Metrics {
    checkpoint: Mutex<Option<Checkpoint>>,
}

/// The last checkpoint written.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Checkpoint {
    /// Its size in bytes.
    pub bytes: u64,
    /// When it was written, seconds since the Unix epoch.
    pub unix_time: f64,
}

impl Metrics {
    /// Records a checkpoint of `bytes` bytes written at `unix_time` (seconds since the epoch);
    /// the checkpoint writer calls it after each successful write.
    pub fn checkpoint_written(&self, bytes: u64, unix_time: f64) {
        *self.checkpoint.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(Checkpoint { bytes, unix_time });
    }

    /// The last checkpoint recorded, if any.
    pub fn checkpoint(&self) -> Option<Checkpoint> {
        *self.checkpoint.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One shard as scraped.
#[derive(Debug, Clone)]
pub struct ShardScrape {
    /// Shard index.
    pub id: u32,
    /// Its version.
    pub version: u64,
    /// The registry's counters for it.
    pub counters: Counters,
    /// Time spent applying updates (a handle on the shard's own histogram).
    pub apply: Option<Histogram>,
    /// Frame bytes received from workers (up).
    pub bytes_received: u64,
    /// Frame bytes sent to workers (down).
    pub bytes_sent: u64,
    /// Its share of the egress budget, bytes per second (`None`: no budget; issue 18).
    pub egress_budget: Option<f64>,
    /// Its pace now, seconds (0: none).
    pub pace_s: f64,
}

/// Everything one scrape shows, read from the live sources.
#[derive(Debug, Clone, Default)]
pub struct Scrape {
    /// The shards served here (in-process, or the one of a shard process).
    pub shards: Vec<ShardScrape>,
    /// The registry's totals, with the workers by kind.
    pub totals: Counters,
    /// Examples per second over the last few seconds.
    pub samples_per_sec: f64,
    /// Remote shards' reachability (coordinator with `--shard-urls`): (index, up).
    pub remote_up: Vec<(u32, bool)>,
    /// The last checkpoint.
    pub checkpoint: Option<Checkpoint>,
    /// Seconds since the process started serving.
    pub uptime_s: f64,
    /// Now, seconds since the Unix epoch (for the checkpoint's age).
    pub now_unix: f64,
    /// The evaluator's last figures on the test set, (accuracy in [0, 1], mean loss): the
    /// run's main curve for Grafana. `None` before the first evaluation and where nothing is
    /// evaluated (a shard process).
    pub test: Option<(f64, f64)>,
    /// A language model's validation bits per token at the last evaluation (`None` for other
    /// models and before the first evaluation).
    pub test_bits_per_token: Option<f64>,
}

impl Collector for Scrape {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        type Labels = Vec<(&'static str, String)>;
        fn shard(id: u32) -> Labels {
            vec![("shard", id.to_string())]
        }
        fn counter(
            enc: &mut DescriptorEncoder,
            name: &str,
            help: &str,
            rows: &[(Labels, u64)],
        ) -> Result<(), std::fmt::Error> {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
            if let [(labels, v)] = rows {
                if labels.is_empty() {
                    return ConstCounter::new(*v).encode(m);
                }
            }
            for (labels, v) in rows {
                ConstCounter::new(*v).encode(m.encode_family(labels)?)?;
            }
            Ok(())
        }
        fn gauge(
            enc: &mut DescriptorEncoder,
            name: &str,
            help: &str,
            rows: &[(Labels, f64)],
        ) -> Result<(), std::fmt::Error> {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
            if let [(labels, v)] = rows {
                if labels.is_empty() {
                    return ConstGauge::new(*v).encode(m);
                }
            }
            for (labels, v) in rows {
                ConstGauge::new(*v).encode(m.encode_family(labels)?)?;
            }
            Ok(())
        }
        let per_shard = |f: &dyn Fn(&ShardScrape) -> u64| -> Vec<(Labels, u64)> {
            self.shards.iter().map(|s| (shard(s.id), f(s))).collect()
        };
        let by_reason =
            |f: &dyn Fn(&Counters) -> &std::collections::BTreeMap<&'static str, u64>| {
                let mut rows = Vec::new();
                for s in &self.shards {
                    for (reason, n) in f(&s.counters) {
                        rows.push((
                            vec![
                                ("shard", s.id.to_string()),
                                ("reason", (*reason).to_string()),
                            ],
                            *n,
                        ));
                    }
                }
                rows
            };
        counter(
            &mut enc,
            "crowdgrad_pushes_applied",
            "Pushes applied (sync mode: accepted into an aggregate).",
            &per_shard(&|s| s.counters.pushes_applied),
        )?;
        counter(
            &mut enc,
            "crowdgrad_pushes_rejected",
            "Pushes rejected, by error code.",
            &by_reason(&|c| &c.rejected_by_reason),
        )?;
        counter(
            &mut enc,
            "crowdgrad_frames_rejected",
            "Frames other than pushes refused with an error frame, by error code.",
            &by_reason(&|c| &c.frames_rejected_by_reason),
        )?;
        counter(
            &mut enc,
            "crowdgrad_pushes_dropped",
            "Sync pushes taken out of their pending round because their worker was quarantined.",
            &per_shard(&|s| s.counters.pushes_dropped),
        )?;
        counter(
            &mut enc,
            "crowdgrad_pushes_clipped",
            "Pushes over the norm bound scaled down to it and applied (a trusted worker's rare outlier).",
            &per_shard(&|s| s.counters.pushes_clipped),
        )?;
        counter(
            &mut enc,
            "crowdgrad_pulls",
            "Pulls answered.",
            &per_shard(&|s| s.counters.pulls),
        )?;
        counter(
            &mut enc,
            "crowdgrad_bytes_received",
            "Frame bytes received from workers (pushes and control frames).",
            &per_shard(&|s| s.bytes_received),
        )?;
        counter(
            &mut enc,
            "crowdgrad_bytes_sent",
            "Frame bytes sent to workers (parameters and replies).",
            &per_shard(&|s| s.bytes_sent),
        )?;
        counter(
            &mut enc,
            "crowdgrad_samples",
            "Examples behind the applied pushes (once per step).",
            &[(Vec::new(), self.totals.samples)],
        )?;
        gauge(
            &mut enc,
            "crowdgrad_samples_per_second",
            "Examples per second over the last 5 s.",
            &[(Vec::new(), self.samples_per_sec)],
        )?;
        gauge(
            &mut enc,
            "crowdgrad_egress_budget_bytes_per_second",
            "The shard's share of the egress budget for parameters sent to workers (--egress-budget; absent: off).",
            &self
                .shards
                .iter()
                .filter_map(|s| Some((shard(s.id), s.egress_budget?)))
                .collect::<Vec<_>>(),
        )?;
        gauge(
            &mut enc,
            "crowdgrad_pace_seconds",
            "The shard's pace: its Params bytes to every connected worker over its budget share, the least interval between one worker's pulls it asks for (0: none).",
            &self
                .shards
                .iter()
                .map(|s| (shard(s.id), s.pace_s))
                .collect::<Vec<_>>(),
        )?;
        gauge(
            &mut enc,
            "crowdgrad_shard_version",
            "Updates applied to the shard.",
            &self
                .shards
                .iter()
                .map(|s| (shard(s.id), s.version as f64))
                .collect::<Vec<_>>(),
        )?;
        {
            let mut m = enc.encode_descriptor(
                "crowdgrad_push_staleness",
                "Staleness (shard version minus base version) of applied pushes.",
                None,
                MetricType::Histogram,
            )?;
            for s in &self.shards {
                let c = &s.counters;
                let buckets: Vec<(f64, u64)> = (0..STALENESS_BUCKETS)
                    .map(|i| {
                        let le = if i + 1 == STALENESS_BUCKETS {
                            f64::MAX
                        } else {
                            i as f64
                        };
                        (le, c.staleness_hist.get(i).copied().unwrap_or(0))
                    })
                    .collect();
                let count = buckets.iter().map(|b| b.1).sum();
                let labels = shard(s.id);
                m.encode_family(&labels)?.encode_histogram::<Labels>(
                    c.staleness_sum as f64,
                    count,
                    &buckets,
                    None,
                )?;
            }
        }
        {
            let mut m = enc.encode_descriptor(
                "crowdgrad_apply_seconds",
                "Time an update spends in the shard's apply, under the shard's lock.",
                None,
                MetricType::Histogram,
            )?;
            for s in &self.shards {
                if let Some(h) = &s.apply {
                    let labels = shard(s.id);
                    h.encode(m.encode_family(&labels)?)?;
                }
            }
        }
        if let Some(w) = self.totals.workers {
            let kinds = |f: &dyn Fn(&crate::registry::KindCount) -> u64| -> Vec<(Labels, f64)> {
                [("native", &w.native), ("browser", &w.browser)]
                    .into_iter()
                    .map(|(k, c)| (vec![("kind", k.to_string())], f(c) as f64))
                    .collect()
            };
            gauge(
                &mut enc,
                "crowdgrad_workers_connected",
                "Workers with at least one shard connection open, by kind.",
                &kinds(&|c| c.connected),
            )?;
            gauge(
                &mut enc,
                "crowdgrad_workers_registered",
                "Workers registered, by kind.",
                &kinds(&|c| c.registered),
            )?;
        }
        if !self.remote_up.is_empty() {
            gauge(
                &mut enc,
                "crowdgrad_remote_shard_up",
                "1 when the remote shard process answered its last health check.",
                &self
                    .remote_up
                    .iter()
                    .map(|(id, up)| (shard(*id), if *up { 1.0 } else { 0.0 }))
                    .collect::<Vec<_>>(),
            )?;
        }
        if let Some(c) = self.checkpoint {
            gauge(
                &mut enc,
                "crowdgrad_checkpoint_size_bytes",
                "Size of the last checkpoint written.",
                &[(Vec::new(), c.bytes as f64)],
            )?;
            gauge(
                &mut enc,
                "crowdgrad_checkpoint_timestamp_seconds",
                "When the last checkpoint was written (Unix time).",
                &[(Vec::new(), c.unix_time)],
            )?;
            gauge(
                &mut enc,
                "crowdgrad_checkpoint_age_seconds",
                "Seconds since the last checkpoint was written.",
                &[(Vec::new(), (self.now_unix - c.unix_time).max(0.0))],
            )?;
        }
        gauge(
            &mut enc,
            "crowdgrad_uptime_seconds",
            "Seconds since the server started.",
            &[(Vec::new(), self.uptime_s)],
        )?;
        if let Some((accuracy, loss)) = self.test {
            gauge(
                &mut enc,
                "crowdgrad_test_accuracy",
                "Accuracy of the current parameters on the test set at the last evaluation, 0 to 1.",
                &[(Vec::new(), accuracy)],
            )?;
            gauge(
                &mut enc,
                "crowdgrad_test_loss",
                "Mean loss of the current parameters on the test set at the last evaluation.",
                &[(Vec::new(), loss)],
            )?;
        }
        if let Some(bits) = self.test_bits_per_token {
            gauge(
                &mut enc,
                "crowdgrad_test_bits_per_token",
                "A language model's validation loss in bits per token at the last evaluation.",
                &[(Vec::new(), bits)],
            )?;
        }
        Ok(())
    }
}

/// Seconds since the Unix epoch, now.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Encodes `scrape` in the text format (ends with `# EOF`).
pub fn render(scrape: Scrape) -> String {
    render_with(scrape, None)
}

/// [`render`], with the spot-check and quarantine counters of a server
/// (the defences' counters, `crate::defence::spotcheck::DefenceScrape`).
pub fn render_with(scrape: Scrape, extra: Option<Box<dyn Collector>>) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(scrape));
    if let Some(d) = extra {
        registry.register_collector(d);
    }
    let mut out = String::new();
    // Writing to a String cannot fail; an encoder error would leave a partial body, which a
    // scraper rejects as a whole (no `# EOF`).
    let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::Registry;
    use crowdgrad_core::shard::Outcome;
    use crowdgrad_core::wire::{ClientKind, ErrorCode};

    fn applied_on_0() -> Outcome {
        Outcome::Applied {
            version: 1,
            staleness: 0,
            lr_scale: 1.0,
            merged: 1,
        }
    }

    #[test]
    fn renders_the_registry_counters_and_checkpoint() {
        let r = Registry::new(2, 10);
        let (id, _) = r.join(ClientKind::Browser, None, 1).unwrap();
        r.connection(id, true);
        for staleness in [0, 3, 40] {
            let o = Outcome::Applied {
                version: 1,
                staleness,
                lr_scale: 1.0,
                merged: 1,
            };
            r.pushed(1, Some(id), &o, 32, true);
        }
        let rejected = Outcome::Rejected {
            code: ErrorCode::TooStale,
            message: "old".into(),
        };
        r.pushed(1, Some(id), &rejected, 32, false);
        r.pushed(0, Some(id), &applied_on_0(), 96, true);
        r.frame_rejected(0, Some(id), ErrorCode::Malformed);
        let (_, shards, totals) = r.view();
        let apply = apply_histogram();
        apply.observe(3e-5);
        let m = Metrics::default();
        assert_eq!(m.checkpoint(), None);
        m.checkpoint_written(4096, 1000.0);
        let text = render(Scrape {
            shards: shards
                .into_iter()
                .enumerate()
                .map(|(i, counters)| ShardScrape {
                    id: i as u32,
                    version: 7,
                    counters,
                    apply: Some(apply.clone()),
                    bytes_received: 100,
                    bytes_sent: 200,
                    egress_budget: Some(25e6),
                    pace_s: 0.004 * (i + 1) as f64,
                })
                .collect(),
            totals,
            samples_per_sec: 12.5,
            remote_up: vec![(0, true), (1, false)],
            checkpoint: m.checkpoint(),
            uptime_s: 3.0,
            now_unix: 1010.0,
            test: Some((0.9375, 0.25)),
            test_bits_per_token: Some(1.5),
        });
        for line in [
            "crowdgrad_pushes_applied_total{shard=\"1\"} 3",
            "crowdgrad_pushes_rejected_total{shard=\"1\",reason=\"too_stale\"} 1",
            "crowdgrad_frames_rejected_total{shard=\"0\",reason=\"malformed\"} 1",
            "crowdgrad_push_staleness_bucket{le=\"0.0\",shard=\"1\"} 1",
            "crowdgrad_push_staleness_bucket{le=\"15.0\",shard=\"1\"} 2",
            "crowdgrad_push_staleness_bucket{le=\"+Inf\",shard=\"1\"} 3",
            "crowdgrad_push_staleness_sum{shard=\"1\"} 43.0",
            "crowdgrad_apply_seconds_count{shard=\"0\"} 1",
            "crowdgrad_workers_connected{kind=\"browser\"} 1.0",
            "crowdgrad_workers_connected{kind=\"native\"} 0.0",
            "crowdgrad_samples_total 96",
            "crowdgrad_bytes_sent_total{shard=\"1\"} 200",
            "crowdgrad_egress_budget_bytes_per_second{shard=\"0\"} 25000000.0",
            "crowdgrad_pace_seconds{shard=\"1\"} 0.008",
            "crowdgrad_remote_shard_up{shard=\"1\"} 0.0",
            "crowdgrad_checkpoint_size_bytes 4096.0",
            "crowdgrad_checkpoint_age_seconds 10.0",
            "crowdgrad_test_accuracy 0.9375",
            "crowdgrad_test_loss 0.25",
            "crowdgrad_test_bits_per_token 1.5",
            "# EOF",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }
}
