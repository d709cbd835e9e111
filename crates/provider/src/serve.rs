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
use crate::leader::{hold_lease, wait_for_lease, Standby, Switched, Term};
use crate::metrics::Metrics;
use crate::plan::{BackendConfig, LeaseConfig, Plan, ProxmoxAccess, ProxmoxConfig, StateConfig};
use bigfleet_proto::admin::admin_server::AdminServer;
use pg_store::Lease;
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
        Some(StateConfig::Postgres {
            target, options, ..
        }) => {
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
    gate: Option<Arc<Term>>,
) -> Result<Arc<dyn Substrate>, StartupError> {
    let substrate = Arc::new(pve_substrate(&proxmox.access, &proxmox.options, gate)?);
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

/// The client and the substrate; the options were validated by the plan.
fn pve_substrate(
    access: &ProxmoxAccess,
    options: &PveOptions,
    gate: Option<Arc<Term>>,
) -> Result<PveSubstrate, StartupError> {
    let mut config = pve::PveConfig::new(
        access.api_url.clone(),
        access.token_id.clone(),
        access.token_secret.clone(),
    );
    config.ca_pem = access.ca_pem.clone();
    config.fingerprints = access.fingerprints.clone();
    config.gate = gate.map(|term| term as Arc<dyn pve::RequestGate>);
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

/// The gRPC services whose calls go to the leader's engine: forwarded
/// while this replica serves, UNAVAILABLE otherwise.
#[derive(Clone)]
struct Served {
    capacity: Switched<CapacityProviderServer<GuardedCapacity>>,
    admin: Switched<AdminServer<crate::admin::AdminService>>,
    /// The engine of the term being served, for shutdown.
    engine: Arc<parking_lot::RwLock<Option<Arc<Engine>>>>,
}

/// What every term of serving is built from; shared by the terms of a
/// process.
struct TermContext {
    plan: Plan,
    metrics: Arc<Metrics>,
    guard: Arc<IdentityGuard>,
    ready: Readiness,
    health: tonic_health::server::HealthReporter,
    served: Served,
}

/// One term of serving: the engine and the tasks that work for it, which
/// stop when the term is dropped.
struct Leading {
    engine: Arc<Engine>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Leading {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl TermContext {
    /// Build the backend on `store`, load the state, resume what a restart
    /// interrupted. With a `gate`, every Proxmox request asks it first.
    async fn start(
        &self,
        store: Arc<dyn Store>,
        gate: Option<Arc<Term>>,
        signals: Option<&mut ShutdownSignals>,
    ) -> Result<Arc<Engine>, RunError> {
        let plan = &self.plan;
        let catalog = &plan.catalog;
        let (inner, fake): (Arc<dyn Substrate>, _) = match &plan.backend {
            BackendConfig::Fake { latency } => {
                let fake = Arc::new(FakeCluster::new(catalog.zones.clone(), *latency));
                (fake.clone(), Some(fake))
            }
            BackendConfig::Proxmox(proxmox) => {
                let substrate = proxmox_substrate(plan, proxmox, gate);
                let substrate = match signals {
                    Some(signals) => signals.or_stop(substrate).await?,
                    None => substrate.await?,
                };
                (substrate, None)
            }
        };
        let substrate: Arc<dyn Substrate> = Arc::new(Metered::new(inner, self.metrics.clone()));
        let backend = Arc::new(ProxmoxBackend::new(
            catalog.slots.clone(),
            catalog.types.clone(),
            catalog.pricing.clone(),
            substrate,
        ));
        let engine = Engine::load(backend, store, plan.engine.clone())
            .await
            .map_err(StartupError::Engine)?;
        if let Some(fake) = &fake {
            for machine in engine.list(&[], 0, &[]).machines {
                if let Some(vm) = machine
                    .host
                    .as_ref()
                    .and_then(|h| VmRef::parse(&h.r#ref).ok())
                {
                    fake.restore(&vm, &machine.id);
                }
            }
        }
        // After the fake cluster holds the VMs on record, which a resumed
        // Drain or Delete acts on.
        let resumed = engine.resume();
        if resumed > 0 {
            tracing::info!(
                resumed,
                "resumed the transitions a provider restart interrupted"
            );
        }
        Ok(engine)
    }

    /// Serve `engine`: route the RPCs to it, start its background work,
    /// report SERVING.
    async fn lead(&self, engine: Arc<Engine>) -> Leading {
        let plan = &self.plan;
        let served = &self.served;
        served.capacity.lead(
            GuardedCapacity::new(CapacityService::new(engine.clone()), self.guard.clone())
                .into_server(),
        );
        served.admin.lead(
            crate::admin::AdminService::new(engine.clone(), self.guard.clone()).into_server(),
        );
        *served.engine.write() = Some(engine.clone());
        self.metrics
            .observe_engine(engine.clone(), plan.catalog.zones.clone());
        let mut tasks = Vec::new();
        if let Some(task) =
            crate::admin::spawn_auto_reclaim(&engine, plan.reconcile.reclaim_failed_after)
        {
            tasks.push(task);
        }
        if !plan.reconcile.interval.is_zero() {
            tasks.push(tokio::spawn(reconcile_loop(
                engine.clone(),
                self.metrics.clone(),
                plan.reconcile.interval,
            )));
        }
        self.ready.set_store_ok(true);
        self.ready.set(true);
        set_health(self.health.clone(), ServingStatus::Serving).await;
        tasks.push(tokio::spawn(follow_store_health(
            engine.clone(),
            self.ready.clone(),
            self.health.clone(),
            STORE_HEALTH_PERIOD,
        )));
        Leading { engine, tasks }
    }

    /// The term ended: refuse everything at once, then stop its work.
    async fn stand_by(&self, leading: Leading) {
        self.served.capacity.stand_by();
        self.served.admin.stand_by();
        *self.served.engine.write() = None;
        self.ready.set(false);
        leading.engine.stop_accepting();
        self.metrics.forget_engine();
        drop(leading);
        set_health(self.health.clone(), ServingStatus::NotServing).await;
    }
}

async fn set_health(health: tonic_health::server::HealthReporter, status: ServingStatus) {
    health
        .set_service_status(
            <CapacityProviderServer<CapacityService> as tonic::server::NamedService>::NAME,
            status,
        )
        .await;
    health.set_service_status("", status).await;
}

/// Reconcile every `period`; an unchanged pass bumps nothing.
async fn reconcile_loop(engine: Arc<Engine>, metrics: Arc<Metrics>, period: std::time::Duration) {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match engine.reconcile().await {
            Ok(report) => {
                metrics.observe_reconcile(true);
                if report.added + report.refreshed + report.reattached + report.detached > 0 {
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
}

/// The start-up line: logged once, when this process first serves.
fn log_serving(plan: &Plan, local_addr: &std::net::SocketAddr, metrics_local: &str) {
    let serving = &plan.serving;
    let catalog = &plan.catalog;
    tracing::info!(
        addr = %local_addr,
        provider = %serving.provider,
        proxmox_backend = plan.backend.kind().name(),
        security = serving.security.name(),
        client_identity = serving.client_identity.name(),
        offerings = catalog.slots.len(),
        zones = %catalog.zones.join(","),
        metrics_addr = %metrics_local,
        store = %engine_store_name(plan),
        "{}",
        providerkit::service::STARTUP_MESSAGE
    );
}

/// What a replica of a shared PostgreSQL state needs to lead.
struct SharedState {
    target: pg_store::Target,
    options: pg_store::PgOptions,
    config: LeaseConfig,
    lease: Arc<Lease>,
    standby: Standby,
}

/// Replicas sharing a PostgreSQL state: wait for the lease, serve while it
/// is held, stand by when it is lost, and give it up once `release` is
/// set (shutdown, after the transitions in flight had their grace).
async fn lead_terms(
    context: Arc<TermContext>,
    shared: SharedState,
    mut stopping: tokio::sync::watch::Receiver<bool>,
    mut release: tokio::sync::watch::Receiver<bool>,
    first_serving: impl FnOnce() + Send + 'static,
) {
    let SharedState {
        target,
        options,
        config,
        lease,
        standby,
    } = shared;
    let mut first_serving = Some(first_serving);
    loop {
        let term = Arc::new(Term::default());
        let epoch = tokio::select! {
            epoch = wait_for_lease(lease.clone(), config.clone(), term.clone(), standby.clone()) => epoch,
            () = raised(&mut stopping) => return,
        };
        tracing::info!(replica = %config.replica, epoch, "took the leader lease: loading the state");
        let mut hold = {
            let (lease, config, term) = (lease.clone(), config.clone(), term.clone());
            tokio::spawn(async move { hold_lease(&lease, &config, &term, epoch).await })
        };
        let started = {
            let store_options = pg_store::PgOptions {
                lease_epoch: Some(epoch),
                ..options.clone()
            };
            let target = target.clone();
            let context = context.clone();
            let gate = term.clone();
            async move {
                let opened = tokio::task::spawn_blocking(move || {
                    pg_store::PgStore::open(&target, &store_options)
                })
                .await;
                let store = match opened {
                    Ok(store) => {
                        let store = store.map_err(StartupError::from)?;
                        let report = store.report();
                        tracing::info!(
                            url = %store.target(),
                            machines = report.machines,
                            fence_marks = report.fence_marks,
                            "state loaded"
                        );
                        store
                    }
                    Err(e) => {
                        return Err(RunError::Startup(StartupError::Store(
                            providerkit::StoreError::unavailable(format!(
                                "the state store could not be opened: {e}"
                            )),
                        )))
                    }
                };
                context.start(Arc::new(store), Some(gate), None).await
            }
        };
        let started = tokio::select! {
            started = started => started,
            lost = &mut hold => {
                let lost = lost.map_or_else(|e| e.to_string(), |l| l.to_string());
                tracing::warn!(epoch, reason = %lost, "lost the leader lease while loading the state: standing by");
                continue;
            }
            () = raised(&mut release) => {
                hold.abort();
                give_up(&lease, &term, epoch).await;
                return;
            }
        };
        let engine = match started {
            Ok(engine) => engine,
            Err(e) => {
                hold.abort();
                tracing::error!(epoch, error = %e, "cannot serve as the leader: giving the lease up and standing by");
                give_up(&lease, &term, epoch).await;
                tokio::select! {
                    () = tokio::time::sleep(config.ttl) => continue,
                    () = raised(&mut stopping) => return,
                }
            }
        };
        let leading = context.lead(engine).await;
        tracing::info!(replica = %config.replica, epoch, "serving as the leader");
        if let Some(first) = first_serving.take() {
            first();
        }
        tokio::select! {
            lost = &mut hold => {
                let lost = lost.map_or_else(|e| e.to_string(), |l| l.to_string());
                standby.lost();
                context.stand_by(leading).await;
                tracing::warn!(epoch, reason = %lost, "lost the leader lease: stopped all work and standing by");
            }
            () = raised(&mut release) => {
                hold.abort();
                context.stand_by(leading).await;
                give_up(&lease, &term, epoch).await;
                return;
            }
        }
    }
}

/// Resolves once `flag` is set (or its sender is gone, which only happens
/// when the process is ending).
async fn raised(flag: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = flag.wait_for(|set| *set).await;
}

/// End the term and release the lease so a standby need not wait for it
/// to expire.
async fn give_up(lease: &Lease, term: &Term, epoch: i64) {
    term.end();
    match tokio::time::timeout(std::time::Duration::from_secs(5), lease.release(epoch)).await {
        Ok(Ok(())) => tracing::info!(epoch, "released the leader lease"),
        Ok(Err(e)) => {
            tracing::warn!(epoch, error = %e, "cannot release the leader lease; a standby takes it when it expires")
        }
        Err(_) => tracing::warn!(
            epoch,
            "releasing the leader lease did not finish in time; a standby takes it when it expires"
        ),
    }
}

/// Run until SIGINT/SIGTERM. Every error before the start-up line is a
/// [`RunError::Startup`].
pub async fn run(plan: Plan) -> Result<(), RunError> {
    let mut signals = ShutdownSignals::install()?;
    let serving = plan.serving.clone();
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
    if plan.state.is_none() {
        tracing::info!("no --state: lifecycle state, fences and bindings are kept in memory only and are lost on restart");
    }
    let shared_state = match &plan.state {
        Some(StateConfig::Postgres {
            target,
            options,
            lease,
        }) => Some(((**target).clone(), options.clone(), lease.clone())),
        _ => None,
    };
    let standby = Standby::new(
        shared_state
            .as_ref()
            .map_or("", |(_, _, lease)| lease.replica.as_str()),
    );

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    set_health(health_reporter.clone(), ServingStatus::NotServing).await;
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
    let served = Served {
        capacity: Switched::new(standby.clone()),
        admin: Switched::new(standby.clone()),
        engine: Arc::default(),
    };
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
        .add_service(served.capacity.clone())
        .add_service(served.admin.clone())
        .add_service(health_service)
        .add_optional_service(reflection)
        .add_optional_service(reflection_alpha);

    let context = Arc::new(TermContext {
        plan,
        metrics: metrics.clone(),
        guard,
        ready: ready.clone(),
        health: health_reporter.clone(),
        served: served.clone(),
    });
    let (stopping_tx, stopping_rx) = tokio::sync::watch::channel(false);
    let (release_tx, release_rx) = tokio::sync::watch::channel(false);
    let mut single_term = None;
    let terms = match shared_state {
        None => {
            // One replica on a state of its own: it serves as soon as the
            // state is loaded, before the listener answers anything.
            let store = open_store(&context.plan)?;
            let engine = context.start(store, None, Some(&mut signals)).await?;
            single_term = Some(context.lead(engine).await);
            log_serving(&context.plan, &local_addr, &metrics_local);
            None
        }
        Some((target, options, config)) => {
            let lease = signals
                .or_stop(async {
                    pg_store::Lease::connect(&target, &options)
                        .await
                        .map_err(StartupError::from)
                })
                .await?;
            if lease.created_the_state() {
                tracing::info!(url = %target.display(), "state created");
            }
            tracing::info!(
                replica = %config.replica,
                url = %target.display(),
                lease_ttl_ms = config.ttl.as_millis() as u64,
                addr = %local_addr,
                metrics_addr = %metrics_local,
                "replica of a shared PostgreSQL state: standby until it holds the leader lease"
            );
            let first_serving = {
                let context = context.clone();
                let metrics_local = metrics_local.clone();
                move || log_serving(&context.plan, &local_addr, &metrics_local)
            };
            let shared = SharedState {
                target,
                options,
                config,
                lease: Arc::new(lease),
                standby,
            };
            Some(tokio::spawn(lead_terms(
                context.clone(),
                shared,
                stopping_rx,
                release_rx,
                first_serving,
            )))
        }
    };

    // Signal -> not ready -> drain in-flight RPCs for at most the grace
    // period (a client holding a stream open must not keep us alive).
    let stopping = Arc::new(tokio::sync::Notify::new());
    let shutdown = {
        let served = served.clone();
        let ready = ready.clone();
        let health_reporter = health_reporter.clone();
        let stopping = stopping.clone();
        async move {
            signals.recv().await;
            tracing::info!("shutdown requested: not ready, draining in-flight RPCs");
            // A standby takes no lease from now on. Nobody listening only
            // means no leadership task runs.
            let _ = stopping_tx.send(true);
            let engine = served.engine.read().clone();
            if let Some(engine) = engine {
                engine.stop_accepting();
            }
            ready.set(false);
            set_health(health_reporter.clone(), ServingStatus::NotServing).await;
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
    let served_result = tokio::select! {
        served = server => served,
        () = grace_expired => {
            tracing::warn!(grace = ?grace, "shutdown grace period expired with RPCs still open; exiting");
            Ok(())
        }
    };
    // Mutations are refused by now: let the transitions in flight land
    // within what is left of the grace. What is still running stays
    // transitional in the state and resumes at the next start (or at the
    // standby that takes the lease).
    let ends = grace_ends
        .get()
        .copied()
        .unwrap_or_else(|| tokio::time::Instant::now() + grace);
    let engine = served.engine.read().clone();
    if let Some(engine) = engine {
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
    }
    // Nobody listening only means no leadership task runs.
    let _ = release_tx.send(true);
    if let Some(terms) = terms {
        if let Err(e) = terms.await {
            tracing::error!(error = %e, "the leadership task ended abnormally");
        }
    }
    drop(single_term);
    served_result.map_err(RunError::Serve)?;
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
