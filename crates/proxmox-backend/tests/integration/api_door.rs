//! Every PVE call goes through one door (`Api`), which retries a transient
//! failure whichever part makes the call: the start-up check, the VMID
//! choice, the node memory guard, the clone, the guest agent, the destroy.
//! The client here makes one attempt per call, so only the door's retry
//! can carry a step past the failures injected before it.

use std::time::Duration;

use proxmox_backend::proxmox::{PveOptions, PveSubstrate};
use proxmox_backend::substrate::{Substrate, VmRef};
use pve::RetryPolicy;
use pve_sim::{endpoints, PveSim, SimConfig};

use crate::common::{self, client_of, config, req, sim_with};

/// Failures injected before a step: more than one, so a single retry is
/// not enough either.
const FAILURES: u32 = 2;

/// A client that never repeats a call by itself.
fn one_attempt(sim: &PveSim) -> pve::PveClient {
    let mut cfg = config(sim);
    cfg.request_timeout = Duration::from_secs(10);
    cfg.retry = RetryPolicy::none();
    client_of(cfg)
}

fn opts() -> PveOptions {
    PveOptions {
        retry_window: Duration::from_secs(20),
        ..common::opts(Duration::from_secs(20))
    }
}

/// `endpoint` answers the next [`FAILURES`] calls with PVE's proxy error
/// for a node it could not reach (a transient failure).
fn fail_next(sim: &PveSim, endpoint: &str) -> u64 {
    sim.faults()
        .fail_next(endpoint, FAILURES, 503, "Service Unavailable");
    sim.faults().call_count(endpoint)
}

/// The step passed the failures: the endpoint saw them and one more call.
fn assert_retried(sim: &PveSim, endpoint: &str, before: u64, step: &str) {
    let calls = sim.faults().call_count(endpoint) - before;
    assert!(
        calls > u64::from(FAILURES),
        "{step}: {endpoint} was called {calls} times after {FAILURES} injected failures"
    );
}

#[tokio::test]
async fn a_transient_failure_is_retried_whichever_part_makes_the_call() {
    let sim = sim_with(common::fast_sim(
        Duration::from_millis(100),
        Duration::from_millis(50),
    ))
    .await;
    let sub = PveSubstrate::new(one_attempt(&sim), opts());

    // The start-up check: the token's privileges, the template's config.
    for endpoint in [endpoints::PERMISSIONS, endpoints::CONFIG_GET] {
        let before = fail_next(&sim, endpoint);
        let warnings = sub
            .preflight(&["pve1".into()], &[9000])
            .await
            .unwrap_or_else(|e| panic!("preflight after failing {endpoint}: {e}"));
        assert!(
            !warnings.iter().any(|w| w.contains("could not read")),
            "preflight after failing {endpoint} gave up a check: {warnings:?}"
        );
        assert_retried(&sim, endpoint, before, "preflight");
    }

    // A Create: the node memory guard's read, the VMID choice, the guest
    // agent's first answer.
    let mut vms: Vec<(VmRef, String)> = Vec::new();
    for (n, endpoint) in [
        endpoints::NODE_VMS,
        endpoints::NEXTID,
        endpoints::AGENT_PING,
    ]
    .into_iter()
    .enumerate()
    {
        let id = format!("p/OnDemand/pve.small/pve1/{n:03}");
        let r = req(&id, "pve1");
        let before = fail_next(&sim, endpoint);
        let _held = sub.admit(&r).await.expect("room");
        let vm = sub
            .clone_vm(&r)
            .await
            .unwrap_or_else(|e| panic!("create after failing {endpoint}: {e}"));
        sub.ensure_running(&vm)
            .await
            .unwrap_or_else(|e| panic!("running after failing {endpoint}: {e}"));
        assert_retried(&sim, endpoint, before, "create");
        vms.push((vm, id));
    }

    // Configure: the blob written through the agent.
    let (vm, _) = &vms[0];
    let before = fail_next(&sim, endpoints::AGENT_FILE_WRITE);
    sub.configure(vm, b"true\n")
        .await
        .expect("configure after failed file writes");
    assert_retried(&sim, endpoints::AGENT_FILE_WRITE, before, "configure");

    // Delete: the marker's read, the destroy.
    for (endpoint, (vm, id)) in [endpoints::CONFIG_GET, endpoints::DESTROY]
        .into_iter()
        .zip(&vms)
    {
        let before = fail_next(&sim, endpoint);
        sub.delete_vm(vm, id)
            .await
            .unwrap_or_else(|e| panic!("delete after failing {endpoint}: {e}"));
        assert!(sim.vm(vm.vmid).is_none(), "{vm} destroyed");
        assert_retried(&sim, endpoint, before, "delete");
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn the_first_answer_of_a_start_up_check_is_not_waited_for() {
    // A wrong URL or a cluster that is down fails the start at once: the
    // first read is made once (here one attempt), not retried for the
    // retry window.
    let sim = sim_with(SimConfig::default()).await;
    let sub = PveSubstrate::new(one_attempt(&sim), opts());
    sim.faults()
        .fail_next(endpoints::NODES, 1, 503, "Service Unavailable");
    let started = std::time::Instant::now();
    let e = sub
        .preflight(&["pve1".into()], &[9000])
        .await
        .expect_err("the cluster did not answer");
    assert!(e.to_string().contains("listing the cluster's nodes"), "{e}");
    assert!(
        started.elapsed() < opts().retry_window,
        "the first read waited out the retry window"
    );
    sim.shutdown().await;
}

/// How far a full clone under way has copied, read from its task's log
/// through the door (past transient failures): a percent while it copies,
/// `None` for a task whose log reports no copy, a clear error for a UPID
/// that is not one.
#[tokio::test]
async fn a_clones_copy_progress_is_read_from_its_log_through_the_door() {
    let sim = sim_with(SimConfig {
        // The template's 32 GiB disk in about 4 s.
        storage_bandwidth: vec![("local-lvm".into(), 8 << 30)],
        ..common::fast_sim(Duration::from_millis(100), Duration::from_millis(50))
    })
    .await;
    let sub = PveSubstrate::new(one_attempt(&sim), opts());
    let pve = common::client(&sim);
    let clone = |newid, full| {
        let params = pve::CloneParams {
            newid,
            full: Some(full),
            ..Default::default()
        };
        let pve = pve.clone();
        async move { pve.clone_vm("pve1", 9000, &params).await.expect("clone") }
    };
    let upid = clone(150, true).await.to_string();
    // Until its copy has begun (after the volume's allocation).
    let first = provider_testkit::wait::Wait::new(
        "the copy's first progress line",
        Duration::from_secs(10),
    )
    .some_async(|| async { sub.copy_progress(&upid).await.expect("read") })
    .await;
    assert!((0.0..100.0).contains(&first), "{first}");
    let before = fail_next(&sim, endpoints::TASK_LOG);
    let again = sub
        .copy_progress(&upid)
        .await
        .expect("read past the failures")
        .expect("a percent");
    assert_retried(&sim, endpoints::TASK_LOG, before, "copy progress");
    assert!(again >= first, "{first} then {again}");

    // A linked clone copies nothing: its log, once it ended, has no
    // progress line.
    let linked = clone(151, false).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    pve.wait_task(&linked, deadline, Duration::from_millis(20))
        .await
        .expect("the linked clone ends");
    assert_eq!(
        sub.copy_progress(&linked.to_string()).await.expect("read"),
        None
    );
    let bad = sub
        .copy_progress("not-a-upid")
        .await
        .expect_err("not a UPID");
    assert!(bad.to_string().contains("UPID"), "{bad}");
    sim.shutdown().await;
}
