//! The simulator's shard driver: core's [`ShardState`] and one [`ShardSession`] per simulated
//! connection, on simulated time. Like the server's handler it only moves frames and time;
//! every rule is core's (see [`crowdgrad_core::session`]), so a simulated run follows exactly
//! what the server does. The conformance test plays the same conversations through this driver
//! and through the server over real sockets and compares the frames.

use crowdgrad_core::session::{Action, Admission, Record, ShardAccess, ShardSession, ShardState};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// What the driver asks of the transport, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Send `bytes` down connection `conn`.
    Frame {
        /// The connection.
        conn: u64,
        /// One binary message.
        bytes: Vec<u8>,
    },
    /// Close connection `conn` (after the frames before).
    Close {
        /// The connection.
        conn: u64,
    },
    /// Something to count.
    Record {
        /// The connection.
        conn: u64,
        /// What happened.
        record: Record,
    },
    /// Call [`ShardDriver::timer`] for `conn` at time `at` (seconds).
    Timer {
        /// The connection.
        conn: u64,
        /// When.
        at: f64,
    },
}

/// The shard's state and the workers known to the run: [`ShardAccess`] for the sessions.
#[derive(Debug)]
struct Host {
    state: ShardState,
    known: BTreeSet<u64>,
    /// Whether Welcomes announce spot checks (`--announce-spot-checks`).
    spot_checks: bool,
}

impl ShardAccess for Host {
    fn snapshot(&self) -> (u64, Arc<Vec<f32>>) {
        self.state.snapshot()
    }
    fn snapshot_samples(&self) -> u64 {
        self.state.snapshot_samples()
    }
    fn with<R>(&mut self, f: impl FnOnce(&mut ShardState) -> R) -> R {
        f(&mut self.state)
    }
    fn spot_checks(&self) -> bool {
        self.spot_checks
    }
    fn admit(&self, worker: u64, _credential: Option<&str>) -> Admission {
        if self.known.contains(&worker) {
            Admission::Admitted
        } else {
            Admission::Unknown
        }
    }
}

#[derive(Debug)]
struct Conn {
    session: ShardSession,
    /// The deadline a timer was last asked for.
    timer: Option<f64>,
}

/// One simulated shard and its connections.
#[derive(Debug)]
pub struct ShardDriver {
    host: Host,
    conns: BTreeMap<u64, Conn>,
}

impl ShardDriver {
    /// A shard over `state`, with no connection and no known worker. With `spot_checks` its
    /// Welcomes announce spot checks and it refuses untagged pushes, as a spot-checking
    /// server's shard does; it never draws a push for a check.
    pub fn new(state: ShardState, spot_checks: bool) -> Self {
        Self {
            host: Host {
                state,
                known: BTreeSet::new(),
                spot_checks,
            },
            conns: BTreeMap::new(),
        }
    }

    /// The shard's state.
    pub fn state(&self) -> &ShardState {
        &self.host.state
    }

    /// The shard's norm reference at `now` ([`ShardState::norm_reference`]): what the
    /// report shows, never a worker.
    pub fn norm_reference(&mut self, now: f64) -> Option<f32> {
        self.host.state.norm_reference(now)
    }

    /// `zeno`: the shard's slice of the validation gradient ([`ShardState::set_reference`]).
    pub fn set_reference(&mut self, slice: &[f32]) {
        self.host.state.set_reference(slice);
    }

    /// `worker` joined the run (what `POST /api/join` does on the server).
    pub fn register(&mut self, worker: u64) {
        self.host.known.insert(worker);
    }

    /// A connection opened.
    pub fn open(&mut self, conn: u64) {
        let session = ShardSession::new(*self.host.state.config());
        self.conns.insert(
            conn,
            Conn {
                session,
                timer: None,
            },
        );
    }

    /// Whether `conn` is open.
    pub fn is_open(&self, conn: u64) -> bool {
        self.conns.contains_key(&conn)
    }

    /// A binary message arrived on `conn`.
    pub fn receive(&mut self, conn: u64, bytes: &[u8], now: f64, out: &mut Vec<Output>) {
        self.on(conn, now, out, |s, h| s.handle_frame(h, bytes, now));
    }

    /// The worker closed `conn`.
    pub fn close(&mut self, conn: u64, now: f64, out: &mut Vec<Output>) {
        self.on(conn, now, out, |s, h| s.handle_close(h));
    }

    /// A timer of `conn` fired.
    pub fn timer(&mut self, conn: u64, now: f64, out: &mut Vec<Output>) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.timer = None;
        }
        self.on(conn, now, out, |s, h| s.handle_timeout(h, now));
    }

    /// Feeds one event to `conn`'s session, then wakes every waiting session while the shard
    /// keeps changing (a push may release a pull, whose held frames may release another).
    fn on(
        &mut self,
        conn: u64,
        now: f64,
        out: &mut Vec<Output>,
        event: impl FnOnce(&mut ShardSession, &mut Host),
    ) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let mut epoch = self.host.state.epoch();
        event(&mut c.session, &mut self.host);
        self.drain(conn, out);
        while self.host.state.epoch() != epoch {
            epoch = self.host.state.epoch();
            let waiting: Vec<u64> = self
                .conns
                .iter()
                .filter(|(_, c)| c.session.is_waiting())
                .map(|(&id, _)| id)
                .collect();
            for id in waiting {
                if let Some(c) = self.conns.get_mut(&id) {
                    c.session.handle_update(&mut self.host, now);
                    self.drain(id, out);
                }
            }
        }
        let ids: Vec<u64> = self.conns.keys().copied().collect();
        for id in ids {
            if let Some(c) = self.conns.get_mut(&id) {
                let t = c.session.poll_timeout();
                if t != c.timer {
                    c.timer = t;
                    if let Some(at) = t {
                        out.push(Output::Timer { conn: id, at });
                    }
                }
            }
        }
    }

    fn drain(&mut self, conn: u64, out: &mut Vec<Output>) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        while let Some(a) = c.session.poll_action() {
            out.push(match a {
                Action::Send(frame) => Output::Frame {
                    conn,
                    bytes: frame.into_vec(),
                },
                Action::Close(_) => Output::Close { conn },
                Action::Record(record) => Output::Record { conn, record },
            });
        }
        if c.session.is_closed() {
            self.conns.remove(&conn);
        }
    }
}
