//! Work inside the guest through the qemu guest agent: waiting for it,
//! chunked file writes and command execution with exit status and output.

use std::time::Duration;

use base64::Engine as _;
use pve::{ExecStatus, FileEncoding, PveError};
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use super::{err, PveSubstrate};
use providerkit::ErrorKind;

use crate::redact::{Redactor, REDACTED};
use crate::substrate::{SubstrateError, VmRef};

/// Raw bytes per file-write / exec chunk: 36 KiB base64-encodes to 48 KiB, which
/// stays under the 60 KiB `content` limit and (form-encoded) under the 64 KiB
/// request body limit of older PVE releases.
pub(super) const CHUNK_RAW: usize = 36 * 1024;

/// Bytes of stderr/stdout quoted in an error.
pub(super) const OUTPUT_TAIL: usize = 512;

/// Why a guest command produced no exit status.
#[derive(Clone, Debug, thiserror::Error)]
pub(super) enum ExecError {
    #[error(transparent)]
    Api(#[from] PveError),
    #[error("guest pid {pid} was still running after {timeout:?}")]
    Deadline { pid: u32, timeout: Duration },
    #[error(
        "the exit status of guest pid {pid} was lost: the agent's answer failed ({first}) and \
         qemu-ga forgets a pid once it has reported its exit, so success cannot be confirmed"
    )]
    Lost { pid: u32, first: String },
}

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
    exec_outcome_redacted(what, st, &[])
}

/// [`exec_outcome`] for a command that saw `secret` (the bootstrap blob):
/// every piece of it is cut from the quoted output before the tail is taken
/// (see [`crate::redact`]), and the error says so.
pub(super) fn exec_outcome_redacted(
    what: &str,
    st: &ExecStatus,
    secret: &[u8],
) -> Result<(), SubstrateError> {
    exec_outcome_with(what, st, &Redactor::new(secret))
}

/// [`exec_outcome_redacted`] with a redactor built once.
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

impl ExecError {
    pub(super) fn kind(&self) -> ErrorKind {
        match self {
            ExecError::Api(e) => super::kind_of(e),
            // The command may still be running or may have finished: not
            // safely retried.
            ExecError::Deadline { .. } | ExecError::Lost { .. } => ErrorKind::Permanent,
        }
    }
}

/// `{context}: {e}` for a guest command that produced no exit status.
pub(super) fn exec_err(context: impl std::fmt::Display, e: &ExecError) -> SubstrateError {
    SubstrateError::caused_by(e.kind(), context, e.clone())
}

impl PveSubstrate {
    /// Pings the agent until it answers, polling through boot-time failures.
    pub(super) async fn wait_agent(&self, vm: &VmRef) -> Result<(), SubstrateError> {
        let deadline = Instant::now() + self.opts.agent_timeout;
        loop {
            match self.client.agent_ping(&vm.node, vm.vmid).await {
                Ok(()) => {
                    tracing::info!(vm = %vm, "guest agent up");
                    return Ok(());
                }
                Err(e) if e.is_agent_transient() => {
                    if Instant::now() >= deadline {
                        return Err(SubstrateError::new(format!(
                            "the guest agent of VM {vm} did not answer within {:?} (last error: {e}); is qemu-guest-agent installed and enabled in the template?",
                            self.opts.agent_timeout
                        )));
                    }
                }
                Err(e) => return Err(err(format!("pinging the guest agent of VM {vm}"), &e)),
            }
            tokio::time::sleep(self.opts.poll_interval).await;
        }
    }

    /// Runs `argv` in the guest and waits for it to exit (bounded by `timeout`).
    pub(super) async fn run(
        &self,
        vm: &VmRef,
        argv: &[String],
        input: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<ExecStatus, ExecError> {
        let pid = self
            .client
            .agent_exec(&vm.node, vm.vmid, argv, input)
            .await?;
        let deadline = Instant::now() + timeout;
        let mut delay = self.first_poll();
        let mut dropped: Option<String> = None;
        loop {
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(self.opts.poll_interval);
            match self.client.agent_exec_status(&vm.node, vm.vmid, pid).await {
                Ok(st) if st.exited => return Ok(st),
                Ok(_) => {}
                // The reply carrying the exit was lost and qemu-ga has forgotten the pid.
                Err(e) if dropped.is_some() && e.is_unknown_pid() => {
                    return Err(ExecError::Lost {
                        pid,
                        first: dropped.unwrap_or_default(),
                    })
                }
                Err(e) if e.is_agent_transient() && Instant::now() < deadline => {
                    dropped = Some(e.to_string());
                }
                Err(e) => return Err(e.into()),
            }
            if Instant::now() >= deadline {
                return Err(ExecError::Deadline { pid, timeout });
            }
        }
    }

    /// Delivers the blob to `path`: one file-write when small, else a first
    /// file-write plus appends through `base64 -d`, verified by sha256.
    pub(super) async fn write_blob(
        &self,
        vm: &VmRef,
        path: &str,
        blob: &[u8],
    ) -> Result<(), SubstrateError> {
        let ctx = || {
            format!(
                "writing the bootstrap blob ({} bytes) to {path} in VM {vm}",
                blob.len()
            )
        };
        let mut chunks = blob.chunks(CHUNK_RAW);
        let first = chunks.next().unwrap_or_default();
        self.client
            .agent_file_write(&vm.node, vm.vmid, path, first, FileEncoding::Base64)
            .await
            .map_err(|e| err(ctx(), &e))?;
        if blob.len() <= CHUNK_RAW {
            return Ok(());
        }
        let append: Vec<String> = vec![
            "/bin/sh".into(),
            "-c".into(),
            "base64 -d >> \"$1\"".into(),
            "bigfleet-append".into(),
            path.into(),
        ];
        for chunk in chunks {
            let b64 = base64::engine::general_purpose::STANDARD.encode(chunk);
            let st = self
                .run(vm, &append, Some(b64.as_bytes()), self.opts.exec_timeout)
                .await
                .map_err(|e| exec_err(ctx(), &e))?;
            exec_outcome_redacted("appending a bootstrap chunk", &st, blob)
                .map_err(|e| SubstrateError::new(format!("{}: {e}", ctx())))?;
        }
        let want = hex::encode(Sha256::digest(blob));
        let st = self
            .run(
                vm,
                &["sha256sum".to_string(), path.to_string()],
                None,
                self.opts.exec_timeout,
            )
            .await
            .map_err(|e| exec_err(ctx(), &e))?;
        exec_outcome_redacted("sha256sum", &st, blob)
            .map_err(|e| SubstrateError::new(format!("{}: {e}", ctx())))?;
        let got = st
            .out_data
            .as_deref()
            .and_then(|o| o.split_whitespace().next())
            .unwrap_or_default();
        if !got.eq_ignore_ascii_case(&want) {
            return Err(SubstrateError::new(format!(
                "{}: checksum mismatch after the chunked upload (guest has sha256 {got:?})",
                ctx()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
