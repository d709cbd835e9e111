//! What is in the database: the versioned schema, created or migrated at
//! start-up under an advisory lock (two providers starting at once migrate
//! once), and the checks that refuse a schema from a newer build.

use providerkit::StoreError;
use tokio_postgres::Client;

use crate::error::pg_error;

/// The schema this build writes. Older schemas are migrated forward at
/// start-up.
pub const SCHEMA_VERSION: i64 = 3;

/// The advisory lock key migrations run under ("bigfleet" in ASCII).
const MIGRATION_LOCK: i64 = 0x6269_6766_6c65_6574;

/// `MIGRATIONS[n]` takes a database from schema `n` to `n + 1`. Table
/// names carry a `bigfleet_` prefix: the database may hold other things.
/// The fence marks' keys are `bytea`: a shard id is the client's text and
/// PostgreSQL's `text` cannot hold a NUL.
const MIGRATIONS: &[&str] = &[
    // 0 -> 1: the initial schema, with the transition windows (wall-clock
    // milliseconds; NULL outside a transition) that SQLite's schema 2 added.
    // `commit_seq` counted commits: each commit advanced it in the same
    // transaction, so a commit whose answer was lost was resolved by
    // reading (schema 3 replaces it).
    "CREATE TABLE bigfleet_meta (
         id INTEGER PRIMARY KEY CHECK (id = 1),
         schema_version BIGINT NOT NULL,
         boot_generation BIGINT NOT NULL,
         commit_seq BIGINT NOT NULL
     );
     INSERT INTO bigfleet_meta (id, schema_version, boot_generation, commit_seq)
         VALUES (1, 0, 0, 0);
     CREATE TABLE bigfleet_machines (
         id TEXT PRIMARY KEY,
         rev BIGINT NOT NULL,
         record BYTEA NOT NULL,
         op_create TEXT,
         op_configure TEXT,
         op_drain TEXT,
         op_delete TEXT,
         started_ms BIGINT,
         deadline_ms BIGINT,
         grace_ms BIGINT
     );
     CREATE TABLE bigfleet_fences (
         shard_id BYTEA NOT NULL,
         machine_id BYTEA NOT NULL,
         epoch BIGINT NOT NULL,
         sequence BIGINT NOT NULL,
         PRIMARY KEY (shard_id, machine_id)
     );",
    // 1 -> 2: the leader lease. One row; `epoch` grows with every new
    // holder and every commit checks it (see `lease` and `writer`).
    // `expires_at` is the database's clock, so replicas never compare
    // their own clocks; '-infinity' is a lease nobody holds.
    "CREATE TABLE bigfleet_lease (
         id INTEGER PRIMARY KEY CHECK (id = 1),
         epoch BIGINT NOT NULL,
         holder TEXT NOT NULL,
         expires_at TIMESTAMPTZ NOT NULL
     );
     INSERT INTO bigfleet_lease (id, epoch, holder, expires_at)
         VALUES (1, 0, '', '-infinity');",
    // 2 -> 3: commits in flight side by side (see `commit` and `writer`).
    // A commit inserts its round number into `bigfleet_commits` instead of
    // advancing one counter that every commit would have to lock in turn;
    // rows carry the stamp of the round that wrote them, and only a higher
    // stamp replaces a row. The counter becomes the generation of writers
    // without a lease: each one advances it when it opens the state, and
    // its commits check it. Every commit rewrites whole rows without
    // touching their keys: room left in each page (fillfactor) lets the new
    // version stay on its page with no index entry to add (a HOT update).
    // `writer` names the store that committed a round (a random number
    // drawn when it opens), so a deposed writer reading whether its round
    // landed never mistakes the next leader's round of the same number.
    "CREATE TABLE bigfleet_commits (round BIGINT PRIMARY KEY, writer BIGINT NOT NULL);
     INSERT INTO bigfleet_commits (round, writer) SELECT commit_seq, 0 FROM bigfleet_meta;
     ALTER TABLE bigfleet_meta RENAME COLUMN commit_seq TO writer_generation;
     ALTER TABLE bigfleet_machines ADD COLUMN round BIGINT NOT NULL DEFAULT 0;
     ALTER TABLE bigfleet_fences ADD COLUMN round BIGINT NOT NULL DEFAULT 0;
     ALTER TABLE bigfleet_machines SET (fillfactor = 70);
     ALTER TABLE bigfleet_fences SET (fillfactor = 70);",
];

/// What the database held before start-up.
pub(crate) struct Opened {
    pub(crate) created: bool,
    /// The highest round number committed: this writer's rounds go above.
    pub(crate) last_round: i64,
    /// The writer generation this store opened the state at, when it
    /// writes without a lease.
    pub(crate) writer_generation: Option<i64>,
    pub(crate) machines: u64,
    pub(crate) fence_marks: u64,
}

/// What to do with a database that holds no state schema.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IfAbsent {
    /// Create it (a provider's first start on a new database).
    Create,
    /// Leave the database untouched and answer `None` (reading a state
    /// that must already be there, as `state copy --from`).
    Leave,
}

/// Create the schema if the database has none, migrate an older one, and
/// refuse a newer one; all in one transaction under the migration lock.
///
/// A store that writes without a lease (`leased` false) advances the
/// writer generation in the same transaction: a writer that opened the
/// state before finds it moved at its next commit.
pub(crate) async fn prepare(
    target: &str,
    client: &mut Client,
    leased: bool,
) -> Result<Opened, StoreError> {
    prepare_if(target, client, leased, IfAbsent::Create)
        .await?
        .ok_or_else(|| vanished(target))
}

/// [`IfAbsent::Create`] answered that there is no schema: only a database
/// that dropped it in between could.
pub(crate) fn vanished(target: &str) -> StoreError {
    StoreError::corrupt(format!(
        "PostgreSQL state {target}: the schema is missing right after its creation"
    ))
}

/// The schema version of the state in this database, `None` when it holds
/// none; a version newer than this build's is refused.
async fn stored_version(
    target: &str,
    tx: &tokio_postgres::Transaction<'_>,
) -> Result<Option<i64>, StoreError> {
    let exists: bool = tx
        .query_one("SELECT to_regclass('bigfleet_meta') IS NOT NULL", &[])
        .await
        .map_err(|e| pg_error(target, "cannot read the schema", e))?
        .get(0);
    if !exists {
        return Ok(None);
    }
    let version: i64 = tx
        .query_one("SELECT schema_version FROM bigfleet_meta WHERE id = 1", &[])
        .await
        .map_err(|e| pg_error(target, "cannot read the schema version", e))?
        .get(0);
    if version > SCHEMA_VERSION {
        return Err(StoreError::incompatible(format!(
            "PostgreSQL state {target} was written by a newer version (schema {version}, this \
             build knows up to {SCHEMA_VERSION})"
        )));
    }
    Ok(Some(version))
}

/// The whole state at `target`, read without writing anything: for
/// `state copy --from`, whose source must stay as it was (a rollback to the
/// release that wrote it must still read it, and a provider that owns it
/// must not find its writer generation moved). An older schema is migrated
/// inside the read's own transaction, which is then rolled back, so the
/// source never sees it. `None` when the database holds no state.
pub(crate) async fn read_unchanged(
    target: &str,
    client: &mut Client,
) -> Result<Option<providerkit::Loaded>, StoreError> {
    let err = |action: &str| {
        let action = action.to_string();
        move |e| pg_error(target, &action, e)
    };
    let tx = client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .start()
        .await
        .map_err(err("cannot start the read transaction"))?;
    let Some(version) = stored_version(target, &tx).await? else {
        return Ok(None);
    };
    for (from, sql) in MIGRATIONS.iter().enumerate().skip(version.max(0) as usize) {
        let to = from as i64 + 1;
        tx.batch_execute(sql)
            .await
            .map_err(err(&format!("cannot read schema {from} as {to}")))?;
    }
    let loaded = crate::decode::load_state(target, &tx).await?;
    tx.rollback()
        .await
        .map_err(err("cannot end the read transaction"))?;
    Ok(Some(loaded))
}

/// [`prepare`], or `None` with nothing written when the database holds no
/// state and `absent` says to leave it so.
pub(crate) async fn prepare_if(
    target: &str,
    client: &mut Client,
    leased: bool,
    absent: IfAbsent,
) -> Result<Option<Opened>, StoreError> {
    let err = |action: &str| {
        let action = action.to_string();
        move |e| pg_error(target, &action, e)
    };
    let tx = client
        .transaction()
        .await
        .map_err(err("cannot start the schema transaction"))?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await
        .map_err(err("cannot take the migration lock"))?;
    let stored = stored_version(target, &tx).await?;
    let exists = stored.is_some();
    if !exists && absent == IfAbsent::Leave {
        // Dropping the transaction rolls it back: only the advisory lock
        // was taken.
        return Ok(None);
    }
    let version = stored.unwrap_or(0);
    for (from, sql) in MIGRATIONS.iter().enumerate().skip(version.max(0) as usize) {
        let to = from as i64 + 1;
        let action = format!("cannot migrate schema {from} to {to}");
        tx.batch_execute(sql).await.map_err(err(&action))?;
        tx.execute("UPDATE bigfleet_meta SET schema_version = $1", &[&to])
            .await
            .map_err(err(&action))?;
    }
    let writer_generation = if leased {
        None
    } else {
        let row = tx
            .query_one(
                "UPDATE bigfleet_meta SET writer_generation = writer_generation + 1
                 WHERE id = 1 RETURNING writer_generation",
                &[],
            )
            .await
            .map_err(err("cannot open the state as its writer"))?;
        Some(row.get(0))
    };
    let row = tx
        .query_one(
            "SELECT (SELECT COALESCE(max(round), 0) FROM bigfleet_commits),
                    (SELECT count(*) FROM bigfleet_machines),
                    (SELECT count(*) FROM bigfleet_fences)",
            &[],
        )
        .await
        .map_err(err("cannot read the state"))?;
    let count = |i: usize| u64::try_from(row.get::<_, i64>(i)).unwrap_or(0);
    let opened = Opened {
        created: !exists,
        last_round: row.get(0),
        writer_generation,
        machines: count(1),
        fence_marks: count(2),
    };
    tx.commit().await.map_err(err("cannot commit the schema"))?;
    Ok(Some(opened))
}
