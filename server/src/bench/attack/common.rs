//! What the attacks share: the servers under attack, honest `crowdgrad work` children, a
//! raw-protocol client bound to a chosen loopback address, plain HTTP from a chosen address,
//! an honest-gradient oracle (core's model on the real MNIST training set) and the verdict
//! rows the summary prints.

use super::super::crowd::dechunk;
use super::super::load::{open, Server, Ws};
use crate::error::{Error, Result};
use crowdgrad_core::codec::Encoding;
use crowdgrad_core::data::{BatchSampler, Dataset};
use crowdgrad_core::model::{Model, Workspace};
use crowdgrad_core::spec::{JoinRequest, JoinResponse};
use crowdgrad_core::wire::{
    self, ClientKind, ErrorCode, Hello, Message as Frame, PushTag, Report, Welcome,
    PROTOCOL_VERSION,
};
use futures_util::{SinkExt, StreamExt};
use ndarray::Array2;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::Message;

/// How long one network step (connect, reply frame, HTTP answer) may take.
pub(super) const STEP: Duration = Duration::from_secs(15);

/// The servers attacked: a default `serve`, and one with spot checks and quarantine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `serve` with its defaults.
    Default,
    /// `serve --spot-check 0.5 --quarantine-rejections 5`.
    Spot,
}

/// How the attacked servers exchange with workers (`bench attack --local-steps`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exchange {
    /// `--local-steps 1 --egress-budget off`: gradient pushes without pacing. The attackers'
    /// pushes are batch gradients ([`Oracle`]), honest pushes at H = 1 only.
    Gradients,
    /// No exchange flag at all: `serve`'s real defaults, `--local-steps auto` and
    /// `--egress-budget 400mbit`. The attackers' pushes are round pushes formed by core's
    /// worker ([`super::rounds::Rounds`]).
    Defaults,
    /// `--local-steps H` (2 to 10,000), the egress budget at its default; round pushes as
    /// under [`Exchange::Defaults`].
    Fixed(u32),
}

impl Exchange {
    /// Parses `1`, `auto` or a whole number of local steps from 2 to 10,000.
    ///
    /// # Errors
    /// [`Error::Config`] naming the value.
    pub fn parse(text: &str) -> Result<Self> {
        match text.trim() {
            "1" => Ok(Exchange::Gradients),
            "auto" => Ok(Exchange::Defaults),
            t => match t.parse::<u32>() {
                Ok(h) if (2..=crowdgrad_core::local::MAX_LOCAL_STEPS).contains(&h) => {
                    Ok(Exchange::Fixed(h))
                }
                _ => Err(Error::Config(format!(
                    "--local-steps {t}: use 1, auto or a whole number from 2 to {}",
                    crowdgrad_core::local::MAX_LOCAL_STEPS
                ))),
            },
        }
    }

    /// Whether workers push round pseudo-gradients (anything but H = 1).
    pub fn rounds(self) -> bool {
        self != Exchange::Gradients
    }

    /// The `serve` flags it takes.
    fn flags(self) -> Vec<String> {
        let v: Vec<String> = match self {
            Exchange::Gradients => vec!["--local-steps", "1", "--egress-budget", "off"]
                .into_iter()
                .map(String::from)
                .collect(),
            Exchange::Defaults => Vec::new(),
            Exchange::Fixed(h) => vec!["--local-steps".into(), h.to_string()],
        };
        v
    }
}

impl Mode {
    /// The name printed (and taken by `--servers`).
    pub fn name(self) -> &'static str {
        match self {
            Mode::Default => "default",
            Mode::Spot => "spot",
        }
    }

    /// The server's name in the verdicts: the mode, and `@auto` or `@H` for round pushes.
    pub fn label(self, exchange: Exchange) -> String {
        match exchange {
            Exchange::Gradients => self.name().into(),
            Exchange::Defaults => format!("{}@auto", self.name()),
            Exchange::Fixed(h) => format!("{}@{h}", self.name()),
        }
    }

    /// The `serve` flags of this mode under `exchange`: the server's defaults (spot checks
    /// `auto`, probation, the norm reference, every limit) plus the exchange's flags
    /// ([`Exchange::flags`]: none at all for the real defaults), and for [`Mode::Spot`]
    /// `--spot-check 0.5 --quarantine-rejections 5`. With [`Exchange::Gradients`] the
    /// attackers speak gradient pushes: their oracle computes a batch's gradient, which is an
    /// honest push at H = 1 and not under `serve`'s default `auto`, where a round's push is
    /// the inner optimizer's pseudo-gradient (a spot check of the oracle's "honest" push
    /// would fail there); under the other exchanges they push rounds formed by core's worker.
    pub fn flags(self, exchange: Exchange) -> Vec<String> {
        let spot: &[&str] = match self {
            Mode::Default => &[],
            Mode::Spot => &["--spot-check", "0.5", "--quarantine-rejections", "5"],
        };
        let mut v = exchange.flags();
        v.extend(spot.iter().map(|s| (*s).to_string()));
        v
    }
}

/// What the attacks need to start servers and workers.
pub(super) struct Ctx {
    pub exe: PathBuf,
    pub data_dir: PathBuf,
    /// Extra flags for every `serve`, after the mode's.
    pub serve_args: Vec<String>,
    /// Seconds each timed attack runs (honest workers train this long).
    pub seconds: f64,
    /// Honest workers in the sybil and poison runs.
    pub honest: usize,
    /// Sybils.
    pub sybils: usize,
    /// The training set, loaded once for the gradient oracle.
    pub train: std::sync::OnceLock<Dataset>,
    /// How the servers exchange (`--local-steps`).
    pub exchange: Exchange,
}

impl Ctx {
    /// Starts a `serve` child in `mode` with `extra` flags (before the caller's own).
    pub fn serve(&self, mode: Mode, extra: &[String]) -> Result<Server> {
        let mut args = mode.flags(self.exchange);
        args.extend(extra.iter().cloned());
        args.extend(self.serve_args.iter().cloned());
        Server::start(&self.exe, &self.data_dir, &args, &[])
    }

    /// Starts `crowdgrad work` (one thread, quiet) with `extra` flags.
    pub fn work(&self, url: &str, extra: &[&str]) -> Result<Child> {
        Command::new(&self.exe)
            .args(["work", "--quiet", "--threads", "1", "--server", url])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| Error::io("starting a worker", e))
    }

    /// The training set (loaded on first use).
    pub fn train(&self) -> Result<&Dataset> {
        if self.train.get().is_none() {
            let tt = crate::support::data::load_dir(&self.data_dir)?;
            let _ = self.train.set(tt.train);
        }
        self.train
            .get()
            .ok_or_else(|| Error::Process("training set".into()))
    }
}

/// Children killed when dropped (a failed attack leaves nothing behind).
pub(super) struct Children(pub Vec<Child>);

impl Children {
    /// Whether every child has exited.
    pub fn all_done(&mut self) -> bool {
        self.0.iter_mut().all(|c| !matches!(c.try_wait(), Ok(None)))
    }

    /// Waits (bounded by `within`) for every child to exit; false when one outlived it.
    pub async fn wait(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while !self.all_done() {
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        true
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// One HTTP/1.1 request from the loopback address `from` with `Connection: close`: status,
/// body (de-chunked, at most 8 MiB) and the time to the last byte.
pub(super) async fn http(
    addr: SocketAddr,
    from: [u8; 4],
    method: &str,
    path: &str,
    body: &[u8],
) -> Result<(u16, Vec<u8>, Duration)> {
    let t = Instant::now();
    let socket = tokio::net::TcpSocket::new_v4().map_err(|e| Error::io("socket", e))?;
    socket
        .bind(SocketAddr::from((from, 0)))
        .map_err(|e| Error::io("bind a loopback address", e))?;
    let mut out = Vec::new();
    tokio::time::timeout(STEP, async {
        let mut s = socket.connect(addr).await?;
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await?;
        s.write_all(body).await?;
        (&mut s).take(8 << 20).read_to_end(&mut out).await
    })
    .await
    .map_err(|_| Error::Http(format!("{method} {path}: no answer within {STEP:?}")))?
    .map_err(|e| Error::io("http", e))?;
    let elapsed = t.elapsed();
    let split = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| Error::Http(format!("{method} {path}: reply without a header end")))?;
    let head = String::from_utf8_lossy(&out[..split]).to_ascii_lowercase();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or_else(|| Error::Http("reply without a status".into()))?;
    let mut b = out[split + 4..].to_vec();
    if head.contains("transfer-encoding: chunked") {
        b = dechunk(&b);
    }
    Ok((status, b, elapsed))
}

/// `GET path` as JSON from 127.0.0.1.
pub(super) async fn get_json(addr: SocketAddr, path: &str) -> Result<serde_json::Value> {
    let (code, b, _) = http(addr, [127, 0, 0, 1], "GET", path, b"").await?;
    if code != 200 {
        return Err(Error::Http(format!("GET {path}: {code}")));
    }
    serde_json::from_slice(&b).map_err(|e| Error::Http(format!("GET {path}: {e}")))
}

/// `POST /api/join` from `from`: the status and the reply (when 200).
pub(super) async fn join(
    addr: SocketAddr,
    from: [u8; 4],
    identity: Option<&str>,
    name: Option<&str>,
) -> Result<(u16, Option<JoinResponse>, String)> {
    let mut req = JoinRequest::new(ClientKind::Native);
    req.identity = identity.map(str::to_string);
    req.name = name.map(str::to_string);
    let body = serde_json::to_vec(&req).map_err(|e| Error::Http(e.to_string()))?;
    let (code, b, _) = http(addr, from, "POST", "/api/join", &body).await?;
    let text = String::from_utf8_lossy(&b[..b.len().min(200)]).to_string();
    if code != 200 {
        return Ok((code, None, text));
    }
    let j = serde_json::from_slice(&b).map_err(|e| Error::Http(format!("join reply: {e}")))?;
    Ok((code, Some(j), text))
}

/// Waits (at most `within`) until `pred` holds for `/api/status`; the last status read.
pub(super) async fn wait_status(
    addr: SocketAddr,
    within: Duration,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> Option<serde_json::Value> {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(s) = get_json(addr, "/api/status").await {
            if pred(&s) {
                return Some(s);
            }
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The test accuracy of the final parameters (%): waits for an evaluation made after the
/// training stopped.
pub(super) async fn final_accuracy(addr: SocketAddr) -> f64 {
    // The evaluator runs every --eval-every (1 s by default).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    get_json(addr, "/api/status")
        .await
        .ok()
        .and_then(|s| s["eval"]["accuracy"].as_f64())
        .map_or(f64::NAN, |a| a * 100.0)
}

/// Pushes of the workers whose name starts with `prefix`, from `/api/workers`.
#[derive(Debug, Clone, Default)]
pub(super) struct Pushes {
    /// Applied or buffered.
    pub accepted: u64,
    /// Refused.
    pub refused: u64,
    /// Refusals by reason.
    pub reasons: BTreeMap<String, u64>,
}

impl Pushes {
    /// Accepted share, %.
    pub fn share(&self) -> f64 {
        100.0 * self.accepted as f64 / (self.accepted + self.refused).max(1) as f64
    }

    /// `a accepted / r refused (x%)` and the reasons.
    pub fn describe(&self) -> String {
        let why: Vec<String> = self
            .reasons
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        format!(
            "{} accepted / {} refused ({:.2}%){}",
            self.accepted,
            self.refused,
            self.share(),
            if why.is_empty() {
                String::new()
            } else {
                format!(" [{}]", why.join(", "))
            }
        )
    }
}

/// The pushes of every worker named `prefix…`.
pub(super) async fn pushes_of(addr: SocketAddr, prefix: &str) -> Result<Pushes> {
    let w = get_json(addr, "/api/workers?limit=1000").await?;
    let mut p = Pushes::default();
    for row in w["workers"].as_array().into_iter().flatten() {
        if !row["name"].as_str().is_some_and(|n| n.starts_with(prefix)) {
            continue;
        }
        let n = |k: &str| row[k].as_u64().unwrap_or(0);
        p.accepted += n("pushes_applied") + n("pushes_buffered");
        p.refused += n("pushes_rejected");
        if let Some(r) = row["rejected_by_reason"].as_object() {
            for (k, v) in r {
                *p.reasons.entry(k.clone()).or_default() += v.as_u64().unwrap_or(0);
            }
        }
    }
    Ok(p)
}

/// What the server answered to one push.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Reply {
    /// Acknowledged (applied or buffered).
    Ack,
    /// Refused with this code.
    Refused(ErrorCode),
    /// The socket closed (or nothing came within [`STEP`]).
    Closed,
}

impl Reply {
    /// `ack`, the refusal code's name, or `closed`.
    pub fn name(&self) -> String {
        match self {
            Reply::Ack => "ack".into(),
            Reply::Refused(c) => c.name().to_string(),
            Reply::Closed => "closed".into(),
        }
    }
}

/// The spot checker's counters from `/api/status` (its recent checks left out).
pub(super) fn spot_summary(status: &serde_json::Value) -> String {
    let s = &status["spot_checks"];
    if s.is_null() {
        return "off".into();
    }
    let n = |k: &str| s[k].as_u64().unwrap_or(0);
    format!(
        "fraction {}, history {}, sampled {}, passed {}, failed {}, refused busy {}, dropped (queue) {}, refused_version {}, skipped_version {}, rollbacks {} ({} versions undone, {} poisoned, {} kept), healed {}",
        s["fraction"].as_f64().unwrap_or(0.0),
        n("history"),
        n("sampled"),
        n("passed"),
        n("failed"),
        n("refused_busy"),
        n("dropped_queue"),
        n("refused_version"),
        n("skipped_version"),
        n("rollbacks"),
        n("versions_undone"),
        n("poisoned_undone"),
        n("poisoned_kept"),
        n("healed")
    )
}

/// Replies counted by name.
#[derive(Debug, Clone, Default)]
pub(super) struct Tally(pub BTreeMap<String, u64>);

impl Tally {
    pub fn add(&mut self, r: &Reply) {
        *self.0.entry(r.name()).or_default() += 1;
    }

    pub fn get(&self, name: &str) -> u64 {
        self.0.get(name).copied().unwrap_or(0)
    }

    pub fn total(&self) -> u64 {
        self.0.values().sum()
    }

    /// `ack 3, out_of_bounds 12`.
    pub fn describe(&self) -> String {
        if self.0.is_empty() {
            return "none".into();
        }
        let v: Vec<String> = self.0.iter().map(|(k, n)| format!("{k} {n}")).collect();
        v.join(", ")
    }
}

/// One shard socket of a [`Raw`] client.
pub(super) struct Link {
    pub ws: Ws,
    pub len: usize,
    pub version: u64,
    /// The shard's Welcome (what round pushes need: spot checks, pacing).
    pub welcome: Welcome,
    /// The pace the last Params said, ms (0: none).
    pub pace_ms: u32,
}

/// A raw-protocol client: joined from its own loopback address with a valid credential,
/// a socket on every shard (docs/protocol.md).
pub(super) struct Raw {
    pub addr: SocketAddr,
    pub from: [u8; 4],
    pub joined: JoinResponse,
    pub links: Vec<Link>,
    pub rid: u32,
    /// The batch index the next untagged push claims (one per push on shard 0).
    pub batch: u64,
}

async fn next_frame(ws: &mut Ws, within: Duration) -> Option<Vec<u8>> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, ws.next()).await {
            Ok(Some(Ok(Message::Binary(b)))) => return Some(b.into()),
            Ok(Some(Ok(Message::Close(_)) | Err(_)) | None) | Err(_) => return None,
            Ok(Some(Ok(_))) => {}
        }
    }
}

impl Raw {
    /// Joins from `from` (as `identity`, named `name`) and says Hello on every shard.
    pub async fn join(
        addr: SocketAddr,
        from: [u8; 4],
        identity: Option<&str>,
        name: Option<&str>,
    ) -> Result<Raw> {
        let (code, j, text) = join(addr, from, identity, name).await?;
        let joined = j.ok_or_else(|| Error::Http(format!("join: {code} {text}")))?;
        let mut raw = Raw {
            addr,
            from,
            joined,
            links: Vec::new(),
            rid: 1,
            batch: 0,
        };
        for s in 0..raw.joined.run.shards.len() {
            let l = raw.connect(s as u32).await?;
            raw.links.push(l);
        }
        Ok(raw)
    }

    /// A new socket on shard `s`, with Hello and Welcome.
    async fn connect(&mut self, s: u32) -> Result<Link> {
        let path = self.joined.run.shards[s as usize].path.clone();
        let mut ws = tokio::time::timeout(STEP, open(self.addr, self.from, &path))
            .await
            .map_err(|_| Error::WebSocket("connect timed out".into()))??;
        self.rid = wire::next_request_id(self.rid);
        let h = wire::encode(&Frame::Hello {
            request_id: self.rid,
            shard: s,
            hello: Hello {
                protocol: PROTOCOL_VERSION,
                worker_id: self.joined.worker_id,
                client: ClientKind::Native,
                credential: self.joined.credential.clone(),
                // Told the pace, as a worker is (round pushes choose H from it); nothing
                // makes a client honour it.
                pacing: true,
                ..Default::default()
            },
        });
        ws.send(Message::Binary(h.into()))
            .await
            .map_err(|e| Error::WebSocket(e.to_string()))?;
        let reply = next_frame(&mut ws, STEP)
            .await
            .ok_or_else(|| Error::WebSocket("no Welcome".into()))?;
        match wire::decode(&reply, usize::MAX) {
            Ok(Frame::Welcome { welcome, .. }) => Ok(Link {
                ws,
                len: welcome.range.len(),
                version: welcome.version,
                welcome,
                pace_ms: 0,
            }),
            other => Err(Error::WebSocket(format!("expected Welcome, got {other:?}"))),
        }
    }

    /// Replaces shard `s`'s socket by a new one (a new connection of the same worker).
    pub async fn reconnect(&mut self, s: u32) -> Result<()> {
        let l = self.connect(s).await?;
        self.links[s as usize] = l;
        Ok(())
    }

    /// Every shard's Welcome, in shard order.
    pub fn welcomes(&self) -> Vec<Welcome> {
        self.links.iter().map(|l| l.welcome.clone()).collect()
    }

    /// Slice length of shard `s`.
    pub fn len(&self, s: u32) -> usize {
        self.links[s as usize].len
    }

    /// Pulls shard `s`: its version and values (`None` once the socket closed).
    pub async fn pull(&mut self, s: u32) -> Option<(u64, Vec<f32>)> {
        self.rid = wire::next_request_id(self.rid);
        let rid = self.rid;
        let f = wire::encode(&Frame::Pull {
            request_id: rid,
            shard: s,
            min_version: 0,
        });
        let link = &mut self.links[s as usize];
        link.ws.send(Message::Binary(f.into())).await.ok()?;
        loop {
            let b = next_frame(&mut link.ws, STEP).await?;
            match wire::decode(&b, usize::MAX) {
                Ok(Frame::Params {
                    request_id,
                    version,
                    values,
                    pace_ms,
                    ..
                }) if request_id == rid => {
                    link.version = version;
                    link.pace_ms = pace_ms;
                    return Some((version, values.iter().collect()));
                }
                Ok(Frame::Error { error, .. }) if error.code.is_fatal() => return None,
                _ => {}
            }
        }
    }

    /// Every shard's parameters, concatenated in shard order, and their versions.
    pub async fn pull_all(&mut self) -> Option<(Vec<f32>, Vec<u64>)> {
        let mut params = Vec::new();
        let mut versions = Vec::new();
        for s in 0..self.links.len() as u32 {
            let (v, p) = self.pull(s).await?;
            params.extend(p);
            versions.push(v);
        }
        Some((params, versions))
    }

    /// Sends `frame` on shard `s` and waits for the answer to `rid`.
    pub async fn send(&mut self, s: u32, rid: u32, frame: Vec<u8>) -> Reply {
        let link = &mut self.links[s as usize];
        if link.ws.send(Message::Binary(frame.into())).await.is_err() {
            return Reply::Closed;
        }
        loop {
            let Some(b) = next_frame(&mut link.ws, STEP).await else {
                return Reply::Closed;
            };
            match wire::decode(&b, usize::MAX) {
                Ok(Frame::Ack {
                    request_id,
                    version,
                    ..
                }) if request_id == rid => {
                    link.version = version;
                    return Reply::Ack;
                }
                Ok(Frame::Error {
                    request_id, error, ..
                }) if request_id == rid || request_id == 0 => return Reply::Refused(error.code),
                _ => {}
            }
        }
    }

    /// The push frame of `grad` on shard `s` at the last version seen, claiming one batch,
    /// with `tag`, else a tag as a worker's (the next batch index, the versions last seen):
    /// a spot-checking server refuses untagged pushes.
    pub fn push_frame(&mut self, s: u32, grad: &[f32], tag: Option<&PushTag>) -> (u32, Vec<u8>) {
        let samples = self.joined.run.batch_size as u32;
        self.push_frame_of(s, grad, tag, samples)
    }

    /// [`Raw::push_frame`] claiming `samples` examples (a round of H batches: H × batch
    /// size).
    pub fn push_frame_of(
        &mut self,
        s: u32,
        grad: &[f32],
        tag: Option<&PushTag>,
        samples: u32,
    ) -> (u32, Vec<u8>) {
        self.rid = wire::next_request_id(self.rid);
        let rid = self.rid;
        let v = self.links[s as usize].version;
        let own;
        let tag = match tag {
            Some(t) => t,
            None => {
                if s == 0 {
                    self.batch += 1;
                }
                own = PushTag {
                    batch: self.batch,
                    versions: self.links.iter().map(|l| l.version).collect(),
                };
                &own
            }
        };
        // Only an invalid tag fails to encode (more versions than shards allowed).
        let f = wire::encode_push_tagged(Encoding::F32, rid, s, v, samples, grad, None, tag)
            .unwrap_or_default();
        (rid, f)
    }

    /// Pushes `grad` on shard `s` ([`Raw::push_frame`]) and waits for the reply.
    pub async fn push(&mut self, s: u32, grad: &[f32], tag: Option<&PushTag>) -> Reply {
        let (rid, f) = self.push_frame(s, grad, tag);
        self.send(s, rid, f).await
    }

    /// Pushes `grad` on shard `s` claiming `samples` examples ([`Raw::push_frame_of`]).
    pub async fn push_of(
        &mut self,
        s: u32,
        grad: &[f32],
        tag: Option<&PushTag>,
        samples: u32,
    ) -> Reply {
        let (rid, f) = self.push_frame_of(s, grad, tag, samples);
        self.send(s, rid, f).await
    }

    /// Every shard's version, pace (ms) and values, in shard order, and how long the pulls
    /// took, seconds (`None` once a socket closed).
    pub async fn pull_rounds(&mut self) -> Option<(Vec<(u64, u32, Vec<f32>)>, f64)> {
        let t = Instant::now();
        let mut out = Vec::new();
        for s in 0..self.links.len() as u32 {
            let (v, p) = self.pull(s).await?;
            out.push((v, self.links[s as usize].pace_ms, p));
        }
        Some((out, t.elapsed().as_secs_f64()))
    }

    /// Sends a Report on shard `s`; the code of an Error frame that answers it within
    /// `within`, if any (a report has no reply when taken).
    pub async fn report(
        &mut self,
        s: u32,
        compute_s: f64,
        wall_s: f64,
        within: Duration,
    ) -> Option<ErrorCode> {
        let f = wire::encode(&Frame::Report {
            shard: s,
            report: Report {
                local_steps: 1,
                compute_s,
                wall_s,
                exchange_s: 0.0,
                bytes_up: 0,
                bytes_down: 0,
            },
        });
        let link = &mut self.links[s as usize];
        if link.ws.send(Message::Binary(f.into())).await.is_err() {
            return Some(ErrorCode::ShuttingDown);
        }
        match next_frame(&mut link.ws, within).await {
            Some(b) => match wire::decode(&b, usize::MAX) {
                Ok(Frame::Error { error, .. }) => Some(error.code),
                _ => None,
            },
            None => None,
        }
    }
}

/// An honest gradient for the current parameters: core's model on a batch of the real
/// training set, as a worker computes it (its norm is the honest norm).
pub(super) struct Oracle {
    model: Model,
    data: Dataset,
    ws: Workspace,
    x: Array2<f32>,
    y: Vec<u8>,
    idx: Vec<u32>,
    grad: Vec<f32>,
    ranges: Vec<std::ops::Range<usize>>,
    state: u64,
    /// The joined worker's own partition (normalised) and batch seed: what the server's spot
    /// checker recomputes a tagged push from.
    part: Dataset,
    seed: u64,
}

impl Oracle {
    /// For the run `joined` describes (a copy of the training set, normalised as it says).
    pub fn new(joined: &JoinResponse, data: &Dataset) -> Result<Self> {
        let range = data.partition(joined.partition.index, joined.partition.count)?;
        let mut part = data.subset(range)?;
        part.set_normalize(&joined.run.normalize)?;
        let mut data = data.clone();
        data.set_normalize(&joined.run.normalize)?;
        let model = Model::new(joined.run.model.clone())?;
        let batch = joined.run.batch_size;
        Ok(Oracle {
            ws: model.workspace(batch),
            x: Array2::zeros((batch, data.features)),
            y: vec![0; batch],
            idx: vec![0; batch],
            grad: vec![0.0; model.param_len()],
            ranges: joined
                .run
                .shards
                .iter()
                .map(|d| d.range.start..d.range.end)
                .collect(),
            state: joined.worker_id | 1,
            part,
            seed: crate::defence::spotcheck::batch_seed(joined.run.seed, joined.worker_id),
            model,
            data,
        })
    }

    /// The gradient at `params` (every shard's, concatenated) on a random batch, cut by
    /// shard.
    pub fn gradient(&mut self, params: &[f32]) -> Result<Vec<Vec<f32>>> {
        let n = self.data.len() as u64;
        for i in self.idx.iter_mut() {
            self.state ^= self.state << 13;
            self.state ^= self.state >> 7;
            self.state ^= self.state << 17;
            *i = (self.state % n.max(1)) as u32;
        }
        self.data
            .fill_batch(&self.idx, &mut self.x.view_mut(), &mut self.y);
        self.model
            .loss_and_grad(params, self.x.view(), &self.y, &mut self.grad, &mut self.ws)?;
        Ok(self
            .ranges
            .iter()
            .map(|r| self.grad[r.clone()].to_vec())
            .collect())
    }

    /// The gradient an honest worker pushes tagged with `batch`: on that batch of its own
    /// partition, drawn as the worker and the spot checker draw it (so it passes a check).
    pub fn honest(&mut self, params: &[f32], batch: u64) -> Result<Vec<Vec<f32>>> {
        let mut sampler = BatchSampler::new(self.part.len(), self.seed);
        sampler.skip(batch * self.idx.len() as u64);
        sampler.next_batch(&mut self.idx);
        self.part
            .fill_batch(&self.idx, &mut self.x.view_mut(), &mut self.y);
        self.model
            .loss_and_grad(params, self.x.view(), &self.y, &mut self.grad, &mut self.ws)?;
        Ok(self
            .ranges
            .iter()
            .map(|r| self.grad[r.clone()].to_vec())
            .collect())
    }
}

/// L2 norm.
pub(super) fn norm(v: &[f32]) -> f64 {
    v.iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt()
}

/// A loopback address 127.0.0.x for attacker number `i` (2, 3, ...; 127.0.0.1 is the honest
/// workers').
pub(super) fn attacker_addr(i: usize) -> [u8; 4] {
    [127, 0, 0, (i.min(250) + 2) as u8]
}

/// One line of the summary.
#[derive(Debug, Clone)]
pub struct Verdict {
    /// The attack.
    pub attack: String,
    /// The server ([`Mode::label`]).
    pub server: String,
    /// What happened, in figures.
    pub figures: String,
    /// `holds`, `FAILS: why`, or `-` where nothing is claimed.
    pub verdict: String,
}

/// `holds`, or `FAILS: ` and the failed claims.
pub(super) fn judge(claims: &[(bool, String)]) -> String {
    let failed: Vec<&str> = claims
        .iter()
        .filter(|(ok, _)| !ok)
        .map(|(_, c)| c.as_str())
        .collect();
    if failed.is_empty() {
        "holds".into()
    } else {
        format!("FAILS: {}", failed.join("; "))
    }
}

/// The data directory's training set path exists (a clear error before any server starts).
pub(super) fn check_data(dir: &Path) -> Result<()> {
    if crate::support::data::files(dir).is_none() {
        return Err(Error::Config(format!(
            "no dataset in {} (run `crowdgrad data fetch` first)",
            dir.display()
        )));
    }
    Ok(())
}
