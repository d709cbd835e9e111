//! A node that powers off, as PVE shows it (pve-sim's `set_node_online`):
//! calls routed to it hang until the connect fails, then 595; its VMs keep
//! their last sample in `/cluster/resources` for a while, then lose name
//! and template. A dead node costs only its own capacity: Creates on the
//! other nodes go on at their speed without touching it, a Create for it
//! fails at once naming it, a Delete of a machine on it finishes once it is
//! back, and a restart serves while it is down.

use std::sync::Arc;
use std::time::{Duration, Instant};

use provider_testkit::wait::Wait;
use proxmox_backend::proxmox::{marker_description, vm_name, PveOptions, PveSubstrate};
use proxmox_backend::substrate::{CloneRequest, Substrate};
use pve_sim::{endpoints, GuestOutput, PveSim, SimConfig, TemplateSpec};

use crate::common::{self, client, req, sim_with};

fn opts() -> PveOptions {
    PveOptions {
        vmid_range: (200, 399),
        max_parallel_clones: 8,
        ..common::fast_retrying()
    }
}

/// Three nodes with a local template each; calls to a dead node hang
/// `offline_delay`, its samples last `rrd_expiry`.
fn three_nodes(offline_delay: Duration, rrd_expiry: Duration) -> SimConfig {
    SimConfig {
        nodes: vec!["pve1".into(), "pve2".into(), "pve3".into()],
        templates: vec![
            TemplateSpec::local(9000, "pve1"),
            TemplateSpec::local(9002, "pve2"),
            TemplateSpec::local(9003, "pve3"),
        ],
        max_parallel_local_clones: None,
        offline_delay,
        rrd_expiry,
        ..common::fast_sim_150()
    }
}

fn on(node: &str, template: u32, n: usize) -> CloneRequest {
    CloneRequest {
        template_vmid: template,
        ..req(&format!("p/OnDemand/pve.small/{node}/{n:03}"), node)
    }
}

/// `count` running VMs on `node` carrying our marker, as a fleet the
/// provider made there before.
fn seed_ours(sim: &PveSim, node: &str, first: u32, count: u32) -> Vec<String> {
    (first..first + count)
        .map(|vmid| {
            let id = format!("p/OnDemand/pve.small/{node}/{vmid}");
            let mut vm = sim.new_vm(vmid, node, &vm_name("pve.small", &id));
            vm.description = Some(marker_description(&id, "op-0"));
            vm.tags = Some("bigfleet".into());
            vm.pool = Some("bigfleet".into());
            vm.running = true;
            sim.insert_vm(vm).expect("seeded VM");
            id
        })
        .collect()
}

/// Requests the simulator received for `node`'s paths since the last
/// `clear_requests`.
fn calls_to(sim: &PveSim, node: &str) -> Vec<String> {
    let prefix = format!("/api2/json/nodes/{node}/");
    sim.requests()
        .into_iter()
        .filter(|r| r.path.starts_with(&prefix) || r.path == prefix.trim_end_matches('/'))
        .map(|r| format!("{} {}", r.method, r.path))
        .collect()
}

/// `per_node` Creates on each of pve1 and pve2 at once; how long the
/// burst took.
async fn burst(sub: &Arc<PveSubstrate>, first: usize, per_node: usize) -> Duration {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (node, template) in [("pve1", 9000), ("pve2", 9002)] {
        for n in first..first + per_node {
            let sub = Arc::clone(sub);
            let r = on(node, template, n);
            tasks.push(tokio::spawn(async move { sub.clone_vm(&r).await }));
        }
    }
    for t in tasks {
        t.await.expect("joined").expect("a Create on a live node");
    }
    started.elapsed()
}

/// Waits until `/cluster/resources` lists `node`'s VMs without a name:
/// pmxcfs dropped their last samples.
async fn until_samples_expired(sim: &PveSim, node: &str) {
    let pve = client(sim);
    Wait::new(
        "the offline node's samples to expire",
        Duration::from_secs(10),
    )
    .every(Duration::from_millis(50))
    .until_async(|| {
        let pve = &pve;
        async move {
            let rows = pve.cluster_resources_vms().await.expect("listing");
            rows.iter()
                .filter(|v| v.node == node && !v.template)
                .all(|v| v.status == "unknown" && v.name.is_none())
        }
    })
    .await;
}

#[tokio::test]
async fn creates_on_live_nodes_keep_their_speed_and_never_touch_an_offline_node() {
    let sim = sim_with(three_nodes(
        Duration::from_millis(500),
        Duration::from_millis(300),
    ))
    .await;
    let ours = seed_ours(&sim, "pve3", 500, 12);
    let sub = Arc::new(PveSubstrate::new(client(&sim), opts()));
    assert_eq!(sub.describe_managed().await.expect("inventory").len(), 12);
    let healthy = burst(&sub, 0, 8).await;

    assert!(sim.set_node_online("pve3", false));
    until_samples_expired(&sim, "pve3").await;
    sim.clear_requests();
    sim.reset_counts();
    let degraded = burst(&sub, 10, 8).await;
    println!("burst of 16 Creates: healthy {healthy:?}, pve3 offline {degraded:?}");
    assert_eq!(
        calls_to(&sim, "pve3"),
        Vec::<String>::new(),
        "nothing is sent to the node that is down"
    );
    assert_eq!(
        sim.call_count(endpoints::STATUS),
        0,
        "no VM is read one at a time"
    );
    // 16 Creates, each a scan: pve3's 12 VMs would each cost a 595 after
    // 500 ms, retried, if they were asked for.
    assert!(
        degraded < healthy * 3 / 2 + Duration::from_secs(1),
        "healthy {healthy:?}, pve3 offline {degraded:?}"
    );

    // The machines on the dead node stay reported, as last seen.
    let managed = sub.describe_managed().await.expect("inventory");
    for id in &ours {
        assert!(
            managed.iter().any(|m| &m.machine_id == id),
            "{id} dropped: {managed:?}"
        );
    }
    assert_eq!(sub.offline_nodes(), ["pve3"]);

    // A Create for the dead node fails at once, naming it; nothing cloned.
    let clones = sim.call_count(endpoints::CLONE);
    let started = Instant::now();
    let e = sub
        .clone_vm(&on("pve3", 9003, 99))
        .await
        .expect_err("pve3 is down");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert!(e.to_string().contains("node pve3"), "{e}");
    assert!(e.to_string().contains("offline"), "{e}");
    assert_eq!(sim.call_count(endpoints::CLONE), clones);
    assert!(
        calls_to(&sim, "pve3").is_empty(),
        "{:?}",
        calls_to(&sim, "pve3")
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn a_delete_on_an_offline_node_waits_for_it_and_finishes_once_it_is_back() {
    let sim = sim_with(three_nodes(
        Duration::from_millis(500),
        Duration::from_secs(300),
    ))
    .await;
    let sub = Arc::new(PveSubstrate::new(client(&sim), opts()));
    let r = on("pve3", 9003, 1);
    let vm = sub.clone_vm(&r).await.expect("create on pve3");
    assert!(sim.set_node_online("pve3", false));
    sub.describe_managed()
        .await
        .expect("a pass learns pve3 is down");
    sim.clear_requests();

    let nodes_reads = sim.call_count(endpoints::NODES);
    let delete = {
        let (sub, vm, id) = (Arc::clone(&sub), vm.clone(), r.machine_id.clone());
        tokio::spawn(async move { sub.delete_vm(&vm, &id).await })
    };
    common::until("the Delete asked /nodes about pve3 again and again", || {
        sim.call_count(endpoints::NODES) >= nodes_reads + 3
    })
    .await;
    assert!(!delete.is_finished(), "the Delete waits for the node");
    assert!(sim.vm(vm.vmid).is_some());
    assert!(
        calls_to(&sim, "pve3").is_empty(),
        "the node is waited for through /nodes, not by calls that hang: {:?}",
        calls_to(&sim, "pve3")
    );

    assert!(sim.set_node_online("pve3", true));
    delete
        .await
        .expect("joined")
        .expect("the Delete finishes once the node is back");
    assert!(sim.vm(vm.vmid).is_none(), "destroyed");
    sim.shutdown().await;
}

#[tokio::test]
async fn a_drain_on_an_offline_node_waits_for_it_and_finishes_once_it_is_back() {
    let sim = sim_with(three_nodes(
        Duration::from_millis(500),
        Duration::from_secs(300),
    ))
    .await;
    sim.on_guest_command("kubectl drain", GuestOutput::exit(0));
    let sub = Arc::new(PveSubstrate::new(client(&sim), opts()));
    let vm = sub
        .clone_vm(&on("pve3", 9003, 2))
        .await
        .expect("create on pve3");
    assert!(sim.set_node_online("pve3", false));
    sub.describe_managed()
        .await
        .expect("a pass learns pve3 is down");
    sim.clear_requests();

    let nodes_reads = sim.call_count(endpoints::NODES);
    let drain = {
        let (sub, vm) = (Arc::clone(&sub), vm.clone());
        tokio::spawn(async move { sub.drain(&vm, Duration::from_secs(10)).await })
    };
    common::until("the Drain asked /nodes about pve3 again and again", || {
        sim.call_count(endpoints::NODES) >= nodes_reads + 3
    })
    .await;
    assert!(!drain.is_finished(), "the Drain waits for the node");
    assert!(
        calls_to(&sim, "pve3").is_empty(),
        "{:?}",
        calls_to(&sim, "pve3")
    );
    assert!(sim.set_node_online("pve3", true));
    drain
        .await
        .expect("joined")
        .expect("the Drain finishes once the node is back");
    sim.shutdown().await;
}

#[tokio::test]
async fn a_restart_with_a_node_offline_serves_the_others_at_once() {
    // PVE's own timing: a call to the dead node hangs 3 s before its 595.
    let sim = sim_with(three_nodes(
        Duration::from_secs(3),
        Duration::from_millis(300),
    ))
    .await;
    seed_ours(&sim, "pve3", 500, 6);
    assert!(sim.set_node_online("pve3", false));
    until_samples_expired(&sim, "pve3").await;

    let started = Instant::now();
    let sub = PveSubstrate::new(client(&sim), opts());
    let warnings = sub
        .preflight(
            &["pve1".into(), "pve2".into(), "pve3".into()],
            &[9000, 9002, 9003],
        )
        .await
        .expect("the start-up check passes with a node down");
    let managed = sub.describe_managed().await.expect("the first reconcile");
    let serving = started.elapsed();
    println!("preflight and first reconcile with pve3 offline: {serving:?}");
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("\"pve3\"") && w.contains("offline")),
        "{warnings:?}"
    );
    assert!(serving < Duration::from_secs(10), "{serving:?}");
    assert!(
        managed.is_empty(),
        "never read while pve3 is down: {managed:?}"
    );
    assert_eq!(sub.offline_nodes(), ["pve3"]);
    sub.clone_vm(&on("pve1", 9000, 7))
        .await
        .expect("a Create on a live node");
    assert!(
        calls_to(&sim, "pve3").is_empty(),
        "{:?}",
        calls_to(&sim, "pve3")
    );
    sim.shutdown().await;
}
