//! sqlite-store's integration tests, one binary (each file a module): the
//! store itself, what `open` finds at the path, the reference import, and
//! the engine surviving a restart on it. The fuzz targets stay a binary of
//! their own (`make fuzz` runs it by name).

mod engine;
mod reference_import;
mod state_files;
mod store;
