//! A lock only root can clear: a clone worker that dies with its node
//! leaves `lock: clone` on the new VM (and before `add_vm_to_pool`, so
//! outside the pool). `check_lock` refuses the destroy, `skiplock` is
//! root-only, a config PUT may not touch `lock`. With no task holding the
//! lock, the machine ends FAILED naming the command, never loops, never
//! leaks silently.

use std::sync::Arc;
use std::time::{Duration, Instant};

use provider_testkit::wait::until_some;
use providerkit::ErrorKind;
use proxmox_backend::proxmox::{PveOptions, PveSubstrate};
use proxmox_backend::substrate::Substrate;
use pve::CloneParams;
use pve_sim::{endpoints, SimConfig};

use crate::common::{self, client, req, sim_with};

fn opts() -> PveOptions {
    PveOptions {
        vmid_range: (200, 299),
        ..common::fast_retrying()
    }
}

#[tokio::test]
async fn a_delete_of_a_vm_whose_lock_no_task_holds_fails_naming_qm_unlock() {
    let sim = sim_with(SimConfig {
        clone_duration: Duration::from_millis(1500),
        ..common::fast_sim_150()
    })
    .await;
    let sub = Arc::new(PveSubstrate::new(client(&sim), opts()));
    let id = "p/OnDemand/pve.small/pve1/001";
    let vm = sub.clone_vm(&req(id, "pve1")).await.expect("create");
    // What a clone that died with its node leaves (`qm set` cannot clear it:
    // only root's `qm unlock` can).
    assert!(sim.set_lock(vm.vmid, Some("clone")));

    // While a clone runs on the node, the lock may be its: the Delete waits.
    let upid = client(&sim)
        .clone_vm(
            "pve1",
            9000,
            &CloneParams {
                newid: 350,
                ..CloneParams::default()
            },
        )
        .await
        .expect("someone's clone");
    let delete = {
        let (sub, vm) = (Arc::clone(&sub), vm.clone());
        tokio::spawn(async move { sub.delete_vm(&vm, id).await })
    };
    // (It runs: the stop is refused by the lock first.)
    let stops = sim.call_count(endpoints::STOP);
    common::until("the Delete tried to stop the locked VM twice", || {
        sim.call_count(endpoints::STOP) >= stops + 2
    })
    .await;
    assert!(
        !delete.is_finished(),
        "a clone is running: the lock may be held"
    );
    client(&sim)
        .wait_task(
            &upid,
            tokio::time::Instant::now() + Duration::from_secs(10),
            Duration::from_millis(50),
        )
        .await
        .expect("the other clone ends");

    // No clone left: nobody will ever clear it. FAILED, naming the command,
    // well before the retry window.
    let started = Instant::now();
    let e = delete
        .await
        .expect("joined")
        .expect_err("the lock stays until root clears it");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(e.kind(), ErrorKind::Permanent, "{e}");
    let text = e.to_string();
    assert!(text.contains(&format!("qm unlock {}", vm.vmid)), "{text}");
    assert!(
        text.contains("locked (clone)") && text.contains("pve1"),
        "{text}"
    );
    assert!(
        sim.vm(vm.vmid).is_some(),
        "nothing destroyed behind the lock"
    );

    // Root ran `qm unlock`: the next Delete (after a reclaim) ends.
    assert!(sim.set_lock(vm.vmid, None));
    sub.delete_vm(&vm, id)
        .await
        .expect("delete after qm unlock");
    assert!(sim.vm(vm.vmid).is_none());
    sim.shutdown().await;
}

#[tokio::test]
async fn a_clone_that_dies_with_its_node_under_a_pool_token_is_named_not_leaked() {
    let sim = sim_with(SimConfig {
        pool_acl: true,
        clone_duration: Duration::from_millis(1500),
        offline_delay: Duration::from_millis(100),
        ..common::fast_sim_150()
    })
    .await;
    let sub = Arc::new(PveSubstrate::new(client(&sim), opts()));
    let create = {
        let sub = Arc::clone(&sub);
        tokio::spawn(async move {
            sub.clone_vm(&req("p/OnDemand/pve.small/pve1/002", "pve1"))
                .await
        })
    };
    let vmid = until_some("the clone's VM to appear", Duration::from_secs(10), || {
        sim.vms()
            .values()
            .find(|v| !v.template && v.lock.as_deref() == Some("clone"))
            .map(|v| v.vmid)
    })
    .await;
    // The node powers off mid-clone and comes back.
    assert!(sim.set_node_online("pve1", false));
    assert!(sim.set_node_online("pve1", true));
    let left = sim.vm(vmid).expect("the half-made VM stays");
    assert_eq!(
        (left.lock.as_deref(), left.pool.as_deref()),
        (Some("clone"), None)
    );

    let e = create
        .await
        .expect("joined")
        .expect_err("the clone died with its node");
    let text = e.to_string();
    assert!(text.contains(&format!("qm unlock {vmid}")), "{text}");
    assert!(text.contains(&format!("qm destroy {vmid}")), "{text}");
    assert!(
        text.contains("outside") || text.contains("never joined the pool"),
        "{text}"
    );
    assert_eq!(e.kind(), ErrorKind::Permanent, "{e}");
    sim.shutdown().await;
}
