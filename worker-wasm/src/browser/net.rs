//! Thin async wrappers over the worker scope's browser APIs: clock, timers, `fetch`, and the
//! Cache API for the (immutable, content-addressed) data partition files.

use crate::error::{Error, Result};
use js_sys::{Function, Promise, Uint8Array};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::cell::{Cell, RefCell};
use wasm_bindgen::{JsCast, JsValue};
use wasm_bindgen_futures::JsFuture;
use web_sys::{AbortController, Cache, Headers, RequestInit, Response, WorkerGlobalScope};

/// Name of the Cache API cache holding partition files. Bump the suffix if the entries'
/// meaning ever changes.
const CACHE_NAME: &str = "crowdgrad-data-v1";
/// Beyond this many cached files, entries other than the ones just used are dropped (several
/// tabs of one origin share the cache, and a rejoin may hand out another partition).
const MAX_CACHED_FILES: u32 = 8;
/// Longest a join may take, reply included.
pub(crate) const JOIN_TIMEOUT_MS: f64 = 30_000.0;
/// Longest one data file may take to download (a partition is ~7.5 MiB, ~1.5 MiB gzipped).
pub(crate) const DOWNLOAD_TIMEOUT_MS: f64 = 300_000.0;

/// Aborts a request (its body too) when `ms` pass; dropping it cancels the timer.
struct Deadline {
    scope: WorkerGlobalScope,
    controller: AbortController,
    timer: Option<i32>,
    _abort: wasm_bindgen::closure::Closure<dyn FnMut()>,
}

impl Deadline {
    fn new(scope: &Scope, ms: f64) -> Result<Self> {
        let controller = AbortController::new().map_err(|e| js_error("AbortController", e))?;
        let c = controller.clone();
        let abort = wasm_bindgen::closure::Closure::<dyn FnMut()>::new(move || c.abort());
        let timer = scope.set_timeout(abort.as_ref().unchecked_ref(), ms);
        Ok(Self {
            scope: scope.global.clone(),
            controller,
            timer,
            _abort: abort,
        })
    }

    fn attach(&self, init: &RequestInit) {
        init.set_signal(Some(&self.controller.signal()));
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        if let Some(t) = self.timer.take() {
            self.scope.clear_timeout_with_handle(t);
        }
    }
}

/// Text of a JS exception (or whatever was thrown).
pub(crate) fn js_error(what: &'static str, thrown: JsValue) -> Error {
    let message = thrown
        .dyn_ref::<js_sys::Error>()
        .map(|e| String::from(e.message()))
        .or_else(|| thrown.as_string())
        .unwrap_or_else(|| format!("{thrown:?}"));
    Error::Js { what, message }
}

/// The dedicated worker's global scope.
#[derive(Clone)]
pub(crate) struct Scope {
    global: WorkerGlobalScope,
}

impl Scope {
    /// The current scope, which must be a worker's.
    pub(crate) fn current() -> Result<Self> {
        js_sys::global()
            .dyn_into::<WorkerGlobalScope>()
            .map(|global| Self { global })
            .map_err(|_| {
                Error::Config(
                    "BrowserWorker must run inside a Web Worker \
                     (new Worker('worker.js', { type: 'module' }))"
                        .into(),
                )
            })
    }

    /// Milliseconds from a fixed origin (monotonic).
    pub(crate) fn now(&self) -> f64 {
        self.global
            .performance()
            .map_or_else(js_sys::Date::now, |p| p.now())
    }

    fn set_timeout(&self, f: &Function, ms: f64) -> Option<i32> {
        let ms = ms.clamp(0.0, f64::from(i32::MAX)) as i32;
        self.global
            .set_timeout_with_callback_and_timeout_and_arguments_0(f, ms)
            .ok()
    }

    /// Resolves after `ms` milliseconds.
    pub(crate) async fn sleep(&self, ms: f64) {
        let promise = Promise::new(&mut |resolve, _reject| {
            self.set_timeout(&resolve, ms);
        });
        // A timer promise never rejects.
        let _ = JsFuture::from(promise).await;
    }

    async fn fetch(&self, method: &'static str, url: &str, init: &RequestInit) -> Result<Response> {
        init.set_method(method);
        let resp = JsFuture::from(self.global.fetch_with_str_and_init(url, init))
            .await
            .map_err(|e| js_error("fetch", e))?;
        let resp: Response = resp
            .dyn_into()
            .map_err(|e| js_error("fetch returned a non-Response", e))?;
        if !resp.ok() {
            return Err(Error::Http {
                method,
                url: url.to_owned(),
                status: resp.status(),
            });
        }
        Ok(resp)
    }

    /// `POST`s `body` as JSON (with `Authorization: Bearer` when `bearer` is set) and decodes
    /// the JSON reply, all within [`JOIN_TIMEOUT_MS`].
    pub(crate) async fn post_json<B: Serialize, R: DeserializeOwned>(
        &self,
        url: &str,
        body: &B,
        bearer: Option<&str>,
    ) -> Result<R> {
        let json = serde_json::to_string(body).map_err(|e| Error::Json {
            url: url.to_owned(),
            message: e.to_string(),
        })?;
        let headers = Headers::new().map_err(|e| js_error("Headers", e))?;
        headers
            .set("content-type", "application/json")
            .map_err(|e| js_error("Headers.set", e))?;
        if let Some(t) = bearer {
            headers
                .set("authorization", &format!("Bearer {t}"))
                .map_err(|e| js_error("Headers.set", e))?;
        }
        let deadline = Deadline::new(self, JOIN_TIMEOUT_MS)?;
        let init = RequestInit::new();
        deadline.attach(&init);
        init.set_headers(&headers);
        init.set_body(&JsValue::from_str(&json));
        let resp = self.fetch("POST", url, &init).await?;
        let text = JsFuture::from(resp.text().map_err(|e| js_error("Response.text", e))?)
            .await
            .map_err(|e| js_error("reading the response", e))?
            .as_string()
            .unwrap_or_default();
        serde_json::from_str(&text).map_err(|e| Error::Json {
            url: url.to_owned(),
            message: e.to_string(),
        })
    }

    async fn open_cache(&self) -> Option<Cache> {
        // `caches` is missing outside secure contexts (plain http to a LAN address): then the
        // HTTP cache is all there is.
        let storage = self.global.caches().ok()?;
        if storage.is_undefined() || storage.is_null() {
            return None;
        }
        JsFuture::from(storage.open(CACHE_NAME))
            .await
            .ok()?
            .dyn_into()
            .ok()
    }

    /// `GET`s `url` through the Cache API: a cached copy is used as is (the server's data URLs
    /// are content-addressed, so an entry never goes stale). Returns the bytes and whether they
    /// came from the cache. Cache failures (quota, private mode) only cost a download.
    pub(crate) async fn fetch_cached(&self, url: &str) -> Result<(Vec<u8>, bool)> {
        let cache = self.open_cache().await;
        if let Some(cache) = &cache {
            if let Ok(hit) = JsFuture::from(cache.match_with_str(url)).await {
                if let Ok(resp) = hit.dyn_into::<Response>() {
                    if resp.ok() {
                        if let Ok(bytes) = body_bytes(&resp).await {
                            return Ok((bytes, true));
                        }
                    }
                }
            }
        }
        let deadline = Deadline::new(self, DOWNLOAD_TIMEOUT_MS)?;
        let init = RequestInit::new();
        deadline.attach(&init);
        let resp = self.fetch("GET", url, &init).await?;
        if let Some(cache) = &cache {
            if let Ok(copy) = resp.clone() {
                if JsFuture::from(cache.put_with_str(url, &copy)).await.is_ok() {
                    prune(cache, url).await;
                }
            }
        }
        Ok((body_bytes(&resp).await?, false))
    }
}

async fn body_bytes(resp: &Response) -> Result<Vec<u8>> {
    let buf = JsFuture::from(
        resp.array_buffer()
            .map_err(|e| js_error("Response.arrayBuffer", e))?,
    )
    .await
    .map_err(|e| js_error("reading the response", e))?;
    Ok(Uint8Array::new(&buf).to_vec())
}

/// Keeps the cache small: past [`MAX_CACHED_FILES`] entries, drops all but `keep`.
async fn prune(cache: &Cache, keep: &str) {
    let Ok(keys) = JsFuture::from(cache.keys()).await else {
        return;
    };
    let keys = js_sys::Array::from(&keys);
    if keys.length() <= MAX_CACHED_FILES {
        return;
    }
    for key in keys.iter() {
        let Ok(req) = key.dyn_into::<web_sys::Request>() else {
            continue;
        };
        if req.url() != keep {
            let _ = JsFuture::from(cache.delete_with_request(&req)).await;
        }
    }
}

/// A wake-up signal between browser callbacks (socket events, page commands) and the driver's
/// async loop: `notify` resolves the pending `wait`, or makes the next `wait` return at once.
#[derive(Default)]
pub(crate) struct Wake {
    pending: Cell<bool>,
    resolve: RefCell<Option<Function>>,
}

impl Wake {
    /// Wakes the driver.
    pub(crate) fn notify(&self) {
        self.pending.set(true);
        let resolve = self.resolve.borrow_mut().take();
        if let Some(f) = resolve {
            // Resolving a promise runs nothing synchronously, so this cannot re-enter Rust.
            let _ = f.call0(&JsValue::UNDEFINED);
        }
    }

    /// Waits for a `notify` or `timeout_ms`, whichever comes first.
    pub(crate) async fn wait(&self, scope: &Scope, timeout_ms: f64) {
        if self.pending.replace(false) {
            return;
        }
        let mut timer = None;
        let promise = Promise::new(&mut |resolve, _reject| {
            timer = scope.set_timeout(&resolve, timeout_ms);
            *self.resolve.borrow_mut() = Some(resolve);
        });
        let _ = JsFuture::from(promise).await;
        self.resolve.borrow_mut().take();
        if let Some(t) = timer {
            scope.global.clear_timeout_with_handle(t);
        }
        self.pending.set(false);
    }
}
