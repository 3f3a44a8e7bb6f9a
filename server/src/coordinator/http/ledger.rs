//! `GET /api/contributors`: the contribution ledger's leaderboard and CSV export.

use crate::coordinator::app::App;
use crate::registry::ledger;

/// `GET /api/contributors`: JSON [`ledger::Board`] (`?limit=N`, 1..=1000, default 100;
/// `?identity=PUBLIC_ID` adds that identity's entry and rank; each entry has `recent`, samples
/// per hour over the last 24 h), or every identity as CSV with `?format=csv`. Read from the
/// ledger's database on a blocking thread, never under the registry's lock.
///
/// Every identity here is a public id (`ledger::public_id`): a lookup reads what the board
/// shows anyway and acts as no one. A lookup with something that is not a public id (a
/// secret, sent by mistake) is refused with 400 and not looked up.
pub async fn contributors(
    axum::extract::State(app): axum::extract::State<std::sync::Arc<App>>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> axum::response::Response {
    use axum::http::{header, HeaderValue, StatusCode};
    use axum::response::IntoResponse;
    let bad = |m: String| {
        (
            StatusCode::BAD_REQUEST,
            axum::Json(serde_json::json!({ "error": m })),
        )
            .into_response()
    };
    let (mut csv, mut limit, mut identity) = (false, 100usize, None::<String>);
    for pair in query
        .as_deref()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
    {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "format" if v == "csv" => csv = true,
            "format" if v == "json" => csv = false,
            "format" => return bad(format!("format must be json or csv, got {v:?}")),
            "limit" => match v.parse::<usize>() {
                Ok(n) if (1..=1000).contains(&n) => limit = n,
                _ => return bad(format!("limit must be 1..=1000, got {v:?}")),
            },
            "identity" => {
                if let Err(m) = ledger::check_public_id(v) {
                    return bad(format!("bad identity: {m}"));
                }
                identity = Some(v.to_string());
            }
            _ => {
                return bad(format!(
                    "unknown parameter {k:?} (expected format, limit, identity)"
                ))
            }
        }
    }
    // Off the reactor and off the registry's lock: the ledger's own read connection, after
    // a flush so the caller sees its own last pushes (crate::registry::ledger::store).
    let Some(store) = app.registry.ledger() else {
        return bad("this server keeps no ledger".into());
    };
    let read = tokio::task::spawn_blocking(move || {
        store.flush();
        if csv {
            store.csv().map(Err)
        } else {
            store.board(limit, identity.as_deref()).map(Ok)
        }
    })
    .await;
    match read {
        Ok(Ok(Ok(board))) => axum::Json(board).into_response(),
        Ok(Ok(Err(body))) => {
            let mut r = body.into_response();
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/csv; charset=utf-8"),
            );
            r
        }
        Ok(Err(e)) => {
            tracing::error!(%e, "ledger read failed");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                axum::Json(serde_json::json!({ "error": "the ledger could not be read" })),
            )
                .into_response()
        }
        Err(e) => {
            tracing::error!(%e, "ledger read task failed");
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}
