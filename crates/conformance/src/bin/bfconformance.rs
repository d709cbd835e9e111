//! `bfconformance`: certifies a bigfleet.v1alpha1.CapacityProvider endpoint against the
//! baseline and the 93-behavior extension registry.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::Parser;
use conformance::harness::TlsOpts;
use conformance::report::{Status, Verdict};
use conformance::runner::{run, RunConfig, Target};

#[derive(Parser, Debug)]
#[command(
    name = "bfconformance",
    about = "Black-box certification runner for CapacityProvider endpoints"
)]
struct Cli {
    /// Boot this provider credential-free (`proxmox`: --use-fake-backend) and certify it.
    #[arg(long, conflicts_with = "target")]
    provider: Option<String>,
    /// Provider binary (default: bin/proxmox, else target/debug/bigfleet-proxmox,
    /// else $CARGO_TARGET_DIR/debug/bigfleet-proxmox).
    #[arg(long)]
    provider_bin: Option<PathBuf>,
    /// Extra flag passed to the booted provider (repeatable).
    #[arg(long = "provider-arg", allow_hyphen_values = true)]
    provider_args: Vec<String>,
    /// Certify an already running endpoint (host:port).
    #[arg(long)]
    target: Option<String>,
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    #[arg(long)]
    tls_cert: Option<PathBuf>,
    #[arg(long)]
    tls_key: Option<PathBuf>,
    #[arg(long)]
    tls_domain: Option<String>,
    /// Claimed profiles / lanes: core,cloud,spot,fault,durable,scale.
    #[arg(long, value_delimiter = ',', default_value = "core,cloud")]
    profile: Vec<String>,
    /// Capabilities the endpoint claims (a probe miss then FAILS instead of skipping).
    /// Defaults to Delete,SinceRevision for --provider proxmox.
    #[arg(long, value_delimiter = ',')]
    expect_cap: Vec<String>,
    #[arg(long, default_value_t = 256)]
    seed_count: usize,
    #[arg(long, default_value_t = 10_000)]
    scale_count: usize,
    /// Soak duration of the scale lane.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    soak: Duration,
    /// RNG seed; a run is replayed identically with the same seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Directory for report.json, junit.xml and provider logs.
    #[arg(long)]
    out: Option<PathBuf>,
    #[arg(long)]
    fail_fast: bool,
    /// Stop at the first failing behavior; print the certification line on success.
    #[arg(long)]
    certify: bool,
    /// Fault-injecting provider binary for the fault lane (default: next to this binary).
    #[arg(long)]
    fault_bin: Option<PathBuf>,
    /// Only run these behavior ids (debugging; never certifies).
    #[arg(long, value_delimiter = ',')]
    only: Option<Vec<String>>,
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// The durable lane's provider --state, e.g. a postgres:// URL of an empty
    /// database (default: a fresh state.json in a temporary directory).
    #[arg(long)]
    durable_state: Option<String>,
    #[arg(short, long)]
    verbose: bool,
}

fn default_provider_bin() -> Option<PathBuf> {
    let mut c = vec![
        PathBuf::from("bin/proxmox"),
        PathBuf::from("target/debug/bigfleet-proxmox"),
    ];
    if let Ok(t) = std::env::var("CARGO_TARGET_DIR") {
        c.push(PathBuf::from(t).join("debug/bigfleet-proxmox"));
    }
    c.into_iter().find(|p| p.is_file())
}

async fn main_inner(cli: Cli) -> anyhow::Result<bool> {
    let seed = cli.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    for p in &cli.profile {
        if !conformance::registry::PROFILES.contains(&p.as_str()) {
            bail!(
                "unknown profile {p:?} (known: {})",
                conformance::registry::PROFILES.join(",")
            );
        }
    }
    let mut cfg = RunConfig::new(cli.profile.clone(), seed);
    cfg.fail_fast = cli.fail_fast || cli.certify;
    cfg.concurrency = cli.concurrency;
    cfg.seed_count = cli.seed_count;
    cfg.scale_count = cli.scale_count;
    cfg.soak = cli.soak;
    cfg.fault_bin = cli.fault_bin.clone();
    cfg.only = cli.only.clone();
    cfg.verbose = cli.verbose;
    cfg.durable_state = cli.durable_state.clone();
    cfg.expect_caps = cli.expect_cap.clone();
    // A flag given with --provider-arg replaces the runner's default for it.
    let mut defaults = std::mem::take(&mut cfg.provider_args)
        .into_iter()
        .peekable();
    while let Some(a) = defaults.next() {
        let has_value = defaults.peek().is_some_and(|v| !v.starts_with("--"));
        let value = if has_value { defaults.next() } else { None };
        if !cli
            .provider_args
            .iter()
            .any(|u| u == &a || u.starts_with(&format!("{a}=")))
        {
            cfg.provider_args.push(a);
            cfg.provider_args.extend(value);
        }
    }
    cfg.provider_args.extend(cli.provider_args.iter().cloned());
    cfg.provider_bin = cli.provider_bin.clone().or_else(default_provider_bin);
    match (&cli.provider, &cli.target) {
        (Some(p), None) => {
            if p != "proxmox" {
                bail!("unknown --provider {p:?} (known: proxmox)");
            }
            if cfg.provider_bin.is_none() {
                bail!("no provider binary: pass --provider-bin (looked for bin/proxmox and target/debug/bigfleet-proxmox)");
            }
            if cfg.expect_caps.is_empty() {
                cfg.expect_caps = vec!["Delete".into(), "SinceRevision".into()];
            }
            cfg.target = Target::Spawn;
        }
        (None, Some(addr)) => {
            let tls = if cli.tls_ca.is_some() || cli.tls_cert.is_some() || cli.tls_domain.is_some()
            {
                Some(TlsOpts {
                    ca: cli.tls_ca.clone(),
                    cert: cli.tls_cert.clone(),
                    key: cli.tls_key.clone(),
                    domain: cli.tls_domain.clone(),
                })
            } else {
                None
            };
            cfg.target = Target::Addr {
                addr: addr.clone(),
                tls,
            };
        }
        _ => bail!("pass exactly one of --provider proxmox or --target ADDR"),
    }
    let out = cli.out.clone();
    let logs = match &out {
        Some(o) => o.clone(),
        None => std::env::temp_dir().join(format!("bfconformance-{}", std::process::id())),
    };
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    cfg.log_dir = logs;
    // On SIGINT/SIGTERM the run future is dropped, which kills every provider it owns.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing SIGTERM handler")?;
    let report = tokio::select! {
        r = run(cfg) => r?,
        _ = tokio::signal::ctrl_c() => bail!("interrupted; providers torn down"),
        _ = term.recv() => bail!("terminated; providers torn down"),
    };
    if let Some(o) = &out {
        report.write(o)?;
        println!(
            "wrote {} and {}",
            o.join("report.json").display(),
            o.join("junit.xml").display()
        );
    }
    for id in &report.unimplemented {
        println!("UNIMPLEMENTED {id}");
    }
    let s = &report.summary;
    println!(
        "summary: {} passed, {} failed, {} skipped (baseline {} tests) — seed {}",
        s.get("passed").unwrap_or(&0),
        s.get("failed").unwrap_or(&0),
        s.get("skipped").unwrap_or(&0),
        report.baseline.len(),
        report.seed
    );
    println!(
        "VERDICT: {}",
        match report.verdict {
            Verdict::Certified => "CERTIFIED",
            Verdict::Failed => "FAILED",
            Verdict::Incomplete => "INCOMPLETE",
        }
    );
    let ok = report.verdict == Verdict::Certified;
    if cli.certify {
        if ok {
            let upstream_ran = report.baseline.contains_key(conformance::upstream::RECORD);
            println!("{}", conformance::upstream::certified_line(upstream_ran));
        } else if let Some((id, r)) = report
            .baseline
            .iter()
            .chain(report.behaviors.iter())
            .find(|(_, r)| r.required && r.status == Status::Failed)
        {
            eprintln!("certification failed at {id}: {}", r.message);
        }
    }
    Ok(ok)
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().collect();
    let boot_check = match argv.as_slice() {
        [_, sub, json] if sub == conformance::boot::SUBCOMMAND => Some(json.clone()),
        _ => None,
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("bfconformance: cannot start the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(json) = boot_check {
        return if rt.block_on(conformance::boot::subcommand(&json)) {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    let cli = Cli::parse();
    match rt.block_on(main_inner(cli)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("bfconformance: {e:#}");
            ExitCode::from(2)
        }
    }
}
