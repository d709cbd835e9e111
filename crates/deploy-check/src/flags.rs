//! Finds the provider flags that docs/*.md and deploy/ mention, so a test
//! can hold them against the flags the binary really accepts.
//!
//! Text names flags of other tools too (`kubectl drain --ignore-daemonsets`,
//! `pveum ... --privsep 0`). A command is attributed to the provider when its
//! program is `bigfleet-proxmox` (or `bin/proxmox`, or an image reference
//! `.../bigfleet-proxmox:<tag>`); flags before that token belong to the
//! wrapping tool. A command that starts with one of [`OTHER_TOOLS`] and never
//! reaches the provider is skipped; any other text is checked in full.

use std::collections::BTreeSet;

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
    "make",
    "openssl",
    "pip",
    "podman",
    "pvenode",
    "pveum",
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

fn is_provider_program(token: &str) -> bool {
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
        let mention = |flag: String, ctl: bool, ctl_sub: Option<String>, explicit: bool| Mention {
            flag,
            ctl,
            ctl_sub,
            explicit,
            file: file.to_owned(),
            line,
        };
        match start {
            Some(i) => {
                let rest = &tokens[i + 1..];
                let ctl = rest.first().map(|t| strip_quotes(t)) == Some("ctl");
                let sub = if ctl {
                    rest.get(1)
                        .map(|s| strip_quotes(s).to_owned())
                        .filter(|s| !s.starts_with('-'))
                } else {
                    None
                };
                for t in rest {
                    for f in scan(t) {
                        out.push(mention(f, ctl, sub.clone(), true));
                    }
                }
            }
            None => {
                let other = program_of(&tokens).is_some_and(|p| OTHER_TOOLS.contains(&p.as_str()));
                if !other {
                    for f in scan(part) {
                        out.push(mention(f, false, None, false));
                    }
                }
            }
        }
    }
    out
}

/// Joins shell `\` continuations.
fn logical_lines(text: &str) -> Vec<(usize, String)> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
