//! The real substrate: a Proxmox VE cluster driven through the `pve` API client.
//!
//! [`PveSubstrate`] is a composition of parts, each a type that owns its
//! state and its locks in a file of its own, built bottom-up so that every
//! part holds handles only to the parts below it and none reaches into
//! another's fields:
//!
//! ```text
//!                       PveSubstrate (this file: the Substrate impl)
//!                 plan --------.------------.
//!      preflight   replica    clone ------------------.     guest
//!          |          |  \      |        \             \      |
//!          |          |  storage_guard   late           \     |
//!          |          |        |  \     /    \           |    |
//!      placement    slots   inventory      vmid         |    |
//!          \__________|________|____________|___________|____/
//!                     api  (the one door to PVE: client, retries, VM primitives)
//! ```
//!
//! - `api`: the one door to PVE (the client is private to it), the retry
//!   and wait policy, start, stop and destroy, the VMID-in-use check; no
//!   state. Each part keeps the options it reads.
//! - `vmid` (`Vmids`): VMID choice, cool-downs, the late-clone watch.
//! - `inventory`: the index of the cluster's VMs, templates' nodes, clones
//!   in progress.
//! - `slots`: clone slots per domain (a node's storage, or a shared one
//!   cluster-wide), adaptive by what clones take.
//! - `placement`: clone mode, target storage, template layouts, node
//!   storages, what a full clone's disks need, the start-up placement check.
//! - `storage_guard`: claims of full clones on their storages, checked
//!   against each storage's free space (admission, clone step, staging).
//! - `late`: clones given up as not applied that land late.
//! - `clone`: cloning and marking one machine's VM.
//! - `replica`: per-node template replicas.
//! - `plan`: where a Create clones from (template or replica) and the
//!   storage claim it makes first, at admission and at the clone step.
//! - `node_memory`: the node memory guard's reads (a node's memory and VMs).
//! - `device_guard`: mapped PCI devices (GPUs) per node: free devices of
//!   an instance type's mapping, claimed by Creates in flight.
//! - `guest`: the guest agent: blob delivery, bootstrap, readiness, drain.
//! - `preflight`: the start-up check.
//! - `marker`, `options`: the marker policy and the options (no state).
//!
//! This file composes them: the lifecycle steps, the admission (memory,
//! devices, then storage), and the per-machine Create lock.
//!
//! Cost model (API calls per operation, independent of cluster size):
//! Create = 2 reads for the node memory guard at admission (`/nodes` and
//! `/nodes/{node}/qemu`; none with `--node-memory-limit 0`) + 1 inventory
//! read (`/nodes` for which nodes are down, `/cluster/resources`, and one
//! `/nodes/{node}/qemu` per live node listing VMs too new to be sampled) +
//! 1 `nextid` + clone + task polls + 1 config PUT +
//! start + task polls + agent pings, + 1 storage status read per full clone
//! (the storage guard, at admission; the clone step reuses its claim), + for
//! a type with mapped PCI devices `/cluster/mapping/pci` and
//! `/nodes/{node}/qemu` at admission and one config read per VM started on
//! the node since the last such read (the device guard). The first Create per template also reads the
//! template's config once (disk storages and sizes), the first cross-node
//! one the template node's storage list (shared or local); a Create served
//! by a per-node replica reads the template's config each time (its digest
//! tells a fresh replica from a stale one), and the one that stages it adds
//! clone + migrate + template conversion and their task polls (`replica`);
//! Configure = status + the blob's file-write + one exec (name, read-back,
//! hook) + exec-status polls; Drain = status + exec + exec-status polls (no
//! ping for either: PVE's own before each agent command refuses one the
//! agent is not up for, and then it waits); Delete = config (the
//! marker is the ownership proof) + stop (whatever the power state: a
//! stopped VM's stop ends at once) + destroy + task polls + the destroy's
//! log; a
//! reconcile pass = 1 inventory read plus config reads only for marked VMs that
//! are new or whose tags/name changed since the last pass. A node the
//! inventory read found down is never called: its VMs keep what the last
//! pass learnt, a Create for it fails naming it, and a Delete or Drain of
//! a machine on it polls `/nodes` until it is back.
//!
//! Task polls are per node, not per task (`task_watch`): while several of
//! a node's tasks are waited on, one `GET /nodes/{node}/tasks` per tick
//! covers them all, and each task's status is read once, when it ends; a
//! task alone on its node has its status read each tick, as above.
//!
//! Transient failures (595/596/597, 502-504, refused or reset connections,
//! timeouts, an offline node, a template locked by a backup) are retried with
//! backoff within [`PveOptions::retry_window`]. Nothing is destroyed unless
//! its description marker names the machine; under a pool-scoped token a 403
//! on a VM is told apart (gone, or not ours) with `GET /cluster/nextid?vmid=N`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use providerkit::ErrorKind;
use pve::{ClusterVm, PveClient, VmStatus};
use tokio::sync::Mutex as AsyncMutex;
use tokio::time::Instant;

use crate::capacity::{Admitted, Refusal, StorageSpace};
use crate::memory::MemoryRoom;
use crate::substrate::{CloneRequest, ManagedVm, Substrate, SubstrateError, VmRef};
use api::{err_at, Api, Probe};
use clone::{Cloner, ClonerParts};
use device_guard::DeviceGuard;
use guest::Guest;
use inventory::Inventory;
use late::LateClones;
use marker::TagPolicy;
use node_memory::NodeMemory;
use placement::Placement;
use plan::Planner;
use preflight::Preflight;
use replica::Replicas;
use restart::InterruptedClones;
use sizing::Inherited;
use slots::CloneSlots;
use storage_guard::StorageGuard;
use vmid::Vmids;

mod api;
mod clone;
mod device_guard;
mod estimate;
mod guest;
mod inventory;
mod late;
mod marker;
mod node_memory;
mod options;
mod placement;
mod plan;
mod preflight;
mod replica;
mod restart;
mod sizing;
mod slots;
mod storage_guard;
mod task_watch;
mod vmid;

pub use marker::{
    machine_tag, marker_description, owned_by, parse_marker, parse_marker_operation,
    parse_replica_marker, replica_description, vm_name, MANAGED_TAG, REPLICA_TAG,
};
pub use options::{
    parse_node_storage, parse_storage_overcommit, parse_vmid_range, CloneMode, PveOptions,
    TypeDevices, TypeDisk, DEFAULT_DRAIN_COMMAND, DEFAULT_HOSTNAME_COMMAND, NODE_NAME_ENV,
};

/// The real Proxmox substrate.
pub struct PveSubstrate {
    api: Arc<Api>,
    /// The options the composition reads (each part holds its own handle).
    opts: Arc<PveOptions>,
    vmids: Arc<Vmids>,
    inventory: Arc<Inventory>,
    placement: Arc<Placement>,
    tags: Arc<TagPolicy>,
    late: Arc<LateClones>,
    cloner: Arc<Cloner>,
    /// Clone slots, shared by the cloner and replica staging.
    slots: Arc<CloneSlots>,
    planner: Planner,
    guest: Guest,
    restart: InterruptedClones,
    memory: NodeMemory,
    devices: DeviceGuard,
    /// One Create per machine id at a time.
    creating: Mutex<HashMap<String, Arc<AsyncMutex<()>>>>,
}

impl PveSubstrate {
    pub fn new(client: PveClient, opts: PveOptions) -> Self {
        let opts = Arc::new(opts);
        let api = Arc::new(Api::new(client, Arc::clone(&opts)));
        let vmids = Arc::new(Vmids::new(Arc::clone(&api), Arc::clone(&opts)));
        let inventory = Arc::new(Inventory::new(Arc::clone(&api)));
        let slots =
            Arc::new(CloneSlots::new(opts.max_parallel_clones, opts.adaptive_clones).learning());
        let placement = Arc::new(Placement::new(Arc::clone(&api), Arc::clone(&opts)));
        let storage = Arc::new(StorageGuard::new(
            Arc::clone(&api),
            Arc::clone(&opts),
            Arc::clone(&inventory),
        ));
        let tags = Arc::new(TagPolicy::default());
        let late = Arc::new(LateClones::new(
            Arc::clone(&api),
            Arc::clone(&vmids),
            Arc::clone(&inventory),
        ));
        let cloner = Arc::new(Cloner::new(ClonerParts {
            api: Arc::clone(&api),
            opts: Arc::clone(&opts),
            vmids: Arc::clone(&vmids),
            inventory: Arc::clone(&inventory),
            slots: Arc::clone(&slots),
            placement: Arc::clone(&placement),
            late: Arc::clone(&late),
            tags: Arc::clone(&tags),
        }));
        let replicas = Replicas::new(
            Arc::clone(&api),
            Arc::clone(&opts),
            Arc::clone(&vmids),
            Arc::clone(&slots),
            Arc::clone(&placement),
            Arc::clone(&storage),
            Arc::clone(&tags),
        );
        let planner = Planner {
            opts: Arc::clone(&opts),
            inventory: Arc::clone(&inventory),
            placement: Arc::clone(&placement),
            storage,
            replicas,
            cloner: Arc::clone(&cloner),
        };
        let guest = Guest::new(Arc::clone(&api), Arc::clone(&opts));
        let restart = InterruptedClones::new(Arc::clone(&api));
        let devices = DeviceGuard::new(Arc::clone(&api), Arc::clone(&opts), Arc::clone(&inventory));
        let memory = NodeMemory::new(
            Arc::clone(&api),
            opts.node_memory_limit,
            Arc::clone(&inventory),
        );
        PveSubstrate {
            api,
            opts,
            vmids,
            inventory,
            placement,
            tags,
            late,
            cloner,
            slots,
            planner,
            guest,
            restart,
            memory,
            devices,
            creating: Mutex::new(HashMap::new()),
        }
    }

    pub fn options(&self) -> &PveOptions {
        &self.opts
    }

    /// Startup check. Errors name the problem and the fix; the returned
    /// strings are warnings (offline node, source VM not a template, a check
    /// that could not be made, marker-only ownership).
    pub async fn preflight(
        &self,
        nodes: &[String],
        templates: &[u32],
    ) -> Result<Vec<String>, SubstrateError> {
        Preflight {
            api: &self.api,
            opts: &self.opts,
            inventory: &self.inventory,
            placement: &self.placement,
            tags: &self.tags,
        }
        .run(nodes, templates)
        .await
    }

    /// One inventory read (see [`Inventory::scan`]), with late duplicate
    /// clones removed from the cluster and from the result.
    async fn scan(
        &self,
        want: impl Fn(&ClusterVm) -> bool,
    ) -> Result<(Vec<ClusterVm>, Vec<(ClusterVm, String)>), SubstrateError> {
        let (list, marked) = self.inventory.scan(want).await?;
        Ok((list, self.late.reap(marked).await))
    }

    /// Fails a Create whose `node` the last listing found down, naming it.
    fn refuse_if_down(&self, node: &str, what: &str) -> Result<(), SubstrateError> {
        if !self.inventory.offline_nodes().iter().any(|n| n == node) {
            return Ok(());
        }
        Err(SubstrateError::with_kind(
            ErrorKind::Transient,
            format!(
                "node {node} is offline ({what}, by GET /nodes): a clone cannot be made or \
                 started there until it is back; create the machine in another zone, or again \
                 once the node is online"
            ),
        ))
    }

    /// Before a Delete or Drain of a VM on a node the last listing found
    /// down: waits for the node (polling `/nodes`, not the node, whose
    /// calls each hang until the connect fails), so the transition ends
    /// once it is back. A node not known down costs nothing here.
    async fn wait_if_down(&self, node: &str, deadline: Instant) -> Result<(), SubstrateError> {
        if !self.inventory.offline_nodes().iter().any(|n| n == node) {
            return Ok(());
        }
        tracing::info!(
            node,
            "the VM's node is offline; waiting for it to come back"
        );
        self.api.wait_node_online(node, deadline).await
    }

    /// Drops what is known of a destroyed (or never ours) VMID and cools it down.
    fn forget(&self, vmid: u32) {
        self.inventory.forget(vmid);
        self.vmids.cool_down(vmid);
    }

    async fn ensure_running_status(
        &self,
        vm: &VmRef,
        st: &VmStatus,
        deadline: Instant,
    ) -> Result<(), SubstrateError> {
        if !st.is_running() {
            self.api.start(vm, deadline).await?;
            return self.guest.wait_agent_after_start(vm).await;
        }
        self.guest.wait_agent(vm).await
    }

    // ---- delete ----

    /// The VM's config, whose description marker is the ownership proof,
    /// following a migration (by VMID; the marker is checked afterwards).
    /// `None`: it no longer exists, or it is invisible to this token, which
    /// under a pool-scoped token means it is outside the pool and so not
    /// ours (ours stay in the pool until destroyed).
    async fn find_for_delete(
        &self,
        vm: &VmRef,
        deadline: Instant,
    ) -> Result<Option<(VmRef, pve::VmConfig)>, SubstrateError> {
        let api = &self.api;
        match api
            .retry_raw(Some(&vm.node), deadline, |pve| {
                pve.get_config(&vm.node, vm.vmid)
            })
            .await
        {
            Ok(cfg) => Ok(Some((vm.clone(), cfg))),
            Err(e) if e.is_forbidden() => {
                if api.vmid_taken(vm.vmid, deadline).await? {
                    tracing::warn!(vm = %vm, "VMID is in use but outside the token's pool: not ours; leaving it alone");
                }
                Ok(None)
            }
            Err(e) if e.is_not_found() => {
                let Some(moved) = self.inventory.locate(vm.vmid).await? else {
                    return Ok(None);
                };
                let moved = VmRef {
                    node: moved.node,
                    vmid: vm.vmid,
                };
                tracing::info!(vmid = vm.vmid, from = %vm.node, to = %moved.node, "VM moved; deleting it on its new node");
                let cfg = api
                    .read_present("reading the marker of", &moved, deadline, |pve| {
                        pve.get_config(&moved.node, moved.vmid)
                    })
                    .await?;
                Ok(cfg.map(|cfg| (moved, cfg)))
            }
            Err(e) => Err(err_at(
                format!("reading the marker of VM {vm}"),
                Some(&vm.node),
                &e,
            )),
        }
    }

    // ---- create ----

    fn machine_lock(&self, machine_id: &str) -> Arc<AsyncMutex<()>> {
        self.creating
            .lock()
            .entry(machine_id.to_string())
            .or_default()
            .clone()
    }

    /// An existing VM marked with this machine id, if any: the in-process
    /// record of clones we started, then the (possibly seconds-stale) inventory.
    async fn find_existing(
        &self,
        req: &CloneRequest,
        expected_name: &str,
        deadline: tokio::time::Instant,
    ) -> Result<(Option<(VmRef, Vec<String>)>, Vec<ClusterVm>), SubstrateError> {
        let pending = self.inventory.pending(&req.machine_id);
        let mtag = machine_tag(&req.machine_id);
        let (list, marked) = self
            .scan(|v| v.tags.contains(&mtag) || v.name.as_deref() == Some(expected_name))
            .await?;
        let mut found: Vec<&ClusterVm> = marked
            .iter()
            .filter(|(_, id)| *id == req.machine_id)
            .map(|(v, _)| v)
            .collect();
        // Prefer a running one, then the oldest.
        found.sort_by_key(|v| (v.status != "running", v.vmid));
        if found.len() > 1 {
            tracing::warn!(machine_id = %req.machine_id, vmids = ?found.iter().map(|v| v.vmid).collect::<Vec<_>>(), "several VMs carry this machine id; adopting the first");
        }
        if let Some(v) = found.first() {
            let vm = VmRef {
                node: v.node.clone(),
                vmid: v.vmid,
            };
            // Adopted: it is this machine's VM now, not a late duplicate.
            self.vmids.unwatch_late(v.vmid);
            return Ok((Some((vm, v.tags.clone())), list));
        }
        if let Some(vm) = pending {
            // Not in the inventory yet: ask the VM itself. A clone still in
            // progress (temporary config, or outside the pool until its end)
            // is waited for: cloning again would make a second VM.
            loop {
                match self.api.probe(&vm, &req.machine_id, deadline).await? {
                    Probe::Ours(tags) => {
                        self.vmids.unwatch_late(vm.vmid);
                        return Ok((Some((vm, tags)), list));
                    }
                    Probe::Gone | Probe::Foreign => break,
                    Probe::Cloning if tokio::time::Instant::now() >= deadline => {
                        return Err(SubstrateError::with_kind(
                            ErrorKind::Transient,
                            format!(
                                "VM {vm}, cloned for this machine by an earlier attempt, is still being cloned \
                                 (or is not visible to the API token) after {:?}; retry the Create",
                                self.opts.retry_window
                            ),
                        ))
                    }
                    Probe::Cloning => tokio::time::sleep(self.opts.poll_interval).await,
                }
            }
            self.inventory.clear_pending(&req.machine_id);
        }
        Ok((None, list))
    }
}

#[async_trait]
impl Substrate for PveSubstrate {
    async fn admit(&self, req: &CloneRequest) -> Result<Admitted, Refusal> {
        let mut held = Admitted::default();
        if let Some(memory) = self.memory.admit(req).await? {
            held.hold(memory);
        }
        if let Some(devices) = self.devices.admit(req).await? {
            held.hold(devices);
        }
        if let Some(space) = self.planner.admit_space(req).await? {
            held.hold(space);
        }
        Ok(held)
    }

    fn storage_spaces(&self) -> Vec<StorageSpace> {
        self.planner.spaces()
    }

    async fn observe_storage(&self, nodes: &[String]) -> Vec<StorageSpace> {
        self.planner.observe(nodes).await
    }

    fn memory_rooms(&self) -> Vec<MemoryRoom> {
        self.memory.guard().rooms()
    }

    fn offline_nodes(&self) -> Vec<String> {
        self.inventory.offline_nodes()
    }

    async fn copy_progress(&self, upid: &str) -> Result<Option<f64>, SubstrateError> {
        // An operator's read: a few retries at most, never a long hang.
        const WITHIN: Duration = Duration::from_secs(5);
        let task = pve::Upid::parse(upid).map_err(|e| api::err("a task's UPID", &e))?;
        self.api
            .copy_percent(&task, Some(Instant::now() + WITHIN))
            .await
            .map_err(|e| err_at(format!("reading the log of {upid}"), Some(&task.node), &e))
    }

    async fn observe_memory(&self, nodes: &[String]) -> Vec<MemoryRoom> {
        self.memory.rooms_now(nodes).await
    }

    fn destroy_leftovers(&self) -> u64 {
        self.api.unremoved_disks()
    }

    fn clone_slots(&self) -> Vec<crate::substrate::CloneSlotsView> {
        self.slots.view()
    }

    async fn clone_vm(&self, req: &CloneRequest) -> Result<VmRef, SubstrateError> {
        if req.machine_id.trim().is_empty() || req.node.trim().is_empty() {
            return Err(SubstrateError::new(
                "create needs a machine id and a node (zone)",
            ));
        }
        if req.vcpu == 0 || req.memory_mib == 0 {
            return Err(SubstrateError::new(format!(
                "instance type {:?} has {} vCPU and {} MiB; both must be positive",
                req.instance_type, req.vcpu, req.memory_mib
            )));
        }
        let lock = self.machine_lock(&req.machine_id);
        let _one_at_a_time = lock.lock().await;
        let deadline = self.api.deadline();
        let name = vm_name(&req.instance_type, &req.machine_id);
        let mtag = machine_tag(&req.machine_id);

        // A resumed Create holds its memory from the start, before it looks
        // for its clone: what the process before started counts at once.
        let mut memory = if req.resumed {
            self.memory.claim_for_clone(req, deadline).await?
        } else {
            None
        };
        let (mut existing, mut list) = self.find_existing(req, &name, deadline).await?;
        // The listing just now said which nodes are down: a Create there
        // fails at once, naming the node, rather than hang in CREATING for
        // the retry window (PVE would even accept a clone to it).
        self.refuse_if_down(&req.node, "the machine's node")?;
        if existing.is_none() && req.resumed {
            // The process before the restart may have a clone of this
            // machine still running: wait for it, then look again.
            let template_node = self.inventory.template_node(req.template_vmid, &list)?;
            // Its running clones are asked of the template's node: not of
            // one that is down.
            self.refuse_if_down(
                &template_node,
                &format!("the node of template {}", req.template_vmid),
            )?;
            let mut nodes = vec![template_node.as_str()];
            if req.node != template_node {
                // A replica's clone runs on the target node.
                nodes.push(req.node.as_str());
            }
            if self
                .restart
                .settle(&req.machine_id, &nodes, deadline)
                .await?
                > 0
            {
                (existing, list) = self.find_existing(req, &name, deadline).await?;
            }
        }
        if let Some((vm, tags)) = existing {
            tracing::info!(machine_id = %req.machine_id, vm = %vm, "adopting the VM already marked for this machine");
            let tagged = tags.contains(&mtag) && tags.iter().any(|t| t == MANAGED_TAG);
            // Under restricted tag access the tags never appear: marking is
            // then one idempotent PUT of sizing and marker, not a loop.
            if !tagged {
                // Its own config holds what it copied from its template
                // (whose node may be down now).
                let cfg = self
                    .api
                    .retry_pve(
                        format!("reading the config of VM {vm}, cloned for this machine"),
                        Some(&vm.node),
                        deadline,
                        |pve| pve.get_config(&vm.node, vm.vmid),
                    )
                    .await?;
                self.cloner
                    .mark(&vm, req, &Inherited::of(&cfg), deadline)
                    .await?;
            }
            // A restart may have come between the clone and its resize.
            self.cloner.grow_boot_disk(&vm, req, deadline).await?;
            let st = self.api.managed_status(&vm, deadline).await?;
            self.ensure_running_status(&vm, &st, deadline).await?;
            self.inventory.clear_pending(&req.machine_id);
            return Ok(vm);
        }

        let template_node = self.inventory.template_node(req.template_vmid, &list)?;
        self.refuse_if_down(
            &template_node,
            &format!("the node of template {}", req.template_vmid),
        )?;
        if memory.is_none() {
            memory = self.memory.claim_for_clone(req, deadline).await?;
        }
        // Held until the VM runs, as the memory claim is.
        let devices = self.devices.claim_for_clone(req, deadline).await?;
        // From the template itself, or its replica on the target node.
        let vm = self
            .planner
            .clone_planned(req, &template_node, &list, &name, deadline)
            .await?;
        tracing::info!(machine_id = %req.machine_id, vm = %vm, "clone done");
        // The template's settings (read once per template, cached), not a
        // replica's: a clone of a replica must not keep the replica's tag.
        let template = self
            .placement
            .layout(req.template_vmid, &template_node, None, deadline)
            .await?;
        self.cloner
            .mark(&vm, req, &template.inherited, deadline)
            .await?;
        self.cloner.grow_boot_disk(&vm, req, deadline).await?;
        self.api.start(&vm, deadline).await?;
        self.guest.wait_agent_after_start(&vm).await?;
        if self.opts.type_disk.contains_key(&req.instance_type) {
            self.guest
                .check_grows_root(&vm, req.template_vmid, &req.instance_type)
                .await;
        }
        self.inventory.clear_pending(&req.machine_id);
        tracing::info!(machine_id = %req.machine_id, vm = %vm, "VM created and its guest agent answers");
        // Held until here: the VM now runs and every later read sees it.
        drop(memory);
        drop(devices);
        Ok(vm)
    }

    async fn delete_vm(&self, vm: &VmRef, machine_id: &str) -> Result<(), SubstrateError> {
        self.guest.forget(vm.vmid);
        let deadline = self.api.deadline();
        self.wait_if_down(&vm.node, deadline).await?;
        let Some((vm, cfg)) = self.find_for_delete(vm, deadline).await? else {
            tracing::info!(vm = %vm, "VM already gone");
            self.forget(vm.vmid);
            return Ok(());
        };
        if !owned_by(cfg.description.as_deref(), machine_id, None) {
            // The VMID was reused, or the VM only looks like ours: our VM is gone.
            tracing::warn!(vm = %vm, machine_id, "VM's description marker does not name this machine; leaving it alone");
            self.forget(vm.vmid);
            return Ok(());
        }
        // Stopped first whatever its state: a machine's VM runs until its
        // Delete, and a stop of one that does not is a task that ends at
        // once, where a status read first would cost every Delete.
        self.api.destroy(&vm, true, deadline).await?;
        self.forget(vm.vmid);
        Ok(())
    }

    async fn describe_managed(&self) -> Result<Vec<ManagedVm>, SubstrateError> {
        let (_, marked) = self.scan(|_| true).await?;
        let mut out: Vec<ManagedVm> = marked
            .into_iter()
            .map(|(v, machine_id)| ManagedVm {
                running: v.status == "running",
                vm: VmRef {
                    node: v.node,
                    vmid: v.vmid,
                },
                machine_id,
            })
            .collect();
        out.sort_by_key(|m| m.vm.vmid);
        Ok(out)
    }

    async fn ensure_running(&self, vm: &VmRef) -> Result<(), SubstrateError> {
        let deadline = self.api.deadline();
        let st = self.api.managed_status(vm, deadline).await?;
        // Configure and Drain name the node after the VM: learnt here, fresh
        // on every EnsureRunning that comes before them.
        self.guest.learn_name(vm, st.name.as_deref());
        if st.is_running() {
            // No ping: PVE pings the agent before the guest command that
            // comes next and refuses it, unsent, while the agent is not up;
            // that command then waits for the agent (`Guest::when_agent_up`).
            return Ok(());
        }
        self.ensure_running_status(vm, &st, deadline).await
    }

    async fn configure(&self, vm: &VmRef, blob: &[u8]) -> Result<(), SubstrateError> {
        self.guest.configure(vm, blob).await
    }

    fn readiness_gate(&self) -> bool {
        self.guest.readiness_gate()
    }

    async fn node_ready(&self, vm: &VmRef) -> Result<bool, SubstrateError> {
        self.guest.node_ready(vm).await
    }

    fn readiness_detail(&self, vm: &VmRef) -> Option<String> {
        self.guest.readiness_detail(vm)
    }

    async fn drain(&self, vm: &VmRef, grace: Duration) -> Result<(), SubstrateError> {
        self.wait_if_down(&vm.node, self.api.deadline()).await?;
        self.guest.drain(vm, grace).await
    }
}
