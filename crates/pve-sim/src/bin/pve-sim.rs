//! Run the Proxmox VE API simulator standalone.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{ArgAction, Parser};
use pve_sim::{
    GuestAgentMode, HttpServerVersion, NodeMemory, PveSim, SimConfig, TagAccess, TagStyle,
    TemplateSpec,
};

#[derive(Parser, Debug)]
#[command(
    name = "pve-sim",
    about = "Proxmox VE API simulator (HTTPS, token auth, guest agent)"
)]
struct Args {
    /// Listen address (port 0 picks one).
    #[arg(long, default_value = "127.0.0.1:8006")]
    listen: SocketAddr,
    /// Comma-separated node names.
    #[arg(long, default_value = "pve1,pve2", value_delimiter = ',')]
    nodes: Vec<String>,
    /// Each node's memory (its `maxmem`): SIZE for every node, or
    /// NODE=SIZE,... per node (mixable: `16G,pve2=32G`). Sizes are bytes or
    /// K/M/G/T (= KiB/MiB/GiB/TiB).
    #[arg(long, default_value = "16T", value_parser = |s: &str| s.parse::<NodeMemory>())]
    node_memory: NodeMemory,
    /// Templates as VMID[@NODE][:shared], comma-separated (node defaults to the first).
    #[arg(long, default_value = "9000", value_delimiter = ',')]
    templates: Vec<String>,
    /// Pools that exist.
    #[arg(long, default_value = "bigfleet", value_delimiter = ',')]
    pools: Vec<String>,
    /// API token id USER@REALM!TOKENID.
    #[arg(long, default_value = "bigfleet@pve!autoscaler")]
    token_id: String,
    /// API token secret (default: a fixed test value).
    #[arg(long, env = "PVE_SIM_TOKEN_SECRET")]
    token_secret: Option<String>,
    /// Write the CA PEM here.
    #[arg(long)]
    ca_out: Option<PathBuf>,
    /// The official PVE API schema (pve-api-schema.json) to validate against in
    /// addition to the embedded description (default: $PVE_SIM_SCHEMA, else
    /// shared/spec/pve-api-schema.json beside the repository if present).
    #[arg(long)]
    schema: Option<PathBuf>,
    /// RRD lag of /cluster/resources (PVE: 10s; 0s = always fresh and complete).
    #[arg(long, default_value = "10s", value_parser = humantime_ms)]
    rrd_lag: Duration,
    /// Whole-answer staleness of /cluster/resources (0s = off).
    #[arg(long, default_value = "0s", value_parser = humantime_ms)]
    resources_staleness: Duration,
    /// Simulated pve-http-server version: before 5.2 errors carry their text
    /// only in the reason phrase; the body limit is 64 KiB before 5.2.1.
    #[arg(long, default_value_t = HttpServerVersion::CURRENT,
          value_parser = |s: &str| s.parse::<HttpServerVersion>())]
    pve_http_server_version: HttpServerVersion,
    /// Request body limit in bytes (default: by --pve-http-server-version).
    #[arg(long)]
    body_limit: Option<usize>,
    /// Return descriptions with PVE's trailing newline.
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    description_newline: bool,
    /// Tag normalisation: lowercase, case-sensitive or verbatim.
    #[arg(long, default_value = "lowercase", value_parser = |s: &str| s.parse::<TagStyle>())]
    tag_style: TagStyle,
    /// Agent file-write content and exec input-data are Latin-1 only
    /// ("Wide character" above U+00FF).
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    agent_latin1: bool,
    /// `;` separates form pairs like `&`.
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    form_semicolon_separator: bool,
    /// Turn every realism knob off (fresh resources, JSON error messages,
    /// verbatim descriptions and tags, UTF-8 agent data, `&`-only forms);
    /// explicit knob flags are ignored when set.
    #[arg(long)]
    forgiving: bool,
    /// Offline migration task duration.
    #[arg(long, default_value = "1s", value_parser = humantime_ms)]
    migrate_duration: Duration,
    /// How long a call routed to an offline node (`POST
    /// /_sim/nodes/{node}/offline`) hangs before its 595: the connect to a
    /// powered-off host waiting out ARP (PVE: about 3s).
    #[arg(long, default_value = "3s", value_parser = humantime_ms)]
    offline_delay: Duration,
    /// How long /cluster/resources keeps an offline node's VMs' last RRD
    /// sample before listing them `status: unknown` without name or
    /// template (pmxcfs: 5m).
    #[arg(long, default_value = "5m", value_parser = humantime_ms)]
    rrd_expiry: Duration,
    /// Clone task duration, e.g. 2s.
    #[arg(long, default_value = "2s", value_parser = humantime_ms)]
    clone_duration: Duration,
    /// Time from start until the guest agent answers.
    #[arg(long, default_value = "3s", value_parser = humantime_ms)]
    agent_boot_delay: Duration,
    /// Config lock wait before "got timeout" (PVE: 10s).
    #[arg(long, default_value = "1s", value_parser = humantime_ms)]
    lock_wait: Duration,
    /// Delay before a 401 (PVE: 3s).
    #[arg(long, default_value = "0s", value_parser = humantime_ms)]
    auth_failure_delay: Duration,
    /// Parallel clones per node+local storage before storage-lock timeouts (0 = unlimited).
    #[arg(long, default_value_t = 4)]
    max_parallel_local_clones: usize,
    /// Seed this many VMs marked as the provider's.
    #[arg(long, default_value_t = 0)]
    seed_marked_vms: usize,
    /// Guest agent: `auto` (qemu-ga when installed, else built-in), `builtin`,
    /// `qemu-ga` (required), or a path to a qemu-ga binary.
    #[arg(long, default_value = "auto", value_parser = |s: &str| s.parse::<GuestAgentMode>())]
    guest_agent: GuestAgentMode,
    /// The token's rights come from a pool ACL: VMs outside the first pool
    /// answer 403 and are not listed.
    #[arg(long)]
    pool_acl: bool,
    /// The clone worker's real timeline (temporary config on the source node;
    /// name, description, target node and pool at the end).
    #[arg(long)]
    clone_timeline: bool,
    /// Datacenter user-tag-access: free, none, existing[:TAGS] or list:TAGS.
    #[arg(long, default_value = "free", value_parser = |s: &str| s.parse::<TagAccess>())]
    tag_access: TagAccess,
    /// pveproxy closes keep-alive connections idle this long (0s = never).
    #[arg(long, default_value = "5s", value_parser = humantime_ms)]
    keepalive_idle: Duration,
    /// Close the connection after every response with status >= 400.
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    close_after_error: bool,
    /// datacenter.cfg's `next-id` range, LOWER:UPPER with UPPER exclusive
    /// as PVE writes it: what `GET /cluster/nextid` without `vmid`
    /// searches; a full range answers PVE's 500 `unable to get any free
    /// VMID in range [LOWER, UPPER]`.
    #[arg(long, default_value = "100:1000000", value_parser = next_id_range)]
    next_id: (u32, u32),
    /// The PVE major version the nodes run, 8 or 9: privilege names
    /// (`VM.Monitor` or `VM.GuestAgent.*`), `/version`, and how a task
    /// that warned ends (a destroy that cannot free a disk on a storage
    /// made busy with `POST /_sim/storages/{node}/{storage}/busy` ends
    /// `WARNINGS: N` on 9, `OK` on 8, with the warning in its log).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u8).range(8..=9))]
    pve_version: u8,
}

/// `LOWER:UPPER` (UPPER exclusive) as the inclusive range the simulator keeps.
fn next_id_range(s: &str) -> Result<(u32, u32), String> {
    let (lo, hi) = s
        .split_once(':')
        .ok_or_else(|| format!("--next-id {s:?}: write LOWER:UPPER, e.g. 100:1000000"))?;
    let parse = |v: &str| {
        v.trim()
            .parse::<u32>()
            .map_err(|_| format!("--next-id {s:?}: {v:?} is not a VMID"))
    };
    let (lo, hi) = (parse(lo)?, parse(hi)?);
    if lo < 100 || hi <= lo {
        return Err(format!(
            "--next-id {s:?}: LOWER must be at least 100 and below UPPER (UPPER is exclusive)"
        ));
    }
    Ok((lo, hi - 1))
}

/// Durations like `500ms`, `2s`, `1m`.
fn humantime_ms(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, mul) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1000)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60_000)
    } else {
        return Err(format!("duration '{s}' needs a unit (ms, s, m)"));
    };
    num.trim()
        .parse::<u64>()
        .map(|n| Duration::from_millis(n * mul))
        .map_err(|_| format!("invalid duration '{s}'"))
}

fn parse_template(spec: &str, default_node: &str) -> Result<TemplateSpec> {
    let (rest, shared) = match spec.strip_suffix(":shared") {
        Some(r) => (r, true),
        None => (spec, false),
    };
    let (id, node) = rest.split_once('@').unwrap_or((rest, default_node));
    let vmid: u32 = id
        .parse()
        .with_context(|| format!("template '{spec}': VMID '{id}' is not a number"))?;
    Ok(if shared {
        TemplateSpec::shared(vmid, node)
    } else {
        TemplateSpec::local(vmid, node)
    })
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour only for a person at a terminal, never into a log file.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let a = Args::parse();
    let Some(first) = a.nodes.first().cloned() else {
        bail!("--nodes must name at least one node");
    };
    if let Some(unknown) = a.node_memory.per_node.keys().find(|n| !a.nodes.contains(n)) {
        bail!(
            "--node-memory names node {unknown:?}, which is not in --nodes ({})",
            a.nodes.join(",")
        );
    }
    let templates = a
        .templates
        .iter()
        .map(|t| parse_template(t, &first))
        .collect::<Result<Vec<_>>>()?;
    let mut cfg = SimConfig {
        listen: a.listen,
        nodes: a.nodes,
        templates,
        pools: a.pools,
        token_id: a.token_id,
        schema_path: a.schema,
        clone_duration: a.clone_duration,
        agent_boot_delay: a.agent_boot_delay,
        lock_wait: a.lock_wait,
        auth_failure_delay: a.auth_failure_delay,
        max_parallel_local_clones: (a.max_parallel_local_clones > 0)
            .then_some(a.max_parallel_local_clones),
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
        tag_access: a.tag_access,
        keepalive_idle: (!a.keepalive_idle.is_zero()).then_some(a.keepalive_idle),
        close_after_error: a.close_after_error,
        vmid_range: a.next_id,
        pve9: a.pve_version == 9,
        ..SimConfig::default()
    };
    if a.forgiving {
        cfg = cfg.forgiving();
    }
    if let Some(s) = a.token_secret {
        cfg.token_secret = s;
    }
    let sim = PveSim::start(cfg).await?;
    tracing::info!(guest_agent = %sim.guest_agent_description(), "guest agent active");
    if a.seed_marked_vms > 0 {
        sim.seed_marked_vms(a.seed_marked_vms)?;
    }
    if let Some(p) = &a.ca_out {
        sim.write_ca(p)?;
    }
    // This is a test tool: printing the token lets users point a client at it.
    println!("base_url: {}", sim.base_url());
    println!("token_id: {}", sim.token_id());
    println!("token_secret: {}", sim.token_secret());
    match &a.ca_out {
        Some(p) => println!("ca_file: {}", p.display()),
        None => println!("ca_file: (not written; use --ca-out)"),
    }
    println!("fingerprint: {}", sim.fingerprint());
    println!("guest_agent: {}", sim.guest_agent_description());
    println!("schema: {}", sim.schema_source());
    let c = sim.config();
    println!(
        "realism: rrd_lag={:?} pve_http_server={} body_limit={} description_newline={} \
         tag_style={:?} agent_latin1={} form_semicolon_separator={}",
        c.rrd_lag,
        c.http_server_version,
        c.effective_body_limit(),
        c.description_newline,
        c.tag_style,
        c.agent_latin1,
        c.form_semicolon_separator
    );
    println!(
        "admin: POST {}/_sim/faults etc.",
        sim.base_url().trim_end_matches("/api2/json")
    );
    // SIGTERM too (what `kill` and process managers send): shutting down
    // stops every VM and with it each VM's qemu-ga.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("waiting for Ctrl-C")?,
        _ = term.recv() => {}
    }
    sim.shutdown().await;
    Ok(())
}
