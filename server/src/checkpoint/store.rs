//! Where checkpoints live, through the `object_store` crate: a local directory, or an
//! S3-compatible bucket given as `s3://bucket/prefix` (endpoint, region and credentials from
//! the standard `AWS_*` environment variables: `AWS_ENDPOINT`, `AWS_REGION`,
//! `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`; `AWS_ALLOW_HTTP=true` for a plain-HTTP
//! endpoint such as a local moto server).
//!
//! Checkpoints are named `ckpt-{seq:012}.safetensors`; the sequence number orders them, so
//! the newest is the one with the largest number whatever the clocks say.
//!
//! Writes are atomic. On S3 an object appears whole or not at all. In a local directory the
//! file is written under a temporary name (`.tmp-...`), fsynced, renamed into place and the
//! directory fsynced: `object_store`'s local store renames but does not fsync, so local
//! writes go through [`write_atomic`] and reads, listings and deletes through `object_store`.

use crate::error::{Error, Result};
use bytes::Bytes;
use futures_util::StreamExt;
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Longest one store operation may take.
const OP_TIMEOUT: Duration = Duration::from_secs(300);

/// Prefix and suffix of checkpoint names.
const PREFIX: &str = "ckpt-";
const SUFFIX: &str = ".safetensors";

/// Most objects a listing looks at (a directory full of other things is refused past it).
const MAX_LIST: usize = 100_000;

/// One checkpoint in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Object name, e.g. `ckpt-000000000007.safetensors`.
    pub name: String,
    /// Its sequence number.
    pub seq: u64,
    /// Size in bytes.
    pub size: u64,
}

/// The name of checkpoint number `seq`.
pub fn name(seq: u64) -> String {
    format!("{PREFIX}{seq:012}{SUFFIX}")
}

fn parse_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(PREFIX)?.strip_suffix(SUFFIX)?;
    (digits.len() == 12 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// A checkpoint store.
#[derive(Debug, Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    prefix: Option<ObjPath>,
    local: Option<PathBuf>,
    display: String,
}

fn err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Checkpoint(format!("{what}: {e}"))
}

impl Store {
    /// Opens `location`: `s3://bucket[/prefix]`, or a directory (created if missing).
    ///
    /// # Errors
    /// A bad URL, a directory that cannot be created, or an S3 configuration the environment
    /// does not complete.
    pub fn open(location: &str) -> Result<Self> {
        if let Some(rest) = location.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(Error::Config(format!(
                    "--checkpoint-dir {location:?}: no bucket (use s3://BUCKET/PREFIX)"
                )));
            }
            // reqwest is built without a crypto provider of its own (Cargo.toml): use ring's,
            // the TLS server's, as the process default (a no-op when one is installed).
            let _ = rustls::crypto::ring::default_provider().install_default();
            let s3 = object_store::aws::AmazonS3Builder::from_env()
                .with_bucket_name(bucket)
                .build()
                .map_err(|e| Error::Config(format!("--checkpoint-dir {location}: {e}")))?;
            let prefix = prefix.trim_matches('/');
            return Ok(Self {
                inner: Arc::new(s3),
                prefix: (!prefix.is_empty()).then(|| ObjPath::from(prefix)),
                local: None,
                display: location.to_string(),
            });
        }
        if location.contains("://") {
            return Err(Error::Config(format!(
                "--checkpoint-dir {location:?}: only directories and s3:// URLs are supported"
            )));
        }
        let dir = PathBuf::from(location);
        std::fs::create_dir_all(&dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        let dir = dir
            .canonicalize()
            .map_err(|e| Error::io(format!("resolving {}", dir.display()), e))?;
        let fs = LocalFileSystem::new_with_prefix(&dir)
            .map_err(|e| Error::Config(format!("--checkpoint-dir {location}: {e}")))?;
        Ok(Self {
            inner: Arc::new(fs),
            prefix: None,
            local: Some(dir),
            display: location.to_string(),
        })
    }

    /// Where the store is, as given.
    pub fn location(&self) -> &str {
        &self.display
    }

    fn path(&self, name: &str) -> ObjPath {
        match &self.prefix {
            Some(p) => p.clone().join(name),
            None => ObjPath::from(name),
        }
    }

    /// The checkpoints, oldest first (other objects are ignored).
    ///
    /// # Errors
    /// When the store cannot be listed.
    pub async fn list(&self) -> Result<Vec<Entry>> {
        let inner = self.inner.clone();
        let prefix = self.prefix.clone();
        let list = async move {
            let mut stream = inner.list(prefix.as_ref());
            let mut out = Vec::new();
            let mut seen = 0usize;
            while let Some(meta) = stream.next().await {
                let meta = meta.map_err(|e| err("listing checkpoints", e))?;
                seen += 1;
                if seen > MAX_LIST {
                    return Err(Error::Checkpoint(format!(
                        "more than {MAX_LIST} objects in the checkpoint location"
                    )));
                }
                // Only direct children of the prefix.
                let Some(file) = meta.location.filename() else {
                    continue;
                };
                let parent_ok = match &prefix {
                    Some(p) => meta
                        .location
                        .prefix_match(p)
                        .is_some_and(|mut r| r.next().is_some() && r.next().is_none()),
                    None => meta.location.parts().count() == 1,
                };
                if let (true, Some(seq)) = (parent_ok, parse_name(file)) {
                    out.push(Entry {
                        name: file.to_string(),
                        seq,
                        size: meta.size,
                    });
                }
            }
            out.sort_by_key(|e| e.seq);
            Ok(out)
        };
        timeout("listing checkpoints", list).await
    }

    /// Reads checkpoint `name`, at most `limit` bytes.
    ///
    /// # Errors
    /// When it cannot be read or is larger than `limit`.
    pub async fn get(&self, name: &str, limit: u64) -> Result<Bytes> {
        let path = self.path(name);
        let inner = self.inner.clone();
        timeout("reading a checkpoint", async move {
            let r = inner
                .get(&path)
                .await
                .map_err(|e| err(&format!("reading {path}"), e))?;
            if r.meta.size > limit {
                return Err(Error::Checkpoint(format!(
                    "{path} is {} bytes, more than the {limit} a checkpoint of this model can be",
                    r.meta.size
                )));
            }
            r.bytes()
                .await
                .map_err(|e| err(&format!("reading {path}"), e))
        })
        .await
    }

    /// Reads bytes `range` of checkpoint `name`.
    ///
    /// # Errors
    /// When they cannot be read (the object is shorter, or gone).
    pub async fn get_range(&self, name: &str, range: std::ops::Range<u64>) -> Result<Bytes> {
        let path = self.path(name);
        let inner = self.inner.clone();
        timeout("reading a checkpoint", async move {
            inner
                .get_range(&path, range)
                .await
                .map_err(|e| err(&format!("reading {path}"), e))
        })
        .await
    }

    /// Local directory: removes temporary files a crash mid-write left behind.
    pub fn remove_temporaries(&self) {
        let Some(dir) = &self.local else { return };
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if name.starts_with(".tmp-") && name.ends_with(SUFFIX) {
                tracing::info!(file = %name, "removing a checkpoint a crash left half-written");
                let _ = std::fs::remove_file(e.path());
            }
        }
    }

    /// Writes checkpoint `name` atomically (module doc).
    ///
    /// # Errors
    /// When writing fails; a failed write leaves no object under `name`.
    pub async fn put(&self, name: &str, bytes: Bytes) -> Result<()> {
        if let Some(dir) = &self.local {
            let dir = dir.clone();
            let name = name.to_string();
            return tokio::task::spawn_blocking(move || write_atomic(&dir, &name, &bytes))
                .await
                .map_err(|e| Error::Task(format!("checkpoint writer: {e}")))?;
        }
        let path = self.path(name);
        let inner = self.inner.clone();
        timeout("writing a checkpoint", async move {
            inner
                .put(&path, bytes.into())
                .await
                .map(|_| ())
                .map_err(|e| err(&format!("writing {path}"), e))
        })
        .await
    }

    /// Deletes checkpoint `name`.
    ///
    /// # Errors
    /// When deleting fails.
    pub async fn delete(&self, name: &str) -> Result<()> {
        let path = self.path(name);
        let inner = self.inner.clone();
        timeout("deleting a checkpoint", async move {
            inner
                .delete(&path)
                .await
                .map_err(|e| err(&format!("deleting {path}"), e))
        })
        .await
    }
}

async fn timeout<T>(what: &str, f: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    tokio::time::timeout(OP_TIMEOUT, f)
        .await
        .map_err(|_| Error::Checkpoint(format!("{what} took longer than {OP_TIMEOUT:?}")))?
}

/// Writes `bytes` to `dir/name` so that a crash at any point leaves either the old state or
/// the whole new file: a temporary file in the same directory, fsync, rename, fsync the
/// directory.
///
/// # Errors
/// Any failing step; the temporary file is removed.
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let tmp = dir.join(format!(".tmp-{}-{name}", std::process::id()));
    let fin = dir.join(name);
    let res = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, &fin)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if let Err(e) = res {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io(format!("writing {}", fin.display()), e));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_order_and_parse() {
        assert_eq!(name(7), "ckpt-000000000007.safetensors");
        assert_eq!(parse_name(&name(123)), Some(123));
        for bad in [
            "ckpt-7.safetensors",
            "ckpt-00000000000x.safetensors",
            ".tmp-1-ckpt-000000000007.safetensors",
            "model.safetensors",
        ] {
            assert_eq!(parse_name(bad), None, "{bad}");
        }
        assert!(name(9) < name(10));
    }

    #[tokio::test]
    async fn a_local_store_writes_lists_reads_and_deletes() {
        let dir = std::env::temp_dir().join(format!("crowdgrad-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = Store::open(dir.to_str().unwrap()).unwrap();
        assert!(store.list().await.unwrap().is_empty());
        store
            .put(&name(2), Bytes::from_static(b"two"))
            .await
            .unwrap();
        store
            .put(&name(1), Bytes::from_static(b"one!"))
            .await
            .unwrap();
        std::fs::write(dir.join("notes.txt"), "ignored").unwrap();
        let l = store.list().await.unwrap();
        assert_eq!(
            l.iter().map(|e| (e.seq, e.size)).collect::<Vec<_>>(),
            vec![(1, 4), (2, 3)]
        );
        assert_eq!(&store.get(&name(2), 100).await.unwrap()[..], b"two");
        assert!(store.get(&name(1), 3).await.is_err(), "over the size limit");
        store.delete(&name(1)).await.unwrap();
        assert_eq!(store.list().await.unwrap().len(), 1);
        // No temporary file is left behind.
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().to_string())
            .filter(|n| n.starts_with(".tmp"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
        assert!(Store::open("gs://bucket/x").is_err());
        assert!(Store::open("s3:///x").is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
