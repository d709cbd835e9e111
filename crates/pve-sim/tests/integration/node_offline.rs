//! A node that powers off (`POST /_sim/nodes/{node}/offline`), as PVE shows
//! it: calls routed to it hang the unanswered ARP, then 595; the node lists
//! say offline; its VMs keep their last RRD sample in `/cluster/resources`
//! until it expires; its tasks die, and a clone leaves `lock: clone` on a VM
//! outside the pool.

use std::time::{Duration, Instant};

use pve_sim::SimConfig;
use serde_json::Value;

use crate::common::{start_sim, Api};

fn cfg(offline_delay: Duration, rrd_expiry: Duration) -> SimConfig {
    SimConfig {
        rrd_lag: Duration::ZERO,
        offline_delay,
        rrd_expiry,
        ..SimConfig::default()
    }
}

async fn admin(api: &Api, sim: &pve_sim::PveSim, path: &str) -> u16 {
    let url = format!("{}/_sim/{path}", api.base.trim_end_matches("/api2/json"));
    api.c
        .post(&url)
        .header("authorization", sim.auth_header())
        .send()
        .await
        .expect("admin call")
        .status()
        .as_u16()
}

fn vm_row(r: &Value, vmid: u64) -> Value {
    r.as_array()
        .and_then(|a| a.iter().find(|v| v["vmid"] == vmid))
        .cloned()
        .unwrap_or(Value::Null)
}

#[tokio::test]
async fn an_offline_node_answers_595_after_the_delay_and_is_listed_offline() {
    let delay = Duration::from_millis(400);
    let (sim, api) = start_sim(cfg(delay, Duration::from_secs(300))).await;
    assert_eq!(admin(&api, &sim, "nodes/pve2/offline").await, 200);
    assert_eq!(admin(&api, &sim, "nodes/nope/offline").await, 404);

    let t0 = Instant::now();
    let r = api.get("/nodes/pve2/qemu", &[]).await;
    assert_eq!((r.status, r.message().as_str()), (595, "No route to host"));
    assert!(t0.elapsed() >= delay, "answered after {:?}", t0.elapsed());
    // A call to a live node does not wait.
    let t0 = Instant::now();
    assert_eq!(api.get("/nodes/pve1/qemu", &[]).await.status, 200);
    assert!(t0.elapsed() < delay, "answered after {:?}", t0.elapsed());

    let nodes = api.get("/nodes", &[]).await;
    let pve2 = nodes.data().as_array().unwrap()[1].clone();
    assert_eq!(
        (pve2["node"].as_str(), pve2["status"].as_str()),
        (Some("pve2"), Some("offline"))
    );
    assert!(
        pve2.get("maxmem").is_none() && pve2.get("mem").is_none(),
        "{pve2}"
    );
    let cs = api.get("/cluster/status", &[]).await;
    assert_eq!(cs.data()[2]["name"], "pve2");
    assert_eq!(cs.data()[2]["online"], 0);

    assert_eq!(admin(&api, &sim, "nodes/pve2/online").await, 200);
    let t0 = Instant::now();
    assert_eq!(api.get("/nodes/pve2/qemu", &[]).await.status, 200);
    assert!(t0.elapsed() < delay);
    sim.shutdown().await;
}

#[tokio::test]
async fn an_offline_nodes_vms_keep_their_last_sample_until_it_expires() {
    let expiry = Duration::from_millis(1500);
    let (sim, api) = start_sim(cfg(Duration::ZERO, expiry)).await;
    let r = api
        .post(
            "/nodes/pve1/qemu/9000/clone",
            &[("newid", "300"), ("name", "web-1")],
        )
        .await;
    api.wait_task_of(r).await;
    sim.update_vm(300, |vm| vm.tags = Some("bigfleet".into()));
    api.wait_task_of(api.post("/nodes/pve1/qemu/300/status/start", &[]).await)
        .await;
    let went = Instant::now();
    assert!(sim.set_node_online("pve1", false));

    let rows = api.get("/cluster/resources", &[("type", "vm")]).await;
    let row = vm_row(rows.data(), 300);
    assert_eq!(row["status"], "running", "the last sample: {row}");
    assert_eq!(row["name"], "web-1");
    assert_eq!(vm_row(rows.data(), 9000)["template"], 1);

    let row = api
        .poll(
            "the sample to expire",
            reqwest::Method::GET,
            "/cluster/resources?type=vm",
            |r| vm_row(r.data(), 300)["status"] == "unknown",
        )
        .await;
    assert!(
        went.elapsed() >= expiry,
        "expired after {:?}",
        went.elapsed()
    );
    let row = vm_row(row.data(), 300);
    assert!(row.get("name").is_none(), "{row}");
    assert!(row.get("template").is_none(), "{row}");
    // `tags`, like `lock` and `pool`, is read from the cluster filesystem
    // (pve-manager `API2/Cluster.pm`), not from the RRD sample.
    assert_eq!(row["tags"], "bigfleet");
    assert_eq!(row["node"], "pve1");

    // Back online, pvestatd samples it again.
    sim.set_node_online("pve1", true);
    let rows = api.get("/cluster/resources", &[("type", "vm")]).await;
    assert_eq!(vm_row(rows.data(), 300)["name"], "web-1");
    sim.shutdown().await;
}

#[tokio::test]
async fn a_clone_on_a_node_that_powers_off_dies_leaving_lock_clone_outside_the_pool() {
    let (sim, api) = start_sim(SimConfig {
        clone_duration: Duration::from_secs(30),
        ..cfg(Duration::ZERO, Duration::from_secs(300))
    })
    .await;
    let r = api
        .post(
            "/nodes/pve1/qemu/9000/clone",
            &[("newid", "301"), ("pool", "bigfleet"), ("full", "1")],
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let upid = r.data().as_str().unwrap().to_string();
    assert!(sim.set_node_online("pve1", false));
    sim.set_node_online("pve1", true);

    let vm = sim.vm(301).expect("the half-made VM stays");
    assert_eq!(vm.lock.as_deref(), Some("clone"));
    assert_eq!(vm.pool, None, "added to the pool only at the clone's end");
    assert_eq!(vm.flock, 0, "the config file lock died with the worker");
    let st = api
        .get(&format!("/nodes/pve1/tasks/{upid}/status"), &[])
        .await;
    assert_eq!(st.data()["status"], "stopped");
    assert_eq!(st.data()["exitstatus"], "unexpected status");
    // The worker died before its last line: the log has no `TASK …` line,
    // which is why the status reads `unexpected status`.
    let log = api
        .get(
            &format!("/nodes/pve1/tasks/{upid}/log"),
            &[("start", "0"), ("limit", "500")],
        )
        .await;
    let lines = log.data().as_array().expect("log lines").clone();
    assert!(
        lines
            .iter()
            .all(|l| !l["t"].as_str().unwrap_or_default().starts_with("TASK ")),
        "{lines:?}"
    );
    let active = api.get("/nodes/pve1/tasks", &[("source", "active")]).await;
    assert!(
        active
            .data()
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t["status"] != "RUNNING"),
        "{:?}",
        active.data()
    );
    // Destroy is refused by the lock, as `check_lock` does for anyone but
    // root with `skiplock`.
    let r = api.delete("/nodes/pve1/qemu/301", &[]).await;
    let done = api.wait_task_of(r).await;
    assert_eq!(done["exitstatus"], "VM is locked (clone)");
    sim.shutdown().await;
}
