//! The Proxmox backend: maps providerkit's slot lifecycle onto a
//! [`Substrate`] (the real Proxmox API or the in-memory fake).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use async_trait::async_trait;
use bigfleet_proto::v1alpha1 as pb;
use providerkit::{
    Admission, AdmitCtx, Backend, BackendError, CatalogFacts, ConfigureCtx, CreateCtx, DeleteCtx,
    DrainCtx, ErrorKind, ReclaimCtx, SlotSpec, SubstrateHost,
};

use crate::catalog::{self, InstanceType, Pricing, Slot};
use crate::substrate::{CloneRequest, Substrate, SubstrateError, VmRef};
use crate::timeline::{Step, StepObserver, StepRecord, Timeline};

pub struct ProxmoxBackend {
    slots: Vec<Slot>,
    types: BTreeMap<String, InstanceType>,
    pricing: Pricing,
    substrate: Arc<dyn Substrate>,
    /// The steps each transition took, recorded by the substrate's parts
    /// while the transition runs in its scope.
    timeline: Arc<Timeline>,
}

fn be(e: SubstrateError) -> BackendError {
    e.into()
}

fn parse_host(host_ref: &str) -> Result<VmRef, BackendError> {
    VmRef::parse(host_ref).map_err(be)
}

impl ProxmoxBackend {
    pub fn new(
        slots: Vec<Slot>,
        types: BTreeMap<String, InstanceType>,
        pricing: Pricing,
        substrate: Arc<dyn Substrate>,
    ) -> ProxmoxBackend {
        ProxmoxBackend {
            slots,
            types,
            pricing,
            substrate,
            timeline: Arc::new(Timeline::new(None)),
        }
    }

    /// Reports every step that ends to `observer` (the per-step histograms).
    pub fn with_step_observer(mut self, observer: Arc<dyn StepObserver>) -> ProxmoxBackend {
        self.timeline = Arc::new(Timeline::new(Some(observer)));
        self
    }

    /// The last steps of `machine_id`'s transitions in this process,
    /// oldest first (empty for one it has not worked on).
    pub fn timeline(&self, machine_id: &str) -> Vec<StepRecord> {
        self.timeline.of(machine_id)
    }

    /// [`ProxmoxBackend::timeline`], with how far each clone under way has
    /// copied, read from its task's log now (one PVE request per such
    /// clone; a machine has at most one). A log that cannot be read leaves
    /// the step without it, and is logged: the timeline is still worth
    /// showing.
    pub async fn timeline_now(&self, machine_id: &str) -> Vec<StepRecord> {
        let mut steps = self.timeline.of(machine_id);
        for step in steps
            .iter_mut()
            .filter(|s| s.running && s.step == Step::Clone)
        {
            let Some(upid) = &step.upid else { continue };
            match self.substrate.copy_progress(upid).await {
                Ok(percent) => step.copied_percent = percent,
                Err(e) => tracing::warn!(
                    machine_id,
                    upid = %upid,
                    error = %e,
                    "could not read how far a clone under way has copied"
                ),
            }
        }
        steps
    }

    /// Each node's memory room as the node memory guard last saw it.
    pub fn memory_rooms(&self) -> Vec<crate::memory::MemoryRoom> {
        self.substrate.memory_rooms()
    }

    /// The nodes the last inventory read found down (`GET /nodes`).
    pub fn offline_nodes(&self) -> Vec<String> {
        self.substrate.offline_nodes()
    }

    /// How many volumes destroys could not free since this backend was
    /// made (each also logged as a WARN naming it).
    pub fn destroy_leftovers(&self) -> u64 {
        self.substrate.destroy_leftovers()
    }

    /// Each clone-slot domain's slots, used slots and waiting clones.
    pub fn clone_slots(&self) -> Vec<crate::substrate::CloneSlotsView> {
        self.substrate.clone_slots()
    }

    /// Each storage full clones land on, as the storage guard last checked it.
    pub fn storage_spaces(&self) -> Vec<crate::capacity::StorageSpace> {
        self.substrate.storage_spaces()
    }

    /// Reads the storages full clones on `nodes` land on now (see
    /// [`Self::storage_spaces`]).
    pub async fn observe_storage(&self, nodes: &[String]) -> Vec<crate::capacity::StorageSpace> {
        self.substrate.observe_storage(nodes).await
    }

    /// Reads each of `nodes`' memory room now (see [`Self::memory_rooms`]).
    pub async fn observe_memory(&self, nodes: &[String]) -> Vec<crate::memory::MemoryRoom> {
        self.substrate.observe_memory(nodes).await
    }

    /// How many more machines of each instance type offered on `node` fit
    /// in the memory room `room`, by type name.
    pub fn fits(&self, room: &crate::memory::MemoryRoom) -> Vec<(String, u64)> {
        let mut offered: Vec<&str> = self
            .slots
            .iter()
            .filter(|s| s.facts.zone == room.node)
            .map(|s| s.facts.instance_type.as_str())
            .collect();
        offered.sort_unstable();
        offered.dedup();
        offered
            .into_iter()
            .filter_map(|name| {
                let t = self.types.get(name)?;
                Some((name.to_string(), room.fits(t.memory_mib)))
            })
            .collect()
    }

    /// Every VM whose marker names `machine_id`, oldest VMID first.
    async fn marked_for(&self, machine_id: &str) -> Result<Vec<VmRef>, BackendError> {
        let mut vms: Vec<VmRef> = self
            .substrate
            .describe_managed()
            .await
            .map_err(be)?
            .into_iter()
            .filter(|m| m.machine_id == machine_id)
            .map(|m| m.vm)
            .collect();
        vms.sort_by_key(|vm| vm.vmid);
        Ok(vms)
    }

    /// After a Delete, any other VM still marked for the machine would
    /// outlive its slot: a clone whose answer was lost and that landed after
    /// a restart (the in-memory watch that reaps such clones is gone). Its
    /// marker names the machine, and the slot has no VM any more, so it is
    /// destroyed (`delete_vm` checks the marker again). Best effort: the
    /// Delete itself is done; a failure here only logs, and a reclaim or the
    /// next Delete of the slot sweeps again. One inventory read, served from
    /// the marker cache.
    async fn sweep_twins(&self, machine_id: &str) {
        let twins = match self.marked_for(machine_id).await {
            Ok(twins) => twins,
            Err(e) => {
                tracing::warn!(machine_id, error = %e, "could not check for other VMs marked for a deleted machine; a reclaim or the next Delete checks again");
                return;
            }
        };
        for twin in twins {
            tracing::warn!(machine_id, vm = %twin, "a second VM marked for this machine survived its Delete (a clone that landed late); destroying it");
            if let Err(e) = self.substrate.delete_vm(&twin, machine_id).await {
                tracing::warn!(machine_id, vm = %twin, error = %e, "could not destroy a second VM marked for a deleted machine; a reclaim or the next Delete retries");
            }
        }
    }

    fn spec(slot: &Slot, host: Option<SubstrateHost>) -> SlotSpec {
        SlotSpec {
            id: slot.id.clone(),
            facts: slot.facts.clone(),
            host,
        }
    }

    /// A marked VM whose slot no longer exists (offering shrunk or removed)
    /// is surfaced under its machine id so it can still be drained and
    /// deleted. Its type is read back from the id when it follows our scheme.
    fn orphan_spec(&self, machine_id: &str, vm: &VmRef) -> SlotSpec {
        let parts: Vec<&str> = machine_id.split('/').collect();
        let instance_type = match parts.as_slice() {
            [_, _, t, _, _] if !t.is_empty() => t.to_string(),
            _ => "unknown".to_string(),
        };
        let t = self.types.get(&instance_type);
        let allocatable = t.map(catalog::allocatable).unwrap_or_default();
        SlotSpec {
            id: machine_id.to_string(),
            facts: CatalogFacts {
                price_per_hour: self.pricing.price(&instance_type, t),
                instance_type,
                zone: vm.node.clone(),
                capacity_type: pb::CapacityType::OnDemand,
                interruption_probability: 0.0,
                resources: allocatable.clone(),
                allocatable,
                labels: HashMap::new(),
            }
            .share(),
            host: Some(SubstrateHost {
                host_ref: vm.host_ref(),
            }),
        }
    }
}

#[async_trait]
impl Backend for ProxmoxBackend {
    async fn describe(&self) -> Result<Vec<SlotSpec>, BackendError> {
        let mut managed = self.substrate.describe_managed().await.map_err(be)?;
        // Several VMs marked for one machine (a clone that finished after its
        // Create gave up): the one a Create would adopt wins, running first,
        // then the oldest, so the choice is the same on every pass and an
        // unchanged inventory never moves a host.
        managed.sort_by_key(|m| std::cmp::Reverse((!m.running, m.vm.vmid)));
        let mut by_machine: HashMap<String, VmRef> = HashMap::with_capacity(managed.len());
        for vm in managed {
            by_machine.insert(vm.machine_id, vm.vm);
        }
        let mut specs = Vec::with_capacity(self.slots.len());
        for slot in &self.slots {
            let host = by_machine.remove(&slot.id).map(|vm| SubstrateHost {
                host_ref: vm.host_ref(),
            });
            specs.push(Self::spec(slot, host));
        }
        let mut orphans: Vec<(String, VmRef)> = by_machine.into_iter().collect();
        orphans.sort_by(|a, b| a.0.cmp(&b.0));
        specs.extend(orphans.iter().map(|(id, vm)| self.orphan_spec(id, vm)));
        Ok(specs)
    }

    /// The node memory guard's and the storage guard's checks: a Create its
    /// node has no memory for, or whose full clone's storage has no room,
    /// is refused before anything starts (the machine stays SPECULATIVE).
    async fn admit_create(&self, ctx: &AdmitCtx) -> Result<Admission, BackendError> {
        // An unknown type fails in `create` with its own message.
        let Some(t) = self.types.get(&ctx.instance_type) else {
            return Ok(Admission::unguarded());
        };
        let req = CloneRequest {
            machine_id: ctx.machine_id.clone(),
            operation_id: String::new(),
            instance_type: ctx.instance_type.clone(),
            node: ctx.zone.clone(),
            template_vmid: t.template_vmid,
            vcpu: t.vcpu,
            memory_mib: t.memory_mib,
            resumed: false,
        };
        match self.substrate.admit(&req).await {
            Ok(held) if held.is_empty() => Ok(Admission::unguarded()),
            Ok(held) => Ok(Admission::holding(held)),
            Err(refusal) => {
                tracing::info!(machine_id = %ctx.machine_id, node = %ctx.zone, error = %refusal, "create refused: no room on the node");
                // Room may come back (a VM stops, a Create fails, space is
                // freed): the shard may try this slot again later, and
                // another node now.
                Err(BackendError::caused_by(
                    ErrorKind::Transient,
                    refusal.to_string(),
                    Arc::new(refusal),
                ))
            }
        }
    }

    async fn create(&self, ctx: CreateCtx) -> Result<SubstrateHost, BackendError> {
        let t = self.types.get(&ctx.instance_type).ok_or_else(|| {
            BackendError::new(format!(
                "instance type {:?} is not in the catalog",
                ctx.instance_type
            ))
        })?;
        let req = CloneRequest {
            machine_id: ctx.machine_id,
            operation_id: ctx.operation_id,
            instance_type: ctx.instance_type.clone(),
            node: ctx.zone,
            template_vmid: t.template_vmid,
            vcpu: t.vcpu,
            memory_mib: t.memory_mib,
            resumed: ctx.resumed,
        };
        let machine_id = req.machine_id.clone();
        let vm = self
            .timeline
            .scope(&machine_id, self.substrate.clone_vm(&req))
            .await
            .map_err(be)?;
        Ok(SubstrateHost {
            host_ref: vm.host_ref(),
        })
    }

    async fn configure(&self, ctx: &ConfigureCtx) -> Result<(), BackendError> {
        let vm = parse_host(&ctx.host_ref)?;
        self.timeline
            .scope(&ctx.machine_id, async {
                self.substrate.ensure_running(&vm).await?;
                self.substrate.configure(&vm, &ctx.bootstrap_blob).await
            })
            .await
            .map_err(be)
    }

    async fn drain(&self, ctx: DrainCtx) -> Result<(), BackendError> {
        let vm = parse_host(&ctx.host_ref)?;
        self.timeline
            .scope(&ctx.machine_id, async {
                self.substrate.ensure_running(&vm).await?;
                self.substrate.drain(&vm, ctx.grace_period).await
            })
            .await
            .map_err(be)
    }

    fn supports_delete(&self) -> bool {
        true
    }

    async fn delete(&self, ctx: DeleteCtx) -> Result<(), BackendError> {
        let vm = parse_host(&ctx.host_ref)?;
        self.timeline
            .scope(
                &ctx.machine_id,
                self.substrate.delete_vm(&vm, &ctx.machine_id),
            )
            .await
            .map_err(be)?;
        self.sweep_twins(&ctx.machine_id).await;
        Ok(())
    }

    /// Destroys every VM whose marker names the machine, found in the
    /// inventory (not just the host on record: a FAILED Create usually has
    /// none, and a kill mid-clone can leave one nobody recorded). A host on
    /// record that no longer carries this machine's marker is left alone.
    /// Ends with a fresh inventory read: success means no marked VM is left.
    async fn reclaim(&self, ctx: ReclaimCtx) -> Result<(), BackendError> {
        let marked = self.marked_for(&ctx.machine_id).await?;
        if let Some(host_ref) = &ctx.host_ref {
            let on_record = parse_host(host_ref)?;
            if !marked.contains(&on_record) {
                tracing::info!(machine_id = %ctx.machine_id, host = %host_ref, "the host on record no longer carries this machine's marker (gone, or not ours); not touching it");
            }
        }
        for vm in &marked {
            tracing::info!(machine_id = %ctx.machine_id, vm = %vm, "reclaim: destroying the VM marked for this machine");
            self.substrate
                .delete_vm(vm, &ctx.machine_id)
                .await
                .map_err(|e| be(e.context(format!("destroying VM {vm}"))))?;
        }
        let left = self.marked_for(&ctx.machine_id).await?;
        if !left.is_empty() {
            let refs: Vec<String> = left.iter().map(VmRef::host_ref).collect();
            return Err(BackendError::new(format!(
                "VMs marked for machine {} still exist after destroying them: {}",
                ctx.machine_id,
                refs.join(", ")
            )));
        }
        Ok(())
    }

    fn supports_readiness(&self) -> bool {
        self.substrate.readiness_gate()
    }

    async fn node_ready(&self, ctx: &ConfigureCtx) -> Result<bool, BackendError> {
        let vm = parse_host(&ctx.host_ref)?;
        self.timeline
            .scope(&ctx.machine_id, self.substrate.node_ready(&vm))
            .await
            .map_err(be)
    }

    fn readiness_detail(&self, host_ref: &str) -> Option<String> {
        self.substrate
            .readiness_detail(&VmRef::parse(host_ref).ok()?)
    }
}
