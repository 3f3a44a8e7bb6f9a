//! What a native worker is asked to do ([`WorkOptions`], [`Timeouts`]) and what it reports
//! ([`Summary`]), and the small things every part of it needs.

use crate::error::{Error, Result};
use crowdgrad_core::backoff;
use crowdgrad_core::fault::Fault;
use crowdgrad_core::worker::WorkerStats;
use serde::Serialize;
use std::time::Duration;

/// What `crowdgrad work` was asked to do.
#[derive(Debug, Clone)]
pub struct WorkOptions {
    /// Base URL of the server, e.g. `http://127.0.0.1:8080`.
    pub server: String,
    /// Stop after this many steps.
    pub steps: Option<u64>,
    /// Stop after this long.
    pub duration: Option<Duration>,
    /// Display name sent on join.
    pub name: Option<String>,
    /// Team sent on join (the leaderboard adds up its members).
    pub team: Option<String>,
    /// Show a progress bar.
    pub progress: bool,
    /// Longest wait between reconnection attempts, jitter included (the cap of core's
    /// [`Backoff`](crowdgrad_core::backoff::Backoff)).
    pub max_backoff: Duration,
    /// Extra time each gradient step takes (to play a slow volunteer in experiments).
    pub step_delay: Duration,
    /// The volunteer's stable identity sent with every join (the server's contribution
    /// ledger credits it across sessions); `None`: not credited.
    pub identity: Option<String>,
    /// A private run's join token (sent as `Authorization: Bearer`).
    pub join_token: Option<String>,
    /// Trust only the certificates in this PEM file for `https://` servers (a self-signed
    /// test server) instead of the webpki roots.
    pub ca: Option<std::path::PathBuf>,
    /// Deadlines of the network waits.
    pub timeouts: Timeouts,
    /// Worker loops to run in parallel (1 to [`MAX_THREADS`](crowdgrad_core::spec::MAX_THREADS)), as threads of one volunteer;
    /// `steps` and `duration` apply to each.
    pub threads: usize,
    /// Play a faulty worker (`--fault`, for experiments on robust rules and spot checks): its
    /// pushes are rewritten by core's [`Faults`](crowdgrad_core::fault::Faults) (colluders agree through the run's seed,
    /// [`Collusion::Seeded`](crowdgrad_core::fault::Collusion::Seeded)), or, for [`Fault::ShuffledLabels`], it trains on its partition
    /// with the labels permuted. Nothing in the join or the Hello says so: the server has to
    /// find out by itself. Applies to every thread.
    pub fault: Option<Fault>,
    /// Pushes sent honestly before the fault begins (`--fault-after`): a patient attacker
    /// that first earns the server's trust. Per thread and session.
    pub fault_after: u64,
}

/// How long the worker waits for the network before it gives the session up and reconnects.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timeouts {
    /// TCP (and TLS) connect, for HTTP and each WebSocket (with its upgrade).
    pub connect: Duration,
    /// A whole HTTP request: the join, or one data file (a partition is ~7.5 MiB).
    pub http: Duration,
    /// No byte received for this long during an HTTP request: the link stalled.
    pub stall: Duration,
    /// No frame from any shard for this long while the worker waits for a reply to its pulls
    /// or pushes (a held SSP/sync pull included).
    pub reply: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(10),
            http: Duration::from_secs(300),
            stall: Duration::from_secs(30),
            reply: Duration::from_secs(30),
        }
    }
}

impl WorkOptions {
    /// Options for `server` with no limit, no progress bar and the standard backoff cap
    /// ([`backoff::CAP_S`]).
    pub fn new(server: impl Into<String>) -> Self {
        Self {
            server: server.into(),
            steps: None,
            duration: None,
            name: None,
            team: None,
            progress: false,
            max_backoff: Duration::from_secs_f64(backoff::CAP_S),
            step_delay: Duration::ZERO,
            identity: None,
            join_token: None,
            ca: None,
            timeouts: Timeouts::default(),
            threads: 1,
            fault: None,
            fault_after: 0,
        }
    }
}

/// The default of `crowdgrad work --threads`: every core but one (left to the volunteer), at
/// least one.
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get().saturating_sub(1))
        .max(1)
}

/// What a worker did, printed at the end.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// Worker ids it was given (one per session).
    pub worker_ids: Vec<u64>,
    /// Counters over all sessions.
    pub stats: WorkerStats,
    /// Wall time.
    pub seconds: f64,
    /// Examples per second.
    pub samples_per_sec: f64,
    /// Sessions (1 + reconnections).
    pub sessions: u32,
    /// Peak resident memory of the process, KiB (Linux).
    pub peak_rss_kib: Option<u64>,
    /// Why the last session ended badly, if it did.
    pub last_error: Option<String>,
    /// The server refused to let the worker join (a private run and a missing or wrong
    /// `--join-token`): the worker gave up instead of retrying.
    pub refused: bool,
    /// Worker loops it ran ([`WorkOptions::threads`]); the counters are their sums.
    pub threads: usize,
    /// The public id of its identity ([`crate::registry::ledger::public_id`]): what the
    /// leaderboard shows of it (the identity itself is a secret and is never printed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub public_id: Option<String>,
}

/// The identity kept in `path` (created with 32 random hex digits, 128 bits, when missing):
/// how `crowdgrad work` stays the same volunteer across runs. It is a secret: the server
/// shows only its public id ([`crate::registry::ledger::public_id`]), and whoever reads the
/// file can act as the volunteer. So the file is created with mode 0600 (owner only), and
/// one found readable by others (every file made before issue 21 was 0644) is set to 0600,
/// with a warning.
///
/// # Errors
/// When the file cannot be read or created, or holds an unusable identity.
pub fn identity_from_file(path: &std::path::Path) -> Result<String> {
    match std::fs::read_to_string(path) {
        Ok(s) => {
            let id = s.trim().to_string();
            crate::registry::ledger::check_identity(&id)
                .map_err(|m| Error::Config(format!("identity file {}: {m}", path.display())))?;
            owner_only(path)?;
            Ok(id)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let bytes = crate::support::credential::run_secret()
                .map_err(|e| Error::io("drawing an identity", e))?;
            let id: String = bytes[..16].iter().map(|b| format!("{b:02x}")).collect();
            if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)
                    .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
            }
            let mut open = std::fs::OpenOptions::new();
            open.write(true).create_new(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut open, 0o600);
            match open.open(path) {
                Ok(mut f) => {
                    use std::io::Write;
                    f.write_all(format!("{id}\n").as_bytes())
                        .and_then(|()| f.sync_all())
                        .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
                    Ok(id)
                }
                // Another worker made it first: use its identity.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    identity_from_file(path)
                }
                Err(e) => Err(Error::io(format!("creating {}", path.display()), e)),
            }
        }
        Err(e) => Err(Error::io(format!("reading {}", path.display()), e)),
    }
}

/// Makes the identity file at `path` readable by its owner only (see [`identity_from_file`]).
fn owner_only(path: &std::path::Path) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let meta = std::fs::metadata(path)
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| Error::io(format!("setting {} to mode 0600", path.display()), e))?;
            tracing::warn!(
                path = %path.display(),
                was = format!("{mode:o}"),
                "the identity file is a secret: set it to mode 0600 (owner only)"
            );
        }
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

/// Peak resident set size of this process in KiB, from /proc (Linux only).
pub fn peak_rss_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

pub(super) fn base_urls(server: &str) -> Result<(String, String)> {
    let s = server.trim_end_matches('/');
    let (rest, ws) = match (s.strip_prefix("http://"), s.strip_prefix("https://")) {
        (Some(rest), _) => (rest, "ws"),
        (_, Some(rest)) => (rest, "wss"),
        _ => {
            return Err(Error::Config(format!(
                "server URL {server:?} must start with http:// or https:// (e.g. http://127.0.0.1:8080)"
            )))
        }
    };
    if rest.is_empty() || rest.contains('/') {
        return Err(Error::Config(format!(
            "server URL {server:?} must be a base address like http://HOST:PORT"
        )));
    }
    Ok((s.to_string(), format!("{ws}://{rest}")))
}

/// A seed for the backoff's jitter that differs between workers started together (the point
/// of the jitter): the clock's nanoseconds and the process id.
pub(super) fn jitter_seed() -> u64 {
    // Workers in one process (tests, benches) may read the same clock tick: count them too.
    static STARTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nth = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ (u64::from(std::process::id()) << 32) ^ nth.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_take_http_and_https_bases_only() {
        assert_eq!(
            base_urls("http://127.0.0.1:8080/").expect("ok"),
            ("http://127.0.0.1:8080".into(), "ws://127.0.0.1:8080".into())
        );
        assert_eq!(
            base_urls("https://example.org").expect("ok").1,
            "wss://example.org"
        );
        for (bad, says) in [
            ("127.0.0.1:8080", "must start with http://"),
            ("ftp://x", "must start with http://"),
            ("http://a/b/c", "base address"),
            ("http://host/path", "base address"),
        ] {
            let e = base_urls(bad).expect_err(bad).to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn the_identity_file_is_created_once_and_checked_when_read() {
        let dir = std::env::temp_dir().join(format!("crowdgrad-id-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("nested/worker-id");
        let id = identity_from_file(&path).expect("created");
        assert_eq!(id.len(), 32);
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = |p: &std::path::Path| {
                std::fs::metadata(p).expect("meta").permissions().mode() & 0o777
            };
            assert_eq!(mode(&path), 0o600, "created owner-only");
            // A file made by an older worker (0644) is set to 0600 when read.
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
            assert_eq!(identity_from_file(&path).expect("read back"), id);
            assert_eq!(mode(&path), 0o600, "tightened");
        }
        assert_eq!(identity_from_file(&path).expect("read back"), id);
        std::fs::write(&path, "not an identity!\n").expect("write");
        let e = identity_from_file(&path).expect_err("refused").to_string();
        assert!(e.contains("identity file"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn jitter_seeds_differ_between_workers_started_together() {
        let seeds: std::collections::BTreeSet<u64> = (0..64).map(|_| jitter_seed()).collect();
        assert_eq!(seeds.len(), 64);
    }
}
