//! The substrate's inventory, merged into the records: at start-up and at
//! every reconcile pass, new slots are added and the catalogue facts of
//! known ones refreshed. Lifecycle state, host, binding and metadata are
//! the engine's and are never overwritten, with one exception: a FAILED
//! machine's host follows the substrate (see [`Inventory::reattach`]).

use std::sync::Arc;

use super::ledger::Ledger;
use super::machines::{host_ref, Machines};
use super::options::EngineOptions;
use crate::backend::{Backend, BackendError, SlotSpec, SubstrateHost};
use crate::model::{MachineRecord, State};
use crate::store::{Change, StoreError};

/// Slots applied per hold of the state lock during a reconcile pass.
const INVENTORY_BATCH: usize = 2048;

/// What one reconcile pass changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    pub added: usize,
    pub refreshed: usize,
    /// FAILED machines whose host was set or changed to the one the
    /// substrate found marked for them.
    pub reattached: usize,
    /// FAILED machines whose host no longer exists, host cleared.
    pub detached: usize,
}

/// Why a reconcile pass failed; the cause is the source, and its text is
/// part of the message.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("describing the substrate's inventory failed: {0}")]
    Backend(#[source] BackendError),
    #[error("state store: {0}")]
    Store(#[source] StoreError),
}

pub(super) struct Inventory {
    ledger: Arc<Ledger>,
    backend: Arc<dyn Backend>,
    /// Stamped on every host a slot is found with.
    provider: String,
    /// Mutant: every pass bumps every machine's revision.
    #[cfg(feature = "mutants")]
    bump_every_pass: bool,
}

impl Inventory {
    pub(super) fn new(
        ledger: Arc<Ledger>,
        backend: Arc<dyn Backend>,
        opts: &EngineOptions,
    ) -> Inventory {
        Inventory {
            ledger,
            backend,
            provider: opts.provider.clone(),
            #[cfg(feature = "mutants")]
            bump_every_pass: opts.mutants.bump_revision_on_reconcile,
        }
    }

    /// One pass against the substrate.
    pub(super) async fn reconcile(&self) -> Result<ReconcileReport, ReconcileError> {
        let specs = self
            .backend
            .describe()
            .await
            .map_err(ReconcileError::Backend)?;
        self.apply(specs).await.map_err(ReconcileError::Store)
    }

    /// Add new slots and refresh catalogue facts of known ones. Nothing is
    /// bumped when nothing changed.
    pub(super) async fn apply(&self, specs: Vec<SlotSpec>) -> Result<ReconcileReport, StoreError> {
        let mut report = ReconcileReport::default();
        let mut ticket = None;
        let mut specs = specs.into_iter().peekable();
        // In batches, so a pass over a large fleet never holds the lock
        // long enough to stall the RPCs waiting on it.
        while specs.peek().is_some() {
            let mut books = self.ledger.write();
            let mut changes = Vec::new();
            for spec in specs.by_ref().take(INVENTORY_BATCH) {
                self.apply_spec(&mut books.machines, spec, &mut changes, &mut report);
            }
            ticket = Some(self.ledger.submit(changes));
        }
        if let Some(ticket) = ticket {
            self.ledger.durable(ticket).await?;
        }
        Ok(report)
    }

    fn apply_spec(
        &self,
        machines: &mut Machines,
        spec: SlotSpec,
        changes: &mut Vec<Change>,
        report: &mut ReconcileReport,
    ) {
        match machines.slot(&spec.id) {
            Some(slot) => {
                let current = &machines.at(slot).facts;
                let shared = Arc::ptr_eq(current, &spec.facts);
                let changed = !shared && !current.same_as(&spec.facts);
                if !shared {
                    // Equal facts from another source (a load) are swapped
                    // for the substrate's copy too, without a bump.
                    machines.record_mut(slot).facts = spec.facts;
                }
                let moved = self.reattach(machines, slot, spec.host.as_ref(), report);
                if changed {
                    report.refreshed += 1;
                }
                if changed || moved || self.mutant_bump_every_pass() {
                    changes.push(machines.bump(slot));
                }
            }
            None => {
                let record = self.new_record(spec, machines.next_rev());
                let slot = machines.insert(record);
                changes.push(Change::Machine(Arc::clone(machines.at(slot))));
                report.added += 1;
            }
        }
    }

    /// A FAILED machine's host follows the substrate: the VM marked for it
    /// is attached (so nothing marked is orphaned and a reclaim can find
    /// it), and a host that no longer exists is cleared. No shard mutation
    /// is accepted on a FAILED machine, so nothing else writes its host.
    /// Every other state's host is the engine's alone. True when changed.
    fn reattach(
        &self,
        machines: &mut Machines,
        slot: usize,
        found: Option<&SubstrateHost>,
        report: &mut ReconcileReport,
    ) -> bool {
        let record = machines.at(slot);
        if record.state() != State::Failed {
            return false;
        }
        let on_record = record.host.as_ref().map(|h| h.r#ref.as_str());
        let host = match (on_record, found) {
            (Some(have), Some(found)) if have == found.host_ref => return false,
            (None, None) => return false,
            (_, Some(found)) => Some(host_ref(&self.provider, found)),
            (Some(_), None) => None,
        };
        let Ok(next) = record.rehosted(host) else {
            return false;
        };
        match (&next.host, on_record) {
            (Some(host), _) => {
                tracing::info!(machine_id = %record.id, host = %host.r#ref, "FAILED machine re-attached to the host marked for it");
                report.reattached += 1;
            }
            (None, gone) => {
                tracing::info!(machine_id = %record.id, host = gone.unwrap_or_default(), "FAILED machine's host no longer exists; host cleared");
                report.detached += 1;
            }
        }
        // The caller bumps the revision once for every change to the slot.
        machines.replace(slot, next);
        true
    }

    fn new_record(&self, spec: SlotSpec, rev: u64) -> MachineRecord {
        let mut record = MachineRecord::new(spec.id, spec.facts, rev);
        if let Some(host) = &spec.host {
            record.state = State::Idle;
            record.host = Some(host_ref(&self.provider, host));
        }
        record
    }

    #[cfg(feature = "mutants")]
    fn mutant_bump_every_pass(&self) -> bool {
        self.bump_every_pass
    }

    #[cfg(not(feature = "mutants"))]
    fn mutant_bump_every_pass(&self) -> bool {
        false
    }
}
