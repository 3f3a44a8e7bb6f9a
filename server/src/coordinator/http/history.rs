//! What the host and the teacher look back on (issue 19; docs/protocol.md, "Other
//! endpoints"):
//!
//! | call | what |
//! |---|---|
//! | `GET /api/evals` | every experiment with its settings, `sim` command and evaluation points |
//! | `GET /api/evals.csv?experiment=ID` | one experiment as CSV, its `sim` command first |
//! | `GET /api/history?since_ms=N` | the run's figures every 5 s newer than N |
//! | `GET /api/history.csv?since_ms=N` | the same as CSV |
//! | `GET /api/guesses` | 16 test images with the current parameters' guesses (image models) |

use super::error;
use crate::coordinator::app::App;
use crate::coordinator::history::{figures_csv, FIGURE_EVERY_S};
use axum::extract::{RawQuery, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use std::sync::Arc;

/// The routes (merged into [`crate::coordinator::http::router`]).
pub fn routes() -> Router<Arc<App>> {
    Router::new()
        .route("/api/evals", get(evals))
        .route("/api/evals.csv", get(evals_csv))
        .route("/api/history", get(history))
        .route("/api/history.csv", get(history_csv))
        .route("/api/guesses", get(guesses))
}

/// The value of the one parameter `key` in `query` (absent: `None`), as a `T`; anything else
/// in the query is refused with a message.
fn one_param<T: std::str::FromStr>(
    query: Option<&str>,
    key: &str,
    what: &str,
) -> Result<Option<T>, String> {
    let mut found = None;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if k != key {
            return Err(format!("unknown parameter {k:?} (expected {key})"));
        }
        found = Some(
            v.parse::<T>()
                .map_err(|_| format!("{key} must be {what}, got {v:?}"))?,
        );
    }
    Ok(found)
}

fn data_dir(app: &App) -> String {
    app.cfg.data_dir.display().to_string()
}

fn csv(body: String, name: &str) -> Response {
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/csv; charset=utf-8"),
    );
    if let Ok(v) = HeaderValue::from_str(&format!("attachment; filename=\"{name}\"")) {
        h.insert(header::CONTENT_DISPOSITION, v);
    }
    r
}

async fn evals(State(app): State<Arc<App>>, RawQuery(query): RawQuery) -> Response {
    if query.as_deref().is_some_and(|q| !q.is_empty()) {
        return error(
            StatusCode::BAD_REQUEST,
            "GET /api/evals takes no parameters",
        );
    }
    let x = app.experiments.lock().unwrap_or_else(|p| p.into_inner());
    Json(x.to_json(&data_dir(&app))).into_response()
}

async fn evals_csv(State(app): State<Arc<App>>, RawQuery(query): RawQuery) -> Response {
    let id = match one_param::<u32>(query.as_deref(), "experiment", "an experiment id") {
        Ok(Some(id)) => id,
        Ok(None) => {
            return error(
                StatusCode::BAD_REQUEST,
                "say which experiment: /api/evals.csv?experiment=ID (ids in /api/evals)",
            )
        }
        Err(m) => return error(StatusCode::BAD_REQUEST, m),
    };
    let body = app
        .experiments
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .csv(id, &data_dir(&app));
    match body {
        Some(b) => csv(b, &format!("experiment-{id}.csv")),
        None => error(
            StatusCode::NOT_FOUND,
            format!("no experiment {id} (the ids are in /api/evals)"),
        ),
    }
}

fn since(query: Option<&str>) -> Result<u64, String> {
    Ok(one_param::<u64>(query, "since_ms", "milliseconds since the Unix epoch")?.unwrap_or(0))
}

async fn history(State(app): State<Arc<App>>, RawQuery(query): RawQuery) -> Response {
    let since = match since(query.as_deref()) {
        Ok(s) => s,
        Err(m) => return error(StatusCode::BAD_REQUEST, m),
    };
    let points = app
        .figures
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .since(since);
    Json(serde_json::json!({ "interval_s": FIGURE_EVERY_S, "points": points })).into_response()
}

async fn history_csv(State(app): State<Arc<App>>, RawQuery(query): RawQuery) -> Response {
    let since = match since(query.as_deref()) {
        Ok(s) => s,
        Err(m) => return error(StatusCode::BAD_REQUEST, m),
    };
    let points = app
        .figures
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .since(since);
    csv(figures_csv(&points), "history.csv")
}

async fn guesses(State(app): State<Arc<App>>) -> Response {
    if app.model.sequence().is_some() {
        return error(
            StatusCode::NOT_FOUND,
            "this run trains a language model: its samples are at /api/sample",
        );
    }
    let a = app.clone();
    let body = app
        .guesses
        .get(move || crate::coordinator::experiments::guesses(&a))
        .await;
    let mut r = body.into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_param_takes_one_key() {
        assert_eq!(one_param::<u64>(None, "since_ms", "n"), Ok(None));
        assert_eq!(
            one_param::<u64>(Some("since_ms=5"), "since_ms", "n"),
            Ok(Some(5))
        );
        assert!(one_param::<u64>(Some("since_ms=-1"), "since_ms", "n")
            .unwrap_err()
            .contains("since_ms must be"));
        assert!(one_param::<u64>(Some("since=1"), "since_ms", "n")
            .unwrap_err()
            .contains("unknown parameter"));
    }
}
