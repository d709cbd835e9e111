//! At most one agent ping per node that may wait for a boot.
//!
//! PVE asks the agent for a `guest-ping`, with a 3 s timeout, before every
//! agent request (qemu-server's `qga_check_running`), so a ping to a guest
//! still booting is held until the agent comes up or the 3 s pass. It is
//! held in one of the node's pvedaemon workers (three by default), which
//! serves nothing else meanwhile. A wave of boots each pinged on its own
//! would hold all three, and the node's other API calls (this provider's
//! clones and starts, the web UI, other tools) would queue behind them;
//! a template whose guest has no agent would hold them for the whole agent
//! timeout. So the pings that may wait (every ping after one that found
//! the agent not up, and every ping while nothing is learnt of boots) go
//! through the node's gate, one at a time. The first ping at a learnt
//! estimate does not: it usually finds the agent up and returns at once.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Per node, the one ping that may wait.
#[derive(Default)]
pub(super) struct WaitGate {
    per_node: Mutex<HashMap<String, Arc<Semaphore>>>,
}

impl WaitGate {
    /// Waits for `node`'s turn; the turn ends when the permit drops.
    pub(super) async fn enter(&self, node: &str) -> Option<OwnedSemaphorePermit> {
        let gate = Arc::clone(
            self.per_node
                .lock()
                .entry(node.to_string())
                .or_insert_with(|| Arc::new(Semaphore::new(1))),
        );
        // Never closed: an error cannot happen, and would only mean no gate.
        gate.acquire_owned().await.ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_turn_per_node_at_a_time() {
        let gate = WaitGate::default();
        let first = gate.enter("pve1").await;
        assert!(first.is_some());
        // Another node has its own turn.
        assert!(gate.enter("pve2").await.is_some());
        // The same node waits until the first turn ends.
        let second =
            tokio::time::timeout(std::time::Duration::from_millis(50), gate.enter("pve1")).await;
        assert!(
            second.is_err(),
            "a second turn on pve1 while the first is held"
        );
        drop(first);
        assert!(gate.enter("pve1").await.is_some());
    }
}
