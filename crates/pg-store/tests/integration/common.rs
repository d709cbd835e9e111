//! The store under test on a schema of the test's own
//! (provider-testkit's `postgres`).

use pg_store::{PgOptions, PgStore, Target};
use provider_testkit::postgres::TestSchema;
use provider_testkit::store_contract::StateUnderTest;

pub struct PgState {
    pub schema: TestSchema,
}

/// A fresh, empty state, or `None` when the tests skip.
pub fn fresh() -> Option<PgState> {
    provider_testkit::postgres::fresh().map(|schema| PgState { schema })
}

impl PgState {
    pub fn target(&self) -> Target {
        Target::parse(&self.schema.url).unwrap_or_else(|e| panic!("{}: {e}", self.schema.url))
    }

    pub fn try_open(&self) -> Result<PgStore, providerkit::StoreError> {
        PgStore::open(&self.target(), &PgOptions::default())
    }
}

impl StateUnderTest for PgState {
    type Store = PgStore;

    fn open(&self) -> PgStore {
        self.try_open()
            .unwrap_or_else(|e| panic!("cannot open {}: {e}", self.schema.url))
    }

    fn commits(store: &PgStore) -> u64 {
        store.commits()
    }

    fn describe_prefix(&self) -> String {
        "postgres://".to_string()
    }

    fn expire_windows(&self) {
        self.schema.admin(
            "UPDATE bigfleet_machines SET deadline_ms = started_ms WHERE started_ms IS NOT NULL",
        );
    }

    fn forget_windows(&self) {
        self.schema.admin(
            "UPDATE bigfleet_machines SET started_ms = NULL, deadline_ms = NULL, grace_ms = NULL",
        );
    }

    fn set_deadline_ms(&self, id: &str, deadline_ms: u64) {
        // Machine ids in the contract are plain ASCII (`m-2`).
        self.schema.admin(&format!(
            "UPDATE bigfleet_machines SET deadline_ms = {deadline_ms} WHERE id = '{id}'"
        ));
    }
}
