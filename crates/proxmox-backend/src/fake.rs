//! The fake backend's substrate: an in-memory Proxmox cluster (VMIDs,
//! nodes, power state, a guest agent that runs the bootstrap hook and the
//! drain). Testing and certification only; selected explicitly.
//!
//! Its nodes have a memory size and go through the same node memory guard
//! as a real cluster's ([`crate::memory`]), so the certification lanes
//! exercise the guard's admission path; the default size is large enough
//! that no lane's offerings fill a node.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use providerkit::ErrorKind;

use crate::capacity::{Admitted, Refusal};
use crate::memory::{
    ClaimRequest, CountedVm, MemoryClaim, MemoryGuard, MemoryRoom, NoRoom, NodeView,
};
use crate::substrate::{CloneRequest, ManagedVm, Substrate, SubstrateError, VmRef};

/// Each fake node's memory unless told otherwise: 1 PiB, far beyond any
/// lane's offerings (10 000 machines of 64 GiB fit on one node).
pub const DEFAULT_FAKE_NODE_MEMORY_MIB: u64 = 1 << 30;

#[derive(Clone, Debug)]
pub struct FakeVm {
    pub node: String,
    pub name: String,
    pub machine_id: String,
    pub operation_id: String,
    pub running: bool,
    /// Size of the last bootstrap blob delivered (the blob itself is not kept).
    pub bootstrap_bytes: Option<usize>,
    /// Configured memory, MiB.
    pub memory_mib: u64,
}

pub struct FakeCluster {
    nodes: Vec<String>,
    latency: Duration,
    /// Every node's memory, MiB.
    node_memory_mib: u64,
    guard: Arc<MemoryGuard>,
    state: Mutex<FakeState>,
}

/// The fake cluster's VMs. `running` changes only through its methods,
/// which keep `running_mib` equal to what a scan of `vms` would add up, so
/// an admission reads a node's sum in O(1) instead of walking every VM
/// under the lock (which made Creates serialise on an O(VMs) scan).
#[derive(Default)]
struct FakeState {
    vms: BTreeMap<u32, FakeVm>,
    /// machine id -> vmid, so a Create's idempotency check is one lookup.
    /// A machine has at most one VM here: a Create reuses the one it has.
    by_machine: HashMap<String, u32>,
    /// node -> configured memory of its running VMs, MiB.
    running_mib: HashMap<String, u64>,
    next_vmid: u32,
}

impl FakeState {
    fn insert(&mut self, vmid: u32, vm: FakeVm) {
        if !vm.machine_id.is_empty() {
            self.by_machine.insert(vm.machine_id.clone(), vmid);
        }
        if vm.running {
            *self.running_mib.entry(vm.node.clone()).or_default() += vm.memory_mib;
        }
        if let Some(replaced) = self.vms.insert(vmid, vm) {
            self.stopped(&replaced);
        }
    }

    fn remove(&mut self, vmid: u32) -> Option<FakeVm> {
        let removed = self.vms.remove(&vmid)?;
        if self.by_machine.get(&removed.machine_id) == Some(&vmid) {
            self.by_machine.remove(&removed.machine_id);
        }
        self.stopped(&removed);
        Some(removed)
    }

    /// Powers `vmid` on or off; `false` when there is no such VM.
    fn set_running(&mut self, vmid: u32, running: bool) -> bool {
        let Some(vm) = self.vms.get_mut(&vmid) else {
            return false;
        };
        if vm.running != running {
            vm.running = running;
            let sum = self.running_mib.entry(vm.node.clone()).or_default();
            *sum = if running {
                *sum + vm.memory_mib
            } else {
                sum.saturating_sub(vm.memory_mib)
            };
        }
        true
    }

    /// Takes a VM that leaves (or stops) out of its node's running sum.
    fn stopped(&mut self, vm: &FakeVm) {
        if vm.running {
            if let Some(sum) = self.running_mib.get_mut(&vm.node) {
                *sum = sum.saturating_sub(vm.memory_mib);
            }
        }
    }

    /// The memory of `node`'s running VMs but those of `claimants`' machines.
    fn running_mib_but(&self, node: &str, claimants: &HashSet<String>) -> u64 {
        let claimed: u64 = claimants
            .iter()
            .filter_map(|machine| self.by_machine.get(machine))
            .filter_map(|vmid| self.vms.get(vmid))
            .filter(|v| v.node == node && v.running)
            .map(|v| v.memory_mib)
            .sum();
        self.running_mib
            .get(node)
            .copied()
            .unwrap_or(0)
            .saturating_sub(claimed)
    }
}

impl FakeCluster {
    /// Nodes of [`DEFAULT_FAKE_NODE_MEMORY_MIB`] under a limit of 1.0.
    pub fn new(nodes: Vec<String>, latency: Duration) -> FakeCluster {
        FakeCluster {
            nodes,
            latency,
            node_memory_mib: DEFAULT_FAKE_NODE_MEMORY_MIB,
            guard: MemoryGuard::new(1.0),
            state: Mutex::new(FakeState {
                next_vmid: 100,
                ..FakeState::default()
            }),
        }
    }

    /// Every node has `node_memory_mib`; the guard's limit is `limit` of it
    /// (0 = off).
    pub fn with_node_memory(mut self, node_memory_mib: u64, limit: f64) -> FakeCluster {
        self.node_memory_mib = node_memory_mib;
        self.guard = MemoryGuard::new(limit);
        self
    }

    /// Starts a VM no machine owns on `node` (a test's foreign VM).
    pub fn run_foreign(&self, node: &str, memory_mib: u64) -> u32 {
        let mut state = self.state.lock();
        let vmid = state.next_vmid;
        state.next_vmid += 1;
        state.insert(
            vmid,
            FakeVm {
                node: node.to_string(),
                name: format!("foreign-{vmid}"),
                machine_id: String::new(),
                operation_id: String::new(),
                running: true,
                bootstrap_bytes: None,
                memory_mib,
            },
        );
        vmid
    }

    /// The node's view for the guard: its running VMs, those of machines
    /// holding a claim there left out (the claim counts them), as one sum
    /// (the fake's claims match nothing by name). O(claims on the node),
    /// whatever the number of VMs: a lane's Creates each read a node of
    /// thousands of VMs.
    fn view(&self, node: &str) -> NodeView {
        let claimants = self.guard.claimants(node);
        let running_mib = self.state.lock().running_mib_but(node, &claimants);
        NodeView {
            memory_mib: self.node_memory_mib,
            vms: vec![CountedVm {
                vmid: 0,
                name: None,
                memory_mib: running_mib,
                unnamed_clone: false,
            }],
        }
    }

    /// Checks and claims the memory of `req` (see [`crate::memory`]).
    fn claim(&self, req: &CloneRequest, force: bool) -> Result<MemoryClaim, NoRoom> {
        let ticket = self.guard.reading();
        let view = self.view(&req.node);
        self.guard.claim(
            &ticket,
            &view,
            &ClaimRequest {
                machine_id: req.machine_id.clone(),
                node: req.node.clone(),
                instance_type: req.instance_type.clone(),
                memory_mib: req.memory_mib,
                vm_name: String::new(),
            },
            force,
        )
    }

    pub fn vms(&self) -> BTreeMap<u32, FakeVm> {
        self.state.lock().vms.clone()
    }

    /// Re-create a VM the provider's durable state says exists: the fake
    /// cluster lives in memory, but real VMs outlive a provider restart.
    /// A machine that has a VM here already keeps it (one VM per machine,
    /// as a Create that finds its VM reuses it).
    pub fn restore(&self, vm: &VmRef, machine_id: &str, memory_mib: u64) {
        let mut state = self.state.lock();
        state.next_vmid = state.next_vmid.max(vm.vmid.saturating_add(1));
        let has_one = state
            .by_machine
            .get(machine_id)
            .is_some_and(|vmid| state.vms.contains_key(vmid));
        if !has_one && !state.vms.contains_key(&vm.vmid) {
            state.insert(
                vm.vmid,
                FakeVm {
                    node: vm.node.clone(),
                    name: format!("bigfleet-{}", vm.vmid),
                    machine_id: machine_id.to_string(),
                    operation_id: String::new(),
                    running: true,
                    bootstrap_bytes: None,
                    memory_mib,
                },
            );
        }
    }

    /// Power a VM off behind the provider's back (tests).
    pub fn stop_out_of_band(&self, vmid: u32) -> bool {
        self.state.lock().set_running(vmid, false)
    }

    async fn step(&self, parts: u32) {
        if !self.latency.is_zero() {
            tokio::time::sleep(self.latency / parts).await;
        }
    }

    /// Runs `f` on the VM `vm` names, with the state locked; the error
    /// PVE gives for a VM that is not on that node otherwise.
    fn with_vm<T>(
        &self,
        vm: &VmRef,
        f: impl FnOnce(&mut FakeState) -> T,
    ) -> Result<T, SubstrateError> {
        let mut state = self.state.lock();
        match state.vms.get(&vm.vmid) {
            Some(found) if found.node == vm.node => Ok(f(&mut state)),
            _ => Err(SubstrateError::new(format!(
                "500 Configuration file 'nodes/{}/qemu-server/{}.conf' does not exist",
                vm.node, vm.vmid
            ))),
        }
    }

    fn start(&self, vm: &VmRef) -> Result<(), SubstrateError> {
        self.with_vm(vm, |state| {
            state.set_running(vm.vmid, true);
        })
    }

    fn set_bootstrap(&self, vm: &VmRef, bytes: Option<usize>) -> Result<(), SubstrateError> {
        self.with_vm(vm, |state| {
            if let Some(found) = state.vms.get_mut(&vm.vmid) {
                found.bootstrap_bytes = bytes;
            }
        })
    }
}

#[async_trait]
impl Substrate for FakeCluster {
    async fn admit(&self, req: &CloneRequest) -> Result<Admitted, Refusal> {
        let mut held = Admitted::default();
        if self.guard.enabled() && self.nodes.contains(&req.node) {
            held.hold(self.claim(req, false)?);
        }
        Ok(held)
    }

    fn memory_rooms(&self) -> Vec<MemoryRoom> {
        self.guard.rooms()
    }

    async fn observe_memory(&self, nodes: &[String]) -> Vec<MemoryRoom> {
        nodes
            .iter()
            .filter(|n| self.nodes.contains(n))
            .map(|node| {
                let ticket = self.guard.reading();
                let view = self.view(node);
                self.guard.observe(node, &ticket, &view)
            })
            .collect()
    }

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
                if let Some(node) = state.vms.get(&vmid).map(|vm| vm.node.clone()) {
                    state.set_running(vmid, true);
                    return Ok(VmRef { node, vmid });
                }
            }
        }
        // As the real substrate: the admission's claim, or a check of its own.
        let _memory = match self.guard.rejoin(&req.node, &req.machine_id) {
            Some(held) => Some(held),
            None if self.guard.enabled() => {
                Some(self.claim(req, req.resumed).map_err(|no_room| {
                    SubstrateError::caused_by(
                        ErrorKind::Permanent,
                        "the node memory guard refused the clone",
                        no_room,
                    )
                })?)
            }
            None => None,
        };
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
                    memory_mib: req.memory_mib,
                },
            );
            vmid
        };
        self.step(2).await;
        let vm = VmRef {
            node: req.node.clone(),
            vmid,
        };
        self.start(&vm)?;
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
            state.remove(vm.vmid);
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
        self.start(vm)
    }

    async fn configure(&self, vm: &VmRef, blob: &[u8]) -> Result<(), SubstrateError> {
        self.step(1).await;
        self.set_bootstrap(vm, Some(blob.len()))
    }

    fn readiness_gate(&self) -> bool {
        false
    }

    async fn node_ready(&self, _vm: &VmRef) -> Result<bool, SubstrateError> {
        Ok(true)
    }

    async fn drain(&self, vm: &VmRef, _grace: Duration) -> Result<(), SubstrateError> {
        self.step(1).await;
        self.set_bootstrap(vm, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(n: usize) -> CloneRequest {
        CloneRequest {
            machine_id: format!("p/OnDemand/pve.small/pve-a/{n:03}"),
            operation_id: format!("op-{n}"),
            instance_type: "pve.small".into(),
            node: "pve-a".into(),
            template_vmid: 9000,
            vcpu: 2,
            memory_mib: 4096,
            resumed: false,
        }
    }

    #[tokio::test]
    async fn the_fake_nodes_go_through_the_same_guard() {
        let fake =
            FakeCluster::new(vec!["pve-a".into()], Duration::ZERO).with_node_memory(16 * 1024, 1.0);
        let foreign = fake.run_foreign("pve-a", 4096);
        let mut held = Vec::new();
        for n in 0..3 {
            let claim = fake.admit(&req(n)).await.expect("fits");
            assert!(!claim.is_empty(), "claimed");
            held.push(claim);
            fake.clone_vm(&req(n)).await.expect("cloned");
        }
        let Refusal::Memory(refused) = fake.admit(&req(3)).await.expect_err("full") else {
            panic!("refused for memory")
        };
        assert_eq!((refused.committed_mib, refused.left_mib), (16 * 1024, 0));
        // Landed: the claims go, the running VMs count instead, once.
        drop(held);
        assert!(fake.admit(&req(3)).await.is_err(), "still full");
        // Unadmitted, the clone checks by itself and refuses too.
        let e = fake.clone_vm(&req(3)).await.expect_err("refused");
        assert!(e.to_string().contains("no memory"), "{e}");
        assert!(fake.stop_out_of_band(foreign));
        assert!(!fake.admit(&req(3)).await.expect("room").is_empty());
        let room = &fake.memory_rooms()[0];
        assert_eq!(room.committed_mib, 16 * 1024);
    }

    /// What the guard's view summed before it kept running sums: a scan.
    fn scanned_mib(state: &FakeState, node: &str, claimants: &HashSet<String>) -> u64 {
        state
            .vms
            .values()
            .filter(|v| v.node == node && v.running)
            .filter(|v| v.machine_id.is_empty() || !claimants.contains(&v.machine_id))
            .map(|v| v.memory_mib)
            .sum()
    }

    #[tokio::test]
    async fn the_running_sums_stay_what_a_scan_of_every_vm_adds_up() {
        let nodes = ["pve-a", "pve-b"];
        let fake = FakeCluster::new(
            nodes.iter().map(|n| n.to_string()).collect(),
            Duration::ZERO,
        )
        .with_node_memory(1 << 40, 1.0);
        let mut held = Vec::new();
        // A fixed pseudo-random walk through every way a VM starts, stops
        // or goes: clones (admitted and not), restores, foreign VMs,
        // out-of-band stops, restarts of stopped VMs, deletes by the owner
        // and by someone else.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for step in 0..600usize {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let node = nodes[(x % 2) as usize];
            let n = (x >> 8) as usize % 120;
            let mut r = req(n);
            r.node = node.to_string();
            r.memory_mib = 256 * (1 + (x >> 20) % 8);
            match (x >> 32) % 8 {
                0 | 1 => {
                    if let Ok(claim) = fake.admit(&r).await {
                        held.push(claim);
                    }
                }
                2 | 3 => {
                    let _ = fake.clone_vm(&r).await;
                }
                4 => {
                    fake.run_foreign(node, r.memory_mib);
                }
                5 => {
                    let vmid = 100 + (x >> 40) as u32 % (step as u32 + 1);
                    fake.stop_out_of_band(vmid);
                }
                6 => {
                    let vmid = 100 + (x >> 40) as u32 % (step as u32 + 1);
                    let owner = fake
                        .vms()
                        .get(&vmid)
                        .map(|v| (v.node.clone(), v.machine_id.clone()));
                    if let Some((node, machine)) = owner {
                        let vm = VmRef { node, vmid };
                        let by = if x & 1 == 0 {
                            machine
                        } else {
                            "someone else".into()
                        };
                        fake.delete_vm(&vm, &by).await.expect("delete");
                    }
                }
                _ => {
                    if x & 1 == 0 {
                        held.clear();
                    }
                    let vmid = 100 + (x >> 40) as u32 % (step as u32 + 2);
                    fake.restore(
                        &VmRef {
                            node: node.into(),
                            vmid,
                        },
                        &r.machine_id,
                        r.memory_mib,
                    );
                }
            }
            for node in nodes {
                let claimants = fake.guard.claimants(node);
                let state = fake.state.lock();
                assert_eq!(
                    state.running_mib_but(node, &claimants),
                    scanned_mib(&state, node, &claimants),
                    "step {step}, node {node}"
                );
            }
        }
    }
}
