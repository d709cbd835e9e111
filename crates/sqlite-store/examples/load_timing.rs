//! Where restart time goes: open vs load at 100k machines, repeated.
//! `cargo run --release -p sqlite-store --example load_timing -- /tmp/x.db`
use std::collections::HashMap;
use std::time::Instant;

use bigfleet_proto::v1alpha1 as pb;
use providerkit::{Change, MachineRecord, Store};
use sqlite_store::SqliteStore;

fn record(i: usize) -> MachineRecord {
    let map = |p: &str, n: usize| -> HashMap<String, String> {
        (0..n)
            .map(|k| (format!("{p}-{k}"), format!("value-{k}-{i}")))
            .collect()
    };
    MachineRecord {
        machine: pb::Machine {
            id: format!("pve-slot-{i:07}"),
            state: 5,
            host: Some(pb::HostRef {
                provider: "proxmox".into(),
                r#ref: format!("node1/{i}"),
            }),
            instance_type: "pve.8c32g".into(),
            zone: "zone-1".into(),
            resources: Some(pb::Resources {
                resources: map("r", 3),
            }),
            allocatable: Some(pb::Resources {
                resources: map("a", 3),
            }),
            labels: map("label", 5),
            shard_metadata: map("meta", 4),
            cluster: "cluster-prod-1".into(),
            ..Default::default()
        },
        rev: i as u64 + 1,
        ops: [
            Some(format!("op-1-{i:x}")),
            Some(format!("op-2-{i:x}")),
            None,
            None,
        ],
    }
}

fn main() {
    let path = std::path::PathBuf::from(std::env::args().nth(1).expect("path to a state db"));
    if !path.exists() {
        let store = SqliteStore::open(&path).unwrap();
        store.load().unwrap();
        let t = store.submit(
            (0..100_000)
                .map(|i| Change::Machine(Box::new(record(i))))
                .collect(),
        );
        futures::executor::block_on(store.durable(t)).unwrap();
    }
    for _ in 0..3 {
        let t = Instant::now();
        let store = SqliteStore::open(&path).unwrap();
        let opened = t.elapsed();
        let t = Instant::now();
        let cpu = cpu_time();
        let loaded = store.load().unwrap();
        let cpu = cpu_time() - cpu;
        println!(
            "open {:?} load {:?} (cpu {:?}, {} machines)",
            opened,
            t.elapsed(),
            cpu,
            loaded.machines.len()
        );
    }
}

/// User + system CPU time of the whole process (all threads).
fn cpu_time() -> std::time::Duration {
    // SAFETY: getrusage fills the struct we pass; no other memory is touched.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let tv = |t: libc::timeval| std::time::Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}
