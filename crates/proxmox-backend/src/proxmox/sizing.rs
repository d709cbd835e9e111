//! What a clone must be told so that it is exactly its instance type, not
//! what its template happened to carry.
//!
//! A clone copies every key of its template (qemu-server `clone_vm`), and
//! some of those decide the guest's size as much as `cores` and `memory`:
//!
//! - `balloon`: PVE refuses a `memory` below the balloon in force
//!   (`balloon value too large`, `API2/Qemu.pm` `$load_and_check_config`),
//!   and a template balloon below the type's memory lets host
//!   auto-ballooning shrink the guest to it. The clone gets the type's
//!   balloon (its memory unless the catalog says otherwise) in the same
//!   PUT; a template with ballooning off (`balloon: 0`) keeps it off.
//! - `sockets` and `vcpus`: qemu-server boots `sockets` x `cores` vCPUs, or
//!   `vcpus` of them when set (`config_to_command`). The clone gets
//!   `sockets=1` and loses `vcpus`, so `cores` is the whole story.
//! - tags: PVE checks tags removed as well as added
//!   (pve-guest-common `assert_tag_permissions`), so replacing a template's
//!   registered or unlisted tags is a 403 where adding ours is not. The
//!   clone keeps its template's tags beside ours.
//! - mapped PCI devices (an instance type's `pci`): the clone gets as many
//!   `hostpciN: mapping=<name>` entries as the type asks for, counting
//!   those of the same mapping it already has (from its template, or from
//!   an earlier marking of the same VM), in indices it does not use yet.

use std::collections::BTreeMap;

use pve::VmConfig;

use super::options::TypeDevices;

/// The most `hostpciN` entries a VM has (`hostpci0` to `hostpci15`).
const HOSTPCI_SLOTS: u32 = 16;

/// The settings a clone copied from its source that the sizing PUT must
/// take into account.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Inherited {
    /// The source's `balloon` (MiB): `Some(0)` = ballooning off.
    pub(super) balloon_mib: Option<u64>,
    /// The source's tags, normalised as PVE returns them.
    pub(super) tags: Vec<String>,
    /// The `hostpciN` indices the source uses.
    pub(super) hostpci: Vec<u32>,
    /// Its mapped PCI devices, by mapping.
    pub(super) mapped: BTreeMap<String, u32>,
}

impl Inherited {
    /// What `cfg` (a template's, or a clone's own) hands on.
    pub(super) fn of(cfg: &VmConfig) -> Inherited {
        Inherited {
            balloon_mib: cfg.balloon,
            tags: cfg.tags.clone(),
            hostpci: cfg.hostpci_indices(),
            mapped: cfg.mapped_pci(),
        }
    }

    /// The `hostpciN` entries to add so the VM has `dev.count` devices of
    /// its mapping, in the lowest free indices; `Err` names why they do not
    /// fit in PVE's 16.
    pub(super) fn pci_entries(&self, dev: &TypeDevices) -> Result<BTreeMap<u32, String>, String> {
        let have = self.mapped.get(&dev.mapping).copied().unwrap_or(0);
        let want = dev.count.saturating_sub(have);
        let free: Vec<u32> = (0..HOSTPCI_SLOTS)
            .filter(|n| !self.hostpci.contains(n))
            .take(want as usize)
            .collect();
        if (free.len() as u32) < want {
            return Err(format!(
                "{want} more hostpci entries of mapping {} do not fit beside the {} the template \
                 uses (PVE allows hostpci0 to hostpci{})",
                dev.mapping,
                self.hostpci.len(),
                HOSTPCI_SLOTS - 1
            ));
        }
        Ok(free.into_iter().map(|n| (n, dev.entry())).collect())
    }

    /// The clone's `balloon` for a type of `memory_mib` whose catalog entry
    /// may name one: `None` = send none (the source has ballooning off,
    /// and 0 passes PVE's check whatever the memory).
    pub(super) fn balloon(&self, memory_mib: u64, type_balloon: Option<u64>) -> Option<u64> {
        match (type_balloon, self.balloon_mib) {
            (Some(b), _) => Some(b.min(memory_mib)),
            (None, Some(0)) => None,
            (None, _) => Some(memory_mib),
        }
    }

    /// The source's tags with `ours` added (each once): only the added
    /// tags are new to the VM, so only they meet PVE's tag checks.
    pub(super) fn tags_with(&self, ours: &[String]) -> Vec<String> {
        let mut out = self.tags.clone();
        for tag in ours {
            if !out.iter().any(|t| t.eq_ignore_ascii_case(tag)) {
                out.push(tag.clone());
            }
        }
        out
    }
}

/// Keys a clone loses in its sizing PUT: `protection` (a protected VM
/// cannot be destroyed, and PVE copies the template's flag onto clones)
/// and `vcpus` (it would cap the type's `cores`). PVE skips, with a
/// warning, a key that is not set.
pub(super) const CLEARED_KEYS: [&str; 2] = ["protection", "vcpus"];

#[cfg(test)]
mod tests {
    use super::*;

    fn inherited(balloon: Option<u64>, tags: &[&str]) -> Inherited {
        Inherited {
            balloon_mib: balloon,
            tags: tags.iter().map(|t| t.to_string()).collect(),
            ..Inherited::default()
        }
    }

    fn gpus(count: u32, pcie: bool) -> TypeDevices {
        TypeDevices {
            mapping: "a10".into(),
            count,
            pcie,
            nodes: vec!["pve1".into()],
        }
    }

    #[test]
    fn mapped_devices_fill_the_free_indices_and_count_what_the_vm_has() {
        let cfg: VmConfig = serde_json::from_value(serde_json::json!({
            "hostpci0": "mapping=nic", "hostpci2": "mapping=a10",
        }))
        .expect("config");
        let got = Inherited::of(&cfg);
        // One a10 already: two more, in 1 and 3.
        let entries = got.pci_entries(&gpus(3, true)).expect("fits");
        assert_eq!(
            entries.into_iter().collect::<Vec<_>>(),
            [
                (1, "mapping=a10,pcie=1".to_string()),
                (3, "mapping=a10,pcie=1".to_string())
            ]
        );
        // Marking again (the VM has them all) adds none.
        assert!(got.pci_entries(&gpus(1, false)).expect("fits").is_empty());
        let full = Inherited {
            hostpci: (0..15).collect(),
            ..Inherited::default()
        };
        let e = full
            .pci_entries(&gpus(2, false))
            .expect_err("one slot left");
        assert!(e.contains("2 more hostpci entries of mapping a10"), "{e}");
    }

    #[test]
    fn the_balloon_is_the_types_memory_unless_the_catalog_or_the_template_says_otherwise() {
        // A template balloon above or below the type's memory: the type's.
        assert_eq!(inherited(Some(8192), &[]).balloon(2048, None), Some(2048));
        assert_eq!(inherited(Some(1024), &[]).balloon(4096, None), Some(4096));
        assert_eq!(inherited(None, &[]).balloon(4096, None), Some(4096));
        // Ballooning off in the template stays off.
        assert_eq!(inherited(Some(0), &[]).balloon(4096, None), None);
        // The catalog's, never above the memory.
        assert_eq!(
            inherited(Some(0), &[]).balloon(4096, Some(1024)),
            Some(1024)
        );
        assert_eq!(inherited(None, &[]).balloon(4096, Some(8192)), Some(4096));
        assert_eq!(inherited(Some(2048), &[]).balloon(4096, Some(0)), Some(0));
    }

    #[test]
    fn tags_are_added_to_the_templates_not_put_in_their_place() {
        let ours = vec!["bigfleet".to_string(), "bigfleet-m-1".to_string()];
        assert_eq!(
            inherited(None, &["golden", "bigfleet"]).tags_with(&ours),
            vec!["golden", "bigfleet", "bigfleet-m-1"]
        );
        assert_eq!(inherited(None, &[]).tags_with(&ours), ours);
    }

    #[test]
    fn inherited_settings_come_from_the_config() {
        let cfg: VmConfig = serde_json::from_value(serde_json::json!({
            "balloon": 1024, "tags": "Golden;team-a", "vcpus": 2, "sockets": 2
        }))
        .expect("config");
        let got = Inherited::of(&cfg);
        assert_eq!(got.balloon_mib, Some(1024));
        assert_eq!(got.tags.len(), 2);
    }
}
