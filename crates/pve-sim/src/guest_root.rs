//! The per-VM scratch directory that stands in for a guest's `/`: the
//! variable that points the guest's processes at it and the directories a
//! fresh one has. Both agents (the built-in one in `agent` and a real
//! `qemu-ga` in `qga`) run commands inside it, so it sits below both and
//! neither has to reach into the other for it.

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
    "usr/local/bin",
];
