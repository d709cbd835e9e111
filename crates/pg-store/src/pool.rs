//! Connections: the options besides the URL ([`PgOptions`]) and the
//! bounded pools the store and the lease draw from.

use std::path::PathBuf;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use providerkit::StoreError;

use crate::target::{Target, TargetError};

/// How long a caller waits for a pooled connection, and a new connection
/// may take to be made, before the attempt counts as failed.
const POOL_TIMEOUT: Duration = Duration::from_secs(15);

/// How [`crate::PgStore::open`] and [`crate::Lease::connect`] connect,
/// besides the URL.
#[derive(Clone, Debug, Default)]
pub struct PgOptions {
    /// A file holding the password (`--state-password-file`); unset, libpq's
    /// sources are used: `PGPASSWORD`, then `PGPASSFILE` (default
    /// `~/.pgpass`).
    pub password_file: Option<PathBuf>,
    /// The leader lease epoch this replica holds ([`crate::Lease`]): every commit
    /// checks it in its own transaction, so once another replica has taken
    /// the lease nothing of this one is committed. `None`: the store is
    /// written without a lease (tools, tests).
    pub lease_epoch: Option<i64>,
}

/// A bounded pool of connections to `target`, made on demand.
pub(crate) fn build_pool(
    target: &Target,
    options: &PgOptions,
    size: usize,
) -> Result<Pool, StoreError> {
    let name = target.display().to_string();
    let config_error = |e: TargetError| StoreError::inaccessible(e.to_string()).with_source(e);
    let config = target
        .config_with_password(options.password_file.as_deref())
        .map_err(config_error)?;
    let manager_config = ManagerConfig {
        recycling_method: RecyclingMethod::Fast,
    };
    let manager = match target.connector().map_err(config_error)? {
        Some(tls) => Manager::from_config(config, tls, manager_config),
        None => Manager::from_config(config, tokio_postgres::NoTls, manager_config),
    };
    Pool::builder(manager)
        .max_size(size)
        .wait_timeout(Some(POOL_TIMEOUT))
        .create_timeout(Some(POOL_TIMEOUT))
        .recycle_timeout(Some(POOL_TIMEOUT))
        .runtime(Runtime::Tokio1)
        .build()
        .map_err(|e| {
            StoreError::unavailable(format!(
                "PostgreSQL state {name}: cannot build the connection pool: {e}"
            ))
            .with_source(e)
        })
}
