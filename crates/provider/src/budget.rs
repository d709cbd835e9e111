//! Bounded memory against slow or hostile clients, at the transport.
//!
//! * [`BudgetLayer`] keeps a List response's share of the
//!   [`providerkit::service::ListBudget`] until its body is dropped, and
//!   hands the body to HTTP/2 in small frames. hyper asks the body for the
//!   next frame only when the stream has send capacity, so a client that
//!   does not read holds one frame in the connection's buffers and the rest
//!   stays in the (budgeted) body instead of being copied into an unbounded
//!   send queue.
//! * [`FirstBytes`] closes a connection that does not send the HTTP/2
//!   preface and its SETTINGS within a deadline: a peer that connects and
//!   stays silent must not hold a connection (and its buffers) forever.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use providerkit::service::{HeldBudget, ListPermit};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::body::Body;
use tower::{Layer, Service};

type HttpRequest = http::Request<Body>;
type HttpResponse = http::Response<Body>;

/// Largest DATA chunk handed to HTTP/2 at once: the default stream window.
pub const FRAME_BYTES: usize = 64 * 1024;

#[derive(Clone, Default)]
pub struct BudgetLayer;

impl<S> Layer<S> for BudgetLayer {
    type Service = Budgeted<S>;
    fn layer(&self, inner: S) -> Budgeted<S> {
        Budgeted { inner }
    }
}

#[derive(Clone)]
pub struct Budgeted<S> {
    inner: S,
}

impl<S> Service<HttpRequest> for Budgeted<S>
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
        Box::pin(async move {
            let response = inner.call(request).await?;
            let Some(held) = response.extensions().get::<HeldBudget>().cloned() else {
                return Ok(response);
            };
            let (parts, body) = response.into_parts();
            let body = Body::new(Framed {
                inner: body,
                pending: Bytes::new(),
                permit: held.take(),
            });
            Ok(http::Response::from_parts(parts, body))
        })
    }
}

/// A body that yields at most [`FRAME_BYTES`] per frame and holds a budget
/// permit until it is dropped.
struct Framed {
    inner: Body,
    pending: Bytes,
    permit: Option<ListPermit>,
}

impl HttpBody for Framed {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let this = &mut *self;
        if this.pending.is_empty() {
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => this.pending = data,
                    Err(frame) => {
                        // Trailers: everything was handed over.
                        this.permit = None;
                        return Poll::Ready(Some(Ok(frame)));
                    }
                },
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                None => {
                    this.permit = None;
                    return Poll::Ready(None);
                }
            }
        }
        let n = this.pending.len().min(FRAME_BYTES);
        Poll::Ready(Some(Ok(Frame::data(this.pending.split_to(n)))))
    }

    fn is_end_stream(&self) -> bool {
        self.pending.is_empty() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let mut hint = self.inner.size_hint();
        let pending = self.pending.len() as u64;
        hint.set_lower(hint.lower().saturating_add(pending));
        if let Some(upper) = hint.upper() {
            hint.set_upper(upper.saturating_add(pending));
        }
        hint
    }
}

/// The HTTP/2 client preface (24 bytes) plus a SETTINGS frame header.
pub const PREFACE_BYTES: usize = 24 + 9;

/// How long a new connection may take to send [`PREFACE_BYTES`].
pub const PREFACE_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection that fails its reads once `deadline` passes before the
/// first [`PREFACE_BYTES`] have arrived; after that it is the plain stream.
pub struct FirstBytes<T> {
    io: T,
    seen: usize,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<T> FirstBytes<T> {
    pub fn new(io: T, timeout: Duration) -> FirstBytes<T> {
        FirstBytes {
            io,
            seen: 0,
            deadline: Some(Box::pin(tokio::time::sleep(timeout))),
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for FirstBytes<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(result) => {
                this.seen += buf.filled().len() - before;
                if this.seen >= PREFACE_BYTES {
                    this.deadline = None;
                }
                Poll::Ready(result)
            }
            Poll::Pending => {
                let expired = this
                    .deadline
                    .as_mut()
                    .is_some_and(|deadline| deadline.as_mut().poll(cx).is_ready());
                if expired {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client sent no HTTP/2 preface within the deadline",
                    )));
                }
                Poll::Pending
            }
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for FirstBytes<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, data)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<T: tonic::transport::server::Connected> tonic::transport::server::Connected for FirstBytes<T> {
    type ConnectInfo = T::ConnectInfo;
    fn connect_info(&self) -> T::ConnectInfo {
        self.io.connect_info()
    }
}

/// Hand freed memory back to the OS promptly. glibc raises its mmap
/// threshold after each large free, so the multi-megabyte List buffers end
/// up in the heap and stay resident after a burst; a fixed threshold keeps
/// them mmapped (unmapped on free), and fewer arenas limit fragmentation.
#[allow(unsafe_code)] // libc call; see the SAFETY note inside
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; called once at
    // start-up before the runtime's threads exist.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}
