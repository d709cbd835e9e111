//! `bigfleet-proxmox ctl`: an operator CLI that drives a running provider
//! over its own gRPC contract (plain, TLS or mTLS). It never prints the
//! bootstrap blob, and every failure is one line naming the RPC, the gRPC
//! code and what to check.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bigfleet_proto::v1alpha1::capacity_provider_client::CapacityProviderClient;
use bigfleet_proto::v1alpha1::{
    CapacityType, ConfigureRequest, CreateRequest, DeleteRequest, DrainRequest, ListFilter,
    Machine, MachineRef, MachineState, TransitionAck,
};
use clap::{Args, Subcommand, ValueEnum};
use hyper_util::rt::TokioIo;
use rustls::client::ResolvesClientCert;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, SignatureScheme};
use serde::Serialize;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;
use tonic::transport::{Channel, Endpoint};
use tonic::Code;

type Client = CapacityProviderClient<Channel>;

/// Operate a running provider: list, inspect and drive machines.
#[derive(Args, Debug, Clone)]
pub struct CtlArgs {
    /// Provider gRPC address: HOST:PORT, or an http:// or https:// URL.
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        value_name = "ADDR",
        default_value = "127.0.0.1:9000"
    )]
    pub target: String,

    /// CA (PEM) the provider's certificate must chain to; enables TLS.
    #[arg(
        id = "ctl_tls_ca",
        long = "tls-ca",
        global = true,
        help_heading = "Global options",
        value_name = "PATH"
    )]
    pub tls_ca: Option<PathBuf>,

    /// Client certificate (PEM) for mTLS; needs --tls-key.
    #[arg(
        id = "ctl_tls_cert",
        long = "tls-cert",
        global = true,
        help_heading = "Global options",
        value_name = "PATH"
    )]
    pub tls_cert: Option<PathBuf>,

    /// Client private key (PEM) for mTLS; needs --tls-cert.
    #[arg(
        id = "ctl_tls_key",
        long = "tls-key",
        global = true,
        help_heading = "Global options",
        value_name = "PATH"
    )]
    pub tls_key: Option<PathBuf>,

    /// Name the provider's certificate is checked against (default: the
    /// --target host).
    #[arg(
        id = "ctl_tls_domain",
        long = "tls-domain",
        global = true,
        help_heading = "Global options",
        value_name = "NAME"
    )]
    pub tls_domain: Option<String>,

    /// Connect timeout and per-RPC deadline.
    #[arg(long, global = true, help_heading = "Global options", value_name = "DURATION", default_value = "10s", value_parser = parse_positive_duration)]
    pub timeout: Duration,

    /// Output format on stdout.
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        value_enum,
        default_value = "table"
    )]
    pub output: Output,

    #[command(subcommand)]
    pub command: CtlCommand,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

#[derive(Subcommand, Debug, Clone)]
pub enum CtlCommand {
    /// List machines, optionally filtered by state.
    List {
        /// Only machines in this state (repeatable or comma list).
        #[arg(long = "state", value_delimiter = ',', value_parser = parse_state)]
        states: Vec<MachineState>,
        /// At most this many machines (0 = no cap).
        #[arg(long, value_parser = clap::value_parser!(i32).range(0..))]
        max: Option<i32>,
    },
    /// Show one machine.
    Get {
        /// Machine id, as `list` shows it.
        id: String,
    },
    /// SPECULATIVE -> CREATING -> IDLE.
    Create {
        /// Machine id, as `list` shows it.
        id: String,
        #[command(flatten)]
        fence: Fence,
        #[command(flatten)]
        wait: Wait,
    },
    /// IDLE -> CONFIGURING -> CONFIGURED, delivering the bootstrap blob.
    Configure {
        /// Machine id, as `list` shows it.
        id: String,
        /// Cluster the machine joins.
        #[arg(long)]
        cluster: String,
        /// File holding the bootstrap blob ("-" reads stdin); never printed.
        #[arg(long)]
        blob_file: PathBuf,
        /// Shard metadata KEY=VALUE, stored verbatim (repeatable).
        #[arg(long = "metadata", value_parser = parse_key_value)]
        metadata: Vec<(String, String)>,
        #[command(flatten)]
        fence: Fence,
        #[command(flatten)]
        wait: Wait,
    },
    /// CONFIGURED -> DRAINING -> IDLE.
    Drain {
        /// Machine id, as `list` shows it.
        id: String,
        /// Grace period handed to the in-guest drain, in seconds.
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i64).range(0..))]
        grace: i64,
        #[command(flatten)]
        fence: Fence,
        #[command(flatten)]
        wait: Wait,
    },
    /// IDLE -> DELETING -> SPECULATIVE.
    Delete {
        /// Machine id, as `list` shows it.
        id: String,
        #[command(flatten)]
        fence: Fence,
        #[command(flatten)]
        wait: Wait,
    },
    /// Print one line per observed state change until Ctrl-C or --until.
    Watch {
        /// Machine id, as `list` shows it.
        id: String,
        /// How often to poll.
        #[arg(long, default_value = "500ms", value_parser = parse_positive_duration)]
        interval: Duration,
        /// Stop (exit 0) once the machine is in this state.
        #[arg(long, value_parser = parse_state)]
        until: Option<MachineState>,
    },
}

/// Fencing token; all absent (the default) bypasses fencing.
#[derive(Args, Debug, Clone, Default)]
pub struct Fence {
    /// Shard id of the fencing token.
    #[arg(long, help_heading = "Fencing (default: absent)")]
    pub shard_id: Option<String>,
    /// Shard epoch of the fencing token.
    #[arg(long, requires = "shard_id", help_heading = "Fencing (default: absent)", value_parser = clap::value_parser!(i64).range(0..))]
    pub epoch: Option<i64>,
    /// Sequence number of the fencing token.
    #[arg(long, requires = "shard_id", help_heading = "Fencing (default: absent)", value_parser = clap::value_parser!(i64).range(0..))]
    pub sequence: Option<i64>,
}

impl Fence {
    fn token(&self) -> (String, i64, i64) {
        (
            self.shard_id.clone().unwrap_or_default(),
            self.epoch.unwrap_or(0),
            self.sequence.unwrap_or(0),
        )
    }
}

#[derive(Args, Debug, Clone)]
pub struct Wait {
    /// Poll until the target state (or FAILED), progress on stderr.
    #[arg(long, help_heading = "Waiting")]
    pub wait: bool,
    /// Give up waiting after this long (the transition keeps running).
    #[arg(long, help_heading = "Waiting", default_value = "30m", value_parser = parse_positive_duration)]
    pub wait_timeout: Duration,
    /// How often --wait polls.
    #[arg(long, help_heading = "Waiting", default_value = "500ms", value_parser = parse_positive_duration)]
    pub poll_interval: Duration,
}

fn parse_positive_duration(text: &str) -> Result<Duration, String> {
    let d = crate::config::parse_duration(text)?;
    if d.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(d)
}

const STATE_NAMES: &str =
    "SPECULATIVE, CREATING, IDLE, CONFIGURING, CONFIGURED, DRAINING, DELETING, FAILED";

/// Accepts `idle`, `IDLE` or `MACHINE_STATE_IDLE`.
pub fn parse_state(text: &str) -> Result<MachineState, String> {
    let upper = text.trim().to_ascii_uppercase().replace('-', "_");
    let full = if upper.starts_with("MACHINE_STATE_") {
        upper
    } else {
        format!("MACHINE_STATE_{upper}")
    };
    match MachineState::from_str_name(&full) {
        Some(MachineState::Unspecified) | None => Err(format!(
            "unknown machine state {text:?}: expected one of {STATE_NAMES}"
        )),
        Some(state) => Ok(state),
    }
}

fn parse_key_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("{text:?} is not KEY=VALUE with a non-empty KEY")),
    }
}

/// `IDLE` for a known state, `UNKNOWN(n)` for a value this build does not know.
pub fn state_name(value: i32) -> String {
    match MachineState::try_from(value) {
        Ok(s) => s
            .as_str_name()
            .trim_start_matches("MACHINE_STATE_")
            .to_string(),
        Err(_) => format!("UNKNOWN({value})"),
    }
}

fn capacity_name(value: i32) -> String {
    match CapacityType::try_from(value) {
        Ok(c) => c
            .as_str_name()
            .trim_start_matches("CAPACITY_TYPE_")
            .to_string(),
        Err(_) => format!("UNKNOWN({value})"),
    }
}

/// The JSON shape of a machine: plain names, sorted maps.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct MachineView {
    pub id: String,
    pub state: String,
    pub host: Option<HostView>,
    pub instance_type: String,
    pub zone: String,
    pub capacity_type: String,
    pub price_per_hour: f64,
    pub interruption_probability: f64,
    pub resources: BTreeMap<String, String>,
    pub allocatable: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
    pub cluster: String,
    pub shard_metadata: BTreeMap<String, String>,
    pub last_error: String,
}

#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct HostView {
    pub provider: String,
    #[serde(rename = "ref")]
    pub reference: String,
}

impl From<&Machine> for MachineView {
    fn from(m: &Machine) -> MachineView {
        let sorted = |map: &std::collections::HashMap<String, String>| {
            map.iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<BTreeMap<_, _>>()
        };
        MachineView {
            id: m.id.clone(),
            state: state_name(m.state),
            host: m.host.as_ref().map(|h| HostView {
                provider: h.provider.clone(),
                reference: h.r#ref.clone(),
            }),
            instance_type: m.instance_type.clone(),
            zone: m.zone.clone(),
            capacity_type: capacity_name(m.capacity_type),
            price_per_hour: m.price_per_hour,
            interruption_probability: m.interruption_probability,
            resources: m
                .resources
                .as_ref()
                .map(|r| sorted(&r.resources))
                .unwrap_or_default(),
            allocatable: m
                .allocatable
                .as_ref()
                .map(|r| sorted(&r.resources))
                .unwrap_or_default(),
            labels: sorted(&m.labels),
            cluster: m.cluster.clone(),
            shard_metadata: sorted(&m.shard_metadata),
            last_error: m.last_error.clone(),
        }
    }
}

#[derive(Serialize)]
struct AckView {
    operation_id: String,
    /// `null` when a waited-for Delete removed the machine entirely.
    machine: Option<MachineView>,
}

#[derive(Serialize)]
struct WatchLine {
    elapsed_ms: u128,
    machine: Option<MachineView>,
}

/// Escape control bytes so a hostile value cannot rewrite the terminal.
fn cell(text: &str) -> String {
    if text.is_empty() {
        return "-".into();
    }
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Left-aligned columns; the last column is not padded.
pub fn render_table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let last = cells.len().saturating_sub(1);
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i == last {
                s.push_str(c);
            } else {
                s.push_str(c);
                let pad = widths[i] - c.chars().count() + 2;
                s.extend(std::iter::repeat_n(' ', pad));
            }
        }
        s.trim_end().to_string()
    };
    let mut out = line(header.to_vec());
    out.push('\n');
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
        out.push('\n');
    }
    out
}

fn list_table(machines: &[Machine]) -> String {
    let rows: Vec<Vec<String>> = machines
        .iter()
        .map(|m| {
            vec![
                cell(&m.id),
                state_name(m.state),
                cell(m.host.as_ref().map(|h| h.r#ref.as_str()).unwrap_or("")),
                cell(&m.cluster),
                cell(&m.instance_type),
                cell(&m.zone),
                cell(&m.last_error),
            ]
        })
        .collect();
    render_table(
        &[
            "ID",
            "STATE",
            "HOST",
            "CLUSTER",
            "TYPE",
            "ZONE",
            "LAST_ERROR",
        ],
        &rows,
    )
}

fn map_cell(map: &BTreeMap<String, String>) -> String {
    if map.is_empty() {
        return "-".into();
    }
    map.iter()
        .map(|(k, v)| format!("{}={}", cell(k), cell(v)))
        .collect::<Vec<_>>()
        .join(",")
}

fn machine_details(m: &Machine) -> String {
    let v = MachineView::from(m);
    let host = v
        .host
        .as_ref()
        .map(|h| format!("{}/{}", cell(&h.provider), cell(&h.reference)))
        .unwrap_or_else(|| "-".into());
    let rows = [
        ("id", cell(&v.id)),
        ("state", v.state.clone()),
        ("host", host),
        ("instance_type", cell(&v.instance_type)),
        ("zone", cell(&v.zone)),
        ("capacity_type", v.capacity_type.clone()),
        ("price_per_hour", format!("{}", v.price_per_hour)),
        (
            "interruption_probability",
            format!("{}", v.interruption_probability),
        ),
        ("resources", map_cell(&v.resources)),
        ("allocatable", map_cell(&v.allocatable)),
        ("labels", map_cell(&v.labels)),
        ("cluster", cell(&v.cluster)),
        ("shard_metadata", map_cell(&v.shard_metadata)),
        ("last_error", cell(&v.last_error)),
    ];
    let mut out = String::new();
    for (k, val) in rows {
        out.push_str(&format!("{:<27}{val}\n", format!("{k}:")));
    }
    out
}

fn json<T: Serialize>(value: &T) -> Result<String, String> {
    serde_json::to_string_pretty(value)
        .map(|s| s + "\n")
        .map_err(|e| format!("cannot encode JSON output: {e}"))
}

fn emit(text: &str) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| format!("cannot write to stdout: {e}"))
}

fn elapsed(d: Duration) -> String {
    format!("{:.2}s", d.as_secs_f64())
}

/// gRPC's canonical upper-case code names, as operators see them in docs.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// `outer: inner: innermost`, skipping links that repeat what came before.
fn join_chain(first: String, mut next: Option<&(dyn std::error::Error + 'static)>) -> String {
    let mut parts: Vec<String> = vec![first];
    while let Some(e) = next {
        let text = e.to_string();
        if !text.is_empty() && parts.last().is_none_or(|p| !p.contains(&text)) {
            parts.push(text);
        }
        next = e.source();
    }
    parts.retain(|p| !p.is_empty());
    parts.join(": ")
}

fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    join_chain(err.to_string(), err.source())
}

/// Connection facts the error hints depend on.
struct Session {
    client: Client,
    target: String,
    tls: bool,
    client_cert: bool,
    timeout: Duration,
}

impl Session {
    fn status_error(&self, what: &str, status: &tonic::Status) -> String {
        let message = status.message().trim();
        let message = if message.is_empty() {
            String::new()
        } else {
            cell(message)
        };
        let detail = join_chain(message, std::error::Error::source(status));
        let mut msg = format!("{what}: {}", code_name(status.code()));
        if !detail.is_empty() {
            msg.push_str(&format!(": {detail}"));
        }
        let hint = match status.code() {
            Code::FailedPrecondition => {
                Some("fenced out: retry with a higher --epoch or --sequence".to_string())
            }
            // Locally generated transport failures carry a source; answers
            // from the provider never do.
            _ if std::error::Error::source(status).is_some()
                || status.code() == Code::Unavailable =>
            {
                Some(if !self.tls {
                    format!(
                        "check that the provider runs at {}; if it serves TLS, pass --tls-ca \
                         (and --tls-cert/--tls-key for mTLS)",
                        self.target
                    )
                } else if !self.client_cert {
                    format!(
                        "check that the provider runs at {} and whether it requires a client \
                         certificate (--tls-cert/--tls-key)",
                        self.target
                    )
                } else {
                    format!("check that the provider runs at {}", self.target)
                })
            }
            Code::DeadlineExceeded => Some(format!(
                "no answer within --timeout {}",
                humantime::format_duration(self.timeout)
            )),
            _ => None,
        };
        if let Some(hint) = hint {
            msg.push_str(&format!(" ({hint})"));
        }
        msg
    }

    async fn get(&mut self, id: &str) -> Result<Machine, tonic::Status> {
        self.client
            .get(MachineRef { id: id.to_string() })
            .await
            .map(tonic::Response::into_inner)
    }
}

fn split_target(target: &str) -> (Option<&str>, &str) {
    for scheme in ["http", "https"] {
        if let Some(rest) = target
            .strip_prefix(scheme)
            .and_then(|r| r.strip_prefix("://"))
        {
            return (Some(scheme), rest);
        }
    }
    (None, target)
}

fn read_pem_certs(flag: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem =
        std::fs::read(path).map_err(|e| format!("cannot read {flag} {}: {e}", path.display()))?;
    let certs = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{flag} {} is not PEM: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "{flag} {} holds no PEM certificate",
            path.display()
        ));
    }
    Ok(certs)
}

fn read_pem_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    let pem = std::fs::read(path)
        .map_err(|e| format!("cannot read --tls-key {}: {e}", path.display()))?;
    match rustls_pemfile::private_key(&mut pem.as_slice()) {
        Ok(Some(key)) => Ok(key),
        Ok(None) => Err(format!(
            "--tls-key {} holds no PEM private key",
            path.display()
        )),
        Err(e) => Err(format!(
            "--tls-key {} is not a PEM private key: {e}",
            path.display()
        )),
    }
}

/// Stands in for a missing client identity and records whether the server
/// asked for one, so a refused handshake can be explained instead of
/// surfacing later as a broken pipe.
#[derive(Debug, Default)]
struct CertRequestProbe(AtomicBool);

impl ResolvesClientCert for CertRequestProbe {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        self.0.store(true, Ordering::SeqCst);
        None
    }

    fn has_certs(&self) -> bool {
        false
    }
}

/// Everything a TLS dial needs, validated before the first connection.
struct TlsDial {
    roots: Arc<RootCertStore>,
    identity: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
    server_name: ServerName<'static>,
    address: String,
}

impl TlsDial {
    fn config(&self) -> Result<(ClientConfig, Option<Arc<CertRequestProbe>>), String> {
        let builder =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_protocol_versions(&[&rustls::version::TLS13])
                .map_err(|e| format!("TLS setup failed: {e}"))?
                .with_root_certificates(self.roots.clone());
        let (mut config, probe) = match &self.identity {
            Some((certs, key)) => (
                builder
                    .with_client_auth_cert(certs.clone(), key.clone_key())
                    .map_err(|e| {
                        format!("--tls-cert and --tls-key do not form a usable keypair: {e}")
                    })?,
                None,
            ),
            None => {
                let probe = Arc::new(CertRequestProbe::default());
                (
                    builder.with_client_cert_resolver(probe.clone()),
                    Some(probe),
                )
            }
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok((config, probe))
    }

    async fn dial(&self) -> std::io::Result<TokioIo<TlsStream<TcpStream>>> {
        let (config, probe) = self.config().map_err(std::io::Error::other)?;
        let tcp = TcpStream::connect(&self.address).await?;
        tcp.set_nodelay(true)?;
        let tls = TlsConnector::from(Arc::new(config))
            .connect(self.server_name.clone(), tcp)
            .await
            .map_err(|e| std::io::Error::other(format!("TLS handshake failed: {e}")))?;
        if probe.is_some_and(|p| p.0.load(Ordering::SeqCst)) {
            return Err(std::io::Error::other(
                "the provider requires a client certificate (mTLS): pass --tls-cert and \
                 --tls-key",
            ));
        }
        Ok(TokioIo::new(tls))
    }
}

fn tls_dial(args: &CtlArgs, authority: &str) -> Result<TlsDial, String> {
    let ca = args
        .tls_ca
        .as_deref()
        .ok_or("TLS needs --tls-ca: the CA (PEM) that signed the provider's certificate")?;
    let mut roots = RootCertStore::empty();
    for cert in read_pem_certs("--tls-ca", ca)? {
        roots
            .add(cert)
            .map_err(|e| format!("--tls-ca {}: unusable CA certificate: {e}", ca.display()))?;
    }
    let identity = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some((read_pem_certs("--tls-cert", cert)?, read_pem_key(key)?)),
        (None, None) => None,
        _ => return Err("--tls-cert and --tls-key must be given together".into()),
    };
    let uri: http::Uri = format!("https://{authority}")
        .parse()
        .map_err(|e| format!("--target {authority:?} is not a valid address: {e}"))?;
    let host = uri
        .host()
        .map(|h| h.trim_start_matches('[').trim_end_matches(']'))
        .filter(|h| !h.is_empty())
        .ok_or_else(|| format!("--target {authority:?} names no host"))?;
    let port = uri
        .port_u16()
        .ok_or_else(|| format!("--target {authority:?} names no port"))?;
    let name = args.tls_domain.as_deref().unwrap_or(host);
    let server_name = ServerName::try_from(name.to_string())
        .map_err(|e| format!("{name:?} is not a valid TLS server name: {e}"))?;
    let dial = TlsDial {
        roots: Arc::new(roots),
        identity,
        server_name,
        address: if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        },
    };
    // Surfaces a mismatched cert/key pair before anything is dialled.
    dial.config()?;
    Ok(dial)
}

async fn connect(args: &CtlArgs) -> Result<Session, String> {
    let target = args.target.trim();
    let (scheme, authority) = split_target(target);
    let authority = authority.trim_end_matches('/');
    if authority.is_empty() {
        return Err(format!("--target {target:?} names no host:port"));
    }
    let tls_flags = args.tls_ca.is_some()
        || args.tls_cert.is_some()
        || args.tls_key.is_some()
        || args.tls_domain.is_some();
    if scheme == Some("http") && tls_flags {
        return Err(format!(
            "--target {target} is http:// but --tls-* flags are set: use https:// or a bare \
             HOST:PORT"
        ));
    }
    let tls = tls_flags || scheme == Some("https");
    // TLS is layered by our own connector, so the channel URI stays http.
    let endpoint = Endpoint::from_shared(format!("http://{authority}"))
        .map_err(|e| format!("--target {target:?} is not a valid address: {e}"))?
        .connect_timeout(args.timeout)
        .timeout(args.timeout);
    let mut client_cert = false;
    let channel = if tls {
        let dial = Arc::new(tls_dial(args, authority)?);
        client_cert = dial.identity.is_some();
        let connector = tower::service_fn(move |_: http::Uri| {
            let dial = dial.clone();
            async move { dial.dial().await }
        });
        endpoint.connect_with_connector(connector).await
    } else {
        endpoint.connect().await
    };
    let channel =
        channel.map_err(|e| format!("cannot connect to {target}: {}", error_chain(&e)))?;
    Ok(Session {
        client: CapacityProviderClient::new(channel),
        target: target.to_string(),
        tls,
        client_cert,
        timeout: args.timeout,
    })
}

fn progress(start: Instant, id: &str, m: &Machine) {
    let mut line = format!(
        "[{:>8}] {}: {}",
        elapsed(start.elapsed()),
        cell(id),
        state_name(m.state)
    );
    if m.state == MachineState::Failed as i32 && !m.last_error.is_empty() {
        line.push_str(&format!(" ({})", cell(&m.last_error)));
    }
    eprintln!("{line}");
}

/// Ctrl-C, registered at creation: a bare `ctrl_c()` future only installs
/// its handler when first polled, so an early Ctrl-C would kill the process.
struct Interrupt {
    #[cfg(unix)]
    signal: tokio::signal::unix::Signal,
}

impl Interrupt {
    fn new() -> Result<Interrupt, String> {
        #[cfg(unix)]
        {
            let signal = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
                .map_err(|e| format!("cannot install the Ctrl-C handler: {e}"))?;
            Ok(Interrupt { signal })
        }
        #[cfg(not(unix))]
        {
            Ok(Interrupt {})
        }
    }

    async fn recv(&mut self) {
        #[cfg(unix)]
        {
            if self.signal.recv().await.is_none() {
                std::future::pending::<()>().await;
            }
        }
        #[cfg(not(unix))]
        {
            if tokio::signal::ctrl_c().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }
}

/// Poll until `target` (or FAILED); `None` when a Delete made Get answer
/// NOT_FOUND, i.e. the slot itself is gone.
async fn wait_for(
    session: &mut Session,
    id: &str,
    target: MachineState,
    accepted: Machine,
    opts: &Wait,
) -> Result<Option<Machine>, String> {
    let start = Instant::now();
    let mut ctrl_c = Interrupt::new()?;
    let mut current = accepted;
    progress(start, id, &current);
    loop {
        if current.state == target as i32 {
            return Ok(Some(current));
        }
        if current.state == MachineState::Failed as i32 {
            return Err(format!(
                "{} landed in FAILED after {}: {}",
                cell(id),
                elapsed(start.elapsed()),
                cell(&current.last_error)
            ));
        }
        if start.elapsed() >= opts.wait_timeout {
            return Err(format!(
                "gave up after --wait-timeout {}: {} is still {} (the transition continues on \
                 the provider)",
                humantime::format_duration(opts.wait_timeout),
                cell(id),
                state_name(current.state)
            ));
        }
        tokio::select! {
            _ = tokio::time::sleep(opts.poll_interval) => {}
            _ = ctrl_c.recv() => {
                return Err(format!(
                    "interrupted while {} was {} (the transition continues on the provider)",
                    cell(id),
                    state_name(current.state)
                ));
            }
        }
        let next = match session.get(id).await {
            Ok(m) => m,
            Err(s) if s.code() == Code::NotFound && target == MachineState::Speculative => {
                eprintln!("[{:>8}] {}: gone", elapsed(start.elapsed()), cell(id));
                return Ok(None);
            }
            Err(s) => return Err(session.status_error(&format!("Get {}", cell(id)), &s)),
        };
        if next.state != current.state {
            progress(start, id, &next);
        }
        current = next;
    }
}

async fn mutate(
    session: &mut Session,
    output: Output,
    rpc: &str,
    id: &str,
    target: MachineState,
    wait: &Wait,
    ack: Result<tonic::Response<TransitionAck>, tonic::Status>,
) -> Result<(), String> {
    let ack = ack
        .map_err(|s| session.status_error(&format!("{rpc} {}", cell(id)), &s))?
        .into_inner();
    let snapshot = ack.machine.clone().unwrap_or_else(|| Machine {
        id: id.to_string(),
        ..Machine::default()
    });
    // `None`: a waited-for Delete removed the machine entirely.
    let machine = if wait.wait {
        wait_for(session, id, target, snapshot, wait).await?
    } else {
        Some(snapshot)
    };
    let text = match output {
        Output::Json => json(&AckView {
            operation_id: ack.operation_id.clone(),
            machine: machine.as_ref().map(MachineView::from),
        })?,
        Output::Table => {
            let state = machine
                .as_ref()
                .map(|m| state_name(m.state))
                .unwrap_or_else(|| "gone".into());
            format!(
                "{}: {state} (operation {})\n",
                cell(id),
                cell(&ack.operation_id)
            )
        }
    };
    emit(&text)
}

fn read_blob(path: &Path) -> Result<Vec<u8>, String> {
    if path == Path::new("-") {
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut buf)
            .map_err(|e| format!("cannot read the bootstrap blob from stdin: {e}"))?;
        return Ok(buf);
    }
    std::fs::read(path).map_err(|e| format!("cannot read --blob-file {}: {e}", path.display()))
}

fn metadata_map(
    pairs: &[(String, String)],
) -> Result<std::collections::HashMap<String, String>, String> {
    let mut map = std::collections::HashMap::new();
    for (k, v) in pairs {
        if map.insert(k.clone(), v.clone()).is_some() {
            return Err(format!("--metadata key {k:?} is given more than once"));
        }
    }
    Ok(map)
}

async fn watch(
    session: &mut Session,
    output: Output,
    id: &str,
    interval: Duration,
    until: Option<MachineState>,
) -> Result<(), String> {
    let start = Instant::now();
    let mut ctrl_c = Interrupt::new()?;
    let mut last: Option<i32> = None;
    loop {
        let machine = match session.get(id).await {
            Ok(m) => Some(m),
            // A machine we already saw can vanish when its slot is gone.
            Err(s) if s.code() == Code::NotFound && last.is_some() => None,
            Err(s) => return Err(session.status_error(&format!("Get {}", cell(id)), &s)),
        };
        let state = machine.as_ref().map(|m| m.state);
        if state.is_none() || state != last {
            let text = match output {
                Output::Json => {
                    let line = WatchLine {
                        elapsed_ms: start.elapsed().as_millis(),
                        machine: machine.as_ref().map(MachineView::from),
                    };
                    serde_json::to_string(&line)
                        .map_err(|e| format!("cannot encode JSON output: {e}"))?
                        + "\n"
                }
                Output::Table => {
                    let mut line = format!(
                        "[{:>8}] {}: {}",
                        elapsed(start.elapsed()),
                        cell(id),
                        state.map(state_name).unwrap_or_else(|| "gone".into())
                    );
                    if let Some(m) = &machine {
                        if m.state == MachineState::Failed as i32 && !m.last_error.is_empty() {
                            line.push_str(&format!(" ({})", cell(&m.last_error)));
                        }
                    }
                    line + "\n"
                }
            };
            emit(&text)?;
        }
        let Some(state) = state else {
            return match until {
                None | Some(MachineState::Speculative) => Ok(()),
                Some(u) => Err(format!(
                    "{} is gone; it will never reach {}",
                    cell(id),
                    state_name(u as i32)
                )),
            };
        };
        last = Some(state);
        if let Some(u) = until {
            if state == u as i32 {
                return Ok(());
            }
            if state == MachineState::Failed as i32 {
                return Err(format!(
                    "{} is FAILED and will not reach {}",
                    cell(id),
                    state_name(u as i32)
                ));
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = ctrl_c.recv() => return Ok(()),
        }
    }
}

/// Run one `ctl` invocation; the error is the one line to print.
pub async fn run(args: CtlArgs) -> Result<(), String> {
    // Local input problems are reported before anything is dialled.
    let blob = match &args.command {
        CtlCommand::Configure { blob_file, .. } => Some(read_blob(blob_file)?),
        _ => None,
    };
    let mut session = connect(&args).await?;
    let output = args.output;
    match args.command {
        CtlCommand::List { states, max } => {
            let filter = ListFilter {
                states: states.iter().map(|s| *s as i32).collect(),
                max_results: max.unwrap_or(0),
                since_revision: Vec::new(),
            };
            let list = session
                .client
                .list(filter)
                .await
                .map_err(|s| session.status_error("List", &s))?
                .into_inner();
            let text = match output {
                Output::Json => json(
                    &list
                        .machines
                        .iter()
                        .map(MachineView::from)
                        .collect::<Vec<_>>(),
                )?,
                Output::Table => list_table(&list.machines),
            };
            emit(&text)
        }
        CtlCommand::Get { id } => {
            let m = session
                .get(&id)
                .await
                .map_err(|s| session.status_error(&format!("Get {}", cell(&id)), &s))?;
            let text = match output {
                Output::Json => json(&MachineView::from(&m))?,
                Output::Table => machine_details(&m),
            };
            emit(&text)
        }
        CtlCommand::Create { id, fence, wait } => {
            let (shard_id, shard_epoch, sequence_number) = fence.token();
            let req = CreateRequest {
                machine_id: id.clone(),
                shard_id,
                shard_epoch,
                sequence_number,
            };
            let ack = session.client.create(req).await;
            mutate(
                &mut session,
                output,
                "Create",
                &id,
                MachineState::Idle,
                &wait,
                ack,
            )
            .await
        }
        CtlCommand::Configure {
            id,
            cluster,
            metadata,
            fence,
            wait,
            ..
        } => {
            let (shard_id, shard_epoch, sequence_number) = fence.token();
            let req = ConfigureRequest {
                machine_id: id.clone(),
                cluster_id: cluster,
                bootstrap_blob: blob.unwrap_or_default(),
                shard_id,
                shard_epoch,
                sequence_number,
                shard_metadata: metadata_map(&metadata)?,
            };
            let ack = session.client.configure(req).await;
            mutate(
                &mut session,
                output,
                "Configure",
                &id,
                MachineState::Configured,
                &wait,
                ack,
            )
            .await
        }
        CtlCommand::Drain {
            id,
            grace,
            fence,
            wait,
        } => {
            let (shard_id, shard_epoch, sequence_number) = fence.token();
            let req = DrainRequest {
                machine_id: id.clone(),
                grace_period_seconds: grace,
                shard_id,
                shard_epoch,
                sequence_number,
            };
            let ack = session.client.drain(req).await;
            mutate(
                &mut session,
                output,
                "Drain",
                &id,
                MachineState::Idle,
                &wait,
                ack,
            )
            .await
        }
        CtlCommand::Delete { id, fence, wait } => {
            let (shard_id, shard_epoch, sequence_number) = fence.token();
            let req = DeleteRequest {
                machine_id: id.clone(),
                shard_id,
                shard_epoch,
                sequence_number,
            };
            let ack = session.client.delete(req).await;
            mutate(
                &mut session,
                output,
                "Delete",
                &id,
                MachineState::Speculative,
                &wait,
                ack,
            )
            .await
        }
        CtlCommand::Watch {
            id,
            interval,
            until,
        } => watch(&mut session, output, &id, interval, until).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bigfleet_proto::v1alpha1::{HostRef, Resources};
    use clap::{CommandFactory, Parser};

    /// Mirrors how the binary mounts `ctl`: a parent with its own
    /// --tls-* flags and an optional subcommand.
    #[derive(Parser, Debug)]
    struct Parent {
        #[arg(long)]
        tls_ca: Option<PathBuf>,
        #[arg(long)]
        tls_cert: Option<PathBuf>,
        #[command(subcommand)]
        command: Option<ParentCommand>,
    }

    #[derive(Subcommand, Debug)]
    enum ParentCommand {
        Ctl(CtlArgs),
    }

    fn parse(argv: &[&str]) -> Result<CtlArgs, clap::Error> {
        let mut full = vec!["bigfleet-proxmox", "ctl"];
        full.extend_from_slice(argv);
        Parent::try_parse_from(full).map(|p| match p.command {
            Some(ParentCommand::Ctl(c)) => c,
            None => panic!("no subcommand parsed"),
        })
    }

    #[test]
    fn clap_definition_is_consistent() {
        Parent::command().debug_assert();
        crate::config::Args::command().debug_assert();
    }

    #[test]
    fn the_binary_flags_mount_ctl() {
        let args = crate::config::Args::try_parse_from([
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
            Some(crate::config::Command::Ctl(ctl)) => {
                assert_eq!(ctl.target, "h:1");
                assert_eq!(ctl.tls_ca.as_deref(), Some(Path::new("/ca.pem")));
                assert!(matches!(
                    ctl.command,
                    CtlCommand::Watch {
                        until: Some(MachineState::Idle),
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
    fn global_options_work_before_and_after_the_subcommand() {
        let a = parse(&[
            "--target", "h:1", "--output", "json", "list", "--state", "idle",
        ])
        .unwrap();
        assert_eq!(a.target, "h:1");
        assert_eq!(a.output, Output::Json);
        let b = parse(&[
            "list",
            "--tls-ca",
            "/ca.pem",
            "--state",
            "IDLE,failed",
            "--max",
            "3",
        ])
        .unwrap();
        assert_eq!(b.tls_ca.as_deref(), Some(Path::new("/ca.pem")));
        match b.command {
            CtlCommand::List { states, max } => {
                assert_eq!(states, vec![MachineState::Idle, MachineState::Failed]);
                assert_eq!(max, Some(3));
            }
            other => panic!("parsed {other:?}"),
        }
        assert_eq!(b.timeout, Duration::from_secs(10));
        assert_eq!(b.target, "127.0.0.1:9000");
    }

    #[test]
    fn mutating_commands_parse_fencing_and_wait() {
        let a = parse(&[
            "configure",
            "m1",
            "--cluster",
            "c1",
            "--blob-file",
            "/b",
            "--metadata",
            "a=1",
            "--metadata",
            "b=x=y",
            "--shard-id",
            "s",
            "--epoch",
            "2",
            "--sequence",
            "9",
            "--wait",
            "--poll-interval",
            "50ms",
        ])
        .unwrap();
        match a.command {
            CtlCommand::Configure {
                id,
                cluster,
                metadata,
                fence,
                wait,
                ..
            } => {
                assert_eq!(id, "m1");
                assert_eq!(cluster, "c1");
                assert_eq!(
                    metadata,
                    vec![("a".into(), "1".into()), ("b".into(), "x=y".into())]
                );
                assert_eq!(fence.token(), ("s".into(), 2, 9));
                assert!(wait.wait);
                assert_eq!(wait.poll_interval, Duration::from_millis(50));
            }
            other => panic!("parsed {other:?}"),
        }
        match parse(&["create", "m1"]).unwrap().command {
            CtlCommand::Create { fence, wait, .. } => {
                assert_eq!(fence.token(), (String::new(), 0, 0));
                assert!(!wait.wait);
            }
            other => panic!("parsed {other:?}"),
        }
    }

    #[test]
    fn bad_input_is_rejected_by_the_parser() {
        assert!(parse(&["list", "--state", "sleeping"]).is_err());
        assert!(parse(&["drain", "m1", "--grace", "-1"]).is_err());
        assert!(parse(&["create", "m1", "--epoch", "1"]).is_err());
        assert!(parse(&["create", "m1", "--shard-id", "s", "--epoch", "-1"]).is_err());
        assert!(parse(&["watch", "m1", "--interval", "0"]).is_err());
        assert!(parse(&["configure", "m1", "--cluster", "c"]).is_err());
        assert!(parse(&[
            "configure",
            "m1",
            "--cluster",
            "c",
            "--blob-file",
            "b",
            "--metadata",
            "=v"
        ])
        .is_err());
    }

    #[test]
    fn states_parse_in_every_spelling() {
        assert_eq!(parse_state("idle"), Ok(MachineState::Idle));
        assert_eq!(parse_state("CONFIGURED"), Ok(MachineState::Configured));
        assert_eq!(
            parse_state("MACHINE_STATE_DRAINING"),
            Ok(MachineState::Draining)
        );
        let err = parse_state("unspecified").unwrap_err();
        assert!(err.contains("SPECULATIVE"), "{err}");
        assert_eq!(state_name(3), "IDLE");
        assert_eq!(state_name(99), "UNKNOWN(99)");
    }

    #[test]
    fn duplicate_metadata_keys_are_an_error() {
        let pairs = vec![("k".to_string(), "1".to_string()), ("k".into(), "2".into())];
        assert!(metadata_map(&pairs).unwrap_err().contains("\"k\""));
    }

    fn machine() -> Machine {
        Machine {
            id: "p/OnDemand/pve.small/z/000".into(),
            state: MachineState::Failed as i32,
            host: Some(HostRef {
                provider: "proxmox".into(),
                r#ref: "z/101".into(),
            }),
            instance_type: "pve.small".into(),
            zone: "z".into(),
            capacity_type: CapacityType::OnDemand as i32,
            price_per_hour: 0.5,
            resources: Some(Resources {
                resources: [("cpu".to_string(), "2".to_string())].into(),
            }),
            shard_metadata: [("b".to_string(), "2".to_string()), ("a".into(), "1".into())].into(),
            last_error: "clone failed\nlock timeout".into(),
            ..Machine::default()
        }
    }

    #[test]
    fn json_view_uses_plain_names() {
        let v = serde_json::to_value(MachineView::from(&machine())).unwrap();
        assert_eq!(v["state"], "FAILED");
        assert_eq!(v["capacity_type"], "ON_DEMAND");
        assert_eq!(v["host"]["ref"], "z/101");
        assert_eq!(v["resources"]["cpu"], "2");
        assert_eq!(v["shard_metadata"]["a"], "1");
        assert_eq!(v["last_error"], "clone failed\nlock timeout");
        let bare = serde_json::to_value(MachineView::from(&Machine::default())).unwrap();
        assert!(bare["host"].is_null());
        assert_eq!(bare["state"], "UNSPECIFIED");
    }

    #[test]
    fn table_aligns_columns_and_escapes_control_bytes() {
        let text = list_table(&[machine()]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(lines[0].starts_with("ID  "), "{text}");
        let col = lines[0].find("STATE").unwrap();
        assert_eq!(&lines[1][col..col + 6], "FAILED");
        assert!(lines[1].ends_with("clone failed\\nlock timeout"), "{text}");
        assert!(
            lines[1].contains("  -  "),
            "empty cluster shows '-': {text}"
        );
        let details = machine_details(&machine());
        assert!(details.contains("host:"));
        assert!(details.contains("proxmox/z/101"));
        assert!(
            details.contains("shard_metadata:            a=1,b=2"),
            "{details}"
        );
        assert!(
            details.contains("interruption_probability:  0\n"),
            "{details}"
        );
    }

    #[test]
    fn targets_split_into_scheme_and_authority() {
        assert_eq!(split_target("h:1"), (None, "h:1"));
        assert_eq!(split_target("https://h:1"), (Some("https"), "h:1"));
        assert_eq!(split_target("http://[::1]:9"), (Some("http"), "[::1]:9"));
    }

    #[tokio::test]
    async fn tls_misconfiguration_fails_before_dialling() {
        let base = parse(&["list"]).unwrap();
        let https = CtlArgs {
            target: "https://127.0.0.1:1".into(),
            ..base.clone()
        };
        let err = connect(&https).await.err().unwrap();
        assert!(err.contains("--tls-ca"), "{err}");
        let mixed = CtlArgs {
            target: "http://127.0.0.1:1".into(),
            tls_ca: Some("/nonexistent".into()),
            ..base.clone()
        };
        let err = connect(&mixed).await.err().unwrap();
        assert!(err.contains("http://"), "{err}");
        let missing = CtlArgs {
            tls_ca: Some("/nonexistent/ca.pem".into()),
            ..base.clone()
        };
        let err = connect(&missing).await.err().unwrap();
        assert!(
            err.contains("cannot read --tls-ca /nonexistent/ca.pem"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn unreachable_target_names_the_address() {
        // A port nothing listens on: bind, learn it, release it.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let args = CtlArgs {
            target: format!("127.0.0.1:{port}"),
            ..parse(&["list"]).unwrap()
        };
        let err = connect(&args).await.err().unwrap();
        assert!(
            err.starts_with(&format!("cannot connect to 127.0.0.1:{port}")),
            "{err}"
        );
    }
}
