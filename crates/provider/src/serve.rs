//! Boot and serve: listeners first (so "address in use" fails before any
//! work), then the engine, then gRPC with health, reflection, TLS, the
//! interceptor chain, the reconcile loop and graceful shutdown.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::routing::get;
use axum::Router;
use bigfleet_proto::serving::capacity_provider_server::CapacityProviderServer;
use providerkit::service::CapacityService;
use providerkit::{bind_aux, AuxListener, Engine, MemoryStore, Store};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_stream::StreamExt;
use tonic_health::ServingStatus;

use crate::budget::{BudgetLayer, FirstBytes, PREFACE_TIMEOUT};
use crate::error::StartupError;
use crate::guard::{GuardedCapacity, IdentityGuard};
use crate::identity::IdentityCheck;
use crate::layers::{CatchPanicLayer, ObserveLayer};
use crate::metrics::Metrics;
use crate::plan::{BackendConfig, Plan, ProxmoxAccess, ProxmoxConfig, StateConfig};
use proxmox_backend::backend::ProxmoxBackend;
use proxmox_backend::fake::FakeCluster;
use proxmox_backend::proxmox::{PveOptions, PveSubstrate};
use proxmox_backend::substrate::{Metered, Substrate, VmRef};

/// Shared by `/readyz` and gRPC health: ready while serving (started, not
/// shutting down) and the store can commit.
#[derive(Clone)]
pub struct Readiness {
    serving: Arc<AtomicBool>,
    store_ok: Arc<AtomicBool>,
}

impl Default for Readiness {
    fn default() -> Readiness {
        Readiness {
            serving: Arc::new(AtomicBool::new(false)),
            store_ok: Arc::new(AtomicBool::new(true)),
        }
    }
}

impl Readiness {
    pub fn set(&self, ready: bool) {
        self.serving.store(ready, Ordering::SeqCst);
    }
    pub fn set_store_ok(&self, ok: bool) {
        self.store_ok.store(ok, Ordering::SeqCst);
    }
    pub fn get(&self) -> bool {
        self.serving.load(Ordering::SeqCst) && self.store_ok.load(Ordering::SeqCst)
    }
}

/// How often readiness re-checks the store.
pub const STORE_HEALTH_PERIOD: std::time::Duration = std::time::Duration::from_millis(500);

/// Readiness follows the store: NOT_SERVING (and `/readyz` 503) while
/// commits fail, every RPC being UNAVAILABLE then anyway, and SERVING
/// again by itself once the store's own retry commits. Runs until dropped.
pub async fn follow_store_health(
    engine: Arc<Engine>,
    ready: Readiness,
    health: tonic_health::server::HealthReporter,
    period: std::time::Duration,
) {
    let mut was_ok = true;
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let result = engine.store_health();
        let ok = result.is_ok();
        if ok == was_ok {
            continue;
        }
        was_ok = ok;
        ready.set_store_ok(ok);
        match result {
            Err(e) => tracing::warn!(error = %e, "state store cannot commit: not ready"),
            Ok(()) => tracing::info!("state store commits again: ready"),
        }
        // A shutdown in progress keeps NOT_SERVING.
        let status = if ready.get() {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        health
            .set_service_status(
                <CapacityProviderServer<CapacityService> as tonic::server::NamedService>::NAME,
                status,
            )
            .await;
        health.set_service_status("", status).await;
    }
}

/// HTTP/2 streams one connection may have open; beyond it the client
/// queues. Bounds what one connection can make the server hold.
pub const MAX_CONCURRENT_STREAMS: u32 = 64;

async fn bind(flag: &str, addr: std::net::SocketAddr) -> Result<TcpListener, StartupError> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| StartupError::bind(flag, addr, e))
}

pub fn http_router(metrics: Arc<Metrics>, ready: Readiness) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(
                |State((metrics, _)): State<(Arc<Metrics>, Readiness)>, headers: HeaderMap| async move {
                    metrics.scrape(headers.get(header::ACCEPT))
                },
            ),
        )
        .route("/healthz", get(|| async { (StatusCode::OK, "ok") }))
        .route(
            "/readyz",
            get(
                |State((_, ready)): State<(Arc<Metrics>, Readiness)>| async move {
                    if ready.get() {
                        (StatusCode::OK, "ready")
                    } else {
                        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
                    }
                },
            ),
        )
        .with_state((metrics, ready))
}

fn open_store(plan: &Plan) -> Result<Arc<dyn Store>, StartupError> {
    match &plan.state {
        None => Ok(Arc::new(MemoryStore::new())),
        Some(StateConfig::Sqlite(path)) => open_sqlite(path),
        Some(StateConfig::Postgres { target, options }) => {
            let store = pg_store::PgStore::open(target, options)?;
            let report = store.report();
            if report.created {
                tracing::info!(url = %store.target(), "state created");
            } else {
                tracing::info!(
                    url = %store.target(),
                    machines = report.machines,
                    fence_marks = report.fence_marks,
                    "state loaded"
                );
            }
            Ok(Arc::new(store))
        }
    }
}

fn open_sqlite(path: &std::path::Path) -> Result<Arc<dyn Store>, StartupError> {
    let store = sqlite_store::SqliteStore::open(path)?;
    // Says which of the two happened, so a state that was expected but
    // silently replaced by a fresh one shows in the first lines of the log.
    let report = store.report();
    match &report.origin {
        sqlite_store::Origin::Created => {
            tracing::info!(path = %store.path().display(), "state created");
        }
        sqlite_store::Origin::Loaded => tracing::info!(
            path = %store.path().display(),
            machines = report.machines,
            fence_marks = report.fence_marks,
            "state loaded"
        ),
        sqlite_store::Origin::Imported(imported) => tracing::info!(
            path = %store.path().display(),
            backup = %imported.backup.display(),
            machines = report.machines,
            fence_marks = report.fence_marks,
            operation_ids = imported.operation_ids,
            "state imported from the reference implementation's JSON file"
        ),
    }
    Ok(Arc::new(store))
}

/// The real substrate, checked against the cluster before serving: the
/// token works, every zone is a node, every template in use is visible.
async fn proxmox_substrate(
    plan: &Plan,
    proxmox: &ProxmoxConfig,
) -> Result<Arc<dyn Substrate>, StartupError> {
    let substrate = Arc::new(pve_substrate(&proxmox.access, &proxmox.options)?);
    let catalog = &plan.catalog;
    let mut templates: Vec<u32> = catalog
        .slots
        .iter()
        .filter_map(|s| {
            catalog
                .types
                .get(&s.facts.instance_type)
                .map(|t| t.template_vmid)
        })
        .collect();
    templates.sort_unstable();
    templates.dedup();
    tracing::info!(
        url = %proxmox.access.api_url,
        nodes = %catalog.zones.join(","),
        "checking the Proxmox cluster before serving"
    );
    let warnings = substrate
        .preflight(&catalog.zones, &templates)
        .await
        .map_err(StartupError::Preflight)?;
    for warning in warnings {
        tracing::warn!(warning = %warning, "Proxmox preflight");
    }
    Ok(substrate)
}

/// One INFO line per node: its memory, what is committed there, and how
/// many more machines of each instance type offered on it fit under the
/// node memory guard's limit.
async fn log_node_memory(backend: &ProxmoxBackend, zones: &[String], limit: f64) {
    const MIB_PER_GIB: f64 = 1024.0;
    for room in backend.observe_memory(zones).await {
        let fits: Vec<String> = backend
            .fits(&room)
            .into_iter()
            .map(|(t, n)| format!("{t}={n}"))
            .collect();
        tracing::info!(
            node = %room.node,
            memory_gib = format!("{:.1}", room.memory_mib as f64 / MIB_PER_GIB),
            committed_gib = format!("{:.1}", room.committed_mib as f64 / MIB_PER_GIB),
            limit_gib = format!("{:.1}", room.limit_mib as f64 / MIB_PER_GIB),
            node_memory_limit = limit,
            fits = %fits.join(","),
            "node memory room"
        );
    }
}

/// The client and the substrate; the options were validated by the plan.
fn pve_substrate(
    access: &ProxmoxAccess,
    options: &PveOptions,
) -> Result<PveSubstrate, StartupError> {
    let mut config = pve::PveConfig::new(
        access.api_url.clone(),
        access.token_id.clone(),
        access.token_secret.clone(),
    );
    config.ca_pem = access.ca_pem.clone();
    config.fingerprints = access.fingerprints.clone();
    let client = pve::PveClient::new(config).map_err(StartupError::ProxmoxClient)?;
    if options.readiness_command.is_empty() {
        tracing::warn!(
            "--readiness-command is empty: the node-readiness gate is off and a \
                     machine may report CONFIGURED before its node can take pods"
        );
    }
    Ok(PveSubstrate::new(client, options.clone()))
}

/// SIGINT/SIGTERM handlers, installed before the provider reports itself
/// serving: a signal that arrives right after the startup line must start
/// a graceful shutdown, not kill the process with the default action.
struct ShutdownSignals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

impl ShutdownSignals {
    fn install() -> Result<ShutdownSignals, StartupError> {
        use tokio::signal::unix::{signal, SignalKind};
        let install = |kind: SignalKind, name: &'static str| {
            signal(kind).map_err(|source| StartupError::Signal {
                signal: name,
                source,
            })
        };
        Ok(ShutdownSignals {
            interrupt: install(SignalKind::interrupt(), "SIGINT")?,
            terminate: install(SignalKind::terminate(), "SIGTERM")?,
        })
    }

    async fn recv(&mut self) {
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
    }

    /// Runs one start-up step unless a signal comes first: the handlers are
    /// installed before start-up (so a signal right after the start-up line
    /// is graceful), which would otherwise leave a SIGTERM unheard while a
    /// step waits on a cluster that does not answer.
    async fn or_stop<T>(
        &mut self,
        step: impl std::future::Future<Output = Result<T, StartupError>>,
    ) -> Result<T, RunError> {
        tokio::select! {
            result = step => Ok(result?),
            () = self.recv() => Err(RunError::Stopped),
        }
    }
}

/// Reflection over our API and gRPC health, served as v1 and v1alpha.
fn reflection_builder() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(bigfleet_proto::v1alpha1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(bigfleet_proto::admin::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
}

/// Why [`run`] returned an error: before the provider served (the
/// `startup failed` line), or while it served.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Something the configuration could not check: a port in use, the
    /// state store, the Proxmox preflight. The message names the cause.
    #[error(transparent)]
    Startup(#[from] StartupError),
    /// The gRPC server stopped with an error after start-up.
    #[error("gRPC server failed: {0}")]
    Serve(#[source] tonic::transport::Error),
    /// SIGINT or SIGTERM before start-up finished: nothing was served, and
    /// the process ends at once, as asked.
    #[error("shutdown requested during start-up")]
    Stopped,
}

/// Run until SIGINT/SIGTERM. Every error before the start-up line is a
/// [`RunError::Startup`].
pub async fn run(plan: Plan) -> Result<(), RunError> {
    let mut signals = ShutdownSignals::install()?;
    let serving = &plan.serving;
    let grpc_listener = bind("--addr", serving.addr).await?;
    let local_addr = grpc_listener
        .local_addr()
        .map_err(|source| StartupError::LocalAddr {
            flag: "--addr",
            source,
        })?;
    let metrics = Metrics::new();
    let ready = Readiness::default();
    let metrics_local = match bind_aux("--metrics-addr", serving.metrics_addr)
        .await
        .map_err(StartupError::Bind)?
    {
        AuxListener::Bound(listener) => {
            let local = listener
                .local_addr()
                .map_err(|source| StartupError::LocalAddr {
                    flag: "--metrics-addr",
                    source,
                })?;
            let router = http_router(metrics.clone(), ready.clone());
            tokio::spawn(async move {
                if let Err(e) = axum::serve(listener, router).await {
                    tracing::error!(error = %e, "metrics listener stopped");
                }
            });
            local.to_string()
        }
        AuxListener::Disabled => "disabled".to_string(),
        AuxListener::DefaultUnavailable { addr, .. } => format!("unavailable ({addr} in use)"),
    };

    if matches!(plan.backend, BackendConfig::Fake { .. }) {
        tracing::warn!(
            "FAKE BACKEND: machines are simulated in memory and no Proxmox cluster is touched; \
             for testing and certification only"
        );
    }
    let store = open_store(&plan)?;
    if plan.state.is_none() {
        tracing::info!("no --state: lifecycle state, fences and bindings are kept in memory only and are lost on restart");
    }
    let catalog = &plan.catalog;
    let (inner, fake): (Arc<dyn Substrate>, _) = match &plan.backend {
        BackendConfig::Fake {
            latency,
            node_memory_mib,
            node_memory_limit,
        } => {
            let fake = Arc::new(
                FakeCluster::new(catalog.zones.clone(), *latency)
                    .with_node_memory(*node_memory_mib, *node_memory_limit),
            );
            (fake.clone(), Some(fake))
        }
        BackendConfig::Proxmox(proxmox) => (
            signals.or_stop(proxmox_substrate(&plan, proxmox)).await?,
            None,
        ),
    };
    let substrate: Arc<dyn Substrate> = Arc::new(Metered::new(inner, metrics.clone()));
    let backend = Arc::new(ProxmoxBackend::new(
        catalog.slots.clone(),
        catalog.types.clone(),
        catalog.pricing.clone(),
        substrate,
    ));
    let engine = signals
        .or_stop(async {
            Engine::load(backend.clone(), store, plan.engine.clone())
                .await
                .map_err(StartupError::Engine)
        })
        .await?;
    if let Some(fake) = &fake {
        for machine in engine.list(&[], 0, &[]).machines {
            if let Some(vm) = machine
                .host
                .as_ref()
                .and_then(|h| VmRef::parse(&h.r#ref).ok())
            {
                let memory_mib = catalog
                    .types
                    .get(&machine.facts.instance_type)
                    .map_or(0, |t| t.memory_mib);
                fake.restore(&vm, &machine.id, memory_mib);
            }
        }
    }
    // After the fake cluster holds the VMs on record, which a resumed Drain
    // or Delete acts on.
    let resumed = engine.resume();
    if resumed > 0 {
        tracing::info!(
            resumed,
            "resumed the transitions a provider restart interrupted"
        );
    }
    log_node_memory(&backend, &catalog.zones, plan.backend.node_memory_limit()).await;

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    let reflection = if serving.reflection {
        Some(
            reflection_builder()
                .build_v1()
                .map_err(StartupError::Reflection)?,
        )
    } else {
        None
    };
    let reflection_alpha = if serving.reflection {
        Some(
            reflection_builder()
                .build_v1alpha()
                .map_err(StartupError::Reflection)?,
        )
    } else {
        None
    };

    if serving.client_identity == IdentityCheck::ChainOnly {
        tracing::warn!(
            "--tls-client-identity any: every client certificate that chains to --tls-ca may \
             call every RPC, for any shard_id; give each client its bigfleet:// URI SAN and \
             drop the flag"
        );
    }
    let guard = IdentityGuard::new(serving.client_identity, metrics.clone());
    let router = tonic::transport::Server::builder()
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .http2_max_header_list_size(16 * 1024)
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(60)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(20)))
        .layer(ObserveLayer {
            metrics: metrics.clone(),
        })
        .layer(CatchPanicLayer {
            metrics: metrics.clone(),
        })
        .layer(BudgetLayer)
        .add_service(
            GuardedCapacity::new(CapacityService::new(engine.clone()), guard.clone()).into_server(),
        )
        .add_service(
            crate::admin::AdminService::new(engine.clone(), guard, backend.clone()).into_server(),
        )
        .add_service(health_service)
        .add_optional_service(reflection)
        .add_optional_service(reflection_alpha);

    metrics.observe_engine(engine.clone(), catalog.zones.clone());
    metrics.observe_memory(backend.clone());
    crate::admin::spawn_auto_reclaim(&engine, plan.reconcile.reclaim_failed_after);

    // Reconcile in the background; an unchanged pass bumps nothing.
    if !plan.reconcile.interval.is_zero() {
        let engine = engine.clone();
        let metrics = metrics.clone();
        let period = plan.reconcile.interval;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match engine.reconcile().await {
                    Ok(report) => {
                        metrics.observe_reconcile(true);
                        if report.added + report.refreshed + report.reattached + report.detached > 0
                        {
                            tracing::info!(
                                added = report.added,
                                refreshed = report.refreshed,
                                reattached = report.reattached,
                                detached = report.detached,
                                "reconcile changed the inventory"
                            );
                        }
                    }
                    Err(e) => {
                        metrics.observe_reconcile(false);
                        tracing::warn!(error = %e, "reconcile failed");
                    }
                }
            }
        });
    }

    health_reporter
        .set_serving::<CapacityProviderServer<CapacityService>>()
        .await;
    health_reporter
        .set_service_status("", ServingStatus::Serving)
        .await;
    ready.set(true);
    tokio::spawn(follow_store_health(
        engine.clone(),
        ready.clone(),
        health_reporter.clone(),
        STORE_HEALTH_PERIOD,
    ));
    tracing::info!(
        addr = %local_addr,
        provider = %serving.provider,
        proxmox_backend = plan.backend.kind().name(),
        security = serving.security.name(),
        client_identity = serving.client_identity.name(),
        offerings = catalog.slots.len(),
        zones = %catalog.zones.join(","),
        metrics_addr = %metrics_local,
        store = %engine_store_name(&plan),
        "{}",
        providerkit::service::STARTUP_MESSAGE
    );

    // Signal -> not ready -> drain in-flight RPCs for at most the grace
    // period (a client holding a stream open must not keep us alive).
    let stopping = Arc::new(tokio::sync::Notify::new());
    let shutdown = {
        let stop_engine = engine.clone();
        let ready = ready.clone();
        let health_reporter = health_reporter.clone();
        let stopping = stopping.clone();
        async move {
            signals.recv().await;
            tracing::info!("shutdown requested: not ready, draining in-flight RPCs");
            stop_engine.stop_accepting();
            ready.set(false);
            health_reporter
                .set_not_serving::<CapacityProviderServer<CapacityService>>()
                .await;
            health_reporter
                .set_service_status("", ServingStatus::NotServing)
                .await;
            stopping.notify_one();
        }
    };
    let grace = serving.shutdown_grace;
    // One bound for the whole shutdown: open RPCs, then transitions landing.
    let grace_ends = Arc::new(std::sync::OnceLock::new());
    let grace_expired = {
        let grace_ends = grace_ends.clone();
        async move {
            stopping.notified().await;
            let ends = tokio::time::Instant::now() + grace;
            let _ = grace_ends.set(ends);
            tokio::time::sleep_until(ends).await;
        }
    };

    let incoming = TcpListenerStream::new(grpc_listener);
    let server = async {
        match serving.tls.clone() {
            None => {
                // Unary RPCs are small writes: without TCP_NODELAY, Nagle
                // and delayed ACKs add ~40 ms to responses.
                let incoming = incoming.map(|conn| {
                    conn.map(|tcp| {
                        let _ = tcp.set_nodelay(true);
                        FirstBytes::new(tcp, PREFACE_TIMEOUT)
                    })
                });
                router
                    .serve_with_incoming_shutdown(incoming, shutdown)
                    .await
            }
            Some(config) => {
                let tls_incoming = tls_handshakes(incoming, config);
                router
                    .serve_with_incoming_shutdown(tls_incoming, shutdown)
                    .await
            }
        }
    };
    let served = tokio::select! {
        served = server => served,
        () = grace_expired => {
            tracing::warn!(grace = ?grace, "shutdown grace period expired with RPCs still open; exiting");
            Ok(())
        }
    };
    served.map_err(RunError::Serve)?;
    // Mutations are refused by now: let the transitions in flight land
    // within what is left of the grace. What is still running stays
    // transitional in the state and resumes at the next start.
    let ends = grace_ends
        .get()
        .copied()
        .unwrap_or_else(|| tokio::time::Instant::now() + grace);
    let running = engine.transitions_running();
    if running > 0 {
        tracing::info!(
            running,
            "waiting for transitions in flight to land before exiting"
        );
        let left = engine
            .quiesce(ends.saturating_duration_since(tokio::time::Instant::now()))
            .await;
        if left > 0 {
            tracing::info!(
                left,
                "shutdown grace ended with transitions in flight; they resume at the next start"
            );
        }
    }
    tracing::info!("stopped");
    Ok(())
}

/// Upper bound on one TLS handshake: a silent peer must not hold a slot.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Accept TLS on every connection concurrently, each in its own task with
/// a timeout, so one stalled peer never blocks the others.
fn tls_handshakes(
    mut incoming: TcpListenerStream,
    config: Arc<rustls::ServerConfig>,
) -> tokio_stream::wrappers::ReceiverStream<
    Result<tokio_rustls::server::TlsStream<tokio::net::TcpStream>, std::io::Error>,
> {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        while let Some(conn) = incoming.next().await {
            let tcp = match conn {
                Ok(tcp) => tcp,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a connection failed");
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = acceptor.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                let peer = tcp.peer_addr().ok();
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(peer = ?peer, error = %e, "TLS handshake failed");
                    }
                    Err(_) => {
                        tracing::warn!(peer = ?peer, "TLS handshake timed out");
                    }
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

fn engine_store_name(plan: &Plan) -> String {
    match &plan.state {
        None => "memory".into(),
        Some(state) => state.describe(),
    }
}
