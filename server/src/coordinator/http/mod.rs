//! The HTTP surface: join, status, events (SSE), the worker list (paged), parameters, data
//! partitions, shard WebSockets and the static page.

pub mod admin;
mod ledger;

use crate::coordinator::app::App;
use crate::net::ConnSlot;
use crate::registry::{MAX_PAGE, RECENT_WORKERS};
use crate::support::limits::client_ip;
use axum::body::Bytes;
use axum::extract::ws::WebSocketUpgrade;
use axum::extract::{ConnectInfo, Path, RawQuery, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
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
        .merge(admin::routes())
        .route("/api/contributors", get(ledger::contributors))
        .route("/api/data/{tag}/train/{index}/{file}", get(data))
        .route("/ws/shard/{id}", get(ws))
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .fallback_service(web)
        // gzip for clients that ask (a browser's 7.5 MiB data partition shrinks ~5x, the wasm
        // ~2.5x); server-sent events and WebSocket upgrades are left alone by the predicate.
        .layer(tower_http::compression::CompressionLayer::new())
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
    if let Some(id) = &req.identity {
        if let Err(m) = crate::registry::ledger::check_identity(id) {
            return error(StatusCode::BAD_REQUEST, format!("bad identity: {m}"));
        }
        if let Some(why) = app.defence.reputation.identity_quarantined(id) {
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
    if !crate::registry::admission::admits(new, established) {
        return limited(
            Duration::from_secs(5),
            "too many new workers at once for this run's established ones; retry later",
        );
    }
    let name: Option<String> = req
        .name
        .map(|n| n.chars().filter(|c| !c.is_control()).take(64).collect());
    let Some((worker_id, index)) =
        app.registry
            .join_thread(req.client, name.clone(), app.cfg.partitions, req.threads)
    else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many workers registered",
        );
    };
    if let Some(id) = &req.identity {
        app.registry
            .identify(worker_id, id, name.as_deref(), req.client);
        app.defence.reputation.bind(worker_id, id);
    }
    let Ok(range) = app.train.partition(index, app.cfg.partitions) else {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "no such data partition");
    };
    let base = format!("/api/data/{}/train/{index}", app.data_tag);
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
            index,
            count: app.cfg.partitions,
            examples: range.len(),
            images: format!("{base}/images"),
            labels: format!("{base}/labels"),
        },
        credential: Some(app.secret.issue(worker_id)),
    })
    .into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let body =
        crate::registry::metrics::render_with(app.scrape(), Some(Box::new(app.defence.scrape())));
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
        Ok((offset, limit)) => Json(app.registry.workers(offset, limit)).into_response(),
        Err(m) => error(StatusCode::BAD_REQUEST, m),
    }
}

async fn events(
    State(app): State<Arc<App>>,
) -> Sse<impl futures_util::Stream<Item = Result<Event, Infallible>>> {
    let stream = futures_util::stream::unfold((app, true), |(app, first)| async move {
        if !first {
            let mut stop = app.shutdown.clone();
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = stop.changed() => {}
            }
        }
        if *app.shutdown.borrow() {
            return None;
        }
        let body = serde_json::to_string(&app.status()).unwrap_or_else(|_| "{}".into());
        Some((
            Ok(Event::default().event("status").data(body)),
            (app, false),
        ))
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}

async fn reads(State(app): State<Arc<App>>) -> Response {
    Json(app.registry.reads()).into_response()
}

async fn params(State(app): State<Arc<App>>, RawQuery(query): RawQuery) -> Response {
    let (values, versions) = app.params();
    match query.as_deref() {
        None | Some("") | Some("format=f32") => {}
        Some("format=safetensors") => {
            // The export format (crate::checkpoint::format::encode_model): named tensors.
            let a = app.clone();
            let encoded = tokio::task::spawn_blocking(move || {
                crate::checkpoint::format::encode_model(&a.spec, &values, &versions)
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
        Some(q) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("unknown query {q:?} (expected format=f32 or format=safetensors)"),
            )
        }
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
    r
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
    if tag != app.data_tag {
        return error(
            StatusCode::NOT_FOUND,
            "unknown data tag (the server's data changed; join again)",
        );
    }
    let Ok(range) = app.train.partition(index, app.cfg.partitions) else {
        return error(StatusCode::NOT_FOUND, format!("no partition {index}"));
    };
    let Ok((images, labels)) = app.train.to_idx(range) else {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "partition out of range");
    };
    let body = match file.as_str() {
        "images" => images,
        "labels" => labels,
        _ => return error(StatusCode::NOT_FOUND, "file must be images or labels"),
    };
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
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
    upgrade: WebSocketUpgrade,
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
