//! PVE's less forgiving behaviours, each on by default and each with a knob,
//! and the endpoints a lifecycle client calls besides the provider's own.

use std::time::Duration;

use pve_sim::{HttpServerVersion, PveSim, SimConfig, TagStyle, TemplateSpec};
use serde_json::Value;

use crate::common::{shutdown_clean, start_sim, Api};

fn cfg() -> SimConfig {
    SimConfig {
        templates: vec![
            TemplateSpec::local(9000, "pve1"),
            TemplateSpec::shared(9001, "pve1"),
        ],
        clone_duration: Duration::from_millis(50),
        agent_boot_delay: Duration::ZERO,
        migrate_duration: Duration::from_millis(50),
        ..SimConfig::default()
    }
}

async fn clone(api: &Api, template: &str, newid: &str) {
    let r = api
        .post(
            &format!("/nodes/pve1/qemu/{template}/clone"),
            // Full: a VM of its own (a linked clone's disk names its base).
            &[
                ("newid", newid),
                ("name", &format!("vm-{newid}")),
                ("full", "1"),
            ],
        )
        .await;
    assert_eq!(api.wait_task_of(r).await["exitstatus"], "OK");
}

async fn start(api: &Api, node: &str, vmid: &str) {
    let r = api
        .post(&format!("/nodes/{node}/qemu/{vmid}/status/start"), &[])
        .await;
    assert_eq!(api.wait_task_of(r).await["exitstatus"], "OK");
}

fn row(res: &Value, vmid: u64) -> Value {
    res.as_array()
        .expect("rows")
        .iter()
        .find(|r| r["vmid"] == vmid)
        .cloned()
        .unwrap_or(Value::Null)
}

#[tokio::test]
async fn resources_rrd_fields_lag_for_a_new_vm_then_refresh_per_sample() {
    let lag = Duration::from_millis(600);
    let sim = PveSim::start(SimConfig {
        rrd_lag: lag,
        ..cfg()
    })
    .await
    .unwrap();
    let api = Api::new(&sim);
    // Templates existed before the simulator started: sampled already.
    let res = api.get("/cluster/resources", &[("type", "vm")]).await;
    assert_eq!(row(res.data(), 9000)["name"], "tmpl-9000");
    assert_eq!(row(res.data(), 9000)["template"], 1);

    clone(&api, "9000", "101").await;
    let r = row(
        api.get("/cluster/resources", &[("type", "vm")])
            .await
            .data(),
        101,
    );
    assert_eq!(
        (r["id"].as_str(), r["node"].as_str()),
        (Some("qemu/101"), Some("pve1"))
    );
    // As PVE lists an unsampled VM: `unknown`, without name or template.
    assert_eq!(r["status"], "unknown", "{r}");
    for k in ["name", "maxmem", "mem", "cpu", "uptime", "template"] {
        assert!(r.get(k).is_none(), "{k} already in {r}");
    }
    // The first sample arrives once the lag has passed.
    let r = api
        .poll(
            "first RRD sample",
            reqwest::Method::GET,
            "/cluster/resources?type=vm",
            |r| row(r.data(), 101).get("name").is_some(),
        )
        .await;
    let r = row(r.data(), 101);
    assert_eq!(
        (r["name"].as_str(), r["status"].as_str()),
        (Some("vm-101"), Some("stopped"))
    );
    // A status change shows only with the next sample.
    start(&api, "pve1", "101").await;
    let stale = row(
        api.get("/cluster/resources", &[("type", "vm")])
            .await
            .data(),
        101,
    );
    assert_eq!(
        stale["status"], "stopped",
        "sample refreshed early: {stale}"
    );
    assert_eq!(
        api.get("/nodes/pve1/qemu/101/status/current", &[])
            .await
            .data()["status"],
        "running",
        "the node itself is current"
    );
    api.poll(
        "next RRD sample",
        reqwest::Method::GET,
        "/cluster/resources?type=vm",
        |r| row(r.data(), 101)["status"] == "running",
    )
    .await;
    sim.shutdown().await;

    // rrd_lag = 0: complete and current at once.
    let sim = PveSim::start(SimConfig {
        rrd_lag: Duration::ZERO,
        ..cfg()
    })
    .await
    .unwrap();
    let api = Api::new(&sim);
    clone(&api, "9000", "102").await;
    let r = row(
        api.get("/cluster/resources", &[("type", "vm")])
            .await
            .data(),
        102,
    );
    assert_eq!(
        (r["name"].as_str(), r["status"].as_str()),
        (Some("vm-102"), Some("stopped"))
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn old_http_server_errors_and_body_limits() {
    let old = PveSim::start(SimConfig {
        http_server_version: "5.1".parse().unwrap(),
        ..cfg()
    })
    .await
    .unwrap();
    let new = PveSim::start(cfg()).await.unwrap();
    assert_eq!(new.config().http_server_version, HttpServerVersion::CURRENT);
    let (a_old, a_new) = (Api::new(&old), Api::new(&new));
    let r = a_old.get("/nodes/pve1/qemu/999/config", &[]).await;
    assert_eq!(r.status, 500);
    assert!(
        r.body.get("message").is_none(),
        "5.1 has no JSON message: {}",
        r.body
    );
    let r = a_new.get("/nodes/pve1/qemu/999/config", &[]).await;
    assert!(r.message().contains("does not exist"), "{}", r.body);
    // Parameter errors keep their `errors` map either way.
    let r = a_old
        .put("/nodes/pve1/qemu/9000/config", &[("memory", "1")])
        .await;
    assert_eq!(r.status, 400);
    assert!(r.body["errors"]["memory"].is_string(), "{}", r.body);

    // 64 KiB before 5.2.1, 512 KiB from it.
    let big = "x".repeat(70 * 1024);
    let r = a_old
        .put("/nodes/pve1/qemu/9000/config", &[("description", &big)])
        .await;
    assert_eq!(r.status, 413, "{}", r.body);
    let r = a_new
        .put("/nodes/pve1/qemu/9000/config", &[("description", &big)])
        .await;
    assert_eq!(r.status, 400, "read, then refused by maxLength: {}", r.body);
    assert!(r.body["errors"]["description"].is_string());
    let huge = "x".repeat(600 * 1024);
    let r = a_new
        .put("/nodes/pve1/qemu/9000/config", &[("description", &huge)])
        .await;
    assert_eq!(r.status, 413);
    assert!(r.message().contains("request too large"), "{}", r.body);
    old.shutdown().await;
    new.shutdown().await;
}

#[tokio::test]
async fn descriptions_and_tags_are_stored_the_pve_way_unless_told_otherwise() {
    for (knobs, want_desc, want_tags) in [
        (cfg(), "line 1\n\nline 3\n", "alpha;beta;zeta"),
        (
            SimConfig {
                description_newline: false,
                tag_style: TagStyle::CaseSensitive,
                ..cfg()
            },
            "line 1\n\nline 3\n\n",
            "Beta;Zeta;alpha;beta",
        ),
        (
            SimConfig {
                tag_style: TagStyle::Verbatim,
                ..cfg()
            },
            "line 1\n\nline 3\n",
            "Zeta,beta alpha;Beta;beta",
        ),
    ] {
        let sim = PveSim::start(knobs).await.unwrap();
        let api = Api::new(&sim);
        let r = api
            .put(
                "/nodes/pve1/qemu/9000/config",
                &[
                    ("description", "line 1\n\nline 3\n\n"),
                    ("tags", "Zeta,beta alpha;Beta;beta"),
                ],
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
        let c = api.get("/nodes/pve1/qemu/9000/config", &[]).await;
        assert_eq!(c.data()["description"], want_desc);
        assert_eq!(c.data()["tags"], want_tags);
        sim.shutdown().await;
    }
}

#[tokio::test]
async fn agent_text_is_latin1_like_perls_encode_base64() {
    for latin1 in [true, false] {
        let sim = PveSim::start(SimConfig {
            agent_latin1: latin1,
            ..cfg()
        })
        .await
        .unwrap();
        let api = Api::new(&sim);
        clone(&api, "9000", "101").await;
        start(&api, "pve1", "101").await;
        let fw = "/nodes/pve1/qemu/101/agent/file-write";
        let r = api
            .post(fw, &[("file", "/tmp/a"), ("content", "caf\u{e9}")])
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
        let want: &[u8] = if latin1 {
            b"caf\xe9"
        } else {
            "caf\u{e9}".as_bytes()
        };
        assert_eq!(sim.read_guest_file(101, "/tmp/a").unwrap(), want);
        let r = api
            .post(fw, &[("file", "/tmp/b"), ("content", "\u{2603}")])
            .await;
        let r2 = api
            .post(
                "/nodes/pve1/qemu/101/agent/exec",
                &[("command", "/bin/true"), ("input-data", "\u{2603}")],
            )
            .await;
        if latin1 {
            for r in [r, r2] {
                assert_eq!(
                    (r.status, r.message().as_str()),
                    (500, "Wide character in subroutine entry")
                );
            }
            assert!(
                sim.read_guest_file(101, "/tmp/b").is_err(),
                "nothing written"
            );
        } else {
            assert_eq!((r.status, r2.status), (200, 200));
        }
        // encode=0 content is the caller's base64: exact bytes either way.
        let r = api
            .post(
                fw,
                &[("file", "/tmp/c"), ("content", "/+k="), ("encode", "0")],
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(sim.read_guest_file(101, "/tmp/c").unwrap(), [0xff, 0xe9]);
        sim.shutdown().await;
    }
}

#[tokio::test]
async fn semicolons_separate_form_pairs_like_pve() {
    for split in [true, false] {
        let sim = PveSim::start(SimConfig {
            form_semicolon_separator: split,
            ..cfg()
        })
        .await
        .unwrap();
        let api = Api::new(&sim);
        let r = api
            .post_raw("/nodes/pve1/qemu/9000/config", "tags=a;b")
            .await;
        let t = api
            .wait_task_of(
                api.post_raw("/nodes/pve1/qemu/9000/config", "tags=x%3By")
                    .await,
            )
            .await;
        assert_eq!(t["exitstatus"], "OK");
        if split {
            // `b` became a parameter of its own.
            assert_eq!(r.status, 400, "{}", r.body);
            assert!(r.body["errors"]["b"]
                .as_str()
                .unwrap()
                .contains("not defined"));
        } else {
            assert_eq!(r.status, 200, "{}", r.body);
        }
        let c = api.get("/nodes/pve1/qemu/9000/config", &[]).await;
        assert_eq!(c.data()["tags"], "x;y");
        sim.shutdown().await;
    }
}

#[tokio::test]
async fn cluster_node_storage_and_permission_views() {
    let (sim, api) = start_sim(cfg()).await;
    let cs = api.get("/cluster/status", &[]).await;
    let rows = cs.data().as_array().unwrap();
    assert_eq!(rows[0]["type"], "cluster");
    assert_eq!(rows[0]["quorate"], 1);
    assert_eq!(rows[0]["nodes"], 2);
    let names: Vec<&str> = rows[1..]
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["pve1", "pve2"]);
    sim.set_node_online("pve2", false);
    let cs = api.get("/cluster/status", &[]).await;
    assert_eq!(cs.data()[2]["online"], 0);
    assert_eq!(cs.data()[0]["quorate"], 0, "1 of 2 nodes is no majority");
    let r = api.get("/nodes/pve2/status", &[]).await;
    assert_eq!(r.status, 595);
    sim.set_node_online("pve2", true);

    let ns = api.get("/nodes/pve1/status", &[]).await;
    assert!(ns.data()["memory"]["total"].as_u64().unwrap() > 0);
    assert_eq!(ns.data()["loadavg"].as_array().unwrap().len(), 3);

    let st = api.get("/nodes/pve1/storage", &[]).await;
    let names: Vec<&str> = st
        .data()
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["storage"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["local", "local-lvm", "ceph-pool"]);
    let st = api.get("/nodes/pve1/storage", &[("content", "iso")]).await;
    assert_eq!(st.data().as_array().unwrap().len(), 1);
    let s = api.get("/nodes/pve1/storage/ceph-pool/status", &[]).await;
    assert_eq!(
        (s.data()["type"].as_str(), s.data()["shared"].as_u64()),
        (Some("rbd"), Some(1))
    );
    // Template 9001's disk is on the shared storage.
    assert_eq!(s.data()["used"], 32u64 << 30);
    // An unknown storage is a parameter error, as pve-storage raises it.
    let s = api.get("/nodes/pve1/storage/nosuch/status", &[]).await;
    assert_eq!(
        (s.status, s.message().as_str()),
        (400, "Parameter verification failed.")
    );
    assert_eq!(s.body["errors"]["storage"], "No such storage.");
    let s = api.get("/nodes/pve1/storage/1bad/status", &[]).await;
    assert_eq!(s.status, 400, "storage ids are validated");

    let res = api.get("/cluster/resources", &[("type", "storage")]).await;
    assert_eq!(res.data().as_array().unwrap().len(), 6);
    assert_eq!(res.data()[0]["id"], "storage/pve1/local");
    let res = api.get("/cluster/resources", &[("type", "node")]).await;
    assert_eq!(res.data()[1]["id"], "node/pve2");

    let p = api.get("/access/permissions", &[]).await;
    assert_eq!(p.data()["/"]["VM.Allocate"], 1);
    assert_eq!(p.data()["/pool/bigfleet"]["VM.PowerMgmt"], 1);
    let p = api
        .get("/access/permissions", &[("path", "/vms/101")])
        .await;
    assert_eq!(p.data().as_object().unwrap().len(), 1);
    assert!(sim
        .schema_violations()
        .iter()
        .all(|r| r.path.contains("1bad")));
    sim.shutdown().await;
}

#[tokio::test]
async fn migrate_and_template_refuse_what_pve_refuses() {
    let (sim, api) = start_sim(cfg()).await;
    clone(&api, "9000", "101").await;
    start(&api, "pve1", "101").await;
    let m = "/nodes/pve1/qemu/101/migrate";
    for (form, status, msg) in [
        (vec![("target", "pve2")], 500, "can't migrate running VM without --online"),
        (vec![("target", "pve3"), ("online", "0")], 500, "no such cluster node 'pve3'"),
        (
            vec![("target", "pve2"), ("online", "1")],
            500,
            "can't live migrate attached local disks without with-local-disks option (local-lvm:vm-101-disk-0,size=32G)",
        ),
    ] {
        let r = api.post(m, &form).await;
        assert_eq!((r.status, r.message().as_str()), (status, msg), "{form:?}");
    }
    let r = api.post(m, &[("target", "pve1")]).await;
    assert_eq!(r.body["errors"]["target"], "target is local node.");
    let r = api.post("/nodes/pve1/qemu/101/template", &[]).await;
    assert_eq!(
        (r.status, r.message().as_str()),
        (500, "you can't convert a VM to template if VM is running")
    );

    // Stopped: offline migration moves it (with its local disk).
    let r = api.post("/nodes/pve1/qemu/101/status/stop", &[]).await;
    api.wait_task_of(r).await;
    let r = api
        .post(m, &[("target", "pve2"), ("with-local-disks", "1")])
        .await;
    let upid = r.data().as_str().unwrap().to_string();
    assert!(upid.contains(":qmigrate:101:"), "{upid}");
    assert_eq!(api.wait_task(&upid).await["exitstatus"], "OK");
    assert_eq!(sim.vm(101).unwrap().node, "pve2");
    let r = api.get("/nodes/pve1/qemu/101/config", &[]).await;
    assert!(r.message().contains("does not exist"));

    // Template conversion of the stopped VM, then PVE's refusals of a template.
    let r = api.post("/nodes/pve2/qemu/101/template", &[]).await;
    assert!(r.data().as_str().unwrap().contains(":qmtemplate:101:"));
    assert_eq!(api.wait_task_of(r).await["exitstatus"], "OK");
    assert!(sim.vm(101).unwrap().template);
    let r = api.post("/nodes/pve2/qemu/101/template", &[]).await;
    assert_eq!(r.message(), "you can't convert a template to a template");
    let r = api.post("/nodes/pve2/qemu/101/status/start", &[]).await;
    assert_eq!(r.message(), "you can't start a vm if it's a template");
    let r = api.get("/nodes/pve2/qemu/101/status", &[]).await;
    assert!(r
        .data()
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["subdir"] == "current"));
    shutdown_clean(sim).await;
}

#[tokio::test]
async fn agent_info_osinfo_and_interfaces() {
    let (sim, api) = start_sim(cfg()).await;
    clone(&api, "9000", "300").await;
    let r = api
        .get("/nodes/pve1/qemu/300/agent/network-get-interfaces", &[])
        .await;
    assert_eq!(r.message(), "VM 300 is not running");
    start(&api, "pve1", "300").await;
    let net0 = api.get("/nodes/pve1/qemu/300/config", &[]).await.data()["net0"]
        .as_str()
        .unwrap()
        .to_lowercase();
    let r = api
        .get("/nodes/pve1/qemu/300/agent/network-get-interfaces", &[])
        .await;
    let eth0 = &r.data()["result"][1];
    assert!(
        net0.contains(eth0["hardware-address"].as_str().unwrap()),
        "{net0} {eth0}"
    );
    assert_eq!(eth0["ip-addresses"][0]["ip-address"], "10.99.1.44");
    let r = api.get("/nodes/pve1/qemu/300/agent/get-osinfo", &[]).await;
    assert_eq!(r.data()["result"]["id"], "debian");
    // The modelled hostname: the template image's until a guest command
    // renames the guest, then the new one; never the machine's own.
    let r = api
        .get("/nodes/pve1/qemu/300/agent/get-host-name", &[])
        .await;
    assert_eq!(r.data()["result"]["host-name"], pve_sim::TEMPLATE_HOSTNAME);
    let st = api
        .run(300, &["hostnamectl", "set-hostname", "web-1"])
        .await;
    assert_eq!(st["exitcode"], 0, "{st}");
    let st = api.run(300, &["/bin/sh", "-c", "hostname"]).await;
    assert_eq!(st["out-data"], "web-1\n", "{st}");
    let r = api
        .get("/nodes/pve1/qemu/300/agent/get-host-name", &[])
        .await;
    assert_eq!(r.data()["result"]["host-name"], "web-1");
    assert_eq!(sim.guest_hostname(300).as_deref(), Some("web-1"));
    let r = api.get("/nodes/pve1/qemu/300/agent/info", &[]).await;
    assert!(r.data()["result"]["supported_commands"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["name"] == "guest-network-get-interfaces"));
    sim.shutdown().await;
}

#[tokio::test]
async fn forgiving_turns_every_knob_off_and_ha_vms_migrate_through_the_ha_manager() {
    let (sim, api) = start_sim(cfg().forgiving()).await;
    clone(&api, "9001", "101").await;
    let r = row(
        api.get("/cluster/resources", &[("type", "vm")])
            .await
            .data(),
        101,
    );
    assert_eq!(r["name"], "vm-101", "complete at once: {r}");
    let r = api
        .put(
            "/nodes/pve1/qemu/101/config",
            &[("description", "d\n\n"), ("tags", "B;a")],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let c = api.get("/nodes/pve1/qemu/101/config", &[]).await;
    assert_eq!(
        (c.data()["description"].as_str(), c.data()["tags"].as_str()),
        (Some("d\n\n"), Some("B;a"))
    );
    let r = api
        .post_raw("/nodes/pve1/qemu/101/config", "tags=x;y")
        .await;
    assert_eq!(api.wait_task_of(r).await["exitstatus"], "OK");

    // HA-managed: the migrate call queues an hamigrate request.
    sim.set_ha(101, Some("stopped"));
    let r = api
        .post("/nodes/pve1/qemu/101/migrate", &[("target", "pve2")])
        .await;
    let upid = r.data().as_str().expect("upid").to_string();
    assert!(upid.contains(":hamigrate:101:"), "{upid}");
    assert_eq!(api.wait_task(&upid).await["exitstatus"], "OK");
    assert_eq!(sim.vm(101).unwrap().node, "pve2");
    sim.shutdown().await;
}
