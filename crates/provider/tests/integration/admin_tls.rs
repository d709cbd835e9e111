//! The Admin service (Reclaim) under mTLS, black-box: it is served on the
//! CapacityProvider listener with the same TLS, so a client without a
//! certificate from the configured CA is refused at the handshake, before
//! any handler runs, and a good client reclaims.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use bigfleet_proto::admin::admin_client::AdminClient;
use bigfleet_proto::admin::ReclaimRequest;
use provider_testkit::wait::Wait;
use serde_json::Value;

use crate::common::{path_str, tls_channel, Pki, Provider, BIN};

/// `--fake-latency 30s` with `--create-timeout 300ms`: a Create times out
/// and lands FAILED (a restart would resume it, not fail it).
fn start(pki: &Pki, state: &Path) -> Provider {
    Provider::start(&[
        "--use-fake-backend",
        "--seed-count",
        "4",
        "--fake-latency",
        "30s",
        "--create-timeout",
        "300ms",
        "--state",
        path_str(state),
        "--tls-cert",
        path_str(&pki.server_cert),
        "--tls-key",
        path_str(&pki.server_key),
        "--tls-ca",
        path_str(&pki.ca),
    ])
}

/// `bigfleet-proxmox ctl --output json ARGS` with the good client cert.
fn ctl(pki: &Pki, addr: SocketAddr, args: &[&str]) -> Value {
    let target = addr.to_string();
    let mut full = vec![
        "ctl",
        "--target",
        &target,
        "--tls-ca",
        path_str(&pki.ca),
        "--tls-cert",
        path_str(&pki.client_cert),
        "--tls-key",
        path_str(&pki.client_key),
        "--output",
        "json",
    ];
    full.extend_from_slice(args);
    let out = Command::new(BIN).args(&full).output().expect("run ctl");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "ctl {args:?}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

/// One Reclaim over TLS trusting the server's CA, with `identity` if any.
async fn reclaim(
    addr: SocketAddr,
    ca: &Path,
    identity: Option<(&Path, &Path)>,
    id: &str,
) -> Result<(), String> {
    let call = async {
        let channel = tls_channel(addr, ca, identity).await?;
        AdminClient::new(channel)
            .reclaim(ReclaimRequest {
                machine_id: id.to_string(),
                wait: true,
            })
            .await
            .map(|_| ())
            .map_err(|s| format!("Reclaim: {s:?}"))
    };
    tokio::time::timeout(Duration::from_secs(15), call)
        .await
        .map_err(|_| "timed out".to_string())?
}

#[tokio::test]
async fn reclaim_needs_a_client_cert_from_the_configured_ca() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state.db");

    // A Create that times out is FAILED, and stays so across a restart.
    let first = start(&pki, &state);
    let list = ctl(
        &pki,
        first.grpc,
        &["list", "--state", "SPECULATIVE", "--max", "1"],
    );
    let id = list[0]["id"].as_str().expect("a machine id").to_string();
    ctl(&pki, first.grpc, &["create", &id]);
    Wait::new(
        format!("{id} to time out (FAILED)"),
        Duration::from_secs(15),
    )
    .every(Duration::from_millis(50))
    .until_blocking(|| ctl(&pki, first.grpc, &["get", &id])["state"] == "FAILED");
    drop(first);
    let p = start(&pki, &state);
    assert_eq!(
        provider_testkit::field(&p.startup_line, "security").as_deref(),
        Some("mTLS")
    );
    assert_eq!(ctl(&pki, p.grpc, &["get", &id])["state"], "FAILED");

    let anonymous = reclaim(p.grpc, &pki.ca, None, &id).await;
    assert!(
        anonymous.is_err(),
        "Reclaim without a client cert: {anonymous:?}"
    );
    let foreign = reclaim(
        p.grpc,
        &pki.ca,
        Some((&pki.other_client_cert, &pki.other_client_key)),
        &id,
    )
    .await;
    assert!(
        foreign.is_err(),
        "Reclaim with another CA's cert: {foreign:?}"
    );
    assert!(
        p.logs.wait_count(Duration::from_secs(10), 2, |l| l
            .contains("TLS handshake failed")),
        "both refusals happen at the handshake:\n{}",
        p.stderr()
    );
    // No handler ran: nothing logged, the machine untouched.
    assert!(
        !p.logs.text().contains("reclaim requested"),
        "a refused client reached the Reclaim handler:\n{}",
        p.stderr()
    );
    assert_eq!(ctl(&pki, p.grpc, &["get", &id])["state"], "FAILED");

    // The good client cert: the tonic client, then the operator CLI.
    reclaim(
        p.grpc,
        &pki.ca,
        Some((&pki.client_cert, &pki.client_key)),
        &id,
    )
    .await
    .expect("Reclaim with the right client cert");
    assert_eq!(ctl(&pki, p.grpc, &["get", &id])["state"], "SPECULATIVE");
    let again = ctl(&pki, p.grpc, &["reclaim", &id, "--wait"]);
    assert_eq!(again["status"], "ALREADY_SPECULATIVE", "{again}");
    assert_eq!(p.logs.text().matches("reclaim requested").count(), 2);
}

#[tokio::test]
async fn an_overlong_machine_id_is_refused_with_a_short_echo() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let p = start(&pki, &dir.path().join("state.db"));
    let long = "x".repeat(64 * 1024);
    let e = reclaim(
        p.grpc,
        &pki.ca,
        Some((&pki.client_cert, &pki.client_key)),
        &long,
    )
    .await
    .expect_err("over the machine_id cap");
    assert!(e.contains("InvalidArgument"), "{e}");
    assert!(
        e.len() < 1024,
        "the error echoes only a prefix: {} bytes",
        e.len()
    );
    assert!(
        !p.logs.text().contains(&long[..1024]),
        "the id is not logged"
    );
}
