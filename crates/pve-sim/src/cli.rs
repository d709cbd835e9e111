//! The standalone simulator's knobs: its command-line flags and the
//! `--config FILE` that can set every one of them.
//!
//! A config file is a JSON object whose keys are flag names without the
//! leading `--` (`storage-size`, `pve-version`, ...) and whose values are
//! what the flag takes: a string, number or boolean, or a list of those
//! for a flag that may be given more than once. The file is turned into
//! flags and read by the same parser as the command line, so it accepts
//! exactly what the flags accept; flags given on the command line win: a
//! single-valued flag replaces the file's value, a repeatable flag adds to
//! the file's entries (for the same storage, mapping or VNet the command
//! line's entry wins). The docs (`docs/try-on-pve-sim.md`) list every flag.
//!
//! JSON because the workspace already depends on `serde_json`; no second
//! format library for one file.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{ArgAction, CommandFactory, Parser};
use serde_json::Value;

use crate::config::{
    parse_size, GuestAgentMode, HttpServerVersion, NodeMemory, PciMapping, SimConfig, StorageKind,
    StorageSpec, TagAccess, TagStyle,
};
use crate::flag_values::{
    humantime_ms, next_id_range, parse_drop, parse_grant, parse_template, parse_vnet,
};

/// Every flag of `pve-sim`.
#[derive(Parser, Debug)]
#[command(
    name = "pve-sim",
    about = "Proxmox VE API simulator (HTTPS, token auth, guest agent)",
    // A flag given twice (the file's, then the command line's) keeps the
    // last: that is how the command line wins over the file.
    args_override_self = true
)]
pub struct Args {
    /// A JSON file setting any of these flags: keys are flag names without
    /// `--`, values what the flag takes (a list for a repeatable flag).
    /// Flags on the command line win.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Listen address (port 0 picks one).
    #[arg(long, default_value = "127.0.0.1:8006")]
    pub listen: SocketAddr,
    /// Comma-separated node names.
    #[arg(long, default_value = "pve1,pve2", value_delimiter = ',',
          action = ArgAction::Set)]
    pub nodes: Vec<String>,
    /// Each node's memory (its `maxmem`): SIZE for every node, or
    /// NODE=SIZE,... per node (mixable: `16G,pve2=32G`). Sizes are bytes or
    /// K/M/G/T (= KiB/MiB/GiB/TiB).
    #[arg(long, default_value = "16T", value_parser = |s: &str| s.parse::<NodeMemory>())]
    pub node_memory: NodeMemory,
    /// Templates as `VMID[@NODE][:shared]`, comma-separated (node defaults to the first).
    #[arg(long, default_value = "9000", value_delimiter = ',',
          action = ArgAction::Set)]
    pub templates: Vec<String>,
    /// Pools that exist.
    #[arg(long, default_value = "bigfleet", value_delimiter = ',',
          action = ArgAction::Set)]
    pub pools: Vec<String>,
    /// A storage of storage.cfg, repeatable:
    /// `NAME=TYPE[,shared][,size=SIZE][,content=A;B][,nodes=N1;N2]`. TYPE is dir, lvm, lvmthin, zfspool,
    /// rbd or nfs; size defaults to 1T (per node when local); `nodes`
    /// leaves the storage disabled on the other nodes. Any --storage
    /// replaces the default set (local, local-lvm, ceph-pool).
    #[arg(long, value_name = "SPEC", action = ArgAction::Append,
          value_parser = parse_storage)]
    pub storage: Vec<StorageSpec>,
    /// Storage capacity, repeatable and comma-separated: STORAGE=SIZE for
    /// every node, STORAGE@NODE=SIZE for one node's pool of a local
    /// storage. Whole GiB (e.g. 500G, 2T).
    #[arg(long, value_name = "STORAGE[@NODE]=SIZE", action = ArgAction::Append,
          value_delimiter = ',', value_parser = parse_storage_size)]
    pub storage_size: Vec<StorageSize>,
    /// A storage's write bandwidth, repeatable and comma-separated:
    /// STORAGE=RATE, bytes per second with K/M/G/T (e.g. local-lvm=500M).
    /// Full clones onto it copy the template's disk at RATE shared among
    /// the clones writing there at once; linked clones take 100 ms.
    /// Storages not named take --clone-duration.
    #[arg(long, value_name = "STORAGE=RATE", action = ArgAction::Append,
          value_delimiter = ',', value_parser = parse_bandwidth)]
    pub storage_bandwidth: Vec<(String, u64)>,
    /// The most one clone's copy reaches on a storage, repeatable and
    /// comma-separated: STORAGE=RATE (e.g. ceph-pool=400M). A copy runs
    /// at the lesser of this and its share of --storage-bandwidth.
    #[arg(long, value_name = "STORAGE=RATE", action = ArgAction::Append,
          value_delimiter = ',', value_parser = parse_bandwidth)]
    pub storage_stream_bandwidth: Vec<(String, u64)>,
    /// How long a full clone allocates its volume under the storage's lock
    /// on a storage with --storage-bandwidth (0 = no allocation step).
    #[arg(long, default_value = "0s", value_parser = humantime_ms)]
    pub volume_alloc_time: Duration,
    /// How long an allocation waits for the storage's lock before the
    /// clone fails (PVE: 10s).
    #[arg(long, default_value = "10s", value_parser = humantime_ms)]
    pub storage_lock_timeout: Duration,
    /// A storage that cannot be activated on a node at start-up (NFS
    /// server gone), repeatable: NODE:STORAGE.
    #[arg(long, value_name = "NODE:STORAGE", action = ArgAction::Append,
          value_parser = parse_node_storage)]
    pub storage_offline: Vec<(String, String)>,
    /// Take a privilege from the token on a path and below, repeatable:
    /// PATH:PRIV (`*` = every privilege), e.g. `/storage/local-lvm:Datastore.AllocateSpace`.
    #[arg(long, value_name = "PATH:PRIV", action = ArgAction::Append,
          value_parser = parse_drop)]
    pub drop_privilege: Vec<(String, String)>,
    /// Give the token a privilege on a path and below, repeatable:
    /// PATH:PRIV, e.g. `/mapping/pci/gpu:Mapping.Use` or `/:Sys.Modify`.
    #[arg(long, value_name = "PATH:PRIV", action = ArgAction::Append,
          value_parser = parse_grant)]
    pub grant_privilege: Vec<(String, String)>,
    /// An SDN VNet and its zone, repeatable: VNET=ZONE. NICs on it are
    /// checked for SDN.Use on /sdn/zones/ZONE/VNET.
    #[arg(long, value_name = "VNET=ZONE", action = ArgAction::Append,
          value_parser = parse_vnet)]
    pub sdn_vnet: Vec<(String, String)>,
    /// pve-network (SDN) is installed; `false` = GET /cluster/sdn/vnets
    /// answers 501 and every bridge is in `localnetwork`.
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    pub sdn_installed: bool,
    /// A PCI resource mapping, repeatable: `NAME=NODE:COUNT[,NODE:COUNT]`
    /// (COUNT devices on each node named).
    #[arg(long, value_name = "NAME=NODE:COUNT", action = ArgAction::Append,
          value_parser = |s: &str| s.parse::<PciMapping>())]
    pub pci_mapping: Vec<PciMapping>,
    /// API token id USER@REALM!TOKENID.
    #[arg(long, default_value = "bigfleet@pve!autoscaler")]
    pub token_id: String,
    /// API token secret (default: a fixed test value).
    #[arg(long, env = "PVE_SIM_TOKEN_SECRET")]
    pub token_secret: Option<String>,
    /// Write the CA PEM here.
    #[arg(long)]
    pub ca_out: Option<PathBuf>,
    /// The official PVE API schema (pve-api-schema.json) to validate against in
    /// addition to the embedded description (default: $PVE_SIM_SCHEMA, else
    /// shared/spec/pve-api-schema.json beside the repository if present).
    #[arg(long)]
    pub schema: Option<PathBuf>,
    /// Directory for the VMs' guest roots (default: a temporary one).
    #[arg(long)]
    pub scratch_dir: Option<PathBuf>,
    /// RRD lag of /cluster/resources (PVE: 10s; 0s = always fresh and complete).
    #[arg(long, default_value = "10s", value_parser = humantime_ms)]
    pub rrd_lag: Duration,
    /// Whole-answer staleness of /cluster/resources (0s = off).
    #[arg(long, default_value = "0s", value_parser = humantime_ms)]
    pub resources_staleness: Duration,
    /// Simulated pve-http-server version: before 5.2 errors carry their text
    /// only in the reason phrase; the body limit is 64 KiB before 5.2.1.
    #[arg(long, default_value_t = HttpServerVersion::CURRENT,
          value_parser = |s: &str| s.parse::<HttpServerVersion>())]
    pub pve_http_server_version: HttpServerVersion,
    /// Request body limit in bytes (default: by --pve-http-server-version).
    #[arg(long)]
    pub body_limit: Option<usize>,
    /// Return descriptions with PVE's trailing newline.
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    pub description_newline: bool,
    /// Tag normalisation: lowercase, case-sensitive or verbatim.
    #[arg(long, default_value = "lowercase", value_parser = |s: &str| s.parse::<TagStyle>())]
    pub tag_style: TagStyle,
    /// Agent file-write content and exec input-data are Latin-1 only
    /// ("Wide character" above U+00FF).
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    pub agent_latin1: bool,
    /// `;` separates form pairs like `&`.
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    pub form_semicolon_separator: bool,
    /// Turn every realism knob off (fresh resources, JSON error messages,
    /// verbatim descriptions and tags, UTF-8 agent data, `&`-only forms);
    /// explicit knob flags are ignored when set.
    #[arg(long, default_value_t = false, num_args = 0..=1,
          default_missing_value = "true", action = ArgAction::Set)]
    pub forgiving: bool,
    /// Offline migration task duration.
    #[arg(long, default_value = "1s", value_parser = humantime_ms)]
    pub migrate_duration: Duration,
    /// How long a call routed to an offline node (`POST
    /// /_sim/nodes/{node}/offline`) hangs before its 595: the connect to a
    /// powered-off host waiting out ARP (PVE: about 3s).
    #[arg(long, default_value = "3s", value_parser = humantime_ms)]
    pub offline_delay: Duration,
    /// How long /cluster/resources keeps an offline node's VMs' last RRD
    /// sample before listing them `status: unknown` without name or
    /// template (pmxcfs: 5m).
    #[arg(long, default_value = "5m", value_parser = humantime_ms)]
    pub rrd_expiry: Duration,
    /// Clone task duration, e.g. 2s.
    #[arg(long, default_value = "2s", value_parser = humantime_ms)]
    pub clone_duration: Duration,
    /// Start task duration.
    #[arg(long, default_value = "50ms", value_parser = humantime_ms)]
    pub start_duration: Duration,
    /// Stop and shutdown task duration.
    #[arg(long, default_value = "50ms", value_parser = humantime_ms)]
    pub stop_duration: Duration,
    /// Destroy task duration.
    #[arg(long, default_value = "50ms", value_parser = humantime_ms)]
    pub destroy_duration: Duration,
    /// How long a `POST .../config` worker takes before applying.
    #[arg(long, default_value = "20ms", value_parser = humantime_ms)]
    pub config_task_duration: Duration,
    /// How long the HA manager takes to act on a hastart/hastop request.
    #[arg(long, default_value = "300ms", value_parser = humantime_ms)]
    pub ha_delay: Duration,
    /// Time from start until the guest agent answers.
    #[arg(long, default_value = "3s", value_parser = humantime_ms)]
    pub agent_boot_delay: Duration,
    /// How long an agent request waits for a booting agent before "QEMU
    /// guest agent is not running" (PVE: qemu-server's 3 s `guest-ping`).
    #[arg(long, default_value = "3s", value_parser = humantime_ms)]
    pub agent_ping_wait: Duration,
    /// pvedaemon workers per node, each serving one protected call (a
    /// POST, PUT or DELETE, an agent call, a VM's status) at a time (PVE:
    /// 3; 0: no limit).
    #[arg(long, default_value_t = 3)]
    pub daemon_workers: usize,
    /// Config lock wait before "got timeout" (PVE: 10s).
    #[arg(long, default_value = "1s", value_parser = humantime_ms)]
    pub lock_wait: Duration,
    /// How long a clone over the parallel limit waits for the storage lock
    /// before failing.
    #[arg(long, default_value = "100ms", value_parser = humantime_ms)]
    pub storage_lock_wait: Duration,
    /// Delay before a 401 (PVE: 3s).
    #[arg(long, default_value = "0s", value_parser = humantime_ms)]
    pub auth_failure_delay: Duration,
    /// Parallel clones per node+local storage before storage-lock timeouts (0 = unlimited).
    #[arg(long, default_value_t = 4)]
    pub max_parallel_local_clones: usize,
    /// Parallel clones per shared storage before cfs-lock timeouts (0 = unlimited).
    #[arg(long, default_value_t = 0)]
    pub max_parallel_shared_clones: usize,
    /// Most bytes of an exec's stdout or stderr kept before `*-truncated`
    /// (qemu-ga: 16M).
    #[arg(long, default_value = "16M", value_parser = parse_size)]
    pub exec_output_limit: u64,
    /// Seed this many VMs marked as the provider's.
    #[arg(long, default_value_t = 0)]
    pub seed_marked_vms: usize,
    /// Guest agent: `auto` (qemu-ga when installed, else built-in), `builtin`,
    /// `qemu-ga` (required), or a path to a qemu-ga binary.
    #[arg(long, default_value = "auto", value_parser = |s: &str| s.parse::<GuestAgentMode>())]
    pub guest_agent: GuestAgentMode,
    /// The token's rights come from a pool ACL: VMs outside the first pool
    /// answer 403 and are not listed.
    #[arg(long, default_value_t = false, num_args = 0..=1,
          default_missing_value = "true", action = ArgAction::Set)]
    pub pool_acl: bool,
    /// The clone worker's real timeline (temporary config on the source node;
    /// name, description, target node and pool at the end).
    #[arg(long, default_value_t = false, num_args = 0..=1,
          default_missing_value = "true", action = ArgAction::Set)]
    pub clone_timeline: bool,
    /// A clone failed through a task fault leaves its half-made VM behind.
    #[arg(long, default_value_t = false, num_args = 0..=1,
          default_missing_value = "true", action = ArgAction::Set)]
    pub keep_failed_clone: bool,
    /// Datacenter user-tag-access: free, none, `existing[:TAGS]` or list:TAGS.
    #[arg(long, default_value = "free", value_parser = |s: &str| s.parse::<TagAccess>())]
    pub tag_access: TagAccess,
    /// datacenter.cfg `registered-tags`, repeatable or comma-separated:
    /// tags only a token with Sys.Modify on / may add to or remove from a
    /// VM, whatever --tag-access says.
    #[arg(long, value_name = "TAG", action = ArgAction::Append, value_delimiter = ',')]
    pub registered_tag: Vec<String>,
    /// Each node's CPU threads: its `maxcpu`, and the most vCPUs (sockets x
    /// cores) a VM may have there to start (`MAX N vcpus allowed per VM on
    /// this node`).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub node_cpus: u32,
    /// pveproxy closes keep-alive connections idle this long (0s = never).
    #[arg(long, default_value = "5s", value_parser = humantime_ms)]
    pub keepalive_idle: Duration,
    /// Close the connection after every response with status >= 400.
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    pub close_after_error: bool,
    /// datacenter.cfg's `next-id` range, LOWER:UPPER with UPPER exclusive
    /// as PVE writes it: what `GET /cluster/nextid` without `vmid`
    /// searches; a full range answers PVE's 500 `unable to get any free
    /// VMID in range [LOWER, UPPER]`.
    #[arg(long, default_value = "100:1000000", value_parser = next_id_range)]
    pub next_id: (u32, u32),
    /// The PVE major version the nodes run, 8 or 9: privilege names
    /// (`VM.Monitor` or `VM.GuestAgent.*`), `/version`, clone's check of
    /// custom CPU models, and how a task that warned ends (a destroy that
    /// cannot free a disk on a storage made busy with `POST
    /// /_sim/storages/{node}/{storage}/busy` ends `WARNINGS: N` on 9, `OK`
    /// on 8, with the warning in its log).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u8).range(8..=9))]
    pub pve_version: u8,
}

/// One `--storage-size` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StorageSize {
    pub storage: String,
    /// `None` = every node.
    pub node: Option<String>,
    pub gib: u64,
}

/// A storage size in whole GiB (storage capacities are kept in GiB).
fn parse_gib(s: &str) -> Result<u64, String> {
    let bytes = parse_size(s)?;
    if bytes % (1 << 30) != 0 {
        return Err(format!(
            "size {s:?}: storage sizes are whole GiB; write e.g. 500G or 2T"
        ));
    }
    Ok(bytes >> 30)
}

/// `NAME=TYPE[,shared][,size=SIZE][,content=A;B][,nodes=N1;N2]`; a
/// `nodes` list is kept in `node_gib` under [`NODES_MARK`] keys, which
/// [`Args::into_options`] turns into [`SimConfig::storages_disabled`] (the
/// spec has no field for it).
fn parse_storage(s: &str) -> Result<StorageSpec, String> {
    let usage = "write NAME=TYPE[,shared][,size=SIZE][,content=A;B][,nodes=N1;N2], \
                 e.g. nfs1=nfs,shared,size=2T";
    let (name, rest) = s
        .split_once('=')
        .ok_or_else(|| format!("storage {s:?}: {usage}"))?;
    let name = name.trim();
    if !crate::config::is_config_id(name) {
        return Err(format!(
            "storage {s:?}: {name:?} is not a storage id (a letter, then letters, digits, '-' or '_')"
        ));
    }
    let mut parts = rest.split(',').map(str::trim);
    let kind: StorageKind = parts.next().unwrap_or_default().parse()?;
    let mut spec = StorageSpec::new(name, kind, false, 1024);
    for part in parts.filter(|p| !p.is_empty()) {
        match part.split_once('=') {
            None if part == "shared" => spec.shared = true,
            Some(("size", v)) => spec.total_gib = parse_gib(v)?,
            Some(("content", v)) => spec.content = v.replace(['+', ';'], ","),
            Some(("nodes", v)) => {
                let nodes: Vec<&str> = v.split([';', '+']).filter(|n| !n.is_empty()).collect();
                if nodes.is_empty() {
                    return Err(format!("storage {s:?}: `nodes=` names no node"));
                }
                for n in nodes {
                    spec.node_gib.insert(format!("{NODES_MARK}{n}"), 0);
                }
            }
            _ => return Err(format!("storage {s:?}: unknown part {part:?}; {usage}")),
        }
    }
    Ok(spec)
}

/// Prefix of the `node_gib` keys [`parse_storage`] records a `nodes=`
/// list in until [`Args::into_options`] turns it into disabled storages
/// (a node name cannot contain it).
const NODES_MARK: &str = "nodes=";

/// `STORAGE=RATE` (bytes per second).
fn parse_bandwidth(s: &str) -> Result<(String, u64), String> {
    let (name, rate) = s.split_once('=').ok_or_else(|| {
        format!(
            "storage bandwidth {s:?}: write STORAGE=RATE, e.g. local-lvm=500M (bytes per second)"
        )
    })?;
    let bytes =
        crate::config::parse_size(rate).map_err(|e| format!("storage bandwidth {s:?}: {e}"))?;
    if name.trim().is_empty() || bytes == 0 {
        return Err(format!(
            "storage bandwidth {s:?}: name a storage and a rate above 0, e.g. local-lvm=500M"
        ));
    }
    Ok((name.trim().to_string(), bytes))
}

/// `STORAGE[@NODE]=SIZE`.
fn parse_storage_size(s: &str) -> Result<StorageSize, String> {
    let (name, size) = s.split_once('=').ok_or_else(|| {
        format!("storage size {s:?}: write STORAGE=SIZE or STORAGE@NODE=SIZE, e.g. local-lvm=500G")
    })?;
    let (storage, node) = match name.split_once('@') {
        Some((st, n)) => (st.trim(), Some(n.trim().to_string())),
        None => (name.trim(), None),
    };
    Ok(StorageSize {
        storage: storage.to_string(),
        node,
        gib: parse_gib(size).map_err(|e| format!("storage size {s:?}: {e}"))?,
    })
}

fn parse_node_storage(s: &str) -> Result<(String, String), String> {
    match s.split_once(':') {
        Some((n, st)) if !n.trim().is_empty() && !st.trim().is_empty() => {
            Ok((n.trim().to_string(), st.trim().to_string()))
        }
        _ => Err(format!("{s:?}: write NODE:STORAGE, e.g. pve2:nfs1")),
    }
}

/// The flags a config file sets, in order, for the parser.
pub fn file_to_flags(path: &Path) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("config file {}: cannot read it: {e}", path.display()))?;
    let doc: Value = serde_json::from_str(&text).map_err(|e| {
        format!(
            "config file {}: not valid JSON ({e}); write an object of flag names to values",
            path.display()
        )
    })?;
    let Value::Object(map) = doc else {
        return Err(format!(
            "config file {}: the top level must be a JSON object, e.g. {{\"nodes\": \"pve1,pve2\"}}",
            path.display()
        ));
    };
    let cmd = Args::command();
    let mut out = Vec::new();
    for (key, value) in map {
        let flag = key.replace('_', "-");
        let known = cmd
            .get_arguments()
            .any(|a| a.get_long() == Some(flag.as_str()));
        if !known || flag == "config" {
            return Err(format!(
                "config file {}: {key:?} is not a pve-sim flag (keys are flag names without \
                 '--'; see pve-sim --help)",
                path.display()
            ));
        }
        let items = match value {
            Value::Array(items) => items,
            one => vec![one],
        };
        for item in items {
            let text = match item {
                Value::String(s) => s,
                Value::Bool(b) => b.to_string(),
                Value::Number(n) => n.to_string(),
                other => {
                    return Err(format!(
                        "config file {}: {key:?} has {other}; give a string, number or boolean \
                         (or a list of them), as the flag takes on the command line",
                        path.display()
                    ))
                }
            };
            out.push(format!("--{flag}={text}"));
        }
    }
    Ok(out)
}

/// What the binary runs with: the simulator's config and what it does
/// after starting.
#[derive(Debug)]
pub struct Options {
    pub config: SimConfig,
    pub seed_marked_vms: usize,
    pub ca_out: Option<PathBuf>,
}

/// Parse `argv` (program name first): the `--config` file's flags, then
/// the command line's. `Err` is clap's error (help and version included),
/// printed and exited on by the caller; a bad file or a knob that
/// contradicts another comes back as a usage error too.
pub fn parse(argv: &[String]) -> Result<Options, clap::Error> {
    let cli = Args::try_parse_from(argv)?;
    let args = match &cli.config {
        None => cli,
        Some(path) => {
            let usage =
                |msg: String| Args::command().error(clap::error::ErrorKind::InvalidValue, msg);
            let file = file_to_flags(path).map_err(usage)?;
            let prog = argv.first().cloned().unwrap_or_else(|| "pve-sim".into());
            // The file's flags alone first, so an error in them names the file.
            let mut only_file = vec![prog.clone()];
            only_file.extend(file.iter().cloned());
            if let Err(e) = Args::try_parse_from(&only_file) {
                return Err(usage(format!(
                    "config file {}: {}",
                    path.display(),
                    e.kind_message()
                )));
            }
            let mut all = vec![prog];
            all.extend(file);
            all.extend(argv.iter().skip(1).cloned());
            Args::try_parse_from(&all)?
        }
    };
    args.into_options()
        .map_err(|msg| Args::command().error(clap::error::ErrorKind::InvalidValue, msg))
}

/// clap's error text without the usage lines, for a file's error.
trait KindMessage {
    fn kind_message(&self) -> String;
}

impl KindMessage for clap::Error {
    fn kind_message(&self) -> String {
        let text = self.to_string();
        let first = text.lines().next().unwrap_or_default();
        first.trim_start_matches("error: ").to_string()
    }
}

impl Args {
    /// The [`SimConfig`] the flags describe, after checking that they
    /// agree with each other (nodes, storages and mappings named exist).
    pub fn into_options(self) -> Result<Options, String> {
        let a = self;
        let Some(first) = a.nodes.first().cloned() else {
            return Err("--nodes must name at least one node".into());
        };
        let known_node = |n: &str, what: &str| -> Result<(), String> {
            if a.nodes.iter().any(|x| x == n) {
                Ok(())
            } else {
                Err(format!(
                    "{what} names node {n:?}, which is not in --nodes ({}); add it there or fix the name",
                    a.nodes.join(",")
                ))
            }
        };
        for n in a.node_memory.per_node.keys() {
            known_node(n, "--node-memory")?;
        }
        let templates = a
            .templates
            .iter()
            .map(|t| parse_template(t, &first))
            .collect::<Result<Vec<_>, _>>()?;
        for t in &templates {
            known_node(&t.node, &format!("template {}", t.vmid))?;
        }
        let defaults = SimConfig::default();
        // Storages: the given ones (a later one of the same name wins),
        // else the default set; `nodes=` lists become disabled storages.
        let mut storages: Vec<StorageSpec> = Vec::new();
        for s in a.storage.iter().cloned() {
            storages.retain(|x| x.name != s.name);
            storages.push(s);
        }
        if storages.is_empty() {
            storages = defaults.storages.clone();
        }
        let mut storages_disabled = Vec::new();
        for st in &mut storages {
            let listed: Vec<String> = st
                .node_gib
                .keys()
                .filter_map(|k| k.strip_prefix(NODES_MARK).map(str::to_string))
                .collect();
            st.node_gib.retain(|k, _| !k.starts_with(NODES_MARK));
            for n in &listed {
                known_node(n, &format!("storage {}'s nodes=", st.name))?;
            }
            if !listed.is_empty() {
                storages_disabled.extend(
                    a.nodes
                        .iter()
                        .filter(|n| !listed.contains(n))
                        .map(|n| (n.clone(), st.name.clone())),
                );
            }
        }
        let names = |storages: &[StorageSpec]| {
            storages
                .iter()
                .map(|s| s.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        for size in &a.storage_size {
            let all = names(&storages);
            let Some(st) = storages.iter_mut().find(|s| s.name == size.storage) else {
                return Err(format!(
                    "--storage-size names storage {:?}, which is not declared (storages: {all}); \
                     declare it with --storage NAME=TYPE",
                    size.storage
                ));
            };
            match &size.node {
                None => {
                    st.total_gib = size.gib;
                    st.node_gib.clear();
                }
                Some(_) if st.shared => {
                    return Err(format!(
                        "--storage-size {}@NODE: {} is shared, one pool for every node; give \
                         {}=SIZE without @NODE",
                        st.name, st.name, st.name
                    ))
                }
                Some(n) => {
                    known_node(n, "--storage-size")?;
                    st.node_gib.insert(n.clone(), size.gib);
                }
            }
        }
        let declared = |name: &str| {
            storages.iter().any(|s| s.name == name) || templates.iter().any(|t| t.storage == name)
        };
        for (n, st) in &a.storage_offline {
            known_node(n, "--storage-offline")?;
            if !declared(st) {
                return Err(format!(
                    "--storage-offline names storage {st:?}, which is not declared (storages: {})",
                    names(&storages)
                ));
            }
        }
        let mut pci_mappings: Vec<PciMapping> = Vec::new();
        for m in a.pci_mapping.iter().cloned() {
            for n in m.devices.keys() {
                known_node(n, &format!("PCI mapping {}", m.name))?;
            }
            pci_mappings.retain(|x| x.name != m.name);
            pci_mappings.push(m);
        }
        // One zone per VNet: a later entry for the same VNet wins.
        let vnets: BTreeMap<String, String> = a.sdn_vnet.iter().cloned().collect();
        let shared_storages = storages
            .iter()
            .filter(|s| s.shared)
            .map(|s| s.name.clone())
            .collect();
        let mut cfg = SimConfig {
            listen: a.listen,
            nodes: a.nodes,
            templates,
            pools: a.pools,
            shared_storages,
            storages,
            storages_disabled,
            storages_offline: a.storage_offline,
            dropped_privileges: a.drop_privilege,
            granted_privileges: a.grant_privilege,
            sdn_vnets: vnets.into_iter().collect(),
            sdn_installed: a.sdn_installed,
            pci_mappings,
            token_id: a.token_id,
            schema_path: a.schema,
            scratch_dir: a.scratch_dir,
            clone_duration: a.clone_duration,
            start_duration: a.start_duration,
            stop_duration: a.stop_duration,
            destroy_duration: a.destroy_duration,
            config_task_duration: a.config_task_duration,
            ha_delay: a.ha_delay,
            agent_boot_delay: a.agent_boot_delay,
            agent_ping_wait: a.agent_ping_wait,
            daemon_workers: a.daemon_workers,
            lock_wait: a.lock_wait,
            storage_lock_wait: a.storage_lock_wait,
            auth_failure_delay: a.auth_failure_delay,
            max_parallel_local_clones: (a.max_parallel_local_clones > 0)
                .then_some(a.max_parallel_local_clones),
            max_parallel_shared_clones: (a.max_parallel_shared_clones > 0)
                .then_some(a.max_parallel_shared_clones),
            exec_output_limit: usize::try_from(a.exec_output_limit).unwrap_or(usize::MAX),
            guest_agent: a.guest_agent,
            rrd_lag: a.rrd_lag,
            resources_staleness: a.resources_staleness,
            http_server_version: a.pve_http_server_version,
            body_limit: a.body_limit,
            description_newline: a.description_newline,
            tag_style: a.tag_style,
            agent_latin1: a.agent_latin1,
            form_semicolon_separator: a.form_semicolon_separator,
            migrate_duration: a.migrate_duration,
            offline_delay: a.offline_delay,
            rrd_expiry: a.rrd_expiry,
            node_memory: a.node_memory,
            pool_acl: a.pool_acl,
            clone_timeline: a.clone_timeline,
            keep_failed_clone: a.keep_failed_clone,
            tag_access: a.tag_access,
            registered_tags: a.registered_tag,
            storage_bandwidth: a.storage_bandwidth,
            storage_stream_bandwidth: a.storage_stream_bandwidth,
            volume_alloc_time: a.volume_alloc_time,
            storage_lock_timeout: a.storage_lock_timeout,
            node_cpus: a.node_cpus,
            keepalive_idle: (!a.keepalive_idle.is_zero()).then_some(a.keepalive_idle),
            close_after_error: a.close_after_error,
            vmid_range: a.next_id,
            pve9: a.pve_version == 9,
            ..defaults
        };
        if a.forgiving {
            cfg = cfg.forgiving();
        }
        if let Some(s) = a.token_secret {
            cfg.token_secret = s;
        }
        Ok(Options {
            config: cfg,
            seed_marked_vms: a.seed_marked_vms,
            ca_out: a.ca_out,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(args: &[&str]) -> Vec<String> {
        std::iter::once("pve-sim")
            .chain(args.iter().copied())
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn storages_sizes_and_nodes_become_the_config() {
        let o = parse(&argv(&[
            "--storage",
            "local-lvm=lvmthin,size=100G",
            "--storage=nfs1=nfs,shared,size=2T,content=images;iso,nodes=pve1",
            "--storage-size",
            "local-lvm@pve2=300G",
        ]))
        .expect("parses");
        let c = o.config;
        assert_eq!(c.storages.len(), 2);
        assert_eq!(c.storages[0].total_gib_on("pve1"), 100);
        assert_eq!(c.storages[0].total_gib_on("pve2"), 300);
        assert_eq!(c.storages[1].content, "images,iso");
        assert!(c.storages[1].shared && c.storages[1].node_gib.is_empty());
        assert_eq!(c.storages_disabled, [("pve2".into(), "nfs1".into())]);
        assert_eq!(c.shared_storages, ["nfs1"]);
    }

    #[test]
    fn bad_input_is_an_error_naming_the_fix() {
        for (args, wants) in [
            (&["--storage-size", "nope=1T"][..], "not declared"),
            (&["--storage-size", "ceph-pool@pve1=1T"][..], "is shared"),
            (&["--storage-size", "local=1536M"][..], "size"),
            (&["--pci-mapping", "gpu=pve7:1"][..], "not in --nodes"),
            (&["--drop-privilege", "/:VM.Clnoe"][..], "unknown privilege"),
            (
                &["--grant-privilege", "vms:VM.Clone"][..],
                "must start with '/'",
            ),
            (&["--storage", "xy=zfs"][..], "unknown storage type"),
            (&["--storage-offline", "pve1:nope"][..], "not declared"),
        ] {
            let err = parse(&argv(args)).expect_err("refused").to_string();
            assert!(err.contains(wants), "{args:?}: {err}");
        }
    }

    #[test]
    fn the_command_line_wins_over_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sim.json");
        std::fs::write(
            &path,
            r#"{"pve-version": 9, "next-id": "200:300", "pool-acl": true,
                "drop-privilege": ["/storage/local:Datastore.Audit"]}"#,
        )
        .expect("write");
        let p = path.display().to_string();
        let o = parse(&argv(&[
            "--config",
            &p,
            "--next-id",
            "500:600",
            "--pool-acl=false",
            "--drop-privilege",
            "/vms:VM.Clone",
        ]))
        .expect("parses");
        assert!(o.config.pve9);
        assert_eq!(o.config.vmid_range, (500, 599));
        assert!(!o.config.pool_acl);
        assert_eq!(o.config.dropped_privileges.len(), 2);
        std::fs::write(&path, r#"{"storage-size": "local=1536M"}"#).expect("write");
        let err = parse(&argv(&["--config", &p]))
            .expect_err("bad file")
            .to_string();
        assert!(
            err.contains("config file") && err.contains("whole GiB"),
            "{err}"
        );
        std::fs::write(&path, r#"{"nodez": "a"}"#).expect("write");
        let err = parse(&argv(&["--config", &p]))
            .expect_err("bad key")
            .to_string();
        assert!(err.contains("\"nodez\" is not a pve-sim flag"), "{err}");
    }

    /// docs/pve-sim.md documents every flag (as `pve-sim --FLAG ...` in
    /// its tables) and its config-file example is one pve-sim accepts.
    #[test]
    fn the_docs_list_every_flag_and_their_example_parses() {
        let doc = include_str!("../../../docs/pve-sim.md");
        let cmd = Args::command();
        for arg in cmd.get_arguments() {
            let Some(long) = arg.get_long().filter(|l| *l != "help") else {
                continue;
            };
            assert!(
                doc.contains(&format!("`pve-sim --{long}")),
                "docs/pve-sim.md does not document --{long}"
            );
        }
        let example = doc
            .split("```json\n")
            .nth(1)
            .and_then(|rest| rest.split("```").next())
            .expect("a JSON example");
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sim.json");
        std::fs::write(&path, example).expect("write");
        let p = path.display().to_string();
        let o = parse(&argv(&["--config", &p])).expect("the docs' example parses");
        assert_eq!(o.config.nodes.len(), 3);
        assert!(o.config.pve9 && o.config.pool_acl);
        assert_eq!(o.config.pci_mappings[0].devices_on("pve2"), 1);
    }
}
