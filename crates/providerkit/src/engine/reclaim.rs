//! The way out of FAILED. The contract keeps a FAILED machine FAILED under
//! the shard's mutations (the shard recovers on another slot), so leaving
//! FAILED is the provider's own act: destroy whatever the substrate holds
//! for the machine, then return the slot to SPECULATIVE with a fresh
//! revision. Fence marks are kept, so a shard's stale token stays stale.
//!
//! Also here: the per-state census the metrics read at scrape time, and the
//! sweeper behind the optional automatic reclaim.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::{JoinError, JoinHandle};
use tokio::time::Instant;

use super::worker::humanize;
use super::Engine;
use crate::backend::{BackendError, ReclaimCtx};
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

/// Machines by zone and lifecycle state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Census {
    pub counts: BTreeMap<(String, State), u64>,
}

impl Census {
    pub fn get(&self, zone: &str, state: State) -> u64 {
        self.counts
            .get(&(zone.to_string(), state))
            .copied()
            .unwrap_or(0)
    }
}

impl Engine {
    /// Check that `id` can be reclaimed and start the reclaim. Refuses a
    /// machine that is neither FAILED nor already SPECULATIVE.
    pub fn start_reclaim(self: &Arc<Self>, id: &str) -> Result<ReclaimHandle, ReclaimError> {
        let machine = self.reclaimable(id)?;
        if machine.state() == State::Speculative {
            return Ok(ReclaimHandle {
                machine,
                id: id.to_string(),
                done: None,
            });
        }
        let engine = Arc::clone(self);
        let owned = id.to_string();
        let done = tokio::spawn(async move { engine.run_reclaim(&owned).await });
        Ok(ReclaimHandle {
            machine,
            id: id.to_string(),
            done: Some(done),
        })
    }

    /// Reclaim `id` and wait for the outcome.
    pub async fn reclaim(self: &Arc<Self>, id: &str) -> Result<ReclaimOutcome, ReclaimError> {
        self.start_reclaim(id)?.wait().await
    }

    /// The machine, if it is FAILED or SPECULATIVE.
    fn reclaimable(&self, id: &str) -> Result<Arc<MachineRecord>, ReclaimError> {
        if id.is_empty() {
            return Err(ReclaimError::InvalidArgument(
                "machine_id must not be empty".into(),
            ));
        }
        let inner = self.inner.read();
        let slot = *inner
            .index
            .get(id)
            .ok_or_else(|| ReclaimError::NotFound(id.to_string()))?;
        let machine = Arc::clone(&inner.machines[slot]);
        match machine.state() {
            State::Failed | State::Speculative => Ok(machine),
            state => Err(ReclaimError::NotFailed {
                id: id.to_string(),
                state,
            }),
        }
    }

    async fn run_reclaim(&self, id: &str) -> Result<ReclaimOutcome, ReclaimError> {
        let _one_at_a_time = self.reclaims.lock().await;
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
        let limit = self.opts.timeouts.delete;
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
            let mut inner = self.inner.write();
            let slot = *inner
                .index
                .get(id)
                .ok_or_else(|| ReclaimError::NotFound(id.to_string()))?;
            // Only a reclaim moves a FAILED machine, and reclaims are serial.
            let state = inner.machines[slot].state();
            let next = inner.machines[slot]
                .reclaimed(inner.next_rev())
                .map_err(|_| ReclaimError::NotFailed {
                    id: id.to_string(),
                    state,
                })?;
            let change = inner.replace(slot, next);
            (
                Arc::clone(&inner.machines[slot]),
                self.store.submit(vec![change]),
            )
        };
        self.store
            .durable(ticket)
            .await
            .map_err(|source| ReclaimError::Store {
                id: id.to_string(),
                source,
            })?;
        tracing::info!(machine_id = %id, rev = record.rev, "reclaimed: the machine is SPECULATIVE again");
        Ok(ReclaimOutcome::Reclaimed(record))
    }

    /// Machines by zone and state, every state of every zone present (at 0
    /// when empty). One pass under the read lock; meant for scrape time.
    pub fn census(&self, zones: &[String]) -> Census {
        let mut counts = BTreeMap::new();
        for zone in zones {
            for state in State::ALL {
                counts.insert((zone.clone(), state), 0);
            }
        }
        // Counted per shared facts first: one zone string per offering,
        // not one allocation per machine.
        let mut by_facts: HashMap<
            *const crate::model::Facts,
            (Arc<crate::model::Facts>, [u64; 8]),
        > = HashMap::new();
        {
            let inner = self.inner.read();
            for m in &inner.machines {
                let entry = by_facts
                    .entry(Arc::as_ptr(&m.facts))
                    .or_insert_with(|| (Arc::clone(&m.facts), [0; 8]));
                entry.1[m.state() as usize] += 1;
            }
        }
        for (facts, per_state) in by_facts.into_values() {
            for state in State::ALL {
                let n = per_state[state as usize];
                *counts.entry((facts.zone.clone(), state)).or_insert(0) += n;
            }
        }
        Census { counts }
    }

    /// Ids of the FAILED machines.
    pub fn failed_ids(&self) -> Vec<String> {
        let inner = self.inner.read();
        inner
            .machines
            .iter()
            .filter(|m| m.state() == State::Failed)
            .map(|m| m.id.clone())
            .collect()
    }
}

/// The automatic reclaim: a machine is reclaimed once this process has
/// seen it FAILED for the whole hold period. The clock starts when the
/// sweeper first sees the machine FAILED (after a restart it starts over:
/// the hold is never shortened, only lengthened).
pub struct ReclaimSweeper {
    hold: Duration,
    first_seen: HashMap<String, Instant>,
}

impl ReclaimSweeper {
    pub fn new(hold: Duration) -> ReclaimSweeper {
        ReclaimSweeper {
            hold,
            first_seen: HashMap::new(),
        }
    }

    /// How often to sweep: often enough that a machine is reclaimed close
    /// to its hold period, rarely enough to cost nothing.
    pub fn period(&self) -> Duration {
        (self.hold / 4).clamp(Duration::from_millis(50), Duration::from_secs(30))
    }

    /// One sweep: reclaim every machine held FAILED long enough. Returns
    /// how many were reclaimed. A failed reclaim starts the machine's hold
    /// over, so a substrate that keeps refusing is retried once per period.
    pub async fn sweep(&mut self, engine: &Arc<Engine>) -> usize {
        let now = Instant::now();
        let failed = engine.failed_ids();
        let mut seen = HashMap::with_capacity(failed.len());
        let mut due = Vec::new();
        for id in failed {
            let since = self.first_seen.get(&id).copied().unwrap_or(now);
            if now.duration_since(since) >= self.hold {
                due.push(id.clone());
            }
            seen.insert(id, since);
        }
        // Machines no longer FAILED are forgotten.
        self.first_seen = seen;
        let mut reclaimed = 0;
        for id in due {
            match engine.reclaim(&id).await {
                Ok(ReclaimOutcome::Reclaimed(_)) => {
                    tracing::info!(machine_id = %id, hold = %humanize(self.hold), "FAILED machine reclaimed automatically (--reclaim-failed-after)");
                    self.first_seen.remove(&id);
                    reclaimed += 1;
                }
                Ok(ReclaimOutcome::AlreadySpeculative(_)) => {
                    self.first_seen.remove(&id);
                }
                Err(ReclaimError::NotFailed { .. }) | Err(ReclaimError::NotFound(_)) => {
                    self.first_seen.remove(&id);
                }
                Err(e) => {
                    tracing::warn!(machine_id = %id, error = %e, "automatic reclaim failed; retrying after another hold period");
                    self.first_seen.insert(id, Instant::now());
                }
            }
        }
        reclaimed
    }
}
