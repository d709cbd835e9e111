//! Waiting for PVE tasks at the cost of one request per node per tick,
//! not one per task: a burst of clones, starts or destroys on a node is
//! watched through the node's recent task list (`GET /nodes/{node}/tasks
//! ?source=all&since=S`, `S` the start of the oldest task looked at), which
//! shows each task running or, once it has ended, with its exit status: a
//! task listed ended needs no read of its own. A task the list leaves out
//! (past its row limit, or a row with an end but no status) has its own
//! status read, as it would alone.
//!
//! A node with a single task waited on has its status read directly: the
//! list only pays off from two tasks on.
//!
//! A node's watch runs while someone waits on one of its tasks and stops
//! when the last waiter is answered or gives up; a node whose list cannot
//! be read this tick has its tasks' statuses read one by one instead (the
//! per-task wait it replaces), so a failure costs what it did before.
//! Deadlines are the waiters' own: a task still running at a waiter's
//! deadline answers [`PveError::TaskDeadline`], as the per-task wait did.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pve::error::Cause;
use pve::{exit_ok, PveClient, PveError, TaskState, TaskStatus, TaskSummary, Upid};
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

/// A task is first looked at this soon after it is waited on (or at the
/// poll interval, when that is shorter).
const FIRST_LOOK: Duration = Duration::from_millis(100);

/// Tasks falling due within this of the one that wakes the loop are looked
/// at with it: a little early for them, and one list for all.
const COALESCE: Duration = Duration::from_millis(150);

/// How a wait ends: the task's final status, or why it could not be known.
type Outcome = Result<TaskStatus, PveError>;

/// The watches of every node with tasks waited on.
pub(super) struct TaskWatch {
    client: PveClient,
    poll: Duration,
    nodes: Mutex<HashMap<String, Arc<NodeWatch>>>,
}

/// The tasks waited on in one node, each with its waiters.
struct NodeWatch {
    waiting: Mutex<HashMap<String, Waiting>>,
    /// A poll loop runs for this node. Set and cleared under `waiting`'s
    /// lock, so there is never a second loop, nor a waiter without one.
    running: std::sync::atomic::AtomicBool,
    /// Told of every new task, so the loop looks at it [`FIRST_LOOK`] after
    /// it was registered rather than at the loop's next wake.
    arrived: Notify,
}

impl Default for NodeWatch {
    fn default() -> NodeWatch {
        NodeWatch {
            waiting: Mutex::default(),
            running: std::sync::atomic::AtomicBool::new(false),
            arrived: Notify::new(),
        }
    }
}

struct Waiting {
    upid: Upid,
    /// When it is next looked at.
    due: Instant,
    waiters: Vec<oneshot::Sender<Outcome>>,
    /// The last failed read of its status (the node unreachable): what a
    /// waiter whose deadline passes is told.
    last_error: Option<Cause>,
}

impl TaskWatch {
    pub(super) fn new(client: PveClient, poll: Duration) -> TaskWatch {
        TaskWatch {
            client,
            poll: poll.max(Duration::from_millis(10)),
            nodes: Mutex::default(),
        }
    }

    /// Waits for `upid` to end or `deadline` to pass. `OK` and `WARNINGS:
    /// N` succeed; any other exit status is [`PveError::TaskFailed`].
    pub(super) async fn wait(&self, upid: &Upid, deadline: Instant) -> Outcome {
        let (tx, rx) = oneshot::channel();
        let start = {
            let mut nodes = self.nodes.lock();
            let node = nodes.entry(upid.node.clone()).or_default();
            let mut waiting = node.waiting.lock();
            let first = !node.running.swap(true, std::sync::atomic::Ordering::SeqCst);
            waiting
                .entry(upid.to_string())
                .or_insert_with(|| Waiting {
                    upid: upid.clone(),
                    due: Instant::now() + self.poll.min(FIRST_LOOK),
                    waiters: Vec::new(),
                    last_error: None,
                })
                .waiters
                .push(tx);
            drop(waiting);
            node.arrived.notify_one();
            first.then(|| Arc::clone(node))
        };
        if let Some(node) = start {
            let watch = Watcher {
                client: self.client.clone(),
                poll: self.poll,
                node,
            };
            tokio::spawn(watch.run());
        }
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(outcome)) => outcome,
            // The watch ended without answering (the runtime shutting down).
            Ok(Err(_)) => Err(PveError::TaskDeadline {
                upid: upid.to_string(),
                last_error: None,
            }),
            Err(_) => Err(PveError::TaskDeadline {
                upid: upid.to_string(),
                last_error: self.give_up(upid),
            }),
        }
    }

    /// Forgets a waiter whose deadline passed (the task stops being polled
    /// once nobody waits on it); the last poll error, if the last poll failed.
    fn give_up(&self, upid: &Upid) -> Option<Cause> {
        let nodes = self.nodes.lock();
        let node = nodes.get(&upid.node)?;
        let mut waiting = node.waiting.lock();
        let key = upid.to_string();
        let w = waiting.get_mut(&key)?;
        w.waiters.retain(|tx| !tx.is_closed());
        let last = w.last_error.clone();
        if w.waiters.is_empty() {
            waiting.remove(&key);
        }
        last
    }
}

/// One node's poll loop.
struct Watcher {
    client: PveClient,
    poll: Duration,
    node: Arc<NodeWatch>,
}

impl Watcher {
    async fn run(self) {
        loop {
            // Each task is looked at [`FIRST_LOOK`] after it was registered
            // (a start or a stop often ends within it), then every poll
            // period in its own phase, so no task waits longer to be seen
            // than it did polled alone; tasks falling due within
            // [`COALESCE`] of each other (a burst's, started together) are
            // looked at together, through one list.
            let next = {
                let mut waiting = self.node.waiting.lock();
                waiting.retain(|_, w| {
                    w.waiters.retain(|tx| !tx.is_closed());
                    !w.waiters.is_empty()
                });
                if waiting.is_empty() {
                    // Cleared under the lock a waiter registers under: one
                    // arriving after this starts a fresh loop.
                    self.node
                        .running
                        .store(false, std::sync::atomic::Ordering::SeqCst);
                    return;
                }
                waiting.values().map(|w| w.due).min()
            };
            let Some(next) = next else { return };
            tokio::select! {
                () = tokio::time::sleep_until(next) => {}
                // A new task may fall due sooner: look again.
                () = self.node.arrived.notified() => continue,
            }
            let now = Instant::now();
            let horizon = now + COALESCE;
            let mut tasks: Vec<Upid> = Vec::new();
            for w in self.node.waiting.lock().values_mut() {
                if w.due <= horizon {
                    tasks.push(w.upid.clone());
                    w.due = (w.due + self.poll).max(now + self.poll / 2);
                }
            }
            let Some(node) = tasks.first().map(|u| u.node.clone()) else {
                continue;
            };
            // The list pays off from two tasks on: one task alone costs a
            // status read, as before.
            let listed = if tasks.len() > 1 {
                let since = tasks.iter().map(|u| u.starttime).min().unwrap_or(0);
                self.client.node_tasks_since(&node, since).await.ok()
            } else {
                None
            };
            // The status reads the list leaves (tasks gone from it) run side
            // by side, as the per-task polls did: no task waits on another's.
            let listed = listed.as_deref();
            let me = &self;
            let checks = tasks.iter().map(|upid| async move {
                match me.check(upid, listed).await {
                    Polled::Ended(outcome) => me.answer(upid, outcome),
                    Polled::Running => me.note(upid, None),
                    Polled::Unreadable(e) => me.note(upid, Some(e)),
                }
            });
            futures::future::join_all(checks).await;
        }
    }

    /// Whether `upid` has ended (or its status cannot be read for a reason
    /// that will not heal), from the node's list when it was read.
    async fn check(&self, upid: &Upid, listed: Option<&[TaskSummary]>) -> Polled {
        let key = upid.to_string();
        if let Some(rows) = listed {
            if let Some(row) = rows.iter().find(|r| r.upid == key) {
                if let Some(exit) = row.exit_status() {
                    // Ended: the row says how, as the task's status would.
                    let status = TaskStatus {
                        status: TaskState::Stopped,
                        exitstatus: Some(exit.to_string()),
                        upid: Some(key),
                        task_type: row.task_type.clone(),
                        node: Some(upid.node.clone()),
                    };
                    return Polled::Ended(finished(upid, status));
                }
                if row.endtime.is_none() {
                    return Polled::Running;
                }
                // An end without a status: the task's own status says.
            }
            // Not listed (past the list's rows) or listed ended without a
            // status: its own status says how it stands.
        }
        match self.client.task_status(upid).await {
            Ok(st) if st.status == TaskState::Stopped => Polled::Ended(finished(upid, st)),
            Ok(_) => Polled::Running,
            // Polled through until the waiter's deadline, as before.
            Err(e) if e.is_node_unreachable() || e.is_transport() || e.is_timeout() => {
                Polled::Unreadable(Cause::new(e))
            }
            Err(e) => Polled::Ended(Err(e)),
        }
    }

    /// Keeps the outcome of the last poll of a task still waited on.
    fn note(&self, upid: &Upid, error: Option<Cause>) {
        if let Some(w) = self.node.waiting.lock().get_mut(&upid.to_string()) {
            w.last_error = error;
        }
    }

    fn answer(&self, upid: &Upid, outcome: Outcome) {
        let Some(w) = self.node.waiting.lock().remove(&upid.to_string()) else {
            return;
        };
        for tx in w.waiters {
            let _ = tx.send(outcome.clone());
        }
    }
}

/// What one poll found of a task.
enum Polled {
    Running,
    Ended(Outcome),
    /// Its status could not be read (the node unreachable); polled again.
    Unreadable(Cause),
}

/// A stopped task's outcome: its status, or [`PveError::TaskFailed`].
fn finished(upid: &Upid, st: TaskStatus) -> Outcome {
    let es = st.exitstatus.clone().unwrap_or_default();
    if exit_ok(&es) {
        return Ok(st);
    }
    Err(PveError::TaskFailed {
        upid: upid.to_string(),
        exitstatus: if es.is_empty() {
            "stopped without an exit status".into()
        } else {
            es
        },
    })
}
