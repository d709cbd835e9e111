//! Where a transition's time went: each step the substrate takes for a
//! machine (a clone, a wait for a clone slot or a lock, a start, the guest
//! agent, the bootstrap, readiness, a drain, a stop, a destroy), when it
//! started, how long it took, the PVE task that ran it and how it ended.
//!
//! The [`Timeline`] belongs to the backend, which runs each transition of a
//! machine inside [`Timeline::scope`]; the substrate's parts mark their
//! steps with [`step`], which finds the machine being worked on through a
//! task-local, as a tracing span would, so no part threads a machine id it
//! has no other use for. A step taken outside any scope (a test driving
//! the substrate directly, the reconcile pass) is not recorded.
//!
//! Bounded and in memory only: the last [`STEPS_PER_MACHINE`] steps of at
//! most [`MACHINES`] machines, the least recently worked on forgotten
//! first. A restart forgets it all: it explains a slow transition of this
//! process, nothing an operator must keep.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use parking_lot::Mutex;

/// Steps kept per machine: a Create, a Configure, a Drain and a Delete
/// with their waits fit.
pub const STEPS_PER_MACHINE: usize = 24;

/// Machines kept; beyond it the one worked on least recently goes.
pub const MACHINES: usize = 4096;

/// One kind of step, a label value of `bigfleet_proxmox_step_duration_seconds`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    /// Waiting for a clone slot (`--max-parallel-clones` per node and storage).
    CloneSlot,
    /// The clone task, from its POST to its end.
    Clone,
    /// Waiting for a VM's config lock to go (a clone finishing, a backup).
    LockWait,
    /// Growing the boot disk to the type's `disk_gib` (its task).
    Resize,
    /// The start task.
    Start,
    /// From the start until the guest agent answers.
    Agent,
    /// Writing the bootstrap blob through the agent.
    BootstrapWrite,
    /// Running `--bootstrap-exec` to its exit.
    BootstrapExec,
    /// `--readiness-command` until the node is Ready.
    Readiness,
    /// `--drain-command` to its exit.
    Drain,
    /// The stop task before a destroy.
    Stop,
    /// The destroy task.
    Destroy,
}

impl Step {
    pub const ALL: [Step; 12] = [
        Step::CloneSlot,
        Step::Clone,
        Step::LockWait,
        Step::Resize,
        Step::Start,
        Step::Agent,
        Step::BootstrapWrite,
        Step::BootstrapExec,
        Step::Readiness,
        Step::Drain,
        Step::Stop,
        Step::Destroy,
    ];

    /// The name in metrics, the Admin service and `ctl get`.
    pub fn name(self) -> &'static str {
        match self {
            Step::CloneSlot => "clone_slot",
            Step::Clone => "clone",
            Step::LockWait => "lock_wait",
            Step::Resize => "resize",
            Step::Start => "start",
            Step::Agent => "agent",
            Step::BootstrapWrite => "bootstrap_write",
            Step::BootstrapExec => "bootstrap_exec",
            Step::Readiness => "readiness",
            Step::Drain => "drain",
            Step::Stop => "stop",
            Step::Destroy => "destroy",
        }
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One step taken for a machine.
#[derive(Clone, Debug, PartialEq)]
pub struct StepRecord {
    pub step: Step,
    pub node: String,
    pub started: SystemTime,
    pub duration: Duration,
    /// The PVE task that ran it, when one did.
    pub upid: Option<String>,
    /// How it failed; `None` when it succeeded (or is still under way).
    pub error: Option<String>,
    /// Still under way: `duration` is how long it has run so far. An
    /// operator asking why a Create is slow asks while it is.
    pub running: bool,
    /// For a clone under way: how far its copy is, in percent, as its task
    /// log last said when the timeline was asked for
    /// ([`crate::backend::ProxmoxBackend::timeline_now`]); `None` otherwise.
    pub copied_percent: Option<f64>,
}

/// Told of every step that ends, for the per-step histograms.
pub trait StepObserver: Send + Sync {
    fn observe_step(&self, step: Step, node: &str, duration: Duration, ok: bool);
}

/// The steps of the machines this process worked on lately.
#[derive(Default)]
pub struct Timeline {
    machines: Mutex<Machines>,
    observer: Option<Arc<dyn StepObserver>>,
}

#[derive(Default)]
struct Machines {
    steps: HashMap<String, (u64, VecDeque<StepRecord>)>,
    /// Bumped on every record: the machine with the smallest goes first.
    clock: u64,
    /// The steps under way, by their guard's serial: one per live
    /// [`StepGuard`] in a scope, so bounded by the work in flight.
    open: HashMap<u64, Open>,
    next_open: u64,
}

/// A step under way, as [`Timeline::of`] shows it until it ends.
struct Open {
    machine_id: String,
    step: Step,
    node: String,
    started: SystemTime,
    clock: tokio::time::Instant,
    upid: Option<String>,
}

impl Open {
    /// What it is as a record now: its time so far; `running` while under
    /// way, else ended with `error`.
    fn record(&self, running: bool, error: Option<String>) -> StepRecord {
        StepRecord {
            step: self.step,
            node: self.node.clone(),
            started: self.started,
            duration: self.clock.elapsed(),
            upid: self.upid.clone(),
            error,
            running,
            copied_percent: None,
        }
    }
}

impl Machines {
    /// Keeps `record` as `machine_id`'s latest step, within the bounds.
    fn push(&mut self, machine_id: &str, record: StepRecord) {
        self.clock += 1;
        let now = self.clock;
        if !self.steps.contains_key(machine_id) && self.steps.len() >= MACHINES {
            let oldest = self
                .steps
                .iter()
                .min_by_key(|(_, (at, _))| *at)
                .map(|(id, _)| id.clone());
            if let Some(id) = oldest {
                self.steps.remove(&id);
            }
        }
        let entry = self
            .steps
            .entry(machine_id.to_string())
            .or_insert_with(|| (now, VecDeque::new()));
        entry.0 = now;
        if entry.1.len() >= STEPS_PER_MACHINE {
            entry.1.pop_front();
        }
        entry.1.push_back(record);
    }
}

impl Timeline {
    pub fn new(observer: Option<Arc<dyn StepObserver>>) -> Timeline {
        Timeline {
            machines: Mutex::default(),
            observer,
        }
    }

    /// Runs `fut` (one transition of `machine_id`) with its steps recorded
    /// here.
    pub async fn scope<F: Future>(self: &Arc<Self>, machine_id: &str, fut: F) -> F::Output {
        let current = Current {
            machine_id: machine_id.to_string(),
            timeline: Arc::clone(self),
        };
        CURRENT.scope(current, fut).await
    }

    /// The recorded steps of `machine_id`, oldest first, then the ones
    /// under way (`running`, with how long so far), by when they started.
    pub fn of(&self, machine_id: &str) -> Vec<StepRecord> {
        let m = self.machines.lock();
        let mut steps: Vec<StepRecord> = m
            .steps
            .get(machine_id)
            .map(|(_, steps)| steps.iter().cloned().collect())
            .unwrap_or_default();
        let mut open: Vec<StepRecord> = m
            .open
            .values()
            .filter(|o| o.machine_id == machine_id)
            .map(|o| o.record(true, None))
            .collect();
        open.sort_by_key(|r| r.started);
        steps.extend(open);
        steps
    }

    /// Shows a step under way until it is recorded; its serial.
    fn open(&self, open: Open) -> u64 {
        let mut m = self.machines.lock();
        m.next_open += 1;
        let serial = m.next_open;
        m.open.insert(serial, open);
        serial
    }

    fn set_task(&self, serial: u64, upid: &str) {
        if let Some(o) = self.machines.lock().open.get_mut(&serial) {
            o.upid = Some(upid.to_string());
        }
    }

    /// Ends the step under way `serial` with `error` (`None`: it
    /// succeeded): recorded, and no longer shown as under way, under the
    /// same lock, so no read misses it between.
    fn close(&self, serial: u64, error: Option<String>) {
        let observed = {
            let mut m = self.machines.lock();
            let Some(open) = m.open.remove(&serial) else {
                return;
            };
            let record = open.record(false, error);
            let observed = self.observer.is_some().then(|| {
                let ok = record.error.is_none();
                (record.step, record.node.clone(), record.duration, ok)
            });
            m.push(&open.machine_id, record);
            observed
        };
        if let (Some(obs), Some((step, node, duration, ok))) = (&self.observer, observed) {
            obs.observe_step(step, &node, duration, ok);
        }
    }
}

#[derive(Clone)]
struct Current {
    machine_id: String,
    timeline: Arc<Timeline>,
}

tokio::task_local! {
    static CURRENT: Current;
}

/// Starts `step` on `node` for the machine being worked on (see the module
/// doc). End it with [`StepGuard::end`]; a guard dropped without it (the
/// future cancelled, an early return) records the step as abandoned.
pub fn step(step: Step, node: &str) -> StepGuard {
    let open = CURRENT
        .try_with(|c| {
            let serial = c.timeline.open(Open {
                machine_id: c.machine_id.clone(),
                step,
                node: node.to_string(),
                started: SystemTime::now(),
                clock: tokio::time::Instant::now(),
                upid: None,
            });
            (Arc::clone(&c.timeline), serial)
        })
        .ok();
    StepGuard { open, done: false }
}

/// A step under way: its timeline and its serial there, when a machine is
/// in scope (outside one nothing is shown or recorded).
pub struct StepGuard {
    open: Option<(Arc<Timeline>, u64)>,
    done: bool,
}

impl StepGuard {
    /// The PVE task running this step.
    pub fn task(&mut self, upid: impl fmt::Display) {
        if let Some((timeline, serial)) = &self.open {
            timeline.set_task(*serial, &upid.to_string());
        }
    }

    /// Ends the step with the outcome of what it did, and hands it back.
    pub fn end<T, E: fmt::Display>(mut self, outcome: Result<T, E>) -> Result<T, E> {
        let error = outcome.as_ref().err().map(ToString::to_string);
        self.finish(error);
        outcome
    }

    fn finish(&mut self, error: Option<String>) {
        self.done = true;
        if let Some((timeline, serial)) = self.open.take() {
            timeline.close(serial, error);
        }
    }
}

impl Drop for StepGuard {
    fn drop(&mut self) {
        if !self.done {
            self.finish(Some(
                "abandoned (the transition ended before this step did)".into(),
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Seen(Mutex<Vec<(Step, String, bool)>>);

    impl StepObserver for Seen {
        fn observe_step(&self, step: Step, node: &str, _: Duration, ok: bool) {
            self.0.lock().push((step, node.to_string(), ok));
        }
    }

    #[tokio::test]
    async fn steps_are_recorded_for_the_machine_in_scope_and_observed() {
        let seen = Arc::new(Seen::default());
        let timeline = Arc::new(Timeline::new(Some(seen.clone() as Arc<dyn StepObserver>)));
        timeline
            .scope("m-1", async {
                let mut clone = step(Step::Clone, "pve1");
                clone.task("UPID:pve1:1");
                let _: Result<(), String> = clone.end(Ok(()));
                let _: Result<(), String> =
                    step(Step::Start, "pve1").end(Err("start failed".to_string()));
                drop(step(Step::Agent, "pve1"));
            })
            .await;
        // Outside any scope: nothing recorded.
        let _: Result<(), String> = step(Step::Destroy, "pve1").end(Ok(()));
        let got = timeline.of("m-1");
        let summary: Vec<(Step, Option<&str>, Option<&str>)> = got
            .iter()
            .map(|r| (r.step, r.upid.as_deref(), r.error.as_deref()))
            .collect();
        assert_eq!(
            summary,
            [
                (Step::Clone, Some("UPID:pve1:1"), None),
                (Step::Start, None, Some("start failed")),
                (
                    Step::Agent,
                    None,
                    Some("abandoned (the transition ended before this step did)")
                ),
            ]
        );
        assert_eq!(seen.0.lock().len(), 3);
        assert!(timeline.of("m-2").is_empty());
    }

    #[tokio::test]
    async fn memory_is_bounded_per_machine_and_in_machines() {
        let timeline = Arc::new(Timeline::new(None));
        for i in 0..(STEPS_PER_MACHINE + 5) {
            timeline
                .scope("m-1", async move {
                    let mut s = step(Step::Clone, "pve1");
                    s.task(i);
                    let _: Result<(), String> = s.end(Ok(()));
                })
                .await;
        }
        let steps = timeline.of("m-1");
        assert_eq!(steps.len(), STEPS_PER_MACHINE);
        assert_eq!(steps[0].upid.as_deref(), Some("5"), "the oldest went");
        for i in 0..MACHINES + 1 {
            timeline
                .scope(&format!("n-{i}"), async {
                    let _: Result<(), String> = step(Step::Start, "pve1").end(Ok(()));
                })
                .await;
        }
        assert!(timeline.of("m-1").is_empty(), "least recently worked on");
        assert_eq!(timeline.of(&format!("n-{MACHINES}")).len(), 1);
        assert_eq!(timeline.machines.lock().steps.len(), MACHINES);
    }

    #[tokio::test]
    async fn a_step_under_way_is_shown_running_until_it_ends() {
        let timeline = Arc::new(Timeline::new(None));
        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        let (end_tx, end_rx) = tokio::sync::oneshot::channel::<Result<(), String>>();
        let t = Arc::clone(&timeline);
        let work = tokio::spawn(async move {
            t.scope("m-1", async {
                let _: Result<(), String> = step(Step::CloneSlot, "pve1").end(Ok(()));
                let mut clone = step(Step::Clone, "pve1");
                clone.task("UPID:pve1:7");
                let _ = started_tx.send(());
                let outcome = end_rx.await.unwrap_or(Ok(()));
                let _ = clone.end(outcome);
            })
            .await;
        });
        started_rx.await.expect("the clone step began");
        let steps = timeline.of("m-1");
        let shown: Vec<(Step, bool, Option<&str>)> = steps
            .iter()
            .map(|r| (r.step, r.running, r.upid.as_deref()))
            .collect();
        assert_eq!(
            shown,
            [
                (Step::CloneSlot, false, None),
                (Step::Clone, true, Some("UPID:pve1:7")),
            ]
        );
        assert!(steps[1].error.is_none());
        assert!(timeline.of("m-2").is_empty(), "only its own machine's");
        end_tx.send(Err("clone failed".into())).expect("end it");
        work.await.expect("the work ends");
        let steps = timeline.of("m-1");
        assert_eq!(steps.len(), 2, "{steps:?}");
        assert!(!steps[1].running);
        assert_eq!(steps[1].error.as_deref(), Some("clone failed"));
        assert!(
            timeline.machines.lock().open.is_empty(),
            "nothing left shown as under way"
        );
    }

    #[tokio::test]
    async fn a_step_outside_any_scope_is_not_shown_under_way() {
        let timeline = Arc::new(Timeline::new(None));
        let guard = step(Step::Start, "pve1");
        assert!(timeline.machines.lock().open.is_empty());
        drop(guard);
    }
}
