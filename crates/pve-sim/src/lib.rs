//! A Proxmox VE API simulator for tests of the real Proxmox backend.
//!
//! It serves the part of `/api2/json` a VM lifecycle client uses over HTTPS
//! (with a CA generated at startup), checks token auth, validates every request
//! against its embedded description of those endpoints (and against the
//! official PVE API schema when one is available), runs worker tasks with
//! UPIDs, models config/storage locks, HA, migration and the guest agent, and
//! offers fault injection. PVE's less forgiving behaviours (RRD lag, old
//! pve-http-server error rendering and body limits, description and tag
//! storage, Latin-1 agent data, `;` in forms) are on by default; each has a
//! [`SimConfig`] knob. Agent calls go to a real `qemu-ga` per running VM when
//! one is installed ([`GuestAgentMode`]), else to a built-in agent; either way
//! commands run as real processes confined to a per-VM scratch dir. The crate
//! README lists every endpoint and knob.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! let sim = pve_sim::PveSim::start(pve_sim::SimConfig::default()).await?;
//! println!("{} {}", sim.base_url(), sim.fingerprint());
//! sim.shutdown().await;
//! # Ok(()) }
//! ```

pub mod agent;
pub mod cli;
pub mod config;
pub mod faults;
mod flag_values;
mod guest_api;
pub mod guest_root;
mod inventory;
mod lifecycle;
mod mapping;
mod migrate;
pub mod params;
mod privileges;
pub mod qga;
mod resize;
mod routes;
pub mod schema;
pub mod server;
pub mod sim;
pub mod state;
mod storage;
mod storage_cfg;
pub mod tasks;
pub mod tls;
mod vm_config;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use tokio::task::JoinHandle;

pub use agent::{GuestExec, GuestHandler, GuestOutput};
pub use config::{
    find_qemu_ga, parse_size, GuestAgentMode, HttpServerVersion, NodeMemory, PciMapping, SimConfig,
    StorageKind, StorageSpec, TagAccess, TagStyle, TemplateSpec, GUEST_AGENT_ENV,
};
pub use faults::Faults;
pub use guest_root::{GUEST_ROOT_ENV, TEMPLATE_HOSTNAME};
pub use params::Params;
pub use sim::{LeftoverVolume, RecordedRequest, Waits};
pub use state::Vm;

/// Endpoint names for counters and fault injection (`"METHOD /template"`).
pub mod endpoints {
    pub const NEXTID: &str = "GET /cluster/nextid";
    pub const RESOURCES: &str = "GET /cluster/resources";
    pub const NODES: &str = "GET /nodes";
    pub const POOLS: &str = "GET /pools";
    pub const POOL: &str = "GET /pools/{poolid}";
    pub const NODE_VMS: &str = "GET /nodes/{node}/qemu";
    pub const CLONE: &str = "POST /nodes/{node}/qemu/{vmid}/clone";
    pub const CONFIG_GET: &str = "GET /nodes/{node}/qemu/{vmid}/config";
    pub const CONFIG_PUT: &str = "PUT /nodes/{node}/qemu/{vmid}/config";
    pub const CONFIG_POST: &str = "POST /nodes/{node}/qemu/{vmid}/config";
    pub const START: &str = "POST /nodes/{node}/qemu/{vmid}/status/start";
    pub const STOP: &str = "POST /nodes/{node}/qemu/{vmid}/status/stop";
    pub const SHUTDOWN: &str = "POST /nodes/{node}/qemu/{vmid}/status/shutdown";
    pub const STATUS: &str = "GET /nodes/{node}/qemu/{vmid}/status/current";
    pub const DESTROY: &str = "DELETE /nodes/{node}/qemu/{vmid}";
    pub const TASK_STATUS: &str = "GET /nodes/{node}/tasks/{upid}/status";
    pub const TASK_LOG: &str = "GET /nodes/{node}/tasks/{upid}/log";
    pub const AGENT_PING: &str = "POST /nodes/{node}/qemu/{vmid}/agent/ping";
    pub const AGENT_FILE_WRITE: &str = "POST /nodes/{node}/qemu/{vmid}/agent/file-write";
    pub const AGENT_EXEC: &str = "POST /nodes/{node}/qemu/{vmid}/agent/exec";
    pub const AGENT_EXEC_STATUS: &str = "GET /nodes/{node}/qemu/{vmid}/agent/exec-status";
    pub const AGENT_NETWORK: &str = "GET /nodes/{node}/qemu/{vmid}/agent/network-get-interfaces";
    pub const AGENT_OSINFO: &str = "GET /nodes/{node}/qemu/{vmid}/agent/get-osinfo";
    pub const AGENT_HOST_NAME: &str = "GET /nodes/{node}/qemu/{vmid}/agent/get-host-name";
    pub const AGENT_INFO: &str = "GET /nodes/{node}/qemu/{vmid}/agent/info";
    pub const MIGRATE: &str = "POST /nodes/{node}/qemu/{vmid}/migrate";
    pub const TEMPLATE: &str = "POST /nodes/{node}/qemu/{vmid}/template";
    pub const CLUSTER_STATUS: &str = "GET /cluster/status";
    pub const NODE_STATUS: &str = "GET /nodes/{node}/status";
    pub const NODE_STORAGE: &str = "GET /nodes/{node}/storage";
    pub const STORAGE_STATUS: &str = "GET /nodes/{node}/storage/{storage}/status";
    pub const PERMISSIONS: &str = "GET /access/permissions";
    pub const SDN_VNETS: &str = "GET /cluster/sdn/vnets";
    pub const RESIZE: &str = "PUT /nodes/{node}/qemu/{vmid}/resize";
    pub const PCI_MAPPINGS: &str = "GET /cluster/mapping/pci";
}

/// Description marker the provider writes (`proxmox-provider.md`).
pub fn marker_description(machine_id: &str, operation_id: &str) -> String {
    format!("BigFleet managed VM. machine_id={machine_id} operation_id={operation_id}")
}

/// A running simulator. Dropping it stops the server (prefer [`PveSim::shutdown`]).
pub struct PveSim {
    shared: Arc<sim::Shared>,
    addr: SocketAddr,
    ca: tls::TestCa,
    server: JoinHandle<()>,
    accepted: Arc<std::sync::atomic::AtomicU64>,
    _scratch: Option<tempfile::TempDir>,
}

impl PveSim {
    /// Generate the CA, load the schema, bind and start serving.
    pub async fn start(cfg: SimConfig) -> Result<Self> {
        let schema = schema::Schema::load(cfg.schema_path.as_deref())?;
        tracing::info!(schema = %schema.source(), "validating requests");
        anyhow::ensure!(!cfg.nodes.is_empty(), "at least one node is required");
        let (scratch, tmp) = match &cfg.scratch_dir {
            Some(d) => {
                std::fs::create_dir_all(d)
                    .with_context(|| format!("creating scratch dir {}", d.display()))?;
                (d.clone(), None)
            }
            None => {
                let t = tempfile::Builder::new()
                    .prefix("pve-sim-")
                    .tempdir()
                    .context("creating scratch dir")?;
                (t.path().to_path_buf(), Some(t))
            }
        };
        let ca = tls::TestCa::generate()?;
        let tls_cfg = ca.server_config()?;
        let listener = server::bind(cfg.listen).await?;
        let addr = listener.local_addr().context("local addr")?;
        let shared = Arc::new(sim::Shared::new(
            cfg,
            schema,
            scratch,
            ca.fingerprint.clone(),
        )?);
        let app = server::router(Arc::clone(&shared));
        let idle = shared.cfg.keepalive_idle;
        let accepted = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let server = tokio::spawn(server::serve_with(
            listener,
            tls_cfg,
            app,
            idle,
            Arc::clone(&accepted),
        ));
        Ok(Self {
            shared,
            addr,
            ca,
            server,
            accepted,
            _scratch: tmp,
        })
    }

    /// `https://127.0.0.1:PORT/api2/json`.
    pub fn base_url(&self) -> String {
        format!("https://{}/api2/json", self.addr)
    }

    /// `https://localhost:PORT/api2/json` (hostname in the leaf's SANs).
    pub fn base_url_localhost(&self) -> String {
        format!("https://localhost:{}/api2/json", self.addr.port())
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// TCP connections accepted so far (each closed one is a new one next time).
    pub fn connections_accepted(&self) -> u64 {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// PEM of the CA that signed the server certificate.
    pub fn ca_pem(&self) -> &str {
        &self.ca.ca_pem
    }

    /// Write the CA PEM to `path` (for `--proxmox-ca-file`).
    pub fn write_ca(&self, path: &Path) -> Result<()> {
        std::fs::write(path, &self.ca.ca_pem)
            .with_context(|| format!("writing CA to {}", path.display()))
    }

    /// SHA-256 of the leaf certificate, `AB:CD:...`.
    pub fn fingerprint(&self) -> &str {
        &self.ca.fingerprint
    }

    pub fn token_id(&self) -> &str {
        &self.shared.cfg.token_id
    }

    pub fn token_secret(&self) -> &str {
        &self.shared.cfg.token_secret
    }

    /// The full `Authorization` header value.
    pub fn auth_header(&self) -> String {
        format!("PVEAPIToken={}={}", self.token_id(), self.token_secret())
    }

    /// Which descriptions requests are validated against: `embedded` or
    /// `embedded+official:PATH`.
    pub fn schema_source(&self) -> String {
        self.shared.schema.source()
    }

    pub fn config(&self) -> &SimConfig {
        &self.shared.cfg
    }

    /// The `qemu-ga` agent calls are forwarded to; `None` = the built-in agent.
    pub fn qemu_ga(&self) -> Option<&Path> {
        self.shared.qga_bin.as_deref()
    }

    /// `"qemu-ga (PATH)"` or `"built-in"`, for logs.
    pub fn guest_agent_description(&self) -> String {
        match self.qemu_ga() {
            Some(p) => format!("qemu-ga ({})", p.display()),
            None => "built-in".into(),
        }
    }

    /// OS pid of VM `vmid`'s qemu-ga while one runs (forwarding mode; it starts
    /// on the first agent call after boot and dies with the VM).
    pub fn qemu_ga_pid(&self, vmid: u32) -> Option<u32> {
        self.shared.qga_pid(vmid)
    }

    /// Fault injection and counters.
    pub fn faults(&self) -> &Faults {
        &self.shared.faults
    }

    pub fn call_count(&self, endpoint: &str) -> u64 {
        self.shared.faults.call_count(endpoint)
    }

    pub fn reset_counts(&self) {
        self.shared.faults.reset_counts()
    }

    /// Every request received so far.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared.requests.lock().clone()
    }

    /// Requests that matched no endpoint or violated the schema.
    pub fn schema_violations(&self) -> Vec<RecordedRequest> {
        self.shared
            .requests
            .lock()
            .iter()
            .filter(|r| r.endpoint.is_none() || r.schema_errors.is_some())
            .cloned()
            .collect()
    }

    pub fn clear_requests(&self) {
        self.shared.requests.lock().clear();
    }

    /// Snapshot of VM `vmid`.
    pub fn vm(&self, vmid: u32) -> Option<Vm> {
        self.shared.cluster.lock().vms.get(&vmid).cloned()
    }

    /// Snapshot of all VMs (templates included).
    pub fn vms(&self) -> BTreeMap<u32, Vm> {
        self.shared.cluster.lock().vms.clone()
    }

    /// The VM's guest scratch root (its `/`).
    pub fn guest_root(&self, vmid: u32) -> PathBuf {
        self.shared.guest_root(vmid)
    }

    /// Read a file from the VM's guest root.
    pub fn read_guest_file(&self, vmid: u32, guest_path: &str) -> Result<Vec<u8>> {
        let p = agent::guest_path(&self.shared.guest_root(vmid), guest_path)
            .map_err(anyhow::Error::msg)?;
        std::fs::read(&p).with_context(|| format!("reading {}", p.display()))
    }

    /// The guest's hostname (its `/etc/hostname`): the template image's
    /// ([`guest_root::TEMPLATE_HOSTNAME`]) until a guest command renames it;
    /// `None` before the guest first booted its agent.
    pub fn guest_hostname(&self, vmid: u32) -> Option<String> {
        let name = self.read_guest_file(vmid, guest_root::HOSTNAME_FILE).ok()?;
        Some(String::from_utf8_lossy(&name).trim().to_string())
    }

    /// Power the VM off behind the API's back (agent state is lost).
    pub fn stop_vm_out_of_band(&self, vmid: u32) -> bool {
        self.shared.set_running_out_of_band(vmid, false)
    }

    /// Power the VM on behind the API's back (agent boots after the delay).
    pub fn start_vm_out_of_band(&self, vmid: u32) -> bool {
        self.shared.set_running_out_of_band(vmid, true)
    }

    /// Set or clear the config `lock` (e.g. a leftover `clone` lock).
    pub fn set_lock(&self, vmid: u32, lock: Option<&str>) -> bool {
        self.shared
            .update_vm(vmid, |vm| vm.lock = lock.map(str::to_string))
    }

    /// Make the VM HA-managed (`Some("started"|"stopped")`) or not.
    pub fn set_ha(&self, vmid: u32, state: Option<&str>) -> bool {
        self.shared
            .update_vm(vmid, |vm| vm.ha = state.map(str::to_string))
    }

    pub fn set_protection(&self, vmid: u32, on: bool) -> bool {
        self.shared.update_vm(vmid, |vm| vm.protection = on)
    }

    /// Arbitrary mutation of one VM.
    pub fn update_vm(&self, vmid: u32, f: impl FnOnce(&mut Vm)) -> bool {
        self.shared.update_vm(vmid, f)
    }

    /// Take a node offline (API calls for it answer 595) or back online.
    pub fn set_node_online(&self, node: &str, online: bool) -> bool {
        self.shared.set_node_online(node, online)
    }

    /// Make `storage` unreachable from `node` (its status says `active` 0,
    /// allocating there fails `storage 'X' is not online`) or reachable
    /// again; see [`SimConfig::storages_offline`].
    pub fn set_storage_online(&self, node: &str, storage: &str, online: bool) {
        let key = (node.to_string(), storage.to_string());
        let mut offline = self.shared.storages_offline.lock();
        if online {
            offline.remove(&key);
        } else {
            offline.insert(key);
        }
    }

    /// Make `storage`'s mount on `node` hang (an NFS server that stopped
    /// answering, a dir storage on a dead disk) or answer again. PVE's
    /// `activate_storage` gives up on it after 2 s with `unable to
    /// activate storage 'X' - directory '/mnt/pve/X' does not exist or is
    /// unreachable`, which fails a destroy with `destroy-unreferenced-disks`
    /// on that node (it activates every storage holding images) after the
    /// VM's own disks are freed; without the option the destroy ends.
    pub fn set_storage_hung(&self, node: &str, storage: &str, hung: bool) {
        self.shared.set_storage_hung(node, storage, hung);
    }

    /// Make freeing volumes on `storage` fail on `node` (an RBD image with
    /// watchers, an LV or ZFS dataset in use) or work again. A destroy there
    /// then does as qemu-server's `destroy_vm`: it logs `Could not remove
    /// disk '<volid>', check manually: <error>` (`WARN: ` in front on PVE
    /// 9), removes the VM all the same, and leaves the volume (see
    /// [`PveSim::leftover_volumes`]); with `destroy-unreferenced-disks` the
    /// second attempt warns again. PVE 9 counts both warnings (`WARNINGS:
    /// N`), PVE 8 writes them with plain `warn` and ends `OK` (see
    /// [`SimConfig::pve9`]).
    pub fn set_storage_busy(&self, node: &str, storage: &str, busy: bool) {
        self.shared.set_storage_busy(node, storage, busy);
    }

    /// Agent requests that waited for a booting agent, by node: how many,
    /// for how long in all, and the most at once. On PVE each holds one of
    /// the node's three pvedaemon workers while it waits, so this is what
    /// a caller's agent waits cost the node's API.
    pub fn agent_waits(&self) -> BTreeMap<String, Waits> {
        self.shared.agent_waits.lock().clone()
    }

    /// Protected calls that queued for one of their node's pvedaemon
    /// workers (see [`SimConfig::daemon_workers`]), by node: how many, for
    /// how long in all, and the most queued at once.
    pub fn daemon_queue(&self) -> BTreeMap<String, Waits> {
        self.shared.daemon_queue.lock().clone()
    }

    /// The volumes destroys could not free, oldest first.
    pub fn leftover_volumes(&self) -> Vec<LeftoverVolume> {
        self.shared.leftover_volumes.lock().clone()
    }

    /// Replace all guest command handlers with `h`.
    pub fn set_guest_handler(
        &self,
        h: impl Fn(&GuestExec) -> Option<GuestOutput> + Send + Sync + 'static,
    ) {
        self.shared.guest.set(Arc::new(h));
    }

    /// Add a handler after the existing ones.
    pub fn add_guest_handler(
        &self,
        h: impl Fn(&GuestExec) -> Option<GuestOutput> + Send + Sync + 'static,
    ) {
        self.shared.guest.add(Arc::new(h));
    }

    /// Commands whose space-joined argv contains `pattern` produce `out`.
    pub fn on_guest_command(&self, pattern: &str, out: GuestOutput) {
        let pattern = pattern.to_string();
        self.add_guest_handler(move |e| e.command_line().contains(&pattern).then(|| out.clone()));
    }

    pub fn clear_guest_handlers(&self) {
        self.shared.guest.clear();
    }

    /// Remove a VM behind the API's back (`qm destroy` on its node).
    pub fn remove_vm(&self, vmid: u32) -> Option<Vm> {
        let mut c = self.shared.cluster.lock();
        c.agents.remove(&vmid);
        c.resources_cache = None;
        c.vms.remove(&vmid)
    }

    /// Insert a VM directly (not via the API).
    pub fn insert_vm(&self, vm: Vm) -> Result<()> {
        self.shared.insert_vm(vm)
    }

    /// A stopped, agent-enabled VM on `node` with default sizing, for seeding.
    pub fn new_vm(&self, vmid: u32, node: &str, name: &str) -> Vm {
        Vm {
            vmid,
            node: node.to_string(),
            name: name.to_string(),
            description: None,
            tags: None,
            cores: 2,
            sockets: 1,
            memory_mib: 2048,
            agent: "1".into(),
            lock: None,
            flock: 0,
            template: false,
            running: false,
            started_at: None,
            ha: None,
            protection: false,
            pool: self.shared.cfg.pools.first().cloned(),
            storage: "local-lvm".into(),
            shared_storage: false,
            disk_gib: 32,
            linked_base: None,
            extra: BTreeMap::new(),
            guest_root: self.shared.guest_root(vmid),
        }
    }

    /// Seed `n` running VMs marked the way the provider marks them (tags
    /// `bigfleet;bigfleet-<id>`, marker description, `bigfleet-` name), spread
    /// over the nodes, with VMIDs from 10000 (or above the highest existing id).
    /// Returns the VMIDs.
    pub fn seed_marked_vms(&self, n: usize) -> Result<Vec<u32>> {
        let nodes = self.shared.cfg.nodes.clone();
        let first = self
            .shared
            .cluster
            .lock()
            .vms
            .keys()
            .next_back()
            .map_or(10_000, |&max| max.max(9_999) + 1);
        let mut ids = Vec::with_capacity(n);
        for i in 0..n {
            let vmid = first + i as u32;
            let idx = vmid - 10_000;
            let node = &nodes[idx as usize % nodes.len()];
            let machine_id = format!("proxmox/OnDemand/pve.small/{node}/{idx:03}");
            let sanitized: String = machine_id
                .to_lowercase()
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || "_.+-".contains(c) {
                        c
                    } else {
                        '-'
                    }
                })
                .collect();
            let mut vm = self.new_vm(vmid, node, &format!("bigfleet-pve-small-{vmid}"));
            vm.description = Some(marker_description(&machine_id, &format!("seed-{idx}")));
            vm.tags = Some(schema::normalize_tags(&format!(
                "bigfleet;bigfleet-{sanitized}"
            )));
            vm.running = true;
            vm.started_at = Some(std::time::Instant::now());
            self.insert_vm(vm)?;
            ids.push(vmid);
        }
        Ok(ids)
    }

    /// Stop serving and drop open connections.
    pub async fn shutdown(mut self) {
        self.server.abort();
        let _ = (&mut self.server).await; // JoinError::Cancelled is the expected outcome
        self.shared.cluster.lock().agents.clear();
    }
}

impl Drop for PveSim {
    fn drop(&mut self) {
        self.server.abort();
        // Worker tasks may keep `shared` alive a while; the VMs' qemu-ga must not.
        self.shared.cluster.lock().agents.clear();
    }
}
