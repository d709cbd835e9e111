//! The accepting half of a transition, under the state lock: validate the
//! request, fence, then not-found, idempotency and position, and accept
//! (the background half is in [`super::worker`]).

use std::sync::Arc;

use tokio::time::Instant;

use super::options::echo_prefix;
use super::{Ack, Engine, Inner, Params, Work};
use crate::backend::{
    Admission, AdmitCtx, BackendError, ConfigureCtx, CreateCtx, DeleteCtx, DrainCtx,
};
use crate::error::KitError;
use crate::fence::Token;
use crate::model::{Begin, InFlight, State, TransitionKind};
use crate::store::{Change, FenceMark};

impl Engine {
    pub(super) fn validate(
        &self,
        id: &str,
        token: &Token,
        params: &Params,
    ) -> Result<(), KitError> {
        if id.is_empty() {
            return Err(KitError::InvalidArgument(
                "machine_id must not be empty".into(),
            ));
        }
        let limits = &self.opts.limits;
        check_len("machine_id", id, limits.max_machine_id_bytes)?;
        check_len("shard_id", &token.shard_id, limits.max_shard_id_bytes)?;
        token.validate()?;
        if let Some(e) = self.mutant_token_error(token) {
            return Err(e);
        }
        if let Params::Configure {
            cluster_id,
            bootstrap_blob,
            shard_metadata,
        } = params
        {
            if cluster_id.is_empty() {
                return Err(KitError::InvalidArgument(
                    "cluster_id must not be empty".into(),
                ));
            }
            check_len("cluster_id", cluster_id, limits.max_cluster_id_bytes)?;
            if bootstrap_blob.len() > limits.max_bootstrap_blob_bytes {
                return Err(KitError::InvalidArgument(format!(
                    "bootstrap_blob is {} bytes; the cap is {}",
                    bootstrap_blob.len(),
                    limits.max_bootstrap_blob_bytes
                )));
            }
            if shard_metadata.len() > limits.max_metadata_entries {
                return Err(KitError::InvalidArgument(format!(
                    "shard_metadata has {} entries; the cap is {}",
                    shard_metadata.len(),
                    limits.max_metadata_entries
                )));
            }
            for (key, value) in shard_metadata {
                check_len("a shard_metadata key", key, limits.max_metadata_key_bytes)?;
                if value.len() > limits.max_metadata_value_bytes {
                    return Err(KitError::InvalidArgument(format!(
                        "shard_metadata value for key {} is {} bytes; the cap is {} bytes",
                        echo_prefix(key),
                        value.len(),
                        limits.max_metadata_value_bytes
                    )));
                }
            }
            let bytes: usize = shard_metadata.iter().map(|(k, v)| k.len() + v.len()).sum();
            if bytes > limits.max_metadata_bytes {
                return Err(KitError::InvalidArgument(format!(
                    "shard_metadata is {bytes} bytes; the cap is {}",
                    limits.max_metadata_bytes
                )));
            }
        }
        if params.kind() == TransitionKind::Delete && !self.supports_delete {
            return Err(KitError::Unimplemented(
                "this provider cannot delete machines".into(),
            ));
        }
        Ok(())
    }

    /// Fence, then not-found, then idempotency, then position; accept.
    pub(super) async fn transition(
        self: &Arc<Self>,
        id: &str,
        token: Token,
        params: Params,
    ) -> Result<Ack, KitError> {
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
            let mut inner = self.inner.write();
            let mut changes = Vec::new();
            let result = self.decide(
                &mut inner,
                id,
                &token,
                params,
                refusal,
                &mut changes,
                &mut work,
            );
            (result, self.store.submit(changes))
        };
        if let Some(work) = work {
            let engine = Arc::clone(self);
            let limit = self.opts.timeouts.for_kind(kind);
            let attempt = super::worker::Attempt {
                kind,
                deadline: Instant::now() + limit,
                limit,
                resumed: false,
            };
            let guard = self.in_flight.enter();
            tokio::spawn(async move {
                engine.run(attempt, work, ticket, guard).await;
                // The Create's claim on the substrate lasts until its
                // outcome has landed.
                drop(admission);
            });
        }
        self.store.durable(ticket).await.map_err(KitError::Store)?;
        result
    }

    /// The substrate's admission of a Create, asked only while the machine
    /// is SPECULATIVE (a repeated Create of a machine already on its way is
    /// never refused for room). `None`: not asked.
    async fn admit(&self, id: &str) -> Option<Result<Admission, BackendError>> {
        let ctx = {
            let inner = self.inner.read();
            let record = &inner.machines[*inner.index.get(id)?];
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

    pub(super) fn fence(
        &self,
        inner: &mut Inner,
        id: &str,
        token: &Token,
        changes: &mut Vec<Change>,
    ) -> Result<(), KitError> {
        if token.is_absent() {
            return Ok(());
        }
        let mark_key = self.fence_key(id);
        let mark = inner
            .fences
            .get(&token.shard_id)
            .and_then(|m| m.get(mark_key))
            .copied();
        if !token.is_newer_than(mark) {
            let (epoch, sequence) = mark.unwrap_or_default();
            return Err(KitError::Fenced(format!(
                "stale fencing token for shard {:?} on machine {id:?}: ({}, {}) is not newer \
                 than ({epoch}, {sequence})",
                token.shard_id, token.epoch, token.sequence
            )));
        }
        let mark = (token.epoch, token.sequence);
        // Keys are allocated only the first time a pair is seen.
        match inner
            .fences
            .get_mut(&token.shard_id)
            .and_then(|marks| marks.get_mut(mark_key))
        {
            Some(slot) => *slot = mark,
            None => {
                let cap = self.opts.limits.max_shard_marks_per_machine;
                let held = inner.shard_marks.get(mark_key).copied().unwrap_or(0);
                if held >= cap {
                    return Err(KitError::InvalidArgument(format!(
                        "machine {} already carries fencing marks from {held} shards; the cap \
                         is {cap} shards per machine: reuse an existing shard_id for it",
                        echo_prefix(id)
                    )));
                }
                *inner.shard_marks.entry(mark_key.to_string()).or_default() += 1;
                inner
                    .fences
                    .entry(token.shard_id.clone())
                    .or_default()
                    .insert(mark_key.to_string(), mark);
            }
        }
        changes.push(Change::Fence(FenceMark {
            shard_id: token.shard_id.clone(),
            machine_id: mark_key.to_string(),
            epoch: token.epoch,
            sequence: token.sequence,
        }));
        Ok(())
    }

    // The request's parts and the state it writes to are each one argument,
    // as every caller has them apart; a struct would only be built to be
    // taken apart here.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn decide(
        &self,
        inner: &mut Inner,
        id: &str,
        token: &Token,
        params: Params,
        refusal: Option<BackendError>,
        changes: &mut Vec<Change>,
        work: &mut Option<Work>,
    ) -> Result<Ack, KitError> {
        let kind = params.kind();
        self.fence(inner, id, token, changes)?;
        let slot = *inner
            .index
            .get(id)
            .ok_or_else(|| KitError::NotFound(format!("machine {id:?} not found")))?;
        let record = &inner.machines[slot];
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
                let change = inner.replace(slot, adopted);
                changes.push(change);
                return Ok(Ack {
                    operation_id: op,
                    machine: Arc::clone(&inner.machines[slot]),
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
        let mut record = record
            .begin(begin, || self.mint_operation_id(), inner.next_rev())
            .map_err(|e| self.out_of_position(e))?;
        let grace = match &params {
            Params::Drain { grace } => *grace,
            _ => std::time::Duration::ZERO,
        };
        // Stored with the acceptance, so a restart resumes the transition
        // under the deadline it has now.
        record.in_flight = Some(InFlight::starting(
            crate::model::wall_clock_ms(),
            self.opts.timeouts.for_kind(kind),
            grace,
        ));
        let op = record.op(kind).unwrap_or_default().to_string();
        let host_ref = record
            .host
            .as_ref()
            .map(|h| h.r#ref.clone())
            .unwrap_or_default();
        *work = Some(match params {
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
        });
        let change = inner.replace(slot, record);
        changes.push(change);
        Ok(Ack {
            operation_id: op,
            machine: Arc::clone(&inner.machines[slot]),
        })
    }
}

/// INVALID_ARGUMENT when `value` is longer than `cap` bytes; the message
/// repeats only a short prefix of it.
pub(super) fn check_len(what: &str, value: &str, cap: usize) -> Result<(), KitError> {
    if value.len() <= cap {
        return Ok(());
    }
    Err(KitError::InvalidArgument(format!(
        "{what} is {} bytes (starts {}); the cap is {cap} bytes: use a shorter one",
        value.len(),
        echo_prefix(value)
    )))
}
