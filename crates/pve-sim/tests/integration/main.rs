//! pve-sim's integration tests, one binary (each file a module): the API
//! over HTTPS, the real-cluster failure modes, the realism knobs, storage
//! placement, the endpoint schema, the guest agent through a real
//! `qemu-ga`, and the dialect as proxmoxer speaks it.

mod common;

mod api;
mod cli;
mod configurations;
mod failure_modes;
mod fidelity;
mod mappings;
mod memory;
mod node_offline;
mod proxmoxer;
mod qga;
mod realism;
mod resize;
mod schema;
mod storage;
mod templates;
