//! The provider binary on the PVE simulator, started while one of its nodes
//! is offline: it serves (the start-up line, read with provider-testkit),
//! logs each node's state, stays ready (its healthy nodes' capacity is
//! served; taking the whole provider out of service for one node would be
//! the outage the offline node is not), reports the node down
//! (`bigfleet_proxmox_node_up`), and a Create aimed at the offline node
//! fails at once naming it instead of hanging in CREATING.

use std::time::Duration;

use bigfleet_proto::v1alpha1::capacity_provider_client::CapacityProviderClient;
use bigfleet_proto::v1alpha1::{CreateRequest, MachineState};
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

/// `bigfleet_proxmox_node_up{node}` as `/metrics` says it now.
fn node_up(p: &Provider, node: &str) -> Option<String> {
    let (_, body) = http_get(p.metrics, "/metrics").expect("/metrics");
    let series = format!("bigfleet_proxmox_node_up{{node=\"{node}\"}} ");
    body.lines()
        .find_map(|l| l.strip_prefix(&series).map(str::to_string))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_with_a_node_offline_and_a_create_for_it_fails_at_once_naming_it() {
    // PVE's own timing: a call to the dead node hangs 3 s before its 595
    // (the simulator's default); the start-up must not pay it.
    let started = std::time::Instant::now();
    let (sim, _dir, p, mut c) = boot("40s").await;
    println!("serving with pve2 offline after {:?}", started.elapsed());
    assert!(
        started.elapsed() < Duration::from_secs(45),
        "serving after {:?}",
        started.elapsed()
    );
    assert_eq!(node_up(&p, "pve2").as_deref(), Some("0"), "pve2 is down");
    assert_eq!(node_up(&p, "pve1").as_deref(), Some("1"));

    // The healthy node's capacity works meanwhile.
    let on_pve1 = speculative_in(&mut c, "pve1").await;
    create(&mut c, &on_pve1).await;
    wait_state(&mut c, &on_pve1, MachineState::Idle, DEADLINE).await;

    // A Create aimed at the offline node fails at once, naming it, well
    // within its 40 s deadline: never CREATING for as long as the node is
    // away (PVE would accept a clone to it; none is sent).
    let on_pve2 = speculative_in(&mut c, "pve2").await;
    let clones_before = sim.call_count(endpoints::CLONE);
    let asked = std::time::Instant::now();
    create(&mut c, &on_pve2).await;
    let failed = wait_failed(&mut c, &on_pve2, DEADLINE).await;
    assert!(
        asked.elapsed() < Duration::from_secs(20),
        "failed after {:?}",
        asked.elapsed()
    );
    assert!(
        failed.last_error.contains("node pve2") && failed.last_error.contains("offline"),
        "last_error names the node: {}",
        failed.last_error
    );
    assert_eq!(
        sim.call_count(endpoints::CLONE),
        clones_before,
        "no clone sent to the offline node"
    );
    assert_eq!(
        http_get(p.metrics, "/readyz").expect("/readyz").0,
        200,
        "still ready while a node is down"
    );

    // The node comes back: the next reconcile pass says so.
    assert!(sim.set_node_online("pve2", true));
    Wait::new("node_up of pve2 back to 1", DEADLINE)
        .every(Duration::from_millis(50))
        .until(|| node_up(&p, "pve2").as_deref() == Some("1"))
        .await;
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
