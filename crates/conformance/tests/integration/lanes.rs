//! End-to-end runs of the runner's lanes against the in-crate fault-provider (built on
//! providerkit): the suite certifies a correct engine, and the durable lane FAILS (not skips)
//! against a provider that loses its state on restart.

use std::path::PathBuf;
use std::time::Duration;

use conformance::report::{Status, Verdict};
use conformance::runner::{run, RunConfig};

fn fault_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_fault-provider"))
}

fn config(profiles: &[&str]) -> RunConfig {
    let mut cfg = RunConfig::new(profiles.iter().map(|s| s.to_string()).collect(), 1234);
    cfg.provider_bin = Some(fault_bin());
    cfg.fault_bin = Some(fault_bin());
    cfg.runner_bin = Some(PathBuf::from(env!("CARGO_BIN_EXE_bfconformance")));
    cfg.concurrency = 4;
    cfg.expect_caps = vec!["Delete".into(), "SinceRevision".into()];
    cfg
}

fn failures(r: &conformance::report::Report) -> Vec<String> {
    r.baseline
        .iter()
        .chain(r.behaviors.iter())
        .filter(|(_, v)| v.status == Status::Failed)
        .map(|(k, v)| format!("{k}: {}", v.message))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn core_cloud_and_fault_lanes_certify_the_engine() {
    let report = run(config(&["core", "cloud", "fault"])).await.expect("run");
    assert_eq!(
        report.verdict,
        Verdict::Certified,
        "failures: {:#?}",
        failures(&report)
    );
    assert!(report.unimplemented.is_empty());
    for id in ["B101", "B312", "B701", "B708", "B907", "B1205"] {
        assert_eq!(report.behaviors[id].status, Status::Passed, "{id}");
    }
    assert!(report.baseline.values().all(|r| r.status != Status::Failed));
    // The provider was also booted the way the published runner boots it.
    let boot = &report.baseline[conformance::runner::BOOT_RECORD];
    assert!(
        boot.status == Status::Passed
            || (boot.status == Status::Skipped && !provider_testkit::host::in_ci()),
        "{boot:?}"
    );
    let json = serde_json::to_value(&report).expect("json");
    assert_eq!(json["behaviors"]["B101"]["status"], "passed");
    assert!(report.junit().contains("<testcase"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn durable_lane_fails_when_state_is_lost() {
    let mut cfg = config(&["durable"]);
    cfg.durable_slow_latency = "5s".into();
    let report = run(cfg).await.expect("run");
    assert_eq!(report.verdict, Verdict::Failed);
    for id in ["B1001", "B1002", "B1003", "B1004"] {
        assert_eq!(
            report.behaviors[id].status,
            Status::Failed,
            "{id} must fail when state is lost: {:?}",
            report.behaviors[id]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scale_lane_runs_small() {
    let mut cfg = config(&["scale"]);
    cfg.scale_count = 2000;
    cfg.scale_baseline = 200;
    cfg.soak = Duration::from_secs(3);
    let report = run(cfg).await.expect("run");
    assert_eq!(
        report.verdict,
        Verdict::Certified,
        "failures: {:#?}",
        failures(&report)
    );
    let scale = report.scale.expect("scale figures");
    assert!(scale["latency"]["Get"]["p99_ms"].as_f64().is_some());
    assert!(scale["soak"]["cycles"].as_u64().unwrap_or(0) > 0);
}
