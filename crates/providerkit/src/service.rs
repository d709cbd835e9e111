//! The gRPC face of the engine: `bigfleet.v1alpha1.CapacityProvider`.

use std::sync::Arc;

use bigfleet_proto::raw::{EncodedMachine, EncodedMachineList};
use bigfleet_proto::serving as pb;
use bigfleet_proto::serving::capacity_provider_server::{CapacityProvider, CapacityProviderServer};
use tonic::{Request, Response, Status};

use crate::engine::{Ack, Engine};
use crate::fence::Token;

/// The message the serving binary logs once its gRPC listener accepts calls;
/// tools that boot a provider wait for it.
pub const STARTUP_MESSAGE: &str = "serving CapacityProvider";

/// Largest request the service decodes: room for the bootstrap blob cap
/// plus metadata; anything larger is refused by the transport.
pub const MAX_DECODING_MESSAGE_SIZE: usize = 4 * 1024 * 1024;

/// Default budget for encoded List responses in flight. A full List of
/// 100k machines encodes to ~15 MiB (and is copied once more while tonic
/// frames it), so two fit; together with the inventory itself (~80 MiB at
/// 100k) that stays well inside the chart's 256 Mi memory limit whatever
/// the clients do.
pub const LIST_BUDGET_BYTES: usize = 32 * 1024 * 1024;

/// Budget units are KiB so a whole budget fits a semaphore's `u32`.
const BUDGET_UNIT: usize = 1024;

/// Bytes of encoded List responses that may exist at once (encoded and not
/// yet handed to the connection). A List beyond it waits (queued, not
/// failed) until earlier responses are sent or their callers go away: a
/// client that never reads its responses can only pin the budget, not grow
/// memory.
#[derive(Clone)]
pub struct ListBudget {
    semaphore: Arc<tokio::sync::Semaphore>,
    units: usize,
    /// Size of the last full List, the estimate the next one reserves
    /// before it snapshots (so queued Lists hold no snapshot).
    last_full: Arc<std::sync::atomic::AtomicUsize>,
}

impl ListBudget {
    pub fn new(bytes: usize) -> ListBudget {
        let units = bytes.div_ceil(BUDGET_UNIT).clamp(1, u32::MAX as usize);
        ListBudget {
            semaphore: Arc::new(tokio::sync::Semaphore::new(units)),
            units,
            last_full: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
        }
    }

    fn units_for(&self, bytes: usize) -> u32 {
        bytes.div_ceil(BUDGET_UNIT).clamp(1, self.units) as u32
    }

    async fn reserve(&self, bytes: usize) -> tokio::sync::OwnedSemaphorePermit {
        let units = self.units_for(bytes);
        match Arc::clone(&self.semaphore).acquire_many_owned(units).await {
            Ok(permit) => permit,
            // The semaphore is never closed; an empty permit stands in.
            Err(_) => unreachable_permit(),
        }
    }

    /// Budget units free now (tests and metrics).
    pub fn available_bytes(&self) -> usize {
        self.semaphore.available_permits() * BUDGET_UNIT
    }
}

fn unreachable_permit() -> tokio::sync::OwnedSemaphorePermit {
    // A fresh one-unit semaphore always has its permit.
    Arc::new(tokio::sync::Semaphore::new(1))
        .try_acquire_owned()
        .unwrap_or_else(|_| unreachable!("a fresh semaphore has its permit"))
}

/// A List response's share of the [`ListBudget`], carried in the response
/// extensions. The transport layer that sends the body takes it out and
/// holds it until the body is dropped (sent, or the caller went away).
#[derive(Clone)]
pub struct HeldBudget(Arc<parking_lot::Mutex<Option<tokio::sync::OwnedSemaphorePermit>>>);

impl HeldBudget {
    pub fn take(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.0.lock().take()
    }
}

#[derive(Clone)]
pub struct CapacityService {
    engine: Arc<Engine>,
    budget: ListBudget,
}

impl CapacityService {
    pub fn new(engine: Arc<Engine>) -> CapacityService {
        CapacityService::with_budget(engine, ListBudget::new(LIST_BUDGET_BYTES))
    }

    pub fn with_budget(engine: Arc<Engine>, budget: ListBudget) -> CapacityService {
        CapacityService { engine, budget }
    }

    pub fn into_server(self) -> CapacityProviderServer<CapacityService> {
        CapacityProviderServer::new(self).max_decoding_message_size(MAX_DECODING_MESSAGE_SIZE)
    }
}

fn ack(result: Result<Ack, crate::KitError>) -> Result<Response<pb::TransitionAck>, Status> {
    let ack = result?;
    Ok(Response::new(pb::TransitionAck {
        operation_id: ack.operation_id,
        machine: Some(ack.machine.encoded()),
    }))
}

#[tonic::async_trait]
impl CapacityProvider for CapacityService {
    async fn create(
        &self,
        request: Request<pb::CreateRequest>,
    ) -> Result<Response<pb::TransitionAck>, Status> {
        let r = request.into_inner();
        let token = Token::new(r.shard_id, r.shard_epoch, r.sequence_number);
        ack(self.engine.create(&r.machine_id, token).await)
    }

    async fn configure(
        &self,
        request: Request<pb::ConfigureRequest>,
    ) -> Result<Response<pb::TransitionAck>, Status> {
        let r = request.into_inner();
        let token = Token::new(r.shard_id, r.shard_epoch, r.sequence_number);
        ack(self
            .engine
            .configure(
                &r.machine_id,
                token,
                r.cluster_id,
                r.bootstrap_blob,
                r.shard_metadata,
            )
            .await)
    }

    async fn drain(
        &self,
        request: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::TransitionAck>, Status> {
        let r = request.into_inner();
        let token = Token::new(r.shard_id, r.shard_epoch, r.sequence_number);
        ack(self
            .engine
            .drain(&r.machine_id, token, r.grace_period_seconds)
            .await)
    }

    async fn delete(
        &self,
        request: Request<pb::DeleteRequest>,
    ) -> Result<Response<pb::TransitionAck>, Status> {
        let r = request.into_inner();
        let token = Token::new(r.shard_id, r.shard_epoch, r.sequence_number);
        ack(self.engine.delete(&r.machine_id, token).await)
    }

    async fn get(
        &self,
        request: Request<pb::MachineRef>,
    ) -> Result<Response<EncodedMachine>, Status> {
        let machine = self.engine.get_encoded(&request.into_inner().id)?;
        self.engine.read_barrier().await?;
        Ok(Response::new(machine))
    }

    async fn list(
        &self,
        request: Request<pb::ListFilter>,
    ) -> Result<Response<EncodedMachineList>, Status> {
        let r = request.into_inner();
        let full = r.max_results <= 0;
        let budget = &self.budget;
        // Reserve the expected size before taking the snapshot, so a queued
        // List holds nothing but its place in the queue.
        let estimate = if full {
            budget.last_full.load(std::sync::atomic::Ordering::Relaxed)
        } else {
            0
        };
        let mut permit = budget.reserve(estimate).await;
        let page = self
            .engine
            .list(&r.states, r.max_results, &r.since_revision);
        self.engine.read_barrier().await?;
        let bytes: usize = page.machines.iter().map(|m| m.wire_len() + 8).sum();
        if full {
            budget
                .last_full
                .store(bytes, std::sync::atomic::Ordering::Relaxed);
        }
        let need = budget.units_for(bytes) as usize;
        if need > permit.num_permits() {
            // Never wait holding a part of the budget: two Lists each holding
            // half and waiting for the rest would stall each other.
            drop(permit);
            permit = budget.reserve(bytes).await;
        } else if let Some(excess) = permit.split(permit.num_permits() - need) {
            drop(excess);
        }
        let mut response = Response::new(page.encode());
        response
            .extensions_mut()
            .insert(HeldBudget(Arc::new(parking_lot::Mutex::new(Some(permit)))));
        Ok(response)
    }
}
