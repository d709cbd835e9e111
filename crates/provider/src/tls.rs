//! TLS for the gRPC listener: TLS 1.3 only, optional mTLS. Certificates are
//! read once at start; every problem is reported before anything listens.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};

use crate::error::ConfigError;

/// How the gRPC listener is secured; also the startup log's `security`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Security {
    Insecure,
    Tls,
    Mtls,
}

impl Security {
    pub fn name(self) -> &'static str {
        match self {
            Security::Insecure => "insecure",
            Security::Tls => "TLS",
            Security::Mtls => "mTLS",
        }
    }
}

fn read_certs(
    flag: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let pem = std::fs::read(path).map_err(|source| ConfigError::Read {
        flag,
        path: path.to_path_buf(),
        source,
    })?;
    let certs: Vec<CertificateDer<'static>> = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<_, _>>()
        .map_err(|e| {
            let message = format!(
                "{flag} {} is not a PEM certificate file: {e}",
                path.display()
            );
            ConfigError::malformed(message, Some(e.into()))
        })?;
    if certs.is_empty() {
        return Err(ConfigError::malformed(
            format!("{flag} {} holds no PEM certificate", path.display()),
            None,
        ));
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, ConfigError> {
    let pem = std::fs::read(path).map_err(|source| ConfigError::Read {
        flag: "--tls-key",
        path: path.to_path_buf(),
        source,
    })?;
    rustls_pemfile::private_key(&mut pem.as_slice())
        .map_err(|e| {
            let message = format!("--tls-key {} is not a PEM private key: {e}", path.display());
            ConfigError::malformed(message, Some(e.into()))
        })?
        .ok_or_else(|| {
            ConfigError::malformed(
                format!("--tls-key {} holds no PEM private key", path.display()),
                None,
            )
        })
}

/// Validate the flag combination and build the server config.
pub fn server_config(
    cert: Option<&Path>,
    key: Option<&Path>,
    client_ca: Option<&Path>,
) -> Result<(Security, Option<Arc<ServerConfig>>), ConfigError> {
    let (cert, key) = match (cert, key, client_ca) {
        (None, None, None) => return Ok((Security::Insecure, None)),
        (None, None, Some(_)) => {
            return Err(ConfigError::invalid(
                "--tls-ca set without --tls-cert/--tls-key",
            ))
        }
        (Some(c), Some(k), _) => (c, k),
        _ => {
            return Err(ConfigError::invalid(
                "both --tls-cert and --tls-key are required to enable TLS",
            ))
        }
    };
    let certs = read_certs("--tls-cert", cert)?;
    let key = read_key(key)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| ConfigError::invalid_because(format!("TLS setup failed: {e}"), e))?;
    let (security, builder) = match client_ca {
        None => (Security::Tls, builder.with_no_client_auth()),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in read_certs("--tls-ca", ca)? {
                roots.add(c).map_err(|e| {
                    let message =
                        format!("--tls-ca {}: unusable CA certificate: {e}", ca.display());
                    ConfigError::malformed(message, Some(e.into()))
                })?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| {
                    ConfigError::malformed(
                        format!("--tls-ca {}: {e}", ca.display()),
                        Some(e.into()),
                    )
                })?;
            (Security::Mtls, builder.with_client_cert_verifier(verifier))
        }
    };
    let mut config = builder.with_single_cert(certs, key).map_err(|e| {
        let message = format!(
            "--tls-cert {} and --tls-key do not form a usable keypair: {e}",
            cert.display()
        );
        ConfigError::invalid_because(message, e)
    })?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok((security, Some(Arc::new(config))))
}
