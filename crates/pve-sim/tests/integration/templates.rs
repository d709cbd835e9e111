//! Templates as operators make them, and what real PVE does with their
//! settings on a clone (PVE 8 and 9 sources, third review): a `balloon`
//! above the memory a clone is given, `sockets` and `vcpus` that override
//! `cores`, tags the update would remove, node figures hidden from a token
//! without `Sys.Audit`, and a clone `storage` the template's node does not
//! have enabled.

use std::time::Duration;

use pve_sim::{SimConfig, StorageKind, StorageSpec, TagAccess, TemplateSpec};
use serde_json::Value;

use crate::common::{shutdown_clean, start_sim, Api};

fn cfg() -> SimConfig {
    SimConfig {
        clone_duration: Duration::from_millis(50),
        rrd_lag: Duration::ZERO,
        ..SimConfig::default()
    }
}

/// Clones template 9000 on pve1 to `newid` and waits for the clone task.
async fn clone(api: &Api, newid: u32) {
    let newid = newid.to_string();
    let st = api
        .wait_task_of(
            api.post(
                "/nodes/pve1/qemu/9000/clone",
                &[("newid", newid.as_str()), ("full", "1")],
            )
            .await,
        )
        .await;
    assert_eq!(st["exitstatus"], "OK", "{st}");
}

/// qemu-server `API2/Qemu.pm` `$load_and_check_config`: `memory` below the
/// `balloon` the clone copied from its template dies `balloon value too
/// large`, before anything is written; the balloon sent in the same update
/// is what counts, and `balloon: 0` (no balloon device) never refuses.
#[tokio::test]
async fn memory_below_the_copied_balloon_is_refused_unless_balloon_is_sent_too() {
    let (sim, api) = start_sim(cfg()).await;
    sim.update_vm(9000, |t| {
        t.memory_mib = 4096;
        t.extra.insert("balloon".into(), "2048".into());
    });
    clone(&api, 120).await;
    assert_eq!(sim.vm(120).unwrap().balloon_mib(), Some(2048), "copied");

    let r = api
        .put(
            "/nodes/pve1/qemu/120/config",
            &[("memory", "1024"), ("cores", "2")],
        )
        .await;
    assert_eq!(r.status, 500);
    assert_eq!(
        r.message(),
        "balloon value too large (must be smaller than assigned memory)"
    );
    let vm = sim.vm(120).unwrap();
    assert_eq!((vm.memory_mib, vm.cores), (4096, 2), "nothing applied");

    // A `delete=balloon` in the same request does not help: PVE checks
    // before it deletes.
    let r = api
        .put(
            "/nodes/pve1/qemu/120/config",
            &[("memory", "1024"), ("delete", "balloon")],
        )
        .await;
    assert_eq!(r.status, 500, "{:?}", r.body);

    let r = api
        .put(
            "/nodes/pve1/qemu/120/config",
            &[("memory", "1024"), ("balloon", "1024")],
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let vm = sim.vm(120).unwrap();
    assert_eq!((vm.memory_mib, vm.balloon_mib()), (1024, Some(1024)));

    // Ballooning off: no minimum to pass.
    sim.update_vm(120, |v| {
        v.extra.insert("balloon".into(), "0".into());
    });
    let r = api
        .put("/nodes/pve1/qemu/120/config", &[("memory", "512")])
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    shutdown_clean(sim).await;
}

/// qemu-server `config_to_command`: `maxcpus = sockets * cores`, refused
/// past the node's CPUs (`MAX N vcpus allowed per VM on this node`), and
/// `vcpus` (copied from the template) is what the guest boots with: the
/// status's `cpus` (qemu-server `vmstatus`) says so.
#[tokio::test]
async fn sockets_and_vcpus_copied_from_the_template_decide_the_vcpus() {
    let (sim, api) = start_sim(SimConfig {
        node_cpus: 8,
        ..cfg()
    })
    .await;
    sim.update_vm(9000, |t| {
        t.sockets = 2;
        t.extra.insert("vcpus".into(), "2".into());
    });
    clone(&api, 121).await;
    let r = api
        .put("/nodes/pve1/qemu/121/config", &[("cores", "4")])
        .await;
    assert_eq!(r.status, 200);
    let status = api.get("/nodes/pve1/qemu/121/status/current", &[]).await;
    assert_eq!(status.data()["cpus"], 2, "vcpus caps the 8 of 2 x 4");

    // 2 sockets x 8 cores = 16 > the node's 8: the start task fails.
    let r = api
        .put("/nodes/pve1/qemu/121/config", &[("cores", "8")])
        .await;
    assert_eq!(r.status, 200);
    let st = api
        .wait_task_of(api.post("/nodes/pve1/qemu/121/status/start", &[]).await)
        .await;
    assert_eq!(st["exitstatus"], "MAX 8 vcpus allowed per VM on this node");
    assert!(!sim.vm(121).unwrap().running);

    // `sockets=1` and `delete=vcpus`: the VM has exactly `cores`.
    let r = api
        .put(
            "/nodes/pve1/qemu/121/config",
            &[("cores", "4"), ("sockets", "1"), ("delete", "vcpus")],
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let st = api
        .wait_task_of(api.post("/nodes/pve1/qemu/121/status/start", &[]).await)
        .await;
    assert_eq!(st["exitstatus"], "OK");
    let status = api.get("/nodes/pve1/qemu/121/status/current", &[]).await;
    assert_eq!(status.data()["cpus"], 4);
    shutdown_clean(sim).await;
}

/// pve-guest-common `GuestHelpers.pm` `assert_tag_permissions`: a tag
/// removed is checked like a tag added. Replacing a template's tags with
/// others is refused where adding to them is not: a `registered-tags` tag
/// even under `user-tag-access` free, an unlisted one under `list`.
#[tokio::test]
async fn tags_removed_are_checked_like_tags_added() {
    let (sim, api) = start_sim(SimConfig {
        registered_tags: vec!["golden".into()],
        ..cfg()
    })
    .await;
    sim.update_vm(9000, |t| t.tags = Some("golden".into()));
    clone(&api, 122).await;
    let path = "/nodes/pve1/qemu/122/config";
    let r = api.put(path, &[("tags", "bigfleet")]).await;
    assert_eq!(r.status, 403);
    assert_eq!(
        r.message(),
        "Permission check failed (/, Sys.Modify for modifying tag 'golden')"
    );
    assert_eq!(api.put(path, &[("delete", "tags")]).await.status, 403);
    assert_eq!(
        sim.vm(122).unwrap().tags.as_deref(),
        Some("golden"),
        "nothing applied"
    );
    // Adding to them changes only the added tags' counts.
    let r = api.put(path, &[("tags", "golden;bigfleet")]).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(
        sim.vm(122).unwrap().tags.as_deref(),
        Some("bigfleet;golden")
    );
    sim.shutdown().await;

    // `user-tag-access` list: a template tag outside the list cannot go.
    let (sim, api) = start_sim(SimConfig {
        tag_access: TagAccess::List(vec!["bigfleet".into()]),
        ..cfg()
    })
    .await;
    sim.update_vm(9000, |t| t.tags = Some("team-a".into()));
    clone(&api, 123).await;
    let path = "/nodes/pve1/qemu/123/config";
    assert_eq!(api.put(path, &[("tags", "bigfleet")]).await.status, 403);
    assert_eq!(
        api.put(path, &[("tags", "team-a;bigfleet")]).await.status,
        200
    );
    shutdown_clean(sim).await;
}

/// pve-manager `API2/Nodes.pm` and `API2/Cluster.pm` `resources`, through
/// `API2Tools.pm` `extract_node_stats`: a node the token may not audit
/// (`Sys.Audit` on `/nodes/<node>`) is listed online, without `maxmem`,
/// `mem` or any other figure.
#[tokio::test]
async fn node_figures_need_sys_audit_on_the_node() {
    let (sim, api) = start_sim(SimConfig {
        dropped_privileges: vec![("/nodes/pve2".into(), "Sys.Audit".into())],
        ..cfg()
    })
    .await;
    let row = |list: &Value, node: &str| {
        list.as_array()
            .and_then(|a| a.iter().find(|n| n["node"] == node && n["type"] == "node"))
            .cloned()
            .unwrap_or(Value::Null)
    };
    for path in ["/nodes", "/cluster/resources"] {
        let list = api.get(path, &[]).await;
        let (pve1, pve2) = (row(list.data(), "pve1"), row(list.data(), "pve2"));
        assert_eq!(pve2["status"], "online", "{path}");
        for key in ["maxmem", "mem", "maxcpu", "cpu", "uptime"] {
            assert!(pve1.get(key).is_some(), "{path}: pve1 has {key}: {pve1}");
            assert!(pve2.get(key).is_none(), "{path}: pve2 hides {key}: {pve2}");
        }
    }
    shutdown_clean(sim).await;
}

/// qemu-server `clone_vm` runs `storage_check_enabled` for the clone's
/// `storage` on the node the call runs on (the template's) before it
/// checks the target: a shared storage whose `nodes` list leaves the
/// template's node out fails even for a clone to a node that has it.
#[tokio::test]
async fn a_clone_storage_must_be_enabled_on_the_template_node() {
    let mut c = cfg();
    c.templates = vec![TemplateSpec::shared(9001, "pve1")];
    c.storages
        .push(StorageSpec::new("nfs-b", StorageKind::Nfs, true, 1 << 10));
    c.storages_disabled = vec![("pve1".into(), "nfs-b".into())];
    let (sim, api) = start_sim(c).await;
    let clone_to = |target: &'static str, newid: &'static str| {
        let api = &api;
        async move {
            api.post(
                "/nodes/pve1/qemu/9001/clone",
                &[
                    ("newid", newid),
                    ("full", "1"),
                    ("storage", "nfs-b"),
                    ("target", target),
                ],
            )
            .await
        }
    };
    let r = clone_to("pve2", "124").await;
    assert_eq!(r.status, 500);
    assert_eq!(
        r.message(),
        "storage 'nfs-b' is not available on node 'pve1'"
    );
    assert!(sim.vm(124).is_none());
    // From pve2 itself (a copy of the template there), the same storage is fine.
    let mut copy = sim.new_vm(9101, "pve2", "tmpl-copy");
    copy.template = true;
    copy.storage = "ceph-pool".into();
    copy.shared_storage = true;
    sim.insert_vm(copy).unwrap();
    let st = api
        .wait_task_of(
            api.post(
                "/nodes/pve2/qemu/9101/clone",
                &[("newid", "125"), ("full", "1"), ("storage", "nfs-b")],
            )
            .await,
        )
        .await;
    assert_eq!(st["exitstatus"], "OK", "{st}");
    assert_eq!(sim.vm(125).unwrap().storage, "nfs-b");
    shutdown_clean(sim).await;
}

/// Clones template 9000 on `pve1` to `newid` (`full` "1" or "0"), which
/// must end OK: how long the task took from its POST.
async fn timed_clone(api: &Api, newid: &str, full: &str) -> Duration {
    let t0 = std::time::Instant::now();
    let st = api
        .wait_task_of(
            api.post(
                "/nodes/pve1/qemu/9000/clone",
                &[("newid", newid), ("full", full)],
            )
            .await,
        )
        .await;
    assert_eq!(st["exitstatus"], "OK", "{st}");
    t0.elapsed()
}

/// `--storage-bandwidth` (#41 item 2): a full clone copies its template's
/// disk at the storage's bandwidth, shared among the clones writing there
/// at once: alone, a 32 GiB disk at 64 GiB/s takes half a second; two at
/// once take a second each. A linked clone takes no copy at all. (Lower
/// bounds only: a loaded machine stretches every duration.)
#[tokio::test]
async fn full_clones_share_the_storages_bandwidth() {
    let (sim, api) = start_sim(SimConfig {
        storage_bandwidth: vec![("local-lvm".into(), 64 << 30)],
        max_parallel_local_clones: None,
        ..cfg()
    })
    .await;
    let timed = |newid, full| timed_clone(&api, newid, full);
    let alone = timed("130", "1").await;
    assert!(alone >= Duration::from_millis(450), "alone: {alone:?}");
    let (a, b) = tokio::join!(timed("131", "1"), timed("132", "1"));
    for t in [a, b] {
        assert!(t >= Duration::from_millis(900), "two at once: {a:?} {b:?}");
    }
    sim.update_vm(9000, |t| t.template = true);
    let linked = timed("133", "0").await;
    assert!(
        linked < alone,
        "a linked clone copies nothing: {linked:?} vs {alone:?}"
    );
    shutdown_clean(sim).await;
}

/// A full clone's task log shows the copy's progress as qemu-server
/// prints qemu-img's: `transferred X of Y (P%)`, from 0 % to 100 %, rising,
/// a line at most each whole percent; a client can read how far a copy is.
#[tokio::test]
async fn a_full_clones_log_shows_the_copys_progress() {
    let (sim, api) = start_sim(SimConfig {
        storage_bandwidth: vec![("local-lvm".into(), 64 << 30)],
        max_parallel_local_clones: None,
        ..cfg()
    })
    .await;
    let resp = api
        .post(
            "/nodes/pve1/qemu/9000/clone",
            &[("newid", "135"), ("full", "1")],
        )
        .await;
    assert_eq!(resp.status, 200, "{:?}", resp.body);
    let upid = resp.data().as_str().expect("upid").to_string();
    let st = api.wait_task(&upid).await;
    assert_eq!(st["exitstatus"], "OK", "{st}");
    let log = api
        .get(
            &format!("/nodes/pve1/tasks/{upid}/log"),
            &[("limit", "1000")],
        )
        .await;
    let lines: Vec<String> = log
        .data()
        .as_array()
        .expect("log lines")
        .iter()
        .filter_map(|l| l["t"].as_str().map(str::to_string))
        .filter(|t| t.starts_with("transferred "))
        .collect();
    assert_eq!(
        lines.first().map(String::as_str),
        Some("transferred 0.0 B of 32.0 GiB (0.00%)"),
        "{lines:#?}"
    );
    assert_eq!(
        lines.last().map(String::as_str),
        Some("transferred 32.0 GiB of 32.0 GiB (100.00%)"),
        "{lines:#?}"
    );
    assert!((3..=101).contains(&lines.len()), "{lines:#?}");
    let percents: Vec<f64> = lines
        .iter()
        .filter_map(|l| l.rsplit_once('(')?.1.strip_suffix("%)")?.parse().ok())
        .collect();
    assert_eq!(percents.len(), lines.len(), "{lines:#?}");
    assert!(
        percents.windows(2).all(|w| w[1].floor() > w[0].floor()),
        "rising, a whole percent at least between lines: {percents:?}"
    );
    shutdown_clean(sim).await;
}

/// `--storage-stream-bandwidth`: one copy runs no faster than a stream,
/// however idle the storage (qemu-img's in-order writes): a 32 GiB disk on
/// a 64 GiB/s storage whose stream reaches 32 GiB/s takes a second, not
/// half of one; two at once take a second each too, the storage having
/// room for both streams.
#[tokio::test]
async fn a_copy_runs_no_faster_than_one_stream() {
    let (sim, api) = start_sim(SimConfig {
        storage_bandwidth: vec![("local-lvm".into(), 64 << 30)],
        storage_stream_bandwidth: vec![("local-lvm".into(), 32 << 30)],
        max_parallel_local_clones: None,
        ..cfg()
    })
    .await;
    let timed = |newid| timed_clone(&api, newid, "1");
    let alone = timed("140").await;
    assert!(alone >= Duration::from_millis(950), "alone: {alone:?}");
    let (a, b) = tokio::join!(timed("141"), timed("142"));
    for t in [a, b] {
        assert!(t >= Duration::from_millis(950), "two at once: {a:?} {b:?}");
        // Lower bounds only, but two streams must not take the time of a
        // shared copy (2 s each) on a machine this idle.
        assert!(t < Duration::from_millis(1900), "two at once: {a:?} {b:?}");
    }
    shutdown_clean(sim).await;
}

/// `--volume-alloc-time`: a full clone allocates its volume under the
/// storage's lock (pve-storage `vdisk_alloc`): cluster-wide for a shared
/// storage, so a clone on another node queues behind it and, past
/// `--storage-lock-timeout`, fails with PVE's cfs-lock message and leaves
/// nothing; a local storage's lock is the node's own, so two nodes'
/// allocations do not queue on each other.
#[tokio::test]
async fn volume_allocations_queue_on_the_storages_lock() {
    let mut c = cfg();
    c.templates = vec![
        TemplateSpec::shared(9000, "pve1"),
        TemplateSpec::local(9001, "pve1"),
        TemplateSpec::local(9002, "pve2"),
    ];
    let (sim, api) = start_sim(SimConfig {
        storage_bandwidth: vec![
            ("ceph-pool".into(), 64 << 30),
            ("local-lvm".into(), 64 << 30),
        ],
        volume_alloc_time: Duration::from_millis(600),
        storage_lock_timeout: Duration::from_millis(300),
        max_parallel_local_clones: None,
        ..c
    })
    .await;
    let clone = |path: &'static str, newid: &'static str, target: Option<&'static str>| {
        let api = &api;
        async move {
            let mut form = vec![("newid", newid), ("full", "1")];
            if let Some(t) = target {
                form.push(("target", t));
            }
            api.wait_task_of(api.post(path, &form).await).await
        }
    };
    let (a, b) = tokio::join!(
        clone("/nodes/pve1/qemu/9000/clone", "150", None),
        clone("/nodes/pve1/qemu/9000/clone", "151", Some("pve2")),
    );
    let mut exits = [a["exitstatus"].to_string(), b["exitstatus"].to_string()];
    exits.sort();
    assert_eq!(exits[0], "\"OK\"", "{a} {b}");
    assert!(
        exits[1].contains("cfs-lock 'storage-ceph-pool' error: got lock request timeout"),
        "the second allocation queued past the lock's timeout: {a} {b}"
    );
    assert_eq!(
        [150, 151]
            .iter()
            .filter(|id| sim.vm(**id).is_some())
            .count(),
        1,
        "the failed clone leaves nothing"
    );
    let (c, d) = tokio::join!(
        clone("/nodes/pve1/qemu/9001/clone", "152", None),
        clone("/nodes/pve2/qemu/9002/clone", "153", None),
    );
    assert_eq!(c["exitstatus"], "OK", "{c}");
    assert_eq!(
        d["exitstatus"], "OK",
        "each node's local lock is its own: {d}"
    );
    shutdown_clean(sim).await;
}
