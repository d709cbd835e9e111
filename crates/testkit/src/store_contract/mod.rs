//! The `Store` contract: one suite every durable store runs (the SQLite
//! and the PostgreSQL store), so both keep the same promises. Each case is
//! a function taking a fresh [`StateUnderTest`]; [`store_contract_tests!`]
//! turns every case into a `#[test]` of the calling crate.
//!
//! What a store proves here: records and fence marks round-trip, group
//! commit batches, boot generations grow, a big state loads quickly, a
//! whole state dumps and restores exactly (`store`); the engine on it survives a restart (`engine`); and every
//! transition a restart interrupted resumes or fails saying why
//! (`resume`). What only one store can show (its files, its locks, its
//! failure modes) stays in that store's own tests.
//!
//! [`store_contract_tests!`]: crate::store_contract_tests

mod engine;
mod resume;
mod store;

use std::collections::HashMap;
use std::sync::Arc;

use bigfleet_proto::v1alpha1 as pb;
use providerkit::{CatalogFacts, Change, FenceMark, MachineRecord, State, StateDump};

pub use engine::{
    a_mutation_the_store_cannot_commit_costs_no_machine, engine_state_survives_restart,
};
pub use resume::{
    a_configure_without_a_readiness_check_cannot_resume_and_says_why,
    a_record_stored_without_a_window_is_failed_as_before,
    a_restart_after_the_deadline_fails_the_transition_as_timed_out,
    a_resumed_configure_whose_node_never_gets_ready_says_the_outcome_is_unknown,
    every_interrupted_transition_resumes_under_its_operation_id,
    shutdown_refuses_mutations_and_waits_for_transitions_to_land,
};
pub use store::{
    a_whole_state_restores_and_dumps_back_exactly,
    boot_generation_increases_across_opens_and_loads, group_commit_batches_concurrent_submits,
    load_of_many_machines_is_fast, round_trip_survives_reopen,
};

/// One fresh, empty state of the store under test, which a case may open
/// several times in turn (each open is a new process's store; the previous
/// one is dropped first).
pub trait StateUnderTest: Send + Sync + 'static {
    /// A `Store` whose whole state can be dumped and restored (every
    /// durable store's, for `state copy`).
    type Store: StateDump;

    /// Open the state; panics (naming why) when it cannot.
    fn open(&self) -> Self::Store;

    /// Transactions `store` committed so far.
    fn commits(store: &Self::Store) -> u64;

    /// What `describe()` of an open store starts with (`sqlite:`, ...).
    fn describe_prefix(&self) -> String;

    /// Set every stored transition's deadline to its start, behind the
    /// store's back: the restart came after the deadline.
    fn expire_windows(&self);

    /// Clear every stored transition window, as a state written before
    /// windows were stored has them.
    fn forget_windows(&self);

    /// Set machine `id`'s stored transition deadline (wall-clock
    /// milliseconds), behind the store's back.
    fn set_deadline_ms(&self, id: &str, deadline_ms: u64);
}

/// Every case as a `#[test]`: `store_contract_tests!(EXPR)` where `EXPR`
/// evaluates (once per test) to an `Option` of a fresh
/// [`StateUnderTest`]; `None` skips the case (the caller said why).
#[macro_export]
macro_rules! store_contract_tests {
    ($fresh:expr) => {
        $crate::store_contract_tests!(@each $fresh;
            round_trip_survives_reopen,
            group_commit_batches_concurrent_submits,
            boot_generation_increases_across_opens_and_loads,
            load_of_many_machines_is_fast,
            a_whole_state_restores_and_dumps_back_exactly,
            engine_state_survives_restart,
            every_interrupted_transition_resumes_under_its_operation_id,
            a_restart_after_the_deadline_fails_the_transition_as_timed_out,
            a_configure_without_a_readiness_check_cannot_resume_and_says_why,
            a_record_stored_without_a_window_is_failed_as_before,
            shutdown_refuses_mutations_and_waits_for_transitions_to_land,
            a_resumed_configure_whose_node_never_gets_ready_says_the_outcome_is_unknown
        );
    };
    (@each $fresh:expr; $($case:ident),*) => {
        $(
            #[test]
            fn $case() {
                if let Some(state) = $fresh {
                    $crate::store_contract::$case(state);
                }
            }
        )*
    };
}

/// A record with every field set, metadata with bytes a store must keep
/// verbatim (a NUL, non-ASCII), and operation ids in two slots.
pub fn record(id: &str, rev: u64, state: State) -> MachineRecord {
    let mut labels = HashMap::new();
    labels.insert("zone".to_string(), "z1".to_string());
    let mut metadata = HashMap::new();
    metadata.insert("k".to_string(), "v\u{e9}rbatim \0 bytes".to_string());
    let facts = CatalogFacts {
        instance_type: "small".into(),
        zone: "z1".into(),
        price_per_hour: 0.25,
        labels,
        ..Default::default()
    }
    .share();
    let mut r = MachineRecord::new(id.to_string(), facts, rev);
    r.state = state;
    r.host = Some(pb::HostRef {
        provider: "proxmox".into(),
        r#ref: format!("pve1/{rev}"),
    });
    r.cluster = "c1".into();
    r.shard_metadata = metadata;
    r.ops = [Some(format!("op-1-{rev}")), None, Some("op-x".into()), None];
    r
}

/// A fence mark.
pub fn mark(shard: &str, machine: &str, epoch: i64, sequence: i64) -> FenceMark {
    FenceMark {
        shard_id: shard.into(),
        machine_id: machine.into(),
        epoch,
        sequence,
    }
}

/// A record as a change.
pub fn machine(r: MachineRecord) -> Change {
    Change::Machine(Arc::new(r))
}

/// Fence marks in key order (stores load them in any order).
pub fn sorted_fences(mut f: Vec<FenceMark>) -> Vec<FenceMark> {
    f.sort_by(|a, b| (&a.shard_id, &a.machine_id).cmp(&(&b.shard_id, &b.machine_id)));
    f
}

/// A runtime like the provider's, for cases that run "processes" in turn.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("cannot build a runtime: {e}"))
}
