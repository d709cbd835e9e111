//! Work inside the guest through the qemu guest agent: waiting for it,
//! naming the guest after its VM (the hostname kubelet registers the node
//! under) and checking the name took, delivering the bootstrap blob in
//! chunks, running the bootstrap hook, the readiness probes (with what the
//! last one said) and the drain, each with exit status and output, and the
//! blob kept out of every quoted output. Every command run on the node's
//! behalf gets its node name in [`NODE_NAME_ENV`](super::options::NODE_NAME_ENV).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pve::{ExecStatus, FileEncoding, PveError};
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use super::api::{err, err_at, kind_of, Api};
use super::options::PveOptions;

use command::{
    configure_argv, drain_command, exec_outcome, exec_outcome_with, join_argv, part_path,
    read_back_hostname, split_configure, tail, with_node_name, CONFIGURE_MARK,
};
use providerkit::ErrorKind;

use crate::redact::Redactor;
use crate::substrate::{SubstrateError, VmRef};
use crate::timeline::{self, Step, StepGuard};

mod boots;
mod command;
mod gate;

use boots::Boots;
use gate::WaitGate;

/// What one ping of a guest agent found.
enum Ping {
    Up,
    /// Not up yet (the error that said so).
    NotYet(PveError),
}

/// Raw bytes per file-write chunk: 36 KiB base64-encodes to 48 KiB, which
/// stays under the 60 KiB `content` limit and (form-encoded) under the 64 KiB
/// request body limit of older PVE releases.
pub(super) const CHUNK_RAW: usize = 36 * 1024;

/// Why a guest command produced no exit status.
#[derive(Clone, Debug, thiserror::Error)]
pub(super) enum ExecError {
    #[error(transparent)]
    Api(#[from] PveError),
    /// The agent did not come up for a command PVE refused to send.
    #[error(transparent)]
    Agent(SubstrateError),
    #[error("guest pid {pid} was still running after {timeout:?}")]
    Deadline { pid: u32, timeout: Duration },
    #[error(
        "the exit status of guest pid {pid} was lost: the agent's answer failed ({first}) and \
         qemu-ga forgets a pid once it has reported its exit, so success cannot be confirmed"
    )]
    Lost { pid: u32, first: String },
}

/// The guest's hostname, read back after the hostname command, is not its
/// VM name: kubelet would register the node under the wrong name, and the
/// readiness and drain commands would act on another machine's node.
#[derive(Clone, Debug, thiserror::Error)]
#[error("the guest's hostname is {guest:?}, not its VM name {vm_name:?}")]
pub(super) struct HostnameMismatch {
    pub(super) vm_name: String,
    pub(super) guest: String,
}

impl ExecError {
    pub(super) fn kind(&self) -> ErrorKind {
        match self {
            ExecError::Api(e) => kind_of(e),
            ExecError::Agent(e) => e.kind(),
            // The command may still be running or may have finished: not
            // safely retried.
            ExecError::Deadline { .. } | ExecError::Lost { .. } => ErrorKind::Permanent,
        }
    }
}

/// `{context}: {e}` for a guest command that produced no exit status.
pub(super) fn exec_err(context: impl std::fmt::Display, e: &ExecError) -> SubstrateError {
    SubstrateError::caused_by(e.kind(), context, e.clone())
}

/// The readiness probes of one Configure.
struct Probes {
    attempts: u32,
    /// The readiness step of the machine's timeline, from the first probe
    /// to Ready (dropped unfinished, it is recorded as abandoned).
    step: Option<StepGuard>,
    /// The last failed probe, already redacted.
    last: Option<String>,
    /// Built from this Configure's blob: probe output can repeat it too
    /// (a join token read back from a file the bootstrap wrote).
    redactor: Arc<Redactor>,
}

/// The guest-agent work of every VM, and the readiness probes of each
/// Configure since its last verdict.
pub(super) struct Guest {
    api: Arc<Api>,
    /// The options this part reads.
    opts: Arc<PveOptions>,
    /// Readiness probes since the last Configure, by VMID: what a readiness
    /// timeout's `last_error` quotes.
    probes: Mutex<HashMap<u32, Probes>>,
    /// Each VM's name, by VMID: the node name its commands are given. Learnt
    /// from the status EnsureRunning reads before every Configure and Drain.
    names: Mutex<HashMap<u32, String>>,
    /// When to ping the agent after a start (see [`boots`]).
    boots: Boots,
    /// Per node, the one ping that may wait for a boot (see [`gate`]).
    waits: WaitGate,
    /// Templates whose guest was asked whether it grows its root file
    /// system at boot (once per template per process).
    grow_checked: Mutex<std::collections::HashSet<u32>>,
}

/// Whether the guest has what grows its root file system to a larger boot
/// disk at boot: cloud-utils' `growpart` (which cloud-init's growpart
/// module runs) or `systemd-repart`. Exit 0: it has one.
const GROWS_ROOT: &str =
    "command -v growpart >/dev/null 2>&1 || command -v systemd-repart >/dev/null 2>&1";

impl Guest {
    pub(super) fn new(api: Arc<Api>, opts: Arc<PveOptions>) -> Guest {
        Guest {
            api,
            opts,
            probes: Mutex::new(HashMap::new()),
            names: Mutex::new(HashMap::new()),
            boots: Boots::default(),
            waits: WaitGate::default(),
            grow_checked: Mutex::default(),
        }
    }

    /// Once per template, on the first Create of a type that grows the boot
    /// disk: asks the guest whether it can grow its root file system at
    /// boot (the template contract) and warns when it has neither
    /// `growpart` nor `systemd-repart`, as then the disk is larger and the
    /// file system is not. An answer it cannot get is no finding; nothing
    /// here fails the Create.
    pub(super) async fn check_grows_root(&self, vm: &VmRef, template: u32, instance_type: &str) {
        if !self.grow_checked.lock().insert(template) {
            return;
        }
        let argv = ["sh".to_string(), "-c".to_string(), GROWS_ROOT.to_string()];
        let timeout = self.opts.exec_timeout.min(Duration::from_secs(30));
        match self.run(vm, &argv, timeout).await {
            Ok(st) if st.exitcode == Some(0) => {
                tracing::debug!(template, vm = %vm, "the template's guest can grow its root file system at boot");
            }
            Ok(st) => tracing::warn!(
                template,
                vm = %vm,
                instance_type,
                exit_code = ?st.exitcode,
                "template {template}'s guest has neither growpart nor systemd-repart: instance type \
                 {instance_type}'s larger boot disk leaves its root file system at the template's size. \
                 Install cloud-guest-utils with cloud-init's growpart module, or enable systemd-repart, \
                 in the template (docs/configuration.md, the template contract)"
            ),
            Err(e) => {
                tracing::debug!(template, vm = %vm, error = %e, "could not ask the guest whether it grows its root file system");
            }
        }
    }

    /// Whether a readiness command gates Configure.
    pub(super) fn readiness_gate(&self) -> bool {
        !self.opts.readiness_command.trim().is_empty()
    }

    /// Forgets the probes of `vmid` (Drain ends a Configure's story).
    fn forget_probes(&self, vmid: u32) {
        self.probes.lock().remove(&vmid);
    }

    /// Forgets everything about `vmid` (Delete: the VMID may be reused).
    pub(super) fn forget(&self, vmid: u32) {
        self.forget_probes(vmid);
        self.names.lock().remove(&vmid);
    }

    /// Records the VM's name as PVE just reported it.
    pub(super) fn learn_name(&self, vm: &VmRef, name: Option<&str>) {
        let mut names = self.names.lock();
        match name.map(str::trim).filter(|n| !n.is_empty()) {
            Some(n) => names.insert(vm.vmid, n.to_string()),
            None => names.remove(&vm.vmid),
        };
    }

    /// The node name of `vm`: its VM name, as learnt, else read from PVE.
    async fn node_name(&self, vm: &VmRef) -> Result<String, SubstrateError> {
        if let Some(n) = self.names.lock().get(&vm.vmid) {
            return Ok(n.clone());
        }
        let st = self.api.managed_status(vm, self.api.deadline()).await?;
        self.learn_name(vm, st.name.as_deref());
        self.names.lock().get(&vm.vmid).cloned().ok_or_else(|| {
            SubstrateError::new(format!(
                "VM {vm} has no name in Proxmox, and its node is named after it: \
                 give the VM a name (the provider names its clones bigfleet-<type>-<id>)"
            ))
        })
    }

    /// Pings the agent until it answers, polling through boot-time failures.
    pub(super) async fn wait_agent(&self, vm: &VmRef) -> Result<(), SubstrateError> {
        let step = timeline::step(Step::Agent, &vm.node);
        let now = Instant::now();
        let deadline = now + self.opts.agent_timeout;
        step.end(
            self.ping_until_up(vm, self.opts.poll_interval, deadline, now)
                .await,
        )
    }

    /// [`Guest::wait_agent`] right after this provider started the VM, on
    /// the schedule [`boots`] learns: the first ping at about when agents
    /// have answered after a start lately, so a boot costs about one ping.
    pub(super) async fn wait_agent_after_start(&self, vm: &VmRef) -> Result<(), SubstrateError> {
        let step = timeline::step(Step::Agent, &vm.node);
        let boot = self.boots.begin(vm.vmid);
        let deadline = boot.started + self.opts.agent_timeout;
        let poll = self.opts.poll_interval;
        let out = loop {
            if let Some(at) = self.boots.first_ping.at(&vm.node) {
                let first = boot.started + at.min(self.opts.agent_timeout / 2);
                tokio::time::sleep_until(first).await;
                let every = (at / 8).clamp(self.api.first_poll(), poll);
                let sent = Instant::now();
                let out = match self.ping(vm).await {
                    // Answered at once: the estimate was late enough. One
                    // PVE held until the agent came up was early: the
                    // agent was not up when asked, and the wait held one
                    // of the node's pvedaemon workers, so it is a miss
                    // (else the estimate would creep earlier, boot after
                    // boot, each first ping held longer).
                    Ok(Ping::Up) => Ok(sent.elapsed() <= every),
                    Ok(Ping::NotYet(_)) => self
                        .ping_until_up(vm, every, deadline, sent + every)
                        .await
                        .map(|()| false),
                    Err(e) => Err(e),
                };
                if let Ok(first_hit) = out {
                    let took = boot.started.elapsed();
                    self.boots
                        .first_ping
                        .learn(&vm.node, Some(at), first_hit, took);
                }
                break out.map(|_| ());
            }
            // Nothing learnt anywhere: the oldest boot pings through, the
            // others less often until it has learnt.
            let period = if self.boots.is_scout(&boot) {
                poll
            } else {
                poll * boots::FOLLOWER_PERIOD
            };
            tokio::select! {
                () = tokio::time::sleep(period) => {}
                () = self.boots.first_ping.learnt() => continue,
            }
            let (_, pinged) = self.ping_in_turn(vm).await;
            match pinged {
                Ok(Ping::Up) => {
                    self.boots
                        .first_ping
                        .learn(&vm.node, None, false, boot.started.elapsed());
                    break Ok(());
                }
                Ok(Ping::NotYet(e)) if Instant::now() >= deadline => {
                    break Err(self.agent_timed_out(vm, &e))
                }
                Ok(Ping::NotYet(_)) => {}
                Err(e) => break Err(e),
            }
        };
        drop(boot);
        step.end(out)
    }

    /// Pings from `first` on until the agent answers or `deadline` passes,
    /// each `every` after the one before was sent (so one PVE held while
    /// the guest booted is followed at once), and each through the node's
    /// [`WaitGate`].
    async fn ping_until_up(
        &self,
        vm: &VmRef,
        every: Duration,
        deadline: Instant,
        first: Instant,
    ) -> Result<(), SubstrateError> {
        let mut next = first;
        loop {
            tokio::time::sleep_until(next).await;
            let (sent, pinged) = self.ping_in_turn(vm).await;
            next = sent + every;
            match pinged? {
                Ping::Up => return Ok(()),
                Ping::NotYet(e) if Instant::now() >= deadline => {
                    return Err(self.agent_timed_out(vm, &e))
                }
                Ping::NotYet(_) => {}
            }
        }
    }

    /// One ping in the node's turn ([`WaitGate`]), and when it was sent.
    async fn ping_in_turn(&self, vm: &VmRef) -> (Instant, Result<Ping, SubstrateError>) {
        let _turn = self.waits.enter(&vm.node).await;
        let sent = Instant::now();
        (sent, self.ping(vm).await)
    }

    /// One ping. An agent not up yet, or PVE failing transiently on the
    /// way to it (a proxy 503, a reset connection), is [`Ping::NotYet`]:
    /// both heal by themselves, so a wait goes on.
    async fn ping(&self, vm: &VmRef) -> Result<Ping, SubstrateError> {
        match self.api.once(|pve| pve.agent_ping(&vm.node, vm.vmid)).await {
            Ok(()) => {
                tracing::info!(vm = %vm, "guest agent up");
                Ok(Ping::Up)
            }
            Err(e) if e.is_agent_transient() || e.is_transient() => Ok(Ping::NotYet(e)),
            Err(e) => Err(err(format!("pinging the guest agent of VM {vm}"), &e)),
        }
    }

    /// The error of an agent that did not answer within `--agent-timeout`.
    fn agent_timed_out(&self, vm: &VmRef, last: &PveError) -> SubstrateError {
        SubstrateError::new(format!(
            "the guest agent of VM {vm} did not answer within {:?} (last error: {last}); is qemu-guest-agent installed and enabled in the template?",
            self.opts.agent_timeout
        ))
    }

    /// Runs `argv` in the guest and waits for it to exit (bounded by `timeout`).
    async fn run(
        &self,
        vm: &VmRef,
        argv: &[String],
        timeout: Duration,
    ) -> Result<ExecStatus, ExecError> {
        // Exec is not repeated (a second run of the command is not
        // harmless); its status is polled on this loop's own terms.
        let pid = self
            .api
            .once(|pve| pve.agent_exec(&vm.node, vm.vmid, argv, None))
            .await?;
        self.await_exit(vm, pid, timeout).await
    }

    /// [`Guest::run`] for the first command of a Drain, which no agent ping
    /// comes before (see [`Guest::when_agent_up`]).
    async fn run_first(
        &self,
        vm: &VmRef,
        argv: &[String],
        timeout: Duration,
    ) -> Result<ExecStatus, ExecError> {
        let pid = self
            .when_agent_up(vm, || {
                self.api
                    .once(|pve| pve.agent_exec(&vm.node, vm.vmid, argv, None))
            })
            .await
            .map_err(ExecError::Agent)??;
        self.await_exit(vm, pid, timeout).await
    }

    /// Sends the first guest request of a Configure or a Drain, which no
    /// agent ping comes before: qemu-server pings the agent itself before
    /// any agent request and refuses one it could not send (`QEMU guest
    /// agent is not running`, the VM not running). Only then, when nothing
    /// ran, does this wait for the agent (as [`Guest::wait_agent`], up to
    /// `--agent-timeout`) and send it again. A ping before every Configure
    /// and Drain cost a request each to learn what the request's own answer
    /// says. The outer error: the agent did not come up; the inner: the
    /// request's own answer.
    async fn when_agent_up<T, F, Fut>(
        &self,
        vm: &VmRef,
        mut send: F,
    ) -> Result<Result<T, PveError>, SubstrateError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, PveError>>,
    {
        match send().await {
            Err(e) if e.is_agent_unreached() => {
                tracing::info!(vm = %vm, error = %e, "the guest agent did not take the request; waiting for it");
                self.wait_agent(vm).await?;
                Ok(send().await)
            }
            sent => Ok(sent),
        }
    }

    /// Polls guest pid `pid` until it exits or `timeout` passes.
    async fn await_exit(
        &self,
        vm: &VmRef,
        pid: u32,
        timeout: Duration,
    ) -> Result<ExecStatus, ExecError> {
        let deadline = Instant::now() + timeout;
        let mut delay = self.api.first_poll();
        let mut dropped: Option<String> = None;
        loop {
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(self.opts.poll_interval);
            match self
                .api
                .once(|pve| pve.agent_exec_status(&vm.node, vm.vmid, pid))
                .await
            {
                Ok(st) if st.exited => return Ok(st),
                Ok(_) => {}
                // The reply carrying the exit was lost and qemu-ga has forgotten the pid.
                Err(e) if dropped.is_some() && e.is_unknown_pid() => {
                    return Err(ExecError::Lost {
                        pid,
                        first: dropped.unwrap_or_default(),
                    })
                }
                Err(e) if e.is_agent_transient() && Instant::now() < deadline => {
                    dropped = Some(e.to_string());
                }
                Err(e) => return Err(e.into()),
            }
            if Instant::now() >= deadline {
                return Err(ExecError::Deadline { pid, timeout });
            }
        }
    }

    /// Delivers the blob, runs the bootstrap hook on it, and opens the
    /// readiness probes of this Configure. The redactor is built once, off
    /// the async workers (its cost grows with the blob), and serves every
    /// output quoted from here on, the probes' too.
    pub(super) async fn configure(&self, vm: &VmRef, blob: &[u8]) -> Result<(), SubstrateError> {
        let opts = &self.opts;
        if opts.bootstrap_exec.is_empty() {
            return Err(SubstrateError::new("no bootstrap exec configured"));
        }
        let name = self.node_name(vm).await?;
        let redactor = Redactor::build(blob).await;
        // Only kept while the readiness gate may probe; dropped on failure,
        // on the gate's verdict, and by Drain and Delete.
        if self.readiness_gate() {
            self.probes.lock().insert(
                vm.vmid,
                Probes {
                    attempts: 0,
                    step: None,
                    last: None,
                    redactor: Arc::clone(&redactor),
                },
            );
        }
        let outcome = self
            .bootstrap(vm, &name, &opts.bootstrap_path, blob, &redactor)
            .await;
        if outcome.is_err() {
            self.forget_probes(vm.vmid);
        }
        outcome
    }

    /// Writes the blob, then names the guest and runs the bootstrap hook on
    /// it in one guest command ([`configure_argv`]): the hostname command
    /// (skipped when empty), `hostname` read back behind [`CONFIGURE_MARK`],
    /// and only when the name is the VM's, the hook. A guest still carrying
    /// its template's name would register as another machine's node, so
    /// the hook never runs under the wrong name. One exec and its status
    /// instead of two of each: a Configure costs the status read, the
    /// file-write, the exec and its status.
    async fn bootstrap(
        &self,
        vm: &VmRef,
        name: &str,
        path: &str,
        blob: &[u8],
        redactor: &Redactor,
    ) -> Result<(), SubstrateError> {
        timeline::step(Step::BootstrapWrite, &vm.node)
            .end(self.write_blob(vm, path, blob, redactor).await)?;
        tracing::info!(vm = %vm, bytes = blob.len(), "bootstrap blob written");
        let step = timeline::step(Step::BootstrapExec, &vm.node);
        let mut hook = self.opts.bootstrap_exec.clone();
        hook.push(path.to_string());
        let what = format!("bootstrap hook `{}`", hook.join(" "));
        let cmd = self.opts.hostname_command.trim();
        let argv = configure_argv(name, cmd, &hook);
        let st = match self.run(vm, &argv, self.opts.exec_timeout).await {
            Ok(st) => st,
            Err(e) => return step.end(Err(exec_err(format!("running the {what} in VM {vm}"), &e))),
        };
        let (named, hook_st) = split_configure(&st);
        if let Err(e) = self.check_named(vm, name, cmd, &named, redactor) {
            return step.end(Err(e));
        }
        let Some(hook_st) = hook_st else {
            // Named as the VM by the provider's reading, not by the
            // guest's own comparison: nothing ran, and it is said.
            return step.end(Err(SubstrateError::new(format!(
                "VM {vm}: the guest's hostname is {name:?} but the guest did not start the {what}"
            ))));
        };
        tracing::info!(vm = %vm, exit_code = hook_st.exitcode, signal = hook_st.signal, "bootstrap exited");
        step.end(
            exec_outcome_with(&what, &hook_st, redactor)
                .map_err(|e| SubstrateError::new(format!("VM {vm}: {e}"))),
        )
    }

    /// The hostname part of the Configure command: the hostname command's
    /// outcome, then the name read back, which must be the VM's. Its output
    /// is quoted through the blob's redactor too: the blob is in the guest
    /// by then, and a command may repeat it.
    fn check_named(
        &self,
        vm: &VmRef,
        name: &str,
        cmd: &str,
        named: &ExecStatus,
        redactor: &Redactor,
    ) -> Result<(), SubstrateError> {
        let what = if cmd.is_empty() {
            "`hostname`".to_string()
        } else {
            format!("hostname command `{cmd}`")
        };
        let read_back = read_back_hostname(named.out_data.as_deref().unwrap_or_default());
        if read_back.is_none() || !cmd.is_empty() {
            tracing::info!(vm = %vm, exit_code = named.exitcode, signal = named.signal, "hostname command exited");
        }
        let guest = match read_back {
            Some(Ok(guest)) => guest,
            Some(Err(failed)) => {
                let (failed, _) = redactor.redact(&failed, false);
                return Err(SubstrateError::new(format!(
                    "VM {vm}: `hostname` failed in the guest after the {what}: {}",
                    tail(&failed)
                )));
            }
            None => {
                // No read-back: the hostname command failed and ended the
                // shell (its status is the command's), or the shell died.
                exec_outcome_with(&what, named, redactor)
                    .map_err(|e| e.context(format!("VM {vm}")))?;
                return Err(SubstrateError::new(format!(
                    "VM {vm}: the guest's hostname could not be read back after the {what} \
                     (its output lacks the {CONFIGURE_MARK:?} line{})",
                    if named.out_truncated {
                        "; the agent truncated the output"
                    } else {
                        ""
                    }
                )));
            }
        };
        if !guest.eq_ignore_ascii_case(name) {
            let mismatch = HostnameMismatch {
                vm_name: name.to_string(),
                guest,
            };
            let how = if cmd.is_empty() {
                "--hostname-command is empty, so the template must name the guest itself".into()
            } else {
                format!("the hostname command `{cmd}` did not take")
            };
            return Err(SubstrateError::caused_by(
                ErrorKind::Permanent,
                format!("VM {vm}: {how}"),
                mismatch,
            ));
        }
        tracing::info!(vm = %vm, hostname = %name, "guest hostname set");
        Ok(())
    }

    /// Delivers the blob to `path`: one file-write when small; else the
    /// first chunk to `path` and each further one to a part file beside it,
    /// one file-write each, then one command that appends the parts in
    /// order, removes them and prints the sha256 checked here. File-writes
    /// answer at once, where an exec per chunk costs a round trip plus
    /// exec-status polls each.
    async fn write_blob(
        &self,
        vm: &VmRef,
        path: &str,
        blob: &[u8],
        redactor: &Redactor,
    ) -> Result<(), SubstrateError> {
        let ctx = || {
            format!(
                "writing the bootstrap blob ({} bytes) to {path} in VM {vm}",
                blob.len()
            )
        };
        // An empty blob is one empty chunk: the file is still made.
        let chunks: Vec<&[u8]> = if blob.is_empty() {
            vec![blob]
        } else {
            blob.chunks(CHUNK_RAW).collect()
        };
        let mut parts = Vec::new();
        // Writing a chunk again writes the same bytes: repeats are
        // harmless, so transient failures are retried, within one window
        // for the whole blob.
        let deadline = self.api.deadline();
        for (i, chunk) in chunks.into_iter().enumerate() {
            let file = if i == 0 {
                path.to_string()
            } else {
                part_path(path, i)
            };
            // The first guest request of a Configure: it waits for an agent
            // PVE finds not up, and the write (harmless to repeat) goes again.
            self.when_agent_up(vm, || {
                self.api.retry_raw(Some(&vm.node), deadline, |pve| {
                    pve.agent_file_write(&vm.node, vm.vmid, &file, chunk, FileEncoding::Base64)
                })
            })
            .await?
            .map_err(|e| err_at(ctx(), Some(&vm.node), &e))?;
            if i > 0 {
                parts.push(file);
            }
        }
        if parts.is_empty() {
            return Ok(());
        }
        let st = self
            .run(vm, &join_argv(path, &parts), self.opts.exec_timeout)
            .await
            .map_err(|e| exec_err(ctx(), &e))?;
        exec_outcome_with("joining the bootstrap chunks", &st, redactor)
            .map_err(|e| SubstrateError::new(format!("{}: {e}", ctx())))?;
        let want = hex::encode(Sha256::digest(blob));
        let got = st
            .out_data
            .as_deref()
            .and_then(|o| o.split_whitespace().next())
            .unwrap_or_default();
        if !got.eq_ignore_ascii_case(&want) {
            return Err(SubstrateError::new(format!(
                "{}: checksum mismatch after the chunked upload (guest has sha256 {got:?})",
                ctx()
            )));
        }
        Ok(())
    }

    /// One readiness probe: `Ok(true)` when the command succeeds (and the
    /// probes end), `Ok(false)` while it fails or the agent is away (the
    /// failure is kept for [`Guest::readiness_detail`]).
    pub(super) async fn node_ready(&self, vm: &VmRef) -> Result<bool, SubstrateError> {
        if !self.readiness_gate() {
            return Ok(true);
        }
        let opts = &self.opts;
        let name = self.node_name(vm).await?;
        let argv = with_node_name(&name, &opts.readiness_command);
        let outcome = self.run(vm, &argv, opts.readiness_timeout).await;
        let mut probes = self.probes.lock();
        let p = probes.entry(vm.vmid).or_insert_with(|| Probes {
            attempts: 0,
            step: None,
            last: None,
            redactor: Arc::new(Redactor::new(&[])),
        });
        if p.step.is_none() {
            p.step = Some(timeline::step(Step::Readiness, &vm.node));
        }
        p.attempts += 1;
        let attempt = p.attempts;
        match outcome {
            Ok(st) => {
                tracing::info!(vm = %vm, attempt, exit_code = st.exitcode, signal = st.signal, "readiness probe");
                match exec_outcome_with("the readiness command", &st, &p.redactor) {
                    Ok(()) => {
                        if let Some(step) = probes.remove(&vm.vmid).and_then(|p| p.step) {
                            let _: Result<(), String> = step.end(Ok(()));
                        }
                        Ok(true)
                    }
                    Err(e) => {
                        p.last = Some(e.to_string());
                        Ok(false)
                    }
                }
            }
            // Rebooting after the bootstrap: not ready yet.
            Err(ExecError::Api(e)) if e.is_agent_transient() => {
                tracing::info!(vm = %vm, attempt, error = %e, "readiness probe: guest agent not answering");
                p.last = Some(format!("the guest agent did not answer: {e}"));
                Ok(false)
            }
            Err(e) => Err(exec_err(format!("probing readiness of VM {vm}"), &e)),
        }
    }

    /// What the last failed probe said, once (the probes end here).
    pub(super) fn readiness_detail(&self, vm: &VmRef) -> Option<String> {
        let probes = self.probes.lock().remove(&vm.vmid)?;
        let last = probes.last?;
        if let Some(step) = probes.step {
            let _: Result<(), &str> = step.end(Err(last.as_str()));
        }
        Some(format!(
            "last readiness probe (attempt {}): {last}",
            probes.attempts
        ))
    }

    /// Runs the drain command in the guest.
    pub(super) async fn drain(&self, vm: &VmRef, grace: Duration) -> Result<(), SubstrateError> {
        self.forget_probes(vm.vmid);
        let opts = &self.opts;
        if opts.drain_command.trim().is_empty() {
            return Err(SubstrateError::new("no drain command configured"));
        }
        let name = self.node_name(vm).await?;
        let cmd = drain_command(&opts.drain_command, grace, opts.drain_timeout);
        tracing::info!(vm = %vm, node_name = %name, command = %cmd, "draining");
        let argv = with_node_name(&name, &cmd);
        let step = timeline::step(Step::Drain, &vm.node);
        let st = match self
            .run_first(vm, &argv, opts.drain_timeout + Duration::from_secs(30))
            .await
        {
            Ok(st) => st,
            Err(e) => return step.end(Err(exec_err(format!("draining VM {vm}"), &e))),
        };
        tracing::info!(vm = %vm, exit_code = st.exitcode, signal = st.signal, "drain command exited");
        step.end(
            exec_outcome("drain command", &st)
                .map_err(|e| SubstrateError::new(format!("VM {vm}: {e}"))),
        )
    }
}
