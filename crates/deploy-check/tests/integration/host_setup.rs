//! deploy/host-setup/setup-token.sh: shellcheck-clean, and correct against a
//! fake `pveum` that records every call and refuses to create what already
//! exists, the way the real one does. Running the script twice proves it is
//! idempotent.

use std::process::{Command, Output};

use deploy_check::tools::{find_or_skip, SHELLCHECK_INSTALL};

use crate::common::{setup_token_script, write_exec, FakePveHost};

#[test]
fn shellcheck_passes() {
    // As hadolint_passes: a reported skip outside CI, a failure under it.
    let Some(sc) = find_or_skip(
        "shellcheck",
        SHELLCHECK_INSTALL,
        "shellcheck deploy/host-setup/setup-token.sh",
    ) else {
        return;
    };
    let out = Command::new(sc)
        .arg("--severity=style")
        .arg(setup_token_script())
        .output()
        .expect("run shellcheck");
    assert!(
        out.status.success(),
        "shellcheck found problems in setup-token.sh:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn has(calls: &[Vec<String>], want: &[&str]) -> bool {
    calls
        .iter()
        .any(|c| c.iter().map(String::as_str).eq(want.iter().copied()))
}

fn privs_of<'a>(calls: &'a [Vec<String>], verb: &str, role: &str) -> Vec<&'a str> {
    let call = calls
        .iter()
        .find(|c| c.len() >= 5 && c[0] == "role" && c[1] == verb && c[2] == role)
        .unwrap_or_else(|| panic!("no `role {verb} {role}` in {calls:?}"));
    assert_eq!(call[3], "--privs");
    let mut p: Vec<&str> = call[4].split(',').collect();
    p.sort();
    p
}

const PVE8_PRIVS: &[&str] = &[
    "Datastore.AllocateSpace",
    "Pool.Audit",
    "VM.Allocate",
    "VM.Audit",
    "VM.Clone",
    "VM.Config.CPU",
    "VM.Config.Disk",
    "VM.Config.Memory",
    "VM.Config.Options",
    "VM.Migrate",
    "VM.Monitor",
    "VM.PowerMgmt",
];

#[test]
fn first_run_creates_everything_and_prints_the_secret() {
    let fake = FakePveHost::new("8.2.4");
    let secret_file = fake.dir.path().join("token");
    let out = fake.run(
        &[
            "--template-vmid",
            "9000,9001",
            "--secret-file",
            secret_file.to_str().unwrap(),
        ],
        &[],
    );
    assert!(out.status.success(), "{}", text(&out));
    let calls = fake.take_calls();

    assert_eq!(privs_of(&calls, "add", "BigFleetProvisioner"), PVE8_PRIVS);
    assert_eq!(
        privs_of(&calls, "add", "BigFleetProvisionerTemplate"),
        ["VM.Audit", "VM.Clone"]
    );
    assert!(has(
        &calls,
        &[
            "pool",
            "add",
            "bigfleet",
            "--comment",
            "BigFleet-managed VMs"
        ]
    ));
    assert!(calls
        .iter()
        .any(|c| c[..3] == ["user", "add", "bigfleet@pve"]));
    let acl = |path: &str, role: &str, propagate: &str| {
        has(
            &calls,
            &[
                "acl",
                "modify",
                path,
                "--users",
                "bigfleet@pve",
                "--roles",
                role,
                "--propagate",
                propagate,
            ],
        )
    };
    assert!(
        acl("/pool/bigfleet", "BigFleetProvisioner", "1"),
        "{calls:?}"
    );
    assert!(
        acl("/vms/9000", "BigFleetProvisionerTemplate", "0"),
        "{calls:?}"
    );
    assert!(
        acl("/vms/9001", "BigFleetProvisionerTemplate", "0"),
        "{calls:?}"
    );
    assert!(
        acl("/storage/local-lvm", "BigFleetProvisioner", "0"),
        "{calls:?}"
    );
    assert!(acl("/nodes", "PVEAuditor", "1"), "{calls:?}");
    assert!(
        acl("/sdn/zones/localnetwork/vmbr0", "PVESDNUser", "1"),
        "{calls:?}"
    );
    let token = calls
        .iter()
        .find(|c| c[..3] == ["user", "token", "add"])
        .expect("token add");
    assert_eq!(token[3..5], ["bigfleet@pve", "autoscaler"]);
    assert!(
        token.windows(2).any(|w| w == ["--privsep", "0"]),
        "{token:?}"
    );
    // Nothing in the pool or on the templates beyond the two roles.
    assert!(!calls
        .iter()
        .any(|c| c.iter().any(|a| a == "Administrator" || a == "PVEAdmin")));

    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("token id:     bigfleet@pve!autoscaler"),
        "{stdout}"
    );
    assert!(
        stdout.contains("token secret: 11111111-2222-3333-4444-555555555555"),
        "{stdout}"
    );
    assert_eq!(
        std::fs::read_to_string(&secret_file).unwrap(),
        "11111111-2222-3333-4444-555555555555"
    );
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&secret_file)
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600);
}

#[test]
fn second_run_is_idempotent() {
    let fake = FakePveHost::new("8.2.4");
    let first = fake.run(&[], &[]);
    assert!(first.status.success(), "{}", text(&first));
    fake.take_calls();

    let again = fake.run(&[], &[]);
    assert!(again.status.success(), "{}", text(&again));
    let calls = fake.take_calls();
    // The role is reset to exactly the same privileges, not appended to.
    assert_eq!(
        privs_of(&calls, "modify", "BigFleetProvisioner"),
        PVE8_PRIVS
    );
    assert!(!calls
        .iter()
        .any(|c| c[..2] == ["role", "modify"] && c.iter().any(|a| a == "--append")));
    let stdout = String::from_utf8_lossy(&again.stdout);
    assert!(stdout.contains("already exists"), "{stdout}");
    assert!(
        !stdout.contains("11111111-"),
        "no secret on a re-run: {stdout}"
    );
    // Still exactly one token.
    let tokens = std::fs::read_dir(fake.dir.path().join("state"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("token-")
        })
        .count();
    assert_eq!(tokens, 1);

    // Rotation replaces it and shows the new secret once.
    let rotated = fake.run(&["--rotate-token"], &[]);
    assert!(rotated.status.success(), "{}", text(&rotated));
    let calls = fake.take_calls();
    assert!(calls.iter().any(|c| c[..3] == ["user", "token", "remove"]));
    assert!(String::from_utf8_lossy(&rotated.stdout).contains("token secret: 11111111-"));
}

#[test]
fn pve9_uses_guest_agent_privileges() {
    let fake = FakePveHost::new("9.0.3");
    let out = fake.run(
        &["--bridge", "vmbr1,vmbr2"],
        &[("BIGFLEET_PVE_POOL", "fleet")],
    );
    assert!(out.status.success(), "{}", text(&out));
    let calls = fake.take_calls();
    let privs = privs_of(&calls, "add", "BigFleetProvisioner");
    assert!(
        !privs.contains(&"VM.Monitor"),
        "VM.Monitor is gone in PVE 9: {privs:?}"
    );
    for p in [
        "VM.GuestAgent.Audit",
        "VM.GuestAgent.FileWrite",
        "VM.GuestAgent.Unrestricted",
    ] {
        assert!(privs.contains(&p), "{p} missing: {privs:?}");
    }
    assert!(calls
        .iter()
        .any(|c| c.get(2).map(String::as_str) == Some("/pool/fleet")));
    assert!(calls
        .iter()
        .any(|c| c.get(2).map(String::as_str) == Some("/sdn/zones/localnetwork/vmbr2")));
}

#[test]
fn an_sdn_vnets_grant_is_in_its_own_zone() {
    let fake = FakePveHost::new("8.3.2");
    // pvesh as root on a node: a VNet reads back with its zone; anything
    // else ("sdn vnet 'vmbr0' does not exist") fails.
    write_exec(
        &fake.dir.path().join("bin/pvesh"),
        r#"#!/usr/bin/env bash
if [[ $1 == get && $2 == /cluster/sdn/vnets/vnet1 ]]; then
  echo '{"digest":"0a1b","type":"vnet","vnet":"vnet1","zone":"z1"}'; exit 0
fi
echo "sdn vnet '${2##*/}' does not exist" >&2; exit 255
"#,
    );
    let sdn_acls = |calls: &[Vec<String>]| -> Vec<String> {
        calls
            .iter()
            .filter_map(|c| c.get(2))
            .filter(|a| a.starts_with("/sdn/"))
            .cloned()
            .collect()
    };
    let out = fake.run(&["--bridge", "vmbr0,vnet1"], &[]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        sdn_acls(&fake.take_calls()),
        ["/sdn/zones/localnetwork/vmbr0", "/sdn/zones/z1/vnet1"]
    );
    // An explicit zone is used for every bridge, as given.
    let out = fake.run(&["--bridge", "vnet1", "--sdn-zone", "z2"], &[]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(sdn_acls(&fake.take_calls()), ["/sdn/zones/z2/vnet1"]);
}

#[test]
fn pve7_skips_sdn_and_an_empty_bridge_list_skips_it_too() {
    let fake = FakePveHost::new("7.4.17");
    let out = fake.run(&[], &[]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(!fake
        .take_calls()
        .iter()
        .any(|c| c.iter().any(|a| a.starts_with("/sdn/"))));

    let fake = FakePveHost::new("8.1.0");
    let out = fake.run(&["--bridge", ""], &[]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(!fake
        .take_calls()
        .iter()
        .any(|c| c.iter().any(|a| a.starts_with("/sdn/"))));
}

#[test]
fn real_failures_stop_the_setup_token_script() {
    let fake = FakePveHost::new("8.2.4");
    let out = fake.run(&[], &[("FAKE_FAIL_ON", "/nodes")]);
    assert!(!out.status.success(), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("permission check failed"), "{err}");
    assert!(err.contains("acl modify /nodes"), "{err}");
    // It stopped there: no token was created.
    assert!(!fake
        .take_calls()
        .iter()
        .any(|c| c[..2] == ["user", "token"]));
}

#[test]
fn bad_input_is_refused_before_any_call() {
    let fake = FakePveHost::new("8.2.4");
    for (args, want) in [
        (vec!["--user", "bigfleet"], "USER@REALM"),
        (vec!["--template-vmid", "90x"], "not a VMID"),
        (vec!["--frobnicate"], "unknown option '--frobnicate'"),
        (vec!["--pool"], "--pool needs a value"),
    ] {
        let out = fake.run(&args, &[]);
        assert!(!out.status.success(), "{args:?}: {}", text(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(fake.take_calls().is_empty(), "{args:?} reached pveum");
    }
}
