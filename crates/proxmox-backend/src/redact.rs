//! Keeping the bootstrap blob out of error text.
//!
//! A failing bootstrap often repeats its input: `/bin/sh` reports a bare
//! join token as `…: <token>: not found`, `set -x` traces every line, a
//! parser quotes the line it choked on. Guest output quoted in an error
//! travels to `last_error`, the WARN log, the state file and every Get and
//! List caller, so anything that looks like a piece of the blob is replaced
//! before the output is shown anywhere.

use std::collections::HashMap;
use std::sync::Arc;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, AhoCorasickKind, MatchKind};
use zeroize::{Zeroize, Zeroizing};

/// What replaces a redacted piece.
pub const REDACTED: &str = "[redacted]";

/// Lines and whitespace-separated tokens of the blob shorter than this are
/// left alone: they are words like `join` or `--token` that carry no secret
/// and that an operator needs to read the error.
pub const MIN_PIECE: usize = 8;

/// Pieces up to this long are matched as patterns; longer ones (the whole
/// blob, long lines) by [`Runs`], so the matcher's cost never grows with
/// one huge pattern. Any piece longer than this holds a run that [`Runs`]
/// finds (`WINDOW + STRIDE - 1` is below it).
const MAX_PATTERN: usize = 64;

/// Bytes per hashed window of the blob.
const WINDOW: usize = 32;

/// Every `STRIDE`-th window of the blob is indexed: a run of the blob in
/// output of at least `WINDOW + STRIDE - 1` bytes always covers one of them.
const STRIDE: usize = 16;

/// Redacts the blob, each of its lines and each of its tokens (at least
/// [`MIN_PIECE`] bytes) from guest output.
///
/// Pieces of up to 64 bytes (tokens, `NAME=value` values, short lines) are
/// one leftmost-longest Aho-Corasick matcher; the whole blob and longer
/// lines are found as runs of the blob: windows of the output are hashed
/// against an index of the blob's windows, and a hit is widened to the
/// longest run the output shares with the blob there. That hides every
/// long piece (and any other long stretch of the blob), while the build
/// costs a pass over the blob rather than an automaton over a pattern the
/// size of the blob.
pub struct Redactor {
    /// `None` when the blob has no short piece worth hiding.
    matcher: Option<AhoCorasick>,
    /// Every piece, short and long: a cut-off last token is checked
    /// against their starts.
    pieces: Vec<String>,
    runs: Option<Runs>,
}

/// The pieces of the blob and the copy of it kept for long runs are wiped
/// when the redactor goes (the Configure, or its last readiness probe, is
/// over). The matcher's automaton holds the short pieces too, in tables of
/// its own that cannot be reached to wipe (docs/security.md).
impl Drop for Redactor {
    fn drop(&mut self) {
        self.wipe();
    }
}

impl Redactor {
    /// Overwrites every piece and the blob's copy with zeros, as dropping
    /// does. Each piece was made with `to_string` (capacity = length).
    fn wipe(&mut self) {
        for piece in &mut self.pieces {
            piece.as_mut_str().zeroize();
        }
        if let Some(runs) = &mut self.runs {
            runs.blob.as_mut_slice().zeroize();
        }
    }

    pub fn new(secret: &[u8]) -> Redactor {
        // A blob that is not UTF-8 is copied with its invalid bytes
        // replaced: that copy is wiped at the end too.
        let lossy: Option<Zeroizing<String>> = std::str::from_utf8(secret)
            .is_err()
            .then(|| Zeroizing::new(String::from_utf8_lossy(secret).into_owned()));
        let text: &str = match &lossy {
            Some(copy) => copy.as_str(),
            None => std::str::from_utf8(secret).unwrap_or_default(),
        };
        let mut pieces: Vec<String> = Vec::new();
        let mut add = |piece: &str| {
            let piece = piece.trim();
            if piece.len() >= MIN_PIECE {
                pieces.push(piece.to_string());
            }
        };
        add(text);
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
        let short: Vec<&String> = pieces.iter().filter(|p| p.len() <= MAX_PATTERN).collect();
        // Leftmost-longest: a whole line wins over the tokens inside it, so
        // one marker stands for one secret. A contiguous NFA: built in time
        // linear in the patterns, where a DFA over thousands of tokens is not.
        let matcher = if short.is_empty() {
            None
        } else {
            AhoCorasickBuilder::new()
                .match_kind(MatchKind::LeftmostLongest)
                .kind(Some(AhoCorasickKind::ContiguousNFA))
                .build(&short)
                .ok()
        };
        let runs = pieces
            .iter()
            .any(|p| p.len() > MAX_PATTERN)
            .then(|| Runs::new(text.as_bytes()));
        Redactor {
            matcher,
            pieces,
            runs,
        }
    }

    /// [`Redactor::new`] off the async workers: its cost grows with the blob
    /// (a pass over 1 MiB), and the RPCs on those workers must not wait
    /// behind it.
    ///
    /// One build at a time across the process: on a small machine, four
    /// parallel builds of 1 MiB blobs would take every core from the async
    /// workers; one at a time leaves them a core and costs the Configures
    /// only their queueing (a build is a fraction of a second).
    pub async fn build(secret: &[u8]) -> Arc<Redactor> {
        static ONE_BUILD: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);
        // The semaphore is never closed, so acquiring cannot fail; if it
        // did, building without the turn is still correct.
        let _turn = ONE_BUILD.acquire().await.ok();
        // Wiped when the build is done with it.
        let owned = Zeroizing::new(secret.to_vec());
        match tokio::task::spawn_blocking(move || Redactor::new(&owned)).await {
            Ok(r) => Arc::new(r),
            // Only a panic inside `new` (a bug) gets here: build it inline
            // rather than lose the redaction.
            Err(_) => Arc::new(Redactor::new(secret)),
        }
    }

    /// `output` with every piece of the blob replaced by [`REDACTED`], and
    /// whether anything was replaced. When `truncated` (the guest agent cut
    /// the output), a last token that is the start of a piece is redacted
    /// too: the cut may have fallen inside a secret.
    pub fn redact(&self, output: &str, truncated: bool) -> (String, bool) {
        let mut spans: Vec<(usize, usize)> = Vec::new();
        if let Some(m) = &self.matcher {
            spans.extend(m.find_iter(output).map(|m| (m.start(), m.end())));
        }
        if let Some(runs) = &self.runs {
            spans.extend(runs.find(output));
        }
        let mut hit = !spans.is_empty();
        let mut out = replace_spans(output, spans);
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

/// `output` with each span (merged where they overlap) replaced by [`REDACTED`].
fn replace_spans(output: &str, mut spans: Vec<(usize, usize)>) -> String {
    if spans.is_empty() {
        return output.to_string();
    }
    spans.sort_unstable();
    let mut out = String::with_capacity(output.len());
    let mut at = 0;
    let mut i = 0;
    while i < spans.len() {
        let (start, mut end) = spans[i];
        i += 1;
        while i < spans.len() && spans[i].0 < end {
            end = end.max(spans[i].1);
            i += 1;
        }
        out.push_str(&output[at..start]);
        out.push_str(REDACTED);
        at = end;
    }
    out.push_str(&output[at..]);
    out
}

/// Long runs of the blob: a hash of every [`STRIDE`]-th [`WINDOW`] of it.
///
/// Every window of the output that equals an indexed window ends up inside
/// a redacted span, so no run of the blob of `WINDOW + STRIDE - 1` bytes or
/// more survives. A blob that repeats a window more than [`CANDIDATES`]
/// times may leave a few bytes between two spans where the true occurrence
/// was not tried: short words of a long line, never a token of 8 bytes or
/// more (those are patterns of their own).
struct Runs {
    /// A copy of the blob, wiped with the [`Redactor`].
    blob: Vec<u8>,
    /// Window hash -> where windows with that hash start in the blob (the
    /// first [`CANDIDATES`]).
    windows: HashMap<u64, Vec<usize>>,
}

/// Occurrences of one window tried when the output repeats it.
const CANDIDATES: usize = 32;

/// Polynomial rolling hash base (odd, so multiplication mod 2^64 mixes).
const BASE: u64 = 0x100_0000_01b3;

fn window_hash(w: &[u8]) -> u64 {
    w.iter().fold(0u64, |h, &b| {
        h.wrapping_mul(BASE).wrapping_add(u64::from(b) + 1)
    })
}

impl Runs {
    fn new(blob: &[u8]) -> Runs {
        let mut windows: HashMap<u64, Vec<usize>> = HashMap::new();
        let mut at = 0;
        while at + WINDOW <= blob.len() {
            let seen = windows
                .entry(window_hash(&blob[at..at + WINDOW]))
                .or_default();
            if seen.len() < CANDIDATES {
                seen.push(at);
            }
            at += STRIDE;
        }
        Runs {
            blob: blob.to_vec(),
            windows,
        }
    }

    /// The spans of `output` that are runs of the blob, widened to whole
    /// characters (see [`Runs`] for what is guaranteed).
    fn find(&self, output: &str) -> Vec<(usize, usize)> {
        let out = output.as_bytes();
        let mut spans = Vec::new();
        if out.len() < WINDOW {
            return spans;
        }
        // BASE^WINDOW, to drop the byte leaving the rolling window.
        let top = (0..WINDOW).fold(1u64, |p, _| p.wrapping_mul(BASE));
        // Output before `covered` is inside the last span.
        let mut covered = 0;
        let mut i = 0;
        let mut h = window_hash(&out[..WINDOW]);
        loop {
            if let Some(run) = self.longest_run(out, i, h, covered) {
                if run.1 > covered {
                    spans.push(char_bounds(output, run.0, run.1));
                    covered = run.1;
                    // Windows that cross the span's end may continue it at
                    // another occurrence: look at them before going on.
                    let next = (covered + 1).saturating_sub(WINDOW).max(i + 1);
                    if next + WINDOW > out.len() {
                        break;
                    }
                    i = next;
                    h = window_hash(&out[i..i + WINDOW]);
                    continue;
                }
            }
            if i + WINDOW >= out.len() {
                break;
            }
            h = h
                .wrapping_mul(BASE)
                .wrapping_add(u64::from(out[i + WINDOW]) + 1)
                .wrapping_sub(top.wrapping_mul(u64::from(out[i]) + 1));
            i += 1;
        }
        spans
    }

    /// The longest run the output shares with the blob through the window
    /// at `i` (hash `h`), over the blob's occurrences of that window; not
    /// widened back past `covered`.
    fn longest_run(&self, out: &[u8], i: usize, h: u64, covered: usize) -> Option<(usize, usize)> {
        let window = &out[i..i + WINDOW];
        self.windows
            .get(&h)?
            .iter()
            .filter(|&&at| self.blob[at..at + WINDOW] == *window)
            .map(|&at| {
                let back = out[covered.min(i)..i]
                    .iter()
                    .rev()
                    .zip(self.blob[..at].iter().rev())
                    .take_while(|(a, b)| a == b)
                    .count();
                let ahead = out[i..]
                    .iter()
                    .zip(&self.blob[at..])
                    .take_while(|(a, b)| a == b)
                    .count();
                (i - back, i + ahead)
            })
            .max_by_key(|(start, end)| end - start)
    }
}

/// `start..end` widened to character boundaries of `s`.
fn char_bounds(s: &str, mut start: usize, mut end: usize) -> (usize, usize) {
    while start > 0 && !s.is_char_boundary(start) {
        start -= 1;
    }
    while end < s.len() && !s.is_char_boundary(end) {
        end += 1;
    }
    (start, end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pieces_and_the_copy_of_the_blob_are_wiped() {
        let long = "x".repeat(MAX_PATTERN * 4);
        let blob = format!("kubeadm join --token abcdef.0123456789abcdef\n{long}\n");
        let mut r = Redactor::new(blob.as_bytes());
        assert!(!r.pieces.is_empty());
        assert!(r.runs.is_some(), "a long line is matched as a run");
        r.wipe();
        for piece in &r.pieces {
            assert!(
                !piece.is_empty() && piece.bytes().all(|b| b == 0),
                "{piece:?}"
            );
        }
        let runs = r
            .runs
            .as_ref()
            .map(|runs| runs.blob.clone())
            .unwrap_or_default();
        assert_eq!(runs.len(), blob.len());
        assert!(runs.iter().all(|b| *b == 0));
    }

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

    /// A blob of long lines of short words (none a piece of its own: only
    /// the lines, and the blob, are), each line different.
    fn long_lines(n: usize) -> String {
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut blob = String::new();
        for _ in 0..n {
            for _ in 0..16 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let len = 2 + (x % 5) as usize;
                let word: String = (0..len)
                    .map(|k| char::from(b'a' + ((x >> (8 * k)) % 26) as u8))
                    .collect();
                blob.push_str(&word);
                blob.push(' ');
            }
            blob.push('\n');
        }
        blob
    }

    #[test]
    fn long_lines_and_the_whole_blob_are_redacted_as_runs() {
        let blob = long_lines(50);
        let r = Redactor::new(blob.as_bytes());
        let line = blob.lines().nth(7).unwrap().trim();
        assert!(line.len() > MAX_PATTERN, "a long piece: {}", line.len());
        let (red, hit) = r.redact(&format!("sh: parse error near: {line} (exit 2)"), false);
        assert!(hit);
        // The space after the line is the blob's too, so it goes with it.
        assert_eq!(red, "sh: parse error near: [redacted](exit 2)");
        // The whole blob echoed back is one marker.
        let (red, hit) = r.redact(&format!("+ cat\n{blob}done"), false);
        assert!(hit);
        assert_eq!(red, "+ cat\n[redacted]done");
        // A chunk of the blob cut anywhere (as a chunked write echoes it).
        let chunk = &blob[333..1333];
        let (red, hit) = r.redact(&format!("base64: invalid input {chunk}!"), false);
        assert!(hit);
        assert_eq!(red, "base64: invalid input [redacted]!");
    }

    /// A blob that repeats itself: whatever the output shows of it, no run
    /// of the blob as long as the guarantee's bound survives.
    #[test]
    fn no_long_run_of_a_repetitive_blob_survives() {
        let blob: String = (0..200)
            .map(|i| format!("ab cd ef {i:05} gh ij kl mn op qr st uv wx yz 01 23 45 ab cd\n"))
            .collect();
        let r = Redactor::new(blob.as_bytes());
        for (from, to) in [(0, blob.len()), (333, 5333), (4000, 4100), (81, 170)] {
            let (red, hit) = r.redact(&blob[from..to], false);
            assert!(hit);
            for piece in red.split(REDACTED) {
                assert!(
                    piece.len() < WINDOW + STRIDE - 1,
                    "a run of {} bytes survived: {piece:?}",
                    piece.len()
                );
            }
        }
    }

    #[test]
    fn a_run_widens_to_whole_characters() {
        let blob = format!("{}é{}", "x".repeat(80), "y".repeat(80));
        let r = Redactor::new(blob.as_bytes());
        // Shares the blob up to the first byte of `é`, then differs.
        let out = format!("<{}è>", "x".repeat(80));
        let (red, hit) = r.redact(&out, false);
        assert!(hit, "{red}");
        assert_eq!(red, "<[redacted]>");
    }

    #[test]
    fn a_large_blob_is_redacted_from_an_echo_of_any_part() {
        // 1 MiB of distinct lines; the matcher builds quickly enough to
        // run in every test of the suite.
        let mut blob = String::new();
        let mut i = 0u64;
        while blob.len() < 1 << 20 {
            blob.push_str(&format!(
                "key{i:07}=value-{:016x} plus short words\n",
                i.wrapping_mul(0x9e37_79b9_7f4a_7c15)
            ));
            i += 1;
        }
        let r = Redactor::new(blob.as_bytes());
        let mid = blob.len() / 2;
        let start = blob[..mid].rfind('\n').unwrap() + 1;
        let line = &blob[start..start + blob[start..].find('\n').unwrap()];
        let value = line
            .split('=')
            .nth(1)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap();
        let (red, hit) = r.redact(&format!("error: {value} refused"), false);
        assert!(hit && !red.contains(value), "{red}");
        let chunk = &blob[mid..mid + 40_000];
        let (red, hit) = r.redact(&format!("echo: {chunk}"), false);
        assert!(hit, "a 40 kB piece of the blob");
        assert!(red.len() < 100, "{}", red.len());
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
