//! proxmox-backend's integration tests, one binary (each file a module):
//! the real substrate against pve-sim (lifecycle, robustness, late clones,
//! clone bounds, template replicas, preflight, the guest's name, a Create
//! resumed after a restart) and the transition detail it reports. The fuzz
//! targets and the replica benchmark stay binaries of their own (`make
//! fuzz` and `make bench-replicas` run them by name).

mod common;

mod api_door;
mod bad_day;
mod bench_real;
mod clone_pace;
mod configurations;
mod devices;
mod guest_hostname;
mod node_memory;
mod offline_node;
mod preflight;
mod proxmox_clone_bound;
mod proxmox_late_clone;
mod proxmox_replicas;
mod proxmox_robust;
mod proxmox_sim;
mod pve_fidelity;
mod resumed_create;
mod stale_lock;
mod storage_guard;
mod task_cost;
mod templates;
mod transition_detail;
