//! The HTTP surface: join, status, events (SSE), the worker list (paged), parameters, data
//! partitions, shard WebSockets and the static page.

pub mod admin;
mod history;
mod ledger;

use crate::checkpoint::format::Weights;
use crate::coordinator::app::App;
use crate::net::ConnSlot;
use crate::registry::{MAX_PAGE, RECENT_WORKERS};
use crate::shard::upgrade::ShardUpgrade;
use crate::support::limits::client_ip;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, Path, RawQuery, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Extension;
use axum::{Json, Router};
use crowdgrad_core::spec::{JoinRequest, JoinResponse, PartitionInfo};
use crowdgrad_core::wire::PROTOCOL_VERSION;
use serde_json::json;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tower_http::services::ServeDir;

/// The router for `app`.
pub fn router(app: Arc<App>) -> Router {
    let web = ServeDir::new(&app.cfg.web_dir);
    Router::new()
        .route("/api/join", post(join))
        .route("/api/status", get(status))
        .route("/api/events", get(events))
        .route("/api/workers", get(workers))
        .route("/api/params", get(params))
        .route("/api/reads", get(reads))
        .route("/api/sample", get(sample))
        .merge(admin::routes())
        .merge(history::routes())
        .route("/api/contributors", get(ledger::contributors))
        .route("/ws/shard/{id}", get(ws))
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .fallback_service(web)
        // gzip for clients that ask (the wasm shrinks ~2.5x); server-sent events and WebSocket
        // upgrades are left alone by the predicate, the data parts by their place below.
        .layer(tower_http::compression::CompressionLayer::new())
        // After the layer, so outside it: a part is encoded once, raw and gzip, by
        // coordinator::parts, and the raw form a gzip client gets while the gzip one is being
        // made must go out as it is. Inside the layer it was compressed again per request, on
        // the request's path (measured: the whole of MNIST, 47 MB, took 3.8 to 6.7 s to reach
        // the run's first worker, which then trained alone after the others had finished).
        .route("/api/data/{tag}/train/{index}/{file}", get(data))
        .with_state(app)
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({ "error": message.into() }))).into_response()
}

/// Whether `headers` carry `Authorization: Bearer <token>` (constant-time compare).
fn bearer_ok(headers: &HeaderMap, token: &crate::support::credential::Secret) -> bool {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|given| token.matches(given.trim()))
}

async fn join(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    // Rate first, so guessing a private run's token is as slow as joining.
    let ip = client_ip(&headers, peer, app.cfg.limits.trust_proxy);
    if let Err(retry) = app.limits.join(ip) {
        return limited(retry, "too many joins from your address; retry later");
    }
    if let Some(token) = &app.cfg.join_token {
        if !bearer_ok(&headers, token) {
            app.limits
                .count(crate::support::limits::Count::JoinUnauthorized);
            let mut r = error(
                StatusCode::UNAUTHORIZED,
                "this run is private: join with Authorization: Bearer <join token>",
            );
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"crowdgrad\""),
            );
            return r;
        }
    }
    let req: JoinRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("bad join request: {e}")),
    };
    if req.protocol != PROTOCOL_VERSION {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "worker speaks protocol {}, this server speaks {PROTOCOL_VERSION}",
                req.protocol
            ),
        );
    }
    if *app.shutdown.borrow() || app.admin.draining() {
        return error(StatusCode::SERVICE_UNAVAILABLE, "server is shutting down");
    }
    // The identity sent is a secret; everything is keyed by its public id, so knowing a
    // public id lets nobody act as its owner (registry::ledger, "Identities").
    let mut public = None;
    if let Some(secret) = &req.identity {
        if let Err(m) = crate::registry::ledger::check_identity(secret) {
            return error(StatusCode::BAD_REQUEST, format!("bad identity: {m}"));
        }
        let id = public.insert(crate::registry::ledger::public_id(secret));
        if let Some(why) = app.defence.reputation.identity_quarantined(id) {
            app.limits
                .count(crate::support::limits::Count::JoinQuarantined);
            return error(
                StatusCode::FORBIDDEN,
                format!("this identity is quarantined: {why}"),
            );
        }
    }
    if let Some(t) = &req.threads {
        if let Err(e) = t.check() {
            return error(StatusCode::BAD_REQUEST, format!("bad join request: {e}"));
        }
    }
    // Issue 21: new identities on probation are bounded by the established ones
    // (crate::registry::admission; docs/protocol.md, "Join").
    let (new, established) = app.registry.probation_counts();
    if !crate::registry::admission::admits(new, established, app.cfg.admission_floor) {
        return limited(
            Duration::from_secs(5),
            "too many new workers at once for this run's established ones; retry later",
        );
    }
    let clean = crate::registry::ledger::clean_label;
    let name = req.name.as_deref().and_then(clean);
    let team = req.team.as_deref().and_then(clean);
    let Some((worker_id, part)) =
        app.registry
            .join_thread(req.client, name.clone(), app.cfg.partitions, req.threads)
    else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many workers registered",
        );
    };
    if let Some(id) = &public {
        let who = crate::registry::ledger::Who {
            name: name.as_deref(),
            team: team.as_deref(),
        };
        app.registry.identify(worker_id, id, who, req.client);
        app.defence.reputation.bind(worker_id, id);
    }
    let Ok(range) = app.train.partition(part.index, part.count) else {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "no such data partition");
    };
    // The tag names the cut (`{data}-{count}`), so each part has one URL to cache.
    let base = format!(
        "/api/data/{}-{}/train/{}",
        app.data_tag, part.count, part.index
    );
    Json(JoinResponse {
        protocol: PROTOCOL_VERSION,
        worker_id,
        run: {
            // The mode now: an operator may have switched it (`ctl set-consistency`).
            let mut run = app.spec.clone();
            run.consistency = app.consistency();
            run
        },
        partition: PartitionInfo {
            index: part.index,
            count: part.count,
            examples: range.len(),
            images: format!("{base}/images"),
            labels: format!("{base}/labels"),
        },
        credential: Some(app.secret.issue(worker_id)),
    })
    .into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let body = crate::registry::metrics::render_with(
        app.scrape(),
        Some(Box::new(crate::support::limits::WithLimits(
            app.defence.scrape(),
            app.limits.counts(),
        ))),
    );
    (
        [(header::CONTENT_TYPE, crate::registry::metrics::CONTENT_TYPE)],
        body,
    )
        .into_response()
}

/// Live: the process answers HTTP.
async fn healthz() -> Response {
    Json(json!({ "live": true })).into_response()
}

/// Ready: 200 once every shard is loaded (and, with remote shards, answering); 503 with the
/// reasons otherwise, or while shutting down.
async fn readyz(State(app): State<Arc<App>>) -> Response {
    let r = app.readiness();
    let code = if r.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(r)).into_response()
}

async fn status(State(app): State<Arc<App>>) -> Response {
    Json(app.status()).into_response()
}

/// `offset` and `limit` of `GET /api/workers?offset=&limit=`: both optional (0 and
/// [`RECENT_WORKERS`]), `limit` in `1..=MAX_PAGE`; anything else is refused with a message.
fn page_params(query: Option<&str>) -> Result<(usize, usize), String> {
    let (mut offset, mut limit) = (0, RECENT_WORKERS);
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let parse = |what: &str| {
            value
                .parse::<usize>()
                .map_err(|_| format!("{what} must be a non-negative integer, got {value:?}"))
        };
        match key {
            "offset" => offset = parse("offset")?,
            "limit" => limit = parse("limit")?,
            _ => {
                return Err(format!(
                    "unknown parameter {key:?} (expected offset and limit)"
                ))
            }
        }
    }
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(format!(
            "limit must be between 1 and {MAX_PAGE}, got {limit}"
        ));
    }
    Ok((offset, limit))
}

async fn workers(State(app): State<Arc<App>>, RawQuery(query): RawQuery) -> Response {
    match page_params(query.as_deref()) {
        Ok((offset, limit)) => {
            // The page's rows with their reputation records (the dashboard tick has only the
            // counts): one response for the table.
            let page = app.registry.workers(offset, limit);
            let reputation = app.defence.reputation.of(page.workers.iter().map(|w| w.id));
            Json(json!({
                "total": page.total,
                "offset": page.offset,
                "limit": page.limit,
                "workers": page.workers,
                "reputation": reputation,
                "quarantines": app.quarantines(),
            }))
            .into_response()
        }
        Err(m) => error(StatusCode::BAD_REQUEST, m),
    }
}

/// Whether `Accept-Encoding` takes gzip (named, or `*`, with a non-zero q).
fn accepts_gzip(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|item| {
            let mut parts = item.split(';').map(str::trim);
            let name = parts.next().unwrap_or("");
            let zero = parts.any(|p| {
                p.strip_prefix("q=")
                    .and_then(|q| q.parse::<f32>().ok())
                    .is_some_and(|q| q <= 0.0)
            });
            (name.eq_ignore_ascii_case("gzip") || name == "*") && !zero
        })
}

/// One viewer of the dashboard stream: which tick it was sent last.
struct Viewer {
    ticks: tokio::sync::watch::Receiver<Arc<crate::coordinator::dashboard::Tick>>,
    stop: tokio::sync::watch::Receiver<bool>,
    last: Option<u64>,
    gzip: bool,
}

/// `GET /api/events`: the dashboard stream ([`crate::coordinator::dashboard`]). Every viewer is
/// sent the bytes the tick task built: a `run` event first (and after a missed tick), then a
/// `tick` event per tick; gzip when the viewer accepts it, compressed once for all viewers.
async fn events(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    let gzip = accepts_gzip(&headers);
    let viewer = Viewer {
        ticks: app.dashboard.subscribe(),
        stop: app.shutdown.clone(),
        last: None,
        gzip,
    };
    let stream = futures_util::stream::unfold(viewer, |mut v| async move {
        loop {
            if *v.stop.borrow() {
                return None;
            }
            let t = v.ticks.borrow_and_update().clone();
            if t.seq != 0 && v.last != Some(t.seq) {
                let event = if v.last.map(|l| l + 1) == Some(t.seq) {
                    t.tick.bytes(v.gzip)
                } else {
                    t.run().bytes(v.gzip)
                };
                let chunk = if v.last.is_none() && v.gzip {
                    let mut first = crate::coordinator::dashboard::GZIP_HEADER.to_vec();
                    first.extend_from_slice(&event);
                    Bytes::from(first)
                } else {
                    event
                };
                v.last = Some(t.seq);
                return Some((Ok::<_, Infallible>(chunk), v));
            }
            tokio::select! {
                r = v.ticks.changed() => if r.is_err() { return None },
                r = v.stop.changed() => if r.is_err() { return None },
            }
        }
    });
    let mut r = axum::body::Body::from_stream(stream).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    h.insert(header::VARY, HeaderValue::from_static("accept-encoding"));
    if gzip {
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    }
    r
}

/// The newest text a language model's weights wrote (`404` for other models, `204` before
/// the first).
async fn sample(State(app): State<Arc<App>>) -> Response {
    if app.model.sequence().is_none() {
        return error(
            StatusCode::NOT_FOUND,
            "this run does not train a language model",
        );
    }
    match app.sample.lock().unwrap_or_else(|p| p.into_inner()).clone() {
        Some(s) => Json(s).into_response(),
        None => StatusCode::NO_CONTENT.into_response(),
    }
}

/// Read-log entries `/api/reads` returns by default, and at most (`?limit=`): an entry is at
/// most ~160 bytes of JSON, so a response stays under ~160 kB by default and ~800 kB at most
/// (the whole log of 50,000 was 4.1 MB, to anyone who asked).
pub const READS_DEFAULT: usize = 1_000;
/// See [`READS_DEFAULT`].
pub const READS_MAX: usize = 5_000;

/// `/api/reads`'s query: `limit`, 1..=[`READS_MAX`] (default [`READS_DEFAULT`]).
fn reads_limit(query: Option<&str>) -> Result<usize, String> {
    let mut limit = READS_DEFAULT;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=').unwrap_or((pair, "")) {
            ("limit", v) => {
                limit = v
                    .parse()
                    .map_err(|_| format!("limit must be a non-negative integer, got {v:?}"))?
            }
            (key, _) => return Err(format!("unknown parameter {key:?} (expected limit)")),
        }
    }
    if !(1..=READS_MAX).contains(&limit) {
        return Err(format!(
            "limit must be between 1 and {READS_MAX}, got {limit}"
        ));
    }
    Ok(limit)
}

async fn reads(State(app): State<Arc<App>>, RawQuery(query): RawQuery) -> Response {
    match reads_limit(query.as_deref()) {
        Ok(limit) => Json(app.registry.reads(limit)).into_response(),
        Err(m) => error(StatusCode::BAD_REQUEST, m),
    }
}

async fn params(State(app): State<Arc<App>>, RawQuery(query): RawQuery) -> Response {
    let (safetensors, live) = match params_query(query.as_deref()) {
        Ok(q) => q,
        Err(m) => return error(StatusCode::BAD_REQUEST, m),
    };
    let (values, versions) = if live {
        app.live_params()
    } else {
        app.params()
    };
    let weights = if live || app.cfg.training.ema.is_none() {
        Weights::Live
    } else {
        Weights::Average
    };
    if safetensors {
        // The export format (crate::checkpoint::format::encode_model): named tensors.
        let a = app.clone();
        let encoded = tokio::task::spawn_blocking(move || {
            crate::checkpoint::format::encode_model(&a.spec, &values, &versions, weights)
        })
        .await;
        return match encoded {
            Ok(Ok(bytes)) => {
                let mut r = bytes.into_response();
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/octet-stream"),
                );
                r
            }
            Ok(Err(e)) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
            Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        };
    }
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let versions: Vec<String> = versions.iter().map(ToString::to_string).collect();
    let mut r = bytes.into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    if let Ok(v) = HeaderValue::from_str(&versions.join(",")) {
        r.headers_mut().insert("x-crowdgrad-versions", v);
    }
    r.headers_mut().insert(
        "x-crowdgrad-weights",
        HeaderValue::from_static(weights.name()),
    );
    r
}

/// `/api/params`'s query: `format=f32` (the default) or `format=safetensors`, and
/// `weights=evaluated` (the default: with `--ema` the moving average, else the live weights)
/// or `weights=live`, joined by `&`. Returns (safetensors, live).
fn params_query(query: Option<&str>) -> Result<(bool, bool), String> {
    let (mut safetensors, mut live) = (false, false);
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        match pair {
            "format=f32" => safetensors = false,
            "format=safetensors" => safetensors = true,
            "weights=evaluated" => live = false,
            "weights=live" => live = true,
            other => {
                return Err(format!(
                    "unknown query {other:?} (expected format=f32 or format=safetensors, \
                     weights=evaluated or weights=live)"
                ))
            }
        }
    }
    Ok((safetensors, live))
}

async fn data(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Path((tag, index, file)): Path<(String, usize, String)>,
) -> Response {
    let ip = client_ip(&headers, peer, app.cfg.limits.trust_proxy);
    if let Err(retry) = app.limits.download(ip) {
        return limited(
            retry,
            "too many data downloads from your address; retry later",
        );
    }
    let count = tag
        .strip_prefix(app.data_tag.as_str())
        .and_then(|rest| rest.strip_prefix('-'))
        .and_then(|c| c.parse::<usize>().ok())
        .filter(|c| (1..=app.cfg.partitions).contains(c));
    let Some(count) = count else {
        return error(
            StatusCode::NOT_FOUND,
            "unknown data tag (the server's data changed; join again)",
        );
    };
    if !matches!(file.as_str(), "images" | "labels") {
        return error(StatusCode::NOT_FOUND, "file must be images or labels");
    }
    if app.train.partition(index, count).is_err() {
        return error(StatusCode::NOT_FOUND, format!("no partition {index}"));
    }
    // Encoded once per part and encoding, shared by every download (coordinator::parts); a
    // response that carries its Content-Encoding is left alone by the compression layer.
    let gzip = headers
        .get(header::ACCEPT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .is_some_and(crate::coordinator::parts::accepts_gzip);
    let part = crate::registry::Part { index, count };
    let (files, gzip) = match app.parts.serve(part, gzip).await {
        Ok(f) => f,
        Err(m) => return error(StatusCode::INTERNAL_SERVER_ERROR, m),
    };
    let body = if file == "images" {
        files.images
    } else {
        files.labels
    };
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::VARY, HeaderValue::from_static("accept-encoding"));
    if gzip {
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    }
    // The URL names the content, so clients may cache it forever.
    h.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("public, max-age=31536000, immutable"),
    );
    r
}

async fn ws(
    State(app): State<Arc<App>>,
    Path(id): Path<usize>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    Extension(slot): Extension<Arc<ConnSlot>>,
    headers: HeaderMap,
    upgrade: ShardUpgrade,
) -> Response {
    let Some(shard) = app.shards.get(id).cloned() else {
        return error(StatusCode::NOT_FOUND, format!("no shard {id}"));
    };
    if *app.shutdown.borrow() {
        return error(StatusCode::SERVICE_UNAVAILABLE, "server is shutting down");
    }
    // The TCP connection was counted when accepted (crate::net); the socket keeps its slot.
    crate::shard::socket::limited_socket(
        upgrade,
        shard,
        app.registry.clone(),
        app.shutdown.clone(),
        app.tracker.clone(),
        &app.limits,
        peer,
        &headers,
        slot,
    )
}

/// 429 with `Retry-After` (whole seconds, at least 1).
fn limited(retry: Duration, message: &str) -> Response {
    let mut r = error(StatusCode::TOO_MANY_REQUESTS, message);
    let secs = retry.as_secs_f64().ceil().max(1.0) as u64;
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gzip_is_taken_when_accepted() {
        let h = |v: &str| {
            let mut m = HeaderMap::new();
            m.insert(header::ACCEPT_ENCODING, HeaderValue::from_str(v).unwrap());
            accepts_gzip(&m)
        };
        assert!(h("gzip, deflate, br, zstd"));
        assert!(h("br;q=1.0, GZIP;q=0.5"));
        assert!(h("*"));
        assert!(!h("gzip;q=0, br"));
        assert!(!h("br, deflate"));
        assert!(!accepts_gzip(&HeaderMap::new()));
    }

    #[test]
    fn reads_limit_defaults_and_is_capped() {
        assert_eq!(reads_limit(None), Ok(READS_DEFAULT));
        assert_eq!(reads_limit(Some("limit=5000")), Ok(5000));
        assert_eq!(reads_limit(Some("limit=1&")), Ok(1));
        for bad in [
            "limit=0",
            "limit=5001",
            "limit=-1",
            "limit=x",
            "offset=3",
            "limit",
        ] {
            assert!(reads_limit(Some(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn page_params_default_and_validate() {
        assert_eq!(page_params(None), Ok((0, RECENT_WORKERS)));
        assert_eq!(page_params(Some("")), Ok((0, RECENT_WORKERS)));
        assert_eq!(page_params(Some("offset=200&limit=50")), Ok((200, 50)));
        assert_eq!(page_params(Some("limit=1000&")), Ok((0, 1000)));
        for (bad, says) in [
            ("limit=0", "between 1 and 1000"),
            ("limit=1001", "between 1 and 1000"),
            ("offset=-1", "offset must be a non-negative integer"),
            ("limit=ten", "limit must be a non-negative integer"),
            ("offset", "offset must be"),
            ("page=2", "unknown parameter \"page\""),
        ] {
            let e = page_params(Some(bad)).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
