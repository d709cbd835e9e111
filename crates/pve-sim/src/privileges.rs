//! What PVE checks before it runs a call: the pool ACL's view of a VM path
//! and the privileges a route requires, against what the token holds.
//!
//! Each route names its requirement in the table in `routes` (a
//! [`Privileges`]); the requirements that depend on the request (what a
//! clone, config update or migration names, what the VM's NICs and disks
//! are) are computed here, apart from the table, because they read the
//! cluster's state and PVE's rules for it, not the route.

use crate::params::Params;
use crate::sim::Shared;
use crate::state::{ApiError, ApiResult};

/// The checks one request needs: `(path, alternatives)`, every entry must
/// hold and any one alternative satisfies it.
pub(crate) type Required = Vec<(String, Vec<&'static str>)>;

/// The privilege checks PVE makes on a route (from the API schema's
/// `permissions`; the guest agent's by release), on `/vms/{vmid}` (which a
/// pool's ACL covers for its members) unless the rule names other paths.
#[derive(Clone, Copy)]
pub(crate) enum Privileges {
    /// No check the simulator models.
    Unchecked,
    /// This privilege on `/vms/{vmid}`.
    OnVm(&'static str),
    /// A guest agent call on `/vms/{vmid}`: any of these on PVE 9, which
    /// replaced `VM.Monitor` with the `VM.GuestAgent.*` privileges;
    /// `VM.Monitor` before.
    Agent(&'static [&'static str]),
    /// Depends on the request and the cluster's state.
    Rule(fn(&Shared, &Params) -> Required),
}

impl Privileges {
    /// What this request must hold, in the order PVE checks it (the first
    /// missing one is the one reported).
    pub(crate) fn required(&self, s: &Shared, p: &Params) -> Required {
        match *self {
            Privileges::Unchecked => Vec::new(),
            Privileges::OnVm(privilege) => vec![(vm_path(p), vec![privilege])],
            Privileges::Agent(pve9) => {
                let any_of = if s.cfg.pve9 {
                    pve9.to_vec()
                } else {
                    vec!["VM.Monitor"]
                };
                vec![(vm_path(p), any_of)]
            }
            Privileges::Rule(rule) => rule(s, p),
        }
    }

    /// 403 `Permission check failed (PATH, PRIV)` for a privilege the token
    /// lacks (see [`crate::SimConfig::dropped_privileges`]).
    pub(crate) fn check(&self, s: &Shared, p: &Params) -> ApiResult<()> {
        for (path, any_of) in self.required(s, p) {
            let held = s.effective_privileges(&path);
            if !any_of.iter().any(|want| held.iter().any(|h| h == want)) {
                return Err(ApiError::Status(
                    403,
                    format!("Permission check failed ({path}, {})", any_of.join("|")),
                ));
            }
        }
        Ok(())
    }
}

/// Under [`crate::SimConfig::pool_acl`], a VM path outside the token's pool is
/// a 403 whether or not the VM exists (PVE checks the privilege on
/// `/vms/{vmid}` before looking the VM up).
pub(crate) fn check_acl(s: &Shared, template: &str, p: &Params) -> ApiResult<()> {
    if !s.cfg.pool_acl || !template.starts_with("/nodes/{node}/qemu/{vmid}") {
        return Ok(());
    }
    let vmid = p.u64("vmid").unwrap_or(0) as u32;
    if s.visible(&s.cluster.lock(), vmid) {
        return Ok(());
    }
    Err(ApiError::Status(
        403,
        format!("Permission check failed (/vms/{vmid}, VM.Audit)"),
    ))
}

/// `/vms/{vmid}` of the request's VM.
fn vm_path(p: &Params) -> String {
    format!("/vms/{}", p.u64("vmid").unwrap_or(0))
}

/// `POST .../clone`.
pub(crate) fn clone(s: &Shared, p: &Params) -> Required {
    let vmid = p.u64("vmid").unwrap_or(0);
    let mut out = vec![(vm_path(p), vec!["VM.Clone"])];
    let target = match p.get("pool") {
        Some(pool) => format!("/pool/{pool}"),
        None => format!("/vms/{}", p.u64("newid").unwrap_or(0)),
    };
    out.push((target, vec!["VM.Allocate"]));
    // PVE 8 and newer: the clone's NICs need SDN.Use on their
    // bridge, in the VNet's zone or `localnetwork`; on the VLAN
    // below it for a NIC with a tag, and on each VLAN of its trunks
    // (pve-guest-common `check_vnet_access`).
    for path in sdn_paths(s, vmid as u32) {
        out.push((path, vec!["SDN.Use"]));
    }
    // qemu-server `check_storage_access_clone`: the storage the
    // disks go to, `storage` when given, else the source's.
    let storage = p.get("storage").map(str::to_string).or_else(|| {
        let c = s.cluster.lock();
        c.vms.get(&(vmid as u32)).map(|v| v.storage.clone())
    });
    if let Some(st) = storage.filter(|st| !st.is_empty()) {
        out.push((format!("/storage/{st}"), vec!["Datastore.AllocateSpace"]));
    }
    // The host's CD-ROM drive is a device, not a volume: PVE asks
    // for Sys.Console on `/` (check_storage_access).
    let physical_cdrom = s
        .cluster
        .lock()
        .vms
        .get(&(vmid as u32))
        .is_some_and(|vm| vm.has_physical_cdrom());
    if physical_cdrom {
        out.push(("/".to_string(), vec!["Sys.Console"]));
    }
    // Then qemu-server `check_mapping_access` on the source's config:
    // `Mapping.Use` on each mapped PCI or USB device's mapping; and, from
    // qemu-server 9.1.15 (PVE 9), `$check_cpu_model_access`: `Mapping.Use`
    // on `/mapping/cpu/<x>` for a `cpu: custom-<x>`.
    let config = s
        .cluster
        .lock()
        .vms
        .get(&(vmid as u32))
        .map(|vm| vm.config_json());
    if let Some(keys) = config.as_ref().and_then(|c| c.as_object()) {
        let mut devices = keys
            .iter()
            .filter_map(|(k, v)| v.as_str().map(|v| (k.as_str(), v)));
        for path in crate::mapping::mapping_paths(&mut devices) {
            out.push((path, vec!["Mapping.Use"]));
        }
        let custom = keys
            .get("cpu")
            .and_then(|c| c.as_str())
            .and_then(crate::mapping::custom_cpu_model);
        if let (true, Some(model)) = (s.cfg.pve9, custom) {
            out.push((format!("/mapping/cpu/{model}"), vec!["Mapping.Use"]));
        }
    }
    out
}

/// `PUT` and `POST .../config`: one privilege per option set or deleted.
pub(crate) fn config(_: &Shared, p: &Params) -> Required {
    let vm = vm_path(p);
    let mut out = Vec::new();
    for (key, privilege) in [
        // qemu-server `$check_vm_modify_config_perm`: `$cpuoptions` and
        // `$memoryoptions`.
        ("cores", "VM.Config.CPU"),
        ("sockets", "VM.Config.CPU"),
        ("vcpus", "VM.Config.CPU"),
        ("memory", "VM.Config.Memory"),
        ("balloon", "VM.Config.Memory"),
        ("description", "VM.Config.Options"),
        ("tags", "VM.Config.Options"),
        ("protection", "VM.Config.Options"),
    ] {
        let deleted = p
            .get("delete")
            .is_some_and(|d| d.split([',', ';', ' ']).any(|k| k == key));
        if p.get(key).is_some() || deleted {
            out.push((vm.clone(), vec![privilege]));
        }
    }
    // qemu-server `check_hostpci_perm` / `check_usb_perm`: a mapped
    // device needs `Mapping.Use` on its mapping and `VM.Config.HWType`.
    for (key, values) in &p.0 {
        let Some(value) = values.first() else {
            continue;
        };
        let mut one = std::iter::once((key.as_str(), value.as_str()));
        for path in crate::mapping::mapping_paths(&mut one) {
            out.push((path, vec!["Mapping.Use"]));
            out.push((vm.clone(), vec!["VM.Config.HWType"]));
        }
    }
    out
}

/// `POST .../migrate`.
pub(crate) fn migrate(_: &Shared, p: &Params) -> Required {
    let vm = vm_path(p);
    let mut out = vec![(vm.clone(), vec!["VM.Migrate"])];
    // qemu-server migrate_vm: a `targetstorage` other than the
    // identity map `1` moves disks, so it needs VM.Config.Disk on
    // the VM and room on each target storage.
    if let Some(ts) = p.get("targetstorage").filter(|t| *t != "1") {
        out.push((vm, vec!["VM.Config.Disk"]));
        for entry in ts.split(',') {
            let target = entry.rsplit(':').next().unwrap_or(entry).trim();
            if !target.is_empty() && target != "1" {
                out.push((
                    format!("/storage/{target}"),
                    vec!["Datastore.AllocateSpace"],
                ));
            }
        }
    }
    out
}

/// `GET .../storage/{storage}/status`: either privilege on the storage.
pub(crate) fn storage_status(_: &Shared, p: &Params) -> Required {
    vec![(
        format!("/storage/{}", p.get("storage").unwrap_or_default()),
        vec!["Datastore.Audit", "Datastore.AllocateSpace"],
    )]
}

/// The SDN paths the NICs of VM `vmid` are checked on (see [`clone`]): as
/// pve-guest-common `check_vnet_access`, `/sdn/zones/<zone>/<bridge>/<tag>`
/// for the `tag` and for each VLAN of `trunks` (`10;20-30`), and the
/// bridge's own path only for a NIC with neither.
fn sdn_paths(s: &Shared, vmid: u32) -> Vec<String> {
    let config = match s.cluster.lock().vms.get(&vmid) {
        Some(vm) => vm.config_json(),
        None => return Vec::new(),
    };
    let Some(keys) = config.as_object() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (key, value) in keys {
        let is_nic = key
            .strip_prefix("net")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        let Some(nic) = value.as_str().filter(|_| is_nic) else {
            continue;
        };
        let field = |name: &str| {
            nic.split(',')
                .find_map(|part| part.strip_prefix(name))
                .filter(|v| !v.is_empty())
        };
        let Some(bridge) = field("bridge=") else {
            continue;
        };
        let path = format!("/sdn/zones/{}/{bridge}", s.sdn_zone_of(bridge));
        let mut vlans: Vec<String> = field("tag=").map(str::to_string).into_iter().collect();
        vlans.extend(field("trunks=").map(trunk_vlans).unwrap_or_default());
        if vlans.is_empty() {
            out.push(path);
        } else {
            out.extend(vlans.iter().map(|vlan| format!("{path}/{vlan}")));
        }
    }
    out.sort();
    out.dedup();
    out
}

/// The VLANs of a NIC's `trunks` (`10;20-30`), as pve-guest-common's
/// `get_tags_from_trunk` expands them: a range whose end is not above its
/// start is its start alone.
fn trunk_vlans(trunks: &str) -> Vec<String> {
    let mut out = Vec::new();
    for trunk in trunks.split(';').filter(|t| !t.is_empty()) {
        let (start, end) = trunk.split_once('-').unwrap_or((trunk, ""));
        match (start.parse::<u32>(), end.parse::<u32>()) {
            (Ok(a), Ok(b)) if b > a => out.extend((a..=b).map(|v| v.to_string())),
            _ => out.push(start.to_string()),
        }
    }
    out
}

/// Privileges of PVE 8's Administrator role that matter to a VM lifecycle
/// client, less `Sys.Modify`: a provider token does not hold it, so a
/// restricted `user-tag-access` applies to it (grant it with
/// [`crate::SimConfig::granted_privileges`]).
const PRIVILEGES: &[&str] = &[
    "Datastore.Allocate",
    "Datastore.AllocateSpace",
    "Datastore.AllocateTemplate",
    "Datastore.Audit",
    "Pool.Allocate",
    "Pool.Audit",
    "SDN.Allocate",
    "SDN.Audit",
    "SDN.Use",
    "Sys.Audit",
    "Sys.Console",
    "Sys.PowerMgmt",
    "Sys.Syslog",
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
    "VM.Migrate",
    "VM.Monitor",
    "VM.PowerMgmt",
    "VM.Snapshot",
    "VM.Snapshot.Rollback",
];

/// What PVE 9 renamed in [`PRIVILEGES`]: `VM.Monitor` is gone, the guest
/// agent has its own privileges.
const PVE9_DROPPED: &[&str] = &["VM.Monitor"];
const PVE9_ADDED: &[&str] = &[
    "VM.GuestAgent.Audit",
    "VM.GuestAgent.FileRead",
    "VM.GuestAgent.FileSystemMgmt",
    "VM.GuestAgent.FileWrite",
    "VM.GuestAgent.Unrestricted",
];

/// The default privileges on `/`: [`PRIVILEGES`], as PVE 9 names them when
/// `pve9`; sorted.
pub(crate) fn default_privileges(pve9: bool) -> Vec<&'static str> {
    let mut names: Vec<&'static str> = PRIVILEGES
        .iter()
        .copied()
        .filter(|p| !pve9 || !PVE9_DROPPED.contains(p))
        .collect();
    if pve9 {
        names.extend_from_slice(PVE9_ADDED);
    }
    names.sort_unstable();
    names
}

#[cfg(test)]
mod default_tests {
    use super::{default_privileges, PRIVILEGES, PVE9_ADDED};

    #[test]
    fn pve9_renames_only_the_guest_agent_privileges() {
        let (pve8, pve9) = (default_privileges(false), default_privileges(true));
        assert_eq!(pve8, PRIVILEGES, "PVE 8's list as written, in order");
        assert_eq!((pve8.len(), pve9.len()), (31, 35));
        assert!(pve8.contains(&"VM.Monitor") && !pve9.contains(&"VM.Monitor"));
        let common: Vec<_> = pve8.iter().filter(|p| **p != "VM.Monitor").collect();
        assert!(common.iter().all(|p| pve9.contains(p)), "{pve9:?}");
        assert!(PVE9_ADDED
            .iter()
            .all(|p| pve9.contains(p) && !pve8.contains(p)));
        assert!(pve9.is_sorted(), "{pve9:?}");
    }
}
