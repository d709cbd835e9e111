//! VM migration: `POST .../migrate`, offline or online, HA-managed or not,
//! with its disks copied to the target node's storage.
//!
//! Apart from `lifecycle` because migration is the one operation that spans
//! two nodes and their storages: its checks (target node, storage types,
//! local disks and CD-ROMs, room on the target) are its own.

use std::sync::Arc;

use serde_json::json;

use crate::params::Params;
use crate::sim::Shared;
use crate::state::{locked, ApiError, ApiResult};

impl Shared {
    /// `POST .../migrate`. Offline migration moves the stopped VM (its local
    /// disks are copied); a running VM needs `online=1`, and with local disks
    /// also `with-local-disks=1`. HA-managed VMs get an `hamigrate` request.
    pub fn migrate(self: &Arc<Self>, node: &str, vmid: u32, p: &Params) -> ApiResult {
        let target = p.get("target").unwrap_or_default().to_string();
        let online = p.bool("online").unwrap_or(false);
        let with_local = p.bool("with-local-disks").unwrap_or(false);
        let mut c = self.cluster.lock();
        let vm = c.vm_on(node, vmid)?.clone();
        if target == node {
            return Err(ApiError::param("target", "target is local node."));
        }
        match c.nodes.get(&target) {
            None => {
                return Err(ApiError::internal(format!(
                    "no such cluster node '{target}'"
                )))
            }
            Some(n) if !n.online => {
                return Err(ApiError::internal(format!(
                    "target node '{target}' is not online"
                )))
            }
            Some(_) => {}
        }
        if let Some(l) = &vm.lock {
            return Err(ApiError::internal(locked(vmid, l)));
        }
        if vm.running && !online {
            return Err(ApiError::internal(
                "can't migrate running VM without --online",
            ));
        }
        // Local disks go to `targetstorage` (else the same storage id) on
        // the target node, which must have it.
        let to_storage = p
            .get("targetstorage")
            .map_or_else(|| vm.storage.clone(), str::to_string);
        if !vm.shared_storage && self.storage_on(&c, &target, &to_storage).is_none() {
            return Err(ApiError::internal(format!(
                "storage '{to_storage}' does not exist"
            )));
        }
        // QemuMigrate: a CD-ROM image on local storage cannot be moved (a
        // cloud-init drive is regenerated on the target instead).
        let local_iso = vm
            .cdrom_volumes()
            .into_iter()
            .filter(|v| !v.contains("cloudinit"))
            .find(|v| v.split_once(':').is_some_and(|(st, _)| !self.is_shared(st)))
            .map(str::to_string);
        // pve-storage storage_migrate: LVM and LVM-thin import raw block
        // data only, which a file-based storage's qcow2 disk cannot send.
        let incompatible = if vm.shared_storage {
            None
        } else {
            let kind = |n: &str, st: &str| self.storage_on(&c, n, st).map(|i| i.kind);
            match (kind(node, &vm.storage), kind(&target, &to_storage)) {
                (Some(from), Some(to)) if from.is_file_based() && to.is_lvm() => {
                    Some((from.as_str(), to.as_str()))
                }
                _ => None,
            }
        };
        if vm.running && !vm.shared_storage && !with_local {
            return Err(ApiError::internal(format!(
                "can't live migrate attached local disks without with-local-disks option ({})",
                vm.disk()
            )));
        }
        if vm.ha.is_some() {
            let upid = self.spawn_task(
                &mut c,
                node,
                "hamigrate",
                &vmid.to_string(),
                move |me, upid| async move {
                    let mut c = me.cluster.lock();
                    c.task_log(
                        &upid,
                        format!("Requesting HA migration for VM {vmid} to node {target}"),
                    );
                    if let Some(vm) = c.vms.get_mut(&vmid) {
                        vm.node = target;
                    }
                    c.resources_cache = None;
                    Ok("OK".into())
                },
            );
            return Ok(json!(upid));
        }
        let n = node.to_string();
        let kind = if online { "online" } else { "offline" };
        let upid = self.spawn_task(
            &mut c,
            node,
            "qmigrate",
            &vmid.to_string(),
            move |me, upid| async move {
                me.hold_flock(vmid, &n, |vm| match &vm.lock {
                    Some(l) => Err(locked(vmid, l)),
                    None if vm.running && !online => {
                        Err("can't migrate running VM without --online".into())
                    }
                    None => Ok(()),
                })
                .await?;
                {
                    let mut c = me.cluster.lock();
                    if let Some(vm) = c.vms.get_mut(&vmid) {
                        vm.lock = Some("migrate".into());
                    }
                    c.task_log(
                        &upid,
                        format!("starting migration of VM {vmid} to node '{target}'"),
                    );
                }
                // Local disks are copied to the target node first; a target
                // storage without room aborts the migration, leaving the VM
                // where it was.
                let room = if let Some(iso) = &local_iso {
                    Err(format!("can't migrate local disk '{iso}': local cdrom image"))
                } else if let Some((from, to)) = incompatible {
                    Err(format!("cannot migrate from storage type '{from}' to '{to}'"))
                } else {
                    let c = me.cluster.lock();
                    match c.vms.get(&vmid) {
                        Some(vm) if !vm.shared_storage => me
                            .room_for(
                                &c,
                                &target,
                                &to_storage,
                                vmid,
                                &vm.volume(),
                                vm.allocated_bytes(),
                            )
                            .map_err(|e| {
                                format!(
                                    "storage migration for '{}:{}' to storage '{to_storage}' failed - {e}",
                                    vm.storage,
                                    vm.volume()
                                )
                            }),
                        _ => Ok(()),
                    }
                };
                tokio::time::sleep(me.cfg.migrate_duration).await;
                if let Err(why) = room {
                    me.release_flock(vmid, |c| {
                        if let Some(vm) = c.vms.get_mut(&vmid) {
                            vm.lock = None;
                        }
                        c.task_log(&upid, format!("ERROR: migration aborted: {why}"));
                    });
                    return Err("migration aborted".into());
                }
                me.release_flock(vmid, |c| {
                    if let Some(vm) = c.vms.get_mut(&vmid) {
                        vm.lock = None;
                        vm.node = target.clone();
                        if !vm.shared_storage {
                            vm.storage = to_storage.clone();
                        }
                    }
                    c.resources_cache = None;
                    c.task_log(&upid, format!("migration finished successfully ({kind})"));
                });
                Ok("OK".into())
            },
        );
        Ok(json!(upid))
    }
}
