//! The background half of a transition: wait until its acceptance is
//! durable, run the substrate work under the deadline, and land the outcome
//! (a completion after the transition already failed is discarded). The
//! [`Worker`] owns what running transitions takes: the count of those in
//! flight, which a graceful shutdown waits on, and the counts of how the
//! ones a restart interrupted ended.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::ledger::Ledger;
use super::machines::host_ref;
use super::options::{humanize, EngineOptions};
use super::running::{InFlightCount, InFlightGuard, ResumeCounters, ResumeOutcome};
use crate::backend::{
    Admission, Backend, BackendError, ConfigureCtx, CreateCtx, DeleteCtx, DrainCtx, SubstrateHost,
};
use crate::model::{MachineRecord, State, TransitionKind};
use crate::store::{StoreError, Ticket};

/// Substrate work handed to a background task once a transition is accepted.
pub(super) enum Work {
    Create(CreateCtx),
    Configure(ConfigureCtx),
    /// A Configure resumed after a restart: its blob was never stored, so
    /// all that is left is to wait for the node to report ready.
    AwaitReady(ConfigureCtx),
    Drain(DrainCtx),
    Delete(DeleteCtx),
}

impl Work {
    /// The machine and operation the work is for.
    pub(super) fn ids(&self) -> (String, String) {
        match self {
            Work::Create(c) => (c.machine_id.clone(), c.operation_id.clone()),
            Work::Configure(c) | Work::AwaitReady(c) => {
                (c.machine_id.clone(), c.operation_id.clone())
            }
            Work::Drain(c) => (c.machine_id.clone(), c.operation_id.clone()),
            Work::Delete(c) => (c.machine_id.clone(), c.operation_id.clone()),
        }
    }
}

enum Outcome {
    Created(SubstrateHost),
    Done,
}

/// Why a transition failed. Its `Display` is the machine's `last_error`
/// word for word; the store's or the substrate's error stays the source.
#[derive(Debug, thiserror::Error)]
enum TransitionFailure {
    /// The acceptance never became durable, so the substrate was not touched.
    #[error("state store write failed before {}: {source}", kind.name())]
    Store {
        kind: TransitionKind,
        #[source]
        source: StoreError,
    },
    /// The substrate's own message is the whole operator-facing story.
    #[error("{0}")]
    Backend(#[source] BackendError),
    /// The deadline passed first; `readiness` is what the last readiness
    /// probe said when the Configure was waiting in the readiness gate.
    #[error(
        "{} timed out after {} (deadline exceeded){}",
        kind.name(),
        humanize(*limit),
        readiness_suffix(readiness.as_deref())
    )]
    TimedOut {
        kind: TransitionKind,
        limit: Duration,
        readiness: Option<String>,
    },
    /// A Configure resumed after a restart (its blob gone) whose node never
    /// reported ready: nothing says whether the bootstrap ran.
    #[error(
        "Configure timed out after {} (deadline exceeded) waiting for the node to become ready \
         after a provider restart; the bootstrap's outcome is unknown: its blob is never stored, \
         so it could not be delivered again{}",
        humanize(*limit),
        readiness.as_deref().map(|d| format!("; {d}")).unwrap_or_default()
    )]
    ResumedConfigureNeverReady {
        limit: Duration,
        readiness: Option<String>,
    },
}

fn readiness_suffix(detail: Option<&str>) -> String {
    detail.map_or_else(String::new, |detail| {
        format!(" waiting for the node to become ready; {detail}")
    })
}

/// One run of a transition's substrate work.
pub(super) struct Attempt {
    pub(super) kind: TransitionKind,
    pub(super) deadline: Instant,
    /// The transition's whole time limit (a resumed one's original window).
    pub(super) limit: Duration,
    /// Continues a transition a restart interrupted (counted on landing).
    pub(super) resumed: bool,
    /// The machine as it was before this transition was accepted: put back
    /// if the acceptance is never committed. None for a resumed one, whose
    /// acceptance was committed before the restart.
    pub(super) before: Option<Arc<MachineRecord>>,
}

pub(super) struct Worker {
    ledger: Arc<Ledger>,
    backend: Arc<dyn Backend>,
    /// Stamped on the host a Create lands with.
    provider: String,
    /// Pause between node-readiness probes after a successful configure.
    readiness_poll: Duration,
    in_flight: Arc<InFlightCount>,
    resumed: ResumeCounters,
}

impl Worker {
    /// `resumed`: the counts start-up began, with the transitions it ended.
    pub(super) fn new(
        ledger: Arc<Ledger>,
        backend: Arc<dyn Backend>,
        opts: &EngineOptions,
        resumed: ResumeCounters,
    ) -> Worker {
        Worker {
            ledger,
            backend,
            provider: opts.provider.clone(),
            readiness_poll: opts.timeouts.readiness_poll,
            in_flight: Arc::default(),
            resumed,
        }
    }

    /// Run `work` in a task of its own, counted in flight from now until it
    /// has landed. `claim`: the substrate's admission of a Create, held
    /// until its outcome has landed.
    pub(super) fn start(
        self: &Arc<Self>,
        attempt: Attempt,
        work: Work,
        ticket: Ticket,
        claim: Option<Admission>,
    ) {
        let worker = Arc::clone(self);
        let guard = self.in_flight.enter();
        tokio::spawn(async move {
            worker.run(attempt, work, ticket, guard).await;
            drop(claim);
        });
    }

    /// Transitions whose substrate work is running now.
    pub(super) fn running(&self) -> usize {
        self.in_flight.running()
    }

    /// Wait until no transition is running, or `bound` passes. Returns how
    /// many were still running.
    pub(super) async fn quiesce(&self, bound: Duration) -> usize {
        self.in_flight.wait_idle(Instant::now() + bound).await
    }

    /// Transitions found at start-up, per kind and outcome, since start.
    pub(super) fn resumed_counts(&self) -> Vec<(TransitionKind, ResumeOutcome, u64)> {
        self.resumed.snapshot()
    }

    /// The background half of a transition. `_running` counts it as in
    /// flight until it has landed (a graceful shutdown waits on it).
    async fn run(
        self: Arc<Self>,
        attempt: Attempt,
        work: Work,
        ticket: Ticket,
        _running: InFlightGuard,
    ) {
        let Attempt {
            kind,
            deadline,
            limit,
            resumed,
            before,
        } = attempt;
        let (machine_id, operation_id) = work.ids();
        let configuring = match &work {
            Work::Configure(c) | Work::AwaitReady(c) => Some(c.host_ref.clone()),
            _ => None,
        };
        // Never touch the substrate for a transition that is not durable.
        let outcome = match self.ledger.durable(ticket).await {
            Err(source) => match before {
                // The caller was answered UNAVAILABLE: withdraw the
                // acceptance rather than fail a machine for a mutation
                // nobody was told was accepted.
                Some(before) => {
                    self.withdraw(kind, &machine_id, &operation_id, before, &source);
                    return;
                }
                None => Err(TransitionFailure::Store { kind, source }),
            },
            Ok(()) => match tokio::time::timeout_at(deadline, self.execute(work)).await {
                Ok(Ok(outcome)) => Ok(outcome),
                Ok(Err(source)) => Err(TransitionFailure::Backend(source)),
                Err(_) => {
                    // Timed out in the readiness gate: say what the probe said.
                    let readiness = configuring
                        .as_deref()
                        .and_then(|h| self.backend.readiness_detail(h));
                    Err(if resumed && kind == TransitionKind::Configure {
                        TransitionFailure::ResumedConfigureNeverReady { limit, readiness }
                    } else {
                        TransitionFailure::TimedOut {
                            kind,
                            limit,
                            readiness,
                        }
                    })
                }
            },
        };
        self.land(kind, &machine_id, &operation_id, outcome, resumed)
            .await;
    }

    /// Put machine `id` back as it was before the acceptance of
    /// `operation_id`, which the store could not commit, unless something
    /// else has changed it since. The withdrawal is queued behind the
    /// acceptance, so once the store commits again both land together and
    /// the state holds the machine as it was. A fence mark the token raised
    /// stays raised: marks only ever rise, and a lower one could admit a
    /// writer a newer epoch has already deposed.
    fn withdraw(
        &self,
        kind: TransitionKind,
        id: &str,
        operation_id: &str,
        before: Arc<MachineRecord>,
        cause: &StoreError,
    ) {
        let mut books = self.ledger.write();
        let machines = &mut books.machines;
        let Some(slot) = machines.slot(id) else {
            return;
        };
        let current = machines.at(slot);
        if current.state() != kind.via_state() || current.op(kind) != Some(operation_id) {
            tracing::info!(machine_id = %id, operation_id, "an uncommitted acceptance was already superseded");
            return;
        }
        let mut restored = (*before).clone();
        restored.rev = machines.next_rev();
        let change = machines.replace(slot, restored);
        // Not awaited: it commits with the acceptance once the store can.
        let _ = self.ledger.submit(vec![change]);
        tracing::warn!(
            machine_id = %id,
            operation_id,
            error = %cause,
            "the state store could not commit the acceptance of {}: withdrawn, the machine is as it \
             was; the caller was answered UNAVAILABLE and its retry is safe",
            kind.name()
        );
    }

    async fn execute(&self, work: Work) -> Result<Outcome, BackendError> {
        match work {
            Work::Create(ctx) => self.backend.create(ctx).await.map(Outcome::Created),
            Work::Configure(ctx) => {
                self.backend.configure(&ctx).await?;
                if self.backend.supports_readiness() {
                    while !self.backend.node_ready(&ctx).await? {
                        tokio::time::sleep(self.readiness_poll).await;
                    }
                }
                Ok(Outcome::Done)
            }
            Work::AwaitReady(ctx) => {
                while !self.backend.node_ready(&ctx).await? {
                    tokio::time::sleep(self.readiness_poll).await;
                }
                Ok(Outcome::Done)
            }
            Work::Drain(ctx) => self.backend.drain(ctx).await.map(|()| Outcome::Done),
            Work::Delete(ctx) => self.backend.delete(ctx).await.map(|()| Outcome::Done),
        }
    }

    /// Land an outcome, unless the transition is no longer the current one
    /// (a late completion after a timeout is discarded). A `resumed` one is
    /// counted as it becomes visible.
    async fn land(
        &self,
        kind: TransitionKind,
        id: &str,
        operation_id: &str,
        outcome: Result<Outcome, TransitionFailure>,
        resumed: bool,
    ) {
        let ticket = {
            let mut books = self.ledger.write();
            let machines = &mut books.machines;
            let Some(slot) = machines.slot(id) else {
                return;
            };
            let record = machines.at(slot);
            let rev = machines.next_rev();
            let landed = match outcome {
                Ok(outcome) => {
                    let host = match &outcome {
                        Outcome::Created(host) => Some(host_ref(&self.provider, host)),
                        Outcome::Done => None,
                    };
                    record.land_success(kind, operation_id, host, rev)
                }
                Err(failure) => record.land_failure(kind, operation_id, failure.to_string(), rev),
            };
            let next = match landed {
                Ok(next) => next,
                Err(_) => {
                    tracing::info!(machine_id = %id, operation_id, "late completion discarded");
                    return;
                }
            };
            if next.state() == State::Failed {
                tracing::warn!(machine_id = %id, operation_id, error = %next.last_error, "transition failed");
            } else {
                tracing::info!(machine_id = %id, operation_id, to = %next.state(), "transition landed");
            }
            if resumed {
                let counted = if next.state() == State::Failed {
                    ResumeOutcome::Failed
                } else {
                    ResumeOutcome::Landed
                };
                self.resumed.add(kind, counted);
            }
            let change = machines.replace(slot, next);
            self.ledger.submit(vec![change])
        };
        if let Err(e) = self.ledger.durable(ticket).await {
            tracing::error!(machine_id = %id, error = %e, "could not persist transition outcome");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;
    use crate::backend::ErrorKind;

    #[test]
    fn failures_read_as_last_error_and_keep_their_cause() {
        let store = TransitionFailure::Store {
            kind: TransitionKind::Configure,
            source: StoreError::unavailable("disk full"),
        };
        assert_eq!(
            store.to_string(),
            "state store write failed before Configure: disk full"
        );
        assert!(store
            .source()
            .is_some_and(|s| s.downcast_ref::<StoreError>().is_some()));

        let backend = TransitionFailure::Backend(BackendError::with_kind(
            ErrorKind::Transient,
            "node pve-a is offline",
        ));
        assert_eq!(backend.to_string(), "node pve-a is offline");
        let cause = backend
            .source()
            .and_then(|s| s.downcast_ref::<BackendError>());
        assert_eq!(cause.map(BackendError::kind), Some(ErrorKind::Transient));

        let timed_out = TransitionFailure::TimedOut {
            kind: TransitionKind::Create,
            limit: Duration::from_secs(480),
            readiness: None,
        };
        assert_eq!(
            timed_out.to_string(),
            "Create timed out after 8m (deadline exceeded)"
        );
        let gated = TransitionFailure::TimedOut {
            kind: TransitionKind::Configure,
            limit: Duration::from_millis(1500),
            readiness: Some("the probe exited 1".into()),
        };
        let resumed = TransitionFailure::ResumedConfigureNeverReady {
            limit: Duration::from_secs(600),
            readiness: Some("the probe exited 1".into()),
        };
        assert_eq!(
            resumed.to_string(),
            "Configure timed out after 10m (deadline exceeded) waiting for the node to become \
             ready after a provider restart; the bootstrap's outcome is unknown: its blob is \
             never stored, so it could not be delivered again; the probe exited 1"
        );
        assert_eq!(
            gated.to_string(),
            "Configure timed out after 1500ms (deadline exceeded) waiting for the node to \
             become ready; the probe exited 1"
        );
    }
}
