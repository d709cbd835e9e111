//! Mutation check: each deliberately broken engine behaviour (providerkit's `mutants`
//! feature, switched on per run of the fault-provider) must be caught by the behavior that
//! guards it. Run with `cargo test -p conformance --features mutants --test mutants`.
#![cfg(feature = "mutants")]

use std::path::PathBuf;

use conformance::report::Status;
use conformance::runner::{run, RunConfig, BOOT_RECORD};

fn config(ids: &[&str]) -> RunConfig {
    let mut cfg = RunConfig::new(vec!["core".into(), "cloud".into()], 99);
    cfg.provider_bin = Some(PathBuf::from(env!("CARGO_BIN_EXE_fault-provider")));
    cfg.runner_bin = Some(PathBuf::from(env!("CARGO_BIN_EXE_bfconformance")));
    cfg.only = Some(ids.iter().map(|s| s.to_string()).collect());
    cfg.concurrency = 4;
    cfg
}

async fn run_mutant(mutant: &str, ids: &[&str]) -> conformance::report::Report {
    let mut cfg = config(ids);
    let flag = ["--mutant".to_string(), mutant.to_string()];
    cfg.provider_args.extend(flag.clone());
    cfg.boot_args.extend(flag);
    run(cfg).await.expect("run")
}

/// The boot-compatibility check needs a private network namespace; where
/// the machine cannot make one (not root, no user namespaces) it skips,
/// and then it cannot catch anything (under CI=true it fails instead).
fn boot_check_ran(r: &conformance::report::Report) -> bool {
    let rec = &r.baseline[BOOT_RECORD];
    if rec.status == Status::Skipped {
        println!("boot check skipped here: {}", rec.message);
        return false;
    }
    true
}

async fn caught(mutant: &str, guards: &[&str]) {
    let r = run_mutant(mutant, guards).await;
    for id in guards {
        assert_eq!(
            r.behaviors[*id].status,
            Status::Failed,
            "mutant {mutant} escaped {id}: {:?}",
            r.behaviors[*id]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fence_per_shard_is_caught() {
    caught("fence-per-shard", &["B302"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn truncated_metadata_is_caught() {
    caught("truncate-metadata", &["B501", "B504"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failed_precondition_for_out_of_position_is_caught() {
    caught("oop-failed-precondition", &["B201", "B202", "B311"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn revision_bump_on_idle_reconcile_is_caught() {
    caught("bump-revision-on-reconcile", &["B908"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_capped_list_head_that_never_moves_is_caught() {
    caught("frozen-list-head", &["B302"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fence_that_rejects_negative_values_is_caught() {
    caught("reject-negative-tokens", &["B303", "B1201", "B1204"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fatal_bind_of_the_default_metrics_address_is_caught() {
    let r = run_mutant("fatal-default-metrics-bind", &["boot"]).await;
    if boot_check_ran(&r) {
        let rec = &r.baseline[BOOT_RECORD];
        assert_eq!(
            rec.status,
            Status::Failed,
            "mutant escaped the boot check: {rec:?}"
        );
        assert!(rec.message.contains("did not serve"), "{}", rec.message);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_unbroken_engine_passes_the_same_guards() {
    let ids = [
        "B302", "B303", "B501", "B504", "B201", "B202", "B211", "B311", "B904", "B908", "B1201",
        "B1204", "boot",
    ];
    let r = run(config(&ids)).await.expect("run");
    if boot_check_ran(&r) {
        let rec = &r.baseline[BOOT_RECORD];
        assert_eq!(rec.status, Status::Passed, "boot check: {rec:?}");
    }
    for id in ids.iter().filter(|id| **id != "boot") {
        assert_eq!(
            r.behaviors[*id].status,
            Status::Passed,
            "{id}: {:?}",
            r.behaviors[*id]
        );
    }
}
