//! Readiness follows the store: `/readyz` and gRPC health go NOT_SERVING
//! while the store cannot commit and come back by themselves once it can.
//! The store here fails its commits on demand (as a full disk does).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bigfleet_proxmox::metrics::Metrics;
use bigfleet_proxmox::serve::{follow_store_health, http_router, Readiness};
use futures::future::BoxFuture;
use provider_testkit::wait::Wait;
use providerkit::{Change, Engine, EngineOptions, Loaded, MemoryStore, Store, StoreError, Ticket};
use proxmox_backend::backend::ProxmoxBackend;
use proxmox_backend::catalog::Pricing;
use proxmox_backend::fake::FakeCluster;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use crate::common;

/// A memory store whose commits fail while `failing` is set.
struct FlakyStore {
    inner: MemoryStore,
    failing: Arc<AtomicBool>,
}

impl Store for FlakyStore {
    fn load(&self) -> Result<Loaded, StoreError> {
        self.inner.load()
    }
    fn submit(&self, changes: Vec<Change>) -> Ticket {
        self.inner.submit(changes)
    }
    fn durable(&self, ticket: Ticket) -> BoxFuture<'static, Result<(), StoreError>> {
        if self.failing.load(Ordering::SeqCst) {
            return Box::pin(async { Err(StoreError::unavailable("disk full")) });
        }
        self.inner.durable(ticket)
    }
    fn describe(&self) -> String {
        "flaky".into()
    }
    fn health(&self) -> Result<(), StoreError> {
        if self.failing.load(Ordering::SeqCst) {
            Err(StoreError::unavailable("disk full"))
        } else {
            Ok(())
        }
    }
}

async fn readyz(addr: std::net::SocketAddr) -> u16 {
    tokio::task::spawn_blocking(move || common::http_get(addr, "/readyz"))
        .await
        .unwrap()
        .map(|(code, _)| code)
        .unwrap_or(0)
}

/// Poll until both probes say `want` (or fail after 10 s).
async fn wait_both(
    addr: std::net::SocketAddr,
    health: &mut HealthClient<tonic::transport::Channel>,
    want: bool,
) {
    Wait::new(
        format!("both probes to say ready={want}"),
        Duration::from_secs(10),
    )
    .every(Duration::from_millis(20))
    .try_ok_async(|| {
        let mut health = health.clone();
        async move {
            let code = readyz(addr).await;
            let status = health
                .check(HealthCheckRequest {
                    service: "bigfleet.v1alpha1.CapacityProvider".into(),
                })
                .await
                .map(|r| r.into_inner().status)
                .unwrap_or(-1);
            let serving = status == ServingStatus::Serving as i32;
            if (code == 200) == want && serving == want {
                Ok(())
            } else {
                Err((code, status))
            }
        }
    })
    .await
    .unwrap_or_else(|t| {
        let (code, status) = t.last;
        panic!("wanted ready={want}; /readyz {code}, health {status}")
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_goes_not_serving_while_the_store_cannot_commit() {
    let failing = Arc::new(AtomicBool::new(false));
    let store = Arc::new(FlakyStore {
        inner: MemoryStore::new(),
        failing: failing.clone(),
    });
    let pricing = Pricing {
        explicit: Default::default(),
        per_vcpu_hour: 0.0,
        per_gib_hour: 0.0,
    };
    let cluster = Arc::new(FakeCluster::new(vec!["pve1".into()], Duration::ZERO));
    let backend = Arc::new(ProxmoxBackend::new(
        vec![],
        BTreeMap::new(),
        pricing,
        cluster,
    ));
    let engine = Engine::start(backend, store, EngineOptions::default())
        .await
        .unwrap();

    let ready = Readiness::default();
    ready.set(true);
    let (reporter, health_service) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<bigfleet_proto::serving::capacity_provider_server::CapacityProviderServer<
            providerkit::service::CapacityService,
        >>()
        .await;
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http_addr = http.local_addr().unwrap();
    let probe = ready.clone();
    tokio::spawn(async move { axum::serve(http, http_router(Metrics::new(), probe)).await });
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let grpc_addr = grpc.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(health_service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(grpc)),
    );
    tokio::spawn(follow_store_health(
        engine.clone(),
        ready.clone(),
        reporter,
        Duration::from_millis(20),
    ));
    let mut health = HealthClient::new(common::plain_channel(grpc_addr).await);

    wait_both(http_addr, &mut health, true).await;
    failing.store(true, Ordering::SeqCst);
    assert_eq!(
        engine.read_barrier().await.unwrap_err().code(),
        tonic::Code::Unavailable
    );
    wait_both(http_addr, &mut health, false).await;
    failing.store(false, Ordering::SeqCst);
    wait_both(http_addr, &mut health, true).await;
    engine.read_barrier().await.unwrap();
}
