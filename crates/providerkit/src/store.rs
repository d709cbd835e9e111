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

/// What went wrong with a store, so callers can react without parsing text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// A commit or read failed (I/O error, disk full); the store keeps
    /// retrying and the condition may clear by itself.
    Unavailable,
    /// The state cannot be opened or created (missing directory, permission
    /// denied, read-only filesystem, not a regular file).
    Inaccessible,
    /// The state is unreadable or is not a state at all (empty, foreign or
    /// damaged file).
    Corrupt,
    /// The state was written by a newer version of the store.
    Incompatible,
    /// Another process owns the state.
    Locked,
    /// The store stopped before the change was committed.
    Closed,
}

impl StoreErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            StoreErrorKind::Unavailable => "unavailable",
            StoreErrorKind::Inaccessible => "inaccessible",
            StoreErrorKind::Corrupt => "corrupt",
            StoreErrorKind::Incompatible => "incompatible",
            StoreErrorKind::Locked => "locked",
            StoreErrorKind::Closed => "closed",
        }
    }
}

impl std::fmt::Display for StoreErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The underlying cause, shared so the error stays cheap to clone (one
/// failed commit is reported to every waiter of its batch).
pub type StoreErrorSource = Arc<dyn std::error::Error + Send + Sync + 'static>;

/// A store failure: its kind, a message that names the problem and the fix
/// (this is what Display prints), and the underlying cause if any.
#[derive(Debug, Clone)]
pub struct StoreError {
    kind: StoreErrorKind,
    message: String,
    source: Option<StoreErrorSource>,
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// Written out rather than derived: a derived `source()` would hand out the
/// `Arc` that shares the cause, which no caller can downcast to the cause's
/// type (an `io::Error`, a `rusqlite::Error`); this hands out the cause.
impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|cause| cause as &(dyn std::error::Error + 'static))
    }
}

impl StoreError {
    pub fn new(kind: StoreErrorKind, message: impl Into<String>) -> StoreError {
        StoreError {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// Attach the underlying cause (kept for `Error::source`, not printed
    /// by Display: the message already says what it means).
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Arc::new(source));
        self
    }

    /// The same error under another kind (a caller that knows better what
    /// the failure means to it, e.g. a commit that will be retried).
    pub fn with_kind(mut self, kind: StoreErrorKind) -> Self {
        self.kind = kind;
        self
    }

    pub fn unavailable(message: impl Into<String>) -> StoreError {
        StoreError::new(StoreErrorKind::Unavailable, message)
    }

    pub fn inaccessible(message: impl Into<String>) -> StoreError {
        StoreError::new(StoreErrorKind::Inaccessible, message)
    }

    pub fn corrupt(message: impl Into<String>) -> StoreError {
        StoreError::new(StoreErrorKind::Corrupt, message)
    }

    pub fn incompatible(message: impl Into<String>) -> StoreError {
        StoreError::new(StoreErrorKind::Incompatible, message)
    }

    pub fn locked(message: impl Into<String>) -> StoreError {
        StoreError::new(StoreErrorKind::Locked, message)
    }

    pub fn closed(message: impl Into<String>) -> StoreError {
        StoreError::new(StoreErrorKind::Closed, message)
    }

    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }
}

/// Equal when kind and message are: a source has no equality of its own.
impl PartialEq for StoreError {
    fn eq(&self, other: &StoreError) -> bool {
        self.kind == other.kind && self.message == other.message
    }
}

impl Eq for StoreError {}

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

    /// Err while changes are waiting for a commit that keeps failing (a full
    /// disk, say): readiness follows it. Ok again once a commit succeeds.
    fn health(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// What a durable store's callers hand its writer: changes queued in
/// submission order, each submission numbered by a ticket.
#[derive(Default)]
pub struct ChangeQueue {
    /// The last ticket handed out.
    pub issued: Ticket,
    /// Every change submitted since the writer last drained, in order.
    pub pending: Vec<Change>,
    /// Set when the store stops: the writer commits what is queued, then ends.
    pub shutdown: bool,
}

impl ChangeQueue {
    /// Queue `changes`: the ticket that is durable once they are, and
    /// whether anything was queued (the writer then needs waking). An empty
    /// submission takes the last ticket: nothing more to wait for.
    pub fn push(&mut self, changes: Vec<Change>) -> (Ticket, bool) {
        if changes.is_empty() {
            return (self.issued, false);
        }
        self.issued += 1;
        self.pending.extend(changes);
        (self.issued, true)
    }
}

/// The changes a durable store's writer holds for one commit: the latest
/// version of every changed row (a later change to a row overwrites an
/// earlier one, so a group commit writes each row once).
#[derive(Default)]
pub struct ChangeBatch {
    /// machine id -> its record as of the latest change.
    pub machines: HashMap<String, Arc<MachineRecord>>,
    /// (shard id, machine id) -> the latest mark.
    pub fences: HashMap<(String, String), FenceMark>,
}

impl ChangeBatch {
    pub fn merge(&mut self, changes: Vec<Change>) {
        for change in changes {
            match change {
                Change::Machine(record) => {
                    self.machines.insert(record.id.clone(), record);
                }
                Change::Fence(mark) => {
                    self.fences
                        .insert((mark.shard_id.clone(), mark.machine_id.clone()), mark);
                }
            }
        }
    }

    /// `newer`'s rows over this batch's.
    pub fn absorb(&mut self, newer: ChangeBatch) {
        self.machines.extend(newer.machines);
        self.fences.extend(newer.fences);
    }

    pub fn is_empty(&self) -> bool {
        self.machines.is_empty() && self.fences.is_empty()
    }

    pub fn clear(&mut self) {
        self.machines.clear();
        self.fences.clear();
    }
}

/// The tickets whose commit failed and are not durable yet, each range with
/// the error its waiters get: what a durable store's `durable` answers
/// while its writer keeps retrying.
#[derive(Default)]
pub struct FailedCommits {
    ranges: Mutex<Vec<FailedRange>>,
}

struct FailedRange {
    first: Ticket,
    last: Ticket,
    error: StoreError,
}

impl FailedCommits {
    /// The error of the failed commit that carried `ticket`, if any.
    pub fn failure_for(&self, ticket: Ticket) -> Option<StoreError> {
        self.ranges
            .lock()
            .iter()
            .find(|f| (f.first..=f.last).contains(&ticket))
            .map(|f| f.error.clone())
    }

    /// The latest commit failure whose changes are still not durable.
    pub fn latest(&self) -> Option<StoreError> {
        self.ranges.lock().last().map(|f| f.error.clone())
    }

    /// Tickets `first..=last` failed with `error`. Consecutive failures (a
    /// dead disk, a database that is down) coalesce into one range.
    pub fn record(&self, first: Ticket, last: Ticket, error: StoreError) {
        let mut ranges = self.ranges.lock();
        if let Some(prev) = ranges.last_mut() {
            if prev.last + 1 == first {
                prev.last = last;
                prev.error = error;
                return;
            }
        }
        ranges.push(FailedRange { first, last, error });
    }

    /// A commit succeeded: everything carried is durable now.
    pub fn clear(&self) {
        self.ranges.lock().clear();
    }
}

/// What a durable store's `durable` and `health` answer from: the last
/// ticket its writer made durable and the commits that failed. One type
/// for every store, so the rule (a ticket is durable once the writer
/// passed it and no failed commit still carries it) is written once.
#[derive(Clone)]
pub struct CommitWaiter {
    done: tokio::sync::watch::Receiver<Ticket>,
    failures: Arc<FailedCommits>,
    /// The store as its errors name it (`state file /x`, `PostgreSQL
    /// state postgres://...`).
    name: Arc<str>,
}

impl CommitWaiter {
    /// `done` is what the writer sends each ticket it made durable on;
    /// `failures` is what it records failed commits in.
    pub fn new(
        name: impl Into<Arc<str>>,
        done: tokio::sync::watch::Receiver<Ticket>,
        failures: Arc<FailedCommits>,
    ) -> CommitWaiter {
        CommitWaiter {
            done,
            failures,
            name: name.into(),
        }
    }

    /// [`Store::durable`].
    pub fn durable(&self, ticket: Ticket) -> BoxFuture<'static, Result<(), StoreError>> {
        let waiter = self.clone();
        Box::pin(async move {
            let mut done = waiter.done;
            if done.wait_for(|d| *d >= ticket).await.is_err() {
                return Err(StoreError::closed(format!(
                    "{}: the writer stopped before ticket {ticket} was committed",
                    waiter.name
                )));
            }
            match waiter.failures.failure_for(ticket) {
                Some(error) => Err(error),
                None => Ok(()),
            }
        })
    }

    /// [`Store::health`]: the latest commit failure whose changes are still
    /// not durable.
    pub fn health(&self) -> Result<(), StoreError> {
        match self.failures.latest() {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    #[test]
    fn the_cause_is_the_source_itself() {
        let io = std::io::Error::new(std::io::ErrorKind::StorageFull, "no space");
        let e = StoreError::unavailable("state file /s: cannot commit: no space").with_source(io);
        assert_eq!(e.to_string(), "state file /s: cannot commit: no space");
        let cause = e.source().and_then(|s| s.downcast_ref::<std::io::Error>());
        assert_eq!(
            cause.map(std::io::Error::kind),
            Some(std::io::ErrorKind::StorageFull)
        );
        assert!(StoreError::closed("stopped").source().is_none());
    }
}
