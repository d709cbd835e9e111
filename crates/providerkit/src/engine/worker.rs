//! The background half of a transition: wait until its acceptance is
//! durable, run the substrate work under the deadline, and land the outcome
//! (a completion after the transition already failed is discarded).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{Engine, Outcome, Work};
use crate::backend::BackendError;
use crate::model::{State, TransitionKind};
use crate::store::Ticket;

impl Engine {
    /// The background half of a transition.
    pub(super) async fn run(
        self: Arc<Self>,
        kind: TransitionKind,
        work: Work,
        ticket: Ticket,
        deadline: Instant,
    ) {
        let (machine_id, operation_id) = match &work {
            Work::Create(c) => (c.machine_id.clone(), c.operation_id.clone()),
            Work::Configure(c) => (c.machine_id.clone(), c.operation_id.clone()),
            Work::Drain(c) => (c.machine_id.clone(), c.operation_id.clone()),
            Work::Delete(c) => (c.machine_id.clone(), c.operation_id.clone()),
        };
        let configuring = match &work {
            Work::Configure(c) => Some(c.host_ref.clone()),
            _ => None,
        };
        // Never touch the substrate for a transition that is not durable.
        let outcome = match self.store.durable(ticket).await {
            Err(e) => Err(format!(
                "state store write failed before {}: {e}",
                kind.name()
            )),
            Ok(()) => {
                let limit = self.opts.timeouts.for_kind(kind);
                match tokio::time::timeout_at(deadline, self.execute(work)).await {
                    Ok(Ok(outcome)) => Ok(outcome),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => {
                        let mut msg = format!(
                            "{} timed out after {} (deadline exceeded)",
                            kind.name(),
                            humanize(limit)
                        );
                        // Timed out in the readiness gate: say what the probe said.
                        if let Some(detail) = configuring
                            .as_deref()
                            .and_then(|h| self.backend.readiness_detail(h))
                        {
                            msg.push_str(&format!(
                                " waiting for the node to become ready; {detail}"
                            ));
                        }
                        Err(msg)
                    }
                }
            }
        };
        self.land(kind, &machine_id, &operation_id, outcome).await;
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
            Work::Drain(ctx) => self.backend.drain(ctx).await.map(|()| Outcome::Done),
            Work::Delete(ctx) => self.backend.delete(ctx).await.map(|()| Outcome::Done),
        }
    }

    /// Land an outcome, unless the transition is no longer the current one
    /// (a late completion after a timeout is discarded).
    pub(super) async fn land(
        &self,
        kind: TransitionKind,
        id: &str,
        operation_id: &str,
        outcome: Result<Outcome, String>,
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
                Err(message) => record.land_failure(kind, operation_id, message, rev),
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
