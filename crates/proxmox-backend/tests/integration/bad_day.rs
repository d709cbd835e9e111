//! A real cluster's bad day, each failure as PVE's sources say it happens,
//! reproduced in pve-sim and survived by the real substrate.

use proxmox_backend::proxmox::{PveOptions, PveSubstrate};
use proxmox_backend::substrate::Substrate;
use pve_sim::{endpoints, SimConfig, StorageKind, StorageSpec};

use crate::common::{self, client, req, sim_with};

fn opts() -> PveOptions {
    PveOptions {
        vmid_range: (200, 299),
        ..common::fast_retrying()
    }
}

/// datacenter.cfg's `next-id` range is full: PVE's `nextid` searches only
/// it and fails (`unable to get any free VMID in range [100, 102]`), while
/// `--vmid-range` has room. The Create walks its own range instead of
/// failing.
#[tokio::test]
async fn a_full_next_id_range_is_walked_past_inside_the_vmid_range() {
    let sim = sim_with(SimConfig {
        vmid_range: (100, 101),
        ..common::fast_sim_150()
    })
    .await;
    for vmid in [100, 101] {
        sim.insert_vm(sim.new_vm(vmid, "pve1", &format!("someone-{vmid}")))
            .expect("a VM of someone else's");
    }
    let nextid = sim.faults().call_count(endpoints::NEXTID);
    let sub = PveSubstrate::new(client(&sim), opts());
    let vm = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/000", "pve1"))
        .await
        .expect("cloned into --vmid-range");
    assert_eq!(vm.vmid, 200, "the first free id of --vmid-range");
    assert!(
        sim.faults().call_count(endpoints::NEXTID) >= nextid + 2,
        "PVE's pick, then the walk's ?vmid= check"
    );
    // The next one continues the walk.
    let next = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/001", "pve1"))
        .await
        .expect("second clone");
    assert_eq!(next.vmid, 201);
    sim.shutdown().await;
}

/// PVE's answer for a full range, as the simulator gives it.
#[tokio::test]
async fn the_simulator_answers_a_full_next_id_range_as_pve_does() {
    let sim = sim_with(SimConfig {
        vmid_range: (100, 100),
        ..SimConfig::default()
    })
    .await;
    sim.insert_vm(sim.new_vm(100, "pve1", "someone"))
        .expect("VM 100");
    let e = client(&sim)
        .next_id(None)
        .await
        .expect_err("the range is full");
    assert!(e.is_next_id_range_full(), "{e}");
    assert!(
        e.to_string()
            .contains("unable to get any free VMID in range [100, 101]"),
        "{e}"
    );
    // Asked for an id outside the range, it still answers.
    assert_eq!(client(&sim).next_id(Some(250)).await.expect("free"), 250);
    sim.shutdown().await;
}

/// An NFS mount on the node hangs: PVE's `activate_storage` gives up on it
/// (`unable to activate storage 'nas' - directory '/mnt/pve/nas' does not
/// exist or is unreachable`), which fails a destroy with
/// `destroy-unreferenced-disks` after the VM's own disks are freed. The
/// Delete destroys again without the option, and the VM is gone.
#[tokio::test]
async fn a_delete_finishes_while_a_storage_it_never_used_hangs() {
    let mut cfg = common::fast_sim_150();
    cfg.storages
        .push(StorageSpec::new("nas", StorageKind::Nfs, true, 1 << 10));
    let sim = sim_with(cfg).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let id = "p/OnDemand/pve.small/pve1/004";
    let vm = sub.clone_vm(&req(id, "pve1")).await.expect("create");
    sim.set_storage_hung("pve1", "nas", true);
    let destroys = sim.faults().call_count(endpoints::DESTROY);
    sub.delete_vm(&vm, id).await.expect("delete");
    assert!(sim.vm(vm.vmid).is_none(), "config removed too");
    assert_eq!(
        sim.faults().call_count(endpoints::DESTROY) - destroys,
        2,
        "one destroy with the option, one without"
    );
    sim.shutdown().await;
}
