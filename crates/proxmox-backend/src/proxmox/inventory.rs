//! The inventory read: which VMs exist, which carry our marker, and the
//! per-VM knowledge that spares repeated config reads.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use futures::stream;
use futures::stream::{StreamExt, TryStreamExt};
use parking_lot::Mutex;
use pve::ClusterVm;

use super::api::{err, Api};
use super::marker::{looks_managed, parse_marker};
use crate::substrate::{SubstrateError, VmRef};

/// Concurrent config reads while indexing new VMs.
const CONFIG_READ_CONCURRENCY: usize = 8;

/// The outcome of one config read during a pass.
enum ConfigRead {
    /// The machine id from the marker, if any.
    Read(Option<String>),
    /// The node did not answer.
    Unread,
}
use ConfigRead::{Read, Unread};

/// What the last inventory pass learnt about one VM. A config read is only
/// repeated when the listing shows different tags or name.
#[derive(Clone, Debug)]
pub(super) struct Known {
    pub(super) node: String,
    pub(super) name: Option<String>,
    pub(super) tags: Vec<String>,
    /// Verbatim machine id from the description marker; `None` = not ours.
    pub(super) machine_id: Option<String>,
}

/// What the provider knows of the cluster's VMs between listings.
pub(super) struct Inventory {
    api: Arc<Api>,
    /// vmid -> what we know; refreshed by every inventory read.
    index: Mutex<HashMap<u32, Known>>,
    /// Template vmid -> node it lives on.
    templates: Mutex<HashMap<u32, String>>,
    /// VMs whose clone we started, by machine id (covers a stale inventory).
    pending: Mutex<HashMap<String, VmRef>>,
    /// The nodes the last listing found down (`GET /nodes`), sorted.
    offline: Mutex<Vec<String>>,
}

impl Inventory {
    pub(super) fn new(api: Arc<Api>) -> Inventory {
        Inventory {
            api,
            index: Mutex::new(HashMap::new()),
            templates: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            offline: Mutex::new(Vec::new()),
        }
    }

    /// One `/cluster/resources` read. Configs are read (and cached) only for
    /// VMs that look managed, pass `want`, and are new or changed since last seen.
    /// Returns the listing and the machine id of every marked VM in it.
    pub(super) async fn scan(
        &self,
        want: impl Fn(&ClusterVm) -> bool,
    ) -> Result<(Vec<ClusterVm>, Vec<(ClusterVm, String)>), SubstrateError> {
        let listed = self
            .api
            .once(|pve| pve.cluster_vms())
            .await
            .map_err(|e| err("listing the cluster's VMs", &e))?;
        self.note_offline(&listed.offline_nodes);
        let offline = listed.offline_nodes;
        let is_down = |node: &str| offline.iter().any(|n| n == node);
        let list = listed.vms;
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
        // A node that is down is not asked: every call to it hangs until
        // the connect fails (~3 s, each retry as long). Its VMs keep what
        // the last pass learnt of them.
        let (away, to_read): (Vec<ClusterVm>, Vec<ClusterVm>) =
            to_read.into_iter().partition(|v| is_down(&v.node));
        let read: Vec<(ClusterVm, ConfigRead)> = stream::iter(to_read)
            .map(|v| async move {
                match self.api.once(|pve| pve.get_config(&v.node, v.vmid)).await {
                    Ok(cfg) => {
                        let id = cfg.description.as_deref().and_then(parse_marker);
                        Ok(Some((v, Read(id))))
                    }
                    // Destroyed between the listing and the read.
                    Err(e) if e.is_not_found() => Ok(None),
                    // Its node is offline or unreachable: keep what the last
                    // pass learnt (the VM stays reported under its machine
                    // id) rather than fail the whole pass; a VM never read
                    // is left out until its node answers.
                    Err(e) if e.is_transient() => {
                        tracing::warn!(vm = %format!("{}/{}", v.node, v.vmid), error = %e,
                            "cannot read the config of a managed-looking VM (node offline or unreachable); \
                             keeping its last known state");
                        Ok(Some((v, Unread)))
                    }
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
        let read = read
            .into_iter()
            .chain(away.into_iter().map(|v| (v, Unread)));

        let marked = {
            let mut index = self.index.lock();
            for (v, outcome) in read {
                let machine_id = match outcome {
                    Read(id) => id,
                    Unread => {
                        // Follow the listing's tags and name so the cached
                        // machine id stays reported while the node is away
                        // (a dead node's rows lose their name after 5
                        // minutes: the name is kept, see below).
                        if let Some(k) = index.get_mut(&v.vmid) {
                            k.tags.clone_from(&v.tags);
                            if !is_down(&v.node) {
                                k.name.clone_from(&v.name);
                            }
                        }
                        continue;
                    }
                };
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
                        // A dead node's row is PVE's last sample, or no
                        // name at all once that expired: what the last
                        // pass read stands until the node answers.
                        if is_down(&v.node) || (k.tags == v.tags && k.name == v.name) {
                            marked.push((v.clone(), id.clone()));
                        }
                    }
                }
            }
            marked
        };
        Ok((list, marked))
    }

    /// Records which nodes the last listing found down, saying so once
    /// per change (a WARN when a node goes, an INFO when it is back).
    fn note_offline(&self, now: &[String]) {
        let mut known = self.offline.lock();
        for n in now.iter().filter(|n| !known.contains(n)) {
            tracing::warn!(node = %n, "node is offline: its VMs are reported as last seen and not touched until it is back; \
                Creates there fail, Deletes and Drains of machines on it wait for it");
        }
        for n in known.iter().filter(|n| !now.contains(n)) {
            tracing::info!(node = %n, "node is online again");
        }
        known.clone_from(&now.to_vec());
    }

    /// The nodes the last listing found down.
    pub(super) fn offline_nodes(&self) -> Vec<String> {
        self.offline.lock().clone()
    }

    /// Drops what is known of a VMID (destroyed, or not ours after all).
    pub(super) fn forget(&self, vmid: u32) {
        self.index.lock().remove(&vmid);
        self.pending.lock().retain(|_, vm| vm.vmid != vmid);
    }

    /// Records what marking a VM made of it, so the next pass spares the
    /// config read; `None`: not known (the next pass reads the config).
    pub(super) fn learn(&self, vmid: u32, known: Option<Known>) {
        match known {
            Some(k) => self.index.lock().insert(vmid, k),
            None => self.index.lock().remove(&vmid),
        };
    }

    /// The VM a clone of ours was started on for `machine_id`, if any.
    pub(super) fn pending(&self, machine_id: &str) -> Option<VmRef> {
        self.pending.lock().get(machine_id).cloned()
    }

    /// The VMIDs of the clones this process has started and not settled.
    pub(super) fn pending_vmids(&self) -> HashSet<u32> {
        self.pending.lock().values().map(|vm| vm.vmid).collect()
    }

    /// A clone for `machine_id` is being started at `vm`.
    pub(super) fn set_pending(&self, machine_id: &str, vm: &VmRef) {
        self.pending
            .lock()
            .insert(machine_id.to_string(), vm.clone());
    }

    /// The machine's clone is settled (adopted, landed, or given up).
    pub(super) fn clear_pending(&self, machine_id: &str) {
        self.pending.lock().remove(machine_id);
    }

    /// Finds the node a VMID is on now (after a 'does not exist' on the node we
    /// expected); `None` if the cluster no longer has it.
    pub(super) async fn locate(&self, vmid: u32) -> Result<Option<ClusterVm>, SubstrateError> {
        let listed = self
            .api
            .once(|pve| pve.cluster_vms())
            .await
            .map_err(|e| err("listing the cluster's VMs", &e))?;
        self.note_offline(&listed.offline_nodes);
        Ok(listed
            .vms
            .into_iter()
            .find(|v| v.vmid == vmid && !v.template))
    }

    pub(super) fn template_node(
        &self,
        template: u32,
        list: &[ClusterVm],
    ) -> Result<String, SubstrateError> {
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
}
