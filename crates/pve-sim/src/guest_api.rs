//! Guest agent endpoints (ping, file-write, exec, exec-status) on top of the
//! built-in agent in [`crate::agent`].

use std::sync::Arc;

use base64::Engine;
use serde_json::{json, Value};

use crate::agent::{self, AgentState, ExecResult, ExecSlot, GuestExec};
use crate::params::Params;
use crate::sim::{prepare_root, Shared};
use crate::state::{ApiError, ApiResult, Vm};

impl Shared {
    // ---- guest agent ----

    fn agent_vm(&self, node: &str, vmid: u32) -> ApiResult<Vm> {
        let c = self.cluster.lock();
        let vm = c.vm_on(node, vmid)?;
        if !vm.running {
            return Err(ApiError::internal(format!("VM {vmid} is not running")));
        }
        if !vm.agent_enabled() {
            return Err(ApiError::internal("No QEMU guest agent configured"));
        }
        let booted = vm
            .started_at
            .is_some_and(|t| t.elapsed() >= self.cfg.agent_boot_delay);
        if !booted {
            return Err(ApiError::internal("QEMU guest agent is not running"));
        }
        let vm = vm.clone();
        drop(c);
        prepare_root(&vm.guest_root).map_err(|e| ApiError::internal(e.to_string()))?;
        Ok(vm)
    }

    pub fn agent_ping(&self, node: &str, vmid: u32) -> ApiResult {
        self.agent_vm(node, vmid)?;
        Ok(json!({"result": {}}))
    }

    pub fn agent_file_write(&self, node: &str, vmid: u32, p: &Params) -> ApiResult {
        let vm = self.agent_vm(node, vmid)?;
        let file = p.get("file").unwrap_or_default();
        let content = p.get("content").unwrap_or_default();
        let bytes = if p.bool("encode").unwrap_or(true) {
            content.as_bytes().to_vec()
        } else {
            base64::engine::general_purpose::STANDARD
                .decode(content.trim())
                .map_err(|e| {
                    agent_err(
                        vmid,
                        "guest-file-write",
                        &format!("invalid base64 content: {e}"),
                    )
                })?
        };
        let path = agent::guest_path(&vm.guest_root, file)
            .map_err(|e| agent_err(vmid, "guest-file-open", &e))?;
        std::fs::write(&path, &bytes).map_err(|e| {
            agent_err(
                vmid,
                "guest-file-open",
                &format!("failed to open file '{file}': {e}"),
            )
        })?;
        Ok(Value::Null)
    }

    pub fn agent_exec(self: &Arc<Self>, node: &str, vmid: u32, p: &Params) -> ApiResult {
        let vm = self.agent_vm(node, vmid)?;
        let command = p.all("command").to_vec();
        if command.is_empty() {
            return Err(ApiError::param(
                "command",
                "property is missing and it is not optional",
            ));
        }
        let exec = GuestExec {
            vmid,
            node: node.to_string(),
            command,
            input: p.get("input-data").map(|s| s.as_bytes().to_vec()),
            root: vm.guest_root.clone(),
        };
        let handled = self.guest.handle(&exec);
        let child = match handled {
            Some(_) => None,
            None => {
                Some(agent::spawn_process(&exec).map_err(|e| agent_err(vmid, "guest-exec", &e))?)
            }
        };
        let limit = self.cfg.exec_output_limit;
        let mut c = self.cluster.lock();
        let agent = c.agents.entry(vmid).or_default();
        let pid = agent.next_pid;
        agent.next_pid += 1;
        let me = Arc::clone(self);
        let join = tokio::spawn(async move {
            let result = match (handled, child) {
                (Some(out), _) => {
                    tokio::time::sleep(out.delay).await;
                    Ok(ExecResult::from_output(&out, limit))
                }
                (None, Some(child)) => agent::collect(child, exec.input, limit).await,
                (None, None) => Err("no command to run".to_string()),
            };
            let result = result.unwrap_or_else(|e| ExecResult {
                exitcode: Some(127),
                err: e.into_bytes(),
                ..ExecResult::default()
            });
            let mut c = me.cluster.lock();
            if let Some(a) = c.agents.get_mut(&vmid) {
                if a.procs.contains_key(&pid) {
                    a.procs.insert(pid, ExecSlot::Exited(result));
                }
            }
            drop(c);
            me.changed.notify_waiters();
        });
        let agent = c.agents.entry(vmid).or_default();
        agent
            .procs
            .insert(pid, ExecSlot::Running(join.abort_handle()));
        Ok(json!({"pid": pid}))
    }

    pub fn agent_exec_status(&self, node: &str, vmid: u32, pid: u64) -> ApiResult {
        self.agent_vm(node, vmid)?;
        let mut c = self.cluster.lock();
        let agent: &mut AgentState = c.agents.entry(vmid).or_default();
        match agent.procs.get(&pid) {
            None => Err(agent_err(
                vmid,
                "guest-exec-status",
                "Invalid parameter 'pid'",
            )),
            Some(ExecSlot::Running(_)) => Ok(json!({"exited": 0})),
            Some(ExecSlot::Exited(_)) => {
                // qemu-ga forgets the pid once it reported the exit.
                let Some(ExecSlot::Exited(r)) = agent.procs.remove(&pid) else {
                    return Err(agent_err(
                        vmid,
                        "guest-exec-status",
                        "Invalid parameter 'pid'",
                    ));
                };
                if self.faults.take_exec_status_drop() {
                    return Err(ApiError::internal(format!(
                        "VM {vmid} qmp command 'guest-exec-status' failed - got timeout"
                    )));
                }
                Ok(r.to_json())
            }
        }
    }
}

fn agent_err(vmid: u32, cmd: &str, msg: &str) -> ApiError {
    ApiError::internal(format!("VM {vmid} qmp command '{cmd}' failed - {msg}"))
}
