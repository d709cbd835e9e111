//! One writer per state: an exclusive `flock` on the database file itself.
//!
//! The lock lives on the file SQLite writes, so there is no separate file
//! whose removal would let a second process in; the kernel drops it when the
//! holder dies (kill -9 included). SQLite's own locks are POSIX record locks
//! (`fcntl`), which on Linux are independent of `flock`, so holding both on
//! one file works. The descriptor stays open for the life of the store: the
//! store never closes another descriptor of the database while SQLite uses
//! it (which would drop SQLite's record locks).
//!
//! A second opener in the same process is refused before it opens the
//! file at all (from a table of states this process holds): closing its
//! descriptor after a failed `flock` would drop the first store's SQLite
//! record locks, which belong to the process, not to a descriptor.
//!
//! `<path>.lock` is kept as well, for two reasons only: it records the
//! owner's pid for the "in use" message, and builds before this one took
//! their lock on it, so locking it too keeps such a build and this one from
//! sharing a state during an upgrade. Deleting it lets no one in.

use std::collections::HashSet;
use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use providerkit::StoreError;
use rustix::fs::{flock, FlockOperation};

use crate::error::{in_use, io_error};

/// States (device, inode) this process holds.
static HELD: Mutex<Option<HashSet<(u64, u64)>>> = Mutex::new(None);

/// Held for the life of a store; dropping it releases the state.
pub(crate) struct StateLock {
    db: File,
    _pid_file: File,
    key: (u64, u64),
    /// `<path>.lock` when this open created it, until [`StateLock::keep`]:
    /// an open that is refused afterwards (an empty or foreign file) must
    /// leave nothing new beside the file it refused.
    created_pid_file: Option<PathBuf>,
}

impl Drop for StateLock {
    fn drop(&mut self) {
        if let Some(pid_path) = self.created_pid_file.take() {
            // Best effort: a leftover lock file lets no one in (see above).
            let _ = std::fs::remove_file(pid_path);
        }
        if let Some(held) = HELD.lock().as_mut() {
            held.remove(&self.key);
        }
    }
}

impl StateLock {
    /// The open succeeded: `<path>.lock` stays when the lock is released.
    pub(crate) fn keep(&mut self) {
        self.created_pid_file = None;
    }

    /// The locked database file (open read-write).
    pub(crate) fn file(&self) -> &File {
        &self.db
    }

    /// Move the lock to `file`, which is about to replace the locked file
    /// at `path` (an import): it is locked before the old one is let go.
    pub(crate) fn adopt(&mut self, path: &Path, file: File) -> Result<(), StoreError> {
        flock(&file, FlockOperation::NonBlockingLockExclusive).map_err(|e| {
            io_error(
                path,
                "cannot lock the imported database",
                io::Error::from(e),
            )
        })?;
        let meta = file
            .metadata()
            .map_err(|e| io_error(path, "cannot inspect the imported database", e))?;
        let key = (meta.dev(), meta.ino());
        let mut held = HELD.lock();
        let held = held.get_or_insert_with(HashSet::new);
        held.remove(&self.key);
        held.insert(key);
        self.key = key;
        self.db = file;
        Ok(())
    }
}

/// `<path>.lock`: the owner's pid, and the lock older builds take.
pub(crate) fn pid_path(path: &Path) -> PathBuf {
    let mut name = OsString::from(path.as_os_str());
    name.push(".lock");
    PathBuf::from(name)
}

/// Lock the existing database file at `path`, refusing if another process
/// holds it, and record our pid.
pub(crate) fn acquire(path: &Path) -> Result<StateLock, StoreError> {
    // Held throughout, so two threads of this process cannot both get past
    // the check. `stat` opens no descriptor (see the module comment).
    let mut held = HELD.lock();
    let held = held.get_or_insert_with(HashSet::new);
    if let Ok(meta) = std::fs::metadata(path) {
        if held.contains(&(meta.dev(), meta.ino())) {
            return Err(in_use(path, Some(std::process::id())));
        }
    }
    let db = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| io_error(path, "cannot open", e))?;
    let meta = db
        .metadata()
        .map_err(|e| io_error(path, "cannot inspect", e))?;
    if !meta.is_file() {
        return Err(StoreError::inaccessible(format!(
            "state file {}: not a regular file; point --state at a file path",
            path.display()
        )));
    }
    match flock(&db, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(e) if e == rustix::io::Errno::WOULDBLOCK => {
            // The kernel's answer when it is certain, then the pid file,
            // then a match on the inode alone.
            let (exact, loose) = holder_pid(&meta);
            let pid = exact.or_else(|| recorded_pid(path)).or(loose);
            return Err(in_use(path, pid));
        }
        Err(e) => return Err(io_error(path, "cannot lock", e.into())),
    }
    // Under the lock, so a second opener never changes modes under us.
    if meta.permissions().mode() & 0o777 != 0o600 {
        db.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(|e| io_error(path, "cannot restrict permissions to 0600", e))?;
    }
    let key = (meta.dev(), meta.ino());
    let (pid_file, created) = lock_pid_file(path)?;
    held.insert(key);
    Ok(StateLock {
        db,
        _pid_file: pid_file,
        key,
        created_pid_file: created.then(|| pid_path(path)),
    })
}

/// Take `<path>.lock` (refusing an older build that holds it) and write our
/// pid into it; `true` when this call created it.
fn lock_pid_file(path: &Path) -> Result<(File, bool), StoreError> {
    let pid_path = pid_path(path);
    let open = |create_new: bool| {
        let mut options = OpenOptions::new();
        options.read(true).write(true).mode(0o600);
        if create_new {
            options.create_new(true);
        }
        options.open(&pid_path)
    };
    let (file, created) = match open(true) {
        Ok(file) => Ok((file, true)),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => open(false).map(|f| (f, false)),
        Err(e) => Err(e),
    }
    .map_err(|e| {
        io_error(
            path,
            &format!("cannot create lock file {}", pid_path.display()),
            e,
        )
    })?;
    let mut file = file;
    match flock(&file, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(e) if e == rustix::io::Errno::WOULDBLOCK => {
            return Err(in_use(path, read_pid(&mut file)));
        }
        Err(e) => {
            return Err(io_error(
                path,
                &format!("cannot lock {}", pid_path.display()),
                e.into(),
            ))
        }
    }
    let record_pid = |file: &mut File| -> io::Result<()> {
        file.set_len(0)?;
        file.seek(SeekFrom::Start(0))?;
        writeln!(file, "{}", std::process::id())
    };
    record_pid(&mut file)
        .map_err(|e| io_error(path, &format!("cannot write {}", pid_path.display()), e))?;
    Ok((file, created))
}

fn read_pid(file: &mut File) -> Option<u32> {
    let mut text = String::new();
    file.read_to_string(&mut text).ok()?;
    text.trim().parse().ok()
}

/// The pid the current owner wrote into `<path>.lock`, if it is there.
fn recorded_pid(path: &Path) -> Option<u32> {
    read_pid(&mut File::open(pid_path(path)).ok()?)
}

/// The pid holding a `flock` on the file, from the kernel's lock table
/// (Linux `/proc/locks`): right even when `<path>.lock` was deleted or
/// rewritten. Nothing where the table is unavailable.
fn holder_pid(meta: &std::fs::Metadata) -> (Option<u32>, Option<u32>) {
    match std::fs::read_to_string("/proc/locks") {
        Ok(table) => holder_in(&table, meta.dev(), meta.ino()),
        Err(_) => (None, None),
    }
}

/// Lines look like `3: FLOCK  ADVISORY  WRITE 4242 08:01:1234 0 EOF`.
/// Returns the holder matched on device and inode, and failing that the
/// only holder matched on the inode alone: the device listed is the
/// filesystem's, which can differ from `st_dev` (btrfs subvolumes), but an
/// inode number alone may also belong to another filesystem's file.
pub(crate) fn holder_in(table: &str, dev: u64, ino: u64) -> (Option<u32>, Option<u32>) {
    let want_dev = format!(
        "{:02x}:{:02x}",
        rustix::fs::major(dev),
        rustix::fs::minor(dev)
    );
    let mut by_inode = Vec::new();
    for line in table.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // Blocked waiters are listed as `-> FLOCK ...`: skip them.
        if fields.len() < 6 || fields[1] != "FLOCK" || fields[3] != "WRITE" {
            continue;
        }
        // 0: a holder outside our pid namespace, which names no process.
        let Some(pid) = fields[4].parse::<u32>().ok().filter(|p| *p != 0) else {
            continue;
        };
        let Some((device, inode)) = fields[5].rsplit_once(':') else {
            continue;
        };
        if inode.parse::<u64>().ok() != Some(ino) {
            continue;
        }
        if device == want_dev {
            return (Some(pid), None);
        }
        by_inode.push(pid);
    }
    match by_inode.as_slice() {
        [pid] => (None, Some(*pid)),
        _ => (None, None),
    }
}

#[cfg(test)]
mod tests {
    use super::holder_in;

    #[test]
    fn lock_table_lines_name_the_holder() {
        let dev = rustix::fs::makedev(8, 1);
        let table = "1: POSIX  ADVISORY  WRITE 10 08:01:77 1073741824 1073741824\n\
                     2: FLOCK  ADVISORY  WRITE 4242 08:01:77 0 EOF\n\
                     2: -> FLOCK  ADVISORY  WRITE 5151 08:01:77 0 EOF\n\
                     3: FLOCK  ADVISORY  WRITE 99 08:01:78 0 EOF\n";
        assert_eq!(holder_in(table, dev, 77), (Some(4242), None));
        assert_eq!(holder_in(table, dev, 79), (None, None));
        // Another device number, one inode match: a likely holder only.
        assert_eq!(
            holder_in(table, rustix::fs::makedev(0, 40), 78),
            (None, Some(99))
        );
        // A holder outside our pid namespace is listed as 0: no pid.
        let hidden = "1: FLOCK  ADVISORY  WRITE 0 08:01:77 0 EOF\n";
        assert_eq!(holder_in(hidden, dev, 77), (None, None));
    }
}
