//! The real-cluster failure modes at the API level (see the README's
//! "Real-cluster failure modes"): pool-scoped ACLs, the clone worker's
//! timeline, worker-side and post-apply faults, tag policy, pveproxy's
//! connection closing.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use provider_testkit::wait::until;
use pve_sim::{marker_description, PveSim, SimConfig, TagAccess};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use serde_json::Value;

use crate::common::start_sim;

const CLONE: &str = "/nodes/pve1/qemu/9000/clone";

fn fast() -> SimConfig {
    SimConfig {
        clone_duration: Duration::from_millis(300),
        rrd_lag: Duration::ZERO,
        ..SimConfig::default()
    }
}

fn resource_vmids(r: &Value) -> Vec<u64> {
    r.as_array()
        .map(|a| a.iter().filter_map(|v| v["vmid"].as_u64()).collect())
        .unwrap_or_default()
}

#[tokio::test]
async fn pool_scoped_token_sees_403_outside_its_pool() {
    let (sim, api) = start_sim(SimConfig {
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
    let (sim, api) = start_sim(SimConfig {
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
    let (sim, api) = start_sim(SimConfig {
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
    until("the clone to finish", Duration::from_secs(5), || {
        sim.vm(131).is_some_and(|v| v.lock.is_none())
    })
    .await;
    sim.shutdown().await;
}

#[tokio::test]
async fn restricted_user_tag_access_refuses_new_tags() {
    let (sim, api) = start_sim(SimConfig {
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
    assert_eq!(
        r.message(),
        "Permission check failed (/, Sys.Modify for modifying tag 'brand-new')"
    );
    assert_eq!(
        sim.vm(140).unwrap().tags.as_deref(),
        Some("allowed"),
        "nothing applied"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn restricted_tag_access_yields_to_sys_modify_and_shows_in_cluster_options() {
    let (sim, api) = start_sim(SimConfig {
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
    let (free, api) = start_sim(fast()).await;
    let o = api.get("/cluster/options", &[]).await;
    assert!(o.data().get("user-tag-access").is_none(), "{:?}", o.data());
    free.shutdown().await;
}

#[tokio::test]
async fn dropped_privileges_show_in_permissions_and_pool_reads() {
    let (sim, api) = start_sim(SimConfig {
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
    let (sim9, api) = start_sim(SimConfig {
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

/// One HTTPS connection to the simulator, with no client pool in between:
/// requests go over it in turn, and `ended` finishes when the connection
/// does.
struct OneConnection {
    send: SendRequest<Body>,
    ended: tokio::task::JoinHandle<()>,
    auth: String,
}

impl OneConnection {
    async fn open(sim: &PveSim) -> OneConnection {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(sim.ca_pem().as_bytes()).expect("CA PEM"))
            .expect("CA certificate");
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(sim.addr())
            .await
            .expect("connect");
        let stream = tokio_rustls::TlsConnector::from(Arc::new(tls))
            .connect(ServerName::from(sim.addr().ip()), tcp)
            .await
            .expect("TLS handshake");
        let (send, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("HTTP/1.1 handshake");
        // How it ended does not matter, only that it did (the simulator
        // drops the connection without a TLS close_notify).
        let ended = tokio::spawn(async move {
            let _ = connection.await;
        });
        OneConnection {
            send,
            ended,
            auth: sim.auth_header(),
        }
    }

    /// `GET /api2/json{path}` over this connection; its status, once the
    /// body is read and the connection idle again.
    async fn get(&mut self, path: &str) -> u16 {
        let request = http::Request::get(format!("/api2/json{path}"))
            .header(http::header::HOST, "localhost")
            .header(http::header::AUTHORIZATION, &self.auth)
            .body(Body::empty())
            .expect("request");
        let response = self.send.send_request(request).await.expect("response");
        let status = response.status().as_u16();
        axum::body::to_bytes(Body::new(response.into_body()), usize::MAX)
            .await
            .expect("body");
        status
    }

    /// Waits until the simulator closes the connection; this end keeps it
    /// open meanwhile (dropping `send` would close it from here).
    async fn wait_closed_by_server(self, within: Duration) {
        let OneConnection { send, ended, .. } = self;
        tokio::time::timeout(within, ended)
            .await
            .expect("the simulator closed the idle connection")
            .expect("connection task");
        drop(send);
    }
}

#[tokio::test]
async fn pveproxy_closes_idle_connections_and_after_errors() {
    let (sim, api) = start_sim(SimConfig {
        keepalive_idle: Some(Duration::from_millis(200)),
        ..fast()
    })
    .await;
    let mut conn = OneConnection::open(&sim).await;
    assert_eq!(conn.get("/version").await, 200);
    assert_eq!(conn.get("/version").await, 200);
    assert_eq!(sim.connections_accepted(), 1, "kept alive between calls");
    // Left idle, the connection is closed by the simulator.
    conn.wait_closed_by_server(Duration::from_secs(10)).await;
    assert_eq!(api.get("/version", &[]).await.status, 200);
    assert_eq!(
        sim.connections_accepted(),
        2,
        "the next call takes a new connection"
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

/// A storage whose mount hangs, set through the admin endpoint: a destroy
/// with `destroy-unreferenced-disks=1` on that node fails as pve-storage's
/// `activate_storage` does, after the VM's disks are freed and with its
/// config left; without the option, or once the mount answers again, the
/// destroy ends.
#[tokio::test]
async fn a_hung_storage_fails_a_destroy_that_activates_every_storage() {
    let mut cfg = fast();
    cfg.storages.push(pve_sim::StorageSpec::new(
        "nas",
        pve_sim::StorageKind::Nfs,
        true,
        1 << 10,
    ));
    let (sim, api) = start_sim(cfg).await;
    for newid in ["130", "131"] {
        let r = api
            .post(CLONE, &[("newid", newid), ("name", "x"), ("full", "1")])
            .await;
        api.wait_task_of(r).await;
    }
    let set_nas = |state: &'static str| {
        let url = format!(
            "{}/_sim/storages/pve1/nas/{state}",
            api.base.trim_end_matches("/api2/json")
        );
        let call = api
            .c
            .post(url)
            .header("authorization", sim.auth_header())
            .send();
        async move {
            assert_eq!(call.await.expect("admin call").status(), 200, "{state}");
        }
    };
    set_nas("hung").await;
    let unreferenced = [("destroy-unreferenced-disks", "1"), ("purge", "1")];
    let r = api.delete("/nodes/pve1/qemu/130", &unreferenced).await;
    let done = api.wait_task_of(r).await;
    assert_eq!(
        done["exitstatus"],
        "unable to activate storage 'nas' - directory '/mnt/pve/nas' does not exist or is unreachable"
    );
    assert!(sim.vm(130).is_some(), "the config is left");
    // Without the option the destroy does not activate the other storages.
    let r = api.delete("/nodes/pve1/qemu/130", &[("purge", "1")]).await;
    assert_eq!(api.wait_task_of(r).await["exitstatus"], "OK");
    assert!(sim.vm(130).is_none());
    // Answering again, it no longer fails anything.
    set_nas("ok").await;
    let r = api.delete("/nodes/pve1/qemu/131", &unreferenced).await;
    assert_eq!(api.wait_task_of(r).await["exitstatus"], "OK");
    sim.shutdown().await;
}

/// A storage where volumes cannot be freed (an RBD image with watchers, an
/// LV in use), set through the admin endpoint: qemu-server's `destroy_vm`
/// warns `Could not remove disk '<volid>', check manually: <error>`, removes
/// the VM all the same and leaves the volume, taking its space. PVE 9 counts
/// the warnings (`WARNINGS: N`, `WARN: ` in front of each line; the
/// unreferenced-disk pass warns a second time); PVE 8 writes them with
/// Perl's `warn` and ends `OK`.
#[tokio::test]
async fn a_busy_storage_leaves_the_volume_and_warns_as_each_version_does() {
    for (pve9, with_option, exit, prefix) in [
        (true, true, "WARNINGS: 2", "WARN: "),
        (true, false, "WARNINGS: 1", "WARN: "),
        (false, true, "OK", ""),
    ] {
        let (sim, api) = start_sim(SimConfig { pve9, ..fast() }).await;
        for newid in ["140", "141"] {
            let r = api
                .post(CLONE, &[("newid", newid), ("name", "x"), ("full", "1")])
                .await;
            api.wait_task_of(r).await;
        }
        let used = || {
            let r = api.get("/nodes/pve1/storage/local-lvm/status", &[]);
            async move { r.await.data()["used"].as_u64().expect("used") }
        };
        let before = used().await;
        let admin = |state: &'static str| {
            let call = api
                .c
                .post(format!(
                    "{}/_sim/storages/pve1/local-lvm/{state}",
                    api.base.trim_end_matches("/api2/json")
                ))
                .header("authorization", sim.auth_header())
                .send();
            async move {
                assert_eq!(call.await.expect("admin call").status(), 200, "{state}");
            }
        };
        admin("busy").await;
        let opts: &[(&str, &str)] = if with_option {
            &[("destroy-unreferenced-disks", "1"), ("purge", "1")]
        } else {
            &[("purge", "1")]
        };
        let r = api.delete("/nodes/pve1/qemu/140", opts).await;
        let upid = r.data().as_str().expect("upid").to_string();
        let done = api.wait_task(&upid).await;
        assert_eq!(done["exitstatus"], exit, "pve9={pve9}");
        let log = api.task_log_text(&upid).await;
        let volid = "local-lvm:vm-140-disk-0";
        let why = "lvremove 'pve/vm-140-disk-0' error:   Logical volume pve/vm-140-disk-0 in use.";
        assert!(
            log.contains(&format!(
                "{prefix}Could not remove disk '{volid}', check manually: {why}"
            )),
            "{log}"
        );
        assert_eq!(
            log.contains(&format!("\n{prefix}{why}\n")),
            with_option,
            "the unreferenced-disk pass warns again: {log}"
        );
        assert!(log.ends_with(&format!("TASK {exit}")), "{log}");
        assert!(sim.vm(140).is_none(), "the VM is gone");
        let left = sim.leftover_volumes();
        assert_eq!(left.len(), 1, "{left:?}");
        assert_eq!(left[0].volid, volid);
        assert_eq!(used().await, before, "the volume still takes its space");
        // Freed again, a destroy there removes its disk.
        admin("ok").await;
        let r = api.delete("/nodes/pve1/qemu/141", opts).await;
        let upid = r.data().as_str().expect("upid").to_string();
        assert_eq!(api.wait_task(&upid).await["exitstatus"], "OK");
        assert!(!api.task_log_text(&upid).await.contains("Could not remove"));
        assert_eq!(sim.leftover_volumes().len(), 1);
        sim.shutdown().await;
    }
}
