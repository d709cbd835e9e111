//! Status-code assertions: the code discipline every behavior checks.

use anyhow::{anyhow, bail};
use tonic::{Code, Status};

pub type RpcResult<T> = Result<T, Status>;

/// Which way an RPC is expected to end, for code assertions.
pub fn code_of<T>(r: &RpcResult<T>) -> Option<Code> {
    r.as_ref().err().map(|s| s.code())
}

pub fn describe<T>(r: &RpcResult<T>) -> String {
    match r {
        Ok(_) => "OK".into(),
        Err(s) => format!("{:?}: {}", s.code(), s.message()),
    }
}

/// Requires an error whose code is in `allowed`.
pub fn expect_code<T>(r: &RpcResult<T>, allowed: &[Code], what: &str) -> anyhow::Result<()> {
    match r {
        Err(s) if allowed.contains(&s.code()) => Ok(()),
        other => Err(anyhow!(
            "{what}: expected one of {allowed:?}, got {}",
            describe(other)
        )),
    }
}

/// Requires a rejection that is not FAILED_PRECONDITION (reserved for fencing).
pub fn expect_rejected_not_fp<T>(r: &RpcResult<T>, what: &str) -> anyhow::Result<()> {
    match r {
        Ok(_) => bail!("{what}: expected a rejection, got OK"),
        Err(s) if s.code() == Code::FailedPrecondition => {
            bail!(
                "{what}: rejected with FAILED_PRECONDITION (reserved for fencing): {}",
                s.message()
            )
        }
        Err(_) => Ok(()),
    }
}

pub fn expect_fp<T>(r: &RpcResult<T>, what: &str) -> anyhow::Result<()> {
    expect_code(r, &[Code::FailedPrecondition], what)
}

pub fn expect_ok<T>(r: RpcResult<T>, what: &str) -> anyhow::Result<T> {
    r.map_err(|s| anyhow!("{what}: expected OK, got {:?}: {}", s.code(), s.message()))
}
