//! What a Create's admission holds and why one is refused: the node memory
//! guard's claim ([`crate::memory`]), the storage guard's (a full clone's
//! disks on their storage) and the device guard's (mapped PCI devices). Plain data, shared by the substrates, the
//! backend and the binary's metrics and Admin service.

use crate::memory::NoRoom;

/// What an admitted Create holds until its outcome lands: each guard's
/// claim, given back when it drops.
#[derive(Default)]
pub struct Admitted {
    held: Vec<Box<dyn Send + Sync>>,
}

impl Admitted {
    /// Adds a guard's claim.
    pub fn hold(&mut self, claim: impl Send + Sync + 'static) {
        self.held.push(Box::new(claim));
    }

    /// Whether no guard claimed anything (all off, or none could read).
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

impl std::fmt::Debug for Admitted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Admitted({} claims)", self.held.len())
    }
}

/// Why a Create was refused at admission, before anything was cloned.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum Refusal {
    /// Its node has no memory for it (the node memory guard).
    #[error(transparent)]
    Memory(#[from] NoRoom),
    /// A storage its full clone lands on has no room for its disks.
    #[error(transparent)]
    Storage(#[from] NoSpace),
    /// Its node has not enough free devices of its type's PCI mapping.
    #[error(transparent)]
    Devices(#[from] NoDevices),
}

/// A Create whose node has too few free devices of its mapping.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "node {node} has no free device of PCI mapping {mapping} for machine {machine_id}: instance \
     type {instance_type} needs {needed} and {} of the {total} mapped on the node are free \
     ({held_by_vms} held by running VMs, {in_flight} by Creates in flight); create the machine on \
     another node, or stop a VM that holds one",
    self.free()
)]
pub struct NoDevices {
    pub node: String,
    pub mapping: String,
    pub machine_id: String,
    pub instance_type: String,
    pub needed: u32,
    /// Devices the mapping has on the node.
    pub total: u32,
    /// Held by VMs running there (anyone's).
    pub held_by_vms: u32,
    /// Claimed by the provider's Creates in flight there.
    pub in_flight: u32,
}

impl NoDevices {
    pub fn free(&self) -> u32 {
        self.total
            .saturating_sub(self.held_by_vms)
            .saturating_sub(self.in_flight)
    }
}

/// One storage as the storage guard last checked it.
#[derive(Clone, Debug, PartialEq)]
pub struct StorageSpace {
    pub storage: String,
    /// The node it was read on; `None` for a shared storage (one pool,
    /// whichever node reads it).
    pub node: Option<String>,
    /// Free bytes as the guard counts them: PVE's `avail`, less what the
    /// provider's clones that ended since took, with the disks of its
    /// clones still running (which PVE may count already) added back, so
    /// that they are counted once, by `in_flight_bytes`.
    pub avail_bytes: u64,
    /// Bytes the provider's full clones admitted there and not yet done
    /// will take (PVE counts a clone's disks only once its worker
    /// allocates them).
    pub in_flight_bytes: u64,
    /// `--storage-overcommit` for the storage; 1 when not set.
    pub overcommit: f64,
}

impl StorageSpace {
    /// What may be committed there: `avail x overcommit`.
    pub fn allowed_bytes(&self) -> u64 {
        scaled(self.avail_bytes, self.overcommit)
    }

    /// Bytes still free for new clones.
    pub fn left_bytes(&self) -> u64 {
        self.allowed_bytes().saturating_sub(self.in_flight_bytes)
    }

    /// `storage X (shared)` or `storage X of node N`.
    pub fn describe(&self) -> String {
        describe(&self.storage, self.node.as_deref())
    }
}

fn describe(storage: &str, node: Option<&str>) -> String {
    match node {
        Some(n) => format!("storage {storage} of node {n}"),
        None => format!("storage {storage} (shared)"),
    }
}

/// `bytes x factor`, rounded down, saturating.
pub fn scaled(bytes: u64, factor: f64) -> u64 {
    let v = bytes as f64 * factor;
    if v >= u64::MAX as f64 {
        u64::MAX
    } else {
        v as u64
    }
}

/// `12.5 GiB`.
pub fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30))
}

/// A full clone its storage has no room for.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{}", self.message())]
pub struct NoSpace {
    /// The storage as it was checked.
    pub space: StorageSpace,
    /// What the clone's disks on it need, bytes.
    pub needed_bytes: u64,
    /// What needs it: `the full clone of template 9000 for machine m-1
    /// (instance type pve.small)`.
    pub what: String,
}

impl NoSpace {
    fn message(&self) -> String {
        let s = &self.space;
        let overcommitted = (s.overcommit - 1.0).abs() > f64::EPSILON;
        let room = if !overcommitted && s.in_flight_bytes == 0 {
            format!("{} is free", gib(s.avail_bytes))
        } else {
            let mut parts = vec![if overcommitted {
                format!(
                    "{} free x --storage-overcommit {}={}",
                    gib(s.avail_bytes),
                    s.storage,
                    s.overcommit
                )
            } else {
                format!("{} free", gib(s.avail_bytes))
            }];
            if s.in_flight_bytes > 0 {
                parts.push(format!(
                    "{} held by Creates in flight",
                    gib(s.in_flight_bytes)
                ));
            }
            format!("{} is left ({})", gib(s.left_bytes()), parts.join(", "))
        };
        format!(
            "{} has no room for {}: it needs {} and {room}. Create the machine on another node, \
             free space on the storage, or point the instance type (catalog `storage`) or the \
             node (--node-storage) at a storage with room",
            s.describe(),
            self.what,
            gib(self.needed_bytes),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn room_left_is_the_overcommitted_free_space_less_what_is_in_flight() {
        let s = StorageSpace {
            storage: "local-lvm".into(),
            node: Some("pve1".into()),
            avail_bytes: 100 * GIB,
            in_flight_bytes: 64 * GIB,
            overcommit: 1.5,
        };
        assert_eq!(s.allowed_bytes(), 150 * GIB);
        assert_eq!(s.left_bytes(), 86 * GIB);
        let full = StorageSpace {
            in_flight_bytes: 200 * GIB,
            ..s.clone()
        };
        assert_eq!(full.left_bytes(), 0);
        assert_eq!(scaled(u64::MAX, 2.0), u64::MAX);
    }

    #[test]
    fn the_refusal_names_the_storage_the_need_the_room_and_the_fix() {
        let e = NoSpace {
            space: StorageSpace {
                storage: "ceph".into(),
                node: None,
                avail_bytes: 40 * GIB,
                in_flight_bytes: 32 * GIB,
                overcommit: 1.0,
            },
            needed_bytes: 32 * GIB,
            what: "the full clone of template 9000 for machine m-1 (instance type pve.small)"
                .into(),
        };
        let text = e.to_string();
        for want in [
            "storage ceph (shared) has no room for the full clone of template 9000 for machine m-1 \
             (instance type pve.small)",
            "it needs 32.0 GiB and 8.0 GiB is left (40.0 GiB free, 32.0 GiB held by Creates in flight)",
            "catalog `storage`",
        ] {
            assert!(text.contains(want), "{want:?} missing from {text}");
        }
        assert!(!text.contains("overcommit"), "{text}");
        let thin = NoSpace {
            space: StorageSpace {
                overcommit: 2.0,
                in_flight_bytes: 0,
                ..e.space.clone()
            },
            needed_bytes: 96 * GIB,
            ..e
        };
        assert!(
            thin.to_string().contains(
                "it needs 96.0 GiB and 80.0 GiB is left (40.0 GiB free x --storage-overcommit ceph=2)"
            ),
            "{thin}"
        );
    }
}
