//! VM lifecycle operations: clone, config, start/stop (incl. HA), destroy.
//!
//! One file past 600 lines on purpose: the operations share the lock and
//! task model and their failure modes, which must stay consistent.

use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};

use crate::config::TagStyle;
use crate::params::Params;
use crate::schema::normalize_tags_with;
use crate::sim::{err_text, Shared};
use crate::state::{locked, ApiError, ApiResult, Cluster, Vm};

/// What a clone worker needs; `pending` is the finished VM when the worker
/// creates it (the real timeline), `None` when the POST already did.
struct CloneWork {
    upid: String,
    node: String,
    source: String,
    storage: String,
    shared: bool,
    newid: u32,
    vmid: u32,
    kind: &'static str,
    /// Bytes the new disk takes (0 for a linked clone).
    need: u64,
    pending: Option<Vm>,
}

impl Shared {
    // ---- VM lifecycle ----

    pub fn clone_vm(self: &Arc<Self>, node: &str, vmid: u32, p: &Params) -> ApiResult {
        let newid = p.u64("newid").unwrap_or(0) as u32;
        let mut c = self.cluster.lock();
        let src = c.vm_on(node, vmid)?.clone();
        if let Some(l) = &src.lock {
            return Err(ApiError::internal(locked(vmid, l)));
        }
        if let Some(other) = c.vms.get(&newid) {
            return Err(ApiError::internal(format!(
                "VM {newid} already exists on node '{}'",
                other.node
            )));
        }
        let target = p.get("target").unwrap_or(node).to_string();
        // qemu-server checks a given `storage` before anything else: it must
        // exist, and be shared when the clone goes to another node.
        let target_storage = match p.get("storage") {
            Some(st) => match self.storage_on(&c, node, st) {
                None => return Err(ApiError::internal(format!("storage '{st}' does not exist"))),
                Some(info) if target != node && !info.shared => {
                    return Err(ApiError::internal(format!(
                        "can't clone to non-shared storage '{st}'"
                    )))
                }
                Some(info) => Some(info),
            },
            None => None,
        };
        // qemu-server checks only that the target is a cluster node, not
        // that it is online: a clone to an offline node is accepted and its
        // config lands there, where later calls fail with 595.
        if target != node && !c.nodes.contains_key(&target) {
            return Err(ApiError::internal(format!(
                "no such cluster node '{target}'"
            )));
        }
        // Templates default to linked clones; other VMs to full ones.
        let full = p.bool("full").unwrap_or(!src.template);
        if target_storage.is_some() && !full {
            return Err(ApiError::internal(
                "parameter 'storage' not allowed for linked clones",
            ));
        }
        // qemu-server counts every volume, CD-ROMs included (an ISO on
        // `local`, a cloud-init drive on `local-lvm`); an empty drive or the
        // host's does not.
        let local_cdrom = src.cdrom_storages().iter().any(|st| !self.is_shared(st));
        if target != node && (!src.shared_storage || local_cdrom) {
            return Err(ApiError::internal(format!(
                "can't clone VM to node '{target}' (VM uses local storage)"
            )));
        }
        if !full {
            // A linked clone needs the `clone` volume feature: a template's
            // base volume, on a storage that can snapshot it (not thick LVM).
            let supports = self
                .storage_on(&c, node, &src.storage)
                .is_some_and(|st| st.kind.supports_linked_clones());
            if !src.template || !supports {
                return Err(ApiError::internal(
                    "Linked clone feature is not supported for drive 'scsi0'",
                ));
            }
        }
        let pool = p.get("pool").map(str::to_string);
        if let Some(pool) = &pool {
            if !c.pools.contains_key(pool) {
                return Err(ApiError::internal(format!("pool '{pool}' does not exist")));
            }
        }
        let storage = match &target_storage {
            Some(st) => st.name.clone(),
            None => src.storage.clone(),
        };
        let shared = if storage == src.storage {
            src.shared_storage
        } else {
            self.is_shared(&storage)
        };
        let final_vm = Vm {
            vmid: newid,
            node: target.clone(),
            name: p
                .get("name")
                .map(str::to_string)
                .unwrap_or_else(|| format!("Copy-of-VM-{}", src.name)),
            description: p.get("description").map(str::to_string),
            tags: src.tags.clone(),
            cores: src.cores,
            sockets: src.sockets,
            memory_mib: src.memory_mib,
            agent: src.agent.clone(),
            lock: Some("clone".into()),
            flock: 1,
            template: false,
            running: false,
            started_at: None,
            ha: None,
            // qemu-server copies every key but `template`, `lock` and
            // `pending`: a protected template makes protected clones.
            protection: src.protection,
            pool,
            storage: storage.clone(),
            shared_storage: shared,
            disk_gib: src.disk_gib,
            linked_base: (!full).then_some(vmid),
            extra: src.extra.clone(),
            guest_root: self.guest_root(newid),
        };
        let need = if full { src.disk_gib << 30 } else { 0 };
        // With the real timeline the worker creates the VM; else it exists,
        // finished but locked, from the moment the POST is answered.
        let timeline = self.cfg.clone_timeline;
        let pending = if timeline {
            Some(final_vm)
        } else {
            c.vms.insert(newid, final_vm);
            // pvestatd has no sample of the new VM yet (see `SimConfig::rrd_lag`).
            c.created.insert(newid, Instant::now());
            c.rrd.remove(&newid);
            None
        };
        let kind = if full { "full" } else { "linked" };
        let source = node.to_string();
        let upid = self.spawn_task(
            &mut c,
            node,
            "qmclone",
            &vmid.to_string(),
            move |me, upid| async move {
                let w = CloneWork {
                    upid,
                    node: target,
                    source,
                    storage,
                    shared,
                    newid,
                    vmid,
                    kind,
                    need,
                    pending,
                };
                me.clone_worker(w).await
            },
        );
        c.task_log(
            &upid,
            format!("create {kind} clone of drive scsi0 ({})", src.disk()),
        );
        self.touch(&mut c);
        Ok(json!(upid))
    }

    async fn clone_worker(self: Arc<Self>, w: CloneWork) -> Result<String, String> {
        let CloneWork {
            upid,
            node,
            source,
            storage,
            shared,
            newid,
            vmid,
            kind,
            need,
            pending,
        } = w;
        if self.cfg.keep_failed_clone && pending.is_none() {
            if let Some(msg) = self.faults.take_task_failure("qmclone") {
                tokio::time::sleep(self.cfg.clone_duration).await;
                // The worker's lock goes with it; the config stays.
                self.update_vm(newid, |vm| {
                    vm.lock = None;
                    vm.flock = 0;
                });
                return Err(msg.replace("{newid}", &newid.to_string()));
            }
        }
        if let Some(msg) = self.faults.take_task_failure("qmclone") {
            // A collision found before the worker created anything of its own.
            let mut c = self.cluster.lock();
            if pending.is_none() {
                c.vms.remove(&newid);
                c.agents.remove(&newid);
            }
            return Err(msg.replace("{newid}", &newid.to_string()));
        }
        if pending.is_some() {
            // qemu-server: lock the new id (1 s), then create the temporary
            // config on the source node; a VMID taken meanwhile fails here.
            let mut c = self.cluster.lock();
            if c.vms.contains_key(&newid) {
                return Err(format!(
                    "unable to create VM {newid}: config file already exists"
                ));
            }
            let mut temp = self.blank_vm(newid, &source);
            temp.lock = Some("clone".into());
            temp.flock = 1;
            temp.storage = storage.clone();
            temp.shared_storage = shared;
            c.vms.insert(newid, temp);
            c.created.insert(newid, Instant::now());
            c.rrd.remove(&newid);
            self.touch(&mut c);
        }
        {
            // The new disk is allocated first, on the source node (a clone
            // to another node is on shared storage): no room fails the
            // worker, which removes what it made.
            let mut c = self.cluster.lock();
            let vol = format!("vm-{newid}-disk-0");
            if let Err(text) = self.room_for(&c, &source, &storage, newid, &vol, need) {
                c.vms.remove(&newid);
                c.agents.remove(&newid);
                self.touch(&mut c);
                return Err(format!("clone failed: {text}"));
            }
        }
        let key = (node, storage.clone());
        let limit = if shared {
            self.cfg.max_parallel_shared_clones
        } else {
            self.cfg.max_parallel_local_clones
        };
        let over = {
            let mut c = self.cluster.lock();
            let n = c.active_clones.entry(key.clone()).or_default();
            *n += 1;
            limit.is_some_and(|l| *n > l)
        };
        let wait = if over {
            self.cfg.storage_lock_wait
        } else {
            self.cfg.clone_duration
        };
        tokio::time::sleep(wait).await;
        let mut c = self.cluster.lock();
        if let Some(n) = c.active_clones.get_mut(&key) {
            *n = n.saturating_sub(1);
        }
        if over {
            // PVE removes the half-created VM when the clone worker fails.
            c.vms.remove(&newid);
            c.agents.remove(&newid);
            let _ = std::fs::remove_dir_all(self.guest_root(newid)); // scratch only
            let msg = if shared {
                format!(
                    "clone failed: cfs-lock 'storage-{storage}' error: got lock request timeout"
                )
            } else {
                format!("clone failed: can't lock file '/var/lock/pve-manager/pve-storage-{storage}' - got timeout")
            };
            return Err(msg);
        }
        if let Some(mut done) = pending {
            // The end of the worker: the full config (name, description,
            // sizing) is written, moved to the target node, and the VM joins
            // its pool.
            done.lock = None;
            done.flock = 0;
            c.vms.insert(newid, done);
        } else if let Some(vm) = c.vms.get_mut(&newid) {
            vm.lock = None;
            vm.flock = vm.flock.saturating_sub(1);
        }
        c.task_log(
            &upid,
            format!("{kind} clone of VM {vmid} to {newid} finished"),
        );
        Ok("OK".into())
    }

    /// Datacenter `user-tag-access`: setting a tag the VM does not carry yet
    /// needs the policy's leave, else `Sys.Modify` on `/`.
    fn check_tag_access(&self, c: &Cluster, vmid: u32, p: &Params) -> ApiResult<()> {
        let Some(raw) = p.get("tags") else {
            return Ok(());
        };
        if self.holds("/", "Sys.Modify") {
            return Ok(());
        }
        let have: Vec<String> = c
            .vms
            .get(&vmid)
            .and_then(|vm| vm.tags.clone())
            .map(|t| t.split(';').map(str::to_string).collect())
            .unwrap_or_default();
        let in_use = |tag: &str| {
            c.vms.values().any(|vm| {
                vm.tags
                    .as_deref()
                    .is_some_and(|t| t.split(';').any(|x| x == tag))
            })
        };
        let wanted = normalize_tags_with(raw, self.cfg.tag_style);
        for tag in wanted.split(';').filter(|t| !t.is_empty()) {
            if !have.iter().any(|h| h == tag) && !self.cfg.tag_access.allows(tag, &in_use) {
                return Err(ApiError::Status(
                    403,
                    "Permission check failed (/, Sys.Modify)".into(),
                ));
            }
        }
        Ok(())
    }

    pub async fn update_config_sync(&self, node: &str, vmid: u32, p: &Params) -> ApiResult {
        {
            let c = self.cluster.lock();
            c.vm_on(node, vmid)?;
            self.check_tag_access(&c, vmid, p)?;
        }
        let node = node.to_string();
        self.with_flock(vmid, |c| {
            let vm = c.vm_on_mut(&node, vmid).map_err(err_text)?;
            apply_config(vm, p, self.cfg.tag_style)
        })
        .await
        .map_err(ApiError::internal)?;
        Ok(Value::Null)
    }

    pub fn update_config_async(self: &Arc<Self>, node: &str, vmid: u32, p: &Params) -> ApiResult {
        let mut c = self.cluster.lock();
        c.vm_on(node, vmid)?;
        self.check_tag_access(&c, vmid, p)?;
        let p = p.clone();
        let n = node.to_string();
        let upid = self.spawn_task(
            &mut c,
            node,
            "qmconfig",
            &vmid.to_string(),
            move |me, _| async move {
                tokio::time::sleep(me.cfg.config_task_duration).await;
                me.with_flock(vmid, |c| {
                    let vm = c.vm_on_mut(&n, vmid).map_err(err_text)?;
                    apply_config(vm, &p, me.cfg.tag_style)
                })
                .await?;
                Ok("OK".into())
            },
        );
        Ok(json!(upid))
    }

    pub fn start(self: &Arc<Self>, node: &str, vmid: u32, p: &Params) -> ApiResult {
        let skiplock = p.bool("skiplock").unwrap_or(false);
        let mut c = self.cluster.lock();
        let vm = c.vm_on(node, vmid)?;
        if vm.template {
            return Err(ApiError::internal(
                "you can't start a vm if it's a template",
            ));
        }
        if vm.ha.is_some() {
            return Ok(json!(self.ha_request(&mut c, node, vmid, "started")));
        }
        let n = node.to_string();
        let upid = self.spawn_task(
            &mut c,
            node,
            "qmstart",
            &vmid.to_string(),
            move |me, _| async move {
                me.hold_flock(vmid, &n, |vm| {
                    if let (Some(l), false) = (&vm.lock, skiplock) {
                        return Err(locked(vmid, l));
                    }
                    if vm.running {
                        return Err(format!("VM {vmid} already running"));
                    }
                    Ok(())
                })
                .await?;
                tokio::time::sleep(me.cfg.start_duration).await;
                me.release_flock(vmid, |c| {
                    if let Some(vm) = c.vms.get_mut(&vmid) {
                        vm.running = true;
                        vm.started_at = Some(Instant::now());
                    }
                    c.agents.remove(&vmid);
                });
                Ok("OK".into())
            },
        );
        Ok(json!(upid))
    }

    /// `qmstop` or `qmshutdown` (modelled alike); HA-managed VMs get `hastop`.
    pub fn stop(self: &Arc<Self>, node: &str, vmid: u32, p: &Params, kind: &str) -> ApiResult {
        let mut c = self.cluster.lock();
        let vm = c.vm_on(node, vmid)?;
        if vm.ha.is_some() {
            return Ok(json!(self.ha_request(&mut c, node, vmid, "stopped")));
        }
        let skiplock = p.bool("skiplock").unwrap_or(false);
        let n = node.to_string();
        let upid = self.spawn_task(
            &mut c,
            node,
            kind,
            &vmid.to_string(),
            move |me, _| async move {
                me.hold_flock(vmid, &n, |vm| match &vm.lock {
                    Some(l) if !skiplock => Err(locked(vmid, l)),
                    _ => Ok(()),
                })
                .await?;
                tokio::time::sleep(me.cfg.stop_duration).await;
                me.release_flock(vmid, |c| {
                    if let Some(vm) = c.vms.get_mut(&vmid) {
                        vm.running = false;
                        vm.started_at = None;
                    }
                    c.agents.remove(&vmid);
                });
                Ok("OK".into())
            },
        );
        Ok(json!(upid))
    }

    /// hastart/hastop only queue a request for the HA manager; the VM changes
    /// state `ha_delay` after the task ended.
    fn ha_request(
        self: &Arc<Self>,
        c: &mut Cluster,
        node: &str,
        vmid: u32,
        state: &'static str,
    ) -> String {
        let kind = if state == "started" {
            "hastart"
        } else {
            "hastop"
        };
        let upid = self.spawn_task(
            c,
            node,
            kind,
            &vmid.to_string(),
            move |me, upid| async move {
                {
                    let mut c = me.cluster.lock();
                    if let Some(vm) = c.vms.get_mut(&vmid) {
                        vm.ha = Some(state.to_string());
                    }
                    c.task_log(&upid, format!("Requesting HA {} for VM {vmid}", &kind[2..]));
                }
                let me2 = Arc::clone(&me);
                tokio::spawn(async move {
                    tokio::time::sleep(me2.cfg.ha_delay).await;
                    let mut c = me2.cluster.lock();
                    if let Some(vm) = c.vms.get_mut(&vmid) {
                        if vm.ha.as_deref() == Some(state) {
                            let run = state == "started";
                            if vm.running != run {
                                vm.running = run;
                                vm.started_at = run.then(Instant::now);
                                c.agents.remove(&vmid);
                            }
                        }
                    }
                    me2.touch(&mut c);
                });
                Ok("OK".into())
            },
        );
        upid
    }

    pub fn destroy(self: &Arc<Self>, node: &str, vmid: u32, p: &Params) -> ApiResult {
        let mut c = self.cluster.lock();
        let vm = c.vm_on(node, vmid)?;
        // PVE checks the VM's lock only in the worker (qemu-server
        // `destroy_vm`: `check_lock`), so a locked VM's DELETE answers 200.
        let skiplock = p.bool("skiplock").unwrap_or(false);
        if vm.protection {
            return Err(ApiError::internal(format!(
                "can't remove VM {vmid} - protection mode enabled"
            )));
        }
        if vm.running {
            return Err(ApiError::internal(format!(
                "VM {vmid} is running - destroy failed"
            )));
        }
        if vm.ha.is_some() && !p.bool("purge").unwrap_or(false) {
            return Err(ApiError::internal(format!(
                "unable to remove VM {vmid} - used in HA resources and purge parameter not set."
            )));
        }
        let disk = vm.disk();
        let n = node.to_string();
        let unreferenced = p.bool("destroy-unreferenced-disks").unwrap_or(false);
        let upid = self.spawn_task(
            &mut c,
            node,
            "qmdestroy",
            &vmid.to_string(),
            move |me, upid| async move {
                me.hold_flock(vmid, &n, |vm| {
                    if vm.running {
                        return Err(format!("VM {vmid} is running - destroy failed"));
                    }
                    match (&vm.lock, skiplock) {
                        // pve-guest-common `check_lock`: no VMID in the text.
                        (Some(l), false) => Err(format!("VM is locked ({l})")),
                        _ => Ok(()),
                    }
                })
                .await?;
                let in_use = {
                    let c = me.cluster.lock();
                    let base = c.vms.get(&vmid).filter(|v| v.template).map(Vm::disk);
                    base.filter(|_| c.vms.values().any(|v| v.linked_base == Some(vmid)))
                };
                if let Some(disk) = in_use {
                    me.release_flock(vmid, |_| {});
                    let volid = disk.split(',').next().unwrap_or_default().to_string();
                    return Err(format!(
                        "base volume '{volid}' is still in use by linked cloned"
                    ));
                }
                tokio::time::sleep(me.cfg.destroy_duration).await;
                // qemu-server `destroy_vm`: the VM's own disks are freed
                // first; `destroy-unreferenced-disks` then lists every
                // storage holding images, activating each, and one that
                // cannot be activated kills the worker before the config
                // is removed.
                let offline = me.offline_storages_on(&n);
                if let (true, Some(storage)) = (unreferenced, offline.first()) {
                    me.release_flock(vmid, |c| {
                        if let Some(vm) = c.vms.get_mut(&vmid) {
                            vm.disk_gib = 0;
                        }
                        c.task_log(
                            &upid,
                            format!("Removing image: 100% complete...done. ({disk})"),
                        );
                    });
                    return Err(format!("storage '{storage}' is not online"));
                }
                let root = me.guest_root(vmid);
                me.release_flock(vmid, |c| {
                    c.vms.remove(&vmid);
                    c.agents.remove(&vmid);
                    // Under the state lock so a re-used VMID never loses its new root.
                    // Best effort: it is only scratch space.
                    let _ = std::fs::remove_dir_all(&root);
                    c.task_log(
                        &upid,
                        format!("Removing image: 100% complete...done. ({disk})"),
                    );
                    c.task_log(
                        &upid,
                        format!("purging VM {vmid} from related configurations.."),
                    );
                });
                Ok("OK".into())
            },
        );
        Ok(json!(upid))
    }
}

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

    /// `POST .../template`: convert a stopped VM into a template.
    pub fn convert_to_template(self: &Arc<Self>, node: &str, vmid: u32, p: &Params) -> ApiResult {
        let mut c = self.cluster.lock();
        let vm = c.vm_on(node, vmid)?;
        if let Some(l) = &vm.lock {
            return Err(ApiError::internal(locked(vmid, l)));
        }
        if vm.template && !p.contains("disk") {
            return Err(ApiError::internal(
                "you can't convert a template to a template",
            ));
        }
        if vm.running {
            return Err(ApiError::internal(
                "you can't convert a VM to template if VM is running",
            ));
        }
        let n = node.to_string();
        let upid = self.spawn_task(
            &mut c,
            node,
            "qmtemplate",
            &vmid.to_string(),
            move |me, _| async move {
                me.hold_flock(vmid, &n, |vm| {
                    if vm.running {
                        return Err("you can't convert a VM to template if VM is running".into());
                    }
                    Ok(())
                })
                .await?;
                me.release_flock(vmid, |c| {
                    if let Some(vm) = c.vms.get_mut(&vmid) {
                        vm.template = true;
                    }
                });
                Ok("OK".into())
            },
        );
        Ok(json!(upid))
    }
}

/// Apply a validated config update like qemu-server's update_vm_api.
fn apply_config(vm: &mut Vm, p: &Params, tag_style: TagStyle) -> Result<(), String> {
    let skiplock = p.bool("skiplock").unwrap_or(false);
    if let (Some(l), false) = (&vm.lock, skiplock) {
        // Setting or clearing `lock` itself is how operators fix leftovers.
        if !p.contains("lock") && !p.get("delete").is_some_and(|d| d.contains("lock")) {
            return Err(locked(vm.vmid, l));
        }
    }
    if let Some(d) = p.get("digest") {
        if d != vm.digest() {
            return Err(
                "detected modified configuration - file changed by other user? Try again.".into(),
            );
        }
    }
    if let Some(del) = p.get("delete") {
        for key in del
            .split(|c: char| c == ',' || c == ';' || c.is_whitespace())
            .filter(|s| !s.is_empty())
        {
            match key {
                "description" => vm.description = None,
                "tags" => vm.tags = None,
                "lock" => vm.lock = None,
                "protection" => vm.protection = false,
                "cores" => vm.cores = 1,
                "sockets" => vm.sockets = 1,
                "memory" => vm.memory_mib = 512,
                "agent" => vm.agent = "0".into(),
                other => {
                    vm.extra.remove(other);
                }
            }
        }
    }
    for (k, vals) in &p.0 {
        let Some(v) = vals.first() else { continue };
        match k.as_str() {
            "node" | "vmid" | "digest" | "delete" | "skiplock" | "revert" | "background_delay"
            | "force" => {}
            "cores" => vm.cores = v.parse().map_err(|_| format!("invalid cores '{v}'"))?,
            "sockets" => vm.sockets = v.parse().map_err(|_| format!("invalid sockets '{v}'"))?,
            "memory" => {
                let first = v.split(',').next().unwrap_or("");
                let n = first.strip_prefix("current=").unwrap_or(first);
                vm.memory_mib = n.parse().map_err(|_| format!("invalid memory '{v}'"))?;
            }
            "description" => vm.description = Some(v.clone()),
            "tags" => {
                let t = normalize_tags_with(v, tag_style);
                vm.tags = (!t.is_empty()).then_some(t);
            }
            "name" => vm.name = v.clone(),
            "agent" => vm.agent = v.clone(),
            "lock" => vm.lock = Some(v.clone()),
            "protection" => vm.protection = crate::params::parse_bool(v).unwrap_or(false),
            "template" => vm.template = crate::params::parse_bool(v).unwrap_or(false),
            other => {
                vm.extra.insert(other.to_string(), v.clone());
            }
        }
    }
    Ok(())
}
