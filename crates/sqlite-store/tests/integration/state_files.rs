//! What `open` does with what it finds at the path: one writer enforced on
//! the database file itself (also across processes and after the `.lock`
//! file is deleted), and empty, schema-less or foreign files refused
//! instead of being taken for a fresh state.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use providerkit::{Change, FenceMark, Store, StoreErrorKind};
use sqlite_store::{OpenReport, Origin, SqliteStore};

/// Set (to a state path) in the child process `hold_state_in_child` runs as.
const HOLD_ENV: &str = "SQLITE_STORE_TEST_HOLD";
const HOLDING: &str = "holding the state";

/// Not a test of its own: the body of the child process the cross-process
/// tests start. Without the variable it does nothing.
#[test]
fn hold_state_in_child() {
    let Some(path) = std::env::var_os(HOLD_ENV) else {
        return;
    };
    let store = SqliteStore::open(Path::new(&path)).expect("child: open the state");
    store.load().expect("child: load");
    println!("{HOLDING}");
    // Hold the state until the parent kills us (or closes stdin).
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    drop(store);
}

/// `hold_state_in_child` as the test harness names it: its module path
/// in this test binary (without the crate's name), then the function.
fn holder_test() -> String {
    match module_path!().split_once("::") {
        Some((_crate, module)) => format!("{module}::hold_state_in_child"),
        None => "hold_state_in_child".to_string(),
    }
}

/// A child process that holds the state at `path`; returns once it has it.
fn holder(path: &Path) -> Child {
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            holder_test().as_str(),
            "--nocapture",
            "--test-threads=1",
        ])
        .env(HOLD_ENV, path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the holder");
    let stdout = child.stdout.take().expect("stdout");
    // Blocks until the child says it holds the state, or its output ends
    // (it died): no timing assumption either way.
    let holding = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .any(|line| line.contains(HOLDING));
    if !holding {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the holder process exited without taking the state");
    }
    child
}

fn mark(shard: &str, machine: &str) -> Change {
    Change::Fence(FenceMark {
        shard_id: shard.into(),
        machine_id: machine.into(),
        epoch: 1,
        sequence: 1,
    })
}

#[test]
fn another_process_is_refused_until_killed_even_without_the_lock_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    let mut child = holder(&path);
    let child_pid = format!("pid {}", child.id());

    let err = SqliteStore::open(&path).err().expect("refused while held");
    assert_eq!(err.kind(), StoreErrorKind::Locked, "{err}");
    let text = err.to_string();
    assert!(
        text.contains("in use by another provider process"),
        "{text}"
    );
    assert!(text.contains(&child_pid), "names the holder: {text}");

    // The sidecar is not what keeps a second writer out.
    let sidecar = dir.path().join("state.db.lock");
    std::fs::remove_file(&sidecar).expect("the holder's .lock file exists");
    let err = SqliteStore::open(&path)
        .err()
        .expect("still refused with the .lock file deleted");
    assert_eq!(err.kind(), StoreErrorKind::Locked, "{err}");
    let text = err.to_string();
    assert!(
        text.contains(&child_pid),
        "the pid comes from the kernel's lock table: {text}"
    );

    // kill -9: the kernel drops the lock with the process.
    child.kill().expect("SIGKILL the holder");
    child.wait().expect("reap the holder");
    let store = SqliteStore::open(&path).expect("free after the holder died");
    assert_eq!(store.report().origin, Origin::Loaded);
    store.load().expect("the state is intact");
}

#[test]
fn in_process_second_open_is_refused_after_the_lock_file_is_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    let first = SqliteStore::open(&path).unwrap();
    std::fs::remove_file(dir.path().join("state.db.lock")).unwrap();
    let err = SqliteStore::open(&path).err().expect("refused");
    assert_eq!(err.kind(), StoreErrorKind::Locked, "{err}");
    assert!(
        err.to_string()
            .contains(&format!("pid {}", std::process::id())),
        "{err}"
    );
    drop(first);
    SqliteStore::open(&path).expect("released on drop");
}

#[test]
fn empty_file_is_refused_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    std::fs::write(&path, b"").unwrap();
    let err = SqliteStore::open(&path).err().expect("empty must fail");
    assert_eq!(err.kind(), StoreErrorKind::Corrupt);
    let text = err.to_string();
    assert_eq!(
        text,
        format!(
            "state file {} is empty (0 bytes): it is not a state database; move it away (or \
             restore a backup) or point --state at a new path",
            path.display()
        )
    );
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 0, "not written");
    assert_only(dir.path(), &["state.db"]);
}

/// The directory holds exactly `names`: a refused open leaves nothing
/// beside the file it refused (no `.lock`, no WAL files).
fn assert_only(dir: &Path, names: &[&str]) {
    let mut found: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    found.sort();
    assert_eq!(found, names, "a refused open left files behind");
}

#[test]
fn schema_less_sqlite_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    let conn = rusqlite::Connection::open(&path).unwrap();
    // Writes the database header and nothing else.
    conn.execute_batch("PRAGMA user_version = 7").unwrap();
    drop(conn);
    let before = std::fs::read(&path).unwrap();
    assert!(!before.is_empty());
    let err = SqliteStore::open(&path)
        .err()
        .expect("schema-less must fail");
    assert!(
        std::fs::read(&path).unwrap() == before,
        "a refused file is left exactly as found (not even switched to WAL)"
    );
    assert_eq!(err.kind(), StoreErrorKind::Corrupt);
    let text = err.to_string();
    assert!(text.contains("is not a valid state database"), "{text}");
    assert!(text.contains("without the state schema"), "{text}");
    assert!(text.contains("point --state at a new path"), "{text}");
    assert_only(dir.path(), &["state.db"]);
}

#[test]
fn foreign_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    std::fs::write(&path, "machines:\n  - m-1\n").unwrap();
    let err = SqliteStore::open(&path).err().expect("foreign must fail");
    assert_eq!(err.kind(), StoreErrorKind::Corrupt);
    let text = err.to_string();
    assert!(text.contains("not an SQLite database"), "{text}");
    assert!(text.contains(&path.display().to_string()), "{text}");
    assert_only(dir.path(), &["state.db"]);
}

#[tokio::test]
async fn missing_file_is_created_and_reopened_with_its_counts() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    {
        let store = SqliteStore::open(&path).unwrap();
        assert_eq!(
            store.report(),
            &OpenReport {
                origin: Origin::Created,
                machines: 0,
                fence_marks: 0
            }
        );
        store.load().unwrap();
        let t = store.submit(vec![
            mark("s1", "m-1"),
            mark("s1", "m-2"),
            mark("s2", "m-1"),
        ]);
        store.durable(t).await.unwrap();
    }
    // Only the state, its WAL files and the pid file: no creation leftovers.
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert!(
        names.iter().all(
            |n| ["state.db", "state.db-wal", "state.db-shm", "state.db.lock"].contains(&n.as_str())
        ),
        "{names:?}"
    );
    let store = Arc::new(SqliteStore::open(&path).unwrap());
    assert_eq!(
        store.report(),
        &OpenReport {
            origin: Origin::Loaded,
            machines: 0,
            fence_marks: 3
        }
    );
}

#[test]
fn a_leftover_from_an_interrupted_creation_is_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    // What a kill -9 during creation leaves: a temporary, never the state.
    std::fs::write(dir.path().join("state.db.creating-1"), b"").unwrap();
    let store = SqliteStore::open(&path).unwrap();
    assert_eq!(store.report().origin, Origin::Created);
}
