//! The endpoint methods of [`PveClient`](crate::PveClient), one typed method
//! per call the client supports, grouped by the PVE resource they act on:
//! `cluster` (cluster-wide reads: VMs, next id, options, SDN VNets, nodes,
//! version),
//! `vm` (one VM's config, power, clone, migrate, template, destroy),
//! `agent` (the guest agent inside a VM), `tasks` (worker tasks and waiting
//! for them), `storage` (a node's storages) and `access` (the token's
//! privileges and its pool). Each builds the path and parameters and hands
//! them to `PveClient::call`; how the request travels is the `client`
//! module's business.

mod access;
mod agent;
mod cluster;
mod storage;
mod tasks;
mod vm;

pub use agent::{MAX_EXEC_INPUT, MAX_FILE_WRITE_CONTENT};

use crate::form::encode_segment;

/// `/nodes/{node}/qemu/{vmid}{rest}`: the VM endpoints and the agent's under them.
fn vm_path(node: &str, vmid: u32, rest: &str) -> String {
    format!("/nodes/{}/qemu/{vmid}{rest}", encode_segment(node))
}
