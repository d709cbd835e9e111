//! The guest commands as they are run, and how their answers read: the
//! node name each gets in [`NODE_NAME_ENV`], the Configure command (name
//! the guest, read the name back, start the hook) and how its output cuts
//! in two, the join of a chunked blob, the drain command line, and the
//! exit status and output tail an error quotes, with the blob kept out.

use std::time::Duration;

use pve::ExecStatus;

use super::super::options::NODE_NAME_ENV;
use crate::redact::{Redactor, REDACTED};
use crate::substrate::SubstrateError;

/// Bytes of stderr/stdout quoted in an error.
pub(in crate::proxmox) const OUTPUT_TAIL: usize = 512;

/// The last `OUTPUT_TAIL` bytes of guest output, cut on a character boundary.
pub(super) fn tail(s: &str) -> &str {
    let s = s.trim_end();
    if s.len() <= OUTPUT_TAIL {
        return s;
    }
    let mut start = s.len() - OUTPUT_TAIL;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

/// Ok for exit 0; otherwise an error with the exit code / signal and the tail of stderr.
pub(super) fn exec_outcome(what: &str, st: &ExecStatus) -> Result<(), SubstrateError> {
    exec_outcome_with(what, st, &Redactor::new(&[]))
}

/// Ok for exit 0; otherwise [`exec_outcome`]'s error with every piece of
/// the bootstrap blob that `redactor` knows cut from the quoted output
/// before the tail is taken (see [`crate::redact`]), and the error says so.
pub(super) fn exec_outcome_with(
    what: &str,
    st: &ExecStatus,
    redactor: &Redactor,
) -> Result<(), SubstrateError> {
    let mut msg = match (st.exitcode, st.signal) {
        (Some(0), None) => return Ok(()),
        (_, Some(sig)) => format!("{what} was killed by signal {sig}"),
        (Some(code), None) => format!("{what} exited {code}"),
        (None, None) => format!("{what} ended without an exit status"),
    };
    let mut redacted = false;
    let mut quote = |data: &Option<String>, truncated: bool| {
        let (clean, hit) = redactor.redact(data.as_deref().unwrap_or_default(), truncated);
        redacted |= hit;
        tail(&clean).to_string()
    };
    let err = quote(&st.err_data, st.err_truncated);
    let out = quote(&st.out_data, st.out_truncated);
    if !err.is_empty() {
        msg.push_str(&format!(": stderr: {err}"));
        if st.err_truncated {
            msg.push_str(" (stderr was truncated by the guest agent)");
        }
    } else if !out.is_empty() {
        msg.push_str(&format!(": stdout: {out}"));
        if st.out_truncated {
            msg.push_str(" (stdout was truncated by the guest agent)");
        }
    }
    if redacted {
        msg.push_str(&format!(
            " (output that repeated the bootstrap blob was replaced by {REDACTED})"
        ));
    }
    Err(SubstrateError::new(msg))
}

/// `cmd` run by `/bin/sh` with the node name in [`NODE_NAME_ENV`]. The
/// agent's exec takes no environment, so `env` sets it; the command text
/// stays one argument, as given, with no quoting of the name to get wrong.
pub(super) fn with_node_name(name: &str, cmd: &str) -> Vec<String> {
    vec![
        "/usr/bin/env".into(),
        format!("{NODE_NAME_ENV}={name}"),
        "/bin/sh".into(),
        "-c".into(),
        cmd.into(),
    ]
}

/// What the Configure command prints before the hook: a line
/// `bigfleet-configure:<status>:<answer>` with `hostname`'s exit status and
/// answer (or error), then, when the hook starts, `bigfleet-configure:hook`.
pub(super) const CONFIGURE_MARK: &str = "bigfleet-configure:";

/// The Configure command: with the node name in [`NODE_NAME_ENV`], runs the
/// hostname command `cmd` (when not empty; a failure ends it with the
/// command's status), prints [`CONFIGURE_MARK`] with what `hostname` says,
/// and only when that is the node name (letter case aside) prints the hook
/// mark and becomes `hook`, the bootstrap hook and the blob's path. Every
/// piece is an argument of its own, as given; nothing is quoted into the
/// script.
pub(super) fn configure_argv(name: &str, cmd: &str, hook: &[String]) -> Vec<String> {
    const SCRIPT: &str = r#"cmd=$1; mark=$2; want=$3; shift 3
if [ -n "$cmd" ]; then /bin/sh -c "$cmd" || exit $?; fi
h=$(hostname 2>&1); s=$?
printf '\n%s%s:%s\n' "$mark" "$s" "$h"
lower() { printf '%s' "$1" | tr '[:upper:]' '[:lower:]'; }
[ "$s" = 0 ] && [ "$(lower "$h")" = "$(lower "$want")" ] || exit 0
printf '%shook\n' "$mark"
exec "$@""#;
    let mut argv = with_node_name(name, SCRIPT);
    argv.extend([
        "bigfleet-configure".to_string(),
        cmd.to_string(),
        CONFIGURE_MARK.to_string(),
        name.to_string(),
    ]);
    argv.extend(hook.iter().cloned());
    argv
}

/// The Configure command's status cut in two: the naming part (stdout up
/// to the hook mark, with the shell's exit when the hook never started)
/// and, when the hook started, the hook's own (its stdout after the mark,
/// its exit, the stderr; what the naming part wrote to stderr comes
/// before the hook's).
pub(super) fn split_configure(st: &ExecStatus) -> (ExecStatus, Option<ExecStatus>) {
    let out = st.out_data.as_deref().unwrap_or_default();
    let hook_mark = format!("{CONFIGURE_MARK}hook\n");
    let at = out
        .match_indices(&hook_mark)
        .map(|(i, _)| i)
        .find(|&i| i == 0 || out[..i].ends_with('\n'));
    match at {
        None => (st.clone(), None),
        Some(i) => {
            let named = ExecStatus {
                exited: true,
                exitcode: Some(0),
                signal: None,
                out_data: Some(out[..i].to_string()),
                out_truncated: false,
                err_data: None,
                err_truncated: false,
            };
            let hook = ExecStatus {
                out_data: Some(out[i + hook_mark.len()..].to_string()),
                ..st.clone()
            };
            (named, Some(hook))
        }
    }
}

/// What the last [`CONFIGURE_MARK`] read-back line of `out` says: the
/// guest's hostname, or `hostname`'s error when it exited non-zero. `None`
/// when there is no such line.
pub(super) fn read_back_hostname(out: &str) -> Option<Result<String, String>> {
    let line = out
        .lines()
        .rev()
        .filter_map(|l| l.strip_prefix(CONFIGURE_MARK))
        .find(|l| *l != "hook")?;
    let (status, answer) = line.split_once(':')?;
    let answer = answer.trim();
    match status {
        "0" => Some(Ok(answer.to_string())),
        other => Some(Err(format!("exit {other}: {answer}"))),
    }
}

/// The `i`th part file of a chunked blob: beside the blob, numbered so the
/// join's order is explicit.
pub(super) fn part_path(path: &str, i: usize) -> String {
    format!("{path}.part{i}")
}

/// The command that appends `parts` to `path` in the order given, removes
/// them (also on failure, with the half-joined file: they hold the blob) and
/// prints the sha256 of the result. Every file is named as an argument, not
/// built inside the script, so the command reads only what it is given.
pub(super) fn join_argv(path: &str, parts: &[String]) -> Vec<String> {
    const SCRIPT: &str = r#"p="$1"; shift
for part in "$@"; do
  cat "$part" >> "$p" || { rm -f "$p" "$@"; exit 1; }
done
rm -f "$@"
sha256sum "$p""#;
    let mut argv: Vec<String> = vec![
        "/bin/sh".into(),
        "-c".into(),
        SCRIPT.into(),
        "bigfleet-join".into(),
        path.into(),
    ];
    argv.extend(parts.iter().cloned());
    argv
}

/// The drain command as run: `--drain-command`, then `--grace-period=N`
/// only for a request's positive grace (0, proto3's unset, leaves each
/// pod's own `terminationGracePeriodSeconds` in force, where kubectl's
/// `--grace-period=0` would mean "delete now"), then `--timeout=Ns` so
/// kubectl gives up before the provider stops waiting.
pub(super) fn drain_command(base: &str, grace: Duration, drain_timeout: Duration) -> String {
    let mut cmd = base.trim().to_string();
    if grace.as_secs() > 0 {
        cmd.push_str(&format!(" --grace-period={}", grace.as_secs()));
    }
    cmd.push_str(&format!(" --timeout={}s", drain_timeout.as_secs().max(1)));
    cmd
}

#[cfg(test)]
mod tests {
    use super::super::CHUNK_RAW;
    use super::*;
    use sha2::{Digest, Sha256};

    #[test]
    fn drain_appends_grace_only_when_asked() {
        let base = "kubectl drain \"$(hostname)\" --ignore-daemonsets";
        let t = Duration::from_secs(600);
        assert_eq!(
            drain_command(base, Duration::ZERO, t),
            format!("{base} --timeout=600s"),
            "0 = the pods' own grace"
        );
        assert_eq!(
            drain_command(base, Duration::from_secs(30), t),
            format!("{base} --grace-period=30 --timeout=600s")
        );
        assert_eq!(
            drain_command(base, Duration::from_millis(400), Duration::ZERO),
            format!("{base} --timeout=1s"),
            "sub-second grace rounds to unset; the timeout is at least 1s"
        );
    }

    /// The join script itself, run by a real `/bin/sh` on the files as
    /// the chunked write leaves them.
    #[test]
    fn the_join_appends_the_parts_in_order_and_removes_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bootstrap");
        let path = path.to_str().unwrap();
        let blob: Vec<u8> = (0..(CHUNK_RAW * 2 + 100))
            .map(|i| (i % 251) as u8)
            .collect();
        let chunks: Vec<&[u8]> = blob.chunks(CHUNK_RAW).collect();
        std::fs::write(path, chunks[0]).unwrap();
        let parts: Vec<String> = (1..chunks.len()).map(|i| part_path(path, i)).collect();
        for (part, chunk) in parts.iter().zip(&chunks[1..]) {
            std::fs::write(part, chunk).unwrap();
        }
        let run = |argv: Vec<String>| {
            std::process::Command::new(&argv[0])
                .args(&argv[1..])
                .output()
                .unwrap()
        };
        let out = run(join_argv(path, &parts));
        assert!(out.status.success(), "{out:?}");
        assert_eq!(std::fs::read(path).unwrap(), blob);
        let printed = String::from_utf8_lossy(&out.stdout);
        assert!(
            printed.starts_with(&hex::encode(Sha256::digest(&blob))),
            "{printed}"
        );
        let left = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(left, 1, "only the blob is left");

        // A missing part fails the join and leaves no piece of the blob.
        std::fs::write(path, chunks[0]).unwrap();
        std::fs::write(&parts[1], chunks[2]).unwrap();
        let out = run(join_argv(path, &parts));
        assert!(!out.status.success());
        let left = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(left, 0, "no piece of the blob is left behind");
    }

    /// The Configure command (name, read-back, hook) run by a real
    /// `/bin/sh` with a `hostname` of the test's own on `PATH`, and its
    /// output cut into the naming part and the hook's.
    #[test]
    fn the_configure_command_names_the_guest_before_it_starts_the_hook() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path();
        let name_file = bin.join("name");
        let fake_hostname = |script: &str| {
            std::fs::write(bin.join("hostname"), script).unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(bin.join("hostname"), std::fs::Permissions::from_mode(0o755))
                .unwrap();
        };
        fake_hostname(&format!(
            "#!/bin/sh\nif [ -n \"$1\" ]; then printf '%s\\n' \"$1\" > {f}; else cat {f}; fi\n",
            f = name_file.display()
        ));
        let path = format!("{}:/usr/bin:/bin", bin.display());
        let hook: Vec<String> = [
            "/bin/sh",
            "-c",
            "echo \"hook $BIGFLEET_NODE_NAME $1\"; exit 5",
            "hook",
            "/run/blob",
        ]
        .map(String::from)
        .to_vec();
        let run = |cmd: &str| {
            let argv = configure_argv("node-7", cmd, &hook);
            let out = std::process::Command::new(&argv[0])
                .args(&argv[1..])
                .env("PATH", &path)
                .output()
                .unwrap();
            ExecStatus {
                exited: true,
                exitcode: out.status.code().map(i64::from),
                out_data: Some(String::from_utf8_lossy(&out.stdout).into_owned()),
                err_data: Some(String::from_utf8_lossy(&out.stderr).into_owned()),
                ..ExecStatus::default()
            }
        };
        // Named, read back, then the hook, with the node name and the blob.
        std::fs::write(&name_file, "template\n").unwrap();
        let st = run("echo renaming; hostname \"$BIGFLEET_NODE_NAME\"");
        let (named, hook_st) = split_configure(&st);
        let named_out = named.out_data.clone().unwrap_or_default();
        assert!(named_out.starts_with("renaming\n"), "{named_out}");
        assert_eq!(read_back_hostname(&named_out), Some(Ok("node-7".into())));
        let hook_st = hook_st.expect("the hook ran");
        assert_eq!(hook_st.out_data.as_deref(), Some("hook node-7 /run/blob\n"));
        assert_eq!(hook_st.exitcode, Some(5), "the hook's own status");
        // Another name (letter case aside) runs no hook.
        std::fs::write(&name_file, "template\n").unwrap();
        let st = run("");
        assert_eq!(st.exitcode, Some(0));
        let (named, hook_st) = split_configure(&st);
        assert!(hook_st.is_none(), "{st:?}");
        assert_eq!(
            read_back_hostname(named.out_data.as_deref().unwrap_or_default()),
            Some(Ok("template".into()))
        );
        std::fs::write(&name_file, "NODE-7\n").unwrap();
        assert!(split_configure(&run("")).1.is_some(), "NODE-7 is node-7");
        // A failing hostname command ends it with its status: no read-back.
        let st = run("echo nope >&2; exit 3");
        assert_eq!(st.exitcode, Some(3));
        assert_eq!(st.err_data.as_deref(), Some("nope\n"));
        let (named, hook_st) = split_configure(&st);
        assert!(hook_st.is_none());
        assert_eq!(
            read_back_hostname(named.out_data.as_deref().unwrap_or_default()),
            None
        );
        // A failing `hostname` is reported with its status and words.
        fake_hostname("#!/bin/sh\necho broken >&2\nexit 4\n");
        let st = run("");
        let (named, hook_st) = split_configure(&st);
        assert!(hook_st.is_none());
        assert_eq!(
            read_back_hostname(named.out_data.as_deref().unwrap_or_default()),
            Some(Err("exit 4: broken".into()))
        );
        // Only the last read-back counts: the command cannot speak for the guest.
        assert_eq!(
            read_back_hostname("bigfleet-configure:0:fake\nbigfleet-configure:0:real\n"),
            Some(Ok("real".into()))
        );
    }

    #[test]
    fn exec_errors_quote_exit_and_stderr_tail() {
        let st = ExecStatus {
            exited: true,
            exitcode: Some(3),
            err_data: Some(format!("{}boom\n", "x".repeat(2000))),
            err_truncated: true,
            ..ExecStatus::default()
        };
        let e = exec_outcome("hook", &st).unwrap_err().to_string();
        assert!(e.starts_with("hook exited 3: stderr: "), "{e}");
        assert!(e.contains("boom") && e.contains("truncated"), "{e}");
        assert!(e.len() < 700, "{}", e.len());
        let ok = ExecStatus {
            exited: true,
            exitcode: Some(0),
            ..ExecStatus::default()
        };
        assert!(exec_outcome("hook", &ok).is_ok());
        let sig = ExecStatus {
            exited: true,
            signal: Some(9),
            ..ExecStatus::default()
        };
        assert!(exec_outcome("hook", &sig)
            .unwrap_err()
            .to_string()
            .contains("signal 9"));
    }
}
