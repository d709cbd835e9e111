//! The List budget: responses hold their share until their body is gone,
//! and a List beyond the budget waits (queued, not failed).
//!
//! On tokio's paused clock: the budget is tokio semaphores, so "still
//! waiting" is shown by letting every task run until all are blocked
//! (`settle`) rather than by sleeping a while.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bigfleet_proto::serving as pb;
use bigfleet_proto::serving::capacity_provider_server::CapacityProvider;
use bigfleet_proto::v1alpha1 as v1;
use provider_testkit::wait::{settle, until_some};
use providerkit::service::{CapacityService, HeldBudget, ListBudget};
use providerkit::{
    Backend, BackendError, CatalogFacts, ConfigureCtx, CreateCtx, DrainCtx, Engine, EngineOptions,
    MemoryStore, SlotSpec, SubstrateHost,
};

struct Slots(usize);

#[async_trait]
impl Backend for Slots {
    async fn describe(&self) -> Result<Vec<SlotSpec>, BackendError> {
        Ok((0..self.0)
            .map(|i| SlotSpec {
                id: format!("m-{i:05}"),
                facts: CatalogFacts {
                    instance_type: "pve.small".into(),
                    zone: "pve-a".into(),
                    capacity_type: v1::CapacityType::OnDemand,
                    resources: HashMap::from([("cpu".into(), "1".into())]),
                    ..Default::default()
                }
                .share(),
                host: None,
            })
            .collect())
    }
    async fn create(&self, _ctx: CreateCtx) -> Result<SubstrateHost, BackendError> {
        Err(BackendError::new("unused"))
    }
    async fn configure(&self, _ctx: &ConfigureCtx) -> Result<(), BackendError> {
        Err(BackendError::new("unused"))
    }
    async fn drain(&self, _ctx: DrainCtx) -> Result<(), BackendError> {
        Err(BackendError::new("unused"))
    }
}

#[tokio::test(start_paused = true)]
async fn lists_beyond_the_budget_queue_until_earlier_bodies_are_gone() {
    let engine = Engine::start(
        Arc::new(Slots(2000)),
        Arc::new(MemoryStore::new()),
        EngineOptions::default(),
    )
    .await
    .unwrap();
    let full = || tonic::Request::new(pb::ListFilter::default());
    // Room for one full List of 2,000 machines (~100 KiB), not two.
    let budget = ListBudget::new(160 * 1024);
    let service = CapacityService::with_budget(engine, budget.clone());

    let first = service.list(full()).await.unwrap();
    let held = first.extensions().get::<HeldBudget>().cloned().unwrap();
    assert!(budget.available_bytes() < 160 * 1024);
    // The first response still holds its share: a second full List waits.
    let svc = service.clone();
    let second = tokio::spawn(async move { svc.list(full()).await });
    settle().await;
    assert!(
        !second.is_finished(),
        "the second List did not wait for the budget"
    );
    // Dropping the share (the transport drops it with the body) lets it run.
    drop(held.take());
    drop(first);
    let second = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .expect("the queued List ran once the budget was free")
        .unwrap()
        .expect("queued, not failed");
    assert!(second.into_inner().as_bytes().len() > 50_000);
    // A capped List needs only its own small share.
    let capped = service
        .list(tonic::Request::new(pb::ListFilter {
            max_results: 10,
            ..Default::default()
        }))
        .await
        .unwrap();
    drop(capped);
}

fn full_from(peer: &str) -> tonic::Request<pb::ListFilter> {
    let mut request = tonic::Request::new(pb::ListFilter::default());
    request
        .extensions_mut()
        .insert(tonic::transport::server::TcpConnectInfo {
            local_addr: None,
            remote_addr: Some(peer.parse().expect("address")),
        });
    request
}

#[tokio::test(start_paused = true)]
async fn a_connection_that_never_reads_cannot_starve_another() {
    let engine = Engine::start(
        Arc::new(Slots(2000)),
        Arc::new(MemoryStore::new()),
        EngineOptions::default(),
    )
    .await
    .unwrap();
    // Room for three full Lists of 2,000 machines (~100 KiB each); one
    // connection's share is a quarter of it, so it holds one List at a time.
    let budget = ListBudget::new(320 * 1024);
    let service = CapacityService::with_budget(engine, budget.clone());
    let slow = "127.0.0.1:40001";

    // The slow client's first List is encoded and never read: it holds.
    let first = service.list(full_from(slow)).await.unwrap();
    let held = first.extensions().get::<HeldBudget>().cloned().unwrap();
    // Its next Lists queue behind its own share instead of taking the rest
    // of the budget (without the share they would fit and hold it all).
    let queued: Vec<_> = (0..2)
        .map(|_| {
            let svc = service.clone();
            tokio::spawn(async move { svc.list(full_from(slow)).await })
        })
        .collect();
    settle().await;
    assert!(
        queued.iter().all(|t| !t.is_finished()),
        "the slow connection took more than its share"
    );

    // Another client's full List completes meanwhile.
    let svc = service.clone();
    let other = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::spawn(async move { svc.list(full_from("127.0.0.1:40002")).await }),
    )
    .await
    .expect("a second client's full List completes while the first never reads")
    .unwrap()
    .expect("listed");
    assert!(other.into_inner().as_bytes().len() > 50_000);
    assert!(queued.iter().all(|t| !t.is_finished()));

    // The slow client's queued Lists run as it lets go of the first.
    drop(held.take());
    drop(first);
    let mut queued = queued;
    while !queued.is_empty() {
        // One at a time gets the share; drop each as soon as it is done.
        let done = until_some(
            "queued List runs once its connection's share is free",
            Duration::from_secs(10),
            || queued.iter().position(|t| t.is_finished()),
        )
        .await;
        let response = queued.swap_remove(done).await.unwrap().expect("listed");
        drop(response);
    }
    assert_eq!(budget.available_bytes(), 320 * 1024, "all returned");
    assert_eq!(budget.connections(), 0, "no connection entry is kept");
}
