//! Command-line flags and their validation. Every check here runs before
//! anything listens, and each failure is one clear line naming the problem.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};

use crate::error::ConfigError;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    Auto,
    Proxmox,
    Fake,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// BigFleet capacity provider for Proxmox VE.
#[derive(Parser, Debug, Clone)]
#[command(name = "bigfleet-proxmox", version, about, long_about = None)]
pub struct Args {
    #[command(subcommand)]
    pub command: Option<Command>,

    /// gRPC listen address (CapacityProvider + grpc.health.v1 + reflection).
    #[arg(long, default_value = ":9000")]
    pub addr: String,

    /// Label stamped on every HostRef.provider.
    #[arg(long, default_value = "proxmox")]
    pub provider: String,

    /// Backend: proxmox | fake | auto (proxmox when --proxmox-api-url is set).
    #[arg(long, value_enum, default_value = "auto")]
    pub proxmox_backend: BackendChoice,

    /// Explicitly select the in-memory simulator (testing/certification only).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false)]
    pub use_fake_backend: bool,

    /// Proxmox API base URL, e.g. https://host:8006/api2/json.
    #[arg(long)]
    pub proxmox_api_url: Option<String>,

    /// API token id, USER@REALM!TOKENID.
    #[arg(long)]
    pub proxmox_token_id: Option<String>,

    /// API token secret inline (prefer --proxmox-token-file).
    #[arg(long, hide_env_values = true)]
    pub proxmox_token_secret: Option<String>,

    /// File holding the API token secret; wins over the inline form.
    #[arg(long)]
    pub proxmox_token_file: Option<PathBuf>,

    /// PEM CA bundle the API certificate must chain to (hostname checked).
    #[arg(long)]
    pub proxmox_ca_file: Option<PathBuf>,

    /// Pinned SHA-256 of the API leaf certificate (AB:CD:... or hex; comma list).
    #[arg(long)]
    pub proxmox_tls_fingerprint: Option<String>,

    /// Resource pool clones are placed in.
    #[arg(long)]
    pub proxmox_pool: Option<String>,

    /// Comma list of node names (zones); required for the real backend.
    #[arg(long, value_delimiter = ',')]
    pub nodes: Vec<String>,

    /// Fake backend: two synthetic zones, this value with -a and -b appended.
    #[arg(long, default_value = "pve")]
    pub default_zone: String,

    /// JSON offerings file (default: built-in, sized by --seed-count).
    #[arg(long)]
    pub offerings: Option<PathBuf>,

    /// Slots in the built-in offerings (ignored with --offerings).
    #[arg(long, default_value_t = 32)]
    pub seed_count: usize,

    /// JSON instance-type catalog: name -> {vcpu, memory_mib, template_vmid}.
    #[arg(long)]
    pub instance_types: Option<PathBuf>,

    /// Default template VMID for the built-in catalog and zero entries.
    #[arg(long, default_value_t = 9000)]
    pub template_vmid: u32,

    /// Explicit USD/hour per type: type=usd,type=usd.
    #[arg(long)]
    pub prices: Option<String>,

    /// Synthetic price per vCPU-hour (USD).
    #[arg(long, default_value_t = 0.0030)]
    pub price_per_vcpu_hour: f64,

    /// Synthetic price per GiB-hour (USD).
    #[arg(long, default_value_t = 0.0008)]
    pub price_per_gib_hour: f64,

    /// In-guest path the bootstrap blob is written to.
    #[arg(long, default_value = "/run/bigfleet-bootstrap")]
    pub bootstrap_path: String,

    /// Comma-separated argv run in the guest; the blob path is appended.
    #[arg(long, default_value = "/bin/sh")]
    pub bootstrap_exec: String,

    /// Shell command run in the guest before the bootstrap to set its
    /// hostname to the VM name, given as $BIGFLEET_NODE_NAME; the hostname is
    /// then read back and Configure fails unless it matches. Empty leaves
    /// naming to the template (the check still runs).
    #[arg(long, default_value = proxmox_backend::proxmox::DEFAULT_HOSTNAME_COMMAND)]
    pub hostname_command: String,

    /// Shell command run in the guest that succeeds once the node is Ready,
    /// with the node name (the VM name) in $BIGFLEET_NODE_NAME; empty turns
    /// the readiness gate off.
    #[arg(
        long,
        default_value = "kubectl --kubeconfig /etc/kubernetes/kubelet.conf get node \"$BIGFLEET_NODE_NAME\" -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' | grep -qx True"
    )]
    pub readiness_command: String,

    /// Shell command run in the guest to drain the node, with the node name
    /// (the VM name) in $BIGFLEET_NODE_NAME. The provider appends
    /// --timeout=SECONDS (nine tenths of --drain-timeout) and, only for a
    /// positive requested grace, --grace-period=SECONDS; a grace of 0 leaves
    /// each pod its own termination grace.
    #[arg(long, default_value = proxmox_backend::proxmox::DEFAULT_DRAIN_COMMAND)]
    pub drain_command: String,

    /// Poll period for Proxmox tasks, guest-agent pings and in-guest commands.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub proxmox_poll_interval: Duration,

    /// Most concurrent clones per node and storage (the one the clone
    /// writes to): clones to the same storage share its bandwidth and queue
    /// on its lock. With --adaptive-clones (the default) the bound each
    /// storage uses moves within 1 and this per node; without, it is this.
    #[arg(long, default_value_t = 8)]
    pub max_parallel_clones: usize,

    /// Let each storage (a local one per node, a shared one cluster-wide)
    /// find its own number of clones at once, as TCP Vegas finds a window:
    /// start at 2 per node, take one more while clones show the storage
    /// had bandwidth to spare and others wait, give one back when more
    /// than one copy only shared it, halve on a storage-lock timeout;
    /// false: always --max-parallel-clones per node and storage.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub adaptive_clones: bool,

    /// VMIDs this provider allocates, MIN-MAX inclusive (e.g. 10000-19999);
    /// unset, PVE's whole range 100-999999.
    #[arg(long, value_parser = parse_vmid_range_arg)]
    pub vmid_range: Option<VmidRange>,

    /// When a template's disks are on local storage of another node, stage a
    /// copy of the template on the target node (clone, offline migration,
    /// conversion) and clone from it; false: such Creates fail.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub template_replicas: bool,

    /// How clones copy the template's disks: full (independent copies) or
    /// linked (thin children of the template; same storage, needs one that
    /// can snapshot).
    #[arg(long, default_value = "full", value_parser = parse_clone_mode)]
    pub clone_mode: proxmox_backend::proxmox::CloneMode,

    /// Storage the clones' disks go to, per node: NODE=STORAGE,... (an
    /// instance type's catalog `storage` wins); unset, the template's storage.
    #[arg(long, default_value = "", value_parser = parse_node_storage_arg)]
    pub node_storage: NodeStorage,

    /// The storage guard, per storage: STORAGE=FACTOR,... A full clone is
    /// refused before anything is cloned when its disks and the provider's
    /// clones in flight there would pass FACTOR x the storage's free space;
    /// unset, 1 (a thin pool that overcommits on purpose says more).
    #[arg(long, default_value = "", value_parser = parse_storage_overcommit_arg)]
    pub storage_overcommit: StorageOvercommit,

    /// Background reconcile period (0 = off).
    #[arg(long, default_value = "2m", value_parser = parse_duration)]
    pub reconcile_interval: Duration,

    /// Reclaim a machine automatically once it has been FAILED this long:
    /// destroy its marked VMs and return it to SPECULATIVE (0 = off).
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    pub reclaim_failed_after: Duration,

    /// Durable state: a file path (SQLite), or postgres://USER@HOST:PORT/DB?sslmode=...
    /// (also postgresql://); empty = in memory.
    #[arg(long, default_value = "")]
    pub state: String,

    /// File holding the PostgreSQL password of a postgres:// --state; unset,
    /// PGPASSWORD, then the password file PGPASSFILE or ~/.pgpass.
    #[arg(long)]
    pub state_password_file: Option<PathBuf>,

    /// With a postgres:// --state, replicas share the state and one leader
    /// serves: how long its lease lasts unless renewed (it renews every
    /// third of it). A standby takes over within about this long after the
    /// leader dies. Between 1s and 60s. [default: 5s]
    #[arg(long, value_parser = parse_duration)]
    pub lease_ttl: Option<Duration>,

    /// This replica's name in the leader lease, which a standby quotes when
    /// it refuses an RPC; unique among the live replicas. [default: the host
    /// name, i.e. the pod name under Kubernetes]
    #[arg(long)]
    pub replica_name: Option<String>,

    /// Metrics and probes listener (/metrics, /healthz, /readyz); empty = off.
    /// Unset, it is the default below, and a default that is already taken is
    /// a warning (the provider serves without metrics); an address set here
    /// that cannot be bound is fatal. [default: :9090]
    #[arg(long)]
    pub metrics_addr: Option<String>,

    /// Serve gRPC server reflection.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub reflection: bool,

    /// Open gRPC connections at most; past it new ones wait in the
    /// kernel's backlog until one closes. Lowered (with a warning) to fit
    /// the descriptor limit, whose soft value is raised to the hard one.
    #[arg(long, default_value_t = crate::accept::DEFAULT_MAX_CONNECTIONS, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,

    /// Open gRPC connections one peer address may hold; one more is closed
    /// at once, so one client cannot take every slot.
    #[arg(long, default_value_t = crate::accept::DEFAULT_MAX_CONNECTIONS_PER_PEER, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections_per_peer: u32,

    /// TLS certificate (PEM) for the gRPC listener.
    #[arg(long)]
    pub tls_cert: Option<PathBuf>,

    /// TLS private key (PEM) for the gRPC listener.
    #[arg(long)]
    pub tls_key: Option<PathBuf>,

    /// Client CA (PEM): enables mTLS, a verified client certificate is required.
    #[arg(long)]
    pub tls_ca: Option<PathBuf>,

    /// Under mTLS, what a client certificate must say: bigfleet (its one
    /// bigfleet:// URI SAN decides which RPCs it may call, and for which
    /// shard_id) or any (every certificate that chains to --tls-ca may call
    /// everything). Without --tls-ca there is no client certificate to check.
    #[arg(long, value_enum, default_value = "bigfleet")]
    pub tls_client_identity: crate::identity::ClientIdentityMode,

    /// Create transition timeout.
    #[arg(long, default_value = "8m", value_parser = parse_duration)]
    pub create_timeout: Duration,

    /// Configure transition timeout (includes the readiness gate).
    #[arg(long, default_value = "8m", value_parser = parse_duration)]
    pub configure_timeout: Duration,

    /// Drain transition timeout.
    #[arg(long, default_value = "15m", value_parser = parse_duration)]
    pub drain_timeout: Duration,

    /// Delete transition timeout.
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    pub delete_timeout: Duration,

    /// On SIGINT/SIGTERM, how long in-flight RPCs and then transitions in
    /// flight may take to finish before exit (what is left resumes at the
    /// next start). Keep it under the pod's terminationGracePeriodSeconds.
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,

    /// Fake backend: simulated duration of each transition.
    #[arg(long, default_value = "50ms", value_parser = parse_duration)]
    pub fake_latency: Duration,

    /// Fake backend: each zone's memory for the node memory guard (bytes or
    /// K/M/G/T/P, powers of 1024); the default fits any lane's offerings.
    #[arg(long, default_value = "1024T", value_parser = proxmox_backend::memory::parse_size_mib)]
    pub fake_node_memory: u64,

    /// The node memory guard: a Create is refused, before anything starts,
    /// when the configured memory of the VMs running or about to run on its
    /// node (whoever owns them), the Creates in flight there and its own
    /// would pass this share of the node's memory. 1.0 never commits more
    /// than the node has; 0 turns the guard off.
    #[arg(long, default_value = "1.0", value_parser = proxmox_backend::memory::parse_limit)]
    pub node_memory_limit: f64,

    /// Log line format on stderr.
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,

    /// Minimum log level (error, warn, info, debug, trace).
    #[arg(long, default_value = DEFAULT_LOG_LEVEL)]
    pub log_level: String,

    /// Allow core files (the core limit and dumpability the environment
    /// set). Off by default: a core of this process holds the Proxmox API
    /// token and pieces of bootstrap blobs; turn it on only to debug a
    /// crash on a machine whose cores are kept safe.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false)]
    pub core_dumps: bool,
}

// One value per process, parsed once: the size of its largest variant
// costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug, Clone)]
pub enum Command {
    /// Operator client for a running provider: list, summary, get, create,
    /// configure, drain, delete, reclaim and watch machines.
    Ctl(bigfleet_ctl::CtlArgs),
    /// Work on a stopped provider's durable state: copy it whole between
    /// SQLite and PostgreSQL (`state copy --from ... --to ...`).
    State(crate::state_copy::StateArgs),
}

/// `0` means zero; otherwise humantime (`50ms`, `2m`, `1h30m`).
/// `--vmid-range MIN-MAX`, inclusive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmidRange(pub u32, pub u32);

/// `--node-storage NODE=STORAGE,...`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeStorage(pub std::collections::BTreeMap<String, String>);

/// `--storage-overcommit STORAGE=FACTOR,...`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StorageOvercommit(pub std::collections::BTreeMap<String, f64>);

fn parse_storage_overcommit_arg(
    text: &str,
) -> Result<StorageOvercommit, proxmox_backend::ConfigError> {
    proxmox_backend::proxmox::parse_storage_overcommit(text).map(StorageOvercommit)
}

fn parse_node_storage_arg(text: &str) -> Result<NodeStorage, proxmox_backend::ConfigError> {
    proxmox_backend::proxmox::parse_node_storage(text).map(NodeStorage)
}

fn parse_clone_mode(
    text: &str,
) -> Result<proxmox_backend::proxmox::CloneMode, proxmox_backend::ConfigError> {
    text.parse()
}

fn parse_vmid_range_arg(text: &str) -> Result<VmidRange, proxmox_backend::ConfigError> {
    proxmox_backend::proxmox::parse_vmid_range(text).map(|(lo, hi)| VmidRange(lo, hi))
}

pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    humantime::parse_duration(text).map_err(|e| format!("invalid duration {text:?}: {e}"))
}

/// `--log-level` when not given, and the level a refused `--log-level`
/// falls back to, so the refusal itself is still a line in the chosen format.
pub const DEFAULT_LOG_LEVEL: &str = "info";

/// The metrics listener's address when `--metrics-addr` is not given.
pub const DEFAULT_METRICS_ADDR: &str = ":9090";

/// Go-style `:9000` means every interface; a host name (`localhost:9200`)
/// is resolved, and its first address is used.
pub fn parse_listen_addr(flag: &str, value: &str) -> Result<SocketAddr, ConfigError> {
    let full = if value.starts_with(':') {
        format!("0.0.0.0{value}")
    } else {
        value.to_string()
    };
    if let Ok(addr) = full.parse() {
        return Ok(addr);
    }
    let bad = || {
        ConfigError::invalid(format!(
            "{flag} {value:?} is not a host:port listen address"
        ))
    };
    let (host, port) = full.rsplit_once(':').ok_or_else(bad)?;
    if host.is_empty() || port.parse::<u16>().is_err() {
        return Err(bad());
    }
    std::net::ToSocketAddrs::to_socket_addrs(&full)
        .map_err(|e| {
            let message = format!("{flag} {value:?}: cannot resolve {host:?}: {e}");
            ConfigError::invalid_because(message, e)
        })?
        .next()
        .ok_or_else(|| {
            ConfigError::invalid(format!("{flag} {value:?}: {host:?} resolves to no address"))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn the_binary_flags_mount_ctl() {
        let args = Args::try_parse_from([
            "bigfleet-proxmox",
            "ctl",
            "--target",
            "h:1",
            "watch",
            "m1",
            "--until",
            "idle",
            "--tls-ca",
            "/ca.pem",
        ])
        .unwrap();
        match args.command {
            Some(Command::Ctl(ctl)) => {
                assert_eq!(ctl.target, "h:1");
                assert_eq!(ctl.tls_ca.as_deref(), Some(std::path::Path::new("/ca.pem")));
                assert!(matches!(
                    ctl.command,
                    bigfleet_ctl::CtlCommand::Watch {
                        until: Some(bigfleet_proto::v1alpha1::MachineState::Idle),
                        ..
                    }
                ));
            }
            other => panic!("parsed {other:?}"),
        }
        // ctl's --tls-ca has its own id, so clap does not copy the value
        // into the server's --tls-ca.
        assert!(args.tls_ca.is_none());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("50ms"), Ok(Duration::from_millis(50)));
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn listen_addrs_accept_host_names() {
        let a = parse_listen_addr("--addr", "localhost:9200").unwrap();
        assert!(a.ip().is_loopback() && a.port() == 9200, "{a}");
        let e = parse_listen_addr("--addr", "localhost")
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a host:port"), "{e}");
    }

    #[test]
    fn listen_addrs() {
        assert_eq!(
            parse_listen_addr("--addr", ":9000").unwrap().to_string(),
            "0.0.0.0:9000"
        );
        assert_eq!(
            parse_listen_addr("--addr", "127.0.0.1:1")
                .unwrap()
                .to_string(),
            "127.0.0.1:1"
        );
        assert!(parse_listen_addr("--addr", "nope").is_err())
    }
}
