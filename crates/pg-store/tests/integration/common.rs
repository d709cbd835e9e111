//! A fresh state per test: a schema of its own in the test database
//! (through the URL's `search_path`), dropped when the test ends, and the
//! test's own `application_name`, so a test can end its own connections
//! without touching another test's.

use pg_store::{PgOptions, PgStore, Target};
use provider_testkit::store_contract::StateUnderTest;

/// The one variable the PostgreSQL tests read.
pub const URL_VAR: &str = "BIGFLEET_TEST_POSTGRES_URL";

/// The test database's URL; `None` (with a line saying how to run the
/// tests) when it is not set, a failure when it is not set under CI.
pub fn url() -> Option<String> {
    match std::env::var(URL_VAR) {
        Ok(url) if !url.is_empty() => Some(url),
        _ if std::env::var("CI").as_deref() == Ok("true") => panic!(
            "{URL_VAR} is not set under CI=true: the PostgreSQL store tests must run \
             (scripts/pg-throwaway.sh run -- cargo test -p pg-store)"
        ),
        _ => {
            eprintln!(
                "skipped: {URL_VAR} is not set; run `scripts/pg-throwaway.sh run -- cargo test -p \
                 pg-store` (needs PostgreSQL's server binaries) to run the PostgreSQL store tests"
            );
            None
        }
    }
}

pub struct PgState {
    admin_url: String,
    pub schema: String,
    pub url: String,
}

/// A fresh, empty state, or `None` when the tests skip.
pub fn fresh() -> Option<PgState> {
    let admin_url = url()?;
    let schema = format!("bf_test_{:016x}", rand::random::<u64>());
    let sep = if admin_url.contains('?') { '&' } else { '?' };
    let url =
        format!("{admin_url}{sep}options=-c%20search_path%3D{schema}&application_name={schema}");
    let state = PgState {
        admin_url,
        schema,
        url,
    };
    state.admin(&format!("CREATE SCHEMA {}", state.schema));
    Some(state)
}

impl PgState {
    /// Run `sql` on a connection of the test's own (not the store's).
    pub fn admin(&self, sql: &str) {
        let url = self.admin_url.clone();
        let sql = sql.to_string();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"));
            tokio::spawn(connection);
            client
                .batch_execute(&sql)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
        });
    }

    /// The first column of the first row `sql` returns, in the test's schema.
    pub fn query_i64(&self, sql: &str) -> i64 {
        let url = self.admin_url.clone();
        let sql = format!("SELECT ({sql})::int8");
        let schema = self.schema.clone();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"));
            tokio::spawn(connection);
            client
                .batch_execute(&format!("SET search_path = {schema}"))
                .await
                .expect("search_path");
            client
                .query_one(&sql, &[])
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"))
                .get(0)
        })
    }

    /// Run `sql` with the test's schema first on the search path.
    pub fn admin_in_schema(&self, sql: &str) {
        self.admin(&format!("SET search_path = {}; {sql}", self.schema));
    }

    /// End every connection the store under test has open (a database
    /// restart, a proxy dropping them) and wait until they are gone.
    pub fn terminate_store_connections(&self) {
        self.admin(&format!(
            "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity
             WHERE application_name = '{}' AND pid <> pg_backend_pid()",
            self.schema
        ));
    }

    pub fn target(&self) -> Target {
        Target::parse(&self.url).unwrap_or_else(|e| panic!("{}: {e}", self.url))
    }

    pub fn try_open(&self) -> Result<PgStore, providerkit::StoreError> {
        PgStore::open(&self.target(), &PgOptions::default())
    }
}

impl Drop for PgState {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.admin(&format!("DROP SCHEMA {} CASCADE", self.schema));
        }
    }
}

impl StateUnderTest for PgState {
    type Store = PgStore;

    fn open(&self) -> PgStore {
        self.try_open()
            .unwrap_or_else(|e| panic!("cannot open {}: {e}", self.url))
    }

    fn commits(store: &PgStore) -> u64 {
        store.commits()
    }

    fn describe_prefix(&self) -> String {
        "postgres://".to_string()
    }

    fn expire_windows(&self) {
        self.admin_in_schema(
            "UPDATE bigfleet_machines SET deadline_ms = started_ms WHERE started_ms IS NOT NULL",
        );
    }

    fn forget_windows(&self) {
        self.admin_in_schema(
            "UPDATE bigfleet_machines SET started_ms = NULL, deadline_ms = NULL, grace_ms = NULL",
        );
    }
}
