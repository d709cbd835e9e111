//! Behaviour knobs of the Proxmox substrate and their validation.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::ConfigError;

/// How a Create copies the template's disks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CloneMode {
    /// A full copy: independent of the template, any storage, slower.
    #[default]
    Full,
    /// A thin child of the template's base volume: fast and small, but tied
    /// to the template (which cannot be destroyed while clones use it), on
    /// the template's storage, and only where that storage can snapshot.
    Linked,
}

impl std::str::FromStr for CloneMode {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, ConfigError> {
        match s.trim() {
            "full" => Ok(Self::Full),
            "linked" => Ok(Self::Linked),
            other => Err(ConfigError::Invalid(format!(
                "--clone-mode {other:?} is invalid: expected full or linked"
            ))),
        }
    }
}

impl std::fmt::Display for CloneMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Full => "full",
            Self::Linked => "linked",
        })
    }
}

/// The environment variable that carries the machine's node name (its VM
/// name) into the hostname, readiness and drain commands.
pub const NODE_NAME_ENV: &str = "BIGFLEET_NODE_NAME";

/// `--hostname-command`'s default: systemd's `hostnamectl` (which also
/// writes `/etc/hostname`, so the name survives a reboot), else the
/// `hostname` command for guests without systemd.
pub const DEFAULT_HOSTNAME_COMMAND: &str =
    "hostnamectl set-hostname \"$BIGFLEET_NODE_NAME\" || hostname \"$BIGFLEET_NODE_NAME\"";

/// `--drain-command`'s default: the node is named explicitly, not by the
/// guest's `$(hostname)`, so a guest whose hostname is wrong never drains
/// another machine's node.
pub const DEFAULT_DRAIN_COMMAND: &str =
    "kubectl drain \"$BIGFLEET_NODE_NAME\" --ignore-daemonsets --delete-emptydir-data";

/// Behaviour knobs of [`super::PveSubstrate`].
#[derive(Clone, Debug)]
pub struct PveOptions {
    /// Resource pool clones are placed in.
    pub pool: Option<String>,
    /// In-guest path of the bootstrap blob.
    pub bootstrap_path: String,
    /// argv run in the guest; the blob path is appended.
    pub bootstrap_exec: Vec<String>,
    /// Shell command that sets the guest's hostname to its VM name (in
    /// `BIGFLEET_NODE_NAME`) before the bootstrap; empty = the template sets
    /// it itself. Either way the hostname is read back and must match.
    pub hostname_command: String,
    /// Shell command that succeeds once the node is Ready; empty = no readiness gate.
    pub readiness_command: String,
    /// Shell command draining the node; `--grace-period` and `--timeout` are appended.
    pub drain_command: String,
    /// Most concurrent clones per (target node, storage the clone writes
    /// to): they share the storage's bandwidth and queue on its lock.
    /// At least 1.
    pub max_parallel_clones: usize,
    /// Adapt each storage's clone slots (a shared one's cluster-wide)
    /// within 1 and `max_parallel_clones` per node by how long its clones
    /// take (see `slots`); false: always `max_parallel_clones` per node.
    pub adaptive_clones: bool,
    /// Bound on each PVE worker task (clone, start, stop, destroy).
    pub task_timeout: Duration,
    /// How long to wait for the guest agent to answer after a start.
    pub agent_timeout: Duration,
    /// Bound on the bootstrap hook (and blob upload helpers).
    pub exec_timeout: Duration,
    /// Bound on one readiness probe.
    pub readiness_timeout: Duration,
    /// Passed to the drain command as `--timeout`; the exec is awaited a little longer.
    pub drain_timeout: Duration,
    /// Poll period for tasks, agent pings and exec status.
    pub poll_interval: Duration,
    /// A VMID freed (or abandoned) by this process is not reused for this long.
    pub vmid_cooldown: Duration,
    /// VMIDs this provider allocates from (inclusive).
    pub vmid_range: (u32, u32),
    /// How long one transition keeps retrying transient failures (595/596/597,
    /// 502-504, refused or reset connections, timeouts, an offline node, a
    /// template locked by a backup) before it fails with a `last_error` that
    /// names the cause. Kept under the engine's transition timeouts so the
    /// operator sees the cause, not "deadline exceeded".
    pub retry_window: Duration,
    /// After a clone POST whose answer was lost (596/597, timeout, reset),
    /// how long the new VMID must stay free before the clone is taken as not
    /// applied and tried again with a fresh VMID. Clone workers start within
    /// a second of the request, so this only needs to cover a slow node.
    pub ambiguous_settle: Duration,
    /// When a template's disks are on storage a target node cannot clone
    /// from (local storage of another node), stage a copy of it on that
    /// node (clone, offline migration, template conversion) and clone from
    /// the copy. `false`: such Creates fail, naming the fix.
    pub template_replicas: bool,
    /// Full or linked clones.
    pub clone_mode: CloneMode,
    /// Storage a clone's disks go to, by instance type (catalog `storage`);
    /// wins over [`PveOptions::node_storage`].
    pub type_storage: BTreeMap<String, String>,
    /// A clone's `balloon` (MiB) by instance type (catalog `balloon_mib`);
    /// a type without one gets its memory.
    pub type_balloon: BTreeMap<String, u64>,
    /// A clone's boot disk size by instance type (catalog `disk_gib`),
    /// with the type's template, for the start-up check against it.
    pub type_disk: BTreeMap<String, TypeDisk>,
    /// Storage a clone's disks (and a template replica's) go to, by node
    /// (`--node-storage`). Unset: the template's own storage id.
    pub node_storage: BTreeMap<String, String>,
    /// The node memory guard's limit, a share of each node's memory
    /// (`--node-memory-limit`): a clone is refused when the configured
    /// memory of what runs or is about to run there, the Creates in flight
    /// and its own would pass it. 0 turns the guard off.
    pub node_memory_limit: f64,
    /// The storage guard's factor per storage id (`--storage-overcommit`):
    /// a full clone is admitted while what the provider's clones in flight
    /// there need stays within `avail x factor`. 1 when not set; more for
    /// a thin pool that overcommits on purpose.
    pub storage_overcommit: BTreeMap<String, f64>,
    /// Mapped PCI devices per instance type (its catalog `pci`), with the
    /// nodes it is offered on.
    pub type_devices: BTreeMap<String, TypeDevices>,
}

/// An instance type's mapped PCI devices (GPUs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TypeDevices {
    /// The cluster resource mapping (`/cluster/mapping/pci`).
    pub mapping: String,
    /// Devices per clone.
    pub count: u32,
    /// Passed as PCI Express (`pcie=1`).
    pub pcie: bool,
    /// The nodes the type is offered on (each must map `count` devices).
    pub nodes: Vec<String>,
}

impl TypeDevices {
    /// A `hostpciN` value for one device.
    pub fn entry(&self) -> String {
        if self.pcie {
            format!("mapping={},pcie=1", self.mapping)
        } else {
            format!("mapping={}", self.mapping)
        }
    }
}

/// An instance type's boot disk size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TypeDisk {
    /// The template the type clones.
    pub template_vmid: u32,
    pub gib: u64,
}

impl TypeDisk {
    pub fn bytes(&self) -> u64 {
        self.gib << 30
    }
}

impl Default for PveOptions {
    fn default() -> Self {
        PveOptions {
            pool: None,
            bootstrap_path: "/run/bigfleet-bootstrap".into(),
            bootstrap_exec: vec!["/bin/sh".into()],
            hostname_command: DEFAULT_HOSTNAME_COMMAND.into(),
            readiness_command: String::new(),
            drain_command: DEFAULT_DRAIN_COMMAND.into(),
            max_parallel_clones: 8,
            adaptive_clones: true,
            task_timeout: Duration::from_secs(7 * 60),
            agent_timeout: Duration::from_secs(5 * 60),
            exec_timeout: Duration::from_secs(7 * 60),
            readiness_timeout: Duration::from_secs(60),
            drain_timeout: Duration::from_secs(14 * 60),
            poll_interval: Duration::from_secs(1),
            vmid_cooldown: Duration::from_secs(10 * 60),
            vmid_range: (100, 999_999),
            retry_window: Duration::from_secs(4 * 60),
            ambiguous_settle: Duration::from_secs(30),
            template_replicas: true,
            clone_mode: CloneMode::Full,
            type_storage: BTreeMap::new(),
            type_balloon: BTreeMap::new(),
            type_disk: BTreeMap::new(),
            node_storage: BTreeMap::new(),
            node_memory_limit: 1.0,
            storage_overcommit: BTreeMap::new(),
            type_devices: BTreeMap::new(),
        }
    }
}

impl PveOptions {
    /// Rejects options the substrate cannot work with, naming the problem.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.bootstrap_path.trim().is_empty() || !self.bootstrap_path.starts_with('/') {
            return Err(ConfigError::Invalid(format!(
                "--bootstrap-path {:?} must be an absolute in-guest path",
                self.bootstrap_path
            )));
        }
        if self
            .bootstrap_exec
            .first()
            .is_none_or(|a| a.trim().is_empty())
        {
            return Err(ConfigError::Invalid(
                "--bootstrap-exec must name a program".into(),
            ));
        }
        if self.drain_command.trim().is_empty() {
            return Err(ConfigError::Invalid(
                "--drain-command must not be empty".into(),
            ));
        }
        if self.max_parallel_clones == 0 {
            return Err(ConfigError::Invalid(
                "--max-parallel-clones must be at least 1".into(),
            ));
        }
        if !self.node_memory_limit.is_finite() || self.node_memory_limit < 0.0 {
            return Err(ConfigError::Invalid(format!(
                "--node-memory-limit {} is invalid: it is a share of each node's memory, \
                 0 (off) or more, e.g. 1.0",
                self.node_memory_limit
            )));
        }
        let (lo, hi) = self.vmid_range;
        if lo < 100 || hi < lo || hi > 999_999_999 {
            return Err(ConfigError::Invalid(format!(
                "--vmid-range {lo}-{hi} is invalid: it must be MIN-MAX with 100 <= MIN <= MAX <= 999999999 (PVE's VMID limits)"
            )));
        }
        if self.clone_mode == CloneMode::Linked
            && (!self.type_storage.is_empty() || !self.node_storage.is_empty())
        {
            return Err(ConfigError::Invalid(
                "--clone-mode linked keeps a clone's disks on its template's storage \
                 (PVE refuses `storage` for linked clones): drop --node-storage and the \
                 instance types' `storage`, or use --clone-mode full"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// Whether `id` is a PVE storage id: a letter, then letters, digits, '-',
/// '_', '.'.
fn storage_id(id: &str) -> bool {
    id.starts_with(|c: char| c.is_ascii_alphabetic())
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

/// Parses `--storage-overcommit STORAGE=FACTOR,...` (a factor above 0,
/// e.g. `local-lvm=2.5`), naming the problem on bad input.
pub fn parse_storage_overcommit(s: &str) -> Result<BTreeMap<String, f64>, ConfigError> {
    let mut out = BTreeMap::new();
    for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = |why: &str| {
            ConfigError::Invalid(format!(
                "--storage-overcommit {pair:?} is invalid: {why} (expected STORAGE=FACTOR,..., \
                 a factor above 0, e.g. local-lvm=2.5 lets full clones there take 2.5 x its free space)"
            ))
        };
        let (storage, factor) = pair.split_once('=').ok_or_else(|| bad("no '='"))?;
        let (storage, factor) = (storage.trim(), factor.trim());
        if !storage_id(storage) {
            return Err(bad(&format!("{storage:?} is not a PVE storage id")));
        }
        let factor: f64 = factor
            .parse()
            .map_err(|_| bad(&format!("{factor:?} is not a number")))?;
        if !factor.is_finite() || factor <= 0.0 {
            return Err(bad(&format!("{factor} is not above 0")));
        }
        if out.insert(storage.to_string(), factor).is_some() {
            return Err(bad(&format!("storage {storage} is named twice")));
        }
    }
    Ok(out)
}

/// Parses `--node-storage node=storage,node=storage`.
pub fn parse_node_storage(s: &str) -> Result<BTreeMap<String, String>, ConfigError> {
    let mut out = BTreeMap::new();
    for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = |why: &str| {
            ConfigError::Invalid(format!("--node-storage {pair:?} is invalid: {why} (expected NODE=STORAGE,NODE=STORAGE, e.g. pve1=local-lvm,pve2=fast-zfs)"))
        };
        let (node, storage) = pair.split_once('=').ok_or_else(|| bad("no '='"))?;
        let (node, storage) = (node.trim(), storage.trim());
        if node.is_empty() || storage.is_empty() {
            return Err(bad("empty node or storage"));
        }
        if !storage_id(storage) {
            return Err(bad(&format!("{storage:?} is not a PVE storage id")));
        }
        if out.insert(node.to_string(), storage.to_string()).is_some() {
            return Err(bad(&format!("node {node} is named twice")));
        }
    }
    Ok(out)
}

/// Parses `--vmid-range MIN-MAX` (inclusive), naming the problem on bad input.
pub fn parse_vmid_range(s: &str) -> Result<(u32, u32), ConfigError> {
    let bad = |why: &str| {
        ConfigError::Invalid(format!(
            "--vmid-range {s:?} is invalid: {why} (expected MIN-MAX, e.g. 10000-19999)"
        ))
    };
    let (lo, hi) = s
        .trim()
        .split_once('-')
        .ok_or_else(|| bad("no '-' between MIN and MAX"))?;
    let num = |v: &str| {
        v.trim()
            .parse::<u32>()
            .map_err(|_| bad(&format!("{:?} is not a number", v.trim())))
    };
    let range = (num(lo)?, num(hi)?);
    if range.0 < 100 {
        return Err(bad("PVE VMIDs start at 100"));
    }
    if range.1 < range.0 {
        return Err(bad("MAX is below MIN"));
    }
    if range.1 > 999_999_999 {
        return Err(bad("PVE VMIDs end at 999999999"));
    }
    Ok(range)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_validation() {
        assert!(PveOptions::default().validate().is_ok());
        let bad = PveOptions {
            bootstrap_exec: vec![],
            ..PveOptions::default()
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--bootstrap-exec"));
        let bad = PveOptions {
            max_parallel_clones: 0,
            ..PveOptions::default()
        };
        assert!(bad.validate().is_err());
        for limit in [-0.5, f64::NAN, f64::INFINITY] {
            let bad = PveOptions {
                node_memory_limit: limit,
                ..PveOptions::default()
            };
            let e = bad.validate().unwrap_err().to_string();
            assert!(e.contains("--node-memory-limit"), "{limit}: {e}");
        }
    }

    #[test]
    fn clone_mode_and_node_storage_flags() {
        assert_eq!("linked".parse::<CloneMode>().ok(), Some(CloneMode::Linked));
        let e = "thin".parse::<CloneMode>().unwrap_err();
        assert!(matches!(e, ConfigError::Invalid(_)), "{e:?}");
        assert!(e.to_string().contains("full or linked"), "{e}");
        let m = parse_node_storage("pve1=local-lvm, pve2=fast.zfs").unwrap();
        assert_eq!(m.get("pve2").map(String::as_str), Some("fast.zfs"));
        assert!(parse_node_storage("").unwrap().is_empty());
        for bad in ["pve1", "pve1=", "=x", "pve1=9bad", "a=x,a=y"] {
            let e = parse_node_storage(bad).unwrap_err().to_string();
            assert!(e.contains("--node-storage"), "{bad}: {e}");
        }
        let o = parse_storage_overcommit("local-lvm=2.5, ceph=1").unwrap();
        assert_eq!(o.get("local-lvm"), Some(&2.5));
        assert!(parse_storage_overcommit("").unwrap().is_empty());
        for (bad, why) in [
            ("local-lvm", "no '='"),
            ("local-lvm=0", "not above 0"),
            ("local-lvm=-1", "not above 0"),
            ("local-lvm=inf", "not above 0"),
            ("local-lvm=x", "not a number"),
            ("9x=2", "not a PVE storage id"),
            ("a=2,a=3", "named twice"),
        ] {
            let e = parse_storage_overcommit(bad).unwrap_err().to_string();
            assert!(
                e.contains("--storage-overcommit") && e.contains(why),
                "{bad}: {e}"
            );
        }
        let linked = PveOptions {
            clone_mode: CloneMode::Linked,
            node_storage: m,
            ..PveOptions::default()
        };
        assert!(linked
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--clone-mode linked"));
    }

    #[test]
    fn vmid_range_flag() {
        assert_eq!(parse_vmid_range("10000-19999").ok(), Some((10000, 19999)));
        assert_eq!(parse_vmid_range(" 100 - 100 ").ok(), Some((100, 100)));
        for bad in ["", "100", "99-200", "300-200", "a-200", "100-1000000000"] {
            let e = parse_vmid_range(bad).unwrap_err().to_string();
            assert!(
                e.contains("--vmid-range") && e.contains("MIN-MAX"),
                "{bad}: {e}"
            );
        }
    }
}
