//! The shape of `server/src`, checked rather than trusted: every `crate::` / `super::` path in
//! code (not in comments, not in `#[cfg(test)]` modules) is an edge from one file to another,
//! and
//!
//! - the graph of files has no cycle;
//! - a file of a role imports only its own role and the roles below it, in the order of
//!   [`ROLES`] (the `# Layout` of `server/src/lib.rs`): nothing below the coordinator can name
//!   `App`.
//!
//! Re-exports are followed (`crate::Result` is `crate::error`'s), so a `pub use` in a parent does
//! not hide a dependency.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The roles from the bottom up: a module path prefix (after `crate::`) and its rank. A file
/// may import files of equal or lower rank only.
const ROLES: &[(&str, u32)] = &[
    ("error", 0),
    ("support", 0),
    ("config", 1),
    ("registry", 2),
    ("defence", 3),
    ("shard", 4),
    ("net", 5),
    ("checkpoint", 6),
    ("coordinator", 7),
    ("shardproc", 8),
    ("worker", 9),
    ("sim", 10),
    ("bench", 11),
    ("ctl", 11),
    ("cli", 12),
    // lib.rs: the crate root re-exports and documents; main.rs parses flags.
    ("", 13),
];

fn rank(module: &str) -> u32 {
    let first = module.split("::").next().unwrap_or("");
    ROLES
        .iter()
        .find(|(name, _)| *name == first)
        .map(|(_, r)| *r)
        .unwrap_or_else(|| panic!("module crate::{module} belongs to no role of ROLES"))
}

/// `crate::a::b` for `src/a/b.rs` and `src/a/b/mod.rs`; `` for `src/lib.rs`.
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().expect("a file name");
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" {
        parts.push(stem.to_owned());
    }
    parts.join("::")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("readable src")
        .map(|e| e.expect("entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// The code of a file without comments, string contents and `#[cfg(test)]` items.
fn code_of(text: &str) -> String {
    // Drop the test module: `#[cfg(test)]` up to its matching brace.
    let mut s = String::new();
    let mut rest = text;
    while let Some(i) = rest.find("#[cfg(test)]") {
        s.push_str(&rest[..i]);
        let after = &rest[i..];
        match after.find('{') {
            Some(open) => {
                // A `#[cfg(test)] use ...;` ends at `;` before any brace.
                if let Some(semi) = after.find(';').filter(|&semi| semi < open) {
                    rest = &after[semi + 1..];
                    continue;
                }
                let mut depth = 0usize;
                let mut end = after.len();
                for (j, c) in after[open..].char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = open + j + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                rest = &after[end..];
            }
            None => rest = "",
        }
    }
    s.push_str(rest);
    // Drop line comments (doc comments included) and string literals' contents.
    let mut out = String::with_capacity(s.len());
    for line in s.lines() {
        let mut in_str = false;
        let mut prev = ' ';
        let mut kept = String::new();
        let chars: Vec<char> = line.chars().collect();
        let mut i = 0;
        while i < chars.len() {
            let c = chars[i];
            if !in_str && c == '/' && chars.get(i + 1) == Some(&'/') {
                break;
            }
            if c == '"' && prev != '\\' {
                in_str = !in_str;
                kept.push(c);
            } else if !in_str {
                kept.push(c);
            }
            prev = if prev == '\\' && c == '\\' { ' ' } else { c };
            i += 1;
        }
        out.push_str(&kept);
        out.push('\n');
    }
    out
}

/// Every path a file's code names: `crate::a::b`, `super::x`, and the members of
/// `use crate::{a, b::{c, d}}` groups, as segment lists (`crate` / `super` first).
fn paths_in(code: &str) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let bytes: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        let at_word_start = i == 0 || !(bytes[i - 1].is_alphanumeric() || bytes[i - 1] == '_');
        let starts = |w: &str| bytes[i..].iter().take(w.len()).copied().eq(w.chars());
        if at_word_start && (starts("crate::") || starts("super::")) {
            let (found, next) = parse_path(&bytes, i, Vec::new());
            paths.extend(found);
            i = next.max(i + 1);
        } else {
            i += 1;
        }
    }
    paths
}

/// Parses a path (with `{...}` groups) starting at `i`, prefixed by `prefix`.
fn parse_path(c: &[char], mut i: usize, prefix: Vec<String>) -> (Vec<Vec<String>>, usize) {
    let mut segs = prefix;
    loop {
        while i < c.len() && c[i].is_whitespace() {
            i += 1;
        }
        if i < c.len() && c[i] == '{' {
            // A group: each comma-separated member continues the path.
            i += 1;
            let mut out = Vec::new();
            loop {
                while i < c.len() && (c[i].is_whitespace() || c[i] == ',') {
                    i += 1;
                }
                if i >= c.len() || c[i] == '}' {
                    return (out, i + 1);
                }
                let (found, next) = parse_path(c, i, segs.clone());
                out.extend(found);
                i = next;
            }
        }
        let start = i;
        while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
            i += 1;
        }
        if start == i {
            return (vec![segs], i);
        }
        segs.push(c[start..i].iter().collect());
        if c.get(i) == Some(&':') && c.get(i + 1) == Some(&':') {
            i += 2;
        } else {
            return (vec![segs], i);
        }
    }
}

struct Crate {
    /// Module path → file.
    files: BTreeMap<String, PathBuf>,
    /// (module, name) → the module path its `pub use` re-exports the name from.
    reexports: BTreeMap<(String, String), String>,
}

impl Crate {
    /// The file a path lands in: the longest module prefix, following re-exports.
    fn resolve(&self, from: &str, path: &[String], depth: u32) -> Option<String> {
        let mut segs: Vec<String> = match path.first().map(String::as_str) {
            Some("crate") => path[1..].to_vec(),
            Some("super") => {
                let mut base: Vec<String> = if from.is_empty() {
                    vec![]
                } else {
                    from.split("::").map(str::to_owned).collect()
                };
                let mut rest = path;
                while rest.first().map(String::as_str) == Some("super") {
                    base.pop();
                    rest = &rest[1..];
                }
                base.extend(rest.iter().cloned());
                base
            }
            _ => return None,
        };
        if depth > 8 {
            return None;
        }
        let abs = segs.clone();
        // Longest prefix that is a module file.
        loop {
            let m = segs.join("::");
            if self.files.contains_key(&m) {
                // The next segment may be a name this module re-exports.
                if let Some(name) = abs.get(segs.len()) {
                    if let Some(target) = self.reexports.get(&(m.clone(), name.clone())) {
                        let mut p = vec!["crate".to_owned()];
                        p.extend(
                            target
                                .split("::")
                                .filter(|s| !s.is_empty())
                                .map(str::to_owned),
                        );
                        p.extend(abs[segs.len()..].iter().cloned());
                        return self.resolve(from, &p, depth + 1).or(Some(m));
                    }
                }
                return Some(m);
            }
            segs.pop()?;
        }
    }
}

fn load() -> (Crate, BTreeMap<String, String>) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    rust_files(&src, &mut all);
    let mut files = BTreeMap::new();
    let mut codes = BTreeMap::new();
    for f in all {
        if f.file_name().is_some_and(|n| n == "main.rs") && f.parent() == Some(src.as_path()) {
            continue; // the binary: a crate of its own, over the library
        }
        let m = module_of(&src, &f);
        let text = std::fs::read_to_string(&f).expect("readable file");
        codes.insert(m.clone(), code_of(&text));
        files.insert(m, f);
    }
    let mut reexports = BTreeMap::new();
    for (m, code) in &codes {
        for stmt in code.split(';') {
            let t = stmt.trim_start();
            let Some(body) = t
                .strip_prefix("pub use ")
                .or_else(|| t.strip_prefix("pub(crate) use "))
            else {
                continue;
            };
            let body = body.trim();
            // `pub use a::b::{X, Y}` / `pub use a::b::X` (relative to this module or crate::).
            let (base, names): (&str, Vec<&str>) = match body.find('{') {
                Some(open) => (
                    body[..open].trim_end_matches("::"),
                    body[open + 1..]
                        .trim_end_matches('}')
                        .split(',')
                        .map(str::trim)
                        .collect(),
                ),
                None => match body.rsplit_once("::") {
                    Some((b, n)) => (b, vec![n]),
                    None => continue,
                },
            };
            let target = if let Some(b) = base.strip_prefix("crate::") {
                b.to_owned()
            } else if base == "crate" {
                String::new()
            } else if m.is_empty() {
                base.to_owned()
            } else {
                format!("{m}::{base}")
            };
            for n in names {
                let n = n.split(" as ").last().unwrap_or(n).trim();
                if !n.is_empty() && n != "self" && n != "*" {
                    reexports.insert((m.clone(), n.to_owned()), target.clone());
                }
            }
        }
    }
    (Crate { files, reexports }, codes)
}

/// file → files it imports.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let (krate, codes) = load();
    let mut g = BTreeMap::new();
    for (m, code) in &codes {
        let mut deps = BTreeSet::new();
        let mut paths = paths_in(code);
        // `use child::X` in a parent: a path relative to this module.
        for stmt in code.split(';') {
            let t = stmt.trim_start();
            let t = t
                .strip_prefix("pub use ")
                .or_else(|| t.strip_prefix("pub(crate) use "))
                .or_else(|| t.strip_prefix("use "));
            if let Some(body) = t {
                let first = body.split("::").next().unwrap_or("").trim();
                let child = if m.is_empty() {
                    first.to_owned()
                } else {
                    format!("{m}::{first}")
                };
                if krate.files.contains_key(&child) {
                    let mut p = vec!["crate".to_owned()];
                    p.extend(child.split("::").map(str::to_owned));
                    paths.push(p);
                }
            }
        }
        for p in paths {
            if let Some(to) = krate.resolve(m, &p, 0) {
                if &to != m {
                    deps.insert(to);
                }
            }
        }
        g.insert(m.clone(), deps);
    }
    g
}

fn name(m: &str) -> String {
    if m.is_empty() {
        "crate (lib.rs)".into()
    } else {
        format!("crate::{m}")
    }
}

#[test]
fn server_src_has_no_import_cycle() {
    let g = graph();
    // Tarjan's strongly connected components.
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        next: usize,
        sccs: Vec<Vec<&'a str>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        t.index.insert(v, t.next);
        t.low.insert(v, t.next);
        t.next += 1;
        t.stack.push(v);
        t.on.insert(v);
        for w in t.g.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !t.g.contains_key(w) {
                continue;
            }
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if t.on.contains(w) {
                let iw = t.index[w];
                let lv = t.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut scc = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                scc.push(w);
                if w == v {
                    break;
                }
            }
            if scc.len() > 1 {
                t.sccs.push(scc);
            }
        }
    }
    let mut t = T {
        g: &g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        next: 0,
        sccs: Vec::new(),
    };
    for v in g.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    let cycles: Vec<String> = t
        .sccs
        .iter()
        .map(|scc| {
            let mut s: Vec<String> = scc.iter().map(|m| name(m)).collect();
            s.sort();
            format!("{} files: {}", s.len(), s.join(", "))
        })
        .collect();
    assert!(
        cycles.is_empty(),
        "import cycles in server/src:\n{}",
        cycles.join("\n")
    );
}

#[test]
fn server_src_roles_depend_downward_only() {
    let g = graph();
    let mut bad = Vec::new();
    for (from, deps) in &g {
        for to in deps {
            if rank(to) > rank(from) {
                bad.push(format!(
                    "{} (rank {}) imports {} (rank {})",
                    name(from),
                    rank(from),
                    name(to),
                    rank(to)
                ));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "imports that go up the layers of server/src/lib.rs:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_checker_sees_grouped_relative_and_reexported_paths() {
    let code = code_of(
        "use crate::{a::{B, c::D}, e};\n// use crate::commented;\nfn f() { super::g::h(); let s = \"crate::in_string\"; }\n#[cfg(test)]\nmod tests { use crate::only_tests; }\n",
    );
    let mut p: Vec<String> = paths_in(&code).iter().map(|p| p.join("::")).collect();
    p.sort();
    assert_eq!(
        p,
        ["crate::a::B", "crate::a::c::D", "crate::e", "super::g::h"]
    );
    let krate = Crate {
        files: ["", "error", "x", "x::y", "z"]
            .iter()
            .map(|m| (m.to_string(), PathBuf::new()))
            .collect(),
        reexports: [(("".to_string(), "Result".to_string()), "error".to_string())]
            .into_iter()
            .collect(),
    };
    let seg = |s: &str| s.split("::").map(str::to_owned).collect::<Vec<_>>();
    assert_eq!(
        krate.resolve("z", &seg("crate::Result"), 0).as_deref(),
        Some("error")
    );
    assert_eq!(
        krate.resolve("x::y", &seg("super::Foo"), 0).as_deref(),
        Some("x")
    );
    assert_eq!(
        krate.resolve("z", &seg("crate::x::y::T"), 0).as_deref(),
        Some("x::y")
    );
}
