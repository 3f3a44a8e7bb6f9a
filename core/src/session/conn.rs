//! One connection to one shard: [`ShardSession`], the [`Action`]s it asks its driver to take
//! and the [`Record`]s it keeps for the dashboard.

use super::state::Gate;
use super::{fallbacks, Admission, SampledPush, Sampling, ShardAccess, ShardConfig};
use crate::codec::Encoding;
use crate::shard::{Consistency, Outcome};
use crate::wire::{
    self, Bye, ErrorCode, Message, Report, Welcome, HEADER_LEN, MAGIC, PROTOCOL_VERSION,
};
use std::collections::VecDeque;

/// Frames a session keeps while a pull waits; past this the connection is refused with
/// [`ErrorCode::Busy`] and closed (a well-behaved worker has a few frames in flight).
pub const MAX_DEFERRED: usize = 64;

/// What a session records for the dashboard and the metrics.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    /// A worker said Hello on this shard.
    Joined {
        /// The worker.
        worker: u64,
    },
    /// The worker's connection to this shard ended.
    Left {
        /// The worker.
        worker: u64,
    },
    /// A pull was answered.
    Pulled {
        /// The reader.
        worker: u64,
        /// Bytes of the Params frame.
        bytes: usize,
        /// Version sent.
        version: u64,
        /// SSP: the reader's clock.
        clock: Option<u64>,
        /// SSP: the slowest active clock.
        min_clock: Option<u64>,
    },
    /// A frame that decoded as a push: applied, buffered or rejected.
    Pushed {
        /// The pusher (None before Hello).
        worker: Option<u64>,
        /// What happened.
        outcome: Outcome,
        /// Samples the push claims.
        samples: u32,
        /// Bytes of the Push frame.
        bytes: usize,
        /// Whether the gradient had any non-zero value (false for a push refused before it
        /// was decoded): the server's ledger credits samples only for non-zero pushes, so
        /// pushing zeros earns nothing.
        nonzero: bool,
        /// Whether the push was over the norm bound and scaled down to it (a trusted
        /// worker's rare outlier, `session/guard.rs`): applied, and counted apart.
        clipped: bool,
    },
    /// A worker reported its measurements.
    Reported {
        /// The worker.
        worker: u64,
        /// What it measured.
        report: Report,
        /// The encodings this connection negotiated: pulls, pushes.
        encodings: (Encoding, Encoding),
    },
    /// Any other frame was refused.
    Rejected {
        /// The sender (None before Hello).
        worker: Option<u64>,
        /// Why.
        code: ErrorCode,
    },
    /// The worker was expelled ([`ShardSession::expel`]) and its pushes still pending in the
    /// `sync:K` round were dropped from it, never applied.
    Dropped {
        /// The worker.
        worker: u64,
        /// Pushes dropped.
        pushes: usize,
    },
    /// A push of a worker on probation was acknowledged and held for its spot check
    /// ([`Sampling::Hold`]): not applied now; the checker applies it if it passes.
    Held {
        /// The pusher.
        worker: u64,
        /// Samples the push claims.
        samples: u32,
        /// Bytes of the Push frame.
        bytes: usize,
    },
}

/// One binary message for the driver to send: bytes of its own (`head`), followed, for a
/// `Params` frame, by the encoded values shared with every other pull of the same version and
/// encoding ([`wire::ParamsBody`], issue 18). A driver that can write a message in pieces sends
/// the shared body without copying it (the server sends it in WebSocket fragments); others
/// take [`Outgoing::into_vec`].
#[derive(Debug, Clone)]
pub struct Outgoing {
    head: Vec<u8>,
    body: Option<std::sync::Arc<[u8]>>,
}

impl Outgoing {
    /// A message of `head` and then the shared `body`.
    pub fn shared(head: Vec<u8>, body: std::sync::Arc<[u8]>) -> Self {
        Self {
            head,
            body: Some(body),
        }
    }

    /// The message's length in bytes.
    pub fn len(&self) -> usize {
        self.head.len() + self.body.as_ref().map_or(0, |b| b.len())
    }

    /// Whether the message is empty (never, for a frame).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes of its own, and the shared body after them, if any.
    pub fn into_parts(self) -> (Vec<u8>, Option<std::sync::Arc<[u8]>>) {
        (self.head, self.body)
    }

    /// The whole message as one buffer (copies a shared body).
    pub fn into_vec(self) -> Vec<u8> {
        match self.body {
            None => self.head,
            Some(b) => {
                let mut v = self.head;
                v.extend_from_slice(&b);
                v
            }
        }
    }

    /// The whole message as one buffer, leaving `self` as it is.
    pub fn to_vec(&self) -> Vec<u8> {
        self.clone().into_vec()
    }
}

impl From<Vec<u8>> for Outgoing {
    fn from(head: Vec<u8>) -> Self {
        Self { head, body: None }
    }
}

impl PartialEq for Outgoing {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.to_vec() == other.to_vec()
    }
}

/// What a session asks its driver to do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Send one binary message.
    Send(Outgoing),
    /// Close the connection with this reason (after everything sent before).
    Close(String),
    /// Record this.
    Record(Record),
}

#[derive(Debug, Clone, Copy)]
struct Waiting {
    request_id: u32,
    min_version: u64,
    since: f64,
    deadline: f64,
}

/// One connection to one shard.
///
/// # Driving a session
/// Its methods come in the two kinds of quinn-proto's `Connection`:
/// - `handle_*` feed one event in, with the time `now` on the driver's clock:
///   [`handle_frame`](Self::handle_frame) (a binary message arrived),
///   [`handle_text`](Self::handle_text) (a text message, refused),
///   [`handle_update`](Self::handle_update) (the shard's [`ShardState::epoch`] moved: another
///   session's push, join or leave, or an operator's change, may release a waiting pull),
///   [`handle_timeout`](Self::handle_timeout) (the time [`poll_timeout`](Self::poll_timeout)
///   gave has come) and [`handle_close`](Self::handle_close) (the peer closed or the socket
///   failed). [`shutdown`](Self::shutdown) and [`expel`](Self::expel) are the driver's own
///   decisions, fed in the same way.
/// - `poll_*` ask what to do and when: [`poll_action`](Self::poll_action) gives the next
///   [`Action`] (send this frame, close, record this), in the order they must happen;
///   [`poll_timeout`](Self::poll_timeout) the time to wake it at the latest (`Some` only while
///   a pull waits). [`is_closed`](Self::is_closed), [`is_waiting`](Self::is_waiting) and
///   [`worker`](Self::worker) say what state it is in.
///
/// The order a driver keeps, around every event (the server's handler, the simulator's shard
/// and the loopback all do):
/// 1. note [`ShardState::epoch`], then call one `handle_*` (or `shutdown`, `expel`);
/// 2. drain [`poll_action`](Self::poll_action) until `None`, carrying out each action in
///    order;
/// 3. if the epoch moved, call [`handle_update`](Self::handle_update) on every other session
///    of the shard that [`is_waiting`](Self::is_waiting), and drain its actions; repeat while
///    the epoch keeps moving (a released pull's held frames may release another);
/// 4. drop the session once [`is_closed`](Self::is_closed) (it ignores every further event);
/// 5. otherwise (re)arm its timer from [`poll_timeout`](Self::poll_timeout) and wait: for the
///    next message while it is `None`; for an update, the timer or shutdown while it is `Some`.
///    Frames fed while a pull waits are held by the session (at most [`MAX_DEFERRED`]) and
///    handled in order once it is answered; the server simply stops reading until then.
///
/// [`ShardState::epoch`]: super::ShardState::epoch
#[derive(Debug)]
pub struct ShardSession {
    cfg: ShardConfig,
    worker: Option<u64>,
    waiting: Option<Waiting>,
    deferred: VecDeque<Vec<u8>>,
    actions: VecDeque<Action>,
    closed: bool,
    /// Negotiated in the handshake: what Params are sent in, what pushes should come in.
    pull_encoding: Encoding,
    push_encoding: Encoding,
    /// The request id of the last push on this connection (replays are refused).
    last_push: Option<u32>,
    /// The rounding bound carried into the next push ([`wire::Payload::error_bound`]): with
    /// error feedback a push carries the last one's residual in. An accepted push's bound is
    /// carried whole; a refused one's at most twice the last accepted push's (a worker drops
    /// the residual of a refused push, and a huge refused push must not buy an attacker a
    /// wide tolerance for the next one).
    last_bound: f64,
    /// The rounding bound of the last accepted push on this connection.
    accepted_bound: f64,
    /// When the last Report this connection took arrived, and its `compute_s`.
    last_report: Option<(f64, f64)>,
    /// Bytes of one `Params` frame on this connection (counted in the shard's demand while
    /// the worker is joined).
    frame_bytes: u64,
    /// Negotiated in the handshake: `Params` carry the shard's pace (issue 18).
    paces: bool,
    /// Negotiated in the handshake: `Params` carry the samples the shard applied.
    samples: bool,
}

/// Least time between two Reports a session takes, seconds. Workers send one a second; one
/// sooner is ignored, which loses nothing (a Report is cumulative: the next one carries it).
pub const REPORT_MIN_GAP: f64 = 0.5;

/// Why a session ignores `report`, arriving at `now` after the one it took last (`last`:
/// when it arrived and its `compute_s`), or `None` when it takes it (docs/protocol.md,
/// "Report"):
/// - [`ErrorCode::NotFinite`]: a time (`compute_s`, `wall_s`, `exchange_s`) is NaN or
///   infinite;
/// - [`ErrorCode::OutOfBounds`]: a time is negative;
/// - [`ErrorCode::Replayed`]: `compute_s` is below the last one taken (a report rewound);
/// - [`ErrorCode::Busy`]: less than [`REPORT_MIN_GAP`] after the last one taken.
///
/// The bound by wall time since the worker joined is the registry's (it knows the join; a
/// connection does not, and a worker may reconnect a shard without joining again).
pub fn check_report(report: &Report, last: Option<(f64, f64)>, now: f64) -> Option<ErrorCode> {
    let times = [report.compute_s, report.wall_s, report.exchange_s];
    if times.iter().any(|t| !t.is_finite()) {
        return Some(ErrorCode::NotFinite);
    }
    if times.iter().any(|&t| t < 0.0) {
        return Some(ErrorCode::OutOfBounds);
    }
    match last {
        Some((_, compute)) if report.compute_s < compute => Some(ErrorCode::Replayed),
        Some((at, _)) if now - at < REPORT_MIN_GAP => Some(ErrorCode::Busy),
        _ => None,
    }
}

/// The request id of a frame, if its header can be read (32 bytes, right magic); else 0.
pub fn header_request_id(bytes: &[u8]) -> u32 {
    match bytes.get(..HEADER_LEN) {
        Some(h) if h[..2] == MAGIC => u32::from_le_bytes([h[4], h[5], h[6], h[7]]),
        _ => 0,
    }
}

impl ShardSession {
    /// A new connection to the shard described by `cfg`.
    pub fn new(cfg: ShardConfig) -> Self {
        Self {
            cfg,
            worker: None,
            waiting: None,
            deferred: VecDeque::new(),
            actions: VecDeque::new(),
            closed: false,
            pull_encoding: Encoding::F32,
            push_encoding: Encoding::F32,
            last_push: None,
            last_bound: 0.0,
            accepted_bound: 0.0,
            last_report: None,
            frame_bytes: 0,
            paces: false,
            samples: false,
        }
    }

    /// The worker that said Hello, if any.
    pub fn worker(&self) -> Option<u64> {
        self.worker
    }

    /// Whether a pull is waiting (the frames behind it are held).
    pub fn is_waiting(&self) -> bool {
        self.waiting.is_some()
    }

    /// Whether the session has closed (it ignores every further event).
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// The next action for the driver.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// When to call [`ShardSession::handle_timeout`] at the latest (a waiting pull's deadline).
    pub fn poll_timeout(&self) -> Option<f64> {
        self.waiting.map(|w| w.deadline)
    }

    /// A text message arrived (not part of the protocol).
    pub fn handle_text(&mut self, shard: &mut impl ShardAccess, now: f64) {
        if self.closed {
            return;
        }
        self.fail(
            shard,
            0,
            ErrorCode::Malformed,
            "text messages are not part of the protocol; send binary frames".into(),
            None,
            now,
        );
    }

    /// A binary message arrived.
    pub fn handle_frame(&mut self, shard: &mut impl ShardAccess, bytes: &[u8], now: f64) {
        if self.closed {
            return;
        }
        if self.waiting.is_some() {
            if self.deferred.len() >= MAX_DEFERRED {
                let id = header_request_id(bytes);
                let m = format!("more than {MAX_DEFERRED} frames behind a waiting pull");
                self.fail(shard, id, ErrorCode::Busy, m, None, now);
                self.close(shard, format!("busy: {MAX_DEFERRED} frames behind a pull"));
            } else {
                self.deferred.push_back(bytes.to_vec());
            }
            return;
        }
        self.frame(shard, bytes, now);
    }

    /// The shard published an update or its clock moved (another connection's push, join or
    /// leave): a waiting pull may now be answered.
    pub fn handle_update(&mut self, shard: &mut impl ShardAccess, now: f64) {
        self.retry(shard, now, false);
    }

    /// A timer fired (at or after [`ShardSession::poll_timeout`]).
    pub fn handle_timeout(&mut self, shard: &mut impl ShardAccess, now: f64) {
        let due = self.waiting.is_some_and(|w| now >= w.deadline);
        self.retry(shard, now, due);
    }

    /// The peer closed or the socket failed.
    pub fn handle_close(&mut self, shard: &mut impl ShardAccess) {
        self.leave(shard);
        self.closed = true;
    }

    /// The server shuts down: a pull still waiting is answered [`ErrorCode::ShuttingDown`]
    /// (its request fails; frames held behind it are dropped), then Bye, then close.
    pub fn shutdown(&mut self, shard: &mut impl ShardAccess) {
        if self.closed {
            return;
        }
        if let Some(w) = self.waiting.take() {
            self.send(wire::encode_error(
                w.request_id,
                self.cfg.id,
                ErrorCode::ShuttingDown,
                "server shutting down",
            ));
        }
        let bye = wire::encode(&Message::Bye {
            shard: self.cfg.id,
            bye: Bye {
                reason: "server shutting down".into(),
            },
        });
        self.actions.push_back(Action::Send(bye.into()));
        self.close(shard, "server shutting down".into());
    }

    /// The driver turns the connection away (its worker was quarantined): an error frame
    /// with `code` and `message` (request id 0), then Close.
    pub fn expel(&mut self, shard: &mut impl ShardAccess, code: ErrorCode, message: String) {
        if self.closed {
            return;
        }
        let worker = self.worker;
        if let Some(w) = worker {
            // Before the close: leaving may apply the round, and its pushes must not be in it.
            let pushes = shard.with(|s| s.drop_pending(w));
            if pushes > 0 {
                self.actions
                    .push_back(Action::Record(Record::Dropped { worker: w, pushes }));
            }
        }
        self.actions
            .push_back(Action::Record(Record::Rejected { worker, code }));
        self.send(wire::encode_error(0, self.cfg.id, code, message.clone()));
        self.close(shard, format!("{}: {message}", code.name()));
    }

    fn close(&mut self, shard: &mut impl ShardAccess, reason: String) {
        if self.closed {
            return;
        }
        self.actions.push_back(Action::Close(reason));
        self.leave(shard);
        self.closed = true;
        self.waiting = None;
        self.deferred.clear();
    }

    fn leave(&mut self, shard: &mut impl ShardAccess) {
        if let Some(worker) = self.worker.take() {
            let bytes = self.frame_bytes;
            shard.with(|s| s.leave(worker, bytes));
            self.actions
                .push_back(Action::Record(Record::Left { worker }));
        }
    }

    fn send(&mut self, frame: Vec<u8>) {
        self.actions.push_back(Action::Send(frame.into()));
    }

    /// Records the rejection, sends the error frame, and closes if the code is fatal.
    fn fail(
        &mut self,
        shard: &mut impl ShardAccess,
        request_id: u32,
        code: ErrorCode,
        message: String,
        push: Option<(u32, usize)>,
        _now: f64,
    ) {
        let worker = self.worker;
        let record = match push {
            Some((samples, bytes)) => Record::Pushed {
                worker,
                outcome: Outcome::Rejected {
                    code,
                    message: message.clone(),
                },
                samples,
                bytes,
                nonzero: false,
                clipped: false,
            },
            None => Record::Rejected { worker, code },
        };
        self.actions.push_back(Action::Record(record));
        self.send(wire::encode_error(
            request_id,
            self.cfg.id,
            code,
            message.clone(),
        ));
        if code.is_fatal() {
            self.close(shard, format!("{}: {message}", code.name()));
        }
    }

    /// Re-checks a waiting pull; `due` when its deadline passed (sync: flush first). Then
    /// handles the frames that were held behind it, until one waits again.
    fn retry(&mut self, shard: &mut impl ShardAccess, now: f64, due: bool) {
        let Some(w) = self.waiting else { return };
        if self.closed {
            return;
        }
        if due {
            // Rule 3: stragglers; apply what was gathered so far.
            shard.with(|s| {
                if matches!(s.consistency(), Consistency::Sync { .. }) {
                    s.flush();
                }
            });
        }
        let since = if due { now } else { w.since };
        if !self.pull(shard, w.request_id, w.min_version, now, since) {
            return;
        }
        while !self.closed && self.waiting.is_none() {
            let Some(bytes) = self.deferred.pop_front() else {
                break;
            };
            self.frame(shard, &bytes, now);
        }
    }

    /// Answers a pull, or parks it. Returns whether it was answered.
    fn pull(
        &mut self,
        shard: &mut impl ShardAccess,
        request_id: u32,
        min_version: u64,
        now: f64,
        since: f64,
    ) -> bool {
        let Some(worker) = self.worker else {
            return true;
        };
        let (gate, clock, min_clock) = if shard.mode() == Consistency::Async {
            (Gate::Open, None, None)
        } else {
            shard.with(|s| {
                let g = s.gate(worker, min_version, now, since);
                let (c, m) = s.read_view(worker, now);
                (g, c, m)
            })
        };
        if let Gate::Wait(deadline) = gate {
            self.waiting = Some(Waiting {
                request_id,
                min_version,
                since,
                deadline,
            });
            return false;
        }
        self.waiting = None;
        let body = shard.params_body(self.pull_encoding);
        let version = body.version;
        let pace_ms = if self.paces {
            crate::shard::pace_ms(shard.pace())
        } else {
            0
        };
        let frame = Outgoing::shared(
            body.header(request_id, self.cfg.id, pace_ms, self.samples),
            body.bytes,
        );
        let bytes = frame.len();
        self.actions.push_back(Action::Send(frame));
        self.actions.push_back(Action::Record(Record::Pulled {
            worker,
            bytes,
            version,
            clock,
            min_clock,
        }));
        true
    }

    /// A push of a worker on probation, drawn for a check ([`Sampling::Hold`], issue 21):
    /// decoded, handed to the checker as held, acknowledged at the shard's version, and not
    /// applied. The checker applies it if its check passes ([`ShardState::apply_held`]); a
    /// failed check quarantines the worker and the push is never applied. So no push of a
    /// fresh identity moves the model before it was recomputed and found honest.
    #[allow(clippy::too_many_arguments)]
    fn hold(
        &mut self,
        shard: &mut impl ShardAccess,
        request_id: u32,
        base_version: u64,
        samples: u32,
        grad: wire::Payload<'_>,
        tag: Option<wire::PushTag>,
        bound: f64,
        carried: f64,
        frame_bytes: usize,
        now: f64,
    ) {
        let worker = self.worker.unwrap_or_default();
        let push = Some((samples, frame_bytes));
        let mut copy = vec![0.0; grad.len()];
        if let Err(e) = grad.copy_into(&mut copy) {
            // The place the check held is given back.
            shard.take_sample(None);
            return self.fail(
                shard,
                request_id,
                ErrorCode::from(&e),
                e.to_string(),
                push,
                now,
            );
        }
        let Some(tag) = tag else {
            shard.take_sample(None);
            let m = "a held push needs a PushTag meta".to_string();
            return self.fail(shard, request_id, ErrorCode::Protocol, m, push, now);
        };
        if let Err((code, m)) =
            shard.with(|s| s.screen_held(worker, request_id, base_version, &copy, samples))
        {
            shard.take_sample(None);
            return self.fail(shard, request_id, code, m, push, now);
        }
        shard.take_sample(Some(SampledPush {
            worker,
            shard: self.cfg.id,
            base_version,
            samples,
            tag,
            pull_encoding: self.pull_encoding,
            push_encoding: grad.encoding(),
            error_bound: bound + carried,
            grad: copy,
            request_id,
            held: true,
            produced: None,
        }));
        // The worker's residual moved with the push: as if accepted.
        self.last_bound = bound;
        self.accepted_bound = bound;
        let version = shard.with(|s| s.version());
        self.actions.push_back(Action::Record(Record::Held {
            worker,
            samples,
            bytes: frame_bytes,
        }));
        self.send(wire::encode(&Message::Ack {
            request_id,
            shard: self.cfg.id,
            version,
            staleness: version
                .saturating_sub(base_version)
                .min(u64::from(u32::MAX)) as u32,
        }));
    }

    fn frame(&mut self, shard: &mut impl ShardAccess, bytes: &[u8], now: f64) {
        let id = self.cfg.id;
        let msg = match wire::decode(bytes, self.cfg.frame_limit()) {
            Ok(m) => m,
            Err(e) => {
                let rid = header_request_id(bytes);
                return self.fail(shard, rid, ErrorCode::from(&e), e.to_string(), None, now);
            }
        };
        let (request_id, addressed, push) = match &msg {
            Message::Push {
                request_id,
                shard,
                samples,
                ..
            } => (*request_id, *shard, Some((*samples, bytes.len()))),
            Message::Hello {
                request_id, shard, ..
            }
            | Message::Pull {
                request_id, shard, ..
            }
            | Message::Welcome {
                request_id, shard, ..
            }
            | Message::Params {
                request_id, shard, ..
            }
            | Message::Ack {
                request_id, shard, ..
            }
            | Message::Error {
                request_id, shard, ..
            } => (*request_id, *shard, None),
            Message::Bye { shard, .. } | Message::Report { shard, .. } => (0, *shard, None),
        };
        if addressed != id {
            let m = format!("frame addressed to shard {addressed} arrived at shard {id}");
            return self.fail(shard, request_id, ErrorCode::WrongShard, m, push, now);
        }
        if let Some(w) = self.worker {
            shard.with(|s| s.seen(w, now));
        }
        match msg {
            Message::Hello { hello, .. } => {
                if self.worker.is_some() {
                    let m = "second Hello on one connection".to_string();
                    return self.fail(shard, request_id, ErrorCode::Protocol, m, None, now);
                }
                if hello.protocol != PROTOCOL_VERSION {
                    let m = format!(
                        "worker speaks protocol {}, this server speaks {PROTOCOL_VERSION}",
                        hello.protocol
                    );
                    return self.fail(shard, request_id, ErrorCode::ProtocolVersion, m, None, now);
                }
                if self.cfg.setup.counted && !hello.samples {
                    let m = "this run's learning-rate schedule follows the samples the shards \
                             applied (auto local steps): say \"samples\": true in the Hello and \
                             read them from each Params (docs/protocol.md, section 4d)"
                        .to_string();
                    return self.fail(shard, request_id, ErrorCode::Protocol, m, None, now);
                }
                match shard.admit(hello.worker_id, hello.credential.as_deref()) {
                    Admission::Admitted => {}
                    Admission::Unknown => {
                        let m = format!(
                            "worker id {} is unknown; POST /api/join first",
                            hello.worker_id
                        );
                        let code = ErrorCode::UnknownWorker;
                        return self.fail(shard, request_id, code, m, None, now);
                    }
                    Admission::BadCredential => {
                        let m = format!(
                            "the credential does not belong to worker {}; use the one from its join",
                            hello.worker_id
                        );
                        let code = ErrorCode::Unauthorized;
                        return self.fail(shard, request_id, code, m, None, now);
                    }
                    Admission::Quarantined(why) => {
                        let m = format!("worker {} is quarantined: {why}", hello.worker_id);
                        let code = ErrorCode::Quarantined;
                        return self.fail(shard, request_id, code, m, None, now);
                    }
                }
                let worker = hello.worker_id;
                let open = shard.with(|s| s.sockets_of(worker));
                if open >= super::state::MAX_SOCKETS_PER_WORKER {
                    let m = format!(
                        "worker {worker} already has {open} connections to this shard (at most {})",
                        super::state::MAX_SOCKETS_PER_WORKER
                    );
                    self.fail(shard, request_id, ErrorCode::Busy, m.clone(), None, now);
                    return self.close(shard, format!("busy: {m}"));
                }
                self.worker = Some(worker);
                self.pull_encoding = Encoding::negotiate(
                    &hello.pull_encodings,
                    &fallbacks(self.cfg.setup.pull_encoding),
                );
                self.push_encoding = Encoding::negotiate(
                    &hello.push_encodings,
                    &fallbacks(self.cfg.setup.push_encoding),
                );
                self.frame_bytes = crate::shard::pace::params_frame_bytes(
                    self.pull_encoding,
                    self.cfg.range.len(),
                );
                self.paces = hello.pacing && self.cfg.setup.pacing.is_on();
                self.samples = hello.samples;
                let bytes = self.frame_bytes;
                let version = shard.with(|s| {
                    s.join(worker, now, bytes);
                    s.version()
                });
                self.actions
                    .push_back(Action::Record(Record::Joined { worker }));
                self.send(wire::encode(&Message::Welcome {
                    request_id,
                    shard: id,
                    welcome: Welcome {
                        protocol: PROTOCOL_VERSION,
                        range: self.cfg.range,
                        version,
                        pull_encoding: self.pull_encoding,
                        push_encoding: self.push_encoding,
                        reports: self.cfg.setup.reports && self.cfg.id == 0,
                        spot_checks: shard.spot_checks(),
                        paces: self.paces,
                        samples: self.samples,
                    },
                }));
            }
            _ if self.worker.is_none() => {
                let m = "the first frame must be Hello".to_string();
                self.fail(shard, request_id, ErrorCode::Protocol, m, push, now);
            }
            Message::Pull { min_version, .. } => {
                self.pull(shard, request_id, min_version, now, now);
            }
            Message::Push {
                base_version,
                samples,
                grad,
                ..
            } => {
                let worker = self.worker.unwrap_or_default();
                if grad.len() != self.cfg.range.len() {
                    let m = format!(
                        "push of {} values to a shard of {}",
                        grad.len(),
                        self.cfg.range.len()
                    );
                    return self.fail(shard, request_id, ErrorCode::WrongLength, m, push, now);
                }
                if self
                    .last_push
                    .is_some_and(|last| !wire::id_after(request_id, last))
                {
                    let m = format!(
                        "push request id {request_id} does not follow this connection's last push {}",
                        self.last_push.unwrap_or_default()
                    );
                    return self.fail(shard, request_id, ErrorCode::Replayed, m, push, now);
                }
                self.last_push = Some(request_id);
                // Whatever becomes of this push, the worker's residual moved with it.
                // (Only a spot-checking shard needs it: bf16's bound is a pass over the values.)
                let bound = if shard.spot_checks() {
                    grad.error_bound()
                } else {
                    0.0
                };
                let carried = self.last_bound;
                // As if refused, until the outcome says otherwise (below).
                self.last_bound = bound.min(2.0 * self.accepted_bound);
                // The frame decoded, so its meta, if any, is a valid tag.
                let tag = wire::push_tag(bytes).ok().flatten();
                if tag.is_none() && shard.spot_checks() {
                    let m = "this shard spot-checks pushes: every push must carry a PushTag meta"
                        .to_string();
                    return self.fail(shard, request_id, ErrorCode::Protocol, m, push, now);
                }
                if let Some(t) = &tag {
                    if let Err(m) = shard.check_tag(worker, t) {
                        return self.fail(shard, request_id, ErrorCode::TooStale, m, push, now);
                    }
                }
                // Whether it is checked is decided before it is applied: a push drawn for a
                // check the driver cannot take now is refused `busy`, never applied unchecked.
                let sampled = match &tag {
                    Some(t) => {
                        let digest = super::guard::bytes_digest(grad.bytes());
                        shard.sample(worker, request_id, digest, t)
                    }
                    None => Sampling::No,
                };
                if let Sampling::Busy(m) = sampled {
                    return self.fail(shard, request_id, ErrorCode::Busy, m, push, now);
                }
                if sampled == Sampling::Hold {
                    return self.hold(
                        shard,
                        request_id,
                        base_version,
                        samples,
                        grad,
                        tag,
                        bound,
                        carried,
                        bytes.len(),
                        now,
                    );
                }
                let (outcome, nonzero, clipped) = shard.with(|s| {
                    let o = s.push(worker, request_id, base_version, grad, samples, now);
                    (o, s.last_push_nonzero, s.last_push_clipped)
                });
                if sampled == Sampling::Yes {
                    let accepted =
                        matches!(outcome, Outcome::Applied { .. } | Outcome::Buffered { .. });
                    let mut copy = Vec::new();
                    let copied = accepted && {
                        copy.resize(grad.len(), 0.0);
                        grad.copy_into(&mut copy).is_ok()
                    };
                    let push = match (copied, tag) {
                        (true, Some(tag)) => Some(SampledPush {
                            worker,
                            shard: id,
                            base_version,
                            samples,
                            tag,
                            pull_encoding: self.pull_encoding,
                            push_encoding: grad.encoding(),
                            error_bound: bound + carried,
                            grad: copy,
                            request_id,
                            held: false,
                            produced: match &outcome {
                                Outcome::Applied { version, .. } => Some(*version),
                                Outcome::Buffered { version, .. } => Some(version + 1),
                                Outcome::Rejected { .. } => None,
                            },
                        }),
                        _ => None,
                    };
                    shard.take_sample(push);
                }
                if matches!(outcome, Outcome::Applied { .. } | Outcome::Buffered { .. }) {
                    self.last_bound = bound;
                    self.accepted_bound = bound;
                }
                let (version, staleness) = match &outcome {
                    Outcome::Applied {
                        version, staleness, ..
                    } => (*version, *staleness),
                    Outcome::Buffered { version, .. } => (*version, 0),
                    Outcome::Rejected { code, message } => {
                        let (code, message) = (*code, message.clone());
                        return self.fail(shard, request_id, code, message, push, now);
                    }
                };
                self.actions.push_back(Action::Record(Record::Pushed {
                    worker: Some(worker),
                    outcome,
                    samples,
                    bytes: bytes.len(),
                    nonzero,
                    clipped,
                }));
                self.send(wire::encode(&Message::Ack {
                    request_id,
                    shard: id,
                    version,
                    staleness: staleness.min(u64::from(u32::MAX)) as u32,
                }));
            }
            Message::Bye { .. } => self.close(shard, "worker said bye".into()),
            Message::Report { report, .. } => {
                if !(self.cfg.setup.reports && self.cfg.id == 0) {
                    let m = "this shard takes no Report frames".to_string();
                    return self.fail(shard, request_id, ErrorCode::Protocol, m, None, now);
                }
                let worker = self.worker.unwrap_or_default();
                // A Report has no reply (an error frame would read as the answer to a push):
                // one refused is only recorded.
                if let Some(code) = check_report(&report, self.last_report, now) {
                    let worker = Some(worker);
                    self.actions
                        .push_back(Action::Record(Record::Rejected { worker, code }));
                    return;
                }
                self.last_report = Some((now, report.compute_s));
                let encodings = (self.pull_encoding, self.push_encoding);
                self.actions.push_back(Action::Record(Record::Reported {
                    worker,
                    report,
                    encodings,
                }));
            }
            Message::Welcome { .. }
            | Message::Params { .. }
            | Message::Ack { .. }
            | Message::Error { .. } => {
                let m = "a worker sent a shard-side message".to_string();
                self.fail(shard, request_id, ErrorCode::Protocol, m, None, now);
            }
        }
    }
}

#[cfg(test)]
mod tests;
