//! The write path: one task drains every queued change into a single
//! transaction (group commit) on one pooled connection; a failed commit is
//! resolved by reading the commit sequence before anything is written
//! again, and changes that are not yet durable ride along with the next
//! round.
//!
//! Every commit advances `bigfleet_meta.commit_seq` from the value this
//! writer last saw to the next one, in the same transaction as the rows.
//! When a commit fails, whatever the failure (an error, a dropped
//! connection, no answer in time), the writer reads the sequence on a
//! fresh connection: the next value means the commit landed (its answer was
//! lost) and nothing is written again; the old value means it did not, and
//! writing it again cannot apply anything twice; any other value means
//! another process writes this state. When even the read fails, the batch
//! is kept "in doubt" and resolved the same way before the next write.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Object, Pool};
use parking_lot::Mutex;
use providerkit::{
    Change, ChangeBatch, ChangeQueue, FailedCommits, FenceMark, MachineRecord, StoreError,
    StoreErrorKind, Ticket,
};
use tokio::sync::{watch, Notify};

use crate::error::{pg_error, pool_error};
use crate::rows::{send_fences, send_machines};

/// One statement for every machine of a batch: the rows travel as arrays.
const UPSERT_MACHINES: &str = "INSERT INTO bigfleet_machines
     (id, rev, record, op_create, op_configure, op_drain, op_delete,
      started_ms, deadline_ms, grace_ms)
     SELECT * FROM UNNEST($1::text[], $2::int8[], $3::bytea[], $4::text[], $5::text[],
                          $6::text[], $7::text[], $8::int8[], $9::int8[], $10::int8[])
     ON CONFLICT (id) DO UPDATE SET rev = excluded.rev, record = excluded.record,
         op_create = excluded.op_create, op_configure = excluded.op_configure,
         op_drain = excluded.op_drain, op_delete = excluded.op_delete,
         started_ms = excluded.started_ms, deadline_ms = excluded.deadline_ms,
         grace_ms = excluded.grace_ms";

const UPSERT_FENCES: &str = "INSERT INTO bigfleet_fences (shard_id, machine_id, epoch, sequence)
     SELECT * FROM UNNEST($1::bytea[], $2::bytea[], $3::int8[], $4::int8[])
     ON CONFLICT (shard_id, machine_id) DO UPDATE SET epoch = excluded.epoch,
         sequence = excluded.sequence";

const ADVANCE: &str = "UPDATE bigfleet_meta SET commit_seq = $1 WHERE id = 1 AND commit_seq = $2";

/// The lease row, locked against a new holder until this transaction ends:
/// a replica taking the lease waits for the commits in flight, and a commit
/// that comes after reads the new epoch and writes nothing.
pub(crate) const CHECK_LEASE: &str = "SELECT epoch FROM bigfleet_lease WHERE id = 1 FOR SHARE";

const READ_SEQ: &str = "SELECT commit_seq FROM bigfleet_meta WHERE id = 1";

/// How long the last round before the store stops may take: an unreachable
/// database must not hold the process's exit for the pool's timeouts
/// (what it could not commit was never acknowledged).
const SHUTDOWN_ROUND: Duration = Duration::from_secs(10);

/// How long the writer waits before retrying changes whose commit failed
/// when no new submission arrives to carry them.
const RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// How long one commit (or the read that resolves it) may take before its
/// outcome is treated as unknown: a connection that hangs without closing
/// (a dead peer, a partition) must not stall the state for TCP's timeouts.
const COMMIT_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) struct Shared {
    pub(crate) target: String,
    /// The lease epoch every commit must still find (see [`CHECK_LEASE`]).
    pub(crate) lease_epoch: Option<i64>,
    pub(crate) queue: Mutex<ChangeQueue>,
    pub(crate) wake: Notify,
    /// Ticket ranges whose commit failed and whose changes are not yet
    /// durable; cleared once everything is.
    failures: FailedCommits,
    pub(crate) commits: AtomicU64,
    /// Commits whose answer was lost and that a read found had landed.
    pub(crate) resolved_by_reading: AtomicU64,
    /// Test hook: the next commit lands but its answer is thrown away.
    pub(crate) lose_next_answer: AtomicBool,
}

impl Shared {
    pub(crate) fn new(target: String, lease_epoch: Option<i64>) -> Shared {
        Shared {
            target,
            lease_epoch,
            queue: Mutex::new(ChangeQueue::default()),
            wake: Notify::new(),
            failures: FailedCommits::default(),
            commits: AtomicU64::new(0),
            resolved_by_reading: AtomicU64::new(0),
            lose_next_answer: AtomicBool::new(false),
        }
    }

    pub(crate) fn failure_for(&self, ticket: Ticket) -> Option<StoreError> {
        self.failures.failure_for(ticket)
    }

    /// The latest commit failure whose changes are still not durable.
    pub(crate) fn pending_failure(&self) -> Option<StoreError> {
        self.failures.latest()
    }
}

/// The latest version of every changed row; later changes overwrite earlier.
/// What the writer knows about the database between rounds.
struct Writer {
    /// The commit sequence this writer last saw committed.
    known: i64,
    /// Changes not yet known to be durable.
    carry: ChangeBatch,
    /// A commit whose outcome is unknown (it would have set the sequence
    /// to the number given) with the changes it carried.
    doubt: Option<(i64, ChangeBatch)>,
}

/// Drain the queue into one transaction per round until shut down.
pub(crate) async fn writer_loop(
    shared: Arc<Shared>,
    pool: Pool,
    done_tx: watch::Sender<Ticket>,
    known: i64,
) {
    let mut writer = Writer {
        known,
        carry: ChangeBatch::default(),
        doubt: None,
    };
    let mut done: Ticket = 0;
    loop {
        let idle = writer.carry.is_empty() && writer.doubt.is_none();
        let (changes, upto, shutdown) = next_round(&shared, idle).await;
        writer.carry.merge(changes);
        let outcome = if shutdown {
            tokio::time::timeout(SHUTDOWN_ROUND, round(&shared, &pool, &mut writer))
                .await
                .unwrap_or_else(|_| {
                    Err(StoreError::closed(format!(
                        "PostgreSQL state {}: stopped before the last changes were committed \
                         (no answer within {}s)",
                        shared.target,
                        SHUTDOWN_ROUND.as_secs()
                    )))
                })
        } else {
            round(&shared, &pool, &mut writer).await
        };
        match outcome {
            Ok(()) => shared.failures.clear(),
            Err(error) => {
                tracing::error!(state = %shared.target, error = %error, "state commit failed");
                if upto > done {
                    shared.failures.record(done + 1, upto, error);
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

/// Wait for submissions (or, with work outstanding, at most the retry
/// interval) and take everything queued.
async fn next_round(shared: &Shared, idle: bool) -> (Vec<Change>, Ticket, bool) {
    loop {
        {
            let mut queue = shared.queue.lock();
            if !queue.pending.is_empty() || queue.shutdown {
                return (
                    std::mem::take(&mut queue.pending),
                    queue.issued,
                    queue.shutdown,
                );
            }
        }
        if idle {
            shared.wake.notified().await;
        } else if tokio::time::timeout(RETRY_INTERVAL, shared.wake.notified())
            .await
            .is_err()
        {
            let queue = shared.queue.lock();
            return (Vec::new(), queue.issued, queue.shutdown);
        }
    }
}

/// One round: settle a commit in doubt, then commit what is carried
/// (once more after a commit that a read shows did not land).
async fn round(shared: &Shared, pool: &Pool, writer: &mut Writer) -> Result<(), StoreError> {
    if let Some((seq, _)) = &writer.doubt {
        let seq = *seq;
        let found = read_seq(shared, pool).await?;
        let Some((_, batch)) = writer.doubt.take() else {
            return Ok(());
        };
        if found == seq {
            writer.known = seq;
            shared.resolved_by_reading.fetch_add(1, Ordering::Relaxed);
            shared.commits.fetch_add(1, Ordering::Relaxed);
        } else if found == writer.known {
            // It did not land: its changes go first, newer ones over them.
            let newer = std::mem::replace(&mut writer.carry, batch);
            writer.carry.absorb(newer);
        } else {
            writer.doubt = Some((seq, batch));
            return Err(moved(shared, writer.known, found));
        }
    }
    if writer.carry.is_empty() {
        return Ok(());
    }
    let mut last_error = None;
    for _ in 0..2 {
        let next = writer.known + 1;
        let error = match write(shared, pool, &writer.carry, writer.known, next).await {
            Ok(()) => {
                writer.known = next;
                writer.carry = ChangeBatch::default();
                shared.commits.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            // Nothing was committed: the transaction found the lease taken
            // and rolled back. Writing again cannot succeed.
            Err(WriteFailed::Deposed(error)) => return Err(error),
            Err(WriteFailed::Other(error)) => error,
        };
        tracing::warn!(state = %shared.target, error = %error, "state commit failed; reading whether it landed");
        match read_seq(shared, pool).await {
            Ok(found) if found == next => {
                writer.known = next;
                writer.carry = ChangeBatch::default();
                shared.resolved_by_reading.fetch_add(1, Ordering::Relaxed);
                shared.commits.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            // Not applied: writing it again cannot apply anything twice.
            Ok(found) if found == writer.known => last_error = Some(error),
            Ok(found) => return Err(moved(shared, writer.known, found)),
            Err(_) => {
                writer.doubt = Some((next, std::mem::take(&mut writer.carry)));
                return Err(error);
            }
        }
    }
    Err(last_error
        .unwrap_or_else(|| StoreError::unavailable("state commit failed"))
        .with_kind(StoreErrorKind::Unavailable))
}

/// Someone else advanced the commit sequence: two providers on one state.
fn moved(shared: &Shared, known: i64, found: i64) -> StoreError {
    StoreError::locked(format!(
        "PostgreSQL state {}: another process is writing this state (commit sequence {found}, \
         this process last wrote {known}); run one provider per database",
        shared.target
    ))
}

/// The committed sequence, on a connection of its own.
async fn read_seq(shared: &Shared, pool: &Pool) -> Result<i64, StoreError> {
    let target = &shared.target;
    let action = "cannot read the commit sequence";
    let client = pool
        .get()
        .await
        .map_err(|e| pool_error(target, action, e))?;
    match tokio::time::timeout(COMMIT_TIMEOUT, client.query_one(READ_SEQ, &[])).await {
        Ok(Ok(row)) => Ok(row.get(0)),
        Ok(Err(e)) => {
            drop(Object::take(client));
            Err(pg_error(target, action, e))
        }
        Err(_) => {
            drop(Object::take(client));
            Err(timed_out(target, action))
        }
    }
}

fn timed_out(target: &str, action: &str) -> StoreError {
    StoreError::unavailable(format!(
        "PostgreSQL state {target}: {action}: no answer within {}s",
        COMMIT_TIMEOUT.as_secs()
    ))
}

/// Why a commit did not land.
enum WriteFailed {
    /// Another replica holds the lease: nothing was committed, and nothing
    /// of this store will be.
    Deposed(StoreError),
    /// Anything else; whether it landed is settled by reading.
    Other(StoreError),
}

/// Commit `batch` as sequence `next`. On any failure the connection is
/// discarded rather than returned to the pool: its state is unknown.
async fn write(
    shared: &Shared,
    pool: &Pool,
    batch: &ChangeBatch,
    known: i64,
    next: i64,
) -> Result<(), WriteFailed> {
    let target = &shared.target;
    let action = "cannot commit changes";
    let mut client = pool
        .get()
        .await
        .map_err(|e| WriteFailed::Other(pool_error(target, action, e)))?;
    let result = tokio::time::timeout(
        COMMIT_TIMEOUT,
        write_batch(&mut client, batch, shared.lease_epoch, known, next),
    )
    .await;
    let error = match result {
        Ok(Ok(Written::Committed)) => {
            if shared.lose_next_answer.swap(false, Ordering::SeqCst) {
                drop(Object::take(client));
                return Err(WriteFailed::Other(StoreError::unavailable(format!(
                    "PostgreSQL state {target}: {action}: the answer was lost (test hook)"
                ))));
            }
            return Ok(());
        }
        Ok(Ok(Written::SequenceMoved)) => StoreError::locked(format!(
            "PostgreSQL state {target}: {action}: the commit sequence is no longer {known}"
        )),
        Ok(Ok(Written::LeaseTaken { mine, found })) => {
            return Err(WriteFailed::Deposed(deposed(target, mine, found)))
        }
        Ok(Err(e)) => pg_error(target, action, e),
        Err(_) => timed_out(target, action),
    };
    drop(Object::take(client));
    Err(WriteFailed::Other(error))
}

/// The commit of a replica whose lease another replica has taken.
pub(crate) fn deposed(target: &str, mine: i64, found: i64) -> StoreError {
    StoreError::locked(format!(
        "PostgreSQL state {target}: this replica no longer holds the leader lease (it held \
         epoch {mine}, the lease is at epoch {found}): nothing is committed by a replica that \
         lost the lease"
    ))
}

/// What one commit attempt did.
enum Written {
    Committed,
    /// The sequence was not where this writer left it: nothing committed.
    SequenceMoved,
    /// Another replica holds the lease now: nothing committed.
    LeaseTaken {
        mine: i64,
        found: i64,
    },
}

/// The batch's rows and the sequence's step in one transaction, under the
/// lease check when this store writes as a leader.
async fn write_batch(
    client: &mut Object,
    batch: &ChangeBatch,
    lease_epoch: Option<i64>,
    known: i64,
    next: i64,
) -> Result<Written, tokio_postgres::Error> {
    let advance = client.prepare_cached(ADVANCE).await?;
    let machines = client.prepare_cached(UPSERT_MACHINES).await?;
    let fences = client.prepare_cached(UPSERT_FENCES).await?;
    let check_lease = client.prepare_cached(CHECK_LEASE).await?;
    let tx = client.transaction().await?;
    // Dropping the transaction on an early return rolls it back.
    if let Some(mine) = lease_epoch {
        let found: i64 = tx.query_one(&check_lease, &[]).await?.get(0);
        if found != mine {
            return Ok(Written::LeaseTaken { mine, found });
        }
    }
    if tx.execute(&advance, &[&next, &known]).await? != 1 {
        return Ok(Written::SequenceMoved);
    }
    if !batch.machines.is_empty() {
        let records: Vec<&MachineRecord> = batch.machines.values().map(|r| &**r).collect();
        send_machines(&tx, &machines, &records).await?;
    }
    if !batch.fences.is_empty() {
        let marks: Vec<&FenceMark> = batch.fences.values().collect();
        send_fences(&tx, &fences, &marks).await?;
    }
    tx.commit().await?;
    Ok(Written::Committed)
}
