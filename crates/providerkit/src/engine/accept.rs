//! The accepting half of a transition, under the state lock: validate the
//! request, fence, then not-found, idempotency and position, and accept;
//! the accepted work is handed to the worker. The [`Acceptor`] owns what
//! deciding takes: the input caps, the operation ids it mints, and whether
//! it still accepts at all (a shutdown stops it).
//!
//! The mutants that break acceptance are here, beside what they break:
//! a refusal out of position answered as fenced, metadata stored cut
//! short.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::ledger::{Books, Ledger};
use super::options::{echo_prefix, EngineOptions, Timeouts};
use super::request::{InputCaps, Params};
use super::worker::{Attempt, Work, Worker};
use crate::backend::{
    Admission, AdmitCtx, Backend, BackendError, ConfigureCtx, CreateCtx, DeleteCtx, DrainCtx,
};
use crate::error::KitError;
use crate::fence::Token;
use crate::model::{Begin, InFlight, MachineRecord, State, TransitionError, TransitionKind};
use crate::store::Change;

/// The accepted (or idempotently repeated) transition.
#[derive(Clone, Debug)]
pub struct Ack {
    pub operation_id: String,
    /// The machine as of the ack (a snapshot; the engine moves on).
    pub machine: Arc<MachineRecord>,
}

pub(super) struct Acceptor {
    ledger: Arc<Ledger>,
    backend: Arc<dyn Backend>,
    worker: Arc<Worker>,
    caps: InputCaps,
    timeouts: Timeouts,
    supports_delete: bool,
    /// The boot's generation, in every operation id minted.
    generation: u64,
    next_op: AtomicU64,
    /// Set when shutdown begins: mutations are refused from then on.
    stopping: AtomicBool,
    /// Mutant: an out-of-position request is FAILED_PRECONDITION, as fenced.
    #[cfg(feature = "mutants")]
    out_of_position_failed_precondition: bool,
    /// Mutant: metadata is stored cut short.
    #[cfg(feature = "mutants")]
    truncate_metadata: bool,
}

impl Acceptor {
    pub(super) fn new(
        ledger: Arc<Ledger>,
        backend: Arc<dyn Backend>,
        worker: Arc<Worker>,
        generation: u64,
        opts: &EngineOptions,
    ) -> Acceptor {
        let supports_delete = backend.supports_delete();
        Acceptor {
            ledger,
            backend,
            worker,
            caps: InputCaps::new(opts),
            timeouts: opts.timeouts.clone(),
            supports_delete,
            generation,
            next_op: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
            #[cfg(feature = "mutants")]
            out_of_position_failed_precondition: opts.mutants.out_of_position_failed_precondition,
            #[cfg(feature = "mutants")]
            truncate_metadata: opts.mutants.truncate_metadata,
        }
    }

    pub(super) fn supports_delete(&self) -> bool {
        self.supports_delete
    }

    /// Refuse every mutation from now on (UNAVAILABLE).
    pub(super) fn stop_accepting(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    pub(super) async fn create(&self, id: &str, token: Token) -> Result<Ack, KitError> {
        self.transition(id, token, Params::Create).await
    }

    pub(super) async fn configure(
        &self,
        id: &str,
        token: Token,
        cluster_id: String,
        bootstrap_blob: Vec<u8>,
        shard_metadata: HashMap<String, String>,
    ) -> Result<Ack, KitError> {
        self.transition(
            id,
            token,
            Params::Configure {
                cluster_id,
                // Taken over as it is (no copy), and wiped wherever the
                // Configure ends: refused, failed or done.
                bootstrap_blob: zeroize::Zeroizing::new(bootstrap_blob),
                shard_metadata,
            },
        )
        .await
    }

    pub(super) async fn drain(
        &self,
        id: &str,
        token: Token,
        grace_period_seconds: i64,
    ) -> Result<Ack, KitError> {
        if grace_period_seconds < 0 {
            return Err(KitError::InvalidArgument(format!(
                "grace_period_seconds must be >= 0, got {grace_period_seconds}"
            )));
        }
        let grace = Duration::from_secs(grace_period_seconds as u64);
        self.transition(id, token, Params::Drain { grace }).await
    }

    pub(super) async fn delete(&self, id: &str, token: Token) -> Result<Ack, KitError> {
        self.transition(id, token, Params::Delete).await
    }

    /// The request's shape, then whether this provider can do it at all.
    fn validate(&self, id: &str, token: &Token, params: &Params) -> Result<(), KitError> {
        self.caps.check(id, token, params)?;
        if params.kind() == TransitionKind::Delete && !self.supports_delete {
            return Err(KitError::Unimplemented(
                "this provider cannot delete machines".into(),
            ));
        }
        Ok(())
    }

    /// Fence, then not-found, then idempotency, then position; accept.
    async fn transition(&self, id: &str, token: Token, params: Params) -> Result<Ack, KitError> {
        self.validate(id, &token, &params)?;
        if self.is_stopping() {
            return Err(KitError::ShuttingDown(format!(
                "the provider is shutting down; {} of machine {} was not accepted: retry it \
                 (another replica, or this one once restarted, answers)",
                params.kind().name(),
                echo_prefix(id)
            )));
        }
        let kind = params.kind();
        // Asked before the lock, as it may call the substrate; a refusal is
        // answered only after fencing and idempotency have had their say.
        let admission = match kind {
            TransitionKind::Create => self.admit(id).await,
            _ => None,
        };
        let (admission, refusal) = match admission {
            Some(Ok(held)) => (Some(held), None),
            Some(Err(refused)) => (None, Some(refused)),
            None => (None, None),
        };
        let mut work = None;
        let (result, ticket) = {
            let mut books = self.ledger.write();
            let mut changes = Vec::new();
            let result = self.decide(
                &mut books,
                id,
                &token,
                params,
                refusal,
                &mut changes,
                &mut work,
            );
            (result, self.ledger.submit(changes))
        };
        if let Some((work, before)) = work {
            let limit = self.timeouts.for_kind(kind);
            let attempt = Attempt {
                kind,
                deadline: Instant::now() + limit,
                limit,
                resumed: false,
                before: Some(before),
            };
            // The Create's claim on the substrate lasts until its outcome
            // has landed.
            self.worker.start(attempt, work, ticket, admission);
        }
        // Never committed: the worker puts the machine back as it was, so
        // the caller's retry (with a new token) starts from there.
        self.ledger
            .durable(ticket)
            .await
            .map_err(|source| KitError::NotCommitted { kind, source })?;
        result
    }

    /// The substrate's admission of a Create, asked only while the machine
    /// is SPECULATIVE (a repeated Create of a machine already on its way is
    /// never refused for room). `None`: not asked.
    async fn admit(&self, id: &str) -> Option<Result<Admission, BackendError>> {
        let ctx = {
            let books = self.ledger.read();
            let record = books.machines.at(books.machines.slot(id)?);
            if record.state() != State::Speculative {
                return None;
            }
            AdmitCtx {
                machine_id: id.to_string(),
                instance_type: record.facts.instance_type.clone(),
                zone: record.facts.zone.clone(),
            }
        };
        Some(self.backend.admit_create(&ctx).await)
    }

    // The request's parts and the state it writes to are each one argument,
    // as every caller has them apart; a struct would only be built to be
    // taken apart here.
    #[allow(clippy::too_many_arguments)]
    fn decide(
        &self,
        books: &mut Books,
        id: &str,
        token: &Token,
        params: Params,
        refusal: Option<BackendError>,
        changes: &mut Vec<Change>,
        work: &mut Option<(Work, Arc<MachineRecord>)>,
    ) -> Result<Ack, KitError> {
        let kind = params.kind();
        books.fences.advance(id, token, changes)?;
        let machines = &mut books.machines;
        let slot = machines
            .slot(id)
            .ok_or_else(|| KitError::NotFound(format!("machine {id:?} not found")))?;
        let record = machines.at(slot);
        let state = record.state();
        // Idempotency first: a FAILED machine is never at a transition's
        // own or target state, so its refusal below is unaffected.
        if state == kind.via_state() || state == kind.to_state() {
            if let Some(op) = record.op(kind) {
                return Ok(Ack {
                    operation_id: op.to_string(),
                    machine: Arc::clone(record),
                });
            }
            // A machine adopted from the substrate is at Create's target with
            // no Create on record: record one so retries see the same id.
            if kind == TransitionKind::Create && state == State::Idle {
                let op = self.mint_operation_id();
                let adopted = record
                    .adopt_create(op.clone())
                    .map_err(|e| self.out_of_position(e))?;
                let change = machines.replace(slot, adopted);
                changes.push(change);
                return Ok(Ack {
                    operation_id: op,
                    machine: Arc::clone(machines.at(slot)),
                });
            }
        }
        // The substrate refused room for it: nothing is accepted, the
        // machine stays SPECULATIVE (a machine elsewhere keeps its own
        // out-of-position answer).
        if let Some(refused) = refusal.filter(|_| state == State::Speculative) {
            return Err(KitError::Exhausted(refused));
        }
        let begin = match &params {
            Params::Create => Begin::Create,
            Params::Configure {
                cluster_id,
                shard_metadata,
                ..
            } => Begin::Configure {
                cluster: cluster_id.clone(),
                shard_metadata: self.stored_metadata(shard_metadata),
            },
            Params::Drain { .. } => Begin::Drain,
            Params::Delete => Begin::Delete,
        };
        // What the machine goes back to if the acceptance is never committed.
        let before = Arc::clone(record);
        let mut record = record
            .begin(begin, || self.mint_operation_id(), machines.next_rev())
            .map_err(|e| self.out_of_position(e))?;
        let grace = match &params {
            Params::Drain { grace } => *grace,
            _ => std::time::Duration::ZERO,
        };
        // Stored with the acceptance, so a restart resumes the transition
        // under the deadline it has now.
        record.in_flight = Some(InFlight::starting(
            crate::model::wall_clock_ms(),
            self.timeouts.for_kind(kind),
            grace,
        ));
        let op = record.op(kind).unwrap_or_default().to_string();
        let host_ref = record
            .host
            .as_ref()
            .map(|h| h.r#ref.clone())
            .unwrap_or_default();
        *work = Some((
            match params {
                Params::Create => Work::Create(CreateCtx {
                    machine_id: id.to_string(),
                    operation_id: op.clone(),
                    instance_type: record.facts.instance_type.clone(),
                    zone: record.facts.zone.clone(),
                    resumed: false,
                }),
                Params::Configure {
                    cluster_id,
                    bootstrap_blob,
                    shard_metadata,
                } => Work::Configure(ConfigureCtx {
                    machine_id: id.to_string(),
                    operation_id: op.clone(),
                    host_ref,
                    cluster_id,
                    bootstrap_blob,
                    shard_metadata,
                }),
                Params::Drain { grace } => Work::Drain(DrainCtx {
                    machine_id: id.to_string(),
                    operation_id: op.clone(),
                    host_ref,
                    cluster_id: record.cluster.clone(),
                    grace_period: grace,
                }),
                Params::Delete => Work::Delete(DeleteCtx {
                    machine_id: id.to_string(),
                    operation_id: op.clone(),
                    host_ref,
                }),
            },
            before,
        ));
        let change = machines.replace(slot, record);
        changes.push(change);
        Ok(Ack {
            operation_id: op,
            machine: Arc::clone(machines.at(slot)),
        })
    }

    fn mint_operation_id(&self) -> String {
        let n = self.next_op.fetch_add(1, Ordering::Relaxed);
        format!("op-{:x}-{:x}", self.generation, n)
    }

    /// The answer to a request the position matrix refuses.
    fn out_of_position(&self, refusal: TransitionError) -> KitError {
        #[cfg(feature = "mutants")]
        if self.out_of_position_failed_precondition {
            return KitError::Fenced(refusal.to_string());
        }
        KitError::Conflict(refusal)
    }

    /// The metadata as stored with the machine: verbatim.
    #[cfg(feature = "mutants")]
    fn stored_metadata(&self, metadata: &HashMap<String, String>) -> HashMap<String, String> {
        if self.truncate_metadata {
            return metadata
                .iter()
                .take(8)
                .map(|(k, v)| (k.clone(), v.chars().take(16).collect()))
                .collect();
        }
        metadata.clone()
    }

    /// The metadata as stored with the machine: verbatim.
    #[cfg(not(feature = "mutants"))]
    fn stored_metadata(&self, metadata: &HashMap<String, String>) -> HashMap<String, String> {
        metadata.clone()
    }
}
