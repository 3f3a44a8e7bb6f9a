//! The browser worker's error type. It holds only strings and numbers (no `JsValue`) so it is
//! the same type natively and in wasm; the wasm boundary turns it into a `JsError`.

use thiserror::Error;

/// What can end a training session: the driver rejoins after a backoff delay.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum Error {
    /// A browser API threw (fetch failed, WebSocket could not be built, ...).
    #[error("{what}: {message}")]
    Js {
        /// Which call failed.
        what: &'static str,
        /// The exception's text.
        message: String,
    },
    /// An HTTP request answered with a non-success status.
    #[error("{method} {url} answered HTTP {status}")]
    Http {
        /// Request method.
        method: &'static str,
        /// Requested URL.
        url: String,
        /// Status code.
        status: u16,
    },
    /// A JSON body could not be decoded.
    #[error("bad JSON from {url}: {message}")]
    Json {
        /// Where it came from.
        url: String,
        /// The decoder's message.
        message: String,
    },
    /// The core worker refused a frame or the run spec.
    #[error(transparent)]
    Core(#[from] crowdgrad_core::Error),
    /// A shard connection closed under the worker.
    #[error(
        "connection to shard {shard} closed (code {code}{})",
        fmt_reason(reason)
    )]
    Closed {
        /// Shard index.
        shard: usize,
        /// WebSocket close code (1006: abnormal, e.g. the server went away).
        code: u16,
        /// Close reason sent by the server, if any.
        reason: String,
    },
    /// The shards went quiet for too long.
    #[error("stalled: {0}")]
    Stalled(String),
    /// A setting is out of range (not retried).
    #[error("invalid setting: {0}")]
    Config(String),
}

fn fmt_reason(reason: &str) -> String {
    if reason.is_empty() {
        String::new()
    } else {
        format!(": {reason}")
    }
}

/// `Result` with the crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_read_well() {
        let e = Error::Closed {
            shard: 1,
            code: 1006,
            reason: String::new(),
        };
        assert_eq!(e.to_string(), "connection to shard 1 closed (code 1006)");
        let e = Error::Closed {
            shard: 0,
            code: 1001,
            reason: "shutting down".into(),
        };
        assert_eq!(
            e.to_string(),
            "connection to shard 0 closed (code 1001: shutting down)"
        );
        let e = Error::Http {
            method: "POST",
            url: "http://h/api/join".into(),
            status: 503,
        };
        assert_eq!(e.to_string(), "POST http://h/api/join answered HTTP 503");
    }
}
