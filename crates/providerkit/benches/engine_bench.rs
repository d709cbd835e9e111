//! The engine alone, in process: no gRPC, no sockets. Shows what the
//! contract engine costs per operation, separate from the transport that
//! `loadgen` measures end to end.
//!
//! `cargo bench -p providerkit --bench engine_bench [-- SIZES]` (default
//! 1000,10000,100000). Prints one `key=value` line per figure.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bigfleet_proto::v1alpha1 as pb;
use prost::Message;
use providerkit::{
    Backend, BackendError, CatalogFacts, ConfigureCtx, CreateCtx, DeleteCtx, DrainCtx, Engine,
    EngineOptions, MemoryStore, SharedFacts, SlotSpec, State, SubstrateHost, Token,
};

/// Slots of four offerings; every transition succeeds at once.
struct InstantBackend {
    slots: Vec<SlotSpec>,
}

impl InstantBackend {
    fn new(n: usize) -> InstantBackend {
        let offerings: Vec<SharedFacts> = (0..4)
            .map(|o| {
                let map = |pairs: &[(&str, String)]| -> HashMap<String, String> {
                    pairs
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.clone()))
                        .collect()
                };
                CatalogFacts {
                    instance_type: format!("pve.type{o}"),
                    zone: format!("pve{}", o % 2),
                    capacity_type: pb::CapacityType::OnDemand,
                    price_per_hour: 0.01 * (o + 1) as f64,
                    interruption_probability: 0.0,
                    resources: map(&[
                        ("cpu", (2 << o).to_string()),
                        ("memory", format!("{}Gi", 4 << o)),
                    ]),
                    allocatable: map(&[
                        ("cpu", (2 << o).to_string()),
                        ("memory", format!("{}Gi", 4 << o)),
                    ]),
                    labels: map(&[("tier", "bench".into()), ("rack", format!("r{o}"))]),
                }
                .share()
            })
            .collect();
        InstantBackend {
            slots: (0..n)
                .map(|i| SlotSpec {
                    id: format!("proxmox/OnDemand/pve.type{}/pve{}/{i:06}", i % 4, i % 2),
                    facts: offerings[i % 4].clone(),
                    host: None,
                })
                .collect(),
        }
    }
}

#[async_trait]
impl Backend for InstantBackend {
    async fn describe(&self) -> Result<Vec<SlotSpec>, BackendError> {
        Ok(self.slots.clone())
    }
    async fn create(&self, ctx: CreateCtx) -> Result<SubstrateHost, BackendError> {
        Ok(SubstrateHost {
            host_ref: format!("pve0/{}", ctx.machine_id.len()),
        })
    }
    async fn configure(&self, _ctx: &ConfigureCtx) -> Result<(), BackendError> {
        Ok(())
    }
    async fn drain(&self, _ctx: DrainCtx) -> Result<(), BackendError> {
        Ok(())
    }
    fn supports_delete(&self) -> bool {
        true
    }
    async fn delete(&self, _ctx: DeleteCtx) -> Result<(), BackendError> {
        Ok(())
    }
}

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    samples.sort_unstable();
    let rank = ((p / 100.0) * (samples.len() - 1) as f64).round() as usize;
    samples[rank.min(samples.len() - 1)]
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

async fn bench_size(n: usize) {
    let rss_before = rss_kib();
    let backend = Arc::new(InstantBackend::new(n));
    let ids: Vec<String> = backend.slots.iter().map(|s| s.id.clone()).collect();
    let t = Instant::now();
    let engine = Engine::start(
        backend,
        Arc::new(MemoryStore::new()),
        EngineOptions::default(),
    )
    .await
    .expect("engine starts");
    println!(
        "engine_start_ms={:.1} engine_rss_mib={:.1} size={n}",
        t.elapsed().as_secs_f64() * 1e3,
        (rss_kib().saturating_sub(rss_before)) as f64 / 1024.0
    );

    // Get: what the service does per call (lookup + encode).
    let gets = 200_000;
    let t = Instant::now();
    let mut bytes = 0usize;
    for k in 0..gets {
        let id = &ids[(k * 7919) % n];
        bytes += engine.get_encoded(id).expect("known id").0.len();
    }
    let per_get = t.elapsed() / gets as u32;
    println!(
        "engine_get_ns={} bytes_per_machine={} size={n}",
        per_get.as_nanos(),
        bytes / gets
    );

    // Full List: snapshot + encode, against prost encoding the same page.
    let mut list = Vec::new();
    let mut tree = Vec::new();
    let mut len = 0;
    for _ in 0..5 {
        let t = Instant::now();
        let page = engine.list(&[], 0, &[]);
        let encoded = page.encode();
        list.push(t.elapsed());
        len = encoded.0.len();
        let message = page.to_wire();
        let t = Instant::now();
        let plain = message.encode_to_vec();
        tree.push(t.elapsed());
        assert_eq!(plain.len(), len, "same message, same size");
    }
    let list_ms = percentile(&mut list, 50.0).as_secs_f64() * 1e3;
    let tree_ms = percentile(&mut tree, 50.0).as_secs_f64() * 1e3;
    println!(
        "engine_list_ms={list_ms:.2} prost_encode_ms={tree_ms:.2} list_over_encode={:.2} list_bytes={len} size={n}",
        list_ms / tree_ms
    );

    // Create acks: distinct machines, `level` concurrent callers.
    let per_level = (n / 3).min(30_000);
    let mut next = 0;
    for level in [1usize, 8, 64] {
        let batch: Arc<Vec<String>> = Arc::new(ids[next..next + per_level].to_vec());
        next += per_level;
        let cursor = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let t = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..level {
            let (engine, batch, cursor) = (engine.clone(), batch.clone(), cursor.clone());
            tasks.push(tokio::spawn(async move {
                let mut lat = Vec::new();
                loop {
                    let i = cursor.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(id) = batch.get(i) else { break };
                    let t = Instant::now();
                    let ack = engine
                        .create(id, Token::new("bench", 1, 1))
                        .await
                        .expect("create accepted");
                    assert_eq!(ack.machine.state, State::Creating);
                    lat.push(t.elapsed());
                }
                lat
            }));
        }
        let mut lat = Vec::new();
        for task in tasks {
            lat.extend(task.await.expect("worker"));
        }
        let wall = t.elapsed();
        println!(
            "engine_create_acks_per_s={:.0} p50_us={:.1} p99_us={:.1} clients={level} creates={per_level} size={n}",
            per_level as f64 / wall.as_secs_f64(),
            percentile(&mut lat, 50.0).as_secs_f64() * 1e6,
            percentile(&mut lat, 99.0).as_secs_f64() * 1e6,
        );
    }
}

fn main() {
    let sizes: Vec<usize> = match std::env::args().skip(1).find(|a| !a.starts_with('-')) {
        Some(list) => list
            .split(',')
            .map(|s| {
                s.trim()
                    .parse()
                    .expect("SIZES is a comma-separated list of counts")
            })
            .collect(),
        None => vec![1_000, 10_000, 100_000],
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    for n in sizes {
        runtime.block_on(bench_size(n));
    }
}
