//! The simulator's dialect checked by code nobody here wrote: starts pve-sim
//! (HTTPS with its own CA) and runs `proxmoxer_lifecycle.py`, which drives it
//! with proxmoxer through every lifecycle endpoint. Without proxmoxer the test
//! is skipped with a printed reason, except under `CI=true`, where it fails.

use std::path::Path;
use std::time::Duration;

use provider_testkit::host::or_skip;
use pve_sim::{HttpServerVersion, PveSim, SimConfig, TemplateSpec};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/proxmoxer_lifecycle.py");

/// `Ok(())` when python3 can import proxmoxer, else why not.
fn proxmoxer_available() -> Result<(), String> {
    let out = std::process::Command::new("python3")
        .args(["-c", "import proxmoxer, requests"])
        .output()
        .map_err(|e| format!("cannot run python3: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "python3 cannot import proxmoxer/requests ({}); install with \
             `python3 -m pip install proxmoxer requests`",
            // The traceback's last line names the missing module.
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("no output")
                .trim()
        ))
    }
}

fn skip_or_fail() -> bool {
    or_skip(proxmoxer_available()).is_none()
}

async fn run_script(cfg: SimConfig, reason_only: bool) {
    let sim = PveSim::start(cfg).await.expect("simulator starts");
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = dir.path().join("ca.pem");
    sim.write_ca(&ca).expect("write CA");
    let (user, token_name) = sim.token_id().split_once('!').expect("USER@REALM!TOKEN");
    let nodes = sim.config().nodes.join(",");
    let template = sim.config().templates[0].vmid.to_string();
    let child = tokio::process::Command::new("python3")
        .arg(Path::new(SCRIPT))
        .env("PVE_HOST", sim.addr().ip().to_string())
        .env("PVE_PORT", sim.addr().port().to_string())
        .env("PVE_USER", user)
        .env("PVE_TOKEN_NAME", token_name)
        .env("PVE_TOKEN_VALUE", sim.token_secret())
        .env("PVE_CA", &ca)
        .env("PVE_TEMPLATE", template)
        .env("PVE_NODES", nodes)
        .env("PVE_REASON_ONLY", if reason_only { "1" } else { "0" })
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(180), child)
        .await
        .expect("proxmoxer script finished within 180 s")
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "proxmoxer script failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(stdout.contains("steps OK"), "{stdout}");
    // Everything proxmoxer sent matched an endpoint and its parameters, but
    // for the one deliberately invalid request (`memory=1`).
    let bad = sim.schema_violations();
    assert!(
        bad.len() == 1 && bad[0].params.get("memory") == Some("1"),
        "requests outside the API description: {bad:?}"
    );
    sim.shutdown().await;
}

fn cfg() -> SimConfig {
    SimConfig {
        templates: vec![TemplateSpec::local(9000, "pve1")],
        clone_duration: Duration::from_millis(100),
        agent_boot_delay: Duration::from_millis(200),
        migrate_duration: Duration::from_millis(100),
        // One SDN VNet, listed by GET /cluster/sdn/vnets.
        sdn_vnets: vec![("vnet1".into(), "zone1".into())],
        ..SimConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxmoxer_drives_a_full_lifecycle() {
    if skip_or_fail() {
        return;
    }
    run_script(cfg(), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxmoxer_reads_reason_phrase_only_errors() {
    if skip_or_fail() {
        return;
    }
    let cfg = SimConfig {
        http_server_version: HttpServerVersion(5, 1, 0),
        ..cfg()
    };
    run_script(cfg, true).await;
}
