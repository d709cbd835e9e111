//! The real-cluster failure modes at the API level (see the README's
//! "Real-cluster failure modes"): pool-scoped ACLs, the clone worker's
//! timeline, worker-side and post-apply faults, tag policy, pveproxy's
//! connection closing.

use std::time::Duration;

use pve_sim::{marker_description, PveSim, SimConfig, TagAccess};
use serde_json::Value;

use crate::common::Api;

const CLONE: &str = "/nodes/pve1/qemu/9000/clone";

fn fast() -> SimConfig {
    SimConfig {
        clone_duration: Duration::from_millis(300),
        rrd_lag: Duration::ZERO,
        ..SimConfig::default()
    }
}

async fn sim(cfg: SimConfig) -> (PveSim, Api) {
    let sim = PveSim::start(cfg).await.expect("simulator");
    let api = Api::new(&sim);
    (sim, api)
}

fn resource_vmids(r: &Value) -> Vec<u64> {
    r.as_array()
        .map(|a| a.iter().filter_map(|v| v["vmid"].as_u64()).collect())
        .unwrap_or_default()
}

#[tokio::test]
async fn pool_scoped_token_sees_403_outside_its_pool() {
    let (sim, api) = sim(SimConfig {
        pool_acl: true,
        ..fast()
    })
    .await;
    let mut outside = sim.new_vm(500, "pve1", "not-in-pool");
    outside.pool = None;
    sim.insert_vm(outside).unwrap();
    let inside = sim.new_vm(501, "pve1", "in-pool");
    sim.insert_vm(inside).unwrap();

    for vmid in [500, 4242] {
        let r = api
            .get(&format!("/nodes/pve1/qemu/{vmid}/status/current"), &[])
            .await;
        assert_eq!(r.status, 403, "existing or not: {vmid}");
        assert_eq!(
            r.message(),
            format!("Permission check failed (/vms/{vmid}, VM.Audit)")
        );
    }
    assert_eq!(
        api.get("/nodes/pve1/qemu/501/status/current", &[])
            .await
            .status,
        200
    );
    // nextid needs no privilege on the VM: it tells taken from free.
    assert_eq!(
        api.get("/cluster/nextid", &[("vmid", "500")]).await.status,
        400
    );
    assert_eq!(
        api.get("/cluster/nextid", &[("vmid", "4242")]).await.status,
        200
    );
    let listed = resource_vmids(
        api.get("/cluster/resources", &[("type", "vm")])
            .await
            .data(),
    );
    assert!(
        listed.contains(&501) && listed.contains(&9000),
        "{listed:?}"
    );
    assert!(!listed.contains(&500), "outside the pool is not listed");
    sim.shutdown().await;
}

#[tokio::test]
async fn clone_worker_timeline_and_pool_membership_at_the_end() {
    let (sim, api) = sim(SimConfig {
        pool_acl: true,
        clone_timeline: true,
        templates: vec![pve_sim::TemplateSpec::shared(9000, "pve1")],
        ..fast()
    })
    .await;
    let desc = marker_description("m/1", "op-1");
    let r = api
        .post(
            CLONE,
            &[
                ("newid", "120"),
                ("name", "bigfleet-x"),
                ("description", &desc),
                ("pool", "bigfleet"),
                ("target", "pve2"),
                ("full", "1"),
            ],
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let upid = r.data().as_str().unwrap().to_string();
    // While copying: a temporary config on the source node, nothing else, and
    // outside the pool (so a pool-scoped token gets 403).
    let vm = sim.vm(120).expect("temporary config");
    assert_eq!(vm.node, "pve1");
    assert_eq!(vm.lock.as_deref(), Some("clone"));
    assert!(vm.description.is_none() && vm.name.is_empty() && vm.pool.is_none());
    assert_eq!(
        api.get("/nodes/pve2/qemu/120/config", &[]).await.status,
        403
    );
    let task = api.wait_task(&upid).await;
    assert_eq!(task["exitstatus"], "OK");
    let vm = sim.vm(120).unwrap();
    assert_eq!(vm.node, "pve2");
    assert_eq!(vm.pool.as_deref(), Some("bigfleet"));
    assert_eq!(vm.description.as_deref(), Some(desc.as_str()));
    assert!(vm.lock.is_none());
    assert_eq!(
        api.get("/nodes/pve2/qemu/120/config", &[]).await.status,
        200
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn worker_side_collision_and_post_apply_failures() {
    let (sim, api) = sim(SimConfig {
        clone_timeline: true,
        ..fast()
    })
    .await;
    sim.faults().fail_next_task(
        "qmclone",
        1,
        "unable to create VM {newid}: config file already exists",
    );
    let r = api.post(CLONE, &[("newid", "130"), ("full", "1")]).await;
    assert_eq!(r.status, 200);
    let task = api.wait_task(r.data().as_str().unwrap()).await;
    assert_eq!(
        task["exitstatus"],
        "unable to create VM 130: config file already exists"
    );
    assert!(sim.vm(130).is_none(), "the worker created nothing");

    sim.faults().fail_after_apply(
        "POST /nodes/{node}/qemu/{vmid}/clone",
        1,
        596,
        "Connection timed out",
    );
    let r = api.post(CLONE, &[("newid", "131"), ("full", "1")]).await;
    assert_eq!(r.status, 596);
    // Applied all the same: the worker runs and creates the VM.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while sim.vm(131).is_none_or(|v| v.lock.is_some()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the clone never finished"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn restricted_user_tag_access_refuses_new_tags() {
    let (sim, api) = sim(SimConfig {
        tag_access: TagAccess::Existing(vec!["allowed".into()]),
        ..fast()
    })
    .await;
    sim.insert_vm(sim.new_vm(140, "pve1", "a")).unwrap();
    let put = |tags: &'static str| {
        let api = &api;
        async move {
            api.put("/nodes/pve1/qemu/140/config", &[("tags", tags)])
                .await
        }
    };
    assert_eq!(put("allowed").await.status, 200, "listed");
    let r = put("allowed;brand-new").await;
    assert_eq!(r.status, 403);
    assert_eq!(r.message(), "Permission check failed (/, Sys.Modify)");
    assert_eq!(
        sim.vm(140).unwrap().tags.as_deref(),
        Some("allowed"),
        "nothing applied"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn restricted_tag_access_yields_to_sys_modify_and_shows_in_cluster_options() {
    let (sim, api) = sim(SimConfig {
        tag_access: TagAccess::List(vec!["bigfleet".into()]),
        granted_privileges: vec![("/".into(), "Sys.Modify".into())],
        ..fast()
    })
    .await;
    let o = api.get("/cluster/options", &[]).await;
    assert_eq!(o.status, 200);
    assert_eq!(o.data()["user-tag-access"]["user-allow"], "list");
    assert_eq!(
        o.data()["user-tag-access"]["user-allow-list"][0],
        "bigfleet"
    );
    sim.insert_vm(sim.new_vm(141, "pve1", "a")).unwrap();
    let r = api
        .put("/nodes/pve1/qemu/141/config", &[("tags", "brand-new")])
        .await;
    assert_eq!(r.status, 200, "Sys.Modify on / sets any tag");
    sim.shutdown().await;
    // The default (free) is absent from the options, as in PVE.
    let (free, api) = self::sim(fast()).await;
    let o = api.get("/cluster/options", &[]).await;
    assert!(o.data().get("user-tag-access").is_none(), "{:?}", o.data());
    free.shutdown().await;
}

#[tokio::test]
async fn dropped_privileges_show_in_permissions_and_pool_reads() {
    let (sim, api) = sim(SimConfig {
        dropped_privileges: vec![
            ("/pool/bigfleet".into(), "VM.PowerMgmt".into()),
            ("/pool/bigfleet".into(), "Pool.Audit".into()),
            ("/".into(), "VM.Clone".into()),
        ],
        ..fast()
    })
    .await;
    let p = api
        .get("/access/permissions", &[("path", "/pool/bigfleet")])
        .await;
    let privs = &p.data()["/pool/bigfleet"];
    assert!(privs.get("VM.PowerMgmt").is_none(), "{privs}");
    assert!(
        privs.get("VM.Clone").is_none(),
        "dropped on / is gone below"
    );
    assert_eq!(privs["VM.Allocate"], 1);
    let p = api
        .get("/access/permissions", &[("path", "/vms/9000")])
        .await;
    assert_eq!(
        p.data()["/vms/9000"]["VM.PowerMgmt"],
        1,
        "other paths keep it"
    );
    let tree = api.get("/access/permissions", &[]).await;
    assert!(
        tree.data().get("/vms/9000").is_some(),
        "templates are listed"
    );
    assert!(
        tree.data().get("/storage/local-lvm").is_some(),
        "storages too"
    );
    let r = api.get("/pools/bigfleet", &[]).await;
    assert_eq!(r.status, 403);
    assert_eq!(
        r.message(),
        "Permission check failed (/pool/bigfleet, Pool.Audit)"
    );
    let r = api.get("/pools", &[("poolid", "bigfleet")]).await;
    assert_eq!(r.data().as_array().map(Vec::len), Some(0), "filtered");
    sim.shutdown().await;
    // PVE 9 names the guest-agent privileges.
    let (sim9, api) = self::sim(SimConfig {
        pve9: true,
        ..fast()
    })
    .await;
    let p = api.get("/access/permissions", &[("path", "/")]).await;
    assert!(p.data()["/"].get("VM.Monitor").is_none());
    assert_eq!(p.data()["/"]["VM.GuestAgent.Unrestricted"], 1);
    assert_eq!(api.get("/version", &[]).await.data()["release"], "9.0");
    sim9.shutdown().await;
}

#[tokio::test]
async fn pveproxy_closes_idle_connections_and_after_errors() {
    let (sim, api) = sim(SimConfig {
        keepalive_idle: Some(Duration::from_millis(200)),
        ..fast()
    })
    .await;
    assert_eq!(api.get("/version", &[]).await.status, 200);
    assert_eq!(api.get("/version", &[]).await.status, 200);
    assert_eq!(sim.connections_accepted(), 1, "kept alive between calls");
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(api.get("/version", &[]).await.status, 200);
    assert_eq!(
        sim.connections_accepted(),
        2,
        "the idle connection was closed"
    );
    let r = api.get("/nodes/pve1/qemu/4242/config", &[]).await;
    assert_eq!(r.status, 500);
    assert_eq!(api.get("/version", &[]).await.status, 200);
    assert_eq!(
        sim.connections_accepted(),
        3,
        "no keep-alive after a response >= 400"
    );
    sim.shutdown().await;
}
