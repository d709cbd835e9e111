//! Load generator for the BigFleet capacity provider: boots (or dials) a
//! provider on the fake backend and prints one `key=value` line per figure.

mod durable;
mod half_sent;
mod machine;
mod provider;
mod scaling;
mod scenarios;
mod stats;
mod unread;

use std::fs::OpenOptions;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use clap::Parser;

use provider::Provider;
use scenarios::{Bench, Profile};

#[derive(Parser, Debug)]
#[command(
    about = "Benchmarks a BigFleet capacity provider (Get/List/Create/lifecycle/RSS/startup; durable state in SQLite and PostgreSQL, takeover)"
)]
struct Args {
    /// Provider binary to boot once per inventory size (fake backend, in memory).
    #[arg(
        long,
        default_value = "target/release/bigfleet-proxmox",
        conflicts_with = "target"
    )]
    provider_bin: PathBuf,

    /// Drive an already running endpoint (host:port) instead of booting one.
    /// Mutating figures consume its SPECULATIVE machines; RSS/startup are skipped.
    #[arg(long)]
    target: Option<String>,

    /// Inventory sizes (--seed-count) to boot, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1000,10000,100000")]
    sizes: Vec<usize>,

    /// Append the figures to this file as well as printing them.
    #[arg(long)]
    out: Option<PathBuf>,

    /// Shorter runs (smoke test); figures are noisier.
    #[arg(long)]
    quick: bool,

    /// Offered Get rate for the open-loop latency run.
    #[arg(long, default_value_t = 5000)]
    get_rps: u32,

    /// Run only these scenarios (for profiling one path); default: all.
    #[arg(long, value_delimiter = ',', value_enum)]
    only: Vec<scenarios::Scenario>,

    /// Pin the load generator to CPU 0 and the provider to CPU 1, so the two
    /// do not preempt each other on a small machine (needs 2+ CPUs).
    #[arg(long)]
    pin: bool,

    /// Inventory size for the unread-List scenario.
    #[arg(long, default_value_t = 20_000)]
    unread_size: usize,
    /// PostgreSQL server for the `postgres` scenario
    /// (postgres://USER@HOST:PORT/DB?sslmode=disable, a loopback server):
    /// each of its runs creates a database of its own there and drops it.
    #[arg(long)]
    state_url: Option<String>,
    /// Seconds allowed for a provider boot before giving up.
    #[arg(long, default_value_t = 120)]
    boot_timeout_secs: u64,
}

/// Prints figure lines and appends them to `--out`.
pub struct Report {
    out: Option<std::fs::File>,
}

impl Report {
    pub fn line(&mut self, line: String) {
        println!("{line}");
        if let Some(f) = self.out.as_mut() {
            if let Err(e) = writeln!(f, "{line}") {
                eprintln!("loadgen: writing --out failed: {e}");
                self.out = None;
            }
        }
    }
}

/// CPUs online on the machine (not just those this process may use, which
/// `--pin` narrows to one).
#[allow(unsafe_code)] // libc call; see the SAFETY note inside
fn online_cpus() -> i64 {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }
}

/// Restrict the calling thread (and what it spawns or execs) to one CPU.
#[allow(unsafe_code)] // libc call; see the SAFETY note inside
pub fn pin_to_cpu(cpu: usize) -> std::io::Result<()> {
    // SAFETY: the set is zeroed then filled by the libc macros; the call
    // only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Issue #15's memory goals, in MB (10^6 bytes) as they are stated.
const PEAK_GOAL_MB: f64 = 150.0;
const UNREAD_GROWTH_GOAL_MB: f64 = 150.0;

/// One line per memory goal: the largest size's peak RSS under boot + the
/// scenarios run, and the unread-List growth.
fn memory_goals(
    peaks: &[(usize, u64)],
    unread_growth_kib: Option<u64>,
    unread_size: usize,
    report: &mut Report,
) {
    let mb = |kib: u64| kib as f64 * 1024.0 / 1e6;
    if let Some(&(size, hwm)) = peaks.iter().max_by_key(|(size, _)| *size) {
        report.line(format!(
            "memory_goal=peak_rss peak_mb={:.1} peak_mib={:.1} goal_mb={PEAK_GOAL_MB} met={} size={size}",
            mb(hwm),
            hwm as f64 / 1024.0,
            mb(hwm) <= PEAK_GOAL_MB
        ));
    }
    if let Some(growth) = unread_growth_kib {
        report.line(format!(
            "memory_goal=unread_list_growth growth_mb={:.1} growth_mib={:.1} goal_mb={UNREAD_GROWTH_GOAL_MB} met={} size={unread_size}",
            mb(growth),
            growth as f64 / 1024.0,
            mb(growth) <= UNREAD_GROWTH_GOAL_MB
        ));
    }
}

fn main() {
    let args = Args::parse();
    if args.pin {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        if cpus < 2 {
            eprintln!("loadgen: --pin needs at least 2 CPUs, this machine has {cpus}");
            std::process::exit(2);
        }
        // Before the runtime exists, so every worker inherits it.
        if let Err(e) = pin_to_cpu(0) {
            eprintln!("loadgen: --pin: {e}");
            std::process::exit(1);
        }
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("loadgen: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = runtime.block_on(run(args)) {
        eprintln!("loadgen: {e:#}");
        std::process::exit(1);
    }
}

async fn run(args: Args) -> Result<()> {
    if args.sizes.is_empty() || args.sizes.contains(&0) {
        bail!("--sizes needs one or more positive inventory sizes");
    }
    if args.get_rps == 0 {
        bail!("--get-rps must be positive");
    }
    if args.only.contains(&scenarios::Scenario::Postgres) && args.state_url.is_none() {
        bail!("--only postgres needs --state-url postgres://... (scripts/pg-throwaway.sh run -- ... provides one in BIGFLEET_TEST_POSTGRES_URL)");
    }
    if args.state_url.is_some() && args.target.is_some() {
        bail!("--state-url boots its own providers: it cannot be used with --target");
    }
    let out = match &args.out {
        Some(path) => {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
            Some(
                OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .with_context(|| format!("opening --out {}", path.display()))?,
            )
        }
        None => None,
    };
    let mut report = Report { out };
    let mut profile = if args.quick {
        Profile::quick()
    } else {
        Profile::full()
    };
    profile.only = args.only.clone();
    profile.provider_cpu = args.pin.then_some(1);
    let unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    report.line(format!(
        "# loadgen run unix_time={unix} quick={} pinned={} nproc={} cpu_reference_ms={:.1}",
        args.quick,
        args.pin,
        online_cpus(),
        machine::cpu_reference().as_secs_f64() * 1e3
    ));

    if let Some(target) = &args.target {
        let bench = Bench::connect(target, &profile, None).await?;
        let size = bench.inventory().await?.len();
        return bench.run_all(size, &mut report, args.get_rps).await;
    }

    if !args.provider_bin.exists() {
        bail!(
            "provider binary {} not found (build it with `cargo build --release -p bigfleet-proxmox` or pass --provider-bin)",
            args.provider_bin.display()
        );
    }
    let boot_timeout = Duration::from_secs(args.boot_timeout_secs);
    if !profile.only_own_boots() {
        in_memory(&args, &profile, boot_timeout, &mut report).await?;
    }
    if profile.runs(scenarios::Scenario::Scaling) {
        let small = args.sizes.iter().copied().min().unwrap_or(1000);
        let large = args.sizes.iter().copied().max().unwrap_or(100_000);
        let met = scaling::run(
            &args.provider_bin,
            small,
            large,
            boot_timeout,
            &profile,
            &mut report,
        )
        .await?;
        if !met {
            bail!(
                "the scaling guard failed: a figure at {large} machines is under {:.2} of its value at {small} (the scaling_guard= lines above)",
                scaling::FLOOR
            );
        }
    }
    if profile.runs(scenarios::Scenario::HalfSent) {
        let met = half_sent::run(&args.provider_bin, boot_timeout, &profile, &mut report).await?;
        if !met {
            bail!(
                "the half-sent-bodies guard failed: the resident set grew past {} MiB or Get p99 \
                 passed {}x its value at rest (the half_sent_guard= lines above)",
                half_sent::RSS_GROWTH_LIMIT_MIB,
                half_sent::GET_P99_LIMIT
            );
        }
    }
    if let (true, Some(url)) = (profile.runs(scenarios::Scenario::Postgres), &args.state_url) {
        durable::run(
            &args.provider_bin,
            url,
            &args.sizes,
            boot_timeout,
            &profile,
            &mut report,
        )
        .await?;
    }
    Ok(())
}

/// The in-memory boots at each size, the unread Lists, the memory goals and
/// the restart with a SQLite state.
async fn in_memory(
    args: &Args,
    profile: &Profile,
    boot_timeout: Duration,
    report: &mut Report,
) -> Result<()> {
    // VmHWM (KiB) per size, for the memory goals at the end.
    let mut peaks: Vec<(usize, u64)> = Vec::new();
    let mut unread_growth_kib: Option<u64> = None;
    for &size in &args.sizes {
        let provider = Provider::spawn(
            &args.provider_bin,
            size,
            None,
            boot_timeout,
            profile.provider_cpu,
        )
        .await
        .with_context(|| format!("booting provider with --seed-count {size}"))?;
        report.line(format!(
            "startup_ms={} size={size} state=memory",
            stats::ms(provider.startup)
        ));
        if let Ok((_, rss)) = provider.memory_kib() {
            report.line(format!(
                "rss_after_boot_mib={:.1} size={size}",
                rss as f64 / 1024.0
            ));
        }
        let bench = Bench::connect(&provider.addr, profile, provider.pid()).await?;
        let outcome = bench.run_all(size, report, args.get_rps).await;
        match provider.memory_kib() {
            Ok((hwm, rss)) => {
                peaks.push((size, hwm));
                report.line(format!(
                    "rss_peak_mib={:.1} rss_now_mib={:.1} size={size}",
                    hwm as f64 / 1024.0,
                    rss as f64 / 1024.0
                ))
            }
            Err(e) => report.line(format!("rss_peak_mib=skipped size={size} reason={e:#}")),
        }
        drop(bench);
        provider.kill().await?;
        outcome.with_context(|| format!("benchmark at size {size}"))?;
    }

    if profile.runs(scenarios::Scenario::UnreadList) {
        match unread::unread_lists(
            &args.provider_bin,
            args.unread_size,
            boot_timeout,
            profile.provider_cpu,
            report,
        )
        .await
        {
            Ok(growth) => unread_growth_kib = Some(growth),
            Err(e) => report.line(format!(
                "unread_list_rss_before_mib=skipped size={} reason=\"{}\"",
                args.unread_size,
                format!("{e:#}").replace(['\n', '"'], " ")
            )),
        }
    }
    memory_goals(&peaks, unread_growth_kib, args.unread_size, report);

    let largest = args.sizes.iter().copied().max().unwrap_or(1000);
    if let Err(e) =
        scenarios::restart_with_state(&args.provider_bin, largest, boot_timeout, profile, report)
            .await
    {
        report.line(format!(
            "restart_state_ms=skipped size={largest} reason=\"{}\"",
            format!("{e:#}").replace(['\n', '"'], " ")
        ));
    }
    Ok(())
}
