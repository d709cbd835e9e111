//! Cloning one machine's VM: the clone itself with its retry loop (VMID
//! collisions, locks, an offline node, a lost answer resolved by the
//! marker), marking, and clean-up of a failed clone.

use std::sync::Arc;

use providerkit::ErrorKind;
use pve::{CloneParams, ConfigParams, PveError, Upid};
use tokio::time::Instant;

use super::api::{err, err_at, stale_lock_error, Api, LockedVm, Probe};
use super::inventory::{Inventory, Known};
use super::late::LateClones;
use super::marker::{
    looks_managed, machine_tag, marker_description, owned_by, vm_name, TagPolicy, MANAGED_TAG,
};
use super::options::PveOptions;
use super::placement::Placement;
use super::sizing::{Inherited, CLEARED_KEYS};
use super::slots::{ClonePermit, CloneSlots, Read, SlotDomain};
use super::vmid::{LateClone, Vmids};
use crate::substrate::{CloneRequest, SubstrateError, VmRef};
use crate::timeline::{self, Step};

/// Makes and marks the VM of one machine; it owns no state of its own, only
/// the parts a clone goes through.
pub(super) struct Cloner {
    api: Arc<Api>,
    /// The options this part reads.
    opts: Arc<PveOptions>,
    vmids: Arc<Vmids>,
    inventory: Arc<Inventory>,
    slots: Arc<CloneSlots>,
    placement: Arc<Placement>,
    late: Arc<LateClones>,
    tags: Arc<TagPolicy>,
}

/// The parts a [`Cloner`] goes through.
pub(super) struct ClonerParts {
    pub(super) api: Arc<Api>,
    pub(super) opts: Arc<PveOptions>,
    pub(super) vmids: Arc<Vmids>,
    pub(super) inventory: Arc<Inventory>,
    pub(super) slots: Arc<CloneSlots>,
    pub(super) placement: Arc<Placement>,
    pub(super) late: Arc<LateClones>,
    pub(super) tags: Arc<TagPolicy>,
}

impl Cloner {
    pub(super) fn new(p: ClonerParts) -> Cloner {
        Cloner {
            api: p.api,
            opts: p.opts,
            vmids: p.vmids,
            inventory: p.inventory,
            slots: p.slots,
            placement: p.placement,
            late: p.late,
            tags: p.tags,
        }
    }

    /// Drops what is known of a VMID this part destroyed, and cools it down.
    fn forget(&self, vmid: u32) {
        self.inventory.forget(vmid);
        self.vmids.cool_down(vmid);
    }

    /// Clones until a VMID sticks or `deadline` passes: a VMID collision
    /// (found by the API or inside the clone worker) moves on to a fresh id;
    /// storage lock timeouts, a template locked by a backup, and an offline or
    /// unreachable node back off and retry; a POST whose answer was lost is
    /// resolved by looking for the VM by its marker, never by cloning twice.
    /// Returns once the clone task is OK.
    pub(super) async fn clone_new(
        &self,
        req: &CloneRequest,
        template_node: &str,
        name: &str,
        deadline: Instant,
    ) -> Result<VmRef, SubstrateError> {
        let (full, target_storage) = self.placement.clone_options(req);
        let domain = self
            .placement
            .slot_domain(
                req.template_vmid,
                template_node,
                target_storage.as_deref(),
                deadline,
            )
            .await?;
        let storage = &domain.storage;
        let slot = timeline::step(Step::CloneSlot, &req.node);
        let mut permit = slot.end(self.slots.permit(&req.node, &domain).await)?;
        let description = marker_description(&req.machine_id, &req.operation_id);
        let mut last: Option<String> = None;
        let mut attempt: u32 = 0;
        loop {
            if Instant::now() >= deadline {
                return Err(SubstrateError::with_kind(
                    ErrorKind::Transient,
                    format!(
                        "cloning template {} to node {} did not succeed within {:?} (last error: {})",
                        req.template_vmid,
                        req.node,
                        self.opts.retry_window,
                        last.unwrap_or_else(|| "none".into())
                    ),
                ));
            }
            let cross_node = req.node != template_node;
            if cross_node && self.api.node_offline(&req.node, deadline).await? {
                tracing::info!(node = %req.node, template_node, "target node is offline; waiting");
                last = Some(format!(
                    "node {} is offline (a clone there would be accepted and left on a node that cannot start it)",
                    req.node
                ));
                self.api.pause(attempt, deadline).await;
                attempt += 1;
                continue;
            }
            let res = self.vmids.reserve(deadline).await?;
            let vm = VmRef {
                node: req.node.clone(),
                vmid: res.vmid,
            };
            let params = CloneParams {
                newid: res.vmid,
                name: Some(name.to_string()),
                description: Some(description.clone()),
                pool: self.opts.pool.clone(),
                full: Some(full),
                storage: target_storage.clone(),
                target: cross_node.then(|| req.node.clone()),
            };
            self.inventory.set_pending(&req.machine_id, &vm);
            tracing::info!(machine_id = %req.machine_id, vm = %vm, template = req.template_vmid, template_node, storage = %storage, "cloning");
            let posted = Instant::now();
            let upid = match self
                .api
                .once(|pve| pve.clone_vm(template_node, req.template_vmid, &params))
                .await
            {
                Ok(upid) => upid,
                Err(e) if e.is_vmid_collision(res.vmid) => {
                    tracing::info!(vmid = res.vmid, "VMID taken meanwhile; trying a fresh one");
                    self.vmids.guessed_wrong();
                    self.inventory.clear_pending(&req.machine_id);
                    last = Some(e.to_string());
                    continue;
                }
                Err(e) if e.is_local_storage_clone() => {
                    self.inventory.clear_pending(&req.machine_id);
                    return Err(SubstrateError::new(format!(
                        "cannot clone template {} from node {template_node} to node {}: its disks are on local storage. \
                         Put the template on shared storage, or keep a template per node and point each node's instance types at it ({e})",
                        req.template_vmid, req.node
                    )));
                }
                Err(e) if e.may_have_been_applied_post() => {
                    tracing::warn!(vm = %vm, error = %e, "the answer to the clone request was lost; looking for the VM by its marker");
                    match self.resolve_ambiguous_clone(&vm, req, &e, deadline).await? {
                        Ambiguous::Ours => {
                            res.commit();
                            self.late
                                .reap_twins(&req.machine_id, vm.vmid, deadline)
                                .await;
                            return Ok(vm);
                        }
                        Ambiguous::Absent => {
                            // Taken as not applied, but the request may still
                            // be queued on the node: watch its VMID, so a clone
                            // landing there later is found and removed once
                            // the fresh clone exists (one VM per machine).
                            let until = std::time::Instant::now()
                                + self.opts.vmid_cooldown.max(self.opts.task_timeout);
                            self.vmids.watch_late(
                                vm.vmid,
                                LateClone {
                                    machine_id: req.machine_id.clone(),
                                    operation_id: req.operation_id.clone(),
                                    node: req.node.clone(),
                                    until,
                                },
                            );
                        }
                        Ambiguous::Taken => {}
                    }
                    self.inventory.clear_pending(&req.machine_id);
                    last = Some(e.to_string());
                    continue;
                }
                Err(e) if e.is_lock_timeout() => {
                    self.inventory.clear_pending(&req.machine_id);
                    permit = self
                        .requeue(permit, &e, req, &domain, attempt, deadline)
                        .await?;
                    last = Some(e.to_string());
                    attempt += 1;
                    continue;
                }
                Err(e) if e.is_locked() => {
                    // `VM 9000 is locked (backup)`: a nightly backup of the
                    // template; it clears by itself.
                    tracing::info!(template = req.template_vmid, error = %e, "template is locked; waiting");
                    self.inventory.clear_pending(&req.machine_id);
                    last = Some(format!(
                        "template {} on node {template_node} is locked: {e}",
                        req.template_vmid
                    ));
                    self.api.pause(attempt, deadline).await;
                    attempt += 1;
                    continue;
                }
                Err(e) if e.is_transient() || e.is_offline() => {
                    // Not applied (595: pveproxy could not connect; a target
                    // node that is not online is refused before anything).
                    tracing::info!(node = %req.node, template_node, error = %e, "node unreachable; waiting");
                    self.inventory.clear_pending(&req.machine_id);
                    last = Some(format!(
                        "node {} (template node {template_node}) is offline or unreachable: {e}",
                        req.node
                    ));
                    self.api.pause(attempt, deadline).await;
                    attempt += 1;
                    continue;
                }
                Err(e) => {
                    self.inventory.clear_pending(&req.machine_id);
                    return Err(err(
                        format!("cloning template {} to VM {vm}", req.template_vmid),
                        &e,
                    ));
                }
            };
            tracing::info!(machine_id = %req.machine_id, vm = %vm, task = %upid, "clone started");
            let waited = {
                let wait = self.api.wait_task(&upid, "clone");
                tokio::pin!(wait);
                tokio::select! {
                    ended = &mut wait => ended,
                    () = self.report_progress(&permit, &upid) => wait.await,
                }
            };
            match waited {
                Ok(()) => {
                    permit.finished(req.template_vmid, posted.elapsed());
                    res.commit();
                    self.late
                        .reap_twins(&req.machine_id, vm.vmid, deadline)
                        .await;
                    return Ok(vm);
                }
                Err(e) if e.is_vmid_collision(res.vmid) => {
                    // The worker found the id taken before creating anything:
                    // whatever is at that VMID is not ours; never touch it.
                    tracing::info!(vm = %vm, error = %e, "the clone worker found the VMID taken; trying a fresh one");
                    self.vmids.guessed_wrong();
                    self.inventory.clear_pending(&req.machine_id);
                    last = Some(e.to_string());
                }
                Err(e) if e.is_lock_timeout() => {
                    tracing::info!(vm = %vm, error = %e, "clone hit a storage lock timeout; retrying");
                    self.remove_failed_clone(&vm, req, deadline).await?;
                    self.inventory.clear_pending(&req.machine_id);
                    permit = self
                        .requeue(permit, &e, req, &domain, attempt, deadline)
                        .await?;
                    last = Some(e.to_string());
                    attempt += 1;
                }
                Err(e @ PveError::TaskFailed { .. }) => {
                    self.remove_failed_clone(&vm, req, deadline).await?;
                    self.inventory.clear_pending(&req.machine_id);
                    return Err(err(format!("clone task for VM {vm}"), &e));
                }
                // Still running at the deadline (or unreadable): the VM may yet
                // appear; `pending` lets a retried Create adopt it.
                Err(e) => {
                    return Err(err(format!("clone task for VM {vm}"), &e));
                }
            }
        }
    }

    /// While the clone's domain learns its storage (see
    /// `slots::learn`): reads the clone task's log for its copy's progress
    /// when the domain asks (while it allocates, every 250 ms; in its
    /// stage's window, when it should have advanced enough; otherwise when
    /// the learning moves on), and tells it. Returns once the domain needs
    /// no more (at once when it is not learning); the task's wait runs
    /// beside it. A log that cannot be read now is read again at the next
    /// turn: a missed sample only delays the learning.
    async fn report_progress(&self, permit: &ClonePermit, upid: &Upid) {
        // A wake missed is made up for by a read this much later.
        const AT_LATEST: std::time::Duration = std::time::Duration::from_secs(2);
        let Some(first) = permit.first_read() else {
            return;
        };
        let mut changes = permit.changes();
        let mut next = Read::After(first);
        loop {
            match next {
                Read::After(after) => tokio::time::sleep(after).await,
                Read::OnChange => {
                    let _ = tokio::time::timeout(AT_LATEST, changes.changed()).await;
                    if !permit.learning() {
                        return;
                    }
                }
                Read::Done => return,
            }
            let percent = match self.api.copy_percent(upid, None).await {
                Ok(percent) => percent,
                Err(e) => {
                    tracing::debug!(task = %upid, error = %e, "could not read the clone's progress; reading it at the next turn");
                    next = Read::After(first);
                    continue;
                }
            };
            next = permit.sample(percent, &mut changes);
        }
    }

    /// After a lock timeout: a storage's tells the clone slots; then the
    /// slot goes back while the clone backs off (it holds nothing on the
    /// storage), and the clone waits its turn for one again.
    async fn requeue(
        &self,
        permit: ClonePermit,
        e: &PveError,
        req: &CloneRequest,
        domain: &SlotDomain,
        attempt: u32,
        deadline: Instant,
    ) -> Result<ClonePermit, SubstrateError> {
        if e.is_storage_lock_timeout() {
            permit.lock_timeout();
        }
        drop(permit);
        self.api.pause(attempt, deadline).await;
        let slot = timeline::step(Step::CloneSlot, &req.node);
        slot.end(self.slots.permit(&req.node, domain).await)
    }

    /// After a clone POST whose answer was lost: [`Ambiguous::Ours`] once the
    /// VM shows up with our marker and unlocked, [`Ambiguous::Absent`] once
    /// its VMID has stayed free for [`PveOptions::ambiguous_settle`], and
    /// [`Ambiguous::Taken`] when a VM that is not ours holds it. Gives up at
    /// `deadline` with a transient error that keeps `pending`, so a retried
    /// Create resolves it.
    ///
    /// [`PveOptions::ambiguous_settle`]: super::options::PveOptions::ambiguous_settle
    async fn resolve_ambiguous_clone(
        &self,
        vm: &VmRef,
        req: &CloneRequest,
        cause: &PveError,
        deadline: Instant,
    ) -> Result<Ambiguous, SubstrateError> {
        let settle = Instant::now() + self.opts.ambiguous_settle;
        loop {
            match self.api.probe(vm, &req.machine_id, deadline).await? {
                Probe::Ours(_) => {
                    self.api
                        .wait_status(vm, "unlocked after cloning", |s| s.lock.is_none())
                        .await?;
                    return Ok(Ambiguous::Ours);
                }
                Probe::Foreign => return Ok(Ambiguous::Taken),
                Probe::Gone if Instant::now() >= settle => return Ok(Ambiguous::Absent),
                Probe::Gone | Probe::Cloning => {}
            }
            if Instant::now() >= deadline {
                return Err(SubstrateError::caused_by(
                    ErrorKind::Transient,
                    format!(
                        "the clone request for VM {vm} may have been applied (its answer was lost) \
                         and the VM is still being cloned after {:?}; a retried Create adopts it by its marker",
                        self.opts.retry_window
                    ),
                    cause.clone(),
                ));
            }
            tokio::time::sleep(self.opts.poll_interval).await;
        }
    }

    /// PVE normally removes the half-made VM when a clone worker fails; if it
    /// did not, destroy it, but only when its marker names this machine and
    /// this operation (a VM that merely looks managed may be another's).
    pub(super) async fn remove_failed_clone(
        &self,
        vm: &VmRef,
        req: &CloneRequest,
        deadline: Instant,
    ) -> Result<(), SubstrateError> {
        const WHAT: &str = "checking the failed clone";
        let Some(st) = self
            .api
            .read_present(WHAT, vm, deadline, |pve| {
                pve.status_current(&vm.node, vm.vmid)
            })
            .await?
        else {
            // Gone, or outside the token's pool. A clone worker that died
            // (its node powered off) leaves the new VM `lock: clone` and
            // never adds it to the pool: the VMID we cloned to is still
            // taken, by a VM this token can neither see nor destroy. Say
            // so rather than leak it silently.
            if self.api.vmid_taken(vm.vmid, deadline).await? {
                return Err(stale_lock_error(vm, "clone", LockedVm::OutsidePool));
            }
            return Ok(());
        };
        let Some(cfg) = self
            .api
            .read_present(WHAT, vm, deadline, |pve| pve.get_config(&vm.node, vm.vmid))
            .await?
        else {
            return Ok(());
        };
        // A bare temporary config (`lock: clone`, no marker yet) at the
        // VMID our clone went to, with no clone running to finish it: the
        // worker died and left it, and only root can unlock it.
        if cfg.lock.as_deref() == Some("clone") && cfg.description.is_none() {
            if let Some(lock) = self.api.stale_lock(vm, deadline).await? {
                return Err(stale_lock_error(vm, &lock, LockedVm::Unmarked));
            }
        }
        if !owned_by(
            cfg.description.as_deref(),
            &req.machine_id,
            Some(&req.operation_id),
        ) {
            if looks_managed(&st.tags, st.name.as_deref()) {
                tracing::warn!(vm = %vm, machine_id = %req.machine_id, "a VM that looks managed is at the failed clone's VMID but its marker is not this clone's; leaving it alone");
            }
            return Ok(());
        }
        tracing::warn!(vm = %vm, "failed clone left its VM behind; destroying it");
        self.api.destroy(vm, st.is_running(), deadline).await?;
        self.forget(vm.vmid);
        Ok(())
    }

    /// Sizes and tags the VM, waiting out the clone's config lock: exactly
    /// the instance type's vCPUs and memory whatever the template's
    /// `sockets`, `vcpus` and `balloon` (see [`super::sizing`]), its mapped
    /// PCI devices, our tags beside the template's. Where the cluster's `user-tag-access` refuses
    /// the per-machine tag (403), marks by sizing and description only,
    /// from then on, with one warning.
    pub(super) async fn mark(
        &self,
        vm: &VmRef,
        req: &CloneRequest,
        inherited: &Inherited,
        deadline: Instant,
    ) -> Result<(), SubstrateError> {
        let ours = vec![MANAGED_TAG.to_string(), machine_tag(&req.machine_id)];
        let type_balloon = self.opts.type_balloon.get(&req.instance_type).copied();
        // The type's mapped devices, beside those the VM has.
        let hostpci = match self.opts.type_devices.get(&req.instance_type) {
            Some(dev) => inherited.pci_entries(dev).map_err(|why| {
                SubstrateError::new(format!(
                    "instance type {}: {why}: free hostpci entries on the template, or lower the \
                     type's pci.count",
                    req.instance_type
                ))
            })?,
            None => Default::default(),
        };
        let mut params = ConfigParams {
            cores: Some(req.vcpu),
            sockets: Some(1),
            memory: Some(req.memory_mib),
            balloon: inherited.balloon(req.memory_mib, type_balloon),
            description: Some(marker_description(&req.machine_id, &req.operation_id)),
            tags: (!self.tags.restricted()).then(|| inherited.tags_with(&ours)),
            digest: None,
            // PVE copies a template's `protection: 1` onto its clones, and
            // a protected VM cannot be destroyed: the machine's VM is ours
            // to delete, so the flag goes in the same PUT as the marker.
            delete: CLEARED_KEYS.iter().map(|k| k.to_string()).collect(),
            hostpci,
        };
        let mut attempt = 0;
        loop {
            match self
                .api
                .once(|pve| pve.set_config_sync(&vm.node, vm.vmid, &params))
                .await
            {
                Ok(()) => break,
                // Not the tags: the devices' privileges (qemu-server
                // `check_hostpci_perm`), which the start-up check names too.
                Err(e)
                    if e.is_forbidden()
                        && !params.hostpci.is_empty()
                        && ["Mapping.Use", "VM.Config.HWType"]
                            .iter()
                            .any(|p| e.to_string().contains(p)) =>
                {
                    return Err(SubstrateError::caused_by(
                        providerkit::ErrorKind::Refused,
                        format!(
                            "attaching instance type {}'s mapped PCI devices to VM {vm}: the API token \
                             needs Mapping.Use on /mapping/pci/<mapping> and VM.Config.HWType on the \
                             pool (deploy/host-setup/setup-token.sh --pci-mapping <mapping>)",
                            req.instance_type
                        ),
                        e,
                    ));
                }
                Err(e) if e.is_forbidden() && params.tags.is_some() => {
                    if self.tags.restrict() {
                        tracing::warn!(vm = %vm, error = %e,
                            "the cluster refuses new tags (datacenter option user-tag-access); \
                             VMs are owned by their description marker only. To keep the tags, set \
                             user-tag-access to free (Datacenter > Options > User Tag Access) or grant \
                             the token Sys.Modify on /");
                    }
                    params.tags = None;
                }
                Err(e) if e.is_locked() && Instant::now() < deadline => {
                    tracing::debug!(vm = %vm, error = %e, "config locked; waiting");
                    if e.is_lock_timeout() {
                        self.api.pause(attempt, deadline).await;
                    } else {
                        timeline::step(Step::LockWait, &vm.node).end(
                            self.api
                                .wait_status(vm, "unlocked", |s| s.lock.is_none())
                                .await,
                        )?;
                    }
                    attempt += 1;
                }
                // Repeating the same PUT is harmless.
                Err(e) if e.is_transient() && Instant::now() < deadline => {
                    self.api.pause(attempt, deadline).await;
                    attempt += 1;
                }
                Err(e) => {
                    return Err(err_at(
                        format!("setting size and tags of VM {vm}"),
                        Some(&vm.node),
                        &e,
                    ))
                }
            }
        }
        let Some(applied) = params.tags else {
            // Tags unknown (the template's, if any): the next pass reads the config.
            self.inventory.learn(vm.vmid, None);
            return Ok(());
        };
        let mut normalized = pve::normalize_tags(&pve::join_tags(&applied));
        normalized.sort();
        self.inventory.learn(
            vm.vmid,
            Some(Known {
                node: vm.node.clone(),
                name: Some(vm_name(&req.instance_type, &req.machine_id)),
                tags: normalized,
                machine_id: Some(req.machine_id.clone()),
            }),
        );
        Ok(())
    }
}

impl Cloner {
    /// Grows the VM's boot disk to its instance type's `disk_gib`, before
    /// the VM starts (the guest grows its file system at boot). Reads the
    /// VM's own config first, so a resumed Create whose resize landed
    /// before a restart sends nothing; the size sent is absolute, so a
    /// resize repeated after a lost answer is harmless. Types without a
    /// size cost nothing.
    pub(super) async fn grow_boot_disk(
        &self,
        vm: &VmRef,
        req: &CloneRequest,
        deadline: Instant,
    ) -> Result<(), SubstrateError> {
        let Some(want) = self.opts.type_disk.get(&req.instance_type) else {
            return Ok(());
        };
        let cfg = self
            .api
            .retry_pve(
                format!("reading the disks of VM {vm}"),
                Some(&vm.node),
                deadline,
                |pve| pve.get_config(&vm.node, vm.vmid),
            )
            .await?;
        let Some((disk, _storage, bytes)) = cfg.boot_disk() else {
            return Err(SubstrateError::new(format!(
                "instance type {} sets disk_gib {}, but VM {vm} has no boot disk on a storage to grow",
                req.instance_type, want.gib
            )));
        };
        if bytes >= want.bytes() {
            return Ok(());
        }
        tracing::info!(vm = %vm, disk = %disk, from_gib = bytes >> 30, to_gib = want.gib, "growing the boot disk");
        let upid = self
            .api
            .retry_pve(
                format!("growing disk {disk} of VM {vm} to {} GiB", want.gib),
                Some(&vm.node),
                deadline,
                |pve| pve.resize_disk(&vm.node, vm.vmid, &disk, want.bytes()),
            )
            .await?;
        self.api.wait_task(&upid, "resize").await.map_err(|e| {
            err_at(
                format!("growing disk {disk} of VM {vm} to {} GiB", want.gib),
                Some(&vm.node),
                &e,
            )
        })
    }
}

/// How a clone POST whose answer was lost turned out.
enum Ambiguous {
    /// Applied: the VM carries our marker.
    Ours,
    /// Its VMID stayed free: taken as not applied (but watched).
    Absent,
    /// Its VMID holds a VM that is not ours: ours never landed there.
    Taken,
}
