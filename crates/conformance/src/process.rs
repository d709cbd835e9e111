//! Owning a provider process: boot on a free port, wait until it answers, kill -9, restart.
//! The child is always killed on drop (including unwinding after a panic).

use std::fs::File;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use crate::harness::{dial, Client};

pub struct ProviderProcess {
    child: Option<Child>,
    pub addr: String,
    /// Pass the address as `--addr=HOST:PORT` (one argument), the way the
    /// published runner does, rather than `--addr HOST:PORT`.
    pub addr_equals: bool,
    pub bin: PathBuf,
    pub args: Vec<String>,
    pub log: PathBuf,
}

/// A currently free 127.0.0.1 port (bound then released).
pub fn free_port() -> anyhow::Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("binding 127.0.0.1:0 to find a free port")?;
    Ok(l.local_addr()?.port())
}

impl ProviderProcess {
    /// Starts `bin args... --addr 127.0.0.1:<free port>` with output to `log`, and waits until
    /// a List answers (or the process exits, or `ready_timeout` passes).
    pub async fn spawn(
        bin: &Path,
        args: &[String],
        log: &Path,
        ready_timeout: Duration,
    ) -> anyhow::Result<(ProviderProcess, Client)> {
        Self::spawn_with(bin, args, log, ready_timeout, false).await
    }

    /// As [`ProviderProcess::spawn`], with the address passed as
    /// `--addr=HOST:PORT` first when `addr_equals` is set.
    pub async fn spawn_with(
        bin: &Path,
        args: &[String],
        log: &Path,
        ready_timeout: Duration,
        addr_equals: bool,
    ) -> anyhow::Result<(ProviderProcess, Client)> {
        let port = free_port()?;
        let addr = format!("127.0.0.1:{port}");
        let mut p = ProviderProcess {
            child: None,
            addr,
            addr_equals,
            bin: bin.to_path_buf(),
            args: args.to_vec(),
            log: log.to_path_buf(),
        };
        let client = p.start(ready_timeout).await?;
        Ok((p, client))
    }

    async fn start(&mut self, ready_timeout: Duration) -> anyhow::Result<Client> {
        let out = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("opening {}", self.log.display()))?;
        let err = out.try_clone()?;
        let mut cmd = Command::new(&self.bin);
        if self.addr_equals {
            cmd.arg(format!("--addr={}", self.addr));
        } else {
            cmd.arg("--addr").arg(&self.addr);
        }
        let child = cmd
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting provider {}", self.bin.display()))?;
        self.child = Some(child);
        self.wait_ready(ready_timeout).await
    }

    async fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<Client> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(c) = self.child.as_mut() {
                if let Some(st) = c.try_wait()? {
                    self.child = None;
                    bail!(
                        "provider exited during startup ({st}); log tail:\n{}",
                        self.log_tail(20)
                    );
                }
            }
            if let Ok(mut c) = dial(&self.addr, None).await {
                if c.list(bigfleet_proto::v1alpha1::ListFilter {
                    max_results: 1,
                    ..Default::default()
                })
                .await
                .is_ok()
                {
                    return Ok(c);
                }
            }
            if Instant::now() >= deadline {
                bail!(
                    "provider at {} did not answer within {timeout:?}; log tail:\n{}",
                    self.addr,
                    self.log_tail(20)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn log_tail(&self, n: usize) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// SIGKILL (std's Child::kill) and reap.
    pub fn kill9(&mut self) -> anyhow::Result<()> {
        if let Some(mut c) = self.child.take() {
            c.kill().context("kill -9 provider")?;
            c.wait().context("reaping provider")?;
        }
        Ok(())
    }

    /// Restarts (on a fresh port, so a lingering socket can never block the bind) with
    /// possibly new arguments.
    pub async fn restart(
        &mut self,
        args: &[String],
        ready_timeout: Duration,
    ) -> anyhow::Result<Client> {
        self.kill9()?;
        self.args = args.to_vec();
        self.addr = format!("127.0.0.1:{}", free_port()?);
        self.start(ready_timeout).await
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }
}

impl Drop for ProviderProcess {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
