//! Tests of [`super`] (conn.rs).

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
                if let Ok(Message::Welcome { welcome, .. }) = wire::decode(&f.to_vec(), usize::MAX)
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
                if let Ok(Message::Params { pace_ms, .. }) = wire::decode(&f.to_vec(), usize::MAX) {
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
