//! TLS on the gRPC listener, black-box: a throwaway PKI is minted per test,
//! the binary is started with it, and real clients (tonic, raw rustls) prove
//! what is accepted and what is refused.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bigfleet_proto::v1alpha1::capacity_provider_client::CapacityProviderClient;
use bigfleet_proto::v1alpha1::ListFilter;
use provider_testkit::field;
use rustls::pki_types::ServerName;
use tonic::transport::Endpoint;

use crate::common::{path_str, tls_channel, Pki, Provider};

const RPC_DEADLINE: Duration = Duration::from_secs(15);

fn start_tls(pki: &Pki, mtls: bool) -> Provider {
    let mut args = vec![
        "--use-fake-backend",
        "--seed-count",
        "4",
        "--tls-cert",
        path_str(&pki.server_cert),
        "--tls-key",
        path_str(&pki.server_key),
    ];
    if mtls {
        args.extend(["--tls-ca", path_str(&pki.ca)]);
    }
    Provider::start(&args)
}

/// List over TLS trusting `ca`, optionally presenting a client identity.
/// Any failure (connect, handshake, RPC) is an Err with its description.
async fn list_over_tls(
    addr: SocketAddr,
    ca: &Path,
    identity: Option<(&Path, &Path)>,
) -> Result<usize, String> {
    let call = async {
        let channel = tls_channel(addr, ca, identity).await?;
        let list = CapacityProviderClient::new(channel)
            .list(ListFilter::default())
            .await
            .map_err(|s| format!("List: {s:?}"))?;
        Ok::<_, String>(list.into_inner().machines.len())
    };
    tokio::time::timeout(RPC_DEADLINE, call)
        .await
        .map_err(|_| "timed out".to_string())?
}

fn roots(ca: &Path) -> rustls::RootCertStore {
    let pem = std::fs::read(ca).expect("read CA");
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pemfile::certs(&mut pem.as_slice()) {
        roots.add(cert.expect("CA pem")).expect("add CA");
    }
    roots
}

/// A raw TLS handshake restricted to one protocol version.
async fn handshake(
    addr: SocketAddr,
    ca: &Path,
    version: &'static rustls::SupportedProtocolVersion,
) -> Result<(), String> {
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[version])
    .expect("protocol versions")
    .with_root_certificates(roots(ca))
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("tcp: {e}"))?;
    let name = ServerName::try_from("localhost").expect("name").to_owned();
    tokio::time::timeout(RPC_DEADLINE, connector.connect(name, tcp))
        .await
        .map_err(|_| "handshake timed out".to_string())?
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// A peer that completes the TLS handshake and then sends nothing is
/// closed once the HTTP/2 preface deadline passes, as on plaintext.
#[tokio::test]
async fn a_silent_connection_after_the_handshake_is_closed() {
    use tokio::io::AsyncReadExt;
    let pki = Pki::new();
    let provider = start_tls(&pki, false);
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("protocol versions")
    .with_root_certificates(roots(&pki.ca))
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(provider.grpc)
        .await
        .expect("tcp");
    let name = ServerName::try_from("localhost").expect("name").to_owned();
    let mut tls = connector.connect(name, tcp).await.expect("handshake");
    let started = std::time::Instant::now();
    // The server writes its SETTINGS, then closes once the deadline
    // passes: read until end of stream (or a reset).
    let mut sink = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), tls.read_to_end(&mut sink)).await;
    let waited = started.elapsed();
    assert!(
        read.is_ok(),
        "the silent TLS connection was still open after {waited:?}"
    );
    assert!(
        waited < Duration::from_secs(20),
        "closed only after {waited:?}"
    );
}

#[tokio::test]
async fn tls_serves_a_client_that_trusts_the_ca() {
    let pki = Pki::new();
    let provider = start_tls(&pki, false);
    assert_eq!(
        field(&provider.startup_line, "security").as_deref(),
        Some("TLS")
    );
    // No client certificate, so no identity to check.
    assert_eq!(
        field(&provider.startup_line, "client_identity").as_deref(),
        Some("off")
    );
    let n = list_over_tls(provider.grpc, &pki.ca, None)
        .await
        .expect("List over TLS");
    assert_eq!(n, 4);
    // Certificates are read once at start: removing the files changes nothing.
    std::fs::remove_file(&pki.server_cert).expect("rm cert");
    std::fs::remove_file(&pki.server_key).expect("rm key");
    list_over_tls(provider.grpc, &pki.ca, None)
        .await
        .expect("List over TLS after the cert files are gone");
}

#[tokio::test]
async fn tls_refuses_a_plaintext_client_and_an_untrusting_one() {
    let pki = Pki::new();
    let provider = start_tls(&pki, false);
    let plain = async {
        let channel = Endpoint::from_shared(format!("http://{}", provider.grpc))
            .expect("endpoint")
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(10))
            .connect()
            .await
            .map_err(|e| e.to_string())?;
        CapacityProviderClient::new(channel)
            .list(ListFilter::default())
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let plain = tokio::time::timeout(RPC_DEADLINE, plain)
        .await
        .unwrap_or(Err("timed out".into()));
    assert!(
        plain.is_err(),
        "a plaintext List must not succeed on a TLS listener"
    );
    // A client that trusts some other CA must refuse the server's cert.
    let wrong = list_over_tls(provider.grpc, &pki.other_ca, None).await;
    assert!(wrong.is_err(), "{wrong:?}");
    // And the listener still serves a proper client afterwards.
    list_over_tls(provider.grpc, &pki.ca, None)
        .await
        .expect("List over TLS after refused clients");
}

#[tokio::test]
async fn tls12_only_client_is_refused() {
    let pki = Pki::new();
    let provider = start_tls(&pki, false);
    // Control: the same handshake code at TLS 1.3 works.
    handshake(provider.grpc, &pki.ca, &rustls::version::TLS13)
        .await
        .expect("TLS 1.3 handshake");
    let tls12 = handshake(provider.grpc, &pki.ca, &rustls::version::TLS12).await;
    assert!(
        tls12.is_err(),
        "a TLS 1.2-only client completed a handshake"
    );
    assert!(
        provider
            .logs
            .wait_for(Duration::from_secs(10), |l| l
                .contains("TLS handshake failed")
                && l.contains("level=warn"))
            .is_some(),
        "the refused handshake is not logged at warn:\n{}",
        provider.stderr()
    );
}

#[tokio::test]
async fn mtls_requires_a_client_cert_from_the_configured_ca() {
    let pki = Pki::new();
    let provider = start_tls(&pki, true);
    assert_eq!(
        field(&provider.startup_line, "security").as_deref(),
        Some("mTLS")
    );

    let anonymous = list_over_tls(provider.grpc, &pki.ca, None).await;
    assert!(
        anonymous.is_err(),
        "no client cert was accepted: {anonymous:?}"
    );

    let foreign = list_over_tls(
        provider.grpc,
        &pki.ca,
        Some((&pki.other_client_cert, &pki.other_client_key)),
    )
    .await;
    assert!(
        foreign.is_err(),
        "a cert from another CA was accepted: {foreign:?}"
    );

    let n = list_over_tls(
        provider.grpc,
        &pki.ca,
        Some((&pki.client_cert, &pki.client_key)),
    )
    .await
    .expect("List with the right client cert");
    assert_eq!(n, 4);

    assert!(
        provider.logs.wait_count(Duration::from_secs(10), 2, |l| l
            .contains("TLS handshake failed")),
        "refused handshakes are not logged:\n{}",
        provider.stderr()
    );
}

#[tokio::test]
async fn insecure_listener_says_so() {
    let provider = Provider::start(&["--use-fake-backend", "--seed-count", "2"]);
    assert_eq!(
        field(&provider.startup_line, "security").as_deref(),
        Some("insecure")
    );
    assert_eq!(
        field(&provider.startup_line, "client_identity").as_deref(),
        Some("off")
    );
    let list = provider
        .client()
        .await
        .list(ListFilter::default())
        .await
        .expect("List")
        .into_inner();
    assert_eq!(list.machines.len(), 2);
}

#[tokio::test]
async fn a_stalled_handshake_does_not_block_other_clients() {
    let pki = Pki::new();
    let provider = start_tls(&pki, false);
    // A peer that connects and never sends a ClientHello.
    let _stalled = tokio::net::TcpStream::connect(provider.grpc)
        .await
        .expect("tcp connect");
    let n = list_over_tls(provider.grpc, &pki.ca, None).await;
    assert_eq!(
        n,
        Ok(4),
        "a silent TCP peer must not stall every other client's handshake"
    );
}
