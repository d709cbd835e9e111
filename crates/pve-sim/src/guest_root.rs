//! The per-VM scratch directory that stands in for a guest's `/`: the
//! variable that points the guest's processes at it, the directories a
//! fresh one has, and the guest's hostname. Both agents (the built-in one
//! in `agent` and a real `qemu-ga` in `qga`) run commands inside it, so it
//! sits below both and neither has to reach into the other for it.
//!
//! The hostname is modelled, never the test machine's own: it lives in the
//! root's `/etc/hostname` (the template image's name until something sets
//! it), and the root's `usr/bin` holds `hostname` and `hostnamectl` scripts
//! that read and write that file. They come first on the guest processes'
//! `PATH`, so a guest command that names the guest (`hostnamectl
//! set-hostname x`) renames the simulated guest and nothing else.

use std::ffi::OsString;
use std::path::Path;

/// Env var pointing exec'd processes at their VM's scratch root.
pub const GUEST_ROOT_ENV: &str = "BIGFLEET_GUEST_ROOT";

/// Directories every fresh guest root has, so writes to e.g. `/run/x` work.
pub const GUEST_DIRS: &[&str] = &[
    "run",
    "tmp",
    "etc",
    "root",
    "home",
    "opt",
    "var/lib",
    "usr/bin",
    "usr/local/bin",
];

/// A fresh guest's hostname: the one the template's image was built with
/// (a Debian cloud image's), which a clone keeps until it is renamed.
pub const TEMPLATE_HOSTNAME: &str = "debian";

/// The guest's hostname file, relative to its root.
pub const HOSTNAME_FILE: &str = "etc/hostname";

/// `hostname`: prints the guest's name, or sets it. Refuses to run outside
/// a guest root, so it can never touch the machine's own name.
const HOSTNAME_SCRIPT: &str = r#"#!/bin/sh
# pve-sim guest: the hostname is the guest root's /etc/hostname.
[ -n "$BIGFLEET_GUEST_ROOT" ] || { echo "hostname: not in a pve-sim guest" >&2; exit 1; }
f="$BIGFLEET_GUEST_ROOT/etc/hostname"
case "$#:$1" in
  0:) cat "$f" ;;
  1:-*) echo "hostname: option $1 is not modelled" >&2; exit 1 ;;
  1:*) printf '%s\n' "$1" > "$f" ;;
  *) echo "usage: hostname [NAME]" >&2; exit 1 ;;
esac
"#;

/// `hostnamectl`: `set-hostname NAME`, `hostname [NAME]`, or the status.
const HOSTNAMECTL_SCRIPT: &str = r#"#!/bin/sh
# pve-sim guest: the hostname is the guest root's /etc/hostname.
[ -n "$BIGFLEET_GUEST_ROOT" ] || { echo "hostnamectl: not in a pve-sim guest" >&2; exit 1; }
f="$BIGFLEET_GUEST_ROOT/etc/hostname"
case "$#:$1" in
  0:|1:status) printf ' Static hostname: %s\n' "$(cat "$f")" ;;
  1:hostname) cat "$f" ;;
  2:set-hostname|2:hostname) printf '%s\n' "$2" > "$f" ;;
  *) echo "hostnamectl: $* is not modelled" >&2; exit 1 ;;
esac
"#;

/// The guest's programs that stand in for the machine's own.
const GUEST_PROGRAMS: &[(&str, &str)] = &[
    ("usr/bin/hostname", HOSTNAME_SCRIPT),
    ("usr/bin/hostnamectl", HOSTNAMECTL_SCRIPT),
];

/// Makes `root` a guest's `/`: its directories, its hostname (the
/// template's, unless already set) and its programs. Idempotent and cheap
/// once done: it runs before every agent call.
pub(crate) fn prepare(root: &Path) -> std::io::Result<()> {
    for d in GUEST_DIRS {
        std::fs::create_dir_all(root.join(d))?;
    }
    write_new(
        &root.join(HOSTNAME_FILE),
        &format!("{TEMPLATE_HOSTNAME}\n"),
        0o644,
    )?;
    for (path, script) in GUEST_PROGRAMS {
        write_new(&root.join(path), script, 0o755)?;
    }
    Ok(())
}

/// Writes `path` unless it exists, through a temporary file and a rename,
/// so a concurrent agent call never runs or reads a half-written file.
fn write_new(path: &Path, text: &str, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if path.exists() {
        return Ok(());
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))?;
    std::fs::rename(&tmp, path)
}

/// The `PATH` of a guest's processes: the guest's own program directories
/// first, then the machine's (the guest has no shell or coreutils of its
/// own).
pub(crate) fn guest_path_env(root: &Path) -> OsString {
    let mut dirs: Vec<std::path::PathBuf> = [
        "usr/local/sbin",
        "usr/local/bin",
        "usr/sbin",
        "usr/bin",
        "sbin",
        "bin",
    ]
    .iter()
    .map(|d| root.join(d))
    .collect();
    if let Some(host) = std::env::var_os("PATH") {
        dirs.extend(std::env::split_paths(&host));
    }
    std::env::join_paths(dirs).unwrap_or_default()
}
