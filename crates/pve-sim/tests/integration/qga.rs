//! The simulator forwarding guest-agent calls to a real `qemu-ga` (package
//! `qemu-guest-agent`). Without qemu-ga these tests are skipped, except under
//! `CI=true`, where they fail: CI must exercise the real agent.

use std::path::{Path, PathBuf};
use std::time::Duration;

use provider_testkit::host::{alive, or_skip};
use provider_testkit::wait::{until, until_some};
use pve_sim::{GuestAgentMode, PveSim, SimConfig};
use serde_json::Value;

use crate::common::{shutdown_clean, start_sim, Api, Resp};

/// The qemu-ga to use, or `None` (after saying so) to skip.
fn qemu_ga_or_skip() -> Option<PathBuf> {
    or_skip(pve_sim::find_qemu_ga().ok_or_else(|| {
        "qemu-ga is not installed (not on PATH or in /usr/sbin; install the qemu-guest-agent package)".to_string()
    }))
}

fn cfg(bin: PathBuf) -> SimConfig {
    SimConfig {
        guest_agent: GuestAgentMode::Qga(bin),
        clone_duration: Duration::from_millis(50),
        agent_boot_delay: Duration::from_millis(300),
        // Shorter than the boot, so a ping right after the start is refused.
        agent_ping_wait: Duration::from_millis(50),
        ..SimConfig::default()
    }
}

/// Clone template 9000 to `vmid` and start it; returns once the start task ended.
async fn running_vm(api: &Api, vmid: u32) {
    let id = vmid.to_string();
    let r = api
        .post(
            "/nodes/pve1/qemu/9000/clone",
            &[("newid", &id), ("full", "1"), ("pool", "bigfleet")],
        )
        .await;
    assert_eq!(api.wait_task_of(r).await["exitstatus"], "OK");
    let r = api
        .post(&format!("/nodes/pve1/qemu/{vmid}/status/start"), &[])
        .await;
    assert_eq!(api.wait_task_of(r).await["exitstatus"], "OK");
}

async fn wait_agent(api: &Api, vmid: u32) -> Resp {
    let path = format!("/nodes/pve1/qemu/{vmid}/agent/ping");
    api.poll("agent ping", reqwest::Method::POST, &path, |r| {
        r.status == 200
    })
    .await
}

/// A simulator whose VM `vmid` runs and whose qemu-ga answers.
async fn agent_up(bin: PathBuf, vmid: u32) -> (PveSim, Api) {
    let (sim, api) = start_sim(cfg(bin)).await;
    running_vm(&api, vmid).await;
    wait_agent(&api, vmid).await;
    (sim, api)
}

/// Every request the test sent matched the API schema; then stop.
async fn shut_down_clean(sim: PveSim) {
    shutdown_clean(sim).await;
}

async fn wait_gone(pid: u32) {
    until(
        &format!("process {pid} to exit"),
        Duration::from_secs(10),
        || !alive(pid),
    )
    .await;
}

fn canon(p: &Path) -> PathBuf {
    p.canonicalize().expect("canonical path")
}

#[tokio::test]
async fn ping_answers_only_after_boot_delay_from_a_real_qemu_ga() {
    let Some(bin) = qemu_ga_or_skip() else { return };
    let sim = PveSim::start(cfg(bin.clone())).await.unwrap();
    assert_eq!(sim.qemu_ga(), Some(bin.as_path()));
    let api = Api::new(&sim);
    running_vm(&api, 100).await;

    let r = api.post("/nodes/pve1/qemu/100/agent/ping", &[]).await;
    assert_eq!(
        (r.status, r.message().as_str()),
        (500, "QEMU guest agent is not running"),
        "no answer before the boot delay"
    );
    assert_eq!(sim.qemu_ga_pid(100), None, "not started before boot");
    let r = wait_agent(&api, 100).await;
    assert_eq!(r.data()["result"], serde_json::json!({}));

    let pid = sim.qemu_ga_pid(100).expect("qemu-ga runs for VM 100");
    assert!(alive(pid));
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap();
    assert_eq!(exe, canon(&bin), "the real qemu-ga answers");
    let cwd = std::fs::read_link(format!("/proc/{pid}/cwd")).unwrap();
    assert_eq!(
        cwd,
        canon(&sim.guest_root(100)),
        "confined to the scratch dir"
    );
    assert!(sim.guest_root(100).join("run/qemu-ga/qga.sock").exists());
    sim.shutdown().await;
    wait_gone(pid).await;
}

#[tokio::test]
async fn file_write_then_cat_goes_through_qemu_ga() {
    let Some(bin) = qemu_ga_or_skip() else { return };
    let (sim, api) = agent_up(bin, 101).await;

    let content = "joined by qemu-ga\nline two\n";
    let r = api
        .post(
            "/nodes/pve1/qemu/101/agent/file-write",
            &[("file", "/run/bigfleet-bootstrap"), ("content", content)],
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    // Written inside the scratch root, not the host's /run.
    assert_eq!(
        std::fs::read(sim.guest_root(101).join("run/bigfleet-bootstrap")).unwrap(),
        content.as_bytes()
    );
    let done = api.run(101, &["cat", "/run/bigfleet-bootstrap"]).await;
    assert_eq!(done["exitcode"], 0, "{done}");
    assert_eq!(done["out-data"], content);

    // Binary content sent pre-encoded (encode=0).
    let r = api
        .post(
            "/nodes/pve1/qemu/101/agent/file-write",
            &[
                ("file", "/tmp/bin"),
                ("content", "AAEC/w=="),
                ("encode", "0"),
            ],
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(
        sim.read_guest_file(101, "/tmp/bin").unwrap(),
        [0, 1, 2, 255]
    );

    // Commands run in the guest root with $BIGFLEET_GUEST_ROOT set, as with the built-in agent.
    let done = api
        .run(
            101,
            &["/bin/sh", "-c", "pwd; echo \"$BIGFLEET_GUEST_ROOT\""],
        )
        .await;
    let root = canon(&sim.guest_root(101));
    let out = done["out-data"].as_str().unwrap_or_default().to_string();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines.first().map(PathBuf::from),
        Some(root.clone()),
        "{out}"
    );
    assert_eq!(
        lines.get(1).map(|l| canon(Path::new(l))),
        Some(root),
        "{out}"
    );

    // qemu-ga's own error for a missing directory names the guest path, in PVE's shape.
    let r = api
        .post(
            "/nodes/pve1/qemu/101/agent/file-write",
            &[("file", "/no/such/dir/f"), ("content", "x")],
        )
        .await;
    assert_eq!(r.status, 500);
    assert!(
        r.message().starts_with(
            "VM 101 qmp command 'guest-file-open' failed - failed to open file '/no/such/dir/f'"
        ),
        "{}",
        r.message()
    );
    // Escaping the root is refused before qemu-ga sees it.
    let r = api
        .post(
            "/nodes/pve1/qemu/101/agent/file-write",
            &[("file", "/../../etc/x"), ("content", "x")],
        )
        .await;
    assert_eq!(r.status, 500);
    assert!(
        r.message().contains("escapes the guest root"),
        "{}",
        r.message()
    );
    shut_down_clean(sim).await;
}

#[tokio::test]
async fn exit_code_stderr_and_lost_replies_through_qemu_ga() {
    let Some(bin) = qemu_ga_or_skip() else { return };
    let (sim, api) = agent_up(bin, 102).await;

    let r = api
        .exec(
            102,
            &[
                "/bin/sh",
                "-c",
                "echo partial; echo 'kubeadm: boom' >&2; exit 3",
            ],
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let pid = r.data()["pid"].as_u64().unwrap().to_string();
    let path = format!("/nodes/pve1/qemu/102/agent/exec-status?pid={pid}");
    let done = api
        .poll("exit", reqwest::Method::GET, &path, |r| {
            r.data()["exited"] == 1
        })
        .await;
    assert_eq!(done.data()["exitcode"], 3, "{:?}", done.body);
    assert_eq!(done.data()["err-data"], "kubeadm: boom\n");
    assert_eq!(done.data()["out-data"], "partial\n");
    let again = api.get(&path, &[]).await;
    assert_eq!(
        (again.status, again.message().as_str()),
        (
            500,
            "VM 102 qmp command 'guest-exec-status' failed - Invalid parameter 'pid'"
        ),
        "qemu-ga forgets the pid after the exited reply"
    );

    // Output arrives only at exit: the command waits for a file we create.
    let r = api
        .exec(
            102,
            &[
                "/bin/sh",
                "-c",
                "echo early; while [ ! -e run/go ]; do sleep 0.02; done; echo late",
            ],
        )
        .await;
    let pid = r.data()["pid"].as_u64().unwrap().to_string();
    let path = format!("/nodes/pve1/qemu/102/agent/exec-status?pid={pid}");
    let running = api.get(&path, &[]).await;
    assert_eq!(running.data(), &serde_json::json!({"exited": 0}));
    std::fs::write(sim.guest_root(102).join("run/go"), b"").unwrap();
    let done = api
        .poll("exit", reqwest::Method::GET, &path, |r| {
            r.data()["exited"] == 1
        })
        .await;
    assert_eq!(done.data()["out-data"], "early\nlate\n");

    // stdin from input-data.
    let r = api
        .c
        .post(format!("{}/nodes/pve1/qemu/102/agent/exec", api.base))
        .header("authorization", api.auth.as_deref().expect("token"))
        .json(
            &serde_json::json!({"command": ["/bin/sh", "-c", "cat"], "input-data": "from-stdin\n"}),
        )
        .send()
        .await
        .unwrap();
    let pid = r.json::<Value>().await.unwrap()["data"]["pid"]
        .as_u64()
        .unwrap();
    let path = format!("/nodes/pve1/qemu/102/agent/exec-status?pid={pid}");
    let done = api
        .poll("exit", reqwest::Method::GET, &path, |r| {
            r.data()["exited"] == 1
        })
        .await;
    assert_eq!(done.data()["out-data"], "from-stdin\n");

    // Fault injection stays in front of qemu-ga: a dropped reply loses the exit.
    sim.faults().drop_exec_status_replies(1);
    let r = api.exec(102, &["/bin/true"]).await;
    let pid = r.data()["pid"].as_u64().unwrap().to_string();
    let path = format!("/nodes/pve1/qemu/102/agent/exec-status?pid={pid}");
    let lost = api
        .poll("dropped reply", reqwest::Method::GET, &path, |r| {
            r.status != 200 || r.data()["exited"] == 1
        })
        .await;
    assert_eq!(lost.status, 500);
    assert!(lost.message().contains("got timeout"), "{}", lost.message());
    let after = api.get(&path, &[]).await;
    assert!(
        after.message().contains("Invalid parameter 'pid'"),
        "{}",
        after.message()
    );

    // A missing binary fails the exec call itself with qemu-ga's text.
    let r = api.exec(102, &["/no/such/binary"]).await;
    assert_eq!(r.status, 500);
    assert!(
        r.message().starts_with(
            "VM 102 qmp command 'guest-exec' failed - Guest agent command failed, error was 'Failed to execute child process"
        ),
        "{}",
        r.message()
    );
    shut_down_clean(sim).await;
}

#[tokio::test]
async fn stopping_or_destroying_a_vm_kills_its_qemu_ga() {
    let Some(bin) = qemu_ga_or_skip() else { return };
    let (sim, api) = agent_up(bin, 103).await;
    let pid = sim.qemu_ga_pid(103).expect("qemu-ga for VM 103");

    // A long-running guest command dies with its VM too.
    let r = api
        .exec(
            103,
            &[
                "/bin/sh",
                "-c",
                "echo $$ > \"$BIGFLEET_GUEST_ROOT/run/sleeper\"; exec sleep 300",
            ],
        )
        .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let pidfile = sim.guest_root(103).join("run/sleeper");
    let sleeper: u32 = until_some(
        "the guest command to start",
        Duration::from_secs(10),
        || {
            std::fs::read_to_string(&pidfile)
                .ok()
                .and_then(|s| s.trim().parse().ok())
        },
    )
    .await;
    assert!(alive(sleeper));

    let r = api.post("/nodes/pve1/qemu/103/status/stop", &[]).await;
    assert_eq!(api.wait_task_of(r).await["exitstatus"], "OK");
    assert_eq!(sim.qemu_ga_pid(103), None);
    wait_gone(pid).await;
    wait_gone(sleeper).await;
    let r = api.post("/nodes/pve1/qemu/103/agent/ping", &[]).await;
    assert_eq!(r.message(), "VM 103 is not running");

    // Started again: a fresh qemu-ga once booted.
    let r = api.post("/nodes/pve1/qemu/103/status/start", &[]).await;
    assert_eq!(api.wait_task_of(r).await["exitstatus"], "OK");
    wait_agent(&api, 103).await;
    let pid2 = sim.qemu_ga_pid(103).expect("restarted qemu-ga");
    assert_ne!(pid2, pid);

    // Stopped behind the API's back, then destroyed.
    assert!(sim.stop_vm_out_of_band(103));
    wait_gone(pid2).await;
    let r = api
        .call(
            reqwest::Method::DELETE,
            "/nodes/pve1/qemu/103",
            &[("purge", "1")],
        )
        .await;
    assert_eq!(api.wait_task_of(r).await["exitstatus"], "OK");
    assert!(!sim.guest_root(103).exists());

    // Dropping the simulator kills the rest.
    let api2 = Api::new(&sim);
    running_vm(&api2, 104).await;
    wait_agent(&api2, 104).await;
    let pid3 = sim.qemu_ga_pid(104).expect("qemu-ga for VM 104");
    drop(sim);
    wait_gone(pid3).await;
}

#[tokio::test]
async fn builtin_mode_ignores_an_installed_qemu_ga() {
    let sim = PveSim::start(SimConfig {
        guest_agent: GuestAgentMode::BuiltIn,
        clone_duration: Duration::from_millis(50),
        agent_boot_delay: Duration::ZERO,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    assert_eq!(sim.qemu_ga(), None);
    assert_eq!(sim.guest_agent_description(), "built-in");
    let api = Api::new(&sim);
    running_vm(&api, 105).await;
    wait_agent(&api, 105).await;
    let done = api.run(105, &["/bin/sh", "-c", "exit 4"]).await;
    assert_eq!(done["exitcode"], 4);
    assert_eq!(sim.qemu_ga_pid(105), None);
    sim.shutdown().await;
}

#[test]
fn mode_parsing_and_missing_binary() {
    assert_eq!("auto".parse::<GuestAgentMode>(), Ok(GuestAgentMode::Auto));
    assert_eq!(
        "builtin".parse::<GuestAgentMode>(),
        Ok(GuestAgentMode::BuiltIn)
    );
    assert_eq!(
        "/opt/qga/qemu-ga".parse::<GuestAgentMode>(),
        Ok(GuestAgentMode::Qga("/opt/qga/qemu-ga".into()))
    );
    let e = "fast".parse::<GuestAgentMode>().unwrap_err();
    assert!(e.contains("unknown guest agent 'fast'"), "{e}");
    let e = GuestAgentMode::Qga("/nonexistent/qemu-ga".into())
        .resolve()
        .unwrap_err()
        .to_string();
    assert!(e.contains("qemu-guest-agent"), "{e}");
}
