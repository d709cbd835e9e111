//! The Proxmox-shaped substrate client the backend drives, and the metrics
//! decorator every implementation (real or fake) is wrapped in.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use providerkit::{BackendError, Cause, ErrorKind};

use crate::capacity::{Admitted, Refusal, StorageSpace};
use crate::memory::MemoryRoom;

/// One clone-slot domain as it stands: how many clones may run at once
/// there, how many run, and how many wait.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CloneSlotsView {
    /// The node, or `(cluster)` for a shared storage's cluster-wide slots.
    pub node: String,
    /// The storages the clones write to, joined by `+`.
    pub storage: String,
    pub limit: usize,
    pub used: usize,
    pub waiting: usize,
    /// A node's storage that learnt its rate: one clone starts each this
    /// long. `None` while it learns, or where nothing paces.
    pub pace: Option<std::time::Duration>,
}

/// A VM on one node: `HostRef.ref` is `<node>/<vmid>`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct VmRef {
    pub node: String,
    pub vmid: u32,
}

impl VmRef {
    pub fn host_ref(&self) -> String {
        format!("{}/{}", self.node, self.vmid)
    }

    pub fn parse(host_ref: &str) -> Result<VmRef, SubstrateError> {
        let bad = || SubstrateError::new(format!("host ref {host_ref:?} is not <node>/<vmid>"));
        let (node, vmid) = host_ref.rsplit_once('/').ok_or_else(bad)?;
        if node.is_empty() {
            return Err(bad());
        }
        Ok(VmRef {
            node: node.to_string(),
            vmid: vmid.parse().map_err(|_| bad())?,
        })
    }
}

impl std::fmt::Display for VmRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.node, self.vmid)
    }
}

/// What a Create asks the substrate for.
#[derive(Clone, Debug)]
pub struct CloneRequest {
    pub machine_id: String,
    pub operation_id: String,
    pub instance_type: String,
    pub node: String,
    pub template_vmid: u32,
    pub vcpu: u32,
    pub memory_mib: u64,
    /// Continues a Create a provider restart interrupted: a clone the
    /// earlier process started may still be running, with no marker yet.
    pub resumed: bool,
}

/// A VM carrying our marker.
#[derive(Clone, Debug, PartialEq)]
pub struct ManagedVm {
    pub vm: VmRef,
    pub machine_id: String,
    pub running: bool,
}

/// A substrate failure: a kind, the whole operator-facing message (it
/// becomes `last_error` verbatim, so it includes the cause's text) and the
/// typed cause (a [`pve::PveError`], say), if any.
#[derive(Clone, Debug)]
pub struct SubstrateError {
    kind: ErrorKind,
    message: String,
    cause: Option<Cause>,
}

impl std::fmt::Display for SubstrateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// `source()` is the cause itself, not the `Arc` it is kept in, so a caller
/// can downcast it (to a [`pve::PveError`], say).
impl std::error::Error for SubstrateError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause
            .as_deref()
            .map(|c| c as &(dyn std::error::Error + 'static))
    }
}

impl SubstrateError {
    /// A permanent failure with no typed cause.
    pub fn new(message: impl Into<String>) -> SubstrateError {
        SubstrateError::with_kind(ErrorKind::Permanent, message)
    }

    pub fn with_kind(kind: ErrorKind, message: impl Into<String>) -> SubstrateError {
        SubstrateError {
            kind,
            message: message.into(),
            cause: None,
        }
    }

    /// `{context}: {cause}`, keeping `cause` as the typed source.
    pub fn caused_by<E>(
        kind: ErrorKind,
        context: impl std::fmt::Display,
        cause: E,
    ) -> SubstrateError
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        SubstrateError {
            kind,
            message: format!("{context}: {cause}"),
            cause: Some(Arc::new(cause)),
        }
    }

    /// The same failure with more context in front of its message.
    pub fn context(mut self, context: impl std::fmt::Display) -> SubstrateError {
        self.message = format!("{context}: {}", self.message);
        self
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }
}

impl PartialEq for SubstrateError {
    fn eq(&self, other: &SubstrateError) -> bool {
        self.kind == other.kind && self.message == other.message
    }
}

impl From<SubstrateError> for BackendError {
    fn from(e: SubstrateError) -> BackendError {
        let kind = e.kind;
        BackendError::caused_by(kind, e.to_string(), Arc::new(e))
    }
}

#[async_trait]
pub trait Substrate: Send + Sync + 'static {
    /// Before a Create is accepted: checks that its node has memory for it
    /// (see [`crate::memory`]) and its storages room for a full clone's
    /// disks, and claims both until what it returns drops. Nothing held:
    /// nothing to guard, or the room could not be read now (the clone checks
    /// again); `Err`: no room, refuse the Create.
    async fn admit(&self, _req: &CloneRequest) -> Result<Admitted, Refusal> {
        Ok(Admitted::default())
    }
    /// Each storage full clones land on, as the storage guard last checked it.
    fn storage_spaces(&self) -> Vec<StorageSpace> {
        Vec::new()
    }
    /// Reads the storages full clones on `nodes` land on now (those the
    /// configuration names), and returns every storage as then known.
    async fn observe_storage(&self, _nodes: &[String]) -> Vec<StorageSpace> {
        Vec::new()
    }
    /// Each node's memory room as last seen, by node name.
    fn memory_rooms(&self) -> Vec<MemoryRoom> {
        Vec::new()
    }
    /// Reads the memory room of each of `nodes` now (a node that cannot be
    /// read is left out, with a warning).
    async fn observe_memory(&self, _nodes: &[String]) -> Vec<MemoryRoom> {
        Vec::new()
    }
    /// The nodes the last inventory read found down (for `node_up`).
    fn offline_nodes(&self) -> Vec<String> {
        Vec::new()
    }

    /// How many volumes destroys reported they could not free (the VM went,
    /// the disk stayed), since this substrate was made.
    fn destroy_leftovers(&self) -> u64 {
        0
    }
    /// How far the disk copy of the PVE task `upid` is, in percent, as its
    /// log last reported it (a full clone under way); `None` when its log
    /// reports none. Read when asked (an operator's `ctl get`), not polled.
    async fn copy_progress(&self, _upid: &str) -> Result<Option<f64>, SubstrateError> {
        Ok(None)
    }
    /// Each clone-slot domain's slots, as they stand now.
    fn clone_slots(&self) -> Vec<CloneSlotsView> {
        Vec::new()
    }
    /// Clone, size, mark, start and wait for the guest agent. A VM already
    /// marked for this machine id is adopted (and powered on) instead.
    async fn clone_vm(&self, req: &CloneRequest) -> Result<VmRef, SubstrateError>;
    /// Stop and destroy with disks; an already-gone VM is success. Only a VM
    /// whose description marker names `machine_id` is destroyed: anything
    /// else at that VMID (reused id, a look-alike) is left alone as "gone".
    async fn delete_vm(&self, vm: &VmRef, machine_id: &str) -> Result<(), SubstrateError>;
    /// Every VM carrying our marker.
    async fn describe_managed(&self) -> Result<Vec<ManagedVm>, SubstrateError>;
    /// Power on if stopped and wait for the agent; no-op when running.
    async fn ensure_running(&self, vm: &VmRef) -> Result<(), SubstrateError>;
    /// Deliver the bootstrap blob and run the hook.
    async fn configure(&self, vm: &VmRef, blob: &[u8]) -> Result<(), SubstrateError>;
    /// Whether Configure must wait for [`Substrate::node_ready`].
    fn readiness_gate(&self) -> bool;
    async fn node_ready(&self, vm: &VmRef) -> Result<bool, SubstrateError>;
    /// What the last failed readiness probe of the VM's Configure said (exit
    /// code and redacted stderr tail), taken once, for a readiness timeout.
    fn readiness_detail(&self, _vm: &VmRef) -> Option<String> {
        None
    }
    /// Drain the node inside the guest within the grace period.
    async fn drain(&self, vm: &VmRef, grace: Duration) -> Result<(), SubstrateError>;
}

/// The `op` label values [`Metered`] reports.
pub const API_OPS: [&str; 7] = [
    "CloneVM",
    "DeleteVM",
    "DescribeManaged",
    "EnsureRunning",
    "Configure",
    "NodeReady",
    "Drain",
];

/// Receives one observation per substrate call.
pub trait ApiObserver: Send + Sync + 'static {
    /// `outcome` is `Ok` or the failure's kind.
    fn observe(&self, op: &'static str, outcome: Result<(), ErrorKind>, elapsed: Duration);
}

/// Wraps a substrate and reports every call (`op`, outcome, duration).
pub struct Metered {
    inner: Arc<dyn Substrate>,
    observer: Arc<dyn ApiObserver>,
}

impl Metered {
    pub fn new(inner: Arc<dyn Substrate>, observer: Arc<dyn ApiObserver>) -> Metered {
        Metered { inner, observer }
    }

    async fn timed<T>(
        &self,
        op: &'static str,
        call: impl std::future::Future<Output = Result<T, SubstrateError>>,
    ) -> Result<T, SubstrateError> {
        let started = Instant::now();
        let result = call.await;
        let outcome = match &result {
            Ok(_) => Ok(()),
            Err(e) => Err(e.kind()),
        };
        self.observer.observe(op, outcome, started.elapsed());
        result
    }
}

#[async_trait]
impl Substrate for Metered {
    async fn admit(&self, req: &CloneRequest) -> Result<Admitted, Refusal> {
        self.inner.admit(req).await
    }
    fn storage_spaces(&self) -> Vec<StorageSpace> {
        self.inner.storage_spaces()
    }
    async fn observe_storage(&self, nodes: &[String]) -> Vec<StorageSpace> {
        self.inner.observe_storage(nodes).await
    }
    fn memory_rooms(&self) -> Vec<MemoryRoom> {
        self.inner.memory_rooms()
    }
    async fn observe_memory(&self, nodes: &[String]) -> Vec<MemoryRoom> {
        self.inner.observe_memory(nodes).await
    }
    fn offline_nodes(&self) -> Vec<String> {
        self.inner.offline_nodes()
    }
    fn destroy_leftovers(&self) -> u64 {
        self.inner.destroy_leftovers()
    }
    async fn copy_progress(&self, upid: &str) -> Result<Option<f64>, SubstrateError> {
        self.inner.copy_progress(upid).await
    }

    fn clone_slots(&self) -> Vec<CloneSlotsView> {
        self.inner.clone_slots()
    }
    async fn clone_vm(&self, req: &CloneRequest) -> Result<VmRef, SubstrateError> {
        self.timed("CloneVM", self.inner.clone_vm(req)).await
    }
    async fn delete_vm(&self, vm: &VmRef, machine_id: &str) -> Result<(), SubstrateError> {
        self.timed("DeleteVM", self.inner.delete_vm(vm, machine_id))
            .await
    }
    async fn describe_managed(&self) -> Result<Vec<ManagedVm>, SubstrateError> {
        self.timed("DescribeManaged", self.inner.describe_managed())
            .await
    }
    async fn ensure_running(&self, vm: &VmRef) -> Result<(), SubstrateError> {
        self.timed("EnsureRunning", self.inner.ensure_running(vm))
            .await
    }
    async fn configure(&self, vm: &VmRef, blob: &[u8]) -> Result<(), SubstrateError> {
        self.timed("Configure", self.inner.configure(vm, blob))
            .await
    }
    fn readiness_gate(&self) -> bool {
        self.inner.readiness_gate()
    }
    async fn node_ready(&self, vm: &VmRef) -> Result<bool, SubstrateError> {
        // A probe of its own: counted under Configure, the probes of one
        // slow node made hundreds of Configure "successes" and hid the
        // error ratio. "Not ready yet" (Ok(false)) is a probe that worked;
        // only a probe that could not run is an error.
        self.timed("NodeReady", self.inner.node_ready(vm)).await
    }
    fn readiness_detail(&self, vm: &VmRef) -> Option<String> {
        self.inner.readiness_detail(vm)
    }
    async fn drain(&self, vm: &VmRef, grace: Duration) -> Result<(), SubstrateError> {
        self.timed("Drain", self.inner.drain(vm, grace)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Seen(parking_lot::Mutex<Vec<(&'static str, bool)>>);

    impl ApiObserver for Seen {
        fn observe(&self, op: &'static str, outcome: Result<(), ErrorKind>, _: Duration) {
            self.0.lock().push((op, outcome.is_ok()));
        }
    }

    #[tokio::test]
    async fn readiness_probes_are_metered_as_their_own_op() {
        let seen = Arc::new(Seen::default());
        let fake = Arc::new(crate::fake::FakeCluster::new(
            vec!["pve1".into()],
            Duration::ZERO,
        ));
        let metered = Metered::new(fake, seen.clone());
        let vm = VmRef::parse("pve1/100").expect("a VM ref");
        assert!(metered.node_ready(&vm).await.expect("the fake is ready"));
        assert_eq!(*seen.0.lock(), vec![("NodeReady", true)]);
        assert!(API_OPS.contains(&"NodeReady"));
    }

    #[test]
    fn the_cause_is_the_source_itself() {
        let pve = pve::PveError::NotFound("pool bigfleet".into());
        let e = SubstrateError::caused_by(ErrorKind::NotFound, "reading the pool", pve);
        assert_eq!(
            e.to_string(),
            "reading the pool: pool bigfleet does not exist"
        );
        let source = std::error::Error::source(&e).expect("a source");
        assert!(
            source.downcast_ref::<pve::PveError>().is_some(),
            "the PveError, not its Arc: {source:?}"
        );
        assert!(std::error::Error::source(&SubstrateError::new("plain")).is_none());
    }

    #[test]
    fn host_ref_round_trip() {
        let vm = VmRef::parse("pve1/104").unwrap();
        assert_eq!(
            vm,
            VmRef {
                node: "pve1".into(),
                vmid: 104
            }
        );
        assert_eq!(vm.host_ref(), "pve1/104");
        assert!(VmRef::parse("pve1").is_err());
        assert!(VmRef::parse("/104").is_err());
        assert!(VmRef::parse("pve1/x").is_err());
    }
}
