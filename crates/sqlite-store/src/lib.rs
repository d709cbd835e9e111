//! Durable providerkit state in one SQLite file.
//!
//! The database runs in WAL mode with `synchronous=FULL`, so a committed
//! transaction survives a kill -9 or power loss. [`Store::submit`] only
//! appends to an in-memory queue; one dedicated writer thread drains
//! everything queued into a single transaction and publishes the highest
//! committed ticket, so one fsync acknowledges many concurrent mutations
//! (group commit). Checkpoints (copying the WAL into the database file) run
//! on a second connection in a background thread, so commits never wait
//! for them.
//!
//! The file is owned by one process at a time: an exclusive `flock` on the
//! database file itself (see `lock`). A missing file is created complete
//! (schema included) under a temporary name and linked into place; an
//! existing file that is empty, not SQLite, or SQLite without this schema is
//! refused instead of being taken for a fresh state. The reference
//! implementation's JSON state is imported once (see `import`).
//!
//! Modules: `schema` (what is on disk), `lock` (one writer), `writer`
//! (group commit and checkpoints), `decode` (loading), `import` (the
//! reference implementation's state), `dump` (the whole state out and into
//! an empty one, for `state copy`), `error` (messages).

mod decode;
mod dump;
mod error;
mod import;
mod lock;
mod schema;
mod source;
mod writer;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

use futures::future::BoxFuture;
use parking_lot::Mutex;
use providerkit::{Change, CommitWaiter, Loaded, Store, StoreError, Ticket};
use rusqlite::{Connection, TransactionBehavior};
use tokio::sync::watch;

use crate::error::sql_error;
use crate::lock::StateLock;
use crate::writer::{checkpoint_loop, shutdown, writer_loop, Shared};

pub use import::Imported;
pub use schema::SCHEMA_VERSION;
pub use source::ReadOnlySource;

/// How [`SqliteStore::open`] found the state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// Nothing was at the path: a new, empty state was created.
    Created,
    /// An existing state was opened.
    Loaded,
    /// The reference implementation's JSON state was found at the path,
    /// imported, and replaced by a new database there.
    Imported(Imported),
}

/// What [`SqliteStore::open`] found, for the start-up log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenReport {
    pub origin: Origin,
    /// Machine records in the state when it was opened.
    pub machines: u64,
    /// Fence marks in the state when it was opened.
    pub fence_marks: u64,
}

/// A [`Store`] backed by one SQLite database file.
pub struct SqliteStore {
    path: PathBuf,
    report: OpenReport,
    shared: Arc<Shared>,
    waiter: CommitWaiter,
    writer: Option<JoinHandle<()>>,
    checkpointer: Option<JoinHandle<()>>,
    // Field order matters: the connection closes before the lock is released.
    conn: Arc<Mutex<Connection>>,
    _lock: StateLock,
}

impl SqliteStore {
    /// Open the state database at `path` (creating it if nothing is there),
    /// take the exclusive lock and migrate the schema to [`SCHEMA_VERSION`].
    pub fn open(path: &Path) -> Result<SqliteStore, StoreError> {
        let path = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        let created = schema::create_if_missing(&path)?;
        let mut lock = lock::acquire(&path)?;
        let imported = match schema::inspect(&path, lock.file())? {
            schema::Content::Sqlite => None,
            schema::Content::ReferenceJson => Some(import::import(&path, &mut lock)?),
        };
        let mut conn = Connection::open_with_flags(&path, schema::OPEN_FLAGS)
            .map_err(|e| sql_error(&path, "cannot open", e))?;
        let version = schema::existing_version(&path, &conn)?;
        schema::configure(&path, &conn)?;
        schema::migrate(&path, &mut conn, version)?;
        let (machines, fence_marks) = schema::counts(&path, &conn)?;
        // Checkpoints run on their own connection so commits never wait
        // for the database file to be written and synced.
        let checkpoint_conn = Connection::open_with_flags(&path, schema::OPEN_FLAGS)
            .map_err(|e| sql_error(&path, "cannot open", e))?;
        schema::configure(&path, &checkpoint_conn)?;

        let conn = Arc::new(Mutex::new(conn));
        let shared = Arc::new(Shared::new(path.clone()));
        let (done_tx, done) = watch::channel(0);
        let writer = {
            let shared = Arc::clone(&shared);
            let conn = Arc::clone(&conn);
            std::thread::Builder::new()
                .name("sqlite-store-writer".into())
                .spawn(move || writer_loop(&shared, &conn, &done_tx))
                .map_err(|e| {
                    StoreError::unavailable(format!(
                        "state file {}: cannot start the writer thread: {e}",
                        path.display()
                    ))
                    .with_source(e)
                })?
        };
        let checkpointer = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("sqlite-store-checkpoint".into())
                .spawn(move || checkpoint_loop(&shared, checkpoint_conn))
                .map_err(|e| {
                    StoreError::unavailable(format!(
                        "state file {}: cannot start the checkpoint thread: {e}",
                        path.display()
                    ))
                    .with_source(e)
                })
        };
        let checkpointer = match checkpointer {
            Ok(handle) => handle,
            Err(e) => {
                shutdown(&shared, Some(writer), None);
                return Err(e);
            }
        };
        // Past every refusal: the lock file this open created stays.
        lock.keep();
        let origin = match imported {
            Some(imported) => Origin::Imported(imported),
            None if created => Origin::Created,
            None => Origin::Loaded,
        };
        Ok(SqliteStore {
            path,
            report: OpenReport {
                origin,
                machines,
                fence_marks,
            },
            waiter: CommitWaiter::new(
                format!("state file {}", shared.path.display()),
                done,
                Arc::clone(&shared.failures),
            ),
            shared,
            writer: Some(writer),
            checkpointer: Some(checkpointer),
            conn,
            _lock: lock,
        })
    }

    /// Whether the state was created or loaded, and what it held.
    pub fn report(&self) -> &OpenReport {
        &self.report
    }

    /// The database file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Transactions committed so far (each is one fsync); submissions per
    /// commit shows how well group commit is batching.
    pub fn commits(&self) -> u64 {
        self.shared.commits.load(Ordering::Relaxed)
    }

    /// Test hook: cap the database size in pages (0 lifts the cap back to
    /// SQLite's maximum) so tests can provoke a failing commit.
    #[doc(hidden)]
    pub fn set_max_page_count_for_tests(&self, pages: u64) -> Result<u64, StoreError> {
        let pages = if pages == 0 {
            u32::MAX as u64 - 1
        } else {
            pages
        };
        self.conn
            .lock()
            .query_row(&format!("PRAGMA max_page_count = {pages}"), [], |r| {
                r.get(0)
            })
            .map_err(|e| sql_error(&self.path, "cannot set max_page_count", e))
    }

    /// Test hook: pages the database occupies now.
    #[doc(hidden)]
    pub fn page_count_for_tests(&self) -> Result<u64, StoreError> {
        self.conn
            .lock()
            .query_row("PRAGMA page_count", [], |r| r.get(0))
            .map_err(|e| sql_error(&self.path, "cannot read page_count", e))
    }
}

impl Drop for SqliteStore {
    fn drop(&mut self) {
        shutdown(&self.shared, self.writer.take(), self.checkpointer.take());
    }
}

impl Store for SqliteStore {
    fn load(&self) -> Result<Loaded, StoreError> {
        let path = &self.path;
        let mut conn = self.conn.lock();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| sql_error(path, "cannot start the load transaction", e))?;
        tx.execute("UPDATE meta SET boot_generation = boot_generation + 1", [])
            .map_err(|e| sql_error(path, "cannot start a new boot generation", e))?;
        let loaded = decode::load_state(path, &tx)?;
        tx.commit()
            .map_err(|e| sql_error(path, "cannot commit the new boot generation", e))?;
        Ok(loaded)
    }

    fn submit(&self, changes: Vec<Change>) -> Ticket {
        let (ticket, queued) = self.shared.queue.lock().push(changes);
        if queued {
            self.shared.wake.notify_one();
        }
        ticket
    }

    fn durable(&self, ticket: Ticket) -> BoxFuture<'static, Result<(), StoreError>> {
        self.waiter.durable(ticket)
    }

    fn describe(&self) -> String {
        format!("sqlite:{}", self.path.display())
    }

    fn health(&self) -> Result<(), StoreError> {
        self.waiter.health()
    }
}
