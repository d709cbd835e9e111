//! Making a skipped test visible. libtest has no "skipped" outcome: a test
//! that returns early for want of a tool reports `ok`, and what it printed
//! with `println!`/`eprintln!` is captured and shown only with
//! `--nocapture`. So a skip is reported twice, outside the capture:
//!
//! - a `SKIPPED <check>: <why>` line written straight to the process's
//!   stderr (libtest captures only the print macros), so it shows in any
//!   `cargo test` run, next to the test's `ok`;
//! - the same line appended to the file `$BIGFLEET_SKIPPED_LOG` names, when
//!   set: `make test-proxmox` (and so `make test`) sets it and prints the
//!   count and the lines at the end of the run.

use std::io::Write;
use std::path::Path;

/// The variable naming the file skips are appended to.
pub const LOG_VAR: &str = "BIGFLEET_SKIPPED_LOG";

/// The running test's name (libtest names each test's thread after it).
pub fn current_test() -> String {
    std::thread::current()
        .name()
        .unwrap_or("a test")
        .to_string()
}

/// Reports that `check` did not run, and `why` (what is missing, how to get
/// it). The caller returns early.
pub fn report(check: &str, why: &str) {
    let log = std::env::var_os(LOG_VAR).filter(|p| !p.is_empty());
    report_to(log.as_deref().map(Path::new), check, why);
}

fn report_to(log: Option<&Path>, check: &str, why: &str) {
    let line = format!("SKIPPED {check}: {}\n", why.replace('\n', " "));
    // One write of the whole line, so concurrent tests do not interleave.
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
    if let Some(path) = log {
        let appended = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .and_then(|mut f| f.write_all(line.as_bytes()));
        if let Err(e) = appended {
            let _ = writeln!(
                std::io::stderr().lock(),
                "cannot record the skip in {LOG_VAR}={}: {e}",
                path.display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skip_is_appended_to_the_log() {
        let dir = std::env::temp_dir().join(format!("skip-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("skipped.log");
        report_to(
            Some(&log),
            "the widget check",
            "`widget` is not installed;\ninstall it",
        );
        report_to(Some(&log), "the other check", "no gadget");
        let text = std::fs::read_to_string(&log).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            text,
            "SKIPPED the widget check: `widget` is not installed; install it\n\
             SKIPPED the other check: no gadget\n"
        );
    }
}
