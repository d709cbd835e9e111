//! What only the PostgreSQL store shows: a commit whose answer was lost is
//! resolved by reading, dropped connections are replaced without losing
//! an acknowledged change, a second writer is detected, and what it
//! refuses (a newer schema, an undecodable record, a server without TLS
//! under verify-full, an unreachable server).

use pg_store::{PgOptions, PgStore, Target, SCHEMA_VERSION};
use provider_testkit::store_contract::{machine, record, StateUnderTest};
use providerkit::{State, Store, StoreErrorKind};

use crate::common::{fresh, PgState};

/// The rounds this build's stores committed (the row of schema 3's
/// migration, writer 0, is not one).
const COMMITTED_ROUNDS: &str = "SELECT count(*) FROM bigfleet_commits WHERE writer <> 0";

/// Wait for `ticket` here (the store commits on a thread of its own).
fn durable(store: &PgStore, ticket: providerkit::Ticket) -> Result<(), providerkit::StoreError> {
    futures::executor::block_on(store.durable(ticket))
}

fn ids(store: &PgStore) -> Vec<String> {
    let loaded = store.load().expect("load");
    loaded.machines.into_iter().map(|m| m.id).collect()
}

#[test]
fn a_lost_commit_answer_is_resolved_by_reading_not_by_writing_again() {
    let Some(state) = fresh() else { return };
    let store = state.open();
    store.load().expect("load");
    store.lose_next_commit_answer_for_tests();
    let t = store.submit(vec![machine(record("m-1", 1, State::Idle))]);
    durable(&store, t).expect("the commit landed: its lost answer is no failure");
    assert_eq!(store.commits_resolved_by_reading(), 1);
    assert_eq!(store.commits(), 1);
    // One commit in the database: the batch was not written a second time.
    assert_eq!(state.schema.query_i64(COMMITTED_ROUNDS), 1);
    store.health().expect("healthy");
    let t = store.submit(vec![machine(record("m-2", 2, State::Idle))]);
    durable(&store, t).expect("the next commit follows on");
    assert_eq!(state.schema.query_i64(COMMITTED_ROUNDS), 2);
    drop(store);
    assert_eq!(ids(&state.open()), ["m-1", "m-2"]);
}

#[test]
fn dropped_connections_are_replaced_and_nothing_acknowledged_is_lost() {
    let Some(state) = fresh() else { return };
    let store = state.open();
    store.load().expect("load");
    let t = store.submit(vec![machine(record("m-1", 1, State::Idle))]);
    durable(&store, t).expect("durable");
    // Every pooled connection dies (a database restart, a proxy).
    state.schema.terminate_connections();
    let t = store.submit(vec![machine(record("m-2", 2, State::Idle))]);
    durable(&store, t).expect("the writer reconnects and commits");
    store.health().expect("healthy");
    state.schema.terminate_connections();
    assert_eq!(ids(&store), ["m-1", "m-2"], "a load reconnects too");
    assert_eq!(state.schema.query_i64(COMMITTED_ROUNDS), 2);
}

#[test]
fn a_second_writer_is_detected_and_nothing_is_overwritten() {
    let Some(state) = fresh() else { return };
    let store = state.open();
    store.load().expect("load");
    // Another process committed behind this one's back.
    state
        .schema
        .admin("UPDATE bigfleet_meta SET writer_generation = writer_generation + 5");
    let t = store.submit(vec![machine(record("m-1", 1, State::Idle))]);
    let err = durable(&store, t).expect_err("must not write");
    assert_eq!(err.kind(), StoreErrorKind::Locked);
    let err = err.to_string();
    assert!(
        err.contains("another process is writing this state"),
        "{err}"
    );
    assert!(store.health().is_err());
    assert_eq!(
        state
            .schema
            .query_i64("SELECT count(*) FROM bigfleet_machines"),
        0
    );
}

#[test]
fn the_schema_is_created_once_and_a_newer_one_is_refused() {
    let Some(state) = fresh() else { return };
    let first = state.open();
    assert!(first.report().created);
    drop(first);
    let again = state.open();
    assert!(!again.report().created, "an existing schema is kept");
    drop(again);
    assert_eq!(
        state
            .schema
            .query_i64("SELECT schema_version FROM bigfleet_meta"),
        SCHEMA_VERSION
    );
    state
        .schema
        .admin("UPDATE bigfleet_meta SET schema_version = 9");
    let err = state.try_open().err().expect("a newer schema must fail");
    assert_eq!(err.kind(), StoreErrorKind::Incompatible);
    assert!(
        err.to_string().contains(&format!(
            "was written by a newer version (schema 9, this build knows up to {SCHEMA_VERSION})"
        )),
        "{err}"
    );
}

#[test]
fn an_undecodable_record_is_reported_on_load() {
    let Some(state) = fresh() else { return };
    drop(state.open());
    state
        .schema
        .admin("INSERT INTO bigfleet_machines (id, rev, record) VALUES ('m-1', 1, '\\xffffffff')");
    let err = state.open().load().expect_err("must fail");
    assert_eq!(err.kind(), StoreErrorKind::Corrupt);
    let err = err.to_string();
    assert!(err.contains("is not a valid state"), "{err}");
    assert!(err.contains("\"m-1\""), "{err}");
}

/// The test server's URL with TLS verified, or `None` (skipping, or
/// failing under CI) when the server was started without TLS.
fn verify_full_url(state: &PgState) -> Option<String> {
    if state.schema.ca_file.is_none() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "under CI=true the test server must speak TLS (scripts/pg-throwaway.sh with openssl)"
        );
        provider_testkit::skip::report(
            &provider_testkit::skip::current_test(),
            "the test server has no TLS (start it with scripts/pg-throwaway.sh)",
        );
        return None;
    }
    let url = state
        .schema
        .url
        .replace("sslmode=disable", "sslmode=verify-full");
    assert!(url.contains("sslmode=verify-full"), "{url}");
    Some(url)
}

#[test]
fn verify_full_with_the_servers_ca_commits_over_tls() {
    let Some(state) = fresh() else { return };
    let Some(url) = verify_full_url(&state) else {
        return;
    };
    let target = Target::parse(&url).expect("parse");
    let store = PgStore::open(&target, &PgOptions::default()).expect("open over TLS");
    store.load().expect("load");
    let t = store.submit(vec![machine(record("m-1", 1, State::Idle))]);
    durable(&store, t).expect("durable over TLS");
    let tls_connections = state.schema.query_i64(&format!(
        "SELECT count(*) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid)
         WHERE ssl AND application_name = '{}'",
        state.schema.name
    ));
    assert!(tls_connections >= 1, "the store's connections are TLS");
}

#[test]
fn verify_full_refuses_a_server_whose_chain_it_cannot_verify() {
    let Some(state) = fresh() else { return };
    let Some(url) = verify_full_url(&state) else {
        return;
    };
    // Without sslrootcert the public web roots are the trust anchors: the
    // throwaway CA is not one of them, so the handshake must fail.
    let (base, query) = url.split_once('?').expect("a query");
    let query: Vec<&str> = query
        .split('&')
        .filter(|p| !p.starts_with("sslrootcert="))
        .collect();
    let target = Target::parse(&format!("{base}?{}", query.join("&"))).expect("parse");
    let err = PgStore::open(&target, &PgOptions::default())
        .err()
        .expect("an unverifiable server must be refused");
    assert_eq!(err.kind(), StoreErrorKind::Unavailable);
    let err = err.to_string();
    assert!(err.contains(target.display()), "{err}");
    assert!(err.to_lowercase().contains("certificate"), "{err}");
}

#[test]
fn an_unreachable_server_is_named() {
    let Some(_state) = fresh() else { return };
    // Port 1 on loopback: nothing listens, the connection is refused.
    let target = Target::parse("postgres://bigfleet@127.0.0.1:1/db?sslmode=disable").unwrap();
    let err = PgStore::open(&target, &PgOptions::default())
        .err()
        .expect("must fail");
    assert_eq!(err.kind(), StoreErrorKind::Unavailable);
    let err = err.to_string();
    assert!(
        err.starts_with("PostgreSQL state postgres://bigfleet@127.0.0.1:1/db: cannot connect"),
        "{err}"
    );
}

#[test]
fn a_schema_2_state_is_migrated_with_its_rows_and_its_commit_count() {
    let Some(state) = fresh() else { return };
    let store = state.open();
    store.load().expect("load");
    let t = store.submit(vec![machine(record("m-1", 1, State::Idle))]);
    durable(&store, t).expect("durable");
    drop(store);
    // The same rows as a build of schema 2 left them, 7 commits in.
    state.schema.admin(
        "DROP TABLE bigfleet_commits;
         ALTER TABLE bigfleet_machines DROP COLUMN round;
         ALTER TABLE bigfleet_fences DROP COLUMN round;
         ALTER TABLE bigfleet_meta RENAME COLUMN writer_generation TO commit_seq;
         UPDATE bigfleet_meta SET commit_seq = 7, schema_version = 2",
    );
    let store = state.open();
    assert_eq!(ids(&store), ["m-1"]);
    assert_eq!(
        state
            .schema
            .query_i64("SELECT schema_version FROM bigfleet_meta"),
        SCHEMA_VERSION
    );
    assert_eq!(
        state
            .schema
            .query_i64("SELECT round FROM bigfleet_commits WHERE writer = 0"),
        7,
        "the old count carries over"
    );
    let t = store.submit(vec![machine(record("m-1", 2, State::Idle))]);
    durable(&store, t).expect("the migrated state takes commits");
    assert_eq!(
        state
            .schema
            .query_i64("SELECT max(round) FROM bigfleet_commits"),
        8,
        "new rounds number on from the old count"
    );
    drop(store);
    let loaded = state.open().load().expect("load");
    assert_eq!(
        loaded.machines[0].rev, 2,
        "the migrated row takes new versions"
    );
}
