//! The transport half of the client: [`PveClient`] and what it is built from
//! (`config`), TLS and connection-pool set-up (here), which failures are
//! retried (`retry`), one call with its retries (`request`) and turning
//! answers into values or errors (`decode`). The endpoint methods sit on top
//! of `PveClient::call`, one file per PVE resource, in the crate's `api`
//! module; nothing here knows an endpoint.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderValue, Uri};
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::error::PveError;

mod body;
mod coalesce;
mod config;
mod decode;
mod request;
mod retry;

pub use config::{ApiCall, ApiObserver, PveConfig, RequestGate, DEFAULT_POOL_IDLE, MAX_POOL_IDLE};
pub use retry::RetryPolicy;

type HttpClient = Client<HttpsConnector<HttpConnector>, Full<body::WipedBody>>;

struct Inner {
    http: HttpClient,
    /// Base URL without trailing slash.
    base: String,
    token_id: String,
    auth: HeaderValue,
    request_timeout: Duration,
    retry: RetryPolicy,
    observer: Option<Arc<dyn ApiObserver>>,
    gate: Option<Arc<dyn RequestGate>>,
    /// Shared reads in flight (see `coalesce`).
    in_flight: coalesce::InFlight,
}

/// Async PVE API client. Cheap to clone (shared connection pool).
#[derive(Clone)]
pub struct PveClient {
    inner: Arc<Inner>,
}

impl fmt::Debug for PveClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PveClient")
            .field("base", &self.inner.base)
            .field("token_id", &self.inner.token_id)
            .field("token_secret", &"<redacted>")
            .finish()
    }
}

impl PveClient {
    /// Validates the config and builds the client. Fails on a non-https URL, a
    /// malformed token, or missing/invalid TLS trust material.
    pub fn new(cfg: PveConfig) -> Result<PveClient, PveError> {
        let base = cfg.api_url.trim().trim_end_matches('/').to_string();
        let uri: Uri = base
            .parse()
            .map_err(|e| PveError::Config(format!("API URL {base:?} is not a valid URL: {e}")))?;
        if uri.scheme_str() != Some("https") {
            return Err(PveError::Config(format!(
                "API URL {base:?} must use https (TLS is always verified)"
            )));
        }
        if uri.host().is_none_or(|h| h.is_empty()) {
            return Err(PveError::Config(format!("API URL {base:?} has no host")));
        }
        if uri.query().is_some() {
            return Err(PveError::Config(format!(
                "API URL {base:?} must not carry a query string"
            )));
        }
        let token_id = cfg.token_id.trim().to_string();
        let (user, tokname) = token_id.split_once('!').unwrap_or(("", ""));
        if !user.contains('@') || tokname.is_empty() {
            return Err(PveError::Config(format!(
                "token id {token_id:?} must look like USER@REALM!TOKENID"
            )));
        }
        let secret = cfg.token_secret.trim();
        if secret.is_empty() {
            return Err(PveError::Config("token secret is empty".into()));
        }
        // The error deliberately does not echo the value: it contains the secret.
        let mut auth =
            HeaderValue::from_str(&format!("PVEAPIToken={token_id}={secret}")).map_err(|_| {
                PveError::Config(
                    "token id or secret contains characters not allowed in an HTTP header".into(),
                )
            })?;
        auth.set_sensitive(true);

        let tls = crate::tls::client_config(cfg.ca_pem.as_deref(), &cfg.fingerprints)?;
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(cfg.connect_timeout));
        http.set_nodelay(true);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_only()
            .enable_http1()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(cfg.pool_idle_timeout.min(MAX_POOL_IDLE))
            .build(connector);

        Ok(PveClient {
            inner: Arc::new(Inner {
                http: client,
                base,
                token_id,
                auth,
                request_timeout: cfg.request_timeout,
                retry: cfg.retry,
                observer: cfg.observer,
                gate: cfg.gate,
                in_flight: coalesce::InFlight::default(),
            }),
        })
    }

    /// The base URL calls are made against.
    pub fn base_url(&self) -> &str {
        &self.inner.base
    }

    /// The token id this client authenticates as (`USER@REALM!TOKENID`).
    pub fn token_id(&self) -> &str {
        &self.inner.token_id
    }
}
