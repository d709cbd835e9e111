//! One commit round: a transaction that writes a round's rows under the
//! owner check, and the resolution of its outcome when the answer is lost.
//!
//! Every round has a number, and its transaction inserts that number with
//! the writer's id into `bigfleet_commits`. When a commit fails (an error,
//! a dropped connection, no answer in time), the round reads on a fresh
//! connection whether its number is there under its writer's id: if it is,
//! the commit landed and its answer was lost, and nothing is written again;
//! if not, writing it again cannot apply anything twice (and a second
//! attempt that meets the number already there fails on the key).
//!
//! Rows carry a stamp: the number of the round that first carried that
//! version of the row. Rounds run concurrently on several connections (see
//! `writer`), so an older version may reach the database after a newer one;
//! the upserts only ever replace a row with a higher stamp, which makes the
//! order in which rounds land irrelevant. Each round sends its rows sorted
//! by key, so two rounds lock shared rows in the same order and cannot
//! deadlock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Object, Pool};
use providerkit::{Change, FenceMark, MachineRecord, StoreError, StoreErrorKind};

use crate::error::{pg_error, pool_error};
use crate::rows::{send_fences, send_machines, ROWS_PER_STATEMENT};
use crate::shared::Shared;

/// One statement for every machine of a round: the rows travel as arrays.
const UPSERT_MACHINES: &str = "INSERT INTO bigfleet_machines
     (id, rev, record, op_create, op_configure, op_drain, op_delete,
      started_ms, deadline_ms, grace_ms, round)
     SELECT * FROM UNNEST($1::text[], $2::int8[], $3::bytea[], $4::text[], $5::text[],
                          $6::text[], $7::text[], $8::int8[], $9::int8[], $10::int8[],
                          $11::int8[])
     ON CONFLICT (id) DO UPDATE SET rev = excluded.rev, record = excluded.record,
         op_create = excluded.op_create, op_configure = excluded.op_configure,
         op_drain = excluded.op_drain, op_delete = excluded.op_delete,
         started_ms = excluded.started_ms, deadline_ms = excluded.deadline_ms,
         grace_ms = excluded.grace_ms, round = excluded.round
     WHERE bigfleet_machines.round < excluded.round";

const UPSERT_FENCES: &str = "INSERT INTO bigfleet_fences
     (shard_id, machine_id, epoch, sequence, round)
     SELECT * FROM UNNEST($1::bytea[], $2::bytea[], $3::int8[], $4::int8[], $5::int8[])
     ON CONFLICT (shard_id, machine_id) DO UPDATE SET epoch = excluded.epoch,
         sequence = excluded.sequence, round = excluded.round
     WHERE bigfleet_fences.round < excluded.round";

const INSERT_ROUND: &str = "INSERT INTO bigfleet_commits (round, writer) VALUES ($1, $2)";

const PRUNE_ROUNDS: &str = "DELETE FROM bigfleet_commits WHERE round < $1";

const ROUND_LANDED: &str =
    "SELECT EXISTS (SELECT 1 FROM bigfleet_commits WHERE round = $1 AND writer = $2)";

/// The lease lock in shared mode, held until this transaction ends: a
/// replica taking the lease takes it exclusively (`lease::TAKE_LEASE_LOCK`),
/// so it waits for the commits in flight, and a commit that comes after
/// waits for the take and then reads the new epoch ([`READ_LEASE_EPOCH`],
/// a statement of its own: under READ COMMITTED each statement sees what
/// was committed before it started, here after the lock was granted).
///
/// An advisory lock rather than `FOR SHARE` on the lease row: several
/// rounds in flight sharing a row lock make PostgreSQL write a multixact
/// and a WAL record for the row on every commit, and a share lock on the
/// row also held the leader's own renewals back behind its commits. The
/// lock's key is the lease table's OID, so two states in one database
/// (two schemas) never wait for each other.
pub(crate) const SHARE_LEASE_LOCK: &str = concat!(
    "SELECT pg_advisory_xact_lock_shared(",
    lease_lock_key!(),
    ")"
);

pub(crate) const READ_LEASE_EPOCH: &str = "SELECT epoch FROM bigfleet_lease WHERE id = 1";

/// The same for a store that writes without a lease: a second writer
/// opening the state advances the generation (waiting for these commits),
/// and this writer's later commits find it moved.
const CHECK_WRITER: &str = "SELECT writer_generation FROM bigfleet_meta WHERE id = 1 FOR SHARE";

/// How long one commit (or the read that resolves it) may take before its
/// outcome is treated as unknown: a connection that hangs without closing
/// (a dead peer, a partition) must not stall the state for TCP's timeouts.
const COMMIT_TIMEOUT: Duration = Duration::from_secs(30);

/// Who this store writes as; every commit checks it is still so.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Owner {
    /// The holder of the leader lease at this epoch.
    Lease(i64),
    /// The writer that opened the state at this writer generation.
    Writer(i64),
}

/// A row's latest version and the stamp it carries.
type Stamped<T> = (i64, T);

/// The rows one round writes, or that wait for the next one: the latest
/// version of every changed row, each with its stamp.
#[derive(Default)]
pub(crate) struct Rows {
    machines: HashMap<String, Stamped<Arc<MachineRecord>>>,
    fences: HashMap<(String, String), Stamped<FenceMark>>,
}

impl Rows {
    /// Add `changes`, newer than every row held, stamped `round`.
    pub(crate) fn stamp(&mut self, changes: Vec<Change>, round: i64) {
        for change in changes {
            match change {
                Change::Machine(record) => {
                    self.machines.insert(record.id.clone(), (round, record));
                }
                Change::Fence(mark) => {
                    let key = (mark.shard_id.clone(), mark.machine_id.clone());
                    self.fences.insert(key, (round, mark));
                }
            }
        }
    }

    /// Take back the rows of a round that did not land, except where a
    /// newer version is held.
    pub(crate) fn absorb_older(&mut self, older: &Rows) {
        keep_newer(&mut self.machines, &older.machines);
        keep_newer(&mut self.fences, &older.fences);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.machines.is_empty() && self.fences.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.machines.len() + self.fences.len()
    }

    #[cfg(test)]
    pub(crate) fn holds_machine(&self, id: &str) -> bool {
        self.machines.contains_key(id)
    }

    #[cfg(test)]
    pub(crate) fn machine_stamp(&self, id: &str) -> Option<i64> {
        self.machines.get(id).map(|(stamp, _)| *stamp)
    }
}

/// Every row of `older` into `held`, unless `held` has a newer version.
fn keep_newer<K, V>(held: &mut HashMap<K, Stamped<V>>, older: &HashMap<K, Stamped<V>>)
where
    K: Clone + Eq + std::hash::Hash,
    V: Clone,
{
    for (key, row) in older {
        let kept = held.entry(key.clone()).or_insert_with(|| row.clone());
        if kept.0 < row.0 {
            *kept = row.clone();
        }
    }
}

/// The rows of `map` in key order (the order every round locks them in),
/// each as its stamp and `project`ed value.
fn in_key_order<'a, K: Ord, V, T: ?Sized>(
    map: &'a HashMap<K, Stamped<V>>,
    project: impl Fn(&'a V) -> &'a T,
) -> Vec<(i64, &'a T)> {
    let mut rows: Vec<(&K, &Stamped<V>)> = map.iter().collect();
    rows.sort_unstable_by(|a, b| a.0.cmp(b.0));
    rows.into_iter()
        .map(|(_, (stamp, value))| (*stamp, project(value)))
        .collect()
}

/// How a round ended.
pub(crate) enum Outcome {
    /// Durable. `by_reading`: its answer was lost and a read found it.
    Landed { by_reading: bool },
    /// Not committed; writing its rows again cannot apply anything twice.
    NotLanded(StoreError),
    /// Not known: the commit failed and so did the read that would tell.
    Unknown(StoreError),
}

/// What a round is to do besides writing its rows.
pub(crate) struct RoundPlan {
    pub(crate) number: i64,
    pub(crate) owner: Owner,
    /// Forget the numbers of rounds below this one: none of them can be in
    /// doubt any more (`bigfleet_commits` stays small). The highest number
    /// always stays, so a writer that opens later starts above it.
    pub(crate) prune_below: Option<i64>,
    /// Set once the round's rows are written and COMMIT is sent: from then
    /// on the round only waits for the server's flush, and the next round
    /// may start (see `writer`).
    pub(crate) flushing: Arc<AtomicBool>,
}

/// Write `rows` as round `plan.number`: once, and once more if a read shows
/// the first attempt did not land.
pub(crate) async fn commit_round(
    shared: &Shared,
    pool: &Pool,
    plan: &RoundPlan,
    rows: &Rows,
) -> Outcome {
    let mut last_error = None;
    for _ in 0..2 {
        let error = match write(shared, pool, plan, rows).await {
            Ok(Written::Committed) => return Outcome::Landed { by_reading: false },
            // Nothing was committed and writing again cannot succeed.
            Ok(Written::OwnerMoved(error)) => return Outcome::NotLanded(error),
            Err(error) => error,
        };
        tracing::warn!(state = %shared.target, error = %error, "state commit failed; reading whether it landed");
        match round_landed(shared, pool, plan.number).await {
            Ok(true) => return Outcome::Landed { by_reading: true },
            Ok(false) => last_error = Some(error),
            Err(_) => return Outcome::Unknown(error),
        }
    }
    Outcome::NotLanded(
        last_error
            .unwrap_or_else(|| StoreError::unavailable("state commit failed"))
            .with_kind(StoreErrorKind::Unavailable),
    )
}

/// Whether round `number` committed, read on a connection of its own.
pub(crate) async fn round_landed(
    shared: &Shared,
    pool: &Pool,
    number: i64,
) -> Result<bool, StoreError> {
    let target = &shared.target;
    let action = "cannot read whether a commit landed";
    let client = pool
        .get()
        .await
        .map_err(|e| pool_error(target, action, e))?;
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&number, &shared.writer_id];
    let read = client.query_one(ROUND_LANDED, &params);
    match tokio::time::timeout(COMMIT_TIMEOUT, read).await {
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

/// The commit of a replica whose lease another replica has taken.
pub(crate) fn deposed(target: &str, mine: i64, found: i64) -> StoreError {
    StoreError::locked(format!(
        "PostgreSQL state {target}: this replica no longer holds the leader lease (it held \
         epoch {mine}, the lease is at epoch {found}): nothing is committed by a replica that \
         lost the lease"
    ))
}

/// Another writer opened the state after this one.
fn superseded(target: &str, mine: i64, found: i64) -> StoreError {
    StoreError::locked(format!(
        "PostgreSQL state {target}: another process is writing this state (writer generation \
         {found}, this process opened it at {mine}); run one provider per database, or several \
         under a leader lease"
    ))
}

/// What one commit attempt did, when it got an answer.
enum Written {
    Committed,
    /// The owner check failed: nothing committed, nothing ever will be.
    OwnerMoved(StoreError),
}

/// One attempt. On any failure the connection is discarded rather than
/// returned to the pool: its state is unknown.
async fn write(
    shared: &Shared,
    pool: &Pool,
    plan: &RoundPlan,
    rows: &Rows,
) -> Result<Written, StoreError> {
    let target = &shared.target;
    let action = "cannot commit changes";
    let mut client = pool
        .get()
        .await
        .map_err(|e| pool_error(target, action, e))?;
    let sent = transaction(&mut client, shared, plan, rows);
    let result = tokio::time::timeout(COMMIT_TIMEOUT, sent).await;
    let error = match result {
        Ok(Ok(Found::Committed)) => {
            if shared.lose_next_answer.swap(false, Ordering::SeqCst) {
                drop(Object::take(client));
                return Err(StoreError::unavailable(format!(
                    "PostgreSQL state {target}: {action}: the answer was lost (test hook)"
                )));
            }
            return Ok(Written::Committed);
        }
        Ok(Ok(Found::OwnerMoved { found })) => {
            let error = match plan.owner {
                Owner::Lease(mine) => deposed(target, mine, found),
                Owner::Writer(mine) => superseded(target, mine, found),
            };
            return Ok(Written::OwnerMoved(error));
        }
        Ok(Err(e)) => pg_error(target, action, e),
        Err(_) => timed_out(target, action),
    };
    drop(Object::take(client));
    Err(error)
}

/// What the transaction found.
enum Found {
    Committed,
    OwnerMoved { found: i64 },
}

/// The owner check, the round's number and its rows in one transaction.
/// The statements are pipelined (sent together, answered in order): a
/// round costs two round trips to the server whatever its size, and the
/// owner check's answer is looked at before COMMIT is sent.
async fn transaction(
    client: &mut Object,
    shared: &Shared,
    plan: &RoundPlan,
    rows: &Rows,
) -> Result<Found, tokio_postgres::Error> {
    let leased = matches!(plan.owner, Owner::Lease(_));
    let share_lease = client.prepare_cached(SHARE_LEASE_LOCK).await?;
    let check = client
        .prepare_cached(if leased {
            READ_LEASE_EPOCH
        } else {
            CHECK_WRITER
        })
        .await?;
    let insert_round = client.prepare_cached(INSERT_ROUND).await?;
    let prune = client.prepare_cached(PRUNE_ROUNDS).await?;
    let upsert_machines = client.prepare_cached(UPSERT_MACHINES).await?;
    let upsert_fences = client.prepare_cached(UPSERT_FENCES).await?;

    let machines: Vec<(i64, &MachineRecord)> = in_key_order(&rows.machines, |r| &**r);
    let fences: Vec<(i64, &FenceMark)> = in_key_order(&rows.fences, |m| m);

    let round_params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] =
        [&plan.number, &shared.writer_id];
    // BEGIN goes in the same pipeline as the statements. On any failure
    // the caller discards this connection (its transaction state is
    // unknown), so only the owner check's refusal needs a ROLLBACK here.
    let client: &Object = client;
    let (begun, locked, owner, round, pruned, machines_sent, fences_sent) = futures::join!(
        client.batch_execute("BEGIN"),
        async {
            if leased {
                client.execute(&share_lease, &[]).await.map(|_| ())
            } else {
                Ok(())
            }
        },
        client.query_one(&check, &[]),
        client.execute(&insert_round, &round_params),
        async {
            match plan.prune_below {
                Some(below) => client.execute(&prune, &[&below]).await.map(|_| ()),
                None => Ok(()),
            }
        },
        // A small round is one statement per table, pipelined with the
        // rest; a large one goes a statement at a time, each encoded only
        // once the one before was answered (the peak memory of a seeding
        // boot is one statement's arrays, not the whole state's).
        async {
            let mut sent = 0;
            for chunk in machines.chunks(ROWS_PER_STATEMENT) {
                sent += send_machines(client, &upsert_machines, chunk).await?;
            }
            Ok::<u64, tokio_postgres::Error>(sent)
        },
        async {
            let mut sent = 0;
            for chunk in fences.chunks(ROWS_PER_STATEMENT) {
                sent += send_fences(client, &upsert_fences, chunk).await?;
            }
            Ok::<u64, tokio_postgres::Error>(sent)
        },
    );
    begun?;
    locked?;
    let found: i64 = owner?.get(0);
    let mine = match plan.owner {
        Owner::Lease(epoch) | Owner::Writer(epoch) => epoch,
    };
    if found != mine {
        client.batch_execute("ROLLBACK").await?;
        return Ok(Found::OwnerMoved { found });
    }
    round?;
    pruned?;
    machines_sent?;
    fences_sent?;
    plan.flushing.store(true, Ordering::Release);
    shared.wake.notify_one();
    client.batch_execute("COMMIT").await?;
    Ok(Found::Committed)
}

#[cfg(test)]
mod tests {
    //! Rounds against a real PostgreSQL (skipped without one, failed under
    //! CI: provider-testkit's `postgres`).
    use super::*;
    use crate::pool::build_pool;
    use crate::{schema, PgOptions, Target};
    use provider_testkit::postgres::TestSchema;
    use provider_testkit::store_contract::{machine, mark, record};
    use providerkit::State;

    /// A fresh state with the schema, a leader's store at lease epoch 0
    /// and a pool on it; `None` when the tests skip.
    async fn fresh() -> Option<(TestSchema, Shared, Pool)> {
        let schema = provider_testkit::postgres::fresh()?;
        let shared = Shared::new("test".into(), Some(0));
        let target = Target::parse(&schema.url).expect("target");
        let pool = build_pool(&target, &PgOptions::default(), 2).expect("pool");
        let mut client = pool.get().await.expect("connect");
        schema::prepare(&shared.target, &mut client, true)
            .await
            .expect("schema");
        Some((schema, shared, pool))
    }

    fn plan(number: i64) -> RoundPlan {
        RoundPlan {
            number,
            owner: Owner::Lease(0),
            prune_below: None,
            flushing: Arc::default(),
        }
    }

    /// `outcome` must be a landing; otherwise the failure says why.
    fn assert_landed(outcome: Outcome, by_reading: bool) {
        match outcome {
            Outcome::Landed { by_reading: found } => assert_eq!(found, by_reading),
            Outcome::NotLanded(e) => panic!("not landed: {e}"),
            Outcome::Unknown(e) => panic!("unknown: {e}"),
        }
    }

    fn rows(id: &str, rev: u64, stamp: i64) -> Rows {
        let mut rows = Rows::default();
        rows.stamp(vec![machine(record(id, rev, State::Idle))], stamp);
        rows
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn an_older_round_that_lands_late_leaves_the_newer_row() {
        let Some((schema, shared, pool)) = fresh().await else {
            return;
        };
        // Round 6 carries the newer version and lands first; round 5,
        // formed earlier, lands after it.
        let newer = commit_round(&shared, &pool, &plan(6), &rows("m-1", 9, 6)).await;
        assert_landed(newer, false);
        let older = commit_round(&shared, &pool, &plan(5), &rows("m-1", 3, 5)).await;
        assert_landed(older, false);
        let row = schema.query_i64("SELECT rev FROM bigfleet_machines WHERE id = 'm-1'");
        assert_eq!(
            row, 9,
            "the late older version must not replace the newer one"
        );
        assert_eq!(
            schema.query_i64("SELECT round FROM bigfleet_machines WHERE id = 'm-1'"),
            6
        );
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_round_of_the_same_number_by_another_writer_is_not_taken_for_ours() {
        let Some((_schema, next, pool)) = fresh().await else {
            return;
        };
        let deposed = Shared::new("deposed".into(), Some(0));
        let landed = commit_round(&next, &pool, &plan(7), &rows("m-1", 1, 7)).await;
        assert_landed(landed, false);
        assert!(round_landed(&next, &pool, 7).await.expect("read"));
        assert!(
            !round_landed(&deposed, &pool, 7).await.expect("read"),
            "round 7 is the next writer's, not the deposed one's"
        );
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_prune_keeps_the_rounds_that_may_still_be_read() {
        let Some((schema, shared, pool)) = fresh().await else {
            return;
        };
        for number in 1..=3 {
            let outcome =
                commit_round(&shared, &pool, &plan(number), &rows("m-1", 1, number)).await;
            assert_landed(outcome, false);
        }
        let pruning = RoundPlan {
            prune_below: Some(3),
            ..plan(4)
        };
        let outcome = commit_round(&shared, &pool, &pruning, &rows("m-2", 1, 4)).await;
        assert_landed(outcome, false);
        assert_eq!(
            schema.query_i64("SELECT count(*) FROM bigfleet_commits WHERE round < 3"),
            0
        );
        assert!(round_landed(&shared, &pool, 3).await.expect("read"));
        assert!(round_landed(&shared, &pool, 4).await.expect("read"));
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_round_larger_than_one_statement_writes_every_row() {
        let Some((schema, shared, pool)) = fresh().await else {
            return;
        };
        // Two and a bit statements of machines, one and a bit of marks.
        let machines = 2 * ROWS_PER_STATEMENT + 1;
        let fences = ROWS_PER_STATEMENT + 1;
        let mut changes: Vec<Change> = (0..machines)
            .map(|i| machine(record(&format!("m-{i}"), i as u64 + 1, State::Idle)))
            .collect();
        changes.extend((0..fences).map(|i| Change::Fence(mark("s-1", &format!("m-{i}"), 1, 1))));
        let mut big = Rows::default();
        big.stamp(changes, 1);
        assert_landed(commit_round(&shared, &pool, &plan(1), &big).await, false);
        assert_eq!(
            schema.query_i64("SELECT count(*) FROM bigfleet_machines"),
            machines as i64
        );
        assert_eq!(
            schema.query_i64("SELECT count(*) FROM bigfleet_fences"),
            fences as i64
        );
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_round_under_a_taken_lease_writes_nothing() {
        let Some((schema, shared, pool)) = fresh().await else {
            return;
        };
        schema.admin("UPDATE bigfleet_lease SET epoch = 2");
        let outcome = commit_round(&shared, &pool, &plan(1), &rows("m-1", 1, 1)).await;
        let Outcome::NotLanded(error) = outcome else {
            panic!("a deposed writer's round must not land");
        };
        assert!(
            error.to_string().contains("the lease is at epoch 2"),
            "{error}"
        );
        assert_eq!(
            schema.query_i64("SELECT count(*) FROM bigfleet_machines"),
            0
        );
        assert_eq!(
            schema.query_i64("SELECT count(*) FROM bigfleet_commits WHERE writer <> 0"),
            0
        );
    }
}
