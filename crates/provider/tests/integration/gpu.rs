//! Mapped PCI devices end to end (#44 item 3), as a new user would try
//! them: the built binary on pve-sim, an instance type with one device of
//! mapping `a10` per clone, offered 4 times on pve1, whose mapping has two
//! devices. A burst of four Creates: two land IDLE with a
//! `hostpci0: mapping=a10` each, the other two are refused with
//! RESOURCE_EXHAUSTED and stay SPECULATIVE; nothing is left transitional,
//! nothing was cloned for them; `allocatable` and `resources` carry
//! `nvidia.com/gpu`. An offering on a node the mapping does not cover stops
//! the start-up, naming both.

use std::time::Duration;

use bigfleet_proto::v1alpha1::{ListFilter, MachineState};
use pve_sim::{endpoints, PciMapping, PveSim, SimConfig};

use crate::common::{self, path_str, sim_backend_args, sim_ca_file, wait_state};

const TYPES: &str = r#"{"gpu.a10": {"vcpu": 4, "memory_mib": 4096, "template_vmid": 9000,
    "pci": {"mapping": "a10", "count": 1, "resource": "nvidia.com/gpu"}}}"#;

async fn gpu_sim() -> PveSim {
    PveSim::start(SimConfig {
        pci_mappings: vec![PciMapping::new("a10", &[("pve1", 2)])],
        granted_privileges: vec![("/mapping/pci/a10".into(), "Mapping.Use".into())],
        max_parallel_local_clones: None,
        clone_duration: Duration::from_millis(300),
        agent_boot_delay: Duration::from_millis(50),
        rrd_lag: Duration::ZERO,
        ..SimConfig::default()
    })
    .await
    .expect("simulator")
}

#[tokio::test(flavor = "multi_thread")]
async fn two_mapped_devices_take_two_gpu_machines_and_refuse_the_rest() {
    let sim = gpu_sim().await;
    let (dir, ca) = sim_ca_file(&sim);
    let types = dir.path().join("types.json");
    std::fs::write(&types, TYPES).unwrap();
    let offerings = dir.path().join("offerings.json");
    std::fs::write(
        &offerings,
        r#"[{"instance_type":"gpu.a10","zone":"pve1","count":4}]"#,
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
            "--max-parallel-clones",
            "4",
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
    assert_eq!(machines.len(), 4);
    for m in &machines {
        for (what, r) in [("allocatable", &m.allocatable), ("resources", &m.resources)] {
            let r = r.as_ref().unwrap_or_else(|| panic!("{what} of {}", m.id));
            assert_eq!(
                r.resources.get("nvidia.com/gpu").map(String::as_str),
                Some("1"),
                "{what}: {r:?}"
            );
        }
    }
    let (accepted, refused) = common::create_burst(
        &client,
        &machines.iter().map(|m| m.id.clone()).collect::<Vec<_>>(),
        &["node pve1 has no free device of PCI mapping a10"],
    )
    .await;
    assert_eq!((accepted.len(), refused.len()), (2, 2), "{refused:?}");
    for id in &accepted {
        wait_state(&mut client, id, MachineState::Idle, Duration::from_secs(60)).await;
    }
    assert_eq!(
        sim.call_count(endpoints::CLONE),
        2,
        "nothing cloned for the refused"
    );
    let vms: Vec<_> = sim.vms().into_values().filter(|v| !v.template).collect();
    assert_eq!(vms.len(), 2, "nothing leaked");
    for vm in &vms {
        assert!(vm.running);
        assert_eq!(
            vm.extra.get("hostpci0").map(String::as_str),
            Some("mapping=a10")
        );
    }
    for m in client
        .list(ListFilter::default())
        .await
        .unwrap()
        .into_inner()
        .machines
    {
        let state = MachineState::try_from(m.state).unwrap();
        let want = if refused.contains(&m.id) {
            MachineState::Speculative
        } else {
            MachineState::Idle
        };
        assert_eq!(state, want, "{}", m.id);
    }
    drop(dir);
    sim.shutdown().await;
}

#[tokio::test]
async fn an_offering_on_a_node_the_mapping_does_not_cover_stops_the_start_up() {
    let sim = gpu_sim().await;
    let (dir, ca) = sim_ca_file(&sim);
    let types = dir.path().join("types.json");
    std::fs::write(&types, TYPES).unwrap();
    let offerings = dir.path().join("offerings.json");
    std::fs::write(
        &offerings,
        r#"[{"instance_type":"gpu.a10","zone":"pve1","count":1},
            {"instance_type":"gpu.a10","zone":"pve2","count":1}]"#,
    )
    .unwrap();
    let args = sim_backend_args(
        &sim,
        &ca,
        "pve1,pve2",
        &[
            "--instance-types",
            path_str(&types),
            "--offerings",
            path_str(&offerings),
        ],
    );
    let mut args = args;
    args.extend(["--addr", "127.0.0.1:0", "--metrics-addr", ""].map(String::from));
    let run = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        common::run_to_exit(&args, Duration::from_secs(60))
    })
    .await
    .unwrap();
    assert!(!run.status.success(), "{}", run.stderr);
    assert!(
        run.stderr.contains(
            "instance type gpu.a10 is offered on node pve2, but PCI mapping a10 maps 0 device(s) there"
        ),
        "{}",
        run.stderr
    );
    drop(dir);
    sim.shutdown().await;
}
