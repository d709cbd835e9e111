//! providerkit's integration tests, one binary (each file a module): the
//! engine's rules, the List budget, and the way out of FAILED.

mod engine;
mod list_budget;
mod reclaim;
