//! Migration, template conversion, storage reads and disk sizes.

use pve::{MigrateParams, VmConfig};
use serde_json::json;

use crate::common::*;

const UPID_MIGRATE: &str =
    "UPID:pve1:00000ACD:00006AE8:679A423B:qmigrate:300:bigfleet@pve!autoscaler:";
const UPID_TEMPLATE: &str =
    "UPID:pve2:00000ACE:00006AE8:679A423B:qmtemplate:300:bigfleet@pve!autoscaler:";

#[tokio::test]
async fn migrate_template_and_storage_calls() {
    let leaf = self_signed_leaf(&["localhost"]);
    let srv = serve(&leaf, |r, _| {
        if r.path.ends_with("/migrate") {
            ok(json!(UPID_MIGRATE))
        } else if r.path.ends_with("/template") {
            ok(json!(UPID_TEMPLATE))
        } else if r.path.ends_with("/status") {
            // Numbers as strings and booleans as 0/1: parsed leniently.
            ok(
                json!({"type": "lvmthin", "shared": 0, "total": "107374182400",
                      "used": 34359738368u64, "avail": 73014444032u64, "active": 1}),
            )
        } else {
            ok(json!([
                {"storage": "local", "type": "dir", "shared": 0, "total": 1, "used": 0, "avail": 1},
                {"storage": "ceph-pool", "type": "rbd", "shared": 1},
                {"storage": "thick", "type": "lvm", "shared": 0}
            ]))
        }
    })
    .await;
    let (c, _) = client(&srv.url(), None, vec![leaf.fingerprint()]);

    let upid = c
        .migrate(
            "pve1",
            300,
            &MigrateParams {
                target: "pve2".into(),
                online: false,
                with_local_disks: true,
                targetstorage: Some("local-lvm".into()),
            },
        )
        .await
        .unwrap();
    assert_eq!(upid.task_type, "qmigrate");
    let upid = c.convert_to_template("pve2", 300).await.unwrap();
    assert_eq!(upid.task_type, "qmtemplate");
    let st = c.storage_status("pve2", "local-lvm").await.unwrap();
    assert_eq!(st.storage.as_deref(), Some("local-lvm"));
    assert_eq!((st.kind.as_str(), st.shared), ("lvmthin", false));
    assert_eq!(
        (st.total, st.avail),
        (Some(100 << 30), Some(73_014_444_032))
    );
    assert!(st.supports_linked_clones());
    let all = c.node_storages("pve2").await.unwrap();
    let kinds: Vec<(&str, bool, bool)> = all
        .iter()
        .map(|s| {
            (
                s.storage.as_deref().unwrap_or_default(),
                s.shared,
                s.supports_linked_clones(),
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            ("local", false, true),
            ("ceph-pool", true, true),
            ("thick", false, false)
        ]
    );

    let reqs = srv.recorded();
    assert_eq!(reqs[0].path, "/api2/json/nodes/pve1/qemu/300/migrate");
    assert_eq!(
        reqs[0].body,
        "target=pve2&online=0&with-local-disks=1&targetstorage=local-lvm"
    );
    assert_eq!(
        (reqs[1].method.as_str(), reqs[1].path.as_str()),
        ("POST", "/api2/json/nodes/pve2/qemu/300/template")
    );
    assert_eq!(
        reqs[2].path,
        "/api2/json/nodes/pve2/storage/local-lvm/status"
    );
    assert_eq!(reqs[3].path, "/api2/json/nodes/pve2/storage");
}

#[test]
fn disk_sizes_are_read_from_the_config() {
    let cfg: VmConfig = serde_json::from_value(json!({
        "scsi0": "local-lvm:base-9000-disk-0,size=32G",
        "scsi1": "ceph-pool:vm-9000-disk-1,cache=none,size=512M",
        "efidisk0": "local-lvm:vm-9000-disk-2,efitype=4m,size=4M",
        "virtio0": "local-lvm:vm-9000-disk-3",
        "ide2": "local:iso/debian.iso,media=cdrom,size=600M",
        "unused0": "local-lvm:vm-9000-disk-9",
        "sata0": "/dev/sdb,size=1T"
    }))
    .unwrap();
    let mut disks = cfg.disks();
    disks.sort();
    assert_eq!(
        disks,
        [
            ("efidisk0".to_string(), "local-lvm".to_string(), 4 << 20),
            ("scsi0".into(), "local-lvm".into(), 32 << 30),
            ("scsi1".into(), "ceph-pool".into(), 512 << 20),
            ("virtio0".into(), "local-lvm".into(), 0),
        ]
    );
}
