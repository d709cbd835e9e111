//! `make bench-real` (#41 item 4): bursts of whole lifecycles (Create,
//! Configure, Drain, Delete) on pve-sim's honest clone model: a full clone
//! copies the template's disk at its storage's bandwidth, shared among the
//! copies writing there at once. 16, 40 and 64 at once over 2, 3 and 4
//! nodes, from one shared template (2 GiB on `ceph-pool`, 2 GiB/s), a 3 s
//! agent boot and the default 1 s poll. Prints, per burst: time to IDLE
//! (the Create) median and p95, the makespan, what the storage's bandwidth
//! alone allows, PVE requests per lifecycle, and the peak requests per
//! second, cluster-wide and on the busiest node. `bench_real_local` runs
//! the same bursts on local storage: a template per node on its
//! `local-lvm` (1 GiB/s, shared among that node's copies). A measurement,
//! not a check: `cargo test -p proxmox-backend --test integration
//! bench_real -- --ignored --nocapture` runs both.
//! `BIGFLEET_BENCH_CLONE_SLOTS=N` sets `--max-parallel-clones` (default 2),
//! for a sweep.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proxmox_backend::proxmox::{PveOptions, PveSubstrate};
use proxmox_backend::substrate::{CloneRequest, Substrate, SubstrateError};
use pve_sim::PveSim;

use crate::common::{client, fast_sim, opts, req, sim_with};

/// The template's disk and the storage's bandwidth.
const DISK_GIB: u64 = 2;
const BANDWIDTH: u64 = 2 << 30;

/// A node's local storage: each node's copies share its own bandwidth.
const LOCAL_BANDWIDTH: u64 = 1 << 30;

/// Where the burst's templates are.
#[derive(Clone, Copy, PartialEq)]
enum Layout {
    /// One template on the shared `ceph-pool`, copied by every node.
    Shared,
    /// A template per node (VMID 9000 + n) on its own `local-lvm`.
    Local,
}

/// `--max-parallel-clones`: `BIGFLEET_BENCH_CLONE_SLOTS`, else the default.
fn clone_slots() -> usize {
    std::env::var("BIGFLEET_BENCH_CLONE_SLOTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(PveOptions::default().max_parallel_clones)
}

/// Whose request it is: the node a `/nodes/<node>/...` path names, or the
/// cluster for the rest.
fn node_of(path: &str) -> String {
    path.strip_prefix("/api2/json")
        .unwrap_or(path)
        .strip_prefix("/nodes/")
        .and_then(|rest| rest.split('/').next())
        .map_or_else(|| "cluster".to_string(), str::to_string)
}

/// Requests so far, by node.
fn by_node(sim: &PveSim) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for r in sim.requests() {
        *out.entry(node_of(&r.path)).or_default() += 1;
    }
    out
}

fn quantile(mut v: Vec<f64>, q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 - 1.0) * q).round() as usize;
    v.get(i).copied().unwrap_or(0.0)
}

async fn burst(size: usize, nodes: usize, layout: Layout) {
    let names: Vec<String> = (1..=nodes).map(|n| format!("pve{n}")).collect();
    let mut cfg = fast_sim(Duration::from_secs(2), Duration::from_secs(3));
    cfg.nodes = names.clone();
    cfg.templates = match layout {
        Layout::Shared => vec![pve_sim::TemplateSpec::shared(9000, "pve1")],
        Layout::Local => (0..nodes)
            .map(|n| pve_sim::TemplateSpec::local(9000 + n as u32, &names[n]))
            .collect(),
    };
    for t in &mut cfg.templates {
        t.disk_gib = DISK_GIB;
    }
    cfg.storage_bandwidth = vec![
        ("ceph-pool".into(), BANDWIDTH),
        ("local-lvm".into(), LOCAL_BANDWIDTH),
    ];
    cfg.max_parallel_local_clones = None;
    cfg.max_parallel_shared_clones = None;
    let sim = Arc::new(sim_with(cfg).await);
    let sub = Arc::new(PveSubstrate::new(
        client(&sim),
        PveOptions {
            poll_interval: Duration::from_secs(1),
            max_parallel_clones: clone_slots(),
            readiness_command: String::new(),
            drain_command: "true".into(),
            ..opts(Duration::from_secs(600))
        },
    ));
    // Requests by node, sampled every 100 ms, for the peak per second.
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (sim, done) = (Arc::clone(&sim), Arc::clone(&done));
        tokio::spawn(async move {
            let mut samples: Vec<(Instant, BTreeMap<String, u64>)> = Vec::new();
            while !done.load(Ordering::SeqCst) {
                samples.push((Instant::now(), by_node(&sim)));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            samples.push((Instant::now(), by_node(&sim)));
            samples
        })
    };
    let started = Instant::now();
    let runs: Vec<_> = (0..size)
        .map(|i| {
            let sub = Arc::clone(&sub);
            let node = names[i % nodes].clone();
            let template = match layout {
                Layout::Shared => 9000,
                Layout::Local => 9000 + (i % nodes) as u32,
            };
            tokio::spawn(async move {
                let id = format!("p/OnDemand/pve.small/{node}/{i:03}");
                let t = Instant::now();
                let vm = sub
                    .clone_vm(&CloneRequest {
                        template_vmid: template,
                        ..req(&id, &node)
                    })
                    .await?;
                let to_idle = t.elapsed();
                sub.ensure_running(&vm).await?;
                sub.configure(&vm, b"true\n").await?;
                sub.ensure_running(&vm).await?;
                sub.drain(&vm, Duration::from_secs(10)).await?;
                sub.delete_vm(&vm, &id).await?;
                Ok::<_, SubstrateError>(to_idle)
            })
        })
        .collect();
    let mut to_idle = Vec::new();
    let mut failed = 0;
    for r in runs {
        match r.await.expect("task") {
            Ok(t) => to_idle.push(t.as_secs_f64()),
            Err(e) => {
                failed += 1;
                println!("  FAILED: {e}");
            }
        }
    }
    let makespan = started.elapsed().as_secs_f64();
    done.store(true, Ordering::SeqCst);
    let samples = sampler.await.expect("sampler");
    // The most requests in any one second, cluster-wide and per node.
    let (mut peak_all, mut peak_node) = (0u64, 0u64);
    for (i, (t0, c0)) in samples.iter().enumerate() {
        let Some((_, c1)) = samples[i..]
            .iter()
            .take_while(|(t, _)| t.duration_since(*t0) <= Duration::from_secs(1))
            .last()
        else {
            continue;
        };
        let delta = |k: &String| c1.get(k).copied().unwrap_or(0) - c0.get(k).copied().unwrap_or(0);
        peak_all = peak_all.max(c1.keys().map(delta).sum());
        peak_node = peak_node.max(
            c1.keys()
                .filter(|k| *k != "cluster")
                .map(delta)
                .max()
                .unwrap_or(0),
        );
    }
    let total = sim.requests().len() as f64;
    let bytes = |copies: usize| (copies as u64 * (DISK_GIB << 30)) as f64;
    // Shared: every copy through the one storage; local: the busiest
    // node's copies through its own.
    let (copy_bound, place) = match layout {
        Layout::Shared => (bytes(size) / BANDWIDTH as f64, "shared"),
        Layout::Local => (
            bytes(size.div_ceil(nodes)) / LOCAL_BANDWIDTH as f64,
            "local",
        ),
    };
    let slots = clone_slots();
    println!(
        "bench-real {size:>2}-way on {nodes} nodes, {place} storage, {slots} clone slots per node: {failed} FAILED, to IDLE p50 {:.1} s p95 {:.1} s, \
         makespan {makespan:.1} s (the copies alone take {copy_bound:.1} s at the storage's bandwidth), \
         {:.1} requests per lifecycle, peak {peak_all} requests/s, {peak_node} on the busiest node",
        quantile(to_idle.clone(), 0.5),
        quantile(to_idle, 0.95),
        total / size as f64,
    );
    assert_eq!(failed, 0, "every lifecycle lands");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement (a few minutes); run by hand or with make bench-real"]
async fn bench_real() {
    for (size, nodes) in [(16, 2), (40, 3), (64, 4)] {
        burst(size, nodes, Layout::Shared).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement (a few minutes); run by hand or with make bench-real"]
async fn bench_real_local() {
    for (size, nodes) in [(16, 2), (40, 3), (64, 4)] {
        burst(size, nodes, Layout::Local).await;
    }
}
