//! Serving in terms: a term builds the backend on a store, loads the
//! state, resumes what was in flight and serves it, until it ends. With a
//! state file the process has one term; replicas of a PostgreSQL state
//! serve a term while they hold the leader lease and stand by in between
//! (`lead_terms`).

use std::sync::Arc;

use bigfleet_proto::admin::admin_server::AdminServer;
use bigfleet_proto::serving::capacity_provider_server::CapacityProviderServer;
use pg_store::{Lease, OwnName};
use providerkit::service::CapacityService;
use providerkit::{Engine, MemoryStore, Store};
use proxmox_backend::backend::ProxmoxBackend;
use proxmox_backend::fake::FakeCluster;
use proxmox_backend::proxmox::{PveOptions, PveSubstrate};
use proxmox_backend::substrate::{Metered, Substrate, VmRef};
use tonic_health::ServingStatus;

use crate::error::StartupError;
use crate::guard::{GuardedCapacity, IdentityGuard};
use crate::leader::{hold_lease, wait_for_lease, LeaseLost, Standby, Switched, Term};
use crate::metrics::{Metrics, PveRequests};
use crate::plan::{BackendConfig, LeaseConfig, Plan, ProxmoxAccess, ProxmoxConfig};
use crate::probes::{follow_store_health, set_health, Readiness, STORE_HEALTH_PERIOD};
use crate::state::{OpenError, Purpose, StateLocation};

/// The state a single replica serves from: in memory without `--state`.
pub(crate) fn open_store(plan: &Plan) -> Result<Arc<dyn Store>, StartupError> {
    let Some(state) = &plan.state else {
        return Ok(Arc::new(MemoryStore::new()));
    };
    let opened = state
        .location
        .open(Purpose::Serve { lease_epoch: None })
        .map_err(open_failed)?;
    opened.log_opened();
    Ok(opened.into_store())
}

fn open_failed(e: OpenError) -> StartupError {
    match e {
        OpenError::Store(e) => StartupError::Store(e),
        // Only a copy's source is required to exist already.
        OpenError::NoState(why) => StartupError::Store(providerkit::StoreError::unavailable(
            format!("the state could not be opened: {why}"),
        )),
    }
}

/// The real substrate, checked against the cluster before serving: the
/// token works, every zone is a node, every template in use is visible.
async fn proxmox_substrate(
    plan: &Plan,
    proxmox: &ProxmoxConfig,
    gate: Option<Arc<Term>>,
    metrics: Arc<Metrics>,
) -> Result<Arc<dyn Substrate>, StartupError> {
    let substrate = Arc::new(pve_substrate(
        &proxmox.access,
        &proxmox.options,
        gate,
        metrics,
    )?);
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
    metrics: Arc<Metrics>,
) -> Result<PveSubstrate, StartupError> {
    let mut config = pve::PveConfig::new(
        access.api_url.clone(),
        access.token_id.clone(),
        access.token_secret.clone(),
    );
    config.ca_pem = access.ca_pem.clone();
    config.fingerprints = access.fingerprints.clone();
    config.gate = gate.map(|term| term as Arc<dyn pve::RequestGate>);
    config.observer = Some(Arc::new(PveRequests(metrics)));
    let client = pve::PveClient::new(config).map_err(StartupError::ProxmoxClient)?;
    if options.readiness_command.is_empty() {
        tracing::warn!(
            "--readiness-command is empty: the node-readiness gate is off and a \
                     machine may report CONFIGURED before its node can take pods"
        );
    }
    Ok(PveSubstrate::new(client, options.clone()))
}

/// The gRPC services whose calls go to the leader's engine: forwarded
/// while this replica serves, UNAVAILABLE otherwise.
#[derive(Clone)]
pub(crate) struct Served {
    pub(crate) capacity: Switched<CapacityProviderServer<GuardedCapacity>>,
    pub(crate) admin: Switched<AdminServer<crate::admin::AdminService>>,
    /// The engine of the term being served, for shutdown.
    pub(crate) engine: Arc<parking_lot::RwLock<Option<Arc<Engine>>>>,
}

/// What every term of serving is built from; shared by the terms of a
/// process.
pub(crate) struct TermContext {
    pub(crate) plan: Plan,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) guard: Arc<IdentityGuard>,
    pub(crate) ready: Readiness,
    pub(crate) health: tonic_health::server::HealthReporter,
    pub(crate) served: Served,
}

/// A term's engine, loaded and resumed, and the backend it drives.
pub(crate) struct Started {
    engine: Arc<Engine>,
    backend: Arc<ProxmoxBackend>,
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

/// One INFO line per storage full clones land on (those the configuration
/// names): what is free there and what the storage guard lets clones take.
async fn log_storage_space(backend: &ProxmoxBackend, zones: &[String]) {
    for space in backend.observe_storage(zones).await {
        tracing::info!(
            storage = %space.storage,
            node = space.node.as_deref().unwrap_or("(shared)"),
            avail = %proxmox_backend::capacity::gib(space.avail_bytes),
            overcommit = space.overcommit,
            left = %proxmox_backend::capacity::gib(space.left_bytes()),
            "storage room"
        );
    }
}

/// One term of serving: the engine and the tasks that work for it, which
/// stop when the term is dropped.
pub(crate) struct Leading {
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
    pub(crate) async fn start(
        &self,
        store: Arc<dyn Store>,
        gate: Option<Arc<Term>>,
    ) -> Result<Started, StartupError> {
        let plan = &self.plan;
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
            BackendConfig::Proxmox(proxmox) => {
                self.served.capacity.standby().starting(format!(
                    "checking the Proxmox cluster at {} before serving (its API must answer: see \
                     the log for what the check waits on)",
                    proxmox.access.api_url
                ));
                (
                    proxmox_substrate(plan, proxmox, gate, self.metrics.clone()).await?,
                    None,
                )
            }
        };
        self.served.capacity.standby().starting(format!(
            "loading the state from {} and resuming what was in flight",
            store.describe()
        ));
        let substrate: Arc<dyn Substrate> = Arc::new(Metered::new(inner, self.metrics.clone()));
        let backend = Arc::new(
            ProxmoxBackend::new(
                catalog.slots.clone(),
                catalog.types.clone(),
                catalog.pricing.clone(),
                substrate,
            )
            .with_step_observer(self.metrics.clone()),
        );
        let engine = Engine::load(backend.clone(), store, plan.engine.clone())
            .await
            .map_err(StartupError::Engine)?;
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
        // After the fake cluster holds the VMs on record, which a resumed
        // Drain or Delete acts on.
        let resumed = engine.resume();
        if resumed > 0 {
            tracing::info!(
                resumed,
                "resumed the transitions a provider restart interrupted"
            );
        }
        log_node_memory(&backend, &catalog.zones, plan.backend.node_memory_limit()).await;
        log_storage_space(&backend, &catalog.zones).await;
        Ok(Started { engine, backend })
    }

    /// Serve `engine`: route the RPCs to it, start its background work,
    /// report SERVING.
    pub(crate) async fn lead(&self, started: Started) -> Leading {
        let Started { engine, backend } = started;
        let plan = &self.plan;
        let served = &self.served;
        served.capacity.standby().started();
        served.capacity.lead(
            GuardedCapacity::new(CapacityService::new(engine.clone()), self.guard.clone())
                .into_server(),
        );
        served.admin.lead(
            crate::admin::AdminService::new(engine.clone(), self.guard.clone(), backend.clone())
                .into_server(),
        );
        *served.engine.write() = Some(engine.clone());
        self.metrics
            .observe_engine(engine.clone(), plan.catalog.zones.clone());
        self.metrics
            .observe_nodes(backend.clone(), plan.catalog.zones.clone());
        self.metrics.observe_memory(backend);
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

/// What a replica of a shared PostgreSQL state needs to lead.
pub(crate) struct SharedState {
    pub(crate) target: pg_store::Target,
    pub(crate) options: pg_store::PgOptions,
    pub(crate) config: LeaseConfig,
    pub(crate) lease: Arc<Lease>,
    pub(crate) standby: Standby,
}

/// Replicas sharing a PostgreSQL state: wait for the lease, serve while it
/// is held, stand by when it is lost, and give it up once `release` is
/// set (shutdown, after the transitions in flight had their grace).
pub(crate) async fn lead_terms(
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
    let mut own_name = OwnName::TakeBack;
    loop {
        let term = Arc::new(Term::default());
        let epoch = tokio::select! {
            epoch = wait_for_lease(lease.clone(), config.clone(), term.clone(), standby.clone(), own_name) => epoch,
            () = raised(&mut stopping) => return,
        };
        tracing::info!(replica = %config.replica, epoch, "took the leader lease: loading the state");
        standby.starting(format!(
            "replica {} took the leader lease (epoch {epoch}) and is opening the state",
            config.replica
        ));
        let mut hold = {
            let (lease, config, term) = (lease.clone(), config.clone(), term.clone());
            tokio::spawn(async move { hold_lease(&lease, &config, &term, epoch).await })
        };
        let started = {
            let location = StateLocation::Postgres {
                target: Box::new(target.clone()),
                options: options.clone(),
                url: target.display().to_string(),
            };
            let context = context.clone();
            let gate = term.clone();
            async move {
                let opened = tokio::task::spawn_blocking(move || {
                    location.open(Purpose::Serve {
                        lease_epoch: Some(epoch),
                    })
                })
                .await;
                let store = match opened {
                    Ok(opened) => {
                        let opened = opened.map_err(open_failed)?;
                        opened.log_opened();
                        opened.into_store()
                    }
                    Err(e) => {
                        return Err(StartupError::Store(providerkit::StoreError::unavailable(
                            format!("the state store could not be opened: {e}"),
                        )))
                    }
                };
                context.start(store, Some(gate)).await
            }
        };
        let started = tokio::select! {
            started = started => started,
            lost = &mut hold => {
                let lost = diagnose(lost, &mut own_name);
                tracing::warn!(epoch, reason = %lost, "lost the leader lease while loading the state: standing by");
                standby.started();
                continue;
            }
            () = raised(&mut release) => {
                hold.abort();
                give_up(&lease, &term, epoch).await;
                return;
            }
        };
        let started = match started {
            Ok(started) => started,
            Err(e) => {
                hold.abort();
                standby.started();
                tracing::error!(epoch, error = %e, "cannot serve as the leader: giving the lease up and standing by");
                give_up(&lease, &term, epoch).await;
                tokio::select! {
                    () = tokio::time::sleep(config.ttl) => continue,
                    () = raised(&mut stopping) => return,
                }
            }
        };
        let leading = context.lead(started).await;
        tracing::info!(replica = %config.replica, epoch, "serving as the leader");
        if let Some(first) = first_serving.take() {
            first();
        }
        tokio::select! {
            lost = &mut hold => {
                let lost = diagnose(lost, &mut own_name);
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

/// Why the lease was lost, as the log says it; a replica that found
/// another live one under its name stops taking a running lease back by
/// name from then on (else the two would depose each other at every
/// attempt), and says so as an error: the configuration needs fixing.
fn diagnose(lost: Result<LeaseLost, tokio::task::JoinError>, own_name: &mut OwnName) -> String {
    match lost {
        Ok(lost @ LeaseLost::TakenUnderThisName { .. }) => {
            if *own_name == OwnName::TakeBack {
                tracing::error!(reason = %lost, "two live replicas share one --replica-name");
            }
            *own_name = OwnName::WaitForExpiry;
            lost.to_string()
        }
        Ok(lost) => lost.to_string(),
        Err(e) => e.to_string(),
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
