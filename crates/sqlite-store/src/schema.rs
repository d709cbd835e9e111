//! What is on disk: creating a new state atomically, recognising an
//! existing one (and refusing what is not one), connection settings and
//! schema migrations.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use providerkit::StoreError;
use rusqlite::{Connection, OpenFlags, TransactionBehavior};

use crate::error::{invalid, io_error, parent_dir, sql_error, NOT_A_STATE_FIX};

/// The schema this build writes. Older files are migrated forward on open.
pub const SCHEMA_VERSION: i64 = 2;

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
    // 1 -> 2: each transition's window (start, deadline, a Drain's grace),
    // in wall-clock milliseconds, so a restart resumes it. NULL outside a
    // transition, and on rows written before: those are not resumed.
    "ALTER TABLE machines ADD COLUMN started_ms INTEGER;
     ALTER TABLE machines ADD COLUMN deadline_ms INTEGER;
     ALTER TABLE machines ADD COLUMN grace_ms INTEGER;",
];

/// The first 16 bytes of every SQLite database file.
const SQLITE_HEADER: &[u8; 16] = b"SQLite format 3\0";

pub(crate) const OPEN_FLAGS: OpenFlags =
    OpenFlags::SQLITE_OPEN_READ_WRITE.union(OpenFlags::SQLITE_OPEN_NO_MUTEX);

pub(crate) fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = OsString::from(path.as_os_str());
    name.push(suffix);
    PathBuf::from(name)
}

/// Make the directory entries in `path`'s directory durable.
pub(crate) fn sync_dir(path: &Path) -> Result<(), StoreError> {
    File::open(parent_dir(path))
        .and_then(|dir| dir.sync_all())
        .map_err(|e| io_error(path, "cannot sync its directory", e))
}

/// Create a new, empty state database at `path` if nothing is there, and
/// say whether this call created it.
///
/// The database is built under a temporary name and linked into place
/// complete, so `path` never holds a half-made state: a crash during
/// creation leaves nothing at `path`, and an empty file found there later
/// is never one of ours (and is refused rather than mistaken for a fresh
/// state).
pub(crate) fn create_if_missing(path: &Path) -> Result<bool, StoreError> {
    match std::fs::metadata(path) {
        Ok(_) => return Ok(false),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_error(path, "cannot inspect", e)),
    }
    let temp = sibling(path, &format!(".creating-{}", std::process::id()));
    let result = build_new(path, &temp).and_then(|()| publish(path, &temp));
    // Best effort: after a successful link the name is just a second link.
    let _ = std::fs::remove_file(&temp);
    let created = result?;
    sync_dir(path)?;
    Ok(created)
}

/// Write a complete schema-only database at `temp` and sync it.
pub(crate) fn build_new(path: &Path, temp: &Path) -> Result<(), StoreError> {
    // A leftover of an earlier process with our pid is never in use.
    let _ = std::fs::remove_file(temp);
    // Created by us with mode 0600, independent of the umask; SQLite gives
    // its `-wal` and `-shm` files the same mode later.
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(temp)
        .map_err(|e| io_error(path, "cannot create", e))?;
    let mut conn = Connection::open_with_flags(temp, OPEN_FLAGS)
        .map_err(|e| sql_error(path, "cannot create", e))?;
    // A rollback journal (the default) keeps everything in the one file
    // that is linked into place; WAL is switched on at the first open.
    conn.execute_batch("PRAGMA synchronous = FULL;")
        .map_err(|e| sql_error(path, "cannot configure the new database", e))?;
    migrate(path, &mut conn, 0)?;
    conn.close()
        .map_err(|(_, e)| sql_error(path, "cannot close the new database", e))?;
    File::open(temp)
        .and_then(|f| f.sync_all())
        .map_err(|e| io_error(path, "cannot sync the new database", e))
}

/// Move the complete database at `temp` to `path` unless something
/// appeared there meanwhile (another process won the race: use its file).
fn publish(path: &Path, temp: &Path) -> Result<bool, StoreError> {
    match std::fs::hard_link(temp, path) {
        Ok(()) => return Ok(true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(false),
        // Filesystems without hard links: a rename that also refuses to
        // replace an existing file.
        Err(_) => {}
    }
    match rustix::fs::renameat_with(
        rustix::fs::CWD,
        temp,
        rustix::fs::CWD,
        path,
        rustix::fs::RenameFlags::NOREPLACE,
    ) {
        Ok(()) => Ok(true),
        Err(e) if e == rustix::io::Errno::EXIST => Ok(false),
        Err(e) => Err(io_error(
            path,
            &format!("cannot move the new database {} into place", temp.display()),
            e.into(),
        )),
    }
}

/// What an existing file at the state path holds.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Content {
    Sqlite,
    /// The reference implementation's JSON state, to be imported.
    ReferenceJson,
}

/// Refuse, before SQLite touches it, a file that cannot be a state
/// database: empty, or neither SQLite nor the reference implementation's
/// JSON state.
pub(crate) fn inspect(path: &Path, file: &File) -> Result<Content, StoreError> {
    let len = file
        .metadata()
        .map_err(|e| io_error(path, "cannot inspect", e))?
        .len();
    if len == 0 {
        // A database whose every page is still in the WAL would be empty
        // here; SQLite recovers it from the log.
        let wal = std::fs::metadata(sibling(path, "-wal")).map_or(0, |m| m.len());
        if wal > 0 {
            return Ok(Content::Sqlite);
        }
        return Err(StoreError::corrupt(format!(
            "state file {} is empty (0 bytes): it is not a state database; {NOT_A_STATE_FIX}",
            path.display()
        )));
    }
    let mut head = [0u8; 16];
    let read = read_prefix(file, &mut head).map_err(|e| io_error(path, "cannot read", e))?;
    if &head[..read] == SQLITE_HEADER {
        return Ok(Content::Sqlite);
    }
    if looks_like_json(&head[..read]) {
        return Ok(Content::ReferenceJson);
    }
    Err(invalid(
        path,
        "it is not an SQLite database (it lacks the SQLite file header)",
    ))
}

/// Whether the start of a file looks like a JSON object (the reference
/// implementation's state) rather than anything else. Recognising what is
/// on disk is this module's job; `import` only runs once it has said so.
fn looks_like_json(head: &[u8]) -> bool {
    head.iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|b| *b == b'{')
}

/// Fill as much of `buf` as the file has, from offset 0.
fn read_prefix(file: &File, buf: &mut [u8]) -> io::Result<usize> {
    let mut read = 0;
    while read < buf.len() {
        match file.read_at(&mut buf[read..], read as u64) {
            Ok(0) => break,
            Ok(n) => read += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(read)
}

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

/// The schema version of an existing state, read without writing: a file
/// that is refused must be left exactly as it was found (so this runs
/// before WAL is switched on). Refuses databases that are not ours and
/// files from a newer build.
pub(crate) fn existing_version(path: &Path, conn: &Connection) -> Result<i64, StoreError> {
    let tables: Vec<String> = {
        let mut stmt = conn
            .prepare("SELECT name FROM sqlite_master WHERE type = 'table'")
            .map_err(|e| sql_error(path, "cannot read the schema", e))?;
        stmt.query_map([], |r| r.get(0))
            .and_then(|rows| rows.collect::<Result<Vec<String>, _>>())
            .map_err(|e| sql_error(path, "cannot read the schema", e))?
    };
    if tables.is_empty() {
        return Err(invalid(
            path,
            "it is an SQLite database without the state schema (it has no tables)",
        ));
    }
    if !tables.iter().any(|t| t == "meta") {
        return Err(invalid(
            path,
            format!("it holds unrelated tables ({})", tables.join(", ")),
        ));
    }
    let version: i64 = conn
        .query_row("SELECT schema_version FROM meta WHERE id = 1", [], |r| {
            r.get(0)
        })
        .map_err(|e| {
            invalid(path, format!("cannot read the schema version: {e}")).with_source(e)
        })?;
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
    Ok(version)
}

/// Bring the schema from `version` to [`SCHEMA_VERSION`] in one
/// transaction (under the state lock, so nothing changed it since it was
/// read).
pub(crate) fn migrate(path: &Path, conn: &mut Connection, version: i64) -> Result<(), StoreError> {
    if version >= SCHEMA_VERSION {
        return Ok(());
    }
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(|e| sql_error(path, "cannot lock the database", e))?;
    for (from, sql) in MIGRATIONS.iter().enumerate().skip(version as usize) {
        let to = from as i64 + 1;
        tx.execute_batch(sql)
            .and_then(|()| tx.execute("UPDATE meta SET schema_version = ?1", [to]))
            .map_err(|e| sql_error(path, &format!("cannot migrate schema {from} to {to}"), e))?;
    }
    tx.commit()
        .map_err(|e| sql_error(path, "cannot commit the schema", e))
}

/// Machines and fence marks the state holds (for the start-up log).
pub(crate) fn counts(path: &Path, conn: &Connection) -> Result<(u64, u64), StoreError> {
    let count = |table: &str| -> Result<u64, StoreError> {
        conn.query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))
            .map_err(|e| sql_error(path, &format!("cannot count {table}"), e))
    };
    Ok((count("machines")?, count("fences")?))
}
