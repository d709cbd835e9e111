//! sqlite-store's integration tests, one binary (each file a module): the
//! store itself, what `open` finds at the path, the reference import, the
//! engine surviving a restart on it, and resuming what a restart
//! interrupted. The fuzz targets stay a binary of their own (`make fuzz`
//! runs it by name).

mod engine;
mod reference_import;
mod resume;
mod state_files;
mod store;
