//! SDN: the VNets `GET /cluster/sdn/vnets` lists, and where PVE checks a
//! NIC's right to its bridge (`SDN.Use` on `/sdn/zones/<zone>/<bridge>`, or
//! on a VLAN below it).
//!
//! PVE 8 and newer check every NIC of a VM being created, cloned or
//! restored (qemu-server `check_bridge_access`, pve-guest-common
//! `check_vnet_access`): a plain Linux bridge sits in the `localnetwork`
//! zone, an SDN VNet in its own zone, which only the SDN configuration says.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;

use crate::types::{lenient, VmConfig};

/// The zone every bridge that is not an SDN VNet is checked in.
pub const LOCAL_ZONE: &str = "localnetwork";

/// One VNet of `GET /cluster/sdn/vnets` (pve-network's index: the VNet's
/// section of `sdn/vnets.cfg`). PVE lists only the VNets on whose
/// `/sdn/zones/<zone>/<vnet>` the token holds `SDN.Audit` or `SDN.Allocate`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct SdnVnet {
    /// The VNet's name: what a NIC names as its `bridge`.
    pub vnet: String,
    /// The zone the VNet belongs to.
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub zone: Option<String>,
    /// The VNet's own VLAN tag (VLAN and QinQ zones) or VXLAN VNI (VXLAN
    /// and EVPN zones): not a NIC's `tag`, and not part of any ACL path.
    #[serde(default, deserialize_with = "lenient::opt_u32")]
    pub tag: Option<u32>,
    /// The VNet's alias, shown beside its name.
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub alias: Option<String>,
    /// Whether VLANs (a NIC's `tag` or `trunks`) pass through the VNet.
    #[serde(default, deserialize_with = "lenient::bool")]
    pub vlanaware: bool,
}

/// The zone of each SDN VNet, by VNet name: what a NIC's bridge is looked up
/// in to find the zone PVE checks it in.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VnetZones(BTreeMap<String, String>);

impl VnetZones {
    /// The zones of `vnets`; a VNet without a zone (never in a valid
    /// configuration) is left out.
    pub fn new(vnets: &[SdnVnet]) -> VnetZones {
        VnetZones(
            vnets
                .iter()
                .filter_map(|v| Some((v.vnet.clone(), v.zone.clone()?)))
                .collect(),
        )
    }

    /// The zone of VNet `bridge`, `None` when it is not a known VNet.
    pub fn zone(&self, bridge: &str) -> Option<&str> {
        self.0.get(bridge).map(String::as_str)
    }
}

/// Where PVE checks `SDN.Use` for a NIC: its bridge, or one VLAN of it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SdnPath {
    /// The bridge's zone: the VNet's own, or [`LOCAL_ZONE`].
    pub zone: String,
    /// The bridge (or VNet) the NIC is on.
    pub bridge: String,
    /// The VLAN, for a NIC with a `tag` or `trunks`.
    pub vlan: Option<u32>,
}

impl fmt::Display for SdnPath {
    /// The ACL path: `/sdn/zones/<zone>/<bridge>[/<vlan>]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "/sdn/zones/{}/{}", self.zone, self.bridge)?;
        if let Some(vlan) = self.vlan {
            write!(f, "/{vlan}")?;
        }
        Ok(())
    }
}

/// The VLANs of a NIC's `trunks` (`10;20-30`), as pve-guest-common's
/// `get_tags_from_trunk` expands them: a range whose end is not above its
/// start stands for its start alone. Parts that are not numbers (which
/// PVE's schema refuses) are skipped.
fn trunk_vlans(trunks: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for trunk in trunks.split(';').map(str::trim).filter(|t| !t.is_empty()) {
        let (start, end) = trunk.split_once('-').unwrap_or((trunk, ""));
        let Ok(start) = start.trim().parse::<u32>() else {
            continue;
        };
        match end.trim().parse::<u32>() {
            Ok(end) if end > start => out.extend(start..=end),
            _ => out.push(start),
        }
    }
    out
}

impl VmConfig {
    /// The paths a clone (or creation) of this VM needs `SDN.Use` on, as
    /// pve-guest-common `check_vnet_access` checks each NIC (`netN`) with a
    /// bridge: in the VNet's zone from `zones`, else [`LOCAL_ZONE`]; on
    /// `.../<bridge>/<vlan>` for the NIC's `tag` and for each VLAN of its
    /// `trunks`, and on the bridge's own path only for a NIC with neither.
    /// Sorted and deduplicated.
    pub fn sdn_paths(&self, zones: &VnetZones) -> Vec<SdnPath> {
        let mut out = Vec::new();
        for nic in self.nics() {
            let field = |name: &str| {
                nic.split(',')
                    .find_map(|part| part.trim().strip_prefix(name))
                    .map(str::trim)
                    .filter(|x| !x.is_empty())
            };
            let Some(bridge) = field("bridge=") else {
                continue;
            };
            let zone = zones.zone(bridge).unwrap_or(LOCAL_ZONE);
            let path = |vlan| SdnPath {
                zone: zone.to_string(),
                bridge: bridge.to_string(),
                vlan,
            };
            let mut vlans: Vec<u32> = field("tag=")
                .and_then(|t| t.parse().ok())
                .into_iter()
                .collect();
            vlans.extend(field("trunks=").map(trunk_vlans).unwrap_or_default());
            if vlans.is_empty() {
                out.push(path(None));
            } else {
                out.extend(vlans.into_iter().map(|v| path(Some(v))));
            }
        }
        out.sort();
        out.dedup();
        out
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn config(nics: serde_json::Value) -> VmConfig {
        serde_json::from_value(nics).expect("a config")
    }

    fn paths(c: &VmConfig, zones: &VnetZones) -> Vec<String> {
        c.sdn_paths(zones).iter().map(SdnPath::to_string).collect()
    }

    #[test]
    fn a_nic_is_checked_in_its_vnets_zone_on_its_vlan() {
        let c = config(json!({
            "net0": "virtio=BC:24:11:00:23:28,bridge=vmbr0,firewall=1",
            "net1": "e1000=BC:24:11:00:23:29, bridge=vnet7 ,tag=20",
            "net2": "virtio=BC:24:11:00:23:30,bridge=vmbr0",
            "net3": "virtio=BC:24:11:00:23:31",
            "netx": "bridge=not-a-nic",
            "scsi0": "local-lvm:vm-1-disk-0,size=8G"
        }));
        assert_eq!(
            paths(&c, &VnetZones::default()),
            vec![
                "/sdn/zones/localnetwork/vmbr0",
                "/sdn/zones/localnetwork/vnet7/20"
            ]
        );
        let zones = VnetZones::new(&[SdnVnet {
            vnet: "vnet7".into(),
            zone: Some("z1".into()),
            ..SdnVnet::default()
        }]);
        assert_eq!(
            paths(&c, &zones),
            vec!["/sdn/zones/localnetwork/vmbr0", "/sdn/zones/z1/vnet7/20"]
        );
        assert_eq!(zones.zone("vnet7"), Some("z1"));
        assert_eq!(zones.zone("vmbr0"), None);
    }

    #[test]
    fn trunks_are_checked_vlan_by_vlan_with_the_tag() {
        let c = config(json!({
            "net0": "virtio=BC:24:11:00:23:28,bridge=vmbr1,trunks=10;20-22;30-30;40-35"
        }));
        assert_eq!(
            paths(&c, &VnetZones::default()),
            ["10", "20", "21", "22", "30", "40"]
                .iter()
                .map(|v| format!("/sdn/zones/localnetwork/vmbr1/{v}"))
                .collect::<Vec<_>>()
        );
        // A tag and trunks: both, never the bridge itself.
        let c = config(json!({
            "net0": "virtio=BC:24:11:00:23:28,bridge=vmbr1,tag=5,trunks=6;5"
        }));
        assert_eq!(
            paths(&c, &VnetZones::default()),
            vec![
                "/sdn/zones/localnetwork/vmbr1/5",
                "/sdn/zones/localnetwork/vmbr1/6"
            ]
        );
        assert_eq!(trunk_vlans("x;7-y;"), vec![7]);
    }

    #[test]
    fn the_vnet_index_decodes_leniently() {
        let vnets: Vec<SdnVnet> = serde_json::from_value(json!([
            {"vnet": "vnet7", "zone": "z1", "type": "vnet", "digest": "ab",
             "tag": "100", "vlanaware": 1, "alias": "prod"},
            {"vnet": "bare", "type": "vnet"}
        ]))
        .expect("decodes");
        assert_eq!(vnets[0].zone.as_deref(), Some("z1"));
        assert_eq!(
            (vnets[0].tag, vnets[0].vlanaware, vnets[0].alias.as_deref()),
            (Some(100), true, Some("prod"))
        );
        let zones = VnetZones::new(&vnets);
        assert_eq!(
            (zones.zone("vnet7"), zones.zone("bare")),
            (Some("z1"), None)
        );
    }
}
