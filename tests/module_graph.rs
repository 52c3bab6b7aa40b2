//! No import cycle among the modules of any of our crates: a module that another imports must
//! not, directly or through others, import it back. Cycles are how shared vocabulary ends up in
//! one concern and node code depends on cluster concerns; this keeps it from coming back.
//!
//! Reads each crate's `src/*.rs` as text: `crate::m` and `super::m` paths (also inside `use
//! crate::{a, b::C}` groups) name the module `m`; comments and the unit tests (`#[cfg(test)] mod
//! tests`, which may use anything) are left out.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

const CRATES: [&str; 8] = [
    "src",
    "controllers/src",
    "webhooks/src",
    "extender/src",
    "driver/src",
    "testenv/src",
    "e2e/src",
    "bench/src",
];

type Graph = BTreeMap<String, BTreeSet<String>>;

/// The source without line comments and without the unit-test module at its end.
fn production_text(source: &str) -> String {
    let source = match source.find("#[cfg(test)]\nmod tests") {
        Some(at) => &source[..at],
        None => source,
    };
    source
        .lines()
        .map(|line| match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The top-level names of a `{...}` use group (its text without the braces).
fn group_names(group: &str) -> Vec<String> {
    let mut names = Vec::new();
    let (mut depth, mut current) = (0usize, String::new());
    for c in group.chars() {
        match c {
            '{' => depth += 1,
            '}' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                names.push(std::mem::take(&mut current));
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    names.push(current);
    names
        .iter()
        .map(|n| n.trim().split("::").next().unwrap_or_default().to_string())
        .collect()
}

/// The modules `text` refers to through `crate::` or `super::`.
fn referenced(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for prefix in ["crate::", "super::"] {
        let mut rest = text;
        while let Some(at) = rest.find(prefix) {
            rest = &rest[at + prefix.len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let mut depth = 1usize;
                let end = group
                    .char_indices()
                    .find(|&(_, c)| {
                        match c {
                            '{' => depth += 1,
                            '}' => depth -= 1,
                            _ => {}
                        }
                        depth == 0
                    })
                    .map_or(group.len(), |(i, _)| i);
                found.extend(group_names(&group[..end]));
            } else {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                found.insert(name);
            }
        }
    }
    found
}

/// Module → the modules of the same crate it refers to.
fn graph(dir: &Path) -> Graph {
    let modules: BTreeSet<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|entry| {
            let path = entry.ok()?.path();
            (path.extension()? == "rs").then(|| path.file_stem()?.to_str().map(str::to_string))?
        })
        .collect();
    modules
        .iter()
        .filter(|m| !matches!(m.as_str(), "lib" | "main"))
        .map(|m| {
            let path = dir.join(format!("{m}.rs"));
            let source = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let uses = referenced(&production_text(&source))
                .into_iter()
                .filter(|r| r != m && modules.contains(r) && !matches!(r.as_str(), "lib" | "main"))
                .collect();
            (m.clone(), uses)
        })
        .collect()
}

/// One cycle of `graph`, as the modules along it, if it has any.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &Graph,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

#[test]
fn no_module_imports_itself_back() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut modules = 0;
    for krate in CRATES {
        let graph = graph(&root.join(krate));
        modules += graph.len();
        if let Some(cycle) = find_cycle(&graph) {
            panic!("{krate}: import cycle {}", cycle.join(" → "));
        }
    }
    assert!(modules > 100, "only {modules} modules read");
}

#[test]
fn the_reader_finds_cycles_and_grouped_imports() {
    let text = "use crate::{a::X, b::{self, Y}};\nuse super::c;\n// crate::commented\n";
    assert_eq!(
        referenced(&production_text(text)),
        ["a", "b", "c"].map(String::from).into()
    );
    let graph: Graph = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec![]),
    ]
    .into_iter()
    .map(|(m, uses)| (m.to_string(), uses.into_iter().map(String::from).collect()))
    .collect();
    assert_eq!(
        find_cycle(&graph),
        Some(["a", "b", "c", "a"].map(String::from).to_vec())
    );
    let mut acyclic = graph.clone();
    acyclic.insert("c".into(), BTreeSet::new());
    assert_eq!(find_cycle(&acyclic), None);
}
