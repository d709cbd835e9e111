//! Dialling the provider: target parsing, plaintext or TLS/mTLS channels,
//! and the connection facts error hints depend on.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bigfleet_proto::v1alpha1::capacity_provider_client::CapacityProviderClient;
use bigfleet_proto::v1alpha1::{Machine, MachineRef};
use hyper_util::rt::TokioIo;
use rustls::client::ResolvesClientCert;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, SignatureScheme};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;
use tonic::transport::{Channel, Endpoint};
use tonic::Code;

use crate::args::CtlArgs;
use crate::error::{CtlError, CtlErrorKind};
use crate::render::{canonical_code_name, cell, error_chain, join_chain};

pub(crate) type Client = CapacityProviderClient<Channel>;
pub(crate) type AdminClient = bigfleet_proto::admin::admin_client::AdminClient<Channel>;

/// Connection facts the error hints depend on.
pub(crate) struct Session {
    pub(crate) client: Client,
    /// The provider's admin service, on the same channel.
    pub(crate) admin: AdminClient,
    pub(crate) target: String,
    pub(crate) tls: bool,
    pub(crate) client_cert: bool,
    pub(crate) timeout: Duration,
}

impl Session {
    pub(crate) fn status_error(&self, what: &str, status: &tonic::Status) -> CtlError {
        self.status_error_hinted(
            what,
            status,
            "fenced out: retry with a higher --epoch or --sequence",
        )
    }

    /// [`Session::status_error`] with the FAILED_PRECONDITION hint the RPC
    /// calls for.
    pub(crate) fn status_error_hinted(
        &self,
        what: &str,
        status: &tonic::Status,
        precondition_hint: &str,
    ) -> CtlError {
        let message = status.message().trim();
        let message = if message.is_empty() {
            String::new()
        } else {
            cell(message)
        };
        let detail = join_chain(message, std::error::Error::source(status));
        let mut msg = format!("{what}: {}", canonical_code_name(status.code()));
        if !detail.is_empty() {
            msg.push_str(&format!(": {detail}"));
        }
        let hint = match status.code() {
            Code::FailedPrecondition => Some(precondition_hint.to_string()),
            // Locally generated transport failures carry a source; answers
            // from the provider never do. A provider that answered
            // UNAVAILABLE itself (a standby, a provider still starting, a
            // state store that could not commit) was reached: its message
            // says what to do, and "check that it runs" would mislead.
            _ if std::error::Error::source(status).is_some() => Some(if !self.tls {
                format!(
                    "check that the provider runs at {}; if it serves TLS, pass --tls-ca \
                         (and --tls-cert/--tls-key for mTLS)",
                    self.target
                )
            } else if !self.client_cert {
                format!(
                    "check that the provider runs at {} and whether it requires a client \
                         certificate (--tls-cert/--tls-key)",
                    self.target
                )
            } else {
                format!("check that the provider runs at {}", self.target)
            }),
            Code::DeadlineExceeded => Some(format!(
                "no answer within --timeout {}",
                humantime::format_duration(self.timeout)
            )),
            _ => None,
        };
        if let Some(hint) = hint {
            msg.push_str(&format!(" ({hint})"));
        }
        CtlError::new(CtlErrorKind::Rpc(status.code()), msg).caused_by(status.clone())
    }

    pub(crate) async fn get(&mut self, id: &str) -> Result<Machine, tonic::Status> {
        self.client
            .get(MachineRef { id: id.to_string() })
            .await
            .map(tonic::Response::into_inner)
    }
}

pub(crate) fn split_target(target: &str) -> (Option<&str>, &str) {
    for scheme in ["http", "https"] {
        if let Some(rest) = target
            .strip_prefix(scheme)
            .and_then(|r| r.strip_prefix("://"))
        {
            return (Some(scheme), rest);
        }
    }
    (None, target)
}

/// The port a bare host means: the provider's default gRPC port.
pub(crate) const DEFAULT_PORT: u16 = 9000;

/// `HOST` -> `HOST:9000`, `:PORT` -> `127.0.0.1:PORT`, a bare IPv6 address
/// -> `[ADDR]:9000`; anything with a port stays as it is.
pub(crate) fn normalize_authority(authority: &str) -> String {
    if let Some(port) = authority
        .strip_prefix(':')
        .filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
    {
        return format!("127.0.0.1:{port}");
    }
    if authority.starts_with('[') {
        return if authority.contains("]:") {
            authority.to_string()
        } else {
            format!("{authority}:{DEFAULT_PORT}")
        };
    }
    match authority.matches(':').count() {
        0 => format!("{authority}:{DEFAULT_PORT}"),
        1 => authority.to_string(),
        _ => format!("[{authority}]:{DEFAULT_PORT}"),
    }
}

pub(crate) fn read_pem_certs(
    flag: &str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, CtlError> {
    let pem = std::fs::read(path).map_err(|e| {
        CtlError::input(format!("cannot read {flag} {}: {e}", path.display())).caused_by(e)
    })?;
    let certs = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            CtlError::input(format!("{flag} {} is not PEM: {e}", path.display())).caused_by(e)
        })?;
    if certs.is_empty() {
        return Err(CtlError::input(format!(
            "{flag} {} holds no PEM certificate",
            path.display()
        )));
    }
    Ok(certs)
}

pub(crate) fn read_pem_key(path: &Path) -> Result<PrivateKeyDer<'static>, CtlError> {
    let pem = std::fs::read(path).map_err(|e| {
        CtlError::input(format!("cannot read --tls-key {}: {e}", path.display())).caused_by(e)
    })?;
    match rustls_pemfile::private_key(&mut pem.as_slice()) {
        Ok(Some(key)) => Ok(key),
        Ok(None) => Err(CtlError::input(format!(
            "--tls-key {} holds no PEM private key",
            path.display()
        ))),
        Err(e) => Err(CtlError::input(format!(
            "--tls-key {} is not a PEM private key: {e}",
            path.display()
        ))
        .caused_by(e)),
    }
}

/// Stands in for a missing client identity and records whether the server
/// asked for one, so a refused handshake can be explained instead of
/// surfacing later as a broken pipe.
#[derive(Debug, Default)]
pub(crate) struct CertRequestProbe(AtomicBool);

impl ResolvesClientCert for CertRequestProbe {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        self.0.store(true, Ordering::SeqCst);
        None
    }

    fn has_certs(&self) -> bool {
        false
    }
}

/// Everything a TLS dial needs, validated before the first connection.
pub(crate) struct TlsDial {
    pub(crate) roots: Arc<RootCertStore>,
    pub(crate) identity: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
    pub(crate) server_name: ServerName<'static>,
    pub(crate) address: String,
}

impl TlsDial {
    fn config(&self) -> Result<(ClientConfig, Option<Arc<CertRequestProbe>>), CtlError> {
        let builder =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_protocol_versions(&[&rustls::version::TLS13])
                .map_err(|e| {
                    CtlError::new(CtlErrorKind::Connect, format!("TLS setup failed: {e}"))
                        .caused_by(e)
                })?
                .with_root_certificates(self.roots.clone());
        let (mut config, probe) = match &self.identity {
            Some((certs, key)) => (
                builder
                    .with_client_auth_cert(certs.clone(), key.clone_key())
                    .map_err(|e| {
                        CtlError::input(format!(
                            "--tls-cert and --tls-key do not form a usable keypair: {e}"
                        ))
                        .caused_by(e)
                    })?,
                None,
            ),
            None => {
                let probe = Arc::new(CertRequestProbe::default());
                (
                    builder.with_client_cert_resolver(probe.clone()),
                    Some(probe),
                )
            }
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok((config, probe))
    }

    async fn dial(&self) -> std::io::Result<TokioIo<TlsStream<TcpStream>>> {
        let (config, probe) = self.config().map_err(std::io::Error::other)?;
        let tcp = TcpStream::connect(&self.address).await?;
        tcp.set_nodelay(true)?;
        let tls = TlsConnector::from(Arc::new(config))
            .connect(self.server_name.clone(), tcp)
            .await
            .map_err(|e| std::io::Error::other(handshake_failure(&self.address, &e)))?;
        if probe.is_some_and(|p| p.0.load(Ordering::SeqCst)) {
            return Err(std::io::Error::other(
                "the provider requires a client certificate (mTLS): pass --tls-cert and \
                 --tls-key",
            ));
        }
        Ok(TokioIo::new(tls))
    }
}

/// What a failed TLS handshake means. A plaintext gRPC server answers the
/// ClientHello with HTTP/2 bytes, which rustls reports only as a corrupt
/// record; say what that means and what to do instead.
fn handshake_failure(address: &str, e: &std::io::Error) -> String {
    let plaintext = e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .is_some_and(|tls| {
            matches!(
                tls,
                rustls::Error::InvalidMessage(
                    rustls::InvalidMessage::InvalidContentType
                        | rustls::InvalidMessage::UnknownProtocolVersion
                )
            )
        });
    if plaintext {
        format!(
            "TLS handshake failed: {e}: the provider at {address} seems to serve plaintext; \
             drop --tls-ca/--tls-cert/--tls-key (or use an http:// target)"
        )
    } else {
        format!("TLS handshake failed: {e}")
    }
}

pub(crate) fn tls_dial(args: &CtlArgs, authority: &str) -> Result<TlsDial, CtlError> {
    let ca = args.tls_ca.as_deref().ok_or_else(|| {
        CtlError::input("TLS needs --tls-ca: the CA (PEM) that signed the provider's certificate")
    })?;
    let mut roots = RootCertStore::empty();
    for cert in read_pem_certs("--tls-ca", ca)? {
        roots.add(cert).map_err(|e| {
            CtlError::input(format!(
                "--tls-ca {}: unusable CA certificate: {e}",
                ca.display()
            ))
            .caused_by(e)
        })?;
    }
    let identity = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some((read_pem_certs("--tls-cert", cert)?, read_pem_key(key)?)),
        (None, None) => None,
        _ => {
            return Err(CtlError::input(
                "--tls-cert and --tls-key must be given together",
            ))
        }
    };
    let uri: http::Uri = format!("https://{authority}").parse().map_err(|e| {
        CtlError::input(format!(
            "--target {authority:?} is not a valid address: {e}"
        ))
        .caused_by(e)
    })?;
    let host = uri
        .host()
        .map(|h| h.trim_start_matches('[').trim_end_matches(']'))
        .filter(|h| !h.is_empty())
        .ok_or_else(|| CtlError::input(format!("--target {authority:?} names no host")))?;
    let port = uri
        .port_u16()
        .ok_or_else(|| CtlError::input(format!("--target {authority:?} names no port")))?;
    let name = args.tls_domain.as_deref().unwrap_or(host);
    let server_name = ServerName::try_from(name.to_string()).map_err(|e| {
        CtlError::input(format!("{name:?} is not a valid TLS server name: {e}")).caused_by(e)
    })?;
    let dial = TlsDial {
        roots: Arc::new(roots),
        identity,
        server_name,
        address: if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        },
    };
    // Surfaces a mismatched cert/key pair before anything is dialled.
    dial.config()?;
    Ok(dial)
}

pub(crate) async fn connect(args: &CtlArgs) -> Result<Session, CtlError> {
    connect_with_deadline(args, args.timeout).await
}

/// [`connect`] with a per-RPC deadline other than --timeout (an RPC that
/// waits for substrate work).
pub(crate) async fn connect_with_deadline(
    args: &CtlArgs,
    rpc_deadline: Duration,
) -> Result<Session, CtlError> {
    let target = args.target.trim();
    let (scheme, authority) = split_target(target);
    let authority = authority.trim_end_matches('/');
    if authority.is_empty() {
        return Err(CtlError::input(format!(
            "--target {target:?} names no host:port"
        )));
    }
    let authority = &normalize_authority(authority);
    let tls_flags = args.tls_ca.is_some()
        || args.tls_cert.is_some()
        || args.tls_key.is_some()
        || args.tls_domain.is_some();
    if scheme == Some("http") && tls_flags {
        return Err(CtlError::input(format!(
            "--target {target} is http:// but --tls-* flags are set: use https:// or a bare \
             HOST:PORT"
        )));
    }
    let tls = tls_flags || scheme == Some("https");
    // TLS is layered by our own connector, so the channel URI stays http.
    let endpoint = Endpoint::from_shared(format!("http://{authority}"))
        .map_err(|e| {
            CtlError::input(format!("--target {target:?} is not a valid address: {e}")).caused_by(e)
        })?
        .connect_timeout(args.timeout)
        .timeout(rpc_deadline);
    let mut client_cert = false;
    let channel = if tls {
        let dial = Arc::new(tls_dial(args, authority)?);
        client_cert = dial.identity.is_some();
        let connector = tower::service_fn(move |_: http::Uri| {
            let dial = dial.clone();
            async move { dial.dial().await }
        });
        endpoint.connect_with_connector(connector).await
    } else {
        endpoint.connect().await
    };
    let channel = channel.map_err(|e| {
        let message = format!("cannot connect to {authority}: {}", error_chain(&e));
        CtlError::new(CtlErrorKind::Connect, message).caused_by(e)
    })?;
    Ok(Session {
        client: CapacityProviderClient::new(channel.clone()),
        admin: AdminClient::new(channel),
        target: target.to_string(),
        tls,
        client_cert,
        timeout: args.timeout,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(tls: bool) -> Session {
        let channel = Endpoint::from_static("http://127.0.0.1:1").connect_lazy();
        Session {
            client: CapacityProviderClient::new(channel.clone()),
            admin: AdminClient::new(channel),
            target: "127.0.0.1:1".into(),
            tls,
            client_cert: false,
            timeout: Duration::from_secs(1),
        }
    }

    #[tokio::test]
    async fn the_provider_s_own_unavailable_gets_no_connection_hint() {
        let s = session(false);
        for answer in [
            "replica r2 is a standby; the leader serves",
            "the provider is starting and serves nothing yet: reading the state",
            "the state store could not commit the mutation: disk full",
        ] {
            let err = s
                .status_error("List", &tonic::Status::unavailable(answer))
                .to_string();
            assert_eq!(err, format!("List: UNAVAILABLE: {answer}"));
        }
    }

    #[tokio::test]
    async fn a_transport_failure_keeps_the_connection_hint() {
        let s = session(false);
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "connection reset");
        let status = tonic::Status::from_error(Box::new(io));
        assert!(std::error::Error::source(&status).is_some());
        let err = s.status_error("List", &status).to_string();
        assert!(
            err.contains(
                "check that the provider runs at 127.0.0.1:1; if it serves TLS, pass --tls-ca"
            ),
            "{err}"
        );
    }

    #[tokio::test]
    async fn tls_against_a_plaintext_provider_says_so() {
        // A plaintext HTTP/2 server opens with its SETTINGS frame: the bytes
        // a TLS client reads where it expects a record.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            while let Ok((mut conn, _)) = listener.accept().await {
                let _ = conn.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await;
                // Keep the connection open until the client gives up.
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    drop(conn);
                });
            }
        });
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, cert.pem()).unwrap();
        let args = CtlArgs {
            target: address.clone(),
            tls_ca: Some(ca),
            timeout: Duration::from_secs(5),
            ..crate::tests::parse_ctl(&["list"])
        };
        let err = connect(&args).await.err().expect("the handshake fails");
        let err = err.to_string();
        assert!(
            err.contains(&format!(
                "the provider at {address} seems to serve plaintext; drop --tls-ca"
            )),
            "{err}"
        );
    }
}
