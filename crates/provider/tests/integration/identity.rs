//! Caller identities under mTLS, black-box: a throwaway CA mints one client
//! certificate per `bigfleet://` identity, the binary is started with
//! `--tls-ca`, and each binding is shown by real calls: a shard acts only
//! for its own `shard_id` (a refusal leaves the other shard's fence mark and
//! machine untouched), read-only tooling reads, only an admin reclaims,
//! certificates without exactly one usable identity are refused everywhere,
//! and `--tls-client-identity any` restores the chain-only check.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use bigfleet_proto::admin::admin_client::AdminClient;
use bigfleet_proto::admin::ReclaimRequest;
use bigfleet_proto::v1alpha1::capacity_provider_client::CapacityProviderClient;
use bigfleet_proto::v1alpha1::{
    ConfigureRequest, CreateRequest, DeleteRequest, ListFilter, Machine, MachineRef, MachineState,
};
use provider_testkit::field;
use tonic::transport::Channel;
use tonic::Code;

use crate::common::{
    http_get, path_str, speculative_id, tls_channel, wait_state, Pki, Provider, BIN,
};

const SETTLE: Duration = Duration::from_secs(30);

/// One client certificate (certificate, key).
type Cert = (PathBuf, PathBuf);

/// The provider on the fake backend under mTLS, with `more` flags.
fn start(pki: &Pki, more: &[&str]) -> Provider {
    let mut args = vec![
        "--use-fake-backend",
        "--seed-count",
        "6",
        "--fake-latency",
        "50ms",
        "--tls-cert",
        path_str(&pki.server_cert),
        "--tls-key",
        path_str(&pki.server_key),
        "--tls-ca",
        path_str(&pki.ca),
    ];
    args.extend_from_slice(more);
    Provider::start(&args)
}

async fn channel(p: &Provider, pki: &Pki, cert: &Cert) -> Channel {
    tls_channel(p.grpc, &pki.ca, Some((&cert.0, &cert.1)))
        .await
        .unwrap_or_else(|e| panic!("mTLS connect with {}: {e}", cert.0.display()))
}

async fn client(p: &Provider, pki: &Pki, cert: &Cert) -> CapacityProviderClient<Channel> {
    CapacityProviderClient::new(channel(p, pki, cert).await)
}

fn admin(pki: &Pki) -> Cert {
    (pki.client_cert.clone(), pki.client_key.clone())
}

async fn create(
    c: &mut CapacityProviderClient<Channel>,
    id: &str,
    shard_id: &str,
    token: (i64, i64),
) -> Result<(), tonic::Status> {
    c.create(CreateRequest {
        machine_id: id.to_string(),
        shard_id: shard_id.to_string(),
        shard_epoch: token.0,
        sequence_number: token.1,
    })
    .await
    .map(|_| ())
}

async fn configure(
    c: &mut CapacityProviderClient<Channel>,
    id: &str,
    shard_id: &str,
    token: (i64, i64),
    blob: &[u8],
) -> Result<(), tonic::Status> {
    c.configure(ConfigureRequest {
        machine_id: id.to_string(),
        cluster_id: "c1".to_string(),
        bootstrap_blob: blob.to_vec(),
        shard_id: shard_id.to_string(),
        shard_epoch: token.0,
        sequence_number: token.1,
        shard_metadata: Default::default(),
    })
    .await
    .map(|_| ())
}

async fn get(c: &mut CapacityProviderClient<Channel>, id: &str) -> Result<Machine, tonic::Status> {
    c.get(MachineRef { id: id.to_string() })
        .await
        .map(|r| r.into_inner())
}

async fn list(c: &mut CapacityProviderClient<Channel>) -> Result<usize, tonic::Status> {
    c.list(ListFilter::default())
        .await
        .map(|r| r.into_inner().machines.len())
}

async fn reclaim(p: &Provider, pki: &Pki, cert: &Cert, id: &str) -> Result<i32, tonic::Status> {
    AdminClient::new(channel(p, pki, cert).await)
        .reclaim(ReclaimRequest {
            machine_id: id.to_string(),
            wait: true,
        })
        .await
        .map(|r| r.into_inner().status)
}

/// The call was refused for its identity, with `message` when given.
fn denied<T: std::fmt::Debug>(result: Result<T, tonic::Status>, message: Option<&str>) -> String {
    let status = result.expect_err("refused for its identity");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    if let Some(want) = message {
        assert_eq!(status.message(), want);
    }
    status.message().to_string()
}

/// `bigfleet_proxmox_identity_rejected_total{rpc,reason}` in a scrape.
fn rejected(p: &Provider, rpc: &str, reason: &str) -> Option<u64> {
    let (_, body) = http_get(p.metrics, "/metrics").expect("scrape /metrics");
    let series =
        format!("bigfleet_proxmox_identity_rejected_total{{rpc=\"{rpc}\",reason=\"{reason}\"}} ");
    body.lines()
        .find_map(|l| l.strip_prefix(&series))
        .map(|v| v.trim().parse().expect("a counter value"))
}

#[tokio::test]
async fn a_shard_drives_its_own_machines_and_cannot_act_for_another() {
    let pki = Pki::new();
    let a = pki.client("shard-a", &["bigfleet://shard/a"]);
    let b = pki.client("shard-b", &["bigfleet://shard/b"]);
    let p = start(&pki, &[]);
    assert_eq!(
        field(&p.startup_line, "client_identity").as_deref(),
        Some("bigfleet")
    );
    let mut ca = client(&p, &pki, &a).await;
    let mut cb = client(&p, &pki, &b).await;

    // Shard A drives its own machine through Create and Configure.
    let mine = speculative_id(&mut ca).await;
    create(&mut ca, &mine, "a", (1, 1))
        .await
        .expect("A's Create");
    wait_state(&mut ca, &mine, MachineState::Idle, SETTLE).await;
    configure(&mut ca, &mine, "a", (1, 2), b"join")
        .await
        .expect("A's Configure");
    wait_state(&mut ca, &mine, MachineState::Configured, SETTLE).await;

    // Shard B's machine, fenced at token N = (1, 5).
    let theirs = speculative_id(&mut cb).await;
    create(&mut cb, &theirs, "b", (1, 5))
        .await
        .expect("B's Create");
    let before = wait_state(&mut cb, &theirs, MachineState::Idle, SETTLE).await;

    // A acting for B with B's next token is refused, naming both identities.
    let want = "caller identity bigfleet://shard/a may not act for shard_id \"b\": \
                needs bigfleet://shard/b or bigfleet://admin";
    denied(create(&mut ca, &theirs, "b", (1, 6)).await, Some(want));
    denied(
        configure(&mut ca, &theirs, "b", (1, 6), b"join").await,
        Some(want),
    );
    // A shard always stamps its token: a tokenless mutation is refused too.
    let tokenless = ca
        .delete(DeleteRequest {
            machine_id: mine.clone(),
            ..Default::default()
        })
        .await;
    let message = denied(tokenless, None);
    assert!(message.contains("without a fencing token"), "{message}");

    // Nothing was applied: B's machine is as it was, and B's token N+1,
    // which the refused calls carried, still passes its fence.
    let after = get(&mut cb, &theirs).await.expect("Get");
    assert_eq!(after, before);
    configure(&mut cb, &theirs, "b", (1, 6), b"join")
        .await
        .expect("B's Configure with token N+1 after A's refused ones");
    wait_state(&mut cb, &theirs, MachineState::Configured, SETTLE).await;
    assert_eq!(
        get(&mut ca, &mine).await.expect("Get").state,
        MachineState::Configured as i32,
        "the refused tokenless Delete left A's machine alone"
    );

    assert_eq!(rejected(&p, "Create", "wrong_shard"), Some(1));
    assert_eq!(rejected(&p, "Configure", "wrong_shard"), Some(1));
    assert_eq!(rejected(&p, "Delete", "no_token"), Some(1));
    assert_eq!(rejected(&p, "Create", "no_identity"), Some(0));
}

/// `bigfleet-proxmox ctl` against `p` with the certificate `cert`.
fn ctl(p: &Provider, pki: &Pki, cert: &Cert, args: &[&str]) -> std::process::Output {
    let target = p.grpc.to_string();
    Command::new(BIN)
        .args(["ctl", "--target", &target, "--timeout", "10s"])
        .args(["--tls-ca", path_str(&pki.ca)])
        .args(["--tls-cert", path_str(&cert.0)])
        .args(["--tls-key", path_str(&cert.1)])
        .args(args)
        .output()
        .expect("run ctl")
}

#[tokio::test]
async fn ctl_with_an_admin_certificate_drives_machines() {
    let pki = Pki::new();
    let readonly = pki.client("readonly", &["bigfleet://readonly"]);
    let p = start(&pki, &[]);
    let id = speculative_id(&mut client(&p, &pki, &admin(&pki)).await).await;
    let blob = pki.write("blob", "join-secret");

    // Read-only tooling may list, but not create.
    let out = ctl(&p, &pki, &readonly, &["list"]);
    assert!(out.status.success(), "{out:?}");
    let out = ctl(&p, &pki, &readonly, &["create", &id]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("PERMISSION_DENIED"), "{err}");
    assert!(
        err.contains("caller identity bigfleet://readonly may not call Create"),
        "{err}"
    );

    // An operator's admin certificate drives the machine, tokenless.
    let admin = admin(&pki);
    for args in [
        &["create", &id, "--wait", "--poll-interval", "20ms"][..],
        &[
            "configure",
            &id,
            "--cluster",
            "c1",
            "--blob-file",
            path_str(&blob),
            "--wait",
            "--poll-interval",
            "20ms",
        ],
        &["drain", &id, "--wait", "--poll-interval", "20ms"],
        &["delete", &id, "--wait", "--poll-interval", "20ms"],
    ] {
        let out = ctl(&p, &pki, &admin, args);
        assert!(
            out.status.success(),
            "ctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // With a shard's token, on that shard's behalf, too.
    let out = ctl(
        &p,
        &pki,
        &admin,
        &[
            "create",
            &id,
            "--shard-id",
            "b",
            "--epoch",
            "1",
            "--sequence",
            "1",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn readonly_reads_and_only_admin_reclaims() {
    let pki = Pki::new();
    let readonly = pki.client("readonly", &["bigfleet://readonly"]);
    let shard = pki.client("shard-a", &["bigfleet://shard/a"]);
    let p = start(&pki, &[]);
    let mut ro = client(&p, &pki, &readonly).await;
    assert_eq!(list(&mut ro).await.expect("read-only List"), 6);
    let id = speculative_id(&mut ro).await;
    assert_eq!(
        get(&mut ro, &id).await.expect("read-only Get").state,
        MachineState::Speculative as i32
    );
    denied(
        create(&mut ro, &id, "a", (1, 1)).await,
        Some(
            // Refused from the certificate alone, before the body (and its
            // shard_id) is read.
            "caller identity bigfleet://readonly may not call Create, a mutation: needs \
             bigfleet://shard/<the request's shard_id> or bigfleet://admin",
        ),
    );
    denied(create(&mut ro, &id, "", (0, 0)).await, None);
    assert_eq!(rejected(&p, "Create", "not_permitted"), Some(2));

    // Reclaim is the admin's: a shard and read-only tooling are refused
    // before the machine is looked at, the admin is answered.
    let want = "caller identity bigfleet://shard/a may not call Reclaim: needs bigfleet://admin";
    denied(reclaim(&p, &pki, &shard, &id).await, Some(want));
    denied(reclaim(&p, &pki, &readonly, &id).await, None);
    assert!(
        !p.logs.text().contains("reclaim requested"),
        "a refused caller reached the Reclaim handler:\n{}",
        p.stderr()
    );
    let status = reclaim(&p, &pki, &admin(&pki), &id)
        .await
        .expect("the admin's Reclaim");
    assert_eq!(
        status,
        bigfleet_proto::admin::ReclaimStatus::AlreadySpeculative as i32
    );
    assert_eq!(rejected(&p, "Reclaim", "not_permitted"), Some(2));
}

#[tokio::test]
async fn certificates_without_one_usable_identity_are_refused_everywhere() {
    let pki = Pki::new();
    let p = start(&pki, &[]);
    let id = speculative_id(&mut client(&p, &pki, &admin(&pki)).await).await;
    let blob = b"BLOB-never-logged-7f3a";
    let cases = [
        (
            pki.client("cluster", &["bigfleet://cluster/c1"]),
            "cluster_identity",
            "bigfleet://cluster/c1",
        ),
        (
            pki.client("two", &["bigfleet://shard/a", "bigfleet://admin"]),
            "several_identities",
            "ambiguous (2 bigfleet:// URI SANs: bigfleet://shard/a, bigfleet://admin)",
        ),
        (
            pki.client("none", &["spiffe://example.org/a"]),
            "no_identity",
            "none (the client certificate carries no bigfleet:// URI SAN)",
        ),
        (
            pki.client("unknown", &["bigfleet://operator"]),
            "unknown_role",
            "bigfleet://operator",
        ),
    ];
    for (cert, reason, seen) in &cases {
        let mut c = client(&p, &pki, cert).await;
        let prefix = format!("caller identity {seen} may not ");
        for message in [
            denied(list(&mut c).await, None),
            denied(get(&mut c, &id).await, None),
            denied(create(&mut c, &id, "c1", (1, 1)).await, None),
            denied(configure(&mut c, &id, "a", (1, 1), blob).await, None),
            denied(reclaim(&p, &pki, cert, &id).await, None),
        ] {
            assert!(message.starts_with(&prefix), "{message}");
        }
        for rpc in ["List", "Get", "Create", "Configure", "Reclaim"] {
            assert_eq!(rejected(&p, rpc, reason), Some(1), "{rpc} {reason}");
        }
        // gRPC health stays open to every verified client.
        let health =
            tonic_health::pb::health_client::HealthClient::new(channel(&p, &pki, cert).await)
                .check(tonic_health::pb::HealthCheckRequest::default())
                .await
                .expect("health check");
        assert_eq!(health.into_inner().status, 1, "SERVING");
    }
    // Nothing was applied.
    let mut c = client(&p, &pki, &admin(&pki)).await;
    assert_eq!(
        get(&mut c, &id).await.expect("Get").state,
        MachineState::Speculative as i32
    );
    // One WARN line names the identity and the RPC; the blob never shows.
    let line = p
        .logs
        .wait_for(Duration::from_secs(10), |l| {
            l.contains("caller identity refused") && l.contains("bigfleet://cluster/c1")
        })
        .unwrap_or_else(|| panic!("no refusal line:\n{}", p.stderr()));
    assert!(line.contains("level=warn"), "{line}");
    assert!(line.contains("rpc=List"), "{line}");
    assert!(line.contains("reason=cluster_identity"), "{line}");
    assert!(
        !p.stderr().contains("BLOB-never-logged"),
        "the blob was logged"
    );
}

#[tokio::test]
async fn any_restores_the_chain_only_check() {
    let pki = Pki::new();
    let none = pki.client("none", &[]);
    let cluster = pki.client("cluster", &["bigfleet://cluster/c1"]);
    let p = start(&pki, &["--tls-client-identity", "any"]);
    assert_eq!(
        field(&p.startup_line, "client_identity").as_deref(),
        Some("any")
    );
    assert!(
        p.logs
            .wait_for(Duration::from_secs(10), |l| l.contains("level=warn")
                && l.contains("--tls-client-identity any"))
            .is_some(),
        "no start-up WARN:\n{}",
        p.stderr()
    );
    // A certificate without any identity acts for any shard and reclaims.
    let mut c = client(&p, &pki, &none).await;
    let id = speculative_id(&mut c).await;
    create(&mut c, &id, "b", (1, 1))
        .await
        .expect("Create for another shard, chain-only");
    wait_state(&mut c, &id, MachineState::Idle, SETTLE).await;
    let other = speculative_id(&mut c).await;
    reclaim(&p, &pki, &none, &other)
        .await
        .expect("Reclaim, chain-only");
    let mut c = client(&p, &pki, &cluster).await;
    assert_eq!(list(&mut c).await.expect("List, chain-only"), 6);
    // No identity is checked, so no refusal series exists.
    assert_eq!(rejected(&p, "List", "cluster_identity"), None);
}

/// A client retrying refused calls in a loop cannot flood the log: 500
/// Creates from read-only tooling write one `caller identity refused` WARN
/// per refusal period (the per-RPC line of a refusal is at DEBUG), and 200
/// Gets of a machine that does not exist one per-RPC WARN per period, the
/// rest at DEBUG.
#[tokio::test]
async fn refused_calls_in_a_loop_write_at_most_the_limiters_lines() {
    let pki = Pki::new();
    let readonly = pki.client("readonly", &["bigfleet://readonly"]);
    let p = start(&pki, &[]);
    let mut ro = client(&p, &pki, &readonly).await;
    let id = speculative_id(&mut ro).await;
    let started = std::time::Instant::now();
    for _ in 0..500 {
        denied(create(&mut ro, &id, "a", (1, 1)).await, None);
    }
    let missing = "proxmox/OnDemand/pve.small/pve-a/999";
    for _ in 0..200 {
        let status = get(&mut ro, missing).await.expect_err("no such machine");
        assert_eq!(status.code(), Code::NotFound);
    }
    // Each refusal period may begin a new line per key.
    let periods = 1 + started.elapsed().as_secs() as usize / 10;
    // A line written after all of theirs: the admin's Create, at INFO.
    let mut c = client(&p, &pki, &admin(&pki)).await;
    create(&mut c, &id, "a", (1, 1))
        .await
        .expect("the admin's Create");
    p.logs
        .wait_for(SETTLE, |l| {
            l.contains(" msg=rpc") && l.contains("method=Create") && l.contains("code=OK")
        })
        .unwrap_or_else(|| panic!("no Create line:\n{}", p.stderr()));
    let warns: Vec<String> = p
        .logs
        .lines()
        .into_iter()
        .filter(|l| l.contains("level=warn"))
        .collect();
    let refusal_lines = warns
        .iter()
        .filter(|l| l.contains("caller identity refused") && l.contains("rpc=Create"))
        .count();
    let create_lines = warns
        .iter()
        .filter(|l| l.contains(" msg=rpc") && l.contains("method=Create"))
        .count();
    let get_lines: Vec<&String> = warns
        .iter()
        .filter(|l| l.contains(" msg=rpc") && l.contains("method=Get"))
        .collect();
    assert!(
        (1..=periods).contains(&refusal_lines),
        "{refusal_lines} refusal lines in {periods} period(s):\n{warns:#?}"
    );
    assert_eq!(create_lines, 0, "{warns:#?}");
    assert!(
        (1..=periods).contains(&get_lines.len()),
        "{} Get lines in {periods} period(s):\n{get_lines:#?}",
        get_lines.len()
    );
    assert_eq!(field(get_lines[0], "code").as_deref(), Some("NotFound"));
    assert_eq!(field(get_lines[0], "machine_id").as_deref(), Some(missing));
    assert_eq!(rejected(&p, "Create", "not_permitted"), Some(500));
}
