//! The coordinator's view of remote shards (`crowdgrad serve --shard-urls ws://h1:p1,...`):
//! where workers find them, whether each answers with the run's layout, their parameters for
//! the evaluator, and what the workers' pushes did there (each shard's feed,
//! [`crate::registry::feed`], applied to this registry: the ledger's credit and the join
//! admission's established workers). Every request has a timeout; a shard that does not
//! answer is reported down on `/readyz`, `/api/status` and `/metrics`, never waited for.

use crate::error::{Error, Result};
use crate::registry::feed::{Batch, Cursor};
use crate::registry::Registry;
use crate::shard::report::ShardReport;
use crowdgrad_core::partition::KeyRange;
use crowdgrad_core::spec::ShardInfo;
use serde::Serialize;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Timeout of one health check.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(2);
/// Timeout of one parameter fetch.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(10);
/// Period of the health checks (and of the feed's takes).
pub const CHECK_EVERY: Duration = Duration::from_secs(1);
/// Timeout of one take of a shard's feed.
pub const FEED_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest feed answer read (a batch of `feed::MAX_BATCH` workers is about 8 MB of JSON).
const FEED_LIMIT: u64 = 32 << 20;

/// One remote shard's health as last checked.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Health {
    /// Index.
    pub id: u32,
    /// Its WebSocket URL (what workers are handed).
    pub url: String,
    /// It answered the last check.
    pub up: bool,
    /// It answered with the run's layout (model, consistency, range, shard count).
    pub ready: bool,
    /// Why not, if not.
    pub error: Option<String>,
    /// Seconds since it last answered (none yet: `null`).
    pub last_ok_s: Option<f64>,
    /// Its version.
    pub version: Option<u64>,
    /// Seconds it has been up (drops when the process restarts).
    pub uptime_s: Option<f64>,
    /// Its `/api/status`-style shard record (counters), as it reported it.
    pub status: Option<serde_json::Value>,
    #[serde(skip)]
    last_ok: Option<Instant>,
}

/// One remote shard.
#[derive(Debug)]
struct Remote {
    id: u32,
    ws: String,
    http: String,
    range: KeyRange,
    health: Mutex<Health>,
    /// The last feed batch applied from it.
    cursor: Mutex<Cursor>,
}

/// The remote shards of a run.
#[derive(Debug)]
pub struct RemoteShards {
    shards: Vec<Remote>,
    model: String,
    consistency: String,
    /// `--ema`: what each shard process must keep (the evaluations are of its `/api/params`).
    ema: Option<f32>,
}

/// `ws://host:port[/]` → (`ws://host:port`, `http://host:port`); `wss` → `https`.
///
/// # Errors
/// [`Error::Config`] for anything but a `ws://` or `wss://` base address.
pub fn parse_url(url: &str) -> Result<(String, String)> {
    let u = url.trim().trim_end_matches('/');
    let (http, rest) = if let Some(r) = u.strip_prefix("ws://") {
        ("http://", r)
    } else if let Some(r) = u.strip_prefix("wss://") {
        ("https://", r)
    } else {
        return Err(Error::Config(format!(
            "--shard-urls: {url:?} must start with ws:// or wss:// (e.g. ws://10.0.0.2:9000)"
        )));
    };
    if rest.is_empty() || rest.contains('/') || rest.contains(char::is_whitespace) {
        return Err(Error::Config(format!(
            "--shard-urls: {url:?} must be a base address like ws://HOST:PORT"
        )));
    }
    Ok((u.to_string(), format!("{http}{rest}")))
}

impl RemoteShards {
    /// The shards at `urls` (one per range, in order), expected to serve `model` with
    /// `consistency`.
    ///
    /// # Errors
    /// A bad URL, or as many URLs as ranges not given.
    pub fn new(
        urls: &[String],
        ranges: &[KeyRange],
        model: &str,
        consistency: &str,
    ) -> Result<Self> {
        if urls.len() != ranges.len() {
            return Err(Error::Config(format!(
                "--shard-urls lists {} shards, the run has {} (--shards)",
                urls.len(),
                ranges.len()
            )));
        }
        let shards = urls
            .iter()
            .zip(ranges)
            .enumerate()
            .map(|(i, (u, r))| {
                let (ws, http) = parse_url(u)?;
                let ws = format!("{ws}/ws/shard/{i}");
                Ok(Remote {
                    id: i as u32,
                    health: Mutex::new(Health {
                        id: i as u32,
                        url: ws.clone(),
                        error: Some("not checked yet".into()),
                        ..Health::default()
                    }),
                    ws,
                    http,
                    range: *r,
                    cursor: Mutex::default(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            shards,
            model: model.to_string(),
            consistency: consistency.to_string(),
            ema: None,
        })
    }

    /// The same shards, expected to keep a moving average of their weights with decay `ema`
    /// (`--ema`; `None`: none): a shard process started with another is not ready, and says
    /// so.
    pub fn with_ema(mut self, ema: Option<f32>) -> Self {
        self.ema = ema;
        self
    }

    /// Points `map`'s paths at the remote shards: each `path` becomes the shard's absolute
    /// `ws://`/`wss://` URL, which workers use as it is.
    pub fn rewrite(&self, map: &mut [ShardInfo]) {
        for (s, r) in map.iter_mut().zip(&self.shards) {
            s.path = r.ws.clone();
        }
    }

    /// Every shard's health, in order.
    pub fn health(&self) -> Vec<Health> {
        self.shards
            .iter()
            .map(|r| {
                let mut h = r.health.lock().unwrap_or_else(|p| p.into_inner()).clone();
                h.last_ok_s = h.last_ok.map(|t| t.elapsed().as_secs_f64());
                h
            })
            .collect()
    }

    /// True when every shard answered its last check with the run's layout.
    pub fn all_ready(&self) -> bool {
        self.health().iter().all(|h| h.ready)
    }

    /// Checks every shard once, concurrently.
    pub async fn check(&self) {
        let checks = self.shards.iter().map(|r| async move {
            let got = get(format!("{}/api/shard", r.http), CHECK_TIMEOUT, 1 << 20).await;
            let report = got.and_then(|(body, _)| {
                serde_json::from_slice::<ShardReport>(&body)
                    .map_err(|e| Error::Http(format!("bad /api/shard reply: {e}")))
            });
            let mut h = r.health.lock().unwrap_or_else(|p| p.into_inner());
            match report {
                Ok(rep) => {
                    h.up = true;
                    h.last_ok = Some(Instant::now());
                    h.version = Some(rep.version);
                    h.uptime_s = Some(rep.uptime_s);
                    let mismatch = self.mismatch(r, &rep);
                    h.ready = mismatch.is_none();
                    h.error = mismatch;
                    h.status = Some(rep.status);
                }
                Err(e) => {
                    if h.up {
                        tracing::warn!(shard = r.id, url = %r.http, error = %e, "remote shard down");
                    }
                    h.up = false;
                    h.ready = false;
                    h.error = Some(e.to_string());
                }
            }
        });
        futures_util::future::join_all(checks).await;
    }

    fn mismatch(&self, r: &Remote, rep: &ShardReport) -> Option<String> {
        let want = |what: &str, got: &dyn std::fmt::Debug, expected: &dyn std::fmt::Debug| {
            Some(format!(
                "shard process serves {what} {got:?}, the run expects {expected:?}: start it with the coordinator's training flags"
            ))
        };
        if rep.index != r.id {
            return want("index", &rep.index, &r.id);
        }
        if rep.of != self.shards.len() {
            return want("shard count", &rep.of, &self.shards.len());
        }
        if rep.model != self.model {
            return want("model", &rep.model, &self.model);
        }
        if rep.consistency != self.consistency {
            return want("consistency", &rep.consistency, &self.consistency);
        }
        if rep.range != r.range {
            return want("range", &rep.range, &r.range);
        }
        if rep.ema != self.ema {
            return want("--ema", &rep.ema, &self.ema);
        }
        None
    }

    /// Takes every shard's feed once, concurrently, with `token`
    /// ([`crate::support::credential::coordinator_token`]), and applies each new batch to
    /// `registry` ([`Registry::tallied`]). A shard that does not answer keeps its batch for
    /// the next take.
    pub async fn take_feeds(&self, registry: &Registry, token: &str) {
        let takes = self.shards.iter().map(|r| async move {
            let (boot, ack) = r.cursor.lock().unwrap_or_else(|p| p.into_inner()).query();
            let url = format!("{}/api/feed?boot={boot}&ack={ack}", r.http);
            let got = get_with(url, FEED_TIMEOUT, FEED_LIMIT, Some(token.to_string())).await;
            let batch = got.and_then(|(body, _)| {
                serde_json::from_slice::<Batch>(&body)
                    .map_err(|e| Error::Http(format!("bad /api/feed reply: {e}")))
            });
            match batch {
                Ok(b) => {
                    let fresh = r.cursor.lock().unwrap_or_else(|p| p.into_inner()).fresh(&b);
                    if fresh {
                        for (worker, t) in &b.workers {
                            registry.tallied(*worker, t);
                        }
                    }
                }
                Err(e) => tracing::debug!(shard = r.id, error = %e, "feed not taken"),
            }
        });
        futures_util::future::join_all(takes).await;
    }

    /// Checks every [`CHECK_EVERY`], and takes the feeds into `registry` with `token`
    /// ([`RemoteShards::take_feeds`]), until `shutdown` flips.
    pub async fn monitor(
        &self,
        mut shutdown: tokio::sync::watch::Receiver<bool>,
        registry: Registry,
        token: String,
    ) {
        loop {
            self.check().await;
            self.take_feeds(&registry, &token).await;
            tokio::select! {
                _ = tokio::time::sleep(CHECK_EVERY) => {}
                _ = shutdown.changed() => return,
            }
        }
    }

    /// The full parameter vector from every shard's `/api/params` (concurrently, each with a
    /// timeout) and the shards' versions.
    ///
    /// # Errors
    /// When a shard does not answer in time or answers with the wrong length.
    pub async fn params(&self) -> Result<(Vec<f32>, Vec<u64>)> {
        let fetches = self.shards.iter().map(|r| async move {
            let limit = 4 * r.range.len() as u64 + 1024;
            let (body, version) =
                get(format!("{}/api/params", r.http), FETCH_TIMEOUT, limit).await?;
            if body.len() != 4 * r.range.len() {
                return Err(Error::Http(format!(
                    "shard {} sent {} bytes of parameters, expected {}",
                    r.id,
                    body.len(),
                    4 * r.range.len()
                )));
            }
            Ok((body, version.unwrap_or(0)))
        });
        let parts = futures_util::future::try_join_all(fetches).await?;
        let mut all = Vec::new();
        let mut versions = Vec::new();
        for (body, v) in parts {
            all.extend(
                body.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
            versions.push(v);
        }
        Ok((all, versions))
    }
}

/// GET `url` with a global `timeout` and a body `limit`: the body and the
/// `x-crowdgrad-versions` header as a number.
async fn get(url: String, timeout: Duration, limit: u64) -> Result<(Vec<u8>, Option<u64>)> {
    get_with(url, timeout, limit, None).await
}

/// [`get`] with an `Authorization: Bearer` token.
async fn get_with(
    url: String,
    timeout: Duration,
    limit: u64,
    bearer: Option<String>,
) -> Result<(Vec<u8>, Option<u64>)> {
    tokio::task::spawn_blocking(move || -> Result<(Vec<u8>, Option<u64>)> {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            .http_status_as_error(false)
            .build()
            .into();
        let mut req = agent.get(&url);
        if let Some(t) = &bearer {
            req = req.header("authorization", &format!("Bearer {t}"));
        }
        let mut resp = req.call().map_err(|e| Error::Http(format!("{url}: {e}")))?;
        let status = resp.status();
        let version = resp
            .headers()
            .get("x-crowdgrad-versions")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let body = resp
            .body_mut()
            .with_config()
            .limit(limit)
            .read_to_vec()
            .map_err(|e| Error::Http(format!("{url}: {e}")))?;
        if !status.is_success() {
            return Err(Error::Http(format!("{url}: HTTP {status}")));
        }
        Ok((body, version))
    })
    .await
    .map_err(|e| Error::Task(format!("fetch: {e}")))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_become_shard_paths() {
        assert_eq!(
            parse_url("ws://127.0.0.1:9000/").unwrap(),
            ("ws://127.0.0.1:9000".into(), "http://127.0.0.1:9000".into())
        );
        assert_eq!(
            parse_url("wss://s1.example:443").unwrap().1,
            "https://s1.example:443"
        );
        for bad in ["http://h:1", "ws://", "ws://h:1/ws/shard/0", "h:1"] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
        let ranges = [KeyRange { start: 0, end: 5 }, KeyRange { start: 5, end: 9 }];
        let r = RemoteShards::new(
            &["ws://127.0.0.1:1".into(), "ws://127.0.0.1:2".into()],
            &ranges,
            "mlp",
            "async",
        )
        .unwrap();
        let mut map = crowdgrad_core::spec::shard_map(&ranges);
        r.rewrite(&mut map);
        assert_eq!(map[1].path, "ws://127.0.0.1:2/ws/shard/1");
        assert!(!r.all_ready(), "nothing checked yet");
        assert!(RemoteShards::new(&["ws://h:1".into()], &ranges, "mlp", "async").is_err());
    }

    /// Issue 20: a shard process started without the coordinator's `--ema` (or with another)
    /// serves the live weights where the run evaluates an average: not ready, and it says why.
    #[test]
    fn a_shard_process_with_another_ema_is_a_mismatch() {
        let ranges = [KeyRange { start: 0, end: 5 }];
        let r = RemoteShards::new(&["ws://127.0.0.1:1".into()], &ranges, "mlp", "async")
            .unwrap()
            .with_ema(Some(0.999));
        let mut rep = ShardReport {
            index: 0,
            of: 1,
            range: ranges[0],
            model: "mlp".into(),
            consistency: "async".into(),
            ema: Some(0.999),
            version: 0,
            uptime_s: 1.0,
            status: serde_json::Value::Null,
        };
        assert_eq!(r.mismatch(&r.shards[0], &rep), None);
        for other in [None, Some(0.99)] {
            rep.ema = other;
            let m = r.mismatch(&r.shards[0], &rep).expect("a mismatch");
            assert!(m.contains("--ema") && m.contains("training flags"), "{m}");
        }
        // A report from a shard process older than --ema reads as none.
        let old: ShardReport = serde_json::from_str(
            r#"{"index":0,"of":1,"range":{"start":0,"end":5},"model":"mlp","consistency":"async","version":0,"uptime_s":1,"status":null}"#,
        )
        .unwrap();
        assert_eq!(old.ema, None);
    }
}
