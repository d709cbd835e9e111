//! The preflight's checks of the instance types themselves: a `disk_gib`
//! PVE can grow the template's boot disk to, and `pci` devices the nodes
//! offering the type have, with the privileges attaching them needs.

use std::collections::{BTreeMap, BTreeSet};

use pve::VmConfig;
use tokio::time::Instant;

use super::super::api::{err, Api};
use super::super::options::{PveOptions, TypeDisk};
use super::{Need, READ_RETRY};
use crate::substrate::SubstrateError;

/// On the pool, when an instance type has mapped devices: a `hostpciN`
/// with a mapping needs `VM.Config.HWType` on the VM (qemu-server
/// `check_hostpci_perm`).
const ON_DEVICES: &[Need] = &[Need {
    job: "attach the instance types' mapped PCI devices (pci) to their clones",
    any_of: &["VM.Config.HWType"],
}];

/// On each mapping an instance type names: `Mapping.Use` on
/// `/mapping/pci/<name>` (`check_hostpci_perm`).
const ON_TYPE_MAPPING: &[Need] = &[Need {
    job: "attach this mapping's devices to clones (an instance type's pci)",
    any_of: &["Mapping.Use"],
}];

/// The paths and needs of the instance types' mapped devices.
pub(super) fn device_paths(opts: &PveOptions, pool_path: &str) -> Vec<(String, &'static [Need])> {
    if opts.type_devices.is_empty() {
        return Vec::new();
    }
    let mappings: BTreeSet<&str> = opts
        .type_devices
        .values()
        .map(|d| d.mapping.as_str())
        .collect();
    let mut out = vec![(pool_path.to_string(), ON_DEVICES)];
    out.extend(
        mappings
            .into_iter()
            .map(|m| (format!("/mapping/pci/{m}"), ON_TYPE_MAPPING)),
    );
    out
}

/// Each instance type with `pci` against the cluster's PCI mappings: the
/// mapping exists and maps at least `count` devices on every node the
/// type is offered on (a node that is down is warned of, and its Creates
/// are checked by the device guard). PVE would fail every start there.
pub(super) async fn check_devices(
    api: &Api,
    opts: &PveOptions,
    live_nodes: &[String],
) -> Result<Vec<String>, SubstrateError> {
    if opts.type_devices.is_empty() {
        return Ok(Vec::new());
    }
    let mappings = api
        .retry_raw(None, Instant::now() + READ_RETRY, |pve| pve.pci_mappings())
        .await
        .map_err(|e| {
            err(
                "listing the cluster's PCI resource mappings (GET /cluster/mapping/pci)",
                &e,
            )
        })?;
    let mut warnings = Vec::new();
    for (name, dev) in &opts.type_devices {
        let Some(mapping) = mappings.iter().find(|m| m.id == dev.mapping) else {
            return Err(SubstrateError::with_kind(
                providerkit::ErrorKind::Refused,
                format!(
                    "instance type {name} asks for PCI mapping {}, which GET /cluster/mapping/pci does not \
                     list: create it (Datacenter > Resource Mappings > PCI Devices) or grant the token \
                     Mapping.Use on /mapping/pci/{} (deploy/host-setup/setup-token.sh --pci-mapping {})",
                    dev.mapping, dev.mapping, dev.mapping
                ),
            ));
        };
        let per_node: BTreeMap<&str, u32> = dev
            .nodes
            .iter()
            .map(|n| (n.as_str(), mapping.devices_on(n)))
            .collect();
        for (node, have) in per_node {
            if !live_nodes.iter().any(|n| n == node) {
                warnings.push(format!(
                    "node {node} is offline: instance type {name}'s PCI mapping {} is checked by its first Create there",
                    dev.mapping
                ));
                continue;
            }
            if have < dev.count {
                return Err(SubstrateError::new(format!(
                    "instance type {name} is offered on node {node}, but PCI mapping {} maps {have} device(s) \
                     there and the type needs {} per machine: add the node's devices to the mapping \
                     (Datacenter > Resource Mappings), or drop the type's offering on {node}",
                    dev.mapping, dev.count
                )));
            }
        }
    }
    Ok(warnings)
}

/// Each instance type's `disk_gib` against its template's boot disk: PVE
/// grows a disk, never shrinks one, so a type smaller than its template
/// would fail every Create. A template whose config was not read (its node
/// down, or no privilege, reported elsewhere) is checked by its first Create.
pub(super) fn check_disk_sizes(
    types: &BTreeMap<String, TypeDisk>,
    configs: &[(u32, VmConfig)],
) -> Result<(), SubstrateError> {
    for (name, disk) in types {
        let Some((_, cfg)) = configs.iter().find(|(t, _)| *t == disk.template_vmid) else {
            continue;
        };
        let Some((key, _, bytes)) = cfg.boot_disk() else {
            return Err(SubstrateError::new(format!(
                "instance type {name} sets disk_gib {}, but template {} has no boot disk on a storage \
                 (boot order, bootdisk, or scsi0/virtio0/sata0/ide0) to grow: leave disk_gib out",
                disk.gib, disk.template_vmid
            )));
        };
        if bytes > disk.bytes() {
            return Err(SubstrateError::new(format!(
                "instance type {name}: disk_gib {} GiB is smaller than template {}'s boot disk \
                 ({key}, {}), and PVE cannot shrink a disk: set disk_gib to at least {} or leave it out",
                disk.gib,
                disk.template_vmid,
                crate::capacity::gib(bytes),
                bytes.div_ceil(1 << 30)
            )));
        }
    }
    Ok(())
}
