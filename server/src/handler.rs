//! One WebSocket connection to one shard (mini-redis' `Handler`): a thin driver of core's
//! [`ShardSession`], which holds every rule of the shard side (see
//! [`crowdgrad_core::session`]). Generic over a `Sink` of [`Outbound`] and a `Stream` of
//! [`Inbound`], so unit tests drive it with channels and the router adapts axum's socket to it.
//!
//! The driver only moves bytes and time: it feeds the session what arrives, sends what the
//! session asks, records what it reports in the [`Registry`], and, while a pull waits, stops
//! reading the socket and sleeps until the shard changes, the session's deadline passes, or the
//! server shuts down.

use crate::registry::Registry;
use crate::shard::{Read, Shard, Snapshot};
use bytes::Bytes;
use crowdgrad_core::session::{Action, Record, ShardSession};
use futures_util::{Sink, SinkExt, Stream, StreamExt};
use std::sync::Arc;
use tokio::sync::watch;

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
    /// A binary message.
    Frame(Vec<u8>),
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
) where
    Si: Sink<Outbound> + Unpin,
    St: Stream<Item = Inbound> + Unpin,
{
    let mut session = ShardSession::new(shard.config());
    let mut access = shard.access(&registry);
    let mut changed = shard.subscribe();
    loop {
        if !perform(&mut session, &mut tx, &shard, &registry).await {
            session.handle_close(&mut access);
            perform(&mut session, &mut tx, &shard, &registry).await;
            break;
        }
        if session.is_closed() {
            break;
        }
        if let Some(deadline) = session.poll_timeout() {
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
            }
            continue;
        }
        let inbound = tokio::select! {
            biased;
            c = shutdown.changed() => {
                if c.is_err() || *shutdown.borrow() {
                    session.shutdown(&mut access);
                }
                continue;
            }
            m = rx.next() => m.unwrap_or(Inbound::Closed),
        };
        // Anything that changes from here on wakes the pull this frame may park.
        changed.borrow_and_update();
        let now = shard.now();
        match inbound {
            Inbound::Frame(bytes) => session.handle_frame(&mut access, &bytes, now),
            Inbound::Text => session.handle_text(&mut access, now),
            Inbound::Closed => session.handle_close(&mut access),
        }
    }
    // Records of a close the peer started (Left) still reach the registry.
    perform(&mut session, &mut tx, &shard, &registry).await;
}

/// Carries out the session's actions. Returns false when sending failed.
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
                if tx.send(Outbound::Frame(frame)).await.is_err() {
                    return false;
                }
            }
            Action::Close(reason) => {
                let _ = tx.send(Outbound::Close(reason)).await;
            }
            Action::Record(r) => record(registry, id, r),
        }
    }
    true
}

fn record(registry: &Registry, shard: u32, r: Record) {
    match r {
        Record::Joined { worker } => registry.connection(worker, true),
        Record::Left { worker } => registry.connection(worker, false),
        Record::Pulled {
            worker,
            version,
            clock,
            min_clock,
        } => registry.pulled(
            shard,
            Some(worker),
            &Read {
                snapshot: Snapshot {
                    version,
                    values: Arc::default(),
                },
                clock,
                min_clock,
            },
        ),
        Record::Pushed {
            worker,
            outcome,
            samples,
        } => registry.pushed(shard, worker, &outcome, samples),
        Record::Rejected { worker, code } => registry.frame_rejected(shard, worker, code),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::ShardOptions;
    use crowdgrad_core::optim::{OptimizerConfig, Rule};
    use crowdgrad_core::partition::KeyRange;
    use crowdgrad_core::shard::{Consistency, StalenessPolicy};
    use crowdgrad_core::wire::{self, ClientKind, ErrorCode, Hello, Message};
    use futures_channel::mpsc;
    use std::time::Duration;

    #[tokio::test]
    async fn channel_driven_session() {
        let opts = ShardOptions {
            optimizer: OptimizerConfig {
                rule: Rule::Sgd,
                lr: 1.0,
                weight_decay: 0.0,
                clip_norm: None,
            },
            staleness: StalenessPolicy::default(),
            consistency: Consistency::Async,
            heartbeat: Duration::from_secs(5),
            sync_timeout: Duration::from_secs(1),
        };
        let shard = Shard::start(1, KeyRange { start: 4, end: 6 }, vec![0.0; 2], opts);
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
            replies.push(f);
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
            matches!(wire::decode(&e, 1 << 20).unwrap(), Message::Error { request_id: 10, error, .. } if error.code == ErrorCode::WrongShard)
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
