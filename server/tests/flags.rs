//! The flag reference, docs/flags.md, is generated from the clap types in `crowdgrad::cli`, so
//! flags are described once (in their doc comments) and the reference cannot go stale:
//!
//! - `flag_reference_is_current` generates the text and fails when docs/flags.md differs;
//! - `write_flag_reference` (ignored; `cargo xtask flags` runs it) writes the file.
//!
//! The generator walks `Cli::command()` depth first in declaration order: one section per
//! command and subcommand with its about text, then every visible argument with its value name,
//! default, environment variable, possible values and help. Hidden arguments are skipped, and
//! the global `--log-format` is listed once, at the top.

use clap::{Arg, ArgAction, Command, CommandFactory};
use std::fmt::Write as _;
use std::path::PathBuf;

/// Where the reference lives, from the repository root.
const REFERENCE: &str = "docs/flags.md";

fn reference_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("server/ lives one level below the repository root")
        .join(REFERENCE)
}

/// The whole reference as Markdown.
fn flag_reference() -> String {
    let root = crowdgrad::cli::Cli::command();
    let mut out = String::new();
    out.push_str("# Flag reference\n\n");
    out.push_str(
        "Generated from the clap types in `server/src/cli.rs` (and the `*Args` structs they \
         hold) by `cargo xtask flags`; do not edit by hand. `server/tests/flags.rs` fails when \
         this file differs from what the code says. `crowdgrad <command> --help` prints the \
         same text.\n\n",
    );
    if let Some(about) = root.get_about() {
        let _ = writeln!(out, "{about}\n");
    }
    // The commands, as a table of contents.
    for (path, cmd) in commands(&root) {
        if path.len() < 2 {
            continue;
        }
        let depth = path.len() - 2;
        let name = path.join(" ");
        let about = cmd.get_about().map(first_line).unwrap_or_default();
        let _ = writeln!(
            out,
            "{}- [`{name}`](#{}): {about}",
            "  ".repeat(depth),
            anchor(&name)
        );
    }
    out.push('\n');
    let globals: Vec<&Arg> = visible_args(&root).filter(|a| a.is_global_set()).collect();
    if !globals.is_empty() {
        out.push_str("## Every command\n\n");
        out.push_str("These flags are accepted by every command, before or after its name.\n\n");
        for arg in globals {
            write_arg(&mut out, arg);
        }
        out.push('\n');
    }
    for (path, cmd) in commands(&root) {
        if path.len() < 2 {
            continue;
        }
        let name = path.join(" ");
        let _ = writeln!(out, "## {name}\n");
        if let Some(about) = cmd.get_long_about().or(cmd.get_about()) {
            let _ = writeln!(out, "{}\n", about.to_string().trim_end());
        }
        let subs: Vec<&str> = cmd
            .get_subcommands()
            .filter(|s| !s.is_hide_set())
            .map(Command::get_name)
            .collect();
        let _ = writeln!(out, "```text\n{}\n```\n", usage(&name, cmd, &subs));
        if !subs.is_empty() {
            let list: Vec<String> = subs
                .iter()
                .map(|s| {
                    let full = format!("{name} {s}");
                    format!("[`{s}`](#{})", anchor(&full))
                })
                .collect();
            let _ = writeln!(out, "Subcommands: {}.\n", list.join(", "));
        }
        let args: Vec<&Arg> = visible_args(cmd).filter(|a| !a.is_global_set()).collect();
        if args.is_empty() && subs.is_empty() {
            out.push_str("No flags of its own.\n\n");
        }
        let mut heading: Option<&str> = None;
        for arg in args {
            if arg.get_help_heading() != heading {
                heading = arg.get_help_heading();
                if let Some(h) = heading {
                    let _ = writeln!(out, "\n### {h}\n");
                }
            }
            write_arg(&mut out, arg);
        }
        out.push('\n');
    }
    // One trailing newline, no blank lines doubled.
    let mut text = out.trim_end().to_owned();
    while text.contains("\n\n\n") {
        text = text.replace("\n\n\n", "\n\n");
    }
    text.push('\n');
    text
}

/// Every command below `root` (itself included) with its path of names, depth first, in
/// declaration order, hidden ones and clap's generated `help` left out.
fn commands(root: &Command) -> Vec<(Vec<String>, &Command)> {
    fn walk<'a>(cmd: &'a Command, path: Vec<String>, out: &mut Vec<(Vec<String>, &'a Command)>) {
        out.push((path.clone(), cmd));
        for sub in cmd.get_subcommands() {
            if sub.is_hide_set() || sub.get_name() == "help" {
                continue;
            }
            let mut p = path.clone();
            p.push(sub.get_name().to_owned());
            walk(sub, p, out);
        }
    }
    let mut out = Vec::new();
    walk(root, vec![root.get_name().to_owned()], &mut out);
    out
}

/// The arguments a reader can use: not hidden, not clap's own `--help` / `--version`.
fn visible_args(cmd: &Command) -> impl Iterator<Item = &Arg> {
    cmd.get_arguments().filter(|a| {
        !a.is_hide_set()
            && !matches!(
                a.get_action(),
                ArgAction::Help | ArgAction::HelpShort | ArgAction::HelpLong | ArgAction::Version
            )
    })
}

/// A one-line synopsis: `crowdgrad bench e2e [FLAGS] [-- SERVE_ARGS...]`.
fn usage(name: &str, cmd: &Command, subs: &[&str]) -> String {
    let mut s = name.to_owned();
    if visible_args(cmd).any(|a| !a.is_positional() && !a.is_global_set()) {
        s.push_str(" [FLAGS]");
    }
    for arg in visible_args(cmd).filter(|a| a.is_positional()) {
        s.push(' ');
        s.push_str(&arg_name(arg));
    }
    if !subs.is_empty() {
        s.push_str(" <COMMAND>");
    }
    s
}

/// How an argument is written: `--addr <ADDR>`, `-s, --steps <N>`, `<TOKEN>`, `-- ARGS...`.
fn arg_name(arg: &Arg) -> String {
    let values = value_names(arg);
    if arg.is_positional() {
        let v = if values.is_empty() {
            arg.get_id().as_str().to_uppercase()
        } else {
            values.join(" ")
        };
        let many = arg.get_num_args().is_some_and(|n| n.max_values() > 1)
            || matches!(arg.get_action(), ArgAction::Append);
        let v = if many { format!("{v}...") } else { v };
        return if arg.is_last_set() {
            format!("[-- {v}]")
        } else if arg.is_required_set() {
            format!("<{v}>")
        } else {
            format!("[{v}]")
        };
    }
    let mut s = String::new();
    if let Some(short) = arg.get_short() {
        let _ = write!(s, "-{short}, ");
    }
    match arg.get_long() {
        Some(long) => {
            let _ = write!(s, "--{long}");
        }
        None => s.push_str(arg.get_id().as_str()),
    }
    if arg.get_action().takes_values() {
        let v = if values.is_empty() {
            arg.get_id().as_str().to_uppercase()
        } else {
            values.join("> <")
        };
        let _ = write!(s, " <{v}>");
    }
    s
}

fn value_names(arg: &Arg) -> Vec<String> {
    arg.get_value_names()
        .map(|v| v.iter().map(|s| s.to_string()).collect())
        .unwrap_or_default()
}

/// One argument as a list item: the name in code, then what it takes, then its help.
fn write_arg(out: &mut String, arg: &Arg) {
    let mut facts: Vec<String> = Vec::new();
    if arg.is_required_set() {
        facts.push("required".into());
    }
    let aliases: Vec<String> = arg
        .get_visible_aliases()
        .unwrap_or_default()
        .iter()
        .map(|a| format!("`--{a}`"))
        .collect();
    if !aliases.is_empty() {
        facts.push(format!("alias {}", aliases.join(", ")));
    }
    let defaults: Vec<String> = arg
        .get_default_values()
        .iter()
        .map(|v| v.to_string_lossy().into_owned())
        .collect();
    if arg.get_action().takes_values() && !defaults.is_empty() {
        let shown: Vec<String> = defaults.iter().map(|d| format!("`{d}`")).collect();
        facts.push(format!("default {}", shown.join(", ")));
    }
    if let Some(env) = arg.get_env() {
        facts.push(format!("env `{}`", env.to_string_lossy()));
    }
    if arg.get_action().takes_values() {
        let possible: Vec<String> = arg
            .get_possible_values()
            .iter()
            .filter(|p| !p.is_hide_set())
            .map(|p| match p.get_help() {
                Some(h) => format!(
                    "`{}` ({})",
                    p.get_name(),
                    first_line(h).trim_end_matches('.')
                ),
                None => format!("`{}`", p.get_name()),
            })
            .collect();
        if !possible.is_empty() {
            facts.push(format!("one of {}", possible.join(", ")));
        }
    }
    if let Some(d) = arg.get_value_delimiter() {
        if arg.get_action().takes_values() {
            facts.push(format!("a `{d}` list"));
        }
    }
    if matches!(arg.get_action(), ArgAction::Append)
        && !arg.is_positional()
        && arg.get_value_delimiter().is_none()
    {
        facts.push("repeatable".into());
    }
    let _ = write!(out, "- `{}`", arg_name(arg));
    if !facts.is_empty() {
        let _ = write!(out, " ({})", facts.join("; "));
    }
    out.push('\n');
    if let Some(help) = arg.get_long_help().or(arg.get_help()) {
        for line in help.to_string().trim_end().lines() {
            if line.trim().is_empty() {
                out.push('\n');
            } else {
                let _ = writeln!(out, "  {}", line.trim_end());
            }
        }
    }
}

fn first_line(s: &clap::builder::StyledStr) -> String {
    s.to_string().lines().next().unwrap_or("").trim().to_owned()
}

/// GitHub's heading anchor: lower case, spaces to dashes, punctuation dropped.
fn anchor(heading: &str) -> String {
    heading
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c.to_ascii_lowercase()),
            _ => None,
        })
        .collect()
}

#[test]
fn flag_reference_is_current() {
    let want = flag_reference();
    let path = reference_path();
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    if have != want {
        let line = have
            .lines()
            .zip(want.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| have.lines().count().min(want.lines().count()));
        panic!(
            "{REFERENCE} is not what the clap types in server/src/cli.rs generate (first \
             difference at line {}): run `cargo xtask flags` and commit the result",
            line + 1
        );
    }
}

#[test]
#[ignore = "writes docs/flags.md; run by `cargo xtask flags`"]
fn write_flag_reference() {
    let path = reference_path();
    std::fs::write(&path, flag_reference()).expect("writing docs/flags.md");
    println!("wrote {}", path.display());
}

#[test]
fn every_command_and_visible_flag_is_in_the_reference() {
    let text = flag_reference();
    let root = crowdgrad::cli::Cli::command();
    for (path, cmd) in commands(&root) {
        if path.len() >= 2 {
            assert!(text.contains(&format!("## {}\n", path.join(" "))));
        }
        for arg in visible_args(cmd) {
            if let Some(long) = arg.get_long() {
                assert!(text.contains(&format!("`--{long}")), "--{long} missing");
            }
        }
    }
    // Hidden flags stay out, and the global flag is listed once.
    assert_eq!(text.matches("`--log-format").count(), 1);
}
