//! The in-memory [`Store`]: the engine's memory is the state and nothing
//! survives the process (the fake backend's default). With
//! [`MemoryStore::retaining`] it keeps every change, so tests can restart an
//! engine on it and copy it like a durable state.
//!
//! A module of its own, above both the store contract and `state_copy`: it
//! implements both, and neither needs to know of it.

use std::collections::HashMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use parking_lot::Mutex;

use crate::model::MachineRecord;
use crate::state_copy::{RestoreError, StateDump};
use crate::store::{Change, FenceMark, Loaded, Store, StoreError, Ticket};

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

impl MemoryInner {
    /// The whole state as held: records in revision order, every mark, the
    /// generation (a load and a dump read the same).
    fn state(&self) -> Loaded {
        let mut machines: Vec<MachineRecord> =
            self.machines.values().map(|m| (**m).clone()).collect();
        machines.sort_by_key(|m| m.rev);
        Loaded {
            machines,
            fences: self.fences.values().cloned().collect(),
            boot_generation: self.generation,
        }
    }
}

/// The in-memory store copies too: what providerkit's own tests of
/// `state_copy` copy, and a model of what a durable store does.
impl StateDump for MemoryStore {
    fn dump(&self) -> Result<Loaded, StoreError> {
        Ok(self.inner.lock().state())
    }

    /// A restore is explicit, so it keeps the state even in a store that
    /// does not retain changes.
    fn restore(&self, state: &Loaded) -> Result<(), RestoreError> {
        let mut inner = self.inner.lock();
        if !inner.machines.is_empty() || !inner.fences.is_empty() {
            return Err(RestoreError::NotEmpty {
                target: "memory".to_string(),
                machines: inner.machines.len() as u64,
                fence_marks: inner.fences.len() as u64,
            });
        }
        for record in &state.machines {
            inner
                .machines
                .insert(record.id.clone(), Arc::new(record.clone()));
        }
        for mark in &state.fences {
            inner.fences.insert(
                (mark.shard_id.clone(), mark.machine_id.clone()),
                mark.clone(),
            );
        }
        inner.generation = inner.generation.max(state.boot_generation);
        Ok(())
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
        Ok(inner.state())
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
