//! The test harness stays in one place (STYLE.md, "Tests own their processes in one place"):
//! a grep over the test sources that fails when a test file grows a second binary finder, a
//! second process guard, a second parse of the "listening on" line, a second Hello builder or
//! a `Fault` enum of its own. Each rule names the one file that holds the thing, and checks it
//! is there (so a rule cannot rot into matching nothing).
//!
//! The Rust sources are read without their comments (a doc comment may say "listening on");
//! string literals are kept, since that is where a parse's needle lives.

use std::path::{Path, PathBuf};

/// One kind of scaffolding: where it lives and the needles that give a copy away.
struct Rule {
    what: &'static str,
    /// The file (relative to the workspace root) that holds the one copy.
    home: &'static str,
    /// Files beside the home that may hold a needle for another reason.
    also: &'static [&'static str],
    needles: &'static [&'static str],
}

/// The Rust rules, over `tests/integration/*.rs` and `tests/src/*.rs`.
const RUST: &[Rule] = &[
    Rule {
        what: "a binary finder (use util::binary / util::crowdgrad)",
        home: "tests/integration/util.rs",
        also: &[],
        needles: &[
            "current_exe",
            "CARGO_TARGET_DIR",
            "CARGO_BIN_EXE",
            "target/release",
            "target/debug",
        ],
    },
    Rule {
        what: "a process guard (use util::Proc)",
        home: "tests/integration/util.rs",
        also: &[],
        // `std::process::Child` held anywhere, or a Drop that kills or reaps.
        needles: &["Child", "DROP-KILLS"],
    },
    Rule {
        what: "a parse of the \"listening on\" line (use util::listening_addr / Proc::listening)",
        home: "tests/integration/util.rs",
        also: &[],
        needles: &["listening on"],
    },
    Rule {
        what: "a Hello frame built inline (use util::hello)",
        home: "tests/integration/util.rs",
        also: &[],
        needles: &[
            "hello: Hello {",
            "hello: wire::Hello {",
            "Hello { protocol",
            "encode(&Frame::Hello",
            "encode(&Message::Hello",
            "encode(&wire::Message::Hello",
        ],
    },
    Rule {
        what:
            "a Fault enum of a test's own (use crowdgrad_core::fault::Fault with the real worker)",
        home: "core/src/fault.rs",
        also: &[],
        needles: &["enum Fault"],
    },
];

/// The browser rules, over `tests/browser/*.mjs`: what `harness.mjs` holds.
const BROWSER: &[Rule] = &[
    Rule {
        what: "a binary finder (use harness.mjs SERVER)",
        home: "tests/browser/harness.mjs",
        also: &[],
        needles: &["CARGO_TARGET_DIR", "target/release", "target/debug"],
    },
    Rule {
        what: "a server process started by hand (use harness.mjs startServer)",
        home: "tests/browser/harness.mjs",
        // cdp.mjs starts Chromium (through the caller's `track`).
        also: &["tests/browser/cdp.mjs"],
        needles: &["node:child_process", "listening on"],
    },
];

/// The character at `i`, if any.
fn at(c: &[char], i: usize) -> Option<char> {
    c.get(i).copied()
}

/// Whether the character before `i` continues an identifier (so `c[i]` is inside a word, not
/// the `r` of a raw string; `br"..."` is still one).
fn ends_ident(c: &[char], i: usize) -> bool {
    i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_') && c[i - 1] != 'b'
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `dir`'s files ending in `ext`, sorted.
fn sources(dir: &str, ext: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root().join(dir))
        .unwrap_or_else(|e| panic!("{dir}: {e}"))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(ext))
        .collect();
    v.sort();
    v
}

/// Rust source without comments, whitespace runs collapsed to one space. Strings (plain and
/// raw), char literals and lifetimes are told apart well enough for test code.
fn rust_code(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < c.len() {
        match c[i] {
            '/' if at(&c, i + 1) == Some('/') => {
                while i < c.len() && c[i] != '\n' {
                    i += 1;
                }
            }
            '/' if at(&c, i + 1) == Some('*') => {
                let mut depth = 0;
                while i < c.len() {
                    if c[i] == '/' && at(&c, i + 1) == Some('*') {
                        depth += 1;
                        i += 2;
                    } else if c[i] == '*' && at(&c, i + 1) == Some('/') {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
                out.push(' ');
            }
            'r' if !ends_ident(&c, i)
                && (at(&c, i + 1) == Some('"')
                    || (at(&c, i + 1) == Some('#')
                        && matches!(at(&c, i + 2), Some('"' | '#')))) =>
            {
                // A raw string, r"..." or r#"..."# (or a raw identifier, r#name).
                let mut j = i + 1;
                let mut hashes = 0;
                while c.get(j) == Some(&'#') {
                    hashes += 1;
                    j += 1;
                }
                if c.get(j) != Some(&'"') {
                    out.push('r');
                    i += 1;
                    continue;
                }
                let mut k = j + 1;
                while k < c.len() {
                    if c[k] == '"' && (1..=hashes).all(|h| c.get(k + h) == Some(&'#')) {
                        k += 1 + hashes;
                        break;
                    }
                    k += 1;
                }
                let k = k.min(c.len());
                out.extend(&c[i..k]);
                i = k;
            }
            '"' => {
                out.push('"');
                i += 1;
                while i < c.len() && c[i] != '"' {
                    if c[i] == '\\' {
                        out.push(c[i]);
                        i += 1;
                    }
                    if i < c.len() {
                        out.push(c[i]);
                        i += 1;
                    }
                }
                out.push('"');
                i += 1;
            }
            '\'' if at(&c, i + 1) == Some('\\') || at(&c, i + 2) == Some('\'') => {
                // A char literal ('x', '\n', '\''), not a lifetime.
                let mut j = i + 1;
                if c.get(j) == Some(&'\\') {
                    j += 2;
                }
                while j < c.len() && c[j] != '\'' {
                    j += 1;
                }
                out.extend(&c[i..(j + 1).min(c.len())]);
                i = j + 1;
            }
            ch => {
                out.push(ch);
                i += 1;
            }
        }
    }
    out.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// JavaScript without `//` and `/* */` comments (strings and template literals kept).
fn js_code(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < c.len() {
        match c[i] {
            '/' if at(&c, i + 1) == Some('/') => {
                while i < c.len() && c[i] != '\n' {
                    i += 1;
                }
            }
            '/' if at(&c, i + 1) == Some('*') => {
                i += 2;
                while i < c.len() && !(c[i] == '*' && at(&c, i + 1) == Some('/')) {
                    i += 1;
                }
                i += 2;
                out.push(' ');
            }
            q @ ('"' | '\'' | '`') => {
                out.push(q);
                i += 1;
                while i < c.len() && c[i] != q {
                    if c[i] == '\\' {
                        out.push(c[i]);
                        i += 1;
                    }
                    if i < c.len() {
                        out.push(c[i]);
                        i += 1;
                    }
                }
                out.push(q);
                i += 1;
            }
            ch => {
                out.push(ch);
                i += 1;
            }
        }
    }
    out.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Whether `code` holds `needle`: as a whole word for identifiers (`Child`, not `Children`);
/// `DROP-KILLS` is an `impl Drop` whose body kills or waits for a process.
fn holds(code: &str, needle: &str) -> bool {
    if needle == "DROP-KILLS" {
        return code.match_indices("impl Drop for").any(|(at, _)| {
            let rest = &code[at..];
            let Some(open) = rest.find('{') else {
                return false;
            };
            let mut depth = 0usize;
            let mut end = rest.len();
            for (k, ch) in rest[open..].char_indices() {
                match ch {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            end = open + k;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            let body = &rest[open..end];
            body.contains(".kill(") || body.contains(".wait(")
        });
    }
    let word = needle
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_');
    code.match_indices(needle).any(|(at, _)| {
        if !word {
            return true;
        }
        let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
        let before = code[..at].chars().next_back().is_some_and(ident);
        let after = code[at + needle.len()..].chars().next().is_some_and(ident);
        !before && !after
    })
}

/// Every (file, rule, needle) of `files` that breaks `rules`, and checks each rule's home
/// holds one of its needles.
fn check(rules: &[Rule], files: &[PathBuf], code: fn(&str) -> String) -> Vec<String> {
    let here = Path::new(file!())
        .file_name()
        .expect("file name")
        .to_owned();
    let mut found = Vec::new();
    for rule in rules {
        let home = root().join(rule.home);
        let home_code = code(&std::fs::read_to_string(&home).expect("the rule's home"));
        assert!(
            rule.needles.iter().any(|n| holds(&home_code, n)),
            "{} holds none of {:?}: the rule for {} matches nothing there",
            rule.home,
            rule.needles,
            rule.what
        );
        for f in files {
            let name = f.file_name().expect("file name");
            // This file names every needle; the home is where the one copy lives.
            if name == here || f.ends_with(rule.home) || rule.also.iter().any(|a| f.ends_with(a)) {
                continue;
            }
            let text = code(&std::fs::read_to_string(f).expect("read"));
            for n in rule.needles {
                if holds(&text, n) {
                    found.push(format!("{}: {} ({n:?})", f.display(), rule.what));
                }
            }
        }
    }
    found
}

#[test]
fn no_test_file_copies_the_harness() {
    let mut rust = sources("tests/integration", ".rs");
    rust.extend(sources("tests/src", ".rs"));
    let mut found = check(RUST, &rust, rust_code);
    found.extend(check(BROWSER, &sources("tests/browser", ".mjs"), js_code));
    assert!(
        found.is_empty(),
        "test scaffolding copied outside its one home:\n  {}",
        found.join("\n  ")
    );
}

#[test]
fn the_grep_sees_code_not_comments() {
    let c = rust_code(
        "// listening on\nlet url = \"ws://x\"; /* Child */ let c = '\"'; let s = r#\"a \"listening on\" b\"#; fn f<'a>() {}\n",
    );
    assert!(!c.contains("// listening") && !c.contains("Child"), "{c}");
    assert!(c.contains("\"ws://x\"") && holds(&c, "listening on"), "{c}");
    assert!(c.contains("fn f<'a>() {}"), "{c}");
    assert!(holds("struct Children;", "Children") && !holds("struct Children;", "Child"));
    let d = rust_code("impl Drop for X { fn drop(&mut self) { let _ = self.c.kill(); } }");
    assert!(holds(&d, "DROP-KILLS"));
    let d = rust_code("impl Drop for Tmp { fn drop(&mut self) { remove(&self.0); } }");
    assert!(!holds(&d, "DROP-KILLS"));
    let j = js_code("// CARGO_TARGET_DIR\nconst u = 'http://x'; /* listening on */");
    assert!(
        !j.contains("CARGO_TARGET_DIR") && !j.contains("listening") && j.contains("'http://x'")
    );
}
