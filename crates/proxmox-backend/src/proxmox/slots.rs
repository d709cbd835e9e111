//! Clone slots: at most `--max-parallel-clones` clones at a time per
//! (target node, storage key), the unit PVE serialises on (the storage's
//! lock), shared by Creates and replica stagings.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::substrate::SubstrateError;

/// Clone-slot key for a template's disk storages (sorted, deduplicated): one
/// storage is its id; several are joined into one stable key, so templates
/// spanning the same set of storages share a bound; none (a diskless
/// template) is a fixed placeholder.
pub(super) fn storage_key(storages: &[String]) -> String {
    if storages.is_empty() {
        "(no disks)".to_string()
    } else {
        storages.join("+")
    }
}

/// The semaphores of the clone slots, made on first use.
pub(super) struct CloneSlots {
    per_key: usize,
    slots: Mutex<HashMap<(String, String), Arc<Semaphore>>>,
}

impl CloneSlots {
    /// `per_key` slots per (node, storage key); at least one.
    pub(super) fn new(per_key: usize) -> CloneSlots {
        CloneSlots {
            per_key: per_key.max(1),
            slots: Mutex::new(HashMap::new()),
        }
    }

    /// Waits for a slot on (`node`, `storage`); held until the permit drops.
    pub(super) async fn permit(
        &self,
        node: &str,
        storage: &str,
    ) -> Result<OwnedSemaphorePermit, SubstrateError> {
        let sem = self
            .slots
            .lock()
            .entry((node.to_string(), storage.to_string()))
            .or_insert_with(|| Arc::new(Semaphore::new(self.per_key)))
            .clone();
        sem.acquire_owned()
            .await
            .map_err(|_| SubstrateError::new("clone slots closed"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[tokio::test]
    async fn slots_bound_each_key_alone() {
        let slots = CloneSlots::new(1);
        let held = slots.permit("pve1", "local-lvm").await.unwrap();
        // Another key is not bound by the first.
        let _other = slots.permit("pve2", "local-lvm").await.unwrap();
        let waiting = slots.permit("pve1", "local-lvm");
        tokio::pin!(waiting);
        assert!(
            futures::poll!(&mut waiting).is_pending(),
            "the second clone on one key waits"
        );
        drop(held);
        assert!(waiting.await.is_ok(), "and gets the slot once it is free");
    }
}
