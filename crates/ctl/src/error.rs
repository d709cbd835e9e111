//! Why a `ctl` invocation failed: a kind the caller can act on (its exit
//! code) and the one line to print, with the underlying error as source.

use std::error::Error as StdError;

/// What went wrong, at the level an operator or a script reacts to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CtlErrorKind {
    /// A local input is unusable (a file, a flag combination): nothing was
    /// sent, fix the command line.
    Input,
    /// The provider could not be reached or the channel not set up.
    Connect,
    /// The provider (or the transport under the RPC) answered with this
    /// code.
    Rpc(tonic::Code),
    /// The RPC was accepted but the awaited outcome did not come: the
    /// machine landed FAILED, `--wait-timeout` passed, Ctrl-C, or the
    /// machine vanished.
    Outcome,
    /// The answer could not be written to stdout.
    Output,
}

/// A failed `ctl` invocation. `Display` is the whole line to print.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct CtlError {
    kind: CtlErrorKind,
    message: String,
    #[source]
    source: Option<Box<dyn StdError + Send + Sync + 'static>>,
}

impl CtlError {
    pub(crate) fn new(kind: CtlErrorKind, message: impl Into<String>) -> CtlError {
        CtlError {
            kind,
            message: message.into(),
            source: None,
        }
    }

    pub(crate) fn input(message: impl Into<String>) -> CtlError {
        CtlError::new(CtlErrorKind::Input, message)
    }

    pub(crate) fn outcome(message: impl Into<String>) -> CtlError {
        CtlError::new(CtlErrorKind::Outcome, message)
    }

    pub(crate) fn output(message: impl Into<String>) -> CtlError {
        CtlError::new(CtlErrorKind::Output, message)
    }

    /// Attach the underlying error; the message already says what it means.
    pub(crate) fn caused_by(mut self, source: impl StdError + Send + Sync + 'static) -> CtlError {
        self.source = Some(Box::new(source));
        self
    }

    pub fn kind(&self) -> CtlErrorKind {
        self.kind
    }

    /// 2 for a command line to fix (nothing was sent), 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self.kind {
            CtlErrorKind::Input => 2,
            _ => 1,
        }
    }
}
