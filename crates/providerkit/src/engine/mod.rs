//! The contract engine: every rule of the wire contract, in one place.
//!
//! [`Engine`] is a composition of parts, each a type that owns its state
//! in a file of its own; a part is handed the parts below it when it is
//! built, and none imports the composition, so each of the methods here is
//! one call into the part that does the work. From the top:
//!
//! - `accept`: the accepting half of a transition (its request checked
//!   by `request`), and whether mutations are still accepted;
//! - `resume`: the transitions a restart interrupted, until started again;
//! - `worker`: the background half (substrate work under the deadline,
//!   the landing), what is in flight (`running`);
//! - `list`: List, its cursor and where the next cursor-less walk starts;
//! - `reclaim`: the way out of FAILED, one at a time;
//! - `inventory`: the substrate's slots merged in at start-up and at each
//!   reconcile pass;
//! - `ledger`: the one lock over the records (`machines`) and the
//!   fencing marks (`fencing`), and the store every change is queued to
//!   under it;
//! - `options`: what the engine is built with.
//!
//! All state lives behind the ledger's one `RwLock`. Critical sections are
//! short and never await; durability is awaited after the lock is released
//! (see [`crate::store`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bigfleet_proto::raw::EncodedMachine;
use bigfleet_proto::v1alpha1 as pb;

use crate::backend::{Backend, BackendError};
use crate::error::KitError;
use crate::fence::Token;
use crate::model::{MachineRecord, TransitionKind};
use crate::store::{Store, StoreError};

mod accept;
mod fencing;
mod inventory;
mod ledger;
mod list;
mod machines;
mod options;
mod reclaim;
mod request;
mod resume;
mod running;
mod worker;

pub use accept::Ack;
pub use inventory::{ReconcileError, ReconcileReport};
pub use list::ListPage;
pub use machines::Census;
pub(crate) use options::humanize;
#[cfg(feature = "mutants")]
pub use options::Mutants;
pub use options::{echo_prefix, EngineOptions, Limits, Timeouts, ECHO_PREFIX_CHARS};
pub use reclaim::{ReclaimError, ReclaimHandle, ReclaimOutcome};
pub use running::ResumeOutcome;

use accept::Acceptor;
use fencing::Fences;
use inventory::Inventory;
use ledger::{Books, Ledger};
use list::Lister;
use machines::Machines;
use reclaim::Reclaims;
use resume::Resumes;
use running::ResumeCounters;
use worker::Worker;

pub struct Engine {
    opts: EngineOptions,
    ledger: Arc<Ledger>,
    inventory: Inventory,
    acceptor: Acceptor,
    worker: Arc<Worker>,
    lister: Lister,
    resumes: Resumes,
    reclaims: Arc<Reclaims>,
}

impl Engine {
    /// [`Engine::load`], then [`Engine::resume`]: the engine with every
    /// transition the previous process left in flight running again.
    pub async fn start(
        backend: Arc<dyn Backend>,
        store: Arc<dyn Store>,
        opts: EngineOptions,
    ) -> Result<Arc<Engine>, StartError> {
        let engine = Engine::load(backend, store, opts).await?;
        engine.resume();
        Ok(engine)
    }

    /// Load the store, merge the substrate's inventory, and make all of it
    /// durable. A transition found in flight stays as stored, to continue
    /// at [`Engine::resume`], unless it cannot continue (its deadline has
    /// passed, or a Configure has no readiness check to finish it): then it
    /// is FAILED, saying why.
    pub async fn load(
        backend: Arc<dyn Backend>,
        store: Arc<dyn Store>,
        opts: EngineOptions,
    ) -> Result<Arc<Engine>, StartError> {
        let loaded = store.load().map_err(StartError::Store)?;
        let resumed = ResumeCounters::default();
        let sorted = Resumes::sort(
            loaded.machines,
            crate::model::wall_clock_ms(),
            backend.supports_readiness(),
            &resumed,
        );
        let mut machines = Machines::default();
        for record in sorted.records {
            machines.insert(record);
        }
        let books = Books {
            machines,
            fences: Fences::load(loaded.fences, &opts),
        };
        let ledger = Arc::new(Ledger::new(books, store));
        let generation = loaded.boot_generation;
        let worker = Arc::new(Worker::new(
            Arc::clone(&ledger),
            Arc::clone(&backend),
            &opts,
            resumed,
        ));
        let engine = Arc::new(Engine {
            inventory: Inventory::new(Arc::clone(&ledger), Arc::clone(&backend), &opts),
            acceptor: Acceptor::new(
                Arc::clone(&ledger),
                Arc::clone(&backend),
                Arc::clone(&worker),
                generation,
                &opts,
            ),
            lister: Lister::new(Arc::clone(&ledger), generation, &opts),
            reclaims: Arc::new(Reclaims::new(
                Arc::clone(&ledger),
                Arc::clone(&backend),
                &opts,
            )),
            resumes: sorted.resumes,
            worker,
            ledger,
            opts,
        });
        Resumes::publish_ended(&engine.ledger, &sorted.ended)
            .await
            .map_err(StartError::Store)?;
        let specs = backend.describe().await.map_err(StartError::Backend)?;
        engine
            .inventory
            .apply(specs)
            .await
            .map_err(StartError::Store)?;
        Ok(engine)
    }

    pub fn options(&self) -> &EngineOptions {
        &self.opts
    }

    pub fn supports_delete(&self) -> bool {
        self.acceptor.supports_delete()
    }

    pub fn machine_count(&self) -> usize {
        self.ledger.read().machines.len()
    }

    /// One background reconcile pass against the substrate (see
    /// `inventory`).
    pub async fn reconcile(&self) -> Result<ReconcileReport, ReconcileError> {
        self.inventory.reconcile().await
    }

    /// Whether the store can commit now (see [`Store::health`]).
    pub fn store_health(&self) -> Result<(), StoreError> {
        self.ledger.health()
    }

    /// Wait until everything submitted so far is durable, so a read never
    /// shows state a crash could take back.
    pub async fn read_barrier(&self) -> Result<(), KitError> {
        let ticket = self.ledger.submit(Vec::new());
        self.ledger.durable(ticket).await.map_err(KitError::Store)
    }

    /// The current record of one machine.
    pub fn get_record(&self, id: &str) -> Result<Arc<MachineRecord>, KitError> {
        if id.is_empty() {
            return Err(KitError::InvalidArgument("id must not be empty".into()));
        }
        options::check_len("id", id, self.opts.limits.max_machine_id_bytes)?;
        let books = self.ledger.read();
        let slot = books
            .machines
            .slot(id)
            .ok_or_else(|| KitError::NotFound(format!("machine {id:?} not found")))?;
        Ok(Arc::clone(books.machines.at(slot)))
    }

    /// One machine as a message tree (tests and tools).
    pub fn get(&self, id: &str) -> Result<pb::Machine, KitError> {
        Ok(self.get_record(id)?.to_wire())
    }

    /// One machine, encoded for the wire (what Get serves).
    pub fn get_encoded(&self, id: &str) -> Result<EncodedMachine, KitError> {
        Ok(self.get_record(id)?.encoded())
    }

    /// List (see `list`: deltas, capped pages, the rotating walk).
    pub fn list(&self, states: &[i32], max_results: i32, since_revision: &[u8]) -> ListPage {
        self.lister.list(states, max_results, since_revision)
    }

    pub async fn create(&self, id: &str, token: Token) -> Result<Ack, KitError> {
        self.acceptor.create(id, token).await
    }

    pub async fn configure(
        &self,
        id: &str,
        token: Token,
        cluster_id: String,
        bootstrap_blob: Vec<u8>,
        shard_metadata: HashMap<String, String>,
    ) -> Result<Ack, KitError> {
        self.acceptor
            .configure(id, token, cluster_id, bootstrap_blob, shard_metadata)
            .await
    }

    pub async fn drain(
        &self,
        id: &str,
        token: Token,
        grace_period_seconds: i64,
    ) -> Result<Ack, KitError> {
        self.acceptor.drain(id, token, grace_period_seconds).await
    }

    pub async fn delete(&self, id: &str, token: Token) -> Result<Ack, KitError> {
        self.acceptor.delete(id, token).await
    }

    /// Start the transitions found in flight at load time (once; later calls
    /// find nothing). Returns how many were resumed.
    pub fn resume(&self) -> usize {
        self.resumes.start(&self.worker, &self.ledger)
    }

    /// Transitions found at start-up, per kind and outcome, since start.
    pub fn resumed_counts(&self) -> Vec<(TransitionKind, ResumeOutcome, u64)> {
        self.worker.resumed_counts()
    }

    /// Refuse every mutation from now on (UNAVAILABLE): the process is
    /// shutting down, and what is in flight is left to land or to resume.
    pub fn stop_accepting(&self) {
        self.acceptor.stop_accepting();
    }

    /// Transitions whose substrate work is running now.
    pub fn transitions_running(&self) -> usize {
        self.worker.running()
    }

    /// Wait until no transition is running, or `bound` passes. Returns how
    /// many were still running (they stay transitional in the store and
    /// resume at the next start).
    pub async fn quiesce(&self, bound: Duration) -> usize {
        self.worker.quiesce(bound).await
    }

    /// Check that `id` can be reclaimed and start the reclaim. Refuses a
    /// machine that is neither FAILED nor already SPECULATIVE.
    pub fn start_reclaim(&self, id: &str) -> Result<ReclaimHandle, ReclaimError> {
        self.reclaims.start(id)
    }

    /// Reclaim `id` and wait for the outcome.
    pub async fn reclaim(&self, id: &str) -> Result<ReclaimOutcome, ReclaimError> {
        self.start_reclaim(id)?.wait().await
    }

    /// Machines by zone and state, every state of every zone present (at 0
    /// when empty). One pass under the read lock; meant for scrape time.
    pub fn census(&self, zones: &[String]) -> Census {
        let by_facts = self.ledger.read().machines.count_by_facts();
        Census::from_counts(zones, by_facts)
    }

    /// Ids of the FAILED machines.
    pub fn failed_ids(&self) -> Vec<String> {
        self.ledger.read().machines.failed_ids()
    }
}

/// Why [`Engine::start`] failed; the store's or the substrate's error is
/// the source, and its text is part of the message.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("state store: {0}")]
    Store(#[source] StoreError),
    #[error("describing the substrate's inventory failed: {0}")]
    Backend(#[source] BackendError),
}
