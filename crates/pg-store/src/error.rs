//! Turning client, pool and server failures into [`StoreError`]s whose
//! message names the database, what was being done and the cause, and
//! whose kind says how a caller should react.

use deadpool_postgres::PoolError;
use providerkit::{StoreError, StoreErrorKind};
use tokio_postgres::error::SqlState;

/// A failure of the client library or the server while doing `action`.
pub(crate) fn pg_error(target: &str, action: &str, e: tokio_postgres::Error) -> StoreError {
    let kind = match e.code() {
        Some(code) if is_access(code) => StoreErrorKind::Inaccessible,
        _ => StoreErrorKind::Unavailable,
    };
    let cause = cause_text(&e);
    StoreError::new(
        kind,
        format!("PostgreSQL state {target}: {action}: {cause}"),
    )
    .with_source(e)
}

/// A connection that could not be had from the pool while doing `action`.
pub(crate) fn pool_error(target: &str, action: &str, e: PoolError) -> StoreError {
    match e {
        PoolError::Backend(e) => pg_error(target, action, e),
        other => StoreError::unavailable(format!(
            "PostgreSQL state {target}: {action}: no connection: {other}"
        ))
        .with_source(other),
    }
}

/// Authentication, authorisation and a missing database: the operator's to
/// fix, not a passing outage.
fn is_access(code: &SqlState) -> bool {
    [
        SqlState::INVALID_PASSWORD,
        SqlState::INVALID_AUTHORIZATION_SPECIFICATION,
        SqlState::INSUFFICIENT_PRIVILEGE,
        SqlState::INVALID_CATALOG_NAME,
    ]
    .contains(code)
}

/// The server's own message when there is one (`Display` of the client
/// error says only "db error"), else the client's, with its cause.
fn cause_text(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return format!("{} ({})", db.message(), db.code().code());
    }
    match std::error::Error::source(e) {
        Some(cause) => format!("{e}: {cause}"),
        None => e.to_string(),
    }
}
