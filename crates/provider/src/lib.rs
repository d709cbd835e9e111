//! The `bigfleet-proxmox` binary's composition root: configuration
//! ([`config`], validated into a [`Plan`] by [`plan`]), serving
//! ([`serve::run`]: the gRPC server, the metrics and probe listener, the
//! reconcile loop), metrics, logging and TLS. The Proxmox policy lives in
//! `proxmox-backend`, the contract engine in `providerkit`, the operator
//! client in `bigfleet-ctl`.

pub mod admin;
pub mod budget;
pub mod config;
pub mod layers;
pub mod logging;
pub mod metrics;
pub mod serve;
pub mod tls;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use providerkit::{AuxAddr, EngineOptions, Limits, Timeouts};

use crate::config::{Args, BackendChoice};
use proxmox_backend::catalog::{self, InstanceType, Pricing, Slot};

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
    pub pool: Option<String>,
}

impl std::fmt::Debug for ProxmoxAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxmoxAccess")
            .field("api_url", &self.api_url)
            .field("token_id", &self.token_id)
            .field("token_secret", &"<redacted>")
            .field("ca_pem", &self.ca_pem.as_ref().map(|c| c.len()))
            .field("fingerprints", &self.fingerprints.len())
            .field("pool", &self.pool)
            .finish()
    }
}

/// Everything startup validation produced; nothing has been bound yet.
pub struct Plan {
    pub backend: BackendKind,
    pub access: Option<ProxmoxAccess>,
    pub zones: Vec<String>,
    pub types: BTreeMap<String, InstanceType>,
    pub slots: Vec<Slot>,
    pub pricing: Pricing,
    pub addr: SocketAddr,
    pub metrics_addr: AuxAddr,
    pub security: tls::Security,
    pub tls: Option<Arc<rustls::ServerConfig>>,
    pub state: Option<PathBuf>,
    pub engine: EngineOptions,
    pub args: Args,
}

fn choose_backend(args: &Args) -> Result<BackendKind, String> {
    let has_url = args
        .proxmox_api_url
        .as_deref()
        .is_some_and(|u| !u.is_empty());
    match (args.proxmox_backend, args.use_fake_backend) {
        (BackendChoice::Proxmox, true) => {
            Err("--use-fake-backend conflicts with --proxmox-backend proxmox: choose one".into())
        }
        (BackendChoice::Proxmox, false) => Ok(BackendKind::Proxmox),
        (BackendChoice::Fake, true) => Ok(BackendKind::Fake),
        (BackendChoice::Fake, false) => Err(
            "--proxmox-backend fake is testing-only and must be requested explicitly: add \
             --use-fake-backend"
                .into(),
        ),
        (BackendChoice::Auto, true) if has_url => Err(
            "--use-fake-backend conflicts with --proxmox-api-url: a real deployment must not \
             silently simulate; drop one of them"
                .into(),
        ),
        (BackendChoice::Auto, true) => Ok(BackendKind::Fake),
        (BackendChoice::Auto, false) if has_url => Ok(BackendKind::Proxmox),
        (BackendChoice::Auto, false) => Err(
            "no backend selected: set --proxmox-api-url (with --proxmox-token-id, a token \
             secret, --nodes and --proxmox-ca-file or --proxmox-tls-fingerprint) to drive a \
             Proxmox cluster, or pass --use-fake-backend to run the in-memory simulator \
             (testing only)"
                .into(),
        ),
    }
}

fn proxmox_access(args: &Args) -> Result<ProxmoxAccess, String> {
    let api_url = args
        .proxmox_api_url
        .clone()
        .filter(|u| !u.is_empty())
        .ok_or("the proxmox backend needs --proxmox-api-url (e.g. https://pve1:8006/api2/json)")?;
    if !api_url.starts_with("https://") {
        return Err(format!(
            "--proxmox-api-url {api_url:?} must be an https:// URL (TLS is always verified)"
        ));
    }
    let token_id = args
        .proxmox_token_id
        .clone()
        .filter(|t| !t.is_empty())
        .ok_or("the proxmox backend needs --proxmox-token-id (USER@REALM!TOKENID)")?;
    if !token_id.contains('@') || !token_id.contains('!') {
        return Err(format!(
            "--proxmox-token-id {token_id:?} is not of the form USER@REALM!TOKENID"
        ));
    }
    let token_secret = match &args.proxmox_token_file {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read --proxmox-token-file {}: {e}", path.display()))?
            .trim()
            .to_string(),
        None => args.proxmox_token_secret.clone().unwrap_or_default(),
    };
    if token_secret.is_empty() {
        return Err(
            "the proxmox backend needs a token secret: set --proxmox-token-file (preferred) or \
             --proxmox-token-secret"
                .into(),
        );
    }
    let fingerprints = match args
        .proxmox_tls_fingerprint
        .as_deref()
        .filter(|f| !f.trim().is_empty())
    {
        Some(text) => pve::parse_fingerprints(text)
            .map_err(|e| format!("--proxmox-tls-fingerprint {text:?}: {e}"))?,
        None => Vec::new(),
    };
    if args.proxmox_ca_file.is_none() && fingerprints.is_empty() {
        return Err(
            "TLS verification material is required: set --proxmox-ca-file (the cluster CA, \
             /etc/pve/pve-root-ca.pem) or --proxmox-tls-fingerprint (the API certificate's \
             SHA-256); verification cannot be disabled"
                .into(),
        );
    }
    let ca_pem = match &args.proxmox_ca_file {
        Some(path) => {
            let pem = std::fs::read(path)
                .map_err(|e| format!("cannot read --proxmox-ca-file {}: {e}", path.display()))?;
            let certs = rustls_pemfile::certs(&mut pem.as_slice())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("--proxmox-ca-file {} is not PEM: {e}", path.display()))?;
            if certs.is_empty() {
                return Err(format!(
                    "--proxmox-ca-file {} holds no PEM certificate",
                    path.display()
                ));
            }
            Some(pem)
        }
        None => None,
    };
    if args.nodes.iter().all(|n| n.trim().is_empty()) {
        return Err("the proxmox backend needs --nodes (comma list of cluster node names)".into());
    }
    Ok(ProxmoxAccess {
        api_url,
        token_id,
        token_secret,
        ca_pem,
        fingerprints,
        pool: args.proxmox_pool.clone().filter(|p| !p.is_empty()),
    })
}

/// Every startup check, in order; the first failure is returned as one line.
pub fn plan(args: Args) -> Result<Plan, String> {
    let backend = choose_backend(&args)?;
    let access = match backend {
        BackendKind::Proxmox => Some(proxmox_access(&args)?),
        BackendKind::Fake => None,
    };
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
    if args.provider.trim().is_empty() {
        return Err("--provider must not be empty".into());
    }
    let types = match &args.instance_types {
        Some(path) => {
            catalog::load_instance_types(path, args.template_vmid).map_err(|e| e.to_string())?
        }
        None => catalog::builtin_instance_types(args.template_vmid),
    };
    let offerings = match &args.offerings {
        Some(path) => catalog::load_offerings(path).map_err(|e| e.to_string())?,
        None => catalog::builtin_offerings(&zones, args.seed_count),
    };
    let pricing = Pricing {
        explicit: match &args.prices {
            Some(text) => catalog::parse_prices(text).map_err(|e| e.to_string())?,
            None => Default::default(),
        },
        per_vcpu_hour: args.price_per_vcpu_hour,
        per_gib_hour: args.price_per_gib_hour,
    };
    let rate_ok = |r: f64| r.is_finite() && r >= 0.0;
    if !rate_ok(pricing.per_vcpu_hour) || !rate_ok(pricing.per_gib_hour) {
        return Err("--price-per-vcpu-hour and --price-per-gib-hour must be >= 0".into());
    }
    // The fake backend's nodes are whatever the offerings name.
    let zone_check = match backend {
        BackendKind::Proxmox => Some(zones.as_slice()),
        BackendKind::Fake => None,
    };
    let slots = catalog::expand_slots(&args.provider, &offerings, &types, zone_check, &pricing)
        .map_err(|e| e.to_string())?;
    let zones = match backend {
        BackendKind::Proxmox => zones,
        BackendKind::Fake => {
            let mut z: Vec<String> = slots.iter().map(|s| s.facts.zone.clone()).collect();
            z.sort();
            z.dedup();
            z
        }
    };
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
    if args.bootstrap_exec.split(',').all(|a| a.trim().is_empty()) {
        return Err("--bootstrap-exec must name a program".into());
    }
    for (flag, d) in [
        ("--create-timeout", args.create_timeout),
        ("--configure-timeout", args.configure_timeout),
        ("--drain-timeout", args.drain_timeout),
        ("--delete-timeout", args.delete_timeout),
    ] {
        if d.is_zero() {
            return Err(format!("{flag} must be > 0"));
        }
    }
    let engine = EngineOptions {
        provider: args.provider.clone(),
        timeouts: Timeouts {
            create: args.create_timeout,
            configure: args.configure_timeout,
            drain: args.drain_timeout,
            delete: args.delete_timeout,
            ..Timeouts::default()
        },
        limits: Limits::default(),
    };
    let state = if args.state.trim().is_empty() {
        None
    } else {
        Some(PathBuf::from(args.state.trim()))
    };
    Ok(Plan {
        backend,
        access,
        zones,
        types,
        slots,
        pricing,
        addr,
        metrics_addr,
        security,
        tls,
        state,
        engine,
        args,
    })
}
