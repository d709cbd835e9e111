use std::process::ExitCode;

use clap::Parser;

use bigfleet_proxmox::config::{Args, Command, DEFAULT_LOG_LEVEL};
use bigfleet_proxmox::logging::{self, LogError};
use bigfleet_proxmox::serve::RunError;
use bigfleet_proxmox::state_copy::{self, StateArgs, StateCommand};

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
}

/// The operator client: its errors are for a person at a terminal.
fn ctl(ctl: bigfleet_ctl::CtlArgs) -> ExitCode {
    let runtime = match runtime() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(bigfleet_ctl::run(ctl)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            // 2: the command line needs fixing and nothing was sent.
            ExitCode::from(e.exit_code())
        }
    }
}

/// `state copy`: one summary line on stdout, or one error line on stderr.
fn state(state: StateArgs) -> ExitCode {
    match state.command {
        StateCommand::Copy(copy) => match state_copy::run(&copy) {
            Ok(summary) => {
                println!("{summary}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                // 2: the command line needs fixing and nothing was opened.
                ExitCode::from(e.exit_code())
            }
        },
    }
}

fn main() -> ExitCode {
    bigfleet_proxmox::budget::tune_allocator();
    let mut args = Args::parse();
    match args.command.take() {
        Some(Command::Ctl(args)) => return ctl(args),
        Some(Command::State(args)) => return state(args),
        None => {}
    }
    // A fatal error is one line in the chosen format, like every other:
    // `invalid configuration` before anything starts, `startup failed` once
    // the configuration is valid. The guard is dropped (queued lines
    // flushed) before the process exits.
    let log_guard = match logging::init(args.log_format, &args.log_level) {
        Ok(guard) => guard,
        Err(LogError::Level(e)) => {
            // The level is what is wrong: refuse at the default one.
            match logging::init(args.log_format, DEFAULT_LOG_LEVEL) {
                Ok(guard) => {
                    tracing::error!(error = %e, "invalid configuration");
                    drop(guard);
                }
                Err(_) => eprintln!("error: invalid configuration: {e}"),
            }
            return ExitCode::from(2);
        }
        Err(e @ LogError::Install(_)) => {
            eprintln!("error: startup failed: {e}");
            return ExitCode::from(1);
        }
    };
    // Before any secret is read: a core of this process would hold them.
    if !args.core_dumps {
        if let Err(e) = bigfleet_proxmox::core_dumps::forbid() {
            tracing::error!(error = %format_args!("cannot forbid core files (they would hold the Proxmox token): {e}; pass --core-dumps to serve without this protection"), "startup failed");
            drop(log_guard);
            return ExitCode::from(1);
        }
    }
    let plan = match bigfleet_proxmox::plan(&args) {
        Ok(plan) => plan,
        Err(e) => {
            tracing::error!(error = %e, "invalid configuration");
            drop(log_guard);
            return ExitCode::from(2);
        }
    };
    for warning in bigfleet_proxmox::hygiene::warnings(&args, &plan) {
        tracing::warn!(warning = %warning, "secrets at risk");
    }
    let runtime = match runtime() {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %format_args!("cannot start the async runtime: {e}"), "startup failed");
            drop(log_guard);
            return ExitCode::from(1);
        }
    };
    let result = runtime.block_on(bigfleet_proxmox::serve::run(plan));
    drop(runtime);
    let code = match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e @ RunError::Startup(_)) => {
            tracing::error!(error = %e, "startup failed");
            ExitCode::from(1)
        }
        Err(RunError::Stopped) => {
            tracing::info!("shutdown requested during start-up: stopped before serving");
            ExitCode::SUCCESS
        }
        Err(e @ RunError::Serve(_)) => {
            tracing::error!(error = %e, "stopped on an error");
            ExitCode::from(1)
        }
    };
    drop(log_guard);
    code
}
