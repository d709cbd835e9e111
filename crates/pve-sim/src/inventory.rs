//! Read-only cluster views: nextid, nodes, resources, pools, tasks, VM config/status.

use std::time::Instant;

use serde_json::{json, Value};

use crate::sim::Shared;
use crate::state::{ApiError, ApiResult, Cluster, Vm};

/// Root disk size reported for every VM.
const STORAGE_BYTES: u64 = 32 * 1024 * 1024 * 1024;

impl Shared {
    // ---- cluster-level ----

    pub fn nextid(&self, vmid: Option<u32>) -> ApiResult {
        let c = self.cluster.lock();
        if let Some(id) = vmid {
            if c.vms.contains_key(&id) {
                return Err(ApiError::param("vmid", format!("VM {id} already exists")));
            }
            return Ok(json!(id.to_string()));
        }
        let (lo, hi) = self.cfg.vmid_range;
        (lo..=hi)
            .find(|id| !c.vms.contains_key(id))
            .map(|id| json!(id.to_string()))
            .ok_or_else(|| ApiError::internal("unable to get any free VMID in range"))
    }

    pub fn nodes(&self) -> Value {
        let c = self.cluster.lock();
        let rows: Vec<Value> = c
            .nodes
            .iter()
            .map(|(name, n)| {
                let mut v = json!({
                    "id": format!("node/{name}"),
                    "type": "node",
                    "node": name,
                    "status": if n.online { "online" } else { "offline" },
                    "ssl_fingerprint": self.fingerprint,
                    "level": "",
                });
                if n.online {
                    let mem = node_mem(&c, name);
                    v["cpu"] = json!(0.05);
                    v["maxcpu"] = json!(64);
                    v["mem"] = json!(mem);
                    v["maxmem"] = json!(256u64 << 30);
                    v["uptime"] = json!(86400);
                }
                v
            })
            .collect();
        Value::Array(rows)
    }

    pub fn resources(&self, ty: Option<&str>) -> Value {
        let mut c = self.cluster.lock();
        let stale_ok = !self.cfg.resources_staleness.is_zero();
        let vms = match (&c.resources_cache, stale_ok) {
            (Some((at, v)), true) if at.elapsed() < self.cfg.resources_staleness => v.clone(),
            _ => {
                let v = Value::Array(c.vms.values().map(|vm| resource_row(&c, vm)).collect());
                c.resources_cache = Some((Instant::now(), v.clone()));
                v
            }
        };
        let mut rows: Vec<Value> = Vec::new();
        if matches!(ty, None | Some("vm")) {
            if let Value::Array(v) = vms {
                rows.extend(v);
            }
        }
        if matches!(ty, None | Some("node")) {
            for (name, n) in &c.nodes {
                rows.push(json!({
                    "id": format!("node/{name}"), "type": "node", "node": name,
                    "status": if n.online { "online" } else { "offline" },
                    "maxcpu": 64, "maxmem": 256u64 << 30, "level": "",
                }));
            }
        }
        if matches!(ty, None | Some("storage")) {
            let mut seen = Vec::new();
            for vm in c.vms.values() {
                let key = (vm.node.clone(), vm.storage.clone());
                if !seen.contains(&key) {
                    rows.push(json!({
                        "id": format!("storage/{}/{}", vm.node, vm.storage), "type": "storage",
                        "node": vm.node, "storage": vm.storage, "status": "available",
                        "shared": u8::from(vm.shared_storage),
                    }));
                    seen.push(key);
                }
            }
        }
        Value::Array(rows)
    }

    /// `GET /nodes/{node}/qemu`: the node's VMs (templates included).
    pub fn node_vms(&self, node: &str) -> Value {
        let c = self.cluster.lock();
        Value::Array(
            c.vms
                .values()
                .filter(|vm| vm.node == node)
                .map(|vm| {
                    let mut r = resource_row(&c, vm);
                    if let Some(o) = r.as_object_mut() {
                        for k in ["id", "type", "node", "pool", "hastate"] {
                            o.remove(k);
                        }
                        o.insert("cpus".into(), json!(vm.cores * vm.sockets));
                        if !vm.template {
                            o.remove("template");
                        }
                    }
                    r
                })
                .collect(),
        )
    }

    pub fn pools(&self, poolid: Option<&str>) -> ApiResult {
        let c = self.cluster.lock();
        match poolid {
            None => Ok(Value::Array(
                c.pools
                    .iter()
                    .map(|(p, comment)| json!({"poolid": p, "comment": comment}))
                    .collect(),
            )),
            Some(p) => {
                let comment = c
                    .pools
                    .get(p)
                    .ok_or_else(|| ApiError::internal(format!("pool '{p}' does not exist")))?;
                Ok(json!([{"poolid": p, "comment": comment, "members": pool_members(&c, p)}]))
            }
        }
    }

    pub fn pool(&self, poolid: &str) -> ApiResult {
        let c = self.cluster.lock();
        let comment = c
            .pools
            .get(poolid)
            .ok_or_else(|| ApiError::internal(format!("pool '{poolid}' does not exist")))?;
        Ok(json!({"comment": comment, "members": pool_members(&c, poolid)}))
    }

    pub fn task_status(&self, node: &str, upid: &str) -> ApiResult {
        let c = self.cluster.lock();
        match c.tasks.get(upid) {
            Some(t) if t.node == node => Ok(t.status_json()),
            _ => Err(no_task(upid)),
        }
    }

    pub fn task_log(&self, node: &str, upid: &str, start: usize, limit: usize) -> ApiResult {
        let c = self.cluster.lock();
        match c.tasks.get(upid) {
            Some(t) if t.node == node => Ok(t.log_json(start, limit)),
            _ => Err(no_task(upid)),
        }
    }

    pub fn config(&self, node: &str, vmid: u32) -> ApiResult {
        Ok(self.cluster.lock().vm_on(node, vmid)?.config_json())
    }

    pub fn status_current(&self, node: &str, vmid: u32) -> ApiResult {
        let c = self.cluster.lock();
        let vm = c.vm_on(node, vmid)?;
        let mut v = json!({
            "vmid": vm.vmid,
            "name": vm.name,
            "status": vm.status_str(),
            "qmpstatus": vm.status_str(),
            "agent": u8::from(vm.agent_enabled()),
            "ha": vm.ha_json(),
            "cpus": vm.cores * vm.sockets,
            "maxmem": vm.memory_mib * 1024 * 1024,
            "maxdisk": STORAGE_BYTES,
            "uptime": vm.started_at.map(|t| t.elapsed().as_secs()).unwrap_or(0),
        });
        if vm.template {
            v["template"] = json!(1);
        }
        if let Some(l) = &vm.lock {
            v["lock"] = json!(l);
        }
        if let Some(t) = &vm.tags {
            v["tags"] = json!(t);
        }
        if vm.running {
            v["pid"] = json!(100_000 + vm.vmid);
            v["mem"] = json!(vm.memory_mib * 1024 * 1024 / 4);
            v["cpu"] = json!(0.01);
        }
        Ok(v)
    }
}

fn no_task(upid: &str) -> ApiError {
    ApiError::internal(format!(
        "unable to open file '/var/log/pve/tasks/{}' - No such file or directory",
        upid
    ))
}

fn node_mem(c: &Cluster, node: &str) -> u64 {
    c.vms
        .values()
        .filter(|v| v.node == node && v.running)
        .map(|v| v.memory_mib * 1024 * 1024)
        .sum()
}

fn resource_row(c: &Cluster, vm: &Vm) -> Value {
    let online = c.nodes.get(&vm.node).is_some_and(|n| n.online);
    let mut v = json!({
        "id": format!("qemu/{}", vm.vmid),
        "type": "qemu",
        "vmid": vm.vmid,
        "node": vm.node,
        "name": vm.name,
        "status": if online { vm.status_str() } else { "unknown" },
        "template": u8::from(vm.template),
        "maxmem": vm.memory_mib * 1024 * 1024,
        "maxcpu": vm.cores * vm.sockets,
        "maxdisk": STORAGE_BYTES,
        "disk": 0,
        "mem": if vm.running { vm.memory_mib * 1024 * 1024 / 4 } else { 0 },
        "cpu": if vm.running { 0.01 } else { 0.0 },
        "uptime": vm.started_at.map(|t| t.elapsed().as_secs()).unwrap_or(0),
        "netin": 0, "netout": 0, "diskread": 0, "diskwrite": 0,
    });
    if let Some(t) = &vm.tags {
        v["tags"] = json!(t);
    }
    if let Some(p) = &vm.pool {
        v["pool"] = json!(p);
    }
    if let Some(l) = &vm.lock {
        v["lock"] = json!(l);
    }
    if let Some(h) = &vm.ha {
        v["hastate"] = json!(h);
    }
    v
}

fn pool_members(c: &Cluster, pool: &str) -> Value {
    Value::Array(
        c.vms
            .values()
            .filter(|v| v.pool.as_deref() == Some(pool))
            .map(|vm| {
                let mut r = resource_row(c, vm);
                r["type"] = json!("qemu");
                r
            })
            .collect(),
    )
}
