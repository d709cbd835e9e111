//! The arguments the Helm chart renders are accepted by the real binary:
//! the fake-backend release (with durable state and offerings, and with the
//! clone and storage values set) boots to `serving CapacityProvider`, a
//! real-backend release fails on the missing token file and a release on
//! PostgreSQL on the unreachable database, rather than on an unknown flag
//! or value.
//!
//! Needs the built provider (`cargo build -p bigfleet-proxmox`).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use deploy_check::helm::{Chart, Release};
use deploy_check::tools::provider_binary;
use deploy_check::workspace_root;

/// The container's args from the rendered Deployment.
fn chart_args(values: &str) -> Vec<String> {
    let chart = Chart::load(&workspace_root().join("deploy/helm/bigfleet-proxmox")).unwrap();
    let overrides: serde_yaml::Value = serde_yaml::from_str(values).unwrap();
    let docs = chart.render(&overrides, &Release::default()).unwrap();
    let dep = docs
        .iter()
        .find(|d| d.template == "deployment.yaml")
        .expect("deployment rendered");
    let v: serde_yaml::Value = serde_yaml::from_str(&dep.yaml).unwrap();
    v["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect()
}

/// Moves the chart's in-container paths and ports onto this machine.
fn localise(args: Vec<String>, dir: &std::path::Path) -> Vec<String> {
    args.into_iter()
        .map(|a| {
            let a = a
                .replace(
                    "/var/lib/bigfleet",
                    &dir.join("state").display().to_string(),
                )
                .replace("/etc/bigfleet", &dir.join("etc").display().to_string());
            match a.split_once('=') {
                Some(("--addr", _)) => "--addr=127.0.0.1:0".to_owned(),
                Some(("--metrics-addr", _)) => "--metrics-addr=127.0.0.1:0".to_owned(),
                _ => a,
            }
        })
        .collect()
}

/// Boots the binary with the chart's args for `values` and returns the
/// `serving CapacityProvider` line, or panics with what it logged instead.
fn boot(values: &str, dir: &std::path::Path) -> String {
    let bin = provider_binary().unwrap_or_else(|e| panic!("{e}"));
    let args = localise(chart_args(values), dir);
    let mut child = Command::new(&bin)
        .args(&args)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    let serving = loop {
        // Ends on the serving line, on exit (channel closes), or after 30 s.
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(line) => {
                let done = line.contains(provider_testkit::STARTUP_LINE);
                seen.push(line);
                if done {
                    break true;
                }
            }
            Err(_) => break false,
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        serving,
        "provider did not start with the chart's args {args:?}:\n{}",
        seen.join("\n")
    );
    seen.pop().unwrap_or_default()
}

const OFFERINGS: &str = r#"[{"instance_type": "pve.small", "zone": "pve-a", "count": 3}]"#;

fn fake_values(state: bool) -> String {
    format!(
        "fakeBackend: {{enabled: true}}\nstate: {{enabled: {state}}}\nofferings: {{content: '{OFFERINGS}'}}\nextraArgs: [\"--fake-latency=1ms\"]\n"
    )
}

fn workdir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("state")).unwrap();
    std::fs::create_dir_all(dir.path().join("etc/config")).unwrap();
    std::fs::write(dir.path().join("etc/config/offerings.json"), OFFERINGS).unwrap();
    dir
}

#[test]
fn fake_backend_release_boots() {
    let dir = workdir();
    let line = boot(&fake_values(false), dir.path());
    assert!(line.contains("proxmox_backend=fake"), "{line}");
    assert!(line.contains("offerings=3"), "{line}");
}

#[test]
fn fake_backend_release_with_durable_state_boots() {
    let dir = workdir();
    let line = boot(&fake_values(true), dir.path());
    assert!(line.contains("proxmox_backend=fake"), "{line}");
    assert!(
        dir.path().join("state/state.db").exists(),
        "state file created"
    );
}

const CATALOG: &str =
    r#"{"pve.small": {"vcpu": 2, "memory_mib": 4096, "template_vmid": 9001, "storage": "nvme"}}"#;

/// The clone and storage values, each set away from its default: the
/// binary takes what they render (and the catalog's `storage`).
#[test]
fn fake_backend_release_with_clone_and_storage_values_boots() {
    let sets: &[(&str, &[&str])] = &[
        (
            "proxmox: {templateReplicas: false, nodeStorage: {pve-b: fast-zfs, pve-a: local-lvm}, storageOvercommit: {local-lvm: 2.5}}",
            &[
                "--template-replicas=false",
                "--node-storage=pve-a=local-lvm,pve-b=fast-zfs",
                "--storage-overcommit=local-lvm=2.5",
            ],
        ),
        ("proxmox: {cloneMode: linked}", &["--clone-mode=linked"]),
    ];
    for (set, want) in sets {
        let values = format!(
            "{}{set}\ninstanceTypes: {{content: '{CATALOG}'}}\n",
            fake_values(false)
        );
        let args = chart_args(&values);
        for w in *want {
            assert!(args.iter().any(|a| a == w), "{set}: {w} not in {args:?}");
        }
        let dir = workdir();
        std::fs::write(dir.path().join("etc/config/instance-types.json"), CATALOG).unwrap();
        let line = boot(&values, dir.path());
        assert!(line.contains("offerings=3"), "{set}: {line}");
    }
}

#[test]
fn real_backend_release_parses_and_fails_on_the_missing_secret() {
    let bin = provider_binary().unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().unwrap();
    let args = localise(
        chart_args(
            r#"
proxmox: {apiURL: "https://pve1.example.internal:8006/api2/json", tokenID: "bigfleet@pve!autoscaler", nodes: [pve1, pve2], pool: bigfleet, templateReplicas: false, nodeStorage: {pve1: local-lvm, pve2: fast-zfs}}
credentials: {token: {secretName: t}, ca: {secretName: c}}
tls: {enabled: true, mtls: true, secretName: s, clientIdentity: any}
"#,
        ),
        dir.path(),
    );
    for flag in [
        "--template-replicas=false",
        "--node-storage=pve1=local-lvm,pve2=fast-zfs",
        "--tls-client-identity=any",
    ] {
        assert!(args.iter().any(|a| a == flag), "{flag} not in {args:?}");
    }
    let out = Command::new(&bin).args(&args).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    // clap would say "unexpected argument"; validation names the token file.
    assert!(!err.contains("unexpected argument"), "{err}");
    assert!(err.contains("--proxmox-token-file"), "{err}");
}

/// A release on PostgreSQL: the binary takes the state URL and the mounted
/// password file the chart renders, and fails on the database it cannot
/// reach, naming it, rather than on a flag.
#[test]
fn postgres_release_parses_and_fails_on_the_unreachable_database() {
    let bin = provider_binary().unwrap_or_else(|e| panic!("{e}"));
    let dir = workdir();
    let values = format!(
        "{}replicaCount: 2\n",
        fake_values(true).replace(
            "state: {enabled: true}",
            "state:\n  enabled: true\n  postgres:\n    url: \
             postgres://bigfleet@127.0.0.1:1/bigfleet?sslmode=disable\n    \
             password: {secretName: pg-app}"
        )
    );
    let args = localise(chart_args(&values), dir.path());
    let password = dir.path().join("etc/postgres-password/password");
    assert!(
        args.iter()
            .any(|a| *a == format!("--state-password-file={}", password.display())),
        "{args:?}"
    );
    std::fs::create_dir_all(password.parent().unwrap()).unwrap();
    std::fs::write(&password, "not-the-password\n").unwrap();
    let out = Command::new(&bin).args(&args).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("unexpected argument"), "{err}");
    assert!(!err.contains("invalid configuration"), "{err}");
    assert!(
        err.contains("postgres://bigfleet@127.0.0.1:1/bigfleet"),
        "{err}"
    );
    assert!(!err.contains("not-the-password"), "{err}");
    assert!(
        !dir.path().join("state/state.db").exists(),
        "no SQLite state beside PostgreSQL"
    );
}
