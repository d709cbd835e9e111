//! Per-node template replicas: when a template's disks are on local storage
//! of another node, Creates on this node clone from a copy of it here,
//! staged once by the provider (clone on the template's node, offline
//! migration with the local disks, conversion to a template).
//!
//! A replica is ours only by its description marker, which names the source
//! template and the source's config digest at staging time; a copy whose
//! digest differs from the source's is stale and is no longer used (and is
//! replaced by the next staging). Templates without the marker, however
//! they look, are never touched. Stagings of one (template, node) are
//! single-flight: concurrent Creates share one, and its outcome.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use pve::{CloneParams, ClusterVm, ConfigParams, MigrateParams, PveError, Upid};
use tokio::sync::Mutex as AsyncMutex;
use tokio::time::Instant;

use super::api::{err_at, kind_of, Api};
use super::marker::{
    parse_replica_marker, replica_description, replica_name, replica_target, TagPolicy, REPLICA_TAG,
};
use super::options::PveOptions;
use super::placement::{Layout, Placement};
use super::slots::CloneSlots;
use super::storage_guard::{SpaceRequest, StorageGuard};
use super::vmid::{VmidHold, Vmids};
use crate::substrate::{CloneRequest, SubstrateError, VmRef};

/// What a replica's config said when last read.
#[derive(Clone, Debug)]
struct ReplicaInfo {
    /// Where it is now.
    node: String,
    /// The node it is for.
    target: String,
    source: u32,
    digest: String,
    /// Converted (a staging that died half-way leaves a plain VM).
    template: bool,
    /// When this process staged it (a listing taken before may not show it yet).
    staged: Option<std::time::Instant>,
}

/// How long a replica this process staged is trusted without showing up in
/// the inventory (PVE lists a new VM within seconds).
const STAGED_GRACE: std::time::Duration = std::time::Duration::from_secs(60);

/// One (template, node)'s staging: Creates that waited for a staging take
/// its outcome instead of starting another.
#[derive(Default)]
struct Flight {
    finished: AtomicU64,
    last: AsyncMutex<Option<Result<u32, SubstrateError>>>,
}

/// The replicas this process knows of and the stagings in flight.
pub(super) struct Replicas {
    api: Arc<Api>,
    /// The options this part reads.
    opts: Arc<PveOptions>,
    vmids: Arc<Vmids>,
    slots: Arc<CloneSlots>,
    placement: Arc<Placement>,
    storage: Arc<StorageGuard>,
    tags: Arc<TagPolicy>,
    flights: Mutex<HashMap<(u32, String), Arc<Flight>>>,
    /// Replicas (ours, by marker) by VMID; VMIDs read and found not ours
    /// map to `None` so they are not read again.
    known: Mutex<HashMap<u32, Option<ReplicaInfo>>>,
}

/// Why step 2 failed: PVE refused or failed the clone of this VMID, or
/// something before it did.
enum CloneFailure {
    Pve(u32, PveError),
    Other(SubstrateError),
}

/// A failed step of a staging: the step, PVE's error, the task log's word.
type StepFailure = (Step, PveError, Option<String>);

/// The steps of a staging, named in `last_error` when one fails.
#[derive(Clone, Copy)]
enum Step {
    Room,
    Clone,
    Tag,
    Migrate,
    Convert,
}

impl Step {
    fn describe(self, source: u32, vmid: u32, from: &str, to: &str) -> String {
        match self {
            Step::Room => format!("step 1 of 5, checking room on nodes {from} and {to}"),
            Step::Clone => {
                format!("step 2 of 5, cloning template {source} to VM {vmid} on node {from}")
            }
            Step::Tag => format!("step 3 of 5, tagging VM {vmid}"),
            Step::Migrate => format!(
                "step 4 of 5, migrating VM {vmid} offline (its disks too, where they are local) from \
                 node {from} to node {to}"
            ),
            Step::Convert => {
                format!("step 5 of 5, converting VM {vmid} on node {to} to a template")
            }
        }
    }
}

impl Replicas {
    pub(super) fn new(
        api: Arc<Api>,
        opts: Arc<PveOptions>,
        vmids: Arc<Vmids>,
        slots: Arc<CloneSlots>,
        placement: Arc<Placement>,
        storage: Arc<StorageGuard>,
        tags: Arc<TagPolicy>,
    ) -> Replicas {
        Replicas {
            api,
            opts,
            vmids,
            slots,
            placement,
            storage,
            tags,
            flights: Mutex::default(),
            known: Mutex::default(),
        }
    }

    /// The replica of `req.template_vmid` on `req.node` to clone from,
    /// staging (or refreshing) it first when there is no fresh one; with the
    /// template's layout at its current digest. One config read of the
    /// source per call: that is what tells a fresh replica from a stale one.
    pub(super) async fn for_create(
        &self,
        req: &CloneRequest,
        template_node: &str,
        list: &[ClusterVm],
        deadline: Instant,
    ) -> Result<(u32, Arc<Layout>), SubstrateError> {
        let source = req.template_vmid;
        let node = req.node.as_str();
        let mut attempt = 0;
        let cfg = loop {
            let cfg = self
                .api
                .retry_pve(
                    format!("reading the config of template {source} on node {template_node}"),
                    Some(template_node),
                    deadline,
                    |pve| pve.get_config(template_node, source),
                )
                .await?;
            let Some(lock) = cfg.lock.clone() else {
                break cfg;
            };
            // A lock (vzdump's `lock: backup`) is a line of the config, so
            // it changes the digest without changing the template: no
            // staleness decision while it holds. A copy we have serves;
            // without one, staging waits for the lock to go (a clone of a
            // locked template fails), and then reads the digest again.
            self.learn_replicas(node, template_node, list, deadline)
                .await?;
            if let Some(vmid) = self.newest_replica(source, node, None) {
                tracing::debug!(template = source, node, replica = vmid, lock = %lock,
                    "template locked; cloning from the copy staged before");
                let layout = self
                    .placement
                    .layout(source, template_node, None, deadline)
                    .await?;
                return Ok((vmid, layout));
            }
            if Instant::now() >= deadline {
                return Err(SubstrateError::with_kind(
                    providerkit::ErrorKind::Transient,
                    format!(
                        "template {source} on node {template_node} stayed locked ({lock}) until the \
                         deadline, so no copy of it could be staged on node {node}; a backup job holds \
                         this lock while it runs"
                    ),
                ));
            }
            tracing::info!(template = source, node, lock = %lock, "template locked; waiting to stage its copy");
            self.api.pause(attempt, deadline).await;
            attempt += 1;
        };
        let digest = cfg.digest.clone().unwrap_or_default();
        let layout = self
            .placement
            .layout(source, template_node, Some(&digest), deadline)
            .await?;
        self.learn_replicas(node, template_node, list, deadline)
            .await?;
        if let Some(vmid) = self.newest_replica(source, node, Some(&digest)) {
            return Ok((vmid, layout));
        }
        let flight = Arc::clone(
            self.flights
                .lock()
                .entry((source, node.to_string()))
                .or_default(),
        );
        let seen = flight.finished.load(Ordering::SeqCst);
        let mut last = flight.last.lock().await;
        if flight.finished.load(Ordering::SeqCst) != seen {
            // A staging ended while we waited: share its outcome.
            if let Some(outcome) = last.clone() {
                return outcome.map(|vmid| (vmid, Arc::clone(&layout)));
            }
        }
        // A staging that ended before this Create listed the cluster.
        if let Some(vmid) = self.newest_replica(source, node, Some(&digest)) {
            return Ok((vmid, layout));
        }
        let outcome = self
            .stage_replica(req, template_node, &digest, &layout, deadline)
            .await;
        if let Err(e) = &outcome {
            tracing::warn!(template = source, node, error = %e, "staging a template replica failed; the next Create retries it");
        }
        *last = Some(outcome.clone());
        flight.finished.fetch_add(1, Ordering::SeqCst);
        outcome.map(|vmid| (vmid, layout))
    }

    /// Reads the config of replica-looking VMs on `node` not read before
    /// (tag or name; the marker decides).
    async fn learn_replicas(
        &self,
        node: &str,
        template_node: &str,
        list: &[ClusterVm],
        deadline: Instant,
    ) -> Result<(), SubstrateError> {
        let unread: Vec<&ClusterVm> = {
            let mut known = self.known.lock();
            // Gone from the cluster (destroyed out of band): forget it, so the
            // next staging replaces it rather than Creates cloning nothing.
            known.retain(|vmid, i| {
                list.iter().any(|v| v.vmid == *vmid)
                    || i.as_ref()
                        .and_then(|i| i.staged)
                        .is_some_and(|t| t.elapsed() < STAGED_GRACE)
            });
            list.iter()
                // The template's node too: a staging cut short (a restart)
                // leaves its copy there.
                .filter(|v| {
                    (v.node == node || v.node == template_node) && !known.contains_key(&v.vmid)
                })
                .filter(|v| {
                    v.tags.iter().any(|t| t == REPLICA_TAG)
                        || v.name
                            .as_deref()
                            .is_some_and(|n| n.starts_with("bigfleet-replica-"))
                })
                .collect()
        };
        for v in unread {
            let info = match self
                .api
                .retry_raw(Some(node), deadline, |pve| pve.get_config(&v.node, v.vmid))
                .await
            {
                Ok(cfg) => cfg
                    .description
                    .as_deref()
                    .and_then(parse_replica_marker)
                    .map(|(source, digest)| ReplicaInfo {
                        node: v.node.clone(),
                        target: cfg
                            .description
                            .as_deref()
                            .and_then(replica_target)
                            .unwrap_or_else(|| v.node.clone()),
                        source,
                        digest,
                        template: cfg.template.unwrap_or(false) && cfg.lock.is_none(),
                        staged: None,
                    }),
                Err(e) if e.is_not_found() || e.is_forbidden() => None,
                Err(e) => {
                    return Err(err_at(
                        format!("reading the config of VM {}/{}", v.node, v.vmid),
                        Some(node),
                        &e,
                    ))
                }
            };
            if info.is_none() {
                tracing::debug!(
                    vmid = v.vmid,
                    node,
                    "replica-looking VM without our replica marker: not ours, never touched"
                );
            }
            self.known.lock().insert(v.vmid, info);
        }
        Ok(())
    }

    /// Drops what is known of a replica (it is gone).
    pub(super) fn forget(&self, vmid: u32) {
        self.known.lock().remove(&vmid);
    }

    /// The newest converted replica of `source` on `node` made at `digest`;
    /// with `None`, whatever digest it was staged at.
    fn newest_replica(&self, source: u32, node: &str, digest: Option<&str>) -> Option<u32> {
        self.known
            .lock()
            .iter()
            .filter_map(|(vmid, i)| i.as_ref().map(|i| (*vmid, i)))
            .filter(|(_, i)| i.node == node && i.target == node && i.source == source)
            .filter(|(_, i)| i.template && digest.is_none_or(|d| i.digest == d))
            .map(|(vmid, _)| vmid)
            .max()
    }

    /// Our replicas of `source` for `node` that are not fresh at `digest`
    /// (stale, half-staged, or left on the template's node), where they are.
    fn stale_replicas(&self, source: u32, node: &str, digest: &str) -> Vec<VmRef> {
        self.known
            .lock()
            .iter()
            .filter_map(|(vmid, i)| i.as_ref().map(|i| (*vmid, i)))
            .filter(|(_, i)| i.target == node && i.source == source)
            .filter(|(_, i)| !i.template || i.digest != digest || i.node != node)
            .map(|(vmid, i)| VmRef {
                node: i.node.clone(),
                vmid,
            })
            .collect()
    }

    /// Stages a fresh replica, replacing stale ones. A failure names the
    /// step and removes what the staging made.
    async fn stage_replica(
        &self,
        req: &CloneRequest,
        template_node: &str,
        digest: &str,
        layout: &Layout,
        deadline: Instant,
    ) -> Result<u32, SubstrateError> {
        let source = req.template_vmid;
        let node = req.node.as_str();
        let shared = layout.shared(
            &*self
                .placement
                .node_storages(template_node, deadline)
                .await?,
        );
        let why = if shared {
            // Only a clone on the node itself may use the node's own storage.
            "so that clones on the node can use its own storage".to_string()
        } else {
            format!("its disks are on local storage of node {template_node}")
        };
        let context = |step: Step, vmid: u32| {
            format!(
                "staging a copy of template {source} ({why}) on node {node} failed at {}",
                step.describe(source, vmid, template_node, node)
            )
        };
        // A copy of shared disks stays on them: the migration moves only
        // the config, so it names no target storage (which would also need
        // VM.Config.Disk for nothing).
        let target_storage = if shared {
            None
        } else {
            self.opts.node_storage.get(node).cloned()
        };
        // The clone lands on the template's storage first, then (local
        // disks) on the node's storage, or the same id, there.
        let mut at_template: BTreeMap<String, u64> = BTreeMap::new();
        let mut at_node: BTreeMap<String, u64> = BTreeMap::new();
        for (s, bytes) in &layout.disks {
            *at_template.entry(s.clone()).or_default() += bytes;
            if !shared {
                let to = target_storage.clone().unwrap_or_else(|| s.clone());
                *at_node.entry(to).or_default() += bytes;
            }
        }
        let mut room = Vec::new();
        for (n, needs) in [(template_node, &at_template), (node, &at_node)] {
            if needs.is_empty() {
                continue;
            }
            // Each side is a claim of its own: one holder per side.
            let holder = format!("replica of template {source} for node {node}, on node {n}");
            let claim = self
                .storage
                .claim(
                    &SpaceRequest {
                        holder: &holder,
                        node: n,
                        needs,
                        what: format!("a copy of template {source} for node {node}"),
                    },
                    deadline,
                )
                .await
                .map_err(|e| e.into_substrate().context(context(Step::Room, 0)))?;
            room.extend(claim);
        }
        tracing::info!(
            template = source,
            template_node,
            node,
            "staging a template replica"
        );
        let (res, here) = self
            .clone_for_replica(source, template_node, node, digest, deadline)
            .await
            .map_err(|f| match f {
                CloneFailure::Pve(vmid, e) => {
                    SubstrateError::caused_by(kind_of(&e), context(Step::Clone, vmid), e)
                }
                CloneFailure::Other(e) => e.context(context(Step::Clone, 0)),
            })?;
        let vmid = res.vmid;
        res.commit();
        let staged = self
            .finish_staging(
                &here,
                node,
                source,
                target_storage,
                &layout.inherited.tags,
                deadline,
            )
            .await;
        match staged {
            Ok(()) => {
                self.known.lock().insert(
                    vmid,
                    Some(ReplicaInfo {
                        node: node.to_string(),
                        target: node.to_string(),
                        source,
                        digest: digest.to_string(),
                        template: true,
                        staged: Some(std::time::Instant::now()),
                    }),
                );
                tracing::info!(
                    template = source,
                    node,
                    replica = vmid,
                    "template replica staged"
                );
                // Only now that its successor serves: a failed staging
                // (a template locked by a backup, a full storage) must not
                // cost the node the copy it had.
                for old in self.stale_replicas(source, node, digest) {
                    self.remove_replica(&old, source, deadline).await;
                }
                Ok(vmid)
            }
            Err((step, e, log)) => {
                // Wherever it got to: the migration moves it, or not.
                for n in [node, template_node] {
                    let vm = VmRef {
                        node: n.to_string(),
                        vmid,
                    };
                    self.remove_replica(&vm, source, deadline).await;
                }
                let mut ctx = context(step, vmid);
                if let Some(log) = log {
                    ctx = format!("{ctx} ({log})");
                }
                Err(SubstrateError::caused_by(kind_of(&e), ctx, e))
            }
        }
    }

    /// Step 2: a full clone of the template on its own node, under the same
    /// clone slots as Creates there (the storage lock is shared). VMID
    /// collisions move on to a fresh id; storage lock timeouts back off and
    /// retry until `deadline`. A failed worker's leftover (ours by marker)
    /// is removed.
    async fn clone_for_replica(
        &self,
        source: u32,
        template_node: &str,
        node: &str,
        digest: &str,
        deadline: Instant,
    ) -> Result<(VmidHold<'_>, VmRef), CloneFailure> {
        let domain = self
            .placement
            .slot_domain(source, template_node, None, deadline)
            .await
            .map_err(CloneFailure::Other)?;
        let mut permit = self
            .slots
            .permit(template_node, &domain)
            .await
            .map_err(CloneFailure::Other)?;
        let mut attempt = 0;
        loop {
            let res = self
                .vmids
                .reserve(deadline)
                .await
                .map_err(CloneFailure::Other)?;
            let vm = VmRef {
                node: template_node.to_string(),
                vmid: res.vmid,
            };
            let params = CloneParams {
                newid: res.vmid,
                name: Some(replica_name(source, node)),
                description: Some(replica_description(source, digest, node)),
                pool: self.opts.pool.clone(),
                full: Some(true),
                storage: None,
                target: None,
            };
            let posted = Instant::now();
            let outcome = match self
                .api
                .once(|pve| pve.clone_vm(template_node, source, &params))
                .await
            {
                Ok(upid) => self.api.wait_task(&upid, "replica clone").await,
                Err(e) => Err(e),
            };
            let e = match outcome {
                Ok(()) => {
                    // Timed like a Create's clone: the same storage, the
                    // same slots.
                    permit.finished(source, posted.elapsed());
                    return Ok((res, vm));
                }
                Err(e) => e,
            };
            self.remove_replica(&vm, source, deadline).await;
            // `is_locked`: a backup may start between the config read and
            // the clone.
            let retry = e.is_vmid_collision(res.vmid) || e.is_locked() || e.is_transient();
            if !retry || Instant::now() >= deadline {
                return Err(CloneFailure::Pve(res.vmid, e));
            }
            tracing::info!(vm = %vm, error = %e, "replica clone failed transiently; retrying");
            if e.is_vmid_collision(res.vmid) {
                self.vmids.guessed_wrong();
            } else if e.is_storage_lock_timeout() {
                // As a Create's clone does: the slots learn of it, and the
                // slot goes back while this one backs off.
                permit.lock_timeout();
                drop(permit);
                self.api.pause(attempt, deadline).await;
                attempt += 1;
                permit = self
                    .slots
                    .permit(template_node, &domain)
                    .await
                    .map_err(CloneFailure::Other)?;
            } else {
                self.api.pause(attempt, deadline).await;
                attempt += 1;
            }
        }
    }

    /// Tag, migrate, convert: steps 3 to 5. A failure is the step, PVE's
    /// error, and what the task log adds.
    async fn finish_staging(
        &self,
        vm: &VmRef,
        node: &str,
        source: u32,
        target_storage: Option<String>,
        template_tags: &[String],
        deadline: Instant,
    ) -> Result<(), StepFailure> {
        let fail = |step: Step| move |e: PveError| (step, e, None);
        // Ours beside the template's (which the copy carries): PVE checks
        // tags removed as well as added (`assert_tag_permissions`), so
        // replacing a registered or unlisted template tag would be refused.
        let mut tags = template_tags.to_vec();
        if !tags.iter().any(|t| t == REPLICA_TAG) {
            tags.push(REPLICA_TAG.to_string());
        }
        // A protected template's copy is protected too (PVE copies the
        // flag), and could then never be replaced: clear it with the tag.
        let mut params = ConfigParams {
            tags: (!self.tags.restricted()).then_some(tags),
            delete: vec!["protection".to_string()],
            ..ConfigParams::default()
        };
        loop {
            match self
                .api
                .retry_raw(Some(&vm.node), deadline, |pve| {
                    pve.set_config_sync(&vm.node, vm.vmid, &params)
                })
                .await
            {
                Ok(()) => break,
                // Restricted user-tag-access: the name and marker suffice.
                Err(e) if e.is_forbidden() && params.tags.is_some() => {
                    tracing::info!(vm = %vm, error = %e, "replica left untagged (user-tag-access)");
                    params.tags = None;
                }
                Err(e) => return Err(fail(Step::Tag)(e)),
            }
        }
        let params = MigrateParams {
            target: node.to_string(),
            online: false,
            with_local_disks: true,
            targetstorage: target_storage,
        };
        // PVE refuses a second migrate of the same VM (`VM is locked
        // (migrate)`, or its config is gone from the source): a POST whose
        // answer was lost is resolved by reading where the VM settled.
        let mut attempt = 0;
        loop {
            match self
                .api
                .once(|pve| pve.migrate(&vm.node, vm.vmid, &params))
                .await
            {
                Ok(upid) => {
                    if let Err(e) = self.api.wait_task(&upid, "replica migration").await {
                        let why = self.task_error_lines(&upid).await;
                        return Err((Step::Migrate, e, why));
                    }
                    break;
                }
                Err(e) if e.may_have_been_applied_post() => {
                    tracing::warn!(vm = %vm, error = %e, "the answer to the migration request was lost; reading where the VM is");
                    match self
                        .settled(vm.vmid, &[node, vm.node.as_str()], deadline)
                        .await
                        .map(|(n, _)| n)
                    {
                        Some(n) if n == node => break,
                        // Still on the source and unlocked: not applied.
                        Some(_) if Instant::now() < deadline => {}
                        _ => return Err(fail(Step::Migrate)(e)),
                    }
                }
                Err(e) if e.is_transient() && Instant::now() < deadline => {
                    self.api.pause(attempt, deadline).await;
                    attempt += 1;
                }
                Err(e) => return Err(fail(Step::Migrate)(e)),
            }
        }
        // Right after the migration the config lock may still be contended
        // (a backup job, a person): a lock timeout is retried. A second
        // conversion is refused (`you can't convert a template to a
        // template`): a lost answer is resolved by reading the config.
        let mut attempt = 0;
        loop {
            let outcome = match self
                .api
                .once(|pve| pve.convert_to_template(node, vm.vmid))
                .await
            {
                Ok(upid) => self.api.wait_task(&upid, "template conversion").await,
                Err(e) if e.may_have_been_applied_post() => {
                    tracing::warn!(vm = vm.vmid, node, error = %e, "the answer to the conversion request was lost; reading the config");
                    let here = VmRef {
                        node: node.to_string(),
                        vmid: vm.vmid,
                    };
                    match self
                        .settled(here.vmid, &[here.node.as_str()], deadline)
                        .await
                        .map(|(_, cfg)| cfg.template.unwrap_or(false))
                    {
                        Some(true) => break,
                        Some(false) if Instant::now() < deadline => continue,
                        _ => return Err(fail(Step::Convert)(e)),
                    }
                }
                Err(e) => Err(e),
            };
            match outcome {
                Ok(()) => break,
                Err(e)
                    if (e.is_lock_timeout() || e.is_transient()) && Instant::now() < deadline =>
                {
                    self.api.pause(attempt, deadline).await;
                    attempt += 1;
                }
                Err(e) => return Err(fail(Step::Convert)(e)),
            }
        }
        tracing::debug!(vm = vm.vmid, source, node, "replica converted");
        Ok(())
    }

    /// The first of `nodes` where VM `vmid`'s config reads with no lock on
    /// it, with that config: polled until the task timeout (or `deadline`),
    /// `None` when no node shows it unlocked by then. How a POST whose
    /// answer was lost is resolved: by reading what it left, not by posting
    /// again.
    async fn settled(
        &self,
        vmid: u32,
        nodes: &[&str],
        deadline: Instant,
    ) -> Option<(String, pve::VmConfig)> {
        let until = deadline.min(Instant::now() + self.opts.task_timeout);
        loop {
            for &n in nodes {
                if let Ok(cfg) = self
                    .api
                    .retry_raw(Some(n), until, |pve| pve.get_config(n, vmid))
                    .await
                {
                    if cfg.lock.is_none() {
                        return Some((n.to_string(), cfg));
                    }
                }
            }
            if Instant::now() >= until {
                return None;
            }
            tokio::time::sleep(self.opts.poll_interval).await;
        }
    }

    /// The `ERROR` lines of a failed task's log (PVE puts a migration's cause
    /// there; the exit status says only `migration aborted`).
    async fn task_error_lines(&self, upid: &Upid) -> Option<String> {
        let deadline = Instant::now() + self.opts.task_timeout;
        let lines = self
            .api
            .retry_raw(Some(&upid.node), deadline, |pve| pve.task_log(upid, 0, 500))
            .await
            .ok()?;
        let errs: Vec<&str> = lines
            .iter()
            .filter(|l| l.is_error())
            .map(|l| l.t.trim())
            .collect();
        (!errs.is_empty()).then(|| errs.join("; "))
    }

    /// Destroys a replica of `source` at `vm` if its marker says we made it;
    /// anything else there is left alone. Best effort: a replica that cannot
    /// go (linked clones still use it) stays, unused.
    async fn remove_replica(&self, vm: &VmRef, source: u32, deadline: Instant) {
        let ours = match self
            .api
            .retry_raw(Some(&vm.node), deadline, |pve| {
                pve.get_config(&vm.node, vm.vmid)
            })
            .await
        {
            Ok(cfg) => cfg
                .description
                .as_deref()
                .and_then(parse_replica_marker)
                .is_some_and(|(s, _)| s == source),
            Err(_) => false,
        };
        if !ours {
            return;
        }
        let Ok(st) = self
            .api
            .retry_raw(Some(&vm.node), deadline, |pve| {
                pve.status_current(&vm.node, vm.vmid)
            })
            .await
        else {
            return;
        };
        tracing::info!(vm = %vm, source, "removing a stale or half-staged template replica");
        match self.api.destroy(vm, st.is_running(), deadline).await {
            Ok(()) => {
                self.vmids.cool_down(vm.vmid);
                self.known.lock().remove(&vm.vmid);
            }
            Err(e) => {
                tracing::warn!(vm = %vm, error = %e, "could not remove a stale template replica; it is no longer used");
            }
        }
    }
}
