//! What a transition tells the operator, through the real substrate and
//! pve-sim's guest agent: the readiness timeout's last probe (redacted),
//! and the drain command's arguments.

use std::sync::Arc;
use std::time::Duration;

use proxmox_backend::proxmox::{PveOptions, PveSubstrate};
use proxmox_backend::substrate::{Substrate, VmRef};
use pve::PveClient;
use pve_sim::{GuestOutput, PveSim, SimConfig};

use crate::common;

const SECRET: &str = "abcdefgh-SECRETTOKEN-12345";

/// A client with the default timeouts and retries.
fn client(sim: &PveSim) -> PveClient {
    common::client_of(common::config(sim))
}

fn opts() -> PveOptions {
    PveOptions {
        readiness_command: "kubectl get node ready-check".into(),
        readiness_timeout: Duration::from_secs(10),
        drain_timeout: Duration::from_secs(30),
        retry_window: Duration::from_secs(10),
        ..common::opts(Duration::from_secs(20))
    }
}

async fn vm(sim: &PveSim, sub: &PveSubstrate, index: u32) -> VmRef {
    sub.clone_vm(&common::req(
        &format!("p/OnDemand/pve.small/pve1/{index:03}"),
        "pve1",
    ))
    .await
    .unwrap_or_else(|e| panic!("create on {}: {e}", sim.base_url()))
}

fn fast() -> SimConfig {
    common::fast_sim(Duration::from_millis(100), Duration::from_millis(50))
}

#[tokio::test]
async fn a_readiness_timeout_quotes_the_last_probe_with_the_blob_redacted() {
    let sim = PveSim::start(fast()).await.expect("simulator");
    let sub = PveSubstrate::new(client(&sim), opts());
    let vm = vm(&sim, &sub, 1).await;
    // The probe echoes a secret the bootstrap carried (a join token).
    sim.on_guest_command(
        "ready-check",
        GuestOutput::exit(4).with_stderr(format!("node not ready; token {SECRET} rejected\n")),
    );
    let blob = format!("# join token {SECRET}\ntrue\n");
    sub.configure(&vm, blob.as_bytes())
        .await
        .expect("bootstrap");
    assert_eq!(sub.readiness_detail(&vm), None, "no probe ran yet");
    sub.configure(&vm, blob.as_bytes())
        .await
        .expect("bootstrap");
    for _ in 0..3 {
        assert!(!sub.node_ready(&vm).await.expect("probe runs"));
    }
    let detail = sub.readiness_detail(&vm).expect("the last probe is kept");
    assert!(
        detail.contains("attempt 3")
            && detail.contains("the readiness command exited 4")
            && detail.contains("stderr: node not ready; token [redacted] rejected"),
        "{detail}"
    );
    assert!(!detail.contains(SECRET), "{detail}");
    assert_eq!(sub.readiness_detail(&vm), None, "taken once");
    sim.shutdown().await;
}

#[tokio::test]
async fn a_drain_without_grace_leaves_the_pods_own_grace() {
    let sim = PveSim::start(fast()).await.expect("simulator");
    let sub = PveSubstrate::new(client(&sim), opts());
    let vm = vm(&sim, &sub, 2).await;
    let seen = common::record_commands(&sim, "kubectl drain");
    sub.drain(&vm, Duration::ZERO).await.expect("drain");
    sub.drain(&vm, Duration::from_secs(45))
        .await
        .expect("drain");
    let cmds = seen.lock().clone();
    assert_eq!(cmds.len(), 2, "{cmds:?}");
    assert!(
        cmds[0].ends_with("--delete-emptydir-data --timeout=30s")
            && !cmds[0].contains("--grace-period"),
        "grace 0 (unset) appends no --grace-period: {cmds:?}"
    );
    assert!(
        cmds[1].ends_with("--delete-emptydir-data --grace-period=45 --timeout=30s"),
        "{cmds:?}"
    );
    sim.shutdown().await;
}

/// The whole path: the engine's Configure deadline passes in the readiness
/// gate, and `last_error` quotes the last probe of the real backend, the
/// join token cut out.
#[tokio::test]
async fn the_engine_quotes_the_last_probe_in_last_error() {
    use provider_testkit::engine::wait_for_state;
    use providerkit::{Engine, EngineOptions, MemoryStore, State, Timeouts, Token};

    let sim = PveSim::start(fast()).await.expect("simulator");
    sim.on_guest_command(
        "ready-check",
        GuestOutput::exit(1).with_stderr(format!("Unauthorized: bootstrap token {SECRET}\n")),
    );
    let (backend, ids) = common::small_backend(
        "p",
        "pve1",
        1,
        &["pve1"],
        PveSubstrate::new(client(&sim), opts()),
    );
    let id = ids[0].clone();
    let backend = Arc::new(backend);
    let engine = Engine::start(
        backend,
        Arc::new(MemoryStore::new()),
        EngineOptions {
            timeouts: Timeouts {
                create: Duration::from_secs(20),
                configure: Duration::from_secs(3),
                drain: Duration::from_secs(20),
                delete: Duration::from_secs(20),
                readiness_poll: Duration::from_millis(100),
            },
            ..EngineOptions::default()
        },
    )
    .await
    .expect("engine");
    engine.create(&id, Token::absent()).await.expect("create");
    wait_for_state(&engine, &id, State::Idle).await;
    engine
        .configure(
            &id,
            Token::absent(),
            "c1".into(),
            format!("# join with {SECRET}\ntrue\n").into_bytes(),
            Default::default(),
        )
        .await
        .expect("configure accepted");
    let failed = wait_for_state(&engine, &id, State::Failed).await;
    let e = failed.last_error;
    assert!(
        e.starts_with("Configure timed out after 3s (deadline exceeded) waiting for the node to become ready; last readiness probe (attempt ")
            && e.contains("the readiness command exited 1: stderr: Unauthorized: bootstrap token [redacted]"),
        "{e}"
    );
    assert!(!e.contains(SECRET), "{e}");
    sim.shutdown().await;
}
