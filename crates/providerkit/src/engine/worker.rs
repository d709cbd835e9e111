//! The background half of a transition: wait until its acceptance is
//! durable, run the substrate work under the deadline, and land the outcome
//! (a completion after the transition already failed is discarded).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::running::{InFlightGuard, ResumeOutcome};
use super::{Engine, Outcome, Work};
use crate::backend::BackendError;
use crate::model::{State, TransitionKind};
use crate::store::{StoreError, Ticket};

/// Why a transition failed. Its `Display` is the machine's `last_error`
/// word for word; the store's or the substrate's error stays the source.
#[derive(Debug, thiserror::Error)]
pub(super) enum TransitionFailure {
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
}

impl Engine {
    /// The background half of a transition. `_running` counts it as in
    /// flight until it has landed (a graceful shutdown waits on it).
    pub(super) async fn run(
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
        } = attempt;
        let (machine_id, operation_id) = work.ids();
        let configuring = match &work {
            Work::Configure(c) | Work::AwaitReady(c) => Some(c.host_ref.clone()),
            _ => None,
        };
        // Never touch the substrate for a transition that is not durable.
        let outcome = match self.store.durable(ticket).await {
            Err(source) => Err(TransitionFailure::Store { kind, source }),
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

    pub(super) async fn execute(&self, work: Work) -> Result<Outcome, BackendError> {
        match work {
            Work::Create(ctx) => self.backend.create(ctx).await.map(Outcome::Created),
            Work::Configure(ctx) => {
                self.backend.configure(&ctx).await?;
                if self.backend.supports_readiness() {
                    while !self.backend.node_ready(&ctx).await? {
                        tokio::time::sleep(self.opts.timeouts.readiness_poll).await;
                    }
                }
                Ok(Outcome::Done)
            }
            Work::AwaitReady(ctx) => {
                while !self.backend.node_ready(&ctx).await? {
                    tokio::time::sleep(self.opts.timeouts.readiness_poll).await;
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
    pub(super) async fn land(
        &self,
        kind: TransitionKind,
        id: &str,
        operation_id: &str,
        outcome: Result<Outcome, TransitionFailure>,
        resumed: bool,
    ) {
        let ticket = {
            let mut inner = self.inner.write();
            let Some(&slot) = inner.index.get(id) else {
                return;
            };
            let record = &inner.machines[slot];
            let rev = inner.next_rev();
            let landed = match outcome {
                Ok(outcome) => {
                    let host = match &outcome {
                        Outcome::Created(host) => Some(self.host_ref(host)),
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
            let change = inner.replace(slot, next);
            self.store.submit(vec![change])
        };
        if let Err(e) = self.store.durable(ticket).await {
            tracing::error!(machine_id = %id, error = %e, "could not persist transition outcome");
        }
    }
}

pub(super) fn humanize(d: Duration) -> String {
    let secs = d.as_secs();
    if d.subsec_millis() != 0 || secs == 0 {
        format!("{}ms", d.as_millis())
    } else if secs.is_multiple_of(60) {
        format!("{}m", secs / 60)
    } else {
        format!("{secs}s")
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
