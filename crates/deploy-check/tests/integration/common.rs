//! What several of these checks share: fields read from the workspace
//! itself, the processes they start (the built provider, pve-sim), awaited
//! by the lines they print rather than by sleeping, and a fake Proxmox VE
//! node for the host setup script.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use deploy_check::tools::provider_binary;
use deploy_check::workspace_root;

/// A `[workspace.package]` field of the root Cargo.toml (`version`,
/// `license`): what the image labels and the chart must agree with.
pub fn workspace_package_field(key: &str) -> String {
    let cargo = std::fs::read_to_string(workspace_root().join("Cargo.toml"))
        .unwrap_or_else(|e| panic!("the workspace Cargo.toml: {e}"));
    cargo
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key} = ")))
        .map(|v| v.trim_matches('"').to_owned())
        .unwrap_or_else(|| panic!("the workspace Cargo.toml has no `{key} = ` line"))
}

/// How long a started process may take to print the line it is awaited by:
/// generous, as CI shares two cores between several builds.
pub const START_WITHIN: Duration = Duration::from_secs(60);

/// A process a test started, its stdout and stderr read line by line as
/// they come; killed when dropped.
pub struct Running {
    child: Option<Child>,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
    /// The command line, for messages.
    pub what: String,
}

/// Sends each line of `pipe` to `tx` until the pipe closes.
fn forward(pipe: impl Read + Send + 'static, tx: mpsc::Sender<String>) {
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
}

impl Running {
    /// Starts `program` with `args`, stdin closed.
    pub fn spawn(program: &Path, args: &[String]) -> Running {
        let what = format!("{} {}", program.display(), args.join(" "));
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting `{what}`: {e}"));
        let (tx, lines) = mpsc::channel();
        forward(child.stdout.take().expect("piped stdout"), tx.clone());
        forward(child.stderr.take().expect("piped stderr"), tx);
        Running {
            child: Some(child),
            lines,
            seen: Vec::new(),
            what,
        }
    }

    /// The first line (from now on) for which `wanted` holds; or, when the
    /// process closed its output or `within` passed first, everything it
    /// printed.
    pub fn wait_for(
        &mut self,
        within: Duration,
        wanted: impl Fn(&str) -> bool,
    ) -> Result<String, String> {
        let deadline = Instant::now() + within;
        loop {
            match self
                .lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if wanted(&line) {
                        return Ok(line);
                    }
                }
                Err(e) => {
                    let why = match e {
                        mpsc::RecvTimeoutError::Timeout => format!("not within {within:?}"),
                        mpsc::RecvTimeoutError::Disconnected => "it exited".to_owned(),
                    };
                    return Err(format!("`{}` ({why}):\n{}", self.what, self.seen()));
                }
            }
        }
    }

    /// Everything the process printed so far that was read.
    pub fn seen(&self) -> String {
        self.seen.join("\n")
    }

    /// Sends SIGTERM and awaits the exit, for at most `within` (then it is
    /// killed and the test fails).
    pub fn terminate(mut self, within: Duration) -> ExitStatus {
        let mut child = self.child.take().expect("a running child");
        let pid = child.id().to_string();
        let sent = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill -TERM {pid} failed: {sent}");
        let (tx, exited) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(child.wait());
        });
        match exited.recv_timeout(within) {
            Ok(status) => status.expect("wait for the process"),
            Err(_) => {
                let _ = Command::new("kill").args(["-KILL", &pid]).status();
                panic!(
                    "`{}` did not exit within {within:?} of SIGTERM:\n{}",
                    self.what,
                    self.seen()
                );
            }
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The built provider, serving.
pub struct Provider {
    pub process: Running,
    /// The gRPC listener's bound address.
    pub grpc: String,
    /// The metrics listener's bound address, when it serves one.
    pub metrics: Option<SocketAddr>,
}

/// Starts the built provider with `args` and awaits its start-up line; the
/// error is everything it printed instead.
pub fn start_provider(args: &[String]) -> Result<Provider, String> {
    let bin = provider_binary().unwrap_or_else(|e| panic!("{e}"));
    let mut process = Running::spawn(&bin, args);
    let line = process.wait_for(START_WITHIN, provider_testkit::is_startup_line)?;
    let grpc = provider_testkit::addr_field(&line, "addr")?.to_string();
    let metrics = provider_testkit::addr_field(&line, "metrics_addr").ok();
    Ok(Provider {
        process,
        grpc,
        metrics,
    })
}

/// deploy/host-setup/setup-token.sh.
pub fn setup_token_script() -> PathBuf {
    workspace_root().join("deploy/host-setup/setup-token.sh")
}

/// The fake keeps created objects as files under $FAKE_STATE and appends
/// each invocation (one argument per field, tab separated) to $FAKE_LOG.
const FAKE_PVEUM: &str = r#"#!/usr/bin/env bash
set -euo pipefail
printf '%s' "pveum" >>"$FAKE_LOG"
for a in "$@"; do printf '\t%s' "$a" >>"$FAKE_LOG"; done
printf '\n' >>"$FAKE_LOG"
exists() { [[ -e "$FAKE_STATE/$1" ]]; }
create() { touch "$FAKE_STATE/$1"; }
if [[ -n ${FAKE_FAIL_ON:-} && " $* " == *" $FAKE_FAIL_ON "* ]]; then
  echo "permission check failed (/, Permissions.Modify)" >&2; exit 2
fi
case "$1 $2" in
  "role add")
    if exists "role-$3"; then echo "role '$3' already exists" >&2; exit 255; fi
    create "role-$3" ;;
  "role modify") exists "role-$3" || { echo "role '$3' does not exist" >&2; exit 255; } ;;
  "pool add")
    if exists "pool-$3"; then echo "create pool failed: pool '$3' already exists" >&2; exit 255; fi
    create "pool-$3" ;;
  "user add")
    if exists "user-$3"; then echo "create user failed: user '$3' already exists" >&2; exit 255; fi
    create "user-$3" ;;
  "acl modify") ;;
  "user token")
    case "$3" in
      add)
        if exists "token-$4-$5"; then echo "Token already exists." >&2; exit 255; fi
        create "token-$4-$5"
        printf '{"full-tokenid":"%s!%s","info":{"privsep":"0"},"value":"11111111-2222-3333-4444-555555555555"}\n' "$4" "$5" ;;
      remove) exists "token-$4-$5" || { echo "no such token" >&2; exit 255; }; rm "$FAKE_STATE/token-$4-$5" ;;
    esac ;;
  *) echo "fake pveum: unexpected call: $*" >&2; exit 99 ;;
esac
"#;

/// A Proxmox VE node as setup-token.sh sees it: the recording `pveum` and a
/// `pveversion` reporting `pve_version`, first on its PATH.
pub struct FakePveHost {
    pub dir: tempfile::TempDir,
}

impl FakePveHost {
    pub fn new(pve_version: &str) -> FakePveHost {
        let dir = tempfile::tempdir().unwrap();
        for sub in ["bin", "state"] {
            std::fs::create_dir(dir.path().join(sub)).unwrap();
        }
        write_exec(&dir.path().join("bin/pveum"), FAKE_PVEUM);
        write_exec(
            &dir.path().join("bin/pveversion"),
            &format!("#!/bin/sh\necho 'pve-manager/{pve_version}/0123456789abcdef (running kernel: 6.8.12-4-pve)'\n"),
        );
        FakePveHost { dir }
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("calls.log")
    }

    /// Recorded calls since the last `take_calls`.
    pub fn take_calls(&self) -> Vec<Vec<String>> {
        let text = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let _ = std::fs::remove_file(self.log_path());
        text.lines()
            .map(|l| l.split('\t').skip(1).map(str::to_owned).collect())
            .collect()
    }

    /// `program` with the fake first on its PATH, recording into this host.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let path = format!(
            "{}:{}",
            self.dir.path().join("bin").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut cmd = Command::new(program);
        cmd.env("PATH", path)
            .env("FAKE_LOG", self.log_path())
            .env("FAKE_STATE", self.dir.path().join("state"));
        cmd
    }

    /// The fake `pveum`.
    pub fn pveum(&self) -> PathBuf {
        self.dir.path().join("bin/pveum")
    }

    /// setup-token.sh with `args`, and `env` set.
    pub fn run(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        let mut cmd = self.command("bash");
        cmd.arg(setup_token_script()).args(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.output().unwrap()
    }
}

pub fn write_exec(p: &Path, body: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(p, body).unwrap();
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
}
