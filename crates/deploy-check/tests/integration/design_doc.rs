//! docs/DESIGN.md against the code: every path it names in backticks
//! (`crate::module::Item`, `module::item`, `Type::method`) resolves to a
//! module file or a definition, and its drawings of the engine's and the
//! real substrate's parts each list every part file, each above the parts
//! it imports. So the page cannot drift from the code silently: a move or
//! a rename fails here until the page says the new truth.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use regex::Regex;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn design() -> String {
    std::fs::read_to_string(workspace().join("docs/DESIGN.md")).expect("docs/DESIGN.md")
}

/// Each crate's `src/` by the names the page may call it: its library
/// name (the package's, `-` as `_`) and its folder's name (`provider`).
fn crate_sources() -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let crates = workspace().join("crates");
    for entry in std::fs::read_dir(&crates).expect("crates/") {
        let dir = entry.expect("entry").path();
        let Ok(manifest) = std::fs::read_to_string(dir.join("Cargo.toml")) else {
            continue;
        };
        let src = dir.join("src");
        let package = manifest
            .lines()
            .find_map(|l| l.strip_prefix("name = \""))
            .and_then(|l| l.strip_suffix('"'))
            .expect("package name");
        out.insert(package.replace('-', "_"), src.clone());
        if let Some(folder) = dir.file_name().and_then(|n| n.to_str()) {
            out.insert(folder.replace('-', "_"), src);
        }
    }
    out
}

/// Whether `file` defines `name` (an item, a re-export, a macro).
fn defines(file: &str, name: &str) -> bool {
    let item = Regex::new(&format!(
        r"\b(fn|struct|enum|trait|type|const|static|mod|union)\s+{name}\b|macro_rules!\s*{name}\b|\bpub(\([^)]*\))?\s+use\s[^;]*\b{name}\b"
    ))
    .expect("regex");
    item.is_match(file)
}

/// Resolves `segments` from the module at `dir` (its file `file`): each
/// segment is a submodule (`dir/seg.rs` or `dir/seg/mod.rs`) or, from the
/// first that is not, a definition in the file reached.
fn resolves_from(dir: &Path, file: &Path, segments: &[&str]) -> bool {
    let Some((first, rest)) = segments.split_first() else {
        return true;
    };
    for sub in [
        dir.join(format!("{first}.rs")),
        dir.join(first).join("mod.rs"),
    ] {
        if sub.is_file() {
            return resolves_from(&dir.join(first), &sub, rest);
        }
    }
    let Ok(text) = std::fs::read_to_string(file) else {
        return false;
    };
    segments.iter().all(|s| defines(&text, s))
}

/// Whether a path the page names resolves in some crate.
fn resolves(path: &str, crates: &BTreeMap<String, PathBuf>) -> bool {
    let segments: Vec<&str> = path.split("::").collect();
    if let Some(src) = crates.get(segments[0]) {
        return ["lib.rs", "main.rs"]
            .iter()
            .any(|root| resolves_from(src, &src.join(root), &segments[1..]));
    }
    // `Type::method`: the type defined somewhere, the method in a file
    // that implements it (its impl blocks may live apart from it).
    if segments[0].starts_with(char::is_uppercase) {
        let files: Vec<String> = crates
            .values()
            .flat_map(|src| rust_files(src))
            .filter_map(|f| std::fs::read_to_string(f).ok())
            .collect();
        let ty = segments[0];
        let implements = Regex::new(&format!(r"\bimpl\b[^{{;]*\b{ty}\b")).expect("regex");
        return files.iter().any(|t| defines(t, ty))
            && files
                .iter()
                .any(|t| implements.is_match(t) && segments[1..].iter().all(|s| defines(t, s)));
    }
    // A path within a crate the sentence speaks of (`engine::accept`).
    crates
        .values()
        .any(|src| resolves_from(src, &src.join("lib.rs"), &segments))
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out
}

/// The code paths the page names: backticked `a::b`, with `a::{b, c}`
/// groups expanded.
fn named_paths(text: &str) -> BTreeSet<String> {
    let path = Regex::new(r"`([A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)*)::(\{[A-Za-z0-9_, ]+\}|[A-Za-z_][A-Za-z0-9_]*)`")
        .expect("regex");
    let mut out = BTreeSet::new();
    for c in path.captures_iter(text) {
        let (head, tail) = (&c[1], &c[2]);
        match tail.strip_prefix('{').and_then(|t| t.strip_suffix('}')) {
            Some(group) => {
                for last in group.split(',').map(str::trim) {
                    out.insert(format!("{head}::{last}"));
                }
            }
            None => {
                out.insert(format!("{head}::{tail}"));
            }
        }
    }
    out
}

#[test]
fn every_code_path_the_design_page_names_resolves() {
    let crates = crate_sources();
    let named = named_paths(&design());
    assert!(named.len() > 20, "the page names {} paths", named.len());
    let missing: Vec<&String> = named.iter().filter(|p| !resolves(p, &crates)).collect();
    assert!(
        missing.is_empty(),
        "docs/DESIGN.md names code that is not there (moved or renamed?): {missing:?}"
    );
}

#[test]
fn a_path_that_is_not_there_is_found_missing() {
    let crates = crate_sources();
    assert!(resolves("provider::terms::lead_terms", &crates));
    assert!(resolves("providerkit::engine::accept", &crates));
    assert!(!resolves("provider::serve::lead_terms", &crates));
    assert!(!resolves("providerkit::engine::nowhere", &crates));
    assert!(!resolves("proxmox_backend::proxmox::room", &crates));
    assert!(resolves("MachineRecord::begin", &crates));
    assert!(!resolves("MachineRecord::finish_everything", &crates));
}

/// One line of the parts drawing: the part, its files, the line's place.
struct PartLine {
    part: String,
    files: Vec<String>,
}

/// The drawing under the heading `section`.
fn parts_drawing(text: &str, section: &str) -> Vec<PartLine> {
    let section = text
        .split(&format!("## {section}"))
        .nth(1)
        .expect("the parts section");
    let block = section.split("```").nth(1).expect("the parts drawing");
    let file = Regex::new(r"[a-z_/]+\.rs").expect("regex");
    block
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let part = l.split_whitespace().next().unwrap_or_default().to_string();
            let inside = l.split_once('(').map_or("", |(_, rest)| rest);
            let inside = inside.split_once(')').map_or(inside, |(i, _)| i);
            PartLine {
                part,
                files: file
                    .find_iter(inside)
                    .map(|m| m.as_str().to_string())
                    .collect(),
            }
        })
        .collect()
}

#[test]
fn the_substrate_drawing_lists_every_part_above_the_parts_it_imports() {
    let wrong =
        drawing_against_imports("The real substrate's parts", "proxmox-backend/src/proxmox");
    assert!(
        wrong.is_empty(),
        "docs/DESIGN.md's drawing of the substrate's parts: {wrong:#?}"
    );
}

#[test]
fn the_engine_drawing_lists_every_part_above_the_parts_it_imports() {
    let wrong = drawing_against_imports("The engine's parts", "providerkit/src/engine");
    assert!(
        wrong.is_empty(),
        "docs/DESIGN.md's drawing of the engine's parts: {wrong:#?}"
    );
}

/// What the drawing under `section` gets wrong about the files under
/// `crates/<dir>`: a file it does not list, or an import of a part it
/// lists above the importer (or not at all).
fn drawing_against_imports(section: &str, dir: &str) -> Vec<String> {
    let dir = workspace().join("crates").join(dir);
    let lines = parts_drawing(&design(), section);
    // Module name (a file's stem, `preflight/sdn.rs` as `preflight`) ->
    // the drawing's line.
    let mut line_of: BTreeMap<String, usize> = BTreeMap::new();
    for (i, line) in lines.iter().enumerate() {
        for f in &line.files {
            let module = f.split(['/', '.']).next().unwrap_or_default();
            line_of.entry(module.to_string()).or_insert(i);
        }
    }
    let on_disk: Vec<PathBuf> = rust_files(&dir);
    let import = Regex::new(r"super::(?:super::)?([a-z_]+)").expect("regex");
    let mut wrong = Vec::new();
    for path in &on_disk {
        let rel = path
            .strip_prefix(&dir)
            .expect("under the parts' folder")
            .to_string_lossy()
            .to_string();
        let module = rel.split(['/', '.']).next().unwrap_or_default().to_string();
        let Some(&here) = line_of.get(&module) else {
            wrong.push(format!("{rel} is not in the drawing"));
            continue;
        };
        let text = std::fs::read_to_string(path).expect("part file");
        // The test module may reach anywhere.
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        for c in import.captures_iter(code) {
            let used = &c[1];
            if used == module {
                continue;
            }
            match line_of.get(used) {
                Some(&there) if there > here => {}
                Some(_) => wrong.push(format!(
                    "{} ({rel}) imports {used}, which the drawing lists above it",
                    lines[here].part
                )),
                None => wrong.push(format!("{rel} imports {used}, not in the drawing")),
            }
        }
    }
    wrong
}
