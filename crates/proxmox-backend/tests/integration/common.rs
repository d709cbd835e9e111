//! Set-up shared by the substrate's tests against pve-sim: the simulator, a
//! client that trusts it, the substrate's options, Create requests and a
//! one-type catalog behind a `ProxmoxBackend`. Per-test differences are
//! parameters or struct-update overrides at the call site.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use proxmox_backend::backend::ProxmoxBackend;
use proxmox_backend::catalog::{expand_slots, InstanceType, Offering, Pricing};
use proxmox_backend::proxmox::{PveOptions, PveSubstrate};
use proxmox_backend::substrate::CloneRequest;
use pve::{PveClient, PveConfig, RetryPolicy};
use pve_sim::{GuestOutput, PveSim, SimConfig, Vm};

pub async fn sim_with(cfg: SimConfig) -> PveSim {
    PveSim::start(cfg).await.expect("simulator")
}

/// The simulator with short clones and guest-agent boots and no RRD lag.
pub fn fast_sim(clone: Duration, agent_boot: Duration) -> SimConfig {
    SimConfig {
        clone_duration: clone,
        agent_boot_delay: agent_boot,
        rrd_lag: Duration::ZERO,
        ..SimConfig::default()
    }
}

/// A client config for the simulator's API token that trusts its CA, with
/// the default timeouts and retries.
pub fn config(sim: &PveSim) -> PveConfig {
    let mut cfg = PveConfig::new(sim.base_url(), sim.token_id(), sim.token_secret());
    cfg.ca_pem = Some(sim.ca_pem().as_bytes().to_vec());
    cfg
}

/// [`config`] with a 10 s request timeout and `max_attempts` tries, backing
/// off from `initial_backoff` up to `max_backoff`.
pub fn config_retrying(
    sim: &PveSim,
    max_attempts: u32,
    initial_backoff: Duration,
    max_backoff: Duration,
) -> PveConfig {
    let mut cfg = config(sim);
    cfg.request_timeout = Duration::from_secs(10);
    cfg.retry = RetryPolicy {
        max_attempts,
        initial_backoff,
        max_backoff,
    };
    cfg
}

pub fn client_of(cfg: PveConfig) -> PveClient {
    PveClient::new(cfg).expect("client")
}

/// The usual client: 5 tries, backing off from 20 ms up to 200 ms.
pub fn client(sim: &PveSim) -> PveClient {
    client_of(config_retrying(
        sim,
        5,
        Duration::from_millis(20),
        Duration::from_millis(200),
    ))
}

/// A client that gives up sooner: 3 tries, backing off from 20 ms up to
/// 100 ms.
pub fn client_3_tries(sim: &PveSim) -> PveClient {
    client_of(config_retrying(
        sim,
        3,
        Duration::from_millis(20),
        Duration::from_millis(100),
    ))
}

/// Options in the `bigfleet` pool that poll every 50 ms and give tasks, the
/// guest agent and guest commands `timeout` each.
pub fn opts(timeout: Duration) -> PveOptions {
    PveOptions {
        pool: Some("bigfleet".into()),
        task_timeout: timeout,
        agent_timeout: timeout,
        exec_timeout: timeout,
        poll_interval: Duration::from_millis(50),
        ..PveOptions::default()
    }
}

/// [`opts`] with 4 clones in parallel, retrying transient failures for
/// `retry_window` and waiting `ambiguous_settle` before judging a clone
/// whose answer was lost.
pub fn opts_retrying(
    timeout: Duration,
    retry_window: Duration,
    ambiguous_settle: Duration,
) -> PveOptions {
    PveOptions {
        max_parallel_clones: 4,
        retry_window,
        ambiguous_settle,
        ..opts(timeout)
    }
}

/// The Create of a `pve.small` (2 vCPU, 2 GiB) on `node` from template
/// 9000, as operation `op-1`.
pub fn req(machine_id: &str, node: &str) -> CloneRequest {
    CloneRequest {
        machine_id: machine_id.into(),
        operation_id: "op-1".into(),
        instance_type: "pve.small".into(),
        node: node.into(),
        template_vmid: 9000,
        vcpu: 2,
        memory_mib: 2048,
        resumed: false,
    }
}

pub fn assert_no_violations(sim: &PveSim) {
    let v = sim.schema_violations();
    assert!(v.is_empty(), "schema violations: {v:?}");
}

/// The simulator's VMs that are not templates.
pub fn clones(sim: &PveSim) -> Vec<Vm> {
    sim.vms().into_values().filter(|v| !v.template).collect()
}

/// API calls the simulator has answered since its counts were last reset.
pub fn total_calls(sim: &PveSim) -> u64 {
    sim.faults().counts().values().sum()
}

/// Answers every guest command whose line contains `needle` with exit 0,
/// and records those lines.
pub fn record_commands(sim: &PveSim, needle: &'static str) -> Arc<parking_lot::Mutex<Vec<String>>> {
    let seen = Arc::new(parking_lot::Mutex::new(Vec::<String>::new()));
    let seen2 = seen.clone();
    sim.add_guest_handler(move |e| {
        let line = e.command_line();
        line.contains(needle).then(|| {
            seen2.lock().push(line.clone());
            GuestOutput::exit(0)
        })
    });
    seen
}

/// A backend over `sub` offering `count` `pve.small` slots (2 vCPU, 2 GiB,
/// template 9000) on `zone`, of the nodes `zones`, priced per vCPU and GiB;
/// returned with the slots' ids.
pub fn small_backend(
    provider: &str,
    zone: &str,
    count: i64,
    zones: &[&str],
    sub: PveSubstrate,
) -> (ProxmoxBackend, Vec<String>) {
    let types = BTreeMap::from([(
        "pve.small".to_string(),
        InstanceType {
            vcpu: 2,
            memory_mib: 2048,
            template_vmid: 9000,
            storage: None,
            balloon_mib: None,
            disk_gib: None,
            pci: None,
        },
    )]);
    let pricing = || Pricing {
        explicit: Default::default(),
        per_vcpu_hour: 0.003,
        per_gib_hour: 0.0008,
    };
    let offerings = vec![Offering {
        instance_type: "pve.small".into(),
        zone: zone.into(),
        capacity_type: String::new(),
        count,
        resources: Default::default(),
        labels: Default::default(),
    }];
    let zones: Vec<String> = zones.iter().map(|z| z.to_string()).collect();
    let slots =
        expand_slots(provider, &offerings, &types, Some(&zones), &pricing()).expect("slots");
    let ids = slots.iter().map(|s| s.id.clone()).collect();
    let backend = ProxmoxBackend::new(slots, types, pricing(), Arc::new(sub));
    (backend, ids)
}

/// Options for the robustness tests: 20 s per task, transient failures
/// retried for 15 s, a lost clone answer judged after 500 ms.
pub fn fast_retrying() -> PveOptions {
    opts_retrying(
        Duration::from_secs(20),
        Duration::from_secs(15),
        Duration::from_millis(500),
    )
}

/// The simulator with 150 ms clones and 100 ms agent boots.
pub fn fast_sim_150() -> SimConfig {
    fast_sim(Duration::from_millis(150), Duration::from_millis(100))
}

/// Waits (bounded, 10 s) until `cond` holds on the simulator.
pub async fn until(what: &str, cond: impl FnMut() -> bool) {
    provider_testkit::wait::until(what, Duration::from_secs(10), cond).await
}

/// The `q` quantile of `v` by nearest rank (0 for none): the benchmarks'
/// median and p95, one definition for all of them.
pub fn quantile(mut v: Vec<f64>, q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 - 1.0) * q).round() as usize;
    v.get(i).copied().unwrap_or(0.0)
}

/// What the agent requests PVE held through boots cost the nodes'
/// pvedaemon workers (see `PveSim::agent_waits`): how many were held, for
/// how long in all, and the most held at once on one node; and the
/// protected calls that queued for a worker meanwhile.
pub fn held_agent_requests(sim: &PveSim) -> String {
    let sum = |waits: BTreeMap<String, pve_sim::Waits>| {
        let requests: u64 = waits.values().map(|w| w.requests).sum();
        let total: Duration = waits.values().map(|w| w.total).sum();
        let peak = waits.values().map(|w| w.peak).max().unwrap_or(0);
        (requests, total.as_secs_f64(), peak)
    };
    let (held, held_s, held_peak) = sum(sim.agent_waits());
    let (queued, queued_s, _) = sum(sim.daemon_queue());
    format!(
        "{held} agent requests held through boots ({held_s:.1} s in all, at most {held_peak} at once on a node), \
         {queued} protected calls queued for a pvedaemon worker ({queued_s:.1} s in all)"
    )
}
