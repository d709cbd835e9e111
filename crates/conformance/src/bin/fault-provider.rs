//! Test-only provider for the fault lane: providerkit's engine over an in-memory backend whose
//! failures are steered per machine over a line-based control endpoint:
//!
//! - `SET <machine_id> <create|configure|drain|delete> <error|hang|late MS>`
//! - `SET <machine_id> ready <hold|never>` then `READY <machine_id>` releases a hold
//! - `CLEAR <machine_id>`
//!
//! Every command answers `OK` or `ERR <reason>`.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use async_trait::async_trait;
use bigfleet_proto::v1alpha1::CapacityType;
use clap::Parser;
use parking_lot::Mutex;
use providerkit::service::CapacityService;
use providerkit::{
    bind_aux, AuxAddr, AuxListener, Backend, BackendError, CatalogFacts, ConfigureCtx, CreateCtx,
    DeleteCtx, DrainCtx, Engine, EngineOptions, MemoryStore, SlotSpec, SubstrateHost, Timeouts,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

#[derive(Parser, Debug)]
struct Cli {
    #[arg(long)]
    addr: SocketAddr,
    /// Fault control endpoint; without it no fault can be injected.
    #[arg(long)]
    control_addr: Option<SocketAddr>,
    #[arg(long, default_value_t = 64)]
    seed_count: usize,
    /// Latency of each successful substrate call.
    #[arg(long, alias = "fake-latency", default_value = "50ms", value_parser = humantime::parse_duration)]
    latency: Duration,
    /// Accepted for command-line compatibility with real providers and IGNORED: this provider
    /// keeps everything in memory, so the durable lane must fail against it.
    #[arg(long)]
    state: Option<String>,
    /// Accepted for command-line compatibility (always a fake backend).
    #[arg(long)]
    use_fake_backend: bool,
    /// Accepted for command-line compatibility (the label is not used).
    #[arg(long)]
    provider: Option<String>,
    /// Bound like a real provider's metrics listener, default `:9090` (a
    /// taken default is a warning, a taken explicit address is fatal), so
    /// the boot-compatibility check sees the same port behaviour; nothing
    /// is served on it. Empty = off.
    #[arg(long)]
    metrics_addr: Option<String>,
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    create_timeout: Duration,
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    configure_timeout: Duration,
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    drain_timeout: Duration,
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    delete_timeout: Duration,
    /// Background reconcile period; 0 turns it off.
    #[arg(long, default_value = "200ms", value_parser = parse_period)]
    reconcile_interval: Duration,
    /// Deliberately broken engine behaviour (needs the `mutants` feature):
    /// fence-per-shard, truncate-metadata, oop-failed-precondition, bump-revision-on-reconcile,
    /// frozen-list-head, reject-negative-tokens, fatal-default-metrics-bind.
    #[arg(long)]
    mutant: Vec<String>,
}

fn parse_period(s: &str) -> Result<Duration, String> {
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e}"))
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Error,
    Hang,
    Late(Duration),
    Hold,
    Never,
}

#[derive(Default)]
struct Faults {
    modes: HashMap<(String, String), Mode>,
    released: HashSet<String>,
}

struct FaultBackend {
    slots: usize,
    latency: Duration,
    faults: Arc<Mutex<Faults>>,
}

impl FaultBackend {
    async fn act(&self, id: &str, op: &str) -> Result<(), BackendError> {
        let mode = self
            .faults
            .lock()
            .modes
            .get(&(id.to_string(), op.to_string()))
            .copied();
        match mode {
            Some(Mode::Error) => Err(BackendError::new(format!("injected {op} failure for {id}"))),
            Some(Mode::Hang) => futures::future::pending().await,
            Some(Mode::Late(d)) => {
                tokio::time::sleep(d).await;
                Ok(())
            }
            _ => {
                tokio::time::sleep(self.latency).await;
                Ok(())
            }
        }
    }
}

#[async_trait]
impl Backend for FaultBackend {
    async fn describe(&self) -> Result<Vec<SlotSpec>, BackendError> {
        let kv = |p: &[(&str, &str)]| {
            p.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<HashMap<_, _>>()
        };
        let facts = CatalogFacts {
            instance_type: "f.small".into(),
            zone: "zone-a".into(),
            capacity_type: CapacityType::OnDemand,
            price_per_hour: 0.05,
            interruption_probability: 0.0,
            resources: kv(&[("cpu", "2"), ("memory", "4Gi")]),
            allocatable: kv(&[("cpu", "4"), ("memory", "8Gi")]),
            labels: HashMap::new(),
        }
        .share();
        Ok((0..self.slots)
            .map(|i| SlotSpec {
                id: format!("fault/OnDemand/f.small/zone-a/{i:04}"),
                facts: facts.clone(),
                host: None,
            })
            .collect())
    }

    async fn create(&self, ctx: CreateCtx) -> Result<SubstrateHost, BackendError> {
        self.act(&ctx.machine_id, "create").await?;
        Ok(SubstrateHost {
            host_ref: format!(
                "fault-node/{}",
                ctx.machine_id.rsplit('/').next().unwrap_or("0")
            ),
        })
    }

    async fn configure(&self, ctx: &ConfigureCtx) -> Result<(), BackendError> {
        self.act(&ctx.machine_id, "configure").await
    }

    async fn drain(&self, ctx: DrainCtx) -> Result<(), BackendError> {
        self.act(&ctx.machine_id, "drain").await
    }

    fn supports_delete(&self) -> bool {
        true
    }

    async fn delete(&self, ctx: DeleteCtx) -> Result<(), BackendError> {
        self.act(&ctx.machine_id, "delete").await
    }

    fn supports_readiness(&self) -> bool {
        true
    }

    async fn node_ready(&self, ctx: &ConfigureCtx) -> Result<bool, BackendError> {
        let f = self.faults.lock();
        Ok(
            match f.modes.get(&(ctx.machine_id.clone(), "ready".to_string())) {
                Some(Mode::Never) => false,
                Some(Mode::Hold) => f.released.contains(&ctx.machine_id),
                _ => true,
            },
        )
    }
}

fn apply(faults: &Mutex<Faults>, line: &str) -> anyhow::Result<()> {
    let parts: Vec<&str> = line.split_whitespace().collect();
    let mut f = faults.lock();
    match parts.as_slice() {
        ["SET", id, op, rest @ ..] => {
            let mode = match (op, rest) {
                (&"ready", ["hold"]) => Mode::Hold,
                (&"ready", ["never"]) => Mode::Never,
                (&("create" | "configure" | "drain" | "delete"), ["error"]) => Mode::Error,
                (&("create" | "configure" | "drain" | "delete"), ["hang"]) => Mode::Hang,
                (&("create" | "configure" | "drain" | "delete"), ["late", ms]) => {
                    Mode::Late(Duration::from_millis(
                        ms.parse()
                            .with_context(|| format!("bad milliseconds {ms:?}"))?,
                    ))
                }
                _ => bail!("unknown fault {op} {rest:?}"),
            };
            f.modes.insert((id.to_string(), op.to_string()), mode);
        }
        ["READY", id] => {
            f.released.insert(id.to_string());
        }
        ["CLEAR", id] => {
            f.modes.retain(|(m, _), _| m != id);
            f.released.remove(*id);
        }
        _ => bail!("unknown command {line:?}"),
    }
    Ok(())
}

async fn control(listener: TcpListener, faults: Arc<Mutex<Faults>>) {
    loop {
        let Ok((sock, _)) = listener.accept().await else {
            continue;
        };
        let faults = faults.clone();
        tokio::spawn(async move {
            let (r, mut w) = sock.into_split();
            let mut lines = BufReader::new(r).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let reply = match apply(&faults, &line) {
                    Ok(()) => "OK\n".to_string(),
                    Err(e) => format!("ERR {e:#}\n"),
                };
                if w.write_all(reply.as_bytes()).await.is_err() {
                    break;
                }
            }
        });
    }
}

fn options(cli: &Cli) -> anyhow::Result<EngineOptions> {
    #[allow(unused_mut)]
    let mut opts = EngineOptions {
        provider: "fault".into(),
        timeouts: Timeouts {
            create: cli.create_timeout,
            configure: cli.configure_timeout,
            drain: cli.drain_timeout,
            delete: cli.delete_timeout,
            readiness_poll: Duration::from_millis(20),
        },
        ..EngineOptions::default()
    };
    #[cfg(not(feature = "mutants"))]
    if let Some(m) = cli.mutant.first() {
        bail!("--mutant {m} needs the fault-provider built with the `mutants` feature");
    }
    #[cfg(feature = "mutants")]
    for m in &cli.mutant {
        match m.as_str() {
            "fence-per-shard" => opts.mutants.fence_per_shard = true,
            "truncate-metadata" => opts.mutants.truncate_metadata = true,
            "oop-failed-precondition" => opts.mutants.out_of_position_failed_precondition = true,
            "bump-revision-on-reconcile" => opts.mutants.bump_revision_on_reconcile = true,
            "frozen-list-head" => opts.mutants.frozen_list_head = true,
            "reject-negative-tokens" => opts.mutants.reject_negative_tokens = true,
            "fatal-default-metrics-bind" => providerkit::listen::MUTANT_FATAL_DEFAULT_BIND
                .store(true, std::sync::atomic::Ordering::Relaxed),
            other => bail!("unknown --mutant {other:?}"),
        }
    }
    Ok(opts)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(p) = &cli.state {
        eprintln!(
            "fault-provider: --state {p} is IGNORED (in-memory only; restarts lose everything)"
        );
    }
    // Compatibility flags only.
    let _ = (cli.use_fake_backend, &cli.provider);
    let options = options(&cli)?;
    let metrics_addr = match cli.metrics_addr.as_deref().map(str::trim) {
        None => AuxAddr::Default("0.0.0.0:9090".parse()?),
        Some("") => AuxAddr::Disabled,
        Some(a) => AuxAddr::Explicit(
            a.parse()
                .with_context(|| format!("--metrics-addr {a:?} is not host:port"))?,
        ),
    };
    let _metrics = match bind_aux("--metrics-addr", metrics_addr).await? {
        AuxListener::DefaultUnavailable { addr, error } => {
            eprintln!("fault-provider: the default --metrics-addr {addr} is taken ({error}); serving without it");
            None
        }
        AuxListener::Bound(l) => Some(l),
        AuxListener::Disabled => None,
    };
    let faults = Arc::new(Mutex::new(Faults::default()));
    let backend = Arc::new(FaultBackend {
        slots: cli.seed_count,
        latency: cli.latency,
        faults: faults.clone(),
    });
    let engine = Engine::start(backend, Arc::new(MemoryStore::new()), options)
        .await
        .map_err(|e| anyhow::anyhow!("starting the engine: {e}"))?;
    if let Some(addr) = cli.control_addr {
        let ctl = TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding control {addr}"))?;
        tokio::spawn(control(ctl, faults));
    }
    let reconciler = engine.clone();
    let every = cli.reconcile_interval;
    if !every.is_zero() {
        tokio::spawn(async move {
            let mut t = tokio::time::interval(every);
            loop {
                t.tick().await;
                if let Err(e) = reconciler.reconcile().await {
                    eprintln!("fault-provider: reconcile failed: {e}");
                }
            }
        });
    }
    tonic::transport::Server::builder()
        .add_service(CapacityService::new(engine).into_server())
        .serve(cli.addr)
        .await
        .context("serving gRPC")?;
    Ok(())
}
