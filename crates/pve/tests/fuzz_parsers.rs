//! Property tests (the fuzz targets) for everything the PVE client parses
//! from the API: JSON bodies, UPIDs, tag lists and descriptions. Arbitrary
//! input never panics; what can be written can be read back.
//!
//! CI runs a few cases per property; `make fuzz` runs many
//! (`PROPTEST_CASES=100000`).

use proptest::prelude::*;
use provider_testkit::fuzz::{config, JsonShape};
use pve::types::{ClusterVm, ExecStatus, NodeInfo, PoolMember, TaskStatus, VmConfig, VmStatus};
use pve::{is_valid_tag, join_tags, normalize_tags, sanitize_tag, Upid};

/// JSON values shaped like API answers: objects with the field names the
/// types read, holding values of every JSON kind.
fn json_value() -> impl Strategy<Value = serde_json::Value> {
    JsonShape {
        keys: &[
            "vmid",
            "node",
            "name",
            "status",
            "tags",
            "description",
            "template",
            "memory",
            "cores",
            "sockets",
            "agent",
            "exitstatus",
            "upid",
            "type",
            "exited",
            "exitcode",
            "out-data",
            "err-data",
            "signal",
            "hastate",
            "lock",
            "maxmem",
            "pid",
            "n",
            "t",
            "scsi0",
            "virtio0",
            "ha",
            "pool",
            "id",
            "qmpstatus",
            "uptime",
        ],
        strings: &[".{0,24}", "[0-9]{1,12}"],
        max_members: 9,
        expected_branch_size: 8,
    }
    .values()
}

fn parse_all(body: &str) {
    let _ = serde_json::from_str::<VmConfig>(body);
    let _ = serde_json::from_str::<VmStatus>(body);
    let _ = serde_json::from_str::<TaskStatus>(body);
    let _ = serde_json::from_str::<ClusterVm>(body);
    let _ = serde_json::from_str::<Vec<ClusterVm>>(body);
    let _ = serde_json::from_str::<NodeInfo>(body);
    let _ = serde_json::from_str::<PoolMember>(body);
    let _ = serde_json::from_str::<ExecStatus>(body);
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn json_bodies_of_any_shape_never_panic(value in json_value()) {
        parse_all(&value.to_string());
    }

    #[test]
    fn arbitrary_text_bodies_never_panic(body in ".{0,200}") {
        parse_all(&body);
    }

    #[test]
    fn upid_parse_never_panics(raw in ".{0,120}") {
        let _ = Upid::parse(&raw);
    }

    #[test]
    fn upids_round_trip(
        node in "[a-z][a-z0-9-]{0,15}",
        pid in any::<u32>(),
        pstart in 0u64..=0xF_FFFF_FFFF,
        starttime in any::<u32>(),
        task_type in "[a-z]{1,10}",
        id in "[0-9]{0,6}",
        user in "[a-z]{1,8}@(pam|pve)(![a-z]{1,8})?",
    ) {
        let raw = format!("UPID:{node}:{pid:08X}:{pstart:08X}:{starttime:08X}:{task_type}:{id}:{user}:");
        let upid = Upid::parse(&raw).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(upid.as_str(), raw.as_str());
        prop_assert_eq!(&upid.node, &node);
        prop_assert_eq!(upid.pid, pid);
        prop_assert_eq!(upid.pstart, pstart);
        prop_assert_eq!(upid.starttime, starttime as u64);
        prop_assert_eq!(&upid.task_type, &task_type);
        prop_assert_eq!(&upid.id, &id);
        prop_assert_eq!(&upid.user, &user);
    }

    #[test]
    fn tags_normalise_idempotently_and_sanitise_to_valid(text in ".{0,80}") {
        let tags = normalize_tags(&text);
        prop_assert_eq!(normalize_tags(&join_tags(&tags)), tags.clone());
        prop_assert!(tags.iter().all(|t| !t.is_empty()));
        let tag = sanitize_tag(&text);
        prop_assert!(is_valid_tag(&tag), "{:?} -> {:?}", text, tag);
    }
}
