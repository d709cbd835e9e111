//! `providerkit`: the substrate-agnostic engine behind a BigFleet
//! `CapacityProvider`.
//!
//! A backend implements [`Backend`] (describe inventory, create, configure,
//! drain, optionally delete and a node-readiness probe); the [`Engine`] owns
//! every cross-cutting rule of the wire contract — fencing, idempotency, the
//! position matrix, async dispatch with timeouts, metadata, the revision
//! cursor and durability through a [`Store`] — and [`service::CapacityService`]
//! exposes it over gRPC.

pub mod backend;
pub mod cursor;
pub mod engine;
pub mod error;
pub mod fence;
pub mod listen;
pub mod memory_store;
pub mod model;
pub mod service;
pub mod state_copy;
pub mod store;
pub mod sweeper;

pub use backend::{
    Admission, AdmitCtx, Backend, BackendError, Cause, ConfigureCtx, CreateCtx, DeleteCtx,
    DrainCtx, ErrorKind, ReclaimCtx, SlotSpec, SubstrateHost,
};
#[cfg(feature = "mutants")]
pub use engine::Mutants;
pub use engine::{
    Ack, Census, Engine, EngineOptions, Limits, ListPage, ReclaimError, ReclaimHandle,
    ReclaimOutcome, ReconcileError, ReconcileReport, ResumeOutcome, StartError, Timeouts,
};
pub use error::KitError;
pub use fence::Token;
pub use listen::{bind_aux, AuxAddr, AuxListener, BindError};
pub use memory_store::MemoryStore;
pub use model::{
    wall_clock_ms, CatalogFacts, Facts, FactsInterner, InFlight, MachineRecord, RecordError,
    SharedFacts, State, TransitionError, TransitionKind,
};
pub use state_copy::{copy_state, CopyError, CopyReport, RestoreError, StateDump, StateSource};
pub use store::{
    Change, ChangeBatch, ChangeQueue, CommitWaiter, FailedCommits, FenceMark, Loaded, Store,
    StoreError, StoreErrorKind, StoreErrorSource, Ticket,
};
pub use sweeper::ReclaimSweeper;
