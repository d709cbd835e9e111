//! Dialling an endpoint, plaintext or TLS/mTLS.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context as _};
use bigfleet_proto::v1alpha1::capacity_provider_client::CapacityProviderClient;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

pub type Client = CapacityProviderClient<Channel>;

/// TLS material for dialing; all paths are PEM files.
#[derive(Debug, Clone, Default)]
pub struct TlsOpts {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub domain: Option<String>,
}

impl TlsOpts {
    fn client_config(&self) -> anyhow::Result<ClientTlsConfig> {
        let mut cfg = ClientTlsConfig::new();
        if let Some(ca) = &self.ca {
            let pem =
                std::fs::read(ca).with_context(|| format!("reading --tls-ca {}", ca.display()))?;
            cfg = cfg.ca_certificate(Certificate::from_pem(pem));
        }
        match (&self.cert, &self.key) {
            (Some(c), Some(k)) => {
                let cert = std::fs::read(c)
                    .with_context(|| format!("reading --tls-cert {}", c.display()))?;
                let key = std::fs::read(k)
                    .with_context(|| format!("reading --tls-key {}", k.display()))?;
                cfg = cfg.identity(Identity::from_pem(cert, key));
            }
            (None, None) => {}
            _ => bail!("--tls-cert and --tls-key must be given together"),
        }
        if let Some(d) = &self.domain {
            cfg = cfg.domain_name(d.clone());
        }
        Ok(cfg)
    }
}

/// Dials `addr` (host:port) over a fresh connection: plaintext when `tls` is None, TLS or mTLS otherwise.
pub async fn dial(addr: &str, tls: Option<&TlsOpts>) -> anyhow::Result<Client> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut ep = Endpoint::from_shared(format!("{scheme}://{addr}"))
        .with_context(|| format!("invalid target address {addr:?}"))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(60));
    if let Some(t) = tls {
        ep = ep
            .tls_config(t.client_config()?)
            .context("applying TLS config")?;
    }
    let ch = ep
        .connect()
        .await
        .with_context(|| format!("dialing {addr}"))?;
    Ok(CapacityProviderClient::new(ch)
        .max_decoding_message_size(512 * 1024 * 1024)
        .max_encoding_message_size(64 * 1024 * 1024))
}
