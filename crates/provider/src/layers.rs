//! The gRPC interceptor chain: an outer layer that records metrics and logs
//! one line per RPC, and an inner layer that turns a panicking handler into
//! INTERNAL so the process survives.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use futures::future::BoxFuture;
use futures::FutureExt;
use tonic::body::Body;
use tonic::Code;
use tower::{Layer, Service};

use crate::metrics::Metrics;

type HttpRequest = http::Request<Body>;
type HttpResponse = http::Response<Body>;

/// Short method name (`Create`) from `/bigfleet.v1alpha1.CapacityProvider/Create`.
fn method_of(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// The gRPC code a unary response carries in its headers (trailers-only
/// errors); a response without one succeeded (status OK in trailers).
fn code_of(response: &HttpResponse) -> Code {
    response
        .headers()
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i32>().ok())
        .map(Code::from_i32)
        .unwrap_or(Code::Ok)
}

/// gRPC code names as dashboards expect them (`OK`, `NotFound`, ...).
pub fn metric_code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "Canceled",
        Code::Unknown => "Unknown",
        Code::InvalidArgument => "InvalidArgument",
        Code::DeadlineExceeded => "DeadlineExceeded",
        Code::NotFound => "NotFound",
        Code::AlreadyExists => "AlreadyExists",
        Code::PermissionDenied => "PermissionDenied",
        Code::ResourceExhausted => "ResourceExhausted",
        Code::FailedPrecondition => "FailedPrecondition",
        Code::Aborted => "Aborted",
        Code::OutOfRange => "OutOfRange",
        Code::Unimplemented => "Unimplemented",
        Code::Internal => "Internal",
        Code::Unavailable => "Unavailable",
        Code::DataLoss => "DataLoss",
        Code::Unauthenticated => "Unauthenticated",
    }
}

#[derive(Clone)]
pub struct ObserveLayer {
    pub metrics: Arc<Metrics>,
}

impl<S> Layer<S> for ObserveLayer {
    type Service = Observe<S>;
    fn layer(&self, inner: S) -> Observe<S> {
        Observe {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Observe<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S> Service<HttpRequest> for Observe<S>
where
    S: Service<HttpRequest, Response = HttpResponse> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = HttpResponse;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<HttpResponse, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: HttpRequest) -> Self::Future {
        // The clone that was polled ready serves this call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let metrics = self.metrics.clone();
        let path = request.uri().path().to_string();
        Box::pin(async move {
            let started = Instant::now();
            let result = inner.call(request).await;
            let elapsed = started.elapsed();
            let code = match &result {
                Ok(response) => code_of(response),
                Err(_) => Code::Unknown,
            };
            // Health and reflection calls are not part of the provider API.
            if path.starts_with("/bigfleet.") {
                let method = method_of(&path);
                let name = metric_code_name(code);
                metrics.observe_grpc(method, name, elapsed);
                // Formatted only if the line is actually written.
                let ms = elapsed.as_secs_f64() * 1000.0;
                let dur_ms = format_args!("{ms:.3}");
                if code != Code::Ok {
                    tracing::warn!(method = %method, code = name, dur_ms = %dur_ms, "rpc");
                } else if method == "Get" || method == "List" {
                    tracing::debug!(method = %method, code = name, dur_ms = %dur_ms, "rpc");
                } else {
                    tracing::info!(method = %method, code = name, dur_ms = %dur_ms, "rpc");
                }
            }
            result
        })
    }
}

#[derive(Clone)]
pub struct CatchPanicLayer {
    pub metrics: Arc<Metrics>,
}

impl<S> Layer<S> for CatchPanicLayer {
    type Service = CatchPanic<S>;
    fn layer(&self, inner: S) -> CatchPanic<S> {
        CatchPanic {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

#[derive(Clone)]
pub struct CatchPanic<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S> Service<HttpRequest> for CatchPanic<S>
where
    S: Service<HttpRequest, Response = HttpResponse> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = HttpResponse;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<HttpResponse, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: HttpRequest) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let metrics = self.metrics.clone();
        let path = request.uri().path().to_string();
        Box::pin(async move {
            let call = match std::panic::catch_unwind(AssertUnwindSafe(|| inner.call(request))) {
                Ok(future) => AssertUnwindSafe(future).catch_unwind().await,
                Err(panic) => Err(panic),
            };
            match call {
                Ok(result) => result,
                Err(panic) => {
                    metrics.panics.inc();
                    let detail = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "non-string panic payload".to_string());
                    tracing::error!(method = %method_of(&path), panic = %detail, "handler panicked; answered INTERNAL");
                    Ok(tonic::Status::internal("internal error: the handler panicked").into_http())
                }
            }
        })
    }
}
