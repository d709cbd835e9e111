//! The `bigfleet-proxmox` binary's composition root: configuration
//! ([`config`], validated once into a [`Plan`] of sub-configurations by
//! [`plan()`]), serving ([`serve::run`]: the gRPC server and the metrics
//! and probe listener ([`probes`]), over terms of serving ([`terms`]: the
//! engine, the reconcile loop; one term per leader lease held, [`leader`],
//! with a PostgreSQL state), metrics, logging, TLS, the caller identities
//! of mTLS ([`identity`], applied by [`guard`]), where a state is and how it opens
//! ([`state`]), and `state copy` ([`state_copy`]). The
//! Proxmox policy lives in `proxmox-backend`, the contract engine in
//! `providerkit`, the operator client in `bigfleet-ctl`.

pub mod accept;
pub mod admin;
pub mod budget;
pub mod config;
pub mod core_dumps;
pub mod error;
pub mod guard;
pub mod hygiene;
pub mod identity;
pub mod intake;
pub mod layers;
pub mod leader;
pub mod logging;
pub mod metrics;
pub mod plan;
pub mod probes;
pub mod serve;
pub mod state;
pub mod state_copy;
pub mod terms;
pub mod tls;

pub use error::{ConfigError, ConfigErrorKind, StartupError};
pub use plan::{
    plan, BackendConfig, BackendKind, Catalog, Plan, ProxmoxAccess, ProxmoxConfig, ReconcileConfig,
    ServingConfig,
};
