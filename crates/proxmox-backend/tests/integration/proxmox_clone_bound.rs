//! `--max-parallel-clones` bounds clones per (target node, template storage),
//! checked against the PVE simulator. A clone in flight is visible in the
//! simulator as a VM holding the `clone` config lock.

use std::sync::Arc;
use std::time::Duration;

use provider_testkit::wait::{until as wait_for, Wait};
use proxmox_backend::proxmox::{PveOptions, PveSubstrate};
use proxmox_backend::substrate::{CloneRequest, Substrate, VmRef};
use pve_sim::{endpoints, PveSim, SimConfig, TemplateSpec};
use tokio::task::JoinHandle;

use crate::common::{self, client};

/// One clone slot per (node, storage), outside any pool.
fn opts() -> PveOptions {
    PveOptions {
        pool: None,
        max_parallel_clones: 1,
        ..common::opts(Duration::from_secs(30))
    }
}

fn req(machine_id: &str, node: &str, template: u32) -> CloneRequest {
    CloneRequest {
        template_vmid: template,
        ..common::req(machine_id, node)
    }
}

/// The simulator also allows one clone per (node, storage): an overlapping
/// clone would fail with the storage lock timeout and be POSTed again.
fn sim_config(templates: Vec<TemplateSpec>, clone_duration: Duration) -> SimConfig {
    SimConfig {
        templates,
        clone_duration,
        start_duration: Duration::from_millis(10),
        agent_boot_delay: Duration::from_millis(20),
        max_parallel_local_clones: Some(1),
        max_parallel_shared_clones: Some(1),
        storage_lock_wait: Duration::from_millis(50),
        ..SimConfig::default()
    }
}

/// Templates 9000 on pve1's local-lvm and 9001 on the shared ceph-pool.
async fn local_and_shared_templates(clone_duration: Duration) -> PveSim {
    PveSim::start(sim_config(
        vec![
            TemplateSpec::local(9000, "pve1"),
            TemplateSpec::shared(9001, "pve1"),
        ],
        clone_duration,
    ))
    .await
    .expect("simulator")
}

fn clones_in_flight(sim: &PveSim) -> usize {
    sim.vms()
        .values()
        .filter(|v| !v.template && v.lock.as_deref() == Some("clone"))
        .count()
}

fn template_config_reads(sim: &PveSim, template: u32) -> usize {
    let needle = format!("/qemu/{template}/config");
    sim.requests()
        .iter()
        .filter(|r| {
            r.endpoint.as_deref() == Some(endpoints::CONFIG_GET) && r.path.ends_with(&needle)
        })
        .count()
}

fn spawn_create(
    sub: &Arc<PveSubstrate>,
    r: CloneRequest,
) -> JoinHandle<Result<VmRef, proxmox_backend::substrate::SubstrateError>> {
    let sub = sub.clone();
    tokio::spawn(async move { sub.clone_vm(&r).await })
}

#[tokio::test]
async fn different_storages_or_nodes_clone_concurrently() {
    // Long clones so the overlap is certain to be seen.
    let sim = local_and_shared_templates(Duration::from_millis(1500)).await;
    let sub = Arc::new(PveSubstrate::new(client(&sim), opts()));

    let tasks = vec![
        // local-lvm onto pve1
        spawn_create(&sub, req("b/OnDemand/t/pve1/000", "pve1", 9000)),
        // ceph-pool onto pve1: a different storage, so its own slot
        spawn_create(&sub, req("b/OnDemand/t/pve1/001", "pve1", 9001)),
        // ceph-pool onto pve2: same storage, different node
        spawn_create(&sub, req("b/OnDemand/t/pve2/000", "pve2", 9001)),
    ];
    wait_for(
        "three clones in flight at once",
        Duration::from_secs(20),
        || clones_in_flight(&sim) == 3,
    )
    .await;

    let mut vms = Vec::new();
    for t in tasks {
        vms.push(t.await.expect("join").expect("create"));
    }
    let storages: Vec<String> = vms
        .iter()
        .map(|vm| sim.vm(vm.vmid).expect("vm").storage)
        .collect();
    assert_eq!(storages, ["local-lvm", "ceph-pool", "ceph-pool"]);
    assert_eq!(
        sim.call_count(endpoints::CLONE),
        3,
        "no clone hit a storage lock timeout"
    );
    assert!(sim.schema_violations().is_empty());
    sim.shutdown().await;
}

#[tokio::test]
async fn same_storage_same_node_clones_serialise() {
    // Two templates, both on local-lvm of pve1.
    let sim = PveSim::start(sim_config(
        vec![
            TemplateSpec::local(9000, "pve1"),
            TemplateSpec::local(9002, "pve1"),
        ],
        Duration::from_millis(400),
    ))
    .await
    .expect("simulator");
    let sub = Arc::new(PveSubstrate::new(client(&sim), opts()));

    let a = spawn_create(&sub, req("s/OnDemand/t/pve1/000", "pve1", 9000));
    let b = spawn_create(&sub, req("s/OnDemand/t/pve1/001", "pve1", 9002));
    let mut max_in_flight = 0;
    let mut seen_one = false;
    // Samples the clones in flight until both Creates end.
    Wait::new("both Creates to end", Duration::from_secs(60))
        .every(Duration::from_millis(5))
        .until(|| {
            let n = clones_in_flight(&sim);
            seen_one |= n == 1;
            max_in_flight = max_in_flight.max(n);
            a.is_finished() && b.is_finished()
        })
        .await;
    let va = a.await.expect("join").expect("create a");
    let vb = b.await.expect("join").expect("create b");
    assert_ne!(va.vmid, vb.vmid);
    assert!(seen_one, "the sampler saw a clone in flight");
    assert_eq!(
        max_in_flight, 1,
        "clones on one node and storage overlapped"
    );
    // An overlap the sampler missed would have hit the simulator's storage
    // lock timeout and been POSTed again.
    assert_eq!(sim.call_count(endpoints::CLONE), 2);
    sim.shutdown().await;
}

#[tokio::test]
async fn template_config_is_read_once_per_template() {
    let sim = local_and_shared_templates(Duration::from_millis(50)).await;
    let mut o = opts();
    o.max_parallel_clones = 4;
    let sub = Arc::new(PveSubstrate::new(client(&sim), o));

    // Concurrent first Creates of one template share the single read.
    let tasks: Vec<_> = (0..3)
        .map(|i| {
            spawn_create(
                &sub,
                req(&format!("o/OnDemand/t/pve1/{i:03}"), "pve1", 9000),
            )
        })
        .collect();
    for t in tasks {
        t.await.expect("join").expect("create");
    }
    sub.clone_vm(&req("o/OnDemand/t/pve1/003", "pve1", 9000))
        .await
        .expect("create");
    sub.clone_vm(&req("o/OnDemand/t/pve1/004", "pve1", 9001))
        .await
        .expect("create");
    assert_eq!(template_config_reads(&sim, 9000), 1);
    assert_eq!(template_config_reads(&sim, 9001), 1);
    sim.shutdown().await;
}

#[tokio::test]
async fn unreadable_template_config_fails_the_create() {
    let sim = PveSim::start(sim_config(
        vec![TemplateSpec::local(9000, "pve1")],
        Duration::from_millis(50),
    ))
    .await
    .expect("simulator");
    let sub = PveSubstrate::new(client(&sim), opts());
    // No managed VMs exist, so the only config read is the template's.
    sim.faults().fail_next(
        endpoints::CONFIG_GET,
        1,
        403,
        "Permission check failed (/vms/9000, VM.Audit)",
    );
    let e = sub
        .clone_vm(&req("u/OnDemand/t/pve1/000", "pve1", 9000))
        .await
        .expect_err("config unreadable");
    let text = e.to_string();
    assert!(
        text.contains("template 9000") && text.contains("Permission check failed"),
        "{e}"
    );
    // A 403 is a refusal, not something to retry.
    assert_eq!(e.kind(), providerkit::ErrorKind::Refused, "{e}");
    assert_eq!(sim.call_count(endpoints::CLONE), 0, "nothing was cloned");
    assert!(sim.vms().values().all(|v| v.template));

    // The failure is not cached: the next Create reads again and succeeds.
    sub.clone_vm(&req("u/OnDemand/t/pve1/000", "pve1", 9000))
        .await
        .expect("create after the fault");
    assert_eq!(template_config_reads(&sim, 9000), 2);
    sim.shutdown().await;
}

/// The honest clone model: a 1 GiB template on `ceph-pool`, whose copies
/// run at the lesser of one stream and their share of the pool's
/// bandwidth (in GiB/s).
fn honest_model(
    (stream, bandwidth): (u64, u64),
    volume_alloc: Duration,
    lock_timeout: Duration,
) -> SimConfig {
    let mut t = TemplateSpec::shared(9000, "pve1");
    t.disk_gib = 1;
    SimConfig {
        templates: vec![t],
        start_duration: Duration::from_millis(10),
        agent_boot_delay: Duration::from_millis(20),
        max_parallel_local_clones: None,
        max_parallel_shared_clones: None,
        storage_bandwidth: vec![("ceph-pool".into(), bandwidth << 30)],
        storage_stream_bandwidth: vec![("ceph-pool".into(), stream << 30)],
        volume_alloc_time: volume_alloc,
        storage_lock_timeout: lock_timeout,
        ..SimConfig::default()
    }
}

/// A substrate on `sim` with at most `most` clone slots per (node,
/// storage), adaptive or fixed.
fn substrate(sim: &PveSim, most: usize, adaptive: bool) -> Arc<PveSubstrate> {
    Arc::new(PveSubstrate::new(
        client(sim),
        PveOptions {
            max_parallel_clones: most,
            adaptive_clones: adaptive,
            ..opts()
        },
    ))
}

/// Creates `n` machines on `node` at once, sampling how many clones run at
/// once; returns the most seen.
async fn burst_peak(sim: &Arc<PveSim>, sub: &Arc<PveSubstrate>, node: &str, n: usize) -> usize {
    let tasks: Vec<_> = (0..n)
        .map(|i| spawn_create(sub, req(&format!("a/OnDemand/t/{node}/{i:03}"), node, 9000)))
        .collect();
    let mut peak = 0;
    while !tasks.iter().all(|t| t.is_finished()) {
        peak = peak.max(clones_in_flight(sim));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for t in tasks {
        t.await.expect("join").expect("every Create lands");
    }
    peak
}

/// Adaptive slots (#41 item 2) grow while clones take as long as the
/// shortest seen and others wait: on a storage with room for eight
/// streams, twelve Creates end up copying more than the two slots they
/// start with, and never more than `--max-parallel-clones`. Fixed slots
/// stay at two.
#[tokio::test]
async fn adaptive_slots_grow_while_the_storage_has_bandwidth_to_spare() {
    let sim = Arc::new(
        // Eight streams fit: eight copies at once each take a second.
        PveSim::start(honest_model(
            (1, 8),
            Duration::ZERO,
            Duration::from_secs(10),
        ))
        .await
        .expect("simulator"),
    );
    let adaptive = substrate(&sim, 6, true);
    let peak = burst_peak(&sim, &adaptive, "pve1", 12).await;
    assert!(
        (3..=6).contains(&peak),
        "adaptive slots grew past the 2 they start with, within 6: {peak}"
    );
    let fixed = substrate(&sim, 2, false);
    let peak = burst_peak(&sim, &fixed, "pve2", 6).await;
    assert!(peak <= 2, "fixed slots stay at 2: {peak}");
}

/// Adaptive slots give slots back on storage-lock timeouts: a volume's
/// allocation holds `ceph-pool`'s cluster-wide lock for 400 ms and a clone
/// waits 500 ms for it, so more than two allocations at once fail; the
/// copy itself is quick. A clone that met the timeout gives its slot back
/// while it backs off. Every Create lands, and at most half as many clones
/// fail as with fixed slots, which keep four allocations queued (4 against
/// 14 here).
#[tokio::test]
async fn adaptive_slots_shrink_on_storage_lock_timeouts() {
    const CREATES: usize = 16;
    let clone_posts = |sim: &PveSim| {
        sim.requests()
            .iter()
            .filter(|r| r.endpoint.as_deref() == Some(endpoints::CLONE))
            .count()
    };
    let mut counts = Vec::new();
    for adaptive in [true, false] {
        let sim = Arc::new(
            PveSim::start(honest_model(
                (64, 64),
                Duration::from_millis(400),
                Duration::from_millis(500),
            ))
            .await
            .expect("simulator"),
        );
        let sub = substrate(&sim, 2, adaptive);
        let tasks: Vec<_> = (0..CREATES)
            .map(|i| {
                let node = if i % 2 == 0 { "pve1" } else { "pve2" };
                spawn_create(
                    &sub,
                    req(&format!("s/OnDemand/t/{node}/{i:03}"), node, 9000),
                )
            })
            .collect();
        for t in tasks {
            t.await.expect("join").expect("every Create lands");
        }
        // Each POST past the Creates that landed was a retry after a
        // clone failed on the storage's lock.
        counts.push(clone_posts(&sim) - CREATES);
        Arc::try_unwrap(sim)
            .ok()
            .expect("one owner")
            .shutdown()
            .await;
    }
    let (adaptive, fixed) = (counts[0], counts[1]);
    println!("clone retries after storage-lock timeouts: adaptive {adaptive}, fixed {fixed}");
    assert!(
        adaptive >= 1,
        "the first allocations queue past the timeout"
    );
    assert!(
        adaptive * 2 <= fixed,
        "adaptive slots shrink and mostly stop meeting the timeout: {adaptive} retries against {fixed}"
    );
}

/// Adaptive slots: a shared storage's are the cluster's (its lock and its
/// bandwidth are), a local storage's each node's, and a full clone given a
/// storage counts on that storage, which its volume is allocated on and
/// written to, not on the template's.
#[tokio::test]
async fn slots_follow_the_storage_a_clone_writes_to_and_its_reach() {
    let sim = local_and_shared_templates(Duration::from_millis(50)).await;
    let adaptive = PveOptions {
        max_parallel_clones: 4,
        adaptive_clones: true,
        ..opts()
    };
    let sub = PveSubstrate::new(client(&sim), adaptive.clone());
    for (id, node, template) in [
        ("d/OnDemand/t/pve1/000", "pve1", 9001),
        ("d/OnDemand/t/pve2/000", "pve2", 9001),
        ("d/OnDemand/t/pve1/001", "pve1", 9000),
    ] {
        sub.clone_vm(&req(id, node, template))
            .await
            .expect("create");
    }
    let domains: Vec<(String, String, usize)> = sub
        .clone_slots()
        .into_iter()
        .map(|d| (d.node, d.storage, d.limit))
        .collect();
    assert_eq!(
        domains,
        [
            ("(cluster)".to_string(), "ceph-pool".to_string(), 4),
            ("pve1".to_string(), "local-lvm".to_string(), 2),
        ],
        "one domain for ceph-pool, 2 slots to start with per node cloning there"
    );
    assert!(sub
        .clone_slots()
        .iter()
        .all(|d| d.used == 0 && d.waiting == 0));
    // Whether a storage is shared is read from the template's node, which
    // the clone runs on: a target node down or slow is never asked here.
    let listed = |node: &str| {
        sim.requests()
            .iter()
            .filter(|r| {
                r.endpoint.as_deref() == Some(endpoints::NODE_STORAGE)
                    && r.path.ends_with(&format!("/nodes/{node}/storage"))
            })
            .count()
    };
    assert_eq!((listed("pve1"), listed("pve2")), (1, 0));

    // A full clone of the ceph template onto pve2's local-lvm.
    let onto_local = PveSubstrate::new(
        client(&sim),
        PveOptions {
            node_storage: [("pve2".to_string(), "local-lvm".to_string())].into(),
            ..adaptive.clone()
        },
    );
    let vm = onto_local
        .clone_vm(&req("d/OnDemand/t/pve2/001", "pve2", 9001))
        .await
        .expect("create");
    let domains: Vec<(String, String)> = onto_local
        .clone_slots()
        .into_iter()
        .map(|d| (d.node, d.storage))
        .collect();
    // A shared template cannot be cloned from pve1 onto pve2's local
    // storage: a template replica is staged first, by a clone on pve1 to
    // the template's ceph-pool; the Create's clone from it writes pve2's
    // local-lvm.
    assert_eq!(
        domains,
        [
            ("(cluster)".to_string(), "ceph-pool".to_string()),
            ("pve2".to_string(), "local-lvm".to_string())
        ]
    );
    let landed = sim.vm(vm.vmid).expect("the Create's VM");
    assert_eq!(
        (landed.node.as_str(), landed.storage.as_str()),
        ("pve2", "local-lvm")
    );

    // Fixed slots stay per node, shared storage or not.
    let fixed = PveSubstrate::new(
        client(&sim),
        PveOptions {
            adaptive_clones: false,
            ..adaptive
        },
    );
    fixed
        .clone_vm(&req("d/OnDemand/t/pve2/002", "pve2", 9001))
        .await
        .expect("create");
    let domains: Vec<(String, String, usize)> = fixed
        .clone_slots()
        .into_iter()
        .map(|d| (d.node, d.storage, d.limit))
        .collect();
    assert_eq!(domains, [("pve2".to_string(), "ceph-pool".to_string(), 4)]);
    assert!(sim.schema_violations().is_empty());
    sim.shutdown().await;
}
