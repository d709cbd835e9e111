//! Durable providerkit state in one SQLite file.
//!
//! The database runs in WAL mode with `synchronous=FULL`, so a committed
//! transaction survives a kill -9 or power loss. [`Store::submit`] only
//! appends to an in-memory queue; one dedicated writer thread drains
//! everything queued into a single transaction and publishes the highest
//! committed ticket, so one fsync acknowledges many concurrent mutations
//! (group commit).
//!
//! Checkpoints (copying the WAL into the database file) run on a second
//! connection in a background thread, so commits never wait for them.
//!
//! The file is owned by one process at a time: an exclusive `flock` on
//! `<path>.lock`, which also records the owner's pid.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use futures::future::BoxFuture;
use parking_lot::{Condvar, Mutex};
use providerkit::{
    Change, FactsInterner, FenceMark, Loaded, MachineRecord, Store, StoreError, Ticket,
};
use rusqlite::{Connection, ErrorCode, OpenFlags, TransactionBehavior};
use tokio::sync::watch;

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

const UPSERT_MACHINE: &str = "INSERT INTO machines
     (id, rev, record, op_create, op_configure, op_drain, op_delete)
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
     ON CONFLICT (id) DO UPDATE SET rev = excluded.rev, record = excluded.record,
         op_create = excluded.op_create, op_configure = excluded.op_configure,
         op_drain = excluded.op_drain, op_delete = excluded.op_delete";

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

/// A [`Store`] backed by one SQLite database file.
pub struct SqliteStore {
    path: PathBuf,
    shared: Arc<Shared>,
    done: watch::Receiver<Ticket>,
    writer: Option<JoinHandle<()>>,
    checkpointer: Option<JoinHandle<()>>,
    // Field order matters: the connection closes before the lock is released.
    conn: Arc<Mutex<Connection>>,
    _lock: File,
}

struct Shared {
    path: PathBuf,
    queue: Mutex<Queue>,
    wake: Condvar,
    /// Ticket ranges whose commit failed and whose changes are not yet
    /// durable; cleared by the next successful commit (which carries them).
    failures: Mutex<Vec<Failure>>,
    commits: AtomicU64,
    stop_checkpoints: Mutex<bool>,
    checkpoint_wake: Condvar,
}

#[derive(Default)]
struct Queue {
    /// The last ticket handed out.
    issued: Ticket,
    /// Every change submitted since the writer last drained, in order.
    pending: Vec<Change>,
    shutdown: bool,
}

struct Failure {
    first: Ticket,
    last: Ticket,
    message: String,
}

impl Shared {
    fn failure_for(&self, ticket: Ticket) -> Option<String> {
        self.failures
            .lock()
            .iter()
            .find(|f| (f.first..=f.last).contains(&ticket))
            .map(|f| f.message.clone())
    }

    fn record_failure(&self, first: Ticket, last: Ticket, message: String) {
        let mut failures = self.failures.lock();
        // Consecutive failures (a dead disk) coalesce into one range.
        if let Some(prev) = failures.last_mut() {
            if prev.last + 1 == first {
                prev.last = last;
                prev.message = message;
                return;
            }
        }
        failures.push(Failure {
            first,
            last,
            message,
        });
    }
}

impl SqliteStore {
    /// Open (creating if needed) the state database at `path`, take the
    /// exclusive lock and migrate the schema to [`SCHEMA_VERSION`].
    pub fn open(path: &Path) -> Result<SqliteStore, StoreError> {
        let path = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        let lock = acquire_lock(&path)?;
        create_private_file(&path)?;
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let mut conn = Connection::open_with_flags(&path, flags)
            .map_err(|e| sql_error(&path, "cannot open", e))?;
        configure(&path, &conn)?;
        migrate(&path, &mut conn)?;
        // Checkpoints run on their own connection so commits never wait
        // for the database file to be written and synced.
        let checkpoint_conn = Connection::open_with_flags(&path, flags)
            .map_err(|e| sql_error(&path, "cannot open", e))?;
        configure(&path, &checkpoint_conn)?;

        let conn = Arc::new(Mutex::new(conn));
        let shared = Arc::new(Shared {
            path: path.clone(),
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            failures: Mutex::new(Vec::new()),
            commits: AtomicU64::new(0),
            stop_checkpoints: Mutex::new(false),
            checkpoint_wake: Condvar::new(),
        });
        let (done_tx, done) = watch::channel(0);
        let writer = {
            let shared = Arc::clone(&shared);
            let conn = Arc::clone(&conn);
            std::thread::Builder::new()
                .name("sqlite-store-writer".into())
                .spawn(move || writer_loop(&shared, &conn, &done_tx))
                .map_err(|e| {
                    StoreError(format!(
                        "state file {}: cannot start the writer thread: {e}",
                        path.display()
                    ))
                })?
        };
        let checkpointer = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("sqlite-store-checkpoint".into())
                .spawn(move || checkpoint_loop(&shared, checkpoint_conn))
                .map_err(|e| {
                    StoreError(format!(
                        "state file {}: cannot start the checkpoint thread: {e}",
                        path.display()
                    ))
                })
        };
        let checkpointer = match checkpointer {
            Ok(handle) => handle,
            Err(e) => {
                shutdown(&shared, Some(writer), None);
                return Err(e);
            }
        };
        Ok(SqliteStore {
            path,
            shared,
            done,
            writer: Some(writer),
            checkpointer: Some(checkpointer),
            conn,
            _lock: lock,
        })
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

/// Let the writer commit what is queued, then stop both threads.
fn shutdown(shared: &Shared, writer: Option<JoinHandle<()>>, checkpointer: Option<JoinHandle<()>>) {
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
fn checkpoint_loop(shared: &Shared, conn: Connection) {
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

impl Store for SqliteStore {
    fn load(&self) -> Result<Loaded, StoreError> {
        let path = &self.path;
        let mut conn = self.conn.lock();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| sql_error(path, "cannot start the load transaction", e))?;
        tx.execute("UPDATE meta SET boot_generation = boot_generation + 1", [])
            .map_err(|e| sql_error(path, "cannot start a new boot generation", e))?;
        let boot_generation: u64 = tx
            .query_row("SELECT boot_generation FROM meta", [], |r| r.get(0))
            .map_err(|e| sql_error(path, "cannot read the boot generation", e))?;

        let mut machines = load_machines(path, &tx)?;
        machines.sort_unstable_by_key(|m| m.rev);

        let mut fences = Vec::new();
        {
            let mut stmt = tx
                .prepare("SELECT shard_id, machine_id, epoch, sequence FROM fences")
                .map_err(|e| sql_error(path, "cannot read fencing marks", e))?;
            let mut rows = stmt
                .query([])
                .map_err(|e| sql_error(path, "cannot read fencing marks", e))?;
            while let Some(row) = rows
                .next()
                .map_err(|e| sql_error(path, "cannot read fencing marks", e))?
            {
                let mark = (|| {
                    Ok::<_, rusqlite::Error>(FenceMark {
                        shard_id: row.get(0)?,
                        machine_id: row.get(1)?,
                        epoch: row.get(2)?,
                        sequence: row.get(3)?,
                    })
                })()
                .map_err(|e| invalid(path, format!("a fencing mark row is malformed: {e}")))?;
                fences.push(mark);
            }
        }
        tx.commit()
            .map_err(|e| sql_error(path, "cannot commit the new boot generation", e))?;
        Ok(Loaded {
            machines,
            fences,
            boot_generation,
        })
    }

    fn submit(&self, changes: Vec<Change>) -> Ticket {
        let mut queue = self.shared.queue.lock();
        if changes.is_empty() {
            return queue.issued;
        }
        queue.issued += 1;
        queue.pending.extend(changes);
        let ticket = queue.issued;
        drop(queue);
        self.shared.wake.notify_one();
        ticket
    }

    fn durable(&self, ticket: Ticket) -> BoxFuture<'static, Result<(), StoreError>> {
        let mut done = self.done.clone();
        let shared = Arc::clone(&self.shared);
        Box::pin(async move {
            if done.wait_for(|d| *d >= ticket).await.is_err() {
                return Err(StoreError(format!(
                    "state file {}: the writer stopped before ticket {ticket} was committed",
                    shared.path.display()
                )));
            }
            match shared.failure_for(ticket) {
                Some(message) => Err(StoreError(message)),
                None => Ok(()),
            }
        })
    }

    fn describe(&self) -> String {
        format!("sqlite:{}", self.path.display())
    }
}

/// Rows handed to a decoder thread at a time.
const DECODE_CHUNK: usize = 512;

/// Machine rows as stored, copied into one buffer per chunk so the scanning
/// thread does one allocation per chunk and every allocation of the decoded
/// records happens (and stays) on the decoder thread.
#[derive(Default)]
struct RawChunk {
    bytes: Vec<u8>,
    rows: Vec<RawRow>,
}

struct RawRow {
    rev: u64,
    id: std::ops::Range<usize>,
    record: std::ops::Range<usize>,
    ops: [Option<std::ops::Range<usize>>; 4],
}

impl RawChunk {
    fn push_bytes(&mut self, data: &[u8]) -> std::ops::Range<usize> {
        let start = self.bytes.len();
        self.bytes.extend_from_slice(data);
        start..self.bytes.len()
    }

    fn push(&mut self, path: &Path, row: &rusqlite::Row<'_>) -> Result<(), StoreError> {
        let text = |i: usize| -> rusqlite::Result<Option<&[u8]>> {
            Ok(row.get_ref(i)?.as_str_or_null()?.map(str::as_bytes))
        };
        let id_bytes = text(0)
            .ok()
            .flatten()
            .ok_or_else(|| invalid(path, "a machine row has no valid id".to_string()))?;
        let id = self.push_bytes(id_bytes);
        let bad = |chunk: &RawChunk, what: &str, e: &dyn std::fmt::Display| {
            let id = String::from_utf8_lossy(&chunk.bytes[id.clone()]).into_owned();
            invalid(path, format!("machine {id:?} has an invalid {what}: {e}"))
        };
        let rev: u64 = match row.get(1) {
            Ok(rev) => rev,
            Err(e) => return Err(bad(self, "revision", &e)),
        };
        let record = match row.get_ref(2).and_then(|v| Ok(v.as_blob()?)) {
            Ok(blob) => self.push_bytes(blob),
            Err(e) => return Err(bad(self, "record", &e)),
        };
        let mut ops: [Option<std::ops::Range<usize>>; 4] = Default::default();
        for (i, op) in ops.iter_mut().enumerate() {
            match text(3 + i) {
                Ok(value) => *op = value.map(|v| self.push_bytes(v)),
                Err(e) => return Err(bad(self, "operation id", &e)),
            }
        }
        self.rows.push(RawRow {
            rev,
            id,
            record,
            ops,
        });
        Ok(())
    }

    fn decode(
        self,
        path: &Path,
        out: &mut Vec<MachineRecord>,
        interner: &mut FactsInterner,
    ) -> Result<(), StoreError> {
        let text = |range: &std::ops::Range<usize>| {
            // Came out of SQLite as TEXT, which the scan checked is UTF-8.
            String::from_utf8_lossy(&self.bytes[range.clone()]).into_owned()
        };
        for row in &self.rows {
            let id = &self.bytes[row.id.clone()];
            let ops = [
                row.ops[0].as_ref().map(text),
                row.ops[1].as_ref().map(text),
                row.ops[2].as_ref().map(text),
                row.ops[3].as_ref().map(text),
            ];
            let record =
                MachineRecord::decode_wire(&self.bytes[row.record.clone()], row.rev, ops, interner)
                    .map_err(|e| {
                        invalid(
                            path,
                            format!("machine {:?} has an invalid record: {e}", text(&row.id)),
                        )
                    })?;
            if record.id.as_bytes() != id {
                return Err(invalid(
                    path,
                    format!(
                        "machine row {:?} holds the record of {:?}",
                        text(&row.id),
                        record.id
                    ),
                ));
            }
            out.push(record);
        }
        Ok(())
    }
}

/// Scan every machine row while decoder threads turn the records into
/// messages: decoding (allocation-heavy maps) dominates restart time, so it
/// runs on every core alongside the scan.
fn load_machines(
    path: &Path,
    tx: &rusqlite::Transaction<'_>,
) -> Result<Vec<MachineRecord>, StoreError> {
    let mut stmt = tx
        .prepare(
            "SELECT id, rev, record, op_create, op_configure, op_drain, op_delete FROM machines",
        )
        .map_err(|e| sql_error(path, "cannot read machines", e))?;
    let mut rows = stmt
        .query([])
        .map_err(|e| sql_error(path, "cannot read machines", e))?;
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get().clamp(1, 4));
    std::thread::scope(|scope| {
        let mut senders = Vec::with_capacity(workers);
        let mut decoders = Vec::with_capacity(workers);
        for _ in 0..workers {
            let (send, receive) = std::sync::mpsc::sync_channel::<RawChunk>(4);
            senders.push(send);
            decoders.push(scope.spawn(move || {
                let mut out = Vec::new();
                let mut interner = FactsInterner::new();
                for chunk in receive {
                    chunk.decode(path, &mut out, &mut interner)?;
                }
                Ok::<_, StoreError>(out)
            }));
        }
        let scanned = (|| {
            let mut chunk = RawChunk::default();
            let mut next = 0;
            while let Some(row) = rows
                .next()
                .map_err(|e| sql_error(path, "cannot read machines", e))?
            {
                chunk.push(path, row)?;
                if chunk.rows.len() == DECODE_CHUNK {
                    // A closed channel means that decoder already failed;
                    // its error is collected below.
                    if senders[next % workers]
                        .send(std::mem::take(&mut chunk))
                        .is_err()
                    {
                        return Ok(());
                    }
                    next += 1;
                }
            }
            if !chunk.rows.is_empty() {
                // As above: a failed send surfaces as the decoder's error.
                let _ = senders[next % workers].send(chunk);
            }
            Ok(())
        })();
        drop(senders);
        let mut first_error = scanned.err();
        let mut machines = Vec::new();
        for decoder in decoders {
            match decoder.join() {
                Ok(Ok(mut part)) => machines.append(&mut part),
                Ok(Err(e)) => {
                    first_error.get_or_insert(e);
                }
                Err(_) => {
                    first_error.get_or_insert_with(|| {
                        StoreError(format!(
                            "state file {}: a record decoder thread panicked",
                            path.display()
                        ))
                    });
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(machines),
        }
    })
}

/// The latest version of every changed row; later changes overwrite earlier.
#[derive(Default)]
struct Batch {
    machines: HashMap<String, Arc<MachineRecord>>,
    fences: HashMap<(String, String), FenceMark>,
}

impl Batch {
    fn merge(&mut self, changes: Vec<Change>) {
        for change in changes {
            match change {
                Change::Machine(record) => {
                    self.machines.insert(record.id.clone(), record);
                }
                Change::Fence(mark) => {
                    self.fences
                        .insert((mark.shard_id.clone(), mark.machine_id.clone()), mark);
                }
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.machines.is_empty() && self.fences.is_empty()
    }

    fn clear(&mut self) {
        self.machines.clear();
        self.fences.clear();
    }
}

fn write_batch(conn: &mut Connection, batch: &Batch) -> rusqlite::Result<()> {
    let tx = conn.transaction()?;
    {
        let mut put = tx.prepare_cached(UPSERT_MACHINE)?;
        for record in batch.machines.values() {
            let [create, configure, drain, delete] = &record.ops;
            put.execute(rusqlite::params![
                record.id,
                record.rev,
                record.encoded().as_bytes(),
                create,
                configure,
                drain,
                delete,
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
    tx.commit()
}

/// Drain the queue into one transaction per round until shut down. Changes
/// whose commit failed (after one retry) stay in `carry` and ride along with
/// the next round, so memory and disk converge once the disk recovers.
fn writer_loop(shared: &Shared, conn: &Mutex<Connection>, done_tx: &watch::Sender<Ticket>) {
    let mut carry = Batch::default();
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
                    shared.failures.lock().clear();
                    shared.commits.fetch_add(1, Ordering::Relaxed);
                    limit_wal(shared, conn);
                }
                Err(e) => {
                    let message = sql_error(&shared.path, "cannot commit changes", e).0;
                    tracing::error!(path = %shared.path.display(), error = %message, "state commit failed");
                    if upto > done {
                        shared.record_failure(done + 1, upto, message);
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

fn lock_path(path: &Path) -> PathBuf {
    let mut name = OsString::from(path.as_os_str());
    name.push(".lock");
    PathBuf::from(name)
}

fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// A message naming the state file, the action and a readable cause.
fn io_error(path: &Path, action: &str, e: &io::Error) -> StoreError {
    let dir = parent_dir(path).display();
    let cause = match e.raw_os_error() {
        Some(libc::EACCES) | Some(libc::EPERM) => {
            format!("permission denied (directory {dir} or the file is not writable by this user)")
        }
        Some(libc::EROFS) => format!("directory {dir} is on a read-only filesystem"),
        Some(libc::ENOENT) => format!("directory {dir} does not exist"),
        Some(libc::ENOTDIR) => format!("a component of {dir} is not a directory"),
        Some(libc::EISDIR) => "the path is a directory".to_string(),
        Some(libc::ENOSPC) => "no space left on the device".to_string(),
        _ => "I/O error".to_string(),
    };
    StoreError(format!(
        "state file {}: {action}: {cause} ({e})",
        path.display()
    ))
}

fn invalid(path: &Path, detail: String) -> StoreError {
    StoreError(format!(
        "state file {} is not a valid state database: {detail}",
        path.display()
    ))
}

fn in_use(path: &Path, pid: Option<u32>) -> StoreError {
    let who = match pid {
        Some(pid) => format!(" (pid {pid})"),
        None => String::new(),
    };
    StoreError(format!(
        "state file {} is in use by another provider process{who}",
        path.display()
    ))
}

fn sql_error(path: &Path, action: &str, e: rusqlite::Error) -> StoreError {
    match e.sqlite_error_code() {
        Some(ErrorCode::NotADatabase) | Some(ErrorCode::DatabaseCorrupt) => {
            invalid(path, e.to_string())
        }
        Some(ErrorCode::DatabaseBusy) | Some(ErrorCode::DatabaseLocked) => in_use(path, None),
        Some(ErrorCode::ReadOnly) => StoreError(format!(
            "state file {}: {action}: the file or its filesystem is read-only ({e})",
            path.display()
        )),
        Some(ErrorCode::DiskFull) => StoreError(format!(
            "state file {}: {action}: no space left on the device ({e})",
            path.display()
        )),
        Some(ErrorCode::CannotOpen) | Some(ErrorCode::PermissionDenied) => StoreError(format!(
            "state file {}: {action}: cannot open the file or its journal in {} ({e})",
            path.display(),
            parent_dir(path).display()
        )),
        _ => StoreError(format!("state file {}: {action}: {e}", path.display())),
    }
}

/// Take the process-level lock on `<path>.lock` and record our pid in it.
fn acquire_lock(path: &Path) -> Result<File, StoreError> {
    let lock_path = lock_path(path);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&lock_path)
        .map_err(|e| {
            io_error(
                path,
                &format!("cannot create lock file {}", lock_path.display()),
                &e,
            )
        })?;
    // SAFETY: flock on a file descriptor we own; no memory is involved.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            let mut text = String::new();
            let pid = file
                .read_to_string(&mut text)
                .ok()
                .and_then(|_| text.trim().parse().ok());
            return Err(in_use(path, pid));
        }
        return Err(io_error(
            path,
            &format!("cannot lock {}", lock_path.display()),
            &e,
        ));
    }
    let record_pid = |file: &mut File| -> io::Result<()> {
        file.set_len(0)?;
        file.seek(SeekFrom::Start(0))?;
        writeln!(file, "{}", std::process::id())
    };
    record_pid(&mut file)
        .map_err(|e| io_error(path, &format!("cannot write {}", lock_path.display()), &e))?;
    Ok(file)
}

/// Create the database file ourselves with mode 0600 (independent of the
/// umask); SQLite gives its `-wal` file the same mode.
fn create_private_file(path: &Path) -> Result<(), StoreError> {
    let existed = path.exists();
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .map_err(|e| io_error(path, "cannot create or open", &e))?;
    let meta = file
        .metadata()
        .map_err(|e| io_error(path, "cannot inspect", &e))?;
    if !meta.is_file() {
        return Err(StoreError(format!(
            "state file {}: not a regular file",
            path.display()
        )));
    }
    if meta.permissions().mode() & 0o777 != 0o600 {
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(|e| io_error(path, "cannot restrict permissions to 0600", &e))?;
    }
    if !existed {
        // Make the new directory entry itself durable.
        File::open(parent_dir(path))
            .and_then(|dir| dir.sync_all())
            .map_err(|e| io_error(path, "cannot sync its directory", &e))?;
    }
    Ok(())
}

fn configure(path: &Path, conn: &Connection) -> Result<(), StoreError> {
    // Exclusion between processes is the flock on `<path>.lock`; SQLite's
    // own locks stay shared so the checkpoint connection can work alongside
    // the writer. A foreign process holding the write lock is "in use".
    conn.busy_timeout(Duration::from_secs(5))
        .map_err(|e| sql_error(path, "cannot set the busy timeout", e))?;
    let mode: String = conn
        .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
        .map_err(|e| sql_error(path, "cannot enable WAL", e))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError(format!(
            "state file {}: cannot enable WAL (journal mode stays {mode:?})",
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
fn migrate(path: &Path, conn: &mut Connection) -> Result<(), StoreError> {
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
        return Err(StoreError(format!(
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
