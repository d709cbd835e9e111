//! Templates as operators make them, through the real substrate against
//! pve-sim (which refuses or mis-sizes them as PVE 8 and 9 do): a balloon
//! above the type's memory, `sockets` and `vcpus` that override `cores`,
//! registered tags, a node the token may not audit, resource mappings, and
//! a clone storage the template's node does not have enabled. Each Create
//! ends with a VM sized exactly as its instance type says, or is refused
//! before anything is cloned, naming the fix.

use std::time::Duration;

use providerkit::ErrorKind;
use proxmox_backend::proxmox::TypeDisk;
use proxmox_backend::proxmox::{machine_tag, PveOptions, PveSubstrate, MANAGED_TAG};
use proxmox_backend::substrate::{CloneRequest, Substrate};
use pve_sim::{endpoints, PveSim, SimConfig, StorageKind, StorageSpec, TagAccess, TemplateSpec};

use crate::common::{assert_no_violations, client, clones, fast_sim, opts, req, sim_with};

fn fast() -> SimConfig {
    fast_sim(Duration::from_millis(50), Duration::from_millis(50))
}

fn options() -> PveOptions {
    PveOptions {
        retry_window: Duration::from_secs(5),
        ..opts(Duration::from_secs(20))
    }
}

/// The one clone's sizing as the guest sees it: `(cores, sockets, vCPUs,
/// memory, balloon)`.
fn sizing(sim: &PveSim) -> (u32, u32, u32, u64, Option<u64>) {
    let all = clones(sim);
    assert_eq!(all.len(), 1, "one clone");
    let vm = &all[0];
    (
        vm.cores,
        vm.sockets,
        vm.vcpus(),
        vm.memory_mib,
        vm.balloon_mib(),
    )
}

/// Item 1: a template whose balloon (8 GiB) is above the type's memory
/// (2 GiB) made every Create fail `balloon value too large`; one below it
/// let auto-ballooning shrink the guest. The clone's balloon is now the
/// type's memory, or the catalog's `balloon_mib`; a template with
/// ballooning off keeps it off.
#[tokio::test]
async fn a_template_balloon_never_decides_the_clones_memory() {
    for (template_balloon, type_balloon, want) in [
        (Some(8192), None, Some(2048)),
        (Some(512), None, Some(2048)),
        (Some(0), None, Some(0)),
        (Some(8192), Some(1024), Some(1024)),
    ] {
        let sim = sim_with(fast()).await;
        sim.update_vm(9000, |t| {
            t.memory_mib = 8192;
            if let Some(b) = template_balloon {
                t.extra.insert("balloon".into(), b.to_string());
            }
        });
        let mut o = options();
        if let Some(b) = type_balloon {
            o.type_balloon.insert("pve.small".into(), b);
        }
        let sub = PveSubstrate::new(client(&sim), o);
        let id = "p/OnDemand/pve.small/pve1/b01";
        let vm = sub.clone_vm(&req(id, "pve1")).await.unwrap_or_else(|e| {
            panic!("template balloon {template_balloon:?}, type {type_balloon:?}: {e}")
        });
        let (_, _, _, memory, balloon) = sizing(&sim);
        assert_eq!(
            (memory, balloon),
            (2048, want),
            "template balloon {template_balloon:?}, type {type_balloon:?}"
        );
        assert!(sim.vm(vm.vmid).is_some_and(|v| v.running));
        sub.delete_vm(&vm, id).await.expect("delete");
        assert!(clones(&sim).is_empty(), "nothing left behind");
        assert_no_violations(&sim);
        sim.shutdown().await;
    }
}

/// Item 2: a template with `sockets: 2` doubled every clone's vCPUs (and
/// one past the node's CPUs never started); `vcpus: 2` capped every type
/// at 2. The clone gets `sockets=1` and loses `vcpus`.
#[tokio::test]
async fn template_sockets_and_vcpus_never_decide_the_clones_vcpus() {
    let sim = sim_with(SimConfig {
        node_cpus: 6,
        ..fast()
    })
    .await;
    sim.update_vm(9000, |t| {
        t.sockets = 2;
        t.extra.insert("vcpus".into(), "2".into());
    });
    let sub = PveSubstrate::new(client(&sim), options());
    let id = "p/OnDemand/pve.large/pve1/c01";
    let r = CloneRequest {
        instance_type: "pve.large".into(),
        vcpu: 4,
        ..req(id, "pve1")
    };
    let vm = sub.clone_vm(&r).await.expect("create");
    // 2 sockets x 4 cores = 8 would pass the node's 6 CPUs and not start.
    assert_eq!(sizing(&sim), (4, 1, 4, 2048, Some(2048)));
    assert!(sim.vm(vm.vmid).is_some_and(|v| v.running));
    sub.delete_vm(&vm, id).await.expect("delete");
    assert_no_violations(&sim);
    sim.shutdown().await;
}

/// Item 4: a template tag in datacenter.cfg's `registered-tags` (or not in
/// `user-tag-access`'s list) made the marking PUT a 403 (PVE checks tags
/// removed too), and the provider then gave up its tags for good. Ours now
/// go beside the template's.
#[tokio::test]
async fn template_tags_are_kept_and_ours_added() {
    let id = "p/OnDemand/pve.small/pve1/t01";
    for cfg in [
        SimConfig {
            registered_tags: vec!["golden".into()],
            ..fast()
        },
        // Only our own tags are listed: the template's cannot go.
        SimConfig {
            tag_access: TagAccess::List(vec![MANAGED_TAG.into(), machine_tag(id)]),
            ..fast()
        },
    ] {
        let sim = sim_with(cfg).await;
        sim.update_vm(9000, |t| t.tags = Some("golden".into()));
        let sub = PveSubstrate::new(client(&sim), options());
        let vm = sub.clone_vm(&req(id, "pve1")).await.expect("create");
        let tags = sim.vm(vm.vmid).and_then(|v| v.tags).unwrap_or_default();
        let mut want = vec!["golden".to_string(), MANAGED_TAG.into(), machine_tag(id)];
        want.sort();
        let mut got: Vec<String> = tags.split(';').map(str::to_string).collect();
        got.sort();
        assert_eq!(got, want, "the template's and ours");
        let managed = sub.describe_managed().await.expect("inventory");
        assert_eq!(managed.len(), 1);
        sub.delete_vm(&vm, id).await.expect("delete");
        assert_no_violations(&sim);
        sim.shutdown().await;
    }
}

/// Item 3: without `Sys.Audit` on `/nodes/<node>`, `GET /nodes` hides the
/// node's memory, and the node memory guard let Creates through unchecked.
/// The preflight now requires it while the guard is on, and the guard
/// refuses a Create it cannot check, before cloning.
#[tokio::test]
async fn the_memory_guard_needs_sys_audit_on_the_nodes() {
    let sim = sim_with(SimConfig {
        dropped_privileges: vec![("/nodes/pve1".into(), "Sys.Audit".into())],
        ..fast()
    })
    .await;
    let sub = PveSubstrate::new(client(&sim), options());
    let e = sub
        .preflight(&["pve1".into()], &[9000])
        .await
        .expect_err("the guard cannot read pve1");
    assert_eq!(e.kind(), ErrorKind::Refused);
    let msg = e.to_string();
    assert!(
        msg.contains("on /nodes/pve1: Sys.Audit to read the node's memory"),
        "{msg}"
    );
    let e = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/m01", "pve1"))
        .await
        .expect_err("an unchecked Create is refused");
    assert_eq!(e.kind(), ErrorKind::Refused, "{e}");
    assert!(
        format!("{e:#}").contains("Sys.Audit on /nodes/pve1"),
        "{e:#}"
    );
    assert!(clones(&sim).is_empty(), "nothing cloned");

    // With the guard off, nothing needs the figures.
    let off = PveSubstrate::new(
        client(&sim),
        PveOptions {
            node_memory_limit: 0.0,
            ..options()
        },
    );
    off.preflight(&["pve1".into()], &[9000])
        .await
        .expect("the guard is off");
    sim.shutdown().await;
}

/// Item 3: qemu-server's `clone_vm` checks `Mapping.Use` on a template's
/// mapped devices (`check_mapping_access`) and, from 9.1.15, on its custom
/// CPU model; a device passed through by host address only root may
/// clone. The preflight names each before serving.
#[tokio::test]
async fn the_preflight_checks_the_templates_resource_mappings() {
    let sim = sim_with(SimConfig {
        pve9: true,
        ..fast()
    })
    .await;
    sim.update_vm(9000, |t| {
        t.extra
            .insert("hostpci0".into(), "mapping=gpu-a2,pcie=1".into());
        t.extra.insert("cpu".into(), "custom-tuned".into());
    });
    let sub = PveSubstrate::new(client(&sim), options());
    let msg = sub
        .preflight(&["pve1".into()], &[9000])
        .await
        .expect_err("Mapping.Use missing")
        .to_string();
    for want in [
        "on /mapping/cpu/tuned: Mapping.Use",
        "on /mapping/pci/gpu-a2: Mapping.Use",
    ] {
        assert!(msg.contains(want), "missing {want:?} in: {msg}");
    }
    sim.shutdown().await;

    let sim = sim_with(SimConfig {
        pve9: true,
        granted_privileges: vec![
            ("/mapping/pci/gpu-a2".into(), "Mapping.Use".into()),
            ("/mapping/cpu/tuned".into(), "Mapping.Use".into()),
        ],
        ..fast()
    })
    .await;
    sim.update_vm(9000, |t| {
        t.extra
            .insert("hostpci0".into(), "mapping=gpu-a2,pcie=1".into());
        t.extra.insert("cpu".into(), "custom-tuned".into());
    });
    let sub = PveSubstrate::new(client(&sim), options());
    sub.preflight(&["pve1".into()], &[9000])
        .await
        .expect("granted");
    // A device by host address: only root may clone it.
    sim.update_vm(9000, |t| {
        t.extra.insert("hostpci1".into(), "0000:01:00.0".into());
    });
    let msg = sub
        .preflight(&["pve1".into()], &[9000])
        .await
        .expect_err("a raw host device")
        .to_string();
    assert!(
        msg.contains("hostpci1: 0000:01:00.0") && msg.contains("mapping=<name>"),
        "{msg}"
    );
    sim.shutdown().await;
}

/// Item 5: a shared storage whose `nodes` list leaves the template's node
/// out failed every Create that named it (`storage 'X' is not available on
/// node`): PVE checks it on the template's node first. Such a Create now
/// clones from a copy of the template on the target node.
#[tokio::test]
async fn a_storage_not_enabled_on_the_template_node_is_reached_through_a_replica() {
    let mut cfg = fast();
    cfg.templates = vec![TemplateSpec::shared(9000, "pve1")];
    cfg.storages
        .push(StorageSpec::new("nfs-b", StorageKind::Nfs, true, 1 << 10));
    cfg.storages_disabled = vec![("pve1".into(), "nfs-b".into())];
    let sim = sim_with(cfg).await;
    let mut o = options();
    o.type_storage.insert("pve.small".into(), "nfs-b".into());
    let sub = PveSubstrate::new(client(&sim), o);
    sub.preflight(&["pve1".into(), "pve2".into()], &[9000])
        .await
        .expect("preflight");
    let id = "p/OnDemand/pve.small/pve2/s01";
    let vm = sub.clone_vm(&req(id, "pve2")).await.expect("create");
    let made = sim.vm(vm.vmid).expect("the clone");
    assert_eq!(
        (made.node.as_str(), made.storage.as_str()),
        ("pve2", "nfs-b")
    );
    assert!(made.running);
    sub.delete_vm(&vm, id).await.expect("delete");
    assert_no_violations(&sim);
    sim.shutdown().await;
}

/// Options with `pve.small` sized at `gib` GiB from template 9000.
fn sized(gib: u64) -> PveOptions {
    let mut o = options();
    o.type_disk.insert(
        "pve.small".into(),
        TypeDisk {
            template_vmid: 9000,
            gib,
        },
    );
    o
}

/// #44 item 1: a type's `disk_gib` grows the clone's boot disk (32 GiB in
/// the template) before the VM starts; a retried Create finds it grown and
/// sends no second resize; a type smaller than its template is refused at
/// start-up naming both sizes.
#[tokio::test]
async fn a_types_disk_size_grows_the_boot_disk_once() {
    let sim = sim_with(fast()).await;
    let sub = PveSubstrate::new(client(&sim), sized(64));
    sub.preflight(&["pve1".into()], &[9000])
        .await
        .expect("64 GiB from a 32 GiB template");
    let id = "p/OnDemand/pve.small/pve1/d01";
    let vm = sub.clone_vm(&req(id, "pve1")).await.expect("create");
    let made = sim.vm(vm.vmid).expect("the clone");
    assert_eq!(made.disk_gib, 64);
    assert!(made.running);
    assert_eq!(sim.call_count(endpoints::RESIZE), 1);
    // A retried Create (as after a restart) adopts it: nothing to grow.
    let again = sub
        .clone_vm(&CloneRequest {
            resumed: true,
            ..req(id, "pve1")
        })
        .await
        .expect("adopt");
    assert_eq!(again, vm);
    assert_eq!(sim.call_count(endpoints::RESIZE), 1, "no second resize");
    sub.delete_vm(&vm, id).await.expect("delete");
    assert_no_violations(&sim);

    let small = PveSubstrate::new(client(&sim), sized(16));
    let msg = small
        .preflight(&["pve1".into()], &[9000])
        .await
        .expect_err("smaller than the template")
        .to_string();
    assert!(
        msg.contains("disk_gib 16 GiB is smaller than template 9000's boot disk (scsi0, 32.0 GiB)"),
        "{msg}"
    );
    sim.shutdown().await;
}

/// #44 item 1, the template contract: the first Create of a sized type per
/// template asks its guest, once, whether it can grow its root file system
/// at boot (`growpart` or `systemd-repart`); a type that keeps the
/// template's size asks nothing.
#[tokio::test]
async fn the_first_sized_create_asks_the_guest_once_whether_it_grows_its_root() {
    let sim = sim_with(fast()).await;
    let asked = crate::common::record_commands(&sim, "growpart");
    let sub = PveSubstrate::new(client(&sim), sized(64));
    let mut made = Vec::new();
    for n in 0..2 {
        let id = format!("p/OnDemand/pve.small/pve1/g0{n}");
        made.push((sub.clone_vm(&req(&id, "pve1")).await.expect("create"), id));
    }
    let lines = asked.lock().clone();
    assert_eq!(lines.len(), 1, "once per template: {lines:?}");
    assert!(lines[0].contains("systemd-repart"), "{lines:?}");
    let plain = PveSubstrate::new(client(&sim), options());
    let id = "p/OnDemand/pve.small/pve1/g09";
    made.push((
        plain.clone_vm(&req(id, "pve1")).await.expect("create"),
        id.to_string(),
    ));
    assert_eq!(asked.lock().len(), 1, "an unsized type asks nothing");
    for (vm, id) in made {
        sub.delete_vm(&vm, &id).await.expect("delete");
    }
    sim.shutdown().await;
}

/// #44: the storage room check counts a clone's grown boot disk: 232 GiB
/// free hold three 64 GiB clones of a 32 GiB template, and the fourth is
/// refused before anything is cloned (by the template's 32 GiB alone, the
/// 40 GiB left would pass the check and the resize fail after the clone).
#[tokio::test]
async fn the_room_check_counts_the_grown_disk() {
    let mut cfg = fast();
    cfg.storages.retain(|s| s.name != "local-lvm");
    cfg.storages.push(StorageSpec::new(
        "local-lvm",
        StorageKind::LvmThin,
        false,
        232 + 32,
    ));
    let sim = sim_with(cfg).await;
    let sub = PveSubstrate::new(client(&sim), sized(64));
    let mut made = Vec::new();
    for n in 0..3 {
        let id = format!("p/OnDemand/pve.small/pve1/r0{n}");
        let vm = sub.clone_vm(&req(&id, "pve1")).await.expect("fits");
        made.push((id, vm));
    }
    let before = sim.call_count(endpoints::CLONE);
    let e = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/r03", "pve1"))
        .await
        .expect_err("no room for a fourth");
    let msg = format!("{e:#}");
    assert!(
        msg.contains(
            "storage local-lvm of node pve1 has no room for the full clone of template 9000"
        ),
        "{msg}"
    );
    assert!(
        msg.contains("it needs 64.0 GiB and 40.0 GiB is free"),
        "{msg}"
    );
    assert_eq!(sim.call_count(endpoints::CLONE), before, "nothing cloned");
    for (id, vm) in made {
        sub.delete_vm(&vm, &id).await.expect("delete");
    }
    sim.shutdown().await;
}
