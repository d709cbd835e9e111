//! Devices a VM passes through (`hostpciN`, `usbN`) and its CPU model, as
//! far as cloning it is concerned: which resource mappings a clone is
//! checked on, and which devices only root may clone.

use crate::types::VmConfig;

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
