//! What a transition tells the operator, through the real substrate and
//! pve-sim's guest agent: the readiness timeout's last probe (redacted),
//! and the drain command's arguments.

use std::sync::Arc;
use std::time::Duration;

use proxmox_backend::proxmox::{PveOptions, PveSubstrate};
use proxmox_backend::substrate::{CloneRequest, Substrate, VmRef};
use pve::{PveClient, PveConfig};
use pve_sim::{GuestOutput, PveSim, SimConfig};

const SECRET: &str = "abcdefgh-SECRETTOKEN-12345";

fn client(sim: &PveSim) -> PveClient {
    let mut cfg = PveConfig::new(sim.base_url(), sim.token_id(), sim.token_secret());
    cfg.ca_pem = Some(sim.ca_pem().as_bytes().to_vec());
    PveClient::new(cfg).expect("client")
}

fn opts() -> PveOptions {
    PveOptions {
        pool: Some("bigfleet".into()),
        readiness_command: "kubectl get node ready-check".into(),
        task_timeout: Duration::from_secs(20),
        agent_timeout: Duration::from_secs(20),
        exec_timeout: Duration::from_secs(20),
        readiness_timeout: Duration::from_secs(10),
        drain_timeout: Duration::from_secs(30),
        poll_interval: Duration::from_millis(50),
        retry_window: Duration::from_secs(10),
        ..PveOptions::default()
    }
}

async fn vm(sim: &PveSim, sub: &PveSubstrate, index: u32) -> VmRef {
    sub.clone_vm(&CloneRequest {
        machine_id: format!("p/OnDemand/pve.small/pve1/{index:03}"),
        operation_id: "op-1".into(),
        instance_type: "pve.small".into(),
        node: "pve1".into(),
        template_vmid: 9000,
        vcpu: 2,
        memory_mib: 2048,
    })
    .await
    .unwrap_or_else(|e| panic!("create on {}: {e}", sim.base_url()))
}

fn fast() -> SimConfig {
    SimConfig {
        clone_duration: Duration::from_millis(100),
        agent_boot_delay: Duration::from_millis(50),
        rrd_lag: Duration::ZERO,
        ..SimConfig::default()
    }
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
    let seen = Arc::new(parking_lot::Mutex::new(Vec::<String>::new()));
    let seen2 = seen.clone();
    sim.add_guest_handler(move |e| {
        let line = e.command_line();
        line.contains("kubectl drain").then(|| {
            seen2.lock().push(line.clone());
            GuestOutput::exit(0)
        })
    });
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
    use std::collections::BTreeMap;

    use providerkit::{Engine, EngineOptions, MemoryStore, State, Timeouts, Token};
    use proxmox_backend::backend::ProxmoxBackend;
    use proxmox_backend::catalog::{expand_slots, InstanceType, Offering, Pricing};

    let sim = PveSim::start(fast()).await.expect("simulator");
    sim.on_guest_command(
        "ready-check",
        GuestOutput::exit(1).with_stderr(format!("Unauthorized: bootstrap token {SECRET}\n")),
    );
    let types = BTreeMap::from([(
        "pve.small".to_string(),
        InstanceType {
            vcpu: 2,
            memory_mib: 2048,
            template_vmid: 9000,
            storage: None,
        },
    )]);
    let pricing = Pricing {
        explicit: Default::default(),
        per_vcpu_hour: 0.003,
        per_gib_hour: 0.0008,
    };
    let offerings = vec![Offering {
        instance_type: "pve.small".into(),
        zone: "pve1".into(),
        capacity_type: String::new(),
        count: 1,
        resources: Default::default(),
        labels: Default::default(),
    }];
    let slots = expand_slots(
        "p",
        &offerings,
        &types,
        Some(&["pve1".to_string()]),
        &pricing,
    )
    .expect("slots");
    let id = slots[0].id.clone();
    let sub = Arc::new(PveSubstrate::new(client(&sim), opts()));
    let backend = Arc::new(ProxmoxBackend::new(slots, types, pricing, sub));
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
    let until = |want: State| {
        let engine = engine.clone();
        let id = id.clone();
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            loop {
                let m = engine.get(&id).expect("machine");
                if m.state == want.to_wire() as i32 {
                    return m;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "never {want}: {m:?}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    engine.create(&id, Token::absent()).await.expect("create");
    until(State::Idle).await;
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
    let failed = until(State::Failed).await;
    let e = failed.last_error;
    assert!(
        e.starts_with("Configure timed out after 3s (deadline exceeded) waiting for the node to become ready; last readiness probe (attempt ")
            && e.contains("the readiness command exited 1: stderr: Unauthorized: bootstrap token [redacted]"),
        "{e}"
    );
    assert!(!e.contains(SECRET), "{e}");
    sim.shutdown().await;
}
