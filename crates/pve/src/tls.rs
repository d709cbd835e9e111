//! TLS trust for the PVE API. There is deliberately no way to disable
//! verification: a CA bundle, a set of leaf pins, or both must be given.
//!
//! * CA mode: rustls' WebPKI verifier (chain to the bundle + hostname).
//! * Pin mode: the SHA-256 of the leaf certificate's DER must equal one of the
//!   pins. The hostname is not checked, because PVE's self-signed `pve-ssl.pem`
//!   often lacks the DNS name or IP the API is reached by; the exact pin already
//!   binds the connection to that one certificate (and so to its key). Validity
//!   dates are not checked either: the pin names one exact certificate, and
//!   renewals are handled by pinning the new fingerprint alongside the old one.
//! * Both: the chain/hostname check and the pin must both hold.
//!
//! In every mode the handshake signatures are verified with the crypto provider,
//! so the peer must hold the private key of the certificate it presents.

use std::fmt;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use sha2::{Digest, Sha256};

use crate::error::PveError;

/// SHA-256 of a certificate's DER encoding.
pub fn cert_fingerprint(der: &[u8]) -> [u8; 32] {
    Sha256::digest(der).into()
}

/// Renders a fingerprint the way PVE shows it (`AB:CD:...`, upper case).
pub fn format_fingerprint(fp: &[u8; 32]) -> String {
    let parts: Vec<String> = fp.iter().map(|b| format!("{b:02X}")).collect();
    parts.join(":")
}

/// Parses one fingerprint: `AB:CD:...` or bare hex, case-insensitive, also
/// as `openssl x509 -noout -fingerprint -sha256` prints it
/// (`sha256 Fingerprint=AB:CD:...`; OpenSSL 1.1 writes `SHA256`).
pub fn parse_fingerprint(s: &str) -> Result<[u8; 32], PveError> {
    let t = s.trim();
    let t = match t.split_once('=') {
        Some((label, value)) => {
            let label = label.trim().to_ascii_lowercase();
            if label != "sha256 fingerprint" && label != "fingerprint" {
                return Err(PveError::Config(format!(
                    "TLS fingerprint {t:?} is not a SHA-256 fingerprint: pass openssl's \
                     `-fingerprint -sha256` output (sha256 Fingerprint=AB:CD:...) or the hex"
                )));
            }
            value.trim()
        }
        None => t,
    };
    let hexstr: String = if t.contains(':') {
        let parts: Vec<&str> = t.split(':').collect();
        if parts.iter().any(|p| p.len() != 2) {
            return Err(PveError::Config(format!(
                "TLS fingerprint {t:?} is malformed: colon-separated form needs two hex digits per byte"
            )));
        }
        parts.concat()
    } else {
        t.to_string()
    };
    let bytes = hex::decode(&hexstr)
        .map_err(|e| PveError::Config(format!("TLS fingerprint {t:?} is not valid hex: {e}")))?;
    <[u8; 32]>::try_from(bytes.as_slice()).map_err(|_| {
        PveError::Config(format!(
            "TLS fingerprint {t:?} has {} bytes; a SHA-256 fingerprint has 32",
            bytes.len()
        ))
    })
}

/// Parses a comma-separated list of fingerprints (so a renewed certificate can be
/// pinned before it is deployed). Empty items are ignored; an empty list is an error.
pub fn parse_fingerprints(s: &str) -> Result<Vec<[u8; 32]>, PveError> {
    let pins = s
        .split(',')
        .filter(|p| !p.trim().is_empty())
        .map(parse_fingerprint)
        .collect::<Result<Vec<_>, _>>()?;
    if pins.is_empty() {
        return Err(PveError::Config("TLS fingerprint list is empty".into()));
    }
    Ok(pins)
}

/// The crypto provider used for all PVE connections.
pub(crate) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Certificate verifier enforcing the CA and/or pin policy described in the module docs.
pub struct PveServerVerifier {
    webpki: Option<Arc<WebPkiServerVerifier>>,
    pins: Vec<[u8; 32]>,
    provider: Arc<CryptoProvider>,
}

impl fmt::Debug for PveServerVerifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PveServerVerifier")
            .field("ca", &self.webpki.is_some())
            .field(
                "pins",
                &self.pins.iter().map(format_fingerprint).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl PveServerVerifier {
    /// Builds the verifier. Fails if neither a CA bundle nor a pin is given, or if
    /// the bundle holds no usable certificate.
    pub fn new(ca_pem: Option<&[u8]>, pins: &[[u8; 32]]) -> Result<Self, PveError> {
        let provider = provider();
        if ca_pem.is_none() && pins.is_empty() {
            return Err(PveError::Config(
                "TLS verification material is required: a CA bundle, a certificate fingerprint, or both".into(),
            ));
        }
        let webpki = match ca_pem {
            None => None,
            Some(pem) => {
                let mut roots = RootCertStore::empty();
                let mut n = 0usize;
                for cert in CertificateDer::pem_slice_iter(pem) {
                    let cert = cert.map_err(|e| {
                        PveError::Config(format!("CA bundle is not valid PEM: {e}"))
                    })?;
                    roots.add(cert).map_err(|e| {
                        PveError::Config(format!("CA bundle holds an unusable certificate: {e}"))
                    })?;
                    n += 1;
                }
                if n == 0 {
                    return Err(PveError::Config(
                        "CA bundle contains no PEM certificates".into(),
                    ));
                }
                let v =
                    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                        .build()
                        .map_err(|e| PveError::Config(format!("CA bundle rejected: {e}")))?;
                Some(v)
            }
        };
        Ok(Self {
            webpki,
            pins: pins.to_vec(),
            provider,
        })
    }
}

impl ServerCertVerifier for PveServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if let Some(v) = &self.webpki {
            v.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)?;
        }
        if !self.pins.is_empty() {
            let fp = cert_fingerprint(end_entity.as_ref());
            if !self.pins.contains(&fp) {
                return Err(rustls::Error::General(format!(
                    "server certificate fingerprint {} matches none of the {} pinned fingerprint(s)",
                    format_fingerprint(&fp),
                    self.pins.len()
                )));
            }
        }
        // At least one of the two checks ran: the constructor refuses neither.
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// A rustls client config that trusts the PVE API per the CA/pin policy.
pub fn client_config(ca_pem: Option<&[u8]>, pins: &[[u8; 32]]) -> Result<ClientConfig, PveError> {
    let verifier = PveServerVerifier::new(ca_pem, pins)?;
    let cfg = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| PveError::Config(format!("TLS setup: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth();
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_forms() {
        let fp: [u8; 32] = core::array::from_fn(|i| i as u8 * 7);
        let colon = format_fingerprint(&fp);
        assert_eq!(parse_fingerprint(&colon).unwrap(), fp);
        assert_eq!(parse_fingerprint(&colon.to_lowercase()).unwrap(), fp);
        assert_eq!(parse_fingerprint(&hex::encode(fp)).unwrap(), fp);
        assert_eq!(parse_fingerprint(&hex::encode_upper(fp)).unwrap(), fp);
        let other = [0xABu8; 32];
        let list = format!(" {colon} ,{} ,", hex::encode(other));
        assert_eq!(parse_fingerprints(&list).unwrap(), vec![fp, other]);
        // As `openssl x509 -noout -fingerprint -sha256` prints it (3.x, 1.1).
        for printed in [
            format!("sha256 Fingerprint={colon}"),
            format!("SHA256 Fingerprint={colon}\n"),
        ] {
            assert_eq!(parse_fingerprint(&printed).unwrap(), fp, "{printed}");
        }
    }

    #[test]
    fn fingerprint_errors() {
        assert!(parse_fingerprint("zz")
            .unwrap_err()
            .to_string()
            .contains("not valid hex"));
        assert!(parse_fingerprint("AB:CD")
            .unwrap_err()
            .to_string()
            .contains("has 2 bytes"));
        assert!(parse_fingerprint("ABC:D")
            .unwrap_err()
            .to_string()
            .contains("two hex digits"));
        assert!(
            parse_fingerprint(&format!("sha1 Fingerprint={}", "AB:".repeat(19) + "AB"))
                .unwrap_err()
                .to_string()
                .contains("not a SHA-256 fingerprint")
        );
        assert!(parse_fingerprints(" , ")
            .unwrap_err()
            .to_string()
            .contains("empty"));
    }

    #[test]
    fn requires_trust_material() {
        let e = PveServerVerifier::new(None, &[]).unwrap_err();
        assert!(e
            .to_string()
            .contains("TLS verification material is required"));
        let e = PveServerVerifier::new(Some(b"not a pem"), &[]).unwrap_err();
        assert!(e.to_string().contains("no PEM certificates"), "{e}");
    }
}
