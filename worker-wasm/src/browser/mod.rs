//! The wasm-bindgen surface: [`BrowserWorker`], built once by `web/worker.js` inside a module
//! Web Worker. Its methods only flip flags and wake the driver ([`driver::run`]), which owns the
//! core worker, the sockets and all timing.

mod driver;
mod net;
mod socket;

use crate::error::Error;
use crate::pace::Throttle;
use crate::progress::Progress;
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
        let progress = Progress {
            throttle_percent: Throttle::default().percent(),
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
            }),
        })
    }

    /// Sets a private run's join token (from the page's URL fragment or a field), used by the
    /// next join; an empty string clears it.
    pub fn set_join_token(&self, token: &str) {
        let t = token.trim();
        *self.shared.join_token.borrow_mut() = (!t.is_empty()).then(|| t.to_owned());
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
