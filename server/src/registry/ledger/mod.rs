//! The contribution ledger: what every volunteer gave the run, by a stable identity that
//! survives reconnections, page reloads and server restarts.
//!
//! A worker may send an `identity` with its join (`POST /api/join`): a secret, 32 random hex
//! digits (128 bits) that the browser keeps in `localStorage` and the native worker in a
//! file of mode 0600 (`--id-file`). The server never keeps, shows or logs it: it keys
//! everything by the identity's public id ([`public_id`]), which anyone may see and nobody
//! can join as. Worker ids change with every join; the identity does not. Per identity the
//! ledger counts samples (of applied, non-zero pushes, once per step like the status),
//! accepted and rejected pushes (over all shards), compute seconds (from the worker's
//! `Report` frames, 0 for workers that send none), sessions, and first and last seen (Unix
//! seconds), and per identity per hour the samples and compute seconds credited (for the
//! recent average, [`RECENT_HOURS`]).
//!
//! # Where it lives
//! On disk, in SQLite ([`db`]): `<checkpoint dir>/ledger.sqlite`, or `serve --ledger PATH`;
//! without either a temporary file that is deleted at exit. This module is the in-memory
//! part, kept by the registry under its lock: the seats (worker id -> identity and report
//! bounds, for the workers of this process) and the [`Delta`]s recorded since the last flush.
//! Recording a push is a hash-map update; a single writer thread ([`store`]) takes the
//! deltas every [`store::FLUSH_EVERY`] (and at shutdown) and writes them in one transaction.
//! Pulls and pushes never wait for SQLite, and the leaderboard reads SQLite through its own
//! connection, never the registry's lock.
//!
//! Bounded: at most [`MAX_IDENTITIES`] rows on disk (the one least recently seen is forgotten
//! for a new one), at most [`MAX_SEATS`] seats and [`MAX_PENDING`] pending identities in
//! memory, each with at most [`MAX_PENDING_HOURS`] hour buckets.
//!
//! # Credit
//! Samples are credited for pushes the shard accepted (applied or buffered) whose gradient is
//! not all zero (`nonzero` of core's `Record::Pushed`, from the push's norm on shard 0, where
//! samples count): an all-zero push counts as accepted but earns no samples. Spot checks
//! (`--spot-check`) sample pushes after they are applied; a failed check quarantines the
//! worker (its later pushes are refused, so earn nothing) but does not take back the
//! credit of the pushes before it.
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
//! # Identities: a secret, and the public id derived from it
//! Before issue 21 the identity a worker sent was the key shown in full on the leaderboard,
//! the CSV and the status, so anyone could join as anyone: rename them, book refused pushes to
//! them, get them quarantined. Now what a worker sends is a secret and what is shown, and
//! what the ledger, the teams, the names, the credit and the quarantine are keyed by, is
//!
//! ```text
//! public_id(secret) = first 24 hex digits of SHA-256("crowdgrad identity v1" || 0x00 || secret)
//! ```
//!
//! Unkeyed on purpose: the page and a third-party worker compute their own public id without
//! asking (to find themselves on the board), and the id of a volunteer is the same on every
//! server and across restarts, with no server key to lose. A hash rather than a random id
//! the server hands out: nothing to store or send back for the client to keep. The domain
//! string (and the NUL after it) keeps this hash apart from any other hash of the same string
//! (the project hashes data and HMACs credentials), so a public id is never some other
//! value's digest. 24 hex digits (96 bits): finding a secret for a given public id costs
//! 2^96 hashes, out of anyone's reach; two honest volunteers collide with probability about
//! n^2 / 2^97 (1e-17 for a million); and the board stays readable. Secrets are still 8 to 64
//! characters of `[A-Za-z0-9_-]` on the wire ([`check_identity`]): the clients draw 128
//! random bits, and shorter ones (picked by hand with `--id`, or from old clients) are
//! accepted, as strong as they are hard to guess. A public id sent as a secret is just
//! another secret: it derives another public id.
//!
//! Ledgers written before (schema version 2) were keyed by the old identities, which were
//! public. Migration 3 re-keys every row by hashing ([`public_id`] of the old key), and
//! [`import_json`] does the same to a JSON ledger: a volunteer whose browser or id file
//! still holds its old identity keeps its credit, name and team, and its old string is no
//! longer shown anywhere. The migration cannot tell the owner from someone who copied that
//! string while it was public: such an identity is as strong as before (a volunteer who
//! wants one nobody ever saw uses "Forget me" or a new `--id-file`, and starts from zero).
//!
//! # Old checkpoints
//! Checkpoints written before the ledger moved to SQLite carry the whole ledger as JSON;
//! [`import_json`] reads it back (leniently: a restored entry with a missing, `null` or
//! non-finite time gets 0 and an entry that is not a contribution at all is skipped, with a
//! warning) and [`db::Db::import`] writes it into the database once.

pub mod db;
pub mod store;

use crate::error::{Error, Result};
use crowdgrad_core::shard::Outcome;
use crowdgrad_core::wire::ClientKind;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// Most identities kept on disk (the least recently seen is forgotten for a new one).
pub const MAX_IDENTITIES: usize = 1_000_000;

/// Most worker ids the ledger remembers in memory (the oldest is forgotten first: its later
/// pushes are not credited).
pub const MAX_SEATS: usize = 1 << 20;

/// Most identities with credit waiting for the writer; past it (the writer is failing for a
/// long time) new identities' credit is dropped and counted ([`Ledger::lost`]).
pub const MAX_PENDING: usize = 1 << 20;

/// Most hour buckets one pending identity holds (a writer stalled longer folds the older
/// hours into the oldest kept).
pub const MAX_PENDING_HOURS: usize = 48;

/// The recent average ("RAC"-like, [`Contribution::recent`]) is over this many hours: the
/// current hour and the ones before it.
pub const RECENT_HOURS: i64 = 24;

/// Hourly rows older than this many hours are deleted by the writer.
pub const HOURLY_KEEP_HOURS: i64 = 24 * 7;

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

/// The domain-separation prefix of [`public_id`] (a NUL byte follows it).
pub const PUBLIC_ID_DOMAIN: &str = "crowdgrad identity v1";

/// Hex digits in a public id (96 bits).
pub const PUBLIC_ID_LEN: usize = 24;

/// The public id of the identity `secret` (module doc, "Identities"): the first
/// [`PUBLIC_ID_LEN`] lowercase hex digits of SHA-256 over [`PUBLIC_ID_DOMAIN`], a NUL byte and
/// the secret's bytes.
pub fn public_id(secret: &str) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(PUBLIC_ID_DOMAIN.as_bytes());
    h.update([0u8]);
    h.update(secret.as_bytes());
    h.finalize()
        .iter()
        .take(PUBLIC_ID_LEN / 2)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Whether `id` has the form of a public id: [`PUBLIC_ID_LEN`] lowercase hex digits.
///
/// # Errors
/// A message saying what is expected.
pub fn check_public_id(id: &str) -> std::result::Result<(), String> {
    if id.len() == PUBLIC_ID_LEN && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        Ok(())
    } else {
        Err(format!(
            "expected a public id ({PUBLIC_ID_LEN} lowercase hex digits, as /api/contributors shows), never the secret identity"
        ))
    }
}

/// What a join says of the volunteer besides its identity (both optional, both cleaned by
/// the join handler: [`clean_label`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Who<'a> {
    /// Display name.
    pub name: Option<&'a str>,
    /// Team.
    pub team: Option<&'a str>,
}

impl<'a> Who<'a> {
    /// A display name and no team.
    pub fn named(name: &'a str) -> Self {
        Self {
            name: Some(name),
            team: None,
        }
    }
}

/// Most characters kept of a display name or a team.
pub const MAX_LABEL_CHARS: usize = 64;

/// A display name or team as the ledger keeps it: control characters removed, surrounding
/// white space trimmed, at most [`MAX_LABEL_CHARS`] characters; `None` when nothing is left.
pub fn clean_label(text: &str) -> Option<String> {
    let kept: String = text
        .chars()
        .filter(|c| !c.is_control())
        .take(MAX_LABEL_CHARS)
        .collect();
    let kept = kept.trim();
    (!kept.is_empty()).then(|| kept.to_string())
}

/// A team's line on the leaderboard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TeamRow {
    /// The team's name.
    pub team: String,
    /// Identities whose last join gave this team.
    pub members: u64,
    /// Their samples, all time.
    pub samples: u64,
}

/// What one identity contributed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Contribution {
    /// The identity.
    pub identity: String,
    /// The last display name it gave.
    pub name: Option<String>,
    /// The last team it gave.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub team: Option<String>,
    /// The kind of its last session.
    pub client: ClientKind,
    /// Examples behind its applied non-zero pushes (counted once per step). Saturates at
    /// `i64::MAX` (SQLite's integer).
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
    /// Recent average credit (like BOINC's RAC): samples credited per hour, averaged over the
    /// last [`RECENT_HOURS`] hours (the current UTC hour and the 23 before it).
    #[serde(default, deserialize_with = "lenient_seconds")]
    pub recent: f64,
}

/// A time as saved: any finite non-negative number; anything else (`null`, what serde_json
/// wrote for a non-finite number) is 0.
fn lenient_seconds<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    let v = Option::<serde_json::Value>::deserialize(d)?;
    Ok(clean(v.and_then(|v| v.as_f64()).unwrap_or(0.0)))
}

/// `x` if finite and non-negative, else 0.
pub(crate) fn clean(x: f64) -> f64 {
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
            &mut self.recent,
        ] {
            *x = clean(*x);
        }
        self
    }
}

/// The UTC hour `unix` falls in (hours since the epoch).
pub fn hour_of(unix: f64) -> i64 {
    (clean(unix) / 3600.0).floor() as i64
}

/// What one identity gained since the last flush.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Delta {
    /// The display name of its last join in the interval, if it gave one.
    pub name: Option<String>,
    /// The team of its last join in the interval, if it gave one.
    pub team: Option<String>,
    /// The kind of its last join in the interval.
    pub client: Option<ClientKind>,
    /// Samples credited.
    pub samples: u64,
    /// Pushes accepted.
    pub accepted: u64,
    /// Pushes rejected.
    pub rejected: u64,
    /// Compute seconds credited.
    pub compute_s: f64,
    /// Joins.
    pub sessions: u64,
    /// Its first event in the interval, Unix seconds (`None`: no event yet).
    pub first_seen: Option<f64>,
    /// Its last event in the interval, Unix seconds.
    pub last_seen: f64,
    /// Samples and compute seconds by UTC hour ([`hour_of`]), oldest first, at most
    /// [`MAX_PENDING_HOURS`].
    pub hours: Vec<(i64, u64, f64)>,
}

impl Delta {
    fn touch(&mut self, now: f64) {
        self.first_seen = Some(self.first_seen.map_or(now, |f| f.min(now)));
        self.last_seen = self.last_seen.max(now);
    }

    fn credit(&mut self, now: f64, samples: u64, compute_s: f64) {
        self.samples = self.samples.saturating_add(samples);
        self.compute_s = (self.compute_s + compute_s).min(f64::MAX);
        self.add_hour(hour_of(now), samples, compute_s);
    }

    fn add_hour(&mut self, hour: i64, samples: u64, compute_s: f64) {
        match self.hours.iter_mut().find(|h| h.0 == hour) {
            Some(h) => {
                h.1 = h.1.saturating_add(samples);
                h.2 = (h.2 + compute_s).min(f64::MAX);
            }
            None => {
                if self.hours.len() >= MAX_PENDING_HOURS {
                    // Fold the oldest two together (a stalled writer; bounded memory).
                    let (_, s, c) = self.hours.remove(0);
                    self.hours[0].1 = self.hours[0].1.saturating_add(s);
                    self.hours[0].2 = (self.hours[0].2 + c).min(f64::MAX);
                }
                self.hours.push((hour, samples, compute_s));
                self.hours.sort_by_key(|h| h.0);
            }
        }
    }

    /// `other` (later) added into `self` (earlier).
    fn merge(&mut self, other: Delta) {
        if other.name.is_some() {
            self.name = other.name;
        }
        if other.team.is_some() {
            self.team = other.team;
        }
        if other.client.is_some() {
            self.client = other.client;
        }
        self.accepted = self.accepted.saturating_add(other.accepted);
        self.rejected = self.rejected.saturating_add(other.rejected);
        self.sessions = self.sessions.saturating_add(other.sessions);
        if let Some(f) = other.first_seen {
            self.touch(f);
        }
        self.touch(other.last_seen);
        for (h, s, c) in other.hours {
            self.add_hour(h, s, c);
        }
        self.samples = self.samples.saturating_add(other.samples);
        self.compute_s = (self.compute_s + other.compute_s).min(f64::MAX);
    }
}

/// Deltas taken by the writer: one transaction's worth.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Batch {
    /// By identity.
    pub deltas: HashMap<String, Delta>,
}

impl Batch {
    /// True when there is nothing to write.
    pub fn is_empty(&self) -> bool {
        self.deltas.is_empty()
    }
}

/// The in-memory part of the ledger (no lock of its own: the registry holds it under its
/// lock; module doc).
#[derive(Debug, Default, Clone)]
pub struct Ledger {
    /// Worker id -> its identity and reports, for the workers of this process' lifetime (ids
    /// grow, so the first is the oldest).
    seats: BTreeMap<u64, Seat>,
    /// Credit not yet written.
    pending: Batch,
    /// Events dropped because [`MAX_PENDING`] identities were waiting.
    lost: u64,
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

/// Now, Unix seconds.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Ledger {
    /// Worker `worker` joined as `identity`: the public id the join handler derived from the
    /// secret it was sent ([`public_id`]), never the secret.
    pub fn joined(&mut self, worker: u64, identity: &str, who: Who<'_>, client: ClientKind) {
        self.joined_at(worker, identity, who, client, unix_now());
    }

    /// [`Ledger::joined`] at `now` (Unix seconds).
    pub fn joined_at(
        &mut self,
        worker: u64,
        identity: &str,
        who: Who<'_>,
        client: ClientKind,
        now: f64,
    ) {
        if let Some(d) = self.delta(identity) {
            d.sessions = d.sessions.saturating_add(1);
            d.client = Some(client);
            if let Some(n) = who.name {
                d.name = Some(n.to_string());
            }
            if let Some(t) = who.team {
                d.team = Some(t.to_string());
            }
            d.touch(now);
        }
        if self.seats.len() >= MAX_SEATS {
            self.seats.pop_first();
        }
        self.seats.insert(
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

    /// The pending delta of `identity`, made if there is room.
    fn delta(&mut self, identity: &str) -> Option<&mut Delta> {
        if !self.pending.deltas.contains_key(identity) {
            if self.pending.deltas.len() >= MAX_PENDING {
                self.lost += 1;
                return None;
            }
            self.pending
                .deltas
                .insert(identity.to_string(), Delta::default());
        }
        self.pending.deltas.get_mut(identity)
    }

    /// A push of `worker` had `outcome`; `samples` is `Some` on the shard that counts them;
    /// `nonzero` says whether its gradient moved anything (an all-zero push earns no samples).
    pub fn pushed(&mut self, worker: u64, outcome: &Outcome, samples: Option<u32>, nonzero: bool) {
        self.pushed_at(worker, outcome, samples, nonzero, unix_now());
    }

    /// [`Ledger::pushed`] at `now` (Unix seconds).
    pub fn pushed_at(
        &mut self,
        worker: u64,
        outcome: &Outcome,
        samples: Option<u32>,
        nonzero: bool,
        now: f64,
    ) {
        let Some(identity) = self.seats.get(&worker).map(|s| s.identity.clone()) else {
            return;
        };
        let Some(d) = self.delta(&identity) else {
            return;
        };
        match outcome {
            Outcome::Applied { .. } | Outcome::Buffered { .. } => {
                d.accepted = d.accepted.saturating_add(1);
                let credited = if nonzero { samples.unwrap_or(0) } else { 0 };
                if credited > 0 {
                    d.credit(now, u64::from(credited), 0.0);
                }
            }
            Outcome::Rejected { .. } => d.rejected = d.rejected.saturating_add(1),
        }
        d.touch(now);
    }

    /// `worker` was forgotten by the registry: its seat goes (its identity's credit stays).
    pub fn left(&mut self, worker: u64) {
        self.seats.remove(&worker);
    }

    /// A shard process reported `accepted` and `rejected` pushes of `worker`, `credited` of
    /// whose samples count ([`crate::registry::feed`]): credited as [`Ledger::pushed`] credits
    /// them one by one.
    pub fn tallied(&mut self, worker: u64, accepted: u64, rejected: u64, credited: u64) {
        let now = unix_now();
        let Some(identity) = self.seats.get(&worker).map(|s| s.identity.clone()) else {
            return;
        };
        let Some(d) = self.delta(&identity) else {
            return;
        };
        d.accepted = d.accepted.saturating_add(accepted);
        d.rejected = d.rejected.saturating_add(rejected);
        if credited > 0 {
            d.credit(now, credited, 0.0);
        }
        d.touch(now);
    }

    /// `worker` reported `compute_s` seconds of computing in its session so far: its identity
    /// is credited the growth, within the bounds of the module doc ("Compute seconds").
    pub fn reported(&mut self, worker: u64, compute_s: f64) {
        self.reported_at(worker, compute_s, unix_now());
    }

    /// [`Ledger::reported`] at `now` (Unix seconds).
    pub fn reported_at(&mut self, worker: u64, compute_s: f64, now: f64) {
        if !(compute_s.is_finite() && compute_s >= 0.0) {
            return;
        }
        let Some(seat) = self.seats.get_mut(&worker) else {
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
        let identity = seat.identity.clone();
        if let Some(d) = self.delta(&identity) {
            d.credit(now, 0, delta);
        }
    }

    /// The credit recorded since the last call, for the writer (leaves none pending).
    pub fn take(&mut self) -> Batch {
        std::mem::take(&mut self.pending)
    }

    /// Puts back a batch the writer could not write, before anything recorded since.
    pub fn give_back(&mut self, batch: Batch) {
        let newer = std::mem::replace(&mut self.pending, batch);
        for (identity, d) in newer.deltas {
            match self.pending.deltas.get_mut(&identity) {
                Some(old) => old.merge(d),
                None => {
                    self.pending.deltas.insert(identity, d);
                }
            }
        }
        while self.pending.deltas.len() > MAX_PENDING {
            let Some(k) = self.pending.deltas.keys().next().cloned() else {
                break;
            };
            self.pending.deltas.remove(&k);
            self.lost += 1;
        }
    }

    /// Identities with credit pending.
    pub fn pending(&self) -> usize {
        self.pending.deltas.len()
    }

    /// Worker ids remembered.
    pub fn seats(&self) -> usize {
        self.seats.len()
    }

    /// Events dropped because too many identities were pending (the writer failing).
    pub fn lost(&self) -> u64 {
        self.lost
    }
}

/// The contributions in a checkpoint written before the ledger moved to SQLite (its `ledger`
/// metadata: `{"contributors": [...]}`; `null` is none). Lenient per entry (module doc, "Old
/// checkpoints"): one bad entry costs that entry only.
///
/// # Errors
/// [`Error::Checkpoint`] for JSON that is not a saved ledger at all (not an object with
/// a `contributors` list).
pub fn import_json(json: &serde_json::Value) -> Result<Vec<Contribution>> {
    if json.is_null() {
        return Ok(Vec::new());
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
            Ok(mut c) if check_identity(&c.identity).is_ok() => {
                // Keyed by the old (public) identity: re-keyed by hashing, as migration 3
                // does (module doc, "Identities").
                c.identity = public_id(&c.identity);
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
    let mut v: Vec<Contribution> = by_identity.into_values().collect();
    v.sort_by(|a, b| {
        b.samples
            .cmp(&a.samples)
            .then_with(|| a.identity.cmp(&b.identity))
    });
    Ok(v)
}

/// The header line of the CSV export (`GET /api/contributors?format=csv`).
pub const CSV_HEADER: &str = "identity,name,client,samples,pushes_accepted,pushes_rejected,compute_seconds,sessions,first_seen_unix,last_seen_unix,team\n";

/// The ledger as CSV: [`CSV_HEADER`], then one line per identity ([`csv_row`]) in the order
/// given (the export is most samples first). Text cells go through [`csv_cell`] (names are
/// always quoted), so a spreadsheet opening the export never evaluates a name as a formula.
pub fn to_csv(rows: &[Contribution]) -> String {
    let mut out = String::from(CSV_HEADER);
    for c in rows {
        csv_row(c, &mut out);
    }
    out
}

/// One identity's line of the CSV export, appended to `out`.
pub fn csv_row(c: &Contribution, out: &mut String) {
    let client = match c.client {
        ClientKind::Native => "native",
        ClientKind::Browser => "browser",
    };
    out.push_str(&format!(
        "{},{},{},{},{},{},{:.3},{},{:.3},{:.3},{}\n",
        csv_cell(&c.identity, false),
        csv_cell(c.name.as_deref().unwrap_or(""), true),
        client,
        c.samples,
        c.pushes_accepted,
        c.pushes_rejected,
        c.compute_seconds,
        c.sessions,
        c.first_seen_unix,
        c.last_seen_unix,
        csv_cell(c.team.as_deref().unwrap_or(""), true),
    ));
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
    /// The teams with the most samples (at most [`BOARD_TEAMS`]), most first.
    pub teams: Vec<TeamRow>,
}

/// Teams on the leaderboard ([`Board::teams`]).
pub const BOARD_TEAMS: usize = 10;

#[cfg(test)]
pub(crate) mod tests {
    use super::db::Db;
    use super::*;
    use crowdgrad_core::wire::ErrorCode;
    use std::path::PathBuf;

    /// An applied push's outcome (the registry's tests share it).
    pub(crate) fn applied() -> Outcome {
        Outcome::Applied {
            version: 1,
            staleness: 0,
            lr_scale: 1.0,
            merged: 1,
        }
    }

    /// A fresh path in a directory of its own.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "crowdgrad-ledger-test-{name}-{}-{}",
            std::process::id(),
            unix_now().to_bits()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("ledger.sqlite")
    }

    fn flush(l: &mut Ledger, db: &mut Db) {
        db.apply(&l.take(), unix_now()).unwrap();
    }

    fn all(db: &Db) -> Vec<Contribution> {
        db.top(MAX_IDENTITIES, unix_now()).unwrap()
    }

    #[test]
    fn identities_accumulate_across_sessions_and_restarts() {
        let path = scratch("accumulate");
        let mut db = Db::open(&path).unwrap();
        let mut l = Ledger::default();
        l.joined(1, "alice-0001", Who::named("Alice"), ClientKind::Browser);
        l.pushed(1, &applied(), Some(32), true);
        l.pushed(1, &applied(), None, true);
        l.pushed(
            1,
            &Outcome::Rejected {
                code: ErrorCode::TooStale,
                message: "old".into(),
            },
            Some(32),
            true,
        );
        let t = unix_now();
        l.reported_at(1, 2.0, t);
        l.reported_at(1, 3.5, t + 1.0);
        flush(&mut l, &mut db);
        // A new session of the same identity (worker ids change), in a restarted server.
        drop(db);
        let mut db = Db::open(&path).unwrap();
        let mut l = Ledger::default();
        l.joined(7, "alice-0001", Who::default(), ClientKind::Browser);
        l.pushed(7, &applied(), Some(32), true);
        l.reported(7, 1.0);
        l.joined(8, "bob-000001", Who::default(), ClientKind::Native);
        l.pushed(99, &applied(), Some(32), true); // unknown worker: ignored
                                                  // An all-zero push is accepted but earns no samples (issue 21).
        l.pushed(8, &applied(), Some(32), false);
        flush(&mut l, &mut db);
        assert_eq!(db.seq().unwrap(), 2);
        let a = db.get("alice-0001", unix_now()).unwrap().unwrap();
        assert_eq!(
            (a.samples, a.pushes_accepted, a.pushes_rejected, a.sessions),
            (64, 3, 1, 2)
        );
        assert_eq!(a.compute_seconds, 4.5);
        assert_eq!(a.name.as_deref(), Some("Alice"));
        assert_eq!(a.recent, 64.0 / RECENT_HOURS as f64);
        let b = db.get("bob-000001", unix_now()).unwrap().unwrap();
        assert_eq!((b.samples, b.pushes_accepted), (0, 1));
        let board = db.board(1, Some("bob-000001"), unix_now()).unwrap();
        assert_eq!(
            (
                board.total,
                board.samples,
                board.contributors.len(),
                board.your_rank
            ),
            (2, 64, 1, Some(2))
        );
        assert_eq!(board.contributors[0].identity, "alice-0001");
        let csv = db.csv().unwrap();
        assert!(csv.starts_with("identity,name,"));
        assert!(
            csv.contains("alice-0001,\"Alice\",browser,64,3,1,4.500,2,"),
            "{csv}"
        );
        db.verify().unwrap();
    }

    /// The defences issue: Reports rewound and replayed are not credited again, a huge one is
    /// bounded by the time since the join, they are rate-limited, and nothing reaches `inf`.
    #[test]
    fn reports_credit_growth_only_within_the_wall_time_since_the_join() {
        let mut db = Db::open(&scratch("reports")).unwrap();
        let mut l = Ledger::default();
        let t0 = 1.7e9;
        l.joined_at(1, "carol-0001", Who::default(), ClientKind::Browser, t0);
        let mut compute = |l: &mut Ledger| {
            flush(l, &mut db);
            db.get("carol-0001", t0).unwrap().unwrap().compute_seconds
        };
        for (i, c) in [100.0, 0.0, 100.0, 0.0, 100.0].into_iter().enumerate() {
            l.reported_at(1, c, t0 + 200.0 + i as f64);
        }
        assert_eq!(compute(&mut l), 100.0, "100, 0, 100, 0, 100 is 100 s");
        l.reported_at(1, 1e12, t0 + 210.0);
        assert_eq!(
            compute(&mut l),
            210.0 + COMPUTE_SLACK_S,
            "bounded by the wall time"
        );
        // Sooner than the gap: not credited (the next report carries it).
        l.reported_at(1, 1e12, t0 + 210.1);
        assert_eq!(compute(&mut l), 210.0 + COMPUTE_SLACK_S);
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
        assert_eq!(compute(&mut l), 303.0 + COMPUTE_SLACK_S);
        // Another worker id of the same identity (a rejoin) starts its own bound.
        l.joined_at(
            2,
            "carol-0001",
            Who::default(),
            ClientKind::Browser,
            t0 + 400.0,
        );
        l.reported_at(2, 1.0, t0 + 401.0);
        assert_eq!(compute(&mut l), 304.0 + COMPUTE_SLACK_S);
    }

    /// Issue 21 and the defences issue: whatever the API lets into the ledger (extreme
    /// f64s, long and unicode names, 0 and the largest counts) is written and read back
    /// unchanged after a restart (the database reopened).
    #[test]
    fn the_ledger_restores_every_value_it_accepts_after_a_restart() {
        let path = scratch("values");
        let mut db = Db::open(&path).unwrap();
        let mut l = Ledger::default();
        let t0 = unix_now();
        let long_id = "Z".repeat(MAX_IDENTITY_LEN);
        let names = [
            "\"quoted\", with \\ and 'apostrophes'".to_string(),
            "é 名前 🧮 \u{200b}".repeat(8).chars().take(64).collect(),
            "=cmd|' /C calc'!A0".to_string(),
            "\u{0}\u{1f}\n\r\t".to_string(),
            String::new(),
            "x".repeat(64),
        ];
        for (w, name) in names.iter().enumerate() {
            let id = format!("{}{w}", &long_id[..MAX_IDENTITY_LEN - 1]);
            l.joined_at(w as u64, &id, Who::named(name), ClientKind::Native, t0);
            for _ in 0..3 {
                l.pushed_at(w as u64, &applied(), Some(u32::MAX), true, t0);
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
        // A first seen at 0, an identity starting with '-', and a row with no pushes.
        l.joined_at(99, "-0000000", Who::default(), ClientKind::Browser, 0.0);
        flush(&mut l, &mut db);
        // Counts at the top: u64::MAX saturates at i64::MAX (SQLite's integer), and more
        // credit on top of it stays there.
        let mut big = Batch::default();
        big.deltas.insert(
            "maxed-counts-1".into(),
            Delta {
                name: Some("max".into()),
                team: Some("max team".into()),
                client: Some(ClientKind::Browser),
                samples: u64::MAX,
                accepted: u64::MAX,
                rejected: u64::MAX,
                compute_s: f64::MAX,
                sessions: u64::MAX,
                first_seen: Some(5e-324),
                last_seen: f64::MAX,
                hours: vec![(hour_of(t0), u64::MAX, f64::MAX)],
            },
        );
        db.apply(&big, t0).unwrap();
        db.apply(&big, t0).unwrap();
        let rows = all(&db);
        assert!(rows.iter().all(|c| c.compute_seconds.is_finite()));
        let m = rows
            .iter()
            .find(|c| c.identity == "maxed-counts-1")
            .unwrap();
        let top = i64::MAX as u64;
        assert_eq!(
            (m.samples, m.pushes_accepted, m.pushes_rejected, m.sessions),
            (top, top, top, top)
        );
        assert_eq!((m.compute_seconds, m.last_seen_unix), (f64::MAX, f64::MAX));
        assert_eq!(m.first_seen_unix, 5e-324);
        let z = rows.iter().find(|c| c.identity == "-0000000").unwrap();
        assert_eq!((z.samples, z.first_seen_unix, z.sessions), (0, 0.0, 1));
        for (w, name) in names.iter().enumerate() {
            let id = format!("{}{w}", &long_id[..MAX_IDENTITY_LEN - 1]);
            let c = rows.iter().find(|c| c.identity == id).unwrap();
            assert_eq!(c.name.as_deref(), Some(name.as_str()));
            assert_eq!(c.samples, 3 * u64::from(u32::MAX));
        }
        let csv = db.csv().unwrap();
        drop(db);
        let db = Db::open(&path).unwrap();
        assert_eq!(all(&db), rows, "the same after a restart");
        assert_eq!(db.csv().unwrap(), csv);
        db.verify().unwrap();
    }

    /// The defences issue: an old checkpoint's JSON ledger that holds `null` (what an `inf`
    /// was saved as) or other junk in one entry imports, with 0 there and the junk skipped;
    /// it is imported once, and identities the file has keep their rows.
    #[test]
    fn an_old_checkpoints_json_ledger_is_imported_once() {
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
            good("dave-0001"), no_time, {"identity": 7}, "junk", good("bad id!"), good("erin-0001")
        ]});
        let rows = import_json(&json).unwrap();
        assert_eq!(rows.len(), 3);
        for bad in [serde_json::json!(3), serde_json::json!({"contributors": 3})] {
            assert!(import_json(&bad).is_err(), "{bad}");
        }
        assert!(import_json(&serde_json::Value::Null).unwrap().is_empty());
        let mut db = Db::open(&scratch("import")).unwrap();
        // erin is in the file already, with more than the checkpoint has: she keeps it.
        // The imported rows are keyed by public id (issue 21), as the joins are.
        let erin = public_id("erin-0001");
        let mut l = Ledger::default();
        l.joined(1, &erin, Who::default(), ClientKind::Browser);
        l.pushed(1, &applied(), Some(50), true);
        flush(&mut l, &mut db);
        assert_eq!(db.import("run/ckpt-1", &rows).unwrap(), Some(2));
        assert_eq!(db.import("run/ckpt-1", &rows).unwrap(), None, "once");
        assert!(db.get("dave-0001", unix_now()).unwrap().is_none());
        let d = db
            .get(&public_id("dave-0001"), unix_now())
            .unwrap()
            .unwrap();
        assert_eq!(
            (d.compute_seconds, d.samples, d.last_seen_unix),
            (0.0, 3, 2.0)
        );
        assert_eq!(
            db.get(&public_id("dave-0002"), unix_now())
                .unwrap()
                .unwrap()
                .last_seen_unix,
            0.0
        );
        assert_eq!(db.get(&erin, unix_now()).unwrap().unwrap().samples, 50);
        assert_eq!(db.totals().unwrap(), (3, 56));
        db.verify().unwrap();
    }

    /// A corrupt file, a foreign SQLite database (no schema, another schema, another
    /// application id) and a ledger from a newer crowdgrad are refused with the path in the
    /// error, and left byte for byte as they were.
    #[test]
    fn corrupt_and_foreign_files_are_refused_untouched() {
        let dir = scratch("refuse");
        let dir = dir.parent().unwrap();
        type Make = Box<dyn Fn(&std::path::Path)>;
        let cases: Vec<(&str, Make, &str)> = vec![
            (
                "garbage.sqlite",
                Box::new(|p| std::fs::write(p, vec![0x5a; 8192]).unwrap()),
                "not a SQLite database",
            ),
            (
                "empty-schema.sqlite",
                Box::new(|p| {
                    let c = rusqlite::Connection::open(p).unwrap();
                    c.execute_batch("PRAGMA user_version = 0; VACUUM;").unwrap();
                }),
                "not a crowdgrad ledger",
            ),
            (
                "other.sqlite",
                Box::new(|p| {
                    let c = rusqlite::Connection::open(p).unwrap();
                    c.execute_batch("CREATE TABLE t (x); INSERT INTO t VALUES (1);")
                        .unwrap();
                }),
                "not a crowdgrad ledger",
            ),
            (
                "newer.sqlite",
                Box::new(|p| {
                    drop(Db::open(p).unwrap());
                    let c = rusqlite::Connection::open(p).unwrap();
                    c.execute_batch("PRAGMA user_version = 99;").unwrap();
                }),
                "newer than this crowdgrad",
            ),
            (
                "corrupt.sqlite",
                Box::new(|p| {
                    let mut db = Db::open(p).unwrap();
                    let mut l = Ledger::default();
                    for i in 0..2000u64 {
                        l.joined(
                            i,
                            &format!("corrupt-{i:06}"),
                            Who::named("n"),
                            ClientKind::Native,
                        );
                    }
                    flush(&mut l, &mut db);
                    drop(db);
                    // Checkpoint the WAL into the file, then scribble over its pages.
                    let c = rusqlite::Connection::open(p).unwrap();
                    c.execute_batch("PRAGMA wal_checkpoint(TRUNCATE); PRAGMA journal_mode=DELETE;")
                        .unwrap();
                    drop(c);
                    let mut bytes = std::fs::read(p).unwrap();
                    for b in &mut bytes[4096 * 2..4096 * 6] {
                        *b = 0xa5;
                    }
                    std::fs::write(p, bytes).unwrap();
                }),
                "",
            ),
        ];
        for (name, make, says) in cases {
            let p = dir.join(name);
            make(&p);
            let before = std::fs::read(&p).unwrap();
            let err = Db::open(&p).expect_err(name).to_string();
            assert!(err.contains(&p.display().to_string()), "{name}: {err}");
            assert!(err.contains(says), "{name}: {err}");
            assert!(err.contains("untouched"), "{name}: {err}");
            assert_eq!(std::fs::read(&p).unwrap(), before, "{name} was changed");
            assert!(!dir.join(format!("{name}-wal")).exists() || name == "newer.sqlite");
        }
        // An empty file is a new ledger.
        let p = dir.join("zero.sqlite");
        std::fs::write(&p, b"").unwrap();
        Db::open(&p).unwrap().verify().unwrap();
    }

    /// The queries the leaderboard makes answer as a sort of every identity would, over
    /// 20,000 identities with ties (their speed is `crowdgrad bench ledger`'s).
    #[test]
    fn top_k_and_rank_match_a_full_sort_over_20000_identities() {
        let mut db = Db::open(&scratch("rank")).unwrap();
        let mut rng = crowdgrad_core::rng::Rng::new(7);
        let mut batch = Batch::default();
        let n = 20_000u64;
        for i in 0..n {
            // Heavy-tailed, with many ties (zeros and small values) and a few huge ones.
            let u = rng.next_f64();
            let samples = match i % 10 {
                0 => 0,
                1 => 5,
                _ => (1.0 / (1.0 - u * 0.999_999)).powf(2.5) as u64,
            } + if i % 997 == 0 { 1 << 40 } else { 0 };
            batch.deltas.insert(
                format!("ident-{i:08}"),
                Delta {
                    client: Some(ClientKind::Native),
                    samples,
                    last_seen: 1.0 + i as f64,
                    ..Delta::default()
                },
            );
            if batch.deltas.len() == 3000 {
                db.apply(&std::mem::take(&mut batch), unix_now()).unwrap();
            }
        }
        db.apply(&batch, unix_now()).unwrap();
        // Some move between buckets.
        let mut more = Batch::default();
        for i in (0..n).step_by(13) {
            more.deltas.insert(
                format!("ident-{i:08}"),
                Delta {
                    samples: 1 + i * 3,
                    last_seen: 1e9,
                    ..Delta::default()
                },
            );
        }
        db.apply(&more, unix_now()).unwrap();
        db.verify().unwrap();
        let mut sorted = all(&db);
        assert_eq!(sorted.len(), n as usize);
        sorted.sort_by(|a, b| b.samples.cmp(&a.samples).then(a.identity.cmp(&b.identity)));
        assert_eq!(db.top(10, unix_now()).unwrap(), sorted[..10].to_vec());
        for (r, c) in sorted.iter().enumerate().step_by(37) {
            assert_eq!(db.rank(&c.identity).unwrap(), Some(r as u64 + 1), "{c:?}");
        }
        let last = sorted.last().unwrap();
        assert_eq!(db.rank(&last.identity).unwrap(), Some(n));
        assert_eq!(db.rank("nobody-000").unwrap(), None);
        let total: u64 = sorted.iter().map(|c| c.samples).sum();
        assert_eq!(db.totals().unwrap(), (n, total));
        // Past the bound the least recently seen go.
        let mut fresh = Batch::default();
        fresh.deltas.insert(
            "newcomer-01".into(),
            Delta {
                sessions: 1,
                last_seen: 2e9,
                ..Delta::default()
            },
        );
        db.apply_limited(&fresh, unix_now(), n as usize).unwrap();
        assert!(
            db.get("ident-00000001", 0.0).unwrap().is_none(),
            "oldest gone"
        );
        assert!(db.get("newcomer-01", 0.0).unwrap().is_some());
        assert_eq!(db.totals().unwrap().0, n);
        db.verify().unwrap();
    }

    #[test]
    fn buckets_cover_every_value_in_order() {
        let mut prev = 0;
        for s in (0..5000i64).chain([1 << 20, (1 << 40) + 7, i64::MAX - 1, i64::MAX]) {
            let b = db::bucket(s);
            assert!(b >= prev && b < db::BUCKETS, "{s}: {b}");
            prev = b;
        }
        assert_eq!(db::bucket(i64::MAX), db::BUCKETS - 1);
    }

    /// Teams add up their members' samples; a member who names another team moves with its
    /// samples, one who names none stays, and an evicted member leaves its team.
    #[test]
    fn teams_add_up_their_members_and_follow_moves_and_evictions() {
        let mut db = Db::open(&scratch("teams")).unwrap();
        let mut l = Ledger::default();
        let t0 = unix_now();
        let team = |name: &'static str, team: &'static str| Who {
            name: Some(name),
            team: Some(team),
        };
        l.joined_at(1, "team-a-0001", team("a1", "Red"), ClientKind::Native, t0);
        l.joined_at(2, "team-a-0002", team("a2", "Red"), ClientKind::Browser, t0);
        l.joined_at(3, "team-b-0001", team("b1", "Blue"), ClientKind::Native, t0);
        l.joined_at(4, "loner-00001", Who::default(), ClientKind::Native, t0);
        for (w, n) in [(1, 100), (2, 50), (3, 120), (4, 500)] {
            l.pushed_at(w, &applied(), Some(n), true, t0 + 1.0);
        }
        flush(&mut l, &mut db);
        let rows = |db: &Db| -> Vec<(String, u64, u64)> {
            db.teams(10)
                .unwrap()
                .into_iter()
                .map(|t| (t.team, t.members, t.samples))
                .collect()
        };
        assert_eq!(rows(&db), [("Red".into(), 2, 150), ("Blue".into(), 1, 120)]);
        db.verify().unwrap();
        // a2 joins again without a team (stays Red) and earns more; a1 moves to Blue.
        l.joined_at(
            5,
            "team-a-0002",
            Who::named("a2"),
            ClientKind::Browser,
            t0 + 2.0,
        );
        l.pushed_at(5, &applied(), Some(10), true, t0 + 2.0);
        l.joined_at(
            6,
            "team-a-0001",
            team("a1", "Blue"),
            ClientKind::Native,
            t0 + 3.0,
        );
        flush(&mut l, &mut db);
        assert_eq!(rows(&db), [("Blue".into(), 2, 220), ("Red".into(), 1, 60)]);
        let a1 = db.get("team-a-0001", t0).unwrap().unwrap();
        assert_eq!(a1.team.as_deref(), Some("Blue"));
        db.verify().unwrap();
        // The board carries the teams; the CSV names each member's.
        let board = db.board(10, None, t0).unwrap();
        assert_eq!(board.teams.len(), 2);
        let csv = db.csv().unwrap();
        let line = csv.lines().find(|l| l.starts_with("team-a-0002,")).unwrap();
        assert!(
            line.starts_with("team-a-0002,\"a2\",browser,") && line.ends_with(",\"Red\""),
            "{line}"
        );
        // Bounded at 3 identities: the least recently seen (b1 and the loner, at t0 + 1)
        // go, and Blue keeps only a1.
        let mut fresh = Ledger::default();
        fresh.joined_at(
            7,
            "team-a-0002",
            Who::default(),
            ClientKind::Browser,
            t0 + 9.0,
        );
        fresh.joined_at(
            8,
            "newcomer-01",
            team("n", "Green"),
            ClientKind::Native,
            t0 + 9.0,
        );
        db.apply_limited(&fresh.take(), t0 + 9.0, 3).unwrap();
        assert_eq!(
            rows(&db),
            [
                ("Blue".into(), 1, 100),
                ("Red".into(), 1, 60),
                ("Green".into(), 1, 0)
            ]
        );
        db.verify().unwrap();
    }

    /// A ledger file made before teams existed (schema version 1) opens, migrates in place
    /// and keeps its rows; its identities have no team until they give one.
    #[test]
    fn a_version_1_ledger_migrates_and_keeps_its_rows() {
        let path = scratch("v1");
        {
            let c = rusqlite::Connection::open(&path).unwrap();
            c.execute_batch(db::MIGRATIONS[0]).unwrap();
            c.execute_batch(&format!(
                "PRAGMA application_id = {}; PRAGMA user_version = 1;
                 INSERT INTO contributors VALUES ('old-timer-1', 'Old', 'native', 42, 3, 0, 1.5, 2, 1e9, 1e9);
                 INSERT INTO buckets VALUES (42, 1);
                 UPDATE meta SET value = 1 WHERE key = 'identities';
                 UPDATE meta SET value = 42 WHERE key = 'samples';",
                db::APPLICATION_ID
            ))
            .unwrap();
        }
        let mut db = Db::open(&path).unwrap();
        db.verify().unwrap();
        // Re-keyed by public id (version 3).
        assert!(db.get("old-timer-1", unix_now()).unwrap().is_none());
        let pid = public_id("old-timer-1");
        let old = db.get(&pid, unix_now()).unwrap().unwrap();
        assert_eq!(
            (old.samples, old.name.as_deref(), old.team),
            (42, Some("Old"), None)
        );
        let mut l = Ledger::default();
        let who = Who {
            name: None,
            team: Some("Veterans"),
        };
        l.joined(1, &pid, who, ClientKind::Native);
        l.pushed(1, &applied(), Some(8), true);
        flush(&mut l, &mut db);
        assert_eq!(db.teams(10).unwrap()[0].samples, 50);
        db.verify().unwrap();
        let version: i64 = rusqlite::Connection::open(&path)
            .unwrap()
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, db::MIGRATIONS.len() as i64);
    }

    /// The worked example of docs/protocol.md ("Join"), checked against `sha256sum`:
    /// `printf 'crowdgrad identity v1\0%s' 00112233445566778899aabbccddeeff | sha256sum`
    /// gives c333c4041a3ce077d01777b3a6f51dba46a4ac1e34acdf758f6604274b42036d.
    #[test]
    fn the_public_id_is_the_documented_hash_prefix() {
        let p = public_id("00112233445566778899aabbccddeeff");
        assert_eq!(p, "c333c4041a3ce077d01777b3");
        assert!(check_public_id(&p).is_ok());
        // A public id is a secret like any other: it derives another public id.
        assert_ne!(public_id(&p), p);
        assert!(check_public_id(&public_id(&p)).is_ok());
        for bad in [
            "00112233445566778899aabbccddeeff",
            "C333C4041A3CE077D01777B3",
            "c333c4041a3ce077d01777b",
            "c333c4041a3ce077d01777bg",
            "",
        ] {
            assert!(check_public_id(bad).is_err(), "{bad}");
        }
    }

    /// Issue 21: a ledger of schema version 2 (keyed by identities that were public) migrates
    /// to version 3 keyed by their public ids, with its samples, hours, names and teams, even
    /// when one old key is another's public id (an attacker's row made to collide).
    #[test]
    fn a_version_2_ledger_is_rekeyed_by_public_id() {
        let path = scratch("v2");
        let victim = "victim-identity-0001";
        let squatter = public_id(victim);
        {
            let mut db = Db::open(&path).unwrap();
            // Back to version 2: as written before issue 21, by old identities.
            let c = rusqlite::Connection::open(&path).unwrap();
            c.execute_batch("PRAGMA user_version = 2;").unwrap();
            drop(c);
            let mut l = Ledger::default();
            let t0 = 1e9;
            let team = Who {
                name: Some("Victim"),
                team: Some("Blue"),
            };
            l.joined_at(1, victim, team, ClientKind::Browser, t0);
            l.pushed_at(1, &applied(), Some(70), true, t0);
            l.joined_at(2, &squatter, Who::named("Squatter"), ClientKind::Native, t0);
            l.pushed_at(2, &applied(), Some(5), true, t0);
            db.apply(&l.take(), t0).unwrap();
            drop(db);
            let c = rusqlite::Connection::open(&path).unwrap();
            c.execute_batch("PRAGMA user_version = 2;").unwrap();
        }
        let db = Db::open(&path).unwrap();
        db.verify().unwrap();
        let now = 1e9 + 60.0;
        let v = db.get(&public_id(victim), now).unwrap().unwrap();
        assert_eq!((v.samples, v.name.as_deref()), (70, Some("Victim")));
        assert_eq!(v.team.as_deref(), Some("Blue"));
        assert!(v.recent > 0.0, "its hourly rows moved with it: {v:?}");
        let s = db.get(&public_id(&squatter), now).unwrap().unwrap();
        assert_eq!((s.samples, s.name.as_deref()), (5, Some("Squatter")));
        assert!(db.get(victim, now).unwrap().is_none());
        for c in all(&db) {
            assert!(check_public_id(&c.identity).is_ok(), "{c:?}");
        }
        assert_eq!(db.totals().unwrap(), (2, 75));
        assert_eq!(db.teams(10).unwrap()[0].samples, 70);
        let version: i64 = rusqlite::Connection::open(&path)
            .unwrap()
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, 3);
    }

    #[test]
    fn labels_are_cleaned() {
        assert_eq!(
            clean_label("  Team\u{7} Rocket \n"),
            Some("Team Rocket".into())
        );
        assert_eq!(clean_label(" \t "), None);
        assert_eq!(clean_label(&"é".repeat(100)).unwrap().chars().count(), 64);
    }

    /// The in-memory part stays bounded while the writer cannot write: a batch given back
    /// merges with what came after it.
    #[test]
    fn a_batch_given_back_merges_with_newer_credit() {
        let mut l = Ledger::default();
        l.joined_at(1, "frank-0001", Who::named("F"), ClientKind::Native, 1e9);
        l.pushed_at(1, &applied(), Some(10), true, 1e9);
        let first = l.take();
        l.pushed_at(1, &applied(), Some(5), true, 1e9 + 7200.0);
        l.give_back(first);
        let d = &l.take().deltas["frank-0001"];
        assert_eq!((d.samples, d.accepted, d.sessions), (15, 2, 1));
        assert_eq!(d.hours.len(), 2);
        assert_eq!((d.first_seen, d.last_seen), (Some(1e9), 1e9 + 7200.0));
        assert_eq!(l.pending(), 0);
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
        let mut db = Db::open(&scratch("csv")).unwrap();
        let mut l = Ledger::default();
        l.joined(
            1,
            "-abcdefg1",
            Who::named("=cmd|' /C calc'!A0"),
            ClientKind::Native,
        );
        l.joined(
            2,
            "bob-000001",
            Who {
                name: Some("@x,y"),
                team: Some("+team"),
            },
            ClientKind::Native,
        );
        flush(&mut l, &mut db);
        let csv = db.csv().unwrap();
        assert!(
            csv.contains("\n'-abcdefg1,\"'=cmd|' /C calc'!A0\",native,"),
            "{csv}"
        );
        assert!(
            csv.contains("\nbob-000001,\"'@x,y\",native,") && csv.contains(",\"'+team\"\n"),
            "{csv}"
        );
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
