//! Boots the provider binary, waits for its "serving" log line and reads its
//! memory high-water mark.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use provider_testkit::STARTUP_LINE as SERVING_MARKER;

/// A provider child process; killed on drop so a failed run never leaks one.
pub struct Provider {
    child: Child,
    pub addr: String,
    /// Spawn -> serving line.
    pub startup: Duration,
}

impl Provider {
    #[allow(unsafe_code)] // libc call; see the SAFETY note inside
    pub async fn spawn(
        bin: &Path,
        seed_count: usize,
        state: Option<&Path>,
        boot_timeout: Duration,
        cpu: Option<usize>,
    ) -> Result<Provider> {
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
            "",
            "--fake-latency",
            "0",
            "--reconcile-interval",
            "0",
        ]);
        if let Some(state) = state {
            cmd.arg("--state").arg(state);
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
                if line.contains(SERVING_MARKER) {
                    return parse_addr(&line).map(|a| (a, started.elapsed()));
                }
                tail.push(line);
                if tail.len() > 20 {
                    tail.remove(0);
                }
            }
            Err(anyhow!("provider exited before serving"))
        };
        let (addr, startup) = match tokio::time::timeout(boot_timeout, wait_serving).await {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => bail!("{e}; last stderr lines:\n{}", tail.join("\n")),
            Err(_) => bail!(
                "provider did not log {SERVING_MARKER:?} within {boot_timeout:?}; last stderr lines:\n{}",
                tail.join("\n")
            ),
        };
        // Keep draining stderr so the provider never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Provider {
            child,
            addr,
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
