//! The probes: readiness (`/readyz` and gRPC health follow one flag and
//! the store's health) and the metrics listener's routes (`/metrics`,
//! `/healthz`, `/readyz`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::routing::get;
use axum::Router;
use bigfleet_proto::serving::capacity_provider_server::CapacityProviderServer;
use providerkit::service::CapacityService;
use providerkit::Engine;
use tonic_health::ServingStatus;

use crate::metrics::Metrics;

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
        set_health(health.clone(), status).await;
    }
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

/// gRPC health of the CapacityProvider service and of the server (`""`).
pub async fn set_health(health: tonic_health::server::HealthReporter, status: ServingStatus) {
    health
        .set_service_status(
            <CapacityProviderServer<CapacityService> as tonic::server::NamedService>::NAME,
            status,
        )
        .await;
    health.set_service_status("", status).await;
}
