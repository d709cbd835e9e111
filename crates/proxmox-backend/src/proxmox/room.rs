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

use super::api::{err_at, Api};
use super::inventory::Inventory;
use crate::memory::{
    bytes_to_mib, ClaimRequest, CountedVm, MemoryGuard, NoRoom, NodeRoom, NodeView, Reservation,
};
use crate::proxmox::vm_name;
use crate::substrate::{CloneRequest, SubstrateError};

/// PVE's default `memory` (MiB), what a VM without the option has.
const PVE_DEFAULT_MEMORY_MIB: u64 = 512;

/// Why a claim was not made.
#[derive(Debug)]
pub(super) enum ClaimError {
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
    pub(super) fn new(api: Arc<Api>, inventory: Arc<Inventory>) -> NodeMemory {
        let guard = MemoryGuard::new(api.opts.node_memory_limit);
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
        let mut nodes = || api.client.nodes();
        let listed = api
            .retry_raw(Some(node), deadline, &mut nodes)
            .await
            .map_err(|e| err_at(&what, Some(node), &e))?;
        let Some(memory) = listed
            .iter()
            .find(|n| n.node == node)
            .and_then(|n| n.maxmem)
        else {
            return Err(SubstrateError::with_kind(
                providerkit::ErrorKind::Transient,
                format!("{what}: GET /nodes reports no maxmem for node {node} (offline, or not in the cluster)"),
            ));
        };
        let mut vms = || api.client.node_vms(node);
        let rows = api
            .retry_raw(Some(node), deadline, &mut vms)
            .await
            .map_err(|e| err_at(&what, Some(node), &e))?;
        Ok(self.view_of(bytes_to_mib(memory), &rows))
    }

    /// Checks and claims the memory of `req` on its node. With `force`,
    /// claims without checking (a Create the process before admitted).
    pub(super) async fn claim(
        &self,
        req: &CloneRequest,
        force: bool,
        deadline: Instant,
    ) -> Result<Reservation, ClaimError> {
        let ticket = self.guard.reading();
        let view = self
            .read(&req.node, deadline)
            .await
            .map_err(ClaimError::Unread)?;
        self.guard
            .claim(&ticket, &view, &claim_request(req), force)
            .map_err(ClaimError::NoRoom)
    }

    /// The room of `node` now (start-up line, metrics), claiming nothing.
    pub(super) async fn observe(
        &self,
        node: &str,
        deadline: Instant,
    ) -> Result<NodeRoom, SubstrateError> {
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
