//! #44 item 3, mapped PCI devices (GPUs), through the real substrate
//! against pve-sim's resource mappings: a type with one device per clone
//! on a node whose mapping has two gets two machines and the rest refused
//! at admission, before anything is cloned; each clone carries its
//! `hostpciN: mapping=...`; a VM the provider does not own holds its
//! device too; a running VM's config is read once per QEMU process; the
//! start-up check names a mapping missing, short on a node, or not usable.

use std::time::Duration;

use futures::future::join_all;
use proxmox_backend::capacity::Refusal;
use proxmox_backend::proxmox::{PveOptions, PveSubstrate, TypeDevices};
use proxmox_backend::substrate::{CloneRequest, Substrate};
use pve_sim::{endpoints, PciMapping, PveSim, SimConfig};

use crate::common::{clones, fast_sim, opts, req, sim_with};

/// pve-sim whose mapping `a10` has two devices on pve1 and none on pve2,
/// with `Mapping.Use` on every PCI mapping granted when `usable`.
async fn sim(usable: bool) -> PveSim {
    let mut cfg: SimConfig = fast_sim(Duration::from_millis(100), Duration::from_millis(50));
    cfg.pci_mappings = vec![PciMapping::new("a10", &[("pve1", 2)])];
    cfg.max_parallel_local_clones = None;
    if usable {
        cfg.granted_privileges
            .push(("/mapping/pci".into(), "Mapping.Use".into()));
    }
    sim_with(cfg).await
}

/// `pve.small` with one device of `a10` per clone, offered on `nodes`.
fn options(nodes: &[&str]) -> PveOptions {
    let mut o = PveOptions {
        retry_window: Duration::from_secs(5),
        max_parallel_clones: 8,
        ..opts(Duration::from_secs(20))
    };
    o.type_devices.insert(
        "pve.small".into(),
        TypeDevices {
            mapping: "a10".into(),
            count: 1,
            pcie: false,
            nodes: nodes.iter().map(|n| n.to_string()).collect(),
        },
    );
    o
}

fn gpu(n: usize) -> CloneRequest {
    req(&format!("p/OnDemand/pve.small/pve1/{n:03}"), "pve1")
}

#[tokio::test]
async fn a_node_with_two_devices_takes_two_gpu_machines_and_refuses_the_rest() {
    let sim = sim(true).await;
    let sub = PveSubstrate::new(crate::common::client(&sim), options(&["pve1"]));
    sub.preflight(&["pve1".into()], &[9000])
        .await
        .expect("preflight");
    let reqs: Vec<CloneRequest> = (0..4).map(gpu).collect();
    let admitted = join_all(reqs.iter().map(|r| sub.admit(r))).await;
    assert_eq!(sim.call_count(endpoints::CLONE), 0, "nothing cloned yet");
    let mut held = Vec::new();
    let mut refused = Vec::new();
    for (r, a) in reqs.iter().zip(admitted) {
        match a {
            Ok(claim) => {
                assert!(!claim.is_empty(), "a claim is held");
                held.push((r.clone(), claim));
            }
            Err(Refusal::Devices(no)) => refused.push(no),
            Err(other) => panic!("refused for something else: {other}"),
        }
    }
    assert_eq!((held.len(), refused.len()), (2, 2));
    let msg = refused[0].to_string();
    assert!(
        msg.contains("node pve1 has no free device of PCI mapping a10")
            && msg.contains("needs 1 and 0 of the 2 mapped on the node are free (0 held by running VMs, 2 by Creates in flight)"),
        "{msg}"
    );

    let made = join_all(held.iter().map(|(r, _)| sub.clone_vm(r))).await;
    let vms: Vec<_> = made.into_iter().map(|v| v.expect("lands")).collect();
    for vm in clones(&sim) {
        assert!(vm.running, "{}", vm.vmid);
        assert_eq!(
            vm.extra.get("hostpci0").map(String::as_str),
            Some("mapping=a10")
        );
    }
    drop(held);

    // Both devices are held by running VMs now; read once per process.
    let Err(Refusal::Devices(no)) = sub.admit(&gpu(4)).await else {
        panic!("no device left");
    };
    assert_eq!((no.held_by_vms, no.in_flight), (2, 0));
    let reads = sim.call_count(endpoints::CONFIG_GET);
    assert!(sub.admit(&gpu(5)).await.is_err());
    assert_eq!(
        sim.call_count(endpoints::CONFIG_GET),
        reads,
        "the running VMs' devices are known by their QEMU process"
    );

    // One deleted: a device is free again.
    let first = reqs[0].machine_id.clone();
    let vm = vms
        .iter()
        .find(|v| {
            sim.vms()[&v.vmid]
                .description
                .as_deref()
                .is_some_and(|d| d.contains(first.as_str()))
        })
        .expect("the first machine's VM");
    sub.delete_vm(vm, &first).await.expect("delete");
    assert!(!sub.admit(&gpu(6)).await.expect("free").is_empty());
    sim.shutdown().await;
}

#[tokio::test]
async fn a_vm_the_provider_does_not_own_holds_its_device_too() {
    let sim = sim(true).await;
    let mut db = sim.new_vm(500, "pve1", "someone-elses-gpu-vm");
    db.extra
        .insert("hostpci0".into(), "mapping=a10,pcie=1".into());
    sim.insert_vm(db).expect("foreign VM");
    assert!(sim.start_vm_out_of_band(500));
    let sub = PveSubstrate::new(crate::common::client(&sim), options(&["pve1"]));
    let one = sub.admit(&gpu(0)).await.expect("one device is free");
    assert!(!one.is_empty());
    let Err(Refusal::Devices(no)) = sub.admit(&gpu(1)).await else {
        panic!("the other is the foreign VM's");
    };
    assert_eq!((no.total, no.held_by_vms, no.in_flight), (2, 1, 1));
    sim.shutdown().await;
}

#[tokio::test]
async fn the_preflight_names_a_mapping_missing_short_on_a_node_or_not_usable() {
    let sim = sim(true).await;
    // Offered on pve2, where the mapping has no device.
    let sub = PveSubstrate::new(crate::common::client(&sim), options(&["pve1", "pve2"]));
    let msg = sub
        .preflight(&["pve1".into(), "pve2".into()], &[9000])
        .await
        .expect_err("no device on pve2")
        .to_string();
    assert!(
        msg.contains("instance type pve.small is offered on node pve2, but PCI mapping a10 maps 0 device(s) there"),
        "{msg}"
    );
    // A mapping the cluster does not have.
    let mut o = options(&["pve1"]);
    if let Some(d) = o.type_devices.get_mut("pve.small") {
        d.mapping = "h100".into();
    }
    let sub = PveSubstrate::new(crate::common::client(&sim), o);
    let msg = sub
        .preflight(&["pve1".into()], &[9000])
        .await
        .expect_err("no such mapping")
        .to_string();
    assert!(
        msg.contains("instance type pve.small asks for PCI mapping h100, which GET /cluster/mapping/pci does not list"),
        "{msg}"
    );
    sim.shutdown().await;

    // Without Mapping.Use on it: named with the other privileges.
    let sim = self::sim(false).await;
    let sub = PveSubstrate::new(crate::common::client(&sim), options(&["pve1"]));
    let msg = sub
        .preflight(&["pve1".into()], &[9000])
        .await
        .expect_err("Mapping.Use missing")
        .to_string();
    assert!(msg.contains("on /mapping/pci/a10: Mapping.Use"), "{msg}");
    sim.shutdown().await;
}
