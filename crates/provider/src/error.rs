//! The typed error of start-up validation. Its `Display` is the whole
//! operator-facing message (the `error` field of the `invalid
//! configuration` line), naming the flag and the fix; `source()` carries
//! the cause (an I/O error, a parse error, a TLS error) for callers that
//! classify.

use std::error::Error as StdError;
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
}
