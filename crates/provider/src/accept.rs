//! Accepting gRPC connections without letting the accept loop or its
//! callers hurt the process.
//!
//! * A cap on open connections, overall and per peer address: past the
//!   overall cap the loop stops accepting (new connections wait in the
//!   kernel's backlog) until one closes; a peer past its own cap is closed
//!   at once, so one client cannot take every slot.
//! * Accept errors back off (100 ms doubling to 1 s) instead of spinning:
//!   with the descriptor limit reached `accept` fails at once, every time.
//!   The WARN line for them is rate-limited.
//! * At start the soft descriptor limit is raised to the hard one, and the
//!   cap is kept below it, so the cap is reached before the limit.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// `--max-connections` when unset.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 1024;
/// `--max-connections-per-peer` when unset: BigFleet dials a handful of
/// connections; a proxy in front of several clients needs more.
pub const DEFAULT_MAX_CONNECTIONS_PER_PEER: u32 = 256;

/// Descriptors kept for everything but gRPC connections: the state store,
/// the Proxmox client's pool, the metrics listener, log files.
const RESERVED_DESCRIPTORS: u64 = 128;

/// The first and the longest pause after a failed accept.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(1));

/// At most one WARN line about failed accepts or refused peers per this.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// The connection caps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionLimits {
    pub total: usize,
    pub per_peer: usize,
}

impl Default for ConnectionLimits {
    fn default() -> ConnectionLimits {
        ConnectionLimits {
            total: DEFAULT_MAX_CONNECTIONS as usize,
            per_peer: DEFAULT_MAX_CONNECTIONS_PER_PEER as usize,
        }
    }
}

/// Raise the soft descriptor limit to the hard one, and return the caps
/// lowered so that the overall one stays under it (with a WARN saying so).
#[allow(unsafe_code)] // libc calls; see the SAFETY notes inside
pub fn fit_descriptor_limit(limits: ConnectionLimits) -> ConnectionLimits {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only the struct passed by reference.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        tracing::warn!(error = %io::Error::last_os_error(), "cannot read the descriptor limit");
        return limits;
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: setrlimit reads the struct passed by reference; raising
        // the soft limit up to the hard one needs no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit.rlim_cur = limit.rlim_max;
        } else {
            tracing::warn!(error = %io::Error::last_os_error(), "cannot raise the descriptor limit");
        }
    }
    let room = limit.rlim_cur.saturating_sub(RESERVED_DESCRIPTORS).max(1);
    let room = usize::try_from(room).unwrap_or(usize::MAX);
    if limits.total <= room {
        return limits;
    }
    tracing::warn!(
        max_connections = limits.total,
        descriptor_limit = limit.rlim_cur,
        lowered_to = room,
        "--max-connections is above what the descriptor limit (ulimit -n) leaves: lowered; \
         raise the limit (LimitNOFILE=, the container runtime's nofile) to serve more"
    );
    ConnectionLimits {
        total: room,
        per_peer: limits.per_peer.min(room),
    }
}

/// Accept connections from `listener` within `limits`, each handed on
/// holding its slot until it closes.
pub fn accept(
    listener: TcpListener,
    limits: ConnectionLimits,
) -> tokio_stream::wrappers::ReceiverStream<io::Result<Admitted>> {
    accept_from(listener, limits)
}

/// Where connections come from: a TCP listener, or a test's stand-in.
pub(crate) trait Listen: Send + 'static {
    fn next(&self)
        -> impl std::future::Future<Output = io::Result<(TcpStream, SocketAddr)>> + Send;
}

impl Listen for TcpListener {
    fn next(
        &self,
    ) -> impl std::future::Future<Output = io::Result<(TcpStream, SocketAddr)>> + Send {
        self.accept()
    }
}

/// [`accept`] over any [`Listen`].
pub(crate) fn accept_from(
    listener: impl Listen,
    limits: ConnectionLimits,
) -> tokio_stream::wrappers::ReceiverStream<io::Result<Admitted>> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let slots = Arc::new(Semaphore::new(limits.total));
    let peers = Arc::new(Peers::default());
    tokio::spawn(async move {
        let mut backoff = BACKOFF.0;
        let mut errors = RateLimited::default();
        let mut refused = RateLimited::default();
        loop {
            // Past the cap, wait for a connection to close before taking
            // the next one from the backlog.
            let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
                return;
            };
            match listener.next().await {
                Ok((tcp, peer)) => {
                    backoff = BACKOFF.0;
                    let Some(peer_slot) = peers.take(peer.ip(), limits.per_peer) else {
                        refused.warn(|suppressed| {
                            tracing::warn!(
                                peer = %peer.ip(),
                                max_connections_per_peer = limits.per_peer,
                                suppressed,
                                "closed a connection: the peer holds as many as \
                                 --max-connections-per-peer allows"
                            )
                        });
                        continue;
                    };
                    let _ = tcp.set_nodelay(true);
                    let admitted = Admitted {
                        tcp,
                        _slot: slot,
                        _peer: peer_slot,
                    };
                    if tx.send(Ok(admitted)).await.is_err() {
                        return;
                    }
                }
                Err(e) => {
                    errors.warn(|suppressed| {
                        tracing::warn!(
                            error = %e,
                            retry_in_ms = backoff.as_millis() as u64,
                            suppressed,
                            "accepting a connection failed (at the descriptor limit, raise \
                             ulimit -n or lower --max-connections)"
                        )
                    });
                    drop(slot);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(BACKOFF.1);
                }
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// Open connections per peer address.
#[derive(Default)]
struct Peers {
    open: Mutex<HashMap<IpAddr, usize>>,
}

impl Peers {
    fn take(self: &Arc<Self>, ip: IpAddr, cap: usize) -> Option<PeerSlot> {
        let mut open = self.open.lock();
        let count = open.entry(ip).or_insert(0);
        if *count >= cap {
            return None;
        }
        *count += 1;
        Some(PeerSlot {
            peers: Arc::clone(self),
            ip,
        })
    }
}

/// One of a peer's connections; given back when it closes.
struct PeerSlot {
    peers: Arc<Peers>,
    ip: IpAddr,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut open = self.peers.open.lock();
        if let Some(count) = open.get_mut(&self.ip) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

/// A WARN at most every [`LOG_EVERY`], counting the ones it held back.
#[derive(Default)]
struct RateLimited {
    last: Option<tokio::time::Instant>,
    suppressed: u64,
}

impl RateLimited {
    fn warn(&mut self, log: impl FnOnce(u64)) {
        let now = tokio::time::Instant::now();
        if self.last.is_some_and(|last| now < last + LOG_EVERY) {
            self.suppressed += 1;
            return;
        }
        log(self.suppressed);
        self.last = Some(now);
        self.suppressed = 0;
    }
}

/// An accepted connection holding its slots.
pub struct Admitted {
    tcp: TcpStream,
    _slot: OwnedSemaphorePermit,
    _peer: PeerSlot,
}

impl Admitted {
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.peer_addr()
    }
}

impl AsyncRead for Admitted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for Admitted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, data)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }
}

impl tonic::transport::server::Connected for Admitted {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.tcp.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use tokio_stream::StreamExt;

    use super::*;

    async fn listener() -> (TcpListener, SocketAddr) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        (listener, addr)
    }

    #[tokio::test]
    async fn a_peer_past_its_cap_is_closed_and_its_slot_comes_back() {
        let (listener, addr) = listener().await;
        let mut accepted = accept(
            listener,
            ConnectionLimits {
                total: 10,
                per_peer: 2,
            },
        );
        let _a = TcpStream::connect(addr).await.expect("connect");
        let _b = TcpStream::connect(addr).await.expect("connect");
        let first = accepted.next().await.expect("first").expect("ok");
        let _second = accepted.next().await.expect("second").expect("ok");
        let mut third = TcpStream::connect(addr).await.expect("connect");
        // The third is closed by the server: reading it ends at once.
        let mut byte = [0u8; 1];
        let read = tokio::io::AsyncReadExt::read(&mut third, &mut byte).await;
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
        drop(first);
        let _c = TcpStream::connect(addr).await.expect("connect");
        let again = tokio::time::timeout(Duration::from_secs(5), accepted.next())
            .await
            .expect("a slot came back");
        assert!(again.is_some_and(|r| r.is_ok()));
    }

    #[tokio::test]
    async fn past_the_overall_cap_nothing_more_is_accepted_until_one_closes() {
        let (listener, addr) = listener().await;
        let mut accepted = accept(
            listener,
            ConnectionLimits {
                total: 1,
                per_peer: 5,
            },
        );
        let _a = TcpStream::connect(addr).await.expect("connect");
        let first = accepted.next().await.expect("first").expect("ok");
        let _b = TcpStream::connect(addr).await.expect("connect");
        let waited = tokio::time::timeout(Duration::from_millis(300), accepted.next()).await;
        assert!(waited.is_err(), "accepted past the cap");
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(5), accepted.next())
            .await
            .expect("accepted once a slot freed");
        assert!(second.is_some_and(|r| r.is_ok()));
    }

    /// A listener whose every accept fails as at the descriptor limit.
    struct Starved(Arc<std::sync::atomic::AtomicUsize>);

    impl Listen for Starved {
        async fn next(&self) -> io::Result<(TcpStream, SocketAddr)> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Err(io::Error::from_raw_os_error(libc::EMFILE))
        }
    }

    /// With accept failing at once, every time (the descriptor limit), the
    /// loop backs off to one attempt a second instead of spinning.
    #[test]
    fn accept_errors_back_off_instead_of_spinning() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let attempts = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let _stream = accept_from(Starved(Arc::clone(&attempts)), ConnectionLimits::default());
            tokio::time::sleep(Duration::from_secs(10)).await;
            let n = attempts.load(std::sync::atomic::Ordering::Relaxed);
            // 100 ms doubling to 1 s: 0, 0.1, 0.3, 0.7, 1.5, 2.5, ... 9.5 s.
            assert!((5..=14).contains(&n), "{n} accept attempts in 10 s");
        });
    }

    #[test]
    fn the_log_is_held_back_within_its_window() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let mut limited = RateLimited::default();
            let mut logged = Vec::new();
            for _ in 0..1000 {
                limited.warn(|suppressed| logged.push(suppressed));
            }
            tokio::time::advance(LOG_EVERY).await;
            limited.warn(|suppressed| logged.push(suppressed));
            assert_eq!(logged, vec![0, 999]);
        });
    }
}
