//! Cluster configurations of real PVE that break a naive client, reproduced
//! as PVE 8/9 behave (qemu-server `API2/Qemu.pm` clone_vm and migrate_vm,
//! `QemuMigrate.pm`, pve-guest-common `AbstractConfig.pm`, vzdump): protected
//! templates, CD-ROMs on local storage, a node's own storage for a shared
//! template, migration privileges and a template's backup lock.

use std::time::Duration;

use pve_sim::{SimConfig, TemplateSpec};

use crate::common::{shutdown_clean, start_sim, Api};

fn cfg(templates: Vec<TemplateSpec>) -> SimConfig {
    SimConfig {
        templates,
        clone_duration: Duration::from_millis(50),
        migrate_duration: Duration::from_millis(20),
        ..SimConfig::default()
    }
}

/// Clones `vmid` on pve1 as `newid` with `extra` params; the task's status.
async fn clone(
    api: &Api,
    vmid: u32,
    newid: u32,
    extra: &[(&str, &str)],
) -> Result<serde_json::Value, String> {
    let newid = newid.to_string();
    let mut form = vec![("newid", newid.as_str()), ("full", "1")];
    form.extend_from_slice(extra);
    let r = api
        .post(&format!("/nodes/pve1/qemu/{vmid}/clone"), &form)
        .await;
    if r.status != 200 {
        return Err(format!("{} {}", r.status, r.message()));
    }
    Ok(api.wait_task(r.data().as_str().expect("upid")).await)
}

#[tokio::test]
async fn a_protected_template_makes_protected_clones_that_refuse_destroy() {
    let (sim, api) = start_sim(cfg(vec![TemplateSpec {
        protection: true,
        ..TemplateSpec::local(9000, "pve1")
    }]))
    .await;
    let done = clone(&api, 9000, 200, &[]).await.expect("clone");
    assert_eq!(done["exitstatus"], "OK");
    assert!(
        sim.vm(200).expect("clone").protection,
        "PVE copies protection"
    );
    let r = api.delete("/nodes/pve1/qemu/200", &[]).await;
    assert_eq!(r.status, 500);
    assert!(
        r.message()
            .contains("can't remove VM 200 - protection mode enabled"),
        "{}",
        r.message()
    );
    let r = api
        .put("/nodes/pve1/qemu/200/config", &[("delete", "protection")])
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let r = api.delete("/nodes/pve1/qemu/200", &[]).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    shutdown_clean(sim).await;
}

#[tokio::test]
async fn a_cdrom_on_local_storage_makes_a_shared_template_local() {
    let iso = TemplateSpec {
        cdrom: Some("local:iso/debian-12.iso,media=cdrom".into()),
        ..TemplateSpec::shared(9001, "pve1")
    };
    let cloudinit = TemplateSpec {
        cdrom: Some("local-lvm:vm-9002-cloudinit,media=cdrom".into()),
        ..TemplateSpec::shared(9002, "pve1")
    };
    let empty = TemplateSpec {
        cdrom: Some("none,media=cdrom".into()),
        ..TemplateSpec::shared(9003, "pve1")
    };
    let (sim, api) = start_sim(cfg(vec![iso, cloudinit, empty])).await;
    for t in [9001, 9002] {
        let e = clone(&api, t, 300 + t - 9000, &[("target", "pve2")])
            .await
            .expect_err("local cdrom");
        assert!(
            e.contains("can't clone VM to node 'pve2' (VM uses local storage)"),
            "{t}: {e}"
        );
    }
    let done = clone(&api, 9003, 303, &[("target", "pve2")])
        .await
        .expect("an empty drive does not count");
    assert_eq!(done["exitstatus"], "OK");
    assert_eq!(sim.vm(303).expect("clone").node, "pve2");

    // The clone keeps the ISO; an offline migration of it fails in the task.
    let done = clone(&api, 9001, 310, &[]).await.expect("same-node clone");
    assert_eq!(done["exitstatus"], "OK");
    assert!(sim
        .vm(310)
        .unwrap()
        .extra
        .get("ide2")
        .is_some_and(|v| v.contains("iso/debian-12.iso")));
    let r = api
        .post("/nodes/pve1/qemu/310/migrate", &[("target", "pve2")])
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let st = api.wait_task(r.data().as_str().unwrap()).await;
    assert_eq!(st["exitstatus"], "migration aborted");
    let upid = r.data().as_str().unwrap();
    let log = api.task_log_text(upid).await;
    assert!(log.contains("local cdrom image"), "{log}");
    assert_eq!(sim.vm(310).unwrap().node, "pve1");
    shutdown_clean(sim).await;
}

#[tokio::test]
async fn the_hosts_cdrom_drive_needs_sys_console() {
    let (sim, api) = start_sim(SimConfig {
        dropped_privileges: vec![("/".into(), "Sys.Console".into())],
        ..cfg(vec![TemplateSpec {
            cdrom: Some("cdrom,media=cdrom".into()),
            ..TemplateSpec::local(9000, "pve1")
        }])
    })
    .await;
    let e = clone(&api, 9000, 200, &[])
        .await
        .expect_err("needs Sys.Console");
    assert!(
        e.starts_with("403") && e.contains("(/, Sys.Console)"),
        "{e}"
    );
    shutdown_clean(sim).await;
}

#[tokio::test]
async fn a_nodes_own_storage_cannot_be_the_target_of_a_cross_node_clone() {
    let (sim, api) = start_sim(cfg(vec![TemplateSpec::shared(9001, "pve1")])).await;
    let e = clone(
        &api,
        9001,
        200,
        &[("target", "pve2"), ("storage", "local-lvm")],
    )
    .await
    .expect_err("non-shared storage with target");
    assert!(
        e.contains("can't clone to non-shared storage 'local-lvm'"),
        "{e}"
    );
    // On the template's own node the same storage is fine.
    let done = clone(&api, 9001, 201, &[("storage", "local-lvm")])
        .await
        .expect("local clone");
    assert_eq!(done["exitstatus"], "OK");
    assert_eq!(sim.vm(201).unwrap().storage, "local-lvm");
    shutdown_clean(sim).await;
}

#[tokio::test]
async fn migrating_to_another_storage_needs_vm_config_disk_and_room_rights() {
    let (sim, api) = start_sim(SimConfig {
        dropped_privileges: vec![("/vms".into(), "VM.Config.Disk".into())],
        ..cfg(vec![TemplateSpec::local(9000, "pve1")])
    })
    .await;
    clone(&api, 9000, 200, &[]).await.expect("clone");
    let r = api
        .post(
            "/nodes/pve1/qemu/200/migrate",
            &[
                ("target", "pve2"),
                ("targetstorage", "local-lvm"),
                ("with-local-disks", "1"),
            ],
        )
        .await;
    assert_eq!(r.status, 403, "{:?}", r.body);
    assert!(
        r.message().contains("(/vms/200, VM.Config.Disk)"),
        "{}",
        r.message()
    );
    // Without `targetstorage` the same migration needs no disk right.
    let r = api
        .post(
            "/nodes/pve1/qemu/200/migrate",
            &[("target", "pve2"), ("with-local-disks", "1")],
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(
        api.wait_task(r.data().as_str().unwrap()).await["exitstatus"],
        "OK"
    );
    shutdown_clean(sim).await;
}

#[tokio::test]
async fn a_backup_locks_the_template_and_changes_its_digest() {
    let (sim, api) = start_sim(cfg(vec![TemplateSpec::local(9000, "pve1")])).await;
    let before = sim.vm(9000).unwrap().digest();
    assert!(sim.set_lock(9000, Some("backup")));
    let during = sim.vm(9000).unwrap().digest();
    assert_ne!(before, during, "the lock line is part of the digest");
    let e = clone(&api, 9000, 200, &[]).await.expect_err("locked");
    assert!(e.contains("VM 9000 is locked (backup)"), "{e}");
    assert!(sim.set_lock(9000, None));
    assert_eq!(
        sim.vm(9000).unwrap().digest(),
        before,
        "the digest comes back"
    );
    clone(&api, 9000, 200, &[]).await.expect("unlocked");
    shutdown_clean(sim).await;
}
