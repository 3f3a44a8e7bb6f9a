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
//!
//! # Compute seconds
//! A `Report` says how long the worker computed in its session (cumulative; the session has
//! already refused reports that are not finite, negative, rewound or too frequent:
//! `crowdgrad_core::session::check_report`). Per worker id the ledger credits only growth
//! past the most it was credited, bounded by the wall time since that worker joined plus
//! [`COMPUTE_SLACK_S`], and at most one report per [`REPORT_MIN_GAP_S`] (over all its
//! connections). So 100, 0, 100, 0, 100 credits 100 s, a report of 1e12 s credits the
//! time since the join, and no sum of reports reaches infinity.
//!
//! # Persistence
//! [`Ledger::save`] writes only finite numbers and [`Ledger::restore`] takes back anything
//! `save` wrote: a restored entry with a missing, `null` or non-finite time gets 0 and an
//! entry that is not a contribution at all is skipped (with a warning), never the ledger.

use crate::error::{Error, Result};
use crowdgrad_core::shard::Outcome;
use crowdgrad_core::wire::ClientKind;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// Most identities kept.
pub const MAX_IDENTITIES: usize = 100_000;

/// Longest identity accepted, in bytes.
pub const MAX_IDENTITY_LEN: usize = 64;

/// Seconds of compute a worker may claim beyond the wall time since it joined (clocks and
/// the time a Report takes to arrive).
pub const COMPUTE_SLACK_S: f64 = 5.0;

/// Least time between two Reports of one worker the ledger credits, seconds.
pub const REPORT_MIN_GAP_S: f64 = 0.5;

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
    #[serde(default, deserialize_with = "lenient_seconds")]
    pub compute_seconds: f64,
    /// Joins.
    pub sessions: u64,
    /// First join, Unix seconds.
    #[serde(default, deserialize_with = "lenient_seconds")]
    pub first_seen_unix: f64,
    /// Last push or join, Unix seconds.
    #[serde(default, deserialize_with = "lenient_seconds")]
    pub last_seen_unix: f64,
}

/// A time as saved: any finite non-negative number; anything else (`null`, what serde_json
/// wrote for a non-finite number before [`Ledger::save`] cleaned them) is 0.
fn lenient_seconds<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    let v = Option::<serde_json::Value>::deserialize(d)?;
    Ok(clean(v.and_then(|v| v.as_f64()).unwrap_or(0.0)))
}

/// `x` if finite and non-negative, else 0.
fn clean(x: f64) -> f64 {
    if x.is_finite() && x >= 0.0 {
        x
    } else {
        0.0
    }
}

impl Contribution {
    /// Itself with every time [`clean`].
    fn cleaned(mut self) -> Self {
        for x in [
            &mut self.compute_seconds,
            &mut self.first_seen_unix,
            &mut self.last_seen_unix,
        ] {
            *x = clean(*x);
        }
        self
    }
}

/// The ledger (no lock of its own: the registry holds it under its lock).
#[derive(Debug, Default, Clone)]
pub struct Ledger {
    by_identity: HashMap<String, Contribution>,
    /// Worker id -> its identity and reports, for the workers of this process' lifetime.
    workers: HashMap<u64, Seat>,
}

/// One worker id in the ledger.
#[derive(Debug, Clone)]
struct Seat {
    identity: String,
    /// When it joined, Unix seconds.
    joined_unix: f64,
    /// The most compute seconds it reported.
    reported: f64,
    /// The compute seconds credited to its identity for it.
    credited: f64,
    /// When a report of it was last credited, Unix seconds.
    last_unix: Option<f64>,
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
        self.joined_at(worker, identity, name, client, unix_now());
    }

    fn joined_at(
        &mut self,
        worker: u64,
        identity: &str,
        name: Option<&str>,
        client: ClientKind,
        now: f64,
    ) {
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
        }
        self.workers.insert(
            worker,
            Seat {
                identity: identity.to_string(),
                joined_unix: now,
                reported: 0.0,
                credited: 0.0,
                last_unix: None,
            },
        );
    }

    fn of(&mut self, worker: u64) -> Option<&mut Contribution> {
        let seat = self.workers.get(&worker)?;
        self.by_identity.get_mut(&seat.identity)
    }

    /// A push of `worker` had `outcome`; `samples` is `Some` on the shard that counts them.
    pub fn pushed(&mut self, worker: u64, outcome: &Outcome, samples: Option<u32>) {
        let Some(c) = self.of(worker) else { return };
        match outcome {
            Outcome::Applied { .. } | Outcome::Buffered { .. } => {
                c.pushes_accepted = c.pushes_accepted.saturating_add(1);
                c.samples = c.samples.saturating_add(u64::from(samples.unwrap_or(0)));
            }
            Outcome::Rejected { .. } => c.pushes_rejected = c.pushes_rejected.saturating_add(1),
        }
        c.last_seen_unix = unix_now();
    }

    /// `worker` reported `compute_s` seconds of computing in its session so far: its identity
    /// is credited the growth, within the bounds of the module doc ("Compute seconds").
    pub fn reported(&mut self, worker: u64, compute_s: f64) {
        self.reported_at(worker, compute_s, unix_now());
    }

    fn reported_at(&mut self, worker: u64, compute_s: f64, now: f64) {
        if !(compute_s.is_finite() && compute_s >= 0.0) {
            return;
        }
        let Some(seat) = self.workers.get_mut(&worker) else {
            return;
        };
        // (A clock stepped back does not hold the reports up.)
        if seat
            .last_unix
            .is_some_and(|t| (0.0..REPORT_MIN_GAP_S).contains(&(now - t)))
        {
            return;
        }
        seat.last_unix = Some(now);
        seat.reported = seat.reported.max(compute_s);
        let bound = (now - seat.joined_unix).max(0.0) + COMPUTE_SLACK_S;
        let total = seat.reported.min(bound);
        let delta = total - seat.credited;
        if delta <= 0.0 {
            return;
        }
        seat.credited = total;
        if let Some(c) = self.by_identity.get_mut(&seat.identity) {
            c.compute_seconds = (c.compute_seconds + delta).min(f64::MAX);
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

    /// The saved form (every number finite, so it always serializes and restores).
    pub fn save(&self) -> Saved {
        Saved {
            contributors: self
                .contributors()
                .into_iter()
                .map(Contribution::cleaned)
                .collect(),
        }
    }

    /// A ledger from its saved form (a checkpoint's `ledger` metadata; `null` is empty).
    /// Lenient per entry (module doc, "Persistence"): one bad entry costs that entry only.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for JSON that is not a saved ledger at all (not an object with
    /// a `contributors` list).
    pub fn restore(json: &serde_json::Value) -> Result<Self> {
        if json.is_null() {
            return Ok(Self::default());
        }
        let Some(entries) = json.get("contributors").and_then(|c| c.as_array()) else {
            return Err(Error::Checkpoint(
                "bad ledger: expected an object with a `contributors` list".into(),
            ));
        };
        let mut by_identity = HashMap::new();
        let mut skipped = 0usize;
        for e in entries.iter().take(MAX_IDENTITIES) {
            match serde_json::from_value::<Contribution>(e.clone()) {
                Ok(c) if check_identity(&c.identity).is_ok() => {
                    by_identity.insert(c.identity.clone(), c.cleaned());
                }
                _ => skipped += 1,
            }
        }
        if skipped > 0 {
            tracing::warn!(
                skipped,
                "ledger: entries that are not contributions were skipped"
            );
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
        let t = unix_now();
        l.reported_at(1, 2.0, t);
        l.reported_at(1, 3.5, t + 1.0);
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

    /// The defences issue: Reports rewound and replayed are not credited again, a huge one is
    /// bounded by the time since the join, they are rate-limited, and nothing reaches `inf`.
    #[test]
    fn reports_credit_growth_only_within_the_wall_time_since_the_join() {
        let mut l = Ledger::default();
        let t0 = 1.7e9;
        l.joined_at(1, "carol-0001", None, ClientKind::Browser, t0);
        let compute = |l: &Ledger| l.get("carol-0001").unwrap().compute_seconds;
        for (i, c) in [100.0, 0.0, 100.0, 0.0, 100.0].into_iter().enumerate() {
            l.reported_at(1, c, t0 + 200.0 + i as f64);
        }
        assert_eq!(compute(&l), 100.0, "100, 0, 100, 0, 100 is 100 s");
        l.reported_at(1, 1e12, t0 + 210.0);
        assert_eq!(
            compute(&l),
            210.0 + COMPUTE_SLACK_S,
            "bounded by the wall time"
        );
        // Sooner than the gap: not credited (the next report carries it).
        l.reported_at(1, 1e12, t0 + 210.1);
        assert_eq!(compute(&l), 210.0 + COMPUTE_SLACK_S);
        for (i, c) in [
            1.7e308,
            0.0,
            1.7e308,
            f64::MAX,
            f64::INFINITY,
            f64::NAN,
            -1.0,
        ]
        .into_iter()
        .enumerate()
        {
            l.reported_at(1, c, t0 + 300.0 + i as f64);
        }
        // The last finite one (f64::MAX at 303 s) is bounded too.
        assert_eq!(compute(&l), 303.0 + COMPUTE_SLACK_S);
        // Another worker id of the same identity (a rejoin) starts its own bound.
        l.joined_at(2, "carol-0001", None, ClientKind::Browser, t0 + 400.0);
        l.reported_at(2, 1.0, t0 + 401.0);
        assert_eq!(compute(&l), 304.0 + COMPUTE_SLACK_S);
        let saved = serde_json::to_string(&l.to_json()).unwrap();
        assert!(saved.contains("\"compute_seconds\":309.0"), "{saved}");
    }

    /// The defences issue: whatever the API lets into the ledger is saved and restored
    /// unchanged, through the checkpoint's JSON text.
    #[test]
    fn the_ledger_round_trips_every_value_it_accepts() {
        let mut l = Ledger::default();
        let t0 = unix_now();
        let long_id = "Z".repeat(MAX_IDENTITY_LEN);
        let names = [
            "\"quoted\", with \\ and 'apostrophes'".to_string(),
            "é 名前 🧮 \u{200b}".repeat(8),
            "=cmd|' /C calc'!A0".to_string(),
            "\u{0}\u{1f}\n\r\t".to_string(),
            String::new(),
        ];
        for (w, name) in names.iter().enumerate() {
            let id = format!("{}{w}", &long_id[..MAX_IDENTITY_LEN - 1]);
            l.joined_at(w as u64, &id, Some(name), ClientKind::Native, t0);
            for _ in 0..3 {
                l.pushed(w as u64, &applied(), Some(u32::MAX));
            }
            for (i, c) in [
                f64::MAX,
                5e-324,
                -0.0,
                1.7e308,
                f64::MIN_POSITIVE,
                0.1 + 0.2,
            ]
            .into_iter()
            .enumerate()
            {
                l.reported_at(w as u64, c, t0 + 1.0 + i as f64 * 0.7);
            }
        }
        l.joined_at(99, "-0000000", None, ClientKind::Browser, 0.0);
        let rows = l.contributors();
        assert!(rows.iter().all(|c| c.compute_seconds.is_finite()));
        let text = serde_json::to_string(&l.to_json()).unwrap();
        let back = Ledger::restore(&serde_json::from_str(&text).unwrap()).unwrap();
        assert_eq!(back.contributors(), rows);
        // A second round trip writes the same bytes.
        assert_eq!(serde_json::to_string(&back.to_json()).unwrap(), text);
    }

    /// The defences issue: a checkpoint that holds `null` (what an `inf` was saved as) or
    /// other junk in one entry restores the ledger, with 0 there and the junk entry skipped.
    #[test]
    fn a_bad_entry_costs_that_entry_not_the_ledger() {
        let good = |id: &str| {
            serde_json::json!({
                "identity": id, "name": null, "client": "native", "samples": 3,
                "pushes_accepted": 1, "pushes_rejected": 0, "compute_seconds": null,
                "sessions": 1, "first_seen_unix": 1.0, "last_seen_unix": 2.0
            })
        };
        let mut no_time = good("dave-0002");
        no_time.as_object_mut().unwrap().remove("last_seen_unix");
        let json = serde_json::json!({"contributors": [
            good("dave-0001"), no_time, {"identity": 7}, "junk", good("bad id!")
        ]});
        let l = Ledger::restore(&json).unwrap();
        assert_eq!(l.len(), 2);
        let d = l.get("dave-0001").unwrap();
        assert_eq!(
            (d.compute_seconds, d.samples, d.last_seen_unix),
            (0.0, 3, 2.0)
        );
        assert_eq!(l.get("dave-0002").unwrap().last_seen_unix, 0.0);
        for bad in [serde_json::json!(3), serde_json::json!({"contributors": 3})] {
            assert!(Ledger::restore(&bad).is_err(), "{bad}");
        }
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
