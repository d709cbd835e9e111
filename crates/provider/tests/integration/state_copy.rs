//! `bigfleet-proxmox state copy` through the binary: SQLite to PostgreSQL
//! and back leaves every record (transition windows included), fence mark
//! and the boot generation as they were; a target that is not empty is
//! refused with nothing written; a bad URL or path says which and why; a
//! state a running provider holds is refused. The PostgreSQL cases need
//! the test server (provider-testkit's `postgres`); they skip without it
//! and fail under CI=true.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;

use bigfleet_proto::v1alpha1 as pb;
use providerkit::{
    CatalogFacts, Change, FenceMark, InFlight, Loaded, MachineRecord, State, StateDump, Store,
};
use sqlite_store::SqliteStore;

use crate::common::{path_str, Provider, BIN};

/// A machine with every field a store keeps, in `state`.
fn record(id: &str, rev: u64, state: State) -> MachineRecord {
    let mut labels = HashMap::new();
    labels.insert("zone".to_string(), "z1".to_string());
    let facts = CatalogFacts {
        instance_type: "pve.small".into(),
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
        r#ref: format!("pve-a/{}", 100 + rev),
    });
    r.ops = [Some(format!("op-3-{rev}")), None, None, None];
    r
}

fn window(started_ms: u64, grace_ms: u64) -> Option<InFlight> {
    Some(InFlight {
        started_ms,
        deadline_ms: started_ms + 480_000,
        grace_ms,
    })
}

fn mark(shard: &str, machine: &str, epoch: i64, sequence: i64) -> FenceMark {
    FenceMark {
        shard_id: shard.into(),
        machine_id: machine.into(),
        epoch,
        sequence,
    }
}

/// A state as a provider leaves it: machines at rest and mid-transition
/// (with their windows), fence marks, and three boots behind it.
fn write_state(path: &Path) {
    let mut creating = record("m-creating", 2, State::Creating);
    creating.in_flight = window(1_700_000_000_000, 0);
    let mut configuring = record("m-configuring", 3, State::Configuring);
    configuring.cluster = "c1".into();
    configuring.shard_metadata = HashMap::from([("k".to_string(), "v\u{e9} \0".to_string())]);
    configuring.ops[1] = Some("op-3-configure".into());
    configuring.in_flight = window(1_700_000_001_000, 0);
    let mut draining = record("m-draining", 4, State::Draining);
    draining.cluster = "c1".into();
    draining.ops[2] = Some("op-3-drain".into());
    draining.in_flight = window(1_700_000_002_000, 30_000);
    let mut failed = record("m-failed", 5, State::Failed);
    failed.last_error = "clone timed out on pve-a".into();
    let changes = vec![
        Change::Machine(Arc::new(record("m-idle", 1, State::Idle))),
        Change::Machine(Arc::new(creating)),
        Change::Machine(Arc::new(configuring)),
        Change::Machine(Arc::new(draining)),
        Change::Machine(Arc::new(failed)),
        Change::Fence(mark("shard-1", "m-idle", 2, 7)),
        Change::Fence(mark("shard-1", "m-draining", 2, 9)),
        Change::Fence(mark("shard\u{0}2", "m-failed", 1, 1)),
    ];
    let store = SqliteStore::open(path).expect("open the source");
    for _ in 0..3 {
        store.load().expect("load");
    }
    let ticket = store.submit(changes);
    futures::executor::block_on(store.durable(ticket)).expect("durable");
}

fn dump_sqlite(path: &Path) -> Loaded {
    SqliteStore::open(path).expect("open").dump().expect("dump")
}

/// Records by id and marks by key: stores hand them out in any order.
fn normalised(mut state: Loaded) -> Loaded {
    state.machines.sort_by(|a, b| a.id.cmp(&b.id));
    state
        .fences
        .sort_by(|a, b| (&a.shard_id, &a.machine_id).cmp(&(&b.shard_id, &b.machine_id)));
    state
}

fn copy(from: &str, to: &str, more: &[&str]) -> Output {
    Command::new(BIN)
        .args(["state", "copy", "--from", from, "--to", to])
        .args(more)
        .stdin(Stdio::null())
        .output()
        .expect("run state copy")
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_state_goes_from_sqlite_to_postgres_and_back_unchanged() {
    let Some(schema) = provider_testkit::postgres::fresh() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let original = dir.path().join("state.db");
    let back = dir.path().join("back.db");
    write_state(&original);

    let out = copy(path_str(&original), &schema.url, &[]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert_eq!(stdout.lines().count(), 1, "one summary line: {stdout}");
    assert!(
        stdout.starts_with("copied 5 machines and 3 fence marks from sqlite:"),
        "{stdout}"
    );
    assert!(
        stdout.contains("(boot generation 3); the copy was read back and matches"),
        "{stdout}"
    );
    assert_eq!(
        schema.query_i64("SELECT count(*) FROM bigfleet_machines WHERE started_ms IS NOT NULL"),
        3,
        "the windows are in the database's columns"
    );

    // A PostgreSQL source is read in a transaction that is rolled back:
    // its writer generation (which a writer's open moves) stays.
    let generation = "SELECT writer_generation FROM bigfleet_meta WHERE id = 1";
    let before = schema.query_i64(generation);
    let out = copy(&schema.url, path_str(&back), &[]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert_eq!(
        schema.query_i64(generation),
        before,
        "the source was written"
    );
    assert!(
        stdout.starts_with("copied 5 machines and 3 fence marks from postgres://"),
        "{stdout}"
    );

    let (before, after) = (
        normalised(dump_sqlite(&original)),
        normalised(dump_sqlite(&back)),
    );
    assert_eq!(after.machines, before.machines);
    assert_eq!(after.fences, before.fences);
    assert_eq!(after.boot_generation, before.boot_generation);
    // The next boot of the copy starts a generation none of the original's
    // boots used, so no operation id is handed out twice.
    let store = SqliteStore::open(&back).expect("open the copy");
    assert_eq!(store.load().expect("load").boot_generation, 4);
}

#[test]
fn a_postgres_target_that_is_not_empty_is_refused_with_nothing_written() {
    let Some(schema) = provider_testkit::postgres::fresh() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let source = dir.path().join("state.db");
    write_state(&source);
    assert!(copy(path_str(&source), &schema.url, &[]).status.success());
    // What the target holds, row by row (opening it as a writer advances
    // its writer generation, so that is no sign of a commit).
    const ROWS: &str =
        "SELECT (SELECT COALESCE(sum(hashtext(id || rev || round || encode(record, 'hex'))), 0)
                               FROM bigfleet_machines)
                          + (SELECT COALESCE(sum(hashtext(encode(shard_id || machine_id, 'hex')
                                                          || epoch || sequence || round)), 0)
                               FROM bigfleet_fences)
                          + (SELECT boot_generation FROM bigfleet_meta)";
    let rows = schema.query_i64(ROWS);

    let out = copy(path_str(&source), &schema.url, &[]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(
            "is not empty (it holds 5 machine records and 3 fence marks); nothing was written"
        ),
        "{stderr}"
    );
    assert_eq!(schema.query_i64(ROWS), rows, "nothing was committed");
}

#[test]
fn a_postgres_source_without_a_state_is_refused_and_left_without_tables() {
    let Some(schema) = provider_testkit::postgres::fresh() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let target = dir.path().join("copy.db");
    let out = copy(&schema.url, path_str(&target), &[]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("holds no state (the database has no state tables)"),
        "{stderr}"
    );
    // A wrong database name must not leave the state's tables behind.
    let tables = schema.query_i64(&format!(
        "SELECT count(*) FROM pg_tables WHERE schemaname = '{}'",
        schema.name
    ));
    assert_eq!(tables, 0, "reading the source created tables");
    assert!(
        !target.exists(),
        "the failed copy left {}",
        target.display()
    );
}

#[test]
fn a_sqlite_target_that_is_not_empty_is_refused_with_nothing_written() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (source, target) = (dir.path().join("a.db"), dir.path().join("b.db"));
    write_state(&source);
    {
        let store = SqliteStore::open(&target).expect("open the target");
        store.load().expect("load");
        let ticket = store.submit(vec![Change::Fence(mark("other", "m-9", 1, 1))]);
        futures::executor::block_on(store.durable(ticket)).expect("durable");
    }
    let before = dump_sqlite(&target);

    let out = copy(path_str(&source), path_str(&target), &[]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stdout.is_empty(), "{stdout}");
    assert!(
        stderr.starts_with(&format!(
            "error: the target sqlite:{} is not empty (it holds 0 machine records and 1 fence \
             marks); nothing was written: copy into an empty state",
            target.display()
        )),
        "{stderr}"
    );
    let after = dump_sqlite(&target);
    assert_eq!(after.fences, before.fences);
    assert!(after.machines.is_empty());
    assert_eq!(after.boot_generation, before.boot_generation);
}

/// Every file in `dir` with its bytes.
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .expect("read_dir")
        .map(|e| {
            let e = e.expect("entry");
            let bytes = std::fs::read(e.path()).expect("read");
            (e.file_name().to_string_lossy().into_owned(), bytes)
        })
        .collect()
}

#[test]
fn sqlite_to_sqlite_creates_the_target_and_copies_everything() {
    let (dir, elsewhere) = (
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
    );
    let (source, target) = (dir.path().join("a.db"), elsewhere.path().join("new.db"));
    write_state(&source);
    let untouched = files(dir.path());
    let out = copy(path_str(&source), path_str(&target), &[]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    // The source is read, never written: the same files, byte for byte,
    // and no lock file beside it.
    assert_eq!(
        files(dir.path()),
        untouched,
        "the source's directory changed"
    );
    assert_eq!(
        normalised(dump_sqlite(&target)).machines,
        normalised(dump_sqlite(&source)).machines
    );
}

#[test]
fn bad_urls_and_paths_say_which_and_why() {
    let dir = tempfile::tempdir().expect("tempdir");
    let source = dir.path().join("state.db");
    write_state(&source);

    // A password in the URL: the command line needs fixing (2), and the
    // password is never echoed.
    let out = copy(
        path_str(&source),
        "postgres://bf:hunter2@127.0.0.1:1/db?sslmode=disable",
        &[],
    );
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--to: the URL must not carry the password"),
        "{stderr}"
    );
    assert!(!stderr.contains("hunter2"), "{stderr}");

    // Nothing at the source path: nothing is created there either.
    let missing = dir.path().join("missing.db");
    let out = copy(path_str(&missing), path_str(&dir.path().join("x.db")), &[]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "the source sqlite:{} holds no state (no file is at that path)",
            missing.display()
        )),
        "{stderr}"
    );
    assert!(!missing.exists() && !dir.path().join("x.db").exists());

    // A target in a directory that does not exist.
    let nowhere = dir.path().join("no-such-dir").join("state.db");
    let out = copy(path_str(&source), path_str(&nowhere), &[]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "cannot open the target sqlite:{}",
            nowhere.display()
        )),
        "{stderr}"
    );
    assert!(stderr.contains("does not exist"), "{stderr}");

    // A database nobody listens for: named, without a password.
    let out = copy(
        path_str(&source),
        "postgres://bf@127.0.0.1:1/bigfleet?sslmode=disable",
        &[],
    );
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("cannot open the target postgres://bf@127.0.0.1:1/bigfleet"),
        "{stderr}"
    );
    assert!(!stderr.contains("--state"), "{stderr}");
}

#[test]
fn a_state_a_running_provider_holds_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (source, target) = (dir.path().join("state.db"), dir.path().join("copy.db"));
    write_state(&source);
    let provider = Provider::start(&["--use-fake-backend", "--state", path_str(&source)]);
    let out = copy(path_str(&source), path_str(&target), &[]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("is in use by another provider process"),
        "{stderr}"
    );
    assert!(!target.exists(), "nothing was created");
    drop(provider);
}
