//! What is on disk: creating the file, connection settings and schema
//! migrations.

use std::path::Path;
use std::time::Duration;

use providerkit::StoreError;
use rusqlite::{Connection, OpenFlags, TransactionBehavior};

use crate::error::{invalid, sql_error};

/// The schema this build writes. Older files are migrated forward on open.
pub const SCHEMA_VERSION: i64 = 1;

/// `MIGRATIONS[n]` takes a database from schema `n` to `n + 1`.
const MIGRATIONS: &[&str] = &[
    // 0 -> 1: the initial schema.
    "CREATE TABLE meta (
         id INTEGER PRIMARY KEY CHECK (id = 1),
         schema_version INTEGER NOT NULL,
         boot_generation INTEGER NOT NULL
     );
     INSERT INTO meta (id, schema_version, boot_generation) VALUES (1, 0, 0);
     CREATE TABLE machines (
         id TEXT PRIMARY KEY NOT NULL,
         rev INTEGER NOT NULL,
         record BLOB NOT NULL,
         op_create TEXT,
         op_configure TEXT,
         op_drain TEXT,
         op_delete TEXT
     ) WITHOUT ROWID;
     CREATE TABLE fences (
         shard_id TEXT NOT NULL,
         machine_id TEXT NOT NULL,
         epoch INTEGER NOT NULL,
         sequence INTEGER NOT NULL,
         PRIMARY KEY (shard_id, machine_id)
     ) WITHOUT ROWID;",
];

pub(crate) const OPEN_FLAGS: OpenFlags =
    OpenFlags::SQLITE_OPEN_READ_WRITE.union(OpenFlags::SQLITE_OPEN_NO_MUTEX);

pub(crate) fn configure(path: &Path, conn: &Connection) -> Result<(), StoreError> {
    // Exclusion between processes is the flock on the database file (see
    // `lock`); SQLite's own locks stay shared so the checkpoint connection
    // can work alongside the writer.
    conn.busy_timeout(Duration::from_secs(5))
        .map_err(|e| sql_error(path, "cannot set the busy timeout", e))?;
    let mode: String = conn
        .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
        .map_err(|e| sql_error(path, "cannot enable WAL", e))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::inaccessible(format!(
            "state file {}: cannot enable WAL (journal mode stays {mode:?}); put the state on \
             a local filesystem",
            path.display()
        )));
    }
    // In WAL mode FULL syncs the log on every commit: a commit is durable.
    // Checkpoints are the checkpointer's job, not the commit path's.
    conn.execute_batch(
        "PRAGMA synchronous = FULL; PRAGMA wal_autocheckpoint = 0; \
         PRAGMA journal_size_limit = 67108864;",
    )
    .map_err(|e| sql_error(path, "cannot configure the database", e))?;
    Ok(())
}

/// Bring the schema to [`SCHEMA_VERSION`] in one transaction; refuse files
/// from a newer build and databases that are not ours.
pub(crate) fn migrate(path: &Path, conn: &mut Connection) -> Result<(), StoreError> {
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(|e| sql_error(path, "cannot lock the database", e))?;
    let tables: Vec<String> = {
        let mut stmt = tx
            .prepare("SELECT name FROM sqlite_master WHERE type = 'table'")
            .map_err(|e| sql_error(path, "cannot read the schema", e))?;
        stmt.query_map([], |r| r.get(0))
            .and_then(|rows| rows.collect::<Result<Vec<String>, _>>())
            .map_err(|e| sql_error(path, "cannot read the schema", e))?
    };
    let version: i64 = if tables.is_empty() {
        0
    } else if tables.iter().any(|t| t == "meta") {
        tx.query_row("SELECT schema_version FROM meta WHERE id = 1", [], |r| {
            r.get(0)
        })
        .map_err(|e| invalid(path, format!("cannot read the schema version: {e}")))?
    } else {
        return Err(invalid(
            path,
            format!("it holds unrelated tables ({})", tables.join(", ")),
        ));
    };
    if version > SCHEMA_VERSION {
        return Err(StoreError::incompatible(format!(
            "state file {} was written by a newer version (schema {version}, this build knows \
             up to {SCHEMA_VERSION})",
            path.display()
        )));
    }
    if version < 0 {
        return Err(invalid(
            path,
            format!("schema version {version} is negative"),
        ));
    }
    for (from, sql) in MIGRATIONS.iter().enumerate().skip(version as usize) {
        let to = from as i64 + 1;
        tx.execute_batch(sql)
            .and_then(|()| tx.execute("UPDATE meta SET schema_version = ?1", [to]))
            .map_err(|e| sql_error(path, &format!("cannot migrate schema {from} to {to}"), e))?;
    }
    tx.commit()
        .map_err(|e| sql_error(path, "cannot commit the schema", e))
}
