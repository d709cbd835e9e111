//! Start-up warnings about how secrets are kept and sent, where refusing to
//! start would break deployments that are merely careless: a secret file
//! every user of the host can read, and a PostgreSQL state reached without
//! TLS over a network.
//!
//! The group bits are left alone: the chart mounts the token and the TLS
//! key `0440` for the runtime group, as Kubernetes' `defaultMode` does. A
//! file readable by others is what libpq refuses in a `.pgpass`; here it is
//! a WARN naming the file and the `chmod` that fixes it.

use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use crate::config::Args;
use crate::plan::Plan;
use crate::state::StateLocation;

/// One WARN line's text per finding, in flag order.
pub fn warnings(args: &Args, plan: &Plan) -> Vec<String> {
    let mut out = Vec::new();
    let files = [
        ("--proxmox-token-file", args.proxmox_token_file.as_deref()),
        ("--state-password-file", args.state_password_file.as_deref()),
        ("--tls-key", args.tls_key.as_deref()),
    ];
    for (flag, path) in files {
        if let Some(warning) = path.and_then(|p| readable_by_others(flag, p)) {
            out.push(warning);
        }
    }
    if let Some(state) = &plan.state {
        if let StateLocation::Postgres { target, .. } = &state.location {
            if matches!(target.tls(), pg_store::Tls::Disabled) {
                if let Some(host) = target.host().filter(|h| !is_loopback(h)) {
                    out.push(format!(
                        "--state uses sslmode=disable to {host}, which is not a loopback \
                         address: the state (fence marks, metadata) and the password cross the \
                         network in clear text; use sslmode=verify-full with sslrootcert=CA"
                    ));
                }
            }
        }
    }
    out
}

fn readable_by_others(flag: &str, path: &Path) -> Option<String> {
    let mode = std::fs::metadata(path).ok()?.permissions().mode();
    (mode & 0o004 != 0).then(|| {
        format!(
            "{flag} {} is readable by every user of this host (mode {:04o}): chmod o-rwx it \
             (0600, or 0440 for a group that runs the provider)",
            path.display(),
            mode & 0o7777
        )
    })
}

/// `localhost` and loopback addresses; a Unix socket path is local too.
fn is_loopback(host: &str) -> bool {
    host == "localhost"
        || host.starts_with('/')
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn warnings_for(state: &str) -> Vec<String> {
        use clap::Parser;
        let args =
            Args::try_parse_from(["bigfleet-proxmox", "--use-fake-backend", "--state", state])
                .expect("flags parse");
        let plan = crate::plan(&args).expect("plan");
        warnings(&args, &plan)
    }

    #[test]
    fn a_state_without_tls_over_a_network_is_warned_of() {
        let warned = warnings_for("postgres://bf@db.example:5432/bf?sslmode=disable");
        assert_eq!(warned.len(), 1, "{warned:?}");
        assert!(
            warned[0].contains("sslmode=disable to db.example"),
            "{warned:?}"
        );
        assert!(warnings_for("postgres://bf@127.0.0.1:5432/bf?sslmode=disable").is_empty());
        assert!(warnings_for("postgres://bf@db.example:5432/bf").is_empty());
    }

    #[test]
    fn loopback_hosts_are_local() {
        for host in ["localhost", "127.0.0.1", "::1", "[::1]", "/run/postgresql"] {
            assert!(is_loopback(host), "{host}");
        }
        for host in ["db.example", "10.0.0.5", "localhost.example"] {
            assert!(!is_loopback(host), "{host}");
        }
    }

    #[test]
    fn a_file_others_can_read_is_named_with_its_fix() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("token");
        std::fs::write(&path, "s").expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let warning = readable_by_others("--proxmox-token-file", &path).expect("warned");
        assert!(
            warning.contains("mode 0644") && warning.contains("chmod o-rwx"),
            "{warning}"
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o440)).expect("chmod");
        assert_eq!(readable_by_others("--proxmox-token-file", &path), None);
    }
}
