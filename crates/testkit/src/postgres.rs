//! The PostgreSQL test server: its URL from the one variable every
//! PostgreSQL test reads, and a schema of its own per test (through the
//! URL's `search_path`), dropped when the test ends, with the test's own
//! `application_name` so a test can end its own connections without
//! touching another test's.
//!
//! Without the variable the tests skip, saying how to run them; under
//! `CI=true` they fail instead.

use std::sync::atomic::{AtomicU64, Ordering};

/// The one variable the PostgreSQL tests read.
pub const URL_VAR: &str = "BIGFLEET_TEST_POSTGRES_URL";

/// The test server's URL; `None` (with a line saying how to run the tests)
/// when it is not set; a panic when it is not set under `CI=true`.
pub fn url() -> Option<String> {
    match std::env::var(URL_VAR) {
        Ok(url) if !url.is_empty() => Some(url),
        _ if std::env::var("CI").as_deref() == Ok("true") => panic!(
            "{URL_VAR} is not set under CI=true: the PostgreSQL tests must run \
             (scripts/pg-throwaway.sh run -- cargo test ...)"
        ),
        _ => {
            crate::skip::report(
                &crate::skip::current_test(),
                &format!(
                    "{URL_VAR} is not set; run the tests under `scripts/pg-throwaway.sh run -- \
                     cargo test ...` (needs PostgreSQL's server binaries) to run the PostgreSQL \
                     tests"
                ),
            );
            None
        }
    }
}

/// A schema of one test's own in the test server.
pub struct TestSchema {
    admin_url: String,
    /// The CA the server's certificate chains to, when it speaks TLS (the
    /// URL's `sslrootcert`, which `scripts/pg-throwaway.sh` sets).
    pub ca_file: Option<String>,
    /// The schema's (and the connections' application) name.
    pub name: String,
    /// The server's URL with this schema first on the search path.
    pub url: String,
}

/// A fresh, empty schema, or `None` when the tests skip.
pub fn fresh() -> Option<TestSchema> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let url_var = url()?;
    // libpq's sslrootcert is not the client library's: the test's own
    // connections (plain) go without it, the store's keep it.
    let (base, query) = url_var.split_once('?').unwrap_or((&url_var, ""));
    let mut ca_file = None;
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| match pair.strip_prefix("sslrootcert=") {
            Some(path) => {
                ca_file = Some(path.to_string());
                false
            }
            None => !pair.is_empty(),
        })
        .collect();
    let admin_url = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let name = format!(
        "bf_test_{}_{nanos}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let sep = if url_var.contains('?') { '&' } else { '?' };
    let url = format!("{url_var}{sep}options=-c%20search_path%3D{name}&application_name={name}");
    let schema = TestSchema {
        admin_url,
        ca_file,
        name,
        url,
    };
    schema.admin(&format!("CREATE SCHEMA {}", schema.name));
    Some(schema)
}

impl TestSchema {
    /// Run `sql` on a connection of the test's own, in this schema.
    pub fn admin(&self, sql: &str) {
        let sql = format!("SET search_path = {}; {sql}", self.name);
        self.with_client(move |client| async move {
            client
                .batch_execute(&sql)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
        });
    }

    /// The value of `sql` (one integer) in this schema.
    pub fn query_i64(&self, sql: &str) -> i64 {
        let search_path = format!("SET search_path = {}", self.name);
        let sql = format!("SELECT ({sql})::int8");
        let (tx, rx) = std::sync::mpsc::channel();
        self.with_client(move |client| async move {
            client
                .batch_execute(&search_path)
                .await
                .expect("search_path");
            let value: i64 = client
                .query_one(&sql, &[])
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"))
                .get(0);
            tx.send(value).expect("the caller waits");
        });
        rx.recv().expect("a value")
    }

    /// End every connection opened with this schema's URL (a database
    /// restart, a proxy dropping them) and wait until they are gone.
    pub fn terminate_connections(&self) {
        self.admin(&format!(
            "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity
             WHERE application_name = '{}' AND pid <> pg_backend_pid()",
            self.name
        ));
    }

    /// Start a transaction on a connection of its own, run `sql` in it (in
    /// this schema), and keep it open until [`HeldTransaction::commit`]:
    /// a peer that holds its locks mid-transaction. Returns once `sql` ran.
    pub fn hold(&self, sql: &str) -> HeldTransaction {
        let url = self.admin_url.clone();
        let sql = format!("BEGIN; SET LOCAL search_path = {}; {sql}", self.name);
        let (ran_tx, ran) = std::sync::mpsc::channel();
        let (finish, finish_rx) = tokio::sync::oneshot::channel::<bool>();
        let thread = spawn_with_client(url, move |client| async move {
            client
                .batch_execute(&sql)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
            ran_tx.send(()).expect("the caller waits");
            // Dropped without a word (the test failed): roll back.
            let end = match finish_rx.await {
                Ok(true) => "COMMIT",
                _ => "ROLLBACK",
            };
            client
                .batch_execute(end)
                .await
                .unwrap_or_else(|e| panic!("{end}: {e}"));
        });
        if ran.recv().is_err() {
            // The thread panicked before the statements ran: say why.
            if let Err(panic) = thread.join() {
                std::panic::resume_unwind(panic);
            }
            panic!("the held transaction ended before it ran");
        }
        HeldTransaction {
            finish: Some(finish),
            thread: Some(thread),
        }
    }

    /// Lock requests in the server that wait on an advisory lock of the
    /// two-key form `(class, object)`, with `object` an SQL expression
    /// evaluated in this schema (as `'t'::regclass::oid`).
    pub fn advisory_lock_waiters(&self, class: u32, object: &str) -> i64 {
        self.query_i64(&format!(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
             AND classid = {class}::oid AND objid = ({object})::oid AND objsubid = 2"
        ))
    }

    /// Run `work` with a fresh client on a runtime of its own (callers may
    /// be inside another runtime or not).
    fn with_client<F, Fut>(&self, work: F)
    where
        F: FnOnce(tokio_postgres::Client) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()>,
    {
        let thread = spawn_with_client(self.admin_url.clone(), work);
        if let Err(panic) = thread.join() {
            std::panic::resume_unwind(panic);
        }
    }
}

/// A thread with a runtime of its own that runs `work` with a fresh client
/// connected to `url`.
fn spawn_with_client<F, Fut>(url: String, work: F) -> std::thread::JoinHandle<()>
where
    F: FnOnce(tokio_postgres::Client) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"));
            tokio::spawn(connection);
            work(client).await;
        });
    })
}

/// A transaction [`TestSchema::hold`] keeps open; dropped, it rolls back.
pub struct HeldTransaction {
    finish: Option<tokio::sync::oneshot::Sender<bool>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HeldTransaction {
    /// Commit it and wait until the commit is done.
    pub fn commit(mut self) {
        self.end(true);
    }

    fn end(&mut self, commit: bool) {
        if let Some(finish) = self.finish.take() {
            // Gone only if the thread panicked: the join below says so.
            let _ = finish.send(commit);
        }
        if let Some(thread) = self.thread.take() {
            if let Err(panic) = thread.join() {
                if !std::thread::panicking() {
                    std::panic::resume_unwind(panic);
                }
            }
        }
    }
}

impl Drop for HeldTransaction {
    fn drop(&mut self) {
        self.end(false);
    }
}

impl Drop for TestSchema {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.admin(&format!("DROP SCHEMA {} CASCADE", self.name));
        }
    }
}
