//! kill -9 campaign against the REAL Proxmox backend: the binary drives the
//! PVE simulator over its HTTP API with `--state`, takes a mixed
//! Create/Configure/Drain/Delete/Reclaim workload from several clients, and is
//! SIGKILLed at a random moment, round after round. After every restart (and
//! once the simulator's tasks have settled and a reconcile has run) these
//! must hold:
//!
//! - every marked VM is the host of the machine its marker names (0 orphans);
//! - no machine has two marked VMs (0 duplicates);
//! - no machine's host points at a VM that does not exist;
//! - no machine is left in a transitional state;
//! - nothing acknowledged is lost: an acked transition is completed or FAILED
//!   with a last_error, a state read back is never reverted;
//! - every IDLE or CONFIGURED machine of the sized type (`pve.small`, its
//!   boot disk grown to 48 GiB) has a VM of that size: a kill between the
//!   clone and its resize is made good by the resumed Create.
//!
//! At the end every FAILED machine is reclaimed: 0 FAILED machines and 0 VMs
//! marked for the reclaimed ones must remain.
//!
//! `BIGFLEET_CRASH_REAL_ITERATIONS` (default 5) sets the number of kills
//! (`make crash-real` runs 300); `BIGFLEET_CRASH_SEED` replays a run's
//! decisions and kill delays.

// The integration binary's helpers; this campaign, a binary of its own
// (`make crash-real` runs it by name), uses a few.
#[allow(dead_code)]
#[path = "integration/common.rs"]
mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bigfleet_proto::admin::admin_client::AdminClient;
use bigfleet_proto::admin::{ReclaimRequest, ReclaimStatus};
use bigfleet_proto::v1alpha1 as pb;
use common::{marked, path_str, sim_backend_args, sim_ca_file, sim_settled, start_blocking};
use parking_lot::Mutex;
use pb::capacity_provider_client::CapacityProviderClient;
use pb::MachineState as S;
use provider_testkit::wait::Wait;
use pve_sim::{GuestAgentMode, PveSim, SimConfig, TemplateSpec};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tonic::transport::Channel;
use tonic::Code;

/// `--seed-count`: slots in all.
const SLOTS: usize = 12;
const CLIENTS: usize = 4;
/// Workload time before the kill, in milliseconds.
const KILL_WINDOW_MS: std::ops::RangeInclusive<u64> = 30..=900;
/// How long a client waits for a transition to land before the kill stops
/// it (the kill comes within KILL_WINDOW_MS; this is only a bound).
const LANDING: Duration = Duration::from_secs(120);
/// How long the simulator's tasks and a reconcile get to settle the world.
const SETTLE: Duration = Duration::from_secs(30);

type Client = CapacityProviderClient<Channel>;

/// What a client knows about one of its machines.
#[derive(Clone, Debug, PartialEq)]
enum Known {
    /// Read back (or landed and read back): a crash must not revert it.
    Stable(S),
    /// Sent, outcome unknown (the kill came first): `from` or anything the
    /// transition may lead to.
    InFlight { from: S, to: S },
    /// Acknowledged: completed (`to`), or FAILED with a last_error.
    Acked { to: S },
}

struct Model {
    machines: Mutex<BTreeMap<String, Known>>,
}

#[derive(Default, Debug)]
struct Figures {
    kills: usize,
    acked: usize,
    completed: usize,
    failed_seen: usize,
    reclaimed: usize,
    orphans: usize,
    duplicates: usize,
    missing: usize,
    stuck: usize,
    lost: usize,
    wrong_disk_size: usize,
    /// Machines newly FAILED after a restart, by the reason's kind.
    failed_by_reason: BTreeMap<&'static str, usize>,
    /// Transitions the restarted processes found in flight, by outcome
    /// (`bigfleet_proxmox_resumed_total`, summed over transitions).
    resumed: BTreeMap<String, u64>,
}

/// What kind of failure a `last_error` reports, for the campaign's figures.
fn failure_reason(last_error: &str) -> &'static str {
    if last_error.contains("interrupted by a provider restart while CONFIGURING") {
        // No readiness command here: whether the node joined is unknowable.
        "configure_interrupted"
    } else if last_error.contains("interrupted by a provider restart") {
        "interrupted_by_restart"
    } else if last_error.contains("while the provider was restarting") {
        "deadline_passed_during_restart"
    } else if last_error.contains("timed out") {
        "timed_out"
    } else {
        "substrate_error"
    }
}

/// `bigfleet_proxmox_resumed_total` of one process, summed per outcome.
fn resumed_by_outcome(metrics: std::net::SocketAddr) -> BTreeMap<String, u64> {
    let (status, body) = common::http_get(metrics, "/metrics").expect("scrape /metrics");
    assert_eq!(status, 200, "/metrics answered {status}");
    let mut out = BTreeMap::new();
    for line in body.lines() {
        let Some(rest) = line.strip_prefix("bigfleet_proxmox_resumed_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let outcome = labels
            .split(',')
            .find_map(|l| l.strip_prefix("outcome=\""))
            .map(|o| o.trim_end_matches('"').to_owned())
            .unwrap_or_default();
        let n: u64 = value.trim().parse().unwrap_or(0);
        *out.entry(outcome).or_default() += n;
    }
    out
}

fn iterations() -> usize {
    std::env::var("BIGFLEET_CRASH_REAL_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5)
}

fn seed() -> u64 {
    std::env::var("BIGFLEET_CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(rand::random)
}

fn state(m: &pb::Machine) -> S {
    S::try_from(m.state).unwrap_or(S::Unspecified)
}

/// The transition a client sends from a stable state, if any.
fn next(from: S, rng: &mut StdRng) -> Option<(&'static str, S)> {
    match from {
        S::Speculative => Some(("Create", S::Idle)),
        S::Idle if rng.random_bool(0.6) => Some(("Configure", S::Configured)),
        S::Idle => Some(("Delete", S::Speculative)),
        S::Configured => Some(("Drain", S::Idle)),
        S::Failed => Some(("Reclaim", S::Speculative)),
        _ => None,
    }
}

/// A definite refusal: the request changed nothing.
fn refused(code: Code) -> bool {
    matches!(
        code,
        Code::Aborted | Code::InvalidArgument | Code::NotFound | Code::FailedPrecondition
    )
}

async fn send(
    c: &mut Client,
    admin: &mut AdminClient<Channel>,
    rpc: &str,
    id: &str,
) -> Result<(), tonic::Status> {
    let id = id.to_string();
    match rpc {
        "Create" => c
            .create(pb::CreateRequest {
                machine_id: id,
                ..Default::default()
            })
            .await
            .map(drop),
        "Configure" => c
            .configure(pb::ConfigureRequest {
                machine_id: id,
                cluster_id: "crash-real".into(),
                bootstrap_blob: b"join".to_vec(),
                shard_metadata: HashMap::from([("k".into(), "v".into())]),
                ..Default::default()
            })
            .await
            .map(drop),
        "Drain" => c
            .drain(pb::DrainRequest {
                machine_id: id,
                grace_period_seconds: 0,
                ..Default::default()
            })
            .await
            .map(drop),
        "Delete" => c
            .delete(pb::DeleteRequest {
                machine_id: id,
                ..Default::default()
            })
            .await
            .map(drop),
        "Reclaim" => admin
            .reclaim(ReclaimRequest {
                machine_id: id,
                wait: true,
            })
            .await
            .map(drop),
        other => unreachable!("no RPC {other}"),
    }
}

/// One client: drives its machines one request at a time until `stop`.
async fn client_loop(
    addr: std::net::SocketAddr,
    ids: Vec<String>,
    model: Arc<Model>,
    stop: Arc<AtomicBool>,
    mut rng: StdRng,
    acked: Arc<Mutex<(usize, usize)>>,
) {
    let Ok(channel) = Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await
    else {
        return;
    };
    let mut c = Client::new(channel.clone());
    let mut admin = AdminClient::new(channel);
    while !stop.load(Ordering::SeqCst) {
        let id = &ids[rng.random_range(0..ids.len())];
        let Some(Known::Stable(from)) = model.machines.lock().get(id).cloned() else {
            continue;
        };
        let Some((rpc, to)) = next(from, &mut rng) else {
            continue;
        };
        model
            .machines
            .lock()
            .insert(id.clone(), Known::InFlight { from, to });
        match send(&mut c, &mut admin, rpc, id).await {
            Ok(()) => {
                model
                    .machines
                    .lock()
                    .insert(id.clone(), Known::Acked { to });
                acked.lock().0 += 1;
            }
            Err(s) if refused(s.code()) => {
                model
                    .machines
                    .lock()
                    .insert(id.clone(), Known::Stable(from));
                continue;
            }
            Err(_) => return, // the kill: the outcome stays unknown
        }
        // Wait for the landing, reading back as we go, or for the kill
        // (within KILL_WINDOW_MS): then the outcome stays unknown.
        let landed = Wait::new(format!("{id} to land or the kill"), LANDING)
            .every(Duration::from_millis(20))
            .ok_async(|| {
                let (mut c, id, stop) = (c.clone(), id.clone(), &stop);
                async move {
                    if stop.load(Ordering::SeqCst) {
                        return Ok(None);
                    }
                    let Ok(m) = c
                        .get(pb::MachineRef { id })
                        .await
                        .map(tonic::Response::into_inner)
                    else {
                        return Ok(None);
                    };
                    let s = state(&m);
                    if s == to || s == S::Failed {
                        Ok(Some(s))
                    } else {
                        Err(s)
                    }
                }
            })
            .await;
        let Some(s) = landed else { return };
        model.machines.lock().insert(id.clone(), Known::Stable(s));
        acked.lock().1 += 1;
    }
}

/// Whether a state after restart agrees with what was known before the kill.
fn consistent(known: &Known, m: &pb::Machine) -> bool {
    let s = state(m);
    let failed_with_reason = s == S::Failed && !m.last_error.is_empty();
    match known {
        Known::Stable(k) => s == *k,
        Known::Acked { to } => s == *to || failed_with_reason,
        // A reclaim in flight leaves FAILED or SPECULATIVE; a transition in
        // flight leaves its start, its target, or FAILED.
        Known::InFlight { from, to } => s == *from || s == *to || failed_with_reason,
    }
}

/// The catalog of the campaign: `pve.small` sizes its boot disk (the
/// template's 32 GiB grown to [`SIZED_DISK_GIB`]), so kills land during
/// resizes too; `pve.medium` keeps the template's disk.
const INSTANCE_TYPES: &str = r#"{
  "pve.small":  {"vcpu": 2, "memory_mib": 4096, "disk_gib": 48},
  "pve.medium": {"vcpu": 4, "memory_mib": 8192}
}"#;
const SIZED_DISK_GIB: u64 = 48;

fn provider_args(sim: &PveSim, ca: &Path, state: &str, types: &str, slots: usize) -> Vec<String> {
    let slots = slots.to_string();
    sim_backend_args(
        sim,
        ca,
        "pve1,pve2",
        &[
            "--instance-types",
            types,
            "--seed-count",
            &slots,
            "--proxmox-poll-interval",
            "20ms",
            "--max-parallel-clones",
            "16",
            "--readiness-command=",
            "--bootstrap-exec=/bin/true",
            "--drain-command=echo drained",
            "--state",
            state,
            "--reconcile-interval",
            "250ms",
            "--reclaim-failed-after",
            "0",
            "--create-timeout",
            "20s",
            "--delete-timeout",
            "20s",
        ],
    )
}

#[derive(Default, Debug, PartialEq)]
struct Violations {
    orphans: Vec<String>,
    duplicates: Vec<String>,
    missing: Vec<String>,
    stuck: Vec<String>,
    lost: Vec<String>,
    /// A sized type's machine past Create whose VM's boot disk is not its
    /// type's size (a kill between the clone and its resize, not resumed).
    wrong_disk_size: Vec<String>,
}

impl Violations {
    fn is_empty(&self) -> bool {
        *self == Violations::default()
    }
}

async fn list(c: &mut Client) -> Vec<pb::Machine> {
    c.list(pb::ListFilter::default())
        .await
        .expect("List")
        .into_inner()
        .machines
}

fn check(sim: &PveSim, machines: &[pb::Machine], known: &BTreeMap<String, Known>) -> Violations {
    let mut v = Violations::default();
    let by_id: HashMap<&str, &pb::Machine> = machines.iter().map(|m| (m.id.as_str(), m)).collect();
    let existing: std::collections::HashSet<String> = sim
        .vms()
        .values()
        .map(|vm| format!("{}/{}", vm.node, vm.vmid))
        .collect();
    for (id, vms) in marked(sim) {
        if vms.len() > 1 {
            v.duplicates.push(format!("{id}: {vms:?}"));
        }
        let host = by_id
            .get(id.as_str())
            .and_then(|m| m.host.as_ref())
            .map(|h| h.r#ref.clone());
        for vm in vms {
            if host.as_deref() != Some(vm.as_str()) {
                v.orphans
                    .push(format!("{vm} marked for {id}, whose host is {host:?}"));
            }
        }
    }
    for m in machines {
        let s = state(m);
        if let Some(h) = &m.host {
            if !existing.contains(&h.r#ref) {
                v.missing.push(format!("{} ({s:?}) -> {}", m.id, h.r#ref));
            }
        }
        if matches!(s, S::Creating | S::Configuring | S::Draining | S::Deleting) {
            v.stuck.push(format!("{} is {s:?}", m.id));
        }
        let sized = m.instance_type == "pve.small";
        if sized && matches!(s, S::Idle | S::Configured) {
            let vm = m
                .host
                .as_ref()
                .and_then(|h| h.r#ref.rsplit('/').next()?.parse::<u32>().ok())
                .and_then(|vmid| sim.vm(vmid));
            if let Some(vm) = vm.filter(|vm| vm.disk_gib != SIZED_DISK_GIB) {
                v.wrong_disk_size.push(format!(
                    "{} ({s:?}): VM {} has a {} GiB boot disk, not {SIZED_DISK_GIB}",
                    m.id, vm.vmid, vm.disk_gib
                ));
            }
        }
        if let Some(k) = known.get(&m.id) {
            if !consistent(k, m) {
                v.lost.push(format!(
                    "{}: known {k:?}, now {s:?} (last_error {:?})",
                    m.id, m.last_error
                ));
            }
        }
    }
    v
}

/// Poll until the invariants hold (a reconcile runs every 250 ms), or
/// return the last violations after `SETTLE`.
async fn settle_and_check(
    sim: &PveSim,
    c: &mut Client,
    known: &BTreeMap<String, Known>,
) -> (Vec<pb::Machine>, Violations) {
    sim_settled(sim, SETTLE).await;
    Wait::new("the invariants to hold", SETTLE)
        .every(Duration::from_millis(100))
        .try_ok_async(|| {
            let mut c = c.clone();
            async move {
                let machines = list(&mut c).await;
                let v = check(sim, &machines, known);
                if v.is_empty() {
                    Ok((machines, v))
                } else {
                    Err((machines, v))
                }
            }
        })
        .await
        .unwrap_or_else(|t| t.last)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_nine_campaign_on_the_real_backend() {
    let kills = iterations();
    let seed = seed();
    println!("crash-real: {kills} kills, BIGFLEET_CRASH_SEED={seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let sim = PveSim::start(SimConfig {
        nodes: vec!["pve1".into(), "pve2".into()],
        templates: vec![TemplateSpec::shared(9000, "pve1")],
        guest_agent: GuestAgentMode::BuiltIn,
        clone_duration: Duration::from_millis(150),
        agent_boot_delay: Duration::from_millis(100),
        max_parallel_local_clones: None,
        ..SimConfig::default()
    })
    .await
    .expect("simulator");
    let (dir, ca) = sim_ca_file(&sim);
    let state_path = dir.path().join("state.db");
    let types_path = dir.path().join("instance-types.json");
    std::fs::write(&types_path, INSTANCE_TYPES).expect("instance types");
    let args = provider_args(
        &sim,
        &ca,
        path_str(&state_path),
        path_str(&types_path),
        SLOTS,
    );

    let started = Instant::now();
    let mut figures = Figures::default();
    let mut provider = start_blocking(args.clone()).await;
    let mut c = Client::new(common::plain_channel(provider.grpc).await);
    let model = Arc::new(Model {
        machines: Mutex::new(
            list(&mut c)
                .await
                .iter()
                .map(|m| (m.id.clone(), Known::Stable(state(m))))
                .collect(),
        ),
    });
    let ids: Vec<String> = model.machines.lock().keys().cloned().collect();
    assert_eq!(ids.len(), SLOTS);

    for round in 0..kills {
        let stop = Arc::new(AtomicBool::new(false));
        let counts = Arc::new(Mutex::new((0, 0)));
        let mut tasks = Vec::new();
        for k in 0..CLIENTS {
            let mine: Vec<String> = ids.iter().skip(k).step_by(CLIENTS).cloned().collect();
            tasks.push(tokio::spawn(client_loop(
                provider.grpc,
                mine,
                model.clone(),
                stop.clone(),
                StdRng::seed_from_u64(rng.random()),
                counts.clone(),
            )));
        }
        // The kill lands at a random point of the workload: the delay is the
        // experiment, there is nothing to wait for.
        tokio::time::sleep(Duration::from_millis(rng.random_range(KILL_WINDOW_MS))).await;
        provider.signal(libc::SIGKILL);
        stop.store(true, Ordering::SeqCst);
        for t in tasks {
            t.await.expect("client task");
        }
        drop(provider);
        figures.kills += 1;
        let (a, done) = *counts.lock();
        figures.acked += a;
        figures.completed += done;

        provider = start_blocking(args.clone()).await;
        c = Client::new(common::plain_channel(provider.grpc).await);
        let known = model.machines.lock().clone();
        let (machines, v) = settle_and_check(&sim, &mut c, &known).await;
        figures.orphans += v.orphans.len();
        figures.duplicates += v.duplicates.len();
        figures.missing += v.missing.len();
        figures.stuck += v.stuck.len();
        figures.lost += v.lost.len();
        figures.wrong_disk_size += v.wrong_disk_size.len();
        assert!(
            v.is_empty(),
            "round {round} (seed {seed}): invariants broken after restart: {v:#?}\nprovider \
             stderr:\n{}",
            provider.stderr()
        );
        for (outcome, n) in resumed_by_outcome(provider.metrics) {
            *figures.resumed.entry(outcome).or_default() += n;
        }
        // Everything is read back now: the next round starts from it.
        let mut m = model.machines.lock();
        for machine in &machines {
            let s = state(machine);
            if s == S::Failed {
                figures.failed_seen += 1;
                // Not the same failure seen again: FAILED when the round
                // began, or with a reclaim of it cut by the kill.
                let newly = !matches!(
                    known.get(&machine.id),
                    Some(
                        Known::Stable(S::Failed)
                            | Known::InFlight {
                                from: S::Failed,
                                ..
                            }
                    )
                );
                if newly {
                    *figures
                        .failed_by_reason
                        .entry(failure_reason(&machine.last_error))
                        .or_default() += 1;
                }
            }
            m.insert(machine.id.clone(), Known::Stable(s));
        }
    }

    // The way out: reclaim every FAILED machine.
    let mut admin = AdminClient::new(common::plain_channel(provider.grpc).await);
    let failed: Vec<String> = list(&mut c)
        .await
        .into_iter()
        .filter(|m| state(m) == S::Failed)
        .map(|m| m.id)
        .collect();
    for id in &failed {
        let r = admin
            .reclaim(ReclaimRequest {
                machine_id: id.clone(),
                wait: true,
            })
            .await
            .unwrap_or_else(|s| panic!("reclaim {id}: {s:?}"))
            .into_inner();
        assert_eq!(r.status, ReclaimStatus::Reclaimed as i32, "{id}: {r:?}");
        figures.reclaimed += 1;
    }
    let after = list(&mut c).await;
    let still_failed = after.iter().filter(|m| state(m) == S::Failed).count();
    let marked_now = marked(&sim);
    let left: Vec<&String> = failed
        .iter()
        .filter(|id| marked_now.contains_key(*id))
        .collect();
    let known: BTreeMap<String, Known> = after
        .iter()
        .map(|m| (m.id.clone(), Known::Stable(state(m))))
        .collect();
    let (_, v) = settle_and_check(&sim, &mut c, &known).await;

    println!(
        "crash-real: kills={} rounds={} acked={} completed={} failed_machine_rounds={} reclaimed={} \
         orphans={} duplicates={} missing={} stuck={} lost={} wrong_disk_size={} failed_after_reclaim={} \
         marked_vms_of_reclaimed={} duration={:.1}s seed={seed}",
        figures.kills,
        kills,
        figures.acked,
        figures.completed,
        figures.failed_seen,
        figures.reclaimed,
        figures.orphans,
        figures.duplicates,
        figures.missing,
        figures.stuck,
        figures.lost,
        figures.wrong_disk_size,
        still_failed,
        left.len(),
        started.elapsed().as_secs_f64(),
    );
    let by_reason: Vec<String> = figures
        .failed_by_reason
        .iter()
        .map(|(reason, n)| format!("{reason}={n}"))
        .collect();
    let resumed: Vec<String> = figures
        .resumed
        .iter()
        .map(|(outcome, n)| format!("{outcome}={n}"))
        .collect();
    println!(
        "crash-real: newly_failed_by_reason: {} | resumed_by_outcome: {}",
        if by_reason.is_empty() {
            "none".to_owned()
        } else {
            by_reason.join(" ")
        },
        resumed.join(" ")
    );
    // A restart costs no capacity: no Create, Drain or Delete a kill
    // interrupts ends FAILED for the interruption alone. (A Configure does:
    // this campaign runs without a readiness command, so whether its node
    // joined cannot be known after the restart.)
    let interrupted = figures
        .failed_by_reason
        .get("interrupted_by_restart")
        .copied()
        .unwrap_or(0);
    assert_eq!(
        interrupted, 0,
        "machines FAILED only because a restart interrupted them: {by_reason:?}"
    );
    assert_eq!(still_failed, 0, "FAILED machines left after reclaim");
    assert!(
        left.is_empty(),
        "VMs still marked for reclaimed machines: {left:?}"
    );
    assert!(v.is_empty(), "invariants after the reclaims: {v:#?}");
    assert!(
        figures.acked > 0,
        "the workload never got an acknowledgement: the campaign tested nothing"
    );
    let violations = sim.schema_violations();
    assert!(violations.is_empty(), "schema violations: {violations:?}");
    drop(provider);
    sim.shutdown().await;
}
