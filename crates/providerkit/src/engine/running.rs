//! What is running, and how the transitions found at start-up ended: the
//! count of transitions in flight that a graceful shutdown waits on, and
//! the resume counters behind `bigfleet_proxmox_resumed_total`. The worker
//! owns both; start-up counts into the resume counters before handing
//! them over (a transition it ends never runs).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::model::TransitionKind;

/// How a transition found at start-up ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ResumeOutcome {
    /// Resumed, and reached the transition's target state.
    Landed,
    /// Resumed, and failed (the machine is FAILED with the substrate's error).
    Failed,
    /// Its deadline had passed by the restart: FAILED, timed out.
    TimedOut,
    /// It could not continue: a Configure without a readiness check (the
    /// bootstrap blob is never stored), or a record written before windows
    /// were stored. FAILED, saying why.
    NotResumable,
}

impl ResumeOutcome {
    pub const ALL: [ResumeOutcome; 4] = [
        ResumeOutcome::Landed,
        ResumeOutcome::Failed,
        ResumeOutcome::TimedOut,
        ResumeOutcome::NotResumable,
    ];

    /// The label value in metrics.
    pub fn name(self) -> &'static str {
        match self {
            ResumeOutcome::Landed => "landed",
            ResumeOutcome::Failed => "failed",
            ResumeOutcome::TimedOut => "timed_out",
            ResumeOutcome::NotResumable => "not_resumable",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Counts of transitions found at start-up, per kind and outcome.
#[derive(Default)]
pub(super) struct ResumeCounters {
    counts: [[AtomicU64; 4]; 4],
}

impl ResumeCounters {
    pub(super) fn add(&self, kind: TransitionKind, outcome: ResumeOutcome) {
        self.counts[kind.index()][outcome.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn snapshot(&self) -> Vec<(TransitionKind, ResumeOutcome, u64)> {
        let mut out = Vec::with_capacity(16);
        for kind in TransitionKind::ALL {
            for outcome in ResumeOutcome::ALL {
                let n = self.counts[kind.index()][outcome.index()].load(Ordering::Relaxed);
                out.push((kind, outcome, n));
            }
        }
        out
    }
}

/// How many transitions are running, and a wake-up when none is.
#[derive(Default)]
pub(super) struct InFlightCount {
    running: AtomicUsize,
    idle: tokio::sync::Notify,
}

impl InFlightCount {
    pub(super) fn enter(self: &Arc<Self>) -> InFlightGuard {
        self.running.fetch_add(1, Ordering::AcqRel);
        InFlightGuard(Arc::clone(self))
    }

    pub(super) fn running(&self) -> usize {
        self.running.load(Ordering::Acquire)
    }

    /// Wait until none is running, or `until`; returns how many still are.
    pub(super) async fn wait_idle(&self, until: tokio::time::Instant) -> usize {
        loop {
            // Registered before the check, so a landing in between wakes us.
            let idle = self.idle.notified();
            let running = self.running();
            if running == 0 {
                return 0;
            }
            if tokio::time::timeout_at(until, idle).await.is_err() {
                return self.running();
            }
        }
    }
}

/// One running transition; dropping it (landed, or its task ended) counts
/// it out.
pub(super) struct InFlightGuard(Arc<InFlightCount>);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if self.0.running.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}
