//! The contribution ledger: what every volunteer gave the run, by a stable identity that
//! survives reconnections, page reloads and server restarts (it is saved in every checkpoint
//! and restored on resume).
//!
//! A worker may send an `identity` with its join (`POST /api/join`): the browser keeps a
//! random one in `localStorage`, the native worker in a file under its data directory (or
//! `--id`). Worker ids change with every join; the identity does not. Per identity the
//! ledger counts samples (of applied pushes, once per step like the status), accepted and
//! rejected pushes (over all shards), compute seconds (from the worker's `Report` frames, 0
//! for workers that send none), sessions, and first and last seen (Unix seconds).
//!
//! Bounded: at most [`MAX_IDENTITIES`]; when full, the identity least recently seen is
//! forgotten for a new one.

use crate::error::{Error, Result};
use crowdgrad_core::shard::Outcome;
use crowdgrad_core::wire::ClientKind;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// Most identities kept.
pub const MAX_IDENTITIES: usize = 100_000;

/// Longest identity accepted, in bytes.
pub const MAX_IDENTITY_LEN: usize = 64;

/// Whether `id` is an acceptable identity: 8 to 64 characters of `[A-Za-z0-9_-]`.
///
/// # Errors
/// A message saying what is wrong.
pub fn check_identity(id: &str) -> std::result::Result<(), String> {
    if !(8..=MAX_IDENTITY_LEN).contains(&id.len()) {
        return Err(format!(
            "identity must be 8 to {MAX_IDENTITY_LEN} characters, got {}",
            id.len()
        ));
    }
    if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err("identity may only hold letters, digits, '-' and '_'".into());
    }
    Ok(())
}

/// What one identity contributed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Contribution {
    /// The identity.
    pub identity: String,
    /// The last display name it gave.
    pub name: Option<String>,
    /// The kind of its last session.
    pub client: ClientKind,
    /// Examples behind its applied pushes (counted once per step).
    pub samples: u64,
    /// Pushes applied or buffered, over all shards.
    pub pushes_accepted: u64,
    /// Pushes rejected, over all shards.
    pub pushes_rejected: u64,
    /// Seconds spent computing, as its `Report` frames say (0 when it sends none).
    pub compute_seconds: f64,
    /// Joins.
    pub sessions: u64,
    /// First join, Unix seconds.
    pub first_seen_unix: f64,
    /// Last push or join, Unix seconds.
    pub last_seen_unix: f64,
}

/// The ledger (no lock of its own: the registry holds it under its lock).
#[derive(Debug, Default, Clone)]
pub struct Ledger {
    by_identity: HashMap<String, Contribution>,
    /// Worker id -> identity, for the workers of this process' lifetime.
    workers: HashMap<u64, String>,
    /// Worker id -> last compute seconds reported (reports are cumulative per session).
    reported: HashMap<u64, f64>,
}

/// The ledger as checkpoints store it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Saved {
    /// Every identity's contribution.
    pub contributors: Vec<Contribution>,
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Ledger {
    /// Worker `worker` joined as `identity` (checked with [`check_identity`] by the caller).
    pub fn joined(&mut self, worker: u64, identity: &str, name: Option<&str>, client: ClientKind) {
        let now = unix_now();
        if !self.by_identity.contains_key(identity) && self.by_identity.len() >= MAX_IDENTITIES {
            if let Some(oldest) = self
                .by_identity
                .values()
                .min_by(|a, b| a.last_seen_unix.total_cmp(&b.last_seen_unix))
                .map(|c| c.identity.clone())
            {
                self.by_identity.remove(&oldest);
            }
        }
        let c = self
            .by_identity
            .entry(identity.to_string())
            .or_insert_with(|| Contribution {
                identity: identity.to_string(),
                name: None,
                client,
                samples: 0,
                pushes_accepted: 0,
                pushes_rejected: 0,
                compute_seconds: 0.0,
                sessions: 0,
                first_seen_unix: now,
                last_seen_unix: now,
            });
        c.sessions += 1;
        c.client = client;
        if let Some(n) = name {
            c.name = Some(n.to_string());
        }
        c.last_seen_unix = now;
        if self.workers.len() >= 4 * MAX_IDENTITIES {
            self.workers.clear();
            self.reported.clear();
        }
        self.workers.insert(worker, identity.to_string());
    }

    fn of(&mut self, worker: u64) -> Option<&mut Contribution> {
        let id = self.workers.get(&worker)?;
        self.by_identity.get_mut(id)
    }

    /// A push of `worker` had `outcome`; `samples` is `Some` on the shard that counts them.
    pub fn pushed(&mut self, worker: u64, outcome: &Outcome, samples: Option<u32>) {
        let Some(c) = self.of(worker) else { return };
        match outcome {
            Outcome::Applied { .. } | Outcome::Buffered { .. } => {
                c.pushes_accepted += 1;
                c.samples += u64::from(samples.unwrap_or(0));
            }
            Outcome::Rejected { .. } => c.pushes_rejected += 1,
        }
        c.last_seen_unix = unix_now();
    }

    /// `worker` reported `compute_s` seconds of computing in its session so far.
    pub fn reported(&mut self, worker: u64, compute_s: f64) {
        if !(compute_s.is_finite() && compute_s >= 0.0) {
            return;
        }
        let last = self.reported.insert(worker, compute_s).unwrap_or(0.0);
        let delta = (compute_s - last).max(0.0);
        if let Some(c) = self.of(worker) {
            c.compute_seconds += delta;
        }
    }

    /// Every contribution, most samples first.
    pub fn contributors(&self) -> Vec<Contribution> {
        let mut v: Vec<Contribution> = self.by_identity.values().cloned().collect();
        v.sort_by(|a, b| {
            b.samples
                .cmp(&a.samples)
                .then_with(|| a.identity.cmp(&b.identity))
        });
        v
    }

    /// One identity's contribution.
    pub fn get(&self, identity: &str) -> Option<Contribution> {
        self.by_identity.get(identity).cloned()
    }

    /// Identities known.
    pub fn len(&self) -> usize {
        self.by_identity.len()
    }

    /// True when nobody contributed yet.
    pub fn is_empty(&self) -> bool {
        self.by_identity.is_empty()
    }

    /// The saved form.
    pub fn save(&self) -> Saved {
        Saved {
            contributors: self.contributors(),
        }
    }

    /// A ledger from its saved form (a checkpoint's `ledger` metadata; `null` is empty).
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for JSON that is not a saved ledger.
    pub fn restore(json: &serde_json::Value) -> Result<Self> {
        if json.is_null() {
            return Ok(Self::default());
        }
        let saved: Saved = serde_json::from_value(json.clone())
            .map_err(|e| Error::Checkpoint(format!("bad ledger: {e}")))?;
        let mut by_identity = HashMap::new();
        for c in saved.contributors.into_iter().take(MAX_IDENTITIES) {
            if check_identity(&c.identity).is_ok() {
                by_identity.insert(c.identity.clone(), c);
            }
        }
        Ok(Self {
            by_identity,
            ..Self::default()
        })
    }
}

/// The ledger as CSV (`GET /api/contributors?format=csv`): a header line, then one line per
/// identity, most samples first. Text cells go through [`csv_cell`] (names are always quoted),
/// so a spreadsheet opening the export never evaluates a name as a formula.
pub fn to_csv(rows: &[Contribution]) -> String {
    let mut out = String::from(
        "identity,name,client,samples,pushes_accepted,pushes_rejected,compute_seconds,sessions,first_seen_unix,last_seen_unix\n",
    );
    for c in rows {
        let client = match c.client {
            ClientKind::Native => "native",
            ClientKind::Browser => "browser",
        };
        out.push_str(&format!(
            "{},{},{},{},{},{},{:.3},{},{:.3},{:.3}\n",
            csv_cell(&c.identity, false),
            csv_cell(c.name.as_deref().unwrap_or(""), true),
            client,
            c.samples,
            c.pushes_accepted,
            c.pushes_rejected,
            c.compute_seconds,
            c.sessions,
            c.first_seen_unix,
            c.last_seen_unix
        ));
    }
    out
}

/// One CSV text cell, safe to open in a spreadsheet (OWASP "CSV injection"): a cell whose first
/// character is `=`, `+`, `-`, `@`, a tab or a carriage return gets a leading `'` so it is
/// read as text, not as a formula; a cell holding a comma, a quote, a CR or an LF (or any cell
/// when `quote`) is put in double quotes, with its quotes doubled (RFC 4180).
pub fn csv_cell(text: &str, quote: bool) -> String {
    let mut cell = String::with_capacity(text.len() + 3);
    if text.starts_with(['=', '+', '-', '@', '\t', '\r']) {
        cell.push('\'');
    }
    cell.push_str(text);
    if quote || cell.contains([',', '"', '\r', '\n']) {
        format!("\"{}\"", cell.replace('"', "\"\""))
    } else {
        cell
    }
}

/// A summary for the page: the top `limit` and the total count.
#[derive(Debug, Clone, Serialize)]
pub struct Board {
    /// Identities known.
    pub total: usize,
    /// Samples over all identities.
    pub samples: u64,
    /// The top contributors, most samples first.
    pub contributors: Vec<Contribution>,
    /// The one asked for with `?identity=`, wherever it ranks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub you: Option<Contribution>,
    /// Its rank (1 = most samples).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub your_rank: Option<usize>,
}

impl Ledger {
    /// The top `limit` contributors and, if given, one identity's entry and rank.
    pub fn board(&self, limit: usize, identity: Option<&str>) -> Board {
        let all = self.contributors();
        let rank = identity.and_then(|id| all.iter().position(|c| c.identity == id));
        Board {
            total: all.len(),
            samples: all.iter().map(|c| c.samples).sum(),
            you: rank.map(|r| all[r].clone()),
            your_rank: rank.map(|r| r + 1),
            contributors: all.into_iter().take(limit).collect(),
        }
    }
}

impl Ledger {
    /// The ledger as the checkpoint stores it.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self.save()).unwrap_or(serde_json::Value::Null)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crowdgrad_core::wire::ErrorCode;

    fn applied() -> Outcome {
        Outcome::Applied {
            version: 1,
            staleness: 0,
            lr_scale: 1.0,
            merged: 1,
        }
    }

    #[test]
    fn identities_accumulate_across_sessions_and_restarts() {
        let mut l = Ledger::default();
        l.joined(1, "alice-0001", Some("Alice"), ClientKind::Browser);
        l.pushed(1, &applied(), Some(32));
        l.pushed(1, &applied(), None);
        l.pushed(
            1,
            &Outcome::Rejected {
                code: ErrorCode::TooStale,
                message: "old".into(),
            },
            Some(32),
        );
        l.reported(1, 2.0);
        l.reported(1, 3.5);
        // A new session of the same identity (worker ids change).
        l.joined(7, "alice-0001", None, ClientKind::Browser);
        l.pushed(7, &applied(), Some(32));
        l.reported(7, 1.0);
        l.joined(8, "bob-000001", None, ClientKind::Native);
        l.pushed(99, &applied(), Some(32)); // unknown worker: ignored
        let a = l.get("alice-0001").unwrap();
        assert_eq!(
            (a.samples, a.pushes_accepted, a.pushes_rejected, a.sessions),
            (64, 3, 1, 2)
        );
        assert_eq!(a.compute_seconds, 4.5);
        assert_eq!(a.name.as_deref(), Some("Alice"));
        // Saved and restored (as a checkpoint does), it is the same.
        let json = serde_json::to_value(l.save()).unwrap();
        let back = Ledger::restore(&json).unwrap();
        assert_eq!(back.contributors(), l.contributors());
        assert_eq!(back.contributors()[0].identity, "alice-0001");
        assert!(Ledger::restore(&serde_json::Value::Null)
            .unwrap()
            .is_empty());
        assert!(Ledger::restore(&serde_json::json!({"contributors": 3})).is_err());
        let b = l.board(1, Some("bob-000001"));
        assert_eq!(
            (b.total, b.contributors.len(), b.your_rank),
            (2, 1, Some(2))
        );
        let csv = to_csv(&l.contributors());
        assert!(csv.starts_with("identity,name,"));
        assert!(
            csv.contains("alice-0001,\"Alice\",browser,64,3,1,4.500,2,"),
            "{csv}"
        );
    }

    #[test]
    fn csv_cells_never_start_a_formula() {
        for (text, quote, cell) in [
            ("Alice", false, "Alice"),
            ("Alice", true, "\"Alice\""),
            (
                "=HYPERLINK(\"http://x\",\"y\")",
                false,
                "\"'=HYPERLINK(\"\"http://x\"\",\"\"y\"\")\"",
            ),
            ("+1+1", false, "'+1+1"),
            ("-2+3", false, "'-2+3"),
            ("@SUM(A1)", false, "'@SUM(A1)"),
            ("\tx", false, "'\tx"),
            ("\rx", false, "\"'\rx\""),
            ("a,b", false, "\"a,b\""),
            ("say \"hi\"", false, "\"say \"\"hi\"\"\""),
            ("two\nlines", false, "\"two\nlines\""),
            ("a=1", false, "a=1"),
            ("", true, "\"\""),
        ] {
            assert_eq!(csv_cell(text, quote), cell, "{text:?}");
        }
        // In the export: an identity may start with '-', a name with anything.
        let mut l = Ledger::default();
        l.joined(
            1,
            "-abcdefg1",
            Some("=cmd|' /C calc'!A0"),
            ClientKind::Native,
        );
        l.joined(2, "bob-000001", Some("@x,y"), ClientKind::Native);
        let csv = to_csv(&l.contributors());
        assert!(
            csv.contains("\n'-abcdefg1,\"'=cmd|' /C calc'!A0\",native,"),
            "{csv}"
        );
        assert!(csv.contains("\nbob-000001,\"'@x,y\",native,"), "{csv}");
        for line in csv.lines().skip(1) {
            for cell in line.split(',') {
                let bare = cell.trim_start_matches('"');
                assert!(!bare.starts_with(['=', '+', '-', '@']), "{line}");
            }
        }
    }

    #[test]
    fn identities_are_checked() {
        assert!(check_identity("abcdefgh").is_ok());
        assert!(check_identity("a-b_C-9-0123").is_ok());
        for bad in ["short", "has space 1", "semi;colon1", &"x".repeat(65)] {
            assert!(check_identity(bad).is_err(), "{bad}");
        }
    }
}
