//! The write path: one thread drains every queued change into a single
//! transaction (group commit), a second copies the WAL into the database
//! in the background, and failed commits are carried until one succeeds.

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use providerkit::{Change, ChangeBatch, ChangeQueue, FailedCommits, StoreErrorKind, Ticket};
use rusqlite::Connection;
use tokio::sync::watch;

use crate::error::sql_error;

const UPSERT_MACHINE: &str = "INSERT INTO machines
     (id, rev, record, op_create, op_configure, op_drain, op_delete,
      started_ms, deadline_ms, grace_ms)
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)
     ON CONFLICT (id) DO UPDATE SET rev = excluded.rev, record = excluded.record,
         op_create = excluded.op_create, op_configure = excluded.op_configure,
         op_drain = excluded.op_drain, op_delete = excluded.op_delete,
         started_ms = excluded.started_ms, deadline_ms = excluded.deadline_ms,
         grace_ms = excluded.grace_ms";

const UPSERT_FENCE: &str = "INSERT INTO fences (shard_id, machine_id, epoch, sequence)
     VALUES (?1, ?2, ?3, ?4)
     ON CONFLICT (shard_id, machine_id) DO UPDATE SET epoch = excluded.epoch,
         sequence = excluded.sequence";

/// How long the writer waits before retrying changes whose commit failed
/// when no new submission arrives to carry them.
const RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// How often the checkpointer copies committed WAL frames into the database.
const CHECKPOINT_INTERVAL: Duration = Duration::from_millis(200);

/// WAL size at which the writer itself forces a checkpoint (backpressure
/// when the background checkpointer cannot keep up).
const WAL_LIMIT_BYTES: u64 = 64 * 1024 * 1024;

pub(crate) struct Shared {
    pub(crate) path: PathBuf,
    pub(crate) queue: Mutex<ChangeQueue>,
    pub(crate) wake: Condvar,
    /// Ticket ranges whose commit failed and whose changes are not yet
    /// durable; cleared by the next successful commit (which carries them).
    pub(crate) failures: Arc<FailedCommits>,
    pub(crate) commits: AtomicU64,
    stop_checkpoints: Mutex<bool>,
    checkpoint_wake: Condvar,
}

impl Shared {
    pub(crate) fn new(path: PathBuf) -> Shared {
        Shared {
            path,
            queue: Mutex::new(ChangeQueue::default()),
            wake: Condvar::new(),
            failures: Arc::default(),
            commits: AtomicU64::new(0),
            stop_checkpoints: Mutex::new(false),
            checkpoint_wake: Condvar::new(),
        }
    }
}

/// Let the writer commit what is queued, then stop both threads.
pub(crate) fn shutdown(
    shared: &Shared,
    writer: Option<JoinHandle<()>>,
    checkpointer: Option<JoinHandle<()>>,
) {
    shared.queue.lock().shutdown = true;
    shared.wake.notify_all();
    if let Some(writer) = writer {
        if writer.join().is_err() {
            tracing::error!(path = %shared.path.display(), "state store writer thread panicked");
        }
    }
    *shared.stop_checkpoints.lock() = true;
    shared.checkpoint_wake.notify_all();
    if let Some(checkpointer) = checkpointer {
        if checkpointer.join().is_err() {
            tracing::error!(path = %shared.path.display(), "state store checkpoint thread panicked");
        }
    }
}

/// Copy committed frames from the WAL into the database in the background
/// (PASSIVE: never blocks the writer).
pub(crate) fn checkpoint_loop(shared: &Shared, conn: Connection) {
    let mut seen = 0;
    loop {
        {
            let mut stop = shared.stop_checkpoints.lock();
            if !*stop {
                shared
                    .checkpoint_wake
                    .wait_for(&mut stop, CHECKPOINT_INTERVAL);
            }
            if *stop {
                return;
            }
        }
        let commits = shared.commits.load(Ordering::Relaxed);
        if commits == seen {
            continue;
        }
        seen = commits;
        if let Err(e) = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
            tracing::warn!(path = %shared.path.display(), error = %e, "background checkpoint failed");
        }
    }
}

/// The latest version of every changed row; later changes overwrite earlier.
/// Write `changes` in one transaction outside the writer thread (an
/// import into a database nobody else has open yet).
pub(crate) fn write_changes(conn: &mut Connection, changes: Vec<Change>) -> rusqlite::Result<()> {
    let mut batch = ChangeBatch::default();
    batch.merge(changes);
    write_batch(conn, &batch)
}

fn write_batch(conn: &mut Connection, batch: &ChangeBatch) -> rusqlite::Result<()> {
    let tx = conn.transaction()?;
    write_rows(&tx, batch)?;
    tx.commit()
}

/// Every row of `batch` into the caller's transaction (the writer's
/// commits, and a restore into an empty state that checks it is empty in
/// the same transaction).
pub(crate) fn write_rows(
    tx: &rusqlite::Transaction<'_>,
    batch: &ChangeBatch,
) -> rusqlite::Result<()> {
    {
        let mut put = tx.prepare_cached(UPSERT_MACHINE)?;
        for record in batch.machines.values() {
            let [create, configure, drain, delete] = &record.ops;
            // SQLite integers are signed; a window past i64 is never real.
            let ms = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            let window = record.in_flight.as_ref();
            put.execute(rusqlite::params![
                record.id,
                record.rev,
                record.encoded().as_bytes(),
                create,
                configure,
                drain,
                delete,
                window.map(|w| ms(w.started_ms)),
                window.map(|w| ms(w.deadline_ms)),
                window.map(|w| ms(w.grace_ms)),
            ])?;
        }
        let mut put = tx.prepare_cached(UPSERT_FENCE)?;
        for mark in batch.fences.values() {
            put.execute(rusqlite::params![
                mark.shard_id,
                mark.machine_id,
                mark.epoch,
                mark.sequence,
            ])?;
        }
    }
    Ok(())
}

/// Drain the queue into one transaction per round until shut down. Changes
/// whose commit failed (after one retry) stay in `carry` and ride along with
/// the next round, so memory and disk converge once the disk recovers.
pub(crate) fn writer_loop(
    shared: &Shared,
    conn: &Mutex<Connection>,
    done_tx: &watch::Sender<Ticket>,
) {
    let mut carry = ChangeBatch::default();
    let mut done: Ticket = 0;
    loop {
        let (changes, upto, shutdown) = {
            let mut queue = shared.queue.lock();
            while queue.pending.is_empty() && !queue.shutdown {
                if carry.is_empty() {
                    shared.wake.wait(&mut queue);
                } else if shared.wake.wait_for(&mut queue, RETRY_INTERVAL).timed_out() {
                    break;
                }
            }
            (
                std::mem::take(&mut queue.pending),
                queue.issued,
                queue.shutdown,
            )
        };
        carry.merge(changes);
        if !carry.is_empty() {
            let mut guard = conn.lock();
            let result = write_batch(&mut guard, &carry).or_else(|e| {
                tracing::warn!(path = %shared.path.display(), error = %e, "state commit failed; retrying once");
                write_batch(&mut guard, &carry)
            });
            drop(guard);
            match result {
                Ok(()) => {
                    carry.clear();
                    shared.failures.clear();
                    shared.commits.fetch_add(1, Ordering::Relaxed);
                    limit_wal(shared, conn);
                }
                Err(e) => {
                    let mut error = sql_error(&shared.path, "cannot commit changes", e);
                    // Whatever the cause, the change is carried and retried:
                    // to a waiter the state is unavailable, not gone.
                    if error.kind() != StoreErrorKind::Corrupt {
                        error = error.with_kind(StoreErrorKind::Unavailable);
                    }
                    tracing::error!(path = %shared.path.display(), error = %error, "state commit failed");
                    if upto > done {
                        shared.failures.record(done + 1, upto, error);
                    }
                }
            }
        }
        if upto > done {
            done = upto;
            // No receiver left only means nobody is waiting.
            let _ = done_tx.send(done);
        }
        if shutdown {
            return;
        }
    }
}

/// When the WAL outgrows [`WAL_LIMIT_BYTES`] (the checkpointer never found
/// a quiet moment to let it restart), checkpoint and restart it here.
fn limit_wal(shared: &Shared, conn: &Mutex<Connection>) {
    let mut wal = OsString::from(shared.path.as_os_str());
    wal.push("-wal");
    let size = std::fs::metadata(&wal).map_or(0, |m| m.len());
    if size <= WAL_LIMIT_BYTES {
        return;
    }
    if let Err(e) = conn
        .lock()
        .query_row("PRAGMA wal_checkpoint(RESTART)", [], |_| Ok(()))
    {
        tracing::warn!(path = %shared.path.display(), error = %e, "WAL restart checkpoint failed");
    }
}
