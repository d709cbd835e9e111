//! Every machine record, indexed by id and by revision, and the revision
//! the next visible change gets. The table knows nothing of locks or the
//! store: the ledger holds it behind its lock, and each change it makes is
//! returned as the [`Change`] to persist.

use std::collections::{BTreeMap, HashMap};
use std::ops::RangeBounds;
use std::sync::Arc;

use bigfleet_proto::v1alpha1 as pb;

use crate::backend::SubstrateHost;
use crate::model::{Facts, MachineRecord, State};
use crate::store::Change;

#[derive(Default)]
pub(super) struct Machines {
    /// Shared with List snapshots and the store; changed copy-on-write.
    records: Vec<Arc<MachineRecord>>,
    index: HashMap<String, usize>,
    /// rev -> machine slot; every machine appears exactly once.
    by_rev: BTreeMap<u64, usize>,
    revision: u64,
}

impl Machines {
    /// Add a machine; returns its slot.
    pub(super) fn insert(&mut self, record: MachineRecord) -> usize {
        let slot = self.records.len();
        self.index.insert(record.id.clone(), slot);
        self.by_rev.insert(record.rev, slot);
        self.revision = self.revision.max(record.rev);
        self.records.push(Arc::new(record));
        slot
    }

    /// The slot of machine `id`, if there is one.
    pub(super) fn slot(&self, id: &str) -> Option<usize> {
        self.index.get(id).copied()
    }

    /// The record in `slot` (a slot this table handed out).
    pub(super) fn at(&self, slot: usize) -> &Arc<MachineRecord> {
        &self.records[slot]
    }

    pub(super) fn len(&self) -> usize {
        self.records.len()
    }

    /// The revision of the latest visible change.
    pub(super) fn revision(&self) -> u64 {
        self.revision
    }

    /// The revision the next visible change gets.
    pub(super) fn next_rev(&self) -> u64 {
        self.revision + 1
    }

    /// The record in `slot`, for changing (copied only if a reader holds it).
    pub(super) fn record_mut(&mut self, slot: usize) -> &mut MachineRecord {
        Arc::make_mut(&mut self.records[slot])
    }

    /// Put `record` (a transition's result) in `slot`, its revision indexed,
    /// and return the change to persist.
    pub(super) fn replace(&mut self, slot: usize, record: MachineRecord) -> Change {
        let old = self.records[slot].rev;
        if old != record.rev {
            self.by_rev.remove(&old);
            self.by_rev.insert(record.rev, slot);
        }
        self.revision = self.revision.max(record.rev);
        self.records[slot] = Arc::new(record);
        Change::Machine(Arc::clone(&self.records[slot]))
    }

    /// Give the machine in `slot` a fresh revision (after a visible change)
    /// and return the change to persist.
    pub(super) fn bump(&mut self, slot: usize) -> Change {
        self.revision += 1;
        let revision = self.revision;
        let old = self.records[slot].rev;
        self.by_rev.remove(&old);
        self.record_mut(slot).rev = revision;
        self.by_rev.insert(revision, slot);
        Change::Machine(Arc::clone(&self.records[slot]))
    }

    /// The machines whose revision is in `revs`, in revision order, each
    /// with its revision. An inverted range panics, as `BTreeMap::range`
    /// does: callers build theirs so it never is.
    pub(super) fn by_revision(
        &self,
        revs: impl RangeBounds<u64>,
    ) -> impl Iterator<Item = (u64, &Arc<MachineRecord>)> + '_ {
        self.by_rev
            .range(revs)
            .map(|(&rev, &slot)| (rev, &self.records[slot]))
    }

    /// Machines per shared facts and state. Counted per facts, not per
    /// zone: one zone string per offering, not one allocation per machine,
    /// so the pass under the read lock stays cheap.
    pub(super) fn count_by_facts(&self) -> Vec<(Arc<Facts>, [u64; 8])> {
        let mut by_facts: HashMap<*const Facts, (Arc<Facts>, [u64; 8])> = HashMap::new();
        for m in &self.records {
            let entry = by_facts
                .entry(Arc::as_ptr(&m.facts))
                .or_insert_with(|| (Arc::clone(&m.facts), [0; 8]));
            entry.1[m.state() as usize] += 1;
        }
        by_facts.into_values().collect()
    }

    /// Ids of the FAILED machines.
    pub(super) fn failed_ids(&self) -> Vec<String> {
        self.records
            .iter()
            .filter(|m| m.state() == State::Failed)
            .map(|m| m.id.clone())
            .collect()
    }
}

/// A host as the records hold it: the substrate's reference, stamped with
/// the provider's label.
pub(super) fn host_ref(provider: &str, host: &SubstrateHost) -> pb::HostRef {
    pb::HostRef {
        provider: provider.to_string(),
        r#ref: host.host_ref.clone(),
    }
}

/// Machines by zone and lifecycle state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Census {
    pub counts: BTreeMap<(String, State), u64>,
}

impl Census {
    /// Every state of every zone in `zones` (at 0 when empty), plus the
    /// counts per facts a table pass found. Built after the lock is
    /// released: only the counting pass holds it.
    pub(super) fn from_counts(zones: &[String], by_facts: Vec<(Arc<Facts>, [u64; 8])>) -> Census {
        let mut counts = BTreeMap::new();
        for zone in zones {
            for state in State::ALL {
                counts.insert((zone.clone(), state), 0);
            }
        }
        for (facts, per_state) in by_facts {
            for state in State::ALL {
                let n = per_state[state as usize];
                *counts.entry((facts.zone.clone(), state)).or_insert(0) += n;
            }
        }
        Census { counts }
    }

    pub fn get(&self, zone: &str, state: State) -> u64 {
        self.counts
            .get(&(zone.to_string(), state))
            .copied()
            .unwrap_or(0)
    }
}
