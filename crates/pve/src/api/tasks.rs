//! Worker tasks: a task's status and log, asked of the node that runs it,
//! and waiting for a task to end.

use std::time::Duration;

use http::Method;

use crate::client::PveClient;
use crate::error::{Cause, PveError};
use crate::form::{encode_segment, Params};
use crate::types::{exit_ok, TaskLogLine, TaskState, TaskStatus, TaskSummary};
use crate::upid::Upid;

/// `/nodes/{upid.node}/tasks/{upid}{rest}`.
fn task_path(upid: &Upid, rest: &str) -> String {
    format!(
        "/nodes/{}/tasks/{}{rest}",
        encode_segment(&upid.node),
        encode_segment(upid.as_str())
    )
}

impl PveClient {
    /// `GET /nodes/{upid.node}/tasks/{upid}/status` (asks the node that runs the task).
    pub async fn task_status(&self, upid: &Upid) -> Result<TaskStatus, PveError> {
        self.call(
            "task_status",
            Method::GET,
            &task_path(upid, "/status"),
            &Params::new(),
        )
        .await
    }

    /// `GET /nodes/{node}/tasks?source=active&typefilter=T`: the tasks of
    /// type `task_type` running on `node` that the token may see (its own,
    /// or every one with `Sys.Audit` on `/nodes/{node}`). PVE lists at most
    /// `limit` rows; 500 covers any burst one provider starts.
    pub async fn active_tasks(
        &self,
        node: &str,
        task_type: &str,
    ) -> Result<Vec<TaskSummary>, PveError> {
        let mut p = Params::new();
        p.push("source", "active");
        p.push("typefilter", task_type);
        p.push("limit", "500");
        self.call(
            "node_tasks",
            Method::GET,
            &format!("/nodes/{}/tasks", encode_segment(node)),
            &p,
        )
        .await
    }

    /// `GET /nodes/{node}/tasks?source=all&since=S`: every task of `node`
    /// the token may see (its own at least) started at `since` (Unix
    /// seconds) or later: those running (`status: RUNNING`), and those
    /// ended, with their exit status in `status` and their `endtime`,
    /// whether pveproxy has archived them yet or not (pve-manager's
    /// `node_tasks` reads the active list, then the archive index, whose
    /// lines hold what the task's own status read would say). One request
    /// tells a whole burst's tasks apart and says how each that ended
    /// ended. PVE lists at most `limit` rows, newest first: a task past
    /// them is not listed, and its status is to be read on its own.
    pub async fn node_tasks_since(
        &self,
        node: &str,
        since: u64,
    ) -> Result<Vec<TaskSummary>, PveError> {
        let mut p = Params::new();
        p.push("source", "all");
        p.push("since", since.to_string());
        p.push("limit", "500");
        self.call(
            "node_tasks_since",
            Method::GET,
            &format!("/nodes/{}/tasks", encode_segment(node)),
            &p,
        )
        .await
    }

    /// `GET /nodes/{upid.node}/tasks/{upid}/log?start=S&limit=L`.
    pub async fn task_log(
        &self,
        upid: &Upid,
        start: u64,
        limit: u64,
    ) -> Result<Vec<TaskLogLine>, PveError> {
        let mut p = Params::new();
        p.push("start", start.to_string());
        p.push("limit", limit.to_string());
        self.call("task_log", Method::GET, &task_path(upid, "/log"), &p)
            .await
    }

    /// Polls the task every `poll` until it stops or `deadline` passes. `OK` and
    /// `WARNINGS: N` succeed; any other exit status is [`PveError::TaskFailed`].
    /// Transient poll failures (unreachable node, transport, timeout) are polled
    /// through until the deadline; other errors end the wait. A poll in flight at
    /// the deadline is allowed to finish.
    pub async fn wait_task(
        &self,
        upid: &Upid,
        deadline: tokio::time::Instant,
        poll: Duration,
    ) -> Result<TaskStatus, PveError> {
        let poll = poll.max(Duration::from_millis(10));
        loop {
            let last_error = match self.task_status(upid).await {
                Ok(st) if st.status == TaskState::Stopped => {
                    let es = st.exitstatus.clone().unwrap_or_default();
                    if exit_ok(&es) {
                        return Ok(st);
                    }
                    return Err(PveError::TaskFailed {
                        upid: upid.to_string(),
                        exitstatus: if es.is_empty() {
                            "stopped without an exit status".into()
                        } else {
                            es
                        },
                    });
                }
                Ok(_) => None,
                Err(e) if e.is_unanswered() => Some(Cause::new(e)),
                Err(e) => return Err(e),
            };
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Err(PveError::TaskDeadline {
                    upid: upid.to_string(),
                    last_error,
                });
            }
            tokio::time::sleep_until((now + poll).min(deadline)).await;
        }
    }
}
