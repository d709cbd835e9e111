//! Storages: storage.cfg (type, shared flag, capacity), what each node sees,
//! how full each is, and the checks clones and migrations make against them.

use serde_json::{json, Value};

use crate::storage_cfg::StorageKind;

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
    /// storage.cfg enables it on this node.
    pub enabled: bool,
    /// It could be activated on this node (its server answers).
    pub active: bool,
}

impl StorageInfo {
    pub(crate) fn avail(&self) -> u64 {
        self.total.saturating_sub(self.used)
    }

    /// Whether disks can be allocated on it from this node.
    pub(crate) fn usable(&self) -> bool {
        self.enabled && self.active
    }

    /// As pve-storage's `storage_info` reports it: a storage disabled on the
    /// node or that could not be activated keeps its row, with `enabled` /
    /// `active` 0 and every size 0.
    pub(crate) fn status_json(&self, with_name: bool) -> Value {
        let (total, used, avail) = if self.usable() {
            (self.total, self.used, self.avail())
        } else {
            (0, 0, 0)
        };
        let mut v = json!({
            "type": self.kind.as_str(), "content": self.content, "shared": u8::from(self.shared),
            "active": u8::from(self.usable()), "enabled": u8::from(self.enabled),
            "total": total, "used": used, "avail": avail,
        });
        if with_name {
            v["storage"] = json!(self.name);
            if self.usable() {
                v["used_fraction"] = json!(used as f64 / total.max(1) as f64);
            }
        }
        v
    }

    /// Why a disk cannot be allocated on it from `node`, in PVE's words.
    pub(crate) fn unusable_reason(&self, node: &str) -> Option<String> {
        if !self.enabled {
            Some(format!(
                "storage '{}' is not available on node '{node}'",
                self.name
            ))
        } else if !self.active {
            Some(format!("storage '{}' is not online", self.name))
        } else {
            None
        }
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
                    // A local storage is a pool per node, each its own size.
                    if s.shared {
                        s.total_gib << 30
                    } else {
                        s.total_gib_on(node) << 30
                    },
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
        let offline = self.storages_offline.lock();
        let on = |list: &[(String, String)], name: &str| {
            list.iter().any(|(n, s)| n == node && s == name)
        };
        defs.into_iter()
            .map(|(name, kind, content, shared, total)| {
                let used = self.used_bytes(c, node, &name, shared, None);
                StorageInfo {
                    enabled: !on(&self.cfg.storages_disabled, &name),
                    active: !offline.contains(&(node.to_string(), name.clone())),
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

    /// The storages holding VM images that cannot be activated on `node`
    /// right now.
    pub(crate) fn offline_storages_on(&self, node: &str) -> Vec<String> {
        let c = self.cluster.lock();
        self.storages_on(&c, node)
            .into_iter()
            .filter(|s| s.enabled && !s.active)
            .filter(|s| s.content.split(',').any(|t| t == "images"))
            .map(|s| s.name)
            .collect()
    }

    /// The storages holding VM images whose mount on `node` hangs.
    pub(crate) fn hung_storages_on(&self, node: &str) -> Vec<String> {
        let hung = self.storages_hung.lock().clone();
        let c = self.cluster.lock();
        self.storages_on(&c, node)
            .into_iter()
            .filter(|s| s.content.split(',').any(|t| t == "images"))
            .filter(|s| hung.contains(&(node.to_string(), s.name.clone())))
            .map(|s| s.name)
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
        let vms: u64 = c
            .vms
            .values()
            .filter(|v| v.storage == storage && (shared || v.node == node))
            .filter(|v| Some(v.vmid) != except)
            .map(|v| v.allocated_bytes())
            .sum();
        // A volume a destroy could not free still takes its space.
        let leftovers: u64 = self
            .leftover_volumes
            .lock()
            .iter()
            .filter(|l| l.storage == storage && (shared || l.node == node))
            .map(|l| l.bytes)
            .sum();
        vms + leftovers
    }

    /// Why freeing `volume` of VM `vmid` on `storage` fails on `node` when
    /// the storage is busy there, in the words of pve-storage's plugin for
    /// its kind (`vdisk_free`); `None` when it is not busy.
    pub(crate) fn busy_free_error(
        &self,
        c: &Cluster,
        node: &str,
        storage: &str,
        vmid: u32,
        volume: &str,
    ) -> Option<String> {
        if !self
            .storages_busy
            .lock()
            .contains(&(node.to_string(), storage.to_string()))
        {
            return None;
        }
        let kind = self
            .storage_on(c, node, storage)
            .map_or(StorageKind::Dir, |s| s.kind);
        // A linked clone's volume is `base-B-disk-0/vm-N-disk-0`; the
        // plugins free the part after the slash.
        let own = volume.rsplit('/').next().unwrap_or(volume);
        Some(match kind {
            StorageKind::Rbd => {
                format!("rbd rm '{own}' error: rbd: error: image still has watchers")
            }
            StorageKind::Lvm | StorageKind::LvmThin => format!(
                "lvremove 'pve/{own}' error:   Logical volume pve/{own} in use."
            ),
            StorageKind::ZfsPool => {
                format!("zfs error: cannot destroy 'rpool/data/{own}': dataset is busy")
            }
            StorageKind::Dir | StorageKind::Nfs => format!(
                "unlink '/mnt/pve/{storage}/images/{vmid}/{own}.qcow2' failed - Device or resource busy"
            ),
        })
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
        if let Some(reason) = st.unusable_reason(node) {
            return Err(reason);
        }
        let used = self.used_bytes(c, node, storage, st.shared, Some(vmid));
        let avail = st.total.saturating_sub(used);
        if need > avail {
            return Err(st.kind.no_space(storage, volume, need, avail));
        }
        Ok(())
    }
}
