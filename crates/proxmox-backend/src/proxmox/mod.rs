//! The real substrate: a Proxmox VE cluster driven through the `pve` API client.
//!
//! Past 600 lines on purpose: this is the `Substrate` impl, one method per
//! lifecycle step; the pieces they share live in the sibling modules.
//!
//! Cost model (API calls per operation, independent of cluster size):
//! Create = 1 inventory read + 1 `nextid` + clone + task polls + 1 config PUT +
//! start + task polls + agent pings, + 1 storage status read per full clone
//! (the room check). The first Create per template also reads the
//! template's config once (disk storages and sizes), the first cross-node
//! one the template node's storage list (shared or local); a Create served
//! by a per-node replica reads the template's config each time (its digest
//! tells a fresh replica from a stale one), and the one that stages it adds
//! clone + migrate + template conversion and their task polls (`replica`);
//! Configure/Drain =
//! status + ping + exec + exec-status polls; Delete = status + config (the
//! marker is the ownership proof) + stop + destroy + task polls; a
//! reconcile pass = 1 inventory read plus config reads only for marked VMs that
//! are new or whose tags/name changed since the last pass.
//!
//! Transient failures (595/596/597, 502-504, refused or reset connections,
//! timeouts, an offline node, a template locked by a backup) are retried with
//! backoff within [`PveOptions::retry_window`]. Nothing is destroyed unless
//! its description marker names the machine; under a pool-scoped token a 403
//! on a VM is told apart (gone, or not ours) with `GET /cluster/nextid?vmid=N`.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use providerkit::ErrorKind;
use pve::{PveClient, PveError, Upid, VmStatus};
use rand::Rng;
use tokio::sync::{Mutex as AsyncMutex, OnceCell, Semaphore};
use tokio::time::Instant;

use crate::redact::Redactor;
use crate::substrate::{CloneRequest, ManagedVm, Substrate, SubstrateError, VmRef};
use guest::{exec_err, exec_outcome, exec_outcome_redacted, exec_outcome_with, ExecError};
use inventory::Known;
use marker::machine_tag;

use vmid::VmidState;

mod clone;
mod guest;
mod inventory;
mod late;
mod marker;
mod options;
mod placement;
mod preflight;
mod replica;
mod vmid;

pub use marker::{
    marker_description, owned_by, parse_marker, parse_marker_operation, vm_name, MANAGED_TAG,
};
pub use options::{parse_node_storage, parse_vmid_range, CloneMode, PveOptions};
pub use replica::{parse_replica_marker, replica_description, REPLICA_TAG};

/// The real Proxmox substrate.
pub struct PveSubstrate {
    client: PveClient,
    opts: PveOptions,
    /// vmid -> what we know; refreshed by every inventory read.
    index: Mutex<HashMap<u32, Known>>,
    /// Template vmid -> node it lives on.
    templates: Mutex<HashMap<u32, String>>,
    /// Template vmid -> clone-slot storage key of its disks, read once per
    /// template (failed reads are not cached).
    template_storage: Mutex<HashMap<u32, Arc<OnceCell<String>>>>,
    /// VMs whose clone we started, by machine id (covers a stale inventory).
    pending: Mutex<HashMap<String, VmRef>>,
    vmids: Mutex<VmidState>,
    /// Serialises VMID choice so two clones never probe for the same id.
    vmid_choice: AsyncMutex<()>,
    /// One Create per machine id at a time.
    creating: Mutex<HashMap<String, Arc<AsyncMutex<()>>>>,
    /// Clone slots per (target node, storage key).
    clone_slots: Mutex<HashMap<(String, String), Arc<Semaphore>>>,
    /// The cluster's `user-tag-access` refused a per-machine tag: VMs are
    /// marked by their description marker only (the ownership proof anyway).
    tags_restricted: AtomicBool,
    /// Readiness probes since the last Configure, by VMID: what a readiness
    /// timeout's `last_error` quotes.
    probes: Mutex<HashMap<u32, Probes>>,
    /// Clone sources (template or per-node replica) and storage room.
    placement: placement::PlacementState,
}

/// The readiness probes of one Configure.
struct Probes {
    attempts: u32,
    /// The last failed probe, already redacted.
    last: Option<String>,
    /// Built from this Configure's blob: probe output can repeat it too
    /// (a join token read back from a file the bootstrap wrote).
    redactor: Arc<Redactor>,
}

/// Context for a failure after retries: names the node when it was the
/// node that did not answer, so `last_error` says where to look.
fn err_at(context: impl std::fmt::Display, node: Option<&str>, e: &PveError) -> SubstrateError {
    match node {
        Some(node) if e.is_node_unreachable() || e.is_offline() => err(
            format!("{context}: node {node} is offline or unreachable"),
            e,
        ),
        _ => err(context, e),
    }
}

/// How a PVE failure is classified for callers and metrics.
fn kind_of(e: &PveError) -> ErrorKind {
    if e.is_auth() || e.status() == Some(403) || e.is_tls() {
        ErrorKind::Refused
    } else if e.is_not_found() {
        ErrorKind::NotFound
    } else if e.is_locked()
        || e.is_node_unreachable()
        || e.is_transport()
        || e.is_timeout()
        || matches!(e.status(), Some(502..=504 | 597))
    {
        ErrorKind::Transient
    } else {
        ErrorKind::Permanent
    }
}

fn err(context: impl std::fmt::Display, e: &PveError) -> SubstrateError {
    SubstrateError::caused_by(kind_of(e), context, e.clone())
}

impl PveSubstrate {
    pub fn new(client: PveClient, opts: PveOptions) -> Self {
        PveSubstrate {
            client,
            opts,
            index: Mutex::new(HashMap::new()),
            templates: Mutex::new(HashMap::new()),
            template_storage: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            vmids: Mutex::new(VmidState::default()),
            vmid_choice: AsyncMutex::new(()),
            creating: Mutex::new(HashMap::new()),
            clone_slots: Mutex::new(HashMap::new()),
            tags_restricted: AtomicBool::new(false),
            probes: Mutex::new(HashMap::new()),
            placement: placement::PlacementState::default(),
        }
    }

    pub fn options(&self) -> &PveOptions {
        &self.opts
    }

    fn first_poll(&self) -> Duration {
        self.opts.poll_interval.min(Duration::from_millis(100))
    }

    /// Jittered exponential backoff (`attempt` from 0), capped at 16 polls.
    fn backoff(&self, attempt: u32) -> Duration {
        let base = self.opts.poll_interval.max(Duration::from_millis(10));
        let d = base.saturating_mul(1 << attempt.min(4));
        let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(2);
        Duration::from_millis(rand::rng().random_range(ms / 2..=ms))
    }

    /// The end of the retry window of a transition starting now.
    fn deadline(&self) -> Instant {
        Instant::now() + self.opts.retry_window
    }

    /// Sleeps the backoff for `attempt`, never past `deadline`.
    pub(super) async fn pause(&self, attempt: u32, deadline: Instant) {
        let now = Instant::now();
        let d = self
            .backoff(attempt)
            .min(deadline.saturating_duration_since(now));
        tokio::time::sleep(d).await;
    }

    /// Runs an idempotent call (a read, or a write whose repeat is harmless)
    /// until it succeeds, fails for good, or `deadline` passes; transient
    /// failures (see [`PveError::is_transient`]) are retried with backoff.
    /// The error names the node when the node did not answer.
    pub(super) async fn retry_pve<T, F, Fut>(
        &self,
        what: impl std::fmt::Display,
        node: Option<&str>,
        deadline: Instant,
        mut call: F,
    ) -> Result<T, SubstrateError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, PveError>>,
    {
        self.retry_raw(node, deadline, &mut call)
            .await
            .map_err(|e| err_at(what, node, &e))
    }

    /// [`PveSubstrate::retry_pve`] returning the PVE error itself, for callers
    /// that branch on it (not found, forbidden).
    pub(super) async fn retry_raw<T, F, Fut>(
        &self,
        node: Option<&str>,
        deadline: Instant,
        call: &mut F,
    ) -> Result<T, PveError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, PveError>>,
    {
        let mut attempt = 0;
        loop {
            match call().await {
                Ok(v) => return Ok(v),
                Err(e) if e.is_transient() && Instant::now() < deadline => {
                    tracing::debug!(node = node.unwrap_or(""), error = %e, attempt, "transient PVE failure; retrying");
                    self.pause(attempt, deadline).await;
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// A retried read of VM `vm`; `None` when it is gone or outside the
    /// token's reach (404, or 403 under a pool-scoped token once the VM is
    /// not in the pool), i.e. nothing of ours this token could act on. Any
    /// other failure names `what` was being done.
    pub(super) async fn read_present<T, F, Fut>(
        &self,
        what: &str,
        vm: &VmRef,
        deadline: Instant,
        mut call: F,
    ) -> Result<Option<T>, SubstrateError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, PveError>>,
    {
        match self.retry_raw(Some(&vm.node), deadline, &mut call).await {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.is_not_found() || e.is_forbidden() => Ok(None),
            Err(e) => Err(err_at(format!("{what} VM {vm}"), Some(&vm.node), &e)),
        }
    }

    // ---- inventory ----

    // ---- tasks and agent ----

    async fn wait_task(&self, upid: &Upid, what: &str) -> Result<(), PveError> {
        tokio::time::sleep(self.first_poll()).await;
        let deadline = Instant::now() + self.opts.task_timeout;
        self.client
            .wait_task(upid, deadline, self.opts.poll_interval)
            .await
            .map(|_| ())
            .inspect_err(|e| tracing::debug!(task = what, error = %e, "PVE task failed"))
    }

    /// Polls `status/current` until `done` holds.
    async fn wait_status(
        &self,
        vm: &VmRef,
        what: &str,
        done: impl Fn(&VmStatus) -> bool,
    ) -> Result<(), SubstrateError> {
        let deadline = Instant::now() + self.opts.task_timeout;
        loop {
            let st = self
                .retry_pve(
                    format!("waiting for VM {vm} to be {what}"),
                    Some(&vm.node),
                    deadline,
                    || self.client.status_current(&vm.node, vm.vmid),
                )
                .await?;
            if done(&st) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(SubstrateError::new(format!(
                    "VM {vm} was not {what} within {:?} (status {}, lock {:?})",
                    self.opts.task_timeout, st.status, st.lock
                )));
            }
            tokio::time::sleep(self.opts.poll_interval).await;
        }
    }

    /// Starts a stopped VM (HA-aware: the agent wait covers a queued `hastart`).
    /// A repeated start is harmless (the task of the second fails "already
    /// running", taken as success), so transient failures are retried.
    async fn start(&self, vm: &VmRef, deadline: Instant) -> Result<(), SubstrateError> {
        tracing::info!(vm = %vm, "starting VM");
        let upid = self
            .retry_pve(
                format!("starting VM {vm}"),
                Some(&vm.node),
                deadline,
                || self.client.start(&vm.node, vm.vmid),
            )
            .await?;
        match self.wait_task(&upid, "start").await {
            Ok(()) => Ok(()),
            // Started by someone else meanwhile: fine.
            Err(PveError::TaskFailed { exitstatus, .. })
                if exitstatus.contains("already running") =>
            {
                Ok(())
            }
            // A repeated start (after a lost answer) waited on the first
            // one's config lock: the first start is the one to wait for.
            Err(e) if e.is_lock_timeout() => {
                self.wait_status(vm, "running", |s| s.is_running()).await
            }
            Err(e) => Err(err(format!("starting VM {vm}"), &e)),
        }
    }

    async fn ensure_running_status(
        &self,
        vm: &VmRef,
        st: &VmStatus,
        deadline: Instant,
    ) -> Result<(), SubstrateError> {
        if !st.is_running() {
            self.start(vm, deadline).await?;
        }
        self.wait_agent(vm).await
    }

    /// Writes the blob and runs the bootstrap hook on it.
    async fn bootstrap(&self, vm: &VmRef, path: String, blob: &[u8]) -> Result<(), SubstrateError> {
        self.write_blob(vm, &path, blob).await?;
        tracing::info!(vm = %vm, bytes = blob.len(), "bootstrap blob written");
        let mut argv = self.opts.bootstrap_exec.clone();
        argv.push(path);
        let what = format!("bootstrap hook `{}`", argv.join(" "));
        let st = self
            .run(vm, &argv, None, self.opts.exec_timeout)
            .await
            .map_err(|e| exec_err(format!("running the {what} in VM {vm}"), &e))?;
        tracing::info!(vm = %vm, exit_code = ?st.exitcode, signal = ?st.signal, "bootstrap exited");
        exec_outcome_redacted(&what, &st, blob)
            .map_err(|e| SubstrateError::new(format!("VM {vm}: {e}")))
    }

    // ---- delete ----

    /// The VM's status, following a migration (by VMID; the marker is
    /// checked afterwards). `None`: it no longer exists, or it is invisible
    /// to this token, which under a pool-scoped token means it is outside the
    /// pool and so not ours (ours stay in the pool until destroyed).
    async fn find_for_delete(
        &self,
        vm: &VmRef,
        deadline: Instant,
    ) -> Result<Option<(VmRef, VmStatus)>, SubstrateError> {
        let mut call = || self.client.status_current(&vm.node, vm.vmid);
        match self.retry_raw(Some(&vm.node), deadline, &mut call).await {
            Ok(st) => Ok(Some((vm.clone(), st))),
            Err(e) if e.is_forbidden() => {
                if self.vmid_taken(vm.vmid, deadline).await? {
                    tracing::warn!(vm = %vm, "VMID is in use but outside the token's pool: not ours; leaving it alone");
                }
                Ok(None)
            }
            Err(e) if e.is_not_found() => {
                let Some(moved) = self.locate(vm.vmid).await? else {
                    return Ok(None);
                };
                let moved = VmRef {
                    node: moved.node,
                    vmid: vm.vmid,
                };
                tracing::info!(vmid = vm.vmid, from = %vm.node, to = %moved.node, "VM moved; deleting it on its new node");
                let st = self
                    .read_present("reading the status of", &moved, deadline, || {
                        self.client.status_current(&moved.node, moved.vmid)
                    })
                    .await?;
                Ok(st.map(|st| (moved, st)))
            }
            Err(e) => Err(err_at(
                format!("reading the status of VM {vm}"),
                Some(&vm.node),
                &e,
            )),
        }
    }

    /// Stops and destroys a VM whose marker was checked by the caller.
    /// Repeats are harmless (stopping a stopped VM, destroying a gone one),
    /// so transient failures are retried until `deadline`.
    pub(super) async fn destroy_owned(
        &self,
        vm: &VmRef,
        st: &VmStatus,
        deadline: Instant,
    ) -> Result<(), SubstrateError> {
        let node = Some(vm.node.as_str());
        if st.is_running() {
            tracing::info!(vm = %vm, ha = st.ha_managed(), "stopping VM");
            let mut call = || self.client.stop(&vm.node, vm.vmid);
            match self.retry_raw(node, deadline, &mut call).await {
                Ok(upid) => self
                    .wait_task(&upid, "stop")
                    .await
                    .map_err(|e| err_at(format!("stopping VM {vm}"), node, &e))?,
                Err(e) if e.is_not_found() => {
                    self.forget(vm.vmid);
                    return Ok(());
                }
                Err(e) => return Err(err_at(format!("stopping VM {vm}"), node, &e)),
            }
            if st.ha_managed() {
                // hastop only queues the request.
                self.wait_status(vm, "stopped", |s| !s.is_running()).await?;
            }
        }
        tracing::info!(vm = %vm, "destroying VM");
        let mut call = || self.client.destroy(&vm.node, vm.vmid);
        match self.retry_raw(node, deadline, &mut call).await {
            Ok(upid) => match self.wait_task(&upid, "destroy").await {
                Ok(()) => {}
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(err_at(format!("destroying VM {vm}"), node, &e)),
            },
            Err(e) if e.is_not_found() || e.is_forbidden() => {}
            Err(e) => return Err(err_at(format!("destroying VM {vm}"), node, &e)),
        }
        self.forget(vm.vmid);
        Ok(())
    }

    // ---- create ----

    fn machine_lock(&self, machine_id: &str) -> Arc<AsyncMutex<()>> {
        self.creating
            .lock()
            .entry(machine_id.to_string())
            .or_default()
            .clone()
    }
}

#[async_trait]
impl Substrate for PveSubstrate {
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
        let deadline = self.deadline();
        let name = vm_name(&req.instance_type, &req.machine_id);
        let mtag = machine_tag(&req.machine_id);

        let (existing, list) = self.find_existing(req, &name, deadline).await?;
        if let Some((vm, tags)) = existing {
            tracing::info!(machine_id = %req.machine_id, vm = %vm, "adopting the VM already marked for this machine");
            let tagged = tags.contains(&mtag) && tags.iter().any(|t| t == MANAGED_TAG);
            // Under restricted tag access the tags never appear: marking is
            // then one idempotent PUT of sizing and marker, not a loop.
            if !tagged {
                self.mark(&vm, req, deadline).await?;
            }
            let st = self.managed_status(&vm, deadline).await?;
            self.ensure_running_status(&vm, &st, deadline).await?;
            self.pending.lock().remove(&req.machine_id);
            return Ok(vm);
        }

        let template_node = self.template_node(req.template_vmid, &list)?;
        // From the template itself, or its replica on the target node.
        let vm = self
            .clone_planned(req, &template_node, &list, &name, deadline)
            .await?;
        tracing::info!(machine_id = %req.machine_id, vm = %vm, "clone done");
        self.mark(&vm, req, deadline).await?;
        self.start(&vm, deadline).await?;
        self.wait_agent(&vm).await?;
        self.pending.lock().remove(&req.machine_id);
        tracing::info!(machine_id = %req.machine_id, vm = %vm, "VM created and its guest agent answers");
        Ok(vm)
    }

    async fn delete_vm(&self, vm: &VmRef, machine_id: &str) -> Result<(), SubstrateError> {
        self.probes.lock().remove(&vm.vmid);
        let deadline = self.deadline();
        let Some((vm, st)) = self.find_for_delete(vm, deadline).await? else {
            tracing::info!(vm = %vm, "VM already gone");
            self.forget(vm.vmid);
            return Ok(());
        };
        let Some(cfg) = self
            .read_present("reading the marker of", &vm, deadline, || {
                self.client.get_config(&vm.node, vm.vmid)
            })
            .await?
        else {
            tracing::info!(vm = %vm, "VM gone before its marker could be read");
            self.forget(vm.vmid);
            return Ok(());
        };
        if !owned_by(cfg.description.as_deref(), machine_id, None) {
            // The VMID was reused, or the VM only looks like ours: our VM is gone.
            tracing::warn!(vm = %vm, machine_id, "VM's description marker does not name this machine; leaving it alone");
            self.forget(vm.vmid);
            return Ok(());
        }
        self.destroy_owned(&vm, &st, deadline).await
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
        let deadline = self.deadline();
        let st = self.managed_status(vm, deadline).await?;
        self.ensure_running_status(vm, &st, deadline).await
    }

    async fn configure(&self, vm: &VmRef, blob: &[u8]) -> Result<(), SubstrateError> {
        let path = self.opts.bootstrap_path.clone();
        if self.opts.bootstrap_exec.is_empty() {
            return Err(SubstrateError::new("no bootstrap exec configured"));
        }
        // Only kept while the readiness gate may probe; dropped on failure,
        // on the gate's verdict, and by Drain and Delete.
        if self.readiness_gate() {
            self.probes.lock().insert(
                vm.vmid,
                Probes {
                    attempts: 0,
                    last: None,
                    redactor: Arc::new(Redactor::new(blob)),
                },
            );
        }
        let outcome = self.bootstrap(vm, path, blob).await;
        if outcome.is_err() {
            self.probes.lock().remove(&vm.vmid);
        }
        outcome
    }

    fn readiness_gate(&self) -> bool {
        !self.opts.readiness_command.trim().is_empty()
    }

    async fn node_ready(&self, vm: &VmRef) -> Result<bool, SubstrateError> {
        if !self.readiness_gate() {
            return Ok(true);
        }
        let argv = vec![
            "/bin/sh".to_string(),
            "-c".to_string(),
            self.opts.readiness_command.clone(),
        ];
        let outcome = self.run(vm, &argv, None, self.opts.readiness_timeout).await;
        let mut probes = self.probes.lock();
        let p = probes.entry(vm.vmid).or_insert_with(|| Probes {
            attempts: 0,
            last: None,
            redactor: Arc::new(Redactor::new(&[])),
        });
        p.attempts += 1;
        let attempt = p.attempts;
        match outcome {
            Ok(st) => {
                tracing::info!(vm = %vm, attempt, exit_code = ?st.exitcode, signal = ?st.signal, "readiness probe");
                match exec_outcome_with("the readiness command", &st, &p.redactor) {
                    Ok(()) => {
                        probes.remove(&vm.vmid);
                        Ok(true)
                    }
                    Err(e) => {
                        p.last = Some(e.to_string());
                        Ok(false)
                    }
                }
            }
            // Rebooting after the bootstrap: not ready yet.
            Err(ExecError::Api(e)) if e.is_agent_transient() => {
                tracing::info!(vm = %vm, attempt, error = %e, "readiness probe: guest agent not answering");
                p.last = Some(format!("the guest agent did not answer: {e}"));
                Ok(false)
            }
            Err(e) => Err(exec_err(format!("probing readiness of VM {vm}"), &e)),
        }
    }

    fn readiness_detail(&self, vm: &VmRef) -> Option<String> {
        let probes = self.probes.lock().remove(&vm.vmid)?;
        let last = probes.last?;
        Some(format!(
            "last readiness probe (attempt {}): {last}",
            probes.attempts
        ))
    }

    async fn drain(&self, vm: &VmRef, grace: Duration) -> Result<(), SubstrateError> {
        self.probes.lock().remove(&vm.vmid);
        if self.opts.drain_command.trim().is_empty() {
            return Err(SubstrateError::new("no drain command configured"));
        }
        let cmd = drain_command(&self.opts.drain_command, grace, self.opts.drain_timeout);
        tracing::info!(vm = %vm, command = %cmd, "draining");
        let argv = vec!["/bin/sh".to_string(), "-c".to_string(), cmd];
        let st = self
            .run(
                vm,
                &argv,
                None,
                self.opts.drain_timeout + Duration::from_secs(30),
            )
            .await
            .map_err(|e| exec_err(format!("draining VM {vm}"), &e))?;
        tracing::info!(vm = %vm, exit_code = ?st.exitcode, signal = ?st.signal, "drain command exited");
        exec_outcome("drain command", &st).map_err(|e| SubstrateError::new(format!("VM {vm}: {e}")))
    }
}

/// The drain command as run: `--drain-command`, then `--grace-period=N`
/// only for a request's positive grace (0, proto3's unset, leaves each
/// pod's own `terminationGracePeriodSeconds` in force, where kubectl's
/// `--grace-period=0` would mean "delete now"), then `--timeout=Ns` so
/// kubectl gives up before the provider stops waiting.
pub(crate) fn drain_command(base: &str, grace: Duration, drain_timeout: Duration) -> String {
    let mut cmd = base.trim().to_string();
    if grace.as_secs() > 0 {
        cmd.push_str(&format!(" --grace-period={}", grace.as_secs()));
    }
    cmd.push_str(&format!(" --timeout={}s", drain_timeout.as_secs().max(1)));
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drain_appends_grace_only_when_asked() {
        let base = "kubectl drain \"$(hostname)\" --ignore-daemonsets";
        let t = Duration::from_secs(600);
        assert_eq!(
            drain_command(base, Duration::ZERO, t),
            format!("{base} --timeout=600s"),
            "0 = the pods' own grace"
        );
        assert_eq!(
            drain_command(base, Duration::from_secs(30), t),
            format!("{base} --grace-period=30 --timeout=600s")
        );
        assert_eq!(
            drain_command(base, Duration::from_millis(400), Duration::ZERO),
            format!("{base} --timeout=1s"),
            "sub-second grace rounds to unset; the timeout is at least 1s"
        );
    }
}
