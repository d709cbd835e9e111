//! Parsers of single flag values (`PATH:PRIV`, `VNET=ZONE`, `LOWER:UPPER`,
//! durations, templates), each naming the flag's form and an example in
//! its error: apart from `cli` so that file holds the flags and how they
//! become a [`crate::SimConfig`].

use std::time::Duration;

use crate::config::TemplateSpec;

/// Every privilege PVE 8 and 9 know (pve-access-control
/// `AccessControl.pm`), so a misspelt one is refused rather than ignored.
const KNOWN_PRIVILEGES: &[&str] = &[
    "Datastore.Allocate",
    "Datastore.AllocateSpace",
    "Datastore.AllocateTemplate",
    "Datastore.Audit",
    "Group.Allocate",
    "Mapping.Audit",
    "Mapping.Modify",
    "Mapping.Use",
    "Permissions.Modify",
    "Pool.Allocate",
    "Pool.Audit",
    "Realm.Allocate",
    "Realm.AllocateUser",
    "SDN.Allocate",
    "SDN.Audit",
    "SDN.Use",
    "Sys.AccessNetwork",
    "Sys.Audit",
    "Sys.Console",
    "Sys.Incoming",
    "Sys.Modify",
    "Sys.PowerMgmt",
    "Sys.Syslog",
    "User.Modify",
    "VM.Allocate",
    "VM.Audit",
    "VM.Backup",
    "VM.Clone",
    "VM.Config.CDROM",
    "VM.Config.CPU",
    "VM.Config.Cloudinit",
    "VM.Config.Disk",
    "VM.Config.HWType",
    "VM.Config.Memory",
    "VM.Config.Network",
    "VM.Config.Options",
    "VM.Console",
    "VM.GuestAgent.Audit",
    "VM.GuestAgent.FileRead",
    "VM.GuestAgent.FileSystemMgmt",
    "VM.GuestAgent.FileWrite",
    "VM.GuestAgent.Unrestricted",
    "VM.Migrate",
    "VM.Monitor",
    "VM.PowerMgmt",
    "VM.Replicate",
    "VM.Snapshot",
    "VM.Snapshot.Rollback",
];

/// `PATH:PRIV`; the privilege is the part after the last `:` (paths have
/// none).
pub(crate) fn parse_acl(s: &str, wildcard: bool) -> Result<(String, String), String> {
    let (path, privilege) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("{s:?}: write PATH:PRIV, e.g. /vms/9000:VM.Clone"))?;
    let (path, privilege) = (path.trim(), privilege.trim());
    if !path.starts_with('/') {
        return Err(format!(
            "{s:?}: the ACL path must start with '/', e.g. /storage/local"
        ));
    }
    if !(KNOWN_PRIVILEGES.contains(&privilege) || wildcard && privilege == "*") {
        return Err(format!(
            "{s:?}: unknown privilege {privilege:?}; PVE's are {}{}",
            KNOWN_PRIVILEGES.join(", "),
            if wildcard { " (or * for all)" } else { "" }
        ));
    }
    Ok((path.to_string(), privilege.to_string()))
}

pub(crate) fn parse_drop(s: &str) -> Result<(String, String), String> {
    parse_acl(s, true)
}

pub(crate) fn parse_grant(s: &str) -> Result<(String, String), String> {
    parse_acl(s, false)
}

pub(crate) fn parse_vnet(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((v, z)) if crate::config::is_config_id(v.trim()) && !z.trim().is_empty() => {
            Ok((v.trim().to_string(), z.trim().to_string()))
        }
        _ => Err(format!("SDN VNet {s:?}: write VNET=ZONE, e.g. vnet1=zone1")),
    }
}

/// `LOWER:UPPER` (UPPER exclusive) as the inclusive range the simulator keeps.
pub(crate) fn next_id_range(s: &str) -> Result<(u32, u32), String> {
    let (lo, hi) = s
        .split_once(':')
        .ok_or_else(|| format!("--next-id {s:?}: write LOWER:UPPER, e.g. 100:1000000"))?;
    let parse = |v: &str| {
        v.trim()
            .parse::<u32>()
            .map_err(|_| format!("--next-id {s:?}: {v:?} is not a VMID"))
    };
    let (lo, hi) = (parse(lo)?, parse(hi)?);
    if lo < 100 || hi <= lo {
        return Err(format!(
            "--next-id {s:?}: LOWER must be at least 100 and below UPPER (UPPER is exclusive)"
        ));
    }
    Ok((lo, hi - 1))
}

/// Durations like `500ms`, `2s`, `1m`.
pub(crate) fn humantime_ms(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, mul) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1000)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60_000)
    } else {
        return Err(format!("duration '{s}' needs a unit (ms, s, m)"));
    };
    num.trim()
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .map(Duration::from_millis)
        .ok_or_else(|| format!("invalid duration '{s}' (e.g. 500ms, 2s, 1m)"))
}

pub(crate) fn parse_template(spec: &str, default_node: &str) -> Result<TemplateSpec, String> {
    let (rest, shared) = match spec.strip_suffix(":shared") {
        Some(r) => (r, true),
        None => (spec, false),
    };
    let (id, node) = rest.split_once('@').unwrap_or((rest, default_node));
    let vmid: u32 = id.trim().parse().map_err(|_| {
        format!("template '{spec}': VMID '{id}' is not a number (write VMID[@NODE][:shared])")
    })?;
    Ok(if shared {
        TemplateSpec::shared(vmid, node)
    } else {
        TemplateSpec::local(vmid, node)
    })
}
