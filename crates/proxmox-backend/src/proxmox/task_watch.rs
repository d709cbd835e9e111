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
//! list only pays off from two tasks on. A list read for some tasks
//! answers every other task of the node it shows ended, at no cost.
//!
//! Looks follow what tasks take: the node's watch learns, per task kind
//! ([`kind_of`]), how long its tasks ran until seen ended, and a new one is
//! first looked at an eighth of that before it is due, then every eighth
//! of it (at most the poll interval): a clone that took 40 s last time is
//! not looked at 40 times, and one that ends on time is seen within an
//! eighth of its length (a clone slot waits on that). Tasks waited on
//! before any of their kind ended on the node (a burst's first round) are
//! looked at every poll period until one ends, and then follow what it
//! took.
//!
//! A node's watch runs while someone waits on one of its tasks and stops
//! when the last waiter is answered or gives up; a node whose list cannot
//! be read this tick has its tasks' statuses read one by one instead (the
//! per-task wait it replaces), so a failure costs what it did before.
//! Deadlines are the waiters' own: a task still running at a waiter's
//! deadline answers [`PveError::TaskDeadline`], as the per-task wait did.
//!
//! A task whose log its waiter reads anyway ([`TaskWatch::wait_logged`]: a
//! destroy, whose log alone names the disks it could not free) is looked
//! at through its log instead: a worker ends its log with `TASK OK`, `TASK
//! WARNINGS: N` or `TASK ERROR: …`, the very line PVE's status read takes
//! the exit status from (pve-common `PVE::UPID::read_status`), so the look
//! that sees it ended has read the log too, and no read follows. Every
//! [`STATUS_EVERY`]th look is a status read instead: a worker killed before
//! its last line (its node rebooted) never writes one, and only the status
//! says it is no longer running.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pve::error::Cause;
use pve::{exit_ok, PveClient, PveError, TaskLogLine, TaskState, TaskStatus, TaskSummary, Upid};
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

/// A task is first looked at this soon after it is waited on (or at the
/// poll interval, when that is shorter).
const FIRST_LOOK: Duration = Duration::from_millis(100);

/// Tasks falling due within this of the one that wakes the loop are looked
/// at with it: a little early for them, and one list for all.
const COALESCE: Duration = Duration::from_millis(150);

/// A task looked at through its log has every this-many-th look read its
/// status instead (see the module's doc).
const STATUS_EVERY: u32 = 4;

/// How a wait ends: the task's final status (with its log, when the
/// waiter asked for it and the look that saw the end read it), or why it
/// could not be known.
type Outcome = Result<Ended, PveError>;

/// An ended task: its status, and its log's first lines when the look that
/// saw it end was a log read.
#[derive(Clone)]
pub(super) struct Ended {
    pub(super) status: TaskStatus,
    pub(super) log: Option<Vec<TaskLogLine>>,
}

/// The watches of every node with tasks waited on.
pub(super) struct TaskWatch {
    client: PveClient,
    poll: Duration,
    nodes: Mutex<HashMap<String, Arc<NodeWatch>>>,
}

/// The tasks waited on in one node, each with its waiters.
struct NodeWatch {
    waiting: Mutex<HashMap<String, Waiting>>,
    /// How long the node's tasks of each kind ran until seen ended
    /// (smoothed), by [`kind_of`].
    learnt: Mutex<HashMap<String, Duration>>,
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
            learnt: Mutex::default(),
            running: std::sync::atomic::AtomicBool::new(false),
            arrived: Notify::new(),
        }
    }
}

struct Waiting {
    upid: Upid,
    /// When it was first waited on (about when it started).
    since: Instant,
    /// When it is next looked at.
    due: Instant,
    /// How long after one look the next comes.
    every: Duration,
    waiters: Vec<oneshot::Sender<Outcome>>,
    /// The last failed read of its status (the node unreachable): what a
    /// waiter whose deadline passes is told.
    last_error: Option<Cause>,
    /// Looked at through its log's first this-many lines, when a waiter
    /// reads them anyway (see [`TaskWatch::wait_logged`]).
    log_lines: Option<u64>,
    /// Looks so far (for [`STATUS_EVERY`]).
    looks: u32,
    /// Its looks follow what its kind took on the node. A task waited on
    /// before any of its kind ended there is looked at every poll period
    /// until one does; then it follows what that one took (see
    /// [`Watcher::follow_learnt`]).
    estimated: bool,
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
    pub(super) async fn wait(
        &self,
        upid: &Upid,
        deadline: Instant,
    ) -> Result<TaskStatus, PveError> {
        self.wait_with(upid, deadline, None).await.map(|e| e.status)
    }

    /// [`TaskWatch::wait`] for a task whose log's first `lines` lines the
    /// waiter reads once it ended: it is looked at through them, and the
    /// look that sees it end hands them over (`None` when a status read or
    /// the node's list saw the end: the waiter reads the log itself).
    pub(super) async fn wait_logged(
        &self,
        upid: &Upid,
        deadline: Instant,
        lines: u64,
    ) -> Result<Ended, PveError> {
        self.wait_with(upid, deadline, Some(lines)).await
    }

    async fn wait_with(&self, upid: &Upid, deadline: Instant, log_lines: Option<u64>) -> Outcome {
        let (tx, rx) = oneshot::channel();
        let start = {
            let mut nodes = self.nodes.lock();
            let node = nodes.entry(upid.node.clone()).or_default();
            let soonest = self.poll.min(FIRST_LOOK);
            let (first_look, every, estimated) = match node.learnt.lock().get(&kind_of(upid)) {
                Some(took) => {
                    let every = looks_every(*took, self.poll);
                    (took.saturating_sub(every).max(soonest), every, true)
                }
                None => (soonest, self.poll, false),
            };
            let mut waiting = node.waiting.lock();
            let first = !node.running.swap(true, std::sync::atomic::Ordering::SeqCst);
            let now = Instant::now();
            let w = waiting.entry(upid.to_string()).or_insert_with(|| Waiting {
                upid: upid.clone(),
                since: now,
                due: now + first_look,
                every,
                waiters: Vec::new(),
                last_error: None,
                log_lines: None,
                looks: 0,
                estimated,
            });
            w.waiters.push(tx);
            w.log_lines = w.log_lines.max(log_lines);
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
    /// The poll interval: the longest between two looks at a task.
    poll: Duration,
    node: Arc<NodeWatch>,
}

impl Watcher {
    async fn run(self) {
        loop {
            // Each task is looked at [`FIRST_LOOK`] after it was registered
            // (a start or a stop often ends within it), or shortly before
            // what its kind took before, then every poll period (or an
            // eighth of what it takes) in its own phase, so no task waits
            // much longer to be seen than it did polled alone; tasks falling due within
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
            let mut others: Vec<Upid> = Vec::new();
            // Tasks looked at through their logs, with how (never through
            // the list: a row that shows one ended would still leave its
            // log to read).
            let mut logged: Vec<(Upid, Look)> = Vec::new();
            for w in self.node.waiting.lock().values_mut() {
                if w.due <= horizon {
                    w.due = (w.due + w.every).max(now + w.every / 2);
                    match w.log_lines {
                        Some(lines) => {
                            w.looks += 1;
                            let look = if w.looks % STATUS_EVERY == 0 {
                                Look::Status
                            } else {
                                Look::Log(lines)
                            };
                            logged.push((w.upid.clone(), look));
                        }
                        None => tasks.push(w.upid.clone()),
                    }
                } else if w.log_lines.is_none() {
                    others.push(w.upid.clone());
                }
            }
            let me = &self;
            let by_log = logged.iter().map(|(upid, look)| async move {
                let polled = match look {
                    Look::Log(lines) => me.check_log(upid, *lines).await,
                    Look::Status => me.check(upid, None).await,
                };
                me.settle(upid, polled);
            });
            let Some(node) = tasks.first().map(|u| u.node.clone()) else {
                futures::future::join_all(by_log).await;
                continue;
            };
            // The list pays off from two tasks on: one task alone costs a
            // status read, as before.
            let listed = if tasks.len() + others.len() > 1 {
                let since = tasks
                    .iter()
                    .chain(&others)
                    .map(|u| u.starttime)
                    .min()
                    .unwrap_or(0);
                self.client.node_tasks_since(&node, since).await.ok()
            } else {
                None
            };
            // Tasks not due yet that the list shows ended are answered now.
            if let Some(rows) = listed.as_deref() {
                for upid in &others {
                    let key = upid.to_string();
                    if let Some(row) = rows.iter().find(|r| r.upid == key) {
                        if let Some(status) = ended_row(upid, row) {
                            self.answer(upid, finished(upid, status, None));
                        }
                    }
                }
            }
            // The status reads the list leaves (tasks gone from it) run side
            // by side, as the per-task polls did: no task waits on another's.
            let listed = listed.as_deref();
            let checks = tasks.iter().map(|upid| async move {
                let polled = me.check(upid, listed).await;
                me.settle(upid, polled);
            });
            futures::future::join(
                futures::future::join_all(checks),
                futures::future::join_all(by_log),
            )
            .await;
        }
    }

    /// Answers the waiters of a task seen ended, or keeps what the look found.
    fn settle(&self, upid: &Upid, polled: Polled) {
        match polled {
            Polled::Ended(outcome) => self.answer(upid, outcome),
            Polled::Running => self.note(upid, None),
            Polled::Unreadable(e) => self.note(upid, Some(e)),
        }
    }

    /// Whether `upid` has ended, from its log's first `lines` lines: ended
    /// when the last of them is a worker's last line. A log that cannot be
    /// read for a reason that will not heal (a token that may read the
    /// task's status but not its log) leaves this look to the status read:
    /// the log is the waiter's to read then, and its failure its to report.
    async fn check_log(&self, upid: &Upid, lines: u64) -> Polled {
        match self.client.task_log(upid, 0, lines).await {
            Ok(log) => match log.last().and_then(TaskLogLine::exit_status) {
                Some(exit) => {
                    let status = stopped(upid, exit, Some(upid.task_type.clone()));
                    Polled::Ended(finished(upid, status, Some(log)))
                }
                // Running, or past the lines read: later looks tell.
                None => Polled::Running,
            },
            Err(e) if e.is_unanswered() => Polled::Unreadable(Cause::new(e)),
            Err(_) => self.check(upid, None).await,
        }
    }

    /// Whether `upid` has ended (or its status cannot be read for a reason
    /// that will not heal), from the node's list when it was read.
    async fn check(&self, upid: &Upid, listed: Option<&[TaskSummary]>) -> Polled {
        let key = upid.to_string();
        if let Some(rows) = listed {
            if let Some(row) = rows.iter().find(|r| r.upid == key) {
                if let Some(status) = ended_row(upid, row) {
                    return Polled::Ended(finished(upid, status, None));
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
            Ok(st) if st.status == TaskState::Stopped => Polled::Ended(finished(upid, st, None)),
            Ok(_) => Polled::Running,
            // Polled through until the waiter's deadline, as before.
            Err(e) if e.is_unanswered() => Polled::Unreadable(Cause::new(e)),
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
        // A failed task tells nothing of how long the kind takes.
        if outcome.is_ok() {
            let took = w.since.elapsed();
            let kind = kind_of(upid);
            let smoothed = {
                let mut learnt = self.node.learnt.lock();
                let smoothed = match learnt.get(&kind) {
                    Some(before) => (*before + took) / 2,
                    None => took,
                };
                learnt.insert(kind.clone(), smoothed);
                smoothed
            };
            self.follow_learnt(&kind, smoothed);
        }
        for tx in w.waiters {
            let _ = tx.send(outcome.clone());
        }
    }

    /// Tasks of `kind` waited on before any of it ended on the node (a
    /// burst's first round, all registered together) are looked at every
    /// poll period in their own phase; now that one has shown what the kind
    /// takes, they follow it as a later task would: next looked at shortly
    /// before it is due, then every eighth of it. A clone that ends half a
    /// second after its sibling is then seen within an eighth of a clone,
    /// not a whole poll period later, and hands its clone slot on sooner.
    fn follow_learnt(&self, kind: &str, took: Duration) {
        let every = looks_every(took, self.poll);
        let now = Instant::now();
        for w in self.node.waiting.lock().values_mut() {
            if w.estimated || kind_of(&w.upid) != kind {
                continue;
            }
            w.estimated = true;
            w.every = every;
            // Not sooner than a period from this look, which saw it running.
            let due = (w.since + took.saturating_sub(every)).max(now + every);
            w.due = w.due.min(due);
        }
    }
}

/// How a task looked at through its log is looked at this time.
enum Look {
    /// Its log's first this-many lines.
    Log(u64),
    /// Its status (every [`STATUS_EVERY`]th look).
    Status,
}

/// What one poll found of a task.
enum Polled {
    Running,
    Ended(Outcome),
    /// Its status could not be read (the node unreachable); polled again.
    Unreadable(Cause),
}

/// How often a task of a kind that took `took` is looked at: every eighth
/// of it, no sooner than [`FIRST_LOOK`] (or the poll interval, when that is
/// shorter) and no later than the poll interval.
fn looks_every(took: Duration, poll: Duration) -> Duration {
    (took / 8).clamp(poll.min(FIRST_LOOK), poll)
}

/// What a task's duration is learnt under: its type, and for a clone its
/// source too (a template's full clones take minutes, another's linked
/// clones a second); a start, stop or destroy by type alone, as each names
/// its own VM.
fn kind_of(upid: &Upid) -> String {
    if upid.task_type == "qmclone" {
        format!("qmclone:{}", upid.id)
    } else {
        upid.task_type.clone()
    }
}

/// The status of a task its list row shows ended: `None` while it runs, and
/// for a row with an end but no exit status.
fn ended_row(upid: &Upid, row: &TaskSummary) -> Option<TaskStatus> {
    let exit = row.exit_status()?;
    Some(stopped(upid, exit, row.task_type.clone()))
}

/// The status a read of ended task `upid` would give, with exit status `exit`.
fn stopped(upid: &Upid, exit: &str, task_type: Option<String>) -> TaskStatus {
    TaskStatus {
        status: TaskState::Stopped,
        exitstatus: Some(exit.to_string()),
        upid: Some(upid.to_string()),
        task_type,
        node: Some(upid.node.clone()),
    }
}

/// A stopped task's outcome: its status (and its log, when the look read
/// it), or [`PveError::TaskFailed`].
fn finished(upid: &Upid, st: TaskStatus, log: Option<Vec<TaskLogLine>>) -> Outcome {
    let es = st.exitstatus.clone().unwrap_or_default();
    if exit_ok(&es) {
        return Ok(Ended { status: st, log });
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
