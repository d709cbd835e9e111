//! Devices a VM passes through (`hostpciN`, `usbN`) and its CPU model, as
//! far as cloning it is concerned: which resource mappings a clone is
//! checked on, and which devices only root may clone.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::types::VmConfig;

/// One PCI resource mapping as `GET /cluster/mapping/pci` lists it: its id
/// and a `map` entry per device (`node=pve1,path=0000:01:00.0,id=10de:2236,...`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct PciMapping {
    pub id: String,
    #[serde(default)]
    pub map: Vec<String>,
}

impl PciMapping {
    /// How many devices the mapping has on `node` (its `map` entries whose
    /// `node=` is that node).
    pub fn devices_on(&self, node: &str) -> u32 {
        self.map
            .iter()
            .filter(|entry| {
                entry
                    .split(',')
                    .any(|part| part.trim().split_once('=') == Some(("node", node)))
            })
            .count() as u32
    }
}

/// Whether `key` is `prefix` followed by a number (`hostpci0`, `usb3`).
fn is_numbered(key: &str, prefix: &str) -> bool {
    key.strip_prefix(prefix)
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The bus of a passed-through device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceBus {
    Pci,
    Usb,
}

impl DeviceBus {
    /// The mapping kind in ACL paths: `/mapping/pci/<name>`, `/mapping/usb/<name>`.
    pub fn mapping_kind(self) -> &'static str {
        match self {
            DeviceBus::Pci => "pci",
            DeviceBus::Usb => "usb",
        }
    }
}

/// One `hostpciN` or `usbN` entry of a VM config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Passthrough {
    /// `hostpci0`, `usb1`.
    pub key: String,
    pub bus: DeviceBus,
    /// `mapping=<name>`: a cluster resource mapping (`Mapping.Use` on
    /// `/mapping/<bus>/<name>` lets a non-root token clone the VM).
    pub mapping: Option<String>,
    /// `host=...` (or the key-less first part): a raw host device, which
    /// only root may clone; `spice` for a USB redirect, which anyone may.
    pub host: Option<String>,
}

impl Passthrough {
    /// Whether qemu-server lets only `root@pam` clone a VM with this device
    /// (`check_mapping_access`: a PCI device by host address, a USB device
    /// by host address other than `spice`).
    pub fn root_only(&self) -> bool {
        match (&self.mapping, &self.host) {
            (Some(_), _) => false,
            (None, Some(h)) => self.bus == DeviceBus::Pci || !h.eq_ignore_ascii_case("spice"),
            (None, None) => true,
        }
    }
}

impl VmConfig {
    /// The `hostpciN` indices the config uses.
    pub fn hostpci_indices(&self) -> Vec<u32> {
        self.other
            .keys()
            .filter(|k| is_numbered(k, "hostpci"))
            .filter_map(|k| k["hostpci".len()..].parse().ok())
            .collect()
    }

    /// How many `hostpciN` entries pass through a device of each PCI
    /// mapping the config names, by mapping.
    pub fn mapped_pci(&self) -> BTreeMap<String, u32> {
        let mut out = BTreeMap::new();
        for dev in self.passthrough() {
            if let (DeviceBus::Pci, Some(m)) = (dev.bus, dev.mapping) {
                *out.entry(m).or_default() += 1;
            }
        }
        out
    }

    /// The custom CPU model a `cpu: custom-<name>` names (a cluster
    /// resource mapping under `/mapping/cpu/<name>` from qemu-server
    /// 9.1.15), `None` for a built-in model.
    pub fn custom_cpu_model(&self) -> Option<&str> {
        let cpu = self.cpu.as_deref()?;
        let first = cpu.split(',').next().unwrap_or(cpu);
        let cputype = first.strip_prefix("cputype=").unwrap_or(first).trim();
        cputype
            .strip_prefix("custom-")
            .filter(|name| !name.is_empty())
    }

    /// The PCI (`hostpciN`) and USB (`usbN`) devices passed through, in key
    /// order: each by its cluster resource mapping, or by host address.
    pub fn passthrough(&self) -> Vec<Passthrough> {
        let mut out = Vec::new();
        for (key, value) in &self.other {
            let bus = if is_numbered(key, "hostpci") {
                DeviceBus::Pci
            } else if is_numbered(key, "usb") {
                DeviceBus::Usb
            } else {
                continue;
            };
            let Some(value) = value.as_str() else {
                continue;
            };
            let mut mapping = None;
            let mut host = None;
            for (i, part) in value.split(',').enumerate() {
                match part.trim().split_once('=') {
                    Some(("mapping", m)) => mapping = Some(m.trim().to_string()),
                    Some(("host", h)) => host = Some(h.trim().to_string()),
                    // The first, key-less part is the host address.
                    None if i == 0 && !part.trim().is_empty() => {
                        host = Some(part.trim().to_string())
                    }
                    _ => {}
                }
            }
            out.push(Passthrough {
                key: key.clone(),
                bus,
                mapping,
                host,
            });
        }
        out
    }
}

#[cfg(test)]
mod mapping_tests {
    use super::*;

    #[test]
    fn a_mapping_counts_its_devices_per_node_and_a_config_its_entries() {
        let m: PciMapping = serde_json::from_value(serde_json::json!({
            "id": "a10", "type": "pci",
            "map": ["node=pve1,path=0000:01:00.0,id=10de:2236",
                    "node=pve1,path=0000:02:00.0,id=10de:2236",
                    "node=pve10,path=0000:01:00.0,id=10de:2236"],
        }))
        .expect("mapping");
        assert_eq!(
            (
                m.devices_on("pve1"),
                m.devices_on("pve10"),
                m.devices_on("pve2")
            ),
            (2, 1, 0)
        );
        let cfg: VmConfig = serde_json::from_value(serde_json::json!({
            "hostpci0": "mapping=a10,pcie=1", "hostpci3": "mapping=other",
            "hostpci5": "0000:03:00.0", "usb0": "mapping=a10",
        }))
        .expect("config");
        let mut idx = cfg.hostpci_indices();
        idx.sort();
        assert_eq!(idx, [0, 3, 5]);
        let mapped = cfg.mapped_pci();
        assert_eq!((mapped.get("a10"), mapped.get("x")), (Some(&1), None));
        // hostpci3's `other` counts; usb0's a10 and hostpci5's address do not.
        assert_eq!(mapped.len(), 2, "{mapped:?}");
    }
}
