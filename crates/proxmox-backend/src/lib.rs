//! The Proxmox side of the BigFleet provider, behind providerkit's
//! [`providerkit::Backend`]:
//!
//! - [`catalog`]: instance types, offerings, slot ids and pricing;
//! - [`substrate`]: the Proxmox-shaped [`substrate::Substrate`] interface,
//!   its typed error and the metrics decorator;
//! - [`proxmox`]: the real substrate over the `pve` client (markers, VMID
//!   choice, inventory, guest agent, clones);
//! - [`fake`]: the in-memory substrate for certification;
//! - [`backend`]: maps slots and transitions onto a substrate.
//!
//! It knows nothing of gRPC serving, flags or processes: the binary
//! (`bigfleet-proxmox`) wires it.

pub mod backend;
pub mod catalog;
pub mod fake;
pub mod proxmox;
pub mod redact;
pub mod substrate;
