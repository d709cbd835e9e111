//! The preflight's SDN check: may this token put a clone's NICs on the
//! templates' bridges?
//!
//! PVE 8 and newer check every NIC of a VM being cloned, for every API
//! token (qemu-server `clone_vm` calls `check_bridge_access` on the source
//! config; only `root@pam` itself is exempt), as pve-guest-common
//! `check_vnet_access` does: `SDN.Use` on `/sdn/zones/<zone>/<bridge>`, or
//! on `.../<bridge>/<vlan>` for the NIC's `tag` and each VLAN of its
//! `trunks`. `<zone>` is an SDN VNet's own zone, looked up here in `GET
//! /cluster/sdn/vnets`, and `localnetwork` for any other bridge.
//!
//! A gap on a VNet the listing shows is certain: every clone of the
//! template fails `Permission check failed`, so start-up is refused. A
//! bridge the listing does not show is checked in `localnetwork` and a gap
//! is only warned of: PVE lists a VNet only to a token holding `SDN.Audit`
//! or `SDN.Allocate` on its path, so the bridge may be a VNet this token
//! cannot see (and may use, in its zone). When the listing fails (no SDN
//! installed answers 501), every bridge is checked in `localnetwork` and
//! warned of in the same way.

use std::collections::{BTreeMap, BTreeSet};

use futures::stream::{self, StreamExt};
use pve::{PveError, SdnPath, VmConfig, VnetZones};
use tokio::time::Instant;

use super::super::api::Api;

/// Permission reads in flight at once: each VLAN of a trunk is a path of
/// its own, and a trunk may span thousands of them.
const READS_IN_FLIGHT: usize = 8;

/// What the check found: warnings to log, and the gaps that make every
/// clone of a template fail (the start-up refusal's text).
#[derive(Default)]
pub(in crate::proxmox) struct Findings {
    pub(in crate::proxmox) warnings: Vec<String>,
    pub(in crate::proxmox) refusal: Option<String>,
}

/// The VNets' zones, or why they could not be looked up.
enum Lookup {
    Listed(VnetZones),
    Failed(PveError),
}

impl Lookup {
    fn zones(&self) -> VnetZones {
        match self {
            Lookup::Listed(z) => z.clone(),
            Lookup::Failed(_) => VnetZones::default(),
        }
    }
}

/// The NICs of one (zone, bridge) the token may not use: the bridge itself,
/// or some of its VLANs; and the templates with such a NIC.
#[derive(Default)]
struct Gap {
    vlans: BTreeSet<u32>,
    templates: BTreeSet<u32>,
}

/// Checks `SDN.Use` on every path the templates' NICs (`configs`, by
/// template VMID) are checked on. A path whose privileges cannot be read is
/// skipped: the clone itself names a missing privilege.
pub(in crate::proxmox) async fn check(api: &Api, configs: &[(u32, VmConfig)]) -> Findings {
    let bridged = configs
        .iter()
        .any(|(_, c)| !c.sdn_paths(&VnetZones::default()).is_empty());
    if !bridged {
        return Findings::default();
    }
    let lookup = match api
        .retry_raw(None, Instant::now() + super::READ_RETRY, |pve| {
            pve.sdn_vnets()
        })
        .await
    {
        Ok(vnets) => Lookup::Listed(VnetZones::new(&vnets)),
        Err(e) => Lookup::Failed(e),
    };
    let zones = lookup.zones();
    let mut users: BTreeMap<SdnPath, Vec<u32>> = BTreeMap::new();
    for (t, config) in configs {
        for path in config.sdn_paths(&zones) {
            users.entry(path).or_default().push(*t);
        }
    }
    // Each read owns its path: a closure over borrowed paths makes this
    // future `Send` only for one lifetime, which a caller spawning it as a
    // task cannot use.
    let reads = stream::iter(users.keys().cloned().map(|path| async move {
        let acl = path.to_string();
        let deadline = Instant::now() + super::READ_RETRY;
        let held = match api
            .retry_raw(None, deadline, |pve| pve.permissions(Some(&acl)))
            .await
        {
            Ok(mut p) => p.remove(&acl).unwrap_or_default(),
            Err(_) => return None,
        };
        (!held.contains("SDN.Use")).then_some(path)
    }))
    .buffered(READS_IN_FLIGHT)
    .collect::<Vec<_>>()
    .await;
    // Grouped by bridge (and whether VLANs are checked), so that a trunk's
    // many VLANs make one finding.
    let mut gaps: BTreeMap<(String, String, bool), Gap> = BTreeMap::new();
    for path in reads.into_iter().flatten() {
        let gap = gaps
            .entry((path.zone.clone(), path.bridge.clone(), path.vlan.is_some()))
            .or_default();
        gap.vlans.extend(path.vlan);
        gap.templates
            .extend(users.get(&path).into_iter().flatten().copied());
    }
    let token = api.token_id();
    let mut findings = Findings::default();
    let mut refused = Vec::new();
    for ((zone, bridge, _), gap) in &gaps {
        let text = Finding {
            zone,
            bridge,
            gap,
            token,
        };
        match &lookup {
            Lookup::Listed(z) if z.zone(bridge).is_some() => refused.push(text.refusal()),
            Lookup::Listed(_) => findings.warnings.push(text.warning(&format!(
                "{bridge} is not an SDN VNet this token can see: if it is one, PVE checks it in \
                 the VNet's zone instead of localnetwork, and SDN.Audit on \
                 /sdn/zones/<zone>/{bridge} lets this check look the zone up"
            ))),
            Lookup::Failed(e) => findings.warnings.push(text.warning(&format!(
                "the SDN VNets could not be listed (GET /cluster/sdn/vnets: {e}), so the zone of \
                 {bridge} could not be looked up and localnetwork was assumed: if {bridge} is an \
                 SDN VNet, PVE checks it in the VNet's zone, and SDN.Audit on \
                 /sdn/zones/<zone>/{bridge} lets this check look the zone up"
            ))),
        }
    }
    if !refused.is_empty() {
        findings.refusal = Some(refused.join(" | "));
    }
    findings
}

/// The words of one gap.
struct Finding<'a> {
    zone: &'a str,
    bridge: &'a str,
    gap: &'a Gap,
    token: &'a str,
}

impl Finding<'_> {
    fn bridge_path(&self) -> String {
        format!("/sdn/zones/{}/{}", self.zone, self.bridge)
    }

    /// The paths lacking: the bridge's, one VLAN's, or several VLANs'.
    fn paths(&self) -> String {
        match self.gap.vlans.len() {
            0 => self.bridge_path(),
            1 => format!("{}/{}", self.bridge_path(), vlan_list(&self.gap.vlans)),
            _ => format!(
                "{}/<vlan> for VLANs {}",
                self.bridge_path(),
                vlan_list(&self.gap.vlans)
            ),
        }
    }

    /// The path PVE's refusal names: the first it checks and finds lacking.
    fn first_path(&self) -> String {
        match self.gap.vlans.first() {
            Some(v) => format!("{}/{v}", self.bridge_path()),
            None => self.bridge_path(),
        }
    }

    /// `, VLAN 20` or `, VLANs 10, 20-30`: what the NIC carries.
    fn vlans(&self) -> String {
        match self.gap.vlans.len() {
            0 => String::new(),
            1 => format!(", VLAN {}", vlan_list(&self.gap.vlans)),
            _ => format!(", VLANs {}", vlan_list(&self.gap.vlans)),
        }
    }

    /// The grant: the one path, or the bridge's, whose grant propagates to
    /// every VLAN below it.
    fn grant(&self) -> String {
        let path = match self.gap.vlans.len() {
            0 | 1 => self.first_path(),
            _ => self.bridge_path(),
        };
        format!(
            "`pveum acl modify {path} --tokens '{}' --roles PVESDNUser`",
            self.token
        )
    }

    fn templates(&self) -> String {
        let ids: Vec<String> = self.gap.templates.iter().map(u32::to_string).collect();
        ids.join(", ")
    }

    /// A bridge whose zone is assumed: the fix, then why it may be wrong.
    fn warning(&self, zone_note: &str) -> String {
        format!(
            "the API token lacks SDN.Use on {}: on Proxmox VE 8 and newer every clone of \
             template {} (a NIC on bridge {}{}) is refused with `Permission check failed ({}, \
             SDN.Use)`. Grant it with {} (deploy/host-setup/setup-token.sh --bridge {} does \
             this); {zone_note}",
            self.paths(),
            self.templates(),
            self.bridge,
            self.vlans(),
            self.first_path(),
            self.grant(),
            self.bridge,
        )
    }

    /// A VNet the listing shows: the path is the one PVE checks.
    fn refusal(&self) -> String {
        format!(
            "the API token lacks SDN.Use on {}: every clone of template {} (a NIC on SDN VNet \
             {} of zone {}{}) is refused with `Permission check failed ({}, SDN.Use)`, as \
             Proxmox VE 8 and newer check each NIC of a clone. Grant it with {} \
             (deploy/host-setup/setup-token.sh --bridge {} --sdn-zone {} does this)",
            self.paths(),
            self.templates(),
            self.bridge,
            self.zone,
            self.vlans(),
            self.first_path(),
            self.grant(),
            self.bridge,
            self.zone,
        )
    }
}

/// `10, 20-30`: sorted VLANs, runs as ranges.
fn vlan_list(vlans: &BTreeSet<u32>) -> String {
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for &v in vlans {
        match runs.last_mut() {
            Some((_, end)) if end.checked_add(1) == Some(v) => *end = v,
            _ => runs.push((v, v)),
        }
    }
    let parts: Vec<String> = runs
        .iter()
        .map(|(a, b)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}-{b}")
            }
        })
        .collect();
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vlans_read_as_ranges() {
        let set = |v: &[u32]| v.iter().copied().collect::<BTreeSet<u32>>();
        assert_eq!(vlan_list(&set(&[20])), "20");
        assert_eq!(vlan_list(&set(&[10, 20, 21, 22, 30])), "10, 20-22, 30");
        assert_eq!(vlan_list(&set(&[])), "");
    }
}
