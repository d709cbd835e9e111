//! The `bigfleet-proxmox` binary's tests, one test binary (each file a
//! module): start-up validation, TLS, caller identities under mTLS and the
//! admin listener, limits,
//! readiness, observability, secrets in logs, PostgreSQL state, `state
//! copy` between stores, the operator client, the binary on the real
//! backend against pve-sim, and resumption after a restart (kill -9 inside each transition, SIGTERM).
//! Most boot the built binary
//! as a child process; the kill -9 campaigns (`crash`, `crash_real`) stay
//! binaries of their own, run by name by `make crash-1000` and
//! `make crash-real`.

mod common;

mod admin_tls;
mod configure_load;
mod ctl;
mod destroy_leftovers;
mod failover;
mod gpu;
mod identity;
mod limits;
mod list_share;
mod node_memory;
mod observability;
mod offline_start;
mod pg_state;
mod proxmox_qga;
mod readiness;
mod resume;
mod secrets;
mod sized_disk;
mod startup;
mod state_copy;
mod storage_guard;
mod timeline;
mod tls;
