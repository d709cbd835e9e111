//! A disk PVE could not free when it destroyed a machine's VM, end to end:
//! the built binary on the real backend against pve-sim as PVE 8 and as PVE
//! 9. The Delete succeeds (the VM is gone), and the leftover volume is
//! reported: a WARN naming it and the destroy task, and
//! `bigfleet_proxmox_destroy_leftover_volumes_total`.

use std::time::Duration;

use bigfleet_proto::v1alpha1::{DeleteRequest, MachineState};
use pve_sim::{PveSim, SimConfig};

use crate::common::{self, http_get, sim_backend_args, sim_ca_file, wait_state};

const LIFECYCLE_DEADLINE: Duration = Duration::from_secs(30);
const COUNTER: &str = "bigfleet_proxmox_destroy_leftover_volumes_total";

/// The counter's value in a plain-text scrape.
fn leftovers(p: &common::Provider) -> Option<String> {
    let (status, body) = http_get(p.metrics, "/metrics").expect("GET /metrics");
    assert_eq!(status, 200, "{body}");
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("{COUNTER} ")))
        .map(str::to_string)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_the_destroy_left_is_a_warn_and_a_count_on_pve_8_and_9() {
    for pve9 in [false, true] {
        let sim = PveSim::start(SimConfig {
            pve9,
            clone_duration: Duration::from_millis(150),
            agent_boot_delay: Duration::from_millis(50),
            rrd_lag: Duration::ZERO,
            ..SimConfig::default()
        })
        .await
        .expect("simulator");
        let (_dir, ca) = sim_ca_file(&sim);
        let args = sim_backend_args(
            &sim,
            &ca,
            "pve1",
            &["--seed-count", "1", "--proxmox-poll-interval", "50ms"],
        );
        let p = common::start_blocking(args).await;
        // The series exists from the start, at 0, so `increase()` sees
        // the first leak.
        assert_eq!(leftovers(&p).as_deref(), Some("0"), "pve9={pve9}");
        let mut c = p.client().await;
        let id = common::create_speculative(&mut c).await;
        let idle = wait_state(&mut c, &id, MachineState::Idle, LIFECYCLE_DEADLINE).await;
        let host = idle.host.expect("a host").r#ref;
        let vmid: u32 = host
            .rsplit_once('/')
            .and_then(|(_, v)| v.parse().ok())
            .expect("node/vmid");
        let storage = sim.vm(vmid).expect("the VM").storage;
        sim.set_storage_busy("pve1", &storage, true);
        c.delete(DeleteRequest {
            machine_id: id.clone(),
            ..Default::default()
        })
        .await
        .expect("Delete");
        let done = wait_state(&mut c, &id, MachineState::Speculative, LIFECYCLE_DEADLINE).await;
        assert!(done.last_error.is_empty(), "{}", done.last_error);
        assert!(sim.vm(vmid).is_none(), "the VM is gone");
        let left = sim.leftover_volumes();
        assert_eq!(left.len(), 1, "{left:?}");
        let volid = &left[0].volid;
        let line = p
            .logs
            .wait_for(Duration::from_secs(5), |l| {
                l.contains("could not remove one of its disks")
            })
            .unwrap_or_else(|| panic!("pve9={pve9}: no WARN; stderr:\n{}", p.logs.text()));
        assert!(line.contains("level=warn"), "{line}");
        assert!(line.contains(volid.as_str()), "{volid} in {line}");
        assert!(line.contains(&host), "{host} in {line}");
        assert!(line.contains(":qmdestroy:"), "the task's UPID in {line}");
        assert!(!line.contains(sim.token_secret()), "{line}");
        assert_eq!(leftovers(&p).as_deref(), Some("1"), "pve9={pve9}");
        drop(c);
        drop(p);
        sim.shutdown().await;
    }
}
