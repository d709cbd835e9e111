//! What real PVE 8 and 9 do where an earlier simulator was kinder, from a
//! reading of PVE's own sources (qemu-server, pve-manager, pve-storage,
//! pve-access-control): each test pins one behaviour the provider must
//! cope with.

use std::time::Duration;

use pve_sim::{SimConfig, StorageKind, StorageSpec};
use serde_json::json;

use crate::common::{shutdown_clean, start_sim, urlencode};

fn fast() -> SimConfig {
    SimConfig {
        clone_duration: Duration::from_millis(100),
        rrd_lag: Duration::ZERO,
        ..SimConfig::default()
    }
}

#[tokio::test]
async fn unknown_task_is_a_parameter_error_on_upid() {
    let (sim, api) = start_sim(fast()).await;
    let upid = "UPID:pve1:00001234:00005678:65000000:qmclone:9000:root@pam:";
    for rest in ["status", "log"] {
        let r = api
            .get(
                &format!("/nodes/pve1/tasks/{}/{rest}", urlencode(upid)),
                &[],
            )
            .await;
        assert_eq!(r.status, 400, "{rest}: {:?}", r.body);
        assert_eq!(r.message(), "Parameter verification failed.");
        assert_eq!(r.body["errors"]["upid"], "no such task", "{rest}");
    }
    shutdown_clean(sim).await;
}

#[tokio::test]
async fn a_locked_vms_delete_fails_inside_its_task() {
    let (sim, api) = start_sim(fast()).await;
    sim.insert_vm(sim.new_vm(500, "pve1", "locked")).unwrap();
    assert!(sim.set_lock(500, Some("backup")));
    let r = api
        .delete(
            "/nodes/pve1/qemu/500",
            &[("purge", "1"), ("destroy-unreferenced-disks", "1")],
        )
        .await;
    let task = api.wait_task_of(r).await;
    assert_eq!(task["exitstatus"], "VM is locked (backup)", "no VMID in it");
    assert!(sim.vm(500).is_some(), "nothing was destroyed");
    assert!(sim.set_lock(500, None));
    let r = api.delete("/nodes/pve1/qemu/500", &[("purge", "1")]).await;
    assert_eq!(api.wait_task_of(r).await["exitstatus"], "OK");
    assert!(sim.vm(500).is_none());
    shutdown_clean(sim).await;
}

#[tokio::test]
async fn storage_status_of_unknown_disabled_and_inactive_storages() {
    let (sim, api) = start_sim(SimConfig {
        storages: vec![
            StorageSpec::new("local-lvm", StorageKind::LvmThin, false, 100),
            StorageSpec::new("fast", StorageKind::LvmThin, false, 100),
            StorageSpec::new("nas", StorageKind::Nfs, true, 100),
        ],
        storages_disabled: vec![("pve1".into(), "fast".into())],
        storages_offline: vec![("pve1".into(), "nas".into())],
        ..fast()
    })
    .await;
    let r = api.get("/nodes/pve1/storage/nosuch/status", &[]).await;
    assert_eq!(
        (r.status, r.message().as_str()),
        (400, "Parameter verification failed.")
    );
    assert_eq!(r.body["errors"]["storage"], "No such storage.");
    for (storage, enabled) in [("fast", 0), ("nas", 1)] {
        let r = api
            .get(&format!("/nodes/pve1/storage/{storage}/status"), &[])
            .await;
        assert_eq!(r.status, 200, "{storage}: {:?}", r.body);
        let d = r.data();
        assert_eq!(
            (&d["enabled"], &d["active"], &d["avail"], &d["total"]),
            (&json!(enabled), &json!(0), &json!(0), &json!(0)),
            "{storage}: {d}"
        );
    }
    // Every storage of storage.cfg is in the node's list.
    let listed = api.get("/nodes/pve1/storage", &[]).await;
    let names: Vec<&str> = listed
        .data()
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["storage"].as_str())
        .collect();
    for s in ["local-lvm", "fast", "nas"] {
        assert!(names.contains(&s), "{s} in {names:?}");
    }
    // pve2 has both, usable.
    let r = api.get("/nodes/pve2/storage/fast/status", &[]).await;
    assert_eq!(
        (&r.data()["enabled"], &r.data()["active"]),
        (&json!(1), &json!(1))
    );
    // Allocating on them fails the way pve-storage says.
    let clone = |storage: &'static str, newid: &'static str| {
        let api = &api;
        async move {
            api.post(
                "/nodes/pve1/qemu/9000/clone",
                &[("newid", newid), ("full", "1"), ("storage", storage)],
            )
            .await
        }
    };
    // qemu-server `clone_vm` runs `storage_check_enabled` among its early
    // checks, before it forks the worker: the POST itself fails.
    let r = clone("fast", "300").await;
    assert_eq!(
        (r.status, r.message().as_str()),
        (500, "storage 'fast' is not available on node 'pve1'")
    );
    assert!(sim.vm(300).is_none());
    sim.set_storage_online("pve1", "nas", true);
    let r = api.get("/nodes/pve1/storage/nas/status", &[]).await;
    assert_eq!(r.data()["active"], 1, "back online");
    shutdown_clean(sim).await;
}

#[tokio::test]
async fn destroy_with_unreferenced_disks_dies_on_an_offline_storage() {
    let (sim, api) = start_sim(SimConfig {
        storages: vec![
            StorageSpec::new("local-lvm", StorageKind::LvmThin, false, 100),
            StorageSpec::new("nas", StorageKind::Nfs, true, 100),
        ],
        ..fast()
    })
    .await;
    sim.insert_vm(sim.new_vm(500, "pve1", "doomed")).unwrap();
    sim.set_storage_online("pve1", "nas", false);
    let r = api
        .delete(
            "/nodes/pve1/qemu/500",
            &[("purge", "1"), ("destroy-unreferenced-disks", "1")],
        )
        .await;
    let t = api.wait_task_of(r).await;
    assert_eq!(t["exitstatus"], "storage 'nas' is not online");
    let left = sim.vm(500).expect("the config is left");
    assert_eq!(left.allocated_bytes(), 0, "its own disks were freed");
    // Without the flag no other storage is touched.
    let r = api.delete("/nodes/pve1/qemu/500", &[("purge", "1")]).await;
    assert_eq!(api.wait_task_of(r).await["exitstatus"], "OK");
    assert!(sim.vm(500).is_none());
    shutdown_clean(sim).await;
}

#[tokio::test]
async fn a_clone_to_an_offline_node_is_accepted() {
    let (sim, api) = start_sim(SimConfig {
        templates: vec![pve_sim::TemplateSpec::shared(9000, "pve1")],
        ..fast()
    })
    .await;
    assert!(sim.set_node_online("pve2", false));
    let r = api
        .post(
            "/nodes/pve1/qemu/9000/clone",
            &[("newid", "300"), ("target", "pve2")],
        )
        .await;
    assert_eq!(api.wait_task_of(r).await["exitstatus"], "OK");
    assert_eq!(
        sim.vm(300).expect("cloned").node,
        "pve2",
        "its config is there"
    );
    let r = api.get("/nodes/pve2/qemu/300/status/current", &[]).await;
    assert_eq!(r.status, 595, "and nothing can reach it");
    shutdown_clean(sim).await;
}

#[tokio::test]
async fn cluster_options_hide_user_tag_access_without_sys_audit() {
    let restricted = || SimConfig {
        tag_access: pve_sim::TagAccess::Existing(vec![]),
        ..fast()
    };
    let (sim, api) = start_sim(restricted()).await;
    let r = api.get("/cluster/options", &[]).await;
    assert_eq!(r.data()["user-tag-access"]["user-allow"], "existing");
    shutdown_clean(sim).await;
    let (sim, api) = start_sim(SimConfig {
        dropped_privileges: vec![("/".into(), "Sys.Audit".into())],
        ..restricted()
    })
    .await;
    let r = api.get("/cluster/options", &[]).await;
    assert_eq!(r.status, 200);
    assert!(
        r.data().get("user-tag-access").is_none(),
        "hidden: {}",
        r.data()
    );
    shutdown_clean(sim).await;
}

#[tokio::test]
async fn exec_output_comes_back_one_character_per_byte() {
    let (sim, api) = start_sim(fast()).await;
    sim.insert_vm(sim.new_vm(500, "pve1", "guest")).unwrap();
    let r = api.post("/nodes/pve1/qemu/500/status/start", &[]).await;
    assert_eq!(api.wait_task_of(r).await["exitstatus"], "OK");
    sim.on_guest_command(
        "say-it",
        pve_sim::GuestOutput::exit(0)
            .with_stdout("grün €\n")
            .with_stderr("ö"),
    );
    let done = api
        .poll(
            "the agent answers",
            reqwest::Method::POST,
            "/nodes/pve1/qemu/500/agent/ping",
            |r| r.status == 200,
        )
        .await;
    assert_eq!(done.status, 200);
    let st = api.run(500, &["/bin/say-it"]).await;
    // PVE puts the decoded bytes into the JSON as they are: UTF-8 output
    // arrives as one character per byte.
    assert_eq!(st["out-data"], "gr\u{c3}\u{bc}n \u{e2}\u{82}\u{ac}\n");
    assert_eq!(st["err-data"], "\u{c3}\u{b6}");
    shutdown_clean(sim).await;
}

#[tokio::test]
async fn clone_and_migrate_need_allocate_space_on_the_storage_they_fill() {
    let (sim, api) = start_sim(SimConfig {
        storages: vec![
            StorageSpec::new("local-lvm", StorageKind::LvmThin, false, 100),
            StorageSpec::new("big", StorageKind::LvmThin, false, 100),
        ],
        dropped_privileges: vec![("/storage/big".into(), "Datastore.AllocateSpace".into())],
        ..fast()
    })
    .await;
    let clone = "/nodes/pve1/qemu/9000/clone";
    let r = api
        .post(
            clone,
            &[("newid", "300"), ("full", "1"), ("storage", "big")],
        )
        .await;
    assert_eq!(
        (r.status, r.message().as_str()),
        (
            403,
            "Permission check failed (/storage/big, Datastore.AllocateSpace)"
        )
    );
    // Without `storage`, the template's disk storage is the one checked.
    let r = api.post(clone, &[("newid", "300"), ("full", "1")]).await;
    assert_eq!(api.wait_task_of(r).await["exitstatus"], "OK");
    let r = api
        .post(
            "/nodes/pve1/qemu/300/migrate",
            &[("target", "pve2"), ("targetstorage", "big")],
        )
        .await;
    assert_eq!(
        (r.status, r.message().as_str()),
        (
            403,
            "Permission check failed (/storage/big, Datastore.AllocateSpace)"
        )
    );
    shutdown_clean(sim).await;
}

#[tokio::test]
async fn sdn_use_is_checked_on_the_vlan_and_the_vnets_zone() {
    let (sim, api) = start_sim(SimConfig {
        sdn_vnets: vec![("vnet7".into(), "zonea".into())],
        dropped_privileges: vec![
            ("/sdn/zones/localnetwork/vmbr0/20".into(), "SDN.Use".into()),
            ("/sdn/zones/zonea/vnet7".into(), "SDN.Use".into()),
        ],
        ..fast()
    })
    .await;
    let clone = "/nodes/pve1/qemu/9000/clone";
    let set_net0 = |net0: &str| {
        let net0 = net0.to_string();
        assert!(sim.update_vm(9000, move |vm| {
            vm.extra.insert("net0".into(), net0);
        }));
    };
    let refused = |path: &str| (403, format!("Permission check failed ({path}, SDN.Use)"));
    set_net0("virtio=BC:24:11:00:23:28,bridge=vmbr0,tag=20");
    let r = api.post(clone, &[("newid", "300")]).await;
    assert_eq!(
        (r.status, r.message()),
        refused("/sdn/zones/localnetwork/vmbr0/20")
    );
    set_net0("virtio=BC:24:11:00:23:28,bridge=vnet7");
    let r = api.post(clone, &[("newid", "300")]).await;
    assert_eq!((r.status, r.message()), refused("/sdn/zones/zonea/vnet7"));
    // Another VLAN of the same bridge is allowed.
    set_net0("virtio=BC:24:11:00:23:28,bridge=vmbr0,tag=30");
    let r = api.post(clone, &[("newid", "300")]).await;
    assert_eq!(api.wait_task_of(r).await["exitstatus"], "OK");
    shutdown_clean(sim).await;
}

#[tokio::test]
async fn sdn_use_is_checked_on_each_vlan_of_a_trunk() {
    // pve-guest-common check_vnet_access: with `trunks` (and a `tag`) every
    // VLAN's own path is checked, never the bridge's.
    let (sim, api) = start_sim(SimConfig {
        sdn_vnets: vec![("vnet7".into(), "zonea".into())],
        dropped_privileges: vec![
            ("/sdn/zones/zonea/vnet7".into(), "SDN.Use".into()),
            ("/sdn/zones/localnetwork/vmbr0".into(), "SDN.Use".into()),
        ],
        granted_privileges: ["10", "20", "21", "22"]
            .iter()
            .map(|v| (format!("/sdn/zones/zonea/vnet7/{v}"), "SDN.Use".into()))
            .chain([("/sdn/zones/localnetwork/vmbr0/5".into(), "SDN.Use".into())])
            .collect(),
        ..fast()
    })
    .await;
    let clone = "/nodes/pve1/qemu/9000/clone";
    let set_net0 = |net0: &str| {
        let net0 = net0.to_string();
        assert!(sim.update_vm(9000, move |vm| {
            vm.extra.insert("net0".into(), net0);
        }));
    };
    let refused = |path: &str| (403, format!("Permission check failed ({path}, SDN.Use)"));
    // Every VLAN of the trunk is granted: allowed without the bridge's grant.
    set_net0("virtio=BC:24:11:00:23:28,bridge=vnet7,trunks=10;20-22");
    let r = api.post(clone, &[("newid", "300")]).await;
    assert_eq!(api.wait_task_of(r).await["exitstatus"], "OK");
    // One VLAN of a range is not.
    set_net0("virtio=BC:24:11:00:23:28,bridge=vnet7,trunks=10;20-23");
    let r = api.post(clone, &[("newid", "301")]).await;
    assert_eq!(
        (r.status, r.message()),
        refused("/sdn/zones/zonea/vnet7/23")
    );
    // A tag and trunks: both are checked.
    set_net0("virtio=BC:24:11:00:23:28,bridge=vmbr0,tag=5,trunks=6");
    let r = api.post(clone, &[("newid", "301")]).await;
    assert_eq!(
        (r.status, r.message()),
        refused("/sdn/zones/localnetwork/vmbr0/6")
    );
    set_net0("virtio=BC:24:11:00:23:28,bridge=vmbr0,tag=5,trunks=5");
    let r = api.post(clone, &[("newid", "301")]).await;
    assert_eq!(api.wait_task_of(r).await["exitstatus"], "OK");
    shutdown_clean(sim).await;
}

#[tokio::test]
async fn the_vnet_index_lists_only_what_the_token_may_audit() {
    // pve-network API2/Network/SDN/Vnets.pm: open to every user, filtered by
    // SDN.Audit or SDN.Allocate on /sdn/zones/<zone>/<vnet>.
    let (sim, api) = start_sim(SimConfig {
        sdn_vnets: vec![
            ("vnet9".into(), "zoneb".into()),
            ("vnet7".into(), "zonea".into()),
            ("hidden".into(), "zonea".into()),
        ],
        dropped_privileges: vec![
            ("/sdn/zones/zonea/hidden".into(), "SDN.Audit".into()),
            ("/sdn/zones/zonea/hidden".into(), "SDN.Allocate".into()),
            ("/sdn/zones/zoneb".into(), "SDN.Audit".into()),
        ],
        ..fast()
    })
    .await;
    let r = api.get("/cluster/sdn/vnets", &[]).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let rows = r.data().as_array().expect("a list").clone();
    let names: Vec<(&str, &str, &str)> = rows
        .iter()
        .map(|v| {
            (
                v["vnet"].as_str().unwrap_or_default(),
                v["zone"].as_str().unwrap_or_default(),
                v["type"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    // vnet9 stays: SDN.Allocate alone lets it be listed.
    assert_eq!(
        names,
        vec![("vnet7", "zonea", "vnet"), ("vnet9", "zoneb", "vnet")]
    );
    assert!(rows
        .iter()
        .all(|v| v["digest"].as_str().is_some_and(|d| d.len() == 40)));
    // Neither privilege anywhere: an empty list, not a 403.
    let (sim2, api2) = start_sim(SimConfig {
        sdn_vnets: vec![("vnet7".into(), "zonea".into())],
        dropped_privileges: vec![("/".into(), "*".into())],
        granted_privileges: vec![("/sdn/zones/zonea/vnet7".into(), "SDN.Use".into())],
        ..fast()
    })
    .await;
    let r = api2.get("/cluster/sdn/vnets", &[("running", "1")]).await;
    assert_eq!((r.status, r.data().clone()), (200, json!([])));
    shutdown_clean(sim2).await;
    shutdown_clean(sim).await;
}

#[tokio::test]
async fn without_sdn_the_vnet_index_is_not_implemented_and_every_bridge_is_local() {
    // pve-manager API2/Cluster.pm registers `sdn` only when pve-network
    // loads; pve-guest-common then checks every bridge in localnetwork.
    let (sim, api) = start_sim(SimConfig {
        sdn_installed: false,
        sdn_vnets: vec![("vnet7".into(), "zonea".into())],
        dropped_privileges: vec![("/sdn/zones/localnetwork/vnet7".into(), "SDN.Use".into())],
        ..fast()
    })
    .await;
    let r = api.get("/cluster/sdn/vnets", &[]).await;
    assert_eq!(
        (r.status, r.message()),
        (
            501,
            "Method 'GET /cluster/sdn/vnets' not implemented".to_string()
        )
    );
    assert!(sim.update_vm(9000, |vm| {
        vm.extra.insert(
            "net0".into(),
            "virtio=BC:24:11:00:23:28,bridge=vnet7".into(),
        );
    }));
    let r = api
        .post("/nodes/pve1/qemu/9000/clone", &[("newid", "300")])
        .await;
    assert_eq!(
        (r.status, r.message()),
        (
            403,
            "Permission check failed (/sdn/zones/localnetwork/vnet7, SDN.Use)".to_string()
        )
    );
    shutdown_clean(sim).await;
}

/// qemu-server asks the agent for a `guest-ping` with a 3 s timeout before
/// every agent request (`qga_check_running`), and QEMU hands the socket's
/// bytes to the guest only once qemu-ga has opened its port: a request made
/// while the guest boots waits, and is answered when the agent comes up
/// within the window, or refused once the window has passed.
#[tokio::test]
async fn an_agent_request_during_boot_waits_for_the_agent() {
    use std::time::Instant;
    let boot = Duration::from_millis(1500);
    let window = Duration::from_millis(1000);
    let (sim, api) = start_sim(SimConfig {
        agent_boot_delay: boot,
        agent_ping_wait: window,
        ..fast()
    })
    .await;
    sim.insert_vm(sim.new_vm(500, "pve1", "guest")).unwrap();
    let r = api.post("/nodes/pve1/qemu/500/status/start", &[]).await;
    let started = Instant::now();
    assert_eq!(api.wait_task_of(r).await["exitstatus"], "OK");
    let ping = "/nodes/pve1/qemu/500/agent/ping";

    // The boot ends beyond the window: refused once the window has passed.
    let sent = Instant::now();
    let r = api.post(ping, &[]).await;
    assert_eq!(
        (r.status, r.message().as_str()),
        (500, "QEMU guest agent is not running")
    );
    assert!(
        sent.elapsed() >= window,
        "refused after {:?}",
        sent.elapsed()
    );
    let waited = sim.agent_waits()["pve1"];
    assert_eq!((waited.requests, waited.peak, waited.now), (1, 1, 0));
    assert!(waited.total >= window, "{waited:?}");

    // The boot ends within the window: answered then, not at its end.
    let sent = Instant::now();
    let r = api.post(ping, &[]).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert!(started.elapsed() >= boot, "answered before the boot ended");
    assert!(
        sent.elapsed() < window,
        "answered at the window's end, not when the agent came up: {:?}",
        sent.elapsed()
    );

    assert_eq!(sim.agent_waits()["pve1"].requests, 2);

    // The VM stops while a request waits for its boot: that boot's agent
    // is gone, and the request is refused, not answered.
    assert!(sim.stop_vm_out_of_band(500) && sim.start_vm_out_of_band(500));
    tokio::time::sleep(boot - window + Duration::from_millis(200)).await;
    let pings = || {
        sim.requests()
            .iter()
            .filter(|r| r.path.ends_with("/agent/ping"))
            .count()
    };
    let before = pings();
    let waiting = {
        let api = crate::common::Api::new(&sim);
        tokio::spawn(async move { api.post(ping, &[]).await })
    };
    while pings() == before {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(sim.stop_vm_out_of_band(500));
    let r = waiting.await.unwrap();
    assert_eq!(r.status, 500, "{:?}", r.body);
    shutdown_clean(sim).await;
}

/// pvedaemon serves a node's protected calls with three workers, one call
/// each: three agent requests held through boots leave a fourth protected
/// call on that node (here a clone) queued until one ends, while reads
/// pveproxy serves (the task list) and other nodes' calls go on.
#[tokio::test]
async fn held_agent_requests_queue_a_nodes_other_protected_calls() {
    use std::time::Instant;
    let window = Duration::from_millis(800);
    let (sim, api) = start_sim(SimConfig {
        agent_boot_delay: Duration::from_secs(3600),
        agent_ping_wait: window,
        ..fast()
    })
    .await;
    for vmid in [501, 502, 503] {
        sim.insert_vm(sim.new_vm(vmid, "pve1", "guest")).unwrap();
        assert!(sim.start_vm_out_of_band(vmid));
    }
    sim.insert_vm(sim.new_vm(504, "pve2", "guest")).unwrap();
    assert!(sim.start_vm_out_of_band(504));
    let held: Vec<_> = [501, 502, 503, 504]
        .into_iter()
        .map(|vmid| {
            let api = crate::common::Api::new(&sim);
            tokio::spawn(async move {
                let node = if vmid == 504 { "pve2" } else { "pve1" };
                api.post(&format!("/nodes/{node}/qemu/{vmid}/agent/ping"), &[])
                    .await
            })
        })
        .collect();
    let held_now = || sim.agent_waits().values().map(|w| w.now).sum::<usize>();
    while held_now() < 4 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // A read pveproxy serves is not held.
    let t = Instant::now();
    assert_eq!(api.get("/nodes/pve1/tasks", &[]).await.status, 200);
    assert!(
        t.elapsed() < window / 2,
        "a task list waited {:?}",
        t.elapsed()
    );
    // A protected call on pve1 queues behind the three held pings.
    let t = Instant::now();
    let r = api
        .post(
            "/nodes/pve1/qemu/9000/clone",
            &[("newid", "600"), ("name", "queued"), ("full", "1")],
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let queued = t.elapsed();
    assert!(queued >= window / 2, "the clone did not queue: {queued:?}");
    for h in held {
        assert_eq!(h.await.unwrap().status, 500, "no agent ever answers");
    }
    let q = sim.daemon_queue();
    assert_eq!((q["pve1"].requests, q["pve1"].peak), (1, 1), "{q:?}");
    assert!(!q.contains_key("pve2"), "pve2 has workers to spare: {q:?}");
    shutdown_clean(sim).await;
}
