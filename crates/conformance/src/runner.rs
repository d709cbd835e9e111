//! Lanes (endpoint core/cloud, fault, durable, scale), result mapping onto the registry, verdict.
//!
//! One file past 600 lines on purpose: the lanes all record into one report
//! under one fail-fast rule, and read best side by side.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use futures::future::BoxFuture;
use futures::StreamExt;

use crate::boot::{self, BootCheck};
use crate::harness::{dial, probe, Ctx, Outcome, SharedCtx, TestResult, Timing, TlsOpts};
use crate::process::{free_port, ProviderProcess};
use crate::registry::{Behavior, BEHAVIORS};
use crate::report::{Report, Status, TestRecord, Verdict};
use crate::suite::{self, durable, scale, Impl};
use crate::upstream::{self, Baseline};

/// Where the core/cloud lanes find their endpoint.
#[derive(Debug, Clone)]
pub enum Target {
    /// Boot the provider binary ourselves.
    Spawn,
    /// Dial an already running endpoint.
    Addr { addr: String, tls: Option<TlsOpts> },
}

#[derive(Debug, Clone)]
pub struct RunConfig {
    pub profiles: Vec<String>,
    pub seed: u64,
    pub fail_fast: bool,
    pub concurrency: usize,
    pub target: Target,
    /// Provider binary (needed for Spawn, durable and scale).
    pub provider_bin: Option<PathBuf>,
    /// Provider flags besides --addr/--seed-count/--state (e.g. --use-fake-backend).
    pub provider_args: Vec<String>,
    pub seed_count: usize,
    pub scale_count: usize,
    pub scale_baseline: usize,
    pub soak: Duration,
    pub fault_bin: Option<PathBuf>,
    /// Capabilities the provider claims: a failed probe for one of these FAILS its gated
    /// behaviors instead of skipping them.
    pub expect_caps: Vec<String>,
    /// Restrict to these ids (debugging); others are recorded as not selected.
    pub only: Option<Vec<String>>,
    pub test_timeout: Duration,
    pub log_dir: PathBuf,
    pub durable_slow_latency: String,
    /// The durable lane's `--state` instead of a fresh file (an empty
    /// PostgreSQL database's URL, say).
    pub durable_state: Option<String>,
    /// Print one line per finished test, not only failures.
    pub verbose: bool,
    /// Which baseline runs first (`$BIGFLEET_SRC`).
    pub baseline: Baseline,
    /// `bfconformance` itself, re-executed in a private network namespace
    /// for the boot-compatibility check (default: found next to this
    /// executable).
    pub runner_bin: Option<PathBuf>,
    /// Flags the boot-compatibility check adds after the published ones.
    pub boot_args: Vec<String>,
}

impl RunConfig {
    pub fn new(profiles: Vec<String>, seed: u64) -> RunConfig {
        RunConfig {
            profiles,
            seed,
            fail_fast: false,
            concurrency: 8,
            target: Target::Spawn,
            provider_bin: None,
            // A short reconcile period so quiescence checks (B908) span several background ticks.
            provider_args: vec![
                "--use-fake-backend".into(),
                "--metrics-addr".into(),
                String::new(),
                "--reconcile-interval".into(),
                "1s".into(),
            ],
            seed_count: 256,
            scale_count: 10_000,
            scale_baseline: 1_000,
            soak: Duration::from_secs(20),
            fault_bin: None,
            expect_caps: Vec::new(),
            only: None,
            test_timeout: Duration::from_secs(180),
            log_dir: std::env::temp_dir().join(format!(
                "bfconformance-{}-{}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or(0)
            )),
            durable_slow_latency: "5s".into(),
            durable_state: None,
            verbose: false,
            baseline: Baseline::from_env(),
            runner_bin: None,
            boot_args: Vec::new(),
        }
    }

    fn claims(&self, p: &str) -> bool {
        self.profiles.iter().any(|x| x == p)
    }

    fn selected(&self, id: &str) -> bool {
        self.only.as_ref().is_none_or(|o| o.iter().any(|x| x == id))
    }
}

struct State {
    cfg: RunConfig,
    report: parking_lot::Mutex<Report>,
    failed: AtomicBool,
}

impl State {
    fn stop(&self) -> bool {
        self.cfg.fail_fast && self.failed.load(Ordering::Relaxed)
    }

    fn record(&self, id: &str, baseline: bool, rec: TestRecord) {
        if rec.status == Status::Failed && rec.required {
            self.failed.store(true, Ordering::Relaxed);
            println!("FAIL {id}: {}", rec.message);
        } else if self.cfg.verbose {
            println!(
                "{:?} {id} ({} ms) {}",
                rec.status, rec.duration_ms, rec.message
            );
        }
        let mut r = self.report.lock();
        if baseline {
            r.baseline.insert(id.to_string(), rec);
        } else {
            r.behaviors.insert(id.to_string(), rec);
        }
    }

    fn record_status(&self, b: &Behavior, status: Status, msg: String) {
        self.record(
            b.id,
            false,
            TestRecord {
                status,
                duration_ms: 0,
                message: msg,
                area: Some(b.area.title().into()),
                required: true,
            },
        );
    }
}

/// Runs one test on its own task (a panic is a failure) under the per-test timeout.
async fn run_one(fut: BoxFuture<'static, TestResult>, timeout: Duration) -> (Status, u64, String) {
    let t = Instant::now();
    let res = tokio::spawn(tokio::time::timeout(timeout, fut)).await;
    let ms = t.elapsed().as_millis() as u64;
    match res {
        Ok(Ok(Ok(Outcome::Pass))) => (Status::Passed, ms, String::new()),
        Ok(Ok(Ok(Outcome::PassWith(m)))) => (Status::Passed, ms, m),
        Ok(Ok(Ok(Outcome::Skip(m)))) => (Status::Skipped, ms, m),
        Ok(Ok(Err(e))) => (Status::Failed, ms, format!("{e:#}")),
        Ok(Err(_)) => (Status::Failed, ms, format!("timed out after {timeout:?}")),
        Err(e) => (Status::Failed, ms, format!("test panicked: {e}")),
    }
}

fn behavior_record(b: &Behavior, (status, ms, msg): (Status, u64, String)) -> TestRecord {
    TestRecord {
        status,
        duration_ms: ms,
        message: msg,
        area: Some(b.area.title().into()),
        required: true,
    }
}

/// A binary of this crate next to the running executable (or one folder up,
/// from a test binary in `deps/`).
fn sibling_bin(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    if exe.file_name().is_some_and(|n| n == name) {
        return Some(exe);
    }
    let dir = exe.parent()?;
    [dir.join(name), dir.join("..").join(name)]
        .into_iter()
        .find(|p| p.is_file())
}

/// Resolves the fault-provider binary: explicit, else next to the running executable.
pub fn default_fault_bin() -> Option<PathBuf> {
    sibling_bin("fault-provider")
}

/// The key the boot-compatibility check is recorded under (with the baseline).
pub const BOOT_RECORD: &str = "boot/published-runner-flags";

/// Runs every lane the profiles ask for and returns the finished report.
pub async fn run(cfg: RunConfig) -> anyhow::Result<Report> {
    let target_desc = match &cfg.target {
        Target::Spawn => format!(
            "spawned {}",
            cfg.provider_bin
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        ),
        Target::Addr { addr, .. } => addr.clone(),
    };
    std::fs::create_dir_all(&cfg.log_dir)
        .with_context(|| format!("creating log dir {}", cfg.log_dir.display()))?;
    println!(
        "bfconformance: seed {} (replay with --seed {}), profiles {}, provider logs in {}",
        cfg.seed,
        cfg.seed,
        cfg.profiles.join(","),
        cfg.log_dir.display()
    );
    println!("{}", cfg.baseline.describe());
    let st = Arc::new(State {
        report: parking_lot::Mutex::new(Report::new(cfg.seed, cfg.profiles.clone(), target_desc)),
        cfg,
        failed: AtomicBool::new(false),
    });
    let cfg = &st.cfg;

    let mut unimplemented = Vec::new();
    for b in BEHAVIORS {
        if !b.required_by(&cfg.profiles) {
            st.record(
                b.id,
                false,
                TestRecord {
                    status: Status::Skipped,
                    duration_ms: 0,
                    message: format!(
                        "profile not claimed (behavior profiles: {})",
                        b.profiles.join(",")
                    ),
                    area: Some(b.area.title().into()),
                    required: false,
                },
            );
        } else if suite::implementation(b.id).is_none() {
            unimplemented.push(b.id.to_string());
        } else if !cfg.selected(b.id) {
            st.record_status(b, Status::Skipped, "not selected (--only)".into());
        }
    }
    st.report.lock().unimplemented = unimplemented;

    if ["core", "cloud", "spot"].iter().any(|p| cfg.claims(p)) {
        if let Err(e) = endpoint_lane(&st).await {
            fail_lane(
                &st,
                |i| matches!(i, Impl::Endpoint(_) | Impl::Serial(_)),
                &format!("endpoint lane setup failed: {e:#}"),
            );
            st.record(
                "baseline/setup",
                true,
                TestRecord {
                    status: Status::Failed,
                    duration_ms: 0,
                    message: format!("{e:#}"),
                    area: None,
                    required: true,
                },
            );
        }
    }
    if cfg.claims("fault") && !st.stop() {
        if let Err(e) = fault_lane(&st).await {
            fail_lane(
                &st,
                |i| matches!(i, Impl::Fault(_)),
                &format!("fault lane setup failed: {e:#}"),
            );
        }
    }
    if cfg.claims("durable") && !st.stop() {
        if let Err(e) = durable_lane(&st).await {
            fail_lane(
                &st,
                |i| matches!(i, Impl::Durable(_)),
                &format!("durable lane setup failed: {e:#}"),
            );
        }
    }
    if cfg.claims("scale") && !st.stop() {
        if let Err(e) = scale_lane(&st).await {
            fail_lane(
                &st,
                |i| matches!(i, Impl::Scale(_)),
                &format!("scale lane setup failed: {e:#}"),
            );
        }
    }
    // Anything required and selected that never ran (fail-fast stop) is recorded as not run.
    for b in BEHAVIORS {
        if b.required_by(&cfg.profiles)
            && cfg.selected(b.id)
            && !st.report.lock().behaviors.contains_key(b.id)
            && suite::implementation(b.id).is_some()
        {
            st.record(
                b.id,
                false,
                TestRecord {
                    status: Status::Skipped,
                    duration_ms: 0,
                    message: "not run (stopped after the first failure)".into(),
                    area: Some(b.area.title().into()),
                    required: true,
                },
            );
        }
    }
    let mut report = st.report.lock().clone();
    if cfg.only.is_some() && report.verdict != Verdict::Failed {
        // A filtered run can never certify.
        report.finish();
        if report.verdict == Verdict::Certified {
            report.verdict = Verdict::Incomplete;
        }
    } else {
        report.finish();
    }
    Ok(report)
}

fn fail_lane(st: &State, pred: impl Fn(Impl) -> bool, msg: &str) {
    for b in BEHAVIORS {
        let Some(i) = suite::implementation(b.id) else {
            continue;
        };
        if pred(i)
            && b.required_by(&st.cfg.profiles)
            && st.cfg.selected(b.id)
            && !st.report.lock().behaviors.contains_key(b.id)
        {
            st.record_status(b, Status::Failed, msg.to_string());
        }
    }
}

fn provider_bin(cfg: &RunConfig) -> anyhow::Result<PathBuf> {
    match &cfg.provider_bin {
        Some(p) if p.is_file() => Ok(p.clone()),
        Some(p) => bail!("provider binary {} not found", p.display()),
        None => bail!("this lane owns the provider process: pass --provider/--provider-bin"),
    }
}

async fn endpoint_lane(st: &Arc<State>) -> anyhow::Result<()> {
    let cfg = &st.cfg;
    let mut _proc = None;
    let (addr, tls, client) = match &cfg.target {
        Target::Spawn => {
            let bin = provider_bin(cfg)?;
            let mut args = cfg.provider_args.clone();
            args.extend(["--seed-count".to_string(), cfg.seed_count.to_string()]);
            let (p, c) = ProviderProcess::spawn(
                &bin,
                &args,
                &cfg.log_dir.join("provider-core.log"),
                Duration::from_secs(60),
            )
            .await?;
            let addr = p.addr.clone();
            _proc = Some(p);
            (addr, None, c)
        }
        Target::Addr { addr, tls } => (addr.clone(), tls.clone(), dial(addr, tls.as_ref()).await?),
    };
    let caps = probe(&client).await?;
    println!(
        "capabilities: delete={} since_revision={} fleet={}",
        caps.delete, caps.since_revision, caps.fleet_size
    );
    st.report.lock().capabilities = Some(serde_json::to_value(&caps)?);
    if let Baseline::Upstream(src) = &cfg.baseline {
        let t = Instant::now();
        let r = upstream::run(src, &addr, &cfg.log_dir.join("upstream-baseline.log")).await;
        let (status, message) = match r {
            Ok(summary) => (Status::Passed, summary),
            Err(e) => (Status::Failed, format!("{e:#}")),
        };
        st.record(
            upstream::RECORD,
            true,
            TestRecord {
                status,
                duration_ms: t.elapsed().as_millis() as u64,
                message,
                area: None,
                required: true,
            },
        );
    }
    let mut ctx = Ctx::new(addr, tls, client, caps, cfg.seed);
    ctx.profiles = cfg.profiles.clone();
    let ctx: SharedCtx = Arc::new(ctx);

    // Baseline first.
    let base: Vec<_> = suite::BASELINE.iter().collect();
    futures::stream::iter(base)
        .map(|(name, f)| {
            let ctx = ctx.clone();
            let st = st.clone();
            async move {
                if st.stop() {
                    return;
                }
                let (status, ms, msg) = run_one(f(ctx), st.cfg.test_timeout).await;
                st.record(
                    name,
                    true,
                    TestRecord {
                        status,
                        duration_ms: ms,
                        message: msg,
                        area: None,
                        required: true,
                    },
                );
            }
        })
        .buffer_unordered(cfg.concurrency.max(1))
        .collect::<Vec<_>>()
        .await;

    if matches!(cfg.target, Target::Spawn)
        && cfg
            .only
            .as_ref()
            .is_none_or(|o| o.iter().any(|x| x == "boot"))
        && !st.stop()
    {
        let r = boot_check(cfg).await;
        let rec = TestRecord {
            status: r.0,
            duration_ms: r.1,
            message: r.2,
            area: None,
            required: true,
        };
        st.record(BOOT_RECORD, true, rec);
    }

    let mut parallel = Vec::new();
    let mut serial = Vec::new();
    for b in BEHAVIORS {
        if !b.required_by(&cfg.profiles) || !cfg.selected(b.id) {
            continue;
        }
        match suite::implementation(b.id) {
            Some(Impl::Endpoint(f)) => parallel.push((b, f)),
            Some(Impl::Serial(f)) => serial.push((b, f)),
            _ => {}
        }
    }
    let gate_check = |b: &Behavior, ctx: &Ctx| -> Option<(Status, String)> {
        let g = b.gate?;
        if ctx.caps.has(g) {
            return None;
        }
        if cfg.expect_caps.iter().any(|c| c == g) {
            Some((
                Status::Failed,
                format!("capability {g} is claimed but the probe did not detect it"),
            ))
        } else {
            Some((
                Status::Skipped,
                format!("capability {g} not supported by the endpoint"),
            ))
        }
    };
    futures::stream::iter(parallel)
        .map(|(b, f)| {
            let ctx = ctx.clone();
            let st = st.clone();
            let gate = gate_check(b, &ctx);
            async move {
                if st.stop() {
                    return;
                }
                if let Some((s, m)) = gate {
                    return st.record_status(b, s, m);
                }
                let r = run_one(f(ctx), st.cfg.test_timeout).await;
                st.record(b.id, false, behavior_record(b, r));
            }
        })
        .buffer_unordered(cfg.concurrency.max(1))
        .collect::<Vec<_>>()
        .await;
    for (b, f) in serial {
        if st.stop() {
            break;
        }
        if let Some((s, m)) = gate_check(b, &ctx) {
            st.record_status(b, s, m);
            continue;
        }
        let r = run_one(f(ctx.clone()), cfg.test_timeout).await;
        st.record(b.id, false, behavior_record(b, r));
    }
    Ok(())
}

/// Boots the provider the way the published runner does (see [`boot`]).
async fn boot_check(cfg: &RunConfig) -> (Status, u64, String) {
    let setup = || -> anyhow::Result<(PathBuf, BootCheck)> {
        let runner = cfg
            .runner_bin
            .clone()
            .or_else(|| sibling_bin("bfconformance"))
            .context("bfconformance binary not found for the boot check (set runner_bin)")?;
        let check = BootCheck {
            bin: provider_bin(cfg)?,
            extra_args: cfg.boot_args.clone(),
            seed_count: 16,
            log_dir: cfg.log_dir.clone(),
        };
        Ok((runner, check))
    };
    match setup() {
        Ok((runner, check)) => {
            run_one(
                Box::pin(async move { boot::run_isolated(&runner, &check).await }),
                cfg.test_timeout,
            )
            .await
        }
        Err(e) => (Status::Failed, 0, format!("{e:#}")),
    }
}

async fn fault_lane(st: &Arc<State>) -> anyhow::Result<()> {
    let cfg = &st.cfg;
    let bin = cfg
        .fault_bin
        .clone()
        .or_else(default_fault_bin)
        .context("fault-provider binary not found (pass --fault-bin)")?;
    let control = format!("127.0.0.1:{}", free_port()?);
    let timeout = "2s";
    let args: Vec<String> = [
        "--metrics-addr",
        "",
        "--control-addr",
        &control,
        "--seed-count",
        "64",
        "--latency",
        "50ms",
        "--create-timeout",
        timeout,
        "--configure-timeout",
        timeout,
        "--drain-timeout",
        timeout,
        "--delete-timeout",
        timeout,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let (proc, client) = ProviderProcess::spawn(
        &bin,
        &args,
        &cfg.log_dir.join("fault-provider.log"),
        Duration::from_secs(30),
    )
    .await?;
    let caps = probe(&client).await?;
    let mut ctx = Ctx::new(proc.addr.clone(), None, client, caps, cfg.seed);
    ctx.fault_control = Some(control);
    ctx.profiles = cfg.profiles.clone();
    ctx.timing = Timing {
        configure: Duration::from_secs(2),
        create: Duration::from_secs(2),
        drain: Duration::from_secs(2),
        delete: Duration::from_secs(2),
        ..Timing::default()
    };
    let ctx = Arc::new(ctx);
    let tests: Vec<_> = BEHAVIORS
        .iter()
        .filter(|b| b.required_by(&cfg.profiles) && cfg.selected(b.id))
        .filter_map(|b| match suite::implementation(b.id) {
            Some(Impl::Fault(f)) => Some((b, f)),
            _ => None,
        })
        .collect();
    futures::stream::iter(tests)
        .map(|(b, f)| {
            let ctx = ctx.clone();
            let st = st.clone();
            async move {
                if st.stop() {
                    return;
                }
                let r = run_one(f(ctx), st.cfg.test_timeout).await;
                st.record(b.id, false, behavior_record(b, r));
            }
        })
        .buffer_unordered(cfg.concurrency.max(1))
        .collect::<Vec<_>>()
        .await;
    drop(proc);
    Ok(())
}

async fn durable_lane(st: &Arc<State>) -> anyhow::Result<()> {
    let cfg = &st.cfg;
    let mut base = cfg.provider_args.clone();
    base.extend(["--seed-count".to_string(), "64".to_string()]);
    let opts = durable::DurableOpts {
        bin: provider_bin(cfg)?,
        base_args: base,
        seed: cfg.seed,
        slow_latency: cfg.durable_slow_latency.clone(),
        log_dir: cfg.log_dir.clone(),
        state: cfg.durable_state.clone(),
    };
    let run = durable::prepare(&opts).await?;
    for b in BEHAVIORS {
        if let (Some(Impl::Durable(f)), true) = (
            suite::implementation(b.id),
            b.required_by(&cfg.profiles) && cfg.selected(b.id),
        ) {
            if st.stop() {
                break;
            }
            let r = run_one(f(run.clone()), cfg.test_timeout).await;
            st.record(b.id, false, behavior_record(b, r));
        }
    }
    run.proc.lock().await.kill9()?;
    Ok(())
}

async fn scale_lane(st: &Arc<State>) -> anyhow::Result<()> {
    let cfg = &st.cfg;
    let opts = scale::ScaleOpts {
        bin: provider_bin(cfg)?,
        base_args: cfg.provider_args.clone(),
        n: cfg.scale_count,
        baseline_n: cfg.scale_baseline,
        soak: cfg.soak,
        seed: cfg.seed,
        log_dir: cfg.log_dir.clone(),
    };
    let run = scale::prepare(&opts).await?;
    // Order matters: the delta check (B1102) must see only its own batch, the soak comes last.
    let order = [
        "B1101", "B1102", "B1103", "B1107", "B1108", "B1106", "B1104", "B1105", "B1109",
    ];
    let mut by_id: BTreeMap<&str, &Behavior> = BTreeMap::new();
    for b in BEHAVIORS {
        by_id.insert(b.id, b);
    }
    for id in order {
        let Some(b) = by_id.get(id) else { continue };
        if !b.required_by(&cfg.profiles) || !cfg.selected(id) || st.stop() {
            continue;
        }
        if let Some(Impl::Scale(f)) = suite::implementation(id) {
            let r = run_one(f(run.clone()), cfg.test_timeout.max(cfg.soak * 3)).await;
            st.record(id, false, behavior_record(b, r));
        }
    }
    st.report.lock().scale = Some(run.report());
    Ok(())
}
