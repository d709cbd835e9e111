use clap::Parser;

use bigfleet_proxmox::config::{Args, Command};

fn runtime() -> Result<tokio::runtime::Runtime, std::process::ExitCode> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| {
            eprintln!("error: cannot start the async runtime: {e}");
            std::process::ExitCode::from(1)
        })
}

fn main() -> std::process::ExitCode {
    bigfleet_proxmox::budget::tune_allocator();
    let mut args = Args::parse();
    if let Some(Command::Ctl(ctl)) = args.command.take() {
        let runtime = match runtime() {
            Ok(rt) => rt,
            Err(code) => return code,
        };
        return match runtime.block_on(bigfleet_ctl::run(ctl)) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                std::process::ExitCode::from(1)
            }
        };
    }
    let log_guard = match bigfleet_proxmox::logging::init(args.log_format, &args.log_level) {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    // The guard is dropped (queued log lines flushed) before a final error
    // is printed, so stderr keeps the order things happened in.
    let plan = match bigfleet_proxmox::plan(args) {
        Ok(plan) => plan,
        Err(e) => {
            drop(log_guard);
            eprintln!("error: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let runtime = match runtime() {
        Ok(rt) => rt,
        Err(code) => {
            drop(log_guard);
            return code;
        }
    };
    let result = runtime.block_on(bigfleet_proxmox::serve::run(plan));
    drop(runtime);
    drop(log_guard);
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::from(1)
        }
    }
}
