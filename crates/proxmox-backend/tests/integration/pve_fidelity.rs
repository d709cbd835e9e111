//! What real PVE 8 and 9 do where an earlier simulator was kinder (from a
//! reading of PVE's sources), reproduced in pve-sim and driven through the
//! real substrate: failures that heal by themselves, locks found inside a
//! worker, and the like.

use std::sync::Arc;
use std::time::Duration;

use providerkit::ErrorKind;
use proxmox_backend::proxmox::{PveOptions, PveSubstrate};
use proxmox_backend::substrate::Substrate;
use pve_sim::{
    endpoints, GuestOutput, SimConfig, StorageKind, StorageSpec, TagAccess, TemplateSpec,
};

use crate::common::{
    assert_no_violations, client_3_tries as client, clones, fast_retrying as opts,
    fast_sim_150 as fast, req, sim_with, until,
};

#[tokio::test]
async fn redirect_loops_and_lost_quorum_are_waited_out() {
    let sim = sim_with(fast()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let id = "p/OnDemand/pve.small/pve1/001";
    // pveproxy's stale proxied connection: the node never saw the POST.
    sim.faults()
        .fail_next(endpoints::CLONE, 1, 599, "Too many redirections");
    // Then a cluster that lost quorum for a moment: pmxcfs refuses writes.
    sim.faults()
        .fail_next(endpoints::CLONE, 2, 500, "cluster not ready - no quorum?");
    let vm = sub.clone_vm(&req(id, "pve1")).await.expect("create");
    assert_eq!(sim.call_count(endpoints::CLONE), 4);
    assert_eq!(clones(&sim).len(), 1, "one clone, whatever the retries");
    sim.faults().fail_next(
        endpoints::DESTROY,
        1,
        500,
        "cfs-lock 'storage-local-lvm' error: 'storage-local-lvm'-locked command timed out - aborting",
    );
    sub.delete_vm(&vm, id).await.expect("delete");
    assert!(sim.vm(vm.vmid).is_none());
    assert_no_violations(&sim);
    sim.shutdown().await;
}

#[tokio::test]
async fn delete_of_a_vm_locked_by_a_backup_waits_for_the_lock() {
    let sim = sim_with(fast()).await;
    let sub = Arc::new(PveSubstrate::new(client(&sim), opts()));
    let id = "p/OnDemand/pve.small/pve1/002";
    let vm = sub.clone_vm(&req(id, "pve1")).await.expect("create");
    // Stopped: the DELETE answers 200 and its worker fails `VM is locked
    // (backup)`.
    assert!(sim.stop_vm_out_of_band(vm.vmid));
    sim.reset_counts();
    assert!(sim.set_lock(vm.vmid, Some("backup")));
    let task = {
        let (sub, vm) = (Arc::clone(&sub), vm.clone());
        tokio::spawn(async move { sub.delete_vm(&vm, id).await })
    };
    until("a destroy was sent again after its task failed", || {
        sim.call_count(endpoints::DESTROY) >= 2 || task.is_finished()
    })
    .await;
    assert!(sim.vm(vm.vmid).is_some(), "nothing destroyed yet");
    assert!(sim.set_lock(vm.vmid, None), "the backup ends");
    task.await
        .unwrap()
        .expect("destroyed once the lock cleared");
    assert!(sim.vm(vm.vmid).is_none());

    // Running: the stop before the destroy fails the same way.
    let id = "p/OnDemand/pve.small/pve1/012";
    let vm = sub.clone_vm(&req(id, "pve1")).await.expect("create");
    sim.reset_counts();
    assert!(sim.set_lock(vm.vmid, Some("backup")));
    let task = {
        let (sub, vm) = (Arc::clone(&sub), vm.clone());
        tokio::spawn(async move { sub.delete_vm(&vm, id).await })
    };
    until("a stop was sent again after its task failed", || {
        sim.call_count(endpoints::STOP) >= 2 || task.is_finished()
    })
    .await;
    assert!(sim.set_lock(vm.vmid, None), "the backup ends");
    task.await
        .unwrap()
        .expect("stopped and destroyed once the lock cleared");
    assert!(sim.vm(vm.vmid).is_none());
    sim.shutdown().await;
}

#[tokio::test]
async fn a_fresh_vm_is_found_by_its_marker_before_pvestatd_samples_it() {
    // Marker-only (the cluster refuses our tags) and no RRD sample yet:
    // PVE lists the new VM as `unknown`, without its name.
    let sim = sim_with(SimConfig {
        tag_access: TagAccess::Existing(vec![]),
        rrd_lag: Duration::from_secs(3600),
        ..fast()
    })
    .await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let id = "p/OnDemand/pve.small/pve1/003";
    let vm = sub.clone_vm(&req(id, "pve1")).await.expect("create");
    let fresh = PveSubstrate::new(client(&sim), opts());
    let managed = fresh.describe_managed().await.expect("inventory");
    assert_eq!(
        managed
            .iter()
            .map(|m| m.machine_id.as_str())
            .collect::<Vec<_>>(),
        [id],
        "found at once"
    );
    sub.delete_vm(&vm, id).await.expect("delete");
    sim.shutdown().await;
}

/// A fourth storage, `nas` (NFS, images), beside the default ones.
fn with_nas() -> SimConfig {
    let mut cfg = fast();
    cfg.storages
        .push(StorageSpec::new("nas", StorageKind::Nfs, true, 1 << 10));
    cfg
}

#[tokio::test]
async fn delete_succeeds_while_a_storage_it_never_used_is_offline() {
    let sim = sim_with(with_nas()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let id = "p/OnDemand/pve.small/pve1/004";
    let vm = sub.clone_vm(&req(id, "pve1")).await.expect("create");
    sim.set_storage_online("pve1", "nas", false);
    sub.delete_vm(&vm, id).await.expect("delete");
    assert!(sim.vm(vm.vmid).is_none(), "config removed too");
    sim.shutdown().await;
}

#[tokio::test]
async fn a_create_for_an_offline_target_node_fails_naming_it_instead_of_cloning_there() {
    let sim = sim_with(SimConfig {
        templates: vec![TemplateSpec::shared(9000, "pve1")],
        ..fast()
    })
    .await;
    assert!(sim.set_node_online("pve2", false));
    let o = PveOptions {
        retry_window: Duration::from_millis(600),
        ..opts()
    };
    let sub = PveSubstrate::new(client(&sim), o);
    let e = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve2/005", "pve2"))
        .await
        .expect_err("node stays offline");
    assert_eq!(e.kind(), ErrorKind::Transient, "{e}");
    assert!(
        e.to_string().contains("node pve2 is offline"),
        "names the node: {e}"
    );
    assert_eq!(sim.call_count(endpoints::CLONE), 0, "nothing sent there");
    assert!(clones(&sim).is_empty());
    sim.shutdown().await;
}

#[tokio::test]
async fn room_checks_tell_a_missing_or_disabled_storage_from_a_full_one() {
    let mut cfg = with_nas();
    cfg.storages.push(StorageSpec::new(
        "fast",
        StorageKind::LvmThin,
        false,
        1 << 10,
    ));
    cfg.storages_disabled = vec![("pve1".into(), "fast".into())];
    let sim = sim_with(cfg).await;
    let create = |storage: &str| {
        let mut o = opts();
        o.type_storage.insert("pve.small".into(), storage.into());
        PveSubstrate::new(client(&sim), o)
    };
    let e = create("nosuch")
        .clone_vm(&req("p/OnDemand/pve.small/pve1/006", "pve1"))
        .await
        .expect_err("no such storage");
    assert!(
        e.to_string()
            .starts_with("storage nosuch does not exist on node pve1"),
        "{e}"
    );
    let e = create("fast")
        .clone_vm(&req("p/OnDemand/pve.small/pve1/007", "pve1"))
        .await
        .expect_err("disabled there");
    assert!(
        e.to_string()
            .starts_with("storage fast is disabled on node pve1"),
        "{e}"
    );
    assert_eq!(e.kind(), ErrorKind::Permanent);
    sim.set_storage_online("pve1", "nas", false);
    let e = create("nas")
        .clone_vm(&req("p/OnDemand/pve.small/pve1/008", "pve1"))
        .await
        .expect_err("inactive there");
    assert!(
        e.to_string()
            .starts_with("storage nas is not active on node pve1"),
        "{e}"
    );
    assert_eq!(e.kind(), ErrorKind::Transient);
    assert_eq!(
        sim.call_count(endpoints::CLONE),
        0,
        "refused before cloning"
    );
    // The start-up check refuses a configured storage disabled on its node.
    let mut o = opts();
    o.node_storage.insert("pve1".into(), "fast".into());
    let e = PveSubstrate::new(client(&sim), o)
        .preflight(&["pve1".into(), "pve2".into()], &[9000])
        .await
        .expect_err("disabled on pve1");
    assert!(e.to_string().contains("is disabled on node pve1"), "{e}");
    sim.shutdown().await;
}

#[tokio::test]
async fn a_hidden_user_tag_access_is_unknown_not_free() {
    let sim = sim_with(SimConfig {
        tag_access: TagAccess::Existing(vec![]),
        // As setup-token.sh grants it: PVEAuditor on /nodes, nothing on /.
        dropped_privileges: vec![("/".into(), "Sys.Audit".into())],
        granted_privileges: vec![("/nodes".into(), "Sys.Audit".into())],
        ..fast()
    })
    .await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let warnings = sub
        .preflight(&["pve1".into()], &[9000])
        .await
        .expect("serves");
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("user-tag-access is unknown") && w.contains("Sys.Audit on /")),
        "{warnings:?}"
    );
    // Not restricted up front: the first refused marking falls back.
    let vm = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/013", "pve1"))
        .await
        .expect("create");
    assert_eq!(sim.vm(vm.vmid).unwrap().tags, None, "marker only");
    sim.shutdown().await;
}

#[tokio::test]
async fn a_bootstrap_echoing_non_ascii_secrets_is_redacted() {
    let sim = sim_with(fast()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let vm = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/014", "pve1"))
        .await
        .expect("create");
    const SECRET: &str = "jöin-tökén-Ωmega-2718281828";
    // The shell reports the bare token; PVE sends its bytes one character
    // per byte (`Ã¶` for `ö`). The Configure command names the guest, says
    // so, and starts the hook, which fails.
    let name = proxmox_backend::proxmox::vm_name("pve.small", "p/OnDemand/pve.small/pve1/014");
    sim.on_guest_command(
        "bigfleet-bootstrap",
        GuestOutput::exit(127)
            .with_stdout(format!(
                "\nbigfleet-configure:0:{name}\nbigfleet-configure:hook\n"
            ))
            .with_stderr(format!("sh: 2: {SECRET}: not found\n")),
    );
    let blob = format!("# join\n{SECRET}\n");
    let e = sub
        .configure(&vm, blob.as_bytes())
        .await
        .expect_err("the bootstrap fails")
        .to_string();
    let as_pve_sends_it: String = SECRET.bytes().map(char::from).collect();
    assert!(!e.contains(SECRET), "{e}");
    assert!(!e.contains(&as_pve_sends_it), "{e}");
    assert!(!e.contains("t\u{c3}\u{b6}k"), "no piece of it either: {e}");
    assert!(e.contains("stderr: sh: 2: [redacted]: not found"), "{e}");
    // Failing before the hook (in the hostname command): the blob is in the
    // guest by then, so that output is redacted too.
    sim.clear_guest_handlers();
    sim.on_guest_command(
        "bigfleet-bootstrap",
        GuestOutput::exit(1).with_stderr(format!("hostnamectl: read {SECRET}\n")),
    );
    let e = sub
        .configure(&vm, blob.as_bytes())
        .await
        .expect_err("the hostname command fails")
        .to_string();
    assert!(e.contains("hostname command"), "{e}");
    assert!(!e.contains(SECRET) && !e.contains(&as_pve_sends_it), "{e}");
    assert!(e.contains("[redacted]"), "{e}");
    sim.shutdown().await;
}

#[tokio::test]
async fn the_preflight_checks_the_storages_clones_really_fill() {
    let mut cfg = with_nas();
    cfg.storages.push(StorageSpec::new(
        "big",
        StorageKind::LvmThin,
        false,
        1 << 10,
    ));
    cfg.dropped_privileges = vec![("/storage/big".into(), "Datastore.AllocateSpace".into())];
    let sim = sim_with(cfg).await;
    let nodes = ["pve1".to_string(), "pve2".to_string()];
    // The instance type's storage: every clone of it names `big`.
    let mut o = opts();
    o.type_storage.insert("pve.small".into(), "big".into());
    let e = PveSubstrate::new(client(&sim), o)
        .preflight(&nodes, &[9000])
        .await
        .expect_err("no AllocateSpace on big");
    assert!(
        e.to_string().contains("/storage/big") && e.to_string().contains("Datastore.AllocateSpace"),
        "{e}"
    );
    // A node's storage, which its replica's migration fills too.
    let mut o = opts();
    o.node_storage.insert("pve2".into(), "big".into());
    let e = PveSubstrate::new(client(&sim), o)
        .preflight(&nodes, &[9000])
        .await
        .expect_err("no AllocateSpace on big");
    assert!(e.to_string().contains("/storage/big"), "{e}");
    // Every clone names a storage the token may fill: the template's own
    // storage is not needed for clones (here it is still held anyway).
    let mut o = opts();
    o.node_storage.insert("pve1".into(), "nas".into());
    o.node_storage.insert("pve2".into(), "nas".into());
    PveSubstrate::new(client(&sim), o)
        .preflight(&nodes, &[9000])
        .await
        .expect("nas is allowed");
    sim.shutdown().await;
}

#[tokio::test]
async fn the_preflight_checks_sdn_use_on_a_nics_vlan() {
    let sim = sim_with(SimConfig {
        dropped_privileges: vec![("/sdn/zones/localnetwork/vmbr0/20".into(), "SDN.Use".into())],
        ..fast()
    })
    .await;
    assert!(sim.update_vm(9000, |vm| {
        vm.extra.insert(
            "net0".into(),
            "virtio=BC:24:11:00:23:28,bridge=vmbr0,tag=20".into(),
        );
    }));
    let warnings = PveSubstrate::new(client(&sim), opts())
        .preflight(&["pve1".into()], &[9000])
        .await
        .expect("serves");
    assert!(
        warnings.iter().any(|w| w.starts_with(
            "the API token lacks SDN.Use on /sdn/zones/localnetwork/vmbr0/20: on Proxmox VE 8 \
             and newer every clone of template 9000 (a NIC on bridge vmbr0, VLAN 20)"
        )),
        "{warnings:?}"
    );
    sim.shutdown().await;
}

/// The template's NIC on SDN VNet `vnet1` of zone `z1`, the token holding
/// `SDN.Use` only where `grants` say (and everything else the lifecycle needs).
async fn vnet_sim(net0: &str, grants: &[&str], extra: SimConfig) -> pve_sim::PveSim {
    let sim = sim_with(SimConfig {
        sdn_vnets: vec![("vnet1".into(), "z1".into())],
        dropped_privileges: [
            extra.dropped_privileges.clone(),
            vec![("/".into(), "SDN.Use".into())],
        ]
        .concat(),
        granted_privileges: grants
            .iter()
            .map(|path| (path.to_string(), "SDN.Use".into()))
            .collect(),
        ..extra
    })
    .await;
    let net0 = net0.to_string();
    assert!(sim.update_vm(9000, move |vm| {
        vm.extra.insert("net0".into(), net0);
    }));
    sim
}

const ON_VNET1: &str = "virtio=BC:24:11:00:23:28,bridge=vnet1";

#[tokio::test]
async fn the_preflight_checks_a_vnets_nic_in_the_vnets_own_zone() {
    // SDN.Use on the VNet's own path: quiet (before the VNet's zone was
    // looked up, localnetwork/vnet1 was checked and warned of), and the
    // clone PVE checks the same way goes through.
    let sim = vnet_sim(ON_VNET1, &["/sdn/zones/z1/vnet1"], fast()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let warnings = sub
        .preflight(&["pve1".into()], &[9000])
        .await
        .expect("serves");
    assert!(warnings.iter().all(|w| !w.contains("SDN")), "{warnings:?}");
    sub.clone_vm(&req("p/OnDemand/pve.small/pve1/020", "pve1"))
        .await
        .expect("the clone is allowed");
    sim.shutdown().await;

    // SDN.Use only on localnetwork's path of that name: the clone is
    // refused on the VNet's path, which the preflight names and refuses on.
    let sim = vnet_sim(ON_VNET1, &["/sdn/zones/localnetwork/vnet1"], fast()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let e = sub
        .preflight(&["pve1".into()], &[9000])
        .await
        .expect_err("every clone would be refused");
    assert_eq!(e.kind(), ErrorKind::Refused, "{e}");
    assert_eq!(
        e.to_string(),
        "the API token lacks SDN.Use on /sdn/zones/z1/vnet1: every clone of template 9000 (a NIC \
         on SDN VNet vnet1 of zone z1) is refused with `Permission check failed \
         (/sdn/zones/z1/vnet1, SDN.Use)`, as Proxmox VE 8 and newer check each NIC of a clone. \
         Grant it with `pveum acl modify /sdn/zones/z1/vnet1 --tokens 'bigfleet@pve!autoscaler' \
         --roles PVESDNUser` (deploy/host-setup/setup-token.sh --bridge vnet1 --sdn-zone z1 does \
         this)"
    );
    let clone = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/021", "pve1"))
        .await
        .expect_err("refused by PVE");
    assert!(
        clone
            .to_string()
            .contains("Permission check failed (/sdn/zones/z1/vnet1, SDN.Use)"),
        "{clone}"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn the_preflight_checks_each_vlan_of_a_trunk_in_the_vnets_zone() {
    let trunk = "virtio=BC:24:11:00:23:28,bridge=vnet1,trunks=10;20-23";
    let sim = vnet_sim(
        trunk,
        &["/sdn/zones/z1/vnet1/10", "/sdn/zones/z1/vnet1/20"],
        fast(),
    )
    .await;
    let e = PveSubstrate::new(client(&sim), opts())
        .preflight(&["pve1".into()], &[9000])
        .await
        .expect_err("three VLANs are not granted");
    assert!(
        e.to_string().starts_with(
            "the API token lacks SDN.Use on /sdn/zones/z1/vnet1/<vlan> for VLANs 21-23: every \
             clone of template 9000 (a NIC on SDN VNet vnet1 of zone z1, VLANs 21-23) is refused \
             with `Permission check failed (/sdn/zones/z1/vnet1/21, SDN.Use)`"
        ) && e
            .to_string()
            .contains("`pveum acl modify /sdn/zones/z1/vnet1 --tokens"),
        "{e}"
    );
    sim.shutdown().await;
    // The bridge's grant covers every VLAN below it.
    let sim = vnet_sim(trunk, &["/sdn/zones/z1/vnet1"], fast()).await;
    PveSubstrate::new(client(&sim), opts())
        .preflight(&["pve1".into()], &[9000])
        .await
        .expect("every VLAN is granted");
    sim.shutdown().await;
}

#[tokio::test]
async fn without_the_vnets_zone_the_preflight_warns_in_localnetwork_and_says_why() {
    let grants = ["/sdn/zones/z1/vnet1"];
    // The listing refused, or SDN not installed (pve-manager then has no
    // /cluster/sdn): the zone cannot be looked up.
    for (sdn_installed, cause) in [
        (
            true,
            "PVE API error 403: Permission check failed (/sdn, SDN.Audit)",
        ),
        (
            false,
            "PVE API error 501: Method 'GET /cluster/sdn/vnets' not implemented",
        ),
    ] {
        let sim = vnet_sim(
            ON_VNET1,
            &grants,
            SimConfig {
                sdn_installed,
                ..fast()
            },
        )
        .await;
        if sdn_installed {
            sim.faults().fail_next(
                pve_sim::endpoints::SDN_VNETS,
                1,
                403,
                "Permission check failed (/sdn, SDN.Audit)",
            );
        }
        let warnings = PveSubstrate::new(client(&sim), opts())
            .preflight(&["pve1".into()], &[9000])
            .await
            .expect("a warning, not a refusal");
        let w = warnings
            .iter()
            .find(|w| w.contains("SDN.Use"))
            .unwrap_or_else(|| panic!("no SDN.Use warning: {warnings:?}"));
        assert!(
            w.starts_with("the API token lacks SDN.Use on /sdn/zones/localnetwork/vnet1: ")
                && w.contains(&format!(
                    "the SDN VNets could not be listed (GET /cluster/sdn/vnets: {cause}), so the \
                     zone of vnet1 could not be looked up and localnetwork was assumed"
                ))
                && w.contains(
                    "SDN.Audit on /sdn/zones/<zone>/vnet1 lets this check look the zone up"
                ),
            "{w}"
        );
        sim.shutdown().await;
    }

    // A VNet this token may use but not see (no SDN.Audit nor SDN.Allocate
    // on it): PVE leaves it out of the listing, so it looks like a plain
    // bridge; a warning, since the clone may well be allowed.
    let hidden = SimConfig {
        dropped_privileges: vec![
            ("/sdn".into(), "SDN.Audit".into()),
            ("/sdn".into(), "SDN.Allocate".into()),
        ],
        ..fast()
    };
    let sim = vnet_sim(ON_VNET1, &grants, hidden).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let warnings = sub
        .preflight(&["pve1".into()], &[9000])
        .await
        .expect("a warning, not a refusal");
    assert!(
        warnings.iter().any(|w| w
            .starts_with("the API token lacks SDN.Use on /sdn/zones/localnetwork/vnet1: ")
            && w.contains("vnet1 is not an SDN VNet this token can see")),
        "{warnings:?}"
    );
    sub.clone_vm(&req("p/OnDemand/pve.small/pve1/022", "pve1"))
        .await
        .expect("PVE checks the VNet's zone, where SDN.Use is held");
    sim.shutdown().await;
}
