//! The measured scenarios. Each one prints its figures through `Report`.
//!
//! One file past 600 lines on purpose: the scenarios share their setup and
//! their figures' shape, and BENCHMARKS.md cites them in this order.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use bigfleet_proto::v1alpha1::capacity_provider_client::CapacityProviderClient;
use bigfleet_proto::v1alpha1::{
    ConfigureRequest, CreateRequest, DeleteRequest, DrainRequest, ListFilter, Machine, MachineList,
    MachineRef, MachineState,
};
use prost::Message;
use tonic::transport::{Channel, Endpoint};

use crate::provider::Provider;
use crate::stats::{ms, us, Samples};
use crate::Report;

type Client = CapacityProviderClient<Channel>;

/// Connections the open-loop Get run spreads its requests over.
const GET_CONNECTIONS: usize = 4;
/// Creates in the batch that precedes the delta-List measurement.
const DELTA_BATCH: usize = 100;
/// Create-ack runs: (concurrent callers, connections they share).
const CREATE_LEVELS: [(usize, usize); 4] = [(1, 1), (8, 8), (64, 64), (64, 4)];
/// Poll period while waiting for a background transition to land.
const POLL: Duration = Duration::from_millis(1);
/// How long any single transition may take before the run is declared broken.
const TRANSITION_TIMEOUT: Duration = Duration::from_secs(30);
const SHARD: &str = "loadgen";

/// The scenarios `--only` can pick.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    List,
    Get,
    Delta,
    Create,
    Lifecycle,
    /// Full Lists that the client never reads (its own provider boot).
    UnreadList,
    /// Durable Create acks with the state in SQLite, then in PostgreSQL;
    /// takeover between two replicas on a PostgreSQL state; peak RSS with
    /// PostgreSQL. Needs `--state-url` and runs only when named.
    Postgres,
    /// The scaling guard: the Create rate (in memory and in SQLite) and
    /// Get p99 at the smallest and the largest of `--sizes`, compared as
    /// ratios; loadgen fails when one is under its floor. Runs only when
    /// named.
    Scaling,
    /// Callers that declare large requests and never finish sending them:
    /// the provider's RSS growth and Get p99 meanwhile, against limits.
    /// Runs only when named.
    HalfSent,
}

pub struct Profile {
    /// Scenarios to run; empty runs them all.
    pub only: Vec<Scenario>,
    /// CPU the provider is pinned to (`--pin`).
    pub provider_cpu: Option<usize>,
    get_duration: Duration,
    list_runs: usize,
    pub(crate) create_cap_per_level: usize,
    lifecycle_machines: usize,
    lifecycle_cycles: usize,
    /// Leader kills in the takeover run (the PostgreSQL scenario).
    pub(crate) takeover_rounds: usize,
}

impl Profile {
    pub fn runs(&self, scenario: Scenario) -> bool {
        // The PostgreSQL scenario needs a server, the scaling guard boots
        // providers of its own: only when asked for.
        if matches!(
            scenario,
            Scenario::Postgres | Scenario::Scaling | Scenario::HalfSent
        ) {
            return self.only.contains(&scenario);
        }
        self.only.is_empty() || self.only.contains(&scenario)
    }

    /// Whether only scenarios that boot their own providers were asked for
    /// (the PostgreSQL one, the scaling guard): the in-memory boots and the
    /// SQLite restart are then skipped.
    pub fn only_own_boots(&self) -> bool {
        !self.only.is_empty()
            && self.only.iter().all(|s| {
                matches!(
                    s,
                    Scenario::Postgres | Scenario::Scaling | Scenario::HalfSent
                )
            })
    }

    pub fn full() -> Profile {
        Profile {
            only: Vec::new(),
            provider_cpu: None,
            get_duration: Duration::from_secs(3),
            list_runs: 5,
            create_cap_per_level: 4000,
            lifecycle_machines: 32,
            lifecycle_cycles: 3,
            takeover_rounds: 3,
        }
    }

    pub fn quick() -> Profile {
        Profile {
            only: Vec::new(),
            provider_cpu: None,
            get_duration: Duration::from_secs(1),
            list_runs: 3,
            create_cap_per_level: 500,
            lifecycle_machines: 16,
            lifecycle_cycles: 2,
            takeover_rounds: 1,
        }
    }
}

pub struct Bench<'a> {
    pub(crate) endpoint: Endpoint,
    pub(crate) client: Client,
    profile: &'a Profile,
    /// The provider's pid when it runs here: its CPU time per operation is
    /// reported, which the shared CPU does not distort the way wall time is.
    provider_pid: Option<u32>,
    /// Fencing epoch for this run: the start time, so a rerun against the
    /// same endpoint is always strictly newer than the previous run's marks.
    pub(crate) epoch: i64,
}

async fn dial(endpoint: &Endpoint) -> Result<Client> {
    let channel = endpoint
        .connect()
        .await
        .with_context(|| format!("connecting to {}", endpoint.uri()))?;
    // A 100k-machine List is far beyond tonic's 4 MiB default.
    Ok(CapacityProviderClient::new(channel).max_decoding_message_size(usize::MAX))
}

fn token_epoch() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(1)
        .max(1)
}

pub(crate) fn full_filter() -> ListFilter {
    ListFilter::default()
}

impl<'a> Bench<'a> {
    pub async fn connect(
        addr: &str,
        profile: &'a Profile,
        provider_pid: Option<u32>,
    ) -> Result<Bench<'a>> {
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .with_context(|| format!("bad target address {addr:?}"))?
            .tcp_nodelay(true);
        let client = dial(&endpoint).await?;
        Ok(Bench {
            endpoint,
            client,
            profile,
            provider_pid,
            epoch: token_epoch(),
        })
    }

    /// The machines in `state`, with the current cursor.
    pub(crate) async fn list_in(&self, state: MachineState) -> Result<MachineList> {
        Ok(self
            .client
            .clone()
            .list(ListFilter {
                states: vec![state as i32],
                ..Default::default()
            })
            .await
            .with_context(|| format!("List of {state:?} machines"))?
            .into_inner())
    }

    /// Ids of every SPECULATIVE machine (the ones mutating runs may use).
    pub async fn inventory(&self) -> Result<Vec<String>> {
        let list = self.list_in(MachineState::Speculative).await?;
        Ok(list.machines.into_iter().map(|m| m.id).collect())
    }

    pub async fn run_all(&self, size: usize, report: &mut Report, get_rps: u32) -> Result<()> {
        let mut ids = self.inventory().await?;
        if ids.is_empty() {
            bail!("the provider has no SPECULATIVE machines to exercise");
        }
        let revision = if self.profile.runs(Scenario::List) {
            self.full_list(size, report).await?
        } else {
            // The current cursor, without paying for a full List.
            self.list_in(MachineState::Deleting).await?.revision
        };
        if self.profile.runs(Scenario::Get) {
            self.open_loop_get(size, &ids, get_rps, report).await?;
        }

        // Split the speculative pool so no machine is used by two runs.
        let life_n = self.profile.lifecycle_machines.min(ids.len() / 4).max(1);
        let life_ids: Vec<String> = ids.split_off(ids.len() - life_n);
        let delta_n = DELTA_BATCH.min(ids.len() / 4);
        let delta_ids: Vec<String> = ids.split_off(ids.len() - delta_n);
        if self.profile.runs(Scenario::Delta) {
            self.delta_list(size, revision, delta_ids, report).await?;
        }
        let per_level = self
            .profile
            .create_cap_per_level
            .min(ids.len() / CREATE_LEVELS.len());
        if self.profile.runs(Scenario::Create) {
            for (level, conns) in CREATE_LEVELS {
                let batch: Vec<String> = ids.split_off(ids.len() - per_level);
                self.create_acks(size, level, conns, batch, report).await?;
            }
        }
        if self.profile.runs(Scenario::Lifecycle) {
            self.lifecycle(size, life_ids, report).await?;
        }
        Ok(())
    }

    /// Full List wall time and size, and the cost of just encoding it.
    async fn full_list(&self, size: usize, report: &mut Report) -> Result<Vec<u8>> {
        let mut wall = Samples::default();
        let mut encode = Samples::default();
        let mut decode = Samples::default();
        let mut last = MachineList::default();
        for _ in 0..self.profile.list_runs {
            let t = Instant::now();
            last = self
                .client
                .clone()
                .list(full_filter())
                .await
                .context("full List")?
                .into_inner();
            wall.push(t.elapsed());
            let t = Instant::now();
            let bytes = last.encode_to_vec();
            encode.push(t.elapsed());
            let t = Instant::now();
            let back = MachineList::decode(bytes.as_slice()).context("re-decoding List")?;
            decode.push(t.elapsed());
            std::hint::black_box(back);
        }
        let (w, e) = (wall.percentile(50.0), encode.percentile(50.0));
        report.line(format!(
            "list_full_ms_p50={} list_bytes={} list_machines={} encode_only_ms_p50={} decode_only_ms_p50={} list_over_encode={:.1} runs={} size={size}",
            ms(w),
            last.encoded_len(),
            last.machines.len(),
            ms(e),
            ms(decode.percentile(50.0)),
            w.as_secs_f64() / e.as_secs_f64().max(1e-9),
            self.profile.list_runs,
        ));
        Ok(last.revision)
    }

    /// Open loop: request i is due at start + i/rps regardless of how earlier
    /// ones fared; latency counts from the due time, so a stalled server is
    /// charged for the queue it builds (no coordinated omission).
    /// Returns the p99 from the due times.
    pub(crate) async fn open_loop_get(
        &self,
        size: usize,
        ids: &[String],
        rps: u32,
        report: &mut Report,
    ) -> Result<Duration> {
        let cpu = CpuSpan::start(self.provider_pid);
        let mut clients = Vec::with_capacity(GET_CONNECTIONS);
        for _ in 0..GET_CONNECTIONS {
            clients.push(dial(&self.endpoint).await?);
        }
        let total = (self.profile.get_duration.as_secs_f64() * f64::from(rps)) as usize;
        let interval = Duration::from_secs_f64(1.0 / f64::from(rps));
        let ids: Arc<Vec<String>> = Arc::new(ids.to_vec());
        let handle = tokio::runtime::Handle::current();
        // The schedule runs on its own thread: std sleeps are ~50 us precise,
        // tokio timers only 1 ms, which would swamp a sub-ms latency target.
        let scheduler = tokio::task::spawn_blocking(move || {
            let start = Instant::now() + Duration::from_millis(5);
            let mut tasks = Vec::with_capacity(total);
            let mut rng: u64 = 0x9E37_79B9_7F4A_7C15;
            for i in 0..total {
                let due = start + interval * i as u32;
                let now = Instant::now();
                if due > now {
                    std::thread::sleep(due - now);
                }
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let id = ids[(rng % ids.len() as u64) as usize].clone();
                let mut client = clients[i % clients.len()].clone();
                tasks.push(handle.spawn(async move {
                    let sent = Instant::now();
                    let res = client.get(MachineRef { id }).await;
                    let done = Instant::now();
                    (res.is_ok(), done - due, done - sent, sent - due)
                }));
            }
            tasks
        });
        let started = Instant::now();
        let tasks = scheduler.await.context("Get scheduler thread")?;
        let mut from_due = Samples::with_capacity(total);
        let mut service = Samples::with_capacity(total);
        let mut send_lag = Samples::with_capacity(total);
        let mut errors = 0usize;
        for t in tasks {
            let (ok, d, s, lag) = t.await.context("Get task")?;
            if ok {
                from_due.push(d);
                service.push(s);
                send_lag.push(lag);
            } else {
                errors += 1;
            }
        }
        let achieved = from_due.len() as f64 / started.elapsed().as_secs_f64();
        let cpu = cpu.us_per_op(total);
        let p99 = from_due.percentile(99.0);
        report.line(format!(
            "get_p50_us={} get_p99_us={} get_max_us={} get_service_p99_us={} client_send_lag_p99_us={} server_cpu_us_per_get={cpu} offered_rps={rps} achieved_rps={achieved:.0} errors={errors} conns={GET_CONNECTIONS} size={size}",
            us(from_due.percentile(50.0)),
            us(p99),
            us(from_due.percentile(100.0)),
            us(service.percentile(99.0)),
            us(send_lag.percentile(99.0)),
        ));
        if errors > 0 {
            bail!("{errors} of {total} Gets failed");
        }
        Ok(p99)
    }

    /// Cost of a delta List (since the pre-batch revision) after 100 Creates
    /// have landed in IDLE.
    async fn delta_list(
        &self,
        size: usize,
        revision: Vec<u8>,
        ids: Vec<String>,
        report: &mut Report,
    ) -> Result<()> {
        let n = ids.len();
        let ids = Arc::new(ids);
        run_concurrently(
            &self.endpoint,
            8,
            8,
            None,
            ids.clone(),
            self.epoch,
            |mut c, id, epoch| async move { c.create(create_req(&id, epoch, 1)).await.map(|_| ()) },
        )
        .await?;
        for id in ids.iter() {
            wait_state(&mut self.client.clone(), id, MachineState::Idle).await?;
        }
        let mut wall = Samples::default();
        let mut last = MachineList::default();
        for _ in 0..self.profile.list_runs {
            let t = Instant::now();
            last = self
                .client
                .clone()
                .list(ListFilter {
                    since_revision: revision.clone(),
                    ..Default::default()
                })
                .await
                .context("delta List")?
                .into_inner();
            wall.push(t.elapsed());
        }
        report.line(format!(
            "delta_list_ms_p50={} delta_machines={} delta_bytes={} mutations={n} size={size}",
            ms(wall.percentile(50.0)),
            last.machines.len(),
            last.encoded_len(),
        ));
        Ok(())
    }

    /// Create-ack throughput and latency with `level` concurrent clients,
    /// each on its own connection, each Create on a distinct machine.
    async fn create_acks(
        &self,
        size: usize,
        level: usize,
        conns: usize,
        ids: Vec<String>,
        report: &mut Report,
    ) -> Result<()> {
        let n = ids.len();
        let (mut lat, wall, cpu) = run_concurrently(
            &self.endpoint,
            level,
            conns,
            self.provider_pid,
            Arc::new(ids),
            self.epoch,
            |mut c, id, epoch| async move { c.create(create_req(&id, epoch, 1)).await.map(|_| ()) },
        )
        .await?;
        let cpu = cpu.us_per_op(n);
        report.line(format!(
            "create_acks_per_s={:.0} create_p50_us={} create_p99_us={} server_cpu_us_per_create={cpu} clients={level} conns={conns} creates={n} size={size}",
            n as f64 / wall.as_secs_f64(),
            us(lat.percentile(50.0)),
            us(lat.percentile(99.0)),
        ));
        Ok(())
    }

    /// Whole cycles (Create -> Idle -> Configure -> Configured -> Drain ->
    /// Idle -> Delete -> Speculative), one task per machine, all concurrent.
    async fn lifecycle(&self, size: usize, ids: Vec<String>, report: &mut Report) -> Result<()> {
        let cycles = self.profile.lifecycle_cycles;
        let k = ids.len();
        let t = Instant::now();
        let mut tasks = Vec::with_capacity(k);
        for id in ids {
            let mut c = dial(&self.endpoint).await?;
            let epoch = self.epoch;
            tasks.push(tokio::spawn(async move {
                let mut seq = 0i64;
                let mut next = || {
                    seq += 1;
                    seq
                };
                for _ in 0..cycles {
                    c.create(create_req(&id, epoch, next())).await?;
                    wait_state(&mut c, &id, MachineState::Idle).await?;
                    c.configure(ConfigureRequest {
                        machine_id: id.clone(),
                        cluster_id: "loadgen-cluster".into(),
                        bootstrap_blob: b"loadgen".to_vec(),
                        shard_id: SHARD.into(),
                        shard_epoch: epoch,
                        sequence_number: next(),
                        shard_metadata: Default::default(),
                    })
                    .await?;
                    wait_state(&mut c, &id, MachineState::Configured).await?;
                    c.drain(DrainRequest {
                        machine_id: id.clone(),
                        grace_period_seconds: 0,
                        shard_id: SHARD.into(),
                        shard_epoch: epoch,
                        sequence_number: next(),
                    })
                    .await?;
                    wait_state(&mut c, &id, MachineState::Idle).await?;
                    c.delete(delete_req(&id, epoch, next())).await?;
                    wait_state(&mut c, &id, MachineState::Speculative).await?;
                }
                anyhow::Ok(())
            }));
        }
        for task in tasks {
            task.await.context("lifecycle task")??;
        }
        let wall = t.elapsed();
        let total = k * cycles;
        report.line(format!(
            "lifecycles_per_s={:.1} lifecycle_ms_avg={} machines={k} cycles_each={cycles} poll_ms={} size={size}",
            total as f64 / wall.as_secs_f64(),
            ms(wall / cycles as u32),
            POLL.as_millis(),
        ));
        Ok(())
    }
}

pub(crate) fn delete_req(id: &str, epoch: i64, seq: i64) -> DeleteRequest {
    DeleteRequest {
        machine_id: id.to_string(),
        shard_id: SHARD.into(),
        shard_epoch: epoch,
        sequence_number: seq,
    }
}

pub(crate) fn create_req(id: &str, epoch: i64, seq: i64) -> CreateRequest {
    CreateRequest {
        machine_id: id.to_string(),
        shard_id: SHARD.into(),
        shard_epoch: epoch,
        sequence_number: seq,
    }
}

/// Runs `op` once per id with `level` workers spread over `conns`
/// connections; returns per-call latencies, the wall time (connections are
/// made before the clock starts) and the span over which `pid`'s CPU time is
/// measured. Any failed call fails the run.
pub(crate) async fn run_concurrently<F, Fut>(
    endpoint: &Endpoint,
    level: usize,
    conns: usize,
    pid: Option<u32>,
    ids: Arc<Vec<String>>,
    epoch: i64,
    op: F,
) -> Result<(Samples, Duration, CpuSpan)>
where
    F: Fn(Client, String, i64) -> Fut + Send + Sync + Clone + 'static,
    Fut: std::future::Future<Output = Result<(), tonic::Status>> + Send,
{
    let next = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::with_capacity(level);
    let mut channels = Vec::with_capacity(conns.max(1));
    for _ in 0..conns.max(1) {
        channels.push(dial(endpoint).await?);
    }
    let clients: Vec<Client> = (0..level)
        .map(|i| channels[i % channels.len()].clone())
        .collect();
    let cpu = CpuSpan::start(pid);
    let started = Instant::now();
    for client in clients {
        let (next, ids, op) = (next.clone(), ids.clone(), op.clone());
        workers.push(tokio::spawn(async move {
            let mut lat = Samples::default();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(id) = ids.get(i) else { break };
                let t = Instant::now();
                op(client.clone(), id.clone(), epoch)
                    .await
                    .map_err(|s| anyhow!("call for {id}: {s}"))?;
                lat.push(t.elapsed());
            }
            anyhow::Ok(lat)
        }));
    }
    let mut all = Samples::with_capacity(ids.len());
    for w in workers {
        all.extend(w.await.context("worker task")??);
    }
    let wall = started.elapsed();
    Ok((all, wall, cpu))
}

/// The CPU time a provider process spends from `start` on.
pub(crate) struct CpuSpan {
    pid: Option<u32>,
    before: Option<Duration>,
}

impl CpuSpan {
    fn start(pid: Option<u32>) -> CpuSpan {
        CpuSpan {
            pid,
            before: pid.and_then(process_cpu),
        }
    }

    /// Microseconds per operation so far, or `skipped` when the process is
    /// not one this run started (or `ops` is zero).
    pub(crate) fn us_per_op(&self, ops: usize) -> String {
        match (self.before, self.pid.and_then(process_cpu)) {
            (Some(before), Some(after)) if ops > 0 => format!(
                "{:.0}",
                after.saturating_sub(before).as_secs_f64() * 1e6 / ops as f64
            ),
            _ => "skipped".to_string(),
        }
    }
}

/// User + system CPU time of a process so far, from /proc (USER_HZ = 100
/// ticks per second on Linux, so a 10 ms resolution).
fn process_cpu(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name, which may hold spaces.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(Duration::from_millis((utime + stime) * 10))
}

/// Polls Get until `id` reaches `want`; FAILED or a timeout is an error.
async fn wait_state(client: &mut Client, id: &str, want: MachineState) -> Result<Machine> {
    let deadline = Instant::now() + TRANSITION_TIMEOUT;
    loop {
        let m = client
            .get(MachineRef { id: id.to_string() })
            .await
            .with_context(|| format!("Get {id}"))?
            .into_inner();
        if m.state == want as i32 {
            return Ok(m);
        }
        if m.state == MachineState::Failed as i32 {
            bail!("{id} went FAILED: {}", m.last_error);
        }
        if Instant::now() > deadline {
            bail!(
                "{id} not {want:?} after {TRANSITION_TIMEOUT:?} (state {})",
                m.state
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Boot with a durable state file, mutate, SIGKILL, and time the restart.
pub async fn restart_with_state(
    bin: &Path,
    size: usize,
    boot_timeout: Duration,
    profile: &Profile,
    report: &mut Report,
) -> Result<()> {
    let dir = tempfile::tempdir().context("creating a temp dir for --state")?;
    let state = dir.path().join("state.db");
    let first = Provider::spawn(bin, size, Some(&state), boot_timeout, profile.provider_cpu)
        .await
        .context("first boot with --state")?;
    report.line(format!(
        "startup_ms={} size={size} state=sqlite first_boot=true",
        ms(first.startup)
    ));
    let mutated = {
        let bench = Bench::connect(&first.addr, profile, first.pid()).await?;
        let mut ids = bench.inventory().await?;
        ids.truncate(200);
        let n = ids.len();
        run_concurrently(
            &bench.endpoint,
            8,
            8,
            None,
            Arc::new(ids.clone()),
            bench.epoch,
            |mut c, id, e| async move { c.create(create_req(&id, e, 1)).await.map(|_| ()) },
        )
        .await?;
        for id in &ids {
            wait_state(&mut bench.client.clone(), id, MachineState::Idle).await?;
        }
        n
    };
    first.kill().await?;
    let second = Provider::spawn(bin, size, Some(&state), boot_timeout, profile.provider_cpu)
        .await
        .context("restart with --state")?;
    let bench = Bench::connect(&second.addr, profile, second.pid()).await?;
    let list = bench
        .client
        .clone()
        .list(full_filter())
        .await
        .context("List after restart")?
        .into_inner();
    // Only the mutated machines should have left SPECULATIVE; name the rest.
    let mut by_state = std::collections::BTreeMap::<String, usize>::new();
    for m in &list.machines {
        let name = MachineState::try_from(m.state)
            .map(|s| format!("{s:?}"))
            .unwrap_or_else(|_| m.state.to_string());
        *by_state.entry(name).or_default() += 1;
    }
    let states: Vec<String> = by_state.iter().map(|(k, v)| format!("{k}:{v}")).collect();
    report.line(format!(
        "restart_state_ms={} size={size} mutated={mutated} machines_after={} states_after={}",
        ms(second.startup),
        list.machines.len(),
        states.join(","),
    ));
    let rss = second.memory_kib().ok();
    drop(bench);
    second.kill().await?;
    if let Some((hwm, _)) = rss {
        report.line(format!(
            "rss_peak_mib={:.1} size={size} state=sqlite after_restart=true",
            hwm as f64 / 1024.0
        ));
    }
    Ok(())
}
