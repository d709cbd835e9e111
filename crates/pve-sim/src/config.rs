//! Simulator configuration and timing knobs.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

/// Env var consulted when the mode is [`GuestAgentMode::Auto`], so a whole test
/// suite can be pinned to one agent (`builtin`, `qemu-ga`, `auto` or a path).
pub const GUEST_AGENT_ENV: &str = "PVE_SIM_GUEST_AGENT";

/// Which guest agent answers the agent endpoints.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum GuestAgentMode {
    /// A real `qemu-ga` when one is installed (or as [`GUEST_AGENT_ENV`] says),
    /// else the built-in agent.
    #[default]
    Auto,
    /// The built-in agent, even when `qemu-ga` is installed.
    BuiltIn,
    /// Forward to this `qemu-ga` binary; starting the simulator fails without it.
    Qga(PathBuf),
}

impl GuestAgentMode {
    /// The `qemu-ga` binary to forward to, or `None` for the built-in agent.
    pub fn resolve(&self) -> anyhow::Result<Option<PathBuf>> {
        match self {
            Self::BuiltIn => Ok(None),
            Self::Qga(p) => {
                anyhow::ensure!(
                    is_executable(p),
                    "qemu-ga binary {} does not exist or is not executable \
                     (install the qemu-guest-agent package)",
                    p.display()
                );
                Ok(Some(p.clone()))
            }
            Self::Auto => match std::env::var(GUEST_AGENT_ENV) {
                Ok(v) if !v.trim().is_empty() => {
                    let mode: Self = v
                        .parse()
                        .map_err(|e| anyhow::anyhow!("{GUEST_AGENT_ENV}: {e}"))?;
                    match mode {
                        Self::Auto => Ok(find_qemu_ga()),
                        m => m.resolve(),
                    }
                }
                _ => Ok(find_qemu_ga()),
            },
        }
    }
}

impl FromStr for GuestAgentMode {
    type Err = String;

    /// `auto`, `builtin`, `qemu-ga` (searched like [`find_qemu_ga`]) or a path to a
    /// `qemu-ga` binary.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" => Ok(Self::Auto),
            "builtin" | "built-in" => Ok(Self::BuiltIn),
            "qemu-ga" => find_qemu_ga().map(Self::Qga).ok_or_else(|| {
                "qemu-ga not found on PATH or in /usr/sbin (install the qemu-guest-agent package)"
                    .to_string()
            }),
            p if p.contains('/') => Ok(Self::Qga(PathBuf::from(p))),
            other => Err(format!(
                "unknown guest agent '{other}' (expected auto, builtin, qemu-ga or a path to qemu-ga)"
            )),
        }
    }
}

/// `qemu-ga` on `PATH`, else `/usr/sbin/qemu-ga` (Debian installs it there, and
/// `sbin` is often missing from a non-root `PATH`).
pub fn find_qemu_ga() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("qemu-ga"))
        .chain(std::iter::once(PathBuf::from("/usr/sbin/qemu-ga")))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// A template VM present at startup.
#[derive(Clone, Debug)]
pub struct TemplateSpec {
    pub vmid: u32,
    pub node: String,
    pub name: String,
    /// Storage holding the template's disks, e.g. `local-lvm`.
    pub storage: String,
    /// Shared storage allows `target` clones to other nodes.
    pub shared: bool,
    pub cores: u32,
    pub memory_mib: u64,
    /// Guest agent enabled in the template's config (`agent: 1`).
    pub agent: bool,
}

impl TemplateSpec {
    /// A local-storage (`local-lvm`) template with the agent enabled.
    pub fn local(vmid: u32, node: &str) -> Self {
        Self {
            vmid,
            node: node.to_string(),
            name: format!("tmpl-{vmid}"),
            storage: "local-lvm".into(),
            shared: false,
            cores: 2,
            memory_mib: 2048,
            agent: true,
        }
    }

    /// A shared-storage (`ceph-pool`) template with the agent enabled.
    pub fn shared(vmid: u32, node: &str) -> Self {
        Self {
            storage: "ceph-pool".into(),
            shared: true,
            ..Self::local(vmid, node)
        }
    }
}

/// Everything the simulator can be told at startup. Durations default to small
/// values so tests run fast; real PVE values are noted per field.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Listen address; port 0 picks a free port.
    pub listen: SocketAddr,
    pub nodes: Vec<String>,
    pub templates: Vec<TemplateSpec>,
    /// Pools that exist (clones into other pools fail like PVE).
    pub pools: Vec<String>,
    /// Storages other than the templates' that count as shared.
    pub shared_storages: Vec<String>,
    /// `USER@REALM!TOKENID`.
    pub token_id: String,
    pub token_secret: String,
    /// Delay before a 401 (PVE: ~3 s).
    pub auth_failure_delay: Duration,
    /// Path of `pve-api-schema.json`; `None` = [`crate::schema::default_schema_path`].
    pub schema_path: Option<PathBuf>,
    /// Parent of the per-VM guest scratch directories; `None` = a temp dir.
    pub scratch_dir: Option<PathBuf>,
    /// How long a clone task copies disks (holding the new VM's config lock).
    pub clone_duration: Duration,
    pub start_duration: Duration,
    pub stop_duration: Duration,
    pub destroy_duration: Duration,
    /// Duration of an async (POST) config task.
    pub config_task_duration: Duration,
    /// How long hastart/hastop take to take effect after their task ends.
    pub ha_delay: Duration,
    /// Guest agent answers this long after the VM started (PVE: often 100 s+).
    pub agent_boot_delay: Duration,
    /// Wait for a held config lock before "got timeout" (PVE: 10 s).
    pub lock_wait: Duration,
    /// Wait for a storage lock before a clone fails (PVE: 10 s or more).
    pub storage_lock_wait: Duration,
    /// Parallel clones per (node, local storage) beyond which extra ones fail
    /// with the storage lock timeout. `None` = unlimited.
    pub max_parallel_local_clones: Option<usize>,
    /// Same for shared storage (cfs-lock timeout). `None` = unlimited.
    pub max_parallel_shared_clones: Option<usize>,
    /// `/cluster/resources` may be this stale (PVE: a few seconds).
    pub resources_staleness: Duration,
    /// Request body limit (older PVE 64 KiB, newer 512 KiB).
    pub body_limit: usize,
    /// Max captured bytes per exec output stream before `*-truncated` (qemu-ga: 16 MiB).
    pub exec_output_limit: usize,
    /// Range `GET /cluster/nextid` searches.
    pub vmid_range: (u32, u32),
    /// Built-in agent or a real `qemu-ga` per running VM.
    pub guest_agent: GuestAgentMode,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            nodes: vec!["pve1".into(), "pve2".into()],
            templates: vec![TemplateSpec::local(9000, "pve1")],
            pools: vec!["bigfleet".into()],
            shared_storages: vec!["ceph-pool".into()],
            token_id: "bigfleet@pve!autoscaler".into(),
            token_secret: "00000000-0000-4000-8000-000000000000".into(),
            auth_failure_delay: Duration::ZERO,
            schema_path: None,
            scratch_dir: None,
            clone_duration: Duration::from_millis(300),
            start_duration: Duration::from_millis(50),
            stop_duration: Duration::from_millis(50),
            destroy_duration: Duration::from_millis(50),
            config_task_duration: Duration::from_millis(20),
            ha_delay: Duration::from_millis(300),
            agent_boot_delay: Duration::from_millis(300),
            lock_wait: Duration::from_millis(100),
            storage_lock_wait: Duration::from_millis(100),
            max_parallel_local_clones: Some(4),
            max_parallel_shared_clones: None,
            resources_staleness: Duration::ZERO,
            body_limit: 512 * 1024,
            exec_output_limit: 16 * 1024 * 1024,
            vmid_range: (100, 999_999),
            guest_agent: GuestAgentMode::Auto,
        }
    }
}
