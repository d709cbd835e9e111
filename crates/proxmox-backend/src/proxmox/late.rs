//! Clones whose request was given up as not applied (a lost answer, its
//! VMID free for the settle time) but may still land late: watched by VMID,
//! and destroyed once landed only when a second VM exists for the machine
//! and the late one's marker names this machine and this operation.

use std::collections::HashSet;
use std::sync::Arc;

use pve::ClusterVm;
use tokio::time::Instant;

use super::api::{Api, Probe};
use super::inventory::Inventory;
use super::marker::owned_by;
use super::vmid::{LateClone, Vmids};
use crate::substrate::{SubstrateError, VmRef};

/// The watch over late clones; the watched VMIDs themselves are kept with
/// the VMID choice, which must not reuse them.
pub(super) struct LateClones {
    api: Arc<Api>,
    vmids: Arc<Vmids>,
    inventory: Arc<Inventory>,
}

impl LateClones {
    pub(super) fn new(api: Arc<Api>, vmids: Arc<Vmids>, inventory: Arc<Inventory>) -> LateClones {
        LateClones {
            api,
            vmids,
            inventory,
        }
    }

    /// Once `keep` (this machine's clone) exists: removes any earlier clone
    /// of the same machine that was given up as not applied and has landed
    /// since. One still being cloned, or not yet there, stays watched (the
    /// reconcile pass finds it later). Failures only log: the Create has its
    /// VM, and the next pass tries again.
    pub(super) async fn reap_twins(&self, machine_id: &str, keep: u32, deadline: Instant) {
        let late: Vec<(u32, LateClone)> = self
            .vmids
            .late_clones()
            .into_iter()
            .filter(|(vmid, l)| *vmid != keep && l.machine_id == machine_id)
            .collect();
        for (vmid, l) in late {
            let vm = VmRef {
                node: l.node.clone(),
                vmid,
            };
            match self.api.probe(&vm, &l.machine_id, deadline).await {
                Ok(Probe::Ours(_)) => {
                    if let Err(e) = self.remove_late_clone(&vm, &l, deadline).await {
                        tracing::warn!(vm = %vm, error = %e, "could not remove a late duplicate clone; the next reconcile retries");
                    }
                }
                Ok(Probe::Foreign) => self.vmids.unwatch_late(vmid),
                Ok(Probe::Gone | Probe::Cloning) => {}
                Err(e) => {
                    tracing::warn!(vm = %vm, error = %e, "could not check a clone given up as not applied; the next reconcile retries");
                }
            }
        }
    }

    /// For an inventory pass: a watched late clone that has landed next to
    /// another VM marked for the same machine is removed (and left out of
    /// the result). While it is the machine's only VM it is kept: a retried
    /// Create or reconcile may adopt it.
    pub(super) async fn reap(
        &self,
        mut marked: Vec<(ClusterVm, String)>,
    ) -> Vec<(ClusterVm, String)> {
        let late = self.vmids.late_clones();
        if late.is_empty() {
            return marked;
        }
        let watched: HashSet<u32> = late.iter().map(|(vmid, _)| *vmid).collect();
        let deadline = self.api.deadline();
        for (vmid, l) in late {
            let Some((v, id)) = marked.iter().find(|(v, _)| v.vmid == vmid) else {
                continue;
            };
            if *id != l.machine_id {
                // Another machine's VM at that id: our request never landed.
                self.vmids.unwatch_late(vmid);
                continue;
            }
            // The twin must be a VM this process kept, not another late one.
            let twin = marked
                .iter()
                .any(|(o, oid)| *oid == l.machine_id && !watched.contains(&o.vmid));
            if !twin {
                continue;
            }
            let vm = VmRef {
                node: v.node.clone(),
                vmid,
            };
            match self.remove_late_clone(&vm, &l, deadline).await {
                Ok(true) => marked.retain(|(v, _)| v.vmid != vmid),
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(vm = %vm, error = %e, "could not remove a late duplicate clone; the next pass retries");
                }
            }
        }
        marked
    }

    /// Destroys a late-landed clone, only when its marker names the machine
    /// and the operation it was cloned for. `Ok(false)`: not ours after all
    /// (or gone), and no longer watched.
    async fn remove_late_clone(
        &self,
        vm: &VmRef,
        late: &LateClone,
        deadline: Instant,
    ) -> Result<bool, SubstrateError> {
        let forget = || self.vmids.unwatch_late(vm.vmid);
        const WHAT: &str = "checking the late clone";
        let Some(cfg) = self
            .api
            .read_present(WHAT, vm, deadline, |pve| pve.get_config(&vm.node, vm.vmid))
            .await?
        else {
            return Ok(false);
        };
        if cfg.lock.is_some() {
            // Still being cloned (its marker may not be written yet), or
            // otherwise busy: next time.
            return Ok(false);
        }
        if !owned_by(
            cfg.description.as_deref(),
            &late.machine_id,
            Some(&late.operation_id),
        ) {
            tracing::warn!(vm = %vm, machine_id = %late.machine_id, "a VM landed at the id of a clone given up as not applied, but its marker is not that clone's; leaving it alone");
            forget();
            return Ok(false);
        }
        let Some(st) = self
            .api
            .read_present(WHAT, vm, deadline, |pve| {
                pve.status_current(&vm.node, vm.vmid)
            })
            .await?
        else {
            return Ok(false);
        };
        tracing::warn!(vm = %vm, machine_id = %late.machine_id,
            "a clone given up as not applied (its answer was lost) landed late next to this machine's VM; destroying the duplicate");
        self.api.destroy(vm, st.is_running(), deadline).await?;
        self.inventory.forget(vm.vmid);
        self.vmids.cool_down(vm.vmid);
        forget();
        Ok(true)
    }
}
