//! The shared `Store` contract (provider-testkit's `store_contract`) on
//! PostgreSQL: each case gets a schema of its own.

provider_testkit::store_contract_tests!(crate::common::fresh());
