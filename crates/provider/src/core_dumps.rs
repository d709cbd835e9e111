//! Keeping secrets out of core files.
//!
//! The process holds the Proxmox API token (in the client and in every
//! request's `Authorization` header) and, while a Configure runs, pieces of
//! a bootstrap blob. A core file written on a crash (`ulimit -c unlimited`,
//! or a host's systemd-coredump) would carry them to wherever cores are
//! kept. So the serving process forbids its own cores at start: the core
//! size limit goes to 0 (nothing is written on a crash) and the process is
//! made non-dumpable (`PR_SET_DUMPABLE` 0: no core even if a limit is
//! raised later, and no `ptrace` attach or `/proc/PID/mem` read by another
//! process of the same user). `--core-dumps` leaves both as the
//! environment set them, for debugging a crash on a machine whose cores
//! are kept safe.

use std::io;

/// Forbids core files for this process (see the module docs).
#[allow(unsafe_code)] // libc calls; see the SAFETY notes inside
pub fn forbid() -> io::Result<()> {
    let none = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: setrlimit reads the struct passed by reference; lowering a
    // limit needs no privilege.
    if unsafe { libc::setrlimit(libc::RLIMIT_CORE, &none) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: PR_SET_DUMPABLE takes one integer argument and touches no
    // memory of ours.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io;

    /// Whether this process may write a core file now: a core limit above 0
    /// and dumpable.
    #[allow(unsafe_code)] // libc calls; see the SAFETY notes inside
    fn allowed() -> io::Result<bool> {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes only the struct passed by reference.
        if unsafe { libc::getrlimit(libc::RLIMIT_CORE, &mut limit) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: PR_GET_DUMPABLE takes no argument and returns the flag.
        let dumpable = unsafe { libc::prctl(libc::PR_GET_DUMPABLE, 0, 0, 0, 0) };
        if dumpable < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(limit.rlim_cur > 0 && dumpable > 0)
    }

    #[test]
    fn forbidden_cores_stay_forbidden() {
        super::forbid().expect("lowering a limit needs no privilege");
        assert!(!allowed().expect("readable"));
    }
}
