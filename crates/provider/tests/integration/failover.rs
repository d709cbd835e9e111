//! Replicas sharing a PostgreSQL state: one leader serves, the others are
//! standbys (`/readyz` 503, `/healthz` 200, gRPC health NOT_SERVING, every
//! RPC UNAVAILABLE naming the leader) that take over within the lease once
//! the leader dies, with the state it left. A leader stopped past its
//! lease (SIGSTOP) and woken after a standby took over commits nothing and
//! sends nothing to Proxmox, and stands by. Needs the test server
//! (provider-testkit's `postgres`); skips without it, fails under CI=true.

use std::time::{Duration, Instant};

use bigfleet_proto::v1alpha1::capacity_provider_client::CapacityProviderClient;
use bigfleet_proto::v1alpha1::{CreateRequest, ListFilter, MachineRef, MachineState};
use provider_testkit::field;
use provider_testkit::wait::{until, Wait};
use pve_sim::{GuestAgentMode, PveSim, SimConfig};
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use crate::common::{
    http_get, marked, plain_channel, sim_backend_args, sim_ca_file, speculative_id, speculative_in,
    wait_state, Provider,
};

/// The lease in these tests: short, so a takeover is quick to see.
const TTL: &str = "2s";

/// Bound on every takeover and landing awaited (a cold debug binary on a
/// shared 2-core machine); the takeover figure itself is asserted apart.
const WITHIN: Duration = Duration::from_secs(40);

const LOST: &str = "lost the leader lease: stopped all work and standing by";

type Client = CapacityProviderClient<Channel>;

fn replica(base: &[String], name: &str) -> Provider {
    replica_with(base, name, &["--lease-ttl", TTL])
}

fn replica_with(base: &[String], name: &str, more: &[&str]) -> Provider {
    let mut args: Vec<&str> = base.iter().map(String::as_str).collect();
    args.extend(["--replica-name", name]);
    args.extend(more);
    tokio::task::block_in_place(|| Provider::start_replica(&args))
}

/// pve-sim with the clone worker's real timeline, each clone taking
/// `clone_duration`.
async fn simulator(clone_duration: Duration) -> PveSim {
    PveSim::start(SimConfig {
        guest_agent: GuestAgentMode::BuiltIn,
        clone_timeline: true,
        clone_duration,
        ..SimConfig::default()
    })
    .await
    .expect("simulator")
}

fn ready(p: &Provider) {
    tokio::task::block_in_place(|| p.wait_ready(WITHIN));
}

fn status(p: &Provider, path: &str) -> u16 {
    http_get(p.metrics, path).map_or(0, |(code, _)| code)
}

async fn health(p: &Provider) -> i32 {
    let mut h = HealthClient::new(plain_channel(p.grpc).await);
    h.check(HealthCheckRequest {
        service: String::new(),
    })
    .await
    .expect("health check")
    .into_inner()
    .status
}

fn create(id: &str, sequence: i64) -> CreateRequest {
    CreateRequest {
        machine_id: id.to_string(),
        shard_id: "s1".into(),
        shard_epoch: 1,
        sequence_number: sequence,
    }
}

/// The first line whose `msg` is `msg`, waiting for it.
fn logged(p: &Provider, msg: &str) -> String {
    tokio::task::block_in_place(|| {
        p.logs
            .wait_for(WITHIN, |l| field(l, "msg").as_deref() == Some(msg))
    })
    .unwrap_or_else(|| panic!("no {msg:?} line; stderr:\n{}", p.stderr()))
}

async fn standby_is_refusing(p: &Provider, leader: &str) {
    assert_eq!(status(p, "/readyz"), 503, "a standby is not ready");
    assert_eq!(status(p, "/healthz"), 200, "a standby is alive");
    assert_eq!(health(p).await, ServingStatus::NotServing as i32);
    let c = p.client().await;
    let named = format!("the leader is replica {leader}");
    // A replica that has just lost the lease names the new leader once it
    // has looked at the lease again (its next attempt to take it).
    Wait::new(format!("a refusal naming {leader}"), WITHIN)
        .every(Duration::from_millis(100))
        .try_ok_async(|| {
            let mut c = c.clone();
            let named = &named;
            async move {
                let refused = c
                    .list(ListFilter::default())
                    .await
                    .expect_err("a standby refuses");
                assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
                if refused.message().contains(named) {
                    Ok(())
                } else {
                    Err(refused.message().to_owned())
                }
            }
        })
        .await
        .unwrap_or_else(|t| panic!("the refusal never named {leader}: {}", t.last))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_names_the_leader_and_takes_over_with_its_state_when_it_dies() {
    let Some(schema) = provider_testkit::postgres::fresh() else {
        return;
    };
    let base: Vec<String> = ["--use-fake-backend", "--state", schema.url.as_str()]
        .map(String::from)
        .to_vec();
    let a = replica(&base, "replica-a");
    ready(&a);
    let b = replica(&base, "replica-b");
    logged(&b, "standby: another replica holds the leader lease");
    standby_is_refusing(&b, "replica-a").await;
    assert_eq!(health(&a).await, ServingStatus::Serving as i32);

    let mut ca = a.client().await;
    let id = speculative_id(&mut ca).await;
    ca.create(create(&id, 1))
        .await
        .expect("Create on the leader");
    wait_state(&mut ca, &id, MachineState::Idle, WITHIN).await;

    let mut a = a;
    a.signal(libc::SIGKILL);
    let died = Instant::now();
    tokio::task::block_in_place(|| a.wait_exit(WITHIN)).expect("the leader died");
    ready(&b);
    let takeover = died.elapsed();
    assert!(
        takeover <= Duration::from_secs(10),
        "takeover took {takeover:?}"
    );
    assert_eq!(health(&b).await, ServingStatus::Serving as i32);
    let mut cb = b.client().await;
    let m = cb
        .get(MachineRef { id: id.clone() })
        .await
        .expect("Get on the new leader")
        .into_inner();
    assert_eq!(m.state, MachineState::Idle as i32, "{m:?}");
    // The fence mark survived: the same Create is a replay, a lower
    // sequence is fenced out.
    let fenced = cb.create(create(&id, 0)).await.expect_err("fenced");
    assert_eq!(fenced.code(), tonic::Code::FailedPrecondition, "{fenced:?}");
}

/// A leader frozen past its lease while a Create is in flight on pve-sim:
/// the standby takes over and lands the Create; the old leader, woken,
/// sends nothing to Proxmox, commits nothing, and stands by.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_frozen_past_its_lease_commits_and_sends_nothing_once_woken() {
    let Some(schema) = provider_testkit::postgres::fresh() else {
        return;
    };
    // The clone outlasts the freeze: the frozen leader wakes up waiting
    // for it.
    let sim = simulator(Duration::from_secs(4)).await;
    let (_ca_dir, ca) = sim_ca_file(&sim);
    let base = sim_backend_args(
        &sim,
        &ca,
        "pve1",
        &[
            "--seed-count",
            "2",
            "--readiness-command=",
            "--state",
            schema.url.as_str(),
        ],
    );
    let a = replica(&base, "replica-a");
    ready(&a);
    let b = replica(&base, "replica-b");
    logged(&b, "standby: another replica holds the leader lease");

    let mut c: Client = a.client().await;
    let id = speculative_in(&mut c, "pve1").await;
    c.create(create(&id, 1))
        .await
        .expect("Create on the leader");
    logged(&a, "clone started");
    let commits_before = schema.query_i64("SELECT max(round) FROM bigfleet_commits");

    a.signal(libc::SIGSTOP);
    ready(&b);
    let mut cb = b.client().await;
    let landed = wait_state(&mut cb, &id, MachineState::Idle, WITHIN).await;
    let on_b = schema.query_i64("SELECT max(round) FROM bigfleet_commits");
    assert!(on_b > commits_before, "the new leader committed");
    // From here on, anything that is not a read comes from the old leader
    // (the new one has nothing to do).
    sim.clear_requests();

    a.signal(libc::SIGCONT);
    logged(&a, LOST);
    // Its Create's work, woken, found the gate shut.
    tokio::task::block_in_place(|| {
        a.logs.wait_for(WITHIN, |l| {
            l.contains("not sent: this replica no longer holds the leader lease")
        })
    })
    .unwrap_or_else(|| panic!("no refused request; stderr:\n{}", a.stderr()));
    until("the old leader to stop being ready", WITHIN, || {
        status(&a, "/readyz") == 503
    })
    .await;
    standby_is_refusing(&a, "replica-b").await;
    let sent: Vec<String> = sim
        .requests()
        .into_iter()
        .filter(|r| r.method != "GET")
        .map(|r| format!("{} {}", r.method, r.path))
        .collect();
    assert!(sent.is_empty(), "the deposed leader sent {sent:?}");
    // Its Create's work found the gate shut and its commit the lease
    // taken: the record is the new leader's.
    let m = cb
        .get(MachineRef { id: id.clone() })
        .await
        .expect("Get")
        .into_inner();
    assert_eq!(m.state, MachineState::Idle as i32, "{m:?}");
    assert_eq!(m.host, landed.host, "one VM, the new leader's record");
    let vms = marked(&sim);
    assert_eq!(
        vms.get(&id).map(Vec::len),
        Some(1),
        "one VM for the machine: {vms:?}"
    );
    assert!(
        !a.stderr().contains("state commit failed")
            || a.stderr().contains("no longer holds the leader lease"),
        "a commit of the old leader failed for another reason:\n{}",
        a.stderr()
    );
    sim.shutdown().await;
}

/// Rounds of [`failover_under_a_burst_loses_nothing`]: `make failover` runs
/// the campaign's 20; the test suite runs a few.
fn rounds() -> usize {
    std::env::var("BIGFLEET_FAILOVER_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(2)
}

const BURST: usize = 16;

const TRANSITIONAL: [MachineState; 4] = [
    MachineState::Creating,
    MachineState::Configuring,
    MachineState::Draining,
    MachineState::Deleting,
];

/// Two replicas on pve-sim with the default lease; each round a 16-way burst of Creates on the
/// leader, which is killed (-9) after some of them were acknowledged. The
/// standby takes over within 10 s (the longest takeover of the campaign is
/// printed), and once everything settles: every acknowledged Create landed
/// IDLE, no machine has two VMs, no marked VM is an orphan, no machine
/// points at a missing VM, nothing is left transitional. Then the machines
/// are deleted for the next round, and the killed replica comes back as
/// the standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_under_a_burst_loses_nothing() {
    let Some(schema) = provider_testkit::postgres::fresh() else {
        return;
    };
    let sim = simulator(SimConfig::default().clone_duration).await;
    let (_ca_dir, ca) = sim_ca_file(&sim);
    let seeds = BURST.to_string();
    let base = sim_backend_args(
        &sim,
        &ca,
        "pve1",
        &[
            "--seed-count",
            seeds.as_str(),
            "--readiness-command=",
            "--state",
            schema.url.as_str(),
        ],
    );
    // The default lease: the takeover measured is the one operators get.
    let mut names = ["replica-a", "replica-b"];
    let mut leader = replica_with(&base, names[0], &[]);
    ready(&leader);
    let mut standby = replica_with(&base, names[1], &[]);
    logged(&standby, "standby: another replica holds the leader lease");
    let mut longest = Duration::ZERO;
    for round in 0..rounds() {
        let sequence = round as i64 * 10;
        let mut c = leader.client().await;
        let (mut acks, _calls) = burst(&mut c, sequence + 1, Duration::ZERO).await;
        // Kill after a varying number of acknowledgements.
        let kill_after = 1 + round % 8;
        let mut acked = Vec::new();
        while acked.len() < kill_after {
            match acks.recv().await {
                Some(id) => acked.push(id),
                None => break,
            }
        }
        leader.signal(libc::SIGKILL);
        let died = Instant::now();
        tokio::task::block_in_place(|| leader.wait_exit(WITHIN)).expect("the leader died");
        // Acknowledgements that raced the kill count too.
        while let Ok(id) = acks.try_recv() {
            acked.push(id);
        }
        ready(&standby);
        let takeover = died.elapsed();
        longest = longest.max(takeover);
        assert!(
            takeover <= Duration::from_secs(10),
            "round {round}: takeover took {takeover:?}"
        );
        std::mem::swap(&mut leader, &mut standby);
        names.swap(0, 1);
        standby = replica_with(&base, names[1], &[]);

        let mut c = leader.client().await;
        let settled = settle(&mut c, round).await;
        all_landed(&settled, &acked, round);
        check_vms(&sim, &settled, round);

        // Free every slot for the next round.
        for m in settled
            .iter()
            .filter(|m| m.state != MachineState::Speculative as i32)
        {
            c.delete(bigfleet_proto::v1alpha1::DeleteRequest {
                machine_id: m.id.clone(),
                shard_id: "s1".into(),
                shard_epoch: 1,
                sequence_number: sequence + 2,
            })
            .await
            .unwrap_or_else(|e| panic!("round {round}: Delete {}: {e:?}", m.id));
        }
        let settled = settle(&mut c, round).await;
        check_vms(&sim, &settled, round);
        ready(&leader);
    }
    println!(
        "failover: {} rounds, longest takeover {} ms",
        rounds(),
        longest.as_millis()
    );
    sim.shutdown().await;
}

/// Creates on BURST free slots at once, the second half of them each `stagger`
/// times its place later: the ids acknowledged, as they are, and the calls.
async fn burst(
    c: &mut Client,
    sequence: i64,
    stagger: Duration,
) -> (
    tokio::sync::mpsc::UnboundedReceiver<String>,
    Vec<tokio::task::JoinHandle<()>>,
) {
    let slots: Vec<String> = list(c)
        .await
        .into_iter()
        .filter(|m| m.state == MachineState::Speculative as i32)
        .map(|m| m.id)
        .collect();
    assert!(slots.len() >= BURST, "not enough free slots: {slots:?}");
    let (acks_tx, acks) = tokio::sync::mpsc::unbounded_channel();
    let mut calls = Vec::new();
    for (i, id) in slots.into_iter().take(BURST).enumerate() {
        let mut c = c.clone();
        let acks_tx = acks_tx.clone();
        calls.push(tokio::spawn(async move {
            if i >= BURST / 2 {
                // The stagger is the scenario: the later half of the burst
                // reaches the provider spread out over the takeover, on
                // purpose, not waiting for anything.
                tokio::time::sleep(stagger * i as u32).await;
            }
            if c.create(create(&id, sequence)).await.is_ok() {
                let _ = acks_tx.send(id);
            }
        }));
    }
    (acks, calls)
}

async fn list(c: &mut Client) -> Vec<bigfleet_proto::v1alpha1::Machine> {
    c.list(ListFilter::default())
        .await
        .expect("List")
        .into_inner()
        .machines
}

/// Waits until no machine is transitional and returns them. A List may be
/// refused UNAVAILABLE while the state store retries a commit the database
/// cut short; it is asked again.
async fn settle(c: &mut Client, round: usize) -> Vec<bigfleet_proto::v1alpha1::Machine> {
    Wait::new(
        format!("round {round}: no machine transitional"),
        WITHIN * 2,
    )
    .every(Duration::from_millis(200))
    .try_ok_async(|| {
        let mut c = c.clone();
        async move {
            let machines = match c.list(ListFilter::default()).await {
                Ok(listed) => listed.into_inner().machines,
                Err(e) if e.code() == tonic::Code::Unavailable => {
                    return Err(format!("List: {e:?}"));
                }
                Err(e) => panic!("round {round}: List: {e:?}"),
            };
            let moving: Vec<&bigfleet_proto::v1alpha1::Machine> = machines
                .iter()
                .filter(|m| TRANSITIONAL.iter().any(|s| *s as i32 == m.state))
                .collect();
            if moving.is_empty() {
                Ok(machines)
            } else {
                Err(format!("still transitional: {moving:?}"))
            }
        }
    })
    .await
    .unwrap_or_else(|t| panic!("round {round}: {}", t.last))
}

/// Every acknowledged Create landed IDLE.
fn all_landed(machines: &[bigfleet_proto::v1alpha1::Machine], acked: &[String], round: usize) {
    for id in acked {
        let m = machines
            .iter()
            .find(|m| &m.id == id)
            .expect("an acknowledged machine is listed");
        assert_eq!(
            m.state,
            MachineState::Idle as i32,
            "round {round}: acknowledged Create of {id} did not land: {m:?}"
        );
    }
}

/// One VM per machine that has a host, none for the others, none marked
/// for a machine the state does not know.
fn check_vms(sim: &PveSim, machines: &[bigfleet_proto::v1alpha1::Machine], round: usize) {
    let vms = marked(sim);
    for (id, refs) in &vms {
        assert_eq!(
            refs.len(),
            1,
            "round {round}: duplicate VMs for {id}: {refs:?}"
        );
        let m = machines
            .iter()
            .find(|m| &m.id == id)
            .unwrap_or_else(|| panic!("round {round}: orphan VM {refs:?} marked for {id}"));
        let host = m
            .host
            .as_ref()
            .unwrap_or_else(|| panic!("round {round}: VM {refs:?} for {id} with no host: {m:?}"));
        assert_eq!(
            host.r#ref, refs[0],
            "round {round}: {id} points at another VM than its own"
        );
    }
    for m in machines {
        if m.host.is_some() {
            assert!(
                vms.contains_key(&m.id),
                "round {round}: {} points at a VM that does not exist: {m:?}",
                m.id
            );
        }
    }
}

/// A PostgreSQL cluster of the test's own (restarting the shared test
/// server would cut every other test's connections), stopped and removed
/// on drop.
struct PrivateCluster {
    dir: std::path::PathBuf,
    url: String,
}

const THROWAWAY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/pg-throwaway.sh");

impl PrivateCluster {
    fn start() -> PrivateCluster {
        // Beside the temporary directory, not inside a private one: as root
        // the cluster runs as another user, who must reach it.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = std::env::temp_dir().join(format!(
            "bigfleet-pg-restart-{}-{nanos}",
            std::process::id()
        ));
        let out = std::process::Command::new(THROWAWAY)
            .arg("start")
            .arg(&dir)
            .output()
            .expect("run pg-throwaway.sh");
        assert!(
            out.status.success(),
            "pg-throwaway.sh start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let url = String::from_utf8_lossy(&out.stdout).trim().to_string();
        PrivateCluster { dir, url }
    }

    /// `pg-throwaway.sh halt|resume|restart DIR`.
    fn control(&self, verb: &str) {
        let out = std::process::Command::new(THROWAWAY)
            .arg(verb)
            .arg(&self.dir)
            .output()
            .expect("run pg-throwaway.sh");
        assert!(
            out.status.success(),
            "pg-throwaway.sh {verb}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn restart(&self) {
        let out = std::process::Command::new(THROWAWAY)
            .arg("restart")
            .arg(&self.dir)
            .output()
            .expect("run pg-throwaway.sh");
        assert!(
            out.status.success(),
            "pg-throwaway.sh restart: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        let _ = std::process::Command::new(THROWAWAY)
            .arg("stop")
            .arg(&self.dir)
            .output();
    }
}

/// PostgreSQL stopped (`pg_ctl stop`) under a serving leader: a Create is
/// refused UNAVAILABLE saying nothing was changed and `/readyz` says not
/// ready (Get and List too answer UNAVAILABLE while changes wait for a
/// commit: they show only durable state); with the database back (`pg_ctl
/// start`) it is ready again by itself, the same machine is SPECULATIVE,
/// never FAILED, and the retry with a new token lands IDLE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_costs_no_machine() {
    if provider_testkit::postgres::fresh().is_none() {
        return;
    }
    let cluster = tokio::task::block_in_place(PrivateCluster::start);
    let p = {
        let args = [
            "--use-fake-backend",
            "--seed-count",
            "4",
            "--state",
            cluster.url.as_str(),
            "--replica-name",
            "replica-a",
            // Long enough that the leader keeps its term through the outage.
            "--lease-ttl",
            "60s",
        ];
        tokio::task::block_in_place(|| Provider::start(&args))
    };
    let mut c = p.client().await;
    let id = speculative_id(&mut c).await;
    tokio::task::block_in_place(|| cluster.control("halt"));
    let refused = c
        .create(create(&id, 1))
        .await
        .expect_err("a Create the database cannot commit is not acknowledged");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(
        refused.message().contains("nothing was changed"),
        "{}",
        refused.message()
    );
    let get = |c: &CapacityProviderClient<Channel>| {
        let id = id.clone();
        let mut c = c.clone();
        async move { c.get(MachineRef { id }).await.map(|m| m.into_inner()) }
    };
    Wait::new("/readyz to say not ready", Duration::from_secs(10))
        .until(|| http_get(p.metrics, "/readyz").is_ok_and(|(status, _)| status == 503))
        .await;
    tokio::task::block_in_place(|| cluster.control("resume"));
    Wait::new("/readyz ready again by itself", Duration::from_secs(60))
        .until(|| http_get(p.metrics, "/readyz").is_ok_and(|(status, _)| status == 200))
        .await;
    let m = get(&c).await.expect("Get");
    assert_eq!(m.state, MachineState::Speculative as i32, "{m:?}");
    assert!(m.last_error.is_empty(), "{m:?}");
    c.create(create(&id, 2))
        .await
        .expect("the retry with a new token is accepted");
    wait_state(&mut c, &id, MachineState::Idle, Duration::from_secs(30)).await;
}

/// `pg_ctl restart` of the database in the middle of a 16-way burst: the
/// leader re-connects (and, should the restart outlast its lease, takes the
/// lease back and resumes), and every acknowledged Create lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restart_mid_burst_loses_nothing_acknowledged() {
    // The shared server's presence decides whether PostgreSQL tests run.
    if provider_testkit::postgres::fresh().is_none() {
        return;
    }
    let cluster = tokio::task::block_in_place(PrivateCluster::start);
    let seeds = BURST.to_string();
    let p = {
        let args = [
            "--use-fake-backend",
            // Every landing's commit comes after the restart has begun (it
            // starts right after the first acknowledgements).
            "--fake-latency",
            "2s",
            "--seed-count",
            seeds.as_str(),
            "--state",
            cluster.url.as_str(),
            "--replica-name",
            "replica-a",
        ];
        tokio::task::block_in_place(|| Provider::start(&args))
    };
    let mut c = p.client().await;
    // Half before the restart, half during and after it.
    let (mut acks, calls) = burst(&mut c, 1, Duration::from_millis(20)).await;
    let mut acked = Vec::new();
    while acked.len() < BURST / 4 {
        acked.push(acks.recv().await.expect("some Creates are acknowledged"));
    }
    tokio::task::block_in_place(|| cluster.restart());
    for call in calls {
        call.await.expect("the call task");
    }
    while let Some(id) = acks.recv().await {
        acked.push(id);
    }
    ready(&p);
    let settled = settle(&mut c, 0).await;
    all_landed(&settled, &acked, 0);
    assert!(acked.len() >= BURST / 4, "{acked:?}");
}

/// SIGTERM on the leader: it lands what it can, gives the lease up, and a
/// standby serves at once instead of waiting for the lease to expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_stopped_gracefully_hands_over_without_waiting_for_its_lease() {
    let Some(schema) = provider_testkit::postgres::fresh() else {
        return;
    };
    // A lease far longer than the handover may take.
    let args = |name: &'static str| -> Vec<String> {
        [
            "--use-fake-backend",
            "--state",
            schema.url.as_str(),
            "--replica-name",
            name,
            "--lease-ttl",
            "60s",
        ]
        .map(String::from)
        .to_vec()
    };
    let start = |args: Vec<String>| {
        tokio::task::block_in_place(|| {
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            Provider::start_replica(&refs)
        })
    };
    let mut a = start(args("replica-a"));
    ready(&a);
    let b = start(args("replica-b"));
    logged(&b, "standby: another replica holds the leader lease");
    a.signal(libc::SIGTERM);
    let stopped = Instant::now();
    let status = tokio::task::block_in_place(|| a.wait_exit(WITHIN)).expect("exited");
    assert!(status.success(), "{status:?}\n{}", a.stderr());
    assert!(
        a.stderr().contains("released the leader lease"),
        "{}",
        a.stderr()
    );
    ready(&b);
    let handover = stopped.elapsed();
    assert!(
        handover < Duration::from_secs(30),
        "the standby waited {handover:?}, as if the lease had not been given up"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_live_replicas_under_one_name_settle_on_one_leader_and_say_so() {
    let Some(schema) = provider_testkit::postgres::fresh() else {
        return;
    };
    let base: Vec<String> = ["--use-fake-backend", "--state", schema.url.as_str()]
        .map(String::from)
        .to_vec();
    let first = replica(&base, "same-name");
    ready(&first);
    // A second process under the same name takes the running lease back,
    // as a replica restarted in place would.
    let second = replica(&base, "same-name");
    ready(&second);
    logged(&first, LOST);
    let error = logged(&first, "two live replicas share one --replica-name");
    assert_eq!(field(&error, "level").as_deref(), Some("error"), "{error}");
    assert!(
        error.contains("give every replica its own --replica-name"),
        "{error}"
    );
    // The first looks at the lease again and leaves it to the second
    // instead of taking it back by name in turn.
    logged(&first, "standby: another replica holds the leader lease");
    assert_eq!(status(&first, "/readyz"), 503);
    assert_eq!(status(&second, "/readyz"), 200);
    assert!(
        !second.stderr().contains(LOST),
        "the second was deposed in turn:\n{}",
        second.stderr()
    );
}
