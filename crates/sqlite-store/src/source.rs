//! A state file read without writing to it: the source of `state copy`.
//!
//! Opening a state the usual way takes its lock (a `.lock` file beside it),
//! migrates an older schema in place and may import the reference's JSON
//! state; a source must come out of a copy byte for byte as it went in, so
//! a rollback to the release that wrote it still reads it. So the source
//! is read through a private copy: under a shared `flock` of the source
//! (which a serving provider's exclusive lock refuses, and which keeps one
//! from starting meanwhile), the database and its WAL are copied into a
//! temporary directory, and that copy is opened, migrated and read. Nothing
//! is created beside the source, and the copy goes with this value.

use std::fs::File;
use std::path::{Path, PathBuf};

use providerkit::{Loaded, StateDump, StateSource, StoreError};
use rustix::fs::{flock, FlockOperation};

use crate::schema::sibling;
use crate::SqliteStore;

/// The state at a path, read through a private copy (see the module docs).
pub struct ReadOnlySource {
    path: PathBuf,
    copy: SqliteStore,
    // After `copy`: the store closes before its directory goes.
    _dir: tempfile::TempDir,
    _shared: File,
}

impl ReadOnlySource {
    /// Copy the state at `path` aside and open the copy. Refused while a
    /// provider holds the state (its lock is exclusive).
    pub fn open(path: &Path) -> Result<ReadOnlySource, StoreError> {
        let named = |what: &str, e: std::io::Error| {
            StoreError::inaccessible(format!("state file {}: {what}: {e}", path.display()))
                .with_source(e)
        };
        let source = File::open(path).map_err(|e| named("cannot open it to read", e))?;
        match flock(&source, FlockOperation::NonBlockingLockShared) {
            Ok(()) => {}
            Err(e) if e == rustix::io::Errno::WOULDBLOCK => {
                return Err(StoreError::locked(format!(
                    "state file {} is in use by another provider process; stop it before copying \
                     its state",
                    path.display()
                )))
            }
            Err(e) => return Err(named("cannot lock it to read", e.into())),
        }
        let dir = tempfile::Builder::new()
            .prefix("bigfleet-state-copy-")
            .tempdir()
            .map_err(|e| named("cannot make a directory for its read copy", e))?;
        let copy_path = dir.path().join("state.db");
        std::fs::copy(path, &copy_path).map_err(|e| named("cannot copy it aside", e))?;
        let wal = sibling(path, "-wal");
        if wal.exists() {
            std::fs::copy(&wal, sibling(&copy_path, "-wal"))
                .map_err(|e| named("cannot copy its write-ahead log aside", e))?;
        }
        let copy = SqliteStore::open(&copy_path).map_err(|e| {
            // Its messages name the copy: name the source instead.
            let message = e.message().replace(
                &copy_path.display().to_string(),
                &path.display().to_string(),
            );
            StoreError::new(e.kind(), message).with_source(e)
        })?;
        Ok(ReadOnlySource {
            path: path.to_path_buf(),
            copy,
            _dir: dir,
            _shared: source,
        })
    }
}

impl StateSource for ReadOnlySource {
    fn read(&self) -> Result<Loaded, StoreError> {
        self.copy.dump()
    }

    /// `sqlite:PATH`, the source's path (not the copy's).
    fn describe(&self) -> String {
        format!("sqlite:{}", self.path.display())
    }
}
