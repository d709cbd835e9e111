//! Switching from the reference implementation: its JSON state at the
//! `--state` path is imported once, kept as `<path>.reference-backup`, and
//! replaced by a database at the same path.

use std::collections::HashMap;

use bigfleet_proto::v1alpha1 as pb;
use providerkit::{FenceMark, State, Store, StoreErrorKind};
use sqlite_store::{Imported, Origin, SqliteStore};

/// A document in the published layout, as the reference writes it
/// (indented, `null` for empty maps and lists).
const REFERENCE: &str = r#"{
  "machines": [
    {
      "ID": "m-1",
      "State": "Configured",
      "Host": { "Provider": "proxmox", "Ref": "pve1/101" },
      "InstanceType": "pve.small",
      "Zone": "pve1",
      "CapacityType": "OnDemand",
      "PricePerHour": 0.25,
      "InterruptionProbability": 0,
      "Resources": { "cpu": "2" },
      "Allocatable": null,
      "Labels": { "zone": "pve1" },
      "Cluster": "c1",
      "ShardMetadata": { "k": "v\u00e9rbatim" },
      "LastError": ""
    },
    {
      "ID": "m-2",
      "State": "Speculative",
      "Host": { "Provider": "", "Ref": "" },
      "InstanceType": "pve.small",
      "Zone": "pve2",
      "CapacityType": "OnDemand",
      "PricePerHour": 0.25,
      "InterruptionProbability": 0,
      "Resources": null,
      "Allocatable": null,
      "Labels": null,
      "Cluster": "",
      "ShardMetadata": null,
      "LastError": ""
    }
  ],
  "fences": [
    { "shard_id": "shard-a", "machine_id": "m-1", "epoch": 3, "sequence": 17 },
    { "shard_id": "shard-b", "machine_id": "m-2", "epoch": 1, "sequence": 2 }
  ],
  "ops": [
    { "machine_id": "m-1", "kind": "create", "operation_id": "op-7" },
    { "machine_id": "m-1", "kind": "configure", "operation_id": "op-9" },
    { "machine_id": "gone", "kind": "create", "operation_id": "op-1" }
  ],
  "rev": 12,
  "next_op": 10
}
"#;

fn sorted(mut f: Vec<FenceMark>) -> Vec<FenceMark> {
    f.sort_by(|a, b| (&a.shard_id, &a.machine_id).cmp(&(&b.shard_id, &b.machine_id)));
    f
}

#[test]
fn reference_state_is_imported_once_with_a_backup() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.json");
    std::fs::write(&path, REFERENCE).unwrap();
    let backup = dir.path().join("state.json.reference-backup");
    {
        let store = SqliteStore::open(&path).unwrap();
        let report = store.report();
        assert_eq!(
            report.origin,
            Origin::Imported(Imported {
                backup: backup.clone(),
                operation_ids: 2,
            })
        );
        assert_eq!((report.machines, report.fence_marks), (2, 2));
        let loaded = store.load().unwrap();
        let by_id: HashMap<&str, _> = loaded.machines.iter().map(|m| (m.id(), m)).collect();
        let m1 = by_id["m-1"];
        assert_eq!(m1.state, State::Configured);
        assert_eq!(m1.cluster, "c1");
        assert_eq!(m1.shard_metadata["k"], "v\u{e9}rbatim");
        assert_eq!(
            m1.host,
            Some(pb::HostRef {
                provider: "proxmox".into(),
                r#ref: "pve1/101".into()
            })
        );
        assert_eq!(
            m1.ops,
            [Some("op-7".into()), Some("op-9".into()), None, None]
        );
        assert_eq!(m1.facts.instance_type, "pve.small");
        assert_eq!(m1.facts.capacity_type, pb::CapacityType::OnDemand);
        assert_eq!(m1.facts.resources["cpu"], "2");
        let m2 = by_id["m-2"];
        assert_eq!(m2.state, State::Speculative);
        assert_eq!(m2.host, None, "an empty host is no host");
        assert_eq!(
            sorted(loaded.fences),
            vec![
                FenceMark {
                    shard_id: "shard-a".into(),
                    machine_id: "m-1".into(),
                    epoch: 3,
                    sequence: 17
                },
                FenceMark {
                    shard_id: "shard-b".into(),
                    machine_id: "m-2".into(),
                    epoch: 1,
                    sequence: 2
                },
            ]
        );
    }
    assert_eq!(std::fs::read_to_string(&backup).unwrap(), REFERENCE);
    let head = std::fs::read(&path).unwrap();
    assert!(
        head.starts_with(b"SQLite format 3\0"),
        "the path now holds SQLite"
    );
    let leftovers: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("importing") || n.contains("creating"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // Once: the next open loads the database.
    let store = SqliteStore::open(&path).unwrap();
    assert_eq!(store.report().origin, Origin::Loaded);
    assert_eq!(store.load().unwrap().machines.len(), 2);
}

#[test]
fn per_shard_marks_of_earlier_versions_fence_every_machine() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.json");
    let doc = r#"{"machines":[
        {"ID":"m-1","State":"Idle"},{"ID":"m-2","State":"Draining"}],
      "fences":{"shard-a":{"Epoch":2,"Sequence":5}},
      "ops":null,"rev":3,"next_op":1}"#;
    std::fs::write(&path, doc).unwrap();
    let store = SqliteStore::open(&path).unwrap();
    let loaded = store.load().unwrap();
    let fences = sorted(loaded.fences);
    assert_eq!(fences.len(), 2);
    assert!(fences
        .iter()
        .all(|f| f.shard_id == "shard-a" && f.epoch == 2 && f.sequence == 5));
    assert_eq!(fences[0].machine_id, "m-1");
    assert_eq!(fences[1].machine_id, "m-2");
}

#[test]
fn unreadable_json_is_refused_and_left_alone() {
    for (doc, expect) in [
        (r#"{"machines": [ {"ID": "m-1"#, "EOF"),
        (
            r#"{"machines":[{"ID":"m-1","State":"Hovering"}],"fences":null}"#,
            "Hovering",
        ),
        (
            r#"{"machines":[{"ID":"m-1","State":"Idle"},{"ID":"m-1","State":"Idle"}],"fences":[]}"#,
            "listed twice",
        ),
        (
            r#"{"machines":[{"ID":"m-1","State":"Idle"}], "fences": [],
               "ops":[{"machine_id":"m-1","kind":"resize","operation_id":"o"}]}"#,
            "resize",
        ),
    ] {
        assert_refused_untouched(
            doc,
            "reference implementation's JSON state but cannot be imported",
            expect,
        );
    }
}

#[test]
fn a_json_parse_failure_keeps_the_parser_error_as_its_source() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.json");
    std::fs::write(&path, r#"{"machines": [ {"ID": "m-1"#).unwrap();
    let err = SqliteStore::open(&path).err().expect("must be refused");
    let source = std::error::Error::source(&err).expect("the parser's error is kept");
    assert!(source.is::<serde_json::Error>(), "{source:?}");
    assert!(err.to_string().contains(&source.to_string()), "{err}");
}

/// Opening `doc` as a state file is refused as corrupt with both texts in
/// the message, and neither the file nor a backup is touched.
fn assert_refused_untouched(doc: &str, reason: &str, detail: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.json");
    std::fs::write(&path, doc).unwrap();
    let err = SqliteStore::open(&path).err().expect("must be refused");
    assert_eq!(err.kind(), StoreErrorKind::Corrupt, "{err}");
    let text = err.to_string();
    assert!(
        text.contains(reason) && text.contains(detail),
        "{doc}: {text}"
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), doc, "untouched");
    assert!(!dir.path().join("state.json.reference-backup").exists());
}

#[test]
fn other_json_is_refused_and_left_alone() {
    for (doc, expect) in [
        (r#"{"fences": {}}"#, r#"no "machines" key"#),
        (
            r#"{"machines": [], "fences": [], "name": "x"}"#,
            r#"unexpected key "name""#,
        ),
    ] {
        assert_refused_untouched(
            doc,
            "is not a valid state database: it is JSON but not the reference",
            expect,
        );
    }
}

#[test]
fn a_differing_backup_is_not_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.json");
    std::fs::write(&path, REFERENCE).unwrap();
    let backup = dir.path().join("state.json.reference-backup");
    std::fs::write(&backup, "something else").unwrap();
    let err = SqliteStore::open(&path).err().expect("must be refused");
    assert!(err.to_string().contains("exists and differs"), "{err}");
    assert_eq!(std::fs::read_to_string(&backup).unwrap(), "something else");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), REFERENCE);

    // The backup of an interrupted import (same bytes) is reused.
    std::fs::write(&backup, REFERENCE).unwrap();
    let store = SqliteStore::open(&path).unwrap();
    assert!(matches!(store.report().origin, Origin::Imported(_)));
}

#[test]
fn a_new_json_path_is_created_as_a_database() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.json");
    let store = SqliteStore::open(&path).unwrap();
    assert_eq!(store.report().origin, Origin::Created);
    drop(store);
    assert!(std::fs::read(&path)
        .unwrap()
        .starts_with(b"SQLite format 3\0"));
    assert!(!dir.path().join("state.json.reference-backup").exists());
}
