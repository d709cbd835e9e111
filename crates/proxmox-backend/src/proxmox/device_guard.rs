//! The device guard: a Create of an instance type with mapped PCI devices
//! (GPUs) is admitted only when its node has that many free devices of the
//! mapping.
//!
//! PVE checks only at start (qemu-server `PCI.pm`: `could not find a free
//! device`), after the clone: a Create it refuses there has cost a clone
//! and fails. So before cloning the guard reads the mapping's devices on
//! the node (`GET /cluster/mapping/pci`, its `map` entries for the node),
//! subtracts those held by the VMs running there, whoever owns them (each
//! `hostpciN` naming the mapping in their config), and those the
//! provider's Creates in flight there have claimed, and refuses the Create
//! when its type's `count` does not fit.
//!
//! A running VM's devices cannot change while its QEMU process lives (a
//! `hostpciN` edit waits as a pending change until it restarts), so its
//! config is read once per process: by `(vmid, pid)`, the pid that `GET
//! /nodes/{node}/qemu` lists. A burst of Creates reads one config per VM
//! that started since the last Create, not one per running VM.
//!
//! A claim is made at admission (refused there: RESOURCE_EXHAUSTED, nothing
//! cloned) and lives until the Create ends: by then its VM runs and the
//! next read counts it; until then the view leaves out the provider's own
//! clones in progress, which their claims count.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use providerkit::ErrorKind;
use tokio::time::Instant;

use super::api::{err_at, Api, QUICK_READ};
use super::inventory::Inventory;
use super::options::{PveOptions, TypeDevices};
use crate::capacity::NoDevices;
use crate::substrate::{CloneRequest, SubstrateError};

/// The most running VMs whose devices are remembered.
const USAGE_ENTRIES: usize = 10_000;

/// Per (node, mapping): machine -> (claim id, devices).
type Claims = BTreeMap<(String, String), HashMap<String, (u64, u32)>>;

/// A Create's claim on its node's devices; given back on drop (by
/// whichever of its holders drops first).
pub(super) struct DeviceClaim {
    ledger: Arc<Mutex<Claims>>,
    key: (String, String),
    machine_id: String,
    id: u64,
}

impl std::fmt::Debug for DeviceClaim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceClaim({} on {})", self.machine_id, self.key.0)
    }
}

impl Drop for DeviceClaim {
    fn drop(&mut self) {
        let mut ledger = self.ledger.lock();
        if let Some(per) = ledger.get_mut(&self.key) {
            if per
                .get(&self.machine_id)
                .is_some_and(|(id, _)| *id == self.id)
            {
                per.remove(&self.machine_id);
            }
            if per.is_empty() {
                ledger.remove(&self.key);
            }
        }
    }
}

/// What one read says of a mapping on a node.
struct DeviceView {
    total: u32,
    held_by_vms: u32,
}

/// Why a claim was not made.
enum DeviceError {
    NoDevices(NoDevices),
    Unread(SubstrateError),
}

pub(super) struct DeviceGuard {
    api: Arc<Api>,
    opts: Arc<PveOptions>,
    /// Our clones in progress, left out of the view (their claims count).
    inventory: Arc<Inventory>,
    ledger: Arc<Mutex<Claims>>,
    next_id: AtomicU64,
    /// `(vmid, pid)` -> its mapped PCI devices by mapping.
    usage: Mutex<HashMap<(u32, u32), BTreeMap<String, u32>>>,
    /// A running VM's config could not be read (the token may not audit
    /// it): warned once.
    unreadable_warned: AtomicBool,
}

impl DeviceGuard {
    pub(super) fn new(
        api: Arc<Api>,
        opts: Arc<PveOptions>,
        inventory: Arc<Inventory>,
    ) -> DeviceGuard {
        DeviceGuard {
            api,
            opts,
            inventory,
            ledger: Arc::default(),
            next_id: AtomicU64::new(1),
            usage: Mutex::default(),
            unreadable_warned: AtomicBool::new(false),
        }
    }

    /// Reads the mapping's devices on `node` and how many the VMs running
    /// there hold.
    async fn read(
        &self,
        node: &str,
        mapping: &str,
        deadline: Instant,
    ) -> Result<DeviceView, SubstrateError> {
        let api = &self.api;
        let what = format!("reading PCI mapping {mapping} on node {node} (the device guard)");
        let mappings = api
            .retry_raw(None, deadline, |pve| pve.pci_mappings())
            .await
            .map_err(|e| err_at(&what, None, &e))?;
        let Some(found) = mappings.iter().find(|m| m.id == mapping) else {
            return Err(SubstrateError::with_kind(
                ErrorKind::Refused,
                format!(
                    "PCI resource mapping {mapping} does not exist, or the API token may not see it \
                     (it needs Mapping.Use on /mapping/pci/{mapping}): create it under Datacenter > \
                     Resource Mappings, or fix the instance type's pci.mapping"
                ),
            ));
        };
        let total = found.devices_on(node);
        let rows = api
            .retry_raw(Some(node), deadline, |pve| pve.node_vms(node))
            .await
            .map_err(|e| err_at(&what, Some(node), &e))?;
        let ours = self.inventory.pending_vmids();
        let mut held_by_vms = 0;
        for row in rows
            .iter()
            .filter(|v| v.status == "running" && !v.template && !ours.contains(&v.vmid))
        {
            held_by_vms += self
                .usage_of(node, row.vmid, row.pid, deadline)
                .await?
                .get(mapping)
                .copied()
                .unwrap_or(0);
        }
        Ok(DeviceView { total, held_by_vms })
    }

    /// The mapped devices a running VM holds, read once per QEMU process.
    async fn usage_of(
        &self,
        node: &str,
        vmid: u32,
        pid: Option<u32>,
        deadline: Instant,
    ) -> Result<BTreeMap<String, u32>, SubstrateError> {
        if let Some(known) = pid.and_then(|p| self.usage.lock().get(&(vmid, p)).cloned()) {
            return Ok(known);
        }
        let cfg = match self
            .api
            .retry_raw(Some(node), deadline, |pve| pve.get_config(node, vmid))
            .await
        {
            Ok(cfg) => cfg,
            Err(e) if e.is_forbidden() => {
                if !self.unreadable_warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(node, vmid, error = %e,
                        "the device guard cannot read a running VM's config; the devices it holds are \
                         not counted (grant VM.Audit on /vms so the guard sees every VM)");
                }
                return Ok(BTreeMap::new());
            }
            // Stopped or gone since the listing: it holds nothing.
            Err(e) if e.is_not_found() => return Ok(BTreeMap::new()),
            Err(e) => {
                return Err(err_at(
                    format!("reading the config of VM {vmid} on node {node} (the device guard)"),
                    Some(node),
                    &e,
                ))
            }
        };
        let used = cfg.mapped_pci();
        if let Some(p) = pid {
            let mut usage = self.usage.lock();
            // What no running process holds any more goes with it; VMs
            // destroyed long ago stay until the map is this large, then
            // everything is read afresh (once per running VM).
            usage.retain(|(v, _), _| *v != vmid);
            if usage.len() >= USAGE_ENTRIES {
                usage.clear();
            }
            usage.insert((vmid, p), used.clone());
        }
        Ok(used)
    }

    /// Another holder of the machine's claim on `key`, if it has one.
    fn rejoin(&self, key: &(String, String), machine_id: &str) -> Option<DeviceClaim> {
        let id = self.ledger.lock().get(key)?.get(machine_id)?.0;
        Some(DeviceClaim {
            ledger: Arc::clone(&self.ledger),
            key: key.clone(),
            machine_id: machine_id.to_string(),
            id,
        })
    }

    /// Checks the node's free devices against `dev.count` and claims them;
    /// with `force`, claims without checking (a Create the process before
    /// admitted).
    async fn claim(
        &self,
        req: &CloneRequest,
        dev: &TypeDevices,
        force: bool,
        deadline: Instant,
    ) -> Result<DeviceClaim, DeviceError> {
        let key = (req.node.clone(), dev.mapping.clone());
        if let Some(held) = self.rejoin(&key, &req.machine_id) {
            return Ok(held);
        }
        let view = if force {
            None
        } else {
            Some(
                self.read(&req.node, &dev.mapping, deadline)
                    .await
                    .map_err(DeviceError::Unread)?,
            )
        };
        let mut ledger = self.ledger.lock();
        let per = ledger.entry(key.clone()).or_default();
        if let Some(view) = view {
            let in_flight: u32 = per.values().map(|(_, n)| n).sum();
            if view.held_by_vms + in_flight + dev.count > view.total {
                return Err(DeviceError::NoDevices(NoDevices {
                    node: req.node.clone(),
                    mapping: dev.mapping.clone(),
                    machine_id: req.machine_id.clone(),
                    instance_type: req.instance_type.clone(),
                    needed: dev.count,
                    total: view.total,
                    held_by_vms: view.held_by_vms,
                    in_flight,
                }));
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        per.insert(req.machine_id.clone(), (id, dev.count));
        Ok(DeviceClaim {
            ledger: Arc::clone(&self.ledger),
            key,
            machine_id: req.machine_id.clone(),
            id,
        })
    }

    /// Before a Create is accepted: its claim; `Ok(None)` for a type without
    /// devices, or when the node cannot be read within [`QUICK_READ`] (the
    /// clone step checks again); `Err` when the node has too few free.
    pub(super) async fn admit(&self, req: &CloneRequest) -> Result<Option<DeviceClaim>, NoDevices> {
        let Some(dev) = self.opts.type_devices.get(&req.instance_type) else {
            return Ok(None);
        };
        let deadline = Instant::now() + QUICK_READ;
        match tokio::time::timeout(QUICK_READ, self.claim(req, dev, false, deadline)).await {
            Ok(Ok(held)) => Ok(Some(held)),
            Ok(Err(DeviceError::NoDevices(no))) => Err(no),
            Ok(Err(DeviceError::Unread(e))) => {
                tracing::warn!(machine_id = %req.machine_id, node = %req.node, error = %e, "the device guard cannot check the Create now; admitting it, its clone step checks again");
                Ok(None)
            }
            Err(_) => {
                tracing::warn!(machine_id = %req.machine_id, node = %req.node, "the device guard cannot check the Create now; admitting it, its clone step checks again");
                Ok(None)
            }
        }
    }

    /// The claim of a Create about to clone: its admission's, else a fresh
    /// check (a resumed Create claims without one: the process before
    /// admitted it). `None` for a type without devices, or when the node
    /// cannot be read now (PVE's start checks then).
    pub(super) async fn claim_for_clone(
        &self,
        req: &CloneRequest,
        deadline: Instant,
    ) -> Result<Option<DeviceClaim>, SubstrateError> {
        let Some(dev) = self.opts.type_devices.get(&req.instance_type) else {
            return Ok(None);
        };
        match self.claim(req, dev, req.resumed, deadline).await {
            Ok(held) => Ok(Some(held)),
            Err(DeviceError::NoDevices(no)) => Err(SubstrateError::caused_by(
                ErrorKind::Permanent,
                "the device guard refused the clone",
                no,
            )),
            Err(DeviceError::Unread(e)) if e.kind() == ErrorKind::Refused => Err(e),
            Err(DeviceError::Unread(e)) => {
                tracing::warn!(machine_id = %req.machine_id, node = %req.node, error = %e, "the device guard cannot read the node; cloning without its check (PVE's start checks the devices)");
                Ok(None)
            }
        }
    }
}
