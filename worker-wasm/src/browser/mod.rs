//! The wasm-bindgen surface: [`BrowserWorker`], built once by `web/worker.js` inside a module
//! Web Worker. Its methods only flip flags and wake the driver ([`driver::run`]), which owns the
//! core worker, the sockets and all timing.
//!
//! A tab that uses K cores runs K Web Workers (`web/app.js`), each its own worker with its own
//! sockets, joined as the threads of one volunteer. Each learns which thread it is, and
//! whether it runs against in-memory loopback shards instead of the server, from its script
//! URL's query ([`Setup::from_query`]: `worker.js?thread=0&threads=2&volunteer=KEY`,
//! `&loopback=1&model=mlp:128&batch=32&shards=2`), so `worker.js` stays the same thin shim.

mod driver;
mod net;
mod socket;

use crate::error::Error;
use crate::pace::Throttle;
use crate::progress::Progress;
use crowdgrad_core::spec::Threads;
use js_sys::Function;
use net::{Scope, Wake};
use socket::SocketEvent;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use wasm_bindgen::prelude::*;

/// What the page asked for.
#[derive(Debug, Clone, Copy, Default)]
struct Control {
    started: bool,
    paused: bool,
    stopped: bool,
    throttle: Throttle,
}

/// In-memory loopback shards to train against instead of the server's (to measure this
/// device's compute alone): the run's model text, batch and shard count, on a synthetic
/// MNIST-shaped partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LoopbackRun {
    pub(crate) model: String,
    pub(crate) batch: usize,
    pub(crate) shards: usize,
}

/// What the script URL's query asked of this Web Worker.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Setup {
    /// Which of the tab's threads it is (sent with the join); `None`: the only one.
    pub(crate) threads: Option<Threads>,
    /// Loopback mode.
    pub(crate) loopback: Option<LoopbackRun>,
    /// The volunteer's display name and team, sent with the join (the server trims them to
    /// 64 characters).
    pub(crate) name: Option<String>,
    /// See [`Setup::name`].
    pub(crate) team: Option<String>,
}

impl Setup {
    /// Parses `?thread=I&threads=K&volunteer=KEY[&name=N][&team=T][&loopback=1&model=M&batch=B&shards=S]`
    /// (each part optional; `thread`, `threads` and `volunteer` come together). The identity
    /// is not in the URL, which servers and proxies log: it is a secret, and comes by
    /// [`BrowserWorker::set_identity`].
    ///
    /// # Errors
    /// [`Error::Config`] for a malformed or out-of-range value.
    pub(crate) fn from_query(query: &str) -> crate::error::Result<Self> {
        let mut get = std::collections::HashMap::new();
        for part in query
            .trim_start_matches('?')
            .split('&')
            .filter(|p| !p.is_empty())
        {
            let (k, v) = part.split_once('=').unwrap_or((part, ""));
            // The page builds the query with URLSearchParams: a space is `+` there (a `+`
            // itself is `%2B`).
            let v = js_sys::decode_uri_component(&v.replace('+', " "))
                .ok()
                .and_then(|v| v.as_string())
                .ok_or_else(|| Error::Config(format!("worker URL: bad value of {k}")))?;
            get.insert(k.to_owned(), v);
        }
        let num = |k: &str| -> crate::error::Result<Option<u32>> {
            get.get(k)
                .map(|v| {
                    v.parse::<u32>().map_err(|_| {
                        Error::Config(format!("worker URL: {k}={v:?} is not a number"))
                    })
                })
                .transpose()
        };
        let threads = match (num("thread")?, num("threads")?, get.get("volunteer")) {
            (None, None, None) => None,
            (Some(index), Some(count), Some(v)) => {
                let t = Threads {
                    volunteer: v.clone(),
                    index,
                    count,
                };
                t.check()
                    .map_err(|e| Error::Config(format!("worker URL: {e}")))?;
                Some(t)
            }
            _ => {
                return Err(Error::Config(
                    "worker URL: thread, threads and volunteer go together".into(),
                ))
            }
        };
        let loopback = match get.get("loopback").map(String::as_str) {
            None | Some("0") => None,
            Some(_) => {
                let batch = num("batch")?.unwrap_or(32) as usize;
                let shards = num("shards")?.unwrap_or(2) as usize;
                if !(1..=4096).contains(&batch) || !(1..=64).contains(&shards) {
                    return Err(Error::Config(
                        "worker URL: loopback batch must be 1..=4096 and shards 1..=64".into(),
                    ));
                }
                Some(LoopbackRun {
                    model: get
                        .get("model")
                        .cloned()
                        .unwrap_or_else(|| "mlp:128".into()),
                    batch,
                    shards,
                })
            }
        };
        // Names and teams: any text, at most 256 bytes in the URL (the server keeps 64
        // characters).
        let label = |k: &str| -> crate::error::Result<Option<String>> {
            match get.get(k).map(|v| v.trim()) {
                None | Some("") => Ok(None),
                Some(v) if v.len() <= 256 => Ok(Some(v.to_owned())),
                Some(_) => Err(Error::Config(format!(
                    "worker URL: {k} is longer than 256 bytes"
                ))),
            }
        };
        Ok(Self {
            threads,
            loopback,
            name: label("name")?,
            team: label("team")?,
        })
    }
}

/// State shared between the exported object, the socket callbacks and the driver task.
pub(crate) struct Shared {
    scope: Scope,
    /// `http(s)://host[:port]` of the server, no trailing slash.
    base: String,
    on_progress: Function,
    control: RefCell<Control>,
    /// Socket events not yet handled by the driver.
    events: RefCell<VecDeque<SocketEvent>>,
    wake: Wake,
    /// The latest report (also returned by [`BrowserWorker::progress`]).
    progress: RefCell<Progress>,
    /// A private run's join token (sent as `Authorization: Bearer`; never reported).
    join_token: RefCell<Option<String>>,
    /// The volunteer's identity, a secret (the page keeps it in `localStorage`, which a Web
    /// Worker cannot read, and posts it: [`BrowserWorker::set_identity`]), sent with every
    /// join so the server's ledger credits its public id across sessions and reloads; `None`:
    /// not credited. Never reported.
    pub(crate) identity: RefCell<Option<String>>,
    /// Thread and loopback mode, from the script URL.
    setup: Setup,
}

impl Shared {
    /// Posts the current report to the page.
    fn post(&self) {
        let json = self.progress.borrow().to_json();
        match js_sys::JSON::parse(&json) {
            Ok(v) => {
                if let Err(e) = self.on_progress.call1(&JsValue::NULL, &v) {
                    web_sys::console::warn_2(&"crowdgrad: progress callback threw".into(), &e);
                }
            }
            Err(e) => web_sys::console::warn_2(&"crowdgrad: bad progress JSON".into(), &e),
        }
    }
}

fn js(e: Error) -> JsError {
    JsError::new(&e.to_string())
}

/// A volunteer's worker: joins the server at `base_url`, trains on its partition and reports
/// progress through a callback, until stopped. Build it inside a module Web Worker.
#[wasm_bindgen]
pub struct BrowserWorker {
    shared: Rc<Shared>,
}

#[wasm_bindgen]
impl BrowserWorker {
    /// A worker for the server at `base_url` (`http://host:port`, usually `self.location.origin`)
    /// that calls `on_progress(report)` with a plain object a few times a second.
    ///
    /// # Errors
    /// When not inside a Web Worker or `base_url` is not an http(s) URL.
    #[wasm_bindgen(constructor)]
    pub fn new(base_url: &str, on_progress: Function) -> Result<BrowserWorker, JsError> {
        console_error_panic_hook::set_once();
        let scope = Scope::current().map_err(js)?;
        let base = base_url.trim_end_matches('/').to_owned();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(js(Error::Config(format!(
                "server URL {base_url:?} is not http(s)"
            ))));
        }
        let query = js_sys::Reflect::get(&js_sys::global(), &"location".into())
            .and_then(|l| js_sys::Reflect::get(&l, &"search".into()))
            .ok()
            .and_then(|s| s.as_string())
            .unwrap_or_default();
        let setup = Setup::from_query(&query).map_err(js)?;
        let progress = Progress {
            throttle_percent: Throttle::default().percent(),
            thread: setup.threads.as_ref().map(|t| t.index),
            threads: setup.threads.as_ref().map_or(1, |t| t.count),
            loopback: setup.loopback.is_some(),
            ..Progress::default()
        };
        Ok(Self {
            shared: Rc::new(Shared {
                scope,
                base,
                on_progress,
                control: RefCell::new(Control::default()),
                events: RefCell::new(VecDeque::new()),
                wake: Wake::default(),
                progress: RefCell::new(progress),
                join_token: RefCell::new(None),
                identity: RefCell::new(None),
                setup,
            }),
        })
    }

    /// Sets a private run's join token (from the page's URL fragment or a field), used by the
    /// next join; an empty string clears it.
    pub fn set_join_token(&self, token: &str) {
        let t = token.trim();
        *self.shared.join_token.borrow_mut() = (!t.is_empty()).then(|| t.to_owned());
    }

    /// Sets the volunteer's identity (a secret: 8 to 64 characters of `[A-Za-z0-9_-]`, as the
    /// server requires; the page makes 32 random hex digits), sent with the next join; an
    /// empty string clears it.
    ///
    /// # Errors
    /// For anything else (the worker keeps the identity it had).
    pub fn set_identity(&self, identity: &str) -> Result<(), JsError> {
        let id = identity.trim();
        let ok = id.is_empty()
            || ((8..=64).contains(&id.len())
                && id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
        if !ok {
            return Err(js(Error::Config(
                "identity must be 8 to 64 characters of A-Z a-z 0-9 - _".into(),
            )));
        }
        *self.shared.identity.borrow_mut() = (!id.is_empty()).then(|| id.to_owned());
        Ok(())
    }

    /// Starts contributing (once; later calls do nothing).
    pub fn start(&self) {
        let mut c = self.shared.control.borrow_mut();
        if c.started || c.stopped {
            return;
        }
        c.started = true;
        drop(c);
        wasm_bindgen_futures::spawn_local(driver::run(self.shared.clone()));
    }

    /// Stops computing and closes the shard connections until [`BrowserWorker::resume`].
    pub fn pause(&self) {
        self.shared.control.borrow_mut().paused = true;
        self.shared.progress.borrow_mut().paused = true;
        self.shared.wake.notify();
    }

    /// Reconnects and carries on after [`BrowserWorker::pause`].
    pub fn resume(&self) {
        self.shared.control.borrow_mut().paused = false;
        self.shared.progress.borrow_mut().paused = false;
        self.shared.wake.notify();
    }

    /// Limits computing to `percent` % of wall time (e.g. 25, 50 or 100).
    ///
    /// # Errors
    /// When `percent` is outside 1..=100.
    pub fn set_throttle(&self, percent: u32) -> Result<(), JsError> {
        let t = Throttle::from_percent(percent).map_err(js)?;
        self.shared.control.borrow_mut().throttle = t;
        self.shared.progress.borrow_mut().throttle_percent = t.percent();
        self.shared.wake.notify();
        Ok(())
    }

    /// Leaves for good: closes the connections; the object cannot be started again.
    pub fn stop(&self) {
        self.shared.control.borrow_mut().stopped = true;
        self.shared.wake.notify();
    }

    /// The latest progress report, as posted to the callback.
    ///
    /// # Errors
    /// Never in practice (the report is plain JSON).
    pub fn progress(&self) -> Result<JsValue, JsError> {
        js_sys::JSON::parse(&self.shared.progress.borrow().to_json())
            .map_err(|_| JsError::new("progress is not JSON"))
    }
}
