use clap::Parser;

use bigfleet_proxmox::config::Args;

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    if let Err(e) = bigfleet_proxmox::logging::init(args.log_format, &args.log_level) {
        eprintln!("error: {e}");
        return std::process::ExitCode::from(2);
    }
    let plan = match bigfleet_proxmox::plan(args) {
        Ok(plan) => plan,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    match runtime.block_on(bigfleet_proxmox::serve::run(plan)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::from(1)
        }
    }
}
