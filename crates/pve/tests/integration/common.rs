//! In-test HTTPS servers: an rcgen PKI, an axum app that records every request
//! and answers from a script, and a raw TLS server for transport failures.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use parking_lot::Mutex;
use pve::{ApiCall, PveClient, PveConfig, PveError, RetryPolicy};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use serde_json::{json, Value};
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

pub const TOKEN_ID: &str = "bigfleet@pve!autoscaler";
pub const SECRET: &str = "0b1c2d3e-aaaa-bbbb-cccc-123456789abc";

pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

pub struct Leaf {
    pub chain: Vec<CertificateDer<'static>>,
    pub key_der: Vec<u8>,
}

impl Leaf {
    pub fn fingerprint(&self) -> [u8; 32] {
        pve::cert_fingerprint(self.chain[0].as_ref())
    }
}

impl Ca {
    pub fn new(cn: &str) -> Ca {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, cn);
        p.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        Ca {
            issuer: CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap(),
        }
    }

    pub fn pem(&self) -> Vec<u8> {
        self.issuer.pem().into_bytes()
    }

    /// A server certificate for `names`, chained to this CA.
    pub fn leaf(&self, names: &[&str]) -> Leaf {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .unwrap();
        p.distinguished_name.push(DnType::CommonName, names[0]);
        let cert = p.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            chain: vec![cert.der().clone(), self.issuer.der().clone()],
            key_der: key.serialize_der(),
        }
    }
}

/// A self-signed leaf, like a PVE node's certificate seen without its CA.
pub fn self_signed_leaf(names: &[&str]) -> Leaf {
    let key = KeyPair::generate().unwrap();
    let p =
        CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    let cert = p.self_signed(&key).unwrap();
    Leaf {
        chain: vec![cert.der().clone()],
        key_der: key.serialize_der(),
    }
}

fn acceptor(leaf: &Leaf) -> TlsAcceptor {
    let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        leaf.chain.clone(),
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf.key_der.clone())),
    )
    .unwrap();
    TlsAcceptor::from(Arc::new(cfg))
}

/// One request as the server saw it (path and query still percent-encoded).
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    pub query: Option<String>,
    pub auth: Option<String>,
    pub content_type: Option<String>,
    pub body: String,
}

/// A scripted answer.
pub struct Reply {
    pub status: u16,
    pub reason: Option<String>,
    pub body: String,
    pub delay: Duration,
}

pub fn ok(data: Value) -> Reply {
    Reply {
        status: 200,
        reason: None,
        body: json!({ "data": data }).to_string(),
        delay: Duration::ZERO,
    }
}

/// PVE-style error: message in the reason phrase, `{"data":null}` body.
pub fn fail(status: u16, reason: &str) -> Reply {
    Reply {
        status,
        reason: Some(reason.to_string()),
        body: r#"{"data":null}"#.to_string(),
        delay: Duration::ZERO,
    }
}

pub struct TestServer {
    pub addr: SocketAddr,
    pub requests: Arc<Mutex<Vec<Recorded>>>,
}

impl TestServer {
    /// `https://localhost:PORT/api2/json`.
    pub fn url(&self) -> String {
        format!("https://localhost:{}/api2/json", self.addr.port())
    }
    pub fn recorded(&self) -> Vec<Recorded> {
        self.requests.lock().clone()
    }
}

type Script = dyn Fn(&Recorded, usize) -> Reply + Send + Sync;

/// Serves `script(request, index of this request)` over TLS with `leaf`.
pub async fn serve(
    leaf: &Leaf,
    script: impl Fn(&Recorded, usize) -> Reply + Send + Sync + 'static,
) -> TestServer {
    serve_tls(acceptor(leaf), script).await
}

/// Like [`serve`], but presents `leaf`'s certificate while signing the handshake
/// with `other_key` (PKCS#8): a server that does not hold the pinned key.
pub async fn serve_with_wrong_key(
    leaf: &Leaf,
    other_key: &[u8],
    script: impl Fn(&Recorded, usize) -> Reply + Send + Sync + 'static,
) -> TestServer {
    #[derive(Debug)]
    struct Fixed(Arc<rustls::sign::CertifiedKey>);
    impl rustls::server::ResolvesServerCert for Fixed {
        fn resolve(
            &self,
            _hello: rustls::server::ClientHello<'_>,
        ) -> Option<Arc<rustls::sign::CertifiedKey>> {
            Some(self.0.clone())
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let key = provider
        .key_provider
        .load_private_key(PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(
            other_key.to_vec(),
        )))
        .unwrap();
    let ck = rustls::sign::CertifiedKey::new(leaf.chain.clone(), key);
    let cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(Fixed(Arc::new(ck))));
    serve_tls(TlsAcceptor::from(Arc::new(cfg)), script).await
}

async fn serve_tls(
    acc: TlsAcceptor,
    script: impl Fn(&Recorded, usize) -> Reply + Send + Sync + 'static,
) -> TestServer {
    let requests: Arc<Mutex<Vec<Recorded>>> = Arc::default();
    let script: Arc<Script> = Arc::new(script);
    let recs = requests.clone();
    let app = Router::new().fallback(move |req: Request| {
        let recs = recs.clone();
        let script = script.clone();
        async move {
            let (parts, body) = req.into_parts();
            let body = axum::body::to_bytes(body, 1 << 20).await.unwrap();
            let hdr = |n: &str| {
                parts
                    .headers
                    .get(n)
                    .map(|v| v.to_str().unwrap().to_string())
            };
            let rec = Recorded {
                method: parts.method.to_string(),
                path: parts.uri.path().to_string(),
                query: parts.uri.query().map(str::to_string),
                auth: hdr("authorization"),
                content_type: hdr("content-type"),
                body: String::from_utf8(body.to_vec()).unwrap(),
            };
            let n = {
                let mut g = recs.lock();
                g.push(rec.clone());
                g.len() - 1
            };
            let reply = script(&rec, n);
            if !reply.delay.is_zero() {
                // The scripted reply's own latency: the fake PVE answering
                // slowly is the behaviour under test, not a wait.
                tokio::time::sleep(reply.delay).await;
            }
            let mut resp = Response::builder()
                .status(reply.status)
                .header("content-type", "application/json")
                .body(Body::from(reply.body))
                .unwrap();
            if let Some(r) = reply.reason {
                resp.extensions_mut()
                    .insert(hyper::ext::ReasonPhrase::try_from(r.into_bytes()).unwrap());
            }
            resp
        }
    });
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let acc = acc.clone();
            let app = app.clone();
            tokio::spawn(async move {
                // Handshake failures are the point of some tests; nothing to do.
                let Ok(tls) = acc.accept(tcp).await else {
                    return;
                };
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), TowerToHyperService::new(app))
                    .await;
            });
        }
    });
    TestServer { addr, requests }
}

/// A TLS server that reads the start of each request and then closes the
/// connection without answering. Returns (addr, connections that sent bytes).
pub async fn serve_hangup(leaf: &Leaf) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let acc = acceptor(leaf);
    let seen = Arc::new(AtomicUsize::new(0));
    let seen2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let acc = acc.clone();
            let seen = seen2.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acc.accept(tcp).await else {
                    return;
                };
                let mut buf = [0u8; 4096];
                if let Ok(n) = tls.read(&mut buf).await {
                    if n > 0 {
                        seen.fetch_add(1, Ordering::SeqCst);
                    }
                }
                drop(tls);
            });
        }
    });
    (addr, seen)
}

/// Observed calls: (op, ok, attempts).
pub type Calls = Arc<Mutex<Vec<(String, bool, u32)>>>;

pub fn fast_retry() -> RetryPolicy {
    RetryPolicy {
        max_attempts: 4,
        initial_backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(5),
    }
}

pub fn config(url: &str, ca: Option<Vec<u8>>, pins: Vec<[u8; 32]>) -> (PveConfig, Calls) {
    let calls: Calls = Arc::default();
    let c2 = calls.clone();
    let mut cfg = PveConfig::new(url, TOKEN_ID, SECRET);
    cfg.ca_pem = ca;
    cfg.fingerprints = pins;
    cfg.request_timeout = Duration::from_secs(5);
    cfg.retry = fast_retry();
    cfg.observer = Some(Arc::new(move |c: &ApiCall<'_>| {
        c2.lock()
            .push((c.op.to_string(), c.result.is_ok(), c.attempts));
    }));
    (cfg, calls)
}

pub fn client(url: &str, ca: Option<Vec<u8>>, pins: Vec<[u8; 32]>) -> (PveClient, Calls) {
    let (cfg, calls) = config(url, ca, pins);
    (PveClient::new(cfg).unwrap(), calls)
}

pub fn last_call(calls: &Calls) -> (String, bool, u32) {
    calls.lock().last().cloned().expect("no call observed")
}

pub fn expect_api(e: &PveError) -> (u16, String) {
    match e {
        PveError::Api {
            status, message, ..
        } => (*status, message.clone()),
        other => panic!("expected an API error, got {other:?}"),
    }
}
