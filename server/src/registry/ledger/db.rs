//! The ledger's SQLite database: one file, opened by one writer ([`Db::open`], the writer
//! thread of [`super::store`]) and one reader ([`Db::reader`], the leaderboard).
//!
//! # Durability
//! WAL journal with `synchronous=FULL`: a transaction is on disk (the WAL fsynced) when its
//! commit returns, so neither a `kill -9` nor a power loss (on a disk that honours fsync)
//! loses a committed transaction. NORMAL would survive a process kill too but could lose the
//! last transactions on power loss; FULL costs one fsync per commit, and the writer commits
//! once per [`super::store::FLUSH_EVERY`], not once per push, so it costs nothing that shows.
//! What a kill loses is the credit still in memory: at most one flush interval.
//!
//! # Refusals
//! A file that exists is checked before anything is written to it: a file SQLite cannot read
//! (not a database, corrupt: `PRAGMA quick_check`), a SQLite database that is not a crowdgrad
//! ledger (its `application_id` is not [`APPLICATION_ID`]: another program's, or one with no
//! schema at all) and a ledger written by a newer crowdgrad (`user_version` past
//! [`MIGRATIONS`]) are refused with an [`Error::Ledger`] naming the path, and the file is left
//! as it was. An empty (0-byte) file is a new ledger.
//!
//! # Schema (version 1)
//! - `contributors`: a row per identity (identity, name, client, samples, accepted, rejected,
//!   compute_s, sessions, first_seen, last_seen), indexed by `(samples DESC, identity)` for
//!   the top-k and by `last_seen` for eviction.
//! - `hourly(identity, hour, samples, compute_s)`: credit per identity per UTC hour, for the
//!   recent average ([`super::RECENT_HOURS`]); rows older than [`super::HOURLY_KEEP_HOURS`]
//!   are deleted.
//! - `buckets(bucket, n)`: identities per samples bucket ([`bucket`]), so the rank of an
//!   identity is a sum over at most [`BUCKETS`] rows plus a count inside its own bucket, not
//!   a count over every identity above it.
//! - `meta(key, value)`: `seq` (transactions committed: the position a checkpoint records),
//!   `identities`, `samples`.
//! - `imports(checkpoint, identities, at)`: old checkpoints whose JSON ledger was imported.
//!
//! Version 2 added `contributors.team` and `teams(team, members, samples)`. Version 3 re-keys
//! `contributors` and `hourly` by public id (issue 21; [`super::public_id`] of the old key,
//! the policy is in the module doc of [`super`], "Identities"): every key is a public id since.
//!
//! Counters are SQLite integers: they saturate at `i64::MAX` (9.2e18), not `u64::MAX`.

use super::RECENT_HOURS;
use super::{clean, hour_of, Batch, Board, Contribution, HOURLY_KEEP_HOURS, MAX_IDENTITIES};
use crate::error::{Error, Result};
use crowdgrad_core::wire::ClientKind;
use rusqlite::{params, Connection, OpenFlags, OptionalExtension, TransactionBehavior};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// `PRAGMA application_id` of a crowdgrad ledger ("CGLD").
pub const APPLICATION_ID: i32 = 0x4347_4c44;

/// The schema, one SQL script per version: version N is reached by running script N-1 on a
/// database at version N-1, in one transaction with the new `user_version`.
pub const MIGRATIONS: &[&str] = &[
    r#"
CREATE TABLE contributors (
    identity TEXT PRIMARY KEY NOT NULL,
    name TEXT,
    client TEXT NOT NULL,
    samples INTEGER NOT NULL,
    accepted INTEGER NOT NULL,
    rejected INTEGER NOT NULL,
    compute_s REAL NOT NULL,
    sessions INTEGER NOT NULL,
    first_seen REAL NOT NULL,
    last_seen REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX contributors_by_samples ON contributors (samples DESC, identity);
CREATE INDEX contributors_by_last_seen ON contributors (last_seen);
CREATE TABLE hourly (
    identity TEXT NOT NULL,
    hour INTEGER NOT NULL,
    samples INTEGER NOT NULL,
    compute_s REAL NOT NULL,
    PRIMARY KEY (identity, hour)
) WITHOUT ROWID;
CREATE INDEX hourly_by_hour ON hourly (hour);
CREATE TABLE buckets (bucket INTEGER PRIMARY KEY, n INTEGER NOT NULL);
CREATE TABLE meta (key TEXT PRIMARY KEY NOT NULL, value INTEGER NOT NULL) WITHOUT ROWID;
INSERT INTO meta (key, value) VALUES ('seq', 0), ('identities', 0), ('samples', 0);
CREATE TABLE imports (checkpoint TEXT PRIMARY KEY NOT NULL, identities INTEGER NOT NULL, at REAL NOT NULL);
"#,
    r#"
ALTER TABLE contributors ADD COLUMN team TEXT;
CREATE TABLE teams (
    team TEXT PRIMARY KEY NOT NULL,
    members INTEGER NOT NULL,
    samples INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX teams_by_samples ON teams (samples DESC, team);
"#,
    // Version 3: by public id. [`fill_rekey`] has filled `rekey(old, new)` in the same
    // transaction; through a '~' prefix (never in an old key) so that no row meets another's
    // key half-way, even one whose old key was some other row's public id.
    r#"
UPDATE contributors SET identity = '~' || (SELECT new FROM rekey WHERE old = contributors.identity);
UPDATE contributors SET identity = substr(identity, 2);
UPDATE hourly SET identity = '~' || (SELECT new FROM rekey WHERE old = hourly.identity);
UPDATE hourly SET identity = substr(identity, 2);
DROP TABLE rekey;
"#,
];

/// The schema version that re-keys the rows by public id ([`MIGRATIONS`]).
pub const REKEY_VERSION: usize = 3;

/// Before migration [`REKEY_VERSION`]'s script: `rekey(old, new)` with a row per identity in
/// `contributors` or `hourly`, `new` its [`super::public_id`]. Streams (bounded memory for
/// a million rows).
///
/// # Errors
/// SQLite's.
pub fn fill_rekey(tx: &rusqlite::Transaction<'_>) -> rusqlite::Result<()> {
    tx.execute_batch(
        "CREATE TABLE rekey (old TEXT PRIMARY KEY NOT NULL, new TEXT NOT NULL) WITHOUT ROWID;",
    )?;
    let mut read =
        tx.prepare("SELECT identity FROM contributors UNION SELECT identity FROM hourly")?;
    let mut write = tx.prepare("INSERT INTO rekey (old, new) VALUES (?1, ?2)")?;
    let mut rows = read.query([])?;
    while let Some(r) = rows.next()? {
        let old: String = r.get(0)?;
        write.execute(params![old, super::public_id(&old)])?;
    }
    Ok(())
}

/// Buckets of [`bucket`]: exact values below 1024, then 64 per power of two.
pub const BUCKETS: i64 = 1024 + 53 * 64;

/// The writer's page cache, KiB: a flush updates rows all over a table of up to 1,000,000
/// identities (about 200 MiB with its indexes), so the hot index pages should stay cached.
const WRITER_CACHE_KIB: u32 = 64 * 1024;

/// The reader's page cache, KiB (the top of the samples index and the buckets).
const READER_CACHE_KIB: u32 = 16 * 1024;

/// How long a statement waits for the other connection's lock.
const BUSY: Duration = Duration::from_secs(5);

/// The samples bucket of `samples`: the value itself below 1024, above it the power of two and
/// the next 6 bits (so a bucket spans under 1.6% of its values).
pub fn bucket(samples: i64) -> i64 {
    let s = samples.max(0) as u64;
    if s < 1024 {
        return s as i64;
    }
    let e = 63 - i64::from(s.leading_zeros());
    let m = ((s >> (e - 6)) & 63) as i64;
    1024 + (e - 10) * 64 + m
}

/// The largest samples value in bucket `b`.
fn bucket_max(b: i64) -> i64 {
    if b < 1024 {
        return b;
    }
    let (e, m) = ((b - 1024) / 64 + 10, (b - 1024) % 64);
    let upper = ((64 + m as u128) << (e - 6)) + (1u128 << (e - 6)) - 1;
    upper.min(i64::MAX as u128) as i64
}

/// A counter as SQLite stores it (saturating at `i64::MAX`).
fn int(x: u64) -> i64 {
    i64::try_from(x).unwrap_or(i64::MAX)
}

fn client_name(c: ClientKind) -> &'static str {
    match c {
        ClientKind::Native => "native",
        ClientKind::Browser => "browser",
    }
}

fn client_of(s: &str) -> ClientKind {
    if s == "native" {
        ClientKind::Native
    } else {
        ClientKind::Browser
    }
}

/// An open ledger database.
#[derive(Debug)]
pub struct Db {
    conn: Connection,
    path: PathBuf,
}

/// The columns of a [`Contribution`], in [`row`]'s order.
const COLUMNS: &str = "identity, name, client, samples, accepted, rejected, compute_s, sessions, first_seen, last_seen, team";

fn row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Contribution> {
    let n = |i: usize| -> rusqlite::Result<u64> { Ok(r.get::<_, i64>(i)?.max(0) as u64) };
    Ok(Contribution {
        identity: r.get(0)?,
        name: r.get(1)?,
        client: client_of(&r.get::<_, String>(2)?),
        samples: n(3)?,
        pushes_accepted: n(4)?,
        pushes_rejected: n(5)?,
        compute_seconds: clean(r.get(6)?),
        sessions: n(7)?,
        first_seen_unix: clean(r.get(8)?),
        last_seen_unix: clean(r.get(9)?),
        team: r.get(10)?,
        recent: 0.0,
    })
}

/// Old counters plus a delta, saturating.
fn add(old: i64, d: u64) -> i64 {
    old.max(0).saturating_add(int(d))
}

impl Db {
    fn fail(&self, what: &str, e: impl std::fmt::Display) -> Error {
        fail(&self.path, what, e)
    }

    /// Opens (or creates) the ledger at `path` for writing: checks an existing file (module
    /// doc, "Refusals"), switches it to WAL with `synchronous=FULL` and brings its schema up
    /// to date.
    ///
    /// # Errors
    /// [`Error::Ledger`] naming `path`: not a database, corrupt, not crowdgrad's, newer than
    /// this build, or not writable.
    pub fn open(path: &Path) -> Result<Self> {
        let existing = match std::fs::metadata(path) {
            Ok(m) if m.is_dir() => return Err(fail(path, "opening", "it is a directory")),
            Ok(m) => m.len() > 0,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
            Err(e) => return Err(fail(path, "opening", e)),
        };
        let flags = if existing {
            OpenFlags::SQLITE_OPEN_READ_WRITE
        } else {
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE
        };
        let conn = Connection::open_with_flags(path, flags | OpenFlags::SQLITE_OPEN_NO_MUTEX)
            .map_err(|e| fail(path, "opening", e))?;
        let mut db = Self {
            conn,
            path: path.to_path_buf(),
        };
        db.conn
            .busy_timeout(BUSY)
            .map_err(|e| db.fail("setting the busy timeout", e))?;
        if existing {
            db.check()?;
        }
        let mode: String = db
            .conn
            .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
            .map_err(|e| db.fail("switching to WAL", e))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(db.fail("switching to WAL", format!("journal mode is {mode}")));
        }
        db.conn
            .execute_batch(&format!(
                "PRAGMA synchronous=FULL; PRAGMA foreign_keys=OFF; PRAGMA temp_store=MEMORY; PRAGMA cache_size=-{WRITER_CACHE_KIB};"
            ))
            .map_err(|e| db.fail("setting synchronous=FULL", e))?;
        db.migrate()?;
        Ok(db)
    }

    /// Opens the ledger at `path` (made by [`Db::open`]) for reading only.
    ///
    /// # Errors
    /// [`Error::Ledger`] naming `path`.
    pub fn reader(path: &Path) -> Result<Self> {
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|e| fail(path, "opening for reading", e))?;
        let db = Self {
            conn,
            path: path.to_path_buf(),
        };
        db.conn
            .busy_timeout(BUSY)
            .map_err(|e| db.fail("setting the busy timeout", e))?;
        db.conn
            .execute_batch(&format!(
                "PRAGMA query_only=ON; PRAGMA cache_size=-{READER_CACHE_KIB};"
            ))
            .map_err(|e| db.fail("opening for reading", e))?;
        Ok(db)
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The read-only checks of an existing file (module doc, "Refusals").
    fn check(&self) -> Result<()> {
        let app: i32 = self
            .conn
            .query_row("PRAGMA application_id", [], |r| r.get(0))
            .map_err(|e| {
                self.fail(
                    "reading it",
                    format!("{e} (not a SQLite database, or a corrupt one; it was left untouched)"),
                )
            })?;
        if app != APPLICATION_ID {
            let tables: i64 = self
                .conn
                .query_row(
                    "SELECT count(*) FROM sqlite_master WHERE type = 'table'",
                    [],
                    |r| r.get(0),
                )
                .unwrap_or(-1);
            return Err(self.fail(
                "refusing it",
                format!(
                    "not a crowdgrad ledger (application_id {app:#x}, expected {APPLICATION_ID:#x}; {tables} tables); it was left untouched: move it away or give --ledger another path"
                ),
            ));
        }
        let version: i64 = self
            .conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(|e| self.fail("reading its version", e))?;
        if version > MIGRATIONS.len() as i64 {
            return Err(self.fail(
                "refusing it",
                format!(
                    "schema version {version} is newer than this crowdgrad's {} (written by a newer crowdgrad); it was left untouched",
                    MIGRATIONS.len()
                ),
            ));
        }
        let verdict: String = self
            .conn
            .query_row("PRAGMA quick_check", [], |r| r.get(0))
            .map_err(|e| self.fail("checking it", format!("{e}; it was left untouched")))?;
        if verdict != "ok" {
            return Err(self.fail(
                "refusing it",
                format!("corrupt (quick_check: {verdict}); it was left untouched"),
            ));
        }
        Ok(())
    }

    /// Runs the migrations past the file's `user_version`, each in a transaction with its
    /// new version (the first also sets [`APPLICATION_ID`]).
    fn migrate(&mut self) -> Result<()> {
        let version: i64 = self
            .conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(|e| self.fail("reading its version", e))?;
        for (i, sql) in MIGRATIONS.iter().enumerate().skip(version.max(0) as usize) {
            let path = self.path.clone();
            let tx = self
                .conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(|e| fail(&path, "migrating", e))?;
            if i + 1 == REKEY_VERSION {
                fill_rekey(&tx)
                    .map_err(|e| fail(&path, &format!("migrating to version {}", i + 1), e))?;
            }
            tx.execute_batch(sql)
                .map_err(|e| fail(&path, &format!("migrating to version {}", i + 1), e))?;
            tx.execute_batch(&format!(
                "PRAGMA application_id = {APPLICATION_ID}; PRAGMA user_version = {};",
                i + 1
            ))
            .map_err(|e| fail(&path, "migrating", e))?;
            tx.commit().map_err(|e| fail(&path, "migrating", e))?;
        }
        Ok(())
    }

    fn meta(&self, key: &str) -> Result<i64> {
        self.conn
            .query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0))
            .map_err(|e| self.fail("reading meta", e))
    }

    /// Transactions committed so far: the ledger's position.
    ///
    /// # Errors
    /// [`Error::Ledger`] when the database cannot be read.
    pub fn seq(&self) -> Result<u64> {
        Ok(self.meta("seq")?.max(0) as u64)
    }

    /// Identities and samples over all of them.
    ///
    /// # Errors
    /// [`Error::Ledger`] when the database cannot be read.
    pub fn totals(&self) -> Result<(u64, u64)> {
        Ok((
            self.meta("identities")?.max(0) as u64,
            self.meta("samples")?.max(0) as u64,
        ))
    }

    /// Writes `batch` in one transaction (as of `now`, Unix seconds: hourly rows older than
    /// [`HOURLY_KEEP_HOURS`] go, and past [`MAX_IDENTITIES`] the least recently seen) and
    /// returns the new sequence number.
    ///
    /// # Errors
    /// [`Error::Ledger`] when it cannot be written; nothing of the batch is then.
    pub fn apply(&mut self, batch: &Batch, now: f64) -> Result<u64> {
        self.apply_limited(batch, now, MAX_IDENTITIES)
    }

    /// [`Db::apply`] keeping at most `max_identities`.
    ///
    /// # Errors
    /// As [`Db::apply`].
    pub fn apply_limited(&mut self, batch: &Batch, now: f64, max_identities: usize) -> Result<u64> {
        let path = self.path.clone();
        let e = |e: rusqlite::Error| fail(&path, "writing", e);
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(e)?;
        let (mut identities, mut samples, seq) = totals(&tx).map_err(e)?;
        let mut moves: HashMap<i64, i64> = HashMap::new();
        let mut teams = TeamMoves::default();
        {
            let mut get = tx
                .prepare_cached(
                    "SELECT samples, accepted, rejected, compute_s, sessions, first_seen, last_seen, team FROM contributors WHERE identity = ?1",
                )
                .map_err(e)?;
            let mut insert = tx
                .prepare_cached(&format!(
                    "INSERT INTO contributors ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)"
                ))
                .map_err(e)?;
            let mut update = tx
                .prepare_cached(
                    "UPDATE contributors SET name = coalesce(?2, name), client = coalesce(?3, client), samples = ?4, accepted = ?5, rejected = ?6, compute_s = ?7, sessions = ?8, first_seen = ?9, last_seen = ?10, team = coalesce(?11, team) WHERE identity = ?1",
                )
                .map_err(e)?;
            let mut hour = tx
                .prepare_cached(
                    "INSERT INTO hourly (identity, hour, samples, compute_s) VALUES (?1, ?2, ?3, ?4)
                     ON CONFLICT (identity, hour) DO UPDATE SET
                       samples = CASE WHEN samples > 9223372036854775807 - excluded.samples
                                 THEN 9223372036854775807 ELSE samples + excluded.samples END,
                       compute_s = min(compute_s + excluded.compute_s, 1.7976931348623157e308)",
                )
                .map_err(e)?;
            for (identity, d) in &batch.deltas {
                let old = get
                    .query_row([identity], |r| {
                        Ok((
                            r.get::<_, i64>(0)?,
                            r.get::<_, i64>(1)?,
                            r.get::<_, i64>(2)?,
                            r.get::<_, f64>(3)?,
                            r.get::<_, i64>(4)?,
                            r.get::<_, f64>(5)?,
                            r.get::<_, f64>(6)?,
                            r.get::<_, Option<String>>(7)?,
                        ))
                    })
                    .optional()
                    .map_err(e)?;
                let first = d.first_seen.unwrap_or(now);
                let last = d.last_seen.max(first);
                let name = d.name.as_deref();
                let team = d.team.as_deref();
                let client = d.client.map(client_name);
                let new_samples = match old {
                    Some((s, a, r, c, n, f, l, old_team)) => {
                        let ns = add(s, d.samples);
                        update
                            .execute(params![
                                identity,
                                name,
                                client,
                                ns,
                                add(a, d.accepted),
                                add(r, d.rejected),
                                (clean(c) + clean(d.compute_s)).min(f64::MAX),
                                add(n, d.sessions),
                                f.min(first),
                                l.max(last),
                                team,
                            ])
                            .map_err(e)?;
                        *moves.entry(bucket(s)).or_default() -= 1;
                        samples = samples.saturating_sub(s.max(0));
                        if let Some(t) = old_team.as_deref() {
                            teams.leave(t, s);
                        }
                        if let Some(t) = team.or(old_team.as_deref()) {
                            teams.join(t, ns);
                        }
                        ns
                    }
                    None => {
                        let ns = int(d.samples);
                        insert
                            .execute(params![
                                identity,
                                name,
                                client.unwrap_or("browser"),
                                ns,
                                int(d.accepted),
                                int(d.rejected),
                                clean(d.compute_s).min(f64::MAX),
                                int(d.sessions),
                                first,
                                last,
                                team,
                            ])
                            .map_err(e)?;
                        identities += 1;
                        if let Some(t) = team {
                            teams.join(t, ns);
                        }
                        ns
                    }
                };
                *moves.entry(bucket(new_samples)).or_default() += 1;
                samples = samples.saturating_add(new_samples);
                for &(h, s, c) in &d.hours {
                    hour.execute(params![identity, h, int(s), clean(c).min(f64::MAX)])
                        .map_err(e)?;
                }
            }
        }
        // Past the bound, the least recently seen go (not one just written: it is newest).
        let excess = identities - max_identities as i64;
        if excess > 0 {
            let gone: Vec<(String, i64, Option<String>)> = {
                let mut q = tx
                    .prepare_cached(
                        "SELECT identity, samples, team FROM contributors ORDER BY last_seen, identity LIMIT ?1",
                    )
                    .map_err(e)?;
                let rows = q
                    .query_map([excess], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
                    .map_err(e)?;
                rows.collect::<rusqlite::Result<_>>().map_err(e)?
            };
            for (identity, s, team) in gone {
                if let Some(t) = team.as_deref() {
                    teams.leave(t, s);
                }
                tx.execute("DELETE FROM contributors WHERE identity = ?1", [&identity])
                    .map_err(e)?;
                tx.execute("DELETE FROM hourly WHERE identity = ?1", [&identity])
                    .map_err(e)?;
                *moves.entry(bucket(s)).or_default() -= 1;
                samples = samples.saturating_sub(s.max(0));
                identities -= 1;
            }
        }
        tx.execute(
            "DELETE FROM hourly WHERE hour < ?1",
            [hour_of(now) - HOURLY_KEEP_HOURS],
        )
        .map_err(e)?;
        {
            let mut upsert = tx
                .prepare_cached(
                    "INSERT INTO buckets (bucket, n) VALUES (?1, ?2)
                     ON CONFLICT (bucket) DO UPDATE SET n = n + excluded.n",
                )
                .map_err(e)?;
            for (&b, &n) in moves.iter().filter(|(_, &n)| n != 0) {
                upsert.execute([b, n]).map_err(e)?;
            }
        }
        tx.execute("DELETE FROM buckets WHERE n <= 0", [])
            .map_err(e)?;
        teams.write(&tx).map_err(e)?;
        let seq = seq.saturating_add(1);
        for (k, v) in [
            ("seq", seq),
            ("identities", identities),
            ("samples", samples),
        ] {
            tx.execute("UPDATE meta SET value = ?2 WHERE key = ?1", params![k, v])
                .map_err(e)?;
        }
        tx.commit().map_err(e)?;
        Ok(seq.max(0) as u64)
    }

    /// Writes the contributions of an old checkpoint's JSON ledger (`rows`, from
    /// [`super::import_json`]) once: `checkpoint` names it, and a second import of the same
    /// name does nothing (`Ok(None)`). An identity already in the database keeps its row
    /// (it is newer than the checkpoint). Returns the identities added.
    ///
    /// # Errors
    /// [`Error::Ledger`] when it cannot be written; nothing is then.
    pub fn import(&mut self, checkpoint: &str, rows: &[Contribution]) -> Result<Option<usize>> {
        let path = self.path.clone();
        let e = |e: rusqlite::Error| fail(&path, "importing a checkpoint's ledger", e);
        let done: Option<i64> = self
            .conn
            .query_row(
                "SELECT identities FROM imports WHERE checkpoint = ?1",
                [checkpoint],
                |r| r.get(0),
            )
            .optional()
            .map_err(e)?;
        if done.is_some() {
            return Ok(None);
        }
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(e)?;
        let (mut identities, mut samples, seq) = totals(&tx).map_err(e)?;
        let mut added = 0usize;
        let mut moves: HashMap<i64, i64> = HashMap::new();
        let mut teams = TeamMoves::default();
        {
            let mut insert = tx
                .prepare_cached(&format!(
                    "INSERT OR IGNORE INTO contributors ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)"
                ))
                .map_err(e)?;
            for c in rows.iter().take(MAX_IDENTITIES) {
                let s = int(c.samples);
                let n = insert
                    .execute(params![
                        c.identity,
                        c.name,
                        client_name(c.client),
                        s,
                        int(c.pushes_accepted),
                        int(c.pushes_rejected),
                        clean(c.compute_seconds),
                        int(c.sessions),
                        clean(c.first_seen_unix),
                        clean(c.last_seen_unix),
                        c.team,
                    ])
                    .map_err(e)?;
                if n > 0 {
                    if let Some(t) = c.team.as_deref() {
                        teams.join(t, s);
                    }
                    added += 1;
                    identities += 1;
                    samples = samples.saturating_add(s);
                    *moves.entry(bucket(s)).or_default() += 1;
                }
            }
            let mut upsert = tx
                .prepare_cached(
                    "INSERT INTO buckets (bucket, n) VALUES (?1, ?2)
                     ON CONFLICT (bucket) DO UPDATE SET n = n + excluded.n",
                )
                .map_err(e)?;
            for (&b, &n) in &moves {
                upsert.execute([b, n]).map_err(e)?;
            }
        }
        teams.write(&tx).map_err(e)?;
        tx.execute(
            "INSERT INTO imports (checkpoint, identities, at) VALUES (?1, ?2, ?3)",
            params![checkpoint, added as i64, super::unix_now()],
        )
        .map_err(e)?;
        for (k, v) in [
            ("seq", seq.saturating_add(1)),
            ("identities", identities),
            ("samples", samples),
        ] {
            tx.execute("UPDATE meta SET value = ?2 WHERE key = ?1", params![k, v])
                .map_err(e)?;
        }
        tx.commit().map_err(e)?;
        Ok(Some(added))
    }

    /// One identity's row (its `recent` as of `now`).
    ///
    /// # Errors
    /// [`Error::Ledger`] when the database cannot be read.
    pub fn get(&self, identity: &str, now: f64) -> Result<Option<Contribution>> {
        let c = self
            .conn
            .prepare_cached(&format!(
                "SELECT {COLUMNS} FROM contributors WHERE identity = ?1"
            ))
            .and_then(|mut q| q.query_row([identity], row).optional())
            .map_err(|e| self.fail("reading", e))?;
        match c {
            Some(mut c) => {
                c.recent = self.recent(identity, now)?;
                Ok(Some(c))
            }
            None => Ok(None),
        }
    }

    /// Samples per hour `identity` was credited over the last [`RECENT_HOURS`] hours.
    fn recent(&self, identity: &str, now: f64) -> Result<f64> {
        let sum: f64 = self
            .conn
            .prepare_cached("SELECT total(samples) FROM hourly WHERE identity = ?1 AND hour > ?2")
            .and_then(|mut q| {
                q.query_row(params![identity, hour_of(now) - RECENT_HOURS], |r| r.get(0))
            })
            .map_err(|e| self.fail("reading", e))?;
        Ok(sum / RECENT_HOURS as f64)
    }

    /// The `limit` identities with the most samples (ties by identity), as of `now`.
    ///
    /// # Errors
    /// [`Error::Ledger`] when the database cannot be read.
    pub fn top(&self, limit: usize, now: f64) -> Result<Vec<Contribution>> {
        let mut v: Vec<Contribution> = self
            .conn
            .prepare_cached(&format!(
                "SELECT {COLUMNS} FROM contributors ORDER BY samples DESC, identity LIMIT ?1"
            ))
            .and_then(|mut q| {
                q.query_map([limit as i64], row)?
                    .collect::<rusqlite::Result<Vec<_>>>()
            })
            .map_err(|e| self.fail("reading", e))?;
        for c in &mut v {
            c.recent = self.recent(&c.identity, now)?;
        }
        Ok(v)
    }

    /// The `limit` teams with the most samples (ties by name).
    ///
    /// # Errors
    /// [`Error::Ledger`] when the database cannot be read.
    pub fn teams(&self, limit: usize) -> Result<Vec<super::TeamRow>> {
        self.conn
            .prepare_cached(
                "SELECT team, members, samples FROM teams ORDER BY samples DESC, team LIMIT ?1",
            )
            .and_then(|mut q| {
                q.query_map([limit as i64], |r| {
                    Ok(super::TeamRow {
                        team: r.get(0)?,
                        members: r.get::<_, i64>(1)?.max(0) as u64,
                        samples: r.get::<_, i64>(2)?.max(0) as u64,
                    })
                })?
                .collect::<rusqlite::Result<Vec<_>>>()
            })
            .map_err(|e| self.fail("reading", e))
    }

    /// The rank of `identity` (1 = most samples; ties by identity), if it is known.
    ///
    /// # Errors
    /// [`Error::Ledger`] when the database cannot be read.
    pub fn rank(&self, identity: &str) -> Result<Option<u64>> {
        let fail = |e: rusqlite::Error| self.fail("reading", e);
        let Some(s) = self
            .conn
            .prepare_cached("SELECT samples FROM contributors WHERE identity = ?1")
            .and_then(|mut q| q.query_row([identity], |r| r.get::<_, i64>(0)).optional())
            .map_err(fail)?
        else {
            return Ok(None);
        };
        let b = bucket(s);
        let above: i64 = self
            .conn
            .prepare_cached("SELECT coalesce(sum(n), 0) FROM buckets WHERE bucket > ?1")
            .and_then(|mut q| q.query_row([b], |r| r.get(0)))
            .map_err(fail)?;
        let within: i64 = self
            .conn
            .prepare_cached(
                "SELECT count(*) FROM contributors WHERE samples > ?1 AND samples <= ?2",
            )
            .and_then(|mut q| q.query_row([s, bucket_max(b)], |r| r.get(0)))
            .map_err(fail)?;
        let ties: i64 = self
            .conn
            .prepare_cached(
                "SELECT count(*) FROM contributors WHERE samples = ?1 AND identity < ?2",
            )
            .and_then(|mut q| q.query_row(params![s, identity], |r| r.get(0)))
            .map_err(fail)?;
        Ok(Some((above + within + ties).max(0) as u64 + 1))
    }

    /// The leaderboard: totals, the top `limit` and, if asked, one identity and its rank, read
    /// in one transaction (one consistent snapshot), as of `now`.
    ///
    /// # Errors
    /// [`Error::Ledger`] when the database cannot be read.
    pub fn board(&self, limit: usize, identity: Option<&str>, now: f64) -> Result<Board> {
        self.conn
            .execute_batch("BEGIN DEFERRED")
            .map_err(|e| self.fail("reading", e))?;
        let board = (|| {
            let (total, samples) = self.totals()?;
            let contributors = self.top(limit, now)?;
            let teams = self.teams(super::BOARD_TEAMS)?;
            let (you, your_rank) = match identity {
                Some(id) => (self.get(id, now)?, self.rank(id)?),
                None => (None, None),
            };
            Ok(Board {
                total: total as usize,
                samples,
                contributors,
                your_rank: you.as_ref().and(your_rank).map(|r| r as usize),
                you,
                teams,
            })
        })();
        let _ = self.conn.execute_batch("COMMIT");
        board
    }

    /// Every identity as CSV ([`super::to_csv`]'s shape), most samples first, in one snapshot.
    ///
    /// # Errors
    /// [`Error::Ledger`] when the database cannot be read.
    pub fn csv(&self) -> Result<String> {
        let mut out = String::from(super::CSV_HEADER);
        self.conn
            .prepare_cached(&format!(
                "SELECT {COLUMNS} FROM contributors ORDER BY samples DESC, identity"
            ))
            .and_then(|mut q| {
                for c in q.query_map([], row)? {
                    super::csv_row(&c?, &mut out);
                }
                Ok(())
            })
            .map_err(|e| self.fail("reading", e))?;
        Ok(out)
    }

    /// `PRAGMA quick_check` and the bucket counts against the rows: `Ok(())` when both hold.
    ///
    /// # Errors
    /// [`Error::Ledger`] saying what does not hold.
    pub fn verify(&self) -> Result<()> {
        let verdict: String = self
            .conn
            .query_row("PRAGMA quick_check", [], |r| r.get(0))
            .map_err(|e| self.fail("checking", e))?;
        if verdict != "ok" {
            return Err(self.fail("checking", verdict));
        }
        let (rows, in_buckets, ids): (i64, i64, i64) = self
            .conn
            .query_row(
                "SELECT (SELECT count(*) FROM contributors), (SELECT coalesce(sum(n), 0) FROM buckets), (SELECT value FROM meta WHERE key = 'identities')",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .map_err(|e| self.fail("checking", e))?;
        if rows != in_buckets || rows != ids {
            return Err(self.fail(
                "checking",
                format!("{rows} rows, {in_buckets} in buckets, {ids} counted"),
            ));
        }
        // Every team's members and samples against its rows (total(): a float sum, which
        // cannot overflow on saturated counts).
        let off: Option<String> = self
            .conn
            .query_row(
                "SELECT coalesce(g.team, t.team) FROM
                   (SELECT team, count(*) AS m, total(samples) AS s FROM contributors
                    WHERE team IS NOT NULL GROUP BY team) AS g
                   FULL OUTER JOIN teams AS t ON t.team = g.team
                 WHERE g.m IS NOT t.members OR abs(g.s - t.samples) > 1e-9 * max(1.0, g.s)
                    OR g.s IS NULL OR t.samples IS NULL
                 LIMIT 1",
                [],
                |r| r.get(0),
            )
            .optional()
            .map_err(|e| self.fail("checking", e))?;
        if let Some(team) = off {
            return Err(self.fail(
                "checking",
                format!("team {team:?} does not match its members' rows"),
            ));
        }
        Ok(())
    }
}

/// Changes to the `teams` table within one write: members and samples by team, added up and
/// then written once ([`TeamMoves::write`]).
#[derive(Debug, Default)]
struct TeamMoves(HashMap<String, (i64, i64)>);

impl TeamMoves {
    /// An identity with `samples` is now in `team`.
    fn join(&mut self, team: &str, samples: i64) {
        let m = self.0.entry(team.to_string()).or_default();
        m.0 += 1;
        m.1 = m.1.saturating_add(samples);
    }

    /// An identity with `samples` is no longer counted in `team`.
    fn leave(&mut self, team: &str, samples: i64) {
        let m = self.0.entry(team.to_string()).or_default();
        m.0 -= 1;
        m.1 = m.1.saturating_sub(samples);
    }

    /// Adds the moves into `teams` and drops the teams left without members.
    fn write(&self, tx: &rusqlite::Transaction<'_>) -> rusqlite::Result<()> {
        let mut upsert = tx.prepare_cached(
            "INSERT INTO teams (team, members, samples) VALUES (?1, ?2, max(?3, 0))
             ON CONFLICT (team) DO UPDATE SET members = members + excluded.members,
               samples = max(0, CASE WHEN ?3 > 0 AND samples > 9223372036854775807 - ?3
                           THEN 9223372036854775807 ELSE samples + ?3 END)",
        )?;
        for (t, &(m, s)) in self.0.iter().filter(|(_, &(m, s))| m != 0 || s != 0) {
            upsert.execute(params![t, m, s])?;
        }
        if !self.0.is_empty() {
            tx.execute("DELETE FROM teams WHERE members <= 0", [])?;
        }
        Ok(())
    }
}

fn fail(path: &Path, what: &str, e: impl std::fmt::Display) -> Error {
    Error::Ledger(format!("{}: {what}: {e}", path.display()))
}

/// The ledger's running totals in `meta`: identities, samples and the last committed seq.
fn totals(tx: &rusqlite::Transaction<'_>) -> rusqlite::Result<(i64, i64, i64)> {
    let get = |k: &str| -> rusqlite::Result<i64> {
        tx.query_row("SELECT value FROM meta WHERE key = ?1", [k], |r| r.get(0))
    };
    Ok((get("identities")?, get("samples")?, get("seq")?))
}
