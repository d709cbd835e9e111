//! The node memory guard end to end: the built binary on pve-sim's nodes of
//! 16 GiB, machines of 4 GiB. A 16-way burst of Creates aimed at one node
//! lands at most 4 VMs there (3 when a VM the provider does not own runs);
//! the others are refused at once with RESOURCE_EXHAUSTED and a message
//! naming the node, the memory needed and the room left, and stay
//! SPECULATIVE; the node never holds more than its memory; no machine is
//! left in a transition; the start-up line, the gauges and the admin
//! NodeMemory RPC (behind `ctl summary`) show the room.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bigfleet_proto::admin::admin_client::AdminClient;
use bigfleet_proto::admin::NodeMemoryRequest;
use bigfleet_proto::v1alpha1::{ListFilter, MachineState};
use provider_testkit::wait::Wait;
use pve_sim::{NodeMemory, PveSim, SimConfig};

use crate::common::{self, http_get, path_str, sim_backend_args, sim_ca_file, wait_state};

const GIB: u64 = 1 << 30;

/// Configured memory of what runs or is being cloned on `node`, bytes.
fn committed(sim: &PveSim, node: &str) -> u64 {
    sim.vms()
        .values()
        .filter(|v| v.node == node && !v.template)
        .filter(|v| v.running || v.lock.as_deref() == Some("clone"))
        .map(|v| v.memory_mib << 20)
        .sum()
}

async fn burst_at_one_node(foreign: bool) {
    let sim = Arc::new(
        PveSim::start(SimConfig {
            node_memory: NodeMemory::every_node(16 * GIB),
            max_parallel_local_clones: None,
            clone_duration: Duration::from_millis(300),
            agent_boot_delay: Duration::from_millis(50),
            rrd_lag: Duration::ZERO,
            ..SimConfig::default()
        })
        .await
        .expect("simulator"),
    );
    if foreign {
        let mut vm = sim.new_vm(500, "pve1", "someone-elses-db");
        vm.memory_mib = 4096;
        sim.insert_vm(vm).unwrap();
        assert!(sim.start_vm_out_of_band(500));
    }
    let (dir, ca) = sim_ca_file(&sim);
    // 16 slots of a 4 GiB type on pve1 (the built-in pve.small).
    let offerings = dir.path().join("offerings.json");
    std::fs::write(
        &offerings,
        r#"[{"instance_type":"pve.small","zone":"pve1","count":16},
            {"instance_type":"pve.small","zone":"pve2","count":1}]"#,
    )
    .unwrap();
    let args = sim_backend_args(
        &sim,
        &ca,
        "pve1,pve2",
        &[
            "--offerings",
            path_str(&offerings),
            "--max-parallel-clones",
            "16",
            "--proxmox-poll-interval",
            "50ms",
            "--readiness-command",
            "",
        ],
    );
    let provider = common::start_blocking(args).await;
    let room_line = provider
        .logs
        .wait_for(Duration::from_secs(5), |l| {
            l.contains("node memory room") && l.contains("node=pve1")
        })
        .expect("a start-up line with pve1's room");
    let (committed_gib, fits) = if foreign { ("4.0", 3) } else { ("0.0", 4) };
    for field in [
        "memory_gib=16.0".to_string(),
        "limit_gib=16.0".to_string(),
        format!("committed_gib={committed_gib}"),
        format!("fits=\"pve.small={fits}\""),
    ] {
        assert!(room_line.contains(&field), "{field} in {room_line}");
    }

    let mut client = provider.client().await;
    let ids: Vec<String> = client
        .list(ListFilter::default())
        .await
        .unwrap()
        .into_inner()
        .machines
        .into_iter()
        .filter(|m| m.zone == "pve1")
        .map(|m| m.id)
        .collect();
    assert_eq!(ids.len(), 16);

    // Watch the node for the whole burst.
    let done = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let watcher = {
        let (sim, done, peak) = (Arc::clone(&sim), Arc::clone(&done), Arc::clone(&peak));
        tokio::spawn(async move {
            // Samples until told the burst has landed (at most 4 landings
            // of up to 60 s each).
            Wait::new("the end of the burst", Duration::from_secs(300))
                .every(Duration::from_millis(5))
                .until(|| {
                    peak.fetch_max(committed(&sim, "pve1"), Ordering::SeqCst);
                    done.load(Ordering::SeqCst)
                })
                .await;
        })
    };
    let (accepted, refused) = common::create_burst(
        &client,
        &ids,
        &["node pve1", "needs 4096 MiB", "MiB is left"],
    )
    .await;
    let most = if foreign { 3 } else { 4 };
    assert_eq!(accepted.len(), most, "accepted {accepted:?}");
    assert_eq!(refused.len(), 16 - most);
    for id in &accepted {
        wait_state(&mut client, id, MachineState::Idle, Duration::from_secs(60)).await;
    }
    done.store(true, Ordering::SeqCst);
    watcher.await.unwrap();
    assert!(
        peak.load(Ordering::SeqCst) <= 16 * GIB,
        "pve1 held {} bytes",
        peak.load(Ordering::SeqCst)
    );
    assert_eq!(committed(&sim, "pve1"), 16 * GIB);

    // Refused ones never moved; nothing is left in a transition.
    for m in client
        .list(ListFilter::default())
        .await
        .unwrap()
        .into_inner()
        .machines
    {
        let state = MachineState::try_from(m.state).unwrap();
        if refused.contains(&m.id) {
            assert_eq!(state, MachineState::Speculative, "{}", m.id);
            assert!(m.last_error.is_empty());
        }
        assert!(
            matches!(state, MachineState::Speculative | MachineState::Idle),
            "{} is {state:?}",
            m.id
        );
    }

    // The room, as `ctl summary` reads it, and as the gauges show it.
    let mut admin = AdminClient::new(common::plain_channel(provider.grpc).await);
    let rooms = admin
        .node_memory(NodeMemoryRequest {})
        .await
        .expect("NodeMemory")
        .into_inner()
        .nodes;
    let pve1 = rooms.iter().find(|r| r.node == "pve1").expect("pve1");
    assert_eq!(
        (pve1.memory_bytes, pve1.limit_bytes, pve1.committed_bytes),
        (16 * GIB, 16 * GIB, 16 * GIB)
    );
    assert_eq!(pve1.fits[0].count, 0, "{pve1:?}");
    let (status, body) = http_get(provider.metrics, "/metrics").unwrap();
    assert_eq!(status, 200);
    for (name, bytes) in [
        ("bigfleet_proxmox_node_memory_committed_bytes", 16 * GIB),
        ("bigfleet_proxmox_node_memory_limit_bytes", 16 * GIB),
    ] {
        let line = format!("{name}{{node=\"pve1\"}} {bytes}");
        assert!(body.contains(&line), "{line} in\n{body}");
    }
    drop(dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_16_way_burst_at_one_node_lands_at_most_4_of_4_gib_on_16_gib() {
    burst_at_one_node(false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_foreign_vm_running_on_the_node_leaves_room_for_3() {
    burst_at_one_node(true).await;
}
