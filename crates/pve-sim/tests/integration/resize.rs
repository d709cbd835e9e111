//! `PUT /nodes/{node}/qemu/{vmid}/resize` as qemu-server's `resize_vm`
//! (`src/PVE/API2/Qemu.pm`) does it: a `resize` worker task (since
//! qemu-server 8.0), absolute or `+` sizes, no shrinking, the config lock,
//! `VM.Config.Disk` on the VM and `Datastore.AllocateSpace` on the disk's
//! storage, and room on the storage for the grown disk.

use std::time::Duration;

use pve_sim::{PveSim, SimConfig, StorageKind, StorageSpec};

use crate::common::{shutdown_clean, start_sim, Api};

fn cfg() -> SimConfig {
    SimConfig {
        storages: vec![StorageSpec::new(
            "local-lvm",
            StorageKind::LvmThin,
            false,
            100,
        )],
        rrd_lag: Duration::ZERO,
        ..SimConfig::default()
    }
}

/// VM `vmid` on pve1 with a 32G `scsi0` on `local-lvm`, in no pool (a
/// pool's ACL would give back a privilege dropped on `/vms/{vmid}`).
fn seed(sim: &PveSim, vmid: u32) {
    let mut vm = sim.new_vm(vmid, "pve1", &format!("vm{vmid}"));
    vm.pool = None;
    sim.insert_vm(vm).expect("seed VM");
}

/// Resize and wait for the task; its exit status.
async fn resize(api: &Api, vmid: u32, disk: &str, size: &str) -> String {
    let r = api
        .put(
            &format!("/nodes/pve1/qemu/{vmid}/resize"),
            &[("disk", disk), ("size", size)],
        )
        .await;
    let t = api.wait_task_of(r).await;
    t["exitstatus"].as_str().unwrap_or_default().to_string()
}

async fn scsi0(api: &Api, vmid: u32) -> String {
    let c = api
        .get(&format!("/nodes/pve1/qemu/{vmid}/config"), &[])
        .await;
    c.data()["scsi0"].as_str().unwrap_or_default().to_string()
}

/// qemu-server `resize_vm`: the answer is a `resize` task's UPID; `+N`
/// adds to the volume's size, `N` is the new size; a smaller one dies
/// `shrinking disks is not supported`, the same one changes nothing, a
/// missing drive `disk 'X' does not exist`; the new size is written into
/// the drive's `size` and counts against the storage.
#[tokio::test]
async fn resize_grows_scsi0_as_resize_vm_does() {
    let (sim, api) = start_sim(cfg()).await;
    seed(&sim, 101);
    let r = api
        .put(
            "/nodes/pve1/qemu/101/resize",
            &[("disk", "scsi0"), ("size", "+8G")],
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let upid = r.data().as_str().expect("a UPID").to_string();
    assert!(upid.contains(":resize:101:"), "{upid}");
    assert_eq!(api.wait_task(&upid).await["exitstatus"], "OK");
    assert_eq!(scsi0(&api, 101).await, "local-lvm:vm-101-disk-0,size=40G");

    assert_eq!(resize(&api, 101, "scsi0", "48G").await, "OK");
    assert_eq!(scsi0(&api, 101).await, "local-lvm:vm-101-disk-0,size=48G");
    assert_eq!(resize(&api, 101, "scsi0", "48G").await, "OK", "same size");
    assert_eq!(
        resize(&api, 101, "scsi0", "40G").await,
        "shrinking disks is not supported"
    );
    assert_eq!(
        resize(&api, 101, "scsi1", "+1G").await,
        "disk 'scsi1' does not exist"
    );
    // Template 9000's 32G and VM 101's 48G on pve1's local-lvm.
    let st = api.get("/nodes/pve1/storage/local-lvm/status", &[]).await;
    assert_eq!(st.data()["used"], 80u64 << 30);
    shutdown_clean(sim).await;
}

/// qemu-server `resize_vm` runs under the config lock and calls
/// `check_lock`: a locked VM's resize task fails `VM is locked (X)`; and
/// the grown disk must fit the storage, whose allocation fails as it does
/// for a new disk (`room_for`).
#[tokio::test]
async fn resize_respects_the_lock_and_the_storage_room() {
    let (sim, api) = start_sim(cfg()).await;
    seed(&sim, 101);
    assert!(sim.set_lock(101, Some("backup")));
    assert_eq!(
        resize(&api, 101, "scsi0", "+1G").await,
        "VM is locked (backup)"
    );
    assert!(sim.set_lock(101, None));
    // 100G, 32G of it the template's: 68G is the most VM 101 may have.
    let full = resize(&api, 101, "scsi0", "69G").await;
    assert!(full.contains("insufficient free space"), "{full}");
    assert_eq!(scsi0(&api, 101).await, "local-lvm:vm-101-disk-0,size=32G");
    assert_eq!(resize(&api, 101, "scsi0", "68G").await, "OK");
    shutdown_clean(sim).await;
}

/// qemu-server `resize_vm`: `VM.Config.Disk` on `/vms/{vmid}` before
/// anything (403), `Datastore.AllocateSpace` on the volume's storage in
/// the worker (a failed task), and `skiplock` only for root@pam (400).
#[tokio::test]
async fn resize_checks_its_privileges() {
    let (sim, api) = start_sim(SimConfig {
        dropped_privileges: vec![
            ("/vms/101".into(), "VM.Config.Disk".into()),
            (
                "/storage/local-lvm".into(),
                "Datastore.AllocateSpace".into(),
            ),
        ],
        ..cfg()
    })
    .await;
    seed(&sim, 101);
    seed(&sim, 102);
    let r = api
        .put(
            "/nodes/pve1/qemu/101/resize",
            &[("disk", "scsi0"), ("size", "+1G")],
        )
        .await;
    assert_eq!(r.status, 403);
    assert_eq!(
        r.message(),
        "Permission check failed (/vms/101, VM.Config.Disk)"
    );
    assert_eq!(
        resize(&api, 102, "scsi0", "+1G").await,
        "Permission check failed (/storage/local-lvm, Datastore.AllocateSpace)"
    );
    let r = api
        .put(
            "/nodes/pve1/qemu/102/resize",
            &[("disk", "scsi0"), ("size", "+1G"), ("skiplock", "1")],
        )
        .await;
    assert_eq!(r.status, 400);
    assert_eq!(
        r.body["errors"]["skiplock"],
        "Only root may use this option."
    );
    shutdown_clean(sim).await;
}
