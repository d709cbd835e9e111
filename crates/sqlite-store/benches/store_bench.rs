//! Durable mutations/s, ack latency and restart time of [`SqliteStore`]
//! against a naive baseline that rewrites the whole state as one JSON file
//! and fsyncs it for every mutation.
//!
//! `cargo bench -p sqlite-store --bench store_bench [-- SECONDS_PER_CASE]`
//! (default 3 s per case). Each mutation is what an accepted transition
//! writes: one fencing mark and one machine record.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bigfleet_proto::v1alpha1 as pb;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use providerkit::{
    CatalogFacts, Change, FenceMark, Loaded, MachineRecord, SharedFacts, State, Store, StoreError,
    Ticket,
};
use sqlite_store::SqliteStore;

const SIZES: [usize; 3] = [1_000, 10_000, 100_000];
const CLIENTS: [usize; 2] = [1, 16];

/// Three offerings (one per zone); every machine shares its offering's facts.
fn offering(i: usize) -> SharedFacts {
    static OFFERINGS: OnceLock<Vec<SharedFacts>> = OnceLock::new();
    let offerings = OFFERINGS.get_or_init(|| {
        let resources = HashMap::from([
            ("cpu".to_string(), "8".to_string()),
            ("memory".to_string(), "32Gi".to_string()),
            ("ephemeral-storage".to_string(), "100Gi".to_string()),
        ]);
        (0..3)
            .map(|z| {
                CatalogFacts {
                    instance_type: "pve.8c32g".into(),
                    zone: format!("zone-{z}"),
                    capacity_type: pb::CapacityType::OnDemand,
                    price_per_hour: 0.42,
                    interruption_probability: 0.0,
                    resources: resources.clone(),
                    allocatable: resources.clone(),
                    labels: (0..5)
                        .map(|k| (format!("label-{k}"), format!("value-{k}-{z}")))
                        .collect(),
                }
                .share()
            })
            .collect()
    });
    offerings[i % offerings.len()].clone()
}

fn machine_record(i: usize, rev: u64) -> MachineRecord {
    let mut r = MachineRecord::new(format!("pve-slot-{i:07}"), offering(i), rev);
    r.state = State::Configured;
    r.host = Some(pb::HostRef {
        provider: "proxmox".into(),
        r#ref: format!("node{}/{}", i % 16, 100 + i),
    });
    r.cluster = "cluster-prod-1".into();
    r.shard_metadata = (0..4)
        .map(|k| (format!("bigfleet.io/key-{k}"), format!("meta-{k}-{i}")))
        .collect();
    r.ops = [
        Some(format!("op-1-{i:x}")),
        Some(format!("op-1-{:x}", i + 1)),
        None,
        None,
    ];
    r
}

// ---------------------------------------------------------------------------
// The naive baseline: whole state as JSON, rewritten + fsynced per mutation.

#[derive(serde::Serialize)]
struct JsonOut<'a> {
    id: &'a str,
    rev: u64,
    state: i32,
    host: Option<&'a str>,
    instance_type: &'a str,
    zone: &'a str,
    capacity_type: i32,
    price_per_hour: f64,
    interruption_probability: f64,
    resources: Option<&'a HashMap<String, String>>,
    allocatable: Option<&'a HashMap<String, String>>,
    labels: &'a HashMap<String, String>,
    last_error: &'a str,
    cluster: &'a str,
    shard_metadata: &'a HashMap<String, String>,
    ops: &'a [Option<String>; 4],
}

#[derive(serde::Deserialize)]
#[allow(dead_code)]
struct JsonIn {
    id: String,
    rev: u64,
    state: i32,
    host: Option<String>,
    instance_type: String,
    zone: String,
    capacity_type: i32,
    price_per_hour: f64,
    interruption_probability: f64,
    resources: Option<HashMap<String, String>>,
    allocatable: Option<HashMap<String, String>>,
    labels: HashMap<String, String>,
    last_error: String,
    cluster: String,
    shard_metadata: HashMap<String, String>,
    ops: [Option<String>; 4],
}

#[derive(serde::Serialize, serde::Deserialize)]
struct JsonFence {
    shard_id: String,
    machine_id: String,
    epoch: i64,
    sequence: i64,
}

#[derive(Default)]
struct NaiveState {
    ticket: Ticket,
    machines: HashMap<String, Arc<MachineRecord>>,
    fences: HashMap<(String, String), (i64, i64)>,
}

struct NaiveJsonStore {
    path: PathBuf,
    state: Arc<Mutex<NaiveState>>,
    /// One writer at a time; every durable() call rewrites the file itself.
    write: Arc<Mutex<()>>,
}

impl NaiveJsonStore {
    fn new(path: &Path) -> NaiveJsonStore {
        NaiveJsonStore {
            path: path.to_path_buf(),
            state: Arc::default(),
            write: Arc::default(),
        }
    }

    fn rewrite(path: &Path, state: &Mutex<NaiveState>) -> std::io::Result<()> {
        let bytes = {
            let state = state.lock();
            let machines: Vec<JsonOut<'_>> = state
                .machines
                .values()
                .map(|r| {
                    let f = &r.facts;
                    JsonOut {
                        id: &r.id,
                        rev: r.rev,
                        state: r.state.to_wire() as i32,
                        host: r.host.as_ref().map(|h| h.r#ref.as_str()),
                        instance_type: &f.instance_type,
                        zone: &f.zone,
                        capacity_type: f.capacity_type as i32,
                        price_per_hour: f.price_per_hour,
                        interruption_probability: f.interruption_probability,
                        resources: Some(&f.resources),
                        allocatable: Some(&f.allocatable),
                        labels: &f.labels,
                        last_error: &r.last_error,
                        cluster: &r.cluster,
                        shard_metadata: &r.shard_metadata,
                        ops: &r.ops,
                    }
                })
                .collect();
            let fences: Vec<JsonFence> = state
                .fences
                .iter()
                .map(|((s, m), (e, q))| JsonFence {
                    shard_id: s.clone(),
                    machine_id: m.clone(),
                    epoch: *e,
                    sequence: *q,
                })
                .collect();
            serde_json::to_vec(&serde_json::json!({ "machines": machines, "fences": fences }))
                .map_err(std::io::Error::other)?
        };
        let tmp = path.with_extension("tmp");
        let mut file = File::create(&tmp)?;
        file.write_all(&bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)?;
        File::open(path.parent().unwrap_or(Path::new(".")))?.sync_all()
    }

    fn restart_time(&self) -> Duration {
        let started = Instant::now();
        let bytes = std::fs::read(&self.path).unwrap();
        #[derive(serde::Deserialize)]
        struct Doc {
            machines: Vec<JsonIn>,
            #[allow(dead_code)]
            fences: Vec<JsonFence>,
        }
        let doc: Doc = serde_json::from_slice(&bytes).unwrap();
        assert!(!doc.machines.is_empty());
        started.elapsed()
    }
}

impl Store for NaiveJsonStore {
    fn load(&self) -> Result<Loaded, StoreError> {
        Ok(Loaded {
            boot_generation: 1,
            ..Loaded::default()
        })
    }

    fn submit(&self, changes: Vec<Change>) -> Ticket {
        let mut state = self.state.lock();
        for change in changes {
            match change {
                Change::Machine(r) => {
                    state.machines.insert(r.id.clone(), r);
                }
                Change::Fence(f) => {
                    state
                        .fences
                        .insert((f.shard_id, f.machine_id), (f.epoch, f.sequence));
                }
            }
        }
        state.ticket += 1;
        state.ticket
    }

    fn durable(&self, _ticket: Ticket) -> BoxFuture<'static, Result<(), StoreError>> {
        let path = self.path.clone();
        let state = Arc::clone(&self.state);
        let write = Arc::clone(&self.write);
        Box::pin(async move {
            tokio::task::spawn_blocking(move || {
                let _one_writer = write.lock();
                NaiveJsonStore::rewrite(&path, &state)
                    .map_err(|e| StoreError::unavailable(format!("{}: {e}", path.display())))
            })
            .await
            .map_err(|e| StoreError::unavailable(e.to_string()))?
        })
    }

    fn describe(&self) -> String {
        format!("json:{}", self.path.display())
    }
}

// ---------------------------------------------------------------------------

struct Figures {
    ops: usize,
    per_sec: f64,
    p50: Duration,
    p99: Duration,
}

/// `clients` tasks each loop submit + durable until `budget` has passed
/// (every client completes at least one mutation).
async fn drive(store: Arc<dyn Store>, n: usize, clients: usize, budget: Duration) -> Figures {
    let rev = Arc::new(AtomicU64::new(n as u64 + 1));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..clients {
        let store = Arc::clone(&store);
        let rev = Arc::clone(&rev);
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut k = 0usize;
            loop {
                let i = (c + k * clients) % n;
                k += 1;
                let rev = rev.fetch_add(1, Ordering::Relaxed);
                let mut record = machine_record(i, rev);
                record.state = if k.is_multiple_of(2) {
                    State::Idle
                } else {
                    State::Configuring
                };
                let fence = FenceMark {
                    shard_id: format!("shard-{c}"),
                    machine_id: record.id.clone(),
                    epoch: 1,
                    sequence: rev as i64,
                };
                let t0 = Instant::now();
                let ticket = store.submit(vec![
                    Change::Fence(fence),
                    Change::Machine(Arc::new(record)),
                ]);
                store.durable(ticket).await.unwrap();
                latencies.push(t0.elapsed());
                if started.elapsed() >= budget {
                    return latencies;
                }
            }
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let elapsed = started.elapsed();
    all.sort_unstable();
    let pct = |p: f64| all[((all.len() as f64 * p).ceil() as usize).clamp(1, all.len()) - 1];
    Figures {
        ops: all.len(),
        per_sec: all.len() as f64 / elapsed.as_secs_f64(),
        p50: pct(0.50),
        p99: pct(0.99),
    }
}

fn ms(d: Duration) -> String {
    format!("{:.2}ms", d.as_secs_f64() * 1e3)
}

fn main() {
    let budget = Duration::from_secs_f64(
        std::env::args()
            .skip(1)
            .find_map(|a| a.parse::<f64>().ok())
            .unwrap_or(3.0),
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    println!(
        "store   machines clients    ops   mut/s      p50       p99   (commits)   [{}s per case, dir {}]",
        budget.as_secs_f64(),
        dir.path().display()
    );
    let mut restart = Vec::new();
    let mut results: HashMap<(&str, usize, usize), f64> = HashMap::new();
    for n in SIZES {
        // SQLite.
        let path = dir.path().join(format!("state-{n}.db"));
        let store = Arc::new(SqliteStore::open(&path).unwrap());
        store.load().unwrap();
        let ticket = store.submit(
            (0..n)
                .map(|i| Change::Machine(Arc::new(machine_record(i, i as u64 + 1))))
                .collect(),
        );
        rt.block_on(store.durable(ticket)).unwrap();
        for clients in CLIENTS {
            let before = store.commits();
            let f = rt.block_on(drive(store.clone(), n, clients, budget));
            let commits = store.commits() - before;
            println!(
                "sqlite  {n:>8} {clients:>7} {:>6} {:>7.0} {:>9} {:>9}   ({commits}, {:.1} muts/commit)",
                f.ops,
                f.per_sec,
                ms(f.p50),
                ms(f.p99),
                f.ops as f64 / commits.max(1) as f64
            );
            results.insert(("sqlite", n, clients), f.per_sec);
        }
        drop(store);
        let started = Instant::now();
        let store = SqliteStore::open(&path).unwrap();
        let loaded = store.load().unwrap();
        let sqlite_restart = started.elapsed();
        assert_eq!(loaded.machines.len(), n);
        drop(store);

        // Naive JSON.
        let json = NaiveJsonStore::new(&dir.path().join(format!("state-{n}.json")));
        let json = Arc::new(json);
        json.submit(
            (0..n)
                .map(|i| Change::Machine(Arc::new(machine_record(i, i as u64 + 1))))
                .collect(),
        );
        rt.block_on(json.durable(0)).unwrap();
        let mut one_rewrite = Duration::ZERO;
        for clients in CLIENTS {
            // Rewrites serialize, so every client waits for all the others:
            // when that alone blows the budget, report the 1-client rate.
            if clients > 1 && one_rewrite * clients as u32 > budget * 2 {
                println!(
                    "json    {n:>8} {clients:>7}  skipped: {clients} serialized rewrites of ~{} each; \
                     rate = the 1-client rate, p99 >= {}",
                    ms(one_rewrite),
                    ms(one_rewrite * clients as u32)
                );
                let single = results[&("json", n, 1)];
                results.insert(("json", n, clients), single);
                continue;
            }
            let f = rt.block_on(drive(json.clone(), n, clients, budget));
            if clients == 1 {
                one_rewrite = f.p50;
            }
            println!(
                "json    {n:>8} {clients:>7} {:>6} {:>7.1} {:>9} {:>9}",
                f.ops,
                f.per_sec,
                ms(f.p50),
                ms(f.p99)
            );
            results.insert(("json", n, clients), f.per_sec);
        }
        let json_restart = json.restart_time();
        let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        restart.push((
            n,
            sqlite_restart,
            json_restart,
            size(&path),
            size(&json.path),
        ));
    }
    println!("\nrestart (open + load)   machines   sqlite      json    file sizes (sqlite / json)");
    for (n, s, j, ss, js) in restart {
        println!(
            "                        {n:>8} {:>9} {:>9}    {:.1} MB / {:.1} MB",
            ms(s),
            ms(j),
            ss as f64 / 1e6,
            js as f64 / 1e6
        );
    }
    println!("\nthroughput ratio sqlite / json (durable mutations per second)");
    for n in SIZES {
        for clients in CLIENTS {
            println!(
                "  {n:>8} machines, {clients:>2} clients: {:>8.1}x",
                results[&("sqlite", n, clients)] / results[&("json", n, clients)]
            );
        }
    }
}
