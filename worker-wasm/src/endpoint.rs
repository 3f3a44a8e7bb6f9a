//! Server URLs: the page gives the base (`http://host:port`), the join reply gives paths.

/// The WebSocket URL of `path` (e.g. `/ws/shard/0`) on the server at `base`: `http` becomes
/// `ws` and `https` becomes `wss`. An absolute `ws://`/`wss://` path (a shard in its own
/// process, `crowdgrad serve --shard-urls`) is kept as is.
pub fn ws_url(base: &str, path: &str) -> String {
    if path.starts_with("ws://") || path.starts_with("wss://") {
        return path.to_owned();
    }
    let host = base
        .strip_prefix("https://")
        .map(|h| format!("wss://{h}"))
        .or_else(|| base.strip_prefix("http://").map(|h| format!("ws://{h}")))
        .unwrap_or_else(|| base.to_owned());
    format!("{host}{path}")
}

/// The URL of `path` on the server at `base`; an absolute `path` is kept as is.
pub fn http_url(base: &str, path: &str) -> String {
    if path.starts_with("http://") || path.starts_with("https://") {
        path.to_owned()
    } else {
        format!("{base}{path}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            ws_url("http://127.0.0.1:8080", "ws://10.0.0.2:9000/ws/shard/1"),
            "ws://10.0.0.2:9000/ws/shard/1"
        );
        assert_eq!(
            ws_url("http://127.0.0.1:8080", "/ws/shard/0"),
            "ws://127.0.0.1:8080/ws/shard/0"
        );
        assert_eq!(ws_url("https://h", "/ws/shard/1"), "wss://h/ws/shard/1");
        assert_eq!(http_url("http://h", "/api/x"), "http://h/api/x");
        assert_eq!(http_url("http://h", "https://cdn/x"), "https://cdn/x");
    }
}
