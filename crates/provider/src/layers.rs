//! The gRPC interceptor chain: an outer layer that records metrics and logs
//! one line per RPC (with the request's machine id, read off the body as it
//! streams past, and a failed call's status message), and an inner layer
//! that turns a panicking handler into INTERNAL so the process survives.

use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{ready, Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;
use http_body::{Body as HttpBody, Frame, SizeHint};
use prost::encoding::decode_varint;
use tonic::body::Body;
use tonic::Code;
use tower::{Layer, Service};
use zeroize::Zeroizing;

use crate::guard::{RateLimit, REFUSAL_LOG_PERIOD};
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

/// RPCs whose request carries the machine id as field 1 (`machine_id` or
/// `MachineRef.id`).
fn carries_machine_id(method: &str) -> bool {
    matches!(
        method,
        "Create" | "Configure" | "Drain" | "Delete" | "Get" | "Reclaim"
    )
}

/// Request bytes looked at for the machine id: the gRPC frame header, the
/// key, the length and an id at the contract's 256-byte cap, with room for
/// a client that sends another field first.
const PEEK_BYTES: usize = 512;

/// Characters of a status message or machine id kept on a log line.
pub const LOG_VALUE_CHARS: usize = 256;

enum Peeked {
    Found(String),
    Absent,
    NeedMore,
}

/// Field 1 (a string) of the protobuf message in the gRPC frame that
/// `buf` starts with; NeedMore while `buf` may be too short to tell.
fn peek_field_one(buf: &[u8]) -> Peeked {
    let Some(header) = buf.get(..5) else {
        return Peeked::NeedMore;
    };
    if header[0] != 0 {
        // A compressed message: not worth inflating for a log field.
        return Peeked::Absent;
    }
    let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    let complete = buf.len() - 5 >= len;
    let msg = &buf[5..5 + len.min(buf.len() - 5)];
    let short = if complete {
        Peeked::Absent
    } else {
        Peeked::NeedMore
    };
    // The protobuf wire format, walked with prost's varint decoder (which
    // fails on a cut or overlong varint: either way, too short to tell).
    let mut rest = msg;
    while !rest.is_empty() {
        let Ok(key) = decode_varint(&mut rest) else {
            return short;
        };
        let skip = match key & 7 {
            0 => match decode_varint(&mut rest) {
                Ok(_) => 0,
                Err(_) => return short,
            },
            1 => 8,
            2 => match decode_varint(&mut rest) {
                Ok(n) => usize::try_from(n).unwrap_or(usize::MAX),
                Err(_) => return short,
            },
            5 => 4,
            _ => return Peeked::Absent,
        };
        if key == (1 << 3) | 2 {
            return match rest.get(..skip) {
                Some(id) => Peeked::Found(clip(&String::from_utf8_lossy(id))),
                None => short,
            };
        }
        let Some(after) = rest.get(skip..) else {
            return short;
        };
        rest = after;
    }
    short
}

/// At most [`LOG_VALUE_CHARS`] characters of `text`, an ellipsis when cut.
fn clip(text: &str) -> String {
    match text.char_indices().nth(LOG_VALUE_CHARS) {
        None => text.to_string(),
        Some((end, _)) => format!("{}...", &text[..end]),
    }
}

/// The request body, passed through unchanged, that records the machine id
/// from the first bytes it yields.
struct PeekBody {
    inner: Body,
    /// The first bytes, kept only when the first frame was too short. In a
    /// Configure they may hold the start of the bootstrap blob, so they are
    /// wiped when let go (and held in one buffer of [`PEEK_BYTES`], never
    /// grown, so no outgrown copy is left behind).
    head: Zeroizing<Vec<u8>>,
    done: bool,
    id: Arc<OnceLock<String>>,
}

impl PeekBody {
    fn look(&mut self, data: &[u8]) {
        let peeked = if self.head.is_empty() {
            peek_field_one(data)
        } else {
            let room = PEEK_BYTES.saturating_sub(self.head.len());
            self.head.extend_from_slice(&data[..data.len().min(room)]);
            peek_field_one(&self.head)
        };
        match peeked {
            Peeked::Found(id) => {
                let _ = self.id.set(id);
                self.done = true;
            }
            Peeked::Absent => self.done = true,
            Peeked::NeedMore if self.head.is_empty() => {
                let mut head = Vec::with_capacity(PEEK_BYTES);
                head.extend_from_slice(&data[..data.len().min(PEEK_BYTES)]);
                self.head = Zeroizing::new(head);
                self.done = self.head.len() >= PEEK_BYTES;
            }
            Peeked::NeedMore => self.done = self.head.len() >= PEEK_BYTES,
        }
        if self.done {
            self.head = Zeroizing::default();
        }
    }
}

impl HttpBody for PeekBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let this = &mut *self;
        let frame = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        if let Some(Ok(frame)) = &frame {
            if let (false, Some(data)) = (this.done, frame.data_ref()) {
                this.look(data);
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The status message of a failed unary response (trailers-only, so in the
/// headers), percent-decoded and clipped.
fn message_of(response: &HttpResponse) -> Option<String> {
    let raw = response.headers().get("grpc-message")?.as_bytes();
    Some(clip(
        &percent_encoding::percent_decode(raw).decode_utf8_lossy(),
    ))
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

/// The provider's RPCs by name, so a key made of one stays in a fixed set
/// whatever path a caller sends (any other is `other`).
const METHODS: [&str; 9] = [
    "Create",
    "Configure",
    "Drain",
    "Delete",
    "Get",
    "List",
    "Reclaim",
    "NodeMemory",
    "Timeline",
];

fn known_method(method: &str) -> &'static str {
    METHODS
        .iter()
        .find(|m| **m == method)
        .copied()
        .unwrap_or("other")
}

/// Whether a failed call's code says the caller's request was refused
/// (bad arguments, wrong state, no room, no such machine, a stale fence,
/// not allowed) rather than the server failing: every code but those the
/// `BigFleetProxmoxGrpcInternalErrors` alert counts. A caller can make as
/// many of these as it sends calls, so their lines are rate-limited.
fn is_refusal(code: Code) -> bool {
    !matches!(
        code,
        Code::Ok
            | Code::Unknown
            | Code::Internal
            | Code::Unavailable
            | Code::DeadlineExceeded
            | Code::DataLoss
    )
}

/// One line per RPC, with its metrics. Server errors are a WARN each;
/// refusals (the client-error codes) a WARN at most once per method and code
/// every [`REFUSAL_LOG_PERIOD`], the rest at DEBUG, so a client retrying a
/// refused call in a loop cannot flood the log. PERMISSION_DENIED is at
/// DEBUG only: the identity guard, its only source, already writes a
/// rate-limited `caller identity refused` WARN for it.
#[derive(Clone)]
pub struct ObserveLayer {
    metrics: Arc<Metrics>,
    refusals: Arc<RateLimit<(&'static str, Code)>>,
}

impl ObserveLayer {
    pub fn new(metrics: Arc<Metrics>) -> ObserveLayer {
        ObserveLayer {
            metrics,
            refusals: Arc::new(RateLimit::new(REFUSAL_LOG_PERIOD)),
        }
    }
}

impl<S> Layer<S> for ObserveLayer {
    type Service = Observe<S>;
    fn layer(&self, inner: S) -> Observe<S> {
        Observe {
            inner,
            metrics: self.metrics.clone(),
            refusals: Arc::clone(&self.refusals),
        }
    }
}

#[derive(Clone)]
pub struct Observe<S> {
    inner: S,
    metrics: Arc<Metrics>,
    refusals: Arc<RateLimit<(&'static str, Code)>>,
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
        let refusals = Arc::clone(&self.refusals);
        let path = request.uri().path().to_string();
        // Health and reflection calls are not part of the provider API.
        let ours = path.starts_with("/bigfleet.");
        let id = (ours && carries_machine_id(method_of(&path))).then(|| Arc::new(OnceLock::new()));
        let request = match &id {
            Some(id) => request.map(|inner| {
                Body::new(PeekBody {
                    inner,
                    head: Zeroizing::default(),
                    done: false,
                    id: Arc::clone(id),
                })
            }),
            None => request,
        };
        Box::pin(async move {
            let started = Instant::now();
            let result = inner.call(request).await;
            let elapsed = started.elapsed();
            let code = match &result {
                Ok(response) => code_of(response),
                Err(_) => Code::Unknown,
            };
            if ours {
                let method = method_of(&path);
                let name = metric_code_name(code);
                metrics.observe_grpc(method, name, elapsed);
                // Formatted only if the line is actually written.
                let ms = elapsed.as_secs_f64() * 1000.0;
                let dur_ms = format_args!("{ms:.3}");
                let machine_id = id.as_ref().and_then(|id| id.get()).map(String::as_str);
                // `error`, as on every other failure line: `message` is
                // the line's own message in tracing (and in JSON).
                let error = || result.as_ref().ok().and_then(message_of);
                let limited = is_refusal(code) && code != Code::PermissionDenied;
                let written = limited.then(|| {
                    refusals.admit_key((known_method(method), code), tokio::time::Instant::now())
                });
                if code == Code::PermissionDenied || written == Some(None) {
                    let error = error();
                    tracing::debug!(method = %method, machine_id, code = name, dur_ms = %dur_ms, error, "rpc");
                } else if let Some(Some(suppressed)) = written {
                    let error = error();
                    tracing::warn!(method = %method, machine_id, code = name, dur_ms = %dur_ms, error, suppressed, "rpc");
                } else if code != Code::Ok {
                    let error = error();
                    tracing::warn!(method = %method, machine_id, code = name, dur_ms = %dur_ms, error, "rpc");
                } else if method == "Get" || method == "List" {
                    tracing::debug!(method = %method, machine_id, code = name, dur_ms = %dur_ms, "rpc");
                } else {
                    tracing::info!(method = %method, machine_id, code = name, dur_ms = %dur_ms, "rpc");
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

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(message: &[u8]) -> Vec<u8> {
        let mut out = vec![0];
        out.extend_from_slice(&(message.len() as u32).to_be_bytes());
        out.extend_from_slice(message);
        out
    }

    fn string_field(tag: u8, value: &str) -> Vec<u8> {
        let mut out = vec![tag << 3 | 2, value.len() as u8];
        out.extend_from_slice(value.as_bytes());
        out
    }

    fn found(p: Peeked) -> Option<String> {
        match p {
            Peeked::Found(id) => Some(id),
            _ => None,
        }
    }

    #[test]
    fn the_machine_id_is_read_off_the_first_frame() {
        let mut msg = string_field(1, "pve/OnDemand/pve.small/pve1/003");
        msg.extend(string_field(3, "shard-a"));
        let buf = frame(&msg);
        assert_eq!(
            found(peek_field_one(&buf)).as_deref(),
            Some("pve/OnDemand/pve.small/pve1/003")
        );
        // Field 1 after another field (a client's own order) is found too.
        let mut msg = string_field(3, "shard-a");
        msg.push(4 << 3); // a varint field
        msg.push(0x96);
        msg.push(0x01);
        msg.extend(string_field(1, "m-1"));
        assert_eq!(found(peek_field_one(&frame(&msg))).as_deref(), Some("m-1"));
        // Cut anywhere before the id ends: more is needed.
        let buf = frame(&string_field(1, "m-1"));
        for cut in 0..buf.len() {
            assert!(
                matches!(peek_field_one(&buf[..cut]), Peeked::NeedMore),
                "{cut}"
            );
        }
        // A complete message without field 1, or a compressed one: absent.
        assert!(matches!(
            peek_field_one(&frame(&string_field(2, "x"))),
            Peeked::Absent
        ));
        let mut compressed = frame(&string_field(1, "m-1"));
        compressed[0] = 1;
        assert!(matches!(peek_field_one(&compressed), Peeked::Absent));
    }

    #[test]
    fn split_frames_are_joined_and_the_peek_is_bounded() {
        let buf = frame(&string_field(1, "m-42"));
        let mut body = PeekBody {
            inner: Body::empty(),
            head: Zeroizing::default(),
            done: false,
            id: Arc::new(OnceLock::new()),
        };
        for chunk in buf.chunks(2) {
            body.look(chunk);
        }
        assert_eq!(body.id.get().map(String::as_str), Some("m-42"));
        assert!(body.done && body.head.is_empty());
        // A frame that never says: the peek stops at PEEK_BYTES.
        let mut long = vec![0, 0, 0, 4, 0];
        long.extend(std::iter::repeat_n(0x80, 2 * PEEK_BYTES));
        let mut body = PeekBody {
            inner: Body::empty(),
            head: Zeroizing::default(),
            done: false,
            id: Arc::new(OnceLock::new()),
        };
        for chunk in long.chunks(100) {
            if !body.done {
                body.look(chunk);
            }
        }
        assert!(body.done && body.id.get().is_none());
    }

    /// The bytes kept to read the machine id off (in a Configure, maybe the
    /// start of the blob) are one buffer, never grown, wiped when let go.
    #[test]
    fn the_peeked_bytes_are_one_buffer_wiped_when_let_go() {
        fn wiped_on_drop<T: zeroize::ZeroizeOnDrop>(_: &T) {}
        let buf = frame(&string_field(1, "m-42"));
        let mut body = PeekBody {
            inner: Body::empty(),
            head: Zeroizing::default(),
            done: false,
            id: Arc::new(OnceLock::new()),
        };
        body.look(&buf[..3]);
        wiped_on_drop(&body.head);
        assert_eq!(body.head.capacity(), PEEK_BYTES);
        let held = body.head.as_ptr();
        body.look(&buf[3..5]);
        assert_eq!(body.head.as_ptr(), held, "grown in place, never moved");
        body.look(&buf[5..]);
        assert!(body.done && body.head.is_empty() && body.head.capacity() == 0);
    }

    /// A refusal's per-RPC line is a WARN once per method and code in each
    /// period; PERMISSION_DENIED never (the guard's line reports it); a
    /// server error always.
    #[test]
    fn refusals_are_told_from_server_errors() {
        for code in [
            Code::InvalidArgument,
            Code::NotFound,
            Code::PermissionDenied,
            Code::Unauthenticated,
            Code::FailedPrecondition,
            Code::ResourceExhausted,
            Code::Aborted,
        ] {
            assert!(is_refusal(code), "{code:?}");
        }
        for code in [Code::Ok, Code::Internal, Code::Unknown, Code::Unavailable] {
            assert!(!is_refusal(code), "{code:?}");
        }
        assert_eq!(known_method("Create"), "Create");
        assert_eq!(known_method("AnythingAcallerSends"), "other");
    }

    #[test]
    fn status_messages_are_decoded_and_clipped() {
        let status = tonic::Status::aborted("machine \"m-1\" is CREATING; 100% sure");
        let response = status.into_http::<Body>();
        assert_eq!(
            message_of(&response).as_deref(),
            Some("machine \"m-1\" is CREATING; 100% sure")
        );
        let long = "x".repeat(5 * LOG_VALUE_CHARS);
        let response = tonic::Status::internal(long).into_http::<Body>();
        let clipped = message_of(&response).unwrap_or_default();
        assert_eq!(clipped.len(), LOG_VALUE_CHARS + 3);
        assert!(clipped.ends_with("..."));
    }
}
