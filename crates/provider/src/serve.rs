//! Boot and serve: listeners first (so "address in use" fails before any
//! work), then the engine, then gRPC with health, reflection, TLS, the
//! interceptor chain, the reconcile loop and graceful shutdown.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use bigfleet_proto::v1alpha1::capacity_provider_server::CapacityProviderServer;
use providerkit::service::CapacityService;
use providerkit::{Engine, MemoryStore, Store};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_stream::StreamExt;
use tonic_health::ServingStatus;

use crate::backend::ProxmoxBackend;
use crate::fake::FakeCluster;
use crate::layers::{CatchPanicLayer, ObserveLayer};
use crate::metrics::Metrics;
use crate::substrate::{Metered, Substrate};
use crate::{BackendKind, Plan};

/// Shared by `/readyz` and gRPC health.
#[derive(Clone, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::SeqCst);
    }
    pub fn get(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

async fn bind(flag: &str, addr: std::net::SocketAddr) -> Result<TcpListener, String> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {flag} {addr}: {e}"))
}

fn http_router(metrics: Arc<Metrics>, ready: Readiness) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(
                |State((metrics, _)): State<(Arc<Metrics>, Readiness)>| async move {
                    match metrics.encode() {
                        Ok(body) => (
                            StatusCode::OK,
                            [(
                                header::CONTENT_TYPE,
                                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                            )],
                            body,
                        )
                            .into_response(),
                        Err(_) => {
                            (StatusCode::INTERNAL_SERVER_ERROR, "encoding failed").into_response()
                        }
                    }
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

fn open_store(plan: &Plan) -> Result<Arc<dyn Store>, String> {
    match &plan.state {
        None => Ok(Arc::new(MemoryStore::new())),
        Some(path) => Err(format!(
            "--state {}: durable state is not available in this build",
            path.display()
        )),
    }
}

fn substrate(plan: &Plan) -> Result<Arc<dyn Substrate>, String> {
    match plan.backend {
        BackendKind::Fake => Ok(Arc::new(FakeCluster::new(
            plan.zones.clone(),
            plan.args.fake_latency,
        ))),
        BackendKind::Proxmox => {
            Err("the Proxmox API backend is not available in this build".into())
        }
    }
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Run until SIGINT/SIGTERM. Errors are startup failures, one line each.
pub async fn run(plan: Plan) -> Result<(), String> {
    let grpc_listener = bind("--addr", plan.addr).await?;
    let local_addr = grpc_listener
        .local_addr()
        .map_err(|e| format!("--addr: {e}"))?;
    let metrics = Metrics::new();
    let ready = Readiness::default();
    let metrics_local = match plan.metrics_addr {
        Some(addr) => {
            let listener = bind("--metrics-addr", addr).await?;
            let local = listener
                .local_addr()
                .map_err(|e| format!("--metrics-addr: {e}"))?;
            let router = http_router(metrics.clone(), ready.clone());
            tokio::spawn(async move {
                if let Err(e) = axum::serve(listener, router).await {
                    tracing::error!(error = %e, "metrics listener stopped");
                }
            });
            Some(local)
        }
        None => None,
    };

    if plan.backend == BackendKind::Fake {
        tracing::warn!(
            "FAKE BACKEND: machines are simulated in memory and no Proxmox cluster is touched; \
             for testing and certification only"
        );
    }
    let store = open_store(&plan)?;
    if plan.state.is_none() {
        tracing::info!("no --state: lifecycle state, fences and bindings are kept in memory only and are lost on restart");
    }
    let substrate: Arc<dyn Substrate> = Arc::new(Metered::new(substrate(&plan)?, metrics.clone()));
    let backend = Arc::new(ProxmoxBackend::new(
        plan.slots.clone(),
        plan.types.clone(),
        crate::catalog::Pricing {
            explicit: plan.pricing.explicit.clone(),
            per_vcpu_hour: plan.pricing.per_vcpu_hour,
            per_gib_hour: plan.pricing.per_gib_hour,
        },
        substrate,
    ));
    let engine = Engine::start(backend, store, plan.engine.clone())
        .await
        .map_err(|e| format!("startup failed: {e}"))?;

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    let reflection = if plan.args.reflection {
        Some(
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(bigfleet_proto::v1alpha1::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
                .build_v1()
                .map_err(|e| format!("reflection setup failed: {e}"))?,
        )
    } else {
        None
    };
    let reflection_alpha = if plan.args.reflection {
        Some(
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(bigfleet_proto::v1alpha1::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
                .build_v1alpha()
                .map_err(|e| format!("reflection setup failed: {e}"))?,
        )
    } else {
        None
    };

    let router = tonic::transport::Server::builder()
        .layer(ObserveLayer {
            metrics: metrics.clone(),
        })
        .layer(CatchPanicLayer {
            metrics: metrics.clone(),
        })
        .add_service(CapacityService::new(engine.clone()).into_server())
        .add_service(health_service)
        .add_optional_service(reflection)
        .add_optional_service(reflection_alpha);

    // Reconcile in the background; an unchanged pass bumps nothing.
    if !plan.args.reconcile_interval.is_zero() {
        let engine = engine.clone();
        let metrics = metrics.clone();
        let period = plan.args.reconcile_interval;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match engine.reconcile().await {
                    Ok(report) => {
                        metrics.observe_reconcile(true);
                        if report.added + report.refreshed > 0 {
                            tracing::info!(
                                added = report.added,
                                refreshed = report.refreshed,
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
    tracing::info!(
        addr = %local_addr,
        provider = %plan.args.provider,
        proxmox_backend = plan.backend.name(),
        security = plan.security.name(),
        offerings = plan.slots.len(),
        zones = %plan.zones.join(","),
        metrics_addr = %metrics_local.map(|a| a.to_string()).unwrap_or_else(|| "disabled".into()),
        store = %engine_store_name(&plan),
        "serving CapacityProvider"
    );

    let shutdown = {
        let ready = ready.clone();
        let health_reporter = health_reporter.clone();
        async move {
            shutdown_signal().await;
            tracing::info!("shutdown requested: not ready, draining in-flight RPCs");
            ready.set(false);
            health_reporter
                .set_not_serving::<CapacityProviderServer<CapacityService>>()
                .await;
            health_reporter
                .set_service_status("", ServingStatus::NotServing)
                .await;
        }
    };

    let incoming = TcpListenerStream::new(grpc_listener);
    let served = match plan.tls.clone() {
        None => {
            router
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
        }
        Some(config) => {
            let acceptor = tokio_rustls::TlsAcceptor::from(config);
            let tls_incoming = incoming
                .filter_map(|conn| conn.ok())
                .then(move |tcp| {
                    let acceptor = acceptor.clone();
                    async move {
                        let peer = tcp.peer_addr().ok();
                        match acceptor.accept(tcp).await {
                            Ok(stream) => Some(Ok::<_, std::io::Error>(stream)),
                            Err(e) => {
                                tracing::warn!(peer = ?peer, error = %e, "TLS handshake failed");
                                None
                            }
                        }
                    }
                })
                .filter_map(|s| s);
            router
                .serve_with_incoming_shutdown(tls_incoming, shutdown)
                .await
        }
    };
    served.map_err(|e| format!("gRPC server failed: {e}"))?;
    tracing::info!("stopped");
    Ok(())
}

fn engine_store_name(plan: &Plan) -> String {
    match &plan.state {
        None => "memory".into(),
        Some(p) => format!("sqlite:{}", p.display()),
    }
}
