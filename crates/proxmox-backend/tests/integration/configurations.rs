//! Cluster configurations of real PVE that used to fail every Create or
//! leak VMs, driven through the real substrate against pve-sim, which
//! models them as PVE 8/9 do (see pve-sim's `configurations` tests): protected
//! templates, CD-ROMs on local storage, a node's own storage for a shared
//! template, the migration's disk privilege, a template's backup lock, and
//! lost answers to a replica's migrate and template POSTs.

use std::collections::BTreeMap;
use std::time::Duration;

use provider_testkit::wait::Wait;
use proxmox_backend::proxmox::{parse_replica_marker, PveOptions, PveSubstrate};
use proxmox_backend::substrate::{CloneRequest, Substrate};
use pve_sim::{endpoints, PveSim, SimConfig, StorageKind, StorageSpec, TemplateSpec, Vm};

use crate::common::{self, assert_no_violations, client, sim_with};

fn opts() -> PveOptions {
    common::opts_retrying(
        Duration::from_secs(20),
        Duration::from_secs(20),
        Duration::from_millis(300),
    )
}

fn sim_cfg(templates: Vec<TemplateSpec>) -> SimConfig {
    SimConfig {
        templates,
        ..common::fast_sim(Duration::from_millis(100), Duration::from_millis(50))
    }
}

fn req(template: u32, node: &str, i: usize) -> CloneRequest {
    CloneRequest {
        operation_id: format!("op-{node}-{i}"),
        template_vmid: template,
        ..common::req(&format!("p/OnDemand/pve.small/{node}/{i:03}"), node)
    }
}

fn replicas(sim: &PveSim) -> Vec<(u32, Vm)> {
    sim.vms()
        .into_iter()
        .filter(|(_, vm)| {
            vm.description
                .as_deref()
                .and_then(parse_replica_marker)
                .is_some()
        })
        .collect()
}

async fn preflight(sim: &PveSim, o: PveOptions, templates: &[u32]) -> Result<Vec<String>, String> {
    PveSubstrate::new(client(sim), o)
        .preflight(&["pve1".into(), "pve2".into()], templates)
        .await
        .map_err(|e| e.to_string())
}

#[tokio::test]
async fn a_protected_template_leaks_no_machine_and_no_replica() {
    let sim = sim_with(sim_cfg(vec![TemplateSpec {
        protection: true,
        ..TemplateSpec::local(9000, "pve1")
    }]))
    .await;
    let sub = PveSubstrate::new(client(&sim), opts());
    for node in ["pve1", "pve2"] {
        let r = req(9000, node, 0);
        let vm = sub.clone_vm(&r).await.expect("create");
        assert!(
            !sim.vm(vm.vmid).unwrap().protection,
            "the marker PUT clears protection"
        );
        sub.delete_vm(&vm, &r.machine_id).await.expect("delete");
        assert!(sim.vm(vm.vmid).is_none(), "VM {vm} destroyed");
    }
    let reps = replicas(&sim);
    assert_eq!(reps.len(), 1);
    assert!(!reps[0].1.protection, "the replica can be replaced later");
    assert!(
        sim.vm(9000).unwrap().protection,
        "the template keeps its flag"
    );
    assert_no_violations(&sim);
    sim.shutdown().await;
}

#[tokio::test]
async fn a_protected_clone_from_before_the_fix_is_still_deleted() {
    let sim = sim_with(sim_cfg(vec![TemplateSpec::local(9000, "pve1")])).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let r = req(9000, "pve1", 0);
    let vm = sub.clone_vm(&r).await.expect("create");
    assert!(sim.set_protection(vm.vmid, true));
    sub.delete_vm(&vm, &r.machine_id)
        .await
        .expect("delete clears the copied flag");
    assert!(sim.vm(vm.vmid).is_none());
    // A protected VM that is not ours stays protected and in place.
    let mut foreign = sim.new_vm(4242, "pve1", "someone-elses");
    foreign.protection = true;
    sim.insert_vm(foreign).unwrap();
    let e = sub.delete_vm(&pve_sim_ref(4242), &r.machine_id).await;
    assert!(e.is_ok(), "not ours: nothing to delete ({e:?})");
    assert!(sim.vm(4242).is_some_and(|v| v.protection));
    sim.shutdown().await;
}

fn pve_sim_ref(vmid: u32) -> proxmox_backend::substrate::VmRef {
    proxmox_backend::substrate::VmRef {
        node: "pve1".into(),
        vmid,
    }
}

#[tokio::test]
async fn a_cloud_init_drive_on_local_storage_is_served_through_a_replica() {
    let sim = sim_with(sim_cfg(vec![TemplateSpec {
        cdrom: Some("local-lvm:vm-9001-cloudinit,media=cdrom".into()),
        ..TemplateSpec::shared(9001, "pve1")
    }]))
    .await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let vm = sub
        .clone_vm(&req(9001, "pve2", 0))
        .await
        .expect("through a replica");
    assert_eq!(sim.vm(vm.vmid).unwrap().node, "pve2");
    assert_eq!(
        replicas(&sim).len(),
        1,
        "PVE counts the cloud-init drive: the template is local"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn a_local_iso_on_a_template_that_serves_other_nodes_is_refused_at_start_up() {
    let sim = sim_with(sim_cfg(vec![TemplateSpec {
        cdrom: Some("local:iso/debian-12.iso,media=cdrom".into()),
        ..TemplateSpec::shared(9001, "pve1")
    }]))
    .await;
    let e = preflight(&sim, opts(), &[9001])
        .await
        .expect_err("local ISO");
    assert!(
        e.contains("template 9001's CD-ROM ide2 holds local:iso/debian-12.iso")
            && e.contains("qm set 9001 --ide2 none,media=cdrom"),
        "{e}"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn the_hosts_cdrom_drive_is_refused_at_start_up_without_sys_console() {
    let sim = sim_with(SimConfig {
        dropped_privileges: vec![("/".into(), "Sys.Console".into())],
        ..sim_cfg(vec![TemplateSpec {
            cdrom: Some("cdrom,media=cdrom".into()),
            ..TemplateSpec::local(9000, "pve1")
        }])
    })
    .await;
    let e = preflight(&sim, opts(), &[9000])
        .await
        .expect_err("physical drive");
    assert!(
        e.contains("host's CD-ROM drive (ide2: cdrom)") && e.contains("--ide2 none,media=cdrom"),
        "{e}"
    );
    sim.shutdown().await;
}

fn node_storage(node: &str, storage: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(node.to_string(), storage.to_string())])
}

#[tokio::test]
async fn a_nodes_own_storage_works_with_a_shared_template() {
    let sim = sim_with(sim_cfg(vec![TemplateSpec::shared(9001, "pve1")])).await;
    let o = PveOptions {
        node_storage: node_storage("pve2", "local-lvm"),
        ..opts()
    };
    preflight(&sim, o.clone(), &[9001])
        .await
        .expect("the documented example passes");
    let sub = PveSubstrate::new(client(&sim), o);
    for i in 0..2 {
        let vm = sub
            .clone_vm(&req(9001, "pve2", i))
            .await
            .expect("create on pve2");
        let v = sim.vm(vm.vmid).unwrap();
        assert_eq!((v.node.as_str(), v.storage.as_str()), ("pve2", "local-lvm"));
    }
    let reps = replicas(&sim);
    assert_eq!(
        reps.len(),
        1,
        "one copy of the template on pve2, cloned locally"
    );
    assert_eq!(reps[0].1.node, "pve2");
    assert_eq!(
        reps[0].1.storage, "ceph-pool",
        "the copy stays on the shared storage"
    );
    // On the template's node nothing changes: no copy, no migration.
    sub.clone_vm(&req(9001, "pve1", 0))
        .await
        .expect("create on pve1");
    assert_eq!(sim.call_count(endpoints::MIGRATE), 1);
    assert_no_violations(&sim);
    sim.shutdown().await;
}

#[tokio::test]
async fn a_nodes_own_storage_without_replicas_is_refused_at_start_up() {
    let sim = sim_with(sim_cfg(vec![TemplateSpec::shared(9001, "pve1")])).await;
    let o = PveOptions {
        node_storage: node_storage("pve2", "local-lvm"),
        template_replicas: false,
        ..opts()
    };
    let e = preflight(&sim, o, &[9001]).await.expect_err("cannot work");
    assert!(
        e.contains("--node-storage pve2=local-lvm") && e.contains("--template-replicas"),
        "{e}"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn moving_a_replicas_disks_needs_vm_config_disk_and_the_preflight_says_so() {
    let sim = sim_with(SimConfig {
        dropped_privileges: vec![("/".into(), "VM.Config.Disk".into())],
        ..sim_cfg(vec![TemplateSpec::local(9000, "pve1")])
    })
    .await;
    let o = PveOptions {
        node_storage: node_storage("pve2", "local-lvm"),
        ..opts()
    };
    let e = preflight(&sim, o.clone(), &[9000])
        .await
        .expect_err("VM.Config.Disk");
    assert!(e.contains("VM.Config.Disk"), "{e}");
    // Without the preflight, the staging fails at the migration, named.
    let sub = PveSubstrate::new(client(&sim), o);
    let e = sub
        .clone_vm(&req(9000, "pve2", 0))
        .await
        .expect_err("403")
        .to_string();
    assert!(
        e.contains("step 4 of 5") && e.contains("VM.Config.Disk"),
        "{e}"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn a_storage_type_the_replica_cannot_migrate_to_is_refused_at_start_up() {
    let sim = sim_with(SimConfig {
        storages: vec![
            StorageSpec::new("local", StorageKind::Dir, false, 1 << 20).with_content("images,iso"),
            StorageSpec::new("local-lvm", StorageKind::LvmThin, false, 64 << 10),
            StorageSpec::new("ceph-pool", StorageKind::Rbd, true, 1 << 20),
        ],
        ..sim_cfg(vec![TemplateSpec {
            storage: "local".into(),
            ..TemplateSpec::local(9000, "pve1")
        }])
    })
    .await;
    let o = PveOptions {
        node_storage: node_storage("pve2", "local-lvm"),
        ..opts()
    };
    let e = preflight(&sim, o.clone(), &[9000])
        .await
        .expect_err("dir to lvmthin");
    assert!(
        e.contains("cannot migrate from storage type 'dir' to 'lvmthin'"),
        "{e}"
    );
    // The simulator fails the same migration the same way.
    let sub = PveSubstrate::new(client(&sim), o);
    let e = sub
        .clone_vm(&req(9000, "pve2", 0))
        .await
        .expect_err("migration")
        .to_string();
    assert!(
        e.contains("cannot migrate from storage type 'dir' to 'lvmthin'"),
        "{e}"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn a_backup_of_the_template_costs_no_replica_and_no_create() {
    let sim = sim_with(sim_cfg(vec![TemplateSpec::local(9000, "pve1")])).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    sub.clone_vm(&req(9000, "pve2", 0)).await.expect("stages");
    let before = replicas(&sim);
    assert_eq!(before.len(), 1);
    // vzdump holds `lock: backup` on the template, which changes its digest.
    assert!(sim.set_lock(9000, Some("backup")));
    sub.clone_vm(&req(9000, "pve2", 1))
        .await
        .expect("clones from the copy it has");
    assert_eq!(
        replicas(&sim).iter().map(|r| r.0).collect::<Vec<_>>(),
        vec![before[0].0],
        "kept, not restaged"
    );
    assert!(sim.set_lock(9000, None));
    sub.clone_vm(&req(9000, "pve2", 2))
        .await
        .expect("after the backup");
    assert_eq!(sim.call_count(endpoints::MIGRATE), 1, "never restaged");
    sim.shutdown().await;
}

#[tokio::test]
async fn a_first_staging_waits_out_a_backup_and_records_the_unlocked_digest() {
    let sim = sim_with(sim_cfg(vec![TemplateSpec::local(9000, "pve1")])).await;
    let unlocked = sim.vm(9000).unwrap().digest();
    assert!(sim.set_lock(9000, Some("backup")));
    let sub = std::sync::Arc::new(PveSubstrate::new(client(&sim), opts()));
    let s2 = sub.clone();
    let create = tokio::spawn(async move { s2.clone_vm(&req(9000, "pve2", 0)).await });
    // Await the Create's second look at the locked template (it waits for
    // the lock to go), or its end, then end the backup.
    let template_reads = || {
        sim.requests()
            .iter()
            .filter(|r| {
                r.endpoint.as_deref() == Some(endpoints::CONFIG_GET)
                    && r.path.contains("/qemu/9000/")
            })
            .count()
    };
    Wait::new("the Create to read the template", Duration::from_secs(10))
        .every(Duration::from_millis(10))
        .until(|| template_reads() >= 3 || create.is_finished())
        .await;
    assert!(sim.set_lock(9000, None));
    create.await.unwrap().expect("staged after the backup");
    let reps = replicas(&sim);
    assert_eq!(reps.len(), 1);
    let (_, digest) = parse_replica_marker(reps[0].1.description.as_deref().unwrap()).unwrap();
    assert_eq!(
        digest, unlocked,
        "the copy names the template's own digest, not the backup's"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn a_lost_answer_to_the_replicas_migrate_or_template_post_is_read_not_reposted() {
    for endpoint in [endpoints::MIGRATE, endpoints::TEMPLATE] {
        let sim = sim_with(sim_cfg(vec![TemplateSpec::local(9000, "pve1")])).await;
        sim.faults()
            .fail_after_apply(endpoint, 1, 596, "Connection timed out");
        let sub = PveSubstrate::new(client(&sim), opts());
        let vm = sub
            .clone_vm(&req(9000, "pve2", 0))
            .await
            .unwrap_or_else(|e| panic!("{endpoint}: {e}"));
        assert_eq!(sim.vm(vm.vmid).unwrap().node, "pve2");
        let reps = replicas(&sim);
        assert_eq!(reps.len(), 1, "{endpoint}: {reps:?}");
        assert!(reps[0].1.template && reps[0].1.node == "pve2");
        assert_eq!(sim.call_count(endpoint), 1, "{endpoint}: posted once");
        sim.shutdown().await;
    }
}
