//! The black-box harness: everything a behavior test needs to talk to an endpoint using only
//! the six wire RPCs.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context as _};
use bigfleet_proto::v1alpha1::capacity_provider_client::CapacityProviderClient;
use bigfleet_proto::v1alpha1::{
    ConfigureRequest, CreateRequest, DeleteRequest, DrainRequest, ListFilter, Machine, MachineList,
    MachineRef, MachineState, TransitionAck,
};
use futures::future::join_all;
use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::SeedableRng;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Code, Status};

pub type Client = CapacityProviderClient<Channel>;
pub type RpcResult<T> = Result<T, Status>;

/// What a passing test reports; failures are `Err`.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Pass,
    /// Passed, with a note (e.g. a sub-assertion outside the claimed profiles skipped-as-pass).
    PassWith(String),
    /// Not applicable to this endpoint (skip-as-pass), with the reason.
    Skip(String),
}

pub type TestResult = anyhow::Result<Outcome>;

/// TLS material for dialing; all paths are PEM files.
#[derive(Debug, Clone, Default)]
pub struct TlsOpts {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub domain: Option<String>,
}

impl TlsOpts {
    fn client_config(&self) -> anyhow::Result<ClientTlsConfig> {
        let mut cfg = ClientTlsConfig::new();
        if let Some(ca) = &self.ca {
            let pem =
                std::fs::read(ca).with_context(|| format!("reading --tls-ca {}", ca.display()))?;
            cfg = cfg.ca_certificate(Certificate::from_pem(pem));
        }
        match (&self.cert, &self.key) {
            (Some(c), Some(k)) => {
                let cert = std::fs::read(c)
                    .with_context(|| format!("reading --tls-cert {}", c.display()))?;
                let key = std::fs::read(k)
                    .with_context(|| format!("reading --tls-key {}", k.display()))?;
                cfg = cfg.identity(Identity::from_pem(cert, key));
            }
            (None, None) => {}
            _ => bail!("--tls-cert and --tls-key must be given together"),
        }
        if let Some(d) = &self.domain {
            cfg = cfg.domain_name(d.clone());
        }
        Ok(cfg)
    }
}

/// Dials `addr` (host:port) over a fresh connection: plaintext when `tls` is None, TLS or mTLS otherwise.
pub async fn dial(addr: &str, tls: Option<&TlsOpts>) -> anyhow::Result<Client> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut ep = Endpoint::from_shared(format!("{scheme}://{addr}"))
        .with_context(|| format!("invalid target address {addr:?}"))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(60));
    if let Some(t) = tls {
        ep = ep
            .tls_config(t.client_config()?)
            .context("applying TLS config")?;
    }
    let ch = ep
        .connect()
        .await
        .with_context(|| format!("dialing {addr}"))?;
    Ok(CapacityProviderClient::new(ch)
        .max_decoding_message_size(512 * 1024 * 1024)
        .max_encoding_message_size(64 * 1024 * 1024))
}

/// Probed endpoint capabilities.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Capabilities {
    pub delete: bool,
    pub since_revision: bool,
    pub fleet_size: usize,
}

impl Capabilities {
    pub fn has(&self, gate: &str) -> bool {
        match gate {
            "Delete" => self.delete,
            "SinceRevision" => self.since_revision,
            _ => false,
        }
    }
}

/// Probes Delete (NOT_FOUND on an unknown id = supported, UNIMPLEMENTED = not) and the revision
/// cursor (a non-empty revision whose immediate delta is smaller than the full list).
pub async fn probe(client: &Client) -> anyhow::Result<Capabilities> {
    let mut c = client.clone();
    let delete = match c
        .delete(DeleteRequest {
            machine_id: "bfconf-probe-unknown-machine".into(),
            ..Default::default()
        })
        .await
    {
        Err(s) if s.code() == Code::Unimplemented => false,
        Err(s) if s.code() == Code::NotFound => true,
        Err(s) => bail!(
            "capability probe: Delete of an unknown id returned {:?}: {}",
            s.code(),
            s.message()
        ),
        Ok(_) => bail!("capability probe: Delete of an unknown id succeeded"),
    };
    let full = c
        .list(ListFilter::default())
        .await
        .context("capability probe: List")?
        .into_inner();
    let since_revision = if full.revision.is_empty() {
        false
    } else {
        let delta = c
            .list(ListFilter {
                since_revision: full.revision.clone(),
                ..Default::default()
            })
            .await
            .context("capability probe: delta List")?
            .into_inner();
        full.machines.is_empty() || delta.machines.len() < full.machines.len()
    };
    Ok(Capabilities {
        delete,
        since_revision,
        fleet_size: full.machines.len(),
    })
}

/// A fencing token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token {
    pub shard: String,
    pub epoch: i64,
    pub seq: i64,
}

impl Token {
    /// The absent token (bypasses fencing).
    pub fn none() -> Token {
        Token {
            shard: String::new(),
            epoch: 0,
            seq: 0,
        }
    }
    pub fn new(shard: &str, epoch: i64, seq: i64) -> Token {
        Token {
            shard: shard.to_string(),
            epoch,
            seq,
        }
    }
}

/// Mints monotonic tokens for one shard: (epoch, 1), (epoch, 2), ...; `new_epoch` resets the sequence.
#[derive(Debug, Clone)]
pub struct ShardSession {
    pub shard: String,
    pub epoch: i64,
    pub seq: i64,
}

impl ShardSession {
    pub fn new(shard: String) -> Self {
        ShardSession {
            shard,
            epoch: 1,
            seq: 0,
        }
    }
    pub fn mint(&mut self) -> Token {
        self.seq += 1;
        Token::new(&self.shard, self.epoch, self.seq)
    }
    /// The most recently minted token (a replay of it is stale).
    pub fn last(&self) -> Token {
        Token::new(&self.shard, self.epoch, self.seq)
    }
    pub fn new_epoch(&mut self) {
        self.epoch += 1;
        self.seq = 0;
    }
}

pub fn create_req(id: &str, t: &Token) -> CreateRequest {
    CreateRequest {
        machine_id: id.into(),
        shard_id: t.shard.clone(),
        shard_epoch: t.epoch,
        sequence_number: t.seq,
    }
}

pub fn configure_req(
    id: &str,
    cluster: &str,
    meta: &HashMap<String, String>,
    t: &Token,
) -> ConfigureRequest {
    ConfigureRequest {
        machine_id: id.into(),
        cluster_id: cluster.into(),
        bootstrap_blob: b"#bfconf bootstrap\n".to_vec(),
        shard_id: t.shard.clone(),
        shard_epoch: t.epoch,
        sequence_number: t.seq,
        shard_metadata: meta.clone(),
    }
}

pub fn drain_req(id: &str, grace: i64, t: &Token) -> DrainRequest {
    DrainRequest {
        machine_id: id.into(),
        grace_period_seconds: grace,
        shard_id: t.shard.clone(),
        shard_epoch: t.epoch,
        sequence_number: t.seq,
    }
}

pub fn delete_req(id: &str, t: &Token) -> DeleteRequest {
    DeleteRequest {
        machine_id: id.into(),
        shard_id: t.shard.clone(),
        shard_epoch: t.epoch,
        sequence_number: t.seq,
    }
}

pub fn is_transitional(s: MachineState) -> bool {
    matches!(
        s,
        MachineState::Creating
            | MachineState::Configuring
            | MachineState::Draining
            | MachineState::Deleting
    )
}

pub fn is_stable(s: MachineState) -> bool {
    matches!(
        s,
        MachineState::Speculative | MachineState::Idle | MachineState::Configured
    )
}

/// The de-duplicated observations of one machine: a snapshot is kept only when it differs from
/// the previous one.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    pub snapshots: Vec<Machine>,
}

impl Trace {
    pub fn push(&mut self, m: Machine) {
        if self.snapshots.last() != Some(&m) {
            self.snapshots.push(m);
        }
    }
    /// De-duplicated state sequence.
    pub fn states(&self) -> Vec<MachineState> {
        let mut out: Vec<MachineState> = Vec::new();
        for m in &self.snapshots {
            let s = m.state();
            if out.last() != Some(&s) {
                out.push(s);
            }
        }
        out
    }
    pub fn last(&self) -> Option<&Machine> {
        self.snapshots.last()
    }
    pub fn extend(&mut self, other: Trace) {
        for m in other.snapshots {
            self.push(m);
        }
    }
}

pub fn fmt_states(s: &[MachineState]) -> String {
    s.iter()
        .map(|x| x.as_str_name().trim_start_matches("MACHINE_STATE_"))
        .collect::<Vec<_>>()
        .join("→")
}

/// Per-transition settle budgets (the baseline's timing assumptions).
#[derive(Debug, Clone)]
pub struct Timing {
    pub create: Duration,
    pub configure: Duration,
    pub drain: Duration,
    pub delete: Duration,
    /// Window over which "nothing changes" is asserted.
    pub stability: Duration,
    pub poll: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            create: Duration::from_secs(10),
            configure: Duration::from_secs(10),
            drain: Duration::from_secs(30),
            delete: Duration::from_secs(10),
            stability: Duration::from_millis(600),
            poll: Duration::from_millis(5),
        }
    }
}

/// Which way an RPC is expected to end, for code assertions.
pub fn code_of<T>(r: &RpcResult<T>) -> Option<Code> {
    r.as_ref().err().map(|s| s.code())
}

pub fn describe<T>(r: &RpcResult<T>) -> String {
    match r {
        Ok(_) => "OK".into(),
        Err(s) => format!("{:?}: {}", s.code(), s.message()),
    }
}

/// Requires an error whose code is in `allowed`.
pub fn expect_code<T>(r: &RpcResult<T>, allowed: &[Code], what: &str) -> anyhow::Result<()> {
    match r {
        Err(s) if allowed.contains(&s.code()) => Ok(()),
        other => Err(anyhow!(
            "{what}: expected one of {allowed:?}, got {}",
            describe(other)
        )),
    }
}

/// Requires a rejection that is not FAILED_PRECONDITION (reserved for fencing).
pub fn expect_rejected_not_fp<T>(r: &RpcResult<T>, what: &str) -> anyhow::Result<()> {
    match r {
        Ok(_) => bail!("{what}: expected a rejection, got OK"),
        Err(s) if s.code() == Code::FailedPrecondition => {
            bail!(
                "{what}: rejected with FAILED_PRECONDITION (reserved for fencing): {}",
                s.message()
            )
        }
        Err(_) => Ok(()),
    }
}

pub fn expect_fp<T>(r: &RpcResult<T>, what: &str) -> anyhow::Result<()> {
    expect_code(r, &[Code::FailedPrecondition], what)
}

pub fn expect_ok<T>(r: RpcResult<T>, what: &str) -> anyhow::Result<T> {
    r.map_err(|s| anyhow!("{what}: expected OK, got {:?}: {}", s.code(), s.message()))
}

/// Shared context for endpoint tests: one target, shared claims, a seeded RNG source.
pub struct Ctx {
    pub addr: String,
    pub tls: Option<TlsOpts>,
    pub client: Client,
    pub caps: Capabilities,
    pub seed: u64,
    pub timing: Timing,
    pub profiles: Vec<String>,
    /// Run-unique tag for shard ids so reruns against a long-lived endpoint never collide.
    pub run_tag: String,
    /// Address of the fault-provider control endpoint, when running the fault lane.
    pub fault_control: Option<String>,
    claims: Mutex<HashSet<String>>,
    shard_counter: AtomicU64,
}

impl Ctx {
    pub fn new(
        addr: String,
        tls: Option<TlsOpts>,
        client: Client,
        caps: Capabilities,
        seed: u64,
    ) -> Ctx {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        Ctx {
            addr,
            tls,
            client,
            caps,
            seed,
            timing: Timing::default(),
            profiles: vec!["core".into(), "cloud".into()],
            run_tag: format!("{:x}", nanos & 0xffff_ffff),
            fault_control: None,
            claims: Mutex::new(HashSet::new()),
            shard_counter: AtomicU64::new(0),
        }
    }

    pub fn claims_profile(&self, p: &str) -> bool {
        self.profiles.iter().any(|x| x == p)
    }

    pub fn c(&self) -> Client {
        self.client.clone()
    }

    /// A fresh connection (distinct HTTP/2 connection) to the same target.
    pub async fn dial_fresh(&self) -> anyhow::Result<Client> {
        dial(&self.addr, self.tls.as_ref()).await
    }

    /// A replayable RNG for one test: derived from the run seed and the test id only.
    pub fn rng(&self, test_id: &str) -> StdRng {
        test_rng(self.seed, test_id)
    }

    /// A new fencing session on a run-unique shard id.
    pub fn session(&self, label: &str) -> ShardSession {
        let n = self.shard_counter.fetch_add(1, Ordering::Relaxed);
        ShardSession::new(format!("bfconf-{}-{label}-{n}", self.run_tag))
    }

    pub fn unknown_id(&self, label: &str) -> String {
        let n = self.shard_counter.fetch_add(1, Ordering::Relaxed);
        format!("bfconf-unknown/{}/{label}/{n}", self.run_tag)
    }

    /// Claims `n` SPECULATIVE machines no other test of this run has claimed.
    pub async fn fresh(&self, n: usize) -> anyhow::Result<Vec<String>> {
        let mut c = self.c();
        let claimed = self.claims.lock().len();
        for cap in [claimed + n + 64, 0] {
            let l = c
                .list(ListFilter {
                    states: vec![MachineState::Speculative as i32],
                    max_results: i32::try_from(cap).unwrap_or(0),
                    ..Default::default()
                })
                .await
                .context("List(states=[SPECULATIVE]) to pick fresh machines")?
                .into_inner();
            let mut claims = self.claims.lock();
            let free: Vec<String> = l
                .machines
                .iter()
                .filter(|m| m.state() == MachineState::Speculative && !claims.contains(&m.id))
                .map(|m| m.id.clone())
                .take(n)
                .collect();
            if free.len() == n {
                for id in &free {
                    claims.insert(id.clone());
                }
                return Ok(free);
            }
        }
        bail!("not enough unclaimed SPECULATIVE machines for {n} more (seed a larger fleet)")
    }

    /// Marks ids as claimed so `fresh` never hands them out.
    pub fn reserve(&self, ids: impl IntoIterator<Item = String>) {
        self.claims.lock().extend(ids);
    }

    /// One SPECULATIVE machine, picked the way the authoritative harness
    /// picks: `List(states=[SPECULATIVE], max_results=1)`, taking the machine
    /// returned. Machines other tests of this run hold are passed over (the
    /// upstream harness runs one test at a time). `earlier` are this test's
    /// own previous picks: getting one back means successive capped Lists
    /// return the same head, which fails (B302 picks several machines this
    /// way before mutating any of them).
    pub async fn pick_speculative(&self, earlier: &[String]) -> anyhow::Result<String> {
        let mut c = self.c();
        let mut passed_over = 0usize;
        loop {
            let l = c
                .list(ListFilter {
                    states: vec![MachineState::Speculative as i32],
                    max_results: 1,
                    ..Default::default()
                })
                .await
                .context("List(states=[SPECULATIVE], max_results=1) to pick a machine")?
                .into_inner();
            ensure!(
                l.machines.len() <= 1,
                "List(max_results=1) returned {} machines",
                l.machines.len()
            );
            let m = l.machines.into_iter().next().context(
                "List(states=[SPECULATIVE], max_results=1) returned no machine (seed a larger fleet)",
            )?;
            ensure!(
                m.state() == MachineState::Speculative,
                "List(states=[SPECULATIVE]) returned {} in {:?}",
                m.id,
                m.state()
            );
            if earlier.contains(&m.id) {
                bail!(
                    "successive List(states=[SPECULATIVE], max_results=1) calls returned {} again: \
                     a capped List without a cursor must rotate through (or sample) the matching \
                     set, or every caller picking machines this way gets the same one",
                    m.id
                );
            }
            let mut claims = self.claims.lock();
            if claims.insert(m.id.clone()) {
                return Ok(m.id);
            }
            passed_over += 1;
            if passed_over > claims.len() + 16 {
                bail!(
                    "{passed_over} successive List(states=[SPECULATIVE], max_results=1) calls \
                     returned only machines other tests hold (last {}): the capped List does not \
                     spread over the matching set",
                    m.id
                );
            }
        }
    }

    pub async fn fresh1(&self) -> anyhow::Result<String> {
        self.pick_speculative(&[]).await
    }

    pub async fn get(&self, id: &str) -> anyhow::Result<Machine> {
        Ok(self
            .c()
            .get(MachineRef { id: id.into() })
            .await
            .with_context(|| format!("Get({id})"))?
            .into_inner())
    }

    pub async fn list(
        &self,
        states: &[MachineState],
        max: i32,
        since: &[u8],
    ) -> anyhow::Result<MachineList> {
        Ok(self
            .c()
            .list(ListFilter {
                states: states.iter().map(|s| *s as i32).collect(),
                max_results: max,
                since_revision: since.to_vec(),
            })
            .await
            .context("List")?
            .into_inner())
    }

    pub async fn list_all(&self) -> anyhow::Result<MachineList> {
        self.list(&[], 0, &[]).await
    }

    pub async fn create(&self, id: &str, t: &Token) -> RpcResult<TransitionAck> {
        self.c()
            .create(create_req(id, t))
            .await
            .map(|r| r.into_inner())
    }

    pub async fn configure(
        &self,
        id: &str,
        cluster: &str,
        meta: &HashMap<String, String>,
        t: &Token,
    ) -> RpcResult<TransitionAck> {
        self.c()
            .configure(configure_req(id, cluster, meta, t))
            .await
            .map(|r| r.into_inner())
    }

    pub async fn drain(&self, id: &str, grace: i64, t: &Token) -> RpcResult<TransitionAck> {
        self.c()
            .drain(drain_req(id, grace, t))
            .await
            .map(|r| r.into_inner())
    }

    pub async fn delete(&self, id: &str, t: &Token) -> RpcResult<TransitionAck> {
        self.c()
            .delete(delete_req(id, t))
            .await
            .map(|r| r.into_inner())
    }

    pub fn budget(&self, target: MachineState) -> Duration {
        match target {
            MachineState::Idle => self.timing.create.max(self.timing.drain),
            MachineState::Configured => self.timing.configure,
            MachineState::Speculative => self.timing.delete,
            _ => self.timing.drain,
        }
    }

    /// Polls Get until `target`, recording a de-duplicated trace. FAILED (unless targeted) or the
    /// deadline is an error that carries the trace.
    pub async fn wait_for(&self, id: &str, target: MachineState) -> anyhow::Result<Trace> {
        wait_for_state(&self.c(), id, target, self.budget(target), self.timing.poll).await
    }

    /// Observes a machine for the stability window; returns the trace.
    pub async fn observe(&self, id: &str, window: Duration) -> anyhow::Result<Trace> {
        let mut c = self.c();
        let mut tr = Trace::default();
        let end = Instant::now() + window;
        while Instant::now() < end {
            let m = c
                .get(MachineRef { id: id.into() })
                .await
                .with_context(|| format!("Get({id})"))?;
            tr.push(m.into_inner());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(tr)
    }

    /// Asserts the machine stays in `state` for the stability window.
    pub async fn assert_stays(
        &self,
        id: &str,
        state: MachineState,
        what: &str,
    ) -> anyhow::Result<Machine> {
        let tr = self.observe(id, self.timing.stability).await?;
        let states = tr.states();
        if states != [state] {
            bail!(
                "{what}: expected {id} to stay {:?}, observed {}",
                state,
                fmt_states(&states)
            );
        }
        tr.last()
            .cloned()
            .ok_or_else(|| anyhow!("{what}: empty observation"))
    }

    /// Create + wait IDLE with a session token; returns (operation_id, trace including the ack).
    pub async fn to_idle(&self, id: &str, s: &mut ShardSession) -> anyhow::Result<(String, Trace)> {
        let ack = expect_ok(self.create(id, &s.mint()).await, &format!("Create({id})"))?;
        let mut tr = Trace::default();
        if let Some(m) = ack.machine.clone() {
            tr.push(m);
        }
        tr.extend(self.wait_for(id, MachineState::Idle).await?);
        Ok((ack.operation_id, tr))
    }

    pub async fn to_configured(
        &self,
        id: &str,
        s: &mut ShardSession,
        cluster: &str,
        meta: &HashMap<String, String>,
    ) -> anyhow::Result<(String, Trace)> {
        let ack = expect_ok(
            self.configure(id, cluster, meta, &s.mint()).await,
            &format!("Configure({id})"),
        )?;
        let mut tr = Trace::default();
        if let Some(m) = ack.machine.clone() {
            tr.push(m);
        }
        tr.extend(self.wait_for(id, MachineState::Configured).await?);
        Ok((ack.operation_id, tr))
    }

    pub async fn drain_to_idle(
        &self,
        id: &str,
        s: &mut ShardSession,
    ) -> anyhow::Result<(String, Trace)> {
        let ack = expect_ok(self.drain(id, 0, &s.mint()).await, &format!("Drain({id})"))?;
        let mut tr = Trace::default();
        if let Some(m) = ack.machine.clone() {
            tr.push(m);
        }
        tr.extend(self.wait_for(id, MachineState::Idle).await?);
        Ok((ack.operation_id, tr))
    }

    pub async fn delete_to_spec(
        &self,
        id: &str,
        s: &mut ShardSession,
    ) -> anyhow::Result<(String, Trace)> {
        let ack = expect_ok(self.delete(id, &s.mint()).await, &format!("Delete({id})"))?;
        let mut tr = Trace::default();
        if let Some(m) = ack.machine.clone() {
            tr.push(m);
        }
        tr.extend(self.wait_for(id, MachineState::Speculative).await?);
        Ok((ack.operation_id, tr))
    }

    /// A fresh machine driven to IDLE.
    pub async fn fresh_idle(&self, s: &mut ShardSession) -> anyhow::Result<(String, String)> {
        let id = self.fresh1().await?;
        let (op, _) = self.to_idle(&id, s).await?;
        Ok((id, op))
    }

    /// A fresh machine driven to CONFIGURED with `meta`.
    pub async fn fresh_configured(
        &self,
        s: &mut ShardSession,
        meta: &HashMap<String, String>,
    ) -> anyhow::Result<(String, String)> {
        let (id, _) = self.fresh_idle(s).await?;
        let (op, _) = self.to_configured(&id, s, "bfconf-cluster", meta).await?;
        Ok((id, op))
    }
}

/// The RNG of one test: a function of the run seed and the test id only, so a run replays
/// identically with the same `--seed` whatever the scheduling order.
pub fn test_rng(seed: u64, test_id: &str) -> StdRng {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in test_id.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    StdRng::seed_from_u64(seed ^ h)
}

/// Polls `Get(id)` every `poll` until the machine is in `target` or `timeout` passes.
pub async fn wait_for_state(
    client: &Client,
    id: &str,
    target: MachineState,
    timeout: Duration,
    poll: Duration,
) -> anyhow::Result<Trace> {
    let mut c = client.clone();
    let mut tr = Trace::default();
    let deadline = Instant::now() + timeout;
    loop {
        let m = c
            .get(MachineRef { id: id.into() })
            .await
            .with_context(|| format!("Get({id}) while waiting for {target:?}"))?
            .into_inner();
        let s = m.state();
        let err = m.last_error.clone();
        tr.push(m);
        if s == target {
            return Ok(tr);
        }
        if s == MachineState::Failed {
            bail!(
                "{id} went FAILED while waiting for {target:?} (last_error {err:?}); trace {}",
                fmt_states(&tr.states())
            );
        }
        if Instant::now() >= deadline {
            bail!(
                "{id} not {target:?} within {timeout:?}; trace {}",
                fmt_states(&tr.states())
            );
        }
        tokio::time::sleep(poll).await;
    }
}

/// Runs `n` copies of `f` concurrently and collects their results in index order.
pub async fn burst<F, Fut, T>(n: usize, f: F) -> Vec<T>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = T>,
{
    join_all((0..n).map(f)).await
}

/// `n` distinct connections to the context's target.
pub async fn connections(ctx: &Ctx, n: usize) -> anyhow::Result<Vec<Client>> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(ctx.dial_fresh().await?);
    }
    Ok(out)
}

/// Ids of a list, with a duplicate check.
pub fn id_set(ms: &[Machine]) -> anyhow::Result<BTreeMap<String, MachineState>> {
    let mut out = BTreeMap::new();
    for m in ms {
        if out.insert(m.id.clone(), m.state()).is_some() {
            bail!("machine {} listed twice", m.id);
        }
    }
    Ok(out)
}

/// A small metadata map for ordinary configures.
pub fn meta(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

pub type SharedCtx = Arc<Ctx>;

#[cfg(test)]
mod tests {
    use super::*;

    fn m(state: MachineState, cluster: &str) -> Machine {
        Machine {
            id: "m".into(),
            state: state as i32,
            cluster: cluster.into(),
            ..Default::default()
        }
    }

    #[test]
    fn trace_deduplicates_snapshots_and_states() {
        let mut t = Trace::default();
        t.push(m(MachineState::Idle, ""));
        t.push(m(MachineState::Idle, ""));
        t.push(m(MachineState::Configuring, "c"));
        t.push(m(MachineState::Configuring, "c2"));
        t.push(m(MachineState::Configured, "c2"));
        assert_eq!(t.snapshots.len(), 4);
        assert_eq!(
            t.states(),
            vec![
                MachineState::Idle,
                MachineState::Configuring,
                MachineState::Configured
            ]
        );
        assert_eq!(fmt_states(&t.states()), "IDLE→CONFIGURING→CONFIGURED");
    }

    #[test]
    fn sessions_mint_strictly_increasing_tokens() {
        let mut s = ShardSession::new("sh".into());
        let a = s.mint();
        let b = s.mint();
        assert!((b.epoch, b.seq) > (a.epoch, a.seq));
        assert_eq!(s.last(), b);
        s.new_epoch();
        let c = s.mint();
        assert_eq!((c.epoch, c.seq), (2, 1));
        assert!((c.epoch, c.seq) > (b.epoch, b.seq));
    }

    #[test]
    fn code_assertions_reject_failed_precondition_for_position_errors() {
        let fp: RpcResult<()> = Err(Status::failed_precondition("stale"));
        let ab: RpcResult<()> = Err(Status::aborted("out of position"));
        let ok: RpcResult<()> = Ok(());
        assert!(expect_rejected_not_fp(&fp, "x").is_err());
        assert!(expect_rejected_not_fp(&ok, "x").is_err());
        assert!(expect_rejected_not_fp(&ab, "x").is_ok());
        assert!(expect_fp(&fp, "x").is_ok());
        assert!(expect_fp(&ab, "x").is_err());
        assert!(expect_code(&ab, &[Code::Aborted, Code::Internal], "x").is_ok());
    }

    #[test]
    fn per_test_rng_depends_only_on_seed_and_id() {
        use rand::Rng;
        let draw = |seed: u64, id: &str| {
            let mut r = test_rng(seed, id);
            (0..4).map(|_| r.random::<u64>()).collect::<Vec<_>>()
        };
        assert_eq!(draw(7, "B312"), draw(7, "B312"));
        assert_ne!(draw(7, "B312"), draw(8, "B312"));
        assert_ne!(draw(7, "B312"), draw(7, "B1201"));
    }
}
