//! One VM: clone it, read and change its config, read its status, start
//! and stop it, migrate it, turn it into a template, destroy it. Calls that
//! run as a worker task return its [`Upid`].

use http::Method;
use serde_json::Value;

use super::vm_path;
use crate::client::PveClient;
use crate::error::PveError;
use crate::form::Params;
use crate::tags::join_tags;
use crate::types::{CloneParams, ConfigParams, MigrateParams, VmConfig, VmStatus};
use crate::upid::Upid;

/// The form of a config change; refuses one that changes nothing.
fn config_params(params: &ConfigParams) -> Result<Params, PveError> {
    let mut p = Params::new();
    p.push_opt("cores", params.cores.map(|v| v.to_string()));
    p.push_opt("sockets", params.sockets.map(|v| v.to_string()));
    p.push_opt("memory", params.memory.map(|v| v.to_string()));
    p.push_opt("balloon", params.balloon.map(|v| v.to_string()));
    p.push_opt("description", params.description.as_deref());
    p.push_opt("tags", params.tags.as_ref().map(|t| join_tags(t)));
    p.push_opt("digest", params.digest.as_deref());
    if !params.delete.is_empty() {
        p.push("delete", params.delete.join(","));
    }
    for (n, value) in &params.hostpci {
        p.push(&format!("hostpci{n}"), value);
    }
    if p.is_empty() {
        return Err(PveError::InvalidArgument(
            "config update has no fields set".into(),
        ));
    }
    Ok(p)
}

/// A size as `resize` reads it: whole GiB as `NG`, else bytes.
fn size_param(bytes: u64) -> String {
    if bytes.is_multiple_of(1 << 30) {
        format!("{}G", bytes >> 30)
    } else {
        bytes.to_string()
    }
}

impl PveClient {
    /// `POST /nodes/{node}/qemu/{template}/clone` (to the template's own node).
    /// Returns the `qmclone` task.
    pub async fn clone_vm(
        &self,
        node: &str,
        template_vmid: u32,
        params: &CloneParams,
    ) -> Result<Upid, PveError> {
        let mut p = Params::new();
        p.push("newid", params.newid.to_string());
        p.push_opt("name", params.name.as_deref());
        p.push_opt("description", params.description.as_deref());
        p.push_opt("pool", params.pool.as_deref());
        if let Some(full) = params.full {
            p.push_bool("full", full);
        }
        p.push_opt("storage", params.storage.as_deref());
        p.push_opt("target", params.target.as_deref());
        let path = vm_path(node, template_vmid, "/clone");
        self.call_upid("clone", Method::POST, &path, &p).await
    }

    /// `PUT /nodes/{node}/qemu/{vmid}/config`: applies synchronously.
    pub async fn set_config_sync(
        &self,
        node: &str,
        vmid: u32,
        params: &ConfigParams,
    ) -> Result<(), PveError> {
        let p = config_params(params)?;
        let _: Value = self
            .call(
                "config_put",
                Method::PUT,
                &vm_path(node, vmid, "/config"),
                &p,
            )
            .await?;
        Ok(())
    }

    /// `POST /nodes/{node}/qemu/{vmid}/config`: applies in a worker task.
    pub async fn set_config_async(
        &self,
        node: &str,
        vmid: u32,
        params: &ConfigParams,
    ) -> Result<Upid, PveError> {
        let p = config_params(params)?;
        self.call_upid(
            "config_post",
            Method::POST,
            &vm_path(node, vmid, "/config"),
            &p,
        )
        .await
    }

    /// `PUT /nodes/{node}/qemu/{vmid}/resize`: grows `disk` to `bytes`
    /// (an absolute size, so a repeat is harmless; PVE refuses to shrink).
    /// qemu-server 8.0 and later run it as a `resize` task.
    pub async fn resize_disk(
        &self,
        node: &str,
        vmid: u32,
        disk: &str,
        bytes: u64,
    ) -> Result<Upid, PveError> {
        let mut p = Params::new();
        p.push("disk", disk);
        p.push("size", size_param(bytes));
        self.call_upid("resize", Method::PUT, &vm_path(node, vmid, "/resize"), &p)
            .await
    }

    /// `GET /nodes/{node}/qemu/{vmid}/config`.
    pub async fn get_config(&self, node: &str, vmid: u32) -> Result<VmConfig, PveError> {
        self.call(
            "config_get",
            Method::GET,
            &vm_path(node, vmid, "/config"),
            &Params::new(),
        )
        .await
    }

    /// `POST .../status/start` (for HA-managed VMs an `hastart` that only queues).
    pub async fn start(&self, node: &str, vmid: u32) -> Result<Upid, PveError> {
        let path = vm_path(node, vmid, "/status/start");
        self.call_upid("start", Method::POST, &path, &Params::new())
            .await
    }

    /// `POST .../status/stop` (hard stop; `hastop` for HA-managed VMs).
    pub async fn stop(&self, node: &str, vmid: u32) -> Result<Upid, PveError> {
        let path = vm_path(node, vmid, "/status/stop");
        self.call_upid("stop", Method::POST, &path, &Params::new())
            .await
    }

    /// `GET .../status/current`.
    pub async fn status_current(&self, node: &str, vmid: u32) -> Result<VmStatus, PveError> {
        let path = vm_path(node, vmid, "/status/current");
        self.call("status_current", Method::GET, &path, &Params::new())
            .await
    }

    /// `DELETE /nodes/{node}/qemu/{vmid}?purge=1&destroy-unreferenced-disks=1`:
    /// also frees disks named after the VMID that its config does not
    /// reference (a half-made clone's). To find those, PVE activates every
    /// storage holding images on the node, so one that is unreachable fails
    /// the task (`storage 'X' is not online`) after the VM's own disks were
    /// freed, with its config left; see [`PveClient::destroy_referenced`].
    pub async fn destroy(&self, node: &str, vmid: u32) -> Result<Upid, PveError> {
        let mut p = Params::new();
        p.push_bool("purge", true);
        p.push_bool("destroy-unreferenced-disks", true);
        self.call_upid("destroy", Method::DELETE, &vm_path(node, vmid, ""), &p)
            .await
    }

    /// `DELETE /nodes/{node}/qemu/{vmid}?purge=1`: frees only the disks the
    /// config references, touching no other storage.
    pub async fn destroy_referenced(&self, node: &str, vmid: u32) -> Result<Upid, PveError> {
        let mut p = Params::new();
        p.push_bool("purge", true);
        self.call_upid("destroy", Method::DELETE, &vm_path(node, vmid, ""), &p)
            .await
    }

    /// `POST .../migrate`: moves the VM to `params.target` (offline unless
    /// `online`). Returns the `qmigrate` task (`hamigrate` for HA-managed VMs).
    pub async fn migrate(
        &self,
        node: &str,
        vmid: u32,
        params: &MigrateParams,
    ) -> Result<Upid, PveError> {
        let mut p = Params::new();
        p.push("target", params.target.as_str());
        p.push_bool("online", params.online);
        if params.with_local_disks {
            p.push_bool("with-local-disks", true);
        }
        p.push_opt("targetstorage", params.targetstorage.as_deref());
        let path = vm_path(node, vmid, "/migrate");
        self.call_upid("migrate", Method::POST, &path, &p).await
    }

    /// `POST .../template`: converts a stopped VM into a template (its disks
    /// become base volumes). Returns the `qmtemplate` task.
    pub async fn convert_to_template(&self, node: &str, vmid: u32) -> Result<Upid, PveError> {
        let path = vm_path(node, vmid, "/template");
        self.call_upid("template", Method::POST, &path, &Params::new())
            .await
    }
}
