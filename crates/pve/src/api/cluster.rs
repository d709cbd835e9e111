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
use crate::types::{lenient, ClusterOptions, ClusterVm, NodeInfo};

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

    /// `GET /cluster/resources?type=vm`, QEMU VMs only (containers are dropped).
    /// Rows of VMs too new to have an RRD sample are completed with
    /// `status/current` (see the body). Statuses of older VMs may still be up to
    /// one sample interval (~10 s) old.
    pub async fn cluster_resources_vms(&self) -> Result<Vec<ClusterVm>, PveError> {
        let mut p = Params::new();
        p.push("type", "vm");
        let all: Vec<ClusterVm> = self
            .call("cluster_resources", Method::GET, "/cluster/resources", &p)
            .await?;
        let mut vms: Vec<ClusterVm> = all
            .into_iter()
            .filter(|v| v.kind == "qemu" || (v.kind.is_empty() && v.id.starts_with("qemu/")))
            .collect();
        // `name`, `status` and `template` come from pvestatd's RRD samples: a VM
        // created in the last ~10 s has none yet, and PVE lists it with
        // `status: "unknown"` and no name (pve-manager `API2/Cluster.pm`;
        // older servers leave `status` out). Complete those rows from the
        // owning node, which knows; only brand-new VMs cost a call. An
        // `unknown` row with a name or `template: 1` has a sample: a VM of an
        // offline node, whose last sample PVE keeps; nothing to ask. A row
        // whose node cannot answer (offline, VM gone meanwhile) stays as
        // listed.
        let unsampled = |v: &ClusterVm| {
            v.status.is_empty() || (v.status == "unknown" && v.name.is_none() && !v.template)
        };
        for v in vms.iter_mut().filter(|v| unsampled(v)) {
            match self.status_current(&v.node, v.vmid).await {
                Ok(st) => {
                    v.status = st.status;
                    v.template = st.template;
                    if v.name.is_none() {
                        v.name = st.name;
                    }
                }
                Err(e) => {
                    tracing::debug!(vmid = v.vmid, node = %v.node, error = %e, "could not complete an unsampled /cluster/resources row");
                }
            }
        }
        Ok(vms)
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
}
