//! The node memory guard on a real cluster: what a node holds, read from
//! PVE, fed to the shared [`MemoryGuard`] (the fake substrate feeds the same
//! guard from its own state).
//!
//! A node's memory is its `maxmem` in `GET /nodes`. What counts against it
//! is read from `GET /nodes/{node}/qemu`, the node's own answer (qemu-server
//! `vmstatus`: `status`, `lock` and `maxmem`, the configured `memory` in
//! bytes, are current there, without the RRD lag of `/cluster/resources`):
//!
//! - a running VM (paused and suspended-to-RAM ones are running too: their
//!   memory stays allocated), whoever owns it;
//! - a VM locked `clone` or `create`: one being made, which its maker is
//!   about to start (ours always are), counted at its configured memory;
//!
//! and not templates or stopped VMs (suspended-to-disk ones included: they
//! hold no memory until someone resumes them). The provider's own clones in
//! flight are counted by their claims, at their instance type's memory, not
//! by the bare `lock: clone` config PVE shows while copying.

use std::collections::HashSet;
use std::sync::Arc;

use pve::ClusterVm;
use tokio::time::Instant;

use super::api::{err_at, Api, QUICK_READ};
use super::inventory::Inventory;
use super::marker::vm_name;
use crate::memory::{
    bytes_to_mib, ClaimRequest, CountedVm, MemoryClaim, MemoryGuard, MemoryRoom, NoRoom, NodeView,
};
use crate::substrate::{CloneRequest, SubstrateError};

/// PVE's default `memory` (MiB), what a VM without the option has.
const PVE_DEFAULT_MEMORY_MIB: u64 = 512;

/// Why a claim was not made.
#[derive(Debug)]
enum ClaimError {
    NoRoom(NoRoom),
    /// The node's memory or VMs could not be read.
    Unread(SubstrateError),
}

/// Reads nodes for the guard; owns no state (the guard does).
pub(super) struct NodeMemory {
    api: Arc<Api>,
    inventory: Arc<Inventory>,
    guard: Arc<MemoryGuard>,
}

/// The memory a VM holds against its node, MiB; `None`: it does not count.
pub(super) fn counted_mib(v: &ClusterVm) -> Option<u64> {
    let about_to_run = matches!(v.lock.as_deref(), Some("clone" | "create"));
    if v.template || !(v.status == "running" || about_to_run) {
        return None;
    }
    Some(v.maxmem.map_or(PVE_DEFAULT_MEMORY_MIB, bytes_to_mib))
}

/// A VM with no name of its own: none, empty, or the `VM <vmid>` qemu-server
/// `vmstatus` stands in for a missing one.
fn unnamed(v: &ClusterVm) -> bool {
    v.name
        .as_deref()
        .is_none_or(|n| n.is_empty() || n == format!("VM {}", v.vmid))
}

impl NodeMemory {
    pub(super) fn new(api: Arc<Api>, limit: f64, inventory: Arc<Inventory>) -> NodeMemory {
        let guard = MemoryGuard::new(limit);
        NodeMemory {
            api,
            inventory,
            guard,
        }
    }

    pub(super) fn guard(&self) -> &Arc<MemoryGuard> {
        &self.guard
    }

    /// The view of `node` from `rows` (its VMs), with our own clones in
    /// flight left out (their claims count them).
    fn view_of(&self, memory_mib: u64, rows: &[ClusterVm]) -> NodeView {
        let ours: HashSet<u32> = self.inventory.pending_vmids();
        NodeView {
            memory_mib,
            vms: rows
                .iter()
                .filter(|v| !ours.contains(&v.vmid))
                .filter_map(|v| {
                    Some(CountedVm {
                        vmid: v.vmid,
                        name: v.name.clone(),
                        memory_mib: counted_mib(v)?,
                        unnamed_clone: unnamed(v) && v.lock.as_deref() == Some("clone"),
                    })
                })
                .collect(),
        }
    }

    /// Reads `node`'s memory and VMs (retried within `deadline`).
    async fn read(&self, node: &str, deadline: Instant) -> Result<NodeView, SubstrateError> {
        let api = &self.api;
        let what = format!("reading the memory of node {node} (the node memory guard)");
        let listed = api
            .retry_raw(Some(node), deadline, |pve| pve.nodes())
            .await
            .map_err(|e| err_at(&what, Some(node), &e))?;
        let row = listed.iter().find(|n| n.node == node);
        let Some(memory) = row.and_then(|n| n.maxmem) else {
            if row.is_some_and(|n| n.status == "online") {
                // pve-manager lists a node the token may not audit without
                // its figures (`extract_node_stats`): nothing to check a
                // Create against, and nothing that clears by waiting.
                return Err(SubstrateError::with_kind(
                    providerkit::ErrorKind::Refused,
                    format!(
                        "{what}: GET /nodes lists node {node} online but without its memory figures: \
                         the API token lacks Sys.Audit on /nodes/{node}. Grant it (`pveum acl modify /nodes \
                         --tokens '{}' --roles PVEAuditor`), or turn the guard off (--node-memory-limit 0)",
                        api.token_id()
                    ),
                ));
            }
            return Err(SubstrateError::with_kind(
                providerkit::ErrorKind::Transient,
                format!("{what}: GET /nodes reports no maxmem for node {node} (offline, or not in the cluster)"),
            ));
        };
        let rows = api
            .retry_raw(Some(node), deadline, |pve| pve.node_vms(node))
            .await
            .map_err(|e| err_at(&what, Some(node), &e))?;
        Ok(self.view_of(bytes_to_mib(memory), &rows))
    }

    /// Checks and claims the memory of `req` on its node. With `force`,
    /// claims without checking (a Create the process before admitted).
    async fn claim(
        &self,
        req: &CloneRequest,
        force: bool,
        deadline: Instant,
    ) -> Result<MemoryClaim, ClaimError> {
        let ticket = self.guard.reading();
        let view = self
            .read(&req.node, deadline)
            .await
            .map_err(ClaimError::Unread)?;
        self.guard
            .claim(&ticket, &view, &claim_request(req), force)
            .map_err(ClaimError::NoRoom)
    }

    /// Before a Create is accepted: its claim, `Ok(None)` with the guard off
    /// or the node unreadable within [`QUICK_READ`] (the clone checks
    /// again, and a failure there says why), `Err` when it has no room.
    pub(super) async fn admit(&self, req: &CloneRequest) -> Result<Option<MemoryClaim>, NoRoom> {
        if !self.guard.enabled() {
            return Ok(None);
        }
        let deadline = Instant::now() + QUICK_READ;
        match tokio::time::timeout(QUICK_READ, self.claim(req, false, deadline)).await {
            Ok(Ok(held)) => Ok(Some(held)),
            Ok(Err(ClaimError::NoRoom(no_room))) => Err(no_room),
            Ok(Err(ClaimError::Unread(e))) => {
                tracing::warn!(machine_id = %req.machine_id, node = %req.node, error = %e, "the node memory guard cannot read the node; admitting the Create, its clone checks again");
                Ok(None)
            }
            Err(_) => {
                tracing::warn!(machine_id = %req.machine_id, node = %req.node, "the node memory guard cannot read the node; admitting the Create, its clone checks again");
                Ok(None)
            }
        }
    }

    /// The memory claim of a Create about to clone: its admission's when
    /// it has one, else a fresh check (a Create that reached the substrate
    /// without one: admitted while the guard could not read the node, or
    /// driven directly); a resumed Create claims without a check (the
    /// process before admitted it). `None`: the guard is off, or the node
    /// cannot be read now.
    pub(super) async fn claim_for_clone(
        &self,
        req: &CloneRequest,
        deadline: Instant,
    ) -> Result<Option<MemoryClaim>, SubstrateError> {
        if !self.guard.enabled() {
            return Ok(None);
        }
        if let Some(held) = self.guard.rejoin(&req.node, &req.machine_id) {
            return Ok(Some(held));
        }
        match self.claim(req, req.resumed, deadline).await {
            Ok(held) => Ok(Some(held)),
            Err(ClaimError::NoRoom(no_room)) => Err(SubstrateError::caused_by(
                providerkit::ErrorKind::Permanent,
                "the node memory guard refused the clone",
                no_room,
            )),
            // A node the guard may not read: never clone unchecked.
            Err(ClaimError::Unread(e)) if e.kind() == providerkit::ErrorKind::Refused => Err(e),
            Err(ClaimError::Unread(e)) => {
                // An offline or unreachable node: the clone waits for it
                // anyway, and a node that comes back holds none of the VMs
                // it lost; refusing here would fail a Create the node
                // could hold.
                tracing::warn!(machine_id = %req.machine_id, node = %req.node, error = %e, "the node memory guard cannot read the node; cloning without its check");
                Ok(None)
            }
        }
    }

    /// Reads the memory room of each of `nodes` now (the start-up line);
    /// a node that cannot be read within [`QUICK_READ`] is left out with a
    /// warning.
    pub(super) async fn rooms_now(&self, nodes: &[String]) -> Vec<MemoryRoom> {
        let mut rooms = Vec::new();
        for node in nodes {
            let deadline = Instant::now() + QUICK_READ;
            match tokio::time::timeout(QUICK_READ, self.observe(node, deadline)).await {
                Ok(Ok(room)) => rooms.push(room),
                Ok(Err(e)) => {
                    tracing::warn!(node = %node, error = %e, "cannot read the node's memory; its room is unknown until a Create there reads it");
                }
                Err(_) => {
                    tracing::warn!(node = %node, error = "no answer in time", "cannot read the node's memory; its room is unknown until a Create there reads it");
                }
            }
        }
        rooms
    }

    /// The room of `node` now (start-up line, metrics), claiming nothing.
    async fn observe(&self, node: &str, deadline: Instant) -> Result<MemoryRoom, SubstrateError> {
        let ticket = self.guard.reading();
        let view = self.read(node, deadline).await?;
        Ok(self.guard.observe(node, &ticket, &view))
    }
}

/// What the guard is asked for `req`.
pub(super) fn claim_request(req: &CloneRequest) -> ClaimRequest {
    ClaimRequest {
        machine_id: req.machine_id.clone(),
        node: req.node.clone(),
        instance_type: req.instance_type.clone(),
        memory_mib: req.memory_mib,
        vm_name: vm_name(&req.instance_type, &req.machine_id),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(status: &str, lock: Option<&str>, template: bool, maxmem: Option<u64>) -> ClusterVm {
        serde_json::from_value(serde_json::json!({
            "vmid": 100, "node": "pve1", "status": status, "lock": lock,
            "template": u8::from(template), "maxmem": maxmem,
        }))
        .expect("row")
    }

    #[test]
    fn running_and_starting_vms_count_templates_and_stopped_ones_do_not() {
        let gib = 1u64 << 30;
        assert_eq!(
            counted_mib(&vm("running", None, false, Some(4 * gib))),
            Some(4096)
        );
        assert_eq!(
            counted_mib(&vm("stopped", Some("clone"), false, Some(gib))),
            Some(1024)
        );
        assert_eq!(
            counted_mib(&vm("stopped", Some("create"), false, None)),
            Some(512)
        );
        assert_eq!(counted_mib(&vm("stopped", None, false, Some(gib))), None);
        assert_eq!(
            counted_mib(&vm("stopped", Some("suspended"), false, Some(gib))),
            None
        );
        assert_eq!(counted_mib(&vm("stopped", None, true, Some(gib))), None);
        assert_eq!(
            counted_mib(&vm("running", None, false, Some(gib + 1))),
            Some(1025)
        );
    }
}
