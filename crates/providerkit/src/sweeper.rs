//! The automatic reclaim behind `--reclaim-failed-after`: a client of the
//! engine's public face, as the gRPC service is, so it lives beside the
//! service rather than inside the engine it drives.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::engine::{humanize, Engine, ReclaimError, ReclaimOutcome};

/// A machine is reclaimed once this process has seen it FAILED for the
/// whole hold period. The clock starts when the sweeper first sees the
/// machine FAILED (after a restart it starts over: the hold is never
/// shortened, only lengthened).
pub struct ReclaimSweeper {
    hold: Duration,
    first_seen: HashMap<String, Instant>,
}

impl ReclaimSweeper {
    pub fn new(hold: Duration) -> ReclaimSweeper {
        ReclaimSweeper {
            hold,
            first_seen: HashMap::new(),
        }
    }

    /// How often to sweep: often enough that a machine is reclaimed close
    /// to its hold period, rarely enough to cost nothing.
    pub fn period(&self) -> Duration {
        (self.hold / 4).clamp(Duration::from_millis(50), Duration::from_secs(30))
    }

    /// One sweep: reclaim every machine held FAILED long enough. Returns
    /// how many were reclaimed. A failed reclaim starts the machine's hold
    /// over, so a substrate that keeps refusing is retried once per period.
    pub async fn sweep(&mut self, engine: &Arc<Engine>) -> usize {
        let now = Instant::now();
        let failed = engine.failed_ids();
        let mut seen = HashMap::with_capacity(failed.len());
        let mut due = Vec::new();
        for id in failed {
            let since = self.first_seen.get(&id).copied().unwrap_or(now);
            if now.duration_since(since) >= self.hold {
                due.push(id.clone());
            }
            seen.insert(id, since);
        }
        // Machines no longer FAILED are forgotten.
        self.first_seen = seen;
        let mut reclaimed = 0;
        for id in due {
            match engine.reclaim(&id).await {
                Ok(ReclaimOutcome::Reclaimed(_)) => {
                    tracing::info!(machine_id = %id, hold = %humanize(self.hold), "FAILED machine reclaimed automatically (--reclaim-failed-after)");
                    self.first_seen.remove(&id);
                    reclaimed += 1;
                }
                Ok(ReclaimOutcome::AlreadySpeculative(_)) => {
                    self.first_seen.remove(&id);
                }
                Err(ReclaimError::NotFailed { .. }) | Err(ReclaimError::NotFound(_)) => {
                    self.first_seen.remove(&id);
                }
                Err(e) => {
                    tracing::warn!(machine_id = %id, error = %e, "automatic reclaim failed; retrying after another hold period");
                    self.first_seen.insert(id, Instant::now());
                }
            }
        }
        reclaimed
    }
}
