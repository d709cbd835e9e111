//! The guest is named after its VM before the bootstrap runs, the name is
//! read back, and every command run for the node gets it in
//! `BIGFLEET_NODE_NAME`: against pve-sim's modelled hostname, never the
//! test machine's own.

use std::time::Duration;

use proxmox_backend::proxmox::{vm_name, PveOptions, PveSubstrate};
use proxmox_backend::substrate::{Substrate, VmRef};
use pve_sim::{endpoints, PveSim, SimConfig, TEMPLATE_HOSTNAME};

use crate::common::{self, client, sim_with};

fn opts() -> PveOptions {
    common::opts(Duration::from_secs(30))
}

/// The name the kernel gives this machine, which no test may change.
fn machine_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default()
}

/// A running clone of the template for machine `id` on `pve1`.
async fn clone_one(sub: &PveSubstrate, id: &str) -> VmRef {
    let vm = sub
        .clone_vm(&common::req(id, "pve1"))
        .await
        .expect("create");
    sub.ensure_running(&vm).await.expect("running");
    vm
}

#[tokio::test]
async fn configure_names_the_guest_after_its_vm_before_the_bootstrap() {
    let machine = machine_hostname();
    let sim = sim_with(SimConfig::default()).await;
    let mut o = opts();
    // Ready only when the guest's name and the node name it is given agree.
    o.readiness_command = "test \"$(hostname)\" = \"$BIGFLEET_NODE_NAME\"".into();
    let sub = PveSubstrate::new(client(&sim), o);
    let id = "p/OnDemand/pve.small/pve1/000";
    let vm = clone_one(&sub, id).await;
    assert_eq!(
        sim.guest_hostname(vm.vmid).as_deref(),
        Some(TEMPLATE_HOSTNAME),
        "a clone starts with its template's hostname"
    );
    // The bootstrap records the name it ran under.
    let blob = b"hostname > \"$BIGFLEET_GUEST_ROOT/run/name-at-bootstrap\"\n";
    sub.configure(&vm, blob).await.expect("configure");
    let name = vm_name("pve.small", id);
    assert_eq!(sim.guest_hostname(vm.vmid).as_deref(), Some(name.as_str()));
    assert_eq!(
        sim.read_guest_file(vm.vmid, "/run/name-at-bootstrap")
            .unwrap(),
        format!("{name}\n").as_bytes(),
        "named before the bootstrap runs"
    );
    assert!(
        sub.node_ready(&vm).await.expect("probe"),
        "readiness sees BIGFLEET_NODE_NAME"
    );
    assert_eq!(
        machine_hostname(),
        machine,
        "the test machine keeps its name"
    );
    common::assert_no_violations(&sim);
    sim.shutdown().await;
}

#[tokio::test]
async fn a_hostname_command_that_does_not_take_fails_configure_naming_both_names() {
    let machine = machine_hostname();
    let sim = sim_with(SimConfig::default()).await;
    let mut o = opts();
    o.hostname_command = "true".into();
    let sub = PveSubstrate::new(client(&sim), o);
    let id = "p/OnDemand/pve.small/pve1/001";
    let vm = clone_one(&sub, id).await;
    let e = sub
        .configure(&vm, b"touch \"$BIGFLEET_GUEST_ROOT/run/bootstrapped\"\n")
        .await
        .expect_err("the guest kept its template's name");
    let msg = e.to_string();
    let name = vm_name("pve.small", id);
    assert!(msg.contains(&format!("{name:?}")), "{msg}");
    assert!(msg.contains(&format!("{TEMPLATE_HOSTNAME:?}")), "{msg}");
    assert!(msg.contains("hostname command `true`"), "{msg}");
    assert!(
        sim.read_guest_file(vm.vmid, "/run/bootstrapped").is_err(),
        "the bootstrap never ran under the wrong name"
    );
    assert_eq!(machine_hostname(), machine);
    sim.shutdown().await;
}

#[tokio::test]
async fn an_empty_hostname_command_still_checks_the_name() {
    let sim = sim_with(SimConfig::default()).await;
    let mut o = opts();
    o.hostname_command = String::new();
    let sub = PveSubstrate::new(client(&sim), o);
    let id = "p/OnDemand/pve.small/pve1/002";
    let vm = clone_one(&sub, id).await;
    let e = sub.configure(&vm, b"true\n").await.expect_err("not named");
    assert!(e.to_string().contains("--hostname-command is empty"), "{e}");
    // A template that names its clones itself (cloud-init) passes the check.
    let name = vm_name("pve.small", id);
    std::fs::write(
        sim.guest_root(vm.vmid).join("etc/hostname"),
        format!("{name}\n"),
    )
    .unwrap();
    sub.configure(&vm, b"true\n")
        .await
        .expect("named by the template");
    sim.shutdown().await;
}

/// A machine cloned on pve-sim whose agent boots in 600 ms, PVE holding
/// an agent request for up to `ping_wait` meanwhile; its provider polls
/// every 50 ms. Returns the simulator, the provider, the VM and its name.
async fn booting_guest(ping_wait: Duration, n: &str) -> (PveSim, PveSubstrate, VmRef, String) {
    let sim = sim_with(SimConfig {
        agent_boot_delay: Duration::from_millis(600),
        agent_ping_wait: ping_wait,
        ..SimConfig::default()
    })
    .await;
    let mut o = opts();
    o.poll_interval = Duration::from_millis(50);
    o.drain_command = "true".into();
    let sub = PveSubstrate::new(client(&sim), o);
    let id = format!("p/OnDemand/pve.small/pve1/{n}");
    let vm = clone_one(&sub, &id).await;
    (sim, sub, vm, vm_name("pve.small", &id))
}

/// Configure and Drain send no ping first. A Configure's first guest
/// request is the blob's file-write, then one command names the guest,
/// reads the name back and runs the hook. When the agent is not up (the VM
/// restarted behind the provider's back), PVE refuses the write unsent; it
/// then waits for the agent and goes again, and the hostname is still set.
/// With the agent up, a Configure costs one exec, none for a ping.
#[tokio::test]
async fn the_first_guest_command_waits_for_an_agent_that_is_not_up() {
    // A boot longer than PVE holds an agent request for: the write during
    // it is refused (the next test has one within it).
    let (sim, sub, vm, name) = booting_guest(Duration::from_millis(50), "003").await;

    sim.reset_counts();
    sub.ensure_running(&vm).await.expect("running");
    sub.configure(&vm, b"true\n").await.expect("configure");
    assert_eq!(
        sim.call_count(endpoints::AGENT_PING),
        0,
        "no ping before a Configure"
    );
    assert_eq!(sim.call_count(endpoints::AGENT_FILE_WRITE), 1);
    assert_eq!(
        sim.call_count(endpoints::AGENT_EXEC),
        1,
        "name, read-back and hook: one command"
    );
    assert_eq!(sim.guest_hostname(vm.vmid).as_deref(), Some(name.as_str()));

    // Restarted out of band: it runs, and its agent is not up yet.
    assert!(sim.stop_vm_out_of_band(vm.vmid) && sim.start_vm_out_of_band(vm.vmid));
    std::fs::write(sim.guest_root(vm.vmid).join("etc/hostname"), "template\n").unwrap();
    sim.reset_counts();
    sub.ensure_running(&vm).await.expect("running");
    sub.configure(&vm, b"true\n")
        .await
        .expect("configure once the agent is up");
    assert!(
        sim.call_count(endpoints::AGENT_PING) >= 1,
        "the refused write waited for the agent"
    );
    assert_eq!(
        sim.call_count(endpoints::AGENT_FILE_WRITE),
        2,
        "refused once, then written"
    );
    assert_eq!(sim.call_count(endpoints::AGENT_EXEC), 1);
    assert_eq!(sim.guest_hostname(vm.vmid).as_deref(), Some(name.as_str()));

    // A Drain's command waits alike.
    assert!(sim.stop_vm_out_of_band(vm.vmid) && sim.start_vm_out_of_band(vm.vmid));
    sim.reset_counts();
    sub.ensure_running(&vm).await.expect("running");
    sub.drain(&vm, Duration::ZERO)
        .await
        .expect("drain once the agent is up");
    assert!(sim.call_count(endpoints::AGENT_PING) >= 1);
    assert_eq!(
        sim.call_count(endpoints::AGENT_EXEC),
        2,
        "refused once, then run"
    );
    common::assert_no_violations(&sim);
    sim.shutdown().await;
}

/// As PVE does it: an agent request while the guest boots is held until
/// the agent comes up (within qemu-server's 3 s `guest-ping`), so a
/// Configure right after an out-of-band restart writes once, pings never,
/// and still names the guest.
#[tokio::test]
async fn a_guest_command_during_a_short_boot_is_held_until_the_agent_is_up() {
    // PVE's own wait, longer than the boot.
    let (sim, sub, vm, name) = booting_guest(Duration::from_secs(3), "004").await;
    sub.ensure_running(&vm).await.expect("running");

    assert!(sim.stop_vm_out_of_band(vm.vmid) && sim.start_vm_out_of_band(vm.vmid));
    std::fs::write(sim.guest_root(vm.vmid).join("etc/hostname"), "template\n").unwrap();
    let before = sim.agent_waits()["pve1"].requests;
    sim.reset_counts();
    sub.configure(&vm, b"true\n").await.expect("configure");
    assert_eq!(
        sim.call_count(endpoints::AGENT_FILE_WRITE),
        1,
        "held, then written"
    );
    assert_eq!(sim.call_count(endpoints::AGENT_PING), 0);
    assert_eq!(sim.guest_hostname(vm.vmid).as_deref(), Some(name.as_str()));
    let waited = sim.agent_waits()["pve1"];
    assert_eq!((waited.requests - before, waited.now), (1, 0), "{waited:?}");
}
