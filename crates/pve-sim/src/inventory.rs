//! Read-only cluster views: nextid, nodes, resources, pools, tasks, VM config/status.
//!
//! One file past 600 lines on purpose: every view reads the same state under
//! the same visibility rules (pool ACLs, RRD lag).

use std::time::Instant;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::config::TagAccess;
use crate::sim::Shared;
use crate::state::{ApiError, ApiResult, Cluster, Vm};

/// Root disk size reported for every VM.
use crate::state::STORAGE_BYTES;

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
            // pve-manager `API2/Cluster.pm` `nextid`: `die "unable to get any
            // free VMID in range [$lower, $upper]\n"`, upper exclusive.
            .ok_or_else(|| {
                ApiError::internal(format!(
                    "unable to get any free VMID in range [{lo}, {}]",
                    u64::from(hi) + 1
                ))
            })
    }

    pub fn nodes(&self) -> Value {
        // (`maxcpu`/`maxmem` match the node rows of `/cluster/resources`.)
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
                // pve-manager `API2/Nodes.pm` index: a node the token may
                // not audit (`Sys.Audit` on `/nodes/<node>`) is listed
                // without its figures (`API2Tools.pm` `extract_node_stats`).
                if n.online && self.may_audit_node(name) {
                    let mem = node_mem(&c, name).min(self.cfg.node_memory.of(name));
                    v["cpu"] = json!(0.05);
                    v["maxcpu"] = json!(self.cfg.node_cpus);
                    v["mem"] = json!(mem);
                    v["maxmem"] = json!(self.cfg.node_memory.of(name));
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
                let v = self.vm_resource_rows(&mut c);
                c.resources_cache = Some((Instant::now(), v.clone()));
                v
            }
        };
        let mut rows: Vec<Value> = Vec::new();
        if matches!(ty, None | Some("vm")) {
            if let Value::Array(v) = vms {
                // PVE lists only what the token may audit.
                rows.extend(v.into_iter().filter(|r| {
                    let vmid = r.get("vmid").and_then(Value::as_u64).unwrap_or(0) as u32;
                    self.visible(&c, vmid)
                }));
            }
        }
        if matches!(ty, None | Some("node")) {
            for (name, n) in &c.nodes {
                let mut row = json!({
                    "id": format!("node/{name}"), "type": "node", "node": name,
                    "status": if n.online { "online" } else { "offline" },
                    "level": "", "cgroup-mode": 2,
                });
                // The same `extract_node_stats` as `/nodes` (pve-manager
                // `API2/Cluster.pm` `resources`): no figures without
                // `Sys.Audit` on `/nodes/<node>`.
                let audit = self.may_audit_node(name);
                if audit {
                    row["maxcpu"] = json!(self.cfg.node_cpus);
                    row["maxmem"] = json!(self.cfg.node_memory.of(name));
                }
                if n.online && audit {
                    row["cpu"] = json!(0.05);
                    row["mem"] = json!(node_mem(&c, name).min(self.cfg.node_memory.of(name)));
                    row["disk"] = json!(4u64 << 30);
                    row["maxdisk"] = json!(ROOTFS_BYTES);
                    row["uptime"] = json!(self.node_uptime());
                }
                rows.push(row);
            }
        }
        if matches!(ty, None | Some("storage")) {
            for (node, n) in &c.nodes {
                for st in self.storages_on(&c, node) {
                    let mut row = json!({
                        "id": format!("storage/{node}/{}", st.name), "type": "storage",
                        "node": node, "storage": st.name, "plugintype": st.kind.as_str(),
                        "content": st.content, "shared": u8::from(st.shared),
                        "status": if n.online { "available" } else { "unknown" },
                    });
                    if n.online {
                        row["disk"] = json!(st.used);
                        row["maxdisk"] = json!(st.total);
                    }
                    rows.push(row);
                }
            }
        }
        Value::Array(rows)
    }

    /// VM rows of `/cluster/resources`. `id`, `vmid`, `node`, `type`, `tags`,
    /// `lock`, `pool` and `hastate` come from the cluster filesystem and are
    /// always current; the rest comes from pvestatd's RRD samples, which
    /// [`crate::SimConfig::rrd_lag`] delays.
    fn vm_resource_rows(&self, c: &mut Cluster) -> Value {
        let lag = self.cfg.rrd_lag;
        let now = Instant::now();
        let vms: Vec<Vm> = c.vms.values().cloned().collect();
        let mut rows = Vec::with_capacity(vms.len());
        for vm in &vms {
            let mut row = fresh_fields(vm);
            if !c.nodes.get(&vm.node).is_some_and(|n| n.online) {
                // Nobody samples a dead node's VMs: its last sample stands
                // until pmxcfs drops it, then only the cluster filesystem's
                // fields are left (pve-manager `extract_vm_stats`).
                let kept = c
                    .rrd
                    .get(&vm.vmid)
                    .filter(|(t, _)| now.duration_since(*t) < self.cfg.rrd_expiry);
                match (kept, row.as_object_mut()) {
                    (Some((_, Value::Object(sample))), Some(o)) => o.extend(sample.clone()),
                    _ => row["status"] = json!("unknown"),
                }
                rows.push(row);
                continue;
            }
            let sample = if lag.is_zero() {
                Some(vm.rrd_sample())
            } else if c
                .created
                .get(&vm.vmid)
                .is_some_and(|t| now.duration_since(*t) < lag)
            {
                None // pvestatd has not sampled the new VM yet
            } else {
                let due = c
                    .rrd
                    .get(&vm.vmid)
                    .is_none_or(|(t, _)| now.duration_since(*t) >= lag);
                if due {
                    c.rrd.insert(vm.vmid, (now, vm.rrd_sample()));
                }
                c.rrd.get(&vm.vmid).map(|(_, v)| v.clone())
            };
            match (sample, row.as_object_mut()) {
                (Some(Value::Object(sample)), Some(o)) => o.extend(sample),
                // pve-manager's `/cluster/resources` says `unknown` for a VM
                // with no RRD sample yet (and has no name or template).
                _ => row["status"] = json!("unknown"),
            }
            rows.push(row);
        }
        Value::Array(rows)
    }

    /// `GET /nodes/{node}/storage`.
    pub fn node_storages(&self, node: &str, p: &crate::params::Params) -> Value {
        let c = self.cluster.lock();
        let content = p.get("content").map(|c| {
            crate::schema::split_tags(c)
                .map(str::to_string)
                .collect::<Vec<_>>()
        });
        let rows = self
            .storages_on(&c, node)
            .into_iter()
            .filter(|st| p.get("storage").is_none_or(|want| want == st.name))
            .filter(|st| {
                content
                    .as_ref()
                    .is_none_or(|want| want.iter().any(|w| st.content.split(',').any(|h| h == w)))
            })
            .map(|st| st.status_json(true))
            .collect();
        Value::Array(rows)
    }

    /// `GET /nodes/{node}/storage/{storage}/status`. A storage storage.cfg
    /// does not have is a parameter error (pve-storage
    /// `API2/Storage/Status.pm`: `raise_param_exc({ storage => "No such
    /// storage." })`); one disabled or inactive on the node answers 200.
    pub fn storage_status(&self, node: &str, storage: &str) -> ApiResult {
        let c = self.cluster.lock();
        self.storages_on(&c, node)
            .into_iter()
            .find(|st| st.name == storage)
            .map(|st| st.status_json(false))
            .ok_or_else(|| ApiError::param("storage", "No such storage."))
    }

    /// `GET /cluster/status`: the cluster entry, then one entry per node.
    pub fn cluster_status(&self) -> Value {
        let c = self.cluster.lock();
        let online = c.nodes.values().filter(|n| n.online).count();
        let quorate = online * 2 > c.nodes.len();
        let mut rows = vec![json!({
            "type": "cluster", "id": "cluster", "name": "bigfleet-sim",
            "version": c.nodes.len() + 1, "nodes": c.nodes.len(),
            "quorate": u8::from(quorate),
        })];
        for (i, (name, n)) in c.nodes.iter().enumerate() {
            rows.push(json!({
                "type": "node", "id": format!("node/{name}"), "name": name,
                "nodeid": i + 1, "ip": format!("10.0.0.{}", i + 1),
                // The simulator answers as if it were the first node.
                "local": u8::from(i == 0), "online": u8::from(n.online), "level": "",
            }));
        }
        Value::Array(rows)
    }

    /// `GET /nodes/{node}/status` (the node is online: the router answers 595
    /// for offline nodes before getting here).
    pub fn node_status(&self, node: &str) -> Value {
        let c = self.cluster.lock();
        let total = self.cfg.node_memory.of(node);
        // The host itself uses some; never more than there is.
        let used = (node_mem(&c, node) + (2u64 << 30)).min(total);
        json!({
            "uptime": self.node_uptime(),
            "cpu": 0.05,
            "wait": 0.0,
            "idle": 0,
            "loadavg": ["0.42", "0.38", "0.35"],
            "cpuinfo": {
                "cpus": self.cfg.node_cpus, "cores": self.cfg.node_cpus.div_ceil(2), "sockets": 2,
                "model": "QEMU Virtual CPU version 2.5+", "mhz": "2400.000",
                "hvm": "1", "user_hz": 100, "flags": "fpu vme de pse tsc msr pae mce",
            },
            "memory": {"total": total, "used": used, "free": total - used},
            "swap": {"total": 8u64 << 30, "used": 0, "free": 8u64 << 30},
            "rootfs": {
                "total": ROOTFS_BYTES, "used": 4u64 << 30,
                "avail": ROOTFS_BYTES - (4u64 << 30), "free": ROOTFS_BYTES - (4u64 << 30),
            },
            "ksm": {"shared": 0},
            "kversion": "Linux 6.8.12-4-pve #1 SMP PREEMPT_DYNAMIC PMX 6.8.12-4 (2024-11-06T15:04Z) x86_64",
            "current-kernel": {
                "sysname": "Linux", "release": "6.8.12-4-pve", "machine": "x86_64",
                "version": "#1 SMP PREEMPT_DYNAMIC PMX 6.8.12-4 (2024-11-06T15:04Z)",
            },
            "boot-info": {"mode": "efi", "secureboot": 0},
            "pveversion": format!("pve-manager/{PVE_VERSION}/{PVE_REPOID}"),
        })
    }

    /// The token's privileges on `path`. Each privilege follows the most
    /// specific rule on the path or above it (ACLs propagate; a deeper ACL
    /// wins): the default set (PVE 8 or 9 names) on `/`,
    /// [`crate::SimConfig::granted_privileges`], and
    /// [`crate::SimConfig::dropped_privileges`] (`*` = every privilege;
    /// on the same path a drop wins).
    pub fn privileges_on(&self, path: &str) -> Vec<String> {
        let under = |acl: &str| {
            acl == "/"
                || path == acl
                || path
                    .strip_prefix(acl)
                    .is_some_and(|rest| rest.starts_with('/'))
        };
        let base = crate::privileges::default_privileges(self.cfg.pve9);
        let mut names: Vec<String> = base.iter().map(|p| p.to_string()).collect();
        names.extend(self.cfg.granted_privileges.iter().map(|(_, p)| p.clone()));
        names.sort();
        names.dedup();
        names.retain(|name| {
            // (depth, held) of the deciding rule.
            let mut best: (usize, bool) = (0, false);
            if base.contains(&name.as_str()) {
                best = (1, true);
            }
            let mut consider = |acl: &str, held: bool| {
                if !under(acl) {
                    return;
                }
                let depth = acl.len();
                if depth > best.0 || (depth == best.0 && !held) {
                    best = (depth, held);
                }
            };
            for (acl, p) in &self.cfg.granted_privileges {
                if p == name {
                    consider(acl, true);
                }
            }
            for (acl, p) in &self.cfg.dropped_privileges {
                if p == name || p == "*" {
                    consider(acl, false);
                }
            }
            best.1
        });
        names
    }

    /// [`Shared::privileges_on`], where a VM's `/vms/{vmid}` also gets what
    /// its pool's ACL grants (PVE treats the pool as the VM's parent).
    pub fn effective_privileges(&self, path: &str) -> Vec<String> {
        let mut out = self.privileges_on(path);
        let pool = path
            .strip_prefix("/vms/")
            .and_then(|id| id.parse::<u32>().ok())
            .and_then(|vmid| {
                self.cluster
                    .lock()
                    .vms
                    .get(&vmid)
                    .and_then(|vm| vm.pool.clone())
            });
        if let Some(pool) = pool {
            out.extend(self.privileges_on(&format!("/pool/{pool}")));
            out.sort();
            out.dedup();
        }
        out
    }

    /// Whether the token may see `node`'s figures (`Sys.Audit` on
    /// `/nodes/<node>`).
    fn may_audit_node(&self, node: &str) -> bool {
        self.holds(&format!("/nodes/{node}"), "Sys.Audit")
    }

    /// Whether the token holds `privilege` on `path`.
    pub fn holds(&self, path: &str, privilege: &str) -> bool {
        self.privileges_on(path).iter().any(|p| p == privilege)
    }

    /// `GET /access/permissions`: the token's privileges per ACL path. With
    /// `path`, that path alone; without, the top-level paths, every pool,
    /// template and storage, leaving out paths where it holds nothing (as
    /// PVE does).
    pub fn permissions(&self, path: Option<&str>) -> Value {
        let as_map = |path: &str| -> serde_json::Map<String, Value> {
            self.effective_privileges(path)
                .into_iter()
                .map(|p| (p, json!(1)))
                .collect()
        };
        let mut out = serde_json::Map::new();
        match path {
            Some(p) => {
                out.insert(p.to_string(), Value::Object(as_map(p)));
            }
            None => {
                let c = self.cluster.lock();
                let mut paths: Vec<String> = vec![
                    "/".into(),
                    "/nodes".into(),
                    "/storage".into(),
                    "/vms".into(),
                ];
                paths.extend(c.pools.keys().map(|p| format!("/pool/{p}")));
                paths.extend(
                    self.cfg
                        .templates
                        .iter()
                        .map(|t| format!("/vms/{}", t.vmid)),
                );
                paths.extend(
                    self.cfg
                        .templates
                        .iter()
                        .map(|t| format!("/storage/{}", t.storage)),
                );
                drop(c);
                paths.sort();
                paths.dedup();
                for p in paths {
                    let privs = as_map(&p);
                    if !privs.is_empty() {
                        out.insert(p, Value::Object(privs));
                    }
                }
            }
        }
        Value::Object(out)
    }

    /// `GET /cluster/options`: datacenter.cfg as PVE parses it; only the
    /// `user-tag-access` option is modelled, and (as in PVE) it is absent
    /// when left at its default, `free`.
    pub fn cluster_options(&self) -> Value {
        // pve-manager `API2/Cluster.pm`: without `Sys.Audit` on `/` only
        // `console`, `tag-style` and `allowed-tags` are returned (none set
        // here), so `user-tag-access` is absent whatever it is.
        if !self.holds("/", "Sys.Audit") {
            return json!({});
        }
        let (allow, list) = match &self.cfg.tag_access {
            TagAccess::Free => return json!({"keyboard": "en-us"}),
            TagAccess::Existing(l) => ("existing", l.clone()),
            TagAccess::List(l) => ("list", l.clone()),
            TagAccess::None => ("none", Vec::new()),
        };
        let mut uta = json!({"user-allow": allow});
        if !list.is_empty() {
            uta["user-allow-list"] = json!(list);
        }
        json!({"keyboard": "en-us", "user-tag-access": uta})
    }

    /// `GET /cluster/sdn/vnets`: the SDN VNets of
    /// [`crate::SimConfig::sdn_vnets`], sorted by name, as pve-network's
    /// `API2/Network/SDN/Vnets.pm` index returns them (each VNet's section
    /// config plus its name and the file's digest), leaving out every VNet
    /// on whose `/sdn/zones/<zone>/<vnet>` the token holds neither
    /// `SDN.Audit` nor `SDN.Allocate` (the index is open to every user and
    /// filters). Without SDN installed pve-manager never registers the path
    /// (`API2/Cluster.pm`, `$have_sdn`): 501 `Method 'GET
    /// /cluster/sdn/vnets' not implemented`, as for any unknown path.
    pub fn sdn_vnets(&self) -> ApiResult {
        if !self.cfg.sdn_installed {
            return Err(ApiError::Status(
                501,
                "Method 'GET /cluster/sdn/vnets' not implemented".into(),
            ));
        }
        let mut vnets: Vec<&(String, String)> = self.cfg.sdn_vnets.iter().collect();
        vnets.sort();
        vnets.dedup_by(|a, b| a.0 == b.0);
        // vnets.cfg's digest: one for the whole file, in PVE's SHA-1 shape.
        let file: String = vnets
            .iter()
            .map(|(vnet, zone)| format!("vnet: {vnet}\n\tzone {zone}\n\n"))
            .collect();
        let digest = hex::encode(Sha256::digest(file.as_bytes()));
        let rows = vnets
            .into_iter()
            .filter(|(vnet, zone)| {
                let path = format!("/sdn/zones/{zone}/{vnet}");
                let held = self.effective_privileges(&path);
                held.iter().any(|p| p == "SDN.Audit" || p == "SDN.Allocate")
            })
            .map(|(vnet, zone)| {
                json!({"vnet": vnet, "zone": zone, "type": "vnet", "digest": &digest[..40]})
            })
            .collect();
        Ok(Value::Array(rows))
    }

    /// The zone PVE checks a NIC on `bridge` in: an SDN VNet's own, else
    /// `localnetwork` (pve-guest-common `check_vnet_access`; without SDN
    /// installed every bridge is in `localnetwork`).
    pub fn sdn_zone_of(&self, bridge: &str) -> &str {
        self.cfg
            .sdn_vnets
            .iter()
            .find(|(vnet, _)| vnet == bridge && self.cfg.sdn_installed)
            .map_or("localnetwork", |(_, zone)| zone.as_str())
    }

    /// `GET /nodes/{node}/qemu/{vmid}/status`: the directory index.
    pub fn status_index(&self, node: &str, vmid: u32) -> ApiResult {
        self.cluster.lock().vm_on(node, vmid)?;
        Ok(Value::Array(
            [
                "current", "start", "stop", "reset", "shutdown", "suspend", "reboot", "resume",
            ]
            .iter()
            .map(|s| json!({"subdir": s}))
            .collect(),
        ))
    }

    /// The QEMU process id of a running VM, as qemu-server's `vmstatus`
    /// reports it: a new one each time the VM starts (made up from when).
    fn qemu_pid(&self, vm: &Vm) -> Option<u32> {
        if !vm.running {
            return None;
        }
        let since = vm
            .started_at
            .map_or(0, |t| t.saturating_duration_since(self.started).as_micros());
        Some(1000 + (since % 4_000_000_000) as u32 % 4_000_000 + vm.vmid % 1000)
    }

    fn node_uptime(&self) -> u64 {
        86_400 + self.started.elapsed().as_secs()
    }

    /// `GET /nodes/{node}/qemu`: the node's VMs (templates included).
    pub fn node_vms(&self, node: &str) -> Value {
        let c = self.cluster.lock();
        Value::Array(
            c.vms
                .values()
                .filter(|vm| vm.node == node && self.visible(&c, vm.vmid))
                .map(|vm| {
                    let mut r = resource_row(&c, vm);
                    if let Some(o) = r.as_object_mut() {
                        for k in ["id", "type", "node", "pool", "hastate"] {
                            o.remove(k);
                        }
                        o.insert("cpus".into(), json!(vm.vcpus()));
                        if let Some(pid) = self.qemu_pid(vm) {
                            o.insert("pid".into(), json!(pid));
                        }
                        if !vm.template {
                            o.remove("template");
                        }
                    }
                    r
                })
                .collect(),
        )
    }

    /// `GET /pools[?poolid=P]`: pools the token may audit (`Pool.Audit`).
    pub fn pools(&self, poolid: Option<&str>) -> ApiResult {
        let c = self.cluster.lock();
        match poolid {
            None => Ok(Value::Array(
                c.pools
                    .iter()
                    .filter(|(p, _)| self.holds(&format!("/pool/{p}"), "Pool.Audit"))
                    .map(|(p, comment)| json!({"poolid": p, "comment": comment}))
                    .collect(),
            )),
            Some(p) if !self.holds(&format!("/pool/{p}"), "Pool.Audit") => Ok(json!([])),
            Some(p) => {
                let comment = c
                    .pools
                    .get(p)
                    .ok_or_else(|| ApiError::internal(format!("pool '{p}' does not exist")))?;
                Ok(json!([{"poolid": p, "comment": comment, "members": pool_members(&c, p)}]))
            }
        }
    }

    /// `GET /pools/{poolid}`: the privilege is checked before the pool is
    /// looked up, so a missing pool without `Pool.Audit` is a 403 too.
    pub fn pool(&self, poolid: &str) -> ApiResult {
        if !self.holds(&format!("/pool/{poolid}"), "Pool.Audit") {
            return Err(ApiError::Status(
                403,
                format!("Permission check failed (/pool/{poolid}, Pool.Audit)"),
            ));
        }
        let c = self.cluster.lock();
        let comment = c
            .pools
            .get(poolid)
            .ok_or_else(|| ApiError::internal(format!("pool '{poolid}' does not exist")))?;
        Ok(json!({"comment": comment, "members": pool_members(&c, poolid)}))
    }

    /// `GET /nodes/{node}/tasks` (pve-manager `PVE::API2::Tasks::node_tasks`):
    /// newest first; `source` `archive` (the default: finished tasks),
    /// `active` (running) or `all`; filtered by `typefilter`, `userfilter`
    /// (a substring), `vmid` (the task's id), `errors` and the start time
    /// (`since` and `until`, Unix seconds, both inclusive); paged by `start`
    /// and `limit`. Without `Sys.Audit` on `/nodes/{node}` a caller sees
    /// only the tasks it started itself.
    pub fn node_tasks(&self, node: &str, p: &crate::params::Params) -> ApiResult {
        let auditor = self.holds(&format!("/nodes/{node}"), "Sys.Audit");
        let me = self.cfg.token_id.as_str();
        let source = p.get("source").unwrap_or("archive");
        let typefilter = p.get("typefilter");
        let userfilter = p.get("userfilter").map(str::to_lowercase);
        let vmid = p.get("vmid");
        let errors = p.bool("errors").unwrap_or(false);
        let since = p.u64("since");
        let until = p.u64("until");
        let start = p.u64("start").unwrap_or(0) as usize;
        let limit = p.u64("limit").unwrap_or(50) as usize;
        let c = self.cluster.lock();
        let mut tasks: Vec<&crate::tasks::Task> = c
            .tasks
            .values()
            .filter(|t| t.node == node)
            .filter(|t| match source {
                "active" => t.exitstatus.is_none(),
                "all" => true,
                _ => t.exitstatus.is_some(),
            })
            .filter(|t| auditor || t.user == me)
            .filter(|t| typefilter.is_none_or(|k| t.kind == k))
            .filter(|t| {
                userfilter
                    .as_deref()
                    .is_none_or(|u| t.user.to_lowercase().contains(u))
            })
            .filter(|t| vmid.is_none_or(|v| t.id == v))
            .filter(|t| since.is_none_or(|s| t.starttime >= s))
            .filter(|t| until.is_none_or(|u| t.starttime <= u))
            .filter(|t| !errors || t.exitstatus.as_deref().is_some_and(|s| s != "OK"))
            .collect();
        tasks.sort_by_key(|t| std::cmp::Reverse((t.starttime, t.pid)));
        let rows: Vec<Value> = tasks
            .into_iter()
            .skip(start)
            .take(limit)
            .map(crate::tasks::Task::list_json)
            .collect();
        Ok(Value::Array(rows))
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
        let mut v = self.cluster.lock().vm_on(node, vmid)?.config_json();
        if self.cfg.description_newline {
            let block = v
                .get("description")
                .and_then(Value::as_str)
                .map(comment_block);
            match block {
                Some(b) if b.is_empty() => {
                    if let Some(o) = v.as_object_mut() {
                        o.remove("description");
                    }
                }
                Some(b) => v["description"] = json!(b),
                None => {}
            }
        }
        Ok(v)
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
            "cpus": vm.vcpus(),
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
        if let Some(pid) = self.qemu_pid(vm) {
            v["pid"] = json!(pid);
        }
        if vm.running {
            v["mem"] = json!(vm.memory_mib * 1024 * 1024 / 4);
            v["cpu"] = json!(0.01);
        }
        Ok(v)
    }
}

/// A task the node has no file of: PVE raises a parameter error on `upid`
/// (pve-manager `API2/Tasks.pm`, `raise_param_exc({ upid => "no such task" })`).
fn no_task(_upid: &str) -> ApiError {
    ApiError::param("upid", "no such task")
}

fn node_mem(c: &Cluster, node: &str) -> u64 {
    c.vms
        .values()
        .filter(|v| v.node == node && v.running)
        .map(|v| v.memory_mib * 1024 * 1024)
        .sum()
}

/// A complete, current row (what the node itself reports: `/nodes/{n}/qemu`,
/// pool members).
fn resource_row(c: &Cluster, vm: &Vm) -> Value {
    let mut row = fresh_fields(vm);
    if let (Value::Object(sample), Some(o)) = (vm.rrd_sample(), row.as_object_mut()) {
        o.extend(sample);
    }
    let online = c.nodes.get(&vm.node).is_some_and(|n| n.online);
    if !online {
        row["status"] = json!("unknown");
    }
    row
}

/// Row fields read from the cluster filesystem (always current).
fn fresh_fields(vm: &Vm) -> Value {
    let mut v = json!({
        "id": format!("qemu/{}", vm.vmid),
        "type": "qemu",
        "vmid": vm.vmid,
        "node": vm.node,
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

/// How PVE returns a stored description: it keeps it as `#` comment lines and
/// joins them back with a `\n` after every line (Perl's `split` drops trailing
/// empty lines, so they do not survive).
pub fn comment_block(d: &str) -> String {
    let lines: Vec<&str> = d.split('\n').collect();
    let keep = lines
        .iter()
        .rposition(|l| !l.is_empty())
        .map_or(0, |i| i + 1);
    lines[..keep].iter().map(|l| format!("{l}\n")).collect()
}

pub(crate) const PVE_VERSION: &str = "8.3.2";
pub(crate) const PVE_REPOID: &str = "3e76eec21c4a14a7";
const ROOTFS_BYTES: u64 = 100 << 30;

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
