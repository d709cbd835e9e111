//! The per-run context every test gets: the endpoint, timing budgets,
//! machine claims, and the lifecycle helpers built on them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context as _};
use bigfleet_proto::v1alpha1::{
    ListFilter, Machine, MachineList, MachineRef, MachineState, TransitionAck,
};
use futures::future::join_all;
use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::{
    configure_req, create_req, delete_req, dial, drain_req, expect_ok, fmt_states, Capabilities,
    Client, RpcResult, ShardSession, TlsOpts, Token, Trace,
};

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
