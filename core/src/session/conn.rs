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
mod tests {
    use super::*;
    use crate::session::testing::{hello, pull, sent, setup, state};
    use crate::session::ShardState;
    use crate::shard::StalenessPolicy;
    use crate::wire::{ClientKind, Hello, MAX_META_LEN};

    /// A shard whose join registry answers every Hello with `admission` (the server's
    /// registry in miniature).
    struct Admit {
        state: ShardState,
        admission: Admission,
    }

    impl ShardAccess for Admit {
        fn snapshot(&self) -> (u64, std::sync::Arc<Vec<f32>>) {
            self.state.snapshot()
        }
        fn snapshot_samples(&self) -> u64 {
            self.state.snapshot_samples()
        }
        fn with<R>(&mut self, f: impl FnOnce(&mut ShardState) -> R) -> R {
            f(&mut self.state)
        }
        fn admit(&self, _worker: u64, _credential: Option<&str>) -> Admission {
            self.admission.clone()
        }
    }

    /// A spot-checking shard whose checker answers every tagged push with `answer`, and
    /// keeps what it is handed.
    struct Checking {
        state: ShardState,
        answer: Sampling,
        taken: Vec<Option<SampledPush>>,
    }

    impl ShardAccess for Checking {
        fn snapshot(&self) -> (u64, std::sync::Arc<Vec<f32>>) {
            self.state.snapshot()
        }
        fn snapshot_samples(&self) -> u64 {
            self.state.snapshot_samples()
        }
        fn with<R>(&mut self, f: impl FnOnce(&mut ShardState) -> R) -> R {
            f(&mut self.state)
        }
        fn admit(&self, _worker: u64, _credential: Option<&str>) -> Admission {
            Admission::Admitted
        }
        fn spot_checks(&self) -> bool {
            true
        }
        fn sample(&mut self, _: u64, _: u32, _: u64, _: &wire::PushTag) -> Sampling {
            self.answer.clone()
        }
        fn take_sample(&mut self, push: Option<SampledPush>) {
            self.taken.push(push);
        }
    }

    /// A tagged f32 push to shard 1 (batch index = request id, read at version `v`).
    fn tagged(rid: u32, v: u64, g: &[f32]) -> Vec<u8> {
        let tag = wire::PushTag {
            batch: u64::from(rid),
            versions: vec![v],
        };
        wire::encode_push_tagged(Encoding::F32, rid, 1, v, 8, g, None, &tag).unwrap()
    }

    /// Issue 21: whether a push is checked is decided before it is applied. A push drawn for
    /// a check the checker cannot queue is refused `busy` and changes nothing (it used to be
    /// applied and its check dropped); a drawn push is handed over once applied, and a drawn
    /// push the shard refuses gives its place back (`None`).
    #[test]
    fn a_push_drawn_for_a_check_that_cannot_be_queued_is_refused_busy_not_applied() {
        let mut sh = Checking {
            state: state(Consistency::Async, 2),
            answer: Sampling::Busy("the spot checker is full".into()),
            taken: Vec::new(),
        };
        let mut s = ShardSession::new(*sh.state.config());
        s.handle_frame(&mut sh, &hello(1, 7), 0.0);
        assert_eq!(sent(&mut s), ["welcome 1"]);
        s.handle_frame(&mut sh, &tagged(2, 0, &[1.0, 2.0]), 0.0);
        assert_eq!(sent(&mut s), ["error 2 busy"], "refused, connection kept");
        assert_eq!(
            (sh.state.version(), &sh.state.values()[..]),
            (0, &[0.0f32, 0.0][..])
        );
        assert!(sh.taken.is_empty());
        // Drawn and queued: applied, then handed over as the shard decoded it.
        sh.answer = Sampling::Yes;
        s.handle_frame(&mut sh, &tagged(3, 0, &[1.0, 2.0]), 0.0);
        assert_eq!(sent(&mut s), ["ack 3 v1"]);
        assert_eq!(sh.taken.len(), 1);
        let p = sh.taken[0].as_ref().expect("applied, so handed over");
        assert_eq!(
            (p.worker, p.base_version, &p.grad[..]),
            (7, 0, &[1.0f32, 2.0][..])
        );
        // Drawn, then refused by the shard (the same gradient again: a replay): its place
        // is given back.
        s.handle_frame(&mut sh, &tagged(4, 1, &[1.0, 2.0]), 0.0);
        assert_eq!(sent(&mut s), ["error 4 replayed"]);
        assert_eq!(sh.taken.len(), 2);
        assert!(sh.taken[1].is_none());
        // Not drawn: applied, nothing handed over.
        sh.answer = Sampling::No;
        s.handle_frame(&mut sh, &tagged(5, 1, &[3.0, 1.0]), 0.0);
        assert_eq!(sent(&mut s), ["ack 5 v2"]);
        assert_eq!(sh.taken.len(), 2);
    }

    /// Issue 21: a push of a worker on probation drawn for a check (`Sampling::Hold`) is
    /// acknowledged and handed over as held, and changes nothing until the checker applies
    /// it (`apply_held`); its bytes are taken at once, so the same gradient pushed again while
    /// it waits is refused as a replay, and a second apply of it changes nothing more.
    #[test]
    fn a_held_push_changes_nothing_until_the_checker_applies_it() {
        let mut sh = Checking {
            state: state(Consistency::Async, 2),
            answer: Sampling::Hold,
            taken: Vec::new(),
        };
        let mut s = ShardSession::new(*sh.state.config());
        s.handle_frame(&mut sh, &hello(1, 7), 0.0);
        assert_eq!(sent(&mut s), ["welcome 1"]);
        s.handle_frame(&mut sh, &tagged(2, 0, &[1.0, 2.0]), 0.0);
        assert_eq!(
            sent(&mut s),
            ["ack 2 v0"],
            "acknowledged at the shard's version"
        );
        assert_eq!(
            (sh.state.version(), &sh.state.values()[..]),
            (0, &[0.0f32, 0.0][..]),
            "not applied"
        );
        let held = sh.taken[0].clone().expect("handed over");
        assert!(held.held && held.produced.is_none());
        assert_eq!((held.request_id, &held.grad[..]), (2, &[1.0f32, 2.0][..]));
        // The same bytes again while it waits: a replay, refused, not handed over.
        s.handle_frame(&mut sh, &tagged(3, 0, &[1.0, 2.0]), 0.0);
        assert_eq!(sent(&mut s), ["error 3 replayed"]);
        assert!(sh.taken[1].is_none());
        // The check passed: the checker applies it, as SGD at lr 1.
        let (outcome, nonzero) = sh.state.apply_held(&held, 1.0);
        assert!(
            matches!(outcome, Outcome::Applied { version: 1, .. }),
            "{outcome:?}"
        );
        assert!(nonzero);
        assert_eq!(&sh.state.values()[..], &[-1.0f32, -2.0][..]);
        // A second apply of the same push is refused: its request id was taken.
        let (again, _) = sh.state.apply_held(&held, 2.0);
        assert!(matches!(again, Outcome::Rejected { .. }), "{again:?}");
        assert_eq!(sh.state.version(), 1);
    }

    /// How a row's shard (id 1, two values, plain SGD at learning rate 1) is set up.
    #[derive(Debug, Clone, Copy)]
    enum Shard {
        Async,
        /// Paused by an operator.
        Paused,
        /// Staleness policy `drop:0`.
        DropStale,
        /// `--aggregation zeno`, with a reference gradient of `[1, 2]`.
        Zeno,
        /// `sync:2` with one worker: a pull for version 1 waits.
        Sync,
    }

    /// The event that provokes a row's code.
    #[derive(Debug)]
    enum Input {
        Frame(Vec<u8>),
        /// The server shuts down (while the pull fed in `before` waits).
        Shutdown,
    }

    /// One row of the error-code table.
    #[derive(Debug)]
    struct Row {
        /// What provokes it, in words.
        what: &'static str,
        shard: Shard,
        /// What the shard's registry says to the Hello.
        admission: Admission,
        /// Whether worker 7 says Hello (request id 1) first.
        hello: bool,
        /// Frames fed before the input (their replies are not checked).
        before: Vec<Vec<u8>>,
        input: Input,
        /// The request id the error frame echoes.
        request_id: u32,
        /// Whether the code is fatal: the session sends the error frame, then closes.
        fatal: bool,
        /// Whether the session records the refusal (a `Rejected` record, or a `Pushed` one
        /// with a rejected outcome).
        recorded: bool,
    }

    /// A push of `grad` from worker 7 to shard 1, claiming 8 samples.
    fn push(request_id: u32, base_version: u64, grad: &[f32]) -> Vec<u8> {
        wire::encode_push(request_id, 1, base_version, 8, grad)
    }

    /// Issue 21: the record of an accepted push says whether its gradient was all zero
    /// (the server's ledger credits no samples for one), and a refused push is never
    /// non-zero.
    #[test]
    fn pushed_records_say_whether_the_gradient_was_all_zero() {
        let mut sh = state(Consistency::Async, 2);
        let mut s = ShardSession::new(*sh.config());
        s.handle_frame(&mut sh, &hello(1, 7), 0.0);
        let mut flags = Vec::new();
        for (rid, grad) in [(2, [0.0f32, 0.0]), (3, [0.0, 1e-30]), (4, [0.0, -0.0])] {
            s.handle_frame(&mut sh, &push(rid, 0, &grad), 0.0);
            while let Some(a) = s.poll_action() {
                if let Action::Record(Record::Pushed {
                    outcome, nonzero, ..
                }) = a
                {
                    flags.push((rid, matches!(outcome, Outcome::Applied { .. }), nonzero));
                }
            }
        }
        // A push of the wrong length is refused before it is decoded.
        s.handle_frame(&mut sh, &push(5, 0, &[1.0]), 0.0);
        while let Some(a) = s.poll_action() {
            if let Action::Record(Record::Pushed { nonzero, .. }) = a {
                flags.push((5, false, nonzero));
            }
        }
        assert_eq!(
            flags,
            [
                (2, true, false),
                (3, true, true),
                (4, true, false),
                (5, false, false)
            ]
        );
    }

    /// The row of `code`. The match is exhaustive, so a new `ErrorCode` does not compile
    /// until it has a row here. Every code today is one a `ShardSession` sends; a code only a
    /// driver could send (HTTP, a worker) would get a row saying so.
    ///
    /// Besides the session, drivers send some codes themselves, which are tested where they
    /// live (tests/integration/protocol.rs): `busy` for the server's per-worker and per-address
    /// push rate, `protocol` for a missing Hello in time, `quarantined` through
    /// [`ShardSession::expel`].
    fn row(code: ErrorCode) -> Row {
        // A fatal refusal of request 9 from worker 7 on a plain async shard.
        let base = |what: &'static str, input: Input| Row {
            what,
            shard: Shard::Async,
            admission: Admission::Admitted,
            hello: true,
            before: Vec::new(),
            input,
            request_id: 9,
            fatal: true,
            recorded: true,
        };
        let hello_as = |protocol: u32| {
            wire::encode(&Message::Hello {
                request_id: 9,
                shard: 1,
                hello: Hello {
                    protocol,
                    worker_id: 7,
                    client: ClientKind::Native,
                    ..Default::default()
                },
            })
        };
        match code {
            ErrorCode::Malformed => {
                let mut f = push(9, 0, &[0.5, 0.5]);
                f.truncate(f.len() - 3);
                base("a push cut short", Input::Frame(f))
            }
            ErrorCode::WireVersion => {
                let mut f = push(9, 0, &[0.5, 0.5]);
                f[2] = 2;
                base("a header of wire version 2", Input::Frame(f))
            }
            ErrorCode::UnknownKind => {
                let mut f = pull(9, 0);
                f[3] = 99;
                base("a header of kind 99", Input::Frame(f))
            }
            ErrorCode::Oversize => base(
                "a frame over the shard's limit (a full push plus meta)",
                Input::Frame(push(9, 0, &vec![0.0; 2 + MAX_META_LEN / 4 + 1])),
            ),
            ErrorCode::WrongLength => base(
                "a push of three values to a shard of two",
                Input::Frame(push(9, 0, &[0.5, 0.5, 0.5])),
            ),
            ErrorCode::NotFinite => base(
                "a push holding NaN",
                Input::Frame(push(9, 0, &[0.5, f32::NAN])),
            ),
            ErrorCode::ProtocolVersion => Row {
                hello: false,
                ..base("a Hello of protocol 99", Input::Frame(hello_as(99)))
            },
            ErrorCode::Protocol => Row {
                hello: false,
                ..base("a push before Hello", Input::Frame(push(9, 0, &[0.5, 0.5])))
            },
            ErrorCode::WrongShard => base(
                "a push addressed to shard 2",
                Input::Frame(wire::encode_push(9, 2, 0, 8, &[0.5, 0.5])),
            ),
            ErrorCode::FutureVersion => base(
                "a push from version 1000 of a shard at 0",
                Input::Frame(push(9, 1000, &[0.5, 0.5])),
            ),
            ErrorCode::TooStale => Row {
                shard: Shard::DropStale,
                before: vec![push(2, 0, &[0.5, 0.5])],
                fatal: false,
                ..base(
                    "under drop:0, a push from version 0 of a shard at 1",
                    Input::Frame(push(9, 0, &[0.5, 0.25])),
                )
            },
            ErrorCode::UnknownWorker => Row {
                admission: Admission::Unknown,
                hello: false,
                ..base(
                    "a Hello from a worker that never joined",
                    Input::Frame(hello_as(PROTOCOL_VERSION)),
                )
            },
            ErrorCode::ShuttingDown => Row {
                shard: Shard::Sync,
                before: vec![pull(9, 1)],
                // The pull's request fails; no refusal is recorded.
                recorded: false,
                ..base(
                    "the server shuts down while a sync pull waits",
                    Input::Shutdown,
                )
            },
            ErrorCode::Busy => Row {
                shard: Shard::Paused,
                fatal: false,
                ..base(
                    "a push to a paused shard",
                    Input::Frame(push(9, 0, &[0.5, 0.5])),
                )
            },
            ErrorCode::Unauthorized => Row {
                admission: Admission::BadCredential,
                hello: false,
                ..base(
                    "a Hello whose credential is not the worker's",
                    Input::Frame(hello_as(PROTOCOL_VERSION)),
                )
            },
            ErrorCode::OutOfBounds => Row {
                fatal: false,
                ..base(
                    "a push holding 1e30",
                    Input::Frame(push(9, 0, &[1e30, 0.0])),
                )
            },
            ErrorCode::Replayed => Row {
                before: vec![push(9, 0, &[0.5, 0.5])],
                fatal: false,
                ..base(
                    "a push whose request id is not above the last push's",
                    Input::Frame(push(9, 1, &[0.5, 0.5])),
                )
            },
            ErrorCode::Disagrees => Row {
                shard: Shard::Zeno,
                fatal: false,
                ..base(
                    "under zeno, a push against the validation gradient",
                    Input::Frame(push(9, 0, &[-1.0, -2.0])),
                )
            },
            ErrorCode::Quarantined => Row {
                admission: Admission::Quarantined("failed a spot check".into()),
                hello: false,
                ..base(
                    "a Hello from a quarantined worker",
                    Input::Frame(hello_as(PROTOCOL_VERSION)),
                )
            },
        }
    }

    fn shard_for(row: &Row) -> Admit {
        let mut setup = setup(match row.shard {
            Shard::Sync => Consistency::Sync { k: 2 },
            _ => Consistency::Async,
        });
        if let Shard::DropStale = row.shard {
            setup.staleness = StalenessPolicy {
                max_staleness: Some(0),
                ..StalenessPolicy::default()
            };
        }
        if let Shard::Zeno = row.shard {
            setup.aggregation = crate::robust::Aggregation::Zeno { margin: 0.5 };
        }
        let range = crate::partition::KeyRange { start: 4, end: 6 };
        let mut state = setup.state(1, range, vec![0.0; 2]).unwrap();
        match row.shard {
            Shard::Paused => state.set_paused(true),
            Shard::Zeno => state.set_reference(&[1.0, 2.0]),
            _ => {}
        }
        Admit {
            state,
            admission: row.admission.clone(),
        }
    }

    /// Every `ErrorCode` has a row (the match in [`row`] is exhaustive), and a session driven
    /// with that row's decoded frames answers exactly one error frame of that code, echoing the
    /// request id, closes after it if and only if the code is fatal, records the refusal, and
    /// changes nothing on the shard.
    #[test]
    fn every_error_code_is_answered_as_its_row_says() {
        let codes: Vec<ErrorCode> = (0..=u32::from(u8::MAX))
            .filter_map(ErrorCode::from_u32)
            .collect();
        assert!(codes.contains(&ErrorCode::Quarantined), "{codes:?}");
        for code in codes {
            let row = row(code);
            let name = code.name();
            let what = row.what;
            assert_eq!(row.fatal, code.is_fatal(), "{name}: the row's fatal column");
            let mut sh = shard_for(&row);
            let mut s = ShardSession::new(*sh.state.config());
            if row.hello {
                s.handle_frame(&mut sh, &hello(1, 7), 0.0);
            }
            for f in &row.before {
                s.handle_frame(&mut sh, f, 0.0);
            }
            while s.poll_action().is_some() {}
            assert!(!s.is_closed(), "{name} ({what}): closed before the input");
            let version = sh.state.version();
            match &row.input {
                Input::Frame(f) => s.handle_frame(&mut sh, f, 0.0),
                Input::Shutdown => s.shutdown(&mut sh),
            }
            let (mut errors, mut records, mut closes) = (Vec::new(), Vec::new(), 0);
            while let Some(a) = s.poll_action() {
                match a {
                    Action::Send(f) => {
                        if let Ok(Message::Error {
                            request_id,
                            shard,
                            error,
                        }) = wire::decode(&f.to_vec(), usize::MAX)
                        {
                            errors.push((request_id, shard, error.code));
                        }
                    }
                    Action::Close(_) => closes += 1,
                    Action::Record(Record::Rejected { code, .. })
                    | Action::Record(Record::Pushed {
                        outcome: Outcome::Rejected { code, .. },
                        ..
                    }) => records.push(code),
                    Action::Record(_) => {}
                }
            }
            assert_eq!(
                errors,
                [(row.request_id, 1, code)],
                "{name} ({what}): the error frames"
            );
            assert_eq!(s.is_closed(), row.fatal, "{name} ({what}): closed");
            assert_eq!(
                closes,
                usize::from(row.fatal),
                "{name} ({what}): Close actions"
            );
            let want: &[ErrorCode] = if row.recorded { &[code] } else { &[] };
            assert_eq!(records, want, "{name} ({what}): records");
            assert_eq!(
                sh.state.version(),
                version,
                "{name} ({what}): nothing applied"
            );
        }
    }

    /// The defences issue: Reports are taken only when finite, non-negative, not rewound and
    /// not sooner than [`REPORT_MIN_GAP`] after the last one taken; a refused one gets no
    /// reply, only a `Rejected` record, and the connection stays open.
    #[test]
    fn reports_are_checked_and_refused_ones_only_recorded() {
        let report = |compute_s: f64, wall_s: f64| Report {
            local_steps: 1,
            compute_s,
            wall_s,
            ..Default::default()
        };
        let last = Some((10.0, 5.0));
        for (what, r, last, now, want) in [
            ("the first", report(1.0, 2.0), None, 0.0, None),
            ("a later one", report(6.0, 12.0), last, 11.0, None),
            ("the same compute", report(5.0, 12.0), last, 11.0, None),
            (
                "NaN",
                report(f64::NAN, 1.0),
                None,
                0.0,
                Some(ErrorCode::NotFinite),
            ),
            (
                "inf",
                report(f64::INFINITY, 1.0),
                last,
                11.0,
                Some(ErrorCode::NotFinite),
            ),
            (
                "1.7e308 twice",
                report(1.7e308, 1.7e308 * 10.0),
                None,
                0.0,
                Some(ErrorCode::NotFinite),
            ),
            (
                "negative",
                report(-1.0, 1.0),
                None,
                0.0,
                Some(ErrorCode::OutOfBounds),
            ),
            (
                "negative wall",
                report(1.0, -1.0),
                None,
                0.0,
                Some(ErrorCode::OutOfBounds),
            ),
            (
                "rewound",
                report(0.0, 12.0),
                last,
                20.0,
                Some(ErrorCode::Replayed),
            ),
            (
                "too soon",
                report(6.0, 12.0),
                last,
                10.4,
                Some(ErrorCode::Busy),
            ),
        ] {
            assert_eq!(check_report(&r, last, now), want, "{what}");
        }
        let ex = Report {
            exchange_s: f64::NAN,
            ..report(1.0, 1.0)
        };
        assert_eq!(check_report(&ex, None, 0.0), Some(ErrorCode::NotFinite));

        // In a session: 100, 0, 100, 0, 100 a second apart takes 100 three times (the
        // registry credits the growth only), refuses the rewinds, sends nothing, stays open.
        let mut st = setup(Consistency::Async);
        st.reports = true;
        let range = crate::partition::KeyRange { start: 0, end: 2 };
        let mut sh = st.state(0, range, vec![0.0; 2]).unwrap();
        let mut s = ShardSession::new(*sh.config());
        let hello0 = wire::encode(&Message::Hello {
            request_id: 1,
            shard: 0,
            hello: Hello {
                protocol: PROTOCOL_VERSION,
                worker_id: 7,
                client: ClientKind::Native,
                ..Default::default()
            },
        });
        s.handle_frame(&mut sh, &hello0, 0.0);
        let mut records = Vec::new();
        for (i, c) in [100.0, 0.0, 100.0, 0.0, 100.0, 1e12]
            .into_iter()
            .enumerate()
        {
            let f = wire::encode(&Message::Report {
                shard: 0,
                report: report(c, 200.0 + i as f64),
            });
            s.handle_frame(&mut sh, &f, 1.0 + i as f64);
        }
        let mut frames = Vec::new();
        while let Some(a) = s.poll_action() {
            match a {
                Action::Send(f) => frames.push(f),
                Action::Close(why) => panic!("closed: {why}"),
                Action::Record(Record::Reported { report, .. }) => {
                    records.push(format!("took {}", report.compute_s))
                }
                Action::Record(Record::Rejected { code, .. }) => {
                    records.push(format!("refused {}", code.name()))
                }
                Action::Record(_) => {}
            }
        }
        assert_eq!(frames.len(), 1, "only the Welcome");
        assert_eq!(
            records,
            [
                "took 100",
                "refused replayed",
                "took 100",
                "refused replayed",
                "took 100",
                "took 1000000000000"
            ]
        );
        assert!(!s.is_closed());
    }

    #[test]
    fn errors_echo_the_request_id_and_fatal_ones_close() {
        let mut sh = state(Consistency::Async, 2);
        let mut s = ShardSession::new(*sh.config());
        s.handle_frame(&mut sh, &pull(5, 0), 0.0);
        assert_eq!(sent(&mut s), ["error 5 protocol", "close"]);
        s.handle_frame(&mut sh, &hello(6, 1), 0.0);
        assert!(sent(&mut s).is_empty(), "a closed session ignores input");

        let mut s = ShardSession::new(*sh.config());
        s.handle_frame(&mut sh, &[b'C', b'G', 1, 3, 9, 0, 0, 0, 0, 0], 0.0);
        assert_eq!(
            sent(&mut s),
            ["error 0 malformed", "close"],
            "short header: id 0"
        );

        let mut s = ShardSession::new(*sh.config());
        s.handle_frame(&mut sh, &hello(1, 7), 0.0);
        s.handle_frame(
            &mut sh,
            &wire::encode_push(2, 1, 0, 8, &[1.0, f32::NAN]),
            0.0,
        );
        assert_eq!(sent(&mut s), ["welcome 1", "error 2 not_finite", "close"]);
        assert_eq!(sh.connected(), 0, "a closed connection leaves the shard");
        assert_eq!(**sh.values(), vec![0.0, 0.0], "unchanged");
    }

    #[test]
    fn async_pushes_apply_and_pulls_see_them() {
        let mut sh = state(Consistency::Async, 2);
        let mut s = ShardSession::new(*sh.config());
        s.handle_frame(&mut sh, &hello(1, 7), 0.0);
        s.handle_frame(&mut sh, &wire::encode_push(2, 1, 0, 8, &[1.0, -1.0]), 0.0);
        s.handle_frame(&mut sh, &pull(3, 0), 0.0);
        s.handle_frame(
            &mut sh,
            &wire::encode_push(4, 1, 0, 8, &[1.0, -1.0, 3.0]),
            0.0,
        );
        assert_eq!(
            sent(&mut s),
            [
                "welcome 1",
                "ack 2 v1",
                "params 3 v1",
                "error 4 wrong_length",
                "close"
            ]
        );
        assert_eq!(**sh.values(), vec![-1.0, 1.0]);
    }

    /// One worker holds at most two sessions on a shard: a third Hello is answered `busy`
    /// and closed, and a place freed by a close is taken again. The SSP clock keeps the
    /// worker while one of its sessions stays.
    #[test]
    fn one_worker_holds_at_most_two_sessions_per_shard() {
        let mut sh = state(Consistency::Ssp { bound: 2 }, 2);
        let mut a = ShardSession::new(*sh.config());
        let mut b = ShardSession::new(*sh.config());
        let mut c = ShardSession::new(*sh.config());
        a.handle_frame(&mut sh, &hello(1, 7), 0.0);
        b.handle_frame(&mut sh, &hello(1, 7), 0.0);
        c.handle_frame(&mut sh, &hello(1, 7), 0.0);
        assert_eq!(sent(&mut a), ["welcome 1"]);
        assert_eq!(sent(&mut b), ["welcome 1"]);
        assert_eq!(sent(&mut c), ["error 1 busy", "close"]);
        assert_eq!((sh.sockets_of(7), sh.connected()), (2, 2));
        // Another worker is not held back by worker 7's sessions.
        let mut other = ShardSession::new(*sh.config());
        other.handle_frame(&mut sh, &hello(1, 8), 0.0);
        assert_eq!(sent(&mut other), ["welcome 1"]);
        a.handle_close(&mut sh);
        assert_eq!(sh.sockets_of(7), 1);
        assert!(
            sh.clock().clock(7).is_some(),
            "one session of 7 is still open"
        );
        let mut d = ShardSession::new(*sh.config());
        d.handle_frame(&mut sh, &hello(1, 7), 0.0);
        assert_eq!(sent(&mut d), ["welcome 1"]);
        b.handle_close(&mut sh);
        d.handle_close(&mut sh);
        assert_eq!(sh.sockets_of(7), 0);
        assert!(sh.clock().clock(7).is_none());
    }

    #[test]
    fn sync_pull_waits_then_flushes_at_the_timeout_and_held_frames_follow() {
        let mut sh = state(Consistency::Sync { k: 2 }, 1);
        let mut a = ShardSession::new(*sh.config());
        let mut b = ShardSession::new(*sh.config());
        a.handle_frame(&mut sh, &hello(1, 1), 0.0);
        b.handle_frame(&mut sh, &hello(1, 2), 0.0);
        a.handle_frame(&mut sh, &wire::encode_push(2, 1, 0, 8, &[1.0]), 0.0);
        a.handle_frame(&mut sh, &pull(3, 1), 0.5);
        a.handle_frame(&mut sh, &pull(4, 0), 0.6);
        assert!(a.is_waiting());
        assert_eq!(a.poll_timeout(), Some(2.5));
        assert_eq!(sent(&mut a), ["welcome 1", "ack 2 v0"]);
        a.handle_timeout(&mut sh, 1.0);
        assert!(a.is_waiting(), "not due yet");
        a.handle_timeout(&mut sh, 2.5);
        assert_eq!(sent(&mut a), ["params 3 v1", "params 4 v1"]);
        assert_eq!(sh.updates().get(&1), Some(&1), "a partial update of one");
        // A fresh round: b's push completes the aggregate and releases a's pull.
        a.handle_frame(&mut sh, &wire::encode_push(5, 1, 1, 8, &[1.5]), 3.0);
        a.handle_frame(&mut sh, &pull(6, 2), 3.0);
        assert!(a.is_waiting());
        b.handle_frame(&mut sh, &wire::encode_push(2, 1, 1, 8, &[3.0]), 3.1);
        a.handle_update(&mut sh, 3.1);
        assert_eq!(sent(&mut a), ["ack 5 v1", "params 6 v2"]);
        assert_eq!(sh.updates().get(&2), Some(&1));
    }

    #[test]
    fn shutdown_says_bye_and_deferred_frames_are_bounded() {
        let mut sh = state(Consistency::Sync { k: 2 }, 1);
        let mut a = ShardSession::new(*sh.config());
        let mut b = ShardSession::new(*sh.config());
        a.handle_frame(&mut sh, &hello(1, 1), 0.0);
        b.handle_frame(&mut sh, &hello(1, 2), 0.0);
        a.handle_frame(&mut sh, &pull(2, 1), 0.0);
        for i in 0..MAX_DEFERRED as u32 + 1 {
            a.handle_frame(&mut sh, &pull(10 + i, 0), 0.0);
        }
        let out = sent(&mut a);
        assert_eq!(out[1..], ["error 74 busy".to_string(), "close".into()]);
        b.shutdown(&mut sh);
        assert_eq!(sent(&mut b), ["welcome 1", "bye", "close"]);
        assert_eq!(sh.connected(), 0);
        // A pull still waiting for the next version fails with shutting_down before the Bye.
        let mut c = ShardSession::new(*sh.config());
        c.handle_frame(&mut sh, &hello(1, 3), 0.0);
        c.handle_frame(&mut sh, &pull(5, 1), 0.0);
        c.shutdown(&mut sh);
        assert_eq!(
            sent(&mut c),
            ["welcome 1", "error 5 shutting_down", "bye", "close"]
        );
        assert_eq!(sh.connected(), 0);
    }

    /// Issue 18: a shard with a budget tells workers that asked its pace in every Params
    /// `aux`: the sum of its sessions' Params frames over its share of the budget, which
    /// follows workers joining and leaving; a worker that did not ask sees 0 and no `paces`.
    #[test]
    fn issue_18_params_carry_the_pace_to_workers_that_asked() {
        let mut setup = setup(Consistency::Async);
        setup.pull_encoding = Encoding::Bf16;
        // 40 of the model's 100 values: a 4,000 B/s share of 10,000 B/s.
        setup.pacing = crate::shard::Pacing {
            budget: crate::shard::EgressBudget::bytes_per_second(10_000.0).unwrap(),
            model_len: 100,
        };
        let range = crate::partition::KeyRange { start: 4, end: 44 };
        let mut sh = setup.state(1, range, vec![0.0; 40]).unwrap();
        let paced_hello = |rid: u32, worker: u64| {
            wire::encode(&Message::Hello {
                request_id: rid,
                shard: 1,
                hello: Hello {
                    worker_id: worker,
                    pull_encodings: vec![Encoding::Bf16],
                    pacing: true,
                    ..Default::default()
                },
            })
        };
        let welcome = |s: &mut ShardSession| {
            let mut out = None;
            while let Some(a) = s.poll_action() {
                if let Action::Send(f) = a {
                    if let Ok(Message::Welcome { welcome, .. }) =
                        wire::decode(&f.to_vec(), usize::MAX)
                    {
                        out = Some(welcome);
                    }
                }
            }
            out.unwrap()
        };
        let pace_of = |s: &mut ShardSession, sh: &mut ShardState, rid: u32| {
            s.handle_frame(sh, &pull(rid, 0), 1.0);
            let mut out = None;
            while let Some(a) = s.poll_action() {
                if let Action::Send(f) = a {
                    if let Ok(Message::Params { pace_ms, .. }) =
                        wire::decode(&f.to_vec(), usize::MAX)
                    {
                        out = Some(pace_ms);
                    }
                }
            }
            out.unwrap()
        };
        let mut a = ShardSession::new(*sh.config());
        a.handle_frame(&mut sh, &paced_hello(1, 7), 0.0);
        assert!(welcome(&mut a).paces);
        // One bf16 frame of 40 values: 32 + 80 bytes; 112 / 4000 s = 28 ms.
        assert_eq!(sh.demand(), 112);
        assert_eq!(pace_of(&mut a, &mut sh, 2), 28);
        // An old worker (f32, no pacing) adds its 32 + 160 bytes but is told nothing.
        let mut b = ShardSession::new(*sh.config());
        b.handle_frame(&mut sh, &hello(1, 8), 0.0);
        assert!(!welcome(&mut b).paces);
        assert_eq!(sh.demand(), 112 + 192);
        assert_eq!(pace_of(&mut b, &mut sh, 2), 0);
        assert_eq!(pace_of(&mut a, &mut sh, 3), 76, "(112 + 192) / 4000 s");
        b.handle_close(&mut sh);
        assert_eq!(sh.demand(), 112);
        assert_eq!(pace_of(&mut a, &mut sh, 4), 28);
        // Without a budget nobody is paced, even a worker that asks.
        let mut off = state(Consistency::Async, 40);
        let mut c = ShardSession::new(*off.config());
        c.handle_frame(&mut off, &paced_hello(1, 9), 0.0);
        assert!(!welcome(&mut c).paces);
        assert_eq!(pace_of(&mut c, &mut off, 2), 0);
    }

    /// Issue 20: a worker that asks gets the samples the shard applied in every Params meta;
    /// one that does not gets none, and a run whose schedule is counted by samples (`auto`
    /// local steps) refuses its Hello, naming what to do.
    #[test]
    fn issue_20_params_state_the_samples_applied_to_workers_that_asked() {
        let counting_hello = |rid: u32, worker: u64| {
            wire::encode(&Message::Hello {
                request_id: rid,
                shard: 1,
                hello: Hello {
                    worker_id: worker,
                    samples: true,
                    ..Default::default()
                },
            })
        };
        let replies = |s: &mut ShardSession| {
            let mut out = Vec::new();
            while let Some(a) = s.poll_action() {
                if let Action::Send(f) = a {
                    let f = f.to_vec();
                    match wire::decode(&f, usize::MAX).unwrap() {
                        Message::Welcome { welcome, .. } => {
                            out.push(format!("welcome samples={}", welcome.samples))
                        }
                        Message::Params {
                            version, samples, ..
                        } => out.push(format!("params v{version} {samples:?}")),
                        Message::Ack { version, .. } => out.push(format!("ack v{version}")),
                        Message::Error { error, .. } => {
                            out.push(format!("error {}", error.code.name()));
                            assert!(error.message.contains("\"samples\": true"), "{error:?}");
                        }
                        other => out.push(format!("{other:?}")),
                    }
                }
            }
            out
        };
        let mut sh = state(Consistency::Async, 2);
        let mut a = ShardSession::new(*sh.config());
        a.handle_frame(&mut sh, &counting_hello(1, 7), 0.0);
        a.handle_frame(&mut sh, &pull(2, 0), 0.0);
        a.handle_frame(&mut sh, &push(3, 0, &[1.0, 1.0]), 0.0);
        a.handle_frame(&mut sh, &pull(4, 0), 0.0);
        assert_eq!(
            replies(&mut a),
            [
                "welcome samples=true",
                "params v0 Some(0)",
                "ack v1",
                "params v1 Some(8)"
            ]
        );
        let mut b = ShardSession::new(*sh.config());
        b.handle_frame(&mut sh, &hello(1, 8), 0.0);
        b.handle_frame(&mut sh, &pull(2, 0), 0.0);
        assert_eq!(replies(&mut b), ["welcome samples=false", "params v1 None"]);
        // A counted run: the old Hello is refused (fatal), the new one welcomed.
        let mut setup = setup(Consistency::Async);
        setup.counted = true;
        let range = crate::partition::KeyRange { start: 0, end: 2 };
        let mut sh = setup.state(1, range, vec![0.0; 2]).unwrap();
        let mut c = ShardSession::new(*sh.config());
        c.handle_frame(&mut sh, &hello(1, 9), 0.0);
        assert_eq!(replies(&mut c), ["error protocol"]);
        assert_eq!(sh.connected(), 0);
        let mut d = ShardSession::new(*sh.config());
        d.handle_frame(&mut sh, &counting_hello(1, 9), 0.0);
        assert_eq!(replies(&mut d), ["welcome samples=true"]);
    }
}
