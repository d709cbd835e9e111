//! Templates on local storage, per-node replicas, clone modes and storage
//! placement: the real substrate against the PVE simulator.

use std::sync::Arc;
use std::time::Duration;

use proxmox_backend::proxmox::{
    parse_replica_marker, CloneMode, PveOptions, PveSubstrate, REPLICA_TAG,
};
use proxmox_backend::substrate::{CloneRequest, Substrate};
use pve_sim::{endpoints, PveSim, SimConfig, StorageKind, StorageSpec, TemplateSpec, Vm};

use crate::common::{self, assert_no_violations, client, sim_with};

fn opts() -> PveOptions {
    common::opts_retrying(
        Duration::from_secs(30),
        Duration::from_secs(30),
        Duration::from_millis(500),
    )
}

/// The `i`th machine on `node`.
fn req(node: &str, i: usize) -> CloneRequest {
    CloneRequest {
        operation_id: format!("op-{node}-{i}"),
        ..common::req(&format!("p/OnDemand/pve.small/{node}/{i:03}"), node)
    }
}

/// Our replicas in the simulator: (vmid, VM, marker).
fn replicas(sim: &PveSim) -> Vec<(u32, Vm, (u32, String))> {
    sim.vms()
        .into_iter()
        .filter_map(|(id, vm)| {
            let m = parse_replica_marker(vm.description.as_deref()?)?;
            Some((id, vm, m))
        })
        .collect()
}

#[tokio::test]
async fn a_local_template_serves_every_node() {
    let sim = sim_with(SimConfig::default()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let on_pve1 = sub.clone_vm(&req("pve1", 0)).await.expect("same node");
    assert_eq!(
        sim.call_count(endpoints::MIGRATE),
        0,
        "no replica for the template's own node"
    );

    // The first Create on pve2 stages the replica.
    let first = sub
        .clone_vm(&req("pve2", 0))
        .await
        .expect("stages a replica");
    assert_eq!(first.node, "pve2");
    let reps = replicas(&sim);
    assert_eq!(reps.len(), 1, "{reps:?}");
    let (rid, rvm, (source, digest)) = &reps[0];
    assert_eq!((rvm.node.as_str(), rvm.template), ("pve2", true));
    assert_eq!(*source, 9000);
    assert_eq!(
        digest,
        &sim.vm(9000).unwrap().digest(),
        "names the source's digest"
    );
    assert!(rvm
        .tags
        .as_deref()
        .unwrap_or_default()
        .contains(REPLICA_TAG));
    assert_eq!(rvm.storage, "local-lvm");
    assert_eq!(rvm.pool.as_deref(), Some("bigfleet"));
    let (m, t) = (
        sim.call_count(endpoints::MIGRATE),
        sim.call_count(endpoints::TEMPLATE),
    );
    assert_eq!((m, t), (1, 1));
    // The machine was cloned from the replica on pve2, not across nodes.
    let clones: Vec<String> = sim
        .requests()
        .into_iter()
        .filter(|r| r.endpoint.as_deref() == Some(endpoints::CLONE))
        .map(|r| r.path)
        .collect();
    assert!(
        clones
            .last()
            .unwrap()
            .contains(&format!("/nodes/pve2/qemu/{rid}/clone")),
        "{clones:?}"
    );

    // Later Creates on pve2 reuse it.
    let second = sub
        .clone_vm(&req("pve2", 1))
        .await
        .expect("reuses the replica");
    assert_eq!(second.node, "pve2");
    assert_eq!(sim.call_count(endpoints::MIGRATE), 1, "no second staging");
    assert_eq!(replicas(&sim).len(), 1);
    let v = sim.vm(second.vmid).unwrap();
    assert!(v.running && v.node == "pve2");
    // A restarted provider finds it again (tag, then marker) and reuses it.
    let restarted = PveSubstrate::new(client(&sim), opts());
    let third = restarted
        .clone_vm(&req("pve2", 2))
        .await
        .expect("reuses after a restart");
    assert_eq!(sim.call_count(endpoints::MIGRATE), 1);

    // Replicas are not machines.
    let managed = sub.describe_managed().await.unwrap();
    let mut vmids: Vec<u32> = managed.iter().map(|m| m.vm.vmid).collect();
    vmids.sort_unstable();
    let mut want = vec![on_pve1.vmid, first.vmid, second.vmid, third.vmid];
    want.sort_unstable();
    assert_eq!(vmids, want);
    assert_no_violations(&sim);
    sim.shutdown().await;
}

#[tokio::test]
async fn a_burst_from_one_local_template_across_two_nodes_all_succeed() {
    let sim = sim_with(SimConfig::default()).await;
    let sub = Arc::new(PveSubstrate::new(client(&sim), opts()));
    let mut tasks = Vec::new();
    for i in 0..16 {
        let sub = Arc::clone(&sub);
        let node = if i % 2 == 0 { "pve1" } else { "pve2" };
        tasks.push(tokio::spawn(
            async move { sub.clone_vm(&req(node, i)).await },
        ));
    }
    let mut failed = Vec::new();
    let mut nodes = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Ok(vm) => nodes.push(vm.node),
            Err(e) => failed.push(e.to_string()),
        }
    }
    assert!(failed.is_empty(), "{} FAILED: {failed:?}", failed.len());
    assert_eq!(nodes.iter().filter(|n| *n == "pve2").count(), 8);
    assert_eq!(sim.call_count(endpoints::MIGRATE), 1, "one shared staging");
    assert_eq!(replicas(&sim).len(), 1);
    assert_no_violations(&sim);
    sim.shutdown().await;
}

#[tokio::test]
async fn opting_out_keeps_the_local_storage_message() {
    let sim = sim_with(SimConfig::default()).await;
    let sub = PveSubstrate::new(
        client(&sim),
        PveOptions {
            template_replicas: false,
            ..opts()
        },
    );
    let e = sub.clone_vm(&req("pve2", 0)).await.expect_err("refused");
    assert!(
        e.to_string().starts_with(
            "cannot clone template 9000 from node pve1 to node pve2: its disks are on local storage"
        ),
        "{e}"
    );
    assert_eq!(sim.call_count(endpoints::MIGRATE), 0);
    assert!(replicas(&sim).is_empty());
    sim.shutdown().await;
}

#[tokio::test]
async fn a_stale_replica_is_refreshed_and_a_foreign_one_left_alone() {
    let sim = sim_with(SimConfig::default()).await;
    // An operator's own per-node copy: looks like a replica, has no marker.
    let mut foreign = sim.new_vm(8000, "pve2", "bigfleet-replica-9000-pve2");
    foreign.template = true;
    foreign.tags = Some(REPLICA_TAG.into());
    foreign.description = Some("my copy of 9000".into());
    sim.insert_vm(foreign).unwrap();
    let foreign_digest = sim.vm(8000).unwrap().digest();

    let sub = PveSubstrate::new(client(&sim), opts());
    sub.clone_vm(&req("pve2", 0)).await.expect("stages its own");
    let old = replicas(&sim);
    assert_eq!(old.len(), 1);
    let old_id = old[0].0;
    assert_ne!(old_id, 8000);

    // The source template changes: its replica is stale.
    assert!(sim.update_vm(9000, |vm| vm.description = Some("v2: new image".into())));
    let new_digest = sim.vm(9000).unwrap().digest();
    let vm = sub.clone_vm(&req("pve2", 1)).await.expect("refreshes");
    let now = replicas(&sim);
    assert_eq!(now.len(), 1, "{now:?}");
    assert_ne!(now[0].0, old_id, "a new copy");
    assert_eq!(now[0].2, (9000, new_digest));
    assert!(sim.vm(old_id).is_none(), "the stale copy is removed");
    let clone_of_new = sim
        .requests()
        .into_iter()
        .rev()
        .find(|r| r.endpoint.as_deref() == Some(endpoints::CLONE))
        .unwrap();
    assert!(clone_of_new
        .path
        .contains(&format!("/qemu/{}/clone", now[0].0)));
    assert_eq!(sim.vm(vm.vmid).unwrap().node, "pve2");

    // The foreign copy was never touched.
    let f = sim.vm(8000).expect("still there");
    assert_eq!(f.digest(), foreign_digest);
    assert!(!sim
        .requests()
        .iter()
        .any(|r| r.path.contains("/qemu/8000/") && r.method != "GET"));
    assert_no_violations(&sim);
    sim.shutdown().await;
}

#[tokio::test]
async fn a_failed_staging_names_its_step_and_the_next_create_retries() {
    let sim = sim_with(SimConfig::default()).await;
    sim.faults()
        .fail_next_task("qmigrate", 1, "migration aborted");
    let sub = Arc::new(PveSubstrate::new(client(&sim), opts()));
    // Two concurrent Creates share the one failed staging.
    let a = tokio::spawn({
        let sub = Arc::clone(&sub);
        async move { sub.clone_vm(&req("pve2", 0)).await }
    });
    let b = tokio::spawn({
        let sub = Arc::clone(&sub);
        async move { sub.clone_vm(&req("pve2", 1)).await }
    });
    for r in [a.await.unwrap(), b.await.unwrap()] {
        let e = r.expect_err("staging failed").to_string();
        assert!(
            e.contains("staging a copy of template 9000")
                && e.contains("step 4 of 5, migrating VM")
                && e.contains("from node pve1 to node pve2")
                && e.contains("migration aborted"),
            "{e}"
        );
    }
    assert_eq!(
        sim.call_count(endpoints::MIGRATE),
        1,
        "one staging for both"
    );
    assert!(replicas(&sim).is_empty(), "the half-made copy is removed");

    let vm = sub.clone_vm(&req("pve2", 2)).await.expect("retried");
    assert_eq!(vm.node, "pve2");
    assert_eq!(sim.call_count(endpoints::MIGRATE), 2);
    assert_eq!(replicas(&sim).len(), 1);
    sim.shutdown().await;
}

#[tokio::test]
async fn a_storage_without_room_fails_fast_naming_both_sizes() {
    let sim = sim_with(SimConfig {
        storages: vec![
            StorageSpec::new("local-lvm", StorageKind::LvmThin, false, 1024),
            StorageSpec::new("big", StorageKind::LvmThin, false, 200),
            StorageSpec::new("small", StorageKind::LvmThin, false, 10),
        ],
        ..SimConfig::default()
    })
    .await;
    // The instance type's storage (catalog `storage`) is too small.
    let mut o = opts();
    o.type_storage.insert("pve.small".into(), "small".into());
    let sub = PveSubstrate::new(client(&sim), o);
    let e = sub.clone_vm(&req("pve1", 0)).await.expect_err("no room");
    assert_eq!(
        e.to_string(),
        "the storage guard refused the clone: storage small of node pve1 has no room for the \
         full clone of template 9000 for machine p/OnDemand/pve.small/pve1/000 (instance type \
         pve.small): it needs 32.0 GiB and 10.0 GiB is free. Create the machine on another \
         node, free space on the storage, or point the instance type (catalog `storage`) or the \
         node (--node-storage) at a storage with room"
    );
    assert_eq!(sim.call_count(endpoints::CLONE), 0, "failed before cloning");

    // Per node: pve1's clones (and pve2's replica and clones) go to `big`.
    let mut o = opts();
    o.node_storage.insert("pve1".into(), "big".into());
    o.node_storage.insert("pve2".into(), "big".into());
    let sub = PveSubstrate::new(client(&sim), o);
    let warnings = sub
        .preflight(&["pve1".into(), "pve2".into()], &[9000])
        .await
        .expect("storages exist");
    assert!(warnings.is_empty(), "{warnings:?}");
    let vm = sub.clone_vm(&req("pve1", 1)).await.expect("room on big");
    assert_eq!(sim.vm(vm.vmid).unwrap().storage, "big");
    let vm = sub.clone_vm(&req("pve2", 0)).await.expect("replica on big");
    assert_eq!(sim.vm(vm.vmid).unwrap().storage, "big");
    assert_eq!(replicas(&sim)[0].1.storage, "big");

    // A storage a node does not have is refused at start-up.
    let mut o = opts();
    o.node_storage.insert("pve2".into(), "nosuch".into());
    let e = PveSubstrate::new(client(&sim), o)
        .preflight(&["pve1".into(), "pve2".into()], &[9000])
        .await
        .expect_err("no such storage");
    assert!(
        e.to_string()
            .contains("storage \"nosuch\" (from --node-storage) is not on node pve2"),
        "{e}"
    );
    assert_no_violations(&sim);
    sim.shutdown().await;
}

#[tokio::test]
async fn linked_clones_where_pve_allows_them() {
    let mut thick = TemplateSpec::local(9100, "pve1");
    thick.storage = "thick".into();
    let sim = sim_with(SimConfig {
        templates: vec![TemplateSpec::local(9000, "pve1"), thick],
        storages: vec![
            StorageSpec::new("local-lvm", StorageKind::LvmThin, false, 1024),
            StorageSpec::new("thick", StorageKind::Lvm, false, 1024),
        ],
        ..SimConfig::default()
    })
    .await;
    let nodes = ["pve1".to_string(), "pve2".to_string()];
    let linked = || PveOptions {
        clone_mode: CloneMode::Linked,
        ..opts()
    };
    let e = PveSubstrate::new(client(&sim), linked())
        .preflight(&nodes, &[9100])
        .await
        .expect_err("thick LVM cannot link");
    assert!(
        e.to_string()
            .contains("storage thick (type lvm), which cannot make linked clones")
            && e.to_string().contains("--clone-mode full"),
        "{e}"
    );
    let e = PveSubstrate::new(
        client(&sim),
        PveOptions {
            template_replicas: false,
            ..linked()
        },
    )
    .preflight(&nodes, &[9000])
    .await
    .expect_err("local template, other node, no replicas");
    assert!(
        e.to_string()
            .contains("node pve2 cannot make linked clones")
            && e.to_string().contains("--template-replicas"),
        "{e}"
    );

    let sub = PveSubstrate::new(client(&sim), linked());
    sub.preflight(&nodes, &[9000])
        .await
        .expect("linked is possible");
    let a = sub.clone_vm(&req("pve1", 0)).await.expect("linked on pve1");
    assert_eq!(sim.vm(a.vmid).unwrap().linked_base, Some(9000));
    let b = sub
        .clone_vm(&req("pve2", 0))
        .await
        .expect("linked from the replica");
    let rid = replicas(&sim)[0].0;
    assert_eq!(sim.vm(b.vmid).unwrap().linked_base, Some(rid));
    assert_no_violations(&sim);
    sim.shutdown().await;
}

#[tokio::test]
async fn a_replica_destroyed_out_of_band_is_staged_again() {
    let sim = sim_with(SimConfig {
        rrd_lag: Duration::ZERO,
        ..SimConfig::default()
    })
    .await;
    let sub = PveSubstrate::new(client(&sim), opts());
    sub.clone_vm(&req("pve2", 0)).await.expect("stages");
    let old = replicas(&sim)[0].0;
    // An operator removes it behind the provider's back.
    assert!(sim.remove_vm(old).is_some());
    let vm = sub.clone_vm(&req("pve2", 1)).await.expect("staged again");
    assert_eq!(vm.node, "pve2");
    let now = replicas(&sim);
    assert!(
        now.iter().any(|(id, v, _)| *id != old && v.node == "pve2"),
        "{now:?}"
    );
    assert_eq!(sim.call_count(endpoints::MIGRATE), 2);
    sim.shutdown().await;
}

#[tokio::test]
async fn a_staging_cut_short_by_a_restart_is_cleaned_up() {
    let sim = sim_with(SimConfig::default()).await;
    // What a process killed between the clone and the migration leaves: a
    // plain VM on the template's node, marked as a replica for pve2.
    let mut left = sim.new_vm(7000, "pve1", "bigfleet-replica-9000-pve2");
    left.tags = Some(REPLICA_TAG.into());
    left.description = Some(proxmox_backend::proxmox::replica_description(
        9000, "old", "pve2",
    ));
    sim.insert_vm(left).unwrap();
    let sub = PveSubstrate::new(client(&sim), opts());
    let vm = sub.clone_vm(&req("pve2", 0)).await.expect("stages");
    assert_eq!(vm.node, "pve2");
    assert!(sim.vm(7000).is_none(), "the leftover is removed");
    let reps = replicas(&sim);
    assert_eq!(reps.len(), 1, "{reps:?}");
    assert_eq!(
        (reps[0].1.node.as_str(), reps[0].1.template),
        ("pve2", true)
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn replicas_work_under_a_pool_scoped_token() {
    let sim = sim_with(SimConfig {
        pool_acl: true,
        ..SimConfig::default()
    })
    .await;
    let sub = PveSubstrate::new(client(&sim), opts());
    for i in 0..2 {
        let vm = sub.clone_vm(&req("pve2", i)).await.expect("create on pve2");
        assert_eq!(vm.node, "pve2");
    }
    assert_eq!(sim.call_count(endpoints::MIGRATE), 1);
    assert_eq!(replicas(&sim)[0].1.pool.as_deref(), Some("bigfleet"));
    assert_no_violations(&sim);
    sim.shutdown().await;
}

#[tokio::test]
async fn replicas_work_when_the_cluster_refuses_new_tags() {
    let sim = sim_with(SimConfig {
        tag_access: pve_sim::TagAccess::None,
        ..SimConfig::default()
    })
    .await;
    let sub = PveSubstrate::new(client(&sim), opts());
    sub.clone_vm(&req("pve2", 0)).await.expect("stages");
    // After a restart: found again by its name and marker, untagged.
    let sub = PveSubstrate::new(client(&sim), opts());
    sub.clone_vm(&req("pve2", 1)).await.expect("reuses");
    assert_eq!(sim.call_count(endpoints::MIGRATE), 1);
    let reps = replicas(&sim);
    assert_eq!(reps.len(), 1);
    assert!(reps[0].1.tags.is_none(), "{:?}", reps[0].1.tags);
    sim.shutdown().await;
}

/// Through the `Backend` the engine drives: what becomes `last_error`.
#[tokio::test]
async fn through_the_backend_a_failed_staging_is_the_create_error() {
    use providerkit::{Backend, CreateCtx};

    let sim = sim_with(SimConfig::default()).await;
    // A lock timeout is retried; a storage failure is not.
    sim.faults().fail_next_task(
        "qmtemplate",
        1,
        "can't lock file '/var/lock/qemu-server/lock-100.conf' - got timeout",
    );
    let sub = PveSubstrate::new(client(&sim), opts());
    sub.clone_vm(&req("pve2", 9))
        .await
        .expect("conversion retried");
    assert_eq!(replicas(&sim).len(), 1);
    // The template changes, so the next Create stages a new copy, and fails.
    assert!(sim.update_vm(9000, |vm| vm.description = Some("v2".into())));
    sim.faults().fail_next_task(
        "qmtemplate",
        1,
        "lvrename 'pve/vm-102-disk-0' error: Logical volume is in use",
    );
    let (backend, _) = common::small_backend(
        "proxmox",
        "pve2",
        2,
        &["pve1", "pve2"],
        PveSubstrate::new(client(&sim), opts()),
    );
    let ids: Vec<String> = backend
        .describe()
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    let ctx = |id: &str| CreateCtx {
        machine_id: id.to_string(),
        operation_id: format!("op-{id}"),
        instance_type: "pve.small".into(),
        zone: "pve2".into(),
        resumed: false,
    };
    let e = backend
        .create(ctx(&ids[0]))
        .await
        .expect_err("staging fails");
    let last_error = e.to_string();
    assert!(
        last_error.contains("failed at step 5 of 5, converting VM")
            && last_error.contains("to a template")
            && last_error.contains("Logical volume is in use"),
        "{last_error}"
    );
    // The half-made copy was removed after the failure; the stale one stays
    // (unused) until a successor is staged.
    let left = replicas(&sim);
    assert_eq!(left.len(), 1, "{left:?}");
    assert_ne!(left[0].2 .1, sim.vm(9000).unwrap().digest(), "the old copy");
    let stale = left[0].0;
    let host = backend
        .create(ctx(&ids[1]))
        .await
        .expect("the next Create stages it");
    assert!(host.host_ref.starts_with("pve2/"), "{}", host.host_ref);
    let now = replicas(&sim);
    assert_eq!(now.len(), 1, "{now:?}");
    assert_ne!(now[0].0, stale, "the successor replaced the stale copy");
    sim.shutdown().await;
}
