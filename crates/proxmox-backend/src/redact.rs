//! Keeping the bootstrap blob out of error text.
//!
//! A failing bootstrap often repeats its input: `/bin/sh` reports a bare
//! join token as `…: <token>: not found`, `set -x` traces every line, a
//! parser quotes the line it choked on. Guest output quoted in an error
//! travels to `last_error`, the WARN log, the state file and every Get and
//! List caller, so anything that looks like a piece of the blob is replaced
//! before the output is shown anywhere.

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};

/// What replaces a redacted piece.
pub const REDACTED: &str = "[redacted]";

/// Lines and whitespace-separated tokens of the blob shorter than this are
/// left alone: they are words like `join` or `--token` that carry no secret
/// and that an operator needs to read the error.
pub const MIN_PIECE: usize = 8;

/// Redacts the blob, each of its lines and each of its tokens (at least
/// [`MIN_PIECE`] bytes) from guest output.
pub struct Redactor {
    /// `None` when the blob has no piece worth hiding.
    matcher: Option<AhoCorasick>,
    pieces: Vec<String>,
}

impl Redactor {
    pub fn new(secret: &[u8]) -> Redactor {
        let text = String::from_utf8_lossy(secret);
        let mut pieces: Vec<String> = Vec::new();
        let mut add = |piece: &str| {
            let piece = piece.trim();
            if piece.len() >= MIN_PIECE {
                pieces.push(piece.to_string());
            }
        };
        add(&text);
        for line in text.lines() {
            add(line);
        }
        for token in text.split_whitespace() {
            add(token);
            // What a program echoes is often the token without its shell
            // quoting, or the value of a `NAME=value` assignment.
            let bare = token.trim_matches(|c: char| "\"'`;,()[]{}<>".contains(c));
            add(bare);
            for part in bare.split('=') {
                add(part.trim_matches(|c: char| "\"'`".contains(c)));
            }
        }
        pieces.sort_unstable();
        pieces.dedup();
        // Leftmost-longest: the whole blob or a whole line wins over the
        // tokens inside it, so one marker stands for one secret.
        let matcher = if pieces.is_empty() {
            None
        } else {
            AhoCorasickBuilder::new()
                .match_kind(MatchKind::LeftmostLongest)
                .build(&pieces)
                .ok()
        };
        Redactor { matcher, pieces }
    }

    /// `output` with every piece of the blob replaced by [`REDACTED`], and
    /// whether anything was replaced. When `truncated` (the guest agent cut
    /// the output), a last token that is the start of a piece is redacted
    /// too: the cut may have fallen inside a secret.
    pub fn redact(&self, output: &str, truncated: bool) -> (String, bool) {
        let Some(matcher) = &self.matcher else {
            return (output.to_string(), false);
        };
        let mut hit = matcher.is_match(output);
        let mut out = if hit {
            matcher.replace_all(output, &vec![REDACTED; self.pieces.len()])
        } else {
            output.to_string()
        };
        if truncated {
            let trimmed = out.trim_end();
            let start = trimmed.rfind(char::is_whitespace).map_or(0, |i| {
                i + trimmed[i..].chars().next().map_or(1, char::len_utf8)
            });
            let last = &trimmed[start..];
            if last.len() >= MIN_PIECE && self.pieces.iter().any(|p| p.starts_with(last)) {
                out.replace_range(start..trimmed.len(), REDACTED);
                hit = true;
            }
        }
        (out, hit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blob_lines_and_tokens_are_redacted_short_words_kept() {
        let blob = b"kubeadm join 10.0.0.1:6443 --token abcdef.0123456789abcdef\n\
                     --discovery-token-ca-cert-hash sha256:deadbeefcafe\n";
        let r = Redactor::new(blob);
        let out = "sh: 1: abcdef.0123456789abcdef: not found\n\
                   + kubeadm join 10.0.0.1:6443 --token abcdef.0123456789abcdef\n\
                   error: sha256:deadbeefcafe rejected by join";
        let (red, hit) = r.redact(out, false);
        assert!(hit);
        assert!(!red.contains("0123456789abcdef"), "{red}");
        assert!(!red.contains("deadbeefcafe"), "{red}");
        assert!(!red.contains("10.0.0.1:6443"), "{red}");
        assert!(
            red.contains("not found") && red.contains("rejected by join"),
            "{red}"
        );
    }

    #[test]
    fn a_bare_token_echoed_by_sh_is_redacted() {
        let token = "K10f00dfeedbeefcafe::server:0123456789";
        let r = Redactor::new(token.as_bytes());
        let (red, hit) = r.redact(
            &format!("/run/bigfleet-bootstrap: 1: {token}: not found"),
            false,
        );
        assert!(hit);
        assert_eq!(red, "/run/bigfleet-bootstrap: 1: [redacted]: not found");
    }

    #[test]
    fn quoted_and_assigned_tokens_are_redacted_bare() {
        let r = Redactor::new(
            b"echo \"hash sha256:5d41402abc4b2a76\" >&2\nJOIN_TOKEN='abcdef0123456789'\n",
        );
        let (red, hit) = r.redact(
            "hash sha256:5d41402abc4b2a76 / token abcdef0123456789",
            false,
        );
        assert!(hit);
        assert_eq!(red, "hash [redacted] / token [redacted]");
    }

    #[test]
    fn a_secret_cut_by_truncation_is_redacted() {
        let token = "K10f00dfeedbeefcafe::server:0123456789";
        let r = Redactor::new(token.as_bytes());
        let (red, hit) = r.redact("trace: K10f00dfeed", true);
        assert!(hit && !red.contains("K10f00dfeed"), "{red}");
        let (red, hit) = r.redact("trace: K10f00dfeed", false);
        assert!(!hit && red.contains("K10f00dfeed"));
    }

    #[test]
    fn unrelated_output_and_binary_blobs_pass_through() {
        let r = Redactor::new(&[0xff, 0x00, 0x01]);
        assert_eq!(
            r.redact("plain failure", true),
            ("plain failure".into(), false)
        );
        let r = Redactor::new(b"");
        assert_eq!(
            r.redact("plain failure", false),
            ("plain failure".into(), false)
        );
    }
}
