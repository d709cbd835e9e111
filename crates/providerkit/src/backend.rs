//! The small trait a substrate implements to get the whole contract.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::model::SharedFacts;
use async_trait::async_trait;
use zeroize::Zeroizing;

/// What kind of failure a substrate reports: how a caller may react to it
/// (retry, give up, treat as gone, fix a permission) and how metrics label it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// May clear by itself (a node or the network is down for a while, a
    /// lock is held, a timeout): retrying within the deadline is reasonable.
    Transient,
    /// Will not clear by retrying (bad input, a refused operation, a guest
    /// command that failed).
    Permanent,
    /// The object does not exist (any more).
    NotFound,
    /// The substrate refused the credentials or the permission.
    Refused,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 4] = [
        ErrorKind::Transient,
        ErrorKind::Permanent,
        ErrorKind::NotFound,
        ErrorKind::Refused,
    ];

    /// The label value in metrics and logs.
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::Transient => "transient",
            ErrorKind::Permanent => "permanent",
            ErrorKind::NotFound => "not_found",
            ErrorKind::Refused => "refused",
        }
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The typed cause behind an error, shared so errors stay `Clone`.
pub type Cause = Arc<dyn std::error::Error + Send + Sync + 'static>;

/// A substrate failure: a kind, the whole operator-facing message (it becomes
/// the machine's `last_error` verbatim, so it already includes the cause's
/// text) and the typed cause, if any.
#[derive(Debug, Clone)]
pub struct BackendError {
    kind: ErrorKind,
    message: String,
    cause: Option<Cause>,
}

impl std::fmt::Display for BackendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// Written out rather than derived: a derived `source()` would hand out the
/// `Arc` that shares the cause, which no caller can downcast to the cause's
/// type (a `SubstrateError`, a `PveError`); this hands out the cause.
impl std::error::Error for BackendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause
            .as_deref()
            .map(|cause| cause as &(dyn std::error::Error + 'static))
    }
}

impl BackendError {
    /// A permanent failure with no typed cause.
    pub fn new(message: impl Into<String>) -> BackendError {
        BackendError::with_kind(ErrorKind::Permanent, message)
    }

    pub fn with_kind(kind: ErrorKind, message: impl Into<String>) -> BackendError {
        BackendError {
            kind,
            message: message.into(),
            cause: None,
        }
    }

    /// `message` should already say what `cause` says (see the type's docs).
    pub fn caused_by(kind: ErrorKind, message: impl Into<String>, cause: Cause) -> BackendError {
        BackendError {
            kind,
            message: message.into(),
            cause: Some(cause),
        }
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }
}

impl PartialEq for BackendError {
    fn eq(&self, other: &BackendError) -> bool {
        self.kind == other.kind && self.message == other.message
    }
}

impl Eq for BackendError {}

/// One slot the substrate offers: its identity and catalogue facts (shared
/// by every slot of an offering), plus the host currently attached to it, if
/// the substrate already has one.
#[derive(Clone, Debug, PartialEq)]
pub struct SlotSpec {
    pub id: String,
    pub facts: SharedFacts,
    /// A host the substrate found marked for this slot (adopted as IDLE
    /// when the engine has no lifecycle state of its own for the slot).
    pub host: Option<SubstrateHost>,
}

/// The substrate-scoped host reference (for Proxmox `<node>/<vmid>`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubstrateHost {
    pub host_ref: String,
}

#[derive(Clone, Debug)]
pub struct CreateCtx {
    pub machine_id: String,
    pub operation_id: String,
    pub instance_type: String,
    pub zone: String,
    /// This Create continues one a provider restart interrupted: the
    /// earlier attempt may have left a partial result on the substrate (a
    /// clone still running, a VM not yet marked) that must be found and
    /// adopted, never duplicated.
    pub resumed: bool,
}

/// A Create about to be accepted: what the substrate needs to decide whether
/// it has room for the machine.
#[derive(Clone, Debug)]
pub struct AdmitCtx {
    pub machine_id: String,
    pub instance_type: String,
    pub zone: String,
}

/// A Create's claim on the substrate's capacity, taken by
/// [`Backend::admit_create`] before the Create is accepted and held by the
/// engine until the Create's outcome has landed (or the Create was not
/// accepted after all). Dropping it gives the claim back, so whatever it
/// holds releases its claim in its own `Drop`.
pub struct Admission(Option<Box<dyn Send + Sync>>);

impl Admission {
    /// Admitted with nothing held (a substrate with no capacity to guard).
    pub fn unguarded() -> Admission {
        Admission(None)
    }

    /// Admitted; `claim` is held until the Create's outcome lands.
    pub fn holding(claim: impl Send + Sync + 'static) -> Admission {
        Admission(Some(Box::new(claim)))
    }
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Admission(holding)"
        } else {
            "Admission(unguarded)"
        })
    }
}

#[derive(Clone)]
pub struct ConfigureCtx {
    pub machine_id: String,
    pub operation_id: String,
    pub host_ref: String,
    pub cluster_id: String,
    /// Secret material: never log or persist it. Wiped when the last
    /// copy of the context is dropped (the Configure has ended).
    pub bootstrap_blob: Zeroizing<Vec<u8>>,
    pub shard_metadata: HashMap<String, String>,
}

impl std::fmt::Debug for ConfigureCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfigureCtx")
            .field("machine_id", &self.machine_id)
            .field("operation_id", &self.operation_id)
            .field("host_ref", &self.host_ref)
            .field("cluster_id", &self.cluster_id)
            .field(
                "bootstrap_blob",
                &format_args!("<{} bytes redacted>", self.bootstrap_blob.len()),
            )
            .finish()
    }
}

#[derive(Clone, Debug)]
pub struct DrainCtx {
    pub machine_id: String,
    pub operation_id: String,
    pub host_ref: String,
    pub cluster_id: String,
    pub grace_period: Duration,
}

#[derive(Clone, Debug)]
pub struct DeleteCtx {
    pub machine_id: String,
    pub operation_id: String,
    pub host_ref: String,
}

/// An operator reclaim of a FAILED machine: destroy what the substrate holds
/// for it so the slot can start over.
#[derive(Clone, Debug)]
pub struct ReclaimCtx {
    pub machine_id: String,
    /// The host on record, if any. A FAILED Create usually has none even
    /// though a host marked for the machine may exist.
    pub host_ref: Option<String>,
}

/// A substrate. Every method may take as long as it needs: the engine runs
/// it in the background under the transition's timeout and never holds a
/// lock across it.
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// The slots this substrate offers, with any host already attached.
    async fn describe(&self) -> Result<Vec<SlotSpec>, BackendError>;

    /// Asked before a Create of a SPECULATIVE machine is accepted, outside
    /// the state lock: whether the substrate has room for it now. `Ok`
    /// admits it (the claim is held until the outcome lands); `Err` refuses
    /// it synchronously: the RPC fails with RESOURCE_EXHAUSTED and the
    /// error's text, the machine stays SPECULATIVE, and nothing is started.
    /// Only "no room" should refuse: a substrate that cannot tell now
    /// should admit and let [`Backend::create`] decide (its failure lands
    /// FAILED as usual). The default admits everything.
    async fn admit_create(&self, _ctx: &AdmitCtx) -> Result<Admission, BackendError> {
        Ok(Admission::unguarded())
    }

    /// Provision a host for the slot; returns its substrate reference.
    async fn create(&self, ctx: CreateCtx) -> Result<SubstrateHost, BackendError>;

    /// Join the host to `cluster_id` with the bootstrap blob. By reference:
    /// the blob (up to the cap, 1 MiB) is not copied for the call.
    async fn configure(&self, ctx: &ConfigureCtx) -> Result<(), BackendError>;

    /// Remove the host's workload within the grace period; the host stays.
    async fn drain(&self, ctx: DrainCtx) -> Result<(), BackendError>;

    /// Whether [`Backend::delete`] is implemented (the `cloud` profile).
    fn supports_delete(&self) -> bool {
        false
    }

    /// Release the host; the slot returns to SPECULATIVE.
    async fn delete(&self, _ctx: DeleteCtx) -> Result<(), BackendError> {
        Err(BackendError::new("delete is not supported by this backend"))
    }

    /// Destroy every host the substrate holds for `ctx.machine_id` (the one
    /// on record and any other marked for the machine), and nothing that is
    /// not verifiably this machine's. Succeeds when nothing is left; an
    /// already-gone host is success.
    ///
    /// The default destroys the host on record through [`Backend::delete`]
    /// and cannot find unrecorded hosts: a substrate that marks its hosts
    /// should override it.
    async fn reclaim(&self, ctx: ReclaimCtx) -> Result<(), BackendError> {
        let Some(host_ref) = ctx.host_ref else {
            return Ok(());
        };
        if !self.supports_delete() {
            return Err(BackendError::new(format!(
                "this backend cannot destroy hosts: remove host {host_ref} of machine {} by \
                 hand, then reclaim again",
                ctx.machine_id
            )));
        }
        self.delete(DeleteCtx {
            machine_id: ctx.machine_id,
            operation_id: "reclaim".to_string(),
            host_ref,
        })
        .await
    }

    /// Whether the engine must gate CONFIGURED on [`Backend::node_ready`].
    fn supports_readiness(&self) -> bool {
        false
    }

    /// One readiness probe after a successful configure: `Ok(true)` once the
    /// node can take work. Polled until true or the Configure timeout.
    async fn node_ready(&self, _ctx: &ConfigureCtx) -> Result<bool, BackendError> {
        Ok(true)
    }

    /// For a Configure that timed out waiting for readiness: what the last
    /// probe of the host said (exit code, redacted output), quoted in
    /// `last_error`. `None` when no probe ran since the Configure started.
    fn readiness_detail(&self, _host_ref: &str) -> Option<String> {
        None
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    /// The blob a Configure carries is wiped when its context goes, with
    /// every clone of it; its Debug form never shows it.
    #[test]
    fn the_blob_of_a_configure_is_wiped_with_its_context() {
        fn wiped_on_drop<T: zeroize::ZeroizeOnDrop>(_: &T) {}
        let ctx = ConfigureCtx {
            machine_id: "m".into(),
            operation_id: "op".into(),
            host_ref: "pve1/100".into(),
            cluster_id: "c".into(),
            bootstrap_blob: Zeroizing::new(b"kubeadm join --token s3cret".to_vec()),
            shard_metadata: HashMap::new(),
        };
        wiped_on_drop(&ctx.bootstrap_blob);
        wiped_on_drop(&ctx.clone().bootstrap_blob);
        assert!(!format!("{ctx:?}").contains("s3cret"));
        // What dropping runs: every byte, the spare capacity too, is zero.
        let mut blob = ctx.bootstrap_blob.clone();
        let held = blob.as_ptr();
        zeroize::Zeroize::zeroize(&mut *blob);
        assert!(blob.is_empty() && blob.as_ptr() == held);
    }

    #[test]
    fn the_cause_is_the_source_itself() {
        let io = std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer");
        let e = BackendError::caused_by(ErrorKind::Transient, "node a: no answer", Arc::new(io));
        assert_eq!(e.to_string(), "node a: no answer");
        let cause = e.source().and_then(|s| s.downcast_ref::<std::io::Error>());
        assert_eq!(
            cause.map(std::io::Error::kind),
            Some(std::io::ErrorKind::TimedOut)
        );
        assert!(BackendError::new("refused").source().is_none());
    }
}
