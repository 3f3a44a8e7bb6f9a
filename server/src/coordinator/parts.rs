//! The training set's parts as the data route serves them ([`Parts`]): each part's IDX files
//! encoded once, raw or gzip-compressed, and shared by every download of it.
//!
//! Before, every `GET /api/data/...` copied the part out of the training set and the
//! compression layer gzipped it again, per request: a crowd joining at once paid one
//! compression of a ~7.5 MiB part per volunteer, and since a run's first workers train on
//! larger parts (`crate::registry::partition`: the very first on the whole set, 47 MB of
//! MNIST) one join could cost a second of CPU. Now one task encodes a part (concurrent
//! requests for it wait for that one encoding) and the bytes are kept, least recently used
//! first out, within [`CACHE_BYTES`]. A gzip client is served the raw form while the gzip one
//! is being made ([`Parts::serve`]).

use crate::registry::Part;
use bytes::Bytes;
use crowdgrad_core::data::Dataset;
use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::sync::{Arc, Mutex};
use tokio::sync::OnceCell;

/// Most bytes of encoded parts kept (raw and gzip together). The six parts of MNIST's finest
/// default cut take about 57 MB in both forms; the whole set about 57 MB more.
pub const CACHE_BYTES: usize = 256 << 20;

/// Which encoding of a part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key {
    /// The part.
    pub part: Part,
    /// gzip-compressed (`Content-Encoding: gzip`) or raw IDX.
    pub gzip: bool,
}

/// A part's two files.
#[derive(Debug, Clone)]
pub struct Files {
    /// The IDX images file.
    pub images: Bytes,
    /// The IDX labels file.
    pub labels: Bytes,
}

impl Files {
    fn len(&self) -> usize {
        self.images.len() + self.labels.len()
    }
}

type Cell = Arc<OnceCell<Files>>;

#[derive(Default)]
struct Inner {
    cells: HashMap<Key, Cell>,
    /// Keys by last use, oldest first.
    order: VecDeque<Key>,
    sizes: HashMap<Key, usize>,
    bytes: usize,
}

/// The encoded parts of one training set (see the module docs).
pub struct Parts {
    train: Arc<Dataset>,
    budget: usize,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for Parts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parts")
            .field("budget", &self.budget)
            .field("bytes", &self.bytes())
            .finish_non_exhaustive()
    }
}

impl Parts {
    /// Parts of `train`, keeping at most `budget` bytes of them.
    pub fn new(train: Arc<Dataset>, budget: usize) -> Self {
        Self {
            train,
            budget,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes kept now.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    /// The files of `part` for a client that accepts gzip or not, and whether they are
    /// gzip: the gzip form once it exists; until then the raw one, while one background
    /// task compresses (the raw form is a copy, the compression of the whole of MNIST takes
    /// a second or more: a first byte must not wait for it, clients time out on a stall).
    ///
    /// # Errors
    /// As [`Parts::get`].
    pub async fn serve(self: &Arc<Self>, part: Part, gzip: bool) -> Result<(Files, bool), String> {
        if gzip {
            let key = Key { part, gzip: true };
            let cell = self.lock().cells.get(&key).cloned();
            match cell.as_ref().and_then(|c| c.get()) {
                Some(_) => return self.get(key).await.map(|f| (f, true)),
                None => {
                    if cell.is_none() {
                        let me = self.clone();
                        tokio::spawn(async move {
                            if let Err(e) = me.get(key).await {
                                tracing::warn!(error = %e, "compressing a data part failed");
                            }
                        });
                    }
                }
            }
        }
        self.get(Key { part, gzip: false })
            .await
            .map(|f| (f, false))
    }

    /// The files of `key`, encoded on a blocking thread the first time.
    ///
    /// # Errors
    /// A message when the part does not exist in this training set.
    pub async fn get(&self, key: Key) -> Result<Files, String> {
        let cell = {
            let mut g = self.lock();
            let cell = g.cells.entry(key).or_default().clone();
            g.order.retain(|k| *k != key);
            g.order.push_back(key);
            cell
        };
        let train = self.train.clone();
        let files = cell
            .get_or_try_init(|| async move {
                tokio::task::spawn_blocking(move || encode(&train, key))
                    .await
                    .map_err(|e| format!("encoding the part failed: {e}"))?
            })
            .await?
            .clone();
        let mut g = self.lock();
        if g.cells.contains_key(&key) && !g.sizes.contains_key(&key) {
            g.sizes.insert(key, files.len());
            g.bytes += files.len();
            // Least recently used out, never the part just served.
            while g.bytes > self.budget {
                let Some(old) = g.order.iter().copied().find(|k| *k != key) else {
                    break;
                };
                g.order.retain(|k| *k != old);
                g.cells.remove(&old);
                if let Some(n) = g.sizes.remove(&old) {
                    g.bytes -= n;
                }
            }
        }
        Ok(files)
    }
}

fn encode(train: &Dataset, key: Key) -> Result<Files, String> {
    let range = train
        .partition(key.part.index, key.part.count)
        .map_err(|e| e.to_string())?;
    let (images, labels) = train.to_idx(range).map_err(|e| e.to_string())?;
    let pack = |v: Vec<u8>| -> Result<Bytes, String> {
        if !key.gzip {
            return Ok(Bytes::from(v));
        }
        let mut gz = flate2::write::GzEncoder::new(
            Vec::with_capacity(v.len() / 4),
            flate2::Compression::default(),
        );
        gz.write_all(&v).map_err(|e| e.to_string())?;
        gz.finish().map(Bytes::from).map_err(|e| e.to_string())
    };
    Ok(Files {
        images: pack(images)?,
        labels: pack(labels)?,
    })
}

/// Whether an `Accept-Encoding` value accepts gzip (a `gzip` or `*` token without `q=0`).
pub fn accepts_gzip(header: &str) -> bool {
    header.split(',').any(|t| {
        let mut it = t.split(';').map(str::trim);
        let name = it.next().unwrap_or("");
        let zero = it.any(|p| {
            p.strip_prefix("q=")
                .and_then(|q| q.parse::<f32>().ok())
                .is_some_and(|q| q <= 0.0)
        });
        (name.eq_ignore_ascii_case("gzip") || name == "*") && !zero
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crowdgrad_core::data::encode_idx;

    fn data(n: usize) -> Arc<Dataset> {
        let pixels: Vec<u8> = (0..n * 4).map(|i| (i % 7) as u8).collect();
        let labels: Vec<u8> = (0..n).map(|i| (i % 3) as u8).collect();
        Arc::new(
            Dataset::from_idx(&encode_idx(&[n, 2, 2], &pixels), &encode_idx(&[n], &labels))
                .unwrap(),
        )
    }

    #[test]
    fn accept_encoding_tokens() {
        assert!(accepts_gzip("gzip"));
        assert!(accepts_gzip("br, GZIP;q=0.5"));
        assert!(accepts_gzip("*"));
        assert!(!accepts_gzip("gzip;q=0"));
        assert!(!accepts_gzip("br, deflate"));
        assert!(!accepts_gzip(""));
    }

    /// A part is encoded once and shared; gzip bytes decode to the raw ones; the cache stays
    /// within its budget by dropping the least recently used part, and a missing part is an
    /// error, not a panic.
    #[tokio::test]
    async fn parts_are_encoded_once_shared_and_bounded() {
        let train = data(1000);
        let whole = Key {
            part: Part { index: 0, count: 1 },
            gzip: false,
        };
        let raw_len = Parts::new(train.clone(), usize::MAX)
            .get(whole)
            .await
            .unwrap()
            .len();
        let parts = Parts::new(train.clone(), raw_len * 2);
        let a = parts.get(whole).await.unwrap();
        let b = parts.get(whole).await.unwrap();
        assert_eq!(a.images.as_ptr(), b.images.as_ptr(), "shared, not copied");
        let gz = parts
            .get(Key {
                gzip: true,
                ..whole
            })
            .await
            .unwrap();
        assert!(gz.images.len() < a.images.len());
        let back = Dataset::from_idx(&gz.images, &gz.labels).unwrap();
        assert_eq!(back, *train);
        for i in 0..2 {
            let half = Key {
                part: Part { index: i, count: 2 },
                gzip: false,
            };
            parts.get(half).await.unwrap();
            assert!(
                parts.bytes() <= raw_len * 2,
                "{} > {}",
                parts.bytes(),
                raw_len * 2
            );
        }
        let missing = Key {
            part: Part { index: 5, count: 2 },
            gzip: false,
        };
        assert!(parts.get(missing).await.is_err());
    }

    /// A gzip client gets the raw form until the compressed one exists, then the compressed.
    #[tokio::test]
    async fn raw_until_the_gzip_form_is_ready() {
        let parts = Arc::new(Parts::new(data(1000), usize::MAX));
        let whole = Part { index: 0, count: 1 };
        let (first, gz) = parts.serve(whole, true).await.unwrap();
        assert!(!gz, "nothing compressed yet");
        let mut later = None;
        for _ in 0..200 {
            let (f, gz) = parts.serve(whole, true).await.unwrap();
            if gz {
                later = Some(f);
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let later = later.expect("compressed within 2 s");
        assert!(later.images.len() < first.images.len());
        assert!(
            !parts.serve(whole, false).await.unwrap().1,
            "raw when gzip is not accepted"
        );
    }
}
