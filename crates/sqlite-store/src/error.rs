//! Turning I/O and SQLite failures into [`StoreError`]s whose message names
//! the state file, what was being done, the cause in plain words and, where
//! there is one, the fix.

use std::io;
use std::path::Path;

use providerkit::{StoreError, StoreErrorKind};
use rusqlite::ErrorCode;

/// The fix for a file that is not (or no longer) a usable state database.
pub(crate) const NOT_A_STATE_FIX: &str =
    "move it away (or restore a backup) or point --state at a new path";

/// The directory holding the state file (`.` for a bare file name).
pub(crate) fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// A message naming the state file, the action and a readable cause.
pub(crate) fn io_error(path: &Path, action: &str, e: io::Error) -> StoreError {
    let dir = parent_dir(path).display();
    let (kind, cause) = match e.raw_os_error() {
        Some(libc::EACCES) | Some(libc::EPERM) => (
            StoreErrorKind::Inaccessible,
            format!("permission denied (directory {dir} or the file is not writable by this user)"),
        ),
        Some(libc::EROFS) => (
            StoreErrorKind::Inaccessible,
            format!("directory {dir} is on a read-only filesystem"),
        ),
        Some(libc::ENOENT) => (
            StoreErrorKind::Inaccessible,
            format!("directory {dir} does not exist"),
        ),
        Some(libc::ENOTDIR) => (
            StoreErrorKind::Inaccessible,
            format!("a component of {dir} is not a directory"),
        ),
        Some(libc::EISDIR) => (
            StoreErrorKind::Inaccessible,
            "the path is a directory".to_string(),
        ),
        Some(libc::ENOSPC) => (
            StoreErrorKind::Unavailable,
            "no space left on the device".to_string(),
        ),
        _ => (StoreErrorKind::Unavailable, "I/O error".to_string()),
    };
    StoreError::new(
        kind,
        format!("state file {}: {action}: {cause} ({e})", path.display()),
    )
    .with_source(e)
}

/// The file is not a state database this build can read.
pub(crate) fn invalid(path: &Path, detail: impl std::fmt::Display) -> StoreError {
    StoreError::corrupt(format!(
        "state file {} is not a valid state database: {detail}; {NOT_A_STATE_FIX}",
        path.display()
    ))
}

/// Another process holds the state.
pub(crate) fn in_use(path: &Path, pid: Option<u32>) -> StoreError {
    let who = match pid {
        Some(pid) => format!(" (pid {pid})"),
        None => String::new(),
    };
    StoreError::locked(format!(
        "state file {} is in use by another provider process{who}; stop that process \
         or point --state at another path",
        path.display()
    ))
}

pub(crate) fn sql_error(path: &Path, action: &str, e: rusqlite::Error) -> StoreError {
    let p = path.display();
    let error = match e.sqlite_error_code() {
        Some(ErrorCode::NotADatabase) | Some(ErrorCode::DatabaseCorrupt) => invalid(path, &e),
        // The OS lock on the file keeps other processes out, so a busy
        // database means one that ignores locks (an old build, a tool).
        Some(ErrorCode::DatabaseBusy) | Some(ErrorCode::DatabaseLocked) => StoreError::locked(
            format!("state file {p}: {action}: the database is locked by another process ({e})"),
        ),
        Some(ErrorCode::ReadOnly) => StoreError::inaccessible(format!(
            "state file {p}: {action}: the file or its filesystem is read-only ({e})"
        )),
        Some(ErrorCode::DiskFull) => StoreError::unavailable(format!(
            "state file {p}: {action}: no space left on the device ({e})"
        )),
        Some(ErrorCode::CannotOpen) | Some(ErrorCode::PermissionDenied) => {
            StoreError::inaccessible(format!(
                "state file {p}: {action}: cannot open the file or its journal in {} ({e})",
                parent_dir(path).display()
            ))
        }
        _ => StoreError::unavailable(format!("state file {p}: {action}: {e}")),
    };
    error.with_source(e)
}
