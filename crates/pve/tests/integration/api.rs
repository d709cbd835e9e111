//! Endpoint behaviour against an in-test HTTPS server (pin mode).

use std::error::Error as _;
use std::sync::atomic::Ordering;
use std::time::Duration;

use pve::{CloneParams, ConfigParams, FileEncoding, PveError, TaskState, Upid};
use serde_json::json;

use crate::common::*;

const UPID_CLONE: &str =
    "UPID:pve1:00000ACD:00006AE8:679A423B:qmclone:112:bigfleet@pve!autoscaler:";
const UPID_PVE2: &str = "UPID:pve2:00001234:00006AE8:679A423B:qmstart:112:bigfleet@pve!autoscaler:";
const LOCK_MSG: &str = "can't lock file '/var/lock/qemu-server/lock-104.conf' - got timeout";

async fn setup(
    script: impl Fn(&Recorded, usize) -> Reply + Send + Sync + 'static,
) -> (TestServer, pve::PveClient, Calls) {
    let leaf = self_signed_leaf(&["localhost"]);
    let srv = serve(&leaf, script).await;
    let (c, calls) = client(&srv.url(), None, vec![leaf.fingerprint()]);
    (srv, c, calls)
}

#[tokio::test]
async fn token_header_and_clone_form_body() {
    let (srv, c, calls) = setup(|_, _| ok(json!(UPID_CLONE))).await;
    let upid = c
        .clone_vm(
            "pve1",
            9000,
            &CloneParams {
                newid: 112,
                name: Some("bigfleet-pve-medium-007".into()),
                description: Some(
                    "BigFleet managed VM. machine_id=a/b+c&d ü operation_id=op 1".into(),
                ),
                pool: Some("bigfleet".into()),
                full: Some(true),
                storage: Some("local-lvm".into()),
                target: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(upid.task_type, "qmclone");
    assert_eq!(upid.as_str(), UPID_CLONE);

    let r = &srv.recorded()[0];
    assert_eq!(r.method, "POST");
    assert_eq!(r.path, "/api2/json/nodes/pve1/qemu/9000/clone");
    assert_eq!(
        r.auth.as_deref(),
        Some(format!("PVEAPIToken={TOKEN_ID}={SECRET}").as_str())
    );
    assert_eq!(
        r.content_type.as_deref(),
        Some("application/x-www-form-urlencoded")
    );
    assert_eq!(
        r.body,
        "newid=112&name=bigfleet-pve-medium-007\
         &description=BigFleet%20managed%20VM.%20machine_id%3Da%2Fb%2Bc%26d%20%C3%BC%20operation_id%3Dop%201\
         &pool=bigfleet&full=1&storage=local-lvm"
    );
    assert_eq!(last_call(&calls), ("clone".into(), true, 1));
}

#[tokio::test]
async fn exec_sends_argv_as_repeated_keys_and_file_write_encodes() {
    let (srv, c, _) = setup(|r, _| {
        if r.path.ends_with("/agent/exec") {
            ok(json!({"pid": "4242"}))
        } else {
            ok(json!(null))
        }
    })
    .await;
    let pid = c
        .agent_exec(
            "pve1",
            112,
            &[
                "/bin/sh",
                "-c",
                "echo a=b&&x+y 'q'",
                "/run/bigfleet-bootstrap",
            ],
            Some("stdin ✓\n".as_bytes()),
        )
        .await
        .unwrap();
    assert_eq!(pid, 4242);
    c.agent_file_write(
        "pve1",
        112,
        "/run/x y",
        &[0xfb, 0xff, 0xfe, 0x00],
        FileEncoding::Base64,
    )
    .await
    .unwrap();
    c.agent_file_write("pve1", 112, "/tmp/t", b"a+b=c", FileEncoding::PveEncodes)
        .await
        .unwrap();

    let rec = srv.recorded();
    assert_eq!(rec[0].path, "/api2/json/nodes/pve1/qemu/112/agent/exec");
    assert_eq!(
        rec[0].body,
        "command=%2Fbin%2Fsh&command=-c&command=echo%20a%3Db%26%26x%2By%20%27q%27\
         &command=%2Frun%2Fbigfleet-bootstrap&input-data=stdin%20%C3%A2%C2%9C%C2%93%0A"
    );
    // base64 of fb ff fe 00 is "+//+AA==": every +, / and = escaped.
    assert_eq!(
        rec[1].body,
        "file=%2Frun%2Fx%20y&content=%2B%2F%2F%2BAA%3D%3D&encode=0"
    );
    assert_eq!(rec[2].body, "file=%2Ftmp%2Ft&content=a%2Bb%3Dc&encode=1");

    // Oversized payloads are refused before sending.
    let big = vec![b'a'; pve::MAX_FILE_WRITE_CONTENT + 1];
    let e = c
        .agent_file_write("pve1", 112, "/x", &big, FileEncoding::PveEncodes)
        .await
        .unwrap_err();
    assert!(matches!(e, PveError::InvalidArgument(_)) && e.to_string().contains("limit"));
    let e = c
        .agent_exec("pve1", 112, &["/bin/true"], Some(&vec![b'a'; 65_537]))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("limit"), "{e}");
    assert!(c.agent_exec::<&str>("pve1", 112, &[], None).await.is_err());
    assert_eq!(srv.recorded().len(), 3);
    // Any bytes, not only UTF-8, go out as one character per byte.
    c.agent_exec("pve1", 112, &["/bin/cat"], Some(&[0xff, 0xfe]))
        .await
        .unwrap();
    assert_eq!(
        srv.recorded()[3].body,
        "command=%2Fbin%2Fcat&input-data=%C3%BF%C3%BE"
    );
}

#[tokio::test]
async fn destroy_uses_query_string_and_config_put() {
    let (srv, c, _) = setup(|r, _| match r.method.as_str() {
        "DELETE" => ok(json!(UPID_CLONE.replace("qmclone", "qmdestroy"))),
        _ => ok(json!(null)),
    })
    .await;
    let u = c.destroy("pve1", 112).await.unwrap();
    assert_eq!(u.task_type, "qmdestroy");
    c.set_config_sync(
        "pve1",
        112,
        &ConfigParams {
            cores: Some(4),
            memory: Some(8192),
            tags: Some(vec![
                "bigfleet".into(),
                pve::sanitize_tag("bigfleet-dc1/OnDemand/t/pve1/007"),
            ]),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let rec = srv.recorded();
    assert_eq!(rec[0].method, "DELETE");
    assert_eq!(rec[0].path, "/api2/json/nodes/pve1/qemu/112");
    assert_eq!(
        rec[0].query.as_deref(),
        Some("purge=1&destroy-unreferenced-disks=1")
    );
    assert_eq!(rec[0].body, "");
    assert_eq!(rec[1].method, "PUT");
    assert_eq!(
        rec[1].body,
        "cores=4&memory=8192&tags=bigfleet%3Bbigfleet-dc1-ondemand-t-pve1-007"
    );
    // An empty update is refused locally.
    assert!(c
        .set_config_sync("pve1", 112, &ConfigParams::default())
        .await
        .is_err());
    assert_eq!(srv.recorded().len(), 2);
}

#[tokio::test]
async fn reason_phrase_errors_and_classifiers() {
    let (_srv, c, calls) = setup(|r, _| {
        if r.path.ends_with("/config") {
            fail(
                500,
                "Configuration file 'nodes/pve1/qemu-server/104.conf' does not exist",
            )
        } else if r.path.ends_with("/agent/ping") {
            fail(500, "QEMU guest agent is not running")
        } else if r.path.ends_with("/nextid") {
            fail(400, "VM 105 already exists")
        } else if r.path.ends_with("/status/current") {
            fail(401, "authentication failure")
        } else {
            // Newer PVE: the message is also in the body.
            Reply {
                status: 500,
                reason: Some("short".into()),
                body: r#"{"data":null,"message":"VM 112 is not running\n"}"#.into(),
                delay: Duration::ZERO,
            }
        }
    })
    .await;

    let e = c.get_config("pve1", 104).await.unwrap_err();
    assert_eq!(
        expect_api(&e),
        (
            500,
            "Configuration file 'nodes/pve1/qemu-server/104.conf' does not exist".into()
        )
    );
    assert!(e.is_not_found() && !e.is_lock_timeout());

    let e = c.agent_ping("pve1", 104).await.unwrap_err();
    assert!(e.is_agent_not_running(), "{e}");

    let e = c.next_id(Some(105)).await.unwrap_err();
    assert!(e.is_already_exists(), "{e}");

    let e = c.status_current("pve1", 104).await.unwrap_err();
    assert!(e.is_auth(), "{e}");

    let e = c.start("pve1", 112).await.unwrap_err();
    assert_eq!(expect_api(&e), (500, "VM 112 is not running".into()));
    assert!(e.is_vm_not_running() && !e.is_agent_not_running());

    // None of these is retryable: one attempt each.
    let observed = calls.lock().clone();
    assert_eq!(observed.len(), 5);
    assert!(
        observed
            .iter()
            .all(|(_, ok, attempts)| !ok && *attempts == 1),
        "{observed:?}"
    );
}

#[tokio::test]
async fn parameter_errors_from_400_body() {
    let (_srv, c, _) = setup(|_, _| Reply {
        status: 400,
        reason: Some("Parameter verification failed.".into()),
        body: json!({"data": null, "errors": {
            "newid": "invalid format - value '5' does not look like a valid VM ID\n",
            "pool": "pool 'x' does not exist"
        }})
        .to_string(),
        delay: Duration::ZERO,
    })
    .await;
    let e = c
        .clone_vm(
            "pve1",
            9000,
            &CloneParams {
                newid: 5,
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    match &e {
        PveError::Api {
            status,
            message,
            param_errors,
        } => {
            assert_eq!(*status, 400);
            assert_eq!(message, "Parameter verification failed.");
            assert_eq!(
                param_errors.get("newid").map(String::as_str),
                Some("invalid format - value '5' does not look like a valid VM ID")
            );
            assert_eq!(param_errors.len(), 2);
        }
        other => panic!("{other:?}"),
    }
    assert!(e.to_string().contains("newid: invalid format"));
}

#[tokio::test]
async fn lock_timeouts_are_retried_even_for_writes() {
    let (srv, c, calls) = setup(|_, n| {
        if n < 2 {
            fail(500, LOCK_MSG)
        } else {
            ok(json!(UPID_CLONE))
        }
    })
    .await;
    let cfg = ConfigParams {
        description: Some("x".into()),
        ..Default::default()
    };
    c.set_config_async("pve1", 104, &cfg).await.unwrap();
    assert_eq!(last_call(&calls), ("config_post".into(), true, 3));
    assert_eq!(srv.recorded().len(), 3);
}

#[tokio::test]
async fn lock_timeout_gives_up_after_max_attempts() {
    let (srv, c, calls) = setup(|_, _| fail(500, LOCK_MSG)).await;
    let e = c.start("pve1", 104).await.unwrap_err();
    assert!(e.is_lock_timeout());
    assert_eq!(expect_api(&e).1, LOCK_MSG);
    assert_eq!(last_call(&calls), ("start".into(), false, 4));
    assert_eq!(srv.recorded().len(), 4);
}

#[tokio::test]
async fn node_unreachable_retried() {
    let (srv, c, calls) = setup(|r, n| {
        if r.path.ends_with("/nodes") {
            ok(json!([{"node": "pve1", "status": "online"}, {"node": "pve2", "status": "offline"}]))
        } else if r.method == "GET" && n >= 3 {
            ok(json!([
                {"id": "qemu/101", "type": "qemu", "vmid": "101", "node": "pve1", "name": "bigfleet-a",
                 "status": "running", "template": 0, "tags": "bigfleet;BigFleet-x", "pool": "bf",
                 "maxmem": "8589934592", "maxcpu": 4, "hastate": "started"},
                {"id": "lxc/102", "type": "lxc", "vmid": 102, "node": "pve1", "status": "stopped"},
                {"id": "qemu/9000", "type": "qemu", "vmid": 9000, "node": "pve2", "status": "unknown",
                 "template": 1}
            ]))
        } else {
            fail(595, "Connection refused")
        }
    })
    .await;
    let vms = c.cluster_resources_vms().await.unwrap();
    assert_eq!(last_call(&calls), ("cluster_resources".into(), true, 3));
    assert_eq!(srv.recorded()[3].query.as_deref(), Some("type=vm"));
    assert_eq!(vms.len(), 2, "containers are dropped");
    assert_eq!(vms[0].vmid, 101);
    assert_eq!(vms[0].tags, vec!["bigfleet", "bigfleet-x"]);
    assert_eq!(vms[0].maxmem, Some(8 << 30));
    assert_eq!(vms[0].pool.as_deref(), Some("bf"));
    assert!(!vms[0].template && vms[1].template);
    assert_eq!(vms[1].status, "unknown");

    // 595 (pveproxy could not connect to the node: nothing was sent) is
    // retried for a POST too; the handler keeps failing it, so all attempts go.
    let e = c.start("pve1", 101).await.unwrap_err();
    assert!(e.is_node_unreachable());
    assert_eq!(last_call(&calls), ("start".into(), false, 4));
}

/// 596/597 on a POST may have been applied: never repeated by the client.
#[tokio::test]
async fn lost_answer_to_a_post_is_not_retried() {
    let (_srv, c, calls) = setup(|_, _| fail(596, "Connection timed out")).await;
    let e = c.start("pve1", 101).await.unwrap_err();
    assert!(e.may_have_been_applied_post(), "{e}");
    assert_eq!(last_call(&calls), ("start".into(), false, 1));
}

/// PVE lists a VM pvestatd has not sampled yet without `name`, `status` or
/// `template`; the client completes such rows from their node's VM list,
/// one call per live node, never one per VM and never on a node `/nodes`
/// says is down.
#[tokio::test]
async fn unsampled_resource_rows_are_completed_from_the_node() {
    let (srv, c, _) = setup(|r, _| {
        if r.path.ends_with("/cluster/resources") {
            ok(json!([
                {"id": "qemu/101", "type": "qemu", "vmid": 101, "node": "pve1",
                 "tags": "bigfleet", "status": "stopped", "name": "old"},
                {"id": "qemu/102", "type": "qemu", "vmid": 102, "node": "pve2", "tags": "bigfleet"},
                {"id": "qemu/103", "type": "qemu", "vmid": 103, "node": "pve2"},
                // PVE 8 and 9 say `unknown` for an unsampled VM.
                {"id": "qemu/104", "type": "qemu", "vmid": 104, "node": "pve1",
                 "status": "unknown"},
                // A VM of an offline node keeps its last sample's name.
                {"id": "qemu/105", "type": "qemu", "vmid": 105, "node": "pve3",
                 "status": "unknown", "name": "away"},
                // ... and after 5 minutes loses it: nobody asks pve3.
                {"id": "qemu/106", "type": "qemu", "vmid": 106, "node": "pve3",
                 "status": "unknown", "tags": "bigfleet"}
            ]))
        } else if r.path.ends_with("/nodes") {
            ok(json!([
                {"node": "pve1", "status": "online"},
                {"node": "pve2", "status": "online"},
                {"node": "pve3", "status": "offline"}
            ]))
        } else if r.path.ends_with("/nodes/pve2/qemu") {
            // 103 was destroyed meanwhile.
            ok(json!([{"vmid": 102, "status": "running", "name": "bigfleet-new"}]))
        } else if r.path.ends_with("/nodes/pve1/qemu") {
            ok(json!([
                {"vmid": 101, "status": "running", "name": "old"},
                {"vmid": 104, "status": "stopped", "name": "bigfleet-newer", "template": 1}
            ]))
        } else {
            fail(595, "No route to host")
        }
    })
    .await;
    let listed = c.cluster_vms().await.unwrap();
    assert_eq!(listed.offline_nodes, ["pve3"]);
    assert!(listed.is_offline("pve3") && !listed.is_offline("pve1"));
    let vms = listed.vms;
    assert_eq!(vms.len(), 6);
    assert_eq!(
        (vms[0].status.as_str(), vms[0].name.as_deref()),
        ("stopped", Some("old")),
        "a sampled row is left as listed"
    );
    assert_eq!(
        (vms[1].status.as_str(), vms[1].name.as_deref()),
        ("running", Some("bigfleet-new"))
    );
    // Gone meanwhile: listed as PVE listed it.
    assert_eq!((vms[2].status.as_str(), vms[2].name.as_deref()), ("", None));
    assert_eq!(
        (
            vms[3].status.as_str(),
            vms[3].name.as_deref(),
            vms[3].template
        ),
        ("stopped", Some("bigfleet-newer"), true)
    );
    assert_eq!(
        (vms[4].status.as_str(), vms[4].name.as_deref()),
        ("unknown", Some("away"))
    );
    assert_eq!(
        (vms[5].status.as_str(), vms[5].name.as_deref()),
        ("unknown", None)
    );
    let paths: Vec<String> = srv.recorded().iter().map(|r| r.path.clone()).collect();
    assert_eq!(
        paths,
        [
            "/api2/json/nodes",
            "/api2/json/cluster/resources",
            "/api2/json/nodes/pve1/qemu",
            "/api2/json/nodes/pve2/qemu",
        ]
    );
}

#[tokio::test]
async fn post_transport_error_is_not_retried_but_get_is() {
    let leaf = self_signed_leaf(&["localhost"]);
    let (addr, seen) = serve_hangup(&leaf).await;
    let url = format!("https://localhost:{}/api2/json", addr.port());
    let (c, calls) = client(&url, None, vec![leaf.fingerprint()]);

    let e = c.start("pve1", 101).await.unwrap_err();
    assert!(e.is_transport(), "{e:?}");
    // The HTTP client's own error stays reachable as the cause.
    assert!(
        e.source()
            .and_then(|s| s.downcast_ref::<hyper_util::client::legacy::Error>())
            .is_some(),
        "{e:?}"
    );
    assert_eq!(last_call(&calls), ("start".into(), false, 1));
    assert_eq!(
        seen.load(Ordering::SeqCst),
        1,
        "the POST reached the server exactly once"
    );

    let e = c
        .agent_exec("pve1", 101, &["/bin/true"], None)
        .await
        .unwrap_err();
    assert!(e.is_transport());
    assert_eq!(last_call(&calls).2, 1);

    let e = c.nodes().await.unwrap_err();
    assert!(e.is_transport());
    assert_eq!(last_call(&calls), ("nodes".into(), false, 4));
    assert_eq!(seen.load(Ordering::SeqCst), 2 + 4);
}

#[tokio::test]
async fn connection_refused_is_retried_for_posts() {
    // Nothing listens: the request cannot have been applied.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let (c, calls) = client(
        &format!("https://127.0.0.1:{port}/api2/json"),
        None,
        vec![[7; 32]],
    );
    let e = c.start("pve1", 101).await.unwrap_err();
    assert!(
        matches!(e, PveError::Transport { connect: true, .. }),
        "{e:?}"
    );
    let source = e
        .source()
        .and_then(|s| s.downcast_ref::<hyper_util::client::legacy::Error>())
        .expect("the HTTP client's error is the cause");
    assert!(source.is_connect(), "{source:?}");
    assert_eq!(last_call(&calls), ("start".into(), false, 4));
}

#[tokio::test]
async fn request_timeout_applies_and_only_gets_retry() {
    let leaf = self_signed_leaf(&["localhost"]);
    let srv = serve(&leaf, |r, n| {
        if n == 0 || r.method == "POST" {
            Reply {
                delay: Duration::from_secs(5),
                ..ok(json!(null))
            }
        } else {
            ok(json!("123"))
        }
    })
    .await;
    let (mut cfg, calls) = config(&srv.url(), None, vec![leaf.fingerprint()]);
    cfg.request_timeout = Duration::from_secs(1);
    let c = pve::PveClient::new(cfg).unwrap();
    assert_eq!(c.next_id(None).await.unwrap(), 123);
    assert_eq!(last_call(&calls), ("nextid".into(), true, 2));

    let e = c.agent_ping("pve1", 1).await.unwrap_err();
    assert!(e.is_timeout(), "{e:?}");
    assert_eq!(last_call(&calls), ("agent_ping".into(), false, 1));
}

fn task(status: &str, exit: Option<&str>) -> Reply {
    let mut d = json!({"status": status, "upid": UPID_PVE2, "node": "pve2", "type": "qmstart",
                       "pid": 4660, "pstart": 27368, "starttime": 1738162747});
    if let Some(e) = exit {
        d["exitstatus"] = json!(e);
    }
    ok(d)
}

async fn wait_with(exit: &'static str) -> (Result<pve::TaskStatus, PveError>, Vec<Recorded>) {
    let (srv, c, _) = setup(move |_, n| {
        if n < 2 {
            task("running", None)
        } else {
            task("stopped", Some(exit))
        }
    })
    .await;
    let upid = Upid::parse(UPID_PVE2).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let r = c
        .wait_task(&upid, deadline, Duration::from_millis(10))
        .await;
    (r, srv.recorded())
}

#[tokio::test]
async fn wait_task_ok_warnings_and_failure() {
    let (r, rec) = wait_with("OK").await;
    let st = r.unwrap();
    assert_eq!(st.status, TaskState::Stopped);
    assert_eq!(rec.len(), 3);
    // Polls the node named in the UPID, with the UPID percent-encoded.
    assert_eq!(
        rec[0].path,
        "/api2/json/nodes/pve2/tasks/UPID%3Apve2%3A00001234%3A00006AE8%3A679A423B%3Aqmstart%3A112%3Abigfleet%40pve%21autoscaler%3A/status"
    );

    let (r, _) = wait_with("WARNINGS: 3").await;
    assert_eq!(r.unwrap().exitstatus.as_deref(), Some("WARNINGS: 3"));

    let msg =
        "clone failed: can't lock file '/var/lock/pve-manager/pve-storage-local-lvm' - got timeout";
    let (r, _) = wait_with(msg).await;
    match r.unwrap_err() {
        e @ PveError::TaskFailed { .. } => {
            assert!(e.is_lock_timeout());
            let PveError::TaskFailed { upid, exitstatus } = e else {
                unreachable!()
            };
            assert_eq!(upid, UPID_PVE2);
            assert_eq!(exitstatus, msg);
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn wait_task_deadline_and_transient_errors() {
    let (_srv, c, _) = setup(|_, n| {
        if n % 2 == 0 {
            fail(596, "Connection timed out")
        } else {
            task("running", None)
        }
    })
    .await;
    let upid = Upid::parse(UPID_PVE2).unwrap();
    let start = tokio::time::Instant::now();
    let e = c
        .wait_task(
            &upid,
            start + Duration::from_millis(150),
            Duration::from_millis(20),
        )
        .await
        .unwrap_err();
    assert!(matches!(e, PveError::TaskDeadline { .. }), "{e:?}");
    assert!(start.elapsed() >= Duration::from_millis(150));

    // A non-transient poll error ends the wait at once.
    let (_srv, c, _) = setup(|_, _| fail(403, "Permission check failed")).await;
    let e = c
        .wait_task(
            &upid,
            tokio::time::Instant::now() + Duration::from_secs(10),
            Duration::from_millis(10),
        )
        .await
        .unwrap_err();
    assert_eq!(expect_api(&e).0, 403);
}

#[tokio::test]
async fn typed_reads_parse_leniently() {
    let (srv, c, _) = setup(|r, _| {
        let p = r.path.as_str();
        if p.ends_with("/cluster/nextid") {
            ok(json!("107"))
        } else if p.ends_with("/config") {
            ok(
                json!({"cores": "4", "memory": "8192", "agent": "1", "lock": "clone",
                      "digest": "d1", "description": "BigFleet managed VM. machine_id=x",
                      "tags": "bigfleet;bigfleet-x", "scsi0": "local-lvm:vm-112-disk-0"}),
            )
        } else if p.ends_with("/status/current") {
            ok(
                json!({"status": "running", "qmpstatus": "running", "agent": "1",
                      "ha": {"managed": 0}, "template": "", "name": "bigfleet-a", "vmid": "112"}),
            )
        } else if p.ends_with("/agent/exec-status") {
            ok(json!({"exited": 1, "exitcode": "2", "err-data": "boom\n", "out-truncated": 0}))
        } else if p.ends_with("/log") {
            ok(json!([{"n": 1, "t": "starting"}, {"n": "2", "t": "TASK OK"}]))
        } else if p == "/api2/json/nodes" {
            ok(
                json!([{"node": "pve1", "status": "online", "cpu": 0.05, "maxcpu": "8",
                       "mem": 1, "maxmem": "2", "ssl_fingerprint": "AB:CD"}]),
            )
        } else {
            fail(501, "Method not implemented")
        }
    })
    .await;
    assert_eq!(c.next_id(None).await.unwrap(), 107);
    let cfg = c.get_config("pve1", 112).await.unwrap();
    assert_eq!((cfg.cores, cfg.memory), (Some(4), Some(8192)));
    assert!(cfg.agent_enabled());
    assert_eq!(cfg.lock.as_deref(), Some("clone"));
    assert_eq!(cfg.digest.as_deref(), Some("d1"));
    assert_eq!(cfg.tags, vec!["bigfleet", "bigfleet-x"]);
    let st = c.status_current("pve1", 112).await.unwrap();
    assert!(st.is_running() && st.agent && !st.ha_managed() && !st.template);
    let ex = c.agent_exec_status("pve1", 112, 77).await.unwrap();
    assert!(ex.exited && !ex.out_truncated);
    assert_eq!(ex.exitcode, Some(2));
    assert_eq!(ex.err_data.as_deref(), Some("boom\n"));
    let upid = Upid::parse(UPID_CLONE).unwrap();
    let log = c.task_log(&upid, 0, 50).await.unwrap();
    assert_eq!(log[1].n, 2);
    let nodes = c.nodes().await.unwrap();
    assert_eq!(nodes[0].maxcpu, Some(8.0));
    assert_eq!(nodes[0].ssl_fingerprint.as_deref(), Some("AB:CD"));

    let rec = srv.recorded();
    let es = rec
        .iter()
        .find(|r| r.path.ends_with("exec-status"))
        .unwrap();
    assert_eq!(es.query.as_deref(), Some("pid=77"));
    let lg = rec.iter().find(|r| r.path.ends_with("/log")).unwrap();
    assert_eq!(lg.query.as_deref(), Some("start=0&limit=50"));
}

#[tokio::test]
async fn malformed_success_bodies_are_decode_errors() {
    let (_srv, c, _) = setup(|r, _| {
        if r.path.ends_with("/clone") {
            ok(json!("not-a-upid"))
        } else if r.path.ends_with("/nextid") {
            Reply {
                body: "<html>".into(),
                ..ok(json!(null))
            }
        } else {
            ok(json!({"status": "running"}))
        }
    })
    .await;
    let e = c
        .clone_vm(
            "pve1",
            9000,
            &CloneParams {
                newid: 1,
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert!(
        matches!(e, PveError::Decode { op: "clone", .. })
            && e.to_string().contains("malformed UPID"),
        "{e}"
    );
    // The UPID parser's complaint is the cause.
    assert!(
        e.source()
            .and_then(|s| s.downcast_ref::<PveError>())
            .is_some_and(|p| matches!(p, PveError::InvalidArgument(_))),
        "{e:?}"
    );
    let e = c.next_id(None).await.unwrap_err();
    assert!(e.to_string().contains("not JSON"), "{e}");
    assert!(
        e.source()
            .and_then(|s| s.downcast_ref::<serde_json::Error>())
            .is_some_and(serde_json::Error::is_syntax),
        "{e:?}"
    );
    // exec-status without `exited` is not silently "still running".
    let e = c.agent_exec_status("pve1", 1, 1).await.unwrap_err();
    assert!(matches!(e, PveError::Decode { .. }), "{e:?}");
    assert!(
        e.source()
            .and_then(|s| s.downcast_ref::<serde_json::Error>())
            .is_some_and(serde_json::Error::is_data),
        "{e:?}"
    );
}

#[tokio::test]
async fn pool_members_new_and_old_api() {
    let members = json!([{"id": "qemu/101", "type": "qemu", "node": "pve1", "vmid": 101},
                         {"id": "storage/pve1/local", "type": "storage", "node": "pve1", "storage": "local"}]);
    let m2 = members.clone();
    let (srv, c, _) = setup(move |r, _| {
        if r.path == "/api2/json/pools" {
            ok(json!([{"poolid": "bf", "members": m2.clone()}]))
        } else {
            fail(500, "unexpected")
        }
    })
    .await;
    let got = c.pool_members("bf").await.unwrap();
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].vmid, Some(101));
    assert_eq!(srv.recorded()[0].query.as_deref(), Some("poolid=bf"));

    // Older PVE: /pools takes no poolid (400 on the parameter) or lacks the call.
    for old in [0, 1] {
        let m3 = members.clone();
        let (srv, c, _) = setup(move |r, _| {
            if r.path == "/api2/json/pools" {
                if old == 0 {
                    Reply {
                        status: 400,
                        reason: Some("Parameter verification failed.".into()),
                        body: json!({"data": null, "errors": {"poolid": "property is not defined in schema and the schema does not allow additional properties"}}).to_string(),
                        delay: Duration::ZERO,
                    }
                } else {
                    fail(501, "Method 'GET /pools' not implemented")
                }
            } else if r.path == "/api2/json/pools/bf%2Fx" {
                ok(json!({"members": m3.clone()}))
            } else {
                fail(404, "no such path")
            }
        })
        .await;
        let got = c.pool_members("bf/x").await.unwrap();
        assert_eq!(got.len(), 2, "old={old}");
        assert_eq!(srv.recorded().len(), 2);
    }

    let (_srv, c, _) = setup(|_, _| ok(json!([]))).await;
    assert!(c.pool_members("nope").await.unwrap_err().is_not_found());
}

#[tokio::test]
async fn debug_output_never_shows_the_secret() {
    let (srv, c, _) = setup(|_, _| ok(json!(null))).await;
    let d = format!("{c:?}");
    assert!(!d.contains(SECRET) && d.contains("<redacted>"), "{d}");
    let (cfg, _) = config(&srv.url(), None, vec![[1; 32]]);
    let d = format!("{cfg:?} {cfg:#?}");
    assert!(!d.contains(SECRET), "{d}");
    assert!(d.contains(TOKEN_ID));
}

#[tokio::test]
async fn sdn_vnets_are_listed_with_their_zones_and_a_missing_sdn_is_a_501() {
    let (srv, c, _) = setup(|r, i| {
        assert!(r.path.ends_with("/cluster/sdn/vnets"), "{}", r.path);
        if i == 0 {
            ok(json!([
                {"vnet": "vnet7", "zone": "z1", "type": "vnet", "digest": "0a1b",
                 "tag": 100, "vlanaware": "1"},
                {"vnet": "vnet8", "zone": "z2", "type": "vnet", "digest": "0a1b"}
            ]))
        } else {
            // pve-manager without pve-network never registers /cluster/sdn.
            fail(501, "Method 'GET /cluster/sdn/vnets' not implemented")
        }
    })
    .await;
    let vnets = c.sdn_vnets().await.unwrap();
    let zones = pve::VnetZones::new(&vnets);
    assert_eq!(
        (
            zones.zone("vnet7"),
            zones.zone("vnet8"),
            zones.zone("vmbr0")
        ),
        (Some("z1"), Some("z2"), None)
    );
    assert!(vnets[0].vlanaware && vnets[0].tag == Some(100));
    let e = c.sdn_vnets().await.unwrap_err();
    assert_eq!(e.status(), Some(501), "{e}");
    assert_eq!(srv.recorded()[0].method, "GET");
}

/// A gate that admits while its flag is set.
struct Flag(std::sync::atomic::AtomicBool);

impl pve::RequestGate for Flag {
    fn admit(&self) -> Result<(), Box<dyn std::error::Error + Send + Sync + 'static>> {
        if self.0.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err("the caller may not act now".into())
        }
    }
}

#[tokio::test]
async fn a_shut_gate_sends_nothing_and_says_why() {
    let leaf = self_signed_leaf(&["localhost"]);
    let srv = serve(&leaf, |_, _| ok(json!(UPID_CLONE))).await;
    let gate = std::sync::Arc::new(Flag(std::sync::atomic::AtomicBool::new(true)));
    let (mut cfg, _calls) = config(&srv.url(), None, vec![leaf.fingerprint()]);
    cfg.gate = Some(gate.clone());
    let c = pve::PveClient::new(cfg).unwrap();
    let params = CloneParams {
        newid: 112,
        ..CloneParams::default()
    };
    c.clone_vm("pve1", 9000, &params).await.expect("admitted");
    assert_eq!(srv.recorded().len(), 1);

    gate.0.store(false, Ordering::SeqCst);
    let e = c
        .clone_vm("pve1", 9000, &params)
        .await
        .expect_err("refused");
    assert!(
        matches!(e, PveError::NotAdmitted { op: "clone", .. }),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "PVE clone not sent: the caller may not act now"
    );
    assert_eq!(
        e.source().map(|s| s.to_string()).as_deref(),
        Some("the caller may not act now")
    );
    assert_eq!(srv.recorded().len(), 1, "nothing reached the server");
}

/// Concurrent identical reads of the node list share one request; a read
/// that is not shared (`nextid`) goes out once per caller; a failed shared
/// read is not handed to the callers that waited for it: each asks again
/// and gets its own answer.
#[tokio::test]
async fn concurrent_identical_reads_share_one_request() {
    let (srv, c, _) = setup(|r, i| {
        let mut reply = if r.path.ends_with("/nodes") && i == 4 {
            fail(403, "Permission check failed (/nodes, Sys.Audit)")
        } else if r.path.ends_with("/nodes") {
            ok(json!([{"node": "pve1", "status": "online"}]))
        } else {
            ok(json!("100"))
        };
        reply.delay = Duration::from_millis(200);
        reply
    })
    .await;
    let c = std::sync::Arc::new(c);
    let spawn_reads = |n: usize| -> Vec<_> {
        (0..n)
            .map(|_| {
                let c = std::sync::Arc::clone(&c);
                tokio::spawn(async move { c.nodes().await.map(|n| n.len()) })
            })
            .collect()
    };
    for r in spawn_reads(8) {
        assert_eq!(r.await.unwrap().expect("nodes"), 1);
    }
    assert_eq!(srv.recorded().len(), 1, "one request for eight readers");
    let ids: Vec<_> = (0..3)
        .map(|_| {
            let c = std::sync::Arc::clone(&c);
            tokio::spawn(async move { c.next_id(None).await })
        })
        .collect();
    for r in ids {
        assert_eq!(r.await.unwrap().expect("nextid"), 100);
    }
    assert_eq!(srv.recorded().len(), 4, "nextid is never shared");
    // The fifth request is refused (403): its leader gets the refusal, and
    // the two that waited on it each ask again and get the node list.
    let mut results = Vec::new();
    for r in spawn_reads(3) {
        results.push(r.await.unwrap());
    }
    let refused = results.iter().filter(|r| r.is_err()).count();
    assert_eq!(refused, 1, "{results:?}");
    assert_eq!(srv.recorded().len(), 7, "the followers' own requests");
}
