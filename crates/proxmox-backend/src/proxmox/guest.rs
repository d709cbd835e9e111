//! Work inside the guest through the qemu guest agent: waiting for it,
//! naming the guest after its VM (the hostname kubelet registers the node
//! under) and checking the name took, delivering the bootstrap blob in
//! chunks, running the bootstrap hook, the readiness probes (with what the
//! last one said) and the drain, each with exit status and output, and the
//! blob kept out of every quoted output. Every command run on the node's
//! behalf gets its node name in [`NODE_NAME_ENV`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pve::{ExecStatus, FileEncoding, PveError};
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use super::api::{err, kind_of, Api};
use super::options::PveOptions;
use super::options::NODE_NAME_ENV;
use providerkit::ErrorKind;

use crate::redact::{Redactor, REDACTED};
use crate::substrate::{SubstrateError, VmRef};
use crate::timeline::{self, Step, StepGuard};

/// Raw bytes per file-write chunk: 36 KiB base64-encodes to 48 KiB, which
/// stays under the 60 KiB `content` limit and (form-encoded) under the 64 KiB
/// request body limit of older PVE releases.
pub(super) const CHUNK_RAW: usize = 36 * 1024;

/// Bytes of stderr/stdout quoted in an error.
pub(super) const OUTPUT_TAIL: usize = 512;

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

/// The last `OUTPUT_TAIL` bytes of guest output, cut on a character boundary.
pub(super) fn tail(s: &str) -> &str {
    let s = s.trim_end();
    if s.len() <= OUTPUT_TAIL {
        return s;
    }
    let mut start = s.len() - OUTPUT_TAIL;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

/// Ok for exit 0; otherwise an error with the exit code / signal and the tail of stderr.
pub(super) fn exec_outcome(what: &str, st: &ExecStatus) -> Result<(), SubstrateError> {
    exec_outcome_with(what, st, &Redactor::new(&[]))
}

/// Ok for exit 0; otherwise [`exec_outcome`]'s error with every piece of
/// the bootstrap blob that `redactor` knows cut from the quoted output
/// before the tail is taken (see [`crate::redact`]), and the error says so.
pub(super) fn exec_outcome_with(
    what: &str,
    st: &ExecStatus,
    redactor: &Redactor,
) -> Result<(), SubstrateError> {
    let mut msg = match (st.exitcode, st.signal) {
        (Some(0), None) => return Ok(()),
        (_, Some(sig)) => format!("{what} was killed by signal {sig}"),
        (Some(code), None) => format!("{what} exited {code}"),
        (None, None) => format!("{what} ended without an exit status"),
    };
    let mut redacted = false;
    let mut quote = |data: &Option<String>, truncated: bool| {
        let (clean, hit) = redactor.redact(data.as_deref().unwrap_or_default(), truncated);
        redacted |= hit;
        tail(&clean).to_string()
    };
    let err = quote(&st.err_data, st.err_truncated);
    let out = quote(&st.out_data, st.out_truncated);
    if !err.is_empty() {
        msg.push_str(&format!(": stderr: {err}"));
        if st.err_truncated {
            msg.push_str(" (stderr was truncated by the guest agent)");
        }
    } else if !out.is_empty() {
        msg.push_str(&format!(": stdout: {out}"));
        if st.out_truncated {
            msg.push_str(" (stdout was truncated by the guest agent)");
        }
    }
    if redacted {
        msg.push_str(&format!(
            " (output that repeated the bootstrap blob was replaced by {REDACTED})"
        ));
    }
    Err(SubstrateError::new(msg))
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
    /// How long a guest agent took to answer after a start, by node
    /// (smoothed): the first ping after the next start there waits most of
    /// it, instead of pinging every poll interval through the boot.
    boot_times: Mutex<HashMap<String, Duration>>,
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
            boot_times: Mutex::new(HashMap::new()),
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

    /// Names the guest after its VM with `--hostname-command` (skipped when
    /// empty) and reads the name back, in one guest command: the shell runs
    /// the hostname command and, only when it exits 0, prints what
    /// `hostname` says behind [`HOSTNAME_MARK`]. A guest still carrying its
    /// template's name would register as another machine's node. It is the
    /// first command of a Configure, so it waits for the agent when PVE
    /// finds it not up (see [`Guest::run_first`]).
    async fn set_hostname(&self, vm: &VmRef, name: &str) -> Result<(), SubstrateError> {
        let opts = &self.opts;
        let cmd = opts.hostname_command.trim();
        let what = if cmd.is_empty() {
            "`hostname`".to_string()
        } else {
            format!("hostname command `{cmd}`")
        };
        let st = self
            .run_first(vm, &hostname_argv(name, cmd), opts.exec_timeout)
            .await
            .map_err(|e| exec_err(format!("running the {what} in VM {vm}"), &e))?;
        tracing::info!(vm = %vm, exit_code = st.exitcode, signal = st.signal, "hostname command exited");
        exec_outcome(&what, &st).map_err(|e| e.context(format!("VM {vm}")))?;
        let guest = match read_back_hostname(st.out_data.as_deref().unwrap_or_default()) {
            Some(Ok(guest)) => guest,
            Some(Err(failed)) => {
                return Err(SubstrateError::new(format!(
                    "VM {vm}: `hostname` failed in the guest after the {what}: {}",
                    tail(&failed)
                )))
            }
            None => {
                return Err(SubstrateError::new(format!(
                    "VM {vm}: the guest's hostname could not be read back after the {what} \
                     (its output lacks the {HOSTNAME_MARK:?} line{})",
                    if st.out_truncated {
                        "; the agent truncated the output"
                    } else {
                        ""
                    }
                )))
            }
        };
        if !guest.eq_ignore_ascii_case(name) {
            let mismatch = HostnameMismatch {
                vm_name: name.to_string(),
                guest: guest.to_string(),
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

    /// Pings the agent until it answers, polling through boot-time failures.
    pub(super) async fn wait_agent(&self, vm: &VmRef) -> Result<(), SubstrateError> {
        let step = timeline::step(Step::Agent, &vm.node);
        step.end(self.ping_until_up(vm, self.opts.poll_interval).await)
    }

    /// [`Guest::wait_agent`] right after this provider started the VM: the
    /// first ping waits nine tenths of what agents on this node took to
    /// answer after a start lately (at most half the agent timeout), and a
    /// ping that finds the agent not up yet is followed by the next a
    /// quarter of that later (at most a poll interval), so a boot costs a
    /// ping, sometimes two, rather than one per poll interval. The time
    /// this one took is learnt for the next: a boot that answered the first
    /// ping pulls the estimate down, one that needed more pushes it up.
    pub(super) async fn wait_agent_after_start(&self, vm: &VmRef) -> Result<(), SubstrateError> {
        let step = timeline::step(Step::Agent, &vm.node);
        let started = Instant::now();
        let learnt = self.boot_times.lock().get(&vm.node).copied();
        let every = match learnt {
            Some(boot) => {
                tokio::time::sleep((boot * 9 / 10).min(self.opts.agent_timeout / 2)).await;
                (boot / 4).clamp(self.api.first_poll(), self.opts.poll_interval)
            }
            // Nothing learnt: the start task ends once QEMU runs, before
            // the guest has booted far enough for its agent, so the first
            // ping waits a poll interval.
            None => {
                tokio::time::sleep(self.opts.poll_interval).await;
                self.opts.poll_interval
            }
        };
        let out = self.ping_until_up(vm, every).await;
        if out.is_ok() {
            let took = started.elapsed();
            let mut times = self.boot_times.lock();
            let smoothed = match times.get(&vm.node) {
                Some(before) => (*before + took) / 2,
                None => took,
            };
            times.insert(vm.node.clone(), smoothed);
        }
        step.end(out)
    }

    /// Pings every `every` until the agent answers or `--agent-timeout` passes.
    async fn ping_until_up(&self, vm: &VmRef, every: Duration) -> Result<(), SubstrateError> {
        let opts = &self.opts;
        let deadline = Instant::now() + opts.agent_timeout;
        loop {
            match self.api.once(|pve| pve.agent_ping(&vm.node, vm.vmid)).await {
                Ok(()) => {
                    tracing::info!(vm = %vm, "guest agent up");
                    return Ok(());
                }
                // The agent not up yet, or PVE failing transiently on the
                // way to it (a proxy 503, a reset connection): both heal
                // by themselves, so the wait goes on until its deadline.
                Err(e) if e.is_agent_transient() || e.is_transient() => {
                    if Instant::now() >= deadline {
                        return Err(SubstrateError::new(format!(
                            "the guest agent of VM {vm} did not answer within {:?} (last error: {e}); is qemu-guest-agent installed and enabled in the template?",
                            opts.agent_timeout
                        )));
                    }
                }
                Err(e) => return Err(err(format!("pinging the guest agent of VM {vm}"), &e)),
            }
            tokio::time::sleep(every).await;
        }
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

    /// [`Guest::run`] for the first command of a Configure or a Drain, which
    /// no agent ping comes before: qemu-server pings the agent itself before
    /// any agent command and refuses one it could not send (`QEMU guest
    /// agent is not running`, the VM not running). Only then, when nothing
    /// ran, does this wait for the agent (as [`Guest::wait_agent`], up to
    /// `--agent-timeout`) and send the command again. A ping before every
    /// Configure and Drain cost a request each to learn what the command's
    /// own answer says.
    async fn run_first(
        &self,
        vm: &VmRef,
        argv: &[String],
        timeout: Duration,
    ) -> Result<ExecStatus, ExecError> {
        let exec = || {
            self.api
                .once(|pve| pve.agent_exec(&vm.node, vm.vmid, argv, None))
        };
        let pid = match exec().await {
            Ok(pid) => pid,
            Err(e) if e.is_agent_unreached() => {
                tracing::info!(vm = %vm, error = %e, "the guest agent did not take the command; waiting for it");
                self.wait_agent(vm).await.map_err(ExecError::Agent)?;
                exec().await?
            }
            Err(e) => return Err(e.into()),
        };
        self.await_exit(vm, pid, timeout).await
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
        self.set_hostname(vm, &name).await?;
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
            .bootstrap(vm, &opts.bootstrap_path, blob, &redactor)
            .await;
        if outcome.is_err() {
            self.forget_probes(vm.vmid);
        }
        outcome
    }

    /// Writes the blob and runs the bootstrap hook on it.
    async fn bootstrap(
        &self,
        vm: &VmRef,
        path: &str,
        blob: &[u8],
        redactor: &Redactor,
    ) -> Result<(), SubstrateError> {
        timeline::step(Step::BootstrapWrite, &vm.node)
            .end(self.write_blob(vm, path, blob, redactor).await)?;
        tracing::info!(vm = %vm, bytes = blob.len(), "bootstrap blob written");
        let step = timeline::step(Step::BootstrapExec, &vm.node);
        let mut argv = self.opts.bootstrap_exec.clone();
        argv.push(path.to_string());
        let what = format!("bootstrap hook `{}`", argv.join(" "));
        let st = match self.run(vm, &argv, self.opts.exec_timeout).await {
            Ok(st) => st,
            Err(e) => return step.end(Err(exec_err(format!("running the {what} in VM {vm}"), &e))),
        };
        tracing::info!(vm = %vm, exit_code = st.exitcode, signal = st.signal, "bootstrap exited");
        step.end(
            exec_outcome_with(&what, &st, redactor)
                .map_err(|e| SubstrateError::new(format!("VM {vm}: {e}"))),
        )
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
            self.api
                .retry_pve(ctx(), Some(&vm.node), deadline, |pve| {
                    pve.agent_file_write(&vm.node, vm.vmid, &file, chunk, FileEncoding::Base64)
                })
                .await?;
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

/// `cmd` run by `/bin/sh` with the node name in [`NODE_NAME_ENV`]. The
/// agent's exec takes no environment, so `env` sets it; the command text
/// stays one argument, as given, with no quoting of the name to get wrong.
fn with_node_name(name: &str, cmd: &str) -> Vec<String> {
    vec![
        "/usr/bin/env".into(),
        format!("{NODE_NAME_ENV}={name}"),
        "/bin/sh".into(),
        "-c".into(),
        cmd.into(),
    ]
}

/// The line the hostname command's shell prints after it, with
/// `hostname`'s exit status and answer: `bigfleet-hostname:<status>:<name>`.
const HOSTNAME_MARK: &str = "bigfleet-hostname:";

/// One guest command that runs `cmd` (when not empty) with the node name
/// in [`NODE_NAME_ENV`] and, once it exits 0, prints [`HOSTNAME_MARK`],
/// `hostname`'s exit status and its answer (or its error) on a line of its
/// own. The command text stays one argument, as given.
fn hostname_argv(name: &str, cmd: &str) -> Vec<String> {
    const SCRIPT: &str = r#"if [ -n "$1" ]; then /bin/sh -c "$1" || exit $?; fi
h=$(hostname 2>&1); s=$?
printf '\n%s%s:%s\n' "$2" "$s" "$h""#;
    let mut argv = with_node_name(name, SCRIPT);
    argv.extend([
        "bigfleet-hostname".to_string(),
        cmd.to_string(),
        HOSTNAME_MARK.to_string(),
    ]);
    argv
}

/// What the last [`HOSTNAME_MARK`] line of the output says: the guest's
/// hostname, or `hostname`'s error when it exited non-zero. `None` when
/// there is no such line.
fn read_back_hostname(out: &str) -> Option<Result<String, String>> {
    let line = out
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix(HOSTNAME_MARK))?;
    let (status, answer) = line.split_once(':')?;
    let answer = answer.trim();
    match status {
        "0" => Some(Ok(answer.to_string())),
        other => Some(Err(format!("exit {other}: {answer}"))),
    }
}

/// The `i`th part file of a chunked blob: beside the blob, numbered so the
/// join's order is explicit.
fn part_path(path: &str, i: usize) -> String {
    format!("{path}.part{i}")
}

/// The command that appends `parts` to `path` in the order given, removes
/// them (also on failure, with the half-joined file: they hold the blob) and
/// prints the sha256 of the result. Every file is named as an argument, not
/// built inside the script, so the command reads only what it is given.
fn join_argv(path: &str, parts: &[String]) -> Vec<String> {
    const SCRIPT: &str = r#"p="$1"; shift
for part in "$@"; do
  cat "$part" >> "$p" || { rm -f "$p" "$@"; exit 1; }
done
rm -f "$@"
sha256sum "$p""#;
    let mut argv: Vec<String> = vec![
        "/bin/sh".into(),
        "-c".into(),
        SCRIPT.into(),
        "bigfleet-join".into(),
        path.into(),
    ];
    argv.extend(parts.iter().cloned());
    argv
}

/// The drain command as run: `--drain-command`, then `--grace-period=N`
/// only for a request's positive grace (0, proto3's unset, leaves each
/// pod's own `terminationGracePeriodSeconds` in force, where kubectl's
/// `--grace-period=0` would mean "delete now"), then `--timeout=Ns` so
/// kubectl gives up before the provider stops waiting.
pub(crate) fn drain_command(base: &str, grace: Duration, drain_timeout: Duration) -> String {
    let mut cmd = base.trim().to_string();
    if grace.as_secs() > 0 {
        cmd.push_str(&format!(" --grace-period={}", grace.as_secs()));
    }
    cmd.push_str(&format!(" --timeout={}s", drain_timeout.as_secs().max(1)));
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drain_appends_grace_only_when_asked() {
        let base = "kubectl drain \"$(hostname)\" --ignore-daemonsets";
        let t = Duration::from_secs(600);
        assert_eq!(
            drain_command(base, Duration::ZERO, t),
            format!("{base} --timeout=600s"),
            "0 = the pods' own grace"
        );
        assert_eq!(
            drain_command(base, Duration::from_secs(30), t),
            format!("{base} --grace-period=30 --timeout=600s")
        );
        assert_eq!(
            drain_command(base, Duration::from_millis(400), Duration::ZERO),
            format!("{base} --timeout=1s"),
            "sub-second grace rounds to unset; the timeout is at least 1s"
        );
    }

    /// The join script itself, run by a real `/bin/sh` on the files as
    /// the chunked write leaves them.
    #[test]
    fn the_join_appends_the_parts_in_order_and_removes_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bootstrap");
        let path = path.to_str().unwrap();
        let blob: Vec<u8> = (0..(CHUNK_RAW * 2 + 100))
            .map(|i| (i % 251) as u8)
            .collect();
        let chunks: Vec<&[u8]> = blob.chunks(CHUNK_RAW).collect();
        std::fs::write(path, chunks[0]).unwrap();
        let parts: Vec<String> = (1..chunks.len()).map(|i| part_path(path, i)).collect();
        for (part, chunk) in parts.iter().zip(&chunks[1..]) {
            std::fs::write(part, chunk).unwrap();
        }
        let run = |argv: Vec<String>| {
            std::process::Command::new(&argv[0])
                .args(&argv[1..])
                .output()
                .unwrap()
        };
        let out = run(join_argv(path, &parts));
        assert!(out.status.success(), "{out:?}");
        assert_eq!(std::fs::read(path).unwrap(), blob);
        let printed = String::from_utf8_lossy(&out.stdout);
        assert!(
            printed.starts_with(&hex::encode(Sha256::digest(&blob))),
            "{printed}"
        );
        let left = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(left, 1, "only the blob is left");

        // A missing part fails the join and leaves no piece of the blob.
        std::fs::write(path, chunks[0]).unwrap();
        std::fs::write(&parts[1], chunks[2]).unwrap();
        let out = run(join_argv(path, &parts));
        assert!(!out.status.success());
        let left = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(left, 0, "no piece of the blob is left behind");
    }

    /// The hostname command and its read-back as one guest command, run by
    /// a real `/bin/sh` with a `hostname` of the test's own on `PATH`.
    #[test]
    fn the_hostname_command_and_its_read_back_are_one_command() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path();
        let name_file = bin.join("name");
        std::fs::write(&name_file, "template\n").unwrap();
        let script = format!(
            "#!/bin/sh\nif [ -n \"$1\" ]; then printf '%s\\n' \"$1\" > {f}; else cat {f}; fi\n",
            f = name_file.display()
        );
        std::fs::write(bin.join("hostname"), script).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(bin.join("hostname"), std::fs::Permissions::from_mode(0o755))
            .unwrap();
        let path = format!("{}:/usr/bin:/bin", bin.display());
        let run = |cmd: &str| {
            let argv = hostname_argv("node-7", cmd);
            std::process::Command::new(&argv[0])
                .args(&argv[1..])
                .env("PATH", &path)
                .output()
                .unwrap()
        };
        // The command sees the node name, and the read-back follows it.
        let out = run("echo renaming; hostname \"$BIGFLEET_NODE_NAME\"");
        assert!(out.status.success(), "{out:?}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.starts_with("renaming\n"), "{stdout}");
        assert_eq!(read_back_hostname(&stdout), Some(Ok("node-7".into())));
        // An empty command only reads the name.
        std::fs::write(&name_file, "template\n").unwrap();
        let out = run("");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(read_back_hostname(&stdout), Some(Ok("template".into())));
        // A failing command ends the shell with its status: no read-back.
        let out = run("echo nope >&2; exit 3");
        assert_eq!(out.status.code(), Some(3));
        assert_eq!(String::from_utf8_lossy(&out.stderr), "nope\n");
        assert_eq!(
            read_back_hostname(&String::from_utf8_lossy(&out.stdout)),
            None
        );
        // A failing `hostname` is reported with its status and words.
        std::fs::write(bin.join("hostname"), "#!/bin/sh\necho broken >&2\nexit 4\n").unwrap();
        let out = run("");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            read_back_hostname(&stdout),
            Some(Err("exit 4: broken".into()))
        );
        // Only the last mark counts: the command cannot speak for the guest.
        assert_eq!(
            read_back_hostname("bigfleet-hostname:0:fake\nbigfleet-hostname:0:real\n"),
            Some(Ok("real".into()))
        );
    }

    #[test]
    fn exec_errors_quote_exit_and_stderr_tail() {
        let st = ExecStatus {
            exited: true,
            exitcode: Some(3),
            err_data: Some(format!("{}boom\n", "x".repeat(2000))),
            err_truncated: true,
            ..ExecStatus::default()
        };
        let e = exec_outcome("hook", &st).unwrap_err().to_string();
        assert!(e.starts_with("hook exited 3: stderr: "), "{e}");
        assert!(e.contains("boom") && e.contains("truncated"), "{e}");
        assert!(e.len() < 700, "{}", e.len());
        let ok = ExecStatus {
            exited: true,
            exitcode: Some(0),
            ..ExecStatus::default()
        };
        assert!(exec_outcome("hook", &ok).is_ok());
        let sig = ExecStatus {
            exited: true,
            signal: Some(9),
            ..ExecStatus::default()
        };
        assert!(exec_outcome("hook", &sig)
            .unwrap_err()
            .to_string()
            .contains("signal 9"));
    }
}
