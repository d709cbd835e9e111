//! Where restart time goes: open vs load at 100k machines, repeated.
//! `cargo run --release -p sqlite-store --example load_timing -- /tmp/x.db`
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use bigfleet_proto::v1alpha1 as pb;
use providerkit::{CatalogFacts, Change, MachineRecord, SharedFacts, State, Store};
use sqlite_store::SqliteStore;

/// Four offerings, as a catalogue has a handful; machines share their facts.
fn record(i: usize, offerings: &[SharedFacts]) -> MachineRecord {
    let mut r = MachineRecord::new(
        format!("pve-slot-{i:07}"),
        offerings[i % offerings.len()].clone(),
        i as u64 + 1,
    );
    r.state = State::Configured;
    r.host = Some(pb::HostRef {
        provider: "proxmox".into(),
        r#ref: format!("node1/{i}"),
    });
    r.shard_metadata = (0..4)
        .map(|k| (format!("meta-{k}"), format!("value-{k}-{i}")))
        .collect();
    r.cluster = "cluster-prod-1".into();
    r.ops = [
        Some(format!("op-1-{i:x}")),
        Some(format!("op-2-{i:x}")),
        None,
        None,
    ];
    r
}

fn offerings() -> Vec<SharedFacts> {
    let map = |p: &str, n: usize, o: usize| -> HashMap<String, String> {
        (0..n)
            .map(|k| (format!("{p}-{k}"), format!("value-{k}-{o}")))
            .collect()
    };
    (0..4)
        .map(|o| {
            CatalogFacts {
                instance_type: format!("pve.type{o}"),
                zone: "zone-1".into(),
                resources: map("r", 3, o),
                allocatable: map("a", 3, o),
                labels: map("label", 5, o),
                ..Default::default()
            }
            .share()
        })
        .collect()
}

fn main() {
    let path = std::path::PathBuf::from(std::env::args().nth(1).expect("path to a state db"));
    if !path.exists() {
        let store = SqliteStore::open(&path).unwrap();
        store.load().unwrap();
        let offerings = offerings();
        let t = store.submit(
            (0..100_000)
                .map(|i| Change::Machine(Arc::new(record(i, &offerings))))
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
#[allow(unsafe_code)] // libc call; see the SAFETY note inside
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
