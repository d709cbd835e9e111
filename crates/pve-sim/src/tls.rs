//! Test CA generated at startup: a CA certificate and a leaf for `localhost` /
//! `127.0.0.1` signed by it, like a PVE node's `pve-ssl.pem` signed by
//! `pve-root-ca.pem`. Clients can trust the CA or pin the leaf fingerprint.

use std::sync::Arc;

use anyhow::{Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use sha2::{Digest, Sha256};

/// Generated certificate material.
pub struct TestCa {
    /// PEM of the CA certificate clients should trust.
    pub ca_pem: String,
    /// PEM of the leaf certificate the server presents.
    pub leaf_pem: String,
    /// SHA-256 of the leaf DER, `AB:CD:...` uppercase colon form (as PVE shows it).
    pub fingerprint: String,
    leaf_der: CertificateDer<'static>,
    ca_der: CertificateDer<'static>,
    leaf_key: Vec<u8>,
}

impl TestCa {
    /// Generate a fresh CA and a leaf for `localhost` and `127.0.0.1`.
    pub fn generate() -> Result<Self> {
        let ca_key = KeyPair::generate().context("generating CA key")?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(
            DnType::CommonName,
            "Proxmox Virtual Environment (pve-sim CA)",
        );
        ca_params
            .distinguished_name
            .push(DnType::OrganizationName, "PVE Cluster Manager CA");
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca_params.self_signed(&ca_key).context("self-signing CA")?;
        let issuer = Issuer::new(ca_params, ca_key);

        let leaf_key = KeyPair::generate().context("generating leaf key")?;
        let mut leaf_params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])?;
        leaf_params
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        leaf_params.is_ca = IsCa::ExplicitNoCa;
        leaf_params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        leaf_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let leaf = leaf_params
            .signed_by(&leaf_key, &issuer)
            .context("signing leaf")?;

        let fingerprint = fingerprint_of(leaf.der());
        Ok(Self {
            ca_pem: ca_cert.pem(),
            leaf_pem: leaf.pem(),
            fingerprint,
            leaf_der: leaf.der().clone(),
            ca_der: ca_cert.der().clone(),
            leaf_key: leaf_key.serialize_der(),
        })
    }

    /// DER of the CA certificate.
    pub fn ca_der(&self) -> &CertificateDer<'static> {
        &self.ca_der
    }

    /// rustls server config presenting leaf + CA chain; HTTP/1.1 only, like pveproxy
    /// (HTTP/2 has no reason phrase, which PVE uses to carry error messages).
    pub fn server_config(&self) -> Result<Arc<rustls::ServerConfig>> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.leaf_key.clone()));
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .context("TLS protocol versions")?
            .with_no_client_auth()
            .with_single_cert(vec![self.leaf_der.clone(), self.ca_der.clone()], key)
            .context("building TLS server config")?;
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(cfg))
    }
}

/// SHA-256 of a DER certificate in PVE's `AB:CD:...` form.
pub fn fingerprint_of(der: &[u8]) -> String {
    Sha256::digest(der)
        .iter()
        .map(|b| format!("{b:02X}"))
        .collect::<Vec<_>>()
        .join(":")
}
