//! Startup validation, black-box: every invalid flag combination makes the
//! binary exit non-zero with a message naming the problem, before it
//! listens. "Before it listens" is proven by handing it --addr and
//! --metrics-addr ports this test already holds: a process that got as far
//! as binding would report "cannot listen" instead of the validation error.

use std::time::Duration;

use crate::common::{self, held_listener, path_str, run_to_exit, Pki, Provider};

const EXIT_DEADLINE: Duration = Duration::from_secs(30);

/// Flags for a real backend that passes every check up to the offerings.
const REAL: &[&str] = &[
    "--proxmox-api-url",
    "https://pve1.test:8006/api2/json",
    "--proxmox-token-id",
    "bigfleet@pve!provider",
    "--proxmox-token-secret",
    "not-a-real-secret",
    "--proxmox-tls-fingerprint",
    "AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89",
    "--nodes",
    "pve1,pve2",
];

/// REAL without the flag `drop` (and its value).
fn real_without(drop: &str) -> Vec<&'static str> {
    let mut out = Vec::new();
    let mut it = REAL.iter();
    while let Some(flag) = it.next() {
        let value = it.next().expect("flag value");
        if *flag != drop {
            out.push(*flag);
            out.push(*value);
        }
    }
    out
}

/// Run with `args` on held ports; assert a non-zero exit whose stderr has
/// every `expect` fragment; return stderr.
fn fails(args: &[&str], expect: &[&str]) -> String {
    let (_grpc, grpc_addr) = held_listener();
    let (_metrics, metrics_addr) = held_listener();
    let (grpc_addr, metrics_addr) = (grpc_addr.to_string(), metrics_addr.to_string());
    let mut all = vec!["--addr", &grpc_addr, "--metrics-addr", &metrics_addr];
    all.extend_from_slice(args);
    let run = run_to_exit(&all, EXIT_DEADLINE);
    assert!(
        !run.status.success(),
        "{args:?} should fail startup but exited {:?}; stderr:\n{}",
        run.status,
        run.stderr
    );
    // The reason as written, the logfmt escapes undone.
    let reason = run
        .stderr
        .lines()
        .filter_map(|l| provider_testkit::field(l, "error"))
        .collect::<Vec<_>>()
        .join("\n");
    for e in expect {
        assert!(
            run.stderr.contains(e) || reason.contains(e),
            "{args:?}: stderr lacks {e:?}:\n{}",
            run.stderr
        );
    }
    assert!(
        !run.stderr.contains("cannot listen"),
        "{args:?}: validation must run before binding:\n{}",
        run.stderr
    );
    assert!(
        !run.stderr.contains(provider_testkit::STARTUP_LINE),
        "{args:?}: must not serve:\n{}",
        run.stderr
    );
    run.stderr
}

fn offerings_file(pki: &Pki, json: &str) -> String {
    path_str(&pki.write("offerings.json", json)).to_string()
}

#[test]
fn bare_start_says_what_to_pass() {
    let err = fails(&[], &["--proxmox-api-url", "--use-fake-backend"]);
    assert!(err.contains("no backend selected"), "{err}");
}

#[test]
fn real_backend_without_api_url() {
    let mut args = vec!["--proxmox-backend", "proxmox"];
    args.extend(real_without("--proxmox-api-url"));
    fails(&args, &["--proxmox-api-url"]);
}

#[test]
fn real_backend_without_token_id() {
    fails(&real_without("--proxmox-token-id"), &["--proxmox-token-id"]);
}

#[test]
fn real_backend_without_token_secret() {
    fails(
        &real_without("--proxmox-token-secret"),
        &[
            "token secret",
            "--proxmox-token-file",
            "--proxmox-token-secret",
        ],
    );
}

#[test]
fn real_backend_with_unreadable_token_file() {
    let pki = Pki::new();
    let missing = pki.dir.path().join("no-such-token");
    let mut args = real_without("--proxmox-token-secret");
    args.extend(["--proxmox-token-file", path_str(&missing)]);
    fails(&args, &["--proxmox-token-file", path_str(&missing)]);
}

#[test]
fn real_backend_without_nodes() {
    fails(&real_without("--nodes"), &["--nodes"]);
}

#[test]
fn real_backend_without_tls_trust_material() {
    let err = fails(
        &real_without("--proxmox-tls-fingerprint"),
        &["--proxmox-tls-fingerprint"],
    );
    let line = err
        .lines()
        .find(|l| l.contains("TLS verification material"))
        .unwrap_or_else(|| panic!("no trust-material message:\n{err}"));
    let message = provider_testkit::field(line, "error").unwrap_or_default();
    assert!(
        message.starts_with("TLS verification material is required: set --proxmox-ca-file"),
        "{line}"
    );
}

#[test]
fn real_backend_with_unreadable_ca_file() {
    let pki = Pki::new();
    let missing = pki.dir.path().join("no-such-ca.pem");
    let mut args = real_without("--proxmox-tls-fingerprint");
    args.extend(["--proxmox-ca-file", path_str(&missing)]);
    fails(&args, &["--proxmox-ca-file", path_str(&missing)]);
}

#[test]
fn real_backend_with_a_ca_file_that_is_not_pem() {
    let pki = Pki::new();
    let junk = pki.write("junk-ca.pem", "this is not a certificate\n");
    let mut args = real_without("--proxmox-tls-fingerprint");
    args.extend(["--proxmox-ca-file", path_str(&junk)]);
    fails(&args, &["--proxmox-ca-file", path_str(&junk)]);
}

#[test]
fn real_backend_rejects_plain_http_api_url() {
    let mut args = real_without("--proxmox-api-url");
    args.extend(["--proxmox-api-url", "http://pve1.test:8006/api2/json"]);
    fails(&args, &["--proxmox-api-url", "https://"]);
}

#[test]
fn tls_cert_without_key() {
    let pki = Pki::new();
    fails(
        &[
            "--use-fake-backend",
            "--tls-cert",
            path_str(&pki.server_cert),
        ],
        &["both --tls-cert and --tls-key are required to enable TLS"],
    );
}

#[test]
fn tls_key_without_cert() {
    let pki = Pki::new();
    fails(
        &["--use-fake-backend", "--tls-key", path_str(&pki.server_key)],
        &["both --tls-cert and --tls-key are required to enable TLS"],
    );
}

#[test]
fn tls_ca_alone() {
    let pki = Pki::new();
    fails(
        &["--use-fake-backend", "--tls-ca", path_str(&pki.ca)],
        &["--tls-ca set without --tls-cert/--tls-key"],
    );
}

#[test]
fn tls_key_that_does_not_match_the_cert() {
    let pki = Pki::new();
    // The client's key is a valid key, just not the server cert's.
    fails(
        &[
            "--use-fake-backend",
            "--tls-cert",
            path_str(&pki.server_cert),
            "--tls-key",
            path_str(&pki.client_key),
        ],
        &["--tls-key", path_str(&pki.server_cert)],
    );
}

#[test]
fn tls_key_that_is_not_a_key() {
    let pki = Pki::new();
    let junk = pki.write("junk.key", "not a key\n");
    fails(
        &[
            "--use-fake-backend",
            "--tls-cert",
            path_str(&pki.server_cert),
            "--tls-key",
            path_str(&junk),
        ],
        &["--tls-key", path_str(&junk)],
    );
}

#[test]
fn tls_cert_that_is_not_a_cert() {
    let pki = Pki::new();
    let junk = pki.write("junk.pem", "not a certificate\n");
    fails(
        &[
            "--use-fake-backend",
            "--tls-cert",
            path_str(&junk),
            "--tls-key",
            path_str(&pki.server_key),
        ],
        &["--tls-cert", path_str(&junk)],
    );
}

#[test]
fn tls_ca_bundle_that_is_not_pem() {
    let pki = Pki::new();
    let junk = pki.write("junk-client-ca.pem", "-----BEGIN NOTHING-----\n");
    fails(
        &[
            "--use-fake-backend",
            "--tls-cert",
            path_str(&pki.server_cert),
            "--tls-key",
            path_str(&pki.server_key),
            "--tls-ca",
            path_str(&junk),
        ],
        &["--tls-ca", path_str(&junk)],
    );
}

#[test]
fn tls_ca_bundle_that_is_missing() {
    let pki = Pki::new();
    let missing = pki.dir.path().join("missing-ca.pem");
    fails(
        &[
            "--use-fake-backend",
            "--tls-cert",
            path_str(&pki.server_cert),
            "--tls-key",
            path_str(&pki.server_key),
            "--tls-ca",
            path_str(&missing),
        ],
        &["--tls-ca", path_str(&missing)],
    );
}

#[test]
fn grpc_address_in_use() {
    let (_held, addr) = held_listener();
    let addr = addr.to_string();
    let run = run_to_exit(
        &[
            "--use-fake-backend",
            "--addr",
            &addr,
            "--metrics-addr",
            "127.0.0.1:0",
        ],
        EXIT_DEADLINE,
    );
    assert!(!run.status.success(), "{}", run.stderr);
    assert!(
        run.stderr.contains(&format!("--addr {addr}")),
        "message must name the flag and address:\n{}",
        run.stderr
    );
    assert!(
        !run.stderr.contains(provider_testkit::STARTUP_LINE),
        "{}",
        run.stderr
    );
}

#[test]
fn metrics_address_in_use() {
    let (_held, addr) = held_listener();
    let addr = addr.to_string();
    let run = run_to_exit(
        &[
            "--use-fake-backend",
            "--addr",
            "127.0.0.1:0",
            "--metrics-addr",
            &addr,
        ],
        EXIT_DEADLINE,
    );
    assert!(!run.status.success(), "{}", run.stderr);
    assert!(
        run.stderr.contains(&format!("--metrics-addr {addr}")),
        "message must name the flag and address:\n{}",
        run.stderr
    );
    assert!(
        !run.stderr.contains(provider_testkit::STARTUP_LINE),
        "{}",
        run.stderr
    );
}

#[test]
fn empty_offerings_file() {
    let pki = Pki::new();
    let f = offerings_file(&pki, "[]");
    fails(
        &["--use-fake-backend", "--offerings", &f],
        &["no offerings"],
    );
}

#[test]
fn zero_seed_count_leaves_no_offerings() {
    fails(
        &["--use-fake-backend", "--seed-count", "0"],
        &["no offerings"],
    );
}

#[test]
fn offering_with_empty_instance_type() {
    let pki = Pki::new();
    let f = offerings_file(&pki, r#"[{"instance_type":"","zone":"pve-a","count":1}]"#);
    fails(
        &["--use-fake-backend", "--offerings", &f],
        &["empty instance_type"],
    );
}

#[test]
fn offering_with_empty_zone() {
    let pki = Pki::new();
    let f = offerings_file(
        &pki,
        r#"[{"instance_type":"pve.small","zone":"","count":1}]"#,
    );
    fails(
        &["--use-fake-backend", "--offerings", &f],
        &["pve.small", "empty zone"],
    );
}

#[test]
fn offering_type_not_in_catalog() {
    let pki = Pki::new();
    let f = offerings_file(
        &pki,
        r#"[{"instance_type":"pve.huge","zone":"pve-a","count":1}]"#,
    );
    fails(
        &["--use-fake-backend", "--offerings", &f],
        &["pve.huge", "not in the catalog"],
    );
}

#[test]
fn offering_with_non_positive_count() {
    for count in ["0", "-3"] {
        let pki = Pki::new();
        let f = offerings_file(
            &pki,
            &format!(r#"[{{"instance_type":"pve.small","zone":"pve-a","count":{count}}}]"#),
        );
        fails(
            &["--use-fake-backend", "--offerings", &f],
            &["pve.small", "count must be > 0"],
        );
    }
}

#[test]
fn offering_without_count() {
    let pki = Pki::new();
    let f = offerings_file(&pki, r#"[{"instance_type":"pve.small","zone":"pve-a"}]"#);
    fails(&["--use-fake-backend", "--offerings", &f], &["count"]);
}

#[test]
fn offering_on_a_node_not_in_nodes() {
    let pki = Pki::new();
    let f = offerings_file(
        &pki,
        r#"[{"instance_type":"pve.small","zone":"pve1","count":1},
            {"instance_type":"pve.medium","zone":"pve9","count":1}]"#,
    );
    let mut args = REAL.to_vec();
    args.extend(["--offerings", &f]);
    let err = fails(
        &args,
        &[r#"offering pve.medium is placed on node "pve9", which is not in --nodes ("#],
    );
    let line = err.lines().find(|l| l.contains("--nodes (")).expect("line");
    let listed = line.split("--nodes (").nth(1).expect("list");
    assert!(listed.contains("pve1") && listed.contains("pve2"), "{line}");
}

#[test]
fn non_on_demand_capacity_types_are_refused() {
    for ct in ["spot", "reserved", "bare_metal", "SPOT"] {
        let pki = Pki::new();
        let f = offerings_file(
            &pki,
            &format!(
                r#"[{{"instance_type":"pve.small","zone":"pve-a","count":1,"capacity_type":"{ct}"}}]"#
            ),
        );
        fails(
            &["--use-fake-backend", "--offerings", &f],
            &["pve.small", ct],
        );
    }
}

#[tokio::test]
async fn on_demand_spellings_are_accepted() {
    let pki = Pki::new();
    let f = offerings_file(
        &pki,
        r#"[{"instance_type":"pve.small","zone":"pve-a","count":1,"capacity_type":"on_demand"},
            {"instance_type":"pve.small","zone":"pve-b","count":1,"capacity_type":"on-demand"},
            {"instance_type":"pve.medium","zone":"pve-a","count":1,"capacity_type":"ondemand"},
            {"instance_type":"pve.medium","zone":"pve-b","count":1}]"#,
    );
    let provider = Provider::start(&["--use-fake-backend", "--offerings", &f]);
    let list = provider
        .client()
        .await
        .list(bigfleet_proto::v1alpha1::ListFilter::default())
        .await
        .expect("List")
        .into_inner();
    assert_eq!(list.machines.len(), 4);
    for m in &list.machines {
        assert_eq!(
            m.capacity_type,
            bigfleet_proto::v1alpha1::CapacityType::OnDemand as i32,
            "{}",
            m.id
        );
    }
}

#[test]
fn fake_backend_choice_requires_use_fake_backend() {
    fails(&["--proxmox-backend", "fake"], &["--use-fake-backend"]);
}

#[test]
fn use_fake_backend_conflicts_with_an_api_url() {
    fails(
        &[
            "--use-fake-backend",
            "--proxmox-api-url",
            "https://pve1.test:8006/api2/json",
        ],
        &["--use-fake-backend", "--proxmox-api-url"],
    );
}

/// Run the fake backend on `state` (ephemeral ports) and expect a refusal
/// whose stderr has every `expect` fragment; the file must be left as it was.
fn state_refused(state: &std::path::Path, expect: &[&str]) {
    let before = std::fs::read(state).expect("read the state file");
    let run = run_to_exit(
        &[
            "--use-fake-backend",
            "--addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "",
            "--state",
            path_str(state),
        ],
        EXIT_DEADLINE,
    );
    assert!(!run.status.success(), "must refuse:\n{}", run.stderr);
    for e in expect {
        assert!(
            run.stderr.contains(e),
            "stderr lacks {e:?}:\n{}",
            run.stderr
        );
    }
    assert!(
        !run.stderr.contains(provider_testkit::STARTUP_LINE),
        "{}",
        run.stderr
    );
    assert!(!run.stderr.contains("state created"), "{}", run.stderr);
    assert!(
        std::fs::read(state).expect("read the state file") == before,
        "a refused state file is not modified"
    );
}

#[test]
fn empty_state_file_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state.db");
    std::fs::write(&state, b"").expect("write");
    state_refused(
        &state,
        &[
            &format!("state file {} is empty (0 bytes)", state.display()),
            "point --state at a new path",
        ],
    );
}

/// A valid SQLite database without tables, byte for byte (one 4096-byte
/// page): what `sqlite3 FILE 'PRAGMA user_version = 1'` writes, i.e. a file
/// some tool opened and left without this provider's schema.
fn schema_less_sqlite() -> Vec<u8> {
    let mut page = vec![0u8; 4096];
    page[..16].copy_from_slice(b"SQLite format 3\0");
    page[16] = 0x10; // page size 0x1000, big-endian
    page[18] = 1; // write version: rollback journal
    page[19] = 1; // read version
    page[21] = 64; // payload fractions, fixed by the format
    page[22] = 32;
    page[23] = 32;
    page[27] = 1; // file change counter
    page[31] = 1; // database size: one page
    page[63] = 1; // user version
    page[95] = 1; // "version valid for" = the change counter
    page[100] = 13; // page 1 is an empty table b-tree leaf (the schema table)
    page[105] = 0x10; // its cell content area starts at 4096: no cells
    page
}

#[test]
fn schema_less_sqlite_state_file_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state.db");
    std::fs::write(&state, schema_less_sqlite()).expect("write");
    state_refused(
        &state,
        &[
            &state.display().to_string(),
            "without the state schema",
            "point --state at a new path",
        ],
    );
}

#[test]
fn foreign_state_file_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state.db");
    std::fs::write(&state, "machines:\n  - m-1\n").expect("write");
    state_refused(
        &state,
        &[
            &state.display().to_string(),
            "not an SQLite database",
            "point --state at a new path",
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_is_created_then_loaded_with_its_counts() {
    use bigfleet_proto::v1alpha1 as pb;
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state.db");
    let args = [
        "--use-fake-backend",
        "--seed-count",
        "2",
        "--state",
        path_str(&state),
    ];
    let first = tokio::task::block_in_place(|| Provider::start(&args));
    let created = first
        .logs
        .lines()
        .into_iter()
        .find(|l| l.contains("state created"))
        .unwrap_or_else(|| panic!("no `state created` line:\n{}", first.stderr()));
    assert!(created.contains(&state.display().to_string()), "{created}");
    assert!(
        !first.stderr().contains("state loaded"),
        "{}",
        first.stderr()
    );

    // One fenced mutation leaves one fence mark.
    let mut client = first.client().await;
    let id = client
        .list(pb::ListFilter::default())
        .await
        .expect("List")
        .into_inner()
        .machines[0]
        .id
        .clone();
    client
        .create(pb::CreateRequest {
            machine_id: id,
            shard_id: "shard-a".into(),
            shard_epoch: 1,
            sequence_number: 1,
        })
        .await
        .expect("Create");
    drop(first); // SIGKILL: acknowledged means durable

    let second = tokio::task::block_in_place(|| Provider::start(&args));
    let loaded = second
        .logs
        .lines()
        .into_iter()
        .find(|l| l.contains("state loaded"))
        .unwrap_or_else(|| panic!("no `state loaded` line:\n{}", second.stderr()));
    assert_eq!(
        provider_testkit::field(&loaded, "machines").as_deref(),
        Some("2"),
        "{loaded}"
    );
    assert_eq!(
        provider_testkit::field(&loaded, "fence_marks").as_deref(),
        Some("1"),
        "{loaded}"
    );
    assert!(
        !second.stderr().contains("state created"),
        "{}",
        second.stderr()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reference_json_state_is_imported_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state.json");
    // The reference implementation's JSON state, in its published layout.
    let reference = r#"{
  "machines": [
    {"ID": "m-ref", "State": "Configured", "Host": {"Provider": "proxmox", "Ref": "pve-a/900"},
     "InstanceType": "pve.small", "Zone": "pve-a", "CapacityType": "OnDemand",
     "PricePerHour": 0.1, "InterruptionProbability": 0, "Resources": null,
     "Allocatable": null, "Labels": null, "Cluster": "c1",
     "ShardMetadata": {"k": "v"}, "LastError": ""}
  ],
  "fences": [{"shard_id": "shard-a", "machine_id": "m-ref", "epoch": 4, "sequence": 9}],
  "ops": [{"machine_id": "m-ref", "kind": "configure", "operation_id": "op-3"}],
  "rev": 5,
  "next_op": 4
}"#;
    std::fs::write(&state, reference).expect("write");
    let args = ["--use-fake-backend", "--state", path_str(&state)];
    let first = tokio::task::block_in_place(|| Provider::start(&args));
    let line = first
        .logs
        .lines()
        .into_iter()
        .find(|l| l.contains("state imported from the reference implementation"))
        .unwrap_or_else(|| panic!("no import line:\n{}", first.stderr()));
    let backup = dir.path().join("state.json.reference-backup");
    assert_eq!(
        provider_testkit::field(&line, "backup").as_deref(),
        Some(path_str(&backup)),
        "{line}"
    );
    assert_eq!(
        provider_testkit::field(&line, "machines").as_deref(),
        Some("1"),
        "{line}"
    );
    assert_eq!(
        provider_testkit::field(&line, "fence_marks").as_deref(),
        Some("1"),
        "{line}"
    );
    assert_eq!(
        provider_testkit::field(&line, "operation_ids").as_deref(),
        Some("1"),
        "{line}"
    );
    assert_eq!(std::fs::read_to_string(&backup).expect("backup"), reference);
    drop(first);

    let second = tokio::task::block_in_place(|| Provider::start(&args));
    assert!(
        second
            .logs
            .lines()
            .iter()
            .any(|l| l.contains("state loaded")),
        "imported once, then loaded:\n{}",
        second.stderr()
    );
}

#[test]
fn a_new_json_state_path_is_created_as_a_database() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state.json");
    let provider = Provider::start(&["--use-fake-backend", "--state", path_str(&state)]);
    assert!(
        provider
            .logs
            .lines()
            .iter()
            .any(|l| l.contains("state created")),
        "{}",
        provider.stderr()
    );
    drop(provider);
    let head = std::fs::read(&state).expect("state");
    assert!(head.starts_with(b"SQLite format 3\0"));
}

/// Run the fake backend without metrics and with `args`, expecting exit
/// `code`; the last stderr line (the fatal one) and all of stderr.
fn fatal_line(args: &[&str], code: i32) -> (String, String) {
    let mut all = vec!["--use-fake-backend", "--metrics-addr", ""];
    all.extend_from_slice(args);
    let run = run_to_exit(&all, EXIT_DEADLINE);
    assert_eq!(run.status.code(), Some(code), "{args:?}:\n{}", run.stderr);
    let last = run.stderr.lines().last().unwrap_or_default().to_string();
    (last, run.stderr)
}

const ANY_PORT: [&str; 2] = ["--addr", "127.0.0.1:0"];

fn json(line: &str, stderr: &str) -> serde_json::Value {
    serde_json::from_str(line)
        .unwrap_or_else(|e| panic!("the fatal line is not JSON ({e}):\n{stderr}"))
}

#[test]
fn fatal_errors_are_structured_lines_in_the_chosen_format() {
    // A refused flag, in JSON.
    let (line, stderr) = fatal_line(
        &[
            ANY_PORT[0],
            ANY_PORT[1],
            "--log-format",
            "json",
            "--tls-ca",
            "/x",
        ],
        2,
    );
    let line = json(&line, &stderr);
    assert_eq!(line["level"], "ERROR", "{line}");
    assert_eq!(line["message"], "invalid configuration", "{line}");
    assert_eq!(
        line["error"], "--tls-ca set without --tls-cert/--tls-key",
        "{line}"
    );

    // The log level itself is the refused flag: the line still comes, in
    // the chosen format.
    let (line, stderr) = fatal_line(
        &[
            ANY_PORT[0],
            ANY_PORT[1],
            "--log-format",
            "json",
            "--log-level",
            "a=loud",
        ],
        2,
    );
    let line = json(&line, &stderr);
    assert_eq!(line["message"], "invalid configuration", "{line}");
    let error = line["error"].as_str().unwrap_or_default();
    assert!(
        error.starts_with("--log-level \"a=loud\" is not a valid level"),
        "{line}"
    );

    // A valid configuration that cannot start: the port is taken.
    let (_held, addr) = held_listener();
    let addr = addr.to_string();
    let (line, stderr) = fatal_line(&["--log-format", "json", "--addr", &addr], 1);
    let line = json(&line, &stderr);
    assert_eq!(line["message"], "startup failed", "{line}");
    let error = line["error"].as_str().unwrap_or_default();
    assert!(error.contains(&format!("--addr {addr}")), "{line}");

    // The default format: key=value, with the reason as `error`.
    let (line, _) = fatal_line(&[ANY_PORT[0], ANY_PORT[1], "--provider", " "], 2);
    assert!(line.contains("level=error"), "{line}");
    assert_eq!(
        provider_testkit::field(&line, "msg").as_deref(),
        Some("invalid configuration"),
        "{line}"
    );
    assert_eq!(
        provider_testkit::field(&line, "error").as_deref(),
        Some("--provider must not be empty"),
        "{line}"
    );
}

/// A word that is not a level (`warning`) would be a target name to
/// `EnvFilter` and silence every line: it is refused, exit 2, on stderr.
#[test]
fn a_log_level_that_is_not_a_level_is_refused() {
    for level in ["warning", "info,verbose"] {
        let (line, stderr) = fatal_line(&[ANY_PORT[0], ANY_PORT[1], "--log-level", level], 2);
        assert_eq!(
            provider_testkit::field(&line, "msg").as_deref(),
            Some("invalid configuration"),
            "{stderr}"
        );
        let error = provider_testkit::field(&line, "error").unwrap_or_default();
        assert!(error.contains("is not a level"), "{level}: {stderr}");
    }
}

/// A Proxmox endpoint that accepts connections but never answers (a
/// listener nobody reads: the kernel completes the handshakes): start-up
/// says what it is waiting for, and SIGTERM ends it at once instead of
/// after the client's retries (about two minutes).
#[test]
fn sigterm_ends_a_start_up_waiting_on_a_silent_cluster() {
    let (_silent, addr) = held_listener();
    let url = format!("https://{addr}/api2/json");
    let mut args = vec!["--addr", "127.0.0.1:0", "--metrics-addr", ""];
    args.extend(real_without("--proxmox-api-url"));
    args.extend(["--proxmox-api-url", &url]);
    let mut starting = common::Starting::spawn(&args);
    let waiting = starting.logs.wait_for(EXIT_DEADLINE, |l| {
        l.contains("preflight: listing the cluster's nodes")
    });
    assert!(
        waiting.as_deref().is_some_and(|l| l.contains(&url)),
        "no line names the step and the endpoint:\n{}",
        starting.logs.text()
    );
    let asked = std::time::Instant::now();
    starting.signal(libc::SIGTERM);
    let status = starting
        .wait_exit(EXIT_DEADLINE)
        .unwrap_or_else(|| panic!("SIGTERM ignored:\n{}", starting.logs.text()));
    let took = asked.elapsed();
    assert!(status.success(), "{status:?}:\n{}", starting.logs.text());
    assert!(
        took < Duration::from_secs(5),
        "SIGTERM took {took:?} to end start-up:\n{}",
        starting.logs.text()
    );
    assert!(
        starting
            .logs
            .text()
            .contains("shutdown requested during start-up"),
        "{}",
        starting.logs.text()
    );
}

/// While start-up waits on a cluster that does not answer, the gRPC port
/// speaks from the first second: health NOT_SERVING, and a CapacityProvider
/// RPC UNAVAILABLE at once, saying what start-up waits for (not a port that
/// accepts TCP and never sends HTTP/2 SETTINGS).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_says_not_serving_while_start_up_waits() {
    use bigfleet_proto::v1alpha1::capacity_provider_client::CapacityProviderClient;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    let (_silent, pve) = held_listener();
    let url = format!("https://{pve}/api2/json");
    let mut args = vec!["--addr", "127.0.0.1:0", "--metrics-addr", ""];
    args.extend(real_without("--proxmox-api-url"));
    args.extend(["--proxmox-api-url", &url]);
    let starting = common::Starting::spawn(&args);
    let listening = starting
        .logs
        .wait_for(EXIT_DEADLINE, |l| {
            l.contains("listening: gRPC health answers")
        })
        .unwrap_or_else(|| panic!("no listening line:\n{}", starting.logs.text()));
    let grpc = provider_testkit::addr_field(&listening, "addr").unwrap_or_else(|e| panic!("{e}"));
    assert!(
        starting
            .logs
            .wait_for(EXIT_DEADLINE, |l| l
                .contains("preflight: listing the cluster's nodes"))
            .is_some(),
        "start-up never reached the preflight:\n{}",
        starting.logs.text()
    );
    let answer_within = Duration::from_secs(5);
    let channel = tokio::time::timeout(answer_within, common::plain_channel(grpc))
        .await
        .expect("the gRPC port answers during start-up");
    let health = tokio::time::timeout(
        answer_within,
        HealthClient::new(channel.clone()).check(HealthCheckRequest {
            service: String::new(),
        }),
    )
    .await
    .expect("health answers at once")
    .expect("health answers OK");
    assert_eq!(
        health.into_inner().status,
        tonic_health::pb::health_check_response::ServingStatus::NotServing as i32
    );
    let refused = tokio::time::timeout(
        answer_within,
        CapacityProviderClient::new(channel).list(bigfleet_proto::v1alpha1::ListFilter::default()),
    )
    .await
    .expect("List answers at once")
    .expect_err("nothing is served during start-up");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    for says in ["starting", "checking the Proxmox cluster at", url.as_str()] {
        assert!(
            refused.message().contains(says),
            "{says}: {}",
            refused.message()
        );
    }
}

/// Real-backend flags against a running pve-sim, trusting `ca` (a path).
fn against_sim(sim: &pve_sim::PveSim, url: &str, secret: &str, ca: &str) -> Vec<String> {
    common::pve_flags(sim, url, secret, ca, "pve1,pve2")
}

/// Each way of not reaching the API fails start-up with the hint that
/// applies, not a blanket "is the token valid?".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preflight_failures_name_their_fix() {
    let sim = pve_sim::PveSim::start(pve_sim::SimConfig::default())
        .await
        .expect("simulator");
    let other = pve_sim::PveSim::start(pve_sim::SimConfig::default())
        .await
        .expect("second simulator");
    let pki = Pki::new();
    let ca = path_str(&pki.write("pve-ca.pem", sim.ca_pem())).to_string();
    let wrong_ca = path_str(&pki.write("other-ca.pem", other.ca_pem())).to_string();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = closed.local_addr().expect("addr").port();
    drop(closed);
    let url = sim.base_url().to_string();
    let no_root = url.trim_end_matches("/api2/json").to_string();
    let refused = format!("https://127.0.0.1:{port}/api2/json");
    let secret = sim.token_secret().to_string();
    let cases: Vec<(Vec<String>, Vec<&str>)> = vec![
        (
            against_sim(&sim, &url, "wrong-secret", &ca),
            vec![
                "Proxmox preflight failed",
                "the API token was refused (401)",
                "--proxmox-token-id",
            ],
        ),
        (
            against_sim(&sim, &no_root, &secret, &ca),
            vec!["--proxmox-api-url must end in /api2/json"],
        ),
        (
            against_sim(&sim, &refused, &secret, &ca),
            vec!["nothing listens at", "port 8006"],
        ),
        (
            against_sim(&sim, &url, &secret, &wrong_ca),
            vec!["failed verification", "--proxmox-ca-file"],
        ),
    ];
    for (args, expect) in cases {
        // The preflight runs once the listeners are bound: free ports here.
        let mut all = vec!["--addr", "127.0.0.1:0", "--metrics-addr", ""];
        all.extend(args.iter().map(String::as_str));
        let run = tokio::task::block_in_place(|| run_to_exit(&all, EXIT_DEADLINE));
        let stderr = run.stderr;
        assert!(!run.status.success(), "{all:?} must fail:\n{stderr}");
        for e in &expect {
            assert!(stderr.contains(e), "{all:?}: stderr lacks {e:?}:\n{stderr}");
        }
        assert!(
            !stderr.contains(provider_testkit::STARTUP_LINE),
            "must not serve:\n{stderr}"
        );
        assert!(
            !stderr.contains("is the API token valid?"),
            "no blanket hint:\n{stderr}"
        );
        assert!(!stderr.contains(&secret), "the secret is never logged");
    }
    other.shutdown().await;
    sim.shutdown().await;
}

#[test]
fn bad_clone_mode_and_node_storage_are_refused() {
    let mut args = REAL.to_vec();
    args.extend(["--clone-mode", "thin"]);
    fails(
        &args,
        &["--clone-mode \"thin\" is invalid: expected full or linked"],
    );
    let mut args = REAL.to_vec();
    args.extend(["--node-storage", "pve1"]);
    fails(
        &args,
        &["--node-storage \"pve1\" is invalid", "NODE=STORAGE"],
    );
}

/// `--node-storage` naming a node outside `--nodes` is a configuration
/// error (exit 2) found before anything binds, not a preflight failure.
#[test]
fn node_storage_outside_nodes_is_a_configuration_error() {
    let mut args = REAL.to_vec();
    args.extend(["--node-storage", "pve1=local-lvm,pve9=local-lvm"]);
    fails(
        &args,
        &[r#"--node-storage names node "pve9", which is not in --nodes (pve1, pve2)"#],
    );
    let mut all = vec!["--addr", "127.0.0.1:0", "--metrics-addr", ""];
    all.extend_from_slice(&args);
    let run = run_to_exit(&all, EXIT_DEADLINE);
    assert_eq!(run.status.code(), Some(2), "{}", run.stderr);
}

/// `--clone-mode linked` where PVE cannot make linked clones stops start-up
/// with a message naming the fix; on the same cluster, a template PVE can
/// link from starts (so the refusals are about the template, not the mode).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn linked_clones_pve_cannot_make_stop_start_up_naming_the_fix() {
    // 9000 on local LVM-thin of pve1 (linkable there, and from a replica on
    // pve2); 9100 on thick LVM, which cannot snapshot.
    let mut thick = pve_sim::TemplateSpec::local(9100, "pve1");
    thick.storage = "thick".into();
    let sim = pve_sim::PveSim::start(pve_sim::SimConfig {
        templates: vec![pve_sim::TemplateSpec::local(9000, "pve1"), thick],
        storages: vec![
            pve_sim::StorageSpec::new("local-lvm", pve_sim::StorageKind::LvmThin, false, 1024),
            pve_sim::StorageSpec::new("thick", pve_sim::StorageKind::Lvm, false, 1024),
        ],
        ..pve_sim::SimConfig::default()
    })
    .await
    .expect("simulator");
    let pki = Pki::new();
    let ca = path_str(&pki.write("pve-ca.pem", sim.ca_pem())).to_string();
    let secret = sim.token_secret().to_string();
    let real = against_sim(&sim, &sim.base_url(), &secret, &ca);
    let mut linked: Vec<&str> = real.iter().map(String::as_str).collect();
    linked.extend(["--clone-mode", "linked"]);

    let cases: [(&[&str], &[&str]); 2] = [
        (
            &["--template-vmid", "9100"],
            &[
                "--clone-mode linked: template 9100's disks are on storage thick (type lvm), \
                 which cannot make linked clones",
                "Use --clone-mode full, or move the template's disks to LVM-thin",
            ],
        ),
        (
            &["--template-replicas=false"],
            &[
                "--clone-mode linked: template 9000 is on local storage of node pve1, so node \
                 pve2 cannot make linked clones of it",
                "Leave --template-replicas on",
                "or use --clone-mode full",
            ],
        ),
    ];
    for (extra, expect) in cases {
        let mut all = vec!["--addr", "127.0.0.1:0", "--metrics-addr", ""];
        all.extend(&linked);
        all.extend(extra);
        let run = tokio::task::block_in_place(|| run_to_exit(&all, EXIT_DEADLINE));
        let stderr = run.stderr;
        assert!(!run.status.success(), "{extra:?} must fail:\n{stderr}");
        let reason = stderr
            .lines()
            .filter_map(|l| provider_testkit::field(l, "error"))
            .collect::<Vec<_>>()
            .join("\n");
        for e in expect {
            assert!(
                reason.contains(e),
                "{extra:?}: the error lacks {e:?}:\n{stderr}"
            );
        }
        assert!(
            !stderr.contains(provider_testkit::STARTUP_LINE),
            "{extra:?}: must not serve:\n{stderr}"
        );
        assert!(!stderr.contains(&secret), "the secret is never logged");
    }

    // Serves (Provider::start waits for the start-up line and /readyz).
    let provider = tokio::task::block_in_place(|| Provider::start(&linked));
    assert!(
        provider.startup_line.contains("proxmox_backend=proxmox"),
        "{}",
        provider.startup_line
    );
    drop(provider);
    sim.shutdown().await;
}
