//! The server crate's error type.

use thiserror::Error;

/// Errors of the server, the native worker and the data tools.
#[derive(Debug, Error)]
pub enum Error {
    /// An error from the shared core (config, data, protocol).
    #[error(transparent)]
    Core(#[from] crowdgrad_core::Error),
    /// A file or socket operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Invalid configuration given by the user: a flag, the run file, a file a flag names
    /// (a TLS certificate, an identity file), or a setup that cannot run at this size. The
    /// message names the flag to change.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A child process or the machine did not do what a command needed: a server that did
    /// not start or print its address, a network namespace that could not be made. Not the
    /// user's configuration.
    #[error("process: {0}")]
    Process(String),
    /// Obtaining or validating a dataset failed.
    #[error("data: {0}")]
    Data(String),
    /// An HTTP request to the server failed.
    #[error("http: {0}")]
    Http(String),
    /// A WebSocket operation failed.
    #[error("websocket: {0}")]
    WebSocket(String),
    /// A checkpoint could not be written, read or used (corrupt, truncated, another model).
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// The contribution ledger's database could not be opened, read or written: a corrupt
    /// file, a file that is not crowdgrad's ledger, one written by a newer crowdgrad. The
    /// message names the file.
    #[error("ledger: {0}")]
    Ledger(String),
    /// A task or thread ended abnormally: it panicked, was cancelled or was killed.
    #[error("task failed: {0}")]
    Task(String),
}

impl Error {
    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

/// `Result` with the server [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
