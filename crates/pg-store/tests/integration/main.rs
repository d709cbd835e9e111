//! pg-store's integration tests, one binary (each file a module): the
//! shared `Store` contract on PostgreSQL, and what only this store shows
//! (its schema, a lost commit answer, dropped connections, the leader
//! lease).
//!
//! They need a PostgreSQL server: its URL in `BIGFLEET_TEST_POSTGRES_URL`
//! (`scripts/pg-throwaway.sh run -- cargo test -p pg-store` starts a
//! throwaway one). Without it they skip, saying so, except under `CI=true`,
//! where they fail.

mod common;
mod contract;
mod lease;
mod store;
