//! What the store's handle, its writer and the commit rounds share: the
//! queue of submitted changes, the failures waiters are told of, the
//! counters, and this store's name among the writers of the state.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;

use parking_lot::Mutex;
use providerkit::{ChangeQueue, FailedCommits};
use tokio::sync::Notify;

pub(crate) struct Shared {
    pub(crate) target: String,
    /// The lease epoch every commit must still find, if the store writes
    /// as a leader.
    pub(crate) lease_epoch: Option<i64>,
    /// This store's name in `bigfleet_commits` (drawn at random when it
    /// opens): whose round a read finds.
    pub(crate) writer_id: i64,
    pub(crate) queue: Mutex<ChangeQueue>,
    pub(crate) wake: Notify,
    /// Ticket ranges whose commit failed and whose changes are not yet
    /// durable; cleared once everything is.
    pub(crate) failures: Arc<FailedCommits>,
    pub(crate) commits: AtomicU64,
    /// Commits whose answer was lost and that a read found had landed.
    pub(crate) resolved_by_reading: AtomicU64,
    /// Test hook: the next commit lands but its answer is thrown away.
    pub(crate) lose_next_answer: AtomicBool,
}

impl Shared {
    pub(crate) fn new(target: String, lease_epoch: Option<i64>) -> Shared {
        Shared {
            target,
            lease_epoch,
            // Odd, so never 0 (the id of the rounds before schema 3); 63
            // random bits tell two writers apart.
            writer_id: rand::random::<i64>() | 1,
            queue: Mutex::new(ChangeQueue::default()),
            wake: Notify::new(),
            failures: Arc::default(),
            commits: AtomicU64::new(0),
            resolved_by_reading: AtomicU64::new(0),
            lose_next_answer: AtomicBool::new(false),
        }
    }
}
