//! The harness dials TLS and mTLS endpoints (tonic ClientTlsConfig) and refuses to talk to an
//! mTLS endpoint without a client identity.

use std::sync::Arc;

use async_trait::async_trait;
use bigfleet_proto::v1alpha1::CapacityType;
use conformance::harness::{dial, probe, TlsOpts};
use providerkit::service::CapacityService;
use providerkit::{
    Backend, BackendError, CatalogFacts, ConfigureCtx, CreateCtx, DrainCtx, Engine, EngineOptions,
    MemoryStore, SlotSpec, SubstrateHost,
};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};

struct Tiny;

#[async_trait]
impl Backend for Tiny {
    async fn describe(&self) -> Result<Vec<SlotSpec>, BackendError> {
        Ok((0..4)
            .map(|i| SlotSpec {
                id: format!("tiny/{i}"),
                facts: CatalogFacts {
                    instance_type: "t".into(),
                    zone: "z".into(),
                    capacity_type: CapacityType::OnDemand,
                    ..Default::default()
                }
                .share(),
                host: None,
            })
            .collect())
    }
    async fn create(&self, ctx: CreateCtx) -> Result<SubstrateHost, BackendError> {
        Ok(SubstrateHost {
            host_ref: ctx.machine_id,
        })
    }
    async fn configure(&self, _: &ConfigureCtx) -> Result<(), BackendError> {
        Ok(())
    }
    async fn drain(&self, _: DrainCtx) -> Result<(), BackendError> {
        Ok(())
    }
}

struct Pki {
    dir: tempfile::TempDir,
    ca: String,
    server: (String, String),
}

fn pki() -> Pki {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca =
        CertifiedIssuer::self_signed(ca_params, KeyPair::generate().expect("ca key")).expect("ca");
    let leaf = |name: &str| {
        let key = KeyPair::generate().expect("key");
        let cert = CertificateParams::new(vec![name.to_string()])
            .expect("params")
            .signed_by(&key, &ca)
            .expect("sign");
        (cert.pem(), key.serialize_pem())
    };
    let server = leaf("localhost");
    let client = leaf("bfconformance-client");
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("ca.pem"), ca.pem()).expect("write");
    std::fs::write(dir.path().join("client.pem"), &client.0).expect("write");
    std::fs::write(dir.path().join("client.key"), &client.1).expect("write");
    Pki {
        dir,
        ca: ca.pem(),
        server,
    }
}

async fn serve_tls(p: &Pki, mtls: bool) -> String {
    let engine = Engine::start(
        Arc::new(Tiny),
        Arc::new(MemoryStore::new()),
        EngineOptions::default(),
    )
    .await
    .expect("engine");
    let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(&p.server.0, &p.server.1));
    if mtls {
        tls = tls.client_ca_root(Certificate::from_pem(&p.ca));
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let server = Server::builder()
        .tls_config(tls)
        .expect("tls config")
        .add_service(CapacityService::new(engine).into_server())
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
    tokio::spawn(server);
    addr.replace("127.0.0.1", "localhost")
}

#[tokio::test]
async fn dials_tls_and_mtls() {
    let p = pki();
    let ca = Some(p.dir.path().join("ca.pem"));

    let addr = serve_tls(&p, false).await;
    let tls = TlsOpts {
        ca: ca.clone(),
        domain: Some("localhost".into()),
        ..TlsOpts::default()
    };
    let caps = probe(&dial(&addr, Some(&tls)).await.expect("tls dial"))
        .await
        .expect("probe over TLS");
    assert_eq!(caps.fleet_size, 4);
    assert!(!caps.delete, "Tiny does not delete");
    // Plaintext against a TLS listener never works.
    let plain = match dial(&addr, None).await {
        Ok(c) => probe(&c).await.is_err(),
        Err(_) => true,
    };
    assert!(plain, "plaintext talked to a TLS endpoint");

    let addr = serve_tls(&p, true).await;
    let mtls = TlsOpts {
        ca: ca.clone(),
        cert: Some(p.dir.path().join("client.pem")),
        key: Some(p.dir.path().join("client.key")),
        domain: Some("localhost".into()),
    };
    probe(&dial(&addr, Some(&mtls)).await.expect("mtls dial"))
        .await
        .expect("probe over mTLS");
    let refused = match dial(&addr, Some(&tls)).await {
        Ok(c) => probe(&c).await.is_err(),
        Err(_) => true,
    };
    assert!(
        refused,
        "mTLS endpoint served a client without a certificate"
    );
}

#[test]
fn half_an_identity_is_a_clear_error() {
    let opts = TlsOpts {
        cert: Some("/nonexistent/c.pem".into()),
        ..TlsOpts::default()
    };
    let rt = tokio::runtime::Runtime::new().expect("rt");
    let Err(err) = rt.block_on(dial("127.0.0.1:1", Some(&opts))) else {
        panic!("half an identity was accepted");
    };
    assert!(format!("{err:#}").contains("--tls-cert"), "{err:#}");
}
