//! Error type for every client operation: [`PveError`] and its `Display`
//! (what callers log and quote). What kind of failure an error is (lock
//! timeout, VMID collision, unreachable node, agent not ready, ...) is the
//! `classify` submodule's job: the classifiers read PVE's texts.

use std::collections::BTreeMap;
use std::time::Duration;

mod classify;

pub(crate) use classify::is_lock_timeout_text;
pub use classify::AccessFailure;

/// Everything a [`crate::PveClient`] call can fail with.
#[derive(Clone, Debug, thiserror::Error)]
pub enum PveError {
    /// The client configuration is unusable (bad URL, missing trust material, ...).
    #[error("invalid PVE client configuration: {0}")]
    Config(String),

    /// An argument the caller passed cannot be sent (too large, not UTF-8, malformed UPID, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The TLS handshake failed: wrong CA, wrong hostname, pin mismatch, bad signature.
    /// Never retried: it does not heal by itself.
    #[error("TLS verification of the PVE API failed for {op}: {message}")]
    Tls { op: &'static str, message: String },

    /// The request could not be completed at the transport level. `connect` is true
    /// when no connection was established, so the request cannot have been applied.
    #[error("transport error calling PVE {op}: {message}")]
    Transport {
        op: &'static str,
        message: String,
        connect: bool,
    },

    /// No complete response within the per-request timeout.
    #[error("PVE {op} timed out after {timeout:?}")]
    Timeout { op: &'static str, timeout: Duration },

    /// The API answered with a non-2xx status.
    #[error("PVE API error {status}: {message}{}", fmt_params(param_errors))]
    Api {
        status: u16,
        message: String,
        /// Per-parameter reasons from a 400 `{"errors":{...}}` body.
        param_errors: BTreeMap<String, String>,
    },

    /// A 2xx response whose body does not have the documented shape.
    #[error("unexpected PVE response for {op}: {message}")]
    Decode { op: &'static str, message: String },

    /// A worker task ended with an exit status other than `OK` / `WARNINGS: N`.
    #[error("PVE task {upid} failed: {exitstatus}")]
    TaskFailed { upid: String, exitstatus: String },

    /// A task was still running (or could not be read) when the caller's deadline passed.
    #[error("PVE task {upid} did not finish before the deadline{}", last_error.as_ref().map(|e| format!(" (last poll error: {e})")).unwrap_or_default())]
    TaskDeadline {
        upid: String,
        last_error: Option<String>,
    },

    /// A looked-up object (e.g. a pool) is absent from an otherwise successful answer.
    #[error("{0} does not exist")]
    NotFound(String),
}

fn fmt_params(p: &BTreeMap<String, String>) -> String {
    if p.is_empty() {
        return String::new();
    }
    let parts: Vec<String> = p.iter().map(|(k, v)| format!("{k}: {v}")).collect();
    format!(" ({})", parts.join("; "))
}

impl PveError {
    /// The API status code, if the server answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            PveError::Api { status, .. } => Some(*status),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_includes_param_errors() {
        let mut p = BTreeMap::new();
        p.insert("newid".to_string(), "invalid format".to_string());
        let e = PveError::Api {
            status: 400,
            message: "Parameter verification failed.".into(),
            param_errors: p,
        };
        assert_eq!(
            e.to_string(),
            "PVE API error 400: Parameter verification failed. (newid: invalid format)"
        );
    }
}
