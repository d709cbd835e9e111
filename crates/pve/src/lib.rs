//! Typed async client for the subset of the Proxmox VE API the BigFleet
//! provider uses (see `proxmox-api.md` in the specs).
//!
//! * [`PveClient`] — one method per endpoint, PVE token auth, per-request
//!   timeout, safe-only retries ([`RetryPolicy`]) and an [`ApiObserver`] hook.
//!   The [`client`] module is the transport (configuration, TLS, retries,
//!   request and decode); the endpoint methods are grouped by PVE resource
//!   (cluster, VM, guest agent, tasks, storage, access) in private modules.
//! * [`sdn`] — the SDN VNets and the paths PVE checks a NIC's `SDN.Use` on.
//! * [`tls`] — CA-chain and/or SHA-256 leaf-pin verification; there is no
//!   way to turn verification off.
//! * [`PveError`] — API/transport/task errors with classifiers
//!   (`is_lock_timeout`, `is_already_exists`, `is_node_unreachable`, ...);
//!   transport, TLS and decode failures keep their cause as `source()`.
//! * [`Upid`], [`normalize_tags`], [`sanitize_tag`], [`form::Params`],
//!   [`types::lenient`] — the wire formats' helpers.

mod api;
pub mod client;
pub mod devices;
pub mod error;
pub mod form;
pub mod sdn;
pub mod tags;
pub mod tls;
pub mod types;
pub mod upid;

pub use api::{MAX_EXEC_INPUT, MAX_FILE_WRITE_CONTENT};
pub use client::{ApiCall, ApiObserver, PveClient, PveConfig, RequestGate, RetryPolicy};
pub use devices::{DeviceBus, Passthrough, PciMapping};
pub use error::{AccessFailure, PveError};
pub use sdn::{SdnPath, SdnVnet, VnetZones};
pub use tags::{is_valid_tag, join_tags, normalize_tags, sanitize_tag};
pub use tls::{cert_fingerprint, format_fingerprint, parse_fingerprint, parse_fingerprints};
pub use types::{
    exit_ok, Cdrom, CloneParams, ClusterOptions, ClusterVm, ClusterVms, ConfigParams, ExecStatus,
    FileEncoding, MigrateParams, NodeInfo, Permissions, PoolMember, StorageStatus, TagAccess,
    TaskLogLine, TaskState, TaskStatus, TaskSummary, VmConfig, VmStatus,
};
pub use upid::Upid;
