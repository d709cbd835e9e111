//! Boots the provider binary, waits for its "serving" log line (or the line
//! a standby replica logs) and reads its memory high-water mark.

use std::ffi::OsStr;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use provider_testkit::STARTUP_LINE as SERVING_MARKER;

/// The message a replica of a shared PostgreSQL state logs before it holds
/// the leader lease (with `addr=` and `metrics_addr=`).
pub const STANDBY_MARKER: &str =
    "replica of a shared PostgreSQL state: standby until it holds the leader lease";

/// A provider child process; killed on drop so a failed run never leaks one.
pub struct Provider {
    child: Child,
    pub addr: String,
    /// The probes' listener, when the awaited line names one.
    pub metrics_addr: Option<SocketAddr>,
    /// Spawn -> the awaited line.
    pub startup: Duration,
}

/// How one provider is booted beyond the fixed benchmark flags (fake
/// backend, no latency, no reconcile loop).
pub struct Launch<'a> {
    pub seed_count: usize,
    /// `--state`: a SQLite path or a `postgres://` URL; none keeps the
    /// state in memory.
    pub state: Option<&'a OsStr>,
    /// `--replica-name`, for replicas sharing a PostgreSQL state.
    pub replica: Option<&'a str>,
    /// `--metrics-addr`; empty turns the listener off.
    pub metrics_addr: &'a str,
    /// The log message that ends the boot: the serving line, or
    /// [`STANDBY_MARKER`] for a replica that is not to lead.
    pub until: &'a str,
    pub boot_timeout: Duration,
    pub cpu: Option<usize>,
}

impl Provider {
    /// Boot until the serving line, without the probes' listener.
    pub async fn spawn(
        bin: &Path,
        seed_count: usize,
        state: Option<&Path>,
        boot_timeout: Duration,
        cpu: Option<usize>,
    ) -> Result<Provider> {
        Provider::launch(
            bin,
            &Launch {
                seed_count,
                state: state.map(Path::as_os_str),
                replica: None,
                metrics_addr: "",
                until: SERVING_MARKER,
                boot_timeout,
                cpu,
            },
        )
        .await
    }

    #[allow(unsafe_code)] // libc call; see the SAFETY note inside
    pub async fn launch(bin: &Path, launch: &Launch<'_>) -> Result<Provider> {
        let Launch {
            seed_count,
            state,
            replica,
            metrics_addr,
            until,
            boot_timeout,
            cpu,
        } = *launch;
        let mut cmd = Command::new(bin);
        if let Some(cpu) = cpu {
            // SAFETY: only sched_setaffinity runs between fork and exec.
            unsafe {
                cmd.pre_exec(move || crate::pin_to_cpu(cpu));
            }
        }
        cmd.args([
            "--use-fake-backend",
            "--seed-count",
            &seed_count.to_string(),
            "--addr",
            "127.0.0.1:0",
            "--metrics-addr",
            metrics_addr,
            "--fake-latency",
            "0",
            "--reconcile-interval",
            "0",
        ]);
        if let Some(state) = state {
            cmd.arg("--state").arg(state);
        }
        if let Some(replica) = replica {
            cmd.args(["--replica-name", replica]);
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let started = Instant::now();
        let mut child = cmd
            .spawn()
            .with_context(|| format!("spawning provider {}", bin.display()))?;
        let stderr = child
            .stderr
            .take()
            .ok_or_else(|| anyhow!("provider stderr was not captured"))?;
        let mut lines = BufReader::new(stderr).lines();
        let mut tail: Vec<String> = Vec::new();
        let wait_serving = async {
            while let Some(line) = lines.next_line().await? {
                if line.contains(until) {
                    let metrics = provider_testkit::addr_field(&line, "metrics_addr").ok();
                    return parse_addr(&line).map(|a| (a, metrics, started.elapsed()));
                }
                tail.push(line);
                if tail.len() > 20 {
                    tail.remove(0);
                }
            }
            Err(anyhow!("provider exited before serving"))
        };
        let (addr, metrics_addr, startup) =
            match tokio::time::timeout(boot_timeout, wait_serving).await {
                Ok(Ok(v)) => v,
                Ok(Err(e)) => bail!("{e}; last stderr lines:\n{}", tail.join("\n")),
                Err(_) => bail!(
                "provider did not log {until:?} within {boot_timeout:?}; last stderr lines:\n{}",
                tail.join("\n")
            ),
            };
        // Keep draining stderr so the provider never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Provider {
            child,
            addr,
            metrics_addr,
            startup,
        })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Peak and current resident set in KiB (VmHWM, VmRSS).
    pub fn memory_kib(&self) -> Result<(u64, u64)> {
        let pid = self
            .pid()
            .ok_or_else(|| anyhow!("provider already exited"))?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .with_context(|| format!("reading /proc/{pid}/status"))?;
        let field = |name: &str| -> Result<u64> {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .ok_or_else(|| anyhow!("{name} missing from /proc/{pid}/status"))
        };
        Ok((field("VmHWM:")?, field("VmRSS:")?))
    }

    /// SIGKILL and reap (the durability scenario wants an unclean stop).
    pub async fn kill(mut self) -> Result<()> {
        self.child.kill().await.context("killing provider")
    }
}

fn parse_addr(line: &str) -> Result<String> {
    provider_testkit::addr_field(line, "addr")
        .map(|a| a.to_string())
        .map_err(|e| anyhow!("serving line: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_addr_from_logfmt_line() {
        let line = r#"ts=x level=info msg="serving CapacityProvider" addr=127.0.0.1:46493 provider=proxmox"#;
        assert_eq!(parse_addr(line).unwrap(), "127.0.0.1:46493");
    }

    #[test]
    fn serving_line_without_addr_is_an_error() {
        assert!(parse_addr(r#"msg="serving CapacityProvider""#).is_err());
    }
}
