//! Drives the simulator over HTTPS with a plain client, as the real backend would.

use std::sync::Arc;
use std::time::Duration;

use pve_sim::{endpoints, GuestOutput, PveSim, SimConfig, TemplateSpec};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common::{shutdown_clean, start_sim, urlencode, Api};

fn fast_cfg() -> SimConfig {
    SimConfig {
        templates: vec![
            TemplateSpec::local(9000, "pve1"),
            TemplateSpec::shared(9001, "pve1"),
        ],
        clone_duration: Duration::from_millis(300),
        agent_boot_delay: Duration::from_millis(300),
        // Shorter than the boot, so a ping right after the start is refused.
        agent_ping_wait: Duration::from_millis(50),
        lock_wait: Duration::from_millis(50),
        ha_delay: Duration::from_millis(200),
        ..SimConfig::default()
    }
}

async fn clone_and_wait(api: &Api, newid: &str) -> Value {
    let r = api
        .post(
            "/nodes/pve1/qemu/9000/clone",
            &[
                ("newid", newid),
                ("name", &format!("bigfleet-{newid}")),
                ("full", "1"),
                ("pool", "bigfleet"),
            ],
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let upid = r.data().as_str().expect("upid").to_string();
    api.wait_task(&upid).await
}

async fn start_and_wait(api: &Api, node: &str, vmid: &str) -> Value {
    let r = api
        .post(&format!("/nodes/{node}/qemu/{vmid}/status/start"), &[])
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    api.wait_task(r.data().as_str().expect("upid")).await
}

#[tokio::test]
async fn auth_is_required() {
    let sim = PveSim::start(fast_cfg()).await.unwrap();
    let mut api = Api::new(&sim);
    assert_eq!(api.get("/nodes", &[]).await.status, 200);
    api.auth = None;
    assert_eq!(api.get("/nodes", &[]).await.status, 401);
    api.auth = Some(format!("PVEAPIToken={}=wrong", sim.token_id()));
    let r = api.get("/nodes", &[]).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.message(), "authentication failure");
    sim.shutdown().await;
}

#[tokio::test]
async fn full_lifecycle_clone_config_start_agent_destroy() {
    // Windows long enough that the in-progress checks below cannot race the
    // clone's end or the agent's boot on a loaded machine.
    let sim = PveSim::start(SimConfig {
        clone_duration: Duration::from_millis(1500),
        agent_boot_delay: Duration::from_millis(1000),
        ..fast_cfg()
    })
    .await
    .unwrap();
    let api = Api::new(&sim);

    // nextid reserves nothing: asking twice yields the same id.
    let a = api.get("/cluster/nextid", &[]).await;
    let b = api.get("/cluster/nextid", &[]).await;
    assert_eq!(a.data(), "100");
    assert_eq!(a.data(), b.data());

    let r = api
        .post(
            "/nodes/pve1/qemu/9000/clone",
            &[
                ("newid", "100"),
                ("name", "bigfleet-a"),
                ("full", "1"),
                ("pool", "bigfleet"),
                (
                    "description",
                    "BigFleet managed VM. machine_id=m1 operation_id=o1",
                ),
            ],
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let upid = r.data().as_str().unwrap().to_string();
    let re = regex::Regex::new(
        r"^UPID:pve1:[0-9A-F]{8}:[0-9A-F]{8}:[0-9A-F]{8}:qmclone:9000:bigfleet@pve!autoscaler:$",
    )
    .unwrap();
    assert!(re.is_match(&upid), "{upid}");

    // While the clone runs: lock=clone, config update times out, id is taken.
    let st = api.get("/nodes/pve1/qemu/100/status/current", &[]).await;
    assert_eq!(st.data()["lock"], "clone");
    let r = api
        .put("/nodes/pve1/qemu/100/config", &[("cores", "4")])
        .await;
    assert_eq!(r.status, 500);
    assert_eq!(
        r.message(),
        "can't lock file '/var/lock/qemu-server/lock-100.conf' - got timeout"
    );
    let r = api.get("/cluster/nextid", &[("vmid", "100")]).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.body["errors"]["vmid"], "VM 100 already exists");
    let r = api
        .post("/nodes/pve1/qemu/9000/clone", &[("newid", "100")])
        .await;
    assert_eq!(r.status, 500);
    assert!(r.message().contains("already exists"), "{}", r.message());
    let r = api.post("/nodes/pve1/qemu/100/status/start", &[]).await;
    let t = api.wait_task(r.data().as_str().unwrap()).await;
    assert_eq!(
        t["exitstatus"],
        "can't lock file '/var/lock/qemu-server/lock-100.conf' - got timeout"
    );

    let t = api.wait_task(&upid).await;
    assert_eq!(t["exitstatus"], "OK");
    assert_eq!(t["type"], "qmclone");
    let log = api
        .get(&format!("/nodes/pve1/tasks/{}/log", urlencode(&upid)), &[])
        .await;
    let lines: Vec<&str> = log
        .data()
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["t"].as_str().unwrap())
        .collect();
    assert_eq!(lines.last(), Some(&"TASK OK"));
    assert!(lines[0].starts_with("create full clone of drive scsi0"));
    assert!(sim.vm(100).unwrap().lock.is_none());

    // Size and mark; tags are normalised.
    let r = api
        .put(
            "/nodes/pve1/qemu/100/config",
            &[
                ("cores", "4"),
                ("memory", "4096"),
                ("tags", "Bigfleet;bigfleet-M1,zeta bigfleet"),
            ],
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let cfg = api.get("/nodes/pve1/qemu/100/config", &[]).await;
    assert_eq!(cfg.data()["tags"], "bigfleet;bigfleet-m1;zeta");
    assert_eq!(cfg.data()["cores"], 4);
    assert_eq!(cfg.data()["memory"], "4096");
    // PVE keeps the description as a comment block: it comes back with "\n".
    assert_eq!(
        cfg.data()["description"],
        "BigFleet managed VM. machine_id=m1 operation_id=o1\n"
    );
    assert_eq!(cfg.data()["digest"].as_str().unwrap().len(), 40);

    // Async config returns a qmconfig task.
    let r = api
        .post("/nodes/pve1/qemu/100/config", &[("description", "changed")])
        .await;
    let t = api.wait_task(r.data().as_str().unwrap()).await;
    assert_eq!(t["exitstatus"], "OK");
    assert_eq!(sim.vm(100).unwrap().description.as_deref(), Some("changed"));

    // Inventory: no description, tags/pool present.
    let res = api.get("/cluster/resources", &[("type", "vm")]).await;
    let row = res
        .data()
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["vmid"] == 100)
        .unwrap()
        .clone();
    assert_eq!(row["id"], "qemu/100");
    assert_eq!(row["tags"], "bigfleet;bigfleet-m1;zeta");
    assert_eq!(row["pool"], "bigfleet");
    assert!(row.get("description").is_none());
    // Brand new: pvestatd has not sampled it yet, so no RRD-sourced fields,
    // and PVE says `unknown` for its status.
    assert_eq!(row["status"], "unknown");
    for k in ["name", "maxmem", "maxcpu", "uptime", "template"] {
        assert!(row.get(k).is_none(), "{k} present in {row}");
    }
    let on_node = api.get("/nodes/pve1/qemu", &[]).await;
    let vm100 = on_node
        .data()
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["vmid"] == 100)
        .unwrap()
        .clone();
    assert_eq!(vm100["status"], "stopped");
    assert_eq!(vm100["cpus"], 4);
    let pool = api.get("/pools", &[("poolid", "bigfleet")]).await;
    assert_eq!(pool.data()[0]["members"][0]["vmid"], 100);
    let pool = api.get("/pools/bigfleet", &[]).await;
    assert_eq!(pool.data()["members"][0]["id"], "qemu/100");

    // Agent: stopped VM, then booting, then up.
    let r = api.post("/nodes/pve1/qemu/100/agent/ping", &[]).await;
    assert_eq!(r.message(), "VM 100 is not running");
    let t = start_and_wait(&api, "pve1", "100").await;
    assert_eq!(t["exitstatus"], "OK");
    let r = api.post("/nodes/pve1/qemu/100/agent/ping", &[]).await;
    assert_eq!(
        (r.status, r.message().as_str()),
        (500, "QEMU guest agent is not running")
    );
    let r = api
        .wait_for(
            "agent",
            || {
                (
                    reqwest::Method::POST,
                    "/nodes/pve1/qemu/100/agent/ping".into(),
                )
            },
            |r| r.status == 200,
        )
        .await;
    assert_eq!(r.data()["result"], serde_json::json!({}));

    // file-write then exec the written file; output arrives once, at exit.
    let script = "echo hello; echo oops >&2; test -n \"$BIGFLEET_GUEST_ROOT\" && exit 3";
    let r = api
        .post(
            "/nodes/pve1/qemu/100/agent/file-write",
            &[("file", "/run/bigfleet-bootstrap"), ("content", script)],
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(
        sim.read_guest_file(100, "/run/bigfleet-bootstrap").unwrap(),
        script.as_bytes()
    );
    let r = api
        .post(
            "/nodes/pve1/qemu/100/agent/exec",
            &[
                ("command", "/bin/sh"),
                ("command", "/run/bigfleet-bootstrap"),
            ],
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let pid = r.data()["pid"].as_u64().unwrap().to_string();
    let path = format!("/nodes/pve1/qemu/100/agent/exec-status?pid={pid}");
    let done = api
        .wait_for(
            "exec",
            || (reqwest::Method::GET, path.clone()),
            |r| r.data()["exited"] == 1,
        )
        .await;
    assert_eq!(done.data()["exitcode"], 3);
    assert_eq!(done.data()["out-data"], "hello\n");
    assert_eq!(done.data()["err-data"], "oops\n");
    let again = api
        .get("/nodes/pve1/qemu/100/agent/exec-status", &[("pid", &pid)])
        .await;
    assert_eq!(
        again.status, 500,
        "pid must be forgotten after the exited reply"
    );

    // Destroy is refused while running; stop then destroy works.
    let r = api
        .delete(
            "/nodes/pve1/qemu/100",
            &[("purge", "1"), ("destroy-unreferenced-disks", "1")],
        )
        .await;
    assert_eq!(
        (r.status, r.message().as_str()),
        (500, "VM 100 is running - destroy failed")
    );
    let r = api.post("/nodes/pve1/qemu/100/status/stop", &[]).await;
    assert_eq!(
        api.wait_task(r.data().as_str().unwrap()).await["exitstatus"],
        "OK"
    );
    let r = api
        .delete(
            "/nodes/pve1/qemu/100",
            &[("purge", "1"), ("destroy-unreferenced-disks", "1")],
        )
        .await;
    assert!(r.data().as_str().unwrap().contains(":qmdestroy:100:"));
    assert_eq!(
        api.wait_task(r.data().as_str().unwrap()).await["exitstatus"],
        "OK"
    );
    assert!(sim.vm(100).is_none());
    let r = api.get("/nodes/pve1/qemu/100/status/current", &[]).await;
    assert_eq!(
        r.message(),
        "Configuration file 'nodes/pve1/qemu-server/100.conf' does not exist"
    );

    shutdown_clean(sim).await;
}

#[tokio::test]
async fn exec_input_data_json_body_and_guest_handlers() {
    let sim = PveSim::start(SimConfig {
        agent_boot_delay: Duration::ZERO,
        ..fast_cfg()
    })
    .await
    .unwrap();
    let api = Api::new(&sim);
    clone_and_wait(&api, "101").await;
    start_and_wait(&api, "pve1", "101").await;

    // JSON body with an array command and stdin.
    let r = api
        .c
        .post(format!("{}/nodes/pve1/qemu/101/agent/exec", api.base))
        .header("authorization", sim.auth_header())
        .json(&serde_json::json!({"command": ["/bin/sh", "-c", "cat; pwd"], "input-data": "from-stdin\n"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let pid = r.json::<Value>().await.unwrap()["data"]["pid"]
        .as_u64()
        .unwrap();
    let path = format!("/nodes/pve1/qemu/101/agent/exec-status?pid={pid}");
    let done = api
        .wait_for(
            "exec",
            || (reqwest::Method::GET, path.clone()),
            |r| r.data()["exited"] == 1,
        )
        .await;
    let root = sim.guest_root(101);
    let out = done.data()["out-data"].as_str().unwrap().to_string();
    assert_eq!(
        out,
        format!("from-stdin\n{}\n", root.canonicalize().unwrap().display())
    );

    // The guest has no kubectl: a handler models it.
    sim.on_guest_command(
        "kubectl drain",
        GuestOutput::exit(1).with_stderr("error: cannot evict pod"),
    );
    let r = api
        .post(
            "/nodes/pve1/qemu/101/agent/exec",
            &[
                ("command", "/bin/sh"),
                ("command", "-c"),
                (
                    "command",
                    "kubectl drain \"$(hostname)\" --ignore-daemonsets",
                ),
            ],
        )
        .await;
    let pid = r.data()["pid"].as_u64().unwrap();
    let path = format!("/nodes/pve1/qemu/101/agent/exec-status?pid={pid}");
    let done = api
        .wait_for(
            "drain",
            || (reqwest::Method::GET, path.clone()),
            |r| r.data()["exited"] == 1,
        )
        .await;
    assert_eq!(done.data()["exitcode"], 1);
    assert_eq!(done.data()["err-data"], "error: cannot evict pod");

    // Dropped exec-status reply: the exit is consumed and lost.
    sim.faults().drop_exec_status_replies(1);
    let r = api
        .post(
            "/nodes/pve1/qemu/101/agent/exec",
            &[("command", "/bin/true")],
        )
        .await;
    let pid = r.data()["pid"].as_u64().unwrap();
    let path = format!("/nodes/pve1/qemu/101/agent/exec-status?pid={pid}");
    let lost = api
        .wait_for(
            "dropped reply",
            || (reqwest::Method::GET, path.clone()),
            |r| r.status != 200 || r.data()["exited"] == 1,
        )
        .await;
    assert_eq!(lost.status, 500);
    assert!(lost.message().contains("got timeout"), "{}", lost.message());
    let after = api
        .get(
            "/nodes/pve1/qemu/101/agent/exec-status",
            &[("pid", &pid.to_string())],
        )
        .await;
    assert_eq!(after.status, 500);
    assert!(after.message().contains("Invalid parameter 'pid'"));

    // A command the guest cannot run fails the exec call itself.
    let r = api
        .post(
            "/nodes/pve1/qemu/101/agent/exec",
            &[("command", "/no/such/binary")],
        )
        .await;
    assert_eq!(r.status, 500);
    assert!(
        r.message().contains("Failed to execute child process"),
        "{}",
        r.message()
    );

    // Agent disabled in config.
    let r = api
        .put("/nodes/pve1/qemu/101/config", &[("agent", "0")])
        .await;
    assert_eq!(r.status, 200);
    let r = api.post("/nodes/pve1/qemu/101/agent/ping", &[]).await;
    assert_eq!(r.message(), "No QEMU guest agent configured");
    shutdown_clean(sim).await;
}

#[tokio::test]
async fn clone_refusals_and_storage_lock_contention() {
    let sim = PveSim::start(SimConfig {
        max_parallel_local_clones: Some(2),
        // All four parallel clones must overlap.
        clone_duration: Duration::from_millis(1000),
        ..fast_cfg()
    })
    .await
    .unwrap();
    let api = Arc::new(Api::new(&sim));

    let r = api
        .post(
            "/nodes/pve1/qemu/9000/clone",
            &[("newid", "200"), ("target", "pve2"), ("full", "1")],
        )
        .await;
    assert_eq!(
        (r.status, r.message().as_str()),
        (500, "can't clone VM to node 'pve2' (VM uses local storage)")
    );
    // Shared storage may go elsewhere.
    let r = api
        .post(
            "/nodes/pve1/qemu/9001/clone",
            &[("newid", "201"), ("target", "pve2"), ("full", "1")],
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(
        api.wait_task(r.data().as_str().unwrap()).await["exitstatus"],
        "OK"
    );
    assert_eq!(sim.vm(201).unwrap().node, "pve2");

    // Linked clone is the template default.
    let r = api
        .post("/nodes/pve1/qemu/9000/clone", &[("newid", "202")])
        .await;
    api.wait_task(r.data().as_str().unwrap()).await;
    let log = api
        .get(
            &format!(
                "/nodes/pve1/tasks/{}/log",
                urlencode(r.data().as_str().unwrap())
            ),
            &[],
        )
        .await;
    assert!(log.data()[0]["t"]
        .as_str()
        .unwrap()
        .starts_with("create linked clone"));

    // Four parallel local clones with a limit of two: two fail on the storage lock.
    let mut handles = Vec::new();
    for id in 210..214 {
        let api = Arc::clone(&api);
        handles.push(tokio::spawn(async move {
            clone_and_wait(&api, &id.to_string()).await
        }));
    }
    let mut ok = 0;
    let mut failed = Vec::new();
    for h in handles {
        let t = h.await.unwrap();
        if t["exitstatus"] == "OK" {
            ok += 1;
        } else {
            failed.push(t["exitstatus"].as_str().unwrap().to_string());
        }
    }
    assert_eq!(ok, 2);
    assert_eq!(failed.len(), 2);
    for f in &failed {
        assert_eq!(f, "clone failed: can't lock file '/var/lock/pve-manager/pve-storage-local-lvm' - got timeout");
    }
    assert_eq!(
        sim.vms()
            .keys()
            .filter(|id| (210..214).contains(*id))
            .count(),
        2,
        "failed clones are removed"
    );

    // A leftover lock on the template fails the clone.
    sim.set_lock(9000, Some("clone"));
    let r = api
        .post("/nodes/pve1/qemu/9000/clone", &[("newid", "220")])
        .await;
    assert_eq!(
        (r.status, r.message().as_str()),
        (500, "VM 9000 is locked (clone)")
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn ha_stop_is_async_and_destroy_needs_purge() {
    let sim = PveSim::start(SimConfig {
        ha_delay: Duration::from_millis(1000),
        ..fast_cfg()
    })
    .await
    .unwrap();
    let api = Api::new(&sim);
    clone_and_wait(&api, "300").await;
    sim.set_ha(300, Some("stopped"));
    let r = api.post("/nodes/pve1/qemu/300/status/start", &[]).await;
    let upid = r.data().as_str().unwrap().to_string();
    assert!(upid.contains(":hastart:300:"), "{upid}");
    assert_eq!(api.wait_task(&upid).await["exitstatus"], "OK");
    api.wait_for(
        "ha start",
        || {
            (
                reqwest::Method::GET,
                "/nodes/pve1/qemu/300/status/current".into(),
            )
        },
        |r| r.data()["status"] == "running",
    )
    .await;

    let r = api.post("/nodes/pve1/qemu/300/status/stop", &[]).await;
    let upid = r.data().as_str().unwrap().to_string();
    assert!(upid.contains(":hastop:300:"), "{upid}");
    assert_eq!(api.wait_task(&upid).await["exitstatus"], "OK");
    // Task OK does not mean stopped.
    let st = api.get("/nodes/pve1/qemu/300/status/current", &[]).await;
    assert_eq!(st.data()["status"], "running");
    assert_eq!(st.data()["ha"]["managed"], 1);
    let res = api.get("/cluster/resources", &[("type", "vm")]).await;
    let row = res
        .data()
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["vmid"] == 300)
        .unwrap()
        .clone();
    assert_eq!(row["hastate"], "stopped");
    api.wait_for(
        "ha stop",
        || {
            (
                reqwest::Method::GET,
                "/nodes/pve1/qemu/300/status/current".into(),
            )
        },
        |r| r.data()["status"] == "stopped",
    )
    .await;

    let r = api.delete("/nodes/pve1/qemu/300", &[]).await;
    assert_eq!(
        r.message(),
        "unable to remove VM 300 - used in HA resources and purge parameter not set."
    );
    let r = api.delete("/nodes/pve1/qemu/300", &[("purge", "1")]).await;
    assert_eq!(
        api.wait_task(r.data().as_str().unwrap()).await["exitstatus"],
        "OK"
    );

    // Protection also refuses destroy.
    clone_and_wait(&api, "301").await;
    sim.set_protection(301, true);
    let r = api.delete("/nodes/pve1/qemu/301", &[("purge", "1")]).await;
    assert_eq!(r.message(), "can't remove VM 301 - protection mode enabled");
    sim.shutdown().await;
}

#[tokio::test]
async fn schema_violations_get_400_with_errors_map() {
    let (sim, api) = start_sim(fast_cfg()).await;
    let r = api
        .post(
            "/nodes/pve1/qemu/9000/clone",
            &[("newid", "abc"), ("bogus", "1")],
        )
        .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.message(), "Parameter verification failed.");
    assert_eq!(
        r.body["errors"]["newid"],
        "type check ('integer') failed - got 'abc'"
    );
    assert!(r.body["errors"]["bogus"]
        .as_str()
        .unwrap()
        .contains("not defined in schema"));
    let long = "x".repeat(8193);
    let r = api
        .put(
            "/nodes/pve1/qemu/9000/config",
            &[("description", &long), ("tags", "ok;-bad")],
        )
        .await;
    assert_eq!(r.status, 400);
    assert!(r.body["errors"]["description"]
        .as_str()
        .unwrap()
        .contains("8192"));
    assert!(r.body["errors"]["tags"]
        .as_str()
        .unwrap()
        .contains("invalid tag"));
    let r = api.get("/nodes/pve1/qemu/9000/nonsense", &[]).await;
    assert_eq!(r.status, 501);
    let v = sim.schema_violations();
    assert_eq!(v.len(), 3);
    assert_eq!(v[0].endpoint.as_deref(), Some(endpoints::CLONE));
    assert!(v[0].schema_errors.as_ref().unwrap().contains_key("newid"));
    sim.shutdown().await;
}

#[tokio::test]
async fn fault_injection_counters_and_offline_node() {
    let (sim, api) = start_sim(SimConfig {
        offline_delay: Duration::ZERO,
        ..fast_cfg()
    })
    .await;
    sim.faults()
        .fail_next(endpoints::CLONE, 1, 500, "injected boom");
    let r = api
        .post("/nodes/pve1/qemu/9000/clone", &[("newid", "400")])
        .await;
    assert_eq!((r.status, r.message().as_str()), (500, "injected boom"));
    let r = api
        .post("/nodes/pve1/qemu/9000/clone", &[("newid", "400")])
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(sim.call_count(endpoints::CLONE), 2);
    sim.reset_counts();
    assert_eq!(sim.call_count(endpoints::CLONE), 0);

    sim.faults()
        .set_latency(endpoints::NODES, Duration::from_millis(150));
    let t0 = std::time::Instant::now();
    api.get("/nodes", &[]).await;
    assert!(t0.elapsed() >= Duration::from_millis(150));
    sim.faults().clear();

    // Offline node: 595 for calls proxied to it; shown offline elsewhere.
    // VM 400 is too new to have an RRD sample: `unknown` (`node_offline.rs`
    // has the last sample of an older VM and its expiry).
    api.wait_task(r.data().as_str().unwrap()).await;
    sim.set_node_online("pve1", false);
    let r = api.get("/nodes/pve1/qemu/400/status/current", &[]).await;
    assert_eq!(r.status, 595);
    let nodes = api.get("/nodes", &[]).await;
    let pve1 = nodes
        .data()
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node"] == "pve1")
        .unwrap()
        .clone();
    assert_eq!(pve1["status"], "offline");
    let res = api.get("/cluster/resources", &[("type", "vm")]).await;
    let row = res
        .data()
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["vmid"] == 400)
        .unwrap()
        .clone();
    assert_eq!(row["status"], "unknown");
    sim.set_node_online("pve1", true);
    assert_eq!(
        api.get("/nodes/pve1/qemu/400/status/current", &[])
            .await
            .status,
        200
    );

    // Admin endpoint: same faults over HTTP.
    let admin = format!("{}/_sim/faults", api.base.trim_end_matches("/api2/json"));
    let r = api
        .c
        .post(&admin)
        .header("authorization", sim.auth_header())
        .json(&serde_json::json!({"endpoint": endpoints::NODES, "count": 1, "status": 596, "message": "Broken pipe"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(api.get("/nodes", &[]).await.status, 596);
    assert_eq!(api.get("/nodes", &[]).await.status, 200);
    sim.shutdown().await;
}

#[tokio::test]
async fn thousand_marked_vms_in_one_inventory_call() {
    let (sim, api) = start_sim(fast_cfg()).await;
    let ids = sim.seed_marked_vms(1000).unwrap();
    assert_eq!(ids.len(), 1000);
    let res = api.get("/cluster/resources", &[("type", "vm")]).await;
    let rows = res.data().as_array().unwrap();
    assert_eq!(rows.len(), 1002, "1000 seeded + 2 templates");
    let marked = rows
        .iter()
        .filter(|r| {
            r["tags"]
                .as_str()
                .is_some_and(|t| t.split(';').any(|t| t == "bigfleet"))
        })
        .count();
    assert_eq!(marked, 1000);
    assert_eq!(sim.call_count(endpoints::RESOURCES), 1);
    let cfg = api
        .get(&format!("/nodes/pve2/qemu/{}/config", ids[1]), &[])
        .await;
    assert!(cfg.data()["description"]
        .as_str()
        .unwrap()
        .starts_with("BigFleet managed VM. machine_id=proxmox/OnDemand/pve.small/pve2/001"));
    sim.shutdown().await;
}

/// The message travels in the reason phrase; the presented leaf matches the
/// advertised fingerprint.
#[tokio::test]
async fn reason_phrase_and_fingerprint_on_the_wire() {
    let sim = PveSim::start(fast_cfg()).await.unwrap();
    let mut roots = rustls::RootCertStore::empty();
    let der = rustls_pki_types::pem::PemObject::from_pem_slice(sim.ca_pem().as_bytes()).unwrap();
    roots.add(der).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let tcp = tokio::net::TcpStream::connect(sim.addr()).await.unwrap();
    let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls = connector.connect(name, tcp).await.unwrap();
    let leaf = tls.get_ref().1.peer_certificates().unwrap()[0].clone();
    assert_eq!(pve_sim::tls::fingerprint_of(&leaf), sim.fingerprint());
    assert!(regex::Regex::new("^([0-9A-F]{2}:){31}[0-9A-F]{2}$")
        .unwrap()
        .is_match(sim.fingerprint()));

    let req = format!(
        "GET /api2/json/nodes/pve1/qemu/999/config HTTP/1.1\r\nHost: localhost\r\nAuthorization: {}\r\nConnection: close\r\n\r\n",
        sim.auth_header()
    );
    tls.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    tls.read_to_end(&mut buf).await.ok();
    let text = String::from_utf8_lossy(&buf);
    let status_line = text.lines().next().unwrap();
    assert_eq!(
        status_line,
        "HTTP/1.1 500 Configuration file 'nodes/pve1/qemu-server/999.conf' does not exist"
    );
    assert!(text.contains(r#""data":null"#));
    sim.shutdown().await;
}

#[tokio::test]
async fn inventory_may_be_stale_and_admin_sets_locks() {
    let sim = PveSim::start(SimConfig {
        resources_staleness: Duration::from_secs(60),
        ..fast_cfg()
    })
    .await
    .unwrap();
    let api = Api::new(&sim);
    let before = api.get("/cluster/resources", &[("type", "vm")]).await;
    clone_and_wait(&api, "500").await;
    let after = api.get("/cluster/resources", &[("type", "vm")]).await;
    assert_eq!(
        before.data(),
        after.data(),
        "stale view must not show the new VM yet"
    );
    let st = api.get("/nodes/pve1/qemu/500/status/current", &[]).await;
    assert_eq!(st.status, 200, "per-VM status is live");

    // Leftover lock set through the admin endpoint: config refused, then cleared.
    let admin = format!(
        "{}/_sim/vms/500/lock",
        api.base.trim_end_matches("/api2/json")
    );
    let send = |body: Value| {
        api.c
            .post(&admin)
            .header("authorization", sim.auth_header())
            .json(&body)
            .send()
    };
    assert_eq!(
        send(serde_json::json!({"lock": "backup"}))
            .await
            .unwrap()
            .status(),
        200
    );
    let r = api
        .put("/nodes/pve1/qemu/500/config", &[("cores", "2")])
        .await;
    assert_eq!(
        (r.status, r.message().as_str()),
        (500, "VM 500 is locked (backup)")
    );
    let r = api.post("/nodes/pve1/qemu/500/status/start", &[]).await;
    assert_eq!(
        api.wait_task(r.data().as_str().unwrap()).await["exitstatus"],
        "VM 500 is locked (backup)"
    );
    assert_eq!(
        send(serde_json::json!({"lock": null}))
            .await
            .unwrap()
            .status(),
        200
    );
    let r = api
        .put("/nodes/pve1/qemu/500/config", &[("cores", "2")])
        .await;
    assert_eq!(r.status, 200);
    sim.shutdown().await;
}

/// `GET /nodes/{node}/tasks` as pve-manager's node_tasks answers it: a
/// running task is listed by `source=active` with `status: "RUNNING"`
/// (`$task->{status} = 'RUNNING' if !$task->{status}`), a finished
/// one by the default archive with its exit status; `typefilter` and
/// `vmid` narrow the list.
#[tokio::test]
async fn the_node_task_index_lists_running_and_finished_tasks() {
    let (sim, api) = start_sim(SimConfig {
        clone_duration: Duration::from_millis(600),
        ..fast_cfg()
    })
    .await;
    let r = api
        .post(
            "/nodes/pve1/qemu/9000/clone",
            &[("newid", "130"), ("name", "bigfleet-130"), ("full", "1")],
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let upid = r.data().as_str().expect("upid").to_string();
    let active = api
        .get(
            "/nodes/pve1/tasks",
            &[("source", "active"), ("typefilter", "qmclone")],
        )
        .await;
    assert_eq!(active.status, 200, "{:?}", active.body);
    let rows = active.data().as_array().expect("a list").clone();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["upid"], upid.as_str());
    assert_eq!(rows[0]["type"], "qmclone");
    assert_eq!(rows[0]["id"], "9000", "a clone's task names its source");
    assert_eq!(rows[0]["user"], sim.token_id());
    assert_eq!(rows[0]["status"], "RUNNING", "running: {rows:?}");
    assert!(rows[0].get("endtime").is_none(), "running: {rows:?}");
    // Another node runs nothing; another type filters it out.
    let other = api.get("/nodes/pve2/tasks", &[("source", "active")]).await;
    assert_eq!(other.data().as_array().map(Vec::len), Some(0));
    let none = api
        .get(
            "/nodes/pve1/tasks",
            &[("source", "active"), ("typefilter", "qmstart")],
        )
        .await;
    assert_eq!(none.data().as_array().map(Vec::len), Some(0));

    api.wait_task(&upid).await;
    let active = api.get("/nodes/pve1/tasks", &[("source", "active")]).await;
    assert_eq!(active.data().as_array().map(Vec::len), Some(0));
    let done = api.get("/nodes/pve1/tasks", &[("vmid", "9000")]).await;
    let rows = done.data().as_array().expect("a list").clone();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["status"], "OK");
    assert!(rows[0]["endtime"].as_u64().is_some());
    shutdown_clean(sim).await;
}

/// `source=all` lists running and ended tasks together, each ended one
/// with its exit status and end time (what the provider's task watch reads
/// instead of each task's status), and `since`/`until` keep the tasks
/// started in that window (pve-manager compares the UPID's start time,
/// both ends inclusive).
#[tokio::test]
async fn the_node_task_index_lists_all_tasks_since_a_start_time() {
    let (sim, api) = start_sim(SimConfig {
        clone_duration: Duration::from_millis(600),
        ..fast_cfg()
    })
    .await;
    let clone = |id: &'static str| {
        let api = &api;
        async move {
            let r = api
                .post(
                    "/nodes/pve1/qemu/9000/clone",
                    &[("newid", id), ("name", "bigfleet-x"), ("full", "1")],
                )
                .await;
            assert_eq!(r.status, 200, "{:?}", r.body);
            r.data().as_str().expect("upid").to_string()
        }
    };
    let first = clone("131").await;
    api.wait_task(&first).await;
    let second = clone("132").await;
    // `UPID:node:pid:pstart:starttime:type:id:user:`, the start in hex.
    let start_of = |upid: &str| {
        let hex = upid.split(':').nth(4).expect("a UPID");
        u64::from_str_radix(hex, 16).expect("a hex start time")
    };
    let all = api
        .get(
            "/nodes/pve1/tasks",
            &[("source", "all"), ("since", &start_of(&first).to_string())],
        )
        .await;
    assert_eq!(all.status, 200, "{:?}", all.body);
    let rows = all.data().as_array().expect("a list").clone();
    let row = |upid: &str| {
        rows.iter()
            .find(|r| r["upid"] == upid)
            .unwrap_or_else(|| panic!("{upid} is listed: {rows:?}"))
            .clone()
    };
    assert_eq!(row(&first)["status"], "OK");
    assert!(row(&first)["endtime"].as_u64().is_some());
    assert_eq!(row(&second)["status"], "RUNNING");
    assert!(row(&second).get("endtime").is_none());
    // A window that ends before the tasks started lists neither.
    let before = start_of(&first) - 1;
    let none = api
        .get(
            "/nodes/pve1/tasks",
            &[("source", "all"), ("until", &before.to_string())],
        )
        .await;
    let listed = none.data().as_array().expect("a list").clone();
    assert!(
        listed
            .iter()
            .all(|r| r["upid"] != first.as_str() && r["upid"] != second.as_str()),
        "{listed:?}"
    );
    let later = api
        .get(
            "/nodes/pve1/tasks",
            &[
                ("source", "all"),
                ("since", &(start_of(&second) + 1).to_string()),
            ],
        )
        .await;
    assert_eq!(later.data().as_array().map(Vec::len), Some(0));
    api.wait_task(&second).await;
    shutdown_clean(sim).await;
}

/// A stop of a stopped VM is an `OK` task at once, even under a lock
/// (qemu-server's `_do_vm_stop` returns before its lock check when no QEMU
/// runs); a running locked VM's stop fails on the lock.
#[tokio::test]
async fn stopping_a_stopped_vm_ends_ok_at_once_lock_or_not() {
    let (sim, api) = start_sim(SimConfig {
        stop_duration: Duration::from_secs(5),
        ..fast_cfg()
    })
    .await;
    let clone = api
        .post(
            "/nodes/pve1/qemu/9000/clone",
            &[("newid", "140"), ("name", "bigfleet-140"), ("full", "1")],
        )
        .await;
    api.wait_task_of(clone).await;
    assert!(sim.set_lock(140, Some("backup")));
    let began = std::time::Instant::now();
    let stop = api.post("/nodes/pve1/qemu/140/status/stop", &[]).await;
    let done = api.wait_task_of(stop).await;
    assert_eq!(done["exitstatus"], "OK", "{done}");
    assert!(
        began.elapsed() < Duration::from_secs(4),
        "no stop_duration for a VM that is not running"
    );
    assert!(sim.start_vm_out_of_band(140));
    let stop = api.post("/nodes/pve1/qemu/140/status/stop", &[]).await;
    let done = api.wait_task_of(stop).await;
    assert!(
        done["exitstatus"]
            .as_str()
            .is_some_and(|s| s.contains("locked")),
        "{done}"
    );
    shutdown_clean(sim).await;
}
