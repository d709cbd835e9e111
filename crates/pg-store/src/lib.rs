//! Durable providerkit state in a PostgreSQL database (`--state
//! postgres://...`).
//!
//! [`Store::submit`] only appends to an in-memory queue; one writer task
//! drains everything queued into commit rounds and publishes the highest
//! committed ticket, so one commit acknowledges many concurrent mutations
//! (group commit), as the SQLite store does. Unlike SQLite, several rounds
//! commit at once on separate connections, so the server's WAL flushes
//! overlap (`writer`). Connections come from a bounded pool ([`POOL_SIZE`])
//! that reconnects on demand; a commit whose answer was lost is resolved by
//! reading the round number written in the same transaction, never by
//! writing it again (`commit`). The schema is versioned and created or
//! migrated at start-up (`schema`).
//!
//! The client is `tokio-postgres` (async, the most used PostgreSQL client
//! in Rust, with the `deadpool-postgres` pool); it runs on a small runtime
//! of the store's own thread, so [`Store::load`], which is synchronous,
//! can wait for it from anywhere, and so can `Drop`.
//!
//! Every commit checks that this store still owns the state: under a leader
//! lease (`PgOptions::lease_epoch`, see `lease`) the lease's epoch, and
//! otherwise the writer generation this store advanced when it opened, so
//! a second writer opening the same state makes the first one's commits
//! fail rather than interleave.
//!
//! Modules: `target` (the URL, TLS and the password), `schema` (what is in
//! the database), `writer` (group commit and the rounds in flight),
//! `commit` (one round's transaction and the resolution of lost answers),
//! `decode` (loading), `dump` (the whole state out and into an
//! empty one, for `state copy`), `error` (messages).

/// The key of the advisory lock that orders commits against a change of
/// leader (`commit::SHARE_LEASE_LOCK`, `lease::TAKE_LEASE_LOCK`): a class
/// of this store's own (ASCII "bfle") and the lease table's OID, resolved
/// through the connection's search_path, so each state has its own lock.
macro_rules! lease_lock_key {
    () => {
        "1650879589, 'bigfleet_lease'::regclass::oid::int4"
    };
}

mod commit;
mod decode;
mod dump;
mod error;
mod lease;
mod pool;
mod rows;
mod schema;
mod shared;
mod target;
mod writer;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

use deadpool_postgres::Pool;
use futures::future::BoxFuture;
use providerkit::{Change, CommitWaiter, Loaded, Store, StoreError, Ticket};
use tokio::sync::watch;

use crate::commit::Owner;
use crate::error::{pg_error, pool_error};
use crate::pool::build_pool;
use crate::schema::IfAbsent;
use crate::shared::Shared;
use crate::writer::writer_loop;

pub use lease::{Lease, LeaseState, OwnName};
pub use pool::PgOptions;
pub use schema::SCHEMA_VERSION;
pub use target::{is_postgres_url, misread_state, pgpass_lookup, Target, TargetError, Tls};

/// Connections the store keeps at most: one per commit round in flight,
/// one for loads, one for reading a commit's outcome on a fresh connection
/// while a round's is being replaced.
pub const POOL_SIZE: usize = writer::ROUNDS_IN_FLIGHT + 2;

/// What [`PgStore::open`] found, for the start-up log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenReport {
    /// The database had no state schema: it was created.
    pub created: bool,
    /// Machine records in the state when it was opened.
    pub machines: u64,
    /// Fence marks in the state when it was opened.
    pub fence_marks: u64,
}

/// A [`Store`] backed by a PostgreSQL database.
pub struct PgStore {
    target: String,
    report: OpenReport,
    shared: Arc<Shared>,
    pool: Pool,
    waiter: CommitWaiter,
    runtime: tokio::runtime::Handle,
    thread: Option<JoinHandle<()>>,
}

/// The whole state at `target`, read without writing anything (see
/// `schema::read_unchanged`): `state copy --from`. `None` when the database
/// holds no state. Blocks until the database answered.
pub fn read_state(target: &Target, options: &PgOptions) -> Result<Option<Loaded>, StoreError> {
    let name = target.display().to_string();
    let pool = build_pool(target, options, 1)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| {
            StoreError::unavailable(format!(
                "PostgreSQL state {name}: cannot start a runtime to read it: {e}"
            ))
            .with_source(e)
        })?;
    runtime.block_on(async {
        let mut client = pool
            .get()
            .await
            .map_err(|e| pool_error(&name, "cannot connect", e))?;
        schema::read_unchanged(&name, &mut client).await
    })
}

impl PgStore {
    /// Connect, create or migrate the schema to [`SCHEMA_VERSION`], and
    /// start the writer. Blocks until the database answered (or refused).
    pub fn open(target: &Target, options: &PgOptions) -> Result<PgStore, StoreError> {
        PgStore::open_if(target, options, IfAbsent::Create)?
            .ok_or_else(|| schema::vanished(target.display()))
    }

    /// [`PgStore::open`] of a state that must already be there: `None`,
    /// with nothing created or written, when the database holds none (a
    /// wrong database name in `state copy --from` must not leave empty
    /// tables behind).
    pub fn open_existing(
        target: &Target,
        options: &PgOptions,
    ) -> Result<Option<PgStore>, StoreError> {
        PgStore::open_if(target, options, IfAbsent::Leave)
    }

    fn open_if(
        target: &Target,
        options: &PgOptions,
        absent: IfAbsent,
    ) -> Result<Option<PgStore>, StoreError> {
        let name = target.display().to_string();
        let pool = build_pool(target, options, POOL_SIZE)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| {
                StoreError::unavailable(format!(
                    "PostgreSQL state {name}: cannot start the store's runtime: {e}"
                ))
                .with_source(e)
            })?;
        let handle = runtime.handle().clone();
        let shared = Arc::new(Shared::new(name.clone(), options.lease_epoch));
        let (done_tx, done) = watch::channel(0);
        let (opened_tx, opened_rx) = std::sync::mpsc::channel();
        let thread = {
            let shared = Arc::clone(&shared);
            let pool = pool.clone();
            let writer_name = name.clone();
            std::thread::Builder::new()
                .name("pg-store-writer".into())
                .spawn(move || {
                    runtime.block_on(async move {
                        let leased = shared.lease_epoch.is_some();
                        let opened = prepare(&writer_name, &pool, leased, absent).await;
                        let start = opened.as_ref().ok().and_then(Option::as_ref).map(|o| {
                            let owner = match (shared.lease_epoch, o.writer_generation) {
                                (Some(epoch), _) => Owner::Lease(epoch),
                                (None, generation) => Owner::Writer(generation.unwrap_or(0)),
                            };
                            (owner, o.last_round)
                        });
                        // The opener waits for this answer; gone only if it
                        // panicked, and then nobody needs the writer.
                        let _ = opened_tx.send(opened);
                        if let Some((owner, last_round)) = start {
                            writer_loop(shared, pool, owner, done_tx, last_round).await;
                        }
                    });
                })
                .map_err(|e| {
                    StoreError::unavailable(format!(
                        "PostgreSQL state {name}: cannot start the writer thread: {e}"
                    ))
                    .with_source(e)
                })?
        };
        let opened = opened_rx.recv().map_err(|e| {
            StoreError::unavailable(format!(
                "PostgreSQL state {name}: the writer thread stopped while opening: {e}"
            ))
        });
        let opened = match opened.and_then(|o| o) {
            Ok(Some(opened)) => opened,
            // No state to write to, or a failed open: the thread ended
            // without starting a writer.
            other => {
                if thread.join().is_err() {
                    tracing::error!(state = %name, "state store writer thread panicked");
                }
                return other.map(|_| None);
            }
        };
        Ok(Some(PgStore {
            target: name,
            report: OpenReport {
                created: opened.created,
                machines: opened.machines,
                fence_marks: opened.fence_marks,
            },
            waiter: CommitWaiter::new(
                format!("PostgreSQL state {}", shared.target),
                done,
                Arc::clone(&shared.failures),
            ),
            shared,
            pool,
            runtime: handle,
            thread: Some(thread),
        }))
    }

    /// What was found at open.
    pub fn report(&self) -> &OpenReport {
        &self.report
    }

    /// `postgres://USER@HOST:PORT/DB`, never a password.
    pub fn target(&self) -> &str {
        &self.target
    }

    /// Transactions committed so far; submissions per commit shows how
    /// well group commit is batching.
    pub fn commits(&self) -> u64 {
        self.shared.commits.load(Ordering::Relaxed)
    }

    /// Commits whose answer was lost and that a read of the commit's
    /// number found had landed (so they were not written again).
    pub fn commits_resolved_by_reading(&self) -> u64 {
        self.shared.resolved_by_reading.load(Ordering::Relaxed)
    }

    /// Test hook: the next commit lands, but the writer drops its
    /// connection instead of taking the answer (a connection lost between
    /// COMMIT and its reply).
    #[doc(hidden)]
    pub fn lose_next_commit_answer_for_tests(&self) {
        self.shared.lose_next_answer.store(true, Ordering::SeqCst);
    }

    /// Run `work` on the store's runtime and wait for it from this thread
    /// (which may be any thread, inside another runtime or not).
    fn run<T: Send + 'static>(
        &self,
        work: impl std::future::Future<Output = Result<T, StoreError>> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.runtime.spawn(async move {
            // Nobody left to answer only if the caller is gone.
            let _ = tx.send(work.await);
        });
        rx.recv().unwrap_or_else(|_| {
            Err(StoreError::closed(format!(
                "PostgreSQL state {}: the store stopped",
                self.target
            )))
        })
    }
}

async fn prepare(
    name: &str,
    pool: &Pool,
    leased: bool,
    absent: IfAbsent,
) -> Result<Option<schema::Opened>, StoreError> {
    let mut client = pool
        .get()
        .await
        .map_err(|e| pool_error(name, "cannot connect", e))?;
    schema::prepare_if(name, &mut client, leased, absent).await
}

impl Drop for PgStore {
    fn drop(&mut self) {
        // Let the writer commit what is queued (one round), then stop.
        self.shared.queue.lock().shutdown = true;
        self.shared.wake.notify_one();
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!(state = %self.target, "state store writer thread panicked");
            }
        }
    }
}

impl Store for PgStore {
    fn load(&self) -> Result<Loaded, StoreError> {
        let pool = self.pool.clone();
        let name = self.target.clone();
        let lease_epoch = self.shared.lease_epoch;
        self.run(async move {
            let mut client = pool
                .get()
                .await
                .map_err(|e| pool_error(&name, "cannot connect", e))?;
            let tx = client
                .transaction()
                .await
                .map_err(|e| pg_error(&name, "cannot start the load transaction", e))?;
            if let Some(mine) = lease_epoch {
                tx.execute(commit::SHARE_LEASE_LOCK, &[])
                    .await
                    .map_err(|e| pg_error(&name, "cannot lock the leader lease", e))?;
                let found: i64 = tx
                    .query_one(commit::READ_LEASE_EPOCH, &[])
                    .await
                    .map_err(|e| pg_error(&name, "cannot read the leader lease", e))?
                    .get(0);
                if found != mine {
                    return Err(commit::deposed(&name, mine, found));
                }
            }
            tx.execute(
                "UPDATE bigfleet_meta SET boot_generation = boot_generation + 1 WHERE id = 1",
                &[],
            )
            .await
            .map_err(|e| pg_error(&name, "cannot start a new boot generation", e))?;
            let loaded = decode::load_state(&name, &tx).await?;
            tx.commit()
                .await
                .map_err(|e| pg_error(&name, "cannot commit the new boot generation", e))?;
            Ok(loaded)
        })
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
        self.target.clone()
    }

    fn health(&self) -> Result<(), StoreError> {
        self.waiter.health()
    }
}
