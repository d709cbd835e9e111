//! The one door to PVE: every call any part makes goes through [`Api`],
//! which holds the `pve` client privately. It classifies PVE failures and
//! retries them ([`Api::retry_pve`], [`Api::retry_raw`],
//! [`Api::read_present`]); a call whose repeat is not harmless, or whose
//! caller reports a failure rather than waits it out, goes through
//! [`Api::once`]. It also waits on tasks and status and holds the VM
//! primitives (start, stop and destroy, status, the VMID-in-use check,
//! what is at a VMID). It holds no locks and no state but one counter (the
//! volumes destroys left behind, for the metrics), so any part can use it
//! without reaching into another; the options a part uses live with that
//! part, and the Api keeps only its own (poll interval, retry window, task
//! timeout).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use providerkit::ErrorKind;
use pve::{PveClient, PveError, TaskStatus, Upid, VmStatus};
use rand::Rng;
use tokio::time::Instant;

use super::estimate::FirstLook;
use super::marker::{looks_managed, owned_by, MANAGED_TAG};
use super::options::PveOptions;
use super::task_watch::TaskWatch;
use crate::substrate::{SubstrateError, VmRef};
use crate::timeline::{self, Step};

mod destroy;

/// How a PVE failure is classified for callers and metrics.
pub(super) fn kind_of(e: &PveError) -> ErrorKind {
    if e.is_auth() || e.status() == Some(403) || e.is_tls() {
        ErrorKind::Refused
    } else if e.is_not_found() {
        ErrorKind::NotFound
    } else if e.is_locked()
        || e.is_transient()
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

/// `{context}: {e}`, classified by [`kind_of`], keeping `e` as the cause.
pub(super) fn err(context: impl std::fmt::Display, e: &PveError) -> SubstrateError {
    SubstrateError::caused_by(kind_of(e), context, e.clone())
}

/// Context for a failure after retries: names the node when it was the
/// node that did not answer, so `last_error` says where to look.
pub(super) fn err_at(
    context: impl std::fmt::Display,
    node: Option<&str>,
    e: &PveError,
) -> SubstrateError {
    match node {
        Some(node) if e.is_node_unreachable() || e.is_offline() => err(
            format!("{context}: node {node} is offline or unreachable"),
            e,
        ),
        _ => err(context, e),
    }
}

/// What a VM whose lock no task holds is to the provider, which decides
/// what root must do besides unlocking it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LockedVm {
    /// Carries the machine's marker: once unlocked, the provider deletes it.
    Ours,
    /// The VMID a clone of ours went to, but the clone died before writing
    /// the marker: nothing proves it ours, so the provider never destroys it.
    Unmarked,
    /// Outside the token's pool (a clone dies before `add_vm_to_pool`):
    /// the token can neither see nor destroy it.
    OutsidePool,
}

/// The error for a VM whose `lock` no running task holds: only root can
/// clear it (pve-guest-common `check_lock` guards destroy, `skiplock` is
/// root-only, and a config update refuses `lock`: "only root can set
/// 'lock' config"), so waiting would never end.
pub(super) fn stale_lock_error(vm: &VmRef, lock: &str, what: LockedVm) -> SubstrateError {
    let cause = match lock {
        "clone" => "a clone that died with its node or its process",
        "migrate" => "a migration that died with its node or its process",
        _ => "a task that died",
    };
    let (node, vmid) = (&vm.node, vm.vmid);
    let fix = match what {
        LockedVm::Ours => format!(
            "as root on node {node}, run `qm unlock {vmid}`; then reclaim the machine \
             (`bigfleet-proxmox ctl reclaim <machine id>`) and its VM is deleted"
        ),
        LockedVm::Unmarked => format!(
            "as root on node {node}, check that `qm config {vmid}` shows `lock: {lock}` and no \
             description, then run `qm unlock {vmid}` and `qm destroy {vmid}`: the clone died \
             before marking it, so the provider never destroys it"
        ),
        LockedVm::OutsidePool => format!(
            "as root on node {node}, check that `qm config {vmid}` shows `lock: {lock}`, then run \
             `qm unlock {vmid}` and `qm destroy {vmid}`: the VM never joined the pool, so the API \
             token can neither see nor destroy it"
        ),
    };
    SubstrateError::with_kind(
        ErrorKind::Permanent,
        format!(
            "VM {vm} is locked ({lock}) and no running task holds the lock: {cause} left it, \
             and only root can clear it; {fix}"
        ),
    )
}

/// What [`Api::probe`] found at a VMID a clone of ours was started on.
pub(super) enum Probe {
    /// Our marker; the VM's tags.
    Ours(Vec<String>),
    /// In use but not readable as ours yet: a clone in progress.
    Cloning,
    /// Free.
    Gone,
    /// Another VM (a different marker, or none).
    Foreign,
}

/// How long a read for an admission or the start-up line may take: the
/// Create RPC (or the start) waits for it, so a node slow to answer is
/// admitted unchecked (its clone checks again) rather than held up for the
/// whole retry window. Every guard's admission reads within it.
pub(super) const QUICK_READ: Duration = Duration::from_secs(10);

/// The client, with the retry and wait policy.
pub(super) struct Api {
    client: PveClient,
    opts: Arc<PveOptions>,
    /// Task waits, one poll per node per tick.
    tasks: TaskWatch,
    /// When, after a stop, a VM's destroy is accepted (see `Api::wait_stop`).
    stops: FirstLook,
    /// Volumes destroy tasks said they could not free, since this Api was
    /// made (see [`Api::report_unremoved_disks`]).
    unremoved_disks: AtomicU64,
    /// The nodes `/nodes` last listed as not online, and when: a burst of
    /// clones to other nodes than their template's asks once per poll
    /// interval, not once each (see [`Api::node_offline`]). Locked across
    /// the read, so the others wait for it rather than read too.
    offline_nodes: tokio::sync::Mutex<Option<(Instant, Arc<Vec<String>>)>>,
}

impl Api {
    pub(super) fn new(client: PveClient, opts: Arc<PveOptions>) -> Api {
        Api {
            tasks: TaskWatch::new(client.clone(), opts.poll_interval),
            stops: FirstLook::default(),
            client,
            opts,
            unremoved_disks: AtomicU64::new(0),
            offline_nodes: tokio::sync::Mutex::new(None),
        }
    }

    /// How many volumes destroy tasks have said they could not free.
    pub(super) fn unremoved_disks(&self) -> u64 {
        self.unremoved_disks.load(Ordering::Relaxed)
    }

    /// The API's base URL, for messages.
    pub(super) fn base_url(&self) -> &str {
        self.client.base_url()
    }

    /// `USER@REALM!NAME`, for messages and fixes.
    pub(super) fn token_id(&self) -> &str {
        self.client.token_id()
    }

    /// A call made once, its failure left to the caller: a POST whose
    /// repeat is not harmless (the caller resolves a lost answer by
    /// reading what it left), a step that retries on its own terms, or a
    /// check that reports a failure rather than waits it out.
    pub(super) fn once<'a, T, F>(&'a self, call: F) -> T
    where
        F: FnOnce(&'a PveClient) -> T,
    {
        call(&self.client)
    }

    /// How far the disk copy of task `upid` is, in percent, by the last
    /// progress line of its log (`None`: none yet). Retried past transient
    /// failures until `deadline` when one is given, else read once.
    pub(super) async fn copy_percent(
        &self,
        upid: &Upid,
        deadline: Option<Instant>,
    ) -> Result<Option<f64>, PveError> {
        // A clone's log is about a hundred lines (one each whole percent).
        const LINES: u64 = 1000;
        let log = match deadline {
            Some(deadline) => {
                self.retry_raw(Some(&upid.node), deadline, |pve| {
                    pve.task_log(upid, 0, LINES)
                })
                .await?
            }
            None => self.once(|pve| pve.task_log(upid, 0, LINES)).await?,
        };
        Ok(log.iter().rev().find_map(pve::TaskLogLine::copy_percent))
    }

    pub(super) fn first_poll(&self) -> Duration {
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
    pub(super) fn deadline(&self) -> Instant {
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
    pub(super) async fn retry_pve<'a, T, F, Fut>(
        &'a self,
        what: impl std::fmt::Display,
        node: Option<&str>,
        deadline: Instant,
        call: F,
    ) -> Result<T, SubstrateError>
    where
        F: FnMut(&'a PveClient) -> Fut,
        Fut: Future<Output = Result<T, PveError>>,
    {
        self.retry_raw(node, deadline, call)
            .await
            .map_err(|e| err_at(what, node, &e))
    }

    /// [`Api::retry_pve`] returning the PVE error itself, for callers that
    /// branch on it (not found, forbidden).
    pub(super) async fn retry_raw<'a, T, F, Fut>(
        &'a self,
        node: Option<&str>,
        deadline: Instant,
        mut call: F,
    ) -> Result<T, PveError>
    where
        F: FnMut(&'a PveClient) -> Fut,
        Fut: Future<Output = Result<T, PveError>>,
    {
        let mut attempt = 0;
        loop {
            match call(&self.client).await {
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
    pub(super) async fn read_present<'a, T, F, Fut>(
        &'a self,
        what: &str,
        vm: &VmRef,
        deadline: Instant,
        call: F,
    ) -> Result<Option<T>, SubstrateError>
    where
        F: FnMut(&'a PveClient) -> Fut,
        Fut: Future<Output = Result<T, PveError>>,
    {
        match self.retry_raw(Some(&vm.node), deadline, call).await {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.is_not_found() || e.is_forbidden() => Ok(None),
            Err(e) => Err(err_at(format!("{what} VM {vm}"), Some(&vm.node), &e)),
        }
    }

    pub(super) async fn wait_task(&self, upid: &Upid, what: &str) -> Result<(), PveError> {
        self.wait_task_status(upid, what).await.map(|_| ())
    }

    /// [`Api::wait_task`], returning the ended task's status (its exit
    /// status tells `OK` from `WARNINGS: N`).
    ///
    /// A machine's clone, start, stop and destroy tasks are steps of its
    /// [timeline](crate::timeline), from the task's start to its end.
    async fn wait_task_status(&self, upid: &Upid, what: &str) -> Result<TaskStatus, PveError> {
        let deadline = Instant::now() + self.opts.task_timeout;
        self.timed_task(upid, what, self.tasks.wait(upid, deadline))
            .await
    }

    /// A task wait as a step of the machine's timeline (clone, start,
    /// stop, destroy), from the task's start to its end.
    async fn timed_task<T>(
        &self,
        upid: &Upid,
        what: &str,
        wait: impl Future<Output = Result<T, PveError>>,
    ) -> Result<T, PveError> {
        let mut step = task_step(what).map(|s| timeline::step(s, &upid.node));
        if let Some(step) = step.as_mut() {
            step.task(upid);
        }
        let out = wait
            .await
            .inspect_err(|e| tracing::debug!(task = what, error = %e, "PVE task failed"));
        match step {
            Some(step) => step.end(out),
            None => out,
        }
    }

    /// Polls task `upid` until it ends or `deadline` passes.
    pub(super) async fn wait_task_until(
        &self,
        upid: &Upid,
        deadline: Instant,
    ) -> Result<(), PveError> {
        self.tasks.wait(upid, deadline).await.map(|_| ())
    }

    /// Polls `status/current` until `done` holds.
    pub(super) async fn wait_status(
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
                    |pve| pve.status_current(&vm.node, vm.vmid),
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
    pub(super) async fn start(&self, vm: &VmRef, deadline: Instant) -> Result<(), SubstrateError> {
        tracing::info!(vm = %vm, "starting VM");
        let upid = self
            .retry_pve(
                format!("starting VM {vm}"),
                Some(&vm.node),
                deadline,
                |pve| pve.start(&vm.node, vm.vmid),
            )
            .await?;
        match self.wait_task(&upid, "start").await {
            Ok(()) => Ok(()),
            // Started by someone else meanwhile: fine.
            Err(e) if e.is_already_running() => Ok(()),
            // A repeated start (after a lost answer) waited on the first
            // one's config lock: the first start is the one to wait for.
            Err(e) if e.is_lock_timeout() => {
                self.wait_status(vm, "running", |s| s.is_running()).await
            }
            Err(e) => Err(err(format!("starting VM {vm}"), &e)),
        }
    }

    /// `status/current`, refusing VMs without our marker.
    pub(super) async fn managed_status(
        &self,
        vm: &VmRef,
        deadline: Instant,
    ) -> Result<VmStatus, SubstrateError> {
        let st = self
            .retry_raw(Some(&vm.node), deadline, |pve| {
                pve.status_current(&vm.node, vm.vmid)
            })
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

    /// Whether `/nodes` lists `node` as anything but online. PVE has no
    /// online check for a clone with `target` (qemu-server `clone_vm`): it
    /// accepts one to an offline node, whose VM then cannot be started or
    /// reached (595) until the node is back, so the caller asks first. A
    /// node the list does not have is left to PVE to refuse. A list read
    /// within the last poll interval answers: a node that went down since
    /// is the same race as one going down between this check and the POST.
    pub(super) async fn node_offline(
        &self,
        node: &str,
        deadline: Instant,
    ) -> Result<bool, SubstrateError> {
        let mut seen = self.offline_nodes.lock().await;
        let fresh = seen
            .as_ref()
            .filter(|(at, _)| at.elapsed() < self.opts.poll_interval)
            .map(|(_, offline)| Arc::clone(offline));
        let offline = match fresh {
            Some(offline) => offline,
            None => {
                let nodes = self
                    .retry_pve(
                        format!("checking that node {node} is online"),
                        None,
                        deadline,
                        |pve| pve.nodes(),
                    )
                    .await?;
                let offline: Arc<Vec<String>> = Arc::new(
                    nodes
                        .into_iter()
                        .filter(|n| n.status != "online")
                        .map(|n| n.node)
                        .collect(),
                );
                *seen = Some((Instant::now(), Arc::clone(&offline)));
                offline
            }
        };
        Ok(offline.iter().any(|n| n == node))
    }

    /// The lock on VM `vm` when no running task holds it, `None` when it
    /// has none or its holder may still be running. Only the locks this
    /// token's own operations take are judged (`clone`, `migrate`): the
    /// node's task list shows the token its own tasks only, so a backup's
    /// or a snapshot's holder could not be seen, and those locks are
    /// waited out as before. A `clone` lock counts as held while any clone
    /// runs on the node (its task is named after the source, not the new
    /// VM), a `migrate` lock while a migration of the VM does.
    pub(super) async fn stale_lock(
        &self,
        vm: &VmRef,
        deadline: Instant,
    ) -> Result<Option<String>, SubstrateError> {
        let node = Some(vm.node.as_str());
        let st = match self
            .retry_raw(node, deadline, |pve| pve.status_current(&vm.node, vm.vmid))
            .await
        {
            Ok(st) => st,
            Err(e) if e.is_not_found() || e.is_forbidden() => return Ok(None),
            Err(e) => return Err(err_at(format!("reading the lock of VM {vm}"), node, &e)),
        };
        let Some(lock) = st.lock else {
            return Ok(None);
        };
        let (task_type, by_id) = match lock.as_str() {
            "clone" => ("qmclone", false),
            "migrate" => ("qmigrate", true),
            _ => return Ok(None),
        };
        let tasks = self
            .retry_raw(node, deadline, |pve| pve.active_tasks(&vm.node, task_type))
            .await
            .map_err(|e| {
                err_at(
                    format!("listing the tasks running on node {}", vm.node),
                    node,
                    &e,
                )
            })?;
        let vmid = vm.vmid.to_string();
        let held = tasks
            .iter()
            .filter(|t| t.is_running())
            .any(|t| !by_id || t.id.as_deref() == Some(vmid.as_str()));
        Ok((!held).then_some(lock))
    }

    /// Waits until `/nodes` lists `node` as online again, polling `/nodes`
    /// (which the cluster answers whatever node is down) rather than the
    /// node itself, whose calls each hang until the connect gives up. Past
    /// `deadline` the error names the node.
    pub(super) async fn wait_node_online(
        &self,
        node: &str,
        deadline: Instant,
    ) -> Result<(), SubstrateError> {
        let mut attempt = 0;
        loop {
            if !self.node_offline(node, deadline).await? {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(SubstrateError::with_kind(
                    ErrorKind::Transient,
                    format!(
                        "node {node} is offline (GET /nodes) and did not come back within {:?}",
                        self.opts.retry_window
                    ),
                ));
            }
            tracing::debug!(node, attempt, "node is offline; waiting for it");
            self.pause(attempt, deadline).await;
            attempt += 1;
        }
    }

    /// Whether VMID `vmid` exists anywhere in the cluster, whoever can see it:
    /// `GET /cluster/nextid?vmid=N` needs no privilege on the VM and answers N
    /// when free, 400 "VM N already exists" when not. This is how a 403 on a
    /// VM path under a pool-scoped token is told apart: gone, or not visible.
    pub(super) async fn vmid_taken(
        &self,
        vmid: u32,
        deadline: Instant,
    ) -> Result<bool, SubstrateError> {
        let what = format!("checking whether VMID {vmid} is in use");
        let mut attempt = 0;
        loop {
            match self.client.next_id(Some(vmid)).await {
                Ok(_) => return Ok(false),
                Err(e) if e.is_already_exists() => return Ok(true),
                Err(e) if e.is_transient() && Instant::now() < deadline => {
                    self.pause(attempt, deadline).await;
                    attempt += 1;
                }
                Err(e) => return Err(err(what, &e)),
            }
        }
    }

    /// What is at a VMID a clone of ours was started on.
    pub(super) async fn probe(
        &self,
        vm: &VmRef,
        machine_id: &str,
        deadline: Instant,
    ) -> Result<Probe, SubstrateError> {
        match self
            .retry_raw(Some(&vm.node), deadline, |pve| {
                pve.get_config(&vm.node, vm.vmid)
            })
            .await
        {
            Ok(cfg) if owned_by(cfg.description.as_deref(), machine_id, None) => {
                Ok(Probe::Ours(cfg.tags))
            }
            // A temporary config (`lock: clone`, nothing else yet): whose is
            // not known until the worker writes the final one.
            Ok(cfg) if cfg.lock.as_deref() == Some("clone") && cfg.description.is_none() => {
                Ok(Probe::Cloning)
            }
            Ok(_) => Ok(Probe::Foreign),
            // Not on this node (a clone to another node keeps its temporary
            // config on the template's node) or outside the token's pool (pool
            // membership is added at the end of a clone): ask whether the id
            // is in use at all.
            Err(e) if e.is_not_found() || e.is_forbidden() => {
                if self.vmid_taken(vm.vmid, deadline).await? {
                    Ok(Probe::Cloning)
                } else {
                    Ok(Probe::Gone)
                }
            }
            Err(e) => Err(err_at(format!("checking VM {vm}"), Some(&vm.node), &e)),
        }
    }
}

/// The timeline step a task waited for by that name is (see
/// [`Api::wait_task`]); replica staging is no machine's step.
fn task_step(what: &str) -> Option<Step> {
    match what {
        "clone" => Some(Step::Clone),
        "resize" => Some(Step::Resize),
        "start" => Some(Step::Start),
        "stop" => Some(Step::Stop),
        "destroy" => Some(Step::Destroy),
        _ => None,
    }
}
