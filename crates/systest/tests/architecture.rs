//! The architecture page is true: `docs/architecture.md`'s crate table
//! against `cargo metadata` (every crate listed, its dependencies exactly
//! those its row names, none in a higher layer), and no import circles
//! between the modules of any crate.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The layers, lowest first (the `layer` column's words).
const LAYERS: &[&str] = &[
    "foundation",
    "shared",
    "capabilities",
    "processes",
    "lab",
    "binary",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Crate (without the `pagefleet-` prefix) → (its directory, its normal
/// dependencies inside the workspace).
fn metadata() -> BTreeMap<String, (PathBuf, BTreeSet<String>)> {
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(root())
        .output()
        .expect("run cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let m: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata JSON");
    let pkgs = m["packages"].as_array().expect("packages");
    let names: BTreeSet<&str> = pkgs.iter().filter_map(|p| p["name"].as_str()).collect();
    let short = |n: &str| n.trim_start_matches("pagefleet-").to_string();
    pkgs.iter()
        .map(|p| {
            let deps = p["dependencies"]
                .as_array()
                .expect("dependencies")
                .iter()
                .filter(|d| d["kind"].is_null())
                .filter_map(|d| d["name"].as_str())
                .filter(|n| names.contains(n))
                .map(short)
                .collect();
            let dir = PathBuf::from(p["manifest_path"].as_str().expect("manifest_path"))
                .parent()
                .expect("crate dir")
                .to_path_buf();
            (short(p["name"].as_str().expect("name")), (dir, deps))
        })
        .collect()
}

/// The crate table: crate → (layer, dependencies listed).
fn table() -> BTreeMap<String, (String, BTreeSet<String>)> {
    let page = std::fs::read_to_string(root().join("docs/architecture.md")).expect("read page");
    let start = page
        .find("| crate | layer | owns | depends on |")
        .expect("the crate table (| crate | layer | owns | depends on |)");
    page[start..]
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split(" | ").map(str::trim).collect();
            assert_eq!(cells.len(), 4, "a row of four cells: {l}");
            let name = cells[0].trim_matches('`').to_string();
            let deps = cells[3]
                .split(',')
                .map(str::trim)
                .filter(|d| !d.is_empty() && *d != "—")
                .map(String::from)
                .collect();
            (name, (cells[1].to_string(), deps))
        })
        .collect()
}

#[test]
fn the_crate_table_is_the_dependency_graph() {
    let meta = metadata();
    let table = table();
    let mut wrong = Vec::new();
    for (name, (_, deps)) in &meta {
        let Some((layer, listed)) = table.get(name) else {
            wrong.push(format!("{name}: not in the table"));
            continue;
        };
        let Some(rank) = LAYERS.iter().position(|l| l == layer) else {
            wrong.push(format!("{name}: unknown layer {layer:?}"));
            continue;
        };
        for d in deps.difference(listed) {
            wrong.push(format!(
                "{name} depends on {d}, which its row does not list"
            ));
        }
        for d in listed.difference(deps) {
            wrong.push(format!(
                "{name}'s row lists {d}, which it does not depend on"
            ));
        }
        for d in deps {
            let dl = table.get(d).map(|(l, _)| l.as_str()).unwrap_or("?");
            if LAYERS
                .iter()
                .position(|l| *l == dl)
                .is_none_or(|r| r > rank)
            {
                wrong.push(format!(
                    "{name} ({layer}) depends on {d} ({dl}), a higher layer"
                ));
            }
        }
    }
    for name in table.keys().filter(|n| !meta.contains_key(*n)) {
        wrong.push(format!("{name}: in the table, not in the workspace"));
    }
    assert!(
        wrong.is_empty(),
        "docs/architecture.md is wrong:\n{}",
        wrong.join("\n")
    );
}

/// A crate's modules: module path ("" for the root, "pager::faults") →
/// the file's code with comments and string literals blanked.
fn modules(src: &Path) -> BTreeMap<String, String> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                if p.file_name().is_some_and(|n| n != "bin") {
                    walk(&p, out);
                }
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(src, &mut files);
    let mut out = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(src).unwrap().with_extension("");
        let mut parts: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if matches!(
            parts.last().map(String::as_str),
            Some("mod" | "lib" | "main")
        ) {
            parts.pop();
        }
        let code = strip(&std::fs::read_to_string(&f).unwrap());
        out.insert(parts.join("::"), code);
    }
    out
}

/// Code without comments, string and char literals (they name paths that
/// are not imports).
fn strip(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            i += 2;
            while i < b.len() && !b[i..].starts_with(b"*/") {
                i += 1;
            }
            i += 2;
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if b[i..].starts_with(b"r#\"") {
            i += 3;
            while i < b.len() && !b[i..].starts_with(b"\"#") {
                i += 1;
            }
            i += 2;
            out.push_str("\"\"");
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    out
}

/// Module `m` refers to these other modules of its crate: by `crate::`
/// paths, `super::` paths and the bare names of its siblings and
/// children. A module using its ancestors (`use super::*`) is
/// containment, not an import, and is not counted.
fn imports(m: &str, code: &str, all: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    let parent = m.rsplit_once("::").map_or("", |(p, _)| p);
    let join = |a: &str, b: &str| {
        if a.is_empty() {
            b.to_string()
        } else {
            format!("{a}::{b}")
        }
    };
    // The longest module that is a prefix of `path`.
    let module_of = |path: &str| -> Option<String> {
        let segs: Vec<&str> = path.split("::").collect();
        (1..=segs.len())
            .rev()
            .map(|n| segs[..n].join("::"))
            .find(|p| all.contains_key(p))
    };
    let mut out = BTreeMap::new();
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let toks: Vec<&str> = code
        .split(|c: char| !(ident(c) || c == ':'))
        .filter(|t| t.contains("::"))
        .collect();
    for t in toks {
        let t = t.trim_matches(':');
        let target = if let Some(rest) = t.strip_prefix("crate::") {
            module_of(rest)
        } else if t.starts_with("super::") {
            let mut base = m.to_string();
            let mut rest = t;
            while let Some(r) = rest.strip_prefix("super::") {
                base = base
                    .rsplit_once("::")
                    .map_or(String::new(), |(p, _)| p.to_string());
                rest = r;
            }
            module_of(&join(&base, rest))
        } else {
            let first = t.split("::").next().unwrap_or("");
            let child = join(m, first);
            let sibling = join(parent, first);
            if all.contains_key(&child) {
                module_of(&join(m, t))
            } else if !m.is_empty() && all.contains_key(&sibling) {
                module_of(&join(parent, t))
            } else {
                None
            }
        };
        if let Some(x) = target {
            let ancestor = x.is_empty() || m == x || m.starts_with(&format!("{x}::"));
            let descendant = x.starts_with(&format!("{m}::")) || m.is_empty();
            if !ancestor && !descendant {
                out.entry(x).or_insert_with(|| t.to_string());
            }
        }
    }
    out
}

/// Strongly connected sets of more than one module.
fn circles(graph: &BTreeMap<String, BTreeMap<String, String>>) -> Vec<Vec<String>> {
    let reach = |from: &str| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(n) = todo.pop() {
            for x in graph.get(&n).into_iter().flat_map(|m| m.keys()) {
                if seen.insert(x.clone()) {
                    todo.push(x.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&String, BTreeSet<String>> =
        graph.keys().map(|k| (k, reach(k))).collect();
    let mut done = BTreeSet::new();
    let mut out = Vec::new();
    for k in graph.keys() {
        if done.contains(k) {
            continue;
        }
        let set: Vec<String> = reaches[k]
            .iter()
            .filter(|x| *x != k && reaches.get(*x).is_some_and(|r| r.contains(k)))
            .cloned()
            .collect();
        if !set.is_empty() {
            let mut c = set;
            c.push(k.clone());
            c.sort();
            done.extend(c.iter().cloned());
            out.push(c);
        }
    }
    out
}

#[test]
fn no_module_imports_one_that_imports_it() {
    let mut found = Vec::new();
    for (name, (dir, _)) in metadata() {
        let all = modules(&dir.join("src"));
        let graph: BTreeMap<String, BTreeMap<String, String>> = all
            .iter()
            .map(|(m, code)| (m.clone(), imports(m, code, &all)))
            .collect();
        for c in circles(&graph) {
            // Each import inside the circle, with one path that makes it.
            let edges: Vec<String> = c
                .iter()
                .flat_map(|a| {
                    graph[a]
                        .iter()
                        .filter(|(b, _)| c.contains(b))
                        .map(move |(b, via)| format!("{a} -> {b} ({via})"))
                })
                .collect();
            found.push(format!("{name}: {}", edges.join(", ")));
        }
    }
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

/// Crates that are a kernel interface through and through, so the whole
/// crate is their system module: `uffd` (userfaultfd, its guest mappings,
/// epoll, SCM_RIGHTS hand-over: every type a safe wrapper over them, with
/// `copy` and friends `unsafe fn`s) and `vmshim` (a preloaded library that
/// interposes QEMU's mmap).
const SYSTEM_CRATES: [&str; 2] = ["uffd", "vmshim"];

/// Every raw `libc` call sits in its crate's system module (`src/sys.rs` or
/// `src/sys/`), behind a safe function with a `SAFETY:` comment; the rest
/// of the code, tests included, calls those.
#[test]
fn raw_system_calls_live_in_each_crates_sys_module() {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut found = Vec::new();
    for (name, (dir, _)) in metadata() {
        if SYSTEM_CRATES.contains(&name.as_str()) {
            continue;
        }
        let mut files = Vec::new();
        for sub in ["src", "tests", "benches", "examples"] {
            walk(&dir.join(sub), &mut files);
        }
        for f in files {
            let rel = f.strip_prefix(&dir).unwrap();
            let in_sys = rel
                .components()
                .any(|c| c.as_os_str() == "sys" || c.as_os_str() == "sys.rs");
            if in_sys {
                continue;
            }
            let code = strip(&std::fs::read_to_string(&f).unwrap());
            for (n, line) in code.lines().enumerate() {
                let mut rest = line;
                while let Some(i) = rest.find("libc::") {
                    rest = &rest[i + 6..];
                    let id: String = rest
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    if rest[id.len()..].starts_with('(') {
                        found.push(format!("{name}: {}:{}: libc::{id}", rel.display(), n + 1));
                    }
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "{} raw libc calls outside a sys module:\n{}",
        found.len(),
        found.join("\n")
    );
}
