//! The small trait a substrate implements to get the whole contract.

use std::collections::HashMap;
use std::time::Duration;

use crate::model::SharedFacts;
use async_trait::async_trait;

/// A substrate failure; its text becomes the machine's `last_error`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct BackendError {
    pub message: String,
}

impl BackendError {
    pub fn new(message: impl Into<String>) -> BackendError {
        BackendError {
            message: message.into(),
        }
    }
}

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
}

#[derive(Clone)]
pub struct ConfigureCtx {
    pub machine_id: String,
    pub operation_id: String,
    pub host_ref: String,
    pub cluster_id: String,
    /// Secret material: never log or persist it.
    pub bootstrap_blob: Vec<u8>,
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

/// A substrate. Every method may take as long as it needs: the engine runs
/// it in the background under the transition's timeout and never holds a
/// lock across it.
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// The slots this substrate offers, with any host already attached.
    async fn describe(&self) -> Result<Vec<SlotSpec>, BackendError>;

    /// Provision a host for the slot; returns its substrate reference.
    async fn create(&self, ctx: CreateCtx) -> Result<SubstrateHost, BackendError>;

    /// Join the host to `cluster_id` with the bootstrap blob.
    async fn configure(&self, ctx: ConfigureCtx) -> Result<(), BackendError>;

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

    /// Whether the engine must gate CONFIGURED on [`Backend::node_ready`].
    fn supports_readiness(&self) -> bool {
        false
    }

    /// One readiness probe after a successful configure: `Ok(true)` once the
    /// node can take work. Polled until true or the Configure timeout.
    async fn node_ready(&self, _ctx: &ConfigureCtx) -> Result<bool, BackendError> {
        Ok(true)
    }
}
