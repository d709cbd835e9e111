//! The real substrate: a Proxmox VE cluster driven through the `pve` API client.
//!
//! Cost model (API calls per operation, independent of cluster size):
//! Create = 1 inventory read + 1 `nextid` + clone + task polls + 1 config PUT +
//! start + task polls + agent pings (the first Create per template also reads
//! the template's config once, for its disk storage); Configure/Drain =
//! status + ping + exec + exec-status polls; Delete = status + stop + destroy + task polls; a
//! reconcile pass = 1 inventory read plus config reads only for marked VMs that
//! are new or whose tags/name changed since the last pass.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use providerkit::ErrorKind;
use pve::{machine_tag, PveClient, PveError, Upid, VmStatus};
use rand::Rng;
use tokio::sync::{Mutex as AsyncMutex, OnceCell, Semaphore};
use tokio::time::Instant;

use crate::substrate::{CloneRequest, ManagedVm, Substrate, SubstrateError, VmRef};
use guest::{exec_err, exec_outcome, exec_outcome_redacted, ExecError};
use inventory::Known;
use marker::looks_managed;
use vmid::VmidState;

mod clone;
mod guest;
mod inventory;
mod marker;
mod options;
mod vmid;

pub use marker::{marker_description, parse_marker, vm_name, MANAGED_TAG};
pub use options::PveOptions;

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
        }
    }

    /// Startup check (2 API calls): the token works, every zone is a cluster
    /// node, every template is visible. Errors name the problem; the returned
    /// strings are warnings (offline node, source VM not a template).
    pub async fn preflight(
        &self,
        nodes: &[String],
        templates: &[u32],
    ) -> Result<Vec<String>, SubstrateError> {
        let cluster = self
            .client
            .nodes()
            .await
            .map_err(|e| err("listing the cluster's nodes (is the API token valid?)", &e))?;
        let mut warnings = Vec::new();
        let names: Vec<&str> = cluster.iter().map(|n| n.node.as_str()).collect();
        for node in nodes {
            match cluster.iter().find(|n| &n.node == node) {
                None => {
                    return Err(SubstrateError::new(format!(
                        "node {node:?} from --nodes is not in the cluster (cluster nodes: {})",
                        names.join(", ")
                    )))
                }
                Some(n) if n.status != "online" => {
                    warnings.push(format!("node {node:?} is {}", n.status))
                }
                Some(_) => {}
            }
        }
        let (list, _) = self.scan(|_| false).await?;
        for t in templates {
            match list.iter().find(|v| v.vmid == *t) {
                None => {
                    return Err(SubstrateError::new(format!(
                        "template VMID {t} is not in the cluster (or the API token cannot audit it)"
                    )))
                }
                Some(v) if !v.template => warnings.push(format!(
                    "source VMID {t} on node {} is not a template: clones copy a live VM",
                    v.node
                )),
                Some(_) => {}
            }
        }
        Ok(warnings)
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
                .client
                .status_current(&vm.node, vm.vmid)
                .await
                .map_err(|e| err(format!("waiting for VM {vm} to be {what}"), &e))?;
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
    async fn start(&self, vm: &VmRef) -> Result<(), SubstrateError> {
        tracing::info!(vm = %vm, "starting VM");
        let upid = self
            .client
            .start(&vm.node, vm.vmid)
            .await
            .map_err(|e| err(format!("starting VM {vm}"), &e))?;
        match self.wait_task(&upid, "start").await {
            Ok(()) => Ok(()),
            // Started by someone else meanwhile: fine.
            Err(PveError::TaskFailed { exitstatus, .. })
                if exitstatus.contains("already running") =>
            {
                Ok(())
            }
            Err(e) => Err(err(format!("starting VM {vm}"), &e)),
        }
    }

    async fn ensure_running_status(&self, vm: &VmRef, st: &VmStatus) -> Result<(), SubstrateError> {
        if !st.is_running() {
            self.start(vm).await?;
        }
        self.wait_agent(vm).await
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
        let name = vm_name(&req.instance_type, &req.machine_id);
        let mtag = machine_tag(&req.machine_id);

        let (existing, list) = self.find_existing(req, &name).await?;
        if let Some((vm, tags)) = existing {
            tracing::info!(machine_id = %req.machine_id, vm = %vm, "adopting the VM already marked for this machine");
            if !tags.contains(&mtag) || !tags.iter().any(|t| t == MANAGED_TAG) {
                self.mark(&vm, req).await?;
            }
            let st = self.managed_status(&vm).await?;
            self.ensure_running_status(&vm, &st).await?;
            self.pending.lock().remove(&req.machine_id);
            return Ok(vm);
        }

        let template_node = self.template_node(req.template_vmid, &list)?;
        let vm = self.clone_new(req, &template_node, &name).await?;
        self.mark(&vm, req).await?;
        self.start(&vm).await?;
        self.wait_agent(&vm).await?;
        self.pending.lock().remove(&req.machine_id);
        tracing::info!(machine_id = %req.machine_id, vm = %vm, "VM created and its guest agent answers");
        Ok(vm)
    }

    async fn delete_vm(&self, vm: &VmRef) -> Result<(), SubstrateError> {
        let mut vm = vm.clone();
        let st = match self.client.status_current(&vm.node, vm.vmid).await {
            Ok(st) => st,
            Err(e) if e.is_not_found() => match self.locate(vm.vmid).await? {
                Some(moved) if looks_managed(&moved.tags, moved.name.as_deref()) => {
                    tracing::info!(vmid = vm.vmid, from = %vm.node, to = %moved.node, "VM moved; deleting it on its new node");
                    vm.node = moved.node;
                    self.client
                        .status_current(&vm.node, vm.vmid)
                        .await
                        .map_err(|e| err(format!("reading the status of VM {vm}"), &e))?
                }
                _ => {
                    tracing::info!(vm = %vm, "VM already gone");
                    self.forget(vm.vmid);
                    return Ok(());
                }
            },
            Err(e) => return Err(err(format!("reading the status of VM {vm}"), &e)),
        };
        if !looks_managed(&st.tags, st.name.as_deref()) {
            // The VMID was reused by someone else: our VM is gone.
            tracing::warn!(vm = %vm, "VMID now belongs to an unmarked VM; leaving it alone");
            self.forget(vm.vmid);
            return Ok(());
        }
        if st.is_running() {
            tracing::info!(vm = %vm, ha = st.ha_managed(), "stopping VM");
            match self.client.stop(&vm.node, vm.vmid).await {
                Ok(upid) => self
                    .wait_task(&upid, "stop")
                    .await
                    .map_err(|e| err(format!("stopping VM {vm}"), &e))?,
                Err(e) if e.is_not_found() => {
                    self.forget(vm.vmid);
                    return Ok(());
                }
                Err(e) => return Err(err(format!("stopping VM {vm}"), &e)),
            }
            if st.ha_managed() {
                // hastop only queues the request.
                self.wait_status(&vm, "stopped", |s| !s.is_running())
                    .await?;
            }
        }
        tracing::info!(vm = %vm, "destroying VM");
        match self.client.destroy(&vm.node, vm.vmid).await {
            Ok(upid) => match self.wait_task(&upid, "destroy").await {
                Ok(()) => {}
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(err(format!("destroying VM {vm}"), &e)),
            },
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(err(format!("destroying VM {vm}"), &e)),
        }
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
        let st = self.managed_status(vm).await?;
        self.ensure_running_status(vm, &st).await
    }

    async fn configure(&self, vm: &VmRef, blob: &[u8]) -> Result<(), SubstrateError> {
        let path = self.opts.bootstrap_path.clone();
        if self.opts.bootstrap_exec.is_empty() {
            return Err(SubstrateError::new("no bootstrap exec configured"));
        }
        self.write_blob(vm, &path, blob).await?;
        let mut argv = self.opts.bootstrap_exec.clone();
        argv.push(path);
        let what = format!("bootstrap hook `{}`", argv.join(" "));
        let st = self
            .run(vm, &argv, None, self.opts.exec_timeout)
            .await
            .map_err(|e| exec_err(format!("running the {what} in VM {vm}"), &e))?;
        exec_outcome_redacted(&what, &st, blob)
            .map_err(|e| SubstrateError::new(format!("VM {vm}: {e}")))
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
        match self.run(vm, &argv, None, self.opts.readiness_timeout).await {
            Ok(st) => Ok(st.exitcode == Some(0) && st.signal.is_none()),
            // Rebooting after the bootstrap: not ready yet.
            Err(ExecError::Api(e)) if e.is_agent_transient() => Ok(false),
            Err(e) => Err(exec_err(format!("probing readiness of VM {vm}"), &e)),
        }
    }

    async fn drain(&self, vm: &VmRef, grace: Duration) -> Result<(), SubstrateError> {
        if self.opts.drain_command.trim().is_empty() {
            return Err(SubstrateError::new("no drain command configured"));
        }
        let timeout = self.opts.drain_timeout.as_secs().max(1);
        let cmd = format!(
            "{} --grace-period={} --timeout={timeout}s",
            self.opts.drain_command.trim(),
            grace.as_secs()
        );
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
        exec_outcome("drain command", &st).map_err(|e| SubstrateError::new(format!("VM {vm}: {e}")))
    }
}
