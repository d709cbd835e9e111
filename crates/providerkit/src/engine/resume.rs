//! A restart costs no capacity: transitions the previous process left
//! in flight continue under their original operation id and deadline, and
//! a graceful shutdown lets in-flight work land before the process exits.
//!
//! Each accepted transition stores its window ([`InFlight`]) with the
//! record. At start-up every transitional record is either resumed (the
//! substrate work runs again: each backend step is idempotent and finds
//! what an earlier attempt left) or, when it cannot continue, landed FAILED
//! with a `last_error` that says why.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use zeroize::Zeroizing;

use super::running::ResumeOutcome;
use super::worker::humanize;
use super::{Engine, Work};
use crate::backend::{ConfigureCtx, CreateCtx, DeleteCtx, DrainCtx};
use crate::model::{MachineRecord, TransitionKind};

/// What start-up decided for one transitional record.
pub(super) enum Found {
    /// Continue it: the record stays as stored.
    Resume(Pending),
    /// End it: the record to store instead, and how it counts.
    End(MachineRecord, TransitionKind, ResumeOutcome),
}

/// A transition to resume once the engine is up.
pub(super) struct Pending {
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
pub(super) fn on_load(record: &MachineRecord, now_ms: u64, readiness: bool) -> Option<Found> {
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

impl Engine {
    /// Start the transitions found in flight at load time (once; later calls
    /// find nothing). Returns how many were resumed.
    pub fn resume(self: &Arc<Self>) -> usize {
        let pending = std::mem::take(&mut *self.pending_resumes.lock());
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
            let engine = Arc::clone(self);
            let deadline = Instant::now() + p.remaining;
            let guard = self.in_flight.enter();
            // Already durable: the record was loaded from the store.
            let ticket = self.store.submit(Vec::new());
            tokio::spawn(async move {
                let attempt = super::worker::Attempt {
                    kind: p.kind,
                    deadline,
                    limit: p.limit,
                    resumed: true,
                };
                engine.run(attempt, p.work, ticket, guard).await;
            });
        }
        resumed
    }

    /// Transitions found at start-up, per kind and outcome, since start.
    pub fn resumed_counts(&self) -> Vec<(TransitionKind, ResumeOutcome, u64)> {
        self.resumed.snapshot()
    }

    /// Refuse every mutation from now on (UNAVAILABLE): the process is
    /// shutting down, and what is in flight is left to land or to resume.
    pub fn stop_accepting(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    pub(super) fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// Transitions whose substrate work is running now.
    pub fn transitions_running(&self) -> usize {
        self.in_flight.running()
    }

    /// Wait until no transition is running, or `bound` passes. Returns how
    /// many were still running (they stay transitional in the store and
    /// resume at the next start).
    pub async fn quiesce(&self, bound: Duration) -> usize {
        self.in_flight.wait_idle(Instant::now() + bound).await
    }
}

/// Time left, to the second (a log line, not a measurement).
fn humanize_left(d: Duration) -> String {
    humanize(Duration::from_secs(d.as_secs().max(1)))
}
