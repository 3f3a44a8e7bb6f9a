//! Helpers the session tests share: a shard, the frames a worker sends, the frames a session
//! sent.

use super::{Action, PushGuard, ShardSession, ShardSetup, ShardState};
use crate::codec::Encoding;
use crate::optim::{OptimizerConfig, Rule};
use crate::partition::KeyRange;
use crate::shard::{Consistency, StalenessPolicy};
use crate::wire::{self, ClientKind, Hello, Message, PROTOCOL_VERSION};

pub(super) fn state(consistency: Consistency, n: usize) -> ShardState {
    let range = KeyRange {
        start: 4,
        end: 4 + n,
    };
    setup(consistency).state(1, range, vec![0.0; n]).unwrap()
}

/// The setup of [`state`]'s shards: plain SGD at learning rate 1, default bounds, the mean.
pub(super) fn setup(consistency: Consistency) -> ShardSetup {
    ShardSetup {
        optimizer: OptimizerConfig {
            rule: Rule::Sgd,
            lr: 1.0,
            weight_decay: 0.0,
            clip_norm: None,
            schedule: Default::default(),
        },
        staleness: StalenessPolicy::default(),
        consistency,
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
    }
}

pub(super) fn hello(rid: u32, worker: u64) -> Vec<u8> {
    wire::encode(&Message::Hello {
        request_id: rid,
        shard: 1,
        hello: Hello {
            protocol: PROTOCOL_VERSION,
            worker_id: worker,
            client: ClientKind::Native,
            ..Default::default()
        },
    })
}

pub(super) fn pull(rid: u32, min_version: u64) -> Vec<u8> {
    wire::encode(&Message::Pull {
        request_id: rid,
        shard: 1,
        min_version,
    })
}

/// The frames sent, decoded to (kind name, request id, version or error code).
pub(super) fn sent(s: &mut ShardSession) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(a) = s.poll_action() {
        match a {
            Action::Send(f) => out.push(match wire::decode(&f.to_vec(), usize::MAX).unwrap() {
                Message::Welcome { request_id, .. } => format!("welcome {request_id}"),
                Message::Params {
                    request_id,
                    version,
                    ..
                } => format!("params {request_id} v{version}"),
                Message::Ack {
                    request_id,
                    version,
                    ..
                } => format!("ack {request_id} v{version}"),
                Message::Error {
                    request_id, error, ..
                } => format!("error {request_id} {}", error.code.name()),
                Message::Bye { .. } => "bye".into(),
                other => format!("{other:?}"),
            }),
            Action::Close(_) => out.push("close".into()),
            Action::Record(_) => {}
        }
    }
    out
}
