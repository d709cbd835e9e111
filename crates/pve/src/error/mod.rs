//! Error type for every client operation: [`PveError`], its `Display`
//! (what callers log and quote) and the [`Cause`] each transport, TLS or
//! decode failure keeps as its `source()`. What kind of failure an error is
//! (lock timeout, VMID collision, unreachable node, agent not ready, ...)
//! is the `classify` submodule's job: the classifiers read PVE's texts.

use std::collections::BTreeMap;
use std::error::Error;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

mod classify;

pub(crate) use classify::is_lock_timeout_text;
pub use classify::AccessFailure;

/// The underlying failure a [`PveError`] was built from: the HTTP client's
/// error, the rustls error of a refused handshake, the JSON parser's
/// complaint. Shared, so `PveError` stays cheap to clone (callers keep
/// copies of it, e.g. as the cause of their own errors).
///
/// Deliberately not an `Error` itself but a `Deref` to the cause: a plain
/// `Arc<dyn Error>` field would make `source()` return the `Arc` (which
/// implements `Error` by delegation), and `downcast_ref` to the real type
/// would fail. Through this wrapper `PveError::source()` is the cause
/// itself, so `e.source().and_then(|s| s.downcast_ref::<rustls::Error>())`
/// finds it.
#[derive(Clone)]
pub struct Cause(Arc<dyn Error + Send + Sync + 'static>);

impl Cause {
    /// Keeps `e` as the cause.
    pub fn new(e: impl Error + Send + Sync + 'static) -> Cause {
        Cause(Arc::new(e))
    }
}

/// The boxed errors body readers hand out.
impl From<Box<dyn Error + Send + Sync + 'static>> for Cause {
    fn from(e: Box<dyn Error + Send + Sync + 'static>) -> Cause {
        Cause(Arc::from(e))
    }
}

impl Deref for Cause {
    type Target = dyn Error + Send + Sync + 'static;

    fn deref(&self) -> &Self::Target {
        &*self.0
    }
}

impl fmt::Debug for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

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
    Tls {
        op: &'static str,
        /// The rustls error's text.
        message: String,
        /// The `rustls::Error` the handshake failed with.
        #[source]
        source: Cause,
    },

    /// The request could not be completed at the transport level. `connect` is true
    /// when no connection was established, so the request cannot have been applied.
    #[error("transport error calling PVE {op}: {message}")]
    Transport {
        op: &'static str,
        /// The failure and its causes on one line.
        message: String,
        connect: bool,
        /// The HTTP client's error (`hyper_util`'s for the exchange, the
        /// body reader's while reading the answer).
        #[source]
        source: Cause,
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
    Decode {
        op: &'static str,
        message: String,
        /// What the parser said (`serde_json::Error`, or the UPID parser's
        /// [`PveError`]); `None` when the body lacks the `data` envelope.
        #[source]
        source: Option<Cause>,
    },

    /// A worker task ended with an exit status other than `OK` / `WARNINGS: N`.
    #[error("PVE task {upid} failed: {exitstatus}")]
    TaskFailed { upid: String, exitstatus: String },

    /// A task was still running (or could not be read) when the caller's deadline passed.
    #[error("PVE task {upid} did not finish before the deadline{}", last_error.as_ref().map(|e| format!(" (last poll error: {e})")).unwrap_or_default())]
    TaskDeadline {
        upid: String,
        /// The [`PveError`] of the last status poll, when that poll failed.
        #[source]
        last_error: Option<Cause>,
    },

    /// The client's [`crate::RequestGate`] refused the request: it was not
    /// sent, so it cannot have been applied. Never retried.
    #[error("PVE {op} not sent: {source}")]
    NotAdmitted {
        op: &'static str,
        /// What the gate said.
        #[source]
        source: Cause,
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
    /// The first `PveError` in an error's source chain, starting with `err`
    /// itself: for a caller holding its own error type that kept a
    /// `PveError` as its cause. Also looks inside a shared
    /// `Arc<dyn Error + Send + Sync>` level, whose `Error` impl hides the
    /// type it holds from `downcast_ref`.
    pub fn find_in<'a>(err: &'a (dyn Error + 'static)) -> Option<&'a PveError> {
        let mut cur = Some(err);
        while let Some(e) = cur {
            if let Some(pve) = e.downcast_ref::<PveError>() {
                return Some(pve);
            }
            if let Some(pve) = e
                .downcast_ref::<Arc<dyn Error + Send + Sync + 'static>>()
                .and_then(|shared| shared.downcast_ref::<PveError>())
            {
                return Some(pve);
            }
            cur = e.source();
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cause(text: &str) -> Cause {
        Cause::new(std::io::Error::other(text.to_string()))
    }

    fn api(status: u16, msg: &str) -> PveError {
        PveError::Api {
            status,
            message: msg.into(),
            param_errors: BTreeMap::new(),
        }
    }

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

    #[test]
    fn causes_are_the_source_and_keep_their_type() {
        let transport = PveError::Transport {
            op: "nodes",
            message: "reset".into(),
            connect: false,
            source: cause("connection reset"),
        };
        let source = transport.source().expect("a transport error has a cause");
        assert!(source.downcast_ref::<std::io::Error>().is_some());
        assert_eq!(source.to_string(), "connection reset");

        let tls = PveError::Tls {
            op: "nodes",
            message: "invalid peer certificate: UnknownIssuer".into(),
            source: Cause::new(rustls::Error::InvalidCertificate(
                rustls::CertificateError::UnknownIssuer,
            )),
        };
        assert!(tls
            .source()
            .and_then(|s| s.downcast_ref::<rustls::Error>())
            .is_some());
        // Clones share the cause.
        assert!(tls.clone().source().is_some());

        // The Display is the one callers and `last_error` strings know.
        assert_eq!(
            tls.to_string(),
            "TLS verification of the PVE API failed for nodes: invalid peer certificate: UnknownIssuer"
        );
        assert_eq!(
            transport.to_string(),
            "transport error calling PVE nodes: reset"
        );
    }

    #[test]
    fn task_deadline_keeps_the_last_poll_error() {
        let poll = api(595, "No route to host");
        let e = PveError::TaskDeadline {
            upid: "UPID:pve1:x".into(),
            last_error: Some(Cause::new(poll)),
        };
        assert_eq!(
            e.to_string(),
            "PVE task UPID:pve1:x did not finish before the deadline \
             (last poll error: PVE API error 595: No route to host)"
        );
        let last = e.source().and_then(|s| s.downcast_ref::<PveError>());
        assert!(last.is_some_and(PveError::is_node_unreachable), "{e:?}");
        let quiet = PveError::TaskDeadline {
            upid: "UPID:pve1:x".into(),
            last_error: None,
        };
        assert_eq!(
            quiet.to_string(),
            "PVE task UPID:pve1:x did not finish before the deadline"
        );
        assert!(quiet.source().is_none());
    }

    #[test]
    fn find_in_looks_through_wrappers() {
        #[derive(Debug, thiserror::Error)]
        #[error("creating the VM: {0}")]
        struct Direct(#[source] PveError);
        #[derive(Debug, thiserror::Error)]
        #[error("creating the VM")]
        struct Shared(#[source] Arc<dyn Error + Send + Sync + 'static>);

        let gone = api(500, "VM 104 does not exist");
        let direct = Direct(gone.clone());
        assert!(PveError::find_in(&direct).is_some_and(PveError::is_not_found));
        let shared = Shared(Arc::new(gone.clone()));
        assert!(PveError::find_in(&shared).is_some_and(PveError::is_not_found));
        assert!(PveError::find_in(&gone).is_some());
        let io = std::io::Error::other("unrelated");
        assert!(PveError::find_in(&io).is_none());
    }
}
