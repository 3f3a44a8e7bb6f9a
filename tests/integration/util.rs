//! The one test harness (ripgrep's `tests/util.rs`): MNIST loaded once, servers on ephemeral
//! ports, raw WebSocket clients, and everything a test needs to own a process: the `crowdgrad`
//! binary's path ([`binary`], honouring `CARGO_TARGET_DIR`), a kill-on-drop guard that also
//! reaps ([`Proc`]), the "listening on" line's parse ([`listening_addr`]), and the Hello frame
//! builder ([`hello`]) with the join and handshake helpers around it. `scaffolding.rs` fails
//! when a test file grows a second copy of any of these.

use crowdgrad::config::ServeConfig;
use crowdgrad::support::data::TrainTest;
use crowdgrad::Running;
use crowdgrad_core::spec::{JoinRequest, JoinResponse};
use crowdgrad_core::wire::{self, ClientKind, Hello, Message as Frame, PROTOCOL_VERSION};
use futures_util::{SinkExt, StreamExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// A raw client socket.
pub type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// The workspace root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The repository's data directory for MNIST.
pub fn mnist_dir() -> PathBuf {
    root().join("data/mnist")
}

/// Cargo's target directory: `CARGO_TARGET_DIR` when set (relative to the workspace root, as
/// cargo reads it), else the one this test binary was built into, else `target/`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) if !d.is_empty() => root().join(d),
        _ => profile_dir()
            .and_then(|p| p.parent().map(Path::to_path_buf))
            .unwrap_or_else(|| root().join("target")),
    }
}

/// The profile directory this test binary was built into (`<target>/<profile>`, the parent of
/// the `deps/` directory that holds `integration-HASH`).
fn profile_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    Some(exe.parent()?.parent()?.to_path_buf())
}

/// The `crowdgrad` binary of the profile the tests were built in (`release` under
/// `cargo test --release`): in `CARGO_TARGET_DIR` when that is set, else next to this test
/// binary. Panics, saying how to build it, when it is missing.
pub fn binary() -> PathBuf {
    let here = profile_dir().expect("the test binary's directory");
    let profile = here
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "release".into());
    let mut tried = vec![target_dir().join(&profile).join("crowdgrad")];
    tried.push(here.join("crowdgrad"));
    tried.dedup();
    if let Some(b) = tried.iter().find(|b| b.is_file()) {
        return b.clone();
    }
    let flag = if profile == "debug" { "" } else { " --release" };
    panic!(
        "no crowdgrad binary at {tried:?}: run `cargo build{flag} -p crowdgrad` first (cargo xtask test does)"
    );
}

/// A `crowdgrad` command: [`binary`], run from the workspace root.
pub fn crowdgrad() -> Command {
    let mut c = Command::new(binary());
    c.current_dir(root());
    c
}

/// A fresh, empty scratch directory `<target>/tmp/<area>/<name>-<pid>` (kept after the test,
/// so its files can be read when one fails).
pub fn scratch(area: &str, name: &str) -> PathBuf {
    let d = target_dir()
        .join("tmp")
        .join(area)
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("scratch dir");
    d
}

/// The address in a `... listening on URL` line (`crowdgrad serve` prints
/// `crowdgrad listening on http://ADDR`, `crowdgrad shard` `crowdgrad shard I of N listening
/// on ws://ADDR`): the URL as printed, or `None` for any other line.
pub fn listening_addr(line: &str) -> Option<&str> {
    line.split_once(" listening on ")
        .map(|(_, url)| url.trim())
        .filter(|url| !url.is_empty())
}

/// A child process the test owns: killed and reaped when dropped, so a failing test leaves no
/// process behind. Its stdout and stderr go to files (readable while it runs and after), which
/// are removed with it unless the test is panicking (then their paths are printed).
pub struct Proc {
    child: Child,
    tag: String,
    out: PathBuf,
    err: PathBuf,
}

impl Proc {
    /// Starts `cmd` (stdin closed, stdout and stderr to files named after `tag`).
    pub fn spawn(mut cmd: Command, tag: &str) -> Proc {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = target_dir()
            .join("tmp/procs")
            .join(std::process::id().to_string());
        std::fs::create_dir_all(&dir).expect("process log dir");
        let stem = format!("{n:03}-{tag}");
        let (out, err) = (
            dir.join(format!("{stem}.out")),
            dir.join(format!("{stem}.err")),
        );
        let child = cmd
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).expect("stdout file"))
            .stderr(std::fs::File::create(&err).expect("stderr file"))
            .spawn()
            .unwrap_or_else(|e| panic!("{tag}: cannot start {cmd:?}: {e}"));
        Proc {
            child,
            tag: tag.into(),
            out,
            err,
        }
    }

    /// `crowdgrad <args>` ([`crowdgrad`]) as a [`Proc`].
    pub fn crowdgrad(tag: &str, args: &[&str]) -> Proc {
        let mut c = crowdgrad();
        c.args(args);
        Proc::spawn(c, tag)
    }

    /// Waits (at most `within`) for the `... listening on URL` line on stdout and returns the
    /// URL ([`listening_addr`]); panics with its stderr if it exits first or never listens.
    pub fn listening(&mut self, within: Duration) -> String {
        let started = Instant::now();
        loop {
            if let Some(url) = self.stdout().lines().find_map(listening_addr) {
                return url.to_string();
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "{} exited with {status} before listening: {}",
                    self.tag,
                    self.stderr()
                );
            }
            assert!(
                started.elapsed() < within,
                "{} did not listen within {within:?}: {}",
                self.tag,
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Its process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGKILL (a crash: nothing written on the way out), then reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends SIGTERM (the way a supervisor asks it to stop); panics if the signal cannot be sent.
    pub fn terminate(&self) {
        let sent = Command::new("kill")
            .args(["-TERM", &self.id().to_string()])
            .status()
            .expect("kill -TERM");
        assert!(sent.success(), "{}: kill -TERM failed", self.tag);
    }

    /// Its exit status once it exits by itself, polled every 20 ms; `None` after `within`
    /// (it is still running then; dropping it kills it).
    pub async fn exit_within(&mut self, within: Duration) -> Option<ExitStatus> {
        let started = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                return Some(s);
            }
            if started.elapsed() > within {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Everything it wrote to stdout so far.
    pub fn stdout(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    /// Everything it wrote to stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    /// The complete lines it wrote to stderr so far (not one it is still writing).
    pub fn stderr_lines(&self) -> Vec<String> {
        let text = self.stderr();
        let done = text.rfind('\n').map_or("", |end| &text[..end]);
        done.lines().map(str::to_string).collect()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!(
                "{}: output kept in {} and {}",
                self.tag,
                self.out.display(),
                self.err.display()
            );
        } else {
            let _ = std::fs::remove_file(&self.out);
            let _ = std::fs::remove_file(&self.err);
        }
    }
}

/// Real MNIST, fetched (SHA-256 verified) on first use and parsed once per test binary.
pub fn mnist() -> TrainTest {
    static DATA: OnceLock<TrainTest> = OnceLock::new();
    DATA.get_or_init(|| {
        crowdgrad::support::data::ensure(&mnist_dir(), "mnist", true).expect("MNIST is available")
    })
    .clone()
}

/// The flags the in-process tests' servers add to `serve`'s defaults: gradient pushes
/// (H = 1), no egress budget and no spot checks.
///
/// - H = 1 and no budget: the tests count frames, versions and refusals per push, and a server
///   paced under `--local-steps auto` (serve's default since issue 18) would make those counts
///   depend on each worker's speed; the tests of local steps and pacing set their own.
/// - Spot checks off: `serve` spot-checks by default since issue 21 (`--spot-check auto`), and
///   most tests here speak the protocol with raw frames that carry no push tag (a
///   spot-checking shard refuses those, `protocol`), count exact versions and acceptances, or
///   test a defence that spot checks would pre-empt (a sign-flipper the robust rules must
///   handle is quarantined by its first check). A test of spot checks turns them on itself
///   (`cfg.spot.fraction`).
///
/// The real defaults are run by
/// `spotcheck::a_default_server_spot_checks_and_checks_new_identities_first` and by the
/// `attacks`, `training`, `durability` and `lm` tests that spawn `crowdgrad serve`.
pub const TEST_FLAGS: [&str; 6] = [
    "--local-steps",
    "1",
    "--egress-budget",
    "off",
    "--spot-check",
    "0",
];

/// Server defaults with [`TEST_FLAGS`] and evaluation every half second.
pub fn config() -> ServeConfig {
    let mut c = ServeConfig::with_flags(mnist_dir(), &TEST_FLAGS).expect("valid test flags");
    c.eval_every = Duration::from_millis(500);
    c.web_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../web");
    c
}

/// Starts a server on an ephemeral loopback port.
pub async fn server(cfg: ServeConfig) -> Running {
    crowdgrad::start("127.0.0.1:0".parse().expect("addr"), cfg, mnist())
        .await
        .expect("server starts")
}

/// GET a URL, returning status and body.
pub async fn get(url: String) -> (u16, Vec<u8>) {
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let mut r = agent.get(&url).call().expect("request");
        let status = r.status().as_u16();
        (
            status,
            r.body_mut()
                .with_config()
                .limit(1 << 30)
                .read_to_vec()
                .expect("body"),
        )
    })
    .await
    .expect("join")
}

/// POST raw bytes as JSON, returning status and body.
pub async fn post(url: String, body: Vec<u8>) -> (u16, Vec<u8>) {
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let mut r = agent
            .post(&url)
            .header("content-type", "application/json")
            .send(&body[..])
            .expect("request");
        let status = r.status().as_u16();
        (status, r.body_mut().read_to_vec().expect("body"))
    })
    .await
    .expect("join")
}

/// `/api/status` as JSON.
pub async fn status(base: &str) -> serde_json::Value {
    let (code, body) = get(format!("{base}/api/status")).await;
    assert_eq!(code, 200);
    serde_json::from_slice(&body).expect("status JSON")
}

/// POSTs `req` to `/api/join` as it is: status and body (for joins that may be refused).
pub async fn try_join(base: &str, req: &JoinRequest) -> (u16, Vec<u8>) {
    let body = serde_json::to_vec(req).expect("json");
    post(format!("{base}/api/join"), body).await
}

/// A native worker's join as `identity`, as it is: status and body.
pub async fn join_as(base: &str, identity: &str) -> (u16, Vec<u8>) {
    let mut req = JoinRequest::new(ClientKind::Native);
    req.identity = Some(identity.into());
    try_join(base, &req).await
}

/// Joins as a native worker. The session credential is remembered for [`handshake`] and
/// [`credential`].
pub async fn join(base: &str) -> JoinResponse {
    let (code, reply) = try_join(base, &JoinRequest::new(ClientKind::Native)).await;
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&reply));
    let joined: JoinResponse = serde_json::from_slice(&reply).expect("join reply");
    if let Some(c) = &joined.credential {
        credentials()
            .lock()
            .expect("lock")
            .insert((base.to_string(), joined.worker_id), c.clone());
    }
    joined
}

fn credentials() -> &'static std::sync::Mutex<std::collections::HashMap<(String, u64), String>> {
    static CREDS: OnceLock<std::sync::Mutex<std::collections::HashMap<(String, u64), String>>> =
        OnceLock::new();
    CREDS.get_or_init(Default::default)
}

/// The credential [`join`] got for `worker` from the server at `base`.
pub fn credential(base: &str, worker: u64) -> Option<String> {
    credentials()
        .lock()
        .expect("lock")
        .get(&(base.to_string(), worker))
        .cloned()
}

/// Opens shard `shard`'s socket.
pub async fn connect(running: &Running, shard: u32) -> Ws {
    let url = format!("ws://{}/ws/shard/{shard}", running.addr);
    tokio_tungstenite::connect_async(url.as_str())
        .await
        .expect("connect")
        .0
}

/// Sends a binary frame.
pub async fn send(ws: &mut Ws, frame: Vec<u8>) {
    ws.send(Message::Binary(frame.into())).await.expect("send");
}

/// Next binary frame, or `None` when the socket closed; panics after 10 s.
pub async fn recv(ws: &mut Ws) -> Option<Vec<u8>> {
    loop {
        match tokio::time::timeout(Duration::from_secs(10), ws.next())
            .await
            .expect("reply within 10 s")
        {
            Some(Ok(Message::Binary(b))) => return Some(b.into()),
            Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return None,
            Some(Ok(_)) => continue,
        }
    }
}

/// A Hello frame for `worker_id`, to finish with [`HelloFrame::frame`]: request id 1, shard 0,
/// this build's protocol version, a native client, no credential, unless changed.
pub fn hello(worker_id: u64) -> HelloFrame {
    HelloFrame {
        request_id: 1,
        shard: 0,
        hello: Hello {
            protocol: PROTOCOL_VERSION,
            worker_id,
            client: ClientKind::Native,
            ..Default::default()
        },
    }
}

/// A Hello under construction ([`hello`]).
#[derive(Debug, Clone)]
pub struct HelloFrame {
    request_id: u32,
    shard: u32,
    hello: Hello,
}

impl HelloFrame {
    /// The request id its Welcome or Error echoes.
    pub fn request_id(mut self, id: u32) -> Self {
        self.request_id = id;
        self
    }

    /// The shard it is addressed to.
    pub fn shard(mut self, shard: u32) -> Self {
        self.shard = shard;
        self
    }

    /// The protocol version it claims.
    pub fn protocol(mut self, protocol: u32) -> Self {
        self.hello.protocol = protocol;
        self
    }

    /// The session credential it carries.
    pub fn credential(mut self, credential: Option<String>) -> Self {
        self.hello.credential = credential;
        self
    }

    /// The encoded frame.
    pub fn frame(self) -> Vec<u8> {
        wire::encode(&Frame::Hello {
            request_id: self.request_id,
            shard: self.shard,
            hello: self.hello,
        })
    }
}

/// Completes the Hello/Welcome handshake for `worker_id` on `ws`, addressed to `shard`, with the
/// credential [`join`] got from `base`; returns the socket and the shard's version.
pub async fn handshake_on(mut ws: Ws, base: &str, worker_id: u64, shard: u32) -> (Ws, u64) {
    let h = hello(worker_id)
        .shard(shard)
        .credential(credential(base, worker_id))
        .frame();
    send(&mut ws, h).await;
    let reply = recv(&mut ws).await.expect("welcome");
    match wire::decode(&reply, usize::MAX).expect("decodes") {
        Frame::Welcome { welcome, .. } => (ws, welcome.version),
        other => panic!("expected Welcome, got {other:?}"),
    }
}

/// Connects to shard `shard` and completes the handshake ([`handshake_on`]).
pub async fn handshake(running: &Running, worker_id: u64, shard: u32) -> (Ws, u64) {
    let ws = connect(running, shard).await;
    handshake_on(ws, &running.url(), worker_id, shard).await
}

/// Polls `cond` on the status every 100 ms until it holds; panics after `timeout`.
pub async fn wait_for(
    base: &str,
    timeout: Duration,
    what: &str,
    cond: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let start = std::time::Instant::now();
    loop {
        let s = status(base).await;
        if cond(&s) {
            return s;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}; last status: {s}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
