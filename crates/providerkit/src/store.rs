//! Durability boundary: every accepted change goes through a [`Store`]
//! before its ack is returned.
//!
//! The engine calls [`Store::submit`] while it holds its state lock (so the
//! order of submissions is the order of changes) and awaits
//! [`Store::durable`] after releasing it, which lets a durable store commit
//! many submissions with one fsync.

use std::collections::HashMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use parking_lot::Mutex;

use crate::model::MachineRecord;

/// Position of a submission in the store's log; durable once committed.
pub type Ticket = u64;

/// The fencing high-water mark of one (shard, machine) pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FenceMark {
    pub shard_id: String,
    pub machine_id: String,
    pub epoch: i64,
    pub sequence: i64,
}

/// One recorded change. A machine record is written whole (it is small);
/// fence marks are separate rows so a fenced-out retry writes only its mark.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    /// The record as of the change, shared with the engine (no copy).
    Machine(Arc<MachineRecord>),
    Fence(FenceMark),
}

/// What a store hands the engine at startup.
#[derive(Clone, Debug, Default)]
pub struct Loaded {
    pub machines: Vec<MachineRecord>,
    pub fences: Vec<FenceMark>,
    /// A number no earlier boot of this state used; operation ids and
    /// cursors embed it so none is ever reused after a restart.
    pub boot_generation: u64,
}

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct StoreError(pub String);

pub trait Store: Send + Sync + 'static {
    /// Load everything and durably start a new boot generation.
    fn load(&self) -> Result<Loaded, StoreError>;

    /// Queue changes in order. Called under the engine's lock: must not block
    /// on I/O. An empty batch returns the latest ticket already issued.
    fn submit(&self, changes: Vec<Change>) -> Ticket;

    /// Resolves once everything up to `ticket` is durable.
    fn durable(&self, ticket: Ticket) -> BoxFuture<'static, Result<(), StoreError>>;

    /// A short description for the startup log (`memory`, `sqlite:/path`).
    fn describe(&self) -> String;
}

/// The in-memory store: nothing survives the process. With `retaining`, it
/// keeps a copy of every change so tests can simulate a restart.
#[derive(Default)]
pub struct MemoryStore {
    inner: Mutex<MemoryInner>,
    retain: bool,
}

#[derive(Default)]
struct MemoryInner {
    ticket: Ticket,
    generation: u64,
    machines: HashMap<String, Arc<MachineRecord>>,
    fences: HashMap<(String, String), FenceMark>,
}

impl MemoryStore {
    /// A volatile store that keeps nothing (the engine's memory is the state).
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    /// A store that keeps every change, so a second engine can load it.
    pub fn retaining() -> MemoryStore {
        MemoryStore {
            retain: true,
            ..MemoryStore::default()
        }
    }
}

impl Store for MemoryStore {
    fn load(&self) -> Result<Loaded, StoreError> {
        let mut inner = self.inner.lock();
        inner.generation = if inner.generation == 0 {
            // Volatile state: a random generation still keeps ids from two
            // process lifetimes apart.
            rand::random::<u32>() as u64 + 1
        } else {
            inner.generation + 1
        };
        let mut machines: Vec<MachineRecord> =
            inner.machines.values().map(|m| (**m).clone()).collect();
        machines.sort_by_key(|m| m.rev);
        Ok(Loaded {
            machines,
            fences: inner.fences.values().cloned().collect(),
            boot_generation: inner.generation,
        })
    }

    fn submit(&self, changes: Vec<Change>) -> Ticket {
        let mut inner = self.inner.lock();
        if changes.is_empty() {
            return inner.ticket;
        }
        inner.ticket += 1;
        if self.retain {
            for change in changes {
                match change {
                    Change::Machine(record) => {
                        inner.machines.insert(record.id.clone(), record);
                    }
                    Change::Fence(mark) => {
                        inner
                            .fences
                            .insert((mark.shard_id.clone(), mark.machine_id.clone()), mark);
                    }
                }
            }
        }
        inner.ticket
    }

    fn durable(&self, _ticket: Ticket) -> BoxFuture<'static, Result<(), StoreError>> {
        Box::pin(async { Ok(()) })
    }

    fn describe(&self) -> String {
        "memory".to_string()
    }
}
