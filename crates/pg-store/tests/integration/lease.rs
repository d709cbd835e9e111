//! The leader lease: one holder at a time under a growing epoch, taken
//! back at once by the replica that holds it, renewed only by its holder,
//! released for a standby; and a store opened under an epoch commits
//! nothing once another replica holds the lease.

use std::time::Duration;

use pg_store::{Lease, LeaseState, OwnName, PgOptions, PgStore};
use provider_testkit::store_contract::{machine, record};
use provider_testkit::wait::Wait;
use providerkit::{State, Store, StoreErrorKind};

use crate::common::{fresh, PgState};

fn durable(store: &PgStore, ticket: providerkit::Ticket) -> Result<(), providerkit::StoreError> {
    futures::executor::block_on(store.durable(ticket))
}

const TTL: Duration = Duration::from_secs(30);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn lease(rt: &tokio::runtime::Runtime, state: &PgState) -> Lease {
    rt.block_on(Lease::connect(&state.target(), &PgOptions::default()))
        .expect("connect the lease")
}

fn epoch(found: LeaseState) -> i64 {
    match found {
        LeaseState::Acquired { epoch, .. } => epoch,
        LeaseState::Held { .. } => panic!("not acquired: {found:?}"),
    }
}

/// Replica "a" holding the lease, and its store opened and loaded under
/// the lease's epoch.
fn leader(rt: &tokio::runtime::Runtime, state: &PgState) -> (Lease, i64, PgStore) {
    let a = lease(rt, state);
    let mine = epoch(
        rt.block_on(a.try_acquire("a", TTL, OwnName::TakeBack))
            .expect("a"),
    );
    let options = PgOptions {
        lease_epoch: Some(mine),
        ..PgOptions::default()
    };
    let store = PgStore::open(&state.target(), &options).expect("open");
    store.load().expect("load under the lease");
    (a, mine, store)
}

#[test]
fn one_holder_at_a_time_until_it_expires_or_is_released() {
    let Some(state) = fresh() else { return };
    let rt = runtime();
    let a = lease(&rt, &state);
    let b = lease(&rt, &state);
    let first = epoch(
        rt.block_on(a.try_acquire("a", TTL, OwnName::TakeBack))
            .expect("a"),
    );
    match rt
        .block_on(b.try_acquire("b", TTL, OwnName::TakeBack))
        .expect("b")
    {
        LeaseState::Held {
            holder,
            epoch,
            expires_in,
        } => {
            assert_eq!((holder.as_str(), epoch), ("a", first));
            assert!(expires_in > Duration::from_secs(20), "{expires_in:?}");
        }
        other => panic!("b took a held lease: {other:?}"),
    }
    // Restarted in place under its name, a takes its lease back at once.
    let again = epoch(
        rt.block_on(a.try_acquire("a", TTL, OwnName::TakeBack))
            .expect("a again"),
    );
    assert_eq!(again, first + 1);
    assert!(
        rt.block_on(a.renew(first, TTL)).expect("renew").is_none(),
        "an old epoch renews nothing"
    );
    assert!(rt.block_on(a.renew(again, TTL)).expect("renew").is_some());
    // Released, it is b's at b's next attempt.
    rt.block_on(a.release(again)).expect("release");
    let taken = epoch(
        rt.block_on(b.try_acquire("b", TTL, OwnName::TakeBack))
            .expect("b"),
    );
    assert_eq!(taken, again + 1);
    assert!(rt.block_on(a.renew(again, TTL)).expect("renew").is_none());
    // A release under a lost epoch leaves the holder's lease alone.
    rt.block_on(a.release(again)).expect("release");
    assert!(matches!(
        rt.block_on(a.try_acquire("a", TTL, OwnName::TakeBack))
            .expect("a"),
        LeaseState::Held { .. }
    ));
    // Expired (here: set in the past), anyone takes it.
    state
        .schema
        .admin("UPDATE bigfleet_lease SET expires_at = now() - interval '1 second'");
    assert_eq!(
        epoch(
            rt.block_on(a.try_acquire("a", TTL, OwnName::TakeBack))
                .expect("a")
        ),
        taken + 1
    );
}

#[test]
fn a_replica_that_waits_for_expiry_leaves_a_running_lease_of_its_name_alone() {
    let Some(state) = fresh() else { return };
    let rt = runtime();
    let first = lease(&rt, &state);
    let second = lease(&rt, &state);
    let held = epoch(
        rt.block_on(first.try_acquire("a", TTL, OwnName::TakeBack))
            .expect("a"),
    );
    match rt
        .block_on(second.try_acquire("a", TTL, OwnName::WaitForExpiry))
        .expect("second a")
    {
        LeaseState::Held { holder, epoch, .. } => assert_eq!((holder.as_str(), epoch), ("a", held)),
        other => panic!("took a running lease under its name: {other:?}"),
    }
    match rt.block_on(first.current()).expect("read") {
        LeaseState::Held { holder, epoch, .. } => assert_eq!((holder.as_str(), epoch), ("a", held)),
        other => panic!("current() answers Held: {other:?}"),
    }
    // Expired, it is anyone's, this replica's too.
    state
        .schema
        .admin("UPDATE bigfleet_lease SET expires_at = now() - interval '1 second'");
    let taken = epoch(
        rt.block_on(second.try_acquire("a", TTL, OwnName::WaitForExpiry))
            .expect("after expiry"),
    );
    assert_eq!(taken, held + 1);
}

#[test]
fn a_store_under_a_lost_lease_commits_nothing() {
    let Some(state) = fresh() else { return };
    let rt = runtime();
    let (_a, mine, store) = leader(&rt, &state);
    let t = store.submit(vec![machine(record("m-1", 1, State::Idle))]);
    durable(&store, t).expect("the holder commits");

    // Another replica takes the lease.
    let b = lease(&rt, &state);
    state
        .schema
        .admin("UPDATE bigfleet_lease SET expires_at = now() - interval '1 second'");
    let theirs = epoch(
        rt.block_on(b.try_acquire("b", TTL, OwnName::TakeBack))
            .expect("b"),
    );
    let t = store.submit(vec![machine(record("m-2", 2, State::Idle))]);
    let err = durable(&store, t).expect_err("a deposed leader must not write");
    assert_eq!(err.kind(), StoreErrorKind::Locked);
    assert!(
        err.to_string().contains(&format!(
            "this replica no longer holds the leader lease (it held epoch {mine}, the lease is \
             at epoch {theirs})"
        )),
        "{err}"
    );
    assert_eq!(
        state
            .schema
            .query_i64("SELECT count(*) FROM bigfleet_machines"),
        1,
        "only the holder's commit is there"
    );
    let err = store.load().expect_err("nor start a boot generation");
    assert_eq!(err.kind(), StoreErrorKind::Locked);
}

/// The class of the lease lock's key (`lease_lock_key!` in the crate) and
/// its object, the lease table's OID.
const LEASE_LOCK_CLASS: u32 = 1_650_879_589;
const LEASE_LOCK_OBJECT: &str = "'bigfleet_lease'::regclass";
const SHARE_LEASE_LOCK: &str =
    "SELECT pg_advisory_xact_lock_shared(1650879589, 'bigfleet_lease'::regclass::oid::int4)";

/// Wait until a session waits for the lease lock (a condition in the
/// server, not a guess at how long that takes).
fn await_lease_lock_waiter(state: &PgState) {
    Wait::new(
        "a session waiting for the lease lock",
        Duration::from_secs(20),
    )
    .every(Duration::from_millis(5))
    .until_blocking(|| {
        state
            .schema
            .advisory_lock_waiters(LEASE_LOCK_CLASS, LEASE_LOCK_OBJECT)
            > 0
    });
}

#[test]
fn taking_the_lease_waits_for_the_commits_in_flight() {
    let Some(state) = fresh() else { return };
    // A worker of its own drives the take while this thread watches the
    // server.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let b = lease(&rt, &state);
    let before = state.schema.query_i64("SELECT epoch FROM bigfleet_lease");
    // A commit of the old leader in flight holds the lock in shared mode.
    let in_flight = state.schema.hold(SHARE_LEASE_LOCK);
    let take = rt.spawn(async move { b.try_acquire("b", TTL, OwnName::TakeBack).await });
    await_lease_lock_waiter(&state);
    assert_eq!(
        state.schema.query_i64("SELECT epoch FROM bigfleet_lease"),
        before,
        "the epoch moved under a commit in flight"
    );
    in_flight.commit();
    let taken = epoch(rt.block_on(take).expect("join").expect("b"));
    assert_eq!(taken, before + 1);
}

#[test]
fn a_commit_during_a_take_waits_for_it_and_writes_nothing() {
    let Some(state) = fresh() else { return };
    let rt = runtime();
    let (_a, _, store) = leader(&rt, &state);
    // Another replica is taking the lease: it holds the lock and has
    // moved the epoch, not yet committed.
    let take = state.schema.hold(
        "SELECT pg_advisory_xact_lock(1650879589, 'bigfleet_lease'::regclass::oid::int4);
         UPDATE bigfleet_lease SET epoch = epoch + 1, holder = 'b'",
    );
    let t = store.submit(vec![machine(record("m-1", 1, State::Idle))]);
    await_lease_lock_waiter(&state);
    take.commit();
    let err = durable(&store, t).expect_err("a commit behind a take must not land");
    assert_eq!(err.kind(), StoreErrorKind::Locked, "{err}");
    assert_eq!(
        state
            .schema
            .query_i64("SELECT count(*) FROM bigfleet_machines"),
        0,
        "the deposed leader's rows are not there"
    );
}

#[test]
fn a_renewal_is_not_held_back_by_commits_in_flight() {
    let Some(state) = fresh() else { return };
    let rt = runtime();
    let a = lease(&rt, &state);
    let mine = epoch(
        rt.block_on(a.try_acquire("a", TTL, OwnName::TakeBack))
            .expect("a"),
    );
    let in_flight = state.schema.hold(SHARE_LEASE_LOCK);
    // Under a row lock this renewal would wait for the commit.
    let renewed = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(20), a.renew(mine, TTL)).await })
        .expect("the renewal waited for a commit in flight")
        .expect("renew");
    assert!(renewed.is_some());
    in_flight.commit();
}

/// A replica of a newer release raised the schema under a leader: the
/// leader's next renewal says so (Incompatible), so it stops leading
/// instead of committing rows the newer schema would misread.
#[test]
fn a_renewal_finds_a_schema_a_newer_release_raised() {
    let Some(state) = fresh() else { return };
    let rt = runtime();
    let (a, mine, _store) = leader(&rt, &state);
    assert!(rt.block_on(a.renew(mine, TTL)).expect("renew").is_some());
    state.schema.admin(&format!(
        "UPDATE bigfleet_meta SET schema_version = {}",
        pg_store::SCHEMA_VERSION + 1
    ));
    let e = rt
        .block_on(a.renew(mine, TTL))
        .expect_err("a newer schema ends the term");
    assert_eq!(e.kind(), StoreErrorKind::Incompatible, "{e}");
    assert!(e.to_string().contains("written by a newer release"), "{e}");
}
