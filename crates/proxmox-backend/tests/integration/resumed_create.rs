//! A Create resumed after a provider restart, while the clone the dead
//! process started is still running on PVE: the clone's VM is a bare
//! `lock: clone` config outside the pool (no name, no marker) until its
//! worker ends. The resumed Create must wait for that clone and adopt it,
//! never clone a second VM for the machine.

use std::time::Duration;

use proxmox_backend::proxmox::{parse_marker, PveSubstrate};
use proxmox_backend::substrate::{CloneRequest, Substrate};
use pve_sim::{PveSim, SimConfig};

use crate::common::{self, client, clones};

/// Two-second clones on the clone worker's real timeline, under a
/// pool-scoped token.
fn sim_config() -> SimConfig {
    SimConfig {
        clone_timeline: true,
        pool_acl: true,
        ..common::fast_sim(Duration::from_secs(2), Duration::from_millis(100))
    }
}

fn marked_for(sim: &PveSim, machine_id: &str) -> Vec<u32> {
    clones(sim)
        .into_iter()
        .filter(|v| v.description.as_deref().and_then(parse_marker).as_deref() == Some(machine_id))
        .map(|v| v.vmid)
        .collect()
}

/// The first process starts the Create and "dies" (its task is dropped)
/// while the clone runs; returns the VMID PVE is cloning to.
async fn die_mid_clone(sim: &PveSim, req: &CloneRequest) -> u32 {
    let first = PveSubstrate::new(client(sim), common::fast_retrying());
    let req = req.clone();
    let create = tokio::spawn(async move { first.clone_vm(&req).await });
    common::until("the clone is running", || {
        clones(sim)
            .iter()
            .any(|v| v.lock.as_deref() == Some("clone"))
    })
    .await;
    create.abort();
    let _ = create.await;
    let cloning: Vec<u32> = clones(sim)
        .iter()
        .filter(|v| v.lock.as_deref() == Some("clone"))
        .map(|v| v.vmid)
        .collect();
    assert_eq!(cloning.len(), 1, "one clone in flight: {cloning:?}");
    cloning[0]
}

#[tokio::test]
async fn a_resumed_create_adopts_the_clone_the_dead_process_left_running() {
    let sim = common::sim_with(sim_config()).await;
    let id = "p/OnDemand/pve.small/pve1/001";
    let req = CloneRequest {
        resumed: true,
        ..common::req(id, "pve1")
    };
    let in_flight = die_mid_clone(&sim, &req).await;

    // The next process: nothing in memory, the clone still running.
    let second = PveSubstrate::new(client(&sim), common::fast_retrying());
    let vm = second.clone_vm(&req).await.expect("resumed create");
    assert_eq!(vm.vmid, in_flight, "the clone in flight was adopted");
    assert_eq!(
        marked_for(&sim, id),
        vec![in_flight],
        "one VM for the machine"
    );
    assert_eq!(clones(&sim).len(), 1);
    common::assert_no_violations(&sim);
}

#[tokio::test]
async fn a_fresh_create_after_a_restart_does_not_wait_for_others_clones() {
    let sim = common::sim_with(sim_config()).await;
    let dead = "p/OnDemand/pve.small/pve1/001";
    let in_flight = die_mid_clone(&sim, &common::req(dead, "pve1")).await;

    // Another machine's Create, not a resumed one, starts its own clone at
    // once: it does not wait for the clone of the dead process.
    let second = PveSubstrate::new(client(&sim), common::fast_retrying());
    let other = "p/OnDemand/pve.small/pve1/002";
    let vm = second
        .clone_vm(&common::req(other, "pve1"))
        .await
        .expect("create");
    assert_ne!(vm.vmid, in_flight);
    assert_eq!(marked_for(&sim, other), vec![vm.vmid]);
    common::until("the dead process's clone landed", || {
        clones(&sim).iter().all(|v| v.lock.is_none())
    })
    .await;
    assert_eq!(marked_for(&sim, dead), vec![in_flight]);
}
