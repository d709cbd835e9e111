//! sqlite-store's integration tests, one binary (each file a module): the
//! shared `Store` contract (the engine surviving a restart and resuming
//! what it interrupted among it), what only SQLite shows (its files, its
//! lock, a full disk), what `open` finds at the path, and the reference
//! import. The fuzz targets stay a binary of their own (`make fuzz` runs it
//! by name).

mod contract;
mod reference_import;
mod state_files;
mod store;
