//! `crowdgrad serve --config run.toml`: a TOML run file under the command-line flags.
//!
//! Every key of the file stands for one `serve` flag ([`KEYS`]: `training.batch_size` is
//! `--batch-size`, `data.fetch = false` is `--no-fetch`). The file's values become the flags'
//! defaults, so clap parses and checks them like typed flags, and a flag given on the command
//! line wins over the file. An unknown section or key, or a value of the wrong type, is refused
//! before anything starts, naming the key; a bad value or combination caught by the flags'
//! checks is reported with the key it came from ([`explain`]).
//!
//! [`resolve`] also returns the resolved configuration (file and flags merged) as a TOML table,
//! which `serve` prints at start and shows in `/api/status` (`config`): a run file that
//! reproduces the run. Secrets (tokens, the run secret) have no key and never appear.

use crate::error::{Error, Result};
use clap::parser::ValueSource;
use clap::{ArgMatches, Command};
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// What TOML type a key takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A string.
    Str,
    /// An integer.
    Int,
    /// A number (an integer is accepted).
    Float,
    /// A boolean.
    Bool,
    /// A boolean that sets the negated flag (`data.fetch = false` is `--no-fetch`).
    NotBool,
    /// An integer or a string (`local_steps = 4` or `"auto"`).
    IntOrStr,
    /// A number or a string (`spot_check = 0.05` or `"auto"`).
    FloatOrStr,
    /// An array of strings (a comma-separated flag).
    List,
    /// A model: its text, or its layers as an array of layer texts and one-key tables
    /// (`[{ conv = "32x5x5" }, { pool = 2 }, "dense:128"]` is `conv:32x5x5,pool:2,dense:128`).
    Model,
}

/// One key of the run file: `section.key`, the clap argument id it sets, its type.
#[derive(Debug, Clone, Copy)]
pub struct Key {
    /// Where it sits in the file: `"addr"` or `"training.model"`.
    pub path: &'static str,
    /// The `serve` argument id (the field name in [`crate::config::ServeArgs`]).
    pub arg: &'static str,
    /// Its TOML type.
    pub kind: Kind,
}

const fn key(path: &'static str, arg: &'static str, kind: Kind) -> Key {
    Key { path, arg, kind }
}

/// Every key a run file may hold.
pub const KEYS: &[Key] = &[
    key("addr", "addr", Kind::Str),
    key("eval_every", "eval_every", Kind::Float),
    key("web_dir", "web_dir", Kind::Str),
    key("training.model", "model", Kind::Model),
    key("training.normalize", "normalize", Kind::Str),
    key("training.optimizer", "optimizer", Kind::Str),
    key("training.lr", "lr", Kind::Float),
    key("training.momentum", "momentum", Kind::Float),
    key("training.weight_decay", "weight_decay", Kind::Float),
    key("training.clip_norm", "clip_norm", Kind::Float),
    key("training.lr_warmup", "lr_warmup", Kind::Int),
    key("training.lr_decay", "lr_decay", Kind::Str),
    key("training.lr_decay_samples", "lr_decay_samples", Kind::Int),
    key("training.lr_min_ratio", "lr_min_ratio", Kind::Float),
    key("training.ema", "ema", Kind::Float),
    key("training.batch_size", "batch_size", Kind::Int),
    key("training.seed", "seed", Kind::Int),
    key("training.consistency", "consistency", Kind::Str),
    key("training.staleness", "staleness", Kind::Str),
    key("training.aggregation", "aggregation", Kind::Str),
    key(
        "training.heartbeat_timeout",
        "heartbeat_timeout",
        Kind::Float,
    ),
    key("training.sync_timeout", "sync_timeout", Kind::Float),
    key("training.local_steps", "local_steps", Kind::IntOrStr),
    key("training.inner_optimizer", "inner_optimizer", Kind::Str),
    key("training.inner_lr", "inner_lr", Kind::Float),
    key(
        "training.inner_weight_decay",
        "inner_weight_decay",
        Kind::Float,
    ),
    key("training.overlap", "overlap", Kind::Str),
    key("training.pull_encoding", "pull_encoding", Kind::Str),
    key("training.push_encoding", "push_encoding", Kind::Str),
    key("shards.count", "shards", Kind::Int),
    key("shards.urls", "shard_urls", Kind::List),
    key("data.dir", "data_dir", Kind::Str),
    key("data.dataset", "dataset", Kind::Str),
    key("data.partitions", "partitions", Kind::Int),
    key("data.fetch", "no_fetch", Kind::NotBool),
    key("data.text_level", "text_level", Kind::Str),
    key("data.valid_fraction", "valid_fraction", Kind::Float),
    key("checkpoint.dir", "checkpoint_dir", Kind::Str),
    key("checkpoint.every", "checkpoint_every", Kind::Float),
    key("checkpoint.keep", "checkpoint_keep", Kind::Int),
    key("checkpoint.reshard", "reshard", Kind::Bool),
    key("ledger.path", "ledger", Kind::Str),
    key("limits.max_workers", "max_workers", Kind::Int),
    key("limits.admission_floor", "admission_floor", Kind::Int),
    key("limits.max_connections", "max_connections", Kind::Int),
    key(
        "limits.max_connections_per_ip",
        "max_connections_per_ip",
        Kind::Int,
    ),
    key(
        "limits.max_connections_per_prefix",
        "max_connections_per_prefix",
        Kind::Int,
    ),
    key(
        "limits.max_unauthenticated",
        "max_unauthenticated",
        Kind::Int,
    ),
    key("limits.push_rate", "push_rate", Kind::Float),
    key("limits.push_rate_per_ip", "push_rate_per_ip", Kind::Float),
    key("limits.join_rate", "join_rate", Kind::Int),
    key("limits.egress_budget", "egress_budget", Kind::Str),
    key("limits.download_rate", "download_rate", Kind::Int),
    key("limits.idle_timeout", "idle_timeout", Kind::Float),
    key("limits.hello_timeout", "hello_timeout", Kind::Float),
    key("limits.header_timeout", "header_timeout", Kind::Float),
    key("limits.trust_proxy", "trust_proxy", Kind::Bool),
    key("defence.spot_check", "spot_check", Kind::FloatOrStr),
    key(
        "defence.spot_check_cosine",
        "spot_check_cosine",
        Kind::Float,
    ),
    key(
        "defence.spot_check_norm_tol",
        "spot_check_norm_tol",
        Kind::Float,
    ),
    key(
        "defence.spot_check_history",
        "spot_check_history",
        Kind::IntOrStr,
    ),
    key(
        "defence.spot_check_rollback",
        "no_spot_check_rollback",
        Kind::NotBool,
    ),
    key(
        "defence.spot_check_hold",
        "no_spot_check_hold",
        Kind::NotBool,
    ),
    key(
        "defence.quarantine_rejections",
        "quarantine_rejections",
        Kind::Int,
    ),
    key(
        "defence.quarantine_window",
        "quarantine_window",
        Kind::Float,
    ),
    key(
        "defence.quarantine_out_of_bounds",
        "quarantine_out_of_bounds",
        Kind::Bool,
    ),
];

/// The resolved configuration of a `serve` command line.
#[derive(Debug, Clone, Default)]
pub struct Resolved {
    /// The run file, if one was given.
    pub file: Option<PathBuf>,
    /// Every key with a value after merging, by section (the shape of a run file).
    pub table: toml::Table,
    /// Keys whose value came from the file (not overridden by a flag).
    pub from_file: Vec<Key>,
}

impl Resolved {
    /// The resolved configuration as a run file.
    pub fn to_toml(&self) -> String {
        toml::to_string(&self.table).unwrap_or_default()
    }

    /// The same as JSON, for `/api/status`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(&self.table).unwrap_or_default()
    }
}

fn type_name(v: &toml::Value) -> &'static str {
    v.type_str()
}

/// The flag text (clap default values) for `value` of `k`.
fn flag_values(k: &Key, value: &toml::Value, file: &Path) -> Result<Vec<String>> {
    use toml::Value as V;
    let wrong = |want: &str| {
        Err(Error::Config(format!(
            "{}: key {} must be {want}, got {} {value}",
            file.display(),
            k.path,
            type_name(value)
        )))
    };
    Ok(match (k.kind, value) {
        (Kind::Str, V::String(s)) => vec![s.clone()],
        (Kind::Int, V::Integer(i)) if *i >= 0 => vec![i.to_string()],
        (Kind::Int, _) => return wrong("a non-negative integer"),
        (Kind::Float, V::Integer(i)) => vec![i.to_string()],
        (Kind::Float, V::Float(f)) => vec![f.to_string()],
        (Kind::Float, _) => return wrong("a number"),
        (Kind::Bool, V::Boolean(b)) => vec![b.to_string()],
        (Kind::NotBool, V::Boolean(b)) => vec![(!b).to_string()],
        (Kind::Bool | Kind::NotBool, _) => return wrong("true or false"),
        (Kind::IntOrStr, V::Integer(i)) if *i >= 0 => vec![i.to_string()],
        (Kind::IntOrStr, V::String(s)) => vec![s.clone()],
        (Kind::IntOrStr, _) => return wrong("an integer or a string"),
        (Kind::FloatOrStr, V::Integer(i)) => vec![i.to_string()],
        (Kind::FloatOrStr, V::Float(f)) => vec![f.to_string()],
        (Kind::FloatOrStr, V::String(s)) => vec![s.clone()],
        (Kind::FloatOrStr, _) => return wrong("a number or a string"),
        (Kind::List, V::Array(a)) => {
            let mut out = Vec::new();
            for v in a {
                match v {
                    V::String(s) => out.push(s.clone()),
                    _ => return wrong("an array of strings"),
                }
            }
            // One comma-separated value: the flag splits it like a command-line value.
            vec![out.join(",")]
        }
        (Kind::List, _) => return wrong("an array of strings"),
        (Kind::Model, V::String(s)) => vec![s.clone()],
        (Kind::Model, V::Array(a)) => vec![model_layers(k, a, file)?],
        (Kind::Model, _) => return wrong("a model text or an array of layers"),
        (Kind::Str, _) => return wrong("a string"),
    })
}

/// The model text of a layer array: each item a layer text (`"dense:128"`, `"flatten"`) or
/// a table of one layer (`{ conv = "32x5x5/p2" }`, `{ pool = 2 }`, `{ dropout = 0.5 }`).
fn model_layers(k: &Key, layers: &[toml::Value], file: &Path) -> Result<String> {
    use toml::Value as V;
    let bad = |i: usize, why: &str| {
        Err(Error::Config(format!(
            "{}: key {} layer {i}: {why} (use \"conv:32x5x5\" or {{ conv = \"32x5x5\" }})",
            file.display(),
            k.path
        )))
    };
    if layers.is_empty() {
        return bad(
            0,
            "an empty layer list (use \"softmax\" for no hidden layer)",
        );
    }
    let mut out = Vec::with_capacity(layers.len());
    for (i, layer) in layers.iter().enumerate() {
        match layer {
            V::String(s) => out.push(s.clone()),
            V::Table(t) if t.len() == 1 => {
                let Some((name, value)) = t.iter().next() else {
                    return bad(i, "an empty table");
                };
                match value {
                    V::String(v) => out.push(format!("{name}:{v}")),
                    V::Integer(v) => out.push(format!("{name}:{v}")),
                    V::Float(v) => out.push(format!("{name}:{v}")),
                    _ => return bad(i, "a layer's value must be a string or a number"),
                }
            }
            V::Table(_) => return bad(i, "a layer table holds exactly one layer"),
            _ => return bad(i, "a layer is a string or a one-key table"),
        }
    }
    Ok(out.join(","))
}

/// Reads `file` and returns the (key, flag values) pairs it sets.
///
/// # Errors
/// An unreadable file, bad TOML, an unknown section or key, or a value of the wrong type,
/// each naming the file and the key.
pub fn load(file: &Path) -> Result<Vec<(Key, Vec<String>)>> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| Error::io(format!("reading the run file {}", file.display()), e))?;
    if text.len() > 1 << 20 {
        return Err(Error::Config(format!(
            "{}: a run file is at most 1 MiB",
            file.display()
        )));
    }
    let table: toml::Table =
        toml::from_str(&text).map_err(|e| Error::Config(format!("{}: {e}", file.display())))?;
    let mut out = Vec::new();
    let mut visit = |path: String, value: &toml::Value| -> Result<()> {
        let Some(k) = KEYS.iter().find(|k| k.path == path) else {
            return Err(Error::Config(format!(
                "{}: unknown key {path} (known keys: {})",
                file.display(),
                KEYS.iter().map(|k| k.path).collect::<Vec<_>>().join(", ")
            )));
        };
        out.push((*k, flag_values(k, value, file)?));
        Ok(())
    };
    for (name, value) in &table {
        let is_section = KEYS.iter().any(|k| k.path.starts_with(&format!("{name}.")));
        match value {
            toml::Value::Table(t) if is_section => {
                for (k, v) in t {
                    visit(format!("{name}.{k}"), v)?;
                }
            }
            _ if is_section => {
                return Err(Error::Config(format!(
                    "{}: {name} must be a section ([{name}])",
                    file.display()
                )))
            }
            v => visit(name.clone(), v)?,
        }
    }
    Ok(out)
}

fn has_arg(cmd: &Command, id: &str) -> bool {
    cmd.get_arguments().any(|a| a.get_id() == id)
}

/// Parses `argv` for the `Cli` parser `P` whose subcommand `serve` takes `--config`: when
/// `serve --config FILE` is given, FILE's values become the defaults of their flags, and the
/// command line is parsed again (so explicit flags win). Exits like clap on `--help` or bad
/// flags.
///
/// # Errors
/// A bad run file ([`load`]), or a key this build has no flag for.
pub fn resolve<P: clap::Parser>(argv: Vec<OsString>) -> Result<(P, Option<Resolved>)> {
    let first = P::command().get_matches_from(argv.clone());
    let Some(serve) = first.subcommand_matches("serve") else {
        return Ok((from_matches(&first), None));
    };
    let file = serve.get_one::<PathBuf>("config").cloned();
    let sets = match &file {
        Some(f) => load(f)?,
        None => Vec::new(),
    };
    let mut cmd = P::command();
    {
        let sub = cmd
            .find_subcommand_mut("serve")
            .ok_or_else(|| Error::Config("no serve command".into()))?;
        for (k, _) in &sets {
            if !has_arg(sub, k.arg) {
                return Err(Error::Config(format!(
                    "{}: key {} is not supported by this build",
                    file.as_deref().unwrap_or(Path::new("run file")).display(),
                    k.path
                )));
            }
        }
    }
    let cmd = cmd.mut_subcommand("serve", |mut sub| {
        for (k, values) in &sets {
            let values = values.clone();
            sub = sub.mut_arg(k.arg, move |a| a.default_values(values));
        }
        sub
    });
    let matches = cmd.clone().get_matches_from(argv);
    let serve = matches
        .subcommand_matches("serve")
        .ok_or_else(|| Error::Config("no serve command".into()))?;
    let sub = cmd
        .find_subcommand("serve")
        .ok_or_else(|| Error::Config("no serve command".into()))?;
    let resolved = Resolved {
        table: table_of(sub, serve),
        from_file: sets
            .iter()
            .filter(|(k, _)| serve.value_source(k.arg) == Some(ValueSource::DefaultValue))
            .map(|(k, _)| *k)
            .collect(),
        file,
    };
    Ok((from_matches(&matches), Some(resolved)))
}

fn from_matches<P: clap::Parser>(m: &ArgMatches) -> P {
    P::from_arg_matches(m).unwrap_or_else(|e| e.exit())
}

/// The resolved value of every key, from the parsed `serve` matches, as a sectioned table.
fn table_of(cmd: &Command, m: &ArgMatches) -> toml::Table {
    use toml::Value as V;
    let mut root = toml::Table::new();
    for k in KEYS {
        if !has_arg(cmd, k.arg) {
            continue;
        }
        let Some(raw) = m.get_raw(k.arg) else {
            continue;
        };
        let raw: Vec<String> = raw.map(|s| s.to_string_lossy().into_owned()).collect();
        let Some(first) = raw.first().cloned() else {
            continue;
        };
        let value = match k.kind {
            Kind::Str | Kind::Model => V::String(first),
            Kind::Int => first.parse().map_or(V::String(first), V::Integer),
            Kind::Float => first.parse().map_or(V::String(first), V::Float),
            Kind::Bool => V::Boolean(first == "true"),
            Kind::NotBool => V::Boolean(first != "true"),
            Kind::IntOrStr => first.parse().map_or(V::String(first), V::Integer),
            Kind::FloatOrStr => first.parse().map_or(V::String(first), V::Float),
            Kind::List => V::Array(
                raw.iter()
                    .flat_map(|s| s.split(','))
                    .filter(|s| !s.is_empty())
                    .map(|s| V::String(s.to_string()))
                    .collect(),
            ),
        };
        match k.path.split_once('.') {
            Some((section, name)) => {
                let t = root
                    .entry(section)
                    .or_insert_with(|| V::Table(toml::Table::new()));
                if let V::Table(t) = t {
                    t.insert(name.to_string(), value);
                }
            }
            None => {
                root.insert(k.path.to_string(), value);
            }
        }
    }
    // Top-level keys first, then the sections (TOML needs plain keys before tables).
    let (plain, sections): (Vec<_>, Vec<_>) = root
        .into_iter()
        .partition(|(_, v)| !matches!(v, V::Table(_)));
    plain.into_iter().chain(sections).collect()
}

/// `e` (from the flags' checks) with the run-file key of the flag it names, when that flag's
/// value came from the file: "--batch-size 0 must be in 1..=4096 (run.toml key
/// training.batch_size)".
pub fn explain(e: impl std::fmt::Display, resolved: Option<&Resolved>) -> String {
    let msg = e.to_string();
    let Some(r) = resolved else { return msg };
    let file = r.file.as_deref().unwrap_or(Path::new("run file"));
    let keys: Vec<&str> = r
        .from_file
        .iter()
        .filter(|k| {
            let flag = match k.kind {
                Kind::NotBool => format!("--no-{}", k.arg.trim_start_matches("no_")),
                _ => format!("--{}", k.arg.replace('_', "-")),
            };
            msg.match_indices(&flag).any(|(i, _)| {
                // Whole flag only: `--lr` must not match `--lr-foo`.
                !msg[i + flag.len()..].starts_with(|c: char| c.is_alphanumeric() || c == '-')
            })
        })
        .map(|k| k.path)
        .collect();
    if keys.is_empty() {
        msg
    } else {
        format!("{msg} (set by {} key {})", file.display(), keys.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Parser, Subcommand};

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(subcommand)]
        cmd: Cmd,
    }

    #[derive(Subcommand, Debug)]
    enum Cmd {
        Serve(Box<crate::config::ServeArgs>),
    }

    fn write(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("crowdgrad-runfile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    fn run(file: &Path, flags: &[&str]) -> Result<(crate::config::ServeArgs, Resolved)> {
        let mut argv: Vec<OsString> = ["crowdgrad", "serve", "--config"]
            .iter()
            .map(OsString::from)
            .collect();
        argv.push(file.into());
        argv.extend(flags.iter().map(OsString::from));
        let (cli, r) = resolve::<Cli>(argv)?;
        let Cmd::Serve(a) = cli.cmd;
        Ok((*a, r.unwrap()))
    }

    #[test]
    fn the_file_sets_defaults_and_flags_win() {
        let f = write(
            "good.toml",
            "eval_every = 2\n[training]\nmodel = \"mlp:64\"\nbatch_size = 16\nlr = 0.1\n\
             [data]\nfetch = false\npartitions = 3\n[shards]\ncount = 3\n\
             [limits]\nmax_workers = 50\n",
        );
        let (a, r) = run(&f, &["--batch-size", "64"]).unwrap();
        assert_eq!(a.training.model, "mlp:64");
        assert_eq!(a.training.batch_size, 64, "the flag wins");
        assert_eq!(a.training.lr, Some(0.1));
        assert_eq!(a.training.shards, Some(3));
        assert!(a.no_fetch);
        assert_eq!((a.partitions, a.max_workers, a.eval_every), (3, 50, 2.0));
        let t = &r.table;
        assert_eq!(t["training"]["batch_size"].as_integer(), Some(64));
        assert_eq!(t["training"]["model"].as_str(), Some("mlp:64"));
        assert_eq!(t["data"]["fetch"].as_bool(), Some(false));
        assert_eq!(t["addr"].as_str(), Some("127.0.0.1:8080"), "defaults too");
        let from: Vec<&str> = r.from_file.iter().map(|k| k.path).collect();
        assert!(from.contains(&"training.model") && !from.contains(&"training.batch_size"));
        // The printed config is itself a valid run file giving the same values.
        let again = write("again.toml", &r.to_toml());
        let (b, _) = run(&again, &[]).unwrap();
        assert_eq!(b.training.batch_size, 64);
        assert_eq!(b.training.model, "mlp:64");
        assert!(b.no_fetch);
        assert_eq!(r.to_json()["training"]["lr"], 0.1);
    }

    /// Issue 12: a model written as a table of layers in the run file.
    #[test]
    fn a_model_is_a_list_of_layers_in_the_file() {
        let f = write(
            "layers.toml",
            "[training]\nnormalize = \"auto\"\nmodel = [\n  { conv = \"32x5x5/p2\" },\n  \
             { pool = 2 },\n  \"conv:64x5x5\",\n  { pool = 2 },\n  { dense = 128 },\n  \
             { dropout = 0.5 },\n]\n",
        );
        let (a, r) = run(&f, &[]).unwrap();
        assert_eq!(
            a.training.model,
            "conv:32x5x5/p2,pool:2,conv:64x5x5,pool:2,dense:128,dropout:0.5"
        );
        assert_eq!(a.training.normalize, "auto");
        let t = a.training.check(crate::config::SERVE_DEFAULTS).unwrap();
        assert_eq!(t.normalize, crowdgrad_core::data::NormalizeChoice::Auto);
        assert_eq!(
            r.table["training"]["model"].as_str(),
            Some(&*a.training.model)
        );
        for (text, says) in [
            ("model = []", "layer 0: an empty layer list"),
            (
                "model = [{ conv = \"8x3x3\", pool = 2 }]",
                "exactly one layer",
            ),
            ("model = [3]", "a layer is a string or a one-key table"),
            ("model = [{ conv = [8] }]", "a string or a number"),
            ("model = 3", "a model text or an array of layers"),
        ] {
            let f = write("badlayers.toml", &format!("[training]\n{text}\n"));
            let e = run(&f, &[]).unwrap_err().to_string();
            assert!(
                e.contains("training.model") && e.contains(says),
                "{text}: {e}"
            );
        }
        // A layer list outside the grammar is refused at start, naming the layer.
        let f = write(
            "badgrammar.toml",
            "[training]\nmodel = [{ conv = \"x\" }]\n",
        );
        let (a, _) = run(&f, &[]).unwrap();
        let e = a
            .training
            .check(crate::config::SERVE_DEFAULTS)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--model") && e.contains("conv:x"), "{e}");
    }

    /// Issue 20: the optimizer, its schedule and clipping in the run file, and back out.
    #[test]
    fn a_schedule_in_the_file_round_trips() {
        let f = write(
            "schedule.toml",
            "[training]\noptimizer = \"adamw\"\nlr = 0.0006\nclip_norm = 1.0\n\
             lr_warmup = 3200\nlr_decay = \"cosine\"\nlr_decay_samples = 320000\n\
             lr_min_ratio = 0.1\ninner_weight_decay = 0.05\nlocal_steps = 1\n",
        );
        let (a, r) = run(&f, &[]).unwrap();
        let t = a.training.check(crate::config::SERVE_DEFAULTS).unwrap();
        let s = t.optimizer.schedule;
        assert_eq!(
            (s.warmup, s.decay_samples, s.min_ratio),
            (3200, 320_000, 0.1)
        );
        assert_eq!(s.decay, crowdgrad_core::schedule::Decay::Cosine);
        assert_eq!(t.optimizer.clip_norm, Some(1.0));
        assert_eq!(t.optimizer.rule.name(), "adamw");
        assert_eq!(t.exchange.local.inner.weight_decay, 0.05);
        let tr = &r.table["training"];
        assert_eq!(tr["lr_decay"].as_str(), Some("cosine"));
        assert_eq!(tr["lr_warmup"].as_integer(), Some(3200));
        // The printed config is a run file giving the same training.
        let again = write("schedule-again.toml", &r.to_toml());
        let (b, _) = run(&again, &[]).unwrap();
        assert_eq!(b.training.check(crate::config::SERVE_DEFAULTS).unwrap(), t);
        // A bad combination from the file names its key.
        let f = write("badschedule.toml", "[training]\nlr_decay = \"linear\"\n");
        let (a, r) = run(&f, &[]).unwrap();
        let msg = explain(a.check().unwrap_err(), Some(&r));
        assert!(msg.contains("training.lr_decay"), "{msg}");
    }

    #[test]
    fn bad_files_are_refused_naming_the_key() {
        for (text, says) in [
            (
                "[training]\nbatchsize = 3\n",
                "unknown key training.batchsize",
            ),
            ("colour = \"red\"\n", "unknown key colour"),
            (
                "[training]\nbatch_size = \"x\"\n",
                "key training.batch_size must be a non-negative integer",
            ),
            (
                "[training]\nlr = \"fast\"\n",
                "key training.lr must be a number",
            ),
            (
                "[data]\nfetch = 1\n",
                "key data.fetch must be true or false",
            ),
            ("training = 3\n", "training must be a section"),
            ("[training\n", "bad.toml"),
        ] {
            let f = write("bad.toml", text);
            let e = run(&f, &[]).unwrap_err().to_string();
            assert!(e.contains(says), "{text:?}: {e}");
        }
        // A bad value the flags' check catches names the key it came from.
        let f = write("zero.toml", "[training]\nbatch_size = 0\n");
        let (a, r) = run(&f, &[]).unwrap();
        let e = a.check().unwrap_err();
        let msg = explain(&e, Some(&r));
        assert!(msg.contains("training.batch_size"), "{msg}");
    }
}
