//! The provider binary on the PVE simulator, started while one of its nodes
//! is offline: it serves (the start-up line, read with provider-testkit),
//! logs each node's state, stays ready (its healthy nodes' capacity is
//! served; taking the whole provider out of service for one node would be
//! the outage the offline node is not), and a Create aimed at the offline
//! node waits for it within its deadline instead of failing at once.

use std::time::Duration;

use bigfleet_proto::v1alpha1::capacity_provider_client::CapacityProviderClient;
use bigfleet_proto::v1alpha1::{CreateRequest, MachineRef, MachineState};
use provider_testkit::wait::Wait;
use pve_sim::{endpoints, PveSim, SimConfig, TemplateSpec};
use tonic::transport::Channel;

use crate::common::{
    http_get, sim_backend_args, sim_ca_file, speculative_in, start_blocking, wait_failed,
    wait_state, Provider,
};

const DEADLINE: Duration = Duration::from_secs(60);

async fn sim_with_pve2_offline() -> (PveSim, tempfile::TempDir, std::path::PathBuf) {
    let sim = PveSim::start(SimConfig {
        nodes: vec!["pve1".into(), "pve2".into()],
        templates: vec![TemplateSpec::shared(9000, "pve1")],
        clone_duration: Duration::from_millis(150),
        agent_boot_delay: Duration::from_millis(100),
        ..SimConfig::default()
    })
    .await
    .expect("simulator");
    assert!(sim.set_node_online("pve2", false));
    let (dir, ca) = sim_ca_file(&sim);
    (sim, dir, ca)
}

/// Boots the binary (blocking: run beside the simulator's runtime); it
/// returns once the start-up line is out and /readyz answers 200.
async fn start(sim: &PveSim, ca: &std::path::Path, create_timeout: &str) -> Provider {
    start_blocking(sim_backend_args(
        sim,
        ca,
        "pve1,pve2",
        &[
            "--seed-count",
            "2",
            "--proxmox-poll-interval",
            "50ms",
            "--readiness-command=",
            "--reconcile-interval",
            "250ms",
            "--create-timeout",
            create_timeout,
            "--delete-timeout",
            create_timeout,
            "--configure-timeout",
            create_timeout,
        ],
    ))
    .await
}

async fn create(c: &mut CapacityProviderClient<Channel>, id: &str) {
    c.create(CreateRequest {
        machine_id: id.to_string(),
        ..Default::default()
    })
    .await
    .expect("Create accepted");
}

fn assert_serves_and_reports_nodes(p: &Provider) {
    assert!(provider_testkit::is_startup_line(&p.startup_line));
    provider_testkit::addr_field(&p.startup_line, "addr").expect("the line names its address");
    let logs = p.stderr();
    let node_line = |node: &str, state: &str| {
        logs.lines()
            .any(|l| l.contains(&format!("node={node}")) && l.contains(state))
    };
    assert!(
        node_line("pve1", "online"),
        "pve1's state is logged:\n{logs}"
    );
    assert!(
        node_line("pve2", "offline"),
        "pve2's state is logged:\n{logs}"
    );
    assert!(
        logs.lines()
            .any(|l| l.contains("pve2") && l.contains("level=warn")),
        "the offline node is a warning:\n{logs}"
    );
    assert_eq!(
        http_get(p.metrics, "/readyz").expect("/readyz"),
        (200, "ready".to_string()),
        "ready: the healthy node's capacity is served"
    );
}

/// The simulator with pve2 offline, the binary booted on it (checked to
/// serve and report its nodes) with `create_timeout`, and a client.
async fn boot(
    create_timeout: &str,
) -> (
    PveSim,
    tempfile::TempDir,
    Provider,
    CapacityProviderClient<Channel>,
) {
    let (sim, dir, ca) = sim_with_pve2_offline().await;
    let p = start(&sim, &ca, create_timeout).await;
    assert_serves_and_reports_nodes(&p);
    let c = p.client().await;
    (sim, dir, p, c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_with_a_node_offline_and_a_create_waits_for_it() {
    let (sim, _dir, p, mut c) = boot("40s").await;

    // The healthy node's capacity works meanwhile.
    let on_pve1 = speculative_in(&mut c, "pve1").await;
    create(&mut c, &on_pve1).await;
    wait_state(&mut c, &on_pve1, MachineState::Idle, DEADLINE).await;

    // A Create aimed at the offline node keeps trying, CREATING, not FAILED:
    // it checks the node before each attempt (PVE would accept a clone to
    // an offline node) and sends no clone there.
    let on_pve2 = speculative_in(&mut c, "pve2").await;
    let clones_before = sim.call_count(endpoints::CLONE);
    let checks_before = sim.call_count(endpoints::NODES);
    create(&mut c, &on_pve2).await;
    Wait::new("the Create to check the offline node thrice", DEADLINE)
        .every(Duration::from_millis(25))
        .until(|| sim.call_count(endpoints::NODES) >= checks_before + 3)
        .await;
    let m = c
        .get(MachineRef {
            id: on_pve2.clone(),
        })
        .await
        .expect("Get")
        .into_inner();
    assert_eq!(
        m.state,
        MachineState::Creating as i32,
        "waiting for the node, not failed: {}",
        m.last_error
    );
    assert_eq!(
        sim.call_count(endpoints::CLONE),
        clones_before,
        "no clone sent to the offline node"
    );
    assert_eq!(
        http_get(p.metrics, "/readyz").expect("/readyz").0,
        200,
        "still ready while a Create waits for its node"
    );

    // The node comes back within the deadline: the Create lands there.
    assert!(sim.set_node_online("pve2", true));
    let idle = wait_state(&mut c, &on_pve2, MachineState::Idle, DEADLINE).await;
    let host = idle.host.expect("an IDLE machine has a host").r#ref;
    assert!(host.starts_with("pve2/"), "{host}");
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_on_a_node_that_stays_offline_fails_naming_it() {
    let (sim, _dir, _p, mut c) = boot("3s").await;
    let on_pve2 = speculative_in(&mut c, "pve2").await;
    create(&mut c, &on_pve2).await;
    let failed = wait_failed(&mut c, &on_pve2, DEADLINE).await;
    assert!(
        failed.last_error.contains("node pve2") && failed.last_error.contains("offline"),
        "last_error names the node: {}",
        failed.last_error
    );
    sim.shutdown().await;
}
