//! What a request may make the server hold before anything knows who sent
//! it: decided from the path, the peer certificate and the gRPC length
//! prefix, before the body is read.
//!
//! * **Identity first.** Under mTLS with identities, a caller that may not
//!   make this kind of call at all (no usable identity; read-only tooling
//!   calling a mutation; anyone but an admin calling the Admin service) is
//!   refused before a byte of its body is read. Only a mutation's
//!   `shard_id` needs the body, and the guard checks it after decoding.
//! * **A cap per RPC.** The 5-byte gRPC prefix declares the message's
//!   length; a declaration (or a body) over what that RPC can need under
//!   the input caps is refused at once with INVALID_ARGUMENT naming the
//!   cap, as the contract wants of any oversized request. Everything but
//!   Configure needs at most a few KiB.
//! * **A budget for large bodies.** A Configure body (up to the blob cap
//!   plus metadata) is read only while it holds its declared length of a
//!   process-wide byte budget; past it, it waits, unread, and HTTP/2 flow
//!   control stops its sender. Small bodies are bounded by their cap, the
//!   stream limit and the connection caps, so Gets and Lists never wait
//!   behind large bodies.
//! * **A deadline.** A body not fully received within [`BODY_DEADLINE`] of
//!   its request is refused (DEADLINE_EXCEEDED), so a half-sent body cannot
//!   hold its share of the budget for long.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use providerkit::Limits;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::body::Body;
use tonic::Status;
use tower::{Layer, Service};

use crate::guard::{IdentityGuard, GUARDED};

type HttpRequest = http::Request<Body>;
type HttpResponse = http::Response<Body>;
type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// How long a request's body may take to arrive whole.
pub const BODY_DEADLINE: Duration = Duration::from_secs(15);

/// Bytes of large request bodies (Configure) held at once, process-wide:
/// about 40 Configures with a full blob and full metadata.
pub const LARGE_BODY_BUDGET: usize = 64 * 1024 * 1024;

/// What any RPC but Configure may declare: its strings are capped at a few
/// hundred bytes (the ids) and it carries no map or blob. Health and
/// reflection requests are smaller still.
pub const SMALL_REQUEST_CAP: usize = 16 * 1024;

/// The gRPC length-prefixed message header: a flag byte and a 4-byte
/// big-endian length.
const PREFIX: usize = 5;

/// Each RPC's cap, and which RPCs count against the budget.
#[derive(Clone)]
pub struct Intake {
    guard: Arc<IdentityGuard>,
    configure_cap: usize,
    limits: Limits,
    budget: Arc<Semaphore>,
}

impl Intake {
    pub fn new(guard: Arc<IdentityGuard>, limits: &Limits) -> Intake {
        Intake {
            guard,
            configure_cap: configure_cap(limits),
            limits: limits.clone(),
            budget: Arc::new(Semaphore::new(LARGE_BODY_BUDGET)),
        }
    }

    /// The cap of a call to `path`, and the words that explain it.
    fn cap(&self, rpc: &str) -> (usize, String) {
        let l = &self.limits;
        match rpc {
            "Configure" => (
                self.configure_cap,
                format!(
                    "bootstrap_blob: the cap is {} bytes; shard_metadata: {} bytes in all",
                    l.max_bootstrap_blob_bytes, l.max_metadata_bytes
                ),
            ),
            "Create" | "Drain" | "Delete" => (
                SMALL_REQUEST_CAP,
                format!(
                    "machine_id: the cap is {} bytes; shard_id: {} bytes",
                    l.max_machine_id_bytes, l.max_shard_id_bytes
                ),
            ),
            "Get" => (
                SMALL_REQUEST_CAP,
                format!("machine_id: the cap is {} bytes", l.max_machine_id_bytes),
            ),
            _ => (
                SMALL_REQUEST_CAP,
                format!("no {rpc} request needs more than {SMALL_REQUEST_CAP} bytes"),
            ),
        }
    }
}

/// Largest Configure the input caps allow, with its protobuf framing: each
/// field and map entry costs a tag and a length of a few bytes.
fn configure_cap(l: &Limits) -> usize {
    const FRAMING_PER_FIELD: usize = 16;
    l.max_bootstrap_blob_bytes
        + l.max_metadata_bytes
        + l.max_metadata_entries * FRAMING_PER_FIELD
        + l.max_machine_id_bytes
        + l.max_shard_id_bytes
        + l.max_cluster_id_bytes
        + 1024
}

impl<S> Layer<S> for Intake {
    type Service = Admitting<S>;
    fn layer(&self, inner: S) -> Admitting<S> {
        Admitting {
            inner,
            intake: self.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Admitting<S> {
    inner: S,
    intake: Intake,
}

impl<S> Service<HttpRequest> for Admitting<S>
where
    S: Service<HttpRequest, Response = HttpResponse> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = HttpResponse;
    type Error = S::Error;
    type Future = futures::future::BoxFuture<'static, Result<HttpResponse, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: HttpRequest) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let rpc = request
            .uri()
            .path()
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_string();
        if let Some(refused) = self.refuse_before_body(&request, &rpc) {
            return Box::pin(async move { Ok(refused.into_http()) });
        }
        let (cap, why) = self.intake.cap(&rpc);
        let budget = (cap > SMALL_REQUEST_CAP).then(|| Arc::clone(&self.intake.budget));
        let (parts, body) = request.into_parts();
        let body = Body::new(Metered {
            inner: body,
            rpc,
            cap,
            why,
            seen: 0,
            prefix: Vec::with_capacity(PREFIX),
            budget,
            held: None,
            waiting: None,
            parked: None,
            deadline: Box::pin(tokio::time::sleep(BODY_DEADLINE)),
            done: false,
        });
        let request = http::Request::from_parts(parts, body);
        Box::pin(async move { inner.call(request).await })
    }
}

impl<S> Admitting<S> {
    /// The identity check that needs no body: PERMISSION_DENIED for a
    /// caller this RPC admits whatever the body says.
    fn refuse_before_body(&self, request: &HttpRequest, rpc: &str) -> Option<Status> {
        let &(name, need) = GUARDED.iter().find(|(name, _)| *name == rpc)?;
        let certs = request
            .extensions()
            .get::<tonic::transport::server::TlsConnectInfo<tonic::transport::server::TcpConnectInfo>>()
            .and_then(|info| info.peer_certs());
        self.intake
            .guard
            .admit_before_body(certs.as_deref().map(Vec::as_slice), name, need)
            .err()
    }
}

/// A request body read within its cap, its budget and its deadline.
struct Metered {
    inner: Body,
    rpc: String,
    cap: usize,
    why: String,
    seen: usize,
    prefix: Vec<u8>,
    budget: Option<Arc<Semaphore>>,
    held: Option<OwnedSemaphorePermit>,
    waiting: Option<Pin<Box<dyn Future<Output = Option<OwnedSemaphorePermit>> + Send>>>,
    /// A frame read before its body's budget was granted.
    parked: Option<Frame<Bytes>>,
    deadline: Pin<Box<tokio::time::Sleep>>,
    done: bool,
}

impl Metered {
    fn over_cap(&self, declared: usize) -> BoxError {
        Box::new(Status::invalid_argument(format!(
            "a {} request of {declared} bytes was refused before decoding ({}): shorten it",
            self.rpc, self.why
        )))
    }

    /// Take in one frame's data: the prefix, the cap, and (for a large
    /// body) the budget wait it starts.
    fn take_in(&mut self, data: &Bytes) -> Result<(), BoxError> {
        if self.prefix.len() < PREFIX {
            let want = PREFIX - self.prefix.len();
            self.prefix.extend_from_slice(&data[..want.min(data.len())]);
            if self.prefix.len() == PREFIX {
                let declared = u32::from_be_bytes([
                    self.prefix[1],
                    self.prefix[2],
                    self.prefix[3],
                    self.prefix[4],
                ]) as usize;
                if declared > self.cap {
                    return Err(self.over_cap(declared));
                }
                if let Some(budget) = self.budget.take() {
                    let wanted = u32::try_from(declared + PREFIX).unwrap_or(u32::MAX);
                    self.waiting = Some(Box::pin(async move {
                        budget.acquire_many_owned(wanted).await.ok()
                    }));
                }
            }
        }
        self.seen += data.len();
        if self.seen > self.cap + PREFIX {
            return Err(self.over_cap(self.seen - PREFIX));
        }
        Ok(())
    }

    fn expired(&self) -> BoxError {
        Box::new(Status::deadline_exceeded(format!(
            "the {} request's body did not arrive whole within {}s of its headers; nothing was \
             changed",
            self.rpc,
            BODY_DEADLINE.as_secs()
        )))
    }
}

impl HttpBody for Metered {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if !this.done && this.deadline.as_mut().poll(cx).is_ready() {
            this.done = true;
            return Poll::Ready(Some(Err(this.expired())));
        }
        if let Some(waiting) = this.waiting.as_mut() {
            // Nothing more is read until the body holds its budget.
            let granted = ready!(waiting.as_mut().poll(cx));
            this.waiting = None;
            this.held = granted;
        }
        if let Some(frame) = this.parked.take() {
            return Poll::Ready(Some(Ok(frame)));
        }
        let frame = match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
            None => {
                this.done = true;
                return Poll::Ready(None);
            }
            Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
            Some(Ok(frame)) => frame,
        };
        if let Some(data) = frame.data_ref() {
            if let Err(e) = this.take_in(data) {
                this.done = true;
                return Poll::Ready(Some(Err(e)));
            }
            if this.waiting.is_some() {
                this.parked = Some(frame);
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.parked.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_configure_fits_its_cap_and_small_rpcs_stay_small() {
        let limits = Limits::default();
        let cap = configure_cap(&limits);
        assert!(cap > limits.max_bootstrap_blob_bytes + limits.max_metadata_bytes);
        assert!(cap < providerkit::service::MAX_DECODING_MESSAGE_SIZE);
        assert!(
            SMALL_REQUEST_CAP > 4 * (limits.max_machine_id_bytes + limits.max_shard_id_bytes),
            "Create, Drain and Delete fit"
        );
    }
}
