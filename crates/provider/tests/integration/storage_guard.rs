//! The storage guard end to end (#44 item 2): the built binary on pve-sim,
//! whose `local-lvm` on pve1 holds three 32 GiB full clones. Four Creates
//! at once: three land IDLE, the fourth is refused with RESOURCE_EXHAUSTED
//! naming the storage and stays SPECULATIVE, and nothing was cloned for it;
//! the start-up line, the gauges, the admin NodeMemory RPC and `ctl
//! summary` show the storage's room.

use std::sync::Arc;
use std::time::Duration;

use bigfleet_proto::admin::admin_client::AdminClient;
use bigfleet_proto::admin::NodeMemoryRequest;
use bigfleet_proto::v1alpha1::{ListFilter, MachineState};
use pve_sim::{endpoints, PveSim, SimConfig, StorageKind, StorageSpec};

use crate::common::{self, http_get, path_str, sim_backend_args, sim_ca_file, wait_state};

const BIN: &str = env!("CARGO_BIN_EXE_bigfleet-proxmox");
const GIB: u64 = 1 << 30;

#[tokio::test(flavor = "multi_thread")]
async fn a_storage_that_holds_three_clones_takes_three_creates_and_refuses_the_fourth() {
    let mut cfg = SimConfig {
        max_parallel_local_clones: None,
        clone_duration: Duration::from_millis(300),
        agent_boot_delay: Duration::from_millis(50),
        rrd_lag: Duration::ZERO,
        ..SimConfig::default()
    };
    // The template's 32 GiB disk and 104 GiB free: three clones and 8 GiB.
    cfg.storages.retain(|s| s.name != "local-lvm");
    cfg.storages.push(StorageSpec::new(
        "local-lvm",
        StorageKind::LvmThin,
        false,
        32 + 104,
    ));
    let sim = Arc::new(PveSim::start(cfg).await.expect("simulator"));
    let (dir, ca) = sim_ca_file(&sim);
    let offerings = dir.path().join("offerings.json");
    std::fs::write(
        &offerings,
        r#"[{"instance_type":"pve.small","zone":"pve1","count":4}]"#,
    )
    .unwrap();
    let args = sim_backend_args(
        &sim,
        &ca,
        "pve1",
        &[
            "--offerings",
            path_str(&offerings),
            "--node-storage",
            "pve1=local-lvm",
            "--max-parallel-clones",
            "4",
            "--proxmox-poll-interval",
            "50ms",
            "--readiness-command",
            "",
        ],
    );
    let provider = common::start_blocking(args).await;
    let line = provider
        .logs
        .wait_for(Duration::from_secs(5), |l| {
            l.contains("storage room") && l.contains("storage=local-lvm")
        })
        .expect("a start-up line with local-lvm's room");
    for field in ["node=pve1", "avail=\"104.0 GiB\"", "left=\"104.0 GiB\""] {
        assert!(line.contains(field), "{field} in {line}");
    }

    let mut client = provider.client().await;
    let ids: Vec<String> = client
        .list(ListFilter::default())
        .await
        .unwrap()
        .into_inner()
        .machines
        .into_iter()
        .map(|m| m.id)
        .collect();
    assert_eq!(ids.len(), 4);
    let (accepted, refused) = common::create_burst(
        &client,
        &ids,
        &[
            "storage local-lvm of node pve1 has no room",
            "it needs 32.0 GiB",
        ],
    )
    .await;
    assert_eq!((accepted.len(), refused.len()), (3, 1), "{refused:?}");
    for id in &accepted {
        wait_state(&mut client, id, MachineState::Idle, Duration::from_secs(60)).await;
    }
    assert_eq!(
        sim.call_count(endpoints::CLONE),
        3,
        "nothing cloned for the fourth"
    );
    let listed = client
        .list(ListFilter::default())
        .await
        .unwrap()
        .into_inner()
        .machines;
    let fourth = listed.iter().find(|m| m.id == refused[0]).expect("listed");
    assert_eq!(
        MachineState::try_from(fourth.state).unwrap(),
        MachineState::Speculative
    );
    assert!(fourth.last_error.is_empty(), "{}", fourth.last_error);

    // The room, as `ctl summary` reads it, and as the gauges show it: 8 GiB
    // free once the clones hold their disks, and nothing in flight.
    let mut admin = AdminClient::new(common::plain_channel(provider.grpc).await);
    let storages = admin
        .node_memory(NodeMemoryRequest {})
        .await
        .expect("NodeMemory")
        .into_inner()
        .storages;
    assert_eq!(storages.len(), 1, "{storages:?}");
    let s = &storages[0];
    assert_eq!(
        (
            s.storage.as_str(),
            s.node.as_str(),
            s.in_flight_bytes,
            s.overcommit
        ),
        ("local-lvm", "pve1", 0, 1.0)
    );
    assert_eq!(s.avail_bytes, s.allowed_bytes);
    let (status, body) = http_get(provider.metrics, "/metrics").unwrap();
    assert_eq!(status, 200);
    for name in [
        "bigfleet_proxmox_storage_avail_bytes",
        "bigfleet_proxmox_storage_allowed_bytes",
    ] {
        let line = format!(
            "{name}{{storage=\"local-lvm\",node=\"pve1\"}} {}",
            s.avail_bytes
        );
        assert!(body.contains(&line), "{line} in\n{body}");
    }
    assert!(
        body.contains(
            "bigfleet_proxmox_storage_in_flight_bytes{storage=\"local-lvm\",node=\"pve1\"} 0"
        ),
        "{body}"
    );
    let out = std::process::Command::new(BIN)
        .args(["ctl", "summary", "--target", &provider.grpc.to_string()])
        .output()
        .expect("ctl summary");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}");
    let row = table
        .lines()
        .find(|l| l.starts_with("local-lvm"))
        .unwrap_or_else(|| panic!("a storage row in\n{table}"));
    assert!(table.contains("STORAGE"), "{table}");
    assert!(row.contains("pve1") && row.contains(" 0.0 GiB"), "{row}");
    assert_eq!(
        s.avail_bytes,
        8 * GIB,
        "the three clones' disks are PVE's now"
    );
    drop(dir);
}
