//! Real-cluster failure modes, each reproduced in the PVE simulator and
//! driven through the real substrate (PveSubstrate over verified HTTPS).

use std::sync::Arc;
use std::time::Duration;

use proxmox_backend::proxmox::{marker_description, parse_marker, PveOptions, PveSubstrate};
use proxmox_backend::substrate::{Substrate, VmRef};
use pve::PveConfig;
use pve_sim::{endpoints, SimConfig, TagAccess, TemplateSpec};

use crate::common::{
    assert_no_violations, client_3_tries as client, clones, fast_retrying as opts,
    fast_sim_150 as fast, req, sim_with, until,
};

// ---- item 2: never destroy what isn't ours ----

#[tokio::test]
async fn delete_destroys_only_a_vm_whose_marker_names_the_machine() {
    let sim = sim_with(fast()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let a = "p/OnDemand/pve.small/pve1/001";
    let vm = sub.clone_vm(&req(a, "pve1")).await.expect("create");

    // Another machine's delete on this VMID (a stale host_ref) is "gone".
    sub.delete_vm(&vm, "p/OnDemand/pve.small/pve1/002")
        .await
        .expect("not ours: success, nothing done");
    assert!(sim.vm(vm.vmid).is_some(), "another machine's VM survives");

    // A look-alike: our tag and name, but no marker.
    let mut look = sim.new_vm(700, "pve1", "bigfleet-pve-small-x");
    look.tags = Some("bigfleet".into());
    look.running = true;
    sim.insert_vm(look).unwrap();
    let fake = VmRef {
        node: "pve1".into(),
        vmid: 700,
    };
    sub.delete_vm(&fake, a)
        .await
        .expect("look-alike: left alone");
    assert!(
        sim.vm(700).is_some_and(|v| v.running),
        "look-alike untouched"
    );

    // A look-alike carrying another machine's marker.
    let mut other = sim.new_vm(701, "pve1", "bigfleet-pve-small-y");
    other.tags = Some("bigfleet".into());
    other.description = Some(marker_description("someone/else", "op-9"));
    sim.insert_vm(other).unwrap();
    let other_ref = VmRef {
        node: "pve1".into(),
        vmid: 701,
    };
    sub.delete_vm(&other_ref, a).await.expect("left alone");
    assert!(sim.vm(701).is_some());

    sub.delete_vm(&vm, a).await.expect("ours: destroyed");
    assert!(sim.vm(vm.vmid).is_none());
    assert_no_violations(&sim);
    sim.shutdown().await;
}

#[tokio::test]
async fn failed_clone_is_removed_only_when_its_marker_is_this_operations() {
    let sim = sim_with(SimConfig {
        keep_failed_clone: true,
        clone_duration: Duration::from_millis(300),
        ..fast()
    })
    .await;
    let sub = Arc::new(PveSubstrate::new(client(&sim), opts()));

    // A worker that dies mid-copy and leaves our half-made VM: removed.
    sim.faults()
        .fail_next_task("qmclone", 1, "clone failed: copy aborted");
    let e = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/003", "pve1"))
        .await
        .expect_err("worker failed");
    assert!(e.to_string().contains("copy aborted"), "{e}");
    assert!(clones(&sim).is_empty(), "our half-made VM was removed");

    // The same, but while the worker copies, the VM at that VMID comes to
    // carry another machine's marker (a VMID race): it is left alone.
    sim.faults()
        .fail_next_task("qmclone", 1, "clone failed: copy aborted");
    let task = {
        let sub = Arc::clone(&sub);
        tokio::spawn(async move {
            sub.clone_vm(&req("p/OnDemand/pve.small/pve1/004", "pve1"))
                .await
        })
    };
    until("the clone's VM appears", || !clones(&sim).is_empty()).await;
    let vmid = clones(&sim)[0].vmid;
    sim.update_vm(vmid, |vm| {
        vm.description = Some(marker_description("another/machine", "op-x"));
    });
    task.await.unwrap().expect_err("worker failed");
    let left = sim
        .vm(vmid)
        .expect("another machine's VM is never destroyed");
    assert_eq!(
        parse_marker(left.description.as_deref().unwrap_or_default()).as_deref(),
        Some("another/machine")
    );
    sim.shutdown().await;
}

// ---- item 6: pool-scoped tokens ----

fn pool_acl() -> SimConfig {
    SimConfig {
        pool_acl: true,
        clone_timeline: true,
        ..fast()
    }
}

#[tokio::test]
async fn pool_scoped_token_delete_is_idempotent() {
    let sim = sim_with(pool_acl()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let id = "p/OnDemand/pve.small/pve1/010";
    let vm = sub.clone_vm(&req(id, "pve1")).await.expect("create");
    assert_eq!(sim.vm(vm.vmid).unwrap().pool.as_deref(), Some("bigfleet"));
    sub.delete_vm(&vm, id).await.expect("delete");
    assert!(sim.vm(vm.vmid).is_none());
    // The VM is gone: its path is now a 403, resolved through nextid.
    sim.reset_counts();
    sub.delete_vm(&vm, id)
        .await
        .expect("already gone is success");
    assert!(
        sim.call_count(endpoints::NEXTID) >= 1,
        "403 resolved by nextid"
    );

    // A VM outside the pool (taken VMID, invisible): not ours, left alone.
    let mut outside = sim.new_vm(800, "pve1", "bigfleet-pve-small-z");
    outside.pool = None;
    outside.description = Some(marker_description(id, "op-1"));
    sim.insert_vm(outside).unwrap();
    let outside_ref = VmRef {
        node: "pve1".into(),
        vmid: 800,
    };
    sub.delete_vm(&outside_ref, id)
        .await
        .expect("invisible: not ours");
    assert!(sim.vm(800).is_some());
    assert_no_violations(&sim);
    sim.shutdown().await;
}

#[tokio::test]
async fn pool_scoped_token_retried_create_waits_for_the_clone_in_progress() {
    let sim = sim_with(SimConfig {
        clone_duration: Duration::from_millis(1500),
        ..pool_acl()
    })
    .await;
    // The first attempt gives up on the clone task early; the clone goes on,
    // outside the pool (403) until its end.
    let short = PveOptions {
        task_timeout: Duration::from_millis(300),
        ..opts()
    };
    let sub = PveSubstrate::new(client(&sim), short);
    let id = "p/OnDemand/pve.small/pve1/011";
    sub.clone_vm(&req(id, "pve1"))
        .await
        .expect_err("task still running at the deadline");
    let vmid = clones(&sim)[0].vmid;
    assert_eq!(sim.vm(vmid).unwrap().pool, None, "not in the pool yet");
    let vm = sub.clone_vm(&req(id, "pve1")).await.expect("retry adopts");
    assert_eq!(vm.vmid, vmid);
    assert_eq!(sim.call_count(endpoints::CLONE), 1, "never cloned twice");
    assert_eq!(clones(&sim).len(), 1);
    assert!(sim.vm(vmid).unwrap().running);
    sim.shutdown().await;
}

#[tokio::test]
async fn pool_scoped_token_clears_a_pending_clone_that_never_came() {
    let sim = sim_with(pool_acl()).await;
    let id = "p/OnDemand/pve.small/pve1/012";
    // The clone's answer is lost and its worker fails before creating
    // anything: the VMID answers 403 (no VM, so not in the pool).
    sim.faults()
        .fail_after_apply(endpoints::CLONE, 1, 596, "Connection timed out");
    sim.faults()
        .fail_next_task("qmclone", 1, "clone failed: no space left on device");
    let impatient = PveSubstrate::new(
        client(&sim),
        PveOptions {
            retry_window: Duration::from_millis(400),
            ambiguous_settle: Duration::from_secs(30),
            ..opts()
        },
    );
    let e = impatient
        .clone_vm(&req(id, "pve1"))
        .await
        .expect_err("unresolved within the window");
    assert!(e.to_string().contains("may have been applied"), "{e}");
    // The retried Create finds the pending VMID free (403, then nextid 200),
    // clears it and clones once more.
    sim.reset_counts();
    let vm = impatient
        .clone_vm(&req(id, "pve1"))
        .await
        .expect("pending cleared, cloned");
    assert_eq!(sim.call_count(endpoints::CLONE), 1, "one new clone");
    assert!(sim.call_count(endpoints::NEXTID) >= 1);
    assert_eq!(clones(&sim).len(), 1, "exactly one VM");
    assert_eq!(clones(&sim)[0].vmid, vm.vmid);
    sim.shutdown().await;
}

#[tokio::test]
async fn lost_answer_of_a_clone_that_was_not_applied_clones_again() {
    let sim = sim_with(pool_acl()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    sim.faults()
        .fail_after_apply(endpoints::CLONE, 1, 596, "Connection timed out");
    sim.faults()
        .fail_next_task("qmclone", 1, "clone failed: no space left on device");
    let vm = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/013", "pve1"))
        .await
        .expect("the VMID stayed free: cloned again with a fresh one");
    assert_eq!(sim.call_count(endpoints::CLONE), 2);
    assert_eq!(clones(&sim).len(), 1);
    assert!(sim.vm(vm.vmid).unwrap().running);
    sim.shutdown().await;
}

// ---- item 5: VMIDs ----

#[tokio::test]
async fn collisions_found_by_the_clone_worker_get_a_fresh_vmid() {
    let sim = sim_with(SimConfig {
        clone_timeline: true,
        ..fast()
    })
    .await;
    let sub = PveSubstrate::new(client(&sim), opts());
    for msg in [
        "unable to create VM {newid}: config file already exists",
        "close (rename) atomic file '/etc/pve/nodes/pve1/qemu-server/{newid}.conf' failed: File exists",
        "can't lock file '/var/lock/qemu-server/lock-{newid}.conf' - got timeout",
    ] {
        sim.faults().fail_next_task("qmclone", 1, msg);
    }
    let vm = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/020", "pve1"))
        .await
        .expect("create survives three worker-side collisions");
    assert_eq!(sim.call_count(endpoints::CLONE), 4);
    assert_eq!(clones(&sim).len(), 1);
    assert!(sim.vm(vm.vmid).unwrap().running);
    sim.shutdown().await;
}

#[tokio::test]
async fn vmid_allocation_walks_the_whole_range() {
    let sim = sim_with(fast()).await;
    // 36 ids in a row taken: more than any fixed number of probes.
    for vmid in 1000..1036 {
        sim.insert_vm(sim.new_vm(vmid, "pve1", "taken")).unwrap();
    }
    let o = PveOptions {
        vmid_range: (1000, 1040),
        ..opts()
    };
    let sub = PveSubstrate::new(client(&sim), o);
    let vm = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/030", "pve1"))
        .await
        .expect("a free id exists in the range");
    assert_eq!(vm.vmid, 1036);

    // The range full: a clear error naming it and the fix.
    for vmid in 1037..=1040 {
        sim.insert_vm(sim.new_vm(vmid, "pve1", "taken")).unwrap();
    }
    let e = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/031", "pve1"))
        .await
        .expect_err("range exhausted");
    let msg = e.to_string();
    assert!(
        msg.contains("1000-1040") && msg.contains("--vmid-range"),
        "{msg}"
    );
    sim.shutdown().await;
}

// ---- item 3: transient failures and ambiguous POSTs ----

#[tokio::test]
async fn lost_answer_after_the_clone_was_applied_adopts_it() {
    let sim = sim_with(fast()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    sim.faults()
        .fail_after_apply(endpoints::CLONE, 1, 596, "Connection timed out");
    sim.faults()
        .fail_after_apply(endpoints::START, 1, 597, "Connection error");
    let id = "p/OnDemand/pve.small/pve1/040";
    let vm = sub.clone_vm(&req(id, "pve1")).await.expect("create");
    assert_eq!(sim.call_count(endpoints::CLONE), 1, "no second clone");
    assert_eq!(clones(&sim).len(), 1);
    assert!(sim.vm(vm.vmid).unwrap().running);
    sim.shutdown().await;
}

#[tokio::test]
async fn transient_failures_are_retried_within_the_window() {
    let sim = sim_with(fast()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let id = "p/OnDemand/pve.small/pve1/041";
    // More 5xx than the client's own retries cover.
    sim.faults()
        .fail_next(endpoints::CLONE, 4, 595, "No route to host");
    sim.faults()
        .fail_next(endpoints::CONFIG_PUT, 2, 503, "Service Unavailable");
    sim.faults()
        .fail_next(endpoints::STATUS, 5, 596, "Connection timed out");
    let vm = sub.clone_vm(&req(id, "pve1")).await.expect("create");
    sim.faults()
        .fail_next(endpoints::STOP, 5, 595, "No route to host");
    sim.faults()
        .fail_next(endpoints::DESTROY, 1, 502, "Bad Gateway");
    sub.delete_vm(&vm, id).await.expect("delete");
    assert!(sim.vm(vm.vmid).is_none());
    assert_eq!(clones(&sim).len(), 0);
    sim.shutdown().await;
}

#[tokio::test]
async fn connections_closed_by_pveproxy_are_not_reused() {
    let sim = sim_with(SimConfig {
        keepalive_idle: Some(Duration::from_millis(200)),
        ..fast()
    })
    .await;
    assert!(
        PveConfig::new("https://h:8006/api2/json", "a@pve!t", "s").pool_idle_timeout
            < Duration::from_secs(5),
        "pooled connections must be dropped before pveproxy's 5 s"
    );
    let c = client(&sim);
    let sub = PveSubstrate::new(c.clone(), opts());
    let id = "p/OnDemand/pve.small/pve1/042";
    let sim_logs = provider_testkit::logs::capture();
    let vm = sub.clone_vm(&req(id, "pve1")).await.expect("create");
    // Idle until the simulator has closed the pooled connection, as
    // pveproxy does, then state-changing calls.
    let (server, idle_close) = ("pve_sim::server", "closing an idle keep-alive connection");
    let closed_before = sim_logs.count(server, idle_close);
    sim_logs
        .wait_for(
            server,
            idle_close,
            closed_before + 1,
            Duration::from_secs(10),
        )
        .await;
    sub.ensure_running(&vm).await.expect("after an idle close");
    // An error response closes its connection; the next POST still goes through.
    let _ = c
        .status_current("pve1", 4242)
        .await
        .expect_err("missing VM");
    sub.delete_vm(&vm, id)
        .await
        .expect("after an error response");
    sim.shutdown().await;
}

// ---- item 7: backup lock, tag policy ----

#[tokio::test]
async fn template_locked_by_a_backup_is_waited_for() {
    let sim = sim_with(fast()).await;
    let sub = Arc::new(PveSubstrate::new(client(&sim), opts()));
    assert!(sim.set_lock(9000, Some("backup")));
    let task = {
        let sub = Arc::clone(&sub);
        tokio::spawn(async move {
            sub.clone_vm(&req("p/OnDemand/pve.small/pve1/050", "pve1"))
                .await
        })
    };
    until("a clone attempt hit the lock", || {
        sim.call_count(endpoints::CLONE) >= 2
    })
    .await;
    assert!(sim.set_lock(9000, None), "the backup ends");
    task.await.unwrap().expect("created after the backup");

    // A backup outlasting the window: last_error names the lock.
    assert!(sim.set_lock(9000, Some("backup")));
    let o = PveOptions {
        retry_window: Duration::from_millis(600),
        ..opts()
    };
    let sub = PveSubstrate::new(client(&sim), o);
    let e = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/051", "pve1"))
        .await
        .expect_err("still locked");
    assert!(e.to_string().contains("locked (backup)"), "{e}");
    sim.shutdown().await;
}

#[tokio::test]
async fn restricted_tag_access_falls_back_to_marker_only() {
    let sim = sim_with(SimConfig {
        tag_access: TagAccess::Existing(vec![]),
        ..fast()
    })
    .await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let id = "p/OnDemand/pve.small/pve1/060";
    let vm = sub.clone_vm(&req(id, "pve1")).await.expect("create");
    let v = sim.vm(vm.vmid).unwrap();
    assert_eq!(v.tags, None, "no tags could be set");
    assert_eq!((v.cores, v.memory_mib), (2, 2048), "sized all the same");
    let managed = sub.describe_managed().await.unwrap();
    assert_eq!(managed.len(), 1);
    assert_eq!(managed[0].machine_id, id);
    // Adopting does not loop on the tags it can never set.
    let again = sub.clone_vm(&req(id, "pve1")).await.expect("adopt");
    assert_eq!(again, vm);
    // A fresh process (restart) finds it by its marker too.
    let restarted = PveSubstrate::new(client(&sim), opts());
    assert_eq!(restarted.describe_managed().await.unwrap().len(), 1);
    sub.delete_vm(&vm, id).await.expect("delete");
    assert!(sim.vm(vm.vmid).is_none());
    sim.shutdown().await;
}

// ---- item 4: offline nodes ----

#[tokio::test]
async fn offline_node_at_startup_and_during_a_create() {
    let sim = sim_with(SimConfig {
        templates: vec![TemplateSpec::shared(9000, "pve1")],
        ..fast()
    })
    .await;
    let before = PveSubstrate::new(client(&sim), opts());
    let on_pve2 = "p/OnDemand/pve.small/pve2/070";
    let vm2 = before
        .clone_vm(&req(on_pve2, "pve2"))
        .await
        .expect("create");
    assert_eq!(vm2.node, "pve2");
    assert!(sim.set_node_online("pve2", false));

    // The running process keeps reporting the machine on the offline node.
    let managed = before.describe_managed().await.expect("reconcile survives");
    assert_eq!(managed.len(), 1, "machine not dropped");
    assert_eq!(managed[0].machine_id, on_pve2);

    // A restart while pve2 is offline: preflight warns, inventory works.
    let sub = Arc::new(PveSubstrate::new(client(&sim), opts()));
    let warnings = sub
        .preflight(&["pve1".into(), "pve2".into()], &[9000])
        .await
        .expect("start-up survives an offline node");
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("pve2") && w.contains("offline")),
        "{warnings:?}"
    );
    sub.describe_managed()
        .await
        .expect("the first reconcile does not fail");

    // A Create aimed at the offline node fails at once, naming it (PVE
    // would accept a clone to it): nothing is sent, it never hangs in
    // CREATING for the retry window.
    let started = std::time::Instant::now();
    let e = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve2/071", "pve2"))
        .await
        .expect_err("pve2 is offline");
    assert!(e.to_string().contains("node pve2"), "{e}");
    assert!(
        started.elapsed() < opts().retry_window,
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        sim.call_count(endpoints::CLONE),
        1,
        "no clone to the offline node"
    );
    assert!(sim.set_node_online("pve2", true));
    let vm = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve2/071", "pve2"))
        .await
        .expect("created once the node is back");
    assert_eq!(vm.node, "pve2");

    // Offline past the window: last_error names the node.
    assert!(sim.set_node_online("pve2", false));
    let o = PveOptions {
        retry_window: Duration::from_millis(600),
        ..opts()
    };
    let short = PveSubstrate::new(client(&sim), o);
    let e = short
        .clone_vm(&req("p/OnDemand/pve.small/pve2/072", "pve2"))
        .await
        .expect_err("node stays offline");
    assert!(e.to_string().contains("node pve2"), "{e}");
    sim.shutdown().await;
}
