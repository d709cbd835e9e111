//! A clone POST whose answer was lost (596) and whose VMID stayed free is
//! taken as not applied, and the Create clones again with a fresh VMID. When
//! the lost request lands late after all, the machine must still end with
//! one VM: the late one is destroyed, but only when its description marker
//! names this machine and this operation.

use std::time::Duration;

use providerkit::{Backend, DeleteCtx};
use proxmox_backend::proxmox::{marker_description, parse_marker, PveOptions, PveSubstrate};
use proxmox_backend::substrate::{CloneRequest, Substrate};
use pve_sim::{endpoints, PveSim, SimConfig};

use crate::common::{self, client_3_tries as client, clones};

fn opts() -> PveOptions {
    common::opts_retrying(
        Duration::from_secs(20),
        Duration::from_secs(15),
        Duration::from_millis(400),
    )
}

fn req(machine_id: &str) -> CloneRequest {
    common::req(machine_id, "pve1")
}

/// The clone worker's real timeline under a pool-scoped token.
fn sim_config() -> SimConfig {
    SimConfig {
        clone_timeline: true,
        pool_acl: true,
        ..common::fast_sim(Duration::from_millis(150), Duration::from_millis(100))
    }
}

async fn until(what: &str, cond: impl FnMut() -> bool) {
    provider_testkit::wait::until(what, Duration::from_secs(15), cond).await
}

/// Starts a Create whose first clone POST answers 596 and lands `delay`
/// later (after the provider has settled on "not applied" and cloned again);
/// returns once that late clone has finished.
async fn create_with_a_late_landing(sim: &PveSim, sub: &PveSubstrate, id: &str) -> u32 {
    sim.faults().apply_late(
        endpoints::CLONE,
        1,
        596,
        "Connection timed out",
        Duration::from_millis(1500),
    );
    let vm = sub.clone_vm(&req(id)).await.expect("create");
    assert_eq!(
        sim.call_count(endpoints::CLONE),
        2,
        "the lost POST, then one fresh clone"
    );
    until("the lost clone request was carried out", || {
        sim.faults().late_applied() >= 1
    })
    .await;
    until("no clone in progress", || {
        clones(sim).iter().all(|v| v.lock.is_none())
    })
    .await;
    vm.vmid
}

#[tokio::test]
async fn a_lost_clone_landing_late_leaves_one_vm_per_machine() {
    let sim = common::sim_with(sim_config()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let id = "p/OnDemand/pve.small/pve1/001";
    let kept = create_with_a_late_landing(&sim, &sub, id).await;

    // The next inventory pass (reconcile) finds the late duplicate next to
    // the machine's VM and removes it.
    let managed = sub.describe_managed().await.expect("reconcile");
    let mine: Vec<u32> = managed
        .iter()
        .filter(|m| m.machine_id == id)
        .map(|m| m.vm.vmid)
        .collect();
    assert_eq!(mine, vec![kept], "one VM reported for the machine");
    let left = clones(&sim);
    assert_eq!(
        left.iter().map(|v| v.vmid).collect::<Vec<_>>(),
        vec![kept],
        "exactly one VM exists for the machine: {left:?}"
    );
    assert!(sim.vm(kept).is_some_and(|v| v.running), "the kept VM runs");
    assert!(sim.schema_violations().is_empty());
    sim.shutdown().await;
}

#[tokio::test]
async fn a_late_vm_whose_marker_names_another_operation_is_left_alone() {
    let sim = common::sim_with(sim_config()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let id = "p/OnDemand/pve.small/pve1/002";
    let kept = create_with_a_late_landing(&sim, &sub, id).await;
    let late: Vec<u32> = clones(&sim)
        .iter()
        .map(|v| v.vmid)
        .filter(|v| *v != kept)
        .collect();
    if let [late] = late[..] {
        // Before the pass looks at it, the VM at the watched id comes to
        // carry another operation's marker: not provably the lost clone.
        sim.update_vm(late, |vm| {
            vm.description = Some(marker_description(id, "op-other"));
        });
        sub.describe_managed().await.expect("reconcile");
        let vm = sim
            .vm(late)
            .expect("never destroyed without this operation's marker");
        assert_eq!(
            parse_marker(vm.description.as_deref().unwrap_or_default()).as_deref(),
            Some(id)
        );
        assert!(sim.vm(kept).is_some());
    } else {
        // Only if the Create's own check already removed the late clone;
        // then it must have been the lost clone itself.
        assert!(late.is_empty(), "{late:?}");
        panic!("the late clone landed before the Create returned; lengthen the delay");
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn a_late_clone_that_is_the_machines_only_vm_is_kept_and_adopted() {
    let sim = common::sim_with(sim_config()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let id = "p/OnDemand/pve.small/pve1/003";
    sim.faults().apply_late(
        endpoints::CLONE,
        1,
        596,
        "Connection timed out",
        Duration::from_millis(1500),
    );
    // The fresh clone's worker runs first (the late one is still queued)
    // and fails: the Create fails with no VM.
    sim.faults()
        .fail_next_task("qmclone", 1, "clone failed: no space left on device");
    let e = sub
        .clone_vm(&req(id))
        .await
        .expect_err("the fresh clone failed");
    assert!(e.to_string().contains("no space left"), "{e}");
    until("the lost clone request was carried out", || {
        sim.faults().late_applied() >= 1
    })
    .await;
    until("the late clone finished", || {
        clones(&sim).len() == 1 && clones(&sim).iter().all(|v| v.lock.is_none())
    })
    .await;
    let late = clones(&sim)[0].vmid;

    // The machine's only VM: kept and reported, never destroyed.
    let managed = sub.describe_managed().await.expect("reconcile");
    assert!(
        managed
            .iter()
            .any(|m| m.machine_id == id && m.vm.vmid == late),
        "{managed:?}"
    );
    assert!(sim.vm(late).is_some());
    // A retried Create adopts it instead of cloning again.
    let vm = sub.clone_vm(&req(id)).await.expect("retried create");
    assert_eq!(vm.vmid, late);
    assert_eq!(sim.call_count(endpoints::CLONE), 2, "no third clone");
    assert_eq!(clones(&sim).len(), 1);
    sim.shutdown().await;
}

#[tokio::test]
async fn a_late_clone_that_outlived_a_restart_goes_with_its_machines_delete() {
    let sim = common::sim_with(sim_config()).await;
    let id = "p/OnDemand/pve.small/pve1/004";
    let kept = create_with_a_late_landing(&sim, &PveSubstrate::new(client(&sim), opts()), id).await;
    // A restart: the new process never watched the lost clone. (If the
    // Create's own check already removed it, there is nothing to sweep.)
    let late: Vec<u32> = clones(&sim)
        .iter()
        .map(|v| v.vmid)
        .filter(|v| *v != kept)
        .collect();
    assert_eq!(
        late.len(),
        1,
        "the late clone landed after the Create: {late:?}"
    );
    let (backend, _) = common::small_backend(
        "p",
        "pve1",
        1,
        &["pve1"],
        PveSubstrate::new(client(&sim), opts()),
    );
    backend
        .delete(DeleteCtx {
            machine_id: id.into(),
            operation_id: "op-delete".into(),
            host_ref: format!("pve1/{kept}"),
        })
        .await
        .expect("delete");
    assert!(sim.vm(kept).is_none(), "the machine's VM is destroyed");
    assert!(
        sim.vm(late[0]).is_none(),
        "the second VM marked for the machine goes with it"
    );
    assert!(clones(&sim).is_empty(), "{:?}", clones(&sim));
    sim.shutdown().await;
}

#[tokio::test]
async fn a_delete_never_sweeps_a_vm_marked_for_another_machine() {
    let sim = common::sim_with(sim_config()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let mine = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/005"))
        .await
        .expect("create mine");
    let other = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/006"))
        .await
        .expect("create the other");
    let (backend, _) = common::small_backend("p", "pve1", 1, &["pve1"], sub);
    backend
        .delete(DeleteCtx {
            machine_id: "p/OnDemand/pve.small/pve1/005".into(),
            operation_id: "op-delete".into(),
            host_ref: mine.host_ref(),
        })
        .await
        .expect("delete");
    assert!(sim.vm(mine.vmid).is_none());
    assert!(
        sim.vm(other.vmid).is_some(),
        "another machine's VM is never touched"
    );
    sim.shutdown().await;
}
