//! Scale & soak (B1101–B1109): a large seeded fleet, per-RPC latency histograms against
//! declared budgets, a churn soak.
//!
//! One file past 600 lines on purpose: the nine behaviors run in order over
//! one seeded fleet and share its driver, histograms and soak.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _};
use bigfleet_proto::v1alpha1::{ListFilter, MachineRef, MachineState as S};
use futures::future::join_all;
use parking_lot::Mutex;
use serde::Serialize;

use crate::harness::{
    expect_ok, id_set, meta, probe, Client, Ctx, Outcome, SharedCtx, TestResult, Token,
};
use crate::process::ProviderProcess;
use crate::suite::list::{check_pages, page_fleet};
use crate::suite::shape::{cost_shape, density_rule, field_shape};

/// Declared p99 budgets (ms). Full-List budget scales linearly above 10k machines.
#[derive(Debug, Clone, Serialize)]
pub struct Budgets {
    pub get_p99_ms: f64,
    pub create_ack_p99_ms: f64,
    pub list_page_p99_ms: f64,
    pub list_full_p99_ms_per_10k: f64,
    /// Max ratio of per-machine full-List cost at N vs the small baseline fleet.
    pub list_growth_ratio: f64,
}

impl Default for Budgets {
    fn default() -> Self {
        Budgets {
            get_p99_ms: 50.0,
            create_ack_p99_ms: 100.0,
            list_page_p99_ms: 100.0,
            list_full_p99_ms_per_10k: 2000.0,
            list_growth_ratio: 4.0,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Histogram {
    pub count: usize,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

pub fn histogram(samples: &[Duration]) -> Option<Histogram> {
    if samples.is_empty() {
        return None;
    }
    let mut v: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    let q = |p: f64| v[((v.len() as f64 - 1.0) * p).round() as usize];
    Some(Histogram {
        count: v.len(),
        p50_ms: q(0.5),
        p90_ms: q(0.9),
        p99_ms: q(0.99),
        max_ms: q(1.0),
    })
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct SoakResult {
    pub secs: f64,
    pub cycles: u64,
    pub created: u64,
    pub deleted: u64,
    pub resident_before: usize,
    pub resident_after: usize,
    pub invariant_violations: Vec<String>,
    pub drift: Vec<String>,
    pub error: Option<String>,
}

pub struct ScaleRun {
    pub ctx: SharedCtx,
    pub n: usize,
    pub soak: Duration,
    pub budgets: Budgets,
    pub baseline_n: usize,
    pub baseline_list_ms: f64,
    pub lat: Mutex<BTreeMap<String, Vec<Duration>>>,
    soak_result: tokio::sync::OnceCell<SoakResult>,
    pub _proc: tokio::sync::Mutex<ProviderProcess>,
    _dir: tempfile::TempDir,
}

pub struct ScaleOpts {
    pub bin: PathBuf,
    /// Provider flags other than --addr/--seed-count.
    pub base_args: Vec<String>,
    pub n: usize,
    pub baseline_n: usize,
    pub soak: Duration,
    pub seed: u64,
    /// Where the providers' output goes (kept after the run).
    pub log_dir: PathBuf,
}

fn args(o: &ScaleOpts, n: usize) -> Vec<String> {
    let mut a = o.base_args.clone();
    a.push("--seed-count".into());
    a.push(n.to_string());
    a
}

async fn full_list_ms(c: &Client, reps: usize) -> anyhow::Result<(Vec<Duration>, usize)> {
    let mut out = Vec::new();
    let mut len = 0;
    for _ in 0..reps {
        let t = Instant::now();
        let l = c
            .clone()
            .list(ListFilter::default())
            .await
            .context("full List")?
            .into_inner();
        out.push(t.elapsed());
        len = l.machines.len();
    }
    Ok((out, len))
}

pub async fn prepare(o: &ScaleOpts) -> anyhow::Result<Arc<ScaleRun>> {
    let dir = tempfile::tempdir()?;
    let ready = Duration::from_secs(300);
    // Baseline fleet for the growth comparison (B1107).
    let (mut small, c) = ProviderProcess::spawn(
        &o.bin,
        &args(o, o.baseline_n),
        &o.log_dir.join("provider-scale-baseline.log"),
        ready,
    )
    .await?;
    let (samples, _) = full_list_ms(&c, 7).await?;
    let baseline_list_ms = histogram(&samples).map(|h| h.p50_ms).unwrap_or(0.0);
    small.kill9()?;
    drop(small);

    let (proc, client) = ProviderProcess::spawn(
        &o.bin,
        &args(o, o.n),
        &o.log_dir.join("provider-scale.log"),
        ready,
    )
    .await?;
    let caps = probe(&client).await?;
    let mut ctx = Ctx::new(proc.addr.clone(), None, client, caps, o.seed);
    ctx.profiles = vec!["scale".into()];
    Ok(Arc::new(ScaleRun {
        ctx: Arc::new(ctx),
        n: o.n,
        soak: o.soak,
        budgets: Budgets::default(),
        baseline_n: o.baseline_n,
        baseline_list_ms,
        lat: Mutex::new(BTreeMap::new()),
        soak_result: tokio::sync::OnceCell::new(),
        _proc: tokio::sync::Mutex::new(proc),
        _dir: dir,
    }))
}

impl ScaleRun {
    fn record(&self, rpc: &str, d: Duration) {
        self.lat.lock().entry(rpc.to_string()).or_default().push(d);
    }

    pub async fn timed<T, F: std::future::Future<Output = T>>(&self, rpc: &str, f: F) -> T {
        let t = Instant::now();
        let out = f.await;
        self.record(rpc, t.elapsed());
        out
    }

    pub fn histograms(&self) -> BTreeMap<String, Histogram> {
        self.lat
            .lock()
            .iter()
            .filter_map(|(k, v)| histogram(v).map(|h| (k.clone(), h)))
            .collect()
    }

    pub fn full_list_budget_ms(&self) -> f64 {
        self.budgets.list_full_p99_ms_per_10k * (self.n as f64 / 10_000.0).max(1.0)
    }

    /// The scale figures for report.json.
    pub fn report(&self) -> serde_json::Value {
        serde_json::json!({
            "machines": self.n,
            "baseline_machines": self.baseline_n,
            "baseline_full_list_p50_ms": self.baseline_list_ms,
            "budgets": self.budgets,
            "full_list_p99_budget_ms": self.full_list_budget_ms(),
            "latency": self.histograms(),
            "soak": self.soak_result.get(),
        })
    }

    async fn soak_once(self: &Arc<Self>) -> SoakResult {
        match run_soak(self.clone()).await {
            Ok(r) => r,
            Err(e) => SoakResult {
                error: Some(format!("{e:#}")),
                ..Default::default()
            },
        }
    }
}

pub async fn b1101(r: Arc<ScaleRun>) -> TestResult {
    let l = r
        .timed("List(full)", r.ctx.c().list(ListFilter::default()))
        .await
        .context("full List")?
        .into_inner();
    ensure!(
        l.machines.len() == r.n,
        "full List returned {} of {} seeded machines",
        l.machines.len(),
        r.n
    );
    id_set(&l.machines)?;
    for m in &l.machines {
        field_shape(m)?;
        cost_shape(m)?;
        density_rule(m)?;
        crate::suite::lifecycle::host_rule(m)?;
    }
    Ok(Outcome::Pass)
}

pub async fn b1102(r: Arc<ScaleRun>) -> TestResult {
    let ctx = &r.ctx;
    let c0 = ctx.list_all().await?.revision;
    ensure!(!c0.is_empty(), "empty revision cursor at scale");
    let ids = ctx.fresh(25).await?;
    let mut s = ctx.session("b1102");
    for id in &ids {
        let t = s.mint();
        expect_ok(r.timed("Create", ctx.create(id, &t)).await, "Create")?;
    }
    for id in &ids {
        ctx.wait_for(id, S::Idle).await?;
    }
    let d = r
        .timed(
            "List(delta)",
            ctx.c().list(ListFilter {
                since_revision: c0,
                ..Default::default()
            }),
        )
        .await?
        .into_inner();
    let got: BTreeSet<String> = d.machines.iter().map(|m| m.id.clone()).collect();
    let want: BTreeSet<String> = ids.into_iter().collect();
    ensure!(
        got == want,
        "delta is not exactly the mutated set: {} returned, {} mutated, extra {:?}",
        got.len(),
        want.len(),
        got.difference(&want).take(5).collect::<Vec<_>>()
    );
    Ok(Outcome::Pass)
}

pub async fn b1103(r: Arc<ScaleRun>) -> TestResult {
    let full: BTreeSet<String> = id_set(&r.ctx.list_all().await?.machines)?
        .into_keys()
        .collect();
    let page = 1000;
    let t = Instant::now();
    let visited = page_fleet(&r.ctx.client, page, full.len() / page as usize + 50).await?;
    let pages = visited.len().div_ceil(page as usize).max(1);
    r.record("List(page=1000) avg", t.elapsed() / pages as u32);
    check_pages(&visited, &full)?;
    Ok(Outcome::PassWith(format!(
        "{} machines in {pages} pages",
        visited.len()
    )))
}

pub async fn b1106(r: Arc<ScaleRun>) -> TestResult {
    let ctx = &r.ctx;
    let any = ctx.list(&[], 200, &[]).await?.machines;
    ensure!(!any.is_empty(), "empty fleet");
    for i in 0..400 {
        let id = any[i % any.len()].id.clone();
        r.timed("Get", ctx.c().get(MachineRef { id })).await?;
    }
    for _ in 0..50 {
        r.timed(
            "List(max_results=100)",
            ctx.c().list(ListFilter {
                max_results: 100,
                ..Default::default()
            }),
        )
        .await?;
    }
    let (full, _) = full_list_ms(&ctx.client, 10).await?;
    r.lat
        .lock()
        .entry("List(full)".into())
        .or_default()
        .extend(full);
    // Create acks measured one at a time: the budget is per call, not per 100-wide burst.
    let ids = ctx.fresh(100).await?;
    let none = Token::none();
    for id in &ids {
        expect_ok(r.timed("Create", ctx.create(id, &none)).await, "Create")?;
    }
    let h = r.histograms();
    let b = &r.budgets;
    let mut over = Vec::new();
    for (rpc, budget) in [
        ("Get", b.get_p99_ms),
        ("Create", b.create_ack_p99_ms),
        ("List(max_results=100)", b.list_page_p99_ms),
        ("List(full)", r.full_list_budget_ms()),
    ] {
        match h.get(rpc) {
            Some(x) if x.p99_ms <= budget => {}
            Some(x) => over.push(format!("{rpc} p99 {:.1} ms > budget {budget} ms", x.p99_ms)),
            None => over.push(format!("{rpc}: no samples")),
        }
    }
    for id in &ids {
        ctx.wait_for(id, S::Idle).await?;
    }
    ensure!(over.is_empty(), "{}", over.join("; "));
    Ok(Outcome::PassWith(
        h.iter()
            .map(|(k, v)| format!("{k} p99 {:.1}ms", v.p99_ms))
            .collect::<Vec<_>>()
            .join(", "),
    ))
}

pub async fn b1107(r: Arc<ScaleRun>) -> TestResult {
    let (samples, len) = full_list_ms(&r.ctx.client, 5).await?;
    let at_n = histogram(&samples).map(|h| h.p50_ms).unwrap_or(0.0);
    let per_n = at_n / len.max(1) as f64;
    let per_base = r.baseline_list_ms / r.baseline_n.max(1) as f64;
    let ratio = if per_base > 0.0 {
        per_n / per_base
    } else {
        0.0
    };
    let note = format!(
        "full List p50 {:.1} ms at {} vs {:.1} ms at {} (per-machine ratio {ratio:.2})",
        at_n, len, r.baseline_list_ms, r.baseline_n
    );
    // Below 250 ms the comparison is dominated by noise; above it growth must be near-linear.
    ensure!(
        at_n < 250.0 || ratio <= r.budgets.list_growth_ratio,
        "pathological growth: {note}"
    );
    Ok(Outcome::PassWith(note))
}

pub async fn b1108(r: Arc<ScaleRun>) -> TestResult {
    let ctx = &r.ctx;
    let mut s = ctx.session("b1108-single");
    let single = Instant::now();
    ctx.fresh_idle(&mut s).await?;
    let single = single.elapsed();
    const K: usize = 32;
    let ids = ctx.fresh(K).await?;
    let t = Instant::now();
    let res = join_all(ids.iter().map(|id| {
        let ctx = ctx.clone();
        let id = id.clone();
        let r = r.clone();
        async move {
            let a = expect_ok(
                r.timed("Create(parallel x32)", ctx.create(&id, &Token::none()))
                    .await,
                "Create",
            )?;
            ctx.wait_for(&id, S::Idle).await?;
            anyhow::Ok(a.operation_id)
        }
    }))
    .await;
    let wall = t.elapsed();
    let mut ops = HashSet::new();
    for x in res {
        let op = x?;
        ensure!(ops.insert(op.clone()), "operation_id collision: {op}");
    }
    let limit = (single * 3).max(single + Duration::from_secs(2));
    ensure!(
        wall <= limit,
        "{K} parallel walks took {wall:?}; one walk takes {single:?} (limit {limit:?})"
    );
    Ok(Outcome::PassWith(format!(
        "{K} parallel walks in {wall:?}, single {single:?}"
    )))
}

async fn soak_result(r: &Arc<ScaleRun>) -> &SoakResult {
    r.soak_result.get_or_init(|| r.soak_once()).await
}

pub async fn b1104(r: Arc<ScaleRun>) -> TestResult {
    let s = soak_result(&r).await;
    if let Some(e) = &s.error {
        bail!("soak failed: {e}");
    }
    ensure!(s.cycles > 0, "soak completed no cycle");
    ensure!(
        s.invariant_violations.is_empty(),
        "{} invariant violations, e.g. {:?}",
        s.invariant_violations.len(),
        &s.invariant_violations[..s.invariant_violations.len().min(5)]
    );
    Ok(Outcome::PassWith(format!(
        "{} cycles in {:.1}s",
        s.cycles, s.secs
    )))
}

pub async fn b1105(r: Arc<ScaleRun>) -> TestResult {
    let s = soak_result(&r).await;
    if let Some(e) = &s.error {
        bail!("soak failed: {e}");
    }
    ensure!(
        s.resident_before as u64 + s.created == s.deleted + s.resident_after as u64,
        "live count not conserved: resident {} + created {} != deleted {} + resident {}",
        s.resident_before,
        s.created,
        s.deleted,
        s.resident_after
    );
    Ok(Outcome::PassWith(format!(
        "created {} deleted {} resident {}→{}",
        s.created, s.deleted, s.resident_before, s.resident_after
    )))
}

pub async fn b1109(r: Arc<ScaleRun>) -> TestResult {
    let s = soak_result(&r).await;
    if let Some(e) = &s.error {
        bail!("soak failed: {e}");
    }
    ensure!(
        s.drift.is_empty(),
        "steady machines drifted: {:?}",
        &s.drift[..s.drift.len().min(5)]
    );
    Ok(Outcome::Pass)
}

fn check_invariants(m: &bigfleet_proto::v1alpha1::Machine, violations: &Mutex<Vec<String>>) {
    let mut v = Vec::new();
    if let Err(e) = crate::suite::lifecycle::host_rule(m) {
        v.push(format!("{e}"));
    }
    if m.state() == S::Idle && (!m.cluster.is_empty() || !m.shard_metadata.is_empty()) {
        v.push(format!(
            "{} IDLE leaks cluster {:?} / {} metadata keys",
            m.id,
            m.cluster,
            m.shard_metadata.len()
        ));
    }
    if m.state() == S::Configured && m.cluster.is_empty() {
        v.push(format!("{} CONFIGURED without cluster", m.id));
    }
    if m.state() == S::Failed {
        v.push(format!("{} FAILED: {}", m.id, m.last_error));
    }
    violations.lock().extend(v);
}

async fn run_soak(r: Arc<ScaleRun>) -> anyhow::Result<SoakResult> {
    let ctx = r.ctx.clone();
    let count_resident = |l: &[bigfleet_proto::v1alpha1::Machine]| {
        l.iter().filter(|m| m.state() != S::Speculative).count()
    };
    // Steady sample: IDLE, CONFIGURED and untouched SPECULATIVE machines nobody mutates during the soak.
    let mut s = ctx.session("soak-steady");
    let mut steady: Vec<(String, S)> = Vec::new();
    for _ in 0..4 {
        steady.push((ctx.fresh_idle(&mut s).await?.0, S::Idle));
        steady.push((
            ctx.fresh_configured(&mut s, &meta(&[("steady", "1")]))
                .await?
                .0,
            S::Configured,
        ));
    }
    for id in ctx.fresh(8).await? {
        steady.push((id, S::Speculative));
    }
    let before = ctx.list_all().await?.machines;
    let resident_before = count_resident(&before);
    let workers = if ctx.caps.delete { 8 } else { 0 };
    let machines = ctx.fresh(workers * 2).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let created = Arc::new(AtomicU64::new(0));
    let deleted = Arc::new(AtomicU64::new(0));
    let cycles = Arc::new(AtomicU64::new(0));
    let violations = Arc::new(Mutex::new(Vec::new()));
    let drift = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();

    let mut tasks = Vec::new();
    for w in 0..workers {
        let (ctx, r, stop, created, deleted, cycles, violations) = (
            ctx.clone(),
            r.clone(),
            stop.clone(),
            created.clone(),
            deleted.clone(),
            cycles.clone(),
            violations.clone(),
        );
        let mine: Vec<String> = machines[w * 2..w * 2 + 2].to_vec();
        tasks.push(tokio::spawn(async move {
            let mut s = ctx.session(&format!("soak-{w}"));
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let id = &mine[i % mine.len()];
                i += 1;
                expect_ok(
                    r.timed("Create", ctx.create(id, &s.mint())).await,
                    "soak Create",
                )?;
                created.fetch_add(1, Ordering::Relaxed);
                check_invariants(
                    &ctx.wait_for(id, S::Idle)
                        .await?
                        .last()
                        .cloned()
                        .unwrap_or_default(),
                    &violations,
                );
                let md: HashMap<String, String> =
                    meta(&[("cycle", &i.to_string()), ("w", &w.to_string())]);
                expect_ok(
                    r.timed("Configure", ctx.configure(id, "soak", &md, &s.mint()))
                        .await,
                    "soak Configure",
                )?;
                let m = ctx
                    .wait_for(id, S::Configured)
                    .await?
                    .last()
                    .cloned()
                    .unwrap_or_default();
                if m.shard_metadata != md {
                    violations
                        .lock()
                        .push(format!("{id}: metadata not verbatim"));
                }
                check_invariants(&m, &violations);
                expect_ok(
                    r.timed("Drain", ctx.drain(id, 0, &s.mint())).await,
                    "soak Drain",
                )?;
                check_invariants(
                    &ctx.wait_for(id, S::Idle)
                        .await?
                        .last()
                        .cloned()
                        .unwrap_or_default(),
                    &violations,
                );
                let g = r.timed("Get", ctx.get(id)).await?;
                check_invariants(&g, &violations);
                expect_ok(
                    r.timed("Delete", ctx.delete(id, &s.mint())).await,
                    "soak Delete",
                )?;
                ctx.wait_for(id, S::Speculative).await?;
                deleted.fetch_add(1, Ordering::Relaxed);
                cycles.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(())
        }));
    }
    let sampler = {
        let (ctx, stop, drift, r) = (ctx.clone(), stop.clone(), drift.clone(), r.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                for (id, want) in &steady {
                    let m = r.timed("Get", ctx.get(id)).await?;
                    if m.state() != *want {
                        drift.lock().push(format!(
                            "{id}: {want:?} -> {:?} {}",
                            m.state(),
                            m.last_error
                        ));
                    }
                }
                r.timed(
                    "List(max_results=100)",
                    ctx.c().list(ListFilter {
                        max_results: 100,
                        ..Default::default()
                    }),
                )
                .await?;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            anyhow::Ok(())
        })
    };
    tokio::time::sleep(r.soak).await;
    stop.store(true, Ordering::Relaxed);
    let mut error = None;
    for t in tasks.into_iter().chain(std::iter::once(sampler)) {
        match t.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => error = Some(format!("{e:#}")),
            Err(e) => error = Some(format!("soak task panicked: {e}")),
        }
    }
    let after = ctx.list_all().await?.machines;
    let violations = violations.lock().clone();
    let drift = drift.lock().clone();
    Ok(SoakResult {
        secs: start.elapsed().as_secs_f64(),
        cycles: cycles.load(Ordering::Relaxed),
        created: created.load(Ordering::Relaxed),
        deleted: deleted.load(Ordering::Relaxed),
        resident_before,
        resident_after: count_resident(&after),
        invariant_violations: violations,
        drift,
        error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_percentiles() {
        let s: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        let h = histogram(&s).unwrap();
        assert_eq!(h.count, 100);
        assert!((h.p50_ms - 50.0).abs() <= 1.0, "{h:?}");
        assert!((h.p99_ms - 99.0).abs() <= 1.0, "{h:?}");
        assert_eq!(h.max_ms, 100.0);
        assert!(histogram(&[]).is_none());
    }
}
