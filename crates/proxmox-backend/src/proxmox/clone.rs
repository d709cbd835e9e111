//! Cloning: clone slots per (target node, storage), the template's storage,
//! the clone itself with its retry loop, marking, and clean-up of a failed clone.

use std::sync::Arc;

use pve::{machine_tag, CloneParams, ConfigParams, PveError};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::inventory::Known;
use super::marker::{looks_managed, marker_description, parse_marker, vm_name, MANAGED_TAG};
use super::{err, PveSubstrate};
use crate::substrate::{CloneRequest, Substrate, SubstrateError, VmRef};

/// Clone attempts (VMID collisions, storage lock timeouts) before giving up.
pub(super) const CLONE_ATTEMPTS: u32 = 10;

/// Clone-slot key for a template's disk storages (sorted, deduplicated): one
/// storage is its id; several are joined into one stable key, so templates
/// spanning the same set of storages share a bound; none (a diskless
/// template) is a fixed placeholder.
pub(super) fn storage_key(storages: &[String]) -> String {
    if storages.is_empty() {
        "(no disks)".to_string()
    } else {
        storages.join("+")
    }
}

impl PveSubstrate {
    pub(super) async fn clone_permit(
        &self,
        node: &str,
        storage: &str,
    ) -> Result<OwnedSemaphorePermit, SubstrateError> {
        let sem = self
            .clone_slots
            .lock()
            .entry((node.to_string(), storage.to_string()))
            .or_insert_with(|| Arc::new(Semaphore::new(self.opts.max_parallel_clones.max(1))))
            .clone();
        sem.acquire_owned()
            .await
            .map_err(|_| SubstrateError::new("clone slots closed"))
    }

    /// The clone-slot key of a template's disk storages. A full clone without
    /// `storage` lands on the same storages, so their locks are what parallel
    /// clones contend on. One config read per template per process; a failed
    /// read fails the Create (and is retried by the next one).
    pub(super) async fn template_storage(
        &self,
        template: u32,
        template_node: &str,
    ) -> Result<String, SubstrateError> {
        let cell = self
            .template_storage
            .lock()
            .entry(template)
            .or_default()
            .clone();
        cell.get_or_try_init(|| async {
            let cfg = self
                .client
                .get_config(template_node, template)
                .await
                .map_err(|e| {
                    err(
                        format!(
                            "reading the config of template {template} on node {template_node} \
                             (needed to bound clones per storage)"
                        ),
                        &e,
                    )
                })?;
            let key = storage_key(&cfg.disk_storages());
            tracing::debug!(template, storage = %key, "template disk storage resolved");
            Ok(key)
        })
        .await
        .cloned()
    }

    /// Clones until a VMID sticks: collisions move on to the next id, storage
    /// lock timeouts back off and retry. Returns once the clone task is OK.
    pub(super) async fn clone_new(
        &self,
        req: &CloneRequest,
        template_node: &str,
        name: &str,
    ) -> Result<VmRef, SubstrateError> {
        let storage = self
            .template_storage(req.template_vmid, template_node)
            .await?;
        let _permit = self.clone_permit(&req.node, &storage).await?;
        let description = marker_description(&req.machine_id, &req.operation_id);
        let mut last: Option<String> = None;
        for attempt in 0..CLONE_ATTEMPTS {
            let res = self.reserve_vmid().await?;
            let vm = VmRef {
                node: req.node.clone(),
                vmid: res.vmid,
            };
            let params = CloneParams {
                newid: res.vmid,
                name: Some(name.to_string()),
                description: Some(description.clone()),
                pool: self.opts.pool.clone(),
                full: Some(true),
                storage: None,
                target: (req.node != template_node).then(|| req.node.clone()),
            };
            self.pending
                .lock()
                .insert(req.machine_id.clone(), vm.clone());
            tracing::info!(machine_id = %req.machine_id, vm = %vm, template = req.template_vmid, template_node, storage = %storage, "cloning");
            let upid = match self
                .client
                .clone_vm(template_node, req.template_vmid, &params)
                .await
            {
                Ok(upid) => upid,
                Err(e) if e.is_already_exists() => {
                    tracing::info!(vmid = res.vmid, "VMID taken meanwhile; trying the next one");
                    self.pending.lock().remove(&req.machine_id);
                    last = Some(e.to_string());
                    continue;
                }
                Err(e) if e.is_lock_timeout() => {
                    self.pending.lock().remove(&req.machine_id);
                    last = Some(e.to_string());
                    tokio::time::sleep(self.backoff(attempt)).await;
                    continue;
                }
                Err(e) if e.to_string().contains("uses local storage") => {
                    self.pending.lock().remove(&req.machine_id);
                    return Err(SubstrateError::new(format!(
                        "cannot clone template {} from node {template_node} to node {}: its disks are on local storage. \
                         Put the template on shared storage, or keep a template per node and point each node's instance types at it ({e})",
                        req.template_vmid, req.node
                    )));
                }
                Err(e) if e.may_have_been_applied() => {
                    // The clone may have been accepted; look before giving up.
                    return match self.client.get_config(&vm.node, vm.vmid).await {
                        Ok(cfg)
                            if cfg.description.as_deref().and_then(parse_marker).as_deref()
                                == Some(req.machine_id.as_str()) =>
                        {
                            self.wait_status(&vm, "unlocked after cloning", |s| s.lock.is_none())
                                .await?;
                            res.commit();
                            Ok(vm)
                        }
                        _ => Err(err(
                            format!("cloning template {} to VM {vm}", req.template_vmid),
                            &e,
                        )),
                    };
                }
                Err(e) => {
                    self.pending.lock().remove(&req.machine_id);
                    return Err(err(
                        format!("cloning template {} to VM {vm}", req.template_vmid),
                        &e,
                    ));
                }
            };
            match self.wait_task(&upid, "clone").await {
                Ok(()) => {
                    res.commit();
                    return Ok(vm);
                }
                Err(e) if e.is_lock_timeout() => {
                    tracing::info!(vm = %vm, error = %e, "clone hit a storage lock timeout; retrying");
                    self.remove_failed_clone(&vm).await?;
                    self.pending.lock().remove(&req.machine_id);
                    last = Some(e.to_string());
                    tokio::time::sleep(self.backoff(attempt)).await;
                }
                Err(e @ PveError::TaskFailed { .. }) => {
                    self.remove_failed_clone(&vm).await?;
                    self.pending.lock().remove(&req.machine_id);
                    return Err(err(format!("clone task for VM {vm}"), &e));
                }
                // Still running at the deadline (or unreadable): the VM may yet
                // appear; `pending` lets a retried Create adopt it.
                Err(e) => {
                    return Err(err(format!("clone task for VM {vm}"), &e));
                }
            }
        }
        Err(SubstrateError::new(format!(
            "cloning template {} gave up after {CLONE_ATTEMPTS} attempts (last error: {})",
            req.template_vmid,
            last.unwrap_or_default()
        )))
    }

    /// PVE normally removes the half-made VM when a clone worker fails; if it
    /// is still there (marked by its description), destroy it so no orphan
    /// competes with the retry for this machine id.
    pub(super) async fn remove_failed_clone(&self, vm: &VmRef) -> Result<(), SubstrateError> {
        match self.client.status_current(&vm.node, vm.vmid).await {
            Err(e) if e.is_not_found() => Ok(()),
            Err(e) => Err(err(format!("checking the failed clone VM {vm}"), &e)),
            Ok(st) if !looks_managed(&st.tags, st.name.as_deref()) => Ok(()),
            Ok(_) => {
                tracing::warn!(vm = %vm, "failed clone left its VM behind; destroying it");
                self.delete_vm(vm).await
            }
        }
    }

    /// Sizes and tags the VM, waiting out the clone's config lock.
    pub(super) async fn mark(&self, vm: &VmRef, req: &CloneRequest) -> Result<(), SubstrateError> {
        let tags = vec![MANAGED_TAG.to_string(), machine_tag(&req.machine_id)];
        let params = ConfigParams {
            cores: Some(req.vcpu),
            memory: Some(req.memory_mib),
            description: Some(marker_description(&req.machine_id, &req.operation_id)),
            tags: Some(tags.clone()),
            digest: None,
        };
        let deadline = Instant::now() + self.opts.task_timeout;
        let mut attempt = 0;
        loop {
            match self
                .client
                .set_config_sync(&vm.node, vm.vmid, &params)
                .await
            {
                Ok(()) => break,
                Err(e) if e.is_locked() && Instant::now() < deadline => {
                    tracing::debug!(vm = %vm, error = %e, "config locked; waiting");
                    if e.is_lock_timeout() {
                        tokio::time::sleep(self.backoff(attempt)).await;
                    } else {
                        self.wait_status(vm, "unlocked", |s| s.lock.is_none())
                            .await?;
                    }
                    attempt += 1;
                }
                Err(e) => return Err(err(format!("setting size and tags of VM {vm}"), &e)),
            }
        }
        let mut normalized = pve::normalize_tags(&pve::join_tags(&tags));
        normalized.sort();
        self.index.lock().insert(
            vm.vmid,
            Known {
                node: vm.node.clone(),
                name: Some(vm_name(&req.instance_type, &req.machine_id)),
                tags: normalized,
                machine_id: Some(req.machine_id.clone()),
            },
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_keys() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(storage_key(&s(&["local-lvm"])), "local-lvm");
        assert_eq!(
            storage_key(&s(&["ceph-pool", "local-lvm"])),
            "ceph-pool+local-lvm"
        );
        assert_eq!(storage_key(&[]), "(no disks)");
        // `disk_storages` sorts, so the key does not depend on disk order.
        let cfg: pve::VmConfig = serde_json::from_value(serde_json::json!({
            "virtio0": "local-lvm:base-1-disk-1", "scsi0": "ceph-pool:base-1-disk-0",
            "scsi1": "local-lvm:base-1-disk-2", "ide2": "none,media=cdrom"
        }))
        .unwrap();
        assert_eq!(storage_key(&cfg.disk_storages()), "ceph-pool+local-lvm");
    }
}
