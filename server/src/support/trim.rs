//! Gives the heap memory of closed connections back to the operating system.
//!
//! glibc's malloc keeps what a program frees in its arenas: the first free of a large block
//! raises its dynamic mmap threshold, later blocks of that size (per-connection WebSocket
//! read and write buffers, ~200 KiB Params frames) come from per-thread heaps, and an arena only
//! shrinks from its top. After 1,000 WebSocket connections joined and left, `crowdgrad serve`
//! kept ~330 MiB of freed memory (66 MiB before, ~400 MiB after: docs/benchmarks.md, "1,000
//! WebSocket connections joining and leaving"). Retention, not a leak, but a host does not
//! get its memory back.
//!
//! [`task`] watches the number of open TCP connections ([`crate::support::limits::Limits`]) every
//! [`PERIOD`]. Once it has fallen by at least [`FALL`] since the last trim and then held still
//! for one period (or has kept falling for [`MAX_WAIT`] periods), it calls `malloc_trim(0)` on a
//! blocking thread: glibc returns every free page of every arena (`madvise(MADV_DONTNEED)`),
//! which took 30 ms for ~340 MiB here (one trim per round of the churn). Nothing happens
//! while the count rises or holds, so a steady training run never trims; at most one trim per
//! period.
//!
//! Why this and not another allocator or glibc tuning: measured side by side in
//! docs/benchmarks.md (1,000 connections × 2 rounds; RSS 10 s after each round). glibc as it
//! was: 67 → ~415 → ~410 MiB. A fixed mmap threshold (`mallopt(M_MMAP_THRESHOLD)` /
//! `MALLOC_MMAP_THRESHOLD_`): back to 89 MiB, but every large frame is mapped, faulted in and
//! unmapped on the hot path. `MALLOC_ARENA_MAX=2`: kept it (372-426 MiB). jemalloc: kept
//! 128-158 MiB without its background thread, 75-78 MiB with it (a bigger baseline, a C build
//! and a thread of its own). mimalloc: 78 MiB as Debian's 2.0.9; the `mimalloc` crate (2.3)
//! built in kept 426 MiB after one of two rounds (it purges when a thread allocates again).
//! This trim: 71-74 MiB, status latency as low as any candidate's, no new allocator, no C
//! code, and nothing at all while connections hold.
//!
//! On other platforms or C libraries (musl, macOS) `malloc_trim` does not exist and [`task`]
//! returns at once.

use crate::support::limits::Limits;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// How often the connection count is read.
pub const PERIOD: Duration = Duration::from_secs(2);

/// Connections that must have closed since the last trim before the next one.
pub const FALL: u64 = 64;

/// Periods a trim waits for departures to pause before it runs anyway.
pub const MAX_WAIT: u32 = 8;

/// Whether this build can trim (Linux with glibc).
pub const SUPPORTED: bool = cfg!(all(target_os = "linux", target_env = "gnu"));

/// The decision of one period, kept apart from the clock and the allocator so it can be
/// tested exactly.
#[derive(Debug, Clone, Copy, Default)]
pub struct Watch {
    /// Highest count seen since the last trim.
    high: u64,
    /// The count one period ago.
    last: u64,
    /// Periods the trim has been due.
    due_for: u32,
}

impl Watch {
    /// A watch starting at `open` connections.
    pub fn new(open: u64) -> Self {
        Self {
            high: open,
            last: open,
            due_for: 0,
        }
    }

    /// Feeds this period's count; true when a trim should run now (the watch then counts
    /// from `open` again).
    pub fn tick(&mut self, open: u64) -> bool {
        self.high = self.high.max(open);
        let fell = open < self.last;
        self.last = open;
        if self.high.saturating_sub(open) < FALL {
            self.due_for = 0;
            return false;
        }
        self.due_for += 1;
        // Wait for the departures to pause (this period did not fall), but not for ever.
        if (fell && self.due_for < MAX_WAIT) || self.due_for < 2 {
            return false;
        }
        *self = Self::new(open);
        true
    }
}

/// Trims after connections close, until `shutdown` flips to true (see the module doc).
/// Spawn it on the server's runtime; it ends with the server.
pub async fn task(limits: Arc<Limits>, shutdown: watch::Receiver<bool>) {
    counting(move || limits.counts().connections_open, shutdown).await;
}

/// [`task`] for a process that counts its open connections another way (`open()`, e.g. the
/// shard process's connection semaphore).
pub async fn counting(open: impl Fn() -> u64 + Send, mut shutdown: watch::Receiver<bool>) {
    if !SUPPORTED {
        return;
    }
    let mut watch = Watch::new(open());
    loop {
        tokio::select! {
            _ = tokio::time::sleep(PERIOD) => {}
            r = shutdown.changed() => {
                if r.is_err() || *shutdown.borrow() {
                    return;
                }
            }
        }
        let open = open();
        if watch.tick(open) {
            // Off the reactor: the trim walks every arena under its lock.
            match tokio::task::spawn_blocking(trim_now).await {
                Ok(t) => tracing::debug!(
                    connections = open,
                    ms = t.seconds * 1e3,
                    rss_before_mib = t.rss_before_mib,
                    rss_after_mib = t.rss_after_mib,
                    "gave freed heap memory back to the OS"
                ),
                Err(e) => tracing::warn!(%e, "malloc_trim task failed"),
            }
        }
    }
}

/// What one trim did.
#[derive(Debug, Clone, Copy)]
pub struct Trimmed {
    /// How long `malloc_trim` took.
    pub seconds: f64,
    /// This process's RSS before, MiB (0 where unknown).
    pub rss_before_mib: f64,
    /// And after.
    pub rss_after_mib: f64,
}

/// Calls `malloc_trim(0)` now (a no-op where unsupported) and says what it did. Blocks for as
/// long as the trim takes: call it off the reactor.
pub fn trim_now() -> Trimmed {
    let rss_before_mib = rss_mib();
    let t0 = std::time::Instant::now();
    malloc_trim();
    Trimmed {
        seconds: t0.elapsed().as_secs_f64(),
        rss_before_mib,
        rss_after_mib: rss_mib(),
    }
}

/// `malloc_trim(0)`: glibc gives every free page of every arena back to the OS.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn malloc_trim() {
    // SAFETY: malloc_trim takes no pointers and only reorganises glibc's own free lists,
    // under the arenas' locks; it is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn malloc_trim() {}

/// This process's resident memory, MiB (0 where `/proc` is not there).
fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<f64>().ok())
        .map_or(0.0, |pages| pages * 4096.0 / (1024.0 * 1024.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_while_connections_rise_or_hold() {
        let mut w = Watch::new(0);
        for open in [10, 500, 1000, 1000, 1000, 990, 960, 1000, 1000] {
            assert!(!w.tick(open), "{open}");
        }
    }

    #[test]
    fn one_trim_once_departures_pause() {
        let mut w = Watch::new(0);
        for open in [1000, 1000] {
            assert!(!w.tick(open));
        }
        // Leaving: due, but still falling.
        for open in [900, 700, 400] {
            assert!(!w.tick(open), "{open}");
        }
        // Held still for a period: trim, once.
        assert!(w.tick(400));
        assert!(!w.tick(400));
        assert!(!w.tick(400));
        // The rest leave; a second trim when they stop.
        assert!(!w.tick(0));
        assert!(w.tick(0));
        for _ in 0..20 {
            assert!(!w.tick(0));
        }
    }

    #[test]
    fn small_falls_do_not_trim() {
        let mut w = Watch::new(100);
        for open in [100 - FALL + 1; 10] {
            assert!(!w.tick(open));
        }
        assert!(!w.tick(100 - FALL));
        assert!(w.tick(100 - FALL));
    }

    #[test]
    fn departures_that_never_pause_trim_after_max_wait() {
        let mut w = Watch::new(10_000);
        let mut open = 10_000;
        let mut trims = Vec::new();
        for period in 0..40u32 {
            open -= 100;
            if w.tick(open) {
                trims.push(period);
            }
        }
        // Due from the first period, forced every MAX_WAIT periods.
        assert_eq!(trims, vec![7, 15, 23, 31, 39]);
    }

    #[test]
    fn trim_now_runs_and_reports() {
        // Free a lot, then trim: RSS must not grow, and the call reports its time.
        let v: Vec<Vec<u8>> = (0..64).map(|_| vec![1u8; 256 * 1024]).collect();
        drop(v);
        let t = trim_now();
        assert!(t.seconds >= 0.0 && t.seconds < 10.0, "{t:?}");
        if SUPPORTED {
            assert!(t.rss_before_mib > 0.0, "{t:?}");
        }
    }
}
