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
    /// pve-guest-common `GuestHelpers.pm` `assert_tag_permissions`: every
    /// tag whose count changes, added *or removed* (a `tags` that replaces
    /// the VM's, or `delete=tags`), needs the datacenter's leave
    /// (`user-tag-access`, see [`crate::TagAccess`]) and must not be one of
    /// `registered-tags`, unless the token holds `Sys.Modify` on `/`.
    fn check_tag_access(&self, c: &Cluster, vmid: u32, p: &Params) -> ApiResult<()> {
        let deleted = p
            .get("delete")
            .is_some_and(|d| d.split([',', ';', ' ']).any(|k| k == "tags"));
        let new = match p.get("tags") {
            Some(raw) => normalize_tags_with(raw, self.cfg.tag_style),
            None if deleted => String::new(),
            None => return Ok(()),
        };
        if self.holds("/", "Sys.Modify") {
            return Ok(());
        }
        let old = c
            .vms
            .get(&vmid)
            .and_then(|vm| vm.tags.clone())
            .unwrap_or_default();
        let count = |list: &str, tag: &str| list.split(';').filter(|t| *t == tag).count();
        let mut changed: Vec<&str> = old
            .split(';')
            .chain(new.split(';'))
            .filter(|t| !t.is_empty())
            .filter(|t| count(&old, t) != count(&new, t))
            .collect();
        changed.sort_unstable();
        changed.dedup();
        let in_use = |tag: &str| {
            c.vms.values().any(|vm| {
                vm.tags
                    .as_deref()
                    .is_some_and(|t| t.split(';').any(|x| x == tag))
            })
        };
        for tag in changed {
            let registered = self.cfg.registered_tags.iter().any(|r| r == tag);
            if registered || !self.cfg.tag_access.allows(tag, &in_use) {
                return Err(ApiError::Status(
                    403,
                    format!("Permission check failed (/, Sys.Modify for modifying tag '{tag}')"),
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

/// qemu-server `API2/Qemu.pm` `$load_and_check_config`: an update that sets
/// `memory` or `balloon` dies when the balloon it leaves (the one sent,
/// else the VM's, which a clone copied from its template) is above the
/// memory (the one sent, else the VM's), before anything is written. A
/// `delete=balloon` in the same request does not help: deletions are
/// applied after this check.
fn check_balloon(vm: &Vm, p: &Params) -> Result<(), String> {
    let memory = p.get("memory").filter(|m| !m.is_empty());
    let balloon = p.get("balloon");
    if memory.is_none() && balloon.is_none() {
        return Ok(());
    }
    let memory_mib = match memory {
        Some(v) => parse_memory(v)?,
        None => vm.memory_mib,
    };
    let balloon_mib = match balloon {
        Some(b) => b
            .trim()
            .parse::<u64>()
            .map_err(|_| format!("invalid balloon '{b}'"))?,
        None => vm.balloon_mib().unwrap_or(0),
    };
    if balloon_mib > 0 && balloon_mib > memory_mib {
        return Err("balloon value too large (must be smaller than assigned memory)".into());
    }
    Ok(())
}

/// `memory` as a number or PVE 8's property string (`current=N`).
fn parse_memory(v: &str) -> Result<u64, String> {
    let first = v.split(',').next().unwrap_or("");
    let n = first.strip_prefix("current=").unwrap_or(first);
    n.trim()
        .parse()
        .map_err(|_| format!("invalid memory '{v}'"))
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
    check_balloon(vm, p)?;
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
            "memory" => vm.memory_mib = parse_memory(v)?,
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
