//! A restart costs no capacity: transitions the previous process left
//! in flight continue under their original operation id and deadline, and
//! a graceful shutdown lets in-flight work land before the process exits.
//!
//! Each accepted transition stores its window ([`InFlight`]) with the
//! record. At start-up every transitional record is either resumed (the
//! substrate work runs again: each backend step is idempotent and finds
//! what an earlier attempt left) or, when it cannot continue, landed FAILED
//! with a `last_error` that says why. The [`Resumes`] own the transitions
//! found in flight until they are started again.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use zeroize::Zeroizing;

use super::ledger::Ledger;
use super::options::humanize;
use super::running::{ResumeCounters, ResumeOutcome};
use super::worker::{Attempt, Work, Worker};
use crate::backend::{ConfigureCtx, CreateCtx, DeleteCtx, DrainCtx};
use crate::model::{MachineRecord, TransitionKind};
use crate::store::StoreError;

/// What start-up decided for one transitional record.
enum Found {
    /// Continue it: the record stays as stored.
    Resume(Pending),
    /// End it: the record to store instead, and how it counts.
    End(MachineRecord, TransitionKind, ResumeOutcome),
}

/// A transition to resume once the engine is up.
struct Pending {
    kind: TransitionKind,
    work: Work,
    /// What was left of the window at load time.
    remaining: Duration,
    /// The whole window, for a timeout's `last_error`.
    limit: Duration,
    state: crate::model::State,
}

/// Decide, for a record loaded in a transitional state, whether it resumes.
/// `readiness`: whether the backend can tell when a configured node is
/// ready (the only way a Configure can finish without its blob).
fn on_load(record: &MachineRecord, now_ms: u64, readiness: bool) -> Option<Found> {
    let kind = record.state().transition()?;
    let end = |message: String, outcome: ResumeOutcome| {
        record
            .ended_by_restart(message)
            .ok()
            .map(|failed| Found::End(failed, kind, outcome))
    };
    let (Some(window), Some(operation_id)) = (record.in_flight, record.op(kind)) else {
        // Stored before windows were: nothing says how long it may take.
        return record
            .interrupted()
            .ok()
            .map(|failed| Found::End(failed, kind, ResumeOutcome::NotResumable));
    };
    let remaining = window.remaining(now_ms);
    if remaining.is_zero() {
        return end(
            format!(
                "{} timed out after {} (deadline exceeded while the provider was restarting)",
                kind.name(),
                humanize(window.limit())
            ),
            ResumeOutcome::TimedOut,
        );
    }
    if kind == TransitionKind::Configure && !readiness {
        return end(
            "interrupted by a provider restart while CONFIGURING: the bootstrap blob is never \
             stored, so it cannot be delivered again, and with no readiness check configured \
             whether the node joined its cluster is unknown; reclaim the machine and create it \
             again"
                .to_string(),
            ResumeOutcome::NotResumable,
        );
    }
    let host_ref = record
        .host
        .as_ref()
        .map(|h| h.r#ref.clone())
        .unwrap_or_default();
    let machine_id = record.id.clone();
    let operation_id = operation_id.to_string();
    let work = match kind {
        TransitionKind::Create => Work::Create(CreateCtx {
            machine_id,
            operation_id,
            instance_type: record.facts.instance_type.clone(),
            zone: record.facts.zone.clone(),
            resumed: true,
        }),
        // Only the wait for readiness is left to do: the blob is gone.
        TransitionKind::Configure => Work::AwaitReady(ConfigureCtx {
            machine_id,
            operation_id,
            host_ref,
            cluster_id: record.cluster.clone(),
            bootstrap_blob: Zeroizing::default(),
            shard_metadata: record.shard_metadata.clone(),
        }),
        TransitionKind::Drain => Work::Drain(DrainCtx {
            machine_id,
            operation_id,
            host_ref,
            cluster_id: record.cluster.clone(),
            grace_period: window.grace(),
        }),
        TransitionKind::Delete => Work::Delete(DeleteCtx {
            machine_id,
            operation_id,
            host_ref,
        }),
    };
    Some(Found::Resume(Pending {
        kind,
        work,
        remaining,
        limit: window.limit(),
        state: record.state(),
    }))
}

/// The stored records sorted at start-up: each transitional one either
/// resumes or is ended (FAILED, saying why).
pub(super) struct Sorted {
    /// Every record, to load in this order; an ended one as FAILED.
    pub(super) records: Vec<MachineRecord>,
    /// The ended ones: machine id and `last_error`.
    pub(super) ended: Vec<(String, String)>,
    pub(super) resumes: Resumes,
}

/// The transitions found in flight at load time, until [`Resumes::start`].
pub(super) struct Resumes {
    pending: parking_lot::Mutex<Vec<Pending>>,
}

impl Resumes {
    /// Sort the stored `records` (see [`on_load`]) as of `now_ms`; an
    /// ended transition is counted in `counted` as it is found.
    /// `readiness`: whether the backend can tell when a configured node is
    /// ready.
    pub(super) fn sort(
        stored: Vec<MachineRecord>,
        now_ms: u64,
        readiness: bool,
        counted: &ResumeCounters,
    ) -> Sorted {
        let mut records = Vec::with_capacity(stored.len());
        let mut ended = Vec::new();
        let mut pending = Vec::new();
        for record in stored {
            let record = match on_load(&record, now_ms, readiness) {
                Some(Found::End(failed, kind, outcome)) => {
                    counted.add(kind, outcome);
                    ended.push((failed.id.clone(), failed.last_error.clone()));
                    failed
                }
                Some(Found::Resume(p)) => {
                    pending.push(p);
                    record
                }
                // Not in a transition: loaded as stored.
                None => record,
            };
            records.push(record);
        }
        Sorted {
            records,
            ended,
            resumes: Resumes {
                pending: parking_lot::Mutex::new(pending),
            },
        }
    }

    /// Give the ended transitions a fresh revision, so delta readers see
    /// them, and wait until that is durable.
    pub(super) async fn publish_ended(
        ledger: &Ledger,
        ended: &[(String, String)],
    ) -> Result<(), StoreError> {
        let ticket = {
            let mut books = ledger.write();
            let mut changes = Vec::new();
            for (id, _) in ended {
                if let Some(slot) = books.machines.slot(id) {
                    changes.push(books.machines.bump(slot));
                }
            }
            ledger.submit(changes)
        };
        ledger.durable(ticket).await?;
        for (id, why) in ended {
            tracing::warn!(machine_id = %id, error = %why, "transition interrupted by restart recovered as FAILED");
        }
        Ok(())
    }

    /// Start the transitions found in flight at load time (once; later
    /// calls find nothing). Returns how many were resumed.
    pub(super) fn start(&self, worker: &Arc<Worker>, ledger: &Ledger) -> usize {
        let pending = std::mem::take(&mut *self.pending.lock());
        let resumed = pending.len();
        for p in pending {
            let (machine_id, operation_id) = p.work.ids();
            tracing::info!(
                machine_id = %machine_id,
                state = %p.state,
                operation_id = %operation_id,
                time_left = %humanize_left(p.remaining),
                "resuming a transition interrupted by a provider restart"
            );
            let attempt = Attempt {
                kind: p.kind,
                deadline: Instant::now() + p.remaining,
                limit: p.limit,
                resumed: true,
                before: None,
            };
            // Already durable: the record was loaded from the store.
            let ticket = ledger.submit(Vec::new());
            worker.start(attempt, p.work, ticket, None);
        }
        resumed
    }
}

/// Time left, to the second (a log line, not a measurement).
fn humanize_left(d: Duration) -> String {
    humanize(Duration::from_secs(d.as_secs().max(1)))
}
