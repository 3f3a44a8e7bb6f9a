//! `crowdgrad bench ledger`: the contribution ledger's database at scale (issue 18). Fills
//! `--identities` rows through the writer's own code ([`Db::apply`], batches of
//! `--batch`), then prints the insert rate, the file size, the time to reopen it (with its
//! `quick_check`), p50/p99 of a rank query and of a top-10 query over random identities, and
//! the time of a flush of `--batch` updates to existing rows.
//!
//! `--crash-writer` is the child of the kill -9 test (tests/integration/ledger.rs): it writes
//! batches for ever and prints `committed SEQ` after each commit returns; the test kills it
//! with SIGKILL and checks that every reported sequence number's rows are in the file.

use crate::error::{Error, Result};
use crate::registry::ledger::db::Db;
use crate::registry::ledger::{unix_now, Batch, Delta};
use crowdgrad_core::wire::ClientKind;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

/// Flags of `crowdgrad bench ledger`.
#[derive(Debug, Clone, clap::Args)]
pub struct LedgerArgs {
    /// Identities to fill the database with.
    #[arg(long, default_value_t = 1_000_000)]
    pub identities: usize,
    /// Identities per transaction while filling (the writer flushes one transaction a second).
    #[arg(long, default_value_t = 10_000)]
    pub batch: usize,
    /// Rank and top-10 queries to time, each.
    #[arg(long, default_value_t = 1000)]
    pub queries: usize,
    /// The database file (default: a new file in the temporary directory, deleted after).
    #[arg(long)]
    pub db: Option<PathBuf>,
    /// Be the kill -9 test's child: write batches to --db until killed, printing
    /// `committed SEQ` after each commit.
    #[arg(long, hide = true, requires = "db")]
    pub crash_writer: bool,
}

/// The identity of row `i` of the bench.
fn identity(i: u64) -> String {
    format!("bench-{i:010}")
}

/// A splitmix64 step (the bench needs no better randomness).
fn mix(z: &mut u64) -> u64 {
    *z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut x = *z;
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Heavy-tailed samples (most volunteers give little, a few a lot).
fn samples(z: &mut u64) -> u64 {
    let u = (mix(z) >> 11) as f64 / (1u64 << 53) as f64;
    (100.0 / (1.0 - u * 0.999_999).powf(1.0 / 1.2)) as u64
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(((v.len() as f64 - 1.0) * p).round() as usize)
        .copied()
        .unwrap_or(0.0)
}

/// Runs the bench (or the crash writer) and prints its figures.
///
/// # Errors
/// When the database cannot be made or written.
pub fn cli(args: &LedgerArgs) -> Result<()> {
    if args.crash_writer {
        return crash_writer(args);
    }
    let (path, temporary) = match &args.db {
        Some(p) => (p.clone(), false),
        None => (
            std::env::temp_dir().join(format!(
                "crowdgrad-bench-ledger-{}.sqlite",
                std::process::id()
            )),
            true,
        ),
    };
    let result = run(args, &path);
    if temporary {
        for s in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{s}", path.display()));
        }
    }
    result
}

fn run(args: &LedgerArgs, path: &std::path::Path) -> Result<()> {
    let n = args.identities.max(1) as u64;
    let per = args.batch.max(1) as u64;
    let mut db = Db::open(path)?;
    let mut z = 42u64;
    let now = unix_now();
    let started = Instant::now();
    let mut i = 0u64;
    while i < n {
        let mut batch = Batch::default();
        for j in i..(i + per).min(n) {
            let s = samples(&mut z);
            batch.deltas.insert(
                identity(j),
                Delta {
                    name: Some(format!("volunteer {j}")),
                    client: Some(ClientKind::Browser),
                    samples: s,
                    accepted: s / 32 + 1,
                    compute_s: s as f64 * 0.001,
                    sessions: 1,
                    first_seen: Some(now),
                    last_seen: now,
                    hours: vec![(crate::registry::ledger::hour_of(now), s, s as f64 * 0.001)],
                    ..Delta::default()
                },
            );
        }
        db.apply_limited(&batch, now, n as usize)?;
        i += per;
    }
    let fill = started.elapsed().as_secs_f64();
    // An update flush as the writer does it every second: `per` existing identities.
    let mut batch = Batch::default();
    for _ in 0..per {
        let j = mix(&mut z) % n;
        batch.deltas.insert(
            identity(j),
            Delta {
                samples: 32,
                accepted: 1,
                last_seen: now + 1.0,
                hours: vec![(crate::registry::ledger::hour_of(now), 32, 0.0)],
                ..Delta::default()
            },
        );
    }
    let t = Instant::now();
    db.apply_limited(&batch, now + 1.0, n as usize)?;
    let update = t.elapsed().as_secs_f64();
    drop(db);
    let wal = std::fs::metadata(format!("{}-wal", path.display())).map_or(0, |m| m.len());
    let size = std::fs::metadata(path)
        .map_err(|e| Error::io("ledger size", e))?
        .len();
    let t = Instant::now();
    let db = Db::open(path)?;
    let reopen = t.elapsed().as_secs_f64();
    let reader = Db::reader(path)?;
    let (mut rank, mut top) = (Vec::new(), Vec::new());
    for _ in 0..args.queries.max(1) {
        let id = identity(mix(&mut z) % n);
        let t = Instant::now();
        let r = reader.rank(&id)?;
        rank.push(t.elapsed().as_secs_f64() * 1e3);
        if r.is_none() {
            return Err(Error::Ledger(format!("{id} has no rank")));
        }
        let t = Instant::now();
        let v = reader.top(10, now)?;
        top.push(t.elapsed().as_secs_f64() * 1e3);
        if v.len() != 10.min(n as usize) {
            return Err(Error::Ledger(format!("top 10 returned {}", v.len())));
        }
    }
    let t = Instant::now();
    let board = reader.board(100, Some(&identity(n / 2)), now)?;
    let board_ms = t.elapsed().as_secs_f64() * 1e3;
    drop(db);
    println!("| identities | insert rate | file size | reopen + quick_check | flush of {per} updates | rank p50 / p99 | top-10 p50 / p99 | board (top 100 + rank) |");
    println!("|---|---|---|---|---|---|---|---|");
    println!(
        "| {} | {:.0} rows/s ({:.1} s) | {:.1} MiB (+ {:.1} MiB WAL) | {:.2} s | {:.1} ms | {:.3} / {:.3} ms | {:.3} / {:.3} ms | {:.2} ms |",
        board.total,
        n as f64 / fill,
        fill,
        size as f64 / (1 << 20) as f64,
        wal as f64 / (1 << 20) as f64,
        reopen,
        update * 1e3,
        percentile(&mut rank, 0.5),
        percentile(&mut rank, 0.99),
        percentile(&mut top, 0.5),
        percentile(&mut top, 0.99),
        board_ms,
    );
    Ok(())
}

/// The kill -9 test's child: batch `seq` adds identity `crash-{seq}` with `seq` samples,
/// adds 1 sample to `crash-counter`, and updates 500 others; after each commit it prints
/// `committed SEQ`. Runs until killed.
fn crash_writer(args: &LedgerArgs) -> Result<()> {
    let path = args.db.clone().unwrap_or_default();
    let mut db = Db::open(&path)?;
    let mut z = 7u64;
    let mut out = std::io::stdout().lock();
    loop {
        let next = db.seq()? + 1;
        let mut batch = Batch::default();
        let now = unix_now();
        let row = |samples: u64| Delta {
            client: Some(ClientKind::Native),
            samples,
            accepted: 1,
            sessions: 1,
            first_seen: Some(now),
            last_seen: now,
            hours: vec![(crate::registry::ledger::hour_of(now), samples, 0.0)],
            ..Delta::default()
        };
        batch.deltas.insert(format!("crash-{next:010}"), row(next));
        batch.deltas.insert("crash-counter".into(), row(1));
        for _ in 0..500 {
            let k = mix(&mut z) % 20_000;
            batch.deltas.insert(format!("churn-{k:08}"), row(3));
        }
        let seq = db.apply(&batch, now)?;
        writeln!(out, "committed {seq}").map_err(|e| Error::io("stdout", e))?;
        out.flush().map_err(|e| Error::io("stdout", e))?;
    }
}
