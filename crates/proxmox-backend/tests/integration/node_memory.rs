//! The node memory guard through the real backend against pve-sim, on
//! nodes of 16 GiB: a Create that would pass the limit is refused before
//! anything is cloned and the next one that fits lands; a VM the provider
//! does not own takes room once it runs; a restart counts the clones the
//! dead process left in flight; a 16-way burst never commits past the limit.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use providerkit::{Admission, AdmitCtx, Backend, BackendError, CreateCtx, ErrorKind};
use proxmox_backend::backend::ProxmoxBackend;
use proxmox_backend::capacity::Refusal;
use proxmox_backend::catalog::{expand_slots, InstanceType, Offering, Pricing};
use proxmox_backend::memory::NoRoom;
use proxmox_backend::proxmox::{PveOptions, PveSubstrate};
use proxmox_backend::substrate::{CloneRequest, Substrate};
use pve_sim::{NodeMemory, PveSim, SimConfig};

use crate::common::{self, client, clones};

const GIB_MIB: u64 = 1024;

fn sim_config(clone: Duration) -> SimConfig {
    SimConfig {
        node_memory: NodeMemory::every_node(16 << 30),
        // Room for a burst of clones at once on the node's storage.
        max_parallel_local_clones: None,
        ..common::fast_sim(clone, Duration::from_millis(50))
    }
}

fn options() -> PveOptions {
    PveOptions {
        max_parallel_clones: 16,
        ..common::fast_retrying()
    }
}

/// `pve.small` (2 GiB) and `pve.medium` (4 GiB), 16 slots of each on pve1.
fn backend(sub: PveSubstrate) -> ProxmoxBackend {
    let types: BTreeMap<String, InstanceType> = [("pve.small", 2), ("pve.medium", 4)]
        .into_iter()
        .map(|(name, gib)| {
            (
                name.to_string(),
                InstanceType {
                    vcpu: 2,
                    memory_mib: gib * GIB_MIB,
                    template_vmid: 9000,
                    storage: None,
                    balloon_mib: None,
                    disk_gib: None,
                    pci: None,
                },
            )
        })
        .collect();
    let pricing = || Pricing {
        explicit: Default::default(),
        per_vcpu_hour: 0.003,
        per_gib_hour: 0.0008,
    };
    let offerings: Vec<Offering> = ["pve.small", "pve.medium"]
        .into_iter()
        .map(|t| Offering {
            instance_type: t.into(),
            zone: "pve1".into(),
            capacity_type: String::new(),
            count: 16,
            resources: Default::default(),
            labels: Default::default(),
        })
        .collect();
    let zones = vec!["pve1".to_string(), "pve2".to_string()];
    let slots = expand_slots("p", &offerings, &types, Some(&zones), &pricing()).expect("slots");
    ProxmoxBackend::new(slots, types, pricing(), Arc::new(sub))
}

fn id(instance_type: &str, n: usize) -> String {
    format!("p/OnDemand/{instance_type}/pve1/{n:03}")
}

fn admit_ctx(machine_id: &str, instance_type: &str) -> AdmitCtx {
    AdmitCtx {
        machine_id: machine_id.into(),
        instance_type: instance_type.into(),
        zone: "pve1".into(),
    }
}

fn create_ctx(machine_id: &str, instance_type: &str) -> CreateCtx {
    CreateCtx {
        machine_id: machine_id.into(),
        operation_id: format!("op-{machine_id}"),
        instance_type: instance_type.into(),
        zone: "pve1".into(),
        resumed: false,
    }
}

/// Admission then, if admitted, the Create, holding the admission until
/// it returns, as the engine does.
async fn admit_and_create(
    backend: &ProxmoxBackend,
    machine_id: &str,
    instance_type: &str,
) -> Result<(), BackendError> {
    let admission: Admission = backend
        .admit_create(&admit_ctx(machine_id, instance_type))
        .await?;
    backend
        .create(create_ctx(machine_id, instance_type))
        .await
        .expect("an admitted Create lands");
    drop(admission);
    Ok(())
}

/// Configured memory (MiB) of what runs or is being cloned on `node`.
fn committed_mib(sim: &PveSim, node: &str) -> u64 {
    sim.vms()
        .values()
        .filter(|v| v.node == node && !v.template)
        .filter(|v| v.running || v.lock.as_deref() == Some("clone"))
        .map(|v| v.memory_mib)
        .sum()
}

/// A 4 GiB VM nobody in the provider made, started through the API path
/// the simulator offers a test.
fn foreign_vm(sim: &PveSim, vmid: u32, running: bool) {
    let mut vm = sim.new_vm(vmid, "pve1", &format!("db-{vmid}"));
    vm.memory_mib = 4 * GIB_MIB;
    sim.insert_vm(vm).expect("foreign VM");
    if running {
        assert!(sim.start_vm_out_of_band(vmid));
    }
}

fn refusal(e: &BackendError) -> &NoRoom {
    match std::error::Error::source(e).and_then(|s| s.downcast_ref::<Refusal>()) {
        Some(Refusal::Memory(no_room)) => no_room,
        _ => panic!("refused for memory: {e:?}"),
    }
}

#[tokio::test]
async fn a_create_past_the_limit_is_refused_and_the_next_that_fits_lands() {
    let sim = common::sim_with(sim_config(Duration::from_millis(50))).await;
    let backend = backend(PveSubstrate::new(client(&sim), options()));
    // 2 GiB used by someone else's VM (a running VM counts whoever owns it).
    let mut other = sim.new_vm(500, "pve1", "other");
    other.memory_mib = 2 * GIB_MIB;
    sim.insert_vm(other).unwrap();
    assert!(sim.start_vm_out_of_band(500));
    for n in 0..3 {
        admit_and_create(&backend, &id("pve.medium", n), "pve.medium")
            .await
            .expect("fits");
    }
    // 2 + 3 x 4 = 14 GiB: a 4 GiB machine would pass 16.
    let before = clones(&sim).len();
    let e = admit_and_create(&backend, &id("pve.medium", 3), "pve.medium")
        .await
        .expect_err("refused");
    let no_room = refusal(&e);
    assert_eq!(
        (no_room.needed_mib, no_room.left_mib),
        (4 * GIB_MIB, 2 * GIB_MIB)
    );
    let text = e.to_string();
    for says in [
        "node pve1",
        "needs 4096 MiB",
        "2048 MiB is left",
        id("pve.medium", 3).as_str(),
    ] {
        assert!(text.contains(says), "{says:?} in {text}");
    }
    assert_eq!(e.kind(), ErrorKind::Transient);
    assert_eq!(clones(&sim).len(), before, "nothing was cloned for it");
    // The next one that fits (2 GiB) lands.
    admit_and_create(&backend, &id("pve.small", 0), "pve.small")
        .await
        .expect("a 2 GiB machine fits");
    assert_eq!(committed_mib(&sim, "pve1"), 16 * GIB_MIB);
    common::assert_no_violations(&sim);
    sim.shutdown().await;
}

#[tokio::test]
async fn a_vm_the_provider_does_not_own_takes_room_once_it_runs() {
    let sim = common::sim_with(sim_config(Duration::from_millis(50))).await;
    let backend = backend(PveSubstrate::new(client(&sim), options()));
    // Stopped, and a template: neither counts.
    foreign_vm(&sim, 500, false);
    for n in 0..3 {
        admit_and_create(&backend, &id("pve.medium", n), "pve.medium")
            .await
            .expect("a stopped VM takes no room");
    }
    // Someone starts their VM: the node is full now.
    assert!(sim.start_vm_out_of_band(500));
    let e = admit_and_create(&backend, &id("pve.medium", 3), "pve.medium")
        .await
        .expect_err("the foreign VM runs");
    assert_eq!(refusal(&e).committed_mib, 16 * GIB_MIB);
    // It stops again: its room comes back.
    assert!(sim.stop_vm_out_of_band(500));
    admit_and_create(&backend, &id("pve.medium", 3), "pve.medium")
        .await
        .expect("room again");
    sim.shutdown().await;
}

#[tokio::test]
async fn a_restart_counts_the_clones_the_dead_process_left_in_flight() {
    let sim = common::sim_with(SimConfig {
        clone_timeline: true,
        ..sim_config(Duration::from_secs(2))
    })
    .await;
    let medium = |n| CloneRequest {
        instance_type: "pve.medium".into(),
        memory_mib: 4 * GIB_MIB,
        ..common::req(&id("pve.medium", n), "pve1")
    };
    // Two landed, then the first process dies with two more mid-clone.
    let first = Arc::new(PveSubstrate::new(client(&sim), options()));
    for n in 0..2 {
        first.clone_vm(&medium(n)).await.expect("landed");
    }
    let mut dying = Vec::new();
    for n in 2..4 {
        let first = Arc::clone(&first);
        let req = medium(n);
        dying.push(tokio::spawn(async move { first.clone_vm(&req).await }));
    }
    common::until("both clones are running", || {
        clones(&sim)
            .iter()
            .filter(|v| v.lock.as_deref() == Some("clone"))
            .count()
            == 2
    })
    .await;
    for task in dying {
        task.abort();
        let _ = task.await;
    }
    drop(first);

    // The next process resumes those two Creates; until their clones are
    // found, their claims count them: a new 4 GiB machine does not fit.
    let second = Arc::new(backend(PveSubstrate::new(client(&sim), options())));
    let mut resumed = Vec::new();
    for n in 2..4 {
        let second = Arc::clone(&second);
        resumed.push(tokio::spawn(async move {
            second
                .create(CreateCtx {
                    resumed: true,
                    ..create_ctx(&id("pve.medium", n), "pve.medium")
                })
                .await
        }));
    }
    common::until("the resumed Creates hold their memory", || {
        second
            .memory_rooms()
            .iter()
            .any(|r| r.node == "pve1" && r.committed_mib >= 16 * GIB_MIB)
    })
    .await;
    let e = second
        .admit_create(&admit_ctx(&id("pve.medium", 4), "pve.medium"))
        .await
        .expect_err("the clones in flight fill the node");
    assert_eq!(refusal(&e).committed_mib, 16 * GIB_MIB, "counted once each");
    for task in resumed {
        task.await
            .unwrap()
            .expect("resumed Create adopts its clone");
    }
    assert_eq!(clones(&sim).len(), 4, "no second clone for any machine");
    assert_eq!(committed_mib(&sim, "pve1"), 16 * GIB_MIB);
    // Still full once they have landed.
    assert!(second
        .admit_create(&admit_ctx(&id("pve.medium", 4), "pve.medium"))
        .await
        .is_err());
    sim.shutdown().await;
}

#[tokio::test]
async fn a_16_way_burst_never_commits_past_the_limit() {
    let sim = Arc::new(common::sim_with(sim_config(Duration::from_millis(300))).await);
    let backend = Arc::new(backend(PveSubstrate::new(client(&sim), options())));
    foreign_vm(&sim, 500, true);
    // Watches the node for the whole burst.
    let done = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let watcher = {
        let (sim, done, peak) = (Arc::clone(&sim), Arc::clone(&done), Arc::clone(&peak));
        tokio::spawn(async move {
            while !done.load(Ordering::SeqCst) {
                peak.fetch_max(committed_mib(&sim, "pve1"), Ordering::SeqCst);
                tokio::task::yield_now().await;
            }
        })
    };
    let burst: Vec<_> = (0..16)
        .map(|n| {
            let backend = Arc::clone(&backend);
            tokio::spawn(async move {
                admit_and_create(&backend, &id("pve.medium", n), "pve.medium").await
            })
        })
        .collect();
    let mut landed = 0;
    let mut refused = 0;
    for task in burst {
        match task.await.unwrap() {
            Ok(()) => landed += 1,
            Err(e) => {
                let no_room = refusal(&e);
                assert_eq!(no_room.node, "pve1");
                assert!(no_room.left_mib < 4 * GIB_MIB, "{no_room}");
                refused += 1;
            }
        }
    }
    done.store(true, Ordering::SeqCst);
    watcher.await.unwrap();
    assert_eq!(landed, 3, "4 GiB taken by the foreign VM leaves room for 3");
    assert_eq!(refused, 13);
    assert!(
        peak.load(Ordering::SeqCst) <= 16 * GIB_MIB,
        "the node never held more than its memory: peak {} MiB",
        peak.load(Ordering::SeqCst)
    );
    assert_eq!(committed_mib(&sim, "pve1"), 16 * GIB_MIB);
    assert!(
        clones(&sim).iter().all(|v| v.lock.is_none()),
        "nothing left mid-clone"
    );
    drop(backend);
    if let Ok(sim) = Arc::try_unwrap(sim) {
        sim.shutdown().await;
    }
}
