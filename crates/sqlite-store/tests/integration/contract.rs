//! The shared `Store` contract (provider-testkit's `store_contract`) on
//! SQLite: each case gets a fresh file in a temporary directory.

use std::path::PathBuf;

use provider_testkit::store_contract::StateUnderTest;
use sqlite_store::SqliteStore;

struct SqliteState {
    // Kept for the test's lifetime: dropping it removes the directory.
    _dir: tempfile::TempDir,
    path: PathBuf,
}

fn fresh() -> Option<SqliteState> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("state.db");
    Some(SqliteState { _dir: dir, path })
}

impl SqliteState {
    /// Change the state behind the store's back (no store is open then).
    fn execute(&self, sql: &str) {
        let conn = rusqlite::Connection::open(&self.path).expect("open the state file");
        conn.execute(sql, []).expect(sql);
    }
}

impl StateUnderTest for SqliteState {
    type Store = SqliteStore;

    fn open(&self) -> SqliteStore {
        SqliteStore::open(&self.path)
            .unwrap_or_else(|e| panic!("cannot open {}: {e}", self.path.display()))
    }

    fn commits(store: &SqliteStore) -> u64 {
        store.commits()
    }

    fn describe_prefix(&self) -> String {
        format!("sqlite:{}", self.path.display())
    }

    fn expire_windows(&self) {
        self.execute("UPDATE machines SET deadline_ms = started_ms WHERE started_ms IS NOT NULL");
    }

    fn forget_windows(&self) {
        self.execute("UPDATE machines SET started_ms = NULL, deadline_ms = NULL, grace_ms = NULL");
    }

    fn set_deadline_ms(&self, id: &str, deadline_ms: u64) {
        let conn = rusqlite::Connection::open(&self.path).expect("open the state file");
        conn.execute(
            "UPDATE machines SET deadline_ms = ?1 WHERE id = ?2",
            rusqlite::params![deadline_ms as i64, id],
        )
        .expect("set the deadline");
    }
}

provider_testkit::store_contract_tests!(fresh());
