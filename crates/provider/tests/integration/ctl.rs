//! `bigfleet-proxmox ctl` end to end: the real binary serves the fake
//! backend, and the same binary's `ctl` subcommand drives it, in plaintext
//! and over mTLS with certificates minted at test time.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use provider_testkit::wait::{child_exit, Wait};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_bigfleet-proxmox");
const SECRET: &str = "TOPSECRET-bootstrap-token-7f3a";

/// Wait for the provider's start-up line in its log file; its gRPC address.
fn await_serving(child: &mut Child, log: &Path) -> String {
    Wait::new("the provider's start-up line", Duration::from_secs(30))
        .every(Duration::from_millis(50))
        .try_ok_blocking(|| {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            if let Some(line) = text.lines().find(|l| provider_testkit::is_startup_line(l)) {
                let addr = provider_testkit::addr_field(line, "addr");
                return Ok(addr.unwrap_or_else(|e| panic!("{e}")).to_string());
            }
            if let Some(status) = child.try_wait().unwrap() {
                panic!("provider exited early ({status}):\n{text}");
            }
            Err(text)
        })
        .unwrap_or_else(|t| panic!("provider never logged its start-up line:\n{}", t.last))
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// A provider process on the fake backend; killed on drop.
struct Provider {
    child: Child,
    target: String,
    /// Global ctl flags that reach this provider (target + TLS material).
    client: Vec<String>,
    log: PathBuf,
    dir: tempfile::TempDir,
}

impl Provider {
    /// `server_args` are appended to the fake-backend flags.
    fn start(server_args: &[String], client_tls: &[String], dir: tempfile::TempDir) -> Provider {
        let log = dir.path().join("provider.log");
        let mut child = Command::new(BIN)
            .args([
                "--use-fake-backend",
                "--addr",
                "127.0.0.1:0",
                "--metrics-addr",
                "",
                "--seed-count",
                "4",
            ])
            .args(server_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let target = await_serving(&mut child, &log);
        let mut client = vec!["--target".to_string(), target.clone()];
        client.extend_from_slice(client_tls);
        Provider {
            child,
            target,
            client,
            log,
            dir,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn ctl_command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.arg("ctl").args(&self.client).args(args);
        cmd
    }

    fn ctl(&self, args: &[&str]) -> Output {
        self.ctl_command(args).output().unwrap()
    }

    /// Run and require success; returns stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.ctl(args);
        assert!(
            out.status.success(),
            "ctl {args:?} failed: {}\nprovider log:\n{}",
            stderr(&out),
            self.log()
        );
        assert_no_secret(&out);
        stdout(&out)
    }

    fn json(&self, args: &[&str]) -> Value {
        let mut full = vec!["--output", "json"];
        full.extend_from_slice(args);
        let text = self.ok(&full);
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
    }

    /// Run and require failure (exit 1: the provider refused or could not
    /// be reached); returns stderr.
    fn fails(&self, args: &[&str]) -> String {
        self.fails_with(1, args)
    }

    /// Run and require failure with this exit code; returns stderr.
    fn fails_with(&self, code: i32, args: &[&str]) -> String {
        let out = self.ctl(args);
        assert_eq!(
            out.status.code(),
            Some(code),
            "ctl {args:?} should fail with exit {code}; stdout: {} stderr: {}",
            stdout(&out),
            stderr(&out)
        );
        assert_no_secret(&out);
        stderr(&out)
    }

    fn first_speculative(&self) -> String {
        let list = self.json(&["list", "--state", "SPECULATIVE", "--max", "1"]);
        list[0]["id"].as_str().unwrap().to_string()
    }
}

impl Drop for Provider {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn assert_no_secret(out: &Output) {
    assert!(
        !stdout(out).contains(SECRET) && !stderr(out).contains(SECRET),
        "the bootstrap blob leaked into ctl output"
    );
}

fn fake_latency(latency: &str) -> Vec<String> {
    vec!["--fake-latency".into(), latency.into()]
}

fn plaintext() -> Provider {
    Provider::start(&fake_latency("100ms"), &[], tempfile::tempdir().unwrap())
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

#[test]
fn full_lifecycle_through_the_cli() {
    let p = plaintext();
    let id = p.first_speculative();

    // Create: progress on stderr, the landed state on stdout.
    let out = p.ctl(&["create", &id, "--wait", "--poll-interval", "20ms"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let progress = stderr(&out);
    assert!(progress.contains(&format!("{id}: CREATING")), "{progress}");
    assert!(progress.contains(&format!("{id}: IDLE")), "{progress}");
    assert!(
        stdout(&out).starts_with(&format!("{id}: IDLE (operation ")),
        "{}",
        stdout(&out)
    );

    let idle = p.json(&["list", "--state", "IDLE"]);
    let idle = idle.as_array().unwrap();
    assert_eq!(idle.len(), 1, "{idle:?}");
    assert_eq!(idle[0]["id"], id.as_str());
    assert_eq!(idle[0]["state"], "IDLE");
    assert!(idle[0]["host"]["ref"]
        .as_str()
        .is_some_and(|r| !r.is_empty()));

    // Configure with a blob file: the blob never shows, the binding does.
    let blob = write(p.dir.path(), "blob.sh", &format!("#!/bin/sh\n# {SECRET}\n"));
    let ack = p.json(&[
        "configure",
        &id,
        "--cluster",
        "prod-eu",
        "--blob-file",
        &blob,
        "--metadata",
        "team=infra",
        "--metadata",
        "shard=s1",
        "--wait",
        "--poll-interval",
        "20ms",
    ]);
    assert!(ack["operation_id"].as_str().is_some_and(|o| !o.is_empty()));
    assert_eq!(ack["machine"]["state"], "CONFIGURED");
    assert_eq!(ack["machine"]["cluster"], "prod-eu");
    assert_eq!(ack["machine"]["shard_metadata"]["team"], "infra");
    assert_eq!(ack["machine"]["shard_metadata"]["shard"], "s1");

    let got = p.json(&["get", &id]);
    assert_eq!(got["state"], "CONFIGURED");
    assert_eq!(got["cluster"], "prod-eu");
    let table = p.ok(&["get", &id]);
    assert!(table.contains("state:"), "{table}");
    assert!(table.contains("CONFIGURED"), "{table}");
    assert!(table.contains("prod-eu"), "{table}");
    assert!(table.contains("shard=s1,team=infra"), "{table}");

    let listed = p.ok(&["list", "--state", "configured"]);
    let lines: Vec<&str> = listed.lines().collect();
    assert_eq!(lines.len(), 2, "{listed}");
    assert!(lines[0].starts_with("ID "), "{listed}");
    for column in ["STATE", "HOST", "CLUSTER", "TYPE", "ZONE", "LAST_ERROR"] {
        assert!(lines[0].contains(column), "{listed}");
    }
    assert!(
        lines[1].starts_with(&id) && lines[1].contains("prod-eu"),
        "{listed}"
    );

    // Drain lands in IDLE and clears the binding.
    let out = p.ok(&[
        "drain",
        &id,
        "--grace",
        "5",
        "--wait",
        "--poll-interval",
        "20ms",
    ]);
    assert!(out.starts_with(&format!("{id}: IDLE")), "{out}");
    let got = p.json(&["get", &id]);
    assert_eq!(got["state"], "IDLE");
    assert_eq!(got["cluster"], "");
    assert_eq!(got["shard_metadata"], serde_json::json!({}));

    // Delete returns the slot to SPECULATIVE without a host.
    let ack = p.json(&["delete", &id, "--wait", "--poll-interval", "20ms"]);
    assert_eq!(ack["machine"]["state"], "SPECULATIVE");
    let got = p.json(&["get", &id]);
    assert_eq!(got["state"], "SPECULATIVE");
    assert!(got["host"].is_null(), "{got}");
    assert!(p
        .json(&["list", "--state", "IDLE"])
        .as_array()
        .unwrap()
        .is_empty());

    assert!(!p.log().contains(SECRET), "the provider logged the blob");
}

#[test]
fn without_wait_the_ack_shows_the_transitional_state() {
    let p = plaintext();
    let id = p.first_speculative();
    let ack = p.json(&["create", &id]);
    assert_eq!(ack["machine"]["state"], "CREATING");
    // The same transition again is idempotent: same operation id.
    let again = p.json(&["create", &id]);
    assert_eq!(again["operation_id"], ack["operation_id"]);
}

#[test]
fn errors_name_the_rpc_and_the_grpc_code() {
    let p = plaintext();
    let id = p.first_speculative();

    let err = p.fails(&["get", "no-such-machine"]);
    assert!(
        err.starts_with("error: Get no-such-machine: NOT_FOUND"),
        "{err}"
    );

    // Out of position: rejected, but never as a fencing failure.
    let blob = write(p.dir.path(), "blob", SECRET);
    let err = p.fails(&["configure", &id, "--cluster", "c", "--blob-file", &blob]);
    assert!(
        err.starts_with(&format!("error: Configure {id}: ")),
        "{err}"
    );
    assert!(!err.contains("FAILED_PRECONDITION"), "{err}");
    assert_eq!(p.json(&["get", &id])["state"], "SPECULATIVE");

    // A replayed fencing token is fenced out with a hint.
    let token = ["--shard-id", "shard-a", "--epoch", "3", "--sequence", "7"];
    let mut first = vec!["create", id.as_str()];
    first.extend_from_slice(&token);
    p.ok(&first);
    let err = p.fails(&first);
    assert!(err.contains("FAILED_PRECONDITION"), "{err}");
    assert!(err.contains("--epoch"), "{err}");

    // Local input problems never reach the provider: exit 2, like a
    // usage error.
    let err = p.fails_with(
        2,
        &[
            "configure",
            &id,
            "--cluster",
            "c",
            "--blob-file",
            "/nonexistent/blob",
        ],
    );
    assert!(
        err.contains("cannot read --blob-file /nonexistent/blob"),
        "{err}"
    );
    let usage = p.ctl(&["list", "--state", "sleeping"]);
    assert_eq!(usage.status.code(), Some(2));
    assert!(
        stderr(&usage).contains("unknown machine state"),
        "{}",
        stderr(&usage)
    );

    let nobody = format!("127.0.0.1:{}", free_port());
    let out = Command::new(BIN)
        .args(["ctl", "--target", &nobody, "--timeout", "2s", "list"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).starts_with(&format!("error: cannot connect to {nobody}")),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_transition_that_fails_is_reported_with_its_last_error() {
    // Every Create outlives its 100ms timeout and lands in FAILED.
    let mut args = fake_latency("5s");
    args.extend(["--create-timeout".to_string(), "100ms".to_string()]);
    let p = Provider::start(&args, &[], tempfile::tempdir().unwrap());
    let id = p.first_speculative();

    let out = p.ctl(&["create", &id, "--wait", "--poll-interval", "20ms"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).is_empty(), "{}", stdout(&out));
    let err = stderr(&out);
    assert!(err.contains(&format!("{id}: CREATING")), "{err}");
    let last = err.lines().last().unwrap();
    assert!(
        last.starts_with(&format!("error: {id} landed in FAILED after ")),
        "{err}"
    );
    assert!(last.contains("Create timed out"), "{err}");

    let failed = p.json(&["list", "--state", "FAILED"]);
    assert_eq!(failed[0]["id"], id.as_str());
    assert!(failed[0]["last_error"]
        .as_str()
        .unwrap()
        .contains("Create timed out"));
    let table = p.ok(&["list", "--state", "failed"]);
    assert!(table.contains("Create timed out"), "{table}");

    // Watching for a state FAILED can never reach ends with an error.
    let out = p.ctl(&["watch", &id, "--until", "idle", "--interval", "10ms"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stdout(&out).contains(&format!("{id}: FAILED (")),
        "{}",
        stdout(&out)
    );
    assert!(
        stderr(&out).contains("is FAILED and will not reach IDLE"),
        "{}",
        stderr(&out)
    );
}

/// Lines from a child's stdout, readable with a deadline.
fn line_reader(child: &mut Child) -> mpsc::Receiver<String> {
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

fn wait_exit(child: &mut Child, within: Duration) -> std::process::ExitStatus {
    child_exit(child, within).unwrap_or_else(|| {
        let _ = child.kill();
        panic!("child did not exit within {within:?}");
    })
}

#[test]
fn watch_prints_state_changes_until_the_requested_state() {
    let p = plaintext();
    let id = p.first_speculative();
    let mut watch = p
        .ctl_command(&["watch", &id, "--interval", "10ms", "--until", "idle"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = line_reader(&mut watch);
    let first = lines.recv_timeout(Duration::from_secs(20)).unwrap();
    assert!(first.ends_with(&format!("{id}: SPECULATIVE")), "{first}");
    p.ok(&["create", &id]);
    let status = wait_exit(&mut watch, Duration::from_secs(20));
    assert!(status.success(), "watch failed");
    let rest: Vec<String> = lines.try_iter().collect();
    let states: Vec<&str> = rest.iter().map(|l| l.rsplit(' ').next().unwrap()).collect();
    // One line per change: CREATING lasts 100ms against a 10ms poll, but a
    // starved watcher may legitimately see only the landing.
    assert!(
        states == ["CREATING", "IDLE"] || states == ["IDLE"],
        "{rest:?}"
    );
}

#[test]
#[allow(unsafe_code)] // libc call; see the SAFETY note inside
fn watch_stops_cleanly_on_ctrl_c() {
    let p = plaintext();
    let id = p.first_speculative();
    let mut watch = p
        .ctl_command(&["--output", "json", "watch", &id, "--interval", "10ms"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = line_reader(&mut watch);
    let first = lines.recv_timeout(Duration::from_secs(20)).unwrap();
    let first: Value = serde_json::from_str(&first).unwrap();
    assert_eq!(first["machine"]["state"], "SPECULATIVE");
    // SAFETY: signalling our own child by its pid.
    // SAFETY: kill(2) on our own, not yet reaped child.
    let rc = unsafe { libc::kill(watch.id() as libc::pid_t, libc::SIGINT) };
    assert_eq!(rc, 0);
    let status = wait_exit(&mut watch, Duration::from_secs(20));
    assert!(status.success(), "watch should exit 0 on Ctrl-C: {status}");
}

/// A CA, a server certificate for 127.0.0.1/localhost and a client
/// certificate, all written as PEM into `dir`.
struct Pki {
    ca: String,
    server_cert: String,
    server_key: String,
    client_cert: String,
    client_key: String,
}

fn ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params.distinguished_name.push(DnType::CommonName, name);
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

/// A leaf for `names` (DNS names or IP addresses), plus the URI SAN
/// `bigfleet://admin` on a client certificate: ctl is an operator's tool,
/// and an mTLS provider lets only that identity act for any shard.
fn leaf(
    issuer: &CertifiedIssuer<'static, KeyPair>,
    names: &[&str],
    usage: ExtendedKeyUsagePurpose,
) -> (String, String) {
    let mut params =
        CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
    if usage == ExtendedKeyUsagePurpose::ClientAuth {
        let admin = rcgen::string::Ia5String::try_from("bigfleet://admin").unwrap();
        params.subject_alt_names.push(rcgen::SanType::URI(admin));
    }
    params.distinguished_name.push(DnType::CommonName, names[0]);
    params.extended_key_usages = vec![usage];
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

fn mint_pki(dir: &Path, ca_name: &str) -> Pki {
    let authority = ca(ca_name);
    let (server_cert, server_key) = leaf(
        &authority,
        &["localhost", "127.0.0.1"],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let (client_cert, client_key) = leaf(
        &authority,
        &["operator"],
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    Pki {
        ca: write(dir, "ca.pem", &authority.pem()),
        server_cert: write(dir, "server.pem", &server_cert),
        server_key: write(dir, "server.key", &server_key),
        client_cert: write(dir, "client.pem", &client_cert),
        client_key: write(dir, "client.key", &client_key),
    }
}

#[test]
fn mtls_lifecycle_and_rejections() {
    let dir = tempfile::tempdir().unwrap();
    let pki = mint_pki(dir.path(), "bigfleet test CA");
    let mut server = fake_latency("100ms");
    server.extend([
        "--tls-cert".to_string(),
        pki.server_cert.clone(),
        "--tls-key".into(),
        pki.server_key.clone(),
        "--tls-ca".into(),
        pki.ca.clone(),
    ]);
    let client = [
        "--tls-ca".to_string(),
        pki.ca.clone(),
        "--tls-cert".into(),
        pki.client_cert.clone(),
        "--tls-key".into(),
        pki.client_key.clone(),
    ];
    let p = Provider::start(&server, &client, dir);
    assert!(p.log().contains("mTLS"), "{}", p.log());

    let id = p.first_speculative();
    let ack = p.json(&["create", &id, "--wait", "--poll-interval", "20ms"]);
    assert_eq!(ack["machine"]["state"], "IDLE");
    let blob = write(p.dir.path(), "blob", SECRET);
    let out = p.ok(&[
        "configure",
        &id,
        "--cluster",
        "c1",
        "--blob-file",
        &blob,
        "--wait",
        "--poll-interval",
        "20ms",
    ]);
    assert!(out.starts_with(&format!("{id}: CONFIGURED")), "{out}");
    // An explicit server name that the certificate carries also verifies.
    let got = p.json(&["--tls-domain", "localhost", "get", &id]);
    assert_eq!(got["cluster"], "c1");

    let target = p.target.as_str();
    let run = |args: &[&str]| {
        Command::new(BIN)
            .args(["ctl", "--target", target, "--timeout", "5s"])
            .args(args)
            .arg("list")
            .output()
            .unwrap()
    };

    // No client certificate: the server refuses, and the message says so.
    let out = run(&["--tls-ca", &pki.ca]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let err = stderr(&out);
    assert!(
        err.starts_with(&format!("error: cannot connect to {target}")),
        "{err}"
    );
    assert!(
        err.contains("requires a client certificate (mTLS): pass --tls-cert and --tls-key"),
        "{err}"
    );

    // A provider certificate from a CA we do not trust.
    let other = tempfile::tempdir().unwrap();
    let foreign = mint_pki(other.path(), "some other CA");
    let out = run(&[
        "--tls-ca",
        &foreign.ca,
        "--tls-cert",
        &foreign.client_cert,
        "--tls-key",
        &foreign.client_key,
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains(&format!("cannot connect to {target}")),
        "{err}"
    );
    assert!(err.to_lowercase().contains("certificate"), "{err}");

    // Wrong server name.
    let out = run(&[
        "--tls-ca",
        &pki.ca,
        "--tls-cert",
        &pki.client_cert,
        "--tls-key",
        &pki.client_key,
        "--tls-domain",
        "wrong-name.invalid",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).to_lowercase().contains("certificate"),
        "{}",
        stderr(&out)
    );

    // Plaintext against the TLS listener fails rather than hanging.
    let out = run(&[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).starts_with("error: List: "),
        "{}",
        stderr(&out)
    );
    assert!(stderr(&out).contains("pass --tls-ca"), "{}", stderr(&out));

    // Half an identity is a local error: nothing is dialled.
    let out = run(&["--tls-ca", &pki.ca, "--tls-cert", &pki.client_cert]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("--tls-cert and --tls-key must be given together"),
        "{}",
        stderr(&out)
    );
    assert!(!p.log().contains(SECRET), "the provider logged the blob");
}

#[test]
fn list_filters_summary_and_short_targets() {
    let p = plaintext();
    // -o is --output.
    let all: Value = serde_json::from_str(&p.ok(&["-o", "json", "list"])).unwrap();
    let all = all.as_array().unwrap().clone();
    assert_eq!(all.len(), 4, "{all:?}");
    let zone = all[0]["zone"].as_str().unwrap().to_string();
    let typ = all[0]["instance_type"].as_str().unwrap().to_string();

    let in_zone = p.json(&["list", "--zone", &zone]);
    let in_zone = in_zone.as_array().unwrap();
    let want = all.iter().filter(|m| m["zone"] == zone.as_str()).count();
    assert!(
        want > 0 && want < all.len(),
        "the fake backend spreads over two zones"
    );
    assert_eq!(in_zone.len(), want, "{in_zone:?}");
    assert!(in_zone.iter().all(|m| m["zone"] == zone.as_str()));
    let one = p.json(&["list", "--zone", &zone, "--type", &typ, "--max", "1"]);
    let one = one.as_array().unwrap();
    assert_eq!(one.len(), 1);
    assert_eq!(one[0]["instance_type"], typ.as_str());
    assert!(p
        .json(&["list", "--zone", "no-such-node"])
        .as_array()
        .unwrap()
        .is_empty());

    // Summary: every machine counted once, per zone and type, every state a column.
    let summary = p.json(&["summary"]);
    let rows = summary.as_array().unwrap();
    let total: u64 = rows.iter().map(|r| r["total"].as_u64().unwrap()).sum();
    assert_eq!(total, 4);
    for r in rows {
        assert_eq!(r["counts"]["SPECULATIVE"], r["total"], "{r}");
        assert_eq!(r["counts"]["FAILED"], 0, "{r}");
    }
    let table = p.ok(&["summary"]);
    assert!(table.starts_with("ZONE"), "{table}");
    assert!(
        table.lines().last().unwrap().starts_with("(all)"),
        "{table}"
    );

    // `:PORT` means 127.0.0.1; a bare host means port 9000 (nothing listens
    // there in this test, and the error names the address it tried).
    let port = p.target.rsplit_once(':').unwrap().1;
    let out = Command::new(BIN)
        .args(["ctl", "--target", &format!(":{port}"), "list", "--max", "1"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let out = Command::new(BIN)
        .args(["ctl", "--timeout", "1s", "--target", "127.0.0.1", "list"])
        .output()
        .unwrap();
    if !out.status.success() {
        assert!(stderr(&out).contains("127.0.0.1:9000"), "{}", stderr(&out));
    }
}

#[test]
fn reclaim_returns_a_failed_machine_and_refuses_others() {
    // A Create that times out is FAILED, and stays so across a restart (a
    // restart alone would resume it).
    let state_dir = tempfile::tempdir().unwrap();
    let state = state_dir.path().join("state.db").display().to_string();
    let mut args = fake_latency("30s");
    args.extend(["--create-timeout", "300ms", "--state"].map(String::from));
    args.push(state.clone());
    let first = Provider::start(&args, &[], tempfile::tempdir().unwrap());
    let id = first.first_speculative();
    first.ok(&["create", &id]);
    Wait::new(
        format!("{id} to time out (FAILED)"),
        Duration::from_secs(15),
    )
    .every(Duration::from_millis(50))
    .until_blocking(|| first.json(&["get", &id])["state"] == "FAILED");
    drop(first);
    let p = Provider::start(
        &["--state".to_string(), state],
        &[],
        tempfile::tempdir().unwrap(),
    );
    let failed = p.json(&["get", &id]);
    assert_eq!(failed["state"], "FAILED", "{failed}");

    // Not FAILED: refused, naming the state and the way healthy machines leave.
    let other = p.first_speculative();
    p.ok(&["create", &other, "--wait", "--poll-interval", "20ms"]);
    let err = p.fails(&["reclaim", &other]);
    assert!(err.contains("FAILED_PRECONDITION"), "{err}");
    assert!(err.contains("is IDLE, not FAILED"), "{err}");
    assert!(err.contains("Drain and Delete"), "{err}");
    let err = p.fails(&["reclaim", "no/such/machine"]);
    assert!(err.contains("NOT_FOUND"), "{err}");

    let out = p.json(&["reclaim", &id, "--wait"]);
    assert_eq!(out["status"], "RECLAIMED", "{out}");
    let m = p.json(&["get", &id]);
    assert_eq!(m["state"], "SPECULATIVE", "{m}");
    assert!(m["host"].is_null(), "{m}");
    assert_eq!(m["last_error"], "", "{m}");
    // Idempotent.
    let again = p.ok(&["reclaim", &id, "--wait"]);
    assert!(again.contains("already SPECULATIVE"), "{again}");
    // The slot is usable again.
    p.ok(&["create", &id, "--wait", "--poll-interval", "20ms"]);
}

/// The top-level help's line for `ctl` and `ctl --help` name every
/// subcommand, `summary` and `reclaim` included.
#[test]
fn help_names_every_subcommand() {
    const SUBCOMMANDS: [&str; 9] = [
        "list",
        "summary",
        "get",
        "create",
        "configure",
        "drain",
        "delete",
        "reclaim",
        "watch",
    ];
    let top = Command::new(BIN).arg("--help").output().unwrap();
    let top = stdout(&top);
    let ctl_line = top
        .lines()
        .find(|l| l.trim_start().starts_with("ctl "))
        .unwrap_or_else(|| panic!("no ctl line in --help:\n{top}"));
    let ctl = Command::new(BIN).args(["ctl", "--help"]).output().unwrap();
    let ctl = stdout(&ctl);
    for sub in SUBCOMMANDS {
        assert!(
            ctl_line.contains(sub),
            "--help's ctl line lacks {sub}: {ctl_line}"
        );
        assert!(
            ctl.lines()
                .any(|l| l.trim_start().starts_with(&format!("{sub} "))),
            "ctl --help lacks {sub}:\n{ctl}"
        );
    }
}
