//! Run the Proxmox VE API simulator standalone.

use anyhow::{Context, Result};
use pve_sim::PveSim;

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour only for a person at a terminal, never into a log file.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    // Flags and the `--config` file are read by the library (`pve_sim::cli`),
    // where they are documented and tested; a bad one exits with clap's
    // usage error (code 2), as a misspelt flag does.
    // `args_os`: `args` panics on an argument that is not UTF-8.
    let argv: Vec<String> = std::env::args_os()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let a = pve_sim::cli::parse(&argv).unwrap_or_else(|e| e.exit());
    let cfg = a.config;
    let sim = PveSim::start(cfg).await?;
    tracing::info!(guest_agent = %sim.guest_agent_description(), "guest agent active");
    if a.seed_marked_vms > 0 {
        sim.seed_marked_vms(a.seed_marked_vms)?;
    }
    if let Some(p) = &a.ca_out {
        sim.write_ca(p)?;
    }
    // This is a test tool: printing the token lets users point a client at it.
    println!("base_url: {}", sim.base_url());
    println!("token_id: {}", sim.token_id());
    println!("token_secret: {}", sim.token_secret());
    match &a.ca_out {
        Some(p) => println!("ca_file: {}", p.display()),
        None => println!("ca_file: (not written; use --ca-out)"),
    }
    println!("fingerprint: {}", sim.fingerprint());
    println!("guest_agent: {}", sim.guest_agent_description());
    println!("schema: {}", sim.schema_source());
    let c = sim.config();
    println!(
        "realism: rrd_lag={:?} pve_http_server={} body_limit={} description_newline={} \
         tag_style={:?} agent_latin1={} form_semicolon_separator={}",
        c.rrd_lag,
        c.http_server_version,
        c.effective_body_limit(),
        c.description_newline,
        c.tag_style,
        c.agent_latin1,
        c.form_semicolon_separator
    );
    println!(
        "admin: POST {}/_sim/faults etc.",
        sim.base_url().trim_end_matches("/api2/json")
    );
    // SIGTERM too (what `kill` and process managers send): shutting down
    // stops every VM and with it each VM's qemu-ga.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("waiting for Ctrl-C")?,
        _ = term.recv() => {}
    }
    sim.shutdown().await;
    Ok(())
}
