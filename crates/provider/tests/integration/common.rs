//! Shared helpers for the black-box tests of the `bigfleet-proxmox` binary:
//! spawn it, learn its ports from the startup line, wait for readiness with
//! a deadline, capture stderr, talk HTTP/1.1 to the probes, and kill it on
//! drop.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use bigfleet_proto::v1alpha1::capacity_provider_client::CapacityProviderClient;
use bigfleet_proto::v1alpha1::{ListFilter, Machine, MachineRef, MachineState};
use provider_testkit::wait::{child_exit, Wait};
use proxmox_backend::proxmox::parse_marker;
use pve_sim::PveSim;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

pub const BIN: &str = env!("CARGO_BIN_EXE_bigfleet-proxmox");

/// Generous: a cold debug binary on a shared 2-core machine.
pub const STARTUP_DEADLINE: Duration = Duration::from_secs(60);
pub const POLL: Duration = Duration::from_millis(25);

/// A 127.0.0.1 listener the test holds, so its port is certainly taken.
pub fn held_listener() -> (TcpListener, SocketAddr) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    let a = l.local_addr().expect("local addr");
    (l, a)
}

/// Every stderr line of a child, as it arrives.
#[derive(Default)]
pub struct Logs {
    state: Mutex<(Vec<String>, bool)>,
    cond: Condvar,
}

impl Logs {
    fn spawn_reader(stream: impl Read + Send + 'static) -> Arc<Logs> {
        let logs = Arc::new(Logs::default());
        let sink = logs.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines() {
                let Ok(line) = line else { break };
                let mut st = sink.state.lock().unwrap();
                st.0.push(line);
                sink.cond.notify_all();
            }
            sink.state.lock().unwrap().1 = true;
            sink.cond.notify_all();
        });
        logs
    }

    pub fn lines(&self) -> Vec<String> {
        self.state.lock().unwrap().0.clone()
    }

    pub fn text(&self) -> String {
        self.lines().join("\n")
    }

    /// The first line matching `pred`, waiting up to `timeout`; None if the
    /// stream ended or the deadline passed first.
    pub fn wait_for(&self, timeout: Duration, pred: impl Fn(&str) -> bool) -> Option<String> {
        let deadline = Instant::now() + timeout;
        let mut st = self.state.lock().unwrap();
        loop {
            if let Some(l) = st.0.iter().find(|l| pred(l)) {
                return Some(l.clone());
            }
            if st.1 {
                return None;
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            st = self.cond.wait_timeout(st, deadline - now).unwrap().0;
        }
    }

    /// Wait until at least `n` lines match `pred`; false on timeout or EOF.
    pub fn wait_count(&self, timeout: Duration, n: usize, pred: impl Fn(&str) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = self.state.lock().unwrap();
        loop {
            if st.0.iter().filter(|l| pred(l)).count() >= n {
                return true;
            }
            let now = Instant::now();
            if st.1 || now >= deadline {
                return false;
            }
            st = self.cond.wait_timeout(st, deadline - now).unwrap().0;
        }
    }

    /// Wait until the stream is closed (the child exited).
    pub fn wait_closed(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = self.state.lock().unwrap();
        while !st.1 {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            st = self.cond.wait_timeout(st, deadline - now).unwrap().0;
        }
        true
    }
}

/// Outcome of a run that is expected to end on its own.
pub struct Exited {
    pub status: ExitStatus,
    pub stderr: String,
}

/// Run the binary with exactly `args` and wait for it to exit.
pub fn run_to_exit(args: &[&str], timeout: Duration) -> Exited {
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn bigfleet-proxmox");
    let logs = Logs::spawn_reader(child.stderr.take().expect("stderr"));
    let Some(status) = child_exit(&mut child, timeout) else {
        let _ = child.kill();
        let _ = child.wait();
        panic!(
            "bigfleet-proxmox {args:?} did not exit within {timeout:?}; stderr:\n{}",
            logs.text()
        );
    };
    logs.wait_closed(Duration::from_secs(5));
    Exited {
        status,
        stderr: logs.text(),
    }
}

/// A provider still starting (or refusing to): its stderr as it comes, a
/// signal, its exit. Killed on drop.
pub struct Starting {
    child: Child,
    pub logs: Arc<Logs>,
}

impl Starting {
    /// Runs the binary with exactly `args`, without waiting for anything.
    pub fn spawn(args: &[&str]) -> Starting {
        let mut child = Command::new(BIN)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn bigfleet-proxmox");
        let logs = Logs::spawn_reader(child.stderr.take().expect("stderr"));
        Starting { child, logs }
    }

    #[allow(unsafe_code)] // libc call; see the SAFETY note inside
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid; it is not reaped yet, so the
        // pid cannot have been reused.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, sig) };
        assert_eq!(rc, 0, "kill({sig}) failed");
    }

    /// Waits for the process to exit on its own.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let status = child_exit(&mut self.child, timeout);
        if status.is_some() {
            self.logs.wait_closed(Duration::from_secs(5));
        }
        status
    }
}

impl Drop for Starting {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a replica of a shared PostgreSQL state logs once its listeners are
/// up, leader or not.
pub const REPLICA_LINE: &str =
    "replica of a shared PostgreSQL state: standby until it holds the leader lease";

/// A running provider; killed on drop.
pub struct Provider {
    child: Child,
    pub logs: Arc<Logs>,
    pub grpc: SocketAddr,
    pub metrics: SocketAddr,
    pub startup_line: String,
}

impl Provider {
    /// Start with ephemeral gRPC and metrics ports on 127.0.0.1 plus
    /// `args`, and return once the startup line is out and /readyz is 200.
    pub fn start(args: &[&str]) -> Provider {
        let provider = Provider::spawn_until(args, "its startup line", |l| {
            provider_testkit::is_startup_line(l)
        });
        provider.wait_ready(STARTUP_DEADLINE);
        provider
    }

    /// Start with ephemeral ports plus `args` and wait for the first line
    /// `first` accepts, which names the listeners (`addr`, `metrics_addr`).
    fn spawn_until(args: &[&str], what: &str, first: impl Fn(&str) -> bool) -> Provider {
        let mut child = Command::new(BIN)
            .args(["--addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn bigfleet-proxmox");
        let logs = Logs::spawn_reader(child.stderr.take().expect("stderr"));
        let Some(line) = logs.wait_for(STARTUP_DEADLINE, first) else {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "bigfleet-proxmox {args:?} never logged {what}; stderr:\n{}",
                logs.text()
            );
        };
        let parse = |key: &str| -> SocketAddr {
            provider_testkit::addr_field(&line, key).unwrap_or_else(|e| panic!("{e}"))
        };
        Provider {
            grpc: parse("addr"),
            metrics: parse("metrics_addr"),
            child,
            logs,
            startup_line: line,
        }
    }

    /// Start a replica of a shared PostgreSQL state with ephemeral ports
    /// plus `args`, and return once it has said it is a replica (it may be
    /// a standby; it serves once [`Provider::wait_ready`] returns).
    pub fn start_replica(args: &[&str]) -> Provider {
        Provider::spawn_until(args, "that it is a replica", |l| {
            provider_testkit::field(l, "msg").as_deref() == Some(REPLICA_LINE)
        })
    }

    /// Poll /readyz until it answers 200 `ready`.
    pub fn wait_ready(&self, timeout: Duration) {
        let body = Wait::new("/readyz to answer 200", timeout)
            .every(POLL)
            .try_ok_blocking(|| match http_get(self.metrics, "/readyz") {
                Ok((200, body)) => Ok(body),
                other => Err(other),
            })
            .unwrap_or_else(|t| panic!("{t}; stderr:\n{}", self.logs.text()));
        assert_eq!(body, "ready");
    }

    /// The child's pid (its CPU time is read from /proc by the benchmark).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    #[allow(unsafe_code)] // libc call; see the SAFETY note inside
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        // SAFETY: kill(2) on our own child's pid; it is not reaped yet, so the
        // pid cannot have been reused.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, sig) };
        assert_eq!(rc, 0, "kill({sig}) failed");
    }

    /// Wait for the process to exit on its own.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let status = child_exit(&mut self.child, timeout);
        if status.is_some() {
            self.logs.wait_closed(Duration::from_secs(5));
        }
        status
    }

    pub fn stderr(&self) -> String {
        self.logs.text()
    }

    pub async fn client(&self) -> CapacityProviderClient<Channel> {
        CapacityProviderClient::new(plain_channel(self.grpc).await)
    }
}

impl Drop for Provider {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

pub async fn plain_channel(addr: SocketAddr) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(20))
        .connect()
        .await
        .expect("connect to the provider")
}

/// A channel to `addr` over TLS for `localhost`, trusting the CA at `ca`
/// and presenting `identity` (certificate, key) if given. Any failure
/// (building the endpoint, connecting, the handshake) is an Err with its
/// description.
pub async fn tls_channel(
    addr: SocketAddr,
    ca: &Path,
    identity: Option<(&Path, &Path)>,
) -> Result<Channel, String> {
    let read = |p: &Path| std::fs::read_to_string(p).expect("read pem");
    let mut tls = ClientTlsConfig::new()
        .domain_name("localhost")
        .ca_certificate(Certificate::from_pem(read(ca)));
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(read(cert), read(key)));
    }
    Endpoint::from_shared(format!("https://{addr}"))
        .map_err(|e| e.to_string())?
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .map_err(|e| format!("connect: {e:?}"))
}

/// Boots the binary with `args` from async code (blocking: beside the
/// runtime that serves the simulator) and returns once it is ready.
pub async fn start_blocking(args: Vec<String>) -> Provider {
    tokio::task::spawn_blocking(move || {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        Provider::start(&refs)
    })
    .await
    .expect("provider start")
}

/// The simulator's CA written to a file in a fresh temporary directory.
pub fn sim_ca_file(sim: &PveSim) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = dir.path().join("pve-ca.pem");
    sim.write_ca(&ca).expect("write CA");
    (dir, ca)
}

/// The flags for the PVE API at `url` with the simulator's token id and
/// `secret`, trusting the CA file `ca`, in the pool `bigfleet` on `nodes`.
pub fn pve_flags(sim: &PveSim, url: &str, secret: &str, ca: &str, nodes: &str) -> Vec<String> {
    [
        "--proxmox-api-url",
        url,
        "--proxmox-token-id",
        sim.token_id(),
        "--proxmox-token-secret",
        secret,
        "--proxmox-ca-file",
        ca,
        "--proxmox-pool",
        "bigfleet",
        "--nodes",
        nodes,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The real backend on the simulator (`--proxmox-backend proxmox` and
/// [`pve_flags`] for its own API and secret), then `more`.
pub fn sim_backend_args(sim: &PveSim, ca: &Path, nodes: &str, more: &[&str]) -> Vec<String> {
    let mut args = vec!["--proxmox-backend".to_string(), "proxmox".to_string()];
    args.extend(pve_flags(
        sim,
        &sim.base_url(),
        sim.token_secret(),
        path_str(ca),
        nodes,
    ));
    args.extend(more.iter().map(|s| s.to_string()));
    args
}

/// The simulator's VMs that carry our description marker, by the machine id
/// it names (`node/vmid` each).
pub fn marked(sim: &PveSim) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for vm in sim.vms().values() {
        if vm.template {
            continue;
        }
        if let Some(id) = vm.description.as_deref().and_then(parse_marker) {
            out.entry(id)
                .or_default()
                .push(format!("{}/{}", vm.node, vm.vmid));
        }
    }
    out
}

/// Waits until the simulator has no task in progress (no VM holds a lock,
/// twice in a row), failing after `within`.
pub async fn sim_settled(sim: &PveSim, within: Duration) {
    let mut quiet = 0;
    Wait::new(
        "the simulator to settle (no VM locked, twice in a row)",
        within,
    )
    .every(Duration::from_millis(50))
    .until(|| {
        let busy = sim
            .vms()
            .values()
            .any(|vm| vm.lock.is_some() || vm.flock > 0);
        quiet = if busy { 0 } else { quiet + 1 };
        quiet >= 2
    })
    .await
}

/// A GET to the probes or `/metrics`: status code and body.
pub fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    provider_testkit::http::get(addr, path).map(|r| (r.status, r.body))
}

/// The id of a SPECULATIVE slot (the first one List returns).
/// Sends a Create for each of `ids` at once, as a burst of callers would,
/// and returns the ids accepted and the ids refused. Every refusal must be
/// RESOURCE_EXHAUSTED (a guard's, before anything started) with a message
/// naming its machine and holding each of `says`.
pub async fn create_burst(
    client: &CapacityProviderClient<Channel>,
    ids: &[String],
    says: &[&str],
) -> (Vec<String>, Vec<String>) {
    let burst: Vec<_> = ids
        .iter()
        .map(|id| {
            let mut c = client.clone();
            let id = id.clone();
            tokio::spawn(async move {
                let r = c
                    .create(bigfleet_proto::v1alpha1::CreateRequest {
                        machine_id: id.clone(),
                        ..Default::default()
                    })
                    .await;
                (id, r)
            })
        })
        .collect();
    let mut accepted = Vec::new();
    let mut refused = Vec::new();
    for task in burst {
        let (id, r) = task.await.expect("Create task");
        match r {
            Ok(_) => accepted.push(id),
            Err(status) => {
                assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
                let m = status.message();
                assert!(says.iter().all(|s| m.contains(s)) && m.contains(&id), "{m}");
                refused.push(id);
            }
        }
    }
    (accepted, refused)
}

pub async fn speculative_id(c: &mut CapacityProviderClient<Channel>) -> String {
    speculative_where(c, "", |_| true).await
}

/// Sends a plain Create for a SPECULATIVE slot; its id.
pub async fn create_speculative(c: &mut CapacityProviderClient<Channel>) -> String {
    let id = speculative_id(c).await;
    c.create(bigfleet_proto::v1alpha1::CreateRequest {
        machine_id: id.clone(),
        ..Default::default()
    })
    .await
    .expect("Create");
    id
}

/// The id of a SPECULATIVE slot in zone `node`.
pub async fn speculative_in(c: &mut CapacityProviderClient<Channel>, node: &str) -> String {
    speculative_where(c, &format!(" in zone {node}"), |m| m.zone == node).await
}

async fn speculative_where(
    c: &mut CapacityProviderClient<Channel>,
    what: &str,
    pred: impl Fn(&Machine) -> bool,
) -> String {
    c.list(ListFilter::default())
        .await
        .expect("List")
        .into_inner()
        .machines
        .into_iter()
        .find(|m| m.state == MachineState::Speculative as i32 && pred(m))
        .unwrap_or_else(|| panic!("a SPECULATIVE slot{what}"))
        .id
}

/// Poll Get until the machine reaches `want` (failing fast on FAILED).
pub async fn wait_state(
    client: &mut CapacityProviderClient<Channel>,
    id: &str,
    want: MachineState,
    timeout: Duration,
) -> Machine {
    poll_get(
        client,
        id,
        timeout,
        |m| m.state == want as i32,
        |m, late| {
            assert!(
                m.state != MachineState::Failed as i32,
                "{id} went FAILED waiting for {want:?}: {}",
                m.last_error
            );
            assert!(
                !late,
                "{id} is still {:?}, not {want:?}, after {timeout:?}",
                MachineState::try_from(m.state)
            );
        },
    )
    .await
}

/// Poll Get until the machine is FAILED.
pub async fn wait_failed(
    client: &mut CapacityProviderClient<Channel>,
    id: &str,
    timeout: Duration,
) -> Machine {
    poll_get(
        client,
        id,
        timeout,
        |m| m.state == MachineState::Failed as i32,
        |m, late| assert!(!late, "never FAILED: {m:?}"),
    )
    .await
}

/// Polls Get until `done` accepts the machine; every other answer goes to
/// `check`, with whether `timeout` has passed, to assert on.
async fn poll_get(
    client: &mut CapacityProviderClient<Channel>,
    id: &str,
    timeout: Duration,
    done: impl Fn(&Machine) -> bool,
    check: impl Fn(&Machine, bool),
) -> Machine {
    let polled = Wait::new(format!("{id} to land"), timeout)
        .every(POLL)
        .try_ok_async(|| {
            let mut client = client.clone();
            let (done, check) = (&done, &check);
            async move {
                let m = client
                    .get(MachineRef { id: id.to_string() })
                    .await
                    .expect("Get")
                    .into_inner();
                if done(&m) {
                    return Ok(m);
                }
                check(&m, false);
                Err(m)
            }
        })
        .await;
    polled.unwrap_or_else(|t| {
        check(&t.last, true);
        unreachable!("check() fails a late answer: {t}")
    })
}

/// Throwaway PKI: a CA, a server leaf for 127.0.0.1/localhost and a client
/// leaf signed by it (an operator's: `bigfleet://admin`), and a client leaf
/// from an unrelated CA, all written as PEM files under a temporary
/// directory; [`Pki::client`] mints more client leaves from the same CA.
pub struct Pki {
    pub dir: tempfile::TempDir,
    root: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    pub other_ca: PathBuf,
    pub other_client_cert: PathBuf,
    pub other_client_key: PathBuf,
}

fn ca(name: &str) -> rcgen::CertifiedIssuer<'static, rcgen::KeyPair> {
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    rcgen::CertifiedIssuer::self_signed(params, rcgen::KeyPair::generate().expect("key"))
        .expect("self-signed CA")
}

/// A leaf for the DNS names or IP addresses `sans` plus the URI SANs `uris`.
fn leaf(
    issuer: &rcgen::Issuer<'_, rcgen::KeyPair>,
    sans: &[&str],
    uris: &[&str],
    cn: &str,
    usage: rcgen::ExtendedKeyUsagePurpose,
) -> (String, String) {
    let mut params =
        rcgen::CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .expect("params");
    for uri in uris {
        let uri = rcgen::string::Ia5String::try_from(*uri).expect("an ASCII URI");
        params.subject_alt_names.push(rcgen::SanType::URI(uri));
    }
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, cn);
    params.extended_key_usages = vec![usage];
    let key = rcgen::KeyPair::generate().expect("key");
    let cert = params.signed_by(&key, issuer).expect("sign leaf");
    (cert.pem(), key.serialize_pem())
}

impl Pki {
    pub fn new() -> Pki {
        let dir = tempfile::tempdir().expect("tempdir");
        let write = |name: &str, text: &str| -> PathBuf {
            let p = dir.path().join(name);
            std::fs::write(&p, text).expect("write pem");
            p
        };
        let root = ca("bigfleet test CA");
        let other = ca("unrelated test CA");
        let (scert, skey) = leaf(
            &root,
            &["127.0.0.1", "localhost"],
            &[],
            "provider",
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        );
        let (ccert, ckey) = leaf(
            &root,
            &["client.test"],
            &["bigfleet://admin"],
            "client",
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        );
        let (ocert, okey) = leaf(
            &other,
            &["client.test"],
            &["bigfleet://admin"],
            "client",
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        );
        Pki {
            ca: write("ca.pem", &root.pem()),
            server_cert: write("server.pem", &scert),
            server_key: write("server.key", &skey),
            client_cert: write("client.pem", &ccert),
            client_key: write("client.key", &ckey),
            other_ca: write("other-ca.pem", &other.pem()),
            other_client_cert: write("other-client.pem", &ocert),
            other_client_key: write("other-client.key", &okey),
            root,
            dir,
        }
    }

    /// A client leaf from the CA with the URI SANs `uris`, written as
    /// `NAME.pem` and `NAME.key`: (certificate, key).
    pub fn client(&self, name: &str, uris: &[&str]) -> (PathBuf, PathBuf) {
        let (cert, key) = leaf(
            &self.root,
            &["client.test"],
            uris,
            name,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        );
        (
            self.write(&format!("{name}.pem"), &cert),
            self.write(&format!("{name}.key"), &key),
        )
    }

    /// A file in the PKI directory with arbitrary content.
    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.dir.path().join(name);
        std::fs::write(&p, text).expect("write file");
        p
    }
}

pub fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

/// promtool (Debian's prometheus package) on PATH; without it the check is
/// skipped, except under `CI=true`, where `.ci/run` installs it
/// ([`provider_testkit::host::or_skip`]).
pub fn promtool_or_skip() -> Option<PathBuf> {
    provider_testkit::host::or_skip(
        std::env::var_os("PATH")
            .and_then(|path| {
                std::env::split_paths(&path)
                    .map(|dir| dir.join("promtool"))
                    .find(|p| p.is_file())
            })
            .ok_or_else(|| {
                "promtool was not found on PATH; install it with \
                 `apt-get install -y --no-install-recommends prometheus`"
                    .to_owned()
            }),
    )
}

/// `promtool check metrics` on `exposition`: (clean exit, its report).
pub fn promtool_check_metrics(promtool: &Path, exposition: &str) -> (bool, String) {
    let mut child = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool check metrics");
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(exposition.as_bytes())
        .expect("write the exposition to promtool");
    let out = child.wait_with_output().expect("promtool ran");
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success() && report.trim().is_empty(), report)
}
