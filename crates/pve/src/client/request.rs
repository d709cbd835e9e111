//! One API call: the retry loop around it (with its log lines and the
//! observer report), and a single attempt (build the request, send it under
//! the per-request timeout, read the body, decode). Failures keep their
//! cause: the HTTP client's error, or the rustls error of a refused handshake.

use std::error::Error;
use std::time::Instant;

use bytes::Bytes;
use http::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE};
use http::{Method, Request};
use http_body_util::{BodyExt, Full, Limited};
use serde::de::DeserializeOwned;

use super::body::WipedBody;
use super::coalesce::{self, Role};
use super::config::ApiCall;
use super::decode::{api_error, decode_data};
use super::retry::retryable;
use super::PveClient;
use crate::error::{Cause, PveError};
use crate::form::Params;
use crate::upid::Upid;

/// Responses larger than this are refused (exec output is at most 16 MiB per stream).
const MAX_RESPONSE_BYTES: usize = 64 * 1024 * 1024;

impl PveClient {
    /// Runs one API call with the retry policy and decodes its `data`.
    /// A read of [`coalesce::SHARED_OPS`] asked while the same read is in
    /// flight waits for that one's answer instead of sending its own.
    pub(crate) async fn call<T: DeserializeOwned>(
        &self,
        op: &'static str,
        method: Method,
        path: &str,
        params: &Params,
    ) -> Result<T, PveError> {
        if method == Method::GET && coalesce::SHARED_OPS.contains(&op) {
            let key = format!("{path}?{}", params.encode());
            match self.inner.in_flight.join(key) {
                Role::Follower(flight) => {
                    if let Some(body) = coalesce::wait(flight).await {
                        return decode_data(op, &body);
                    }
                    // The request it waited for failed: its own, below.
                }
                Role::Leader(lead) => {
                    let result = self.call_raw(op, method, path, params).await;
                    lead.finish(result.as_ref().ok().cloned());
                    return result.and_then(|body| decode_data(op, &body));
                }
            }
        }
        let body = self.call_raw(op, method, path, params).await?;
        decode_data(op, &body)
    }

    /// Runs one API call with the retry policy and reports it to the
    /// observer: the body of its success.
    async fn call_raw(
        &self,
        op: &'static str,
        method: Method,
        path: &str,
        params: &Params,
    ) -> Result<Bytes, PveError> {
        let start = Instant::now();
        let mut attempts = 0u32;
        let result = loop {
            attempts += 1;
            match self.attempt(op, &method, path, params).await {
                Ok(v) => break Ok(v),
                Err(e) if attempts < self.inner.retry.max_attempts && retryable(&method, &e) => {
                    let wait = self.inner.retry.backoff(attempts);
                    // INFO: a call that keeps failing (an endpoint that
                    // accepts connections but never answers) must say what
                    // it waits for, where, and when it tries again.
                    tracing::info!(
                        op,
                        %method,
                        path,
                        url = %self.base_url(),
                        attempt = attempts,
                        max_attempts = self.inner.retry.max_attempts,
                        next_try_in_ms = wait.as_millis() as u64,
                        error = %e,
                        "retrying PVE call"
                    );
                    tokio::time::sleep(wait).await;
                }
                Err(e) => break Err(e),
            }
        };
        let duration = start.elapsed();
        match &result {
            Ok(_) => {
                tracing::debug!(op, %method, path, attempts, dur_ms = duration.as_millis() as u64, "PVE call ok")
            }
            Err(e) => {
                tracing::debug!(op, %method, path, attempts, dur_ms = duration.as_millis() as u64, error = %e, "PVE call failed")
            }
        }
        if let Some(obs) = &self.inner.observer {
            obs.observe(&ApiCall {
                op,
                method: &method,
                result: result.as_ref().map(|_| ()),
                duration,
                attempts,
            });
        }
        result
    }

    /// [`PveClient::call`] for an endpoint that answers with a worker task's UPID.
    pub(crate) async fn call_upid(
        &self,
        op: &'static str,
        method: Method,
        path: &str,
        params: &Params,
    ) -> Result<Upid, PveError> {
        let raw: String = self.call(op, method, path, params).await?;
        Upid::parse(raw.trim()).map_err(|e| PveError::Decode {
            op,
            message: e.to_string(),
            source: Some(Cause::new(e)),
        })
    }

    /// One attempt: the body of a success, or the API's error.
    async fn attempt(
        &self,
        op: &'static str,
        method: &Method,
        path: &str,
        params: &Params,
    ) -> Result<Bytes, PveError> {
        if let Some(gate) = &self.inner.gate {
            gate.admit().map_err(|e| PveError::NotAdmitted {
                op,
                source: Cause::from(e),
            })?;
        }
        let has_body = *method == Method::POST || *method == Method::PUT;
        let mut url = format!("{}{}", self.inner.base, path);
        if !has_body && !params.is_empty() {
            url.push('?');
            url.push_str(&params.encode());
        }
        let mut req = Request::builder()
            .method(method.clone())
            .uri(&url)
            .header(AUTHORIZATION, self.inner.auth.clone())
            .header(ACCEPT, "application/json");
        // Built again for each attempt, and wiped when hyper drops it.
        let body = if has_body {
            req = req.header(CONTENT_TYPE, "application/x-www-form-urlencoded");
            WipedBody::new(params.encode().into_bytes())
        } else {
            WipedBody::default()
        };
        let req = req.body(Full::new(body)).map_err(|e| {
            PveError::InvalidArgument(format!("cannot build request for {op} ({path}): {e}"))
        })?;

        let timeout = self.inner.request_timeout;
        let exchange = async {
            let resp = self
                .inner
                .http
                .request(req)
                .await
                .map_err(|e| transport_error(op, e))?;
            let (parts, body) = resp.into_parts();
            let bytes = Limited::new(body, MAX_RESPONSE_BYTES)
                .collect()
                .await
                .map_err(|e| PveError::Transport {
                    op,
                    message: format!("reading response body: {e}"),
                    connect: false,
                    source: Cause::from(e),
                })?
                .to_bytes();
            Ok::<_, PveError>((parts, bytes))
        };
        let (parts, bytes) = tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| PveError::Timeout { op, timeout })??;

        if parts.status.is_success() {
            Ok(bytes)
        } else {
            Err(api_error(parts.status, &parts.extensions, &bytes))
        }
    }
}

/// A failed exchange: [`PveError::Tls`] when rustls refused the handshake
/// (its error is the cause), else [`PveError::Transport`] with the HTTP
/// client's error as the cause.
fn transport_error(op: &'static str, e: hyper_util::client::legacy::Error) -> PveError {
    if let Some(tls) = find_rustls_error(&e) {
        return PveError::Tls {
            op,
            message: tls.to_string(),
            source: Cause::new(tls.clone()),
        };
    }
    PveError::Transport {
        op,
        message: chain_message(&e),
        connect: e.is_connect(),
        source: Cause::new(e),
    }
}

/// Walks an error's source chain for a rustls error. `io::Error::source()` skips
/// the wrapped error itself, so wrapped payloads are followed via `get_ref()`.
fn find_rustls_error<'a>(e: &'a (dyn Error + 'static)) -> Option<&'a rustls::Error> {
    let mut cur: Option<&(dyn Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(r) = err.downcast_ref::<rustls::Error>() {
            return Some(r);
        }
        cur = match err.downcast_ref::<std::io::Error>() {
            Some(io) => io.get_ref().map(|inner| inner as &(dyn Error + 'static)),
            None => err.source(),
        };
    }
    None
}

/// Renders an error and its sources on one line.
fn chain_message(e: &(dyn Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cur = s.source();
    }
    out
}
