//! Binding the auxiliary HTTP listener (metrics and probes).
//!
//! The certification runner boots providers without `--metrics-addr` while
//! an earlier instance still holds the default port. A bind failure on the
//! *default* address therefore must not stop a provider from serving: it is
//! a loud warning and the provider runs without metrics or probes. An
//! address the operator chose stays fatal, like any other bad flag.

use std::net::SocketAddr;

use tokio::net::TcpListener;

/// Where the auxiliary listener binds, and who chose the address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuxAddr {
    /// Switched off (`--metrics-addr ""`).
    Disabled,
    /// The built-in default: a failed bind is a warning.
    Default(SocketAddr),
    /// Set explicitly: a failed bind is fatal.
    Explicit(SocketAddr),
}

/// What became of the auxiliary listener.
#[derive(Debug)]
pub enum AuxListener {
    Bound(TcpListener),
    Disabled,
    /// The default address could not be bound; the reason is in `error`.
    DefaultUnavailable {
        addr: SocketAddr,
        error: std::io::Error,
    },
}

#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {flag} {addr}: {source}")]
pub struct BindError {
    pub flag: String,
    pub addr: SocketAddr,
    #[source]
    pub source: std::io::Error,
}

#[cfg(feature = "mutants")]
pub static MUTANT_FATAL_DEFAULT_BIND: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

fn default_bind_is_fatal() -> bool {
    #[cfg(feature = "mutants")]
    if MUTANT_FATAL_DEFAULT_BIND.load(std::sync::atomic::Ordering::Relaxed) {
        return true;
    }
    false
}

/// Bind `addr` for `flag` under the policy above. A default that cannot be
/// bound is logged at WARN here, naming the flag that fixes it.
pub async fn bind_aux(flag: &str, addr: AuxAddr) -> Result<AuxListener, BindError> {
    let (addr, explicit) = match addr {
        AuxAddr::Disabled => return Ok(AuxListener::Disabled),
        AuxAddr::Default(a) => (a, default_bind_is_fatal()),
        AuxAddr::Explicit(a) => (a, true),
    };
    match TcpListener::bind(addr).await {
        Ok(listener) => Ok(AuxListener::Bound(listener)),
        Err(source) if explicit => Err(BindError {
            flag: flag.to_string(),
            addr,
            source,
        }),
        Err(error) => {
            tracing::warn!(
                addr = %addr,
                error = %error,
                "NO METRICS OR PROBES: the default {flag} {addr} cannot be bound; serving without \
                 /metrics, /healthz and /readyz. Set {flag} to a free address (a failure is then \
                 fatal) or to \"\" to switch the listener off"
            );
            Ok(AuxListener::DefaultUnavailable { addr, error })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_taken_default_is_a_warning_and_a_taken_explicit_address_is_fatal() {
        let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let taken = holder.local_addr().unwrap();
        match bind_aux("--metrics-addr", AuxAddr::Default(taken)).await {
            Ok(AuxListener::DefaultUnavailable { addr, .. }) => assert_eq!(addr, taken),
            other => panic!("default: {other:?}"),
        }
        let err = bind_aux("--metrics-addr", AuxAddr::Explicit(taken))
            .await
            .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("--metrics-addr") && text.contains(&taken.to_string()),
            "{text}"
        );
        assert!(matches!(
            bind_aux("--metrics-addr", AuxAddr::Disabled).await,
            Ok(AuxListener::Disabled)
        ));
        let free: SocketAddr = "127.0.0.1:0".parse().unwrap();
        assert!(matches!(
            bind_aux("--metrics-addr", AuxAddr::Default(free)).await,
            Ok(AuxListener::Bound(_))
        ));
    }
}
