//! The `ctl` command line: global options, subcommands and value parsers.

use std::path::PathBuf;
use std::time::Duration;

use bigfleet_proto::v1alpha1::MachineState;
use clap::{Args, Subcommand, ValueEnum};

/// Operate a running provider: list, inspect and drive machines.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Global options")]
pub struct CtlArgs {
    /// Provider gRPC address: HOST:PORT, or an http:// or https:// URL. A
    /// bare HOST means port 9000, and `:PORT` means 127.0.0.1.
    #[arg(
        long,
        global = true,
        value_name = "ADDR",
        default_value = "127.0.0.1:9000"
    )]
    pub target: String,

    /// CA (PEM) the provider's certificate must chain to; enables TLS.
    #[arg(id = "ctl_tls_ca", long = "tls-ca", global = true, value_name = "PATH")]
    pub tls_ca: Option<PathBuf>,

    /// Client certificate (PEM) for mTLS; needs --tls-key.
    #[arg(
        id = "ctl_tls_cert",
        long = "tls-cert",
        global = true,
        value_name = "PATH"
    )]
    pub tls_cert: Option<PathBuf>,

    /// Client private key (PEM) for mTLS; needs --tls-cert.
    #[arg(
        id = "ctl_tls_key",
        long = "tls-key",
        global = true,
        value_name = "PATH"
    )]
    pub tls_key: Option<PathBuf>,

    /// Name the provider's certificate is checked against (default: the
    /// --target host).
    #[arg(
        id = "ctl_tls_domain",
        long = "tls-domain",
        global = true,
        value_name = "NAME"
    )]
    pub tls_domain: Option<String>,

    /// Connect timeout and per-RPC deadline.
    #[arg(long, global = true, value_name = "DURATION", default_value = "10s", value_parser = parse_positive_duration)]
    pub timeout: Duration,

    /// Output format on stdout.
    #[arg(short = 'o', long, global = true, value_enum, default_value = "table")]
    pub output: Output,

    #[command(subcommand)]
    pub command: CtlCommand,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

#[derive(Subcommand, Debug, Clone)]
pub enum CtlCommand {
    /// List machines, optionally filtered by state.
    List {
        /// Only machines in this state (repeatable or comma list).
        #[arg(long = "state", value_delimiter = ',', value_parser = parse_state)]
        states: Vec<MachineState>,
        /// Only machines in this zone (Proxmox node; repeatable or comma list).
        #[arg(long = "zone", value_delimiter = ',')]
        zones: Vec<String>,
        /// Only machines of this instance type (repeatable or comma list).
        #[arg(long = "type", value_delimiter = ',')]
        types: Vec<String>,
        /// At most this many machines (0 = no cap).
        #[arg(long, value_parser = clap::value_parser!(i32).range(0..))]
        max: Option<i32>,
    },
    /// Counts of machines by state, per zone and instance type, under each
    /// zone's memory room when the provider reports it.
    Summary,
    /// Show one machine.
    Get {
        /// Machine id, as `list` shows it.
        id: String,
    },
    /// SPECULATIVE -> CREATING -> IDLE.
    Create {
        /// Machine id, as `list` shows it.
        id: String,
        #[command(flatten)]
        fence: Fence,
        #[command(flatten)]
        wait: Wait,
    },
    /// IDLE -> CONFIGURING -> CONFIGURED, delivering the bootstrap blob.
    Configure {
        /// Machine id, as `list` shows it.
        id: String,
        /// Cluster the machine joins.
        #[arg(long)]
        cluster: String,
        /// File holding the bootstrap blob ("-" reads stdin); never printed.
        #[arg(long)]
        blob_file: PathBuf,
        /// Shard metadata KEY=VALUE, stored verbatim (repeatable).
        #[arg(long = "metadata", value_parser = parse_key_value)]
        metadata: Vec<(String, String)>,
        #[command(flatten)]
        fence: Fence,
        #[command(flatten)]
        wait: Wait,
    },
    /// CONFIGURED -> DRAINING -> IDLE.
    Drain {
        /// Machine id, as `list` shows it.
        id: String,
        /// Grace period handed to the in-guest drain, in seconds.
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i64).range(0..))]
        grace: i64,
        #[command(flatten)]
        fence: Fence,
        #[command(flatten)]
        wait: Wait,
    },
    /// IDLE -> DELETING -> SPECULATIVE.
    Delete {
        /// Machine id, as `list` shows it.
        id: String,
        #[command(flatten)]
        fence: Fence,
        #[command(flatten)]
        wait: Wait,
    },
    /// FAILED -> SPECULATIVE: destroy the machine's marked VMs and free the
    /// slot (the provider's admin service, not a BigFleet transition).
    Reclaim {
        /// Machine id, as `list` shows it.
        id: String,
        /// Answer once the reclaim has finished, or with why it failed.
        #[arg(long, help_heading = "Waiting")]
        wait: bool,
        /// Give up waiting after this long (the reclaim keeps running).
        #[arg(long, help_heading = "Waiting", default_value = "10m", value_parser = parse_positive_duration)]
        wait_timeout: Duration,
    },
    /// Print one line per observed state change until Ctrl-C or --until.
    Watch {
        /// Machine id, as `list` shows it.
        id: String,
        /// How often to poll.
        #[arg(long, default_value = "500ms", value_parser = parse_positive_duration)]
        interval: Duration,
        /// Stop (exit 0) once the machine is in this state.
        #[arg(long, value_parser = parse_state)]
        until: Option<MachineState>,
    },
}

/// Fencing token; all absent (the default) bypasses fencing.
#[derive(Args, Debug, Clone, Default)]
pub struct Fence {
    /// Shard id of the fencing token.
    #[arg(long, help_heading = "Fencing (default: absent)")]
    pub shard_id: Option<String>,
    /// Shard epoch of the fencing token.
    #[arg(long, requires = "shard_id", help_heading = "Fencing (default: absent)", value_parser = clap::value_parser!(i64).range(0..))]
    pub epoch: Option<i64>,
    /// Sequence number of the fencing token.
    #[arg(long, requires = "shard_id", help_heading = "Fencing (default: absent)", value_parser = clap::value_parser!(i64).range(0..))]
    pub sequence: Option<i64>,
}

impl Fence {
    pub(crate) fn token(&self) -> (String, i64, i64) {
        (
            self.shard_id.clone().unwrap_or_default(),
            self.epoch.unwrap_or(0),
            self.sequence.unwrap_or(0),
        )
    }
}

#[derive(Args, Debug, Clone)]
pub struct Wait {
    /// Poll until the target state (or FAILED), progress on stderr.
    #[arg(long, help_heading = "Waiting")]
    pub wait: bool,
    /// Give up waiting after this long (the transition keeps running).
    #[arg(long, help_heading = "Waiting", default_value = "30m", value_parser = parse_positive_duration)]
    pub wait_timeout: Duration,
    /// How often --wait polls.
    #[arg(long, help_heading = "Waiting", default_value = "500ms", value_parser = parse_positive_duration)]
    pub poll_interval: Duration,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    humantime::parse_duration(text).map_err(|e| format!("invalid duration {text:?}: {e}"))
}

pub(crate) fn parse_positive_duration(text: &str) -> Result<Duration, String> {
    let d = parse_duration(text)?;
    if d.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(d)
}

pub(crate) const STATE_NAMES: &str =
    "SPECULATIVE, CREATING, IDLE, CONFIGURING, CONFIGURED, DRAINING, DELETING, FAILED";

/// Accepts `idle`, `IDLE` or `MACHINE_STATE_IDLE`.
pub fn parse_state(text: &str) -> Result<MachineState, String> {
    let upper = text.trim().to_ascii_uppercase().replace('-', "_");
    let full = if upper.starts_with("MACHINE_STATE_") {
        upper
    } else {
        format!("MACHINE_STATE_{upper}")
    };
    match MachineState::from_str_name(&full) {
        Some(MachineState::Unspecified) | None => Err(format!(
            "unknown machine state {text:?}: expected one of {STATE_NAMES}"
        )),
        Some(state) => Ok(state),
    }
}

pub(crate) fn parse_key_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("{text:?} is not KEY=VALUE with a non-empty KEY")),
    }
}
