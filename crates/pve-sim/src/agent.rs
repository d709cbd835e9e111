//! Built-in guest agent: file-write and exec against a per-VM scratch directory
//! standing in for the guest's `/`, plus test-provided command handlers that model
//! what the guest image lacks (e.g. `kubectl`).

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use parking_lot::RwLock;
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::task::AbortHandle;

use crate::guest_root::{guest_path_env, GUEST_ROOT_ENV};
use crate::qga::QgaProcess;

/// An exec request as a guest handler sees it.
#[derive(Clone, Debug)]
pub struct GuestExec {
    pub vmid: u32,
    pub node: String,
    pub command: Vec<String>,
    pub input: Option<Vec<u8>>,
    /// The VM's scratch root (its `/`).
    pub root: PathBuf,
}

impl GuestExec {
    /// argv joined with spaces, handy for substring predicates.
    pub fn command_line(&self) -> String {
        self.command.join(" ")
    }
}

/// What a handled command "did" in the guest.
#[derive(Clone, Debug, Default)]
pub struct GuestOutput {
    pub exitcode: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// How long the command runs before exiting.
    pub delay: Duration,
}

impl GuestOutput {
    pub fn exit(code: i32) -> Self {
        Self {
            exitcode: code,
            ..Self::default()
        }
    }

    pub fn with_stdout(mut self, s: impl Into<Vec<u8>>) -> Self {
        self.stdout = s.into();
        self
    }

    pub fn with_stderr(mut self, s: impl Into<Vec<u8>>) -> Self {
        self.stderr = s.into();
        self
    }

    pub fn with_delay(mut self, d: Duration) -> Self {
        self.delay = d;
        self
    }
}

/// Returns `Some` to handle a command instead of running it as a process.
pub type GuestHandler = Arc<dyn Fn(&GuestExec) -> Option<GuestOutput> + Send + Sync>;

/// Ordered handlers; the first that returns `Some` wins.
#[derive(Default)]
pub struct GuestHandlers(RwLock<Vec<GuestHandler>>);

impl GuestHandlers {
    pub fn set(&self, h: GuestHandler) {
        *self.0.write() = vec![h];
    }

    pub fn add(&self, h: GuestHandler) {
        self.0.write().push(h);
    }

    pub fn clear(&self) {
        self.0.write().clear();
    }

    pub fn handle(&self, e: &GuestExec) -> Option<GuestOutput> {
        let handlers = self.0.read().clone();
        handlers.iter().find_map(|h| h(e))
    }
}

/// Result of a finished exec, as qemu-ga reports it.
#[derive(Clone, Debug, Default)]
pub struct ExecResult {
    pub exitcode: Option<i32>,
    pub signal: Option<i32>,
    pub out: Vec<u8>,
    pub err: Vec<u8>,
    pub out_truncated: bool,
    pub err_truncated: bool,
}

impl ExecResult {
    pub fn from_output(o: &GuestOutput, limit: usize) -> Self {
        let (out, out_truncated) = cap(&o.stdout, limit);
        let (err, err_truncated) = cap(&o.stderr, limit);
        Self {
            exitcode: Some(o.exitcode),
            signal: None,
            out,
            err,
            out_truncated,
            err_truncated,
        }
    }

    /// From a `guest-exec-status` reply with `exited: true`, decoding the
    /// base64 streams (PVE does too) and capping them at `limit` bytes.
    pub fn from_qga(v: &Value, limit: usize) -> Result<Self, String> {
        let stream = |data: &str, trunc: &str| -> Result<(Vec<u8>, bool), String> {
            let raw = match v[data].as_str() {
                Some(b64) => base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .map_err(|e| format!("qemu-ga sent invalid {data}: {e}"))?,
                None => Vec::new(),
            };
            let (b, capped) = cap(&raw, limit);
            Ok((b, capped || v[trunc].as_bool().unwrap_or(false)))
        };
        let (out, out_truncated) = stream("out-data", "out-truncated")?;
        let (err, err_truncated) = stream("err-data", "err-truncated")?;
        let int = |k: &str| v[k].as_i64().and_then(|n| i32::try_from(n).ok());
        Ok(Self {
            exitcode: int("exitcode"),
            signal: int("signal"),
            out,
            err,
            out_truncated,
            err_truncated,
        })
    }

    /// The reply PVE builds. With `latin1` (PVE's way: the decoded bytes go
    /// into the JSON one character per byte, qemu-server `Agent.pm`) each
    /// output byte becomes the character of that code point; without, the
    /// output is read as UTF-8.
    pub fn to_json(&self, latin1: bool) -> Value {
        let text = |b: &[u8]| -> String {
            if latin1 {
                b.iter().map(|&b| char::from(b)).collect()
            } else {
                String::from_utf8_lossy(b).into_owned()
            }
        };
        let mut v = json!({"exited": 1});
        if let Some(c) = self.exitcode {
            v["exitcode"] = json!(c);
        }
        if let Some(s) = self.signal {
            v["signal"] = json!(s);
        }
        if !self.out.is_empty() {
            v["out-data"] = json!(text(&self.out));
        }
        if !self.err.is_empty() {
            v["err-data"] = json!(text(&self.err));
        }
        if self.out_truncated {
            v["out-truncated"] = json!(1);
        }
        if self.err_truncated {
            v["err-truncated"] = json!(1);
        }
        v
    }
}

fn cap(b: &[u8], limit: usize) -> (Vec<u8>, bool) {
    if b.len() > limit {
        (b[..limit].to_vec(), true)
    } else {
        (b.to_vec(), false)
    }
}

pub enum ExecSlot {
    Running(AbortHandle),
    Exited(ExecResult),
    /// Forwarded to qemu-ga, which knows it by this pid.
    Remote(i64),
}

/// Per-VM agent state; dropped (killing running commands and the VM's qemu-ga)
/// when the VM stops.
pub struct AgentState {
    pub next_pid: u64,
    pub procs: HashMap<u64, ExecSlot>,
    /// The VM's qemu-ga when forwarding, started on first agent use after boot.
    pub qga: Option<Arc<QgaProcess>>,
}

impl Default for AgentState {
    fn default() -> Self {
        Self {
            next_pid: 4000,
            procs: HashMap::new(),
            qga: None,
        }
    }
}

impl Drop for AgentState {
    fn drop(&mut self) {
        for slot in self.procs.values() {
            if let ExecSlot::Running(h) = slot {
                h.abort();
            }
        }
        // Kill now rather than when the last in-flight call lets go of the Arc.
        if let Some(q) = &self.qga {
            q.kill();
        }
    }
}

/// Map a guest path into the scratch root; `..` may not climb out of it.
pub fn guest_path(root: &Path, file: &str) -> Result<PathBuf, String> {
    let mut out = root.to_path_buf();
    for c in Path::new(file).components() {
        match c {
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
            Component::Normal(p) => out.push(p),
            Component::ParentDir => {
                if out == root || !out.pop() {
                    return Err(format!("path '{file}' escapes the guest root"));
                }
            }
        }
    }
    Ok(out)
}

/// Absolute args naming something that exists in the guest root point there instead.
pub(crate) fn map_args(root: &Path, command: &[String]) -> Vec<String> {
    command
        .iter()
        .map(|a| {
            if a.starts_with('/') {
                if let Ok(p) = guest_path(root, a) {
                    if p != root && p.exists() {
                        return p.to_string_lossy().into_owned();
                    }
                }
            }
            a.clone()
        })
        .collect()
}

/// Start `command` as a real process confined (by cwd and env) to `root`.
/// Spawn errors surface synchronously, as qemu-ga's guest-exec reports them.
pub fn spawn_process(e: &GuestExec) -> Result<tokio::process::Child, String> {
    let argv = map_args(&e.root, &e.command);
    let Some((prog, args)) = argv.split_first() else {
        return Err("Guest agent command failed, error was 'empty command'".into());
    };
    let mut cmd = tokio::process::Command::new(prog);
    cmd.args(args)
        .current_dir(&e.root)
        .env(GUEST_ROOT_ENV, &e.root)
        .env("PATH", guest_path_env(&e.root))
        .stdin(if e.input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd.spawn().map_err(|err| {
        format!("Guest agent command failed, error was 'Failed to execute child process \u{201c}{prog}\u{201d} ({err})'")
    })
}

/// Feed stdin, wait for exit and capture output up to `limit` bytes per stream.
pub async fn collect(
    mut child: tokio::process::Child,
    input: Option<Vec<u8>>,
    limit: usize,
) -> Result<ExecResult, String> {
    if let (Some(input), Some(mut stdin)) = (input, child.stdin.take()) {
        // Feed stdin concurrently so a child that writes before reading cannot deadlock us.
        tokio::spawn(async move {
            let _ = stdin.write_all(&input).await; // child may exit without reading: not an error
        });
    }
    let output = child
        .wait_with_output()
        .await
        .map_err(|err| format!("waiting for guest command: {err}"))?;
    let (out, out_truncated) = cap(&output.stdout, limit);
    let (err, err_truncated) = cap(&output.stderr, limit);
    use std::os::unix::process::ExitStatusExt;
    Ok(ExecResult {
        exitcode: output.status.code(),
        signal: output.status.signal(),
        out,
        err,
        out_truncated,
        err_truncated,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_paths_stay_inside_root() {
        let root = Path::new("/scratch/vm-101");
        assert_eq!(
            guest_path(root, "/run/x").unwrap(),
            Path::new("/scratch/vm-101/run/x")
        );
        assert_eq!(
            guest_path(root, "a/../b").unwrap(),
            Path::new("/scratch/vm-101/b")
        );
        assert!(guest_path(root, "/../etc/passwd").is_err());
    }
}
