//! What kind of failure a [`PveError`] is, for callers that react to it:
//! lock timeouts, VMID collisions, unreachable or offline nodes, the guest
//! agent not answering yet, whether a failed request may have been applied,
//! and why the API could not be used at all ([`AccessFailure`]). PVE reports
//! most of these only in its message texts, so the classifiers match the
//! texts PVE really sends; the tests quote them.

use super::PveError;

impl PveError {
    /// The server- or task-provided message this error carries, if any.
    fn server_text(&self) -> Option<&str> {
        match self {
            PveError::Api { message, .. } => Some(message),
            PveError::TaskFailed { exitstatus, .. } => Some(exitstatus),
            _ => None,
        }
    }

    /// A lock could not be acquired in time (`can't lock file '...' - got timeout`, or
    /// a cluster-filesystem `cfs-lock ... got lock request timeout`). For an API
    /// error this means nothing was applied, so the call is safe to retry. Also true
    /// for a task that failed that way (e.g. `clone failed: can't lock file ...`).
    pub fn is_lock_timeout(&self) -> bool {
        self.server_text().is_some_and(is_lock_timeout_text)
    }

    /// A storage's lock could not be acquired in time: pve-storage allocates
    /// and frees volumes under it (`cfs-lock 'storage-ID'` cluster-wide for a
    /// shared storage, `/var/lock/pve-manager/pve-storage-ID` on the node for
    /// a local one), so too many clones at once queue on it. A VM's config
    /// lock (`lock-104.conf`) is not one.
    pub fn is_storage_lock_timeout(&self) -> bool {
        self.server_text().is_some_and(|m| {
            is_lock_timeout_text(m)
                && (m.contains("cfs-lock 'storage-") || m.contains("/pve-storage-"))
        })
    }

    /// The object to create already exists (`VM 104 already exists`, clone target
    /// VMID taken, ...). On a retried clone this means an earlier attempt got there.
    /// PVE reports a taken id either in the message or, for a parameter check
    /// (`GET /cluster/nextid?vmid=N`), only in the per-parameter errors.
    pub fn is_already_exists(&self) -> bool {
        let says = |m: &str| m.to_ascii_lowercase().contains("already exists");
        self.server_text().is_some_and(says)
            || matches!(self, PveError::Api { param_errors, .. }
                if param_errors.values().any(|v| says(v)))
    }

    /// A start task that found the VM running already (`VM 104 already
    /// running`): someone else started it, or an earlier start whose answer
    /// was lost did. The VM is running, which is what the caller wanted.
    pub fn is_already_running(&self) -> bool {
        matches!(self, PveError::TaskFailed { exitstatus, .. } if exitstatus.contains("already running"))
    }

    /// A destroy refused because the VM's QEMU still runs (`VM 104 is
    /// running - destroy failed`, qemu-server `destroy_vm`'s check before
    /// its worker starts, or the same check inside it).
    pub fn is_running_refusal(&self) -> bool {
        self.server_text()
            .is_some_and(|m| m.contains(" is running - destroy failed"))
    }

    /// pveproxy could not reach the node owning the call (595/596/597).
    pub fn is_node_unreachable(&self) -> bool {
        matches!(self.status(), Some(595..=597))
    }

    /// The token was rejected (401).
    pub fn is_auth(&self) -> bool {
        self.status() == Some(401)
    }

    /// The object does not exist: 404, a `... does not exist` message (e.g. 500
    /// `Configuration file 'nodes/pve1/qemu-server/104.conf' does not exist`),
    /// `no such VM/task`, or [`PveError::NotFound`]. A task status or log
    /// asked for a task the node has no file of is a 400 whose text is only
    /// in the per-parameter errors (`upid: no such task`, pve-manager
    /// `API2/Tasks.pm`).
    pub fn is_not_found(&self) -> bool {
        match self {
            PveError::NotFound(_) => true,
            PveError::Api {
                status,
                message,
                param_errors,
            } => {
                let m = message.to_ascii_lowercase();
                *status == 404
                    || m.contains("does not exist")
                    || m.starts_with("no such vm")
                    || m.starts_with("no such task")
                    || param_errors
                        .get("upid")
                        .is_some_and(|v| v.to_ascii_lowercase().starts_with("no such task"))
            }
            _ => false,
        }
    }

    /// The guest agent cannot answer yet: `QEMU guest agent is not running`,
    /// `No QEMU guest agent configured`, or a guest-agent command timing out
    /// (`qmp command 'guest-ping' failed - got timeout`). Callers waiting for boot
    /// keep polling through these until their deadline.
    pub fn is_agent_not_running(&self) -> bool {
        let Some(m) = self.server_text() else {
            return false;
        };
        let m = m.to_ascii_lowercase();
        m.contains("guest agent is not running")
            || m.contains("no qemu guest agent configured")
            || (m.contains("qmp command 'guest-") && m.contains("got timeout"))
    }

    /// A guest-agent command that PVE refused before sending it to the
    /// guest: qemu-server's `assert_agent_available` checks, in this order,
    /// that the VM has an agent configured (`No QEMU guest agent
    /// configured`), that it runs (`VM 104 is not running`) and that the
    /// agent answers a `guest-ping` (`QEMU guest agent is not running`)
    /// before any agent command. Sending such a command again once the
    /// agent answers cannot run it twice. A `got timeout` is not one of
    /// these: the command may have reached the guest.
    pub fn is_agent_unreached(&self) -> bool {
        if self.is_vm_not_running() {
            return true;
        }
        self.server_text().is_some_and(|m| {
            let m = m.to_ascii_lowercase();
            m.contains("guest agent is not running") || m.contains("no qemu guest agent configured")
        })
    }

    /// The VM itself is not running (`VM 104 is not running`).
    pub fn is_vm_not_running(&self) -> bool {
        self.server_text().is_some_and(|m| {
            let m = m.to_ascii_lowercase();
            m.starts_with("vm ") && m.contains(" is not running") && !m.contains("agent")
        })
    }

    /// The VM's config file does not exist on the node asked
    /// (`Configuration file 'nodes/pve1/qemu-server/104.conf' does not exist`,
    /// from the API or a task): VM `vmid` is gone, or lives on another node.
    /// Unlike [`PveError::is_not_found`] this names the VM, so a call that
    /// involves two (a clone's source and its new id) can tell which is missing.
    pub fn is_vm_config_missing(&self, vmid: u32) -> bool {
        let conf = format!("/qemu-server/{vmid}.conf' does not exist");
        self.server_text()
            .is_some_and(|m| m.to_ascii_lowercase().contains(&conf))
    }

    /// A node or storage the call needs is not online: a clone or migration
    /// `target node 'pve2' is not online`, or `storage 'nas' is not online`
    /// (the storage's server cannot be reached). Nothing was applied, and it
    /// heals once the node or storage is back.
    pub fn is_offline(&self) -> bool {
        let says = |m: &str| m.to_ascii_lowercase().contains("is not online");
        self.server_text().is_some_and(says)
            || matches!(self, PveError::Api { param_errors, .. }
                if param_errors.values().any(|v| says(v)))
    }

    /// `GET /cluster/nextid` without `vmid` found datacenter.cfg's
    /// `next-id` range full: pve-manager dies `unable to get any free VMID
    /// in range [LOWER, UPPER]` (a 500). It searches only that range; an
    /// id outside it may still be free (`?vmid=N` checks one).
    pub fn is_next_id_range_full(&self) -> bool {
        matches!(self, PveError::Api { message, .. }
            if message.to_ascii_lowercase().contains("unable to get any free vmid"))
    }

    /// A storage the node could not activate: pve-storage's
    /// `activate_storage` dies `unable to activate storage 'X' - directory
    /// '/mnt/pve/X' does not exist or is unreachable` (a hung NFS or dir
    /// mount answers no `-d` within its 2 s), or `... does not exist`,
    /// `... mount failed`, `... is expected to be a mount point but is not
    /// mounted`. A call that activates every storage of the node (a destroy
    /// with `destroy-unreferenced-disks`) fails on any one of them, whether
    /// or not the VM uses it.
    pub fn is_storage_unavailable(&self) -> bool {
        self.server_text().is_some_and(|m| {
            m.to_ascii_lowercase()
                .contains("unable to activate storage")
        })
    }

    /// A clone to another node was refused because the source VM's disks
    /// are on local storage (`can't clone VM to node 'pve2' (VM uses local
    /// storage)`): only shared storage can be cloned across nodes. Retrying
    /// does not help.
    pub fn is_local_storage_clone(&self) -> bool {
        self.server_text()
            .is_some_and(|m| m.to_ascii_lowercase().contains("uses local storage"))
    }

    /// What a storage call answers for a storage that is not there for
    /// this node or token: `storage 'X' does not exist`, `storage 'X' is
    /// not available on node 'N'` (in the message or a parameter's reason),
    /// or the storage status's 400 with `storage: No such storage.` (a
    /// storage storage.cfg does not have). Fixing the configuration is the
    /// only cure.
    pub fn is_storage_missing(&self) -> bool {
        let says = |m: &str| {
            m.contains("does not exist")
                || m.contains("not available on node")
                || m.to_ascii_lowercase().contains("no such storage")
        };
        matches!(self, PveError::NotFound(_))
            || self.server_text().is_some_and(says)
            || matches!(self, PveError::Api { param_errors, .. }
                if param_errors.values().any(|v| says(v)))
    }

    /// No answer came from the node that holds what was asked: pveproxy
    /// could not reach it (595/596/597), the connection failed, or the
    /// request timed out. A read of a task's status or log that fails this
    /// way says nothing of the task, and is repeated at the next look.
    pub fn is_unanswered(&self) -> bool {
        self.is_node_unreachable() || self.is_transport() || self.is_timeout()
    }

    /// Transport-level failure (no usable HTTP answer).
    pub fn is_transport(&self) -> bool {
        matches!(self, PveError::Transport { .. })
    }

    /// Per-request timeout elapsed.
    pub fn is_timeout(&self) -> bool {
        matches!(self, PveError::Timeout { .. })
    }

    /// TLS verification failed.
    pub fn is_tls(&self) -> bool {
        matches!(self, PveError::Tls { .. })
    }

    /// The VM or one of its files is locked: a lock timeout, or `VM 104 is
    /// locked (backup)` and the like. Nothing was applied. A worker that
    /// found the lock says so without the VMID (`VM is locked (clone)`:
    /// pve-guest-common `AbstractConfig::check_lock`, as a destroy task
    /// does after its API call answered 200).
    pub fn is_locked(&self) -> bool {
        self.is_lock_timeout()
            || match self {
                PveError::Api { message, .. } => message.contains("is locked"),
                PveError::TaskFailed { exitstatus, .. } => is_locked_task_text(exitstatus),
                _ => false,
            }
    }

    /// The VM has `protection: 1` (`can't remove VM 104 - protection mode
    /// enabled`): PVE refuses to destroy it until the flag is cleared.
    pub fn is_protected(&self) -> bool {
        self.server_text()
            .is_some_and(|m| m.contains("protection mode enabled"))
    }

    /// The guest agent does not know the exec pid (`invalid parameter 'pid'`,
    /// `no such pid`): qemu-ga forgets a pid once it has reported its exit.
    pub fn is_unknown_pid(&self) -> bool {
        let m = self.to_string().to_ascii_lowercase();
        m.contains("invalid parameter 'pid'") || m.contains("no such pid")
    }

    /// A failure after which the request may or may not have been applied:
    /// the request was sent but no answer came back.
    pub fn may_have_been_applied(&self) -> bool {
        matches!(
            self,
            PveError::Timeout { .. } | PveError::Transport { connect: false, .. }
        )
    }

    /// The token lacks a privilege on the object (403 `Permission check failed
    /// (/vms/104, VM.Audit)`). Under a pool-scoped token this is also what a
    /// VMID outside the pool answers: a VM that is gone, belongs to someone
    /// else, or is still being cloned (pool membership is added at the end).
    pub fn is_forbidden(&self) -> bool {
        self.status() == Some(403)
    }

    /// The clone target VMID turned out to be taken, found either by the API
    /// call (`VM 104 already exists`) or inside the clone worker: `unable to
    /// create VM 104: config file already exists`, pmxcfs refusing the
    /// temporary config (`close (rename) atomic file '...' failed: File
    /// exists`), or the 1 s lock on the new id timing out (`can't lock file
    /// '/var/lock/qemu-server/lock-104.conf' - got timeout`, matched only for
    /// `newid`). A fresh VMID is the fix; nothing of ours was created.
    pub fn is_vmid_collision(&self, newid: u32) -> bool {
        if self.is_already_exists() {
            return true;
        }
        let Some(m) = self.server_text() else {
            return false;
        };
        let m = m.to_ascii_lowercase();
        m.contains("config file already exists")
            || (m.contains("close (rename) atomic file") && m.contains("file exists"))
            || (is_lock_timeout_text(&m) && m.contains(&format!("/lock-{newid}.conf")))
    }

    /// A failure that heals by itself: pveproxy could not reach or hear back
    /// from the node (595/596/597), a gateway or availability 5xx (502-504)
    /// that is not a parameter error, a lock timeout, a transport failure
    /// (refused, reset, closed) or a request timeout. Whether repeating the
    /// call is safe is a separate question: see [`PveError::may_have_been_applied`].
    /// A plain 500 is not transient: PVE uses it for every error a handler
    /// dies with ("VM 104 is running - destroy failed", ...).
    ///
    /// Also transient: pveproxy's `599 Too many redirections` (see
    /// [`PveError::is_proxy_redirect_loop`]), a cluster without quorum
    /// (`cluster not ready - no quorum?`: pmxcfs refuses every write until
    /// quorum is back) and a storage command that outlived its cluster lock
    /// (`'storage-X'-locked command timed out - aborting`), in an answer or a
    /// failed task alike.
    pub fn is_transient(&self) -> bool {
        match self {
            PveError::Api {
                status,
                param_errors,
                ..
            } => {
                (param_errors.is_empty() && matches!(status, 502..=504 | 595..=597))
                    || self.is_lock_timeout()
                    || self.is_proxy_redirect_loop()
                    || self.server_text().is_some_and(is_heals_by_itself_text)
            }
            PveError::TaskFailed { exitstatus, .. } => {
                is_lock_timeout_text(exitstatus)
                    || is_locked_task_text(exitstatus)
                    || is_heals_by_itself_text(exitstatus)
            }
            PveError::Transport { .. } | PveError::Timeout { .. } => true,
            _ => false,
        }
    }

    /// pveproxy answered `599 Too many redirections`: it reused a proxied
    /// connection to the node that had been closed (libpve-http-server-perl
    /// before 5.1.2, still seen for GETs). The request never reached the
    /// node's handler, so nothing was applied and repeating it is safe.
    pub fn is_proxy_redirect_loop(&self) -> bool {
        matches!(self, PveError::Api { status: 599, message, .. }
            if message.to_ascii_lowercase().contains("too many redirections"))
    }

    /// For a request that changes state (POST/PUT/DELETE): the failure says
    /// nothing about whether it was applied. A request timeout or a transport
    /// failure after the connection was made, and pveproxy's 596 (timed out
    /// forwarding to the node) and 597 (the node's answer was lost): the node
    /// may have run the request; likewise a 502/504 from a gateway in front
    /// of pveproxy. 595 means pveproxy could not connect at all.
    pub fn may_have_been_applied_post(&self) -> bool {
        self.may_have_been_applied() || matches!(self.status(), Some(502 | 504 | 596 | 597))
    }

    /// Failures worth polling through while a VM boots and its agent starts.
    pub fn is_agent_transient(&self) -> bool {
        self.is_agent_not_running()
            || self.is_vm_not_running()
            || self.is_timeout()
            || self.is_transport()
            || self.is_node_unreachable()
    }
}

/// Why a call never got a usable answer from the API at all: each points
/// at a different piece of the client's set-up (see [`PveError::access_failure`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccessFailure {
    /// 401: the token id or secret is wrong, or the token expired or was removed.
    Unauthorized,
    /// 404, or an answer that is not the API's JSON: the base URL does not
    /// end in the API root `/api2/json`.
    WrongPath,
    /// Nothing listens on the host and port (PVE's API port is 8006).
    ConnectionRefused,
    /// The host name does not resolve, or the host does not answer.
    Unreachable,
    /// The peer does not speak TLS on that port (a plain HTTP port).
    NotTls,
    /// The certificate failed verification: CA, host name or pinned fingerprint.
    Tls,
}

impl PveError {
    /// Classifies a failure to use the API at all (the first call of a
    /// process): `None` for an answer the API gave about the request itself.
    pub fn access_failure(&self) -> Option<AccessFailure> {
        match self {
            PveError::Api { status: 401, .. } => Some(AccessFailure::Unauthorized),
            PveError::Api { status: 404, .. } => Some(AccessFailure::WrongPath),
            // A web page (the GUI) or another server's 200 instead of `{"data": ...}`.
            PveError::Decode { .. } => Some(AccessFailure::WrongPath),
            PveError::Tls { message, .. } => {
                let m = message.to_ascii_lowercase();
                // rustls: "received corrupt message of type InvalidContentType".
                if m.contains("corrupt message") || m.contains("invalidcontenttype") {
                    Some(AccessFailure::NotTls)
                } else {
                    Some(AccessFailure::Tls)
                }
            }
            PveError::Transport {
                message, connect, ..
            } => {
                let m = message.to_ascii_lowercase();
                if m.contains("connection refused") {
                    Some(AccessFailure::ConnectionRefused)
                } else if m.contains("corrupt message") || m.contains("invalidcontenttype") {
                    Some(AccessFailure::NotTls)
                } else if *connect {
                    Some(AccessFailure::Unreachable)
                } else {
                    None
                }
            }
            PveError::Timeout { .. } => Some(AccessFailure::Unreachable),
            _ => None,
        }
    }
}

/// A worker that found its VM locked by another operation (`VM is locked
/// (backup)`, `CT 104 is locked (clone)`): the lock clears when that
/// operation ends, and the worker did nothing before its check.
fn is_locked_task_text(m: &str) -> bool {
    m.contains("is locked (")
}

/// Texts of failures that heal by themselves but, unlike a lock timeout,
/// may come after part of the work was done: a cluster that lost quorum,
/// and a command that held a storage's cluster lock past its limit
/// (pve-cluster `cfs_lock`: `'storage-X'-locked command timed out - aborting`).
fn is_heals_by_itself_text(m: &str) -> bool {
    let m = m.to_ascii_lowercase();
    m.contains("cluster not ready - no quorum")
        || (m.contains("'storage-") && m.contains("-locked command timed out"))
}

pub(crate) fn is_lock_timeout_text(m: &str) -> bool {
    let m = m.to_ascii_lowercase();
    (m.contains("can't lock file") && m.contains("got timeout"))
        || (m.contains("cfs-lock") && m.contains("timeout"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn storage_lock_timeouts_are_told_from_config_lock_timeouts() {
        let task = |exitstatus: &str| super::PveError::TaskFailed {
            upid: "UPID:pve1:0:0:0:qmclone:9000:root@pam:".into(),
            exitstatus: exitstatus.into(),
        };
        let shared =
            task("clone failed: cfs-lock 'storage-ceph-pool' error: got lock request timeout");
        let local = task("clone failed: can't lock file '/var/lock/pve-manager/pve-storage-local-lvm' - got timeout");
        let config = task("can't lock file '/var/lock/qemu-server/lock-104.conf' - got timeout");
        for e in [&shared, &local, &config] {
            assert!(e.is_lock_timeout(), "{e}");
        }
        assert!(shared.is_storage_lock_timeout());
        assert!(local.is_storage_lock_timeout());
        assert!(!config.is_storage_lock_timeout());
    }

    #[test]
    fn already_running_is_a_start_task_text() {
        let task = |exitstatus: &str| PveError::TaskFailed {
            upid: "UPID:pve1:0:0:0:qmstart:104:root@pam:".into(),
            exitstatus: exitstatus.into(),
        };
        assert!(task("VM 104 already running").is_already_running());
        assert!(!task("start failed: QEMU exited with code 1").is_already_running());
        assert!(
            !api(500, "VM 104 already running").is_already_running(),
            "only a task says it"
        );
    }

    /// Only the refusals qemu-server makes before an agent command is sent
    /// say it was never run; a timeout may have reached the guest.
    #[test]
    fn an_agent_command_refused_before_sending_is_told_apart_from_a_timeout() {
        assert!(api(500, "QEMU guest agent is not running\n").is_agent_unreached());
        assert!(api(500, "No QEMU guest agent configured\n").is_agent_unreached());
        assert!(api(500, "VM 104 is not running\n").is_agent_unreached());
        let timeout = api(
            500,
            "VM 104 qmp command 'guest-exec' failed - got timeout\n",
        );
        assert!(!timeout.is_agent_unreached());
        assert!(
            timeout.is_agent_not_running(),
            "a ping's timeout still waits for boot"
        );
        assert!(!api(500, "Agent error: No such file or directory").is_agent_unreached());
    }

    #[test]
    fn storage_missing_texts() {
        assert!(api(500, "storage 'nas' does not exist\n").is_storage_missing());
        assert!(api(500, "storage 'nas' is not available on node 'pve2'").is_storage_missing());
        assert!(PveError::Api {
            status: 400,
            message: "Parameter verification failed.".into(),
            param_errors: [(
                "storage".to_string(),
                "storage 'x' does not exist".to_string()
            )]
            .into(),
        }
        .is_storage_missing());
        assert!(PveError::Api {
            status: 400,
            message: "Parameter verification failed.".into(),
            param_errors: [("storage".to_string(), "No such storage.".to_string())].into(),
        }
        .is_storage_missing());
        assert!(!api(500, "storage 'nas' is not online").is_storage_missing());
        assert!(!api(
            403,
            "Permission check failed (/storage/nas, Datastore.Audit)"
        )
        .is_storage_missing());
    }

    use std::collections::BTreeMap;

    use super::*;
    use crate::error::Cause;

    fn cause(text: &str) -> Cause {
        Cause::new(std::io::Error::other(text.to_string()))
    }

    fn api(status: u16, msg: &str) -> PveError {
        PveError::Api {
            status,
            message: msg.into(),
            param_errors: BTreeMap::new(),
        }
    }

    #[test]
    fn a_protected_vm_is_told_apart() {
        let e = api(500, "can't remove VM 104 - protection mode enabled");
        assert!(e.is_protected() && !e.is_transient() && !e.is_locked());
        assert!(!api(500, "VM 104 is locked (backup)").is_protected());
    }

    #[test]
    fn classifiers() {
        let lock = api(
            500,
            "can't lock file '/var/lock/qemu-server/lock-104.conf' - got timeout",
        );
        assert!(lock.is_lock_timeout());
        assert!(!lock.is_not_found());
        assert!(api(
            500,
            "cfs-lock 'storage-nfs' error: got lock request timeout"
        )
        .is_lock_timeout());
        assert!(
            !api(500, "VM 104 qmp command 'guest-ping' failed - got timeout").is_lock_timeout()
        );
        assert!(
            api(500, "VM 104 qmp command 'guest-ping' failed - got timeout").is_agent_not_running()
        );
        assert!(api(400, "VM 104 already exists").is_already_exists());
        assert!(api(595, "Connection refused").is_node_unreachable());
        assert!(api(596, "Connection timed out").is_node_unreachable());
        assert!(!api(500, "x").is_node_unreachable());
        assert!(api(595, "Connection refused").is_unanswered());
        assert!(PveError::Timeout {
            op: "task_log",
            timeout: std::time::Duration::from_secs(1)
        }
        .is_unanswered());
        assert!(!api(500, "x").is_unanswered());
        assert!(!api(403, "Permission check failed").is_unanswered());
        assert!(api(401, "authentication failure").is_auth());
        assert!(api(
            500,
            "Configuration file 'nodes/pve1/qemu-server/104.conf' does not exist"
        )
        .is_not_found());
        assert!(api(404, "whatever").is_not_found());
        assert!(api(500, "QEMU guest agent is not running").is_agent_not_running());
        assert!(api(500, "No QEMU guest agent configured").is_agent_not_running());
        assert!(!api(500, "VM 104 is not running").is_agent_not_running());
        assert!(api(500, "VM 104 is not running").is_vm_not_running());
        let task = PveError::TaskFailed {
            upid: "u".into(),
            exitstatus: "clone failed: can't lock file '/var/lock/pve-manager/pve-storage-local-lvm' - got timeout".into(),
        };
        assert!(task.is_lock_timeout());
    }

    #[test]
    fn access_failures() {
        use AccessFailure::*;
        assert_eq!(
            api(401, "authentication failure").access_failure(),
            Some(Unauthorized)
        );
        assert_eq!(api(404, "Not Found").access_failure(), Some(WrongPath));
        let decode = PveError::Decode {
            op: "nodes",
            message: "body is not JSON: expected value".into(),
            source: None,
        };
        assert_eq!(decode.access_failure(), Some(WrongPath));
        let refused = PveError::Transport {
            op: "nodes",
            message: "client error (Connect): tcp connect error: Connection refused (os error 111)"
                .into(),
            connect: true,
            source: cause("Connection refused (os error 111)"),
        };
        assert_eq!(refused.access_failure(), Some(ConnectionRefused));
        let dns = PveError::Transport {
            op: "nodes",
            message: "client error (Connect): dns error: failed to lookup address".into(),
            connect: true,
            source: cause("failed to lookup address"),
        };
        assert_eq!(dns.access_failure(), Some(Unreachable));
        let tls = PveError::Tls {
            op: "nodes",
            message: "invalid peer certificate: UnknownIssuer".into(),
            source: cause("invalid peer certificate: UnknownIssuer"),
        };
        assert_eq!(tls.access_failure(), Some(Tls));
        let plain = PveError::Tls {
            op: "nodes",
            message: "received corrupt message of type InvalidContentType".into(),
            source: cause("received corrupt message of type InvalidContentType"),
        };
        assert_eq!(plain.access_failure(), Some(NotTls));
        assert_eq!(api(500, "VM 1 is locked").access_failure(), None);
        assert_eq!(api(403, "Permission check failed").access_failure(), None);
    }

    #[test]
    fn collisions_inside_the_clone_worker() {
        let task = |t: &str| PveError::TaskFailed {
            upid: "u".into(),
            exitstatus: t.into(),
        };
        assert!(task("unable to create VM 104: config file already exists").is_vmid_collision(104));
        assert!(task(
            "close (rename) atomic file '/etc/pve/nodes/pve1/qemu-server/104.conf' failed: File exists"
        )
        .is_vmid_collision(104));
        let newid_lock =
            task("can't lock file '/var/lock/qemu-server/lock-104.conf' - got timeout");
        assert!(newid_lock.is_vmid_collision(104));
        assert!(
            !newid_lock.is_vmid_collision(105),
            "another VM's lock is not a collision"
        );
        assert!(!task(
            "clone failed: can't lock file '/var/lock/pve-manager/pve-storage-local-lvm' - got timeout"
        )
        .is_vmid_collision(104));
        assert!(api(500, "VM 104 already exists on node 'pve2'").is_vmid_collision(104));
    }

    #[test]
    fn transient_and_ambiguous() {
        for s in [502, 503, 504, 595, 596, 597] {
            assert!(api(s, "x").is_transient(), "{s}");
        }
        assert!(!api(500, "VM 104 is running - destroy failed").is_transient());
        assert!(!api(403, "Permission check failed (/vms/104, VM.Audit)").is_transient());
        assert!(api(403, "Permission check failed (/vms/104, VM.Audit)").is_forbidden());
        let mut p = BTreeMap::new();
        p.insert("x".to_string(), "bad".to_string());
        let param = PveError::Api {
            status: 503,
            message: "Parameter verification failed.".into(),
            param_errors: p,
        };
        assert!(!param.is_transient());
        assert!(api(596, "Connection timed out").may_have_been_applied_post());
        assert!(api(597, "Connection error").may_have_been_applied_post());
        assert!(!api(595, "No route to host").may_have_been_applied_post());
        assert!(api(595, "No route to host").is_transient());
    }

    #[test]
    fn taken_vmid_in_param_errors_is_already_exists() {
        let mut p = BTreeMap::new();
        p.insert("vmid".to_string(), "VM 109 already exists".to_string());
        let taken = PveError::Api {
            status: 400,
            message: "Parameter verification failed.".into(),
            param_errors: p,
        };
        assert!(taken.is_already_exists());
        let mut p = BTreeMap::new();
        p.insert("vmid".to_string(), "invalid format".to_string());
        let other = PveError::Api {
            status: 400,
            message: "Parameter verification failed.".into(),
            param_errors: p,
        };
        assert!(!other.is_already_exists());
    }

    #[test]
    fn vm_config_missing_names_the_vm() {
        let gone = api(
            500,
            "Configuration file 'nodes/pve2/qemu-server/9001.conf' does not exist",
        );
        assert!(gone.is_vm_config_missing(9001));
        assert!(!gone.is_vm_config_missing(900), "another VM's config");
        assert!(!gone.is_vm_config_missing(19001), "another VM's config");
        let in_task = PveError::TaskFailed {
            upid: "u".into(),
            exitstatus:
                "clone failed: Configuration file 'nodes/pve2/qemu-server/9001.conf' does not exist"
                    .into(),
        };
        assert!(in_task.is_vm_config_missing(9001));
        assert!(!api(500, "storage 'local' does not exist").is_vm_config_missing(9001));
        assert!(!api(404, "Not Found").is_vm_config_missing(9001));
    }

    #[test]
    fn a_full_next_id_range() {
        assert!(api(500, "unable to get any free VMID in range [100, 200]").is_next_id_range_full());
        assert!(!api(500, "VM 130 already exists").is_next_id_range_full());
        assert!(!api(503, "Service Unavailable").is_next_id_range_full());
    }

    #[test]
    fn a_storage_the_node_cannot_activate() {
        let hung = "unable to activate storage 'nas' - directory '/mnt/pve/nas' does not exist or is unreachable";
        let in_task = PveError::TaskFailed {
            upid: "UPID:pve1:0:0:0:qmdestroy:104:root@pam:".into(),
            exitstatus: hung.into(),
        };
        assert!(in_task.is_storage_unavailable());
        assert!(api(500, hung).is_storage_unavailable());
        assert!(api(
            500,
            "unable to activate storage 'nfs1' - directory is expected to be a mount point but is not mounted: '/mnt/nfs1'"
        )
        .is_storage_unavailable());
        assert!(!api(500, "storage 'nas' is not online").is_storage_unavailable());
        assert!(!api(500, "storage 'local' does not exist").is_storage_unavailable());
    }

    #[test]
    fn offline_node_or_storage() {
        assert!(api(500, "target node 'pve2' is not online").is_offline());
        assert!(api(500, "storage 'nas' is not online").is_offline());
        let in_task = PveError::TaskFailed {
            upid: "u".into(),
            exitstatus: "migration aborted: target node 'pve2' is not online".into(),
        };
        assert!(in_task.is_offline());
        let mut p = BTreeMap::new();
        p.insert(
            "target".to_string(),
            "node 'pve2' is not online".to_string(),
        );
        let param = PveError::Api {
            status: 400,
            message: "Parameter verification failed.".into(),
            param_errors: p,
        };
        assert!(param.is_offline());
        assert!(!api(500, "no such cluster node 'pve9'").is_offline());
        assert!(!api(595, "No route to host").is_offline());
    }

    #[test]
    fn too_many_redirections_is_transient_and_not_applied() {
        let redirect = api(599, "Too many redirections");
        assert!(redirect.is_transient());
        assert!(redirect.is_proxy_redirect_loop());
        assert!(!redirect.may_have_been_applied());
        assert!(!redirect.may_have_been_applied_post());
        assert!(!api(599, "Internal error").is_proxy_redirect_loop());
        assert!(!api(599, "Internal error").is_transient());
    }

    #[test]
    fn no_quorum_is_transient() {
        let quorum = api(500, "cluster not ready - no quorum?\n");
        assert!(quorum.is_transient());
        let in_task = PveError::TaskFailed {
            upid: "u".into(),
            exitstatus: "clone failed: cluster not ready - no quorum?".into(),
        };
        assert!(in_task.is_transient());
        assert!(!api(500, "cluster not ready").is_transient());
    }

    #[test]
    fn storage_locked_command_timeout_is_transient() {
        let text =
            "cfs-lock 'storage-nfs' error: 'storage-nfs'-locked command timed out - aborting";
        assert!(api(500, text).is_transient());
        let in_task = PveError::TaskFailed {
            upid: "u".into(),
            exitstatus: format!("clone failed: {text}"),
        };
        assert!(in_task.is_transient());
        assert!(
            !api(500, text).is_lock_timeout(),
            "the command ran under the lock: it may have done part of its work"
        );
        assert!(!api(500, "command 'lvs' timed out").is_transient());
    }

    #[test]
    fn no_such_task_in_the_upid_parameter_is_not_found() {
        let mut p = BTreeMap::new();
        p.insert("upid".to_string(), "no such task".to_string());
        let gone = PveError::Api {
            status: 400,
            message: "Parameter verification failed.".into(),
            param_errors: p,
        };
        assert!(gone.is_not_found());
        let mut p = BTreeMap::new();
        p.insert(
            "upid".to_string(),
            "unable to parse worker upid".to_string(),
        );
        let malformed = PveError::Api {
            status: 400,
            message: "Parameter verification failed.".into(),
            param_errors: p,
        };
        assert!(!malformed.is_not_found());
    }

    #[test]
    fn a_task_that_found_its_vm_locked_is_transient() {
        let task = |t: &str| PveError::TaskFailed {
            upid: "UPID:pve1:0:0:0:qmdestroy:104:root@pam:".into(),
            exitstatus: t.into(),
        };
        let locked = task("VM is locked (backup)");
        assert!(locked.is_locked());
        assert!(locked.is_transient());
        let flock = task("can't lock file '/var/lock/qemu-server/lock-104.conf' - got timeout");
        assert!(flock.is_locked());
        assert!(flock.is_transient());
        let running = task("VM 104 is running - destroy failed");
        assert!(!running.is_locked());
        assert!(!running.is_transient());
        assert!(running.is_running_refusal());
        assert!(api(500, "VM 104 is running - destroy failed").is_running_refusal());
        assert!(!task("VM 104 already running").is_running_refusal());
        assert!(!locked.is_running_refusal());
    }

    #[test]
    fn local_storage_clone() {
        assert!(
            api(500, "can't clone VM to node 'pve2' (VM uses local storage)")
                .is_local_storage_clone()
        );
        let in_task = PveError::TaskFailed {
            upid: "u".into(),
            exitstatus: "can't clone VM to node 'pve2' (VM uses local storage)".into(),
        };
        assert!(in_task.is_local_storage_clone());
        assert!(!api(500, "can't clone to non-shared storage 'local'").is_local_storage_clone());
    }
}
