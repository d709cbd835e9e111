//! Every log line troubleshooting.md quotes is one the code can print: a
//! backticked span the prose calls a line, a log or a WARN/INFO/ERROR is a
//! log message, and each literal piece of it (the text between `<x>`, `...`
//! and `key=value` placeholders) must occur in the source of a crate. A
//! page that tells an operator to grep for a line the code never prints
//! sends them looking for nothing.

use std::path::Path;

use deploy_check::workspace_root;

/// Words near a backticked span that make it a quoted log line.
const CUES: &[&str] = &["line", "lines", "log", "logs", "WARN", "INFO", "ERROR"];

/// Spans that are commands or queries, not log text, even beside a cue.
const NOT_LOG_TEXT: &[&str] = &["bigfleet-proxmox ", "kubectl ", "curl ", "sum ", "rate("];

fn rust_sources(dir: &Path, out: &mut String) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push_str(&std::fs::read_to_string(&p).unwrap_or_default());
        }
    }
}

/// The product code's text: every crate's `src/`.
fn product_source() -> String {
    let mut out = String::new();
    let crates = workspace_root().join("crates");
    for e in std::fs::read_dir(&crates).unwrap().flatten() {
        rust_sources(&e.path().join("src"), &mut out);
    }
    out
}

/// Whether `word` occurs in `text` as a whole word.
fn has_word(text: &str, word: &str) -> bool {
    text.split(|c: char| !c.is_alphanumeric())
        .any(|w| w == word)
}

/// The backticked spans of `paragraph` (joined onto one line) with a cue
/// within a few words before or after.
fn quoted_log_lines(paragraph: &str) -> Vec<String> {
    let flat = paragraph.split_whitespace().collect::<Vec<_>>().join(" ");
    let parts: Vec<&str> = flat.split('`').collect();
    let mut out = Vec::new();
    // Odd parts are inside backticks.
    for i in (1..parts.len()).step_by(2) {
        let before: String = {
            let chars: Vec<char> = parts[i - 1].chars().collect();
            chars[chars.len().saturating_sub(40)..].iter().collect()
        };
        let after: String = parts
            .get(i + 1)
            .copied()
            .unwrap_or_default()
            .chars()
            .take(25)
            .collect();
        let cued = CUES
            .iter()
            .any(|c| has_word(&before, c) || has_word(&after, c));
        let span = parts[i];
        if cued && !NOT_LOG_TEXT.iter().any(|p| span.starts_with(p)) {
            out.push(span.to_string());
        }
    }
    out
}

/// The literal pieces of a quoted line: placeholders (`<x>`, `...`, `…`)
/// and `key=value` fields cut out, pieces of fewer than 4 characters
/// dropped.
fn literal_pieces(span: &str) -> Vec<String> {
    let mut pieces = Vec::new();
    let mut cur = String::new();
    let mut rest = span;
    let flush = |cur: &mut String, pieces: &mut Vec<String>| {
        let t = cur.trim().trim_matches('"').trim().to_string();
        if t.chars().count() >= 4 {
            pieces.push(t);
        }
        cur.clear();
    };
    while let Some(c) = rest.chars().next() {
        if c == '<' {
            if let Some(end) = rest.find('>') {
                flush(&mut cur, &mut pieces);
                rest = &rest[end + 1..];
                continue;
            }
        }
        if rest.starts_with("...") || c == '…' {
            flush(&mut cur, &mut pieces);
            rest = &rest[if c == '…' { c.len_utf8() } else { 3 }..];
            continue;
        }
        if c.is_whitespace() {
            // A `key=value` field is no literal text.
            let word_end = rest[1..]
                .find(char::is_whitespace)
                .map_or(rest.len(), |i| i + 1);
            let word = rest[1..word_end].to_string();
            if word.contains('=') && !word.starts_with('-') {
                flush(&mut cur, &mut pieces);
                rest = &rest[word_end..];
                continue;
            }
        }
        cur.push(c);
        rest = &rest[c.len_utf8()..];
    }
    flush(&mut cur, &mut pieces);
    // A lone `key=value` left whole (no space in it) is a field, not text.
    pieces
        .into_iter()
        .filter(|p| !p.contains('=') || p.contains(' '))
        .collect()
}

#[test]
fn the_pieces_of_a_quoted_line_are_its_literal_text() {
    assert_eq!(
        literal_pieces("Proxmox node node=<x> status=offline"),
        ["Proxmox node"]
    );
    assert_eq!(
        literal_pieces("state loaded ... machines=N fence_marks=M"),
        ["state loaded"]
    );
    assert_eq!(
        literal_pieces("TLS material is required: set --ca ... or --pin"),
        ["TLS material is required: set --ca", "or --pin"]
    );
    assert!(literal_pieces("proxmox_backend=fake").is_empty());
    let para = "the WARN line `reconcile failed` carries it; run \
                `kubectl get pods` (see the log)";
    assert_eq!(quoted_log_lines(para), ["reconcile failed"]);
}

#[test]
fn troubleshooting_quotes_only_lines_the_code_prints() {
    let page = std::fs::read_to_string(workspace_root().join("docs/troubleshooting.md"))
        .expect("docs/troubleshooting.md");
    let source = product_source();
    let mut checked = 0;
    let mut never_printed = Vec::new();
    for paragraph in page.split("\n\n") {
        for line in quoted_log_lines(paragraph) {
            for piece in literal_pieces(&line) {
                checked += 1;
                if !source.contains(&piece) {
                    never_printed.push(format!("`{line}`: {piece:?}"));
                }
            }
        }
    }
    assert!(
        checked >= 10,
        "only {checked} quoted pieces found: is the cue list stale?"
    );
    assert!(
        never_printed.is_empty(),
        "troubleshooting.md quotes log text no crate's source contains:\n{}",
        never_printed.join("\n")
    );
}
