//! Mutation check: each deliberately broken engine behaviour (providerkit's `mutants`
//! feature, switched on per run of the fault-provider) must be caught by the behavior that
//! guards it. Run with `cargo test -p conformance --features mutants --test mutants`.
#![cfg(feature = "mutants")]

use std::path::PathBuf;

use conformance::report::Status;
use conformance::runner::{run, RunConfig};

async fn run_mutant(mutant: &str, ids: &[&str]) -> conformance::report::Report {
    let mut cfg = RunConfig::new(vec!["core".into(), "cloud".into()], 99);
    cfg.provider_bin = Some(PathBuf::from(env!("CARGO_BIN_EXE_fault-provider")));
    cfg.provider_args
        .extend(["--mutant".to_string(), mutant.to_string()]);
    cfg.only = Some(ids.iter().map(|s| s.to_string()).collect());
    cfg.concurrency = 4;
    run(cfg).await.expect("run")
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
async fn the_unbroken_engine_passes_the_same_guards() {
    let ids = [
        "B302", "B501", "B504", "B201", "B202", "B311", "B904", "B908",
    ];
    let mut cfg = RunConfig::new(vec!["core".into(), "cloud".into()], 99);
    cfg.provider_bin = Some(PathBuf::from(env!("CARGO_BIN_EXE_fault-provider")));
    cfg.only = Some(ids.iter().map(|s| s.to_string()).collect());
    let r = run(cfg).await.expect("run");
    for id in ids {
        assert_eq!(
            r.behaviors[id].status,
            Status::Passed,
            "{id}: {:?}",
            r.behaviors[id]
        );
    }
}
