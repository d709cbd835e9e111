//! Checks for the deployment artefacts under `deploy/` and the operator docs
//! under `docs/`. The tests live in `tests/`; this library holds what they
//! share: a Helm-compatible renderer for the chart, the manifests it renders
//! for operators' own validators, the Prometheus Operator objects' documented
//! shape, the docs' example commands and the workspace paths.
//!
//! No `helm` binary is available to the build, so [`helm`] renders the chart
//! with a Go text/template engine plus the handful of Helm/Sprig functions
//! the chart uses. The chart deliberately sticks to that subset.

pub mod commands;
pub mod dockerfile;
pub mod flags;
pub mod helm;
pub mod manifests;
pub mod monitoring;
pub mod operator;
pub mod tools;

use std::path::PathBuf;

/// Root of the Cargo workspace (two levels above this crate).
pub fn workspace_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .and_then(|p| p.parent())
        .map(PathBuf::from)
        .unwrap_or(manifest)
}
