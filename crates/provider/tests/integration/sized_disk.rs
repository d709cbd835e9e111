//! An instance type that sizes the boot disk (#44 item 1), end to end as a
//! new user would try it: `disk_gib: 64` from pve-sim's 32 GiB template
//! gives a VM whose boot disk is 64G, and `allocatable` says so; a guest
//! image that cannot grow its root file system (no `growpart`, no
//! `systemd-repart`) is named once, in a WARN line, by the first Create.

use std::time::Duration;

use bigfleet_proto::v1alpha1::{CreateRequest, ListFilter, MachineState};
use pve_sim::{GuestOutput, PveSim, SimConfig};

use crate::common::{self, path_str, sim_backend_args, sim_ca_file, wait_state};

#[tokio::test(flavor = "multi_thread")]
async fn a_64_gib_type_from_a_32_gib_template_and_a_guest_that_cannot_grow_its_root() {
    let sim = PveSim::start(SimConfig {
        clone_duration: Duration::from_millis(200),
        agent_boot_delay: Duration::from_millis(50),
        rrd_lag: Duration::ZERO,
        ..SimConfig::default()
    })
    .await
    .expect("simulator");
    // The template's image has neither tool.
    sim.add_guest_handler(|e| {
        e.command_line()
            .contains("growpart")
            .then(|| GuestOutput::exit(1))
    });
    let (dir, ca) = sim_ca_file(&sim);
    let types = dir.path().join("types.json");
    std::fs::write(
        &types,
        r#"{"pve.big": {"vcpu": 2, "memory_mib": 2048, "template_vmid": 9000, "disk_gib": 64}}"#,
    )
    .unwrap();
    let offerings = dir.path().join("offerings.json");
    std::fs::write(
        &offerings,
        r#"[{"instance_type":"pve.big","zone":"pve1","count":2}]"#,
    )
    .unwrap();
    let args = sim_backend_args(
        &sim,
        &ca,
        "pve1",
        &[
            "--instance-types",
            path_str(&types),
            "--offerings",
            path_str(&offerings),
            "--proxmox-poll-interval",
            "50ms",
            "--readiness-command",
            "",
        ],
    );
    let provider = common::start_blocking(args).await;
    let mut client = provider.client().await;
    let machines = client
        .list(ListFilter::default())
        .await
        .unwrap()
        .into_inner()
        .machines;
    for m in &machines {
        let a = m.allocatable.as_ref().expect("allocatable");
        assert_eq!(
            a.resources.get("ephemeral-storage").map(String::as_str),
            Some("64Gi"),
            "{a:?}"
        );
    }
    for m in &machines {
        client
            .create(CreateRequest {
                machine_id: m.id.clone(),
                ..Default::default()
            })
            .await
            .expect("Create");
        wait_state(
            &mut client,
            &m.id,
            MachineState::Idle,
            Duration::from_secs(60),
        )
        .await;
    }
    let vms: Vec<_> = sim.vms().into_values().filter(|v| !v.template).collect();
    assert_eq!(vms.len(), 2);
    assert!(vms.iter().all(|v| v.disk_gib == 64), "{vms:?}");
    let warned = provider
        .logs
        .wait_for(Duration::from_secs(5), |l| {
            l.contains("neither growpart nor systemd-repart")
        })
        .expect("a WARN line naming the template contract");
    assert!(
        warned.contains("level=warn") && warned.contains("template=9000"),
        "{warned}"
    );
    let count = provider
        .logs
        .text()
        .lines()
        .filter(|l| l.contains("neither growpart nor systemd-repart"))
        .count();
    assert_eq!(count, 1, "once per template");
    drop(dir);
    sim.shutdown().await;
}
