//! One WebSocket connection to one shard (mini-redis' `Handler`): a thin driver of core's
//! [`ShardSession`], which holds every rule of the shard side (see
//! [`crowdgrad_core::session`]). Generic over a `Sink` of [`Outbound`] and a `Stream` of
//! [`Inbound`], so unit tests drive it with channels and the router adapts axum's socket to it.
//!
//! The driver only moves bytes and time: it feeds the session what arrives, sends what the
//! session asks, records what it reports in the [`Registry`], and, while a pull waits, stops
//! reading the socket and sleeps until the shard changes, the session's deadline passes, or the
//! server shuts down.
//!
//! It also enforces the per-connection limits of [`crate::support::limits`] that the session does not
//! know about: a Hello within `--hello-timeout` of the socket opening (else a `protocol` error
//! and Close), no silence longer than `--idle-timeout` while no pull is held (else a Bye
//! `idle` and Close), and the push rates per worker and per IP (an excess push is answered
//! `busy`, not fed to the session, and counted as a rejected push).

use crate::registry::Registry;
use crate::shard::Shard;
use crate::support::limits::{ConnSlot, Count, IpKey, LimitConfig, Limits, PushLimit};
use bytes::Bytes;
use crowdgrad_core::session::{header_request_id, Action, Outgoing, Record, ShardSession};
use crowdgrad_core::shard::Outcome;
use crowdgrad_core::wire::{self, Bye, ErrorCode, Message, MAGIC};
use futures_util::{FutureExt, Sink, SinkExt, Stream, StreamExt};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// The limits one connection is held to, and who it is from.
#[derive(Debug, Clone)]
pub struct ConnLimits {
    /// The server's limits (shared buckets and counters).
    pub limits: Arc<Limits>,
    /// The client, for per-IP push rates.
    pub ip: IpKey,
    /// The TCP connection's share of the connection budgets: its unauthenticated places are
    /// given back once the session's Hello is admitted ([`crate::support::limits`]).
    pub slot: Option<Arc<ConnSlot>>,
}

/// Whether `bytes` is a Push frame (kind 5 in the kind byte's low nibble).
fn is_push(bytes: &[u8]) -> bool {
    bytes.len() >= 4 && bytes[..2] == MAGIC && bytes[3] & 0x0f == wire::Kind::Push as u8
}

/// What the handler reads.
#[derive(Debug, Clone, PartialEq)]
pub enum Inbound {
    /// A binary message: one frame.
    Frame(Bytes),
    /// A text message (not part of the protocol).
    Text,
    /// The peer closed or the socket failed.
    Closed,
}

/// What the handler writes.
#[derive(Debug, Clone, PartialEq)]
pub enum Outbound {
    /// A binary message (a `Params` frame's body shared with other pulls: [`Outgoing`]).
    Frame(Outgoing),
    /// Close the socket with this reason.
    Close(String),
}

/// Serves one connection until it closes, fails or the server shuts down.
pub async fn serve<Si, St>(
    mut tx: Si,
    mut rx: St,
    shard: Shard,
    registry: Registry,
    mut shutdown: watch::Receiver<bool>,
    conn: Option<ConnLimits>,
) where
    Si: Sink<Outbound> + Unpin,
    St: Stream<Item = Inbound> + Unpin,
{
    let mut session = ShardSession::new(shard.config());
    let mut access = shard.access(&registry);
    let mut changed = shard.subscribe();
    let cfg = conn
        .as_ref()
        .map_or_else(LimitConfig::default, |c| c.limits.cfg);
    let opened = Instant::now();
    let mut heard = opened;
    let mut unauthenticated = conn.as_ref().and_then(|c| c.slot.clone());
    // Frames taken in a row without waiting (and without flushing the replies).
    let mut batched = 0usize;
    // The peer ended the connection (its Close frame, or the end of the stream): answered with
    // a Close of ours at the end (RFC 6455 5.5.1: an endpoint that receives a Close it did not
    // start sends one back), as tungstenite's reader did before the shard read frames itself.
    let mut peer_closed = false;
    // The reputation's quarantine epoch last seen: the worker is re-checked when it moves,
    // and a move wakes the waits below.
    let mut quarantine_epoch = u64::MAX;
    let mut quarantines = shard.defence().map(|d| d.reputation.subscribe());
    // What a demonstration's fault remembers on this connection (crate::shard::demo).
    let mut rewriter: Option<crate::shard::demo::Rewriter> = None;
    loop {
        if !perform(&mut session, &mut tx, &shard, &registry).await {
            session.handle_close(&mut access);
            perform(&mut session, &mut tx, &shard, &registry).await;
            break;
        }
        if session.is_closed() {
            break;
        }
        if session.worker().is_some() {
            if let Some(slot) = unauthenticated.take() {
                // The Hello was admitted: the socket leaves the unauthenticated budget.
                slot.authenticated();
            }
        }
        if let (Some(d), Some(worker)) = (shard.defence(), session.worker()) {
            let e = d.reputation.epoch();
            if e != quarantine_epoch {
                quarantine_epoch = e;
                if let Some(why) = d.reputation.quarantined(worker) {
                    // Expelling drops its pushes still pending in a sync round.
                    let m = format!("worker {worker} is quarantined: {why}");
                    session.expel(&mut access, ErrorCode::Quarantined, m);
                    continue;
                }
            }
        }
        if let Some(deadline) = session.poll_timeout() {
            // What the session sent leaves before the pull waits.
            if !flush(&mut tx).await {
                session.handle_close(&mut access);
                continue;
            }
            tokio::select! {
                biased;
                c = shutdown.changed() => {
                    if c.is_err() || *shutdown.borrow() {
                        session.shutdown(&mut access);
                    }
                }
                _ = changed.changed() => session.handle_update(&mut access, shard.now()),
                _ = tokio::time::sleep_until(shard.instant(deadline).into()) => {
                    session.handle_timeout(&mut access, shard.now());
                }
                // Re-checked at the top of the loop.
                () = quarantine_moved(&mut quarantines) => {}
            }
            // The worker waited for us: its silence so far does not count.
            heard = Instant::now();
            continue;
        }
        let (silence_until, hello_due) = match session.worker() {
            None => (opened + cfg.hello_timeout, true),
            Some(_) => (heard + cfg.idle_timeout, false),
        };
        // A frame that is already here is taken at once and the replies so far stay queued, so
        // the replies to frames that came together (a worker's push and its pull) leave in one
        // write; otherwise they are flushed before the wait. At most `BATCH` frames in a row
        // skip the wait (and its shutdown and deadline checks).
        let ready = if batched < BATCH {
            rx.next().now_or_never()
        } else {
            None
        };
        let inbound = if let Some(m) = ready {
            batched += 1;
            m.unwrap_or(Inbound::Closed)
        } else {
            batched = 0;
            if !flush(&mut tx).await {
                session.handle_close(&mut access);
                continue;
            }
            tokio::select! {
                biased;
                c = shutdown.changed() => {
                    if c.is_err() || *shutdown.borrow() {
                        session.shutdown(&mut access);
                    }
                    continue;
                }
                m = rx.next() => m.unwrap_or(Inbound::Closed),
                () = quarantine_moved(&mut quarantines) => continue,
                () = tokio::time::sleep_until(silence_until.into()) => {
                    let limits = conn.as_ref().map(|c| &c.limits);
                    timed_out(&mut tx, &shard, hello_due, &cfg, limits).await;
                    session.handle_close(&mut access);
                    continue;
                }
            }
        };
        heard = Instant::now();
        // Anything that changes from here on wakes the pull this frame may park.
        changed.borrow_and_update();
        let now = shard.now();
        match inbound {
            Inbound::Frame(bytes) => {
                shard.count_bytes(bytes.len(), 0);
                if let (Some(d), Some(worker)) = (shard.defence(), session.worker()) {
                    // A quarantine since the top of the loop: this frame is not taken.
                    if d.reputation.epoch() != quarantine_epoch
                        && d.reputation.quarantined(worker).is_some()
                    {
                        continue;
                    }
                }
                if let (Some(c), Some(worker), true) = (&conn, session.worker(), is_push(&bytes)) {
                    if let Err(hit) = c.limits.push(shard.id(), worker, c.ip, heard) {
                        let m = match hit {
                            PushLimit::Worker => format!(
                                "more than {} pushes per second from this worker",
                                cfg.push_rate
                            ),
                            PushLimit::Ip => format!(
                                "more than {} pushes per second from this address",
                                cfg.push_rate_per_ip
                            ),
                        };
                        let id = header_request_id(&bytes);
                        let frame = wire::encode_error(id, shard.id(), ErrorCode::Busy, &m);
                        let outcome = Outcome::Rejected {
                            code: ErrorCode::Busy,
                            message: m,
                        };
                        registry.pushed(shard.id(), Some(worker), &outcome, 0, false);
                        if tx.send(Outbound::Frame(frame.into())).await.is_err() {
                            session.handle_close(&mut access);
                        }
                        continue;
                    }
                }
                // A teacher's demonstration on this worker (crate::shard::demo): its push is
                // held, or rewritten as a faulty worker's, before the session sees it.
                let (bytes, now) = match (shard.demo(), session.worker(), is_push(&bytes)) {
                    (Some(d), Some(worker), true) => match d.get(worker) {
                        Some(setting) => {
                            if let Some(wait) = crate::shard::demo::delay(&setting) {
                                if !flush(&mut tx).await {
                                    session.handle_close(&mut access);
                                    continue;
                                }
                                tokio::select! {
                                    () = tokio::time::sleep(wait) => {}
                                    _ = shutdown.changed() => {}
                                }
                            }
                            let bytes = match setting.fault {
                                Some(f) => Bytes::from(
                                    rewriter
                                        .get_or_insert_with(|| {
                                            crate::shard::demo::Rewriter::new(
                                                worker,
                                                shard.id() as usize + 1,
                                                u64::from(shard.id()),
                                            )
                                        })
                                        .rewrite(bytes.to_vec(), f),
                                ),
                                None => bytes,
                            };
                            (bytes, shard.now())
                        }
                        None => (bytes, now),
                    },
                    _ => (bytes, now),
                };
                // Pacing (crate::defence::spotcheck): a push is fed holding a place in the
                // spot checker's queue, waited for while the checker is behind, so a push
                // drawn for a check is checked rather than refused `busy`.
                let mut now = now;
                let spot = shard.defence().and_then(|d| d.spot.clone());
                if let (Some(spot), Some(worker), true) = (spot, session.worker(), is_push(&bytes))
                {
                    let placed = spot.try_place(worker) || {
                        if !flush(&mut tx).await {
                            session.handle_close(&mut access);
                            continue;
                        }
                        let p = tokio::select! {
                            biased;
                            _ = shutdown.changed() => false,
                            p = spot.wait_place(worker, crate::defence::spotcheck::PLACE_WAIT) => p,
                        };
                        now = shard.now();
                        p
                    };
                    if placed {
                        access.placed(worker);
                    }
                    if let Some(d) = shard.defence() {
                        // Quarantined while it waited (its last check failed): not taken.
                        if d.reputation.quarantined(worker).is_some() {
                            access.unplace();
                            continue;
                        }
                    }
                }
                session.handle_frame(&mut access, &bytes, now);
                access.unplace();
            }
            Inbound::Text => session.handle_text(&mut access, now),
            Inbound::Closed => {
                peer_closed = true;
                session.handle_close(&mut access);
            }
        }
    }
    // Records of a close the peer started (Left) still reach the registry.
    perform(&mut session, &mut tx, &shard, &registry).await;
    // The last replies (an error frame before a close, the Close echoed to a peer that
    // closed), within a second for a peer that stopped reading.
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        if peer_closed {
            let _ = tx.feed(Outbound::Close(String::new())).await;
        }
        tx.flush().await
    })
    .await;
}

/// Resolves when the reputation's quarantine epoch moves; never without a reputation (or once
/// it is gone).
async fn quarantine_moved(rx: &mut Option<watch::Receiver<u64>>) {
    match rx {
        Some(r) => {
            if r.changed().await.is_err() {
                *rx = None;
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending::<()>().await,
    }
}

/// Most frames taken one after another without waiting (see [`serve`]).
const BATCH: usize = 16;

/// Sends what [`perform`] queued. Returns false when the socket failed.
async fn flush<Si: Sink<Outbound> + Unpin>(tx: &mut Si) -> bool {
    tx.flush().await.is_ok()
}

/// A socket missed its Hello deadline (`protocol` error) or went silent (Bye `idle`): say why,
/// close it, count it.
async fn timed_out<Si: Sink<Outbound> + Unpin>(
    tx: &mut Si,
    shard: &Shard,
    hello_due: bool,
    cfg: &LimitConfig,
    limits: Option<&Arc<Limits>>,
) {
    let (frame, reason) = if hello_due {
        let m = format!("no Hello within {:?} of connecting", cfg.hello_timeout);
        let f = wire::encode_error(0, shard.id(), ErrorCode::Protocol, &m);
        (f, "protocol: no Hello in time".to_string())
    } else {
        let m = format!("idle: no frame for {:?}", cfg.idle_timeout);
        let f = wire::encode(&Message::Bye {
            shard: shard.id(),
            bye: Bye { reason: m.clone() },
        });
        (f, m)
    };
    if let Some(l) = limits {
        l.count(if hello_due {
            Count::HelloTimeout
        } else {
            Count::IdleTimeout
        });
    }
    // A peer that does not read must not hold the task: give the goodbye a second.
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        if tx.send(Outbound::Frame(frame.into())).await.is_ok() {
            let _ = tx.send(Outbound::Close(reason)).await;
        }
    })
    .await;
}

/// Carries out the session's actions. Frames are queued, not flushed: [`serve`] flushes them
/// before it waits, so replies to frames that arrived together leave in one write (one
/// syscall and one wake-up of the worker instead of one per frame). Returns false when
/// sending failed.
async fn perform<Si: Sink<Outbound> + Unpin>(
    session: &mut ShardSession,
    tx: &mut Si,
    shard: &Shard,
    registry: &Registry,
) -> bool {
    let id = shard.id();
    while let Some(action) = session.poll_action() {
        match action {
            Action::Send(frame) => {
                shard.count_bytes(0, frame.len());
                if tx.feed(Outbound::Frame(frame)).await.is_err() {
                    return false;
                }
            }
            Action::Close(reason) => {
                let _ = tx.send(Outbound::Close(reason)).await;
            }
            Action::Record(r) => {
                if let Some(d) = shard.defence() {
                    note(&d.reputation, &r);
                    if let Some(spot) = &d.spot {
                        applied(spot, id, &r);
                    }
                }
                if let Record::Left { worker } = r {
                    // A shard process's credential expiry clock (crate::shard::expiry).
                    shard.left(worker);
                }
                record(registry, id, r)
            }
        }
    }
    true
}

/// Refusals count in the worker's reputation ([`crate::defence::reputation`]).
fn note(reputation: &crate::defence::reputation::Reputation, r: &Record) {
    match r {
        Record::Pushed {
            worker: Some(w),
            outcome: Outcome::Rejected { code, .. },
            ..
        }
        | Record::Rejected {
            worker: Some(w),
            code,
        } => reputation.rejected(*w, *code),
        _ => {}
    }
}

/// An accepted push's version goes to the spot checker's log (for a rollback past a
/// poisoner's pushes, [`crate::defence::spotcheck`]); a `sync:K` push's is the version its round
/// will produce.
fn applied(spot: &crate::defence::spotcheck::SpotChecker, shard: u32, r: &Record) {
    if let Record::Pushed {
        worker: Some(w),
        outcome,
        ..
    } = r
    {
        match outcome {
            Outcome::Applied { version, .. } => spot.applied(shard, *version, *w),
            Outcome::Buffered { version, .. } => spot.applied(shard, version + 1, *w),
            Outcome::Rejected { .. } => {}
        }
    }
}

fn record(registry: &Registry, shard: u32, r: Record) {
    match r {
        Record::Joined { worker } => registry.connection(worker, true),
        Record::Left { worker } => registry.connection(worker, false),
        Record::Pulled {
            worker,
            bytes,
            version,
            clock,
            min_clock,
        } => {
            registry.traffic(shard, Some(worker), 0, bytes);
            registry.pulled(
                shard,
                Some(worker),
                &crate::registry::Pulled {
                    version,
                    clock,
                    min_clock,
                },
            )
        }
        Record::Pushed {
            worker,
            outcome,
            samples,
            bytes,
            nonzero,
            clipped,
        } => {
            registry.traffic(shard, worker, bytes, 0);
            registry.pushed(shard, worker, &outcome, samples, nonzero);
            if clipped {
                registry.clipped(shard, worker);
            }
        }
        Record::Reported {
            worker,
            report,
            encodings,
        } => registry.reported(worker, &report, encodings),
        Record::Rejected { worker, code } => registry.frame_rejected(shard, worker, code),
        Record::Dropped { worker, pushes } => registry.dropped(shard, worker, pushes),
        // Counted when the checker applies it (`crate::defence::spotcheck`, "Probation").
        Record::Held { worker, bytes, .. } => registry.traffic(shard, Some(worker), bytes, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crowdgrad_core::optim::{OptimizerConfig, Rule};
    use crowdgrad_core::partition::KeyRange;
    use crowdgrad_core::session::ShardSetup;
    use crowdgrad_core::shard::{Consistency, StalenessPolicy};
    use crowdgrad_core::wire::{self, ClientKind, ErrorCode, Hello, Message};
    use futures_channel::mpsc;

    #[tokio::test]
    async fn channel_driven_session() {
        let opts = ShardSetup {
            optimizer: OptimizerConfig {
                rule: Rule::Sgd,
                lr: 1.0,
                weight_decay: 0.0,
                clip_norm: None,
                schedule: Default::default(),
            },
            staleness: StalenessPolicy::default(),
            consistency: Consistency::Async,
            heartbeat: 5.0,
            sync_timeout: 1.0,
            reports: true,
            pseudo_gradients: false,
            guard: crowdgrad_core::session::PushGuard::default(),
            aggregation: crowdgrad_core::robust::Aggregation::Mean,
            pull_encoding: crowdgrad_core::codec::Encoding::F32,
            push_encoding: crowdgrad_core::codec::Encoding::F32,
            pacing: crowdgrad_core::shard::Pacing::OFF,
            counted: false,
            average: None,
        };
        let shard = Shard::start(1, KeyRange { start: 4, end: 6 }, vec![0.0; 2], opts)
            .expect("a valid setup");
        let registry = Registry::new(2, 10);
        let (id, _) = registry.join(ClientKind::Native, None, 1).unwrap();
        let (in_tx, in_rx) = mpsc::unbounded();
        let (out_tx, mut out_rx) = mpsc::unbounded();
        let (_stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(serve(
            out_tx,
            in_rx,
            shard.clone(),
            registry.clone(),
            stop_rx,
            None,
        ));
        let hello = wire::encode(&Message::Hello {
            request_id: 7,
            shard: 1,
            hello: Hello {
                protocol: 1,
                worker_id: id,
                client: ClientKind::Native,
                ..Default::default()
            },
        });
        in_tx.unbounded_send(Inbound::Frame(hello.into())).unwrap();
        in_tx
            .unbounded_send(Inbound::Frame(
                wire::encode_push(8, 1, 0, 2, &[1.0, -1.0]).into(),
            ))
            .unwrap();
        in_tx
            .unbounded_send(Inbound::Frame(
                wire::encode(&Message::Pull {
                    request_id: 9,
                    shard: 1,
                    min_version: 0,
                })
                .into(),
            ))
            .unwrap();
        let mut replies = Vec::new();
        for _ in 0..3 {
            let Some(Outbound::Frame(f)) = out_rx.next().await else {
                panic!("closed early")
            };
            replies.push(f.into_vec());
        }
        assert!(matches!(
            wire::decode(&replies[0], 1 << 20).unwrap(),
            Message::Welcome { request_id: 7, .. }
        ));
        assert!(matches!(
            wire::decode(&replies[1], 1 << 20).unwrap(),
            Message::Ack {
                request_id: 8,
                version: 1,
                staleness: 0,
                ..
            }
        ));
        match wire::decode(&replies[2], 1 << 20).unwrap() {
            Message::Params {
                request_id: 9,
                version: 1,
                values,
                ..
            } => assert_eq!(values.iter().collect::<Vec<_>>(), vec![-1.0, 1.0]),
            other => panic!("{other:?}"),
        }
        // A push to the wrong shard: error frame, then close; shard unchanged.
        in_tx
            .unbounded_send(Inbound::Frame(
                wire::encode_push(10, 0, 1, 2, &[5.0, 5.0]).into(),
            ))
            .unwrap();
        let Some(Outbound::Frame(e)) = out_rx.next().await else {
            panic!()
        };
        assert!(
            matches!(wire::decode(&e.into_vec(), 1 << 20).unwrap(), Message::Error { request_id: 10, error, .. } if error.code == ErrorCode::WrongShard)
        );
        assert!(matches!(out_rx.next().await, Some(Outbound::Close(_))));
        task.await.unwrap();
        assert_eq!(*shard.snapshot().values, vec![-1.0, 1.0]);
        let (workers, _, _) = registry.view();
        assert_eq!(workers[0].shards_connected, 0);
        assert_eq!(
            workers[0].counters.rejected_by_reason.get("wrong_shard"),
            Some(&1)
        );
    }
}
