//! Tests of [`super`] (worker.rs).

use super::*;
use crate::data::encode_idx;
use crate::optim::OptimizerConfig;
use crate::partition::KeyRange;
use crate::spec::{DataInfo, PartitionInfo, RunParams, RunSpec};
use crate::wire::ErrorCode;
use crate::wire::{Bye, Welcome};

/// A softmax over 2x2 "images" with 3 classes: 15 parameters, cut into `shards`.
fn join(consistency: &str, shards: usize) -> JoinResponse {
    JoinResponse {
        protocol: PROTOCOL_VERSION,
        worker_id: 42,
        run: RunSpec::build(RunParams {
            run_id: "test".into(),
            model: "softmax".into(),
            optimizer: OptimizerConfig::default(),
            batch_size: 2,
            seed: 1,
            consistency: Consistency::parse(consistency).unwrap(),
            shards,
            dataset: DataInfo {
                name: "toy".into(),
                image_dims: vec![2, 2],
                classes: 3,
                train_len: 6,
                test_len: 0,
                text: None,
            },
            local: crate::local::LocalConfig::default(),
            normalize: Default::default(),
        })
        .unwrap(),
        partition: PartitionInfo {
            index: 0,
            count: 1,
            examples: 6,
            images: "/images".into(),
            labels: "/labels".into(),
        },
        credential: None,
    }
}

fn data() -> Dataset {
    let pixels: Vec<u8> = (0..6 * 4).map(|i| (i * 10) as u8).collect();
    Dataset::from_idx(
        &encode_idx(&[6, 2, 2], &pixels),
        &encode_idx(&[6], &[0, 1, 2, 0, 1, 2]),
    )
    .unwrap()
}

fn local_worker(local: crate::local::LocalConfig, shards: usize, max: Option<u64>) -> Worker {
    let mut j = join("async", shards);
    j.run.local = local;
    Worker::new(j, data(), ClientKind::Native, max).unwrap()
}

fn worker(consistency: &str, shards: usize, max_steps: Option<u64>) -> Worker {
    Worker::new(
        join(consistency, shards),
        data(),
        ClientKind::Native,
        max_steps,
    )
    .unwrap()
}

/// Issue 12: the worker preprocesses its batches as the run spec's normalisation says.
#[test]
fn worker_normalises_its_batches_as_the_run_says() {
    let mut j = join("async", 1);
    j.run.normalize = crate::data::Normalize::parse("0.5/0.25").unwrap();
    let w = Worker::new(j, data(), ClientKind::Native, None).unwrap();
    let mut x = Array2::zeros((1, 4));
    let mut y = [0u8];
    w.data.fill_batch(&[1], &mut x.view_mut(), &mut y);
    // Example 1 holds the pixels 40, 50, 60, 70.
    for (v, p) in x.iter().zip([40.0f32, 50.0, 60.0, 70.0]) {
        assert!((v - (p / 255.0 - 0.5) / 0.25).abs() < 1e-6, "{v} for {p}");
    }
    // A normalisation for 3 channels does not fit 1-channel images.
    let mut j = join("async", 1);
    j.run.normalize = crate::data::Normalize::parse("0.1,0.2,0.3/1").unwrap();
    assert!(Worker::new(j, data(), ClientKind::Native, None).is_err());
}

fn range(w: &Worker, shard: usize) -> KeyRange {
    w.join_info().run.shards[shard].range
}

/// Everything the worker wants to send, decoded (header fields and metas).
#[derive(Debug, Clone, PartialEq)]
enum Sent {
    Hello(usize, u32, Hello),
    Pull(usize, u32, u64),
    Push {
        shard: usize,
        request_id: u32,
        base_version: u64,
        samples: u32,
        len: usize,
    },
}

fn drain(w: &mut Worker) -> Vec<Sent> {
    std::iter::from_fn(|| w.poll_transmit())
        .map(|o| {
            let msg = wire::decode(&o.frame, usize::MAX).unwrap();
            match msg {
                Message::Hello {
                    request_id,
                    shard,
                    hello,
                } => {
                    assert_eq!(shard as usize, o.shard);
                    Sent::Hello(o.shard, request_id, hello)
                }
                Message::Pull {
                    request_id,
                    shard,
                    min_version,
                } => {
                    assert_eq!(shard as usize, o.shard);
                    Sent::Pull(o.shard, request_id, min_version)
                }
                Message::Push {
                    request_id,
                    shard,
                    base_version,
                    samples,
                    grad,
                } => {
                    assert_eq!(shard as usize, o.shard);
                    Sent::Push {
                        shard: o.shard,
                        request_id,
                        base_version,
                        samples,
                        len: grad.len(),
                    }
                }
                other => panic!("a worker sent {other:?}"),
            }
        })
        .collect()
}

fn pulls(sent: &[Sent]) -> Vec<(usize, u32, u64)> {
    sent.iter()
        .filter_map(|s| match s {
            Sent::Pull(shard, id, min) => Some((*shard, *id, *min)),
            _ => None,
        })
        .collect()
}

fn welcome_frame(w: &Worker, shard: usize, version: u64) -> Vec<u8> {
    wire::encode(&Message::Welcome {
        request_id: 1,
        shard: shard as u32,
        welcome: Welcome {
            protocol: PROTOCOL_VERSION,
            range: range(w, shard),
            version,
            pull_encoding: Default::default(),
            push_encoding: Default::default(),
            reports: false,
            spot_checks: false,
            paces: false,
            samples: false,
        },
    })
}

/// `Params` answering `request_id`, every value `fill`.
fn params_frame(w: &Worker, shard: usize, request_id: u32, version: u64, fill: f32) -> Vec<u8> {
    let values = vec![fill; range(w, shard).len()];
    wire::encode_params(request_id, shard as u32, version, &values)
}

fn ack_frame(shard: usize, request_id: u32, version: u64, staleness: u32) -> Vec<u8> {
    wire::encode(&Message::Ack {
        request_id,
        shard: shard as u32,
        version,
        staleness,
    })
}

fn error_frame(shard: usize, request_id: u32, code: ErrorCode) -> Vec<u8> {
    wire::encode_error(
        request_id,
        shard as u32,
        code,
        format!("{} here", code.name()),
    )
}

/// Connects and welcomes every shard at `versions`; returns the pulls that went out.
fn handshake(w: &mut Worker, versions: &[u64]) -> Vec<(usize, u32, u64)> {
    for shard in 0..w.shard_count() {
        w.connected(shard);
    }
    drain(w);
    for (shard, &v) in versions.iter().enumerate() {
        let f = welcome_frame(w, shard, v);
        w.receive(shard, &f).unwrap();
    }
    pulls(&drain(w))
}

/// Answers `pulls` with `Params` at `versions` (by shard).
fn answer(w: &mut Worker, pulls: &[(usize, u32, u64)], versions: &[u64]) {
    for &(shard, id, _) in pulls {
        let f = params_frame(w, shard, id, versions[shard], 0.5);
        w.receive(shard, &f).unwrap();
    }
}

/// The pushes of `sent`: (shard, request id, base version).
fn pushes(sent: &[Sent]) -> Vec<(usize, u32, u64)> {
    sent.iter()
        .filter_map(|s| match s {
            Sent::Push {
                shard,
                request_id,
                base_version,
                ..
            } => Some((*shard, *request_id, *base_version)),
            _ => None,
        })
        .collect()
}

#[test]
fn connecting_sends_hello_with_the_join() {
    let mut w = worker("async", 2, None);
    assert_eq!(w.shard_count(), 2);
    assert!(w.poll_transmit().is_none());
    w.connected(1);
    let sent = drain(&mut w);
    let [Sent::Hello(1, id, hello)] = &sent[..] else {
        panic!("{sent:?}")
    };
    assert_ne!(*id, 0);
    assert_eq!(
        *hello,
        Hello {
            protocol: PROTOCOL_VERSION,
            worker_id: 42,
            client: ClientKind::Native,
            pull_encodings: vec![Encoding::INT8, Encoding::Bf16, Encoding::F32],
            push_encodings: vec![Encoding::INT8, Encoding::Bf16, Encoding::F32],
            credential: None,
            pacing: true,
            samples: true,
        }
    );
    // A connection to a shard the run does not have is ignored.
    w.connected(7);
    assert!(drain(&mut w).is_empty());
}

#[test]
fn pulls_go_to_every_shard_once_all_welcomed() {
    let mut w = worker("async", 3, None);
    for shard in 0..3 {
        w.connected(shard);
    }
    drain(&mut w);
    for shard in 0..2 {
        let f = welcome_frame(&w, shard, 5);
        w.receive(shard, &f).unwrap();
        // Nothing is pulled until every shard is ready: a step needs all of them.
        assert!(drain(&mut w).is_empty());
    }
    let f = welcome_frame(&w, 2, 5);
    w.receive(2, &f).unwrap();
    let p = pulls(&drain(&mut w));
    assert_eq!(p.iter().map(|p| p.0).collect::<Vec<_>>(), vec![0, 1, 2]);
    assert!(p.iter().all(|p| p.2 == 0), "async pulls ask for no version");
    let mut ids: Vec<u32> = p.iter().map(|p| p.1).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 3, "request ids are distinct");
    assert!(!w.ready());
}

#[test]
fn steps_only_when_every_shards_params_arrived() {
    let mut w = worker("async", 2, None);
    let p = handshake(&mut w, &[0, 0]);
    assert!(matches!(w.step(), Err(Error::Protocol(_))));
    let f = params_frame(&w, 0, p[0].1, 3, 0.25);
    w.receive(0, &f).unwrap();
    assert!(!w.ready());
    assert!(w.step().is_err());
    let f = params_frame(&w, 1, p[1].1, 7, 0.75);
    w.receive(1, &f).unwrap();
    assert!(w.ready());
    // The parameters are assembled from both slices.
    let (r0, r1) = (range(&w, 0), range(&w, 1));
    assert!(w.params()[..r0.len()].iter().all(|&v| v == 0.25));
    assert!(w.params()[r0.len()..r0.len() + r1.len()]
        .iter()
        .all(|&v| v == 0.75));
    let report = w.step().unwrap();
    assert_eq!(report.samples, 2);
    assert!(report.loss.is_finite() && report.loss > 0.0);
    assert!(!w.ready(), "the next step needs fresh parameters");
    assert!(w.step().is_err());
    let s = w.stats();
    assert_eq!((s.steps, s.samples, s.pushes_sent), (1, 2, 2));
    assert_eq!(s.read_skew, 4);
    assert_eq!(s.last_loss, report.loss);
    assert_eq!(s.ema_loss, report.loss);
}

#[test]
fn pushes_carry_the_pulled_version_then_pull_again() {
    let mut w = worker("async", 2, None);
    let p = handshake(&mut w, &[0, 0]);
    answer(&mut w, &p, &[3, 9]);
    w.step().unwrap();
    let sent = drain(&mut w);
    // Every push goes out before the next pulls (a shard orders one connection's frames,
    // so the next pull sees this worker's own push).
    assert_eq!(sent.len(), 4, "{sent:?}");
    let (first, second) = sent.split_at(2);
    let mut push_ids = Vec::new();
    for (shard, s) in first.iter().enumerate() {
        let Sent::Push {
            shard: to,
            request_id,
            base_version,
            samples,
            len,
        } = s
        else {
            panic!("{s:?}")
        };
        assert_eq!(*to, shard);
        assert_eq!(*base_version, [3, 9][shard]);
        assert_eq!(*samples, 2);
        assert_eq!(*len, range(&w, shard).len());
        push_ids.push(*request_id);
    }
    let again = pulls(second);
    assert_eq!(again.iter().map(|p| p.0).collect::<Vec<_>>(), vec![0, 1]);
    assert!(again.iter().all(|p| p.2 == 0));
    let old: Vec<u32> = p.iter().map(|p| p.1).collect();
    for id in push_ids.iter().chain(again.iter().map(|p| &p.1)) {
        assert!(!old.contains(id), "request id {id} reused");
    }
    // A second step reads the new versions.
    answer(&mut w, &again, &[4, 11]);
    w.step().unwrap();
    let bases: Vec<u64> = pushes(&drain(&mut w)).iter().map(|p| p.2).collect();
    assert_eq!(bases, vec![4, 11]);
    assert_eq!(w.stats().pushes_sent, 4);
    assert_eq!(w.stats().read_skew, 7);
}

/// The defences issue: request ids wrap. A worker whose ids pass `u32::MAX` keeps pushing
/// to a real shard session: its ids run ..., `u32::MAX`, 1, 2, ... (never 0, which means
/// "no request"), every reply is matched, and no push is refused as `replayed`.
#[test]
fn request_ids_wrap_past_u32_max_and_pushes_go_on() {
    use crate::session::{Action, PushGuard, ShardConfig, ShardSession, ShardSetup};
    let mut w = worker("async", 1, None);
    w.next_request = u32::MAX - 3;
    let range = range(&w, 0);
    let setup = ShardSetup {
        optimizer: OptimizerConfig::default(),
        staleness: crate::shard::StalenessPolicy::default(),
        consistency: Consistency::Async,
        heartbeat: 5.0,
        sync_timeout: 2.0,
        pull_encoding: Encoding::F32,
        push_encoding: Encoding::F32,
        reports: false,
        pseudo_gradients: false,
        guard: PushGuard::default(),
        aggregation: crate::robust::Aggregation::Mean,
        pacing: crate::shard::Pacing::OFF,
        counted: false,
        average: None,
    };
    let mut state = setup.state(0, range, vec![0.0; range.len()]).unwrap();
    let mut session = ShardSession::new(ShardConfig {
        id: 0,
        range,
        setup,
    });
    w.connected(0);
    let mut ids = Vec::new();
    let mut now = 0.0;
    while w.stats().pushes_accepted < 8 {
        now += 0.01;
        assert!(
            now < 10.0,
            "stuck: {} frames, the first {:?}",
            ids.len(),
            &ids[..8]
        );
        while let Some(o) = w.poll_transmit() {
            ids.push(crate::session::header_request_id(&o.frame));
            session.handle_frame(&mut state, &o.frame, now);
            while let Some(a) = session.poll_action() {
                match a {
                    Action::Send(f) => w.receive(0, &f.to_vec()).unwrap(),
                    Action::Close(why) => panic!("closed: {why}"),
                    Action::Record(_) => {}
                }
            }
        }
        if w.ready() {
            w.step().unwrap();
        }
    }
    assert!(!ids.contains(&0), "{ids:?}");
    let wrap = ids
        .iter()
        .position(|&id| id == u32::MAX)
        .expect("reaches u32::MAX");
    assert_eq!(ids[wrap + 1], 1, "{ids:?}");
    assert_eq!(w.stats().pushes_rejected, 0);
    assert_eq!(state.version(), w.stats().pushes_accepted);
}

#[test]
fn acks_count_accepted_pushes_and_staleness() {
    let mut w = worker("async", 2, None);
    let p = handshake(&mut w, &[0, 0]);
    answer(&mut w, &p, &[0, 0]);
    w.step().unwrap();
    let ps = pushes(&drain(&mut w));
    w.receive(0, &ack_frame(0, ps[0].1, 1, 0)).unwrap();
    w.receive(1, &ack_frame(1, ps[1].1, 4, 3)).unwrap();
    let s = w.stats();
    assert_eq!(s.pushes_accepted, 2);
    assert_eq!(
        (s.last_staleness, s.max_staleness, s.staleness_sum),
        (3, 3, 3)
    );
    // A second Ack for the same shard has no push to answer.
    let e = w.receive(0, &ack_frame(0, ps[0].1, 2, 0)).unwrap_err();
    assert!(matches!(e, Error::Protocol(_)), "{e}");
}

#[test]
fn too_stale_and_busy_are_not_fatal() {
    let mut w = worker("async", 2, Some(1));
    let p = handshake(&mut w, &[0, 0]);
    answer(&mut w, &p, &[0, 0]);
    w.step().unwrap();
    let ps = pushes(&drain(&mut w));
    assert!(!w.is_done(), "pushes are in flight");
    w.receive(0, &error_frame(0, ps[0].1, ErrorCode::TooStale))
        .unwrap();
    let s = w.stats();
    assert_eq!((s.pushes_rejected, s.pushes_accepted), (1, 0));
    // A policy refusal is counted by reason, not reported as an error (issue 19).
    assert_eq!(s.last_error, None);
    assert_eq!(s.rejected_by_reason["too_stale"], 1);
    w.receive(1, &error_frame(1, ps[1].1, ErrorCode::Busy))
        .unwrap();
    assert_eq!(w.stats().pushes_rejected, 2);
    assert_eq!(w.stats().rejected_by_reason["busy"], 1);
    assert_eq!(w.stats().last_error, None);
    // Both pushes are answered: the one-step worker is done.
    assert!(w.is_done());
}

#[test]
fn fatal_error_frames_end_the_session() {
    for code in [
        ErrorCode::Malformed,
        ErrorCode::WrongLength,
        ErrorCode::WrongShard,
        ErrorCode::FutureVersion,
        ErrorCode::ProtocolVersion,
        ErrorCode::UnknownWorker,
        ErrorCode::ShuttingDown,
    ] {
        let mut w = worker("async", 2, None);
        handshake(&mut w, &[0, 0]);
        let e = w.receive(1, &error_frame(1, 0, code)).unwrap_err();
        assert!(matches!(e, Error::Protocol(_)), "{code:?}: {e}");
        assert!(e.to_string().contains("shard 1"), "{e}");
        let last = w.stats().last_error.clone().unwrap();
        assert!(last.contains(code.name()), "{last}");
        assert_eq!(
            w.stats().pushes_rejected,
            0,
            "{code:?} is not a rejected push"
        );
    }
}

#[test]
fn bad_frames_from_a_shard_are_errors_not_panics() {
    let mut w = worker("async", 2, None);
    let p = handshake(&mut w, &[0, 0]);
    // Garbage and truncated frames.
    assert!(w.receive(0, b"not a frame").is_err());
    let good = params_frame(&w, 0, p[0].1, 1, 0.0);
    assert!(w.receive(0, &good[..good.len() - 1]).is_err());
    // Params of the wrong length for the shard.
    let short = wire::encode_params(p[0].1, 0, 1, &[0.0; 2]);
    assert!(w.receive(0, &short).is_err());
    // NaN parameters.
    let nan = wire::encode_params(p[0].1, 0, 1, &vec![f32::NAN; range(&w, 0).len()]);
    assert!(w.receive(0, &nan).is_err());
    // Params nobody asked for.
    let stray = params_frame(&w, 0, p[0].1 + 100, 1, 0.0);
    assert!(w.receive(0, &stray).is_err());
    // A frame on a connection the run does not have.
    assert!(w.receive(5, &good).is_err());
    // A second Welcome.
    let again = welcome_frame(&w, 0, 0);
    assert!(w.receive(0, &again).is_err());
    // Worker-side messages.
    let pull = wire::encode(&Message::Pull {
        request_id: 1,
        shard: 0,
        min_version: 0,
    });
    assert!(w.receive(0, &pull).is_err());
    let push = wire::encode_push(1, 0, 0, 1, &vec![0.0; range(&w, 0).len()]);
    assert!(w.receive(0, &push).is_err());
    // None of that disturbed the outstanding pull: the real answer still lands.
    w.receive(0, &good).unwrap();
}

#[test]
fn welcome_must_match_the_run() {
    let mut w = worker("async", 2, None);
    w.connected(0);
    w.connected(1);
    // Before a Hello there is nothing to welcome.
    let mut fresh = worker("async", 2, None);
    let f = welcome_frame(&fresh, 0, 0);
    assert!(fresh.receive(0, &f).is_err());
    // Wrong range.
    let bad_range = wire::encode(&Message::Welcome {
        request_id: 1,
        shard: 0,
        welcome: Welcome {
            protocol: PROTOCOL_VERSION,
            range: range(&w, 1),
            version: 0,
            pull_encoding: Default::default(),
            push_encoding: Default::default(),
            reports: false,
            spot_checks: false,
            paces: false,
            samples: false,
        },
    });
    assert!(matches!(w.receive(0, &bad_range), Err(Error::Protocol(_))));
    // Wrong protocol.
    let bad_protocol = wire::encode(&Message::Welcome {
        request_id: 1,
        shard: 0,
        welcome: Welcome {
            protocol: PROTOCOL_VERSION + 1,
            range: range(&w, 0),
            version: 0,
            pull_encoding: Default::default(),
            push_encoding: Default::default(),
            reports: false,
            spot_checks: false,
            paces: false,
            samples: false,
        },
    });
    assert!(matches!(
        w.receive(0, &bad_protocol),
        Err(Error::ProtocolVersion { .. })
    ));
}

#[test]
fn bye_is_noted_not_fatal() {
    let mut w = worker("async", 2, None);
    handshake(&mut w, &[0, 0]);
    let bye = wire::encode(&Message::Bye {
        shard: 0,
        bye: Bye {
            reason: "restarting".into(),
        },
    });
    w.receive(0, &bye).unwrap();
    let last = w.stats().last_error.clone().unwrap();
    assert!(
        last.contains("bye") && last.contains("restarting"),
        "{last}"
    );
}

#[test]
fn an_applied_push_clears_the_last_error() {
    let mut w = worker("async", 2, None);
    let p = handshake(&mut w, &[0, 0]);
    let bye = wire::encode(&Message::Bye {
        shard: 1,
        bye: Bye {
            reason: "restarting".into(),
        },
    });
    w.receive(1, &bye).unwrap();
    assert!(w.stats().last_error.is_some());
    answer(&mut w, &p, &[0, 0]);
    w.step().unwrap();
    let ps = pushes(&drain(&mut w));
    w.receive(0, &ack_frame(0, ps[0].1, 1, 0)).unwrap();
    assert_eq!(w.stats().last_error, None, "the round after went through");
}

#[test]
fn disconnect_counts_unanswered_pushes_as_lost() {
    let mut w = worker("async", 2, None);
    let p = handshake(&mut w, &[0, 0]);
    answer(&mut w, &p, &[0, 0]);
    w.step().unwrap();
    // Shard 0 closes before its push and pull were even sent: both are dropped.
    w.disconnected(0);
    let sent = drain(&mut w);
    assert!(
        sent.iter()
            .all(|s| !matches!(s, Sent::Push { shard: 0, .. } | Sent::Pull(0, ..))),
        "{sent:?}"
    );
    assert_eq!(pushes(&sent).len(), 1);
    let s = w.stats();
    assert_eq!((s.pushes_sent, s.pushes_lost), (2, 1));
    // An answered push is not lost.
    let ps = pushes(&sent);
    w.receive(1, &ack_frame(1, ps[0].1, 1, 0)).unwrap();
    w.disconnected(1);
    assert_eq!(w.stats().pushes_lost, 1);
    assert_eq!(w.stats().pushes_accepted, 1);
    assert!(!w.ready());
    // A late frame on a closed connection is a protocol error, not a panic.
    let late = params_frame(&w, 1, 99, 1, 0.0);
    assert!(w.receive(1, &late).is_err());
}

#[test]
fn reconnect_handshakes_again_and_resumes() {
    let mut w = worker("async", 2, None);
    let p = handshake(&mut w, &[0, 0]);
    answer(&mut w, &p, &[0, 0]);
    w.step().unwrap();
    let sent = drain(&mut w);
    let again = pulls(&sent);
    // Shard 1 answers its pull; shard 0 drops: the round goes on with shard 0's last
    // values and pushes to shard 1 only.
    let f = params_frame(&w, 1, again[1].1, 1, 0.5);
    w.receive(1, &f).unwrap();
    w.disconnected(0);
    assert_eq!(w.stats().pushes_lost, 1);
    assert!(w.ready());
    w.step().unwrap();
    let sent = drain(&mut w);
    assert_eq!(pushes(&sent), vec![(1, pushes(&sent)[0].1, 1)]);
    let p1 = pulls(&sent);
    assert_eq!(p1.len(), 1);
    // Reconnect shard 0: Hello, then after the Welcome a pull to shard 0 (a round is not
    // in progress: shard 1's pull is still out).
    w.connected(0);
    assert!(matches!(&drain(&mut w)[..], [Sent::Hello(0, ..)]));
    let f = welcome_frame(&w, 0, 2);
    w.receive(0, &f).unwrap();
    let p0 = pulls(&drain(&mut w));
    assert_eq!(p0.len(), 1);
    assert_eq!(p0[0].0, 0);
    let f = params_frame(&w, 0, p0[0].1, 2, 0.5);
    w.receive(0, &f).unwrap();
    // Both shards again: the round waits for shard 1's answer too.
    assert!(!w.ready());
    let f = params_frame(&w, 1, p1[0].1, 3, 0.5);
    w.receive(1, &f).unwrap();
    assert!(w.ready());
    w.step().unwrap();
    let bases: Vec<u64> = pushes(&drain(&mut w)).iter().map(|p| p.2).collect();
    assert_eq!(bases, vec![2, 3]);
    assert_eq!(w.stats().steps, 3);
}

#[test]
fn a_dead_shard_does_not_stall_the_others() {
    let mut w = worker("async", 2, None);
    let p = handshake(&mut w, &[0, 0]);
    answer(&mut w, &p, &[5, 7]);
    let before = w.params().to_vec();
    // Shard 1 dies before the round's push: rounds keep going on shard 0 alone, shard
    // 1's slice stays at its last values and nothing is pushed or pulled there.
    w.disconnected(1);
    for round in 0..3u64 {
        assert!(w.ready(), "round {round}");
        w.step().unwrap();
        let sent = drain(&mut w);
        let ps = pushes(&sent);
        assert_eq!(ps.len(), 1, "{sent:?}");
        assert_eq!((ps[0].0, ps[0].2), (0, 5 + round));
        let pl = pulls(&sent);
        assert_eq!(pl.iter().map(|p| p.0).collect::<Vec<_>>(), vec![0]);
        w.receive(0, &ack_frame(0, ps[0].1, 6 + round, 0)).unwrap();
        let f = params_frame(&w, 0, pl[0].1, 6 + round, 0.25);
        w.receive(0, &f).unwrap();
    }
    let r1 = range(&w, 1);
    assert_eq!(w.params()[r1.start..r1.end], before[r1.start..r1.end]);
    let s = w.stats();
    assert_eq!((s.rounds, s.pushes_sent, s.pushes_accepted), (3, 3, 3));
    // A shard in the middle of its handshake is not pushed to either.
    w.connected(1);
    let sent = drain(&mut w);
    assert!(matches!(&sent[..], [Sent::Hello(1, ..)]), "{sent:?}");
    w.step().unwrap();
    assert!(pushes(&drain(&mut w)).iter().all(|p| p.0 == 0));
    // All shards down: no round.
    w.disconnected(0);
    w.disconnected(1);
    assert!(!w.ready());
}

#[test]
fn the_first_round_waits_for_every_shard() {
    let mut w = worker("async", 2, None);
    let p = handshake(&mut w, &[0, 0]);
    // Shard 1 never answered: its slice has no values yet, so no round without it.
    w.receive(0, &params_frame(&w, 0, p[0].1, 0, 0.5)).unwrap();
    w.disconnected(1);
    assert!(!w.ready());
}

#[test]
fn sync_mode_pulls_one_past_the_version_pushed_to() {
    let mut w = worker("sync:2", 2, None);
    let p = handshake(&mut w, &[0, 0]);
    assert!(
        p.iter().all(|p| p.2 == 0),
        "the first pull takes what is there"
    );
    answer(&mut w, &p, &[5, 6]);
    w.step().unwrap();
    let sent = drain(&mut w);
    let mins: Vec<u64> = pulls(&sent).iter().map(|p| p.2).collect();
    assert_eq!(mins, vec![6, 7]);
    // A reconnect forgets the wait: the new connection's first pull takes what is there.
    w.disconnected(0);
    w.connected(0);
    drain(&mut w);
    let f = welcome_frame(&w, 0, 6);
    w.receive(0, &f).unwrap();
    let p0 = pulls(&drain(&mut w));
    assert_eq!(p0, vec![(0, p0[0].1, 0)]);
    // SSP and async never ask for a version.
    let mut ssp = worker("ssp:2", 2, None);
    let p = handshake(&mut ssp, &[0, 0]);
    answer(&mut ssp, &p, &[5, 6]);
    ssp.step().unwrap();
    assert!(pulls(&drain(&mut ssp)).iter().all(|p| p.2 == 0));
}

#[test]
fn max_steps_stops_pulling_and_waits_for_answers() {
    let mut w = worker("async", 2, Some(1));
    let p = handshake(&mut w, &[0, 0]);
    answer(&mut w, &p, &[0, 0]);
    assert!(!w.is_done());
    w.step().unwrap();
    let sent = drain(&mut w);
    assert!(
        pulls(&sent).is_empty(),
        "no pull after the last step: {sent:?}"
    );
    assert!(!w.ready());
    assert!(w.step().is_err());
    let ps = pushes(&sent);
    w.receive(0, &ack_frame(0, ps[0].1, 1, 0)).unwrap();
    assert!(!w.is_done(), "one push still in flight");
    // A lost push counts as answered for is_done.
    w.disconnected(1);
    assert!(w.is_done());
    // Zero steps: done at once, and nothing is pulled.
    let mut none = worker("async", 2, Some(0));
    assert!(handshake(&mut none, &[0, 0]).is_empty());
    assert!(none.is_done());
}

#[test]
fn carried_stats_keep_counting() {
    let mut w = worker("async", 1, None);
    let before = WorkerStats {
        steps: 10,
        samples: 20,
        pushes_sent: 10,
        pushes_lost: 3,
        ema_loss: 1.0,
        ..WorkerStats::default()
    };
    w.carry_stats(before);
    let p = handshake(&mut w, &[0]);
    answer(&mut w, &p, &[0]);
    let report = w.step().unwrap();
    let s = w.stats();
    assert_eq!(
        (s.steps, s.samples, s.pushes_sent, s.pushes_lost),
        (11, 22, 11, 3)
    );
    // The loss average continues from the carried value.
    assert!((s.ema_loss - (0.98 + 0.02 * report.loss)).abs() < 1e-12);
}

/// The defences issue: a Report says what this session measured, so a worker that carried
/// 500 s of compute over from its last join does not report them again to its new id.
#[test]
fn reports_after_carried_stats_count_this_session_only() {
    let mut w = worker("async", 1, None);
    w.carry_stats(WorkerStats {
        compute_s: 500.0,
        bytes_up: 1_000,
        bytes_down: 2_000,
        ..WorkerStats::default()
    });
    w.connected(0);
    drain(&mut w);
    let welcome = wire::encode(&Message::Welcome {
        request_id: 1,
        shard: 0,
        welcome: Welcome {
            protocol: PROTOCOL_VERSION,
            range: range(&w, 0),
            version: 0,
            pull_encoding: Default::default(),
            push_encoding: Default::default(),
            reports: true,
            spot_checks: false,
            paces: false,
            samples: false,
        },
    });
    w.set_time(0.0);
    w.receive(0, &welcome).unwrap();
    w.observe_compute(0.25);
    w.set_time(2.0);
    let reports: Vec<Report> = frames(&mut w)
        .iter()
        .filter_map(|(_, f)| match wire::decode(f, usize::MAX).unwrap() {
            Message::Report { report, .. } => Some(report),
            _ => None,
        })
        .collect();
    let [r] = &reports[..] else {
        panic!("{reports:?}")
    };
    assert_eq!(r.compute_s, 0.25);
    assert_eq!(r.wall_s, 2.0);
    assert!(r.bytes_up < 1_000, "{r:?}");
    assert_eq!(w.stats().compute_s, 500.25, "the stats go on counting");
}

#[test]
fn the_browser_says_so_in_hello() {
    let mut w = Worker::new(join("async", 1), data(), ClientKind::Browser, None).unwrap();
    w.connected(0);
    let sent = drain(&mut w);
    assert!(matches!(&sent[..], [Sent::Hello(0, _, h)] if h.client == ClientKind::Browser));
}

#[test]
fn new_rejects_what_cannot_train() {
    let mut j = join("async", 2);
    j.protocol += 1;
    assert!(matches!(
        Worker::new(j, data(), ClientKind::Native, None),
        Err(Error::ProtocolVersion { .. })
    ));
    // Images of the wrong size for the model.
    let pixels = vec![0u8; 6 * 9];
    let wrong =
        Dataset::from_idx(&encode_idx(&[6, 3, 3], &pixels), &encode_idx(&[6], &[0; 6])).unwrap();
    assert!(matches!(
        Worker::new(join("async", 2), wrong, ClientKind::Native, None),
        Err(Error::Config(_))
    ));
    // Labels past the model's classes.
    let pixels = vec![0u8; 2 * 4];
    let many =
        Dataset::from_idx(&encode_idx(&[2, 2, 2], &pixels), &encode_idx(&[2], &[0, 7])).unwrap();
    assert!(matches!(
        Worker::new(join("async", 2), many, ClientKind::Native, None),
        Err(Error::Data(_))
    ));
    // An unknown consistency mode never reaches a worker: the join reply does not decode.
    let mut json = serde_json::to_value(join("async", 2)).unwrap();
    json["run"]["consistency"] = "eventually".into();
    assert!(serde_json::from_value::<JoinResponse>(json).is_err());
}

use crate::local::{LocalConfig, LocalSteps};

fn frames(w: &mut Worker) -> Vec<(usize, Vec<u8>)> {
    std::iter::from_fn(|| w.poll_transmit())
        .map(|o| (o.shard, o.frame))
        .collect()
}

#[test]
fn pushes_to_a_spot_checking_shard_carry_the_rounds_first_batch_and_versions() {
    let local = LocalConfig {
        steps: LocalSteps::Fixed(3),
        ..LocalConfig::default()
    };
    let mut w = local_worker(local, 2, None);
    for shard in 0..2 {
        w.connected(shard);
    }
    drain(&mut w);
    // Shard 0 spot-checks, shard 1 does not.
    for (shard, version) in [(0usize, 4u64), (1, 9)] {
        let f = wire::encode(&Message::Welcome {
            request_id: 1,
            shard: shard as u32,
            welcome: Welcome {
                protocol: PROTOCOL_VERSION,
                range: range(&w, shard),
                version,
                pull_encoding: Default::default(),
                push_encoding: Default::default(),
                reports: false,
                spot_checks: shard == 0,
                paces: false,
                samples: false,
            },
        });
        w.receive(shard, &f).unwrap();
    }
    let mut p = pulls(&drain(&mut w));
    for round in 0..2u64 {
        answer(&mut w, &p, &[4, 9]);
        for _ in 0..3 {
            w.step().unwrap();
        }
        let out = frames(&mut w);
        let tags: Vec<(usize, Option<wire::PushTag>)> = out
            .iter()
            .filter(|(_, f)| matches!(wire::decode(f, usize::MAX), Ok(Message::Push { .. })))
            .map(|(shard, f)| (*shard, wire::push_tag(f).unwrap()))
            .collect();
        let want = wire::PushTag {
            batch: 3 * round,
            versions: vec![4, 9],
        };
        assert_eq!(tags, vec![(0, Some(want)), (1, None)], "round {round}");
        p = out
            .iter()
            .filter_map(|(shard, f)| match wire::decode(f, usize::MAX) {
                Ok(Message::Pull {
                    request_id,
                    min_version,
                    ..
                }) => Some((*shard, request_id, min_version)),
                _ => None,
            })
            .collect();
    }
}

#[test]
fn local_steps_push_the_pseudo_gradient_after_h_inner_steps() {
    let local = LocalConfig {
        steps: LocalSteps::Fixed(3),
        ..LocalConfig::default()
    };
    let mut w = local_worker(local, 2, None);
    let p = handshake(&mut w, &[4, 9]);
    answer(&mut w, &p, &[4, 9]);
    let pulled = w.params().to_vec();
    assert!(pulled.iter().all(|&v| v == 0.5));
    for i in 0..3 {
        assert!(w.ready());
        let r = w.step().unwrap();
        assert_eq!(r.pushed, i == 2, "the round ends after H = 3 inner steps");
        if i < 2 {
            assert!(drain(&mut w).is_empty(), "nothing goes out mid-round");
        }
    }
    let local_params = w.params().to_vec();
    assert_ne!(local_params, pulled, "the inner optimizer moved θ_local");
    let out = frames(&mut w);
    let mut delta = vec![0.0; pulled.len()];
    let mut pushes = 0;
    for (shard, f) in &out {
        if let Message::Push {
            base_version,
            samples,
            grad,
            ..
        } = wire::decode(f, usize::MAX).unwrap()
        {
            pushes += 1;
            assert_eq!(base_version, [4, 9][*shard]);
            assert_eq!(samples, 3 * 2, "H × batch");
            let r = range(&w, *shard);
            grad.copy_into(&mut delta[r.start..r.end]).unwrap();
        }
    }
    assert_eq!(pushes, 2);
    for ((d, a), b) in delta.iter().zip(&pulled).zip(&local_params) {
        assert_eq!(*d, a - b, "Δ = θ_pulled − θ_local");
    }
    assert_eq!(
        (w.stats().steps, w.stats().rounds, w.stats().local_steps),
        (3, 1, 3)
    );
}

/// Issue 20: under a schedule counted by samples (`auto` local steps), a round's inner
/// steps run at the factor of the largest count its Params stated plus the round's own
/// samples: the same pulled values with counts past the decay's end give a round a tenth
/// as long (the floor) as with counts at the start.
#[test]
fn a_counted_schedule_follows_the_samples_the_params_state() {
    use crate::schedule::{Decay, Schedule};
    let inner = OptimizerConfig {
        rule: crate::optim::Rule::Sgd,
        lr: 0.01,
        weight_decay: 0.0,
        clip_norm: None,
        schedule: Schedule {
            warmup: 0,
            decay: Decay::Cosine,
            decay_samples: 1000,
            min_ratio: 0.1,
            samples_per_version: 1,
            counted: true,
        },
    };
    let round = |counts: [Option<u64>; 2]| {
        let local = LocalConfig {
            steps: LocalSteps::Fixed(2),
            inner,
            ..LocalConfig::default()
        };
        let mut w = local_worker(local, 2, None);
        let p = handshake(&mut w, &[4, 9]);
        for &(shard, id, _) in &p {
            let values = vec![0.5f32; range(&w, shard).len()];
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            let f = wire::encode(&Message::Params {
                request_id: id,
                shard: shard as u32,
                version: [4, 9][shard],
                pace_ms: 0,
                samples: counts[shard],
                values: wire::Payload::f32(&bytes),
            });
            w.receive(shard, &f).unwrap();
        }
        let pulled = w.params().to_vec();
        w.step().unwrap();
        assert!(w.step().unwrap().pushed);
        pulled
            .iter()
            .zip(w.params())
            .map(|(a, b)| f64::from(a - b).powi(2))
            .sum::<f64>()
            .sqrt()
    };
    // Round samples: H = 2 batches of 2. Counts 0 and 0: f(4) ≈ 1.
    let start = round([Some(0), Some(0)]);
    // The larger count rules: f(5000 + 4) = the floor.
    let end = round([Some(5000), Some(0)]);
    // A shard that states nothing counts as 0.
    let none = round([None, None]);
    assert!(start > 0.0);
    assert_eq!(start, none);
    let ratio = end / start;
    let expect = 0.1 / f64::from(inner.schedule.factor_at(4));
    assert!(
        (ratio / expect - 1.0).abs() < 0.05,
        "step length ratio {ratio}, the schedule's {expect}"
    );
}

#[test]
fn overlap_pulls_the_next_round_before_computing() {
    let local = LocalConfig {
        overlap: true,
        ..LocalConfig::default()
    };
    let mut w = local_worker(local, 2, Some(3));
    let p = handshake(&mut w, &[0, 0]);
    answer(&mut w, &p, &[0, 0]);
    // The round started when the last Params arrived: the next pulls are already queued,
    // before any compute.
    let early = drain(&mut w);
    assert_eq!(pulls(&early).len(), 2, "{early:?}");
    assert!(pushes(&early).is_empty());
    w.step().unwrap();
    let sent = drain(&mut w);
    assert_eq!(pushes(&sent).len(), 2);
    assert!(pulls(&sent).is_empty(), "the next pulls went out already");
    // The next parameters arrive: the next round starts at once and pulls the last one.
    answer(&mut w, &pulls(&early), &[1, 1]);
    assert!(w.ready());
    assert_eq!(pulls(&drain(&mut w)).len(), 2);
    w.step().unwrap();
    let versions: Vec<_> = pushes(&drain(&mut w))
        .iter()
        .map(|&(s, _, v)| (s, v))
        .collect();
    assert_eq!(
        versions,
        vec![(0, 1), (1, 1)],
        "computed from the second pull"
    );
    assert!(!w.ready(), "waiting for the third round's parameters");
}

#[test]
fn auto_picks_h_from_the_measured_times() {
    let local = LocalConfig {
        steps: LocalSteps::Auto { max: 500 },
        ..LocalConfig::default()
    };
    let mut w = local_worker(local, 1, None);
    w.set_time(10.0);
    let p = handshake(&mut w, &[0]);
    assert_eq!(w.local_steps(), 1, "nothing measured yet");
    w.set_time(10.010);
    answer(&mut w, &p, &[0]);
    w.set_time(10.011);
    w.step().unwrap();
    w.observe_compute(0.001);
    // 10 ms exchanges, 1 ms steps: ⌈0.010 · 0.85 / (0.15 · 0.001)⌉ = 57.
    assert_eq!(w.local_steps(), 57);
    assert_eq!(w.stats().compute_s, 0.001);
    assert!((w.stats().wall_s - 0.011).abs() < 1e-9);
}

#[test]
fn negotiated_encodings_are_decoded_and_used() {
    let mut w = local_worker(LocalConfig::default(), 1, None);
    w.connected(0);
    drain(&mut w);
    let welcome = wire::encode(&Message::Welcome {
        request_id: 1,
        shard: 0,
        welcome: Welcome {
            protocol: PROTOCOL_VERSION,
            range: range(&w, 0),
            version: 0,
            pull_encoding: Encoding::Bf16,
            push_encoding: Encoding::INT8,
            reports: true,
            spot_checks: false,
            paces: false,
            samples: false,
        },
    });
    w.set_time(0.0);
    w.receive(0, &welcome).unwrap();
    let p = pulls(&drain(&mut w));
    let n = range(&w, 0).len();
    let values: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
    let f = wire::encode_params_as(Encoding::Bf16, p[0].1, 0, 0, &values).unwrap();
    w.receive(0, &f).unwrap();
    assert_eq!(w.params(), &values[..], "bf16 holds these exactly");
    w.step().unwrap();
    let out = frames(&mut w);
    let push = out
        .iter()
        .find_map(|(_, f)| match wire::decode(f, usize::MAX).unwrap() {
            Message::Push { grad, .. } => Some(grad.encoding()),
            _ => None,
        });
    assert_eq!(push, Some(Encoding::INT8));
    assert_eq!(w.encodings(0), Some((Encoding::Bf16, Encoding::INT8)));
    // Reports: at most one a second, on shard 0.
    w.set_time(0.5);
    w.set_time(1.2);
    w.set_time(1.4);
    let reports = frames(&mut w)
        .iter()
        .filter(|(s, f)| *s == 0 && f[3] == 9)
        .count();
    assert_eq!(reports, 1);
}

/// Welcomes `w` on every shard, saying whether the shard `paces`; returns the pulls.
fn paced_handshake(w: &mut Worker, paces: bool) -> Vec<(usize, u32, u64)> {
    for shard in 0..w.shard_count() {
        w.connected(shard);
    }
    drain(w);
    for shard in 0..w.shard_count() {
        let f = wire::encode(&Message::Welcome {
            request_id: 1,
            shard: shard as u32,
            welcome: Welcome {
                protocol: PROTOCOL_VERSION,
                range: range(w, shard),
                version: 0,
                pull_encoding: Default::default(),
                push_encoding: Default::default(),
                reports: false,
                spot_checks: false,
                paces,
                samples: false,
            },
        });
        w.receive(shard, &f).unwrap();
    }
    pulls(&drain(w))
}

/// Answers `pulls` with Params carrying `pace_ms` per shard.
fn answer_paced(w: &mut Worker, pulls: &[(usize, u32, u64)], pace_ms: &[u32]) {
    for &(shard, id, _) in pulls {
        let values = vec![0.5; range(w, shard).len()];
        let f =
            wire::encode_params_paced(Encoding::F32, id, shard as u32, 1, pace_ms[shard], &values)
                .unwrap();
        w.receive(shard, &f).unwrap();
    }
}

/// Issue 18: with a fixed H the worker holds its next batch of pulls until the largest
/// pace of its shards has passed since the last batch, and says when to wake it.
#[test]
fn issue_18_a_paced_worker_holds_its_next_pull_for_the_pace() {
    let mut w = worker("async", 2, None);
    w.set_time(10.0);
    let p = paced_handshake(&mut w, true);
    assert_eq!(p.len(), 2);
    // Shard 1's pace (250 ms) is the larger: it is the one honoured.
    answer_paced(&mut w, &p, &[100, 250]);
    assert_eq!(w.pace(), 0.25);
    assert_eq!(w.stats().pace_s, 0.25);
    w.set_time(10.01);
    w.step().unwrap();
    let sent = drain(&mut w);
    assert_eq!(sent.len(), 2, "the pushes go out: {sent:?}");
    assert!(pulls(&sent).is_empty(), "the pulls wait: {sent:?}");
    assert!(!w.ready());
    assert_eq!(w.poll_timeout(), Some(10.25));
    // Woken early (another event): still held.
    w.handle_timeout(10.2);
    assert!(drain(&mut w).is_empty());
    assert_eq!(w.poll_timeout(), Some(10.25));
    // A wake-up a rounding error early (a driver's ns or ms clock) counts as on time.
    w.handle_timeout(10.25 - 1e-9);
    let p = pulls(&drain(&mut w));
    assert_eq!(p.len(), 2, "both shards pulled once the pace passed");
    assert_eq!(w.poll_timeout(), None);
    // A pace of 0 (the budget was lifted) releases the next pull at once.
    answer_paced(&mut w, &p, &[0, 0]);
    w.set_time(10.26);
    w.step().unwrap();
    assert_eq!(pulls(&drain(&mut w)).len(), 2);
    assert_eq!(w.poll_timeout(), None);
}

/// Issue 18: a shard that did not say `paces` in its Welcome is not honoured, whatever
/// its `aux` holds (version-1 shards leave it 0; a third party might not).
#[test]
fn issue_18_aux_means_nothing_without_the_welcome_saying_paces() {
    let mut w = worker("async", 1, None);
    w.set_time(0.0);
    let p = paced_handshake(&mut w, false);
    answer_paced(&mut w, &p, &[5_000]);
    assert_eq!(w.pace(), 0.0);
    w.set_time(0.001);
    w.step().unwrap();
    assert_eq!(
        pulls(&drain(&mut w)).len(),
        1,
        "pulled right after the push"
    );
    assert_eq!(w.poll_timeout(), None);
}

/// Issue 18: under `auto` a paced worker lengthens its rounds to cover the pace
/// (H = max(H_auto, ceil(pace / t_c)) within the run's bound), so its pulls need no hold.
#[test]
fn issue_18_auto_lengthens_rounds_to_the_pace() {
    let local = LocalConfig {
        steps: LocalSteps::Auto { max: 1000 },
        ..LocalConfig::default()
    };
    let mut w = local_worker(local, 1, None);
    w.set_time(0.0);
    let p = paced_handshake(&mut w, true);
    w.set_time(0.001);
    answer_paced(&mut w, &p, &[0]);
    // Round 1: nothing measured yet, H = 1.
    assert_eq!(w.stats().local_steps, 1);
    w.set_time(0.002);
    w.step().unwrap();
    w.observe_compute(0.002);
    let p = pulls(&drain(&mut w));
    // The exchange takes 1 ms: the controller alone picks ceil(0.001·0.85/(0.15·0.002)) = 3.
    w.set_time(0.003);
    answer_paced(&mut w, &p, &[0]);
    assert_eq!(w.stats().local_steps, 3);
    for _ in 0..3 {
        w.step().unwrap();
        w.observe_compute(0.002);
    }
    let p = pulls(&drain(&mut w));
    assert_eq!(p.len(), 1);
    // Now the shard paces at 300 ms: 150 steps of 2 ms cover it.
    w.set_time(0.010);
    answer_paced(&mut w, &p, &[300]);
    assert_eq!(w.stats().local_steps, 150);
    // Within the run's bound.
    let local = LocalConfig {
        steps: LocalSteps::Auto { max: 40 },
        ..LocalConfig::default()
    };
    let mut w = local_worker(local, 1, None);
    w.set_time(0.0);
    let p = paced_handshake(&mut w, true);
    answer_paced(&mut w, &p, &[0]);
    w.step().unwrap();
    w.observe_compute(0.002);
    let p = pulls(&drain(&mut w));
    w.set_time(0.001);
    answer_paced(&mut w, &p, &[300]);
    assert_eq!(w.stats().local_steps, 40);
    // And the bound's round (80 ms of compute) is shorter than the pace: the pull waits
    // for 300 ms after the last batch, which went out at 0.
    for _ in 0..40 {
        w.step().unwrap();
    }
    w.set_time(0.081);
    assert!(pulls(&drain(&mut w)).is_empty());
    assert_eq!(w.poll_timeout(), Some(0.3));
}
