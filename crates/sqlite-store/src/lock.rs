//! One writer per state: an exclusive `flock` on `<path>.lock`, which also
//! records the owner's pid for the "in use" message.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use providerkit::StoreError;

use crate::error::{in_use, io_error};

/// Held for the life of a store; dropping it releases the state.
pub(crate) struct StateLock {
    _file: File,
}

fn lock_path(path: &Path) -> PathBuf {
    let mut name = OsString::from(path.as_os_str());
    name.push(".lock");
    PathBuf::from(name)
}

/// Take the process-level lock on `<path>.lock` and record our pid in it.
pub(crate) fn acquire(path: &Path) -> Result<StateLock, StoreError> {
    let lock_path = lock_path(path);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&lock_path)
        .map_err(|e| {
            io_error(
                path,
                &format!("cannot create lock file {}", lock_path.display()),
                e,
            )
        })?;
    // SAFETY: flock on a file descriptor we own; no memory is involved.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            let mut text = String::new();
            let pid = file
                .read_to_string(&mut text)
                .ok()
                .and_then(|_| text.trim().parse().ok());
            return Err(in_use(path, pid));
        }
        return Err(io_error(
            path,
            &format!("cannot lock {}", lock_path.display()),
            e,
        ));
    }
    let record_pid = |file: &mut File| -> io::Result<()> {
        file.set_len(0)?;
        file.seek(SeekFrom::Start(0))?;
        writeln!(file, "{}", std::process::id())
    };
    record_pid(&mut file)
        .map_err(|e| io_error(path, &format!("cannot write {}", lock_path.display()), e))?;
    Ok(StateLock { _file: file })
}
