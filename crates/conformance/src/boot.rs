//! Boot compatibility: the provider must serve when started exactly as the
//! published certification runner starts it.
//!
//! That runner boots `BIN --addr=127.0.0.1:P --provider=certify
//! --use-fake-backend --seed-count=N`, with and without `--state=PATH.json`,
//! and never passes `--metrics-addr`, while an earlier instance may still
//! hold the default metrics port. So the check holds `0.0.0.0:9090` itself
//! and expects the provider to serve anyway; an explicitly chosen metrics
//! address that is taken must still be refused at start-up.
//!
//! Binding the real default port must not touch the machine's interfaces,
//! so the check runs in a private network namespace: the runner re-executes
//! `bfconformance __boot-check` under `unshare -n` (falling back to an
//! unprivileged user namespace, `unshare -r -n`), and that child brings up
//! its own loopback and does the work.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _};
use bigfleet_proto::v1alpha1::{CreateRequest, ListFilter};
use serde::{Deserialize, Serialize};

use crate::harness::{Outcome, TestResult};
use crate::process::{free_port, ProviderProcess};

/// The hidden `bfconformance` subcommand that runs [`check_here`].
pub const SUBCOMMAND: &str = "__boot-check";
/// The default metrics address a provider binds when not told otherwise.
pub const DEFAULT_METRICS_ADDR: &str = "0.0.0.0:9090";
/// How long the published runner waits for a booted provider.
pub const LISTEN_TIMEOUT: Duration = Duration::from_secs(20);
const RESULT_PREFIX: &str = "BOOTCHECK ";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BootCheck {
    pub bin: PathBuf,
    /// Flags after the published ones (e.g. a mutant for the mutation check).
    pub extra_args: Vec<String>,
    pub seed_count: usize,
    pub log_dir: PathBuf,
}

#[derive(Debug, Serialize, Deserialize)]
struct BootResult {
    ok: bool,
    message: String,
}

impl BootCheck {
    fn published_args(&self) -> Vec<String> {
        let mut args = vec![
            "--provider=certify".to_string(),
            "--use-fake-backend".to_string(),
            format!("--seed-count={}", self.seed_count),
        ];
        args.extend(self.extra_args.iter().cloned());
        args
    }
}

/// Runs the check in a private network namespace. The namespace cannot be
/// made without `unshare` and either root or user namespaces: then the check
/// is skipped with the reason, except under `CI=true`, where it fails.
pub async fn run_isolated(runner_bin: &Path, check: &BootCheck) -> TestResult {
    let json = serde_json::to_string(check)?;
    let attempts: [&[&str]; 2] = [&["-n"], &["-r", "-n"]];
    let mut refusals = Vec::new();
    for flags in attempts {
        let mut cmd = tokio::process::Command::new("unshare");
        cmd.args(flags)
            .arg("--")
            .arg(runner_bin)
            .arg(SUBCOMMAND)
            .arg(&json)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let out = match tokio::time::timeout(Duration::from_secs(240), cmd.output()).await {
            Err(_) => bail!("the boot check did not finish within 240 s"),
            Ok(Err(e)) => {
                refusals.push(format!("unshare: {e}"));
                break;
            }
            Ok(Ok(out)) => out,
        };
        let stdout = String::from_utf8_lossy(&out.stdout);
        if let Some(line) = stdout
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix(RESULT_PREFIX))
        {
            let result: BootResult =
                serde_json::from_str(line).context("decoding the boot check's result")?;
            ensure!(result.ok, "{}", result.message);
            return Ok(Outcome::PassWith(result.message));
        }
        refusals.push(format!(
            "unshare {}: {}{}",
            flags.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let why = format!(
        "needs a private network namespace (unshare -n as root, or unshare -r -n), which \
         this machine refused: {}",
        refusals.join("; ")
    );
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        bail!("{why}");
    }
    Ok(Outcome::Skip(why))
}

/// The `__boot-check` subcommand: run [`check_here`] and print its result
/// as the last stdout line, for [`run_isolated`] to read.
pub async fn subcommand(json: &str) -> bool {
    let result = match serde_json::from_str::<BootCheck>(json) {
        Ok(check) => check_here(&check).await,
        Err(e) => Err(anyhow::anyhow!("bad boot check arguments: {e}")),
    };
    let result = match result {
        Ok(message) => BootResult { ok: true, message },
        Err(e) => BootResult {
            ok: false,
            message: format!("{e:#}"),
        },
    };
    let ok = result.ok;
    match serde_json::to_string(&result) {
        Ok(line) => println!("{RESULT_PREFIX}{line}"),
        Err(e) => eprintln!("encoding the boot check result: {e}"),
    }
    ok
}

fn loopback_up() -> anyhow::Result<()> {
    let ip = ["ip", "/usr/sbin/ip", "/sbin/ip"]
        .into_iter()
        .find(|p| !p.starts_with('/') || Path::new(p).exists())
        .unwrap_or("ip");
    let out = Command::new(ip)
        .args(["link", "set", "lo", "up"])
        .output()
        .context("running `ip link set lo up` (install iproute2)")?;
    ensure!(
        out.status.success(),
        "`ip link set lo up` failed: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// The check itself, in the current network namespace (which it assumes is
/// private: it binds the default metrics port on every interface).
pub async fn check_here(check: &BootCheck) -> anyhow::Result<String> {
    loopback_up()?;
    let _holder = std::net::TcpListener::bind(DEFAULT_METRICS_ADDR)
        .with_context(|| format!("holding {DEFAULT_METRICS_ADDR} as an earlier instance would"))?;
    std::fs::create_dir_all(&check.log_dir)
        .with_context(|| format!("creating {}", check.log_dir.display()))?;
    let log = |name: &str| check.log_dir.join(format!("boot-{name}.log"));
    let args = check.published_args();

    // 1. The published flags, no --state, default metrics port taken.
    let (proc, mut client) =
        ProviderProcess::spawn_with(&check.bin, &args, &log("plain"), LISTEN_TIMEOUT, true)
            .await
            .context(
                "booted as the published runner boots it (no --metrics-addr, the default \
                 metrics port held by another process), the provider did not serve",
            )?;
    let listed = client
        .list(ListFilter::default())
        .await
        .context("List after boot")?
        .into_inner()
        .machines
        .len();
    ensure!(
        listed == check.seed_count,
        "booted with --seed-count={} the provider lists {listed} machines",
        check.seed_count
    );
    drop(proc);

    // 2. With --state=PATH.json: serves, survives kill -9, serves again.
    let dir = tempfile::tempdir().context("state directory")?;
    let state = dir.path().join("provider-state.json");
    let mut with_state = args.clone();
    with_state.push(format!("--state={}", state.display()));
    let (mut proc, mut client) =
        ProviderProcess::spawn_with(&check.bin, &with_state, &log("state"), LISTEN_TIMEOUT, true)
            .await
            .context(
                "booted with --state=PATH.json (and no --metrics-addr), the provider did not serve",
            )?;
    let first = client
        .list(ListFilter {
            max_results: 1,
            ..Default::default()
        })
        .await?
        .into_inner()
        .machines
        .into_iter()
        .next()
        .context("an empty fleet after boot with --state")?;
    client
        .create(CreateRequest {
            machine_id: first.id.clone(),
            shard_id: "boot-check".into(),
            shard_epoch: 1,
            sequence_number: 1,
        })
        .await
        .context("Create after boot with --state")?;
    proc.restart(&with_state, LISTEN_TIMEOUT).await.context(
        "restarted after kill -9 on the same --state=PATH.json, the provider did not serve",
    )?;
    drop(proc);

    // 3. An explicit metrics address that is taken is refused at start-up.
    let mut explicit = args;
    explicit.push(format!("--metrics-addr={DEFAULT_METRICS_ADDR}"));
    let status = exits_without_serving(&check.bin, &explicit, &log("explicit")).await?;
    ensure!(
        !status.success(),
        "with --metrics-addr={DEFAULT_METRICS_ADDR} set explicitly and taken, the provider \
         exited successfully; it must fail"
    );
    Ok(format!(
        "served with the published flags and the default metrics port taken, with and without \
         --state=PATH.json (and after kill -9); refused a taken explicit --metrics-addr ({status})"
    ))
}

/// Starts the provider and expects it to exit on its own, never serving.
async fn exits_without_serving(
    bin: &Path,
    args: &[String],
    log: &Path,
) -> anyhow::Result<std::process::ExitStatus> {
    let out = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let addr = format!("127.0.0.1:{}", free_port()?);
    let mut child = tokio::process::Command::new(bin)
        .arg(format!("--addr={addr}"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let deadline = Instant::now() + LISTEN_TIMEOUT;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            bail!(
                "with --metrics-addr set explicitly to a taken address the provider was still \
                 running after {LISTEN_TIMEOUT:?}; it must refuse to start"
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
