//! One WebSocket connection to one shard (mini-redis' `Handler`). Generic over a `Sink` of
//! [`Outbound`] and a `Stream` of [`Inbound`], so unit tests drive it with channels and the router
//! adapts axum's socket to it.
//!
//! Frames of one connection are handled strictly in order: a push is applied (or rejected)
//! before the next frame is read, so a worker's pull right after its push sees that push. In
//! `async` mode pulls never wait for other workers' pushes; `ssp`/`sync` pulls wait as their
//! mode demands (see [`crate::shard`]).
//!
//! Any malformed or illegal frame gets an `Error` frame naming the problem, then the connection
//! is closed; the shard is unchanged and other connections carry on. Policy rejections (a push
//! that is too stale or late) get an `Error` frame and the connection stays open.

use crate::registry::Registry;
use crate::shard::Shard;
use bytes::Bytes;
use crowdgrad_core::shard::Outcome;
use crowdgrad_core::wire::{self, Bye, ErrorCode, Message, Welcome, PROTOCOL_VERSION};
use futures_util::{Sink, SinkExt, Stream, StreamExt};
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

enum Step {
    Continue,
    Close(String),
}

/// Per-connection state and context.
struct Conn<'a, Si> {
    tx: Si,
    shard: &'a Shard,
    registry: &'a Registry,
    worker: Option<u64>,
    limit: usize,
}

/// Serves one connection until it closes, fails or the server shuts down.
pub async fn serve<Si, St>(
    tx: Si,
    mut rx: St,
    shard: Shard,
    registry: Registry,
    mut shutdown: watch::Receiver<bool>,
) where
    Si: Sink<Outbound> + Unpin,
    St: Stream<Item = Inbound> + Unpin,
{
    let mut c = Conn {
        tx,
        shard: &shard,
        registry: &registry,
        worker: None,
        limit: shard.frame_limit(),
    };
    loop {
        let inbound = tokio::select! {
            biased;
            changed = shutdown.changed() => {
                if changed.is_err() || *shutdown.borrow() {
                    c.goodbye().await;
                    break;
                }
                continue;
            }
            m = rx.next() => m.unwrap_or(Inbound::Closed),
        };
        let step = match inbound {
            Inbound::Closed => break,
            Inbound::Text => {
                c.fail(
                    0,
                    ErrorCode::Malformed,
                    "text messages are not part of the protocol; send binary frames".into(),
                )
                .await
            }
            Inbound::Frame(bytes) => c.frame(bytes, &mut shutdown).await,
        };
        if let Step::Close(reason) = step {
            if *shutdown.borrow() {
                c.goodbye().await;
            } else {
                let _ = c.tx.send(Outbound::Close(reason)).await;
            }
            break;
        }
    }
    if let Some(id) = c.worker {
        registry.connection(id, false);
        shard.worker_left(id);
    }
}

impl<Si: Sink<Outbound> + Unpin> Conn<'_, Si> {
    async fn goodbye(&mut self) {
        let bye = wire::encode(&Message::Bye {
            shard: self.shard.id(),
            bye: Bye {
                reason: "server shutting down".into(),
            },
        });
        let _ = self.tx.send(Outbound::Frame(bye)).await;
        let _ = self
            .tx
            .send(Outbound::Close("server shutting down".into()))
            .await;
    }

    async fn send(&mut self, frame: Vec<u8>) -> Step {
        match self.tx.send(Outbound::Frame(frame)).await {
            Ok(()) => Step::Continue,
            Err(_) => Step::Close("send failed".into()),
        }
    }

    /// Records the rejection, sends the error frame, and closes if the code is fatal.
    async fn fail(&mut self, request_id: u32, code: ErrorCode, message: String) -> Step {
        let rejected = Outcome::Rejected {
            code,
            message: message.clone(),
        };
        self.registry
            .pushed(self.shard.id(), self.worker, &rejected, 0);
        let sent = self
            .send(wire::encode_error(
                request_id,
                self.shard.id(),
                code,
                message.clone(),
            ))
            .await;
        if code.is_fatal() {
            Step::Close(format!("{}: {message}", code.name()))
        } else {
            sent
        }
    }

    async fn frame(&mut self, bytes: Bytes, shutdown: &mut watch::Receiver<bool>) -> Step {
        let shard = self.shard;
        let msg = match wire::decode(&bytes, self.limit) {
            Ok(m) => m,
            Err(e) => {
                // Echo the request id when the header got that far.
                let request_id = match bytes.get(4..8) {
                    Some(b) => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                    None => 0,
                };
                return self
                    .fail(request_id, ErrorCode::from(&e), e.to_string())
                    .await;
            }
        };
        let (request_id, addressed) = match &msg {
            Message::Hello {
                request_id, shard, ..
            }
            | Message::Pull {
                request_id, shard, ..
            }
            | Message::Push {
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
            } => (*request_id, *shard),
            Message::Bye { shard, .. } => (0, *shard),
        };
        if addressed != shard.id() {
            let m = format!(
                "frame addressed to shard {addressed} arrived at shard {}",
                shard.id()
            );
            return self.fail(request_id, ErrorCode::WrongShard, m).await;
        }
        if let Some(w) = self.worker {
            shard.heard_from(w);
        }
        match msg {
            Message::Hello { hello, .. } => {
                if self.worker.is_some() {
                    return self
                        .fail(
                            request_id,
                            ErrorCode::Protocol,
                            "second Hello on one connection".into(),
                        )
                        .await;
                }
                if hello.protocol != PROTOCOL_VERSION {
                    let m = format!(
                        "worker speaks protocol {}, this server speaks {PROTOCOL_VERSION}",
                        hello.protocol
                    );
                    return self.fail(request_id, ErrorCode::ProtocolVersion, m).await;
                }
                if !self.registry.knows(hello.worker_id) {
                    let m = format!(
                        "worker id {} is unknown; POST /api/join first",
                        hello.worker_id
                    );
                    return self.fail(request_id, ErrorCode::UnknownWorker, m).await;
                }
                self.worker = Some(hello.worker_id);
                self.registry.connection(hello.worker_id, true);
                shard.worker_joined(hello.worker_id);
                let welcome = Welcome {
                    protocol: PROTOCOL_VERSION,
                    range: shard.range(),
                    version: shard.version(),
                };
                self.send(wire::encode(&Message::Welcome {
                    request_id,
                    shard: shard.id(),
                    welcome,
                }))
                .await
            }
            _ if self.worker.is_none() => {
                self.fail(
                    request_id,
                    ErrorCode::Protocol,
                    "the first frame must be Hello".into(),
                )
                .await
            }
            Message::Pull { min_version, .. } => {
                // Only ssp/sync runs wait here; the wait gives way to shutdown.
                let read = tokio::select! {
                    r = shard.read(self.worker, min_version) => r,
                    _ = shutdown.changed() => return Step::Close("server shutting down".into()),
                };
                self.registry.pulled(shard.id(), self.worker, &read);
                let snap = &read.snapshot;
                self.send(wire::encode_params(
                    request_id,
                    shard.id(),
                    snap.version,
                    &snap.values,
                ))
                .await
            }
            Message::Push { grad, samples, .. } => {
                if grad.len() != shard.range().len() {
                    let m = format!(
                        "push of {} values to a shard of {}",
                        grad.len(),
                        shard.range().len()
                    );
                    return self.fail(request_id, ErrorCode::WrongLength, m).await;
                }
                let outcome = shard.push(self.worker, &bytes);
                let (version, staleness) = match &outcome {
                    Outcome::Applied {
                        version, staleness, ..
                    } => (*version, *staleness),
                    Outcome::Buffered { version, .. } => (*version, 0),
                    Outcome::Rejected { code, message } => {
                        return self.fail(request_id, *code, message.clone()).await;
                    }
                };
                self.registry
                    .pushed(shard.id(), self.worker, &outcome, samples);
                let ack = Message::Ack {
                    request_id,
                    shard: shard.id(),
                    version,
                    staleness: staleness.min(u64::from(u32::MAX)) as u32,
                };
                self.send(wire::encode(&ack)).await
            }
            Message::Bye { .. } => Step::Close("worker said bye".into()),
            Message::Welcome { .. }
            | Message::Params { .. }
            | Message::Ack { .. }
            | Message::Error { .. } => {
                self.fail(
                    request_id,
                    ErrorCode::Protocol,
                    "a worker sent a shard-side message".into(),
                )
                .await
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::ShardOptions;
    use crowdgrad_core::optim::{OptimizerConfig, Rule};
    use crowdgrad_core::partition::KeyRange;
    use crowdgrad_core::shard::{Consistency, StalenessPolicy};
    use crowdgrad_core::wire::{ClientKind, Hello};
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
