//! Clones a previous provider process started and did not see finish.
//!
//! A Create resumed after a restart may find no VM marked for its machine
//! while the clone the dead process started is still running: PVE writes
//! the clone's config (with its name and marker) only when the clone
//! worker ends, and until then the VM is a bare `lock: clone` config that,
//! under a pool-scoped token, is not even listed. Cloning again then would
//! leave two VMs for one machine. So a resumed Create first waits for the
//! clone tasks of this token that were running on the nodes it clones from
//! when it first looked (`GET /nodes/{node}/tasks?source=active`, which
//! lists a token's own tasks without any extra privilege), then looks for
//! its VM again.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use pve::{PveError, Upid};
use tokio::sync::OnceCell;
use tokio::time::Instant;

use super::api::{err_at, Api};
use crate::substrate::SubstrateError;

/// The clone tasks found running per node at the first look after start-up.
pub(super) struct InterruptedClones {
    api: Arc<Api>,
    by_node: Mutex<HashMap<String, Arc<OnceCell<Vec<Upid>>>>>,
}

impl InterruptedClones {
    pub(super) fn new(api: Arc<Api>) -> InterruptedClones {
        InterruptedClones {
            api,
            by_node: Mutex::new(HashMap::new()),
        }
    }

    /// The clone tasks that were running on `node` when a resumed Create
    /// first asked (read once per node per process: later clones are this
    /// process's own, which it tracks itself).
    async fn running_at_start(
        &self,
        node: &str,
        deadline: Instant,
    ) -> Result<Vec<Upid>, SubstrateError> {
        let cell = Arc::clone(self.by_node.lock().entry(node.to_string()).or_default());
        let api = &self.api;
        cell.get_or_try_init(|| async {
            let tasks = api
                .retry_raw(Some(node), deadline, |pve| {
                    pve.active_tasks(node, "qmclone")
                })
                .await
                .map_err(|e| {
                    err_at(
                        format!("listing the clone tasks running on node {node}"),
                        Some(node),
                        &e,
                    )
                })?;
            Ok(tasks
                .into_iter()
                .filter(|t| t.is_running())
                .filter_map(|t| Upid::parse(&t.upid).ok())
                .collect())
        })
        .await
        .cloned()
    }

    /// Wait until every clone task that was running on `nodes` at start-up
    /// has ended, or `deadline` passes. Returns how many were waited for.
    pub(super) async fn settle(
        &self,
        machine_id: &str,
        nodes: &[&str],
        deadline: Instant,
    ) -> Result<usize, SubstrateError> {
        let mut waited = 0;
        for node in nodes {
            for upid in self.running_at_start(node, deadline).await? {
                tracing::info!(machine_id, node, upid = %upid, "a clone started before the restart is still running; waiting for it before looking for this machine's VM");
                match self.api.wait_task_until(&upid, deadline).await {
                    // However it ended: a failed clone left no VM behind.
                    Ok(_) | Err(PveError::TaskFailed { .. }) => {}
                    Err(e) => {
                        return Err(err_at(
                            format!(
                            "waiting for clone task {upid}, started before the provider restarted"
                        ),
                            Some(node),
                            &e,
                        ))
                    }
                }
                waited += 1;
            }
        }
        Ok(waited)
    }
}
