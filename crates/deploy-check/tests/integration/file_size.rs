//! No product source file over 800 non-blank lines (its unit tests, from
//! `#[cfg(test)]` on, not counted): a file that grows past it holds more
//! than one part and is split by what each part owns.

use std::path::{Path, PathBuf};

use deploy_check::workspace_root;

const MAX_LINES: usize = 800;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Non-blank lines before the first `#[cfg(test)]`.
fn product_lines(text: &str) -> usize {
    let body = text.find("#[cfg(test)]").map_or(text, |i| &text[..i]);
    body.lines().filter(|l| !l.trim().is_empty()).count()
}

#[test]
fn no_product_file_is_over_800_non_blank_lines() {
    let root = workspace_root();
    let mut files = Vec::new();
    for base in ["crates", "proto"] {
        let Ok(crates) = std::fs::read_dir(root.join(base)) else {
            continue;
        };
        for c in crates.flatten() {
            rust_files(&c.path().join("src"), &mut files);
        }
        rust_files(&root.join(base).join("src"), &mut files);
    }
    assert!(files.len() > 100, "found only {} source files", files.len());
    let mut over: Vec<String> = files
        .iter()
        .filter_map(|p| {
            let n = product_lines(&std::fs::read_to_string(p).ok()?);
            (n > MAX_LINES)
                .then(|| format!("{} ({n})", p.strip_prefix(&root).unwrap_or(p).display()))
        })
        .collect();
    over.sort();
    assert!(
        over.is_empty(),
        "over {MAX_LINES} non-blank lines: {over:?}"
    );
}

#[test]
fn the_count_leaves_out_blank_lines_and_unit_tests() {
    let text = "fn a() {}\n\n\nfn b() {}\n#[cfg(test)]\nmod tests {\n fn t() {}\n}\n";
    assert_eq!(product_lines(text), 2);
}
