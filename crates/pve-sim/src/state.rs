//! Cluster state: nodes, VMs, pools, tasks, locks.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::Instant;

use serde::Serialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::agent::AgentState;
use crate::schema::ParamErrors;
use crate::tasks::Task;

/// The size every simulated disk reports.
pub(crate) const STORAGE_BYTES: u64 = 32 * 1024 * 1024 * 1024;

/// An API failure, rendered the PVE way by the server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ApiError {
    /// Status + message (reason phrase and body `message`).
    Status(u16, String),
    /// 400 "Parameter verification failed." with an `errors` map.
    Params(ParamErrors),
}

impl ApiError {
    pub fn internal(msg: impl Into<String>) -> Self {
        Self::Status(500, msg.into())
    }

    pub fn param(name: &str, msg: impl Into<String>) -> Self {
        let mut m = ParamErrors::new();
        m.insert(name.to_string(), msg.into());
        Self::Params(m)
    }
}

pub type ApiResult<T = Value> = Result<T, ApiError>;

/// A VM as the simulator holds it. Returned by value from inspection calls.
#[derive(Clone, Debug, Serialize)]
pub struct Vm {
    pub vmid: u32,
    pub node: String,
    pub name: String,
    pub description: Option<String>,
    /// Normalised (`a;b`) tag list.
    pub tags: Option<String>,
    pub cores: u32,
    pub sockets: u32,
    pub memory_mib: u64,
    /// The `agent` property string (`1`, `enabled=1,...`, `0`).
    pub agent: String,
    /// Config lock (`lock:` line), e.g. `clone`.
    pub lock: Option<String>,
    /// Workers holding the config file lock (flock) right now.
    pub flock: u32,
    pub template: bool,
    pub running: bool,
    #[serde(skip)]
    pub started_at: Option<Instant>,
    /// HA resource requested state (`started`/`stopped`) when HA-managed.
    pub ha: Option<String>,
    pub protection: bool,
    pub pool: Option<String>,
    pub storage: String,
    pub shared_storage: bool,
    /// Size of the VM's one disk, `scsi0`.
    pub disk_gib: u64,
    /// A linked clone: its disk is a thin child of this template's base
    /// volume and takes no room of its own.
    pub linked_base: Option<u32>,
    /// Other config keys set through the API, kept verbatim.
    pub extra: BTreeMap<String, String>,
    /// Guest scratch root standing in for the guest's `/`.
    pub guest_root: PathBuf,
}

impl Vm {
    /// Row fields from pvestatd's RRD sample of the VM (what
    /// `/cluster/resources` shows of it).
    pub(crate) fn rrd_sample(&self) -> Value {
        let vm = self;
        json!({
            "name": vm.name,
            "status": vm.status_str(),
            "template": u8::from(vm.template),
            "maxmem": vm.memory_mib * 1024 * 1024,
            "maxcpu": vm.vcpus(),
            "maxdisk": STORAGE_BYTES,
            "disk": 0,
            "mem": if vm.running { vm.memory_mib * 1024 * 1024 / 4 } else { 0 },
            "cpu": if vm.running { 0.01 } else { 0.0 },
            "uptime": vm.started_at.map(|t| t.elapsed().as_secs()).unwrap_or(0),
            "netin": 0, "netout": 0, "diskread": 0, "diskwrite": 0,
        })
    }

    /// `balloon` (MiB): the least memory auto-ballooning may leave the
    /// guest; `Some(0)` disables the balloon device; `None` = `memory`.
    pub fn balloon_mib(&self) -> Option<u64> {
        self.extra
            .get("balloon")
            .and_then(|b| b.trim().parse().ok())
    }

    /// `sockets` x `cores`: the most vCPUs the VM can have (qemu-server
    /// `config_to_command`'s `maxcpus`).
    pub fn max_vcpus(&self) -> u32 {
        self.sockets.max(1) * self.cores.max(1)
    }

    /// The vCPUs the guest boots with: `vcpus` when set (hot-plug), else
    /// [`Vm::max_vcpus`]; what `cpus` of its status reports (qemu-server
    /// `vmstatus`).
    pub fn vcpus(&self) -> u32 {
        self.extra
            .get("vcpus")
            .and_then(|v| v.trim().parse::<u32>().ok())
            .filter(|v| *v > 0)
            .unwrap_or_else(|| self.max_vcpus())
    }

    pub fn agent_enabled(&self) -> bool {
        let first = self.agent.split(',').next().unwrap_or("");
        let v = first.strip_prefix("enabled=").unwrap_or(first);
        crate::params::parse_bool(v).unwrap_or(false)
    }

    /// The volume name of the disk (`vm-N-disk-0`, `base-N-disk-0` once a
    /// template; a linked clone's names its base: `base-B-disk-0/vm-N-disk-0`).
    pub fn volume(&self) -> String {
        let own = if self.template {
            format!("base-{}-disk-0", self.vmid)
        } else {
            format!("vm-{}-disk-0", self.vmid)
        };
        match self.linked_base {
            Some(b) => format!("base-{b}-disk-0/{own}"),
            None => own,
        }
    }

    /// The volumes of the VM's CD-ROM drives (`media=cdrom`): a storage
    /// volume (`local:iso/x.iso`), `cdrom` for the host's drive, or `none`.
    pub fn cdrom_volumes(&self) -> Vec<&str> {
        self.extra
            .values()
            .filter(|v| v.split(',').any(|p| p.trim() == "media=cdrom"))
            .filter_map(|v| v.split(',').next())
            .map(|f| f.strip_prefix("file=").unwrap_or(f))
            .collect()
    }

    /// The storages of CD-ROM volumes (`local` of `local:iso/x.iso`).
    pub fn cdrom_storages(&self) -> Vec<&str> {
        self.cdrom_volumes()
            .into_iter()
            .filter_map(|v| v.split_once(':').map(|(s, _)| s))
            .collect()
    }

    /// Whether a CD-ROM drive is the host's physical drive (`cdrom`).
    pub fn has_physical_cdrom(&self) -> bool {
        self.cdrom_volumes().contains(&"cdrom")
    }

    /// The `scsi0` property string.
    pub fn disk(&self) -> String {
        format!("{}:{},size={}G", self.storage, self.volume(), self.disk_gib)
    }

    /// Bytes the disk takes on its storage (a linked clone's are its base's).
    pub fn allocated_bytes(&self) -> u64 {
        if self.linked_base.is_some() {
            0
        } else {
            self.disk_gib << 30
        }
    }

    /// Config as `GET .../config` renders it (memory is a property string in
    /// PVE 8, so it is a string here too).
    pub fn config_json(&self) -> Value {
        let mut m = serde_json::Map::new();
        m.insert("name".into(), json!(self.name));
        m.insert("cores".into(), json!(self.cores));
        m.insert("sockets".into(), json!(self.sockets));
        m.insert("memory".into(), json!(self.memory_mib.to_string()));
        m.insert("agent".into(), json!(self.agent));
        m.insert("scsi0".into(), json!(self.disk()));
        m.insert("scsihw".into(), json!("virtio-scsi-single"));
        // A `net0` set through `extra` (a VLAN tag, another bridge) wins.
        if !self.extra.contains_key("net0") {
            m.insert(
                "net0".into(),
                json!(format!(
                    "virtio=BC:24:11:00:{:02X}:{:02X},bridge=vmbr0",
                    (self.vmid >> 8) & 0xff,
                    self.vmid & 0xff
                )),
            );
        }
        m.insert("ostype".into(), json!("l26"));
        m.insert("boot".into(), json!("order=scsi0"));
        if let Some(d) = &self.description {
            m.insert("description".into(), json!(d));
        }
        if let Some(t) = &self.tags {
            m.insert("tags".into(), json!(t));
        }
        if let Some(l) = &self.lock {
            m.insert("lock".into(), json!(l));
        }
        if self.template {
            m.insert("template".into(), json!(1));
        }
        if self.protection {
            m.insert("protection".into(), json!(1));
        }
        for (k, v) in &self.extra {
            m.entry(k.clone()).or_insert_with(|| json!(v));
        }
        let digest = hex::encode(Sha256::digest(Value::Object(m.clone()).to_string()));
        // PVE digests are SHA-1 (40 hex); keep the same shape.
        m.insert("digest".into(), json!(digest[..40].to_string()));
        Value::Object(m)
    }

    pub fn digest(&self) -> String {
        self.config_json()["digest"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    pub fn status_str(&self) -> &'static str {
        if self.running {
            "running"
        } else {
            "stopped"
        }
    }

    pub fn ha_json(&self) -> Value {
        match &self.ha {
            Some(state) => json!({"managed": 1, "state": state, "group": null}),
            None => json!({"managed": 0}),
        }
    }
}

#[derive(Clone, Debug)]
pub struct NodeState {
    pub online: bool,
}

/// Mutable simulator state, behind one mutex.
pub struct Cluster {
    pub nodes: BTreeMap<String, NodeState>,
    pub vms: BTreeMap<u32, Vm>,
    pub pools: BTreeMap<String, String>,
    pub tasks: HashMap<String, Task>,
    /// Running clone workers per (node, storage).
    pub active_clones: HashMap<(String, String), usize>,
    pub agents: HashMap<u32, AgentState>,
    pub next_pid: u32,
    pub pstart: u32,
    pub resources_cache: Option<(Instant, Value)>,
    /// Abort handles of running worker tasks, by UPID: a node that goes
    /// offline takes its workers with it.
    pub workers: HashMap<String, tokio::task::AbortHandle>,
    /// When each VM created through the API was created (seeded VMs and
    /// templates count as old: their RRD data exists from the start).
    pub created: HashMap<u32, Instant>,
    /// pvestatd's last RRD sample per VM: when it was taken and its fields.
    pub rrd: HashMap<u32, (Instant, Value)>,
}

impl Cluster {
    pub fn new_task(&mut self, node: &str, kind: &str, id: &str, user: &str) -> String {
        self.next_pid = self.next_pid.wrapping_add(1);
        let t = Task::new(node, self.next_pid, self.pstart, kind, id, user);
        let upid = t.upid.clone();
        self.tasks.insert(upid.clone(), t);
        upid
    }

    pub fn task_log(&mut self, upid: &str, line: impl Into<String>) {
        if let Some(t) = self.tasks.get_mut(upid) {
            t.log.push(line.into());
        }
    }

    pub fn finish_task(&mut self, upid: &str, exitstatus: impl Into<String>) {
        if let Some(t) = self.tasks.get_mut(upid) {
            t.exitstatus = Some(exitstatus.into());
            t.endtime = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .ok()
                .map(|d| d.as_secs());
        }
    }

    /// The VM `vmid` on `node`, or PVE's missing-config error.
    pub fn vm_on(&self, node: &str, vmid: u32) -> ApiResult<&Vm> {
        match self.vms.get(&vmid) {
            Some(vm) if vm.node == node => Ok(vm),
            _ => Err(missing_conf(node, vmid)),
        }
    }

    pub fn vm_on_mut(&mut self, node: &str, vmid: u32) -> ApiResult<&mut Vm> {
        match self.vms.get_mut(&vmid) {
            Some(vm) if vm.node == node => Ok(vm),
            _ => Err(missing_conf(node, vmid)),
        }
    }
}

pub fn missing_conf(node: &str, vmid: u32) -> ApiError {
    ApiError::internal(format!(
        "Configuration file 'nodes/{node}/qemu-server/{vmid}.conf' does not exist"
    ))
}

pub fn lock_timeout(vmid: u32) -> String {
    format!("can't lock file '/var/lock/qemu-server/lock-{vmid}.conf' - got timeout")
}

pub fn locked(vmid: u32, lock: &str) -> String {
    format!("VM {vmid} is locked ({lock})")
}
