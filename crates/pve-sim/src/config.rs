//! Simulator configuration and timing knobs.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

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
        }
    }
}
