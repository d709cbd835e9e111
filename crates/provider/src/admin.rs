//! `bigfleet.proxmox.admin.v1.Admin`: the provider's own day-2 RPCs, served
//! next to CapacityProvider on the same listener (so the same TLS/mTLS
//! guards them). Under mTLS every Admin RPC needs the `bigfleet://admin`
//! identity ([`crate::guard`]). CapacityProvider's wire is untouched.

use std::sync::Arc;

use bigfleet_proto::admin::admin_server::{Admin, AdminServer};
use bigfleet_proto::admin::{
    NodeMemoryRequest, NodeMemoryResponse, NodeRoom, ReclaimRequest, ReclaimResponse,
    ReclaimStatus, StorageRoom, TimelineRequest, TimelineResponse, TimelineStep, TypeFit,
};
use providerkit::{Engine, ReclaimOutcome};
use proxmox_backend::backend::ProxmoxBackend;
use tonic::{Request, Response, Status};

use crate::guard::IdentityGuard;
use crate::identity::Need;

pub struct AdminService {
    engine: Arc<Engine>,
    guard: Arc<IdentityGuard>,
    /// Whose node memory guard NodeMemory reports.
    backend: Arc<ProxmoxBackend>,
}

impl AdminService {
    pub fn new(
        engine: Arc<Engine>,
        guard: Arc<IdentityGuard>,
        backend: Arc<ProxmoxBackend>,
    ) -> AdminService {
        AdminService {
            engine,
            guard,
            backend,
        }
    }

    pub fn into_server(self) -> AdminServer<AdminService> {
        AdminServer::new(self)
    }
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn reclaim(
        &self,
        request: Request<ReclaimRequest>,
    ) -> Result<Response<ReclaimResponse>, Status> {
        // Before anything else: a refused caller learns nothing of the id.
        self.guard.admit(&request, "Reclaim", Need::Admin)?;
        let req = request.into_inner();
        // The same cap as CapacityProvider's ids, checked before the id is
        // logged or echoed (an error quotes only a short prefix).
        let cap = self.engine.options().limits.max_machine_id_bytes;
        if req.machine_id.len() > cap {
            return Err(Status::invalid_argument(format!(
                "machine_id {} is {} bytes; the cap is {cap} bytes",
                providerkit::engine::echo_prefix(&req.machine_id),
                req.machine_id.len()
            )));
        }
        tracing::info!(machine_id = %req.machine_id, wait = req.wait, "reclaim requested");
        let handle = self.engine.start_reclaim(&req.machine_id)?;
        let response = |status: ReclaimStatus, revision: u64| ReclaimResponse {
            machine_id: req.machine_id.clone(),
            status: status as i32,
            revision,
        };
        if !req.wait && handle.started() {
            let revision = handle.machine.rev;
            // The reclaim runs on in its own task; its outcome is logged.
            return Ok(Response::new(response(ReclaimStatus::Started, revision)));
        }
        let outcome = handle.wait().await?;
        let status = match &outcome {
            ReclaimOutcome::Reclaimed(_) => ReclaimStatus::Reclaimed,
            ReclaimOutcome::AlreadySpeculative(_) => ReclaimStatus::AlreadySpeculative,
        };
        Ok(Response::new(response(status, outcome.machine().rev)))
    }

    async fn node_memory(
        &self,
        request: Request<NodeMemoryRequest>,
    ) -> Result<Response<NodeMemoryResponse>, Status> {
        // What Get and List may see: room is no secret of an admin's.
        self.guard.admit(&request, "NodeMemory", Need::Read)?;
        const MIB: u64 = 1 << 20;
        let nodes = self
            .backend
            .memory_rooms()
            .into_iter()
            .map(|room| NodeRoom {
                fits: self
                    .backend
                    .fits(&room)
                    .into_iter()
                    .map(|(instance_type, count)| TypeFit {
                        instance_type,
                        count,
                    })
                    .collect(),
                memory_bytes: room.memory_mib.saturating_mul(MIB),
                committed_bytes: room.committed_mib.saturating_mul(MIB),
                limit_bytes: room.limit_mib.saturating_mul(MIB),
                node: room.node,
            })
            .collect();
        let storages = self
            .backend
            .storage_spaces()
            .into_iter()
            .map(|space| StorageRoom {
                allowed_bytes: space.allowed_bytes(),
                avail_bytes: space.avail_bytes,
                in_flight_bytes: space.in_flight_bytes,
                overcommit: space.overcommit,
                node: space.node.unwrap_or_default(),
                storage: space.storage,
            })
            .collect();
        Ok(Response::new(NodeMemoryResponse { nodes, storages }))
    }

    async fn timeline(
        &self,
        request: Request<TimelineRequest>,
    ) -> Result<Response<TimelineResponse>, Status> {
        // What Get may see: a machine's own history.
        self.guard.admit(&request, "Timeline", Need::Read)?;
        let req = request.into_inner();
        let cap = self.engine.options().limits.max_machine_id_bytes;
        if req.machine_id.is_empty() || req.machine_id.len() > cap {
            return Err(Status::invalid_argument(format!(
                "machine_id {} is {} bytes; it must be 1 to {cap} bytes",
                providerkit::engine::echo_prefix(&req.machine_id),
                req.machine_id.len()
            )));
        }
        // The engine's own NOT_FOUND for an unknown id, as Get answers.
        self.engine.get(&req.machine_id)?;
        let steps = self
            .backend
            .timeline_now(&req.machine_id)
            .await
            .into_iter()
            .map(|r| TimelineStep {
                step: r.step.name().to_string(),
                started_unix_ms: r
                    .started
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
                duration_ms: u64::try_from(r.duration.as_millis()).unwrap_or(u64::MAX),
                upid: r.upid.unwrap_or_default(),
                error: r.error.unwrap_or_default(),
                running: r.running,
                copied_percent: r.copied_percent,
                node: r.node,
            })
            .collect();
        Ok(Response::new(TimelineResponse {
            machine_id: req.machine_id,
            steps,
        }))
    }
}

/// `--reclaim-failed-after`: sweep for machines held FAILED that long and
/// reclaim them. A zero hold turns it off.
pub fn spawn_auto_reclaim(
    engine: &Arc<Engine>,
    hold: std::time::Duration,
) -> Option<tokio::task::JoinHandle<()>> {
    if hold.is_zero() {
        return None;
    }
    let engine = Arc::clone(engine);
    Some(tokio::spawn(async move {
        let mut sweeper = providerkit::ReclaimSweeper::new(hold);
        let mut tick = tokio::time::interval(sweeper.period());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            sweeper.sweep(&engine).await;
        }
    }))
}
