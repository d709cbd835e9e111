//! The inventory read: which VMs exist, which carry our marker, and the
//! per-VM knowledge that spares repeated config reads.

use std::collections::HashSet;

use futures::stream;
use futures::stream::{StreamExt, TryStreamExt};
use pve::{ClusterVm, VmStatus};

use providerkit::ErrorKind;

use super::clone::Probe;
use super::marker::{looks_managed, machine_tag, parse_marker, MANAGED_TAG};
use super::{err, err_at, PveSubstrate};
use crate::substrate::{CloneRequest, SubstrateError, VmRef};

/// Concurrent config reads while indexing new VMs.
pub(super) const CONFIG_READ_CONCURRENCY: usize = 8;

/// The outcome of one config read during a pass.
pub(super) enum ConfigRead {
    /// The machine id from the marker, if any.
    Read(Option<String>),
    /// The node did not answer.
    Unread,
}
use ConfigRead::{Read, Unread};

/// What the last inventory pass learnt about one VM. A config read is only
/// repeated when the listing shows different tags or name.
#[derive(Clone, Debug)]
pub(super) struct Known {
    pub(super) node: String,
    pub(super) name: Option<String>,
    pub(super) tags: Vec<String>,
    /// Verbatim machine id from the description marker; `None` = not ours.
    pub(super) machine_id: Option<String>,
}

impl PveSubstrate {
    /// One `/cluster/resources` read. Configs are read (and cached) only for
    /// VMs that look managed, pass `want`, and are new or changed since last seen.
    /// Returns the listing and the machine id of every marked VM in it.
    pub(super) async fn scan(
        &self,
        want: impl Fn(&ClusterVm) -> bool,
    ) -> Result<(Vec<ClusterVm>, Vec<(ClusterVm, String)>), SubstrateError> {
        let list = self
            .client
            .cluster_resources_vms()
            .await
            .map_err(|e| err("listing the cluster's VMs", &e))?;
        {
            let mut t = self.templates.lock();
            for v in list.iter().filter(|v| v.template) {
                t.insert(v.vmid, v.node.clone());
            }
        }
        let to_read: Vec<ClusterVm> = {
            let index = self.index.lock();
            list.iter()
                .filter(|v| !v.template && looks_managed(&v.tags, v.name.as_deref()) && want(v))
                .filter(|v| {
                    index
                        .get(&v.vmid)
                        .is_none_or(|k| k.tags != v.tags || k.name != v.name)
                })
                .cloned()
                .collect()
        };
        let read: Vec<(ClusterVm, ConfigRead)> = stream::iter(to_read)
            .map(|v| async move {
                match self.client.get_config(&v.node, v.vmid).await {
                    Ok(cfg) => {
                        let id = cfg.description.as_deref().and_then(parse_marker);
                        Ok(Some((v, Read(id))))
                    }
                    // Destroyed between the listing and the read.
                    Err(e) if e.is_not_found() => Ok(None),
                    // Its node is offline or unreachable: keep what the last
                    // pass learnt (the VM stays reported under its machine
                    // id) rather than fail the whole pass; a VM never read
                    // is left out until its node answers.
                    Err(e) if e.is_transient() => {
                        tracing::warn!(vm = %format!("{}/{}", v.node, v.vmid), error = %e,
                            "cannot read the config of a managed-looking VM (node offline or unreachable); \
                             keeping its last known state");
                        Ok(Some((v, Unread)))
                    }
                    // Failing the pass beats reporting a marked VM's slot as free.
                    Err(e) => Err(err(
                        format!("reading the config of VM {}/{}", v.node, v.vmid),
                        &e,
                    )),
                }
            })
            .buffer_unordered(CONFIG_READ_CONCURRENCY)
            .try_filter_map(|x| async move { Ok(x) })
            .try_collect()
            .await?;

        let marked = {
            let mut index = self.index.lock();
            for (v, outcome) in read {
                let machine_id = match outcome {
                    Read(id) => id,
                    Unread => {
                        // Follow the listing's tags and name so the cached
                        // machine id stays reported while the node is away.
                        if let Some(k) = index.get_mut(&v.vmid) {
                            k.tags.clone_from(&v.tags);
                            k.name.clone_from(&v.name);
                        }
                        continue;
                    }
                };
                index.insert(
                    v.vmid,
                    Known {
                        node: v.node.clone(),
                        name: v.name.clone(),
                        tags: v.tags.clone(),
                        machine_id,
                    },
                );
            }
            let present: HashSet<u32> = list.iter().map(|v| v.vmid).collect();
            index.retain(|vmid, _| present.contains(vmid));
            let mut marked = Vec::new();
            for v in &list {
                if let Some(k) = index.get_mut(&v.vmid) {
                    // A migrated VM keeps its marker; follow it without a re-read.
                    k.node.clone_from(&v.node);
                    if let Some(id) = &k.machine_id {
                        if k.tags == v.tags && k.name == v.name {
                            marked.push((v.clone(), id.clone()));
                        }
                    }
                }
            }
            marked
        };
        let marked = self.reap_late_clones(marked).await;
        Ok((list, marked))
    }

    pub(super) fn forget(&self, vmid: u32) {
        self.index.lock().remove(&vmid);
        self.pending.lock().retain(|_, vm| vm.vmid != vmid);
        self.vmids
            .lock()
            .cooldown
            .insert(vmid, std::time::Instant::now() + self.opts.vmid_cooldown);
    }

    /// Finds the node a VMID is on now (after a 'does not exist' on the node we
    /// expected); `None` if the cluster no longer has it.
    pub(super) async fn locate(&self, vmid: u32) -> Result<Option<ClusterVm>, SubstrateError> {
        let list = self
            .client
            .cluster_resources_vms()
            .await
            .map_err(|e| err("listing the cluster's VMs", &e))?;
        Ok(list.into_iter().find(|v| v.vmid == vmid && !v.template))
    }

    /// `status/current`, refusing VMs without our marker.
    pub(super) async fn managed_status(
        &self,
        vm: &VmRef,
        deadline: tokio::time::Instant,
    ) -> Result<VmStatus, SubstrateError> {
        let mut call = || self.client.status_current(&vm.node, vm.vmid);
        let st = self
            .retry_raw(Some(&vm.node), deadline, &mut call)
            .await
            .map_err(|e| {
                if e.is_not_found() {
                    SubstrateError::new(format!(
                        "VM {vm} does not exist (destroyed, or moved to another node; the next reconcile updates its host): {e}"
                    ))
                } else {
                    err_at(format!("reading the status of VM {vm}"), Some(&vm.node), &e)
                }
            })?;
        if !looks_managed(&st.tags, st.name.as_deref()) {
            return Err(SubstrateError::new(format!(
                "VM {vm} does not carry the {MANAGED_TAG} marker; refusing to touch it"
            )));
        }
        Ok(st)
    }

    /// An existing VM marked with this machine id, if any: the in-process
    /// record of clones we started, then the (possibly seconds-stale) inventory.
    pub(super) async fn find_existing(
        &self,
        req: &CloneRequest,
        expected_name: &str,
        deadline: tokio::time::Instant,
    ) -> Result<(Option<(VmRef, Vec<String>)>, Vec<ClusterVm>), SubstrateError> {
        let pending = self.pending.lock().get(&req.machine_id).cloned();
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
            self.vmids.lock().late.remove(&v.vmid);
            return Ok((Some((vm, v.tags.clone())), list));
        }
        if let Some(vm) = pending {
            // Not in the inventory yet: ask the VM itself. A clone still in
            // progress (temporary config, or outside the pool until its end)
            // is waited for: cloning again would make a second VM.
            loop {
                match self.probe_pending(&vm, &req.machine_id, deadline).await? {
                    Probe::Ours(tags) => {
                        self.vmids.lock().late.remove(&vm.vmid);
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
            self.pending.lock().remove(&req.machine_id);
        }
        Ok((None, list))
    }

    pub(super) fn template_node(
        &self,
        template: u32,
        list: &[ClusterVm],
    ) -> Result<String, SubstrateError> {
        if let Some(v) = list.iter().find(|v| v.vmid == template) {
            if !v.template {
                tracing::warn!(
                    vmid = template,
                    "source VM of the instance type is not a template; cloning it anyway"
                );
            }
            return Ok(v.node.clone());
        }
        self.templates
            .lock()
            .get(&template)
            .cloned()
            .ok_or_else(|| {
                SubstrateError::new(format!(
                "template VMID {template} is not in the cluster (or the API token cannot audit it)"
            ))
            })
    }
}
