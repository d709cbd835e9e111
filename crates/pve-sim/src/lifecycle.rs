//! VM lifecycle operations: clone, start/stop/shutdown (incl. HA), destroy
//! and conversion to a template, each answered with the UPID of the worker
//! task that does it.
//!
//! Config updates (`vm_config`) and migration (`migrate`) share the lock and
//! task model these use (in `sim`) but none of their checks, so each has a
//! file of its own; what stays here is creating, powering and removing a
//! VM.

use std::sync::Arc;
use std::time::Instant;

use serde_json::json;

use crate::config::LINKED_CLONE_TIME;
use crate::params::Params;
use crate::sim::{LeftoverVolume, Shared};
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
        // qemu-server `clone_vm` checks a given `storage` before anything
        // else (`storage_check_enabled`): it must exist and be enabled on
        // the node the call runs on, the template's, even when the clone
        // goes elsewhere (a shared storage whose `nodes` list leaves the
        // template's node out fails here); then enabled on the target, and
        // shared.
        let enabled_on = |n: &str, st: &str| -> ApiResult<()> {
            match self.storage_on(&c, n, st) {
                Some(info) if !info.enabled => Err(ApiError::internal(format!(
                    "storage '{st}' is not available on node '{n}'"
                ))),
                _ => Ok(()),
            }
        };
        if let Some(st) = p.get("storage") {
            enabled_on(node, st)?;
            if target != node {
                enabled_on(&target, st)?;
            }
        }
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
        if let Some(t) = c.tasks.get_mut(&upid) {
            t.newid = Some(newid);
        }
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
        let bandwidth = rate_of(&self.cfg.storage_bandwidth, &storage);
        // The new disk is allocated first, on the source node (a clone to
        // another node is on shared storage): no room, or no storage lock
        // in time, fails the worker, which removes what it made.
        let refused = {
            let c = self.cluster.lock();
            let vol = format!("vm-{newid}-disk-0");
            self.room_for(&c, &source, &storage, newid, &vol, need)
                .err()
                .map(|text| format!("clone failed: {text}"))
        };
        let refused = match refused {
            None if bandwidth.is_some() && need > 0 && !self.cfg.volume_alloc_time.is_zero() => {
                self.allocate_volume(&source, &storage, shared).await.err()
            }
            refused => refused,
        };
        if let Some(msg) = refused {
            let mut c = self.cluster.lock();
            c.vms.remove(&newid);
            c.agents.remove(&newid);
            self.touch(&mut c);
            return Err(msg);
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
        match (over, bandwidth) {
            (true, _) => tokio::time::sleep(self.cfg.storage_lock_wait).await,
            (false, Some(_)) if need == 0 => tokio::time::sleep(LINKED_CLONE_TIME).await,
            (false, Some(bw)) => self.copy_at(bw, need, &key, shared, &upid).await,
            (false, None) => tokio::time::sleep(self.cfg.clone_duration).await,
        }
        let mut c = self.cluster.lock();
        if let Some(n) = c.active_clones.get_mut(&key) {
            *n = n.saturating_sub(1);
        }
        if over {
            // PVE removes the half-created VM when the clone worker fails.
            c.vms.remove(&newid);
            c.agents.remove(&newid);
            let _ = std::fs::remove_dir_all(self.guest_root(newid)); // scratch only
            return Err(storage_lock_timeout(&storage, shared));
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

    /// Allocates a full clone's volume on `storage` from `node`, holding
    /// the storage's lock for [`crate::SimConfig::volume_alloc_time`]:
    /// pve-storage's `vdisk_alloc` takes the cluster-wide `cfs-lock` of a
    /// shared storage and the node's lock file of a local one, and gives up
    /// after the lock timeout with the message PVE prints.
    async fn allocate_volume(&self, node: &str, storage: &str, shared: bool) -> Result<(), String> {
        let name = if shared {
            format!("storage-{storage}")
        } else {
            format!("{node}/pve-storage-{storage}")
        };
        let lock = Arc::clone(self.storage_locks.lock().entry(name).or_default());
        let Ok(_held) = tokio::time::timeout(self.cfg.storage_lock_timeout, lock.lock()).await
        else {
            return Err(storage_lock_timeout(storage, shared));
        };
        tokio::time::sleep(self.cfg.volume_alloc_time).await;
        Ok(())
    }

    /// Copies `bytes` onto the storage of `key` at `bandwidth` bytes per
    /// second shared evenly among the full clones writing there now (every
    /// node's, for a shared storage), re-counted every tick, and at most
    /// the storage's stream bandwidth for one copy: the model of a storage
    /// whose throughput, not a lock, bounds parallel clones.
    ///
    /// As it goes it logs what qemu-server's `qemu-img convert -p` parser
    /// prints into the clone's task log, a line each whole percent
    /// (qemu-img reports every 1 %).
    async fn copy_at(
        &self,
        bandwidth: u64,
        bytes: u64,
        key: &(String, String),
        shared: bool,
        upid: &str,
    ) {
        const TICK: std::time::Duration = std::time::Duration::from_millis(20);
        let stream = rate_of(&self.cfg.storage_stream_bandwidth, &key.1)
            .map_or(f64::INFINITY, |bw| bw as f64);
        let mut left = bytes as f64;
        let mut last = Instant::now();
        let mut logged = None;
        let mut log_progress = |left: f64| {
            let percent = (100.0 * (1.0 - left.max(0.0) / bytes as f64)).clamp(0.0, 100.0);
            if logged.is_some_and(|at: f64| percent.floor() <= at.floor()) {
                return;
            }
            logged = Some(percent);
            self.cluster
                .lock()
                .task_log(upid, copy_progress_line(bytes, percent));
        };
        log_progress(left);
        while left > 0.0 {
            tokio::time::sleep(TICK).await;
            let writers = {
                let c = self.cluster.lock();
                c.active_clones
                    .iter()
                    .filter(|((n, st), _)| *st == key.1 && (shared || *n == key.0))
                    .map(|(_, n)| *n)
                    .sum::<usize>()
                    .max(1)
            };
            let now = Instant::now();
            let rate = (bandwidth as f64 / writers as f64).min(stream);
            left -= rate * (now - last).as_secs_f64();
            last = now;
            log_progress(left);
        }
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
                    // qemu-server `config_to_command`: `maxcpus` is
                    // `sockets` x `cores`, refused past the node's CPUs;
                    // `-smp vcpus,...,maxcpus=N` with more `vcpus` than
                    // that is QEMU's refusal.
                    let allowed = me.cfg.node_cpus;
                    if vm.max_vcpus() > allowed {
                        return Err(format!("MAX {allowed} vcpus allowed per VM on this node"));
                    }
                    if vm.vcpus() > vm.max_vcpus() {
                        return Err(format!(
                            "start failed: QEMU exited with code 1 (kvm: Invalid CPU topology: \
                             maxcpus must be equal to or greater than smp: sockets ({}) * cores ({}) < smp ({}))",
                            vm.sockets, vm.cores, vm.vcpus()
                        ));
                    }
                    Ok(())
                })
                .await?;
                // Mapped PCI devices are reserved before QEMU runs (see
                // `Shared::reserve_pci`); held until the worker ends.
                let _pci = me
                    .reserve_pci(vmid, &n)
                    .inspect_err(|_| me.release_flock(vmid, |_| {}))?;
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
                // qemu-server's `_do_vm_stop` returns at once, lock or no
                // lock, when no QEMU runs: a stopped VM's stop is `OK`.
                let mut was_running = false;
                me.hold_flock(vmid, &n, |vm| {
                    was_running = vm.running;
                    match &vm.lock {
                        Some(l) if !skiplock && vm.running => Err(locked(vmid, l)),
                        _ => Ok(()),
                    }
                })
                .await?;
                if was_running {
                    tokio::time::sleep(me.cfg.stop_duration).await;
                }
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
                // qemu-server `destroy_vm` frees the VM's own disks first;
                // one that cannot be freed (busy) is a warning, not an
                // error: the volume stays and the destroy goes on.
                let (volid, bytes, busy) = {
                    let c = me.cluster.lock();
                    match c.vms.get(&vmid) {
                        Some(vm) => {
                            let volid = format!("{}:{}", vm.storage, vm.volume());
                            let busy = me.busy_free_error(&c, &n, &vm.storage, vmid, &vm.volume());
                            (volid, vm.allocated_bytes(), busy)
                        }
                        None => (String::new(), 0, None),
                    }
                };
                // PVE 9 warns through `log_warn` (a `WARN: ` prefix, and
                // the task ends `WARNINGS: N`); PVE 8 through Perl's `warn`
                // (the bare text, and the task ends `OK`).
                let pve9 = me.cfg.pve9;
                let warn_line = |text: String| {
                    if pve9 {
                        format!("WARN: {text}")
                    } else {
                        text
                    }
                };
                let mut log = vec![match &busy {
                    Some(why) => warn_line(format!(
                        "Could not remove disk '{volid}', check manually: {why}"
                    )),
                    None => format!("Removing image: 100% complete...done. ({disk})"),
                }];
                // `destroy-unreferenced-disks` then lists every storage
                // holding images, activating each, and one that cannot be
                // activated kills the worker before the config is removed.
                // pve-storage's `activate_storage`: an offline storage says
                // so; a hung mount does not answer `-d` within 2 s.
                let unreachable = me
                    .offline_storages_on(&n)
                    .first()
                    .map(|storage| format!("storage '{storage}' is not online"))
                    .or_else(|| {
                        me.hung_storages_on(&n).first().map(|storage| {
                            format!(
                                "unable to activate storage '{storage}' - directory \
                                 '/mnt/pve/{storage}' does not exist or is unreachable"
                            )
                        })
                    });
                if let (true, Some(why)) = (unreferenced, unreachable) {
                    me.release_flock(vmid, |c| {
                        if let (Some(vm), None) = (c.vms.get_mut(&vmid), &busy) {
                            vm.disk_gib = 0;
                        }
                        for line in log {
                            c.task_log(&upid, line);
                        }
                    });
                    return Err(why);
                }
                // The unreferenced-disk pass finds the volume still there
                // (it is the VM's) and fails to free it again: a second
                // warning, the bare error.
                if let (true, Some(why)) = (unreferenced, &busy) {
                    log.push(warn_line(why.clone()));
                }
                let warnings = if busy.is_some() { log.len() } else { 0 };
                let root = me.guest_root(vmid);
                me.release_flock(vmid, |c| {
                    c.vms.remove(&vmid);
                    c.agents.remove(&vmid);
                    // Under the state lock so a re-used VMID never loses its new root.
                    // Best effort: it is only scratch space.
                    let _ = std::fs::remove_dir_all(&root);
                    if busy.is_some() {
                        let storage = volid.split(':').next().unwrap_or_default().to_string();
                        me.leftover_volumes.lock().push(LeftoverVolume {
                            node: n.clone(),
                            storage,
                            volid: volid.clone(),
                            bytes,
                        });
                    }
                    for line in log {
                        c.task_log(&upid, line);
                    }
                    c.task_log(
                        &upid,
                        format!("purging VM {vmid} from related configurations.."),
                    );
                });
                if pve9 && warnings > 0 {
                    return Ok(format!("WARNINGS: {warnings}"));
                }
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

/// The rate a `STORAGE=RATE` list gives `storage`, if it names it.
fn rate_of(rates: &[(String, u64)], storage: &str) -> Option<u64> {
    rates
        .iter()
        .find(|(name, _)| name == storage)
        .map(|(_, rate)| *rate)
}

/// How a clone worker fails when its storage's lock did not come in time
/// (pve-cluster `cfs_lock` for a shared storage, pve-common `lock_file`
/// for a local one).
fn storage_lock_timeout(storage: &str, shared: bool) -> String {
    if shared {
        format!("clone failed: cfs-lock 'storage-{storage}' error: got lock request timeout")
    } else {
        format!(
            "clone failed: can't lock file '/var/lock/pve-manager/pve-storage-{storage}' - got timeout"
        )
    }
}

/// A line of a full clone's task log as qemu-server prints qemu-img's
/// progress: `transferred 204.8 MiB of 2.0 GiB (10.00%)` (`QemuImage::convert`,
/// sizes by `PVE::Format::render_bytes` at one decimal).
fn copy_progress_line(size: u64, percent: f64) -> String {
    let transferred = (size as f64 * percent / 100.0) as u64;
    format!(
        "transferred {} of {} ({percent:.2}%)",
        render_bytes(transferred),
        render_bytes(size)
    )
}

/// `PVE::Format::render_bytes($value, 1)`: the largest binary unit the
/// value reaches, one decimal.
fn render_bytes(value: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = value as f64;
    let mut unit = 0;
    if value > 1023 {
        unit = ((v.ln() / 1024f64.ln()) as usize).min(UNITS.len() - 1);
        v /= 1024f64.powi(unit as i32);
    }
    format!("{v:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As `PVE::Format::render_bytes($v, 1)` and qemu-server's parser print.
    #[test]
    fn progress_lines_read_as_pves() {
        assert_eq!(render_bytes(0), "0.0 B");
        assert_eq!(render_bytes(1023), "1023.0 B");
        assert_eq!(render_bytes(1024), "1.0 KiB");
        assert_eq!(render_bytes(2 << 30), "2.0 GiB");
        assert_eq!(
            copy_progress_line(2 << 30, 10.0),
            "transferred 204.8 MiB of 2.0 GiB (10.00%)"
        );
        assert_eq!(
            copy_progress_line(32 << 30, 100.0),
            "transferred 32.0 GiB of 32.0 GiB (100.00%)"
        );
    }
}
