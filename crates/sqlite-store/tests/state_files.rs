//! What `open` does with what it finds at the path: one writer enforced on
//! the database file itself (also across processes and after the `.lock`
//! file is deleted).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use providerkit::{Store, StoreErrorKind};
use sqlite_store::SqliteStore;

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

/// A child process that holds the state at `path`; returns once it has it.
fn holder(path: &Path) -> Child {
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "hold_state_in_child",
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
