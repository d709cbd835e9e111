//! Cluster resource mappings: PCI mappings as pve-manager lists them
//! (`API2/Cluster/Mapping/PCI.pm`), the device keys of a VM config that
//! name them (`hostpciN`, `usbN`, and PVE 9's custom CPU models), and the
//! devices a mapped VM holds while it runs (qemu-server
//! `QemuServer/PCI.pm`).
//!
//! Apart from `lifecycle` because what a mapping is (its devices per node,
//! who may use it) is cluster configuration read by clone, config and
//! start alike; the start worker only asks it for a reservation.

use std::sync::Arc;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::config::PciMapping;
use crate::params::Params;
use crate::sim::Shared;
use crate::state::{ApiError, ApiResult, Cluster, Vm};

/// The vendor:device id every simulated mapped device reports (an NVIDIA
/// A10), as a `map` entry's `id`.
const DEVICE_ID: &str = "10de:2236";

/// The `hostpciN` / `usbN` keys of a config (the whole key, `N` digits).
fn device_key(key: &str, prefix: &str) -> bool {
    key.strip_prefix(prefix)
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// A property string's field `name` (`mapping` of `mapping=gpu,pcie=1`),
/// or its bare first part when `name` is the default key (`host` of
/// `0000:01:00.0,pcie=1`).
fn field<'a>(value: &'a str, name: &str, default_key: bool) -> Option<&'a str> {
    value.split(',').enumerate().find_map(|(i, part)| {
        let part = part.trim();
        match part.split_once('=') {
            Some((k, v)) if k == name => Some(v),
            None if i == 0 && default_key => Some(part),
            _ => None,
        }
    })
}

/// The mapping names of `vm`'s `hostpciN` entries, in index order.
fn pci_mappings_of(vm: &Vm) -> Vec<(String, String)> {
    let mut out: Vec<(u32, String, String)> = vm
        .extra
        .iter()
        .filter(|(k, _)| device_key(k, "hostpci"))
        .filter_map(|(k, v)| {
            let idx = k["hostpci".len()..].parse().ok()?;
            Some((idx, k.clone(), field(v, "mapping", false)?.to_string()))
        })
        .collect();
    out.sort();
    out.into_iter().map(|(_, k, m)| (k, m)).collect()
}

/// The `/mapping/...` paths qemu-server `check_mapping_access` asks
/// `Mapping.Use` on for a config's devices: `/mapping/pci/<name>` for a
/// mapped `hostpciN`, `/mapping/usb/<name>` for a mapped `usbN`.
pub(crate) fn mapping_paths(keys: &mut dyn Iterator<Item = (&str, &str)>) -> Vec<String> {
    let mut out = Vec::new();
    for (key, value) in keys {
        let kind = if device_key(key, "hostpci") {
            "pci"
        } else if device_key(key, "usb") {
            "usb"
        } else {
            continue;
        };
        if let Some(name) = field(value, "mapping", false) {
            out.push(format!("/mapping/{kind}/{name}"));
        }
    }
    out
}

/// What a token (never `root@pam`) may not set, in qemu-server's words
/// (`check_mapping_access`, `check_hostpci_perm`, `check_usb_perm`): a
/// `hostpciN` passing a host device through by address, a `usbN` passing
/// a real host device (`spice` is not one).
pub(crate) fn root_only_device(keys: &mut dyn Iterator<Item = (&str, &str)>) -> Option<String> {
    for (key, value) in keys {
        // `host` is the default key of both formats; qemu-server looks at
        // it before `mapping`.
        let host = field(value, "host", true);
        if device_key(key, "hostpci") && host.is_some() {
            return Some(format!(
                "only root can set '{key}' config for non-mapped devices"
            ));
        }
        if device_key(key, "usb") && host.is_some_and(|h| !h.eq_ignore_ascii_case("spice")) {
            return Some(format!("only root can set '{key}' config for real devices"));
        }
    }
    None
}

/// The custom CPU model of a `cpu` value (`custom-<x>` as the `cputype`,
/// its default key): `<x>` (qemu-server `$check_cpu_model_access`).
pub(crate) fn custom_cpu_model(cpu: &str) -> Option<&str> {
    field(cpu, "cputype", true)?.strip_prefix("custom-")
}

/// Releases a start's PCI reservation when the start worker ends (by then
/// the VM runs and holds its devices itself, or it failed).
pub(crate) struct PciReservation {
    shared: Arc<Shared>,
    vmid: u32,
}

impl Drop for PciReservation {
    fn drop(&mut self) {
        self.shared.pci_starting.lock().remove(&self.vmid);
    }
}

impl Shared {
    /// The simulator's made-up bus address of device `index` of mapping
    /// `name` on `node`: buses counted across the node's mappings in
    /// config order, so no two mappings share a device.
    fn pci_path(&self, node: &str, name: &str, index: u32) -> String {
        let before: u32 = self
            .cfg
            .pci_mappings
            .iter()
            .take_while(|m| m.name != name)
            .map(|m| m.devices_on(node))
            .sum();
        format!("0000:{:02x}:00.0", before + index + 1)
    }

    /// A mapping's `map` entries, one per device, as `mapping/pci.cfg`
    /// stores them.
    fn map_entries(&self, m: &PciMapping) -> Vec<String> {
        let mut out = Vec::new();
        for (node, count) in &m.devices {
            for i in 0..*count {
                let path = self.pci_path(node, &m.name, i);
                let group = u32::from_str_radix(&path[5..7], 16).unwrap_or(0);
                out.push(format!(
                    "node={node},path={path},id={DEVICE_ID},iommugroup={group}"
                ));
            }
        }
        out
    }

    /// `GET /cluster/mapping/pci`: pve-manager's index returns each
    /// mapping's section (`map`, `description`, its `type`), its `id` and
    /// the file's `digest`, leaving out the mappings on whose
    /// `/mapping/pci/<id>` the token holds none of `Mapping.Modify`,
    /// `Mapping.Use`, `Mapping.Audit` (the call itself is open to every
    /// user). With `check-node`, each gets `checks`: a warning when it maps
    /// nothing on that node.
    pub fn pci_mapping_index(&self, p: &Params) -> ApiResult {
        let check_node = p.get("check-node");
        if let Some(n) = check_node {
            // Proxied to that node, which checks it is itself.
            if !self.cfg.nodes.iter().any(|x| x == n) {
                return Err(ApiError::Status(595, format!("no such cluster node '{n}'")));
            }
        }
        let mut mappings: Vec<&PciMapping> = self.cfg.pci_mappings.iter().collect();
        mappings.sort_by(|a, b| a.name.cmp(&b.name));
        let file: String = mappings
            .iter()
            .map(|m| {
                let maps: String = self
                    .map_entries(m)
                    .iter()
                    .map(|e| format!("\tmap {e}\n"))
                    .collect();
                format!("{}\n{maps}\n", m.name)
            })
            .collect();
        let digest = hex::encode(Sha256::digest(file.as_bytes()));
        let rows = mappings
            .into_iter()
            .filter(|m| {
                let held = self.effective_privileges(&format!("/mapping/pci/{}", m.name));
                held.iter()
                    .any(|p| ["Mapping.Modify", "Mapping.Use", "Mapping.Audit"].contains(&p.as_str()))
            })
            .map(|m| {
                let mut row = json!({
                    "id": m.name,
                    "type": "pci",
                    "map": self.map_entries(m),
                    "digest": &digest[..40],
                });
                if let Some(d) = &m.description {
                    row["description"] = json!(d);
                }
                if let Some(n) = check_node {
                    let checks = if m.devices_on(n) == 0 {
                        vec![json!({"severity": "warning", "message": format!("No mapping for node {n}.")})]
                    } else {
                        Vec::new()
                    };
                    row["checks"] = json!(checks);
                }
                row
            })
            .collect();
        Ok(Value::Array(rows))
    }

    /// Devices of mapping `name` on `node` held by VMs other than `vmid`:
    /// one per mapped `hostpciN` of each VM running there or starting.
    fn pci_holders(&self, c: &Cluster, node: &str, name: &str, vmid: u32) -> Vec<u32> {
        let starting = self.pci_starting.lock();
        let mut out = Vec::new();
        for vm in c.vms.values().filter(|v| v.vmid != vmid) {
            let here = (vm.running && vm.node == node)
                || starting.get(&vm.vmid).is_some_and(|n| n == node);
            if here {
                let uses = pci_mappings_of(vm)
                    .iter()
                    .filter(|(_, m)| m == name)
                    .count();
                out.extend(std::iter::repeat_n(vm.vmid, uses));
            }
        }
        out
    }

    /// Reserve, for VM `vmid` starting on `node`, one free device of each
    /// mapping its `hostpciN` entries name, as qemu-server's start does
    /// (`QemuServer/PCI.pm`: `parse_hostpci` finds the node's devices,
    /// `choose_hostpci_devices` tries each alternative's
    /// `reserve_pci_usage`, and with a single device the start's own
    /// reservation finds it taken). Errors are PVE's: `PCI device mapping
    /// not found for 'X'` (nothing mapped on the node), `could not find a
    /// free device for 'hostpciN'` (several devices, all held), `PCI device
    /// 'ADDR' already in use by VMID 'N'` (the only one is held by a
    /// running VM). The reservation ends when the returned guard drops;
    /// running then holds the devices until the VM stops or is destroyed.
    /// Starting a mapped VM needs no `Mapping.Use`: qemu-server's
    /// `vm_start` checks only `VM.PowerMgmt`.
    pub(crate) fn reserve_pci(
        self: &Arc<Self>,
        vmid: u32,
        node: &str,
    ) -> Result<PciReservation, String> {
        let c = self.cluster.lock();
        let Some(vm) = c.vms.get(&vmid) else {
            return Err(crate::sim::err_text(crate::state::missing_conf(node, vmid)));
        };
        let mut wanted: std::collections::BTreeMap<&str, u32> = Default::default();
        let entries = pci_mappings_of(vm);
        for (key, name) in &entries {
            let Some(m) = self.cfg.pci_mappings.iter().find(|m| &m.name == name) else {
                return Err(format!("PCI device mapping not found for '{name}'"));
            };
            let total = m.devices_on(node);
            if total == 0 {
                return Err(format!("PCI device mapping not found for '{name}'"));
            }
            let held = self.pci_holders(&c, node, name, vmid);
            let mine = wanted.entry(name.as_str()).or_default();
            if held.len() as u32 + *mine >= total {
                return Err(if total == 1 {
                    format!(
                        "PCI device '{}' already in use by VMID '{}'",
                        self.pci_path(node, name, 0),
                        held.first().copied().unwrap_or(vmid)
                    )
                } else {
                    format!("could not find a free device for '{key}'")
                });
            }
            *mine += 1;
        }
        if !entries.is_empty() {
            self.pci_starting.lock().insert(vmid, node.to_string());
        }
        Ok(PciReservation {
            shared: Arc::clone(self),
            vmid,
        })
    }

    /// 500 with qemu-server's text when VM `vmid`'s config passes host
    /// devices through that only `root@pam` may (see [`root_only_device`]);
    /// an API token is never `root@pam`.
    pub(crate) fn refuse_root_only_devices_of(&self, vmid: u32) -> ApiResult<()> {
        let c = self.cluster.lock();
        let Some(vm) = c.vms.get(&vmid) else {
            return Ok(());
        };
        let mut keys = vm.extra.iter().map(|(k, v)| (k.as_str(), v.as_str()));
        match root_only_device(&mut keys) {
            Some(why) => Err(ApiError::internal(why)),
            None => Ok(()),
        }
    }
}

/// The same refusal for the keys a config update sets.
pub(crate) fn refuse_root_only_params(p: &Params) -> ApiResult<()> {
    let mut keys =
        p.0.iter()
            .filter_map(|(k, v)| v.first().map(|v| (k.as_str(), v.as_str())));
    match root_only_device(&mut keys) {
        Some(why) => Err(ApiError::internal(why)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::{custom_cpu_model, mapping_paths, root_only_device};

    #[test]
    fn device_keys_as_qemu_server_reads_them() {
        let conf = [
            ("hostpci0", "mapping=gpu,pcie=1"),
            ("usb1", "mapping=dongle"),
            ("usb2", "host=spice"),
            ("net0", "virtio,bridge=vmbr0"),
        ];
        let mut it = conf.iter().copied();
        assert_eq!(
            mapping_paths(&mut it),
            ["/mapping/pci/gpu", "/mapping/usb/dongle"]
        );
        let mut it = conf.iter().copied();
        assert_eq!(root_only_device(&mut it), None);
        let mut it = [("hostpci1", "0000:01:00.0,pcie=1")].into_iter();
        assert_eq!(
            root_only_device(&mut it).as_deref(),
            Some("only root can set 'hostpci1' config for non-mapped devices")
        );
        let mut it = [("usb0", "host=046d:c52b")].into_iter();
        assert_eq!(
            root_only_device(&mut it).as_deref(),
            Some("only root can set 'usb0' config for real devices")
        );
        assert_eq!(custom_cpu_model("custom-epyc,flags=+aes"), Some("epyc"));
        assert_eq!(custom_cpu_model("cputype=custom-x"), Some("x"));
        assert_eq!(custom_cpu_model("host"), None);
    }
}
