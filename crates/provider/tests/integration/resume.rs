//! A restart costs no capacity, through the binary on pve-sim with `--state`:
//! the provider is killed (-9) inside each transition, at several points,
//! and started again on the same state. Every interrupted transition then
//! lands as documented (a Create IDLE, a Delete SPECULATIVE, a Drain IDLE,
//! a Configure CONFIGURED when a readiness check can finish it, else FAILED
//! saying why) under its original operation id, with one VM per machine in
//! the simulator; one whose deadline passed while the provider was down
//! lands FAILED, timed out. A SIGTERM in a burst of Creates exits 0 within
//! `--shutdown-grace`, and what it left in flight resumes at the next start;
//! `bigfleet_proxmox_resumed_total` counts what a restart found.
//!
//! The simulator runs the clone worker's real timeline under a pool-scoped
//! token (a clone in progress is a bare, unlisted `lock: clone` config) with
//! its default RRD lag (a new VM's name is not listed for 10 s): the cluster
//! a dead process leaves behind is as hard to read as a real one.

use std::time::{Duration, Instant};

use bigfleet_proto::v1alpha1::capacity_provider_client::CapacityProviderClient;
use bigfleet_proto::v1alpha1::{
    ConfigureRequest, CreateRequest, DeleteRequest, DrainRequest, ListFilter, Machine, MachineState,
};
use provider_testkit::field;
use provider_testkit::wait::until;
use proxmox_backend::substrate::VmRef;
use pve_sim::{GuestAgentMode, PveSim, SimConfig};
use tonic::transport::Channel;

use crate::common::{
    marked, path_str, sim_backend_args, sim_ca_file, sim_settled, start_blocking, wait_failed,
    wait_state, Provider,
};
use crate::observability::scrape;

type Client = CapacityProviderClient<Channel>;

/// Bound on every landing, log line and settling awaited (a cold debug
/// binary on a shared 2-core machine).
const WITHIN: Duration = Duration::from_secs(40);

const CLONE_POST: &str = "POST /nodes/{node}/qemu/{vmid}/clone";
const CONFIG_PUT: &str = "PUT /nodes/{node}/qemu/{vmid}/config";
const AGENT_PING: &str = "POST /nodes/{node}/qemu/{vmid}/agent/ping";
const DESTROY: &str = "DELETE /nodes/{node}/qemu/{vmid}";

const RESUMING: &str = "resuming a transition interrupted by a provider restart";
const CLONE_STILL_RUNNING: &str = "a clone started before the restart is still running; waiting \
                                   for it before looking for this machine's VM";

/// A guest command that marks `started` in the guest, then waits until the
/// test creates `gate` there (both under the guest's `run/`).
fn gated(started: &str, gate: &str) -> String {
    format!(
        "touch \"$BIGFLEET_GUEST_ROOT/run/{started}\"; \
         while [ ! -e \"$BIGFLEET_GUEST_ROOT/run/{gate}\" ]; do sleep 0.02; done"
    )
}

/// The cluster a restart has to read: the clone worker's real timeline
/// under a pool-scoped token, the default RRD lag.
fn cluster() -> SimConfig {
    SimConfig {
        guest_agent: GuestAgentMode::BuiltIn,
        clone_timeline: true,
        pool_acl: true,
        ..SimConfig::default()
    }
}

/// One simulator and one state file, for a provider started, killed and
/// started again with the same flags.
struct Rig {
    sim: PveSim,
    dir: tempfile::TempDir,
    args: Vec<String>,
}

impl Rig {
    async fn new(sim: SimConfig, flags: &[&str]) -> Rig {
        let sim = PveSim::start(sim).await.expect("simulator");
        let (dir, ca) = sim_ca_file(&sim);
        let state = dir.path().join("state.db");
        let mut all = vec![
            "--proxmox-poll-interval",
            "20ms",
            "--state",
            path_str(&state),
        ];
        all.extend_from_slice(flags);
        let args = sim_backend_args(&sim, &ca, "pve1", &all);
        Rig { sim, dir, args }
    }

    async fn start(&self) -> (Provider, Client) {
        let provider = start_blocking(self.args.clone()).await;
        let client = provider.client().await;
        (provider, client)
    }

    /// Kills the provider with SIGKILL and waits for it to be gone.
    fn kill(&self, mut provider: Provider) {
        provider.signal(libc::SIGKILL);
        let status = tokio::task::block_in_place(|| provider.wait_exit(WITHIN));
        assert!(status.is_some(), "the provider outlived SIGKILL");
    }

    /// A path in the guest root of the machine's VM.
    fn guest_file(&self, m: &Machine, rel: &str) -> std::path::PathBuf {
        self.sim.guest_root(vm_of(m).vmid).join("run").join(rel)
    }

    async fn shutdown(self) {
        let violations = self.sim.schema_violations();
        assert!(violations.is_empty(), "schema violations: {violations:?}");
        self.sim.shutdown().await;
        drop(self.dir);
    }
}

fn vm_of(m: &Machine) -> VmRef {
    let host = m.host.as_ref().expect("a machine with a host");
    VmRef::parse(&host.r#ref).expect("host ref")
}

/// Waits for a line whose `msg` is `msg`.
fn logged(p: &Provider, msg: &str) {
    logged_where(p, msg, |_| true);
}

/// The first line whose `msg` is `msg` and that `also` accepts, waiting for it.
fn logged_where(p: &Provider, msg: &str, also: impl Fn(&str) -> bool) -> String {
    tokio::task::block_in_place(|| {
        p.logs.wait_for(WITHIN, |l| {
            field(l, "msg").as_deref() == Some(msg) && also(l)
        })
    })
    .unwrap_or_else(|| panic!("no {msg:?} line; stderr:\n{}", p.stderr()))
}

/// Waits until the provider retries a clone request the simulator refuses.
fn clone_refused(p: &Provider) {
    logged_where(p, "retrying PVE call", |l| {
        field(l, "op").as_deref() == Some("clone")
    });
}

/// The SPECULATIVE slots, in List order.
async fn slots(c: &mut Client, n: usize) -> Vec<String> {
    let ids: Vec<String> = c
        .list(ListFilter::default())
        .await
        .expect("List")
        .into_inner()
        .machines
        .into_iter()
        .filter(|m| m.state == MachineState::Speculative as i32)
        .map(|m| m.id)
        .take(n)
        .collect();
    assert_eq!(ids.len(), n, "{n} SPECULATIVE slots");
    ids
}

async fn create(c: &mut Client, id: &str) -> String {
    c.create(CreateRequest {
        machine_id: id.to_string(),
        ..Default::default()
    })
    .await
    .expect("Create")
    .into_inner()
    .operation_id
}

async fn configure(c: &mut Client, id: &str, blob: &str) -> String {
    c.configure(ConfigureRequest {
        machine_id: id.to_string(),
        cluster_id: "cluster-resume".into(),
        bootstrap_blob: blob.as_bytes().to_vec(),
        ..Default::default()
    })
    .await
    .expect("Configure")
    .into_inner()
    .operation_id
}

async fn drain(c: &mut Client, id: &str) -> String {
    c.drain(DrainRequest {
        machine_id: id.to_string(),
        grace_period_seconds: 7,
        ..Default::default()
    })
    .await
    .expect("Drain")
    .into_inner()
    .operation_id
}

async fn delete(c: &mut Client, id: &str) -> String {
    c.delete(DeleteRequest {
        machine_id: id.to_string(),
        ..Default::default()
    })
    .await
    .expect("Delete")
    .into_inner()
    .operation_id
}

/// Once the simulator has settled: each machine's host is the one VM marked
/// for it, and no other VM exists (none for a deleted machine, no unmarked
/// leftover).
async fn one_vm_each(sim: &PveSim, hosted: &[&Machine]) {
    sim_settled(sim, WITHIN).await;
    let by_machine = marked(sim);
    for m in hosted {
        let host = m.host.as_ref().map(|h| h.r#ref.clone());
        assert_eq!(
            by_machine.get(&m.id).cloned(),
            host.map(|h| vec![h]),
            "{}: its host and the VMs marked for it differ: {by_machine:?}",
            m.id
        );
    }
    let vms: Vec<u32> = sim
        .vms()
        .values()
        .filter(|v| !v.template)
        .map(|v| v.vmid)
        .collect();
    assert_eq!(
        vms.len(),
        hosted.len(),
        "VMs in the simulator: {vms:?}, marked: {by_machine:?}"
    );
}

/// The resumption line for `id` names the state and the operation id.
fn resumed_line(p: &Provider, id: &str, state: &str, op: &str) {
    let line = logged_where(p, RESUMING, |l| {
        field(l, "machine_id").as_deref() == Some(id)
    });
    assert_eq!(field(&line, "state").as_deref(), Some(state), "{line}");
    assert_eq!(field(&line, "operation_id").as_deref(), Some(op), "{line}");
    assert!(field(&line, "time_left").is_some(), "{line}");
}

// ---- Create -------------------------------------------------------------

/// Where a Create is when the provider dies.
#[derive(Clone, Copy, Debug)]
enum CreateStop {
    /// Accepted, no clone yet: every clone request is refused (595).
    BeforeTheClone,
    /// The clone task is copying (and its VM unlisted).
    DuringTheClone,
    /// The clone landed; marking it is refused (503).
    BeforeTheMark,
    /// Marked and started; its guest agent does not answer yet.
    DuringTheAgentWait,
}

async fn create_killed(stop: CreateStop) {
    let mut sim = cluster();
    if let CreateStop::DuringTheClone = stop {
        // Long enough that the restart finds the copy still running.
        sim.clone_duration = Duration::from_secs(3);
    }
    let rig = Rig::new(sim, &["--seed-count", "1", "--readiness-command="]).await;
    let (p, mut c) = rig.start().await;
    let id = slots(&mut c, 1).await.remove(0);
    let faults = rig.sim.faults();
    match stop {
        CreateStop::BeforeTheClone => faults.fail_next(CLONE_POST, u32::MAX, 595, "no route"),
        CreateStop::BeforeTheMark => {
            faults.fail_next(CONFIG_PUT, u32::MAX, 503, "Service Unavailable")
        }
        CreateStop::DuringTheAgentWait => {
            faults.fail_next(AGENT_PING, u32::MAX, 500, "QEMU guest agent is not running")
        }
        CreateStop::DuringTheClone => {}
    }
    let op = create(&mut c, &id).await;
    match stop {
        CreateStop::BeforeTheClone => {
            clone_refused(&p);
        }
        CreateStop::DuringTheClone => {
            logged(&p, "clone started");
        }
        CreateStop::BeforeTheMark => {
            logged(&p, "clone done");
            until("the mark to be refused", WITHIN, || {
                rig.sim.call_count(CONFIG_PUT) > 0
            })
            .await;
        }
        CreateStop::DuringTheAgentWait => {
            until("the agent to be pinged", WITHIN, || {
                rig.sim.call_count(AGENT_PING) > 1
            })
            .await;
        }
    }
    rig.kill(p);
    rig.sim.faults().clear();
    // The kill came where it was meant to.
    let vms: Vec<pve_sim::Vm> = rig
        .sim
        .vms()
        .into_values()
        .filter(|v| !v.template)
        .collect();
    let at_stop = match stop {
        CreateStop::BeforeTheClone => vms.is_empty(),
        CreateStop::DuringTheClone => vms.len() == 1 && vms[0].lock.as_deref() == Some("clone"),
        CreateStop::BeforeTheMark => {
            vms.len() == 1 && vms[0].lock.is_none() && vms[0].tags.is_none() && !vms[0].running
        }
        CreateStop::DuringTheAgentWait => vms.len() == 1 && vms[0].tags.is_some() && vms[0].running,
    };
    assert!(at_stop, "{stop:?}: the simulator holds {vms:?}");

    let (p, mut c) = rig.start().await;
    resumed_line(&p, &id, "CREATING", &op);
    let m = wait_state(&mut c, &id, MachineState::Idle, WITHIN).await;
    assert_eq!(
        create(&mut c, &id).await,
        op,
        "{stop:?}: a retry's operation id"
    );
    one_vm_each(&rig.sim, &[&m]).await;
    if let CreateStop::DuringTheClone = stop {
        // Its VM is not listed yet: the resumed Create waits for the clone
        // task instead of cloning a second VM.
        logged_where(&p, CLONE_STILL_RUNNING, |l| {
            field(l, "machine_id").as_deref() == Some(id.as_str())
        });
    }
    drop(p);
    rig.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_killed_before_its_clone_lands_idle() {
    create_killed(CreateStop::BeforeTheClone).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_killed_during_its_clone_adopts_that_clone() {
    create_killed(CreateStop::DuringTheClone).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_killed_between_clone_and_mark_adopts_the_clone() {
    create_killed(CreateStop::BeforeTheMark).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_killed_during_the_agent_wait_lands_idle() {
    create_killed(CreateStop::DuringTheAgentWait).await;
}

/// A Create whose deadline passes while the provider is down lands FAILED,
/// timed out, and the restart counts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_whose_deadline_passed_while_down_fails_timed_out() {
    let timeout = Duration::from_secs(2);
    let rig = Rig::new(
        cluster(),
        &[
            "--seed-count",
            "1",
            "--readiness-command=",
            "--create-timeout",
            "2s",
        ],
    )
    .await;
    let (p, mut c) = rig.start().await;
    let id = slots(&mut c, 1).await.remove(0);
    rig.sim
        .faults()
        .fail_next(CLONE_POST, u32::MAX, 595, "no route");
    create(&mut c, &id).await;
    // The deadline is at most `timeout` after the acknowledgement.
    let deadline = Instant::now() + timeout;
    clone_refused(&p);
    rig.kill(p);
    rig.sim.faults().clear();
    // Nothing to observe while the provider is down, and its clock is the
    // wall clock of another process: the condition is the time itself.
    tokio::time::sleep(deadline.saturating_duration_since(Instant::now())).await;

    let (p, mut c) = rig.start().await;
    let m = wait_failed(&mut c, &id, WITHIN).await;
    assert_eq!(
        m.last_error,
        "Create timed out after 2s (deadline exceeded while the provider was restarting)"
    );
    assert!(
        !p.stderr().contains(RESUMING),
        "a transition past its deadline is not resumed:\n{}",
        p.stderr()
    );
    let (_, exp) = scrape(&p);
    let resumed = |outcome: &str| {
        exp.must(
            "bigfleet_proxmox_resumed_total",
            &[("transition", "Create"), ("outcome", outcome)],
        )
    };
    assert_eq!(resumed("timed_out"), 1.0);
    assert_eq!(resumed("landed"), 0.0);
    one_vm_each(&rig.sim, &[]).await;
    drop(p);
    rig.shutdown().await;
}

// ---- Delete, Drain, Configure ---------------------------------------------

/// A Delete killed while PVE destroys its VM lands SPECULATIVE, and no VM is
/// left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_killed_during_the_destroy_lands_speculative() {
    let rig = Rig::new(
        SimConfig {
            destroy_duration: Duration::from_secs(2),
            // PVE's: the restarted provider's destroy worker waits out the
            // first one's config lock, then finds the config gone.
            lock_wait: Duration::from_secs(10),
            ..cluster()
        },
        &["--seed-count", "1", "--readiness-command="],
    )
    .await;
    let (p, mut c) = rig.start().await;
    let id = slots(&mut c, 1).await.remove(0);
    create(&mut c, &id).await;
    let vm = vm_of(&wait_state(&mut c, &id, MachineState::Idle, WITHIN).await);
    let op = delete(&mut c, &id).await;
    until("the destroy to start", WITHIN, || {
        rig.sim.call_count(DESTROY) > 0
    })
    .await;
    rig.kill(p);
    assert!(
        rig.sim.vm(vm.vmid).is_some_and(|v| v.flock > 0),
        "the kill came during the destroy"
    );

    let (p, mut c) = rig.start().await;
    resumed_line(&p, &id, "DELETING", &op);
    wait_state(&mut c, &id, MachineState::Speculative, WITHIN).await;
    assert_eq!(delete(&mut c, &id).await, op, "a retry's operation id");
    one_vm_each(&rig.sim, &[]).await;
    drop(p);
    rig.shutdown().await;
}

/// A Drain killed while its drain command runs lands IDLE, the command run
/// again with the requested grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_killed_during_the_drain_command_lands_idle() {
    let drain_command = format!(
        "{}; echo drained >>\"$BIGFLEET_GUEST_ROOT/run/drained\"",
        gated("drain-started", "drain-go")
    );
    let rig = Rig::new(
        cluster(),
        &[
            "--seed-count",
            "1",
            "--readiness-command=",
            "--drain-command",
            &drain_command,
        ],
    )
    .await;
    let (p, mut c) = rig.start().await;
    let id = slots(&mut c, 1).await.remove(0);
    create(&mut c, &id).await;
    wait_state(&mut c, &id, MachineState::Idle, WITHIN).await;
    configure(&mut c, &id, "true").await;
    let m = wait_state(&mut c, &id, MachineState::Configured, WITHIN).await;
    let op = drain(&mut c, &id).await;
    let started = rig.guest_file(&m, "drain-started");
    until("the drain command to start", WITHIN, || started.exists()).await;
    rig.kill(p);
    std::fs::write(rig.guest_file(&m, "drain-go"), b"").expect("open the gate");

    let (p, mut c) = rig.start().await;
    resumed_line(&p, &id, "DRAINING", &op);
    let idle = wait_state(&mut c, &id, MachineState::Idle, WITHIN).await;
    assert_eq!(drain(&mut c, &id).await, op, "a retry's operation id");
    let runs = std::fs::read_to_string(rig.guest_file(&m, "drained")).expect("drain record");
    let last = runs.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("drained --grace-period=7 --timeout="),
        "the resumed drain keeps the requested grace: {runs:?}"
    );
    one_vm_each(&rig.sim, &[&idle]).await;
    drop(p);
    rig.shutdown().await;
}

/// With a readiness check, a Configure killed while it waits for the node
/// lands CONFIGURED once the node is Ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configure_killed_in_the_readiness_wait_lands_configured() {
    let rig = Rig::new(
        cluster(),
        &[
            "--seed-count",
            "1",
            "--readiness-command",
            "test -e \"$BIGFLEET_GUEST_ROOT/run/ready\"",
        ],
    )
    .await;
    let (p, mut c) = rig.start().await;
    let id = slots(&mut c, 1).await.remove(0);
    create(&mut c, &id).await;
    let m = wait_state(&mut c, &id, MachineState::Idle, WITHIN).await;
    let op = configure(&mut c, &id, "true").await;
    logged(&p, "readiness probe");
    rig.kill(p);
    std::fs::write(rig.guest_file(&m, "ready"), b"").expect("the node is Ready");

    let (p, mut c) = rig.start().await;
    resumed_line(&p, &id, "CONFIGURING", &op);
    let done = wait_state(&mut c, &id, MachineState::Configured, WITHIN).await;
    assert_eq!(done.cluster, "cluster-resume");
    assert_eq!(
        configure(&mut c, &id, "true").await,
        op,
        "a retry's operation id"
    );
    one_vm_each(&rig.sim, &[&done]).await;
    drop(p);
    rig.shutdown().await;
}

/// Without a readiness check, a Configure killed while its bootstrap runs
/// cannot finish (the blob is never stored): FAILED, saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configure_killed_without_readiness_fails_saying_why() {
    let rig = Rig::new(cluster(), &["--seed-count", "1", "--readiness-command="]).await;
    let (p, mut c) = rig.start().await;
    let id = slots(&mut c, 1).await.remove(0);
    create(&mut c, &id).await;
    let m = wait_state(&mut c, &id, MachineState::Idle, WITHIN).await;
    configure(&mut c, &id, &gated("boot-started", "boot-go")).await;
    let started = rig.guest_file(&m, "boot-started");
    until("the bootstrap to start", WITHIN, || started.exists()).await;
    rig.kill(p);
    std::fs::write(rig.guest_file(&m, "boot-go"), b"").expect("open the gate");

    let (p, mut c) = rig.start().await;
    let failed = wait_failed(&mut c, &id, WITHIN).await;
    assert!(
        failed.last_error.starts_with(
            "interrupted by a provider restart while CONFIGURING: the bootstrap blob is never \
             stored"
        ),
        "{}",
        failed.last_error
    );
    // The machine keeps its VM (a reclaim removes it).
    one_vm_each(&rig.sim, &[&failed]).await;
    drop(p);
    rig.shutdown().await;
}

// ---- SIGTERM ----------------------------------------------------------------

/// SIGTERM during 16 concurrent Creates: the process exits 0 within
/// `--shutdown-grace` (what is still running stays CREATING in the state),
/// and after a restart every machine lands IDLE with one VM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_in_a_create_burst_exits_in_grace_and_every_create_lands() {
    const BURST: usize = 16;
    let grace = Duration::from_secs(1);
    let rig = Rig::new(
        SimConfig {
            max_parallel_local_clones: None,
            clone_duration: Duration::from_millis(1500),
            ..cluster()
        },
        &[
            "--seed-count",
            "16",
            "--max-parallel-clones",
            "16",
            "--readiness-command=",
            "--shutdown-grace",
            "1s",
        ],
    )
    .await;
    let (mut p, mut c) = rig.start().await;
    let ids = slots(&mut c, BURST).await;
    let acks = futures::future::join_all(ids.iter().map(|id| {
        let mut c = c.clone();
        async move { create(&mut c, id).await }
    }))
    .await;
    assert_eq!(acks.len(), BURST);
    let asked = Instant::now();
    p.signal(libc::SIGTERM);
    let status = tokio::task::block_in_place(|| p.wait_exit(WITHIN)).expect("exited");
    let took = asked.elapsed();
    assert!(status.success(), "{status:?}; stderr:\n{}", p.stderr());
    assert!(
        took <= grace + Duration::from_secs(3),
        "SIGTERM to exit took {took:?} (grace {grace:?}); stderr:\n{}",
        p.stderr()
    );
    logged(
        &p,
        "shutdown grace ended with transitions in flight; they resume at the next start",
    );
    drop(p);

    let (p, mut c) = rig.start().await;
    logged(&p, RESUMING);
    let mut landed = Vec::new();
    for (id, op) in ids.iter().zip(&acks) {
        landed.push(wait_state(&mut c, id, MachineState::Idle, WITHIN).await);
        assert_eq!(
            &create(&mut c, id).await,
            op,
            "{id}: a retry's operation id"
        );
    }
    let refs: Vec<&Machine> = landed.iter().collect();
    one_vm_each(&rig.sim, &refs).await;
    drop(p);
    rig.shutdown().await;
}

// ---- resumed_total ------------------------------------------------------

/// One restart finds a Create, a Configure (no readiness check) and a Delete
/// in flight: the metric counts each by transition and outcome, every other
/// pair 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumed_total_counts_what_a_restart_found() {
    let rig = Rig::new(
        SimConfig {
            destroy_duration: Duration::from_secs(2),
            // PVE's: the restarted provider's destroy worker waits out the
            // first one's config lock, then finds the config gone.
            lock_wait: Duration::from_secs(10),
            ..cluster()
        },
        &["--seed-count", "3", "--readiness-command="],
    )
    .await;
    let (p, mut c) = rig.start().await;
    let ids = slots(&mut c, 3).await;
    let (creating, configuring, deleting) = (&ids[0], &ids[1], &ids[2]);
    create(&mut c, configuring).await;
    create(&mut c, deleting).await;
    let m = wait_state(&mut c, configuring, MachineState::Idle, WITHIN).await;
    wait_state(&mut c, deleting, MachineState::Idle, WITHIN).await;
    configure(&mut c, configuring, &gated("boot-started", "boot-go")).await;
    let started = rig.guest_file(&m, "boot-started");
    until("the bootstrap to start", WITHIN, || started.exists()).await;
    delete(&mut c, deleting).await;
    until("the destroy to start", WITHIN, || {
        rig.sim.call_count(DESTROY) > 0
    })
    .await;
    rig.sim
        .faults()
        .fail_next(CLONE_POST, u32::MAX, 595, "no route");
    create(&mut c, creating).await;
    clone_refused(&p);
    rig.kill(p);
    rig.sim.faults().clear();
    std::fs::write(rig.guest_file(&m, "boot-go"), b"").expect("open the gate");

    let (p, mut c) = rig.start().await;
    let idle = wait_state(&mut c, creating, MachineState::Idle, WITHIN).await;
    wait_state(&mut c, deleting, MachineState::Speculative, WITHIN).await;
    let failed = wait_failed(&mut c, configuring, WITHIN).await;
    let (_, exp) = scrape(&p);
    for transition in ["Create", "Configure", "Drain", "Delete"] {
        for outcome in ["landed", "failed", "timed_out", "not_resumable"] {
            let want = match (transition, outcome) {
                ("Create" | "Delete", "landed") | ("Configure", "not_resumable") => 1.0,
                _ => 0.0,
            };
            let got = exp.must(
                "bigfleet_proxmox_resumed_total",
                &[("transition", transition), ("outcome", outcome)],
            );
            assert_eq!(got, want, "resumed_total{{{transition},{outcome}}}");
        }
    }
    one_vm_each(&rig.sim, &[&idle, &failed]).await;
    drop(p);
    rig.shutdown().await;
}
