//! `--state postgres://...`: the binary keeps its state in PostgreSQL across
//! a restart, and refuses a URL that carries the password without echoing
//! it. Needs the test server (provider-testkit's `postgres`); skips without
//! it, fails under CI=true.

use std::time::Duration;

use bigfleet_proto::v1alpha1::{CreateRequest, MachineRef, MachineState};

use crate::common::{run_to_exit, speculative_id, wait_state, Provider};

#[tokio::test]
async fn a_postgres_state_survives_a_restart() {
    let Some(schema) = provider_testkit::postgres::fresh() else {
        return;
    };
    let args = ["--use-fake-backend", "--state", schema.url.as_str()];
    let id = {
        let provider = Provider::start(&args);
        assert!(
            provider.stderr().contains("state created"),
            "{}",
            provider.stderr()
        );
        let mut c = provider.client().await;
        let id = speculative_id(&mut c).await;
        c.create(CreateRequest {
            machine_id: id.clone(),
            shard_id: "s1".into(),
            shard_epoch: 1,
            sequence_number: 1,
        })
        .await
        .expect("Create");
        wait_state(&mut c, &id, MachineState::Idle, Duration::from_secs(30)).await;
        id
    };
    let provider = Provider::start(&args);
    let stderr = provider.stderr();
    assert!(stderr.contains("state loaded"), "{stderr}");
    assert!(stderr.contains("fence_marks=1"), "{stderr}");
    let mut c = provider.client().await;
    let m = c
        .get(MachineRef { id: id.clone() })
        .await
        .expect("Get")
        .into_inner();
    assert_eq!(m.state, MachineState::Idle as i32, "{m:?}");
    assert!(
        schema.query_i64("SELECT count(*) FROM bigfleet_machines") >= 1,
        "the records are in the database"
    );
}

#[test]
fn a_password_in_the_state_url_is_refused_and_never_echoed() {
    let run = run_to_exit(
        &[
            "--use-fake-backend",
            "--addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "",
            "--state",
            "postgres://bf:hunter2@127.0.0.1:1/db?sslmode=disable",
        ],
        Duration::from_secs(30),
    );
    assert!(!run.status.success(), "must refuse:\n{}", run.stderr);
    assert!(
        run.stderr.contains("the URL must not carry the password"),
        "{}",
        run.stderr
    );
    assert!(!run.stderr.contains("hunter2"), "{}", run.stderr);
}
