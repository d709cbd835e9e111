//! The contract engine: every rule of the wire contract, in one place.
//!
//! All state lives behind one `RwLock`. Critical sections are short and
//! never await: substrate work runs in spawned tasks and re-enters the lock
//! only to land its outcome, and durability is awaited after the lock is
//! released (see [`crate::store`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bigfleet_proto::raw::EncodedMachine;
use bigfleet_proto::v1alpha1 as pb;
use parking_lot::RwLock;
use zeroize::Zeroizing;

use crate::backend::{
    Backend, BackendError, ConfigureCtx, CreateCtx, DeleteCtx, DrainCtx, SlotSpec, SubstrateHost,
};
use crate::cursor::CursorCodec;
use crate::error::KitError;
use crate::fence::Token;
use crate::model::{MachineRecord, State, TransitionKind};
use crate::store::{Change, Store, StoreError};

/// Slots applied per hold of the state lock during a reconcile pass.
mod accept;
mod list;
mod mutants;
mod options;
mod reclaim;
mod resume;
mod running;
mod worker;

pub use list::ListPage;
#[cfg(feature = "mutants")]
pub use options::Mutants;
pub use options::{echo_prefix, EngineOptions, Limits, Timeouts, ECHO_PREFIX_CHARS};
pub use reclaim::{Census, ReclaimError, ReclaimHandle, ReclaimOutcome, ReclaimSweeper};
pub use running::ResumeOutcome;

const INVENTORY_BATCH: usize = 2048;

/// What one reconcile pass changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    pub added: usize,
    pub refreshed: usize,
    /// FAILED machines whose host was set or changed to the one the
    /// substrate found marked for them.
    pub reattached: usize,
    /// FAILED machines whose host no longer exists, host cleared.
    pub detached: usize,
}

/// The accepted (or idempotently repeated) transition.
#[derive(Clone, Debug)]
pub struct Ack {
    pub operation_id: String,
    /// The machine as of the ack (a snapshot; the engine moves on).
    pub machine: Arc<MachineRecord>,
}

/// Request parameters that differ per transition.
enum Params {
    Create,
    Configure {
        cluster_id: String,
        bootstrap_blob: Zeroizing<Vec<u8>>,
        shard_metadata: HashMap<String, String>,
    },
    Drain {
        grace: Duration,
    },
    Delete,
}

impl Params {
    fn kind(&self) -> TransitionKind {
        match self {
            Params::Create => TransitionKind::Create,
            Params::Configure { .. } => TransitionKind::Configure,
            Params::Drain { .. } => TransitionKind::Drain,
            Params::Delete => TransitionKind::Delete,
        }
    }
}

/// Substrate work handed to a background task once a transition is accepted.
enum Work {
    Create(CreateCtx),
    Configure(ConfigureCtx),
    /// A Configure resumed after a restart: its blob was never stored, so
    /// all that is left is to wait for the node to report ready.
    AwaitReady(ConfigureCtx),
    Drain(DrainCtx),
    Delete(DeleteCtx),
}

impl Work {
    /// The machine and operation the work is for.
    fn ids(&self) -> (String, String) {
        match self {
            Work::Create(c) => (c.machine_id.clone(), c.operation_id.clone()),
            Work::Configure(c) | Work::AwaitReady(c) => {
                (c.machine_id.clone(), c.operation_id.clone())
            }
            Work::Drain(c) => (c.machine_id.clone(), c.operation_id.clone()),
            Work::Delete(c) => (c.machine_id.clone(), c.operation_id.clone()),
        }
    }
}

enum Outcome {
    Created(SubstrateHost),
    Done,
}

#[derive(Default)]
struct Inner {
    /// Shared with List snapshots and the store; changed copy-on-write.
    machines: Vec<Arc<MachineRecord>>,
    index: HashMap<String, usize>,
    /// rev -> machine slot; every machine appears exactly once.
    by_rev: BTreeMap<u64, usize>,
    revision: u64,
    /// shard_id -> machine_id -> (epoch, sequence).
    fences: HashMap<String, HashMap<String, (i64, i64)>>,
    /// machine_id -> how many shards hold a mark on it (for the cap).
    shard_marks: HashMap<String, usize>,
}

impl Inner {
    /// Add a machine; returns its slot.
    fn insert(&mut self, record: MachineRecord) -> usize {
        let slot = self.machines.len();
        self.index.insert(record.id.clone(), slot);
        self.by_rev.insert(record.rev, slot);
        self.revision = self.revision.max(record.rev);
        self.machines.push(Arc::new(record));
        slot
    }

    /// The record in `slot`, for changing (copied only if a reader holds it).
    fn record_mut(&mut self, slot: usize) -> &mut MachineRecord {
        Arc::make_mut(&mut self.machines[slot])
    }

    /// The revision the next visible change gets.
    fn next_rev(&self) -> u64 {
        self.revision + 1
    }

    /// Put `record` (a transition's result) in `slot`, its revision indexed,
    /// and return the change to persist.
    fn replace(&mut self, slot: usize, record: MachineRecord) -> Change {
        let old = self.machines[slot].rev;
        if old != record.rev {
            self.by_rev.remove(&old);
            self.by_rev.insert(record.rev, slot);
        }
        self.revision = self.revision.max(record.rev);
        self.machines[slot] = Arc::new(record);
        Change::Machine(Arc::clone(&self.machines[slot]))
    }

    /// Give the machine in `slot` a fresh revision (after a visible change)
    /// and return the change to persist.
    fn bump(&mut self, slot: usize) -> Change {
        self.revision += 1;
        let revision = self.revision;
        let old = self.machines[slot].rev;
        self.by_rev.remove(&old);
        self.record_mut(slot).rev = revision;
        self.by_rev.insert(revision, slot);
        Change::Machine(Arc::clone(&self.machines[slot]))
    }
}

pub struct Engine {
    backend: Arc<dyn Backend>,
    store: Arc<dyn Store>,
    opts: EngineOptions,
    inner: RwLock<Inner>,
    cursor: CursorCodec,
    generation: u64,
    next_op: AtomicU64,
    /// Where the next capped, cursor-less List starts: the revision of the
    /// head the previous one returned.
    list_head: AtomicU64,
    supports_delete: bool,
    /// One reclaim at a time: it is a rare operator action, and serialising
    /// it means two reclaims never destroy the same machine's hosts at once.
    reclaims: tokio::sync::Mutex<()>,
    /// Transitions found in flight at load time, until [`Engine::resume`].
    pending_resumes: parking_lot::Mutex<Vec<resume::Pending>>,
    resumed: running::ResumeCounters,
    in_flight: Arc<running::InFlightCount>,
    /// Set when shutdown begins: mutations are refused from then on.
    stopping: std::sync::atomic::AtomicBool,
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
        let mut inner = Inner::default();
        let mut recovered = Vec::new();
        let mut pending = Vec::new();
        let counters = running::ResumeCounters::default();
        let now_ms = crate::model::wall_clock_ms();
        let readiness = backend.supports_readiness();
        for record in loaded.machines {
            let record = match resume::on_load(&record, now_ms, readiness) {
                Some(resume::Found::End(failed, kind, outcome)) => {
                    counters.add(kind, outcome);
                    recovered.push((failed.id.clone(), failed.last_error.clone()));
                    failed
                }
                Some(resume::Found::Resume(p)) => {
                    pending.push(p);
                    record
                }
                // Not in a transition: loaded as stored.
                None => record,
            };
            inner.insert(record);
        }
        for mark in loaded.fences {
            *inner
                .shard_marks
                .entry(mark.machine_id.clone())
                .or_default() += 1;
            inner
                .fences
                .entry(mark.shard_id)
                .or_default()
                .insert(mark.machine_id, (mark.epoch, mark.sequence));
        }
        let supports_delete = backend.supports_delete();
        let engine = Arc::new(Engine {
            backend,
            store,
            opts,
            inner: RwLock::new(inner),
            cursor: CursorCodec::new(loaded.boot_generation),
            generation: loaded.boot_generation,
            next_op: AtomicU64::new(1),
            list_head: AtomicU64::new(0),
            supports_delete,
            reclaims: tokio::sync::Mutex::new(()),
            pending_resumes: parking_lot::Mutex::new(pending),
            resumed: counters,
            in_flight: Arc::default(),
            stopping: std::sync::atomic::AtomicBool::new(false),
        });
        // Interrupted transitions get a fresh revision so delta readers see them.
        let ticket = {
            let mut inner = engine.inner.write();
            let mut changes = Vec::new();
            for (id, _) in &recovered {
                if let Some(&slot) = inner.index.get(id) {
                    changes.push(inner.bump(slot));
                }
            }
            engine.store.submit(changes)
        };
        engine
            .store
            .durable(ticket)
            .await
            .map_err(StartError::Store)?;
        for (id, why) in &recovered {
            tracing::warn!(machine_id = %id, error = %why, "transition interrupted by restart recovered as FAILED");
        }
        let specs = engine
            .backend
            .describe()
            .await
            .map_err(StartError::Backend)?;
        engine
            .apply_inventory(specs)
            .await
            .map_err(StartError::Store)?;
        Ok(engine)
    }

    pub fn options(&self) -> &EngineOptions {
        &self.opts
    }

    pub fn supports_delete(&self) -> bool {
        self.supports_delete
    }

    pub fn machine_count(&self) -> usize {
        self.inner.read().machines.len()
    }

    /// One background reconcile pass against the substrate.
    pub async fn reconcile(&self) -> Result<ReconcileReport, ReconcileError> {
        let specs = self
            .backend
            .describe()
            .await
            .map_err(ReconcileError::Backend)?;
        self.apply_inventory(specs)
            .await
            .map_err(ReconcileError::Store)
    }

    /// Add new slots and refresh catalogue facts of known ones. Lifecycle
    /// state, host, binding and metadata are the engine's and are never
    /// overwritten, with one exception: a FAILED machine's host follows the
    /// substrate (see [`Engine::reattach`]). Nothing is bumped when nothing
    /// changed.
    async fn apply_inventory(&self, specs: Vec<SlotSpec>) -> Result<ReconcileReport, StoreError> {
        let mut report = ReconcileReport::default();
        let mut ticket = None;
        let mut specs = specs.into_iter().peekable();
        // In batches, so a pass over a large fleet never holds the lock
        // long enough to stall the RPCs waiting on it.
        while specs.peek().is_some() {
            let mut inner = self.inner.write();
            let mut changes = Vec::new();
            for spec in specs.by_ref().take(INVENTORY_BATCH) {
                self.apply_spec(&mut inner, spec, &mut changes, &mut report);
            }
            ticket = Some(self.store.submit(changes));
        }
        if let Some(ticket) = ticket {
            self.store.durable(ticket).await?;
        }
        Ok(report)
    }

    fn apply_spec(
        &self,
        inner: &mut Inner,
        spec: SlotSpec,
        changes: &mut Vec<Change>,
        report: &mut ReconcileReport,
    ) {
        match inner.index.get(&spec.id).copied() {
            Some(slot) => {
                let current = &inner.machines[slot].facts;
                let shared = Arc::ptr_eq(current, &spec.facts);
                let changed = !shared && !current.same_as(&spec.facts);
                if !shared {
                    // Equal facts from another source (a load) are swapped
                    // for the substrate's copy too, without a bump.
                    inner.record_mut(slot).facts = spec.facts;
                }
                let moved = self.reattach(inner, slot, spec.host.as_ref(), report);
                if changed {
                    report.refreshed += 1;
                }
                if changed || moved || self.mutant_bump_on_reconcile() {
                    changes.push(inner.bump(slot));
                }
            }
            None => {
                let record = self.new_record(spec, inner.revision + 1);
                let slot = inner.insert(record);
                changes.push(Change::Machine(Arc::clone(&inner.machines[slot])));
                report.added += 1;
            }
        }
    }

    /// A FAILED machine's host follows the substrate: the VM marked for it
    /// is attached (so nothing marked is orphaned and a reclaim can find
    /// it), and a host that no longer exists is cleared. No shard mutation
    /// is accepted on a FAILED machine, so nothing else writes its host.
    /// Every other state's host is the engine's alone. True when changed.
    fn reattach(
        &self,
        inner: &mut Inner,
        slot: usize,
        found: Option<&SubstrateHost>,
        report: &mut ReconcileReport,
    ) -> bool {
        let record = &inner.machines[slot];
        if record.state() != State::Failed {
            return false;
        }
        let on_record = record.host.as_ref().map(|h| h.r#ref.as_str());
        let host = match (on_record, found) {
            (Some(have), Some(found)) if have == found.host_ref => return false,
            (None, None) => return false,
            (_, Some(found)) => Some(self.host_ref(found)),
            (Some(_), None) => None,
        };
        let Ok(next) = record.rehosted(host) else {
            return false;
        };
        match (&next.host, on_record) {
            (Some(host), _) => {
                tracing::info!(machine_id = %record.id, host = %host.r#ref, "FAILED machine re-attached to the host marked for it");
                report.reattached += 1;
            }
            (None, gone) => {
                tracing::info!(machine_id = %record.id, host = gone.unwrap_or_default(), "FAILED machine's host no longer exists; host cleared");
                report.detached += 1;
            }
        }
        // The caller bumps the revision once for every change to the slot.
        inner.replace(slot, next);
        true
    }

    fn new_record(&self, spec: SlotSpec, rev: u64) -> MachineRecord {
        let mut record = MachineRecord::new(spec.id, spec.facts, rev);
        if let Some(host) = &spec.host {
            record.state = State::Idle;
            record.host = Some(self.host_ref(host));
        }
        record
    }

    fn host_ref(&self, host: &SubstrateHost) -> pb::HostRef {
        pb::HostRef {
            provider: self.opts.provider.clone(),
            r#ref: host.host_ref.clone(),
        }
    }

    fn mint_operation_id(&self) -> String {
        let n = self.next_op.fetch_add(1, Ordering::Relaxed);
        format!("op-{:x}-{:x}", self.generation, n)
    }

    /// Whether the store can commit now (see [`Store::health`]).
    pub fn store_health(&self) -> Result<(), StoreError> {
        self.store.health()
    }

    /// Wait until everything submitted so far is durable, so a read never
    /// shows state a crash could take back.
    pub async fn read_barrier(&self) -> Result<(), KitError> {
        let ticket = self.store.submit(Vec::new());
        self.store.durable(ticket).await.map_err(KitError::Store)
    }

    /// The current record of one machine.
    pub fn get_record(&self, id: &str) -> Result<Arc<MachineRecord>, KitError> {
        if id.is_empty() {
            return Err(KitError::InvalidArgument("id must not be empty".into()));
        }
        accept::check_len("id", id, self.opts.limits.max_machine_id_bytes)?;
        let inner = self.inner.read();
        let slot = inner
            .index
            .get(id)
            .ok_or_else(|| KitError::NotFound(format!("machine {id:?} not found")))?;
        Ok(Arc::clone(&inner.machines[*slot]))
    }

    /// One machine as a message tree (tests and tools).
    pub fn get(&self, id: &str) -> Result<pb::Machine, KitError> {
        Ok(self.get_record(id)?.to_wire())
    }

    /// One machine, encoded for the wire (what Get serves).
    pub fn get_encoded(&self, id: &str) -> Result<EncodedMachine, KitError> {
        Ok(self.get_record(id)?.encoded())
    }

    pub async fn create(self: &Arc<Self>, id: &str, token: Token) -> Result<Ack, KitError> {
        self.transition(id, token, Params::Create).await
    }

    pub async fn configure(
        self: &Arc<Self>,
        id: &str,
        token: Token,
        cluster_id: String,
        bootstrap_blob: Vec<u8>,
        shard_metadata: HashMap<String, String>,
    ) -> Result<Ack, KitError> {
        self.transition(
            id,
            token,
            Params::Configure {
                cluster_id,
                // Taken over as it is (no copy), and wiped wherever the
                // Configure ends: refused, failed or done.
                bootstrap_blob: Zeroizing::new(bootstrap_blob),
                shard_metadata,
            },
        )
        .await
    }

    pub async fn drain(
        self: &Arc<Self>,
        id: &str,
        token: Token,
        grace_period_seconds: i64,
    ) -> Result<Ack, KitError> {
        if grace_period_seconds < 0 {
            return Err(KitError::InvalidArgument(format!(
                "grace_period_seconds must be >= 0, got {grace_period_seconds}"
            )));
        }
        let grace = Duration::from_secs(grace_period_seconds as u64);
        self.transition(id, token, Params::Drain { grace }).await
    }

    pub async fn delete(self: &Arc<Self>, id: &str, token: Token) -> Result<Ack, KitError> {
        self.transition(id, token, Params::Delete).await
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

/// Why a reconcile pass failed; as [`StartError`], the cause is the source.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("describing the substrate's inventory failed: {0}")]
    Backend(#[source] BackendError),
    #[error("state store: {0}")]
    Store(#[source] StoreError),
}
