//! The example commands of the operator docs: every command line of the
//! shell blocks of README.md and docs/*.md, split into words as a shell
//! splits them, and sorted by what a test can do with it: start the
//! provider ([`Kind::Serve`]), drive a running one ([`Kind::Ctl`]), check
//! a Makefile target ([`Kind::Make`]), or nothing it can run on its own
//! ([`Kind::Other`], which a test must list with its reason).
//!
//! The provider is recognised as `flags` recognises it (the binary, a path to
//! it, an image reference), behind what runs it: `cargo run -p
//! bigfleet-proxmox --`, `docker run ... IMAGE`, `kubectl exec ... --`, and
//! `BIN`, certification.md's name for the binary.

use std::path::{Path, PathBuf};

use crate::flags::{is_provider_program, logical_lines};
use crate::manifests::fences;

/// Fence languages whose blocks are shell commands.
const SHELL_FENCES: &[&str] = &["sh", "bash", "shell", "console"];

/// Words a shell reads as operators between commands, not as arguments.
const OPERATORS: &[&str] = &["|", "||", "&", "&&", ";"];

/// One command line of a doc's shell block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DocCommand {
    /// The page, relative to the workspace (`README.md`, `docs/install.md`).
    pub file: String,
    /// Where the command starts on the page.
    pub line: usize,
    /// The command as written, continuations joined, its comment cut and
    /// whitespace collapsed: what a test's allowlist names.
    pub text: String,
    /// The words a shell would pass (quotes removed, operators on their own).
    pub words: Vec<String>,
}

impl DocCommand {
    /// `file:line`, for messages.
    pub fn at(&self) -> String {
        format!("{}:{}", self.file, self.line)
    }
}

/// What a test can do with a command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// The provider started with these arguments.
    Serve(Vec<String>),
    /// `bigfleet-proxmox ctl` with these arguments (after `ctl`).
    Ctl(Vec<String>),
    /// `bigfleet-proxmox state copy` with these arguments (after `copy`).
    StateCopy(Vec<String>),
    /// `make TARGET VAR=VALUE...`.
    Make { target: String, vars: Vec<String> },
    /// Another tool (kubectl, helm, pveum, ...).
    Other,
}

/// Why the docs' commands could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CommandsError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{at}: {reason} in `{line}`")]
    Shell {
        at: String,
        line: String,
        reason: &'static str,
    },
}

/// The pages whose commands are read: README.md, then docs/*.md by name.
pub fn doc_pages(root: &Path) -> Result<Vec<PathBuf>, CommandsError> {
    let dir = root.join("docs");
    let read_error = |source| CommandsError::Read {
        path: dir.clone(),
        source,
    };
    let mut pages = Vec::new();
    for entry in std::fs::read_dir(&dir).map_err(read_error)? {
        let path = entry.map_err(read_error)?.path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
    pages.sort();
    pages.insert(0, root.join("README.md"));
    Ok(pages)
}

/// Every command of every page of [`doc_pages`], in page order.
pub fn doc_commands(root: &Path) -> Result<Vec<DocCommand>, CommandsError> {
    let mut out = Vec::new();
    for page in doc_pages(root)? {
        let text = std::fs::read_to_string(&page).map_err(|source| CommandsError::Read {
            path: page.clone(),
            source,
        })?;
        let file = page
            .strip_prefix(root)
            .unwrap_or(&page)
            .display()
            .to_string();
        out.extend(commands_in(&text, &file)?);
    }
    Ok(out)
}

/// The commands of `markdown`'s shell blocks; `file` names the page.
pub fn commands_in(markdown: &str, file: &str) -> Result<Vec<DocCommand>, CommandsError> {
    let mut out = Vec::new();
    for (lang, body, first_line) in fences(markdown) {
        if !SHELL_FENCES.contains(&lang.as_str()) {
            continue;
        }
        for (n, line) in logical_lines(&body) {
            let at = format!("{file}:{}", first_line + n - 1);
            let (words, code) = shell_words(&line).map_err(|reason| CommandsError::Shell {
                at: at.clone(),
                line: line.clone(),
                reason,
            })?;
            if words.is_empty() {
                continue;
            }
            out.push(DocCommand {
                file: file.to_owned(),
                line: first_line + n - 1,
                text: code.split_whitespace().collect::<Vec<_>>().join(" "),
                words,
            });
        }
    }
    Ok(out)
}

/// Splits one command line as a shell does: `'...'` literal, `"..."` with
/// `\"`, `\\`, `\$` and `` \` `` escapes, `\x` outside quotes, a `#` that
/// opens a word starts the comment, and `|`, `||`, `&`, `&&` and `;` are
/// words of their own. Returns the words and the line up to its comment.
pub fn shell_words(line: &str) -> Result<(Vec<String>, &str), &'static str> {
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut chars = line.char_indices().peekable();
    let mut end = line.len();
    while let Some((at, c)) = chars.next() {
        match c {
            '#' if word.is_none() => {
                end = at;
                break;
            }
            c if c.is_whitespace() => words.extend(word.take()),
            '|' | '&' | ';' => {
                words.extend(word.take());
                let mut op = c.to_string();
                if c != ';' && chars.peek().is_some_and(|&(_, next)| next == c) {
                    chars.next();
                    op.push(c);
                }
                words.push(op);
            }
            '\'' => {
                let w = word.get_or_insert_with(String::new);
                loop {
                    match chars.next() {
                        Some((_, '\'')) => break,
                        Some((_, c)) => w.push(c),
                        None => return Err("an unclosed '"),
                    }
                }
            }
            '"' => {
                let w = word.get_or_insert_with(String::new);
                loop {
                    match chars.next() {
                        Some((_, '"')) => break,
                        Some((_, '\\')) => match chars.next() {
                            Some((_, e)) if matches!(e, '"' | '\\' | '$' | '`') => w.push(e),
                            Some((_, e)) => {
                                w.push('\\');
                                w.push(e);
                            }
                            None => return Err("an unclosed \""),
                        },
                        Some((_, c)) => w.push(c),
                        None => return Err("an unclosed \""),
                    }
                }
            }
            '\\' => {
                let escaped = chars.next().ok_or("a trailing \\")?.1;
                word.get_or_insert_with(String::new).push(escaped);
            }
            c => word.get_or_insert_with(String::new).push(c),
        }
    }
    words.extend(word);
    Ok((words, &line[..end]))
}

/// `NAME=value`: an environment assignment before a command.
fn is_assignment(word: &str) -> bool {
    word.split_once('=').is_some_and(|(name, _)| {
        !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    })
}

/// Whether `word`, as a command's program, is the provider binary: as
/// `flags` knows it, a path to a build of it (`target/release/bigfleet-proxmox`),
/// or `BIN`, certification.md's name for it.
fn is_provider(word: &str) -> bool {
    word == "BIN"
        || is_provider_program(word)
        || Path::new(word)
            .file_name()
            .is_some_and(|name| name == "bigfleet-proxmox")
}

/// The index of the word the provider's arguments follow, when `words`
/// (assignments stripped) run the provider.
fn provider_at(words: &[String]) -> Option<usize> {
    let program = words.first()?;
    if is_provider(program) {
        return Some(0);
    }
    let has = |w: &str| words.iter().any(|x| x == w);
    match program.as_str() {
        "cargo" if words.get(1).is_some_and(|w| w == "run") => {
            let package = words
                .windows(2)
                .find(|p| p[0] == "-p" || p[0] == "--package")
                .map(|p| p[1].as_str());
            (package == Some("bigfleet-proxmox"))
                .then(|| words.iter().position(|w| w == "--"))
                .flatten()
        }
        "docker" | "podman" if has("run") => words.iter().position(|w| is_provider_program(w)),
        "kubectl" if has("exec") => {
            let dashes = words.iter().position(|w| w == "--")?;
            words
                .get(dashes + 1)
                .filter(|w| is_provider(w))
                .map(|_| dashes + 1)
        }
        _ => None,
    }
}

/// What `words` run (see [`Kind`]).
pub fn kind(words: &[String]) -> Kind {
    let start = words
        .iter()
        .position(|w| !is_assignment(w))
        .unwrap_or(words.len());
    let words = &words[start..];
    if let Some(at) = provider_at(words) {
        let args: Vec<String> = words[at + 1..]
            .iter()
            .take_while(|w| !OPERATORS.contains(&w.as_str()))
            .cloned()
            .collect();
        return match args.as_slice() {
            [first, rest @ ..] if first == "ctl" => Kind::Ctl(rest.to_vec()),
            [first, second, rest @ ..] if first == "state" && second == "copy" => {
                Kind::StateCopy(rest.to_vec())
            }
            _ => Kind::Serve(args),
        };
    }
    if words.first().is_some_and(|w| w == "make") {
        let mut target = None;
        let mut vars = Vec::new();
        for w in words[1..]
            .iter()
            .take_while(|w| !OPERATORS.contains(&w.as_str()))
        {
            if is_assignment(w) {
                vars.push(w.clone());
            } else if !w.starts_with('-') && target.is_none() {
                target = Some(w.clone());
            }
        }
        if let Some(target) = target {
            return Kind::Make { target, vars };
        }
    }
    Kind::Other
}

/// The value of `flag` in `args` (`--flag value` or `--flag=value`).
pub fn flag_value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    let eq = format!("{flag}=");
    args.iter().enumerate().find_map(|(i, a)| {
        if a == flag {
            args.get(i + 1).map(String::as_str)
        } else {
            a.strip_prefix(&eq)
        }
    })
}

/// `args` with every value of `flag` replaced by `new(old)`, in the form it
/// was written in.
pub fn replace_flag(args: &[String], flag: &str, new: impl Fn(&str) -> String) -> Vec<String> {
    let eq = format!("{flag}=");
    let mut out = Vec::with_capacity(args.len());
    let mut value_next = false;
    for a in args {
        if value_next {
            out.push(new(a));
            value_next = false;
        } else if a == flag {
            out.push(a.clone());
            value_next = true;
        } else if let Some(old) = a.strip_prefix(&eq) {
            out.push(format!("{eq}{}", new(old)));
        } else {
            out.push(a.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(line: &str) -> Vec<String> {
        shell_words(line).expect("splits").0
    }

    #[test]
    fn words_are_split_as_a_shell_splits_them() {
        let (w, code) =
            shell_words(r#"a 'b c' "d \"e\" $f" g\ h x# y   # the comment 'unclosed"#).unwrap();
        assert_eq!(w, ["a", "b c", "d \"e\" $f", "g h", "x#", "y"]);
        assert_eq!(code, r#"a 'b c' "d \"e\" $f" g\ h x# y   "#);
        assert_eq!(words("x | y && z & "), ["x", "|", "y", "&&", "z", "&"]);
        assert_eq!(words("--privs ''"), ["--privs", ""]);
        assert!(shell_words("echo 'open").is_err());
    }

    #[test]
    fn commands_come_from_shell_blocks_with_their_lines() {
        let md = "text\n```sh\n# a comment line\nrun --a 1 \\\n  --b 'x y'   # why\n\nnext\n```\n\
                  ```yaml\nnot: a command\n```\n";
        let got = commands_in(md, "p.md").unwrap();
        let got: Vec<(usize, &str, &[String])> = got
            .iter()
            .map(|c| (c.line, c.text.as_str(), c.words.as_slice()))
            .collect();
        assert_eq!(
            got,
            [
                (4, "run --a 1 --b 'x y'", &words("run --a 1 --b 'x y'")[..]),
                (7, "next", &words("next")[..]),
            ]
        );
    }

    #[test]
    fn kinds_follow_the_program_behind_its_runner() {
        let serve = |l: &str| Kind::Serve(words(l));
        assert_eq!(
            kind(&words(
                "cargo run --release -p bigfleet-proxmox -- --addr :1 | tee x"
            )),
            serve("--addr :1")
        );
        assert_eq!(
            kind(&words("cargo run -q -p bigfleet-proxmox -- ctl get 'a/b'")),
            Kind::Ctl(words("get a/b"))
        );
        assert_eq!(
            kind(&words("bigfleet-proxmox state copy --from a --to b")),
            Kind::StateCopy(words("--from a --to b"))
        );
        assert_eq!(
            kind(&words("cargo run -p pve-sim -- --listen x")),
            Kind::Other
        );
        assert_eq!(
            kind(&words("target/release/bigfleet-proxmox --nodes a")),
            serve("--nodes a")
        );
        assert_eq!(
            kind(&words("BIN --addr=127.0.0.1:PORT [--state=PATH.json]")),
            serve("--addr=127.0.0.1:PORT [--state=PATH.json]")
        );
        assert_eq!(
            kind(&words(
                "docker run --read-only -v a:b r/bigfleet-proxmox:0.1 --nodes a"
            )),
            serve("--nodes a")
        );
        assert_eq!(
            kind(&words("docker push r/bigfleet-proxmox:0.1")),
            Kind::Other
        );
        assert_eq!(
            kind(&words(
                "kubectl -n x exec deploy/y -- /usr/local/bin/bigfleet-proxmox ctl list"
            )),
            Kind::Ctl(words("list"))
        );
        assert_eq!(
            kind(&words("kubectl -n x logs deploy/bigfleet-proxmox | grep y")),
            Kind::Other
        );
        assert_eq!(
            kind(&words("A=1 make report-proxmox PROFILE=core,cloud")),
            Kind::Make {
                target: "report-proxmox".into(),
                vars: vec!["PROFILE=core,cloud".into()]
            }
        );
        assert_eq!(
            kind(&words("helm install a deploy/helm/bigfleet-proxmox")),
            Kind::Other
        );
    }

    #[test]
    fn flags_are_read_and_replaced_in_either_form() {
        let args = words("--addr :1 --state=a.db --use-fake-backend --addr=:2");
        assert_eq!(flag_value(&args, "--addr"), Some(":1"));
        assert_eq!(flag_value(&args, "--state"), Some("a.db"));
        assert_eq!(flag_value(&args, "--nodes"), None);
        assert_eq!(
            replace_flag(&args, "--addr", |old| format!("[{old}]")),
            words("--addr [:1] --state=a.db --use-fake-backend --addr=[:2]")
        );
    }
}
