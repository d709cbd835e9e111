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

use bigfleet_proto::raw::{EncodedMachine, EncodedMachineList, RawMessage};
use bigfleet_proto::v1alpha1 as pb;
use parking_lot::RwLock;
use prost::encoding::{encode_key, encode_varint, encoded_len_varint, WireType};
use tokio::time::Instant;

use crate::backend::{
    Backend, BackendError, ConfigureCtx, CreateCtx, DeleteCtx, DrainCtx, SlotSpec, SubstrateHost,
};
use crate::cursor::{Cursor, CursorCodec, Walk};
use crate::error::KitError;
use crate::fence::Token;
use crate::model::{MachineRecord, State, TransitionKind};
use crate::store::{Change, FenceMark, Store, StoreError, Ticket};

/// Slots applied per hold of the state lock during a reconcile pass.
const INVENTORY_BATCH: usize = 2048;

/// Per-transition deadlines, measured from acceptance.
#[derive(Clone, Debug)]
pub struct Timeouts {
    pub create: Duration,
    pub configure: Duration,
    pub drain: Duration,
    pub delete: Duration,
    /// Pause between node-readiness probes after a successful configure.
    pub readiness_poll: Duration,
}

impl Default for Timeouts {
    fn default() -> Timeouts {
        Timeouts {
            create: Duration::from_secs(8 * 60),
            configure: Duration::from_secs(8 * 60),
            drain: Duration::from_secs(15 * 60),
            delete: Duration::from_secs(5 * 60),
            readiness_poll: Duration::from_secs(2),
        }
    }
}

impl Timeouts {
    pub fn for_kind(&self, kind: TransitionKind) -> Duration {
        match kind {
            TransitionKind::Create => self.create,
            TransitionKind::Configure => self.configure,
            TransitionKind::Drain => self.drain,
            TransitionKind::Delete => self.delete,
        }
    }
}

/// Documented input caps. Beyond them a request is INVALID_ARGUMENT as a
/// whole: nothing is truncated and no transition starts.
#[derive(Clone, Debug)]
pub struct Limits {
    pub max_metadata_entries: usize,
    /// Sum of key and value lengths in bytes.
    pub max_metadata_bytes: usize,
    pub max_bootstrap_blob_bytes: usize,
    pub max_cluster_id_bytes: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_metadata_entries: 1024,
            max_metadata_bytes: 256 * 1024,
            max_bootstrap_blob_bytes: 1024 * 1024,
            max_cluster_id_bytes: 1024,
        }
    }
}

/// Deliberately broken behaviours, compiled only for the certification
/// suite's mutation check (it proves the suite can fail).
#[cfg(feature = "mutants")]
#[derive(Clone, Debug, Default)]
pub struct Mutants {
    pub fence_per_shard: bool,
    pub truncate_metadata: bool,
    pub out_of_position_failed_precondition: bool,
    pub bump_revision_on_reconcile: bool,
    /// A capped, cursor-less List always starts at the same head.
    pub frozen_list_head: bool,
    /// Tokens with a negative epoch or sequence are INVALID_ARGUMENT.
    pub reject_negative_tokens: bool,
}

#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Stamped on every `HostRef.provider`.
    pub provider: String,
    pub timeouts: Timeouts,
    pub limits: Limits,
    #[cfg(feature = "mutants")]
    pub mutants: Mutants,
}

impl Default for EngineOptions {
    fn default() -> EngineOptions {
        EngineOptions {
            provider: "proxmox".to_string(),
            timeouts: Timeouts::default(),
            limits: Limits::default(),
            #[cfg(feature = "mutants")]
            mutants: Mutants::default(),
        }
    }
}

/// What one reconcile pass changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    pub added: usize,
    pub refreshed: usize,
}

/// The accepted (or idempotently repeated) transition.
#[derive(Clone, Debug)]
pub struct Ack {
    pub operation_id: String,
    /// The machine as of the ack (a snapshot; the engine moves on).
    pub machine: Arc<MachineRecord>,
}

/// The answer to a List: a snapshot of the matching records, taken under
/// the lock and encoded after it is released.
#[derive(Clone, Debug)]
pub struct ListPage {
    pub machines: Vec<Arc<MachineRecord>>,
    pub revision: Vec<u8>,
}

impl ListPage {
    /// The `MachineList` encoding, built in one buffer.
    pub fn encode(&self) -> EncodedMachineList {
        let lens: Vec<usize> = self.machines.iter().map(|m| m.wire_len()).collect();
        let body: usize = lens
            .iter()
            .map(|&len| 1 + encoded_len_varint(len as u64) + len)
            .sum();
        let mut buf = Vec::with_capacity(
            body + 2 + encoded_len_varint(self.revision.len() as u64) + self.revision.len(),
        );
        for (machine, len) in self.machines.iter().zip(lens) {
            encode_key(1, WireType::LengthDelimited, &mut buf);
            encode_varint(len as u64, &mut buf);
            machine.encode_wire(&mut buf);
        }
        if !self.revision.is_empty() {
            prost::encoding::bytes::encode(2, &self.revision, &mut buf);
        }
        RawMessage(buf.into())
    }

    /// The page as message trees (tests and tools).
    pub fn to_wire(&self) -> pb::MachineList {
        pb::MachineList {
            machines: self.machines.iter().map(|m| m.to_wire()).collect(),
            revision: self.revision.clone(),
        }
    }
}

/// Request parameters that differ per transition.
enum Params {
    Create,
    Configure {
        cluster_id: String,
        bootstrap_blob: Vec<u8>,
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
    Drain(DrainCtx),
    Delete(DeleteCtx),
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

fn wanted(states: &[i32], machine: &MachineRecord) -> bool {
    states.is_empty() || states.contains(&(machine.state.to_wire() as i32))
}

struct WalkPage {
    machines: Vec<Arc<MachineRecord>>,
    /// The revision of the first machine returned.
    head: Option<u64>,
    next: Cursor,
}

/// One page of a [`Walk`]: revisions above `start`, then around to it.
fn scan_walk(inner: &Inner, states: &[i32], cap: usize, walk: Walk) -> WalkPage {
    let mut machines = Vec::with_capacity(cap.min(inner.machines.len()));
    let mut head = None;
    let Walk {
        start,
        mut pos,
        mut settled,
    } = walk;
    loop {
        // BTreeMap::range panics on an inverted range: phase two is empty
        // once it has reached `start`.
        let range = match settled {
            None => Some(pos.saturating_add(1)..=u64::MAX),
            Some(_) => (pos < start).then(|| pos + 1..=start),
        };
        for (&rev, &slot) in range.into_iter().flat_map(|r| inner.by_rev.range(r)) {
            if machines.len() == cap {
                break;
            }
            let machine = &inner.machines[slot];
            if wanted(states, machine) {
                machines.push(Arc::clone(machine));
                head.get_or_insert(rev);
                pos = rev;
            }
        }
        if machines.len() == cap {
            let next = Cursor::Walk(Walk {
                start,
                pos,
                settled,
            });
            return WalkPage {
                machines,
                head,
                next,
            };
        }
        match settled {
            None => {
                settled = Some(inner.revision);
                pos = 0;
            }
            Some(at) => {
                return WalkPage {
                    machines,
                    head,
                    next: Cursor::Since(at),
                }
            }
        }
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
}

impl Engine {
    /// Load the store, turn interrupted transitions into FAILED, merge the
    /// substrate's inventory, and make all of it durable.
    pub async fn start(
        backend: Arc<dyn Backend>,
        store: Arc<dyn Store>,
        opts: EngineOptions,
    ) -> Result<Arc<Engine>, StartError> {
        let loaded = store.load().map_err(StartError::Store)?;
        let mut inner = Inner::default();
        let mut recovered = Vec::new();
        for mut record in loaded.machines {
            let state = record.state();
            if state.is_transitional() {
                record.set_state(State::Failed);
                record.last_error = format!(
                    "interrupted by a provider restart while {state}; the substrate may hold \
                     a partial result"
                );
                recovered.push(record.id.clone());
            }
            inner.insert(record);
        }
        for mark in loaded.fences {
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
        });
        // Interrupted transitions get a fresh revision so delta readers see them.
        let ticket = {
            let mut inner = engine.inner.write();
            let mut changes = Vec::new();
            for id in &recovered {
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
        for id in &recovered {
            tracing::warn!(machine_id = %id, "transition interrupted by restart recovered as FAILED");
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
    /// overwritten; nothing is bumped when nothing changed.
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
                if changed || self.mutant_bump_on_reconcile() {
                    changes.push(inner.bump(slot));
                    report.refreshed += 1;
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

    #[cfg(feature = "mutants")]
    fn mutant_bump_on_reconcile(&self) -> bool {
        self.opts.mutants.bump_revision_on_reconcile
    }

    #[cfg(not(feature = "mutants"))]
    fn mutant_bump_on_reconcile(&self) -> bool {
        false
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

    /// Wait until everything submitted so far is durable, so a read never
    /// shows state a crash could take back.
    pub async fn read_barrier(&self) -> Result<(), KitError> {
        let ticket = self.store.submit(Vec::new());
        self.store
            .durable(ticket)
            .await
            .map_err(|e| KitError::Store(e.to_string()))
    }

    /// The current record of one machine.
    pub fn get_record(&self, id: &str) -> Result<Arc<MachineRecord>, KitError> {
        if id.is_empty() {
            return Err(KitError::InvalidArgument("id must not be empty".into()));
        }
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

    /// List. With a valid `since_revision` only machines changed after it
    /// are returned, in revision order; when `max_results` cuts the page,
    /// the cursor is the revision of the last machine returned, so the next
    /// page resumes exactly after it: every machine is visited once.
    ///
    /// A capped List without a usable cursor does not always return the
    /// same head: it starts just after the head the previous such List
    /// returned (callers pick machines this way), and its cursor continues
    /// a [`Walk`] around the revision order, so paging stays set-complete.
    pub fn list(&self, states: &[i32], max_results: i32, since_revision: &[u8]) -> ListPage {
        let cap = if max_results > 0 {
            max_results as usize
        } else {
            usize::MAX
        };
        let inner = self.inner.read();
        let walk = match self.cursor.decode_cursor(since_revision) {
            Some(Cursor::Since(since)) => return self.list_since(&inner, states, cap, since),
            None if cap == usize::MAX => return self.list_since(&inner, states, cap, 0),
            Some(Cursor::Walk(walk)) => walk,
            None => {
                let start = self.list_head.load(Ordering::Relaxed);
                Walk {
                    start,
                    pos: start,
                    settled: None,
                }
            }
        };
        let fresh = walk.pos == walk.start && walk.settled.is_none();
        let page = scan_walk(&inner, states, cap, walk);
        if fresh {
            if let Some(head) = page.head {
                self.advance_list_head(head);
            }
        }
        ListPage {
            machines: page.machines,
            revision: self.cursor.encode_cursor(page.next),
        }
    }

    fn list_since(&self, inner: &Inner, states: &[i32], cap: usize, since: u64) -> ListPage {
        let mut machines = Vec::with_capacity(cap.min(inner.machines.len()));
        let mut last_rev = None;
        for (&rev, &slot) in inner.by_rev.range(since.saturating_add(1)..) {
            if machines.len() == cap {
                break;
            }
            let machine = &inner.machines[slot];
            if wanted(states, machine) {
                machines.push(Arc::clone(machine));
                last_rev = Some(rev);
            }
        }
        let cursor_rev = if machines.len() == cap {
            last_rev.unwrap_or(inner.revision)
        } else {
            inner.revision
        };
        ListPage {
            machines,
            revision: self.cursor.encode(cursor_rev),
        }
    }

    #[cfg(feature = "mutants")]
    fn advance_list_head(&self, head: u64) {
        if !self.opts.mutants.frozen_list_head {
            self.list_head.store(head, Ordering::Relaxed);
        }
    }

    #[cfg(not(feature = "mutants"))]
    fn advance_list_head(&self, head: u64) {
        self.list_head.store(head, Ordering::Relaxed);
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
                bootstrap_blob,
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

    fn validate(&self, id: &str, token: &Token, params: &Params) -> Result<(), KitError> {
        if id.is_empty() {
            return Err(KitError::InvalidArgument(
                "machine_id must not be empty".into(),
            ));
        }
        token.validate()?;
        #[cfg(feature = "mutants")]
        if self.opts.mutants.reject_negative_tokens && (token.epoch < 0 || token.sequence < 0) {
            return Err(KitError::InvalidArgument("negative fencing token".into()));
        }
        if let Params::Configure {
            cluster_id,
            bootstrap_blob,
            shard_metadata,
        } = params
        {
            let limits = &self.opts.limits;
            if cluster_id.is_empty() {
                return Err(KitError::InvalidArgument(
                    "cluster_id must not be empty".into(),
                ));
            }
            if cluster_id.len() > limits.max_cluster_id_bytes {
                return Err(KitError::InvalidArgument(format!(
                    "cluster_id is {} bytes; the cap is {}",
                    cluster_id.len(),
                    limits.max_cluster_id_bytes
                )));
            }
            if bootstrap_blob.len() > limits.max_bootstrap_blob_bytes {
                return Err(KitError::InvalidArgument(format!(
                    "bootstrap_blob is {} bytes; the cap is {}",
                    bootstrap_blob.len(),
                    limits.max_bootstrap_blob_bytes
                )));
            }
            if shard_metadata.len() > limits.max_metadata_entries {
                return Err(KitError::InvalidArgument(format!(
                    "shard_metadata has {} entries; the cap is {}",
                    shard_metadata.len(),
                    limits.max_metadata_entries
                )));
            }
            let bytes: usize = shard_metadata.iter().map(|(k, v)| k.len() + v.len()).sum();
            if bytes > limits.max_metadata_bytes {
                return Err(KitError::InvalidArgument(format!(
                    "shard_metadata is {bytes} bytes; the cap is {}",
                    limits.max_metadata_bytes
                )));
            }
        }
        if params.kind() == TransitionKind::Delete && !self.supports_delete {
            return Err(KitError::Unimplemented(
                "this provider cannot delete machines".into(),
            ));
        }
        Ok(())
    }

    /// Fence, then not-found, then idempotency, then position; accept.
    async fn transition(
        self: &Arc<Self>,
        id: &str,
        token: Token,
        params: Params,
    ) -> Result<Ack, KitError> {
        self.validate(id, &token, &params)?;
        let kind = params.kind();
        let mut work = None;
        let (result, ticket) = {
            let mut inner = self.inner.write();
            let mut changes = Vec::new();
            let result = self.decide(&mut inner, id, &token, params, &mut changes, &mut work);
            (result, self.store.submit(changes))
        };
        if let Some(work) = work {
            let engine = Arc::clone(self);
            let deadline = Instant::now() + self.opts.timeouts.for_kind(kind);
            tokio::spawn(async move { engine.run(kind, work, ticket, deadline).await });
        }
        self.store
            .durable(ticket)
            .await
            .map_err(|e| KitError::Store(e.to_string()))?;
        result
    }

    fn fence(
        &self,
        inner: &mut Inner,
        id: &str,
        token: &Token,
        changes: &mut Vec<Change>,
    ) -> Result<(), KitError> {
        if token.is_absent() {
            return Ok(());
        }
        let mark_key = self.fence_key(id);
        let mark = inner
            .fences
            .get(&token.shard_id)
            .and_then(|m| m.get(mark_key))
            .copied();
        if !token.is_newer_than(mark) {
            let (epoch, sequence) = mark.unwrap_or_default();
            return Err(KitError::Fenced(format!(
                "stale fencing token for shard {:?} on machine {id:?}: ({}, {}) is not newer \
                 than ({epoch}, {sequence})",
                token.shard_id, token.epoch, token.sequence
            )));
        }
        let mark = (token.epoch, token.sequence);
        // Keys are allocated only the first time a pair is seen.
        match inner
            .fences
            .get_mut(&token.shard_id)
            .and_then(|marks| marks.get_mut(mark_key))
        {
            Some(slot) => *slot = mark,
            None => {
                inner
                    .fences
                    .entry(token.shard_id.clone())
                    .or_default()
                    .insert(mark_key.to_string(), mark);
            }
        }
        changes.push(Change::Fence(FenceMark {
            shard_id: token.shard_id.clone(),
            machine_id: mark_key.to_string(),
            epoch: token.epoch,
            sequence: token.sequence,
        }));
        Ok(())
    }

    #[cfg(feature = "mutants")]
    fn fence_key<'a>(&self, id: &'a str) -> &'a str {
        if self.opts.mutants.fence_per_shard {
            ""
        } else {
            id
        }
    }

    #[cfg(not(feature = "mutants"))]
    fn fence_key<'a>(&self, id: &'a str) -> &'a str {
        id
    }

    fn out_of_position(&self, message: String) -> KitError {
        #[cfg(feature = "mutants")]
        if self.opts.mutants.out_of_position_failed_precondition {
            return KitError::Fenced(message);
        }
        KitError::Conflict(message)
    }

    fn decide(
        &self,
        inner: &mut Inner,
        id: &str,
        token: &Token,
        params: Params,
        changes: &mut Vec<Change>,
        work: &mut Option<Work>,
    ) -> Result<Ack, KitError> {
        let kind = params.kind();
        self.fence(inner, id, token, changes)?;
        let slot = *inner
            .index
            .get(id)
            .ok_or_else(|| KitError::NotFound(format!("machine {id:?} not found")))?;
        let state = inner.machines[slot].state();
        if state == State::Failed {
            return Err(self.out_of_position(format!(
                "machine {id:?} is FAILED and needs intervention; {} is not accepted (last_error: {})",
                kind.name(),
                inner.machines[slot].last_error
            )));
        }
        if state == kind.via_state() || state == kind.to_state() {
            let record = &inner.machines[slot];
            if let Some(op) = record.op(kind) {
                return Ok(Ack {
                    operation_id: op.to_string(),
                    machine: Arc::clone(record),
                });
            }
            // A machine adopted from the substrate is at Create's target with
            // no Create on record: record one so retries see the same id.
            if kind == TransitionKind::Create && state == State::Idle {
                let op = self.mint_operation_id();
                inner.record_mut(slot).ops[kind.index()] = Some(op.clone());
                let record = Arc::clone(&inner.machines[slot]);
                changes.push(Change::Machine(Arc::clone(&record)));
                return Ok(Ack {
                    operation_id: op,
                    machine: record,
                });
            }
        }
        if state != kind.from_state() {
            return Err(self.out_of_position(format!(
                "machine {id:?} is {state}; {} needs {}",
                kind.name(),
                kind.from_state()
            )));
        }
        let op = self.mint_operation_id();
        let stored_metadata = match &params {
            Params::Configure { shard_metadata, .. } => self.stored_metadata(shard_metadata),
            _ => HashMap::new(),
        };
        let record = inner.record_mut(slot);
        record.set_state(kind.via_state());
        record.last_error.clear();
        record.ops[kind.index()] = Some(op.clone());
        let host_ref = record
            .host
            .as_ref()
            .map(|h| h.r#ref.clone())
            .unwrap_or_default();
        *work = Some(match params {
            Params::Create => {
                // A new cycle: earlier ops no longer describe this machine.
                record.ops = Default::default();
                record.ops[kind.index()] = Some(op.clone());
                Work::Create(CreateCtx {
                    machine_id: id.to_string(),
                    operation_id: op.clone(),
                    instance_type: record.facts.instance_type.clone(),
                    zone: record.facts.zone.clone(),
                })
            }
            Params::Configure {
                cluster_id,
                bootstrap_blob,
                shard_metadata,
            } => {
                record.ops[TransitionKind::Drain.index()] = None;
                record.cluster = cluster_id.clone();
                record.shard_metadata = stored_metadata;
                Work::Configure(ConfigureCtx {
                    machine_id: id.to_string(),
                    operation_id: op.clone(),
                    host_ref,
                    cluster_id,
                    bootstrap_blob,
                    shard_metadata,
                })
            }
            Params::Drain { grace } => Work::Drain(DrainCtx {
                machine_id: id.to_string(),
                operation_id: op.clone(),
                host_ref,
                cluster_id: record.cluster.clone(),
                grace_period: grace,
            }),
            Params::Delete => {
                record.ops[TransitionKind::Create.index()] = None;
                record.ops[TransitionKind::Configure.index()] = None;
                record.ops[TransitionKind::Drain.index()] = None;
                Work::Delete(DeleteCtx {
                    machine_id: id.to_string(),
                    operation_id: op.clone(),
                    host_ref,
                })
            }
        });
        let change = inner.bump(slot);
        changes.push(change);
        Ok(Ack {
            operation_id: op,
            machine: Arc::clone(&inner.machines[slot]),
        })
    }

    #[cfg(feature = "mutants")]
    fn stored_metadata(&self, metadata: &HashMap<String, String>) -> HashMap<String, String> {
        if self.opts.mutants.truncate_metadata {
            return metadata
                .iter()
                .take(8)
                .map(|(k, v)| (k.clone(), v.chars().take(16).collect()))
                .collect();
        }
        metadata.clone()
    }

    #[cfg(not(feature = "mutants"))]
    fn stored_metadata(&self, metadata: &HashMap<String, String>) -> HashMap<String, String> {
        metadata.clone()
    }

    /// The background half of a transition.
    async fn run(
        self: Arc<Self>,
        kind: TransitionKind,
        work: Work,
        ticket: Ticket,
        deadline: Instant,
    ) {
        let (machine_id, operation_id) = match &work {
            Work::Create(c) => (c.machine_id.clone(), c.operation_id.clone()),
            Work::Configure(c) => (c.machine_id.clone(), c.operation_id.clone()),
            Work::Drain(c) => (c.machine_id.clone(), c.operation_id.clone()),
            Work::Delete(c) => (c.machine_id.clone(), c.operation_id.clone()),
        };
        // Never touch the substrate for a transition that is not durable.
        let outcome = match self.store.durable(ticket).await {
            Err(e) => Err(format!(
                "state store write failed before {}: {e}",
                kind.name()
            )),
            Ok(()) => {
                let limit = self.opts.timeouts.for_kind(kind);
                match tokio::time::timeout_at(deadline, self.execute(work)).await {
                    Ok(Ok(outcome)) => Ok(outcome),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err(format!(
                        "{} timed out after {} (deadline exceeded)",
                        kind.name(),
                        humanize(limit)
                    )),
                }
            }
        };
        self.land(kind, &machine_id, &operation_id, outcome).await;
    }

    async fn execute(&self, work: Work) -> Result<Outcome, BackendError> {
        match work {
            Work::Create(ctx) => self.backend.create(ctx).await.map(Outcome::Created),
            Work::Configure(ctx) => {
                self.backend.configure(ctx.clone()).await?;
                if self.backend.supports_readiness() {
                    while !self.backend.node_ready(&ctx).await? {
                        tokio::time::sleep(self.opts.timeouts.readiness_poll).await;
                    }
                }
                Ok(Outcome::Done)
            }
            Work::Drain(ctx) => self.backend.drain(ctx).await.map(|()| Outcome::Done),
            Work::Delete(ctx) => self.backend.delete(ctx).await.map(|()| Outcome::Done),
        }
    }

    /// Land an outcome, unless the transition is no longer the current one
    /// (a late completion after a timeout is discarded).
    async fn land(
        &self,
        kind: TransitionKind,
        id: &str,
        operation_id: &str,
        outcome: Result<Outcome, String>,
    ) {
        let ticket = {
            let mut inner = self.inner.write();
            let Some(&slot) = inner.index.get(id) else {
                return;
            };
            let record = &inner.machines[slot];
            if record.state() != kind.via_state() || record.op(kind) != Some(operation_id) {
                tracing::info!(machine_id = %id, operation_id, "late completion discarded");
                return;
            }
            let host = match &outcome {
                Ok(Outcome::Created(host)) => Some(self.host_ref(host)),
                _ => None,
            };
            let m = inner.record_mut(slot);
            match outcome {
                Ok(_) => {
                    m.state = kind.to_state();
                    match kind {
                        TransitionKind::Create => {
                            if host.is_some() {
                                m.host = host;
                            }
                        }
                        TransitionKind::Configure => {}
                        TransitionKind::Drain => {
                            m.cluster.clear();
                            m.shard_metadata.clear();
                        }
                        TransitionKind::Delete => {
                            m.host = None;
                            m.cluster.clear();
                            m.shard_metadata.clear();
                        }
                    }
                    tracing::info!(machine_id = %id, operation_id, to = %kind.to_state(), "transition landed");
                }
                Err(message) => {
                    m.state = State::Failed;
                    m.last_error = if message.is_empty() {
                        format!(
                            "{} failed without a message from the substrate",
                            kind.name()
                        )
                    } else {
                        message
                    };
                    tracing::warn!(machine_id = %id, operation_id, error = %m.last_error, "transition failed");
                }
            }
            let change = inner.bump(slot);
            self.store.submit(vec![change])
        };
        if let Err(e) = self.store.durable(ticket).await {
            tracing::error!(machine_id = %id, error = %e, "could not persist transition outcome");
        }
    }
}

fn humanize(d: Duration) -> String {
    let secs = d.as_secs();
    if d.subsec_millis() != 0 || secs == 0 {
        format!("{}ms", d.as_millis())
    } else if secs.is_multiple_of(60) {
        format!("{}m", secs / 60)
    } else {
        format!("{secs}s")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("state store: {0}")]
    Store(StoreError),
    #[error("describing the substrate's inventory failed: {0}")]
    Backend(BackendError),
}

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("describing the substrate's inventory failed: {0}")]
    Backend(BackendError),
    #[error("state store: {0}")]
    Store(StoreError),
}
