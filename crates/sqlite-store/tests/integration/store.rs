//! What only the SQLite store shows: its files and their modes, the lock,
//! what it refuses at the path, and a full disk. The rest of the store's
//! behaviour is the shared contract (`contract`).

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use provider_testkit::store_contract::{machine, record};
use providerkit::{State, Store, StoreErrorKind};
use sqlite_store::{SqliteStore, SCHEMA_VERSION};

#[tokio::test]
#[allow(unsafe_code)] // libc call; see the SAFETY note inside
async fn files_are_private() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    // SAFETY: umask is process-wide but only widens what this test checks.
    // SAFETY: umask(2) only swaps the process file-mode mask.
    let old = unsafe { libc::umask(0o000) };
    let store = SqliteStore::open(&path);
    // SAFETY: as above, restoring the previous mask.
    unsafe { libc::umask(old) };
    let store = store.unwrap();
    store.load().unwrap();
    let ticket = store.submit(vec![machine(record("m-1", 1, State::Idle))]);
    store.durable(ticket).await.unwrap();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&path), 0o600);
    let wal = dir.path().join("state.db-wal");
    assert!(wal.exists(), "WAL mode keeps a -wal file while open");
    assert_eq!(mode(&wal), 0o600);
    let shm = dir.path().join("state.db-shm");
    assert!(shm.exists(), "WAL mode keeps a -shm index while open");
    assert_eq!(mode(&shm), 0o600);
    assert_eq!(mode(&dir.path().join("state.db.lock")), 0o600);
    drop(store);

    // An existing file with loose permissions is tightened on open.
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let _store = SqliteStore::open(&path).unwrap();
    assert_eq!(mode(&path), 0o600);
}

#[test]
fn second_open_while_alive_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    let first = SqliteStore::open(&path).unwrap();
    let err = SqliteStore::open(&path)
        .err()
        .expect("second open must fail");
    assert_eq!(err.kind(), StoreErrorKind::Locked);
    let err = err.to_string();
    assert!(
        err.contains("is in use by another provider process")
            && err.contains(&format!("pid {}", std::process::id()))
            && err.contains(&path.display().to_string()),
        "{err}"
    );
    drop(first);
    SqliteStore::open(&path).expect("the lock is released on drop");
}

#[test]
fn corrupt_file_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    std::fs::write(&path, "this is not a database\n".repeat(500)).unwrap();
    let err = SqliteStore::open(&path).err().expect("garbage must fail");
    assert_eq!(err.kind(), StoreErrorKind::Corrupt);
    let err = err.to_string();
    eprintln!("{err}");
    assert!(err.contains("not an SQLite database"), "{err}");
    assert!(err.contains("point --state at a new path"), "{err}");
    assert!(
        err.contains(&format!(
            "state file {} is not a valid state database",
            path.display()
        )),
        "{err}"
    );
}

#[test]
fn foreign_database_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.execute_batch("CREATE TABLE users (name TEXT)")
        .unwrap();
    drop(conn);
    let err = SqliteStore::open(&path)
        .err()
        .expect("foreign db must fail");
    assert_eq!(err.kind(), StoreErrorKind::Corrupt);
    let err = err.to_string();
    assert!(err.contains("is not a valid state database"), "{err}");
    assert!(err.contains("users"), "{err}");
}

#[test]
fn undecodable_record_is_reported_on_load() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    drop(SqliteStore::open(&path).unwrap());
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.execute(
        "INSERT INTO machines (id, rev, record) VALUES ('m-1', 1, x'ffffffff')",
        [],
    )
    .unwrap();
    drop(conn);
    let err = SqliteStore::open(&path).unwrap().load().err().unwrap();
    assert_eq!(err.kind(), StoreErrorKind::Corrupt);
    let err = err.to_string();
    assert!(err.contains("is not a valid state database"), "{err}");
    assert!(err.contains("\"m-1\""), "{err}");
}

#[test]
fn newer_schema_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    drop(SqliteStore::open(&path).unwrap());
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.execute("UPDATE meta SET schema_version = 9", [])
        .unwrap();
    drop(conn);
    let err = SqliteStore::open(&path)
        .err()
        .expect("newer schema must fail");
    assert_eq!(err.kind(), StoreErrorKind::Incompatible);
    let err = err.to_string();
    assert_eq!(
        err,
        format!(
            "state file {} was written by a newer version (schema 9, this build knows up to {SCHEMA_VERSION})",
            path.display()
        )
    );
}

#[test]
fn missing_directory_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nope").join("state.db");
    let err = SqliteStore::open(&path).err().unwrap();
    assert_eq!(err.kind(), StoreErrorKind::Inaccessible);
    assert!(
        std::error::Error::source(&err).is_some(),
        "the I/O error is kept as the source"
    );
    let err = err.to_string();
    assert!(err.contains(&path.display().to_string()), "{err}");
    assert!(err.contains("does not exist"), "{err}");
    assert!(!path.exists() && !dir.path().join("nope").exists());
}

#[test]
fn unwritable_directory_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let locked = dir.path().join("ro");
    std::fs::create_dir(&locked).unwrap();
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o500)).unwrap();
    // root ignores directory modes; fall back to a kernel-owned directory.
    let target = if std::fs::write(locked.join("probe"), b"").is_err() {
        locked.join("state.db")
    } else if std::fs::write("/sys/probe", b"").is_err() {
        Path::new("/sys/state.db").to_path_buf()
    } else {
        provider_testkit::skip::report(
            &provider_testkit::skip::current_test(),
            "no unwritable directory available to this user",
        );
        return;
    };
    let err = SqliteStore::open(&target).err().expect("must fail");
    assert_eq!(err.kind(), StoreErrorKind::Inaccessible);
    let err = err.to_string();
    eprintln!("{err}");
    assert!(err.contains(&target.display().to_string()), "{err}");
    assert!(
        err.contains("permission denied") || err.contains("read-only"),
        "{err}"
    );
}

#[tokio::test]
async fn failed_commit_reports_and_later_commit_heals() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    let store = SqliteStore::open(&path).unwrap();
    store.load().unwrap();
    let t = store.submit(vec![machine(record("m-0", 1, State::Idle))]);
    store.durable(t).await.unwrap();

    let pages = store.page_count_for_tests().unwrap();
    store.set_max_page_count_for_tests(pages).unwrap();
    let mut big = record("m-big", 2, State::Idle);
    big.shard_metadata
        .insert("blob".into(), "x".repeat(256 * 1024));
    let t = store.submit(vec![machine(big.clone())]);
    let err = store
        .durable(t)
        .await
        .expect_err("a full database must fail");
    assert_eq!(err.kind(), StoreErrorKind::Unavailable);
    let err = err.to_string();
    eprintln!("{err}");
    assert!(err.contains(&path.display().to_string()), "{err}");
    assert!(err.contains("no space"), "{err}");
    // Readiness follows this: unhealthy while the change waits for a commit.
    let health = store
        .health()
        .expect_err("a failing commit makes the store unhealthy");
    assert_eq!(health.kind(), StoreErrorKind::Unavailable);
    let commits = store.commits();

    // The disk "recovers": the next batch commits and carries the failed one.
    store.set_max_page_count_for_tests(0).unwrap();
    let t2 = store.submit(vec![machine(record("m-1", 3, State::Idle))]);
    store.durable(t2).await.unwrap();
    assert_eq!(store.commits(), commits + 1);
    store
        .durable(t)
        .await
        .expect("the carried change is durable now");
    store
        .health()
        .expect("healthy again once the carried change committed");
    drop(store);

    let loaded = SqliteStore::open(&path).unwrap().load().unwrap();
    let ids: Vec<&str> = loaded.machines.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, ["m-0", "m-big", "m-1"]);
    assert_eq!(loaded.machines[1], big);
}

/// A database that is full (as on a full disk) refuses a mutation
/// UNAVAILABLE and costs no machine: the retry lands once there is room,
/// and the state holds the landing, not a FAILED machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_database_costs_no_machine() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    let store = std::sync::Arc::new(SqliteStore::open(&path).unwrap());
    let (fail, heal) = (store.clone(), store.clone());
    let engine =
        provider_testkit::store_contract::a_mutation_the_store_cannot_commit_costs_no_machine(
            store.clone(),
            move || {
                let pages = fail.page_count_for_tests().expect("page count");
                fail.set_max_page_count_for_tests(pages).expect("cap");
            },
            move || {
                heal.set_max_page_count_for_tests(0).expect("uncap");
            },
        )
        .await;
    // Everything submitted is durable: what a restart would load.
    engine.read_barrier().await.expect("the store commits");
    let loaded = providerkit::StateDump::dump(&*store).expect("dump");
    let m1 = loaded
        .machines
        .iter()
        .find(|m| m.id == "m-1")
        .expect("m-1 is in the state");
    assert_eq!(m1.state(), State::Configured, "{m1:?}");
    assert!(m1.last_error.is_empty(), "{m1:?}");
}
