//! The admin API, `/api/admin/...`, which `crowdgrad ctl` calls (docs/protocol.md, "Admin
//! API").
//!
//! Every call needs `Authorization: Bearer TOKEN` with the admin token (`--admin-token` or
//! `CROWDGRAD_ADMIN_TOKEN`; when neither is set, one is generated at start and printed once on
//! stdout, never logged, never in `/api/status`). The comparison runs in constant time
//! ([`crate::support::credential::token_eq`]). A missing or wrong token is a 401 and changes nothing.
//! Guessing is bounded ([`crate::coordinator::admin`], "Guessing the token"): after 5
//! different wrong tokens within a minute a client gets 429 with Retry-After on every admin
//! call for 5 minutes, even with the right token, and all clients together get 30 wrong tokens,
//! then one a second. Both are counted in `/api/status` `limits` (`admin_unauthorized`,
//! `admin_locked_out`).
//!
//! | call | what |
//! |---|---|
//! | `GET /api/admin/state` | paused, draining, learning rate, consistency, last checkpoint |
//! | `POST /api/admin/pause` | shards answer every push with the non-fatal `busy` error (pulls are served) |
//! | `POST /api/admin/resume` | pushes are applied again |
//! | `POST /api/admin/drain` | refuse joins; every connection finishes the frames it has sent and gets Bye; final checkpoint; the process exits 0 |
//! | `POST /api/admin/stop` | as drain, without waiting for connections to finish |
//! | `POST /api/admin/checkpoint` | write a checkpoint now; answers what was written |
//! | `POST /api/admin/set-lr` `{"lr": 0.01}` | every shard's learning rate from its next update |
//! | `POST /api/admin/set-consistency` `{"consistency": "ssp:2"}` | switches the mode where safe (async ↔ ssp:S, sync:K → sync:K' / async / ssp:S), else 409 with the reason (see [`set_consistency`]) |
//! | `POST /api/admin/demo` `{"worker": 7, "delay_ms": 2000, "fault": "signflip:10"}` | a teacher's demonstration on one worker ([`crate::shard::demo`]); both null: off |
//! | `POST /api/admin/experiment` `{"label": "sync", "consistency"?, "lr"?, "aggregation"?}` | the next experiment from fresh weights ([`crate::coordinator::experiments`]) |

use crate::coordinator::admin::{Auth, StopMode};
use crate::coordinator::app::App;
use crate::support::limits::{client_ip, Count};
use axum::body::Bytes;
use axum::extract::{ConnectInfo, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use crowdgrad_core::shard::Consistency;
use serde_json::json;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

/// The admin routes (merged into [`crate::coordinator::http::router`]).
pub fn routes() -> Router<Arc<App>> {
    Router::new()
        .route("/api/admin/state", get(state))
        .route("/api/admin/pause", post(pause))
        .route("/api/admin/resume", post(resume))
        .route("/api/admin/drain", post(drain))
        .route("/api/admin/stop", post(stop))
        .route("/api/admin/checkpoint", post(checkpoint_now))
        .route("/api/admin/set-lr", post(set_lr))
        .route("/api/admin/set-consistency", post(set_consistency))
        .route("/api/admin/unquarantine", post(unquarantine))
        .route("/api/admin/demo", post(demo))
        .route("/api/admin/experiment", post(experiment))
}

fn reply(status: StatusCode, body: serde_json::Value) -> Response {
    (status, Json(body)).into_response()
}

fn refuse(status: StatusCode, message: impl Into<String>) -> Response {
    reply(status, json!({ "error": message.into() }))
}

/// 401 unless `headers` carry the token; 429 with Retry-After, whatever the token, while the
/// client at `peer` (or everyone) is locked out for guessing (module doc). Refusals are
/// counted in the limits.
// The error is the reply itself, made once per refused call: its size does not matter.
#[allow(clippy::result_large_err)]
fn check(app: &App, headers: &HeaderMap, peer: SocketAddr) -> Result<(), Response> {
    let ip = client_ip(headers, peer, app.cfg.limits.trust_proxy);
    match app.admin.authenticate(headers, ip, Instant::now()) {
        Auth::Granted => Ok(()),
        Auth::Locked(wait) => {
            app.limits.count(Count::AdminLockedOut);
            let mut r = refuse(
                StatusCode::TOO_MANY_REQUESTS,
                "too many wrong admin tokens: try again later",
            );
            let secs = wait.as_secs_f64().ceil().max(1.0) as u64;
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
            Err(r)
        }
        Auth::Missing | Auth::Wrong => {
            app.limits.count(Count::AdminUnauthorized);
            let mut r = refuse(
                StatusCode::UNAUTHORIZED,
                "admin calls need `Authorization: Bearer TOKEN` with the admin token",
            );
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            Err(r)
        }
    }
}

fn state_json(app: &App) -> serde_json::Value {
    json!({
        "demo": app.demo.list(),
        "experiment": app
            .experiments
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .current()
            .map_or(0, |e| e.id),
        "paused": app.admin.paused(),
        "draining": app.admin.draining(),
        "stop": app.admin.stop_mode(),
        "lr": app.admin.lr(),
        "consistency": app.consistency().to_string(),
        "versions": app.shards.iter().map(|s| s.version()).collect::<Vec<_>>(),
        "checkpoint": app.checkpoints.as_ref().map(|c| json!({
            "location": c.store().location(),
            "every_s": c.config().every.as_secs_f64(),
            "keep": c.config().keep,
            "last": c.last(),
        })),
    })
}

async fn state(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Response {
    if let Err(r) = check(&app, &headers, peer) {
        return r;
    }
    reply(StatusCode::OK, state_json(&app))
}

fn set_paused(app: &App, paused: bool) {
    for s in &app.shards {
        s.set_paused(paused);
    }
    app.admin.set_paused(paused);
    tracing::info!(
        paused,
        "admin: pushes {}",
        if paused { "paused" } else { "resumed" }
    );
}

async fn pause(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Response {
    if let Err(r) = check(&app, &headers, peer) {
        return r;
    }
    set_paused(&app, true);
    reply(StatusCode::OK, state_json(&app))
}

async fn resume(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Response {
    if let Err(r) = check(&app, &headers, peer) {
        return r;
    }
    set_paused(&app, false);
    reply(StatusCode::OK, state_json(&app))
}

async fn drain(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Response {
    if let Err(r) = check(&app, &headers, peer) {
        return r;
    }
    tracing::info!("admin: drain requested");
    app.admin.request_stop(StopMode::Drain);
    reply(StatusCode::ACCEPTED, state_json(&app))
}

async fn stop(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Response {
    if let Err(r) = check(&app, &headers, peer) {
        return r;
    }
    tracing::info!("admin: stop requested");
    app.admin.request_stop(StopMode::Stop);
    reply(StatusCode::ACCEPTED, state_json(&app))
}

async fn checkpoint_now(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Response {
    if let Err(r) = check(&app, &headers, peer) {
        return r;
    }
    let Some(ck) = app.checkpoints.clone() else {
        return refuse(
            StatusCode::CONFLICT,
            "this server writes no checkpoints (start it with --checkpoint-dir)",
        );
    };
    match ck.write(&app.checkpoint_source()).await {
        Ok(w) => {
            tracing::info!(checkpoint = %w.name, bytes = w.bytes, "admin: checkpoint written");
            reply(StatusCode::OK, json!({ "written": w }))
        }
        Err(e) => refuse(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

fn body_field<'a>(body: &'a serde_json::Value, key: &str) -> Option<&'a serde_json::Value> {
    body.as_object().and_then(|o| o.get(key))
}

// The error is the reply itself, made once per refused call: its size does not matter.
#[allow(clippy::result_large_err)]
fn parse_body(body: &Bytes, key: &str) -> Result<serde_json::Value, Response> {
    let v: serde_json::Value = serde_json::from_slice(body).map_err(|e| {
        refuse(
            StatusCode::BAD_REQUEST,
            format!("body must be JSON like {{\"{key}\": ...}}: {e}"),
        )
    })?;
    match v.as_object() {
        Some(o) if o.len() == 1 && o.contains_key(key) => Ok(v),
        _ => Err(refuse(
            StatusCode::BAD_REQUEST,
            format!("body must be an object with exactly the key {key:?}"),
        )),
    }
}

async fn set_lr(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(r) = check(&app, &headers, peer) {
        return r;
    }
    let v = match parse_body(&body, "lr") {
        Ok(v) => v,
        Err(r) => return r,
    };
    let Some(lr) = body_field(&v, "lr").and_then(serde_json::Value::as_f64) else {
        return refuse(StatusCode::BAD_REQUEST, "lr must be a number");
    };
    let lr = lr as f32;
    // Checked once for all shards first, so a bad value changes none of them.
    let mut probe = app.spec.optimizer;
    probe.lr = lr;
    if let Err(e) = probe.validate() {
        return refuse(StatusCode::BAD_REQUEST, e.to_string());
    }
    for s in &app.shards {
        if let Err(e) = s.set_lr(lr) {
            return refuse(StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
        }
    }
    app.admin.set_lr(lr);
    tracing::info!(lr, "admin: learning rate set");
    reply(StatusCode::OK, state_json(&app))
}

/// Lifts a quarantine ([`crate::defence::reputation`]): body `{"worker": ID}` or `{"identity": "..."}`,
/// the identity's public id (`crate::registry::ledger::public_id`, as the status shows it).
/// 404 when that worker or identity is not quarantined.
async fn unquarantine(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(r) = check(&app, &headers, peer) {
        return r;
    }
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let r = &app.defence.reputation;
    let lifted = match (
        body_field(&v, "worker").and_then(serde_json::Value::as_u64),
        body_field(&v, "identity").and_then(serde_json::Value::as_str),
    ) {
        (Some(w), None) => r.lift(w),
        (None, Some(id)) => match crate::registry::ledger::check_public_id(id) {
            Ok(()) => r.lift_identity(id),
            Err(m) => return refuse(StatusCode::BAD_REQUEST, format!("identity: {m}")),
        },
        _ => {
            return refuse(
                StatusCode::BAD_REQUEST,
                "body must be JSON like {\"worker\": 7} or {\"identity\": \"...\"}",
            )
        }
    };
    if !lifted {
        return refuse(StatusCode::NOT_FOUND, "not quarantined");
    }
    tracing::info!(body = %v, "admin: quarantine lifted");
    reply(
        StatusCode::OK,
        json!({ "lifted": v, "quarantined": r.quarantined_count() }),
    )
}

/// Switches the consistency mode of a running server, on every shard and every open session
/// at once (sessions read it from the shard's shared state). Safe changes are made:
/// `async` ↔ `ssp:S`, `ssp:S` → `ssp:S'`, `sync:K` → `sync:K'` and `sync:K` → `async`/`ssp:S`
/// (leaving sync or changing K first applies the pending aggregate). Refused with 409 and the
/// reason ([`crate::shard::Shard::set_consistency`]): `async`/`ssp` → `sync:K` (workers that
/// joined without sync pull the current version, not the next), and any change when the shards
/// are other processes (`--shard-urls`: restart them with the new `--consistency`). Workers
/// that join afterwards get the new mode in their join reply; a restart takes the command
/// line's `--consistency` again.
async fn set_consistency(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(r) = check(&app, &headers, peer) {
        return r;
    }
    let v = match parse_body(&body, "consistency") {
        Ok(v) => v,
        Err(r) => return r,
    };
    let Some(text) = body_field(&v, "consistency").and_then(serde_json::Value::as_str) else {
        return refuse(StatusCode::BAD_REQUEST, "consistency must be a string");
    };
    let mode = match Consistency::parse(text) {
        Ok(m) => m,
        Err(e) => return refuse(StatusCode::BAD_REQUEST, e.to_string()),
    };
    let from = app.consistency();
    if mode == from {
        return reply(StatusCode::OK, state_json(&app));
    }
    if app.remote.is_some() {
        return refuse(
            StatusCode::CONFLICT,
            format!(
                "cannot change the consistency mode from {from} to {mode} here: the shards are \
                 other processes (--shard-urls); restart each with --consistency {mode} (its \
                 checkpoint carries the state over)"
            ),
        );
    }
    // Every shard runs the same mode, so the first one decides for all: an unsafe change is
    // refused before any shard changed.
    for (i, s) in app.shards.iter().enumerate() {
        if let Err(why) = s.set_consistency(mode) {
            let status = if i == 0 {
                StatusCode::CONFLICT
            } else {
                StatusCode::INTERNAL_SERVER_ERROR
            };
            return refuse(status, why);
        }
    }
    tracing::info!(%from, to = %mode, "admin: consistency mode switched");
    reply(StatusCode::OK, state_json(&app))
}

/// A teacher's demonstration ([`crate::shard::demo`]): body `{"worker": ID, "delay_ms": N |
/// null, "fault": "signflip:10" | null}` (a missing key is null). Both null turns it off for
/// that worker. 400 for another body, a delay above 10,000 ms or an unknown fault (nothing
/// changes); 409 with the shards in other processes. Answers the state, whose `demo` lists
/// what is on.
async fn demo(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(r) = check(&app, &headers, peer) {
        return r;
    }
    let usage = "body must be JSON like {\"worker\": 7, \"delay_ms\": 2000, \"fault\": \"signflip:10\"} (delay_ms and fault may be null)";
    let v: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return refuse(StatusCode::BAD_REQUEST, format!("{usage}: {e}")),
    };
    let Some(o) = v.as_object() else {
        return refuse(StatusCode::BAD_REQUEST, usage);
    };
    if let Some(k) = o
        .keys()
        .find(|k| !["worker", "delay_ms", "fault"].contains(&k.as_str()))
    {
        return refuse(
            StatusCode::BAD_REQUEST,
            format!("unknown key {k:?}: {usage}"),
        );
    }
    let Some(worker) = o.get("worker").and_then(serde_json::Value::as_u64) else {
        return refuse(
            StatusCode::BAD_REQUEST,
            format!("worker must be a worker id: {usage}"),
        );
    };
    let delay_ms = match o.get("delay_ms") {
        None | Some(serde_json::Value::Null) => None,
        Some(d) => match d.as_u64().and_then(|d| u32::try_from(d).ok()) {
            Some(d) if d <= crate::shard::demo::MAX_DELAY_MS => Some(d),
            _ => {
                return refuse(
                    StatusCode::BAD_REQUEST,
                    format!(
                        "delay_ms must be a whole number of milliseconds from 0 to {}",
                        crate::shard::demo::MAX_DELAY_MS
                    ),
                )
            }
        },
    };
    let fault = match o.get("fault") {
        None | Some(serde_json::Value::Null) => None,
        Some(f) => {
            let Some(text) = f.as_str() else {
                return refuse(StatusCode::BAD_REQUEST, "fault must be a string or null");
            };
            match crowdgrad_core::fault::Fault::parse(text) {
                // A data fault lives on the worker: the server cannot rewrite it into pushes.
                Ok(crowdgrad_core::fault::Fault::ShuffledLabels) => {
                    return refuse(
                        StatusCode::BAD_REQUEST,
                        "shuffled_labels is a worker's data, not a rewrite of its pushes",
                    )
                }
                Ok(f) => Some(f),
                Err(e) => return refuse(StatusCode::BAD_REQUEST, e.to_string()),
            }
        }
    };
    if app.remote.is_some() {
        return refuse(
            StatusCode::CONFLICT,
            "demonstrations need the shards in this process (not --shard-urls)",
        );
    }
    if (delay_ms.is_some() || fault.is_some()) && !app.registry.knows(worker) {
        return refuse(StatusCode::NOT_FOUND, format!("no worker {worker}"));
    }
    if let Err(m) = app.demo.set(worker, delay_ms, fault) {
        return refuse(StatusCode::BAD_REQUEST, m);
    }
    tracing::info!(worker, ?delay_ms, fault = ?fault.map(|f| f.to_string()), "admin: demonstration set");
    reply(StatusCode::OK, state_json(&app))
}

/// The next experiment ([`crate::coordinator::experiments::start_next`]): 200 with
/// `{"experiment": {"id", "label", "started_ms", "settings", "sim_command"}, "state"}`; 400
/// for a bad body, 409 for a change that cannot be made live (nothing changes).
async fn experiment(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(r) = check(&app, &headers, peer) {
        return r;
    }
    let next = match crate::coordinator::experiments::parse(&body) {
        Ok(n) => n,
        Err(m) => return refuse(StatusCode::BAD_REQUEST, m),
    };
    match crate::coordinator::experiments::start_next(&app, next) {
        Ok(e) => reply(
            StatusCode::OK,
            json!({
                "experiment": {
                    "id": e.id,
                    "label": e.label,
                    "started_ms": e.started_ms,
                    "settings": e.settings,
                    "sim_command": e.sim_command(&app.cfg.data_dir.display().to_string()),
                },
                "state": state_json(&app),
            }),
        ),
        Err((code, m)) => refuse(
            StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            m,
        ),
    }
}
