//! The ledger: the one lock the engine's state is behind, and the store
//! every change to it is queued to.
//!
//! One lock, because an acceptance reads and writes the fencing marks and
//! the machine together, and every change must reach the store in the
//! order it was made: a part that changes the books submits its changes
//! before it releases the write guard. Critical sections are short and
//! never await: substrate work runs in spawned tasks and re-enters the
//! lock only to land its outcome, and durability is awaited after the lock
//! is released (see [`crate::store`]).

use std::sync::Arc;

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::fencing::Fences;
use super::machines::Machines;
use crate::store::{Change, Store, StoreError, Ticket};

/// What the lock guards.
pub(super) struct Books {
    pub(super) machines: Machines,
    pub(super) fences: Fences,
}

pub(super) struct Ledger {
    books: RwLock<Books>,
    store: Arc<dyn Store>,
}

impl Ledger {
    pub(super) fn new(books: Books, store: Arc<dyn Store>) -> Ledger {
        Ledger {
            books: RwLock::new(books),
            store,
        }
    }

    pub(super) fn read(&self) -> RwLockReadGuard<'_, Books> {
        self.books.read()
    }

    pub(super) fn write(&self) -> RwLockWriteGuard<'_, Books> {
        self.books.write()
    }

    /// Queue `changes` for the store. Called with the write guard held
    /// (see the module's note); an empty batch is a barrier: its ticket is
    /// durable once everything queued before it is.
    pub(super) fn submit(&self, changes: Vec<Change>) -> Ticket {
        self.store.submit(changes)
    }

    /// Wait until the changes behind `ticket` are durable.
    pub(super) async fn durable(&self, ticket: Ticket) -> Result<(), StoreError> {
        self.store.durable(ticket).await
    }

    /// Whether the store can commit now (see [`Store::health`]).
    pub(super) fn health(&self) -> Result<(), StoreError> {
        self.store.health()
    }
}
