//! The Proxmox side of the BigFleet provider, behind providerkit's
//! [`providerkit::Backend`]:
//!
//! - [`catalog`]: instance types, offerings, slot ids and pricing;
//! - [`substrate`]: the Proxmox-shaped [`substrate::Substrate`] interface,
//!   its typed error and the metrics decorator;
//! - [`proxmox`]: the real substrate over the `pve` client (markers, VMID
//!   choice, inventory, guest agent, clones);
//! - [`fake`]: the in-memory substrate for certification;
//! - [`memory`]: the node memory guard both substrates check before a clone;
//! - [`capacity`]: what an admitted Create holds, and why one is refused;
//! - [`backend`]: maps slots and transitions onto a substrate;
//! - [`timeline`]: where each transition's time went, step by step.
//!
//! It knows nothing of gRPC serving, flags or processes: the binary
//! (`bigfleet-proxmox`) wires it.

pub mod backend;
pub mod capacity;
pub mod catalog;
pub mod fake;
pub mod memory;
pub mod proxmox;
pub mod redact;
pub mod substrate;
pub mod timeline;

/// Configuration the backend was handed that it cannot use: a file it
/// cannot read or parse, or a value that is not allowed. Each message names
/// the flag and what to change.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {flag} {}: {source}", path.display())]
    Read {
        flag: &'static str,
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{flag} {} is not valid: {source}", path.display())]
    Parse {
        flag: &'static str,
        path: std::path::PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// A value that parses but is not allowed.
    #[error("{0}")]
    Invalid(String),
}
