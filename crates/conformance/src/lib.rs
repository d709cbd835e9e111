//! Black-box certification suite for any `bigfleet.v1alpha1.CapacityProvider` endpoint.
//!
//! - [`registry`]: the frozen 93-behavior extension registry.
//! - [`harness`]: dialing, capability probing, fencing sessions, state tracing, bursts.
//! - [`suite`]: the baseline and one implementing test per behavior (`suite::IMPLS`).
//! - [`process`]: owning a provider process (boot, wait-ready, kill -9, restart).
//! - [`runner`]: lanes, verdict, `report.json` and `junit.xml`.
//! - [`boot`]: boot compatibility with the published runner's flags, in a private network
//!   namespace.
//! - [`upstream`]: the upstream baseline from a bigfleet checkout (`$BIGFLEET_SRC`).
//!
//! Entry points:
//! - `bfconformance --provider proxmox --certify` (core+cloud; prints the CERTIFIED line)
//! - `bfconformance --provider proxmox --profile core,cloud,fault,durable,scale --out DIR`
//! - `bfconformance --target HOST:PORT [--tls-ca ..] [--tls-cert .. --tls-key ..] [--tls-domain ..]`
//! - `cargo test -p conformance` (registry well-formedness, lanes against the in-crate
//!   `fault-provider`), `cargo test -p conformance --features mutants --test mutants`
//!   (each providerkit mutant is caught by its guarding behavior).

pub mod boot;
pub mod harness;
pub mod process;
pub mod registry;
pub mod report;
pub mod runner;
pub mod suite;
pub mod upstream;
