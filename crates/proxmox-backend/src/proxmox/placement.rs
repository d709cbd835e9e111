//! Where a clone comes from and where its disks go: the clone mode, the
//! target storage (instance type, then node), whether the template's disks
//! can reach the target node or a per-node replica is needed, what a full
//! clone's disks need per storage, and the start-up check of all of it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use parking_lot::Mutex;
use providerkit::ErrorKind;
use pve::{ClusterVm, StorageStatus};
use tokio::sync::OnceCell;
use tokio::time::Instant;

use super::api::{err_at, Api};
use super::options::CloneMode;
use super::options::PveOptions;
use super::sizing::Inherited;
use super::slots::{storage_key, SlotDomain};
use crate::substrate::{CloneRequest, SubstrateError};

/// Placement decisions with their caches and bookkeeping.
pub(super) struct Placement {
    api: Arc<Api>,
    /// The options this part reads.
    opts: Arc<PveOptions>,
    /// Template vmid -> its disks and their storages; read once per
    /// template (and again when a replica check sees a new digest).
    layouts: Mutex<HashMap<u32, Arc<OnceCell<Arc<Layout>>>>>,
    /// Node -> its storages by id (type, shared flag), read once per node
    /// when a decision needs them.
    storages: Mutex<HashMap<String, Arc<OnceCell<Arc<NodeStorages>>>>>,
    /// Template vmid -> the storages of its disks (sorted, deduplicated),
    /// read once per template (failed reads are not cached).
    template_storages: Mutex<HashMap<u32, Arc<OnceCell<Storages>>>>,
}

/// Storage ids, sorted and deduplicated, shared by whoever read them.
type Storages = Arc<Vec<String>>;

/// A template's disks as its node sees them.
#[derive(Debug)]
pub(super) struct Layout {
    /// Config digest the layout was read at.
    pub(super) digest: String,
    /// `(storage, bytes)` per disk.
    pub(super) disks: Vec<(String, u64)>,
    /// CD-ROM drives: no room of their own, but a volume on local storage
    /// makes the template local to its node, as PVE counts it.
    pub(super) cdroms: Vec<pve::Cdrom>,
    /// What a clone copies from it that its sizing PUT must know.
    pub(super) inherited: Inherited,
    /// The boot disk, `(key, storage, bytes)`: what a type's `disk_gib` grows.
    pub(super) boot: Option<(String, String, u64)>,
}

/// One node's storages by id; a storage missing here is one the token may
/// not see.
pub(super) type NodeStorages = HashMap<String, StorageStatus>;

/// Whether storage `id` is shared as `storages` (one node's) list it; one
/// the token cannot see counts as local (see [`Layout::shared`]).
fn is_shared(storages: &NodeStorages, id: &str) -> bool {
    storages.get(id).is_some_and(|st| st.shared)
}

/// Whether `storages` (one node's) lists `id` as not enabled there (its
/// `nodes` list leaves the node out, or it is disabled). One the list does
/// not hold is not known to be disabled.
fn disabled(storages: &NodeStorages, id: &str) -> bool {
    storages.get(id).is_some_and(|st| st.enabled == Some(false))
}

impl Layout {
    /// Whether every disk is on shared storage, by the template node's
    /// storages (one the token cannot see counts as local: staging a replica
    /// of a shared template is wasteful, cloning a local one to another node
    /// fails).
    pub(super) fn shared(&self, storages: &NodeStorages) -> bool {
        self.disks.iter().all(|(s, _)| is_shared(storages, s))
            && self
                .cdroms
                .iter()
                .filter_map(pve::Cdrom::storage)
                .all(|s| is_shared(storages, s))
    }

    /// A CD-ROM image on storage local to the template's node (not a
    /// cloud-init drive, which PVE regenerates): no copy of the template
    /// can leave the node with it (`local cdrom image`).
    pub(super) fn local_iso(&self, storages: &NodeStorages) -> Option<&pve::Cdrom> {
        self.cdroms
            .iter()
            .find(|c| !c.is_cloudinit() && c.storage().is_some_and(|s| !is_shared(storages, s)))
    }

    /// Bytes the disks need, by the storage they land on, with the boot
    /// disk grown to `boot_bytes` when that is more.
    pub(super) fn needs(
        &self,
        dest: impl Fn(&str) -> String,
        boot_bytes: Option<u64>,
    ) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for (s, bytes) in &self.disks {
            *out.entry(dest(s)).or_default() += bytes;
        }
        if let (Some(want), Some((_, s, bytes))) = (boot_bytes, &self.boot) {
            *out.entry(dest(s)).or_default() += want.saturating_sub(*bytes);
        }
        out
    }
}

impl Placement {
    pub(super) fn new(api: Arc<Api>, opts: Arc<PveOptions>) -> Placement {
        Placement {
            api,
            opts,
            layouts: Mutex::default(),
            storages: Mutex::default(),
            template_storages: Mutex::default(),
        }
    }

    /// Where a clone counts its slots: the storages it writes to
    /// (`target`, a full clone's configured storage, else the template's
    /// disks' storages: their locks and bandwidth are what parallel clones
    /// contend on), shared when the template's node lists every one of
    /// them shared. `shared` is storage.cfg's, the same from every node, and
    /// the template's node is online (the clone runs there), so a target
    /// node down or slow to answer does not hold the clone up here; a
    /// storage that node does not list counts as local. Reads the
    /// template's config and its node's storages once each per process; a
    /// failed read fails the Create (and is retried by the next one).
    pub(super) async fn slot_domain(
        &self,
        template: u32,
        template_node: &str,
        target: Option<&str>,
        deadline: Instant,
    ) -> Result<SlotDomain, SubstrateError> {
        let storages = match target {
            Some(t) => Arc::new(vec![t.to_string()]),
            None => {
                self.template_storages(template, template_node, deadline)
                    .await?
            }
        };
        let listed = self.node_storages(template_node, deadline).await?;
        Ok(SlotDomain {
            storage: storage_key(&storages),
            shared: !storages.is_empty() && storages.iter().all(|s| is_shared(&listed, s)),
        })
    }

    /// The storages of a template's disks, read once.
    async fn template_storages(
        &self,
        template: u32,
        template_node: &str,
        deadline: Instant,
    ) -> Result<Storages, SubstrateError> {
        let cell = self
            .template_storages
            .lock()
            .entry(template)
            .or_default()
            .clone();
        cell.get_or_try_init(|| async {
            let cfg = self
                .api
                .retry_pve(
                    format!(
                        "reading the config of template {template} on node {template_node} \
                         (needed to bound clones per storage)"
                    ),
                    Some(template_node),
                    deadline,
                    |pve| pve.get_config(template_node, template),
                )
                .await?;
            let storages = cfg.disk_storages();
            tracing::debug!(template, storages = ?storages, "template disk storages resolved");
            Ok(Arc::new(storages))
        })
        .await
        .cloned()
    }

    /// The storage a clone's disks go to, if one is configured: the
    /// instance type's, else the node's.
    pub(super) fn target_storage(&self, req: &CloneRequest) -> Option<String> {
        self.opts
            .type_storage
            .get(&req.instance_type)
            .or_else(|| self.opts.node_storage.get(&req.node))
            .cloned()
    }

    /// Whether a full clone onto `storage` of `node` must run on `node`
    /// itself rather than from `template_node` with `target`: the storage
    /// is not shared (or the token cannot see it, which PVE would refuse
    /// with `target` as well), or storage.cfg does not enable it on the
    /// template's node (qemu-server `clone_vm` checks `storage` on the node
    /// it runs on first: `storage 'X' is not available on node 'N'`).
    pub(super) async fn needs_local_source(
        &self,
        node: &str,
        template_node: &str,
        storage: Option<&str>,
        deadline: Instant,
    ) -> Result<bool, SubstrateError> {
        let Some(storage) = storage else {
            return Ok(false);
        };
        let storages = self.node_storages(node, deadline).await?;
        if !is_shared(&storages, storage) {
            return Ok(true);
        }
        if node == template_node {
            return Ok(false);
        }
        let at_template = self.node_storages(template_node, deadline).await?;
        Ok(disabled(&at_template, storage))
    }

    /// Every storage a full clone on `node` may be given: the instance
    /// types', and the node's (for types without one). Empty for linked clones.
    pub(super) fn full_clone_storages(&self, node: &str) -> Vec<String> {
        if self.opts.clone_mode != CloneMode::Full {
            return Vec::new();
        }
        let mut out: Vec<String> = self.opts.type_storage.values().cloned().collect();
        out.extend(self.opts.node_storage.get(node).cloned());
        out.sort();
        out.dedup();
        out
    }

    /// `full` and `storage` of the clone request.
    pub(super) fn clone_options(&self, req: &CloneRequest) -> (bool, Option<String>) {
        match self.opts.clone_mode {
            CloneMode::Full => (true, self.target_storage(req)),
            CloneMode::Linked => (false, None),
        }
    }

    /// The template's disks and storages, read once (a failed read is not
    /// cached). `fresh_digest`: re-read when the cached one differs.
    pub(super) async fn layout(
        &self,
        template: u32,
        template_node: &str,
        fresh_digest: Option<&str>,
        deadline: Instant,
    ) -> Result<Arc<Layout>, SubstrateError> {
        let cell = {
            let mut all = self.layouts.lock();
            let cell = all.entry(template).or_default();
            let stale = cell
                .get()
                .zip(fresh_digest)
                .is_some_and(|(l, d)| l.digest != d);
            if stale {
                *cell = Arc::default();
            }
            Arc::clone(cell)
        };
        cell.get_or_try_init(|| async {
            let cfg = self
                .api
                .retry_pve(
                    format!("reading the config of template {template} on node {template_node}"),
                    Some(template_node),
                    deadline,
                    |pve| pve.get_config(template_node, template),
                )
                .await?;
            // The same read gives the clone slots' storages: one read per
            // template.
            let _already = self
                .template_storages
                .lock()
                .entry(template)
                .or_default()
                .set(Arc::new(cfg.disk_storages()));
            let disks = cfg
                .disks()
                .into_iter()
                .map(|(_, storage, bytes)| (storage, bytes))
                .collect();
            Ok(Arc::new(Layout {
                digest: cfg.digest.clone().unwrap_or_default(),
                disks,
                cdroms: cfg.cdroms(),
                inherited: Inherited::of(&cfg),
                boot: cfg.boot_disk(),
            }))
        })
        .await
        .cloned()
    }

    /// `node`'s storages, read once (a failed read is not cached; a refused
    /// one is an empty map, with a warning).
    pub(super) async fn node_storages(
        &self,
        node: &str,
        deadline: Instant,
    ) -> Result<Arc<NodeStorages>, SubstrateError> {
        let cell = Arc::clone(self.storages.lock().entry(node.to_string()).or_default());
        cell.get_or_try_init(|| async {
            match self.api.retry_raw(Some(node), deadline, |pve| pve.node_storages(node)).await {
                Ok(list) => Ok(Arc::new(
                    list.into_iter()
                        .filter_map(|s| s.storage.clone().map(|id| (id, s)))
                        .collect(),
                )),
                Err(e) if e.is_forbidden() => {
                    tracing::warn!(node, error = %e,
                        "cannot list the node's storages; treating templates' disks there as local");
                    Ok(Arc::default())
                }
                Err(e) => Err(err_at(
                    format!("listing the storages of node {node}"),
                    Some(node),
                    &e,
                )),
            }
        })
        .await
        .cloned()
    }

    /// Start-up check of clone mode, storages and replicas against the
    /// cluster: every configured storage exists on its node, and linked
    /// clones are possible for every (template, node) pair. Errors name the
    /// fix; the strings returned are warnings.
    pub(super) async fn check_placement(
        &self,
        nodes: &[String],
        templates: &[u32],
        list: &[ClusterVm],
    ) -> Result<Vec<String>, SubstrateError> {
        let deadline = self.api.deadline();
        let mut warnings = Vec::new();
        if let Some(n) = self.opts.node_storage.keys().find(|n| !nodes.contains(n)) {
            return Err(SubstrateError::new(format!(
                "--node-storage names node {n:?}, which is not in --nodes ({})",
                nodes.join(", ")
            )));
        }
        let mut node_storages: HashMap<&str, Arc<NodeStorages>> = HashMap::new();
        let wanted = !self.opts.node_storage.is_empty() || !self.opts.type_storage.is_empty();
        if wanted || self.opts.clone_mode == CloneMode::Linked {
            for node in nodes {
                match self.node_storages(node, deadline).await {
                    Ok(m) => {
                        node_storages.insert(node, m);
                    }
                    Err(e) if e.kind() == ErrorKind::Transient => warnings.push(format!(
                        "{e}: its storage settings are checked by its first Create"
                    )),
                    Err(e) => return Err(e),
                }
            }
        }
        for (node, seen) in &node_storages {
            let mut want: Vec<(&str, String, bool)> = Vec::new();
            if let Some(s) = self.opts.node_storage.get(*node) {
                want.push((s, "--node-storage".into(), true));
            }
            for (t, s) in &self.opts.type_storage {
                want.push((s, format!("instance type {t}'s `storage`"), false));
            }
            for (s, from, per_node) in want {
                // The node's list holds every storage of storage.cfg, those
                // not enabled on the node too (`enabled` 0). A node's own
                // storage must be usable there; a type's may be meant for
                // the nodes that have it (its `nodes` list), and a Create
                // of that type elsewhere is refused naming it.
                if seen.get(s).is_some_and(|st| st.enabled == Some(false)) {
                    let msg = format!(
                        "storage {s:?} (from {from}) is disabled on node {node}: enable it for node {node} \
                        (Datacenter > Storage, its `nodes`), or name a storage enabled there"
                    );
                    if per_node {
                        return Err(SubstrateError::new(msg));
                    }
                    warnings.push(format!(
                        "{msg}; Creates of that type on node {node} are refused"
                    ));
                    continue;
                }
                if !seen.contains_key(s) {
                    let mut have: Vec<&str> = seen.keys().map(String::as_str).collect();
                    have.sort_unstable();
                    return Err(SubstrateError::new(format!(
                        "storage {s:?} (from {from}) is not on node {node}, or the API token may not use it \
                         (grant Datastore.AllocateSpace on /storage/{s}); storages it can use there: {}",
                        have.join(", ")
                    )));
                }
            }
        }
        for &t in templates {
            let Some(tnode) = list.iter().find(|v| v.vmid == t).map(|v| v.node.clone()) else {
                continue;
            };
            let others: Vec<&String> = nodes.iter().filter(|n| **n != tnode).collect();
            if others.is_empty() {
                continue;
            }
            let layout = self.layout(t, &tnode, None, deadline).await?;
            let tstorages = self.node_storages(&tnode, deadline).await?;
            if let Some(cd) = layout.local_iso(&tstorages) {
                return Err(SubstrateError::new(format!(
                    "template {t}'s CD-ROM {} holds {} on storage local to node {tnode}: PVE cannot clone \
                     it to node {}, nor move a copy of it there (local cdrom image). Eject it \
                     (`qm set {t} --{} none,media=cdrom`) or keep the ISO on shared storage",
                    cd.key, cd.volume, others[0], cd.key
                )));
            }
            self.check_replica_storages(t, &tnode, &layout, &tstorages, &others, deadline)
                .await?;
        }
        if self.opts.clone_mode != CloneMode::Linked {
            return Ok(warnings);
        }
        for &t in templates {
            let Some(tnode) = list.iter().find(|v| v.vmid == t).map(|v| v.node.clone()) else {
                continue;
            };
            let layout = self.layout(t, &tnode, None, deadline).await?;
            let tstorages = self.node_storages(&tnode, deadline).await?;
            for (s, _) in &layout.disks {
                let Some(st) = tstorages.get(s) else {
                    continue;
                };
                if !st.supports_linked_clones() {
                    return Err(SubstrateError::new(format!(
                        "--clone-mode linked: template {t}'s disks are on storage {s} (type {}), which cannot \
                         make linked clones. Use --clone-mode full, or move the template's disks to LVM-thin, \
                         ZFS, Ceph RBD or a qcow2 directory storage",
                        st.kind
                    )));
                }
            }
            if layout.shared(&tstorages) {
                continue;
            }
            for node in nodes.iter().filter(|n| **n != tnode) {
                if !self.opts.template_replicas {
                    return Err(SubstrateError::new(format!(
                        "--clone-mode linked: template {t} is on local storage of node {tnode}, so node {node} \
                         cannot make linked clones of it. Leave --template-replicas on (a copy of the template \
                         per node), put the template on shared storage, or use --clone-mode full"
                    )));
                }
                // The replica lands on the template's storage ids (no
                // storage override with linked clones): that storage on
                // this node must be able to link too.
                for (s, _) in &layout.disks {
                    let Some(st) = node_storages.get(node.as_str()).and_then(|m| m.get(s)) else {
                        continue;
                    };
                    if !st.supports_linked_clones() {
                        return Err(SubstrateError::new(format!(
                            "--clone-mode linked: template {t}'s replica on node {node} would be on storage {s} \
                             (type {}), which cannot make linked clones. Use --clone-mode full",
                            st.kind
                        )));
                    }
                }
            }
        }
        Ok(warnings)
    }

    /// For a template that reaches `others` only through per-node replicas:
    /// replicas are on, and each replica's migration can land (the storage
    /// exists on the node, and its type can import the template's disks).
    async fn check_replica_storages(
        &self,
        t: u32,
        tnode: &str,
        layout: &Layout,
        tstorages: &NodeStorages,
        others: &[&String],
        deadline: Instant,
    ) -> Result<(), SubstrateError> {
        let full = self.opts.clone_mode == CloneMode::Full;
        let shared = layout.shared(tstorages);
        for node in others {
            // A node that does not answer now is checked by its first Create.
            let read = self.node_storages(node, deadline).await.ok();
            let seen = read.as_deref();
            // The storage a full clone on `node` goes to, when one is set.
            let dest = full
                .then(|| self.opts.node_storage.get(node.as_str()).cloned())
                .flatten();
            // A destination this node cannot reach by a clone from the
            // template's node: local here, or not enabled there.
            let local_dest = dest
                .as_deref()
                .filter(|d| !seen.is_some_and(|m| is_shared(m, d)) || disabled(tstorages, d));
            if shared {
                if let (Some(d), false) = (local_dest, self.opts.template_replicas) {
                    return Err(SubstrateError::new(format!(
                        "--node-storage {node}={d}: storage {d} is not shared, or not enabled on node \
                         {tnode}, and PVE clones from template {t} on node {tnode} to another node only onto \
                         shared storage enabled on both. Leave \
                         --template-replicas on (a copy of the template on node {node} is cloned \
                         locally), or name a shared storage"
                    )));
                }
                continue;
            }
            if !self.opts.template_replicas {
                continue;
            }
            // The replica's migration copies each local disk to `dest`, or
            // to the same storage id on the node.
            for (s, _) in &layout.disks {
                let Some(src) = tstorages.get(s).filter(|st| !st.shared) else {
                    continue;
                };
                let to = dest.clone().unwrap_or_else(|| s.clone());
                let Some(m) = seen else { continue };
                let Some(dst) = m.get(&to) else {
                    return Err(SubstrateError::new(format!(
                        "template {t}'s disks are on storage {s}, local to node {tnode}, and its copy for \
                         node {node} would land on storage {to}, which node {node} does not have (or the \
                         API token may not use). Set --node-storage {node}=<a storage of that node>"
                    )));
                };
                if !migration_compatible(&src.kind, &dst.kind) {
                    return Err(SubstrateError::new(format!(
                        "template {t}'s disks are on storage {s} (type {}) of node {tnode}, and PVE cannot \
                         migrate them to storage {to} (type {}) of node {node}: cannot migrate from storage \
                         type '{}' to '{}'. Set --node-storage {node}= to a storage of a compatible type \
                         (the same type, or a directory storage), or move the template's disks",
                        src.kind, dst.kind, src.kind, dst.kind
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Whether an offline migration can copy a disk from a storage of type
/// `from` to one of type `to` (pve-storage: the two must share an
/// export/import format; LVM and LVM-thin import raw block data only, which
/// file-based storages cannot send once a disk is qcow2).
fn migration_compatible(from: &str, to: &str) -> bool {
    let file_based =
        |k: &str| matches!(k, "dir" | "nfs" | "cifs" | "glusterfs" | "cephfs" | "btrfs");
    let block_lvm = |k: &str| matches!(k, "lvm" | "lvmthin");
    !(file_based(from) && block_lvm(to))
}
