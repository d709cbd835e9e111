//! Forwarding to a real `qemu-ga`: one process per running VM, listening on a
//! unix socket inside the VM's scratch root, plus a small client for the QGA
//! JSON protocol (sync with `guest-sync-delimited`, then one command per line).

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use base64::Engine;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

use crate::guest_root::{guest_path_env, GUEST_ROOT_ENV};

/// How long qemu-ga may take to answer one command (PVE gives up with "got timeout").
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a freshly spawned qemu-ga may take to listen on its socket.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(10);
/// `sun_path` holds 108 bytes including the NUL.
const MAX_SOCKET_PATH: usize = 107;

/// RPCs that act on the host rather than on files and processes; the simulator
/// never sends them, and blocking them keeps a stray client from doing so.
const BLOCKED_RPCS: &str = "guest-shutdown,guest-set-time,guest-fsfreeze-freeze,\
guest-fsfreeze-freeze-list,guest-fsfreeze-thaw,guest-fstrim,guest-suspend-disk,\
guest-suspend-ram,guest-suspend-hybrid,guest-set-vcpus,guest-set-user-password,\
guest-set-memory-blocks,guest-ssh-add-authorized-keys,guest-ssh-remove-authorized-keys";

/// What went wrong talking to qemu-ga.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QgaErrorKind {
    /// qemu-ga answered `{"error": {"class", "desc"}}`.
    Agent { class: String, desc: String },
    /// No answer in time.
    Timeout,
    /// Socket or protocol trouble.
    Io(String),
}

/// A failed QGA command, named like PVE names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QgaError {
    pub command: String,
    pub kind: QgaErrorKind,
}

impl QgaError {
    fn new(command: &str, kind: QgaErrorKind) -> Self {
        Self {
            command: command.to_string(),
            kind,
        }
    }

    fn io(command: &str, msg: impl Into<String>) -> Self {
        Self::new(command, QgaErrorKind::Io(msg.into()))
    }

    /// The text PVE puts after `qmp command '...' failed - `: qemu-ga's `desc`,
    /// or `got timeout` when the agent did not answer (a dead socket looks the
    /// same to PVE; the cause is kept in parentheses).
    pub fn pve_text(&self) -> String {
        match &self.kind {
            QgaErrorKind::Agent { desc, .. } => desc.clone(),
            QgaErrorKind::Timeout => "got timeout".into(),
            QgaErrorKind::Io(e) => format!("got timeout ({e})"),
        }
    }

    /// Whether the connection is unusable afterwards.
    fn breaks_connection(&self) -> bool {
        !matches!(self.kind, QgaErrorKind::Agent { .. })
    }
}

impl fmt::Display for QgaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "qmp command '{}' failed - {}",
            self.command,
            self.pve_text()
        )
    }
}

impl std::error::Error for QgaError {}

/// One client connection to a qemu-ga socket.
pub struct QgaConn {
    s: BufReader<UnixStream>,
}

impl QgaConn {
    pub async fn connect(sock: &Path) -> std::io::Result<Self> {
        Ok(Self {
            s: BufReader::new(UnixStream::connect(sock).await?),
        })
    }

    /// Resynchronise before a command: the leading 0xFF resets qemu-ga's parser
    /// and its reply to `guest-sync-delimited` starts with 0xFF, so whatever
    /// precedes it (stale replies, the parse error for our 0xFF) is skipped.
    /// `command` names the command this sync is for, for errors.
    pub async fn sync(&mut self, command: &str) -> Result<(), QgaError> {
        let id = u64::from(rand::random::<u32>());
        let mut msg = vec![0xFF];
        msg.extend(
            json!({"execute": "guest-sync-delimited", "arguments": {"id": id}})
                .to_string()
                .into_bytes(),
        );
        msg.push(b'\n');
        let fut = async {
            self.write(command, &msg).await?;
            loop {
                let mut skipped = Vec::new();
                self.s
                    .read_until(0xFF, &mut skipped)
                    .await
                    .map_err(|e| QgaError::io(command, format!("reading sync reply: {e}")))?;
                if skipped.last() != Some(&0xFF) {
                    return Err(QgaError::io(command, "qemu-ga closed the connection"));
                }
                let v = self.read_json(command).await?;
                if v.get("return").and_then(Value::as_u64) == Some(id) {
                    return Ok(());
                }
                // A delayed reply to an earlier sync: keep looking for ours.
            }
        };
        tokio::time::timeout(REPLY_TIMEOUT, fut)
            .await
            .map_err(|_| QgaError::new(command, QgaErrorKind::Timeout))?
    }

    /// Send one command and read its reply; `{"error": ...}` becomes
    /// [`QgaErrorKind::Agent`]. `args` may be `Value::Null` for none.
    pub async fn call(&mut self, command: &str, args: Value) -> Result<Value, QgaError> {
        let mut msg = json!({"execute": command});
        if !args.is_null() {
            msg["arguments"] = args;
        }
        let mut line = msg.to_string().into_bytes();
        line.push(b'\n');
        let fut = async {
            self.write(command, &line).await?;
            let v = self.read_json(command).await?;
            parse_reply(command, v)
        };
        tokio::time::timeout(REPLY_TIMEOUT, fut)
            .await
            .map_err(|_| QgaError::new(command, QgaErrorKind::Timeout))?
    }

    async fn write(&mut self, command: &str, bytes: &[u8]) -> Result<(), QgaError> {
        let w = self.s.get_mut();
        w.write_all(bytes)
            .await
            .map_err(|e| QgaError::io(command, format!("writing to qemu-ga: {e}")))
    }

    /// One reply: qemu-ga writes each as a single JSON line.
    async fn read_json(&mut self, command: &str) -> Result<Value, QgaError> {
        let mut line = Vec::new();
        loop {
            line.clear();
            let n = self
                .s
                .read_until(b'\n', &mut line)
                .await
                .map_err(|e| QgaError::io(command, format!("reading from qemu-ga: {e}")))?;
            if n == 0 {
                return Err(QgaError::io(command, "qemu-ga closed the connection"));
            }
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            return serde_json::from_slice(&line)
                .map_err(|e| QgaError::io(command, format!("unparsable reply from qemu-ga: {e}")));
        }
    }
}

fn parse_reply(command: &str, v: Value) -> Result<Value, QgaError> {
    if let Some(e) = v.get("error") {
        return Err(QgaError::new(
            command,
            QgaErrorKind::Agent {
                class: e["class"].as_str().unwrap_or("GenericError").to_string(),
                desc: e["desc"].as_str().unwrap_or_default().to_string(),
            },
        ));
    }
    match v.get("return") {
        Some(r) => Ok(r.clone()),
        None => Err(QgaError::io(
            command,
            format!("unexpected reply from qemu-ga: {v}"),
        )),
    }
}

enum ChildState {
    Running(Child),
    /// Exited on its own (reaped while checking); the text says how.
    Exited(String),
    /// Killed by the simulator.
    Killed,
}

/// A `qemu-ga` serving one simulated VM. It runs in its own process group with
/// its current directory and `$BIGFLEET_GUEST_ROOT` set to the VM's scratch root,
/// so commands it starts land there; [`QgaProcess::kill`] (also on drop) kills
/// the group and reaps qemu-ga.
pub struct QgaProcess {
    pid: u32,
    sock: PathBuf,
    log: PathBuf,
    child: parking_lot::Mutex<ChildState>,
    /// qemu-ga serves one client at a time, so calls take turns on one connection.
    conn: tokio::sync::Mutex<Option<QgaConn>>,
}

impl QgaProcess {
    /// Start `bin` for the guest rooted at `root` (which must exist). Its socket,
    /// state dir and log live in `<root>/run/qemu-ga/`.
    #[allow(unsafe_code)] // libc call; see the SAFETY note inside
    pub fn spawn(bin: &Path, root: &Path) -> Result<Self, String> {
        let root = std::path::absolute(root)
            .map_err(|e| format!("resolving guest root {}: {e}", root.display()))?;
        let dir = root.join("run").join("qemu-ga");
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("creating qemu-ga state dir {}: {e}", dir.display()))?;
        let sock = dir.join("qga.sock");
        if sock.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(format!(
                "qemu-ga socket path {} is longer than a unix socket allows ({MAX_SOCKET_PATH} bytes): use a shorter scratch dir",
                sock.display()
            ));
        }
        match std::fs::remove_file(&sock) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("removing stale socket {}: {e}", sock.display())),
        }
        let log = dir.join("qemu-ga.log");
        use std::os::unix::process::CommandExt;
        let mut child = Command::new(bin);
        child
            .arg("--method=unix-listen")
            .arg("--path")
            .arg(&sock)
            .arg("--statedir")
            .arg(&dir)
            .arg("--pidfile")
            .arg(dir.join("qemu-ga.pid"))
            .arg("--logfile")
            .arg(&log)
            .arg("--block-rpcs")
            .arg(BLOCKED_RPCS)
            .current_dir(&root)
            .env(GUEST_ROOT_ENV, &root)
            // What qemu-ga starts inherits it: the guest's programs first.
            .env("PATH", guest_path_env(&root))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // Own group, so a stop can kill what the guest started too.
            .process_group(0);
        // SAFETY: prctl only sets an attribute of the new process; nothing
        // else runs between fork and exec here. Backstop for a simulator
        // that dies without running its shutdown (SIGKILL): the kernel then
        // kills qemu-ga instead of leaving it orphaned. The spawning thread
        // is a runtime worker, which lives as long as the simulator.
        let child = unsafe {
            child.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            })
        }
        .spawn()
        .map_err(|e| format!("starting {}: {e}", bin.display()))?;
        Ok(Self {
            pid: child.id(),
            sock,
            log,
            child: parking_lot::Mutex::new(ChildState::Running(child)),
            conn: tokio::sync::Mutex::new(None),
        })
    }

    /// OS pid of qemu-ga.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn socket(&self) -> &Path {
        &self.sock
    }

    /// Whether qemu-ga is still running (neither exited nor killed).
    pub fn is_running(&self) -> bool {
        self.check_exited().is_none()
    }

    /// `Some(reason)` once qemu-ga is gone; reaps it if it exited on its own.
    fn check_exited(&self) -> Option<String> {
        let mut st = self.child.lock();
        match &mut *st {
            ChildState::Running(c) => match c.try_wait() {
                Ok(None) => None,
                Ok(Some(status)) => {
                    let tail = log_tail(&self.log);
                    let why = format!("qemu-ga exited ({status}){tail}");
                    *st = ChildState::Exited(why.clone());
                    Some(why)
                }
                Err(e) => Some(format!("checking qemu-ga: {e}")),
            },
            ChildState::Exited(why) => Some(why.clone()),
            ChildState::Killed => Some("qemu-ga was stopped with its VM".into()),
        }
    }

    /// Kill qemu-ga and its process group, then reap it off-thread.
    #[allow(unsafe_code)] // libc call; see the SAFETY note inside
    pub fn kill(&self) {
        let st = std::mem::replace(&mut *self.child.lock(), ChildState::Killed);
        let ChildState::Running(mut child) = st else {
            return;
        };
        let pgid = libc::pid_t::try_from(child.id()).unwrap_or(0);
        // SAFETY: kill(2) only sends a signal; a negative pid addresses the
        // process group `process_group(0)` made for this child, which cannot have
        // been reused: qemu-ga, its leader, is not reaped yet.
        let grouped = pgid > 0 && unsafe { libc::kill(-pgid, libc::SIGKILL) } == 0;
        if !grouped {
            // The group is gone, so only qemu-ga (a zombie by now) can be left.
            let _ = child.kill(); // "already exited" is the expected failure
        }
        let reap = move || {
            let _ = child.wait(); // the status of a SIGKILLed agent says nothing
        };
        let spawned = std::thread::Builder::new()
            .name("qemu-ga-reaper".into())
            .spawn(reap);
        if let Err(e) = spawned {
            tracing::warn!("cannot spawn a reaper thread ({e}); qemu-ga {pgid} stays a zombie");
        }
    }

    /// Run one operation on the (re)connected, freshly synced connection.
    async fn conn<'a>(
        &self,
        guard: &'a mut Option<QgaConn>,
        command: &str,
    ) -> Result<&'a mut QgaConn, QgaError> {
        if guard.is_none() {
            *guard = Some(self.connect(command).await?);
        }
        let Some(conn) = guard.as_mut() else {
            return Err(QgaError::io(command, "no connection"));
        };
        conn.sync(command).await?;
        Ok(conn)
    }

    /// Connect, waiting for a freshly started qemu-ga to listen. There is no
    /// event for "socket is listening", so this polls until the deadline or
    /// until qemu-ga is seen to have exited.
    async fn connect(&self, command: &str) -> Result<QgaConn, QgaError> {
        let deadline = tokio::time::Instant::now() + LISTEN_TIMEOUT;
        loop {
            if let Some(why) = self.check_exited() {
                return Err(QgaError::io(command, why));
            }
            match QgaConn::connect(&self.sock).await {
                Ok(c) => return Ok(c),
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(QgaError::io(
                        command,
                        format!("connecting to {}: {e}", self.sock.display()),
                    ))
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        }
    }

    /// Drop the connection after a transport failure so the next call reconnects.
    fn settle<T>(guard: &mut Option<QgaConn>, r: Result<T, QgaError>) -> Result<T, QgaError> {
        if let Err(e) = &r {
            if e.breaks_connection() {
                *guard = None;
            }
        }
        r
    }

    pub async fn ping(&self) -> Result<(), QgaError> {
        let mut g = self.conn.lock().await;
        let r = async {
            let c = self.conn(&mut g, "guest-ping").await?;
            c.call("guest-ping", Value::Null).await.map(|_| ())
        }
        .await;
        Self::settle(&mut g, r)
    }

    /// Truncate and write `path` (a host path inside the scratch root) the way
    /// PVE's file-write does: open, write, close.
    pub async fn file_write(&self, path: &Path, bytes: &[u8]) -> Result<(), QgaError> {
        let mut g = self.conn.lock().await;
        let r = async {
            let c = self.conn(&mut g, "guest-file-open").await?;
            let handle = c
                .call(
                    "guest-file-open",
                    json!({"path": path.to_string_lossy(), "mode": "w"}),
                )
                .await?;
            let Some(handle) = handle.as_i64() else {
                return Err(QgaError::io(
                    "guest-file-open",
                    format!("unexpected file handle {handle}"),
                ));
            };
            let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
            let written = c
                .call(
                    "guest-file-write",
                    json!({"handle": handle, "buf-b64": b64}),
                )
                .await;
            let closed = c.call("guest-file-close", json!({"handle": handle})).await;
            let count = written?;
            closed?;
            match count["count"].as_u64() {
                Some(n) if n == bytes.len() as u64 => Ok(()),
                other => Err(QgaError::io(
                    "guest-file-write",
                    format!("short write: {other:?} of {} bytes", bytes.len()),
                )),
            }
        }
        .await;
        Self::settle(&mut g, r)
    }

    /// `guest-exec` with captured output; returns qemu-ga's pid for the command.
    pub async fn exec(&self, argv: &[String], input: Option<&[u8]>) -> Result<i64, QgaError> {
        let Some((path, args)) = argv.split_first() else {
            return Err(QgaError::io("guest-exec", "empty command"));
        };
        let mut a = json!({"path": path, "arg": args, "capture-output": true});
        if let Some(input) = input {
            a["input-data"] = json!(base64::engine::general_purpose::STANDARD.encode(input));
        }
        let mut g = self.conn.lock().await;
        let r = async {
            let c = self.conn(&mut g, "guest-exec").await?;
            let ret = c.call("guest-exec", a).await?;
            ret["pid"]
                .as_i64()
                .ok_or_else(|| QgaError::io("guest-exec", format!("reply without pid: {ret}")))
        }
        .await;
        Self::settle(&mut g, r)
    }

    /// Raw `guest-exec-status` reply for qemu-ga's `pid`.
    pub async fn exec_status(&self, pid: i64) -> Result<Value, QgaError> {
        let mut g = self.conn.lock().await;
        let r = async {
            let c = self.conn(&mut g, "guest-exec-status").await?;
            c.call("guest-exec-status", json!({"pid": pid})).await
        }
        .await;
        Self::settle(&mut g, r)
    }
}

impl Drop for QgaProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Last lines of qemu-ga's log, to explain an early exit.
fn log_tail(log: &Path) -> String {
    match std::fs::read_to_string(log) {
        Ok(s) if !s.trim().is_empty() => {
            let lines: Vec<&str> = s.lines().collect();
            let start = lines.len().saturating_sub(5);
            format!(": {}", lines[start..].join(" | "))
        }
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_keep_qemu_ga_desc_and_map_silence_to_timeout() {
        let e = parse_reply(
            "guest-exec-status",
            json!({"error": {"class": "GenericError", "desc": "Invalid parameter 'pid'"}}),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "qmp command 'guest-exec-status' failed - Invalid parameter 'pid'"
        );
        assert!(!e.breaks_connection());
        let t = QgaError::new("guest-ping", QgaErrorKind::Timeout);
        assert_eq!(t.pve_text(), "got timeout");
        assert!(t.breaks_connection());
        assert_eq!(
            parse_reply("guest-ping", json!({"return": {}})).unwrap(),
            json!({})
        );
        assert!(parse_reply("guest-ping", json!({"what": 1})).is_err());
    }
}
