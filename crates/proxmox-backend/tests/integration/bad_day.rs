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

/// A disk the destroy cannot free (an LV in use, an RBD image with
/// watchers): qemu-server's `destroy_vm` warns `Could not remove disk
/// '<volid>', check manually`, removes the VM and leaves the volume; PVE 9
/// ends the task `WARNINGS: N`, PVE 8 `OK`. On both, the Delete succeeds (the
/// VM is gone), and the volume is reported: a WARN naming it and the task,
/// and one more in the leftover count.
#[tokio::test]
async fn a_disk_the_destroy_could_not_free_is_reported_on_pve_8_and_9() {
    for pve9 in [false, true] {
        let sim = sim_with(SimConfig {
            pve9,
            ..common::fast_sim_150()
        })
        .await;
        let sub = PveSubstrate::new(client(&sim), opts());
        let id = "p/OnDemand/pve.small/pve1/005";
        let vm = sub.clone_vm(&req(id, "pve1")).await.expect("create");
        let storage = sim.vm(vm.vmid).expect("the clone").storage;
        sim.set_storage_busy("pve1", &storage, true);
        let logs = provider_testkit::logs::capture();
        sub.delete_vm(&vm, id).await.expect("the Delete succeeds");
        assert!(sim.vm(vm.vmid).is_none(), "the VM is gone");
        let left = sim.leftover_volumes();
        assert_eq!(left.len(), 1, "pve9={pve9}: {left:?}");
        assert_eq!(sub.destroy_leftovers(), 1, "pve9={pve9}");
        let warned: Vec<_> = logs
            .events()
            .into_iter()
            .filter(|e| e.level == tracing::Level::WARN && e.field("volume").is_some())
            .collect();
        assert_eq!(warned.len(), 1, "pve9={pve9}: {warned:?}");
        let w = &warned[0];
        assert_eq!(w.field("volume"), Some(left[0].volid.as_str()));
        assert_eq!(w.field("vm"), Some(vm.to_string().as_str()));
        let upid = w.field("upid").expect("the task's UPID");
        assert!(
            upid.starts_with("UPID:pve1:") && upid.contains(":qmdestroy:"),
            "{upid}"
        );
        assert!(!format!("{w:?}").contains(sim.token_secret()));
        assert_eq!(
            w.field("exit"),
            Some(if pve9 { "WARNINGS: 2" } else { "OK" })
        );
        // A destroy that freed everything reports nothing.
        sim.set_storage_busy("pve1", &storage, false);
        let id = "p/OnDemand/pve.small/pve1/006";
        let vm = sub.clone_vm(&req(id, "pve1")).await.expect("create");
        sub.delete_vm(&vm, id).await.expect("delete");
        assert_eq!(sub.destroy_leftovers(), 1);
        drop(logs);
        sim.shutdown().await;
    }
}

/// What reading the destroy task's log costs a Delete, measured on pve-sim
/// (see `Api::report_unremoved_disks`): API calls per Delete with and
/// without the read, and the read's own time. Not a check; run with
/// `cargo test -p proxmox-backend --test integration destroy_log_cost --
/// --ignored --nocapture`.
#[tokio::test]
#[ignore = "a measurement, not a check"]
async fn destroy_log_cost() {
    let sim = sim_with(common::fast_sim_150()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    const N: usize = 20;
    let mut calls = Vec::new();
    let mut logs = Vec::new();
    let mut took = Vec::new();
    for i in 0..N {
        let id = format!("p/OnDemand/pve.small/pve1/{i:03}");
        let vm = sub.clone_vm(&req(&id, "pve1")).await.expect("create");
        sim.faults().reset_counts();
        let started = std::time::Instant::now();
        sub.delete_vm(&vm, &id).await.expect("delete");
        took.push(started.elapsed());
        calls.push(common::total_calls(&sim));
        logs.push(sim.faults().call_count(endpoints::TASK_LOG));
    }
    // The log read alone, timed on its own.
    let c = client(&sim);
    let id = "p/OnDemand/pve.small/pve1/999";
    let vm = sub.clone_vm(&req(id, "pve1")).await.expect("create");
    assert!(sim.stop_vm_out_of_band(vm.vmid));
    let upid = c.destroy(&vm.node, vm.vmid).await.expect("destroy");
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    c.wait_task(&upid, deadline, std::time::Duration::from_millis(20))
        .await
        .expect("destroyed");
    let mut reads = Vec::new();
    for _ in 0..N {
        let started = std::time::Instant::now();
        c.task_log(&upid, 0, 500).await.expect("log");
        reads.push(started.elapsed());
    }
    took.sort();
    reads.sort();
    println!(
        "Delete: {} API calls each ({} of them the task log read); median {:?}; \
         the log read alone: median {:?}, max {:?}",
        calls[N / 2],
        logs[N / 2],
        took[N / 2],
        reads[N / 2],
        reads[N - 1]
    );
    sim.shutdown().await;
}

/// The requests the provider made about task `upid`: its status reads and
/// its log reads.
fn task_reads(sim: &pve_sim::PveSim, kind: &str) -> (usize, usize) {
    let requests = sim.requests();
    let of_task = |suffix: &str| {
        requests
            .iter()
            .filter(|r| r.path.contains(kind) && r.path.ends_with(suffix))
            .count()
    };
    (of_task("/status"), of_task("/log"))
}

/// A destroy is looked at through its log, which the Delete reads anyway
/// for the disks it could not free: the worker's last line (`TASK OK`)
/// says it ended, so no status read comes first and no log read after.
#[tokio::test]
async fn a_destroy_is_looked_at_through_its_log_which_is_read_once() {
    let sim = sim_with(SimConfig {
        destroy_duration: std::time::Duration::from_millis(10),
        ..common::fast_sim_150()
    })
    .await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let id = "p/OnDemand/pve.small/pve1/007";
    let vm = sub.clone_vm(&req(id, "pve1")).await.expect("create");
    sub.delete_vm(&vm, id).await.expect("delete");
    assert!(sim.vm(vm.vmid).is_none());
    assert_eq!(
        task_reads(&sim, "qmdestroy"),
        (0, 1),
        "one look, through the log, and nothing after it"
    );
    sim.shutdown().await;
}

/// A destroy's worker dies with its node before its last line: its log
/// never ends, and only its status (`unexpected status`) says it is over.
/// Looked at through its log, every fourth look reads the status, so the
/// Delete learns the worker died instead of waiting out `--task-timeout`.
#[tokio::test]
async fn a_destroy_whose_worker_died_unwritten_is_told_by_its_status() {
    let sim = sim_with(SimConfig {
        destroy_duration: std::time::Duration::from_secs(30),
        ..common::fast_sim_150()
    })
    .await;
    let sub = std::sync::Arc::new(PveSubstrate::new(client(&sim), opts()));
    let id = "p/OnDemand/pve.small/pve1/008";
    let vm = sub.clone_vm(&req(id, "pve1")).await.expect("create");
    let delete = tokio::spawn({
        let sub = std::sync::Arc::clone(&sub);
        let vm = vm.clone();
        async move { sub.delete_vm(&vm, id).await }
    });
    common::until("the destroy is looked at", || {
        task_reads(&sim, "qmdestroy").1 > 0
    })
    .await;
    assert!(sim.set_node_online("pve1", false));
    sim.set_node_online("pve1", true);
    let e = tokio::time::timeout(std::time::Duration::from_secs(10), delete)
        .await
        .expect("the Delete ends well before --task-timeout")
        .expect("joined")
        .expect_err("the destroy died");
    assert!(e.to_string().contains("unexpected status"), "{e}");
    let (status, _) = task_reads(&sim, "qmdestroy");
    assert!(status >= 1, "the status said it");
    sim.shutdown().await;
}
