//! `GET /api/contributors`: the contribution ledger's leaderboard and CSV export.

use crate::coordinator::app::App;
use crate::registry::ledger;

/// `GET /api/contributors`: JSON [`Board`] (`?limit=N`, 1..=1000, default 100;
/// `?identity=ID` adds that identity's entry and rank), or every identity as CSV with
/// `?format=csv`.
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
                if let Err(m) = ledger::check_identity(v) {
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
    if csv {
        let body = app
            .registry
            .with_ledger(|l| ledger::to_csv(&l.contributors()));
        let mut r = body.into_response();
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/csv; charset=utf-8"),
        );
        return r;
    }
    let board = app
        .registry
        .with_ledger(|l| l.board(limit, identity.as_deref()));
    axum::Json(board).into_response()
}
