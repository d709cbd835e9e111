//! The gRPC face of the engine: `bigfleet.v1alpha1.CapacityProvider`.

use std::collections::HashMap;
use std::net::SocketAddr;
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
///
/// Fair between connections: one connection holds at most a quarter of the
/// budget, or one List when a List is larger; its further Lists queue behind
/// its own. A client that never reads therefore cannot starve the others.
#[derive(Clone)]
pub struct ListBudget {
    semaphore: Arc<tokio::sync::Semaphore>,
    units: usize,
    /// Size of the last full List, the estimate the next one reserves
    /// before it snapshots (so queued Lists hold no snapshot).
    last_full: Arc<std::sync::atomic::AtomicUsize>,
    /// Each connection's share, by peer address; an entry lives while a
    /// List of that connection holds or waits for budget.
    shares: Arc<parking_lot::Mutex<HashMap<SocketAddr, Arc<tokio::sync::Semaphore>>>>,
}

/// Part of the budget a single connection may hold, as a divisor.
const CONNECTION_SHARE: usize = 4;

impl ListBudget {
    pub fn new(bytes: usize) -> ListBudget {
        let units = bytes.div_ceil(BUDGET_UNIT).clamp(1, u32::MAX as usize);
        ListBudget {
            semaphore: Arc::new(tokio::sync::Semaphore::new(units)),
            units,
            last_full: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            shares: Arc::default(),
        }
    }

    fn units_for(&self, bytes: usize) -> u32 {
        bytes.div_ceil(BUDGET_UNIT).clamp(1, self.units) as u32
    }

    /// Units of one connection's share.
    fn share_units(&self) -> usize {
        (self.units / CONNECTION_SHARE).max(1)
    }

    /// Waits for `bytes` of the budget: first within the connection's own
    /// share (a List larger than the share takes all of it), then from the
    /// whole. `peer` is `None` for in-process callers: no share applies.
    async fn reserve(&self, bytes: usize, peer: Option<SocketAddr>) -> ListPermit {
        let units = self.units_for(bytes);
        let share = match peer {
            None => None,
            Some(peer) => {
                let sem =
                    Arc::clone(self.shares.lock().entry(peer).or_insert_with(|| {
                        Arc::new(tokio::sync::Semaphore::new(self.share_units()))
                    }));
                let want = (units as usize).min(self.share_units()) as u32;
                // The guard exists before the wait, so a List cancelled while
                // queued still lets its connection's entry go.
                let mut share = SharePermit {
                    sem,
                    units: 0,
                    peer,
                    shares: Arc::clone(&self.shares),
                };
                // Never closed; on the impossible error the share is skipped.
                if let Ok(permit) = share.sem.acquire_many(want).await {
                    permit.forget();
                    share.units = want;
                }
                Some(share)
            }
        };
        let whole = match Arc::clone(&self.semaphore).acquire_many_owned(units).await {
            Ok(permit) => permit,
            // The semaphore is never closed; an empty permit stands in.
            Err(_) => unreachable_permit(),
        };
        ListPermit {
            whole,
            _share: share,
        }
    }

    /// Budget units free now (tests and metrics).
    pub fn available_bytes(&self) -> usize {
        self.semaphore.available_permits() * BUDGET_UNIT
    }

    /// Connections holding or waiting for a share now (tests and metrics).
    pub fn connections(&self) -> usize {
        self.shares.lock().len()
    }
}

fn unreachable_permit() -> tokio::sync::OwnedSemaphorePermit {
    // A fresh one-unit semaphore always has its permit.
    Arc::new(tokio::sync::Semaphore::new(1))
        .try_acquire_owned()
        .unwrap_or_else(|_| unreachable!("a fresh semaphore has its permit"))
}

/// A List response's hold on the budget: its bytes of the whole and of its
/// connection's share, released together when it is dropped.
pub struct ListPermit {
    whole: tokio::sync::OwnedSemaphorePermit,
    _share: Option<SharePermit>,
}

impl ListPermit {
    fn units(&self) -> usize {
        self.whole.num_permits()
    }

    /// Gives back all but `keep` units of the whole (the share stays: it
    /// only orders one connection's own Lists).
    fn shrink_to(&mut self, keep: usize) {
        if let Some(excess) = self.whole.split(self.units().saturating_sub(keep)) {
            drop(excess);
        }
    }
}

struct SharePermit {
    sem: Arc<tokio::sync::Semaphore>,
    /// Units of the share held (0 while waiting).
    units: u32,
    peer: SocketAddr,
    shares: Arc<parking_lot::Mutex<HashMap<SocketAddr, Arc<tokio::sync::Semaphore>>>>,
}

impl Drop for SharePermit {
    fn drop(&mut self) {
        self.sem.add_permits(self.units as usize);
        // Forget the connection once nothing of it holds or waits: each
        // holder and waiter keeps a clone of the semaphore, the map one more.
        let mut shares = self.shares.lock();
        if shares
            .get(&self.peer)
            .is_some_and(|sem| Arc::strong_count(sem) == 2)
        {
            shares.remove(&self.peer);
        }
    }
}

/// A List response's share of the [`ListBudget`], carried in the response
/// extensions. The transport layer that sends the body takes it out and
/// holds it until the body is dropped (sent, or the caller went away).
#[derive(Clone)]
pub struct HeldBudget(Arc<parking_lot::Mutex<Option<ListPermit>>>);

impl HeldBudget {
    pub fn take(&self) -> Option<ListPermit> {
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
        // The connection, for its fair share of the budget.
        let peer = request.remote_addr();
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
        let mut permit = budget.reserve(estimate, peer).await;
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
        if need > permit.units() {
            // Never wait holding a part of the budget: two Lists each holding
            // half and waiting for the rest would stall each other.
            drop(permit);
            permit = budget.reserve(bytes, peer).await;
        } else {
            permit.shrink_to(need);
        }
        let mut response = Response::new(page.encode());
        response
            .extensions_mut()
            .insert(HeldBudget(Arc::new(parking_lot::Mutex::new(Some(permit)))));
        Ok(response)
    }
}
