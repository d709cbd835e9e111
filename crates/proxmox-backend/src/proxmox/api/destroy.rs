//! Destroying a VM whose marker the caller checked: stopping it first,
//! destroying it, and reporting the disks the destroy could not free.

use std::sync::atomic::Ordering;

use futures::future::Either;
use pve::{PveClient, PveError, TaskLogLine, Upid};
use tokio::time::Instant;

use super::{err_at, stale_lock_error, Api, LockedVm};
use crate::proxmox::task_watch::Ended;
use crate::substrate::{SubstrateError, VmRef};

/// Lines of a destroy task's log read for the disks it could not free: one
/// line per disk and a few more (`purging VM`, `TASK ...`); a VM of ours has
/// one disk, so this is ample.
const DESTROY_LOG_LINES: u64 = 500;

impl Api {
    /// Stops and destroys a VM whose marker was checked by the caller.
    /// Repeats are harmless (stopping a stopped VM, destroying a gone one),
    /// so transient failures are retried until `deadline`. The caller
    /// forgets the VMID afterwards (it is gone either way on `Ok`).
    ///
    /// `stop_first`: whether to stop it first (a VM known stopped is not).
    /// A VM whose power state is not known is stopped anyway: stopping a
    /// stopped VM is an `OK` task at once (qemu-server's `_do_vm_stop`
    /// returns before anything when no QEMU runs), cheaper than reading its
    /// status first when it usually runs. Whether the HA manager owns it is
    /// told by the stop's own task: `hastop` only queues the request, which
    /// is then waited for.
    pub(in crate::proxmox) async fn destroy(
        &self,
        vm: &VmRef,
        stop_first: bool,
        deadline: Instant,
    ) -> Result<(), SubstrateError> {
        let node = Some(vm.node.as_str());
        // A task of the stop or the destroy finding no config: another
        // destroy of the VM (one a restarted provider left running) got
        // there first. The VM is gone.
        let gone = |e: &PveError| e.is_not_found() || e.is_vm_config_missing(vm.vmid);
        // A destroy PVE accepted while the stop was waited for (see
        // `Api::wait_stop`): the loop below waits for it instead of sending one.
        let mut accepted = None;
        if stop_first {
            tracing::info!(vm = %vm, "stopping VM");
            let mut attempt = 0;
            let ha = loop {
                match self
                    .retry_raw(node, deadline, |pve| pve.stop(&vm.node, vm.vmid))
                    .await
                {
                    Ok(upid) => match self
                        .timed_task(&upid, "stop", self.wait_stop(vm, &upid))
                        .await
                    {
                        Ok(destroy) => {
                            accepted = destroy;
                            break upid.task_type == "hastop";
                        }
                        Err(e) if gone(&e) => return Ok(()),
                        // `VM 104 is locked (backup)` from the worker: the
                        // stop did nothing; a repeated stop is harmless,
                        // unless no task holds the lock (see below).
                        Err(e) if e.is_transient() && Instant::now() < deadline => {
                            if e.is_locked() && !e.is_lock_timeout() {
                                if let Some(lock) = self.stale_lock(vm, deadline).await? {
                                    tracing::warn!(vm = %vm, lock = %lock, "the VM is locked and no task holds the lock; only root can clear it");
                                    return Err(stale_lock_error(vm, &lock, LockedVm::Ours));
                                }
                            }
                            tracing::info!(vm = %vm, error = %e, attempt, "stop task failed transiently; retrying");
                            self.pause(attempt, deadline).await;
                            attempt += 1;
                        }
                        Err(e) => return Err(err_at(format!("stopping VM {vm}"), node, &e)),
                    },
                    Err(e) if e.is_not_found() => return Ok(()),
                    Err(e) => return Err(err_at(format!("stopping VM {vm}"), node, &e)),
                }
            };
            if ha {
                // hastop only queues the request.
                self.wait_status(vm, "stopped", |s| !s.is_running()).await?;
            }
        }
        tracing::info!(vm = %vm, "destroying VM");
        let mut attempt = 0;
        let mut unreferenced_too = true;
        let mut unprotected = false;
        loop {
            let with_unreferenced = unreferenced_too;
            let destroy = |pve| {
                if with_unreferenced {
                    Either::Left(PveClient::destroy(pve, &vm.node, vm.vmid))
                } else {
                    Either::Right(PveClient::destroy_referenced(pve, &vm.node, vm.vmid))
                }
            };
            let sent = match accepted.take() {
                Some(upid) => Ok(upid),
                None => self.retry_raw(node, deadline, destroy).await,
            };
            let failed = match sent {
                Ok(upid) => match self.wait_destroy(&upid).await {
                    Ok(done) => {
                        self.report_unremoved_disks(vm, &upid, done, deadline).await;
                        return Ok(());
                    }
                    // Another destroy of the VM (one a restarted provider
                    // left running) held its config lock and removed the
                    // config before this worker got the lock: `Configuration
                    // file '.../N.conf' does not exist`. The VM is gone.
                    Err(e) if gone(&e) => return Ok(()),
                    Err(e) => e,
                },
                Err(e) if e.is_not_found() || e.is_forbidden() => return Ok(()),
                Err(e) if e.is_protected() => e,
                Err(e) if e.is_locked() && !e.is_lock_timeout() => e,
                Err(e) => return Err(err_at(format!("destroying VM {vm}"), node, &e)),
            };
            // A VM cloned before marking cleared `protection` (PVE copies it
            // from a protected template): the caller proved it ours, so the
            // flag goes, once.
            if failed.is_protected() && !unprotected {
                tracing::info!(vm = %vm, "clearing the protection flag it copied from its template");
                self.clear_protection(vm, deadline).await?;
                unprotected = true;
                continue;
            }
            // `destroy-unreferenced-disks` activates every storage holding
            // images on the node: one out of reach (`is not online`) or
            // hung (`unable to activate storage`, a mount that does not
            // answer) fails the worker after the VM's own disks are freed,
            // leaving its config. What the flag adds (disks of a half-made
            // clone the config never named) is not worth a VM that cannot
            // be destroyed while a storage it never used is down: destroy
            // again without it.
            if unreferenced_too && (failed.is_offline() || failed.is_storage_unavailable()) {
                tracing::warn!(vm = %vm, error = %failed,
                    "a storage of the node is offline or hangs; destroying the VM without looking for unreferenced disks");
                unreferenced_too = false;
                continue;
            }
            // A lock no running task holds stays until root clears it:
            // fail naming the command instead of retrying until the
            // deadline (and again on every Delete after it).
            if failed.is_locked() && !failed.is_lock_timeout() {
                if let Some(lock) = self.stale_lock(vm, deadline).await? {
                    tracing::warn!(vm = %vm, lock = %lock, "the VM is locked and no task holds the lock; only root can clear it");
                    return Err(stale_lock_error(vm, &lock, LockedVm::Ours));
                }
            }
            // PVE checks the VM's lock inside the worker, after the DELETE
            // answered 200: `VM is locked (backup)`, or its config lock
            // still held after 10 s. The worker did nothing, and the lock
            // clears when the other operation ends, so the DELETE is sent
            // again.
            if !failed.is_transient() || Instant::now() >= deadline {
                return Err(err_at(format!("destroying VM {vm}"), node, &failed));
            }
            tracing::info!(vm = %vm, error = %failed, attempt, "destroy task failed transiently; retrying");
            self.pause(attempt, deadline).await;
            attempt += 1;
        }
    }

    /// Waits for stop task `stop` of `vm` to end, or for the VM's destroy
    /// to be accepted, whichever tells first that the VM no longer runs.
    ///
    /// A VM's stop takes about as long each time on a node, and qemu-server
    /// refuses to destroy a VM whose QEMU still runs (`VM N is running -
    /// destroy failed`, checked before the DELETE's worker starts). So
    /// once the node's stops have a learnt length (`Api::stops`), the
    /// destroy is sent then: accepted, the stop has done its part, and the
    /// look at its task is saved (`Some` of the destroy's task); refused as
    /// running, the stop is waited for as any task and the estimate grows.
    /// Anything else the early destroy meets (a lock, a protection flag, a
    /// node not answering) is left to the destroy that follows the stop,
    /// which handles each. `hastop` only queues the stop: always waited.
    async fn wait_stop(&self, vm: &VmRef, stop: &Upid) -> Result<Option<Upid>, PveError> {
        let began = Instant::now();
        let hastop = stop.task_type == "hastop";
        let planned = if hastop {
            None
        } else {
            self.stops.at(&vm.node)
        };
        // Whether how long this stop takes says how long the node's stops
        // take: not when HA only queued it, nor when the early destroy was
        // refused for something else than the VM running.
        let mut telling = !hastop;
        if let Some(at) = planned {
            tokio::time::sleep(at).await;
            // Once: a refusal is the answer sought, not something to retry.
            match self.once(|pve| pve.destroy(&vm.node, vm.vmid)).await {
                Ok(destroy) => {
                    self.stops.learn(&vm.node, Some(at), true, began.elapsed());
                    return Ok(Some(destroy));
                }
                Err(e) if e.is_running_refusal() => {}
                Err(e) => {
                    tracing::debug!(vm = %vm, error = %e, "the destroy sent at the stop's learnt length was refused; waiting for the stop");
                    telling = false;
                }
            }
        }
        let deadline = Instant::now() + self.opts.task_timeout;
        self.tasks.wait(stop, deadline).await?;
        if telling {
            self.stops.learn(&vm.node, planned, false, began.elapsed());
        }
        Ok(None)
    }

    /// Waits for destroy task `upid`, looked at through its log (which
    /// [`Api::report_unremoved_disks`] reads anyway): the look that sees it
    /// end has the log, and no read of its own follows.
    async fn wait_destroy(&self, upid: &Upid) -> Result<Ended, PveError> {
        let deadline = Instant::now() + self.opts.task_timeout;
        let wait = self.tasks.wait_logged(upid, deadline, DESTROY_LOG_LINES);
        self.timed_task(upid, "destroy", wait).await
    }

    /// Reports the disks a successful destroy could not free. qemu-server's
    /// `destroy_vm` goes on past a disk `vdisk_free` fails on (RBD
    /// watchers, an LV or ZFS dataset in use): the VM is gone, the volume
    /// stays. Only the task's log says so: PVE 9 ends the task `WARNINGS:
    /// N`, PVE 8 `OK`. Each such volume gets a WARN (the volume, the task)
    /// and a count in [`Api::unremoved_disks`]; the Delete still succeeds.
    ///
    /// The log is read for every destroy, `OK` too: PVE 8 gives no other
    /// sign, and telling versions apart per node (a cluster being upgraded
    /// runs both) would cost more than it saves. It costs no request of
    /// its own: the destroy is looked at through it ([`Api::wait_destroy`]),
    /// and the look that sees the task end has read it.
    /// Best effort: an unreadable log is a WARN, never a failed Delete.
    async fn report_unremoved_disks(
        &self,
        vm: &VmRef,
        upid: &Upid,
        done: Ended,
        deadline: Instant,
    ) {
        let exit = done.status.exitstatus.as_deref().unwrap_or_default();
        let read = match done.log {
            // The look that saw the destroy end read its log.
            Some(lines) => Ok(lines),
            None => {
                self.retry_raw(Some(&upid.node), deadline, |pve| {
                    pve.task_log(upid, 0, DESTROY_LOG_LINES)
                })
                .await
            }
        };
        let lines = match read {
            Ok(lines) => lines,
            Err(e) => {
                tracing::warn!(vm = %vm, upid = %upid, exit, error = %e,
                    "could not read the log of the destroy task: a disk it could not free would go unreported; look for `Could not remove disk` in that task's log on PVE");
                return;
            }
        };
        for volume in lines.iter().filter_map(TaskLogLine::unremoved_disk) {
            self.unremoved_disks.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(vm = %vm, volume, upid = %upid, exit,
                "PVE destroyed the VM but could not remove one of its disks (still in use: RBD watchers, a busy LV or ZFS dataset); it keeps its space on the storage. Find what holds it, then remove it with `pvesm free <volume>`");
        }
    }

    /// `delete=protection` on a VM whose marker the caller checked.
    async fn clear_protection(&self, vm: &VmRef, deadline: Instant) -> Result<(), SubstrateError> {
        let params = pve::ConfigParams {
            delete: vec!["protection".to_string()],
            ..pve::ConfigParams::default()
        };
        let node = Some(vm.node.as_str());
        self.retry_raw(node, deadline, |pve| {
            pve.set_config_sync(&vm.node, vm.vmid, &params)
        })
        .await
        .map_err(|e| err_at(format!("clearing the protection flag of VM {vm}"), node, &e))
    }
}
