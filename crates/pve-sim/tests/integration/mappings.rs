//! PCI resource mappings: the list pve-manager's
//! `PVE/API2/Cluster/Mapping/PCI.pm` returns, the `Mapping.Use` checks
//! qemu-server's clone makes (`check_mapping_access` in
//! `src/PVE/QemuServer.pm`, `$check_cpu_model_access` in
//! `src/PVE/API2/Qemu.pm`), and the devices a started VM holds
//! (`src/PVE/QemuServer/PCI.pm`).

use std::time::Duration;

use pve_sim::{PciMapping, PveSim, SimConfig};
use serde_json::json;

use crate::common::{shutdown_clean, start_sim, Api};

fn cfg() -> SimConfig {
    SimConfig {
        pci_mappings: vec![
            PciMapping::new("gpu", &[("pve1", 2), ("pve2", 1)]),
            PciMapping::new("single", &[("pve1", 1)]),
        ],
        clone_duration: Duration::from_millis(20),
        rrd_lag: Duration::ZERO,
        ..SimConfig::default()
    }
}

fn grant(path: &str, privilege: &str) -> (String, String) {
    (path.to_string(), privilege.to_string())
}

/// Template 9000 with the device keys `keys`.
fn devices_on_template(sim: &PveSim, keys: &[(&str, &str)]) {
    assert!(sim.update_vm(9000, |vm| {
        for (k, v) in keys {
            vm.extra.insert(k.to_string(), v.to_string());
        }
    }));
}

async fn clone(api: &Api, newid: &str) -> crate::common::Resp {
    api.post("/nodes/pve1/qemu/9000/clone", &[("newid", newid)])
        .await
}

/// pve-manager `API2/Cluster/Mapping/PCI.pm` index: each mapping the token
/// holds `Mapping.Modify`, `.Use` or `.Audit` on, with its `map` entries
/// (`node=...,path=...,id=vendor:device,...`), `type` and digest; with
/// `check-node`, a warning for a mapping with nothing on that node.
#[tokio::test]
async fn pci_mappings_are_listed_as_pve_manager_lists_them() {
    let (sim, api) = start_sim(cfg()).await;
    let r = api.get("/cluster/mapping/pci", &[]).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.data(),
        &json!([]),
        "no Mapping.* privilege: nothing listed"
    );
    sim.shutdown().await;

    let (sim, api) = start_sim(SimConfig {
        granted_privileges: vec![grant("/mapping/pci/gpu", "Mapping.Audit")],
        ..cfg()
    })
    .await;
    let r = api.get("/cluster/mapping/pci", &[]).await;
    let rows = r.data().as_array().expect("a list");
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["id"], "gpu");
    assert_eq!(rows[0]["type"], "pci");
    assert_eq!(
        rows[0]["map"],
        json!([
            "node=pve1,path=0000:01:00.0,id=10de:2236,iommugroup=1",
            "node=pve1,path=0000:02:00.0,id=10de:2236,iommugroup=2",
            "node=pve2,path=0000:01:00.0,id=10de:2236,iommugroup=1",
        ])
    );
    assert_eq!(rows[0]["digest"].as_str().map(str::len), Some(40));
    shutdown_clean(sim).await;

    let (sim, api) = start_sim(SimConfig {
        granted_privileges: vec![grant("/mapping/pci", "Mapping.Use")],
        ..cfg()
    })
    .await;
    let r = api
        .get("/cluster/mapping/pci", &[("check-node", "pve2")])
        .await;
    let rows = r.data().as_array().expect("a list");
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["checks"], json!([]));
    assert_eq!(rows[1]["id"], "single");
    assert_eq!(
        rows[1]["checks"],
        json!([{"severity": "warning", "message": "No mapping for node pve2."}])
    );
    shutdown_clean(sim).await;
}

/// qemu-server `clone_vm` calls `check_mapping_access` on the source's
/// config: `Mapping.Use` on `/mapping/pci/<name>` for `hostpciN:
/// mapping=<name>`, on `/mapping/usb/<name>` for `usbN: mapping=<name>`,
/// a 403 like every other privilege check.
#[tokio::test]
async fn cloning_mapped_devices_needs_mapping_use() {
    let (sim, api) = start_sim(cfg()).await;
    devices_on_template(
        &sim,
        &[
            ("hostpci0", "mapping=gpu,pcie=1"),
            ("usb0", "mapping=dongle"),
        ],
    );
    let r = clone(&api, "101").await;
    assert_eq!(r.status, 403);
    assert_eq!(
        r.message(),
        "Permission check failed (/mapping/pci/gpu, Mapping.Use)"
    );
    sim.shutdown().await;

    let (sim, api) = start_sim(SimConfig {
        granted_privileges: vec![grant("/mapping/pci/gpu", "Mapping.Use")],
        ..cfg()
    })
    .await;
    devices_on_template(
        &sim,
        &[
            ("hostpci0", "mapping=gpu,pcie=1"),
            ("usb0", "mapping=dongle"),
        ],
    );
    let r = clone(&api, "101").await;
    assert_eq!(r.status, 403);
    assert_eq!(
        r.message(),
        "Permission check failed (/mapping/usb/dongle, Mapping.Use)"
    );
    sim.shutdown().await;

    let (sim, api) = start_sim(SimConfig {
        granted_privileges: vec![grant("/mapping", "Mapping.Use")],
        ..cfg()
    })
    .await;
    devices_on_template(
        &sim,
        &[
            ("hostpci0", "mapping=gpu,pcie=1"),
            ("usb0", "mapping=dongle"),
        ],
    );
    let t = api.wait_task_of(clone(&api, "101").await).await;
    assert_eq!(t["exitstatus"], "OK");
    let c = api.get("/nodes/pve1/qemu/101/config", &[]).await;
    assert_eq!(c.data()["hostpci0"], "mapping=gpu,pcie=1");
    // A config update may set one too: with Mapping.Use and VM.Config.HWType
    // (qemu-server `check_hostpci_perm`).
    let r = api
        .put(
            "/nodes/pve1/qemu/101/config",
            &[("hostpci1", "mapping=single")],
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let c = api.get("/nodes/pve1/qemu/101/config", &[]).await;
    assert_eq!(c.data()["hostpci1"], "mapping=single");
    shutdown_clean(sim).await;
}

/// qemu-server `check_mapping_access` (clone) and `check_hostpci_perm` /
/// `check_usb_perm` (config updates): only root@pam may pass a host PCI
/// device through by address (`only root can set 'hostpciN' config for
/// non-mapped devices`) or a real USB device (`only root can set 'usbN'
/// config for real devices`); `spice` is not a real one. A token is
/// never root@pam, so these are 500s whatever it holds.
#[tokio::test]
async fn unmapped_host_devices_are_root_only() {
    let (sim, api) = start_sim(cfg()).await;
    devices_on_template(&sim, &[("hostpci0", "0000:01:00.0,pcie=1")]);
    let r = clone(&api, "101").await;
    assert_eq!(r.status, 500);
    assert_eq!(
        r.message(),
        "only root can set 'hostpci0' config for non-mapped devices"
    );
    assert!(sim.update_vm(9000, |vm| {
        vm.extra.remove("hostpci0");
        vm.extra.insert("usb0".into(), "host=046d:c52b".into());
    }));
    let r = clone(&api, "101").await;
    assert_eq!(r.status, 500);
    assert_eq!(
        r.message(),
        "only root can set 'usb0' config for real devices"
    );
    devices_on_template(&sim, &[("usb0", "host=spice")]);
    let t = api.wait_task_of(clone(&api, "101").await).await;
    assert_eq!(t["exitstatus"], "OK");
    let r = api
        .put(
            "/nodes/pve1/qemu/101/config",
            &[("hostpci0", "host=0000:02:00.0")],
        )
        .await;
    assert_eq!(r.status, 500);
    assert_eq!(
        r.message(),
        "only root can set 'hostpci0' config for non-mapped devices"
    );
    shutdown_clean(sim).await;
}

/// qemu-server 9.1.15's `$check_cpu_model_access` in `clone_vm`: on PVE 9
/// a source with `cpu: custom-<x>` needs `Mapping.Use` on
/// `/mapping/cpu/<x>`; PVE 8 does not check it.
#[tokio::test]
async fn pve9_checks_custom_cpu_models_on_clone() {
    let (sim, api) = start_sim(SimConfig {
        pve9: true,
        ..cfg()
    })
    .await;
    devices_on_template(&sim, &[("cpu", "custom-epyc,flags=+aes")]);
    let r = clone(&api, "101").await;
    assert_eq!(r.status, 403);
    assert_eq!(
        r.message(),
        "Permission check failed (/mapping/cpu/epyc, Mapping.Use)"
    );
    sim.shutdown().await;

    let (sim, api) = start_sim(cfg()).await;
    devices_on_template(&sim, &[("cpu", "custom-epyc,flags=+aes")]);
    let t = api.wait_task_of(clone(&api, "101").await).await;
    assert_eq!(t["exitstatus"], "OK");
    shutdown_clean(sim).await;
}

/// qemu-server's start (`QemuServer/PCI.pm`): `choose_hostpci_devices`
/// reserves one free device of the mapping on the node, failing `could
/// not find a free device for 'hostpciN'` when all are held; with a single
/// device, `reserve_pci_usage` fails `PCI device 'ADDR' already in use by
/// VMID 'N'`; a mapping with nothing on the node fails `PCI device mapping
/// not found for 'X'`. Running VMs hold their devices until they stop.
/// `vm_start` checks only `VM.PowerMgmt`: no `Mapping.Use` is granted here.
#[tokio::test]
async fn starts_hold_mapped_devices_until_the_vm_stops() {
    let (sim, api) = start_sim(cfg()).await;
    for (vmid, node, mapping) in [
        (101, "pve1", "gpu"),
        (102, "pve1", "gpu"),
        (103, "pve1", "gpu"),
        (104, "pve1", "single"),
        (105, "pve1", "single"),
        (106, "pve2", "single"),
    ] {
        let mut vm = sim.new_vm(vmid, node, &format!("vm{vmid}"));
        vm.extra
            .insert("hostpci0".into(), format!("mapping={mapping},pcie=1"));
        sim.insert_vm(vm).expect("seed VM");
    }
    let start = |vmid: u32, node: &'static str| {
        let api = &api;
        async move {
            let r = api
                .post(&format!("/nodes/{node}/qemu/{vmid}/status/start"), &[])
                .await;
            let t = api.wait_task_of(r).await;
            t["exitstatus"].as_str().unwrap_or_default().to_string()
        }
    };
    assert_eq!(start(101, "pve1").await, "OK");
    assert_eq!(start(102, "pve1").await, "OK");
    assert_eq!(
        start(103, "pve1").await,
        "could not find a free device for 'hostpci0'"
    );
    assert_eq!(start(104, "pve1").await, "OK");
    assert_eq!(
        start(105, "pve1").await,
        "PCI device '0000:03:00.0' already in use by VMID '104'"
    );
    assert_eq!(
        start(106, "pve2").await,
        "PCI device mapping not found for 'single'"
    );
    // A stop frees the device.
    let r = api.post("/nodes/pve1/qemu/101/status/stop", &[]).await;
    assert_eq!(api.wait_task_of(r).await["exitstatus"], "OK");
    assert_eq!(start(103, "pve1").await, "OK");
    assert!(sim.vm(103).is_some_and(|vm| vm.running));
    shutdown_clean(sim).await;
}
