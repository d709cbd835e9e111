//! Gauges and a counter read from the backend's guards at scrape time:
//! node memory, storage room, destroy leftovers and clone slots.

use std::sync::Arc;

use parking_lot::RwLock;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use proxmox_backend::backend::ProxmoxBackend;
use proxmox_backend::capacity::StorageSpace;
use proxmox_backend::memory::MemoryRoom;
use proxmox_backend::substrate::CloneSlotsView;

use super::NodeLabels;

/// A gauge family: its name, its help, and its value for one item.
type Gauge<'a, T> = (&'a str, &'a str, fn(&T) -> i64);

/// Bytes as a gauge's value; past `i64::MAX` it saturates.
fn bytes(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// A count as a gauge's value.
fn count(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

const MIB: i64 = 1 << 20;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StorageLabels {
    storage: String,
    /// Empty for a shared storage.
    node: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CloneSlotLabels {
    /// The node, or `(cluster)` for a shared storage's cluster-wide slots.
    node: String,
    storage: String,
}

/// `bigfleet_proxmox_node_memory_{committed,limit}_bytes{node}` (the node
/// memory guard), `bigfleet_proxmox_storage_{avail,allowed,in_flight}_bytes
/// {storage,node}` (the storage guard, as last read: at start-up and by
/// each full clone's Create), `bigfleet_proxmox_destroy_leftover_volumes
/// _total` (while this replica leads: the leader destroys; it counts from
/// 0 again each term, a reset `increase()` and `rate()` handle) and
/// `bigfleet_proxmox_clone_slots{,_used,_waiting}{node,storage}` and
/// `bigfleet_proxmox_clone_pace_seconds{node,storage}`, from the backend at
/// scrape time.
pub(super) struct BackendGauges {
    pub(super) source: Arc<RwLock<Option<Arc<ProxmoxBackend>>>>,
}

impl std::fmt::Debug for BackendGauges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BackendGauges")
    }
}

impl Collector for BackendGauges {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        // A clone, so the lock is not held while the guards are read.
        let Some(backend) = self.source.read().clone() else {
            return Ok(());
        };
        let families: [Gauge<'_, MemoryRoom>; 2] = [
            (
                "bigfleet_proxmox_node_memory_committed_bytes",
                "Configured memory of the VMs running or about to run on the node (whoever \
                 owns them) plus the provider's Creates in flight there, as the node memory \
                 guard last checked it",
                |r| bytes(r.committed_mib).saturating_mul(MIB),
            ),
            (
                "bigfleet_proxmox_node_memory_limit_bytes",
                "What the node memory guard lets be committed on the node: \
                 --node-memory-limit x its memory (its whole memory when the guard is off)",
                |r| bytes(r.limit_mib).saturating_mul(MIB),
            ),
        ];
        encode_gauges(&mut encoder, &families, &backend.memory_rooms(), |r| {
            NodeLabels {
                node: r.node.clone(),
            }
        })?;
        let families: [Gauge<'_, StorageSpace>; 3] = [
            (
                "bigfleet_proxmox_storage_avail_bytes",
                "Free space of a storage full clones land on, as the storage guard counts it \
                 (PVE's avail at its last read, with the disks of the provider's clones in \
                 flight counted once, by the in-flight gauge); node is empty for a shared storage",
                |s| bytes(s.avail_bytes),
            ),
            (
                "bigfleet_proxmox_storage_allowed_bytes",
                "What the storage guard lets full clones take there: free space x \
                 --storage-overcommit (1 unless set)",
                |s| bytes(s.allowed_bytes()),
            ),
            (
                "bigfleet_proxmox_storage_in_flight_bytes",
                "Disk bytes of the provider's full clones admitted there whose clone task \
                 has not ended yet",
                |s| bytes(s.in_flight_bytes),
            ),
        ];
        encode_gauges(&mut encoder, &families, &backend.storage_spaces(), |s| {
            StorageLabels {
                storage: s.storage.clone(),
                node: s.node.clone().unwrap_or_default(),
            }
        })?;
        let families: [Gauge<'_, CloneSlotsView>; 3] = [
            (
                "bigfleet_proxmox_clone_slots",
                "Clones that may run at once on a storage (node is (cluster) for a shared \
                 storage's cluster-wide slots): --max-parallel-clones when fixed, what the \
                 storage showed it takes when adaptive",
                |d| count(d.limit),
            ),
            (
                "bigfleet_proxmox_clone_slots_used",
                "Clones holding one of those slots: running, or staging a template replica",
                |d| count(d.used),
            ),
            (
                "bigfleet_proxmox_clone_slots_waiting",
                "Clones waiting for one of those slots",
                |d| count(d.waiting),
            ),
        ];
        let slots = backend.clone_slots();
        let labels = |d: &CloneSlotsView| CloneSlotLabels {
            node: d.node.clone(),
            storage: d.storage.clone(),
        };
        encode_gauges(&mut encoder, &families, &slots, labels)?;
        // Only the storages that learnt a pace have one; in seconds, a float.
        let mut family = encoder.encode_descriptor(
            "bigfleet_proxmox_clone_pace_seconds",
            "A node's own storage that learnt its rate from its first clones' progress: \
             one clone starts each this long (its time per clone at its whole bandwidth)",
            None,
            MetricType::Gauge,
        )?;
        for d in &slots {
            if let Some(pace) = d.pace {
                ConstGauge::new(pace.as_secs_f64()).encode(family.encode_family(&labels(d))?)?;
            }
        }
        let family = encoder.encode_descriptor(
            "bigfleet_proxmox_destroy_leftover_volumes",
            "Volumes PVE could not remove when it destroyed a VM (`Could not remove disk`: \
             RBD watchers, an LV or ZFS dataset in use): the VM is gone, the disk still takes \
             space until removed by hand",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(backend.destroy_leftovers()).encode(family)
    }
}

/// One gauge family per `families` entry, a series per item labelled by
/// `labels`.
fn encode_gauges<T, L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder,
    families: &[Gauge<'_, T>],
    items: &[T],
    labels: impl Fn(&T) -> L,
) -> Result<(), std::fmt::Error> {
    for (name, help, value) in families {
        let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
        for item in items {
            ConstGauge::new(value(item)).encode(family.encode_family(&labels(item))?)?;
        }
    }
    Ok(())
}
