//! Property tests (the fuzz targets) for decoding persisted records: any
//! bytes in a record are refused with an error or decoded, never a panic;
//! every record the store writes decodes to itself; and a state file whose
//! rows were overwritten with arbitrary bytes is refused clearly on open.
//!
//! CI runs a few cases per property; `make fuzz` runs many
//! (`PROPTEST_CASES=100000`).

use bigfleet_proto::v1alpha1 as pb;
use proptest::prelude::*;
use provider_testkit::fuzz::{cases, config, config_with_cases};
use providerkit::{CatalogFacts, Change, FactsInterner, MachineRecord, State, Store};
use sqlite_store::SqliteStore;

fn state() -> impl Strategy<Value = State> {
    prop::sample::select(vec![
        State::Speculative,
        State::Creating,
        State::Idle,
        State::Configuring,
        State::Configured,
        State::Draining,
        State::Deleting,
        State::Failed,
    ])
}

prop_compose! {
    fn record()(
        id in "[!-~]{1,40}",
        rev in 1u64..u64::MAX / 2,
        state in state(),
        host in proptest::option::of(("[a-z]{0,8}", "[!-~]{0,20}")),
        instance_type in ".{0,12}",
        zone in ".{0,8}",
        price in 0.0f64..1e6,
        labels in prop::collection::hash_map(".{0,8}", ".{0,8}", 0..4),
        last_error in ".{0,64}",
        cluster in ".{0,16}",
        metadata in prop::collection::hash_map(".{0,8}", ".{0,16}", 0..6),
        ops in prop::array::uniform4(proptest::option::of("[!-~]{1,16}")),
    ) -> MachineRecord {
        let facts = CatalogFacts {
            instance_type,
            zone,
            price_per_hour: price,
            labels,
            ..Default::default()
        }
        .share();
        let mut r = MachineRecord::new(id, facts, rev);
        r.state = state;
        r.host = host.map(|(provider, r#ref)| pb::HostRef { provider, r#ref });
        r.last_error = last_error;
        r.cluster = cluster;
        r.shard_metadata = metadata;
        r.ops = ops;
        r
    }
}

fn damage() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..256),
        // A valid-looking start (field 1, a length) followed by junk.
        prop::collection::vec(any::<u8>(), 0..64).prop_map(|mut v| {
            v.splice(0..0, [0x0a, 0x7f]);
            v
        }),
    ]
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn arbitrary_record_bytes_never_panic(bytes in damage(), rev in any::<u64>()) {
        let mut interner = FactsInterner::new();
        let _ = MachineRecord::decode_wire(&bytes, rev, Default::default(), &mut interner);
    }

    #[test]
    fn written_records_decode_to_themselves(r in record()) {
        let bytes = r.encoded();
        let mut interner = FactsInterner::new();
        let back = MachineRecord::decode_wire(bytes.as_bytes(), r.rev, r.ops.clone(), &mut interner)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(back, r);
    }
}

proptest! {
    // Each case opens a database: fewer of them.
    #![proptest_config(config_with_cases((cases() / 8).max(4)))]

    #[test]
    fn damaged_state_rows_are_refused_or_loaded_never_a_panic(
        r in record(),
        bytes in damage(),
        id_junk in proptest::option::of(".{0,16}"),
        rev in any::<i64>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.db");
        {
            let store = SqliteStore::open(&path).unwrap();
            store.load().unwrap();
            let ticket = store.submit(vec![Change::Machine(std::sync::Arc::new(r.clone()))]);
            futures::executor::block_on(store.durable(ticket)).unwrap();
        }
        {
            let conn = rusqlite::Connection::open(&path).unwrap();
            conn.execute("UPDATE machines SET record = ?1, rev = ?2", rusqlite::params![bytes, rev])
                .unwrap();
            if let Some(id) = &id_junk {
                conn.execute("UPDATE machines SET id = ?1", [id]).unwrap();
            }
        }
        match SqliteStore::open(&path).and_then(|s| s.load()) {
            Ok(loaded) => prop_assert!(loaded.machines.len() <= 1),
            Err(e) => prop_assert!(
                e.to_string().contains(&path.display().to_string()),
                "the refusal names the file: {e}"
            ),
        }
    }
}
