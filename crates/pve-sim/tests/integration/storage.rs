//! Storage placement as PVE enforces it: capacity, linked-clone rules, the
//! `storage` clone parameter, offline migration with local disks.

use std::time::Duration;

use pve_sim::{SimConfig, StorageKind, StorageSpec, TemplateSpec};

use crate::common::{shutdown_clean, start_sim, urlencode, Api};

fn cfg() -> SimConfig {
    let mut thick = TemplateSpec::local(9002, "pve1");
    thick.storage = "thick".into();
    SimConfig {
        templates: vec![
            TemplateSpec::local(9000, "pve1"),
            TemplateSpec::shared(9001, "pve1"),
            thick,
        ],
        storages: vec![
            StorageSpec::new("local", StorageKind::Dir, false, 100).with_content("iso,backup"),
            StorageSpec::new("local-lvm", StorageKind::LvmThin, false, 100),
            StorageSpec::new("thick", StorageKind::Lvm, false, 100),
            StorageSpec::new("ceph-pool", StorageKind::Rbd, true, 1000),
        ],
        clone_duration: Duration::from_millis(50),
        migrate_duration: Duration::from_millis(50),
        rrd_lag: Duration::ZERO,
        ..SimConfig::default()
    }
}

async fn task_of(api: &Api, path: &str, form: &[(&str, &str)]) -> serde_json::Value {
    let r = api.post(path, form).await;
    assert_eq!(r.status, 200, "{path} {form:?}: {:?}", r.message());
    api.wait_task(r.data().as_str().expect("upid")).await
}

#[tokio::test]
async fn capacity_is_reported_and_enforced() {
    let (sim, api) = start_sim(cfg()).await;
    let st = api.get("/nodes/pve1/storage/local-lvm/status", &[]).await;
    assert_eq!(st.data()["type"], "lvmthin");
    assert_eq!(st.data()["total"], 100u64 << 30);
    assert_eq!(st.data()["used"], 32u64 << 30, "template 9000's 32G disk");
    // Local storage is per node: pve2's is empty.
    let st = api.get("/nodes/pve2/storage/local-lvm/status", &[]).await;
    assert_eq!(st.data()["used"], 0);
    assert_eq!(st.data()["avail"], 100u64 << 30);
    let cfg = api.get("/nodes/pve1/qemu/9000/config", &[]).await;
    assert_eq!(cfg.data()["scsi0"], "local-lvm:base-9000-disk-0,size=32G");

    // 32G + 32G + 32G fit in 100G; a fourth full clone does not.
    for id in ["101", "102"] {
        let t = task_of(
            &api,
            "/nodes/pve1/qemu/9000/clone",
            &[("newid", id), ("full", "1")],
        )
        .await;
        assert_eq!(t["exitstatus"], "OK");
    }
    let t = task_of(
        &api,
        "/nodes/pve1/qemu/9000/clone",
        &[("newid", "103"), ("full", "1")],
    )
    .await;
    assert_eq!(
        t["exitstatus"],
        "clone failed: lvcreate 'pve/vm-103-disk-0' error:   Volume group \"pve\" has insufficient free space (1024 extents): 8192 required."
    );
    assert!(sim.vm(103).is_none(), "the failed clone is cleaned up");
    // A linked clone takes no room of its own.
    let t = task_of(&api, "/nodes/pve1/qemu/9000/clone", &[("newid", "104")]).await;
    assert_eq!(t["exitstatus"], "OK");
    assert_eq!(
        sim.vm(104).unwrap().disk(),
        "local-lvm:base-9000-disk-0/vm-104-disk-0,size=32G"
    );
    // ...and keeps its base: the template cannot be destroyed under it.
    let r = api.delete("/nodes/pve1/qemu/9000", &[]).await;
    let t = api.wait_task(r.data().as_str().unwrap()).await;
    assert_eq!(
        t["exitstatus"],
        "base volume 'local-lvm:base-9000-disk-0' is still in use by linked cloned"
    );
    assert!(sim.vm(9000).is_some());

    // Offline migration copies the local disk: pve2 has room, so it moves...
    let t = task_of(
        &api,
        "/nodes/pve1/qemu/101/migrate",
        &[("target", "pve2"), ("online", "0")],
    )
    .await;
    assert_eq!(t["exitstatus"], "OK");
    let vm = sim.vm(101).unwrap();
    assert_eq!(
        (vm.node.as_str(), vm.storage.as_str()),
        ("pve2", "local-lvm")
    );
    let st = api.get("/nodes/pve2/storage/local-lvm/status", &[]).await;
    assert_eq!(st.data()["used"], 32u64 << 30);
    // ...with `targetstorage`, onto another storage of the target node.
    let t = task_of(
        &api,
        "/nodes/pve2/qemu/101/migrate",
        &[("target", "pve1"), ("targetstorage", "thick")],
    )
    .await;
    assert_eq!(t["exitstatus"], "OK");
    assert_eq!(sim.vm(101).unwrap().storage, "thick");
    // A target storage without room aborts it and leaves the VM in place.
    sim.update_vm(102, |vm| vm.disk_gib = 101);
    let r = api
        .post(
            "/nodes/pve1/qemu/102/migrate",
            &[("target", "pve2"), ("with-local-disks", "1")],
        )
        .await;
    let upid = r.data().as_str().unwrap().to_string();
    assert_eq!(
        api.wait_task(&upid).await["exitstatus"],
        "migration aborted"
    );
    let log = api
        .get(&format!("/nodes/pve1/tasks/{}/log", urlencode(&upid)), &[])
        .await;
    let text: Vec<String> = log
        .data()
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["t"].as_str().unwrap_or_default().to_string())
        .collect();
    assert!(
        text.iter().any(|l| l.contains(
            "storage migration for 'local-lvm:vm-102-disk-0' to storage 'local-lvm' failed - lvcreate"
        )),
        "{text:?}"
    );
    let vm = sim.vm(102).unwrap();
    assert_eq!((vm.node.as_str(), vm.lock.as_deref()), ("pve1", None));
    let r = api
        .post(
            "/nodes/pve1/qemu/102/migrate",
            &[("target", "pve2"), ("targetstorage", "nosuch")],
        )
        .await;
    assert_eq!(r.message(), "storage 'nosuch' does not exist");
    shutdown_clean(sim).await;
}

#[tokio::test]
async fn linked_clones_and_the_storage_parameter_follow_pve() {
    let (sim, api) = start_sim(cfg()).await;
    let clone = |tmpl: &str| format!("/nodes/pve1/qemu/{tmpl}/clone");
    let linked_refused = "Linked clone feature is not supported for drive 'scsi0'";
    // Thick LVM cannot snapshot: no linked clone, but a full one works.
    let r = api
        .post(&clone("9002"), &[("newid", "200"), ("full", "0")])
        .await;
    assert_eq!((r.status, r.message().as_str()), (500, linked_refused));
    let r = api.post(&clone("9002"), &[("newid", "200")]).await;
    assert_eq!(r.message(), linked_refused, "templates default to linked");
    let t = task_of(&api, &clone("9002"), &[("newid", "200"), ("full", "1")]).await;
    assert_eq!(t["exitstatus"], "OK");
    // A VM that is not a template has no base volume to link to.
    let r = api
        .post(&clone("200"), &[("newid", "201"), ("full", "0")])
        .await;
    assert_eq!(r.message(), linked_refused);
    // `storage` is for full clones, must exist, and must be shared for another node.
    let r = api
        .post(
            &clone("9000"),
            &[("newid", "202"), ("full", "0"), ("storage", "thick")],
        )
        .await;
    assert_eq!(
        r.message(),
        "parameter 'storage' not allowed for linked clones"
    );
    let r = api
        .post(
            &clone("9000"),
            &[("newid", "202"), ("full", "1"), ("storage", "nosuch")],
        )
        .await;
    assert_eq!(r.message(), "storage 'nosuch' does not exist");
    let r = api
        .post(
            &clone("9001"),
            &[
                ("newid", "202"),
                ("full", "1"),
                ("storage", "local-lvm"),
                ("target", "pve2"),
            ],
        )
        .await;
    assert_eq!(r.message(), "can't clone to non-shared storage 'local-lvm'");
    let r = api
        .post(
            &clone("9000"),
            &[("newid", "202"), ("target", "pve2"), ("full", "1")],
        )
        .await;
    assert_eq!(
        r.message(),
        "can't clone VM to node 'pve2' (VM uses local storage)"
    );
    let t = task_of(
        &api,
        &clone("9000"),
        &[("newid", "202"), ("full", "1"), ("storage", "thick")],
    )
    .await;
    assert_eq!(t["exitstatus"], "OK");
    assert_eq!(sim.vm(202).unwrap().disk(), "thick:vm-202-disk-0,size=32G");
    // A linked clone across nodes from shared storage is allowed.
    let t = task_of(
        &api,
        &clone("9001"),
        &[("newid", "203"), ("target", "pve2")],
    )
    .await;
    assert_eq!(t["exitstatus"], "OK");
    let vm = sim.vm(203).unwrap();
    assert_eq!((vm.node.as_str(), vm.linked_base), ("pve2", Some(9001)));
    shutdown_clean(sim).await;
}
