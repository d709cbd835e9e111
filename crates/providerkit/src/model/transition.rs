//! The record's lifecycle transitions, as pure functions: each takes the
//! record and its inputs and returns the new record, or a
//! [`TransitionError`] when the record is not where the transition starts.
//! The engine decides when (under its lock, after fencing and idempotency)
//! and persists the result; what each transition changes lives here.
//!
//! Fencing marks are not part of the record (the engine keeps them per
//! shard and machine), so no transition can move or drop one.

use std::collections::HashMap;

use bigfleet_proto::v1alpha1 as pb;

use super::{MachineRecord, State, TransitionKind};

/// An accepted transition and what it brings into the record.
#[derive(Clone, Debug, PartialEq)]
pub enum Begin {
    Create,
    /// The binding, stored as given.
    Configure {
        cluster: String,
        shard_metadata: HashMap<String, String>,
    },
    Drain,
    Delete,
}

impl Begin {
    pub fn kind(&self) -> TransitionKind {
        match self {
            Begin::Create => TransitionKind::Create,
            Begin::Configure { .. } => TransitionKind::Configure,
            Begin::Drain => TransitionKind::Drain,
            Begin::Delete => TransitionKind::Delete,
        }
    }
}

/// A transition the record's state does not allow. The `Display` is the
/// operator-facing refusal the engine answers with.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    /// Only a reclaim moves a FAILED machine.
    #[error(
        "machine {id:?} is FAILED and needs intervention; {} is not accepted (last_error: {last_error})",
        kind.name()
    )]
    Failed {
        id: String,
        kind: TransitionKind,
        last_error: String,
    },
    /// The machine is not in the state the transition starts from.
    #[error("machine {id:?} is {state}; {} needs {}", kind.name(), kind.from_state())]
    OutOfPosition {
        id: String,
        state: State,
        kind: TransitionKind,
    },
    /// A completion for a transition that is no longer the current one (it
    /// timed out, or a newer one started).
    #[error(
        "machine {id:?} is {state}: its {} with operation {operation_id} is no longer current",
        kind.name()
    )]
    Superseded {
        id: String,
        state: State,
        kind: TransitionKind,
        operation_id: String,
    },
    /// Reclaim applies to FAILED machines only.
    #[error("machine {id:?} is {state}, not FAILED")]
    NotFailed { id: String, state: State },
    /// A restart interrupts only a machine in a transition.
    #[error("machine {id:?} is {state}, not in a transition")]
    NotTransitional { id: String, state: State },
    /// Only an IDLE machine with no Create on record adopts one.
    #[error("machine {id:?} is {state}; only an IDLE machine with no Create on record adopts one")]
    NotAdoptable { id: String, state: State },
}

impl MachineRecord {
    /// Accept `begin`: the machine enters the transition's state with
    /// `rev`, its last error cleared and the new operation id on record.
    /// `operation_id` is called only when the transition is allowed, so a
    /// refusal spends no id.
    ///
    /// A Create starts a new cycle (no earlier operation id describes the
    /// machine); a Configure stores its binding and forgets the last Drain;
    /// a Delete forgets Create, Configure and Drain.
    pub fn begin(
        &self,
        begin: Begin,
        operation_id: impl FnOnce() -> String,
        rev: u64,
    ) -> Result<MachineRecord, TransitionError> {
        let kind = begin.kind();
        if self.state == State::Failed {
            return Err(TransitionError::Failed {
                id: self.id.clone(),
                kind,
                last_error: self.last_error.clone(),
            });
        }
        if self.state != kind.from_state() {
            return Err(TransitionError::OutOfPosition {
                id: self.id.clone(),
                state: self.state,
                kind,
            });
        }
        let mut next = self.clone();
        next.state = kind.via_state();
        next.last_error.clear();
        match begin {
            Begin::Create => next.ops = Default::default(),
            Begin::Configure {
                cluster,
                shard_metadata,
            } => {
                next.ops[TransitionKind::Drain.index()] = None;
                next.cluster = cluster;
                next.shard_metadata = shard_metadata;
            }
            Begin::Drain => {}
            Begin::Delete => {
                for earlier in [
                    TransitionKind::Create,
                    TransitionKind::Configure,
                    TransitionKind::Drain,
                ] {
                    next.ops[earlier.index()] = None;
                }
            }
        }
        next.ops[kind.index()] = Some(operation_id());
        next.in_flight = None;
        next.rev = rev;
        Ok(next)
    }

    /// A machine found on the substrate (IDLE, no Create on record) takes
    /// `operation_id` as its Create, so retries of that Create see one id.
    /// Nothing on the wire changes: the revision stays.
    pub fn adopt_create(&self, operation_id: String) -> Result<MachineRecord, TransitionError> {
        if self.state != State::Idle || self.op(TransitionKind::Create).is_some() {
            return Err(TransitionError::NotAdoptable {
                id: self.id.clone(),
                state: self.state,
            });
        }
        let mut next = self.clone();
        next.ops[TransitionKind::Create.index()] = Some(operation_id);
        Ok(next)
    }

    fn current(&self, kind: TransitionKind, operation_id: &str) -> Result<(), TransitionError> {
        if self.state == kind.via_state() && self.op(kind) == Some(operation_id) {
            return Ok(());
        }
        Err(TransitionError::Superseded {
            id: self.id.clone(),
            state: self.state,
            kind,
            operation_id: operation_id.to_string(),
        })
    }

    /// The transition `operation_id` succeeded: the machine reaches the
    /// transition's target with `rev`. A Create records the host it made
    /// (when the substrate named one); a Drain ends the binding; a Delete
    /// ends the binding and the host.
    pub fn land_success(
        &self,
        kind: TransitionKind,
        operation_id: &str,
        host: Option<pb::HostRef>,
        rev: u64,
    ) -> Result<MachineRecord, TransitionError> {
        self.current(kind, operation_id)?;
        let mut next = self.clone();
        next.state = kind.to_state();
        next.in_flight = None;
        match kind {
            TransitionKind::Create => {
                if host.is_some() {
                    next.host = host;
                }
            }
            TransitionKind::Configure => {}
            TransitionKind::Drain => {
                next.cluster.clear();
                next.shard_metadata.clear();
            }
            TransitionKind::Delete => {
                next.host = None;
                next.cluster.clear();
                next.shard_metadata.clear();
            }
        }
        next.rev = rev;
        Ok(next)
    }

    /// The transition `operation_id` failed with `message`: the machine is
    /// FAILED with `rev`, and `last_error` says why (never empty).
    pub fn land_failure(
        &self,
        kind: TransitionKind,
        operation_id: &str,
        message: String,
        rev: u64,
    ) -> Result<MachineRecord, TransitionError> {
        self.current(kind, operation_id)?;
        let mut next = self.clone();
        next.state = State::Failed;
        next.in_flight = None;
        next.last_error = if message.is_empty() {
            format!(
                "{} failed without a message from the substrate",
                kind.name()
            )
        } else {
            message
        };
        next.rev = rev;
        Ok(next)
    }

    /// A transition cut short by a provider restart: FAILED, saying so. The
    /// revision stays; the engine gives it a fresh one once every stored
    /// record is loaded (only then is the newest revision known).
    pub fn interrupted(&self) -> Result<MachineRecord, TransitionError> {
        self.ended_by_restart(format!(
            "interrupted by a provider restart while {}; the substrate may hold a partial result",
            self.state
        ))
    }

    /// A transition a restart found that cannot continue (its deadline
    /// passed meanwhile, or what it needs was never stored): FAILED with
    /// `last_error`. The revision stays, as for [`MachineRecord::interrupted`].
    pub fn ended_by_restart(&self, last_error: String) -> Result<MachineRecord, TransitionError> {
        if !self.state.is_transitional() {
            return Err(TransitionError::NotTransitional {
                id: self.id.clone(),
                state: self.state,
            });
        }
        let mut next = self.clone();
        next.state = State::Failed;
        next.in_flight = None;
        next.last_error = last_error;
        Ok(next)
    }

    /// A FAILED machine's host follows the substrate: `host` is the one
    /// marked for it, None when it no longer exists. Every other state's
    /// host is the engine's alone. The revision stays; the engine gives one
    /// fresh revision for everything a reconcile changed on the machine.
    pub fn rehosted(&self, host: Option<pb::HostRef>) -> Result<MachineRecord, TransitionError> {
        if self.state != State::Failed {
            return Err(TransitionError::NotFailed {
                id: self.id.clone(),
                state: self.state,
            });
        }
        let mut next = self.clone();
        next.host = host;
        Ok(next)
    }

    /// A FAILED machine whose hosts were destroyed: SPECULATIVE again with
    /// `rev`, no host, binding, error or operation id left.
    pub fn reclaimed(&self, rev: u64) -> Result<MachineRecord, TransitionError> {
        if self.state != State::Failed {
            return Err(TransitionError::NotFailed {
                id: self.id.clone(),
                state: self.state,
            });
        }
        let mut next = self.clone();
        next.state = State::Speculative;
        next.host = None;
        next.last_error.clear();
        next.cluster.clear();
        next.shard_metadata.clear();
        next.ops = Default::default();
        next.in_flight = None;
        next.rev = rev;
        Ok(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::CatalogFacts;

    const ID: &str = "proxmox/OnDemand/pve.small/pve1/007";

    fn host(r: &str) -> pb::HostRef {
        pb::HostRef {
            provider: "proxmox".into(),
            r#ref: r.into(),
        }
    }

    fn speculative() -> MachineRecord {
        let facts = CatalogFacts {
            instance_type: "pve.small".into(),
            zone: "pve1".into(),
            ..CatalogFacts::default()
        }
        .share();
        MachineRecord::new(ID.into(), facts, 1)
    }

    fn configure() -> Begin {
        Begin::Configure {
            cluster: "c-1".into(),
            shard_metadata: [("k".to_string(), "v".to_string())].into(),
        }
    }

    fn op(name: &str) -> impl FnOnce() -> String + '_ {
        move || name.to_string()
    }

    /// Through a whole cycle: Create, Configure, Drain, Delete.
    #[test]
    fn a_cycle_moves_through_every_state() {
        let r = speculative();
        let creating = r.begin(Begin::Create, op("op-c"), 2).expect("Create");
        assert_eq!((creating.state, creating.rev), (State::Creating, 2));
        assert_eq!(creating.op(TransitionKind::Create), Some("op-c"));
        let idle = creating
            .land_success(TransitionKind::Create, "op-c", Some(host("pve1/123")), 3)
            .expect("land Create");
        assert_eq!((idle.state, idle.rev), (State::Idle, 3));
        assert_eq!(idle.host, Some(host("pve1/123")));

        let configuring = idle.begin(configure(), op("op-f"), 4).expect("Configure");
        assert_eq!(configuring.state, State::Configuring);
        assert_eq!(configuring.cluster, "c-1");
        assert_eq!(
            configuring.shard_metadata.get("k").map(String::as_str),
            Some("v")
        );
        let configured = configuring
            .land_success(TransitionKind::Configure, "op-f", None, 5)
            .expect("land Configure");
        assert_eq!(configured.state, State::Configured);
        assert_eq!(configured.host, Some(host("pve1/123")), "the host stays");
        assert_eq!(configured.cluster, "c-1", "the binding stays");

        let draining = configured
            .begin(Begin::Drain, op("op-d"), 6)
            .expect("Drain");
        let idle = draining
            .land_success(TransitionKind::Drain, "op-d", None, 7)
            .expect("land Drain");
        assert_eq!(idle.state, State::Idle);
        assert!(idle.cluster.is_empty() && idle.shard_metadata.is_empty());
        assert_eq!(idle.host, Some(host("pve1/123")));
        // Create's and Configure's ids are still on record for retries.
        assert_eq!(idle.op(TransitionKind::Create), Some("op-c"));
        assert_eq!(idle.op(TransitionKind::Configure), Some("op-f"));

        let deleting = idle.begin(Begin::Delete, op("op-x"), 8).expect("Delete");
        assert_eq!(deleting.op(TransitionKind::Create), None);
        assert_eq!(deleting.op(TransitionKind::Configure), None);
        assert_eq!(deleting.op(TransitionKind::Drain), None);
        assert_eq!(deleting.op(TransitionKind::Delete), Some("op-x"));
        let gone = deleting
            .land_success(TransitionKind::Delete, "op-x", None, 9)
            .expect("land Delete");
        assert_eq!((gone.state, gone.rev), (State::Speculative, 9));
        assert_eq!(gone.host, None);
        // The input records are untouched: the functions are pure.
        assert_eq!(r, speculative());
        assert_eq!(configured.state, State::Configured);
    }

    #[test]
    fn a_transition_from_the_wrong_state_is_refused_without_an_id() {
        let r = speculative();
        for begin in [configure(), Begin::Drain, Begin::Delete] {
            let kind = begin.kind();
            let e = r
                .begin(begin, || panic!("no id for a refusal"), 2)
                .expect_err("refused");
            assert_eq!(
                e,
                TransitionError::OutOfPosition {
                    id: ID.into(),
                    state: State::Speculative,
                    kind,
                }
            );
            assert_eq!(
                e.to_string(),
                format!(
                    "machine {ID:?} is SPECULATIVE; {} needs {}",
                    kind.name(),
                    kind.from_state()
                )
            );
        }
        let creating = r.begin(Begin::Create, op("op-c"), 2).expect("Create");
        assert!(creating.begin(Begin::Create, op("op-2"), 3).is_err());
    }

    #[test]
    fn a_failed_machine_accepts_nothing_but_a_reclaim() {
        let creating = speculative()
            .begin(Begin::Create, op("op-c"), 2)
            .expect("Create");
        let failed = creating
            .land_failure(
                TransitionKind::Create,
                "op-c",
                "clone failed: no space".into(),
                3,
            )
            .expect("land failure");
        assert_eq!((failed.state, failed.rev), (State::Failed, 3));
        assert_eq!(failed.last_error, "clone failed: no space");
        for begin in [Begin::Create, configure(), Begin::Drain, Begin::Delete] {
            let kind = begin.kind();
            let e = failed.begin(begin, op("op"), 4).expect_err("refused");
            assert_eq!(
                e.to_string(),
                format!(
                    "machine {ID:?} is FAILED and needs intervention; {} is not accepted \
                     (last_error: clone failed: no space)",
                    kind.name()
                )
            );
        }
        let mut hosted = failed.clone();
        hosted.host = Some(host("pve1/123"));
        hosted.cluster = "c-1".into();
        let back = hosted.reclaimed(5).expect("reclaim");
        assert_eq!((back.state, back.rev), (State::Speculative, 5));
        assert!(back.host.is_none() && back.last_error.is_empty() && back.cluster.is_empty());
        assert_eq!(back.ops, <[Option<String>; 4]>::default());
        assert_eq!(
            speculative().reclaimed(2),
            Err(TransitionError::NotFailed {
                id: ID.into(),
                state: State::Speculative
            })
        );
    }

    #[test]
    fn only_a_failed_machine_follows_the_substrate_host() {
        let mut failed = speculative();
        failed.state = State::Failed;
        failed.host = Some(host("pve1/123"));
        failed.cluster = "c-1".into();
        let moved = failed.rehosted(Some(host("pve2/456"))).expect("rehost");
        assert_eq!(moved.host, Some(host("pve2/456")));
        assert_eq!((moved.state, moved.rev), (State::Failed, failed.rev));
        assert_eq!(moved.cluster, "c-1", "only the host follows");
        assert_eq!(failed.rehosted(None).expect("detach").host, None);
        let mut idle = speculative();
        idle.state = State::Idle;
        assert!(matches!(
            idle.rehosted(None),
            Err(TransitionError::NotFailed {
                state: State::Idle,
                ..
            })
        ));
    }

    #[test]
    fn an_empty_failure_still_says_what_failed() {
        let creating = speculative()
            .begin(Begin::Create, op("op-c"), 2)
            .expect("Create");
        let failed = creating
            .land_failure(TransitionKind::Create, "op-c", String::new(), 3)
            .expect("land failure");
        assert_eq!(
            failed.last_error,
            "Create failed without a message from the substrate"
        );
        // After a reclaim, a new Create starts clean.
        let fresh = failed.reclaimed(4).expect("reclaim");
        let again = fresh.begin(Begin::Create, op("op-2"), 5).expect("Create");
        assert!(again.last_error.is_empty());
    }

    #[test]
    fn a_late_completion_is_superseded() {
        let creating = speculative()
            .begin(Begin::Create, op("op-c"), 2)
            .expect("Create");
        // Another operation id, another kind, or a machine that moved on.
        let stale = creating.land_success(TransitionKind::Create, "op-old", None, 3);
        assert!(matches!(
            stale,
            Err(TransitionError::Superseded { ref operation_id, .. }) if operation_id == "op-old"
        ));
        assert!(creating
            .land_failure(TransitionKind::Delete, "op-c", "x".into(), 3)
            .is_err());
        let interrupted = creating.interrupted().expect("interrupt");
        assert!(interrupted
            .land_success(TransitionKind::Create, "op-c", None, 4)
            .is_err());
    }

    #[test]
    fn a_restart_fails_only_transitions() {
        let creating = speculative()
            .begin(Begin::Create, op("op-c"), 2)
            .expect("Create");
        let failed = creating.interrupted().expect("interrupt");
        assert_eq!(failed.state, State::Failed);
        assert_eq!(failed.rev, 2, "the engine bumps it after loading");
        assert_eq!(
            failed.last_error,
            "interrupted by a provider restart while CREATING; the substrate may hold a \
             partial result"
        );
        assert_eq!(failed.op(TransitionKind::Create), Some("op-c"));
        assert!(matches!(
            speculative().interrupted(),
            Err(TransitionError::NotTransitional {
                state: State::Speculative,
                ..
            })
        ));
    }

    #[test]
    fn an_adopted_machine_takes_a_create_id_once() {
        let mut idle = speculative();
        idle.state = State::Idle;
        let adopted = idle.adopt_create("op-a".into()).expect("adopt");
        assert_eq!(adopted.op(TransitionKind::Create), Some("op-a"));
        assert_eq!(adopted.rev, idle.rev);
        assert!(adopted.adopt_create("op-b".into()).is_err());
        assert!(speculative().adopt_create("op-a".into()).is_err());
    }
}
