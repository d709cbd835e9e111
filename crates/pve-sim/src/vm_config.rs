//! VM config updates: `PUT .../config` (applied before the answer, under
//! the config lock) and `POST .../config` (applied by a worker task), with
//! the datacenter's tag policy and qemu-server's update rules.
//!
//! Apart from `lifecycle` because a config update changes what a VM is, not
//! whether it exists or runs: its rules are option parsing and tag policy,
//! shared by both methods and by nothing else.

use std::sync::Arc;

use serde_json::{json, Value};

use crate::config::TagStyle;
use crate::params::Params;
use crate::schema::normalize_tags_with;
use crate::sim::{err_text, Shared};
use crate::state::{locked, ApiError, ApiResult, Cluster, Vm};

impl Shared {
    /// Datacenter `user-tag-access`: setting a tag the VM does not carry yet
    /// needs the policy's leave, else `Sys.Modify` on `/`.
    fn check_tag_access(&self, c: &Cluster, vmid: u32, p: &Params) -> ApiResult<()> {
        let Some(raw) = p.get("tags") else {
            return Ok(());
        };
        if self.holds("/", "Sys.Modify") {
            return Ok(());
        }
        let have: Vec<String> = c
            .vms
            .get(&vmid)
            .and_then(|vm| vm.tags.clone())
            .map(|t| t.split(';').map(str::to_string).collect())
            .unwrap_or_default();
        let in_use = |tag: &str| {
            c.vms.values().any(|vm| {
                vm.tags
                    .as_deref()
                    .is_some_and(|t| t.split(';').any(|x| x == tag))
            })
        };
        let wanted = normalize_tags_with(raw, self.cfg.tag_style);
        for tag in wanted.split(';').filter(|t| !t.is_empty()) {
            if !have.iter().any(|h| h == tag) && !self.cfg.tag_access.allows(tag, &in_use) {
                return Err(ApiError::Status(
                    403,
                    "Permission check failed (/, Sys.Modify)".into(),
                ));
            }
        }
        Ok(())
    }

    pub async fn update_config_sync(&self, node: &str, vmid: u32, p: &Params) -> ApiResult {
        {
            let c = self.cluster.lock();
            c.vm_on(node, vmid)?;
            self.check_tag_access(&c, vmid, p)?;
        }
        let node = node.to_string();
        self.with_flock(vmid, |c| {
            let vm = c.vm_on_mut(&node, vmid).map_err(err_text)?;
            apply_config(vm, p, self.cfg.tag_style)
        })
        .await
        .map_err(ApiError::internal)?;
        Ok(Value::Null)
    }

    pub fn update_config_async(self: &Arc<Self>, node: &str, vmid: u32, p: &Params) -> ApiResult {
        let mut c = self.cluster.lock();
        c.vm_on(node, vmid)?;
        self.check_tag_access(&c, vmid, p)?;
        let p = p.clone();
        let n = node.to_string();
        let upid = self.spawn_task(
            &mut c,
            node,
            "qmconfig",
            &vmid.to_string(),
            move |me, _| async move {
                tokio::time::sleep(me.cfg.config_task_duration).await;
                me.with_flock(vmid, |c| {
                    let vm = c.vm_on_mut(&n, vmid).map_err(err_text)?;
                    apply_config(vm, &p, me.cfg.tag_style)
                })
                .await?;
                Ok("OK".into())
            },
        );
        Ok(json!(upid))
    }
}

/// Apply a validated config update like qemu-server's update_vm_api.
fn apply_config(vm: &mut Vm, p: &Params, tag_style: TagStyle) -> Result<(), String> {
    let skiplock = p.bool("skiplock").unwrap_or(false);
    if let (Some(l), false) = (&vm.lock, skiplock) {
        // Setting or clearing `lock` itself is how operators fix leftovers.
        if !p.contains("lock") && !p.get("delete").is_some_and(|d| d.contains("lock")) {
            return Err(locked(vm.vmid, l));
        }
    }
    if let Some(d) = p.get("digest") {
        if d != vm.digest() {
            return Err(
                "detected modified configuration - file changed by other user? Try again.".into(),
            );
        }
    }
    if let Some(del) = p.get("delete") {
        for key in del
            .split(|c: char| c == ',' || c == ';' || c.is_whitespace())
            .filter(|s| !s.is_empty())
        {
            match key {
                "description" => vm.description = None,
                "tags" => vm.tags = None,
                "lock" => vm.lock = None,
                "protection" => vm.protection = false,
                "cores" => vm.cores = 1,
                "sockets" => vm.sockets = 1,
                "memory" => vm.memory_mib = 512,
                "agent" => vm.agent = "0".into(),
                other => {
                    vm.extra.remove(other);
                }
            }
        }
    }
    for (k, vals) in &p.0 {
        let Some(v) = vals.first() else { continue };
        match k.as_str() {
            "node" | "vmid" | "digest" | "delete" | "skiplock" | "revert" | "background_delay"
            | "force" => {}
            "cores" => vm.cores = v.parse().map_err(|_| format!("invalid cores '{v}'"))?,
            "sockets" => vm.sockets = v.parse().map_err(|_| format!("invalid sockets '{v}'"))?,
            "memory" => {
                let first = v.split(',').next().unwrap_or("");
                let n = first.strip_prefix("current=").unwrap_or(first);
                vm.memory_mib = n.parse().map_err(|_| format!("invalid memory '{v}'"))?;
            }
            "description" => vm.description = Some(v.clone()),
            "tags" => {
                let t = normalize_tags_with(v, tag_style);
                vm.tags = (!t.is_empty()).then_some(t);
            }
            "name" => vm.name = v.clone(),
            "agent" => vm.agent = v.clone(),
            "lock" => vm.lock = Some(v.clone()),
            "protection" => vm.protection = crate::params::parse_bool(v).unwrap_or(false),
            "template" => vm.template = crate::params::parse_bool(v).unwrap_or(false),
            other => {
                vm.extra.insert(other.to_string(), v.clone());
            }
        }
    }
    Ok(())
}
