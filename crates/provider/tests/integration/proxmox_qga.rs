//! The provider binary on the PVE simulator with a real `qemu-ga` behind every
//! VM: the bootstrap and drain hooks really run (confined to the VM's scratch
//! dir). Without qemu-ga (package `qemu-guest-agent`) the test is skipped,
//! except under `CI=true`, where it fails.

use std::path::PathBuf;
use std::time::Duration;

use bigfleet_proto::v1alpha1::{ConfigureRequest, DeleteRequest, DrainRequest, MachineState};
use provider_testkit::host::{alive, or_skip};
use provider_testkit::wait::until;
use proxmox_backend::substrate::VmRef;
use pve_sim::{GuestAgentMode, PveSim, SimConfig};

use crate::common::{self, sim_backend_args, sim_ca_file, wait_state, Provider};

const DEADLINE: Duration = Duration::from_secs(60);
const JOIN_SECRET: &str = "join-secret-5b7e0c";

/// The qemu-ga to use, or `None` (after saying so) to skip.
fn qemu_ga_or_skip() -> Option<PathBuf> {
    or_skip(pve_sim::find_qemu_ga().ok_or_else(|| {
        "qemu-ga is not installed (not on PATH or in /usr/sbin; install the qemu-guest-agent package)".to_string()
    }))
}

// The provider blocks this thread while it starts and preflights against the
// simulator, so the simulator needs a second worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_lifecycle_with_real_qemu_ga() {
    let Some(bin) = qemu_ga_or_skip() else { return };
    let sim = PveSim::start(SimConfig {
        guest_agent: GuestAgentMode::Qga(bin),
        ..SimConfig::default()
    })
    .await
    .expect("simulator");
    assert!(sim.qemu_ga().is_some());
    let (_dir, ca) = sim_ca_file(&sim);
    let args = sim_backend_args(
        &sim,
        &ca,
        "pve1",
        &[
            "--seed-count",
            "1",
            "--proxmox-poll-interval",
            "50ms",
            // Both hooks run in the guest through qemu-ga and leave evidence there.
            "--readiness-command",
            "test -s \"$BIGFLEET_GUEST_ROOT/etc/bigfleet/join-secret\"",
            "--drain-command",
            "echo drained >\"$BIGFLEET_GUEST_ROOT/run/drained\"",
        ],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let provider = Provider::start(&args);
    let mut c = provider.client().await;

    let id = common::create_speculative(&mut c).await;
    let idle = wait_state(&mut c, &id, MachineState::Idle, DEADLINE).await;
    let host_ref = idle.host.expect("IDLE machine has a host").r#ref;
    let vm = VmRef::parse(&host_ref).expect("host ref");
    let root = sim.guest_root(vm.vmid);

    // The blob is a script `/bin/sh <bootstrap-path>` runs; it records the join
    // secret and where it ran.
    let blob = format!(
        "mkdir -p \"$BIGFLEET_GUEST_ROOT/etc/bigfleet\"\n\
         printf '%s' '{JOIN_SECRET}' >\"$BIGFLEET_GUEST_ROOT/etc/bigfleet/join-secret\"\n\
         pwd >\"$BIGFLEET_GUEST_ROOT/run/bootstrap-cwd\"\n"
    );
    c.configure(ConfigureRequest {
        machine_id: id.clone(),
        cluster_id: "cluster-qga".into(),
        bootstrap_blob: blob.clone().into_bytes(),
        ..Default::default()
    })
    .await
    .expect("Configure");
    wait_state(&mut c, &id, MachineState::Configured, DEADLINE).await;

    let qga_pid = sim
        .qemu_ga_pid(vm.vmid)
        .expect("the VM's agent calls went to a qemu-ga");
    assert!(alive(qga_pid));
    assert_eq!(
        std::fs::read(root.join("run/bigfleet-bootstrap")).unwrap(),
        blob.as_bytes(),
        "blob delivered into the scratch dir"
    );
    assert_eq!(
        std::fs::read(root.join("etc/bigfleet/join-secret")).unwrap(),
        JOIN_SECRET.as_bytes(),
        "the bootstrap hook ran and wrote the join secret"
    );
    let cwd = std::fs::read_to_string(root.join("run/bootstrap-cwd")).unwrap();
    assert_eq!(
        PathBuf::from(cwd.trim()).canonicalize().unwrap(),
        root.canonicalize().unwrap(),
        "the hook ran inside the scratch dir"
    );
    // Named after its VM (through qemu-ga, in the simulated guest only),
    // and every guest command's exit logged as a plain value.
    let name = sim.vm(vm.vmid).expect("the VM").name;
    assert_eq!(sim.guest_hostname(vm.vmid).as_deref(), Some(name.as_str()));
    let log = provider.stderr();
    for msg in [
        "hostname command exited",
        "bootstrap exited",
        "readiness probe",
    ] {
        let line = log
            .lines()
            .find(|l| provider_testkit::field(l, "msg").as_deref() == Some(msg))
            .unwrap_or_else(|| panic!("no {msg:?} line:\n{log}"));
        assert_eq!(
            provider_testkit::field(line, "exit_code").as_deref(),
            Some("0"),
            "{line}"
        );
    }

    c.drain(DrainRequest {
        machine_id: id.clone(),
        grace_period_seconds: 7,
        ..Default::default()
    })
    .await
    .expect("Drain");
    wait_state(&mut c, &id, MachineState::Idle, DEADLINE).await;
    let drained = std::fs::read_to_string(root.join("run/drained")).unwrap();
    assert!(
        drained.starts_with("drained --grace-period=7 --timeout="),
        "the drain command ran with the grace period: {drained:?}"
    );

    c.delete(DeleteRequest {
        machine_id: id.clone(),
        ..Default::default()
    })
    .await
    .expect("Delete");
    wait_state(&mut c, &id, MachineState::Speculative, DEADLINE).await;
    assert!(sim.vm(vm.vmid).is_none(), "VM destroyed");
    assert_eq!(sim.qemu_ga_pid(vm.vmid), None);
    until(
        "qemu-ga to stop with its VM",
        Duration::from_secs(10),
        || !alive(qga_pid),
    )
    .await;
    let v = sim.schema_violations();
    assert!(v.is_empty(), "schema violations: {v:?}");
    drop(provider);
    sim.shutdown().await;
}
