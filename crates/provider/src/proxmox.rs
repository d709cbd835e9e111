//! The real substrate: a Proxmox VE cluster driven through the `pve` API client.
//!
//! Cost model (API calls per operation, independent of cluster size):
//! Create = 1 inventory read + 1 `nextid` + clone + task polls + 1 config PUT +
//! start + task polls + agent pings (the first Create per template also reads
//! the template's config once, for its disk storage); Configure/Drain =
//! status + ping + exec + exec-status polls; Delete = status + stop + destroy + task polls; a
//! reconcile pass = 1 inventory read plus config reads only for marked VMs that
//! are new or whose tags/name changed since the last pass.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine as _;
use futures::stream::{self, StreamExt, TryStreamExt};
use parking_lot::Mutex;
use pve::{
    machine_tag, CloneParams, ClusterVm, ConfigParams, ExecStatus, FileEncoding, PveClient,
    PveError, Upid, VmStatus,
};
use rand::Rng;
use sha2::{Digest, Sha256};
use tokio::sync::{Mutex as AsyncMutex, OnceCell, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::substrate::{CloneRequest, ManagedVm, Substrate, SubstrateError, VmRef};

/// Tag every VM we create carries.
pub const MANAGED_TAG: &str = "bigfleet";
/// Raw bytes per file-write / exec chunk: 36 KiB base64-encodes to 48 KiB, which
/// stays under the 60 KiB `content` limit and (form-encoded) under the 64 KiB
/// request body limit of older PVE releases.
const CHUNK_RAW: usize = 36 * 1024;
/// Bytes of stderr/stdout quoted in an error.
const OUTPUT_TAIL: usize = 512;
/// Concurrent config reads while indexing new VMs.
const CONFIG_READ_CONCURRENCY: usize = 8;
/// Clone attempts (VMID collisions, storage lock timeouts) before giving up.
const CLONE_ATTEMPTS: u32 = 10;
/// `nextid` probes per reservation.
const VMID_PROBES: u32 = 32;

/// Behaviour knobs of [`PveSubstrate`].
#[derive(Clone, Debug)]
pub struct PveOptions {
    /// Resource pool clones are placed in.
    pub pool: Option<String>,
    /// In-guest path of the bootstrap blob.
    pub bootstrap_path: String,
    /// argv run in the guest; the blob path is appended.
    pub bootstrap_exec: Vec<String>,
    /// Shell command that succeeds once the node is Ready; empty = no readiness gate.
    pub readiness_command: String,
    /// Shell command draining the node; `--grace-period` and `--timeout` are appended.
    pub drain_command: String,
    /// Concurrent clones per (target node, storage of the template's disks):
    /// the storage lock is what parallel clones contend on. At least 1.
    pub max_parallel_clones: usize,
    /// Bound on each PVE worker task (clone, start, stop, destroy).
    pub task_timeout: Duration,
    /// How long to wait for the guest agent to answer after a start.
    pub agent_timeout: Duration,
    /// Bound on the bootstrap hook (and blob upload helpers).
    pub exec_timeout: Duration,
    /// Bound on one readiness probe.
    pub readiness_timeout: Duration,
    /// Passed to the drain command as `--timeout`; the exec is awaited a little longer.
    pub drain_timeout: Duration,
    /// Poll period for tasks, agent pings and exec status.
    pub poll_interval: Duration,
    /// A VMID freed (or abandoned) by this process is not reused for this long.
    pub vmid_cooldown: Duration,
    /// VMIDs this provider allocates from (inclusive).
    pub vmid_range: (u32, u32),
}

impl Default for PveOptions {
    fn default() -> Self {
        PveOptions {
            pool: None,
            bootstrap_path: "/run/bigfleet-bootstrap".into(),
            bootstrap_exec: vec!["/bin/sh".into()],
            readiness_command: String::new(),
            drain_command:
                "kubectl drain \"$(hostname)\" --ignore-daemonsets --delete-emptydir-data".into(),
            max_parallel_clones: 2,
            task_timeout: Duration::from_secs(7 * 60),
            agent_timeout: Duration::from_secs(5 * 60),
            exec_timeout: Duration::from_secs(7 * 60),
            readiness_timeout: Duration::from_secs(60),
            drain_timeout: Duration::from_secs(14 * 60),
            poll_interval: Duration::from_secs(1),
            vmid_cooldown: Duration::from_secs(10 * 60),
            vmid_range: (100, 999_999),
        }
    }
}

impl PveOptions {
    /// Rejects options the substrate cannot work with, naming the problem.
    pub fn validate(&self) -> Result<(), String> {
        if self.bootstrap_path.trim().is_empty() || !self.bootstrap_path.starts_with('/') {
            return Err(format!(
                "--bootstrap-path {:?} must be an absolute in-guest path",
                self.bootstrap_path
            ));
        }
        if self
            .bootstrap_exec
            .first()
            .is_none_or(|a| a.trim().is_empty())
        {
            return Err("--bootstrap-exec must name a program".into());
        }
        if self.drain_command.trim().is_empty() {
            return Err("--drain-command must not be empty".into());
        }
        if self.max_parallel_clones == 0 {
            return Err("--max-parallel-clones must be at least 1".into());
        }
        let (lo, hi) = self.vmid_range;
        if lo < 100 || hi < lo {
            return Err(format!(
                "VMID range {lo}-{hi} is invalid (PVE ids start at 100)"
            ));
        }
        Ok(())
    }
}

/// What the last inventory pass learnt about one VM. A config read is only
/// repeated when the listing shows different tags or name.
#[derive(Clone, Debug)]
struct Known {
    node: String,
    name: Option<String>,
    tags: Vec<String>,
    /// Verbatim machine id from the description marker; `None` = not ours.
    machine_id: Option<String>,
}

#[derive(Default)]
struct VmidState {
    /// Chosen by this process, clone not finished yet.
    reserved: HashSet<u32>,
    /// Freed or abandoned recently; expiry time.
    cooldown: HashMap<u32, std::time::Instant>,
    /// Where the next probe starts (ids grow monotonically within the range).
    hint: Option<u32>,
}

impl VmidState {
    fn blocked(&mut self, id: u32) -> bool {
        let now = std::time::Instant::now();
        self.cooldown.retain(|_, until| *until > now);
        self.reserved.contains(&id) || self.cooldown.contains_key(&id)
    }

    fn next_unblocked(&mut self, from: u32, range: (u32, u32)) -> u32 {
        let mut id = from.max(range.0);
        while id <= range.1 && self.blocked(id) {
            id += 1;
        }
        if id > range.1 {
            range.0
        } else {
            id
        }
    }
}

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

/// A VMID chosen by this process; returned to the pool (with a cool-down)
/// unless [`Reservation::commit`] is called, also when the future is dropped.
struct Reservation<'a> {
    owner: &'a PveSubstrate,
    vmid: u32,
    committed: bool,
}

impl Reservation<'_> {
    fn commit(mut self) {
        self.committed = true;
        self.owner.vmids.lock().reserved.remove(&self.vmid);
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.committed {
            let mut st = self.owner.vmids.lock();
            st.reserved.remove(&self.vmid);
            st.cooldown.insert(
                self.vmid,
                std::time::Instant::now() + self.owner.opts.vmid_cooldown,
            );
        }
    }
}

/// Why a guest command produced no exit status.
#[derive(Debug, thiserror::Error)]
enum ExecError {
    #[error(transparent)]
    Api(#[from] PveError),
    #[error("guest pid {pid} was still running after {timeout:?}")]
    Deadline { pid: u32, timeout: Duration },
    #[error(
        "the exit status of guest pid {pid} was lost: the agent's answer failed ({first}) and \
         qemu-ga forgets a pid once it has reported its exit, so success cannot be confirmed"
    )]
    Lost { pid: u32, first: String },
}

fn is_unknown_pid(e: &PveError) -> bool {
    let m = e.to_string().to_ascii_lowercase();
    m.contains("invalid parameter 'pid'") || m.contains("no such pid")
}

fn err(context: impl std::fmt::Display, e: &dyn std::fmt::Display) -> SubstrateError {
    SubstrateError::new(format!("{context}: {e}"))
}

/// The VM is recognisable as ours without reading its config.
fn looks_managed(tags: &[String], name: Option<&str>) -> bool {
    tags.iter().any(|t| t == MANAGED_TAG) || name.is_some_and(|n| n.starts_with("bigfleet-"))
}

/// The description marker: `BigFleet managed VM. machine_id=<id> operation_id=<op>`.
pub fn marker_description(machine_id: &str, operation_id: &str) -> String {
    format!("BigFleet managed VM. machine_id={machine_id} operation_id={operation_id}")
}

/// The verbatim machine id from a description marker.
pub fn parse_marker(description: &str) -> Option<String> {
    if !description.contains("BigFleet managed VM") {
        return None;
    }
    description
        .split_whitespace()
        .find_map(|w| w.strip_prefix("machine_id="))
        .filter(|id| !id.is_empty())
        .map(str::to_string)
}

/// `bigfleet-<type>-<id>` as a DNS label: lowercase `[a-z0-9-]`, no leading,
/// trailing or repeated `-`, at most 63 characters.
pub fn vm_name(instance_type: &str, machine_id: &str) -> String {
    let raw = format!("bigfleet-{instance_type}-{machine_id}").to_ascii_lowercase();
    let mut out = String::with_capacity(raw.len());
    for c in raw.chars() {
        let c = if c.is_ascii_alphanumeric() { c } else { '-' };
        if c == '-' && (out.is_empty() || out.ends_with('-')) {
            continue;
        }
        out.push(c);
    }
    if out.len() > 63 {
        // Keep the tail (the slot index) distinguishable: `bigfleet-` + the last chars.
        let tail_len = 63 - "bigfleet-".len();
        let tail = &out[out.len() - tail_len..];
        out = format!("bigfleet-{}", tail.trim_start_matches('-'));
    }
    out.trim_end_matches('-').to_string()
}

/// The last `OUTPUT_TAIL` bytes of guest output, cut on a character boundary.
fn tail(s: &str) -> &str {
    let s = s.trim_end();
    if s.len() <= OUTPUT_TAIL {
        return s;
    }
    let mut start = s.len() - OUTPUT_TAIL;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

/// Ok for exit 0; otherwise an error with the exit code / signal and the tail of stderr.
fn exec_outcome(what: &str, st: &ExecStatus) -> Result<(), SubstrateError> {
    let mut msg = match (st.exitcode, st.signal) {
        (Some(0), None) => return Ok(()),
        (_, Some(sig)) => format!("{what} was killed by signal {sig}"),
        (Some(code), None) => format!("{what} exited {code}"),
        (None, None) => format!("{what} ended without an exit status"),
    };
    let err = st.err_data.as_deref().map(tail).unwrap_or_default();
    let out = st.out_data.as_deref().map(tail).unwrap_or_default();
    if !err.is_empty() {
        msg.push_str(&format!(": stderr: {err}"));
        if st.err_truncated {
            msg.push_str(" (stderr was truncated by the guest agent)");
        }
    } else if !out.is_empty() {
        msg.push_str(&format!(": stdout: {out}"));
        if st.out_truncated {
            msg.push_str(" (stdout was truncated by the guest agent)");
        }
    }
    Err(SubstrateError::new(msg))
}

/// Clone-slot key for a template's disk storages (sorted, deduplicated): one
/// storage is its id; several are joined into one stable key, so templates
/// spanning the same set of storages share a bound; none (a diskless
/// template) is a fixed placeholder.
fn storage_key(storages: &[String]) -> String {
    if storages.is_empty() {
        "(no disks)".to_string()
    } else {
        storages.join("+")
    }
}

fn is_locked(e: &PveError) -> bool {
    e.is_lock_timeout()
        || matches!(e, PveError::Api { message, .. } if message.contains("is locked"))
}

/// A failure after which the request may or may not have been applied.
fn ambiguous(e: &PveError) -> bool {
    matches!(
        e,
        PveError::Timeout { .. } | PveError::Transport { connect: false, .. }
    )
}

/// Failures worth polling through while a VM boots.
fn agent_transient(e: &PveError) -> bool {
    e.is_agent_not_running()
        || e.is_vm_not_running()
        || e.is_timeout()
        || e.is_transport()
        || e.is_node_unreachable()
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

    /// One `/cluster/resources` read. Configs are read (and cached) only for
    /// VMs that look managed, pass `want`, and are new or changed since last seen.
    /// Returns the listing and the machine id of every marked VM in it.
    async fn scan(
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
        let read: Vec<(ClusterVm, Option<String>)> = stream::iter(to_read)
            .map(|v| async move {
                match self.client.get_config(&v.node, v.vmid).await {
                    Ok(cfg) => {
                        let id = cfg.description.as_deref().and_then(parse_marker);
                        Ok(Some((v, id)))
                    }
                    // Destroyed between the listing and the read.
                    Err(e) if e.is_not_found() => Ok(None),
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

        let mut index = self.index.lock();
        for (v, machine_id) in read {
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
        Ok((list, marked))
    }

    fn forget(&self, vmid: u32) {
        self.index.lock().remove(&vmid);
        self.pending.lock().retain(|_, vm| vm.vmid != vmid);
        self.vmids
            .lock()
            .cooldown
            .insert(vmid, std::time::Instant::now() + self.opts.vmid_cooldown);
    }

    /// Finds the node a VMID is on now (after a 'does not exist' on the node we
    /// expected); `None` if the cluster no longer has it.
    async fn locate(&self, vmid: u32) -> Result<Option<ClusterVm>, SubstrateError> {
        let list = self
            .client
            .cluster_resources_vms()
            .await
            .map_err(|e| err("listing the cluster's VMs", &e))?;
        Ok(list.into_iter().find(|v| v.vmid == vmid && !v.template))
    }

    /// `status/current`, refusing VMs without our marker.
    async fn managed_status(&self, vm: &VmRef) -> Result<VmStatus, SubstrateError> {
        let st = self
            .client
            .status_current(&vm.node, vm.vmid)
            .await
            .map_err(|e| {
                if e.is_not_found() {
                    SubstrateError::new(format!(
                        "VM {vm} does not exist (destroyed, or moved to another node; the next reconcile updates its host): {e}"
                    ))
                } else {
                    err(format!("reading the status of VM {vm}"), &e)
                }
            })?;
        if !looks_managed(&st.tags, st.name.as_deref()) {
            return Err(SubstrateError::new(format!(
                "VM {vm} does not carry the {MANAGED_TAG} marker; refusing to touch it"
            )));
        }
        Ok(st)
    }

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

    /// Pings the agent until it answers, polling through boot-time failures.
    async fn wait_agent(&self, vm: &VmRef) -> Result<(), SubstrateError> {
        let deadline = Instant::now() + self.opts.agent_timeout;
        loop {
            match self.client.agent_ping(&vm.node, vm.vmid).await {
                Ok(()) => return Ok(()),
                Err(e) if agent_transient(&e) => {
                    if Instant::now() >= deadline {
                        return Err(SubstrateError::new(format!(
                            "the guest agent of VM {vm} did not answer within {:?} (last error: {e}); is qemu-guest-agent installed and enabled in the template?",
                            self.opts.agent_timeout
                        )));
                    }
                }
                Err(e) => return Err(err(format!("pinging the guest agent of VM {vm}"), &e)),
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

    /// Runs `argv` in the guest and waits for it to exit (bounded by `timeout`).
    async fn run(
        &self,
        vm: &VmRef,
        argv: &[String],
        input: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<ExecStatus, ExecError> {
        let pid = self
            .client
            .agent_exec(&vm.node, vm.vmid, argv, input)
            .await?;
        let deadline = Instant::now() + timeout;
        let mut delay = self.first_poll();
        let mut dropped: Option<String> = None;
        loop {
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(self.opts.poll_interval);
            match self.client.agent_exec_status(&vm.node, vm.vmid, pid).await {
                Ok(st) if st.exited => return Ok(st),
                Ok(_) => {}
                // The reply carrying the exit was lost and qemu-ga has forgotten the pid.
                Err(e) if dropped.is_some() && is_unknown_pid(&e) => {
                    return Err(ExecError::Lost {
                        pid,
                        first: dropped.unwrap_or_default(),
                    })
                }
                Err(e) if agent_transient(&e) && Instant::now() < deadline => {
                    dropped = Some(e.to_string());
                }
                Err(e) => return Err(e.into()),
            }
            if Instant::now() >= deadline {
                return Err(ExecError::Deadline { pid, timeout });
            }
        }
    }

    /// Delivers the blob to `path`: one file-write when small, else a first
    /// file-write plus appends through `base64 -d`, verified by sha256.
    async fn write_blob(&self, vm: &VmRef, path: &str, blob: &[u8]) -> Result<(), SubstrateError> {
        let ctx = || {
            format!(
                "writing the bootstrap blob ({} bytes) to {path} in VM {vm}",
                blob.len()
            )
        };
        let mut chunks = blob.chunks(CHUNK_RAW);
        let first = chunks.next().unwrap_or_default();
        self.client
            .agent_file_write(&vm.node, vm.vmid, path, first, FileEncoding::Base64)
            .await
            .map_err(|e| err(ctx(), &e))?;
        if blob.len() <= CHUNK_RAW {
            return Ok(());
        }
        let append: Vec<String> = vec![
            "/bin/sh".into(),
            "-c".into(),
            "base64 -d >> \"$1\"".into(),
            "bigfleet-append".into(),
            path.into(),
        ];
        for chunk in chunks {
            let b64 = base64::engine::general_purpose::STANDARD.encode(chunk);
            let st = self
                .run(vm, &append, Some(b64.as_bytes()), self.opts.exec_timeout)
                .await
                .map_err(|e| err(ctx(), &e))?;
            exec_outcome("appending a bootstrap chunk", &st)
                .map_err(|e| SubstrateError::new(format!("{}: {e}", ctx())))?;
        }
        let want = hex::encode(Sha256::digest(blob));
        let st = self
            .run(
                vm,
                &["sha256sum".to_string(), path.to_string()],
                None,
                self.opts.exec_timeout,
            )
            .await
            .map_err(|e| err(ctx(), &e))?;
        exec_outcome("sha256sum", &st)
            .map_err(|e| SubstrateError::new(format!("{}: {e}", ctx())))?;
        let got = st
            .out_data
            .as_deref()
            .and_then(|o| o.split_whitespace().next())
            .unwrap_or_default();
        if !got.eq_ignore_ascii_case(&want) {
            return Err(SubstrateError::new(format!(
                "{}: checksum mismatch after the chunked upload (guest has sha256 {got:?})",
                ctx()
            )));
        }
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

    async fn clone_permit(
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

    /// Picks a VMID no other clone of this process is using and PVE reports free.
    async fn reserve_vmid(&self) -> Result<Reservation<'_>, SubstrateError> {
        let _choice = self.vmid_choice.lock().await;
        let range = self.opts.vmid_range;
        let mut candidate = self.vmids.lock().hint;
        let mut tried_first_free = false;
        for _ in 0..VMID_PROBES {
            match self.client.next_id(candidate).await {
                Ok(id) => {
                    let mut st = self.vmids.lock();
                    if id >= range.0 && id <= range.1 && !st.blocked(id) {
                        st.reserved.insert(id);
                        st.hint = if id < range.1 { Some(id + 1) } else { None };
                        return Ok(Reservation {
                            owner: self,
                            vmid: id,
                            committed: false,
                        });
                    }
                    candidate = Some(st.next_unblocked(id.saturating_add(1), range));
                }
                Err(e) if e.is_already_exists() => {
                    // Taken: ask for PVE's first free id once, then walk upwards.
                    candidate = match candidate {
                        Some(_) if !tried_first_free => {
                            tried_first_free = true;
                            None
                        }
                        Some(c) => Some(self.vmids.lock().next_unblocked(c + 1, range)),
                        None => Some(range.0),
                    };
                }
                Err(e) => return Err(err("choosing a free VMID", &e)),
            }
        }
        Err(SubstrateError::new(format!(
            "no free VMID found in {}-{} after {VMID_PROBES} probes",
            range.0, range.1
        )))
    }

    /// An existing VM marked with this machine id, if any: the in-process
    /// record of clones we started, then the (possibly seconds-stale) inventory.
    async fn find_existing(
        &self,
        req: &CloneRequest,
        expected_name: &str,
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
            return Ok((Some((vm, v.tags.clone())), list));
        }
        if let Some(vm) = pending {
            // Not in the inventory yet: ask the VM itself.
            match self.client.get_config(&vm.node, vm.vmid).await {
                Ok(cfg)
                    if cfg.description.as_deref().and_then(parse_marker).as_deref()
                        == Some(req.machine_id.as_str()) =>
                {
                    return Ok((Some((vm, cfg.tags)), list));
                }
                Ok(_) => {}
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(err(format!("checking VM {vm}"), &e)),
            }
            self.pending.lock().remove(&req.machine_id);
        }
        Ok((None, list))
    }

    fn template_node(&self, template: u32, list: &[ClusterVm]) -> Result<String, SubstrateError> {
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

    /// The clone-slot key of a template's disk storages. A full clone without
    /// `storage` lands on the same storages, so their locks are what parallel
    /// clones contend on. One config read per template per process; a failed
    /// read fails the Create (and is retried by the next one).
    async fn template_storage(
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
    async fn clone_new(
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
                Err(e) if ambiguous(&e) => {
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
    async fn remove_failed_clone(&self, vm: &VmRef) -> Result<(), SubstrateError> {
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
    async fn mark(&self, vm: &VmRef, req: &CloneRequest) -> Result<(), SubstrateError> {
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
                Err(e) if is_locked(&e) && Instant::now() < deadline => {
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
            .map_err(|e| err(format!("running the {what} in VM {vm}"), &e))?;
        exec_outcome(&what, &st).map_err(|e| SubstrateError::new(format!("VM {vm}: {e}")))
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
            Err(ExecError::Api(e)) if agent_transient(&e) => Ok(false),
            Err(e) => Err(err(format!("probing readiness of VM {vm}"), &e)),
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
            .map_err(|e| err(format!("draining VM {vm}"), &e))?;
        exec_outcome("drain command", &st).map_err(|e| SubstrateError::new(format!("VM {vm}: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_dns_labels() {
        let n = vm_name("pve.medium", "proxmox-dc1/OnDemand/pve.medium/pve1/007");
        assert_eq!(
            n,
            "bigfleet-pve-medium-proxmox-dc1-ondemand-pve-medium-pve1-007"
        );
        assert!(n.len() <= 63);
        let long = vm_name("t", &"x/".repeat(80));
        assert!(long.len() <= 63 && long.starts_with("bigfleet-") && !long.ends_with('-'));
        assert!(long
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'));
    }

    #[test]
    fn marker_round_trip() {
        let d = marker_description("Cap/OnDemand/t/z/001", "op-1");
        assert_eq!(parse_marker(&d).as_deref(), Some("Cap/OnDemand/t/z/001"));
        assert_eq!(
            parse_marker(&format!("{d}\n")).as_deref(),
            Some("Cap/OnDemand/t/z/001")
        );
        assert_eq!(parse_marker("machine_id=x but no marker"), None);
        assert_eq!(parse_marker("BigFleet managed VM. machine_id="), None);
    }

    #[test]
    fn exec_errors_quote_exit_and_stderr_tail() {
        let st = ExecStatus {
            exited: true,
            exitcode: Some(3),
            err_data: Some(format!("{}boom\n", "x".repeat(2000))),
            err_truncated: true,
            ..ExecStatus::default()
        };
        let e = exec_outcome("hook", &st).unwrap_err().0;
        assert!(e.starts_with("hook exited 3: stderr: "), "{e}");
        assert!(e.contains("boom") && e.contains("truncated"), "{e}");
        assert!(e.len() < 700, "{}", e.len());
        let ok = ExecStatus {
            exited: true,
            exitcode: Some(0),
            ..ExecStatus::default()
        };
        assert!(exec_outcome("hook", &ok).is_ok());
        let sig = ExecStatus {
            exited: true,
            signal: Some(9),
            ..ExecStatus::default()
        };
        assert!(exec_outcome("hook", &sig)
            .unwrap_err()
            .0
            .contains("signal 9"));
    }

    #[test]
    fn vmid_state_skips_reserved_and_cooling_ids() {
        let mut st = VmidState::default();
        st.reserved.insert(100);
        st.cooldown
            .insert(101, std::time::Instant::now() + Duration::from_secs(60));
        st.cooldown
            .insert(102, std::time::Instant::now() - Duration::from_secs(1));
        assert_eq!(st.next_unblocked(100, (100, 999)), 102);
        assert!(
            !st.cooldown.contains_key(&102),
            "expired entries are pruned"
        );
        assert_eq!(st.next_unblocked(999, (100, 999)), 999);
        st.reserved.insert(999);
        assert_eq!(st.next_unblocked(999, (100, 999)), 100);
    }

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

    #[test]
    fn options_validation() {
        assert!(PveOptions::default().validate().is_ok());
        let bad = PveOptions {
            bootstrap_exec: vec![],
            ..PveOptions::default()
        };
        assert!(bad.validate().unwrap_err().contains("--bootstrap-exec"));
        let bad = PveOptions {
            max_parallel_clones: 0,
            ..PveOptions::default()
        };
        assert!(bad.validate().is_err());
    }
}
