//! The start-up preflight through the real substrate against pve-sim: each
//! way a new operator's set-up can be wrong fails before serving, naming
//! the fix.

use std::time::Duration;

use proxmox_backend::proxmox::{PveOptions, PveSubstrate};
use proxmox_backend::substrate::{CloneRequest, Substrate};
use pve::{PveClient, PveConfig};
use pve_sim::{endpoints, PveSim, SimConfig, TagAccess, TemplateSpec};

use crate::common::{self, sim_with};

/// A client config that does not retry: each failure is seen as it is.
fn config(sim: &PveSim) -> PveConfig {
    common::config_retrying(sim, 1, Duration::from_millis(10), Duration::from_millis(10))
}

fn client(sim: &PveSim) -> PveClient {
    common::client_of(config(sim))
}

fn opts(pool: &str) -> PveOptions {
    PveOptions {
        pool: Some(pool.into()),
        retry_window: Duration::from_secs(5),
        ..common::opts(Duration::from_secs(20))
    }
}

fn fast() -> SimConfig {
    common::fast_sim(Duration::from_millis(100), Duration::from_millis(50))
}

/// The start-up warning of a token without `Sys.Audit` on `/`, to which PVE
/// does not show `user-tag-access`.
const UNKNOWN_TAG_ACCESS: &str = "the datacenter option user-tag-access is unknown: without \
     Sys.Audit on / PVE does not show it to this token. If it refuses new tags, the first refused \
     marking falls back to marker-only ownership (grant Sys.Audit on / to know at start-up)";

async fn preflight(sim: &PveSim, pool: &str) -> Result<Vec<String>, String> {
    PveSubstrate::new(client(sim), opts(pool))
        .preflight(&["pve1".into(), "pve2".into()], &[9000])
        .await
        .map_err(|e| e.to_string())
}

/// The privileges in the shell array `name=( ... )` of
/// deploy/host-setup/setup-token.sh (the first word of each line), so this
/// test holds the preflight to what the script really grants.
fn setup_script_array(name: &str) -> Vec<String> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/host-setup/setup-token.sh"
    );
    let script = std::fs::read_to_string(path).expect("setup-token.sh");
    let start = script
        .find(&format!("\n{name}=(\n"))
        .unwrap_or_else(|| panic!("setup-token.sh has no {name}=( array"));
    let body = &script[start + name.len() + 4..];
    let body = &body[..body.find("\n)").expect("the array is closed")];
    let privs: Vec<String> = body
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|w| !w.starts_with('#'))
        .map(str::to_string)
        .collect();
    assert!(privs.len() >= 2, "{name}: {privs:?}");
    privs
}

/// The token deploy/host-setup/setup-token.sh creates: nothing on `/`, the
/// provider's role on the pool, the template role on the template, the
/// role's Datastore privileges on the storage. `pool_audit: false` models
/// a hand-made role without `Pool.Audit`.
fn setup_script_token(pool: &str, pool_audit: bool) -> SimConfig {
    let on = |path: &str, privs: &[&str]| -> Vec<(String, String)> {
        privs
            .iter()
            .map(|p| (path.to_string(), p.to_string()))
            .collect()
    };
    let mut pool_privs = setup_script_array("privs");
    pool_privs.retain(|p| p != "Pool.Audit");
    pool_privs.push("VM.Monitor".into());
    let pool_privs: Vec<&str> = pool_privs.iter().map(String::as_str).collect();
    let mut granted = on(&format!("/pool/{pool}"), &pool_privs);
    if pool_audit {
        granted.push((format!("/pool/{pool}"), "Pool.Audit".into()));
    }
    let template_privs = setup_script_array("template_privs");
    let template_privs: Vec<&str> = template_privs.iter().map(String::as_str).collect();
    granted.extend(on("/vms/9000", &template_privs));
    granted.extend(on("/storage/local-lvm", &["Datastore.AllocateSpace"]));
    granted.extend(on("/nodes", &["Sys.Audit"]));
    // PVESDNUser on the default --bridge vmbr0.
    granted.extend(on("/sdn/zones/localnetwork/vmbr0", &["SDN.Use"]));
    SimConfig {
        dropped_privileges: vec![("/".into(), "*".into())],
        granted_privileges: granted,
        ..fast()
    }
}

#[tokio::test]
async fn a_sound_set_up_passes_on_pve8_and_pve9() {
    let sim = sim_with(fast()).await;
    assert_eq!(preflight(&sim, "bigfleet").await, Ok(vec![]));
    sim.shutdown().await;
    // PVE 9 has no VM.Monitor: its guest-agent privileges do the job.
    let sim = sim_with(SimConfig {
        pve9: true,
        ..fast()
    })
    .await;
    assert_eq!(preflight(&sim, "bigfleet").await, Ok(vec![]));
    sim.shutdown().await;
    // The least-privilege token of the setup script, and one without Pool.Audit:
    // without Sys.Audit on / it cannot read user-tag-access, and says so.
    for pool_audit in [true, false] {
        let sim = sim_with(setup_script_token("bigfleet", pool_audit)).await;
        assert_eq!(
            preflight(&sim, "bigfleet").await,
            Ok(vec![UNKNOWN_TAG_ACCESS.to_string()]),
            "{pool_audit}"
        );
        sim.shutdown().await;
    }
}

#[tokio::test]
async fn a_misspelt_pool_is_caught_with_or_without_pool_audit() {
    // An admin token (Pool.Audit): the pool is read and found missing.
    let sim = sim_with(fast()).await;
    let e = preflight(&sim, "bigfleeet")
        .await
        .expect_err("no such pool");
    assert!(
        e.contains("pool \"bigfleeet\" from --proxmox-pool does not exist")
            && e.contains("pveum pool add bigfleeet"),
        "{e}"
    );
    sim.shutdown().await;
    // The setup script's token: its ACLs (Pool.Audit included) are on the
    // real pool only, so nothing is held on the misspelt one.
    let sim = sim_with(setup_script_token("bigfleet", true)).await;
    let e = preflight(&sim, "bigfleeet")
        .await
        .expect_err("no ACL there");
    assert!(
        e.contains("holds no privilege on /pool/bigfleeet")
            && e.contains("does not exist, or the token has no ACL on it")
            && e.contains("pveum acl modify /pool/bigfleeet --tokens 'bigfleet@pve!autoscaler'"),
        "{e}"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn each_missing_privilege_is_named_with_its_path_and_fix() {
    let sim = sim_with(SimConfig {
        dropped_privileges: vec![
            ("/pool/bigfleet".into(), "VM.PowerMgmt".into()),
            ("/pool/bigfleet".into(), "VM.Monitor".into()),
            ("/vms/9000".into(), "VM.Clone".into()),
            (
                "/storage/local-lvm".into(),
                "Datastore.AllocateSpace".into(),
            ),
        ],
        ..fast()
    })
    .await;
    let sub = PveSubstrate::new(client(&sim), opts("bigfleet"));
    let e = sub
        .preflight(&["pve1".into()], &[9000])
        .await
        .expect_err("privileges missing");
    assert_eq!(e.kind(), providerkit::ErrorKind::Refused);
    let e = e.to_string();
    for want in [
        "on /pool/bigfleet: VM.PowerMgmt to start and stop the clones",
        "VM.Monitor (PVE 8) or VM.GuestAgent.Audit or VM.GuestAgent.Unrestricted (PVE 9) to ping the guest agent",
        "on /vms/9000: VM.Clone to clone the template",
        "on /storage/local-lvm: Datastore.AllocateSpace",
        "Fix (PVE 8)",
        "--privs 'VM.PowerMgmt,VM.Monitor'",
        "pveum acl modify /vms/9000 --tokens 'bigfleet@pve!autoscaler'",
        "--users bigfleet@pve",
    ] {
        assert!(e.contains(want), "missing {want:?} in: {e}");
    }
    assert!(
        !e.contains("VM.Audit to"),
        "held privileges are not named: {e}"
    );
    assert!(
        !e.contains(sim.token_secret()),
        "the secret is never shown: {e}"
    );
    sim.shutdown().await;

    // PVE 9: the fix names PVE 9's privilege.
    let sim = sim_with(SimConfig {
        pve9: true,
        dropped_privileges: vec![("/".into(), "VM.GuestAgent.Unrestricted".into())],
        ..fast()
    })
    .await;
    let e = preflight(&sim, "bigfleet")
        .await
        .expect_err("exec not allowed");
    assert!(
        e.contains("to run the bootstrap, readiness and drain commands through the agent")
            && e.contains("Fix (PVE 9)")
            && e.contains("--privs 'VM.GuestAgent.Unrestricted'")
            && !e.contains("ping the guest agent"),
        "{e}"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn a_template_without_the_agent_is_refused() {
    let sim = sim_with(SimConfig {
        templates: vec![TemplateSpec {
            agent: false,
            ..TemplateSpec::local(9000, "pve1")
        }],
        ..fast()
    })
    .await;
    let e = preflight(&sim, "bigfleet").await.expect_err("no agent");
    assert!(
        e.contains("template VMID 9000 on node pve1 has the QEMU guest agent disabled")
            && e.contains("qm set 9000 --agent enabled=1"),
        "{e}"
    );
    sim.shutdown().await;
}

fn req(machine_id: &str) -> CloneRequest {
    common::req(machine_id, "pve1")
}

#[tokio::test]
async fn restricted_tag_access_is_found_at_start_up_and_marks_by_marker_only() {
    let sim = sim_with(SimConfig {
        tag_access: TagAccess::Existing(vec![]),
        ..fast()
    })
    .await;
    let sub = PveSubstrate::new(client(&sim), opts("bigfleet"));
    let warnings = sub
        .preflight(&["pve1".into()], &[9000])
        .await
        .expect("serves");
    assert!(
        warnings.len() == 1
            && warnings[0].contains("user-tag-access")
            && warnings[0].contains("description marker only")
            && warnings[0].contains("Sys.Modify on /"),
        "{warnings:?}"
    );
    let vm = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/001"))
        .await
        .expect("create");
    assert_eq!(sim.vm(vm.vmid).unwrap().tags, None);
    assert_eq!(
        sim.call_count(endpoints::CONFIG_PUT),
        1,
        "marked in one PUT, without a refused attempt with tags first"
    );
    sim.shutdown().await;

    // Sys.Modify on / lifts the restriction: tags as usual.
    let sim = sim_with(SimConfig {
        tag_access: TagAccess::Existing(vec![]),
        granted_privileges: vec![("/".into(), "Sys.Modify".into())],
        ..fast()
    })
    .await;
    let sub = PveSubstrate::new(client(&sim), opts("bigfleet"));
    assert_eq!(
        sub.preflight(&["pve1".into()], &[9000])
            .await
            .expect("serves"),
        Vec::<String>::new()
    );
    let vm = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/002"))
        .await
        .expect("create");
    let tags = sim.vm(vm.vmid).unwrap().tags.unwrap_or_default();
    assert!(tags.contains("bigfleet"), "{tags}");
    sim.shutdown().await;
}

#[tokio::test]
async fn each_way_of_not_reaching_the_api_gets_its_hint() {
    let sim = sim_with(fast()).await;
    let check = |cfg: PveConfig| async move {
        PveSubstrate::new(PveClient::new(cfg).expect("client"), opts("bigfleet"))
            .preflight(&["pve1".into()], &[9000])
            .await
            .expect_err("cannot use the API")
            .to_string()
    };

    let mut bad_secret = config(&sim);
    bad_secret.token_secret = "wrong-secret".into();
    let e = check(bad_secret).await;
    assert!(
        e.contains("the API token was refused (401)") && e.contains("--proxmox-token-id"),
        "{e}"
    );
    assert!(!e.contains("wrong-secret"), "{e}");

    let mut no_api_root = config(&sim);
    no_api_root.api_url = sim.base_url().trim_end_matches("/api2/json").to_string();
    let e = check(no_api_root).await;
    assert!(
        e.contains("--proxmox-api-url must end in /api2/json"),
        "{e}"
    );

    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let mut refused = config(&sim);
    refused.api_url = format!("https://127.0.0.1:{port}/api2/json");
    let e = check(refused).await;
    assert!(
        e.contains("nothing listens at") && e.contains("port 8006"),
        "{e}"
    );

    let other = sim_with(fast()).await;
    let mut wrong_ca = config(&sim);
    wrong_ca.ca_pem = Some(other.ca_pem().as_bytes().to_vec());
    let e = check(wrong_ca).await;
    assert!(
        e.contains("failed verification") && e.contains("--proxmox-ca-file"),
        "{e}"
    );
    let mut wrong_pin = config(&sim);
    wrong_pin.ca_pem = None;
    wrong_pin.fingerprints = vec![[0xAB; 32]];
    let e = check(wrong_pin).await;
    assert!(e.contains("--proxmox-tls-fingerprint"), "{e}");
    other.shutdown().await;
    sim.shutdown().await;
}

/// The preflight's privilege list is what the lifecycle needs: with the
/// setup script's token (which the simulator enforces call by call) a whole
/// lifecycle runs, and without any one of its privileges the preflight
/// refuses to start, naming it.
#[tokio::test]
async fn the_checked_privileges_are_the_ones_the_lifecycle_uses() {
    let sim = sim_with(setup_script_token("bigfleet", false)).await;
    sim.on_guest_command("kubectl drain", pve_sim::GuestOutput::exit(0));
    let sub = PveSubstrate::new(client(&sim), opts("bigfleet"));
    assert_eq!(
        sub.preflight(&["pve1".into()], &[9000])
            .await
            .map_err(|e| e.to_string()),
        Ok(vec![UNKNOWN_TAG_ACCESS.to_string()])
    );
    let id = "p/OnDemand/pve.small/pve1/003";
    let vm = sub.clone_vm(&req(id)).await.expect("create");
    sub.configure(&vm, b"true\n").await.expect("configure");
    sub.drain(&vm, Duration::from_secs(5)).await.expect("drain");
    sub.delete_vm(&vm, id).await.expect("delete");
    assert!(sim.vm(vm.vmid).is_none());
    sim.shutdown().await;

    let base = setup_script_token("bigfleet", false);
    for (path, privilege) in base.granted_privileges.clone() {
        if path == "/nodes"
            || (path.starts_with("/pool/") && privilege == "Datastore.AllocateSpace")
        {
            continue; // not used by the lifecycle on that path
        }
        if privilege == "VM.Config.Disk" {
            // Only a replica migration onto --node-storage uses it (see
            // configurations::moving_a_replicas_disks_needs_vm_config_disk...).
            continue;
        }
        let mut cfg = setup_script_token("bigfleet", false);
        cfg.granted_privileges
            .retain(|g| *g != (path.clone(), privilege.clone()));
        let sim = sim_with(cfg).await;
        if path.starts_with("/sdn/") {
            // A bridge's SDN.Use is warned of, not refused (see
            // a_bridge_the_token_may_not_use_is_named_at_start_up...).
            let warnings = preflight(&sim, "bigfleet").await.expect("a warning");
            assert!(
                warnings
                    .iter()
                    .any(|w| w.contains(&path) && w.contains(&privilege)),
                "{privilege} on {path}: {warnings:?}"
            );
            sim.shutdown().await;
            continue;
        }
        let e = preflight(&sim, "bigfleet")
            .await
            .expect_err(&format!("{privilege} on {path} is needed"));
        assert!(
            e.contains(&format!("on {path}: ")) && e.contains(&privilege),
            "{privilege} on {path}: {e}"
        );
        sim.shutdown().await;
    }
}

#[tokio::test]
async fn the_simulator_refuses_what_the_token_lacks() {
    // Without the preflight, a missing privilege is a 403 naming it.
    let mut cfg = setup_script_token("bigfleet", false);
    cfg.granted_privileges.retain(|(_, p)| p != "VM.PowerMgmt");
    let sim = sim_with(cfg).await;
    let sub = PveSubstrate::new(client(&sim), opts("bigfleet"));
    let e = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/004"))
        .await
        .expect_err("cannot start")
        .to_string();
    assert!(
        e.contains("Permission check failed (/vms/") && e.contains("VM.PowerMgmt)"),
        "{e}"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn a_bridge_the_token_may_not_use_is_named_at_start_up_and_refuses_clones() {
    let mut cfg = setup_script_token("bigfleet", true);
    cfg.granted_privileges
        .retain(|(path, _)| !path.starts_with("/sdn/"));
    let sim = sim_with(cfg).await;
    let warnings = preflight(&sim, "bigfleet")
        .await
        .expect("a warning, not a refusal");
    let w = warnings
        .iter()
        .find(|w| w.contains("SDN.Use"))
        .unwrap_or_else(|| panic!("no SDN.Use warning: {warnings:?}"));
    assert!(
        w.contains("/sdn/zones/localnetwork/vmbr0")
            && w.contains("template 9000")
            && w.contains("pveum acl modify /sdn/zones/localnetwork/vmbr0")
            && w.contains("PVESDNUser"),
        "{w}"
    );
    // The failure it warns of: the simulator refuses the clone as PVE does.
    let sub = PveSubstrate::new(client(&sim), opts("bigfleet"));
    let e = sub
        .clone_vm(&common::req("p/OnDemand/pve.small/pve1/000", "pve1"))
        .await
        .expect_err("a clone without SDN.Use on the bridge");
    assert!(
        e.to_string()
            .contains("Permission check failed (/sdn/zones/localnetwork/vmbr0, SDN.Use)"),
        "{e}"
    );
    sim.shutdown().await;
}
