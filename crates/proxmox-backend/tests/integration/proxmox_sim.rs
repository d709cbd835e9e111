//! The real Proxmox substrate against the PVE simulator, over verified HTTPS.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use proxmox_backend::proxmox::{parse_marker, vm_name, PveOptions, PveSubstrate};
use proxmox_backend::substrate::{CloneRequest, Substrate, VmRef};
use pve::PveClient;
use pve_sim::{endpoints, GuestOutput, PveSim, SimConfig, TemplateSpec};

use crate::common::{self, assert_no_violations, client, sim_with, total_calls};

const LOCK_MSG: &str = "can't lock file '/var/lock/qemu-server/lock-100.conf' - got timeout";

fn client_with(sim: &PveSim, ca: Option<Vec<u8>>, pins: Vec<[u8; 32]>) -> PveClient {
    let mut cfg = common::config_retrying(
        sim,
        5,
        Duration::from_millis(20),
        Duration::from_millis(200),
    );
    cfg.ca_pem = ca;
    cfg.fingerprints = pins;
    common::client_of(cfg)
}

fn opts() -> PveOptions {
    PveOptions {
        drain_command: proxmox_backend::proxmox::DEFAULT_DRAIN_COMMAND.into(),
        readiness_timeout: Duration::from_secs(10),
        drain_timeout: Duration::from_secs(30),
        ..common::opts_retrying(
            Duration::from_secs(30),
            Duration::from_secs(20),
            Duration::from_millis(500),
        )
    }
}

/// A `pve.small` with 3 vCPU and 3 GiB, so its sizing is seen to be applied.
fn req(machine_id: &str, node: &str) -> CloneRequest {
    CloneRequest {
        vcpu: 3,
        memory_mib: 3072,
        ..common::req(machine_id, node)
    }
}

#[tokio::test]
async fn full_lifecycle() {
    let sim = sim_with(SimConfig::default()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let id = "proxmox/OnDemand/pve.small/pve1/000";
    let vm = sub.clone_vm(&req(id, "pve1")).await.expect("create");
    assert_eq!(vm.node, "pve1");

    let v = sim.vm(vm.vmid).expect("vm exists");
    assert!(v.running, "started");
    assert_eq!((v.cores, v.memory_mib), (3, 3072));
    assert_eq!(v.name, vm_name("pve.small", id));
    assert_eq!(v.pool.as_deref(), Some("bigfleet"));
    let tags = v.tags.clone().unwrap_or_default();
    assert!(
        tags.contains("bigfleet-proxmox-ondemand-pve.small-pve1-000"),
        "{tags}"
    );
    assert_eq!(
        parse_marker(v.description.as_deref().unwrap_or_default()).as_deref(),
        Some(id)
    );

    let managed = sub.describe_managed().await.expect("describe");
    assert_eq!(managed.len(), 1);
    assert_eq!(managed[0].machine_id, id);
    assert_eq!(managed[0].vm, vm);
    assert!(managed[0].running);

    // Configure: the blob is a shell script run by `/bin/sh <path>` in the guest.
    let blob = b"echo configured > \"$BIGFLEET_GUEST_ROOT/run/done\"\n";
    sub.ensure_running(&vm).await.expect("ensure running");
    sub.configure(&vm, blob).await.expect("configure");
    assert_eq!(
        sim.read_guest_file(vm.vmid, "/run/bigfleet-bootstrap")
            .unwrap(),
        blob
    );
    assert_eq!(
        sim.read_guest_file(vm.vmid, "/run/done").unwrap(),
        b"configured\n"
    );
    assert!(!sub.readiness_gate());

    let seen = common::record_commands(&sim, "kubectl drain");
    sub.drain(&vm, Duration::from_secs(30))
        .await
        .expect("drain");
    let cmd = seen.lock().clone();
    assert_eq!(cmd.len(), 1);
    // The node is named explicitly, in BIGFLEET_NODE_NAME, by its VM name.
    let env = format!(
        "/usr/bin/env BIGFLEET_NODE_NAME={} ",
        vm_name("pve.small", id)
    );
    assert!(
        cmd[0].starts_with(&format!(
            "{env}/bin/sh -c kubectl drain \"$BIGFLEET_NODE_NAME\""
        )) && cmd[0].contains("--grace-period=30")
            && cmd[0].contains("--timeout=30s"),
        "{cmd:?}"
    );

    sub.delete_vm(&vm, id).await.expect("delete");
    assert!(sim.vm(vm.vmid).is_none(), "destroyed");
    sub.delete_vm(&vm, id)
        .await
        .expect("already gone is success");
    assert!(sub.describe_managed().await.unwrap().is_empty());
    assert_no_violations(&sim);
    sim.shutdown().await;
}

/// A destroy a dead process left running holds the VM's config lock: the
/// next process's destroy worker waits it out (PVE waits 10 s for the lock),
/// then finds the config gone. The VM is gone, which is what Delete wanted.
#[tokio::test]
async fn delete_while_an_earlier_destroy_runs_succeeds() {
    let sim = sim_with(SimConfig {
        destroy_duration: Duration::from_millis(500),
        lock_wait: Duration::from_secs(10),
        ..SimConfig::default()
    })
    .await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let id = "proxmox/OnDemand/pve.small/pve1/000";
    let vm = sub.clone_vm(&req(id, "pve1")).await.expect("create");
    assert!(sim.stop_vm_out_of_band(vm.vmid));
    client(&sim)
        .destroy(&vm.node, vm.vmid)
        .await
        .expect("the earlier destroy");
    sub.delete_vm(&vm, id)
        .await
        .expect("the VM is gone, whoever destroyed it");
    assert!(sim.vm(vm.vmid).is_none(), "destroyed");
    assert_no_violations(&sim);
    sim.shutdown().await;
}

#[tokio::test]
async fn bootstrap_failure_reports_exit_code_and_stderr() {
    let sim = sim_with(SimConfig::default()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let vm = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/001", "pve1"))
        .await
        .unwrap();
    let e = sub
        .configure(&vm, b"echo 'kubeadm join: token expired' >&2\nexit 3\n")
        .await
        .expect_err("hook exits 3");
    assert!(e.to_string().contains("exited 3"), "{e}");
    assert!(e.to_string().contains("kubeadm join: token expired"), "{e}");
    assert!(
        !e.to_string().contains("exit 3\n"),
        "the blob itself is never quoted: {e}"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn large_blob_is_chunked_and_verified() {
    let sim = sim_with(SimConfig::default()).await;
    let mut o = opts();
    o.bootstrap_exec = vec!["/bin/true".into()];
    let sub = PveSubstrate::new(client(&sim), o);
    let vm = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/002", "pve1"))
        .await
        .unwrap();
    let blob: Vec<u8> = (0..150_000u32).map(|i| (i * 7 % 256) as u8).collect();
    sim.reset_counts();
    sub.configure(&vm, &blob).await.expect("configure");
    assert_eq!(
        sim.read_guest_file(vm.vmid, "/run/bigfleet-bootstrap")
            .unwrap(),
        blob
    );
    // 150 000 bytes = 5 chunks: 5 file-writes, then 1 exec that joins the
    // parts and prints the checksum, and 1 that names the guest, reads its
    // name back and runs the hook.
    assert_eq!(sim.call_count(endpoints::AGENT_FILE_WRITE), 5);
    assert_eq!(sim.call_count(endpoints::AGENT_EXEC), 2);
    for i in 1..5 {
        assert!(
            sim.read_guest_file(vm.vmid, &format!("/run/bigfleet-bootstrap.part{i}"))
                .is_err(),
            "part {i} is removed once joined"
        );
    }
    assert_no_violations(&sim);
    sim.shutdown().await;
}

#[tokio::test]
async fn failing_drain_is_an_error() {
    let sim = sim_with(SimConfig::default()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let vm = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/003", "pve1"))
        .await
        .unwrap();
    sim.on_guest_command(
        "kubectl drain",
        GuestOutput::exit(1).with_stderr("error: cannot evict pod web-0: PDB"),
    );
    let e = sub
        .drain(&vm, Duration::from_secs(5))
        .await
        .expect_err("drain fails");
    assert!(e.to_string().contains("exited 1"), "{e}");
    assert!(e.to_string().contains("cannot evict pod web-0"), "{e}");
    sim.shutdown().await;
}

#[tokio::test]
async fn readiness_gate_runs_the_probe() {
    let sim = sim_with(SimConfig::default()).await;
    let mut o = opts();
    o.readiness_command = "kubectl get node ready-check".into();
    let sub = PveSubstrate::new(client(&sim), o);
    assert!(sub.readiness_gate());
    let vm = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/004", "pve1"))
        .await
        .unwrap();
    let ready = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let r2 = ready.clone();
    sim.add_guest_handler(move |e| {
        e.command_line().contains("ready-check").then(|| {
            GuestOutput::exit(if r2.load(std::sync::atomic::Ordering::SeqCst) {
                0
            } else {
                1
            })
        })
    });
    assert!(!sub.node_ready(&vm).await.unwrap());
    ready.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(sub.node_ready(&vm).await.unwrap());
    sim.shutdown().await;
}

#[tokio::test]
async fn vm_stopped_out_of_band_is_powered_on_before_configure_and_drain() {
    let sim = sim_with(SimConfig::default()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let vm = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/005", "pve1"))
        .await
        .unwrap();
    sim.on_guest_command("kubectl drain", GuestOutput::exit(0));

    assert!(sim.stop_vm_out_of_band(vm.vmid));
    // Without EnsureRunning the agent is unreachable.
    assert!(sub.configure(&vm, b"true\n").await.is_err());
    sub.ensure_running(&vm).await.expect("powered on");
    assert!(sim.vm(vm.vmid).unwrap().running);
    sub.configure(&vm, b"true\n").await.expect("configure");

    assert!(sim.stop_vm_out_of_band(vm.vmid));
    sub.ensure_running(&vm).await.expect("powered on again");
    sub.drain(&vm, Duration::from_secs(1)).await.expect("drain");
    // A stopped-but-marked VM still shows up as ours.
    assert!(sim.stop_vm_out_of_band(vm.vmid));
    let managed = sub.describe_managed().await.unwrap();
    assert_eq!(managed.len(), 1);
    assert!(!managed[0].running);
    sim.shutdown().await;
}

#[tokio::test]
async fn parallel_clones_survive_lock_contention_and_vmid_collisions() {
    let sim = sim_with(SimConfig {
        // Five clone slots per node against a storage that times out above four.
        max_parallel_local_clones: Some(4),
        ..SimConfig::default()
    })
    .await;
    let mut o = opts();
    o.max_parallel_clones = 5;
    // Fixed, so five keep meeting the storage's limit of four.
    o.adaptive_clones = false;
    let sub = Arc::new(PveSubstrate::new(client(&sim), o));
    // Someone else grabs a VMID between our nextid and our clone.
    sim.faults().fail_next(
        endpoints::CLONE,
        1,
        500,
        "VM 100 already exists on node 'pve2'",
    );
    // Config PUTs hit lock timeouts (retried by the client and by the substrate).
    sim.faults()
        .fail_next(endpoints::CONFIG_PUT, 6, 500, LOCK_MSG);

    let mut tasks = Vec::new();
    for i in 0..20 {
        let sub = sub.clone();
        tasks.push(tokio::spawn(async move {
            let id = format!("p/OnDemand/pve.small/pve1/{i:03}");
            let r = sub.clone_vm(&req(&id, "pve1")).await;
            (id, r)
        }));
    }
    let mut vms = BTreeMap::new();
    let mut failures = Vec::new();
    for t in tasks {
        let (id, r) = t.await.unwrap();
        match r {
            Ok(vm) => {
                vms.insert(id, vm);
            }
            Err(e) => failures.push(format!("{id}: {e}")),
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    let distinct: HashSet<u32> = vms.values().map(|v| v.vmid).collect();
    assert_eq!(distinct.len(), 20, "20 distinct VMIDs");
    let all = sim.vms();
    let non_templates: Vec<_> = all.values().filter(|v| !v.template).collect();
    assert_eq!(non_templates.len(), 20, "no orphans: {:?}", all.keys());
    for (id, vm) in &vms {
        let v = &all[&vm.vmid];
        assert_eq!(
            parse_marker(v.description.as_deref().unwrap_or_default()).as_deref(),
            Some(id.as_str())
        );
        assert!(v.running && v.lock.is_none());
    }
    let clone_posts = sim.call_count(endpoints::CLONE);
    println!("20 clones took {clone_posts} clone POSTs");
    assert!(clone_posts >= 21, "the collision forced a second attempt");
    let managed = sub.describe_managed().await.unwrap();
    assert_eq!(managed.len(), 20);
    assert_no_violations(&sim);
    sim.shutdown().await;
}

#[tokio::test]
async fn retried_create_adopts_instead_of_cloning_again() {
    let sim = sim_with(SimConfig::default()).await;
    let id = "p/OnDemand/pve.small/pve1/006";
    let sub = PveSubstrate::new(client(&sim), opts());
    let vm = sub.clone_vm(&req(id, "pve1")).await.unwrap();

    // Same process, ack lost: the retry is answered with the same VM.
    let again = sub.clone_vm(&req(id, "pve1")).await.unwrap();
    assert_eq!(again, vm);

    // After a restart (cold caches) with the VM stopped: adopted and powered on.
    assert!(sim.stop_vm_out_of_band(vm.vmid));
    let fresh = PveSubstrate::new(client(&sim), opts());
    sim.reset_counts();
    let adopted = fresh.clone_vm(&req(id, "pve1")).await.unwrap();
    assert_eq!(adopted, vm);
    assert_eq!(sim.call_count(endpoints::CLONE), 0);
    assert!(sim.vm(vm.vmid).unwrap().running);
    assert_eq!(sim.vms().values().filter(|v| !v.template).count(), 1);

    // A clone interrupted before it was sized and tagged (description only):
    // the retry finishes it rather than cloning a second VM.
    let id2 = "p/OnDemand/pve.small/pve1/007";
    let mut half = sim.new_vm(4242, "pve1", &vm_name("pve.small", id2));
    half.description = Some(pve_sim::marker_description(id2, "op-0"));
    sim.insert_vm(half).unwrap();
    let finished = fresh.clone_vm(&req(id2, "pve1")).await.unwrap();
    assert_eq!(
        finished,
        VmRef {
            node: "pve1".into(),
            vmid: 4242
        }
    );
    let v = sim.vm(4242).unwrap();
    assert!(v.running && v.cores == 3);
    assert!(v.tags.unwrap_or_default().contains("bigfleet"));
    assert_eq!(sim.vms().values().filter(|v| !v.template).count(), 2);
    sim.shutdown().await;
}

#[tokio::test]
async fn cross_node_clone_needs_shared_storage() {
    let sim = sim_with(SimConfig {
        templates: vec![
            TemplateSpec::local(9000, "pve1"),
            TemplateSpec::shared(9001, "pve1"),
        ],
        ..SimConfig::default()
    })
    .await;
    // Without per-node replicas (`--template-replicas=false`).
    let sub = PveSubstrate::new(
        client(&sim),
        PveOptions {
            template_replicas: false,
            ..opts()
        },
    );
    let e = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve2/000", "pve2"))
        .await
        .expect_err("local storage");
    assert!(
        e.to_string().contains("local storage") && e.to_string().contains("shared storage"),
        "{e}"
    );
    let mut r = req("p/OnDemand/pve.small/pve2/001", "pve2");
    r.template_vmid = 9001;
    let vm = sub
        .clone_vm(&r)
        .await
        .expect("shared template clones across");
    assert_eq!(vm.node, "pve2");
    assert_eq!(sim.vm(vm.vmid).unwrap().node, "pve2");
    // The clone was POSTed to the template's node with target=pve2.
    let clones: Vec<_> = sim
        .requests()
        .into_iter()
        .filter(|r| r.endpoint.as_deref() == Some(endpoints::CLONE))
        .collect();
    assert!(clones.iter().all(|r| r.path.contains("/nodes/pve1/")));
    assert_no_violations(&sim);
    sim.shutdown().await;
}

#[tokio::test]
async fn delete_waits_for_ha_stop() {
    let sim = sim_with(SimConfig::default()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let id = "p/OnDemand/pve.small/pve1/008";
    let vm = sub.clone_vm(&req(id, "pve1")).await.unwrap();
    assert!(sim.set_ha(vm.vmid, Some("started")));
    sub.delete_vm(&vm, id).await.expect("delete HA VM");
    assert!(sim.vm(vm.vmid).is_none());
    sim.shutdown().await;
}

#[tokio::test]
async fn unmarked_vms_are_never_touched() {
    let sim = sim_with(SimConfig::default()).await;
    let mut foreign = sim.new_vm(500, "pve1", "database");
    foreign.running = true;
    sim.insert_vm(foreign).unwrap();
    let sub = PveSubstrate::new(client(&sim), opts());
    assert!(sub.describe_managed().await.unwrap().is_empty());
    let vm = VmRef {
        node: "pve1".into(),
        vmid: 500,
    };
    let e = sub.ensure_running(&vm).await.expect_err("refused");
    assert!(e.to_string().contains("marker"), "{e}");
    sub.delete_vm(&vm, "p/OnDemand/pve.small/pve1/000")
        .await
        .expect("not ours: nothing to do");
    assert!(sim.vm(500).unwrap().running, "left alone");
    sim.shutdown().await;
}

#[tokio::test]
async fn api_call_accounting_with_1000_marked_vms() {
    let sim = sim_with(SimConfig {
        clone_duration: Duration::from_millis(40),
        start_duration: Duration::from_millis(10),
        stop_duration: Duration::from_millis(10),
        destroy_duration: Duration::from_millis(10),
        agent_boot_delay: Duration::from_millis(30),
        ..SimConfig::default()
    })
    .await;
    sim.seed_marked_vms(1000).unwrap();
    let mut o = opts();
    o.poll_interval = Duration::from_millis(150);
    let sub = PveSubstrate::new(client(&sim), o);
    sim.on_guest_command("kubectl drain", GuestOutput::exit(0));

    sim.reset_counts();
    assert_eq!(sub.describe_managed().await.unwrap().len(), 1000);
    let cold = total_calls(&sim);

    sim.reset_counts();
    sub.describe_managed().await.unwrap();
    let steady = total_calls(&sim);

    sim.reset_counts();
    let acct = "acct/OnDemand/pve.small/pve1/000";
    let vm = sub.clone_vm(&req(acct, "pve1")).await.unwrap();
    let create = sim.faults().counts();

    sim.reset_counts();
    sub.ensure_running(&vm).await.unwrap();
    sub.configure(&vm, b"true\n").await.unwrap();
    let configure = sim.faults().counts();

    sim.reset_counts();
    sub.ensure_running(&vm).await.unwrap();
    sub.drain(&vm, Duration::from_secs(10)).await.unwrap();
    let drain = sim.faults().counts();

    sim.reset_counts();
    sub.delete_vm(&vm, acct).await.unwrap();
    let delete = sim.faults().counts();

    sim.reset_counts();
    assert_eq!(sub.describe_managed().await.unwrap().len(), 1000);
    let after = total_calls(&sim);

    let sum = |m: &BTreeMap<String, u64>| m.values().sum::<u64>();
    println!("reconcile pass, cold cache (1000 marked VMs): {cold} calls");
    println!("reconcile pass, steady state: {steady} calls");
    println!("Create: {} calls {create:?}", sum(&create));
    println!("Configure: {} calls {configure:?}", sum(&configure));
    println!("Drain: {} calls {drain:?}", sum(&drain));
    println!("Delete: {} calls {delete:?}", sum(&delete));
    println!("reconcile pass after the lifecycle: {after} calls");
    assert!(steady <= 2, "steady reconcile {steady}");
    assert!(after <= 2, "reconcile after lifecycle {after}");
    for (op, m) in [
        ("Configure", &configure),
        ("Drain", &drain),
        ("Delete", &delete),
    ] {
        assert!(sum(m) <= 10, "{op} took {} calls: {m:?}", sum(m));
    }
    // The inventory read is `/nodes` (which nodes are down) and
    // `/cluster/resources`. Besides, the node memory guard reads the node's
    // memory (`/nodes` again) and its VMs once per Create (at admission,
    // here in the clone as nothing admitted it): two more calls, whatever
    // the cluster's size.
    assert_eq!(create.get(endpoints::NODES).copied(), Some(2), "{create:?}");
    assert_eq!(
        create.get(endpoints::NODE_VMS).copied(),
        Some(1),
        "{create:?}"
    );
    let guard_reads = 2;
    // The first Create also lists the template node's storages, once per
    // process: whether the template's storage is shared decides whether
    // its clone slots are the node's or the cluster's.
    assert_eq!(
        create.get(endpoints::NODE_STORAGE).copied(),
        Some(1),
        "{create:?}"
    );
    let once_per_process = 1;
    assert!(
        sum(&create) - guard_reads - once_per_process <= 11,
        "Create took {create:?}"
    );
    // The adoption check is the inventory listing; the one config read is the
    // template's (its disk storage keys the clone bound), once per process.
    assert_eq!(create.get(endpoints::CONFIG_GET).copied().unwrap_or(0), 1);
    sim.shutdown().await;
}

#[tokio::test]
async fn wrong_ca_or_pin_is_refused() {
    let sim = sim_with(SimConfig::default()).await;
    let other = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let wrong_ca = PveSubstrate::new(
        client_with(&sim, Some(other.cert.pem().into_bytes()), vec![]),
        opts(),
    );
    let e = wrong_ca.describe_managed().await.expect_err("wrong CA");
    assert!(e.to_string().contains("TLS"), "{e}");

    let wrong_pin = PveSubstrate::new(client_with(&sim, None, vec![[7u8; 32]]), opts());
    let e = wrong_pin.describe_managed().await.expect_err("wrong pin");
    assert!(e.to_string().contains("TLS"), "{e}");

    let pin = pve::parse_fingerprint(sim.fingerprint()).unwrap();
    let pinned = PveSubstrate::new(client_with(&sim, None, vec![pin]), opts());
    pinned.describe_managed().await.expect("right pin");
    // No request reached the API with bad trust material.
    sim.shutdown().await;
}

#[tokio::test]
async fn unreachable_node_and_lock_timeouts_are_retried() {
    let sim = sim_with(SimConfig::default()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    sim.faults()
        .fail_next(endpoints::RESOURCES, 2, 595, "Connection refused");
    sub.describe_managed().await.expect("595 retried");
    assert_eq!(sim.call_count(endpoints::RESOURCES), 3);

    sim.reset_counts();
    sim.faults().fail_next(endpoints::CLONE, 2, 500, LOCK_MSG);
    sim.faults()
        .fail_next(endpoints::CONFIG_PUT, 2, 500, LOCK_MSG);
    sim.faults().fail_next(
        endpoints::AGENT_PING,
        2,
        500,
        "QEMU guest agent is not running",
    );
    let vm = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/009", "pve1"))
        .await
        .expect("create despite lock timeouts");
    assert_eq!(sim.call_count(endpoints::CLONE), 3);
    assert_eq!(sim.call_count(endpoints::CONFIG_PUT), 3);
    assert!(sim.vm(vm.vmid).unwrap().running);
    sim.shutdown().await;
}

#[tokio::test]
async fn lost_clone_answer_then_retry_gives_one_vm() {
    let sim = sim_with(SimConfig::default()).await;
    let mut cfg = common::config(&sim);
    cfg.request_timeout = Duration::from_millis(700);
    let o = PveOptions {
        retry_window: Duration::from_secs(3),
        ..opts()
    };
    let sub = PveSubstrate::new(PveClient::new(cfg).unwrap(), o);
    let id = "p/OnDemand/pve.small/pve1/010";
    // The clone POST outlives the client's request timeout: its answer is lost.
    sim.faults()
        .set_latency(endpoints::CLONE, Duration::from_millis(1200));
    let sim_logs = provider_testkit::logs::capture();
    let e = sub
        .clone_vm(&req(id, "pve1"))
        .await
        .expect_err("answer lost");
    assert!(e.to_string().contains("timed out"), "{e}");
    sim.faults().set_latency(endpoints::CLONE, Duration::ZERO);
    // The client gave up on each of those POSTs by dropping its connection
    // mid-request, which the simulator logs once it sees it; after that the
    // POST has been carried out or never will be. Retry only then, so that
    // a lost clone cannot land behind the retry.
    let lost = sim.call_count(endpoints::CLONE) as usize;
    sim_logs
        .wait_for(
            "pve_sim::server",
            "connection ended with error",
            lost,
            Duration::from_secs(10),
        )
        .await;
    let vm = sub.clone_vm(&req(id, "pve1")).await.expect("retry");
    let ours: Vec<_> = sim.vms().into_values().filter(|v| !v.template).collect();
    assert_eq!(ours.len(), 1, "exactly one VM: {ours:?}");
    assert_eq!(ours[0].vmid, vm.vmid);
    assert!(ours[0].running);
    println!(
        "lost answer: clone POSTs {}, adopted the first clone: {}",
        sim.call_count(endpoints::CLONE),
        sim.call_count(endpoints::CLONE) == 1
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn lost_exit_status_is_an_error_not_a_success() {
    let sim = sim_with(SimConfig::default()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let vm = sub
        .clone_vm(&req("p/OnDemand/pve.small/pve1/011", "pve1"))
        .await
        .unwrap();
    sim.faults().drop_exec_status_replies(1);
    let e = sub
        .configure(&vm, b"true\n")
        .await
        .expect_err("exit status lost");
    assert!(e.to_string().contains("exit status of guest pid"), "{e}");
    sim.shutdown().await;
}

#[tokio::test]
async fn preflight_checks_nodes_and_templates() {
    let sim = sim_with(SimConfig::default()).await;
    let sub = PveSubstrate::new(client(&sim), opts());
    let ok = sub
        .preflight(&["pve1".into(), "pve2".into()], &[9000])
        .await
        .expect("preflight");
    assert!(ok.is_empty(), "{ok:?}");
    let e = sub
        .preflight(&["pve9".into()], &[9000])
        .await
        .expect_err("unknown node");
    assert!(
        e.to_string().contains("\"pve9\"") && e.to_string().contains("pve1"),
        "{e}"
    );
    let e = sub
        .preflight(&["pve1".into()], &[9999])
        .await
        .expect_err("unknown template");
    assert!(e.to_string().contains("9999"), "{e}");
    let mut bad = common::config(&sim);
    bad.token_secret = "wrong-secret".into();
    let sub = PveSubstrate::new(PveClient::new(bad).unwrap(), opts());
    let e = sub
        .preflight(&["pve1".into()], &[9000])
        .await
        .expect_err("401");
    assert!(e.to_string().contains("401"), "{e}");
    assert_eq!(e.kind(), providerkit::ErrorKind::Refused, "{e}");
    sim.shutdown().await;
}

#[tokio::test]
async fn lifecycle_through_the_backend() {
    use providerkit::{Backend, ConfigureCtx, CreateCtx, DeleteCtx, DrainCtx};

    let sim = sim_with(SimConfig::default()).await;
    sim.on_guest_command("kubectl drain", GuestOutput::exit(0));
    let (backend, _) = common::small_backend(
        "proxmox",
        "pve1",
        2,
        &["pve1", "pve2"],
        PveSubstrate::new(client(&sim), opts()),
    );

    let specs = backend.describe().await.unwrap();
    assert_eq!(specs.len(), 2);
    assert!(specs.iter().all(|s| s.host.is_none()));
    let machine_id = specs[0].id.clone();

    let host = backend
        .create(CreateCtx {
            machine_id: machine_id.clone(),
            operation_id: "op-c".into(),
            instance_type: "pve.small".into(),
            zone: "pve1".into(),
            resumed: false,
        })
        .await
        .expect("create");
    let vm = VmRef::parse(&host.host_ref).unwrap();
    let specs = backend.describe().await.unwrap();
    let bound = specs.iter().find(|s| s.id == machine_id).unwrap();
    assert_eq!(
        bound.host.as_ref().map(|h| h.host_ref.clone()),
        Some(host.host_ref.clone())
    );

    assert!(sim.stop_vm_out_of_band(vm.vmid));
    backend
        .configure(&ConfigureCtx {
            machine_id: machine_id.clone(),
            operation_id: "op-cfg".into(),
            host_ref: host.host_ref.clone(),
            cluster_id: "c1".into(),
            bootstrap_blob: b"echo ok > \"$BIGFLEET_GUEST_ROOT/run/ok\"\n"
                .to_vec()
                .into(),
            shard_metadata: Default::default(),
        })
        .await
        .expect("configure powers the VM on first");
    assert_eq!(sim.read_guest_file(vm.vmid, "/run/ok").unwrap(), b"ok\n");

    assert!(sim.stop_vm_out_of_band(vm.vmid));
    backend
        .drain(DrainCtx {
            machine_id: machine_id.clone(),
            operation_id: "op-d".into(),
            host_ref: host.host_ref.clone(),
            cluster_id: "c1".into(),
            grace_period: Duration::from_secs(5),
        })
        .await
        .expect("drain powers the VM on first");
    assert!(sim.vm(vm.vmid).unwrap().running);

    backend
        .delete(DeleteCtx {
            machine_id: machine_id.clone(),
            operation_id: "op-x".into(),
            host_ref: host.host_ref.clone(),
        })
        .await
        .expect("delete");
    assert!(sim.vm(vm.vmid).is_none());
    let specs = backend.describe().await.unwrap();
    assert!(specs.iter().all(|s| s.host.is_none()));
    assert_no_violations(&sim);
    sim.shutdown().await;
}
