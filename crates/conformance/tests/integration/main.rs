//! The conformance crate's integration tests, one binary (each file a
//! module): the registry's well-formedness, the harness's TLS dialling,
//! and end-to-end runs of the runner's lanes. The mutation check (built
//! with the `mutants` feature, run by name by `make mutation-check`) and
//! the upstream-baseline test (it sets process environment variables)
//! stay binaries of their own.

mod lanes;
mod registry;
mod tls;
