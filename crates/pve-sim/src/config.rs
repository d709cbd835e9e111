//! Simulator configuration and timing knobs.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

pub use crate::storage_cfg::{StorageKind, StorageSpec};

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

/// The `libpve-http-server-perl` version the simulated nodes run. It decides
/// how errors are rendered and how large a request body may be.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HttpServerVersion(pub u32, pub u32, pub u32);

impl HttpServerVersion {
    /// What current PVE 8 nodes run.
    pub const CURRENT: Self = Self(5, 2, 1);

    /// Before 5.2 an error's text is only in the status line's reason phrase;
    /// from 5.2 the JSON body also carries it as `message`.
    pub fn json_error_message(self) -> bool {
        self >= Self(5, 2, 0)
    }

    /// Request body limit: 64 KiB before 5.2.1, 512 KiB from 5.2.1.
    pub fn body_limit(self) -> usize {
        if self >= Self(5, 2, 1) {
            512 * 1024
        } else {
            64 * 1024
        }
    }
}

impl Default for HttpServerVersion {
    fn default() -> Self {
        Self::CURRENT
    }
}

impl std::fmt::Display for HttpServerVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

impl FromStr for HttpServerVersion {
    type Err = String;

    /// `MAJOR.MINOR[.PATCH]`, e.g. `5.1` or `5.2.1`.
    fn from_str(s: &str) -> Result<Self, String> {
        let parts: Vec<&str> = s.trim().split('.').collect();
        let num = |p: &str| {
            p.parse::<u32>().map_err(|_| {
                format!("invalid pve-http-server version '{s}' (expected MAJOR.MINOR[.PATCH])")
            })
        };
        match parts.as_slice() {
            [a, b] => Ok(Self(num(a)?, num(b)?, 0)),
            [a, b, c] => Ok(Self(num(a)?, num(b)?, num(c)?)),
            _ => Err(format!(
                "invalid pve-http-server version '{s}' (expected MAJOR.MINOR[.PATCH])"
            )),
        }
    }
}

/// How `tags` are stored (datacenter.cfg `tag-style`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TagStyle {
    /// PVE's defaults as the provider relies on them: split on `;`, `,` or
    /// whitespace, lower-cased, sorted, de-duplicated, `;`-joined.
    #[default]
    Lowercase,
    /// `case-sensitive=1`: sorted and de-duplicated, case kept.
    CaseSensitive,
    /// No normalisation: stored exactly as sent (a forgiving server).
    Verbatim,
}

impl FromStr for TagStyle {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "lowercase" => Ok(Self::Lowercase),
            "case-sensitive" => Ok(Self::CaseSensitive),
            "verbatim" => Ok(Self::Verbatim),
            other => Err(format!(
                "unknown tag style '{other}' (expected lowercase, case-sensitive or verbatim)"
            )),
        }
    }
}

/// Who may add or remove tags (datacenter.cfg `user-tag-access`). A tag a
/// request may not add or remove answers 403 `Permission check failed (/,
/// Sys.Modify for modifying tag 'X')`, as PVE does for a token without
/// `Sys.Modify` on `/`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum TagAccess {
    /// `user-allow=free` (PVE's default): any tag.
    #[default]
    Free,
    /// `user-allow=existing`: tags some VM already carries, or listed.
    Existing(Vec<String>),
    /// `user-allow=list`: only the listed tags.
    List(Vec<String>),
    /// `user-allow=none`: no tags at all.
    None,
}

impl TagAccess {
    /// Whether `tag` may be set, given the tags already in use in the cluster.
    pub fn allows(&self, tag: &str, in_use: &dyn Fn(&str) -> bool) -> bool {
        match self {
            Self::Free => true,
            Self::Existing(list) => list.iter().any(|t| t == tag) || in_use(tag),
            Self::List(list) => list.iter().any(|t| t == tag),
            Self::None => false,
        }
    }
}

impl FromStr for TagAccess {
    type Err = String;

    /// `free`, `none`, `existing[:a,b]` or `list:a,b`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, list) = s.trim().split_once(':').unwrap_or((s.trim(), ""));
        let list: Vec<String> = list
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::to_string)
            .collect();
        match kind {
            "free" => Ok(Self::Free),
            "none" => Ok(Self::None),
            "existing" => Ok(Self::Existing(list)),
            "list" => Ok(Self::List(list)),
            other => Err(format!(
                "unknown user-tag-access '{other}' (expected free, none, existing[:TAGS] or list:TAGS)"
            )),
        }
    }
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
    /// Size of its one disk (`scsi0: ...,size=32G`).
    pub disk_gib: u64,
    /// `protection: 1`: PVE copies it onto every clone, and a protected VM
    /// cannot be destroyed.
    pub protection: bool,
    /// An `ide2` CD-ROM drive, as its property string: an ISO
    /// (`local:iso/debian-12.iso,media=cdrom`), a cloud-init drive
    /// (`local-lvm:vm-9000-cloudinit,media=cdrom`), the host's drive
    /// (`cdrom,media=cdrom`) or an empty one (`none,media=cdrom`).
    pub cdrom: Option<String>,
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
            disk_gib: 32,
            protection: false,
            cdrom: None,
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

/// How long a linked clone takes on a storage with a bandwidth (see
/// [`SimConfig::storage_bandwidth`]): it copies no data, only metadata.
pub const LINKED_CLONE_TIME: Duration = Duration::from_millis(100);

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
    /// storage.cfg: type, shared flag and capacity of each storage. Storages
    /// named only in `shared_storages` or by a template are `rbd` (shared)
    /// or `dir` (local) with ample room.
    pub storages: Vec<StorageSpec>,
    /// `USER@REALM!TOKENID`.
    pub token_id: String,
    pub token_secret: String,
    /// Delay before a 401 (PVE: ~3 s).
    pub auth_failure_delay: Duration,
    /// The official PVE API schema to validate against in addition to the
    /// embedded description; `None` = [`crate::schema::default_schema_path`]
    /// (embedded only when none is found).
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
    /// How long an agent request waits for a booting agent before PVE
    /// answers "QEMU guest agent is not running" (qemu-server's
    /// `qga_check_running`: a `guest-ping` with a 3 s timeout before every
    /// agent command). A request made while the guest boots is answered as
    /// soon as the agent comes up within this window: QEMU hands the
    /// socket's bytes to the guest only once qemu-ga has opened its port.
    pub agent_ping_wait: Duration,
    /// pvedaemon workers per node (PVE: 3). PVE runs every protected call
    /// (a POST, PUT or DELETE, a guest-agent call, a VM's current status)
    /// in one, and a worker serves one call at a time, so calls that wait
    /// (an agent request held through a boot, a config update waiting for
    /// the VM's lock) make the node's others queue. 0: no limit.
    pub daemon_workers: usize,
    /// Wait for a held config lock before "got timeout" (PVE: 10 s).
    pub lock_wait: Duration,
    /// Wait for a storage lock before a clone fails (PVE: 10 s or more).
    pub storage_lock_wait: Duration,
    /// Parallel clones per (node, local storage) beyond which extra ones fail
    /// with the storage lock timeout. `None` = unlimited.
    pub max_parallel_local_clones: Option<usize>,
    /// Same for shared storage (cfs-lock timeout). `None` = unlimited.
    pub max_parallel_shared_clones: Option<usize>,
    /// The whole `/cluster/resources` answer may be this stale (a cache; 0 = off).
    pub resources_staleness: Duration,
    /// How often pvestatd refreshes a VM's RRD-sourced `/cluster/resources`
    /// fields (`name`, `status`, `template`, `uptime`, `cpu`, `mem`, `maxmem`,
    /// `maxcpu`, disk and net counters). A VM created through the API has none of
    /// them for this long; afterwards they may be this old. PVE: 10 s; 0 = always
    /// fresh and complete.
    pub rrd_lag: Duration,
    /// pve-http-server version: error rendering and the default body limit.
    pub http_server_version: HttpServerVersion,
    /// Request body limit; `None` = as [`HttpServerVersion::body_limit`].
    pub body_limit: Option<usize>,
    /// Return `description` the way PVE stores it, as a comment block: every
    /// line, the last included, ends with `\n`. `false` = verbatim.
    pub description_newline: bool,
    /// Tag normalisation.
    pub tag_style: TagStyle,
    /// Agent `file-write` content (with `encode=1`) and exec `input-data` pass
    /// through Perl's `encode_base64`: characters up to U+00FF become one byte
    /// each (Latin-1), anything above fails with "Wide character"; and exec
    /// `out-data` / `err-data` come back one character per output byte.
    /// `false` = UTF-8 passes through both ways.
    pub agent_latin1: bool,
    /// Like PVE's form decoding, `;` separates pairs as `&` does in query strings
    /// and form bodies (a raw `;` in a value splits it). `false` = only `&`.
    pub form_semicolon_separator: bool,
    /// How long an offline migration task copies the VM.
    pub migrate_duration: Duration,
    /// How long a call routed to an offline node hangs before its 595
    /// (`No route to host`): pveproxy forwards it with no online check
    /// (pve-manager `PVE/HTTPServer.pm`) and the connect to a powered-off
    /// host fails once ARP goes unanswered, about 3 s. 0 = at once.
    pub offline_delay: Duration,
    /// How long `/cluster/resources` keeps an offline node's VMs' last RRD
    /// sample (`name`, `status`, `template`, ...): pmxcfs drops samples
    /// older than 5 minutes (pve-cluster `pmxcfs/status.c`), after which
    /// PVE lists the VMs `status: unknown` with no name or template.
    pub rrd_expiry: Duration,
    /// Each node's physical memory: its `maxmem` in `/nodes` and
    /// `/cluster/resources`, and `memory.total` of its status (16 TiB).
    pub node_memory: NodeMemory,
    /// Max captured bytes per exec output stream before `*-truncated` (qemu-ga: 16 MiB).
    pub exec_output_limit: usize,
    /// Range `GET /cluster/nextid` searches, first and last id: datacenter.cfg's
    /// `next-id` (`lower`, and `upper` exclusive there, so `upper - 1`
    /// here; `--next-id LOWER:UPPER`). A full range fails as PVE's does.
    pub vmid_range: (u32, u32),
    /// Built-in agent or a real `qemu-ga` per running VM.
    pub guest_agent: GuestAgentMode,
    /// The token's rights derive from a pool ACL (the documented setup):
    /// calls on `/nodes/{node}/qemu/{vmid}/...` for a VM outside the first
    /// pool of [`SimConfig::pools`] answer 403 `Permission check failed
    /// (/vms/N, VM.Audit)` whether or not the VM exists, and such VMs are
    /// left out of `/cluster/resources` and `/nodes/{node}/qemu`. Templates
    /// stay visible (the setup grants rights on them explicitly).
    /// `false` = the token may do everything.
    pub pool_acl: bool,
    /// The clone worker's real timeline instead of creating the finished VM
    /// when the POST is answered: the worker takes the new id's lock (1 s),
    /// writes a temporary config (`lock: clone`, nothing else) on the source
    /// node, copies the disks, and only at the end writes name, description
    /// and sizing, moves the config to the `target` node and adds the VM to
    /// its pool. A VMID taken between the POST and the worker fails the task
    /// with `unable to create VM N: config file already exists`.
    pub clone_timeline: bool,
    /// A clone worker failing through [`crate::Faults::fail_next_task`] does
    /// so at the end of its copy and leaves the half-made VM behind (as when
    /// a worker is killed mid-copy), instead of PVE's usual clean-up.
    pub keep_failed_clone: bool,
    /// Datacenter `user-tag-access`.
    pub tag_access: TagAccess,
    /// pveproxy closes a keep-alive connection idle this long (PVE: ~5 s);
    /// `None` = never.
    pub keepalive_idle: Option<Duration>,
    /// pveproxy answers every response with status >= 400 with `Connection:
    /// close` and closes the connection.
    pub close_after_error: bool,
    /// Privileges the token lacks, as `(path, privilege)` (`*` = all): gone
    /// on that path and below unless a deeper grant gives it back, in `GET
    /// /access/permissions` and in the checks the simulator makes (the VM
    /// calls' privileges on `/vms/{vmid}`, which a pool's ACL covers for its
    /// members; `Sys.Modify` on `/` for new tags; `Pool.Audit` for pool reads).
    /// `("/", "*")` plus grants models a pool-scoped token.
    pub dropped_privileges: Vec<(String, String)>,
    /// Privileges granted as `(path, privilege)`, on that path and below,
    /// e.g. `("/", "Sys.Modify")`; a deeper drop takes them away again.
    pub granted_privileges: Vec<(String, String)>,
    /// Answer as PVE 9 does: `/version` says 9.0, and the privilege set has
    /// the `VM.GuestAgent.*` privileges where PVE 8 has `VM.Monitor`.
    pub pve9: bool,
    /// Storages storage.cfg does not enable on a node (its `nodes` list
    /// leaves the node out, or `disable`), as `(node, storage)`: still in
    /// the node's storage list and status, with `enabled` and `active` 0
    /// and no capacity; a disk cannot be allocated there.
    pub storages_disabled: Vec<(String, String)>,
    /// Storages that cannot be activated on a node at start-up (an NFS
    /// server or iSCSI target out of reach), as `(node, storage)`; see
    /// [`crate::PveSim::set_storage_online`] to change it while running.
    /// Status says `active` 0 and no capacity; allocating there, and a
    /// destroy with `destroy-unreferenced-disks=1` on that node, fail with
    /// `storage 'X' is not online`.
    pub storages_offline: Vec<(String, String)>,
    /// SDN VNets as `(vnet, zone)`: a NIC on one is checked for `SDN.Use`
    /// on `/sdn/zones/<zone>/<vnet>` (or on its VLANs, see the clone's
    /// checks); any other bridge is in `localnetwork`. `GET
    /// /cluster/sdn/vnets` lists them.
    pub sdn_vnets: Vec<(String, String)>,
    /// pve-network (SDN) is installed, as from PVE 8.1 by default. Without
    /// it `GET /cluster/sdn/vnets` answers 501 and every bridge is in
    /// `localnetwork`, whatever [`SimConfig::sdn_vnets`] says.
    pub sdn_installed: bool,
    /// datacenter.cfg `registered-tags`: tags only a token with
    /// `Sys.Modify` on `/` may add to or remove from a VM, whatever
    /// `user-tag-access` says (pve-guest-common `get_allowed_tags`).
    pub registered_tags: Vec<String>,
    /// Write bandwidth (bytes per second) of storages, by name: a full
    /// clone onto one copies its disk at this rate, shared evenly among the
    /// full clones writing there at once (a shared storage's among every
    /// node's, a local one's among its node's), instead of taking
    /// [`SimConfig::clone_duration`]; a linked clone there takes
    /// [`LINKED_CLONE_TIME`]. Storages not named keep the fixed duration.
    pub storage_bandwidth: Vec<(String, u64)>,
    /// The most one full clone's copy reaches on a storage, by name, below
    /// its [`SimConfig::storage_bandwidth`]: qemu-server copies a disk
    /// with `qemu-img convert -p -n` (in-order writes, no `-W`), which one
    /// stream to network storage cannot run at the pool's full rate, and a
    /// `bwlimit: clone=` caps each clone alike. A copy runs at the lesser of
    /// this and its share of the storage's bandwidth. Storages not named:
    /// the share alone.
    pub storage_stream_bandwidth: Vec<(String, u64)>,
    /// How long allocating a full clone's volume takes on a storage with a
    /// bandwidth, under the storage's lock (pve-storage `vdisk_alloc`:
    /// the cluster-wide `cfs-lock 'storage-ID'` for a shared storage, the
    /// node's `/var/lock/pve-manager/pve-storage-ID` for a local one). A
    /// clone that cannot take the lock within
    /// [`SimConfig::storage_lock_timeout`] fails with PVE's message.
    /// Zero: no allocation step.
    pub volume_alloc_time: Duration,
    /// How long a volume allocation waits for the storage's lock (pve-cluster
    /// `cfs_lock` and pve-common `lock_file` both default to 10 s).
    pub storage_lock_timeout: Duration,
    /// Each node's CPU threads: its `maxcpu`, and the most vCPUs
    /// (`sockets` x `cores`) a VM may have there to start (qemu-server
    /// `config_to_command`: `MAX N vcpus allowed per VM on this node`).
    pub node_cpus: u32,
    /// Cluster PCI resource mappings (`/etc/pve/mapping/pci.cfg`): each
    /// names how many devices it maps on which node. `GET
    /// /cluster/mapping/pci` lists them; a VM with `hostpciN:
    /// mapping=<name>` holds one of the node's devices while it runs, and
    /// a start that finds none free fails as qemu-server's does.
    pub pci_mappings: Vec<PciMapping>,
}

impl SimConfig {
    /// The request body limit in force.
    pub fn effective_body_limit(&self) -> usize {
        self.body_limit
            .unwrap_or_else(|| self.http_server_version.body_limit())
    }

    /// Every realism knob off: complete and fresh `/cluster/resources`, JSON
    /// error messages, verbatim descriptions and tags, UTF-8 agent data, `&`-only
    /// form decoding. For tests that need a forgiving server on purpose.
    pub fn forgiving(mut self) -> Self {
        self.rrd_lag = Duration::ZERO;
        self.offline_delay = Duration::ZERO;
        self.http_server_version = HttpServerVersion::CURRENT;
        self.description_newline = false;
        self.tag_style = TagStyle::Verbatim;
        self.agent_latin1 = false;
        self.form_semicolon_separator = false;
        self.agent_ping_wait = Duration::ZERO;
        self.daemon_workers = 0;
        self
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            nodes: vec!["pve1".into(), "pve2".into()],
            templates: vec![TemplateSpec::local(9000, "pve1")],
            pools: vec!["bigfleet".into()],
            shared_storages: vec!["ceph-pool".into()],
            storages: vec![
                StorageSpec::new("local", StorageKind::Dir, false, 100)
                    .with_content("backup,iso,vztmpl"),
                // Ample, so seeded fleets fit; tests of exhaustion set their own.
                StorageSpec::new("local-lvm", StorageKind::LvmThin, false, 64 << 10),
                StorageSpec::new("ceph-pool", StorageKind::Rbd, true, 1 << 20),
            ],
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
            agent_ping_wait: Duration::from_secs(3),
            daemon_workers: 3,
            lock_wait: Duration::from_millis(100),
            storage_lock_wait: Duration::from_millis(100),
            max_parallel_local_clones: Some(4),
            max_parallel_shared_clones: None,
            resources_staleness: Duration::ZERO,
            rrd_lag: Duration::from_secs(10),
            http_server_version: HttpServerVersion::CURRENT,
            body_limit: None,
            description_newline: true,
            tag_style: TagStyle::Lowercase,
            agent_latin1: true,
            form_semicolon_separator: true,
            migrate_duration: Duration::from_millis(200),
            offline_delay: Duration::from_secs(3),
            rrd_expiry: Duration::from_secs(300),
            node_memory: NodeMemory::default(),
            exec_output_limit: 16 * 1024 * 1024,
            vmid_range: (100, 999_999),
            guest_agent: GuestAgentMode::Auto,
            pool_acl: false,
            clone_timeline: false,
            keep_failed_clone: false,
            tag_access: TagAccess::Free,
            keepalive_idle: Some(Duration::from_secs(5)),
            close_after_error: true,
            dropped_privileges: Vec::new(),
            granted_privileges: Vec::new(),
            pve9: false,
            storages_disabled: Vec::new(),
            storages_offline: Vec::new(),
            sdn_vnets: Vec::new(),
            sdn_installed: true,
            registered_tags: Vec::new(),
            storage_bandwidth: Vec::new(),
            storage_stream_bandwidth: Vec::new(),
            volume_alloc_time: Duration::ZERO,
            storage_lock_timeout: Duration::from_secs(10),
            node_cpus: 64,
            pci_mappings: Vec::new(),
        }
    }
}

/// Each node's physical memory in bytes: one size for every node, with
/// per-node exceptions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeMemory {
    /// Nodes not named in `per_node`.
    pub every_node: u64,
    pub per_node: std::collections::BTreeMap<String, u64>,
}

impl NodeMemory {
    /// Ample, so that seeded fleets (1000 VMs on one node) and every
    /// certification lane's Creates fit: 16 TiB.
    pub const DEFAULT: u64 = 16 << 40;

    /// Every node has `bytes`.
    pub fn every_node(bytes: u64) -> NodeMemory {
        NodeMemory {
            every_node: bytes,
            per_node: Default::default(),
        }
    }

    /// `node` has `bytes`, the others what they had.
    pub fn with_node(mut self, node: &str, bytes: u64) -> NodeMemory {
        self.per_node.insert(node.to_string(), bytes);
        self
    }

    /// The memory of `node`, in bytes.
    pub fn of(&self, node: &str) -> u64 {
        self.per_node.get(node).copied().unwrap_or(self.every_node)
    }
}

impl Default for NodeMemory {
    fn default() -> NodeMemory {
        NodeMemory::every_node(NodeMemory::DEFAULT)
    }
}

/// `SIZE` (every node) or `NODE=SIZE`, comma-separated and mixable:
/// `16G`, `pve1=16GiB,pve2=32G`, `8G,pve3=64G`.
impl FromStr for NodeMemory {
    type Err = String;

    fn from_str(s: &str) -> Result<NodeMemory, String> {
        let mut out = NodeMemory::default();
        if s.trim().is_empty() {
            return Err("node memory is empty: give SIZE (e.g. 16G) or NODE=SIZE,...".into());
        }
        for part in s.split(',').map(str::trim) {
            match part.split_once('=') {
                Some((node, size)) => {
                    let node = node.trim();
                    if node.is_empty() {
                        return Err(format!("{part:?}: NODE=SIZE needs a node name"));
                    }
                    out.per_node.insert(
                        node.to_string(),
                        parse_size(size).map_err(|e| format!("node {node}: {e}"))?,
                    );
                }
                None => out.every_node = parse_size(part)?,
            }
        }
        Ok(out)
    }
}

/// A memory size: plain bytes, or a number with a binary unit, `K`/`M`/`G`/`T`
/// or `KiB`/`MiB`/`GiB`/`TiB` (both mean powers of 1024, as PVE sizes do).
/// Decimal units (`GB`) are refused rather than guessed at.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let shift = match unit.trim() {
        "" | "B" => 0,
        "K" | "KiB" => 10,
        "M" | "MiB" => 20,
        "G" | "GiB" => 30,
        "T" | "TiB" => 40,
        "KB" | "MB" | "GB" | "TB" => {
            return Err(format!(
                "size {t:?}: decimal units are ambiguous here; write {}{} or {}{}iB (powers of 1024), or bytes",
                num,
                &unit.trim()[..1],
                num,
                &unit.trim()[..1]
            ))
        }
        other => {
            return Err(format!(
                "size {t:?}: unknown unit {other:?}; use bytes or K, M, G, T (or KiB, MiB, GiB, TiB)"
            ))
        }
    };
    let n: u64 = num.parse().map_err(|_| {
        format!("size {t:?}: expected a whole number followed by an optional unit (e.g. 16G)")
    })?;
    if n == 0 {
        return Err(format!("size {t:?}: a node needs some memory"));
    }
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("size {t:?} does not fit in 64 bits of bytes"))
}

/// A cluster PCI resource mapping (pve-guest-common `PVE/Mapping/PCI.pm`,
/// `mapping/pci.cfg`): a logical name for interchangeable devices, with
/// `devices` of them on each node named (one `map` entry each, a path the
/// simulator makes up).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PciMapping {
    /// The mapping's id (`pve-configid`: a letter, then letters, digits,
    /// `-` or `_`).
    pub name: String,
    pub description: Option<String>,
    /// Devices per node.
    pub devices: std::collections::BTreeMap<String, u32>,
}

impl PciMapping {
    /// `name` with `count` devices on each of `nodes`.
    pub fn new(name: &str, nodes: &[(&str, u32)]) -> Self {
        Self {
            name: name.to_string(),
            description: None,
            devices: nodes.iter().map(|(n, c)| (n.to_string(), *c)).collect(),
        }
    }

    /// Devices it maps on `node`.
    pub fn devices_on(&self, node: &str) -> u32 {
        self.devices.get(node).copied().unwrap_or(0)
    }
}

/// Whether `id` is a `pve-configid` (pve-common `JSONSchema.pm`
/// `pve_verify_configid`: `^[a-z][a-z0-9_-]+$`, case-insensitive).
pub fn is_config_id(id: &str) -> bool {
    let mut chars = id.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && id.len() >= 2
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// `NAME=NODE:COUNT[,NODE:COUNT...]`, e.g. `gpu=pve1:2,pve2:1`.
impl FromStr for PciMapping {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (name, nodes) = s.trim().split_once('=').ok_or_else(|| {
            format!("PCI mapping {s:?}: write NAME=NODE:COUNT[,NODE:COUNT...], e.g. gpu=pve1:2")
        })?;
        let name = name.trim();
        if !is_config_id(name) {
            return Err(format!(
                "PCI mapping {s:?}: name {name:?} is not a valid mapping id \
                 (a letter, then letters, digits, '-' or '_')"
            ));
        }
        let mut devices = std::collections::BTreeMap::new();
        for part in nodes.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (node, count) = part.split_once(':').ok_or_else(|| {
                format!("PCI mapping {s:?}: {part:?} should be NODE:COUNT, e.g. pve1:2")
            })?;
            let count: u32 = count.trim().parse().map_err(|_| {
                format!("PCI mapping {s:?}: device count {count:?} is not a whole number")
            })?;
            if devices.insert(node.trim().to_string(), count).is_some() {
                return Err(format!("PCI mapping {s:?}: node {node:?} is named twice"));
            }
        }
        if devices.is_empty() {
            return Err(format!(
                "PCI mapping {s:?}: name at least one NODE:COUNT after '='"
            ));
        }
        Ok(Self {
            name: name.to_string(),
            description: None,
            devices,
        })
    }
}
