//! The simulator core: shared state, config-lock waiting and worker tasks. The
//! operations live in `inventory`, `lifecycle`, `vm_config`, `migrate` and
//! `guest_api`; `routes` maps each endpoint to one of them.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::Notify;

use crate::agent::GuestHandlers;
use crate::config::{SimConfig, TemplateSpec};
use crate::faults::Faults;
use crate::params::Params;
use crate::schema::{ParamErrors, Schema};
use crate::state::{lock_timeout, ApiError, Cluster, NodeState, Vm};

/// One request as the simulator received it.
#[derive(Clone, Debug, Serialize)]
pub struct RecordedRequest {
    pub method: String,
    pub path: String,
    /// `"METHOD /template"`, `None` when no endpoint matched.
    pub endpoint: Option<String>,
    pub params: Params,
    /// Schema violations; `None` when valid (or not an API endpoint).
    pub schema_errors: Option<ParamErrors>,
}

pub struct Shared {
    pub cfg: SimConfig,
    pub cluster: Mutex<Cluster>,
    /// Signalled whenever locks or VM state change.
    pub changed: Notify,
    pub faults: Faults,
    pub schema: Schema,
    pub requests: Mutex<Vec<RecordedRequest>>,
    pub guest: GuestHandlers,
    pub scratch: PathBuf,
    pub fingerprint: String,
    /// `qemu-ga` to forward agent calls to; `None` = the built-in agent.
    pub qga_bin: Option<PathBuf>,
    /// When the simulator started (node uptimes count from here).
    pub started: Instant,
    /// `(node, storage)` pairs whose storage cannot be activated now
    /// (seeded from [`SimConfig::storages_offline`]).
    pub storages_offline: Mutex<BTreeSet<(String, String)>>,
    /// `(node, storage)` pairs whose mount hangs: pve-storage's
    /// `activate_storage` gives up on it (see [`crate::PveSim::set_storage_hung`]).
    pub storages_hung: Mutex<BTreeSet<(String, String)>>,
    /// `(node, storage)` pairs where freeing a volume fails (an RBD image
    /// with watchers, an LV or ZFS dataset in use): `destroy_vm` warns and
    /// leaves the volume (see [`crate::PveSim::set_storage_busy`]).
    pub storages_busy: Mutex<BTreeSet<(String, String)>>,
    /// Volumes a destroy could not free: still on their storage, taking
    /// their space, owned by no VM.
    pub leftover_volumes: Mutex<Vec<LeftoverVolume>>,
    /// VMs whose start is under way, by node: their mapped PCI devices
    /// are reserved (qemu-server `reserve_pci_usage` with a timeout) until
    /// the VM runs, when running itself holds them.
    pub(crate) pci_starting: Mutex<BTreeMap<u32, String>>,
    /// Storage locks that volume allocations queue on, by lock name
    /// (`storage-ID` cluster-wide, `NODE/pve-storage-ID` per node); see
    /// [`SimConfig::volume_alloc_time`].
    pub(crate) storage_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Agent requests that waited for a booting agent, by node (see
    /// [`SimConfig::agent_ping_wait`]): on PVE each holds one of the node's
    /// pvedaemon workers for as long as it waits.
    pub(crate) agent_waits: Mutex<BTreeMap<String, Waits>>,
    /// Each node's pvedaemon workers (see [`SimConfig::daemon_workers`]),
    /// and the requests that queued for one.
    pub(crate) daemon: Mutex<BTreeMap<String, Arc<tokio::sync::Semaphore>>>,
    pub(crate) daemon_queue: Mutex<BTreeMap<String, Waits>>,
}

/// Requests on one node that waited for something (an agent's boot, a
/// pvedaemon worker): how many, for how long in all, and the most at once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Waits {
    pub requests: u64,
    pub total: Duration,
    pub peak: usize,
    /// Waiting now.
    pub now: usize,
}

/// Counts one request on `node` in `waits` as waiting until it drops.
pub(crate) struct WaitGuard<'a> {
    waits: &'a Mutex<BTreeMap<String, Waits>>,
    node: String,
    since: Instant,
}

impl<'a> WaitGuard<'a> {
    pub(crate) fn new(waits: &'a Mutex<BTreeMap<String, Waits>>, node: &str) -> Self {
        let mut all = waits.lock();
        let w = all.entry(node.to_string()).or_default();
        w.requests += 1;
        w.now += 1;
        w.peak = w.peak.max(w.now);
        WaitGuard {
            waits,
            node: node.to_string(),
            since: Instant::now(),
        }
    }
}

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        if let Some(w) = self.waits.lock().get_mut(&self.node) {
            w.now -= 1;
            w.total += self.since.elapsed();
        }
    }
}

impl Shared {
    /// One of `node`'s pvedaemon workers for a protected call (PVE runs
    /// those in pvedaemon, three workers by default, each serving one call
    /// at a time), waited for when all are busy; `None` when the simulator
    /// models no limit.
    pub(crate) async fn daemon_worker(
        &self,
        node: &str,
    ) -> Option<tokio::sync::OwnedSemaphorePermit> {
        if self.cfg.daemon_workers == 0 {
            return None;
        }
        let workers = Arc::clone(
            self.daemon
                .lock()
                .entry(node.to_string())
                .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(self.cfg.daemon_workers))),
        );
        if let Ok(permit) = Arc::clone(&workers).try_acquire_owned() {
            return Some(permit);
        }
        let _queued = WaitGuard::new(&self.daemon_queue, node);
        workers.acquire_owned().await.ok()
    }
}

/// A volume a destroy left behind (`Could not remove disk`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LeftoverVolume {
    /// Where the destroy ran.
    pub node: String,
    pub storage: String,
    /// `storage:volume`, as the task log names it.
    pub volid: String,
    pub bytes: u64,
}

impl Shared {
    pub fn new(
        cfg: SimConfig,
        schema: Schema,
        scratch: PathBuf,
        fingerprint: String,
    ) -> anyhow::Result<Self> {
        let nodes = cfg
            .nodes
            .iter()
            .map(|n| (n.clone(), NodeState { online: true }))
            .collect();
        let pools = cfg
            .pools
            .iter()
            .map(|p| (p.clone(), String::new()))
            .collect();
        let cluster = Cluster {
            nodes,
            vms: BTreeMap::new(),
            pools,
            tasks: HashMap::new(),
            active_clones: HashMap::new(),
            agents: HashMap::new(),
            next_pid: 0x1000 + rand::random::<u16>() as u32,
            pstart: 0x6AE8 + rand::random::<u16>() as u32,
            resources_cache: None,
            created: HashMap::new(),
            rrd: HashMap::new(),
            workers: HashMap::new(),
        };
        let qga_bin = cfg.guest_agent.resolve()?;
        let storages_offline = Mutex::new(cfg.storages_offline.iter().cloned().collect());
        let s = Self {
            storages_offline,
            storages_hung: Mutex::default(),
            storages_busy: Mutex::default(),
            leftover_volumes: Mutex::default(),
            pci_starting: Mutex::default(),
            storage_locks: Mutex::default(),
            agent_waits: Mutex::default(),
            daemon: Mutex::default(),
            daemon_queue: Mutex::default(),
            qga_bin,
            cfg,
            cluster: Mutex::new(cluster),
            changed: Notify::new(),
            faults: Faults::default(),
            schema,
            requests: Mutex::new(Vec::new()),
            guest: GuestHandlers::default(),
            scratch,
            fingerprint,
            started: Instant::now(),
        };
        for t in s.cfg.templates.clone() {
            anyhow::ensure!(
                s.cfg.nodes.contains(&t.node),
                "template {} is on node {:?}, which is not in the node list",
                t.vmid,
                t.node
            );
            s.insert_template(&t)?;
        }
        Ok(s)
    }

    /// Whether the token can see VM `vmid` (see [`SimConfig::pool_acl`]):
    /// always without pool ACLs; else templates and members of the first pool.
    pub fn visible(&self, c: &Cluster, vmid: u32) -> bool {
        if !self.cfg.pool_acl {
            return true;
        }
        match c.vms.get(&vmid) {
            Some(vm) => {
                vm.template || (vm.pool.is_some() && vm.pool == self.cfg.pools.first().cloned())
            }
            None => false,
        }
    }

    pub fn user(&self) -> &str {
        &self.cfg.token_id
    }

    /// An empty stopped VM on `node`: what a temporary config describes.
    pub(crate) fn blank_vm(&self, vmid: u32, node: &str) -> Vm {
        Vm {
            vmid,
            node: node.to_string(),
            name: String::new(),
            description: None,
            tags: None,
            cores: 1,
            sockets: 1,
            memory_mib: 512,
            agent: "0".into(),
            lock: None,
            flock: 0,
            template: false,
            running: false,
            started_at: None,
            ha: None,
            protection: false,
            pool: None,
            storage: String::new(),
            shared_storage: false,
            disk_gib: 0,
            linked_base: None,
            extra: BTreeMap::new(),
            guest_root: self.guest_root(vmid),
        }
    }

    fn insert_template(&self, t: &TemplateSpec) -> anyhow::Result<()> {
        let vm = Vm {
            vmid: t.vmid,
            node: t.node.clone(),
            name: t.name.clone(),
            description: None,
            tags: None,
            cores: t.cores,
            sockets: 1,
            memory_mib: t.memory_mib,
            agent: if t.agent { "1".into() } else { "0".into() },
            lock: None,
            flock: 0,
            template: true,
            running: false,
            started_at: None,
            ha: None,
            protection: t.protection,
            pool: None,
            storage: t.storage.clone(),
            shared_storage: t.shared,
            disk_gib: t.disk_gib,
            linked_base: None,
            extra: t
                .cdrom
                .iter()
                .map(|c| ("ide2".to_string(), c.clone()))
                .collect(),
            guest_root: self.guest_root(t.vmid),
        };
        self.insert_vm(vm)
    }

    pub fn guest_root(&self, vmid: u32) -> PathBuf {
        self.scratch.join(format!("vm-{vmid}"))
    }

    /// Add a VM; fails if the id is taken. Its guest root is created lazily on
    /// first agent use (creating thousands of directories up front is slow).
    pub fn insert_vm(&self, vm: Vm) -> anyhow::Result<()> {
        let mut c = self.cluster.lock();
        anyhow::ensure!(
            !c.vms.contains_key(&vm.vmid),
            "VM {} already exists",
            vm.vmid
        );
        c.vms.insert(vm.vmid, vm);
        c.resources_cache = None;
        drop(c);
        self.changed.notify_waiters();
        Ok(())
    }

    pub(crate) fn is_shared(&self, storage: &str) -> bool {
        self.cfg.shared_storages.iter().any(|s| s == storage)
            || self
                .cfg
                .storages
                .iter()
                .any(|s| s.shared && s.name == storage)
            || self
                .cfg
                .templates
                .iter()
                .any(|t| t.shared && t.storage == storage)
    }

    /// Wake lock waiters. (`/cluster/resources` staleness is time-based, so
    /// changes deliberately do not invalidate its cache.)
    pub(crate) fn touch(&self, _c: &mut Cluster) {
        self.changed.notify_waiters();
    }

    /// Wait until no worker holds `vmid`'s config file lock, then run `f` under
    /// the state mutex. Times out like PVE's flock after `cfg.lock_wait`.
    pub(crate) async fn with_flock<T>(
        &self,
        vmid: u32,
        f: impl FnOnce(&mut Cluster) -> Result<T, String>,
    ) -> Result<T, String> {
        let deadline = tokio::time::Instant::now() + self.cfg.lock_wait;
        let mut f = Some(f);
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut c = self.cluster.lock();
                let held = c.vms.get(&vmid).map(|v| v.flock > 0).unwrap_or(false);
                if !held {
                    let Some(f) = f.take() else {
                        return Err(lock_timeout(vmid));
                    };
                    let r = f(&mut c);
                    self.touch(&mut c);
                    return r;
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(lock_timeout(vmid));
            }
        }
    }

    /// Create a task and run `work` as its worker; `work` returns the exit status
    /// (`OK` / `WARNINGS: N`) or the error text.
    pub(crate) fn spawn_task<F, Fut>(
        self: &Arc<Self>,
        c: &mut Cluster,
        node: &str,
        kind: &str,
        id: &str,
        work: F,
    ) -> String
    where
        F: FnOnce(Arc<Shared>, String) -> Fut + Send + 'static,
        Fut: Future<Output = Result<String, String>> + Send + 'static,
    {
        let upid = c.new_task(node, kind, id, self.user());
        let me = Arc::clone(self);
        let u = upid.clone();
        // Clone workers consume their injected failures themselves (they
        // must clean up what the POST created).
        let injected = (kind != "qmclone")
            .then(|| self.faults.take_task_failure(kind))
            .flatten();
        let worker = tokio::spawn(async move {
            let res = match injected {
                Some(msg) => Err(msg),
                None => work(Arc::clone(&me), u.clone()).await,
            };
            let mut c = me.cluster.lock();
            c.workers.remove(&u);
            match res {
                Ok(status) => c.finish_task(&u, status),
                Err(e) => c.finish_task(&u, e),
            }
            me.touch(&mut c);
        });
        // The caller holds the state lock, so the worker cannot finish (and
        // remove its handle) before the handle is in.
        c.workers.insert(upid.clone(), worker.abort_handle());
        upid
    }

    /// Take the config file lock for a worker (after `check` passes).
    pub(crate) async fn hold_flock(
        &self,
        vmid: u32,
        node: &str,
        check: impl FnOnce(&Vm) -> Result<(), String>,
    ) -> Result<(), String> {
        self.with_flock(vmid, |c| {
            let vm = c.vm_on_mut(node, vmid).map_err(err_text)?;
            check(vm)?;
            vm.flock += 1;
            Ok(())
        })
        .await
    }

    pub(crate) fn release_flock(&self, vmid: u32, f: impl FnOnce(&mut Cluster)) {
        let mut c = self.cluster.lock();
        if let Some(vm) = c.vms.get_mut(&vmid) {
            vm.flock = vm.flock.saturating_sub(1);
        }
        f(&mut c);
        self.touch(&mut c);
    }

    // ---- out-of-band controls ----

    pub fn set_running_out_of_band(&self, vmid: u32, running: bool) -> bool {
        let mut c = self.cluster.lock();
        let Some(vm) = c.vms.get_mut(&vmid) else {
            return false;
        };
        vm.running = running;
        vm.started_at = running.then(Instant::now);
        if let Some(ha) = vm.ha.as_mut() {
            *ha = if running { "started" } else { "stopped" }.into();
        }
        c.agents.remove(&vmid);
        self.touch(&mut c);
        true
    }

    pub fn update_vm(&self, vmid: u32, f: impl FnOnce(&mut Vm)) -> bool {
        let mut c = self.cluster.lock();
        let Some(vm) = c.vms.get_mut(&vmid) else {
            return false;
        };
        f(vm);
        self.touch(&mut c);
        true
    }

    /// See [`crate::PveSim::set_storage_hung`].
    pub fn set_storage_hung(&self, node: &str, storage: &str, hung: bool) {
        let key = (node.to_string(), storage.to_string());
        let mut set = self.storages_hung.lock();
        if hung {
            set.insert(key);
        } else {
            set.remove(&key);
        }
    }

    /// See [`crate::PveSim::set_storage_busy`].
    pub fn set_storage_busy(&self, node: &str, storage: &str, busy: bool) {
        let key = (node.to_string(), storage.to_string());
        let mut set = self.storages_busy.lock();
        if busy {
            set.insert(key);
        } else {
            set.remove(&key);
        }
    }

    /// A node powering off or coming back. Going offline, the node's
    /// worker tasks die with it (their status reads `unexpected status`
    /// once it is back, as PVE reports a task whose process vanished), the
    /// config file locks they held go with their processes, and a clone
    /// worker leaves its new VM as it was: `lock: clone`, and outside the
    /// pool (qemu-server adds the VM to its pool last, in `add_vm_to_pool`).
    /// pvestatd on the node stops: its VMs' last RRD samples are what
    /// `/cluster/resources` shows until they expire
    /// ([`crate::SimConfig::rrd_expiry`]).
    pub fn set_node_online(&self, node: &str, online: bool) -> bool {
        let mut c = self.cluster.lock();
        let Some(n) = c.nodes.get_mut(node) else {
            return false;
        };
        let was = n.online;
        n.online = online;
        if was && !online {
            self.power_off(&mut c, node);
        }
        c.resources_cache = None;
        self.touch(&mut c);
        true
    }

    fn power_off(&self, c: &mut Cluster, node: &str) {
        let dying: Vec<String> = c
            .tasks
            .values()
            .filter(|t| t.node == node && t.exitstatus.is_none())
            .map(|t| t.upid.clone())
            .collect();
        for upid in dying {
            if let Some(w) = c.workers.remove(&upid) {
                w.abort();
            }
            let newid = c.tasks.get(&upid).and_then(|t| t.newid);
            c.finish_task(&upid, "unexpected status");
            if let Some(vm) = newid.and_then(|id| c.vms.get_mut(&id)) {
                vm.lock = Some("clone".into());
                vm.pool = None;
            }
        }
        c.active_clones.retain(|(n, _), _| n != node);
        let now = Instant::now();
        let lag = self.cfg.rrd_lag;
        let on_node: Vec<Vm> = c.vms.values().filter(|v| v.node == node).cloned().collect();
        for vm in on_node {
            if let Some(v) = c.vms.get_mut(&vm.vmid) {
                v.flock = 0;
            }
            // pvestatd's last cycle sampled every VM it already knew.
            let too_new = c
                .created
                .get(&vm.vmid)
                .is_some_and(|t| now.duration_since(*t) < lag);
            if !too_new {
                c.rrd.insert(vm.vmid, (now, vm.rrd_sample()));
            }
        }
    }
}

pub(crate) fn err_text(e: ApiError) -> String {
    match e {
        ApiError::Status(_, m) => m,
        ApiError::Params(m) => format!("{m:?}"),
    }
}

pub(crate) fn prepare_root(root: &std::path::Path) -> anyhow::Result<()> {
    crate::guest_root::prepare(root)
        .map_err(|e| anyhow::anyhow!("creating guest root {}: {e}", root.display()))
}
