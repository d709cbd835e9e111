//! Node memory as PVE reports it: each node's `maxmem` as configured
//! (`--node-memory`), a VM's `maxmem` its configured memory in bytes and its
//! `mem` used memory while it runs (0 when stopped), templates listed with
//! `template: 1`, and every running VM, whoever made it, in the node's `mem`.

use std::time::Duration;

use pve_sim::{NodeMemory, SimConfig};
use serde_json::Value;

use crate::common::{shutdown_clean, start_sim, Api};

const GIB: u64 = 1 << 30;

fn cfg() -> SimConfig {
    SimConfig {
        clone_duration: Duration::from_millis(50),
        rrd_lag: Duration::ZERO,
        node_memory: NodeMemory::every_node(16 * GIB).with_node("pve2", 32 * GIB),
        ..SimConfig::default()
    }
}

async fn row(api: &Api, ty: &str, key: &str, value: Value) -> Value {
    let res = api.get("/cluster/resources", &[("type", ty)]).await;
    assert_eq!(res.status, 200, "{:?}", res.body);
    res.data()
        .as_array()
        .expect("rows")
        .iter()
        .find(|r| r[key] == value)
        .unwrap_or_else(|| panic!("no {ty} row with {key}={value}: {:?}", res.body))
        .clone()
}

#[tokio::test]
async fn nodes_report_their_configured_memory_and_vms_their_own() {
    let (sim, api) = start_sim(cfg()).await;
    for (node, bytes) in [("pve1", 16 * GIB), ("pve2", 32 * GIB)] {
        let r = row(&api, "node", "node", node.into()).await;
        assert_eq!(r["maxmem"], bytes, "{r}");
        assert_eq!(r["mem"], 0, "no VM runs yet: {r}");
        let st = api.get(&format!("/nodes/{node}/status"), &[]).await;
        assert_eq!(st.data()["memory"]["total"], bytes, "{:?}", st.body);
        let listed = api.get("/nodes", &[]).await;
        let n = listed
            .data()
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["node"] == node)
            .unwrap()
            .clone();
        assert_eq!(n["maxmem"], bytes, "{n}");
    }

    // A VM made by someone else than the provider, through the API.
    let mut vm = sim.new_vm(500, "pve1", "foreign");
    vm.memory_mib = 4096;
    sim.insert_vm(vm).unwrap();
    let r = row(&api, "vm", "vmid", 500.into()).await;
    assert_eq!(r["maxmem"], 4 * GIB, "configured memory in bytes: {r}");
    assert_eq!(r["mem"], 0, "stopped: no memory used: {r}");
    let t = row(&api, "vm", "vmid", 9000.into()).await;
    assert_eq!(t["template"], 1, "{t}");

    let started = api.post("/nodes/pve1/qemu/500/status/start", &[]).await;
    assert_eq!(api.wait_task_of(started).await["exitstatus"], "OK");
    let r = row(&api, "vm", "vmid", 500.into()).await;
    assert_eq!(r["status"], "running");
    let used = r["mem"].as_u64().expect("mem while running");
    assert!(used > 0 && used <= 4 * GIB, "{r}");
    let node = row(&api, "node", "node", "pve1".into()).await;
    assert_eq!(node["mem"], 4 * GIB, "the foreign VM counts: {node}");
    let per_node = api.get("/nodes/pve1/qemu", &[]).await;
    let listed = per_node
        .data()
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["vmid"] == 500)
        .cloned()
        .expect("listed on its node");
    assert_eq!(listed["maxmem"], 4 * GIB, "{listed}");
    assert_eq!(listed["status"], "running", "{listed}");
    shutdown_clean(sim).await;
}

#[test]
fn sizes_and_node_lists_parse_with_clear_errors() {
    let m: NodeMemory = "16G".parse().unwrap();
    assert_eq!((m.of("pve1"), m.of("any")), (16 * GIB, 16 * GIB));
    let m: NodeMemory = "pve1=16GiB,pve2=32G".parse().unwrap();
    assert_eq!(m.of("pve1"), 16 * GIB);
    assert_eq!(m.of("pve2"), 32 * GIB);
    assert_eq!(
        m.of("pve3"),
        NodeMemory::DEFAULT,
        "unnamed nodes keep the default"
    );
    let m: NodeMemory = "8G, pve3=1T".parse().unwrap();
    assert_eq!((m.of("pve1"), m.of("pve3")), (8 * GIB, 1 << 40));
    assert_eq!("1073741824".parse::<NodeMemory>().unwrap().of("x"), GIB);
    assert_eq!(pve_sim::parse_size("512M"), Ok(512 << 20));
    for (bad, says) in [
        ("16GB", "decimal units are ambiguous"),
        ("16X", "unknown unit"),
        ("G", "whole number"),
        ("0", "needs some memory"),
        ("=16G", "needs a node name"),
        ("pve1=", "node pve1"),
        ("", "node memory is empty"),
        ("99999999999T", "64 bits"),
    ] {
        let err = bad.parse::<NodeMemory>().unwrap_err();
        assert!(err.contains(says), "{bad:?}: {err}");
    }
}
