//! Boot and serve: listeners first (so "address in use" fails before any
//! work), then gRPC with health, reflection, TLS and the interceptor chain
//! over the services of the term being served (`terms`), and graceful
//! shutdown.

use std::sync::Arc;

use providerkit::{bind_aux, AuxListener};
use tokio::net::TcpListener;
use tokio_stream::StreamExt;
use tonic_health::ServingStatus;

use crate::accept::Admitted;
use crate::budget::{BudgetLayer, FirstBytes, PREFACE_TIMEOUT};
use crate::error::StartupError;
use crate::guard::IdentityGuard;
use crate::identity::IdentityCheck;
use crate::intake::Intake;
use crate::layers::{CatchPanicLayer, ObserveLayer};
use crate::leader::{Standby, Switched};
use crate::metrics::Metrics;
use crate::plan::{BackendConfig, Plan, StateConfig};
use crate::state::StateLocation;
use crate::terms::{lead_terms, open_store, Served, SharedState, TermContext};

pub use crate::probes::{
    follow_store_health, http_router, set_health, Readiness, STORE_HEALTH_PERIOD,
};

/// HTTP/2 streams one connection may have open; beyond it the client
/// queues. Bounds what one connection can make the server hold.
pub const MAX_CONCURRENT_STREAMS: u32 = 64;

async fn bind(flag: &str, addr: std::net::SocketAddr) -> Result<TcpListener, StartupError> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| StartupError::bind(flag, addr, e))
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
}

/// Runs one start-up step unless a stop was asked for first: the signal
/// handlers are installed before start-up (so a signal right after the
/// start-up line is graceful), which would otherwise leave a SIGTERM
/// unheard while a step waits on a cluster that does not answer.
async fn or_stop<T>(
    stop: &mut tokio::sync::watch::Receiver<bool>,
    step: impl std::future::Future<Output = Result<T, StartupError>>,
) -> Result<T, RunError> {
    tokio::select! {
        result = step => Ok(result?),
        _ = stop.wait_for(|asked| *asked) => Err(RunError::Stopped),
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
        store_tls = store_tls(plan),
        "{}",
        providerkit::service::STARTUP_MESSAGE
    );
}

/// Run until SIGINT/SIGTERM. Every error before the start-up line is a
/// [`RunError::Startup`].
pub async fn run(plan: Plan) -> Result<(), RunError> {
    let mut signals = ShutdownSignals::install()?;
    // Set by the first SIGINT/SIGTERM: start-up steps end at once, and the
    // server drains and stops.
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        signals.recv().await;
        let _ = stop_tx.send(true);
    });
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
        Some(StateConfig {
            location: StateLocation::Postgres {
                target, options, ..
            },
            lease: Some(lease),
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
        .layer(ObserveLayer::new(metrics.clone()))
        .layer(CatchPanicLayer {
            metrics: metrics.clone(),
        })
        .layer(BudgetLayer)
        .layer(Intake::new(guard.clone(), &plan.engine.limits))
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
    tracing::info!(
        addr = %local_addr,
        metrics_addr = %metrics_local,
        "listening: gRPC health answers NOT_SERVING and every RPC UNAVAILABLE, saying what \
         start-up waits for, until it ends"
    );
    let (stopping_tx, stopping_rx) = tokio::sync::watch::channel(false);
    let (release_tx, release_rx) = tokio::sync::watch::channel(false);
    // Start-up runs while the server already answers: health NOT_SERVING,
    // and every CapacityProvider and Admin RPC UNAVAILABLE saying what
    // start-up waits for (`Standby::starting`), never a silent port.
    let startup = {
        let context = context.clone();
        let mut stop = stop.clone();
        let metrics_local = metrics_local.clone();
        async move {
            match shared_state {
                None => {
                    // One replica on a state of its own.
                    standby.starting(match &context.plan.state {
                        Some(state) => format!("opening the state {}", state.describe()),
                        None => "building the engine".to_string(),
                    });
                    let store = open_store(&context.plan)?;
                    let started = or_stop(&mut stop, context.start(store, None)).await?;
                    let single_term = context.lead(started).await;
                    log_serving(&context.plan, &local_addr, &metrics_local);
                    Ok::<_, RunError>((None, Some(single_term)))
                }
                Some((target, options, config)) => {
                    let lease = or_stop(&mut stop, async {
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
                        move || log_serving(&context.plan, &local_addr, &metrics_local)
                    };
                    let shared = SharedState {
                        target,
                        options,
                        config,
                        lease: Arc::new(lease),
                        standby,
                    };
                    Ok((
                        Some(tokio::spawn(lead_terms(
                            context.clone(),
                            shared,
                            stopping_rx,
                            release_rx,
                            first_serving,
                        ))),
                        None,
                    ))
                }
            }
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
        let mut stop = stop.clone();
        async move {
            let _ = stop.wait_for(|asked| *asked).await;
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

    let limits = crate::accept::fit_descriptor_limit(serving.connections);
    let incoming = crate::accept::accept(grpc_listener, limits);
    let server = async {
        match serving.tls.clone() {
            None => {
                let incoming =
                    incoming.map(|conn| conn.map(|conn| FirstBytes::new(conn, PREFACE_TIMEOUT)));
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
    tokio::pin!(server);
    let (terms, single_term) = tokio::select! {
        started = startup => match started {
            Ok(started) => started,
            // The process ends with the start-up error; the server, which
            // answered only UNAVAILABLE, goes with it.
            Err(e) => return Err(e),
        },
        served = &mut server => {
            // The server ends before start-up only once a stop was asked.
            served.map_err(RunError::Serve)?;
            return Err(RunError::Stopped);
        }
    };
    let served_result = tokio::select! {
        served = &mut server => served,
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
/// a timeout, so one stalled peer never blocks the others. After the
/// handshake the HTTP/2 preface has [`PREFACE_TIMEOUT`] as on plaintext: a
/// peer that completes TLS and then stays silent is closed too.
fn tls_handshakes(
    mut incoming: tokio_stream::wrappers::ReceiverStream<std::io::Result<Admitted>>,
    config: Arc<rustls::ServerConfig>,
) -> tokio_stream::wrappers::ReceiverStream<
    Result<FirstBytes<tokio_rustls::server::TlsStream<Admitted>>, std::io::Error>,
> {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        while let Some(conn) = incoming.next().await {
            // The accept loop logs and backs off from its own errors.
            let Ok(tcp) = conn else { continue };
            let acceptor = acceptor.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                let peer = tcp.peer_addr().ok();
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok(FirstBytes::new(stream, PREFACE_TIMEOUT))).await;
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

/// How the state store is reached: `verify-full` or `disabled` for a
/// PostgreSQL state, `-` for a file or memory.
fn store_tls(plan: &Plan) -> &'static str {
    match plan.state.as_ref().map(|s| &s.location) {
        Some(StateLocation::Postgres { target, .. }) => match target.tls() {
            pg_store::Tls::Disabled => "disabled",
            pg_store::Tls::VerifyFull { .. } => "verify-full",
        },
        _ => "-",
    }
}

fn engine_store_name(plan: &Plan) -> String {
    match &plan.state {
        None => "memory".into(),
        Some(state) => state.describe(),
    }
}
