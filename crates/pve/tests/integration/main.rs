//! pve's integration tests, one binary (each file a module) against
//! in-test HTTPS servers: the endpoints, placement calls and TLS trust.
//! The fuzz targets stay a binary of their own (`make fuzz` runs it by
//! name).

mod common;

mod api;
mod placement;
mod tls;
