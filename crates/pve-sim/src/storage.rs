//! Storages: storage.cfg (type, shared flag, capacity), what each node sees,
//! how full each is, and the checks clones and migrations make against them.

use serde_json::{json, Value};

use crate::config::StorageKind;
use crate::sim::Shared;
use crate::state::Cluster;

/// One storage as the storage endpoints report it, on one node.
pub(crate) struct StorageInfo {
    pub name: String,
    pub kind: StorageKind,
    pub content: String,
    pub shared: bool,
    pub total: u64,
    pub used: u64,
}

impl StorageInfo {
    pub(crate) fn avail(&self) -> u64 {
        self.total.saturating_sub(self.used)
    }

    pub(crate) fn status_json(&self, with_name: bool) -> Value {
        let mut v = json!({
            "type": self.kind.as_str(), "content": self.content, "shared": u8::from(self.shared),
            "active": 1, "enabled": 1, "total": self.total, "used": self.used,
            "avail": self.avail(),
        });
        if with_name {
            v["storage"] = json!(self.name);
            v["used_fraction"] = json!(self.used as f64 / self.total.max(1) as f64);
        }
        v
    }
}

impl Shared {
    /// Storages visible on `node`: storage.cfg ([`crate::SimConfig::storages`]),
    /// then shared storages named only in `shared_storages` or by a
    /// template, then any other storage a VM on the node uses.
    pub(crate) fn storages_on(&self, c: &Cluster, node: &str) -> Vec<StorageInfo> {
        let mut defs: Vec<(String, StorageKind, String, bool, u64)> = self
            .cfg
            .storages
            .iter()
            .map(|s| {
                (
                    s.name.clone(),
                    s.kind,
                    s.content.clone(),
                    s.shared,
                    s.total_gib << 30,
                )
            })
            .collect();
        let mut shared: Vec<String> = self.cfg.shared_storages.clone();
        shared.extend(
            self.cfg
                .templates
                .iter()
                .filter(|t| t.shared)
                .map(|t| t.storage.clone()),
        );
        for s in shared {
            if !defs.iter().any(|d| d.0 == s) {
                defs.push((s, StorageKind::Rbd, "images,rootdir".into(), true, 1 << 50));
            }
        }
        for vm in c.vms.values().filter(|v| v.node == node) {
            if !vm.storage.is_empty() && !defs.iter().any(|d| d.0 == vm.storage) {
                defs.push((
                    vm.storage.clone(),
                    StorageKind::Dir,
                    "images".into(),
                    false,
                    64 << 40,
                ));
            }
        }
        defs.into_iter()
            .map(|(name, kind, content, shared, total)| {
                let used = self.used_bytes(c, node, &name, shared, None);
                StorageInfo {
                    name,
                    kind,
                    content,
                    shared,
                    total,
                    used: used.min(total),
                }
            })
            .collect()
    }

    /// Bytes VM disks take on `storage` as `node` sees it (all nodes' for a
    /// shared one), leaving out VM `except`.
    fn used_bytes(
        &self,
        c: &Cluster,
        node: &str,
        storage: &str,
        shared: bool,
        except: Option<u32>,
    ) -> u64 {
        c.vms
            .values()
            .filter(|v| v.storage == storage && (shared || v.node == node))
            .filter(|v| Some(v.vmid) != except)
            .map(|v| v.allocated_bytes())
            .sum()
    }

    /// `storage` as `node` sees it, if it exists.
    pub(crate) fn storage_on(&self, c: &Cluster, node: &str, storage: &str) -> Option<StorageInfo> {
        self.storages_on(c, node)
            .into_iter()
            .find(|s| s.name == storage)
    }

    /// Whether a new `need`-byte disk `volume` for VM `vmid` fits on
    /// `storage` on `node` (the VM's own current allocation not counted);
    /// `Err` is the storage layer's text.
    pub(crate) fn room_for(
        &self,
        c: &Cluster,
        node: &str,
        storage: &str,
        vmid: u32,
        volume: &str,
        need: u64,
    ) -> Result<(), String> {
        let Some(st) = self.storage_on(c, node, storage) else {
            return Err(format!("storage '{storage}' does not exist"));
        };
        let used = self.used_bytes(c, node, storage, st.shared, Some(vmid));
        let avail = st.total.saturating_sub(used);
        if need > avail {
            return Err(st.kind.no_space(storage, volume, need, avail));
        }
        Ok(())
    }
}
