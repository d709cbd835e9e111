//! The way out of FAILED. The contract keeps a FAILED machine FAILED under
//! the shard's mutations (the shard recovers on another slot), so leaving
//! FAILED is the provider's own act: destroy whatever the substrate holds
//! for the machine, then return the slot to SPECULATIVE with a fresh
//! revision. Fence marks are kept, so a shard's stale token stays stale.
//!
//! The [`Reclaims`] own what reclaiming takes: the one-at-a-time lock, and
//! the window a reclaim's destruction may take (the Delete timeout).

use std::sync::Arc;
use std::time::Duration;

use tokio::task::{JoinError, JoinHandle};

use super::ledger::Ledger;
use super::options::{humanize, EngineOptions};
use crate::backend::{Backend, BackendError, ReclaimCtx};
use crate::model::{MachineRecord, State};
use crate::store::StoreError;

/// How a reclaim ended.
#[derive(Clone, Debug)]
pub enum ReclaimOutcome {
    /// The machine's hosts were destroyed and it is SPECULATIVE again.
    Reclaimed(Arc<MachineRecord>),
    /// Nothing to do: the machine is already SPECULATIVE (a repeated
    /// reclaim, or one that raced another).
    AlreadySpeculative(Arc<MachineRecord>),
}

impl ReclaimOutcome {
    pub fn machine(&self) -> &Arc<MachineRecord> {
        match self {
            ReclaimOutcome::Reclaimed(m) | ReclaimOutcome::AlreadySpeculative(m) => m,
        }
    }
}

/// Why a reclaim was refused or did not finish. A machine whose reclaim
/// failed stays FAILED with its `last_error`; running reclaim again is safe.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ReclaimError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("machine {0:?} not found")]
    NotFound(String),
    #[error(
        "machine {id:?} is {state}, not FAILED: reclaim only returns FAILED machines to \
         SPECULATIVE; a healthy machine leaves through the shard's Drain and Delete"
    )]
    NotFailed { id: String, state: State },
    #[error(
        "reclaiming machine {id:?}: destroying its hosts failed: {source}; the machine stays \
         FAILED: fix the cause and reclaim again"
    )]
    Substrate {
        id: String,
        #[source]
        source: BackendError,
    },
    #[error(
        "reclaiming machine {id:?}: destroying its hosts did not finish within {after} (the \
         Delete timeout); the machine stays FAILED: reclaim again"
    )]
    TimedOut { id: String, after: String },
    #[error("reclaiming machine {id:?}: state store: {source}; reclaim again once the store is writable")]
    Store {
        id: String,
        #[source]
        source: StoreError,
    },
    /// The reclaim task panicked or was cancelled. The join error is shared
    /// so the error stays `Clone`.
    #[error("reclaiming machine {id:?}: the reclaim task ended unexpectedly: {source}")]
    Aborted {
        id: String,
        #[source]
        source: Arc<JoinError>,
    },
}

impl ReclaimError {
    pub fn code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            ReclaimError::InvalidArgument(_) => Code::InvalidArgument,
            ReclaimError::NotFound(_) => Code::NotFound,
            ReclaimError::NotFailed { .. } => Code::FailedPrecondition,
            ReclaimError::Substrate { .. }
            | ReclaimError::TimedOut { .. }
            | ReclaimError::Store { .. } => Code::Unavailable,
            ReclaimError::Aborted { .. } => Code::Internal,
        }
    }
}

impl From<ReclaimError> for tonic::Status {
    fn from(e: ReclaimError) -> tonic::Status {
        tonic::Status::new(e.code(), e.to_string())
    }
}

/// A reclaim that passed its checks. The work runs in a task of its own,
/// so a caller that stops waiting (a cancelled RPC) never cuts it short.
pub struct ReclaimHandle {
    /// The machine as the reclaim found it.
    pub machine: Arc<MachineRecord>,
    id: String,
    done: Option<JoinHandle<Result<ReclaimOutcome, ReclaimError>>>,
}

impl ReclaimHandle {
    /// False when the machine was already SPECULATIVE (nothing was started).
    pub fn started(&self) -> bool {
        self.done.is_some()
    }

    pub async fn wait(self) -> Result<ReclaimOutcome, ReclaimError> {
        match self.done {
            None => Ok(ReclaimOutcome::AlreadySpeculative(self.machine)),
            Some(task) => task.await.unwrap_or_else(|e| {
                Err(ReclaimError::Aborted {
                    id: self.id,
                    source: Arc::new(e),
                })
            }),
        }
    }
}

pub(super) struct Reclaims {
    ledger: Arc<Ledger>,
    backend: Arc<dyn Backend>,
    /// How long destroying a machine's hosts may take: the Delete timeout.
    limit: Duration,
    /// One reclaim at a time: it is a rare operator action, and serialising
    /// it means two reclaims never destroy the same machine's hosts at once.
    one_at_a_time: tokio::sync::Mutex<()>,
}

impl Reclaims {
    pub(super) fn new(
        ledger: Arc<Ledger>,
        backend: Arc<dyn Backend>,
        opts: &EngineOptions,
    ) -> Reclaims {
        Reclaims {
            ledger,
            backend,
            limit: opts.timeouts.delete,
            one_at_a_time: tokio::sync::Mutex::new(()),
        }
    }

    /// Check that `id` can be reclaimed and start the reclaim. Refuses a
    /// machine that is neither FAILED nor already SPECULATIVE.
    pub(super) fn start(self: &Arc<Self>, id: &str) -> Result<ReclaimHandle, ReclaimError> {
        let machine = self.reclaimable(id)?;
        if machine.state() == State::Speculative {
            return Ok(ReclaimHandle {
                machine,
                id: id.to_string(),
                done: None,
            });
        }
        let reclaims = Arc::clone(self);
        let owned = id.to_string();
        let done = tokio::spawn(async move { reclaims.run(&owned).await });
        Ok(ReclaimHandle {
            machine,
            id: id.to_string(),
            done: Some(done),
        })
    }

    /// The machine, if it is FAILED or SPECULATIVE.
    fn reclaimable(&self, id: &str) -> Result<Arc<MachineRecord>, ReclaimError> {
        if id.is_empty() {
            return Err(ReclaimError::InvalidArgument(
                "machine_id must not be empty".into(),
            ));
        }
        let books = self.ledger.read();
        let slot = books
            .machines
            .slot(id)
            .ok_or_else(|| ReclaimError::NotFound(id.to_string()))?;
        let machine = Arc::clone(books.machines.at(slot));
        match machine.state() {
            State::Failed | State::Speculative => Ok(machine),
            state => Err(ReclaimError::NotFailed {
                id: id.to_string(),
                state,
            }),
        }
    }

    async fn run(&self, id: &str) -> Result<ReclaimOutcome, ReclaimError> {
        let _one_at_a_time = self.one_at_a_time.lock().await;
        // Checked again under the reclaim lock: another reclaim may have
        // finished while this one waited.
        let machine = self.reclaimable(id)?;
        if machine.state() == State::Speculative {
            return Ok(ReclaimOutcome::AlreadySpeculative(machine));
        }
        let ctx = ReclaimCtx {
            machine_id: id.to_string(),
            host_ref: machine.host.as_ref().map(|h| h.r#ref.clone()),
        };
        tracing::info!(machine_id = %id, host = ctx.host_ref.as_deref().unwrap_or("-"), "reclaim: destroying the machine's hosts");
        let limit = self.limit;
        match tokio::time::timeout(limit, self.backend.reclaim(ctx)).await {
            Ok(Ok(())) => {}
            Ok(Err(source)) => {
                tracing::warn!(machine_id = %id, error = %source, "reclaim failed; the machine stays FAILED");
                return Err(ReclaimError::Substrate {
                    id: id.to_string(),
                    source,
                });
            }
            Err(_) => {
                tracing::warn!(machine_id = %id, "reclaim timed out; the machine stays FAILED");
                return Err(ReclaimError::TimedOut {
                    id: id.to_string(),
                    after: humanize(limit),
                });
            }
        }
        let (record, ticket) = {
            let mut books = self.ledger.write();
            let machines = &mut books.machines;
            let slot = machines
                .slot(id)
                .ok_or_else(|| ReclaimError::NotFound(id.to_string()))?;
            // Only a reclaim moves a FAILED machine, and reclaims are serial.
            let state = machines.at(slot).state();
            let next = machines
                .at(slot)
                .reclaimed(machines.next_rev())
                .map_err(|_| ReclaimError::NotFailed {
                    id: id.to_string(),
                    state,
                })?;
            let change = machines.replace(slot, next);
            (
                Arc::clone(machines.at(slot)),
                self.ledger.submit(vec![change]),
            )
        };
        self.ledger
            .durable(ticket)
            .await
            .map_err(|source| ReclaimError::Store {
                id: id.to_string(),
                source,
            })?;
        tracing::info!(machine_id = %id, rev = record.rev, "reclaimed: the machine is SPECULATIVE again");
        Ok(ReclaimOutcome::Reclaimed(record))
    }
}
