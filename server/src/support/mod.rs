//! What every role uses and that knows no role (nothing here imports another folder of the
//! crate).
//!
//! - [`credential`]: secrets, the run secret and the HMAC session credentials.
//! - [`tls`]: rustls server and client configurations.
//! - [`trim`]: giving freed memory back to the OS after connections close.
//! - [`data`]: fetching, importing and loading datasets on disk.
//! - [`limits`]: connection, join, download and push-rate limits.
//! - [`text`]: text files as datasets (windows of token ids) and the sentences corpus.

pub mod credential;
pub mod data;
pub mod limits;
pub mod text;
pub mod tls;
pub mod trim;
