//! What a [`PveClient`](super::PveClient) is built from: [`PveConfig`] (URL,
//! token, trust material, timeouts, retries) and the [`ApiObserver`] hook
//! that learns about every call.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::Method;

use super::retry::RetryPolicy;
use crate::error::PveError;

/// Default idle lifetime of a pooled connection (see [`PveConfig::pool_idle_timeout`]).
pub const DEFAULT_POOL_IDLE: Duration = Duration::from_secs(3);
/// Upper bound on the idle lifetime: pveproxy closes idle connections after ~5 s.
pub const MAX_POOL_IDLE: Duration = Duration::from_millis(4500);

/// What the observer learns about each API call (after all retries).
#[derive(Debug)]
pub struct ApiCall<'a> {
    /// Stable operation name, e.g. `clone`, `task_status`, `agent_exec`.
    pub op: &'static str,
    pub method: &'a Method,
    pub result: Result<(), &'a PveError>,
    /// Wall time including retries and backoff.
    pub duration: Duration,
    /// HTTP attempts made (1 = no retry).
    pub attempts: u32,
}

/// Hook called after every API call; the provider's metrics plug in here.
pub trait ApiObserver: Send + Sync {
    fn observe(&self, call: &ApiCall<'_>);
}

impl<F> ApiObserver for F
where
    F: Fn(&ApiCall<'_>) + Send + Sync,
{
    fn observe(&self, call: &ApiCall<'_>) {
        self(call)
    }
}

/// Asked before every HTTP attempt: an `Err` means the request is not sent
/// and the call fails with [`PveError::NotAdmitted`] carrying it. A caller
/// that may lose the right to act on the cluster (a replica deposed as
/// leader) plugs in here, so no request leaves after that moment, whatever
/// task would send it.
pub trait RequestGate: Send + Sync {
    fn admit(&self) -> Result<(), Box<dyn std::error::Error + Send + Sync + 'static>>;
}

/// Client configuration. `Debug` never shows the token secret.
#[derive(Clone)]
pub struct PveConfig {
    /// e.g. `https://pve1:8006/api2/json`. Must be `https`.
    pub api_url: String,
    /// `USER@REALM!TOKENID`.
    pub token_id: String,
    pub token_secret: String,
    /// PEM CA bundle the API certificate must chain to (hostname checked).
    pub ca_pem: Option<Vec<u8>>,
    /// Accepted SHA-256 leaf fingerprints (see [`crate::parse_fingerprints`]).
    pub fingerprints: Vec<[u8; 32]>,
    /// Bound on each HTTP attempt (send + full response).
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    /// How long an idle pooled connection is kept. pveproxy closes idle
    /// keep-alive connections after about 5 s; reusing one it is closing makes
    /// a POST ambiguous, so this stays well under that.
    pub pool_idle_timeout: Duration,
    pub retry: RetryPolicy,
    pub observer: Option<Arc<dyn ApiObserver>>,
    /// Consulted before every HTTP attempt (see [`RequestGate`]).
    pub gate: Option<Arc<dyn RequestGate>>,
}

impl PveConfig {
    /// A config with default timeouts/retries and no trust material yet
    /// (set `ca_pem` and/or `fingerprints` before building the client).
    pub fn new(
        api_url: impl Into<String>,
        token_id: impl Into<String>,
        token_secret: impl Into<String>,
    ) -> Self {
        Self {
            api_url: api_url.into(),
            token_id: token_id.into(),
            token_secret: token_secret.into(),
            ca_pem: None,
            fingerprints: Vec::new(),
            request_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            pool_idle_timeout: DEFAULT_POOL_IDLE,
            retry: RetryPolicy::default(),
            observer: None,
            gate: None,
        }
    }
}

impl fmt::Debug for PveConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PveConfig")
            .field("api_url", &self.api_url)
            .field("token_id", &self.token_id)
            .field("token_secret", &"<redacted>")
            .field(
                "ca_pem",
                &self.ca_pem.as_ref().map(|c| format!("{} bytes", c.len())),
            )
            .field(
                "fingerprints",
                &self
                    .fingerprints
                    .iter()
                    .map(crate::tls::format_fingerprint)
                    .collect::<Vec<_>>(),
            )
            .field("request_timeout", &self.request_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("pool_idle_timeout", &self.pool_idle_timeout)
            .field("retry", &self.retry)
            .field("observer", &self.observer.is_some())
            .field("gate", &self.gate.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_debug_redacts_secret() {
        let cfg = PveConfig::new("https://h:8006/api2/json", "a@pve!t", "s3cr3t-value");
        let d = format!("{cfg:?}");
        assert!(
            !d.contains("s3cr3t-value") && d.contains("<redacted>"),
            "{d}"
        );
    }
}
