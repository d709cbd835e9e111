//! Cluster-wide reads: the VM list (`/cluster/resources`), the next free
//! VMID, the datacenter options, the SDN VNets, the node list and the
//! server's release.

use http::Method;
use serde::Deserialize;
use serde_json::Value;

use crate::client::PveClient;
use crate::error::PveError;
use crate::form::Params;
use crate::sdn::SdnVnet;
use std::collections::BTreeSet;

use crate::types::{lenient, ClusterOptions, ClusterVm, ClusterVms, NodeInfo};

#[derive(Deserialize)]
struct LenientU32(#[serde(deserialize_with = "lenient::u32")] u32);

impl PveClient {
    /// `GET /cluster/nextid[?vmid=N]`: the first free VMID, or `vmid` itself if free
    /// (else 400 "VM N already exists"). Reserves nothing.
    pub async fn next_id(&self, vmid: Option<u32>) -> Result<u32, PveError> {
        let mut p = Params::new();
        p.push_opt("vmid", vmid.map(|v| v.to_string()));
        let LenientU32(id) = self
            .call("nextid", Method::GET, "/cluster/nextid", &p)
            .await?;
        Ok(id)
    }

    /// [`PveClient::cluster_vms`], the VMs only.
    pub async fn cluster_resources_vms(&self) -> Result<Vec<ClusterVm>, PveError> {
        Ok(self.cluster_vms().await?.vms)
    }

    /// The cluster's QEMU VMs (containers are dropped) and which nodes are
    /// down: `GET /nodes`, then `GET /cluster/resources?type=vm`, then, only
    /// for live nodes with rows pvestatd has not sampled yet, one
    /// `GET /nodes/{node}/qemu` per node. Statuses of older VMs may still be
    /// up to one sample interval (~10 s) old.
    ///
    /// `name`, `status` and `template` come from pvestatd's RRD samples: a
    /// VM created in the last ~10 s has none yet, and PVE lists it with
    /// `status: "unknown"` and no name (pve-manager `API2/Cluster.pm`;
    /// older servers leave `status` out). Its node knows: its VM list
    /// completes every such row of the node in one call. A node that is
    /// down is never asked: pveproxy forwards the call anyway and it fails
    /// only after the connect gives up (595 after ~3 s, each retry as
    /// long), and its VMs' rows are what PVE keeps of them (the last sample
    /// for 5 minutes, then `unknown` with no name or template), which the
    /// caller tells apart by [`ClusterVms::is_offline`]. A row whose node
    /// does not answer stays as listed.
    pub async fn cluster_vms(&self) -> Result<ClusterVms, PveError> {
        let nodes = self.nodes().await?;
        let offline_nodes: BTreeSet<String> = nodes
            .iter()
            .filter(|n| n.status != "online")
            .map(|n| n.node.clone())
            .collect();
        let mut p = Params::new();
        p.push("type", "vm");
        let all: Vec<ClusterVm> = self
            .call("cluster_resources", Method::GET, "/cluster/resources", &p)
            .await?;
        let mut vms: Vec<ClusterVm> = all
            .into_iter()
            .filter(|v| v.kind == "qemu" || (v.kind.is_empty() && v.id.starts_with("qemu/")))
            .collect();
        // An `unknown` row with a name or `template: 1` has a sample.
        let unsampled = |v: &ClusterVm| {
            v.status.is_empty() || (v.status == "unknown" && v.name.is_none() && !v.template)
        };
        let to_ask: BTreeSet<String> = vms
            .iter()
            .filter(|v| unsampled(v) && !offline_nodes.contains(&v.node))
            .map(|v| v.node.clone())
            .collect();
        for node in to_ask {
            let listed = match self.node_vms(&node).await {
                Ok(l) => l,
                Err(e) => {
                    tracing::debug!(node = %node, error = %e, "could not complete the unsampled /cluster/resources rows of a node");
                    continue;
                }
            };
            for v in vms.iter_mut().filter(|v| v.node == node && unsampled(v)) {
                // Gone meanwhile: listed as PVE listed it.
                let Some(n) = listed.iter().find(|n| n.vmid == v.vmid) else {
                    continue;
                };
                v.status.clone_from(&n.status);
                v.template = n.template;
                if v.name.is_none() {
                    v.name.clone_from(&n.name);
                }
            }
        }
        Ok(ClusterVms {
            vms,
            offline_nodes: offline_nodes.into_iter().collect(),
        })
    }

    /// `GET /version`: the release, e.g. `8.3` (`release` is missing on
    /// very old servers, where `version` is used).
    pub async fn release(&self) -> Result<String, PveError> {
        let v: Value = self
            .call("version", Method::GET, "/version", &Params::new())
            .await?;
        Ok(v.get("release")
            .or_else(|| v.get("version"))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string())
    }

    /// `GET /cluster/options`: the datacenter options (`user-tag-access`).
    pub async fn cluster_options(&self) -> Result<ClusterOptions, PveError> {
        let v: Value = self
            .call(
                "cluster_options",
                Method::GET,
                "/cluster/options",
                &Params::new(),
            )
            .await?;
        Ok(ClusterOptions::from_value(&v))
    }

    /// `GET /cluster/sdn/vnets`: the SDN VNets, each with its zone. PVE
    /// lists only those on whose `/sdn/zones/<zone>/<vnet>` the token holds
    /// `SDN.Audit` or `SDN.Allocate` (an empty list, not a 403, when it
    /// holds neither anywhere); without SDN installed the path does not
    /// exist (501 `Method 'GET /cluster/sdn/vnets' not implemented`).
    pub async fn sdn_vnets(&self) -> Result<Vec<SdnVnet>, PveError> {
        self.call(
            "sdn_vnets",
            Method::GET,
            "/cluster/sdn/vnets",
            &Params::new(),
        )
        .await
    }

    /// `GET /nodes/{node}/qemu`: the node's QEMU VMs, templates included, as
    /// the node itself reports them (qemu-server `vmstatus`): `status`,
    /// `maxmem` (the configured memory in bytes), `lock` and `template` are
    /// current, without the RRD lag of `/cluster/resources`. Its rows carry
    /// no `node`; it is filled in. Lists only the VMs the token may audit.
    pub async fn node_vms(&self, node: &str) -> Result<Vec<ClusterVm>, PveError> {
        let path = format!("/nodes/{}/qemu", crate::form::encode_segment(node));
        let mut vms: Vec<ClusterVm> = self
            .call("node_vms", Method::GET, &path, &Params::new())
            .await?;
        for v in &mut vms {
            v.node = node.to_string();
            if v.id.is_empty() {
                v.id = format!("qemu/{}", v.vmid);
            }
            if v.kind.is_empty() {
                v.kind = "qemu".to_string();
            }
        }
        Ok(vms)
    }

    /// `GET /nodes`.
    pub async fn nodes(&self) -> Result<Vec<NodeInfo>, PveError> {
        self.call("nodes", Method::GET, "/nodes", &Params::new())
            .await
    }

    /// `GET /cluster/mapping/pci`: the PCI resource mappings the token may
    /// see (any of `Mapping.Audit`, `Mapping.Use`, `Mapping.Modify` on
    /// `/mapping/pci/<id>`; the others are left out, not refused).
    pub async fn pci_mappings(&self) -> Result<Vec<crate::PciMapping>, PveError> {
        self.call(
            "pci_mappings",
            Method::GET,
            "/cluster/mapping/pci",
            &Params::new(),
        )
        .await
    }
}
