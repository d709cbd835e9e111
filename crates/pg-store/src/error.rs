//! Turning client, pool and server failures into [`StoreError`]s whose
//! message names the database, what was being done and the cause, and
//! whose kind says how a caller should react.

use deadpool_postgres::PoolError;
use providerkit::{StoreError, StoreErrorKind};
use tokio_postgres::error::SqlState;

/// A failure of the client library or the server while doing `action`.
pub(crate) fn pg_error(target: &str, action: &str, e: tokio_postgres::Error) -> StoreError {
    if password_missing(&e) {
        // The client's own words, "invalid configuration: password
        // missing", name neither the flag nor the variables that supply it.
        return StoreError::new(
            StoreErrorKind::Inaccessible,
            format!(
                "PostgreSQL state {target}: {action}: the server asks for a password and none \
                 was given: put it in a file and pass --state-password-file, or set PGPASSWORD, \
                 or add a line for this server to the password file (PGPASSFILE, default \
                 ~/.pgpass)"
            ),
        )
        .with_source(e);
    }
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

/// The client was asked for a password it does not have: tokio-postgres
/// says so only in the text of a configuration error.
fn password_missing(e: &tokio_postgres::Error) -> bool {
    e.as_db_error().is_none()
        && std::error::Error::source(e).is_some_and(|cause| cause.to_string() == "password missing")
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A server that answers any startup message with "send your password
    /// in clear text" (AuthenticationCleartextPassword), the way a role
    /// with a password under `password` authentication is asked.
    async fn asks_for_a_password() -> u16 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut startup = [0u8; 512];
            let _ = conn.read(&mut startup).await;
            let _ = conn.write_all(&[b'R', 0, 0, 0, 8, 0, 0, 0, 3]).await;
            let _ = conn.read(&mut startup).await;
        });
        port
    }

    #[tokio::test]
    async fn a_missing_password_names_where_to_put_it() {
        let port = asks_for_a_password().await;
        let mut config = tokio_postgres::Config::new();
        config.host("127.0.0.1").port(port).user("bf").dbname("bf");
        let e = config
            .connect(tokio_postgres::NoTls)
            .await
            .err()
            .expect("no password to give");
        let err = pg_error("bf@127.0.0.1/bf", "connecting", e);
        assert_eq!(err.kind(), StoreErrorKind::Inaccessible);
        let text = err.to_string();
        for named in ["--state-password-file", "PGPASSWORD", "PGPASSFILE"] {
            assert!(text.contains(named), "{named}: {text}");
        }
        assert!(
            text.starts_with("PostgreSQL state bf@127.0.0.1/bf: connecting: the server asks"),
            "{text}"
        );
    }
}
