//! The fake backend's substrate: an in-memory Proxmox cluster (VMIDs,
//! nodes, power state, a guest agent that runs the bootstrap hook and the
//! drain). Testing and certification only; selected explicitly.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;

use crate::substrate::{CloneRequest, ManagedVm, Substrate, SubstrateError, VmRef};

#[derive(Clone, Debug)]
pub struct FakeVm {
    pub node: String,
    pub name: String,
    pub machine_id: String,
    pub operation_id: String,
    pub running: bool,
    /// Size of the last bootstrap blob delivered (the blob itself is not kept).
    pub bootstrap_bytes: Option<usize>,
}

pub struct FakeCluster {
    nodes: Vec<String>,
    latency: Duration,
    state: Mutex<FakeState>,
}

struct FakeState {
    vms: BTreeMap<u32, FakeVm>,
    /// machine id -> vmid, so a Create's idempotency check is one lookup.
    by_machine: HashMap<String, u32>,
    next_vmid: u32,
}

impl FakeState {
    fn insert(&mut self, vmid: u32, vm: FakeVm) {
        self.by_machine.insert(vm.machine_id.clone(), vmid);
        self.vms.insert(vmid, vm);
    }
}

impl FakeCluster {
    pub fn new(nodes: Vec<String>, latency: Duration) -> FakeCluster {
        FakeCluster {
            nodes,
            latency,
            state: Mutex::new(FakeState {
                vms: BTreeMap::new(),
                by_machine: HashMap::new(),
                next_vmid: 100,
            }),
        }
    }

    pub fn vms(&self) -> BTreeMap<u32, FakeVm> {
        self.state.lock().vms.clone()
    }

    /// Re-create a VM the provider's durable state says exists: the fake
    /// cluster lives in memory, but real VMs outlive a provider restart.
    pub fn restore(&self, vm: &VmRef, machine_id: &str) {
        let mut state = self.state.lock();
        state.next_vmid = state.next_vmid.max(vm.vmid.saturating_add(1));
        if !state.vms.contains_key(&vm.vmid) {
            state.insert(
                vm.vmid,
                FakeVm {
                    node: vm.node.clone(),
                    name: format!("bigfleet-{}", vm.vmid),
                    machine_id: machine_id.to_string(),
                    operation_id: String::new(),
                    running: true,
                    bootstrap_bytes: None,
                },
            );
        }
    }

    /// Power a VM off behind the provider's back (tests).
    pub fn stop_out_of_band(&self, vmid: u32) -> bool {
        match self.state.lock().vms.get_mut(&vmid) {
            Some(vm) => {
                vm.running = false;
                true
            }
            None => false,
        }
    }

    async fn step(&self, parts: u32) {
        if !self.latency.is_zero() {
            tokio::time::sleep(self.latency / parts).await;
        }
    }

    fn with_vm<T>(
        &self,
        vm: &VmRef,
        f: impl FnOnce(&mut FakeVm) -> T,
    ) -> Result<T, SubstrateError> {
        let mut state = self.state.lock();
        match state.vms.get_mut(&vm.vmid) {
            Some(found) if found.node == vm.node => Ok(f(found)),
            _ => Err(SubstrateError::new(format!(
                "500 Configuration file 'nodes/{}/qemu-server/{}.conf' does not exist",
                vm.node, vm.vmid
            ))),
        }
    }
}

#[async_trait]
impl Substrate for FakeCluster {
    async fn clone_vm(&self, req: &CloneRequest) -> Result<VmRef, SubstrateError> {
        if !self.nodes.contains(&req.node) {
            return Err(SubstrateError::new(format!(
                "node {:?} is not part of the cluster",
                req.node
            )));
        }
        {
            let mut state = self.state.lock();
            if let Some(vmid) = state.by_machine.get(&req.machine_id).copied() {
                if let Some(vm) = state.vms.get_mut(&vmid) {
                    vm.running = true;
                    return Ok(VmRef {
                        node: vm.node.clone(),
                        vmid,
                    });
                }
            }
        }
        self.step(2).await;
        let vmid = {
            let mut state = self.state.lock();
            let vmid = state.next_vmid;
            state.next_vmid += 1;
            state.insert(
                vmid,
                FakeVm {
                    node: req.node.clone(),
                    name: format!("bigfleet-{}-{vmid}", req.instance_type),
                    machine_id: req.machine_id.clone(),
                    operation_id: req.operation_id.clone(),
                    running: false,
                    bootstrap_bytes: None,
                },
            );
            vmid
        };
        self.step(2).await;
        let vm = VmRef {
            node: req.node.clone(),
            vmid,
        };
        self.with_vm(&vm, |v| v.running = true)?;
        Ok(vm)
    }

    async fn delete_vm(&self, vm: &VmRef, machine_id: &str) -> Result<(), SubstrateError> {
        self.step(1).await;
        let mut state = self.state.lock();
        // Like the real substrate: only a VM marked for this machine is destroyed.
        if state
            .vms
            .get(&vm.vmid)
            .is_some_and(|v| v.machine_id == machine_id)
        {
            if let Some(removed) = state.vms.remove(&vm.vmid) {
                if state.by_machine.get(&removed.machine_id) == Some(&vm.vmid) {
                    state.by_machine.remove(&removed.machine_id);
                }
            }
        }
        Ok(())
    }

    async fn describe_managed(&self) -> Result<Vec<ManagedVm>, SubstrateError> {
        Ok(self
            .state
            .lock()
            .vms
            .iter()
            .map(|(&vmid, vm)| ManagedVm {
                vm: VmRef {
                    node: vm.node.clone(),
                    vmid,
                },
                machine_id: vm.machine_id.clone(),
                running: vm.running,
            })
            .collect())
    }

    async fn ensure_running(&self, vm: &VmRef) -> Result<(), SubstrateError> {
        self.with_vm(vm, |v| v.running = true)
    }

    async fn configure(&self, vm: &VmRef, blob: &[u8]) -> Result<(), SubstrateError> {
        self.step(1).await;
        self.with_vm(vm, |v| v.bootstrap_bytes = Some(blob.len()))
    }

    fn readiness_gate(&self) -> bool {
        false
    }

    async fn node_ready(&self, _vm: &VmRef) -> Result<bool, SubstrateError> {
        Ok(true)
    }

    async fn drain(&self, vm: &VmRef, _grace: Duration) -> Result<(), SubstrateError> {
        self.step(1).await;
        self.with_vm(vm, |v| v.bootstrap_bytes = None)
    }
}
