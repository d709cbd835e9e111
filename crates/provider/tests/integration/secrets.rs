//! Secret hygiene end to end: the provider binary on the PVE simulator with
//! a bootstrap that fails and echoes its blob. The blob must not reach
//! `last_error` (Get and List), the log, the metrics or the state file.

use std::time::Duration;

use bigfleet_proto::v1alpha1::{ConfigureRequest, ListFilter, MachineState};
use pve_sim::{PveSim, SimConfig};

use crate::common::{
    self, http_get, path_str, sim_backend_args, sim_ca_file, wait_failed, wait_state, Provider,
};

const DEADLINE: Duration = Duration::from_secs(60);
/// A bare join token as the whole blob: `/bin/sh <path>` answers
/// `<path>: 1: <token>: not found` on stderr and exits 127.
const TOKEN: &str = "K10f3a9c2e7b1d4::server:7c1e5a0b9d2f44e8";
/// A second secret on its own line, echoed by `set -x`-style tracing.
const LINE_SECRET: &str = "sha256:5d41402abc4b2a76b9719d911017c592";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_bootstrap_that_echoes_the_blob_leaks_nothing() {
    let sim = PveSim::start(SimConfig::default())
        .await
        .expect("simulator");
    let (dir, ca) = sim_ca_file(&sim);
    let state = dir.path().join("state.db");
    let args = sim_backend_args(
        &sim,
        &ca,
        "pve1",
        &[
            "--seed-count",
            "1",
            "--proxmox-poll-interval",
            "50ms",
            "--state",
            path_str(&state),
        ],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let provider = Provider::start(&args);
    let mut c = provider.client().await;
    let id = common::create_speculative(&mut c).await;
    wait_state(&mut c, &id, MachineState::Idle, DEADLINE).await;

    // Line 1 is the bare token (not a command: "not found"); line 2 prints
    // the second secret to stderr and fails.
    let blob = format!("{TOKEN}\necho \"bad hash {LINE_SECRET}\" >&2\nexit 3\n");
    c.configure(ConfigureRequest {
        machine_id: id.clone(),
        cluster_id: "cluster-secret".into(),
        bootstrap_blob: blob.into_bytes(),
        ..Default::default()
    })
    .await
    .expect("Configure is accepted; the bootstrap fails later");
    let failed = wait_failed(&mut c, &id, DEADLINE).await;
    let err = &failed.last_error;
    assert!(err.contains("exited 3"), "{err}");
    // "bad hash" is printed from the blob verbatim as part of a 48-byte
    // run of it, so it goes with the secret; the shell's own words stay.
    assert!(err.contains("not found"), "{err}");
    assert!(
        err.contains("[redacted]") && err.contains("replaced"),
        "{err}"
    );
    let secrets = [TOKEN, LINE_SECRET, "K10f3a9c2e7b1d4", "5d41402abc4b2a76"];
    for s in secrets {
        assert!(!err.contains(s), "Get last_error leaks {s:?}: {err}");
    }
    let listed = c
        .list(ListFilter::default())
        .await
        .expect("List")
        .into_inner();
    let m = listed.machines.iter().find(|m| m.id == id).unwrap();
    assert_eq!(&m.last_error, err);

    let (_, metrics) = http_get(provider.metrics, "/metrics").expect("/metrics");
    // The failure is logged at WARN; wait for it, then look at everything.
    assert!(
        provider
            .logs
            .wait_for(DEADLINE, |l| l.contains("[redacted]"))
            .is_some(),
        "the failure was not logged: {}",
        provider.stderr()
    );
    drop(c);
    let logs_and_metrics = format!("{metrics}\n{}", provider.stderr());
    drop(provider);
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let path = entry.unwrap().path();
        files.push((path.display().to_string(), std::fs::read(&path).unwrap()));
    }
    for s in secrets {
        assert!(
            !logs_and_metrics.contains(s),
            "the log or /metrics leaks {s:?}"
        );
        for (name, bytes) in &files {
            assert!(
                !bytes.windows(s.len()).any(|w| w == s.as_bytes()),
                "{name} holds {s:?}"
            );
        }
    }
    sim.shutdown().await;
}
