//! Finds the provider flags that docs/*.md and deploy/ mention, so a test
//! can hold them against the flags the binary really accepts.
//!
//! Text names flags of other tools too (`kubectl drain --ignore-daemonsets`,
//! `pveum ... --privsep 0`). A command is attributed to the provider when its
//! program is `bigfleet-proxmox` (or `bin/proxmox`, or an image reference
//! `.../bigfleet-proxmox:<tag>`); flags before that token belong to the
//! wrapping tool. A command that starts with one of [`OTHER_TOOLS`] and never
//! reaches the provider is skipped; any other text is checked in full.

use std::collections::{BTreeMap, BTreeSet};

/// Programs whose flags the docs may show.
pub const OTHER_TOOLS: &[&str] = &[
    "apt-get",
    "bfconformance",
    "cargo",
    "curl",
    "docker",
    "helm",
    "hadolint",
    "kubectl",
    "kubernetes-validate",
    "make",
    "openssl",
    "pip",
    "podman",
    "pvenode",
    "pveum",
    "pve-sim",
    "python3",
    "qm",
    "scp",
    "setup-token.sh",
    "shellcheck",
];

/// Where a flag was found.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Mention {
    pub flag: String,
    /// `true` when it follows `bigfleet-proxmox ctl`.
    pub ctl: bool,
    /// `ctl` subcommand, when known.
    pub ctl_sub: Option<String>,
    /// The `state` subcommand (`copy`) when it follows `bigfleet-proxmox
    /// state`: the flag is that subcommand's, not the server's.
    pub state_sub: Option<String>,
    /// `true` when the text names the provider as the program explicitly.
    pub explicit: bool,
    pub file: String,
    pub line: usize,
}

/// Every `--flag` token in `text`: a `--` not preceded by a word character or
/// `-`, then a lowercase name.
pub fn scan(text: &str) -> Vec<String> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i + 2 < b.len() {
        let boundary =
            i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'-' || b[i - 1] == b'_');
        if boundary && b[i] == b'-' && b[i + 1] == b'-' && b[i + 2].is_ascii_lowercase() {
            let mut j = i + 2;
            while j < b.len()
                && (b[j].is_ascii_lowercase() || b[j].is_ascii_digit() || b[j] == b'-')
            {
                j += 1;
            }
            let name = text[i..j].trim_end_matches('-');
            out.push(name.to_owned());
            i = j;
        } else {
            i += 1;
        }
    }
    out
}

fn strip_quotes(t: &str) -> &str {
    t.trim_matches(|c| c == '"' || c == '\'' || c == '`' || c == '(' || c == ')')
}

/// Whether `token` names the provider binary: `bigfleet-proxmox`, a path
/// ending in `bin/bigfleet-proxmox` or `bin/proxmox`, or an image reference
/// `.../bigfleet-proxmox:<tag>`.
pub fn is_provider_program(token: &str) -> bool {
    let t = strip_quotes(token);
    let base = t.rsplit('/').next().unwrap_or(t);
    t == "bigfleet-proxmox"
        || t.ends_with("bin/bigfleet-proxmox")
        || t.ends_with("bin/proxmox")
        || {
            // An image reference with a tag: <registry>/bigfleet-proxmox:<tag>
            base.split_once(':')
                .is_some_and(|(name, tag)| name == "bigfleet-proxmox" && !tag.is_empty())
        }
}

fn program_of(tokens: &[&str]) -> Option<String> {
    tokens
        .iter()
        .map(|t| strip_quotes(t))
        .find(|t| !t.is_empty() && *t != "$" && *t != "sudo" && !t.contains('='))
        .map(|t| t.rsplit('/').next().unwrap_or(t).to_owned())
}

/// Attributes the flags of one shell-ish command line.
pub fn command_mentions(cmd: &str, file: &str, line: usize) -> Vec<Mention> {
    let mut out = Vec::new();
    for part in cmd.split(['|', ';']).flat_map(|p| p.split("&&")) {
        let tokens: Vec<&str> = part.split_whitespace().collect();
        let start = tokens.iter().position(|t| is_provider_program(t));
        let mention = |flag: String,
                       ctl: bool,
                       ctl_sub: Option<String>,
                       state_sub: Option<String>,
                       explicit: bool| Mention {
            flag,
            ctl,
            ctl_sub,
            state_sub,
            explicit,
            file: file.to_owned(),
            line,
        };
        match start {
            Some(i) => {
                let rest = &tokens[i + 1..];
                let ctl = rest.first().map(|t| strip_quotes(t)) == Some("ctl");
                let state = rest.first().map(|t| strip_quotes(t)) == Some("state");
                let second = rest
                    .get(1)
                    .map(|s| strip_quotes(s).to_owned())
                    .filter(|s| !s.starts_with('-'));
                let sub = if ctl { second.clone() } else { None };
                let state_sub = if state { second } else { None };
                for t in rest {
                    for f in scan(t) {
                        out.push(mention(f, ctl, sub.clone(), state_sub.clone(), true));
                    }
                }
            }
            None => {
                let other = program_of(&tokens).is_some_and(|p| OTHER_TOOLS.contains(&p.as_str()));
                if !other {
                    for f in scan(part) {
                        out.push(mention(f, false, None, None, false));
                    }
                }
            }
        }
    }
    out
}

/// Joins shell `\` continuations: (first line's number, the joined line).
pub fn logical_lines(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut start = 0;
    for (n, line) in text.lines().enumerate() {
        if cur.is_empty() {
            start = n + 1;
        }
        if let Some(head) = line.trim_end().strip_suffix('\\') {
            cur.push_str(head);
            cur.push(' ');
        } else {
            cur.push_str(line);
            out.push((start, std::mem::take(&mut cur)));
        }
    }
    if !cur.is_empty() {
        out.push((start, cur));
    }
    out
}

/// Flags in a Markdown file: fenced blocks line by line (continuations
/// joined), inline code spans one by one, and the remaining prose in full.
pub fn markdown_mentions(text: &str, file: &str) -> Vec<Mention> {
    let mut out = Vec::new();
    let mut in_fence = false;
    let mut fence = String::new();
    for (n, line) in text.lines().enumerate() {
        let t = line.trim_start();
        if t.starts_with("```") {
            if in_fence {
                for (ln, l) in logical_lines(&fence) {
                    out.extend(command_mentions(&l, file, n - fence.lines().count() + ln));
                }
                fence.clear();
            }
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            fence.push_str(line);
            fence.push('\n');
            continue;
        }
        let mut prose = String::new();
        for (i, piece) in line.split('`').enumerate() {
            if i % 2 == 1 {
                out.extend(command_mentions(piece, file, n + 1));
            } else {
                prose.push_str(piece);
                prose.push(' ');
            }
        }
        out.extend(scan(&prose).into_iter().map(|flag| Mention {
            flag,
            ctl: false,
            ctl_sub: None,
            state_sub: None,
            explicit: false,
            file: file.to_owned(),
            line: n + 1,
        }));
    }
    out
}

/// Flags in a non-Markdown file, line by line (comment markers stripped).
pub fn plain_mentions(text: &str, file: &str) -> Vec<Mention> {
    logical_lines(text)
        .into_iter()
        .flat_map(|(n, l)| {
            let l = l.trim_start().trim_start_matches('#').to_owned();
            command_mentions(&l, file, n)
        })
        .collect()
}

/// Option names listed in `--help` output: the `--name` tokens that open an
/// option line (`  -h, --help`, `      --addr <ADDR>`). Defaults quoted in
/// the descriptions are not options and are left out.
pub fn help_flags(help: &str) -> BTreeSet<String> {
    help.lines()
        .filter_map(|l| {
            let t = l.trim_start();
            let t = match t.strip_prefix('-') {
                Some(rest) if !rest.starts_with('-') => rest.split_once(", ").map(|(_, r)| r)?,
                _ => t,
            };
            if t.starts_with("--") {
                scan(t.split_whitespace().next()?).into_iter().next()
            } else {
                None
            }
        })
        .collect()
}

/// Each option of `--help` output with its `[default: ...]`, unquoted as
/// clap quotes it (`"..."` with `\"` escapes when the value has spaces);
/// `None` for an option without one.
pub fn help_defaults(help: &str) -> BTreeMap<String, Option<String>> {
    let mut out = BTreeMap::new();
    let mut current: Option<(String, String)> = None;
    let finish = |entry: Option<(String, String)>, out: &mut BTreeMap<_, _>| {
        if let Some((flag, text)) = entry {
            out.insert(flag, clap_default(&text));
        }
    };
    for line in help.lines() {
        let opens = help_flags(line).into_iter().next();
        match opens {
            Some(flag) => {
                finish(current.take(), &mut out);
                current = Some((flag, line.to_owned()));
            }
            None => {
                if let Some((_, text)) = current.as_mut() {
                    text.push(' ');
                    text.push_str(line.trim());
                }
            }
        }
    }
    finish(current.take(), &mut out);
    out
}

/// The value of clap's `[default: VALUE]` in an option's help text.
fn clap_default(text: &str) -> Option<String> {
    let rest = &text[text.find("[default: ")? + "[default: ".len()..];
    let Some(quoted) = rest.strip_prefix('"') else {
        return rest.split_once(']').map(|(v, _)| v.to_owned());
    };
    let mut value = String::new();
    let mut chars = quoted.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => return Some(value),
            '\\' => value.push(chars.next()?),
            c => value.push(c),
        }
    }
    None
}

/// Where the docs state a flag's default: a row of a `| flag | default |`
/// table whose default cell is one code span (`| `--flag` | `VALUE` | ...`)
/// or `—` (no default),
/// or prose that names a flag and, later in the same sentence, its
/// "default `VALUE`". Prose defaults in words (`built-in`, "2 minutes") are
/// not read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DocumentedDefault {
    pub flag: String,
    /// The `ctl` subcommand whose flag it is, when the sentence names one.
    pub ctl_sub: Option<String>,
    /// `None` for `—`: documented as having no default.
    pub value: Option<String>,
    pub file: String,
    pub line: usize,
}

/// The defaults a markdown page states (see [`DocumentedDefault`]).
pub fn documented_defaults(markdown: &str, file: &str) -> Vec<DocumentedDefault> {
    let mut out = Vec::new();
    let mut in_fence = false;
    // Prose is read by sentence, across the line breaks of a paragraph.
    let mut paragraph: Vec<(usize, &str)> = Vec::new();
    let flush = |paragraph: &mut Vec<(usize, &str)>, out: &mut Vec<DocumentedDefault>| {
        out.extend(prose_defaults(paragraph, file));
        paragraph.clear();
    };
    // Whether the table being read is a `| flag | default | ...` table; its
    // header row decides, other tables (a script's options) are not read.
    let mut flag_table: Option<bool> = None;
    for (n, line) in markdown.lines().enumerate() {
        let line_no = n + 1;
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            flush(&mut paragraph, &mut out);
            continue;
        }
        if in_fence {
            continue;
        }
        if !line.starts_with('|') {
            flag_table = None;
        }
        if line.starts_with('|') {
            flush(&mut paragraph, &mut out);
            match flag_table {
                None => {
                    let header: Vec<&str> = line
                        .trim()
                        .trim_matches('|')
                        .split('|')
                        .map(str::trim)
                        .collect();
                    flag_table = Some(header.starts_with(&["flag", "default"]));
                }
                Some(true) => out.extend(table_defaults(line, file, line_no)),
                Some(false) => {}
            }
        } else if line.trim().is_empty() || line.starts_with('#') {
            flush(&mut paragraph, &mut out);
        } else {
            paragraph.push((line_no, line));
        }
    }
    flush(&mut paragraph, &mut out);
    out
}

/// `| `--a`, `--b` | `VALUE` or — | ...`: one default per flag of the row.
/// The cells of a table row; `\|` is a `|` inside a cell (GitHub's escape,
/// as in a default that is a shell `||`).
fn table_cells(row: &str) -> Vec<String> {
    let inner = row.trim().trim_start_matches('|');
    let inner = inner.strip_suffix('|').unwrap_or(inner);
    let mut cells = vec![String::new()];
    let mut chars = inner.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                chars.next();
                cells.last_mut().expect("one cell").push('|');
            }
            '|' => cells.push(String::new()),
            c => cells.last_mut().expect("one cell").push(c),
        }
    }
    cells.into_iter().map(|c| c.trim().to_string()).collect()
}

fn table_defaults(row: &str, file: &str, line: usize) -> Vec<DocumentedDefault> {
    let cells = table_cells(row);
    let cells: Vec<&str> = cells.iter().map(String::as_str).collect();
    let [flags, default, ..] = cells[..] else {
        return Vec::new();
    };
    if !flags.starts_with("`--") {
        return Vec::new();
    }
    let value = if default == "—" {
        None
    } else if let Some(code) = single_code_span(default) {
        Some(code.to_owned())
    } else {
        return Vec::new();
    };
    scan(flags)
        .into_iter()
        .map(|flag| DocumentedDefault {
            flag,
            ctl_sub: None,
            value: value.clone(),
            file: file.to_owned(),
            line,
        })
        .collect()
}

/// `text` when it is exactly one code span: `` `x` ``.
fn single_code_span(text: &str) -> Option<&str> {
    let inner = text.strip_prefix('`')?.strip_suffix('`')?;
    (!inner.contains('`')).then_some(inner)
}

/// The defaults stated in a paragraph's sentences; `lines` are its lines
/// with their numbers.
fn prose_defaults(lines: &[(usize, &str)], file: &str) -> Vec<DocumentedDefault> {
    // The paragraph as one line, with where each source line starts in it.
    let mut paragraph = String::new();
    let mut starts = Vec::new();
    for (number, line) in lines {
        if !paragraph.is_empty() {
            paragraph.push(' ');
        }
        starts.push((paragraph.len(), *number));
        paragraph.push_str(line.trim());
    }
    let line_at = |offset: usize| {
        starts
            .iter()
            .take_while(|(start, _)| *start <= offset)
            .last()
            .map_or(0, |(_, number)| *number)
    };
    let mut out = Vec::new();
    let mut sentence_start = 0;
    for sentence in paragraph.split(". ") {
        let offset = sentence_start;
        sentence_start += sentence.len() + 2;
        for (at, _) in sentence.match_indices("default `") {
            let line = line_at(offset + at);
            let Some(value) = sentence[at + "default `".len()..].split('`').next() else {
                continue;
            };
            let before = &sentence[..at];
            let Some(flag) = scan(before).pop() else {
                continue;
            };
            // `ctl <sub>` named before the flag makes it that subcommand's.
            let ctl_sub = before.rfind("ctl ").and_then(|i| {
                before[i + 4..]
                    .split_whitespace()
                    .next()
                    .filter(|w| w.chars().all(|c| c.is_ascii_lowercase()))
                    .map(str::to_owned)
            });
            out.push(DocumentedDefault {
                flag,
                ctl_sub,
                value: Some(value.to_owned()),
                file: file.to_owned(),
                line,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaped_pipes_stay_in_their_cell() {
        let row = "| `--x` | `a \\|\\| b` | meaning |";
        let d = table_defaults(row, "f.md", 1);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].value.as_deref(), Some("a || b"));
    }

    #[test]
    fn help_defaults_unquote_as_clap_quotes() {
        let help = "Options:\n      --addr <ADDR>\n          listen [default: :9000]\n      \
                    --drain-command <DRAIN_COMMAND>\n          drain\n          [default: \"kubectl \
                    drain \\\"$(hostname)\\\" [x]\"]\n      --nodes <NODES>\n          zones\n  -h, --help\n";
        let d = help_defaults(help);
        assert_eq!(d["--addr"].as_deref(), Some(":9000"));
        assert_eq!(
            d["--drain-command"].as_deref(),
            Some("kubectl drain \"$(hostname)\" [x]")
        );
        assert_eq!(d["--nodes"], None);
        assert_eq!(d["--help"], None);
    }

    #[test]
    fn documented_defaults_come_from_tables_and_sentences() {
        let md = "| flag | default | meaning |\n|---|---|---|\n| `--addr` | `:9000` | x |\n\
                  | `--tls-cert`, `--tls-key` | — | y |\n| `--offerings` | built-in | z |\n\n\
                  Serve on `--metrics-addr` (default\n`:9090`). With `bigfleet-proxmox ctl reclaim ID \
                  --wait-timeout 30m` it waits (default `10m`). The state (default `x`) stays.\n\n\
                  ```sh\nrun --addr :1 # default `no`\n```\n";
        let got: Vec<(String, Option<String>, Option<String>, usize)> =
            documented_defaults(md, "f")
                .into_iter()
                .map(|d| (d.flag, d.ctl_sub, d.value, d.line))
                .collect();
        let some = |s: &str| Some(s.to_owned());
        assert_eq!(
            got,
            [
                ("--addr".to_owned(), None, some(":9000"), 3),
                ("--tls-cert".to_owned(), None, None, 4),
                ("--tls-key".to_owned(), None, None, 4),
                ("--metrics-addr".to_owned(), None, some(":9090"), 7),
                ("--wait-timeout".to_owned(), some("reclaim"), some("10m"), 8),
            ]
        );
    }

    #[test]
    fn scan_finds_flags_only() {
        assert_eq!(
            scan("run --addr=:9000 `--tls-ca` x--y --- a - -b --Caps --nodes,"),
            ["--addr", "--tls-ca", "--nodes"]
        );
    }

    #[test]
    fn commands_are_attributed() {
        let m = command_mentions(
            "docker run --read-only -v x:/y reg/bigfleet-proxmox:0.1.0 --state /s --nodes a",
            "f",
            1,
        );
        let flags: Vec<_> = m.iter().map(|m| m.flag.as_str()).collect();
        assert_eq!(flags, ["--state", "--nodes"]);
        assert!(m.iter().all(|m| m.explicit));
        assert!(command_mentions("kubectl drain x --ignore-daemonsets", "f", 1).is_empty());
        assert!(command_mentions(
            "helm install a deploy/helm/bigfleet-proxmox --set x",
            "f",
            1
        )
        .is_empty());
        let m = command_mentions("bigfleet-proxmox ctl get id --target a:1", "f", 1);
        assert!(m[0].ctl && m[0].ctl_sub.as_deref() == Some("get"));
        assert!(m[0].state_sub.is_none());
        let m = command_mentions("bigfleet-proxmox state copy --from a --to b", "f", 1);
        assert!(m
            .iter()
            .all(|m| !m.ctl && m.state_sub.as_deref() == Some("copy") && m.explicit));
        let m = command_mentions("--reflection false", "f", 1);
        assert_eq!(m[0].flag, "--reflection");
        assert!(!m[0].explicit);
    }

    #[test]
    fn markdown_spans_fences_and_prose() {
        let md = "Use `--state` or --nodes; `qm set 1 --agent enabled=1`.\n\n```sh\n./bin/proxmox \\\n  --addr :1 \\\n  --tls-ca x\npveum acl modify / --roles R\n```\n";
        let flags: Vec<_> = markdown_mentions(md, "f")
            .into_iter()
            .map(|m| (m.flag, m.line))
            .collect();
        assert_eq!(
            flags,
            [
                ("--state".to_owned(), 1),
                ("--nodes".to_owned(), 1),
                ("--addr".to_owned(), 4),
                ("--tls-ca".to_owned(), 4)
            ]
        );
    }

    #[test]
    fn help_parsing_ignores_defaults() {
        let help = "Usage: x [OPTIONS]\n\nOptions:\n      --addr <ADDR>\n          listen [default: :9000]\n      --drain-command <DRAIN_COMMAND>\n          [default: \"kubectl drain --ignore-daemonsets\"]\n  -h, --help\n          Print help\n  -V, --version\n";
        let f: Vec<_> = help_flags(help).into_iter().collect();
        assert_eq!(f, ["--addr", "--drain-command", "--help", "--version"]);
    }
}
