//! The `pve-sim` binary's flags and `--config` file (`pve_sim::cli`): run
//! it with a file and flags, and check through the API that each knob took
//! effect and that the command line won over the file. The knobs model
//! pve-storage's `storage.cfg` (sizes, `nodes`), pve-access-control's
//! ACLs (`/access/permissions`), pve-network's VNets and pve-guest-common's
//! `PVE/Mapping/PCI.pm` mappings.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

/// The simulator process; killed (by its own handle) when dropped.
struct Running {
    child: Child,
    base: String,
    token: String,
    client: reqwest::Client,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill(); // already gone is fine
        let _ = self.child.wait();
    }
}

impl Running {
    async fn get(&self, path: &str) -> Value {
        let r = self
            .client
            .get(format!("{}{path}", self.base))
            .header("authorization", &self.token)
            .send()
            .await
            .expect("request");
        assert_eq!(r.status().as_u16(), 200, "{path}");
        r.json::<Value>().await.expect("json")["data"].clone()
    }
}

/// Start the binary; read its `base_url`, `token_id` and `token_secret`
/// lines (it prints them once it serves) and the CA it wrote.
fn start(args: &[&str], dir: &std::path::Path) -> Running {
    let ca = dir.join("ca.pem");
    let mut child = Command::new(env!("CARGO_BIN_EXE_pve-sim"))
        .args(args)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--guest-agent",
            "builtin",
            "--ca-out",
        ])
        .arg(&ca)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn pve-sim");
    let stdout = child.stdout.take().expect("stdout");
    let mut fields = std::collections::BTreeMap::new();
    let mut lines = BufReader::new(stdout).lines();
    // Blocks until the lines come; the process prints them once bound.
    for line in lines.by_ref() {
        let line = line.expect("stdout line");
        if let Some((k, v)) = line.split_once(": ") {
            fields.insert(k.to_string(), v.to_string());
        }
        if line.starts_with("fingerprint:") {
            break;
        }
    }
    // Keep reading what it prints later: a closed pipe would fail its
    // next write.
    std::thread::spawn(move || lines.for_each(drop));
    let pem = std::fs::read(&ca).expect("CA written");
    let client = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(&pem).expect("CA pem"))
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client");
    Running {
        base: fields.get("base_url").expect("base_url line").clone(),
        token: format!(
            "PVEAPIToken={}={}",
            fields.get("token_id").expect("token_id line"),
            fields.get("token_secret").expect("token_secret line")
        ),
        child,
        client,
    }
}

fn row<'a>(list: &'a Value, key: &str, name: &str) -> &'a Value {
    list.as_array()
        .and_then(|a| a.iter().find(|r| r[key] == name))
        .unwrap_or(&Value::Null)
}

/// A config file sets storages (type, size per node, `nodes`), a dropped
/// privilege, a PCI mapping and an SDN VNet; flags add to the lists and
/// replace single values (the PVE version, one node's storage size).
#[tokio::test]
async fn the_binary_takes_a_config_file_and_flags() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("sim.json");
    std::fs::write(
        &file,
        json!({
            "nodes": "pve1,pve2",
            "storage": ["local-lvm=lvmthin,size=200G", "nfs1=nfs,shared,size=2T,nodes=pve1"],
            "storage-size": ["local-lvm@pve2=300G"],
            "drop-privilege": ["/storage/nfs1:Datastore.Audit"],
            "grant-privilege": ["/mapping/pci:Mapping.Audit"],
            "pci-mapping": ["gpu=pve1:2"],
            "sdn-vnet": ["vnet1=zone1"],
            "pve-version": 8,
            "rrd-lag": "0s"
        })
        .to_string(),
    )
    .expect("write config");
    let sim = start(
        &[
            "--config",
            file.to_str().expect("utf-8 path"),
            "--pve-version",
            "9",
            "--storage-size",
            "local-lvm@pve1=150G",
            "--node-cpus",
            "8",
        ],
        dir.path(),
    );
    let gib = |n: u64| json!(n << 30);
    let pve1 = sim.get("/nodes/pve1/storage").await;
    assert_eq!(row(&pve1, "storage", "local-lvm")["total"], gib(150));
    assert_eq!(row(&pve1, "storage", "nfs1")["total"], gib(2048));
    assert_eq!(row(&pve1, "storage", "nfs1")["shared"], 1);
    let pve2 = sim.get("/nodes/pve2/storage").await;
    assert_eq!(row(&pve2, "storage", "local-lvm")["total"], gib(300));
    assert_eq!(row(&pve2, "storage", "nfs1")["enabled"], 0, "nodes=pve1");

    let perms = sim.get("/access/permissions?path=/storage/nfs1").await;
    let held = &perms["/storage/nfs1"];
    assert!(held.get("Datastore.Audit").is_none(), "{held}");
    assert_eq!(held["Datastore.AllocateSpace"], 1);

    let maps = sim.get("/cluster/mapping/pci").await;
    assert_eq!(
        row(&maps, "id", "gpu")["map"].as_array().map(Vec::len),
        Some(2)
    );
    let vnets = sim.get("/cluster/sdn/vnets").await;
    assert_eq!(row(&vnets, "vnet", "vnet1")["zone"], "zone1");
    let nodes = sim.get("/nodes").await;
    assert_eq!(row(&nodes, "node", "pve1")["maxcpu"], 8, "--node-cpus");
    let version = sim.get("/version").await;
    assert_eq!(version["release"], "9.0", "the flag won over the file's 8");
}

/// Bad input ends the process with a usage error (exit code 2) naming the
/// problem and the file, not a panic.
#[test]
fn a_bad_config_file_is_a_usage_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("bad.json");
    for (content, wants) in [
        (r#"{"pci-mapping": ["gpu=pve9:1"]}"#, "not in --nodes"),
        (
            r#"{"storage-sise": "x"}"#,
            "\"storage-sise\" is not a pve-sim flag",
        ),
        (r#"{"pve-version": 7}"#, "config file"),
        ("[1]", "top level must be a JSON object"),
    ] {
        std::fs::write(&file, content).expect("write");
        let out = Command::new(env!("CARGO_BIN_EXE_pve-sim"))
            .args(["--listen", "127.0.0.1:0", "--config"])
            .arg(&file)
            .output()
            .expect("run pve-sim");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{content}: {err}");
        assert!(err.contains(wants), "{content}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}
