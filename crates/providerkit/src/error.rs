//! The engine's error type and its mapping onto gRPC codes.

use tonic::{Code, Status};

/// Why the engine refused or failed a request. Each variant maps to exactly
/// one gRPC code; `Fenced` is the only one that becomes FAILED_PRECONDITION.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum KitError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Fenced(String),
    #[error("{0}")]
    Unimplemented(String),
    /// Out-of-position transition or a mutation on a FAILED machine.
    #[error("{0}")]
    Conflict(String),
    #[error("state store: {0}")]
    Store(String),
}

impl KitError {
    pub fn code(&self) -> Code {
        match self {
            KitError::InvalidArgument(_) => Code::InvalidArgument,
            KitError::NotFound(_) => Code::NotFound,
            KitError::Fenced(_) => Code::FailedPrecondition,
            KitError::Unimplemented(_) => Code::Unimplemented,
            KitError::Conflict(_) => Code::Aborted,
            KitError::Store(_) => Code::Unavailable,
        }
    }
}

impl From<KitError> for Status {
    fn from(err: KitError) -> Status {
        Status::new(err.code(), err.to_string())
    }
}
