//! Reading deploy/Dockerfile the way the checks need it: instructions with
//! comments dropped and continuations joined, grouped by build stage.

/// The Dockerfile, relative to the workspace root.
pub const DOCKERFILE: &str = "deploy/Dockerfile";

/// Instructions with comments dropped and `\` continuations joined.
pub fn instructions(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with('#') || t.is_empty() {
            continue;
        }
        if let Some(head) = t.strip_suffix('\\') {
            cur.push_str(head);
            cur.push(' ');
        } else {
            cur.push_str(t);
            out.push(std::mem::take(&mut cur));
        }
    }
    out
}

/// Instructions per stage, keyed by the stage's `AS` name (the last one
/// is unnamed: "final").
pub fn stages(ins: &[String]) -> Vec<(String, Vec<String>)> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    for i in ins {
        if let Some(from) = i.strip_prefix("FROM ") {
            let name = from
                .split_once(" AS ")
                .map_or("final", |(_, n)| n.trim())
                .to_owned();
            out.push((name, Vec::new()));
        } else if let Some((_, stage)) = out.last_mut() {
            stage.push(i.clone());
        }
    }
    out
}
