//! storage.cfg as the simulator is told it: each storage's type, shared
//! flag, capacity and content. A leaf: what nodes see of the storages and
//! how full they are is `storage`'s, which reads these.

use std::str::FromStr;

/// A storage type (storage.cfg `type`), as far as clones and capacity care.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StorageKind {
    /// `dir` (disks as qcow2 files).
    Dir,
    /// `lvm`: thick LVM, no snapshots, so no linked clones.
    Lvm,
    /// `lvmthin` (the `local-lvm` of a fresh install).
    LvmThin,
    /// `zfspool`.
    ZfsPool,
    /// `rbd` (Ceph).
    Rbd,
    /// `nfs` (qcow2 files).
    Nfs,
}

impl StorageKind {
    /// Disks are files (qcow2 or raw) on a file system.
    pub fn is_file_based(self) -> bool {
        matches!(self, Self::Dir | Self::Nfs)
    }

    /// Thick or thin LVM: disks are logical volumes (allocation failures
    /// come from `lvcreate`).
    pub fn is_lvm(self) -> bool {
        matches!(self, Self::Lvm | Self::LvmThin)
    }

    /// The `type` PVE reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Dir => "dir",
            Self::Lvm => "lvm",
            Self::LvmThin => "lvmthin",
            Self::ZfsPool => "zfspool",
            Self::Rbd => "rbd",
            Self::Nfs => "nfs",
        }
    }

    /// Whether a template's disk on it can back a linked clone (PVE's
    /// `clone` volume feature on a base volume: not on thick LVM).
    pub fn supports_linked_clones(self) -> bool {
        !matches!(self, Self::Lvm)
    }

    /// The storage layer's text when a new disk does not fit.
    pub fn no_space(self, storage: &str, volume: &str, need: u64, avail: u64) -> String {
        if self.is_lvm() {
            // 4 MiB extents, as `vgcreate` makes them by default.
            format!(
                "lvcreate 'pve/{volume}' error:   Volume group \"pve\" has insufficient free space ({} extents): {} required.",
                avail >> 22,
                need.div_ceil(1 << 22)
            )
        } else {
            format!("unable to create image: '{storage}:{volume}': No space left on device")
        }
    }
}

impl FromStr for StorageKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.trim() {
            "dir" => Self::Dir,
            "lvm" => Self::Lvm,
            "lvmthin" => Self::LvmThin,
            "zfspool" => Self::ZfsPool,
            "rbd" => Self::Rbd,
            "nfs" => Self::Nfs,
            other => {
                return Err(format!(
                "unknown storage type '{other}' (expected dir, lvm, lvmthin, zfspool, rbd or nfs)"
            ))
            }
        })
    }
}

/// One storage of storage.cfg, present on every node. A local (not
/// `shared`) storage is a separate pool of `total_gib` on each node.
#[derive(Clone, Debug)]
pub struct StorageSpec {
    pub name: String,
    pub kind: StorageKind,
    pub shared: bool,
    /// Capacity (per node when local).
    pub total_gib: u64,
    /// Content types, e.g. `images,rootdir`.
    pub content: String,
    /// Per-node capacity of a local storage where it differs from
    /// `total_gib` (each node's disk is its own pool); empty for shared
    /// storages, which are one pool.
    pub node_gib: std::collections::BTreeMap<String, u64>,
}

impl StorageSpec {
    /// A storage for VM disks (`images,rootdir`).
    pub fn new(name: &str, kind: StorageKind, shared: bool, total_gib: u64) -> Self {
        Self {
            name: name.to_string(),
            kind,
            shared,
            total_gib,
            content: "images,rootdir".into(),
            node_gib: Default::default(),
        }
    }

    /// Capacity on `node`, in GiB.
    pub fn total_gib_on(&self, node: &str) -> u64 {
        self.node_gib.get(node).copied().unwrap_or(self.total_gib)
    }

    /// `node`'s pool of this local storage holds `gib`.
    pub fn with_node_size(mut self, node: &str, gib: u64) -> Self {
        self.node_gib.insert(node.to_string(), gib);
        self
    }

    pub fn with_content(mut self, content: &str) -> Self {
        self.content = content.to_string();
        self
    }
}
