//! Every second of a lifecycle accounted for, through the built binary on
//! pve-sim: after Create, Configure, Drain and Delete, the Admin service's
//! Timeline lists each step in order with its node, its duration and the
//! PVE task that ran it; `ctl get` shows it as a table and as JSON; the
//! per-step histogram has a series for each; and the PVE request counter
//! adds up to exactly the requests pve-sim answered.

use std::time::Duration;

use bigfleet_proto::admin::admin_client::AdminClient;
use bigfleet_proto::admin::{TimelineRequest, TimelineStep};
use bigfleet_proto::v1alpha1::capacity_provider_client::CapacityProviderClient;
use bigfleet_proto::v1alpha1::{ConfigureRequest, DeleteRequest, DrainRequest, MachineState};
use pve_sim::{PveSim, SimConfig};
use tonic::transport::Channel;
use tonic::Code;

use crate::common::{self, http_get, sim_backend_args, sim_ca_file, wait_state};

const DEADLINE: Duration = Duration::from_secs(30);
const BIN: &str = env!("CARGO_BIN_EXE_bigfleet-proxmox");

/// Requests pve-sim has answered, every endpoint.
fn answered(sim: &PveSim) -> u64 {
    sim.faults().counts().values().sum()
}

/// The sum of the samples of `family` in a text exposition whose labels
/// contain every one of `labels`.
fn sum_of(body: &str, family: &str, labels: &[&str]) -> f64 {
    body.lines()
        .filter(|l| l.starts_with(family) && !l.starts_with('#'))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The provider on `sim` (pve1, one machine seeded, a 50 ms poll, no
/// background pass: it would read PVE between the counts below), with
/// `more` flags; a Create sent for its machine. The CA file's directory
/// (kept while the provider runs), the provider, its client and the id.
async fn creating(
    sim: &PveSim,
    more: &[&str],
) -> (
    tempfile::TempDir,
    common::Provider,
    CapacityProviderClient<Channel>,
    String,
) {
    let (dir, ca) = sim_ca_file(sim);
    let mut flags = vec![
        "--seed-count",
        "1",
        "--proxmox-poll-interval",
        "50ms",
        "--reconcile-interval",
        "0s",
    ];
    flags.extend_from_slice(more);
    let p = common::start_blocking(sim_backend_args(sim, &ca, "pve1", &flags)).await;
    let mut c = p.client().await;
    let id = common::create_speculative(&mut c).await;
    (dir, p, c, id)
}

/// The Admin service's Timeline of `id`.
async fn timeline(admin: &AdminClient<Channel>, id: &str) -> Vec<TimelineStep> {
    admin
        .clone()
        .timeline(TimelineRequest {
            machine_id: id.to_string(),
        })
        .await
        .expect("Timeline")
        .into_inner()
        .steps
}

/// `ctl get <id>` against the provider at `target`, with `more` flags:
/// its standard output, after it succeeded.
fn ctl_get(target: &str, id: &str, more: &[&str]) -> Vec<u8> {
    let out = std::process::Command::new(BIN)
        .args(["ctl", "get", id, "--target", target])
        .args(more)
        .output()
        .expect("ctl get");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    out.stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lifecycle_is_accounted_for_step_by_step() {
    let sim = PveSim::start(SimConfig {
        clone_duration: Duration::from_millis(300),
        agent_boot_delay: Duration::from_millis(100),
        rrd_lag: Duration::ZERO,
        ..SimConfig::default()
    })
    .await
    .expect("simulator");
    let (_dir, p, mut c, id) = creating(
        &sim,
        &["--readiness-command", "true", "--drain-command", "true"],
    )
    .await;
    wait_state(&mut c, &id, MachineState::Idle, DEADLINE).await;
    c.configure(ConfigureRequest {
        machine_id: id.clone(),
        cluster_id: "c1".into(),
        bootstrap_blob: b"#!/bin/sh\ntrue\n".to_vec(),
        ..Default::default()
    })
    .await
    .expect("Configure");
    wait_state(&mut c, &id, MachineState::Configured, DEADLINE).await;
    c.drain(DrainRequest {
        machine_id: id.clone(),
        ..Default::default()
    })
    .await
    .expect("Drain");
    wait_state(&mut c, &id, MachineState::Idle, DEADLINE).await;
    c.delete(DeleteRequest {
        machine_id: id.clone(),
        ..Default::default()
    })
    .await
    .expect("Delete");
    wait_state(&mut c, &id, MachineState::Speculative, DEADLINE).await;

    let mut admin = AdminClient::new(common::plain_channel(p.grpc).await);
    let steps = timeline(&admin, &id).await;
    let names: Vec<&str> = steps.iter().map(|s| s.step.as_str()).collect();
    assert_eq!(
        names,
        [
            "clone_slot",
            "clone",
            "start",
            "agent",
            // Configure and Drain ping nothing first: their first guest
            // command finds the agent (PVE pings it before each command).
            "bootstrap_write",
            "bootstrap_exec",
            "readiness",
            "drain",
            "stop",
            "destroy"
        ],
        "{steps:#?}"
    );
    for s in &steps {
        assert_eq!(s.node, "pve1", "{s:?}");
        assert!(s.error.is_empty(), "{s:?}");
        assert!(s.started_unix_ms > 0, "{s:?}");
        let task = matches!(s.step.as_str(), "clone" | "start" | "stop" | "destroy");
        assert_eq!(
            !s.upid.is_empty(),
            task,
            "a task's UPID, only for a task: {s:?}"
        );
    }
    let clone = &steps[1];
    assert!(clone.upid.starts_with("UPID:pve1:"), "{clone:?}");
    assert!(
        clone.duration_ms >= 300,
        "the clone took the simulator's 300 ms at least: {clone:?}"
    );
    // In order: each started no earlier than the one before.
    assert!(steps
        .windows(2)
        .all(|w| w[0].started_unix_ms <= w[1].started_unix_ms));
    let unknown = admin
        .timeline(TimelineRequest {
            machine_id: "proxmox/OnDemand/pve.small/pve1/999".into(),
        })
        .await
        .expect_err("an unknown machine");
    assert_eq!(unknown.code(), Code::NotFound);

    // `ctl get`: a table below the details, and JSON.
    let target = p.grpc.to_string();
    let out = ctl_get(&target, &id, &[]);
    let table = String::from_utf8_lossy(&out);
    assert!(table.contains("timeline:"), "{table}");
    assert!(
        table
            .lines()
            .any(|l| l.contains(" clone ") && l.contains("UPID:pve1:")),
        "{table}"
    );
    let out = ctl_get(&target, &id, &["--output", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&out).expect("JSON");
    assert_eq!(v["id"], id.as_str());
    assert_eq!(v["timeline"].as_array().map(Vec::len), Some(steps.len()));
    assert_eq!(v["timeline"][1]["step"], "clone");
    assert!(v["timeline"][1]["started"]
        .as_str()
        .is_some_and(|t| t.ends_with('Z')));

    // The metrics: a histogram series per step, and every request to PVE
    // counted once (what pve-sim answered, no more, no less).
    let before = answered(&sim);
    let (status, body) = http_get(p.metrics, "/metrics").expect("scrape");
    let after = answered(&sim);
    assert_eq!(status, 200);
    for step in names {
        let count = sum_of(
            &body,
            "bigfleet_proxmox_step_duration_seconds_count",
            &[&format!("step=\"{step}\""), "node=\"pve1\""],
        );
        assert!(count >= 1.0, "no {step} observation:\n{body}");
    }
    let counted = sum_of(&body, "bigfleet_proxmox_pve_requests_total", &[]) as u64;
    assert!(
        (before..=after).contains(&counted),
        "counted {counted}, pve-sim answered {before}..{after}"
    );
    assert!(
        sum_of(
            &body,
            "bigfleet_proxmox_pve_requests_total",
            &["endpoint=\"clone\"", "outcome=\"success\""]
        ) >= 1.0,
        "{body}"
    );
    drop(c);
    drop(admin);
    drop(p);
    sim.shutdown().await;
}

/// A Create's step under way is in its timeline as it runs, not only
/// once it ends: the Admin service lists the clone as running with its
/// task, its time so far and how far its copy is (read from the task's
/// log, as PVE prints qemu-img's progress), and `ctl get` says so in the
/// table and the JSON; once the machine is IDLE, nothing is shown as under
/// way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_under_way_is_shown_while_it_runs() {
    // Long enough that the reads below, `ctl get` among them, fall inside
    // it: the template's 32 GiB disk copied at 32 GiB per 6 s.
    const CLONE: Duration = Duration::from_secs(6);
    let sim = PveSim::start(SimConfig {
        storage_bandwidth: vec![("local-lvm".into(), (32 << 30) / CLONE.as_secs())],
        agent_boot_delay: Duration::from_millis(100),
        rrd_lag: Duration::ZERO,
        ..SimConfig::default()
    })
    .await
    .expect("simulator");
    let (_dir, p, mut c, id) = creating(&sim, &[]).await;
    let admin = AdminClient::new(common::plain_channel(p.grpc).await);
    let read = || timeline(&admin, &id);
    // Until the clone's task is known (its POST answered) and its copy
    // has begun (after the volume's allocation).
    let deadline = tokio::time::Instant::now() + CLONE;
    let steps = loop {
        let steps = read().await;
        if steps
            .iter()
            .any(|s| s.step == "clone" && !s.upid.is_empty() && s.copied_percent.is_some())
        {
            break steps;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no clone under way: {steps:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let names: Vec<(&str, bool)> = steps.iter().map(|s| (s.step.as_str(), s.running)).collect();
    assert_eq!(
        names,
        [("clone_slot", false), ("clone", true)],
        "{steps:#?}"
    );
    let clone = &steps[1];
    assert!(clone.upid.starts_with("UPID:pve1:"), "{clone:?}");
    assert!(clone.error.is_empty(), "{clone:?}");
    let copied = clone.copied_percent.unwrap_or(-1.0);
    assert!((0.0..100.0).contains(&copied), "{clone:?}");
    // Until the copy has moved on by a whole percent (a line each).
    let later = loop {
        let later = read().await;
        if later[1].copied_percent.is_some_and(|p| p >= copied + 1.0) {
            break later;
        }
        assert!(
            later[1].running && tokio::time::Instant::now() < deadline,
            "the copy does not move on: {clone:?} then {later:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        later[1].running && later[1].duration_ms >= clone.duration_ms,
        "its time so far grows: {clone:?} then {:?}",
        later[1]
    );

    let target = p.grpc.to_string();
    let out = ctl_get(&target, &id, &[]);
    let table = String::from_utf8_lossy(&out);
    assert!(
        table.lines().any(|l| l.contains(" clone ")
            && l.contains("running (so far), ")
            && l.contains(" % copied; UPID:pve1:")),
        "{table}"
    );
    let out = ctl_get(&target, &id, &["--output", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&out).expect("JSON");
    assert_eq!(v["timeline"][1]["step"], "clone");
    assert_eq!(v["timeline"][1]["running"], true, "{v}");
    assert!(v["timeline"][1]["copied_percent"].is_f64(), "{v}");
    assert_eq!(v["timeline"][0].get("running"), None, "{v}");

    wait_state(&mut c, &id, MachineState::Idle, DEADLINE).await;
    let steps = read().await;
    assert!(
        steps
            .iter()
            .all(|s| !s.running && s.copied_percent.is_none()),
        "{steps:#?}"
    );
    let clone = steps.iter().find(|s| s.step == "clone").expect("the clone");
    assert!(
        clone.duration_ms >= CLONE.as_millis() as u64 - 50,
        "ended, with its whole time: {clone:?}"
    );
    drop(c);
    drop(admin);
    drop(p);
    sim.shutdown().await;
}
