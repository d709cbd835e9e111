//! The engine's error type and its mapping onto gRPC codes.

use tonic::{Code, Status};

use crate::model::TransitionError;
use crate::store::StoreError;

/// Why the engine refused or failed a request. Each variant maps to exactly
/// one gRPC code; `Fenced` is the only one that becomes FAILED_PRECONDITION.
///
/// A refusal the engine words itself carries its message; one caused by
/// another part (the record's transition rules, the store) carries that
/// part's typed error as its source, and prints its text unchanged so the
/// RPC status message stays the operator-facing one.
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
    Conflict(#[source] TransitionError),
    #[error("state store: {0}")]
    Store(#[source] StoreError),
    /// A mutation whose acceptance the store could not commit: withdrawn,
    /// the machine is as it was.
    #[error(
        "the state store could not commit this {}: {source}; nothing was changed, the machine \
         is as it was: retry (with a new fencing token) once the store commits again (/readyz \
         answers ready)",
        kind.name()
    )]
    NotCommitted {
        kind: crate::model::TransitionKind,
        #[source]
        source: StoreError,
    },
    /// A Create the substrate has no room for now
    /// ([`crate::Backend::admit_create`] refused it): nothing was accepted.
    #[error("{0}")]
    Exhausted(#[source] crate::backend::BackendError),
    /// A mutation that arrived after shutdown began: another replica, or
    /// this one after its restart, takes it.
    #[error("{0}")]
    ShuttingDown(String),
}

impl KitError {
    pub fn code(&self) -> Code {
        match self {
            KitError::InvalidArgument(_) => Code::InvalidArgument,
            KitError::NotFound(_) => Code::NotFound,
            KitError::Fenced(_) => Code::FailedPrecondition,
            KitError::Unimplemented(_) => Code::Unimplemented,
            KitError::Conflict(_) => Code::Aborted,
            KitError::Exhausted(_) => Code::ResourceExhausted,
            KitError::Store(_) | KitError::NotCommitted { .. } => Code::Unavailable,
            KitError::ShuttingDown(_) => Code::Unavailable,
        }
    }
}

impl From<KitError> for Status {
    fn from(err: KitError) -> Status {
        Status::new(err.code(), err.to_string())
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;
    use crate::model::{State, TransitionKind};

    #[test]
    fn causes_are_kept_and_the_text_is_theirs() {
        let store = StoreError::unavailable("disk full");
        let err = KitError::Store(store.clone());
        assert_eq!(err.to_string(), "state store: disk full");
        let source = err.source().and_then(|s| s.downcast_ref::<StoreError>());
        assert_eq!(source, Some(&store));
        assert_eq!(Status::from(err).code(), Code::Unavailable);

        let refusal = TransitionError::OutOfPosition {
            id: "m".into(),
            state: State::Idle,
            kind: TransitionKind::Drain,
        };
        let err = KitError::Conflict(refusal.clone());
        assert_eq!(err.to_string(), refusal.to_string());
        let source = err
            .source()
            .and_then(|s| s.downcast_ref::<TransitionError>());
        assert_eq!(source, Some(&refusal));
        assert_eq!(Status::from(err).code(), Code::Aborted);
    }
}
