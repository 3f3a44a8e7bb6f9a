//! The ledger's database as the server uses it: a [`Store`] (cheap to share) holding the path,
//! the read connection and the writer's progress, and a [`Writer`] thread that owns the write
//! connection.
//!
//! The writer wakes every [`FLUSH_EVERY`], when a reader asks for a flush ([`Store::flush`],
//! so a volunteer sees their own push on the leaderboard; at most one such round per
//! [`MIN_GAP`], however many ask) and at [`Writer::stop`]; each time
//! it takes the registry's pending deltas (a swap under the registry's lock, nothing more) and
//! writes them in one transaction. A batch it cannot write goes back to the registry, to be
//! tried with the next (bounded: [`super::MAX_PENDING`]). Reads lock only the read connection
//! (WAL: they never wait for the writer, and see the last committed transaction).

use super::db::Db;
use super::{unix_now, Batch, Board};
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Time between two flushes of the pending credit.
pub const FLUSH_EVERY: Duration = Duration::from_secs(1);

/// Least time between the starts of two flushes: however many readers ask (every tab's
/// leaderboard poll does), the writer commits at most about `1 / MIN_GAP` times a second.
pub const MIN_GAP: Duration = Duration::from_millis(100);

/// How long [`Store::flush`] waits for its flush at most.
pub const FLUSH_WAIT: Duration = Duration::from_secs(2);

/// The ledger file name beside the checkpoints.
pub const FILE_NAME: &str = crate::config::LEDGER_FILE;

/// The ledger's database, shared by the HTTP handlers, the checkpointer and the writer.
#[derive(Debug)]
pub struct Store {
    path: PathBuf,
    /// A temporary file deleted on drop (no `--ledger` and no checkpoint directory).
    temporary: bool,
    reader: Mutex<Db>,
    flush: Mutex<Rounds>,
    woken: Condvar,
    /// The last committed sequence number ([`Db::seq`]).
    seq: AtomicU64,
}

/// Flush requests and rounds done.
#[derive(Debug, Default)]
struct Rounds {
    /// Requests made (each wants a round that starts after it).
    asked: u64,
    /// Requests served: rounds that started after them are done.
    served: u64,
    stop: bool,
}

impl Store {
    /// Opens the ledger at `path` (or, with `None`, in a new temporary file): the write
    /// connection, returned for [`Store::start`], and the read connection.
    ///
    /// # Errors
    /// [`Error::Ledger`] naming the file: refused (corrupt, not crowdgrad's, newer:
    /// [`super::db`]) or not writable.
    pub fn open(path: Option<&Path>) -> Result<(Arc<Self>, Db)> {
        let (path, temporary) = match path {
            Some(p) => {
                if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir)
                        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
                }
                (p.to_path_buf(), false)
            }
            None => {
                let nonce = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos());
                (
                    std::env::temp_dir().join(format!(
                        "crowdgrad-ledger-{}-{nonce:x}.sqlite",
                        std::process::id()
                    )),
                    true,
                )
            }
        };
        let db = Db::open(&path)?;
        let seq = db.seq()?;
        let reader = Db::reader(&path)?;
        Ok((
            Arc::new(Self {
                path,
                temporary,
                reader: Mutex::new(reader),
                flush: Mutex::new(Rounds::default()),
                woken: Condvar::new(),
                seq: AtomicU64::new(seq),
            }),
            db,
        ))
    }

    /// Where the ledger lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// True for a temporary ledger (deleted at exit: credit does not survive a restart).
    pub fn is_temporary(&self) -> bool {
        self.temporary
    }

    /// The last committed sequence number: the ledger's position, which checkpoints record.
    pub fn seq(&self) -> u64 {
        self.seq.load(Ordering::Acquire)
    }

    fn rounds(&self) -> MutexGuard<'_, Rounds> {
        self.flush.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn reader(&self) -> MutexGuard<'_, Db> {
        self.reader.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Asks the writer for a flush and waits (at most [`FLUSH_WAIT`]) until one that started
    /// after the request is done; false if it did not come in time (or no writer runs).
    pub fn flush(&self) -> bool {
        let mut g = self.rounds();
        if g.stop {
            return false;
        }
        g.asked += 1;
        let want = g.asked;
        self.woken.notify_all();
        let deadline = Instant::now() + FLUSH_WAIT;
        while g.served < want && !g.stop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            g = self
                .woken
                .wait_timeout(g, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        g.served >= want
    }

    /// The leaderboard ([`Db::board`]) from the read connection.
    ///
    /// # Errors
    /// [`Error::Ledger`] when the database cannot be read.
    pub fn board(&self, limit: usize, identity: Option<&str>) -> Result<Board> {
        self.reader().board(limit, identity, unix_now())
    }

    /// The CSV export ([`Db::csv`]) from the read connection.
    ///
    /// # Errors
    /// [`Error::Ledger`] when the database cannot be read.
    pub fn csv(&self) -> Result<String> {
        self.reader().csv()
    }

    /// One identity's row, as of now.
    ///
    /// # Errors
    /// [`Error::Ledger`] when the database cannot be read.
    pub fn get(&self, identity: &str) -> Result<Option<super::Contribution>> {
        self.reader().get(identity, unix_now())
    }

    /// Starts the writer thread over `db` (from [`Store::open`]): `take` hands it the pending
    /// credit (the registry's [`super::Ledger::take`]), `give_back` takes back a batch it
    /// could not write.
    ///
    /// # Errors
    /// [`Error::Task`] when the thread cannot be spawned.
    pub fn start(
        self: &Arc<Self>,
        mut db: Db,
        mut take: impl FnMut() -> Batch + Send + 'static,
        mut give_back: impl FnMut(Batch) + Send + 'static,
    ) -> Result<Writer> {
        let store = self.clone();
        let handle = std::thread::Builder::new()
            .name("ledger-writer".into())
            .spawn(move || store.write_loop(&mut db, &mut take, &mut give_back))
            .map_err(|e| Error::Task(format!("ledger writer: {e}")))?;
        Ok(Writer {
            store: self.clone(),
            handle: Some(handle),
        })
    }
}

impl Store {
    /// The writer thread: a round every [`FLUSH_EVERY`], on request (at most one per
    /// [`MIN_GAP`]) and at stop.
    fn write_loop(
        &self,
        db: &mut Db,
        take: &mut impl FnMut() -> Batch,
        give_back: &mut impl FnMut(Batch),
    ) {
        let mut last = Instant::now();
        loop {
            let (asked, stop) = {
                let wait = FLUSH_EVERY.saturating_sub(last.elapsed());
                let (g, _) = self
                    .woken
                    .wait_timeout_while(self.rounds(), wait, |r| !r.stop && r.asked <= r.served)
                    .unwrap_or_else(|p| p.into_inner());
                (g.asked, g.stop)
            };
            let gap = MIN_GAP.saturating_sub(last.elapsed());
            if !stop && !gap.is_zero() {
                std::thread::sleep(gap);
            }
            last = Instant::now();
            let batch = take();
            if !batch.is_empty() {
                match db.apply(&batch, unix_now()) {
                    Ok(seq) => self.seq.store(seq, Ordering::Release),
                    Err(e) => {
                        let identities = batch.deltas.len();
                        tracing::error!(%e, identities, "ledger: a flush failed; its credit is kept for the next one");
                        give_back(batch);
                    }
                }
            }
            {
                let mut g = self.rounds();
                g.served = g.served.max(asked);
                self.woken.notify_all();
            }
            if stop {
                break;
            }
        }
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        if self.temporary {
            for suffix in ["", "-wal", "-shm"] {
                let mut p = self.path.clone().into_os_string();
                p.push(suffix);
                let _ = std::fs::remove_file(PathBuf::from(p));
            }
        }
    }
}

/// The writer thread; [`Writer::stop`] (or drop) flushes what is pending and ends it.
#[derive(Debug)]
pub struct Writer {
    store: Arc<Store>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Writer {
    /// Flushes what is pending, ends the thread and waits for it.
    pub fn stop(mut self) {
        self.end();
    }

    fn end(&mut self) {
        if let Some(h) = self.handle.take() {
            {
                let mut g = self.store.rounds();
                g.stop = true;
                self.store.woken.notify_all();
            }
            if h.join().is_err() {
                tracing::error!("ledger writer panicked");
            }
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.end();
    }
}
