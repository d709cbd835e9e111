//! Create latency and PVE API calls per Create by template placement, on
//! pve-sim with its default timings and the provider's default options.
//! A benchmark, not a test: it asserts only that nothing failed.
//!
//! `cargo test -p proxmox-backend --test bench_replicas -- --ignored --nocapture`

// The integration binary's set-up helpers; this benchmark uses a few of them.
#[allow(dead_code)]
#[path = "integration/common.rs"]
mod common;

use std::sync::Arc;
use std::time::Instant;

use common::total_calls as calls;
use proxmox_backend::proxmox::{PveOptions, PveSubstrate};
use proxmox_backend::substrate::{CloneRequest, Substrate};
use pve::PveClient;
use pve_sim::{PveSim, SimConfig, TemplateSpec};

/// A client with the default timeouts and retries.
fn client(sim: &PveSim) -> PveClient {
    common::client_of(common::config(sim))
}

/// The provider's defaults (`--proxmox-poll-interval 1s`, 2 clones per node
/// and storage), in the pool.
fn opts() -> PveOptions {
    PveOptions {
        pool: Some("bigfleet".into()),
        ..PveOptions::default()
    }
}

fn req(node: &str, template: u32, i: usize) -> CloneRequest {
    CloneRequest {
        operation_id: format!("op-{node}-{i}"),
        template_vmid: template,
        ..common::req(&format!("bench/OnDemand/pve.small/{node}/{i:03}"), node)
    }
}

/// One Create: (seconds, API calls).
async fn one(sim: &PveSim, sub: &PveSubstrate, r: &CloneRequest) -> (f64, u64) {
    sim.reset_counts();
    let t = Instant::now();
    sub.clone_vm(r).await.expect("create");
    (t.elapsed().as_secs_f64(), calls(sim))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn report(what: &str, runs: &[(f64, u64)]) {
    let lat = median(runs.iter().map(|r| r.0).collect());
    let c = median(runs.iter().map(|r| r.1 as f64).collect());
    println!(
        "{what}: n={} latency p50 {:.2} s, API calls p50 {c:.0} (all: {:?})",
        runs.len(),
        lat,
        runs.iter().map(|r| r.1).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run with --ignored --nocapture"]
async fn create_cost_by_template_placement() {
    // (a) A template on shared storage, cloned to another node.
    let sim = PveSim::start(SimConfig {
        templates: vec![TemplateSpec::shared(9000, "pve1")],
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let sub = PveSubstrate::new(client(&sim), opts());
    one(&sim, &sub, &req("pve2", 9000, 100)).await; // warm the per-template caches
    let mut runs = Vec::new();
    for i in 0..5 {
        runs.push(one(&sim, &sub, &req("pve2", 9000, i)).await);
    }
    report("(a) shared template, cross-node Create", &runs);
    sim.shutdown().await;

    // (c) The first Create on a node a local template is not on: stages.
    let mut first = Vec::new();
    let mut warm = Vec::new();
    for round in 0..3 {
        let sim = PveSim::start(SimConfig::default()).await.unwrap();
        let sub = PveSubstrate::new(client(&sim), opts());
        first.push(one(&sim, &sub, &req("pve2", 9000, 200 + round)).await);
        // (b) Later Creates there: from the warm replica.
        for i in 0..2 {
            warm.push(one(&sim, &sub, &req("pve2", 9000, 300 + round * 10 + i)).await);
        }
        sim.shutdown().await;
    }
    report("(b) local template, warm replica on the node", &warm);
    report(
        "(c) local template, first Create on the node (stages the replica)",
        &first,
    );

    // The 16-way burst from one local template across both nodes.
    let sim = PveSim::start(SimConfig::default()).await.unwrap();
    let sub = Arc::new(PveSubstrate::new(client(&sim), opts()));
    sim.reset_counts();
    let t = Instant::now();
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let sub = Arc::clone(&sub);
            let node = if i % 2 == 0 { "pve1" } else { "pve2" };
            tokio::spawn(async move {
                let t = Instant::now();
                let r = sub.clone_vm(&req(node, 9000, 400 + i)).await;
                (t.elapsed(), r.map_err(|e| e.to_string()))
            })
        })
        .collect();
    let mut lat = Vec::new();
    let mut failed = Vec::new();
    for task in tasks {
        let (d, r) = task.await.unwrap();
        lat.push(d.as_secs_f64());
        if let Err(e) = r {
            failed.push(e);
        }
    }
    let wall = t.elapsed();
    let max = lat.iter().copied().fold(0.0, f64::max);
    println!(
        "burst: 16 Creates (8 on pve1, 8 on pve2) from local template 9000 on pve1: {} FAILED, \
         wall {:.2} s, latency p50 {:.2} s max {max:.2} s, {} API calls ({:.1} per Create)",
        failed.len(),
        wall.as_secs_f64(),
        median(lat),
        calls(&sim),
        calls(&sim) as f64 / 16.0
    );
    // Where the calls went, most first, so a change in the count can be
    // traced to an endpoint.
    let mut by_endpoint: Vec<(String, u64)> = sim.faults().counts().into_iter().collect();
    by_endpoint.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let by_endpoint: Vec<String> = by_endpoint
        .iter()
        .map(|(e, n)| format!("{n} {e}"))
        .collect();
    println!("burst by endpoint: {}", by_endpoint.join(", "));
    assert!(failed.is_empty(), "{failed:?}");
    sim.shutdown().await;
}
