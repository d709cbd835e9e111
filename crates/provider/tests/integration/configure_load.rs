//! Large bootstrap blobs through the binary on the PVE simulator: four 1 MiB
//! Configures at once leave every other call prompt and leak nothing, and
//! (ignored, `make bench-configure`) the figures for BENCHMARKS.md: the
//! slowest Configure, the provider's CPU seconds, and Get p99 while they run
//! against Get p99 at rest.

use std::time::{Duration, Instant};

use crate::common::{self, path_str, sim_backend_args, sim_ca_file, wait_state, Provider};
use bigfleet_proto::v1alpha1::capacity_provider_client::CapacityProviderClient;
use bigfleet_proto::v1alpha1::{
    ConfigureRequest, CreateRequest, Machine, MachineRef, MachineState,
};
use pve_sim::{PveSim, SimConfig};
use tonic::transport::Channel;

const DEADLINE: Duration = Duration::from_secs(120);
/// Every secret of the blobs carries it; nothing the provider shows may.
const MARK: &str = "cr3t";

/// A bootstrap script of `size` bytes. Its first line runs; the rest are
/// comments, each with a secret token. With `echo`, the script prints 4 kB
/// of itself to stderr and exits 3, as a hook that traces its input does.
fn blob(size: usize, echo: bool) -> Vec<u8> {
    let mut s = if echo {
        "tail -c +2000 \"$0\" | head -c 4000 >&2; exit 3\n".to_string()
    } else {
        "exit 0\n".to_string()
    };
    let mut i: u64 = 0;
    while s.len() < size {
        s.push_str(&format!(
            "# s3cr3t{:016x} and some words of a cloud-config line {i}\n",
            i.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ));
        i += 1;
    }
    s.truncate(size);
    s.into_bytes()
}

/// The provider on the simulator with `n` machines IDLE on pve1 and no
/// readiness gate.
async fn idle_machines(
    n: usize,
) -> (
    PveSim,
    tempfile::TempDir,
    Provider,
    CapacityProviderClient<Channel>,
    Vec<String>,
) {
    let sim = PveSim::start(SimConfig::default())
        .await
        .expect("simulator");
    let (dir, ca) = sim_ca_file(&sim);
    let state = dir.path().join("state.db");
    let seed = n.to_string();
    let args = sim_backend_args(
        &sim,
        &ca,
        "pve1",
        &[
            "--seed-count",
            &seed,
            "--proxmox-poll-interval",
            "50ms",
            "--readiness-command",
            "",
            "--state",
            path_str(&state),
        ],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let provider = Provider::start(&args);
    let mut c = provider.client().await;
    let mut ids = Vec::new();
    for _ in 0..n {
        let id = common::speculative_in(&mut c, "pve1").await;
        c.create(CreateRequest {
            machine_id: id.clone(),
            ..Default::default()
        })
        .await
        .expect("Create");
        ids.push(id);
    }
    for id in &ids {
        wait_state(&mut c, id, MachineState::Idle, DEADLINE).await;
    }
    (sim, dir, provider, c, ids)
}

async fn get(c: &mut CapacityProviderClient<Channel>, id: &str) -> (Machine, Duration) {
    let t = Instant::now();
    let m = c
        .get(MachineRef { id: id.to_string() })
        .await
        .expect("Get")
        .into_inner();
    (m, t.elapsed())
}

fn terminal(m: &Machine) -> bool {
    m.state == MachineState::Configured as i32 || m.state == MachineState::Failed as i32
}

/// Starts one Configure per id with `blob`, then Gets `probe` back to back
/// until every id has landed. Returns the Get latencies seen while at least
/// one was still CONFIGURING, the slowest Configure's wall time and the
/// landed machines.
async fn configure_all(
    c: &mut CapacityProviderClient<Channel>,
    ids: &[String],
    probe: &str,
    blob: &[u8],
) -> (Vec<Duration>, Duration, Vec<Machine>) {
    let start = Instant::now();
    for id in ids {
        c.configure(ConfigureRequest {
            machine_id: id.clone(),
            cluster_id: "c1".into(),
            bootstrap_blob: blob.to_vec(),
            ..Default::default()
        })
        .await
        .expect("Configure is accepted");
    }
    let mut during = Vec::new();
    let mut landed: Vec<Option<(Machine, Duration)>> = vec![None; ids.len()];
    while landed.iter().any(Option::is_none) {
        assert!(
            start.elapsed() < DEADLINE,
            "the Configures did not land within {DEADLINE:?}"
        );
        let (_, took) = get(c, probe).await;
        during.push(took);
        for (i, id) in ids.iter().enumerate() {
            if landed[i].is_none() {
                let (m, _) = get(c, id).await;
                if terminal(&m) {
                    landed[i] = Some((m, start.elapsed()));
                }
            }
        }
    }
    let landed: Vec<(Machine, Duration)> = landed.into_iter().flatten().collect();
    let slowest = landed.iter().map(|(_, d)| *d).max().unwrap_or_default();
    (
        during,
        slowest,
        landed.into_iter().map(|(m, _)| m).collect(),
    )
}

fn p99(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get((v.len() * 99 / 100).min(v.len().saturating_sub(1)))
        .copied()
        .unwrap_or_default()
}

/// User plus system CPU seconds of a process so far.
#[allow(unsafe_code)] // sysconf; see the SAFETY note inside
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/PID/stat");
    // Fields after the command name (which may hold spaces) start at ')'.
    let rest = &stat[stat.rfind(')').expect("stat format") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().expect("utime") + f[12].parse::<f64>().expect("stime");
    // SAFETY: sysconf(_SC_CLK_TCK) reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    ticks / hz
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gets_stay_prompt_while_four_large_blobs_are_configured_and_nothing_leaks() {
    let (sim, dir, provider, mut c, ids) = idle_machines(5).await;
    let (probe, busy) = ids.split_first().expect("machines");
    let big = blob(1 << 20, true);
    let (during, _, landed) = configure_all(&mut c, busy, probe, &big).await;
    assert!(!during.is_empty());
    // Before one Redactor per Configure, built off the async workers, Gets
    // waited behind the matcher builds for over a second.
    let worst = during.iter().max().copied().unwrap_or_default();
    assert!(
        worst < Duration::from_millis(750),
        "a Get took {worst:?} while the blobs were configured ({} Gets)",
        during.len()
    );
    for m in &landed {
        assert_eq!(
            m.state,
            MachineState::Failed as i32,
            "the hook exits 3: {m:?}"
        );
        assert!(m.last_error.contains("exited 3"), "{}", m.last_error);
        assert!(m.last_error.contains("[redacted]"), "{}", m.last_error);
        assert!(!m.last_error.contains(MARK), "{}", m.last_error);
    }
    // A 64 KiB blob and a 1-byte one through the same path.
    let (small, _, landed) = configure_all(
        &mut c,
        std::slice::from_ref(probe),
        busy[0].as_str(),
        &blob(64 << 10, true),
    )
    .await;
    assert!(!small.is_empty());
    assert!(
        !landed[0].last_error.contains(MARK),
        "{}",
        landed[0].last_error
    );
    drop(c);
    drop(
        provider
            .logs
            .wait_for(Duration::from_secs(5), |l| l.contains("exited 3")),
    );
    let text = provider.stderr();
    drop(provider);
    assert!(!text.contains(MARK), "the log leaks a secret");
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let path = entry.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        assert!(
            !bytes.windows(MARK.len()).any(|w| w == MARK.as_bytes()),
            "{} holds a secret",
            path.display()
        );
    }
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_byte_blob_and_a_64_kib_blob_configure() {
    let (sim, _dir, provider, mut c, ids) = idle_machines(2).await;
    for (id, size) in ids.iter().zip([1usize, 64 << 10]) {
        // `:` is the shell's no-op: a whole script of one byte.
        let b = if size == 1 {
            b":".to_vec()
        } else {
            blob(size, false)
        };
        let (_, _, landed) = configure_all(&mut c, std::slice::from_ref(id), id, &b).await;
        assert_eq!(
            landed[0].state,
            MachineState::Configured as i32,
            "{size} bytes: {}",
            landed[0].last_error
        );
    }
    drop(provider);
    sim.shutdown().await;
}

/// `make bench-configure`: figures for BENCHMARKS.md.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run with make bench-configure"]
async fn bench_configure() {
    let rounds: [(usize, usize); 4] = [(64 << 10, 1), (64 << 10, 4), (1 << 20, 1), (1 << 20, 4)];
    let machines = 1 + rounds.iter().map(|(_, n)| n).sum::<usize>();
    let (sim, _dir, provider, mut c, ids) = idle_machines(machines).await;
    let (probe, mut free) = ids.split_first().expect("machines");
    let mut rest = Vec::new();
    for _ in 0..2000 {
        rest.push(get(&mut c, probe).await.1);
    }
    let at_rest = p99(rest);
    for (size, n) in rounds {
        let (these, others) = free.split_at(n);
        free = others;
        let cpu = cpu_seconds(provider.pid());
        let (during, slowest, landed) =
            configure_all(&mut c, these, probe, &blob(size, false)).await;
        let cpu = cpu_seconds(provider.pid()) - cpu;
        for m in &landed {
            assert_eq!(m.state, MachineState::Configured as i32, "{}", m.last_error);
        }
        println!(
            "configure_blob_bytes={size} parallel={n} slowest_ms={} provider_cpu_s={cpu:.2} get_p99_during_ms={:.2} get_p99_rest_ms={:.2} gets_during={}",
            slowest.as_millis(),
            p99(during.clone()).as_secs_f64() * 1000.0,
            at_rest.as_secs_f64() * 1000.0,
            during.len()
        );
    }
    drop(provider);
    sim.shutdown().await;
}
