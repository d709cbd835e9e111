//! Start-up validation: [`plan`] turns the parsed flags into a [`Plan`] of
//! validated sub-configurations, each flag checked exactly once, before
//! anything is bound. Serving reads only the plan, never the raw flags.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use providerkit::{AuxAddr, EngineOptions, Limits, Timeouts};
use proxmox_backend::catalog::{self, InstanceType, Pricing, Slot};
use proxmox_backend::proxmox::{PveOptions, TypeDevices, TypeDisk};

use crate::config::{self, Args, BackendChoice};
use crate::error::ConfigError;
use crate::identity::IdentityCheck;
use crate::state::{LocateError, StateLocation};
use crate::tls;

/// Which substrate the process drives, after the gating rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Proxmox,
    Fake,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Proxmox => "proxmox",
            BackendKind::Fake => "fake",
        }
    }
}

/// Credentials and trust for the real backend. The secret never reaches a
/// log line: Debug is redacted.
#[derive(Clone)]
pub struct ProxmoxAccess {
    pub api_url: String,
    pub token_id: String,
    pub token_secret: String,
    pub ca_pem: Option<Vec<u8>>,
    pub fingerprints: Vec<[u8; 32]>,
}

impl std::fmt::Debug for ProxmoxAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxmoxAccess")
            .field("api_url", &self.api_url)
            .field("token_id", &self.token_id)
            .field("token_secret", &"<redacted>")
            .field("ca_pem", &self.ca_pem.as_ref().map(|c| c.len()))
            .field("fingerprints", &self.fingerprints.len())
            .finish()
    }
}

/// A Proxmox cluster: API access and the substrate's validated options
/// (pool, bootstrap, readiness, drain, clones, VMIDs, retries).
#[derive(Debug)]
pub struct ProxmoxConfig {
    pub access: ProxmoxAccess,
    pub options: PveOptions,
}

/// The substrate and what it needs.
#[derive(Debug)]
pub enum BackendConfig {
    Proxmox(Box<ProxmoxConfig>),
    /// The in-memory simulator; each transition takes `latency`; each zone
    /// has `node_memory_mib` under the guard's `node_memory_limit`.
    Fake {
        latency: Duration,
        node_memory_mib: u64,
        node_memory_limit: f64,
    },
}

impl BackendConfig {
    /// `--node-memory-limit`, whichever the substrate.
    pub fn node_memory_limit(&self) -> f64 {
        match self {
            BackendConfig::Proxmox(p) => p.options.node_memory_limit,
            BackendConfig::Fake {
                node_memory_limit, ..
            } => *node_memory_limit,
        }
    }

    pub fn kind(&self) -> BackendKind {
        match self {
            BackendConfig::Proxmox(_) => BackendKind::Proxmox,
            BackendConfig::Fake { .. } => BackendKind::Fake,
        }
    }
}

/// What the provider offers: zones, the instance-type catalog, the slots
/// and their prices.
#[derive(Debug)]
pub struct Catalog {
    pub zones: Vec<String>,
    pub types: BTreeMap<String, InstanceType>,
    pub slots: Vec<Slot>,
    pub pricing: Pricing,
}

/// The listeners and how they serve.
#[derive(Clone, Debug)]
pub struct ServingConfig {
    /// The label stamped on every HostRef (and on the start-up line).
    pub provider: String,
    pub addr: SocketAddr,
    pub metrics_addr: AuxAddr,
    pub security: tls::Security,
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// Whether and how calls are bound to the client certificate's identity.
    pub client_identity: IdentityCheck,
    pub reflection: bool,
    /// How long in-flight RPCs may take after SIGINT/SIGTERM.
    pub shutdown_grace: Duration,
    /// `--max-connections` and `--max-connections-per-peer`.
    pub connections: crate::accept::ConnectionLimits,
}

/// The background passes; a zero period turns one off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReconcileConfig {
    pub interval: Duration,
    pub reclaim_failed_after: Duration,
}

/// Everything startup validation produced; nothing has been bound yet.
#[derive(Debug)]
pub struct Plan {
    pub backend: BackendConfig,
    pub catalog: Catalog,
    pub serving: ServingConfig,
    pub reconcile: ReconcileConfig,
    /// The durable state; None keeps it in memory.
    pub state: Option<StateConfig>,
    pub engine: EngineOptions,
}

/// Where `--state` keeps the state, and the leader lease of replicas
/// sharing it.
#[derive(Clone, Debug)]
pub struct StateConfig {
    pub location: StateLocation,
    /// Some for a PostgreSQL state, which replicas share by electing a
    /// leader; a state file serves one replica.
    pub lease: Option<LeaseConfig>,
}

/// The leader lease of a PostgreSQL state (`--lease-ttl`, `--replica-name`).
#[derive(Clone, Debug)]
pub struct LeaseConfig {
    pub ttl: Duration,
    pub replica: String,
}

/// `--lease-ttl` when unset: a standby takes over within about this long
/// plus one attempt, well inside the 10 s the takeover is allowed.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(5);

/// Shortest and longest `--lease-ttl`: below a second a loaded database or
/// a GC pause deposes a healthy leader; above a minute a dead leader stops
/// scaling for that long.
const LEASE_TTL_RANGE: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(60));

impl StateConfig {
    /// What the start-up line names as the store (`sqlite:PATH`, the URL).
    pub fn describe(&self) -> String {
        self.location.describe()
    }
}

/// `--state`: empty keeps the state in memory, a `postgres://` URL names a
/// database, anything else is a path. `--state-password-file` only means
/// something with a database.
fn state(args: &Args) -> Result<Option<StateConfig>, ConfigError> {
    let location = StateLocation::parse(&args.state, args.state_password_file.as_deref()).map_err(
        |e| match e {
            LocateError::Misread(why) => ConfigError::invalid(format!("--state {why}")),
            LocateError::PasswordForFile(file) => ConfigError::invalid(format!(
                "--state-password-file {} needs --state postgres://...: a state file has no \
                 password",
                file.display()
            )),
            LocateError::Url(e) => ConfigError::invalid_because(e.to_string(), e),
        },
    )?;
    let lease = match &location {
        Some(StateLocation::Postgres { .. }) => Some(lease(args)?),
        // In memory or in a file: one replica, no leader to elect.
        None | Some(StateLocation::Sqlite(_)) => {
            if args.lease_ttl.is_some() || args.replica_name.is_some() {
                return Err(ConfigError::invalid(
                    "--lease-ttl and --replica-name need --state postgres://...: only replicas \
                     sharing a PostgreSQL state elect a leader (a state file serves one replica)",
                ));
            }
            None
        }
    };
    Ok(location.map(|location| StateConfig { location, lease }))
}

fn lease(args: &Args) -> Result<LeaseConfig, ConfigError> {
    let ttl = args.lease_ttl.unwrap_or(DEFAULT_LEASE_TTL);
    let (shortest, longest) = LEASE_TTL_RANGE;
    if ttl < shortest || ttl > longest {
        return Err(ConfigError::invalid(format!(
            "--lease-ttl {} is out of range: use between {} and {}",
            humantime::format_duration(ttl),
            humantime::format_duration(shortest),
            humantime::format_duration(longest)
        )));
    }
    let replica = match &args.replica_name {
        Some(name) => name.trim().to_string(),
        None => host_name(),
    };
    if replica.is_empty() || replica.len() > 253 || replica.chars().any(char::is_control) {
        return Err(ConfigError::invalid(
            "--replica-name must be 1 to 253 printable characters: give each replica a unique \
             name (the pod name under Kubernetes)",
        ));
    }
    Ok(LeaseConfig { ttl, replica })
}

/// The host name (the pod name under Kubernetes), from `HOSTNAME` or the
/// kernel; a fixed word when neither is readable, which the log shows.
fn host_name() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|name| name.trim().to_string())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "unnamed-replica".to_string())
}

fn choose_backend(args: &Args) -> Result<BackendKind, ConfigError> {
    let has_url = args
        .proxmox_api_url
        .as_deref()
        .is_some_and(|u| !u.is_empty());
    let refused = |message: &str| Err(ConfigError::invalid(message));
    match (args.proxmox_backend, args.use_fake_backend) {
        (BackendChoice::Proxmox, true) => {
            refused("--use-fake-backend conflicts with --proxmox-backend proxmox: choose one")
        }
        (BackendChoice::Proxmox, false) => Ok(BackendKind::Proxmox),
        (BackendChoice::Fake, true) => Ok(BackendKind::Fake),
        (BackendChoice::Fake, false) => refused(
            "--proxmox-backend fake is testing-only and must be requested explicitly: add \
             --use-fake-backend",
        ),
        (BackendChoice::Auto, true) if has_url => refused(
            "--use-fake-backend conflicts with --proxmox-api-url: a real deployment must not \
             silently simulate; drop one of them",
        ),
        (BackendChoice::Auto, true) => Ok(BackendKind::Fake),
        (BackendChoice::Auto, false) if has_url => Ok(BackendKind::Proxmox),
        (BackendChoice::Auto, false) => refused(
            "no backend selected: set --proxmox-api-url (with --proxmox-token-id, a token \
             secret, --nodes and --proxmox-ca-file or --proxmox-tls-fingerprint) to drive a \
             Proxmox cluster, or pass --use-fake-backend to run the in-memory simulator \
             (testing only)",
        ),
    }
}

fn proxmox_access(args: &Args) -> Result<ProxmoxAccess, ConfigError> {
    let api_url = args
        .proxmox_api_url
        .clone()
        .filter(|u| !u.is_empty())
        .ok_or_else(|| {
            ConfigError::invalid(
                "the proxmox backend needs --proxmox-api-url (e.g. https://pve1:8006/api2/json)",
            )
        })?;
    if !api_url.starts_with("https://") {
        return Err(ConfigError::invalid(format!(
            "--proxmox-api-url {api_url:?} must be an https:// URL (TLS is always verified)"
        )));
    }
    let token_id = args
        .proxmox_token_id
        .clone()
        .filter(|t| !t.is_empty())
        .ok_or_else(|| {
            ConfigError::invalid(
                "the proxmox backend needs --proxmox-token-id (USER@REALM!TOKENID)",
            )
        })?;
    if !token_id.contains('@') || !token_id.contains('!') {
        return Err(ConfigError::invalid(format!(
            "--proxmox-token-id {token_id:?} is not of the form USER@REALM!TOKENID"
        )));
    }
    let token_secret = match &args.proxmox_token_file {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Read {
                flag: "--proxmox-token-file",
                path: path.clone(),
                source,
            })?
            .trim()
            .to_string(),
        None => args.proxmox_token_secret.clone().unwrap_or_default(),
    };
    if token_secret.is_empty() {
        return Err(ConfigError::invalid(
            "the proxmox backend needs a token secret: set --proxmox-token-file (preferred) or \
             --proxmox-token-secret",
        ));
    }
    let fingerprints = match args
        .proxmox_tls_fingerprint
        .as_deref()
        .filter(|f| !f.trim().is_empty())
    {
        Some(text) => pve::parse_fingerprints(text).map_err(|e| {
            ConfigError::invalid_because(format!("--proxmox-tls-fingerprint {text:?}: {e}"), e)
        })?,
        None => Vec::new(),
    };
    if args.proxmox_ca_file.is_none() && fingerprints.is_empty() {
        return Err(ConfigError::invalid(
            "TLS verification material is required: set --proxmox-ca-file (the cluster CA, \
             /etc/pve/pve-root-ca.pem) or --proxmox-tls-fingerprint (the API certificate's \
             SHA-256); verification cannot be disabled",
        ));
    }
    let ca_pem = match &args.proxmox_ca_file {
        Some(path) => Some(read_ca(path)?),
        None => None,
    };
    if args.nodes.iter().all(|n| n.trim().is_empty()) {
        return Err(ConfigError::invalid(
            "the proxmox backend needs --nodes (comma list of cluster node names)",
        ));
    }
    Ok(ProxmoxAccess {
        api_url,
        token_id,
        token_secret,
        ca_pem,
        fingerprints,
    })
}

/// `--proxmox-ca-file`: readable, PEM, at least one certificate.
fn read_ca(path: &std::path::Path) -> Result<Vec<u8>, ConfigError> {
    let pem = std::fs::read(path).map_err(|source| ConfigError::Read {
        flag: "--proxmox-ca-file",
        path: path.to_path_buf(),
        source,
    })?;
    let certs = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            let message = format!("--proxmox-ca-file {} is not PEM: {e}", path.display());
            ConfigError::malformed(message, Some(e.into()))
        })?;
    if certs.is_empty() {
        return Err(ConfigError::malformed(
            format!(
                "--proxmox-ca-file {} holds no PEM certificate",
                path.display()
            ),
            None,
        ));
    }
    Ok(pem)
}

/// The substrate's options from the flags, validated (the bootstrap, drain
/// and clone flags are checked here and nowhere else).
fn pve_options(args: &Args, catalog: &Catalog) -> Result<PveOptions, ConfigError> {
    let options = PveOptions {
        pool: args.proxmox_pool.clone().filter(|p| !p.is_empty()),
        bootstrap_path: args.bootstrap_path.clone(),
        bootstrap_exec: args
            .bootstrap_exec
            .split(',')
            .map(|a| a.trim().to_string())
            .filter(|a| !a.is_empty())
            .collect(),
        hostname_command: args.hostname_command.trim().to_string(),
        readiness_command: args.readiness_command.trim().to_string(),
        drain_command: args.drain_command.clone(),
        max_parallel_clones: args.max_parallel_clones,
        adaptive_clones: args.adaptive_clones,
        poll_interval: args.proxmox_poll_interval,
        // Leave the engine's Drain deadline room for EnsureRunning.
        drain_timeout: args.drain_timeout * 9 / 10,
        vmid_range: args
            .vmid_range
            .map_or(PveOptions::default().vmid_range, |r| (r.0, r.1)),
        template_replicas: args.template_replicas,
        clone_mode: args.clone_mode,
        node_storage: args.node_storage.0.clone(),
        node_memory_limit: args.node_memory_limit,
        storage_overcommit: args.storage_overcommit.0.clone(),
        type_storage: catalog
            .types
            .iter()
            .filter_map(|(name, t)| t.storage.clone().map(|s| (name.clone(), s)))
            .collect(),
        type_balloon: catalog
            .types
            .iter()
            .filter_map(|(name, t)| t.balloon_mib.map(|b| (name.clone(), b)))
            .collect(),
        type_disk: catalog
            .types
            .iter()
            .filter_map(|(name, t)| {
                t.disk_gib.map(|gib| {
                    let disk = TypeDisk {
                        template_vmid: t.template_vmid,
                        gib,
                    };
                    (name.clone(), disk)
                })
            })
            .collect(),
        type_devices: catalog
            .types
            .iter()
            .filter_map(|(name, t)| {
                let pci = t.pci.as_ref()?;
                let mut nodes: Vec<String> = catalog
                    .slots
                    .iter()
                    .filter(|s| s.facts.instance_type == *name)
                    .map(|s| s.facts.zone.clone())
                    .collect();
                nodes.sort();
                nodes.dedup();
                let devices = TypeDevices {
                    mapping: pci.mapping.clone(),
                    count: pci.count,
                    pcie: pci.pcie,
                    nodes,
                };
                Some((name.clone(), devices))
            })
            .collect(),
        // Retries of transient failures end before the engine's shortest
        // transition deadline, so last_error names the cause (the node, the
        // lock) rather than "deadline exceeded".
        retry_window: args
            .create_timeout
            .min(args.delete_timeout)
            .min(args.configure_timeout)
            .mul_f64(0.75),
        ..PveOptions::default()
    };
    options.validate()?;
    // A typo in a node name is the command line's fault: refused here, with
    // exit 2, before anything binds or dials the cluster.
    let nodes: Vec<&str> = args
        .nodes
        .iter()
        .map(|n| n.trim())
        .filter(|n| !n.is_empty())
        .collect();
    if let Some(n) = options
        .node_storage
        .keys()
        .find(|n| !nodes.contains(&n.as_str()))
    {
        return Err(ConfigError::invalid(format!(
            "--node-storage names node {n:?}, which is not in --nodes ({})",
            nodes.join(", ")
        )));
    }
    Ok(options)
}

fn catalog(args: &Args, backend: BackendKind) -> Result<Catalog, ConfigError> {
    let zones: Vec<String> = match backend {
        BackendKind::Proxmox => args
            .nodes
            .iter()
            .map(|n| n.trim().to_string())
            .filter(|n| !n.is_empty())
            .collect(),
        BackendKind::Fake => vec![
            format!("{}-a", args.default_zone),
            format!("{}-b", args.default_zone),
        ],
    };
    let types = match &args.instance_types {
        Some(path) => catalog::load_instance_types(path, args.template_vmid)?,
        None => catalog::builtin_instance_types(args.template_vmid),
    };
    let offerings = match &args.offerings {
        Some(path) => catalog::load_offerings(path)?,
        None => catalog::builtin_offerings(&zones, args.seed_count),
    };
    let pricing = Pricing {
        explicit: match &args.prices {
            Some(text) => catalog::parse_prices(text)?,
            None => Default::default(),
        },
        per_vcpu_hour: args.price_per_vcpu_hour,
        per_gib_hour: args.price_per_gib_hour,
    };
    let rate_ok = |r: f64| r.is_finite() && r >= 0.0;
    if !rate_ok(pricing.per_vcpu_hour) || !rate_ok(pricing.per_gib_hour) {
        return Err(ConfigError::invalid(
            "--price-per-vcpu-hour and --price-per-gib-hour must be >= 0",
        ));
    }
    // The fake backend's nodes are whatever the offerings name.
    let zone_check = match backend {
        BackendKind::Proxmox => Some(zones.as_slice()),
        BackendKind::Fake => None,
    };
    let slots = catalog::expand_slots(&args.provider, &offerings, &types, zone_check, &pricing)?;
    let zones = match backend {
        BackendKind::Proxmox => zones,
        BackendKind::Fake => {
            let mut z: Vec<String> = slots.iter().map(|s| s.facts.zone.clone()).collect();
            z.sort();
            z.dedup();
            z
        }
    };
    Ok(Catalog {
        zones,
        types,
        slots,
        pricing,
    })
}

fn serving(args: &Args) -> Result<ServingConfig, ConfigError> {
    let addr = config::parse_listen_addr("--addr", &args.addr)?;
    let metrics_addr = match args.metrics_addr.as_deref().map(str::trim) {
        None => AuxAddr::Default(config::parse_listen_addr(
            "--metrics-addr",
            config::DEFAULT_METRICS_ADDR,
        )?),
        Some("") => AuxAddr::Disabled,
        Some(value) => AuxAddr::Explicit(config::parse_listen_addr("--metrics-addr", value)?),
    };
    let (security, tls) = tls::server_config(
        args.tls_cert.as_deref(),
        args.tls_key.as_deref(),
        args.tls_ca.as_deref(),
    )?;
    Ok(ServingConfig {
        provider: args.provider.clone(),
        addr,
        metrics_addr,
        security,
        tls,
        client_identity: IdentityCheck::new(
            security == tls::Security::Mtls,
            args.tls_client_identity,
        ),
        reflection: args.reflection,
        shutdown_grace: args.shutdown_grace,
        connections: crate::accept::ConnectionLimits {
            total: args.max_connections as usize,
            per_peer: args.max_connections_per_peer as usize,
        },
    })
}

fn engine_options(args: &Args) -> Result<EngineOptions, ConfigError> {
    for (flag, d) in [
        ("--create-timeout", args.create_timeout),
        ("--configure-timeout", args.configure_timeout),
        ("--drain-timeout", args.drain_timeout),
        ("--delete-timeout", args.delete_timeout),
    ] {
        if d.is_zero() {
            return Err(ConfigError::invalid(format!("{flag} must be > 0")));
        }
    }
    Ok(EngineOptions {
        provider: args.provider.clone(),
        timeouts: Timeouts {
            create: args.create_timeout,
            configure: args.configure_timeout,
            drain: args.drain_timeout,
            delete: args.delete_timeout,
            ..Timeouts::default()
        },
        limits: Limits::default(),
    })
}

/// Every startup check, in order; the first failure is returned.
pub fn plan(args: &Args) -> Result<Plan, ConfigError> {
    let kind = choose_backend(args)?;
    let access = match kind {
        BackendKind::Proxmox => Some(proxmox_access(args)?),
        BackendKind::Fake => None,
    };
    if args.provider.trim().is_empty() {
        return Err(ConfigError::invalid("--provider must not be empty"));
    }
    let catalog = catalog(args, kind)?;
    let serving = serving(args)?;
    let backend = match access {
        Some(access) => BackendConfig::Proxmox(Box::new(ProxmoxConfig {
            access,
            options: pve_options(args, &catalog)?,
        })),
        None => BackendConfig::Fake {
            latency: args.fake_latency,
            node_memory_mib: args.fake_node_memory,
            node_memory_limit: args.node_memory_limit,
        },
    };
    let engine = engine_options(args)?;
    let state = state(args)?;
    Ok(Plan {
        backend,
        catalog,
        serving,
        reconcile: ReconcileConfig {
            interval: args.reconcile_interval,
            reclaim_failed_after: args.reclaim_failed_after,
        },
        state,
        engine,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args(extra: &[&str]) -> Args {
        let mut all = vec!["bigfleet-proxmox"];
        all.extend_from_slice(extra);
        Args::try_parse_from(all).expect("flags parse")
    }

    const REAL: &[&str] = &[
        "--proxmox-api-url",
        "https://pve1.test:8006/api2/json",
        "--proxmox-token-id",
        "bigfleet@pve!provider",
        "--proxmox-token-secret",
        "s",
        "--proxmox-tls-fingerprint",
        "AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89",
        "--nodes",
        "pve1,pve2",
    ];

    #[test]
    fn the_plan_holds_the_validated_sub_configs() {
        let mut flags = REAL.to_vec();
        flags.extend([
            "--bootstrap-exec",
            " /bin/bash , -e ",
            "--reconcile-interval",
            "0",
            "--shutdown-grace",
            "3s",
            "--reflection",
            "false",
            "--proxmox-pool",
            "bigfleet",
        ]);
        let plan = plan(&args(&flags)).expect("a valid plan");
        let BackendConfig::Proxmox(proxmox) = &plan.backend else {
            panic!("not the proxmox backend: {:?}", plan.backend);
        };
        let (access, options) = (&proxmox.access, &proxmox.options);
        assert_eq!(access.token_id, "bigfleet@pve!provider");
        assert_eq!(options.bootstrap_exec, ["/bin/bash", "-e"]);
        assert_eq!(options.pool.as_deref(), Some("bigfleet"));
        assert_eq!(plan.catalog.zones, ["pve1", "pve2"]);
        assert_eq!(plan.reconcile.interval, Duration::ZERO);
        assert_eq!(plan.serving.shutdown_grace, Duration::from_secs(3));
        assert!(!plan.serving.reflection);
        assert!(!format!("{plan:?}").contains("token_secret: \"s\""));
    }

    #[test]
    fn proxmox_options_are_refused_before_serving() {
        for (flag, value, says) in [
            (
                "--bootstrap-exec",
                " , ",
                "--bootstrap-exec must name a program",
            ),
            ("--max-parallel-clones", "0", "--max-parallel-clones"),
            ("--bootstrap-path", "relative", "--bootstrap-path"),
        ] {
            let mut flags = REAL.to_vec();
            flags.extend([flag, value]);
            let e = plan(&args(&flags)).expect_err(flag);
            assert!(e.to_string().contains(says), "{flag}: {e}");
            assert_eq!(e.kind(), crate::ConfigErrorKind::Invalid, "{flag}");
        }
    }

    #[test]
    fn the_fake_backend_takes_its_latency() {
        let plan = plan(&args(&["--use-fake-backend", "--fake-latency", "7ms"])).expect("plan");
        assert_eq!(plan.backend.kind(), BackendKind::Fake);
        assert!(matches!(
            plan.backend,
            BackendConfig::Fake { latency, .. } if latency == Duration::from_millis(7)
        ));
    }

    #[test]
    fn an_unreadable_file_keeps_its_cause() {
        let mut flags = REAL.to_vec();
        flags.extend(["--proxmox-ca-file", "/nonexistent/ca.pem"]);
        let e = plan(&args(&flags)).expect_err("unreadable CA");
        assert!(
            e.to_string()
                .starts_with("cannot read --proxmox-ca-file /nonexistent/ca.pem: "),
            "{e}"
        );
        assert_eq!(e.kind(), crate::ConfigErrorKind::Unreadable);
        let cause = std::error::Error::source(&e).expect("the I/O cause");
        assert!(cause.downcast_ref::<std::io::Error>().is_some());
    }

    #[test]
    fn a_misspelt_state_url_is_refused_without_its_password() {
        for value in [
            "POSTGRES://bf:Secret1@db:5432/bf",
            "host=db user=bf password=Secret1",
        ] {
            let e = plan(&args(&["--use-fake-backend", "--state", value]))
                .err()
                .unwrap_or_else(|| panic!("{value} served"))
                .to_string();
            assert!(e.starts_with("--state "), "{e}");
            assert!(e.contains("postgres://USER@HOST:PORT/DB"), "{e}");
            assert!(!e.contains("Secret1"), "{e}");
        }
    }

    #[test]
    fn state_is_nothing_a_path_or_a_postgres_url() {
        let fake = |extra: &[&str]| {
            let mut all = vec!["--use-fake-backend"];
            all.extend_from_slice(extra);
            plan(&args(&all))
        };
        assert!(fake(&[]).expect("plan").state.is_none());
        let sqlite = fake(&["--state", "/var/lib/bigfleet/state.db"]).expect("plan");
        assert!(
            matches!(&sqlite.state, Some(StateConfig { location: StateLocation::Sqlite(p), lease: None }) if p.ends_with("state.db")),
            "{:?}",
            sqlite.state
        );
        let pg = fake(&[
            "--state",
            "postgresql://bf@db.example:5433/bigfleet?sslmode=verify-full&sslrootcert=/ca.pem",
            "--state-password-file",
            "/run/secrets/pg",
        ])
        .expect("plan");
        let Some(StateConfig {
            location: StateLocation::Postgres {
                target, options, ..
            },
            lease: Some(lease),
        }) = &pg.state
        else {
            panic!("{:?}", pg.state);
        };
        assert_eq!(lease.ttl, DEFAULT_LEASE_TTL);
        assert!(!lease.replica.is_empty(), "the host name by default");
        assert_eq!(target.display(), "postgres://bf@db.example:5433/bigfleet");
        assert_eq!(
            options.password_file.as_deref(),
            Some(std::path::Path::new("/run/secrets/pg"))
        );
        assert_eq!(
            pg.state.as_ref().map(StateConfig::describe).as_deref(),
            Some("postgres://bf@db.example:5433/bigfleet")
        );
    }

    #[test]
    fn the_lease_flags_need_a_database_and_a_sane_ttl() {
        let e = plan(&args(&["--use-fake-backend", "--lease-ttl", "5s"]))
            .expect_err("no lease without a database");
        assert!(e.to_string().contains("need --state postgres://"), "{e}");
        let url = "postgres://bf@db/bigfleet?sslmode=verify-full";
        let e = plan(&args(&[
            "--use-fake-backend",
            "--state",
            url,
            "--lease-ttl",
            "100ms",
        ]))
        .expect_err("too short");
        assert!(
            e.to_string()
                .contains("--lease-ttl 100ms is out of range: use between 1s and 1m"),
            "{e}"
        );
        let e = plan(&args(&[
            "--use-fake-backend",
            "--state",
            url,
            "--replica-name",
            " ",
        ]))
        .expect_err("empty");
        assert!(e.to_string().contains("--replica-name must be"), "{e}");
        let ok = plan(&args(&[
            "--use-fake-backend",
            "--state",
            url,
            "--lease-ttl",
            "3s",
            "--replica-name",
            "pod-1",
        ]))
        .expect("plan");
        let Some(StateConfig {
            lease: Some(lease), ..
        }) = &ok.state
        else {
            panic!("{:?}", ok.state);
        };
        assert_eq!(
            (lease.ttl, lease.replica.as_str()),
            (Duration::from_secs(3), "pod-1")
        );
    }

    #[test]
    fn a_password_file_without_a_database_or_an_unverified_url_is_refused() {
        let e = plan(&args(&[
            "--use-fake-backend",
            "--state",
            "state.db",
            "--state-password-file",
            "/run/secrets/pg",
        ]))
        .expect_err("a file has no password");
        assert!(e.to_string().contains("needs --state postgres://"), "{e}");
        let e = plan(&args(&[
            "--use-fake-backend",
            "--state",
            "postgres://bf@db/bigfleet?sslmode=require",
        ]))
        .expect_err("require does not verify the server");
        assert_eq!(e.kind(), crate::ConfigErrorKind::Invalid);
        assert!(e.to_string().contains("use sslmode=verify-full"), "{e}");
    }
}
