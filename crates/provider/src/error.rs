//! The typed errors of start-up: [`ConfigError`] for validation (the
//! `error` field of the `invalid configuration` line) and [`StartupError`]
//! for what a valid configuration can still meet before the provider serves
//! (the `error` field of the `startup failed` line). Each one's `Display`
//! is the whole operator-facing message, naming the flag and the fix;
//! `source()` carries the cause (an I/O error, a parse error, a TLS error,
//! the store's or the substrate's error) for callers that classify.

use std::error::Error as StdError;
use std::net::SocketAddr;
use std::path::PathBuf;

type Cause = Box<dyn StdError + Send + Sync + 'static>;

/// What is wrong with a configuration, for callers that react to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigErrorKind {
    /// A flag is missing, malformed, out of range or conflicts with another.
    Invalid,
    /// A file a flag names cannot be read.
    Unreadable,
    /// A file a flag names was read, but its content is unusable.
    Malformed,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A flag's value, or a combination of flags, is not allowed.
    #[error("{message}")]
    Invalid {
        message: String,
        #[source]
        source: Option<Cause>,
    },
    /// A file a flag names cannot be read.
    #[error("cannot read {flag} {}: {source}", path.display())]
    Read {
        flag: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A file a flag names holds something unusable.
    #[error("{message}")]
    Malformed {
        message: String,
        #[source]
        source: Option<Cause>,
    },
    /// The catalog, the offerings, the prices or the Proxmox options.
    #[error(transparent)]
    Backend(#[from] proxmox_backend::ConfigError),
}

impl ConfigError {
    /// A flag problem with no underlying cause.
    pub fn invalid(message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            message: message.into(),
            source: None,
        }
    }

    /// A flag problem found by another parser (`cause`).
    pub fn invalid_because(message: impl Into<String>, cause: impl Into<Cause>) -> ConfigError {
        ConfigError::Invalid {
            message: message.into(),
            source: Some(cause.into()),
        }
    }

    /// A file's content is unusable; `cause` is what its parser said.
    pub fn malformed(message: impl Into<String>, cause: Option<Cause>) -> ConfigError {
        ConfigError::Malformed {
            message: message.into(),
            source: cause,
        }
    }

    pub fn kind(&self) -> ConfigErrorKind {
        match self {
            ConfigError::Invalid { .. } => ConfigErrorKind::Invalid,
            ConfigError::Read { .. } => ConfigErrorKind::Unreadable,
            ConfigError::Malformed { .. } => ConfigErrorKind::Malformed,
            ConfigError::Backend(proxmox_backend::ConfigError::Read { .. }) => {
                ConfigErrorKind::Unreadable
            }
            ConfigError::Backend(proxmox_backend::ConfigError::Parse { .. }) => {
                ConfigErrorKind::Malformed
            }
            ConfigError::Backend(_) => ConfigErrorKind::Invalid,
        }
    }
}

/// Why a valid configuration could not start serving. Wrapped errors that
/// already say everything (a bind, the store, the engine) print as they
/// are; the others say what was being done, then the cause.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    /// A SIGINT/SIGTERM handler could not be installed.
    #[error("cannot install the {signal} handler: {source}")]
    Signal {
        signal: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// A listen address could not be bound (a port in use, say).
    #[error(transparent)]
    Bind(#[from] providerkit::BindError),
    /// A bound listener could not say its own address.
    #[error("{flag}: {source}")]
    LocalAddr {
        flag: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The `--state` store could not be opened.
    #[error(transparent)]
    Store(#[from] providerkit::StoreError),
    /// The Proxmox API client refused its settings.
    #[error("cannot set up the Proxmox API client: {0}")]
    ProxmoxClient(#[source] pve::PveError),
    /// The cluster failed the start-up check (token, nodes, templates).
    #[error("Proxmox preflight failed: {0}")]
    Preflight(#[source] proxmox_backend::substrate::SubstrateError),
    /// The engine could not load the state or describe the inventory.
    #[error(transparent)]
    Engine(#[from] providerkit::StartError),
    /// gRPC reflection could not be built from the embedded descriptors.
    #[error("reflection setup failed: {0}")]
    Reflection(#[source] tonic_reflection::server::Error),
}

impl StartupError {
    /// A bind of `flag` at `addr` that failed.
    pub fn bind(flag: &str, addr: SocketAddr, source: std::io::Error) -> StartupError {
        StartupError::Bind(providerkit::BindError {
            flag: flag.to_string(),
            addr,
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_is_the_message_and_the_cause_is_kept() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "gone");
        let e = ConfigError::Read {
            flag: "--tls-key",
            path: "/k.pem".into(),
            source: io,
        };
        assert_eq!(e.to_string(), "cannot read --tls-key /k.pem: gone");
        assert_eq!(e.kind(), ConfigErrorKind::Unreadable);
        assert!(e.source().is_some());
        let e = ConfigError::invalid("--provider must not be empty");
        assert_eq!(e.to_string(), "--provider must not be empty");
        assert_eq!(e.kind(), ConfigErrorKind::Invalid);
        assert!(e.source().is_none());
        let e: ConfigError = proxmox_backend::ConfigError::Invalid("no offerings".into()).into();
        assert_eq!(e.to_string(), "no offerings");
        assert_eq!(e.kind(), ConfigErrorKind::Invalid);
    }

    #[test]
    fn startup_errors_read_as_the_startup_line_and_keep_the_cause() {
        let in_use = || std::io::Error::new(std::io::ErrorKind::AddrInUse, "address in use");
        let addr: SocketAddr = "127.0.0.1:9000".parse().unwrap();
        let e = StartupError::bind("--addr", addr, in_use());
        assert_eq!(
            e.to_string(),
            "cannot listen on --addr 127.0.0.1:9000: address in use"
        );
        assert!(
            matches!(&e, StartupError::Bind(b) if b.source.kind() == std::io::ErrorKind::AddrInUse)
        );

        let e = StartupError::Signal {
            signal: "SIGTERM",
            source: in_use(),
        };
        assert_eq!(
            e.to_string(),
            "cannot install the SIGTERM handler: address in use"
        );
        assert!(e.source().is_some());

        let store = providerkit::StoreError::locked("state file /s is in use");
        let e = StartupError::from(store);
        assert_eq!(e.to_string(), "state file /s is in use");
        assert!(
            matches!(&e, StartupError::Store(s) if s.kind() == providerkit::StoreErrorKind::Locked)
        );

        let e = StartupError::Preflight(proxmox_backend::substrate::SubstrateError::new(
            "the API token was refused (401)",
        ));
        assert_eq!(
            e.to_string(),
            "Proxmox preflight failed: the API token was refused (401)"
        );
        assert!(e
            .source()
            .is_some_and(|s| s.is::<proxmox_backend::substrate::SubstrateError>()));
    }
}
