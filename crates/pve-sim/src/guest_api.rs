//! Guest agent endpoints (ping, file-write, exec, exec-status, and the
//! guest's modelled facts: host name, OS, interfaces) on top of the
//! built-in agent in [`crate::agent`], or forwarded to the VM's real `qemu-ga`
//! ([`crate::qga`]). The checks PVE makes before reaching the agent (running,
//! agent configured, booted) and the simulator's fault injection stay here, in
//! front of either agent.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use serde_json::{json, Value};

use crate::agent::{self, AgentState, ExecResult, ExecSlot, GuestExec};
use crate::params::Params;
use crate::qga::{QgaError, QgaErrorKind, QgaProcess};
use crate::sim::{prepare_root, Shared, WaitGuard};
use crate::state::{ApiError, ApiResult, Vm};

impl Shared {
    // ---- guest agent ----

    /// The VM if its agent answers, plus its qemu-ga when forwarding. qemu-ga is
    /// started on first use after boot rather than at start, so seeded and
    /// out-of-band-started VMs get one too and idle VMs cost no process.
    ///
    /// Like PVE, it first gives a booting agent up to `agent_ping_wait` to
    /// answer (qemu-server's `guest-ping` with a 3 s timeout): a request
    /// made during boot is answered when the agent comes up within that
    /// window, and fails with "QEMU guest agent is not running" after it.
    async fn agent_vm(&self, node: &str, vmid: u32) -> ApiResult<(Vm, Option<Arc<QgaProcess>>)> {
        let (boot, started_at) = {
            let c = self.cluster.lock();
            let vm = c.vm_on(node, vmid)?;
            if !vm.running {
                return Err(ApiError::internal(format!("VM {vmid} is not running")));
            }
            if !vm.agent_enabled() {
                return Err(ApiError::internal("No QEMU guest agent configured"));
            }
            let boot = vm.started_at.map_or(Duration::ZERO, |t| {
                self.cfg.agent_boot_delay.saturating_sub(t.elapsed())
            });
            (boot, vm.started_at)
        };
        if !boot.is_zero() {
            let _waiting = WaitGuard::new(&self.agent_waits, node);
            if boot > self.cfg.agent_ping_wait {
                tokio::time::sleep(self.cfg.agent_ping_wait).await;
                return Err(ApiError::internal("QEMU guest agent is not running"));
            }
            tokio::time::sleep(boot).await;
        }
        let c = self.cluster.lock();
        let vm = c.vm_on(node, vmid)?;
        // Stopped or restarted while the request waited: that boot's agent
        // is gone.
        if !vm.running || vm.started_at != started_at {
            return Err(ApiError::internal("QEMU guest agent is not running"));
        }
        let vm = vm.clone();
        drop(c);
        prepare_root(&vm.guest_root).map_err(|e| ApiError::internal(e.to_string()))?;
        let Some(bin) = &self.qga_bin else {
            return Ok((vm, None));
        };
        let mut c = self.cluster.lock();
        // Stopped or restarted meanwhile: that boot's agent is gone.
        if c.vms.get(&vmid).map(|v| v.started_at) != Some(vm.started_at) {
            return Err(ApiError::internal("QEMU guest agent is not running"));
        }
        let state = c.agents.entry(vmid).or_default();
        let q = match &state.qga {
            Some(q) => Arc::clone(q),
            None => {
                let q = Arc::new(QgaProcess::spawn(bin, &vm.guest_root).map_err(|e| {
                    ApiError::internal(format!("starting qemu-ga for VM {vmid}: {e}"))
                })?);
                tracing::debug!(vmid, pid = q.pid(), "started qemu-ga");
                state.qga = Some(Arc::clone(&q));
                q
            }
        };
        Ok((vm, Some(q)))
    }

    /// PID of `vmid`'s qemu-ga while it runs.
    pub fn qga_pid(&self, vmid: u32) -> Option<u32> {
        let c = self.cluster.lock();
        let q = c.agents.get(&vmid)?.qga.as_ref()?;
        q.is_running().then(|| q.pid())
    }

    pub async fn agent_ping(&self, node: &str, vmid: u32) -> ApiResult {
        let (_, qga) = self.agent_vm(node, vmid).await?;
        if let Some(q) = qga {
            q.ping().await.map_err(|e| qga_err(vmid, &e))?;
        }
        Ok(json!({"result": {}}))
    }

    pub async fn agent_file_write(&self, node: &str, vmid: u32, p: &Params) -> ApiResult {
        let (vm, qga) = self.agent_vm(node, vmid).await?;
        let file = p.get("file").unwrap_or_default();
        let content = p.get("content").unwrap_or_default();
        let bytes = if p.bool("encode").unwrap_or(true) {
            self.perl_bytes(content)?
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
        if let Some(q) = qga {
            // qemu-ga names the host path in its errors; the caller knows the guest path.
            let host = path.to_string_lossy().into_owned();
            q.file_write(&path, &bytes)
                .await
                .map_err(|e| agent_err(vmid, &e.command, &e.pve_text().replace(&host, file)))?;
            return Ok(Value::Null);
        }
        std::fs::write(&path, &bytes).map_err(|e| {
            agent_err(
                vmid,
                "guest-file-open",
                &format!("failed to open file '{file}': {e}"),
            )
        })?;
        Ok(Value::Null)
    }

    pub async fn agent_exec(self: &Arc<Self>, node: &str, vmid: u32, p: &Params) -> ApiResult {
        let (vm, qga) = self.agent_vm(node, vmid).await?;
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
            input: p
                .get("input-data")
                .map(|s| self.perl_bytes(s))
                .transpose()?,
            root: vm.guest_root.clone(),
        };
        let handled = self.guest.handle(&exec);
        if let (None, Some(q)) = (&handled, qga) {
            let argv = agent::map_args(&exec.root, &exec.command);
            let remote = q
                .exec(&argv, exec.input.as_deref())
                .await
                .map_err(|e| qga_err(vmid, &e))?;
            let mut c = self.cluster.lock();
            let agent = c.agents.entry(vmid).or_default();
            let pid = agent.next_pid;
            agent.next_pid += 1;
            agent.procs.insert(pid, ExecSlot::Remote(remote));
            return Ok(json!({"pid": pid}));
        }
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

    pub async fn agent_exec_status(&self, node: &str, vmid: u32, pid: u64) -> ApiResult {
        let (_, qga) = self.agent_vm(node, vmid).await?;
        let remote = match self.local_exec_status(vmid, pid)? {
            Ok(v) => return Ok(v),
            Err(remote) => remote,
        };
        let Some(q) = qga else {
            return Err(agent_err(
                vmid,
                "guest-exec-status",
                "Invalid parameter 'pid'",
            ));
        };
        let st = q.exec_status(remote).await;
        let forget = || {
            if let Some(a) = self.cluster.lock().agents.get_mut(&vmid) {
                a.procs.remove(&pid);
            }
        };
        let st = match st {
            Ok(st) => st,
            Err(e) => {
                if matches!(e.kind, QgaErrorKind::Agent { .. }) {
                    forget(); // qemu-ga does not know the pid (any more)
                }
                return Err(qga_err(vmid, &e));
            }
        };
        if !st["exited"].as_bool().unwrap_or(false) {
            return Ok(json!({"exited": 0}));
        }
        // qemu-ga forgot the pid with this reply; so do we.
        forget();
        let r = ExecResult::from_qga(&st, self.cfg.exec_output_limit)
            .map_err(|e| agent_err(vmid, "guest-exec-status", &e))?;
        if self.faults.take_exec_status_drop() {
            return Err(ApiError::internal(format!(
                "VM {vmid} qmp command 'guest-exec-status' failed - got timeout"
            )));
        }
        Ok(r.to_json(self.cfg.agent_latin1))
    }

    /// Status of a built-in exec, or `Err(remote pid)` for one forwarded to qemu-ga.
    fn local_exec_status(&self, vmid: u32, pid: u64) -> ApiResult<Result<Value, i64>> {
        let mut c = self.cluster.lock();
        let agent: &mut AgentState = c.agents.entry(vmid).or_default();
        Ok(Ok(match agent.procs.get(&pid) {
            Some(ExecSlot::Remote(r)) => return Ok(Err(*r)),
            None => {
                return Err(agent_err(
                    vmid,
                    "guest-exec-status",
                    "Invalid parameter 'pid'",
                ))
            }
            Some(ExecSlot::Running(_)) => json!({"exited": 0}),
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
                r.to_json(self.cfg.agent_latin1)
            }
        }))
    }
}

impl Shared {
    /// The bytes PVE hands the agent for a text parameter: it base64-encodes the
    /// decoded string with Perl's `encode_base64`, which takes each character
    /// up to U+00FF as one byte and dies on anything wider.
    fn perl_bytes(&self, s: &str) -> ApiResult<Vec<u8>> {
        if !self.cfg.agent_latin1 {
            return Ok(s.as_bytes().to_vec());
        }
        s.chars()
            .map(|ch| u8::try_from(u32::from(ch)).ok())
            .collect::<Option<Vec<u8>>>()
            .ok_or_else(|| ApiError::internal("Wide character in subroutine entry"))
    }

    /// `GET .../agent/network-get-interfaces`: the simulated guest's `lo` and
    /// `eth0` (MAC as in the VM's `net0`, an address derived from the VMID).
    pub async fn agent_network_interfaces(&self, node: &str, vmid: u32) -> ApiResult {
        let (vm, _) = self.agent_vm(node, vmid).await?;
        let (hi, lo) = ((vm.vmid >> 8) & 0xff, vm.vmid & 0xff);
        let mac = format!("bc:24:11:00:{hi:02x}:{lo:02x}");
        let stats = json!({
            "rx-bytes": 0, "rx-dropped": 0, "rx-errs": 0, "rx-packets": 0,
            "tx-bytes": 0, "tx-dropped": 0, "tx-errs": 0, "tx-packets": 0,
        });
        Ok(json!({"result": [
            {
                "name": "lo",
                "hardware-address": "00:00:00:00:00:00",
                "ip-addresses": [
                    {"ip-address": "127.0.0.1", "ip-address-type": "ipv4", "prefix": 8},
                    {"ip-address": "::1", "ip-address-type": "ipv6", "prefix": 128},
                ],
                "statistics": stats,
            },
            {
                "name": "eth0",
                "hardware-address": mac,
                "ip-addresses": [
                    {"ip-address": format!("10.99.{hi}.{lo}"), "ip-address-type": "ipv4", "prefix": 16},
                    {
                        "ip-address": format!("fe80::be24:11ff:fe00:{:04x}", vm.vmid & 0xffff),
                        "ip-address-type": "ipv6",
                        "prefix": 64,
                    },
                ],
                "statistics": stats,
            },
        ]}))
    }

    /// `GET .../agent/get-osinfo`: the simulated guest's OS.
    pub async fn agent_osinfo(&self, node: &str, vmid: u32) -> ApiResult {
        self.agent_vm(node, vmid).await?;
        Ok(json!({"result": {
            "id": "debian",
            "name": "Debian GNU/Linux",
            "pretty-name": "Debian GNU/Linux 12 (bookworm)",
            "version": "12 (bookworm)",
            "version-id": "12",
            "kernel-release": "6.1.0-28-amd64",
            "kernel-version": "#1 SMP PREEMPT_DYNAMIC Debian 6.1.119-1 (2024-11-22)",
            "machine": "x86_64",
        }}))
    }

    /// `GET .../agent/get-host-name`: the guest's hostname as modelled (its
    /// `/etc/hostname`, see [`crate::guest_root`]), never the machine's own,
    /// which a real qemu-ga would report.
    pub async fn agent_host_name(&self, node: &str, vmid: u32) -> ApiResult {
        let (vm, _) = self.agent_vm(node, vmid).await?;
        let name = std::fs::read_to_string(vm.guest_root.join(crate::guest_root::HOSTNAME_FILE))
            .map_err(|e| agent_err(vmid, "guest-get-host-name", &e.to_string()))?;
        Ok(json!({"result": {"host-name": name.trim()}}))
    }

    /// `GET .../agent/info`: the agent's version and the commands it supports.
    pub async fn agent_info(&self, node: &str, vmid: u32) -> ApiResult {
        self.agent_vm(node, vmid).await?;
        let cmds: Vec<Value> = AGENT_COMMANDS
            .iter()
            .map(
                |c| json!({"name": c, "enabled": true, "success-response": *c != "guest-shutdown"}),
            )
            .collect();
        Ok(json!({"result": {"version": "7.2.15", "supported_commands": cmds}}))
    }
}

/// Commands the simulated agent advertises in `guest-info`.
const AGENT_COMMANDS: &[&str] = &[
    "guest-exec",
    "guest-exec-status",
    "guest-file-close",
    "guest-file-open",
    "guest-file-write",
    "guest-get-host-name",
    "guest-get-osinfo",
    "guest-info",
    "guest-network-get-interfaces",
    "guest-ping",
    "guest-shutdown",
    "guest-sync",
    "guest-sync-delimited",
];

/// A forwarded command's failure, in the same shape as the built-in agent's.
fn qga_err(vmid: u32, e: &QgaError) -> ApiError {
    agent_err(vmid, &e.command, &e.pve_text())
}

fn agent_err(vmid: u32, cmd: &str, msg: &str) -> ApiError {
    ApiError::internal(format!("VM {vmid} qmp command '{cmd}' failed - {msg}"))
}
